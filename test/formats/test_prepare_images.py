"""Image shards, written and read: scripts/data/prepare_images.py on synthetic Fashion-MNIST IDX
files, CIFAR-10/100 binary archives and an image folder, and train_vit's image loader
(llmc/vision/imagedata.h, through build/test/vit_probe --dump-batches) against torch's
F.interpolate, on shards of every layout.

Run:  /usr/bin/python3 -m pytest -q test/formats/test_prepare_images.py
build/test/vit_probe must be built first; a missing binary FAILS the tests that use it.
"""
import gzip
import os
import struct
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import vit_cases as vc  # noqa: E402  (puts scripts/formats, data and export on sys.path)
import prepare_images as pi  # noqa: E402


PY = sys.executable


def dump(model_dir, shard, out, batches, batch, seed=1, hflip=False, image_size=None):
    cmd = [vc.binary("build/test/vit_probe", "VIT_PROBE"), "--model", model_dir, "--data", shard,
           "--dump-batches", str(batches), "--batch", str(batch), "--seed", str(seed),
           "--out-file", out]
    if hflip:
        cmd.append("--hflip")
    if image_size:
        cmd += ["--image-size", image_size]
    vc.run(cmd)
    return vc.st_io.load(out)


def expected_pixels(images, size, mean, std, channels):
    """What the loader must produce: torch bilinear resize (align_corners=False, no antialias) of
    pixels/255, grayscale replicated, normalised. images uint8 [n, H, W, C] -> [n, C', h, w]."""
    x = torch.from_numpy(images.astype(np.float64) / 255.0).permute(0, 3, 1, 2)
    x = F.interpolate(x, size=size, mode="bilinear", align_corners=False)
    if x.shape[1] == 1 and channels == 3:
        x = x.repeat(1, 3, 1, 1)
    mean = torch.tensor(mean, dtype=torch.float64)[None, :, None, None]
    std = torch.tensor(std, dtype=torch.float64)[None, :, None, None]
    return ((x - mean) / std).numpy()


# ---------------------------------------------------------------------------------------------
# the loader

LOADER_CASES = [  # (shard H, W, C), model channels, model resolution
    ((10, 7, 1), 3, (16, 16)),   # grayscale -> RGB, upsampled, non-square source
    ((40, 30, 3), 3, (16, 16)),  # downsampled (bilinear, no antialias)
    ((16, 16, 3), 3, (16, 16)),  # same size: a plain copy
    ((9, 13, 1), 1, (12, 20)),   # grayscale model at a changed, non-square resolution
]


@pytest.mark.parametrize("shape,channels,size", LOADER_CASES,
                         ids=[f"{s[0]}x{s[1]}x{s[2]}-to-{c}x{z[0]}x{z[1]}" for s, c, z in LOADER_CASES])
def test_loader_matches_torch(tmp_path, shape, channels, size):
    H, W, C = shape
    name = "square" if channels == 3 else "nonsquare"
    mean, std = ([0.4, 0.5, 0.6], [0.2, 0.25, 0.3]) if channels == 3 else ([0.3], [0.4])
    model = str(tmp_path / "model")
    vc.write_model(model, vc.model_config(name), preprocessor={"image_mean": mean, "image_std": std})
    rng = np.random.default_rng(0)
    n, classes = 11, 4
    images = rng.integers(0, 256, size=(n, H, W, C), dtype=np.uint8)
    labels = rng.integers(0, classes, size=n)
    shard = vc.write_shard(str(tmp_path / "s.bin"), images, labels, classes)
    res = None if size == tuple(vc.ref.VitConfig(vc.model_config(name)).image) else f"{size[0]}x{size[1]}"
    got = dump(model, shard, str(tmp_path / "d.st"), 3, 4, hflip=True, image_size=res)
    idx, flip = got["index"], got["flip"]
    assert got["pixels"].shape == (12, channels) + size
    assert sorted(idx[:n].tolist()) == list(range(n)), "first epoch is not a permutation"
    assert idx[:n].tolist() != list(range(n)), "not shuffled"
    assert set(flip.tolist()) == {0, 1}
    np.testing.assert_array_equal(got["labels"], labels[idx])
    want = expected_pixels(images[idx], size, mean, std, channels)
    want = np.where(flip[:, None, None, None] == 1, want[..., ::-1], want)
    err = np.abs(got["pixels"] - want).max()
    assert err < 2e-5, err
    # the order depends on the seed only
    again = dump(model, shard, str(tmp_path / "d2.st"), 3, 4, hflip=True, image_size=res)
    assert again["pixels"].tobytes() == got["pixels"].tobytes()
    other = dump(model, shard, str(tmp_path / "d3.st"), 3, 4, seed=2, image_size=res)
    assert other["index"].tolist() != idx.tolist()
    assert not other["flip"].any()


# ---------------------------------------------------------------------------------------------
# prepare_images.py

def run_prepare(*args, check=True):
    p = subprocess.run([PY, os.path.join(vc.REPO, "scripts", "data", "prepare_images.py")] +
                       [str(a) for a in args], capture_output=True, text=True, timeout=120)
    if check and p.returncode != 0:
        raise AssertionError(f"prepare_images failed: {p.stderr}")
    return p


def write_idx(path, arr, gz=True):
    arr = np.ascontiguousarray(arr, dtype=np.uint8)
    data = bytes([0, 0, 8, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.tobytes()
    with open(path, "wb") as f:
        f.write(gzip.compress(data) if gz else data)


def test_prepare_fashion_mnist_idx(tmp_path):
    rng = np.random.default_rng(1)
    for split, n in (("train", 60), ("t10k", 20)):
        write_idx(tmp_path / f"{split}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        write_idx(tmp_path / f"{split}-labels-idx1-ubyte.gz", np.arange(n) % 10)
    out = tmp_path / "fm.bin"
    run_prepare("--fashion-mnist", tmp_path, "--split", "train", "--classes", "7,2",
                "--per-class", 4, "--out", out)
    images, labels, classes = pi.read_shard(str(out))
    assert classes == 2 and images.shape == (8, 28, 28, 1)
    assert np.bincount(labels).tolist() == [4, 4]
    src = pi.read_idx(str(tmp_path / "train-images-idx3-ubyte.gz"), 3)
    src_lab = np.arange(60) % 10
    by_bytes = {src[i].tobytes(): src_lab[i] for i in range(60)}
    for img, lab in zip(images, labels):
        assert by_bytes[img[..., 0].tobytes()] == (7 if lab == 0 else 2)
    # the C reader takes it: 28x28 grayscale into a 12x20 grayscale model
    model = str(tmp_path / "model")
    vc.write_model(model, vc.model_config("nonsquare"))
    got = dump(model, str(out), str(tmp_path / "d.st"), 1, 8)
    assert sorted(got["labels"].tolist()) == [0] * 4 + [1] * 4
    # a corrupt IDX file is one clear line
    with open(tmp_path / "t10k-images-idx3-ubyte.gz", "wb") as f:
        f.write(gzip.compress(b"\x00\x00\x08\x03" + struct.pack(">3I", 20, 28, 28) + b"\x00" * 100))
    p = run_prepare("--fashion-mnist", tmp_path, "--split", "test", "--out", out, check=False)
    assert p.returncode == 1 and p.stderr.startswith("error: ") and p.stderr.count("\n") == 1
    assert "t10k-images-idx3-ubyte.gz" in p.stderr and "need" in p.stderr


def cifar_records(labels_cols, n, rng):
    lab = np.stack([rng.integers(0, hi, n) for hi in labels_cols], axis=1).astype(np.uint8)
    px = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
    return np.concatenate([lab, px], axis=1), lab, px


def test_prepare_cifar10_archive(tmp_path):
    rng = np.random.default_rng(2)
    tar_path = tmp_path / "cifar-10-binary.tar.gz"
    batches = {}
    with tarfile.open(tar_path, "w:gz") as tar:
        for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
            rec, lab, px = cifar_records([10], 6, rng)
            batches[name] = (lab[:, 0], px)
            p = tmp_path / name
            p.write_bytes(rec.tobytes())
            tar.add(p, arcname="cifar-10-batches-bin/" + name)
    out = tmp_path / "c10.bin"
    run_prepare("--cifar10", tar_path, "--split", "train", "--out", out)
    images, labels, classes = pi.read_shard(str(out))
    assert classes == 10 and images.shape == (30, 32, 32, 3)
    src_lab = np.concatenate([batches[f"data_batch_{i}.bin"][0] for i in range(1, 6)])
    src_px = np.concatenate([batches[f"data_batch_{i}.bin"][1] for i in range(1, 6)])
    hwc = src_px.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    lookup = {hwc[i].tobytes(): src_lab[i] for i in range(30)}
    for img, lab in zip(images, labels):
        assert lookup[img.tobytes()] == lab
    # through the C loader at 32x32 RGB (no resize): exactly the normalised pixels
    model = str(tmp_path / "model")
    vc.write_model(model, vc.model_config("square", image_size=32, patch_size=8),
                   preprocessor={"image_mean": [0.5, 0.5, 0.5], "image_std": [0.25, 0.25, 0.25]})
    got = dump(model, str(out), str(tmp_path / "d.st"), 1, 5)
    want = (images[got["index"]].transpose(0, 3, 1, 2) / 255.0 - 0.5) / 0.25
    assert np.abs(got["pixels"] - want).max() < 1e-5


def test_prepare_cifar100_dir(tmp_path):
    rng = np.random.default_rng(3)
    d = tmp_path / "cifar-100-binary"
    d.mkdir()
    rec, lab, px = cifar_records([20, 100], 9, rng)
    (d / "train.bin").write_bytes(rec.tobytes())
    for coarse, col, k in ((False, 1, 100), (True, 0, 20)):
        out = tmp_path / f"c100_{coarse}.bin"
        run_prepare("--cifar100", tmp_path, "--out", out, *(["--coarse"] if coarse else []))
        images, labels, classes = pi.read_shard(str(out))
        assert classes == k and len(labels) == 9
        hwc = px.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        lookup = {hwc[i].tobytes(): lab[i, col] for i in range(9)}
        assert all(lookup[img.tobytes()] == l for img, l in zip(images, labels))
    p = run_prepare("--cifar100", tmp_path, "--split", "test", "--out", tmp_path / "x.bin", check=False)
    assert p.returncode == 1 and "test.bin" in p.stderr


def test_prepare_image_folder(tmp_path):
    from PIL import Image
    rng = np.random.default_rng(4)
    arrays = {}
    for cls in ("cat", "dog"):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        for i in range(3):
            a = rng.integers(0, 256, (5, 6, 3), dtype=np.uint8)
            Image.fromarray(a).save(tmp_path / "imgs" / cls / f"{i}.png")
            arrays[a.tobytes()] = cls
    out = tmp_path / "f.bin"
    run_prepare("--folder", tmp_path / "imgs", "--out", out)
    images, labels, classes = pi.read_shard(str(out))
    assert classes == 2 and images.shape == (6, 5, 6, 3)
    assert all(arrays[img.tobytes()] == ("cat", "dog")[l] for img, l in zip(images, labels))
    Image.fromarray(rng.integers(0, 256, (7, 7, 3), dtype=np.uint8)).save(tmp_path / "imgs" / "dog" / "x.png")
    p = run_prepare("--folder", tmp_path / "imgs", "--out", out, check=False)
    assert p.returncode == 1 and "--size" in p.stderr
    run_prepare("--folder", tmp_path / "imgs", "--size", "4x8", "--channels", "1", "--out", out)
    images, labels, _ = pi.read_shard(str(out))
    assert images.shape == (7, 4, 8, 1)
