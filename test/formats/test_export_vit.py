"""scripts/export/export_vit.py: a timm state dict (.npz or a torch checkpoint, fused qkv) becomes
the Hugging Face layout train_vit reads, computing the same model; what it cannot map (a global-pool
head) is refused in one line.

Run:  /usr/bin/python3 -m pytest -q test/formats/test_export_vit.py   (needs build/test/vit_probe)
"""
import json
import pickle
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


class _Payload:
    """Unpickling this calls open(marker, "w"): the file appears if the loader executed it."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _plant(kind, path, marker):
    """A checkpoint of `kind` whose full unpickling would run _Payload's call."""
    if kind == "torch_zip":
        torch.save({"model": {"cls_token": torch.zeros(1, 1, 4), "evil": _Payload(marker)}}, path)
    elif kind == "legacy_pickle":
        with open(path, "wb") as f:
            pickle.dump({"state_dict": {"evil": _Payload(marker)}}, f)
    else:  # an object array in a .npz is pickled
        arr = np.empty(1, dtype=object)
        arr[0] = _Payload(marker)
        np.savez(path, cls_token=np.zeros((1, 1, 4), np.float32), evil=arr)


@pytest.mark.parametrize("kind,ext", [("torch_zip", "pth"), ("legacy_pickle", "bin"), ("npz_object", "npz")])
def test_export_refuses_a_pickle_payload(tmp_path, kind, ext):
    """No pickle is ever executed (issue 40): a checkpoint whose unpickling would create a marker
    file is refused in one line naming the file, exit 1, no marker, no output directory. The
    control: the same payload, loaded with pickle's full unpickler in this process, does run."""
    src, marker, out = str(tmp_path / f"evil.{ext}"), str(tmp_path / "marker"), str(tmp_path / "o")
    _plant(kind, src, marker)
    p = subprocess.run([PY, os.path.join(vc.REPO, "scripts", "export", "export_vit.py"), "--input", src, "--out", out],
                       capture_output=True, text=True, timeout=120)
    err = p.stderr.strip()
    assert not os.path.exists(marker), "the payload ran"
    assert p.returncode == 1 and err.startswith("error: ") and len(err.splitlines()) == 1, (p.returncode, err)
    assert src in err and not os.path.exists(out), err
    control = str(tmp_path / "control")
    _plant(kind, src, control)
    if kind == "npz_object":
        with np.load(src, allow_pickle=True) as z:
            z["evil"]
    elif kind == "legacy_pickle":
        with open(src, "rb") as f:
            pickle.load(f)
    else:
        torch.load(src, weights_only=False)
    assert os.path.exists(control), "the planted payload is inert: the test proves nothing"
