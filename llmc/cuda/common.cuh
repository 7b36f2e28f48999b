// cuda/common.cuh: what every CUDA kernel header of the backend needs: the bf16 activation type,
// CUDA_CHECK / CUBLAS_CHECK (a failing call is reported through fail() with file:line and the
// call's text), launch_kernel (every launch followed by a check of the last error), 64-bit index
// helpers, and the warp/block reductions that every row kernel uses (written once, here, and
// tested by dev/cuda/common.cu).
//
// Conventions of the backend (the twins of llmc/cpu/*.h):
//   - a host launcher `foo_cuda(...)` takes the arguments of its CPU twin `foo(...)` in the same
//     order and meaning, with bf16 (`bf16` = __nv_bfloat16) where the CPU has fp32 activations,
//     fp32 for statistics (norm r and mean, attention lse, loss), fp32 LoRA master weights,
//     gradients and optimizer state, plus a trailing cudaStream_t;
//   - every kernel indexes with int64_t, so tensors beyond 2^31 elements are fine;
//   - nothing is allocated behind the caller's back: scratch comes in as an argument (the plan).
// Built with -DLLMC_CUDA_EMU, the same source runs on the CPU under test/emu/emu.h.
#pragma once
#include <stdint.h>
#include <stdlib.h>
#include "../common.h"
#include "../settings.h"
#ifdef LLMC_CUDA_EMU
#include "../../test/emu/emu.h"  // test infrastructure: only the emulator builds (build/emu/) take it
#include "../../test/emu/emu_cublas.h"
#else
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cublasLt.h>
#include <cublas_v2.h>
#endif

typedef __nv_bfloat16 bf16;

// ---- error checks ----------------------------------------------------------------------------

static void cuda_check(cudaError_t err, const char* call, const char* file, int line) {
    if (err != cudaSuccess) fail("CUDA error at %s:%d: %s: %s", file, line, call, cudaGetErrorString(err));
}
#define CUDA_CHECK(call) cuda_check((call), #call, __FILE__, __LINE__)

static void cublas_check(cublasStatus_t st, const char* call, const char* file, int line) {
    if (st != CUBLAS_STATUS_SUCCESS) fail("cuBLAS error at %s:%d: %s: %s", file, line, call, cublasGetStatusString(st));
}
#define CUBLAS_CHECK(call) cublas_check((call), #call, __FILE__, __LINE__)

// LLMC_CUDA_SYNC=1 in the environment makes every launch synchronous, so an asynchronous fault
// (an illegal address) is reported at the launch that caused it instead of at a later call.
static int cuda_sync_each_launch(void) { return setting_on(SETTING_CUDA_SYNC); }

static void cuda_check_launch(const char* kernel, const char* file, int line) {
    cudaError_t err = cudaGetLastError();
    if (err == cudaSuccess && cuda_sync_each_launch()) err = cudaDeviceSynchronize();
    if (err != cudaSuccess) fail("CUDA error at %s:%d: launch of %s: %s", file, line, kernel, cudaGetErrorString(err));
}

// What device work costs the host (--profile's "per step" line, llmc/train/profile.h). On the
// emulator every count is exact (emu.h counts kernel launches, cuBLAS compute calls and every call
// that makes the host wait); on a GPU only the launches made through launch_kernel are counted
// here, and the other two are -1 (unknown: no interposition on the CUDA runtime).
// A CUDA graph's launch (llmc/cuda/graph.cuh) counts as one launch; the kernels and cuBLAS calls it
// replays are counted apart (graph_blas -1 on a GPU), and so are the graphs captured.
typedef struct {
    long long launches, blas_calls, host_syncs;
    long long graph_launches, graph_kernels, graph_blas, graph_captures;
} CudaCounts;
#ifndef LLMC_CUDA_EMU
static CudaCounts cuda_counted = {0, -1, -1, 0, 0, -1, 0};  // launch_kernel and graph.cuh count here
#endif
static CudaCounts cuda_counts_now(void) {
#ifdef LLMC_CUDA_EMU
    CudaCounts c = {emu_counts.launches,      emu_counts.blas_calls,    emu_counts.host_syncs,
                    emu_counts.graph_launches, emu_counts.graph_kernels, emu_counts.graph_blas,
                    emu_counts.graph_captures};
#else
    CudaCounts c = cuda_counted;
#endif
    return c;
}

// launch_kernel(grid, block, shared_bytes, stream, kernel, args...): the <<<>>> launch, then the
// error check. A kernel that is a template takes at most one template argument here (the
// preprocessor would split `k<a, b>` at its comma). On the emulator a launch on a stream that
// captures a CUDA graph is recorded with its arguments as they are now (emu.h).
#ifdef LLMC_CUDA_EMU
#define launch_kernel(grid, block, smem, stream, kernel, ...)                                          \
    do {                                                                                               \
        if (emu_capturing(stream))                                                                     \
            emu_capture_launch(dim3(grid), dim3(block), (smem), #kernel, (const void*)kernel,          \
                               emu_bind_kernel(kernel, ##__VA_ARGS__));                                \
        else if (!emu_capture_refuses_legacy(stream, #kernel)) {                                       \
            emu_stream_issue(stream);                                                                  \
            emu_launch(dim3(grid), dim3(block), (smem), #kernel, (const void*)kernel,                  \
                       [&]() { kernel(__VA_ARGS__); });                                                \
        }                                                                                              \
        cuda_check_launch(#kernel, __FILE__, __LINE__);                                                \
    } while (0)
#else
#define launch_kernel(grid, block, smem, stream, kernel, ...)                                          \
    do {                                                                                               \
        kernel<<<(grid), (block), (smem), (stream)>>>(__VA_ARGS__);                                    \
        cuda_counted.launches++;                                                                       \
        cuda_check_launch(#kernel, __FILE__, __LINE__);                                                \
    } while (0)
#endif

// ---- sizes and indices -----------------------------------------------------------------------

static inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Blocks for a grid-stride loop over n items: enough to fill the GPU, never more than needed.
// The emulator gives at most EMU_GRID_FOR_CAP (3), so that every test size needs the loop: a
// kernel launched with grid_for that is not a grid-stride loop leaves items undone there.
static inline unsigned grid_for(int64_t n, int threads) {
#ifdef LLMC_CUDA_EMU
    const int64_t cap = EMU_GRID_FOR_CAP;
#else
    const int64_t cap = 65536 * 4;
#endif
    int64_t b = ceil_div(n > 0 ? n : 1, threads);
    return (unsigned)(b < cap ? b : cap);
}

static __device__ __forceinline__ int64_t thread_index_1d(void) {
    return (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
}
static __device__ __forceinline__ int64_t grid_stride_1d(void) { return (int64_t)gridDim.x * blockDim.x; }

static __device__ __forceinline__ float bf2f(bf16 x) { return __bfloat162float(x); }
static __device__ __forceinline__ bf16 f2bf(float x) { return __float2bfloat16(x); }  // round to nearest even

// ---- reductions ------------------------------------------------------------------------------
// All lanes of a warp (or threads of a block) must call these together, with full warps.

static __device__ __forceinline__ float warp_reduce_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
static __device__ __forceinline__ float warp_reduce_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
static __device__ __forceinline__ double warp_reduce_sum_double(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the `width` consecutive lanes of a group (width a power of two <= 32): the quads or
// octets that share one row in the attention kernels.
static __device__ __forceinline__ float group_reduce_sum(float v, int width) {
    for (int o = width / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Block-wide sums; every thread gets the result. blockDim.x is a multiple of 32 (<= 1024). The
// leading __syncthreads lets a kernel call them back to back on the same shared scratch.
static __device__ float block_reduce_sum(float v) {
    __shared__ float partial[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_reduce_sum(v);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < nwarps ? partial[lane] : 0.0f;
    return warp_reduce_sum(v);
}
static __device__ double block_reduce_sum_double(double v) {
    __shared__ double partial_d[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_reduce_sum_double(v);
    __syncthreads();
    if (lane == 0) partial_d[warp] = v;
    __syncthreads();
    v = lane < nwarps ? partial_d[lane] : 0.0;
    return warp_reduce_sum_double(v);
}

// Block-wide (max, index of the first max): the argmax of a row, ties to the lowest index, as
// the CPU twin's strict `>` scan from index 0 gives.
typedef struct { float v; int64_t i; } MaxLoc;
static __device__ __forceinline__ MaxLoc maxloc_pick(MaxLoc a, MaxLoc b) {
    if (b.v > a.v || (b.v == a.v && b.i < a.i)) return b;
    return a;
}
static __device__ MaxLoc block_reduce_maxloc(MaxLoc m) {
    __shared__ float pv[32];
    __shared__ int64_t pi[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        MaxLoc other = {__shfl_xor_sync(0xffffffffu, m.v, o), __shfl_xor_sync(0xffffffffu, m.i, o)};
        m = maxloc_pick(m, other);
    }
    __syncthreads();
    if (lane == 0) { pv[warp] = m.v; pi[warp] = m.i; }
    __syncthreads();
    MaxLoc init = {-INFINITY, INT64_MAX};
    m = lane < nwarps ? MaxLoc{pv[lane], pi[lane]} : init;
    for (int o = 16; o > 0; o >>= 1) {
        MaxLoc other = {__shfl_xor_sync(0xffffffffu, m.v, o), __shfl_xor_sync(0xffffffffu, m.i, o)};
        m = maxloc_pick(m, other);
    }
    return m;
}

// ---- column sums ---------------------------------------------------------------------------
// out_k[j] += sum over rows n of term_k(n, j), k < Term::K (at most 2): the gradients of biases
// and norm affines, sums over every token of a [N, d] array. One thread per column would leave a
// GPU nearly idle (d of 768 columns: 6 blocks) and walk N rows serially; instead a block owns 32
// columns and COL_ROW_GROUPS row groups: thread (x, y) adds rows y, y + COL_ROW_GROUPS, ... of
// column x in order, then thread y = 0 adds the groups' partial sums in order. Fixed order, no
// atomics: the result is the same on every run. Reads are coalesced (32 consecutive columns).
#define COL_ROW_GROUPS 16
template <typename Term>
__global__ void column_sums_kernel(float* out0, float* out1, Term term, int64_t N, int d) {
    __shared__ float part[2][COL_ROW_GROUPS][32];
    int64_t j = (int64_t)blockIdx.x * 32 + threadIdx.x;
    float s[2] = {0.0f, 0.0f};
    if (j < d)
        for (int64_t n = threadIdx.y; n < N; n += COL_ROW_GROUPS) term.add(n, j, s);
    for (int k = 0; k < Term::K; k++) part[k][threadIdx.y][threadIdx.x] = s[k];
    __syncthreads();
    if (threadIdx.y != 0 || j >= d) return;
    for (int k = 0; k < Term::K; k++) {
        float t = 0.0f;
        for (int g = 0; g < COL_ROW_GROUPS; g++) t += part[k][g][threadIdx.x];
        (k == 0 ? out0 : out1)[j] += t;
    }
}
// Its launch shape (the launchers call launch_kernel with these themselves; d > 0). The block is a
// macro so that scripts/ci/check_resources.py can read its size at each launch.
static dim3 column_sums_grid(int64_t d) { return dim3((unsigned)ceil_div(d, 32)); }
#define COLUMN_SUMS_BLOCK dim3(32, COL_ROW_GROUPS)

// ---- device buffers --------------------------------------------------------------------------

static void* cuda_malloc_checked(size_t bytes, const char* what) {
    void* p = NULL;
    cudaError_t err = cudaMalloc(&p, bytes ? bytes : 1);
    if (err != cudaSuccess) fail("cudaMalloc of %zu bytes for %s failed: %s", bytes, what, cudaGetErrorString(err));
    return p;
}
