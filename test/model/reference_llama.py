#!/usr/bin/env python3
"""Independent PyTorch reference of a LLaMA forward + backward with LoRA: the oracle the C trainer
is tested against (test/model/test_llama_model.py). Covers the LLaMA-architecture families the trainer
reads: LLaMA (attention_bias, mlp_bias, head_dim), Mistral, Qwen2 (q/k/v biases), Qwen3 (q/k
norms before RoPE), Phi-3 (fused qkv_proj / gate_up_proj with one LoRA adapter over each fused
output, as PEFT puts it there; partial_rotary_factor and LongRoPE as current transformers'
modeling_phi3.py / modeling_rope_utils.py compute them), Gemma 2 and Gemma 3 text (norms scaling by
1 + w, embeddings scaled by sqrt(hidden), GeGLU with the tanh GELU, sandwich norms, attention and
final-logit soft-capping; Gemma 3's q/k norms, local layers with their own RoPE base, linear RoPE
scaling on the global ones), with each layer's sliding window, as transformers' modeling files define them.

Written plainly with autograd, float64 by default. Reads a Hugging Face model directory
(config.json + model.safetensors, or sharded with model.safetensors.index.json) through st_io.

Modes (mirroring the trainer's switches):
  act  exact   SiLU (Gemma: tanh GELU), autograd derivative
       approx  ReSiLU2 (Gemma: ReGELU2): forward exact; backward dx = dy * L[code],
               code = [x > c1] + [x > c2] + [x > c3], L = {0, a1, a1+a2, a1+a2+a3} in float32
  norm std     RMSNorm with gamma
       ms      gamma merged into every consuming linear (q,k,v <- input_layernorm;
               gate,up <- post_attention_layernorm; W' = W * gamma[None, :]), parameter-free
               RMSNorm. The final norm stays standard. LoRA A/B given by the caller are the
               original model's adapters: they see gamma*z (ms_lora "exact", the default, so
               the function and its gradients are those of std), or, with ms_lora "merged" (the
               paper's variant), the adapters of the merged linears, which see z.
  recompute    does not change the math; ignored here.

Case / output contract (same as build/test/llama_probe):
  CASE: "tokens" I32 [B, T+1], "mask" F32 [B, T], "lora.{l}.{t}.A" [r, in], "lora.{l}.{t}.B" [out, r]
  OUT:  "logits" F32 [B, T, V], "loss" F32 [1], "grad.lora.{l}.{t}.A", "grad.lora.{l}.{t}.B"
  loss = sum over positions with mask == 1 of cross-entropy / number of such positions.

CLI (same flags as the probe, plus --dtype):
  python3 test/model/reference_llama.py --model DIR --case CASE.safetensors --out(-file) OUT.safetensors \
      --act exact|approx --norm std|ms --lora-rank R --lora-alpha A --lora-targets q,k,v,o,gate,up,down
"""
import argparse
import json
import math
import os
import sys

import numpy as np
import torch

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_REPO, "scripts", "formats"))
import st_io  # noqa: E402

# ReSiLU2 constants (docs/architecture.md, the method)
RESILU2_A = (-0.04060357190528599, 1.080925428529668, -0.040321856624382146)
RESILU2_C = (-6.3050461001646445, -0.0008684942046214787, 6.325815242089708)
# ReGELU2 constants (the same fit to the GELU; docs/architecture.md)
REGELU2_A = (-0.04922261145617846, 1.0979632065417297, -0.048740595085551286)
REGELU2_C = (-3.1858810036855245, -0.001178821281161997, 3.190832613414926)

LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
# Phi-3's fused modules: each part's module and the parts in row order (Phi3MLP chunks gate first)
FUSED_OF = {"q": ("self_attn.qkv_proj", ("q", "k", "v")), "k": ("self_attn.qkv_proj", ("q", "k", "v")),
            "v": ("self_attn.qkv_proj", ("q", "k", "v")), "gate": ("mlp.gate_up_proj", ("gate", "up")),
            "up": ("mlp.gate_up_proj", ("gate", "up"))}
_MODULE_OF = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
              "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
              "down": "mlp.down_proj"}


# ---------------------------------------------------------------------------------------------
# ReSiLU2

def resilu2_levels(fit_a=RESILU2_A):
    """The 4 backward levels {0, a1, a1+a2, a1+a2+a3}, accumulated in float32 (as the paper's
    reference code does), returned as a float32 numpy array."""
    levels = [np.float32(0.0)]
    acc = np.float32(0.0)
    for a in fit_a:
        acc = np.float32(acc + np.float32(a))
        levels.append(acc)
    return np.array(levels, dtype=np.float32)


def resilu2_codes(x, fit_c=RESILU2_C):
    """code = [x > c1] + [x > c2] + [x > c3] (strict), as int64, same shape as x."""
    code = torch.zeros_like(x, dtype=torch.int64)
    for c in fit_c:
        code += (x > c).to(torch.int64)
    return code


def breakpoint_margins(x, fit_c=RESILU2_C):
    """For each breakpoint c_i, the smallest |x - c_i| over all elements (how close any element
    is to a discontinuity of the ReSiLU2 (ReGELU2) derivative)."""
    x = x.detach().to(torch.float64)
    return [float((x - c).abs().min()) if x.numel() else math.inf for c in fit_c]


class ReSiLU2(torch.autograd.Function):
    """Exact SiLU forward, 4-level step derivative backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(resilu2_codes(x))
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, dy):
        (code,) = ctx.saved_tensors
        levels = torch.from_numpy(resilu2_levels()).to(dy.dtype)
        return dy * levels[code]


def silu_exact(x):
    return x * torch.sigmoid(x)


def gelu_tanh(x):
    """GELU, tanh form (transformers' gelu_pytorch_tanh)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


class ReGELU2(torch.autograd.Function):
    """Exact tanh-GELU forward, ReGELU2's 4-level step derivative backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(resilu2_codes(x, REGELU2_C))
        return gelu_tanh(x)

    @staticmethod
    def backward(ctx, dy):
        (code,) = ctx.saved_tensors
        levels = torch.from_numpy(resilu2_levels(REGELU2_A)).to(dy.dtype)
        return dy * levels[code]


# ---------------------------------------------------------------------------------------------
# config and weights

class LlamaConfig:
    """The fields of a Hugging Face LLaMA config.json that the model needs."""

    def __init__(self, d):
        def need(key):
            if key not in d:
                raise ValueError(f"config.json: missing field {key}")
            return d[key]
        self.dim = int(need("hidden_size"))
        self.hidden = int(need("intermediate_size"))
        self.n_layers = int(need("num_hidden_layers"))
        self.n_heads = int(need("num_attention_heads"))
        self.n_kv_heads = int(d.get("num_key_value_heads") or self.n_heads)
        self.vocab = int(need("vocab_size"))
        self.eps = float(d.get("rms_norm_eps", 1e-6))
        self.rope_theta = float(d.get("rope_theta", 10000.0))
        self.rope_scaling = d.get("rope_scaling")
        self.model_type = d.get("model_type", "llama")
        # Gemma 2 (gemma2) and Gemma 3 text (gemma3_text): transformers' Gemma2Config / Gemma3TextConfig
        self.gemma = self.model_type in ("gemma2", "gemma3_text")
        gemma3 = self.model_type == "gemma3_text"
        self.tied = bool(d.get("tie_word_embeddings", self.gemma))
        self.head_dim = int(d.get("head_dim") or (256 if self.gemma else self.dim // self.n_heads))
        self.final_softcap = d.get("final_logit_softcapping", 30.0 if self.model_type == "gemma2" else None)
        self.attn_scale = float(d.get("query_pre_attn_scalar", self.head_dim)) ** -0.5
        self.attn_softcap = d.get("attn_logit_softcapping", 50.0 if self.model_type == "gemma2" else None)
        # nn.Embedding's padding_idx, every family's pad_token_id (absent: the config class's default,
        # Gemma 0, Phi-3 32000, the others None): its row gets no gradient from the lookup
        pad = d.get("pad_token_id", 0 if self.gemma else 32000 if self.model_type == "phi3" else None)
        self.pad_id = pad if pad is not None and 0 <= pad < self.vocab else None
        if gemma3 and "rope_theta" not in d:
            self.rope_theta = 1000000.0
        self.rope_local_theta = float(d.get("rope_local_base_freq", 10000.0)) if gemma3 else None
        pattern = int(d.get("sliding_window_pattern", 6))
        # which layers are local (sliding) ones: Gemma 2 the even layers, Gemma 3 all but every pattern-th
        self.local = [gemma3 and (l + 1) % pattern != 0 for l in range(self.n_layers)]
        if d.get("layer_types") and gemma3:
            self.local = [t == "sliding_attention" for t in d["layer_types"]]
        self.rot_dim = None
        # the families' additions to LLaMA, as transformers' modeling files define them:
        # Qwen2's q, k, v projections always have biases; LLaMA's and Qwen3's attention_bias puts
        # one on q, k, v and o; LLaMA's mlp_bias on gate, up and down; Qwen3 normalises each head
        # of q and k (RMSNorm with its own weight [head_dim], eps rms_norm_eps) before RoPE.
        attention_bias = bool(d.get("attention_bias", False))
        qwen2 = self.model_type == "qwen2"
        self.bias = {"q": qwen2 or attention_bias, "k": qwen2 or attention_bias, "v": qwen2 or attention_bias,
                     "o": attention_bias and not qwen2}
        for t in ("gate", "up", "down"):
            self.bias[t] = bool(d.get("mlp_bias", False))
        self.qk_norm = self.model_type in ("qwen3", "gemma3_text")
        # Phi-3: q, k, v (gate, up) are row blocks of one fused linear; RoPE turns the first
        # int(head_dim * partial_rotary_factor) dims of each head; LongRoPE's factors and scale
        self.fused = self.model_type == "phi3"
        self.rot_dim = int(self.head_dim * float(d.get("partial_rotary_factor", 1.0))) if self.fused else None
        self.original_ctx = int(d.get("original_max_position_embeddings", 4096))
        self.max_pos = int(d.get("max_position_embeddings", 4096))
        # the sliding window per layer (0: full attention), as current transformers decides it:
        # Mistral and Phi-3 window every layer; Qwen2/Qwen3 with use_sliding_window the layers from
        # max_window_layers on; layer_types names each layer; Gemma 2 its even layers, Gemma 3 its
        # local ones
        w = d.get("sliding_window") or 0
        if self.model_type in ("mistral", "phi3"):
            sliding = [True] * self.n_layers
        elif d.get("layer_types"):
            sliding = [t == "sliding_attention" for t in d["layer_types"]]
        elif self.model_type == "gemma2":
            sliding = [l % 2 == 0 for l in range(self.n_layers)]
        elif gemma3:
            sliding = list(self.local)
        elif d.get("use_sliding_window"):
            first = d.get("max_window_layers")
            first = 28 if first is None else int(first)
            sliding = [l >= first for l in range(self.n_layers)]
        else:
            sliding = [False] * self.n_layers
        self.layer_window = [int(w) if s else 0 for s in sliding]
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"config.json: num_attention_heads {self.n_heads} is not a multiple "
                             f"of num_key_value_heads {self.n_kv_heads}")
        if "head_dim" not in d and self.dim % self.n_heads:
            raise ValueError(f"config.json: hidden_size {self.dim} not divisible by "
                             f"num_attention_heads {self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(f"config.json: head_dim {self.head_dim} must be even for RoPE")
        if self.rot_dim is None:
            self.rot_dim = self.head_dim
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("llama3", "default") and not (self.fused and kind in ("longrope", "su")) \
                    and not (gemma3 and kind == "linear"):
                raise ValueError(f"config.json: rope_scaling type {kind!r} not supported")

    @classmethod
    def from_dir(cls, model_dir):
        with open(os.path.join(model_dir, "config.json")) as f:
            return cls(json.load(f))

    def in_out(self, target):
        """(in_features, out_features) of a LoRA target linear."""
        q_out = self.n_heads * self.head_dim
        kv_out = self.n_kv_heads * self.head_dim
        return {"q": (self.dim, q_out), "k": (self.dim, kv_out), "v": (self.dim, kv_out),
                "o": (q_out, self.dim), "gate": (self.dim, self.hidden),
                "up": (self.dim, self.hidden), "down": (self.hidden, self.dim)}[target]


def load_weights_np(model_dir):
    """All tensors of the model directory as float32/int numpy arrays (single or sharded file)."""
    single = os.path.join(model_dir, "model.safetensors")
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(single):
        return st_io.load(single)
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        out = {}
        for name in files:
            out.update(st_io.load(os.path.join(model_dir, name)))
        return out
    raise FileNotFoundError(f"{model_dir}: neither model.safetensors nor "
                            f"model.safetensors.index.json")


class LlamaModel:
    """Config + frozen weights as torch tensors of one dtype."""

    def __init__(self, cfg, weights_np, dtype=torch.float64):
        self.cfg = cfg
        self.dtype = dtype
        c = cfg
        w = {}

        def get(name, shape):
            if name not in weights_np:
                raise ValueError(f"model: missing tensor {name}")
            arr = weights_np[name]
            if tuple(arr.shape) != tuple(shape):
                raise ValueError(f"model: tensor {name} has shape {list(arr.shape)}, "
                                 f"expected {list(shape)}")
            return torch.from_numpy(np.asarray(arr, dtype=np.float64)).to(dtype)

        off = 1.0 if c.gemma else 0.0  # Gemma's norms scale by (1 + w)

        def gamma(name, shape):
            return get(name, shape) + off

        w["embed"] = get("model.embed_tokens.weight", (c.vocab, c.dim))
        for l in range(c.n_layers):
            p = f"model.layers.{l}."
            for t in LORA_TARGETS:
                i, o = c.in_out(t)
                if c.fused and t in FUSED_OF:  # Phi-3: this part's rows of the fused weight
                    module, parts = FUSED_OF[t]
                    rows = [c.in_out(x)[1] for x in parts]
                    whole = get(p + module + ".weight", (sum(rows), i))
                    r0 = sum(rows[:parts.index(t)])
                    w[f"{l}.{t}"] = whole[r0:r0 + o]
                    continue
                w[f"{l}.{t}"] = get(p + _MODULE_OF[t] + ".weight", (o, i))
            for t in LORA_TARGETS:
                if c.bias[t]:
                    w[f"{l}.{t}.b"] = get(p + _MODULE_OF[t] + ".bias", (c.in_out(t)[1],))
            if c.qk_norm:
                w[f"{l}.q_norm"] = gamma(p + "self_attn.q_norm.weight", (c.head_dim,))
                w[f"{l}.k_norm"] = gamma(p + "self_attn.k_norm.weight", (c.head_dim,))
            w[f"{l}.attn_norm"] = gamma(p + "input_layernorm.weight", (c.dim,))
            if c.gemma:  # sandwich norms: Gemma's post_attention_layernorm is the attention's post norm
                w[f"{l}.mlp_norm"] = gamma(p + "pre_feedforward_layernorm.weight", (c.dim,))
                w[f"{l}.post_attn_norm"] = gamma(p + "post_attention_layernorm.weight", (c.dim,))
                w[f"{l}.post_mlp_norm"] = gamma(p + "post_feedforward_layernorm.weight", (c.dim,))
            else:
                w[f"{l}.mlp_norm"] = gamma(p + "post_attention_layernorm.weight", (c.dim,))
        w["norm"] = gamma("model.norm.weight", (c.dim,))
        if c.tied:
            w["head"] = w["embed"]
        else:
            w["head"] = get("lm_head.weight", (c.vocab, c.dim))
        self.w = w
        self._merged = None
        # Gemma: sqrt(hidden) in the dtype transformers runs the model in (float32 here; a bf16 model's
        # is rounded to bf16, as the trainer rounds it to the checkpoint's dtype)
        self.embed_scale = float(np.float32(math.sqrt(c.dim)))

    @classmethod
    def load(cls, model_dir, dtype=torch.float64):
        return cls(LlamaConfig.from_dir(model_dir), load_weights_np(model_dir), dtype)

    def merged_weights(self):
        """Weights with the block norms' gammas merged into their consuming linears (MS-RMSNorm).
        The block norms become parameter-free (gamma None); the final norm is kept. Computed once
        per model."""
        if self._merged is not None:
            return self._merged
        w = dict(self.w)
        for l in range(self.cfg.n_layers):
            g1, g2 = w[f"{l}.attn_norm"], w[f"{l}.mlp_norm"]
            for t in ("q", "k", "v"):
                w[f"{l}.{t}"] = w[f"{l}.{t}"] * g1[None, :]
            for t in ("gate", "up"):
                w[f"{l}.{t}"] = w[f"{l}.{t}"] * g2[None, :]
            w[f"{l}.attn_norm"] = None
            w[f"{l}.mlp_norm"] = None
        self._merged = w
        return w


# ---------------------------------------------------------------------------------------------
# layers

def rope_inv_freq(cfg, T=0, local=False):
    """inv_freq[i] = theta^(-2i/rot_dim), i < rot_dim/2 (rot_dim = head_dim but for Phi-3's partial
    rotary), with the Llama-3.1 adjustment when rope_scaling says llama3, linear scaling (divided by
    the factor), and Phi-3's LongRoPE (longrope / su): divided by long_factor[i] when the sequence T
    exceeds original_max_position_embeddings (transformers: max(position_ids) + 1 > it), else
    short_factor[i]. Gemma 3's local layers: their own base, unscaled. float64."""
    hd = cfg.rot_dim
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    rs = cfg.rope_scaling
    if local or rs is None:
        return inv
    if rs.get("rope_type", rs.get("type")) == "linear":
        return inv / float(rs["factor"])
    if rs.get("rope_type", rs.get("type")) in ("longrope", "su"):
        factors = rs["long_factor"] if T > cfg.original_ctx else rs["short_factor"]
        return inv / torch.tensor(factors, dtype=torch.float64)
    if rs.get("rope_type", rs.get("type")) != "llama3":
        return inv
    factor = float(rs["factor"])
    low = float(rs.get("low_freq_factor", 1.0))
    high = float(rs.get("high_freq_factor", 4.0))
    old_ctx = float(rs["original_max_position_embeddings"])
    # wavelengths longer than old_ctx/low are slowed by `factor`; shorter than old_ctx/high are
    # kept; in between, interpolate linearly in old_ctx/wavelen.
    wavelen = 2.0 * math.pi / inv
    out = inv.clone()
    for i in range(inv.numel()):
        wl = float(wavelen[i])
        if wl < old_ctx / high:
            continue
        if wl > old_ctx / low:
            out[i] = inv[i] / factor
        else:
            s = (old_ctx / wl - low) / (high - low)
            out[i] = (1.0 - s) * inv[i] / factor + s * inv[i]
    return out


def rope_attention_factor(cfg):
    """LongRoPE's scale on cos and sin: rope_scaling.attention_factor, else sqrt(1 + ln s / ln orig)
    with s = max_position_embeddings / original_max_position_embeddings (1 when s <= 1); 1 otherwise."""
    rs = cfg.rope_scaling
    if rs is None or rs.get("rope_type", rs.get("type")) not in ("longrope", "su"):
        return 1.0
    if rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])
    s = cfg.max_pos / cfg.original_ctx
    return 1.0 if s <= 1.0 else math.sqrt(1.0 + math.log(s) / math.log(cfg.original_ctx))


def rope_cos_sin(cfg, T, dtype, local=False):
    """cos, sin tables [T, rot_dim] for rotate-half RoPE (frequency i used at i and i+rot_dim/2);
    local: Gemma 3's local layers' table."""
    inv = rope_inv_freq(cfg, T, local)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=1)
    scale = rope_attention_factor(cfg)
    return (scale * ang.cos()).to(dtype), (scale * ang.sin()).to(dtype)


def apply_rope(x, cos, sin):
    """x [B, H, T, hd]; rotate-half pairs (i, i + rot/2) over the first rot = cos.shape[-1] dims,
    the rest passed through (partial rotary, as transformers' Phi3 applies it)."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)


def rmsnorm(x, gamma, eps):
    z = x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + eps)
    return z if gamma is None else z * gamma


def lora_linear(x, W, lora, scale, xa=None, bias=None):
    """y = x W^T (+ bias) + scale * (xa A^T) B^T; lora is (A [r, in], B [out, r]) or None; the
    adapter's input xa defaults to x."""
    y = x @ W.t()
    if bias is not None:
        y = y + bias
    if lora is not None:
        A, B = lora
        y = y + scale * (((x if xa is None else xa) @ A.t()) @ B.t())
    return y


def attention(q, k, v, n_rep, window=0, scale=None, softcap=None):
    """Causal attention. q [B, H, T, hd], k/v [B, Hkv, T, hd]; q head h uses kv head h // n_rep.
    window > 0: query i sees keys i - window < j <= i (transformers' sliding-window mask). scale: the
    scores' (default head_dim^-0.5); softcap: scores become softcap * tanh(scores / softcap) before
    the mask (Gemma 2)."""
    if n_rep > 1:
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    T = q.shape[2]
    scores = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)
    if window > 0:
        causal = causal | torch.ones(T, T, dtype=torch.bool).tril(-window)
    scores = scores.masked_fill(causal, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def forward(model, tokens, lora, scale, act="exact", norm="std", stats=None, weights=None, ms_lora="exact",
            dropout=None):
    """Logits [B, T, V] for input tokens [B, T] (int64 tensor).

    dropout: None, or LoRA dropout while training as a function (layer, target, xa) -> the
    adapter's input after dropout (xa [B, T, in] is what the adapter would see without it).

    lora: dict (layer, target) -> (A, B). stats, if a dict, receives "gate_preact": the list of
    the per-layer gate pre-activations (before the activation). ms_lora: what the adapters of the
    merged linears see under norm="ms": "exact" gamma*z, "merged" z."""
    c = model.cfg
    if act not in ("exact", "approx"):
        raise ValueError(f"act must be exact|approx, got {act!r}")
    if norm not in ("std", "ms"):
        raise ValueError(f"norm must be std|ms, got {norm!r}")
    if ms_lora not in ("exact", "merged"):
        raise ValueError(f"ms_lora must be exact|merged, got {ms_lora!r}")
    see_gamma = norm == "ms" and ms_lora == "exact"
    w = weights if weights is not None else (model.merged_weights() if norm == "ms" else model.w)
    if c.gemma:
        silu = ReGELU2.apply if act == "approx" else gelu_tanh
    else:
        silu = ReSiLU2.apply if act == "approx" else silu_exact
    B, T = tokens.shape
    hd = c.head_dim
    cos, sin = rope_cos_sin(c, T, model.dtype)
    x = w["embed"][tokens]
    if c.pad_id is not None:
        x = torch.where((tokens == c.pad_id)[..., None], w["embed"].detach()[tokens], x)
    if c.gemma:
        x = x * model.embed_scale
    gates = []
    for l in range(c.n_layers):
        def lin(t, inp, norm_key=None):
            # behind an MS norm (ms_lora "exact") the adapter sees the original input gamma*z
            xa = inp * model.w[f"{l}.{norm_key}"] if see_gamma and norm_key else None
            if dropout is not None and lora.get((l, t)) is not None:
                xa = dropout(l, t, inp if xa is None else xa)
            return lora_linear(inp, w[f"{l}.{t}"], lora.get((l, t)), scale, xa, w.get(f"{l}.{t}.b"))

        def fused(parts, inp, norm_key):
            # Phi-3: one linear over the fused weight, with PEFT's one adapter on it (the parts
            # share A; B is their B rows stacked), its output split back into the parts
            if not c.fused:
                return [lin(t, inp, norm_key) for t in parts]
            W = torch.cat([w[f"{l}.{t}"] for t in parts])
            lo = lora.get((l, parts[0]))
            ab = None if lo is None else (lo[0], torch.cat([lora[(l, t)][1] for t in parts]))
            xa = inp * model.w[f"{l}.{norm_key}"] if see_gamma else None
            if dropout is not None and lo is not None:
                xa = dropout(l, parts[0], inp if xa is None else xa)
            y = lora_linear(inp, W, ab, scale, xa)
            return torch.split(y, [w[f"{l}.{t}"].shape[0] for t in parts], dim=-1)
        z = rmsnorm(x, w[f"{l}.attn_norm"], c.eps)
        q, k, v = fused(("q", "k", "v"), z, "attn_norm")
        q = q.reshape(B, T, c.n_heads, hd)
        k = k.reshape(B, T, c.n_kv_heads, hd)
        if c.qk_norm:
            q, k = rmsnorm(q, w[f"{l}.q_norm"], c.eps), rmsnorm(k, w[f"{l}.k_norm"], c.eps)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.reshape(B, T, c.n_kv_heads, hd).transpose(1, 2)
        lc, ls = rope_cos_sin(c, T, model.dtype, local=True) if c.local[l] else (cos, sin)
        q, k = apply_rope(q, lc, ls), apply_rope(k, lc, ls)
        o = attention(q, k, v, c.n_heads // c.n_kv_heads, c.layer_window[l], c.attn_scale, c.attn_softcap)
        o = o.transpose(1, 2).reshape(B, T, c.n_heads * hd)
        ya = lin("o", o)
        x = x + (rmsnorm(ya, w[f"{l}.post_attn_norm"], c.eps) if c.gemma else ya)
        z2 = rmsnorm(x, w[f"{l}.mlp_norm"], c.eps)
        g, u = fused(("gate", "up"), z2, "mlp_norm")
        gates.append(g.detach())
        ym = lin("down", silu(g) * u)
        x = x + (rmsnorm(ym, w[f"{l}.post_mlp_norm"], c.eps) if c.gemma else ym)
    if stats is not None:
        stats["gate_preact"] = gates
    x = rmsnorm(x, w["norm"], c.eps)
    logits = x @ w["head"].t()
    if c.final_softcap:
        logits = torch.tanh(logits / c.final_softcap) * c.final_softcap
    return logits


def masked_ce(logits, targets, mask):
    """Sum over mask==1 positions of cross-entropy / number of such positions."""
    logp = torch.log_softmax(logits, dim=-1)
    nll = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (nll * mask).sum() / mask.sum()


# ---------------------------------------------------------------------------------------------
# case runner

def parse_targets(targets):
    if isinstance(targets, str):
        targets = [t for t in targets.split(",") if t]
    for t in targets:
        if t not in LORA_TARGETS:
            raise ValueError(f"unknown LoRA target {t!r} (expected among {','.join(LORA_TARGETS)})")
    return [t for t in LORA_TARGETS if t in targets]


def run_case(model_dir, case, act="exact", norm="std", lora_rank=None, lora_alpha=None,
             targets=LORA_TARGETS, dtype=torch.float64, full=False, ms_lora="exact", dropout=None):
    """Run one case through the reference.

    model_dir: a model directory or an already loaded LlamaModel (of the wanted dtype).
    case: a CASE .safetensors path or the dict of its numpy arrays.
    lora_rank: checked against the A shapes when given. lora_alpha: default = rank.
    full: full fine-tuning: no adapters; the gradients are those of every linear weight (of the
    merged model under norm="ms"), named "grad.{l}.{t}.W", and of the embedding ("grad.embed"),
    the untied head ("grad.lm_head"), the final norm ("grad.final_norm") and, with standard norms,
    the block norms ("grad.{l}.attn_norm", "grad.{l}.mlp_norm"); where the model has them, of
    the linears' biases ("grad.{l}.{t}.b") and Qwen3's q/k norms ("grad.{l}.q_norm", "grad.{l}.k_norm").
    ms_lora: under norm="ms", the adapters see gamma*z ("exact") or z ("merged", the paper's).
    dropout: LoRA dropout, as forward() takes it (None: none).
    Returns a dict with the OUT names ("logits" [B,T,V], "loss" [1], "grad.lora.{l}.{t}.A|B"),
    all float64 numpy, plus "stats": {"min_margin": smallest distance of any gate
    pre-activation to a ReSiLU2 breakpoint, "margins": the same per breakpoint, "code_counts":
    how many pre-activations got each code 0..3}.
    """
    model = model_dir if isinstance(model_dir, LlamaModel) else LlamaModel.load(model_dir, dtype)
    dtype = model.dtype
    if isinstance(case, (str, os.PathLike)):
        case = st_io.load(case)
    c = model.cfg
    targets = parse_targets(targets)
    tokens = torch.from_numpy(np.asarray(case["tokens"], dtype=np.int64))
    mask = torch.from_numpy(np.asarray(case["mask"], dtype=np.float64)).to(dtype)
    if tokens.dim() != 2 or tuple(mask.shape) != (tokens.shape[0], tokens.shape[1] - 1):
        raise ValueError(f"case: tokens {list(tokens.shape)} / mask {list(mask.shape)} mismatch")
    if int(tokens.min()) < 0 or int(tokens.max()) >= c.vocab:
        raise ValueError(f"case: token ids outside [0, {c.vocab})")
    lora = {}
    rank = None
    for l in range(c.n_layers):
        for t in ([] if full else targets):
            A = np.asarray(case[f"lora.{l}.{t}.A"], dtype=np.float64)
            B = np.asarray(case[f"lora.{l}.{t}.B"], dtype=np.float64)
            i, o = c.in_out(t)
            r = A.shape[0]
            if A.shape != (r, i) or B.shape != (o, r):
                raise ValueError(f"case: lora.{l}.{t} shapes A {A.shape} B {B.shape}, "
                                 f"expected [r, {i}] and [{o}, r]")
            rank = r if rank is None else rank
            if r != rank or (lora_rank is not None and r != lora_rank):
                raise ValueError(f"case: lora.{l}.{t} has rank {r}")
            lora[(l, t)] = (torch.from_numpy(A).to(dtype).requires_grad_(True),
                            torch.from_numpy(B).to(dtype).requires_grad_(True))
            lead = FUSED_OF[t][1][0] if c.fused and t in FUSED_OF else t
            if lead != t:  # Phi-3: one adapter per fused module, its A the lead part's (the same in the case)
                if (l, lead) not in lora or not np.array_equal(A, lora[(l, lead)][0].detach().numpy()):
                    raise ValueError(f"case: lora.{l}.{t}.A must equal lora.{l}.{lead}.A (one fused adapter)")
                lora[(l, t)] = (lora[(l, lead)][0], lora[(l, t)][1])
    if rank is None:
        rank = lora_rank or 1
    alpha = float(lora_alpha) if lora_alpha is not None else float(rank)
    scale = alpha / rank

    stats = {}
    weights = None
    extra = []  # --full: the non-linear weights that train too, (output name, weights key)
    if full:  # every weight becomes a leaf that needs a gradient (the MS-merged gammas are gone)
        weights = dict(model.merged_weights() if norm == "ms" else model.w)
        for l in range(c.n_layers):
            for t in LORA_TARGETS:
                weights[f"{l}.{t}"] = weights[f"{l}.{t}"].clone().requires_grad_(True)
        extra = [("grad.embed", "embed"), ("grad.final_norm", "norm")]
        extra += [(f"grad.{l}.{t}.b", f"{l}.{t}.b") for l in range(c.n_layers) for t in LORA_TARGETS if c.bias[t]]
        if c.qk_norm:
            extra += [(f"grad.{l}.{n}", f"{l}.{n}") for l in range(c.n_layers) for n in ("q_norm", "k_norm")]
        if not c.tied:
            extra.append(("grad.lm_head", "head"))
        if norm == "std":
            extra += [(f"grad.{l}.{n}", f"{l}.{n}") for l in range(c.n_layers) for n in ("attn_norm", "mlp_norm")]
        if c.gemma:  # the sandwich norms are standard in both norm modes
            extra += [(f"grad.{l}.{n}", f"{l}.{n}") for l in range(c.n_layers)
                      for n in ("post_attn_norm", "post_mlp_norm")]
        for _, key in extra:
            weights[key] = weights[key].clone().requires_grad_(True)
        if c.tied:
            weights["head"] = weights["embed"]
    logits = forward(model, tokens[:, :-1], lora, scale, act, norm, stats, weights, ms_lora, dropout)
    loss = masked_ce(logits, tokens[:, 1:], mask)
    params = [p for ab in lora.values() for p in ab]
    if full:
        params = [weights[f"{l}.{t}"] for l in range(c.n_layers) for t in LORA_TARGETS] + [weights[k] for _, k in extra]
    grads = torch.autograd.grad(loss, params) if params else []

    out = {"logits": logits.detach().to(torch.float64).numpy(),
           "loss": np.array([float(loss)], dtype=np.float64)}
    gi = iter(grads)
    if full:
        for l in range(c.n_layers):
            for t in LORA_TARGETS:
                out[f"grad.{l}.{t}.W"] = next(gi).to(torch.float64).numpy()
        for name, _ in extra:
            out[name] = next(gi).to(torch.float64).numpy()
    for (l, t) in lora:
        out[f"grad.lora.{l}.{t}.A"] = next(gi).to(torch.float64).numpy()
        out[f"grad.lora.{l}.{t}.B"] = next(gi).to(torch.float64).numpy()
    g = torch.cat([x.reshape(-1) for x in stats["gate_preact"]])
    fit_c = REGELU2_C if c.gemma else RESILU2_C
    codes = resilu2_codes(g, fit_c)
    margins = breakpoint_margins(g, fit_c)
    out["stats"] = {"min_margin": min(margins), "margins": margins,
                    "code_counts": [int((codes == k).sum()) for k in range(4)]}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--case", required=True)
    ap.add_argument("--out", "--out-file", dest="out", required=True)
    ap.add_argument("--act", choices=("exact", "approx"), default="exact")
    ap.add_argument("--norm", choices=("std", "ms"), default="std")
    ap.add_argument("--ms-lora", choices=("exact", "merged"), default="exact")
    ap.add_argument("--recompute", choices=("none", "block"), default="none",
                    help="accepted for symmetry with the probe; does not change the math")
    ap.add_argument("--lora-rank", type=int, default=None)
    ap.add_argument("--lora-alpha", type=float, default=None)
    ap.add_argument("--lora-targets", default=",".join(LORA_TARGETS))
    ap.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    a = ap.parse_args(argv)
    res = run_case(a.model, a.case, a.act, a.norm, a.lora_rank, a.lora_alpha, a.lora_targets,
                   torch.float64 if a.dtype == "float64" else torch.float32, ms_lora=a.ms_lora)
    stats = res.pop("stats")
    st_io.save(a.out, {k: v.astype(np.float32) for k, v in res.items()})
    print(f"loss {float(res['loss'][0]):.6f} min_breakpoint_margin {stats['min_margin']:.3g} "
          f"codes {stats['code_counts']}")


if __name__ == "__main__":
    main()
