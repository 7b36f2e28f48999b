#!/usr/bin/env python3
"""Convert a timm (or Hugging Face) ViT state dict into a model directory that train_vit reads:
config.json + model.safetensors in the Hugging Face ViTForImageClassification layout
(vit.embeddings..., vit.encoder.layer.N...) + preprocessor_config.json (image_mean, image_std).

Input: a .pth/.pt/.bin file (torch.load(weights_only=True): tensors only, never pickled code; a
"state_dict" or "model" entry is unwrapped), a .npz (no object arrays),
or a .safetensors file, holding either
  timm names:  cls_token, pos_embed, patch_embed.proj.{weight,bias}, blocks.N.norm1, blocks.N.attn.qkv
               (fused [3d, d]: q, k, v rows in that order), blocks.N.attn.proj, blocks.N.norm2,
               blocks.N.mlp.fc1, blocks.N.mlp.fc2, norm, head (optional)
  or Hugging Face names (vit.* or without the prefix, classifier optional): copied as they are.
The architecture is read off the tensor shapes; what shapes cannot tell comes from flags:
--heads (default hidden/64), --image-size (default: the square grid of pos_embed times the patch
size), --eps (timm: 1e-6), --act, --mean/--std (timm's ViT-B/16 ImageNet-21k weights: 0.5).
A class-token ViT only: timm models with global average pooling (fc_norm), register tokens or
no class token are refused.

  /usr/bin/python3 scripts/export/export_vit.py --input vit_base_patch16_224.pth --out models/vit-b16
"""
import argparse
import json
import os
import re
import sys

import numpy as np

# sibling modules in scripts/<folder>/
SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(SCRIPTS, d) for d in ("formats",)]
import model_dir  # noqa: E402
import st_io  # noqa: E402


class ExportError(Exception):
    pass


def load_state(path):
    """name -> float32 numpy array (other dtypes kept)."""
    if path.endswith(".npz"):
        with np.load(path, allow_pickle=False) as z:  # object arrays would be unpickled
            return {k: z[k] for k in z.files}
    if path.endswith(".safetensors"):
        return st_io.load(path)
    import pickle
    import torch  # only the .pth route needs it
    # weights_only: tensors and plain containers only. A full unpickle would run whatever code the
    # file names (a downloaded checkpoint's __reduce__); what weights_only refuses is refused here.
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError, EOFError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ExportError(f"not a plain tensor state dict (loaded with torch.load(weights_only=True), which "
                          f"refuses pickled code and objects; convert it to .safetensors): {reason}") from None
    for key in ("state_dict", "model", "model_state"):
        if isinstance(obj, dict) and key in obj and isinstance(obj[key], dict):
            obj = obj[key]
    if not isinstance(obj, dict):
        raise ExportError(f"{path}: expected a state dict, got {type(obj).__name__}")
    out = {}
    for k, v in obj.items():
        if hasattr(v, "detach"):
            v = v.detach()
            out[k] = (v.float() if v.is_floating_point() else v).numpy()
    return out


def _need(state, name, shape=None):
    if name not in state:
        raise ExportError(f"missing tensor {name}")
    a = np.asarray(state[name])
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ExportError(f"tensor {name} has shape {list(a.shape)}, expected {list(shape)}")
    return a.astype(np.float32)


def timm_to_hf(state, heads=None):
    """(Hugging Face tensors with the vit. prefix, facts read off the shapes)."""
    for bad in ("fc_norm.weight", "reg_token"):
        if bad in state:
            raise ExportError(f"tensor {bad}: global-pool / register-token ViTs are not supported")
    cls = _need(state, "cls_token")
    if cls.ndim != 3 or cls.shape[:2] != (1, 1):
        raise ExportError(f"cls_token has shape {list(cls.shape)}, expected [1, 1, d]")
    d = cls.shape[2]
    pw = _need(state, "patch_embed.proj.weight")
    if pw.ndim != 4 or pw.shape[0] != d:
        raise ExportError(f"patch_embed.proj.weight has shape {list(pw.shape)}, expected [{d}, C, p, p]")
    layers = 1 + max((int(m.group(1)) for k in state for m in [re.match(r"blocks\.(\d+)\.", k)] if m),
                     default=-1)
    if layers < 1:
        raise ExportError("no blocks.N.* tensors")
    f = _need(state, "blocks.0.mlp.fc1.weight").shape[0]
    pos = _need(state, "pos_embed")
    if pos.ndim != 3 or pos.shape[0] != 1 or pos.shape[2] != d:
        raise ExportError(f"pos_embed has shape {list(pos.shape)}, expected [1, 1 + patches, {d}]")
    hf = {"vit.embeddings.cls_token": cls, "vit.embeddings.position_embeddings": pos,
          "vit.embeddings.patch_embeddings.projection.weight": pw,
          "vit.embeddings.patch_embeddings.projection.bias": _need(state, "patch_embed.proj.bias", (d,)),
          "vit.layernorm.weight": _need(state, "norm.weight", (d,)),
          "vit.layernorm.bias": _need(state, "norm.bias", (d,))}
    qkv_bias = "blocks.0.attn.qkv.bias" in state
    for l in range(layers):
        b, p = f"blocks.{l}.", f"vit.encoder.layer.{l}."
        hf[p + "layernorm_before.weight"] = _need(state, b + "norm1.weight", (d,))
        hf[p + "layernorm_before.bias"] = _need(state, b + "norm1.bias", (d,))
        hf[p + "layernorm_after.weight"] = _need(state, b + "norm2.weight", (d,))
        hf[p + "layernorm_after.bias"] = _need(state, b + "norm2.bias", (d,))
        qkv = _need(state, b + "attn.qkv.weight", (3 * d, d))
        qkv_b = _need(state, b + "attn.qkv.bias", (3 * d,)) if qkv_bias else None
        for i, name in enumerate(("query", "key", "value")):
            hf[p + f"attention.attention.{name}.weight"] = qkv[i * d:(i + 1) * d]
            if qkv_b is not None:
                hf[p + f"attention.attention.{name}.bias"] = qkv_b[i * d:(i + 1) * d]
        for src, dst, shape in (("attn.proj", "attention.output.dense", (d, d)),
                                ("mlp.fc1", "intermediate.dense", (f, d)),
                                ("mlp.fc2", "output.dense", (d, f))):
            hf[p + dst + ".weight"] = _need(state, b + src + ".weight", shape)
            hf[p + dst + ".bias"] = _need(state, b + src + ".bias", shape[:1])
    if "head.weight" in state:
        hf["classifier.weight"] = _need(state, "head.weight")
        hf["classifier.bias"] = _need(state, "head.bias")
    facts = {"dim": d, "hidden": f, "layers": layers, "channels": pw.shape[1],
             "patch": list(pw.shape[2:]), "positions": pos.shape[1] - 1, "qkv_bias": qkv_bias}
    return hf, facts


def hf_facts(state):
    """The same facts for a state dict already in the Hugging Face layout (prefix added)."""
    if "embeddings.cls_token" in state:
        state = {(k if k.startswith("classifier.") else "vit." + k): v for k, v in state.items()}
    cls = _need(state, "vit.embeddings.cls_token")
    pw = _need(state, "vit.embeddings.patch_embeddings.projection.weight")
    pos = _need(state, "vit.embeddings.position_embeddings")
    layers = 1 + max(int(m.group(1)) for k in state
                     for m in [re.match(r"vit\.encoder\.layer\.(\d+)\.", k)] if m)
    return state, {"dim": cls.shape[2], "hidden": state["vit.encoder.layer.0.intermediate.dense.weight"].shape[0],
                   "layers": layers, "channels": pw.shape[1], "patch": list(pw.shape[2:]),
                   "positions": pos.shape[1] - 1,
                   "qkv_bias": "vit.encoder.layer.0.attention.attention.query.bias" in state}


def make_config(facts, heads=None, image_size=None, eps=1e-6, act="gelu"):
    d = facts["dim"]
    heads = heads or max(1, d // 64)
    if d % heads:
        raise ExportError(f"--heads {heads} does not divide the width {d}")
    ph, pw = facts["patch"]
    if image_size is None:
        g = int(round(facts["positions"] ** 0.5))
        if g * g != facts["positions"]:
            raise ExportError(f"{facts['positions']} patch positions are not a square grid; "
                              f"give --image-size HxW")
        image_size = (g * ph, g * pw)
    gh, gw = image_size[0] // ph, image_size[1] // pw
    if image_size[0] % ph or image_size[1] % pw or gh * gw != facts["positions"]:
        raise ExportError(f"--image-size {image_size[0]}x{image_size[1]} with patch {ph}x{pw} "
                          f"does not give the checkpoint's {facts['positions']} positions")
    return {"architectures": ["ViTForImageClassification"], "model_type": "vit",
            "hidden_size": d, "intermediate_size": facts["hidden"],
            "num_hidden_layers": facts["layers"], "num_attention_heads": heads,
            "image_size": image_size[0] if image_size[0] == image_size[1] else list(image_size),
            "patch_size": ph if ph == pw else [ph, pw], "num_channels": facts["channels"],
            "layer_norm_eps": eps, "hidden_act": act, "qkv_bias": facts["qkv_bias"],
            "torch_dtype": "float32"}


def _write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def export(state, out_dir, heads=None, image_size=None, eps=1e-6, act="gelu", mean=(0.5,),
           std=(0.5,), bf16=False):
    if any(k.startswith("blocks.") for k in state):
        hf, facts = timm_to_hf(state, heads)
    else:
        hf, facts = hf_facts(state)
    config = make_config(facts, heads, image_size, eps, act)
    C = facts["channels"]
    mean = list(mean) * C if len(mean) == 1 else list(mean)
    std = list(std) * C if len(std) == 1 else list(std)
    if len(mean) != C or len(std) != C or min(std) <= 0:
        raise ExportError(f"--mean/--std: need 1 or {C} values, std positive")
    try:
        with model_dir.staged(out_dir) as stage:  # whole or not at all, replacing an earlier export whole
            _write_files(stage, hf, config, mean, std, bf16)
    except model_dir.ModelDirError as e:
        raise ExportError(str(e)) from None
    return config


def _write_files(out_dir, hf, config, mean, std, bf16):
    st_io.save(os.path.join(out_dir, "model.safetensors"), hf, metadata={"format": "pt"}, bf16=bf16)
    _write_json(os.path.join(out_dir, "config.json"), config)
    _write_json(os.path.join(out_dir, "preprocessor_config.json"),
                {"image_processor_type": "ViTImageProcessor", "do_resize": True,
                 "do_rescale": True, "do_normalize": True, "image_mean": mean, "image_std": std,
                 "size": {"height": config["image_size"] if isinstance(config["image_size"], int)
                          else config["image_size"][0],
                          "width": config["image_size"] if isinstance(config["image_size"], int)
                          else config["image_size"][1]}})


def _floats(text):
    return [float(x) for x in text.split(",")]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", required=True, help=".pth/.pt/.bin, .npz or .safetensors state dict")
    ap.add_argument("--out", required=True, help="output model directory")
    ap.add_argument("--heads", type=int, help="attention heads (default hidden/64)")
    ap.add_argument("--image-size", help="pretraining resolution HxW or S (default from pos_embed)")
    ap.add_argument("--eps", type=float, default=1e-6, help="LayerNorm epsilon (timm: 1e-6)")
    ap.add_argument("--act", choices=("gelu", "gelu_pytorch_tanh"), default="gelu")
    ap.add_argument("--mean", type=_floats, default=[0.5], help="per-channel mean, comma list")
    ap.add_argument("--std", type=_floats, default=[0.5], help="per-channel std, comma list")
    ap.add_argument("--bf16", action="store_true", help="store weights as BF16")
    a = ap.parse_args(argv)
    try:
        size = None
        if a.image_size:
            parts = [int(x) for x in a.image_size.lower().split("x")]
            size = (parts[0], parts[-1])
        state = load_state(a.input)
        config = export(state, a.out, a.heads, size, a.eps, a.act, a.mean, a.std, a.bf16)
    except (ExportError, OSError, ValueError) as e:
        print(f"error: {a.input}: {e}", file=sys.stderr)
        return 1
    print(f"wrote {a.out}: d={config['hidden_size']} f={config['intermediate_size']} "
          f"layers={config['num_hidden_layers']} heads={config['num_attention_heads']} "
          f"image {config['image_size']} patch {config['patch_size']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
