#!/usr/bin/env python3
"""Checks that what train_vit writes loads in Hugging Face transformers and PEFT: loss and top-1
accuracy of our --export-merged directory (ViTForImageClassification.from_pretrained) and of the
base model + our PEFT adapter (PeftModel.from_pretrained; the new head as modules_to_save), on
the first images of an image shard already at the model's resolution, normalised with its
preprocessor_config.json. Needs transformers, peft (and accelerate); not part of make test.

    python scripts/interop/check_hf_vit.py --base DIR --adapter DIR --merged DIR --val SHARD --images N
"""
import argparse
import json
import os
import sys

import numpy as np
import torch

# sibling modules in scripts/<folder>/
SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(SCRIPTS, d) for d in ("data",)]
from prepare_images import read_shard  # noqa: E402


def evaluate(model, pixels, labels):
    with torch.no_grad():
        logits = model(pixel_values=pixels).logits.double()
    loss = torch.nn.functional.cross_entropy(logits, labels)
    return float(loss), float((logits.argmax(-1) == labels).double().mean())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag in ("--base", "--adapter", "--merged", "--val"):
        ap.add_argument(flag, required=True)
    ap.add_argument("--images", type=int, required=True)
    a = ap.parse_args()
    from peft import PeftModel
    from transformers import ViTForImageClassification
    px, labels, _ = read_shard(a.val)
    with open(os.path.join(a.merged, "preprocessor_config.json")) as f:
        pre = json.load(f)
    mean, std = np.array(pre["image_mean"]), np.array(pre["image_std"])
    x = (px[: a.images].astype(np.float64) / 255.0 - mean) / std  # [n, H, W, C]
    pixels = torch.from_numpy(x.transpose(0, 3, 1, 2).astype(np.float32))
    y = torch.from_numpy(labels[: a.images])
    merged = ViTForImageClassification.from_pretrained(a.merged, use_safetensors=True).eval()
    print("transformers merged export: loss %.6f acc %.4f" % evaluate(merged, pixels, y))
    classes = merged.config.num_labels
    base = ViTForImageClassification.from_pretrained(a.base, num_labels=classes, ignore_mismatched_sizes=True,
                                                      use_safetensors=True).eval()
    if not os.path.isfile(os.path.join(a.adapter, "adapter_model.safetensors")):  # PEFT would torch.load a .bin
        sys.exit(f"error: {a.adapter}: no adapter_model.safetensors (pickled adapters are not read)")
    peft_model = PeftModel.from_pretrained(base, a.adapter).eval()
    print("transformers base + PEFT adapter: loss %.6f acc %.4f" % evaluate(peft_model, pixels, y))


if __name__ == "__main__":
    main()
