"""A gemma3 directory (Gemma3ForConditionalGeneration, how Gemma 3 4B/12B/27B ship: issue 36): train_llama
fine-tunes the language model inside it exactly as the same weights in a gemma3_text directory.

The gemma3 directory is written here from llama_cases' "gemma3" test model: its config becomes
text_config, its tensors are stored under language_model. (the released checkpoints' names), beside
a tiny random vision part (vision_tower.*, multi_modal_projector.*, SigLIP's names) that must not be
read. The same weights through the same code give the same bits on the CPU, so loss, gradients,
adapter and merged export are compared for equality with the gemma3_text directory's, not within a
tolerance; the vision tensors of the export must be the input's bytes.

Run: /usr/bin/python3 -m pytest -q test/system/test_gemma3_multimodal.py (train_llama,
build/test/llama_probe and build/emu/llama_probe built first)."""
import json
import os
import shutil
import subprocess

import numpy as np
import pytest

import llama_cases as lc
import st_io
from test_llama_families import args, family_model
from test_llama_train import losses, run, val_losses

PEFT_TEXT, PEFT_MM = "base_model.model.model.layers.", "base_model.model.model.language_model.layers."
PEFT_450 = "base_model.model.language_model.model.layers."


def vision_tensors(rng):
    """A tiny SigLIP tower and Gemma 3's projector, random (their values only have to come back unchanged)."""
    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)
    v = "vision_tower.vision_model."
    t = {v + "embeddings.patch_embedding.weight": normal(8, 3, 4, 4), v + "embeddings.patch_embedding.bias": normal(8),
         v + "embeddings.position_embedding.weight": normal(4, 8), v + "post_layernorm.weight": normal(8),
         v + "post_layernorm.bias": normal(8), "multi_modal_projector.mm_input_projection_weight": normal(8, 48),
         "multi_modal_projector.mm_soft_emb_norm.weight": normal(8)}
    for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "mlp.fc1"):
        t[v + f"encoder.layers.0.{m}.weight"] = normal(8, 8)
        t[v + f"encoder.layers.0.{m}.bias"] = normal(8)
    return t


def gemma3_dir(text_dir, out, **top):
    """The gemma3 directory holding text_dir's model as its language model."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(text_dir, "config.json")) as f:
        text_config = json.load(f)
    text_config.pop("architectures")
    config = dict(architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3", text_config=text_config,
                  vision_config=dict(model_type="siglip_vision_model", hidden_size=8, image_size=8, patch_size=4,
                                     num_hidden_layers=1, num_attention_heads=2, intermediate_size=8),
                  mm_tokens_per_image=4, boi_token_index=60, eoi_token_index=61, image_token_index=62,
                  initializer_range=0.02, eos_token_id=[1, 2], torch_dtype="float32", transformers_version="4.50.0")
    config.update(top)
    tensors = {"language_model." + k: v for k, v in st_io.load(os.path.join(text_dir, "model.safetensors")).items()}
    tensors.update(vision_tensors(np.random.default_rng(3)))
    st_io.save(os.path.join(out, "model.safetensors"), tensors, metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return out


def probe_case(tmp_path, text):
    """A probe case of the Gemma 3 test shape away from the ReGELU2 breakpoints: (its path, rank, alpha)."""
    B, T, rank, alpha = lc.SHAPES["gemma3"]
    case, _, _ = lc.make_safe_case(lc.ref.LlamaModel.load(str(text)), B, T, rank, alpha, seed=7)
    path = str(tmp_path / "case.safetensors")
    lc.st_io.save(path, case)
    return path, rank, alpha


@pytest.fixture
def models(tmp_path):
    text, data = family_model(tmp_path, "gemma3")
    return text, gemma3_dir(str(text), str(tmp_path / "mm")), data


def test_probe_loss_and_gradients_equal_the_text_directory(tmp_path, models):
    """llama_probe's loss, logits and every gradient (LoRA and, under --full, the model's), bit for bit."""
    text, mm, _ = models
    path, rank, alpha = probe_case(tmp_path, text)
    for norm, extra in (("std", ()), ("ms", ()), ("std", ("--full",))):
        a = lc.run_probe(str(text), path, str(tmp_path / "a.safetensors"), "exact", norm, "none", rank, alpha,
                         extra=extra)
        b = lc.run_probe(mm, path, str(tmp_path / "b.safetensors"), "exact", norm, "none", rank, alpha, extra=extra)
        grads = [k for k in a if k.startswith("grad.")]
        assert a.keys() == b.keys() and "loss" in a and "logits" in a and grads, sorted(a)
        assert any(np.abs(a[k]).max() > 0 for k in grads)
        for k in a:
            assert np.array_equal(a[k], b[k]), (norm, extra, k)
        if extra:  # the model's own gradients are there too
            assert "grad.embed" in a and "grad.final_norm" in a, sorted(a)


def test_cuda_probe_equals_the_text_directory(tmp_path, models):
    """The CUDA backend (the emulator here, nvcc's build on a GPU) reads the same weights out of both: the same bits."""
    from cuda_backend import binaries, need
    exe = need(binaries("train_llama", "llama_probe")[1])
    text, mm, _ = models
    path, rank, alpha = probe_case(tmp_path, text)
    outs = []
    for i, d in enumerate((str(text), mm)):
        cmd = [exe, "--model", d, "--case", path, "--out-file", str(tmp_path / f"{i}.safetensors"), "--act", "exact",
               "--norm", "ms", "--recompute", "none", "--lora-rank", rank, "--lora-alpha", repr(float(alpha)),
               "--device", "cuda"]
        p = run_cmd(cmd)
        assert p.returncode == 0, p.stderr[-2000:]
        outs.append(st_io.load(str(tmp_path / f"{i}.safetensors")))
    a, b = outs
    assert a.keys() == b.keys() and "loss" in a and any(k.startswith("grad.") for k in a), sorted(a)
    for k in a:
        assert np.array_equal(a[k], b[k]), k


def run_cmd(cmd):
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="2"))


@pytest.mark.parametrize("full", [False, True], ids=["lora", "full"])
def test_training_adapter_and_merged_export(tmp_path, models, full):
    """Losses equal step for step; the adapter holds the same values under the multimodal model's module
    paths (current transformers: model.language_model.layers.N); the merged export is the whole gemma3
    directory, its language tensors the text run's export's, its vision tensors the input's bytes."""
    text, mm, data = models
    flags = ["--mode", "lowmem", "--batch", 2, "--steps", 3] + (["--full", "--lr", 1e-3] if full else [])
    a = run(args(text, data, *flags, "--out", tmp_path / "a", "--export-merged", tmp_path / "ea"))
    b = run(args(mm, data, *flags, "--out", tmp_path / "b", "--export-merged", tmp_path / "eb"))
    n_vision = len(vision_tensors(np.random.default_rng(0)))
    line = [s for s in b.stdout.splitlines() if s.startswith("gemma3:")]
    assert len(line) == 1 and f"{n_vision} vision tensors" in line[0] and "not read" in line[0], b.stdout
    assert "gemma3:" not in a.stdout
    assert losses(a.stdout) == losses(b.stdout) and len(losses(a.stdout)) == 3
    if not full:
        sa = st_io.load(str(tmp_path / "a" / "adapter_model.safetensors"))
        sb = st_io.load(str(tmp_path / "b" / "adapter_model.safetensors"))
        assert sa and all(k.startswith(PEFT_TEXT) for k in sa), sorted(sa)
        assert sorted(sb) == sorted(k.replace(PEFT_TEXT, PEFT_MM) for k in sa)
        for k in sa:
            assert np.array_equal(sa[k], sb[k.replace(PEFT_TEXT, PEFT_MM)]), k
        # each adapter read back (--adapter) into its own model: the same validation loss; one under the
        # other's module paths is refused
        ev = ["--val", data, "--eval-only", "--seq", 16, "--batch", 2, "--val-batches", 2, "--lora-rank", 4]
        va = run(["--model", text, "--adapter", tmp_path / "a", *ev]).stdout
        vb = run(["--model", mm, "--adapter", tmp_path / "b", *ev]).stdout
        assert val_losses(va) == val_losses(vb) and val_losses(va), (va, vb)
        assert run(["--model", mm, "--adapter", tmp_path / "a", *ev], check=False).returncode != 0
        # the names PEFT wrote under transformers 4.50-4.51, Gemma 3's release (language_model.model.layers.N)
        old = tmp_path / "b450"
        shutil.copytree(tmp_path / "b", old)
        st_io.save(str(old / "adapter_model.safetensors"), {k.replace(PEFT_MM, PEFT_450): v for k, v in sb.items()},
                   metadata={"format": "pt"})
        assert val_losses(run(["--model", mm, "--adapter", old, *ev]).stdout) == val_losses(vb)
    ea = st_io.load(str(tmp_path / "ea" / "model.safetensors"))
    eb = st_io.load(str(tmp_path / "eb" / "model.safetensors"))
    src, base = st_io.load(os.path.join(mm, "model.safetensors")), st_io.load(str(text / "model.safetensors"))
    assert sorted(eb) == sorted(src)
    for k in ea:
        assert np.array_equal(ea[k], eb["language_model." + k]), k
    assert any(not np.array_equal(ea[k], base[k]) for k in ea)  # the export did merge something
    vision = [k for k in src if not k.startswith("language_model.")]
    assert len(vision) == n_vision
    for k in vision:
        assert eb[k].tobytes() == src[k].tobytes(), k
    with open(os.path.join(mm, "config.json")) as f, open(tmp_path / "eb" / "config.json") as g:
        assert json.load(f) == json.load(g)
    if full:  # --full's saved model is the whole directory too: the export's tensors
        sb = st_io.load(str(tmp_path / "b" / "model.safetensors"))
        assert sorted(sb) == sorted(src)
        for k in sb:
            assert sb[k].tobytes() == eb[k].tobytes(), k


def test_resume_equals_a_straight_run(tmp_path, models):
    _, mm, data = models
    flags = ["--mode", "lowmem", "--batch", 2, "--save-every", 2, "--steps", 4]
    straight = run(args(mm, data, *flags, "--out", tmp_path / "straight"))
    run(args(mm, data, *flags, "--stop-at", 2, "--out", tmp_path / "resumed"))
    resumed = run(args(mm, data, *flags, "--resume", tmp_path / "resumed"))
    assert "at step 2" in resumed.stdout
    assert losses(straight.stdout)[2:] == losses(resumed.stdout)[-2:]


def refused(tmp_path, text, edit_config=None, extra_tensor=None):
    mm = gemma3_dir(str(text), str(tmp_path / "bad"))
    if edit_config:
        with open(os.path.join(mm, "config.json")) as f:
            c = json.load(f)
        edit_config(c)
        with open(os.path.join(mm, "config.json"), "w") as f:
            json.dump(c, f)
    if extra_tensor:
        t = st_io.load(os.path.join(mm, "model.safetensors"))
        t[extra_tensor] = np.zeros(3, np.float32)
        st_io.save(os.path.join(mm, "model.safetensors"), t, metadata={"format": "pt"})
    p = run(["--model", mm, "--lora-rank", 4, "--export-merged", tmp_path / "x"], check=False)
    shutil.rmtree(mm)
    assert p.returncode != 0 and not os.path.exists(tmp_path / "x")
    lines = [s for s in p.stderr.splitlines() if s.startswith("error:")]
    assert len(lines) == 1, p.stderr
    return lines[0]


@pytest.mark.parametrize("what, edit, tensor, words", [
    ("an unknown top-level key", lambda c: c.update(tie_word_embeddings=False), None, "tie_word_embeddings"),
    ("a quantization_config", lambda c: c.update(quantization_config={"quant_method": "bitsandbytes"}), None,
     "quantization_config"),
    ("another architecture", lambda c: c.update(architectures=["Gemma3ForCausalLM"]), None, "Gemma3ForConditional"),
    ("a text_config of another family", lambda c: c["text_config"].update(model_type="llama"), None, "gemma3_text"),
    ("no text_config", lambda c: c.pop("text_config"), None, "text_config"),
    ("an unknown text_config key", lambda c: c["text_config"].update(final_logit_softcap=1.0), None,
     "final_logit_softcap"),
    ("a tensor outside both parts", None, "model.layers.0.extra.weight", "model.layers.0.extra.weight"),
    ("an unknown language tensor", None, "language_model.model.layers.0.extra.weight", "layers.0.extra.weight"),
])
def test_refusals(tmp_path, what, edit, tensor, words):
    text, _ = family_model(tmp_path, "gemma3")
    line = refused(tmp_path, text, edit, tensor)
    assert words in line, (what, line)


def test_text_config_defaults(tmp_path, models):
    """Keys left out of text_config take Gemma3TextConfig's defaults (released configs name only a few):
    leaving out those whose values are the defaults changes no bit; leaving out num_attention_heads (4 here)
    makes it the default 8, and q_proj's stored shape is then refused."""
    text, mm, data = models
    with open(os.path.join(mm, "config.json")) as f:
        c = json.load(f)
    for k in ("model_type", "rms_norm_eps", "rope_theta", "rope_local_base_freq", "hidden_activation"):
        c["text_config"].pop(k)  # the test config's 1e-6, 1e6, 1e4, gelu_pytorch_tanh are the defaults
    with open(os.path.join(mm, "config.json"), "w") as f:
        json.dump(c, f)
    flags = ["--steps", 2, "--out", tmp_path / "o"]
    a, b = run(args(text, data, *flags)), run(args(mm, data, *flags[:2], "--out", tmp_path / "p"))
    assert losses(a.stdout) == losses(b.stdout) and losses(a.stdout)
    c["text_config"].pop("num_attention_heads")
    with open(os.path.join(mm, "config.json"), "w") as f:
        json.dump(c, f)
    p = run(args(mm, data, *flags[:2], "--out", tmp_path / "q"), check=False)
    assert p.returncode != 0 and "q_proj.weight" in p.stderr and "expected [128,48]" in p.stderr, p.stderr
