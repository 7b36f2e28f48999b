// cuda/vec.cuh: 16-byte vector loads and stores for the memory-bound kernels (cross-entropy, norms,
// activations, casts). A GPU moves a warp's 16-byte accesses in a quarter of the instructions of
// 4-byte ones and 1/8 of 2-byte ones; bf16 kernels that load one element per thread leave most
// of the bandwidth unused. A 16-byte access (ld/st.global.v4) to an address that is not 16-byte
// aligned faults on a GPU ("misaligned address"), so every kernel here splits a range into a
// scalar head up to the first aligned element, an aligned vector body and a scalar tail; on the
// CPU emulator (test/emu/emu.h) load_vec16/store_vec16 refuse a misaligned address the same
// way, so a test at a misaligned size or offset catches what would fault on the GPU.
#pragma once
#include "common.cuh"

template <class E>
struct alignas(16) Vec16 {
    static constexpr int n = 16 / (int)sizeof(E);  // elements per vector: 4 fp32, 8 bf16
    E v[16 / sizeof(E)];
};

#ifdef LLMC_CUDA_EMU
static void emu_check_align16(const void* p, const char* what) {
    if (((uintptr_t)p & 15) == 0) return;
    EmuState* s = &emu_state;
    fprintf(stderr, "emu: misaligned 16-byte %s at %p in %s, block (%u,%u,%u), thread %d (a GPU faults: misaligned "
            "address)\n", what, p, s->kernel, s->bid.x, s->bid.y, s->bid.z, s->cur->linear);
    exit(1);
}
#define VEC16_CHECK(p, what) emu_check_align16((const void*)(p), what)
#else
#define VEC16_CHECK(p, what) ((void)0)
#endif

template <class E>
static __device__ __forceinline__ Vec16<E> load_vec16(const E* p) {
    VEC16_CHECK(p, "load");
    return *(const Vec16<E>*)p;
}
template <class E>
static __device__ __forceinline__ void store_vec16(E* p, const Vec16<E>& x) {
    VEC16_CHECK(p, "store");
    *(Vec16<E>*)p = x;
}

// Elements from p to the first 16-byte aligned address (0 when p is aligned; p must be aligned to
// its element, as every buffer of the plan and every cudaMalloc is).
template <class E>
static __device__ __host__ __forceinline__ int elems_to_align16(const E* p) {
    return (int)(((16 - ((uintptr_t)p & 15)) & 15) / sizeof(E));
}
// Whether p is 16-byte aligned.
static __device__ __host__ __forceinline__ int aligned16(const void* p) { return ((uintptr_t)p & 15) == 0; }
