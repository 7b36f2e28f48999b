"""The environment settings table (llmc/settings.h), as a user meets it through the release trainers:
--help lists every row; a bad value, a removed switch or a fault injector (compiled only into the
test builds) ends the run before anything else with one line naming the variable and what it takes;
a setting that is not at its default is named on the line after the start-up line. And the table is
the one place in llmc/ that reads the environment for a setting of ours.

The expected rows are read from llmc/settings.h's source (the table's own text, not the binary's
output); the expected values in the error lines are the values each row documents."""
import os
import re
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(REPO, "data")
PROGRAMS = {
    "llama": [os.path.join(REPO, "train_llama"), "--model", os.path.join(DATA, "llama_demo"),
              "--data", os.path.join(DATA, "llama_demo_ft_train.bin"), "--batch", "2", "--seq", "32"],
    "vit": [os.path.join(REPO, "train_vit"), "--model", os.path.join(DATA, "vit_demo"),
            "--data", os.path.join(DATA, "vit_demo_ft_train.bin"), "--batch", "4"],
}
SETTINGS_H = os.path.join(REPO, "llmc", "settings.h")


def clean_env(**kw):
    """The environment without any LLMC_ variable of the caller's, plus kw."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("LLMC_")}
    e.update(OMP_NUM_THREADS="1", **kw)
    return e


def run(prog, *args, env=None):
    exe = PROGRAMS[prog][0]
    if not os.path.exists(exe):
        pytest.fail(f"{exe} is missing: build it with `make`")
    return subprocess.run(PROGRAMS[prog] + [str(a) for a in args], capture_output=True, text=True,
                          env=clean_env(**(env or {})), timeout=300)


def table_rows():
    """(name, fault) of every row of the table, from its source."""
    text = open(SETTINGS_H).read()
    body = text[text.index("settings_table[SETTING_COUNT] = {"):]
    body = body[:body.index("\n};")]
    rows, fault = [], False
    for line in body.splitlines():
        if line.startswith("#ifdef LLMC_FAULTS"):
            fault = True
        elif line.startswith("#endif"):
            fault = False
        m = re.match(r'\s*\{"([A-Z][A-Z0-9_]+)", SETTING_', line)
        if m:
            rows.append((m.group(1), fault))
    return rows


def test_table_has_the_rows_the_code_reads():
    rows = table_rows()
    names = [n for n, _ in rows]
    assert len(names) == len(set(names)) and len(names) >= 20, names
    faults = {n for n, f in rows if f}
    assert faults and all(n.startswith("LLMC_FAULT_") for n in faults), faults
    assert not any(n.startswith("LLMC_FAULT_") for n, f in rows if not f)


def test_no_environment_read_in_llmc_outside_the_table():
    """getenv appears in llmc/ only in settings.h: the variables of other programs that the trainers
    look at (the MPI launchers' rank counts in llmc/train/dist.h, libgomp's in llmc/train/omp_policy.h)
    are rows of the table too, read through it."""
    found = set()
    for root, _, files in os.walk(os.path.join(REPO, "llmc")):
        for f in files:
            path = os.path.join(root, f)
            rel = os.path.relpath(path, REPO)
            if rel == "llmc/settings.h":
                continue
            for line in open(path, errors="replace"):
                for m in re.finditer(r"getenv\(([^)]*)\)", line):
                    found.add((rel, m.group(1)))
    assert not found, sorted(found)


@pytest.mark.parametrize("prog", ["llama", "vit"])
def test_help_lists_every_setting_of_the_release_build(prog):
    p = subprocess.run([PROGRAMS[prog][0], "--help"], capture_output=True, text=True, env=clean_env(), timeout=60)
    assert p.returncode == 0, p.stderr
    section = p.stdout[p.stdout.index("\nenvironment settings"):]
    for name, fault in table_rows():
        if fault:  # the release build has no fault injectors
            assert name not in section, name
        else:
            assert re.search(rf"^  {name} ", section, re.M), name


# (variable, value, what the one line must say it takes): the values are each row's documented ones
BAD = [
    ("LLMC_HOST_MEMORY_BYTES", "lots", "an integer >= 1"),
    ("LLMC_HOST_MEMORY_BYTES", "-5", "an integer >= 1"),
    ("LLMC_HOST_MEMORY_BYTES", "64MiB", "an integer >= 1"),
    ("LLMC_GRAD_BUCKET_BYTES", "0", "an integer >= 1"),
    ("LLMC_GRAD_BUCKET_BYTES", "1e6", "an integer >= 1"),
    ("LLMC_CUDA_GRAPH", "yes", "0 or 1"),
    ("LLMC_ATTENTION", "flash", "cudnn or gemm"),
    ("LLMC_HEAD_CHUNK", "0", "plan, old or an integer >= 1"),
    ("LLMC_PEAK_TFLOPS", "fast", "a number >= 1e-09"),
    ("LLMC_OFFLOAD_STAGING", "3", "1 or 2"),
]


@pytest.mark.parametrize("prog", ["llama", "vit"])
@pytest.mark.parametrize("var,value,takes", BAD, ids=[f"{v}={x}" for v, x, _ in BAD])
def test_bad_value_is_one_line_naming_the_variable(prog, var, value, takes):
    """Refused at start on the CPU too, where most of these are never asked: the table is read once,
    whole, before anything runs (garbage in LLMC_HOST_MEMORY_BYTES or LLMC_GRAD_BUCKET_BYTES was
    once ignored, issue 40)."""
    p = run(prog, "--device", "cpu", "--steps", 1, env={var: value})
    err = p.stderr.strip()
    assert p.returncode == 1 and len(err.splitlines()) == 1, (p.returncode, err)
    assert err == f"error: {var}={value}: expected {takes}", err


@pytest.mark.parametrize("var", ["LLMC_STREAM", "LLMC_UPLOAD", "LLMC_STEP_READBACK", "LLMC_ADAMW_STEP",
                                 "LLMC_LOSS_SCALE", "LLMC_DROPOUT_KEY"])
def test_removed_switch_is_refused(var):
    p = run("llama", "--device", "cpu", "--steps", 1, env={var: "1"})
    err = p.stderr.strip()
    assert p.returncode == 1 and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: environment variable {var}: removed"), err


def test_start_up_names_the_settings_not_at_their_default(tmp_path):
    """One line after the model's start-up line names each setting set to a value other than its
    default (LLMC_CUDA_GRAPH=0 and LLMC_LORA_FUSED=1 are the defaults: not named); none without.
    Another program's variable (SLURM_STEP_ID, alone changing nothing) is a row but not ours: not named."""
    plain = run("llama", "--device", "cpu", "--steps", 1, "--out", tmp_path / "a")
    assert plain.returncode == 0, plain.stderr
    assert "environment settings:" not in plain.stdout
    env = {"LLMC_GRAD_BUCKET_BYTES": "1", "LLMC_HOST_MEMORY_BYTES": str(1 << 40), "LLMC_CUDA_GRAPH": "0",
           "LLMC_LORA_FUSED": "1", "SLURM_STEP_ID": "7"}
    p = run("llama", "--device", "cpu", "--steps", 1, "--out", tmp_path / "b", env=env)
    assert p.returncode == 0, p.stderr
    lines = [l for l in p.stdout.splitlines() if l.startswith("environment settings:")]
    want = f"environment settings: LLMC_HOST_MEMORY_BYTES={1 << 40} LLMC_GRAD_BUCKET_BYTES=1"
    assert lines == [want], p.stdout[:2000]


@pytest.mark.parametrize("prog", ["llama", "vit"])
def test_release_build_has_no_fault_injectors(prog):
    """The fault injectors are compiled only into the test builds (build/test/, build/emu/,
    build/asan/): the release binary holds none of their names, and refuses one set in one line
    instead of running as if it took effect; the test build of the same trainer honours it (step 1's
    loss made NaN stops the run under the default --nonfinite stop)."""
    exe = PROGRAMS[prog][0]
    data = open(exe, "rb").read()
    for name, fault in table_rows():
        if fault:
            assert name.encode() not in data, name
    p = run(prog, "--device", "cpu", "--steps", 1, env={"LLMC_FAULT_NONFINITE_STEP": "1"})
    err = p.stderr.strip()
    assert p.returncode == 1 and len(err.splitlines()) == 1, err
    assert err.startswith("error: environment variable LLMC_FAULT_NONFINITE_STEP: fault injectors are compiled only "
                          "into the test builds"), err
    test_build = os.path.join(REPO, "build", "test", os.path.basename(exe))
    if not os.path.exists(test_build):
        pytest.fail(f"{test_build} is missing: build it with `make {os.path.relpath(test_build, REPO)}`")
    q = subprocess.run([test_build] + PROGRAMS[prog][1:] + ["--device", "cpu", "--steps", "1"], capture_output=True,
                       text=True, env=clean_env(LLMC_FAULT_NONFINITE_STEP="1"), timeout=300)
    assert q.returncode == 1 and "step 1: non-finite loss (nan)" in q.stderr, q.stderr
