"""Which attention the CUDA backend runs (LLMC_ATTENTION=cudnn|gemm, llmc/ops.h), and that cuDNN's
attention is built and linked where make finds cuDNN (llmc/cuda/attention_cudnn.cu).

cuDNN's fused attention cannot run without a GPU: the CPU emulator has no cuDNN, so nothing here runs
it. Its numbers are checked on a GPU only, by test_llama_cuda.py's test_cuda_attention_cudnn (skipped on
the emulator) and scripts/ci/gpu_check.sh's side-by-side step; until dev/gpu/RESULTS.md records such a
run it is "not yet run on a GPU". What runs everywhere:
  - the emulator build selects the in-house GEMM path by default, says so in its "attention:" line, and
    trains with it; it refuses an explicit LLMC_ATTENTION=cudnn and unknown values (flash, once a
    third choice, among them) in one line each;
  - make says where cuDNN came from or why it was skipped (CUDNN=0 included), and a CUDNN=0 build
    compiles the trainers without the cuDNN object;
  - the nvcc-built trainer carries the cuDNN object and needs libcudnn (readelf), when cuDNN is found.
    Skipped, with the reason, without nvcc or cuDNN; under CI=true with nvcc present, cuDNN's absence
    is a failure."""
import os
import re
import shutil
import subprocess

import pytest

from cuda_backend import GPU, REPO, need, run

EMU_TRAIN = os.path.join(REPO, "build/emu/train_llama")
NVCC = shutil.which("nvcc")
DEMO = ["--model", os.path.join(REPO, "data/llama_demo"), "--data", os.path.join(REPO, "data/llama_demo_ft_train.bin"),
        "--batch", "2", "--seq", "16", "--lora-rank", "4", "--lr", "1e-3", "--threads", "2", "--device", "cuda"]

emu_only = pytest.mark.skipif(GPU, reason="checks the emulator build's selection (CUDA_TEST_BACKEND=gpu runs the GPU build)")


def make_print_cudnn(*args):
    p = subprocess.run(["make", "--no-print-directory", "print-cudnn", *args], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout, dict(re.findall(r"^(CUDNN_\w+)=(.*)$", p.stdout, re.M))


@emu_only
def test_emulator_defaults_to_gemm_and_trains():
    p = run([need(EMU_TRAIN)] + DEMO + ["--steps", "1"], env={"LLMC_ATTENTION": ""})
    lines = [l for l in p.stdout.splitlines() if l.startswith("attention:")]
    assert lines == ["attention: gemm (LLMC_ATTENTION=unset; cudnn|gemm), no cuDNN in this build"], p.stdout
    assert re.search(r"^step +1/1", p.stdout, re.M), p.stdout


@emu_only
@pytest.mark.parametrize("value,message", [
    ("cudnn", "LLMC_ATTENTION=cudnn: this binary has no cuDNN (the CPU emulator cannot run it); use gemm"),
    ("cuDNN", "LLMC_ATTENTION=cuDNN: expected cudnn or gemm"),
    ("fast", "LLMC_ATTENTION=fast: expected cudnn or gemm"),
    ("flash", "LLMC_ATTENTION=flash: expected cudnn or gemm"),
])
def test_emulator_refuses_in_one_line(value, message):
    p = run([need(EMU_TRAIN)] + DEMO + ["--steps", "1"], check=False, env={"LLMC_ATTENTION": value})
    assert p.returncode != 0
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and message in err[0], p.stderr
    assert "Traceback" not in p.stderr and "Aborted" not in p.stderr


@emu_only
def test_emulator_refuses_an_unknown_packed_mapping_in_one_line():
    """LLMC_CUDNN_PACKED (cuDNN's ragged layout for packed examples, or gemm) is read where the plan
    is made, on any CUDA backend: a value that is neither is refused in one line."""
    p = run([need(EMU_TRAIN)] + DEMO + ["--steps", "1"], check=False, env={"LLMC_CUDNN_PACKED": "thd"})
    err = p.stderr.strip().splitlines()
    assert p.returncode != 0 and len(err) == 1 and "LLMC_CUDNN_PACKED=thd: expected ragged or gemm" in err[0], p.stderr
    ok = run([need(EMU_TRAIN)] + DEMO + ["--steps", "1"], env={"LLMC_CUDNN_PACKED": "gemm"})
    assert re.search(r"^step +1/1", ok.stdout, re.M), ok.stdout


@pytest.mark.skipif(not NVCC, reason="nvcc not found: make builds no CUDA trainer, so there is no cuDNN to find")
def test_make_says_what_it_found_and_skips_on_request():
    out, v = make_print_cudnn("CUDNN=0")
    assert "make: CUDNN=0: cuDNN attention SKIPPED, trainers default to LLMC_ATTENTION=gemm" in out
    assert v["CUDNN_OBJ"] == "" and v["CUDNN_FLAGS"] == ""
    out, v = make_print_cudnn("CUDNN_FRONTEND_INC=/nonexistent", "CUDNN_SYSTEM_DIRS=/nonexistent",
                              "NCCL_PYTHON=/nonexistent")
    assert v["CUDNN_OBJ"] == "" and "cuDNN attention SKIPPED" in out, out
    # a CUDNN=0 build compiles the trainer without the object and without LLMC_HAVE_CUDNN
    n = subprocess.run(["make", "-n", "-B", "--no-print-directory", "train_llama", "CUDNN=0"], cwd=REPO,
                       capture_output=True, text=True, timeout=120).stdout
    build = [l for l in n.splitlines() if "train_llama.cu" in l and "nvcc" in l]
    assert build and "attention_cudnn" not in build[0] and "LLMC_HAVE_CUDNN" not in build[0], n


@pytest.mark.skipif(not NVCC, reason="nvcc not found: no CUDA trainer is built, so none links cuDNN")
def test_trainer_links_cudnn_when_found():
    out, v = make_print_cudnn()
    if not v["CUDNN_OBJ"]:
        msg = f"cuDNN attention not built: {v['CUDNN_SKIPPED']}"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true with nvcc present: {msg} (scripts/ci/install_deps.sh installs the frontend)")
        pytest.skip(msg)
    assert "make: cuDNN found (" in out and v["CUDNN_FLAGS"].startswith("-DLLMC_HAVE_CUDNN"), out
    for exe in ("train_llama", "train_vit"):
        path = need(os.path.join(REPO, exe))
        dyn = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
        assert re.search(r"\(NEEDED\).*\[libcudnn\.so\.\d+\]", dyn), f"{exe} does not need libcudnn:\n{dyn}"
        syms = subprocess.run(["nm", "-C", path], capture_output=True, text=True, check=True).stdout
        for fn in ("attention_cudnn_forward", "attention_cudnn_backward", "attention_cudnn_prepare"):
            assert re.search(r" T %s\(" % fn, syms), f"{exe} lacks {fn}"
