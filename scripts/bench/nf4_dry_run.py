#!/usr/bin/env python3
"""--dry-run totals of LLaMA-2-7B, LLaMA-2-13B and LLaMA-2-70B shapes (config.json alone, no
weights), bf16 against NF4 frozen weights, per memory mode, at batch 1 x 2048 and the paper's
4 x 640 (LoRA r = 64 on every linear, the CUDA layout); then the longest context (batch 1,
--mode lowmem --quant nf4) whose plan fits one 80 GB GPU (79.2 GiB usable, an H100's
cudaMemGetInfo total) and one 141 GB GPU (139.7 GiB, an H200's), found by planning.

    python3 scripts/bench/nf4_dry_run.py [--bin ./train_llama] [--markdown]
"""
import argparse
import json
import os
import subprocess
import tempfile

LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"])
CONFIGS = {
    "LLaMA-2-7B": dict(LLAMA, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096),
    "LLaMA-2-13B": dict(LLAMA, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                        num_key_value_heads=40, vocab_size=32000, max_position_embeddings=4096),
    "LLaMA-2-70B": dict(LLAMA, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096),
}
GPUS = {"80 GB (79.2 GiB)": 79.2 * 2**30, "141 GB (139.7 GiB)": 139.7 * 2**30}
GIB = 2**30


def plan(exe, cfg_dir, mode, quant, batch, seq):
    p = subprocess.run([exe, "--model", cfg_dir, "--dry-run", "--json", "--mode", mode, "--quant", quant, "--batch", str(batch),
                        "--seq", str(seq), "--lora-rank", "64", "--lora-alpha", "16", "--device", "cuda"],
                       capture_output=True, text=True, check=True)
    return json.loads(p.stdout)


def longest_seq(exe, cfg_dir, capacity):
    """The largest multiple of 256 tokens (batch 1) whose lowmem NF4 plan fits capacity, or 0."""
    lo, hi = 0, 1 << 20
    while hi - lo > 256:
        mid = (lo + hi) // 2 // 256 * 256
        if plan(exe, cfg_dir, "lowmem", "nf4", 1, mid)["total_bytes"] <= capacity:
            lo = mid
        else:
            hi = mid
    return lo


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(os.path.dirname(__file__), "..", "..", "train_llama"))
    args = ap.parse_args()
    print("| model | batch x seq | mode | frozen bf16 | frozen NF4 | activations | total bf16 | total NF4 |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {}
        for name, cfg in CONFIGS.items():
            d = os.path.join(tmp, name)
            os.makedirs(d)
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump(cfg, f)
            dirs[name] = d
            for batch, seq in ((1, 2048), (4, 640)):
                for mode in ("baseline", "lowmem", "ckpt"):
                    b, q = plan(args.bin, d, mode, "none", batch, seq), plan(args.bin, d, mode, "nf4", batch, seq)
                    print(f"| {name} | {batch} x {seq} | {mode} | {b['categories']['frozen'] / GIB:.2f} | {q['categories']['frozen'] / GIB:.2f} "
                          f"| {q['activation_bytes'] / GIB:.2f} | {b['total_bytes'] / GIB:.2f} | {q['total_bytes'] / GIB:.2f} |")
        print()
        print("| model | " + " | ".join(f"longest context on {g}, batch 1, lowmem + NF4" for g in GPUS) + " |")
        print("|---|" + "---|" * len(GPUS))
        for name, d in dirs.items():
            print(f"| {name} | " + " | ".join(str(longest_seq(args.bin, d, cap)) for cap in GPUS.values()) + " |")


if __name__ == "__main__":
    main()
