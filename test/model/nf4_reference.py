"""An independent NumPy reference of QLoRA's NF4 format with double quantization, as bitsandbytes
stores it (quant_type "nf4", compress_statistics=True), written from the published rules:

- the 16 NF4 code values of the QLoRA paper (Dettmers et al. 2023, appendix E), as fp32;
- weights flattened row-major, blocks of 64, absmax = max |w| per block; normalised w * (1/absmax)
  in fp32 (bitsandbytes multiplies by the reciprocal); code = the nearest NF4 value, a tie going
  to the lower value; a block whose absmax is 0 gets code 7 (0.0); two codes per byte, element 2j
  in the high nibble;
- double quantization: offset = mean(absmax); absmax - offset in blocks of 256, quantized the
  same way to 8 bits with bitsandbytes' signed dynamic map (create_dynamic_map), fp32 absmax per
  256-block ("nested_absmax");
- dequantization: absmax_b = fp32(fp32(dyn[q_b] * nested[b // 256]) + offset); w = nf4[c] * absmax_b.

The nearest value is found by brute force (argmin of the distance in float64, the first on a
tie), not by the thresholds llmc/nf4.h uses, so the two implementations share only the rules.
"""
import math

import numpy as np

NF4_VALUES = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                       -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                       0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                       0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                       0.7229568362236023, 1.0], dtype=np.float32)
BLOCK = 64
NESTED_BLOCK = 256


def dynamic_map():
    """bitsandbytes' create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8): for
    i = 0..6 the midpoints of linspace(0.1, 1, 2**i + 1) times 10**(i - 6), both signs, then 0 and
    1, sorted; in float64, rounded once to fp32."""
    data = []
    for i in range(7):
        b = np.linspace(0.1, 1.0, 2 ** i + 1)
        means = (b[:-1] + b[1:]) / 2.0
        data += list(10.0 ** (i - 6) * means) + list(-(10.0 ** (i - 6)) * means)
    data += [0.0, 1.0]
    assert len(data) == 256
    return np.array(sorted(data), dtype=np.float32)


def nearest(x, table):
    """Index of the table entry nearest each x (float64 distances; ties to the first = lower)."""
    x = np.asarray(x, dtype=np.float64).reshape(-1, 1)
    return np.argmin(np.abs(x - table.astype(np.float64)[None, :]), axis=1)


def _blockwise(v, size):
    """v (fp32) zero-padded to whole blocks of size: [blocks, size]."""
    nb = -(-v.size // size)
    pad = np.zeros(nb * size, dtype=np.float32)
    pad[:v.size] = v
    return pad.reshape(nb, size)


def _quantize_blocks(v, size, table, zero_code):
    """Blockwise absmax quantization of v (fp32) with table: (codes [v.size], absmax [blocks])."""
    blocks = _blockwise(v, size)
    absmax = np.abs(blocks).max(axis=1).astype(np.float32)
    inv = np.where(absmax > 0, np.float32(1.0) / np.where(absmax > 0, absmax, np.float32(1.0)),
                   np.float32(0.0)).astype(np.float32)
    normed = (blocks * inv[:, None]).astype(np.float32)
    codes = nearest(normed, table).reshape(blocks.shape)
    codes[absmax == 0] = zero_code
    return codes.reshape(-1)[:v.size], absmax


def quantize(w, dyn=None):
    """w: fp32 array (flattened row-major); dyn: the dynamic map (default dynamic_map()). Returns
    dict: codes (packed uint8), qabsmax (uint8), nested (fp32), offset (fp32 scalar)."""
    w = np.asarray(w, dtype=np.float32).reshape(-1)
    codes, absmax = _quantize_blocks(w, BLOCK, NF4_VALUES, 7)
    if codes.size % 2:
        codes = np.concatenate([codes, [0]])
    packed = ((codes[0::2] << 4) | codes[1::2]).astype(np.uint8)
    offset = np.float32(math.fsum(absmax.astype(np.float64)) / absmax.size)
    centered = (absmax - offset).astype(np.float32)
    dyn = dynamic_map() if dyn is None else np.asarray(dyn, dtype=np.float32)
    qabsmax, nested = _quantize_blocks(centered, NESTED_BLOCK, dyn, int(nearest([0.0], dyn)[0]))
    return {"codes": packed, "qabsmax": qabsmax.astype(np.uint8), "nested": nested, "offset": offset}


def dequantize_absmax(q, dyn=None):
    """The dequantized absmax of every 64-block."""
    dyn = dynamic_map() if dyn is None else np.asarray(dyn, dtype=np.float32)
    qa = np.asarray(q["qabsmax"]).astype(np.int64)
    nested = np.asarray(q["nested"], dtype=np.float32)
    scaled = (dyn[qa] * nested[np.arange(qa.size) // NESTED_BLOCK]).astype(np.float32)
    return (scaled + np.float32(q["offset"])).astype(np.float32)


def dequantize(q, n, dyn=None):
    """The fp32 weights of a quantized tensor of n elements (dyn: the dynamic map it was made with)."""
    absmax = dequantize_absmax(q, dyn)
    packed = np.asarray(q["codes"]).astype(np.int64)
    codes = np.stack([packed >> 4, packed & 15], axis=1).reshape(-1)[:n]
    return (NF4_VALUES[codes] * absmax[np.arange(n) // BLOCK]).astype(np.float32)
