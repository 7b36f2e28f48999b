"""Helpers for the ViT tests: small random model directories (Hugging Face or timm layout), random
cases (pixels, labels, LoRA adapters, head), image shards, running build/test/vit_probe and train_vit,
and comparing the probe's output with the PyTorch reference (test/model/reference_vit.py).

Case contract (see test/model/reference_vit.py): "pixels" F32 [B, C, H, W], "labels" I32 [B],
"lora.{l}.{t}.A" F32 [r, in], "lora.{l}.{t}.B" F32 [out, r], "head.weight" [K, d], "head.bias" [K].
"""
import json
import os
import shlex
import struct
import subprocess
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the Python tools the tests exercise: file formats, data preparation, exporters
sys.path[:0] = [os.path.join(REPO, "scripts", d) for d in ("formats", "data", "export")]
import reference_vit as ref  # noqa: E402
import st_io  # noqa: E402
import probe_compare  # noqa: E402
from probe_compare import compare, rel_to_max  # noqa: E402,F401  (used by the tests through this module)

ALL_TARGETS = ref.LORA_TARGETS

# Small random configs, odd sizes on purpose.
CONFIGS = {
    # square 4x4 patch grid, RGB, erf GELU, layer_norm_eps left to the default (1e-12)
    "square": dict(hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=3,
                   image_size=16, patch_size=4, num_channels=3, hidden_act="gelu"),
    # non-square 3x5 grid (12x20 images), odd width 33 with odd head_dim 11, grayscale, tanh GELU,
    # no q/k/v biases in the checkpoint
    "nonsquare": dict(hidden_size=33, intermediate_size=50, num_hidden_layers=2,
                      num_attention_heads=3, image_size=[12, 20], patch_size=4, num_channels=1,
                      layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh", qkv_bias=False),
}
# batch, LoRA rank, alpha, classes per config
SHAPES = {"square": (3, 4, 8.0, 5), "nonsquare": (2, 3, 6.0, 7)}

# fp32 probe vs fp64 reference
TOL = {"logits": 2e-5, "loss": 1e-5, "grad": 2e-4}
# approx mode: a GELU input closer than this to a ReGELU2 breakpoint could get another code in fp32
# than in fp64; cases are re-drawn until none is, in both norm modes and under the paper's
# --ms-lora merged (whose pre-activations differ: the same LoRA A sees z there, gamma*z+beta in std
# and in ms with the default --ms-lora exact).
BREAKPOINT_MARGIN = 2e-4


def model_config(name, **overrides):
    d = dict(CONFIGS[name])
    d.update(model_type="vit", architectures=["ViTForImageClassification"], torch_dtype="float32")
    d.update(overrides)
    return d


def random_hf_weights(cfg, seed=0):
    """Random weights of a ViT in the Hugging Face layout, without the "vit." prefix.

    Linear weights ~ N(0, 0.1) with every 4th fc1 row at std 0.6 (so GELU inputs reach the outer
    ReGELU2 breakpoints, +-3.19, as well as the middle one); LayerNorm gamma 1 + 0.3 N, beta 0.3 N
    (so merging them matters); biases 0.1 N."""
    rng = np.random.default_rng(seed)

    def normal(shape, std):
        return (std * rng.standard_normal(shape)).astype(np.float32)

    d = cfg.dim
    gh, gw = cfg.grid
    t = {"embeddings.cls_token": normal((1, 1, d), 0.5),
         "embeddings.position_embeddings": normal((1, 1 + gh * gw, d), 0.5),
         "embeddings.patch_embeddings.projection.weight": normal((d, cfg.channels) + cfg.patch, 0.2),
         "embeddings.patch_embeddings.projection.bias": normal((d,), 0.1),
         "layernorm.weight": (1.0 + normal((d,), 0.3)), "layernorm.bias": normal((d,), 0.3)}
    for l in range(cfg.n_layers):
        p = f"encoder.layer.{l}."
        for tg, module in ref.HF_MODULE.items():
            i, o = cfg.in_out(tg)
            w = normal((o, i), 0.1)
            if tg == "fc1":
                w[::4] *= 6.0
            t[p + module + ".weight"] = w
            if cfg.qkv_bias or tg not in ("q", "k", "v"):
                t[p + module + ".bias"] = normal((o,), 0.1)
        for nm in ("layernorm_before", "layernorm_after"):
            t[p + nm + ".weight"] = 1.0 + normal((d,), 0.3)
            t[p + nm + ".bias"] = normal((d,), 0.3)
    return t


def hf_to_timm(cfg, hf):
    """The same weights under timm's names (q, k, v fused into attn.qkv, rows in that order)."""
    t = {"cls_token": hf["embeddings.cls_token"],
         "pos_embed": hf["embeddings.position_embeddings"],
         "patch_embed.proj.weight": hf["embeddings.patch_embeddings.projection.weight"],
         "patch_embed.proj.bias": hf["embeddings.patch_embeddings.projection.bias"],
         "norm.weight": hf["layernorm.weight"], "norm.bias": hf["layernorm.bias"]}
    for l in range(cfg.n_layers):
        p, b = f"encoder.layer.{l}.", f"blocks.{l}."
        t[b + "norm1.weight"] = hf[p + "layernorm_before.weight"]
        t[b + "norm1.bias"] = hf[p + "layernorm_before.bias"]
        t[b + "norm2.weight"] = hf[p + "layernorm_after.weight"]
        t[b + "norm2.bias"] = hf[p + "layernorm_after.bias"]
        t[b + "attn.qkv.weight"] = np.concatenate(
            [hf[p + ref.HF_MODULE[x] + ".weight"] for x in ("q", "k", "v")], axis=0)
        if cfg.qkv_bias:
            t[b + "attn.qkv.bias"] = np.concatenate(
                [hf[p + ref.HF_MODULE[x] + ".bias"] for x in ("q", "k", "v")], axis=0)
        for tg, name in (("proj", "attn.proj"), ("fc1", "mlp.fc1"), ("fc2", "mlp.fc2")):
            t[b + name + ".weight"] = hf[p + ref.HF_MODULE[tg] + ".weight"]
            t[b + name + ".bias"] = hf[p + ref.HF_MODULE[tg] + ".bias"]
    return t


def write_model(model_dir, config, seed=0, layout="hf", preprocessor=None, drop=None,
                reshape=None):
    """Write config.json + model.safetensors (F32) for a random ViT of the given config dict.

    layout: "hf" (vit.* keys and a classifier of another size, which must be ignored),
    "hf_bare" (no "vit." prefix, as ViTModel saves), or "timm". preprocessor: dict written as
    preprocessor_config.json. drop / reshape: a tensor name to leave out / {name: new shape}
    (bad-input tests). Returns the reference config."""
    os.makedirs(model_dir, exist_ok=True)
    cfg = ref.VitConfig(config)
    hf = random_hf_weights(cfg, seed)
    if layout == "timm":
        t = hf_to_timm(cfg, hf)
        t["head.weight"] = np.zeros((3, cfg.dim), np.float32)
        t["head.bias"] = np.zeros((3,), np.float32)
    else:
        px = "vit." if layout == "hf" else ""
        t = {px + k: v for k, v in hf.items()}
        if layout == "hf":
            t["classifier.weight"] = np.ones((1000, cfg.dim), np.float32)
            t["classifier.bias"] = np.ones((1000,), np.float32)
    if drop:
        del t[drop]
    for name, shape in (reshape or {}).items():
        t[name] = np.zeros(shape, np.float32)
    st_io.save(os.path.join(model_dir, "model.safetensors"), t, metadata={"format": "pt"})
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    if preprocessor is not None:
        with open(os.path.join(model_dir, "preprocessor_config.json"), "w") as f:
            json.dump(preprocessor, f, indent=1)
    return cfg


def make_case(cfg, batch, rank, classes, targets=ALL_TARGETS, seed=0, image=None):
    """Random normalised pixels [B, C, H, W] (H, W = image or the checkpoint's), labels including
    the last class, random LoRA A and nonzero B for every layer and target, a random head."""
    rng = np.random.default_rng(seed)
    H, W = image or cfg.image
    case = {"pixels": rng.standard_normal((batch, cfg.channels, H, W)).astype(np.float32),
            "labels": rng.integers(0, classes, size=batch).astype(np.int32)}
    case["labels"][-1] = classes - 1
    for l in range(cfg.n_layers):
        for t in ref.parse_targets(targets):
            i, o = cfg.in_out(t)
            case[f"lora.{l}.{t}.A"] = (rng.standard_normal((rank, i)) / np.sqrt(i)).astype(np.float32)
            case[f"lora.{l}.{t}.B"] = (0.1 * rng.standard_normal((o, rank))).astype(np.float32)
    case["head.weight"] = (0.3 * rng.standard_normal((classes, cfg.dim))).astype(np.float32)
    case["head.bias"] = (0.1 * rng.standard_normal(classes)).astype(np.float32)
    return case


def make_safe_case(model, batch, rank, alpha, classes, targets=ALL_TARGETS, seed=0, image=None,
                   tries=50):
    """make_case, re-drawn (seed, seed+1000, ...) until no GELU input is near a ReGELU2 breakpoint
    in either norm mode (and the paper's --ms-lora merged, where the adapters see z). Returns (case,
    seed used, {norm: stats})."""
    for k in range(tries):
        s = seed + 1000 * k
        case = make_case(model.cfg, batch, rank, classes, targets, s, image)
        stats = {norm: ref.run_case(model, case, "exact", norm, rank, alpha, targets)["stats"]
                 for norm in ("std", "ms")}
        stats["ms-merged"] = ref.run_case(model, case, "exact", "ms", rank, alpha, targets, ms_lora="merged")["stats"]
        if all(st["min_margin"] > BREAKPOINT_MARGIN for st in stats.values()):
            return case, s, stats
    raise RuntimeError("could not draw a case away from the ReGELU2 breakpoints")


# ---------------------------------------------------------------------------------------------
# image shards (the format of llmc/vision/imagedata.h, written independently of prepare_images.py)

def shard_bytes(images, labels, classes, version=1, magic=b"IMGS"):
    """images uint8 [n, H, W, C], labels [n] -> the shard's bytes."""
    images = np.ascontiguousarray(images, dtype=np.uint8)
    n, H, W, C = images.shape
    head = magic + struct.pack("<6I", version, n, H, W, C, classes)
    head += b"\0" * (64 - len(head))
    return head + images.tobytes() + np.asarray(labels, dtype="<u2").tobytes()


def write_shard(path, images, labels, classes, **kw):
    with open(path, "wb") as f:
        f.write(shard_bytes(images, labels, classes, **kw))
    return path


# ---------------------------------------------------------------------------------------------
# running the binaries

def binary(name, env_var):
    exe = os.environ.get(env_var, os.path.join(REPO, name))
    if not os.path.isfile(exe):
        raise AssertionError(f"{exe} is missing: build it with `make {name}`")
    return exe


def run(cmd, timeout=300, check=True):
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "2")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and p.returncode != 0:
        raise AssertionError(f"failed (exit {p.returncode}): {' '.join(map(str, cmd))}\n"
                             f"stdout: {p.stdout[-2000:]}\nstderr: {p.stderr[-2000:]}")
    return p


def run_probe(model_dir, case_path, out_path, act, norm, recompute, rank, alpha,
              targets=ALL_TARGETS, extra=(), ms_lora="exact"):
    """Run build/test/vit_probe on a case and return its OUT tensors. VIT_PROBE overrides the probe's
    path; VIT_PROBE_ARGS appends flags to every run."""
    cmd = [binary("build/test/vit_probe", "VIT_PROBE"), "--model", str(model_dir), "--case",
           str(case_path), "--out-file", str(out_path), "--act", act, "--norm", norm,
           "--recompute", recompute, "--ms-lora", ms_lora, "--lora-rank", str(rank), "--lora-alpha", repr(float(alpha)),
           "--lora-targets", ",".join(ref.parse_targets(targets))] + list(extra)
    cmd += shlex.split(os.environ.get("VIT_PROBE_ARGS", ""))
    run(cmd)
    return st_io.load(str(out_path))


def train_vit(*args, check=True, timeout=300):
    return run([binary("train_vit", "TRAIN_VIT")] + [str(a) for a in args], timeout, check)


# ---------------------------------------------------------------------------------------------
# comparing

def check_errors(errs, label=""):
    """Print the worst errors on one line and assert them against TOL."""
    return probe_compare.check_errors(errs, TOL, label)
