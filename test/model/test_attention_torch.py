"""The CPU attention op (llmc/cpu/attention.h) against an independent PyTorch reference in float64:
sliding windows (a query at i sees keys i - W < j <= i, transformers' mask), the scores' scale,
soft-capping c * tanh(s / c) before the mask, packed documents (a query sees only its own document)
combined with the window, and grouped-query heads. Forward o and lse, and the gradients dq, dk, dv
of sum(o * dout) from torch.autograd. The C probe is compiled here from the header alone.

Tolerance: the op works in fp32 (scores as hd-long dot products, a softmax over at most T keys, sums
of at most T products); its relative error is a few hundred ulp of fp32 at most (2^-24 x 64 x T
bounds it at T = 150: 6e-4); 1e-4 relative L2 is well above what fp32 rounding gives (about 1e-6)
and far below a wrong mask or a missing cap derivative (O(1))."""
import os
import subprocess

import numpy as np
import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = r'''
#include <stdio.h>
#include <stdlib.h>
#include "llmc/cpu/attention.h"
static float* load(const char* dir, const char* name, long n) {
    char p[512]; snprintf(p, sizeof(p), "%s/%s", dir, name);
    FILE* f = fopen(p, "rb"); float* x = (float*)malloc(4 * n);
    if (!f || fread(x, 4, n, f) != (size_t)n) { fprintf(stderr, "read %s\n", p); exit(1); }
    fclose(f); return x;
}
static void save(const char* dir, const char* name, const float* x, long n) {
    char p[512]; snprintf(p, sizeof(p), "%s/%s", dir, name);
    FILE* f = fopen(p, "wb"); fwrite(x, 4, n, f); fclose(f);
}
int main(int argc, char** argv) {
    const char* dir = argv[1];
    int B = atoi(argv[2]), T = atoi(argv[3]), H = atoi(argv[4]), KVH = atoi(argv[5]), hd = atoi(argv[6]);
    int window = atoi(argv[7]), packed = atoi(argv[10]);
    float scale = (float)atof(argv[8]), softcap = (float)atof(argv[9]);
    long N = (long)B * T, nq = N * H * hd, nk = N * KVH * hd;
    int* pos = NULL;
    if (packed) {
        float* pf = load(dir, "pos", N);
        pos = (int*)malloc(4 * N);
        for (long i = 0; i < N; i++) pos[i] = (int)pf[i];
    }
    AttnShape s = {B, T, H, KVH, hd, 1, pos, NULL, window, scale, softcap, 0};
    float *q = load(dir, "q", nq), *k = load(dir, "k", nk), *v = load(dir, "v", nk), *dout = load(dir, "dout", nq);
    float *o = (float*)malloc(4 * nq), *lse = (float*)malloc(4 * (long)B * H * T);
    float *dq = (float*)malloc(4 * nq), *dk = (float*)malloc(4 * nk), *dv = (float*)malloc(4 * nk);
    attention_forward(o, lse, q, k, v, s);
    attention_backward(dq, dk, dv, dout, q, k, v, o, lse, s);
    save(dir, "o", o, nq); save(dir, "lse", lse, (long)B * H * T);
    save(dir, "dq", dq, nq); save(dir, "dk", dk, nk); save(dir, "dv", dv, nk);
    return 0;
}
'''


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    d = tmp_path_factory.mktemp("attn_torch")
    (d / "probe.c").write_text(PROBE)
    exe = d / "probe"
    b = subprocess.run(["g++", "-O2", "-march=native", "-fopenmp", "-std=gnu++17", "-x", "c++", "-w", f"-I{REPO}",
                        str(d / "probe.c"), "-o", str(exe), "-lm"], capture_output=True, text=True, timeout=300)
    assert b.returncode == 0, b.stderr[-3000:]
    return exe


def reference(q, k, v, dout, pos, window, scale, softcap):
    """transformers' eager attention in float64: q [B,T,H,hd], k, v [B,T,KVH,hd]."""
    B, T, H, hd = q.shape
    KVH = k.shape[2]
    q, k, v = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
    kk = k.repeat_interleave(H // KVH, dim=2)
    vv = v.repeat_interleave(H // KVH, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, kk) * (scale if scale > 0 else hd ** -0.5)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(T).view(T, 1)
    j = torch.arange(T).view(1, T)
    keep = (j <= i).expand(B, T, T)
    if window > 0:
        keep = keep & (j > i - window)
    if pos is not None:
        start = torch.arange(T).view(1, T) - torch.tensor(pos)  # [B, T] each query's document start
        keep = keep & (j.view(1, 1, T) >= start.view(B, T, 1))
    s = s.masked_fill(~keep.view(B, 1, T, T), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [B, H, T]
    o = torch.einsum("bhij,bjhd->bihd", torch.softmax(s, dim=-1), vv)
    (o * torch.tensor(dout, dtype=torch.float64)).sum().backward()
    return o.detach().numpy(), lse.detach().numpy(), q.grad.numpy(), k.grad.numpy(), v.grad.numpy()


def rel(a, b):
    return float(np.linalg.norm(a.ravel() - b.ravel()) / np.linalg.norm(b.ravel()))


# (B, T, H, KVH, hd, window, scale, softcap, packed)
CASES = [
    (2, 150, 4, 2, 16, 40, 0.0, 0.0, False),    # window over three 64-row blocks, GQA 2
    (1, 150, 3, 1, 20, 17, 0.0, 0.0, True),     # window inside packed documents, GQA 3
    (2, 70, 4, 4, 16, 0, 0.7, 2.0, False),      # scale and a soft-cap that bites (scores of several units)
    (2, 130, 6, 2, 24, 33, 0.45, 3.0, True),    # all of it: window, scale, soft-cap, documents, GQA
    (1, 90, 2, 1, 16, 200, 0.0, 0.0, False),    # a window longer than the sequence: full causal attention
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B%d_T%d_H%d_KVH%d_hd%d_W%d_s%g_c%g_%s" % (
    *c[:8], "packed" if c[8] else "rows"))
def test_cpu_attention_matches_torch(probe, tmp_path, case):
    B, T, H, KVH, hd, window, scale, softcap, packed = case
    rng = np.random.default_rng(B * 1000 + T + window)
    q = rng.standard_normal((B, T, H, hd)).astype(np.float32)
    k = rng.standard_normal((B, T, KVH, hd)).astype(np.float32)
    v = rng.standard_normal((B, T, KVH, hd)).astype(np.float32)
    dout = rng.standard_normal((B, T, H, hd)).astype(np.float32)
    pos = None
    if packed:  # documents of random lengths, each row starting one
        pos = np.zeros((B, T), dtype=np.int64)
        for b in range(B):
            for t in range(1, T):
                pos[b, t] = 0 if rng.integers(0, 40) == 0 else pos[b, t - 1] + 1
        pos.astype(np.float32).tofile(tmp_path / "pos")
    for name, x in (("q", q), ("k", k), ("v", v), ("dout", dout)):
        x.tofile(tmp_path / name)
    r = subprocess.run([str(probe), str(tmp_path), str(B), str(T), str(H), str(KVH), str(hd), str(window), repr(scale),
                        repr(softcap), str(int(packed))], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = {n: np.fromfile(tmp_path / n, dtype=np.float32) for n in ("o", "lse", "dq", "dk", "dv")}
    want = dict(zip(("o", "lse", "dq", "dk", "dv"), reference(q, k, v, dout, pos, window, scale, softcap)))
    for n in got:
        assert rel(got[n], want[n]) < 1e-4, (n, rel(got[n], want[n]))
    if softcap > 0:  # the cap bites: some capped scores differ from the raw ones by more than 10%
        s = np.einsum("bihd,bjhd->bhij", q, np.repeat(k, H // KVH, axis=2)) * (scale or hd ** -0.5)
        assert np.mean(np.abs(softcap * np.tanh(s / softcap) - s) > 0.1 * np.abs(s)) > 0.1
