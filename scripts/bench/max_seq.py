#!/usr/bin/env python3
"""The longest context that fits one GPU, by plan (issue 24): `train_llama --dry-run --max-seq`
for Llama-3.1-8B, Llama-2-7B and Qwen2.5-7B shapes (test/fixtures/*/config.json: config.json
alone, no weights) on 24, 48, 80 and 141 GB cards, frozen weights in NF4 and in bf16, LoRA r16 on
every linear, batch 1, with the best memory flags (--mode lowmem --recompute block --offload host),
and the pinned host memory each length needs. Beside them, Unsloth's published figures for
Llama-3.1-8B QLoRA (24 GB: 78,475 tokens; 80 GB: 342,733).

These are plan figures (what the fit check would admit), not measurements: nothing runs on a GPU.

The memory planned for a card of G GB is G - 2 GiB (an 80 GB card: 78 GiB, the issue's "80 GB card
less its context"): the CUDA context, the libraries' handles and the allocator's rounding are
outside the plan (docs/memory.md); --reserve-gib changes the 2.

    python3 scripts/bench/max_seq.py [--bin ./train_llama] [--reserve-gib 2] [--json FILE]
"""
import argparse
import json
import os
import subprocess

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MODELS = {"Llama-3.1-8B": "llama31_8b", "Llama-2-7B": "llama2_7b", "Qwen2.5-7B": "qwen25_7b"}
CARDS_GB = (24, 48, 80, 141)
WEIGHTS = {"NF4": "nf4", "bf16": "none"}
FLAGS = ("--batch", "1", "--lora-rank", "16", "--mode", "lowmem", "--recompute", "block", "--offload", "host")
UNSLOTH = {("Llama-3.1-8B", "NF4", 24): 78475, ("Llama-3.1-8B", "NF4", 80): 342733}
GIB = 2**30


def max_seq(exe, model_dir, quant, gib):
    """(longest seq, its plan) or (0, None) when not even one token fits."""
    p = subprocess.run([exe, "--model", model_dir, "--dry-run", "--json", "--max-seq", "--gpu-mem", f"{gib:g}",
                        "--quant", quant, *FLAGS], capture_output=True, text=True)
    if p.returncode != 0:
        if "not even --seq 1 fits" in p.stderr:
            return 0, None
        raise SystemExit(f"max_seq.py: {model_dir} {quant} {gib} GiB: {p.stderr.strip()}")
    plan = json.loads(p.stdout)
    return plan["max_seq"], plan


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(REPO, "train_llama"))
    ap.add_argument("--reserve-gib", type=float, default=2.0)
    ap.add_argument("--json", help="also write every row (with its whole plan figures) to this file")
    args = ap.parse_args()
    rows = []
    print("Longest --seq by plan (not measured), LoRA r16, batch 1, --mode lowmem --recompute block --offload host;")
    print(f"a card of G GB planned as G - {args.reserve_gib:g} GiB of device memory. Cell: tokens (pinned host GiB).")
    print()
    print("| model | weights | " + " | ".join(f"{g} GB" for g in CARDS_GB) + " |")
    print("|---|---|" + "---|" * len(CARDS_GB))
    for name, fixture in MODELS.items():
        model_dir = os.path.join(REPO, "test", "fixtures", fixture)
        for wname, quant in WEIGHTS.items():
            cells = []
            for gb in CARDS_GB:
                gib = gb - args.reserve_gib
                seq, plan = max_seq(args.bin, model_dir, quant, gib)
                host = plan["host_bytes"] / GIB if plan else 0.0
                cell = f"{seq:,} ({host:.1f})" if seq else "does not fit"
                if (name, wname, gb) in UNSLOTH:
                    cell += f"; Unsloth {UNSLOTH[(name, wname, gb)]:,}"
                cells.append(cell)
                rows.append(dict(model=name, weights=wname, card_gb=gb, memory_gib=gib, max_seq=seq,
                                 host_bytes=plan["host_bytes"] if plan else 0,
                                 device_bytes=plan["total_bytes"] if plan else 0,
                                 block_peak_bytes_per_token=plan.get("block_peak_bytes_per_token") if plan else None))
            print(f"| {name} | {wname} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
