"""ViT data, formats and plan: the image loader (llmc/vision/imagedata.h, through build/test/vit_probe
--dump-batches) against torch's F.interpolate; scripts/data/prepare_images.py on synthetic
Fashion-MNIST IDX files, CIFAR-10/100 binary archives and an image folder; scripts/export/export_vit.py
from timm state dicts; bad input to train_vit (one-line error, exit status 1); and the memory plan
of --dry-run against the per-module accounting of docs/memory.md.

Run:  /usr/bin/python3 -m pytest -q test/test_vit_data.py
train_vit and build/test/vit_probe must be built first; a missing binary FAILS the tests that use it.
"""
import gzip
import json
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
import export_vit  # noqa: E402
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


# ---------------------------------------------------------------------------------------------
# export_vit.py

@pytest.mark.parametrize("fmt", ["npz", "pth"])
def test_export_timm(tmp_path, fmt):
    """A timm state dict (fused qkv) becomes the Hugging Face layout with identical tensors, a
    config read off the shapes, and the model train_vit computes is the same one."""
    config = vc.model_config("square", layer_norm_eps=1e-6)
    cfg = vc.ref.VitConfig(config)
    hf = vc.random_hf_weights(cfg, seed=5)
    timm = vc.hf_to_timm(cfg, hf)
    timm["head.weight"] = np.ones((7, cfg.dim), np.float32)
    timm["head.bias"] = np.ones(7, np.float32)
    src = str(tmp_path / f"state.{fmt}")
    if fmt == "npz":
        np.savez(src, **timm)
    else:
        torch.save({"model": {k: torch.from_numpy(v) for k, v in timm.items()}}, src)
    out = str(tmp_path / "exported")
    p = subprocess.run([PY, os.path.join(vc.REPO, "scripts", "export", "export_vit.py"), "--input", src,
                        "--out", out, "--heads", "3", "--mean", "0.1,0.2,0.3", "--std", "0.5"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    got = vc.st_io.load(os.path.join(out, "model.safetensors"))
    want = {"vit." + k: v for k, v in hf.items()}
    assert set(got) == set(want) | {"classifier.weight", "classifier.bias"}
    for k, v in want.items():
        assert np.array_equal(got[k], v), k
    with open(os.path.join(out, "config.json")) as f:
        c = json.load(f)
    for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "image_size", "patch_size", "num_channels", "layer_norm_eps", "hidden_act"):
        assert c[k] == config[k], k
    with open(os.path.join(out, "preprocessor_config.json")) as f:
        pc = json.load(f)
    assert pc["image_mean"] == [0.1, 0.2, 0.3] and pc["image_std"] == [0.5, 0.5, 0.5]
    # the C trainer reads it, and computes what it computes on the original layout
    orig = str(tmp_path / "orig")
    os.makedirs(orig)
    vc.st_io.save(os.path.join(orig, "model.safetensors"), want)
    with open(os.path.join(orig, "config.json"), "w") as f:
        json.dump(config, f)
    case = vc.make_case(cfg, 2, 2, 3, seed=1)
    vc.st_io.save(str(tmp_path / "case.st"), case)
    a = vc.run_probe(out, tmp_path / "case.st", tmp_path / "a.st", "approx", "ms", "none", 2, 4.0)
    b = vc.run_probe(orig, tmp_path / "case.st", tmp_path / "b.st", "approx", "ms", "none", 2, 4.0)
    assert all(a[k].tobytes() == b[k].tobytes() for k in a)


def test_export_refuses_global_pool(tmp_path):
    cfg = vc.ref.VitConfig(vc.model_config("square"))
    timm = vc.hf_to_timm(cfg, vc.random_hf_weights(cfg))
    timm["fc_norm.weight"] = np.ones(cfg.dim, np.float32)
    np.savez(tmp_path / "s.npz", **timm)
    p = subprocess.run([PY, os.path.join(vc.REPO, "scripts", "export", "export_vit.py"), "--input",
                        str(tmp_path / "s.npz"), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "fc_norm" in p.stderr and p.stderr.count("\n") == 1


# ---------------------------------------------------------------------------------------------
# bad input to train_vit: one line on stderr naming what is wrong, exit status 1, no crash

def _bad_shard(kind, images, labels):
    data = bytearray(vc.shard_bytes(images, labels, 5))
    if kind == "magic":
        data[:4] = b"IMGZ"
    elif kind == "version":
        data[4:8] = struct.pack("<I", 2)
    elif kind == "truncated":
        data = data[:-10]
    elif kind == "trailing":
        data += b"\0" * 3
    elif kind == "reserved":
        data[40] = 7
    elif kind == "label":
        data[-2:] = struct.pack("<H", 5)
    elif kind == "zero_images":
        data = bytearray(vc.shard_bytes(images[:0].reshape(0, 12, 20, 1), labels[:0], 5))
    elif kind == "channels":
        data = bytearray(vc.shard_bytes(np.repeat(images, 3, axis=3), labels, 5))
    return bytes(data)


BAD_SHARDS = {"magic": "bad magic", "version": "version 2, expected 1",
              "truncated": "truncated or wrong size", "trailing": "truncated or wrong size",
              "reserved": "header byte 40", "label": "has label 5, but the header says 5 classes",
              "zero_images": "0 images", "channels": "images have 3 channels, but the model wants 1"}


def check_one_line_error(p, *needles):
    assert p.returncode == 1, f"exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    err = p.stderr
    assert err.startswith("error: ") and err.count("\n") == 1, repr(err)
    for n in needles:
        assert n in err, f"{n!r} not in {err!r}"


@pytest.fixture(scope="module")
def bad_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("vit_bad")
    vc.write_model(str(root / "model"), vc.model_config("nonsquare"))
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (6, 12, 20, 1), dtype=np.uint8)
    labels = np.arange(6) % 5
    vc.write_shard(str(root / "good.bin"), images, labels, 5)
    return root, images, labels


@pytest.mark.parametrize("kind", list(BAD_SHARDS))
def test_bad_image_shard(bad_root, kind):
    root, images, labels = bad_root
    path = root / f"bad_{kind}.bin"
    path.write_bytes(_bad_shard(kind, images, labels))
    for flag in ("--data", "--val"):
        args = ["--model", root / "model", "--steps", 1, "--batch", 2, "--threads", 1]
        args += ["--data", path] if flag == "--data" else ["--data", root / "good.bin", "--val", path]
        check_one_line_error(vc.train_vit(*args, check=False), str(path), BAD_SHARDS[kind])


BAD_MODELS = {
    "missing_tensor": (dict(drop="vit.encoder.layer.1.output.dense.weight"), {},
                       'missing tensor "vit.encoder.layer.1.output.dense.weight"'),
    "wrong_shape": (dict(reshape={"vit.encoder.layer.0.intermediate.dense.weight": (50, 32)}), {},
                    "has shape [50,32], expected [50,33]"),
    "wrong_pos_grid": (dict(reshape={"vit.embeddings.position_embeddings": (1, 17, 33)}), {},
                       "expected [1,16,33]"),
    "heads": ({}, dict(num_attention_heads=4), "num_attention_heads (4) does not divide hidden_size (33)"),
    "patch": ({}, dict(patch_size=7), "not a multiple of patch_size"),
    "act": ({}, dict(hidden_act="relu"), 'hidden_act "relu" is not supported'),
    "channels": ({}, dict(num_channels=2), "num_channels 2, expected 1 or 3"),
}


@pytest.mark.parametrize("kind", list(BAD_MODELS))
def test_bad_checkpoint(bad_root, kind):
    root, _, _ = bad_root
    kw, overrides, needle = BAD_MODELS[kind]
    model = root / f"model_{kind}"
    vc.write_model(str(model), vc.model_config("nonsquare"), **kw)
    if overrides:  # config.json edited afterwards: the reference would refuse to write it
        (model / "config.json").write_text(json.dumps(vc.model_config("nonsquare", **overrides)))
    p = vc.train_vit("--model", model, "--data", root / "good.bin", "--steps", 1, "--batch", 2,
                     check=False)
    check_one_line_error(p, needle)


BAD_FLAGS = {
    "image_size": (["--image-size", "13x20"], "flag --image-size: 13x20 is not a multiple of the patch size 4x4"),
    "image_size_syntax": (["--image-size", "12by20"], 'expected S or HxW, got "12by20"'),
    "classes": (["--classes", "3"], "the shard has 5 classes, more than --classes 3"),
    "targets": (["--lora-targets", "q,gate"], 'unknown target "gate", expected a comma list of q,k,v,proj,fc1,fc2'),
    "seq": (["--seq", "5"], "unknown flag --seq"),
    "no_model_dir": (["--model", "/nonexistent/vit"], "flag --model: /nonexistent/vit is not a directory"),
    "full": (["--full", "--lora-targets", "q"], "flag --full: not with --lora-targets or --adapter"),
    "eval_only": (["--eval-only"], "flag --eval-only: needs --val"),
}


@pytest.mark.parametrize("kind", list(BAD_FLAGS))
def test_bad_flags(bad_root, kind):
    root, _, _ = bad_root
    extra, needle = BAD_FLAGS[kind]
    args = ["--model", root / "model", "--data", root / "good.bin", "--steps", 1, "--batch", 2]
    if extra[0] == "--model":
        args[1] = extra[1]
        extra = []
    check_one_line_error(vc.train_vit(*args, *extra, check=False), needle)


# ---------------------------------------------------------------------------------------------
# the memory plan (--dry-run), ViT-B/16 at 224 px, batch 64

VIT_B16 = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
               image_size=224, patch_size=16, num_channels=3, layer_norm_eps=1e-12, hidden_act="gelu")


def expected_per_token(mode, targets, d=768, f=3072, h=12, r=4, a=2):
    """Bytes per token per block by module, written out from docs/memory.md (a = bytes per
    activation element; mean, r and lse are fp32)."""
    lowmem = mode == "lowmem"
    m = {"attn_norm": 4 if lowmem else a * d + 8,
         "qkv_input": a * d,
         "attention": 4 * a * d + 4 * h,
         "lora": a * r * len(targets),
         "mlp_norm": 4 if lowmem else a * d + 8,
         "gelu": f / 4 if lowmem else a * f}
    if lowmem or "fc1" in targets:
        m["fc1_input"] = a * d
    if "fc2" in targets:
        m["fc2_input"] = a * f
    return m


def dry_run(tmp_path, *args):
    d = tmp_path / "vitb16"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(VIT_B16))
    p = vc.train_vit("--model", d, "--dry-run", "--json", "--batch", 64, "--lora-rank", 4, *args)
    return json.loads(p.stdout)


@pytest.mark.parametrize("targets", ["q,k,v,proj,fc1,fc2", "q,v"])
def test_dry_run_vit_b16(tmp_path, targets):
    tl = targets.split(",")
    N = 64 * 197
    res = {}
    for mode in ("baseline", "lowmem"):
        j = dry_run(tmp_path, "--mode", mode, "--lora-targets", targets)
        assert j["model"] == "vit" and j["tokens"] == N and j["blocks"] == 12
        assert j["tokens_per_image"] == 197 and j["device"] == "cuda"
        want = expected_per_token(mode, tl)
        assert j["per_block"] == {k: int(v * N) for k, v in want.items()}, (mode, j["per_block"])
        assert j["activation_bytes"] == 12 * N * sum(want.values())
        base = expected_per_token("baseline", tl)
        assert j["baseline"]["per_block"] == {k: int(v * N) for k, v in base.items()}
        res[mode] = j["activation_bytes"]
    # the main terms of docs/memory.md: baseline 16d + 4f, lowmem 12d + 2.25f (all targets)
    if len(tl) == 6:
        small = 2 * 8 + 4 * 12 + 2 * 4 * 6  # mean/r, lse, LoRA A x (baseline); lowmem 8 + 48 + 48
        assert res["baseline"] == 12 * N * (16 * 768 + 4 * 3072 + small)
        assert res["lowmem"] == 12 * N * (12 * 768 + 2.25 * 3072 + 8 + 48 + 48)
    print(f"ViT-B/16 batch 64, LoRA r=4 on {targets}: baseline {res['baseline']} B, lowmem "
          f"{res['lowmem']} B, ratio {res['lowmem'] / res['baseline']:.4f}")


def test_dry_run_ckpt_and_cpu_layout(tmp_path):
    j = dry_run(tmp_path, "--mode", "ckpt")
    assert j["per_block"] == {"checkpoint": 64 * 197 * 2 * 768}
    j = dry_run(tmp_path, "--mode", "baseline", "--device", "cpu", "--image-size", "384")
    N = 64 * (1 + 24 * 24)
    assert j["tokens"] == N and j["image_size"] == [384, 384]
    want = expected_per_token("baseline", vc.ALL_TARGETS, a=4)
    assert j["per_block"] == {k: int(v * N) for k, v in want.items()}
