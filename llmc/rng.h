// rng.h: the seeded host random number generator (splitmix64 seeding an xoshiro128+ style
// stream). Everything random (LoRA init, data order, sampling) draws from explicit Rng states so
// that runs are reproducible and the state can be saved in a checkpoint.
#pragma once
#include <math.h>
#include <stdint.h>

typedef struct { uint64_t s; } Rng;

static uint64_t rng_next_u64(Rng* r) {  // splitmix64: tiny state, good enough statistics
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static Rng rng_seeded(uint64_t seed, uint64_t stream) {
    Rng r = {seed * 0x2545F4914F6CDD1Dull + stream};
    rng_next_u64(&r);
    return r;
}

static float rng_uniform(Rng* r) { return (float)((rng_next_u64(r) >> 40) * (1.0 / 16777216.0)); }  // [0, 1)

static float rng_normal(Rng* r) {  // Box-Muller
    double u1 = ((rng_next_u64(r) >> 11) + 1.0) * (1.0 / 9007199254740993.0);
    double u2 = (rng_next_u64(r) >> 11) * (1.0 / 9007199254740992.0);
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

static uint64_t rng_below(Rng* r, uint64_t n) { return n ? rng_next_u64(r) % n : 0; }

// The data order of one epoch: order[0..n) a permutation of 0..n, shuffled (Fisher-Yates) from the
// epoch's own stream of seed, or in order; any epoch can be rebuilt on resume.
static void rng_epoch_order(int64_t* order, int64_t n, int shuffle, uint64_t seed, int64_t epoch) {
    for (int64_t i = 0; i < n; i++) order[i] = i;
    if (!shuffle) return;
    Rng r = rng_seeded(seed, 1000 + (uint64_t)epoch);
    for (int64_t i = n - 1; i > 0; i--) {
        int64_t j = (int64_t)rng_below(&r, (uint64_t)i + 1), t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
}

// The item at a loader's global_index (epochs of n items one after the other): its place in that
// epoch's order, which order[0..n) holds for epoch *order_epoch, rebuilt when the index enters
// another epoch (the token, pair and image loaders' one lookup).
static int64_t rng_epoch_item(int64_t* order, int64_t* order_epoch, int64_t n, int shuffle, uint64_t seed,
                              int64_t global_index) {
    int64_t epoch = global_index / n;
    if (epoch != *order_epoch) {
        rng_epoch_order(order, n, shuffle, seed, epoch);
        *order_epoch = epoch;
    }
    return order[global_index % n];
}
