#!/usr/bin/env python3
"""Draws the output of scripts/bench/compare_modes.sh as one PNG in the spirit of the paper's Figures 1
and 2: (left) throughput against peak memory per mode, (middle) planned saved activations per
mode, (right) the per-module breakdown of one block's saved activations, baseline vs lowmem.
Usage: python3 scripts/bench/plot_modes.py OUT_DIR [--title TEXT]  (writes OUT_DIR/modes.png)"""
import argparse
import csv
import json
import os
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--title", default="")
    a = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("error: plot_modes.py needs matplotlib (Debian: apt-get install python3-matplotlib)")
    path = os.path.join(a.out_dir, "compare_modes.csv")
    try:
        rows = list(csv.DictReader(open(path)))
        plans = {r["mode"]: json.load(open(os.path.join(a.out_dir, f"plan_{r['mode']}.json"))) for r in rows}
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"error: {path}: cannot read the comparison ({e}); run scripts/bench/compare_modes.sh first")
    modes = [r["mode"] for r in rows]
    colors = {"baseline": "#888888", "lowmem": "#d62728", "ckpt": "#1f77b4"}
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.5))
    for r in rows:
        ax[0].scatter(float(r["peak_mib"]), float(r["throughput"]), s=90, color=colors.get(r["mode"]), label=r["mode"])
        ax[0].annotate(f" {r['mode']}", (float(r["peak_mib"]), float(r["throughput"])))
    ax[0].set_xlabel("measured peak memory (MiB)")
    ax[0].set_ylabel("throughput (per second)")
    ax[0].set_title("throughput vs peak memory")
    saved = [float(r["saved_act_mib"]) for r in rows]
    ax[1].bar(modes, saved, color=[colors.get(m) for m in modes])
    for i, v in enumerate(saved):
        ax[1].text(i, v, f"{v:.2f}", ha="center", va="bottom")
    ax[1].set_ylabel("planned saved activations (MiB)")
    ax[1].set_title("activation memory kept for backward")
    base, low = plans.get("baseline"), plans.get("lowmem")
    if base and low:
        mods = list(dict.fromkeys(list(base["per_block"]) + list(low["per_block"])))
        n = base["tokens"]
        bottom = [0.0, 0.0]
        cmap = plt.get_cmap("tab20")
        for i, m in enumerate(mods):
            vals = [base["per_block"].get(m, 0) / n, low["per_block"].get(m, 0) / n]
            ax[2].bar(["baseline", "lowmem"], vals, bottom=bottom, color=cmap(i % 20), label=m)
            bottom = [bottom[0] + vals[0], bottom[1] + vals[1]]
        ax[2].set_ylabel("bytes per token per block")
        ax[2].set_title(f"per-module breakdown ({100 * (1 - bottom[1] / bottom[0]):.1f}% less)")
        ax[2].legend(fontsize=7, loc="upper right")
    if a.title:
        fig.suptitle(a.title)
    fig.tight_layout()
    out = os.path.join(a.out_dir, "modes.png")
    fig.savefig(out + ".tmp.png", dpi=110)
    os.replace(out + ".tmp.png", out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
