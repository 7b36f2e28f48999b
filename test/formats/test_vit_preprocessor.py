"""A ViT checkpoint's preprocessor_config.json read whole (issue 40; llmc/vision/preprocessor.h): the
pixels train_vit feeds the model are those of transformers' image processor (ViTImageProcessor,
CLIPImageProcessor) on the same raw images, when the shard is prepared by
scripts/data/prepare_images.py --preprocessor (resize and crop with PIL as transformers does; the
trainer rescales and normalises). What it does not apply exactly is refused in one line naming the
key: an unknown key or processor type, a 1-element image_mean for 3 channels (transformers'
normalize refuses it too), a shard its resize would change.

transformers runs in build/hfvenv (scripts/ci/install_deps.sh makes it; test/system/test_hf_interop.py
uses the same one); build/test/vit_probe (--dump-batches: the loader's pixels) and train_vit must be built.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import vit_cases as vc  # noqa: E402  (puts scripts/formats, data and export on sys.path)

PY = sys.executable
HF_PYTHON = os.path.join(vc.REPO, "build", "hfvenv", "bin", "python")
SIZES = [(23, 31), (40, 20), (16, 16), (17, 50)]  # raw image sides (H, W)
MEAN, STD = [0.4, 0.5, 0.6], [0.2, 0.25, 0.3]
CONFIGS = {
    "vit": {"image_processor_type": "ViTImageProcessor", "do_resize": True, "size": {"height": 16, "width": 16},
            "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
            "image_mean": MEAN, "image_std": STD},
    "vit_legacy_int_size": {"feature_extractor_type": "ViTFeatureExtractor", "do_resize": True, "size": 16,
                            "resample": 3, "do_normalize": True, "image_mean": MEAN, "image_std": STD},
    "vit_no_normalize": {"image_processor_type": "ViTImageProcessor", "size": {"height": 16, "width": 16},
                         "rescale_factor": 0.5 / 255, "do_normalize": False},
    # CLIP's usual shortest_edge = crop side (an edge other than the crop is refused: see REFUSALS)
    "clip": {"image_processor_type": "CLIPImageProcessor", "do_resize": True, "size": {"shortest_edge": 16},
             "resample": 3, "do_center_crop": True, "crop_size": {"height": 16, "width": 16}, "do_rescale": True,
             "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True},
}
# float32 against float32: transformers rescales in float64 then normalises in float32; the loader
# folds both into one float32 multiply-add. Values reach |x| <= 4, a float32 ulp there is 5e-7.
TOL = 5e-6

HF_SCRIPT = r"""
import json, sys
import numpy as np
from transformers import AutoImageProcessor
proc = AutoImageProcessor.from_pretrained(sys.argv[1])
raw = np.load(sys.argv[2])
out = [proc(raw[k], return_tensors="np")["pixel_values"][0] for k in sorted(raw.files, key=lambda k: int(k[3:]))]
np.save(sys.argv[3], np.stack(out))
"""


def need_hf():
    if not os.path.isfile(HF_PYTHON):
        pytest.fail(f"{HF_PYTHON} missing: scripts/ci/install_deps.sh makes it")


def model_with(tmp_path, pre):
    model = str(tmp_path / "model")
    vc.write_model(model, vc.model_config("square"), preprocessor=pre)
    return model


def raw_folder(tmp_path):
    """PNGs of several sizes, each in its own class folder (its label names it: the shard's order is
    prepare_images.py's seeded shuffle); the same images as uint8 HWC arrays."""
    from PIL import Image
    rng = np.random.default_rng(7)
    arrays = []
    for i, (h, w) in enumerate(SIZES):
        os.makedirs(tmp_path / "raw" / f"c{i}")
        a = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
        Image.fromarray(a).save(tmp_path / "raw" / f"c{i}" / "x.png")
        arrays.append(a)
    return str(tmp_path / "raw"), arrays


@pytest.mark.parametrize("name", list(CONFIGS))
def test_pixels_equal_transformers_processor(tmp_path, name):
    need_hf()
    model = model_with(tmp_path, CONFIGS[name])
    folder, arrays = raw_folder(tmp_path)
    shard = str(tmp_path / "s.bin")
    p = subprocess.run([PY, os.path.join(vc.REPO, "scripts", "data", "prepare_images.py"), "--folder", folder,
                        "--preprocessor", os.path.join(model, "preprocessor_config.json"), "--out", shard],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    np.savez(tmp_path / "raw.npz", **{f"img{i}": a for i, a in enumerate(arrays)})
    h = subprocess.run([HF_PYTHON, "-c", HF_SCRIPT, model, str(tmp_path / "raw.npz"), str(tmp_path / "hf.npy")],
                       capture_output=True, text=True, timeout=300)
    assert h.returncode == 0, h.stderr[-3000:]
    want = np.load(tmp_path / "hf.npy")
    got = vc.st_io.load(dump(model, shard, str(tmp_path / "d.st"), len(SIZES)))
    px, want = got["pixels"], want[got["labels"]]  # label i: raw image i
    assert px.shape == want.shape and sorted(got["labels"].tolist()) == list(range(len(SIZES))), px.shape
    err = float(np.abs(px - want).max())
    print(f"{name}: max |loader - transformers| = {err:.2e}")
    assert err < TOL


def dump(model, shard, out, batch):
    vc.run([vc.binary("build/test/vit_probe", "VIT_PROBE"), "--model", model, "--data", shard, "--dump-batches", "1",
            "--batch", str(batch), "--out-file", out])
    return out


def refused(tmp_path, pre, shard_hw, *needles):
    model = model_with(tmp_path, pre)
    rng = np.random.default_rng(0)
    shard = vc.write_shard(str(tmp_path / "v.bin"), rng.integers(0, 256, size=(3,) + shard_hw + (3,)), [0, 1, 1], 2)
    p = vc.train_vit("--model", model, "--val", shard, "--dry-run", "--batch", 2, check=False)
    err = p.stderr.strip()
    assert p.returncode == 1 and err.startswith("error: ") and len(err.splitlines()) == 1, (p.returncode, err)
    assert "preprocessor_config.json" in err, err
    for n in needles:
        assert n in err, (n, err)
    return err


REFUSALS = {
    "unknown_key": ({"image_mean": MEAN, "image_std": STD, "do_pad": True}, (16, 16), ["do_pad"]),
    "unknown_type": ({"image_processor_type": "BeitImageProcessor"}, (16, 16), ["image_processor_type",
                                                                                "BeitImageProcessor"]),
    "crop_key_for_vit": ({"image_processor_type": "ViTImageProcessor", "size": 16, "crop_size": 16}, (16, 16),
                         ["crop_size"]),
    "one_element_mean": ({"image_mean": [0.5], "image_std": STD}, (16, 16), ["image_mean", "3 numbers"]),
    "shard_needs_resize": ({"image_processor_type": "ViTImageProcessor", "size": {"height": 16, "width": 16}},
                           (20, 16), ["size", "prepare_images.py --preprocessor"]),
    "default_size_224": ({"image_processor_type": "ViTImageProcessor"}, (16, 16), ["size 224x224"]),
    "clip_edge_changes_image": ({"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 18},
                                 "crop_size": 16}, (16, 16), ["shortest_edge"]),
    "shortest_edge_no_crop": ({"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 16},
                               "do_center_crop": False}, (16, 16), ["shortest_edge", "do_center_crop"]),
    "bad_resample": ({"image_processor_type": "ViTImageProcessor", "size": 16, "resample": 9}, (16, 16),
                     ["resample"]),
    "size_other_key": ({"image_processor_type": "ViTImageProcessor", "size": {"longest_edge": 16}}, (16, 16),
                       ["size.longest_edge"]),
    "zero_rescale": ({"rescale_factor": 0}, (16, 16), ["rescale_factor"]),
}


@pytest.mark.parametrize("kind", list(REFUSALS))
def test_refused_in_one_line(tmp_path, kind):
    pre, hw, needles = REFUSALS[kind]
    print(refused(tmp_path, pre, hw, *needles))


def test_one_element_mean_is_refused_by_transformers_too(tmp_path):
    """The reason for refusing it: transformers' normalize does not broadcast a 1-element list over
    3 channels (a plain number it does, and so does the trainer)."""
    need_hf()
    script = ("import numpy as np\nfrom transformers import ViTImageProcessor\n"
              "p = ViTImageProcessor(size={'height': 4, 'width': 4}, image_mean=[0.5], image_std=[0.5, 0.5, 0.5])\n"
              "try:\n    p(np.zeros((4, 4, 3), np.uint8))\nexcept ValueError as e:\n    print('refused', e)\n"
              "q = ViTImageProcessor(size={'height': 4, 'width': 4}, image_mean=0.25, image_std=0.5)\n"
              "print('scalar', float(q(np.zeros((4, 4, 3), np.uint8))['pixel_values'][0][2, 0, 0]))\n")
    h = subprocess.run([HF_PYTHON, "-c", script], capture_output=True, text=True, timeout=300)
    assert "refused" in h.stdout and "scalar -0.5" in h.stdout, h.stdout + h.stderr[-2000:]
    # the trainer: a scalar mean is broadcast (evaluates), a 1-element list refused
    model = model_with(tmp_path, {"image_mean": 0.25, "image_std": 0.5})
    rng = np.random.default_rng(0)
    shard = vc.write_shard(str(tmp_path / "v.bin"), rng.integers(0, 256, size=(3, 16, 16, 3)), [0, 1, 1], 2)
    vc.train_vit("--model", model, "--val", shard, "--dry-run", "--batch", 2)
