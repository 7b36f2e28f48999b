// cuda/emu.h: a CPU emulation of the CUDA execution model, just enough to run this backend's
// kernels under a plain C++ compiler (build with -DLLMC_CUDA_EMU; `make cuda-emu-check`). It
// exists because development and CI machines have no GPU: it runs the very kernel source of
// llmc/cuda/*.cuh against the CPU twins, so indexing, masking, ragged tails, reductions and
// barrier placement are checked on every machine, and a GPU session only has to confirm.
//
// Model: blocks run one after another; each CUDA thread of a block is a fiber with its own stack
// (started with makecontext, switched with _setjmp/_longjmp, which skip the signal-mask system
// call of swapcontext). A fiber runs until it reaches __syncthreads() or a warp collective (shuffles,
// __syncwarp), which are barriers: the block barrier opens when every live thread of the block is
// waiting on it, a warp barrier when every live thread of that warp is. Threads of a warp waiting
// at different barriers (a shuffle in divergent code) are reported as a deadlock. Launches
// alternate forward and reverse fiber order, so a missing __syncthreads between a shared-memory
// write and another thread's read shows up as a wrong result. __shared__ variables are function
// statics: shared by the threads of a block, and blocks never run concurrently.
// "Device" memory is host memory and kernels and copies run when issued. Streams other than the
// default one may hold deferred work (the emulated NCCL calls of emu_nccl.h): it runs only when
// stream order forces it, so a missing cudaStreamWaitEvent shows up as stale data; see "streams"
// below. The runtime functions are defined here, so include it in one translation unit only.
// It says nothing about performance, memory coherence, register limits or what nvcc makes of the
// code: only a GPU does.
#pragma once
#ifndef LLMC_CUDA_EMU
#error "llmc/cuda/emu.h is only for -DLLMC_CUDA_EMU builds"
#endif
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <setjmp.h>
#include <ucontext.h>
#include <deque>
#include <functional>
#include <map>
#include <set>

// Execution-space keywords become nothing (host_defines.h leaves them alone once defined).
#define __global__
#define __device__
#define __host__
#include <cuda_bf16.h>
#undef __shared__
#define __shared__ static
#undef __forceinline__
#define __forceinline__ inline
#undef __launch_bounds__
#define __launch_bounds__(...)

// ---- fibers and the per-block scheduler -----------------------------------------------------

enum { EMU_RUN, EMU_WAIT_BLOCK, EMU_WAIT_WARP, EMU_DONE };

typedef struct {
    ucontext_t ctx;        // only to start the fiber
    jmp_buf jb;            // where it continues
    int started;
    uint3 tid;
    int linear;            // threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)
    int state;
} EmuThread;

typedef struct {
    dim3 grid, block;
    uint3 bid;
    EmuThread* threads;
    int nthreads;
    char* stacks;
    size_t stack_size;
    int stacks_for;        // how many fibers `stacks` has room for (kept across launches)
    jmp_buf sched;
    EmuThread* cur;
    const std::function<void()>* body;
    const char* kernel;
    unsigned long long launches;
    unsigned char slots[32][32][16];  // warp shuffle exchange: [warp][lane][bytes]
} EmuState;

static EmuState emu_state;

#define threadIdx (emu_state.cur->tid)
#define blockIdx (emu_state.bid)
#define blockDim (emu_state.block)
#define gridDim (emu_state.grid)

static void emu_trampoline(void) {
    (*emu_state.body)();
    emu_state.cur->state = EMU_DONE;
    _longjmp(emu_state.sched, 1);
}

static void emu_wait(int state) {
    EmuThread* t = emu_state.cur;
    t->state = state;
    if (!_setjmp(t->jb)) _longjmp(emu_state.sched, 1);
}

// Runs fiber t until it waits at a barrier or finishes.
static void emu_resume(EmuThread* t) {
    emu_state.cur = t;
    if (_setjmp(emu_state.sched)) return;
    if (!t->started) {
        t->started = 1;
        ucontext_t here;
        swapcontext(&here, &t->ctx);  // never returns here: the fiber jumps back to sched
    }
    _longjmp(t->jb, 1);
}

static void __syncthreads(void) { emu_wait(EMU_WAIT_BLOCK); }
static void __syncwarp(unsigned mask = 0xffffffffu) { (void)mask; emu_wait(EMU_WAIT_WARP); }

// Runs every fiber of the current block to completion, opening barriers as they fill.
static void emu_run_block(void) {
    EmuState* s = &emu_state;
    int n = s->nthreads, reverse = (int)(s->launches & 1);
    for (int i = 0; i < n; i++) {
        EmuThread* t = &s->threads[i];
        getcontext(&t->ctx);
        t->ctx.uc_stack.ss_sp = s->stacks + (size_t)i * s->stack_size;
        t->ctx.uc_stack.ss_size = s->stack_size;
        t->ctx.uc_link = NULL;
        makecontext(&t->ctx, emu_trampoline, 0);
        t->started = 0;
        t->state = EMU_RUN;
    }
    for (;;) {
        int live = 0;
        for (int k = 0; k < n; k++) {
            EmuThread* t = &s->threads[reverse ? n - 1 - k : k];
            if (t->state == EMU_RUN) emu_resume(t);
        }
        int released = 0, at_block = 0;
        for (int w = 0; w * 32 < n; w++) {  // open every warp barrier whose live threads all arrived
            int lo = w * 32, hi = lo + 32 < n ? lo + 32 : n, waiting = 0, alive = 0;
            for (int i = lo; i < hi; i++) {
                if (s->threads[i].state == EMU_DONE) continue;
                alive++;
                waiting += s->threads[i].state == EMU_WAIT_WARP;
            }
            if (alive && waiting == alive) {
                for (int i = lo; i < hi; i++) if (s->threads[i].state == EMU_WAIT_WARP) s->threads[i].state = EMU_RUN;
                released = 1;
            }
        }
        if (released) continue;
        for (int i = 0; i < n; i++) {
            if (s->threads[i].state != EMU_DONE) live++;
            at_block += s->threads[i].state == EMU_WAIT_BLOCK;
        }
        if (live == 0) return;
        if (at_block == live) {
            for (int i = 0; i < n; i++) if (s->threads[i].state == EMU_WAIT_BLOCK) s->threads[i].state = EMU_RUN;
            continue;
        }
        fprintf(stderr, "emu: deadlock in %s, block (%u,%u,%u): threads wait at different barriers "
                        "(a __syncthreads or shuffle in divergent code)\n", s->kernel, s->bid.x, s->bid.y, s->bid.z);
        exit(1);
    }
}

// The launch: every block of the grid in order, each as a set of fibers calling body().
static void emu_launch(dim3 grid, dim3 block, size_t smem, const char* kernel, const std::function<void()>& body) {
    EmuState* s = &emu_state;
    int n = (int)(block.x * block.y * block.z);
    if (n <= 0 || n > 1024 || grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535) {
        fprintf(stderr, "emu: invalid launch of %s: grid (%u,%u,%u) block (%u,%u,%u)\n", kernel, grid.x, grid.y, grid.z,
                block.x, block.y, block.z);
        exit(1);
    }
    if (smem > 0) { fprintf(stderr, "emu: %s asks for dynamic shared memory, which the emulator lacks\n", kernel); exit(1); }
    s->grid = grid;
    s->block = block;
    s->nthreads = n;
    s->kernel = kernel;
    s->body = &body;
    s->stack_size = 128 * 1024;
    if (s->stacks_for < n) {
        free(s->stacks);
        s->stacks = (char*)malloc(s->stack_size * n);
        s->stacks_for = n;
    }
    s->threads = (EmuThread*)calloc(n, sizeof(EmuThread));
    if (!s->threads || !s->stacks) { fprintf(stderr, "emu: out of memory\n"); exit(1); }
    for (int i = 0; i < n; i++) {
        EmuThread* t = &s->threads[i];
        t->linear = i;
        t->tid.x = i % block.x;
        t->tid.y = (i / block.x) % block.y;
        t->tid.z = i / (block.x * block.y);
    }
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                s->bid.x = x;
                s->bid.y = y;
                s->bid.z = z;
                emu_run_block();
            }
    free(s->threads);
    s->launches++;
}

// ---- warp collectives ------------------------------------------------------------------------

template <class T>
static T emu_exchange(T v, int src_lane_of_mine_fn(int lane, int arg), int arg) {
    static_assert(sizeof(T) <= 16, "shuffle of a type wider than 16 bytes");
    int lin = emu_state.cur->linear, warp = lin / 32, lane = lin % 32;
    memcpy(emu_state.slots[warp][lane], &v, sizeof(T));
    __syncwarp();
    int src = src_lane_of_mine_fn(lane, arg);
    T r = v;
    if (src >= 0 && src < 32 && warp * 32 + src < emu_state.nthreads) memcpy(&r, emu_state.slots[warp][src], sizeof(T));
    __syncwarp();  // nobody overwrites a slot before every lane has read
    return r;
}
static int emu_src_xor(int lane, int m) { return lane ^ m; }
static int emu_src_down(int lane, int d) { return lane + d < 32 ? lane + d : lane; }
static int emu_src_up(int lane, int d) { return lane - d >= 0 ? lane - d : lane; }
static int emu_src_idx(int lane, int src) { (void)lane; return src & 31; }

template <class T> static T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) { (void)mask; (void)width; return emu_exchange(v, emu_src_xor, lane_mask); }
template <class T> static T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) { (void)mask; (void)width; return emu_exchange(v, emu_src_down, (int)d); }
template <class T> static T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) { (void)mask; (void)width; return emu_exchange(v, emu_src_up, (int)d); }
template <class T> static T __shfl_sync(unsigned mask, T v, int src, int width = 32) { (void)mask; (void)width; return emu_exchange(v, emu_src_idx, src); }

// Fibers never interleave between two barriers, so plain read-modify-write is atomic here.
template <class T> static T atomicAdd(T* p, T v) { T old = *p; *p = old + v; return old; }
static float atomicMax(float* p, float v) { float old = *p; if (v > old) *p = v; return old; }

static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
template <class T> static inline T __ldg(const T* p) { return *p; }

// ---- the runtime API subset the backend uses: host memory, synchronous, always succeeding ----

// "Device" allocations are registered (start -> size), so every copy and memset can check that
// its pointers are on the side its kind says: passing a host pointer where device memory is
// expected (or the reverse) is a bug on a GPU even though both are host memory here. The
// registry also gives cudaMemGetInfo the bytes in use, against a pretend 80 GiB device.
static std::map<const char*, size_t>& emu_allocations(void) {
    static std::map<const char*, size_t> m;
    return m;
}
static size_t emu_bytes_in_use;
#define EMU_DEVICE_BYTES ((size_t)80 << 30)

// Whether [p, p + n) lies inside one device allocation. (Addresses as integers: the check never
// reads the memory, which the compiler would otherwise suspect of being read uninitialised.)
static int emu_on_device(uintptr_t p, size_t n) {
    const std::map<const char*, size_t>& m = emu_allocations();
    const char* c = (const char*)p;
    std::map<const char*, size_t>::const_iterator it = m.upper_bound(c);
    if (it == m.begin()) return 0;
    --it;
    return c >= it->first && c + n <= it->first + (it->second ? it->second : 1);
}
static void emu_check_side(uintptr_t p, size_t n, int device, const char* call, const char* which) {
    if (emu_on_device(p, n) == device) return;
    fprintf(stderr, "emu: %s: %s pointer %p (%zu bytes) is %s, expected %s\n", call, which, (void*)p, n,
            device ? "not inside a device allocation" : "device memory", device ? "device memory" : "host memory");
    abort();
}

extern "C" {
cudaError_t cudaMalloc(void** p, size_t n) {
    if (n > EMU_DEVICE_BYTES - emu_bytes_in_use) { *p = NULL; return cudaErrorMemoryAllocation; }  // the pretend device is full
    char* raw = (char*)aligned_alloc(256, ((n ? n : 1) + 255) / 256 * 256);  // cudaMalloc aligns to 256 bytes at least
    if (!raw) { *p = NULL; return cudaErrorMemoryAllocation; }
    emu_allocations()[raw] = n;
    emu_bytes_in_use += n;
    *p = raw;
    return cudaSuccess;
}
cudaError_t cudaFree(void* p) {
    if (!p) return cudaSuccess;
    cudaDeviceSynchronize();  // as on a GPU; held-back work may still use the memory
    std::map<const char*, size_t>::iterator it = emu_allocations().find((const char*)p);
    if (it == emu_allocations().end()) { fprintf(stderr, "emu: cudaFree of %p, which cudaMalloc did not return\n", p); abort(); }
    emu_bytes_in_use -= it->second;
    emu_allocations().erase(it);
    free(p);
    return cudaSuccess;
}
// Page-locked host memory is plain host memory here (not registered: it is host memory).
cudaError_t cudaMallocHost(void** p, size_t n) {
    *p = malloc(n ? n : 1);
    return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFreeHost(void* p) { free(p); return cudaSuccess; }
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total) {
    *total = EMU_DEVICE_BYTES;
    *free_bytes = EMU_DEVICE_BYTES - emu_bytes_in_use;
    return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int d) {
    memset(p, 0, sizeof(*p));
    snprintf(p->name, sizeof(p->name), "CPU emulator (llmc/cuda/emu.h), pretend device %d", d);
    p->totalGlobalMem = EMU_DEVICE_BYTES;
    p->major = 9;
    return cudaSuccess;
}
// Eight pretend GPUs, so an mpirun job can give each rank its own (each process emulates one).
cudaError_t cudaGetDeviceCount(int* n) { *n = 8; return cudaSuccess; }
cudaError_t cudaSetDevice(int d) { return d >= 0 && d < 8 ? cudaSuccess : cudaErrorInvalidDevice; }
}

// ---- streams ------------------------------------------------------------------------------------
// Kernels, copies and memsets run when issued, whatever their stream. Work a stream may hold back
// (emu_stream_submit: the emulated NCCL collectives) waits on its created stream until stream order
// forces it: more work issued to that stream, cudaStreamSynchronize or cudaDeviceSynchronize, or
// cudaStreamWaitEvent / cudaEventSynchronize on an event recorded after it. Running it as late as
// CUDA allows makes a consumer that forgot to wait read stale data (tests then fail); and, since
// the default stream's kernels ran long before, emu_stream_submit also checks the producer side:
// the held-back work's stream must have waited (an event) for every earlier kernel of the default
// stream, which a GPU would otherwise overlap with it. As on a GPU, the default stream's own work
// does not wait for streams created with cudaStreamNonBlocking.
struct CUstream_st {
    std::deque<std::function<void()> > pending;
    long long issued;           // held-back work items so far (those not run yet: `pending`)
    long long seen_default;     // default-stream work this stream has waited for (events)
    int nonblocking;
};
struct CUevent_st {
    cudaStream_t stream;        // where it was recorded (NULL: the default stream)
    long long position;         // that stream's `issued` then
    long long default_work;     // the default stream's work count then
};
static long long emu_default_work;  // kernels, copies and memsets issued to the default stream
static std::set<cudaStream_t>& emu_streams(void) {
    static std::set<cudaStream_t> s;
    return s;
}

static void emu_stream_run_until(cudaStream_t st, long long position) {
    while (st && !st->pending.empty() && st->issued - (long long)st->pending.size() < position) {
        std::function<void()> f = std::move(st->pending.front());
        st->pending.pop_front();
        f();
    }
}
static void emu_stream_drain(cudaStream_t st) { if (st) emu_stream_run_until(st, st->issued); }
static void emu_drain_all(int blocking_only) {
    for (std::set<cudaStream_t>::iterator it = emu_streams().begin(); it != emu_streams().end(); ++it)
        if (!blocking_only || !(*it)->nonblocking) emu_stream_drain(*it);
}

// Before a kernel, copy or memset on `st`: what the stream holds runs first (stream order).
static void emu_stream_issue(cudaStream_t st) {
    if (st) { emu_stream_drain(st); return; }
    emu_default_work++;
    emu_drain_all(1);  // the default stream waits for blocking streams
}

// Work that may run late (see above); `what` names it in the error.
static void emu_stream_submit(cudaStream_t st, const char* what, const std::function<void()>& f) {
    if (!st) { emu_stream_issue(NULL); f(); return; }
    if (st->seen_default < emu_default_work) {
        fprintf(stderr, "emu: race: %s issued on stream %p without waiting for the %lld earlier kernels/copies of the default "
                        "stream (cudaEventRecord on it, then cudaStreamWaitEvent)\n", what, (void*)st, emu_default_work - st->seen_default);
        abort();
    }
    st->pending.push_back(f);
    st->issued++;
}

static void emu_copy(void* dst, const void* src, size_t n, enum cudaMemcpyKind kind) {
    if (!n) return;
    if (kind != cudaMemcpyDefault) {
        emu_check_side((uintptr_t)dst, n, kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice, "cudaMemcpy", "destination");
        emu_check_side((uintptr_t)src, n, kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice, "cudaMemcpy", "source");
    }
    memmove(dst, src, n);
}
static void emu_fill(void* p, int v, size_t n) {
    if (!n) return;
    emu_check_side((uintptr_t)p, n, 1, "cudaMemset", "destination");
    memset(p, v, n);
}

extern "C" {
cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, enum cudaMemcpyKind kind) {
    emu_stream_issue(NULL);
    emu_copy(dst, src, n, kind);
    return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, enum cudaMemcpyKind kind, cudaStream_t st) {
    emu_stream_issue(st);
    emu_copy(dst, src, n, kind);
    return cudaSuccess;
}
cudaError_t cudaMemset(void* p, int v, size_t n) {
    emu_stream_issue(NULL);
    emu_fill(p, v, n);
    return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t st) {
    emu_stream_issue(st);
    emu_fill(p, v, n);
    return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void) { emu_drain_all(0); return cudaSuccess; }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* st, unsigned flags) {
    *st = new CUstream_st();
    (*st)->issued = 0;
    (*st)->seen_default = 0;
    (*st)->nonblocking = (flags & cudaStreamNonBlocking) != 0;
    emu_streams().insert(*st);
    return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t st) {
    if (!st) return cudaSuccess;
    emu_stream_drain(st);  // CUDA lets queued work finish
    emu_streams().erase(st);
    delete st;
    return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* ev, unsigned flags) {
    (void)flags;
    *ev = new CUevent_st();
    (*ev)->stream = NULL;
    (*ev)->position = (*ev)->default_work = 0;
    return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t ev) { delete ev; return cudaSuccess; }
cudaError_t cudaEventRecord(cudaEvent_t ev, cudaStream_t st) {
    ev->stream = st;
    ev->position = st ? st->issued : 0;
    ev->default_work = st ? st->seen_default : emu_default_work;
    return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t ev) { emu_stream_run_until(ev->stream, ev->position); return cudaSuccess; }
cudaError_t cudaStreamWaitEvent(cudaStream_t st, cudaEvent_t ev, unsigned flags) {
    (void)flags;
    emu_stream_run_until(ev->stream, ev->position);
    if (st && ev->default_work > st->seen_default) st->seen_default = ev->default_work;
    return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t st) {
    if (st) emu_stream_drain(st);
    else emu_drain_all(1);
    return cudaSuccess;
}
cudaError_t cudaGetLastError(void) { return cudaSuccess; }
const char* cudaGetErrorString(cudaError_t e) { return e == cudaSuccess ? "no error" : "emulated error"; }
}
