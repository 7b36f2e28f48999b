// softcap.h: soft-capping y = c tanh(x / c) (Gemma 2's final logits), the per-element math shared by
// the CPU loss (llmc/cpu/loss.h) and its CUDA twin (llmc/cuda/loss.cuh). The backward reads the
// capped value y, not x: dx = dy (1 - (y / c)^2), since tanh' = 1 - tanh^2.
#pragma once

#ifdef __CUDACC__
#define SOFTCAP_HD __host__ __device__ static inline
#else
#define SOFTCAP_HD static inline
#endif

// x / c then tanh then * c, in that order, as transformers' Gemma2ForCausalLM computes it.
SOFTCAP_HD float softcap_f(float x, float c) { return tanhf(x / c) * c; }
SOFTCAP_HD float softcap_grad_f(float dy, float y, float c) {
    float t = y / c;
    return dy * (1.0f - t * t);
}
