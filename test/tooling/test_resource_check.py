"""scripts/ci/check_resources.py, the per-kernel resource check of `make cuda-resource-check`: kernels
planted to break each rule (test/fixtures/resource_planted*.cu) are caught, with the rule named, and a clean
kernel passes. Needs nvcc (the CUDA toolkit CI machines have; no GPU)."""
import os
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECK = os.path.join(REPO, "scripts", "ci", "check_resources.py")
pytestmark = pytest.mark.skipif(not shutil.which("nvcc"), reason="nvcc not found: the resource check needs the CUDA toolkit")


def check(source):
    src = os.path.join("test", "fixtures", source)
    p = subprocess.run([sys.executable, CHECK, src, "--launches", src], capture_output=True, text=True, cwd=REPO, timeout=300)
    print(p.stdout + p.stderr)
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^(planted_\w+)\(.*?  (ok|FAIL.*|warning.*)$", p.stdout, re.M)}
    return p, rows


def test_planted_register_spill_and_block_size_violations_are_caught():
    p, rows = check("resource_planted.cu")
    assert p.returncode == 1, p.returncode
    # 160 values live at once need > 128 registers; the launch is dim3(32, PLANTED_WARPS) = 512 threads
    assert re.match(r"FAIL: \d+ registers x 512 threads = \d+ > 65536", rows["planted_registers_kernel"]), rows
    assert rows["planted_spill_kernel"].startswith("FAIL: spills on the training hot path"), rows
    assert "not a constant expression" in rows["planted_runtime_block_kernel"], rows
    assert "no launch_kernel call" in rows["planted_unlaunched_kernel"], rows
    assert rows["planted_clean_kernel"] == "ok", rows
    assert len(re.findall(r"^check_resources.py: FAIL: sm_90 planted_", p.stdout, re.M)) == 4


def test_planted_static_shared_memory_is_caught():
    p, rows = check("resource_planted_smem.cu")
    assert p.returncode != 0
    assert rows["planted_smem_kernel"] == "FAIL: 52000 bytes of static shared memory > 49152", rows


def test_missing_source_is_one_line_error():
    p = subprocess.run([sys.executable, CHECK, "test/no_such_file.cu"], capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip() == "check_resources.py: test/no_such_file.cu: no such file (expected a CUDA source or a ptxas report)"
