#!/usr/bin/env python3
"""PEFT over a Gemma 3 text model of our own, for test/system/test_hf_interop.py: build/hfvenv's
transformers (4.46) has no Gemma 3 class, and PEFT wraps any torch nn.Module. Gemma3Module below
holds a gemma3_text checkpoint under transformers' parameter names (model.embed_tokens,
model.layers.N.self_attn.{q,k,v,o}_proj, q_norm, k_norm, input_layernorm, post_attention_layernorm,
pre_feedforward_layernorm, post_feedforward_layernorm, mlp.{gate,up,down}_proj, model.norm; the head
tied to the embedding), or a gemma3 directory's language model under model.language_model. (current
transformers' Gemma3ForConditionalGeneration), each projection an nn.Linear that PEFT's LoRA layers
replace; its forward is the independent reference's math (test/model/reference_llama.py: its norms,
RoPE tables of both bases, windowed attention and tanh GELU), layer by layer. Before any loss is
printed, its logits in float64 are checked equal to reference_llama.forward's, without the adapter
and with PEFT's adapter (its lora_A / lora_B weights handed to the reference as LoRA pairs).

    peft_gemma3_run.py load --base DIR --adapter DIR [--merged DIR] --val SHARD --seq T --windows N
        PeftModel.from_pretrained(module, DIR): prints the base's loss and base + adapter's (and the
        module's loss of a merged export)
    peft_gemma3_run.py save --base DIR --out DIR --rank R --alpha A --val SHARD --seq T --windows N
        get_peft_model (random A and B, every projection) + save_pretrained: prints both losses

Losses (float32, as transformers runs a float32 checkpoint) on the first windows of a token shard,
the windows train_llama --eval-only uses (scripts/interop/check_hf_interop.py's masked_loss)."""
import argparse
import json
import os
import sys
import types

import numpy as np
import torch
from torch import nn

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(REPO, "test", "model"), os.path.join(REPO, "scripts", "formats"),
                os.path.join(REPO, "scripts", "interop")]
import reference_llama as ref  # noqa: E402
import shards  # noqa: E402
from check_hf_interop import masked_loss  # noqa: E402

MM_PREFIX = "language_model."  # a gemma3 directory's language model, as released checkpoints name it
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class Norm(nn.Module):
    """Gemma's RMSNorm: stores w, scales by 1 + w."""

    def __init__(self, n, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.zeros(n)), eps

    def forward(self, x):
        return ref.rmsnorm(x, 1.0 + self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.q_proj = nn.Linear(c.dim, c.n_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=False)
        self.q_norm, self.k_norm = Norm(c.head_dim, c.eps), Norm(c.head_dim, c.eps)


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c.dim, c.hidden, bias=False)
        self.up_proj = nn.Linear(c.dim, c.hidden, bias=False)
        self.down_proj = nn.Linear(c.hidden, c.dim, bias=False)


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn, self.mlp = Attention(c), MLP(c)
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"):
            setattr(self, n, Norm(c.dim, c.eps))


class TextModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.n_layers))
        self.norm = Norm(c.dim, c.eps)


class Config(types.SimpleNamespace):
    """What PEFT reads of a transformers model's config: model_type, tie_word_embeddings, to_dict()."""

    def to_dict(self):
        return dict(vars(self))


def text_checkpoint(model_dir):
    """The text model's config dict and tensors (named as a gemma3_text directory names them) of a gemma3_text
    directory, or of a gemma3 one (text_config; tensors language_model.model.*), and whether it was the latter."""
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    weights = ref.load_weights_np(model_dir)
    if config.get("model_type") != "gemma3":
        return config, weights, False
    text = {k[len(MM_PREFIX):]: v for k, v in weights.items() if k.startswith(MM_PREFIX)}
    return dict(config["text_config"], model_type="gemma3_text"), text, True


class Gemma3Module(nn.Module):
    """A gemma3_text checkpoint under transformers' names (Gemma3ForCausalLM's: model.layers.N...), or the language
    model of a gemma3 one under current transformers' Gemma3ForConditionalGeneration's (model.language_model.layers.N;
    its vision tower is left out); forward = reference_llama.forward's steps."""

    def __init__(self, model_dir, dtype):
        super().__init__()
        config, weights, self.multimodal = text_checkpoint(model_dir)
        self.cfg = c = ref.LlamaConfig(config)
        if c.model_type != "gemma3_text" or not c.tied:
            sys.exit(f"error: {model_dir}: expected a tied gemma3_text checkpoint")
        self.config = Config(model_type="gemma3" if self.multimodal else "gemma3_text", tie_word_embeddings=True)
        if self.multimodal:
            self.model = nn.Module()
            self.model.language_model = TextModel(c)
            weights = {"model.language_model." + k[len("model."):]: v for k, v in weights.items()}
        else:
            self.model = TextModel(c)
        self.load_state_dict({k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in weights.items()}, strict=True)
        self.to(dtype)

    def text(self):
        return self.model.language_model if self.multimodal else self.model

    def prepare_inputs_for_generation(self, *args, **kwargs):  # PeftModelForCausalLM looks it up; never called
        raise NotImplementedError

    def forward(self, input_ids=None, **unused):
        c, m = self.cfg, self.text()
        B, T = input_ids.shape
        hd, dtype = c.head_dim, m.embed_tokens.weight.dtype
        cos, sin = ref.rope_cos_sin(c, T, dtype)
        local = ref.rope_cos_sin(c, T, dtype, local=True)
        x = m.embed_tokens(input_ids) * float(np.float32(np.sqrt(c.dim)))  # the reference's embed_scale
        for l, layer in enumerate(m.layers):
            a = layer.self_attn
            z = layer.input_layernorm(x)
            q = a.q_norm(a.q_proj(z).reshape(B, T, c.n_heads, hd)).transpose(1, 2)
            k = a.k_norm(a.k_proj(z).reshape(B, T, c.n_kv_heads, hd)).transpose(1, 2)
            v = a.v_proj(z).reshape(B, T, c.n_kv_heads, hd).transpose(1, 2)
            lc, ls = local if c.local[l] else (cos, sin)
            q, k = ref.apply_rope(q, lc, ls), ref.apply_rope(k, lc, ls)
            o = ref.attention(q, k, v, c.n_heads // c.n_kv_heads, c.layer_window[l], c.attn_scale, c.attn_softcap)
            x = x + layer.post_attention_layernorm(a.o_proj(o.transpose(1, 2).reshape(B, T, c.n_heads * hd)))
            z2 = layer.pre_feedforward_layernorm(x)
            y = layer.mlp.down_proj(ref.gelu_tanh(layer.mlp.gate_proj(z2)) * layer.mlp.up_proj(z2))
            x = x + layer.post_feedforward_layernorm(y)
        logits = m.norm(x) @ m.embed_tokens.weight.t()
        if c.final_softcap:
            logits = torch.tanh(logits / c.final_softcap) * c.final_softcap
        return types.SimpleNamespace(logits=logits)


def lora_pairs(peft_model):
    """PEFT's adapter as the reference's LoRA dict {(layer, target): (A, B)} and its one scale."""
    short = {v: k for k, v in ref._MODULE_OF.items()}
    pairs, scales = {}, set()
    for name, mod in peft_model.named_modules():
        if hasattr(mod, "lora_A") and "default" in mod.lora_A:
            l = int(name.split(".layers.")[1].split(".")[0])
            module = name.split(f".layers.{l}.")[1]
            pairs[(l, short[module])] = (mod.lora_A["default"].weight.detach(), mod.lora_B["default"].weight.detach())
            scales.add(float(mod.scaling["default"]))
    assert len(scales) == 1, scales
    return pairs, scales.pop()


def check_against_reference(base_dir, peft_model, windows):
    """The module's float64 logits, without and with the adapter, are reference_llama.forward's."""
    peft_model.double()
    tokens = torch.from_numpy(windows[:, :-1])
    config, weights, _ = text_checkpoint(base_dir)
    reference = ref.LlamaModel(ref.LlamaConfig(config), weights, torch.float64)
    pairs, scale = lora_pairs(peft_model)
    if len(pairs) != reference.cfg.n_layers * len(TARGETS):
        sys.exit(f"error: PEFT's adapter covers {len(pairs)} projections, expected every one")
    with torch.no_grad():
        with peft_model.disable_adapter():
            base = peft_model(tokens).logits
        adapted = peft_model(tokens).logits
        want_base = ref.forward(reference, tokens, {}, 1.0)
        want = ref.forward(reference, tokens, pairs, scale)
    for name, got, exp in (("base", base, want_base), ("base + adapter", adapted, want)):
        err = float((got - exp).abs().max())
        print(f"float64 logits against reference_llama.forward ({name}): max abs difference {err:.3g}")
        if err > 1e-10 * float(exp.abs().max()):  # the same float64 operations: only torch's kernels may differ
            sys.exit(f"error: the module's {name} logits are not the reference's ({err:.3g})")
    if float((adapted - base).abs().max()) < 1e-3:
        sys.exit("error: the adapter does not change the logits")
    peft_model.float()


def val_windows(path, T, n):
    toks, mask, _ = shards.read_shard(path)
    windows = np.stack([toks[i * T: i * T + T + 1] for i in range(n)]).astype(np.int64)
    wmask = np.stack([mask[i * T + 1: i * T + T + 1] for i in range(n)]).astype(np.float64)
    return windows, wmask


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("load", "save"))
    ap.add_argument("--base", required=True)
    ap.add_argument("--adapter", help="load: the adapter directory")
    ap.add_argument("--out", help="save: the adapter directory to write")
    ap.add_argument("--merged", help="load: also the loss of this merged export (a gemma3_text directory)")
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--alpha", type=float, default=8.0)
    ap.add_argument("--val", required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--windows", type=int, required=True)
    a = ap.parse_args()
    from peft import LoraConfig, PeftModel, get_peft_model
    torch.manual_seed(0)
    module = Gemma3Module(a.base, torch.float32).eval()
    if a.what == "load":
        if not os.path.isfile(os.path.join(a.adapter or "", "adapter_model.safetensors")):
            sys.exit(f"error: {a.adapter}: no adapter_model.safetensors")
        model = PeftModel.from_pretrained(module, a.adapter).eval()
    else:
        # init_lora_weights=False: B is random too (nn.Linear's init), not zero
        cfg = LoraConfig(r=a.rank, lora_alpha=a.alpha, target_modules=TARGETS, init_lora_weights=False,
                         task_type="CAUSAL_LM")
        model = get_peft_model(module, cfg).eval()
        model.save_pretrained(a.out)
    windows, wmask = val_windows(a.val, a.seq, a.windows)
    check_against_reference(a.base, model, windows)
    print(f"PEFT base + adapter: {masked_loss(model, windows, wmask):.6f}")
    with model.disable_adapter():
        print(f"PEFT base:           {masked_loss(model, windows, wmask):.6f}")
    if a.merged:
        print(f"merged export:       {masked_loss(Gemma3Module(a.merged, torch.float32).eval(), windows, wmask):.6f}")


if __name__ == "__main__":
    main()
