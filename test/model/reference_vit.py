#!/usr/bin/env python3
"""Independent PyTorch reference of a ViT image classifier's forward + backward with LoRA and a new
head: the oracle the C trainer is tested against (test/model/test_vit_model.py).

Written plainly with autograd, float64 by default. Reads a Hugging Face ViT model directory
(config.json + model.safetensors, keys vit.embeddings..., vit.encoder.layer.N..., or the same
without the "vit." prefix) through st_io. timm checkpoints are converted to that layout by
scripts/export/export_vit.py.

The model: patch embedding = F.conv2d with stride = patch size; class token; learned position
embedding, whose patch grid is resized with F.interpolate(mode="bicubic", align_corners=False)
when the image's patch grid differs from the checkpoint's (as Hugging Face's
interpolate_pos_encoding); pre-LN blocks (LayerNorm -> q,k,v -> softmax attention -> proj ->
residual; LayerNorm -> fc1 -> GELU -> fc2 -> residual); final LayerNorm; head on the class token.

Modes (mirroring the trainer's switches):
  act  exact   GELU (erf form; tanh form when hidden_act is gelu_pytorch_tanh / gelu_new)
       approx  ReGELU2: forward the exact GELU above; backward dx = dy * L[code],
               code = [x > c1] + [x > c2] + [x > c3], L = {0, a1, a1+a2, a1+a2+a3} in float32
  norm std     LayerNorm with gamma, beta
       ms      each block norm's gamma and beta merged into its consumers (q,k,v <- layernorm_before,
               fc1 <- layernorm_after; W' = W * gamma[None, :], b' = b + W @ beta), parameter-free
               LayerNorm. The final norm stays standard. LoRA A/B are the original model's
               adapters: they see gamma*z + beta (ms_lora "exact", the default, so the function
               and its gradients are those of std), or, with ms_lora "merged" (the paper's
               variant), the adapters of the merged linears, which see z.
  recompute    does not change the math; ignored here.

Case / output contract (same as build/test/vit_probe):
  CASE: "pixels" F32 [B, C, H, W] (already normalised), "labels" I32 [B],
        "lora.{l}.{t}.A" [r, in], "lora.{l}.{t}.B" [out, r], "head.weight" [K, d], "head.bias" [K]
        with t in q, k, v, proj, fc1, fc2
  OUT:  "logits" F32 [B, K], "loss" F32 [1] (mean cross-entropy), "grad.lora.{l}.{t}.A|B",
        "grad.head.weight", "grad.head.bias"

CLI:
  python3 test/model/reference_vit.py --model DIR --case CASE.safetensors --out OUT.safetensors \
      --act exact|approx --norm std|ms --lora-rank R --lora-alpha A --lora-targets q,v
"""
import argparse
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_REPO, "scripts", "formats"))
import st_io  # noqa: E402

# ReGELU2 constants (docs/architecture.md, the method)
REGELU2_A = (-0.04922261145617846, 1.0979632065417297, -0.048740595085551286)
REGELU2_C = (-3.1858810036855245, -0.001178821281161997, 3.190832613414926)

LORA_TARGETS = ("q", "k", "v", "proj", "fc1", "fc2")
HF_MODULE = {"q": "attention.attention.query", "k": "attention.attention.key",
             "v": "attention.attention.value", "proj": "attention.output.dense",
             "fc1": "intermediate.dense", "fc2": "output.dense"}


# ---------------------------------------------------------------------------------------------
# ReGELU2

def regelu2_levels():
    """{0, a1, a1+a2, a1+a2+a3} accumulated in float32, as a float32 numpy array."""
    levels = [np.float32(0.0)]
    acc = np.float32(0.0)
    for a in REGELU2_A:
        acc = np.float32(acc + np.float32(a))
        levels.append(acc)
    return np.array(levels, dtype=np.float32)


def regelu2_codes(x):
    code = torch.zeros_like(x, dtype=torch.int64)
    for c in REGELU2_C:
        code += (x > c).to(torch.int64)
    return code


def breakpoint_margins(x):
    """Per breakpoint, the smallest |x - c_i| over all elements."""
    x = x.detach().to(torch.float64)
    return [float((x - c).abs().min()) if x.numel() else math.inf for c in REGELU2_C]


def gelu_exact(x, tanh_form):
    return F.gelu(x, approximate="tanh" if tanh_form else "none")


class ReGELU2(torch.autograd.Function):
    """Exact GELU forward (erf or tanh form), 4-level step derivative backward."""

    @staticmethod
    def forward(ctx, x, tanh_form):
        ctx.save_for_backward(regelu2_codes(x))
        return gelu_exact(x, tanh_form)

    @staticmethod
    def backward(ctx, dy):
        (code,) = ctx.saved_tensors
        levels = torch.from_numpy(regelu2_levels()).to(dy.dtype)
        return dy * levels[code], None


# ---------------------------------------------------------------------------------------------
# config and weights

def _pair(v, key):
    if isinstance(v, int):
        return v, v
    if isinstance(v, (list, tuple)) and len(v) == 2:
        return int(v[0]), int(v[1])
    raise ValueError(f"config.json: {key} must be an int or [h, w], got {v!r}")


class VitConfig:
    """The fields of a Hugging Face ViT config.json that the model needs."""

    def __init__(self, d):
        def need(key):
            if key not in d:
                raise ValueError(f"config.json: missing field {key}")
            return d[key]
        self.dim = int(need("hidden_size"))
        self.hidden = int(need("intermediate_size"))
        self.n_layers = int(need("num_hidden_layers"))
        self.n_heads = int(need("num_attention_heads"))
        if self.dim % self.n_heads:
            raise ValueError("config.json: num_attention_heads does not divide hidden_size")
        self.head_dim = self.dim // self.n_heads
        self.image = _pair(need("image_size"), "image_size")
        self.patch = _pair(need("patch_size"), "patch_size")
        self.channels = int(d.get("num_channels", 3))
        self.eps = float(d.get("layer_norm_eps", 1e-12))
        self.qkv_bias = bool(d.get("qkv_bias", True))
        act = d.get("hidden_act", "gelu")
        if act not in ("gelu", "gelu_pytorch_tanh", "gelu_new"):
            raise ValueError(f"config.json: hidden_act {act!r} not supported")
        self.gelu_tanh = act != "gelu"
        self.grid = (self.image[0] // self.patch[0], self.image[1] // self.patch[1])

    @classmethod
    def from_dir(cls, model_dir):
        with open(os.path.join(model_dir, "config.json")) as f:
            return cls(json.load(f))

    def in_out(self, target):
        """(in_features, out_features) of a LoRA target linear."""
        return {"fc1": (self.dim, self.hidden), "fc2": (self.hidden, self.dim)}.get(
            target, (self.dim, self.dim))


class VitModel:
    """Config + frozen weights (Hugging Face layout) as torch tensors of one dtype."""

    def __init__(self, cfg, weights_np, dtype=torch.float64):
        self.cfg = cfg
        self.dtype = dtype
        c = cfg
        px = "vit." if "vit.embeddings.cls_token" in weights_np else ""

        def get(name, shape, optional=False):
            name = px + name
            if name not in weights_np:
                if optional:
                    return torch.zeros(shape, dtype=dtype)
                raise ValueError(f"model: missing tensor {name}")
            arr = weights_np[name]
            if tuple(arr.shape) != tuple(shape):
                raise ValueError(f"model: tensor {name} has shape {list(arr.shape)}, "
                                 f"expected {list(shape)}")
            return torch.from_numpy(np.asarray(arr, dtype=np.float64)).to(dtype)

        d = c.dim
        gh, gw = c.grid
        w = {"cls": get("embeddings.cls_token", (1, 1, d)),
             "pos": get("embeddings.position_embeddings", (1, 1 + gh * gw, d)),
             "patch_w": get("embeddings.patch_embeddings.projection.weight",
                            (d, c.channels) + c.patch),
             "patch_b": get("embeddings.patch_embeddings.projection.bias", (d,)),
             "norm_g": get("layernorm.weight", (d,)), "norm_b": get("layernorm.bias", (d,))}
        for l in range(c.n_layers):
            p = f"encoder.layer.{l}."
            for t in LORA_TARGETS:
                i, o = c.in_out(t)
                w[f"{l}.{t}.w"] = get(p + HF_MODULE[t] + ".weight", (o, i))
                w[f"{l}.{t}.b"] = get(p + HF_MODULE[t] + ".bias", (o,),
                                      optional=t in ("q", "k", "v") and not c.qkv_bias)
            w[f"{l}.ln1.g"] = get(p + "layernorm_before.weight", (d,))
            w[f"{l}.ln1.b"] = get(p + "layernorm_before.bias", (d,))
            w[f"{l}.ln2.g"] = get(p + "layernorm_after.weight", (d,))
            w[f"{l}.ln2.b"] = get(p + "layernorm_after.bias", (d,))
        self.w = w
        self._merged = None

    def hf_tensors(self, prefix="vit."):
        """The (unmerged) weights under their Hugging Face names, as float32 numpy arrays: the
        inverse of the loading above (q/k/v biases included even when qkv_bias is false)."""
        c, w = self.cfg, self.w
        out = {"embeddings.cls_token": w["cls"], "embeddings.position_embeddings": w["pos"],
               "embeddings.patch_embeddings.projection.weight": w["patch_w"],
               "embeddings.patch_embeddings.projection.bias": w["patch_b"],
               "layernorm.weight": w["norm_g"], "layernorm.bias": w["norm_b"]}
        for l in range(c.n_layers):
            p = f"encoder.layer.{l}."
            for t in LORA_TARGETS:
                out[p + HF_MODULE[t] + ".weight"] = w[f"{l}.{t}.w"]
                out[p + HF_MODULE[t] + ".bias"] = w[f"{l}.{t}.b"]
            out[p + "layernorm_before.weight"] = w[f"{l}.ln1.g"]
            out[p + "layernorm_before.bias"] = w[f"{l}.ln1.b"]
            out[p + "layernorm_after.weight"] = w[f"{l}.ln2.g"]
            out[p + "layernorm_after.bias"] = w[f"{l}.ln2.b"]
        return {prefix + k: v.detach().to(torch.float32).numpy() for k, v in out.items()}

    @classmethod
    def load(cls, model_dir, dtype=torch.float64):
        return cls(VitConfig.from_dir(model_dir),
                   st_io.load(os.path.join(model_dir, "model.safetensors")), dtype)

    def merged_weights(self):
        """MS-LN: each block norm's gamma, beta folded into its consumers; the block norms become
        parameter-free (None). The final norm is kept."""
        if self._merged is not None:
            return self._merged
        w = dict(self.w)
        for l in range(self.cfg.n_layers):
            for norm, targets in (("ln1", ("q", "k", "v")), ("ln2", ("fc1",))):
                g, b = w[f"{l}.{norm}.g"], w[f"{l}.{norm}.b"]
                for t in targets:
                    W = self.w[f"{l}.{t}.w"]
                    w[f"{l}.{t}.b"] = self.w[f"{l}.{t}.b"] + W @ b
                    w[f"{l}.{t}.w"] = W * g[None, :]
                w[f"{l}.{norm}.g"] = None
                w[f"{l}.{norm}.b"] = None
        self._merged = w
        return w


# ---------------------------------------------------------------------------------------------
# layers

def position_embedding(model, grid):
    """[1, 1 + gh*gw, d]: the checkpoint's, with the patch grid resized bicubically
    (align_corners=False, no antialias) when `grid` differs from the checkpoint's."""
    pos = model.w["pos"]
    gh0, gw0 = model.cfg.grid
    if tuple(grid) == (gh0, gw0):
        return pos
    d = pos.shape[-1]
    patch = pos[:, 1:].reshape(1, gh0, gw0, d).permute(0, 3, 1, 2)
    patch = F.interpolate(patch, size=tuple(grid), mode="bicubic", align_corners=False)
    patch = patch.permute(0, 2, 3, 1).reshape(1, grid[0] * grid[1], d)
    return torch.cat([pos[:, :1], patch], dim=1)


def lora_linear(x, W, b, lora, scale, xa=None):
    """y = x W^T + b + scale * (xa A^T) B^T; lora is (A [r, in], B [out, r]) or None; the
    adapter's input xa defaults to x."""
    y = x @ W.t() + b
    if lora is not None:
        A, B = lora
        y = y + scale * (((x if xa is None else xa) @ A.t()) @ B.t())
    return y


def attention(q, k, v):
    """Bidirectional softmax attention, q/k/v [B, H, T, hd]."""
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return torch.softmax(scores, dim=-1) @ v


def forward(model, pixels, lora, scale, head, act="exact", norm="std", stats=None, weights=None, ms_lora="exact",
            dropout=None):
    """Logits [B, K] for normalised pixels [B, C, H, W].

    lora: dict (layer, target) -> (A, B); head: (W [K, d], b [K]). stats, if a dict, receives
    "fc1_preact": the list of per-layer GELU inputs. weights: the weight dict to use instead of
    the model's (merged under norm="ms"), e.g. with leaves that need gradients (full FT). ms_lora:
    what the adapters of the merged linears see under norm="ms": "exact" gamma*z + beta, "merged" z."""
    c = model.cfg
    if act not in ("exact", "approx"):
        raise ValueError(f"act must be exact|approx, got {act!r}")
    if norm not in ("std", "ms"):
        raise ValueError(f"norm must be std|ms, got {norm!r}")
    if ms_lora not in ("exact", "merged"):
        raise ValueError(f"ms_lora must be exact|merged, got {ms_lora!r}")
    see_affine = norm == "ms" and ms_lora == "exact"
    w = weights if weights is not None else (model.merged_weights() if norm == "ms" else model.w)
    B, C, H, W = pixels.shape
    ph, pw = c.patch
    if C != c.channels or H % ph or W % pw:
        raise ValueError(f"pixels {list(pixels.shape)} do not fit channels {c.channels} / "
                         f"patch {ph}x{pw}")
    grid = (H // ph, W // pw)
    x = F.conv2d(pixels, w["patch_w"], w["patch_b"], stride=(ph, pw))  # [B, d, gh, gw]
    x = x.flatten(2).transpose(1, 2)
    x = torch.cat([w["cls"].expand(B, 1, c.dim), x], dim=1)
    # "pos_ft": the positions at this resolution as a leaf of their own (full fine-tuning trains them)
    x = x + (w["pos_ft"] if "pos_ft" in w else position_embedding(model, grid))
    T = x.shape[1]
    hs = []
    for l in range(c.n_layers):
        def lin(t, inp, ln=None):
            # behind an MS-LN (ms_lora "exact") the adapter sees the original input gamma*z + beta
            xa = inp * model.w[f"{l}.{ln}.g"] + model.w[f"{l}.{ln}.b"] if see_affine and ln else None
            if dropout is not None and lora.get((l, t)) is not None:  # LoRA dropout: (layer, target, input) -> dropped
                xa = dropout(l, t, inp if xa is None else xa)
            return lora_linear(inp, w[f"{l}.{t}.w"], w[f"{l}.{t}.b"], lora.get((l, t)), scale, xa)

        def heads(y):
            return y.view(B, T, c.n_heads, c.head_dim).transpose(1, 2)
        z = F.layer_norm(x, (c.dim,), w[f"{l}.ln1.g"], w[f"{l}.ln1.b"], c.eps)
        o = attention(heads(lin("q", z, "ln1")), heads(lin("k", z, "ln1")), heads(lin("v", z, "ln1")))
        x = x + lin("proj", o.transpose(1, 2).reshape(B, T, c.dim))
        z2 = F.layer_norm(x, (c.dim,), w[f"{l}.ln2.g"], w[f"{l}.ln2.b"], c.eps)
        h = lin("fc1", z2, "ln2")
        hs.append(h.detach())
        g = ReGELU2.apply(h, c.gelu_tanh) if act == "approx" else gelu_exact(h, c.gelu_tanh)
        x = x + lin("fc2", g)
    if stats is not None:
        stats["fc1_preact"] = hs
    x = F.layer_norm(x, (c.dim,), w["norm_g"], w["norm_b"], c.eps)
    return x[:, 0] @ head[0].t() + head[1]


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
    """Run one case through the reference. ms_lora: under norm="ms", the adapters see
    gamma*z + beta ("exact") or z ("merged", the paper's). dropout: LoRA dropout while training,
    a function (layer, target, adapter input [B, T, in]) -> that input after dropout, or None.

    full: full fine-tuning: no adapters (the case's are ignored); the gradients are those of
    every weight (of the merged model under norm="ms"), besides the head's: "grad.{l}.{t}.W" and
    "grad.{l}.{t}.b" of each linear (no key bias, whose gradient is zero, and no q, v bias for a
    model without them, unless MS-LN merged a beta into it), "grad.{l}.ln1.g" / ln1.b / ln2.g / ln2.b (norm="std"),
    "grad.patch_w", "grad.patch_b", "grad.cls", "grad.pos" (the positions at the case's
    resolution), "grad.norm_g", "grad.norm_b".

    model_dir: a model directory or an already loaded VitModel. case: a CASE path or dict.
    Returns the OUT names as float64 numpy arrays plus "stats": {"min_margin": smallest distance
    of any GELU input to a ReGELU2 breakpoint, "margins", "code_counts"}.
    """
    model = model_dir if isinstance(model_dir, VitModel) else VitModel.load(model_dir, dtype)
    dtype = model.dtype
    if isinstance(case, (str, os.PathLike)):
        case = st_io.load(case)
    c = model.cfg
    targets = parse_targets(targets)
    pixels = torch.from_numpy(np.asarray(case["pixels"], dtype=np.float64)).to(dtype)
    labels = torch.from_numpy(np.asarray(case["labels"], dtype=np.int64))
    hw = torch.from_numpy(np.asarray(case["head.weight"], dtype=np.float64)).to(dtype)
    hb = torch.from_numpy(np.asarray(case["head.bias"], dtype=np.float64)).to(dtype)
    if hw.shape[1] != c.dim or hb.shape != (hw.shape[0],):
        raise ValueError(f"case: head.weight {list(hw.shape)} / head.bias {list(hb.shape)}")
    if int(labels.min()) < 0 or int(labels.max()) >= hw.shape[0]:
        raise ValueError("case: labels outside [0, classes)")
    hw.requires_grad_(True)
    hb.requires_grad_(True)
    lora = {}
    rank = None
    for l in range(c.n_layers):
        for t in ([] if full else targets):
            A = np.asarray(case[f"lora.{l}.{t}.A"], dtype=np.float64)
            Bm = np.asarray(case[f"lora.{l}.{t}.B"], dtype=np.float64)
            i, o = c.in_out(t)
            r = A.shape[0]
            if A.shape != (r, i) or Bm.shape != (o, r):
                raise ValueError(f"case: lora.{l}.{t} shapes A {A.shape} B {Bm.shape}, "
                                 f"expected [r, {i}] and [{o}, r]")
            rank = r if rank is None else rank
            if r != rank or (lora_rank is not None and r != lora_rank):
                raise ValueError(f"case: lora.{l}.{t} has rank {r}")
            lora[(l, t)] = (torch.from_numpy(A).to(dtype).requires_grad_(True),
                            torch.from_numpy(Bm).to(dtype).requires_grad_(True))
    if rank is None:
        rank = lora_rank or 1
    alpha = float(lora_alpha) if lora_alpha is not None else float(rank)
    scale = alpha / rank

    stats = {}
    weights = None
    full_names = []
    if full:  # every weight becomes a leaf that needs a gradient
        weights = dict(model.merged_weights() if norm == "ms" else model.w)
        grid = (pixels.shape[2] // c.patch[0], pixels.shape[3] // c.patch[1])
        weights["pos_ft"] = position_embedding(model, grid).detach()
        for l in range(c.n_layers):
            for t in LORA_TARGETS:
                full_names.append(f"{l}.{t}.w")
                # the key bias is not trained (its gradient is zero: softmax is shift invariant)
                if t not in ("q", "k", "v") or (t != "k" and (c.qkv_bias or norm == "ms")):
                    full_names.append(f"{l}.{t}.b")
            if norm == "std":
                full_names += [f"{l}.ln1.g", f"{l}.ln1.b", f"{l}.ln2.g", f"{l}.ln2.b"]
        full_names += ["patch_w", "patch_b", "cls", "pos_ft", "norm_g", "norm_b"]
        for k in full_names:
            weights[k] = weights[k].clone().requires_grad_(True)
    logits = forward(model, pixels, lora, scale, (hw, hb), act, norm, stats, weights, ms_lora, dropout)
    loss = F.cross_entropy(logits, labels)
    params = [weights[k] for k in full_names] + [p for ab in lora.values() for p in ab] + [hw, hb]
    grads = torch.autograd.grad(loss, params)

    out = {"logits": logits.detach().to(torch.float64).numpy(),
           "loss": np.array([float(loss)], dtype=np.float64)}
    gi = iter(grads)
    for k in full_names:  # the probe's names: grad.{l}.{t}.W / .b, grad.{l}.ln1.g, grad.pos ...
        name = k[:-2] + ".W" if k.endswith(".w") else "pos" if k == "pos_ft" else k
        out["grad." + name] = next(gi).to(torch.float64).numpy()
    for (l, t) in lora:
        out[f"grad.lora.{l}.{t}.A"] = next(gi).to(torch.float64).numpy()
        out[f"grad.lora.{l}.{t}.B"] = next(gi).to(torch.float64).numpy()
    out["grad.head.weight"] = next(gi).to(torch.float64).numpy()
    out["grad.head.bias"] = next(gi).to(torch.float64).numpy()
    h = torch.cat([x.reshape(-1) for x in stats["fc1_preact"]])
    codes = regelu2_codes(h)
    margins = breakpoint_margins(h)
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
    ap.add_argument("--full", action="store_true", help="full fine-tuning: gradients of every linear weight")
    a = ap.parse_args(argv)
    res = run_case(a.model, a.case, a.act, a.norm, a.lora_rank, a.lora_alpha, a.lora_targets,
                   torch.float64 if a.dtype == "float64" else torch.float32, a.full, a.ms_lora)
    stats = res.pop("stats")
    st_io.save(a.out, {k: v.astype(np.float32) for k, v in res.items()})
    print(f"loss {float(res['loss'][0]):.6f} min_breakpoint_margin {stats['min_margin']:.3g} "
          f"codes {stats['code_counts']}")


if __name__ == "__main__":
    main()
