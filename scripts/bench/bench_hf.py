"""The Hugging Face side of `make bench`: transformers + PEFT LoRA on the same config.json, batch
and rank as our trainers (docs/gpu-testing.md compares the two on one GPU), random weights and
data, bf16 weights with fp32 adapters under autocast (the usual mixed-precision recipe), SDPA
attention, AdamW. Prints one line that scripts/bench/bench_gpu.sh puts in its table:

    HF llama plain: 1234 tok/s, peak 5678.9 MiB (torch.cuda.max_memory_allocated)

usage: python3 scripts/bench/bench_hf.py --model DIR (llama|vit) [--mode plain|ckpt] [--batch B]
       [--seq T] [--rank R] [--steps N] [--warmup W] [--device cuda|cpu]
"""
import argparse
import json
import os
import sys
import time

import torch


def build(kind, model_dir, rank, device):
    from peft import LoraConfig, get_peft_model
    import transformers
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    if kind == "llama":
        config = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")})
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        cls, save = transformers.LlamaForCausalLM, None
    else:
        config = transformers.ViTConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")}, num_labels=100)
        targets = ["query", "key", "value", "attention.output.dense", "intermediate.dense", "output.dense"]
        cls, save = transformers.ViTForImageClassification, ["classifier"]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    kwargs = {"attn_implementation": "sdpa"} if device == "cuda" else {}
    if hasattr(torch.device, "__enter__"):  # random init straight on the device (torch >= 2.0)
        with torch.device(device):
            model = cls._from_config(config, torch_dtype=dtype, **kwargs)
    else:
        model = cls._from_config(config, torch_dtype=dtype, **kwargs).to(device)
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=targets, modules_to_save=save)
    model = get_peft_model(model, lora)
    for p in model.parameters():  # fp32 masters for what trains, as our trainers keep them
        if p.requires_grad:
            p.data = p.data.float()
    return model


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("kind", choices=["llama", "vit"])
    ap.add_argument("--mode", choices=["plain", "ckpt"], default="plain")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    model = build(a.kind, a.model, a.rank, a.device)
    if a.mode == "ckpt":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}) \
            if "gradient_checkpointing_kwargs" in model.gradient_checkpointing_enable.__code__.co_varnames \
            else model.gradient_checkpointing_enable()
        model.enable_input_require_grads()
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    cfg = model.config
    if a.kind == "llama":
        batch = {"input_ids": torch.randint(0, cfg.vocab_size, (a.batch, a.seq), device=a.device)}
        batch["labels"] = batch["input_ids"]
        items, unit = a.batch * a.seq, "tok"
    else:
        batch = {"pixel_values": torch.randn(a.batch, 3, cfg.image_size, cfg.image_size, device=a.device),
                 "labels": torch.randint(0, 100, (a.batch,), device=a.device)}
        items, unit = a.batch, "img"
    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(a.steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.time()
        with torch.autocast(device_type=a.device, dtype=torch.bfloat16, enabled=cuda):
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.time() - t0)
        print(f"step {step + 1}/{a.steps}: loss {loss.item():.4f}, {items / times[-1]:.0f} {unit}/s", file=sys.stderr)
    timed = times[a.warmup:] or times
    rate = items * len(timed) / sum(timed)
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else float("nan")
    print(f"HF {a.kind} {a.mode}: {rate:.0f} {unit}/s, peak {peak:.1f} MiB (torch.cuda.max_memory_allocated)")


if __name__ == "__main__":
    main()
