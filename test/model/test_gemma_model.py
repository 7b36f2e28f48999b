"""Gemma 2 (issue 36) beyond test_llama_model.py's every-mode comparison of the probe with the
reference (its "gemma2" config): the reference itself against transformers' own
Gemma2ForCausalLM (build/hfvenv: logits, loss and the gradient of every parameter), --full with
the sandwich norms training, and what each Gemma addition changes (so that a trainer ignoring one
fails the comparisons).

Run: /usr/bin/python3 -m pytest -q test/model/test_gemma_model.py (build/test/llama_probe built first)."""
import functools
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_cases as lc  # noqa: E402

ref = lc.ref
torch.set_num_threads(1)
HF_PYTHON = os.environ.get("HF_PYTHON", os.path.join(lc.REPO, "build", "hfvenv", "bin", "python"))
HF_RUN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_gemma_run.py")
NAME = "gemma2"


@functools.lru_cache(maxsize=None)
def gemma_setup(root, name=NAME):
    d = os.path.join(root, name)
    lc.write_model(d, lc.model_config(name), seed=1)
    model = ref.LlamaModel.load(d)
    B, T, rank, alpha = lc.SHAPES[name]
    case, _, _ = lc.make_safe_case(model, B, T, rank, alpha, seed=7)
    path = os.path.join(root, name + ".case.safetensors")
    lc.st_io.save(path, case)
    return d, model, case, path


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("gemma_model"))


def hf_run(model_dir, case, tmp):
    if not os.path.isfile(HF_PYTHON):
        pytest.fail(f"{HF_PYTHON} missing: scripts/ci/install_deps.sh makes it")
    case_npz, out = os.path.join(tmp, "case.npz"), os.path.join(tmp, "hf.npz")
    np.savez(case_npz, tokens=case["tokens"], mask=case["mask"])
    p = subprocess.run([HF_PYTHON, HF_RUN, model_dir, case_npz, out], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return dict(np.load(out))


# transformers' name of each reference gradient (reference_llama.run_case, full=True, norm std)
def hf_name(key, c):
    if key == "grad.embed":
        return "grad.model.embed_tokens.weight"
    if key == "grad.final_norm":
        return "grad.model.norm.weight"
    _, l, rest = key.split(".", 2)
    norms = {"attn_norm": "input_layernorm", "mlp_norm": "pre_feedforward_layernorm",
             "post_attn_norm": "post_attention_layernorm", "post_mlp_norm": "post_feedforward_layernorm"}
    if rest in norms:
        return f"grad.model.layers.{l}.{norms[rest]}.weight"
    return f"grad.model.layers.{l}.{ref._MODULE_OF[rest[:-2]]}.weight"


def test_reference_equals_transformers_gemma2(root, tmp_path):
    """The oracle against the definition: transformers' Gemma2ForCausalLM in float64 gives the
    reference's logits, loss and every parameter's gradient. transformers' Gemma RMSNorm and
    rotary tables compute in float32 whatever the model's dtype (x.float(), 1 + w.float(), an
    fp32 inv_freq), so the two agree to float32 rounding carried through two blocks, not to
    float64's: 1e-5 relative to the largest value (the measured worst is printed)."""
    d, model, case, _ = gemma_setup(root)
    want = ref.run_case(model, case, "exact", "std", full=True)
    got = hf_run(d, case, str(tmp_path))
    names = [k for k in want if k.startswith("grad.")] + ["logits", "loss"]
    assert len(names) == 1 + 1 + 7 * 2 + 4 * 2 + 2  # embed, final norm, linears, block norms, logits, loss
    worst = (0.0, "")
    for k in names:
        h = got[k if k in ("logits", "loss") else hf_name(k, model.cfg)]
        w = want[k]
        assert h.shape == w.shape, k
        worst = max(worst, (float(np.abs(h - w).max() / np.abs(w).max()), k))
    print(f"reference vs transformers Gemma2ForCausalLM: worst {worst[0]:.2e} ({worst[1]})")
    assert worst[0] < 1e-5, worst


def test_gemma_additions_matter(root):
    """Each Gemma addition moves the reference's logits far beyond the probe's tolerance
    (llama_cases.TOL, 1e-4): without the soft-caps (logits, attention), without the window, with
    head_dim^-0.5 for query_pre_attn_scalar^-0.5, without the post norms, with w instead of 1 + w,
    with SiLU for the tanh GELU, without the embedding scale."""
    d, model, case, _ = gemma_setup(root)
    tokens = torch.from_numpy(case["tokens"][:, :-1].astype(np.int64))
    base = ref.forward(model, tokens, {}, 1.0).detach()
    c = model.cfg

    def moved(logits):
        return float((logits.detach() - base).abs().max() / base.abs().max())

    saved = c.final_softcap
    c.final_softcap = None
    assert moved(ref.forward(model, tokens, {}, 1.0)) > 1e-2
    c.final_softcap = saved
    for attr, off in (("attn_softcap", None), ("layer_window", [0] * c.n_layers), ("attn_scale", 16 ** -0.5)):
        saved = getattr(c, attr)
        setattr(c, attr, off)  # no attention soft-cap, no window, head_dim^-0.5
        try:
            assert moved(ref.forward(model, tokens, {}, 1.0)) > 1e-2, attr
        finally:
            setattr(c, attr, saved)
    w = dict(model.w)
    for k in w:
        if "post_" in k:
            w[k] = None  # rmsnorm without gamma
    assert moved(ref.forward(model, tokens, {}, 1.0, weights=w)) > 1e-2
    w = {k: (v - 1.0 if k.endswith("norm") and v is not None else v) for k, v in model.w.items()}
    assert moved(ref.forward(model, tokens, {}, 1.0, weights=w)) > 1e-2
    c.gemma = False  # SiLU MLP, no embedding scale, and no post norms
    try:
        assert moved(ref.forward(model, tokens, {}, 1.0)) > 1e-2
    finally:
        c.gemma = True


@pytest.mark.parametrize("mode", [("exact", "std", "none"), ("approx", "ms", "none"), ("approx", "ms", "block")],
                         ids=["baseline", "lowmem", "lowmem-recompute"])
@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_probe_full_finetuning_gemma(root, name, mode):
    """--full: every linear, the embedding (tied head), the final norm, the block norms (standard
    norms), the sandwich post norms (every mode) and Gemma 3's q/k norms against the reference."""
    act, norm, recompute = mode
    d, model, case, path = gemma_setup(root, name)
    B, T, rank, alpha = lc.SHAPES[name]
    want = ref.run_case(model, case, act, norm, rank, alpha, full=True)
    assert sum("post_" in k for k in want) == 2 * model.cfg.n_layers
    out = os.path.join(root, f"full.{name}.{act}.{norm}.{recompute}.out.safetensors")
    cmd = [lc.probe_path(), "--model", d, "--case", path, "--out-file", out, "--act", act, "--norm", norm,
           "--recompute", recompute, "--full"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    got = lc.st_io.load(out)
    assert set(k for k in want if k.startswith("grad.")) <= set(got)
    lc.check_errors(lc.compare(want, got), f"full {name} {act} {norm} {recompute}")


def test_gemma3_additions_matter(root):
    """Gemma 3's own parts each move the reference's logits beyond the tolerance: the local layers'
    RoPE base (all layers global instead), the global layer's linear RoPE scaling, the q/k norms'
    1 + w (w instead), the local layers' window (shorter than the case's sequence; none instead).
    The q/k gammas 1 + w are far from 1 (llama_cases.write_model: 1 + 0.5 N(0, 1), one of them 0), so
    a trainer that dropped the norms' scale, or scaled by w, would fail every comparison with them."""
    d, model, case, _ = gemma_setup(root, "gemma3")
    tokens = torch.from_numpy(case["tokens"][:, :-1].astype(np.int64))
    c = model.cfg
    assert c.local == [True, True, False] and c.qk_norm
    assert c.layer_window == [5, 5, 0] and tokens.shape[1] > 5
    for l in range(c.n_layers):
        for n in ("q_norm", "k_norm"):
            g = model.w[f"{l}.{n}"]
            assert float((g - 1.0).abs().max()) > 0.5 and float(g.abs().min()) == 0.0, (l, n)
    base = ref.forward(model, tokens, {}, 1.0).detach()

    def moved(logits):
        return float((logits.detach() - base).abs().max() / base.abs().max())

    c.local = [False] * 3
    assert moved(ref.forward(model, tokens, {}, 1.0)) > 1e-3
    c.local = [True, True, False]
    scaling, c.rope_scaling = c.rope_scaling, None
    assert moved(ref.forward(model, tokens, {}, 1.0)) > 1e-3
    c.rope_scaling = scaling
    w = {k: (v - 1.0 if k.endswith("q_norm") or k.endswith("k_norm") else v) for k, v in model.w.items()}
    assert moved(ref.forward(model, tokens, {}, 1.0, weights=w)) > 1e-2
    c.layer_window = [0] * 3
    try:
        assert moved(ref.forward(model, tokens, {}, 1.0)) > 1e-3
    finally:
        c.layer_window = [5, 5, 0]


def test_regelu2_fits_the_tanh_gelu_as_the_erf_gelu():
    """ReGELU2's constants were fitted to the erf GELU; Gemma's MLP uses the tanh form. Measured as
    the paper measures the fit (the integral over [-6.07, 6.07] of the squared difference between
    the activation and the sum of 3 ReLUs whose derivative is ReGELU2's step function, fine
    midpoint sums here): 0.00956 for the tanh GELU against 0.00951 for the erf GELU (the paper's
    ~0.0095) and 0.0618 for a plain ReLU; the step function's L2 distance to the tanh GELU's
    derivative is within 0.1 % of its distance to the erf GELU's (docs/architecture.md)."""
    n = 2_000_000
    dx = 12.14 / n
    x = torch.linspace(-6.07 + dx / 2, 6.07 - dx / 2, n, dtype=torch.float64)
    h = sum(a * torch.clamp(x - c, min=0.0) for a, c in zip(ref.REGELU2_A, ref.REGELU2_C))
    dh = sum(a * (x > c).to(torch.float64) for a, c in zip(ref.REGELU2_A, ref.REGELU2_C))
    xe = x.clone().requires_grad_(True)
    erf_gelu = 0.5 * xe * (1.0 + torch.erf(xe / np.sqrt(2.0)))
    d_erf = torch.autograd.grad(erf_gelu.sum(), xe)[0]
    xt = x.clone().requires_grad_(True)
    tanh_gelu = ref.gelu_tanh(xt)
    d_tanh = torch.autograd.grad(tanh_gelu.sum(), xt)[0]

    def sq(f):
        return float((f ** 2).sum() * dx)

    fit_erf, fit_tanh = sq(erf_gelu.detach() - h), sq(tanh_gelu.detach() - h)
    relu = sq(tanh_gelu.detach() - x.clamp(min=0))
    print(f"ReGELU2 fit: erf GELU {fit_erf:.5f}, tanh GELU {fit_tanh:.5f}, ReLU {relu:.4f}; "
          f"derivative L2 {sq(d_erf - dh):.5f} / {sq(d_tanh - dh):.5f}")
    assert abs(fit_erf - 0.0095) < 5e-5 and abs(fit_tanh - fit_erf) < 0.01 * fit_erf
    assert relu > 6 * fit_tanh
    assert abs(sq(d_tanh - dh) - sq(d_erf - dh)) < 1e-3 * sq(d_erf - dh)


def test_bf16_checkpoint_scales_embeddings_in_bf16(root):
    """A BF16 checkpoint: transformers running it in bf16 multiplies the embeddings by sqrt(hidden)
    rounded to bf16 (sqrt(48) = 6.9282 -> 6.9375); the trainer reads the embedding's dtype and does
    the same on the CPU (fp32 otherwise). The probe matches the reference with the bf16 scale, and
    not with the fp32 one (0.13 % apart, beyond the 1e-4 tolerance)."""
    d = os.path.join(root, "gemma2_bf16")
    lc.write_model(d, lc.model_config(NAME), seed=1)
    t = lc.st_io.load(os.path.join(d, "model.safetensors"))
    lc.st_io.save(os.path.join(d, "model.safetensors"), t, metadata={"format": "pt"}, bf16=True)
    model = ref.LlamaModel.load(d)
    B, T, rank, alpha = lc.SHAPES[NAME]
    case = lc.make_case(model.cfg, B, T, rank, seed=3)
    path = os.path.join(root, "bf16.case.safetensors")
    lc.st_io.save(path, case)
    got = lc.run_probe(d, path, os.path.join(root, "bf16.out.safetensors"), "exact", "std", "none", rank, alpha)
    model.embed_scale = 6.9375
    lc.check_errors(lc.compare(ref.run_case(model, case, "exact", "std", rank, alpha), got), "gemma2 bf16 checkpoint")
    model.embed_scale = float(np.float32(np.sqrt(48.0)))
    fp32_scale = ref.run_case(model, case, "exact", "std", rank, alpha)
    assert np.abs(fp32_scale["logits"] - got["logits"]).max() > 10 * lc.TOL["logits"] * np.abs(got["logits"]).max()
