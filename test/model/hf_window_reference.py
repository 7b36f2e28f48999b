"""transformers' own sliding-window models as the reference of test/model/test_sliding_window.py.
Run with the interpreter of build/hfvenv (transformers 4.46 over Debian's torch):

  write DIR CONFIG_JSON SEED      a random model of that config by transformers (its own init), the
                                  norm weights spread around 1 so they matter, saved as float32
                                  safetensors with transformers' config.json
  run DIR CASE OUT RANK ALPHA     the case (test/model/llama_cases.py's layout: tokens, mask, LoRA A
                                  and B) through transformers in float64, eager attention: logits,
                                  the masked mean cross-entropy and the LoRA gradients, in the
                                  probe's names (logits, loss, grad.lora.{l}.{t}.A|B)

The per-layer window: 4.46's eager and sdpa paths give every layer the model's one sliding-window
mask (Qwen2 honours max_window_layers only in its flash-attention path); current transformers gives
the layers of layer_types "full_attention" (Qwen2: below max_window_layers) the plain causal mask.
For a model with full layers the run gives those layers transformers' own causal mask (made with the
window off), so the reference is transformers' layers under current transformers' layer plan."""
import json
import sys

import numpy as np
import torch
from safetensors.numpy import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

TARGETS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
           "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def full_layers(cfg):
    """The layers current transformers gives full attention."""
    n = cfg.num_hidden_layers
    if cfg.model_type == "mistral" or not getattr(cfg, "sliding_window", None):
        return set() if cfg.model_type == "mistral" else set(range(n))
    if not getattr(cfg, "use_sliding_window", False):
        return set(range(n))
    return set(range(min(n, cfg.max_window_layers)))


def write(model_dir, config_json, seed):
    torch.manual_seed(int(seed))
    d = json.loads(config_json)
    cfg = AutoConfig.for_model(**d)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(model_dir, safe_serialization=True)


def run(model_dir, case_path, out_path, rank, alpha):
    cfg = AutoConfig.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float64, attn_implementation="eager")
    model.eval()
    case = load_file(case_path)
    tokens = torch.tensor(case["tokens"].astype(np.int64))
    mask = torch.tensor(case["mask"].astype(np.float64))
    scale = float(alpha) / int(rank)
    params = {}
    for l, layer in enumerate(model.model.layers):
        for t, path in TARGETS.items():
            if f"lora.{l}.{t}.A" not in case:
                continue
            A = torch.tensor(case[f"lora.{l}.{t}.A"].astype(np.float64), requires_grad=True)
            B = torch.tensor(case[f"lora.{l}.{t}.B"].astype(np.float64), requires_grad=True)
            params[(l, t)] = (A, B)
            module = layer.get_submodule(path)
            module.register_forward_hook(lambda m, inp, out, A=A, B=B: out + scale * ((inp[0] @ A.t()) @ B.t()))
    T = tokens.shape[1] - 1
    causal = torch.full((T, T), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1)[None, None]
    for l in full_layers(cfg):  # a causal mask without the window for the full layers (their attention_mask)
        layer = model.model.layers[l]
        layer.forward = lambda *a, _f=layer.forward, **kw: _f(
            *a, **dict(kw, attention_mask=causal.expand(tokens.shape[0], 1, T, T)))
    logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
    logp = torch.log_softmax(logits, dim=-1)
    nll = -logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    loss = (nll * mask).sum() / mask.sum()
    keys = sorted(params)
    grads = torch.autograd.grad(loss, [p for k in keys for p in params[k]])
    out = {"logits": logits.detach().numpy(), "loss": np.array([float(loss)])}
    for i, (l, t) in enumerate(keys):
        out[f"grad.lora.{l}.{t}.A"] = grads[2 * i].numpy()
        out[f"grad.lora.{l}.{t}.B"] = grads[2 * i + 1].numpy()
    save_file({k: np.ascontiguousarray(v, dtype=np.float64) for k, v in out.items()}, out_path)


if __name__ == "__main__":
    if sys.argv[1] == "write":
        write(*sys.argv[2:5])
    elif sys.argv[1] == "run":
        run(*sys.argv[2:7])
    else:
        sys.exit("usage: hf_window_reference.py write DIR CONFIG_JSON SEED | run DIR CASE OUT RANK ALPHA")
