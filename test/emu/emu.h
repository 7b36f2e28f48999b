// test/emu/emu.h: a CPU emulation of the CUDA execution model, just enough to run this backend's
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
// at different barriers (a shuffle in divergent code) are reported as a deadlock.
// __shared__ variables are function statics: shared by the threads of a block, and blocks never
// run concurrently.
// "Device" memory is host memory and kernels and copies run when issued. Streams other than the
// default one may hold deferred work (the emulated NCCL calls of emu_nccl.h): it runs only when
// stream order forces it, so a missing cudaStreamWaitEvent shows up as stale data; see "streams"
// below. The runtime functions are defined here, so include it in one translation unit only.
//
// What it catches that a GPU would show as a crash, garbage or a compute-sanitizer report
// (test/cuda/test_emu_checks.py plants each bug and sees it caught):
//   - out-of-bounds accesses: every cudaMalloc and every buffer of the memory plan (plan.h leaves
//     a gap after each) is followed by a guard zone filled with 0xFF (NaN as float or bf16, -1 as
//     an integer), checked after every kernel, copy and cuBLAS call: a write there is reported
//     with the kernel and the buffer; a read gives NaN (under AddressSanitizer the zones are also
//     poisoned, so a read is reported at the access);
//   - reads of shared memory no thread wrote: every __shared__ variable is refilled with 0xFF
//     before each block (they are the executable's thread-local storage), so nothing carries
//     over between blocks;
//   - kernels that do not cover their grid: grid_for (common.cuh) gives at most EMU_GRID_FOR_CAP
//     blocks, so a kernel launched with it must be a grid-stride loop;
//   - thread-order dependence: within a block the runnable threads are resumed forward, in
//     reverse or shuffled (each block of a launch in the next of the three, per kernel), and the
//     blocks of a launch run in a shuffled order, so a missing __syncthreads shows up as a wrong
//     result;
//   - a warp collective whose mask names a lane that has exited or does not exist (undefined on a
//     GPU): reported;
//   - launch configurations a GPU refuses (block size, grid size, dynamic shared memory beyond
//     48 KiB without cudaFuncSetAttribute): the kernel does not run and cudaGetLastError returns
//     the error, as on a GPU;
//   - cuBLAS / cuBLASLt misuse: emu_cublas.h checks every call against the documented contract;
//   - what a stream capture refuses (see "stream capture and graphs" below): a host
//     synchronisation, cudaMalloc / cudaFree, a synchronous copy or memset, work on the legacy
//     stream, a copy from pageable memory, while a stream captures a CUDA graph.
// It says nothing about performance, memory coherence, register limits or what nvcc makes of the
// code: only a GPU does.
#pragma once
#ifndef LLMC_CUDA_EMU
#error "test/emu/emu.h is only for -DLLMC_CUDA_EMU builds"
#endif
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <execinfo.h>
#include <link.h>
#include <setjmp.h>
#include <ucontext.h>
#include <deque>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define EMU_ASAN 1
#else
#define EMU_ASAN 0
#endif

// Execution-space keywords become nothing (host_defines.h leaves them alone once defined).
#define __global__
#define __device__
#define __host__
#include <cuda_bf16.h>
// __shared__ variables: thread-local statics. Every fiber runs on the one host thread, so the
// threads of a block share them; and they are then all that the executable's TLS segment holds
// (nothing else in this code base is thread_local), so that the emulator can refill all of them
// with poison before each block. (A section attribute would be simpler, but GCC ignores it for
// the statics of function templates, which most kernels are.)
#undef __shared__
#define __shared__ static thread_local
#undef __forceinline__
#define __forceinline__ inline
#undef __launch_bounds__
#define __launch_bounds__(...)

#define EMU_POISON 0xFF            // guard zones and fresh shared memory: NaN as float or bf16
#define EMU_GUARD_BYTES 256        // the guard zone before and after every cudaMalloc
#define EMU_GRID_FOR_CAP 3         // grid_for's most blocks on the emulator
#define EMU_SMEM_DEFAULT (48 << 10)     // dynamic shared memory without the opt-in
#define EMU_SMEM_OPTIN_MAX (227 << 10)  // with cudaFuncSetAttribute (sm_90)

// ---- fibers and the per-block scheduler -----------------------------------------------------

enum { EMU_RUN, EMU_WAIT_BLOCK, EMU_WAIT_WARP, EMU_DONE };
enum { EMU_ORDER_FORWARD, EMU_ORDER_REVERSE, EMU_ORDER_SHUFFLED };

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
    int* order;            // the order in which runnable threads are resumed (a permutation)
    int nthreads;
    char* stacks;
    size_t stack_size;
    int stacks_for;        // how many fibers `stacks` has room for (kept across launches)
    jmp_buf sched;
    EmuThread* cur;
    const std::function<void()>* body;
    const char* kernel;
    cudaError_t last_error;  // what cudaGetLastError returns (and clears)
    unsigned char slots[32][32][16];  // warp shuffle exchange: [warp][lane][bytes]
} EmuState;

static EmuState emu_state;

// What the device work costs the host, counted exactly for --profile's "per step" line
// (llmc/train/profile.h): kernel launches that ran, cuBLAS compute calls (GEMMs, emu_cublas.h),
// and host synchronisations: every call that makes the host wait for the device (stream, event
// and device synchronisation; synchronous copies to or from the host; copies between the device
// and pageable host memory, which CUDA stages synchronously; device and pinned allocation and
// freeing).
// A CUDA graph's launch counts as one kernel launch (the host makes one call); the kernels and
// cuBLAS calls it replays are counted apart (graph_kernels, graph_blas), as are the captures.
typedef struct {
    long long launches, blas_calls, host_syncs;
    long long graph_launches, graph_kernels, graph_blas, graph_captures;
} EmuCounts;
static EmuCounts emu_counts;

// A host synchronisation: counted; with LLMC_EMU_TRACE_SYNCS=1 in the environment also reported on
// stderr with the call and the stack that made it (how to find who waits).
static void emu_host_sync(const char* call) {
    emu_counts.host_syncs++;
    if (!setting_on(SETTING_EMU_TRACE_SYNCS)) return;
    void* frames[12];
    int n = backtrace(frames, 12);
    fprintf(stderr, "emu: host synchronization #%lld: %s\n", emu_counts.host_syncs, call);
    backtrace_symbols_fd(frames + 1, n - 1, 2);
}

#define threadIdx (emu_state.cur->tid)
#define blockIdx (emu_state.bid)
#define blockDim (emu_state.block)
#define gridDim (emu_state.grid)

// A small deterministic generator (splitmix64) for the shuffled orders.
static uint64_t emu_random(uint64_t* state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static void emu_shuffle(int* a, int n, uint64_t seed) {
    for (int i = n - 1; i > 0; i--) {
        int j = (int)(emu_random(&seed) % (uint64_t)(i + 1)), t = a[i];
        a[i] = a[j];
        a[j] = t;
    }
}

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

// A warp collective whose mask names a lane that has exited (or lies beyond the block) is
// undefined on a GPU (it may hang or read garbage); checked once the warp barrier has opened.
static void emu_check_mask(unsigned mask, const char* what) {
    EmuState* s = &emu_state;
    int warp = s->cur->linear / 32;
    for (int lane = 0; lane < 32; lane++) {
        if (!(mask >> lane & 1)) continue;
        int i = warp * 32 + lane;
        if (i < s->nthreads && s->threads[i].state != EMU_DONE) continue;
        fprintf(stderr, "emu: %s with mask 0x%08x in %s, block (%u,%u,%u), warp %d: lane %d %s (undefined on a GPU)\n",
                what, mask, s->kernel, s->bid.x, s->bid.y, s->bid.z, warp, lane,
                i < s->nthreads ? "has exited" : "does not exist (partial warp)");
        exit(1);
    }
}

static void __syncthreads(void) { emu_wait(EMU_WAIT_BLOCK); }
static void __syncwarp(unsigned mask = 0xffffffffu) {
    emu_wait(EMU_WAIT_WARP);
    emu_check_mask(mask, "__syncwarp");
}

// The executable's TLS segment in this thread: every __shared__ variable (see above).
typedef struct {
    void* start;
    size_t bytes;
} EmuRange;
static int emu_find_tls(struct dl_phdr_info* info, size_t size, void* out) {
    (void)size;
    for (int i = 0; i < info->dlpi_phnum; i++)
        if (info->dlpi_phdr[i].p_type == PT_TLS && info->dlpi_tls_data) {
            EmuRange* r = (EmuRange*)out;
            r->start = info->dlpi_tls_data;
            r->bytes = info->dlpi_phdr[i].p_memsz;
        }
    return 1;  // the executable comes first; the libraries' TLS is theirs
}

// Every __shared__ variable back to poison: what a block reads before writing is NaN or -1.
static void emu_poison_shared(void) {
    static EmuRange tls = {NULL, (size_t)-1};
    if (tls.bytes == (size_t)-1) {
        tls.bytes = 0;
        dl_iterate_phdr(emu_find_tls, &tls);
    }
    if (tls.bytes) memset(tls.start, EMU_POISON, tls.bytes);
}

// Runs every fiber of the current block to completion, opening barriers as they fill; runnable
// threads are resumed in the given order (forward, reverse or shuffled by seed).
static void emu_run_block(int order, uint64_t seed) {
    EmuState* s = &emu_state;
    int n = s->nthreads;
    for (int i = 0; i < n; i++) {
        EmuThread* t = &s->threads[i];
        getcontext(&t->ctx);
        t->ctx.uc_stack.ss_sp = s->stacks + (size_t)i * s->stack_size;
        t->ctx.uc_stack.ss_size = s->stack_size;
        t->ctx.uc_link = NULL;
        makecontext(&t->ctx, emu_trampoline, 0);
        t->started = 0;
        t->state = EMU_RUN;
        s->order[i] = order == EMU_ORDER_REVERSE ? n - 1 - i : i;
    }
    if (order == EMU_ORDER_SHUFFLED) emu_shuffle(s->order, n, seed);
    emu_poison_shared();
    for (;;) {
        int live = 0;
        for (int k = 0; k < n; k++) {
            EmuThread* t = &s->threads[s->order[k]];
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

// ---- launch configuration: what a GPU refuses ----------------------------------------------

// Dynamic shared memory each kernel opted into (cudaFuncSetAttribute), by its address.
static std::map<const void*, int>& emu_smem_optin(void) {
    static std::map<const void*, int> m;
    return m;
}

// cudaSuccess, or the error a GPU's launch would leave for cudaGetLastError.
static cudaError_t emu_launch_error(dim3 grid, dim3 block, size_t smem, const void* fn) {
    uint64_t threads = (uint64_t)block.x * block.y * block.z;
    if (threads == 0 || threads > 1024 || block.x > 1024 || block.y > 1024 || block.z > 64)
        return cudaErrorInvalidConfiguration;
    if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535)
        return cudaErrorInvalidConfiguration;
    std::map<const void*, int>::const_iterator it = emu_smem_optin().find(fn);
    size_t limit = it != emu_smem_optin().end() ? (size_t)it->second : EMU_SMEM_DEFAULT;
    if (smem > limit) return cudaErrorInvalidValue;
    return cudaSuccess;
}

// How often each kernel has been launched: picks the thread orders of its next launch.
static unsigned long long emu_kernel_launches(const char* kernel) {
    static std::map<std::string, unsigned long long> m;
    return m[kernel]++;
}

static void emu_guards_check(const char* after);

// The launch: the blocks of the grid in a shuffled order, each as a set of fibers calling body(),
// block i of the launch with thread order (i + this kernel's launch count) mod 3. A configuration
// a GPU refuses runs nothing and leaves its error for cudaGetLastError.
static void emu_launch(dim3 grid, dim3 block, size_t smem, const char* kernel, const void* fn,
                       const std::function<void()>& body) {
    EmuState* s = &emu_state;
    cudaError_t err = emu_launch_error(grid, block, smem, fn);
    if (err != cudaSuccess) { s->last_error = err; return; }
    emu_counts.launches++;
    if (smem > 0) {
        fprintf(stderr, "emu: %s asks for dynamic shared memory, which the emulator lacks\n", kernel);
        exit(1);
    }
    int n = (int)(block.x * block.y * block.z);
    unsigned long long launch = emu_kernel_launches(kernel);
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
    s->order = (int*)calloc(n, sizeof(int));
    if (!s->threads || !s->order || !s->stacks) { fprintf(stderr, "emu: out of memory\n"); exit(1); }
    for (int i = 0; i < n; i++) {
        EmuThread* t = &s->threads[i];
        t->linear = i;
        t->tid.x = i % block.x;
        t->tid.y = (i / block.x) % block.y;
        t->tid.z = i / (block.x * block.y);
    }
    uint64_t nblocks = (uint64_t)grid.x * grid.y * grid.z;
    std::vector<int> blocks(nblocks);
    for (uint64_t b = 0; b < nblocks; b++) blocks[b] = (int)b;
    emu_shuffle(blocks.data(), (int)nblocks, launch * 0x51ed27ull + nblocks);
    for (uint64_t k = 0; k < nblocks; k++) {
        uint64_t b = (uint64_t)blocks[k];
        s->bid.x = (unsigned)(b % grid.x);
        s->bid.y = (unsigned)(b / grid.x % grid.y);
        s->bid.z = (unsigned)(b / ((uint64_t)grid.x * grid.y));
        emu_run_block((int)((k + launch) % 3), launch * 1000003ull + k);
    }
    free(s->threads);
    free(s->order);
    emu_guards_check(kernel);
}

// ---- warp collectives ------------------------------------------------------------------------

template <class T>
static T emu_exchange(unsigned mask, const char* what, T v, int src_lane_of_mine_fn(int lane, int arg), int arg) {
    static_assert(sizeof(T) <= 16, "shuffle of a type wider than 16 bytes");
    int lin = emu_state.cur->linear, warp = lin / 32, lane = lin % 32;
    memcpy(emu_state.slots[warp][lane], &v, sizeof(T));
    emu_wait(EMU_WAIT_WARP);
    emu_check_mask(mask, what);
    int src = src_lane_of_mine_fn(lane, arg);
    T r = v;
    if (src >= 0 && src < 32 && warp * 32 + src < emu_state.nthreads) memcpy(&r, emu_state.slots[warp][src], sizeof(T));
    emu_wait(EMU_WAIT_WARP);  // nobody overwrites a slot before every lane has read
    return r;
}
static int emu_src_xor(int lane, int m) { return lane ^ m; }
static int emu_src_down(int lane, int d) { return lane + d < 32 ? lane + d : lane; }
static int emu_src_up(int lane, int d) { return lane - d >= 0 ? lane - d : lane; }
static int emu_src_idx(int lane, int src) { (void)lane; return src & 31; }

template <class T>
static T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    (void)width;
    return emu_exchange(mask, "__shfl_xor_sync", v, emu_src_xor, lane_mask);
}
template <class T>
static T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) {
    (void)width;
    return emu_exchange(mask, "__shfl_down_sync", v, emu_src_down, (int)d);
}
template <class T>
static T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) {
    (void)width;
    return emu_exchange(mask, "__shfl_up_sync", v, emu_src_up, (int)d);
}
template <class T>
static T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    (void)width;
    return emu_exchange(mask, "__shfl_sync", v, emu_src_idx, src);
}

// Fibers never interleave between two barriers, so plain read-modify-write is atomic here.
template <class T> static T atomicAdd(T* p, T v) { T old = *p; *p = old + v; return old; }
static float atomicMax(float* p, float v) { float old = *p; if (v > old) *p = v; return old; }

static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
template <class T> static inline T __ldg(const T* p) { return *p; }

// ---- the runtime API subset the backend uses: host memory, synchronous ----------------------

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

// Page-locked host memory (cudaMallocHost), start -> size: a copy between it and the device is
// asynchronous; one from or to any other host memory makes the host wait (counted).
static std::map<const char*, size_t>& emu_pinned(void) {
    static std::map<const char*, size_t> m;
    return m;
}
static int emu_is_pinned(uintptr_t p, size_t n) {
    const std::map<const char*, size_t>& m = emu_pinned();
    const char* c = (const char*)p;
    std::map<const char*, size_t>::const_iterator it = m.upper_bound(c);
    if (it == m.begin()) return 0;
    --it;
    return c >= it->first && c + n <= it->first + (it->second ? it->second : 1);
}

// ---- guard zones -----------------------------------------------------------------------------
// Device memory no buffer owns, filled with EMU_POISON: before and after every cudaMalloc, and
// after every buffer of the memory plan (registered by backend.h). Checked after every kernel,
// cuBLAS call and copy; copies and cuBLAS operands that overlap one are refused before they run.
typedef struct {
    size_t bytes;
    std::string owner;     // whose end it follows, for the report
} EmuGuard;
static std::map<const char*, EmuGuard>& emu_guards(void) {
    static std::map<const char*, EmuGuard> m;
    return m;
}

static void emu_guard_add(void* p, size_t n, const char* owner) {
    if (!n) return;
    memset(p, EMU_POISON, n);
#if EMU_ASAN
    ASAN_POISON_MEMORY_REGION(p, n);
#endif
    EmuGuard g = {n, owner};
    emu_guards()[(const char*)p] = g;
}

// Forgets the guard zones inside [lo, hi) (the memory is being freed).
static void emu_guards_remove(const char* lo, const char* hi) {
    std::map<const char*, EmuGuard>& m = emu_guards();
    std::map<const char*, EmuGuard>::iterator it = m.lower_bound(lo);
    while (it != m.end() && it->first < hi) {
#if EMU_ASAN
        ASAN_UNPOISON_MEMORY_REGION((void*)it->first, it->second.bytes);
#endif
        m.erase(it++);
    }
}

// The guard zone that [p, p + n) overlaps, or NULL.
static const std::pair<const char* const, EmuGuard>* emu_guard_overlap(uintptr_t p, size_t n) {
    const std::map<const char*, EmuGuard>& m = emu_guards();
    const char* c = (const char*)p;
    std::map<const char*, EmuGuard>::const_iterator it = m.lower_bound(c + (n ? n : 1));
    if (it == m.begin()) return NULL;
    --it;
    return c < it->first + it->second.bytes ? &*it : NULL;
}

// Reports the first guard byte that is no longer poison: something wrote out of bounds. Under
// AddressSanitizer the zones are poisoned and the access itself is reported instead.
static void emu_guards_check(const char* after) {
#if !EMU_ASAN
    static unsigned char poison[4096];
    if (!poison[0]) memset(poison, EMU_POISON, sizeof(poison));
    const std::map<const char*, EmuGuard>& m = emu_guards();
    for (std::map<const char*, EmuGuard>::const_iterator it = m.begin(); it != m.end(); ++it)
        for (size_t at = 0; at < it->second.bytes; at += sizeof(poison)) {
            size_t len = it->second.bytes - at < sizeof(poison) ? it->second.bytes - at : sizeof(poison);
            if (!memcmp(it->first + at, poison, len)) continue;
            size_t i = at;
            while ((unsigned char)it->first[i] == EMU_POISON) i++;
            fprintf(stderr, "emu: out-of-bounds write by %s: byte %zu of the guard zone after %s was written\n", after,
                    i, it->second.owner.c_str());
            exit(1);
        }
#else
    (void)after;
#endif
}

// Checks that [p, p + n) is on the side `device` says and, on the device, touches no guard zone.
static void emu_check_side(uintptr_t p, size_t n, int device, const char* call, const char* which) {
    if (device && !emu_on_device(p, n) && emu_on_device(p, 1)) {
        fprintf(stderr, "emu: %s: %s [%p, +%zu bytes) runs past the end of its device allocation (out of bounds)\n",
                call, which, (void*)p, n);
        abort();
    }
    if (emu_on_device(p, n) != device) {
        fprintf(stderr, "emu: %s: %s pointer %p (%zu bytes) is %s, expected %s\n", call, which, (void*)p, n,
                device ? "not inside a device allocation" : "device memory", device ? "device memory" : "host memory");
        abort();
    }
    const std::pair<const char* const, EmuGuard>* g = device ? emu_guard_overlap(p, n) : NULL;
    if (g) {
        fprintf(stderr, "emu: %s: %s [%p, +%zu bytes) runs out of bounds into the guard zone after %s\n", call, which,
                (void*)p, n, g->second.owner.c_str());
        abort();
    }
}

// ---- stream capture and graphs -------------------------------------------------------------------
// cudaStreamBeginCapture ... cudaStreamEndCapture on a created stream records, without running them,
// the kernel launches, cuBLAS calls, device-to-device copies and memsets issued to it; each kernel's
// arguments are converted and copied at the launch, as CUDA does (a graph replays the values of the
// capture, so a host value that changed since is not seen: the bug a stale graph makes on a GPU).
// cudaGraphLaunch runs the recorded list in order on its stream, as one host call. As in CUDA's
// global capture mode, while a stream captures, every call that would make the host wait, allocate or
// free, or touch the legacy stream fails and invalidates the capture (reported on stderr with the
// call; cudaStreamEndCapture then returns cudaErrorStreamCaptureInvalidated). What the trainer never
// captures is not modelled and stops the run with a line saying so: events, collectives, copies
// between the host and the device, nested graphs.
enum { EMU_OP_KERNEL, EMU_OP_BLAS, EMU_OP_COPY };
struct EmuGraphOp {
    int kind;
    std::function<void()> run;
};
struct CUgraph_st {
    std::vector<EmuGraphOp> ops;
};
struct CUgraphExec_st {
    std::vector<EmuGraphOp> ops;
};
typedef struct {
    cudaStream_t stream;   // the capturing stream (one capture at a time: the trainer has one stream)
    CUgraph_st* graph;     // NULL: no capture
    int invalidated;
} EmuCapture;
static EmuCapture emu_capture;

static int emu_capturing(cudaStream_t st) { return emu_capture.graph && st && st == emu_capture.stream; }

// A call that CUDA's global capture mode refuses while a stream captures: cudaSuccess when none
// captures; else the capture is invalidated and the call returns `err` (reported on stderr).
static cudaError_t emu_capture_refuses(const char* call, const char* why, cudaError_t err) {
    if (!emu_capture.graph) return cudaSuccess;
    fprintf(stderr, "emu: %s while stream %p captures a CUDA graph: %s; CUDA refuses it and invalidates the capture\n",
            call, (void*)emu_capture.stream, why);
    emu_capture.invalidated = 1;
    return err;
}
// Work the emulator does not capture (the trainer never captures it): the run stops.
static void emu_capture_unmodelled(cudaStream_t st, const char* call) {
    if (!emu_capture.graph || (st && st != emu_capture.stream)) return;
    fprintf(stderr, "emu: %s while stream %p captures a CUDA graph: not modelled by the emulator\n", call,
            (void*)emu_capture.stream);
    exit(1);
}
static void emu_capture_record(int kind, const std::function<void()>& run) {
    EmuGraphOp op = {kind, run};
    emu_capture.graph->ops.push_back(op);
}

// A kernel's arguments converted to its parameter types and copied, as a launch does: a literal 0 or
// NULL where a pointer is expected is the null pointer.
template <class P, class A> static P emu_kernel_arg(A&& a) {
    if constexpr (std::is_pointer<P>::value && std::is_integral<typename std::decay<A>::type>::value) {
        if (a != 0) { fprintf(stderr, "emu: a nonzero integer passed as a kernel's pointer argument\n"); exit(1); }
        return (P) nullptr;
    } else {
        return (P)std::forward<A>(a);
    }
}
template <class... P, class... A>
static std::function<void()> emu_bind_kernel(void (*k)(P...), A&&... a) {
    static_assert(sizeof...(P) == sizeof...(A), "kernel launched with the wrong number of arguments");
    std::tuple<typename std::decay<P>::type...> args(
        emu_kernel_arg<typename std::decay<P>::type>(std::forward<A>(a))...);
    return [k, args]() { std::apply(k, args); };
}

static void emu_launch(dim3 grid, dim3 block, size_t smem, const char* kernel, const void* fn,
                       const std::function<void()>& body);
// A launch on a capturing stream: checked now (a configuration a GPU refuses fails the launch and
// the capture), run at each cudaGraphLaunch.
static void emu_capture_launch(dim3 grid, dim3 block, size_t smem, const char* kernel, const void* fn,
                               const std::function<void()>& body) {
    cudaError_t err = emu_launch_error(grid, block, smem, fn);
    if (err != cudaSuccess) {
        emu_state.last_error = err;
        emu_capture.invalidated = 1;
        return;
    }
    emu_capture_record(EMU_OP_KERNEL, [=]() { emu_launch(grid, block, smem, kernel, fn, body); });
}
// A launch on the legacy stream while another stream captures: cudaErrorStreamCaptureImplicit.
static int emu_capture_refuses_legacy(cudaStream_t st, const char* kernel) {
    if (st || !emu_capture.graph) return 0;
    emu_state.last_error =
        emu_capture_refuses(kernel, "a kernel launch on the legacy stream", cudaErrorStreamCaptureImplicit);
    return 1;
}

extern "C" {
// Each allocation sits between two guard zones; its start is 256-byte aligned, as cudaMalloc's.
cudaError_t cudaMalloc(void** p, size_t n) {
    cudaError_t refused = emu_capture_refuses("cudaMalloc", "an allocation", cudaErrorStreamCaptureUnsupported);
    if (refused) return refused;
    emu_host_sync("cudaMalloc");
    if (n > EMU_DEVICE_BYTES - emu_bytes_in_use) {
        *p = NULL;
        return cudaErrorMemoryAllocation;
    }  // the pretend device is full
    size_t tail = (n + 255) / 256 * 256 - n + EMU_GUARD_BYTES;
    char* raw = (char*)aligned_alloc(256, EMU_GUARD_BYTES + n + tail);
    if (!raw) { *p = NULL; return cudaErrorMemoryAllocation; }
    char* user = raw + EMU_GUARD_BYTES;
    char owner[64];
    snprintf(owner, sizeof(owner), "the cudaMalloc of %zu bytes at %p", n, (void*)user);
    emu_guard_add(raw, EMU_GUARD_BYTES, "the allocation before it");
    emu_guard_add(user + n, tail, owner);
    emu_allocations()[user] = n;
    emu_bytes_in_use += n;
    *p = user;
    return cudaSuccess;
}
cudaError_t cudaFree(void* p) {
    if (!p) return cudaSuccess;
    cudaError_t refused =
        emu_capture_refuses("cudaFree", "freeing synchronises the device", cudaErrorStreamCaptureUnsupported);
    if (refused) return refused;
    cudaDeviceSynchronize();  // as on a GPU; held-back work may still use the memory (counted there)
    std::map<const char*, size_t>::iterator it = emu_allocations().find((const char*)p);
    if (it == emu_allocations().end()) {
        fprintf(stderr, "emu: cudaFree of %p, which cudaMalloc did not return\n", p);
        abort();
    }
    emu_guards_check("a kernel (seen at cudaFree)");
    char* raw = (char*)p - EMU_GUARD_BYTES;
    emu_guards_remove(raw, (char*)p + (it->second + 255) / 256 * 256 + EMU_GUARD_BYTES);
    emu_bytes_in_use -= it->second;
    emu_allocations().erase(it);
    free(raw);
    return cudaSuccess;
}
// Page-locked host memory is plain host memory here (not registered: it is host memory).
cudaError_t cudaMallocHost(void** p, size_t n) {
    cudaError_t refused = emu_capture_refuses("cudaMallocHost", "an allocation", cudaErrorStreamCaptureUnsupported);
    if (refused) return refused;
    emu_host_sync("cudaMallocHost");
    *p = malloc(n ? n : 1);
    if (*p) emu_pinned()[(const char*)*p] = n;
    return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFreeHost(void* p) {
    cudaError_t refused =
        emu_capture_refuses("cudaFreeHost", "freeing synchronises the device", cudaErrorStreamCaptureUnsupported);
    if (refused) return refused;
    emu_host_sync("cudaFreeHost");
    emu_pinned().erase((const char*)p);
    free(p);
    return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total) {
    *total = EMU_DEVICE_BYTES;
    *free_bytes = EMU_DEVICE_BYTES - emu_bytes_in_use;
    return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int d) {
    memset(p, 0, sizeof(*p));
    snprintf(p->name, sizeof(p->name), "CPU emulator (test/emu/emu.h), pretend device %d", d);
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
// does not wait for streams created with cudaStreamNonBlocking. A stream created blocking
// (cudaStreamCreate: the trainer's compute stream, backend.h) is ordered with the default stream
// both ways, so its kernels count as default-stream work here: they run when issued, and a
// held-back copy on it needs no event to follow them.
//
// What the host has seen finish: every operation and event record takes the next number of
// `emu_seq`; a stream's `observed` is the last number a host wait covered (cudaStreamSynchronize,
// cudaEventSynchronize, cudaDeviceSynchronize). cudaEventQuery answers from that, as if the device
// were slow: cudaSuccess only for work a wait already covered, so a trainer that polls before it
// waits has the wait counted here whenever a GPU might need it.
// Pinned host memory that an asynchronous copy reads (a host-to-device upload) must not be written
// by the host before a wait covers the copy: a GPU may still be reading it. Each such copy keeps a
// snapshot of its source; when a wait covers it, or another upload from the same bytes is issued,
// the source must still equal the snapshot, else the emulator reports the early rewrite (the
// double-buffered batch upload of backend.h relies on this; test_emu_checks.py plants the bug).
// The memory a held-back copy touches (n == 0: unknown, e.g. a collective: it conflicts with any copy).
struct EmuSpan {
    uintptr_t dst, src;
    size_t n;
};
static int emu_spans_meet(uintptr_t a, uintptr_t b, size_t n) { return a < b + n && b < a + n; }
// Whether a copy `later` must wait for held-back work `earlier` of its stream (one writes what the
// other reads or writes).
static int emu_spans_conflict(const EmuSpan& earlier, const EmuSpan& later) {
    if (!earlier.n || !later.n) return 1;
    return emu_spans_meet(later.dst, earlier.src, later.n) || emu_spans_meet(later.dst, earlier.dst, later.n) ||
           emu_spans_meet(later.src, earlier.dst, later.n);
}
struct CUstream_st {
    std::deque<std::function<void()> > pending;
    std::deque<EmuSpan> spans;  // beside `pending`: what each item touches
    long long issued;           // held-back work items so far (those not run yet: `pending`)
    long long seen_default;     // default-stream work this stream has waited for (events)
    int nonblocking;
    long long observed;         // the last emu_seq a host wait on this stream covered
};
struct CUevent_st {
    cudaStream_t stream;        // where it was recorded (NULL: the default stream)
    long long position;         // that stream's `issued` then
    long long default_work;     // the default stream's work count then
    double host_time;           // host wall time at the record (cudaEventElapsedTime's stand-in)
    long long seq;              // emu_seq at the record
};
static long long emu_seq;            // numbers operations and event records in issue order
static long long emu_null_observed;  // `observed` of the default stream
static long long* emu_observed(cudaStream_t st) { return st ? &st->observed : &emu_null_observed; }
// An upload from pinned host memory not yet covered by a host wait (see above).
struct EmuUpload {
    cudaStream_t stream;
    long long seq;
    const char* src;
    std::vector<char> snapshot;
};
static std::deque<EmuUpload>& emu_uploads(void) {
    static std::deque<EmuUpload> q;
    return q;
}
// The device wrote [p, p + n) (a copy to pinned memory, or its poison until it runs): not the host's
// rewrite, so the snapshots of uploads from those bytes follow (stream order, not the host, says
// when such a copy may run: offload.h's events).
static void emu_uploads_device_wrote(const char* p, size_t n) {
    std::deque<EmuUpload>& q = emu_uploads();
    for (size_t i = 0; i < q.size(); i++) {
        EmuUpload& u = q[i];
        const char* end = u.src + u.snapshot.size();
        const char *lo = p > u.src ? p : u.src, *hi = p + n < end ? p + n : end;
        if (lo < hi) memcpy(u.snapshot.data() + (lo - u.src), lo, (size_t)(hi - lo));
    }
}
// The uploads a wait now covers are checked and forgotten; with n > 0 also the uncovered ones
// whose source meets [p, p + n) (an upload about to read those bytes again).
static void emu_uploads_check(const char* p, size_t n) {
    std::deque<EmuUpload>& q = emu_uploads();
    for (size_t i = 0; i < q.size();) {
        EmuUpload& u = q[i];
        int covered = *emu_observed(u.stream) >= u.seq;
        int meets = n && p < u.src + u.snapshot.size() && u.src < p + n;
        if ((covered || meets) && memcmp(u.src, u.snapshot.data(), u.snapshot.size()) != 0) {
            fprintf(stderr,
                    "emu: race: the host rewrote pinned memory [%p, +%zu bytes) while an asynchronous copy from it "
                    "could still be reading it (wait on an event recorded after the copy before rewriting)\n",
                    (const void*)u.src, u.snapshot.size());
            abort();
        }
        if (covered) q.erase(q.begin() + (long)i);
        else i++;
    }
}
static long long emu_default_work;  // kernels, copies and memsets issued to the default stream

static std::set<cudaStream_t>& emu_streams(void) {
    static std::set<cudaStream_t> s;
    return s;
}
// A host wait covered everything issued to st so far (NULL: the default stream, which also waits
// for the blocking streams).
static void emu_observe_all(cudaStream_t st) {
    *emu_observed(st) = emu_seq;
    if (st) return;
    for (std::set<cudaStream_t>::iterator it = emu_streams().begin(); it != emu_streams().end(); ++it)
        if (!(*it)->nonblocking) (*it)->observed = emu_seq;
}

static void emu_stream_run_until(cudaStream_t st, long long position) {
    while (st && !st->pending.empty() && st->issued - (long long)st->pending.size() < position) {
        std::function<void()> f = std::move(st->pending.front());
        st->pending.pop_front();
        st->spans.pop_front();
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
    emu_seq++;
    if (st) {
        emu_stream_drain(st);
        if (!st->nonblocking) emu_default_work++;  // ordered with the default stream (see above)
        return;
    }
    emu_default_work++;
    emu_drain_all(1);  // the default stream waits for blocking streams
}

// Work that may run late (see above); `what` names it in the error; `span`: the memory it touches.
static void emu_stream_submit_span(cudaStream_t st, const char* what, const std::function<void()>& f, EmuSpan span) {
    emu_capture_unmodelled(st, what);
    if (!st) { emu_stream_issue(NULL); f(); return; }
    emu_seq++;
    if (!st->nonblocking) st->seen_default = emu_default_work;  // ordered after it (see above)
    if (st->seen_default < emu_default_work) {
        fprintf(stderr,
                "emu: race: %s issued on stream %p without waiting for the %lld earlier kernels/copies of the default "
                "stream (cudaEventRecord on it, then cudaStreamWaitEvent)\n",
                what, (void*)st, emu_default_work - st->seen_default);
        abort();
    }
    st->pending.push_back(f);
    st->spans.push_back(span);
    st->issued++;
}
static void emu_stream_submit(cudaStream_t st, const char* what, const std::function<void()>& f) {
    EmuSpan unknown = {0, 0, 0};
    emu_stream_submit_span(st, what, f, unknown);
}

static void emu_copy(void* dst, const void* src, size_t n, enum cudaMemcpyKind kind) {
    if (!n) return;
    if (kind != cudaMemcpyDefault) {
        emu_check_side((uintptr_t)dst, n, kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice,
                       "cudaMemcpy", "destination");
        emu_check_side((uintptr_t)src, n, kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice,
                       "cudaMemcpy", "source");
    } else {  // either side may be device memory, which must stay out of the guard zones
        if (emu_on_device((uintptr_t)dst, n)) emu_check_side((uintptr_t)dst, n, 1, "cudaMemcpy", "destination");
        if (emu_on_device((uintptr_t)src, n)) emu_check_side((uintptr_t)src, n, 1, "cudaMemcpy", "source");
    }
    memmove(dst, src, n);
    emu_uploads_device_wrote((const char*)dst, n);
}
static void emu_fill(void* p, int v, size_t n) {
    if (!n) return;
    emu_check_side((uintptr_t)p, n, 1, "cudaMemset", "destination");
    memset(p, v, n);
}

extern "C" {
// Whether a copy of this kind makes the host wait: cudaMemcpy always, unless device to device
// (`async` 0); cudaMemcpyAsync when its host side is pageable memory (`async` 1).
static int emu_copy_waits(const void* dst, const void* src, size_t n, enum cudaMemcpyKind kind, int async) {
    int dst_host = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyHostToHost ||
                   (kind == cudaMemcpyDefault && !emu_on_device((uintptr_t)dst, n));
    int src_host = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyHostToHost ||
                   (kind == cudaMemcpyDefault && !emu_on_device((uintptr_t)src, n));
    if (!dst_host && !src_host) return 0;
    if (!async) return 1;
    return (dst_host && !emu_is_pinned((uintptr_t)dst, n)) || (src_host && !emu_is_pinned((uintptr_t)src, n));
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, enum cudaMemcpyKind kind) {
    cudaError_t refused = emu_capture_refuses("cudaMemcpy", "a synchronous copy on the legacy stream",
                                              cudaErrorStreamCaptureImplicit);
    if (refused) return refused;
    if (emu_copy_waits(dst, src, n, kind, 0)) emu_host_sync("cudaMemcpy");
    emu_stream_issue(NULL);
    emu_copy(dst, src, n, kind);
    return cudaSuccess;
}
// On a created stream the copy is held back like other deferred work (see "streams" above), and its
// destination reads as 0xFF bytes (NaN) until it has run: a reader that did not wait for it (an
// event recorded after it) sees NaN, and a writer that did not wait before overwriting its source
// has the copy take the new data. Held-back work of the same stream that the copy meets (one
// writes what the other touches) runs first, as stream order requires; the rest stays held back.
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, enum cudaMemcpyKind kind, cudaStream_t st) {
    int pageable = emu_copy_waits(dst, src, n, kind, 1);
    if (emu_capture.graph && (pageable || !st)) {
        const char* why = pageable ? "a copy with pageable host memory, which the host stages synchronously"
                                   : "a copy on the legacy stream";
        cudaError_t refused = emu_capture_refuses(
            "cudaMemcpyAsync", why, pageable ? cudaErrorStreamCaptureUnsupported : cudaErrorStreamCaptureImplicit);
        if (refused) return refused;
    }
    if (emu_capturing(st)) {  // recorded: device to device only (the trainer captures no other copy)
        if (emu_copy_waits(dst, src, n, kind, 0))
            emu_capture_unmodelled(st, "cudaMemcpyAsync between the host and the device");
        emu_check_side((uintptr_t)dst, n, 1, "cudaMemcpyAsync", "destination");
        emu_check_side((uintptr_t)src, n, 1, "cudaMemcpyAsync", "source");
        emu_capture_record(EMU_OP_COPY, [=]() { emu_copy(dst, src, n, kind); });
        return cudaSuccess;
    }
    if (pageable) emu_host_sync("cudaMemcpyAsync with pageable host memory");
    // CUDA stages a copy with pageable memory through the host before returning: on a blocking
    // stream (the trainer's) it runs now, after the stream's earlier work, as for the default stream
    if (!st || (pageable && !st->nonblocking)) {
        emu_stream_issue(st);
        emu_copy(dst, src, n, kind);
        return cudaSuccess;
    }
    // stream order: the held-back work this copy meets runs first (the rest may stay held back)
    EmuSpan span = {(uintptr_t)dst, (uintptr_t)src, n};
    long long last = 0;
    for (size_t i = 0; i < st->spans.size(); i++)
        if (emu_spans_conflict(st->spans[i], span)) last = st->issued - (long long)st->spans.size() + (long long)i + 1;
    emu_stream_run_until(st, last);
    emu_stream_submit_span(st, "cudaMemcpyAsync", [=]() { emu_copy(dst, src, n, kind); }, span);
    if (n && emu_is_pinned((uintptr_t)src, n)) {  // the host must leave the source alone until a wait
        emu_uploads_check((const char*)src, n);
        EmuUpload u = {st, emu_seq, (const char*)src, std::vector<char>((const char*)src, (const char*)src + n)};
        emu_uploads().push_back(u);
    }
    int dst_on_device = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice ||
                        (kind == cudaMemcpyDefault && emu_on_device((uintptr_t)dst, n));
    if (dst_on_device) emu_check_side((uintptr_t)dst, n, 1, "cudaMemcpyAsync", "destination");
    if (n) memset(dst, 0xFF, n);
    if (n) emu_uploads_device_wrote((const char*)dst, n);
    return cudaSuccess;
}
// Rows of `width` bytes, `height` of them, between pitched buffers (--seq-parallel's exchanges
// pack and unpack with it): row by row as cudaMemcpyAsync would copy each.
cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                              enum cudaMemcpyKind kind, cudaStream_t st) {
    for (size_t r = 0; r < height; r++) {
        cudaError_t e = cudaMemcpyAsync((char*)dst + r * dpitch, (const char*)src + r * spitch, width, kind, st);
        if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
}
cudaError_t cudaMemset(void* p, int v, size_t n) {
    cudaError_t refused =
        emu_capture_refuses("cudaMemset", "a memset on the legacy stream", cudaErrorStreamCaptureImplicit);
    if (refused) return refused;
    emu_stream_issue(NULL);
    emu_fill(p, v, n);
    return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t st) {
    if (!st) {
        cudaError_t refused = emu_capture_refuses("cudaMemsetAsync", "a memset on the legacy stream",
                                                  cudaErrorStreamCaptureImplicit);
        if (refused) return refused;
    }
    if (emu_capturing(st)) {
        emu_check_side((uintptr_t)p, n, 1, "cudaMemsetAsync", "destination");
        emu_capture_record(EMU_OP_COPY, [=]() { emu_fill(p, v, n); });
        return cudaSuccess;
    }
    emu_stream_issue(st);
    emu_fill(p, v, n);
    return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void) {
    cudaError_t refused = emu_capture_refuses("cudaDeviceSynchronize", "a host synchronisation",
                                              cudaErrorStreamCaptureUnsupported);
    if (refused) return refused;
    emu_host_sync("cudaDeviceSynchronize");
    emu_drain_all(0);
    emu_null_observed = emu_seq;
    for (std::set<cudaStream_t>::iterator it = emu_streams().begin(); it != emu_streams().end(); ++it)
        (*it)->observed = emu_seq;
    emu_uploads_check(NULL, 0);
    return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* st, unsigned flags) {
    *st = new CUstream_st();
    (*st)->observed = 0;
    (*st)->issued = 0;
    (*st)->seen_default = 0;
    (*st)->nonblocking = (flags & cudaStreamNonBlocking) != 0;
    emu_streams().insert(*st);
    return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t* st) { return cudaStreamCreateWithFlags(st, cudaStreamDefault); }
cudaError_t cudaStreamDestroy(cudaStream_t st) {
    if (!st) return cudaSuccess;
    emu_capture_unmodelled(st, "cudaStreamDestroy");
    emu_stream_drain(st);  // CUDA lets queued work finish
    // the uploads issued to it have run (read their sources) just now: checked as a wait would, then
    // forgotten (no record may name a freed stream)
    *emu_observed(st) = emu_seq;
    std::deque<EmuUpload>& q = emu_uploads();
    for (size_t i = 0; i < q.size(); i++)
        if (q[i].stream == st) q[i].stream = NULL, q[i].seq = 0;  // covered from now on
    emu_uploads_check(NULL, 0);
    emu_streams().erase(st);
    delete st;
    return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* ev, unsigned flags) {
    (void)flags;
    *ev = new CUevent_st();
    (*ev)->stream = NULL;
    (*ev)->position = (*ev)->default_work = 0;
    (*ev)->host_time = 0.0;
    (*ev)->seq = 0;
    return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t* ev) { return cudaEventCreateWithFlags(ev, 0); }
cudaError_t cudaEventDestroy(cudaEvent_t ev) { delete ev; return cudaSuccess; }
cudaError_t cudaEventRecord(cudaEvent_t ev, cudaStream_t st) {
    emu_capture_unmodelled(st, "cudaEventRecord");
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ev->host_time = ts.tv_sec + 1e-9 * ts.tv_nsec;
    ev->stream = st;
    ev->position = st ? st->issued : 0;
    ev->default_work = st && st->nonblocking ? st->seen_default : emu_default_work;
    ev->seq = ++emu_seq;
    return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t ev) {
    cudaError_t refused = emu_capture_refuses("cudaEventSynchronize", "a host synchronisation",
                                              cudaErrorStreamCaptureUnsupported);
    if (refused) return refused;
    emu_host_sync("cudaEventSynchronize");
    emu_stream_run_until(ev->stream, ev->position);
    long long* seen = emu_observed(ev->stream);
    if (*seen < ev->seq) *seen = ev->seq;
    emu_uploads_check(NULL, 0);
    return cudaSuccess;
}
// Done only when a host wait already covered the event (see "what the host has seen" above).
cudaError_t cudaEventQuery(cudaEvent_t ev) {
    return *emu_observed(ev->stream) >= ev->seq ? cudaSuccess : cudaErrorNotReady;
}
// The host time between the two records: the emulator has no device clock (and runs kernels
// lazily), so this says nothing about kernel time; it lets --profile's event path run.
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t a, cudaEvent_t b) {
    emu_stream_run_until(a->stream, a->position);
    emu_stream_run_until(b->stream, b->position);
    *ms = (float)(1e3 * (b->host_time - a->host_time));
    return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t st, cudaEvent_t ev, unsigned flags) {
    emu_capture_unmodelled(st, "cudaStreamWaitEvent");
    (void)flags;
    emu_stream_run_until(ev->stream, ev->position);
    if (st && ev->default_work > st->seen_default) st->seen_default = ev->default_work;
    return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t st) {
    cudaError_t refused = emu_capture_refuses("cudaStreamSynchronize", "a host synchronisation",
                                              cudaErrorStreamCaptureUnsupported);
    if (refused) return refused;
    emu_host_sync("cudaStreamSynchronize");
    if (st) emu_stream_drain(st);
    else emu_drain_all(1);
    emu_observe_all(st);
    emu_uploads_check(NULL, 0);
    return cudaSuccess;
}
cudaError_t cudaStreamBeginCapture(cudaStream_t st, enum cudaStreamCaptureMode mode) {
    (void)mode;  // the emulator refuses what the global mode refuses, whatever the mode
    if (!st) return cudaErrorStreamCaptureUnsupported;  // the legacy stream cannot be captured
    if (emu_capture.graph) return cudaErrorIllegalState;
    emu_capture.stream = st;
    emu_capture.graph = new CUgraph_st();
    emu_capture.invalidated = 0;
    return cudaSuccess;
}
cudaError_t cudaStreamIsCapturing(cudaStream_t st, enum cudaStreamCaptureStatus* status) {
    *status = !emu_capturing(st)          ? cudaStreamCaptureStatusNone
              : emu_capture.invalidated ? cudaStreamCaptureStatusInvalidated
                                          : cudaStreamCaptureStatusActive;
    return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t st, cudaGraph_t* graph) {
    *graph = NULL;
    if (!emu_capturing(st)) return cudaErrorIllegalState;
    CUgraph_st* g = emu_capture.graph;
    int invalidated = emu_capture.invalidated;
    memset(&emu_capture, 0, sizeof(emu_capture));
    if (invalidated) { delete g; return cudaErrorStreamCaptureInvalidated; }
    emu_counts.graph_captures++;
    *graph = g;
    return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long flags) {
    (void)flags;
    *exec = new CUgraphExec_st();
    (*exec)->ops = graph->ops;
    return cudaSuccess;
}
// The recorded work in order on `st`, as one host call: one launch; the kernels and cuBLAS calls it
// replays are counted apart.
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t st) {
    emu_capture_unmodelled(st, "cudaGraphLaunch (a graph inside a graph)");
    if (!st && emu_capture.graph)
        return emu_capture_refuses("cudaGraphLaunch", "a launch on the legacy stream", cudaErrorStreamCaptureImplicit);
    EmuCounts before = emu_counts;
    for (size_t i = 0; i < exec->ops.size(); i++) {
        emu_stream_issue(st);
        exec->ops[i].run();
    }
    emu_counts.graph_kernels += emu_counts.launches - before.launches;
    emu_counts.graph_blas += emu_counts.blas_calls - before.blas_calls;
    emu_counts.launches = before.launches + 1;
    emu_counts.blas_calls = before.blas_calls;
    emu_counts.graph_launches++;
    return cudaSuccess;
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) { delete exec; return cudaSuccess; }
cudaError_t cudaGraphDestroy(cudaGraph_t graph) { delete graph; return cudaSuccess; }
// Launch errors are sticky until read, as on a GPU (the emulator has no asynchronous faults).
cudaError_t cudaGetLastError(void) {
    cudaError_t e = emu_state.last_error;
    emu_state.last_error = cudaSuccess;
    return e;
}
cudaError_t cudaPeekAtLastError(void) { return emu_state.last_error; }
const char* cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureImplicit:
        return "operation would make the legacy stream depend on a capturing blocking stream";
    case cudaErrorIllegalState: return "the operation cannot be performed in the present state";
    default: return "emulated error";
    }
}
}

// The opt-in to more dynamic shared memory than the default 48 KiB (the one attribute modelled).
template <class F> static cudaError_t cudaFuncSetAttribute(F* fn, enum cudaFuncAttribute attr, int value) {
    if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaErrorInvalidValue;
    if (value < 0 || value > EMU_SMEM_OPTIN_MAX) return cudaErrorInvalidValue;
    emu_smem_optin()[(const void*)fn] = value;
    return cudaSuccess;
}
