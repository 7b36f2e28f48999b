// norm_math.h: the per-row and per-element math of RMSNorm and LayerNorm that the CPU and CUDA
// backends share, written so that no finite input overflows it:
//   - the inverse RMS r = 1/sqrt(ss/d + eps) from a row's sum of squares ss, and
//   - the normalised value z = (x - mean) * r;
// and the test of a row whose statistics left fp32's range, the sign of a diverged run.
// Both keep the fp32 arithmetic the kernels have always used wherever it stays in range, so results
// in the normal range are the same bits as before; only a row beyond it takes fp64. Why: a finite
// |x| above ~1.8e19 has a square beyond fp32 (FLT_MAX ~3.4e38), so an fp32 mean square overflows
// to inf and r becomes 0: every later output is 0 and the run silently collapses (issue 13, item
// 5). fp64 holds d times the square of every finite float (d * 1.2e77 << 1.8e308).
// Limit: once the row's RMS passes 1/FLT_MIN ~8.5e37, r itself is an fp32 subnormal and z keeps
// fewer bits (r is stored in fp32 for the backward).
#pragma once
#include <math.h>

#ifdef __CUDACC__
#define NORM_HD __host__ __device__ static inline
#else
#define NORM_HD static inline
#endif

// r = 1/sqrt(ss/d + eps) from the row's fp64 sum of squares: the mean square rounded to fp32 and
// the rest in fp32, as ever, unless that mean square is beyond fp32's range; then all in fp64.
NORM_HD float norm_inv_rms(double ss, int d, float eps) {
    float ms = (float)(ss / d);
    if (isinf(ms)) return (float)(1.0 / sqrt(ss / d + (double)eps));
    return 1.0f / sqrtf(ms + eps);
}

// z = (x - mean) * r. The fp32 difference overflows only when |x| or |mean| exceeds FLT_MAX / 2;
// such an element is formed in fp64 and rounded once.
NORM_HD float norm_normalise(float x, float mean, float r) {
    float c = x - mean;
    if (isinf(c)) return (float)(((double)x - mean) * r);
    return c * r;
}

// A row whose mean square is beyond fp32's range: RMS above 2^64 ~1.8e19 (mean square above 2^128,
// past FLT_MAX), i.e. r below 2^-64 (r = 0 too: an infinite input). Trained networks keep their activations many
// orders of magnitude below (a LLaMA residual stream stays under ~1e4): only weights that have
// diverged put a norm's input there, so the trainers stop on it (llmc/train/health.h). NaN is not
// counted: the non-finite check owns it.
#define NORM_OVERFLOW_INV_RMS 0x1p-64f
NORM_HD int norm_stats_overflowed(float r) { return r < NORM_OVERFLOW_INV_RMS; }
