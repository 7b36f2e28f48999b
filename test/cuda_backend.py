"""What the whole-model CUDA tests (test/test_cuda_llama.py, test/test_cuda_vit.py) share: where
the CUDA side runs (the CPU emulator's build/emu/* binaries, or a real GPU's nvcc builds with
CUDA_TEST_BACKEND=gpu), running binaries and mpirun jobs, and the relative L2 error."""
import os
import shutil
import subprocess

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU = os.environ.get("CUDA_TEST_BACKEND", "emu") == "gpu"
ENV = dict(os.environ, OMP_NUM_THREADS="2")
MPIRUN = shutil.which("mpirun")


def binaries(trainer, probe):
    """(cuda trainer, cuda probe, cpu trainer, cpu probe) paths for e.g. ("train_llama", "llama_probe")."""
    cuda_train = trainer if GPU else f"build/emu/{trainer}"
    cuda_probe = f"test/{probe}" if GPU else f"build/emu/{probe}"
    return tuple(os.path.join(REPO, p) for p in (cuda_train, cuda_probe, trainer, f"test/{probe}"))


def need(path):
    """path, or a FAILED test when the binary was not built."""
    if not os.path.isfile(path):
        pytest.fail(f"{path} is missing: build it with `make {os.path.relpath(path, REPO)}`")
    return path


def run(cmd, check=True, timeout=600, env=None):
    cmd = [str(c) for c in cmd]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(ENV, **(env or {})))
    if check:
        assert p.returncode == 0, f"{' '.join(cmd)}\n{p.stdout[-3000:]}\n{p.stderr[-2000:]}"
    return p


def mpirun(np_, exe, args, check=True, env=None):
    """An mpirun job of np_ ranks of exe (each rank emulates its own GPU on the emulator); env:
    variables set for every rank."""
    if not MPIRUN:
        pytest.fail("mpirun not found: install openmpi-bin (scripts/ci/install_deps.sh does)")
    exports = [x for k, v in (env or {}).items() for x in ("-x", f"{k}={v}")]
    return run([MPIRUN, "--allow-run-as-root", "--oversubscribe", "-np", str(np_)] + exports + [need(exe)] + list(args), check=check)


def rel_l2(got, want):
    """||got - want|| / ||want|| (NaN or Inf in got: infinite)."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    if not np.all(np.isfinite(got)):
        return float("inf")
    n = np.linalg.norm(want)
    return float(np.linalg.norm(got - want) / n) if n > 0 else float(np.linalg.norm(got))
