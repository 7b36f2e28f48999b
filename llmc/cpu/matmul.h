// cpu/matmul.h: fp32 matrix products of the CPU backend, row-major, OpenMP-parallel.
//   matmul_nt:  C[M,N] (+)= alpha * A[M,K] . B[N,K]^T   (linear forward: x W^T)
//   matmul_nn:  C[M,N] (+)= alpha * A[M,K] . B[K,N]     (input gradients: dy W)
//   matmul_tn:  C[M,N] (+)= alpha * A[K,M]^T . B[K,N]   (weight gradients: dy^T x)
//   mm_gemm:    the general strided form behind all three, also called single-threaded from
//               inside other kernels' parallel loops (attention's blocks)
// All are one GEMM: a 6x16 register-tile micro-kernel (6x32 over two adjacent panels where the
// compiler targets 512-bit vectors: same sums, fewer instructions) runs over B copied into 16-column panels
// (any transposition is just a stride) and over A's rows read in place when they are contiguous,
// else copied into 6-row slivers. Skinny operands (LoRA's r = 16 side) skip the copies: B is read
// in place when its columns are contiguous and few rows of A would reuse a copy, A when one or two
// panels would. A large B (the LM head) is packed in cache-sized rounds (mm_gemm). The work is cut
// into tiles of C (row blocks x column blocks, both ways so that skinny products such as LoRA's
// r-row dA still use every thread), each tile computed by one thread with the k loop in a fixed
// order and the same k blocking, so every element of C gets the same operations in the same order
// whatever the thread count (and whatever the rounds or copies): results do not depend on it.
#pragma once
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
// Threads a product may use from here: 1 inside another parallel region (attention's blocks).
static inline int mm_threads_available(void) { return omp_in_parallel() ? 1 : omp_get_max_threads(); }
#else
static inline int mm_threads_available(void) { return 1; }  // a build without OpenMP (the emulator's scratch checks)
#endif

#define MM_MR 6     // rows of the register tile
#define MM_NR 16    // columns of the register tile (two 8-wide vectors)
#define MM_KC 256   // k block: a packed B panel of KC x 16 floats stays in L1
#define MM_MC 96    // rows of A packed per tile (multiple of MR): 96 KiB at KC, within L2
#define MM_TILE_PANELS 64     // at most 1024 columns per tile: its part of C (MC x 1024) stays in L2
#define MM_WHOLE_B (4 << 20)  // floats: B packed whole (all k blocks at once) up to 16 MiB
#define MM_ROUND_B (1 << 18)  // floats: else B is packed in rounds of about 1 MiB, within L2
#define MM_PARALLEL_FLOPS (1 << 18)  // below this a product runs on one thread: forking costs more

typedef float mm_v8 __attribute__((vector_size(32)));

typedef int mm_i8 __attribute__((vector_size(32)));

// Lanes of two 8-float vectors picked by constant indices (0-7: a's, 8-15: b's): GCC's
// __builtin_shuffle, or clang's __builtin_shufflevector (the fuzzers' compiler).
#if defined(__clang__)
#define MM_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define MM_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (mm_i8){__VA_ARGS__})
#endif

// 8 rows of 8 floats (r[i] = row i) into d[j*NR .. j*NR + 8) = column j: an 8x8 transpose in
// three rounds of shuffles (unpack, pair, halves).
static inline void mm_transpose8(float* d, const mm_v8 r[8]) {
    mm_v8 s[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        s[i] = MM_SHUFFLE(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
        s[i + 1] = MM_SHUFFLE(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    }
    for (int i = 0; i < 8; i += 4) {  // u[i + c] holds columns c and c + 4 of rows i..i+3
        u[i] = MM_SHUFFLE(s[i], s[i + 2], 0, 1, 8, 9, 4, 5, 12, 13);
        u[i + 1] = MM_SHUFFLE(s[i], s[i + 2], 2, 3, 10, 11, 6, 7, 14, 15);
        u[i + 2] = MM_SHUFFLE(s[i + 1], s[i + 3], 0, 1, 8, 9, 4, 5, 12, 13);
        u[i + 3] = MM_SHUFFLE(s[i + 1], s[i + 3], 2, 3, 10, 11, 6, 7, 14, 15);
    }
    for (int c = 0; c < 4; c++) {
        mm_v8 a = MM_SHUFFLE(u[c], u[c + 4], 0, 1, 2, 3, 8, 9, 10, 11);
        mm_v8 b = MM_SHUFFLE(u[c], u[c + 4], 4, 5, 6, 7, 12, 13, 14, 15);
        memcpy(d + c * MM_NR, &a, 32);
        memcpy(d + (c + 4) * MM_NR, &b, 32);
    }
}

// One panel of B: B(k, n) = B[k*sbk + n*sbn] for k in [k0, k0+kc), n in [n0, n0+nn), nn <= NR,
// into dst[k][0..NR) (zero-padded).
static void mm_pack_panel(float* dst, const float* B, int64_t sbk, int64_t sbn, int k0, int kc, int n0, int nn) {
    if (sbn == 1) {
        for (int k = 0; k < kc; k++) {
            float* d = dst + (int64_t)k * MM_NR;
            memcpy(d, B + (int64_t)(k0 + k) * sbk + n0, sizeof(float) * nn);
            for (int j = nn; j < MM_NR; j++) d[j] = 0.0f;
        }
        return;
    }
    // B read along its rows (sbk == 1, x W^T): one source row per column, k contiguous; a full
    // panel goes by 8x8 transposes (a forward product packs all of W: scalar copies cost ~10 %)
    int k8 = nn == MM_NR && sbk == 1 ? kc / 8 * 8 : 0;
    for (int j0 = 0; j0 < MM_NR; j0 += 8)
        for (int k = 0; k < k8; k += 8) {
            mm_v8 r[8];
            for (int i = 0; i < 8; i++) memcpy(&r[i], B + (int64_t)(n0 + j0 + i) * sbn + k0 + k, 32);
            mm_transpose8(dst + (int64_t)k * MM_NR + j0, r);
        }
    for (int j = 0; j < MM_NR; j++) {
        const float* src = B + (int64_t)(n0 + j) * sbn + (int64_t)k0 * sbk;
        if (j < nn) for (int k = k8; k < kc; k++) dst[(int64_t)k * MM_NR + j] = src[(int64_t)k * sbk];
        else for (int k = k8; k < kc; k++) dst[(int64_t)k * MM_NR + j] = 0.0f;
    }
}

// Panels [p0, p1) of B (k block k0, kc; N columns in all) into Bp[panel][k][0..NR), panel counted
// from n = 0 (attention's packed keys and values).
static void mm_pack_b(float* Bp, const float* B, int64_t sbk, int64_t sbn, int k0, int kc, int p0, int p1, int N) {
    for (int p = p0; p < p1; p++)
        mm_pack_panel(Bp + (int64_t)p * kc * MM_NR, B, sbk, sbn, k0, kc, p * MM_NR,
                      N - p * MM_NR < MM_NR ? N - p * MM_NR : MM_NR);
}

// A(m, k) = A[m*sam + k*sak], rows [m0, m0+mc), k in [k0, k0+kc), into MR-row slivers
// (zero-padded): Ap[sliver][k][0..MR).
static void mm_pack_a(float* Ap, const float* A, int64_t sam, int64_t sak, int m0, int mc, int k0, int kc) {
    for (int s = 0; s < (mc + MM_MR - 1) / MM_MR; s++) {
        float* dst = Ap + (int64_t)s * kc * MM_MR;
        if (sam == 1 && s * MM_MR + MM_MR <= mc) {  // A read down its columns (A^T products): MR rows side by side
            for (int k = 0; k < kc; k++)
                memcpy(dst + (int64_t)k * MM_MR, A + (int64_t)(k0 + k) * sak + m0 + s * MM_MR, sizeof(float) * MM_MR);
            continue;
        }
        for (int i = 0; i < MM_MR; i++) {
            int m = s * MM_MR + i;
            if (m >= mc) { for (int k = 0; k < kc; k++) dst[(int64_t)k * MM_MR + i] = 0.0f; continue; }
            const float* src = A + (int64_t)(m0 + m) * sam + (int64_t)k0 * sak;
            for (int k = 0; k < kc; k++) dst[(int64_t)k * MM_MR + i] = src[(int64_t)k * sak];
        }
    }
}

// The 6x16 tile: c = sum_k a(i, k) * b(k, j) in k order, then C = alpha * c (store) or
// C += alpha * c, with a(i, k) = a[i*sa + k*ka] and b(k, j) = b[k*sb + j]: a packed sliver and
// panel (sa = 1, ka = MR, sb = NR) or the operands in place. Always inlined, so the packed calls
// get constant strides. Edge tiles (mm < 6 or nn < 16) go through a local copy.
static inline __attribute__((always_inline)) void mm_kernel_strided(float* C, int64_t ldc, int mm, int nn,
                                                                    const float* a, int64_t sa, int64_t ka,
                                                                    const float* b, int64_t sb, int kc, float alpha,
                                                                    int store) {
    mm_v8 c[MM_MR][2];
    for (int i = 0; i < MM_MR; i++) c[i][0] = c[i][1] = (mm_v8){0, 0, 0, 0, 0, 0, 0, 0};
    for (int k = 0; k < kc; k++) {
        mm_v8 b0, b1;
        memcpy(&b0, b + (int64_t)k * sb, 32);
        memcpy(&b1, b + (int64_t)k * sb + 8, 32);
        const float* ak = a + (int64_t)k * ka;
        for (int i = 0; i < MM_MR; i++) {
            float x = ak[i * sa];
            mm_v8 ai = {x, x, x, x, x, x, x, x};
            c[i][0] += ai * b0;
            c[i][1] += ai * b1;
        }
    }
    mm_v8 al = {alpha, alpha, alpha, alpha, alpha, alpha, alpha, alpha};
    if (mm == MM_MR && nn == MM_NR) {
        for (int i = 0; i < MM_MR; i++) {
            float* ci = C + (int64_t)i * ldc;
            mm_v8 y0 = al * c[i][0], y1 = al * c[i][1];
            if (!store) {
                mm_v8 x0, x1;
                memcpy(&x0, ci, 32);
                memcpy(&x1, ci + 8, 32);
                y0 = x0 + y0;
                y1 = x1 + y1;
            }
            memcpy(ci, &y0, 32);
            memcpy(ci + 8, &y1, 32);
        }
        return;
    }
    float acc[MM_MR][MM_NR];
    for (int i = 0; i < MM_MR; i++) {
        mm_v8 y0 = al * c[i][0], y1 = al * c[i][1];
        memcpy(acc[i], &y0, 32);
        memcpy(acc[i] + 8, &y1, 32);
    }
    for (int i = 0; i < mm; i++) {
        float* ci = C + (int64_t)i * ldc;
        if (store) for (int j = 0; j < nn; j++) ci[j] = acc[i][j];
        else for (int j = 0; j < nn; j++) ci[j] = ci[j] + acc[i][j];
    }
}

#ifdef __AVX512F__
// Two adjacent full tiles at once (6 x 32, panels b0 and b1), for machines with 512-bit vectors:
// the same sums as two mm_kernel_strided calls, element for element and in the same k order (the
// same bits), with one 16-wide load per panel and one broadcast per row feeding two FMAs each,
// half the instructions per FLOP of the 8-wide kernel.
typedef float mm_v16 __attribute__((vector_size(64)));
static inline __attribute__((always_inline)) void mm_kernel_6x32(float* C, int64_t ldc, const float* a, int64_t sa,
                                                                 int64_t ka, const float* b0, const float* b1,
                                                                 int64_t sb, int kc, float alpha, int store) {
    mm_v16 c[MM_MR][2];
    for (int i = 0; i < MM_MR; i++) c[i][0] = c[i][1] = (mm_v16){};
    for (int k = 0; k < kc; k++) {
        mm_v16 x0, x1;
        memcpy(&x0, b0 + (int64_t)k * sb, 64);
        memcpy(&x1, b1 + (int64_t)k * sb, 64);
        const float* ak = a + (int64_t)k * ka;
        for (int i = 0; i < MM_MR; i++) {
            float x = ak[i * sa];
            mm_v16 ai = {x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
            c[i][0] += ai * x0;
            c[i][1] += ai * x1;
        }
    }
    mm_v16 al = {alpha, alpha, alpha, alpha, alpha, alpha, alpha, alpha,
                 alpha, alpha, alpha, alpha, alpha, alpha, alpha, alpha};
    for (int i = 0; i < MM_MR; i++)
        for (int h = 0; h < 2; h++) {
            float* ci = C + (int64_t)i * ldc + h * MM_NR;
            mm_v16 y = al * c[i][h];
            if (!store) {
                mm_v16 x;
                memcpy(&x, ci, 64);
                y = x + y;
            }
            memcpy(ci, &y, 64);
        }
}
#define MM_WIDE 1
#define mm_kernel_wide mm_kernel_6x32
#else
#define MM_WIDE 0
#define mm_kernel_wide(...) ((void)0)  // never reached: b2 stays NULL
#endif

// The tile from a packed sliver a[k][0..MR) and a packed panel b[k][0..NR) (attention's tiles).
static inline __attribute__((always_inline)) void mm_kernel_6x16(float* C, int64_t ldc, int mm, int nn, const float* a,
                                                                 const float* b, int kc, float alpha, int store) {
    mm_kernel_strided(C, ldc, mm, nn, a, 1, MM_MR, b, MM_NR, kc, alpha, store);
}

// One product C[M,N] (+)= alpha * A(m,k) B(k,n), A(m,k) = A[m*sam + k*sak], B(k,n) = B[k*sbk + n*sbn],
// and how mm_gemm runs it.
typedef struct {
    float* C;
    int64_t ldc;
    const float* A;
    int64_t sam, sak;
    const float* B;
    int64_t sbk, sbn;
    int M, N, K, kc0;      // kc0: the k block (the last one may be shorter)
    float alpha;
    int accumulate;
    int direct_a;          // the kernel reads A in place: rows contiguous (sak = 1: six rows
                           // stream from L2 as well as a packed sliver does), or one or two panels
                           // to use it (packing A would cost about as much as using it)
    int direct_b;          // ... and B (columns contiguous, sbn = 1; few rows of A or a short K to
                           // reuse a packed copy)
} MmProduct;

// Rows [m0, m0+mc) x panels [p0, p1) of C, k block kb. Bp: that k block's packed panels, the
// first being panel pb (unused with direct_b). Ap and Be: the thread's scratch for A's packed
// rows and for an edge panel of B read in place (B's columns end inside it).
static void mm_tile(const MmProduct* g, const float* Bp, int pb, float* Ap, float* Be, int m0, int mc, int p0, int p1,
                    int kb) {
    int k0 = kb * g->kc0, kc = g->K - k0 < g->kc0 ? g->K - k0 : g->kc0, store = kb == 0 && !g->accumulate;
    int full = g->direct_a ? mc / MM_MR : 0;  // slivers read in place; the rest is packed
    if (full * MM_MR < mc) mm_pack_a(Ap, g->A, g->sam, g->sak, m0 + full * MM_MR, mc - full * MM_MR, k0, kc);
    for (int p = p0; p < p1; p++) {
        int n0 = p * MM_NR, nn = g->N - n0 < MM_NR ? g->N - n0 : MM_NR;
        const float* b = Be;
        int64_t sb = MM_NR;
        if (!g->direct_b) b = Bp + (int64_t)(p - pb) * kc * MM_NR;
        else if (nn == MM_NR) b = g->B + (int64_t)k0 * g->sbk + n0, sb = g->sbk;
        else mm_pack_panel(Be, g->B, g->sbk, g->sbn, k0, kc, n0, nn);
        // The next panel too when it is full and in this tile (6 x 32 tiles, MM_WIDE machines).
        const float* b2 = NULL;
        if (MM_WIDE && p + 1 < p1 && n0 + 2 * MM_NR <= g->N)
            b2 = g->direct_b ? b + MM_NR : b + (int64_t)kc * MM_NR, p++;
        for (int s = 0; s * MM_MR < mc; s++) {
            int mm = mc - s * MM_MR < MM_MR ? mc - s * MM_MR : MM_MR;
            float* c = g->C + (int64_t)(m0 + s * MM_MR) * g->ldc + n0;
            if (s < full) {
                const float* a = g->A + (int64_t)(m0 + s * MM_MR) * g->sam + (int64_t)k0 * g->sak;
                if (b2) mm_kernel_wide(c, g->ldc, a, g->sam, g->sak, b, b2, sb, kc, g->alpha, store);
                else mm_kernel_strided(c, g->ldc, mm, nn, a, g->sam, g->sak, b, sb, kc, g->alpha, store);
            } else {
                const float* a = Ap + (int64_t)(s - full) * kc * MM_MR;
                if (b2 && mm == MM_MR) mm_kernel_wide(c, g->ldc, a, 1, MM_MR, b, b2, sb, kc, g->alpha, store);
                else {
                    mm_kernel_strided(c, g->ldc, mm, nn, a, 1, MM_MR, b, sb, kc, g->alpha, store);
                    if (b2) mm_kernel_strided(c + MM_NR, g->ldc, mm, MM_NR, a, 1, MM_MR, b2, sb, kc, g->alpha, store);
                }
            }
        }
    }
}

// Item i of a round's packing: panel pr0 + i % np of k block kb0 + i / np, into the round's copy
// Br laid out [k block of the round][panel of the round][k][NR], k blocks rp * NR * kc0 apart.
static void mm_pack_round_item(float* Br, const MmProduct* g, int rp, int pr0, int np, int kb0, int i) {
    int kb = kb0 + i / np, p = pr0 + i % np, k0 = kb * g->kc0, kc = g->K - k0 < g->kc0 ? g->K - k0 : g->kc0,
        n0 = p * MM_NR;
    mm_pack_panel(Br + (int64_t)rp * MM_NR * g->kc0 * (kb - kb0) + (int64_t)(p - pr0) * kc * MM_NR, g->B, g->sbk,
                  g->sbn, k0, kc, n0, g->N - n0 < MM_NR ? g->N - n0 : MM_NR);
}

// C[M,N] (+)= alpha * A(m,k) B(k,n) with A(m,k) = A[m*sam + k*sak], B(k,n) = B[k*sbk + n*sbn], C
// with row stride ldc. parallel = 0 runs on the calling thread (inside another parallel loop).
// K = 0 gives C = 0 (or C unchanged when accumulating).
// B is packed in rounds (unless read in place): all of it at once when it fits MM_WHOLE_B (every
// weight of a small model), else about MM_ROUND_B floats at a time: ranges of columns over all of
// K (the LM head's logits, 49k columns), or, K too long for that (its dz, K = 49k), ranges of k
// blocks over all columns. In a round, tiles of C (row blocks x column blocks) run through the
// round's k blocks with their part of C hot in cache. Two packed copies alternate, so a round
// costs one synchronisation (after its packing; the next round's packing starts as each thread
// finishes its tiles, and the following barrier waits for every tile before anyone reuses a copy).
static void mm_gemm(float* C, int64_t ldc, const float* A, int64_t sam, int64_t sak, const float* B, int64_t sbk,
                    int64_t sbn, int M, int N, int K, float alpha, int accumulate, int parallel) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0) {
        if (!accumulate) for (int i = 0; i < M; i++) memset(C + (int64_t)i * ldc, 0, sizeof(float) * N);
        return;
    }
    int threads = parallel && (double)M * N * K > MM_PARALLEL_FLOPS ? mm_threads_available() : 1;
    parallel = threads > 1;
    int panels = (N + MM_NR - 1) / MM_NR, mblocks = (M + MM_MC - 1) / MM_MC;
    int mcb = ((M + mblocks - 1) / mblocks + MM_MR - 1) / MM_MR * MM_MR;  // rows per block, balanced (<= MC)
    // K in equal blocks of at most KC (576 = 3 x 192, not 256 + 256 + 64).
    int kblocks = (K + MM_KC - 1) / MM_KC, kc0 = (K + kblocks - 1) / kblocks;
    MmProduct g = {C, ldc, A, sam, sak, B, sbk, sbn, M, N, K, kc0, alpha, accumulate, sak == 1 || panels <= 2,
                   sbn == 1 && (M <= 4 * MM_MR || (int64_t)N * K <= (1 << 15))};
    // A round: rp panels x rk k blocks of B.
    int rp = panels, rk = kblocks;
    if (!g.direct_b && (int64_t)panels * MM_NR * K > MM_WHOLE_B) {
        rp = (int)(MM_ROUND_B / ((int64_t)MM_NR * K));
        if (rp < (panels < 16 ? panels : 16)) {  // K too long to keep a useful width: k ranges
            rp = MM_ROUND_B / (MM_NR * kc0);
            rp = rp > panels ? panels : rp < 16 ? 16 : rp;
            rk = (int)(MM_ROUND_B / ((int64_t)rp * MM_NR * kc0));
            rk = rk < 1 ? 1 : rk > kblocks ? kblocks : rk;
        }
        rp = rp > panels ? panels : rp;
    }
    int rounds_n = (panels + rp - 1) / rp, rounds_k = (kblocks + rk - 1) / rk, rounds = rounds_n * rounds_k;
    int64_t copy = g.direct_b ? 0 : (int64_t)rp * MM_NR * kc0 * rk;  // floats of one packed copy
    // A single small copy (a LoRA factor, an attention block) is packed before the threads start:
    // no synchronisation inside the product at all.
    int prepacked = rounds == 1 && copy > 0 && copy <= (1 << 15);
    float* Bp = copy ? (float*)malloc(sizeof(float) * (size_t)copy * (rounds > 1 ? 2 : 1)) : NULL;
    if (prepacked)
        for (int i = 0; i < rk * rp; i++) mm_pack_round_item(Bp, &g, rp, 0, rp, 0, i);
#pragma omp parallel if (parallel)
    {
        float* Ap = (float*)malloc(sizeof(float) * (MM_MC * kc0 + MM_NR * kc0));
        float* Be = Ap + MM_MC * kc0;
        for (int r = 0; r < rounds; r++) {
            int pr0 = r / rounds_k * rp, pr1 = pr0 + rp < panels ? pr0 + rp : panels;  // the round's panels
            int kb0 = r % rounds_k * rk, kb1 = kb0 + rk < kblocks ? kb0 + rk : kblocks;  // and k blocks
            float* Br = copy ? Bp + (r % 2) * copy : NULL;
            if (copy && !prepacked) {
#pragma omp for schedule(static)
                for (int i = 0; i < (kb1 - kb0) * (pr1 - pr0); i++)
                    mm_pack_round_item(Br, &g, rp, pr0, pr1 - pr0, kb0, i);
            }
            // Column blocks only when the row blocks alone leave threads idle or unbalanced: as few
            // as give each thread about four tiles (every extra column block reads the same A block
            // again, or packs it again), and none wider than MM_TILE_PANELS.
            int np = pr1 - pr0, ppb = np < MM_TILE_PANELS ? np : MM_TILE_PANELS;
            if (mblocks < 4 * threads && threads > 1) {
                int want = (4 * threads + mblocks - 1) / mblocks;
                want = want > np ? np : want;
                if ((np + want - 1) / want < ppb) ppb = (np + want - 1) / want;
            }
            int nblocks = (np + ppb - 1) / ppb, tiles = mblocks * nblocks;
#pragma omp for schedule(dynamic) nowait
            for (int t = 0; t < tiles; t++) {  // row blocks fastest: they share the tile's part of B
                int mb = t % mblocks, nb = t / mblocks;
                int m0 = mb * mcb, mc = M - m0 < mcb ? M - m0 : mcb;
                int p0 = pr0 + nb * ppb, p1 = p0 + ppb < pr1 ? p0 + ppb : pr1;
                for (int kb = kb0; kb < kb1; kb++)
                    mm_tile(&g, Br ? Br + (int64_t)rp * MM_NR * kc0 * (kb - kb0) : NULL, pr0, Ap, Be, m0, mc, p0, p1,
                            kb);
            }
        }
        free(Ap);
    }
    free(Bp);
}

static void matmul_nt(float* C, const float* A, const float* B, int M, int N, int K, float alpha, int accumulate) {
    mm_gemm(C, N, A, K, 1, B, 1, K, M, N, K, alpha, accumulate, 1);
}

static void matmul_nn(float* C, const float* A, const float* B, int M, int N, int K, float alpha, int accumulate) {
    mm_gemm(C, N, A, K, 1, B, N, 1, M, N, K, alpha, accumulate, 1);
}

static void matmul_tn(float* C, const float* A, const float* B, int M, int N, int K, float alpha, int accumulate) {
    mm_gemm(C, N, A, 1, M, B, N, 1, M, N, K, alpha, accumulate, 1);
}
