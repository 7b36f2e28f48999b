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

At each length the plan has the MLP tile --mlp-tile auto takes there (the largest that fits;
at the longest length usually its smallest, 64 tokens).

With --seq-parallel P ... it also tabulates sequence parallelism (issue 26) for Llama-3.1-8B on one
card size (--card-gb, default 80): --ranks N (default 8) ranks in groups of P sharing each sequence,
the longest sequence a group fits (a multiple of P), one rank's share of it, and the pinned host
memory per rank and per node of N ranks.

    python3 scripts/bench/max_seq.py [--bin ./train_llama] [--reserve-gib 2] [--json FILE]
                                     [--seq-parallel 1 2 4 8 [--ranks 8] [--card-gb 80] [--weights NF4]]
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


def max_seq(exe, model_dir, quant, gib, extra=()):
    """(longest seq, its plan) or (0, None) when not even one token (one per rank) fits."""
    p = subprocess.run([exe, "--model", model_dir, "--dry-run", "--json", "--max-seq", "--gpu-mem", f"{gib:g}",
                        "--quant", quant, *FLAGS, *extra], capture_output=True, text=True)
    if p.returncode != 0:
        if "flag --max-seq: not even --seq" in p.stderr:
            return 0, None
        raise SystemExit(f"max_seq.py: {model_dir} {quant} {gib} GiB: {p.stderr.strip()}")
    plan = json.loads(p.stdout)
    return plan["max_seq"], plan


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(REPO, "train_llama"))
    ap.add_argument("--reserve-gib", type=float, default=2.0)
    ap.add_argument("--json", help="also write every row (with its whole plan figures) to this file")
    ap.add_argument("--seq-parallel", type=int, nargs="+", metavar="P",
                    help="tabulate only Llama-3.1-8B over --ranks ranks with these --seq-parallel P")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--card-gb", type=float, default=80)
    ap.add_argument("--weights", choices=list(WEIGHTS), default="NF4")
    args = ap.parse_args()
    rows = seq_parallel_table(args) if args.seq_parallel else cards_table(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def seq_parallel_table(args):
    gib = args.card_gb - args.reserve_gib
    model_dir = os.path.join(REPO, "test", "fixtures", MODELS["Llama-3.1-8B"])
    print(f"Longest --seq by plan (not measured), Llama-3.1-8B {args.weights}, LoRA r16, batch 1, --mode lowmem "
          f"--recompute block --offload host,")
    print(f"--ranks {args.ranks}, a {args.card_gb:g} GB card per rank planned as {gib:g} GiB of device memory.")
    print()
    print("| --seq-parallel P | tokens per group | tokens per rank | device GiB per rank | MLP tile | "
          f"pinned host GiB per rank | per node of {args.ranks} |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for P in args.seq_parallel:
        seq, plan = max_seq(args.bin, model_dir, WEIGHTS[args.weights], gib,
                            ("--ranks", str(args.ranks), "--seq-parallel", str(P)))
        if not seq:
            print(f"| {P} | does not fit | | | | | |")
            continue
        host = plan["host_bytes"] / GIB
        print(f"| {P} | {seq:,} | {seq // P:,} | {plan['total_bytes'] / GIB:.2f} | {plan['mlp_tile']} | {host:.1f} | "
              f"{host * args.ranks:.0f} |")
        rows.append(dict(model="Llama-3.1-8B", weights=args.weights, card_gb=args.card_gb, memory_gib=gib,
                         ranks=args.ranks, seq_parallel=P, max_seq=seq, tokens_per_rank=seq // P,
                         host_bytes_per_rank=plan["host_bytes"], device_bytes=plan["total_bytes"],
                         mlp_tile=plan["mlp_tile"]))
    return rows


def cards_table(args):
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
                                 mlp_tile=plan["mlp_tile"] if plan else None,
                                 block_peak_bytes_per_token=plan.get("block_peak_bytes_per_token") if plan else None))
            print(f"| {name} | {wname} | " + " | ".join(cells) + " |")
    return rows


if __name__ == "__main__":
    main()
