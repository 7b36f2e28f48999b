"""--quant nf4 (llmc/nf4.h): the format against an independent NumPy reference
(test/model/nf4_reference.py), bit for bit; the NF4 model against the PyTorch reference
(test/model/reference_llama.py) run on the same dequantized weights, in every memory mode, on the CPU
backend and on the CUDA backend (the CPU emulator, build/emu/); the plan's NF4 bytes; bad input.

Tolerances: the CPU probe (fp32) against the fp64 reference uses test/model/llama_cases.py's TOL, as the
unquantized model tests do: dequantization is exact arithmetic shared by both sides, so NF4 adds no
error of its own there. CUDA keeps the dequantized weights and activations in bf16 (2^-8 relative
rounding), so it uses test/cuda/test_llama_cuda.py's bf16 tolerances against the same reference.
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
from test_llama_cuda import TOL_APPROX, TOL_EXACT  # noqa: E402

ref = lc.ref
REPO = lc.REPO
PROBE = os.path.join(REPO, "build", "test", "nf4_probe")
CUDA_TRAIN, CUDA_PROBE, CPU_TRAIN, CPU_PROBE = binaries("train_llama", "llama_probe")
# (act, norm, recompute, extra flags): the four act x norm modes, block recompute, the SwiGLU
# product rebuilt, and the paper's adapters on the merged input
MODES = [("exact", "std", "none", ()), ("exact", "ms", "none", ()), ("approx", "std", "none", ()),
         ("approx", "ms", "none", ()), ("exact", "std", "block", ()), ("approx", "ms", "block", ()),
         ("approx", "ms", "none", ("--swiglu-product", "recompute")), ("exact", "ms", "none", ("--ms-lora", "merged"))]
MODE_IDS = [f"{a}-{n}-{r}" + "".join(x for x in e if not x.startswith("-")) for a, n, r, e in MODES]


def torch_dynamic_map():
    """bitsandbytes' create_dynamic_map as it computes it: fp32 torch.linspace, then Python floats."""
    data = []
    for i in range(7):
        b = torch.linspace(0.1, 1, 2 ** i + 1)
        m = (b[:-1] + b[1:]) / 2.0
        data += ((10 ** (-6 + i)) * m).tolist() + (-(10 ** (-6 + i)) * m).tolist()
    return np.array(sorted(data + [0.0, 1.0]), dtype=np.float32)


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
    bnb = torch_dynamic_map()
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
            mlp_norm = "pre_feedforward_layernorm" if cfg.gemma else "post_attention_layernorm"
            norm_name = {"q": "input_layernorm", "k": "input_layernorm", "v": "input_layernorm",
                         "gate": mlp_norm, "up": mlp_norm}.get(t)
            g = w[f"model.layers.{l}.{norm_name}.weight"].astype(np.float32) if norm == "ms" and norm_name else None
            if g is not None and cfg.gemma:  # Gemma's gamma is 1 + w (fp32, as the trainer forms it)
                g = (g + np.float32(1.0)).astype(np.float32)
            W = w[name].astype(np.float32)
            Wq = (W * g[None, :]).astype(np.float32) if g is not None else W
            deq = nr.dequantize(nr.quantize(Wq), Wq.size).reshape(W.shape).astype(np.float64)
            w[name] = deq / g[None, :].astype(np.float64) if g is not None else deq
    return ref.LlamaModel(cfg, w)


def nf4_setup(root, name):
    """A random model of config `name`, its NF4 reference models and a case away from the ReSiLU2
    breakpoints."""
    d = os.path.join(root, name)
    lc.write_model(d, lc.model_config(name), seed=1)
    batch, seq, rank, alpha = lc.SHAPES[name]
    models = {norm: nf4_reference_model(d, norm) for norm in ("std", "ms")}
    # away from the breakpoints in each norm's own model: under ms the weights are quantized after the
    # merge, so its gate pre-activations differ from std's (a case screened on std's alone had one
    # 1e-6 from a breakpoint under ms, and bf16 flipped its ReSiLU2/ReGELU2 code on CUDA)
    case, _, _ = lc.make_safe_case(models["std"], batch, seq, rank, alpha, seed=7, ms_model=models["ms"])
    cp = os.path.join(root, f"{name}.case.safetensors")
    st_io.save(cp, case)
    refs = {}

    def reference(act, norm, extra=()):
        ms_lora = "merged" if "merged" in extra else "exact"
        if (act, norm, ms_lora) not in refs:
            refs[(act, norm, ms_lora)] = ref.run_case(models[norm], case, act, norm, rank, alpha, ms_lora=ms_lora)
        return refs[(act, norm, ms_lora)]
    return {"dir": d, "case": cp, "rank": rank, "alpha": alpha, "reference": reference, "root": root, "name": name}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return nf4_setup(str(tmp_path_factory.mktemp("nf4_model")), "gqa_untied")


@pytest.fixture(scope="module")
def family_setups(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("nf4_families"))
    return {name: nf4_setup(root, name) for name in FAMILIES}


def probe(s, exe, device, act, norm, rec, extra=()):
    out = os.path.join(s["root"], f"out.{s['name']}.{device}.{act}.{norm}.{rec}.{'_'.join(extra)}.safetensors")
    cmd = [need(exe), "--model", s["dir"], "--case", s["case"], "--out-file", out, "--act", act, "--norm", norm,
           "--recompute", rec, "--lora-rank", str(s["rank"]), "--lora-alpha", repr(float(s["alpha"])),
           "--device", device, "--quant", "nf4", *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert p.returncode == 0, p.stderr
    return st_io.load(out)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_cpu_nf4_model_matches_reference_on_dequantized_weights(setup, mode):
    act, norm, rec, extra = mode
    want = setup["reference"](act, norm, extra)
    got = probe(setup, CPU_PROBE, "cpu", act, norm, rec, extra)
    lc.check_errors(lc.compare(want, got), f"nf4 cpu {act} {norm} {rec}")


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_cuda_nf4_model_matches_reference_on_dequantized_weights(setup, mode):
    check_cuda_nf4(setup, mode)


FAMILIES = ["qwen2", "qwen3", "llama_bias", "gemma2", "gemma3"]
FAMILY_MODES = [MODES[0], MODES[3], MODES[5]]


@pytest.mark.parametrize("mode", FAMILY_MODES, ids=[MODE_IDS[MODES.index(m)] for m in FAMILY_MODES])
@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_nf4_families_match_reference_on_dequantized_weights(family_setups, device, name, mode):
    """The families' additions (biases, Qwen3's q/k norms, Gemma's sandwich norms) stay as they are under NF4: only the
    linears' weights are quantized."""
    s = family_setups[name]
    if device == "cuda":
        check_cuda_nf4(s, mode)
        return
    act, norm, rec, extra = mode
    got = probe(s, CPU_PROBE, "cpu", act, norm, rec, extra)
    lc.check_errors(lc.compare(s["reference"](act, norm, extra), got), f"nf4 cpu {name} {act} {norm} {rec}")


def check_cuda_nf4(setup, mode):
    act, norm, rec, extra = mode
    want = setup["reference"](act, norm, extra)
    got = probe(setup, CUDA_PROBE, "cuda", act, norm, rec, extra)
    tol = TOL_APPROX if act == "approx" else TOL_EXACT
    e_logits = rel_l2(got["logits"], want["logits"])
    e_loss = abs(float(got["loss"][0]) - float(want["loss"][0])) / abs(float(want["loss"][0]))
    grads = sorted((rel_l2(got[k], want[k]), k) for k in want if k.startswith("grad."))
    print(f"nf4 cuda {setup['name']} {mode}: logits {e_logits:.2e} loss {e_loss:.2e} grads median {grads[len(grads) // 2][0]:.2e} worst {grads[-1]}")
    assert e_logits < tol["logits"] and e_loss < tol["loss"], (e_logits, e_loss)
    assert grads[-1][0] < tol["grad"] and grads[len(grads) // 2][0] < tol["grad"] / 3, grads[-1]


# ---- the plan, the command line, resume and export ------------------------------------------------

from test_llama_train import (LLAMA2_7B, dry_run, expect_error, losses, run, tiny,  # noqa: E402,F401
                              train_args, val_losses)
from test_llama_cuda import memory_line  # noqa: E402
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


# ---- bitsandbytes checkpoints ------------------------------------------------------------------

LINEAR_MODULES = tuple(ref._MODULE_OF.values())
BNB_CONFIG = {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False, "bnb_4bit_quant_type": "nf4",
              "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16"}


def is_linear(name):
    return name.endswith(".weight") and any(f".{m}." in name for m in LINEAR_MODULES)


def write_bnb_model(src, dst, edit=None):
    """src's model in bitsandbytes' saved 4-bit layout (QuantState.as_dict(packed=True) per
    linear), quantized by the NumPy reference with bitsandbytes' own (torch fp32) dynamic map.
    edit(tensors, config) may corrupt it. Returns {linear name: its dequantized fp32 weight}."""
    os.makedirs(dst, exist_ok=True)
    dyn = torch_dynamic_map()
    tensors, deq = {}, {}
    for name, arr in ref.load_weights_np(src).items():
        if not is_linear(name):
            tensors[name] = arr
            continue
        q = nr.quantize(arr, dyn)
        blob = {"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": list(arr.shape), "nested_blocksize": 256,
                "nested_dtype": "float32", "nested_offset": float(q["offset"])}
        tensors[name] = q["codes"].reshape(-1, 1)
        tensors[name + ".absmax"] = q["qabsmax"]
        tensors[name + ".quant_map"] = nr.NF4_VALUES.copy()
        tensors[name + ".nested_absmax"] = q["nested"]
        tensors[name + ".nested_quant_map"] = dyn
        tensors[name + ".quant_state.bitsandbytes__nf4"] = np.frombuffer(json.dumps(blob).encode(), np.uint8).copy()
        deq[name] = nr.dequantize(q, arr.size, dyn).reshape(arr.shape)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = dict(BNB_CONFIG)
    if edit:
        edit(tensors, config)
    st_io.save(os.path.join(dst, "model.safetensors"), tensors, metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return deq


def reference_on(model_dir, linears):
    """The reference model of model_dir with its linears replaced (float64)."""
    cfg = ref.LlamaConfig.from_dir(model_dir)
    w = ref.load_weights_np(model_dir)
    w.update({k: v.astype(np.float64) for k, v in linears.items()})
    return ref.LlamaModel(cfg, w)


def test_bitsandbytes_checkpoint_loads_the_same_weights(setup):
    """A hand-made bitsandbytes NF4 checkpoint: under --quant nf4 with standard norms its bytes are
    used as stored (the probe equals the reference on its dequantized weights, to fp32 rounding);
    without --quant it is dequantized to fp32 (lowmem: then merged); under lowmem with --quant nf4
    it is dequantized, merged and quantized again (the reference does the same with the NumPy
    quantizer and bitsandbytes' map); and --export-merged writes bf16 linears equal to
    bf16(dequantized W) bit for bit (a fresh adapter: B = 0), no quant state, no
    quantization_config, every other tensor as stored."""
    s = dict(setup)
    bnb = os.path.join(s["root"], "bnb")
    deq = write_bnb_model(s["dir"], bnb)
    s["dir"] = bnb
    case = st_io.load(s["case"])
    r, a = s["rank"], s["alpha"]
    ref_std = reference_on(s["dir"], deq)
    got = probe(s, CPU_PROBE, "cpu", "exact", "std", "none")
    lc.check_errors(lc.compare(ref.run_case(ref_std, case, "exact", "std", r, a), got), "bnb nf4 as stored, std")
    out = os.path.join(s["root"], "bnb.plain.safetensors")
    cmd = [need(CPU_PROBE), "--model", bnb, "--case", s["case"], "--out-file", out, "--mode", "lowmem",
           "--lora-rank", str(r), "--lora-alpha", repr(float(a)), "--device", "cpu"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    lc.check_errors(lc.compare(ref.run_case(ref_std, case, "approx", "ms", r, a), st_io.load(out)), "bnb dequantized, lowmem")
    # lowmem + NF4: requantized after the merge, with the checkpoint's map
    w = ref.load_weights_np(bnb)
    requant = {}
    for name, d in deq.items():
        layer = name.split(".")[2]
        gname = {"q_proj": "input_layernorm", "k_proj": "input_layernorm", "v_proj": "input_layernorm",
                 "gate_proj": "post_attention_layernorm", "up_proj": "post_attention_layernorm"}.get(name.split(".")[4])
        if gname is None:
            requant[name] = d
            continue
        g = w[f"model.layers.{layer}.{gname}.weight"].astype(np.float32)
        merged = (d * g[None, :]).astype(np.float32)
        requant[name] = nr.dequantize(nr.quantize(merged, torch_dynamic_map()), merged.size, torch_dynamic_map()).reshape(d.shape).astype(np.float64) / g[None, :]
    got = probe(s, CPU_PROBE, "cpu", "approx", "ms", "none")
    lc.check_errors(lc.compare(ref.run_case(reference_on(bnb, requant), case, "approx", "ms", r, a), got), "bnb requantized, lowmem")
    # the export
    e = os.path.join(s["root"], "bnb_export")
    run(["--model", bnb, "--quant", "nf4", "--mode", "baseline", "--lora-rank", r, "--export-merged", e])
    exp = st_io.load(os.path.join(e, "model.safetensors"))
    src = ref.load_weights_np(bnb)
    assert set(exp) == {k for k in src if "absmax" not in k and "quant" not in k}
    for name, d in deq.items():
        bf = (d.view(np.uint32).astype(np.uint64) + 0x7FFF + ((d.view(np.uint32) >> 16) & 1)) >> 16 << 16  # round to nearest even
        assert np.array_equal(exp[name].astype(np.float32).view(np.uint32), bf.astype(np.uint32)), name
    for name in exp:
        if name not in deq:
            assert np.array_equal(exp[name], src[name]), name
    with open(os.path.join(e, "config.json")) as f:
        cfg = json.load(f)
    assert "quantization_config" not in cfg and cfg["hidden_size"] == 48


def _set(tensors, key, value):
    tensors[key] = value


L0Q = "model.layers.0.self_attn.q_proj.weight"
L0K = "model.layers.0.self_attn.k_proj.weight"
BAD_BNB = {
    "gptq": (lambda t, c: c.update(quantization_config={"quant_method": "gptq", "bits": 4}), "gptq"),
    "fp4": (lambda t, c: c["quantization_config"].update(bnb_4bit_quant_type="fp4"), "fp4"),
    "8bit": (lambda t, c: c["quantization_config"].update(load_in_4bit=False, load_in_8bit=True), "8-bit"),
    "shape": (lambda t, c: _set(t, L0Q + ".quant_state.bitsandbytes__nf4", np.frombuffer(json.dumps(
        {"quant_type": "nf4", "blocksize": 64, "shape": [48, 47], "nested_blocksize": 256, "nested_offset": 0.1}).encode(), np.uint8).copy()), "shape"),
    "blocksize": (lambda t, c: _set(t, L0Q + ".quant_state.bitsandbytes__nf4", np.frombuffer(json.dumps(
        {"quant_type": "nf4", "blocksize": 128, "shape": [48, 48], "nested_blocksize": 256, "nested_offset": 0.1}).encode(), np.uint8).copy()), "blocksize"),
    "blob": (lambda t, c: _set(t, L0Q + ".quant_state.bitsandbytes__nf4", np.frombuffer(b"{not json", np.uint8).copy()), "invalid JSON"),
    "absmax": (lambda t, c: _set(t, L0Q + ".absmax", t[L0Q + ".absmax"][:-1].copy()), "absmax"),
    "quant_map": (lambda t, c: _set(t, L0Q + ".quant_map", np.linspace(-1, 1, 16).astype(np.float32)), "quant_map"),
    "nested": (lambda t, c: t.pop(L0Q + ".nested_absmax"), "nested_absmax"),
    "dyn": (lambda t, c: _set(t, L0Q + ".nested_quant_map", np.linspace(-1, 1, 256).astype(np.float32)), "nested_quant_map"),
    "codes": (lambda t, c: _set(t, L0Q, t[L0Q][:-2].copy()), "q_proj"),
    # issue 28: non-finite quant states (they made NaN weights: "val loss nan", exit 0)
    "nested_absmax_nan": (lambda t, c: _set(t, L0Q + ".nested_absmax", np.full_like(t[L0Q + ".nested_absmax"], np.nan)),
                          "nested_absmax\" holds a non-finite value"),
    "nested_offset_overflow": (lambda t, c: _set_blob(t, nested_offset=1e39), "nested_offset 1e+39"),
    "absmax_overflows": (lambda t, c: (_set(t, L0Q + ".nested_absmax", np.full_like(t[L0Q + ".nested_absmax"], 3e38)),
                                       _set_blob(t, nested_offset=3e38)), "overflows float32"),
    "absmax_inf": (lambda t, c: _single_quant(t, L0K, np.inf), "k_proj.weight.absmax\" holds a non-finite value (inf)"),
}


def _set_blob(tensors, **kv):
    """L0Q's quant state JSON with the fields kv changed."""
    key = L0Q + ".quant_state.bitsandbytes__nf4"
    blob = dict(json.loads(tensors[key].tobytes()), **kv)
    tensors[key] = np.frombuffer(json.dumps(blob).encode(), np.uint8).copy()


def _single_quant(tensors, name, bad):
    """Weight `name` without double quantization (fp32 absmax, as bitsandbytes saves it then), one
    absmax `bad`."""
    nb = tensors[name + ".absmax"].size
    tensors[name + ".absmax"] = np.full(nb, 0.1, np.float32)
    tensors[name + ".absmax"][nb // 2] = bad
    for k in (".nested_absmax", ".nested_quant_map"):
        tensors.pop(name + k)
    key = name + ".quant_state.bitsandbytes__nf4"
    blob = {k: v for k, v in json.loads(tensors[key].tobytes()).items() if not k.startswith("nested")}
    tensors[key] = np.frombuffer(json.dumps(blob).encode(), np.uint8).copy()


@pytest.mark.parametrize("bad", list(BAD_BNB))
def test_bad_bitsandbytes_checkpoint_fails_in_one_line(setup, tiny, bad):
    """A corrupt or mismatched quant state, or another quantization: one line naming it, exit 1."""
    edit, needle = BAD_BNB[bad]
    d = os.path.join(setup["root"], f"bad_{bad}")
    write_bnb_model(setup["dir"], d, edit)
    expect_error(["--model", d, "--quant", "nf4", "--mode", "baseline", "--val", tiny / "val.bin", "--eval-only", "--batch", 2, "--seq", 16], needle)


def test_nf4_two_ranks_equal_one_process_accumulating(tiny, tmp_path):
    """mpirun under --quant nf4 (lowmem): 2 ranks x batch 2 against 1 process x batch 2 x
    --grad-accum 2, the same bits (test_llama_system.py says why no tolerance is needed)."""
    from test_llama_system import adapter, mpirun
    args = ["--model", tiny / "model", "--data", tiny / "train.bin", "--seq", 24, "--lora-rank", 4, "--lr", 5e-3, "--seed", 11,
            "--threads", 1, "--quant", "nf4", "--steps", 3, "--batch", 2]
    one = run(args + ["--grad-accum", 2, "--out", tmp_path / "one"])
    two = mpirun(2, args + ["--out", tmp_path / "two"])
    assert losses(one.stdout) == losses(two.stdout) and len(losses(one.stdout)) == 3
    a, b = adapter(tmp_path / "one"), adapter(tmp_path / "two")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_nf4_with_ms_qk_norms_and_a_short_window_plans_on_cuda(tmp_path):
    """Gemma 3 (MS q/k norms under --norm ms) with its local window (5) shorter than --seq under NF4 on
    CUDA: once refused while its gradients missed the reference on the emulator, which was the test's
    case sitting on a ReGELU2 breakpoint of the MS model (nf4_setup); now trained like the rest
    (test_nf4_families_match_reference_on_dequantized_weights runs it), so the driver plans it."""
    d = tmp_path / "gemma3"
    lc.write_model(str(d), lc.model_config("gemma3"), seed=1)
    base = [CPU_TRAIN, "--model", str(d), "--dry-run", "--device", "cuda", "--quant", "nf4", "--batch", "1"]
    for ok in (["--mode", "lowmem", "--seq", "12"], ["--mode", "lowmem", "--norm", "std", "--seq", "12"]):
        p = subprocess.run(base + ok, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, (ok, p.stderr)
