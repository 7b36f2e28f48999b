"""LLaMA model tests: build/test/llama_probe (the C model, fp32 CPU backend) against the independent
PyTorch reference test/model/reference_llama.py (fp64), on small random configs in every mode, plus
self-checks of the reference itself.

Run:  /usr/bin/python3 -m pytest -q -rA test/model/test_llama_model.py   (-rA / -s shows the error lines)
      /usr/bin/python3 test/model/test_llama_model.py                    (same, verbose)
The probe must be built first (`make build/test/llama_probe`); a missing probe FAILS the probe tests.
LLAMA_PROBE overrides the probe path, LLAMA_PROBE_ARGS appends flags to every probe run.

Approx mode and fp32: the ReSiLU2 derivative jumps at its breakpoints, so a gate pre-activation
within fp32 rounding of a breakpoint could get another code in the probe than in the reference.
Cases are re-drawn until no gate pre-activation (in either norm mode) lies within
llama_cases.BREAKPOINT_MARGIN (2e-4) of a breakpoint; the reference computes codes on its own
fp64 pre-activations.
"""
import functools
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_cases as lc  # noqa: E402

ref = lc.ref
torch.set_num_threads(1)

CONFIG_NAMES = list(lc.CONFIGS)
# (act, norm, recompute): all four act x norm combinations, without and with block recompute
ACT_NORM = [("exact", "std"), ("exact", "ms"), ("approx", "std"), ("approx", "ms")]
MODES = [(a, n, r) for r in ("none", "block") for a, n in ACT_NORM]
MODE_IDS = [f"{a}-{n}-{r}" for a, n, r in MODES]
SUMMARY = []


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("llama_model"))


print_summary = lc.probe_compare.summary_printer(SUMMARY)  # an autouse fixture of this module


class Setup:
    """One config: model directory, fp64 reference model, a case away from the breakpoints."""

    def __init__(self, root, name, targets=lc.ALL_TARGETS):
        self.name = name
        self.dir = os.path.join(root, name)
        lc.write_model(self.dir, lc.model_config(name), seed=1)
        self.model = ref.LlamaModel.load(self.dir)
        self.batch, self.seq, self.rank, self.alpha = lc.SHAPES[name]
        self.targets = ref.parse_targets(targets)
        self.case, self.seed, self.stats = lc.make_safe_case(
            self.model, self.batch, self.seq, self.rank, self.alpha, self.targets, seed=7)
        tag = "all" if len(self.targets) == len(lc.ALL_TARGETS) else "_".join(self.targets)
        self.case_path = os.path.join(root, f"{name}.{tag}.case.safetensors")
        lc.st_io.save(self.case_path, self.case)
        self._ref = {}

    def reference(self, act, norm):
        if (act, norm) not in self._ref:
            self._ref[(act, norm)] = ref.run_case(self.model, self.case, act, norm, self.rank,
                                                  self.alpha, self.targets)
        return self._ref[(act, norm)]

    def probe(self, act, norm, recompute, out_name):
        out = os.path.join(os.path.dirname(self.case_path), out_name)
        return lc.run_probe(self.dir, self.case_path, out, act, norm, recompute, self.rank,
                            self.alpha, self.targets)


@functools.lru_cache(maxsize=None)
def _setup(root, name, targets=tuple(lc.ALL_TARGETS)):
    return Setup(root, name, targets)


# ---------------------------------------------------------------------------------------------
# the probe against the reference

@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_probe_matches_reference(workdir, name, mode):
    act, norm, recompute = mode
    s = _setup(workdir, name)
    want = s.reference(act, norm)
    got = s.probe(act, norm, recompute, f"{name}.{act}.{norm}.{recompute}.out.safetensors")
    errs = lc.compare(want, got)
    SUMMARY.append(lc.check_errors(errs, f"{name:12s} {act:6s} {norm:3s} {recompute:5s}"))


@pytest.mark.parametrize("act,norm", ACT_NORM, ids=[f"{a}-{n}" for a, n in ACT_NORM])
@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_probe_recomputed_and_offloaded_blocks_are_bit_identical(workdir, name, act, norm):
    """--recompute block runs each block's own forward again (ReSiLU2 and MS norms under lowmem),
    op for op, from its saved input, and --offload host only moves that input through host memory
    (byte copies): on the CPU backend the logits, the loss and every gradient equal the run that
    keeps the block's activations, to the bit (the same fp32 operations in the same order)."""
    s = _setup(workdir, name)
    kept = s.probe(act, norm, "none", f"bits.{name}.{act}.{norm}.none.out.safetensors")
    for tag, extra in (("block", ()), ("offload", ("--offload", "host"))):
        out = os.path.join(workdir, f"bits.{name}.{act}.{norm}.{tag}.out.safetensors")
        got = lc.run_probe(s.dir, s.case_path, out, act, norm, "block", s.rank, s.alpha, s.targets, extra=extra)
        lc.probe_compare.assert_same_bits(kept, got, tag)


@pytest.mark.parametrize("norm", ["std", "ms"])
def test_probe_offload_of_many_blocks_is_bit_identical(workdir, norm):
    """Five blocks, so that the forward reuses both staging buffers and the backward fetches every
    block input but the last two from the host (with two blocks the staging buffers still hold
    the forward's inputs and a missing fetch would go unseen): --offload host equals the kept run
    bit for bit, under standard norms (recomputed on a copy) and MS norms (in place)."""
    d = os.path.join(workdir, "five_blocks")
    cfg = lc.write_model(d, dict(lc.model_config("gqa_untied"), num_hidden_layers=5), seed=1)
    B, T, r, alpha = lc.SHAPES["gqa_untied"]
    cp = os.path.join(d, "case.safetensors")
    lc.st_io.save(cp, lc.make_case(cfg, B, T, r, seed=3))
    kept = lc.run_probe(d, cp, cp + f".{norm}.kept", "approx", norm, "none", r, alpha)
    got = lc.run_probe(d, cp, cp + f".{norm}.offload", "approx", norm, "block", r, alpha, extra=("--offload", "host"))
    lc.probe_compare.assert_same_bits(kept, got, "offload")


@pytest.mark.parametrize("mode", [MODES[0], MODES[3]], ids=[MODE_IDS[0], MODE_IDS[3]])
def test_probe_lora_subset(workdir, mode):
    """LoRA on some targets only (q, v, down): no adapter, no gradient for the others."""
    act, norm, recompute = mode
    s = _setup(workdir, "gqa_untied", ("q", "v", "down"))
    got = s.probe(act, norm, recompute, f"subset.{act}.{norm}.out.safetensors")
    errs = lc.compare(s.reference(act, norm), got)
    SUMMARY.append(lc.check_errors(errs, f"{'q,v,down':12s} {act:6s} {norm:3s} {recompute:5s}"))


def _probe_full(s, out, act, norm, recompute=None):
    """The probe under --full on s's model and case (no adapter flags; the case's adapters are ignored), its
    outputs written to out; without --recompute where recompute is None."""
    cmd = [lc.probe_path(), "--model", s.dir, "--case", s.case_path, "--out-file", out, "--act", act, "--norm", norm]
    cmd += (["--recompute", recompute] if recompute else []) + ["--full"]
    p = lc.subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return lc.st_io.load(out)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_probe_full_finetuning_matches_reference(workdir, mode):
    """--full: the gradient of every linear weight (of the merged model under MS norms) against
    the reference, in every mode; the case's adapters are ignored."""
    act, norm, recompute = mode
    s = _setup(workdir, "gqa_untied")
    key = ("full", act, norm)
    if key not in s._ref:
        s._ref[key] = ref.run_case(s.model, s.case, act, norm, s.rank, s.alpha, s.targets, full=True)
    want = s._ref[key]
    errs = lc.compare(want, _probe_full(s, os.path.join(workdir, f"full.{act}.{norm}.{recompute}.out.safetensors"),
                                        act, norm, recompute))
    assert sum(k.endswith(".W") for k in want) == 2 * 7
    SUMMARY.append(lc.check_errors(errs, f"{'full':12s} {act:6s} {norm:3s} {recompute:5s}"))


FAMILIES = ["qwen2", "qwen3", "llama_bias"]


@pytest.mark.parametrize("mode", [MODES[0], MODES[3], MODES[5]], ids=[MODE_IDS[0], MODE_IDS[3], MODE_IDS[5]])
@pytest.mark.parametrize("name", FAMILIES)
def test_probe_full_finetuning_families(workdir, name, mode):
    """--full on the families' additions: the biases and Qwen3's q/k norms train (their gradients
    against the reference), beside every linear weight, in baseline, lowmem and lowmem + recompute."""
    act, norm, recompute = mode
    s = _setup(workdir, name)
    want = ref.run_case(s.model, s.case, act, norm, s.rank, s.alpha, s.targets, full=True)
    got = _probe_full(s, os.path.join(workdir, f"full.{name}.{act}.{norm}.{recompute}.out.safetensors"), act, norm,
                      recompute)
    c = s.model.cfg
    n_bias = sum(c.bias[t] for t in lc.ALL_TARGETS)
    assert sum(k.endswith(".b") for k in want) == c.n_layers * n_bias > 0 or c.qk_norm
    assert sum(k.endswith("_norm") and ("q_norm" in k or "k_norm" in k) for k in want) == (2 * c.n_layers if c.qk_norm else 0)
    errs = lc.compare(want, got)
    SUMMARY.append(lc.check_errors(errs, f"{'full ' + name:12s} {act:6s} {norm:3s} {recompute:5s}"))


def test_reference_family_additions_matter(workdir):
    """The oracle is only as good as the difference it sees: dropping Qwen2's biases, the LLaMA
    biases or Qwen3's q/k norms from the reference moves its logits far beyond the tolerance, so a
    trainer that ignored them (as it did before these families were read) fails the tests above."""
    for name in FAMILIES:
        s = _setup(workdir, name)
        w = dict(s.model.w)
        for k in list(w):
            if k.endswith(".b") or k.endswith("q_norm") or k.endswith("k_norm"):
                w[k] = torch.zeros_like(w[k]) if k.endswith(".b") else torch.ones_like(w[k])
        tokens = torch.from_numpy(s.case["tokens"][:, :-1].astype(np.int64))
        stripped = ref.forward(s.model, tokens, {}, 1.0, weights=w)
        plain = ref.forward(s.model, tokens, {}, 1.0)
        diff = lc.rel_to_max(stripped.detach().numpy(), plain.detach().numpy())
        print(f"{name}: logits without the family's additions differ by {diff:.2e} (relative to max)")
        assert diff > 100 * lc.TOL["logits"], name


@pytest.mark.parametrize("norm", ["std", "ms"])
def test_probe_full_finetuning_tied_head_trains_embedding(workdir, norm):
    """--full with a tied head: the embedding's gradient gathers both its uses (input rows and head),
    besides every linear weight, the final norm and (std) the block norms."""
    s = _setup(workdir, "mha_tied")
    want = ref.run_case(s.model, s.case, "exact", norm, s.rank, s.alpha, s.targets, full=True)
    got = _probe_full(s, os.path.join(workdir, f"full.tied.{norm}.out.safetensors"), "exact", norm)
    assert "grad.embed" in want and "grad.lm_head" not in want and ("grad.0.attn_norm" in want) == (norm == "std")
    errs = lc.compare(want, got)
    worst_extra = max(lc.rel_to_max(got[k], want[k]) for k in want if k.startswith("grad.") and not k.endswith(".W"))
    print(f"full tied {norm}: embedding / norms worst {worst_extra:.2e}")
    SUMMARY.append(lc.check_errors(errs, f"{'full tied':12s} exact  {norm:3s} none "))


@pytest.mark.parametrize("mode", [MODES[0], MODES[3], MODES[5]], ids=[MODE_IDS[0], MODE_IDS[3], MODE_IDS[5]])
def test_probe_packed_examples_match_separate_runs(workdir, mode):
    """Packed instruction data: examples of lengths 4, 5, 2 in one row (plus an ordinary row).
    With example starts, positions restart and attention stays inside each example, so the
    probe's logits on each example equal the reference run on that example ALONE, and the
    gradient equals the count-weighted sum of the per-example gradients."""
    act, norm, recompute = mode
    s = _setup(workdir, "gqa_untied")
    B, T = s.case["tokens"].shape[0], s.case["tokens"].shape[1] - 1
    segments = [(0, 4), (4, 9), (9, 11)]
    starts = np.zeros((B, T), np.uint8)
    for a, _ in segments:
        starts[0, a] = 1
    case = dict(s.case)
    case["starts"] = starts
    path = os.path.join(workdir, "packed.case.safetensors")
    lc.st_io.save(path, case)
    out = os.path.join(workdir, f"packed.{act}.{norm}.{recompute}.out.safetensors")
    got = lc.run_probe(s.dir, path, out, act, norm, recompute, s.rank, s.alpha, s.targets)
    mask = s.case["mask"].astype(np.float64)
    total = mask.sum()
    grads = {}
    worst = 0.0
    pieces = [(0, a, b) for a, b in segments] + [(b, 0, T) for b in range(1, B)]
    for row, a, b in pieces:
        sub = {k: v for k, v in s.case.items() if k.startswith("lora.")}
        sub["tokens"] = s.case["tokens"][row:row + 1, a:b + 1]
        sub["mask"] = s.case["mask"][row:row + 1, a:b]
        if sub["mask"].sum() == 0:
            continue
        r = ref.run_case(s.model, sub, act, norm, s.rank, s.alpha, s.targets)
        worst = max(worst, lc.rel_to_max(got["logits"][row, a:b], r["logits"][0]))
        w = sub["mask"].sum() / total
        for k, v in r.items():
            if k.startswith("grad."):
                grads[k] = grads.get(k, 0.0) + w * v
    gerr = max(lc.rel_to_max(got[k], v) for k, v in grads.items())
    SUMMARY.append(f"{'packed':12s} {act:6s} {norm:3s} {recompute:5s}: logits {worst:.2e}  grad {gerr:.2e}")
    assert worst < lc.TOL["logits"] and gerr < lc.TOL["grad"]
    # and packing matters: without the starts the first row's later examples see earlier ones
    plain = lc.run_probe(s.dir, s.case_path, out + ".plain", act, norm, recompute, s.rank, s.alpha, s.targets)
    assert lc.rel_to_max(plain["logits"][0, 4:], got["logits"][0, 4:]) > 100 * lc.TOL["logits"]


@pytest.mark.parametrize("full", [False, True], ids=["lora", "full"])
def test_probe_swiglu_product_recompute_changes_nothing(workdir, full):
    """--swiglu-product recompute rebuilds the down projection's input in backward: outputs are
    the same as when it is kept (LoRA and full fine-tuning)."""
    s = _setup(workdir, "gqa_untied")
    outs = []
    for keep in ("keep", "recompute"):
        out = os.path.join(workdir, f"product.{keep}.{full}.out.safetensors")
        cmd = [lc.probe_path(), "--model", s.dir, "--case", s.case_path, "--out-file", out, "--mode", "lowmem",
               "--swiglu-product", keep]
        cmd += ["--full"] if full else ["--lora-rank", str(s.rank), "--lora-alpha", str(s.alpha)]
        p = lc.subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        outs.append(lc.st_io.load(out))
    assert sorted(outs[0]) == sorted(outs[1])
    for k in outs[0]:
        assert np.array_equal(outs[0][k], outs[1][k]), k


# ---------------------------------------------------------------------------------------------
# MS-RMSNorm under LoRA trains what standard norms train: the adapters keep the original model's
# parameterisation (they see gamma*z, not the merged input z)

MS_LORA_MODES = [("exact", "none"), ("approx", "none"), ("exact", "block"), ("approx", "block")]
MS_LORA_IDS = [f"{a}-{r}" for a, r in MS_LORA_MODES]


def _std_vs_ms(s, act, recompute, tag, label):
    """test/model/probe_compare.py's std_vs_ms within this model's TOL."""
    return lc.probe_compare.std_vs_ms(s, lc.TOL, f"{label:12s}", act, recompute, tag, SUMMARY)


@pytest.mark.parametrize("act,recompute", MS_LORA_MODES, ids=MS_LORA_IDS)
def test_ms_lora_gradients_equal_std(workdir, act, recompute):
    """--norm ms (gamma merged into q, k, v, gate, up) gives every LoRA gradient of --norm std: the
    adapters still act on gamma*z. Before, they acted on z and the gradients differed by O(1)."""
    _std_vs_ms(_setup(workdir, "gqa_untied"), act, recompute, "msstd", "gqa_untied")


def test_ms_lora_merged_is_the_papers_variant(workdir):
    """--ms-lora merged keeps the paper's parameterisation (adapters on the merged input z): equal
    to the reference's merged variant, and NOT to the original model's gradients."""
    s = _setup(workdir, "gqa_untied")
    out = os.path.join(workdir, "merged.out.safetensors")
    got = lc.run_probe(s.dir, s.case_path, out, "exact", "ms", "none", s.rank, s.alpha, s.targets, ms_lora="merged")
    want = ref.run_case(s.model, s.case, "exact", "ms", s.rank, s.alpha, s.targets, ms_lora="merged")
    SUMMARY.append(lc.check_errors(lc.compare(want, got), f"{'ms merged':12s} exact  ms  none "))
    g, name = lc.compare(s.reference("exact", "std"), got)["grad"]
    print(f"--ms-lora merged vs the original model's gradients: {g:.2e} ({name})")
    assert g > 100 * lc.TOL["grad"]


def _setup_gammas(root, name, gammas):
    """gqa_untied with its block norms' gammas replaced by gammas(rng, d) (the final norm too)."""
    d = os.path.join(root, name)
    s = _setup(root, "gqa_untied")
    os.makedirs(d, exist_ok=True)
    t = lc.st_io.load(os.path.join(s.dir, "model.safetensors"))
    rng = np.random.default_rng(3)
    for k in t:
        if k.endswith("layernorm.weight") or k == "model.norm.weight":
            t[k] = gammas(rng, t[k].shape[0]).astype(np.float32)
    lc.st_io.save(os.path.join(d, "model.safetensors"), t, metadata={"format": "pt"})
    lc.shutil.copy(os.path.join(s.dir, "config.json"), os.path.join(d, "config.json"))
    g = Setup.__new__(Setup)
    g.__dict__.update(s.__dict__)
    g.dir, g.name, g._ref = d, name, {}
    g.model = ref.LlamaModel.load(d)
    return g


@pytest.mark.parametrize("kind", ["wide", "zero"])
def test_ms_lora_equals_std_with_extreme_gammas(workdir, kind):
    """The same with gammas spanning four orders of magnitude, and with zero gammas (exact act:
    these gate pre-activations are not kept away from the ReSiLU2 breakpoints)."""
    s = _setup_gammas(workdir, f"gammas_{kind}", lc.probe_compare.EXTREME_GAMMAS[kind])
    _std_vs_ms(s, "exact", "none", f"gammas_{kind}", f"gammas {kind}")


def test_probe_deterministic(workdir):
    """Two runs on the same input give bitwise identical outputs."""
    s = _setup(workdir, "gqa_untied")
    a = s.probe("approx", "ms", "none", "det1.out.safetensors")
    b = s.probe("approx", "ms", "none", "det2.out.safetensors")
    lc.probe_compare.assert_same_bits(a, b, "two identical runs")


# ---------------------------------------------------------------------------------------------
# self-checks of the reference (no probe needed)

def test_reference_resilu2_backward_is_step_rule():
    """ReSiLU2: forward is exact SiLU; backward is exactly dy * L[code] with the float32 levels."""
    L = ref.resilu2_levels()
    assert L.dtype == np.float32 and L[0] == 0.0
    np.testing.assert_allclose(L, [0.0, -0.040603572, 1.0403218, 1.0], atol=1e-7)
    c = ref.RESILU2_C
    for dtype in (torch.float32, torch.float64):
        special = []
        for ci in c:
            cc = torch.tensor(ci, dtype=dtype)
            special += [float(cc), float(torch.nextafter(cc, torch.tensor(-np.inf, dtype=dtype))),
                        float(torch.nextafter(cc, torch.tensor(np.inf, dtype=dtype)))]
        g = torch.Generator().manual_seed(0)
        x = torch.cat([torch.tensor(special, dtype=dtype),
                       10 * torch.randn(2000, generator=g, dtype=dtype)]).requires_grad_(True)
        dy = torch.randn(x.shape, generator=g, dtype=dtype)
        y = ref.ReSiLU2.apply(x)
        assert torch.equal(y.detach(), x.detach() * torch.sigmoid(x.detach()))
        (dx,) = torch.autograd.grad(y, x, dy)
        xd = x.detach().double().numpy()
        # the rule, written out independently: strict comparisons, levels cast to dtype
        code = sum((xd > np.asarray(ci, dtype=np.float64 if dtype == torch.float64 else np.float32)
                    ).astype(int) for ci in c)
        want = dy * torch.from_numpy(L[code]).to(dtype)
        assert torch.equal(dx, want)
        assert set(code.tolist()) == {0, 1, 2, 3}


def _lora_dict(model, case, targets):
    lora = {}
    for l in range(model.cfg.n_layers):
        for t in targets:
            lora[(l, t)] = (torch.tensor(case[f"lora.{l}.{t}.A"], dtype=model.dtype),
                            torch.tensor(case[f"lora.{l}.{t}.B"], dtype=model.dtype))
    return lora


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_reference_ms_merge_keeps_forward(workdir, name):
    """Merging gamma into q,k,v / gate,up leaves the model unchanged: ms logits == std logits; the
    default ms (adapters on gamma*z) gives std's logits and gradients for the same adapters; the
    paper's --ms-lora merged does with LoRA A converted as A_ms = A_std * gamma[None, :] (the
    inverse of its export rule), the gradients relating by dA_std = dA_ms * gamma[None, :],
    dB_std = dB_ms."""
    s = _setup(workdir, name)
    m = s.model
    tokens = torch.from_numpy(s.case["tokens"][:, :-1].astype(np.int64))
    plain = {}
    std0 = ref.forward(m, tokens, plain, 1.0, "exact", "std")
    ms0 = ref.forward(m, tokens, plain, 1.0, "exact", "ms")
    assert lc.rel_to_max(ms0.numpy(), std0.numpy()) < 1e-12

    case_ms = dict(s.case)
    gamma_of = {"q": "attn_norm", "k": "attn_norm", "v": "attn_norm",
                "gate": "mlp_norm", "up": "mlp_norm"}
    for l in range(m.cfg.n_layers):
        for t, gname in gamma_of.items():
            gamma = m.w[f"{l}.{gname}"].numpy()
            case_ms[f"lora.{l}.{t}.A"] = s.case[f"lora.{l}.{t}.A"].astype(np.float64) * gamma[None, :]
    for act in ("exact", "approx"):
        a = ref.run_case(m, s.case, act, "std", s.rank, s.alpha)
        exact = ref.run_case(m, s.case, act, "ms", s.rank, s.alpha)
        for k in a:
            if k != "stats":
                assert lc.rel_to_max(exact[k], a[k]) < 1e-10, (act, k)
        b = ref.run_case(m, case_ms, act, "ms", s.rank, s.alpha, ms_lora="merged")
        assert lc.rel_to_max(b["logits"], a["logits"]) < 1e-12
        assert abs(b["loss"][0] - a["loss"][0]) < 1e-12 * abs(a["loss"][0])
        for l in range(m.cfg.n_layers):
            for t in lc.ALL_TARGETS:
                dA = b[f"grad.lora.{l}.{t}.A"]
                if t in gamma_of:
                    dA = dA * m.w[f"{l}.{gamma_of[t]}"].numpy()[None, :]
                assert lc.rel_to_max(dA, a[f"grad.lora.{l}.{t}.A"]) < 1e-10, (act, l, t)
                assert lc.rel_to_max(b[f"grad.lora.{l}.{t}.B"],
                                     a[f"grad.lora.{l}.{t}.B"]) < 1e-10, (act, l, t)


def test_reference_finite_differences(tmp_path):
    """Exact-mode LoRA gradients of the fp64 reference against central differences (std and ms)
    on a tiny GQA config."""
    config = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=13,
                  rope_theta=10000.0, tie_word_embeddings=False)
    lc.write_model(str(tmp_path), config, seed=3)
    m = ref.LlamaModel.load(str(tmp_path))
    rank, alpha = 3, 5.0
    case = lc.make_case(m.cfg, 2, 5, rank, seed=4)
    rng = np.random.default_rng(5)
    for norm in ("std", "ms"):
        res = ref.run_case(m, case, "exact", norm, rank, alpha)
        worst = 0.0
        for key in [k for k in case if k.startswith("lora.")]:
            g = res["grad." + key]
            for _ in range(2):
                idx = tuple(rng.integers(0, n) for n in case[key].shape)
                vals = []
                for sign in (1, -1):
                    c2 = dict(case)
                    arr = case[key].astype(np.float64).copy()
                    arr[idx] += sign * 1e-6
                    c2[key] = arr
                    vals.append(_loss_only(m, c2, norm, rank, alpha))
                fd = (vals[0] - vals[1]) / 2e-6
                err = abs(fd - g[idx]) / max(1e-3, np.abs(g).max())
                worst = max(worst, err)
        print(f"finite differences ({norm}): worst error rel to max |grad| {worst:.2e}")
        assert worst < 1e-6


def _loss_only(model, case, norm, rank, alpha):
    tokens = torch.from_numpy(np.asarray(case["tokens"], dtype=np.int64))
    mask = torch.from_numpy(np.asarray(case["mask"], dtype=np.float64))
    lora = _lora_dict(model, case, lc.ALL_TARGETS)
    with torch.no_grad():
        logits = ref.forward(model, tokens[:, :-1], lora, alpha / rank, "exact", norm)
        return float(ref.masked_ce(logits, tokens[:, 1:], mask))


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_reference_modes_discriminate(workdir, name):
    """The cases can tell the modes apart: approx gradients differ from exact ones by far more
    than the probe tolerance (logits do not), every ReSiLU2 code occurs, and the paper's --ms-lora
    merged differs from std for the same adapters (the default ms does not: it is std's function)."""
    s = _setup(workdir, name)
    for norm in ("std", "ms"):
        assert all(n > 0 for n in s.stats[norm]["code_counts"]), s.stats[norm]
        ex, ap = s.reference("exact", norm), s.reference("approx", norm)
        assert np.array_equal(ex["logits"], ap["logits"])
        diff = max(lc.rel_to_max(ap[k], ex[k]) for k in ex if k.startswith("grad."))
        assert diff > 30 * lc.TOL["grad"], diff
    merged = ref.run_case(s.model, s.case, "exact", "ms", s.rank, s.alpha, s.targets, ms_lora="merged")
    assert lc.rel_to_max(merged["logits"], s.reference("exact", "std")["logits"]) > 30 * lc.TOL["logits"]


def test_reference_llama3_rope_scaling():
    """Llama-3.1 frequency adjustment: high frequencies kept, low ones divided by factor, the
    band between interpolated; and it changes the logits of the llama3_rope config."""
    cfg = ref.LlamaConfig(lc.model_config("llama3_rope"))
    plain = ref.LlamaConfig({**lc.model_config("llama3_rope"), "rope_scaling": None})
    inv, inv0 = ref.rope_inv_freq(cfg).numpy(), ref.rope_inv_freq(plain).numpy()
    rs = cfg.rope_scaling
    wavelen = 2 * np.pi / inv0
    hi = wavelen < rs["original_max_position_embeddings"] / rs["high_freq_factor"]
    lo = wavelen > rs["original_max_position_embeddings"] / rs["low_freq_factor"]
    mid = ~hi & ~lo
    assert hi.any() and lo.any() and mid.any()
    np.testing.assert_array_equal(inv[hi], inv0[hi])
    np.testing.assert_allclose(inv[lo], inv0[lo] / rs["factor"], rtol=1e-15)
    assert np.all(inv[mid] < inv0[mid]) and np.all(inv[mid] > inv0[mid] / rs["factor"])
    # the interpolation is continuous at both band edges
    s_of = (rs["original_max_position_embeddings"] / wavelen - rs["low_freq_factor"]) / (
        rs["high_freq_factor"] - rs["low_freq_factor"])
    np.testing.assert_allclose(inv[mid], (1 - s_of[mid]) * inv0[mid] / rs["factor"]
                               + s_of[mid] * inv0[mid], rtol=1e-15)


def test_reference_llama3_scaling_changes_logits(workdir):
    s = _setup(workdir, "llama3_rope")
    m2 = ref.LlamaModel(ref.LlamaConfig({**lc.model_config("llama3_rope"), "rope_scaling": None}),
                        ref.load_weights_np(s.dir))
    a = ref.run_case(s.model, s.case, "exact", "std", s.rank, s.alpha)
    b = ref.run_case(m2, s.case, "exact", "std", s.rank, s.alpha)
    assert lc.rel_to_max(b["logits"], a["logits"]) > 30 * lc.TOL["logits"]


if __name__ == "__main__":
    sys.exit(pytest.main([os.path.abspath(__file__), "-v", "-s"]))
