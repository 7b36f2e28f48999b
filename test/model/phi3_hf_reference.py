#!/usr/bin/env python3
"""transformers' own Phi3ForCausalLM with PEFT's LoRA on its fused modules, as the oracle of
test/model/test_phi3_model.py: one forward + backward of a case (test/model/reference_llama.py's
contract) in float64, eager attention, no cache, written in the probe's output layout.

PEFT puts one adapter on each fused module: lora_A [r, in] and lora_B [rows, r] of qkv_proj (q, k, v
rows in that order) and of gate_up_proj (gate, then up). The case gives them per part, A the same
for every part of a module; the gradients come back per part the same way (A's, the whole module's,
under every part's name; B's rows split). Runs in the venv with transformers and PEFT
(build/hfvenv, HF_PYTHON):

    python test/model/phi3_hf_reference.py --model DIR --case CASE --out OUT --rank R --alpha A
"""
import argparse
import os
import sys

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts", "formats"))
import st_io  # noqa: E402

MODULES = {"self_attn.qkv_proj": ("q", "k", "v"), "self_attn.o_proj": ("o",), "mlp.gate_up_proj": ("gate", "up"),
           "mlp.down_proj": ("down",)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--case", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--alpha", type=float, required=True)
    a = ap.parse_args()
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.float64, attn_implementation="eager",
                                                use_safetensors=True)
    assert type(base).__name__ == "Phi3ForCausalLM", type(base).__name__
    cfg = LoraConfig(r=a.rank, lora_alpha=a.alpha, lora_dropout=0.0, bias="none",
                     target_modules=[m.split(".")[1] for m in MODULES])
    model = get_peft_model(base, cfg).eval()
    case = st_io.load(a.case)
    params = {}
    for name, p in model.named_parameters():
        p.requires_grad_(False)
        if "lora_" not in name:
            continue
        # base_model.model.model.layers.{l}.{module}.lora_{A,B}.default.weight
        rest = name.split("model.layers.")[1]
        l, module = int(rest.split(".")[0]), ".".join(rest.split(".")[1:3])
        parts = MODULES[module]
        with torch.no_grad():
            if ".lora_A." in name:
                p.copy_(torch.from_numpy(case[f"lora.{l}.{parts[0]}.A"].astype(np.float64)))
            else:
                p.copy_(torch.from_numpy(np.concatenate([case[f"lora.{l}.{t}.B"] for t in parts]).astype(np.float64)))
        p.requires_grad_(True)
        params[(l, module, "A" if ".lora_A." in name else "B")] = p
    tokens = torch.from_numpy(case["tokens"].astype(np.int64))
    mask = torch.from_numpy(case["mask"].astype(np.float64))
    logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
    logp = torch.log_softmax(logits, dim=-1)
    nll = -logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    loss = (nll * mask).sum() / mask.sum()
    loss.backward()
    out = {"logits": logits.detach().numpy(), "loss": np.array([float(loss)])}
    for (l, module, ab), p in params.items():
        parts = MODULES[module]
        g = p.grad.numpy()
        if ab == "A":
            for t in parts:
                out[f"grad.lora.{l}.{t}.A"] = g
            continue
        rows = np.cumsum([case[f"lora.{l}.{t}.B"].shape[0] for t in parts])[:-1]
        for t, gb in zip(parts, np.split(g, rows)):
            out[f"grad.lora.{l}.{t}.B"] = gb
    st_io.save(a.out, out)
    print(f"loss {float(loss):.12f}")


if __name__ == "__main__":
    main()
