"""Validation is one exact pass (issue 40): train_llama's and train_vit's validation loss is the
mean over every window (image) of the validation set counted once, whatever --batch, the last
micro-batch partial, on the CPU and on the CUDA backend (the CPU emulator's build/emu/* binaries,
or a GPU's with CUDA_TEST_BACKEND=gpu; test/cuda/cuda_backend.py). The expected value is an
independent one-pass mean computed by the PyTorch references (test/model/reference_llama.py,
test/model/reference_vit.py), window by window; a set whose windows hold no target while the shard
has some is refused in one line naming the file, not reported as NaN."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import llama_cases as lc
import reference_llama as ref
import shards  # noqa: E402  (scripts/formats is on sys.path via llama_cases)
import vit_cases as vc
import reference_vit as vref

sys.path.insert(0, os.path.join(lc.REPO, "test", "cuda"))
from cuda_backend import GPU  # noqa: E402

REPO = lc.REPO
SEQ = 16
WINDOWS = 7
CPU_TRAIN = os.path.join(REPO, "train_llama")
CUDA_TRAIN = os.path.join(REPO, "train_llama" if GPU else "build/emu/train_llama")
CPU_VIT = os.path.join(REPO, "train_vit")
CUDA_VIT = os.path.join(REPO, "train_vit" if GPU else "build/emu/train_vit")
ENV = dict(os.environ, OMP_NUM_THREADS="2")
# The relative error of the mean loss against the float64 reference: the CPU trainer computes in
# fp32 (test/model/llama_cases.py's TOL["loss"], plus the 6 printed decimals); the CUDA backend
# in bf16 (test/cuda/test_llama_cuda.py's TOL_EXACT["loss"]).
TOL = {"cpu": 1e-5, "cuda": 1e-2}


def run(exe, args, check=True):
    if not os.path.isfile(exe):
        pytest.fail(f"{exe} is missing: build it with `make {os.path.relpath(exe, REPO)}`")
    p = subprocess.run([exe] + [str(a) for a in args], capture_output=True, text=True, env=ENV, timeout=300)
    if check:
        assert p.returncode == 0, f"{exe} {args} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    return p


def eval_loss(stdout):
    return float(stdout.split("val loss ")[-1].split()[0])


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A random model, and a validation shard of WINDOWS windows: in the first each token is the one
    the model gives the least probability after the window's tokens before it, in the others the
    most (greedy), so that counting the first window twice moves the mean far beyond the
    tolerances. Returns the directory and the per-window (loss sum, target count) from the
    reference, in file order."""
    d = tmp_path_factory.mktemp("val_exact")
    cfg = lc.model_config("gqa_untied")
    c = lc.write_model(str(d / "model"), cfg, seed=3)
    toks = np.zeros(WINDOWS * SEQ + 1, np.int64)
    toks[0] = 5
    model = ref.LlamaModel.load(str(d / "model"))
    for i in range(1, toks.size):
        w = (i - 1) // SEQ
        with torch.no_grad():
            logits = ref.forward(model, torch.from_numpy(toks[None, w * SEQ:i]), {}, 0.0)[0, -1]
        toks[i] = int(logits.argmin() if w == 0 else logits.argmax())
    rng = np.random.default_rng(1)
    mask = (rng.random(toks.size) < 0.8).astype(np.uint8)
    shards.write_shard(str(d / "val.bin"), toks.astype(np.uint32), mask, c.vocab)
    per_window = []
    for w in range(WINDOWS):
        seg = torch.from_numpy(toks[w * SEQ:w * SEQ + SEQ + 1]).long()
        m = torch.from_numpy(mask[w * SEQ + 1:w * SEQ + SEQ + 1]).double()
        with torch.no_grad():
            lg = ref.forward(model, seg[None, :-1], {}, 0.0)[0]
        nll = -torch.log_softmax(lg, -1).gather(-1, seg[1:, None])[:, 0]
        per_window.append((float((nll * m).sum()), float(m.sum())))
    return d, per_window


def one_pass(per_window, windows):
    return sum(s for s, _ in per_window[:windows]) / sum(n for _, n in per_window[:windows])


def wrapped(per_window, batch):
    """What whole micro-batches wrapping to the first windows would report (the bug)."""
    rows = -(-WINDOWS // batch) * batch
    picked = [per_window[i % WINDOWS] for i in range(rows)]
    return sum(s for s, _ in picked) / sum(n for _, n in picked)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_llama_val_loss_is_one_pass_for_every_batch(llama, device):
    d, per_window = llama
    want = one_pass(per_window, WINDOWS)
    exe = CPU_TRAIN if device == "cpu" else CUDA_TRAIN
    for batch in range(1, WINDOWS + 2):
        if WINDOWS % batch:  # the test can tell a wrapped pass from an exact one at this batch
            assert abs(wrapped(per_window, batch) - want) > 3 * TOL[device] * want
        got = eval_loss(run(exe, ["--model", d / "model", "--val", d / "val.bin", "--eval-only", "--seq", SEQ,
                                  "--batch", batch, "--val-batches", 100, "--device", device]).stdout)
        print(f"{device} --batch {batch}: val loss {got:.6f}, one pass {want:.6f}")
        assert abs(got - want) <= TOL[device] * want, (batch, got, want)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_llama_val_batches_caps_the_windows(llama, device):
    """--val-batches 2 --batch 3 covers windows 0-5, each once."""
    d, per_window = llama
    exe = CPU_TRAIN if device == "cpu" else CUDA_TRAIN
    got = eval_loss(run(exe, ["--model", d / "model", "--val", d / "val.bin", "--eval-only", "--seq", SEQ,
                              "--batch", 3, "--val-batches", 2, "--device", device]).stdout)
    want = one_pass(per_window, 6)
    assert abs(got - want) <= TOL[device] * want, (got, want)


def test_llama_windows_without_targets_refused_by_name(llama, tmp_path):
    """The first windows all masked, targets only in the last: --val-batches 1 evaluates none."""
    d, _ = llama
    toks = np.arange(WINDOWS * SEQ + 1) % 50
    mask = np.zeros(toks.size, np.uint8)
    mask[-3:] = 1
    shards.write_shard(str(tmp_path / "late.bin"), toks.astype(np.uint32), mask, 64)
    for exe, device in ((CPU_TRAIN, "cpu"), (CUDA_TRAIN, "cuda")):
        p = run(exe, ["--model", d / "model", "--val", tmp_path / "late.bin", "--eval-only", "--seq", SEQ, "--batch", 2,
                      "--val-batches", 1, "--device", device], check=False)
        err = p.stderr.strip()
        assert p.returncode == 1 and len(err.splitlines()) == 1 and err.startswith("error: "), (p.returncode, err)
        assert "late.bin" in err and "--val-batches" in err and "nan" not in p.stdout.lower(), err


VIT_CFG = "square"
VIT_IMAGES = 7
VIT_CLASSES = 3
VIT_MEAN, VIT_STD = [0.4, 0.5, 0.6], [0.2, 0.25, 0.3]


@pytest.fixture(scope="module")
def vit(tmp_path_factory):
    """A random ViT whose checkpoint carries a random VIT_CLASSES head (--eval-only evaluates it as
    it is), a shard of VIT_IMAGES random images at the model's resolution, and the reference's
    per-image losses (pixels normalised as preprocessor_config.json says: (x / 255 - mean) / std)."""
    d = tmp_path_factory.mktemp("val_exact_vit")
    cfg = vc.model_config(VIT_CFG)
    c = vc.write_model(str(d / "model"), cfg, seed=2, preprocessor={"image_mean": VIT_MEAN, "image_std": VIT_STD})
    path = str(d / "model" / "model.safetensors")
    t = vc.st_io.load(path)
    rng = np.random.default_rng(4)
    t["classifier.weight"] = (0.5 * rng.standard_normal((VIT_CLASSES, c.dim))).astype(np.float32)
    t["classifier.bias"] = (0.1 * rng.standard_normal(VIT_CLASSES)).astype(np.float32)
    vc.st_io.save(path, t, metadata={"format": "pt"})
    H, W = c.image
    images = rng.integers(0, 256, size=(VIT_IMAGES, H, W, c.channels)).astype(np.uint8)
    labels = rng.integers(0, VIT_CLASSES, size=VIT_IMAGES)
    vc.write_shard(str(d / "val.bin"), images, labels, VIT_CLASSES)
    model = vref.VitModel.load(str(d / "model"))
    x = torch.from_numpy(images).double().permute(0, 3, 1, 2) / 255.0
    x = (x - torch.tensor(VIT_MEAN, dtype=torch.float64)[None, :, None, None]) / \
        torch.tensor(VIT_STD, dtype=torch.float64)[None, :, None, None]
    head = (torch.from_numpy(t["classifier.weight"]).double(), torch.from_numpy(t["classifier.bias"]).double())
    with torch.no_grad():
        logits = vref.forward(model, x, {}, 0.0, head)
    nll = -torch.log_softmax(logits, -1).gather(-1, torch.from_numpy(labels)[:, None].long())[:, 0]
    return d, nll.numpy()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_vit_val_loss_is_one_pass(vit, device):
    """--batch 1, 3 (a partial last batch), 7 and 8, and --val-batches 2 --batch 2 (images 0-3)."""
    d, nll = vit
    exe = CPU_VIT if device == "cpu" else CUDA_VIT
    for batch, batches, images in ((1, 100, 7), (3, 100, 7), (7, 100, 7), (8, 100, 7), (2, 2, 4)):
        p = run(exe, ["--model", d / "model", "--val", d / "val.bin", "--eval-only", "--classes", VIT_CLASSES,
                      "--batch", batch, "--val-batches", batches, "--device", device])
        got, want = eval_loss(p.stdout), float(nll[:images].mean())
        print(f"vit {device} --batch {batch} --val-batches {batches}: val loss {got:.6f}, one pass {want:.6f}")
        assert f"({images} images)" in p.stdout and abs(got - want) <= TOL[device] * want, (batch, got, want)


def test_vit_eval_only_takes_the_class_count_from_the_checkpoint_head(vit, tmp_path):
    """A model directory with a VIT_CLASSES head (as --export-merged writes one) evaluated on a shard
    whose header says 2 classes, without --classes: the head's rows give the class count, and the
    loss is the reference's."""
    d, nll = vit
    import prepare_images as pi
    images, labels, _ = pi.read_shard(str(d / "val.bin"))
    keep = labels < 2
    vc.write_shard(str(tmp_path / "two.bin"), images[keep], labels[keep], 2)
    p = run(CPU_VIT, ["--model", d / "model", "--val", tmp_path / "two.bin", "--eval-only", "--batch", 4,
                      "--val-batches", 100, "--device", "cpu"])
    got, want = eval_loss(p.stdout), float(nll[keep].mean())
    assert abs(got - want) <= TOL["cpu"] * want, (got, want)
