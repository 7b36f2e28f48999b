"""What a training save leaves on disk, for both trainers: train_state.bin ends with the CRC-32 of
its contents and records the checksum of the adapter (or --full model) saved with it; the
safetensors files we write record the CRC-32 of their data in __metadata__ (checked here against
zlib.crc32, an independent implementation). A resume names the file on a flipped bit, a changed
value, a NaN, or an adapter from another save. A save is committed as one step (llmc/train/atomic_save.h):
killed between its renames (LLMC_FAULT_KILL_SAVE) or failing on a full disk (RLIMIT_FSIZE), it
never leaves the adapter newer than the state, nor *.tmp files; a resume finishes or clears it and
ends bit-identical to an uninterrupted run. log.csv holds each step once after a resume. Outputs
into the model's own directory are refused.

TRAIN_LLAMA / TRAIN_VIT select other binaries (e.g. an older build, to see these tests fail)."""
import csv
import json
import os
import resource
import shutil
import signal
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest

import llama_cases as lc  # noqa: E402
import shards  # noqa: E402
import st_io  # noqa: E402

REPO = lc.REPO
BINS = {"llama": os.environ.get("TRAIN_LLAMA", os.path.join(REPO, "train_llama")),
        "vit": os.environ.get("TRAIN_VIT", os.path.join(REPO, "train_vit"))}
# The test builds, the same trainers with the fault injectors compiled in (-DLLMC_FAULTS, llmc/settings.h):
# the runs that inject a fault
FAULT_BINS = {"llama": os.path.join(REPO, "build/test/train_llama"), "vit": os.path.join(REPO, "build/test/train_vit")}
VIT_MODEL = os.path.join(REPO, "data", "vit_demo")
VIT_TRAIN = os.path.join(REPO, "data", "vit_demo_ft_train.bin")
ENV = dict(os.environ, OMP_NUM_THREADS="1")

# train_state.bin (llmc/train/train_state.h): magic[8], version u32, StateHeader {step, cursor, seed: 8
# bytes each; settings[1024]; count i64; companion[64]; companion_crc u32; reserved u32}, then
# params, m, v (count floats each), then the CRC-32 of everything before it.
STEP_AT, COUNT_AT, COMPANION_CRC_AT, VALUES_AT = 12, 12 + 24 + 1024, 12 + 24 + 1024 + 8 + 64, 12 + 24 + 1024 + 8 + 64 + 8


@pytest.fixture(scope="module")
def llama_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("saved")
    cfg = lc.model_config("gqa_untied")
    lc.write_model(str(d / "model"), cfg, seed=5)
    rng = np.random.default_rng(2)
    toks = np.tile(rng.integers(3, cfg["vocab_size"], size=11), 300)
    shards.write_shard(str(d / "train.bin"), toks.astype(np.uint32), np.ones(toks.size, np.uint8), cfg["vocab_size"])
    return d


def args_for(trainer, llama_model, *extra):
    """A short run of either trainer (seconds on one thread)."""
    if trainer == "llama":
        base = ["--model", llama_model / "model", "--data", llama_model / "train.bin", "--seq", 16, "--batch", 2,
                "--lora-rank", 4, "--lr", 5e-3, "--seed", 3, "--threads", 1]
    else:
        base = ["--model", VIT_MODEL, "--data", VIT_TRAIN, "--batch", 8, "--lora-rank", 4, "--lr", 3e-3, "--seed", 3,
                "--threads", 1]
    return [str(a) for a in base + list(extra)]


def train(trainer, args, check=True, env=None, preexec_fn=None):
    fault = any(k.startswith("LLMC_FAULT_") for k in (env or {}))
    exe = (FAULT_BINS if fault else BINS)[trainer]
    assert os.path.isfile(exe), f"{exe} is missing: build it with `make {os.path.relpath(exe, REPO)}`"
    p = subprocess.run([exe] + args, capture_output=True, text=True, env=dict(ENV, **(env or {})), timeout=300,
                       preexec_fn=preexec_fn)
    if check and p.returncode != 0:
        pytest.fail(f"{trainer} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr}")
    return p


def one_line_error(p, *needles):
    assert p.returncode == 1, f"expected exit 1, got {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr}"
    err = p.stderr.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, f"{err!r} does not mention {n!r}"
    return err


def state_step(path):
    return struct.unpack_from("<q", open(path, "rb").read(), STEP_AT)[0]


def data_crc(path):
    """zlib's CRC-32 of a safetensors file's data section (everything after the header)."""
    raw = open(path, "rb").read()
    n = struct.unpack_from("<Q", raw, 0)[0]
    return zlib.crc32(raw[8 + n:])


def recorded_crc(path):
    _, meta = st_io.load(str(path), with_metadata=True)
    return int(meta["llmc_crc32"], 16)


def rewrite_state(path, edit):
    """Applies edit(bytearray of the contents, trailer excluded) and writes a valid checksum, as a
    bug that saved a bad value would: what is left to catch is the value itself."""
    raw = bytearray(open(path, "rb").read()[:-4])
    edit(raw)
    open(path, "wb").write(bytes(raw) + struct.pack("<I", zlib.crc32(raw)))


def companion(trainer_full):
    return "model.safetensors" if trainer_full else "adapter_model.safetensors"


def same_files(a, b, names):
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), f"{name} differs"


# ---- checksums -------------------------------------------------------------------------------

@pytest.mark.parametrize("trainer,full", [("llama", False), ("vit", False), ("llama", True), ("vit", True)])
def test_saved_files_carry_checksums_that_zlib_agrees_with(llama_model, tmp_path, trainer, full):
    out = tmp_path / "run"
    train(trainer, args_for(trainer, llama_model, "--steps", 2, "--out", out, *(["--full"] if full else [])))
    state = (out / "train_state.bin").read_bytes()
    assert struct.unpack("<I", state[-4:])[0] == zlib.crc32(state[:-4])
    main = out / companion(full)
    assert recorded_crc(main) == data_crc(main)
    assert struct.unpack_from("<I", state, COMPANION_CRC_AT)[0] == data_crc(main)
    assert state[COMPANION_CRC_AT - 64:COMPANION_CRC_AT].rstrip(b"\0").decode() == companion(full)
    assert not list(out.glob("*.tmp")) and not (out / ".saving.tmp").exists() and not (out / ".saving.done").exists()


@pytest.mark.parametrize("trainer", ["llama", "vit"])
def test_resume_names_a_corrupt_state(llama_model, tmp_path, trainer):
    out = tmp_path / "run"
    run_args = args_for(trainer, llama_model, "--steps", 4, "--stop-at", 2, "--out", out)
    train(trainer, run_args)
    resume = args_for(trainer, llama_model, "--steps", 4, "--resume", out)
    state = out / "train_state.bin"
    good = state.read_bytes()
    count = struct.unpack_from("<q", good, COUNT_AT)[0]

    flipped = bytearray(good)
    flipped[VALUES_AT + 4 * (count // 2) + 1] ^= 0x10  # one bit of a trained value
    state.write_bytes(bytes(flipped))
    one_line_error(train(trainer, resume, check=False), str(state), "checksum mismatch")

    changed = bytearray(good)
    struct.pack_into("<f", changed, VALUES_AT + 4 * 7, 123.0)  # a parameter set by hand
    state.write_bytes(bytes(changed))
    one_line_error(train(trainer, resume, check=False), str(state), "checksum mismatch")

    state.write_bytes(good[:-100])  # cut short
    one_line_error(train(trainer, resume, check=False), str(state), "checksum mismatch")

    state.write_bytes(good)
    rewrite_state(state, lambda b: struct.pack_into("<f", b, VALUES_AT + 4 * 5, float("nan")))
    one_line_error(train(trainer, resume, check=False), str(state), "trainable value 5 ", "nan")
    state.write_bytes(good)
    rewrite_state(state, lambda b: struct.pack_into("<f", b, VALUES_AT + 4 * (2 * count + 3), -1.0))
    one_line_error(train(trainer, resume, check=False), str(state), "second AdamW moment 3 ", "-1")

    # impossible fields under a valid checksum (issue 28: a negative cursor overflowed a heap buffer)
    for at, value, needle in [(STEP_AT + 8, -5, "cursor -5"), (STEP_AT, -1, "step -1"), (STEP_AT, 99, "step 99")]:
        state.write_bytes(good)
        rewrite_state(state, lambda b: struct.pack_into("<q", b, at, value))
        one_line_error(train(trainer, resume, check=False), str(state), needle)

    state.write_bytes(good)
    train(trainer, resume)  # the intact state still resumes


@pytest.mark.parametrize("trainer", ["llama", "vit"])
def test_resume_names_a_corrupt_or_foreign_adapter(llama_model, tmp_path, trainer):
    early, out = tmp_path / "early", tmp_path / "run"
    train(trainer, args_for(trainer, llama_model, "--steps", 4, "--stop-at", 1, "--out", early))
    train(trainer, args_for(trainer, llama_model, "--steps", 4, "--stop-at", 2, "--out", out))
    resume = args_for(trainer, llama_model, "--steps", 4, "--resume", out)
    adapter = out / "adapter_model.safetensors"
    good = adapter.read_bytes()

    bad = bytearray(good)
    bad[-10] ^= 0x01  # one bit of the last tensor's data
    adapter.write_bytes(bytes(bad))
    one_line_error(train(trainer, resume, check=False), str(adapter), "checksum mismatch")
    if trainer == "llama":  # --adapter reads it through the same check
        one_line_error(train(trainer, args_for(trainer, llama_model, "--steps", 1, "--adapter", out), check=False), str(adapter),
                       "checksum mismatch")

    shutil.copy(early / "adapter_model.safetensors", adapter)  # intact, but from another save
    one_line_error(train(trainer, resume, check=False), str(adapter), "not the file saved with", "different saves")

    adapter.unlink()  # the state alone resumes; the next save writes the adapter again
    train(trainer, resume)
    assert recorded_crc(adapter) == struct.unpack_from("<I", (out / "train_state.bin").read_bytes(), COMPANION_CRC_AT)[0]


# ---- one step on disk ------------------------------------------------------------------------

@pytest.mark.parametrize("trainer,point", [("llama", "staged"), ("llama", "committed"), ("llama", "state"), ("vit", "state")])
def test_kill_inside_a_save_then_resume(llama_model, tmp_path, trainer, point):
    """Killed inside the save after step 4 (of saves at 2, 4, 6): before the commit the previous
    save stays whole; after it, the state is published first, so OUT never holds an adapter newer
    than its state. The resume finishes or clears the save and ends like an uninterrupted run."""
    straight, out = tmp_path / "straight", tmp_path / "killed"
    run_args = args_for(trainer, llama_model, "--steps", 6, "--save-every", 2)
    train(trainer, run_args + ["--out", str(straight)])
    p = train(trainer, run_args + ["--out", str(out)], check=False, env={"LLMC_FAULT_KILL_SAVE": f"4:{point}"})
    assert p.returncode == -signal.SIGKILL, f"not killed by the fault hook ({p.returncode}): {p.stderr}"
    state, adapter = out / "train_state.bin", out / "adapter_model.safetensors"
    recorded = struct.unpack_from("<I", state.read_bytes(), COMPANION_CRC_AT)[0]
    if point in ("staged", "committed"):
        assert state_step(state) == 2 and recorded_crc(adapter) == recorded  # the save of step 2, whole
    else:
        assert state_step(state) == 4 and recorded_crc(adapter) != recorded  # the state ahead, the adapter behind
        assert recorded_crc(out / ".saving.done" / "adapter_model.safetensors") == recorded
    r = train(trainer, run_args + ["--resume", str(out)])
    assert f"at step {4 if point != 'staged' else 2}" in r.stdout
    same_files(straight, out, ["adapter_model.safetensors", "train_state.bin", "adapter_config.json"])
    assert not (out / ".saving.tmp").exists() and not (out / ".saving.done").exists()


@pytest.mark.parametrize("trainer", ["llama", "vit"])
def test_a_resume_may_turn_recompute_on(llama_model, tmp_path, trainer):
    """--recompute block recomputes each block's forward from its saved input: the same numbers, so
    a run saved without it resumes with it (a smaller card) and ends bit-identical to the run that
    never stopped, state and adapter alike."""
    straight, out = tmp_path / "straight", tmp_path / "resumed"
    run_args = args_for(trainer, llama_model, "--steps", 4, "--save-every", 2)
    train(trainer, run_args + ["--out", str(straight)])
    train(trainer, run_args + ["--out", str(out), "--stop-at", "2"])
    train(trainer, run_args + ["--resume", str(out), "--recompute", "block"])
    same_files(straight, out, ["adapter_model.safetensors", "train_state.bin"])


@pytest.mark.parametrize("trainer", ["llama", "vit"])
def test_a_stop_by_sigterm_inside_a_save_removes_its_stage(llama_model, tmp_path, trainer):
    """SIGTERM (a scheduler's stop) while the save after step 4 is staged: one line names the signal
    and the stage, the stage is gone, the process ends by the signal, and the save of step 2 stands:
    a resume ends like the run that never stopped."""
    straight, out = tmp_path / "straight", tmp_path / "stopped"
    run_args = args_for(trainer, llama_model, "--steps", 6, "--save-every", 2)
    train(trainer, run_args + ["--out", str(straight)])
    p = train(trainer, run_args + ["--out", str(out)], check=False, env={"LLMC_FAULT_KILL_SAVE": "4:staged:term"})
    assert p.returncode == -signal.SIGTERM, f"not stopped by the signal ({p.returncode}): {p.stderr}"
    err = p.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: stopped by SIGTERM") and ".saving.tmp" in err, err
    assert not (out / ".saving.tmp").exists() and state_step(out / "train_state.bin") == 2
    train(trainer, run_args + ["--resume", str(out)])
    same_files(straight, out, ["adapter_model.safetensors", "train_state.bin", "adapter_config.json"])


def test_kill_mid_publish_of_a_full_model(llama_model, tmp_path):
    """--full: the model directory's files are published after the state, like an adapter."""
    straight, out = tmp_path / "straight", tmp_path / "killed"
    run_args = args_for("llama", llama_model, "--steps", 4, "--save-every", 2, "--full")
    train("llama", run_args + ["--out", str(straight)])
    p = train("llama", run_args + ["--out", str(out)], check=False, env={"LLMC_FAULT_KILL_SAVE": "4:state"})
    assert p.returncode == -signal.SIGKILL
    assert state_step(out / "train_state.bin") == 4 and (out / ".saving.done" / "model.safetensors").exists()
    train("llama", run_args + ["--resume", str(out)])  # step 4 was the last: the resume only finishes the save
    same_files(straight, out, ["model.safetensors", "train_state.bin", "config.json"])


@pytest.mark.parametrize("trainer", ["llama", "vit"])
def test_failed_save_leaves_the_previous_pair_and_no_tmp(llama_model, tmp_path, trainer):
    """A save that runs out of space (RLIMIT_FSIZE: writes past the limit fail with EFBIG, as on
    a full disk) reports the file, removes its temporary files and its staging directory, and
    leaves the previous save's adapter and state, still a pair."""
    out = tmp_path / "run"
    train(trainer, args_for(trainer, llama_model, "--steps", 4, "--stop-at", 2, "--out", out))
    before = {n: (out / n).read_bytes() for n in ("adapter_model.safetensors", "train_state.bin")}
    limit = (len(before["adapter_model.safetensors"]) + len(before["train_state.bin"])) // 2
    assert len(before["adapter_model.safetensors"]) < limit < len(before["train_state.bin"])

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of a signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    p = train(trainer, args_for(trainer, llama_model, "--steps", 4, "--resume", out), check=False, preexec_fn=small_files)
    err = one_line_error(p, "train_state.bin.tmp")
    assert "write failed" in err or "flush failed" in err, err
    assert {n: (out / n).read_bytes() for n in before} == before
    assert not list(out.rglob("*.tmp")) and not (out / ".saving.tmp").exists()


@pytest.mark.parametrize("trainer", ["llama", "vit"])
def test_stale_tmp_files_are_removed(llama_model, tmp_path, trainer):
    out = tmp_path / "run"
    train(trainer, args_for(trainer, llama_model, "--steps", 3, "--stop-at", 1, "--out", out))
    stale = [out / "train_state.bin.tmp", out / "adapter_model.safetensors.tmp", out / "log.csv.tmp"]
    for f in stale:
        f.write_bytes(b"x" * 1000)
    (out / ".saving.tmp").mkdir()
    (out / ".saving.tmp" / "adapter_model.safetensors").write_bytes(b"half")
    keep = out / "notes.tmp"  # not a file the trainer writes: left alone
    keep.write_text("mine")
    train(trainer, args_for(trainer, llama_model, "--steps", 3, "--resume", out))
    assert not any(f.exists() for f in stale) and not (out / ".saving.tmp").exists()
    assert keep.read_text() == "mine"


# ---- log.csv ---------------------------------------------------------------------------------

@pytest.mark.parametrize("trainer", ["llama", "vit"])
def test_resumed_log_holds_each_step_once(llama_model, tmp_path, trainer):
    """A run killed after logging steps 3 and 4 but before saving them resumes at step 2: the log
    drops the rows of steps 3 and 4 (and a row cut short) before the replay writes them again."""
    straight, out = tmp_path / "straight", tmp_path / "run"
    train(trainer, args_for(trainer, llama_model, "--steps", 4, "--out", straight))
    train(trainer, args_for(trainer, llama_model, "--steps", 4, "--stop-at", 2, "--out", out))
    log = out / "log.csv"
    rows = log.read_text().splitlines()
    log.write_text("\n".join(rows + [r.replace("2,", "3,", 1) for r in rows[-1:]] + [r.replace("2,", "4,", 1) for r in rows[-1:]]) +
                   "\n5,0.12")  # as the killed run left it: steps 3, 4 and half of 5
    train(trainer, args_for(trainer, llama_model, "--steps", 4, "--resume", out))
    steps = [int(r["step"]) for r in csv.DictReader(open(log))]
    assert steps == [1, 2, 3, 4], steps
    want = [r["loss"] for r in csv.DictReader(open(straight / "log.csv"))]
    assert [r["loss"] for r in csv.DictReader(open(log))] == want


# ---- outputs into the model's directory ------------------------------------------------------

@pytest.mark.parametrize("trainer", ["llama", "vit"])
def test_outputs_into_the_model_directory_are_refused(llama_model, tmp_path, trainer):
    model = tmp_path / "model"
    shutil.copytree(llama_model / "model" if trainer == "llama" else VIT_MODEL, model)
    (tmp_path / "link").symlink_to(model)
    before = {f.name: f.read_bytes() for f in model.iterdir()}
    args = args_for(trainer, llama_model, "--steps", 1)
    args[args.index("--model") + 1] = str(model)
    for where in (str(model), str(tmp_path / "link"), str(model) + "/.", str(tmp_path / "x" / ".." / "model")):
        (tmp_path / "x").mkdir(exist_ok=True)
        one_line_error(train(trainer, args + ["--export-merged", where], check=False), "--export-merged", "model's own directory")
        one_line_error(train(trainer, args + ["--full", "--out", where], check=False), "--out", "model's own directory")
    assert {f.name: f.read_bytes() for f in model.iterdir()} == before
    train(trainer, args + ["--export-merged", str(tmp_path / "merged")])  # elsewhere is fine
    assert json.loads((tmp_path / "merged" / "config.json").read_text())


# ---- --export-merged: the whole directory or nothing ---------------------------------------------

@pytest.mark.parametrize("trainer", ["llama", "vit"])
def test_export_merged_is_written_whole_or_not_at_all(llama_model, tmp_path, trainer):
    """--export-merged stages its directory beside DIR and renames it into place (atomic_save.h): a
    full disk (RLIMIT_FSIZE) leaves no DIR, not even an empty one; a second export replaces DIR whole,
    so a file of an earlier export (a stale tokenizer.bin, which --generate would read before a
    tokenizer.json) does not survive it; a DIR holding anything else is refused before training."""
    args = args_for(trainer, llama_model, "--steps", 1)
    merged = tmp_path / "merged"

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of a signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    err = one_line_error(train(trainer, args + ["--export-merged", merged], check=False, preexec_fn=small_files))
    assert "model.safetensors" in err and ("write failed" in err or "flush failed" in err), err
    assert os.listdir(tmp_path) == []
    train(trainer, args + ["--export-merged", merged])
    first = {f.name: f.read_bytes() for f in merged.iterdir()}
    (merged / "tokenizer.bin").write_bytes(b"stale")  # as an export of another model left it
    (merged / "model.safetensors.tmp").write_bytes(b"half")
    train(trainer, args + ["--export-merged", str(merged) + "/"])
    assert {f.name: f.read_bytes() for f in merged.iterdir()} == first
    assert os.listdir(tmp_path) == ["merged"]
    (merged / "notes.txt").write_text("mine")
    one_line_error(train(trainer, args + ["--export-merged", merged], check=False), "--export-merged", "notes.txt")
    assert {f.name for f in merged.iterdir()} == set(first) | {"notes.txt"}
    one_line_error(train(trainer, args + ["--export-merged", merged / "notes.txt"], check=False), "not a directory")

# ---- several ranks and the CUDA backend --------------------------------------------------------

def test_kill_inside_a_save_of_two_ranks_then_resume(llama_model, tmp_path):
    """mpirun -np 2 --full (ZeRO-1: rank 0 gathers the moments and writes): rank 0 killed right
    after committing the save of step 4, before publishing it (OUT still holds step 2's state); in
    the resumed job rank 0 publishes it while the other rank waits at a barrier, then both read
    step 4's state, and the job ends like an uninterrupted one."""
    import cuda_backend as cb
    straight, out = tmp_path / "straight", tmp_path / "killed"
    run_args = args_for("llama", llama_model, "--steps", 6, "--save-every", 2, "--full")
    cb.mpirun(2, BINS["llama"], run_args + ["--out", straight])
    p = cb.mpirun(2, FAULT_BINS["llama"], run_args + ["--out", out], check=False,
                  env={"LLMC_FAULT_KILL_SAVE": "4:committed"})
    assert p.returncode != 0 and state_step(out / "train_state.bin") == 2 and state_step(out / ".saving.done" / "train_state.bin") == 4
    r = cb.mpirun(2, BINS["llama"], run_args + ["--resume", out])
    assert "at step 4" in r.stdout
    same_files(straight, out, ["model.safetensors", "train_state.bin"])


@pytest.mark.parametrize("full", [False, True])
def test_kill_inside_a_save_on_the_cuda_backend_then_resume(llama_model, tmp_path, full):
    """--device cuda (the CPU emulator, or a GPU with CUDA_TEST_BACKEND=gpu): the state and the
    adapter or model come from device memory; the same staged save, kill and resume."""
    import cuda_backend as cb
    exe = cb.need(cb.binaries("train_llama", "llama_probe")[0])
    straight, out = tmp_path / "straight", tmp_path / "killed"
    run_args = args_for("llama", llama_model, "--steps", 4, "--save-every", 2, "--device", "cuda", *(["--full"] if full else []))
    cb.run([exe] + run_args + ["--out", straight])
    p = cb.run([exe] + run_args + ["--out", out], check=False, env={"LLMC_FAULT_KILL_SAVE": "2:state"})
    assert p.returncode == -signal.SIGKILL
    cb.run([exe] + run_args + ["--resume", out])
    same_files(straight, out, [companion(full), "train_state.bin"])


def test_a_corrupt_model_we_wrote_is_named_when_loaded(llama_model, tmp_path):
    """--export-merged's model.safetensors records its checksum too: --model reads it through the
    same check, so a flipped bit in a model we wrote is named, not trained on."""
    merged = tmp_path / "merged"
    train("llama", args_for("llama", llama_model, "--steps", 1, "--export-merged", merged))
    model = merged / "model.safetensors"
    assert recorded_crc(model) == data_crc(model)
    evaluate = ["--model", str(merged), "--val", str(llama_model / "train.bin"), "--eval-only", "--seq", "16", "--batch", "2",
                "--val-batches", "1", "--threads", "1"]
    train("llama", evaluate)
    raw = bytearray(model.read_bytes())
    raw[-3] ^= 0x04
    model.write_bytes(bytes(raw))
    one_line_error(train("llama", evaluate, check=False), str(model), "checksum mismatch")
