#!/usr/bin/env python3
"""The report of scripts/bench/quality.sh: reads OUT/runs/<model>/<mode>/log.csv and writes
OUT/quality.md (a markdown table), OUT/quality.csv and OUT/quality.png (gradient-norm and
training-loss traces per model, one line per mode).

  /usr/bin/python3 scripts/bench/quality_report.py build/quality [--note TEXT]

Per run: the final validation loss (and accuracy for the ViT) from the last row of log.csv
that has one, its difference from baseline's (absolute and relative), and the gradient norm
at step 1, its mean, and its maximum over the run (before clipping, as the trainer logs it).
"""
import argparse
import csv
import math
import os
import sys

MODES = ["baseline", "approx", "ms", "lowmem"]
FLAGS = {"baseline": "--mode baseline", "approx": "--mode baseline --act approx",
         "ms": "--mode baseline --norm ms", "lowmem": "--mode lowmem"}
MODELS = {"smollm2": "SmolLM2-135M, tinyshakespeare", "vit": "demo ViT, Fashion-MNIST 5-9"}


def num(s):
    try:
        v = float(s)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) else v


def read_run(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    steps, loss, gnorm = [], [], []
    val = acc = None
    val0 = None
    for r in rows:
        st = int(r["step"])
        if num(r.get("grad_norm")) is not None:
            steps.append(st)
            gnorm.append(num(r["grad_norm"]))
            loss.append(num(r["loss"]))
        if num(r.get("val_loss")) is not None:
            if st == 0:
                val0 = num(r["val_loss"])
            val = num(r["val_loss"])
            acc = num(r.get("val_accuracy"))
    return {"steps": steps, "loss": loss, "gnorm": gnorm, "val": val, "val0": val0, "acc": acc}


def fmt(v, f="%.4f"):
    return "n/a" if v is None else f % v


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--note", default="")
    a = ap.parse_args()

    runs = {}
    for model in MODELS:
        for mode in MODES:
            p = os.path.join(a.out, "runs", model, mode, "log.csv")
            if os.path.isfile(p):
                r = read_run(p)
                sp = os.path.join(a.out, "runs", model, mode, "seconds")
                r["seconds"] = open(sp).read().strip() if os.path.isfile(sp) else "n/a"
                runs.setdefault(model, {})[mode] = r
    if not runs:
        sys.exit(f"quality_report: no runs under {a.out}/runs")

    header = ["model", "mode", "flags", "val loss (step 0)", "final val loss", "vs baseline",
              "vs baseline (%)", "val acc", "grad norm step 1", "grad norm mean", "grad norm max",
              "max abs grad norm diff vs baseline", "seconds"]
    table = []
    for model, ms in runs.items():
        base = ms.get("baseline", {}).get("val")
        bg = ms.get("baseline", {}).get("gnorm")
        for mode in MODES:
            if mode not in ms:
                continue
            r = ms[mode]
            d = None if (base is None or r["val"] is None) else r["val"] - base
            g = r["gnorm"]
            gd = max(abs(x - y) for x, y in zip(g, bg)) if (bg and g and len(bg) == len(g)) else None
            table.append([model, mode, FLAGS[mode], fmt(r["val0"]), fmt(r["val"]),
                          "n/a" if d is None else "%+.4f" % d,
                          "n/a" if d is None else "%+.2f" % (100.0 * d / base),
                          fmt(r["acc"]) if model == "vit" else "",
                          fmt(g[0] if g else None, "%.3f"),
                          fmt(sum(g) / len(g) if g else None, "%.3f"),
                          fmt(max(g) if g else None, "%.3f"), fmt(gd, "%.2e"), r["seconds"]])

    with open(os.path.join(a.out, "quality.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(table)
    md = ["# Quality report: baseline vs the paper's layers", ""]
    if a.note:
        md += [a.note, ""]
    md += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    md += ["| " + " | ".join(c if c else " " for c in row) + " |" for row in table]
    md += ["", "vs baseline: final validation loss minus baseline's (same model, data, seed and steps). "
           "`ms` is exact (it should match baseline up to float rounding); `approx` is the 2-bit "
           "ReSiLU2/ReGELU2 backward alone; lowmem is both. Gradient norms are before clipping; the diff "
           "column is the largest |grad norm - baseline's| over the steps.",
           "", "Plot: quality.png"]
    with open(os.path.join(a.out, "quality.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("quality_report: matplotlib not available, no plot", file=sys.stderr)
        return
    models = list(runs)
    fig, axes = plt.subplots(len(models), 2, figsize=(12, 4 * len(models)), squeeze=False)
    styles = {"baseline": ("k", "-"), "approx": ("tab:orange", "--"), "ms": ("tab:blue", ":"),
              "lowmem": ("tab:red", "-.")}
    for i, model in enumerate(models):
        for mode in MODES:
            r = runs[model].get(mode)
            if not r or not r["steps"]:
                continue
            c, ls = styles[mode]
            lab = f"{mode} (val {fmt(r['val'])})"
            axes[i][0].plot(r["steps"], r["gnorm"], color=c, linestyle=ls, label=lab)
            axes[i][1].plot(r["steps"], r["loss"], color=c, linestyle=ls, label=lab)
        axes[i][0].set_title(f"{MODELS[model]}: gradient norm (before clipping)")
        axes[i][1].set_title(f"{MODELS[model]}: training loss")
        for ax in axes[i]:
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    if a.note:
        fig.suptitle(a.note, fontsize=9)
    fig.tight_layout()
    png = os.path.join(a.out, "quality.png")
    fig.savefig(png, dpi=100)
    print(f"wrote {os.path.join(a.out, 'quality.md')}, quality.csv, {png}")


if __name__ == "__main__":
    main()
