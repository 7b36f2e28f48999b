// nf4.h: QLoRA's 4-bit NormalFloat (NF4) format for frozen weights, with double quantization,
// as bitsandbytes stores it (quant_type "nf4", compress_statistics): the per-element math shared
// by the CPU and CUDA backends (code table, nibble decode, absmax decode, dequantized value), the
// layout of one quantized tensor in one buffer, and the host-side quantizer.
//
// A tensor of n weights, flattened row-major ([out, in]), is cut into blocks of 64:
//   absmax_b = max |w| over block b; code_i = the NF4 value nearest w_i / absmax_b (4 bits);
//   two codes per byte, element 2j in the high nibble, 2j+1 in the low one (bitsandbytes' order).
// Double quantization: offset = mean(absmax) (one fp32 per tensor); absmax - offset is cut into
// blocks of 256 and quantized the same way to 8 bits with bitsandbytes' signed "dynamic" map
// (create_dynamic_map), with an fp32 nested_absmax per 256-block. Dequantization, in fp32 with
// the roundings bitsandbytes makes (two kernels there, so no fused multiply-add):
//   absmax_b = fp32(fp32(dyn[q_b] * nested_absmax[b / 256]) + offset);  w_i = nf4[code_i] * absmax_b
// "Nearest" is exact: a value strictly above the midpoint of two neighbouring codes takes the
// upper one, a value exactly on it the lower one (bitsandbytes' NF4 decision tree compares with
// `>` against midpoints too). A block whose absmax is 0 gets code 7 (0.0) everywhere (bitsandbytes
// would divide by zero). The values are QLoRA's (Dettmers et al. 2023, appendix E), in fp32.
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define NF4_HD __host__ __device__ static inline
#else
#define NF4_HD static inline
#endif

#define NF4_BLOCK 64          // weights per absmax
#define NF4_ABSMAX_BLOCK 256  // absmaxes per nested fp32 absmax
#define NF4_DYN_SIZE 256      // entries of the 8-bit dynamic map
#define NF4_TABLE_FLOATS (16 + NF4_DYN_SIZE)  // the tables buffer: NF4 values, then the dynamic map

#define NF4_VALUES {-1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f, \
                    -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f, \
                    0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f, \
                    0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f}

// One quantized tensor of n weights in one buffer (offsets from its start; host or device memory):
//   [0, n2)           packed codes, n2 = ceil(n / 2)
//   [qa, qa + nb)     8-bit absmax codes, nb = ceil(n / 64), qa = n2 rounded up to 16
//   [na, na + 4 nn)   fp32 nested absmax, nn = ceil(nb / 256), na = qa + nb rounded up to 16
//   [na + 4 nn, +4)   fp32 offset
typedef struct {
    int64_t n, nb, nn;
    uint8_t* codes;
    uint8_t* qabsmax;
    float* nested;
    float* offset;
} Nf4View;

NF4_HD int64_t nf4_round16(int64_t x) { return (x + 15) & ~(int64_t)15; }
NF4_HD int64_t nf4_blocks(int64_t n) { return (n + NF4_BLOCK - 1) / NF4_BLOCK; }
NF4_HD int64_t nf4_nested_blocks(int64_t n) { return (nf4_blocks(n) + NF4_ABSMAX_BLOCK - 1) / NF4_ABSMAX_BLOCK; }
NF4_HD int64_t nf4_qabsmax_at(int64_t n) { return nf4_round16((n + 1) / 2); }
NF4_HD int64_t nf4_nested_at(int64_t n) { return nf4_round16(nf4_qabsmax_at(n) + nf4_blocks(n)); }
// Bytes of one quantized tensor: 0.5 per weight, 1 per 64 weights, 4 per 16,384 weights, 4, and
// at most 30 bytes of alignment.
NF4_HD int64_t nf4_tensor_bytes(int64_t n) { return nf4_nested_at(n) + 4 * nf4_nested_blocks(n) + 4; }

NF4_HD Nf4View nf4_view(void* buf, int64_t n) {
    uint8_t* p = (uint8_t*)buf;
    Nf4View v;
    v.n = n;
    v.nb = nf4_blocks(n);
    v.nn = nf4_nested_blocks(n);
    v.codes = p;
    v.qabsmax = p + nf4_qabsmax_at(n);
    v.nested = (float*)(p + nf4_nested_at(n));
    v.offset = v.nested + v.nn;
    return v;
}

// The 4-bit code of element i: the high nibble for even i, the low one for odd i.
NF4_HD int nf4_code_at(const uint8_t* codes, int64_t i) {
    uint8_t b = codes[i >> 1];
    return (i & 1) ? (b & 15) : (b >> 4);
}

// fp32 a * b + c with the product rounded first (never fused): bitsandbytes forms the product in
// one kernel and adds the offset in another.
NF4_HD float nf4_mul_add_unfused(float a, float b, float c) {
#ifdef __CUDA_ARCH__
    return __fadd_rn(__fmul_rn(a, b), c);
#else
    volatile float p = a * b;  // volatile: the host compiler may not contract it into an fma
    return p + c;
#endif
}

// The dequantized absmax of block b. dyn: the 256-entry dynamic map.
NF4_HD float nf4_absmax_at(const uint8_t* qabsmax, const float* nested, float offset, const float* dyn, int64_t b) {
    return nf4_mul_add_unfused(dyn[qabsmax[b]], nested[b / NF4_ABSMAX_BLOCK], offset);
}

// ---- host side -----------------------------------------------------------------------------------

// The tables buffer: NF4's 16 values, then bitsandbytes' signed dynamic map (create_dynamic_map
// with 7 exponent bits): for i = 0..6, the midpoints of linspace(0.1, 1, 2^i + 1) times 10^(i-6),
// with both signs; then 0 and 1; sorted. Computed in double and rounded once to fp32
// (bitsandbytes forms the linspace in fp32: 90 of its 256 entries differ from these by one ulp;
// a bitsandbytes checkpoint carries its own map, which the loader uses).
static void nf4_fill_tables(float* t) {
    static const float nf4[16] = NF4_VALUES;
    memcpy(t, nf4, sizeof(nf4));
    double d[NF4_DYN_SIZE];
    int k = 0;
    for (int i = 0; i < 7; i++) {
        int pts = (1 << i) + 1;
        double scale = pow(10.0, i - 6);
        for (int j = 0; j + 1 < pts; j++) {
            double b0 = 0.1 + j * (0.9 / (pts - 1)), b1 = 0.1 + (j + 1) * (0.9 / (pts - 1));
            double mid = (b0 + b1) / 2.0;
            d[k++] = scale * mid;
            d[k++] = -scale * mid;
        }
    }
    d[k++] = 0.0;
    d[k++] = 1.0;
    for (int i = 1; i < k; i++)  // insertion sort: 256 entries, once
        for (int j = i; j > 0 && d[j - 1] > d[j]; j--) { double s = d[j]; d[j] = d[j - 1]; d[j - 1] = s; }
    for (int i = 0; i < NF4_DYN_SIZE; i++) t[16 + i] = (float)d[i];
}

// The index of the entry of sorted table c[0..n) nearest x: the count of midpoints x lies strictly
// above (midpoints exact in double: the sum of two fp32 values in [-1, 1] is exact there).
static int nf4_nearest(float x, const float* c, int n) {
    int lo = 0, hi = n - 1;  // answer in [lo, hi]
    while (lo < hi) {
        int m = (lo + hi) / 2;
        if ((double)x > ((double)c[m] + (double)c[m + 1]) * 0.5) lo = m + 1;
        else hi = m;
    }
    return lo;
}

// Quantizes n fp32 weights into the view (its buffer nf4_tensor_bytes(n) bytes) with the tables'
// NF4 values and dynamic map. absmax: scratch of nf4_blocks(n) floats.
static void nf4_quantize(Nf4View q, const float* w, const float* tables, float* absmax) {
    const float* nf4 = tables;
    const float* dyn = tables + 16;
    memset(q.codes, 0, (size_t)((q.n + 1) / 2));
    double sum = 0.0;
    for (int64_t b = 0; b < q.nb; b++) {
        int64_t i0 = b * NF4_BLOCK, i1 = i0 + NF4_BLOCK < q.n ? i0 + NF4_BLOCK : q.n;
        float m = 0.0f;
        for (int64_t i = i0; i < i1; i++) m = fabsf(w[i]) > m ? fabsf(w[i]) : m;
        absmax[b] = m;
        sum += m;
        float inv = m > 0.0f ? 1.0f / m : 0.0f;  // bitsandbytes multiplies by the reciprocal
        for (int64_t i = i0; i < i1; i++) {
            int c = m > 0.0f ? nf4_nearest(w[i] * inv, nf4, 16) : 7;
            q.codes[i >> 1] |= (uint8_t)((i & 1) ? c : c << 4);
        }
    }
    float offset = (float)(sum / (double)q.nb);
    *q.offset = offset;
    for (int64_t k = 0; k < q.nn; k++) {
        int64_t b0 = k * NF4_ABSMAX_BLOCK, b1 = b0 + NF4_ABSMAX_BLOCK < q.nb ? b0 + NF4_ABSMAX_BLOCK : q.nb;
        float m = 0.0f;
        for (int64_t b = b0; b < b1; b++) m = fabsf(absmax[b] - offset) > m ? fabsf(absmax[b] - offset) : m;
        q.nested[k] = m;
        float inv = m > 0.0f ? 1.0f / m : 0.0f;
        for (int64_t b = b0; b < b1; b++)
            q.qabsmax[b] = (uint8_t)nf4_nearest((absmax[b] - offset) * inv, dyn, NF4_DYN_SIZE);
    }
}

// The fp32 weights of a quantized tensor: the CPU backend's dequantization (and the CUDA
// kernel's twin, which rounds the same values to bf16).
static void nf4_dequantize(float* w, Nf4View q, const float* tables) {
    const float* nf4 = tables;
    const float* dyn = tables + 16;
    float offset = *q.offset;
#pragma omp parallel for schedule(static) if (q.n > (1 << 16))
    for (int64_t b = 0; b < q.nb; b++) {
        float a = nf4_absmax_at(q.qabsmax, q.nested, offset, dyn, b);
        int64_t i1 = (b + 1) * NF4_BLOCK < q.n ? (b + 1) * NF4_BLOCK : q.n;
        for (int64_t i = b * NF4_BLOCK; i < i1; i++) w[i] = nf4[nf4_code_at(q.codes, i)] * a;
    }
}
