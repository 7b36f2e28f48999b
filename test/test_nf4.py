"""--quant nf4 (llmc/nf4.h): the format against an independent NumPy reference
(test/nf4_reference.py), bit for bit; the NF4 model against the PyTorch reference
(test/reference_llama.py) run on the same dequantized weights, in every memory mode, on the CPU
backend and on the CUDA backend (the CPU emulator, build/emu/); the plan's NF4 bytes; bad input.

Tolerances: the CPU probe (fp32) against the fp64 reference uses test/llama_cases.py's TOL, as the
unquantized model tests do: dequantization is exact arithmetic shared by both sides, so NF4 adds no
error of its own there. CUDA keeps the dequantized weights and activations in bf16 (2^-8 relative
rounding), so it uses test/test_cuda_llama.py's bf16 tolerances against the same reference.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_cases as lc  # noqa: E402
import nf4_reference as nr  # noqa: E402
import st_io  # noqa: E402
from cuda_backend import binaries, need, rel_l2  # noqa: E402
from test_cuda_llama import TOL_APPROX, TOL_EXACT  # noqa: E402

ref = lc.ref
REPO = lc.REPO
PROBE = os.path.join(REPO, "test", "nf4_probe")
CUDA_TRAIN, CUDA_PROBE, CPU_TRAIN, CPU_PROBE = binaries("train_llama", "llama_probe")
MODES = [("exact", "std", "none"), ("exact", "ms", "none"), ("approx", "std", "none"),
         ("approx", "ms", "none"), ("exact", "std", "block"), ("approx", "ms", "block")]
MODE_IDS = [f"{a}-{n}-{r}" for a, n, r in MODES]


def run_nf4_probe(tmp_path, w):
    src, out = str(tmp_path / "w.safetensors"), str(tmp_path / "q.safetensors")
    st_io.save(src, {"w": np.asarray(w, dtype=np.float32)})
    p = subprocess.run([need(PROBE), src, out], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return st_io.load(out)


def test_tables_are_nf4_and_the_dynamic_map(tmp_path):
    got = run_nf4_probe(tmp_path, np.ones(64, dtype=np.float32))["tables"]
    assert np.array_equal(got[:16].view(np.uint32), nr.NF4_VALUES.view(np.uint32))
    assert np.array_equal(got[16:].view(np.uint32), nr.dynamic_map().view(np.uint32))
    # bitsandbytes builds the same map from fp32 torch.linspace: within one fp32 ulp of ours
    data = []
    for i in range(7):
        b = torch.linspace(0.1, 1, 2 ** i + 1)
        m = (b[:-1] + b[1:]) / 2.0
        data += ((10 ** (-6 + i)) * m).tolist() + (-(10 ** (-6 + i)) * m).tolist()
    bnb = np.array(sorted(data + [0.0, 1.0]), dtype=np.float32)
    assert np.all(np.abs(bnb - got[16:]) <= np.spacing(np.abs(got[16:])))


# sizes: one partial block, odd n, several 256-blocks of absmaxes with a ragged last one
@pytest.mark.parametrize("n", [1, 63, 64 * 5 + 1, 64 * 300 + 17, 64 * 512])
def test_quantize_bit_identical_to_reference(tmp_path, n):
    rng = np.random.default_rng(n)
    w = (rng.standard_normal(n) * np.exp(rng.uniform(-3, 3, n))).astype(np.float32)  # varied block scales
    if n > 200:
        w[64:128] = 0.0        # a block of zeros: absmax 0, code 7
        w[130] = 1e4           # an outlier
        w[192:256] = w[256:320]  # two equal blocks
    got = run_nf4_probe(tmp_path, w)
    want = nr.quantize(w)
    for k in ("codes", "qabsmax"):
        assert np.array_equal(got[k], want[k]), k
    assert np.array_equal(got["nested"].view(np.uint32), want["nested"].view(np.uint32))
    assert got["offset"].view(np.uint32)[0] == np.float32(want["offset"]).view(np.uint32)
    deq = nr.dequantize(want, n)
    assert np.array_equal(got["dequant"].view(np.uint32), deq.view(np.uint32))
    # a bound on the error from the rules alone: w = x A, deq = c A' with c the NF4 value nearest
    # x (|c| <= 1), so |deq - w| <= |A' - A| + A * (widest NF4 gap) / 2 (+ fp32 rounding)
    A = np.repeat(np.abs(nr._blockwise(w, 64)).max(axis=1), 64)[:n].astype(np.float64)
    A2 = np.repeat(nr.dequantize_absmax(want).astype(np.float64), 64)[:n]
    bound = np.abs(A2 - A) + A * 0.5 * float(np.diff(nr.NF4_VALUES).max())
    assert np.all(np.abs(deq.astype(np.float64) - w) <= bound * (1 + 1e-6) + 1e-30)


def nf4_reference_model(model_dir, norm):
    """The reference model on the weights an NF4 run uses: each linear quantized by the NumPy
    reference (after the MS merge, W' = fp32(W * gamma), under norm ms) and dequantized; under ms
    divided by gamma again in float64, so that the reference's own merge gives back the dequantized
    W' (up to fp64 rounding)."""
    cfg = ref.LlamaConfig.from_dir(model_dir)
    w = ref.load_weights_np(model_dir)
    for l in range(cfg.n_layers):
        for t, module in ref._MODULE_OF.items():
            name = f"model.layers.{l}.{module}.weight"
            norm_name = {"q": "input_layernorm", "k": "input_layernorm", "v": "input_layernorm",
                         "gate": "post_attention_layernorm", "up": "post_attention_layernorm"}.get(t)
            g = w[f"model.layers.{l}.{norm_name}.weight"].astype(np.float32) if norm == "ms" and norm_name else None
            W = w[name].astype(np.float32)
            Wq = (W * g[None, :]).astype(np.float32) if g is not None else W
            deq = nr.dequantize(nr.quantize(Wq), Wq.size).reshape(W.shape).astype(np.float64)
            w[name] = deq / g[None, :].astype(np.float64) if g is not None else deq
    return ref.LlamaModel(cfg, w)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("nf4_model"))
    name = "gqa_untied"
    d = os.path.join(root, name)
    lc.write_model(d, lc.model_config(name), seed=1)
    batch, seq, rank, alpha = lc.SHAPES[name]
    models = {norm: nf4_reference_model(d, norm) for norm in ("std", "ms")}
    case, _, _ = lc.make_safe_case(models["std"], batch, seq, rank, alpha, seed=7)
    cp = os.path.join(root, "case.safetensors")
    st_io.save(cp, case)
    refs = {}

    def reference(act, norm):
        if (act, norm) not in refs:
            refs[(act, norm)] = ref.run_case(models[norm], case, act, norm, rank, alpha)
        return refs[(act, norm)]
    return {"dir": d, "case": cp, "rank": rank, "alpha": alpha, "reference": reference, "root": root}


def probe(s, exe, device, act, norm, rec):
    out = os.path.join(s["root"], f"out.{device}.{act}.{norm}.{rec}.safetensors")
    cmd = [need(exe), "--model", s["dir"], "--case", s["case"], "--out-file", out, "--act", act, "--norm", norm,
           "--recompute", rec, "--lora-rank", str(s["rank"]), "--lora-alpha", repr(float(s["alpha"])),
           "--device", device, "--quant", "nf4"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert p.returncode == 0, p.stderr
    return st_io.load(out)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_cpu_nf4_model_matches_reference_on_dequantized_weights(setup, mode):
    act, norm, rec = mode
    want = setup["reference"](act, norm)
    got = probe(setup, CPU_PROBE, "cpu", act, norm, rec)
    lc.check_errors(lc.compare(want, got), f"nf4 cpu {act} {norm} {rec}")


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_cuda_nf4_model_matches_reference_on_dequantized_weights(setup, mode):
    act, norm, rec = mode
    want = setup["reference"](act, norm)
    got = probe(setup, CUDA_PROBE, "cuda", act, norm, rec)
    tol = TOL_APPROX if act == "approx" else TOL_EXACT
    e_logits = rel_l2(got["logits"], want["logits"])
    e_loss = abs(float(got["loss"][0]) - float(want["loss"][0])) / abs(float(want["loss"][0]))
    grads = sorted((rel_l2(got[k], want[k]), k) for k in want if k.startswith("grad."))
    print(f"nf4 cuda {mode}: logits {e_logits:.2e} loss {e_loss:.2e} grads median {grads[len(grads) // 2][0]:.2e} worst {grads[-1]}")
    assert e_logits < tol["logits"] and e_loss < tol["loss"], (e_logits, e_loss)
    assert grads[-1][0] < tol["grad"] and grads[len(grads) // 2][0] < tol["grad"] / 3, grads[-1]


# ---- the plan, the command line, resume and export ------------------------------------------------

from test_llama_cli import LLAMA2_7B, dry_run, expect_error, losses, run, tiny, train_args, val_losses  # noqa: E402,F401
from test_cuda_llama import memory_line  # noqa: E402
from cuda_backend import check_measured_memory, run as run_cmd  # noqa: E402


def nf4_bytes(n):
    """One NF4 tensor of n weights, from the format's rules (no padding at LLaMA-2's sizes, all
    multiples of 64 x 256 x 16): n/2 bytes of codes, one absmax code per 64 weights, one fp32
    nested absmax per 256 absmaxes, one fp32 offset."""
    assert n % (64 * 256 * 16) == 0
    return n // 2 + n // 64 + 4 * (n // 64 // 256) + 4


@pytest.mark.parametrize("device,wbytes", [("cuda", 2), ("cpu", 4)])
def test_dry_run_counts_nf4_bytes_exactly(tmp_path, device, wbytes):
    """LLaMA-2-7B: the frozen arena swaps each linear's wbytes * n for its NF4 bytes (each buffer
    rounded up to the plan's 64 bytes), plus the tables (16 + 256 fp32); the scratch gains one
    dequantized copy of the largest linear (11008 x 4096) in the backend's weight type."""
    args = ("--mode", "lowmem", "--batch", 1, "--seq", 2048, "--device", device)
    plain = dry_run(tmp_path, LLAMA2_7B, *args)
    q = dry_run(tmp_path, LLAMA2_7B, *args, "--quant", "nf4")
    d, f, L = 4096, 11008, 32
    sizes = [d * d] * 4 + [d * f] * 3
    r64 = lambda b: -(-b // 64) * 64  # noqa: E731
    want = plain["categories"]["frozen"] - L * sum(r64(wbytes * n) for n in sizes) + L * sum(r64(nf4_bytes(n)) for n in sizes) + r64(272 * 4)
    assert q["categories"]["frozen"] == want
    assert q["categories"]["scratch"] - plain["categories"]["scratch"] == r64(wbytes * d * f)
    assert q["activation_bytes"] == plain["activation_bytes"] and q["quant"] == "nf4"
    print(f"7B {device}: frozen {plain['categories']['frozen'] / 2**30:.2f} GiB -> NF4 {q['categories']['frozen'] / 2**30:.2f} GiB")


def test_full_refuses_nf4(tiny):
    expect_error(train_args(tiny, "--full", "--quant", "nf4"), "--quant nf4", "--full")


def test_nf4_resume_and_merged_export(tiny, tmp_path):
    """Under --quant nf4 (lowmem: quantized after the MS merge): a run stopped and resumed equals an
    uninterrupted one bit for bit; a resume without --quant nf4 is refused; the merged export
    (dequantized W, MS merge undone, + alpha/r B A; fp32 like the input) evaluated without NF4
    gives the loss of the NF4 model with its adapter, up to fp32 rounding of the merge and its
    inverse (relative 1e-5 on a loss of order 1)."""
    a, b, e = tmp_path / "a", tmp_path / "b", tmp_path / "merged"
    full = run(train_args(tiny, "--steps", 4, "--quant", "nf4", "--out", a))
    run(train_args(tiny, "--steps", 4, "--stop-at", 2, "--quant", "nf4", "--out", b))
    rest = run(train_args(tiny, "--steps", 4, "--quant", "nf4", "--resume", b))
    assert losses(full.stdout)[2:] == losses(rest.stdout) and len(losses(rest.stdout)) == 2
    expect_error(train_args(tiny, "--steps", 4, "--resume", b), "quant")
    common = ["--val", tiny / "val.bin", "--eval-only", "--batch", 4, "--seq", 32, "--val-batches", 4]
    q = run(["--model", tiny / "model", "--adapter", a, "--lora-rank", 4, "--quant", "nf4", "--export-merged", e] + common)
    m = run(["--model", e] + common)
    lq, lm = val_losses(q.stdout)[-1], val_losses(m.stdout)[-1]
    unq = val_losses(run(["--model", tiny / "model", "--adapter", a, "--lora-rank", 4] + common).stdout)[-1]
    assert abs(lq - lm) <= 1e-5 * abs(lq), (lq, lm)
    assert abs(lq - unq) > 1e-4, (lq, unq)  # the export carries NF4's weights, not the checkpoint's


def test_cuda_nf4_run_measures_its_plan(tiny):
    """On the CUDA emulator: a short --quant nf4 run allocates exactly its plan (NF4 tensors,
    tables, the bf16 scratch) and its losses track the CPU backend's within bf16 drift (1 %)."""
    args = [str(x) for x in train_args(tiny, "--steps", 3, "--quant", "nf4")]
    cuda = run_cmd([need(CUDA_TRAIN)] + args + ["--device", "cuda"]).stdout
    cpu = run_cmd([need(CPU_TRAIN)] + args + ["--device", "cpu"]).stdout
    planned, _, measured = memory_line(cuda)
    check_measured_memory(planned, measured)
    for x, y in zip(losses(cuda), losses(cpu)):
        assert abs(x - y) <= 0.01 * abs(y), (losses(cuda), losses(cpu))
