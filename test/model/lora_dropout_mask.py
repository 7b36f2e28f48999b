"""LoRA dropout's keep mask written again in Python from its definition (llmc/lora_dropout.h), for
the PyTorch reference: element e (global row * in + column) of adapted linear `linear` (layer *
targets + target) at optimizer step `step` is kept when the high 32 bits of splitmix64 at position
e of the stream keyed by (seed, step, linear) reach floor(P * 2^32), P taken as the fp32 the
trainer parses. Kept elements are scaled by 1 / (1 - P).

Written from the definition in numpy's uint64 arithmetic (wrapping, as C's), not translated from
the kernels' code paths, so that a bug in the C (a wrong row offset, a stale step, another mask in
the backward) shows as a mismatch with the reference."""
import numpy as np

GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mix64(z):
    """splitmix64's finaliser on a uint64 array (or scalar)."""
    z = np.asarray(z, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def key(seed, step, linear):
    with np.errstate(over="ignore"):
        k = mix64(np.uint64(seed) + GOLDEN)
        k = mix64(k ^ (np.uint64(step) + GOLDEN))
        return mix64(k ^ (np.uint64(linear) + GOLDEN))


def threshold(p):
    return min(int(float(np.float32(p)) * 4294967296.0), 0xFFFFFFFF)


def keep(seed, step, linear, first_element, n, p):
    """Boolean keep mask of elements first_element .. first_element + n - 1."""
    e = np.arange(n, dtype=np.uint64) + np.uint64(first_element)
    with np.errstate(over="ignore"):
        h = mix64(key(seed, step, linear) + (e + np.uint64(1)) * GOLDEN)
    return (h >> np.uint64(32)) >= np.uint64(threshold(p))


def scale(p):
    """1 / (1 - P) as the trainer computes it in fp32."""
    return float(np.float32(1.0) / (np.float32(1.0) - np.float32(p)))


def reference_dropout(p, seed, step, row0, targets, torch):
    """The `dropout` function of test/model/reference_llama.py's forward: LoRA dropout of a micro-batch
    whose first row is `row0` of the step's global batch; `targets` lists the model's linears in
    the trainer's order (the linear index is layer * len(targets) + position)."""
    def apply(layer, target, xa):
        rows, width = xa.shape[0] * xa.shape[1], xa.shape[-1]
        m = keep(seed, step, layer * len(targets) + targets.index(target), row0 * width, rows * width, p)
        mask = torch.from_numpy(m.reshape(xa.shape).astype(np.float64)).to(xa.dtype)
        return xa * mask * scale(p)
    return apply
