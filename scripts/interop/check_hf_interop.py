#!/usr/bin/env python3
"""Checks that what train_llama writes loads in Hugging Face transformers and PEFT: the loss of
base model + our PEFT adapter (PeftModel.from_pretrained) and of our --export-merged directory
(AutoModelForCausalLM.from_pretrained: LlamaForCausalLM, Qwen2ForCausalLM, ... by config.json), on the first windows of a token shard, the same windows
train_llama --eval-only uses. Needs transformers, peft (and accelerate); not part of make test.

    python scripts/interop/check_hf_interop.py --base DIR --adapter DIR --merged DIR --val SHARD --seq T --windows N
"""
import argparse
import os
import sys

import numpy as np
import torch

# sibling modules in scripts/<folder>/
SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(SCRIPTS, d) for d in ("formats",)]
import shards  # noqa: E402


def masked_loss(model, windows, mask):
    with torch.no_grad():
        logits = model(torch.from_numpy(windows[:, :-1]), use_cache=False).logits.double()  # (Gemma 2: no HybridCache)
    logp = torch.log_softmax(logits, -1)
    nll = -logp.gather(-1, torch.from_numpy(windows[:, 1:]).unsqueeze(-1)).squeeze(-1)
    m = torch.from_numpy(mask)
    return float((nll * m).sum() / m.sum())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True)
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--merged", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--windows", type=int, required=True)
    a = ap.parse_args()
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    toks, mask, _ = shards.read_shard(a.val)
    T = a.seq
    windows = np.stack([toks[i * T: i * T + T + 1] for i in range(a.windows)]).astype(np.int64)
    wmask = np.stack([mask[i * T + 1: i * T + T + 1] for i in range(a.windows)]).astype(np.float64)
    # eager attention: the plain softmax(q k^T) v, on every torch transformers supports
    load = dict(torch_dtype=torch.float32, attn_implementation="eager", use_safetensors=True)  # never a pickle
    base = AutoModelForCausalLM.from_pretrained(a.base, **load).eval()
    print(f"transformers class:                {type(base).__name__}")
    print(f"transformers base:                 {masked_loss(base, windows, wmask):.6f}")
    if not os.path.isfile(os.path.join(a.adapter, "adapter_model.safetensors")):  # PEFT would torch.load a .bin
        sys.exit(f"error: {a.adapter}: no adapter_model.safetensors (pickled adapters are not read)")
    peft_model = PeftModel.from_pretrained(base, a.adapter).eval()
    print(f"transformers base + PEFT adapter:  {masked_loss(peft_model, windows, wmask):.6f}")
    merged = AutoModelForCausalLM.from_pretrained(a.merged, **load).eval()
    print(f"transformers merged export:        {masked_loss(merged, windows, wmask):.6f}")


if __name__ == "__main__":
    main()
