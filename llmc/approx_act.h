// approx_act.h: the per-element math of the paper's approximate activations, shared by the CPU
// and CUDA backends: exact SiLU/GELU forward, the 2-bit code rule of ReSiLU2/ReGELU2, the four
// derivative levels, and the 4-codes-per-byte packing (element i in byte i>>2, bits 2*(i&3)).
// Constants: docs/architecture.md, the method (fitted sums of 3 ReLUs).
#pragma once
#include <math.h>
#include <stdint.h>

#ifdef __CUDACC__
#define HD __host__ __device__ static inline
#else
#define HD static inline
#endif

typedef struct { float a1, a2, a3, c1, c2, c3; } Relu3Fit;

#define RESILU2_FIT {-0.04060357190528599f, 1.080925428529668f, -0.040321856624382146f, \
                     -6.3050461001646445f, -0.0008684942046214787f, 6.325815242089708f}
#define REGELU2_FIT {-0.04922261145617846f, 1.0979632065417297f, -0.048740595085551286f, \
                     -3.1858810036855245f, -0.001178821281161997f, 3.190832613414926f}

HD float silu_f(float x) { return x / (1.0f + expf(-x)); }
HD float silu_grad_f(float x) {
    float s = 1.0f / (1.0f + expf(-x));
    return s * (1.0f + x * (1.0f - s));
}
HD float gelu_f(float x) { return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f)); }
HD float gelu_grad_f(float x) {
    return 0.5f * (1.0f + erff(x * 0.70710678118654752f)) + x * 0.39894228040143268f * expf(-0.5f * x * x);
}
// tanh-form GELU, for checkpoints that declare gelu_pytorch_tanh / gelu_new.
HD float gelu_tanh_f(float x) {
    const float k = 0.79788456080286536f;  // sqrt(2/pi)
    return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
}
HD float gelu_tanh_grad_f(float x) {
    const float k = 0.79788456080286536f;
    float t = tanhf(k * (x + 0.044715f * x * x * x));
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * k * (1.0f + 3.0f * 0.044715f * x * x);
}

// code = [x > c1] + [x > c2] + [x > c3], strict comparisons: a value in {0,1,2,3}.
HD uint8_t relu3_code(float x, Relu3Fit fit) {
    return (uint8_t)((x > fit.c1) + (x > fit.c2) + (x > fit.c3));
}

// The derivative level of a code: L = {0, a1, a1+a2, a1+a2+a3}, summed in fp32 like the reference.
HD float relu3_level(uint8_t code, Relu3Fit fit) {
    float l1 = fit.a1, l2 = l1 + fit.a2, l3 = l2 + fit.a3;
    return code == 0 ? 0.0f : code == 1 ? l1 : code == 2 ? l2 : l3;
}

HD uint8_t codes_get(const uint8_t* packed, int64_t i) { return (packed[i >> 2] >> (2 * (i & 3))) & 3; }

// Packs 4 codes (element i..i+3, fewer at a ragged tail) into one byte.
HD uint8_t codes_pack4(const uint8_t* codes, int n) {
    uint8_t b = 0;
    for (int k = 0; k < n && k < 4; k++) b |= (uint8_t)(codes[k] << (2 * k));
    return b;
}

static inline int64_t packed_codes_bytes(int64_t n) { return (n + 3) / 4; }
