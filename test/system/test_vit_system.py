"""ViT full fine-tuning (--full) and merged export (--export-merged): the probe's gradient of every
weight (linears and biases, of the merged layer under MS-LN; norms; patch embedding, class token,
positions; the head) against the PyTorch reference in all four act x norm modes; full fine-tuning
lowers the loss and its --out model directory reloads (--model DIR --eval-only) to the same
validation loss, also when trained at another resolution; a merged export (W + alpha/r B A and the
trained head, MS merge undone) evaluates like base + adapter, for the bundled Hugging Face demo and
for random timm / no-qkv-bias checkpoints; a zero gamma fails clearly under --full and exports under LoRA; mpirun -np 2 --full (ZeRO-1)
equals one process with the combined batch.

Run:  /usr/bin/python3 -m pytest -q test/test_vit_full.py   (needs train_vit and build/test/vit_probe)
"""
import csv
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import vit_cases as vc  # noqa: E402

ref = vc.ref
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
DATA = os.path.join(vc.REPO, "data")
MODEL = os.environ.get("VIT_DEMO_MODEL", os.path.join(DATA, "vit_demo"))
TRAIN = os.environ.get("VIT_DEMO_TRAIN", os.path.join(DATA, "vit_demo_ft_train.bin"))
VAL = os.environ.get("VIT_DEMO_VAL", os.path.join(DATA, "vit_demo_ft_val.bin"))
MODES = [("exact", "std", "none"), ("exact", "ms", "none"), ("approx", "std", "none"),
         ("approx", "ms", "none"), ("approx", "ms", "block")]
MODE_IDS = [f"{a}-{n}-{r}" for a, n, r in MODES]


# ---------------------------------------------------------------------------------------------
# gradients against the reference

_CASES = {}


def _full_case(root, name):
    """A model and a case whose GELU inputs (without adapters, as --full runs) are away from the
    ReGELU2 breakpoints in both norm modes."""
    if name in _CASES:
        return _CASES[name]
    d = os.path.join(root, name)
    vc.write_model(d, vc.model_config(name), seed=1)
    model = ref.VitModel.load(d)
    batch, rank, _, classes = vc.SHAPES[name]
    for k in range(50):
        case = vc.make_case(model.cfg, batch, rank, classes, seed=11 + 1000 * k)
        outs = {n: ref.run_case(model, case, "exact", n, rank, full=True) for n in ("std", "ms")}
        if all(o["stats"]["min_margin"] > vc.BREAKPOINT_MARGIN for o in outs.values()):
            break
    else:
        raise RuntimeError("no case away from the breakpoints")
    path = os.path.join(root, f"{name}.full.case.safetensors")
    vc.st_io.save(path, case)
    _CASES[name] = (d, model, case, path, {})
    return _CASES[name]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("vit_full"))


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("name", ["square", "nonsquare"])
def test_probe_full_finetuning_matches_reference(workdir, name, mode):
    """--full: the gradient of every weight (the linears' W and b, of the merged layer under MS-LN;
    the standard norms; the embeddings; the final norm) and of the head against the fp64
    reference; the case's adapters are ignored."""
    act, norm, recompute = mode
    d, model, case, path, cache = _full_case(workdir, name)
    if (act, norm) not in cache:
        cache[(act, norm)] = ref.run_case(model, case, act, norm, full=True)
    want = cache[(act, norm)]
    out = os.path.join(workdir, f"{name}.full.{act}.{norm}.{recompute}.out.safetensors")
    vc.run([vc.binary("build/test/vit_probe", "VIT_PROBE"), "--model", d, "--case", path, "--out-file", out,
            "--act", act, "--norm", norm, "--recompute", recompute, "--full"])
    got = vc.st_io.load(out)
    assert sum(k.endswith(".W") for k in want) == model.cfg.n_layers * 6
    assert not any(".lora." in k for k in got)
    vc.check_errors(vc.compare(want, got), f"full {name} {act} {norm} {recompute}")


# ---------------------------------------------------------------------------------------------
# training, export, reload

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
    mpirun = shutil.which("mpirun")
    if not mpirun:
        pytest.fail("mpirun not found: install openmpi-bin (scripts/ci/install_deps.sh does)")
    args = ["--model", MODEL, "--data", TRAIN, "--mode", "lowmem", "--full", "--steps", "5", "--lr", "1e-3",
            "--seed", "4", "--threads", "1", "--hflip"]
    exe = vc.binary("train_vit", "TRAIN_VIT")
    vc.run([exe] + args + ["--batch", "8", "--grad-accum", "2", "--out", str(tmp_path / "one")])
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="passive")
    p = subprocess.run([mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", exe] + args +
                       ["--batch", "8", "--out", str(tmp_path / "two")], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "2 ranks" in p.stdout and "per rank" in p.stdout

    def losses(d):
        with open(os.path.join(d, "log.csv")) as f:
            return [float(r["loss"]) for r in csv.DictReader(f)]
    assert losses(tmp_path / "one") == losses(tmp_path / "two") and len(losses(tmp_path / "one")) == 5
    a = vc.st_io.load(str(tmp_path / "one" / "model.safetensors"))
    b = vc.st_io.load(str(tmp_path / "two" / "model.safetensors"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
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
