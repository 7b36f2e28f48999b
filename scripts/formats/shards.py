"""Token shard files: what scripts/data/prepare_text.py writes and the C loader reads.

Layout (little endian):
  64-byte header: b"LMFT", u32 version=1, u64 count, u32 vocab_size, u32 flags, zeros
  count x uint32 tokens
  count x uint8 mask   (mask[i] = 1: the loss for predicting token i from tokens < i counts)
  count x uint8 starts (only when flags bit 1 is set: starts[i] = 1 where token i begins a
                        packed example; the trainer restarts positions and attention there)
flags bit 0 = the mask is present (always set by this writer); bit 1 = example starts present.
"""
import os
import struct

import numpy as np

MAGIC = b"LMFT"
VERSION = 1
HEADER_BYTES = 64
FLAG_HAS_MASK = 1
FLAG_HAS_STARTS = 2
_HEADER = struct.Struct("<4sIQII")


def write_shard(path, tokens, mask, vocab_size, starts=None):
    """Write tokens (uint32), mask (0/1) and optional example starts (0/1) atomically; validates
    ids against vocab_size."""
    tokens = np.asarray(tokens, dtype=np.int64)
    mask = np.asarray(mask, dtype=np.uint8)
    if starts is not None:
        starts = np.asarray(starts, dtype=np.uint8)
        if starts.shape != tokens.shape or (starts.size and starts.max() > 1):
            raise ValueError(f"{path}: starts must be 0/1 and as long as tokens")
    if tokens.ndim != 1 or tokens.shape != mask.shape:
        raise ValueError(f"{path}: tokens and mask must be 1-D and of equal length")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(f"{path}: token id {int(tokens.max())} outside vocab of {vocab_size}")
    if mask.size and mask.max() > 1:
        raise ValueError(f"{path}: mask values must be 0 or 1")
    flags = FLAG_HAS_MASK | (FLAG_HAS_STARTS if starts is not None else 0)
    header = _HEADER.pack(MAGIC, VERSION, tokens.size, vocab_size, flags)
    _write_atomic(path, [header.ljust(HEADER_BYTES, b"\0"), tokens.astype("<u4").tobytes(), mask.tobytes()]
                  + ([starts.tobytes()] if starts is not None else []))


def _write_atomic(path, chunks):
    """The byte strings `chunks` into path through a temporary file beside it: a failed write (a full
    disk) leaves no partial shard behind."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            for c in chunks:
                f.write(c)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_shard(path, with_starts=False):
    """Return (tokens uint32 array, mask uint8 array, vocab_size[, starts uint8 array or None]);
    raise ValueError on bad files."""
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
    if flags & ~(FLAG_HAS_MASK | FLAG_HAS_STARTS):
        raise ValueError(f"{path}: unknown flags {flags}")
    per = 6 if flags & FLAG_HAS_STARTS else 5
    if len(data) != HEADER_BYTES + per * count:
        raise ValueError(f"{path}: {len(data)} bytes but count {count} needs "
                         f"{HEADER_BYTES + per * count}")
    tokens = np.frombuffer(data, "<u4", count, HEADER_BYTES).astype(np.uint32)
    mask = np.frombuffer(data, np.uint8, count, HEADER_BYTES + 4 * count).copy()
    if count and int(tokens.max()) >= vocab:
        raise ValueError(f"{path}: token id {int(tokens.max())} >= vocab_size {vocab}")
    starts = np.frombuffer(data, np.uint8, count, HEADER_BYTES + 5 * count).copy() if per == 6 else None
    return (tokens, mask, vocab, starts) if with_starts else (tokens, mask, vocab)


# Pair shards (preference data; the C reader is llmc/text/pairdata.h):
#   64-byte header: b"LMPR", u32 version=1, u64 pairs, u32 vocab_size, u32 max_len (the longest
#   prompt + completion), zeros; pairs x 3 uint32 lengths (prompt, chosen, rejected); then each
#   pair's prompt, chosen and rejected tokens as uint32.
PAIR_MAGIC = b"LMPR"
_PAIR_HEADER = struct.Struct("<4sIQII")


def write_pair_shard(path, pairs, vocab_size):
    """pairs: a list of (prompt ids, chosen ids, rejected ids), each non-empty; written atomically."""
    if not pairs:
        raise ValueError(f"{path}: no pair to write")
    lens = np.array([[len(p), len(c), len(r)] for p, c, r in pairs], dtype=np.int64)
    if lens.min() < 1:
        raise ValueError(f"{path}: every prompt and completion needs at least one token")
    toks = np.array([t for p, c, r in pairs for t in (*p, *c, *r)], dtype=np.int64)
    if toks.min() < 0 or toks.max() >= vocab_size:
        raise ValueError(f"{path}: token id {int(toks.max())} outside vocab of {vocab_size}")
    max_len = int(np.maximum(lens[:, 0] + lens[:, 1], lens[:, 0] + lens[:, 2]).max())
    header = _PAIR_HEADER.pack(PAIR_MAGIC, VERSION, len(pairs), vocab_size, max_len)
    _write_atomic(path, [header.ljust(HEADER_BYTES, b"\0"), lens.astype("<u4").tobytes(), toks.astype("<u4").tobytes()])


def read_pair_shard(path):
    """Return (list of (prompt, chosen, rejected) uint32 arrays, vocab_size)."""
    with open(path, "rb") as f:
        data = f.read()
    magic, version, n, vocab, _max_len = _PAIR_HEADER.unpack_from(data)
    if magic != PAIR_MAGIC or version != VERSION:
        raise ValueError(f"{path}: not a pair shard")
    lens = np.frombuffer(data, "<u4", 3 * n, HEADER_BYTES).reshape(n, 3)
    toks = np.frombuffer(data, "<u4", offset=HEADER_BYTES + 12 * n)
    out, at = [], 0
    for p, c, r in lens.astype(np.int64):
        out.append((toks[at:at + p], toks[at + p:at + p + c], toks[at + p + c:at + p + c + r]))
        at += p + c + r
    return out, vocab
