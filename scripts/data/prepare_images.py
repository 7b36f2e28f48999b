#!/usr/bin/env python3
"""Write an image shard for train_vit from Fashion-MNIST, CIFAR-10/100 or a folder of class folders.

Shard format (read by llmc/vision/imagedata.h), little-endian:
  64-byte header: b"IMGS", u32 version = 1, u32 n, u32 H, u32 W, u32 C (1 or 3), u32 classes,
                  zeros up to byte 64
  n * H * W * C uint8 pixels, image after image, each row-major HWC at its native resolution
  n uint16 labels, each < classes
The trainer resizes and normalises on the fly, so shards stay at native resolution (unless --preprocessor).

Sources:
  --fashion-mnist [DIR]  the IDX files of Debian's dataset-fashion-mnist package
                         (default /usr/share/datasets/fashion-mnist: {train,t10k}-images-idx3-ubyte.gz,
                         {train,t10k}-labels-idx1-ubyte.gz; plain or gzip'd), 28x28 grayscale, 10 classes
  --cifar10 PATH         the CIFAR-10 binary version: cifar-10-binary.tar.gz, or the directory holding
                         data_batch_1..5.bin / test_batch.bin (records: 1 label byte + 3072 bytes CHW)
  --cifar100 PATH        the CIFAR-100 binary version: cifar-100-binary.tar.gz or the directory of
                         train.bin / test.bin (records: coarse byte, fine byte, 3072 bytes); fine labels
                         unless --coarse
  --folder DIR           DIR/<class>/<image files>; classes are the sorted folder names (needs PIL);
                         --size HxW resizes (bilinear; at most MAX_SIDE a side), else all images must
                         share one size. 16-bit PNG/TIFF pixels are reduced to 8 bits by their high
                         byte (as PIL reduces 16-bit RGB); 32-bit integer or float images are refused.
                         An image over PIL's MAX_IMAGE_PIXELS (a decompression bomb) is refused.
--preprocessor JSON      a checkpoint's preprocessor_config.json: each image resized (and center-cropped)
                         as transformers' ViT / CLIP image processor does (PIL, its resample filter), so
                         that train_vit's pixels are the processor's (llmc/vision/preprocessor.h)

Bounds: an IDX file's header must agree with its size, and no source decompresses to more than
MAX_DECOMPRESSED_BYTES (a gzip bomb is refused, not unpacked into memory).

Selection: --split train|test; --classes 5,6,7 keeps those labels and renumbers them 0,1,2 in that
order; --per-class N keeps N per class; --limit N keeps N in all; --seed picks which (seeded shuffle).

  /usr/bin/python3 scripts/data/prepare_images.py --fashion-mnist --split train --classes 5,6,7,8,9 \\
      --per-class 100 --out data/fmnist_5to9_train.bin
"""
import argparse
import gzip
import math
import os
import struct
import sys
import tarfile
import warnings
import zlib

import numpy as np

MAGIC = b"IMGS"
VERSION = 1
HEADER_BYTES = 64
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
# The most bytes a compressed source may unpack to (Fashion-MNIST's train images are 47 MB,
# CIFAR-100's 150 MB): past it a gzip bomb would fill the memory before any check could see it.
MAX_DECOMPRESSED_BYTES = 1 << 30
# The largest --size side: every image of the shard is held at it (ViT checkpoints use 224 to 518).
MAX_SIDE = 4096
IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".ppm", ".pgm", ".tif", ".tiff")


class DataError(Exception):
    """A source that is not what it claims to be (reported as one line, exit status 1)."""


# ---------------------------------------------------------------------------------------------
# the shard

def shard_bytes(images, labels, classes):
    """images uint8 [n, H, W, C], labels [n] -> the bytes of a shard."""
    images = np.ascontiguousarray(images, dtype=np.uint8)
    labels = np.asarray(labels)
    if images.ndim != 4 or images.shape[3] not in (1, 3):
        raise DataError(f"images must be [n, H, W, 1 or 3], got {list(images.shape)}")
    n, H, W, C = images.shape
    if n < 1:
        raise DataError("no images selected")
    if labels.shape != (n,):
        raise DataError(f"{labels.shape[0]} labels for {n} images")
    if not 1 <= classes <= 65535:
        raise DataError(f"classes {classes} outside 1..65535")
    if labels.min() < 0 or labels.max() >= classes:
        raise DataError(f"labels outside [0, {classes})")
    head = MAGIC + struct.pack("<6I", VERSION, n, H, W, C, classes)
    head += b"\0" * (HEADER_BYTES - len(head))
    return head + images.tobytes() + labels.astype("<u2").tobytes()


def write_shard(path, images, labels, classes):
    """Writes atomically: a temporary file renamed into place when complete."""
    data = shard_bytes(images, labels, classes)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_shard(path):
    """(images [n, H, W, C] uint8, labels [n] int64, classes), validated like the C reader."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < HEADER_BYTES or data[:4] != MAGIC:
        raise DataError(f"{path}: not an image shard (bad magic)")
    version, n, H, W, C, classes = struct.unpack("<6I", data[4:28])
    if version != VERSION:
        raise DataError(f"{path}: version {version}, expected {VERSION}")
    need = HEADER_BYTES + n * (H * W * C + 2)
    if len(data) != need:
        raise DataError(f"{path}: {len(data)} bytes, header implies {need}")
    px = np.frombuffer(data, np.uint8, n * H * W * C, HEADER_BYTES).reshape(n, H, W, C)
    labels = np.frombuffer(data, "<u2", n, HEADER_BYTES + n * H * W * C).astype(np.int64)
    if n and labels.max() >= classes:
        raise DataError(f"{path}: label {labels.max()} >= classes {classes}")
    return px.copy(), labels, classes


# ---------------------------------------------------------------------------------------------
# sources

def _read_bounded(f, path):
    """All of f's bytes, refused past MAX_DECOMPRESSED_BYTES (read one byte more to tell)."""
    try:
        data = f.read(MAX_DECOMPRESSED_BYTES + 1)
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise DataError(f"{path}: not a readable gzip file ({e})") from None
    if len(data) > MAX_DECOMPRESSED_BYTES:
        raise DataError(f"{path}: unpacks to more than {MAX_DECOMPRESSED_BYTES} bytes (MAX_DECOMPRESSED_BYTES); "
                        "not a dataset file this script reads (a gzip bomb?)")
    return data


def _open_maybe_gz(path):
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
        f.seek(0)
        if not gz:
            return _read_bounded(f, path)
        with gzip.GzipFile(fileobj=f) as g:
            return _read_bounded(g, path)


def read_idx(path, want_dims):
    """An IDX file (unsigned bytes) as a numpy array; plain or gzip'd."""
    data = _open_maybe_gz(path)
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise DataError(f"{path}: not an IDX file (bad magic)")
    if data[2] != 0x08:
        raise DataError(f"{path}: IDX element type 0x{data[2]:02x}, expected unsigned byte (0x08)")
    ndim = data[3]
    if ndim != want_dims:
        raise DataError(f"{path}: IDX has {ndim} dimensions, expected {want_dims}")
    if len(data) < 4 + 4 * ndim:
        raise DataError(f"{path}: IDX header truncated")
    dims = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    count = math.prod(dims)  # exact: numpy's int64 product wraps for dimensions near 2^32
    if len(data) != 4 + 4 * ndim + count:
        raise DataError(f"{path}: IDX dimensions {list(dims)} need {count} bytes of data, "
                        f"file has {len(data) - 4 - 4 * ndim}")
    return np.frombuffer(data, np.uint8, count, 4 + 4 * ndim).reshape(dims)


def _find(directory, stem):
    for name in (stem, stem + ".gz"):
        p = os.path.join(directory, name)
        if os.path.isfile(p):
            return p
    raise DataError(f"{directory}: missing {stem}[.gz] (apt-get install dataset-fashion-mnist)")


def load_fashion_mnist(directory, split):
    """(images [n, 28, 28, 1], labels [n], 10)."""
    prefix = "train" if split == "train" else "t10k"
    images = read_idx(_find(directory, f"{prefix}-images-idx3-ubyte"), 3)
    labels = read_idx(_find(directory, f"{prefix}-labels-idx1-ubyte"), 1)
    if images.shape[0] != labels.shape[0]:
        raise DataError(f"{directory}: {images.shape[0]} images but {labels.shape[0]} labels")
    if labels.max() >= 10:
        raise DataError(f"{directory}: label {labels.max()} >= 10")
    return images[..., None], labels.astype(np.int64), 10


def _cifar_members(path, names):
    """{name: bytes} of the wanted batch files, from a .tar(.gz) archive or a directory (searched
    recursively, since the archives unpack into a subfolder)."""
    found = {}
    if os.path.isfile(path):
        try:
            with tarfile.open(path) as tar:
                for m in tar.getmembers():
                    base = os.path.basename(m.name)
                    if m.isfile() and base in names:
                        if m.size > MAX_DECOMPRESSED_BYTES:
                            raise DataError(f"{path}: member {m.name} has {m.size} bytes, more than "
                                            f"{MAX_DECOMPRESSED_BYTES} (MAX_DECOMPRESSED_BYTES); not a CIFAR batch")
                        found[base] = tar.extractfile(m).read()
        except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as e:
            raise DataError(f"{path}: not a readable tar archive ({e})") from None
    elif os.path.isdir(path):
        for root, _, files in os.walk(path):
            for base in files:
                if base in names and base not in found:
                    with open(os.path.join(root, base), "rb") as f:
                        found[base] = f.read()
    else:
        raise DataError(f"{path}: no such file or directory")
    missing = [n for n in names if n not in found]
    if missing:
        raise DataError(f"{path}: missing {', '.join(missing)} (expected the CIFAR binary version)")
    return [found[n] for n in names]


def _cifar_records(blobs, label_bytes, label_index, path):
    rec = label_bytes + 3072
    images, labels = [], []
    for blob in blobs:
        if len(blob) % rec:
            raise DataError(f"{path}: batch of {len(blob)} bytes is not a whole number of "
                            f"{rec}-byte records")
        a = np.frombuffer(blob, np.uint8).reshape(-1, rec)
        labels.append(a[:, label_index].astype(np.int64))
        images.append(a[:, label_bytes:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
    return np.concatenate(images), np.concatenate(labels)


def load_cifar10(path, split):
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] if split == "train" else ["test_batch.bin"]
    images, labels = _cifar_records(_cifar_members(path, names), 1, 0, path)
    if labels.max() >= 10:
        raise DataError(f"{path}: label {labels.max()} >= 10 (is this CIFAR-100?)")
    return images, labels, 10


def load_cifar100(path, split, coarse=False):
    names = ["train.bin" if split == "train" else "test.bin"]
    images, labels = _cifar_records(_cifar_members(path, names), 2, 0 if coarse else 1, path)
    classes = 20 if coarse else 100
    if labels.max() >= classes:
        raise DataError(f"{path}: label {labels.max()} >= {classes}")
    return images, labels, classes


def to_8bit(im, path):
    """A PIL image with 8-bit channels: 16-bit grayscale (mode I or I;16*, as PIL opens a 16-bit PNG
    or TIFF) reduced by its high byte, as PIL itself reduces 16-bit RGB; convert("L") would clip
    every value above 255 to white. 32-bit integer and float pixels have no known range: refused."""
    from PIL import Image
    if im.mode.startswith("I;16") or (im.mode == "I" and im.format == "PNG"):
        a = np.asarray(im).astype(np.int64)
        if a.min() < 0 or a.max() > 65535:
            raise DataError(f"{path}: 16-bit image with values outside 0..65535")
        return Image.fromarray((a >> 8).astype(np.uint8), "L")
    if im.mode in ("I", "F"):
        raise DataError(f"{path}: {'32-bit integer' if im.mode == 'I' else 'floating-point'} pixels (PIL mode "
                        f"{im.mode}) have no known range to map to 0..255; convert the image to 8 or 16 bits")
    return im


def read_image(p, size, channels, geometry=None):
    """One image file as uint8 [H, W, channels]; a decompression bomb (past PIL's MAX_IMAGE_PIXELS,
    whose warning is an error here) or an unreadable file is one DataError naming it."""
    from PIL import Image
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(p) as im:
                im = to_8bit(im, p).convert("RGB" if channels == 3 else "L")
                if size is not None:
                    im = im.resize((size[1], size[0]), Image.BILINEAR)
                if geometry is not None:
                    im = geometry.apply(im)
                a = np.asarray(im, dtype=np.uint8)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise DataError(f"{p}: refused as a decompression bomb ({e})") from None
    except (OSError, ValueError, SyntaxError, EOFError, struct.error, zlib.error) as e:
        raise DataError(f"{p}: cannot read image ({e})") from None
    return a.reshape(a.shape[0], a.shape[1], channels)


def load_folder(directory, size=None, channels=3, geometry=None):
    """DIR/<class>/<images>: (images [n, H, W, C], labels, classes); classes = sorted folders.
    geometry: a Geometry applied to each image (then they may differ in size)."""
    try:
        from PIL import Image  # noqa: F401
    except ImportError:
        raise DataError("--folder needs PIL (Debian: apt-get install python3-pil); "
                        "other sources work without it") from None
    if not os.path.isdir(directory):
        raise DataError(f"{directory}: not a directory")
    classes = sorted(d for d in os.listdir(directory) if os.path.isdir(os.path.join(directory, d)))
    if not classes:
        raise DataError(f"{directory}: no class subfolders")
    images, labels = [], []
    for k, cls in enumerate(classes):
        files = sorted(f for f in os.listdir(os.path.join(directory, cls))
                       if f.lower().endswith(IMAGE_EXTS))
        for name in files:
            p = os.path.join(directory, cls, name)
            a = read_image(p, size, channels, geometry)
            if images and a.shape != images[0].shape:
                raise DataError(f"{p}: size {a.shape[1]}x{a.shape[0]} differs from "
                                f"{images[0].shape[1]}x{images[0].shape[0]}; give --size HxW")
            images.append(a)
            labels.append(k)
    if not images:
        raise DataError(f"{directory}: no images ({', '.join(IMAGE_EXTS)}) in the class folders")
    return np.stack(images), np.asarray(labels, np.int64), len(classes)


# ---------------------------------------------------------------------------------------------
# a checkpoint's preprocessor_config.json: the resize and crop, as transformers applies them

PROCESSOR_TYPES = ("ViTImageProcessor", "ViTFeatureExtractor", "CLIPImageProcessor", "CLIPFeatureExtractor")


class Geometry:
    """The resize and center crop of a ViT or CLIP image processor's config (transformers'
    ViTImageProcessor / CLIPImageProcessor with their defaults), applied with PIL as transformers
    does for uint8 images: Image.resize to the output size with the config's resample filter, then
    center_crop's window (top = (H - h) // 2, left = (W - w) // 2). The pixel values (rescale,
    normalize) are left to train_vit (llmc/vision/preprocessor.h), which checks the images are at
    the size this gives."""

    def __init__(self, path):
        import json
        try:
            with open(path) as f:
                cfg = json.load(f)
        except ValueError as e:
            raise DataError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(cfg, dict):
            raise DataError(f"{path}: expected a JSON object")
        kind = cfg.get("image_processor_type", cfg.get("feature_extractor_type", "ViTImageProcessor"))
        if kind not in PROCESSOR_TYPES:
            raise DataError(f"{path}: processor type {kind!r} is not one of {', '.join(PROCESSOR_TYPES)}")
        clip = kind.startswith("CLIP")
        self.path, self.resample = path, cfg.get("resample", 3 if clip else 2)
        if self.resample not in range(6) or isinstance(self.resample, bool):
            raise DataError(f"{path}: resample must be one of PIL's filters 0-5, got {self.resample!r}")
        self.resize = self.edge = self.crop = None
        if cfg.get("do_resize", True):
            size = cfg.get("size", {"shortest_edge": 224} if clip else {"height": 224, "width": 224})
            if isinstance(size, int) and not isinstance(size, bool):
                size = {"shortest_edge": size} if clip else {"height": size, "width": size}
            if clip and isinstance(size, dict) and set(size) == {"shortest_edge"}:
                self.edge = self._side(size["shortest_edge"], "size.shortest_edge")
            elif isinstance(size, dict) and set(size) == {"height", "width"}:
                self.resize = (self._side(size["height"], "size.height"), self._side(size["width"], "size.width"))
            else:
                raise DataError(f"{path}: size {size!r} is not height/width{' or shortest_edge' if clip else ''}")
        if cfg.get("do_center_crop", clip) and clip:
            crop = cfg.get("crop_size", {"height": 224, "width": 224})
            if isinstance(crop, int) and not isinstance(crop, bool):
                crop = {"height": crop, "width": crop}
            if not isinstance(crop, dict) or set(crop) != {"height", "width"}:
                raise DataError(f"{path}: crop_size {crop!r} is not height/width")
            self.crop = (self._side(crop["height"], "crop_size.height"), self._side(crop["width"], "crop_size.width"))
        if self.edge and not self.crop:
            raise DataError(f"{path}: size.shortest_edge without do_center_crop gives each image its own size")

    def _side(self, v, key):
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 65536:
            raise DataError(f"{self.path}: {key} must be an integer in [1, 65536], got {v!r}")
        return v

    def apply(self, im):
        """A PIL image through the resize and crop."""
        W, H = im.size
        if self.resize:
            im = im.resize((self.resize[1], self.resize[0]), self.resample)
        elif self.edge:  # transformers' get_resize_output_image_size(default_to_square=False)
            short, long = (W, H) if W <= H else (H, W)
            new_long = int(self.edge * long / short)
            im = im.resize((self.edge, new_long) if W <= H else (new_long, self.edge), self.resample)
        if self.crop:
            W, H = im.size
            h, w = self.crop
            if h > H or w > W:
                raise DataError(f"{self.path}: crop_size {h}x{w} is larger than the resized {H}x{W} image "
                                f"(transformers pads it; not supported)")
            top, left = (H - h) // 2, (W - w) // 2
            im = im.crop((left, top, left + w, top + h))
        return im

    def apply_array(self, images):
        """uint8 [n, H, W, C] -> the same through apply (PIL)."""
        from PIL import Image
        out = []
        for a in images:
            im = Image.fromarray(a[..., 0] if a.shape[2] == 1 else a)
            r = np.asarray(self.apply(im), dtype=np.uint8)
            out.append(r.reshape(r.shape[0], r.shape[1], a.shape[2]))
        return np.stack(out)


# ---------------------------------------------------------------------------------------------
# selection

def select(images, labels, classes, keep=None, per_class=None, limit=None, seed=0):
    """Keep the listed classes (renumbered 0.. in the given order), at most per_class of each and
    limit in all, chosen by a seeded shuffle; returns (images, labels, classes) in shuffled order."""
    order = np.random.default_rng(seed).permutation(len(labels))
    if keep is not None:
        bad = [k for k in keep if not 0 <= k < classes]
        if bad:
            raise DataError(f"--classes: {bad} outside [0, {classes})")
        if len(set(keep)) != len(keep):
            raise DataError("--classes: repeated class")
        remap = np.full(classes, -1, np.int64)
        remap[keep] = np.arange(len(keep))
        order = order[remap[labels[order]] >= 0]
        new_labels, classes = remap[labels], len(keep)
    else:
        new_labels = labels
    if per_class is not None:
        taken = np.zeros(classes, np.int64)
        chosen = []
        for i in order:
            c = new_labels[i]
            if taken[c] < per_class:
                taken[c] += 1
                chosen.append(i)
        order = np.asarray(chosen, np.int64)
    if limit is not None:
        order = order[:limit]
    return images[order], new_labels[order], classes


def parse_size(text):
    try:
        parts = [int(x) for x in text.lower().split("x")]
    except ValueError:
        parts = []
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or min(parts) < 1:
        raise DataError(f"--size: expected S or HxW, got {text!r}")
    if max(parts) > MAX_SIDE:
        raise DataError(f"--size: {text} has a side over {MAX_SIDE} (MAX_SIDE; the shard holds every image at this "
                        "size, and ViT checkpoints use 224 to 518)")
    return tuple(parts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--fashion-mnist", nargs="?", const=FASHION_MNIST_DIR, metavar="DIR")
    src.add_argument("--cifar10", metavar="PATH")
    src.add_argument("--cifar100", metavar="PATH")
    src.add_argument("--folder", metavar="DIR")
    ap.add_argument("--out", required=True, help="output shard")
    ap.add_argument("--split", choices=("train", "test"), default="train")
    ap.add_argument("--classes", help="comma list of labels to keep, renumbered in that order")
    ap.add_argument("--per-class", type=int, help="at most N images per class")
    ap.add_argument("--limit", type=int, help="at most N images in all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--coarse", action="store_true", help="CIFAR-100: the 20 coarse labels")
    ap.add_argument("--size", help="--folder: resize every image to HxW (or SxS)")
    ap.add_argument("--channels", type=int, choices=(1, 3), default=3, help="--folder: 1 = grayscale")
    ap.add_argument("--preprocessor", metavar="JSON",
                    help="a checkpoint's preprocessor_config.json: resize and crop as transformers does")
    a = ap.parse_args(argv)
    try:
        geometry = Geometry(a.preprocessor) if a.preprocessor else None
        if a.fashion_mnist:
            data = load_fashion_mnist(a.fashion_mnist, a.split)
        elif a.cifar10:
            data = load_cifar10(a.cifar10, a.split)
        elif a.cifar100:
            data = load_cifar100(a.cifar100, a.split, a.coarse)
        else:
            data = load_folder(a.folder, parse_size(a.size) if a.size else None, a.channels, geometry)
        keep = None
        if a.classes:
            try:
                keep = [int(x) for x in a.classes.split(",")]
            except ValueError:
                raise DataError(f"--classes: expected a comma list of integers, got {a.classes!r}") from None
        for flag, v in (("--per-class", a.per_class), ("--limit", a.limit)):
            if v is not None and v < 1:
                raise DataError(f"{flag}: expected >= 1, got {v}")
        images, labels, classes = select(*data, keep=keep, per_class=a.per_class, limit=a.limit,
                                         seed=a.seed)
        if geometry is not None and not a.folder:
            images = geometry.apply_array(images)
        write_shard(a.out, images, labels, classes)
    except (DataError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    n, H, W, C = images.shape
    counts = np.bincount(labels, minlength=classes)
    print(f"wrote {a.out}: {n} images {H}x{W}x{C}, {classes} classes "
          f"(per class {counts.min()}..{counts.max()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
