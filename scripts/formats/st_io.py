"""Minimal safetensors reader/writer using only numpy.

File layout: u64 little-endian header length N, N bytes of JSON header
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}},
then the tensor data; offsets are relative to the start of the data.
We avoid the `safetensors` package so the scripts run on a bare Debian python3.

bf16 has no numpy dtype: on write we round float32 to nearest-even bf16 bits,
on read we widen the bits back to float32 (or return raw uint16 if asked).
"""
import json
import math
import os
import struct

import numpy as np

# safetensors dtype name -> numpy dtype of the stored element (bf16 kept as raw u16 bits)
_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_NUMPY_TO_ST = {
    np.dtype("float64"): "F64",
    np.dtype("float32"): "F32",
    np.dtype("float16"): "F16",
    np.dtype("int64"): "I64",
    np.dtype("int32"): "I32",
    np.dtype("int16"): "I16",
    np.dtype("int8"): "I8",
    np.dtype("uint8"): "U8",
    np.dtype("bool"): "BOOL",
}
# a header bigger than this is certainly a corrupt length field, not a real model
_MAX_HEADER = 100 * 1024 * 1024


def f32_to_bf16_bits(x):
    """Round float32 to bf16 (nearest, ties to even); return the uint16 bit patterns."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    is_nan = np.isnan(np.asarray(x, dtype=np.float32))
    # adding 0x7FFF plus the lowest kept bit rounds to nearest with ties to even
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    out = rounded.astype(np.uint16)
    out[is_nan] = 0x7FC0  # keep NaN a NaN (rounding could carry it into Inf)
    return out


def bf16_bits_to_f32(bits):
    """Widen bf16 bit patterns (uint16) to float32 exactly."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def _encode_tensor(name, arr, bf16):
    """Return (dtype name, bytes) for one array; bf16=True stores floats as BF16."""
    arr = np.asarray(arr)
    if bf16 and arr.dtype.kind == "f":
        return "BF16", f32_to_bf16_bits(arr).astype("<u2").tobytes()
    st = _NUMPY_TO_ST.get(arr.dtype)
    if st is None:
        raise ValueError(f"tensor {name}: unsupported dtype {arr.dtype}")
    return st, np.ascontiguousarray(arr, dtype=_DTYPES[st]).tobytes()


def save(path, tensors, metadata=None, bf16=False):
    """Write dict name -> numpy array to `path` atomically (tmp file + rename).

    bf16=True converts every floating tensor to BF16 on the way out.
    """
    header = {}
    blobs = []
    offset = 0
    for name in sorted(tensors):
        arr = np.asarray(tensors[name])
        dtype, blob = _encode_tensor(name, arr, bf16)
        header[name] = {"dtype": dtype, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    hbytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hbytes += b" " * (-len(hbytes) % 8)  # keep the data 8-byte aligned for mmap readers
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(hbytes)))
            f.write(hbytes)
            for blob in blobs:
                f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_header(path):
    """Return (header dict without __metadata__, metadata dict, data start offset)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path}: file too short for a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER or 8 + n > size:
            raise ValueError(f"{path}: header length {n} does not fit file of {size} bytes")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    return header, metadata, 8 + n


def _check_entry(path, name, entry, data_len):
    """Validate one header entry; return (numpy dtype, shape, begin, end)."""
    if not isinstance(entry, dict):
        raise ValueError(f"{path}: tensor {name}: entry is not an object")
    dtype = _DTYPES.get(entry.get("dtype"))
    if dtype is None:
        raise ValueError(f"{path}: tensor {name}: unsupported dtype {entry.get('dtype')!r}")
    shape = entry.get("shape")
    offs = entry.get("data_offsets")
    if (not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)):
        raise ValueError(f"{path}: tensor {name}: bad shape {shape!r}")
    if (not isinstance(offs, list) or len(offs) != 2
            or not all(isinstance(o, int) for o in offs)):
        raise ValueError(f"{path}: tensor {name}: bad data_offsets {offs!r}")
    begin, end = offs
    if not 0 <= begin <= end <= data_len:
        raise ValueError(f"{path}: tensor {name}: data_offsets {offs} outside data of "
                         f"{data_len} bytes")
    expected = math.prod(shape) * dtype.itemsize  # Python ints: no overflow (np.prod wraps at 2^63)
    if end - begin != expected:
        raise ValueError(f"{path}: tensor {name}: {end - begin} bytes but shape {shape} "
                         f"{entry['dtype']} needs {expected}")
    return dtype, shape, begin, end


def _check_tiling(path, checked, data_len):
    """The format requires the tensors' bytes to tile the data section: sorted by offset, each
    starts where the previous ends, from 0 to the end (an overlap would read another tensor's
    weights; gaps and trailing bytes would hide other content)."""
    pos, prev = 0, None
    for name, (_, _, begin, end) in sorted(checked.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        if begin < pos:
            raise ValueError(f"{path}: tensor {name}: data_offsets start at {begin}, inside the bytes of "
                             f"tensor {prev} (which end at {pos}): overlapping tensors")
        if begin > pos:
            raise ValueError(f"{path}: tensor {name}: data_offsets start at {begin}, leaving a gap after "
                             f"byte {pos} (the format requires contiguous tensors)")
        pos, prev = end, name
    if pos != data_len:
        raise ValueError(f"{path}: the tensors cover {pos} of the {data_len} data bytes (trailing bytes "
                         "after the last tensor: not a valid safetensors file)")


def load(path, raw=False, with_metadata=False):
    """Read a safetensors file into dict name -> numpy array.

    By default BF16 and F16 tensors are widened to float32; raw=True returns the
    stored representation (float16, or uint16 bit patterns for BF16).
    with_metadata=True returns (tensors, metadata).
    """
    header, metadata, start = read_header(path)
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read()
    checked = {name: _check_entry(path, name, entry, len(data)) for name, entry in header.items()}
    _check_tiling(path, checked, len(data))
    out = {}
    for name, entry in header.items():
        dtype, shape, begin, end = checked[name]
        arr = np.frombuffer(data, dtype=dtype, count=(end - begin) // dtype.itemsize,
                            offset=begin).reshape(shape)
        if not raw and entry["dtype"] == "BF16":
            arr = bf16_bits_to_f32(arr)
        elif not raw and entry["dtype"] == "F16":
            arr = arr.astype(np.float32)
        else:
            arr = arr.copy()  # detach from the file buffer and make it writable
        out[name] = arr.reshape(shape)
    return (out, metadata) if with_metadata else out
