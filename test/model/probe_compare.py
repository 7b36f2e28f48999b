"""Comparing a C probe's output (logits, loss, gradients) with a PyTorch reference's: shared by
the LLaMA and ViT model tests (test/model/llama_cases.py, test/model/vit_cases.py), which pass their own
tolerances; two probe outputs to the bit; the MS-vs-std comparison and the worst-errors summary both model
tests run; and the extreme norm gammas both try under MS norms."""
import numpy as np
import pytest


def rel_to_max(got, want):
    """max |got - want| / max |want| (NaN in got counts as infinite error)."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        raise AssertionError(f"shape {list(got.shape)} != expected {list(want.shape)}")
    if not np.all(np.isfinite(got)):
        return float("inf")
    scale = float(np.abs(want).max()) if want.size else 0.0
    err = float(np.abs(got - want).max()) if want.size else 0.0
    return err / scale if scale > 0 else err


def compare(ref_out, got):
    """Worst relative errors of probe output vs reference: {"logits": e, "loss": e,
    "grad": (e, name)}. Also checks that the probe wrote exactly the expected tensors."""
    want_keys = {k for k in ref_out if k != "stats"}
    missing = sorted(want_keys - set(got))
    extra = sorted(set(got) - want_keys)
    if missing or extra:
        raise AssertionError(f"probe output keys: missing {missing}, unexpected {extra}")
    errs = {"logits": rel_to_max(got["logits"], ref_out["logits"]),
            "loss": rel_to_max(got["loss"], ref_out["loss"])}
    worst = (0.0, "-")
    for k in sorted(want_keys):
        if k.startswith("grad."):
            e = rel_to_max(got[k], ref_out[k])
            if e >= worst[0]:
                worst = (e, k)
    errs["grad"] = worst
    return errs


def check_errors(errs, tol, label=""):
    """Print the worst errors on one line and assert them against tol."""
    g, gname = errs["grad"]
    line = (f"{label}: logits {errs['logits']:.2e}  loss {errs['loss']:.2e}  "
            f"grad {g:.2e} ({gname})")
    print(line)
    bad = [q for q in ("logits", "loss") if not errs[q] < tol[q]]
    if not g < tol["grad"]:
        bad.append("grad")
    assert not bad, f"{line}: over tolerance {', '.join(bad)} (tolerances {tol})"
    return line


def summary_printer(summary):
    """A module's autouse fixture (assign it to a name in the test module) that prints the lines its tests
    appended to summary, the worst errors they saw, once the module's tests have run."""
    @pytest.fixture(scope="module", autouse=True)
    def print_summary():
        yield
        if summary:
            print("\nworst relative errors (probe fp32 vs reference fp64; max|diff| / max|ref|):")
            for line in summary:
                print("  " + line)
    return print_summary


def assert_same_bits(want, got, label=""):
    """got holds want's tensors to the bit: the same names, and each the same dtype, shape and bytes."""
    assert sorted(got) == sorted(want), (label, sorted(set(got) ^ set(want)))
    for k in want:
        a, b = np.ascontiguousarray(want[k]), np.ascontiguousarray(got[k])
        assert a.dtype == b.dtype and a.shape == b.shape, (label, k, a.dtype, b.dtype, a.shape, b.shape)
        assert a.tobytes() == b.tobytes(), (label, k, float(np.abs(a.astype(np.float64) - b).max()))


def std_vs_ms(s, tol, label, act, recompute, tag, summary):
    """The probe under --norm ms and --norm std (s: a model test's Setup, its reference() and probe()) against
    the fp64 reference of the ORIGINAL model (std norms), then against each other. Each probe is within tol of
    those fp64 values, so the two fp32 runs are within 2 tol of each other (triangle inequality); what they
    measure is printed, and two of the lines go to summary. Returns the two probes' outputs by norm."""
    want = s.reference(act, "std")
    got = {norm: s.probe(act, norm, recompute, f"{tag}.{act}.{norm}.{recompute}.out.safetensors")
           for norm in ("std", "ms")}
    summary.append(check_errors(compare(want, got["ms"]), tol, f"{label} {act:6s} ms  {recompute:5s} vs std ref"))
    check_errors(compare(want, got["std"]), tol, f"{label} {act:6s} std {recompute:5s} vs std ref")
    summary.append(check_errors(compare(dict(got["std"]), got["ms"]), {k: 2 * v for k, v in tol.items()},
                                f"{label} {act:6s} ms vs std probe {recompute:5s}"))
    return got


# Norm gammas that stress the MS merge (W diag(gamma)), used by both model tests.
def wide_gammas(rng, n):
    """log-uniform over 1e-2 .. 1e2 with random signs: four orders of magnitude"""
    return np.sign(rng.standard_normal(n)) * 10.0 ** rng.uniform(-2, 2, n)


def zero_gammas(rng, n):
    """1 + 0.3 N(0, 1) with every 5th entry exactly 0 (the merged layer has no inverse there)"""
    g = 1.0 + 0.3 * rng.standard_normal(n)
    g[::5] = 0.0
    return g


EXTREME_GAMMAS = {"wide": wide_gammas, "zero": zero_gammas}
