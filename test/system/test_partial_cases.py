"""Issue 40's partial cases on the trainers' side, each a one-line refusal or the right behaviour:
float flags that underflow, a huge --grad-accum, the fit error's suggested --batch/--grad-accum,
--stop-at below the saved step, a full stdout, a 1-class image shard, a safetensors header over
the cap, and (through build/test/tokenizer_probe, llmc/text/model_tokenizer.h) generation_config.json
beside a tokenizer.bin and a prompt longer than the generation window. The Python scripts' cases
are in test/formats/test_prepare_partial_cases.py."""
import json
import os
import re
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

from test_bad_inputs import ENV, LLAMA, LTRAIN, REPO, VIT, VTRAIN, expect_one_line_error, llama, vit
from llama_cases import auto_smallest_tile

sys.path.insert(0, os.path.join(REPO, "scripts", "data"))
import prepare_images  # noqa: E402

BIN = os.path.join(REPO, "train_llama")
PROBE = os.path.join(REPO, "build", "test", "tokenizer_probe")


def train(args, env=None, **kw):
    return subprocess.run([BIN] + [str(a) for a in args], capture_output=True, text=True, timeout=300,
                          env=dict(ENV, **(env or {})), **kw)


# ---- 1: float flags outside float's range ----------------------------------------------------

@pytest.mark.parametrize("prog,flag,value", [("llama", "lr", "1e-50"), ("llama", "lr", "1e50"),
                                             ("vit", "lora-dropout", "1e-60"), ("llama", "grad-clip", "-1e-46")])
def test_a_float_flag_that_reads_as_zero_or_inf_is_refused(prog, flag, value):
    """strtof reads 1e-50 as 0 (and 1e50 as inf): a nonzero learning rate would silently be none."""
    args = (llama if prog == "llama" else vit)(f"--{flag}", value)
    expect_one_line_error(prog, args, [f"--{flag}", value, "range"])


def test_small_and_zero_float_flags_still_parse(tmp_path):
    """The smallest normal float and a plain 0 are values, not errors."""
    for value in ("1.2e-38", "0", "0e-99"):
        p = train(llama("--lr", value, "--steps", 0))
        assert p.returncode == 0, (value, p.stderr)


# ---- 2: --grad-accum -------------------------------------------------------------------------

@pytest.mark.parametrize("prog", ["llama", "vit"])
def test_a_huge_grad_accum_names_the_flag(prog):
    """A step of 2e9 micro-batches: llama's step holds every micro-batch's tokens at once (it used
    to end in "out of host memory allocating 128000000000 bytes"), and the step's sequences or
    images are counted in an int (train_vit ran on, for 2e9 micro-batches)."""
    args = (llama if prog == "llama" else vit)("--grad-accum", 2000000000)
    expect_one_line_error(prog, args, ["--grad-accum", "2000000000"], timeout=60)


def test_a_grad_accum_whose_tokens_exceed_the_host_is_refused():
    """Within int but more host memory than the machine has: named before any allocation."""
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    accum = min(2**31 - 1, pages // (16 * 16) + 1)  # 16 bytes a token, --seq 16, --batch 1
    expect_one_line_error("llama", llama("--grad-accum", accum), ["--grad-accum", "host"], timeout=60)


# ---- 3: the fit error's suggestion -----------------------------------------------------------

def test_the_fit_suggestion_keeps_the_asked_step_exactly():
    """With host memory for 7 sequences of 128 tokens and --batch 40 asked, the largest fitting
    batch (7) does not divide 40: rounding --grad-accum up suggested 7 x 6 = 42 sequences a step.
    The suggestion is now a batch that fits and divides the step: b x accum == 40."""
    args = ["--model", LLAMA, "--data", LTRAIN, "--steps", 1, "--seq", 128, "--device", "cpu"]

    def plan(batch):  # as test_llama_train's test_plan_bigger_than_host_memory_is_refused_with_what_fits
        p = train(args + ["--dry-run", "--json", "--batch", batch, "--mlp-tile", auto_smallest_tile(batch * 128)])
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout)["total_bytes"]

    budget = plan(7)
    assert plan(8) > budget and 40 % 7  # the case: 7 is the largest batch that fits, and it does not divide 40
    p = train(args + ["--batch", 40], env={"LLMC_HOST_MEMORY_BYTES": str(budget)})
    assert p.returncode == 1 and p.stderr.count("\n") == 1, p.stderr
    b, accum = (int(x) for x in re.search(r"would fit: --batch (\d+) --grad-accum (\d+);", p.stderr).groups())
    assert b * accum == 40, p.stderr
    assert plan(b) <= budget and b == max(d for d in range(1, 8) if 40 % d == 0)


# ---- 4: --stop-at below the saved step -------------------------------------------------------

def test_stop_at_before_the_saved_step_is_refused(tmp_path):
    out = tmp_path / "run"
    p = train(llama("--steps", 6, "--stop-at", 4, "--out", out))
    assert p.returncode == 0, p.stderr
    log = (out / "log.csv").read_text()
    err = expect_one_line_error("llama", llama("--steps", 6, "--stop-at", 2, "--resume", out),
                                ["--stop-at", "2", "saved step 4"])
    assert "trained -" not in err
    assert (out / "log.csv").read_text() == log  # refused before the log is touched


# ---- 5: a full stdout --------------------------------------------------------------------------

@pytest.mark.parametrize("args", [["--help"], llama("--steps", 1)], ids=["help", "train"])
def test_output_to_a_full_stdout_is_an_error(args):
    """> /dev/full: every write fails with ENOSPC; the program said nothing and exited 0."""
    with open("/dev/full", "w") as full:
        p = subprocess.run([BIN] + [str(a) for a in args], stdout=full, stderr=subprocess.PIPE, text=True,
                           timeout=120, env=ENV)
    assert p.returncode == 1, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "standard output" in lines[0], p.stderr


def test_an_error_with_a_full_stdout_is_one_line():
    """fail()'s own line is the report: the exit check adds none."""
    with open("/dev/full", "w") as full:
        p = subprocess.run([BIN] + [str(a) for a in llama("--lr", "1e-50")], stdout=full, stderr=subprocess.PIPE,
                           text=True, timeout=60, env=ENV)
    assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1 and "--lr" in p.stderr, p.stderr


# ---- 11: a 1-class image shard -----------------------------------------------------------------

def test_a_one_class_shard_is_not_called_a_diverged_run(tmp_path):
    """A head of one class: softmax over one class is 1, so the loss and gradient are 0 whatever the
    weights. Said so in one line, not diagnosed as a collapsed or diverged run."""
    with open(os.path.join(VIT, "config.json")) as f:
        cfg = json.load(f)
    size, channels = cfg["image_size"], cfg.get("num_channels", 3)
    rng = np.random.default_rng(0)
    shard = str(tmp_path / "one.bin")
    prepare_images.write_shard(shard, rng.integers(0, 256, (8, size, size, channels), dtype=np.uint8),
                               np.zeros(8, np.int64), 1)
    err = expect_one_line_error("vit", ["--model", VIT, "--data", shard, "--steps", 2, "--batch", 2, "--lora-rank", 2],
                                ["1 class", "--classes"])
    assert "diverged" not in err and "collapsed" not in err, err


# ---- 13: a safetensors header over the cap ----------------------------------------------------

def test_a_safetensors_header_over_the_cap_says_so(tmp_path):
    """A header length of 101 MiB in a 110 MiB file (sparse): it fits in the file, so the refusal's
    reason is the cap, named with its value, not "does not fit in the file"."""
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(os.path.join(LLAMA, "config.json"), d / "config.json")
    st = d / "model.safetensors"
    with open(st, "wb") as f:
        f.write(struct.pack("<Q", 101 << 20) + b"{")
    os.truncate(st, 110 << 20)
    err = expect_one_line_error("llama", ["--model", d, "--data", LTRAIN, "--steps", 1, "--batch", 1, "--seq", 16],
                                ["model.safetensors", str(101 << 20), "cap", str(100 << 20)])
    assert "does not fit" not in err


# ---- 12: the tokenizer beside the model, for --generate (llmc/text/model_tokenizer.h) ---------

def probe(d, *args):
    if not os.path.exists(PROBE):
        pytest.fail(f"{PROBE} is missing: build it with `make build/test/tokenizer_probe`")
    return subprocess.run([PROBE, str(d)] + [str(a) for a in args], capture_output=True, text=True, timeout=60)


@pytest.fixture
def bin_dir(tmp_path):
    """A model directory with the demo's tokenizer.bin (and its config.json)."""
    d = tmp_path / "tok"
    d.mkdir()
    for name in ("tokenizer.bin", "config.json"):
        shutil.copy(os.path.join(LLAMA, name), d / name)
    return d


def test_generation_config_eos_ids_beside_a_tokenizer_bin_end_generation(bin_dir):
    """transformers' generate() stops at every eos_token_id of generation_config.json; beside a
    tokenizer.bin they were ignored."""
    (bin_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 11]}))
    p = probe(bin_dir, "info")
    assert p.returncode == 0, p.stderr
    kind, bos, *ends = p.stdout.split()
    assert kind == "bin" and {7, 11} <= {int(e) for e in ends}, p.stdout


def test_invalid_generation_config_beside_a_tokenizer_bin_is_one_line(bin_dir):
    (bin_dir / "generation_config.json").write_text('{"eos_token_id": [2, 7,')
    p = probe(bin_dir, "info")
    assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "generation_config.json" in p.stderr and p.stderr.startswith("error: ")


def test_a_prompt_longer_than_the_window_is_refused(bin_dir):
    """The generation window restarts from its last half when full: a prompt longer than the window
    was cut to its last half-window silently. The count comes from the prompt's own ids."""
    prompt = "Once upon a time there was a little dog. " * 4
    ids = probe(bin_dir, "encode", prompt)
    assert ids.returncode == 0, ids.stderr
    n = len(ids.stdout.split())
    ok = probe(bin_dir, "check-prompt", n, prompt)
    assert ok.returncode == 0 and ok.stdout.strip() == "ok", ok.stderr
    p = probe(bin_dir, "check-prompt", n - 1, prompt)
    assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert f"{n} tokens" in p.stderr and f"{n - 1}-token window" in p.stderr and "--prompt" in p.stderr


def test_train_llama_refuses_a_prompt_longer_than_its_window(bin_dir):
    """The trainer's own check (train_llama.cu's plan step): the window is --seq with --data, and the
    prompt's length is counted by the tokenizer probe, not by the trainer under test."""
    prompt = "Once upon a time there was a little dog. " * 4
    ids = probe(bin_dir, "encode", prompt)
    assert ids.returncode == 0, ids.stderr
    n = len(ids.stdout.split())
    args = ["--model", LLAMA, "--data", LTRAIN, "--steps", 1, "--batch", 1, "--generate", 4, "--prompt", prompt]
    expect_one_line_error("llama", args + ["--seq", 16], [f"{n} tokens", "16-token window", "--seq"])


@pytest.mark.parametrize("prog", ["llama", "vit"])
def test_the_other_trainers_model_is_named_as_such(prog):
    """A model directory of the other trainer: its model_type named, and which trainer reads it (not
    a ViT "missing image_size", nor a bare "not supported")."""
    other = VIT if prog == "llama" else LLAMA
    data = LTRAIN if prog == "llama" else VTRAIN
    expect_one_line_error(prog, ["--model", other, "--data", data, "--steps", 1],
                          ["config.json", "model_type", "train_vit" if prog == "llama" else "train_llama"])


# ---- 14: the other trainer's data -------------------------------------------------------------

@pytest.mark.parametrize("prog", ["llama", "vit"])
def test_the_other_trainers_shard_is_named_as_such(prog):
    """An image shard given to train_llama (a token shard to train_vit) was "bad magic" with advice to
    make a shard of the other kind; it now says whose data it is."""
    if prog == "llama":
        args = ["--model", LLAMA, "--data", VTRAIN, "--steps", 1, "--batch", 1, "--seq", 16]
        needles = [VTRAIN, "image shard", "train_vit"]
    else:
        args = ["--model", VIT, "--data", LTRAIN, "--steps", 1, "--batch", 2]
        needles = [LTRAIN, "token shard", "train_llama"]
    expect_one_line_error(prog, args, needles)
