"""The LLaMA-architecture families beyond LLaMA (issue 23) through the whole trainer, not only the
model: Qwen2 (q, k, v biases) and Qwen3 (q/k norms before RoPE, head_dim != hidden / heads) train,
save, resume, run on two ranks and generate as LLaMA does. The model's math against the reference
is test_llama_model.py's (every memory mode), the CUDA backend's test_llama_cuda.py's, NF4's
test_nf4.py's; the refusals are rows of test_bad_inputs.py.

Each check compares the trainer with itself along a path that must not change the bits: a resumed
run against a straight one, 2 ranks against 1 process accumulating the same micro-batches
(test_llama_system.py explains why those are bit-identical), generation with the key/value cache
against recomputing the window."""
import json
import os
import shutil
import subprocess

import numpy as np
import pytest

import llama_cases as lc
import shards
import st_io
from test_llama_train import BIN, ENV, REPO, losses, run
from test_llama_system import mpirun

FAMILIES = ["qwen2", "qwen3", "gemma2", "gemma3"]


def family_model(root, name, vocab=None, seed=4):
    """A random model of the family's test config (vocab_size replaced when given), with a token
    shard of a repeated pattern that a few steps learn."""
    cfg = lc.model_config(name)
    if vocab:
        cfg["vocab_size"] = vocab
    lc.write_model(str(root / "model"), cfg, seed=seed)
    rng = np.random.default_rng(1)
    toks = np.tile(rng.integers(3, cfg["vocab_size"], size=13), 400)
    mask = (rng.random(toks.size) > 0.2).astype(np.uint8)
    shards.write_shard(str(root / "train.bin"), toks.astype(np.uint32), mask, cfg["vocab_size"])
    return root / "model", root / "train.bin"


def args(model, data, *extra):
    return ["--model", model, "--data", data, "--seq", 16, "--lora-rank", 4, "--lr", 5e-3, "--seed", 11, "--threads", 1, *extra]


def saved(dir_, full):
    return st_io.load(str(dir_ / ("model.safetensors" if full else "adapter_model.safetensors")))


@pytest.mark.parametrize("full", [False, True], ids=["lora", "full"])
@pytest.mark.parametrize("name", FAMILIES)
def test_resume_equals_a_straight_run(tmp_path, name, full):
    """4 steps straight against a run stopped (and saved) at step 2, then resumed to 4: the same bits. Under --full the
    saved model holds the trained biases, q/k norms and Gemma's sandwich norms, and the state their AdamW moments."""
    model, data = family_model(tmp_path, name)
    flags = ["--mode", "lowmem", "--batch", 2, "--save-every", 2] + (["--full", "--lr", 1e-3] if full else [])
    straight = run(args(model, data, *flags, "--steps", 4, "--out", tmp_path / "straight"))
    run(args(model, data, *flags, "--steps", 4, "--stop-at", 2, "--out", tmp_path / "resumed"))
    resumed = run(args(model, data, *flags, "--steps", 4, "--resume", tmp_path / "resumed"))
    assert "at step 2" in resumed.stdout
    assert losses(straight.stdout)[2:] == losses(resumed.stdout)[-2:]
    a, b = saved(tmp_path / "straight", full), saved(tmp_path / "resumed", full)
    assert a.keys() == b.keys()
    if full:  # the families' own tensors are in the trained model, and they moved
        extra = [k for k in a if k.endswith(".bias") or "q_norm" in k or "k_norm" in k or "feedforward_layernorm" in k]
        assert extra, sorted(a)
        base = st_io.load(str(model / "model.safetensors"))
        assert any(not np.array_equal(a[k], base[k]) for k in extra)
    for k in a:
        assert np.array_equal(a[k], b[k]), k


@pytest.mark.parametrize("name", FAMILIES)
def test_two_ranks_equal_one_process_accumulating(tmp_path, name):
    model, data = family_model(tmp_path, name)
    one = run(args(model, data, "--mode", "lowmem", "--steps", 3, "--batch", 2, "--grad-accum", 2, "--out", tmp_path / "one"))
    two = mpirun(2, args(model, data, "--mode", "lowmem", "--steps", 3, "--batch", 2, "--out", tmp_path / "two"))
    assert losses(one.stdout) == losses(two.stdout) and len(losses(one.stdout)) == 3
    a, b = saved(tmp_path / "one", False), saved(tmp_path / "two", False)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("mode", ["baseline", "lowmem"])
@pytest.mark.parametrize("name", FAMILIES)
def test_generation_kv_cache_equals_recomputing_the_window(tmp_path, name, mode):
    """Greedy generation of a family model (the demo's tokenizer, vocab 512) with the key/value
    cache, whose keys come out of Qwen3's k norm and RoPE or Qwen2's biased k, gives the text of
    recomputing the window for every token."""
    # (seed 5: seed 4's Gemma 2, with its windows and soft-caps, emits the end token after 9 bytes)
    model, _ = family_model(tmp_path, name, vocab=512, seed=5)
    shutil.copy(os.path.join(REPO, "data", "llama_demo", "tokenizer.bin"), model)
    cmd = [BIN] + [str(a) for a in ["--model", model, "--temperature", 0, "--prompt", "Once upon a time", "--generate", 40, "--mode", mode]]
    texts = []
    for env in (ENV, dict(ENV, LLMC_NO_KV_CACHE="1")):  # bytes: a random model emits byte tokens that are not UTF-8
        p = subprocess.run(cmd, capture_output=True, env=env, timeout=120)
        assert p.returncode == 0, p.stderr
        texts.append(p.stdout[p.stdout.index(b"Once upon a time"):])
    assert texts[0] == texts[1]
    assert len(texts[0]) > len("Once upon a time") + 20, texts[0]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_generation_with_a_sliding_window(tmp_path, device):
    """The demo model as a Mistral with a 6-position window: greedy text with the key/value cache
    (llmc/cpu/attention.h's attention_cached over the last 6 cached keys; on the emulator the CUDA
    cached kernel) equals recomputing the window every token (the training attention, windowed),
    and differs from the demo's own text, which sees every earlier position."""
    from cuda_backend import binaries, need
    exe = need(binaries("train_llama", "llama_probe")[0]) if device == "cuda" else BIN
    demo = os.path.join(REPO, "data", "llama_demo")
    model = tmp_path / "mistral"
    shutil.copytree(demo, model)
    cfg = json.load(open(model / "config.json"))
    cfg.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=6)
    (model / "config.json").write_text(json.dumps(cfg))
    prompt = "Licensed under the"

    def text(m, env=None):
        p = subprocess.run([str(exe), "--model", str(m), "--device", device, "--generate", "24", "--prompt", prompt,
                            "--temperature", "0"], capture_output=True, env=dict(ENV, **(env or {})), timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        return p.stdout[p.stdout.index(prompt.encode()):]
    cached, recomputed = text(model), text(model, {"LLMC_NO_KV_CACHE": "1"})
    assert cached == recomputed, (cached, recomputed)
    assert cached != text(demo) and len(cached) > len(prompt) + 20, cached


def test_gemma2_9b_plan(tmp_path):
    """Gemma 2 9B's config (test/fixtures/gemma2_9b, with attention soft-capping turned off): lowmem's
    plan keeps 4d + 1.75f bytes less per token per block than the baseline's (on CUDA: MS norms drop
    the attention norm's and the MLP norm's bf16 input, 2d each; ReGELU2 keeps 2-bit codes of the gate
    instead of its bf16 values, 2f - f/4), the sandwich post norms are standard in both. As the
    checkpoint ships (attn_logit_softcapping 50), it plans too: soft-capped attention takes the
    tensor-core path, which says so in one line."""
    fixture = os.path.join(REPO, "test", "fixtures", "gemma2_9b")
    with open(os.path.join(fixture, "config.json")) as f:
        cfg = json.load(f)
    d, f_, layers, N = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], 4096
    act = {}
    for mode in ("baseline", "lowmem"):
        p = run(["--model", fixture, "--dry-run", "--device", "cuda", "--batch", 1, "--seq", N, "--lora-rank", 16,
                 "--mode", mode, "--json"])
        act[mode] = json.loads(p.stdout)["activation_bytes"]
    assert act["baseline"] - act["lowmem"] == (4 * d + 1.75 * f_) * N * layers
    text = run(["--model", fixture, "--dry-run", "--device", "cuda", "--batch", 1, "--seq", N, "--lora-rank", 16]).stdout
    assert "norms: attn_norm, mlp_norm: MS under --norm ms" in text and "standard in every mode" in text, text
    row = next(line.split() for line in text.splitlines() if line.strip().startswith("post_norm_std"))
    assert float(row[1]) == float(row[2]) == 2 * (2 * d + 4)  # the same in both modes: input and r, two norms
    print(f"Gemma 2 9B activations per token per block: {act['baseline'] / N / layers:.0f} -> "
          f"{act['lowmem'] / N / layers:.0f} bytes ({1 - act['lowmem'] / act['baseline']:.1%} less)")
    (tmp_path / "m").mkdir()
    with open(tmp_path / "m" / "config.json", "w") as f:
        json.dump(dict(cfg, attn_logit_softcapping=50.0), f)
    p = subprocess.run([BIN, "--model", str(tmp_path / "m"), "--dry-run", "--device", "cuda", "--seq", "128"],
                       capture_output=True, text=True, env=ENV)
    assert p.returncode == 0, p.stderr
