"""--dry-run --max-seq (issue 24): the longest --seq whose plan fits a memory budget, found by
planning, checked against a direct search over plain dry runs and against the fit check of a real
run; and the plan's bytes per token at the Llama-3.1-8B shape against a hand count, category by
category, so that a change of the plan nobody meant fails here. Config fixtures (config.json
alone, no weights: a dry run reads none) live in test/fixtures."""
import json
import os
import subprocess

import pytest

from llama_cases import auto_smallest_tile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(REPO, "train_llama")
FIXTURES = os.path.join(REPO, "test", "fixtures")
LLAMA31_8B = os.path.join(FIXTURES, "llama31_8b")
DEMO = os.path.join(REPO, "data", "llama_demo")
DEMO_TRAIN = os.path.join(REPO, "data", "llama_demo_ft_train.bin")
GIB = 2**30
# the best memory flags of the table: lowmem's layers, recomputed blocks, checkpoints on the host
BEST = ("--mode", "lowmem", "--recompute", "block", "--offload", "host")


def run(args, env=None, check=True):
    if not os.path.exists(BIN):
        pytest.fail(f"{BIN} is missing: build it with `make train_llama`")
    p = subprocess.run([BIN] + [str(a) for a in args], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
    if check:
        assert p.returncode == 0, p.stderr
    return p


def plan(model, *flags, env=None):
    return json.loads(run(["--model", model, "--dry-run", "--json", *flags], env=env).stdout)


def direct_search(fits, hi):
    """The largest seq in [1, hi) with fits(seq), by doubling then bisection, each step one plain
    dry run (written apart from the trainer's search, which starts from the top)."""
    lo = 0
    step = 1
    while step < hi and fits(step):
        lo, step = step, 2 * step
    top = min(step, hi)  # !fits(top) unless top == hi
    while top - lo > 1:
        mid = (lo + top) // 2
        if fits(mid):
            lo = mid
        else:
            top = mid
    return lo


@pytest.mark.parametrize("gib,quant", [(24, "nf4"), (48, "none")])
def test_max_seq_of_the_cuda_plan_equals_a_direct_search(gib, quant):
    """Llama-3.1-8B, LoRA r16, batch 1, the best memory flags, planned for a card of `gib` GiB:
    --max-seq's answer is what a search over plain dry runs for that card (--gpu-mem: --mlp-tile
    auto fits its tile to it) finds; its plan fits (total_bytes, the device's, within gib GiB) and
    one token more does not; the pinned host bytes it reports are those of the plain plan at that
    length."""
    flags = ("--batch", 1, "--lora-rank", 16, "--quant", quant, *BEST)
    budget = gib * GIB
    got = plan(LLAMA31_8B, *flags, "--max-seq", "--gpu-mem", gib)
    seq = got["max_seq"]
    assert got["seq"] == seq and got["memory_bytes"] == budget and got["fits"] is True
    assert got["memory_source"] == f"--gpu-mem {gib}" and got["max_seq_bound"] == 0

    def fits(s):
        return plan(LLAMA31_8B, *flags, "--seq", s, "--gpu-mem", gib)["total_bytes"] <= budget

    if quant == "nf4":  # one direct search (about 50 plans) is enough; the other case checks the boundary alone
        assert direct_search(fits, 1 << 30) == seq
    at, past = plan(LLAMA31_8B, *flags, "--seq", seq, "--gpu-mem", gib), plan(LLAMA31_8B, *flags, "--seq", seq + 1,
                                                                              "--gpu-mem", gib)
    assert at["total_bytes"] <= budget < past["total_bytes"]
    assert at["fits"] is True and past["fits"] is False
    assert got["total_bytes"] == at["total_bytes"] and got["host_bytes"] == at["host_bytes"] > 0
    print(f"Llama-3.1-8B {quant} on {gib} GiB: max seq {seq}, host {at['host_bytes'] / GIB:.1f} GiB")


def test_max_seq_with_seq_parallel_equals_a_direct_search_over_multiples_of_p():
    """--ranks 8 --seq-parallel 4: --max-seq plans one rank's share (a quarter of each sequence)
    and searches --seq over multiples of 4 (seqpar_check refuses others): its answer is what a
    direct search over plain dry runs of multiples of 4 finds, 4 tokens more do not fit, and the
    pinned host bytes it reports are one rank's checkpoints, by hand: 32 layers x seq / 4 tokens x
    2d bytes. The given --seq (not a multiple of 4 here) does not matter; P that does not divide
    the heads is still refused in one line."""
    P, gib = 4, 24
    flags = ("--batch", 1, "--lora-rank", 16, "--quant", "nf4", *BEST, "--ranks", 8, "--seq-parallel", P)
    budget = gib * GIB
    got = plan(LLAMA31_8B, *flags, "--max-seq", "--gpu-mem", gib, "--seq", 1001)
    seq = got["max_seq"]
    assert got["seq"] == seq and seq % P == 0 and got["fits"] is True and got["max_seq_bound"] == 0

    def fits(j):
        return plan(LLAMA31_8B, *flags, "--seq", P * j, "--gpu-mem", gib)["total_bytes"] <= budget

    assert P * direct_search(fits, (1 << 30) // P) == seq
    at = plan(LLAMA31_8B, *flags, "--seq", seq, "--gpu-mem", gib)
    past = plan(LLAMA31_8B, *flags, "--seq", seq + P, "--gpu-mem", gib)
    assert at["total_bytes"] <= budget < past["total_bytes"] and past["fits"] is False
    assert got["total_bytes"] == at["total_bytes"] and got["host_bytes"] == at["host_bytes"] == 32 * (seq // P) * 2 * 4096
    text = run(["--model", LLAMA31_8B, "--dry-run", "--max-seq", "--gpu-mem", gib, *flags]).stdout
    assert (f"at batch 1: {seq} tokens ({seq // P} on each of its {P} ranks) (" in text and
            f"{at['host_bytes'] / GIB:.2f} GiB of pinned host memory per rank" in text), text
    p = run(["--model", LLAMA31_8B, "--dry-run", "--max-seq", "--gpu-mem", gib, "--ranks", 3, "--seq-parallel", 3],
            check=False)
    assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "flag --seq-parallel: 3 does not divide the model's 32 attention heads" in p.stderr, p.stderr
    print(f"Llama-3.1-8B nf4, 8 ranks, --seq-parallel {P}, {gib} GiB each: max seq {seq}, "
          f"host {at['host_bytes'] / GIB:.1f} GiB per rank")


def test_max_seq_of_the_cpu_plan_is_what_the_runs_fit_check_allows():
    """--device cpu plans against the host's MemAvailable (here LLMC_HOST_MEMORY_BYTES, as the CPU
    fit check): the found --seq trains (the fit check passes), one token more is refused by the
    fit check in one line before anything is allocated; the run prints the MLP tile its --mlp-tile
    auto took, the one --max-seq planned. A plain CPU dry run has no memory to fit
    --mlp-tile auto to, so the plans here name the tile: the one --max-seq reports at its length,
    and one token more does not fit even in auto's smallest tile (test_mlp_tile.auto_smallest_tile)."""
    budget = 50_000_000  # a length past 2 x auto's smallest tile (AUTO_MIN), so that the run tiles
    env = {"LLMC_HOST_MEMORY_BYTES": str(budget)}
    # --recompute none: a run's default would otherwise recompute blocks where one token more does not fit
    flags = ("--device", "cpu", "--batch", 1, "--lora-rank", 2, "--mode", "lowmem", "--recompute", "none")
    got = plan(DEMO, *flags, "--max-seq", env=env)
    seq = got["max_seq"]
    assert got["memory_source"] == "LLMC_HOST_MEMORY_BYTES" and got["memory_bytes"] == budget
    at = plan(DEMO, *flags, "--seq", seq, "--mlp-tile", got["mlp_tile"])
    past = plan(DEMO, *flags, "--seq", seq + 1, "--mlp-tile", auto_smallest_tile(seq + 1))
    assert got["total_bytes"] == at["total_bytes"]
    # on the CPU the host arena is host memory like the rest (fit_check_plan counts both)
    assert at["total_bytes"] + at["host_bytes"] <= budget < past["total_bytes"] + past["host_bytes"]
    train = ["--model", DEMO, "--data", DEMO_TRAIN, "--steps", 0, *flags]
    ok = run([*train, "--seq", seq], env=env)
    assert "memory: planned" in ok.stdout
    tile = got["mlp_tile"]  # the run's auto fits the same memory, so it takes the tile the dry run planned
    assert tile < seq and f"mlp tile: {tile} of {seq} tokens ({-(-seq // tile)} tiles; auto: " in ok.stdout, ok.stdout
    refused = run([*train, "--seq", seq + 1], env=env, check=False)
    assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "the memory plan needs" in refused.stderr and "LLMC_HOST_MEMORY_BYTES" in refused.stderr


def test_max_seq_human_output_and_limits(tmp_path):
    """The human report names the budget, its source and the length; a budget nothing fits is one
    line; a sliding window does not bound the search."""
    text = run(["--model", LLAMA31_8B, "--dry-run", "--max-seq", "--gpu-mem", 24, "--batch", 1, "--lora-rank", 16,
                "--quant", "nf4", *BEST]).stdout
    seq = plan(LLAMA31_8B, "--max-seq", "--gpu-mem", 24, "--batch", 1, "--lora-rank", 16, "--quant", "nf4",
               *BEST)["max_seq"]
    got = plan(LLAMA31_8B, "--seq", seq, "--batch", 1, "--lora-rank", 16, "--quant", "nf4", *BEST)
    pinned = f"{got['host_bytes'] / GIB:.2f} GiB of pinned host memory"
    assert f"longest --seq that fits 24.00 GiB (--gpu-mem 24) at batch 1: {seq} tokens (" in text, text
    assert pinned in text.splitlines()[1], text
    assert f"batch 1 x seq {seq}" in text and "pinned host memory:" in text
    p = run(["--model", LLAMA31_8B, "--dry-run", "--max-seq", "--gpu-mem", 8, "--batch", 1], check=False)
    assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1
    assert "flag --max-seq: not even --seq 1 fits 8.00 GiB (--gpu-mem 8)" in p.stderr, p.stderr
    # a sliding window no longer bounds the search (attention implements it): the memory does, and
    # a windowed model's attention scratch (key blocks about the window long) fits at least as long
    # a sequence as the same model without the window
    cfg = json.load(open(os.path.join(DEMO, "config.json")))
    cfg.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=64)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    got = plan(tmp_path, "--max-seq", "--gpu-mem", 1, "--batch", 1, "--lora-rank", 2)
    full = plan(DEMO, "--max-seq", "--gpu-mem", 1, "--batch", 1, "--lora-rank", 2)
    assert got["max_seq"] > 64 and got["max_seq_bound"] == 0 and got["max_seq"] >= full["max_seq"], (got, full)


def test_max_seq_of_the_cuda_plan_without_gpu_mem_takes_the_gpu_present():
    """Without --gpu-mem the CUDA plan is for the GPU present (its free memory, as a run's fit
    check); where there is none (no GPU, or a build without the CUDA backend), one line asks for
    --gpu-mem or --device cpu."""
    p = run(["--model", LLAMA31_8B, "--dry-run", "--json", "--max-seq", "--batch", 1, "--quant", "nf4", *BEST],
            check=False)
    if p.returncode == 0:
        got = json.loads(p.stdout)
        assert got["memory_source"] == "free on GPU 0" and got["fits"] is True and got["max_seq"] >= 1
    else:
        assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert "flag --max-seq: no CUDA GPU here to plan for; give --gpu-mem GIB" in p.stderr, p.stderr
        assert "--device cpu" in p.stderr


# ---- bytes per token at the Llama-3.1-8B shape, by hand ---------------------------------------

D, F, H, KVH, HD, V, LAYERS, R = 4096, 14336, 32, 8, 128, 128256, 32, 16
QD, KVD = H * HD, KVH * HD
N = 4096  # batch 1 x seq 4096: above the loss chunk, so the fixed buffers are fixed
A = 2     # the CUDA plan: bf16 activations, fp32 statistics (1/rms, lse)

# saved per token per block, each mode (docs/memory.md's table); LoRA's A x on 7 linears, 2r each
ATTENTION = 4 + 2 * D + 2 * QD + 2 * KVD + 2 * KVD + 2 * QD + 4 * H  # r1, z1, q, k, v, o, lse
LORA_AX = 7 * 2 * R
SAVED_BASELINE = {"attn_norm": 2 * D + 4, "qkv_input": 2 * D, "attention": 2 * QD + 4 * KVD + 2 * QD + 4 * H,
                  "lora": LORA_AX, "mlp_norm": 2 * D + 4, "gate_up_input": 2 * D, "silu": 2 * F,
                  "swiglu_product": 4 * F, "down_input": 2 * F}
# MS norms keep r and z, not their input; ReSiLU2 keeps ceil(f/4) bytes of 2-bit codes, not g
SAVED_LOWMEM = dict(SAVED_BASELINE, attn_norm=4, mlp_norm=4, silu=F // 4)
# the recomputed block's scratch set: what the mode keeps (the ckpt preset: baseline's, less the
# attention norm's input, which the checkpoint is)
BLOCK_SET = {"lowmem": sum(SAVED_LOWMEM.values()), "ckpt": sum(SAVED_BASELINE.values()) - 2 * D}
# activation gradients: dres [d]; dq [qd]; dk, dv [kvd]; dp, dg, du [f]; dax [r]. dz [d] lives in resid's
# buffer (the residual stream is dead once the head has read it), and dout [qd] in dz's (qd = d here,
# no q/k norms): their lives in a block's backward do not overlap
GRADS = 2 * D + 2 * QD + 2 * KVD + 2 * KVD + 3 * 2 * F + 2 * R
# the LM head's chunk, per row: z, r, logits, dz, dlogits, row stats (3 fp32); and 4 double stats
LOSS_ROW = 2 * D + 4 + 4 * V + 2 * D + 2 * V + 12
LOSS_FIXED = 32
OLD_CHUNK = (64 << 20) // (V * 4)  # LLMC_HEAD_CHUNK=old: 64 MiB of fp32 logits


def loss_arena_bytes(chunk):
    """The loss buffers in the scratch arena, each rounded up to the plan's 64 bytes."""
    sizes = [chunk * 2 * D, chunk * 4, chunk * 4 * V, chunk * 2 * D, chunk * 2 * V, chunk * 12, LOSS_FIXED]
    return sum(-(-b // 64) * 64 for b in sizes)


def planned_chunk(tokens):
    """docs/memory.md's rule, written out: the most rows, a multiple of 64, whose fp32 logits take at
    most the head's bytes (V x D x 2 on CUDA: D / 2 rows), at most 4096, at least the old chunk, at
    most the tokens."""
    return min(tokens, max(OLD_CHUNK, min(4096, V * D * A // (4 * V) // 64 * 64)))


def links_cudnn():
    """Whether BIN was built with cuDNN (then its attention defaults to cudnn and plans the
    documents of packed examples: make's "cuDNN found" line)."""
    dyn = subprocess.run(["readelf", "-d", BIN], capture_output=True, text=True, check=True).stdout
    return "libcudnn.so" in dyn


def scratch_parts(mode, chunk):
    """Every scratch part of the recomputed block's peak but attention's workspace (the attention
    kernels' own, llmc/memory/cuda_workspace.h, sized by their chunking), in bytes at N tokens,
    with the LM head's chunk of `chunk` rows."""
    ms = mode == "lowmem"
    parts = {
        "rope": N * (HD // 2) * 4 * 2,          # cos and sin tables, fp32, per position
        "block set": N * BLOCK_SET[mode],
        "residual": N * 2 * D * (1 if ms else 2),  # resid; standard norms recompute on a copy, resid_tmp
        "offload": N * 2 * 2 * D,               # two staging block inputs
        "grads": N * GRADS,
        "batch": N * 4 * 4 + 4,                 # inputs, targets, mask, positions (int32 / fp32); the
                                                # loss scale the kernels read (fp32; CUDA)
        "cublas": 32 << 20,
        "loss": chunk * LOSS_ROW + LOSS_FIXED,
    }
    if links_cudnn():  # packed examples' documents for cuDNN's ragged attention (llmc/attn_docs.h), a
        # document per token at most: 3 x (N + 1) int64 offsets and N int32 lengths
        parts["batch"] += 3 * (N + 1) * 8 + N * 4
    if ms:  # adapters behind an MS norm see gamma * z: per adapter rank x d work, bf16 and fp32, 16-byte aligned
        parts["lora"] = R * D * A + R * A + R * D * 4 + R * 4
    return parts


# The gradient norm's partial sums, (512 blocks + 1) doubles (llmc/cuda/adamw.cuh's
# SUM_SQUARES_SCRATCH), and the step's 5 statistics read back once per step (loss, count, correct,
# overflowed rows, sum of squares: llmc/train/trainable.h's STEP_STATS), then AdamW's step values
# (lr and two bias corrections, 3 floats in 2 doubles: llmc/cuda/adamw.cuh's ADAMW_STEP_DOUBLES) are
# planned under the trainable module only by a binary built with the CUDA backend, so a CPU-only
# build's CUDA plan lacks them.
GRAD_NORM_PARTIALS = (512 + 1 + 5 + 2) * 8


def without_grad_norm_partials(parts, want):
    got = dict(parts)
    if got.get("lora", 0) - want.get("lora", 0) == GRAD_NORM_PARTIALS:
        got["lora"] -= GRAD_NORM_PARTIALS
        if not got["lora"]:
            del got["lora"]
    return got


def test_plan_bytes_per_token_at_llama31_8b_match_a_hand_count():
    """Saved activations per token per block for baseline and lowmem, the checkpoint of the
    recomputed modes (2d per block: on the device, or under --offload host in pinned host memory),
    and the recomputed block's peak, part by part, against the counts written out above."""
    args = ("--batch", 1, "--seq", N, "--lora-rank", R)
    assert sum(SAVED_BASELINE.values()) == 168296 and sum(SAVED_LOWMEM.values()) == 126824
    for mode, want in (("baseline", SAVED_BASELINE), ("lowmem", SAVED_LOWMEM)):
        got = plan(LLAMA31_8B, "--mode", mode, *args)
        assert got["per_block"] == {k: N * v for k, v in want.items()}, mode
        assert got["activation_bytes"] == LAYERS * N * sum(want.values()) and "block_peak_bytes" not in got
    for mode in ("ckpt", "lowmem"):
        kept = plan(LLAMA31_8B, "--mode", mode, "--recompute", "block", *args)
        assert kept["per_block"] == {"checkpoint": N * 2 * D} and kept["host_bytes"] == 0
        got = plan(LLAMA31_8B, "--mode", mode, "--recompute", "block", "--offload", "host", *args)
        assert got["per_block"] == {} and got["host_bytes"] == LAYERS * N * 2 * D
        assert got["block_scratch_bytes"] == N * BLOCK_SET[mode]
        parts = dict(got["block_peak_parts"])
        attention = parts.pop("attention")
        chunk = got["loss_chunk_rows"]
        assert got["loss_chunk_rule"] == "plan" and chunk == planned_chunk(N) == 2048, mode
        want = scratch_parts(mode, chunk)
        assert without_grad_norm_partials(parts, want) == want, mode
        assert got["block_peak_bytes"] == sum(parts.values()) + attention  # the parts are the whole
        assert got["block_peak_bytes_per_token"] == pytest.approx(got["block_peak_bytes"] / N, abs=1e-3)
        # the scratch arena is the peak, plus each buffer's rounding to 64 bytes
        assert 0 <= got["categories"]["scratch"] - got["block_peak_bytes"] < 64 * 200
        print(f"{mode} recomputed block peak: {got['block_peak_bytes'] / N:.1f} B/token "
              f"(attention workspace {attention / N:.1f})")
    text = run(["--model", LLAMA31_8B, "--dry-run", "--mode", "lowmem", "--recompute", "block", *args]).stdout
    assert "recomputed block's peak" in text and "bytes per token" in text


def test_lm_head_chunk_follows_the_plan_rule_and_llmc_head_chunk():
    """The LM head's chunk (llmc/memory/loss_buffers.h): under the default rule 2048 rows at
    Llama-3.1-8B (its fp32 logits as big as the bf16 head: re-read 2 times per 4096 tokens, not 32),
    the same under any memory mode (it depends on the model and the tokens alone), never more than
    the tokens; LLMC_HEAD_CHUNK=old the 64 MiB of logits before, a count that many rows; stated by
    --dry-run; the plan grows by the loss buffers' difference exactly; a bad value is one line."""
    args = ("--batch", 1, "--lora-rank", R)
    big = plan(LLAMA31_8B, "--seq", N, *args)
    small = plan(LLAMA31_8B, "--seq", N, "--mode", "lowmem", "--quant", "nf4", "--recompute", "block",
                 "--offload", "host", *args)
    short = plan(LLAMA31_8B, "--seq", 512, *args)
    for got, tokens in ((big, N), (small, N), (short, 512)):
        assert got["loss_chunk_rule"] == "plan" and got["loss_chunk_rows"] == planned_chunk(tokens)
    assert big["loss_chunk_rows"] == small["loss_chunk_rows"] == 2048 and short["loss_chunk_rows"] == 512
    old = plan(LLAMA31_8B, "--seq", N, *args, env={"LLMC_HEAD_CHUNK": "old"})
    rows = plan(LLAMA31_8B, "--seq", N, *args, env={"LLMC_HEAD_CHUNK": "300"})
    assert (old["loss_chunk_rows"], old["loss_chunk_rule"]) == (OLD_CHUNK, "old")
    assert (rows["loss_chunk_rows"], rows["loss_chunk_rule"]) == (300, "rows")
    assert big["total_bytes"] - old["total_bytes"] == loss_arena_bytes(2048) - loss_arena_bytes(OLD_CHUNK)
    text = run(["--model", LLAMA31_8B, "--dry-run", "--seq", N, *args]).stdout
    assert "LM head chunk: 2048 rows of logits at a time (rule plan" in text, text
    # fitted to a memory between the two plans (auto's tile at its smallest either way, so the
    # difference is the loss buffers'), the old chunk; with room for the plan's, the plan's
    tile = ("--mlp-tile", 1024)
    small_old = plan(LLAMA31_8B, "--seq", N, *args, *tile, env={"LLMC_HEAD_CHUNK": "old"})
    between = (small_old["total_bytes"] + (big["total_bytes"] - old["total_bytes"]) // 2) / 2**30
    tight = plan(LLAMA31_8B, "--seq", N, *args, *tile, "--gpu-mem", f"{between:.6f}")
    assert (tight["loss_chunk_rows"], tight["loss_chunk_rule"], tight["fits"]) == (OLD_CHUNK, "old_fitted", True)
    roomy = plan(LLAMA31_8B, "--seq", N, *args, *tile, "--gpu-mem", f"{between + 1:.6f}")
    assert (roomy["loss_chunk_rows"], roomy["loss_chunk_rule"], roomy["fits"]) == (2048, "plan", True)
    p = run(["--model", LLAMA31_8B, "--dry-run", *args], env={"LLMC_HEAD_CHUNK": "0"}, check=False)
    assert p.returncode == 1 and p.stderr.strip() == "error: LLMC_HEAD_CHUNK=0: expected plan, old or an integer " \
        ">= 1", p.stderr


def test_cpu_plan_states_the_attention_per_call_scratch(tmp_path):
    """The CPU attention takes its packed keys and values, per-thread tiles and the backward's
    partial dk, dv from the heap per call; the plan states the largest call (percall_bytes), so a CPU
    run's peak RSS is its arenas plus at most that. A hand count at the SmolLM2-135M shape (9 heads,
    3 KV heads, hd 64), batch 1 x 4096 tokens, --threads 3 (not this machine's count), from llmc/cpu/attention.h's sizes:
    panels of MM_NR = 16 keys, tiles of ATT_BLOCK = 64 query rows, k blocks of ATT_KC = 256."""
    T, H, KVH, hd, threads = 4096, 9, 3, 64, 3
    csz = -(-T // 16) * 16 * hd                      # keys packed as columns, per (b, kv head)
    rsz = T * (-(-hd // 16) * 16)                    # packed as rows
    tile = 64 * T + (64 + 6) * 256                   # S and the packed A (MM_MR = 6), per thread
    chunks = min(-(-16 // H), -(-T // 64))           # ATT_MIN_UNITS = 16 units: 2 chunks per head
    fwd = KVH * (csz + rsz) + threads * tile
    bwd = KVH * (2 * csz + rsz) + 2 * T * hd * H * chunks + threads * (tile + 64 * T)
    cfg = tmp_path / "smollm2"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps(dict(
        model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True)))
    p = subprocess.run([BIN, "--model", str(cfg), "--dry-run", "--json", "--device", "cpu", "--batch", "1",
                        "--seq", str(T), "--threads", str(threads)], capture_output=True, text=True, check=True)
    assert json.loads(p.stdout)["percall_bytes"] == 4 * max(fwd, bwd)
