// lora_dropout.h: LoRA dropout (--lora-dropout P, PEFT's lora_dropout): the adapter of a linear
// layer sees dropout(x) = x * keep / (1 - P) instead of x while training, y = W x + (alpha/r) B A
// dropout(x); evaluation and generation see x. The keep mask is never stored: one counter-based
// hash of (seed, optimizer step, adapted linear, element) decides each element, so the backward
// regenerates the forward's mask, both backends draw the same one, and the element is counted in
// the step's global batch (the micro-batch's first row, row0, places it), so that N ranks, or one
// process accumulating their micro-batches, or a resumed run all drop the same elements.
// Defines the per-element rule (host and device, like approx_act.h) and the run's dropout state.
#pragma once
#include <stdint.h>

#ifdef __CUDACC__
#define DROP_HD __host__ __device__ static inline
#else
#define DROP_HD static inline
#endif

// splitmix64's finaliser: a bijection of 64-bit words whose outputs pass BigCrush when fed a
// counter (it is splitmix64 itself with the counter as its state).
DROP_HD uint64_t dropout_mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// The key of one adapted linear (`linear`: layer * targets + target) at one optimizer step: each
// field goes through the mixer in turn, so keys of nearby (seed, step, linear) share no structure.
DROP_HD uint64_t lora_dropout_key(uint64_t seed, uint64_t step, uint64_t linear) {
    uint64_t k = dropout_mix64(seed + 0x9E3779B97F4A7C15ull);
    k = dropout_mix64(k ^ (step + 0x9E3779B97F4A7C15ull));
    return dropout_mix64(k ^ (linear + 0x9E3779B97F4A7C15ull));
}

// Whether element `e` (global row * in + column) is kept: the high 32 bits of splitmix64 at
// position e of the key's stream against threshold = floor(P * 2^32), so P(drop) = threshold / 2^32,
// within 2^-32 of P.
DROP_HD int lora_dropout_keep(uint64_t key, uint64_t e, uint32_t threshold) {
    return (uint32_t)(dropout_mix64(key + (e + 1) * 0x9E3779B97F4A7C15ull) >> 32) >= threshold;
}

// What of the key changes between micro-batches (the optimizer step and the micro-batch's first
// row), as the CUDA kernels read it from device memory: uploaded with each micro-batch's batch, so
// that a captured CUDA graph replays with fresh masks (llmc/cuda/graph.cuh; the dev/cuda checks and
// the probes pass them as kernel arguments instead).
typedef struct {
    uint64_t step;
    int64_t row0;
} LoraDropoutAt;

// The run's dropout state, shared by every adapted linear of a model (Linear.drop points here).
// The trainer sets step and row0 before each training micro-batch (before its upload, where `at`
// is used) and active = 1 around its forward and backward only; evaluation and generation leave it 0.
typedef struct {
    float p;               // --lora-dropout; 0: off (no state is bound)
    uint32_t threshold;    // floor(p * 2^32)
    float scale;           // 1 / (1 - p), on kept elements
    uint64_t seed;
    uint64_t step;         // the optimizer step (0-based, the same after --resume)
    int64_t row0;          // first row (token or image token) of this micro-batch in the step's batch
    int64_t row_off;       // rows of the micro-batch before the one the layer sees (an MLP tile's
                           // first; 0 elsewhere): fixed by the shape, so a kernel argument always
    const LoraDropoutAt* at;  // CUDA: step and row0 in device memory, read by the kernels (NULL: arguments)
    int active;
    void* work;            // scratch [rows, widest adapted input] (activation type): the adapter's input
} LoraDropout;

static void lora_dropout_init(LoraDropout* d, float p, uint64_t seed, void* work) {
    d->p = p;
    double t = (double)p * 4294967296.0;
    d->threshold = t >= 4294967295.0 ? 0xFFFFFFFFu : (uint32_t)t;
    d->scale = 1.0f / (1.0f - p);
    d->seed = seed;
    d->step = 0;
    d->row0 = 0;
    d->row_off = 0;
    d->at = NULL;
    d->active = 0;
    d->work = work;
}

// The first row of micro-batch k of `rank` in the step's global batch of world ranks x grad_accum
// micro-batches of `rows` rows: the loaders hand out micro-batch k of every rank before k + 1
// (textdata.h, imagedata.h), so this is where its sequences sit in one process's accumulation.
static int64_t lora_dropout_row0(int k, int rank, int world, int64_t rows) {
    return ((int64_t)k * world + rank) * rows;
}
