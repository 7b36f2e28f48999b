#!/usr/bin/env python3
"""Time one LoRA training step (forward + backward + AdamW on the LoRA parameters) of a LLaMA in
PyTorch on the CPU: the side-by-side baseline for the C trainer's CPU backend.

Prints one machine-readable line on stdout:
    pytorch step_ms=<median ms per step> tok_s=<batch*seq / median step time>
(details of the config and every step time go to stderr).

The model is random (seeded) unless --model DIR loads one. --write-model DIR writes that same
random model as a Hugging Face directory (config.json + model.safetensors, F32) so the C trainer
can be timed on the identical config; --write-only stops after writing.

    /usr/bin/python3 scripts/bench/bench_cpu.py --threads 2
    /usr/bin/python3 scripts/bench/bench_cpu.py --write-model out/bench_model --write-only
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import torch

# sibling modules: scripts/<folder>/ (and the PyTorch references in test/model/)
SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(SCRIPTS, d) for d in ("formats", "../test/model",)]
import reference_llama as ref  # noqa: E402
import st_io  # noqa: E402


def bench_config(a):
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
            "hidden_size": a.dim, "intermediate_size": a.hidden, "num_hidden_layers": a.layers,
            "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads,
            "vocab_size": a.vocab, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "max_position_embeddings": max(2048, a.seq), "tie_word_embeddings": False,
            "torch_dtype": "float32"}


def random_weights(cfg, seed):
    """A random LLaMA: linears N(0, 0.02), norm gammas 1 + 0.1 N(0, 1), untied head."""
    rng = np.random.default_rng(seed)

    def normal(shape, std):
        return (std * rng.standard_normal(shape)).astype(np.float32)

    t = {"model.embed_tokens.weight": normal((cfg.vocab, cfg.dim), 0.02)}
    for l in range(cfg.n_layers):
        p = f"model.layers.{l}."
        for name, module in ref._MODULE_OF.items():
            i, o = cfg.in_out(name)
            t[p + module + ".weight"] = normal((o, i), 0.02)
        t[p + "input_layernorm.weight"] = (1 + normal((cfg.dim,), 0.1)).astype(np.float32)
        t[p + "post_attention_layernorm.weight"] = (1 + normal((cfg.dim,), 0.1)).astype(np.float32)
    t["model.norm.weight"] = (1 + normal((cfg.dim,), 0.1)).astype(np.float32)
    if not cfg.tied:
        t["lm_head.weight"] = normal((cfg.vocab, cfg.dim), 0.02)
    return t


def write_model(model_dir, config, weights):
    os.makedirs(model_dir, exist_ok=True)
    st_io.save(os.path.join(model_dir, "model.safetensors"), weights, metadata={"format": "pt"})
    tmp = os.path.join(model_dir, "config.json.tmp")
    with open(tmp, "w") as f:
        json.dump(config, f, indent=1)
    os.replace(tmp, os.path.join(model_dir, "config.json"))


def blas_in_use():
    """The BLAS library this process mapped (Debian's torch links libblas.so.3, whose provider is
    chosen by update-alternatives: the reference BLAS is ~10x slower than OpenBLAS)."""
    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if "blas" in line.lower() and "/" in line}
        return ",".join(sorted(os.path.realpath(x) for x in libs)) or "unknown"
    except OSError:
        return "unknown"


def main(argv=None):
    ap = argparse.ArgumentParser(description="PyTorch CPU LoRA step benchmark")
    ap.add_argument("--model", help="load this model directory instead of a random one")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=688)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--lora-alpha", type=float, default=16.0)
    ap.add_argument("--lora-targets", default=",".join(ref.LORA_TARGETS))
    ap.add_argument("--act", choices=("exact", "approx"), default="exact")
    ap.add_argument("--norm", choices=("std", "ms"), default="std")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--write-model", metavar="DIR", help="write the random model to DIR")
    ap.add_argument("--write-only", action="store_true", help="write the model and exit")
    a = ap.parse_args(argv)

    torch.set_num_threads(a.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    torch.manual_seed(a.seed)

    if a.model:
        if a.write_model:
            ap.error("--write-model writes the random model; not with --model")
        model = ref.LlamaModel.load(a.model, torch.float32)
    else:
        config = bench_config(a)
        cfg = ref.LlamaConfig(config)
        weights = random_weights(cfg, a.seed)
        if a.write_model:
            write_model(a.write_model, config, weights)
            print(f"wrote {a.write_model}", file=sys.stderr)
            if a.write_only:
                return
        model = ref.LlamaModel(cfg, weights, torch.float32)
    cfg = model.cfg
    targets = ref.parse_targets(a.lora_targets)

    # LoRA as usual: A ~ N(0, 1/in), B = 0 (the gradient work is the same as for any B)
    lora = {}
    for l in range(cfg.n_layers):
        for t in targets:
            i, o = cfg.in_out(t)
            A = (torch.randn(a.lora_rank, i) / i ** 0.5).requires_grad_(True)
            B = torch.zeros(o, a.lora_rank, requires_grad=True)
            lora[(l, t)] = (A, B)
    params = [p for ab in lora.values() for p in ab]
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.0)
    scale = a.lora_alpha / a.lora_rank

    g = torch.Generator().manual_seed(a.seed + 1)
    tokens = torch.randint(0, cfg.vocab, (a.batch, a.seq + 1), generator=g)
    mask = torch.ones(a.batch, a.seq)
    if a.norm == "ms":
        model.merged_weights()  # merge once, at load time, outside the timed steps

    times = []
    for step in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        logits = ref.forward(model, tokens[:, :-1], lora, scale, a.act, a.norm)
        loss = ref.masked_ce(logits, tokens[:, 1:], mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        if step >= a.warmup:
            times.append(dt)
        print(f"step {step} loss {float(loss):.4f} {dt * 1e3:.1f} ms", file=sys.stderr)

    med = float(np.median(times)) if times else float("nan")
    print(f"config dim={cfg.dim} hidden={cfg.hidden} layers={cfg.n_layers} heads={cfg.n_heads} "
          f"kv_heads={cfg.n_kv_heads} vocab={cfg.vocab} batch={a.batch} seq={a.seq} "
          f"lora_rank={a.lora_rank} targets={','.join(targets)} act={a.act} norm={a.norm} "
          f"threads={a.threads} torch={torch.__version__} blas={blas_in_use()}", file=sys.stderr)
    print(f"pytorch step_ms={med * 1e3:.2f} tok_s={a.batch * a.seq / med:.1f}", flush=True)


if __name__ == "__main__":
    main()
