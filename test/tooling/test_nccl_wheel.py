"""The Makefile finds NCCL from the PyPI wheel (nvidia-nccl-cu13 / -cu12: site-packages/nvidia/
nccl/{include,lib}) when the CUDA toolkit and the system have none: a wheel laid out like that
(the header and library copied from this machine's NCCL) on NCCL_PYTHON's path, with the system
folders taken away (NCCL_SYSTEM_DIRS=), is found and said, and a program built with the
trainers' NCCL flags carries an rpath to it and runs. Needs nvcc and an NCCL library to copy."""
import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NVCC = shutil.which("nvcc")
CUDA_INC = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(NVCC))), "include") if NVCC else ""
LIBS = sorted(glob.glob("/usr/local/cuda*/lib*/libnccl.so.2") + glob.glob("/usr/lib/*/libnccl.so.2"))
pytestmark = pytest.mark.skipif(not (NVCC and LIBS and os.path.isfile(os.path.join(CUDA_INC, "nccl.h"))),
                                reason="needs nvcc and an NCCL header and library to lay out as a wheel")


def test_nccl_from_the_pypi_wheel(tmp_path):
    wheel = tmp_path / "site" / "nvidia" / "nccl"
    (wheel / "include").mkdir(parents=True)
    (wheel / "lib").mkdir()
    shutil.copy(os.path.join(CUDA_INC, "nccl.h"), wheel / "include" / "nccl.h")
    shutil.copy(LIBS[0], wheel / "lib" / "libnccl.so.2")  # the wheel ships only the versioned name
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    p = subprocess.run(["make", "--no-print-directory", "print-nccl", "NCCL_SYSTEM_DIRS=", f"NCCL_PYTHON={sys.executable}"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    print(p.stdout)
    assert p.returncode == 0, p.stderr
    assert f"NCCL found (the PyPI wheel in {wheel}): GPU all-reduce with NCCL" in p.stdout
    flags = dict(re.findall(r"^(NCCL_\w+)=(.*)$", p.stdout, re.M))
    assert flags["NCCL_FLAGS"] == f"-DLLMC_HAVE_NCCL -I{wheel}/include"
    assert flags["NCCL_LIBS"] == f"-L{wheel}/lib -l:libnccl.so.2 -Xlinker -rpath={wheel}/lib"

    src = tmp_path / "v.cu"
    src.write_text('#include <nccl.h>\n#include <stdio.h>\nint main(void) { int v = 0; ncclGetVersion(&v); printf("nccl %d\\n", v); return v > 0 ? 0 : 1; }\n')
    exe = tmp_path / "v"
    subprocess.run([NVCC, str(src), "-o", str(exe)] + flags["NCCL_FLAGS"].split() + flags["NCCL_LIBS"].split(),
                   check=True, capture_output=True, timeout=300)
    dyn = subprocess.run(["readelf", "-d", str(exe)], capture_output=True, text=True).stdout
    assert re.search(r"\((RUNPATH|RPATH)\).*%s/lib" % re.escape(str(wheel)), dyn), dyn
    run_env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    out = subprocess.run([str(exe)], capture_output=True, text=True, env=run_env, timeout=60)
    assert out.returncode == 0 and re.fullmatch(r"nccl \d+\n", out.stdout), (out.stdout, out.stderr)
    ldd = subprocess.run(["ldd", str(exe)], capture_output=True, text=True, env=run_env).stdout
    assert f"libnccl.so.2 => {wheel}/lib/libnccl.so.2" in ldd, ldd  # loaded from the wheel, by the rpath


def test_no_nccl_anywhere_is_said(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    p = subprocess.run(["make", "--no-print-directory", "print-nccl", "NCCL_SYSTEM_DIRS=", f"NCCL_PYTHON={sys.executable}"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert "NCCL not found: multi-GPU gradients go through MPI on the host" in p.stdout, p.stdout
    assert "NCCL_FLAGS=\n" in p.stdout
