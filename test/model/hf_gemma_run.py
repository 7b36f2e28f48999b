#!/usr/bin/env python3
"""Runs a Gemma 2 checkpoint through transformers' own Gemma2ForCausalLM (build/hfvenv's
transformers, eager attention, no cache, float64) on a case's tokens and mask: the logits, the
masked cross-entropy and its gradient with respect to every parameter, saved with np.savez under
the checkpoint's tensor names ("grad." + name). test/model/test_gemma_model.py compares them with
the independent reference test/model/reference_llama.py, which the trainer is tested against.

Usage: hf_gemma_run.py MODEL_DIR CASE.npz OUT.npz"""
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def main(model_dir, case_path, out_path):
    case = np.load(case_path)
    tokens = torch.from_numpy(case["tokens"].astype(np.int64))
    mask = torch.from_numpy(case["mask"].astype(np.float64))
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float64, attn_implementation="eager")
    model.train(False)
    logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
    logp = torch.log_softmax(logits, dim=-1)
    nll = -logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    loss = (nll * mask).sum() / mask.sum()
    loss.backward()
    out = {"logits": logits.detach().numpy(), "loss": np.array([loss.item()])}
    for name, p in model.named_parameters():
        out["grad." + name] = p.grad.numpy()
    np.savez(out_path, **out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
