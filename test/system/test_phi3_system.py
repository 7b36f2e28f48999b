"""Phi-3 / Phi-4 (model_type phi3) through the whole trainer: its adapters are PEFT's both ways
(PEFT loads ours, on the fused qkv_proj / gate_up_proj, with our loss; ours loads one PEFT saved,
with PEFT's loss), the merged export writes the fused tensors back fused and transformers reads it
with our loss, a resumed run equals a straight one, generation with the key/value cache equals
recomputing the window, and the dry run plans Phi-3-mini. The model's math against transformers is
test/model/test_phi3_model.py's. The Hugging Face stack: build/hfvenv (or HF_PYTHON), as
test/system/test_hf_interop.py; missing, the tests fail."""
import json
import os
import shutil
import subprocess

import numpy as np
import pytest

import llama_cases as lc
import phi3_cases as pc
import shards
import st_io
from test_llama_train import BIN, ENV, REPO, losses, run
from test_llama_system import mpirun

HF_PYTHON = os.environ.get("HF_PYTHON", os.path.join(lc.REPO, "build", "hfvenv", "bin", "python"))
PHI3_MODULES = "qkv_proj,o_proj,gate_up_proj,down_proj"


def need_hf():
    if not os.path.exists(HF_PYTHON):
        pytest.fail(f"{HF_PYTHON} missing: scripts/ci/install_deps.sh makes it")


def phi3_model(root, name, vocab=None, seed=5):
    """A random Phi-3 of the named test config (vocab_size replaced when given) and a token shard
    of a repeated pattern that a few steps learn."""
    cfg = pc.model_config(name)
    if vocab:
        cfg["vocab_size"] = vocab
    pc.write_phi3_model(str(root / "model"), cfg, seed=seed)
    rng = np.random.default_rng(2)
    toks = np.tile(rng.integers(3, cfg["vocab_size"], size=11), 500)
    shards.write_shard(str(root / "data.bin"), toks.astype(np.uint32), np.ones(toks.size, np.uint8), cfg["vocab_size"])
    return root / "model", root / "data.bin"


def eval_loss(model, data, *extra):
    out = run(["--model", model, "--val", data, "--eval-only", "--seq", 24, "--batch", 4, "--val-batches", 4,
               "--lora-rank", 4, "--threads", 1, *extra]).stdout
    return float(out.split("val loss ")[-1])


# phi3_longrope: --seq 24 exceeds its original context (8), so every run takes the long factors
@pytest.mark.parametrize("name", ["phi3", "phi3_longrope"])
def test_transformers_and_peft_load_our_phi3_outputs(tmp_path, name):
    """Trained under lowmem with --lora-dropout: the adapter PEFT loads (one adapter per fused module)
    and the merged export (qkv_proj and gate_up_proj written back fused) give our --eval-only losses
    in transformers' Phi3ForCausalLM."""
    need_hf()
    model, data = phi3_model(tmp_path, name)
    run(["--model", model, "--data", data, "--steps", 8, "--batch", 4, "--seq", 24, "--lora-rank", 4, "--lr", 1e-2,
         "--mode", "lowmem", "--out", tmp_path / "adapter", "--export-merged", tmp_path / "merged", "--threads", 1,
         "--lora-dropout", 0.1])
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        assert sorted(json.load(f)["target_modules"]) == sorted(PHI3_MODULES.split(","))
    merged = st_io.load(str(tmp_path / "merged" / "model.safetensors"))
    base = st_io.load(str(model / "model.safetensors"))
    assert merged.keys() == base.keys()  # fused as it came, no q_proj / gate_proj of our own
    assert not np.array_equal(merged["model.layers.0.self_attn.qkv_proj.weight"],
                              base["model.layers.0.self_attn.qkv_proj.weight"])
    ours = [eval_loss(model, data), eval_loss(model, data, "--adapter", tmp_path / "adapter"),
            eval_loss(tmp_path / "merged", data)]
    p = subprocess.run([HF_PYTHON, os.path.join(REPO, "scripts", "interop", "check_hf_interop.py"),
                        "--base", str(model), "--adapter", str(tmp_path / "adapter"),
                        "--merged", str(tmp_path / "merged"), "--val", str(data), "--seq", "24", "--windows", "16"],
                       capture_output=True, text=True, timeout=300, env=ENV)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "transformers class:                Phi3ForCausalLM" in p.stdout, p.stdout
    theirs = [float(line.split(":")[-1]) for line in p.stdout.splitlines()
              if line.startswith("transformers") and "class" not in line]
    print("ours (base, base+adapter, merged):", ours, "transformers/PEFT:", theirs)
    assert len(theirs) == 3 and ours[1] < ours[0] - 0.1
    np.testing.assert_allclose(theirs, ours, rtol=2e-6)


def test_peft_phi3_adapter_loads_with_its_loss(tmp_path):
    """An adapter PEFT saves on the fused modules (random A and B): our --eval-only --adapter gives
    PEFT's loss, and the base's without it."""
    need_hf()
    model, data = phi3_model(tmp_path, "phi3_longrope")
    p = subprocess.run([HF_PYTHON, os.path.join(REPO, "scripts", "interop", "save_peft_adapter.py"),
                        "--base", str(model), "--out", str(tmp_path / "adapter"), "--rank", "4", "--alpha", "8",
                        "--targets", PHI3_MODULES,
                        "--val", str(data), "--seq", "24", "--windows", "16"],
                       capture_output=True, text=True, timeout=300, env=ENV)
    assert p.returncode == 0, p.stderr[-3000:]
    peft_adapted, peft_base = (float(line.split(":")[-1]) for line in p.stdout.splitlines() if line.startswith("PEFT"))
    ours = eval_loss(model, data, "--lora-alpha", 8, "--adapter", tmp_path / "adapter")
    print("PEFT (base, base + adapter):", peft_base, peft_adapted, "ours:", ours)
    assert abs(peft_adapted - peft_base) > 0.02
    np.testing.assert_allclose(ours, peft_adapted, rtol=2e-6)
    np.testing.assert_allclose(eval_loss(model, data), peft_base, rtol=2e-6)


@pytest.mark.parametrize("full", [False, True], ids=["lora", "full"])
def test_phi3_resume_equals_a_straight_run(tmp_path, full):
    """4 steps straight against 2, saved, then resumed to 4: the same bits, adapters (LoRA) or the
    fused tensors of the trained model (--full)."""
    model, data = phi3_model(tmp_path, "phi4_mini")
    flags = ["--model", model, "--data", data, "--seq", 12, "--lora-rank", 4, "--lr", 5e-3, "--seed", 11,
             "--threads", 1, "--mode", "lowmem", "--batch", 2, "--save-every", 2]
    flags += ["--full", "--lr", 1e-3] if full else []
    straight = run(flags + ["--steps", 4, "--out", tmp_path / "straight"])
    run(flags + ["--steps", 4, "--stop-at", 2, "--out", tmp_path / "resumed"])
    resumed = run(flags + ["--steps", 4, "--resume", tmp_path / "resumed"])
    assert "at step 2" in resumed.stdout
    assert losses(straight.stdout)[2:] == losses(resumed.stdout)[-2:]
    name = "model.safetensors" if full else "adapter_model.safetensors"
    a, b = st_io.load(str(tmp_path / "straight" / name)), st_io.load(str(tmp_path / "resumed" / name))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    if full:
        assert "model.layers.0.self_attn.qkv_proj.weight" in a


@pytest.mark.parametrize("mode", ["baseline", "lowmem"])
def test_phi3_generation_kv_cache_equals_recomputing_the_window(tmp_path, mode):
    """Greedy generation of Phi-4-mini's shape (partial rotary, LongRoPE) with the key/value cache
    gives the text of recomputing the window for every token."""
    model, _ = phi3_model(tmp_path, "phi4_mini", vocab=512)
    shutil.copy(os.path.join(REPO, "data", "llama_demo", "tokenizer.bin"), model)
    cmd = [BIN] + [str(a) for a in ["--model", model, "--temperature", 0, "--prompt", "Once upon a time",
                                    "--generate", 40, "--mode", mode]]
    texts = []
    for env in (ENV, dict(ENV, LLMC_NO_KV_CACHE="1")):
        p = subprocess.run(cmd, capture_output=True, env=env, timeout=120)
        assert p.returncode == 0, p.stderr
        texts.append(p.stdout[p.stdout.index(b"Once upon a time"):])
    assert texts[0] == texts[1]
    assert len(texts[0]) > len("Once upon a time") + 20, texts[0]


def test_phi3_full_saves_the_fused_tensors_in_the_original_layout(tmp_path):
    """--full under lowmem trains W' = W diag(gamma) of each part: with --lr 0 the saved model's
    fused qkv_proj and gate_up_proj are the checkpoint's again (the merge undone part by part, the
    parts joined in their rows), within the two fp32 roundings of the merge and its inverse."""
    model, data = phi3_model(tmp_path, "phi3")
    run(["--model", model, "--data", data, "--seq", 12, "--batch", 2, "--steps", 1, "--lr", 0, "--full",
         "--mode", "lowmem", "--threads", 1, "--out", tmp_path / "full"])
    saved, base = st_io.load(str(tmp_path / "full" / "model.safetensors")), st_io.load(str(model / "model.safetensors"))
    assert saved.keys() == base.keys()
    for k in base:
        np.testing.assert_allclose(saved[k], base[k], rtol=3e-7, atol=0, err_msg=k)


def test_phi3_nf4_merged_export_is_the_run_s_model(tmp_path):
    """--quant nf4 keeps each part of a fused module in its own NF4 tensor: the merged export
    dequantizes every part into its rows and adds the fused adapter, so the exported model's loss
    is the loss the run's NF4 weights and adapter give."""
    model, data = phi3_model(tmp_path, "phi3")
    run(["--model", model, "--data", data, "--steps", 6, "--batch", 4, "--seq", 24, "--lora-rank", 4, "--lr", 1e-2,
         "--quant", "nf4", "--out", tmp_path / "adapter", "--export-merged", tmp_path / "merged", "--threads", 1])
    with_adapter = eval_loss(model, data, "--quant", "nf4", "--adapter", tmp_path / "adapter")
    merged = eval_loss(tmp_path / "merged", data)
    print("nf4 + adapter:", with_adapter, "merged export:", merged)
    assert with_adapter < eval_loss(model, data, "--quant", "nf4") - 0.1
    np.testing.assert_allclose(merged, with_adapter, rtol=2e-6)


PHI3_MINI = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32064,
             "max_position_embeddings": 4096, "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-05,
             "rope_theta": 10000.0, "rope_scaling": None, "sliding_window": 2047, "tie_word_embeddings": False,
             "hidden_act": "silu", "attention_dropout": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0, "bos_token_id": 1,
             "eos_token_id": 32000, "pad_token_id": 32000, "torch_dtype": "bfloat16"}


def per_block(config, root, mode, r):
    root.mkdir(exist_ok=True)
    with open(root / "config.json", "w") as f:
        json.dump(config, f)
    out = run(["--model", root, "--dry-run", "--device", "cuda", "--batch", 1, "--seq", 2047, "--lora-rank", r,
               "--mode", mode]).stdout
    return float(next(line for line in out.splitlines() if line.strip().startswith("per block")).split()[-1])


def test_phi3_mini_dry_run_plan(tmp_path):
    """Phi-3-mini's config alone (--seq 2047, its sliding window): lowmem keeps 4d + 2f - f/4 bytes
    per token per block less than the baseline (docs/memory.md: 114,952 -> 88,328, -23.2 %), and a
    fused module keeps its adapter's A x once, so the block keeps 3 r bf16 values less per token than
    a LLaMA of the same shape with separate q, k, v, gate and up adapters."""
    d, f, r = 3072, 8192, 16
    base = per_block(PHI3_MINI, tmp_path / "phi3", "baseline", r)
    low = per_block(PHI3_MINI, tmp_path / "phi3", "lowmem", r)
    print(f"Phi-3-mini bytes per token per block: baseline {base:.0f}, lowmem {low:.0f} "
          f"({100 * (low / base - 1):.1f} %)")
    assert base - low == 4 * d + 2 * f - f // 4
    llama = {k: v for k, v in PHI3_MINI.items() if k not in ("original_max_position_embeddings", "embd_pdrop",
                                                             "resid_pdrop", "sliding_window")}
    llama.update(model_type="llama", architectures=["LlamaForCausalLM"])
    assert per_block(llama, tmp_path / "llama", "baseline", r) - base == 3 * r * 2


def test_phi3_two_ranks_equal_one_process_accumulating(tmp_path):
    """Data parallelism over the fused adapters: 2 ranks against 1 process accumulating the same
    micro-batches. Not to the bit, as for the other families (test_llama_system.py): a shared A adds
    its parts' gradients (q, k, v of micro-batch 1, then of 2) in one order in one process, and per
    rank before the all-reduce in two, so its gradient differs by an fp32 rounding, which the next
    steps spread to every adapter. Measured 1 ulp of the largest value after 3 steps; allowed 16,
    while a dropped or doubled part's gradient differs at once by far more. The logged losses
    (4 decimals) agree."""
    model, data = phi3_model(tmp_path, "phi4_mini")
    flags = ["--model", model, "--data", data, "--seq", 12, "--lora-rank", 4, "--lr", 5e-3, "--seed", 11, "--threads", 1,
             "--mode", "lowmem", "--steps", 3, "--batch", 2]
    one = run(flags + ["--grad-accum", 2, "--out", tmp_path / "one"])
    two = mpirun(2, flags + ["--out", tmp_path / "two"])
    assert losses(one.stdout) == losses(two.stdout) and len(losses(one.stdout)) == 3
    a = st_io.load(str(tmp_path / "one" / "adapter_model.safetensors"))
    b = st_io.load(str(tmp_path / "two" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=0, atol=16 * 2.0**-24 * float(np.abs(a[k]).max()), err_msg=k)
