// cuda/misc.cuh: the small memory-bound kernels of the CUDA backend, each the twin of a CPU loop:
//   embed_tokens_cuda           token embedding gather          (llmc/ops.h op_embed)
//   add_bias_rows_cuda          y[n, :] += bias                 (llmc/linear.h add_bias_rows)
//   bias_grad_rows_cuda         db += sum_n dy[n, :]            (the ViT head, and its linears under --full)
//   cast_f32_to_bf16_cuda       bf16 shadows of fp32 masters (LoRA), and back (the ViT head, tests)
//   copy_rows_cuda              strided row copy: the ViT class tokens out of the residual
//                               stream and their gradient back (llmc/ops.h op_copy_rows)
//   sum_replica_blocks_cuda     replicated key/value heads' gradients summed back (--seq-parallel,
//                               llmc/cpu/misc.h sum_replica_blocks)
//   patch_unfold_cuda           image -> patch rows, class-token row zero (llmc/ops.h op_patch_unfold)
//   patch_embed_finish_cuda     + class token / patch bias + positions (op_patch_embed_finish),
//                               and its backward when they train (--full)
//   image_resize_normalize_cuda uint8 HWC images -> normalised CHW, bilinear taps of
//                               llmc/vision/resample.h, optional flip (llmc/vision/imagedata.h convert)
// Elementwise kernels use grid-stride loops with 64-bit indices; accumulation into bf16 happens
// in fp32 and rounds once.
#pragma once
#include "common.cuh"
#include "vec.cuh"
#include "../vision/resample.h"

// ---- token embedding -------------------------------------------------------------------------

// x[n, :] = embed[ids[n], :]. One thread per element; ids are validated at load (< vocab).
__global__ void embed_tokens_kernel(bf16* __restrict__ x, const bf16* __restrict__ embed, const int* __restrict__ ids,
                                    int64_t N, int d) {
    for (int64_t i = thread_index_1d(); i < N * d; i += grid_stride_1d()) {
        int64_t n = i / d, c = i % d;
        x[i] = embed[(int64_t)ids[n] * d + c];
    }
}
static void embed_tokens_cuda(bf16* x, const bf16* embed, const int* ids, int64_t N, int d, cudaStream_t stream) {
    if (N * d == 0) return;
    launch_kernel(grid_for(N * d, 256), 256, 0, stream, embed_tokens_kernel, x, embed, ids, N, d);
}

// dE[v] += the sum of dx[n] over the tokens with ids[n] == v, in text order (a trained embedding,
// full fine-tuning). order: the positions sorted by id, then position (embedding_token_order, on
// the host). The thread for (g, i) works only where g starts a row's run: it sums column i of the
// run and adds it once, so there are no atomics, the sum is deterministic, and a gradient
// accumulated over micro-batches equals the all-reduce of the ranks' sums bit for bit.
__global__ void embedding_backward_kernel(float* dE, const bf16* __restrict__ dx, const int* __restrict__ ids,
                                          const int* __restrict__ order, int64_t N, int d, int skip_id) {
    for (int64_t idx = thread_index_1d(); idx < N * d; idx += grid_stride_1d()) {
        int64_t g = idx / d;
        int i = (int)(idx % d);
        int v = ids[order[g]];
        if ((g > 0 && ids[order[g - 1]] == v) || v == skip_id) continue;  // skip_id: padding_idx, no gradient
        float s = 0.0f;
        for (int64_t e = g; e < N && ids[order[e]] == v; e++) s += bf2f(dx[(int64_t)order[e] * d + i]);
        dE[(int64_t)v * d + i] += s;
    }
}
static void embedding_backward_cuda(float* dE, const bf16* dx, const int* ids, const int* order, int64_t N, int d,
                                    cudaStream_t stream, int skip_id = -1) {
    if (d == 0 || N == 0) return;
    launch_kernel(grid_for(N * d, 256), 256, 0, stream, embedding_backward_kernel, dE, dx, ids, order, N, d, skip_id);
}

// ---- residual add and bias -------------------------------------------------------------------

// out = a * b elementwise, product in fp32 then rounded once (rebuilding SwiGLU's down input): in
// 16-byte vectors where vec (all three arrays aligned), then the rest (the last n % 8 elements, or
// all when not aligned) one at a time (dev/cuda/misc_scalar.cuh keeps that form alone).
__global__ void multiply_kernel(bf16* out, const bf16* a, const bf16* b, int64_t n, int vec) {
    int64_t nv = vec ? n / 8 : 0;
    for (int64_t k = thread_index_1d(); k < nv; k += grid_stride_1d()) {
        Vec16<bf16> av = load_vec16(a + 8 * k), bv = load_vec16(b + 8 * k), o;
        for (int j = 0; j < 8; j++) o.v[j] = f2bf(bf2f(av.v[j]) * bf2f(bv.v[j]));
        store_vec16(out + 8 * k, o);
    }
    for (int64_t i = 8 * nv + thread_index_1d(); i < n; i += grid_stride_1d()) out[i] = f2bf(bf2f(a[i]) * bf2f(b[i]));
}
static void multiply_cuda(bf16* out, const bf16* a, const bf16* b, int64_t n, cudaStream_t stream) {
    if (n == 0) return;
    int vec = aligned16(out) && aligned16(a) && aligned16(b);
    launch_kernel(grid_for(vec ? n / 8 + 8 : n, 256), 256, 0, stream, multiply_kernel, out, a, b, n, vec);
}

// y += x elementwise, the sum in fp32 then rounded once (the twin of add_inplace: Gemma's post-normed
// branch outputs onto the residual stream).
__global__ void add_inplace_kernel(bf16* y, const bf16* __restrict__ x, int64_t n) {
    for (int64_t i = thread_index_1d(); i < n; i += grid_stride_1d()) y[i] = f2bf(bf2f(y[i]) + bf2f(x[i]));
}
static void add_inplace_cuda(bf16* y, const bf16* x, int64_t n, cudaStream_t stream) {
    if (n == 0) return;
    launch_kernel(grid_for(n, 256), 256, 0, stream, add_inplace_kernel, y, x, n);
}

// y[n, i] = x[n, i] * g[i], rows of d, the product in fp32 then rounded once (the twin of scale_columns;
// y may be x). Where vec (d % 8 == 0, every array aligned), on a 2-D grid with no div/mod per element:
// blockIdx.x strides over the rows, the thread along y owns columns 8c .. 8c+7, whose gamma it loads
// once, in 16-byte vectors; in place is safe, each thread reads its vector before writing it. Else
// one element at a time over the 1-D grid (dev/cuda/misc_scalar.cuh keeps that form alone).
#define SCALE_COLUMNS_VEC_THREADS 64
__global__ void scale_columns_kernel(bf16* y, const bf16* x, const bf16* __restrict__ g, int64_t rows, int d, int vec) {
    if (!vec) {
        for (int64_t i = thread_index_1d(); i < rows * d; i += grid_stride_1d())
            y[i] = f2bf(bf2f(x[i]) * bf2f(g[i % d]));
        return;
    }
    int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= d / 8) return;
    Vec16<bf16> gv = load_vec16(g + 8 * c);
    for (int64_t n = blockIdx.x; n < rows; n += gridDim.x) {
        Vec16<bf16> xv = load_vec16(x + n * d + 8 * c), o;
        for (int j = 0; j < 8; j++) o.v[j] = f2bf(bf2f(xv.v[j]) * bf2f(gv.v[j]));
        store_vec16(y + n * d + 8 * c, o);
    }
}
static void scale_columns_cuda(bf16* y, const bf16* x, const bf16* g, int64_t rows, int d, cudaStream_t stream) {
    if (rows * d == 0) return;
    if (d % 8 == 0 && aligned16(y) && aligned16(x) && aligned16(g)) {
        dim3 grid(grid_for(rows, 1), (unsigned)ceil_div(d / 8, SCALE_COLUMNS_VEC_THREADS));
        launch_kernel(grid, SCALE_COLUMNS_VEC_THREADS, 0, stream, scale_columns_kernel, y, x, g, rows, d, 1);
        return;
    }
    launch_kernel(grid_for(rows * d, 256), 256, 0, stream, scale_columns_kernel, y, x, g, rows, d, 0);
}

template <class T>
__global__ void add_bias_rows_kernel(T* y, const T* __restrict__ bias, int64_t N, int out) {
    for (int64_t i = thread_index_1d(); i < N * out; i += grid_stride_1d()) {
        float v = (float)y[i] + (float)bias[i % out];
        y[i] = (T)v;
    }
}
static void add_bias_rows_cuda(bf16* y, const bf16* bias, int64_t N, int out, cudaStream_t stream) {
    if (N * out == 0) return;
    launch_kernel(grid_for(N * out, 256), 256, 0, stream, add_bias_rows_kernel<bf16>, y, bias, N, out);
}
static void add_bias_rows_cuda(float* y, const float* bias, int64_t N, int out, cudaStream_t stream) {
    if (N * out == 0) return;
    launch_kernel(grid_for(N * out, 256), 256, 0, stream, add_bias_rows_kernel<float>, y, bias, N, out);
}

// db[j] += sum_n dy[n, j]: the gradient of a bias (the ViT head; under --full every ViT linear),
// by column_sums_kernel: rows in a fixed order, deterministic.
template <typename T>
struct BiasGradTerm {
    static const int K = 1;
    const T* dy;
    int out;
    __device__ void add(int64_t n, int64_t j, float* s) const { s[0] += (float)dy[n * out + j]; }
};
static void bias_grad_rows_cuda(float* db, const float* dy, int64_t N, int out, cudaStream_t stream) {
    if (out == 0) return;
    launch_kernel(column_sums_grid(out), COLUMN_SUMS_BLOCK, 0, stream, column_sums_kernel<BiasGradTerm<float>>, db,
                  (float*)NULL, BiasGradTerm<float>{dy, out}, N, out);
}
static void bias_grad_rows_cuda(float* db, const bf16* dy, int64_t N, int out, cudaStream_t stream) {
    if (out == 0) return;
    launch_kernel(column_sums_grid(out), COLUMN_SUMS_BLOCK, 0, stream, column_sums_kernel<BiasGradTerm<bf16>>, db,
                  (float*)NULL, BiasGradTerm<bf16>{dy, out}, N, out);
}

// ---- strided rows --------------------------------------------------------------------------

// dst[r*dst_stride + c] = src[r*src_stride + c] for r < rows, c < d (strides in elements): the
// class-token rows of the ViT residual stream into a dense [rows, d] buffer, and back.
__global__ void copy_rows_kernel(bf16* __restrict__ dst, int64_t dst_stride, const bf16* __restrict__ src,
                                 int64_t src_stride, int64_t rows, int d) {
    for (int64_t i = thread_index_1d(); i < rows * d; i += grid_stride_1d()) {
        int64_t r = i / d, c = i % d;
        dst[r * dst_stride + c] = src[r * src_stride + c];
    }
}
static void copy_rows_cuda(bf16* dst, int64_t dst_stride, const bf16* src, int64_t src_stride, int64_t rows, int d,
                           cudaStream_t stream) {
    if (rows * d == 0) return;
    launch_kernel(grid_for(rows * d, 256), 256, 0, stream, copy_rows_kernel, dst, dst_stride, src, src_stride, rows, d);
}

// ---- replicated heads ----------------------------------------------------------------------

// dst [rows, blocks / rep * bw] = for each column chunk ch, the sum over i < rep of src's block
// ch * rep + i [rows, bw] (blocks one after the other), in fp32 in replica order, rounded once.
__global__ void sum_replica_blocks_kernel(bf16* __restrict__ dst, const bf16* __restrict__ src, int64_t rows,
                                          int chunks, int rep, int bw) {
    int64_t width = (int64_t)chunks * bw;
    for (int64_t i = thread_index_1d(); i < rows * width; i += grid_stride_1d()) {
        int64_t r = i / width;
        int ch = (int)(i % width / bw), c = (int)(i % bw);
        float sum = 0.0f;
        for (int k = 0; k < rep; k++) sum += __bfloat162float(src[((int64_t)(ch * rep + k) * rows + r) * bw + c]);
        dst[i] = __float2bfloat16(sum);
    }
}
static void sum_replica_blocks_cuda(bf16* dst, const bf16* src, int64_t rows, int blocks, int rep, int bw,
                                    cudaStream_t stream) {
    int64_t n = rows * (blocks / rep) * bw;
    if (n == 0) return;
    launch_kernel(grid_for(n, 256), 256, 0, stream, sum_replica_blocks_kernel, dst, src, rows, blocks / rep, rep, bw);
}

// ---- casts -----------------------------------------------------------------------------------

// fp32 <-> bf16, 8 elements per thread in 16-byte vectors (two float4 and one vector of 8 bf16):
// elements [0, head) and [head + 8 * nv, n) one at a time, head bringing both pointers to a
// 16-byte boundary (cast_vec_head: the bf16 side to 16 bytes, which the fp32 side must then be).
// head = n, where no element brings both there, casts every element one at a time
// (dev/cuda/misc_scalar.cuh keeps that form alone).
__global__ void cast_f32_to_bf16_kernel(bf16* __restrict__ dst, const float* __restrict__ src, int64_t n,
                                        int64_t head) {
    int64_t nv = (n - head) / 8, tail = head + 8 * nv;
    for (int64_t k = thread_index_1d(); k < nv; k += grid_stride_1d()) {
        Vec16<float> a = load_vec16(src + head + 8 * k), b = load_vec16(src + head + 8 * k + 4);
        Vec16<bf16> o;
        for (int j = 0; j < 4; j++) { o.v[j] = f2bf(a.v[j]); o.v[4 + j] = f2bf(b.v[j]); }
        store_vec16(dst + head + 8 * k, o);
    }
    for (int64_t i = thread_index_1d(); i < head + (n - tail); i += grid_stride_1d()) {
        int64_t e = i < head ? i : tail + (i - head);
        dst[e] = f2bf(src[e]);
    }
}
__global__ void cast_bf16_to_f32_kernel(float* __restrict__ dst, const bf16* __restrict__ src, int64_t n,
                                        int64_t head) {
    int64_t nv = (n - head) / 8, tail = head + 8 * nv;
    for (int64_t k = thread_index_1d(); k < nv; k += grid_stride_1d()) {
        Vec16<bf16> x = load_vec16(src + head + 8 * k);
        Vec16<float> a, b;
        for (int j = 0; j < 4; j++) { a.v[j] = bf2f(x.v[j]); b.v[j] = bf2f(x.v[4 + j]); }
        store_vec16(dst + head + 8 * k, a);
        store_vec16(dst + head + 8 * k + 4, b);
    }
    for (int64_t i = thread_index_1d(); i < head + (n - tail); i += grid_stride_1d()) {
        int64_t e = i < head ? i : tail + (i - head);
        dst[e] = bf2f(src[e]);
    }
}
// Elements before both the bf16 and the fp32 array are 16-byte aligned, or n when no element
// brings both there (their offsets are out of step: every element one at a time).
static int64_t cast_vec_head(const bf16* h, const float* f, int64_t n) {
    int64_t head = elems_to_align16(h);
    if (head > n) head = n;
    return aligned16(f + head) ? head : n;
}

// The casts' grid (256 threads) for n elements from `head` (a launcher that casts inline uses it too).
static unsigned cast_grid(int64_t n, int64_t head) { return grid_for(head < n ? n / 8 + 8 : n, 256); }

static void cast_f32_to_bf16_cuda(bf16* dst, const float* src, int64_t n, cudaStream_t stream) {
    if (n == 0) return;
    int64_t head = cast_vec_head(dst, src, n);
    launch_kernel(cast_grid(n, head), 256, 0, stream, cast_f32_to_bf16_kernel, dst, src, n, head);
}
static void cast_bf16_to_f32_cuda(float* dst, const bf16* src, int64_t n, cudaStream_t stream) {
    if (n == 0) return;
    int64_t head = cast_vec_head(src, dst, n);
    launch_kernel(cast_grid(n, head), 256, 0, stream, cast_bf16_to_f32_kernel, dst, src, n, head);
}

// ---- ViT patch embedding ---------------------------------------------------------------------

typedef struct {
    int B, T;              // images, tokens per image (1 class token + gh*gw patches)
    int C, H, W;           // pixels [B, C, H, W]
    int ph, pw, gw;        // patch size, patches per row
} PatchShape;

// patches[n, (c*ph + i)*pw + j] = pixels[b, c, py*ph + i, px*pw + j] for token t = 1 + py*gw + px
// of image b (n = b*T + t); the class token's row (t = 0) is zero, so that the patch product
// lands straight in the residual stream. One thread per patch-row element. The pixels are bf16,
// or fp32 as the image loader writes them (the trainer uploads those and converts here, so no
// bf16 copy of the images is ever stored).
template <class T>
__global__ void patch_unfold_kernel(bf16* __restrict__ patches, const T* __restrict__ pixels, PatchShape s) {
    int64_t P = (int64_t)s.C * s.ph * s.pw, total = (int64_t)s.B * s.T * P;
    for (int64_t idx = thread_index_1d(); idx < total; idx += grid_stride_1d()) {
        int64_t n = idx / P, e = idx % P;
        int b = (int)(n / s.T), t = (int)(n % s.T);
        if (t == 0) { patches[idx] = f2bf(0.0f); continue; }
        int c = (int)(e / ((int64_t)s.ph * s.pw)), i = (int)(e / s.pw % s.ph), j = (int)(e % s.pw);
        int py = (t - 1) / s.gw, px = (t - 1) % s.gw;
        patches[idx] =
            f2bf((float)pixels[(((int64_t)b * s.C + c) * s.H + (int64_t)py * s.ph + i) * s.W + (int64_t)px * s.pw + j]);
    }
}
static int64_t patch_unfold_total(PatchShape s) { return (int64_t)s.B * s.T * s.C * s.ph * s.pw; }
static void patch_unfold_cuda(bf16* patches, const bf16* pixels, PatchShape s, cudaStream_t stream) {
    int64_t total = patch_unfold_total(s);
    if (total == 0) return;
    launch_kernel(grid_for(total, 256), 256, 0, stream, patch_unfold_kernel<bf16>, patches, pixels, s);
}
static void patch_unfold_cuda(bf16* patches, const float* pixels, PatchShape s, cudaStream_t stream) {
    int64_t total = patch_unfold_total(s);
    if (total == 0) return;
    launch_kernel(grid_for(total, 256), 256, 0, stream, patch_unfold_kernel<float>, patches, pixels, s);
}

// After the patch product: x[b, 0, :] = cls + pos[0]; x[b, t, :] += patch_bias + pos[t] (t > 0).
__global__ void patch_embed_finish_kernel(bf16* x, const bf16* __restrict__ cls, const bf16* __restrict__ patch_b,
                                          const bf16* __restrict__ pos, int64_t N, int T, int d) {
    for (int64_t i = thread_index_1d(); i < N * d; i += grid_stride_1d()) {
        int64_t n = i / d, c = i % d, t = n % T;
        float p = bf2f(pos[t * d + c]);
        x[i] = t == 0 ? f2bf(bf2f(cls[c]) + p) : f2bf(bf2f(x[i]) + (bf2f(patch_b[c]) + p));
    }
}
// Its backward, from dx [N, d] (N = B*T) when the embeddings train: dcls += sum_b dx[b, 0],
// dpos[t] += sum_b dx[b, t], dpatch_b += sum_b sum_{t>0} dx[b, t]. One thread per (t, c), images
// in order; dpatch_b by column_sums_kernel over the patch rows: deterministic.
__global__ void patch_embed_finish_backward_kernel(float* dcls, float* dpos, const bf16* __restrict__ dx, int64_t N,
                                                   int T, int d) {
    int64_t i = thread_index_1d();
    if (i >= (int64_t)T * d) return;
    int64_t t = i / d, c = i % d;
    float s = 0.0f;
    for (int64_t b = 0; b < N / T; b++) s += bf2f(dx[(b * T + t) * d + c]);
    dpos[i] += s;
    if (t == 0) dcls[c] += s;
}
struct PatchBiasTerm {  // dx[n, j] of the patch rows, token t = n % T > 0 (column_sums_kernel)
    static const int K = 1;
    const bf16* dx;
    int T, d;
    __device__ void add(int64_t n, int64_t j, float* s) const { if (n % T) s[0] += bf2f(dx[n * d + j]); }
};
static void patch_embed_finish_backward_cuda(float* dcls, float* dpatch_b, float* dpos, const bf16* dx, int64_t N,
                                             int T, int d, cudaStream_t stream) {
    if (N * d == 0) return;
    launch_kernel(ceil_div((int64_t)T * d, 128), 128, 0, stream, patch_embed_finish_backward_kernel, dcls, dpos, dx, N,
                  T, d);
    launch_kernel(column_sums_grid(d), COLUMN_SUMS_BLOCK, 0, stream, column_sums_kernel<PatchBiasTerm>, dpatch_b,
                  (float*)NULL, PatchBiasTerm{dx, T, d}, N, d);
}

static void patch_embed_finish_cuda(bf16* x, const bf16* cls, const bf16* patch_b, const bf16* pos, int64_t N, int T,
                                    int d, cudaStream_t stream) {
    if (N * d == 0) return;
    launch_kernel(grid_for(N * d, 256), 256, 0, stream, patch_embed_finish_kernel, x, cls, patch_b, pos, N, T, d);
}

// ---- image resize and normalise --------------------------------------------------------------

typedef struct {
    int B;                 // images
    int sH, sW, sC;        // source images [B, sH, sW, sC] uint8, channels last
    int H, W, C;           // output [B, C, H, W]; a 1-channel source feeds every output channel
    float mean[3], std[3]; // per output channel
} ImageShape;

// dst[b, c, y, x] = (sum_a sum_b' wy[a] wx[b'] img[...]) * 1/(255 std) - mean/std, with the taps
// of llmc/vision/resample.h (bilinear_taps, computed on the host and uploaded), x mirrored when flip[b]
// is set: exactly the arithmetic of image_loader_convert. One thread per output pixel value.
__global__ void image_resize_normalize_kernel(bf16* __restrict__ dst, const uint8_t* __restrict__ src,
                                              const ResampleTaps* __restrict__ ty, const ResampleTaps* __restrict__ tx,
                                              const int* __restrict__ flip, ImageShape s) {
    int64_t total = (int64_t)s.B * s.C * s.H * s.W;
    for (int64_t idx = thread_index_1d(); idx < total; idx += grid_stride_1d()) {
        int x = (int)(idx % s.W), y = (int)(idx / s.W % s.H), c = (int)(idx / ((int64_t)s.W * s.H) % s.C);
        int b = (int)(idx / ((int64_t)s.W * s.H * s.C));
        int sc = s.sC == 1 ? 0 : c;
        float scale = 1.0f / (255.0f * s.std[c]), shift = s.mean[c] / s.std[c];
        const uint8_t* img = src + (int64_t)b * s.sH * s.sW * s.sC;
        const ResampleTaps* tyy = &ty[y];
        const ResampleTaps* txx = &tx[flip && flip[b] ? s.W - 1 - x : x];
        float v = 0.0f;
        for (int a = 0; a < 2; a++)
            for (int k = 0; k < 2; k++)
                v += tyy->w[a] * txx->w[k] * (float)img[((int64_t)tyy->idx[a] * s.sW + txx->idx[k]) * s.sC + sc];
        dst[idx] = f2bf(v * scale - shift);
    }
}
// ty [H] and tx [W] are device copies of bilinear_taps(ty, sH, H) and bilinear_taps(tx, sW, W);
// flip [B] may be NULL (no flips).
static void image_resize_normalize_cuda(bf16* dst, const uint8_t* src, const ResampleTaps* ty, const ResampleTaps* tx,
                                        const int* flip, ImageShape s, cudaStream_t stream) {
    int64_t total = (int64_t)s.B * s.C * s.H * s.W;
    if (total == 0) return;
    launch_kernel(grid_for(total, 256), 256, 0, stream, image_resize_normalize_kernel, dst, src, ty, tx, flip, s);
}
