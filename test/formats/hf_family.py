"""Random Gemma 2 / Phi-3 checkpoints written by transformers, and their logits: the reference side of
test/formats/test_gguf_write.py's gemma2/phi3 exports. Run with the venv's python (build/hfvenv: transformers
4.46 over Debian's torch).

    hf_family.py make CONFIG.json OUT_DIR [--seed N]    # save_pretrained of a random model (float32)
    hf_family.py logits JOBS.json   # [{"dir", "ids", "out", "gelu_f16"}]: float64 logits of each sequence
                                    # (eager attention) saved as .npy; gelu_f16: see gelu_f16 below
(one process for many: transformers takes seconds to import)

Weights are drawn wider than transformers' init (std 0.02 gives near-zero logits): matrices N(0, 0.1), the
embedding N(0, 0.2), norm weights N(0, 0.3) around Gemma's 0 (it multiplies by 1 + w) or Phi-3's 1."""
import json
import sys

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM


def make(config_path, out, seed):
    with open(config_path) as f:
        cfg = json.load(f)
    config = AutoConfig.for_model(**cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    gemma = cfg["model_type"].startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_((0.0 if gemma else 1.0) + 0.3 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(out, safe_serialization=True)


def gelu_f16(model):
    """ggml's CPU GELU (GGML_GELU_FP16, on by default) looks the value up in a table of half floats: its input
    and its output are rounded to float16. The same rounding here makes the reference what llama.cpp computes
    up to float32's rounding, so that llama.cpp's f32 file is held to the float32 tolerance."""
    class GeluF16(torch.nn.Module):
        def forward(self, x):
            g = torch.nn.functional.gelu(x.to(torch.float16).to(torch.float32), approximate="tanh")
            return g.to(torch.float16).to(x.dtype)
    for layer in model.model.layers:
        layer.mlp.act_fn = GeluF16()


def logits(jobs_path):
    with open(jobs_path) as f:
        jobs = json.load(f)
    for job in jobs:
        model = AutoModelForCausalLM.from_pretrained(job["dir"], torch_dtype=torch.float64,
                                                     attn_implementation="eager")
        model.eval()
        if job.get("gelu_f16"):
            gelu_f16(model)
        t = torch.tensor([job["ids"]], dtype=torch.int64)
        with torch.no_grad():
            out = model(input_ids=t, attention_mask=torch.ones_like(t), use_cache=False).logits[0]
        np.save(job["out"], out.numpy())


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2], sys.argv[3], int(sys.argv[5]) if len(sys.argv) > 5 else 0)
    elif sys.argv[1] == "logits":
        logits(sys.argv[2])
    else:
        sys.exit(f"error: {sys.argv[1]!r}: expected make or logits")
