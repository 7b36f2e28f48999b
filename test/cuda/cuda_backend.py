"""What the whole-model CUDA tests (test/cuda/test_llama_cuda.py, test/cuda/test_vit_cuda.py) share: where
the CUDA side runs (the CPU emulator's build/emu/* binaries, or a real GPU's nvcc builds with
CUDA_TEST_BACKEND=gpu), running binaries and mpirun jobs, and the relative L2 error."""
import os
import shutil
import subprocess

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU = os.environ.get("CUDA_TEST_BACKEND", "emu") == "gpu"
ENV = dict(os.environ, OMP_NUM_THREADS="2")
MPIRUN = shutil.which("mpirun")

# What the measured device memory (cudaMemGetInfo: in use now minus in use at start-up, after the
# CUDA context was made) may exceed the plan by. The plan names every byte the trainer allocates,
# arenas and cuBLAS's workspace included; the emulator allocates exactly those, so there the
# figures are equal (up to the line's rounding to 0.01 MiB). A GPU adds a cost no plan can name:
# cudaMalloc rounds each of the at most 6 arenas up to its 2 MiB page (< 12 MiB), CUDA loads the
# code of each kernel on its first launch (ours, cuBLAS's, cuBLASLt's: a few MiB to a few tens),
# and the library handles keep some state. 64 MiB bounds these in this estimate (not yet measured
# on a GPU: gpu_check.sh's smoke runs print both figures), plus 1 % of the plan for any per-byte
# overhead of the allocator.
MEASURED_OVER_PLAN_MIB = 64.0 if GPU else 0.0
MEASURED_OVER_PLAN_FRACTION = 0.01 if GPU else 0.0
LINE_ROUNDING_MIB = 0.01  # the memory line prints MiB with two decimals
BLAS_WORKSPACE_MIB = 32   # llmc/memory/cuda_workspace.h's BLAS_WORKSPACE_BYTES, a buffer of every CUDA plan


def check_measured_memory(planned, measured):
    """The measured device memory is the plan plus at most the stated constant and 1 % (GPU)."""
    assert planned - LINE_ROUNDING_MIB <= measured, (planned, measured)
    limit = planned * (1 + MEASURED_OVER_PLAN_FRACTION) + MEASURED_OVER_PLAN_MIB + LINE_ROUNDING_MIB
    assert measured <= limit, (f"measured {measured} MiB > planned {planned} MiB + {100 * MEASURED_OVER_PLAN_FRACTION:g} % + "
                               f"{MEASURED_OVER_PLAN_MIB} MiB")


def binaries(trainer, probe):
    """(cuda trainer, cuda probe, cpu trainer, cpu probe) paths for e.g. ("train_llama", "llama_probe").
    The CUDA trainer is a test build (the emulator's, or on a GPU build/test/'s nvcc build), with the
    fault injectors compiled in (-DLLMC_FAULTS, llmc/settings.h) that some of the tests plant."""
    cuda_train = f"build/test/{trainer}" if GPU else f"build/emu/{trainer}"
    cuda_probe = f"build/test/{probe}" if GPU else f"build/emu/{probe}"
    return tuple(os.path.join(REPO, p) for p in (cuda_train, cuda_probe, trainer, f"build/test/{probe}"))


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
