// resample.h: 2-D interpolation with exactly the sampling rule of PyTorch's
// F.interpolate(..., align_corners=False, antialias=False) given an output size, so that the
// PyTorch reference (test/model/reference_vit.py) can reproduce it:
//   bilinear  the image loader's resize to the model's resolution (llmc/vision/imagedata.h)
//   bicubic   the position-embedding grid at a new fine-tuning resolution (llmc/models/vit_io.h), as
//             Hugging Face's interpolate_pos_encoding does (Keys kernel, A = -0.75)
// Both are separable: per output coordinate a few taps (input indices, clamped to the border)
// and weights are computed once per axis, then applied to every channel.
#pragma once
#include <math.h>
#include <stdint.h>
#include "../common.h"

// Source coordinate of output index i: (i + 0.5) * in/out - 0.5 (pixel centres aligned).
static inline double resample_src(int i, int in, int out) { return (i + 0.5) * ((double)in / out) - 0.5; }

typedef struct {
    int idx[4];
    float w[4];
} ResampleTaps;  // out[i] = sum_k w[k] * in[idx[k]]; bilinear uses k < 2

// Bilinear: a negative source coordinate is clamped to 0 (PyTorch does so for linear modes only).
static void bilinear_taps(ResampleTaps* t, int in, int out) {
    for (int i = 0; i < out; i++) {
        double src = resample_src(i, in, out);
        if (src < 0) src = 0;
        int i0 = (int)src;  // floor, src >= 0
        if (i0 > in - 1) i0 = in - 1;
        double l1 = src - i0;
        memset(&t[i], 0, sizeof(t[i]));
        t[i].idx[0] = i0;
        t[i].idx[1] = i0 < in - 1 ? i0 + 1 : i0;
        t[i].w[0] = (float)(1.0 - l1);
        t[i].w[1] = (float)l1;
    }
}

// Keys' cubic convolution kernel with A = -0.75 (PyTorch's choice), |x| <= 1 and 1 < |x| < 2.
static inline double cubic_near(double x, double A) { return ((A + 2) * x - (A + 3)) * x * x + 1; }
static inline double cubic_far(double x, double A) { return ((A * x - 5 * A) * x + 8 * A) * x - 4 * A; }

// Bicubic: taps floor(src)-1 .. floor(src)+2, each clamped into [0, in-1]; src is not clamped.
static void bicubic_taps(ResampleTaps* t, int in, int out) {
    const double A = -0.75;
    for (int i = 0; i < out; i++) {
        double src = resample_src(i, in, out);
        int i0 = (int)floor(src);
        double f = src - i0;
        double w[4] = {cubic_far(f + 1.0, A), cubic_near(f, A), cubic_near(1.0 - f, A), cubic_far(2.0 - f, A)};
        for (int k = 0; k < 4; k++) {
            int j = i0 - 1 + k;
            t[i].idx[k] = j < 0 ? 0 : j > in - 1 ? in - 1 : j;
            t[i].w[k] = (float)w[k];
        }
    }
}

// out[oh, ow, c] from in[ih, iw, c] (channels last, C contiguous), `ntaps` taps per axis.
static void resample_hwc(float* out, const float* in, int ih, int iw, int oh, int ow, int C, const ResampleTaps* ty,
                         const ResampleTaps* tx, int ntaps) {
#pragma omp parallel for schedule(static)
    for (int y = 0; y < oh; y++)
        for (int x = 0; x < ow; x++) {
            float* o = out + ((int64_t)y * ow + x) * C;
            for (int c = 0; c < C; c++) o[c] = 0.0f;
            for (int a = 0; a < ntaps; a++) {
                for (int b = 0; b < ntaps; b++) {
                    float w = ty[y].w[a] * tx[x].w[b];
                    const float* s = in + ((int64_t)ty[y].idx[a] * iw + tx[x].idx[b]) * C;
                    for (int c = 0; c < C; c++) o[c] += w * s[c];
                }
            }
        }
}

// Bicubic resize of a [ih, iw, C] grid to [oh, ow, C] (the position-embedding grid).
static void bicubic_resize_hwc(float* out, const float* in, int ih, int iw, int oh, int ow, int C) {
    ResampleTaps* ty = (ResampleTaps*)xmalloc(sizeof(ResampleTaps) * oh);
    ResampleTaps* tx = (ResampleTaps*)xmalloc(sizeof(ResampleTaps) * ow);
    bicubic_taps(ty, ih, oh);
    bicubic_taps(tx, iw, ow);
    resample_hwc(out, in, ih, iw, oh, ow, C, ty, tx, 4);
    free(ty);
    free(tx);
}
