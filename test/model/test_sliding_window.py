"""Sliding-window attention end to end against transformers: a random Mistral (every layer
windowed) and a random Qwen2 with use_sliding_window and max_window_layers mid-stack (layer 0 full,
layers 1 and 2 windowed), both written by transformers 4.46 itself (build/hfvenv), with windows
shorter than the sequence (4 and 5 positions of 11 and 12) so that they cut.

- our fp64 reference (test/model/reference_llama.py, its per-layer window) equals transformers'
  eager model run by test/model/hf_window_reference.py (logits, loss, LoRA gradients);
- the probe (build/test/llama_probe, CPU fp32) equals transformers in baseline (exact SiLU,
  standard norms), and equals the reference in lowmem (ReSiLU2, MS norms), which transformers
  does not have, with and without --recompute block;
- the CUDA backend on the emulator (build/emu/llama_probe, bf16) equals the CPU probe within the
  bf16 bounds of test/cuda/test_llama_cuda.py, in both modes; the tensor-core attention path there
  runs the window's masks;
- the window matters: without it the reference's logits move by far more than the tolerances.

Tolerances: CPU fp32 vs fp64, llama_cases.TOL (as every other probe test); our fp64 reference vs
transformers in float64 1e-5 of the largest value: transformers 4.46 makes its RoPE cos/sin tables
in float32 whatever the model's dtype, which moves the logits by ~1e-7 relative (measured 1.5e-7),
while a wrong window moves them by more than 1e-2 (asserted below); emulator vs CPU,
test/cuda/test_llama_cuda.py's TOL_EXACT / TOL_APPROX (bf16 activations)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cuda"))
import llama_cases as lc  # noqa: E402
from cuda_backend import binaries, need, rel_l2, run  # noqa: E402

ref = lc.ref
HF_PYTHON = os.environ.get("HF_PYTHON", os.path.join(lc.REPO, "build", "hfvenv", "bin", "python"))
HF_SCRIPT = os.path.join(lc.REPO, "test", "model", "hf_window_reference.py")
CUDA_TRAIN, CUDA_PROBE, CPU_TRAIN, CPU_PROBE = binaries("train_llama", "llama_probe")
TOL_EXACT = {"logits": 0.05, "loss": 1e-2, "grad": 0.15}  # test/cuda/test_llama_cuda.py's bf16 bounds
TOL_APPROX = {"logits": 0.05, "loss": 1e-2, "grad": 0.6}

MODELS = {
    "mistral": (dict(model_type="mistral", architectures=["MistralForCausalLM"], hidden_size=48,
                     intermediate_size=80, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     vocab_size=61, sliding_window=5, max_position_embeddings=256, tie_word_embeddings=False),
                (2, 12, 4, 8.0)),
    "qwen2_mid": (dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=48,
                       intermediate_size=80, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=59, use_sliding_window=True, sliding_window=4, max_window_layers=1,
                       max_position_embeddings=256, tie_word_embeddings=False),
                  (2, 11, 4, 8.0)),
}


def hf(*args):
    if not os.path.exists(HF_PYTHON):
        pytest.fail(f"{HF_PYTHON} missing: scripts/ci/install_deps.sh makes it")
    p = subprocess.run([HF_PYTHON, HF_SCRIPT, *map(str, args)], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert p.returncode == 0, p.stderr[-3000:]


class Setup:
    def __init__(self, root, name):
        config, (self.batch, self.seq, self.rank, self.alpha) = MODELS[name]
        self.dir = os.path.join(root, name)
        hf("write", self.dir, json.dumps(config), 11)
        self.model = ref.LlamaModel.load(self.dir)
        self.case, _, _ = lc.make_safe_case(self.model, self.batch, self.seq, self.rank, self.alpha, seed=7)
        self.case_path = os.path.join(root, f"{name}.case.safetensors")
        lc.st_io.save(self.case_path, self.case)
        hf_out = os.path.join(root, f"{name}.hf.safetensors")
        hf("run", self.dir, self.case_path, hf_out, self.rank, self.alpha)
        self.hf = lc.st_io.load(hf_out)
        self.root = root

    def reference(self, act, norm):
        return ref.run_case(self.model, self.case, act, norm, self.rank, self.alpha)

    def probe(self, device, act, norm, recompute, case_path=None):
        """The CPU probe (device cpu) or the emulator's CUDA probe (device cuda) on the case (or another)."""
        exe = need(CPU_PROBE if device == "cpu" else CUDA_PROBE)
        case_path = case_path or self.case_path
        out = f"{case_path}.{device}.{act}.{norm}.{recompute}.out"
        run([exe, "--model", self.dir, "--case", case_path, "--out-file", out, "--act", act, "--norm", norm,
             "--recompute", recompute, "--lora-rank", self.rank, "--lora-alpha", repr(float(self.alpha)),
             "--device", device])
        return lc.st_io.load(out)


@pytest.fixture(scope="module")
def setups(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("sliding_window"))
    return {name: Setup(root, name) for name in MODELS}


def fp64_close(got, want, tol=1e-5):
    for k in want:
        if k == "logits" or k == "loss" or k.startswith("grad.lora."):
            assert lc.rel_to_max(got[k], want[k]) < tol, (k, lc.rel_to_max(got[k], want[k]))


@pytest.mark.parametrize("name", list(MODELS))
def test_reference_window_is_transformers(setups, name):
    s = setups[name]
    assert s.model.cfg.layer_window == ([5, 5] if name == "mistral" else [0, 4, 4])
    want = s.reference("exact", "std")
    assert sorted(k for k in s.hf if k.startswith("grad.")) == sorted(k for k in want if k.startswith("grad.lora."))
    fp64_close(s.hf, want)
    # the window cuts: the same model with every layer full gives other logits
    windows = s.model.cfg.layer_window
    s.model.cfg.layer_window = [0] * len(windows)
    try:
        full = s.reference("exact", "std")
    finally:
        s.model.cfg.layer_window = windows
    assert lc.rel_to_max(full["logits"], want["logits"]) > 1e-2
    assert rel_l2(full["logits"], want["logits"]) > 4 * TOL_EXACT["logits"]  # the emulator's bound would see it too


@pytest.mark.parametrize("name", list(MODELS))
def test_probe_baseline_equals_transformers(setups, name):
    s = setups[name]
    got = s.probe("cpu", "exact", "std", "none")
    want = dict(s.hf)
    want.update({k: v for k, v in s.reference("exact", "std").items() if k not in want})  # the keys HF has no name for
    lc.check_errors(lc.compare(want, got), f"{name} baseline vs transformers")
    errs = {"logits": lc.rel_to_max(got["logits"], s.hf["logits"]), "loss": lc.rel_to_max(got["loss"], s.hf["loss"]),
            "grad": max((lc.rel_to_max(got[k], s.hf[k]), k) for k in s.hf if k.startswith("grad."))}
    lc.check_errors(errs, f"{name} baseline vs transformers (its LoRA gradients)")


@pytest.mark.parametrize("recompute", ["none", "block"])
@pytest.mark.parametrize("name", list(MODELS))
def test_probe_lowmem_equals_reference(setups, name, recompute):
    s = setups[name]
    got = s.probe("cpu", "approx", "ms", recompute)
    lc.check_errors(lc.compare(s.reference("approx", "ms"), got), f"{name} lowmem {recompute}")


@pytest.mark.parametrize("mode", [("exact", "std", "none"), ("approx", "ms", "none"), ("approx", "ms", "block")],
                         ids=["baseline", "lowmem", "lowmem-block"])
@pytest.mark.parametrize("name", list(MODELS))
def test_emulator_equals_cpu(setups, name, mode):
    s = setups[name]
    act, norm, rec = mode
    want = s.probe("cpu", act, norm, rec)
    got = s.probe("cuda", act, norm, rec)
    assert set(got) == set(want)
    tol = TOL_APPROX if act == "approx" else TOL_EXACT
    e_logits = rel_l2(got["logits"], want["logits"])
    e_loss = abs(float(got["loss"][0]) - float(want["loss"][0])) / abs(float(want["loss"][0]))
    grads = sorted((rel_l2(got[k], want[k]), k) for k in want if k.startswith("grad."))
    print(f"{name} {mode}: logits {e_logits:.2e} loss {e_loss:.2e} grads worst {grads[-1][0]:.2e} ({grads[-1][1]})")
    assert e_logits < tol["logits"] and e_loss < tol["loss"], (e_logits, e_loss)
    assert grads[-1][0] < tol["grad"], grads[-1]
    assert grads[len(grads) // 2][0] < tol["grad"] / 3


def test_packed_examples_with_a_window_match_separate_runs(setups):
    """Packed examples of 7 and 5 tokens in the Mistral's first row (window 5: it cuts inside the
    first example and restarts at the second): the probe's logits on each example equal the
    reference run on that example alone, its LoRA gradients the count-weighted sum of theirs (CPU);
    the emulator's packed run equals the CPU's within the bf16 bounds."""
    s = setups["mistral"]
    B, T = s.case["tokens"].shape[0], s.case["tokens"].shape[1] - 1
    segments = [(0, 7), (7, 12)]
    starts = np.zeros((B, T), np.uint8)
    for a, _ in segments:
        starts[0, a] = 1
    case = dict(s.case, starts=starts)
    path = os.path.join(s.root, "mistral.packed.case.safetensors")
    lc.st_io.save(path, case)
    got = s.probe("cpu", "exact", "std", "none", path)
    mask = s.case["mask"].astype(np.float64)
    grads, worst = {}, 0.0
    for row, a, b in [(0, a, b) for a, b in segments] + [(r, 0, T) for r in range(1, B)]:
        sub = {k: v for k, v in s.case.items() if k.startswith("lora.")}
        sub["tokens"] = s.case["tokens"][row:row + 1, a:b + 1]
        sub["mask"] = s.case["mask"][row:row + 1, a:b]
        if sub["mask"].sum() == 0:
            continue
        r = ref.run_case(s.model, sub, "exact", "std", s.rank, s.alpha)
        worst = max(worst, lc.rel_to_max(got["logits"][row, a:b], r["logits"][0]))
        for k, v in r.items():
            if k.startswith("grad."):
                grads[k] = grads.get(k, 0.0) + sub["mask"].sum() / mask.sum() * v
    gerr = max(lc.rel_to_max(got[k], v) for k, v in grads.items())
    assert worst < lc.TOL["logits"] and gerr < lc.TOL["grad"], (worst, gerr)
    emu = s.probe("cuda", "exact", "std", "none", path)
    assert rel_l2(emu["logits"], got["logits"]) < TOL_EXACT["logits"]
    assert max(rel_l2(emu[k], got[k]) for k in got if k.startswith("grad.")) < TOL_EXACT["grad"]
