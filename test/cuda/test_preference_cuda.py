"""Preference steps (train_llama --objective dpo|simpo, llmc/models/llama_pref.h) on the CUDA
backend against the CPU backend: step 1 on a random model with a random non-zero adapter (no PEFT
needed: llama_cases' writer and our own adapter save), whose CPU side test/system/test_preference.py
checks against transformers + PEFT. The CUDA side runs on the emulator (build/emu/train_llama) or,
with CUDA_TEST_BACKEND=gpu, on a GPU (not yet run on one).
Tolerances: CUDA keeps activations and frozen weights in bf16 (unit roundoff 2^-9 = 2e-3), so each
summed logp is within ~2e-3 relative (a sum of same-signed log-probabilities); a reward is beta
times a difference of two such sums computed through the same rounding, so within beta * 2 * 2e-3 *
|logp|; the loss and the gradient norm within test/cuda/test_llama_cuda.py's loss tolerance 1e-2 and
1e-2 (the norm averages the per-element gradient error that file bounds by 0.15 per tensor)."""
import csv

import numpy as np
import pytest

import llama_cases as lc
import shards
from cuda_backend import binaries, need, run

CUDA_TRAIN, _, CPU_TRAIN, _ = binaries("train_llama", "llama_probe")
SEQ, PAIRS = 12, 2


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """A random model, an adapter with non-zero B (two SFT steps of our CPU trainer) and two pairs."""
    d = tmp_path_factory.mktemp("pref_cuda")
    cfg = lc.model_config("gqa_untied")
    lc.write_model(str(d / "model"), cfg, seed=5)
    V = cfg["vocab_size"]
    rng = np.random.default_rng(4)
    toks = rng.integers(3, V, size=300)
    shards.write_shard(str(d / "tokens.bin"), toks.astype(np.uint32), np.ones(toks.size, np.uint8), V)
    run([need(CPU_TRAIN), "--model", d / "model", "--data", d / "tokens.bin", "--steps", 2, "--seq", SEQ, "--lr", 0.05,
         "--lora-rank", 4, "--threads", 1, "--device", "cpu", "--out", d / "adapter"])
    pairs = [[list(rng.integers(0, V, size=n)) for n in (3 + i, 4 + 2 * i, 6 - i)] for i in range(PAIRS)]
    shards.write_pair_shard(str(d / "pairs.bin"), pairs, V)
    return d


def step_one(exe, device, case, tmp_path, objective, *flags):
    out = tmp_path / f"{device}_{objective}"
    run([need(exe), "--model", case / "model", "--adapter", case / "adapter", "--data", case / "pairs.bin",
         "--objective", objective, "--steps", 1, "--batch", 2 * PAIRS, "--seq", SEQ, "--lora-rank", 4, "--grad-clip", 0,
         "--mode", "lowmem", "--threads", 1, "--device", device, "--out", out, *flags])
    with open(out / "log.csv") as f:
        row = list(csv.DictReader(f))[-1]
    return {k: float(v) for k, v in row.items() if v and k not in ("step", "lr", "tokens_per_s")}


@pytest.mark.parametrize("objective,flags,beta", [("dpo", ("--beta", "0.5"), 0.5), ("simpo", (), 2.0)])
def test_cuda_preference_step_matches_cpu(case, tmp_path, objective, flags, beta):
    cpu = step_one(CPU_TRAIN, "cpu", case, tmp_path, objective, *flags)
    cuda = step_one(CUDA_TRAIN, "cuda", case, tmp_path, objective, *flags)
    print(objective, "cpu:", cpu, "\ncuda:", cuda)
    for k in ("logps/chosen", "logps/rejected"):
        assert cuda[k] == pytest.approx(cpu[k], rel=2e-3), k
    for k in ("rewards/chosen", "rewards/rejected"):
        assert abs(cuda[k] - cpu[k]) <= beta * 2 * 2e-3 * max(abs(cpu["logps/chosen"]), abs(cpu["logps/rejected"])), k
    assert cuda["loss"] == pytest.approx(cpu["loss"], rel=1e-2)
    assert cuda["grad_norm"] == pytest.approx(cpu["grad_norm"], rel=1e-2)
    if objective == "dpo":
        assert abs(cpu["rewards/margins"]) > 1e-3  # the adapter changes the model: the reference pass matters


def full_two_steps(exe, device, case, tmp_path):
    out = tmp_path / f"{device}_full"
    run([need(exe), "--model", case / "model", "--data", case / "pairs.bin", "--objective", "dpo", "--beta", 0.5,
         "--full", "--steps", 2, "--batch", 2 * PAIRS, "--seq", SEQ, "--lr", 1e-3, "--min-lr-frac", 1, "--grad-clip", 0,
         "--mode", "lowmem", "--threads", 1, "--device", device, "--out", out])
    with open(out / "log.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["loss"]]
    return [{k: float(v) for k, v in r.items() if v and k not in ("step", "lr", "tokens_per_s")} for r in rows]


def test_cuda_full_dpo_reference_is_the_frozen_initial_bf16_weights(case, tmp_path):
    """--full DPO on CUDA: the reference reads the frozen bf16 copy of the initial weights (the
    shadow at step 0, pointer-swapped in). Step 1: the policy is those very bits, so the rewards
    are exactly 0 as on the CPU; step 2 (after one AdamW update) within the bounds of
    test_cuda_preference_step_matches_cpu's derivation against the CPU backend, which
    test/system/test_preference.py checks against transformers autograd. A reference that moved
    with the weights would give step 2's rewards 0, beyond those bounds (asserted: the rewards
    are well above them)."""
    cpu = full_two_steps(CPU_TRAIN, "cpu", case, tmp_path)
    cuda = full_two_steps(CUDA_TRAIN, "cuda", case, tmp_path)
    print("cpu:", cpu, "\ncuda:", cuda)
    assert len(cpu) == len(cuda) == 2
    for k in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert cuda[0][k] == 0.0 and cpu[0][k] == 0.0, k
    beta = 0.5
    for s in range(2):
        bound = beta * 2 * 2e-3 * max(abs(cpu[s]["logps/chosen"]), abs(cpu[s]["logps/rejected"]))
        for k in ("logps/chosen", "logps/rejected"):
            assert cuda[s][k] == pytest.approx(cpu[s][k], rel=2e-3), (s, k)
        for k in ("rewards/chosen", "rewards/rejected"):
            assert abs(cuda[s][k] - cpu[s][k]) <= bound, (s, k)
            assert s == 0 or abs(cpu[s][k]) > 3 * bound, (s, k)  # the frozen reference matters
        # the loss -log sigmoid(m) and the gradient's factor sigmoid(-m) move with the margin m, which is within
        # 2 * bound: d loss / dm = -sigmoid(-m), d ln sigmoid(-m) / dm = -sigmoid(m); plus the step-1 tolerances
        m = cpu[s]["rewards/margins"]
        dm = 2 * bound
        assert abs(cuda[s]["loss"] - cpu[s]["loss"]) <= 1e-2 * cpu[s]["loss"] + dm / (1 + np.exp(m)), s
        assert cuda[s]["grad_norm"] == pytest.approx(cpu[s]["grad_norm"], rel=1e-2 + dm / (1 + np.exp(-m))), s
