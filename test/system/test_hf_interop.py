"""What train_llama writes loads in the real Hugging Face stack: transformers reads our
--export-merged directory and PEFT reads our adapter (trained with MS-RMSNorm, written in the
original layout), and both give the loss our own --eval-only gives. The stack lives in a venv
that scripts/ci/install_deps.sh makes (build/hfvenv: transformers 4.40, peft 0.10 over Debian's torch); HF_PYTHON
may name another interpreter. Missing, the test fails."""
import json
import os
import subprocess

import numpy as np
import pytest

import llama_cases as lc
import shards
from test_llama_train import ENV, run

HF_PYTHON = os.environ.get("HF_PYTHON", os.path.join(lc.REPO, "build", "hfvenv", "bin", "python"))


@pytest.mark.parametrize("name,hf_class", [("gqa_untied", "LlamaForCausalLM"), ("llama_bias", "LlamaForCausalLM"),
                                           ("qwen2", "Qwen2ForCausalLM"), ("gemma2", "Gemma2ForCausalLM")])
def test_transformers_and_peft_load_our_outputs(tmp_path, name, hf_class):
    """Trained with --lora-dropout 0.1: adapter_config.json records it and PEFT, in eval mode,
    applies none, as our --eval-only. The LLaMA with every bias and Qwen2 (q, k, v biases, large k
    ones) and Gemma 2 (norms scaling by 1 + w, sandwich norms, GeGLU, soft-capped logits) load in
    transformers' own classes with our losses: base, adapter and merged export."""
    if not os.path.exists(HF_PYTHON):
        pytest.fail(f"{HF_PYTHON} missing: scripts/ci/install_deps.sh makes it (python3 -m venv --system-site-packages build/hfvenv; "
                    "pip install transformers==4.40.2 peft==0.10.0 accelerate==0.25.0)")
    cfg = lc.model_config(name)
    lc.write_model(str(tmp_path / "model"), cfg, seed=5)
    rng = np.random.default_rng(2)
    toks = np.tile(rng.integers(3, cfg["vocab_size"], size=11), 500)
    shards.write_shard(str(tmp_path / "data.bin"), toks.astype(np.uint32), np.ones(toks.size, np.uint8), cfg["vocab_size"])
    run(["--model", tmp_path / "model", "--data", tmp_path / "data.bin", "--steps", 8, "--batch", 4, "--seq", 24, "--lora-rank", 4,
         "--lr", 1e-2, "--mode", "lowmem", "--out", tmp_path / "adapter", "--export-merged", tmp_path / "merged", "--threads", 1,
         "--lora-dropout", 0.1])
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        assert json.load(f)["lora_dropout"] == pytest.approx(0.1)
    ours = [float(run(["--model", m, "--val", tmp_path / "data.bin", "--eval-only", "--seq", 24, "--batch", 4, "--val-batches", 4,
                       "--lora-rank", 4, "--threads", 1, *x]).stdout.split("val loss ")[-1])
            for m, x in ((tmp_path / "model", ()), (tmp_path / "model", ("--adapter", tmp_path / "adapter")), (tmp_path / "merged", ()))]
    p = subprocess.run([HF_PYTHON, os.path.join(lc.REPO, "scripts", "interop", "check_hf_interop.py"), "--base", str(tmp_path / "model"),
                        "--adapter", str(tmp_path / "adapter"), "--merged", str(tmp_path / "merged"), "--val", str(tmp_path / "data.bin"),
                        "--seq", "24", "--windows", "16"], capture_output=True, text=True, timeout=300, env=ENV)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"transformers class:                {hf_class}" in p.stdout, p.stdout
    theirs = [float(line.split(":")[-1]) for line in p.stdout.splitlines() if line.startswith("transformers") and "class" not in line]
    print("ours (base, base+adapter, merged):", ours, "transformers/PEFT:", theirs)
    assert len(theirs) == 3 and ours[1] < ours[0] - 0.1
    np.testing.assert_allclose(theirs, ours, rtol=2e-6)


@pytest.mark.parametrize("ms_lora", ["exact", "merged"])
def test_transformers_and_peft_load_our_vit_outputs(tmp_path, ms_lora):
    """train_vit under MS-LN (exact: a plain adapter; --ms-lora merged, the paper's variant: the
    merged beta leaves a bias shift, exported as PEFT lora_only biases): transformers'
    ViTForImageClassification reads our merged export and PEFT our adapter (new head as
    modules_to_save), both with our --eval-only loss and accuracy."""
    if not os.path.exists(HF_PYTHON):
        pytest.fail(f"{HF_PYTHON} missing: scripts/ci/install_deps.sh makes it")
    data = os.path.join(lc.REPO, "data")
    vit = os.path.join(lc.REPO, "train_vit")
    model, val = os.path.join(data, "vit_demo"), os.path.join(data, "vit_demo_ft_val.bin")
    p = subprocess.run([vit, "--model", model, "--data", os.path.join(data, "vit_demo_ft_train.bin"), "--steps", "15", "--batch", "32",
                        "--lr", "3e-3", "--lora-rank", "4", "--mode", "lowmem", "--ms-lora", ms_lora, "--out", str(tmp_path / "ad"),
                        "--export-merged", str(tmp_path / "merged"), "--threads", "2"], capture_output=True, text=True, env=ENV, timeout=300)
    assert p.returncode == 0, p.stderr
    ev = subprocess.run([vit, "--model", str(tmp_path / "merged"), "--val", val, "--eval-only", "--batch", "50", "--val-batches", "2"],
                        capture_output=True, text=True, env=ENV, timeout=300)
    ours = ev.stdout.split("val loss ")[-1].split()
    ours_loss, ours_acc = float(ours[0]), float(ours[4])  # "1.05 | val acc 0.61 (...)"
    q = subprocess.run([HF_PYTHON, os.path.join(lc.REPO, "scripts", "interop", "check_hf_vit.py"), "--base", model, "--adapter", str(tmp_path / "ad"),
                        "--merged", str(tmp_path / "merged"), "--val", val, "--images", "100"], capture_output=True, text=True, timeout=300, env=ENV)
    assert q.returncode == 0, q.stderr[-3000:]
    rows = [line.split(": loss ")[1].split(" acc ") for line in q.stdout.splitlines() if line.startswith("transformers")]
    print("ours:", ours_loss, ours_acc, "transformers merged / PEFT:", rows)
    assert len(rows) == 2
    for loss, acc in rows:
        assert abs(float(loss) - ours_loss) < 2e-6 * ours_loss and abs(float(acc) - ours_acc) < 1e-9


def test_peft_rslora_adapter_loads_with_its_scale(tmp_path):
    """An adapter PEFT saves with use_rslora (scale lora_alpha/sqrt(r)) and random A and B: our
    --eval-only with --lora-rslora gives PEFT's loss; without the flag it is refused, naming the
    option (it used to load with the scale alpha/r, another model, exit 0)."""
    if not os.path.exists(HF_PYTHON):
        pytest.fail(f"{HF_PYTHON} missing: scripts/ci/install_deps.sh makes it")
    cfg = lc.model_config("gqa_untied")
    lc.write_model(str(tmp_path / "model"), cfg, seed=5)
    rng = np.random.default_rng(3)
    toks = rng.integers(3, cfg["vocab_size"], size=2000)
    val = str(tmp_path / "val.bin")
    shards.write_shard(val, toks.astype(np.uint32), np.ones(toks.size, np.uint8), cfg["vocab_size"])
    script = os.path.join(lc.REPO, "scripts", "interop", "save_peft_adapter.py")
    p = subprocess.run([HF_PYTHON, script, "--base", str(tmp_path / "model"), "--out", str(tmp_path / "adapter"),
                        "--rank", "4", "--alpha", "8", "--rslora", "--val", val, "--seq", "24", "--windows", "16"],
                       capture_output=True, text=True, timeout=300, env=ENV)
    assert p.returncode == 0, p.stderr[-3000:]
    peft_adapted, peft_base = (float(line.split(":")[-1]) for line in p.stdout.splitlines() if line.startswith("PEFT"))
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        assert json.load(f)["use_rslora"] is True
    args = ["--model", tmp_path / "model", "--val", val, "--eval-only", "--seq", 24, "--batch", 4, "--val-batches", 4,
            "--lora-rank", 4, "--lora-alpha", 8, "--threads", 1, "--adapter", tmp_path / "adapter"]
    ours = float(run(args + ["--lora-rslora"]).stdout.split("val loss ")[-1])
    print("PEFT (base, base + rsLoRA adapter):", peft_base, peft_adapted, "ours:", ours)
    assert abs(peft_adapted - peft_base) > 0.02
    np.testing.assert_allclose(ours, peft_adapted, rtol=2e-6)
    err = run(args, check=False).stderr
    assert "use_rslora is true" in err and "--lora-rslora" in err, err
    # the scale alpha/r, what the flag-less load used to apply, is another model
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        cfg = dict(json.load(f), use_rslora=False)
    with open(tmp_path / "adapter" / "adapter_config.json", "w") as f:
        json.dump(cfg, f)
    assert abs(float(run(args).stdout.split("val loss ")[-1]) - peft_adapted) > 0.01


# Gemma 3 (gemma3_text): build/hfvenv's transformers has no class for it, so PEFT wraps a module of our own
# under transformers' parameter names, whose forward is the independent reference's (checked equal to
# reference_llama.forward in float64 by the script before it prints a loss)
PEFT_GEMMA3 = os.path.join(lc.REPO, "test", "system", "peft_gemma3_run.py")


def gemma3_model(root, layout):
    """The gemma3 test model (q/k gammas far from 1, local layers with a window of 5 < --seq 24, two RoPE
    bases) as a gemma3_text directory, or as the language model of a gemma3 one (test_gemma3_multimodal.py's,
    beside a vision part), and a token shard of a repeated pattern that a few steps learn."""
    from test_gemma3_multimodal import gemma3_dir
    cfg = lc.model_config("gemma3")
    lc.write_model(str(root / "text"), cfg, seed=5)
    rng = np.random.default_rng(2)
    toks = np.tile(rng.integers(3, cfg["vocab_size"], size=11), 500)
    shards.write_shard(str(root / "data.bin"), toks.astype(np.uint32), np.ones(toks.size, np.uint8), cfg["vocab_size"])
    model = root / "text" if layout == "gemma3_text" else gemma3_dir(str(root / "text"), str(root / "mm"))
    return model, root / "data.bin"


def peft_gemma3(*argv):
    p = subprocess.run([HF_PYTHON, PEFT_GEMMA3, *[str(a) for a in argv], "--seq", "24", "--windows", "16"],
                       capture_output=True, text=True, timeout=300, env=ENV)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("float64 logits against reference_llama.forward") == 2, p.stdout
    return {line.split(":")[0]: float(line.split(":")[-1]) for line in p.stdout.splitlines()
            if line.startswith(("PEFT", "merged"))}


def gemma3_eval(model, data, *extra):
    return float(run(["--model", model, "--val", data, "--eval-only", "--seq", 24, "--batch", 4, "--val-batches", 4,
                      "--lora-rank", 4, "--threads", 1, *extra]).stdout.split("val loss ")[-1])


@pytest.mark.parametrize("layout", ["gemma3_text", "gemma3"])
def test_peft_loads_our_gemma3_adapter(tmp_path, layout):
    """Trained under lowmem (MS norms, ReGELU2) with --lora-dropout: PEFT's PeftModel.from_pretrained over
    the reference module reads our adapter, and gives our --eval-only losses for the base and base +
    adapter, and the module reads our merged export with our loss. The same fp32 tolerance as the
    families transformers has (test_transformers_and_peft_load_our_outputs). A gemma3 directory's adapter
    names current transformers' module paths (model.language_model.layers.N), where PEFT finds them."""
    if not os.path.exists(HF_PYTHON):
        pytest.fail(f"{HF_PYTHON} missing: scripts/ci/install_deps.sh makes it")
    model, data = gemma3_model(tmp_path, layout)
    run(["--model", model, "--data", data, "--steps", 8, "--batch", 4, "--seq", 24, "--lora-rank", 4, "--lr", 1e-2,
         "--mode", "lowmem", "--out", tmp_path / "adapter", "--export-merged", tmp_path / "merged", "--threads", 1,
         "--lora-dropout", 0.1])
    ours = [gemma3_eval(model, data), gemma3_eval(model, data, "--adapter", tmp_path / "adapter"),
            gemma3_eval(tmp_path / "merged", data)]
    got = peft_gemma3("load", "--base", model, "--adapter", tmp_path / "adapter", "--merged", tmp_path / "merged",
                      "--val", data)
    theirs = [got["PEFT base"], got["PEFT base + adapter"], got["merged export"]]
    print("ours (base, base+adapter, merged):", ours, "PEFT over the reference module:", theirs)
    assert ours[1] < ours[0] - 0.1
    np.testing.assert_allclose(theirs, ours, rtol=2e-6)


@pytest.mark.parametrize("layout", ["gemma3_text", "gemma3"])
def test_our_gemma3_loads_a_peft_adapter(tmp_path, layout):
    """An adapter PEFT saves over the reference module (get_peft_model, random A and B on every
    projection, save_pretrained): our --eval-only --adapter gives PEFT's loss, and the base's without it."""
    if not os.path.exists(HF_PYTHON):
        pytest.fail(f"{HF_PYTHON} missing: scripts/ci/install_deps.sh makes it")
    model, data = gemma3_model(tmp_path, layout)
    got = peft_gemma3("save", "--base", model, "--out", tmp_path / "adapter", "--rank", 4, "--alpha", 8, "--val", data)
    peft_adapted, peft_base = got["PEFT base + adapter"], got["PEFT base"]
    ours = gemma3_eval(model, data, "--lora-alpha", 8, "--adapter", tmp_path / "adapter")
    print("PEFT (base, base + adapter):", peft_base, peft_adapted, "ours:", ours)
    assert abs(peft_adapted - peft_base) > 0.02
    np.testing.assert_allclose(ours, peft_adapted, rtol=2e-6)
    np.testing.assert_allclose(gemma3_eval(model, data), peft_base, rtol=2e-6)
