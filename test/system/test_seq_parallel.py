"""Sequence parallelism (--seq-parallel P, issue 26; llmc/train/seq_parallel.h) on the CPU backend
under mpirun: groups of P ranks share each sequence (each holds 1/P of its tokens, attention
exchanges heads with all-to-alls), data parallelism runs across groups. The reference is one
process training the same global batch on the same data: the sum over ranks of their slices is
the same sum over the same tokens, so everything differs only by the order of fp32 sums.

The demo model has 4 query heads and 2 key/value heads, so P = 2 is grouped-query attention with
one key/value head per rank, and P = 4 has fewer key/value heads than ranks: each is replicated
over 2 ranks (as DeepSpeed-Ulysses does), the replicas' key/value gradients summed back. A model
of one key/value head (module fixture) replicates it over both ranks at P = 2."""
import csv
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts", "formats"))
import shards  # noqa: E402
sys.path.insert(0, os.path.join(REPO, "test", "model"))
import llama_cases as lc  # noqa: E402
import phi3_cases  # noqa: E402

DATA = os.path.join(REPO, "data")
LLAMA, TRAIN, VAL = (os.path.join(DATA, n) for n in ("llama_demo", "llama_demo_ft_train.bin", "llama_demo_ft_val.bin"))
PROGRAM = os.path.join(REPO, "train_llama")
FAULT_PROGRAM = os.path.join(REPO, "build", "test", "train_llama")  # the test build: fault injectors compiled in
MPIRUN = shutil.which("mpirun")
ENV = dict(os.environ, OMP_NUM_THREADS="1")
SEQ, STEPS = 16, 4

# Step 1 runs the same weights on the same tokens: every per-token value (the linears are row by
# row, attention is per head over the same keys) is computed by the same code on the same inputs,
# and only the loss's sum over tokens is split into per-rank partial sums (fp64 in the loss, then
# MPI's fp64 sum): its relative change is ~1e-15, far below log.csv's 6 decimals, so step 1's loss
# must agree to the printed digit (one unit of rounding at 1e-6). The gradient is a sum over the
# step's 64 tokens in fp32 that the ranks split into partial sums: each element may move by
# ~64 * 2^-24 ~ 4e-6 of the sum of its terms' magnitudes, which the norm of the gradient carries
# as a relative change of the same order: 2e-5 relative leaves a factor 5 of headroom.
STEP1_LOSS_ABS, STEP1_NORM_REL = 2e-6, 2e-5
# relative ~4e-6 per element (B = 0 at the start makes A's first gradient exactly 0 in both runs,
# so no element starts on a tie). An update lr * m / sqrt(v) moves by at most ~2 * 4e-6 of itself
# per step, so after 3 steps each adapter value differs by <= 3 * lr (1e-3) * 8e-6 = 2.4e-8,
# and the loss by at most ||dL/dtheta||_1 * 2.4e-8 <= sqrt(1.1e4 adapter values) * |grad| (~8) *
# 2.4e-8 ~ 2e-5 (the L1 norm by Cauchy-Schwarz from the logged L2 norm), plus log.csv's rounding
# of 1e-6, rounded up. Measured: 1e-6 (the rounding) at most, on every step.
LATER_LOSS_ABS = 3e-5


def launch(np_, *flags, timeout=240):
    if not MPIRUN:
        pytest.fail("mpirun not found: install openmpi-bin (scripts/ci/install_deps.sh does)")
    cmd = [PROGRAM] + [str(x) for x in flags]
    if np_ > 1:
        cmd = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-np", str(np_)] + cmd
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout)


def train(tmp_path, name, np_, batch, data=TRAIN, *extra, model=LLAMA):
    out = tmp_path / name
    what = ["--lr", 1e-4] if "--full" in extra else ["--lora-rank", 2, "--lr", 1e-3]
    p = launch(np_, "--model", model, "--data", data, "--steps", STEPS, "--batch", batch, "--seq", SEQ, *what,
               "--device", "cpu", "--out", out, *extra)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    with open(out / "log.csv") as f:
        rows = [r for r in csv.DictReader(f)]
    steps = [r for r in rows if r["loss"]]
    printed = [line.split("|")[1].strip() for line in p.stdout.splitlines() if line.startswith("step ")
               and "| loss" in line]
    return {"loss": [float(r["loss"]) for r in steps], "norm": [float(r["grad_norm"]) for r in steps],
            "val": [float(r["val_loss"]) for r in rows if r.get("val_loss")], "printed": printed}


def assert_equivalent(single, split):
    assert len(single["loss"]) == len(split["loss"]) == STEPS
    assert single["printed"][0] == split["printed"][0], (single["printed"], split["printed"])
    assert abs(single["loss"][0] - split["loss"][0]) <= STEP1_LOSS_ABS, (single["loss"], split["loss"])
    assert abs(single["norm"][0] - split["norm"][0]) <= STEP1_NORM_REL * single["norm"][0], (single["norm"],
                                                                                           split["norm"])
    diffs = np.abs(np.array(single["loss"]) - np.array(split["loss"]))
    assert diffs.max() <= LATER_LOSS_ABS, (single["loss"], split["loss"])
    # the steps differ from each other by far more than the bound: the comparison can fail
    assert np.abs(np.diff(single["loss"])).min() > 100 * LATER_LOSS_ABS, single["loss"]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """The demo shard with example starts at positions that put boundaries inside each rank's slice
    (slices of SEQ / 2 = 8 tokens: starts at 3, 6, 11 and 13 of every window) and across them."""
    tokens, mask, vocab = shards.read_shard(TRAIN)[:3]
    starts = np.zeros(tokens.size, np.uint8)
    for off in (3, 6, 11, 13):
        starts[off::SEQ] = 1
    path = tmp_path_factory.mktemp("packed") / "packed.bin"
    shards.write_shard(str(path), tokens, mask, vocab, starts=starts)
    return str(path)


def test_two_ranks_match_one_process_gqa_with_dropout_and_validation(tmp_path):
    flags = ["--lora-dropout", 0.3, "--val", VAL, "--val-batches", 2, "--val-every", 2]
    single = train(tmp_path, "single", 1, 2, TRAIN, *flags)
    split = train(tmp_path, "split", 2, 2, TRAIN, "--seq-parallel", 2, *flags)
    assert_equivalent(single, split)
    assert len(single["val"]) == len(split["val"]) == 3  # before training, at step 2 and at the end
    assert np.abs(np.array(single["val"]) - np.array(split["val"])).max() <= LATER_LOSS_ABS, (single, split)
    assert abs(single["val"][0] - split["val"][0]) <= STEP1_LOSS_ABS  # the same weights: the same loss


def test_two_by_two_ranks_match_one_process_on_packed_examples(tmp_path, packed):
    # 4 ranks: 2 data-parallel groups of 2 (--batch 2 each) against one process with both groups'
    # batch (--batch 4: the loader hands rank r of world w the windows r*B.. of the global batch),
    # each accumulating 2 micro-batches (dropout's rows: micro-batch k of every group before k + 1)
    single = train(tmp_path, "single", 1, 4, packed, "--lora-dropout", 0.1, "--grad-accum", 2)
    split = train(tmp_path, "split", 4, 2, packed, "--seq-parallel", 2, "--lora-dropout", 0.1, "--grad-accum", 2)
    assert_equivalent(single, split)


@pytest.mark.parametrize("mode", [["--recompute", "block", "--offload", "host", "--lora-dropout", 0.2],
                                  ["--recompute", "block", "--norm", "std"], ["--norm", "std", "--act", "exact"],
                                  ["--full"], ["--full", "--norm", "std"],
                                  ["--quant", "nf4", "--recompute", "block", "--mlp-tile", 8]])
def test_memory_modes_and_full_fine_tuning_match_one_process(tmp_path, mode):
    # --full: every weight trains (about 1.4e5 values at --lr 1e-4: the later-step bound's
    # sqrt(values) * |grad| * 3 lr * 8e-6 is ~1e-5, inside it) and ZeRO-1 shards the optimizer over
    # all ranks; --recompute block runs each block's forward, exchanges included, again in backward
    # (the exchanges' scratch is lent by buffers dead at the time, which differ between the forward,
    # the recomputed forward on the checkpoint (MS norms) or on a copy of it (standard norms), and
    # the backward: llmc/models/llama_plan.h's llama_seqpar_lends); NF4 weights and tiles of 8 of a rank's 16
    # tokens change nothing the exchanges see
    single = train(tmp_path, "single", 1, 2, TRAIN, *mode)
    split = train(tmp_path, "split", 2, 2, TRAIN, "--seq-parallel", 2, *mode)
    assert_equivalent(single, split)


@pytest.fixture(scope="module")
def one_kv_head(tmp_path_factory):
    """The demo's shape (and vocabulary, for its data) with 2 layers and one key/value head for its 4
    query heads: at P = 2 both ranks hold a copy of it, each for its own 2 query heads."""
    cfg = lc.model_config("gqa_untied")
    cfg.update(hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=1, vocab_size=512)
    d = tmp_path_factory.mktemp("kv1") / "model"
    lc.write_model(str(d), cfg, seed=5)
    return str(d)


@pytest.mark.parametrize("ranks,P,model", [(4, 4, "demo"), (2, 2, "one_kv_head")])
def test_fewer_kv_heads_than_ranks_replicate_and_match_one_process(tmp_path, request, ranks, P, model):
    # demo at P = 4: 2 kv heads, each replicated over 2 ranks of one query head each; one kv head at
    # P = 2: replicated over both ranks, each with 2 query heads sharing it
    path = LLAMA if model == "demo" else request.getfixturevalue("one_kv_head")
    single = train(tmp_path, "single", 1, 2, TRAIN, "--lora-dropout", 0.2, model=path)
    split = train(tmp_path, "split", ranks, 2, TRAIN, "--seq-parallel", P, "--lora-dropout", 0.2, model=path)
    assert_equivalent(single, split)


def test_packed_examples_restart_attention_across_the_slices(tmp_path, packed):
    # the packed run's step-1 loss is not the unpacked one's (the starts matter), so the match
    # above could only come from positions and example boundaries taken per global token
    a = train(tmp_path, "packed", 2, 2, packed, "--seq-parallel", 2)
    b = train(tmp_path, "plain", 2, 2, TRAIN, "--seq-parallel", 2)
    assert abs(a["loss"][0] - b["loss"][0]) > 1e-3, (a["loss"], b["loss"])


def base_flags(*extra):
    return ["--model", LLAMA, "--data", TRAIN, "--steps", 1, "--batch", 1, "--seq", SEQ, "--lora-rank", 2,
            "--device", "cpu", *extra]


def refused(p, *needles):
    assert p.returncode != 0 and p.returncode < 128, (p.returncode, p.stdout[-500:], p.stderr[-1000:])
    err = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert err, p.stderr
    for n in needles:
        assert n in err[0], err[0]
    assert "step " not in p.stdout, p.stdout


@pytest.mark.parametrize("np_,extra,needles", [
    (2, ["--seq-parallel", 3], ["--seq-parallel", "3 does not divide the model's 4 attention heads"]),
    (1, ["--seq-parallel", 2], ["--seq-parallel", "2 does not divide the 1 ranks"]),
    (2, ["--seq-parallel", 2, "--seq", 15], ["--seq-parallel", "2 does not divide --seq 15"]),
    (1, ["--seq-parallel", 0], ["--seq-parallel", "expected >= 1"]),
    (2, ["--seq-parallel", 2, "--generate", 4], ["--seq-parallel", "--generate"]),
])
def test_bad_values_are_refused_in_one_line(np_, extra, needles):
    refused(launch(np_, *base_flags(*extra)), *needles)


@pytest.mark.parametrize("kv,needles", [
    (3, ["--seq-parallel", "4 is not a multiple of the model's 3 key/value heads"]),
    (6, ["--seq-parallel", "4 does not divide the model's 6 key/value heads"]),
])
def test_key_value_heads_that_cannot_be_split_or_replicated_are_refused(tmp_path, kv, needles):
    # 12 query heads (P = 4 divides them): 3 key/value heads cannot be replicated evenly over 4
    # ranks, 6 cannot be split over them; refused from the model's config, before any weight is read
    cfg = lc.model_config("gqa_untied")
    cfg.update(hidden_size=48, num_attention_heads=12, num_key_value_heads=kv, vocab_size=512)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(cfg))
    flags = base_flags("--seq-parallel", 4)
    flags[flags.index("--model") + 1] = model
    refused(launch(1, *flags), *needles)


@pytest.mark.parametrize("how", ["fail", "kill"])
def test_a_rank_that_stops_stops_the_job(how):
    # rank 1 alone stops as step 2 begins (LLMC_FAULT_STOP_STEP, llmc/train/loop.h: an error, or
    # SIGKILL), while rank 0 runs into step 2's first all-to-all, which waits for rank 1 forever
    # unless the job is taken down: the whole mpirun must end, non-zero, well inside the timeout
    if not MPIRUN:
        pytest.fail("mpirun not found: install openmpi-bin (scripts/ci/install_deps.sh does)")
    line = [FAULT_PROGRAM] + [str(x) for x in base_flags("--steps", 3, "--seq-parallel", 2)]
    fault = "2" if how == "fail" else "2:kill"
    cmd = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-np", "1"] + line + [
        ":", "-np", "1", "-x", f"LLMC_FAULT_STOP_STEP={fault}"] + line
    p = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=30)
    assert p.returncode != 0, (p.stdout[-1000:], p.stderr[-2000:])
    assert "step    1/3" in p.stdout and "step    2/3" not in p.stdout, p.stdout[-1000:]  # it stopped mid-run
    if how == "fail":  # the failing rank's one line, then the job's end
        err = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
        assert len(err) == 1 and "step 2" in err[0] and "LLMC_FAULT_STOP_STEP" in err[0], p.stderr[-2000:]
    else:
        assert "signal 9" in p.stderr, p.stderr[-2000:]


def dry_json(*extra):
    p = launch(1, "--model", LLAMA, "--dry-run", "--json", "--seq", 64, "--batch", 2, "--device", "cpu", *extra)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_dry_run_plans_one_ranks_share():
    # every saved activation is per token ([tokens, width], lse [B, H/P, T] = tokens * H / P), so
    # one rank of a group of 2 keeps exactly half of one process's; frozen weights and the
    # adapters' state do not change
    one = dry_json("--ranks", 2)
    half = dry_json("--ranks", 2, "--seq-parallel", 2)
    assert half["tokens"] * 2 == one["tokens"]
    assert half["activation_bytes"] * 2 == one["activation_bytes"]
    assert half["baseline"]["activation_bytes"] * 2 == one["baseline"]["activation_bytes"]
    for cat in ("frozen", "trainable", "grads", "optimizer"):
        assert half["categories"][cat] == one["categories"][cat], cat
    # P = 4 over the demo's 2 key/value heads: each rank keeps k and v of one replicated head for
    # the whole sequence ([N, hd], twice its tokens' share [n, 2 hd]); q, o [n, 4 hd], lse [n * 4]
    quarter = dry_json("--ranks", 4, "--seq-parallel", 4)
    with open(os.path.join(LLAMA, "config.json")) as f:
        cfg = json.load(f)
    n, P, heads = quarter["tokens"], 4, cfg["num_attention_heads"]
    hd = cfg["hidden_size"] // heads
    assert n * P == one["tokens"]
    want = 4 * (2 * n * heads * hd + 2 * n * P * hd + n * heads)  # fp32 on the CPU backend
    assert quarter["per_block"]["attention"] == want, (quarter["per_block"], want)
    # the exchanges' scratch is lent by gradient buffers dead at the time (the demo's heads x head
    # dim equal its width): the group's own part is every token's position, [B * seq] int32
    lent = dry_json("--ranks", 2, "--seq-parallel", 2, "--recompute", "block")
    assert lent["block_peak_parts"]["seq_parallel"] == 4 * 2 * 64, lent["block_peak_parts"]
    p = launch(1, "--model", LLAMA, "--dry-run", "--seq", 64, "--device", "cpu", "--ranks", 3, "--seq-parallel", 2)
    refused(p, "--seq-parallel", "does not divide the 3 ranks planned")


def test_stop_and_resume_equals_one_run(tmp_path):
    # the same ranks, the same sums in the same order: a resumed run is bit-identical, and the
    # saved state records P (a resume with another P would read the data in another order)
    whole = train(tmp_path, "whole", 2, 2, TRAIN, "--seq-parallel", 2, "--lora-dropout", 0.2)
    out = tmp_path / "resumed"

    def flags(P, *extra):
        return ["--model", LLAMA, "--data", TRAIN, "--steps", STEPS, "--batch", 2, "--seq", SEQ, "--lora-rank", 2,
                "--lr", 1e-3, "--device", "cpu", "--seq-parallel", P, "--lora-dropout", 0.2, "--save-every", 2,
                *extra]
    p = launch(2, *flags(2, "--stop-at", 2, "--out", out))
    assert p.returncode == 0, p.stderr[-2000:]
    refused(launch(2, *flags(1, "--resume", out)), "seq_parallel")
    p = launch(2, *flags(2, "--resume", out))
    assert p.returncode == 0 and "resumed" in p.stdout, (p.stdout[-1000:], p.stderr[-2000:])
    with open(out / "log.csv") as f:
        resumed = [float(r["loss"]) for r in csv.DictReader(f) if r["loss"]]
    assert resumed == whole["loss"], (resumed, whole["loss"])


def test_sliding_window_across_the_slices_matches_one_process(tmp_path, packed):
    """The demo as a Mistral with a 3-position window (SEQ 16: each rank's slice of 8 tokens has
    keys of its window on the other rank), on packed examples: the exchanges move whole heads, so
    every query still sees its window within its example, and the split run equals one process;
    the window matters (the example of positions 6..10 is longer than it: another step-1 loss than
    the demo's)."""
    model = tmp_path / "mistral"
    shutil.copytree(LLAMA, model)
    cfg = json.load(open(model / "config.json"))
    cfg.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=3)
    (model / "config.json").write_text(json.dumps(cfg))
    single = train(tmp_path, "single", 1, 2, packed, model=str(model))
    split = train(tmp_path, "split", 2, 2, packed, "--seq-parallel", 2, model=str(model))
    assert_equivalent(single, split)
    full = train(tmp_path, "full", 1, 2, packed)
    assert abs(full["loss"][0] - single["loss"][0]) > 1e-3, (full["loss"], single["loss"])


def test_gemma2_matches_one_process(tmp_path):
    """Gemma 2 (sandwich norms, GeGLU, soft-capped logits) at P = 2, in the demo's vocabulary: as one
    process, within the bounds above."""
    cfg = lc.model_config("gemma2")
    cfg.update(vocab_size=512)
    d = tmp_path / "model"
    lc.write_model(str(d), cfg, seed=5)
    single = train(tmp_path, "single", 1, 2, TRAIN, model=str(d))
    split = train(tmp_path, "split", 2, 2, TRAIN, "--seq-parallel", 2, model=str(d))
    assert_equivalent(single, split)


@pytest.mark.parametrize("mode", [[], ["--full"]])
def test_phi3_matches_one_process(tmp_path, mode):
    """Phi-4-mini's shape (Phi-3's fused qkv_proj and gate_up_proj, rotary over 12 of 16 dims,
    LongRoPE with an original context of 8, tied) at P = 2, in the demo's vocabulary: as one process,
    within the bounds above. Each rank holds 8 of the 16 positions, and the table is the whole
    sequence's (llmc/models/llama_io.h's llama_rope_table: the long factors for both runs)."""
    cfg = phi3_cases.model_config("phi4_mini")
    cfg.update(vocab_size=512)
    d = tmp_path / "model"
    phi3_cases.write_phi3_model(str(d), cfg, seed=5)
    single = train(tmp_path, "single", 1, 2, TRAIN, *mode, model=str(d))
    split = train(tmp_path, "split", 2, 2, TRAIN, "--seq-parallel", 2, *mode, model=str(d))
    assert_equivalent(single, split)


@pytest.mark.parametrize("mode", [["--mode", "baseline"], ["--mode", "lowmem"], ["--mode", "lowmem", "--recompute",
                                  "block"], ["--mode", "baseline", "--full"], ["--mode", "lowmem", "--full"]])
@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_qk_norms_match_one_process(tmp_path, name, mode):
    """Qwen3's and Gemma 3's q/k norms (per token and head, before RoPE) at P = 2, in the demo's
    vocabulary: as one process, within the bounds above. They run on the rank's own tokens before
    the exchange. Under lowmem with LoRA the block keeps their normalised rows and the backward
    rebuilds q and k from them in token layout, then exchanges them to the head layout attention's
    backward reads (llmc/models/llama.h's llama_qk_rebuild); --recompute block rebuilds them in the
    recomputed forward instead; baseline and --full keep the norms' inputs. Gemma 3's single
    key/value head is replicated over both ranks, its local layers' window (5) crosses the slices."""
    cfg = lc.model_config(name)
    cfg.update(vocab_size=512)
    d = tmp_path / "model"
    lc.write_model(str(d), cfg, seed=5)
    single = train(tmp_path, "single", 1, 2, TRAIN, *mode, model=str(d))
    split = train(tmp_path, "split", 2, 2, TRAIN, "--seq-parallel", 2, *mode, model=str(d))
    assert_equivalent(single, split)
