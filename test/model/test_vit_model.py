"""ViT model tests: build/test/vit_probe (the C model, fp32 CPU backend) against the independent PyTorch
reference test/model/reference_vit.py (fp64), on small random configs in every mode, with resolution
changes and both checkpoint layouts, under --full the gradient of every weight, plus self-checks of
the reference itself.

Run:  /usr/bin/python3 -m pytest -q -rA test/model/test_vit_model.py   (-rA / -s shows the error lines)
The probe must be built first (`make build/test/vit_probe`); a missing probe FAILS the probe tests.
VIT_PROBE overrides the probe path, VIT_PROBE_ARGS appends flags to every probe run.

Approx mode and fp32: the ReGELU2 derivative jumps at its breakpoints, so a GELU input within fp32
rounding of a breakpoint could get another code in the probe than in the reference. Cases are
re-drawn until no GELU input (in either norm mode) lies within vit_cases.BREAKPOINT_MARGIN of one.
"""
import functools
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vit_cases as vc  # noqa: E402

ref = vc.ref
torch.set_num_threads(1)

CONFIG_NAMES = list(vc.CONFIGS)
# (act, norm, recompute): all four act x norm combinations, and block recompute for baseline and
# lowmem (test_probe_recomputed_block_is_bit_identical recomputes all four)
MODES = [("exact", "std", "none"), ("exact", "ms", "none"), ("approx", "std", "none"),
         ("approx", "ms", "none"), ("exact", "std", "block"), ("approx", "ms", "block")]
ACT_NORM = [("exact", "std"), ("exact", "ms"), ("approx", "std"), ("approx", "ms")]
MODE_IDS = [f"{a}-{n}-{r}" for a, n, r in MODES]
SUMMARY = []


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("vit_model"))


print_summary = vc.probe_compare.summary_printer(SUMMARY)  # an autouse fixture of this module


class Setup:
    """One config: model directory, fp64 reference model, a case away from the breakpoints (at
    the checkpoint's resolution, or at `image` = (H, W))."""

    def __init__(self, root, name, targets=vc.ALL_TARGETS, image=None):
        self.name = name
        self.dir = os.path.join(root, name)
        if not os.path.isdir(self.dir):
            vc.write_model(self.dir, vc.model_config(name), seed=1)
        self.model = ref.VitModel.load(self.dir)
        self.batch, self.rank, self.alpha, self.classes = vc.SHAPES[name]
        self.targets = ref.parse_targets(targets)
        self.case, self.seed, self.stats = vc.make_safe_case(
            self.model, self.batch, self.rank, self.alpha, self.classes, self.targets, seed=7,
            image=image)
        tag = "all" if len(self.targets) == len(vc.ALL_TARGETS) else "_".join(self.targets)
        res = "" if image is None else f".{image[0]}x{image[1]}"
        self.case_path = os.path.join(root, f"{name}.{tag}{res}.case.safetensors")
        vc.st_io.save(self.case_path, self.case)
        self._ref = {}

    def reference(self, act, norm):
        if (act, norm) not in self._ref:
            self._ref[(act, norm)] = ref.run_case(self.model, self.case, act, norm, self.rank,
                                                  self.alpha, self.targets)
        return self._ref[(act, norm)]

    def probe(self, act, norm, recompute, out_name, model_dir=None):
        out = os.path.join(os.path.dirname(self.case_path), out_name)
        return vc.run_probe(model_dir or self.dir, self.case_path, out, act, norm, recompute,
                            self.rank, self.alpha, self.targets)


@functools.lru_cache(maxsize=None)
def _setup(root, name, targets=tuple(vc.ALL_TARGETS), image=None):
    return Setup(root, name, targets, image)


# ---------------------------------------------------------------------------------------------
# the probe against the reference

@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_probe_matches_reference(workdir, name, mode):
    act, norm, recompute = mode
    s = _setup(workdir, name)
    got = s.probe(act, norm, recompute, f"{name}.{act}.{norm}.{recompute}.out.safetensors")
    errs = vc.compare(s.reference(act, norm), got)
    SUMMARY.append(vc.check_errors(errs, f"{name:9s} {act:6s} {norm:3s} {recompute:5s}"))


@pytest.mark.parametrize("act,norm", ACT_NORM, ids=[f"{a}-{n}" for a, n in ACT_NORM])
@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_probe_recomputed_block_is_bit_identical(workdir, name, act, norm):
    """--recompute block runs each block's own forward again (ReGELU2 and MS-LN under lowmem), op
    for op, from its saved input, and --offload host only moves that input through host memory
    (byte copies): on the CPU backend the logits, the loss and every gradient equal the run that
    keeps the block's activations, to the bit."""
    s = _setup(workdir, name)
    kept = s.probe(act, norm, "none", f"bits.{name}.{act}.{norm}.none.out.safetensors")
    for tag, extra in (("block", ()), ("offload", ("--offload", "host"))):
        out = os.path.join(workdir, f"bits.{name}.{act}.{norm}.{tag}.out.safetensors")
        got = vc.run_probe(s.dir, s.case_path, out, act, norm, "block", s.rank, s.alpha, s.targets, extra=extra)
        vc.probe_compare.assert_same_bits(kept, got, tag)


@pytest.mark.parametrize("norm", ["std", "ms"])
def test_probe_offload_of_many_blocks_is_bit_identical(workdir, norm):
    """Five blocks, so that the forward reuses both staging buffers and the backward fetches every
    block input but the last two from the host (with two blocks the staging buffers still hold the
    forward's inputs and a missing fetch would go unseen): --offload host equals the kept run bit
    for bit, under standard LayerNorm (recomputed on a copy) and MS-LN (in place)."""
    d = os.path.join(workdir, "five_blocks")
    cfg = vc.write_model(d, dict(vc.CONFIGS["square"], num_hidden_layers=5), seed=1)
    B, r, alpha, classes = vc.SHAPES["square"]
    cp = os.path.join(d, "case.safetensors")
    vc.st_io.save(cp, vc.make_case(cfg, B, r, classes, seed=3))
    kept = vc.run_probe(d, cp, cp + f".{norm}.kept", "approx", norm, "none", r, alpha)
    got = vc.run_probe(d, cp, cp + f".{norm}.offload", "approx", norm, "block", r, alpha, extra=("--offload", "host"))
    vc.probe_compare.assert_same_bits(kept, got, "offload")


@pytest.mark.parametrize("mode", [MODES[0], MODES[3]], ids=[MODE_IDS[0], MODE_IDS[3]])
def test_probe_lora_q_v(workdir, mode):
    """--lora-targets q,v: adapters and gradients for q and v only (fc2 frozen: the GELU output is
    not kept, the case where ReGELU2 saves most)."""
    act, norm, recompute = mode
    s = _setup(workdir, "nonsquare", ("q", "v"))
    got = s.probe(act, norm, recompute, f"qv.{act}.{norm}.out.safetensors")
    assert not any(".k." in k or ".fc1." in k for k in got)
    SUMMARY.append(vc.check_errors(vc.compare(s.reference(act, norm), got),
                                   f"{'q,v':9s} {act:6s} {norm:3s} {recompute:5s}"))


# fine-tuning resolutions different from the checkpoint's: square 16x16 (grid 4x4) -> 24x12
# (grid 6x3: larger and non-square); nonsquare 12x20 (grid 3x5) -> 8x12 (grid 2x3: smaller)
RESIZES = [("square", (24, 12), MODES[0]), ("nonsquare", (8, 12), MODES[3])]


@pytest.mark.parametrize("name,image,mode", RESIZES, ids=[f"{n}-{i[0]}x{i[1]}" for n, i, _ in RESIZES])
def test_probe_resolution_change(workdir, name, image, mode):
    """The position embedding's patch grid is resized bicubically (align_corners=False) exactly as
    the reference's F.interpolate does."""
    act, norm, recompute = mode
    s = _setup(workdir, name, image=image)
    got = s.probe(act, norm, recompute, f"{name}.{image[0]}x{image[1]}.out.safetensors")
    want = s.reference(act, norm)
    SUMMARY.append(vc.check_errors(vc.compare(want, got), f"{name:9s} {act:6s} {norm:3s} "
                                   f"at {image[0]}x{image[1]}"))
    # the test can tell the interpolation mode: bilinear positions move the logits far more
    saved = ref.position_embedding

    def bilinear(model, grid):
        pos = model.w["pos"]
        gh0, gw0 = model.cfg.grid
        d = pos.shape[-1]
        p = pos[:, 1:].reshape(1, gh0, gw0, d).permute(0, 3, 1, 2)
        p = F.interpolate(p, size=tuple(grid), mode="bilinear", align_corners=False)
        return torch.cat([pos[:, :1], p.permute(0, 2, 3, 1).reshape(1, -1, d)], dim=1)
    try:
        ref.position_embedding = bilinear
        other = ref.run_case(s.model, s.case, act, norm, s.rank, s.alpha)
    finally:
        ref.position_embedding = saved
    assert vc.rel_to_max(other["logits"], want["logits"]) > 30 * vc.TOL["logits"]


@pytest.mark.parametrize("layout", ["hf_bare", "timm"])
def test_checkpoint_layouts_agree(workdir, layout):
    """The same weights saved as ViTModel (no "vit." prefix) or in timm's layout (fused qkv) give
    bit-identical probe outputs to the ViTForImageClassification layout."""
    s = _setup(workdir, "nonsquare")
    other = os.path.join(workdir, f"nonsquare_{layout}")
    vc.write_model(other, vc.model_config("nonsquare"), seed=1, layout=layout)
    a = s.probe("approx", "ms", "none", f"layout.hf.out.safetensors")
    b = s.probe("approx", "ms", "none", f"layout.{layout}.out.safetensors", model_dir=other)
    vc.probe_compare.assert_same_bits(a, b, f"layouts hf and {layout}")


# ---------------------------------------------------------------------------------------------
# --full: the gradient of every weight against the reference (the case's adapters ignored)

# the act x norm modes, and block recompute under lowmem
FULL_MODES = [("exact", "std", "none"), ("exact", "ms", "none"), ("approx", "std", "none"),
              ("approx", "ms", "none"), ("approx", "ms", "block")]
FULL_MODE_IDS = [f"{a}-{n}-{r}" for a, n, r in FULL_MODES]


_CASES = {}


def _full_case(root, name):
    """A model and a case whose GELU inputs (without adapters, as --full runs) are away from the
    ReGELU2 breakpoints in both norm modes."""
    if name in _CASES:
        return _CASES[name]
    d = os.path.join(root, name + "_full")  # beside Setup's model of the same name, not over it
    vc.write_model(d, vc.model_config(name), seed=1)
    model = ref.VitModel.load(d)
    batch, rank, _, classes = vc.SHAPES[name]
    for k in range(50):
        case = vc.make_case(model.cfg, batch, rank, classes, seed=11 + 1000 * k)
        outs = {n: ref.run_case(model, case, "exact", n, rank, full=True) for n in ("std", "ms")}
        if all(o["stats"]["min_margin"] > vc.BREAKPOINT_MARGIN for o in outs.values()):
            break
    else:
        raise RuntimeError("no case away from the breakpoints")
    path = os.path.join(root, f"{name}.full.case.safetensors")
    vc.st_io.save(path, case)
    _CASES[name] = (d, model, case, path, {})
    return _CASES[name]


@pytest.mark.parametrize("mode", FULL_MODES, ids=FULL_MODE_IDS)
@pytest.mark.parametrize("name", ["square", "nonsquare"])
def test_probe_full_finetuning_matches_reference(workdir, name, mode):
    """--full: the gradient of every weight (the linears' W and b, of the merged layer under MS-LN;
    the standard norms; the embeddings; the final norm) and of the head against the fp64
    reference; the case's adapters are ignored."""
    act, norm, recompute = mode
    d, model, case, path, cache = _full_case(workdir, name)
    if (act, norm) not in cache:
        cache[(act, norm)] = ref.run_case(model, case, act, norm, full=True)
    want = cache[(act, norm)]
    out = os.path.join(workdir, f"{name}.full.{act}.{norm}.{recompute}.out.safetensors")
    vc.run([vc.binary("build/test/vit_probe", "VIT_PROBE"), "--model", d, "--case", path, "--out-file", out,
            "--act", act, "--norm", norm, "--recompute", recompute, "--full"])
    got = vc.st_io.load(out)
    assert sum(k.endswith(".W") for k in want) == model.cfg.n_layers * 6
    assert not any(".lora." in k for k in got)
    vc.check_errors(vc.compare(want, got), f"full {name} {act} {norm} {recompute}")


# ---------------------------------------------------------------------------------------------
# MS-LN under LoRA trains what standard LayerNorm trains: the adapters of q, k, v and fc1 keep the
# original model's parameterisation (they see gamma*z + beta, not the merged input z)

MS_LORA_MODES = [("exact", "none"), ("approx", "none"), ("exact", "block"), ("approx", "block")]
MS_LORA_IDS = [f"{a}-{r}" for a, r in MS_LORA_MODES]


def _std_vs_ms(s, act, recompute, tag, label):
    """test/model/probe_compare.py's std_vs_ms within this model's TOL."""
    vc.probe_compare.std_vs_ms(s, vc.TOL, f"{label:9s}", act, recompute, tag, SUMMARY)


@pytest.mark.parametrize("act,recompute", MS_LORA_MODES, ids=MS_LORA_IDS)
@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_ms_lora_gradients_equal_std(workdir, name, act, recompute):
    """--norm ms (gamma and beta merged into q, k, v, fc1) gives every LoRA and head gradient of
    --norm std: the adapters still act on gamma*z + beta. Before, they acted on z."""
    _std_vs_ms(_setup(workdir, name), act, recompute, f"msstd.{name}", name)


def test_ms_lora_merged_is_the_papers_variant(workdir):
    """--ms-lora merged keeps the paper's parameterisation (adapters on the merged input z): equal
    to the reference's merged variant, and NOT to the original model's gradients."""
    s = _setup(workdir, "square")
    out = os.path.join(workdir, "merged.out.safetensors")
    got = vc.run_probe(s.dir, s.case_path, out, "exact", "ms", "none", s.rank, s.alpha, s.targets, ms_lora="merged")
    want = ref.run_case(s.model, s.case, "exact", "ms", s.rank, s.alpha, s.targets, ms_lora="merged")
    SUMMARY.append(vc.check_errors(vc.compare(want, got), f"{'ms merged':9s} exact  ms  none "))
    g, name = vc.compare(s.reference("exact", "std"), got)["grad"]
    print(f"--ms-lora merged vs the original model's gradients: {g:.2e} ({name})")
    assert g > 100 * vc.TOL["grad"]


def _setup_affine(root, name, gammas):
    """"square" with its block LayerNorms' gammas replaced by gammas(rng, d) (betas 0.3 N(0, 1))."""
    s = _setup(root, "square")
    d = os.path.join(root, name)
    os.makedirs(d, exist_ok=True)
    t = vc.st_io.load(os.path.join(s.dir, "model.safetensors"))
    rng = np.random.default_rng(3)
    for k in t:
        if ".layernorm_before." in k or ".layernorm_after." in k:
            n = t[k].shape[0]
            t[k] = (gammas(rng, n) if k.endswith(".weight") else 0.3 * rng.standard_normal(n)).astype(np.float32)
    vc.st_io.save(os.path.join(d, "model.safetensors"), t, metadata={"format": "pt"})
    for f in os.listdir(s.dir):
        if f.endswith(".json"):
            with open(os.path.join(s.dir, f)) as src, open(os.path.join(d, f), "w") as dst:
                dst.write(src.read())
    g = Setup.__new__(Setup)
    g.__dict__.update(s.__dict__)
    g.dir, g.name, g._ref = d, name, {}
    g.model = ref.VitModel.load(d)
    return g


@pytest.mark.parametrize("kind", ["wide", "zero"])
def test_ms_lora_equals_std_with_extreme_gammas(workdir, kind):
    """The same with gammas spanning four orders of magnitude, and with zero gammas (exact act:
    these GELU inputs are not kept away from the ReGELU2 breakpoints)."""
    s = _setup_affine(workdir, f"gammas_{kind}", vc.probe_compare.EXTREME_GAMMAS[kind])
    _std_vs_ms(s, "exact", "none", f"gammas_{kind}", f"gam {kind}")


def test_probe_deterministic(workdir):
    """Two runs on the same input give bitwise identical outputs."""
    s = _setup(workdir, "square")
    a = s.probe("approx", "ms", "none", "det1.out.safetensors")
    b = s.probe("approx", "ms", "none", "det2.out.safetensors")
    vc.probe_compare.assert_same_bits(a, b, "two identical runs")


# ---------------------------------------------------------------------------------------------
# self-checks of the reference (no probe needed)

def test_reference_regelu2_backward_is_step_rule():
    """ReGELU2: forward is the exact GELU (both forms); backward is exactly dy * L[code] with the
    float32 levels."""
    L = ref.regelu2_levels()
    assert L.dtype == np.float32 and L[0] == 0.0
    np.testing.assert_allclose(L, [0.0, -0.049222611, 1.0487406, 1.0], atol=1e-7)
    for dtype in (torch.float32, torch.float64):
        for tanh_form in (False, True):
            special = []
            for ci in ref.REGELU2_C:
                cc = torch.tensor(ci, dtype=dtype)
                special += [float(cc), float(torch.nextafter(cc, torch.tensor(-np.inf, dtype=dtype))),
                            float(torch.nextafter(cc, torch.tensor(np.inf, dtype=dtype)))]
            g = torch.Generator().manual_seed(0)
            x = torch.cat([torch.tensor(special, dtype=dtype),
                           5 * torch.randn(2000, generator=g, dtype=dtype)]).requires_grad_(True)
            dy = torch.randn(x.shape, generator=g, dtype=dtype)
            y = ref.ReGELU2.apply(x, tanh_form)
            assert torch.equal(y.detach(), F.gelu(x.detach(), approximate="tanh" if tanh_form else "none"))
            (dx,) = torch.autograd.grad(y, x, dy)
            xd = x.detach().double().numpy()
            npdt = np.float64 if dtype == torch.float64 else np.float32
            code = sum((xd > np.asarray(ci, dtype=npdt)).astype(int) for ci in ref.REGELU2_C)
            assert torch.equal(dx, dy * torch.from_numpy(L[code]).to(dtype))
            assert set(code.tolist()) == {0, 1, 2, 3}


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_reference_ms_merge_keeps_model(workdir, name):
    """Merging gamma and beta into q,k,v / fc1 leaves the model unchanged: without adapters on the
    merged linears (LoRA on proj and fc2 only), ms and std give the same logits and gradients."""
    s = _setup(workdir, name)
    case = {k: v for k, v in s.case.items()
            if not k.startswith("lora.") or k.split(".")[2] in ("proj", "fc2")}
    for act in ("exact", "approx"):
        a = ref.run_case(s.model, case, act, "std", s.rank, s.alpha, ("proj", "fc2"))
        b = ref.run_case(s.model, case, act, "ms", s.rank, s.alpha, ("proj", "fc2"))
        for k in a:
            if k != "stats":
                assert vc.rel_to_max(b[k], a[k]) < 1e-10, (act, k)


def test_reference_finite_differences(tmp_path):
    """Exact-mode gradients (LoRA and head) of the fp64 reference against central differences, std
    and ms, at a changed resolution."""
    config = dict(hidden_size=12, intermediate_size=20, num_hidden_layers=2, num_attention_heads=2,
                  image_size=8, patch_size=4, num_channels=3, layer_norm_eps=1e-6)
    vc.write_model(str(tmp_path), config, seed=3)
    m = ref.VitModel.load(str(tmp_path))
    rank, alpha, classes = 2, 3.0, 3
    case = vc.make_case(m.cfg, 2, rank, classes, seed=4, image=(8, 12))
    rng = np.random.default_rng(5)
    for norm in ("std", "ms"):
        res = ref.run_case(m, case, "exact", norm, rank, alpha)
        worst = 0.0
        for key in [k for k in case if k.startswith(("lora.", "head."))]:
            g = res["grad." + key]
            for _ in range(2):
                idx = tuple(rng.integers(0, n) for n in case[key].shape)
                vals = []
                for sign in (1, -1):
                    c2 = dict(case)
                    arr = case[key].astype(np.float64).copy()
                    arr[idx] += sign * 1e-6
                    c2[key] = arr
                    vals.append(float(ref.run_case(m, c2, "exact", norm, rank, alpha)["loss"][0]))
                fd = (vals[0] - vals[1]) / 2e-6
                worst = max(worst, abs(fd - g[idx]) / max(1e-3, np.abs(g).max()))
        print(f"finite differences ({norm}): worst error rel to max |grad| {worst:.2e}")
        assert worst < 1e-6


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_reference_modes_discriminate(workdir, name):
    """The cases tell the modes apart: approx gradients differ from exact ones by far more than the
    probe tolerance (logits do not), every ReGELU2 code occurs, the paper's --ms-lora merged differs
    from std for the same adapters (the default ms gives std's logits and gradients)."""
    s = _setup(workdir, name)
    for norm in ("std", "ms"):
        assert all(n > 0 for n in s.stats[norm]["code_counts"]), s.stats[norm]
        ex, ap = s.reference("exact", norm), s.reference("approx", norm)
        assert np.array_equal(ex["logits"], ap["logits"])
        diff = max(vc.rel_to_max(ap[k], ex[k]) for k in ex if k.startswith("grad.lora"))
        assert diff > 30 * vc.TOL["grad"], diff
    std = s.reference("exact", "std")
    for k, v in s.reference("exact", "ms").items():
        if k != "stats":
            assert vc.rel_to_max(v, std[k]) < 1e-10, k
    merged = ref.run_case(s.model, s.case, "exact", "ms", s.rank, s.alpha, s.targets, ms_lora="merged")
    assert vc.rel_to_max(merged["logits"], std["logits"]) > 30 * vc.TOL["logits"]


if __name__ == "__main__":
    sys.exit(pytest.main([os.path.abspath(__file__), "-v", "-s"]))
