"""train_vit as a user runs it: it fine-tunes the bundled demo model (data/vit_demo, pretrained by
scripts/demo/make_demo_vit.py on Fashion-MNIST classes 0-4) on the bundled subset of the other
classes; validation accuracy must rise well above the new head's chance level; the same seed gives
the same run; another seed gives another; the MFU it logs. The memory plan of --dry-run against the
per-module accounting of docs/memory.md, and bad input (one-line error, exit status 1). What spans
runs and processes (resume, ranks, adapters and exports, the health stops) is test_vit_system.py's.
VIT_DEMO_MODEL / VIT_DEMO_TRAIN / VIT_DEMO_VAL override the bundled files.

Run:  /usr/bin/python3 -m pytest -q test/system/test_vit_train.py
train_vit must be built and data/vit_demo* present; if not, the tests FAIL.
"""
import csv
import json
import os
import struct

import numpy as np

import pytest

import vit_cases as vc  # noqa: E402


DATA = os.path.join(vc.REPO, "data")
MODEL = os.environ.get("VIT_DEMO_MODEL", os.path.join(DATA, "vit_demo"))
TRAIN = os.environ.get("VIT_DEMO_TRAIN", os.path.join(DATA, "vit_demo_ft_train.bin"))
VAL = os.environ.get("VIT_DEMO_VAL", os.path.join(DATA, "vit_demo_ft_val.bin"))


def fine_tune(out_dir, seed, steps, mode="lowmem", extra=()):
    for p in (os.path.join(MODEL, "model.safetensors"), TRAIN, VAL):
        assert os.path.isfile(p), f"{p} is missing (made by scripts/demo/make_demo_vit.py)"
    p = vc.train_vit("--model", MODEL, "--data", TRAIN, "--val", VAL, "--mode", mode,
                     "--steps", steps, "--batch", 16, "--lr", "3e-3", "--warmup", 3,
                     "--lora-rank", 4, "--seed", seed, "--threads", 2, "--val-every", steps,
                     "--out", out_dir, *extra)
    with open(os.path.join(out_dir, "log.csv")) as f:
        rows = list(csv.DictReader(f))
    return rows, p.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vit_train")
    return {"a": fine_tune(str(root / "a"), 5, 40),
            "b": fine_tune(str(root / "b"), 5, 40),
            "c": fine_tune(str(root / "c"), 6, 40)}


def test_fine_tune_raises_accuracy(runs):
    rows, stdout = runs["a"]
    assert "lowmem" in stdout and "baseline" in stdout  # the memory table beside the baseline
    before = float(rows[0]["val_accuracy"])
    after = float(rows[-1]["val_accuracy"])
    print(f"val accuracy {before:.3f} -> {after:.3f}; val loss {rows[0]['val_loss']} -> "
          f"{rows[-1]['val_loss']}")
    assert before < 0.45, "the new head should start near chance (5 classes)"
    assert after > before + 0.25
    assert float(rows[-1]["val_loss"]) < float(rows[0]["val_loss"]) - 0.3


def test_same_seed_same_run(runs):
    (a, _), (b, _) = runs["a"], runs["b"]
    strip = [{k: v for k, v in r.items() if k != "images_per_s"} for r in a]
    assert strip == [{k: v for k, v in r.items() if k != "images_per_s"} for r in b]


def test_other_seed_other_run(runs):
    (a, _), (c, _) = runs["a"], runs["c"]
    assert [r["loss"] for r in a[1:]] != [r["loss"] for r in c[1:]]


def test_log_reports_mfu_from_the_model_flops(monkeypatch):
    """MFU on each step line (with LLMC_PEAK_TFLOPS naming a peak on the CPU): the FLOPs per image
    it implies match a count written from the convention: every token through the block linears
    (4 FLOPs per weight under LoRA, plus the adapters' 6 r (in + out)), bidirectional attention
    12 T d per layer, the patch embedding, and the new head (trained: 6 per weight)."""
    import json
    import re
    with open(os.path.join(MODEL, "config.json")) as f:
        c = json.load(f)
    d, h, r, classes = c["hidden_size"], c["intermediate_size"], 8, 5
    T = 1 + (c["image_size"] // c["patch_size"]) ** 2
    shapes = [(d, d)] * 4 + [(d, h), (h, d)]
    per_token = c["num_hidden_layers"] * (sum(4 * i * o + 6 * r * (i + o) for i, o in shapes) + 12 * T * d)
    want = T * per_token + (T - 1) * 4 * c["patch_size"] ** 2 * c["num_channels"] * d + 6 * d * classes
    monkeypatch.setenv("LLMC_PEAK_TFLOPS", "0.0001")
    p = vc.train_vit("--model", MODEL, "--data", TRAIN, "--steps", 3, "--batch", 8, "--threads", 1)
    steps = re.findall(r"\| (\d+) img/s \| MFU ([0-9.]+)%", p.stdout)
    assert len(steps) == 3, p.stdout
    for imgs, mfu in steps:
        got = float(mfu) / 100 * 1e8 / int(imgs)
        assert abs(got / want - 1) < 0.5 / int(imgs) + 0.005, (got, want)  # the rate is printed rounded


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


@pytest.mark.parametrize("device, abytes", [("cuda", 2), ("cpu", 4)])
def test_dry_run_offload_moves_the_checkpoints_to_host(tmp_path, device, abytes):
    """--offload host: the 12 block inputs [N, d] leave the device for (pinned) host memory, and
    two staging buffers of one block input each take their place on the device."""
    N, d = 64 * 197, 768
    args = ("--mode", "lowmem", "--recompute", "block", "--device", device)
    kept, off = dry_run(tmp_path, *args), dry_run(tmp_path, *args, "--offload", "host")
    assert kept["host_bytes"] == 0 and off["host_bytes"] == 12 * N * d * abytes
    assert kept["total_bytes"] - off["total_bytes"] == (12 - 2) * N * d * abytes
    assert off["offload"] == "host" and kept["offload"] == "none"


def test_offload_needs_block_recompute(tmp_path):
    d = tmp_path / "vitb16"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(VIT_B16))
    p = vc.train_vit("--model", d, "--dry-run", "--mode", "lowmem", "--offload", "host", check=False)
    check_one_line_error(p, "flag --offload host", "--recompute block")


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
