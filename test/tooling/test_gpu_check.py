"""scripts/ci/gpu_check.sh without a GPU: every step's command is replaced (GPU_CHECK_FAKE_CMD) so
that the script's own logic runs here: the summary file survives a kill in the middle, the hard
deadline cuts every step (each step's timeout is min(own limit, time left - margin)), the steps
come in the order of issue 12, and at most 8 files are left under $OUT."""
import os
import re
import signal
import subprocess
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "ci", "gpu_check.sh")
ORDER = ["machine", "build", "kernel checks", "memcheck", "racecheck", "initcheck", "smoke llama", "smoke vit",
         "switches", "whole models", "NCCL self-test", "benchmark"]


def env(out, **kw):
    e = dict(os.environ, OUT=str(out))
    e.update({k: str(v) for k, v in kw.items()})
    return e


def rows(summary):
    """(step, status) of every table row."""
    return [(m.group(1).strip(), m.group(2).strip()) for m in re.finditer(r"^\| ([^|]+) \| ([^|]+) \| [^|]* \| .*\|$", summary, re.M)
            if m.group(1).strip() not in ("step", "---")]


def kinds(rs):
    """The ORDER entry each row belongs to, consecutive repeats merged."""
    out = []
    for name, _ in rs:
        k = next(k for k in ORDER if name.startswith(k))
        if not out or out[-1] != k:
            out.append(k)
    return out


def test_summary_survives_a_kill_in_the_middle(tmp_path):
    p = subprocess.Popen(["bash", SCRIPT], env=env(tmp_path, GPU_CHECK_FAKE_CMD="sleep 0.3; echo fake run of $0"),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    summary = tmp_path / "summary.md"
    try:
        deadline = time.time() + 120
        while time.time() < deadline:  # until a few sanitizer steps have finished
            if summary.exists() and "| racecheck dev/cuda/attention | PASS" in summary.read_text():
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the fake run did not reach racecheck within 120 s")
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    text = summary.read_text()
    print(text)
    assert text.startswith("# gpu_check.sh results")
    # it says where it was killed: in a step, or between two
    assert re.search(r"^- state: (RUNNING '.+' since t=\d+ s|between steps, after '.+')", text, re.M), text
    rs = rows(text)
    assert rs[:3] == [("machine", "PASS"),
                      ("build for sm_90 (cuda-dev train_llama train_vit build/test/llama_probe "
                       "build/test/vit_probe)", "PASS"),
                      ("kernel checks (make test-gpu-kernels)", "PASS")], rs
    assert ("racecheck dev/cuda/attention", "PASS") in rs and not any(n.startswith("smoke") for n, _ in rs)
    assert len(os.listdir(tmp_path)) <= 8


def test_deadline_cuts_every_step_and_the_order_is_kept(tmp_path):
    t = time.time()
    p = subprocess.run(["bash", SCRIPT], env=env(tmp_path, GPU_CHECK_FAKE_CMD="sleep 100", GPU_CHECK_DEADLINE_S=9, GPU_CHECK_MARGIN_S=2),
                       capture_output=True, text=True, timeout=60)
    took = time.time() - t
    text = (tmp_path / "summary.md").read_text()
    print(text, f"took {took:.1f} s")
    assert p.returncode == 0
    # the first step gets min(420, 9 - 2 - ~0) s; the rest would get under 5 s: skipped. Writing the
    # ~30 skipped rows takes a few hundred ms here; 3 s is the slack for a busy machine.
    assert took < 9 + 3, took
    rs = rows(text)
    assert rs[1][1].startswith("TIMEOUT(") and int(re.search(r"\d+", rs[1][1]).group()) <= 7, rs[1]
    assert all(s == "SKIPPED" for _, s in rs[2:]), rs
    assert kinds(rs) == ORDER, kinds(rs)
    assert re.search(r"^- state: finished at t=\d+ s \(deadline 9 s\)", text, re.M)
    assert sorted(os.listdir(tmp_path)) == ["gpu_check.log", "sanitizer.txt", "summary.md"]


def test_smoke_variant_fits_four_minutes(tmp_path):
    p = subprocess.run(["bash", SCRIPT, "--smoke"], env=env(tmp_path, GPU_CHECK_FAKE_CMD="echo fake run of $0"),
                       capture_output=True, text=True, timeout=120)
    text = (tmp_path / "summary.md").read_text()
    print(text)
    assert p.returncode == 0
    assert "deadline 230 s" in text  # 4 minutes less the margin for the device call's transfers
    rs = rows(text)
    assert all(s == "PASS" for _, s in rs), rs
    assert kinds(rs) == [k for k in ORDER if k not in ("initcheck", "benchmark")], kinds(rs)
    assert [n for n, _ in rs if n.startswith("smoke")] == ["smoke llama --mode lowmem", "smoke vit --mode lowmem"]
    # the first lines of every sanitizer run are kept
    san = (tmp_path / "sanitizer.txt").read_text()
    assert "== memcheck dev/cuda/attention: PASS" in san and "== racecheck dev/cuda/attention: PASS" in san


def test_bad_argument_is_one_line_error(tmp_path):
    p = subprocess.run(["bash", SCRIPT, "--fast"], env=env(tmp_path), capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr == "gpu_check.sh: unknown argument '--fast' (expected nothing or --smoke)\n"
    assert os.listdir(tmp_path) == []


# Canned output in the formats the real steps print (make test-gpu-kernels' lines, compute-sanitizer's
# report, the trainers' last step and memory line, pytest -v), keyed by the step's name ($0).
CANNED = r'''case "$0" in
  "kernel checks"*) echo "test-gpu: dev/cuda/norms rc=0 seconds=1.5 57 passed, 0 failed"
                    echo "TIME  rmsnorm_forward 4096x4096 12.0 us 2800 GB/s"
                    echo "test-gpu: dev/cuda/loss rc=1 seconds=2.0 3 passed, 1 failed"; exit 1 ;;
  "memcheck"*) echo "========= COMPUTE-SANITIZER"
               echo "========= Invalid __global__ read of size 4 bytes"
               echo "=========     at attention_forward_kernel<64>+0x1f0"
               echo "========= ERROR SUMMARY: 1 error"; exit 3 ;;
  "smoke llama"*) echo "step    3/3 | loss 2.7028 | lr 1.00e-04"
                  echo "memory: planned 41.08 MiB (saved activations 3.66 MiB), measured device memory in use (cudaMemGetInfo, beyond the CUDA context) 60.50 MiB" ;;
  "switches"*) echo "| shape | run | switches | status | loss | grad norm | rate | vs ref | check | notes |"
               echo "| demo 4x128 | default | (none) | PASS | 5.100000 | 0.900000 | 1500.0 tok/s | - | reference | |"
               echo "| demo 4x128 | gemm | LLMC_ATTENTION=gemm | PASS | 5.300000 | 0.910000 | 900.0 tok/s | 0.60x | OUT OF BOUNDS: loss 3.9e-02 grad norm 1.1e-02 vs default | |"
               echo "| demo 4x128 | flash | LLMC_ATTENTION=flash | SKIPPED | - | - | | - | SKIPPED: 3 s of this shape's budget share left, a run here took up to 9 s | |"; exit 1 ;;
  "whole models"*) echo "test/cuda/test_llama_cuda.py::test_a[lowmem] PASSED"
                   echo "test/cuda/test_llama_cuda.py::test_b FAILED"
                   echo "FAILED test/cuda/test_llama_cuda.py::test_b - AssertionError: measured"; exit 1 ;;
esac'''


def test_step_results_reach_the_summary(tmp_path):
    p = subprocess.run(["bash", SCRIPT, "--smoke"], env=env(tmp_path, GPU_CHECK_FAKE_CMD=CANNED), capture_output=True, text=True, timeout=120)
    text = (tmp_path / "summary.md").read_text()
    print(text)
    assert p.returncode == 0
    assert "| kernel checks (make test-gpu-kernels) | FAIL(rc=1) |" in text
    assert "|   dev/cuda/norms | PASS | 1.5 | 57 passed, 0 failed |" in text
    assert "|   dev/cuda/loss | FAIL(rc=1) | 2.0 | 3 passed, 1 failed" in text
    assert "rmsnorm_forward 4096x4096 12.0 us 2800 GB/s" in text  # the kernel figures
    assert re.search(r"\| memcheck dev/cuda/attention \| FAIL\(rc=3\) \| [0-9.]+ \| ========= ERROR SUMMARY: 1 error "
                     r"========= Invalid __global__ read of size 4 bytes \|", text), text
    san = (tmp_path / "sanitizer.txt").read_text()
    assert san.startswith("== memcheck dev/cuda/attention: FAIL(rc=3)\n========= Invalid __global__ read of size 4 bytes\n"
                          "=========     at attention_forward_kernel<64>+0x1f0\n")
    assert "llama lowmem: memory: planned 41.08 MiB" in text and "measured" in text
    # the last step (its '|' turned to '/' in the cell) and the memory line, shortened
    assert re.search(r"\| smoke llama --mode lowmem \| PASS \| [0-9.]+ \| step +3/3 / loss 2.7028 / lr 1.00e-04 memory: planned "
                     r"41.08 MiB \(saved activations 3.66 MiB\), measured device memory in use 60.50 MiB +\|", text), text
    # the switches' table, and the bound a run broke in the step's row
    assert "## switches side by side (scripts/ci/switch_compare.sh)" in text
    assert "| demo 4x128 | gemm | LLMC_ATTENTION=gemm | PASS | 5.300000 | 0.910000 | 900.0 tok/s | 0.60x |" in text
    assert re.search(r"\| switches side by side \(demo packed\) \| FAIL\(rc=1\) \| [0-9.]+ \| 2 runs passed, 1 skipped; .*OUT OF BOUNDS: "
                     r"loss 3.9e-02", text), text
    assert re.search(r"\| whole models GPU vs CPU .* \| FAIL\(rc=1\) \| [0-9.]+ \| 1 passed, 1 failed so far; FAILED "
                     r"test/cuda/test_llama_cuda.py::test_b - AssertionError: measured \|", text), text
