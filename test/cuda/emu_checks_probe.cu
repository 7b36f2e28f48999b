// emu_checks_probe: small kernels and cuBLAS calls, each with one planted bug of a class a GPU
// shows as a crash, garbage or a compute-sanitizer report, to prove that the CPU emulator
// (test/emu/emu.h, emu_cublas.h) catches it (CPU emulator builds only; test/cuda/test_emu_checks.py
// runs every mode and checks the message):
//   emu_checks_probe ok               the same kernels and calls without the bugs: no report, and
//                                     the launch errors cudaGetLastError returns, value by value
//   oob-write, oob-write-arena        a kernel writes one element past a cudaMalloc / a plan buffer
//   oob-read                          a kernel reads one element past a cudaMalloc (NaN; under
//                                     AddressSanitizer the read itself is reported)
//   oob-copy                          a cudaMemcpy one element longer than its plan buffer
//   shared-unwritten, shared-carry    reads of __shared__ memory no thread of the block wrote
//   grid-stride                       a kernel launched with grid_for that does not loop
//   thread-order, block-order         a missing __syncthreads; a block reading another's output
//   shfl-exited, shfl-partial         full-mask shuffles with an exited lane / in a partial warp
//   launch-block, launch-grid, launch-smem   launch configurations a GPU refuses
//   blas-lda, blas-types, blas-oob, blas-align, blas-workspace   cuBLAS / cuBLASLt contract
//                                     violations
//   async-unwaited                    a kernel reads what a copy stream's cudaMemcpyAsync fills
//                                     without waiting for it (an event)
//   async-unordered                   a copy stream's cudaMemcpyAsync issued without waiting for
//                                     the default stream's kernels (it may overwrite what they read)
//   graph-sync, graph-malloc,         during a stream capture (a CUDA graph): a host synchronisation,
//   graph-legacy, graph-pageable      an allocation, a launch on the legacy stream, a copy from
//                                     pageable memory, each of which CUDA refuses
//   vec-misaligned                    a 16-byte vector load (llmc/cuda/vec.cuh) from an address
//                                     4 bytes past an aligned one (a GPU faults: misaligned address)
// Each planted bug must end the run with an error naming it (non-zero exit).
#include "../../llmc/backend.h"
#include "../../llmc/cuda/matmul.cuh"
#include "../../llmc/cuda/vec.cuh"

static float* device_floats(int64_t n, float value) {
    float* p = (float*)cuda_malloc_checked(sizeof(float) * n, "probe buffer");
    std::vector<float> h((size_t)n, value);
    CUDA_CHECK(cudaMemcpy(p, h.data(), sizeof(float) * n, cudaMemcpyHostToDevice));
    return p;
}
static std::vector<float> download(const float* p, int64_t n) {
    std::vector<float> h((size_t)n);
    CUDA_CHECK(cudaMemcpy(h.data(), p, sizeof(float) * n, cudaMemcpyDeviceToHost));
    return h;
}

// ---- kernels: `bug` = 1 plants the bug ----------------------------------------------------------

__global__ void fill_kernel(float* x, int64_t n, float v, int bug) {  // bug: writes x[n] too
    for (int64_t i = thread_index_1d(); i < n + bug; i += grid_stride_1d()) x[i] = v;
}
__global__ void sum_kernel(float* out, const float* x, int64_t n, int bug) {  // bug: reads x[n] too
    if (thread_index_1d() == 0) {
        float s = 0.0f;
        for (int64_t i = 0; i < n + bug; i++) s += x[i];
        *out = s;
    }
}
__global__ void fill_no_stride_kernel(float* x, int64_t n, int bug) {  // bug: no grid-stride loop
    int64_t i = thread_index_1d();
    if (bug) { if (i < n) x[i] = 1.0f; return; }
    for (; i < n; i += grid_stride_1d()) x[i] = 1.0f;
}
// out[b * 64 + t] = s[t ^ 1] after every thread wrote s[t]; bug: only the first 32 write
__global__ void shared_unwritten_kernel(float* out, int bug) {
    __shared__ float s[64];
    int t = threadIdx.x;
    if (!bug || t < 32) s[t] = (float)t;
    __syncthreads();
    out[blockIdx.x * 64 + t] = s[t ^ 1];
}
// bug: only block 0 writes the shared array (the others read what block 0 left)
__global__ void shared_carry_kernel(float* out, int bug) {
    __shared__ float s[64];
    int t = threadIdx.x;
    if (!bug || blockIdx.x == 0) s[t] = (float)t;
    __syncthreads();
    out[blockIdx.x * 64 + t] = s[63 - t];
}
// thread 0 publishes a value for the block; bug: no __syncthreads before the others read it
__global__ void broadcast_kernel(float* out, int bug) {
    __shared__ float v;
    if (threadIdx.x == 0) v = (float)blockIdx.x + 1.0f;
    if (!bug) __syncthreads();
    out[blockIdx.x * blockDim.x + threadIdx.x] = v;
}
// out[b] = b + 1; bug: computed from the previous block's output (blocks have no order)
__global__ void chain_kernel(float* out, int bug) {
    if (threadIdx.x != 0) return;
    int b = blockIdx.x;
    out[b] = bug ? (b == 0 ? 1.0f : out[b - 1] + 1.0f) : (float)b + 1.0f;
}
// the warp's sum over its lanes; bug "exited": lanes 16.. return first (launched with full warps)
__global__ void warp_sum_kernel(float* out, int exit_half) {
    int lane = threadIdx.x & 31;
    if (exit_half && lane >= 16) return;
    float v = warp_reduce_sum((float)lane);
    if (lane == 0) out[threadIdx.x >> 5] = v;
}
__global__ void empty_kernel(void) {}

// ---- the modes ---------------------------------------------------------------------------------

static void expect(int ok, const char* what) {
    if (!ok) fail("emu_checks_probe: %s", what);
}
static int all_equal(const std::vector<float>& h, float v) {
    for (float x : h) if (x != v) return 0;
    return 1;
}

// y[k] = the sum of the 4 floats of vector k of x + offset (a 16-byte load each).
__global__ void vec_sum_kernel(float* y, const float* x, int64_t nvec, int offset) {
    for (int64_t k = thread_index_1d(); k < nvec; k += grid_stride_1d()) {
        Vec16<float> f = load_vec16(x + offset + 4 * k);
        y[k] = f.v[0] + f.v[1] + f.v[2] + f.v[3];
    }
}
static void vec_misaligned(int bug) {
    const int64_t nvec = 100;
    float *x = device_floats(4 * nvec + 4, 1.0f), *y = device_floats(nvec, 0.0f);
    launch_kernel(grid_for(nvec, 64), 64, 0, 0, vec_sum_kernel, y, x, nvec, bug ? 1 : 0);
    expect(all_equal(download(y, nvec), 4.0f), "vec_sum_kernel");
    CUDA_CHECK(cudaFree(x));
    CUDA_CHECK(cudaFree(y));
}

static void oob_write(int bug) {
    const int64_t n = 1000;
    float* x = device_floats(n, 0.0f);
    launch_kernel(grid_for(n, 256), 256, 0, 0, fill_kernel, x, n, 1.0f, bug);
    expect(all_equal(download(x, n), 1.0f), "fill_kernel");
    CUDA_CHECK(cudaFree(x));
}

// Two buffers of the memory plan in one arena; the kernel writes one past the first.
static void oob_write_arena(int bug, int copy) {
    Backend be = backend_for_plan(1);
    MemPlan plan;
    memset(&plan, 0, sizeof(plan));
    float *first = NULL, *second = NULL;
    const int64_t n = 300;
    plan_add(&plan, MEM_SCRATCH, "probe", -1, "first", n * sizeof(float), &first);
    plan_add(&plan, MEM_SCRATCH, "probe", -1, "second", n * sizeof(float), &second);
    backend_allocate_plan(&be, &plan);
    if (copy) {
        std::vector<float> h((size_t)n + 1, 2.0f);
        CUDA_CHECK(cudaMemcpy(first, h.data(), sizeof(float) * (n + bug), cudaMemcpyHostToDevice));
    } else {
        launch_kernel(grid_for(n, 256), 256, 0, 0, fill_kernel, first, n, 1.0f, bug);
    }
    launch_kernel(grid_for(n, 256), 256, 0, 0, fill_kernel, second, n, 3.0f, 0);
    expect(all_equal(download(second, n), 3.0f), "the second buffer");
    backend_free_plan(&be, &plan);
}

static void oob_read(int bug) {
    const int64_t n = 100;
    float *x = device_floats(n, 1.0f), *out = device_floats(1, 0.0f);
    launch_kernel(1, 32, 0, 0, sum_kernel, out, x, n, bug);
    float s = download(out, 1)[0];
    if (s != (float)n)
        fail("oob-read: sum_kernel gave %g, want %g (NaN: a read past the end hit the guard zone)", s, (float)n);
    CUDA_CHECK(cudaFree(x));
    CUDA_CHECK(cudaFree(out));
}

// --offload host's pattern (llmc/memory/offload.h): pinned host memory to a device buffer on a
// non-blocking copy stream, which first waits for the default stream (its kernel used the buffer
// last), then a kernel on the default stream reads it after waiting for the copy's event.
// bug 1 drops the kernel's wait (it would read the buffer before the copy lands), bug 2 the copy
// stream's (the copy would overwrite the buffer while the earlier kernel still reads it).
enum { ASYNC_OK, ASYNC_UNWAITED, ASYNC_UNORDERED };
static void async_copy(int bug) {
    const int64_t n = 100;
    float *x = device_floats(n, 0.0f), *out = device_floats(1, 0.0f), *host = NULL;
    CUDA_CHECK(cudaMallocHost((void**)&host, sizeof(float) * n));
    for (int64_t i = 0; i < n; i++) host[i] = 1.0f;
    cudaStream_t copy;
    cudaEvent_t used, landed;
    CUDA_CHECK(cudaStreamCreateWithFlags(&copy, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&used, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&landed, cudaEventDisableTiming));
    launch_kernel(1, 32, 0, 0, sum_kernel, out, x, n, 0);  // the buffer's last reader before the copy
    CUDA_CHECK(cudaEventRecord(used, 0));
    if (bug != ASYNC_UNORDERED) CUDA_CHECK(cudaStreamWaitEvent(copy, used, 0));
    CUDA_CHECK(cudaMemcpyAsync(x, host, sizeof(float) * n, cudaMemcpyHostToDevice, copy));
    CUDA_CHECK(cudaEventRecord(landed, copy));
    if (bug != ASYNC_UNWAITED) CUDA_CHECK(cudaStreamWaitEvent(0, landed, 0));
    launch_kernel(1, 32, 0, 0, sum_kernel, out, x, n, 0);
    float s = download(out, 1)[0];
    if (s != (float)n)
        fail("async-unwaited: sum_kernel gave %g, want %g (read before its async copy landed)", s, (float)n);
    CUDA_CHECK(cudaStreamDestroy(copy));
    CUDA_CHECK(cudaEventDestroy(used));
    CUDA_CHECK(cudaEventDestroy(landed));
    CUDA_CHECK(cudaFreeHost(host));
    CUDA_CHECK(cudaFree(x));
    CUDA_CHECK(cudaFree(out));
}

static void grid_stride(int bug) {
    const int64_t n = 5000;  // more than EMU_GRID_FOR_CAP blocks of 256
    float* x = device_floats(n, 0.0f);
    launch_kernel(grid_for(n, 256), 256, 0, 0, fill_no_stride_kernel, x, n, bug);
    std::vector<float> h = download(x, n);
    for (int64_t i = 0; i < n; i++)
        if (h[i] != 1.0f)
            fail("grid-stride: fill_no_stride_kernel left element %lld of %lld unwritten (the grid does not cover it)",
                 (long long)i, (long long)n);
    CUDA_CHECK(cudaFree(x));
}

static void shared(int bug, int carry) {
    const int blocks = 3;
    float* out = device_floats(blocks * 64, 0.0f);
    if (carry) launch_kernel(blocks, 64, 0, 0, shared_carry_kernel, out, bug);
    else launch_kernel(blocks, 64, 0, 0, shared_unwritten_kernel, out, bug);
    std::vector<float> h = download(out, blocks * 64);
    for (int i = 0; i < blocks * 64; i++) {
        int t = i % 64;
        float want = carry ? (float)(63 - t) : (float)(t ^ 1);
        if (h[i] != want) fail("%s: block %d thread %d read %g from shared memory, want %g (unwritten shared memory)",
                               carry ? "shared-carry" : "shared-unwritten", i / 64, t, h[i], want);
    }
    CUDA_CHECK(cudaFree(out));
}

static void thread_order(int bug) {
    const int blocks = 3, threads = 64;
    float* out = device_floats(blocks * threads, 0.0f);
    launch_kernel(blocks, threads, 0, 0, broadcast_kernel, out, bug);
    std::vector<float> h = download(out, blocks * threads);
    for (int i = 0; i < blocks * threads; i++)
        if (h[i] != (float)(i / threads) + 1.0f)
            fail("thread-order: block %d thread %d read %g, want %g (a missing __syncthreads)", i / threads,
                 i % threads, h[i], (float)(i / threads) + 1.0f);
    CUDA_CHECK(cudaFree(out));
}

static void block_order(int bug) {
    const int blocks = 16;
    float* out = device_floats(blocks, 0.0f);
    launch_kernel(blocks, 32, 0, 0, chain_kernel, out, bug);
    std::vector<float> h = download(out, blocks);
    for (int b = 0; b < blocks; b++)
        if (h[b] != (float)b + 1.0f)
            fail("block-order: block %d wrote %g, want %g (it depends on another block's output)", b, h[b],
                 (float)b + 1.0f);
    CUDA_CHECK(cudaFree(out));
}

static void shuffles(int exited, int partial) {
    float* out = device_floats(4, 0.0f);
    launch_kernel(1, partial ? 48 : 64, 0, 0, warp_sum_kernel, out, exited);
    expect(download(out, 1)[0] == 496.0f, "warp_sum_kernel");  // 0 + 1 + ... + 31
    CUDA_CHECK(cudaFree(out));
}

static void launch_config(const char* which) {
    if (!strcmp(which, "block")) launch_kernel(1, 1025, 0, 0, empty_kernel);
    else if (!strcmp(which, "grid")) launch_kernel(dim3(1, 65536), 32, 0, 0, empty_kernel);
    else launch_kernel(1, 32, 64 << 10, 0, empty_kernel);
}

// The launch errors, value by value: refused configurations leave the error for cudaGetLastError
// (which clears it), accepted ones leave none; the shared-memory opt-in raises the limit.
static void launch_errors_ok(void) {
    std::function<void()> body = [&]() { empty_kernel(); };
    const void* fn = (const void*)empty_kernel;
    expect(cudaGetLastError() == cudaSuccess, "no error at the start");
    emu_launch(dim3(1), dim3(1024), 0, "empty_kernel", fn, body);
    expect(cudaGetLastError() == cudaSuccess, "1024 threads is a valid block");
    emu_launch(dim3(1), dim3(32, 33), 0, "empty_kernel", fn, body);
    expect(cudaPeekAtLastError() == cudaErrorInvalidConfiguration, "32 x 33 threads");
    expect(cudaGetLastError() == cudaErrorInvalidConfiguration && cudaGetLastError() == cudaSuccess,
           "the error is read once");
    emu_launch(dim3(1, 1, 1), dim3(1, 1, 65), 0, "empty_kernel", fn, body);
    expect(cudaGetLastError() == cudaErrorInvalidConfiguration, "block z > 64");
    emu_launch(dim3(0), dim3(32), 0, "empty_kernel", fn, body);
    expect(cudaGetLastError() == cudaErrorInvalidConfiguration, "an empty grid");
    emu_launch(dim3(1, 1, 65536), dim3(32), 0, "empty_kernel", fn, body);
    expect(cudaGetLastError() == cudaErrorInvalidConfiguration, "grid z > 65535");
    expect(emu_launch_error(dim3(0x7fffffffu), dim3(32), 0, fn) == cudaSuccess, "grid x up to 2^31 - 1");
    expect(emu_launch_error(dim3(1), dim3(32), 48 << 10, fn) == cudaSuccess, "48 KiB of dynamic shared memory");
    expect(emu_launch_error(dim3(1), dim3(32), (48 << 10) + 1, fn) == cudaErrorInvalidValue,
           "more than 48 KiB without the opt-in");
    expect(cudaFuncSetAttribute(empty_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 << 10) == cudaSuccess,
           "the opt-in");
    expect(emu_launch_error(dim3(1), dim3(32), 100 << 10, fn) == cudaSuccess, "100 KiB after the opt-in");
    expect(emu_launch_error(dim3(1), dim3(32), (100 << 10) + 1, fn) == cudaErrorInvalidValue, "beyond the opt-in");
    expect(cudaFuncSetAttribute(empty_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 228 << 10) ==
               cudaErrorInvalidValue,
           "an opt-in beyond the device's 227 KiB");
}

// cuBLAS calls through their API, with one contract broken per mode.
static void blas(const char* which) {
    const int M = 32, N = 48, K = 64;
    cublas_setup();
    float *A = device_floats(M * K, 1.0f), *B = device_floats(N * K, 1.0f), *C = device_floats(M * N, 0.0f);
    float one = 1.0f, zero = 0.0f;
    if (!strcmp(which, "ok")) {
        matmul_nt_cuda(C, A, B, M, N, K, 1.0f, 0, 0);  // through cuBLASLt
        expect(all_equal(download(C, M * N), (float)K), "matmul_nt_cuda");
        matmul_nn_cuda(C, A, B, M, N - 1, K, 1.0f, 0, 0);  // odd leading dimension: the cublasGemmEx fallback
        expect(download(C, 1)[0] == (float)K, "matmul_nn_cuda with N - 1 columns");
    } else if (!strcmp(which, "lda")) {  // C^T = B^T-as-stored . A: lda must be >= K rows of B^T's storage
        CUBLAS_CHECK(cublasGemmEx(g_cublas.blas, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, B, CUDA_R_32F, K - 1, A,
                                  CUDA_R_32F, K, &zero, C, CUDA_R_32F, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    } else if (!strcmp(which, "types")) {  // fp32 operands into a bf16 C
        CUBLAS_CHECK(cublasGemmEx(g_cublas.blas, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, B, CUDA_R_32F, K, A,
                                  CUDA_R_32F, K, &zero, C, CUDA_R_16BF, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    } else if (!strcmp(which, "oob")) {  // one row of A more than its buffer holds
        matmul_nt_cuda(C, A, B, M + 1, N - 16, K, 1.0f, 0, 0);
    } else {  // the raw cuBLASLt API: an algorithm for 16-byte alignment, then a misaligned B, or too little workspace
        cublasLtMatmulDesc_t desc;
        cublasLtMatrixLayout_t la, lb, lc;
        cublasOperation_t opt = CUBLAS_OP_T;
        CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &opt, sizeof(opt)));
        CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&la, CUDA_R_32F, K, N - 1, K));
        CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_32F, K, M, K));
        CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, N - 1, M, N));
        cublasLtMatmulPreference_t pref;
        CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
        CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                          &g_cublas.workspace_bytes, sizeof(g_cublas.workspace_bytes)));
        uint32_t align = 16;  // every operand: 16 bytes (C's leading dimension, 192 bytes, allows no more)
        CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align,
                                                          sizeof(align)));
        CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align,
                                                          sizeof(align)));
        CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align,
                                                          sizeof(align)));
        CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align,
                                                          sizeof(align)));
        cublasLtMatmulHeuristicResult_t heur;
        int found = 0;
        CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(g_cublas.lt, desc, la, lb, lc, lc, pref, 1, &heur, &found));
        expect(found == 1 && heur.workspaceSize > 0, "an algorithm that needs a workspace");
        int misalign = !strcmp(which, "align");
        size_t ws = misalign ? g_cublas.workspace_bytes : heur.workspaceSize - 1;
        CUBLAS_CHECK(cublasLtMatmul(g_cublas.lt, desc, &one, B + misalign, la, A, lb, &zero, C, lc, C, lc, &heur.algo,
                                    g_cublas.workspace, ws, 0));
    }
    CUDA_CHECK(cudaFree(A));
    CUDA_CHECK(cudaFree(B));
    CUDA_CHECK(cudaFree(C));
}

// A stream capture: a launch, a memset and a device copy recorded, not run; the graph replays the
// arguments of the capture (the host's value changed since is not seen), once per cudaGraphLaunch.
// `which` plants a call CUDA refuses during the capture.
static void graph(const char* which) {
    const int64_t n = 1000;
    float *x = device_floats(n, 0.0f), *y = device_floats(n, 0.0f);
    cudaStream_t st;
    CUDA_CHECK(cudaStreamCreate(&st));
    float v = 2.0f;
    CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    CUDA_CHECK(cudaMemsetAsync(y, 0, sizeof(float) * n, st));
    launch_kernel(grid_for(n, 256), 256, 0, st, fill_kernel, x, n, v, 0);
    CUDA_CHECK(cudaMemcpyAsync(y, x, sizeof(float) * n, cudaMemcpyDeviceToDevice, st));
    if (!strcmp(which, "sync")) CUDA_CHECK(cudaStreamSynchronize(st));
    if (!strcmp(which, "malloc")) cuda_malloc_checked(16, "a buffer made during the capture");
    if (!strcmp(which, "legacy")) launch_kernel(1, 32, 0, 0, fill_kernel, x, n, v, 0);
    std::vector<float> pageable((size_t)n, 5.0f);
    if (!strcmp(which, "pageable"))
        CUDA_CHECK(cudaMemcpyAsync(x, pageable.data(), sizeof(float) * n, cudaMemcpyHostToDevice, st));
    cudaGraph_t g;
    CUDA_CHECK(cudaStreamEndCapture(st, &g));
    cudaGraphExec_t exec;
    CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
    CUDA_CHECK(cudaGraphDestroy(g));
    expect(all_equal(download(y, n), 0.0f), "graph: the capture ran the work it recorded");
    v = 3.0f;  // after the capture: the graph keeps 2
    CUDA_CHECK(cudaMemset(y, 0xFF, sizeof(float) * n));
    CUDA_CHECK(cudaGraphLaunch(exec, st));
    CUDA_CHECK(cudaStreamSynchronize(st));
    expect(all_equal(download(y, n), 2.0f), "graph: the replay did not give the captured argument");
    CUDA_CHECK(cudaGraphExecDestroy(exec));
    CUDA_CHECK(cudaStreamDestroy(st));
    CUDA_CHECK(cudaFree(x));
    CUDA_CHECK(cudaFree(y));
}

int main(int argc, char** argv) {
    const char* mode = argc > 1 ? argv[1] : "ok";
    int ok = !strcmp(mode, "ok");
    if (ok) {
        oob_write(0);
        oob_write_arena(0, 0);
        oob_write_arena(0, 1);
        oob_read(0);
        async_copy(ASYNC_OK);
        grid_stride(0);
        shared(0, 0);
        shared(0, 1);
        for (int i = 0; i < 3; i++) thread_order(0);
        block_order(0);
        shuffles(0, 0);
        launch_errors_ok();
        blas("ok");
        graph("ok");
        vec_misaligned(0);
        printf("emu_checks_probe: ok: every kernel and cuBLAS call without its planted bug passes\n");
        return 0;
    }
    if (!strcmp(mode, "oob-write")) oob_write(1);
    else if (!strcmp(mode, "oob-write-arena")) oob_write_arena(1, 0);
    else if (!strcmp(mode, "oob-copy")) oob_write_arena(1, 1);
    else if (!strcmp(mode, "oob-read")) oob_read(1);
    else if (!strcmp(mode, "grid-stride")) grid_stride(1);
    else if (!strcmp(mode, "async-unwaited")) async_copy(ASYNC_UNWAITED);
    else if (!strcmp(mode, "async-unordered")) async_copy(ASYNC_UNORDERED);
    else if (!strcmp(mode, "shared-unwritten")) shared(1, 0);
    else if (!strcmp(mode, "shared-carry")) shared(1, 1);
    else if (!strcmp(mode, "thread-order")) thread_order(1);
    else if (!strcmp(mode, "block-order")) block_order(1);
    else if (!strcmp(mode, "shfl-exited")) shuffles(1, 0);
    else if (!strcmp(mode, "shfl-partial")) shuffles(0, 1);
    else if (!strcmp(mode, "vec-misaligned")) vec_misaligned(1);
    else if (!strncmp(mode, "launch-", 7)) launch_config(mode + 7);
    else if (!strncmp(mode, "blas-", 5)) blas(mode + 5);
    else if (!strncmp(mode, "graph-", 6)) graph(mode + 6);
    else fail("emu_checks_probe: unknown mode '%s'", mode);
    printf("emu_checks_probe: %s: the planted bug went unnoticed\n", mode);
    return 0;
}
