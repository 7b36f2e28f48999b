#!/usr/bin/env python3
"""make bench-fit (issue 38): the fastest run that fits, measured on the CPU. At the SmolLM2-135M
shape (random init, batch 1 x --seq 2048) and a ViT-B/16 shape (224x224, batch 8), three budgets
(--mem-limit): one where baseline fits without recomputing, one where baseline must recompute every
block, one in between. At each: baseline-auto (--mode baseline --recompute auto), lowmem-auto
(--mode lowmem --recompute auto) and full checkpointing (--mode ckpt), with the blocks each
recomputes, the measured throughput (--profile's step time, after the first step) and peak RSS, and the step
predicted by --dry-run --fit report's cost model (llmc/train/fit_report.h), calibrated by the
measured baseline step with no block recomputed. Writes build/bench_fit/bench_fit.{md,json} and,
where matplotlib is installed (scripts/ci/install_deps.sh), bench_fit.png: throughput against peak
memory, one point per mode and budget (the paper's Figure 1).

    /usr/bin/python3 scripts/bench/bench_fit.py [--steps 2] [--threads 2] [--seq 2048] [--models llama,vit]
"""
import argparse
import json
import os
import re
import subprocess
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(REPO, "scripts", d) for d in ("formats", "data")]
import prepare_images as pi  # noqa: E402
import shards  # noqa: E402

OUT = os.path.join(REPO, "build", "bench_fit")
MIB = 1 << 20
SMOLLM2 = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 576,
           "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "vocab_size": 49152, "max_position_embeddings": 8192, "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
           "rope_theta": 100000.0, "bos_token_id": 1, "eos_token_id": 2}
VIT_B16 = {"model_type": "vit", "architectures": ["ViTForImageClassification"], "hidden_size": 768,
           "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12, "image_size": 224,
           "patch_size": 16, "num_channels": 3, "layer_norm_eps": 1e-12, "hidden_act": "gelu", "qkv_bias": True}
RUNS = [("baseline-auto", ["--mode", "baseline", "--recompute", "auto"]),
        ("lowmem-auto", ["--mode", "lowmem", "--recompute", "auto"]),
        ("ckpt", ["--mode", "ckpt"])]


def write_inputs(seq):
    """The two random-init model directories and their data shards under build/bench_fit."""
    rng = np.random.default_rng(0)
    llama, vit = os.path.join(OUT, "smollm2_135m"), os.path.join(OUT, "vit_b16")
    for d, cfg in ((llama, SMOLLM2), (vit, VIT_B16)):
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
    toks = rng.integers(3, SMOLLM2["vocab_size"], size=64 * (seq + 1)).astype(np.uint32)
    shards.write_shard(os.path.join(llama, "tokens.bin"), toks, np.ones(toks.size, np.uint8), SMOLLM2["vocab_size"])
    pi.write_shard(os.path.join(vit, "images.bin"), rng.integers(0, 256, (64, 224, 224, 3), dtype=np.uint8),
                   rng.integers(0, 10, 64), 10)
    return {"llama": (os.path.join(REPO, "train_llama"), ["--model", llama, "--data", os.path.join(llama, "tokens.bin"),
                                                          "--batch", "1", "--seq", str(seq)], seq, "tok"),
            "vit": (os.path.join(REPO, "train_vit"), ["--model", vit, "--data", os.path.join(vit, "images.bin"),
                                                      "--batch", "8"], 8, "img")}


def run(cmd, threads):
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=dict(os.environ,
                       OMP_NUM_THREADS=str(threads)))
    if p.returncode != 0:
        sys.exit(f"bench_fit: {' '.join(map(str, cmd))} failed:\n{p.stderr[-2000:]}")
    return p.stdout


def plan_bytes(exe, args, threads, *flags):
    d = json.loads(run([exe] + args + ["--device", "cpu", "--dry-run", "--json"] + list(flags), threads))
    return d["total_bytes"] + d["host_bytes"]


def budgets(exe, args, layers, threads):
    """(name, bytes): baseline fits without recompute; baseline must recompute every block (1 MiB above
    full checkpointing's plan: a block kept costs tens of MiB at these shapes); between."""
    p = [plan_bytes(exe, args, threads, "--mode", "baseline", "--recompute", k) for k in (0, layers)]
    return [("roomy", p[0] + MIB), ("between", (p[0] + p[1]) // 2), ("tight", p[1] + MIB)]


def measure(exe, args, flags, limit_gib, steps, threads, items):
    out = run([exe] + args + ["--device", "cpu", "--threads", threads, "--steps", steps, "--random-init", "--profile",
                              "--mem-limit", limit_gib] + flags, threads)
    # --profile's step time (the steps after the first, which warms up), not the log line's rounded rate
    step_ms = float(re.search(r"([0-9.]+) ms per step", out).group(1))
    rss = float(re.search(r"measured peak RSS ([0-9.]+) MiB", out).group(1))
    planned = float(re.search(r"memory: planned ([0-9.]+) MiB", out).group(1))
    k = re.search(r"recompute (\d+) of (\d+) blocks", out)
    return {"rate": items / (step_ms / 1000.0), "step_ms": step_ms, "rss_mib": rss, "planned_mib": planned,
            "recomputed": int(k.group(1)) if k else None}


def predicted_ratios(exe, args, limit_gib, threads):
    rep = json.loads(run([exe] + args + ["--device", "cpu", "--dry-run", "--fit", "report", "--json", "--mem-limit",
                                         limit_gib], threads))
    return {r["mode"]: r for r in rep["rows"]}


def bench_model(name, exe, args, items, unit, a):
    layers = (SMOLLM2 if name == "llama" else VIT_B16)["num_hidden_layers"]
    rows, ckpt = [], None
    for bname, nbytes in budgets(exe, args, layers, a.threads):
        limit = f"{nbytes / (1 << 30):.9f}"
        rep = predicted_ratios(exe, args, limit, a.threads)
        for label, flags in RUNS:
            if label == "ckpt":  # the same run at every budget (all of them hold it): measured once
                ckpt = ckpt or measure(exe, args, flags, limit, a.steps, a.threads, items)
                m, mode = dict(ckpt, recomputed=layers), "baseline"  # every block: the baseline's FLOPs at k = L
            else:
                m, mode = measure(exe, args, flags, limit, a.steps, a.threads, items), label.split("-")[0]
            row = rep[mode]
            rows.append(dict(model=name, budget=bname, budget_mib=nbytes / MIB, run=label, **m,
                             predicted_ratio=None, fits_report=row["fits"], report_k=row["recomputed_blocks"]))
            print(f"{name:5s} {bname:8s} {label:13s} k={m['recomputed']:>2}/{layers} {m['rate']:8.1f} {unit}/s "
                  f"RSS {m['rss_mib']:7.1f} MiB (plan {m['planned_mib']:7.1f})", file=sys.stderr)
    # the cost model's ratio at k blocks: 1 + k c, c from a report row with k > 0 (c is the same for all modes)
    per_block = None
    for bname, nbytes in budgets(exe, args, layers, a.threads):
        rep = predicted_ratios(exe, args, f"{nbytes / (1 << 30):.9f}", a.threads)
        for r in rep.values():
            if r["recomputed_blocks"] > 0:
                per_block = (r["predicted_step"] - 1.0) / r["recomputed_blocks"]
    base = next(r for r in rows if r["budget"] == "roomy" and r["run"] == "baseline-auto")
    t0 = items / base["rate"]  # the calibration: the measured baseline step with no block recomputed
    for r in rows:
        r["predicted_ratio"] = 1.0 + (per_block or 0.0) * r["recomputed"]
        r["predicted_rate"] = items / (t0 * r["predicted_ratio"])
        r["error_pct"] = 100.0 * (r["predicted_rate"] - r["rate"]) / r["rate"]
    return rows


def table(rows):
    lines = ["| model | budget | run | recomputed | measured /s | predicted /s | error | peak RSS MiB | plan MiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['budget']} ({r['budget_mib']:.0f} MiB) | {r['run']} | {r['recomputed']} | "
                     f"{r['rate']:.3g} | {r['predicted_rate']:.3g} | {r['error_pct']:+.1f}% | {r['rss_mib']:.0f} | "
                     f"{r['planned_mib']:.0f} |")
    return "\n".join(lines)


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench_fit: matplotlib is not installed (scripts/ci/install_deps.sh installs python3-matplotlib): "
              "no PNG", file=sys.stderr)
        return False
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5))
    for ax, model in zip(np.atleast_1d(axes), models):
        for run, marker in (("baseline-auto", "o"), ("lowmem-auto", "s"), ("ckpt", "^")):
            pts = [r for r in rows if r["model"] == model and r["run"] == run]
            ax.scatter([r["rss_mib"] for r in pts], [r["rate"] for r in pts], marker=marker, label=run)
            for r in pts:
                ax.annotate(f"{r['budget']} k={r['recomputed']}", (r["rss_mib"], r["rate"]), fontsize=7)
        ax.set_xlabel("peak RSS (MiB)")
        ax.set_ylabel("tokens/s" if model == "llama" else "images/s")
        ax.set_title(f"{model}: throughput vs peak memory (CPU)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2, help="steps per run (the first is not counted)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048, help="the SmolLM2 shape's sequence (2048-4096)")
    ap.add_argument("--models", default="llama,vit")
    a = ap.parse_args()
    a.steps, a.threads = str(a.steps), str(a.threads)
    os.makedirs(OUT, exist_ok=True)
    inputs = write_inputs(a.seq)
    rows = []
    for name in a.models.split(","):
        exe, args, items, unit = inputs[name]
        rows += bench_model(name, exe, args, items, unit, a)
    md = table(rows)
    print(md)
    with open(os.path.join(OUT, "bench_fit.md"), "w") as f:
        f.write(md + "\n")
    with open(os.path.join(OUT, "bench_fit.json"), "w") as f:
        json.dump(rows, f, indent=1)
    if plot(rows, os.path.join(OUT, "bench_fit.png")):
        print(f"bench_fit: {os.path.join(OUT, 'bench_fit.png')}")


if __name__ == "__main__":
    main()
