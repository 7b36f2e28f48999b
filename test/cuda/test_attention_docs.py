"""llmc/attn_docs.h, the mapping of a packed micro-batch onto cuDNN's ragged attention (each document
one entry of cuDNN's batch: its length, and where its rows start in q/k/v/o and in the token-major
statistics), through build/test/attn_docs_probe, against documents found with numpy from the same
positions. The positions are made as the loader makes them (llmc/text/textdata.h's loader_next: 0 at
each window start and each example start, else the previous plus one), so the cases are what
training feeds: one document per row (no packing), a document per token, documents cut by the
window (a partial last one), several rows. Positions of another shape are refused in one line."""
import os
import subprocess

import numpy as np
import pytest

from cuda_backend import REPO, need

PROBE = os.path.join(REPO, "build/test/attn_docs_probe")
H, KVH, HD = 4, 2, 8


def loader_positions(starts):
    """[B, T] positions from [B, T] example starts, as loader_next makes them."""
    pos = np.zeros(starts.shape, np.int64)
    for b in range(starts.shape[0]):
        for t in range(1, starts.shape[1]):
            pos[b, t] = 0 if starts[b, t] else pos[b, t - 1] + 1
    return pos


def probe(pos, pad=0):
    B, T = pos.shape
    text = f"{B} {T} {H} {KVH} {HD} {pad}\n" + " ".join(str(int(p)) for p in pos.ravel()) + "\n"
    p = subprocess.run([need(PROBE)], input=text, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    if lines[0].startswith("refused: "):
        return lines[0]
    head = lines[0].split()
    out = {"docs": int(head[1]), "max_len": int(head[3]), "batch": int(head[5])}
    for line in lines[1:]:
        name, *vals = line.split()
        out[name] = np.array([int(v) for v in vals], np.int64)
    return out


def reference(pos, pad):
    """Documents from numpy: a start wherever the position is 0, its length up to the next start;
    every document's positions must be 0, 1, 2, ... (else the partition is not the mask)."""
    flat = pos.ravel()
    N = flat.size
    starts = np.flatnonzero(flat == 0)
    lens = np.diff(np.append(starts, N))
    for s, n in zip(starts, lens):
        assert (flat[s:s + n] == np.arange(n)).all()
    batch = starts.size + pad
    seq_len = np.concatenate([lens, np.zeros(pad, np.int64)])
    first = np.concatenate([starts, np.full(pad + 1, N)])
    return {"docs": starts.size, "max_len": int(lens.max()) if lens.size else 0, "batch": batch,
            "off_q": first * H * HD, "off_kv": first * KVH * HD, "off_stats": first * H, "seq_len": seq_len}


def random_starts(rng, B, T, p):
    s = (rng.random((B, T)) < p).astype(np.uint8)
    s[:, 0] = 1  # a window starts a document (loader_next)
    return s


CASES = {
    "one_document_per_row": np.zeros((3, 16), np.uint8),
    "a_document_per_token": np.ones((2, 9), np.uint8),
    "one_row_one_token": np.ones((1, 1), np.uint8),
    "partial_last_document": np.array([[1, 0, 0, 1, 0, 0, 0, 0, 0, 1, 0]], np.uint8),
    "every_20_tokens_rows_of_32": (np.arange(4 * 32).reshape(4, 32) % 20 == 0).astype(np.uint8),
}


@pytest.mark.parametrize("pad", [0, 3])
@pytest.mark.parametrize("case", list(CASES) + ["random_rows"])
def test_documents_match_numpy(case, pad):
    rng = np.random.default_rng(11)
    starts = CASES[case] if case in CASES else random_starts(rng, 5, 64, 0.08)
    starts = starts.copy()
    starts[:, 0] = 1
    pos = loader_positions(starts)
    got, want = probe(pos, pad), reference(pos, pad)
    assert not isinstance(got, str), got
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=f"{case} {k}")
    # the entries tile the tokens exactly, in order: cuDNN reads every row once
    assert (np.diff(got["off_stats"]) == got["seq_len"] * H).all() and got["seq_len"].sum() == pos.size


def test_many_random_batches():
    rng = np.random.default_rng(5)
    for _ in range(40):
        B, T = int(rng.integers(1, 5)), int(rng.integers(1, 80))
        pos = loader_positions(random_starts(rng, B, T, float(rng.choice([0.02, 0.2, 0.7]))))
        got, want = probe(pos), reference(pos, 0)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"{B}x{T} {k}")


@pytest.mark.parametrize("pos,why", [
    ([[1, 2, 3, 4]], "a row whose first position is not 0"),  # a slice that starts inside a document
    ([[0, 1, 0, 1], [0, 2, 3, 4]], "positions that neither restart at 0 nor count up by one"),
    ([[0, 1, 1, 2]], "positions that neither restart at 0 nor count up by one"),
])
def test_refuses_what_is_not_documents(pos, why):
    assert probe(np.array(pos)) == f"refused: {why}"
