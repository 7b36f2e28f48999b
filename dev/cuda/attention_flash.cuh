// dev/cuda/attention_flash.cuh: the fp32 flash attention backward (FlashAttention-2's, on CUDA cores)
// that was the trainers' third attention (LLMC_ATTENTION=flash) until issue 35, kept as a reference
// version of the op, as llm.c keeps its numbered kernels; its forward, attention_forward_cuda, stays
// in llmc/cuda/attention.cuh (the forward of shapes the planned workspace does not fit). The layout,
// shape struct and tiling are attention.cuh's:
//   D = rowsum(dO * O)                          (attention_backward_preprocess_kernel, attention.cuh's:
//                                                the GEMM backward's too)
//   dQ: per query tile, loop over key tiles     (attention_backward_dq_kernel)
//   dK, dV: per key tile, loop over the query tiles of every query head of its group
//                                               (attention_backward_dkdv_kernel)
// Scores and probabilities are recomputed from q, k and lse in both backward kernels, so
// nothing is written twice and no atomics are needed: the result is deterministic.
// dev/cuda/attention.cu checks it against the CPU twin and the production (GEMM) backward.
#pragma once
#include "../../llmc/cuda/attention.cuh"

// ---- backward --------------------------------------------------------------------------------

// Whether query row `query` of batch b sees key row `key`: inside the sequence, not in the future
// when causal, within the sliding window (s.window > 0: key > query - window, llmc/cpu/attention.h),
// and (packed examples, s.pos a device array) not before the query's example start.
static __device__ __forceinline__ int att_visible(const AttnShape& s, int b, int query, int key) {
    if (query >= s.T || key >= s.T) return 0;
    if (!s.causal) return 1;
    if (s.window > 0 && key <= query - s.window) return 0;
    return key <= query && (!s.pos || key >= query - s.pos[(int64_t)b * s.T + query]);
}

template <int HDMAX>
__global__ void __launch_bounds__(ATT_THREADS)
    attention_backward_dq_kernel(bf16* dq, const bf16* __restrict__ dout, const bf16* __restrict__ q,
                                 const bf16* __restrict__ k, const bf16* __restrict__ v, const float* __restrict__ lse,
                                 const float* __restrict__ D, AttnShape s) {
    constexpr int DPT = HDMAX / ATT_TPR;
    __shared__ float Ks[ATT_TILE][HDMAX];
    __shared__ float Vs[ATT_TILE][HDMAX];
    int row = threadIdx.x / ATT_TPR, sub = threadIdx.x % ATT_TPR;
    int b = blockIdx.y / s.H, h = blockIdx.y % s.H, kh = h / (s.H / s.KVH);
    int t0 = blockIdx.x * ATT_ROWS, t = t0 + row;
    float scale = 1.0f / sqrtf((float)s.hd);

    float qr[DPT], dor[DPT], acc[DPT];
    att_load_row<HDMAX>(qr, q, b, t, h, s.H, sub, s);
    att_load_row<HDMAX>(dor, dout, b, t, h, s.H, sub, s);
#pragma unroll
    for (int c = 0; c < DPT; c++) acc[c] = 0.0f;
    int64_t st = ((int64_t)b * s.H + h) * s.T + t;
    float L = t < s.T ? lse[st] : 0.0f, Dv = t < s.T ? D[st] : 0.0f;

    int kend = s.causal ? min(s.T, t0 + ATT_ROWS) : s.T;
    for (int j0 = 0; j0 < kend; j0 += ATT_TILE) {
        __syncthreads();
        att_load_tile<HDMAX>(Ks, k, b, j0, kh, s.KVH, s);
        att_load_tile<HDMAX>(Vs, v, b, j0, kh, s.KVH, s);
        __syncthreads();
#pragma unroll 4
        for (int jj = 0; jj < ATT_TILE; jj++) {
            float sdot = att_row_dot<HDMAX>(qr, Ks, jj, sub);
            float dp = att_row_dot<HDMAX>(dor, Vs, jj, sub);
            int key = j0 + jj;
            int ok = att_visible(s, b, t, key);
            float p = ok ? expf(sdot * scale - L) : 0.0f;
            float ds = p * (dp - Dv) * scale;
#pragma unroll
            for (int c = 0; c < DPT; c++) acc[c] += ds * Ks[jj][c * ATT_TPR + sub];
        }
    }
    if (t < s.T) att_store_row<HDMAX>(dq, acc, 1.0f, b, t, h, s.H, sub, s);
}

// dk, dv (overwritten): grid (ceil(T/32), B*KVH); the rows of a block are keys of kv head kh,
// and the query tiles of every query head of its group stream through shared memory.
//   dv_j = sum_i p_ij do_i,   dk_j = scale * sum_i p_ij (dp_ij - D_i) q_i
template <int HDMAX>
__global__ void __launch_bounds__(ATT_THREADS)
attention_backward_dkdv_kernel(bf16* dk, bf16* dv, const bf16* __restrict__ dout, const bf16* __restrict__ q,
                               const bf16* __restrict__ k, const bf16* __restrict__ v, const float* __restrict__ lse,
                               const float* __restrict__ D, AttnShape s) {
    constexpr int DPT = HDMAX / ATT_TPR;
    __shared__ float Qs[ATT_TILE][HDMAX];
    __shared__ float dOs[ATT_TILE][HDMAX];
    __shared__ float Ls[ATT_TILE], Ds[ATT_TILE];
    int row = threadIdx.x / ATT_TPR, sub = threadIdx.x % ATT_TPR;
    int b = blockIdx.y / s.KVH, kh = blockIdx.y % s.KVH, group = s.H / s.KVH;
    int j0 = blockIdx.x * ATT_ROWS, j = j0 + row;
    float scale = 1.0f / sqrtf((float)s.hd);

    float kr[DPT], vr[DPT], dk_acc[DPT], dv_acc[DPT];
    att_load_row<HDMAX>(kr, k, b, j, kh, s.KVH, sub, s);
    att_load_row<HDMAX>(vr, v, b, j, kh, s.KVH, sub, s);
#pragma unroll
    for (int c = 0; c < DPT; c++) dk_acc[c] = dv_acc[c] = 0.0f;

    int istart = s.causal ? j0 / ATT_TILE * ATT_TILE : 0;  // causal: queries before the block see none of its keys
    for (int h = kh * group; h < (kh + 1) * group; h++) {  // int: head numbers, below H
        for (int i0 = istart; i0 < s.T; i0 += ATT_TILE) {
            __syncthreads();
            att_load_tile<HDMAX>(Qs, q, b, i0, h, s.H, s);
            att_load_tile<HDMAX>(dOs, dout, b, i0, h, s.H, s);
            if (threadIdx.x < ATT_TILE) {
                int i = i0 + threadIdx.x;
                int64_t st = ((int64_t)b * s.H + h) * s.T + i;
                Ls[threadIdx.x] = i < s.T ? lse[st] : 0.0f;
                Ds[threadIdx.x] = i < s.T ? D[st] : 0.0f;
            }
            __syncthreads();
#pragma unroll 4
            for (int ii = 0; ii < ATT_TILE; ii++) {
                float sdot = att_row_dot<HDMAX>(kr, Qs, ii, sub);
                float dp = att_row_dot<HDMAX>(vr, dOs, ii, sub);
                int i = i0 + ii;
                int ok = att_visible(s, b, i, j);
                float p = ok ? expf(sdot * scale - Ls[ii]) : 0.0f;
                float ds = p * (dp - Ds[ii]) * scale;
#pragma unroll
                for (int c = 0; c < DPT; c++) {
                    dv_acc[c] += p * dOs[ii][c * ATT_TPR + sub];
                    dk_acc[c] += ds * Qs[ii][c * ATT_TPR + sub];
                }
            }
        }
    }
    if (j < s.T) {
        att_store_row<HDMAX>(dk, dk_acc, 1.0f, b, j, kh, s.KVH, sub, s);
        att_store_row<HDMAX>(dv, dv_acc, 1.0f, b, j, kh, s.KVH, sub, s);
    }
}

// Gradients dq, dk, dv (overwritten) from dout. scratch: B*H*T floats (the row sums D; the same
// size as lse), planned by the caller.
static void attention_backward_cuda(bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q, const bf16* k,
                                    const bf16* v, const bf16* o, const float* lse, float* scratch, AttnShape s,
                                    cudaStream_t stream) {
    if ((int64_t)s.B * s.T * s.H == 0) return;
    int hdmax = att_hdmax(&s);
    int64_t rows = (int64_t)s.B * s.T * s.H;
    launch_kernel(grid_for(rows * 32, 256), 256, 0, stream, attention_backward_preprocess_kernel, scratch, dout, o, s);
    dim3 gq((unsigned)ceil_div(s.T, ATT_ROWS), (unsigned)(s.B * s.H));    // int: <= 65535 (att_hdmax)
    dim3 gk((unsigned)ceil_div(s.T, ATT_ROWS), (unsigned)(s.B * s.KVH));  // int: <= B*H
    switch (hdmax) {
    case 32:
        launch_kernel(gq, ATT_THREADS, 0, stream, attention_backward_dq_kernel<32>, dq, dout, q, k, v, lse, scratch, s);
        launch_kernel(gk, ATT_THREADS, 0, stream, attention_backward_dkdv_kernel<32>, dk, dv, dout, q, k, v, lse,
                      scratch, s);
        break;
    case 64:
        launch_kernel(gq, ATT_THREADS, 0, stream, attention_backward_dq_kernel<64>, dq, dout, q, k, v, lse, scratch, s);
        launch_kernel(gk, ATT_THREADS, 0, stream, attention_backward_dkdv_kernel<64>, dk, dv, dout, q, k, v, lse,
                      scratch, s);
        break;
    default:
        launch_kernel(gq, ATT_THREADS, 0, stream, attention_backward_dq_kernel<128>, dq, dout, q, k, v, lse, scratch,
                      s);
        launch_kernel(gk, ATT_THREADS, 0, stream, attention_backward_dkdv_kernel<128>, dk, dv, dout, q, k, v, lse,
                      scratch, s);
        break;
    }
}
