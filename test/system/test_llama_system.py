"""train_llama as a system: data parallelism over mpirun equals one process with the combined
batch; a failing rank stops the job; SIGKILL + --resume equals an uninterrupted run bit for bit;
a mismatched resume is refused; PEFT adapters out and back in, across norm modes, and against the
independent PyTorch reference."""
import json
import os
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

import llama_cases as lc
import reference_llama as ref
import shards
import st_io
from test_llama_train import BIN, ENV, expect_error, losses, run
# The test build: the same trainer with the fault injectors compiled in (-DLLMC_FAULTS, llmc/settings.h),
# for the runs that inject a fault
FAULT_BIN = os.path.join(lc.REPO, "build", "test", "train_llama")


def binary_for(env):
    return FAULT_BIN if any(k.startswith("LLMC_FAULT_") for k in (env or {})) else BIN

MPIRUN = shutil.which("mpirun")
ONE_BYTE_BUCKETS = {"LLMC_GRAD_BUCKET_BYTES": "1"}  # every block its own gradient bucket


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("sys")
    cfg = lc.model_config("gqa_untied")
    lc.write_model(str(d / "model"), cfg, seed=4)
    rng = np.random.default_rng(1)
    toks = np.tile(rng.integers(3, cfg["vocab_size"], size=13), 600)
    flip = rng.random(toks.size) < 0.1
    toks[flip] = rng.integers(3, cfg["vocab_size"], size=flip.sum())
    mask = (rng.random(toks.size) > 0.2).astype(np.uint8)
    shards.write_shard(str(d / "train.bin"), toks.astype(np.uint32), mask, cfg["vocab_size"])
    shards.write_shard(str(d / "val.bin"), toks[:1500].astype(np.uint32), mask[:1500], cfg["vocab_size"])
    return d


def base_args(tiny, *extra):
    return ["--model", tiny / "model", "--data", tiny / "train.bin", "--seq", 24, "--lora-rank", 4, "--lr", 5e-3,
            "--seed", 11, "--threads", 1, *extra]


def adapter(dir_):
    return st_io.load(str(dir_ / "adapter_model.safetensors"))


def mpirun(np_, args, check=True, timeout=120, env=None):
    """np_ ranks of the trainer; env: variables set for every rank."""
    if not MPIRUN:
        pytest.fail("mpirun not found: install openmpi-bin (scripts/ci/install_deps.sh does)")
    exports = [x for k, v in (env or {}).items() for x in ("-x", f"{k}={v}")]
    cmd = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-np", str(np_)] + exports + [binary_for(env)] + \
        [str(a) for a in args]
    p = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout)
    if check and p.returncode != 0:
        pytest.fail(f"mpirun failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


# ---- data parallelism ------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["baseline", "lowmem"])
def test_two_ranks_equal_one_process_accumulating_their_batches(tiny, tmp_path, mode):
    """2 ranks x batch 2 against 1 process x batch 2 x --grad-accum 2: the same two micro-batches
    (rank r's is the process's micro-batch r), normalised by the same global token count. Each rank
    sums its rows in the order the process sums that micro-batch, and a sum of two partial
    gradients is exact in either order, so the adapters must be the same bits: no tolerance, and
    so nothing that depends on the CPU (comparing against one batch of 4 would not be: its
    weight-gradient sums group the rows differently and AdamW amplifies that rounding). The only
    reordering left is the clip norm's sum of squares, in fp64, rounded once to fp32."""
    one = run(base_args(tiny, "--mode", mode, "--steps", 5, "--batch", 2, "--grad-accum", 2, "--out", tmp_path / "one"))
    two = mpirun(2, base_args(tiny, "--mode", mode, "--steps", 5, "--batch", 2, "--out", tmp_path / "two"))
    assert losses(one.stdout) == losses(two.stdout) and len(losses(one.stdout)) == 5
    a, b = adapter(tmp_path / "one"), adapter(tmp_path / "two")
    assert a.keys() == b.keys() and len(a) == 2 * 7 * 2
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert "2 ranks" in two.stdout and "per rank" in two.stdout


def test_two_ranks_step_one_equals_one_combined_batch(tiny):
    """Step 1 of 2 ranks x batch 2 against 1 process x batch 4, before any update has amplified
    anything: the forward is row by row (the same bits), the loss is an fp64 sum, and the gradient
    differs only by fp32 reordering of the weight-gradient row sums (relative error under
    96 rows x 2^-24 ~ 6e-6 per element, and the norm inherits that bound). The log prints the grad
    norm to 4 decimals, so the printed values may differ by one unit in the last place plus that."""
    one = run(base_args(tiny, "--steps", 1, "--batch", 4))
    two = mpirun(2, base_args(tiny, "--steps", 1, "--batch", 2))
    assert losses(one.stdout) == losses(two.stdout)
    gn = lambda out: float(out.split("| grad norm ")[1].split()[0])  # noqa: E731
    assert abs(gn(one.stdout) - gn(two.stdout)) <= 1e-4 + 6e-6 * gn(one.stdout), (gn(one.stdout), gn(two.stdout))


def test_failing_rank_stops_the_job(tiny, tmp_path):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"nope" * 40)
    t0 = time.time()
    p = mpirun(2, base_args(tiny, "--steps", 3, "--batch", 2, "--data", bad), check=False, timeout=60)
    assert p.returncode != 0
    assert "bad.bin" in p.stderr and "magic" in p.stderr
    assert time.time() - t0 < 30


# ---- non-finite steps ------------------------------------------------------------------------

FAULT_AT_2 = {"LLMC_FAULT_NONFINITE_STEP": "2"}  # step 2's loss becomes NaN, as in a diverging run


def run_env(args, env, check=True):
    p = subprocess.run([binary_for(env)] + [str(a) for a in args], capture_output=True, text=True, env=dict(ENV, **env),
                       timeout=120)
    if check and p.returncode != 0:
        pytest.fail(f"train_llama failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


@pytest.mark.parametrize("ranks", [1, 2])
def test_nonfinite_step_stops_or_is_skipped(tiny, tmp_path, ranks):
    """--nonfinite stop (default): a NaN loss ends the run with one error line. --nonfinite skip:
    the step leaves weights and optimizer state alone, so a run whose last step is skipped equals
    one stopped before it, bit for bit, on one rank or two (every rank decides the same)."""
    go = (lambda a, env, check=True: run_env(a, env, check)) if ranks == 1 else \
         (lambda a, env, check=True: mpirun(2, a, check=check, env=env))
    args = base_args(tiny, "--steps", 2, "--batch", 2)
    p = go(args, FAULT_AT_2, check=False)
    assert p.returncode != 0 and "step 2: non-finite loss (nan)" in p.stderr and "--nonfinite skip" in p.stderr, p.stderr
    if ranks == 1:
        assert p.stderr.count("\n") == 1, p.stderr
    skipped = go(args + ["--nonfinite", "skip", "--out", tmp_path / "skip"], FAULT_AT_2)
    assert "step    2/2 | loss nan" in skipped.stdout and "skipped: non-finite loss or gradient" in skipped.stdout
    go(args + ["--stop-at", 1, "--out", tmp_path / "one_step"], {})
    a, b = adapter(tmp_path / "skip"), adapter(tmp_path / "one_step")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_nonfinite_skips_stop_after_ten_in_a_row(tiny):
    """A run that diverges for good (lr 1e38: the weights overflow) stops after 10 skipped steps
    instead of spinning to the end."""
    p = run_env(base_args(tiny, "--steps", 40, "--batch", 2, "--lr", "1e38", "--nonfinite", "skip"), {}, check=False)
    assert p.returncode == 1, p.stdout[-2000:]
    assert "10 steps in a row were skipped for a non-finite loss or gradient" in p.stderr, p.stderr
    assert p.stdout.count("skipped: non-finite") == 9  # the tenth stops the run before its log line


# ---- resume ----------------------------------------------------------------------------------

def test_sigkill_then_resume_is_bit_identical(tiny, tmp_path):
    steps = 120
    args = base_args(tiny, "--mode", "lowmem", "--steps", steps, "--batch", 8, "--save-every", 3)
    run(args + ["--out", tmp_path / "straight"])
    out = tmp_path / "killed"
    p = subprocess.Popen([BIN] + [str(a) for a in args + ["--out", out]], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    state = out / "train_state.bin"
    deadline = time.time() + 60
    while time.time() < deadline and p.poll() is None:  # kill right after the second save
        if state.exists() and (out / "log.csv").exists() and len((out / "log.csv").read_text().splitlines()) >= 7:
            break
        time.sleep(0.002)
    p.send_signal(signal.SIGKILL)
    p.wait()
    done = len((out / "log.csv").read_text().splitlines()) - 1
    assert p.returncode == -signal.SIGKILL and done < steps, "the run finished before it could be killed"
    assert not (out / "train_state.bin.tmp").exists() or state.exists()
    r = run(base_args(tiny, "--mode", "lowmem", "--steps", steps, "--batch", 8, "--save-every", 3, "--resume", out))
    resumed_at = int(r.stdout.split("at step ")[1].split()[0])
    print(f"killed after {done} logged steps, resumed at step {resumed_at}")
    assert 0 < resumed_at <= done
    a, b = adapter(tmp_path / "straight"), adapter(out)
    for k in a:
        assert np.array_equal(a[k], b[k]), k
    assert (tmp_path / "straight" / "train_state.bin").read_bytes() == state.read_bytes()


def test_mismatched_resume_is_refused(tiny, tmp_path):
    out = tmp_path / "run"
    run(base_args(tiny, "--steps", 2, "--batch", 2, "--out", out))
    expect_error(base_args(tiny, "--steps", 4, "--batch", 2, "--resume", out, "--lora-rank", 8), "train_state.bin", "rank=4", "rank=8")
    expect_error(base_args(tiny, "--steps", 4, "--batch", 2, "--resume", out, "--mode", "baseline"), "train_state.bin", "act=approx")
    expect_error(base_args(tiny, "--steps", 4, "--batch", 2, "--resume", tmp_path / "none"), "--resume")


# ---- adapters --------------------------------------------------------------------------------

def test_peft_adapter_layout(tiny, tmp_path):
    out = tmp_path / "a"
    run(base_args(tiny, "--steps", 2, "--batch", 2, "--out", out, "--lora-targets", "q,v,down"))
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 16 and cfg["task_type"] == "CAUSAL_LM"
    assert cfg["target_modules"] == ["q_proj", "v_proj", "down_proj"]
    t = adapter(out)
    d, f, kv = 48, 100, 24
    want = {}
    for l in range(2):
        p = f"base_model.model.model.layers.{l}."
        want[p + "self_attn.q_proj.lora_A.weight"] = (4, d)
        want[p + "self_attn.q_proj.lora_B.weight"] = (d, 4)
        want[p + "self_attn.v_proj.lora_A.weight"] = (4, d)
        want[p + "self_attn.v_proj.lora_B.weight"] = (kv, 4)
        want[p + "mlp.down_proj.lora_A.weight"] = (4, f)
        want[p + "mlp.down_proj.lora_B.weight"] = (d, 4)
    assert {k: v.shape for k, v in t.items()} == want


def test_rslora_adapter_round_trip(tiny, tmp_path):
    """--lora-rslora scales the update by alpha/sqrt(r) (PEFT's use_rslora) and the adapter written
    says so. Read back with the flag, it is exactly the plain adapter of lora_alpha*sqrt(r) with
    the same tensors (r = 4: 16/sqrt(4) = 32/4): the merged exports are equal byte for byte, and
    another scale exports otherwise. Without the flag it is refused, as a plain adapter is with it.
    A plain adapter's config says use_rslora false and every other math option at its default."""
    rs, plain = tmp_path / "rs", tmp_path / "plain"
    run(base_args(tiny, "--steps", 3, "--batch", 2, "--out", rs, "--lora-rslora"))
    cfg = json.loads((rs / "adapter_config.json").read_text())
    assert cfg["use_rslora"] is True and cfg["r"] == 4 and cfg["lora_alpha"] == 16
    shutil.copytree(rs, plain)
    (plain / "adapter_config.json").write_text(json.dumps(dict(cfg, use_rslora=False, lora_alpha=32)))

    def export(name, *a):
        run(["--model", tiny / "model", "--lora-rank", 4, "--export-merged", tmp_path / name, *a])
        return (tmp_path / name / "model.safetensors").read_bytes()
    assert export("m_rs", "--adapter", rs, "--lora-rslora") == export("m_plain", "--adapter", plain, "--lora-alpha", 32)
    (plain / "adapter_config.json").write_text(json.dumps(dict(cfg, use_rslora=False)))
    assert export("m_alpha_r", "--adapter", plain) != export("m_rs2", "--adapter", rs, "--lora-rslora")
    expect_error(["--model", tiny / "model", "--lora-rank", 4, "--adapter", rs, "--export-merged", tmp_path / "x"],
                 "adapter_config.json", "use_rslora is true", "--lora-rslora")
    expect_error(["--model", tiny / "model", "--lora-rank", 4, "--adapter", plain, "--lora-rslora",
                  "--export-merged", tmp_path / "x"], "adapter_config.json", "use_rslora is false")
    run(base_args(tiny, "--steps", 1, "--batch", 2, "--out", tmp_path / "default"))
    cfg = json.loads((tmp_path / "default" / "adapter_config.json").read_text())
    want = {"use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "layers_to_transform": None,
            "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}, "bias": "none", "modules_to_save": None}
    assert {k: cfg[k] for k in want} == want


def eval_loss(tiny, *extra):
    p = run(["--model", tiny / "model", "--val", tiny / "val.bin", "--eval-only", "--seq", 24, "--batch", 4, "--lora-rank", 4,
             "--threads", 1, *extra])
    return float(p.stdout.split("val loss ")[-1].split()[0])


def test_adapter_round_trip_across_norm_modes_and_against_pytorch(tiny, tmp_path):
    """An adapter trained with MS-RMSNorm (merged gamma) is written in the original model's layout:
    loading it into a standard-norm model, or into the PyTorch reference of the original model,
    gives the same loss as the merged model it was trained in."""
    out = tmp_path / "ms"
    trained = run(base_args(tiny, "--mode", "lowmem", "--steps", 8, "--batch", 4, "--out", out, "--val", tiny / "val.bin",
                            "--val-batches", 4))
    val_ms = float((out / "log.csv").read_text().splitlines()[-1].split(",")[-1])  # 6 digits; stdout has 4
    fresh = eval_loss(tiny, "--val-batches", 4)
    std = eval_loss(tiny, "--val-batches", 4, "--adapter", out, "--mode", "baseline")
    ms = eval_loss(tiny, "--val-batches", 4, "--adapter", out, "--mode", "lowmem")
    print(f"val loss: fresh {fresh:.6f}, trained (ms) {val_ms:.6f}, adapter in std {std:.6f}, in ms {ms:.6f}")
    assert abs(std - val_ms) < 2e-6 * val_ms and abs(ms - val_ms) < 2e-6 * val_ms
    assert fresh - val_ms > 0.05
    # the PyTorch reference of the ORIGINAL model (std norms) with the PEFT tensors as they are
    toks, mask = shards.read_shard(str(tiny / "val.bin"))[:2]
    T = 24
    n = 4 * 4  # --val-batches 4 micro-batches of --batch 4 windows, in order
    windows = np.stack([toks[i * T: i * T + T + 1] for i in range(n)]).astype(np.int32)
    wmask = np.stack([mask[i * T + 1: i * T + T + 1] for i in range(n)]).astype(np.float32)
    case = {"tokens": windows, "mask": wmask}
    t = adapter(out)
    for l in range(2):
        for tg, mod in ref._MODULE_OF.items():
            case[f"lora.{l}.{tg}.A"] = t[f"base_model.model.model.layers.{l}.{mod}.lora_A.weight"]
            case[f"lora.{l}.{tg}.B"] = t[f"base_model.model.model.layers.{l}.{mod}.lora_B.weight"]
    want = ref.run_case(str(tiny / "model"), case, act="exact", norm="std", lora_rank=4, lora_alpha=16.0,
                        targets=list(ref._MODULE_OF))
    print(f"PyTorch reference loss of base + PEFT adapter: {float(want['loss'][0]):.6f}")
    assert abs(float(want["loss"][0]) - std) < 1e-4 * std


# ---- merged export ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_export_merged_equals_base_plus_adapter(tiny, tmp_path, dtype):
    model = tiny / "model"
    if dtype == "bf16":  # the same model stored in bf16: the export must keep that dtype
        model = tmp_path / "bf16"
        model.mkdir()
        shutil.copy(tiny / "model" / "config.json", model / "config.json")
        st_io.save(str(model / "model.safetensors"), st_io.load(str(tiny / "model" / "model.safetensors")), bf16=True)
    ad, merged = tmp_path / "ad", tmp_path / "merged"
    run(["--model", model, "--data", tiny / "train.bin", "--seq", 24, "--lora-rank", 4, "--lr", 5e-3, "--steps", 6, "--batch", 4,
         "--threads", 1, "--mode", "lowmem", "--out", ad, "--export-merged", merged])
    base = st_io.load(str(model / "model.safetensors"), raw=True)
    out = st_io.load(str(merged / "model.safetensors"), raw=True)
    assert base.keys() == out.keys()
    hdr = st_io.read_header(str(merged / "model.safetensors"))[0]
    assert {hdr[k]["dtype"] for k in base} == {"BF16" if dtype == "bf16" else "F32"}
    for k in base:  # only the adapted linears change
        assert np.array_equal(base[k], out[k]) == (".self_attn." not in k and ".mlp." not in k), k
    # W + alpha/r B A for one linear, from the PEFT tensors (original layout)
    a = adapter(ad)
    f32 = lambda path: st_io.load(str(path / "model.safetensors"))
    name = "model.layers.1.mlp.gate_proj.weight"
    pre = "base_model.model.model.layers.1.mlp.gate_proj."
    want = f32(model)[name] + 4.0 * a[pre + "lora_B.weight"] @ a[pre + "lora_A.weight"]
    got = f32(merged)[name]
    tol = 1e-2 if dtype == "bf16" else 1e-5
    assert np.abs(got - want).max() <= tol * np.abs(want).max()
    # the same function: merged model alone vs base + adapter, in both norm modes
    ev = lambda m, *x: float(run(["--model", m, "--val", tiny / "val.bin", "--eval-only", "--seq", 24, "--batch", 4, "--lora-rank", 4,
                                  "--threads", 1, *x]).stdout.split("val loss ")[-1])
    with_adapter = ev(model, "--adapter", ad, "--mode", "baseline")
    for mode in ["baseline", "lowmem"]:
        alone = ev(merged, "--mode", mode)
        print(f"{dtype} {mode}: base+adapter {with_adapter:.6f}, merged {alone:.6f}")
        assert abs(alone - with_adapter) < (2e-3 if dtype == "bf16" else 2e-6) * with_adapter


# ---- MS-RMSNorm under LoRA trains what standard norms train -----------------------------------

def log_losses(out):
    return [float(line.split(",")[1]) for line in (out / "log.csv").read_text().splitlines()[1:]]


@pytest.mark.parametrize("act", ["exact", "approx"])
def test_ms_lora_trains_what_std_trains(tiny, tmp_path, act):
    """8 steps under --norm ms equal 8 steps under --norm std: the same per-step losses and the same
    adapters, up to float rounding; the paper's --ms-lora merged is another optimisation problem.
    Tolerances: one step's fp32 LoRA gradients of the two agree within 2 TOL["grad"] and the losses
    within 2 TOL["loss"] (test_llama_model.py::test_ms_lora_gradients_equal_std); each AdamW step
    moves an element by at most lr with m/sqrt(v) perturbed by the same relative amount, so after 8
    steps the adapters agree within 8 * 2 TOL["grad"] of their largest element, the losses within
    8 * 2 TOL["loss"]."""
    steps = 8
    outs = {}
    for name, flags in [("std", ["--norm", "std"]), ("ms", ["--norm", "ms"]), ("merged", ["--norm", "ms", "--ms-lora", "merged"])]:
        outs[name] = tmp_path / name
        run(base_args(tiny, "--act", act, *flags, "--steps", steps, "--batch", 4, "--out", outs[name]))
    loss = {k: log_losses(v) for k, v in outs.items()}
    ad = {k: adapter(v) for k, v in outs.items()}
    d_loss = {k: max(abs(a - b) / b for a, b in zip(loss[k], loss["std"])) for k in ("ms", "merged")}
    d_ad = {k: max(lc.rel_to_max(ad[k][n], ad["std"][n]) for n in ad["std"]) for k in ("ms", "merged")}
    tol_loss, tol_ad = steps * 2 * lc.TOL["loss"], steps * 2 * lc.TOL["grad"]
    print(f"{act}: ms vs std: losses {d_loss['ms']:.2e}, adapters {d_ad['ms']:.2e}; "
          f"--ms-lora merged vs std: losses {d_loss['merged']:.2e}, adapters {d_ad['merged']:.2e}")
    assert len(loss["ms"]) == steps and d_loss["ms"] < tol_loss and d_ad["ms"] < tol_ad
    assert d_loss["merged"] > tol_loss and d_ad["merged"] > tol_ad


def test_export_with_a_zero_gamma(tiny, tmp_path):
    """A model with zero gammas trains under MS-RMSNorm and exports its merged weights: the adapter
    is the original model's, so nothing divides by gamma (the paper's --ms-lora merged cannot map it
    back, and says so in one line). The export equals W + alpha/r B A from the PEFT tensors."""
    model = tmp_path / "zero"
    model.mkdir()
    shutil.copy(tiny / "model" / "config.json", model / "config.json")
    t = st_io.load(str(tiny / "model" / "model.safetensors"))
    for k in t:
        if k.endswith("layernorm.weight"):
            t[k][::5] = 0.0
    st_io.save(str(model / "model.safetensors"), t)
    ad, merged = tmp_path / "ad", tmp_path / "merged"
    args = ["--model", model, "--data", tiny / "train.bin", "--seq", 24, "--lora-rank", 4, "--lr", 5e-3, "--steps", 4, "--batch", 4,
            "--threads", 1, "--mode", "lowmem"]
    run(args + ["--out", ad, "--export-merged", merged])
    a, got = adapter(ad), st_io.load(str(merged / "model.safetensors"))
    for name in ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"]:
        pre = "base_model.model." + name[:-len("weight")]
        want = t[name] + 4.0 * a[pre + "lora_B.weight"] @ a[pre + "lora_A.weight"]
        assert np.abs(got[name] - want).max() <= 1e-5 * np.abs(want).max(), name  # fp32 sums of r = 4 products
    expect_error(args + ["--ms-lora", "merged", "--export-merged", tmp_path / "m2"], "gamma", "is 0")


# ---- memory comparison report ------------------------------------------------------------------

def test_compare_modes_report(tiny, tmp_path):
    out = tmp_path / "cmp"
    p = subprocess.run(["bash", os.path.join(lc.REPO, "scripts/bench/compare_modes.sh"), str(out), BIN, "--model", str(tiny / "model"),
                        "--data", str(tiny / "train.bin"), "--val", str(tiny / "val.bin"), "--steps", "3", "--seq", "24", "--batch", "2",
                        "--lora-rank", "4", "--threads", "1"], capture_output=True, text=True, env=ENV, timeout=300)
    assert p.returncode == 0, p.stderr
    rows = {r.split(",")[0]: r.split(",") for r in (out / "compare_modes.csv").read_text().splitlines()[1:]}
    assert set(rows) == {"baseline", "lowmem", "ckpt"}
    saved = {m: float(r[1]) for m, r in rows.items()}
    assert saved["ckpt"] < saved["lowmem"] < saved["baseline"]
    assert rows["baseline"][5] == rows["ckpt"][5]  # recomputation changes nothing: same final loss
    for m in rows:
        assert float(rows[m][3]) > 0 and float(rows[m][4]) > 0
    plan = json.loads((out / "plan_lowmem.json").read_text())
    assert plan["activation_bytes"] < plan["baseline"]["activation_bytes"]
    q = subprocess.run(["/usr/bin/python3", os.path.join(lc.REPO, "scripts/bench/plot_modes.py"), str(out)], capture_output=True, text=True)
    assert q.returncode == 0, q.stderr
    assert (out / "modes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- full fine-tuning ----------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["baseline", "lowmem"])
def test_full_finetuning_trains_and_writes_a_model(tiny, tmp_path, mode):
    out = tmp_path / "full"
    p = run(["--model", tiny / "model", "--data", tiny / "train.bin", "--val", tiny / "val.bin", "--seq", 24, "--batch", 4,
             "--steps", 12, "--lr", 2e-3, "--threads", 1, "--full", "--mode", mode, "--out", out, "--val-batches", 4])
    ls = losses(p.stdout)
    assert np.mean(ls[-3:]) < np.mean(ls[:3]) - 0.2, ls
    assert "full fine-tuning" in p.stdout
    # every weight trains: 2 layers of q, k, v, o, gate, up, down; the embedding and the untied head
    # (vocab 67 x d 48); the final norm; the block norms, unless MS merged them into the linears
    n = 2 * (48 * 48 + 24 * 48 + 24 * 48 + 48 * 48 + 3 * 100 * 48) + 2 * 67 * 48 + 48 + (2 * 2 * 48 if mode == "baseline" else 0)
    assert f"({n} trainable)" in p.stdout
    # --out is a model directory in the input's layout (MS merge undone): it evaluates to the same loss
    val_end = float((out / "log.csv").read_text().splitlines()[-1].split(",")[-1])
    again = float(run(["--model", out, "--val", tiny / "val.bin", "--eval-only", "--seq", 24, "--batch", 4, "--threads", 1,
                       "--val-batches", 4]).stdout.split("val loss ")[-1])
    print(f"{mode}: loss {ls[0]:.3f} -> {ls[-1]:.3f}; val at end {val_end:.6f}, reloaded {again:.6f}")
    assert abs(again - val_end) < 2e-6 * val_end
    assert (out / "config.json").exists() and not (out / "adapter_model.safetensors").exists()


def test_zero1_full_finetuning_two_ranks(tiny, tmp_path):
    """--full over 2 ranks shards the AdamW state (ZeRO-1): optimizer memory halves, the weights
    equal one process with the combined batch, and a resumed sharded run equals an unbroken one."""
    args = ["--model", tiny / "model", "--data", tiny / "train.bin", "--seq", 24, "--lr", 2e-3, "--threads", 1, "--full",
            "--mode", "lowmem", "--save-every", 3]
    # one process accumulating the ranks' two micro-batches: the same sums in the same order (see
    # test_two_ranks_equal_one_process_accumulating_their_batches), so the same bits
    one = run(args + ["--steps", 6, "--batch", 2, "--grad-accum", 2, "--out", tmp_path / "one"])
    two = mpirun(2, args + ["--steps", 6, "--batch", 2, "--out", tmp_path / "two"])
    opt = lambda out: float(out.split("optimizer ")[1].split()[0])
    print(f"optimizer state: 1 rank {opt(one.stdout)} MiB, 2 ranks {opt(two.stdout)} MiB per rank")
    assert opt(two.stdout) < 0.55 * opt(one.stdout)
    assert losses(one.stdout) == losses(two.stdout)
    f32 = lambda d: st_io.load(str(d / "model.safetensors"))
    a, b = f32(tmp_path / "one"), f32(tmp_path / "two")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    # every block its own bucket: each rank then owns a piece of every bucket instead of one
    # contiguous half; a sum over two ranks is exact in any grouping, so the weights are the same bits
    many = tmp_path / "two_buckets"
    mpirun(2, args + ["--steps", 6, "--batch", 2, "--out", many], env=ONE_BYTE_BUCKETS)
    c = f32(many)
    assert all(np.array_equal(c[k], b[k]) for k in b)
    # a sharded run stopped mid-way and resumed equals an unbroken sharded run (the AdamW shards
    # are gathered into the state file, in the arena's order, and scattered back): stopped with
    # 1-byte buckets and resumed with the default ones, so the file cannot depend on the layout
    long = args + ["--steps", 150, "--batch", 2]
    mpirun(2, long + ["--out", tmp_path / "straight"])
    out = tmp_path / "stopped"
    stopped = mpirun(2, long + ["--out", out, "--stop-at", 75], env=ONE_BYTE_BUCKETS)
    assert "stopped at step 75 of 150" in stopped.stdout
    done = 75
    r = mpirun(2, long + ["--resume", out])
    print(f"stopped after {done} steps; {r.stdout.split('resumed ')[1].split(chr(10))[0]}")
    assert (out / "train_state.bin").read_bytes() == (tmp_path / "straight" / "train_state.bin").read_bytes()


def test_ranks_on_one_node_share_its_memory_in_the_fit_check(tiny):
    """Ranks of one node share its host memory: with 64 MiB available (LLMC_HOST_MEMORY_BYTES), each
    of two ranks gets 32 MiB, and a plan over that is refused before anything is allocated."""
    p = mpirun(2, base_args(tiny, "--steps", 1, "--batch", 2000), check=False, env={"LLMC_HOST_MEMORY_BYTES": str(64 << 20)})
    assert p.returncode != 0
    assert "but 32.0 MiB is available (LLMC_HOST_MEMORY_BYTES, divided among the node's 2 ranks); would fit: --batch" in p.stderr, p.stderr


# ---- training health (issue 13, items 5 and 6) -------------------------------------------------

def one_error_line(p, *needles):
    err = p.stderr.strip()
    assert p.returncode == 1, (p.returncode, p.stdout[-1500:], err)
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, (n, err)
    return err


@pytest.mark.parametrize("mode", ["baseline", "lowmem"])
def test_diverged_run_stops_with_a_diagnosis(tiny, tmp_path, mode):
    """--lr 1e3 blows the LoRA weights up within two steps: the residual stream's RMS passes 2^64,
    where fp32 cannot square it. Before, the norm's fp32 statistics overflowed (r = 0), the loss sat
    at exactly ln(vocab) with a zero gradient and the run exited 0, saving a collapsed adapter. Now
    the norms compute such rows right and the run stops at the first step that sees them, with one
    line that says what happened and what to try, and no adapter is saved."""
    out = tmp_path / "out"
    p = run_env(base_args(tiny, "--mode", mode, "--steps", 10, "--batch", 2, "--lr", "1e3", "--out", out), {}, check=False)
    one_error_line(p, "the run diverged", "final norm with an RMS beyond 2^64", "lower --lr")
    assert not (out / "adapter_model.safetensors").exists() and not (out / "train_state.bin").exists()


@pytest.mark.parametrize("flags, factor", [
    (["--lora-alpha", "1e38"], "the adapters' scale (--lora-alpha over the rank) is 2.5e+37"),
    (["--lora-dropout", "0.999999"], "--lora-dropout 0.999999 multiplies kept inputs by 9.87e+05"),
])
def test_diverged_lora_run_names_the_factor_that_grew(tiny, tmp_path, flags, factor):
    """An adapter scale of 1e37 overflows the first update; dropout at p = 0.999999 drops every
    input of this tiny batch (a zero gradient: collapse). Before, the message only said to lower
    --lr; now it states both factors of the adapter update with their values: 1e38 / rank 4, and
    1/(1-p) for fp32's p = 0.99999898672, 9.87e5 to 3 digits."""
    p = run_env(base_args(tiny, "--mode", "lowmem", "--steps", 6, "--batch", 2, *flags,
                          "--out", tmp_path / "out"), {}, check=False)
    one_error_line(p, "lower --lr", factor)


def test_diverged_steps_are_skipped_then_stop(tiny, tmp_path):
    """--nonfinite skip applies to diverged steps too: each is logged and not applied; the weights
    stay diverged, so ten in a row stop the run."""
    p = run_env(base_args(tiny, "--steps", 30, "--batch", 2, "--lr", "1e3", "--nonfinite", "skip"), {}, check=False)
    one_error_line(p, "10 steps in a row were skipped", "diverged")
    assert "skipped: diverged (final-norm input beyond fp32 range)" in p.stdout, p.stdout[-2000:]


def test_collapsed_model_stops(tiny, tmp_path):
    """A final norm of zeros makes every logit 0: the loss is exactly ln(vocab) and no trainable
    weight can change it (the gradient is exactly zero), the state an overflowed fp32 norm used to
    leave. The run stops at step 1 and says so."""
    model = tmp_path / "model"
    shutil.copytree(tiny / "model", model)
    w = st_io.load(str(model / "model.safetensors"))
    w["model.norm.weight"] = np.zeros_like(w["model.norm.weight"])
    st_io.save(str(model / "model.safetensors"), w, metadata={"format": "pt"})
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    for mode in ("baseline", "lowmem"):
        args = base_args(tiny, "--mode", mode, "--steps", 3, "--batch", 2, "--out", tmp_path / mode)
        args[1] = model
        p = run_env(args, {}, check=False)
        one_error_line(p, "step 1: the run collapsed: the gradient is exactly zero",
                       f"loss {np.log(vocab):.4f}, uniform predictions ln({vocab}) = {np.log(vocab):.4f}")
        assert not (tmp_path / mode / "adapter_model.safetensors").exists()


def test_fully_masked_shard_is_refused_at_load(tiny, tmp_path):
    """A shard whose every target is masked has nothing to train on (it trained with loss 0 and
    gradient norm 0 and exited 0): one line naming the file, as --data or --val, before anything
    runs. The first token is never a target, so a mask set there alone counts as none."""
    toks = np.fromfile(tiny / "train.bin", dtype=np.uint32, offset=64)[:500]
    mask = np.zeros(toks.size, np.uint8)
    mask[0] = 1
    bad = tmp_path / "masked.bin"
    shards.write_shard(str(bad), toks, mask, 67)
    for flag in ("--data", "--val"):
        args = base_args(tiny, "--steps", 2, "--batch", 2, "--out", tmp_path / "out")
        if flag == "--data":
            args[args.index("--data") + 1] = bad
        else:
            args += ["--val", bad]
        p = run_env(args, {}, check=False)
        one_error_line(p, f"{bad}: every target is masked")
        assert not list((tmp_path / "out").glob("*"))  # --out is made before the data is read, but stays empty


def test_step_without_targets_is_reported_not_applied(tiny, tmp_path):
    """Only one window of the shard (batch 1, seq 24) has targets: the other steps have none on any
    rank, so no loss exists. They say so, log NaN (not loss 0, gradient norm 0) and change nothing:
    the adapter after them equals the adapter of a run stopped after the last step with targets."""
    toks = np.fromfile(tiny / "train.bin", dtype=np.uint32, offset=64)[:24 * 8 + 1]
    mask = np.zeros(toks.size, np.uint8)
    mask[24 * 3 + 1:24 * 4 + 1] = 1  # the targets of window 3 only
    data = tmp_path / "sparse.bin"
    shards.write_shard(str(data), toks, mask, 67)
    args = base_args(tiny, "--steps", 8, "--batch", 1)
    args[args.index("--data") + 1] = data
    p = run_env(args + ["--out", tmp_path / "all", "--log-every", 1], {})
    lines = [l for l in p.stdout.splitlines() if l.startswith("step ")]
    empty = [l for l in lines if "no unmasked target in this step's batches: no loss, no update" in l]
    trained = [i for i, l in enumerate(lines) if "no unmasked target" not in l]
    assert len(lines) == 8 and len(empty) == 7 and len(trained) == 1, "\n".join(lines)
    assert all("loss nan" in l and "grad norm nan" in l for l in empty), "\n".join(empty)
    log = (tmp_path / "all" / "log.csv").read_text().splitlines()[1:]
    assert sum(",nan," in row for row in log) == 7, log
    run_env(args + ["--out", tmp_path / "one", "--stop-at", trained[0] + 1], {})
    a, b = adapter(tmp_path / "all"), adapter(tmp_path / "one")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
