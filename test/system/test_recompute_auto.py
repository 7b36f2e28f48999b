"""--recompute auto and --mem-limit (llmc/train/fit.h, llmc/models/llama_plan.h's llama_fit_recompute,
vit_plan.h's vit_fit_recompute): auto takes the fewest recomputed blocks whose plan fits the budget,
checked against a direct search over --recompute 0..L with the dry run's own verdict ("fits") at
each count; a run says what it chose in one start-up line; a --mem-limit below every plan is refused
in one line naming the smallest budget, which the dry run confirms fits (and a little less does not);
and a CPU run's peak RSS at the chosen count stays within its plan as the kept run's does.

Run:  /usr/bin/python3 -m pytest -q -x -p no:xdist test/system/test_recompute_auto.py
"""
import json
import os
import re
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, OMP_NUM_THREADS="2")
MIB = 1 << 20
MODELS = {
    "llama": (os.path.join(REPO, "train_llama"),
              ["--model", os.path.join(REPO, "data", "llama_demo"), "--data",
               os.path.join(REPO, "data", "llama_demo_ft_train.bin"), "--seq", "128", "--batch", "8"], 4),
    "vit": (os.path.join(REPO, "train_vit"),
            ["--model", os.path.join(REPO, "data", "vit_demo"), "--data",
             os.path.join(REPO, "data", "vit_demo_ft_train.bin"), "--batch", "16"], 4),
}


def run(model, *args, check=True, env=None):
    exe, base, _ = MODELS[model]
    if not os.path.isfile(exe):
        pytest.fail(f"{exe} is missing: build it with `make {os.path.basename(exe)}`")
    p = subprocess.run([exe] + base + ["--device", "cpu", "--threads", "2"] + [str(a) for a in args],
                       capture_output=True, text=True, timeout=300, env=dict(ENV, **(env or {})))
    if check:
        assert p.returncode == 0, p.stderr
    return p


def dry(model, *args):
    return json.loads(run(model, "--dry-run", "--json", *args).stdout)


def need(plan):
    return plan["total_bytes"] + plan["host_bytes"]  # on the CPU the host arena is host memory too


def gib(nbytes):
    return f"{nbytes / (1 << 30):.9f}"


@pytest.mark.parametrize("mode", ["baseline", "lowmem"])
@pytest.mark.parametrize("model", list(MODELS))
def test_auto_takes_the_fewest_blocks_that_fit(model, mode):
    layers = MODELS[model][2]
    sizes = sorted({need(dry(model, "--mode", mode, "--recompute", k)) for k in range(layers + 1)})
    budgets = [(a + b) // 2 for a, b in zip(sizes, sizes[1:])] + [sizes[-1] + MIB]
    for budget in budgets:
        limit = gib(budget)
        fits = [dry(model, "--mode", mode, "--recompute", k, "--mem-limit", limit)["fits"] for k in range(layers + 1)]
        want = fits.index(True)  # the direct search: the fewest blocks whose plan the dry run says fits
        got = dry(model, "--mode", mode, "--recompute", "auto", "--mem-limit", limit)
        assert got["recomputed_blocks"] == want and got["fits"], (budget, fits, got["recomputed_blocks"])
        # a run (its default auto: the mode recomputes nothing) says the same in its start-up line
        p = run(model, "--mode", mode, "--steps", 1, "--mem-limit", limit)
        assert f"recompute {want} of {layers} blocks (the fewest that fit " in p.stdout, p.stdout[:2000]


@pytest.mark.parametrize("model", list(MODELS))
def test_mem_limit_below_every_plan_is_refused_naming_the_smallest_budget(model):
    p = run(model, "--steps", 1, "--mem-limit", gib(MIB), check=False)
    assert p.returncode == 1 and p.stderr.count("\n") == 1, p.stderr
    m = re.search(r"^error: flag --mem-limit: 1\.0 MiB is below anything these flags fit; the smallest budget that "
                  r"would fit is ([0-9.]+) MiB \(recompute (\d+) of (\d+) blocks", p.stderr)
    assert m and m.group(2) == m.group(3), p.stderr
    smallest = float(m.group(1)) * MIB  # printed to 0.1 MiB
    assert dry(model, "--recompute", "auto", "--mem-limit", gib(smallest + 0.1 * MIB))["fits"]
    assert not dry(model, "--recompute", "auto", "--mem-limit", gib(smallest - 0.1 * MIB))["fits"]


def memory_line(out):
    m = re.search(r"memory: planned ([0-9.]+) MiB .*measured peak RSS ([0-9.]+) MiB", out)
    assert m, out[-2000:]
    return float(m.group(1)), float(m.group(2))


@pytest.mark.parametrize("model", list(MODELS))
def test_peak_rss_stays_within_the_plan_at_the_chosen_count(model):
    """The memory a CPU run holds beyond its plan (the binary, libraries, the data, per-call scratch) is
    the same whichever blocks recompute, so a run whose auto recomputes blocks has no more of it than
    the kept run: its peak RSS is within its (smaller) plan as the kept one's is within its own. The
    slack is the allocator's: glibc returns a freed chunk above its 128 KiB mmap threshold at once,
    smaller ones may stay, so 1 MiB."""
    layers = MODELS[model][2]
    kept = run(model, "--mode", "baseline", "--recompute", "none", "--steps", 2).stdout
    sizes = [need(dry(model, "--mode", "baseline", "--recompute", k)) for k in range(layers + 1)]
    budget = (sizes[0] + sizes[layers // 2]) // 2  # recompute some blocks but not all
    out = run(model, "--mode", "baseline", "--steps", 2, "--mem-limit", gib(budget)).stdout
    k = int(re.search(r"recompute (\d+) of", out).group(1))
    assert 0 < k < layers, out[:2000]
    p0, r0 = memory_line(kept)
    pk, rk = memory_line(out)
    assert pk * MIB <= budget and pk < p0
    assert rk - pk <= (r0 - p0) + 1.0, (p0, r0, pk, rk)


def llama_flops(cfg, seq, rank):
    """(step, one block's forward) FLOPs per token of LoRA on every linear, from config.json: a frozen
    product costs 2 in out forward and as much again for its input gradient, an adapter 6 r (in + out)
    in all (2 r (in + out) forward), attention 6 T heads hd in all (a third forward); the head 4 d V."""
    d, f, L, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    H = cfg["num_attention_heads"]
    hd = d // H
    kvd = cfg.get("num_key_value_heads", H) * hd
    shapes = [(d, H * hd), (d, kvd), (d, kvd), (H * hd, d), (d, f), (d, f), (f, d)]
    fwd = sum(2 * i * o + 2 * rank * (i + o) for i, o in shapes) + 2 * seq * H * hd
    step = L * sum(4 * i * o + 6 * rank * (i + o) for i, o in shapes) + L * 6 * seq * H * hd + 4 * d * V
    return step, fwd


def test_fit_report_rows_are_the_plans_and_the_cost_model():
    """--fit report's rows: each mode's count is --recompute auto's under the same --mem-limit, its
    planned bytes that dry run's plan, its predicted step (step + k block forwards) / step from the
    FLOPs counted here from config.json, and the best row the fastest that fits."""
    exe, base, layers = MODELS["llama"]
    with open(os.path.join(base[1], "config.json")) as fh:
        cfg = json.load(fh)
    sizes = sorted({need(dry("llama", "--mode", "baseline", "--recompute", k)) for k in range(layers + 1)})
    limit = gib((sizes[1] + sizes[2]) // 2)
    rep = dry("llama", "--fit", "report", "--mem-limit", limit)
    step, fwd = llama_flops(cfg, 128, 8)
    for row in rep["rows"]:
        plan = dry("llama", "--act", row["act"], "--norm", row["norm"], "--recompute", "auto", "--mem-limit", limit)
        assert row["recomputed_blocks"] == plan["recomputed_blocks"] and row["planned_bytes"] == need(plan), row
        assert row["fits"] == plan["fits"]
        want = (step + row["recomputed_blocks"] * fwd) / step
        assert abs(row["predicted_step"] - want) <= 1e-4 * want, (row, want)  # printed to 4 decimals
    fitting = [r for r in rep["rows"] if r["fits"]]
    assert fitting and rep["best"] == min(fitting, key=lambda r: (r["predicted_step"], r["planned_bytes"]))["mode"]


@pytest.mark.parametrize("model", list(MODELS))
def test_fit_report_after_a_run_is_calibrated_by_its_measured_step(model):
    """--fit report on a training run: after its steps, the dry run's rows at the same --mem-limit
    (counts, plans, ratios), each with a step in ms = the run's measured mean step (after the first)
    over the run's own predicted ratio, times the row's ratio; the run's own row (lowmem at auto's
    count) predicts the measured step itself."""
    layers = MODELS[model][2]
    sizes = sorted({need(dry(model, "--mode", "baseline", "--recompute", k)) for k in range(layers + 1)})
    limit = gib((sizes[1] + sizes[2]) // 2)
    rep = dry(model, "--fit", "report", "--mem-limit", limit)
    out = run(model, "--mode", "lowmem", "--steps", 3, "--fit", "report", "--mem-limit", limit).stdout
    m = re.search(r"calibrated by this run's measured step: ([0-9.]+) ms \(act approx, norm ms, recompute (\d+) of "
                  rf"{layers} blocks\)", out)
    assert m, out
    measured, k = float(m.group(1)), int(m.group(2))
    rows = {r.split()[0]: r.split() for r in out[m.end():].splitlines()[2:2 + len(rep["rows"])]}
    own = next(r for r in rep["rows"] if r["mode"] == "lowmem")
    assert own["recomputed_blocks"] == k
    for r in rep["rows"]:
        got = rows[r["mode"]]  # mode, act,norm, K, of, L, planned, MiB, ratio, ms [, <-, best]
        assert int(got[2]) == r["recomputed_blocks"] and got[7] == f"{r['predicted_step']:.3f}x", (got, r)
        want = measured / own["predicted_step"] * r["predicted_step"]
        # the printed figures: measured to 0.1 ms, each ratio to 4 decimals in the JSON, ms to 0.1
        assert abs(float(got[8]) - want) <= 0.05 + 0.06 + want * 2e-4, (got, want)
    assert float(rows["lowmem"][8]) == pytest.approx(measured, abs=0.11)


def test_fit_report_on_a_run_without_data_is_refused():
    exe, base, _ = MODELS["llama"]
    p = subprocess.run([exe, "--model", base[1], "--eval-only", "--val", base[3], "--fit", "report"],
                       capture_output=True, text=True, timeout=120, env=ENV)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "--fit report" in p.stderr, p.stderr
