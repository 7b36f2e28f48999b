"""--recompute N: exactly the first N of the L blocks recompute (and, with --offload host, move
their checkpoints to host memory); the others keep the mode's saved set. The recomputed forward
runs the kept one's operations in the same order from the block's saved input, so the logits, the
loss and every gradient equal the kept run (--recompute none) to the bit, for N = 0, 1, L/2 and L,
in every act x norm mode, with and without --offload host, on both models: the CPU probes
(build/test/*_probe) and the CUDA emulator's (build/emu/*_probe --device cuda), each against its
own backend's kept run (the emulator runs the CUDA kernels deterministically on the CPU).

Run:  /usr/bin/python3 -m pytest -q -x -p no:xdist test/model/test_recompute_count.py
"""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_cases as lc  # noqa: E402
import vit_cases as vc  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYERS = 4  # N = 0, 1, 2 (L/2), 4 (L): the kept, the mixed and the all-recomputed plans
COUNTS = [0, 1, LAYERS // 2, LAYERS]
ACT_NORM = [("exact", "std"), ("exact", "ms"), ("approx", "std"), ("approx", "ms")]
# (backend, probe flags): the emulator's probe plans and runs the CUDA layout (bf16, copy stream)
BACKENDS = {"cpu": ("build/test/{}", ()), "emu": ("build/emu/{}", ("--device", "cuda"))}


def _same_bits(kept, got, label):
    assert set(got) == set(kept), label
    for k in kept:
        a, b = np.ascontiguousarray(kept[k]), np.ascontiguousarray(got[k])
        assert a.shape == b.shape and a.tobytes() == b.tobytes(), (label, k, float(np.abs(a - b).max()))


def _runs(count):
    """(tag, --recompute value, extra flags) of every run compared with the kept one."""
    out = [(f"n{count}", str(count), ())]
    if count:  # --offload host moves the recomputed blocks' checkpoints (none at N = 0: refused there)
        out.append((f"n{count}.offload", str(count), ("--offload", "host")))
    return out


@pytest.fixture(scope="module")
def llama_case(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("recompute_llama"))
    cfg = lc.write_model(d, dict(lc.model_config("gqa_untied"), num_hidden_layers=LAYERS), seed=1)
    B, T, r, alpha = lc.SHAPES["gqa_untied"]
    cp = os.path.join(d, "case.safetensors")
    lc.st_io.save(cp, lc.make_case(cfg, B, T, r, seed=3))
    return d, cp, r, alpha


@pytest.fixture(scope="module")
def vit_case(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("recompute_vit"))
    cfg = vc.write_model(d, dict(vc.CONFIGS["square"], num_hidden_layers=LAYERS), seed=1)
    B, r, alpha, classes = vc.SHAPES["square"]
    cp = os.path.join(d, "case.safetensors")
    vc.st_io.save(cp, vc.make_case(cfg, B, r, classes, seed=3))
    return d, cp, r, alpha


def _probe(model, backend, monkeypatch):
    """The probe runner of `model` on `backend`, through the cases' own runners (their env overrides)."""
    path, flags = BACKENDS[backend]
    exe = os.path.join(REPO, path.format(f"{model}_probe"))
    if not os.path.isfile(exe):
        pytest.fail(f"{exe} is missing: build it with `make {os.path.relpath(exe, REPO)}`")
    var = "LLAMA_PROBE" if model == "llama" else "VIT_PROBE"
    monkeypatch.setenv(var, exe)
    monkeypatch.setenv(var + "_ARGS", " ".join(flags))
    return lc.run_probe if model == "llama" else vc.run_probe


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("act,norm", ACT_NORM, ids=[f"{a}-{n}" for a, n in ACT_NORM])
@pytest.mark.parametrize("model", ["llama", "vit"])
def test_recompute_count_is_bit_identical(llama_case, vit_case, monkeypatch, model, act, norm, backend):
    d, cp, r, alpha = llama_case if model == "llama" else vit_case
    run_probe = _probe(model, backend, monkeypatch)
    tag = f"{model}.{backend}.{act}.{norm}"
    kept = run_probe(d, cp, cp + f".{tag}.kept", act, norm, "none", r, alpha)
    for count in COUNTS:
        for name, rec, extra in _runs(count):
            got = run_probe(d, cp, cp + f".{tag}.{name}", act, norm, rec, r, alpha, extra=extra)
            _same_bits(kept, got, f"{tag} --recompute {rec} {' '.join(extra)}")
