"""train_vit as a system: what spans runs, files and processes. PEFT adapters out and back in
across norm modes and against PyTorch; MS-LN training what standard LayerNorm trains; SIGKILL +
--resume and --stop-at + --resume bit-identical to a whole run; a mismatched resume refused; the
health stops (a non-finite step skipped, a diverged run stopped); mpirun -np 2 equal to one process
with the combined batch. Full fine-tuning (--full) and merged export (--export-merged): full
fine-tuning lowers the loss and its --out model directory reloads (--model DIR --eval-only) to the
same validation loss, also when trained at another resolution; a merged export (W + alpha/r B A and
the trained head, MS merge undone) evaluates like base + adapter, for the bundled Hugging Face demo
and for random timm / no-qkv-bias checkpoints; a zero gamma fails clearly under --full and exports
under LoRA; mpirun -np 2 --full (ZeRO-1) equals one process with the combined batch; --full
--stop-at + --resume equals a whole run. The gradients of --full against the PyTorch reference are
test_vit_model.py's.
VIT_DEMO_MODEL / VIT_DEMO_TRAIN / VIT_DEMO_VAL override the bundled files.

Run:  /usr/bin/python3 -m pytest -q test/system/test_vit_system.py   (needs train_vit and build/emu/train_vit)
"""
import csv
import json
import os
import shutil
import subprocess

import numpy as np
import pytest

import vit_cases as vc  # noqa: E402
from test_vit_train import fine_tune


os.environ.setdefault("OMP_WAIT_POLICY", "passive")
DATA = os.path.join(vc.REPO, "data")
MODEL = os.environ.get("VIT_DEMO_MODEL", os.path.join(DATA, "vit_demo"))
TRAIN = os.environ.get("VIT_DEMO_TRAIN", os.path.join(DATA, "vit_demo_ft_train.bin"))
VAL = os.environ.get("VIT_DEMO_VAL", os.path.join(DATA, "vit_demo_ft_val.bin"))


# ---------------------------------------------------------------------------------------------
# adapters (PEFT layout) and the resumable state

def _eval_only(adapter, mode, extra=(), model=MODEL):
    p = vc.train_vit("--model", model, "--val", VAL, "--eval-only", "--adapter", adapter, "--mode", mode,
                     "--lora-rank", 4, "--batch", 50, "--val-batches", 100, "--threads", 2, *extra)
    line = [l for l in p.stdout.splitlines() if l.startswith("val loss")][-1]
    return float(line.split()[2]), float(line.split()[6])


@pytest.mark.parametrize("ms_lora", ["exact", "merged"])
def test_adapter_round_trip_across_norm_modes_and_against_pytorch(tmp_path, ms_lora):
    """An adapter trained under MS-LN (gamma, beta merged into q,k,v / fc1) is the ORIGINAL model's:
    as it is (the adapters saw gamma*z + beta; PEFT bias "none"), or, under the paper's --ms-lora
    merged, mapped back as A diag(1/gamma) with the constant that beta leaves in the layer's bias
    (PEFT bias "lora_only"). Evaluated with standard LayerNorm, MS-LN or MS-LN --ms-lora merged it
    gives the training run's own numbers; so does PyTorch applying it to the original weights."""
    out = str(tmp_path / "ms")
    rows, _ = fine_tune(out, 3, 8, mode="lowmem", extra=("--val-batches", 100, "--ms-lora", ms_lora))
    import json
    with open(os.path.join(out, "adapter_config.json")) as f:
        ac = json.load(f)
    assert ac["peft_type"] == "LORA" and ac["r"] == 4 and ac["bias"] == ("lora_only" if ms_lora == "merged" else "none")
    assert ac["modules_to_save"] == ["classifier"] and ac["task_type"] is None
    assert "vit.encoder.layer.0.output.dense" in ac["target_modules"]
    ad = vc.st_io.load(os.path.join(out, "adapter_model.safetensors"))
    assert ad["base_model.model.classifier.weight"].shape == (5, 64)
    want_loss, want_acc = float(rows[-1]["val_loss"]), float(rows[-1]["val_accuracy"])
    for mode, extra in (("baseline", ()), ("lowmem", ()), ("lowmem", ("--ms-lora", "merged"))):
        loss, acc = _eval_only(out, mode, extra)
        assert abs(loss - want_loss) < 1e-4 * want_loss and abs(acc - want_acc) < 1e-6, (mode, extra, loss, want_loss)
    # PyTorch: original weights, adapted biases replaced, LoRA A/B and the head from the adapter
    import numpy as np
    import torch
    import torch.nn.functional as F
    import prepare_images as pi
    model = vc.ref.VitModel.load(MODEL)
    pre = "base_model.model."
    lora = {}
    for l in range(model.cfg.n_layers):
        for t, mod in vc.ref.HF_MODULE.items():
            k = f"{pre}vit.encoder.layer.{l}.{mod}"
            lora[(l, t)] = (torch.from_numpy(ad[k + ".lora_A.weight"]).double(),
                            torch.from_numpy(ad[k + ".lora_B.weight"]).double())
            assert (k + ".bias" in ad) == (ms_lora == "merged")
            if k + ".bias" in ad:
                model.w[f"{l}.{t}.b"] = torch.from_numpy(ad[k + ".bias"]).double()
    head = (torch.from_numpy(ad[pre + "classifier.weight"]).double(),
            torch.from_numpy(ad[pre + "classifier.bias"]).double())
    images, labels, _ = pi.read_shard(VAL)
    with open(os.path.join(MODEL, "preprocessor_config.json")) as f:
        pc = json.load(f)
    x = (torch.from_numpy(images.astype(np.float64) / 255.0).permute(0, 3, 1, 2) - pc["image_mean"][0]) / pc["image_std"][0]
    with torch.no_grad():
        logits = vc.ref.forward(model, x, lora, ac["lora_alpha"] / ac["r"], head, "exact", "std")
        loss = float(F.cross_entropy(logits, torch.from_numpy(labels)))
        acc = float((logits.argmax(1) == torch.from_numpy(labels)).double().mean())
    print(f"val loss: train_vit {want_loss:.6f}, PyTorch on the exported adapter {loss:.6f}")
    assert abs(loss - want_loss) < 1e-4 * want_loss and abs(acc - want_acc) < 1e-6


@pytest.mark.parametrize("act", ["exact", "approx"])
def test_ms_lora_trains_what_std_trains(tmp_path, act):
    """6 steps under --norm ms equal 6 steps under --norm std: the same per-step losses and the same
    adapters and head, up to float rounding; the paper's --ms-lora merged is another optimisation
    problem. Tolerances: one step's fp32 gradients of the two agree within 2 TOL["grad"] and the
    losses within 2 TOL["loss"] (test_vit_model.py::test_ms_lora_gradients_equal_std); each AdamW
    step moves an element by at most lr with m/sqrt(v) perturbed by the same relative amount, so
    after 6 steps they agree within 6 * 2 TOL["grad"] of the largest element, the losses within
    6 * 2 TOL["loss"]."""
    steps, rows, ad = 6, {}, {}
    for name, flags in [("std", ("--norm", "std")), ("ms", ("--norm", "ms")), ("merged", ("--norm", "ms", "--ms-lora", "merged"))]:
        out = str(tmp_path / name)
        rows[name], _ = fine_tune(out, 3, steps, mode="baseline", extra=("--act", act) + flags)
        ad[name] = vc.st_io.load(os.path.join(out, "adapter_model.safetensors"))
    loss = {k: [float(r["loss"]) for r in v if r["loss"] not in ("", "nan")] for k, v in rows.items()}
    d_loss = {k: max(abs(a - b) / b for a, b in zip(loss[k], loss["std"])) for k in ("ms", "merged")}
    keys = [k for k in ad["std"] if "lora_" in k or "classifier" in k]
    d_ad = {k: max(vc.rel_to_max(ad[k][n], ad["std"][n]) for n in keys) for k in ("ms", "merged")}
    tol_loss, tol_ad = steps * 2 * vc.TOL["loss"], steps * 2 * vc.TOL["grad"]
    print(f"{act}: ms vs std: losses {d_loss['ms']:.2e}, adapters {d_ad['ms']:.2e}; "
          f"--ms-lora merged vs std: losses {d_loss['merged']:.2e}, adapters {d_ad['merged']:.2e}")
    assert len(loss["ms"]) == steps and d_loss["ms"] < tol_loss and d_ad["ms"] < tol_ad
    assert d_ad["merged"] > tol_ad  # (its losses differ by a few 1e-4 only: a 6-step run of a small head)


def test_sigkill_then_resume_is_bit_identical(tmp_path):
    import signal
    import subprocess
    import time
    steps = 12
    args = ["--model", MODEL, "--data", TRAIN, "--mode", "lowmem", "--steps", str(steps), "--batch", "64",
            "--lr", "3e-3", "--lora-rank", "4", "--seed", "9", "--threads", "2", "--save-every", "3"]
    exe = vc.binary("train_vit", "TRAIN_VIT")
    whole = str(tmp_path / "whole")
    vc.run([exe] + args + ["--out", whole])
    out = str(tmp_path / "killed")
    p = subprocess.Popen([exe] + args + ["--out", out], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = os.path.join(out, "log.csv")
    deadline, done = time.time() + 120, 0
    while time.time() < deadline and p.poll() is None:  # kill once the save after step 3 is done
        if os.path.exists(log):
            with open(log) as f:
                done = sum(1 for line in f) - 1
            if done >= 4:
                p.send_signal(signal.SIGKILL)
                break
        time.sleep(0.005)
    p.wait()
    assert p.returncode == -signal.SIGKILL and done < steps, "the run finished before it could be killed"
    r = vc.run([exe] + args + ["--resume", out])
    resumed_at = int(r.stdout.split("at step ")[1].split()[0])
    assert 3 <= resumed_at < steps
    for name in ("adapter_model.safetensors", "train_state.bin"):
        with open(os.path.join(whole, name), "rb") as a, open(os.path.join(out, name), "rb") as b:
            assert a.read() == b.read(), f"{name} differs after kill + resume"


def test_stop_at_then_resume_equals_whole_run(tmp_path):
    """--stop-at N saves and stops with the schedule of --steps; --resume finishes the same run."""
    args = ["--model", MODEL, "--data", TRAIN, "--mode", "lowmem", "--steps", "6", "--batch", "32", "--lr", "3e-3",
            "--lora-rank", "4", "--seed", "4", "--threads", "2"]
    exe = vc.binary("train_vit", "TRAIN_VIT")
    whole, part = str(tmp_path / "whole"), str(tmp_path / "part")
    vc.run([exe] + args + ["--out", whole])
    r = vc.run([exe] + args + ["--out", part, "--stop-at", "4"])
    assert "stopped at step 4 of 6" in r.stdout
    vc.run([exe] + args + ["--resume", part])
    for name in ("adapter_model.safetensors", "train_state.bin"):
        with open(os.path.join(whole, name), "rb") as a, open(os.path.join(part, name), "rb") as b:
            assert a.read() == b.read(), f"{name} differs after --stop-at + --resume"


def test_mismatched_resume_is_refused(tmp_path):
    out = str(tmp_path / "run")
    vc.train_vit("--model", MODEL, "--data", TRAIN, "--steps", 2, "--batch", 8, "--lora-rank", 4, "--out", out)
    for extra, needle in ((["--lora-rank", 8], "rank=4"), (["--lora-rank", 4, "--mode", "baseline"], "act=approx"),
                          (["--lora-rank", 4, "--image-size", "35"], "image=28x28")):
        p = vc.train_vit("--model", MODEL, "--data", TRAIN, "--steps", 2, "--batch", 8, "--resume", out, *extra, check=False)
        assert p.returncode == 1 and "train_state.bin" in p.stderr and needle in p.stderr, p.stderr


# ---------------------------------------------------------------------------------------------
# the health stops: a non-finite step, a diverged run

def test_nonfinite_step_is_skipped(tmp_path, monkeypatch):
    """--nonfinite skip leaves the weights alone on a step with a NaN loss (LLMC_FAULT_NONFINITE_STEP
    injects it): the run then equals one stopped before that step, bit for bit."""
    args = ["--model", MODEL, "--data", TRAIN, "--steps", "3", "--batch", "8", "--lora-rank", "4", "--seed", "4"]
    exe = vc.binary("train_vit", "TRAIN_VIT")
    vc.run([exe] + args + ["--stop-at", "2", "--out", str(tmp_path / "two_steps")])
    exe = vc.binary("build/test/train_vit", "TRAIN_VIT_FAULTS")  # the test build: fault injectors compiled in
    monkeypatch.setenv("LLMC_FAULT_NONFINITE_STEP", "3")
    p = vc.run([exe] + args, check=False)
    assert p.returncode == 1 and "step 3: non-finite loss (nan)" in p.stderr, p.stderr
    p = vc.run([exe] + args + ["--nonfinite", "skip", "--out", str(tmp_path / "skip")])
    assert "skipped: non-finite loss or gradient" in p.stdout
    name = "adapter_model.safetensors"
    with open(tmp_path / "skip" / name, "rb") as a, open(tmp_path / "two_steps" / name, "rb") as b:
        assert a.read() == b.read()


@pytest.mark.parametrize("mode", ["baseline", "lowmem"])
def test_diverged_run_stops_with_a_diagnosis(tmp_path, mode):
    """--lr 1e3 drives the re-initialised head to logits that put the loss at ~1e4 (5 classes:
    uniform predictions score ln 5 = 1.61) from step 2 on; it used to run to the end, exit 0 and
    save that adapter. A loss more than 100 nats above ln(classes) cannot come from cross-entropy
    training (llmc/train/health.h says why): the run stops with one line and saves nothing."""
    out = tmp_path / "out"
    p = vc.train_vit("--model", MODEL, "--data", TRAIN, "--mode", mode, "--steps", 10, "--batch", 16, "--lr", "1e3",
                     "--lora-rank", 4, "--threads", 2, "--out", str(out), check=False)
    err = p.stderr.strip()
    assert p.returncode == 1 and err.startswith("error: ") and len(err.splitlines()) == 1, (p.returncode, p.stdout[-1500:], err)
    assert "the run diverged: loss" in err and "nats above ln(5) = 1.6094" in err and "lower --lr" in err, err
    assert not (out / "adapter_model.safetensors").exists() and not (out / "train_state.bin").exists()


def test_activations_beyond_fp32_squares_stop_the_run(tmp_path):
    """A checkpoint whose embeddings are scaled by 1e25 puts every token's residual RMS beyond 2^64
    (the demo's blocks are pre-LN, so the residual keeps that scale): the final LayerNorm computes
    those rows right, its fp32 statistics no longer overflowing, and the run stops at step 1 saying
    the activations are beyond fp32 range. The head only sees normalised features, so the loss
    alone would not show it. On the CUDA backend too (the emulator)."""
    model = tmp_path / "model"
    shutil.copytree(MODEL, model)
    w = vc.st_io.load(str(model / "model.safetensors"))
    for k in ("vit.embeddings.cls_token", "vit.embeddings.position_embeddings", "vit.embeddings.patch_embeddings.projection.weight",
              "vit.embeddings.patch_embeddings.projection.bias"):
        w[k] = w[k] * np.float32(1e25)
    vc.st_io.save(str(model / "model.safetensors"), w, metadata={"format": "pt"})
    cuda_emu = os.path.join(vc.REPO, "build/emu/train_vit")
    for exe, device in ((vc.binary("train_vit", "TRAIN_VIT"), "cpu"), (cuda_emu, "cuda")):
        assert os.path.isfile(exe), f"{exe} is missing (make {os.path.relpath(exe, vc.REPO)})"
        p = vc.run([exe, "--model", str(model), "--data", TRAIN, "--steps", "3", "--batch", "4", "--lora-rank", "4",
                    "--threads", "2", "--device", device, "--out", str(tmp_path / device)], check=False)
        err = p.stderr.strip()
        assert p.returncode == 1 and len(err.splitlines()) == 1, (device, p.returncode, p.stdout[-1500:], err)
        assert "step 1: the run diverged: 4 rows reached the final norm with an RMS beyond 2^64" in err, (device, err)
        assert not (tmp_path / device / "adapter_model.safetensors").exists()


# ---------------------------------------------------------------------------------------------
# data parallelism

@pytest.mark.parametrize("dropout", ["0", "0.1"])
def test_two_ranks_equal_one_process_with_combined_batch(tmp_path, dropout):
    """mpirun -np 2 with --batch 8 trains like one process accumulating the same two micro-batches
    of 8 (--grad-accum 2): the loader gives each rank its half of the global batch, gradients and
    loss are summed across ranks. Each rank's gradient is the process's micro-batch gradient (the
    same sums in the same order) and a sum of two is exact in either order, so the adapters must be
    the same bits: no tolerance, nothing that depends on the CPU. With --lora-dropout the masks are
    keyed by the row in the step's global batch, so rank r draws the process's micro-batch r's."""
    args = ["--model", MODEL, "--data", TRAIN, "--mode", "lowmem", "--steps", "5", "--lr", "3e-3",
            "--lora-rank", "4", "--seed", "4", "--threads", "1", "--hflip", "--lora-dropout", dropout]
    two_ranks_equal_one_process(tmp_path, args, "adapter_model.safetensors", {})


def two_ranks_equal_one_process(tmp_path, args, weights, env):
    """train_vit with args (5 steps) in one process at --batch 8 --grad-accum 2 (into tmp_path/one) and on two
    mpirun ranks at --batch 8 (tmp_path/two; one OpenMP thread each, and env): the two ranks say so, log the
    very losses of the one process, and save the very tensors in the file weights."""
    mpirun = shutil.which("mpirun")
    if not mpirun:
        pytest.fail("mpirun not found: install openmpi-bin (scripts/ci/install_deps.sh does)")
    exe = vc.binary("train_vit", "TRAIN_VIT")
    vc.run([exe] + args + ["--batch", "8", "--grad-accum", "2", "--out", str(tmp_path / "one")])
    p = subprocess.run([mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", exe] + args +
                       ["--batch", "8", "--out", str(tmp_path / "two")], capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1", **env), timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "2 ranks" in p.stdout and "per rank" in p.stdout

    def losses(d):
        with open(os.path.join(d, "log.csv")) as f:
            return [float(r["loss"]) for r in csv.DictReader(f)]
    assert losses(tmp_path / "one") == losses(tmp_path / "two") and len(losses(tmp_path / "one")) == 5
    a = vc.st_io.load(str(tmp_path / "one" / weights))
    b = vc.st_io.load(str(tmp_path / "two" / weights))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------------------------
# --full and --export-merged: training, export, reload

def _train(out, mode, steps, extra=(), model=MODEL, train=TRAIN, val=VAL, batch=16):
    vc.train_vit("--model", model, "--data", train, "--val", val, "--mode", mode, "--steps", steps,
                 "--batch", batch, "--warmup", 2, "--seed", 5, "--threads", 2, "--val-every", steps,
                 "--val-batches", 100, "--out", out, *extra)
    with open(os.path.join(out, "log.csv")) as f:
        return list(csv.DictReader(f))


def _eval(model, mode, val=VAL, extra=()):
    p = vc.train_vit("--model", model, "--val", val, "--eval-only", "--mode", mode, "--batch", 50,
                     "--val-batches", 100, "--threads", 2, *extra)
    line = [l for l in p.stdout.splitlines() if l.startswith("val loss")][-1]
    return float(line.split()[2]), float(line.split()[6])


def _close(a, b):
    return abs(a[0] - b[0]) < 1e-4 * abs(b[0]) and abs(a[1] - b[1]) < 1e-6


@pytest.mark.parametrize("mode", ["lowmem", "baseline"])
def test_full_fine_tune_lowers_loss_and_out_reloads(tmp_path, mode):
    out = str(tmp_path / "full")
    rows = _train(out, mode, 15, ("--full", "--lr", "1e-3"))
    before, after = float(rows[0]["val_loss"]), float(rows[-1]["val_loss"])
    print(f"--full {mode}: val loss {before:.4f} -> {after:.4f}")
    assert after < before - 0.3
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["num_labels"] == 5
    st = vc.st_io.load(os.path.join(out, "model.safetensors"))
    assert st["classifier.weight"].shape == (5, 64) and st["classifier.weight"].dtype == np.float32
    base = vc.st_io.load(os.path.join(MODEL, "model.safetensors"))
    assert set(base) == set(st)
    # every weight trains: the linears with their biases, the embeddings, the final norm, and the
    # block norms when standard (under MS-LN they are merged into the linears and train there)
    trained = ["vit.encoder.layer.0.intermediate.dense.weight", "vit.encoder.layer.1.output.dense.bias",
               "vit.embeddings.cls_token", "vit.embeddings.position_embeddings",
               "vit.embeddings.patch_embeddings.projection.weight", "vit.embeddings.patch_embeddings.projection.bias",
               "vit.layernorm.weight", "vit.layernorm.bias"]
    block_norm = "vit.encoder.layer.0.layernorm_before.weight"
    for k in trained + ([block_norm] if mode == "baseline" else []):
        assert not np.array_equal(base[k], st[k]), k
    if mode == "lowmem":
        assert np.array_equal(base[block_norm], st[block_norm])  # merged: W and b carry its training
    want = (after, float(rows[-1]["val_accuracy"]))
    for m in ("lowmem", "baseline"):  # the exported model in either norm mode
        got = _eval(out, m)
        assert _close(got, want), (m, got, want)


def test_full_at_another_resolution_exports_that_resolution(tmp_path):
    """--full at --image-size 35 (the checkpoint's is 28) trains the positions of the 5x5 grid: the
    model directory holds them, its config.json says 35, and it reloads (no --image-size) to the
    same validation loss."""
    out = str(tmp_path / "full35")
    rows = _train(out, "baseline", 6, ("--full", "--lr", "1e-3", "--image-size", "35"))
    st = vc.st_io.load(os.path.join(out, "model.safetensors"))
    assert st["vit.embeddings.position_embeddings"].shape == (1, 1 + 5 * 5, 64)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["image_size"] == [35, 35]
    want = (float(rows[-1]["val_loss"]), float(rows[-1]["val_accuracy"]))
    got = _eval(out, "baseline")
    print(f"--full at 35 px: val {want}, reloaded {got}")
    assert _close(got, want), (got, want)


@pytest.mark.parametrize("mode", ["lowmem", "baseline"])
def test_export_merged_equals_base_plus_adapter(tmp_path, mode):
    out, merged, again = str(tmp_path / "lora"), str(tmp_path / "merged"), str(tmp_path / "again")
    rows = _train(out, mode, 8, ("--lora-rank", 4, "--lr", "3e-3", "--export-merged", merged))
    want = (float(rows[-1]["val_loss"]), float(rows[-1]["val_accuracy"]))
    assert _close(_eval(MODEL, mode, extra=("--adapter", out, "--lora-rank", 4)), want)
    for m in ("lowmem", "baseline"):
        got = _eval(merged, m)
        assert _close(got, want), (m, got, want)
    # alone, from the adapter
    vc.train_vit("--model", MODEL, "--adapter", out, "--lora-rank", 4, "--mode", mode, "--export-merged", again)
    assert _close(_eval(again, "lowmem"), want)
    base = vc.st_io.load(os.path.join(MODEL, "model.safetensors"))
    st = vc.st_io.load(os.path.join(again, "model.safetensors"))
    assert set(base) == set(st) and all(base[k].dtype == st[k].dtype for k in base)
    assert st["classifier.bias"].shape == (5,)
    for f in ("preprocessor_config.json",):
        with open(os.path.join(MODEL, f)) as a, open(os.path.join(again, f)) as b:
            assert a.read() == b.read()


def _random_setup(root, name, layout, **cfg_over):
    """A random checkpoint (layout hf / timm) with a small train and val shard at its resolution."""
    d = os.path.join(root, "model")
    cfg = vc.write_model(d, vc.model_config(name, **cfg_over), seed=3, layout=layout)
    rng = np.random.default_rng(0)
    H, W = cfg.image
    shards = []
    for split, n in (("train", 48), ("val", 30)):
        imgs = rng.integers(0, 256, size=(n, H, W, cfg.channels), dtype=np.uint8)
        labels = rng.integers(0, 4, size=n)
        shards.append(vc.write_shard(os.path.join(root, f"{split}.bin"), imgs, labels, 4))
    return d, shards[0], shards[1]


@pytest.mark.parametrize("layout,name", [("timm", "square"), ("hf", "nonsquare")])
def test_export_random_checkpoints_lora_and_full(tmp_path, layout, name):
    """timm (fused qkv, head.*) and a Hugging Face checkpoint without q/k/v biases under lowmem: the
    merged export and the --full output reload to the training run's validation numbers. --full
    trains the merged layer, whose mapping back gives q, k, v a bias (written, with qkv_bias true);
    a LoRA adapter is the original model's and folds in without one."""
    d, train, val = _random_setup(str(tmp_path), name, layout)
    for what, extra in (("lora", ("--lora-rank", 3, "--lr", "1e-2")), ("full", ("--full", "--lr", "3e-3"))):
        out, merged = str(tmp_path / what), str(tmp_path / (what + "_merged"))
        ex = extra + (("--export-merged", merged) if what == "lora" else ())
        rows = _train(out, "lowmem", 4, ex, model=d, train=train, val=val, batch=8)
        want = (float(rows[-1]["val_loss"]), float(rows[-1]["val_accuracy"]))
        target = merged if what == "lora" else out
        for m in ("lowmem", "baseline"):
            got = _eval(target, m, val=val)
            assert _close(got, want), (layout, what, m, got, want)
        st = vc.st_io.load(os.path.join(target, "model.safetensors"))
        if layout == "timm":
            assert st["head.weight"].shape[0] == 4 and "blocks.0.attn.qkv.weight" in st
        else:
            assert st["classifier.weight"].shape[0] == 4
            assert ("vit.encoder.layer.0.attention.attention.query.bias" in st) == (what == "full")
            with open(os.path.join(target, "config.json")) as f:
                assert json.load(f)["qkv_bias"] is (what == "full")


def test_zero_gamma_export_fails_clearly(tmp_path):
    d, train, val = _random_setup(str(tmp_path), "square", "hf")
    p = os.path.join(d, "model.safetensors")
    t = vc.st_io.load(p)
    t["vit.encoder.layer.1.layernorm_after.weight"][3] = 0.0
    vc.st_io.save(p, t, metadata={"format": "pt"})
    r = vc.train_vit("--model", d, "--data", train, "--mode", "lowmem", "--full", "--steps", 1, "--batch", 8,
                     "--out", str(tmp_path / "o"), check=False)
    assert r.returncode == 1 and "gamma[3] is 0" in r.stderr and "layer.1" in r.stderr, r.stderr
    # with standard LayerNorm there is nothing to undo
    vc.train_vit("--model", d, "--data", train, "--mode", "baseline", "--full", "--steps", 1, "--batch", 8,
                 "--out", str(tmp_path / "s"))
    # nor under LoRA: the adapter sees gamma*z + beta as in the original model and folds into its W;
    # the export reloads to the run's validation numbers (the paper's --ms-lora merged cannot map back)
    out, merged = str(tmp_path / "lora"), str(tmp_path / "lora_merged")
    rows = _train(out, "lowmem", 4, ("--lora-rank", 3, "--lr", "1e-2", "--export-merged", merged), model=d, train=train, val=val, batch=8)
    want = (float(rows[-1]["val_loss"]), float(rows[-1]["val_accuracy"]))
    for m in ("lowmem", "baseline"):
        got = _eval(merged, m, val=val)
        assert _close(got, want), (m, got, want)
    r = vc.train_vit("--model", d, "--data", train, "--mode", "lowmem", "--ms-lora", "merged", "--steps", 1, "--batch", 8,
                     "--lora-rank", 3, "--export-merged", str(tmp_path / "m2"), check=False)
    assert r.returncode == 1 and "gamma[3] is 0" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_zero1_full_finetuning_two_ranks(tmp_path):
    """mpirun -np 2 --full (AdamW state sharded, ZeRO-1) with --batch 8 trains like one process
    accumulating the same two micro-batches of 8: the same sums in the same order, and AdamW is
    elementwise on the shards, so the same losses and the same weights, bit for bit."""
    args = ["--model", MODEL, "--data", TRAIN, "--mode", "lowmem", "--full", "--steps", "5", "--lr", "1e-3",
            "--seed", "4", "--threads", "1", "--hflip"]
    two_ranks_equal_one_process(tmp_path, args, "model.safetensors", {"OMP_WAIT_POLICY": "passive"})
    with open(tmp_path / "one" / "train_state.bin", "rb") as f1, open(tmp_path / "two" / "train_state.bin", "rb") as f2:
        assert len(f1.read()) > 0 and len(f2.read()) > 0


def test_full_stop_at_then_resume_equals_whole_run(tmp_path):
    """--full: the training state holds the linear weights and the head; --stop-at + --resume gives
    the same model directory and state, bit for bit."""
    args = ["--model", MODEL, "--data", TRAIN, "--mode", "lowmem", "--full", "--steps", "6", "--batch", "16",
            "--lr", "1e-3", "--seed", "4", "--threads", "2"]
    exe = vc.binary("train_vit", "TRAIN_VIT")
    whole, part = str(tmp_path / "whole"), str(tmp_path / "part")
    vc.run([exe] + args + ["--out", whole])
    assert "stopped at step 4 of 6" in vc.run([exe] + args + ["--out", part, "--stop-at", "4"]).stdout
    vc.run([exe] + args + ["--resume", part])
    for name in ("model.safetensors", "train_state.bin"):
        with open(os.path.join(whole, name), "rb") as a, open(os.path.join(part, name), "rb") as b:
            assert a.read() == b.read(), f"{name} differs after --stop-at + --resume"
    # a LoRA run's state is not a --full one's
    p = vc.run([exe] + args[:4] + ["--steps", "6", "--batch", "16", "--lr", "1e-3", "--seed", "4", "--resume", part],
               check=False)
    assert p.returncode == 1 and "full=1" in p.stderr, p.stderr
