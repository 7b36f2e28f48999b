"""Phi-3 / Phi-4 (model_type phi3, issue 36): build/test/llama_probe against transformers' own
Phi3ForCausalLM with PEFT's LoRA on the fused modules (test/model/phi3_hf_reference.py, float64,
in the venv of transformers 4.46: build/hfvenv, or HF_PYTHON), and against the independent
PyTorch reference (test/model/reference_llama.py) where 4.46 is not the reference: Phi-4-mini's
partial_rotary_factor (4.46 ignores the key; current transformers rotates the first factor*head_dim
dims, as the reference does) and the memory modes whose backward is the paper's (ReSiLU2). The
reference itself is checked against transformers on the configs 4.46 computes as current
transformers does (full rotary; LongRoPE at both lengths).

The checkpoints are random, written in Phi-3's layout (qkv_proj, gate_up_proj); the case's LoRA
adapters are PEFT's, one per fused module (A shared by its parts, B's rows split among them).
Tolerances: the probe is fp32 against fp64 (test/model/llama_cases.py's TOL, as for the other
families). The reference against transformers is fp64 against fp64 but for RoPE's tables, which
transformers computes in fp32 (inv_freq, the angles, cos and sin) and only then casts: each entry
off by up to a few 2^-24 relative, which the two blocks carry to ~1e-6 in the logits and ~3e-6 in
single gradients (measured; more with LongRoPE's larger scale); TOL_F64 allows 10x that, and a
wiring error (a wrong row block, a swapped gate and up, the other factor list) is O(1e-2) or more."""
import functools
import os
import subprocess

import pytest

import llama_cases as lc
import phi3_cases as pc

ref = lc.ref
HF_PYTHON = os.environ.get("HF_PYTHON", os.path.join(lc.REPO, "build", "hfvenv", "bin", "python"))
HF_SCRIPT = os.path.join(lc.REPO, "test", "model", "phi3_hf_reference.py")
TOL_F64 = {"logits": 1e-5, "loss": 1e-6, "grad": 5e-5}

CASES = pc.CASES
CASE_IDS = [f"{n}-T{t}" for n, _, t in CASES]
RANK, ALPHA = pc.RANK, pc.ALPHA
MODES = [("exact", "std", "none"), ("exact", "ms", "none"), ("approx", "ms", "none"), ("approx", "std", "none"),
         ("approx", "ms", "block"), ("exact", "std", "block")]
MODE_IDS = ["-".join(m) for m in MODES]


class Setup:
    def __init__(self, root, name, batch, seq):
        self.dir = os.path.join(root, name)
        if not os.path.exists(os.path.join(self.dir, "config.json")):
            pc.write_phi3_model(self.dir, pc.model_config(name), seed=1)
        self.model = ref.LlamaModel.load(self.dir)
        for k in range(50):  # away from the ReSiLU2 breakpoints in both norm modes (llama_cases.make_safe_case)
            self.case = pc.make_phi3_case(self.model.cfg, batch, seq, 7 + 1000 * k)
            if all(lc.margin_ok(ref.run_case(self.model, self.case, "exact", n, RANK, ALPHA)["stats"])
                   for n in ("std", "ms")):
                break
        self.case_path = os.path.join(root, f"{name}.T{seq}.case.safetensors")
        lc.st_io.save(self.case_path, self.case)

    def probe(self, act, norm, recompute, extra=()):
        out = self.case_path + f".{act}.{norm}.{recompute}.out"
        return lc.run_probe(self.dir, self.case_path, out, act, norm, recompute, RANK, ALPHA, extra=extra)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("phi3_model"))


@functools.lru_cache(maxsize=None)
def _setup(root, name, batch, seq):
    return Setup(root, name, batch, seq)


@functools.lru_cache(maxsize=None)
def _transformers(root, name, batch, seq):
    """transformers + PEFT's logits, loss and adapter gradients on the case (float64)."""
    if not os.path.exists(HF_PYTHON):
        pytest.fail(f"{HF_PYTHON} missing: scripts/ci/install_deps.sh makes it")
    s = _setup(root, name, batch, seq)
    out = s.case_path + ".transformers.out"
    p = subprocess.run([HF_PYTHON, HF_SCRIPT, "--model", s.dir, "--case", s.case_path, "--out", out,
                        "--rank", str(RANK), "--alpha", repr(ALPHA)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return lc.st_io.load(out)


HF_CASES = [c for c in CASES if "partial_rotary_factor" not in pc.CONFIGS[c[0]]]  # 4.46 ignores the key


@pytest.mark.parametrize("norm", ["std", "ms"])
@pytest.mark.parametrize("name,batch,seq", HF_CASES, ids=[f"{n}-T{t}" for n, _, t in HF_CASES])
def test_probe_matches_transformers(workdir, name, batch, seq, norm):
    """The trainer (fp32) against Phi3ForCausalLM + PEFT (fp64): logits, loss and every adapter
    gradient, under standard norms and MS norms (exact SiLU: both are transformers' function)."""
    want = _transformers(workdir, name, batch, seq)
    got = _setup(workdir, name, batch, seq).probe("exact", norm, "none")
    lc.check_errors(lc.compare(want, got), f"{name} T{seq} {norm} vs transformers")


@pytest.mark.parametrize("name,batch,seq", HF_CASES, ids=[f"{n}-T{t}" for n, _, t in HF_CASES])
def test_reference_matches_transformers(workdir, name, batch, seq):
    """The reference's Phi-3 (fused adapters, LongRoPE at both lengths) is transformers', in fp64."""
    want = _transformers(workdir, name, batch, seq)
    s = _setup(workdir, name, batch, seq)
    got = ref.run_case(s.model, s.case, "exact", "std", RANK, ALPHA)
    got.pop("stats")
    probe_compare_f64 = lc.compare(want, got)
    lc.probe_compare.check_errors(probe_compare_f64, TOL_F64, f"{name} T{seq} reference vs transformers")


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("name,batch,seq", CASES, ids=CASE_IDS)
def test_probe_matches_reference(workdir, name, batch, seq, mode):
    """Every case (Phi-4-mini's partial rotary included) in the memory modes, against the reference."""
    act, norm, recompute = mode
    s = _setup(workdir, name, batch, seq)
    want = ref.run_case(s.model, s.case, act, norm, RANK, ALPHA)
    lc.check_errors(lc.compare(want, s.probe(act, norm, recompute)), f"{name} T{seq} {act} {norm} {recompute}")


def test_fused_targets_are_whole_modules(workdir):
    """An adapter on q alone would not be PEFT's (one adapter over qkv_proj): refused in one line."""
    s = _setup(workdir, "phi3", 2, 10)
    p = subprocess.run([lc.probe_path(), "--model", s.dir, "--case", s.case_path, "--out-file", s.case_path + ".bad",
                        "--lora-targets", "q,o"], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "qkv_proj" in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert not os.path.exists(s.case_path + ".bad")


FULL_MODES = [("exact", "std", "none"), ("approx", "ms", "block")]


@pytest.mark.parametrize("mode", FULL_MODES, ids=["-".join(m) for m in FULL_MODES])
@pytest.mark.parametrize("name,batch,seq", [CASES[0], CASES[4]], ids=[CASE_IDS[0], CASE_IDS[4]])
def test_probe_full_finetuning_matches_reference(workdir, name, batch, seq, mode):
    """--full: every part of the fused weights trains (its gradient the fused weight's rows, of
    the merged model under MS norms), with the embedding, head and norms, against the reference."""
    act, norm, recompute = mode
    s = _setup(workdir, name, batch, seq)
    want = ref.run_case(s.model, s.case, act, norm, RANK, ALPHA, full=True)
    got = s.probe(act, norm, recompute, extra=("--full",))
    assert sum(k.endswith(".W") for k in want) == 2 * 7
    lc.check_errors(lc.compare(want, got), f"full {name} T{seq} {act} {norm} {recompute}")


@pytest.mark.parametrize("norm", ["std", "ms"])
def test_probe_with_dropout_matches_reference(workdir, norm):
    """--lora-dropout: PEFT drops the fused module's input once for all its parts; the probe's parts
    share the lead part's mask (llmc/models/llama_plan.h), the reference drops the fused input once
    with that mask (test/model/lora_dropout_mask.py)."""
    import lora_dropout_mask as ldm
    import torch
    name, batch, seq = CASES[2]
    s = _setup(workdir, name, batch, seq)
    p, seed, step = 0.2, 5, 3
    drop = ldm.reference_dropout(p, seed, step, 0, list(ref.LORA_TARGETS), torch)
    want = ref.run_case(s.model, s.case, "exact", norm, RANK, ALPHA, dropout=drop)
    got = s.probe("exact", norm, "none", extra=("--lora-dropout", p, "--seed", seed, "--dropout-step", step))
    lc.check_errors(lc.compare(want, got), f"dropout {name} T{seq} {norm}")


def test_probe_ms_lora_merged_matches_reference(workdir):
    """--ms-lora merged (the paper's variant): the fused module's one adapter sees the MS norm's bare
    output z, in the probe as in the reference."""
    name, batch, seq = CASES[4]
    s = _setup(workdir, name, batch, seq)
    want = ref.run_case(s.model, s.case, "exact", "ms", RANK, ALPHA, ms_lora="merged")
    got = s.probe("exact", "ms", "none", extra=("--ms-lora", "merged"))
    lc.check_errors(lc.compare(want, got), f"{name} T{seq} ms-lora merged")
