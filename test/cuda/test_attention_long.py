"""Attention at long sequences (up to a million tokens and past), without running one:

- every index product in the attention kernels (CUDA flash and tensor-core, CPU) is 64-bit, proven
  by a source scan (int_products.py) that fails on planted 32-bit products;
- the tensor-core path's tiles and workspace (llmc/memory/cuda_workspace.h) at the Llama-3.1-8B
  shape (32 heads, 8 kv heads, head dim 128, batch 1) against a hand count: bounded S and P at any
  length, no buffer growing with T x T, the pointer tables in the plan;
- that path on the emulator (dev/cuda/attention.cu): whole keys and key blocks against the CPU
  twin at aligned and misaligned sizes, and no pointer table built by a repeated call.

An actual run past 2^31 / (H*hd) tokens does not fit the emulator (the T x T work at T = 2^24 with
H*hd = 128 is 10^14 multiply-adds), hence the scan.
"""
import os
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import int_products  # noqa: E402

SOURCES = ["llmc/cuda/attention.cuh", "llmc/cuda/attention_gemm.cuh", "llmc/cpu/attention.h",
           "llmc/memory/cuda_workspace.h"]
EMU_ATTENTION = os.path.join(REPO, "build/emu/attention")
NVCC = shutil.which("nvcc")
CUDA_INC = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(NVCC))), "include") if NVCC else None
HAVE_CUDA_HEADERS = bool(CUDA_INC) and os.path.isfile(os.path.join(CUDA_INC, "cuda_bf16.h"))


def read(path):
    with open(os.path.join(REPO, path)) as f:
        return f.read()


@pytest.mark.parametrize("path", SOURCES)
def test_attention_index_products_are_64_bit(path):
    found = int_products.scan(read(path))
    assert not found, f"{path}: int x int products (cast a factor to int64_t, or say `// int: why` it stays small):\n" + \
        "\n".join(f"  line {n}: {text}" for n, text in found)


# (file, a 64-bit index expression there, the same with its cast dropped)
PLANTED = [
    ("llmc/cuda/attention_gemm.cuh", "float* L = lse + (((int64_t)b * s.H + h) * s.T + i);",
     "float* L = lse + ((b * s.H + h) * s.T + i);"),
    ("llmc/cuda/attention_gemm.cuh", "out[((int64_t)b * s.T + i) * s.H * s.hd + (int64_t)h * s.hd + d] = f2bf(x);",
     "out[(b * s.T + i) * s.H * s.hd + h * s.hd + d] = f2bf(x);"),
    ("llmc/cuda/attention.cuh", "src[((int64_t)b * s.T + t) * nheads * s.hd", "src[(b * s.T + t) * nheads * s.hd"),
    ("llmc/cuda/attention.cuh", "if (sub == 0) lse[((int64_t)b * s.H + h) * s.T + t] = m + logf(l);",
     "if (sub == 0) lse[(b * s.H + h) * s.T + t] = m + logf(l);"),
    ("llmc/cpu/attention.h", "int64_t r0 = ((int64_t)b * s.T + t0) * qs + (int64_t)h * s.hd, bh",
     "int64_t r0 = (b * s.T + t0) * qs + (int64_t)h * s.hd, bh"),
    ("llmc/memory/cuda_workspace.h", "int64_t e = (int64_t)s->B * s->H, T = s->T > 0 ? s->T : 1;",
     "int64_t e = s->B * s->H, T = s->T > 0 ? s->T : 1;"),
]


@pytest.mark.parametrize("path,good,bad", PLANTED, ids=[f"{p.split('/')[-1]}:{i}" for i, (p, _, _) in enumerate(PLANTED)])
def test_planted_int_product_is_caught(path, good, bad):
    src = read(path)
    assert src.count(good) == 1, f"the line to plant in is gone from {path}: {good}"
    found = int_products.scan(src.replace(good, bad))
    assert any(bad.strip() in text or text in bad for _, text in found), found


PROBE = r'''
#include "llmc/memory/cuda_workspace.h"
#include <stdio.h>
int main(int argc, char** argv) {
    AttnShape s = {atoi(argv[1]), atoi(argv[2]), atoi(argv[3]), atoi(argv[4]), atoi(argv[5]), 1, NULL, NULL,
                   argc > 6 ? atoi(argv[6]) : 0, 0.0f, argc > 7 ? (float)atof(argv[7]) : 0.0f};
    AttnTiles t = attn_gemm_tiles(&s);
    AttnWorkParts w = attn_gemm_work_parts(&s);
    printf("rows=%d keys=%d row_chunks=%lld key_blocks=%lld slots=%d S=%zu P=%zu o32=%zu ml=%zu tables=%zu "
           "dk32=%zu dv32=%zu D=%zu G=%zu total=%zu\n", t.rows, t.keys, (long long)t.row_chunks,
           (long long)t.key_blocks, attn_table_slots(&s, &t), w.S, w.P, w.o32, w.ml, w.tables, w.dk32, w.dv32, w.D, w.G,
           attn_gemm_work_bytes(&s, 1));
    return 0;
}
'''


@pytest.fixture(scope="module")
def plan_probe(tmp_path_factory):
    d = tmp_path_factory.mktemp("attn_plan")
    (d / "probe.c").write_text(PROBE)
    exe = d / "probe"
    b = subprocess.run(["g++", "-O0", "-std=gnu++17", "-x", "c++", "-w", f"-I{REPO}", str(d / "probe.c"), "-o", str(exe),
                        "-lm"], capture_output=True, text=True, timeout=300)
    assert b.returncode == 0, b.stderr[-3000:]

    def run(T, B=1, H=32, KVH=8, hd=128, env=None, window=0, softcap=0.0):
        p = subprocess.run([str(exe), str(B), str(T), str(H), str(KVH), str(hd), str(window), repr(softcap)],
                           capture_output=True, text=True,
                           env=dict(os.environ, **(env or {})), timeout=60)
        assert p.returncode == 0, p.stderr
        return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", p.stdout)}
    return run


def up(x):
    return (x + 255) // 256 * 256


def test_plan_whole_keys_at_4096(plan_probe):
    # E = 32 entries; rows = 128 MiB / (32 * 4096 * 6) = 170 -> 128 (a multiple of 64); all 4096 keys
    got = plan_probe(4096)
    assert (got["rows"], got["keys"], got["row_chunks"], got["key_blocks"]) == (128, 4096, 32, 1)
    tile = 32 * 128 * 4096
    entries = 32 * (4 * 32 + 4 * 1 + 4)  # per slot: 4 row operands x 32 chunks, 4 key operands x 1, 4 tile buffers
    assert got["slots"] == 64  # 64 x 34,816 bytes is far below 128 MiB
    assert got["S"] == tile * 4 and got["P"] == tile * 2 and got["o32"] == 0 and got["ml"] == 0
    assert got["tables"] == up(64 * entries * 8)
    assert got["dk32"] == got["dv32"] == 4096 * 8 * 128 * 4  # the whole sequence's fp32 sums (one pass)
    assert got["D"] == 32 * 4096 * 4
    assert got["total"] == sum(got[k] for k in ("S", "P", "o32", "ml", "tables", "dk32", "dv32", "D"))


@pytest.mark.parametrize("T", [131072, 1 << 20, 2_000_000])
def test_plan_key_blocks_bounded(plan_probe, T):
    # side: the largest multiple of 64 with 32 * side^2 * 6 <= 128 MiB: 832^2 * 192 = 132.9 MB <= 134.2 MB,
    # 896^2 * 192 = 154.1 MB > it
    got = plan_probe(T)
    chunks = -(-T // 832)
    assert (got["rows"], got["keys"], got["row_chunks"], got["key_blocks"]) == (832, 832, chunks, chunks)
    tile = 32 * 832 * 832
    assert got["S"] == up(tile * 4) and got["P"] == up(tile * 2)  # 88.6 MB + 44.3 MB at every length
    assert got["o32"] == up(32 * 832 * 128 * 4) and got["ml"] == up(32 * 832 * 2 * 4)
    per_slot = 32 * (8 * chunks + 4) * 8
    slots = min(64, max(2, (128 << 20) // (per_slot + 1)))
    assert got["slots"] == slots and got["tables"] == up(slots * per_slot)
    assert got["dk32"] == got["dv32"] == up(832 * 8 * 128 * 4)  # one key block's sums (two-pass backward)
    assert got["D"] == up(32 * T * 4)
    # what grows with T: the row sums D (128 B/token) and the pointer tables (at most 128 MiB)
    fixed = got["S"] + got["P"] + got["o32"] + got["ml"] + got["dk32"] + got["dv32"]
    assert got["total"] - fixed <= 32 * 4 * T + (128 << 20) + 256


def test_plan_old_rule_still_selectable(plan_probe):
    # LLMC_ATTN_KEY_BLOCKS=0: rows = 128 MiB / (32 * 131072 * 6) = 5, all keys, dk/dv summed for the whole sequence
    got = plan_probe(131072, env={"LLMC_ATTN_KEY_BLOCKS": "0"})
    assert (got["rows"], got["keys"], got["key_blocks"]) == (5, 131072, 1)
    assert got["dk32"] == 131072 * 1024 * 4
    # a table slot: 32 x (4 x 26,215 + 4 + 4) pointers = 26.8 MB; 5 of them pass 128 MiB
    assert got["slots"] == 4 and got["tables"] == up(4 * 32 * (4 * 26215 + 8) * 8)


@pytest.mark.skipif(not HAVE_CUDA_HEADERS, reason="no CUDA toolkit headers: the emulator is not built")
def test_gemm_attention_on_the_emulator():
    """dev/cuda/attention.cu: the flash and tensor-core kernels against the CPU twin (tolerances
    derived there), the tensor-core path also in key blocks (LLMC_ATTN_KEYS) with rows per chunk
    unequal to keys per block, ragged T, hd 16..128, GQA, packed examples; repeated calls build no
    pointer table and give the same bits."""
    if not os.path.isfile(EMU_ATTENTION):
        pytest.fail(f"{EMU_ATTENTION} is missing: build it with `make build/emu/attention`")
    p = subprocess.run([EMU_ATTENTION], capture_output=True, text=True, timeout=600, cwd=REPO,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert re.search(r"\b0 failed", out), out[-3000:]
    blocks = out.split("with LLMC_ATTN_KEYS=16 LLMC_ATTN_CHUNK=24:")[1]
    for what in ("attn gemm fwd o", "attn gemm fwd lse", "attn gemm bwd dq", "attn gemm bwd dk", "attn gemm bwd dv",
                 "attn gemm pointer tables built once (0 new builds)"):
        assert f"PASS  {what}" in blocks, what
    assert "causal packed" in blocks and "bidir" in blocks and "hd=36" in blocks


def test_gemm_attention_makes_no_host_arrays_or_copies():
    """The tensor-core path's calls issue device work only: its pointer tables are built by a
    kernel (attn_table_kernel), so no host allocation and no host-to-device copy is left in it
    (the emulator's counter of table builds is checked in test_gemm_attention_on_the_emulator)."""
    src, _ = int_products.strip(read("llmc/cuda/attention_gemm.cuh"))
    for call in ("cudaMemcpy", "malloc(", "xmalloc", "cudaStreamSynchronize", "cudaDeviceSynchronize"):
        assert call not in src, call
    assert "launch_kernel(grid_for(slot.entries, 256), 256, 0, st, attn_table_kernel" in src


@pytest.mark.parametrize("T", [16384, 131072])
def test_plan_sliding_window_tiles_follow_the_window(plan_probe, T):
    # a 512-key window at the Llama-3.1-8B shape: square tiles of 512 (the window rounded up to 64,
    # within the 832 the budget allows), so a chunk of 512 rows sees at most 2 key blocks and the
    # tiles (S, P) are the same at every length; a 4096-key window is held to the budget's 832
    got = plan_probe(T, window=512)
    assert (got["rows"], got["keys"], got["key_blocks"]) == (512, 512, T // 512)
    assert got["S"] == up(32 * 512 * 512 * 4) and got["P"] == up(32 * 512 * 512 * 2) and got["G"] == 0
    wide = plan_probe(T, window=4096)
    assert (wide["rows"], wide["keys"]) == (832, 832)
    # soft-capping keeps the cap's derivative per score of a tile: one more fp32 tile
    capped = plan_probe(T, window=512, softcap=50.0)
    assert capped["G"] == got["S"] and capped["total"] == got["total"] + got["S"]
