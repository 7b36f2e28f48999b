// cuda/attention.cuh: rotary position embedding and the flash attention forward of the CUDA
// backend, the twins of llmc/cpu/attention.h, same layout and shape struct (AttnShape):
// q [N, H*hd], k and v [N, KVH*hd], o [N, H*hd] in bf16, token n = b*T + t, head h at columns
// h*hd; query head h reads kv head h / (H/KVH) (grouped-query attention by index, no copies);
// lse [B, H, T] in fp32. Causal or bidirectional; head dims up to 128.
//
// Design (correctness first): the flash-attention tiling of Dao et al. on CUDA cores in fp32.
// A block owns ATT_ROWS = 32 rows (queries in the forward and dq pass, keys in the dk/dv pass) of
// one (batch, head); each row belongs to ATT_TPR = 8 consecutive threads, each holding hd/8 of
// its dimensions (dim = c*8 + sub, so the 8 threads read 8 consecutive shared-memory words:
// no bank conflicts) in registers. The other operand streams through shared memory in tiles of
// 32 rows, converted to fp32 once per tile; a dot product is a per-thread partial sum plus 3
// shuffles. The forward keeps the online-softmax running max and sum per row, writes o and
// lse = max + log(sum), and never stores a score matrix. Its backward (FlashAttention-2's) is the
// reference version dev/cuda/attention_flash.cuh.
//
// Performance, honestly: this is CUDA-core fp32 arithmetic fed from shared memory (one shared
// load per FMA), so expect on the order of 10-25 TFLOP/s on an H200, far from the 300 TFLOP/s
// target in docs/gpu-testing.md, which needs tensor cores. attention_gemm.cuh puts the products
// on tensor cores through batched cuBLAS GEMMs, and the trainers use it; this forward stays for the
// calls whose shape does not fit the planned workspace (it needs none: llmc/ops.h's
// op_attention_work_fitting). dev/cuda/attention.cu checks and times both.
#pragma once
#include "common.cuh"
#include "vec.cuh"
#include "../cpu/attention.h"  // AttnShape, shared with the CPU twin

#define ATT_TPR 8      // threads per row
#define ATT_ROWS 32    // rows per block
#define ATT_TILE 32    // rows of the streamed operand per shared-memory tile
#define ATT_THREADS (ATT_TPR * ATT_ROWS)

// ---- RoPE ------------------------------------------------------------------------------------

// Rotate-half RoPE on the first rot dims of each head (pairs i, i+rot/2; rot = hd: the whole head)
// in place on x [N, nheads*hd] at position pos[n] (device array; packed examples restart at 0) or
// n % T when pos is NULL; cos/sin tables [T, rot/2] in fp32. inverse = 1 applies the transpose
// rotation (the backward). Twin of llmc/cpu/attention.h's rope_apply. Where vec (rot a multiple of
// 16, hd of 8, x and the tables 16-byte aligned: rope_vec_ok), 8 pairs per thread in 16-byte vectors
// (x[i .. i+7], x[i+half .. i+half+7] and the fp32 tables' 8 values as two vectors each) on a 2-D
// grid: blockIdx.x strides over the rows, blockIdx.y * blockDim.x + threadIdx.x is the group of 8
// pairs within a row, so the head and the pair come from one 32-bit division per thread, not a 64-bit
// div/mod per element. Else one pair per thread over the 1-D grid (rope_pair; dev/cuda/rope_scalar.cuh
// keeps that form alone). The per-element arithmetic is the same, so the bytes agree.
static __device__ __forceinline__ void rope_pair(bf16* x, const float* cos_t, const float* sin_t, const int* pos,
                                                 int64_t idx, int T, int nheads, int hd, int rot, float sgn) {
    int half = rot / 2;
    int i = (int)(idx % half);
    int64_t nh = idx / half, n = nh / nheads;
    int h = (int)(nh % nheads);
    int64_t tab = (pos ? (int64_t)pos[n] : n % T) * half + i;
    float c = cos_t[tab], si = sgn * sin_t[tab];
    bf16* v = x + n * nheads * hd + (int64_t)h * hd;
    float a = bf2f(v[i]), b = bf2f(v[i + half]);
    v[i] = f2bf(a * c - b * si);
    v[i + half] = f2bf(b * c + a * si);
}
#define ROPE_VEC_THREADS 64  // 2 blocks per row for Llama's 32 query heads of 128, 1 for its 8 kv heads
__global__ void rope_apply_kernel(bf16* x, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                  const int* __restrict__ pos, int64_t N, int T, int nheads, int hd, int rot,
                                  int inverse, int vec) {
    if (!vec) {
        for (int64_t idx = thread_index_1d(); idx < N * nheads * (rot / 2); idx += grid_stride_1d())
            rope_pair(x, cos_t, sin_t, pos, idx, T, nheads, hd, rot, inverse ? -1.0f : 1.0f);
        return;
    }
    int half = rot / 2, groups = half / 8;
    int gidx = blockIdx.y * blockDim.x + threadIdx.x;  // int: a group of one row, < heads x rot / 16
    if (gidx >= nheads * groups) return;  // int: one row's groups, heads x rot / 16
    int h = gidx / groups, i0 = (gidx % groups) * 8;
    float sgn = inverse ? -1.0f : 1.0f;
    for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
        const int64_t tab = (pos ? (int64_t)pos[n] : n % T) * half + i0;
        Vec16<float> cv[2] = {load_vec16(cos_t + tab), load_vec16(cos_t + tab + 4)};
        Vec16<float> sv[2] = {load_vec16(sin_t + tab), load_vec16(sin_t + tab + 4)};
        bf16* v = x + n * nheads * hd + (int64_t)h * hd + i0;
        Vec16<bf16> a = load_vec16(v), b = load_vec16(v + half), ao, bo;
        for (int j = 0; j < 8; j++) {
            float c = cv[j / 4].v[j % 4], si = sgn * sv[j / 4].v[j % 4];
            float av = bf2f(a.v[j]), bv = bf2f(b.v[j]);
            ao.v[j] = f2bf(av * c - bv * si);
            bo.v[j] = f2bf(bv * c + av * si);
        }
        store_vec16(v, ao);
        store_vec16(v + half, bo);
    }
}
static int rope_vec_ok(const bf16* x, const float* cos_t, const float* sin_t, int hd, int rot) {
    return rot % 16 == 0 && hd % 8 == 0 && aligned16(x) && aligned16(cos_t) && aligned16(sin_t);
}

static void rope_apply_cuda(bf16* x, const float* cos_t, const float* sin_t, const int* pos, int64_t N, int T,
                            int nheads, int hd, int rot, int inverse, cudaStream_t stream) {
    int64_t total = N * nheads * (rot / 2);
    if (total == 0) return;
    if (rope_vec_ok(x, cos_t, sin_t, hd, rot)) {
        int groups = nheads * (rot / 16);  // int: a row's groups of 8 pairs (heads x rot / 16, thousands)
        dim3 grid(grid_for(N, 1), (unsigned)ceil_div(groups, ROPE_VEC_THREADS));
        launch_kernel(grid, ROPE_VEC_THREADS, 0, stream, rope_apply_kernel, x, cos_t, sin_t, pos, N, T, nheads, hd,
                      rot, inverse, 1);
        return;
    }
    launch_kernel(grid_for(total, 256), 256, 0, stream, rope_apply_kernel, x, cos_t, sin_t, pos, N, T, nheads, hd, rot,
                  inverse, 0);
}

// A scaled score soft-capped as the CPU twin does: softcap * tanh(x / softcap) (softcap 0: x).
static __device__ __forceinline__ float att_softcap(float x, float softcap) {
    return softcap > 0.0f ? softcap * tanhf(x / softcap) : x;
}

// ---- shared pieces of the attention kernels --------------------------------------------------

// Loads rows [r0, r0+ATT_TILE) of head `head` of a [B*T, nheads*hd] tensor into tile[ATT_TILE][HDMAX]
// as fp32, zero beyond T and beyond hd. All threads of the block call it.
template <int HDMAX>
static __device__ __forceinline__ void att_load_tile(float (*tile)[HDMAX], const bf16* __restrict__ src, int b, int r0,
                                                     int head, int nheads, const AttnShape& s) {
    for (int idx = threadIdx.x; idx < ATT_TILE * HDMAX; idx += ATT_THREADS) {
        int rr = idx / HDMAX, dim = idx % HDMAX, t = r0 + rr;
        float val = 0.0f;
        if (t < s.T && dim < s.hd) val = bf2f(src[((int64_t)b * s.T + t) * nheads * s.hd + (int64_t)head * s.hd + dim]);
        tile[rr][dim] = val;
    }
}

// This thread's dims of one row of a [B*T, nheads*hd] tensor (zero when out of range).
template <int HDMAX>
static __device__ __forceinline__ void att_load_row(float* dst, const bf16* __restrict__ src, int b, int t, int head,
                                                    int nheads, int sub, const AttnShape& s) {
    constexpr int DPT = HDMAX / ATT_TPR;
    const bf16* row = src + ((int64_t)b * s.T + t) * nheads * s.hd + (int64_t)head * s.hd;
#pragma unroll
    for (int c = 0; c < DPT; c++) {
        int dim = c * ATT_TPR + sub;
        dst[c] = (t < s.T && dim < s.hd) ? bf2f(row[dim]) : 0.0f;
    }
}

template <int HDMAX>
static __device__ __forceinline__ void att_store_row(bf16* dst, const float* val, float mul, int b, int t, int head,
                                                     int nheads, int sub, const AttnShape& s) {
    constexpr int DPT = HDMAX / ATT_TPR;
    bf16* row = dst + ((int64_t)b * s.T + t) * nheads * s.hd + (int64_t)head * s.hd;
#pragma unroll
    for (int c = 0; c < DPT; c++) {
        int dim = c * ATT_TPR + sub;
        if (dim < s.hd) row[dim] = f2bf(val[c] * mul);
    }
}

// Dot product of this row (per-thread dims in `mine`) with row rr of a tile: all 8 threads of the
// row get the full sum.
template <int HDMAX>
static __device__ __forceinline__ float att_row_dot(const float* mine, const float (*tile)[HDMAX], int rr, int sub) {
    constexpr int DPT = HDMAX / ATT_TPR;
    float part = 0.0f;
#pragma unroll
    for (int c = 0; c < DPT; c++) part += mine[c] * tile[rr][c * ATT_TPR + sub];
    return group_reduce_sum(part, ATT_TPR);
}

// ---- forward ---------------------------------------------------------------------------------

// grid (ceil(T/32), B*H), block 256. Online softmax over key tiles; o = sum p v / sum p.
template <int HDMAX>
__global__ void __launch_bounds__(ATT_THREADS)
attention_forward_kernel(bf16* o, float* lse, const bf16* __restrict__ q, const bf16* __restrict__ k,
                         const bf16* __restrict__ v, AttnShape s) {
    constexpr int DPT = HDMAX / ATT_TPR;
    __shared__ float Ks[ATT_TILE][HDMAX];
    __shared__ float Vs[ATT_TILE][HDMAX];
    int row = threadIdx.x / ATT_TPR, sub = threadIdx.x % ATT_TPR;
    int b = blockIdx.y / s.H, h = blockIdx.y % s.H, kh = h / (s.H / s.KVH);
    int t0 = blockIdx.x * ATT_ROWS, t = t0 + row;
    float scale = s.scale > 0.0f ? s.scale : 1.0f / sqrtf((float)s.hd);

    float qr[DPT], acc[DPT];
    att_load_row<HDMAX>(qr, q, b, t, h, s.H, sub, s);
#pragma unroll
    for (int c = 0; c < DPT; c++) acc[c] = 0.0f;
    float m = -INFINITY, l = 0.0f;

    // the keys this row sees, [klo, khi]: dev/cuda/attention_flash.cuh's att_visible rule, out of the
    // unrolled loop below, whose registers it would otherwise hold per key
    int khi = t < s.T ? (s.causal ? t : s.T - 1) : -1, klo = 0;
    if (s.causal && t < s.T && s.window > 0) klo = t - s.window + 1;
    if (s.causal && t < s.T && s.pos) klo = max(klo, t - s.pos[(int64_t)b * s.T + t]);
    int kend = s.causal ? min(s.T, t0 + ATT_ROWS) : s.T;  // the causal block never looks past its last query
    int kbeg = s.causal && s.window > 0 && t0 - s.window + 1 > 0 ? (t0 - s.window + 1) / ATT_TILE * ATT_TILE : 0;
    for (int j0 = kbeg; j0 < kend; j0 += ATT_TILE) {  // a window: the tiles before it are skipped
        __syncthreads();  // everyone is done with the previous tile
        att_load_tile<HDMAX>(Ks, k, b, j0, kh, s.KVH, s);
        att_load_tile<HDMAX>(Vs, v, b, j0, kh, s.KVH, s);
        __syncthreads();
        float sc[ATT_TILE];
        float mt = -INFINITY;
#pragma unroll
        for (int jj = 0; jj < ATT_TILE; jj++) {
            float dot = att_row_dot<HDMAX>(qr, Ks, jj, sub);
            int key = j0 + jj;
            sc[jj] = key >= klo && key <= khi ? att_softcap(dot * scale, s.softcap) : -INFINITY;
            mt = fmaxf(mt, sc[jj]);
        }
        float mnew = fmaxf(m, mt);
        float corr = m == -INFINITY ? 0.0f : expf(m - mnew);  // nothing seen yet: nothing to rescale
        l *= corr;
#pragma unroll
        for (int c = 0; c < DPT; c++) acc[c] *= corr;
#pragma unroll
        for (int jj = 0; jj < ATT_TILE; jj++) {
            float p = sc[jj] == -INFINITY ? 0.0f : expf(sc[jj] - mnew);
            l += p;
#pragma unroll
            for (int c = 0; c < DPT; c++) acc[c] += p * Vs[jj][c * ATT_TPR + sub];
        }
        m = mnew;
    }
    if (t < s.T) {
        att_store_row<HDMAX>(o, acc, 1.0f / l, b, t, h, s.H, sub, s);
        if (sub == 0) lse[((int64_t)b * s.H + h) * s.T + t] = m + logf(l);
    }
}

// ---- the backward's row sums (attention_gemm.cuh's backward; dev/cuda/attention_flash.cuh's) --

// D[b, h, t] = sum_i dout[n, h, i] * o[n, h, i]: one warp per (token, head) row.
__global__ void attention_backward_preprocess_kernel(float* __restrict__ D, const bf16* __restrict__ dout,
                                                     const bf16* __restrict__ o, AttnShape s) {
    int64_t rows = (int64_t)s.B * s.T * s.H, warps = grid_stride_1d() >> 5;
    int lane = threadIdx.x & 31;
    // a grid-stride loop over rows, a warp per row (launched with the capped grid_for); the warps
    // stay whole, so the shuffles of warp_reduce_sum see every lane
    for (int64_t rowi = thread_index_1d() >> 5; rowi < rows; rowi += warps) {
        int64_t n = rowi / s.H;
        int h = (int)(rowi % s.H);
        const bf16* dr = dout + n * s.H * s.hd + (int64_t)h * s.hd;
        const bf16* orow = o + n * s.H * s.hd + (int64_t)h * s.hd;
        float acc = 0.0f;
        for (int i = lane; i < s.hd; i += 32) acc += bf2f(dr[i]) * bf2f(orow[i]);
        acc = warp_reduce_sum(acc);
        int64_t b = n / s.T, t = n % s.T;
        if (lane == 0) D[(b * s.H + h) * s.T + t] = acc;
    }
}

// dq (overwritten): grid (ceil(T/32), B*H). dq_i = scale * sum_j p_ij (dp_ij - D_i) k_j with
// p_ij = exp(q_i.k_j*scale - lse_i) and dp_ij = do_i.v_j.
// ---- host launchers --------------------------------------------------------------------------

static int att_hdmax(const AttnShape* s) {
    if (s->hd <= 0 || s->hd > 128) fail("attention: head_dim %d not supported by the CUDA kernels (1..128)", s->hd);
    if (s->KVH <= 0 || s->H % s->KVH != 0) fail("attention: %d heads do not group over %d kv heads", s->H, s->KVH);
    if ((int64_t)s->B * s->H > 65535)
        fail("attention: batch x heads = %lld exceeds the grid's y limit (65535)", (long long)s->B * s->H);
    return s->hd <= 32 ? 32 : s->hd <= 64 ? 64 : 128;
}

// o = softmax(q k^T * scale) v per (b, h); lse[b, h, t] = log-sum-exp of the scaled scores.
static void attention_forward_cuda(bf16* o, float* lse, const bf16* q, const bf16* k, const bf16* v, AttnShape s,
                                   cudaStream_t stream) {
    if ((int64_t)s.B * s.T * s.H == 0) return;
    dim3 grid((unsigned)ceil_div(s.T, ATT_ROWS), (unsigned)(s.B * s.H));  // int: <= 65535 (att_hdmax)
    switch (att_hdmax(&s)) {
    case 32: launch_kernel(grid, ATT_THREADS, 0, stream, attention_forward_kernel<32>, o, lse, q, k, v, s); break;
    case 64: launch_kernel(grid, ATT_THREADS, 0, stream, attention_forward_kernel<64>, o, lse, q, k, v, s); break;
    default: launch_kernel(grid, ATT_THREADS, 0, stream, attention_forward_kernel<128>, o, lse, q, k, v, s); break;
    }
}

// ---- the statistics' layouts (cuDNN's packed examples) ---------------------------------------

// One thread per statistic: lse [B, H, T] to token-major [B*T, H] (LSE_TO_TOKENS) or back (checked
// by dev/cuda/attention.cu against a plain loop). Threads run along the destination, so
// its writes are coalesced (the reads stride by T or H: B*H*T floats, a few MiB at most).
__global__ void attention_lse_layout_kernel(float* dst, const float* __restrict__ src, int B, int H, int T,
                                            LseLayout to) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, n = (int64_t)B * H * T;
    if (i >= n) return;
    if (to == LSE_TO_TOKENS) {  // i = (b*T + t)*H + h
        int64_t token = i / H, b = token / T, t = token % T, h = i % H;
        dst[i] = src[(b * H + h) * T + t];
    } else {  // i = (b*H + h)*T + t
        int64_t t = i % T, bh = i / T, b = bh / H, h = bh % H;
        dst[i] = src[(b * T + t) * H + h];
    }
}

static void attention_lse_layout_cuda(float* dst, const float* src, int B, int H, int T, LseLayout to,
                                      cudaStream_t stream) {
    int64_t n = (int64_t)B * H * T;
    if (n == 0) return;
    launch_kernel((unsigned)((n + 255) / 256), 256, 0, stream, attention_lse_layout_kernel, dst, src, B, H, T, to);
}

// ---- attention against a key/value cache (generation) ----------------------------------------

#define ATT_CACHE_MAX 4096   // keys one call can attend to: the scores live in shared memory
#define ATT_CACHE_THREADS 128

// One block per (new query t, head h): scores against every cached key up to the query's own
// position (start + t), a block-wide softmax, then o = p V with threads over the head dims.
__global__ void attention_cached_kernel(bf16* o, const bf16* __restrict__ q, const bf16* __restrict__ kc,
                                        const bf16* __restrict__ vc, int start, AttnShape s) {
    int H = s.H, KVH = s.KVH, hd = s.hd;
    __shared__ float p[ATT_CACHE_MAX];
    __shared__ float qs[128];
    int t = blockIdx.x / H, h = blockIdx.x % H, kh = h / (H / KVH), keys = start + t + 1;
    int j0 = s.window > 0 && keys > s.window ? keys - s.window : 0;  // the window's first key
    int64_t qrow = (int64_t)t * H * hd + (int64_t)h * hd, ks = (int64_t)KVH * hd;
    float scale = s.scale > 0.0f ? s.scale : rsqrtf((float)hd);
    for (int i = threadIdx.x; i < hd; i += blockDim.x) qs[i] = bf2f(q[qrow + i]) * scale;
    __syncthreads();
    float mx = -INFINITY;
    for (int j = j0 + threadIdx.x; j < keys; j += blockDim.x) {
        const bf16* kj = kc + j * ks + (int64_t)kh * hd;
        float d = 0.0f;
        for (int i = 0; i < hd; i++) d += qs[i] * bf2f(kj[i]);
        d = att_softcap(d, s.softcap);
        p[j] = d;
        mx = fmaxf(mx, d);
    }
    MaxLoc init = {mx, 0};
    mx = block_reduce_maxloc(init).v;
    float sum = 0.0f;
    for (int j = j0 + threadIdx.x; j < keys; j += blockDim.x) {
        p[j] = expf(p[j] - mx);
        sum += p[j];
    }
    float inv = 1.0f / block_reduce_sum(sum);  // its barriers also publish every p[j]
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        float acc = 0.0f;
        for (int j = j0; j < keys; j++) acc += p[j] * bf2f(vc[j * ks + (int64_t)kh * hd + i]);
        o[qrow + i] = f2bf(acc * inv);
    }
}

// o [n, H*hd] for n new queries q at positions start .. start+n-1 against kc, vc [>= start+n,
// KVH*hd], within s.window, with s.scale and s.softcap (the twin of attention_cached in
// llmc/cpu/attention.h; s.H, KVH, hd the heads, s.B and s.T unused).
static void attention_cached_cuda(bf16* o, const bf16* q, const bf16* kc, const bf16* vc, int n, int start,
                                  AttnShape s, cudaStream_t stream) {
    int H = s.H, KVH = s.KVH, hd = s.hd;
    if (n <= 0) return;
    if (start + n > ATT_CACHE_MAX)
        fail("attention_cached_cuda: %d cached positions exceed the kernel's %d", start + n, ATT_CACHE_MAX);
    if (hd > 128 || H % KVH)
        fail("attention_cached_cuda: head_dim %d (max 128) or %d heads over %d kv heads not supported", hd, H, KVH);
    unsigned blocks = (unsigned)n * H;  // int: n <= ATT_CACHE_MAX queries
    launch_kernel(blocks, ATT_CACHE_THREADS, 0, stream, attention_cached_kernel, o, q, kc, vc, start, s);
}
