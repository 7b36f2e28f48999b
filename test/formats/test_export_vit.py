"""scripts/export/export_vit.py: a timm state dict (.npz or a torch checkpoint, fused qkv) becomes
the Hugging Face layout train_vit reads, computing the same model; what it cannot map (a global-pool
head) is refused in one line.

Run:  /usr/bin/python3 -m pytest -q test/formats/test_export_vit.py   (needs build/test/vit_probe)
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import vit_cases as vc  # noqa: E402  (puts scripts/formats, data and export on sys.path)
import export_vit  # noqa: E402


PY = sys.executable


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
