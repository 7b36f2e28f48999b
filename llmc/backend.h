// backend.h: where a model runs: the CPU (fp32 everywhere) or one CUDA GPU (bf16 frozen weights
// and activations, fp32 statistics, LoRA masters, gradients and AdamW state). Defines Backend
// (the choice, the element sizes the memory plan uses, the CUDA stream), --device resolution, the
// plan's arenas on the backend (calloc or cudaMalloc), host<->backend copies, the batch's
// double-buffered asynchronous upload (BatchStaging) and the measured memory line printed beside
// the plan.
//
// The CUDA backend is compiled in when the translation unit is built by nvcc (or on the CPU
// emulator of test/emu/emu.h with -DLLMC_CUDA_EMU, which is how CI runs it); a g++ build is
// CPU-only and says so when asked for --device cuda.
#pragma once
#include "common.h"
#include "settings.h"
#include "memory/plan.h"
#include "formats/safetensors.h"
#if defined(__CUDACC__) || defined(LLMC_CUDA_EMU)
#define LLMC_HAVE_CUDA 1
#include "cuda/common.cuh"
#include "cuda/misc.cuh"
#endif

typedef struct {
    int cuda;              // 1: the CUDA backend
    int wbytes;            // bytes per frozen-weight element (4 CPU, 2 CUDA)
    int abytes;            // bytes per activation (and activation-gradient) element
    const char* layout;    // "CPU fp32" or "CUDA bf16", for the logs
    int device;            // the GPU's ordinal (CUDA)
    struct Profiler* prof; // --profile: the ops time themselves into it (llmc/train/profile.h); NULL: off
#ifdef LLMC_HAVE_CUDA
    cudaStream_t stream;
    size_t used_before;    // device bytes already in use before our arenas (context, other jobs)
#endif
} Backend;

static int backend_cuda_devices(void) {
#ifdef LLMC_HAVE_CUDA
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) { (void)cudaGetLastError(); return 0; }
    return n;
#else
    return 0;
#endif
}

// --device cpu|cuda|auto. auto takes the GPU when this binary has the CUDA backend and a GPU is
// visible. Each rank of an mpirun job takes GPU local_rank (one process per GPU).
static void backend_init(Backend* be, const char* flag, int local_rank) {
    memset(be, 0, sizeof(*be));
    int want_cuda = strcmp(flag, "cuda") == 0;
#ifndef LLMC_HAVE_CUDA
    if (want_cuda)
        fail(
            "flag --device cuda: this binary was built without the CUDA backend (no nvcc at build time); rebuild with "
            "the CUDA toolkit or use --device cpu");
#else
    int n = strcmp(flag, "cpu") == 0 ? 0 : backend_cuda_devices();
    if (want_cuda && n == 0) fail("flag --device cuda: no CUDA GPU is visible (cudaGetDeviceCount found none)");
    if (n > 0) {
        if (local_rank >= n)
            fail("rank with local rank %d has no GPU of its own (%d visible); launch at most %d ranks per node",
                 local_rank, n, n);
        be->cuda = 1;
        be->device = local_rank;
        CUDA_CHECK(cudaSetDevice(be->device));
        // One stream keeps every op in program order. Our own, not the legacy default stream: the
        // legacy stream serialises with every other blocking stream and cannot be captured in a
        // CUDA graph. Created blocking, so that the few synchronous calls outside the step
        // (cudaMemcpy of weights at load, cudaMemset of a fresh arena) stay ordered with it.
        CUDA_CHECK(cudaStreamCreate(&be->stream));
        size_t fr, tot;
        CUDA_CHECK(cudaMemGetInfo(&fr, &tot));
        be->used_before = tot - fr;
    }
#endif
    be->wbytes = be->abytes = be->cuda ? 2 : 4;
    be->layout = be->cuda ? "CUDA bf16" : "CPU fp32";
}

// The GPU's dense bf16 peak in FLOP/s, MFU's denominator: LLMC_PEAK_TFLOPS when set, else by
// compute capability (sm_90: H100/H200 SXM, 989 TFLOP/s; sm_80: A100, 312; sm_100: B200, 2250;
// the PCIe and NVL parts are lower: set LLMC_PEAK_TFLOPS), else 0 (unknown: no MFU in the log).
static double backend_peak_flops(const Backend* be) {
    if (setting_is_set(SETTING_PEAK_TFLOPS)) return setting_number(SETTING_PEAK_TFLOPS) * 1e12;
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) {
        cudaDeviceProp p;
        CUDA_CHECK(cudaGetDeviceProperties(&p, be->device));
        int cc = p.major * 10 + p.minor;
        return cc == 90 ? 989e12 : cc == 80 ? 312e12 : cc == 100 ? 2250e12 : 0.0;
    }
#endif
    (void)be;
    return 0.0;
}

// One line about the GPU for the log: its name, compute capability and memory.
static void backend_describe(const Backend* be, char* buf, size_t n) {
    snprintf(buf, n, "CPU");
#ifdef LLMC_HAVE_CUDA
    if (!be->cuda) return;
    cudaDeviceProp p;
    CUDA_CHECK(cudaGetDeviceProperties(&p, be->device));
    snprintf(buf, n, "%.160s (sm_%d%d, %.1f GiB)", p.name, p.major, p.minor, p.totalGlobalMem / 1073741824.0);
#else
    (void)be;
#endif
}

// The start-up line about the GPU (rank 0, CUDA only); collectives: what sums gradients across
// ranks, or NULL for a single rank.
static void backend_print_device(const Backend* be, const char* collectives) {
    if (!be->cuda) return;
    char gpu[192];
    backend_describe(be, gpu, sizeof(gpu));
    printf("device: %s%s%s\n", gpu, collectives ? "; gradients across ranks: " : "", collectives ? collectives : "");
}

// A backend described but not started: what --dry-run plans for (the CUDA layout can be planned
// by a build without CUDA).
static Backend backend_for_plan(int cuda) {
    Backend be;
    memset(&be, 0, sizeof(be));
    be.cuda = cuda;
    be.wbytes = be.abytes = cuda ? 2 : 4;
    be.layout = cuda ? "CUDA bf16" : "CPU fp32";
    return be;
}

// Allocates the plan's arenas (zeroed) on the backend and writes every buffer's address.
static void backend_allocate_plan(const Backend* be, MemPlan* p) {
    if (!be->cuda) { plan_allocate_host(p); return; }
#ifdef LLMC_HAVE_CUDA
    for (int c = 0; c < MEM_CATS; c++) {
        p->arena[c] = NULL;
        if (!p->cat_bytes[c]) continue;
        void* a = NULL;
        if (c == MEM_HOST) {  // page-locked, so the copy stream's transfers run asynchronously at full bus speed
            if (cudaMallocHost(&a, p->cat_bytes[c]) != cudaSuccess)
                fail("cannot allocate %.1f MiB of pinned host memory for --offload host", p->cat_bytes[c] / 1048576.0);
            memset(a, 0, p->cat_bytes[c]);
            p->arena[c] = (uint8_t*)a;
            continue;
        }
        if (cudaMalloc(&a, p->cat_bytes[c]) != cudaSuccess)
            fail(
                "cannot allocate %.1f MiB of GPU memory for %s (try a smaller --batch/--seq, --mode lowmem or --mode "
                "ckpt)",
                p->cat_bytes[c] / 1048576.0, mem_category_name[c]);
        CUDA_CHECK(cudaMemset(a, 0, p->cat_bytes[c]));
        p->arena[c] = (uint8_t*)a;
    }
    for (int i = 0; i < p->count; i++)
        if (p->bufs[i].bind) *p->bufs[i].bind = p->arena[p->bufs[i].cat] + p->bufs[i].offset;
#ifdef LLMC_CUDA_EMU
    for (int i = 0; i < p->count; i++) {  // from each buffer's end to the next one: the emulator's guard zone
        const PlanBuffer* b = &p->bufs[i];
        if (b->cat == MEM_HOST) continue;  // host memory: no kernel touches it
        emu_guard_add(p->arena[b->cat] + b->offset + b->bytes, round_up(b->bytes, PLAN_ALIGN) + PLAN_GUARD - b->bytes,
                      b->name);
    }
#endif
#endif
}

static void backend_free_plan(const Backend* be, MemPlan* p) {
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) {
        for (int c = 0; c < MEM_CATS; c++)
            if (p->arena[c]) CUDA_CHECK(c == MEM_HOST ? cudaFreeHost(p->arena[c]) : cudaFree(p->arena[c]));
        memset(p->arena, 0, sizeof(p->arena));
    }
#else
    (void)be;
#endif
    plan_free(p);
}

// Host staging for what crosses to the GPU every step (the batch): page-locked on CUDA, so the
// copies run at full bus speed and need no bounce buffer; plain zeroed memory otherwise.
static void* backend_alloc_staging(const Backend* be, size_t bytes) {
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) {
        void* p = NULL;
        if (cudaMallocHost(&p, bytes ? bytes : 1) != cudaSuccess)
            fail("cannot allocate %.1f MiB of pinned host memory for the batch", bytes / 1048576.0);
        memset(p, 0, bytes);
        return p;
    }
#endif
    (void)be;
    return xcalloc(bytes ? bytes : 1, 1);
}
static void backend_free_staging(const Backend* be, void* p) {
    if (!p) return;
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) { CUDA_CHECK(cudaFreeHost(p)); return; }
#endif
    (void)be;
    free(p);
}

// The host side of batch buffer `dev` (what the loader fills): on the CPU the buffer itself, on
// CUDA staging of `bytes`, uploaded each step (backend_upload is a no-op when the two are one).
static void* backend_host_side(const Backend* be, void* dev, size_t bytes) {
    return be->cuda ? backend_alloc_staging(be, bytes) : dev;
}
static void backend_free_host_side(const Backend* be, void* host) {
    if (be->cuda) backend_free_staging(be, host);
}

// Byte copies between the host and the backend (plain memcpy on the CPU; no-ops when equal).
static void backend_upload(const Backend* be, void* dst, const void* src, size_t bytes) {
    if (!bytes || dst == src) return;
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) { CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice)); return; }
#endif
    (void)be;
    memcpy(dst, src, bytes);
}
static void backend_download(const Backend* be, void* dst, const void* src, size_t bytes) {
    if (!bytes || dst == src) return;
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) { CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost)); return; }
#endif
    (void)be;
    memcpy(dst, src, bytes);
}

// ---- the batch's upload ---------------------------------------------------------------------
// On CUDA the batch goes up with cudaMemcpyAsync on the backend's stream, from pinned staging, so
// the host never waits for it. The host then runs ahead of the device: while micro-batch k's copy
// may still be queued, the host already prepares micro-batch k + 1, so each micro-batch packs into
// its own staging set, and a set is rewritten only once the event recorded after its last copy
// has completed (cudaEventQuery; cudaEventSynchronize only when it has not: with at least as many
// sets as micro-batches per step, never, since the step's one readback waits for the stream).
// LLMC_FAULT_STAGING_REWRITE=1 plants the bug the emulator must catch: every micro-batch reuses
// one set without waiting (test/cuda/test_emu_checks.py). On the CPU the buffers are the device
// buffers themselves and nothing is staged.
#define STAGING_MAX_SETS 8
typedef struct {
    const Backend* be;
    uint8_t* set[STAGING_MAX_SETS];  // pinned, `bytes` each
    int sets, cur;                   // cur: the set being filled (-1 before the first batch)
    size_t bytes, used;              // capacity of a set; bytes packed into the current one
    int async;                       // 0: synchronous uploads (the CPU)
    int planted_rewrite;             // LLMC_FAULT_STAGING_REWRITE=1 (test builds)
#ifdef LLMC_HAVE_CUDA
    cudaEvent_t uploaded[STAGING_MAX_SETS];
    int pending[STAGING_MAX_SETS];   // an upload from the set was recorded
#endif
} BatchStaging;

static size_t staging_align(size_t n) { return (n + 255) / 256 * 256; }

// `bytes`: what one micro-batch uploads at most (the sum of its buffers); `micro_batches`: per
// optimizer step (--grad-accum), which sizes the sets (at least two: double buffered).
static void staging_init(BatchStaging* s, const Backend* be, size_t bytes, int micro_batches) {
    memset(s, 0, sizeof(*s));
    s->be = be;
    s->cur = -1;
    s->async = be->cuda;
    if (!s->async) return;
#ifdef LLMC_FAULTS
    s->planted_rewrite = setting_on(SETTING_FAULT_STAGING_REWRITE);
#endif
    s->sets = micro_batches < 2 ? 2 : micro_batches > STAGING_MAX_SETS ? STAGING_MAX_SETS : micro_batches;
    s->bytes = bytes;
#ifdef LLMC_HAVE_CUDA
    for (int i = 0; i < s->sets; i++) {
        s->set[i] = (uint8_t*)backend_alloc_staging(be, bytes);
        CUDA_CHECK(cudaEventCreateWithFlags(&s->uploaded[i], cudaEventDisableTiming));
    }
#endif
}

static void staging_free(BatchStaging* s) {
#ifdef LLMC_HAVE_CUDA
    if (s->async) CUDA_CHECK(cudaStreamSynchronize(s->be->stream));
    for (int i = 0; i < s->sets; i++) {
        backend_free_staging(s->be, s->set[i]);
        CUDA_CHECK(cudaEventDestroy(s->uploaded[i]));
    }
#endif
    s->sets = 0;
}

// Before a micro-batch's uploads: the next set, once the device has finished reading it.
static void staging_begin(BatchStaging* s) {
    if (!s->async) return;
    s->used = 0;
    if (s->planted_rewrite && s->cur >= 0) return;  // the planted bug: same set, no wait
    s->cur = (s->cur + 1) % s->sets;
#ifdef LLMC_HAVE_CUDA
    int i = s->cur;
    if (s->pending[i] && cudaEventQuery(s->uploaded[i]) != cudaSuccess) {
        (void)cudaGetLastError();  // cudaErrorNotReady is not an error to keep
        CUDA_CHECK(cudaEventSynchronize(s->uploaded[i]));
    }
    s->pending[i] = 0;
#endif
}

// One buffer of the micro-batch: `bytes` from host `src` to device `dst`.
static void staging_upload(BatchStaging* s, void* dst, const void* src, size_t bytes) {
    if (!s->async) { backend_upload(s->be, dst, src, bytes); return; }
    if (!bytes) return;
    if (s->cur < 0 || s->used + bytes > s->bytes)
        fail("internal: batch staging overflow (%zu + %zu of %zu bytes, or no staging_begin)", s->used, bytes,
             s->bytes);
#ifdef LLMC_HAVE_CUDA
    uint8_t* at = s->set[s->cur] + s->used;
    memcpy(at, src, bytes);
    CUDA_CHECK(cudaMemcpyAsync(dst, at, bytes, cudaMemcpyHostToDevice, s->be->stream));
#endif
    s->used += staging_align(bytes);
}

// After a micro-batch's uploads: the event that says when its set may be rewritten.
static void staging_end(BatchStaging* s) {
    if (!s->async) return;
#ifdef LLMC_HAVE_CUDA
    CUDA_CHECK(cudaEventRecord(s->uploaded[s->cur], s->be->stream));
    s->pending[s->cur] = 1;
#endif
}

// n fp32 host values into a weight buffer of the backend's weight type (bf16 on CUDA, converted
// in slices so the host never holds a second copy of a large tensor).
static void backend_upload_weights(const Backend* be, void* dst, const float* src, int64_t n) {
    if (!be->cuda) { backend_upload(be, dst, src, sizeof(float) * n); return; }
#ifdef LLMC_HAVE_CUDA
    const int64_t slice = 1 << 24, part = 1 << 16;  // converted by all threads, a part each
    uint16_t* tmp = (uint16_t*)xmalloc(sizeof(uint16_t) * slice);
    for (int64_t off = 0; off < n; off += slice) {
        int64_t c = n - off < slice ? n - off : slice;
#pragma omp parallel for schedule(static)
        for (int64_t p = 0; p < c; p += part)
            f32_to_dtype(tmp + p, src + off + p, c - p < part ? c - p : part, ST_BF16);
        CUDA_CHECK(cudaMemcpy((uint16_t*)dst + off, tmp, sizeof(uint16_t) * c, cudaMemcpyHostToDevice));
    }
    free(tmp);
#endif
}

// n fp32 values into a weight: a frozen one to the backend (backend_upload_weights); a trained
// one (h_mirror non-NULL, --full) into the trainable arena's host mirror, which
// trainable_to_device sends on with its shadow once everything is loaded.
static void backend_set_weight(const Backend* be, void* dev, float* h_mirror, const float* src, int64_t n) {
    if (h_mirror) memcpy(h_mirror, src, sizeof(float) * n);
    else backend_upload_weights(be, dev, src, n);
}

static void backend_sync(const Backend* be) {
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) CUDA_CHECK(cudaStreamSynchronize(be->stream));
#else
    (void)be;
#endif
}

// Memory actually in use by this process's run, in bytes: on CUDA the device memory taken since
// backend_init (the plan's arenas, cuBLAS's workspace among them, plus what no plan can name: the
// code of kernels loaded on first use, library handles, cudaMalloc's page rounding); on the CPU
// the peak resident set.
static double backend_measured_mib(const Backend* be) {
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) {
        size_t fr, tot;
        CUDA_CHECK(cudaMemGetInfo(&fr, &tot));
        return ((double)(tot - fr) - (double)be->used_before) / 1048576.0;
    }
#endif
    (void)be;
    return peak_rss_mib();
}

// The line printed after training: the plan beside what was measured.
static void backend_print_memory(const Backend* be, const MemPlan* plan) {
    // on the CPU the host arena is part of the resident set that is measured
    size_t planned = plan_total(plan) + (be->cuda ? 0 : plan_host_bytes(plan));
    printf("memory: planned %.2f MiB (saved activations %.2f MiB), ", mib(planned), mib(plan_saved_bytes(plan)));
    if (plan->percall_bytes) printf("per-call scratch up to %.2f MiB, ", mib(plan->percall_bytes));
    const char* what = be->cuda ? "device memory in use (cudaMemGetInfo, beyond the CUDA context)" : "peak RSS";
    printf("measured %s %.2f MiB\n", what, backend_measured_mib(be));
}
