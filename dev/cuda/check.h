// dev/cuda/check.h: the harness shared by the dev/cuda programs, each of which checks one kernel
// family of llmc/cuda against its CPU twin in llmc/cpu and times it:
//   - inputs are random at odd sizes, rounded to bf16 on the host first, so the CPU twin (fp32)
//     and the CUDA kernel (bf16) see exactly the same values;
//   - every write-only output is poisoned (all bytes 0xFF: NaN in bf16 and fp32) before each run,
//     so an element the kernel forgets to write fails; outputs that a kernel accumulates into
//     start from the same known random values on both sides;
//   - check_close: relative L2 error ||got - want|| / ||want|| under a tolerance (1e-2 for bf16
//     outputs, tighter for fp32), and any NaN/Inf in `got` fails, whatever the error;
//   - check_equal_bytes / check_equal_f32: bit-exact comparisons (2-bit codes, the approximate
//     backward, which must agree exactly);
//   - time_kernel: CUDA-event timing after a warm-up; report_bandwidth / report_flops print the
//     figure against the H200's measured ceilings (copy ~4.3 TB/s, dense bf16 matmul ~790 TFLOP/s);
//   - finish(): prints "N passed, M failed" and returns the exit status.
// Environment: LLMC_DEV_NO_TIMING=1 skips the timing (for compute-sanitizer runs); LLMC_CUDA_SYNC=1
// makes every launch synchronous, so an asynchronous fault names the launch that caused it.
// Built with -DLLMC_CUDA_EMU (make cuda-emu-check) the same programs run on the CPU emulator
// (test/emu/emu.h) at their correctness sizes; timing is skipped there.
#pragma once
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <functional>
#include "../../llmc/cuda/common.cuh"
#include "../../llmc/rng.h"

// Which form of an op a check runs: the production launcher of llmc/cuda (KERNELS_VEC: its 16-byte
// path where the operands are aligned, its fallback where not) or the reference version kept here
// in dev/cuda (KERNELS_SCALAR: *_scalar.cuh, the scalar kernel alone), so each is held to the CPU
// twin and the two to each other.
typedef enum { KERNELS_VEC, KERNELS_SCALAR } KernelChoice;

#define H200_COPY_GBPS 4300.0     // measured device-to-device copy bandwidth, GB/s
#define H200_BF16_TFLOPS 790.0    // measured dense bf16 matmul, TFLOP/s

static int g_pass = 0, g_fail = 0;
static cudaStream_t g_stream = 0;  // the default stream

static void record(int ok, const char* what, const char* detail) {
    if (ok) g_pass++;
    else g_fail++;
    printf("%s  %-58s %s\n", ok ? "PASS" : "FAIL", what, detail);
    fflush(stdout);
}

// The program's title line and the device it runs on; stops with one clear line when there is
// no usable GPU (rather than failing at the first allocation).
static void check_begin(const char* title) {
    printf("%s\n", title);
#ifdef LLMC_CUDA_EMU
    printf(
        "device: the CPU emulator of test/emu/emu.h (kernel logic, and the cuBLAS calls checked against their "
        "contracts)\n");
#else
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0)
        fail("no usable CUDA device (%s)", err != cudaSuccess ? cudaGetErrorString(err) : "none found");
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    int rt = 0, drv = 0;
    CUDA_CHECK(cudaRuntimeGetVersion(&rt));
    CUDA_CHECK(cudaDriverGetVersion(&drv));
    printf("device: %s, sm_%d%d, %d SMs, %.1f GiB; runtime %d, driver %d\n", prop.name, prop.major, prop.minor,
           prop.multiProcessorCount, prop.totalGlobalMem / 1073741824.0, rt, drv);
#endif
    fflush(stdout);
}

static int finish(void) {
    printf("%d passed, %d failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}

// ---- host data -------------------------------------------------------------------------------

static float bf16_round(float x) { return __bfloat162float(__float2bfloat16(x)); }

// n values ~ N(0, scale^2), rounded to bf16 when `round` (inputs of bf16 kernels).
static float* host_randn(int64_t n, Rng* r, float scale, int round) {
    float* x = (float*)xmalloc(sizeof(float) * (n ? n : 1));
    for (int64_t i = 0; i < n; i++) x[i] = round ? bf16_round(scale * rng_normal(r)) : scale * rng_normal(r);
    return x;
}
static float* host_copy(const float* x, int64_t n) {
    float* y = (float*)xmalloc(sizeof(float) * (n ? n : 1));
    memcpy(y, x, sizeof(float) * n);
    return y;
}
static void host_round_bf16(float* x, int64_t n) { for (int64_t i = 0; i < n; i++) x[i] = bf16_round(x[i]); }

// ---- device data -----------------------------------------------------------------------------

static void* dev_alloc(size_t bytes) { return cuda_malloc_checked(bytes, "a dev/cuda test buffer"); }
static void dev_poison(void* d, size_t bytes) { CUDA_CHECK(cudaMemset(d, 0xFF, bytes)); }

static bf16* upload_bf16(const float* h, int64_t n) {
    bf16* tmp = (bf16*)xmalloc(sizeof(bf16) * (n ? n : 1));
    for (int64_t i = 0; i < n; i++) tmp[i] = __float2bfloat16(h[i]);
    bf16* d = (bf16*)dev_alloc(sizeof(bf16) * n);
    CUDA_CHECK(cudaMemcpy(d, tmp, sizeof(bf16) * n, cudaMemcpyHostToDevice));
    free(tmp);
    return d;
}
static void upload_bf16_to(bf16* d, const float* h, int64_t n) {
    bf16* tmp = (bf16*)xmalloc(sizeof(bf16) * (n ? n : 1));
    for (int64_t i = 0; i < n; i++) tmp[i] = __float2bfloat16(h[i]);
    CUDA_CHECK(cudaMemcpy(d, tmp, sizeof(bf16) * n, cudaMemcpyHostToDevice));
    free(tmp);
}
static void* upload(const void* h, size_t bytes) {
    void* d = dev_alloc(bytes);
    CUDA_CHECK(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice));
    return d;
}
static float* download_bf16(const bf16* d, int64_t n) {
    bf16* tmp = (bf16*)xmalloc(sizeof(bf16) * (n ? n : 1));
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(tmp, d, sizeof(bf16) * n, cudaMemcpyDeviceToHost));
    float* h = (float*)xmalloc(sizeof(float) * (n ? n : 1));
    for (int64_t i = 0; i < n; i++) h[i] = __bfloat162float(tmp[i]);
    free(tmp);
    return h;
}
static float* download_f32(const float* d, int64_t n) {
    float* h = (float*)xmalloc(sizeof(float) * (n ? n : 1));
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(h, d, sizeof(float) * n, cudaMemcpyDeviceToHost));
    return h;
}
static uint8_t* download_bytes(const void* d, size_t n) {
    uint8_t* h = (uint8_t*)xmalloc(n ? n : 1);
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(h, d, n, cudaMemcpyDeviceToHost));
    return h;
}

// ---- comparisons -----------------------------------------------------------------------------

// Relative L2 error of got against want; NaN/Inf anywhere in got fails.
static int check_close(const char* what, const float* got, const float* want, int64_t n, double tol) {
    double num = 0.0, den = 0.0;
    int64_t bad = -1;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(got[i])) { bad = i; break; }
        double e = (double)got[i] - want[i];
        num += e * e;
        den += (double)want[i] * want[i];
    }
    char detail[160];
    int ok;
    if (bad >= 0) {
        snprintf(detail, sizeof(detail), "(non-finite output at %lld of %lld)", (long long)bad, (long long)n);
        ok = 0;
    } else {
        double rel = den > 0 ? sqrt(num / den) : sqrt(num);
        ok = rel < tol;
        snprintf(detail, sizeof(detail), "(rel L2 %.2e, tol %.0e)", rel, tol);
    }
    record(ok, what, detail);
    return ok;
}

static int check_equal_bytes(const char* what, const uint8_t* got, const uint8_t* want, int64_t n) {
    int64_t diff = 0, first = -1;
    for (int64_t i = 0; i < n; i++)
        if (got[i] != want[i]) { diff++; if (first < 0) first = i; }
    char detail[160];
    if (diff)
        snprintf(detail, sizeof(detail), "(%lld of %lld bytes differ, first at %lld)", (long long)diff, (long long)n,
                 (long long)first);
    else snprintf(detail, sizeof(detail), "(%lld bytes identical)", (long long)n);
    record(diff == 0, what, detail);
    return diff == 0;
}

// Bit-exact equality of two float arrays (NaN never equal).
static int check_equal_f32(const char* what, const float* got, const float* want, int64_t n) {
    int64_t diff = 0, first = -1;
    for (int64_t i = 0; i < n; i++)
        if (!(got[i] == want[i])) { diff++; if (first < 0) first = i; }
    char detail[200];
    if (diff)
        snprintf(detail, sizeof(detail), "(%lld of %lld differ, first at %lld: %.9g vs %.9g)", (long long)diff,
                 (long long)n, (long long)first, got[first], want[first]);
    else snprintf(detail, sizeof(detail), "(%lld values bit-identical)", (long long)n);
    record(diff == 0, what, detail);
    return diff == 0;
}

static int check_true(const char* what, int ok, const char* detail) {
    record(ok, what, detail);
    return ok;
}

// ---- timing ----------------------------------------------------------------------------------

// Timing is skipped on the emulator, and when LLMC_DEV_NO_TIMING=1 (runs under compute-sanitizer).
#ifdef LLMC_CUDA_EMU
static const int g_timing = 0;
static double time_kernel(const std::function<void()>& fn, int reps) { (void)fn; (void)reps; return -1.0; }
#else
static const int g_timing = !(getenv("LLMC_DEV_NO_TIMING") && getenv("LLMC_DEV_NO_TIMING")[0] == '1');
// Milliseconds per call of fn, averaged over reps calls after two warm-up calls.
static double time_kernel(const std::function<void()>& fn, int reps) {
    fn();
    fn();
    cudaEvent_t a, b;
    CUDA_CHECK(cudaEventCreate(&a));
    CUDA_CHECK(cudaEventCreate(&b));
    CUDA_CHECK(cudaEventRecord(a, g_stream));
    for (int i = 0; i < reps; i++) fn();
    CUDA_CHECK(cudaEventRecord(b, g_stream));
    CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0.0f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    CUDA_CHECK(cudaEventDestroy(a));
    CUDA_CHECK(cudaEventDestroy(b));
    return ms / reps;
}
#endif

// "TIME" lines are what scripts/ci/gpu_check.sh collects into its results table.
static void report_bandwidth(const char* what, double bytes, double ms) {
    if (ms <= 0) return;
    double gbps = bytes / (ms * 1e-3) / 1e9;
    printf("TIME  %-50s %9.3f ms %8.0f GB/s  %5.1f%% of copy\n", what, ms, gbps, 100.0 * gbps / H200_COPY_GBPS);
    fflush(stdout);
}
static void report_flops(const char* what, double flops, double ms) {
    if (ms <= 0) return;
    double tf = flops / (ms * 1e-3) / 1e12;
    printf("TIME  %-50s %9.3f ms %8.1f TFLOP/s %5.1f%% of bf16 mm\n", what, ms, tf, 100.0 * tf / H200_BF16_TFLOPS);
    fflush(stdout);
}
