"""Preference fine-tuning (train_llama --objective dpo|orpo|simpo, llmc/models/llama_pref.h)
against an independent autograd reference on the Hugging Face stack (test/system/pref_reference.py:
transformers + PEFT in float64, DPO's reference model PEFT's disable_adapter()): one step's loss,
TRL's statistics and the LoRA gradient norm before clipping, on a random checkpoint with a
non-zero adapter, in baseline and lowmem; and the pair shard's way in (prepare_text.py, refusals)."""
import csv
import json
import os
import subprocess

import numpy as np
import pytest

import llama_cases as lc
import shards
from test_llama_train import ENV, expect_error, run

HF_PYTHON = os.environ.get("HF_PYTHON", os.path.join(lc.REPO, "build", "hfvenv", "bin", "python"))
HERE = os.path.dirname(os.path.abspath(__file__))
RANK, ALPHA, SEQ, PAIRS = 4, 8.0, 16, 4


def need_hf():
    if not os.path.exists(HF_PYTHON):
        pytest.fail(f"{HF_PYTHON} missing: scripts/ci/install_deps.sh makes it")


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """A random LLaMA (GQA, untied head) written by our writer and read by transformers, a PEFT
    adapter with random A and B (save_peft_adapter.py), and PAIRS pairs of random tokens whose
    prompts and completions differ in length."""
    need_hf()
    d = tmp_path_factory.mktemp("pref")
    cfg = lc.model_config("gqa_untied")
    lc.write_model(str(d / "model"), cfg, seed=5)
    rng = np.random.default_rng(11)
    V = cfg["vocab_size"]
    toks = rng.integers(3, V, size=400)
    shards.write_shard(str(d / "tokens.bin"), toks.astype(np.uint32), np.ones(toks.size, np.uint8), V)
    p = subprocess.run([HF_PYTHON, os.path.join(lc.REPO, "scripts", "interop", "save_peft_adapter.py"), "--base",
                        str(d / "model"), "--out", str(d / "adapter"), "--rank", str(RANK), "--alpha", str(ALPHA),
                        "--val", str(d / "tokens.bin"), "--seq", "8", "--windows", "2"],
                       capture_output=True, text=True, timeout=300, env=ENV)
    assert p.returncode == 0, p.stderr[-3000:]
    pairs = []
    for i in range(PAIRS):
        n_p, n_c, n_r = 2 + i, 3 + (2 * i) % 7, 9 - i
        pairs.append([list(rng.integers(0, V, size=n)) for n in (n_p, n_c, n_r)])
    shards.write_pair_shard(str(d / "pairs.bin"), pairs, V)
    return d


def ours(case, tmp_path, objective, mode, *extra):
    """Our step 1 over every pair (one micro-batch of 2 * PAIRS rows) from log.csv: loss, TRL's
    statistics and the gradient norm."""
    out = tmp_path / f"out_{objective}_{mode}"
    run(["--model", case / "model", "--adapter", case / "adapter", "--data", case / "pairs.bin", "--objective",
         objective, "--steps", 1, "--batch", 2 * PAIRS, "--seq", SEQ, "--lora-rank", RANK, "--lora-alpha", ALPHA,
         "--mode", mode, "--grad-clip", 0, "--threads", 1, "--out", out, *extra])
    with open(out / "log.csv") as f:
        row = list(csv.DictReader(f))[-1]
    return {k: float(v) for k, v in row.items() if v != "" and k not in ("step", "lr", "tokens_per_s")}


def reference(case, objective, act, *extra):
    p = subprocess.run([HF_PYTHON, os.path.join(HERE, "pref_reference.py"), "--model", str(case / "model"),
                        "--adapter", str(case / "adapter"), "--pairs", str(case / "pairs.bin"), "--objective",
                        objective, "--act", act, *map(str, extra)],
                       capture_output=True, text=True, timeout=300, env=ENV)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


# objective, its flags and the reference's: TRL's defaults, cDPO's smoothing, ORPO's lambda, SimPO's gamma
OBJECTIVES = {
    "dpo": ("dpo", ("--beta", 0.1), ("--beta", 0.1)),
    "cdpo": ("dpo", ("--beta", 0.3, "--dpo-label-smoothing", 0.2), ("--beta", 0.3, "--smoothing", 0.2)),
    "orpo": ("orpo", ("--beta", 0.1), ("--beta", 0.1)),
    "simpo": ("simpo", ("--beta", 2.0, "--simpo-gamma", 0.5), ("--beta", 2.0, "--gamma", 0.5)),
}


@pytest.mark.parametrize("mode", ["baseline", "lowmem"])
@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_step_equals_peft_autograd_reference(case, tmp_path, name, mode):
    """fp32 against float64: the logps are sums of <= 9 token log-probabilities through 2 blocks,
    whose fp32 error is about 1e-6 relative (test/model/llama_cases.py's TOL measures the same
    model's logits to 1e-4 abs and its loss to 1e-5); log.csv keeps 6 decimals. The gradient norm
    is compared to 1e-4 relative (llama_cases' gradient tolerance 1e-3 is per element; the norm
    averages them). lowmem's ReSiLU2 backward is the reference's too; a gate pre-activation within
    the fp32 error of a breakpoint may be coded either way in fp32, so the reference gives the norm
    under each such coding and ours must be one of them."""
    objective, flags, ref_flags = OBJECTIVES[name]
    got = ours(case, tmp_path, objective, mode, *flags)
    want = reference(case, objective, "approx" if mode == "lowmem" else "exact", *ref_flags)
    print(name, mode, "ours:", got, "reference:", want)
    for k in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert got[k] == pytest.approx(want[k], rel=1e-5, abs=2e-6), k
    assert got["rewards/accuracies"] == want["rewards/accuracies"]
    assert any(got["grad_norm"] == pytest.approx(g, rel=1e-4) for g in want["grad_norms"]), want["grad_norms"]
    assert abs(want["rewards/margins"]) > 1e-3 or objective != "dpo"  # the adapter changes the model


def test_refusals(case, tmp_path):
    """A pair shard to sft and a token shard to dpo, beta <= 0, an odd batch: one line each."""
    base = ["--model", case / "model", "--steps", 1, "--seq", SEQ, "--threads", 1]
    expect_error(base + ["--data", case / "pairs.bin"], "pairs.bin", "pair shard", "--objective")
    expect_error(base + ["--data", case / "tokens.bin", "--objective", "dpo"], "tokens.bin", "token shard")
    expect_error(base + ["--data", case / "pairs.bin", "--objective", "dpo", "--beta", 0], "--beta", "> 0")
    expect_error(base + ["--data", case / "pairs.bin", "--objective", "simpo", "--batch", 3], "--batch", "even")
    expect_error(base + ["--data", case / "pairs.bin", "--objective", "dpo", "--seq", 4], "pairs.bin", "--seq")


def train_args(case, out, *extra):
    return ["--model", case / "model", "--data", case / "pairs.bin", "--seq", SEQ, "--lora-rank", RANK, "--lr", 1e-2,
            "--threads", 1, "--out", out, *extra]


def log_rows(out):
    with open(out / "log.csv") as f:
        return [{k: v for k, v in row.items() if k != "tokens_per_s"} for row in csv.DictReader(f)]


def adapter(out):
    import st_io
    return st_io.load(str(out / "adapter_model.safetensors"))


def same_adapters(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_kill_and_resume_is_bit_identical(case, tmp_path, objective):
    """A run stopped after step 2 and resumed (its pair order from the saved cursor, DPO's reference
    again from the base) logs the same rows and saves the same adapter bits as a run straight
    through; SIGKILL after the save of step 2 (LLMC_FAULT_STOP_STEP=3:kill) resumes the same."""
    args = ("--objective", objective, "--steps", 4, "--batch", 4, "--save-every", 2)
    run(train_args(case, tmp_path / "straight", *args))
    from test_llama_system import FAULT_BIN
    if not os.path.exists(FAULT_BIN):
        pytest.fail(f"{FAULT_BIN} is missing: build it with `make build/test/train_llama`")
    p = subprocess.run([FAULT_BIN] + [str(a) for a in train_args(case, tmp_path / "killed", *args)],
                       capture_output=True, text=True, timeout=300, env=dict(ENV, LLMC_FAULT_STOP_STEP="3:kill"))
    assert p.returncode == -9, p.stderr
    run(["--resume", tmp_path / "killed", "--model", case / "model", "--data", case / "pairs.bin", "--seq", SEQ,
         "--lora-rank", RANK, "--lr", 1e-2, "--threads", 1, *args])
    assert log_rows(tmp_path / "killed") == log_rows(tmp_path / "straight")
    assert same_adapters(adapter(tmp_path / "killed"), adapter(tmp_path / "straight"))


@pytest.mark.parametrize("objective", ["dpo", "simpo", "orpo"])
def test_two_ranks_equal_one_process_accumulating(case, tmp_path, objective):
    """2 ranks x 1 pair each against 1 process x 1 pair x --grad-accum 2: the same micro-batches,
    the same global pair and chosen-token counts, and a sum of two partial gradients is exact in
    either order: the same losses, statistics and adapter bits."""
    from test_llama_system import mpirun
    args = ("--objective", objective, "--steps", 3, "--batch", 2)
    run(train_args(case, tmp_path / "one", *args, "--grad-accum", 2))
    two = mpirun(2, train_args(case, tmp_path / "two", *args))
    assert "2 ranks" in two.stdout
    rows = lambda out: [{k: v for k, v in r.items() if k not in ("grad_norm",)} for r in log_rows(out)]
    assert rows(tmp_path / "one") == rows(tmp_path / "two") and len(rows(tmp_path / "one")) == 3
    assert same_adapters(adapter(tmp_path / "one"), adapter(tmp_path / "two"))


def test_precomputed_reference_equals_in_step_and_resume_reads_it(case, tmp_path):
    """--ref-logps precompute (the reference logps of every pair, once, before step 1) gives the
    in-step reference's bits: the same forward per row (on the CPU a row's results do not depend on
    the rows beside it). Starting from the non-zero PEFT adapter the reference differs from the
    policy, so the table matters. A run stopped and resumed reads the table back from its directory
    instead of computing it, and ends with the bits of a run straight through."""
    common = ("--objective", "dpo", "--steps", 4, "--batch", 4)
    inline = train_args(case, tmp_path / "inline", *common, "--adapter", case / "adapter", "--lora-alpha", ALPHA)
    pre = train_args(case, tmp_path / "pre", *common, "--adapter", case / "adapter", "--lora-alpha", ALPHA,
                     "--ref-logps", "precompute")
    run(inline)
    p = run(pre)
    assert "reference logps: precomputed over 4 pairs" in p.stdout
    assert log_rows(tmp_path / "inline") == log_rows(tmp_path / "pre")
    assert float(log_rows(tmp_path / "pre")[0]["rewards/margins"]) != 0.0
    assert same_adapters(adapter(tmp_path / "inline"), adapter(tmp_path / "pre"))
    straight = train_args(case, tmp_path / "straight", *common, "--ref-logps", "precompute")
    run(straight)
    run(train_args(case, tmp_path / "split", *common, "--ref-logps", "precompute", "--stop-at", 2))
    p = run(["--resume", tmp_path / "split", "--model", case / "model", "--data", case / "pairs.bin", "--seq", SEQ,
             "--lora-rank", RANK, "--lr", 1e-2, "--threads", 1, *common, "--ref-logps", "precompute"])
    assert "reference logps: read from" in p.stdout and "reference logps: precomputed" not in p.stdout
    assert log_rows(tmp_path / "split") == log_rows(tmp_path / "straight")
    assert same_adapters(adapter(tmp_path / "split"), adapter(tmp_path / "straight"))


def test_precomputed_validation_reads_its_own_table(case, tmp_path):
    """--ref-logps precompute with --val: the validation pairs' reference logps are precomputed too
    (ref_logps_val.bin) and validation reads them: the same bits as computing them in each pass
    (the same forward per row), and a table whose chosen references were shifted (by +1 nat,
    while the run was stopped) changes the resumed run's validation and nothing else."""
    common = ("--objective", "dpo", "--steps", 4, "--batch", 4, "--lora-alpha", ALPHA, "--val", case / "pairs.bin",
              "--val-every", 2)
    start = ("--adapter", case / "adapter")  # (a resumed run's adapter is in its state)
    run(train_args(case, tmp_path / "inline", *common, *start))
    p = run(train_args(case, tmp_path / "pre", *common, *start, "--ref-logps", "precompute"))
    assert "ref_logps_val.bin" in p.stdout and (tmp_path / "pre" / "ref_logps_val.bin").exists()
    rows = log_rows(tmp_path / "pre")
    assert log_rows(tmp_path / "inline") == rows and sum(r["val_loss"] != "" for r in rows) == 3
    run(train_args(case, tmp_path / "t", *common, *start, "--ref-logps", "precompute", "--stop-at", 2))
    table = tmp_path / "t" / "ref_logps_val.bin"
    raw = table.read_bytes()
    logps = np.frombuffer(raw, "<f8", offset=32).reshape(-1, 2).copy()
    assert logps.shape == (PAIRS, 2) and np.all(logps < 0)
    logps[:, 0] += 1.0
    table.write_bytes(raw[:32] + logps.tobytes())
    resume = train_args(case, tmp_path / "t", *common, "--ref-logps", "precompute")
    resume[resume.index("--out")] = "--resume"
    run(resume)
    tampered = log_rows(tmp_path / "t")
    assert [r["loss"] for r in tampered] == [r["loss"] for r in rows]
    assert tampered[-1]["val_loss"] != rows[-1]["val_loss"] and tampered[2]["val_loss"] == rows[2]["val_loss"]


def test_train_vit_takes_sft_alone():
    """train_vit has the flag (one table of shared flags) but trains classifiers: any other objective is
    refused in one line; sft is the default and accepted."""
    vit = os.path.join(lc.REPO, "train_vit")
    data = os.path.join(lc.REPO, "data")
    args = [vit, "--model", os.path.join(data, "vit_demo"), "--data", os.path.join(data, "vit_demo_ft_train.bin"),
            "--steps", "0", "--threads", "1"]
    p = subprocess.run(args + ["--objective", "dpo"], capture_output=True, text=True, timeout=120, env=ENV)
    err = p.stderr.strip()
    assert p.returncode == 1 and err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert "--objective dpo" in err and "train_vit" in err
    p = subprocess.run(args + ["--objective", "sft"], capture_output=True, text=True, timeout=120, env=ENV)
    assert p.returncode == 0, p.stderr


def test_memory_modes_change_no_bit_and_dry_run_plans_the_pairs(case, tmp_path):
    """lowmem with --recompute block, and with --offload host too, trains DPO (reference pass
    included: it saves block checkpoints the policy's forward then overwrites) to lowmem's bits;
    --dry-run plans the pair layout: the plan of the same rows as SFT."""
    outs = []
    for k, extra in enumerate(((), ("--recompute", "block"), ("--recompute", "block", "--offload", "host"))):
        run(train_args(case, tmp_path / f"m{k}", "--objective", "dpo", "--steps", 3, "--batch", 4, "--mode", "lowmem",
                       "--adapter", case / "adapter", "--lora-alpha", ALPHA, *extra))
        outs.append(adapter(tmp_path / f"m{k}"))
    assert same_adapters(outs[0], outs[1]) and same_adapters(outs[0], outs[2])
    dry = lambda *x: run(["--model", case / "model", "--dry-run", "--batch", 4, "--seq", SEQ, "--json", *x]).stdout
    assert json.loads(dry("--objective", "dpo"))["activation_bytes"] == json.loads(dry())["activation_bytes"]
    text = run(["--model", case / "model", "--dry-run", "--batch", 4, "--seq", SEQ, "--objective", "dpo"]).stdout
    assert "objective dpo: --batch 4 rows = 2 pairs" in text and "reference pass" in text


def test_malformed_pair_shards_are_refused_naming_the_file(case, tmp_path):
    """Truncated, a wrong longest length, a token beyond the vocabulary, an empty completion: one
    line each, naming the file."""
    good = (case / "pairs.bin").read_bytes()
    n = int.from_bytes(good[8:16], "little")
    lens = np.frombuffer(good, "<u4", 3 * n, 64).reshape(n, 3)
    bad = {"truncated": (good[:-4], "run past the end"),
           "longest": (good[:20] + (int.from_bytes(good[20:24], "little") + 1).to_bytes(4, "little") + good[24:],
                       "longest"),
           "token": (good[:-4] + (10 ** 6).to_bytes(4, "little"), "vocabulary"),
           "empty": (good[:64 + 4] + (0).to_bytes(4, "little") + good[72:], "at least 1 token")}
    assert lens.min() >= 1
    for name, (data, needle) in bad.items():
        path = tmp_path / f"{name}.bin"
        path.write_bytes(data)
        expect_error(["--model", case / "model", "--data", path, "--objective", "dpo", "--seq", SEQ, "--batch", 2,
                      "--threads", 1], str(path), needle)


def full_args(case, out, mode, *extra):
    return ["--model", case / "model", "--data", case / "pairs.bin", "--objective", "dpo", "--full", "--batch",
            2 * PAIRS, "--seq", SEQ, "--mode", mode, "--lr", FULL_LR, "--min-lr-frac", 1, "--weight-decay", 0,
            "--grad-clip", 0, "--threads", 1, "--out", out, *extra]


FULL_LR = 1e-3  # small: AdamW's first update is ~lr * sign(g) per element, so rounding that flips a sign moves little


@pytest.mark.parametrize("mode", ["baseline", "lowmem"])
def test_full_dpo_two_steps_equal_autograd_reference(case, tmp_path, mode):
    """--full DPO against transformers autograd in float64 (pref_reference.py --full: every parameter
    trains, the reference model a frozen copy of the initial one; lowmem's MS norms fold the block
    gammas into the linears, as ours do): steps 1 and 2, each over all PAIRS pairs. At step 1 the
    policy is the reference (rewards 0); step 2's rewards are the updated policy against the
    frozen copy, so they show that the reference did not move with the weights (had it, they
    would be 0 again). Tolerances as test_step_equals_peft_autograd_reference's at step 1; step 2
    follows one AdamW update of lr 1e-3 per element, which carries the step-1 gradients' relative
    fp32 error (1e-4 on the norm, per element up to 1e-3) into the weights as a relative error of
    the update; so step 2 is compared at 10x step 1's relative tolerances."""
    out = tmp_path / f"full_{mode}"
    run(full_args(case, out, mode, "--steps", 2))
    got = [{k: float(v) for k, v in row.items() if v != "" and k not in ("step", "lr")} for row in log_rows(out)
           if row["loss"] != ""]
    ref_flags = ["--full", "--steps", 2, "--lr", FULL_LR, "--beta", 0.1] + (["--merge-gammas"] * (mode == "lowmem"))
    want = reference_steps(case, "approx" if mode == "lowmem" else "exact", *ref_flags)
    print(mode, "ours:", got, "reference:", want)
    assert len(got) == len(want) == 2
    assert want[0]["rewards/margins"] == 0.0 and abs(want[1]["rewards/margins"]) > 1e-3
    for s, rel in ((0, 1e-5), (1, 1e-4)):
        # (lowmem: the reference counts gate elements near a ReSiLU2 breakpoint, whose fp32 code could differ;
        # one that did would fail the comparison below, never pass it: the count is in the message)
        for k in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
            assert got[s][k] == pytest.approx(want[s][k], rel=rel, abs=2e-6), (s, k)
        assert got[s]["rewards/accuracies"] == want[s]["rewards/accuracies"] or s == 0
        assert got[s]["grad_norm"] == pytest.approx(want[s]["grad_norm"], rel=10 * rel), (s, want[s].get("ambiguous"))


def reference_steps(case, act, *extra):
    p = subprocess.run([HF_PYTHON, os.path.join(HERE, "pref_reference.py"), "--model", str(case / "model"),
                        "--adapter", "-", "--pairs", str(case / "pairs.bin"), "--objective", "dpo", "--act", act,
                        *map(str, extra)], capture_output=True, text=True, timeout=300, env=ENV)
    assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads(line) for line in p.stdout.strip().splitlines() if line.startswith("{")]


def test_full_dpo_kill_and_resume_is_bit_identical_and_planned(case, tmp_path):
    """--full DPO stopped by SIGKILL after step 2's save and resumed: its reference is the frozen
    copy of the initial weights (reloaded from --model, not the resumed ones), so it logs the same
    rows and saves the same weights and state as a run straight through; with a reference that
    had followed the resume, step 3's rewards would start from 0 again. --dry-run shows the copy as
    the plan's dpo_reference buffer, as large as the trainable arena (bf16 in CUDA's layout)."""
    args = ("--steps", 4, "--save-every", 2)
    run(full_args(case, tmp_path / "straight", "baseline", *args))
    from test_llama_system import FAULT_BIN
    if not os.path.exists(FAULT_BIN):
        pytest.fail(f"{FAULT_BIN} is missing: build it with `make build/test/train_llama`")
    p = subprocess.run([FAULT_BIN] + [str(a) for a in full_args(case, tmp_path / "killed", "baseline", *args)],
                       capture_output=True, text=True, timeout=300, env=dict(ENV, LLMC_FAULT_STOP_STEP="3:kill"))
    assert p.returncode == -9, p.stderr
    resume = full_args(case, tmp_path / "killed", "baseline", *args)
    resume[resume.index("--out")] = "--resume"
    run(resume)
    rows = log_rows(tmp_path / "straight")
    assert log_rows(tmp_path / "killed") == rows and abs(float(rows[-1]["rewards/margins"])) > 1e-3
    for f in ("model.safetensors", "train_state.bin"):
        assert (tmp_path / "killed" / f).read_bytes() == (tmp_path / "straight" / f).read_bytes(), f
    dry = lambda *x: run(["--model", case / "model", "--dry-run", "--batch", 4, "--seq", SEQ, "--full", *x]).stdout
    text = dry("--objective", "dpo")
    assert "dpo_reference" in text and "dpo_reference" not in dry() and "frozen initial weights" in text
    plan = lambda *x: json.loads(dry("--json", *x))
    n_params = sum(int(np.prod(v.shape)) for v in safetensors(case / "model" / "model.safetensors").values())
    # baseline: every tensor trains (lowmem's MS norms fold the block gammas into the linears); CUDA's layout, bf16
    with_ref, without = plan("--objective", "dpo", "--mode", "baseline"), plan("--mode", "baseline")
    assert with_ref["dpo_reference_bytes"] == 2 * n_params
    # (the arena's size: the buffer rounded up to llmc/memory/plan.h's PLAN_ALIGN, 64 bytes)
    assert with_ref["categories"]["frozen"] - without["categories"]["frozen"] == -(-2 * n_params // 64) * 64


def safetensors(path):
    import st_io
    return st_io.load(str(path))


@pytest.mark.parametrize("objective,extra", [("dpo", ("--lora-rank", RANK, "--lr", 1e-3, "--adapter", "ADAPTER",
                                                      "--lora-alpha", ALPHA, "--lora-dropout", 0.2)),
                                             ("orpo", ("--lora-rank", RANK, "--lr", 1e-3)),
                                             ("dpo", ("--lora-rank", RANK, "--lr", 1e-3, "--adapter", "ADAPTER",
                                                      "--lora-alpha", ALPHA, "--ref-logps", "precompute")),
                                             ("dpo", ("--full", "--lr", 1e-4))])
def test_seq_parallel_two_ranks_equal_one_process(case, tmp_path, objective, extra):
    """--seq-parallel 2 against one process on the same pairs, with validation: each rank holds half
    of the batch's tokens, and a sequence's logp is the sum of its pieces' sums across the group
    (llmc/models/llama_pref.h's llama_row_logps). Every per-token value is the same code on the same
    inputs, so the bounds are test/system/test_seq_parallel.py's (derived there for the same split
    of fp32 sums, at its learning rates: 1e-3 LoRA, 1e-4 --full): step 1's statistics to log.csv's
    printed digit (its logps are sums of per-token values split into two fp64 partial sums), its
    gradient norm to 2e-5 relative, the later losses to 3e-5."""
    from test_llama_system import mpirun
    from test_seq_parallel import LATER_LOSS_ABS, STEP1_LOSS_ABS, STEP1_NORM_REL
    extra = [case / "adapter" if x == "ADAPTER" else x for x in extra]
    args = lambda out: ["--model", case / "model", "--data", case / "pairs.bin", "--val", case / "pairs.bin",
                        "--val-every", 2, "--objective", objective, "--steps", 3, "--batch", 4, "--seq", SEQ,
                        "--threads", 1, "--out", out, *extra]
    run(args(tmp_path / "one"))
    two = mpirun(2, args(tmp_path / "two") + ["--seq-parallel", 2])
    assert "2 ranks" in two.stdout
    one, two = log_rows(tmp_path / "one"), log_rows(tmp_path / "two")
    assert len(one) == len(two) == 4  # step 0's validation, then 3 steps
    for k, v in one[1].items():
        if k not in ("step", "lr", "grad_norm") and v != "":
            assert abs(float(two[1][k]) - float(v)) <= STEP1_LOSS_ABS, k
    assert abs(float(two[1]["grad_norm"]) / float(one[1]["grad_norm"]) - 1) <= STEP1_NORM_REL
    for a, b in zip(one, two):
        for k in ("loss", "val_loss", "val_rewards/accuracies"):
            assert (a[k] == "") == (b[k] == "") and (a[k] == "" or abs(float(a[k]) - float(b[k])) <= LATER_LOSS_ABS), k
    assert one[0]["val_loss"] != "" and one[2]["val_loss"] != ""
