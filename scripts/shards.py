"""Token shard files: what scripts/prepare_text.py writes and the C loader reads.

Layout (little endian):
  64-byte header: b"LMFT", u32 version=1, u64 count, u32 vocab_size, u32 flags, zeros
  count x uint32 tokens
  count x uint8 mask   (mask[i] = 1: the loss for predicting token i from tokens < i counts)
flags bit 0 = the mask is present (always set by this writer).
"""
import os
import struct

import numpy as np

MAGIC = b"LMFT"
VERSION = 1
HEADER_BYTES = 64
FLAG_HAS_MASK = 1
_HEADER = struct.Struct("<4sIQII")


def write_shard(path, tokens, mask, vocab_size):
    """Write tokens (uint32) and mask (0/1) atomically; validates ids against vocab_size."""
    tokens = np.asarray(tokens, dtype=np.int64)
    mask = np.asarray(mask, dtype=np.uint8)
    if tokens.ndim != 1 or tokens.shape != mask.shape:
        raise ValueError(f"{path}: tokens and mask must be 1-D and of equal length")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(f"{path}: token id {int(tokens.max())} outside vocab of {vocab_size}")
    if mask.size and mask.max() > 1:
        raise ValueError(f"{path}: mask values must be 0 or 1")
    header = _HEADER.pack(MAGIC, VERSION, tokens.size, vocab_size, FLAG_HAS_MASK)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(header.ljust(HEADER_BYTES, b"\0"))
            f.write(tokens.astype("<u4").tobytes())
            f.write(mask.tobytes())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_shard(path):
    """Return (tokens uint32 array, mask uint8 array, vocab_size); raise ValueError on bad files."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < HEADER_BYTES:
        raise ValueError(f"{path}: too short for a shard header ({len(data)} bytes)")
    magic, version, count, vocab, flags = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise ValueError(f"{path}: bad magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise ValueError(f"{path}: shard version {version}, expected {VERSION}")
    if not flags & FLAG_HAS_MASK:
        raise ValueError(f"{path}: flags {flags} lack the mask bit")
    if len(data) != HEADER_BYTES + 5 * count:
        raise ValueError(f"{path}: {len(data)} bytes but count {count} needs "
                         f"{HEADER_BYTES + 5 * count}")
    tokens = np.frombuffer(data, "<u4", count, HEADER_BYTES).astype(np.uint32)
    mask = np.frombuffer(data, np.uint8, count, HEADER_BYTES + 4 * count).copy()
    if count and int(tokens.max()) >= vocab:
        raise ValueError(f"{path}: token id {int(tokens.max())} >= vocab_size {vocab}")
    return tokens, mask, vocab
