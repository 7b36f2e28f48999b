"""train_llama as a user runs it: training lowers the loss, runs are deterministic, the memory
plan and --dry-run --json, the real stories260K model, and every bad input of docs/testing.md
(one-line error naming the file or flag, non-zero exit, no crash, no partial output)."""
import json
import os
import re
import shutil
import struct
import subprocess

import numpy as np
import pytest

import llama_cases as lc
from llama_cases import auto_smallest_tile

REPO = lc.REPO
BIN = os.path.join(REPO, "train_llama")
import shards  # noqa: E402  (scripts/formats is on sys.path via llama_cases)

ENV = dict(os.environ, OMP_NUM_THREADS="2")


def run(args, check=True, timeout=300, env=None):
    if not os.path.exists(BIN):
        pytest.fail(f"{BIN} is missing: build it with `make train_llama`")
    p = subprocess.run([BIN] + [str(a) for a in args], capture_output=True, text=True, env=dict(ENV, **(env or {})),
                       timeout=timeout)
    if check and p.returncode != 0:
        pytest.fail(f"train_llama {' '.join(map(str, args))} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def expect_error(args, *needles):
    p = run(args, check=False)
    assert p.returncode != 0, f"expected failure, got success:\n{p.stdout}"
    assert p.returncode < 128, f"crashed with signal {p.returncode - 128}: {p.stderr}"
    err = p.stderr.strip()
    assert err.startswith("error: "), f"no error line: {err!r}"
    assert len(err.splitlines()) == 1, f"error must be one line: {err!r}"
    for n in needles:
        assert n in err, f"error {err!r} does not mention {n!r}"
    return err


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A small random model and a learnable token stream (a repeating pattern with noise)."""
    d = tmp_path_factory.mktemp("tiny")
    model = d / "model"
    cfg = lc.model_config("gqa_untied")
    lc.write_model(str(model), cfg, seed=3)
    rng = np.random.default_rng(0)
    pattern = rng.integers(3, cfg["vocab_size"], size=17)
    toks = np.tile(pattern, 400)
    noise = rng.random(toks.size) < 0.05
    toks[noise] = rng.integers(3, cfg["vocab_size"], size=noise.sum())
    mask = np.ones(toks.size, np.uint8)
    mask[::9] = 0
    shards.write_shard(str(d / "train.bin"), toks.astype(np.uint32), mask, cfg["vocab_size"])
    shards.write_shard(str(d / "val.bin"), toks[:2000].astype(np.uint32), mask[:2000], cfg["vocab_size"])
    return d


def train_args(tiny, *extra):
    return ["--model", tiny / "model", "--data", tiny / "train.bin", "--val", tiny / "val.bin", "--steps", 25,
            "--batch", 4, "--seq", 32, "--lr", 1e-2, "--lora-rank", 4, "--seed", 5, *extra]


def losses(stdout):
    return [float(line.split("| loss ")[1].split()[0]) for line in stdout.splitlines() if line.startswith("step ") and "| loss " in line]


def val_losses(stdout):
    return [float(line.split("val loss ")[1].split()[0]) for line in stdout.splitlines() if "val loss" in line]


@pytest.mark.parametrize("mode", ["baseline", "lowmem", "ckpt"])
def test_finetune_lowers_loss(tiny, mode):
    p = run(train_args(tiny, "--mode", mode, "--val-every", 5))
    ls, vl = losses(p.stdout), val_losses(p.stdout)
    assert len(ls) == 25 and len(vl) == 6  # before training, then every 5 steps
    first, last = np.mean(ls[:3]), np.mean(ls[-3:])
    print(f"{mode}: train loss {first:.3f} -> {last:.3f}, val {vl[0]:.3f} -> {vl[-1]:.3f}")
    assert last < 0.8 * first, f"loss did not go down: {ls}"
    assert vl[-1] < vl[0]


def test_same_seed_same_result_and_modes_differ(tiny, tmp_path):
    a = run(train_args(tiny, "--mode", "lowmem", "--steps", 6))
    b = run(train_args(tiny, "--mode", "lowmem", "--steps", 6))
    c = run(train_args(tiny, "--mode", "lowmem", "--steps", 6, "--seed", 6))
    assert losses(a.stdout) == losses(b.stdout)
    assert losses(a.stdout) != losses(c.stdout)
    # ckpt recomputes exactly what baseline keeps: identical losses
    base = run(train_args(tiny, "--mode", "baseline", "--steps", 6))
    ckpt = run(train_args(tiny, "--mode", "ckpt", "--steps", 6))
    assert losses(base.stdout) == losses(ckpt.stdout)


def test_grad_accum_equals_big_batch(tiny):
    """K micro-batches of B equal one batch of K*B: same data, loss normalised by all tokens.
    Compared at step 1, before AdamW amplifies rounding: the forward is row by row (the same bits:
    the same loss), and the gradients differ only by how the weight-gradient row sums are grouped
    (fp32, 128 rows: relative error below 128 x 2^-24 ~ 8e-6, which the norm inherits); the log
    prints the norm to 4 decimals, one unit of which may differ on top."""
    one = run(train_args(tiny, "--mode", "baseline", "--steps", 1, "--batch", 4))
    two = run(train_args(tiny, "--mode", "baseline", "--steps", 1, "--batch", 2, "--grad-accum", 2))
    assert losses(one.stdout) == losses(two.stdout) and len(losses(one.stdout)) == 1
    gn = lambda s: float(s.split("grad norm ")[1].split()[0])  # noqa: E731
    assert abs(gn(one.stdout) - gn(two.stdout)) <= 1e-4 + 8e-6 * gn(one.stdout), (gn(one.stdout), gn(two.stdout))


def test_out_dir_log(tiny, tmp_path):
    out = tmp_path / "run"
    run(train_args(tiny, "--steps", 3, "--out", out))
    rows = (out / "log.csv").read_text().splitlines()
    assert rows[0].startswith("step,loss") and len(rows) == 5  # header, the val loss before training, 3 steps
    assert rows[1].startswith("0,") and rows[-1].startswith("3,")


# ---- memory plan ---------------------------------------------------------------------------

LLAMA2_7B = dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=32, vocab_size=32000, rms_norm_eps=1e-5, max_position_embeddings=4096)


def dry_run(tmp_path, config, *flags, env=None):
    d = tmp_path / "cfg"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))  # no weights: a dry run must not read any
    p = run(["--model", d, "--dry-run", "--json", *flags], env=env)
    return json.loads(p.stdout)


def test_dry_run_7b_matches_design_accounting(tmp_path):
    """docs/memory.md: per block main terms 12d + 4kv + 8f (baseline) and 4d + 2f - f/4 less in
    lowmem, in bf16 at batch 1 x seq 2048, plus 4h (lse) + 8 (two r) + LoRA 2r per adapter."""
    d, f, kv, h, r, N = 4096, 11008, 4096, 32, 16, 2048
    base = dry_run(tmp_path, LLAMA2_7B, "--mode", "baseline", "--batch", 1, "--seq", 2048, "--lora-rank", r)
    low = dry_run(tmp_path, LLAMA2_7B, "--mode", "lowmem", "--batch", 1, "--seq", 2048, "--lora-rank", r)
    lora = 7 * 2 * r
    want_base = 12 * d + 4 * kv + 8 * f + 4 * h + 8 + lora
    want_low = want_base - (4 * d + 2 * f - f // 4)
    assert sum(base["per_block"].values()) == want_base * N
    assert sum(low["per_block"].values()) == want_low * N
    assert base["blocks"] == 32 and base["activation_bytes"] == 32 * want_base * N
    assert low["activation_bytes"] == 32 * want_low * N
    assert low["baseline"]["activation_bytes"] == base["activation_bytes"]
    main_base, main_low = 12 * d + 4 * kv + 8 * f, 12 * d + 4 * kv + 8 * f - (4 * d + 2 * f - f // 4)
    assert (main_base, main_low) == (153600, 117952)
    print(f"7B bf16 b1 s2048: baseline {base['activation_bytes']/2**30:.3f} GiB, lowmem {low['activation_bytes']/2**30:.3f} GiB,"
          f" ratio {low['activation_bytes']/base['activation_bytes']:.4f}")


def test_dry_run_ckpt_and_product_switch(tmp_path):
    d, N = 4096, 2048
    ck = dry_run(tmp_path, LLAMA2_7B, "--mode", "ckpt", "--batch", 1, "--seq", 2048)
    assert ck["per_block"] == {"checkpoint": 2 * d * N}
    low = dry_run(tmp_path, LLAMA2_7B, "--mode", "lowmem", "--batch", 1, "--seq", 2048)
    rec = dry_run(tmp_path, LLAMA2_7B, "--mode", "lowmem", "--batch", 1, "--seq", 2048, "--swiglu-product", "recompute")
    assert low["per_block"]["down_input"] == 2 * 11008 * N and "down_input" not in rec["per_block"]
    cpu = dry_run(tmp_path, LLAMA2_7B, "--mode", "baseline", "--batch", 1, "--seq", 2048, "--device", "cpu")
    assert cpu["device"] == "cpu" and cpu["per_block"]["qkv_input"] == 4 * d * N


LLAMA31_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rms_norm_eps=1e-5,
                  max_position_embeddings=131072, rope_theta=500000.0)


def test_dry_run_recomputed_block_scratch_is_the_modes_saved_set(tmp_path):
    """Under --recompute block the block's scratch set (what its recomputed forward makes for its
    backward) is what its mode keeps: lowmem's ReSiLU2 codes and MS-norm outputs, not baseline's
    gate pre-activation, norm inputs and the like. Llama-3.1-8B shape, CUDA plan (bf16, fp32
    statistics), LoRA r16 on all 7 linears, bytes per token, counted by hand from the buffers:
      attention: r1 4 + z1 2d + q 2qd + k 2kvd + v 2kvd + o 2qd + lse 4H; LoRA A x: 7 x 2r
      MLP (lowmem): r2 4 + z2 2d + codes f/4 + silu(g) 2f + up 2f + product 2f
      MLP (baseline): r2 4 + h_mid 2d + z2 2d + g 2f + silu(g) 2f + up 2f + product 2f
    The gate pre-activation under ReSiLU2 is a temporary in gradient scratch, in no block set."""
    d, f, qd, kvd, H, r, N = 4096, 14336, 4096, 1024, 32, 16, 4096
    attention = 4 + 2 * d + 2 * qd + 2 * kvd + 2 * kvd + 2 * qd + 4 * H
    lora = 7 * 2 * r
    want_low = attention + lora + 4 + 2 * d + f // 4 + 3 * 2 * f
    want_base = attention + lora + 4 + 2 * d + 2 * d + 4 * 2 * f
    assert (want_low, want_base) == (126824, 160104)  # 123.9 KiB and 156.4 KiB per token
    args = ("--batch", 1, "--seq", N, "--lora-rank", r)
    low = dry_run(tmp_path, LLAMA31_8B, "--mode", "lowmem", "--recompute", "block", *args)
    base = dry_run(tmp_path, LLAMA31_8B, "--mode", "ckpt", *args)
    assert low["block_scratch_bytes"] == want_low * N
    assert base["block_scratch_bytes"] == want_base * N
    assert low["block_scratch_bytes"] < base["block_scratch_bytes"]
    assert low["per_block"] == base["per_block"] == {"checkpoint": 2 * d * N}
    # without recompute lowmem keeps that very set per block, and no block needs shared scratch
    kept = dry_run(tmp_path, LLAMA31_8B, "--mode", "lowmem", *args)
    assert sum(kept["per_block"].values()) == want_low * N and kept["block_scratch_bytes"] == 0
    print(f"Llama-3.1-8B recomputed block scratch per token: lowmem {want_low} B, baseline {want_base} B")


@pytest.mark.parametrize("device,abytes", [("cuda", 2), ("cpu", 4)])
def test_dry_run_offload_moves_the_checkpoints_to_host(tmp_path, device, abytes):
    """--offload host: the 32 block inputs [N, d] leave the device for (pinned) host memory, and
    the device holds two staging buffers of one block input each instead: device bytes drop by
    (layers - 2) N d abytes, host_bytes is layers N d abytes, nothing else changes."""
    d, layers, N = 4096, 32, 8192
    one = N * d * abytes
    args = ("--mode", "lowmem", "--recompute", "block", "--batch", 1, "--seq", N, "--device", device)
    dev = dry_run(tmp_path, LLAMA31_8B, *args)
    off = dry_run(tmp_path, LLAMA31_8B, *args, "--offload", "host")
    assert dev["host_bytes"] == 0 and off["host_bytes"] == layers * one
    assert dev["total_bytes"] - off["total_bytes"] == (layers - 2) * one
    assert dev["categories"]["saved"] == layers * one and off["categories"]["saved"] == 0
    assert off["categories"]["scratch"] - dev["categories"]["scratch"] == 2 * one
    assert off["offload"] == "host" and dev["offload"] == "none"
    text = run(["--model", tmp_path / "cfg", "--dry-run", *args, "--offload", "host"]).stdout
    assert f"pinned host memory: {layers * one / 2**20:.2f} MiB" in text, text


def test_dry_run_offload_stages_through_one_buffer_where_the_memory_holds_no_second(tmp_path):
    """--offload host plans two staging buffers of one block input, [N, d] bf16, unless the memory
    it is fitted to (--gpu-mem) holds only one: a budget between the two plans (auto's tile fitted
    to the smallest, 1024-token, candidate by the lower bound) gets one; no budget, or a roomy one,
    two; LLMC_OFFLOAD_STAGING=1|2 sets the count."""
    d, N = 4096, 1 << 20
    one = N * d * 2
    args = ("--mode", "lowmem", "--recompute", "block", "--batch", 1, "--seq", N, "--device", "cuda",
            "--offload", "host")
    dev = dry_run(tmp_path, LLAMA31_8B, *args[:-2])
    two = dry_run(tmp_path, LLAMA31_8B, *args)
    assert two["offload_staging"] == 2 and two["categories"]["scratch"] - dev["categories"]["scratch"] == 2 * one
    small = auto_smallest_tile(N)
    lowest = dry_run(tmp_path, LLAMA31_8B, *args, "--mlp-tile", small, env={"LLMC_OFFLOAD_STAGING": "1"})
    gib = (lowest["total_bytes"] + one // 2) / 2**30  # fits one buffer beside the smallest tile, not two
    fitted = dry_run(tmp_path, LLAMA31_8B, *args, "--gpu-mem", f"{gib:.6f}")
    assert fitted["offload_staging"] == 1 and fitted["fits"] is True and fitted["mlp_tile"] >= small
    roomy = dry_run(tmp_path, LLAMA31_8B, *args, "--gpu-mem", f"{gib + 2 * one / 2**30:.6f}")
    assert roomy["offload_staging"] == 2 and roomy["fits"] is True
    below = ("--mode", "lowmem", "--recompute", "block", "--batch", 1, "--seq", 8192, "--device", "cuda")
    two, forced = (run(["--model", tmp_path / "cfg", "--dry-run", "--json", *below, "--offload", "host"], env=e)
                   for e in ({}, {"LLMC_OFFLOAD_STAGING": "1"}))
    assert json.loads(two.stdout)["categories"]["scratch"] - json.loads(forced.stdout)["categories"]["scratch"] == \
        8192 * d * 2
    p = run(["--model", tmp_path / "cfg", "--dry-run", *below, "--offload", "host"], check=False,
            env={"LLMC_OFFLOAD_STAGING": "3"})
    assert p.returncode == 1 and "LLMC_OFFLOAD_STAGING=3: expected 1 or 2" in p.stderr, p.stderr


def test_offload_needs_block_recompute(tiny):
    expect_error(train_args(tiny, "--mode", "lowmem", "--offload", "host"), "flag --offload host", "--recompute block")
    expect_error(train_args(tiny, "--mode", "ckpt", "--offload", "disk"), "--offload")


def test_lowmem_recomputed_and_offloaded_trains_identically(tiny, tmp_path):
    """lowmem with --recompute block, and with --offload host too (through two staging buffers or
    one: LLMC_OFFLOAD_STAGING=1), runs the same fp32 operations in
    the same order on the CPU backend: every logged loss, gradient norm and validation loss
    equals lowmem's (the probe test compares the gradients themselves bit for bit)."""
    logs = {}
    for tag, extra, env in (("kept", (), {}), ("block", ("--recompute", "block"), {}),
                            ("offload", ("--recompute", "block", "--offload", "host"), {}),
                            ("offload1", ("--recompute", "block", "--offload", "host"), {"LLMC_OFFLOAD_STAGING": "1"})):
        out = tmp_path / tag
        run(train_args(tiny, "--mode", "lowmem", "--steps", 3, "--val-every", 3, "--out", out, *extra), env=env)
        rows = [r.split(",") for r in (out / "log.csv").read_text().splitlines()[1:]]
        logs[tag] = [(r[0], r[1], r[3], r[-1]) for r in rows]  # step, loss, grad norm, val loss
    assert len(logs["kept"]) == 4 and logs["kept"][-1][3] != ""
    assert logs["block"] == logs["kept"] and logs["offload"] == logs["kept"] == logs["offload1"], logs


def test_dry_run_plans_the_generation_buffers(tmp_path):
    """The plan names every device byte, --generate's too: the key/value cache of one window (per
    layer keys and values, T x kv_dim in the activation type) and the fp32 logits, each buffer a
    multiple of the plan's 64 bytes here. LLaMA-2-7B, CUDA: 32 x 2 x 2048 x 4096 x 2 + 32000 x 4
    bytes; CPU (fp32): twice the cache."""
    for device, abytes in (("cuda", 2), ("cpu", 4)):
        args = ("--mode", "lowmem", "--batch", 1, "--seq", 2048, "--device", device)
        plain, gen = dry_run(tmp_path, LLAMA2_7B, *args), dry_run(tmp_path, LLAMA2_7B, *args, "--generate", 10)
        extra = 32 * 2 * 2048 * 4096 * abytes + 32000 * 4
        assert gen["total_bytes"] - plain["total_bytes"] == extra, device
        assert gen["categories"]["scratch"] - plain["categories"]["scratch"] == extra, device


def test_dry_run_ranks_plans_one_zero1_rank(tmp_path):
    """--dry-run --ranks N plans one of N ranks without launching them: under --full on CUDA,
    ZeRO-1 divides the AdamW moments and the fp32 master by N (the bf16 weights and the fp32
    gradient stay whole), per weight 2 + 4 + 12/N bytes; on the CPU the master stays whole."""
    d, f, V, L = 4096, 11008, 32000, 32
    n = 2 * V * d + d + L * (4 * d * d + 3 * d * f)  # embedding, head, final norm, 7 linears per block (MS merges the rest)
    one = dry_run(tmp_path, LLAMA2_7B, "--full", "--batch", 1, "--seq", 256)
    for ranks in (2, 8):
        r = dry_run(tmp_path, LLAMA2_7B, "--full", "--batch", 1, "--seq", 256, "--ranks", ranks)
        shard = -(-n // ranks)
        assert abs(r["categories"]["optimizer"] - 8 * shard) < 256 and abs(one["categories"]["optimizer"] - 8 * n) < 256
        assert abs(r["categories"]["trainable"] - (2 * shard * ranks + 4 * shard)) < 256  # bf16 whole (padded), fp32 shard
        assert abs(r["categories"]["grads"] - 4 * shard * ranks) < 256
        assert r["categories"]["saved"] == one["categories"]["saved"]
    cpu = dry_run(tmp_path, LLAMA2_7B, "--full", "--batch", 1, "--seq", 256, "--ranks", 8, "--device", "cpu")
    assert abs(cpu["categories"]["trainable"] - 4 * 8 * (-(-n // 8))) < 256
    p = run(["--model", tmp_path / "cfg", "--ranks", 2], check=False)
    assert p.returncode == 1 and "flag --ranks: only valid with --dry-run" in p.stderr


# ---- the real pretrained model ---------------------------------------------------------------

def test_stories260k_generates(tmp_path, stories260k):
    model = tmp_path / "s260"
    subprocess.run(["/usr/bin/python3", os.path.join(REPO, "scripts/export/export_llama.py"), "--llama2c",
                    stories260k.ckpt, "--tokenizer", stories260k.tok,
                    "--out", str(model)], check=True, capture_output=True)
    p = run(["--model", model, "--generate", 40, "--temperature", 0, "--prompt", "Once upon a time"])
    text = p.stdout.strip().splitlines()[-1]
    words = text.split()
    print(text)
    assert text.startswith("Once upon a time") and len(words) > 12
    # stories260K writes English: most words should be plain lowercase letters
    assert sum(w.strip(".,!\"'").isalpha() for w in words) > 0.8 * len(words)


def test_random_init_trains_from_a_config_alone(tmp_path):
    """--random-init (the benchmarks' mode): no weight file needed, random N(0, 0.02) weights, so
    the first loss is close to ln(vocab); the run trains, and a missing config still fails."""
    import json
    import math
    cfg = json.load(open(os.path.join(REPO, "data/llama_demo/config.json")))
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(cfg))
    p = run(["--model", tmp_path / "cfg", "--random-init", "--data", os.path.join(REPO, "data/llama_demo_ft_train.bin"),
             "--steps", 3, "--batch", 2, "--seq", 32, "--lr", 1e-3])
    first = float(p.stdout.split("| loss ")[1].split()[0])
    print(f"first loss {first:.4f}, ln(vocab) {math.log(cfg['vocab_size']):.4f}")
    assert abs(first - math.log(cfg["vocab_size"])) < 0.1
    p = run(["--model", tmp_path / "cfg", "--data", os.path.join(REPO, "data/llama_demo_ft_train.bin"), "--steps", 1], check=False)
    assert p.returncode != 0 and "model.safetensors" in p.stderr


def test_generation_kv_cache_equals_recomputing_the_window():
    """Greedy sampling with the key/value cache gives the very text of recomputing the whole window
    for every token (LLMC_NO_KV_CACHE=1) while the text fits the window (128 tokens here); past it
    the cache restarts from the last half window and generation goes on."""
    args = ["--model", os.path.join(REPO, "data/llama_demo"), "--temperature", 0, "--prompt", "Licensed under the"]
    cached = run(args + ["--generate", 100]).stdout
    p = subprocess.run([BIN] + [str(a) for a in args + ["--generate", 100]], capture_output=True, text=True,
                       env=dict(ENV, LLMC_NO_KV_CACHE="1"))
    assert p.returncode == 0, p.stderr
    text = cached[cached.index("Licensed under the"):]
    assert text == p.stdout[p.stdout.index("Licensed under the"):]
    assert len(text.split()) > 30, text
    long = run(args + ["--generate", 300]).stdout
    assert len(long[long.index("Licensed under the"):].split()) > len(text.split())


# ---- bad input -------------------------------------------------------------------------------

def copy_model(tiny, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(tiny / "model", dst)
    return dst


def test_unknown_flag(tiny):
    expect_error(["--model", tiny / "model", "--bogus", 1], "--bogus")
    expect_error(["--model", tiny / "model", "--steps", "ten"], "--steps", "integer")
    expect_error(["--model", tiny / "model", "--mode", "fast"], "--mode", "baseline|lowmem|ckpt")
    expect_error(["--model", tiny / "model", "--lora-targets", "q,x"], "--lora-targets", "x")
    expect_error(["--model", tiny / "model", "--ms-lora", "paper"], "--ms-lora", "exact|merged")
    expect_error(["--model", tiny / "model", "--data", tiny / "train.bin", "--mode", "baseline", "--ms-lora", "merged"],
                 "--ms-lora merged", "--norm ms")
    expect_error(["--model", tiny / "model", "--data", tiny / "train.bin", "--full", "--ms-lora", "merged"], "--ms-lora merged", "--full")


def test_missing_model_dir_and_config(tmp_path):
    expect_error(["--model", tmp_path / "nope", "--generate", 1], "nope")
    (tmp_path / "empty").mkdir()
    expect_error(["--model", tmp_path / "empty", "--generate", 1], "config.json")


@pytest.mark.parametrize("field", ["hidden_size", "num_attention_heads", "vocab_size"])
def test_config_missing_field(tiny, tmp_path, field):
    m = copy_model(tiny, tmp_path)
    cfg = json.loads((m / "config.json").read_text())
    del cfg[field]
    (m / "config.json").write_text(json.dumps(cfg))
    expect_error(["--model", m, "--data", tiny / "train.bin"], "config.json", field)


def test_config_inconsistent(tiny, tmp_path):
    m = copy_model(tiny, tmp_path)
    cfg = json.loads((m / "config.json").read_text())
    cfg["num_attention_heads"] = 5  # does not divide 48
    (m / "config.json").write_text(json.dumps(cfg))
    expect_error(["--model", m, "--data", tiny / "train.bin"], "config.json", "divide")
    cfg["num_attention_heads"], cfg["num_key_value_heads"] = 4, 3
    (m / "config.json").write_text(json.dumps(cfg))
    expect_error(["--model", m, "--data", tiny / "train.bin"], "num_key_value_heads")
    (m / "config.json").write_text("{\"hidden_size\": 48,")
    expect_error(["--model", m, "--data", tiny / "train.bin"], "config.json", "JSON")


def test_safetensors_missing_truncated_corrupt(tiny, tmp_path):
    m = copy_model(tiny, tmp_path)
    st = m / "model.safetensors"
    blob = st.read_bytes()
    args = ["--model", m, "--data", tiny / "train.bin", "--steps", 1]
    st.unlink()
    expect_error(args, "model.safetensors")
    st.write_bytes(blob[: len(blob) // 2])
    expect_error(args, "model.safetensors", "truncated")
    st.write_bytes(blob[:5])
    expect_error(args, "model.safetensors")
    st.write_bytes(struct.pack("<Q", 10) + b"{not json}" + blob[18:])
    expect_error(args, "model.safetensors", "JSON")
    st.write_bytes(struct.pack("<Q", 1 << 40) + blob[8:])
    expect_error(args, "model.safetensors", "header length")


def test_safetensors_missing_tensor_and_wrong_shape(tiny, tmp_path):
    import st_io
    m = copy_model(tiny, tmp_path)
    t = st_io.load(str(m / "model.safetensors"))
    args = ["--model", m, "--data", tiny / "train.bin", "--steps", 1]
    bad = dict(t)
    del bad["model.layers.1.mlp.up_proj.weight"]
    st_io.save(str(m / "model.safetensors"), bad)
    expect_error(args, "model.layers.1.mlp.up_proj.weight", "missing")
    bad = dict(t)
    bad["model.layers.0.self_attn.k_proj.weight"] = np.zeros((24, 47), np.float32)
    st_io.save(str(m / "model.safetensors"), bad)
    expect_error(args, "model.layers.0.self_attn.k_proj.weight", "shape")


def test_shard_bad_header_and_token_out_of_range(tiny, tmp_path):
    good = (tiny / "train.bin").read_bytes()
    bad = tmp_path / "bad.bin"
    args = ["--model", tiny / "model", "--data", bad, "--steps", 1]
    bad.write_bytes(b"XXXX" + good[4:])
    expect_error(args, "bad.bin", "magic")
    bad.write_bytes(good[:-100])
    expect_error(args, "bad.bin", "truncated")
    toks = np.full(200, 7, np.uint32)
    toks[150] = 67  # == vocab
    header = b"LMFT" + struct.pack("<IQII", 1, 200, 67, 1)  # hand-written: the writer refuses bad ids
    bad.write_bytes(header.ljust(64, b"\0") + toks.tobytes() + np.ones(200, np.uint8).tobytes())
    expect_error(args, "bad.bin", "token 150", "67")
    shards.write_shard(str(bad), np.full(200, 7, np.uint32), np.ones(200, np.uint8), 1000)
    expect_error(args, "bad.bin", "vocab_size")


def test_unwritable_out(tiny, tmp_path):
    ro = tmp_path / "file"
    ro.write_text("x")
    expect_error(train_args(tiny, "--steps", 1, "--out", ro / "sub"), "--out")


def test_help_lists_every_flag():
    p = run(["--help"])
    for flag in ["--model", "--data", "--val", "--steps", "--batch", "--seq", "--grad-accum", "--lr", "--warmup", "--mode",
                 "--act", "--norm", "--recompute", "--lora-rank", "--lora-alpha", "--lora-targets", "--device", "--seed",
                 "--threads", "--out", "--dry-run", "--json", "--generate", "--prompt", "--temperature", "--val-every"]:
        assert flag in p.stdout, flag


def test_sharded_checkpoint_with_index(tiny, tmp_path):
    """model-0000N-of-0000M.safetensors + model.safetensors.index.json load like one file."""
    import st_io
    m = tmp_path / "sharded"
    m.mkdir()
    shutil.copy(tiny / "model" / "config.json", m / "config.json")
    t = st_io.load(str(tiny / "model" / "model.safetensors"))
    names = sorted(t)
    parts = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, part in enumerate(parts):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        st_io.save(str(m / fname), {k: t[k] for k in part}, bf16=(i == 1))  # mixed dtypes too
        weight_map.update({k: fname for k in part})
    (m / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    ev = lambda model: run(["--model", model, "--val", tiny / "val.bin", "--eval-only", "--seq", 32, "--batch", 2,
                            "--val-batches", 2]).stdout.split("val loss ")[-1]
    one, sharded = float(ev(tiny / "model")), float(ev(m))
    print(f"one file {one:.6f}, two shards (one bf16) {sharded:.6f}")
    assert abs(one - sharded) < 2e-2 * one and one != sharded  # bf16 rounding of half the weights
    (m / "model-00002-of-00002.safetensors").unlink()
    expect_error(["--model", m, "--val", tiny / "val.bin", "--eval-only", "--seq", 32], "model-00002-of-00002.safetensors")
    (m / "model.safetensors.index.json").write_text("{\"weight_map\": 3}")
    expect_error(["--model", m, "--val", tiny / "val.bin", "--eval-only", "--seq", 32], "index.json", "weight_map")


def llama_flops_per_token(cfg, seq, rank, full):
    """Model FLOPs of one token's training step, written from the convention (not from the C):
    2 per weight forward, 2 for the input gradient, 2 for a trained weight's gradient; LoRA's
    three products 6 r (in + out); causal attention 6 T d per layer."""
    d, f, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["hidden_size"] // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)]
    per_weight = 6 if full else 4
    layer = sum(i * o * per_weight + (0 if full else 6 * rank * (i + o)) for i, o in shapes)
    return cfg["num_hidden_layers"] * (layer + 6 * seq * q) + d * cfg["vocab_size"] * per_weight


@pytest.mark.parametrize("full", [False, True])
def test_log_reports_mfu_from_the_model_flops(full):
    """Each step line shows MFU (tokens/s x model FLOPs per token / the GPU's peak; on the CPU only
    when LLMC_PEAK_TFLOPS names a peak); the FLOPs it implies match the independent count."""
    model = os.path.join(REPO, "data", "llama_demo")
    args = ["--model", model, "--data", os.path.join(REPO, "data", "llama_demo_ft_train.bin"), "--steps", 3, "--batch", 2,
            "--seq", 32, "--threads", 1] + (["--full"] if full else [])
    assert "MFU" not in run(args).stdout  # the CPU's peak is unknown
    p = subprocess.run([BIN] + [str(a) for a in args], capture_output=True, text=True, timeout=120,
                       env=dict(ENV, LLMC_PEAK_TFLOPS="0.0001"))
    assert p.returncode == 0, p.stderr
    with open(os.path.join(model, "config.json")) as fh:
        want = llama_flops_per_token(json.load(fh), 32, 8, full)
    steps = re.findall(r"\| (\d+) tok/s \| MFU ([0-9.]+)%", p.stdout)
    assert len(steps) == 3, p.stdout
    for toks, mfu in steps:
        got = float(mfu) / 100 * 1e8 / int(toks)
        assert abs(got / want - 1) < 0.5 / int(toks) + 0.005, (got, want)  # the rate is printed rounded


def test_plan_bigger_than_host_memory_is_refused_with_what_fits():
    """On the CPU backend the plan is checked against the host's available memory (here pretended
    64 MiB by LLMC_HOST_MEMORY_BYTES) before anything is allocated, so the kernel never kills
    the run later: one line naming the largest --batch that fits and divides the step's sequences,
    which --dry-run confirms. (A
    run's --mlp-tile auto takes the largest tile that fits, so a batch fits when auto's smallest
    tile does, test_mlp_tile.auto_smallest_tile; a plain dry run has no memory to fit, so it is
    given that tile.)"""
    args = ["--model", os.path.join(REPO, "data", "llama_demo"), "--data", os.path.join(REPO, "data", "llama_demo_ft_train.bin"),
            "--steps", 1, "--seq", 128, "--device", "cpu"]
    p = subprocess.run([BIN] + [str(a) for a in args + ["--batch", 512]], capture_output=True, text=True, timeout=60,
                       env=dict(ENV, LLMC_HOST_MEMORY_BYTES=str(64 << 20)))
    err = p.stderr
    assert p.returncode == 1 and err.count("\n") == 1, err
    assert "of host memory" in err and "but 64.0 MiB is available (LLMC_HOST_MEMORY_BYTES)" in err, err
    b, accum = (int(x) for x in re.search(r"would fit: --batch (\d+) --grad-accum (\d+);", err).groups())
    plan = lambda batch: json.loads(run(args + ["--dry-run", "--json", "--batch", batch, "--mlp-tile",
                                                 auto_smallest_tile(batch * 128)]).stdout)[  # noqa: E731
        "total_bytes"]
    # the largest batch that fits and divides the step's 512 sequences (the next divisor up is 2b), so
    # that the suggestion keeps the step exactly (not 42 sequences for 40: test_partial_cases.py)
    assert b * accum == 512 and plan(b) <= 64 << 20 < plan(2 * b)
