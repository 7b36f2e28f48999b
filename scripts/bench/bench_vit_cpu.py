#!/usr/bin/env python3
"""Time one LoRA training step (forward + backward + AdamW on the adapters and the head) of a ViT
classifier in PyTorch on the CPU: the side-by-side baseline for train_vit's CPU backend.

Prints one machine-readable line on stdout:
    pytorch step_ms=<median ms per step> img_s=<batch / median step time>
(details go to stderr). The model is random (seeded) unless --model DIR loads one; --write-model DIR
writes that random model as a Hugging Face directory so train_vit can be timed on the same config,
and --write-data FILE writes a random image shard at the model's resolution for it.

    /usr/bin/python3 scripts/bench/bench_vit_cpu.py --threads 2
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

# sibling modules: scripts/<folder>/ (and the PyTorch references in test/model/)
SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(SCRIPTS, d) for d in ("formats", "data", "../test/model",)]
import prepare_images as pi  # noqa: E402
import reference_vit as ref  # noqa: E402
import st_io  # noqa: E402


def bench_config(a):
    return {"model_type": "vit", "architectures": ["ViTForImageClassification"],
            "hidden_size": a.dim, "intermediate_size": a.hidden, "num_hidden_layers": a.layers,
            "num_attention_heads": a.heads, "image_size": a.image, "patch_size": a.patch,
            "num_channels": 3, "layer_norm_eps": 1e-6, "hidden_act": "gelu", "qkv_bias": True,
            "torch_dtype": "float32"}


def random_weights(cfg, seed):
    """HF-layout weights: linears N(0, 0.02), LayerNorm gamma 1 + 0.1 N, beta 0.1 N."""
    rng = np.random.default_rng(seed)

    def normal(shape, std):
        return (std * rng.standard_normal(shape)).astype(np.float32)

    d, (gh, gw) = cfg.dim, cfg.grid
    t = {"vit.embeddings.cls_token": normal((1, 1, d), 0.02),
         "vit.embeddings.position_embeddings": normal((1, 1 + gh * gw, d), 0.02),
         "vit.embeddings.patch_embeddings.projection.weight": normal((d, 3) + cfg.patch, 0.02),
         "vit.embeddings.patch_embeddings.projection.bias": normal((d,), 0.02),
         "vit.layernorm.weight": 1 + normal((d,), 0.1), "vit.layernorm.bias": normal((d,), 0.1)}
    for l in range(cfg.n_layers):
        p = f"vit.encoder.layer.{l}."
        for tg, module in ref.HF_MODULE.items():
            i, o = cfg.in_out(tg)
            t[p + module + ".weight"] = normal((o, i), 0.02)
            t[p + module + ".bias"] = normal((o,), 0.02)
        for nm in ("layernorm_before", "layernorm_after"):
            t[p + nm + ".weight"] = 1 + normal((d,), 0.1)
            t[p + nm + ".bias"] = normal((d,), 0.1)
    return t


def main(argv=None):
    ap = argparse.ArgumentParser(description="PyTorch CPU ViT LoRA step benchmark")
    ap.add_argument("--model", help="load this model directory instead of a random one")
    ap.add_argument("--dim", type=int, default=192)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--image", type=int, default=64)
    ap.add_argument("--patch", type=int, default=8)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lora-rank", type=int, default=4)
    ap.add_argument("--lora-alpha", type=float, default=8.0)
    ap.add_argument("--lora-targets", default=",".join(ref.LORA_TARGETS))
    ap.add_argument("--act", choices=("exact", "approx"), default="exact")
    ap.add_argument("--norm", choices=("std", "ms"), default="std")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--write-model", metavar="DIR")
    ap.add_argument("--write-data", metavar="FILE", help="a random image shard (256 images)")
    ap.add_argument("--write-only", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)

    if a.model:
        model = ref.VitModel.load(a.model, torch.float32)
    else:
        config = bench_config(a)
        cfg = ref.VitConfig(config)
        weights = random_weights(cfg, a.seed)
        if a.write_model:
            os.makedirs(a.write_model, exist_ok=True)
            st_io.save(os.path.join(a.write_model, "model.safetensors"), weights)
            with open(os.path.join(a.write_model, "config.json"), "w") as f:
                json.dump(config, f, indent=1)
        model = ref.VitModel(cfg, weights, torch.float32)
    cfg = model.cfg
    if a.write_data:
        rng = np.random.default_rng(a.seed)
        pi.write_shard(a.write_data, rng.integers(0, 256, (256,) + cfg.image + (3,), dtype=np.uint8),
                       rng.integers(0, a.classes, 256), a.classes)
    if a.write_only:
        return
    targets = ref.parse_targets(a.lora_targets)
    lora = {}
    for l in range(cfg.n_layers):
        for t in targets:
            i, o = cfg.in_out(t)
            lora[(l, t)] = ((torch.randn(a.lora_rank, i) / i ** 0.5).requires_grad_(True),
                            torch.zeros(o, a.lora_rank, requires_grad=True))
    head = ((0.02 * torch.randn(a.classes, cfg.dim)).requires_grad_(True),
            torch.zeros(a.classes, requires_grad=True))
    params = [p for ab in lora.values() for p in ab] + list(head)
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
    scale = a.lora_alpha / a.lora_rank
    g = torch.Generator().manual_seed(a.seed + 1)
    pixels = torch.randn((a.batch, cfg.channels) + cfg.image, generator=g)
    labels = torch.randint(0, a.classes, (a.batch,), generator=g)
    if a.norm == "ms":
        model.merged_weights()  # merged once, at load time, outside the timed steps
    times = []
    for step in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        loss = F.cross_entropy(ref.forward(model, pixels, lora, scale, head, a.act, a.norm), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        if step >= a.warmup:
            times.append(dt)
        print(f"step {step} loss {float(loss):.4f} {dt * 1e3:.1f} ms", file=sys.stderr)
    med = float(np.median(times))
    print(f"config dim={cfg.dim} hidden={cfg.hidden} layers={cfg.n_layers} heads={cfg.n_heads} "
          f"image={cfg.image} patch={cfg.patch} batch={a.batch} lora_rank={a.lora_rank} "
          f"targets={','.join(targets)} act={a.act} norm={a.norm} threads={a.threads} "
          f"torch={torch.__version__}", file=sys.stderr)
    print(f"pytorch step_ms={med * 1e3:.2f} img_s={a.batch / med:.1f}", flush=True)


if __name__ == "__main__":
    main()
