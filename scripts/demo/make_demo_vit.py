#!/usr/bin/env python3
"""Make the bundled ViT demo of `make run`: pretrain a tiny ViT from scratch in PyTorch on
Fashion-MNIST classes 0-4 (T-shirt/top, trouser, pullover, dress, coat), save it as a Hugging Face
model directory (data/vit_demo), and write the small fine-tuning subset of the OTHER classes 5-9
(sandal, shirt, sneaker, bag, ankle boot; relabelled 0-4) that train_vit adapts it to with LoRA
and a new head (data/vit_demo_ft_train.bin, data/vit_demo_ft_val.bin).

Needs Debian's dataset-fashion-mnist package (IDX files under /usr/share/datasets/fashion-mnist)
and python3-torch. Deterministic for a given --seed and thread count. The model is the one of
test/model/reference_vit.py (float32 here), so it is exactly what train_vit loads:
28x28 grayscale, patch 7 (4x4 grid + class token = 17 tokens), width 64, 4 layers, 4 heads,
MLP 256, erf GELU, LayerNorm eps 1e-6, normalisation mean 0.2860 / std 0.3530 (the training set's).

  /usr/bin/python3 scripts/demo/make_demo_vit.py            # ~2-4 minutes on 2 cores
"""
import argparse
import json
import math
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

REPO = os.path.dirname(SCRIPTS)
CONFIG = {"architectures": ["ViTForImageClassification"], "model_type": "vit",
          "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 4,
          "num_attention_heads": 4, "image_size": 28, "patch_size": 7, "num_channels": 1,
          "layer_norm_eps": 1e-6, "hidden_act": "gelu", "qkv_bias": True,
          "torch_dtype": "float32"}
MEAN, STD = 0.2860, 0.3530
PRETRAIN_CLASSES = [0, 1, 2, 3, 4]
FINETUNE_CLASSES = [5, 6, 7, 8, 9]


def init_weights(cfg, seed):
    """HF-layout (no prefix) initial weights: N(0, 0.02) everywhere, LayerNorm 1 / 0, biases 0."""
    rng = np.random.default_rng(seed)
    d, (gh, gw) = cfg.dim, cfg.grid

    def normal(*shape):
        return (0.02 * rng.standard_normal(shape)).astype(np.float32)

    w = {"embeddings.cls_token": normal(1, 1, d),
         "embeddings.position_embeddings": normal(1, 1 + gh * gw, d),
         "embeddings.patch_embeddings.projection.weight": normal(d, cfg.channels, *cfg.patch),
         "embeddings.patch_embeddings.projection.bias": np.zeros(d, np.float32),
         "layernorm.weight": np.ones(d, np.float32), "layernorm.bias": np.zeros(d, np.float32)}
    for l in range(cfg.n_layers):
        p = f"encoder.layer.{l}."
        for t, module in ref.HF_MODULE.items():
            i, o = cfg.in_out(t)
            w[p + module + ".weight"] = normal(o, i)
            w[p + module + ".bias"] = np.zeros(o, np.float32)
        for nm in ("layernorm_before", "layernorm_after"):
            w[p + nm + ".weight"] = np.ones(d, np.float32)
            w[p + nm + ".bias"] = np.zeros(d, np.float32)
    return w


def to_tensor(images):
    """uint8 [n, 28, 28, 1] -> normalised float32 [n, 1, 28, 28]."""
    x = torch.from_numpy(images.astype(np.float32) / 255.0).permute(0, 3, 1, 2)
    return (x - MEAN) / STD


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", default=pi.FASHION_MNIST_DIR)
    ap.add_argument("--out", default=os.path.join(REPO, "data"))
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ft-train-per-class", type=int, default=100)
    ap.add_argument("--ft-val-per-class", type=int, default=60)
    a = ap.parse_args(argv)
    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)

    train = pi.select(*pi.load_fashion_mnist(a.source, "train"), keep=PRETRAIN_CLASSES, seed=a.seed)
    test = pi.select(*pi.load_fashion_mnist(a.source, "test"), keep=PRETRAIN_CLASSES, seed=a.seed)
    xtr, ytr = to_tensor(train[0]), torch.from_numpy(train[1])
    xte, yte = to_tensor(test[0]), torch.from_numpy(test[1])

    cfg = ref.VitConfig(CONFIG)
    model = ref.VitModel(cfg, init_weights(cfg, a.seed), torch.float32)
    for k in model.w:
        model.w[k] = model.w[k].clone().requires_grad_(True)
    rng = np.random.default_rng(a.seed + 1)
    head = ((0.02 * torch.from_numpy(rng.standard_normal((5, cfg.dim)).astype(np.float32))).requires_grad_(True),
            torch.zeros(5, requires_grad=True))
    params = list(model.w.values()) + list(head)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                             {"params": no_decay, "weight_decay": 0.0}], lr=a.lr)
    steps = a.epochs * (len(ytr) // a.batch)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))

    def accuracy(x, y):
        with torch.no_grad():
            correct = 0
            for i in range(0, len(y), 500):
                logits = ref.forward(model, x[i:i + 500], {}, 1.0, head)
                correct += int((logits.argmax(1) == y[i:i + 500]).sum())
            return correct / len(y)

    t0 = time.time()
    g = torch.Generator().manual_seed(a.seed + 2)
    for epoch in range(a.epochs):
        perm = torch.randperm(len(ytr), generator=g)
        tot = 0.0
        for i in range(len(ytr) // a.batch):
            idx = perm[i * a.batch:(i + 1) * a.batch]
            x = xtr[idx]
            flip = torch.rand(len(idx), generator=g) < 0.5  # horizontal flips: cheap augmentation
            x = torch.where(flip[:, None, None, None], x.flip(3), x)
            loss = F.cross_entropy(ref.forward(model, x, {}, 1.0, head), ytr[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            tot += float(loss)
        print(f"epoch {epoch + 1}/{a.epochs}: train loss {tot / (len(ytr) // a.batch):.4f} "
              f"test acc (classes 0-4) {accuracy(xte, yte):.4f}  [{time.time() - t0:.0f} s]",
              flush=True)

    model_dir = os.path.join(a.out, "vit_demo")
    os.makedirs(model_dir, exist_ok=True)
    tensors = model.hf_tensors("vit.")
    tensors["classifier.weight"] = head[0].detach().numpy()
    tensors["classifier.bias"] = head[1].detach().numpy()
    st_io.save(os.path.join(model_dir, "model.safetensors"), tensors, metadata={"format": "pt"})
    config = dict(CONFIG, id2label={str(i): n for i, n in enumerate(
        ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat"])})
    for name, obj in (("config.json", config),
                      ("preprocessor_config.json",
                       {"image_processor_type": "ViTImageProcessor", "do_resize": True,
                        "do_rescale": True, "do_normalize": True, "image_mean": [MEAN],
                        "image_std": [STD], "size": {"height": 28, "width": 28}})):
        with open(os.path.join(model_dir, name + ".tmp"), "w") as f:
            json.dump(obj, f, indent=1)
        os.replace(os.path.join(model_dir, name + ".tmp"), os.path.join(model_dir, name))
    print(f"wrote {model_dir} (pretrained on classes {PRETRAIN_CLASSES}, "
          f"test acc {accuracy(xte, yte):.4f})")

    # the fine-tuning task: the other five classes, a small balanced subset of each split
    for split, per, name in (("train", a.ft_train_per_class, "vit_demo_ft_train.bin"),
                             ("test", a.ft_val_per_class, "vit_demo_ft_val.bin")):
        images, labels, classes = pi.select(*pi.load_fashion_mnist(a.source, split),
                                            keep=FINETUNE_CLASSES, per_class=per, seed=a.seed)
        pi.write_shard(os.path.join(a.out, name), images, labels, classes)
        print(f"wrote {os.path.join(a.out, name)}: {len(labels)} images of classes "
              f"{FINETUNE_CLASSES} (relabelled 0-4), from the {split} split")


if __name__ == "__main__":
    main()
