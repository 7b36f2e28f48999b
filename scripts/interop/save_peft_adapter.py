#!/usr/bin/env python3
"""Saves a PEFT LoRA adapter with random weights (both A and B, so that it changes the model) for
a Hugging Face causal LM, on every linear of every block, and prints PEFT's loss of base + adapter
on the first windows of a token shard, the windows train_llama --eval-only uses. --rslora saves it
with use_rslora (scale lora_alpha/sqrt(r)); --targets names the modules (default LLaMA's seven; a
Phi-3 has qkv_proj,o_proj,gate_up_proj,down_proj). test/system/test_hf_interop.py loads the adapter in
train_llama and compares the losses. Needs transformers and peft; not part of make test.

    python scripts/interop/save_peft_adapter.py --base DIR --out DIR --rank R --alpha A [--rslora] \
        [--targets M,M,...] --val SHARD --seq T --windows N
"""
import argparse
import os
import sys

import numpy as np
import torch

# sibling modules in scripts/<folder>/
SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(SCRIPTS, d) for d in ("formats", "interop")]
import shards  # noqa: E402
from check_hf_interop import masked_loss  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--alpha", type=float, required=True)
    ap.add_argument("--rslora", action="store_true")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--val", required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--windows", type=int, required=True)
    a = ap.parse_args()
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(a.base, torch_dtype=torch.float32, attn_implementation="eager",
                                                use_safetensors=True).eval()
    # init_lora_weights=False: B is random too (nn.Linear's init), not zero
    cfg = LoraConfig(r=a.rank, lora_alpha=a.alpha, target_modules=a.targets.split(","), use_rslora=a.rslora, init_lora_weights=False,
                     task_type="CAUSAL_LM")
    model = get_peft_model(base, cfg).eval()
    model.save_pretrained(a.out)
    toks, mask, _ = shards.read_shard(a.val)
    T = a.seq
    windows = np.stack([toks[i * T: i * T + T + 1] for i in range(a.windows)]).astype(np.int64)
    wmask = np.stack([mask[i * T + 1: i * T + T + 1] for i in range(a.windows)]).astype(np.float64)
    print(f"PEFT base + adapter: {masked_loss(model, windows, wmask):.6f}")
    with model.disable_adapter():
        print(f"PEFT base:           {masked_loss(model, windows, wmask):.6f}")


if __name__ == "__main__":
    main()
