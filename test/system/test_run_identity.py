"""A run checks who it is (issue 28): a resume onto another base model or other data of the same
shape is refused, naming the fingerprint that differs (llmc/train/loop.h records the model's and
the data's in train_state.bin's settings), and mpirun ranks started with different flags, or with
different files behind the same paths, are refused on every rank before any collective, naming
the first differing setting (llmc/train/dist.h dist_check_same). Before, a different --lora-rank
overflowed a buffer in the all-reduce, a different --steps hung, a different --lr or --seed exited
0 with diverged ranks, and a resume onto another model of the same shape trained on."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts", "formats"))
import st_io  # noqa: E402

DATA = os.path.join(REPO, "data")
LLAMA, VIT = os.path.join(DATA, "llama_demo"), os.path.join(DATA, "vit_demo")
LTRAIN, VTRAIN = os.path.join(DATA, "llama_demo_ft_train.bin"), os.path.join(DATA, "vit_demo_ft_train.bin")
PROGRAMS = {"llama": os.path.join(REPO, "train_llama"), "vit": os.path.join(REPO, "train_vit")}
MPIRUN = shutil.which("mpirun")
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def args_for(prog, model, data, *a):
    if prog == "llama":
        return ["--model", model, "--data", data, "--steps", 2, "--batch", 1, "--seq", 16, "--lora-rank", 2, *a]
    return ["--model", model, "--data", data, "--steps", 2, "--batch", 2, "--lora-rank", 2, *a]


def run(prog, args, cwd=None):
    return subprocess.run([PROGRAMS[prog]] + [str(x) for x in args], capture_output=True, text=True, env=ENV,
                          timeout=300, cwd=cwd)


def refused(p, *needles):
    assert p.returncode not in (0,) and p.returncode < 128, (p.returncode, p.stdout[-500:], p.stderr[-1000:])
    err = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert err, p.stderr
    for n in needles:
        assert n in err[0], err[0]


def other_model(src, dst):
    """A copy of the model directory with one weight changed: same shapes, other weights."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    header = st_io.read_header(path)[0]
    bf16 = {e["dtype"] for e in header.values()} == {"BF16"}
    assert bf16 or "BF16" not in {e["dtype"] for e in header.values()}, "mixed dtypes: the copy would change them"
    tensors = st_io.load(path)
    name = sorted(k for k in tensors if tensors[k].ndim == 2)[0]
    tensors[name].flat[0] += 0.5
    st_io.save(path, tensors, bf16=bf16)
    assert {k: e["dtype"] for k, e in st_io.read_header(path)[0].items()} == {k: e["dtype"] for k, e in header.items()}


def other_data(src, dst):
    """A copy of the shard with one value changed, still valid: the low bit of the first token (its
    64-byte header first; an even vocabulary keeps the id in range) or of a pixel mid-file."""
    raw = bytearray(open(src, "rb").read())
    raw[64 if raw[:4] == b"LMFT" else len(raw) // 2] ^= 1
    open(dst, "wb").write(bytes(raw))


@pytest.mark.parametrize("prog", ["llama", "vit"])
def test_resume_onto_another_base_model_is_refused(tmp_path, prog):
    model, data = (LLAMA, LTRAIN) if prog == "llama" else (VIT, VTRAIN)
    out = tmp_path / "run"
    p = run(prog, args_for(prog, model, data, "--stop-at", 1, "--out", out))
    assert p.returncode == 0, p.stderr
    other_model(model, tmp_path / "other")
    refused(run(prog, args_for(prog, tmp_path / "other", data, "--resume", out)), "model_fingerprint", "train_state.bin")
    p = run(prog, args_for(prog, model, data, "--resume", out))  # the same model resumes
    assert p.returncode == 0 and "resumed" in p.stdout, p.stderr


@pytest.mark.parametrize("prog", ["llama", "vit"])
def test_resume_on_other_data_of_the_same_size_is_refused(tmp_path, prog):
    model, data = (LLAMA, LTRAIN) if prog == "llama" else (VIT, VTRAIN)
    out = tmp_path / "run"
    p = run(prog, args_for(prog, model, data, "--stop-at", 1, "--out", out))
    assert p.returncode == 0, p.stderr
    other_data(data, tmp_path / "other.bin")
    refused(run(prog, args_for(prog, model, tmp_path / "other.bin", "--resume", out)), "data_fingerprint")


def mpmd(first, second, cwds=(None, None), timeout=120):
    """mpirun with one rank of each command line (each rank in its own working directory)."""
    if not MPIRUN:
        pytest.fail("mpirun not found: install openmpi-bin (scripts/ci/install_deps.sh does)")
    cmd = [MPIRUN, "--allow-run-as-root", "--oversubscribe"]
    for k, (line, cwd) in enumerate(zip((first, second), cwds)):
        cmd += ([":"] if k else []) + ["-np", "1"] + (["-wdir", str(cwd)] if cwd else []) + [str(x) for x in line]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout)


@pytest.mark.parametrize("flag,a,b", [("--lr", "0.001", "0.002"), ("--lora-rank", "2", "4"), ("--steps", "2", "3"),
                                      ("--seed", "1", "2"), ("--mode", "baseline", "lowmem")])
def test_ranks_started_with_different_flags_are_refused(flag, a, b):
    base = [PROGRAMS["llama"]] + args_for("llama", LLAMA, LTRAIN)
    p = mpmd(base + [flag, a], base + [flag, b])
    refused(p, f"{flag}={b}", f"{flag}={a}", "rank 1", "same on every rank")
    assert "step    1" not in p.stdout and "step 1/" not in p.stdout, p.stdout  # refused before training


def test_ranks_with_other_files_behind_the_same_paths_are_refused(tmp_path):
    # the same flags on both ranks, but each rank's working directory holds other data
    for k in range(2):
        os.makedirs(tmp_path / str(k))
        os.symlink(LLAMA, tmp_path / str(k) / "model")
    shutil.copy(LTRAIN, tmp_path / "0" / "train.bin")
    other_data(LTRAIN, tmp_path / "1" / "train.bin")
    line = [PROGRAMS["llama"]] + args_for("llama", "model", "train.bin")
    p = mpmd(line, line, cwds=(tmp_path / "0", tmp_path / "1"))
    refused(p, "data_fingerprint", "rank 1", "same on every rank")


def test_no_step_says_no_save(tmp_path):
    # --steps 0 --out trains nothing and saves nothing (log.csv only): the summary said
    # "adapter and state in OUT" (issue 28)
    p = run("llama", ["--model", LLAMA, "--data", LTRAIN, "--steps", 0, "--batch", 1, "--seq", 16, "--out", tmp_path / "o"])
    assert p.returncode == 0, p.stderr
    assert "trained 0 steps" in p.stdout and "adapter and state" not in p.stdout, p.stdout
    assert sorted(os.listdir(tmp_path / "o")) == ["log.csv"]
