// cuda/attention_cudnn.h: the interface of llmc/cuda/attention_cudnn.cu, attention forward and
// backward through cuDNN's fused flash attention (SDPA), compiled in its own translation unit and
// linked only when make finds cuDNN and its C++ frontend (the build defines LLMC_HAVE_CUDNN then).
// Same layout and meaning as the in-house kernels (llmc/cuda/attention.cuh, attention_gemm.cuh):
// q and o [B*T, H*hd], k and v [B*T, KVH*hd] in bf16 (token n = b*T + t, head h at columns h*hd,
// query head h reads kv head h / (H/KVH)), lse [B, H, T] fp32, the natural-log log-sum-exp of each
// query row's scaled scores: the statistic cuDNN saves for its backward ("Stats"), so a forward of
// one path and a backward of another agree. Packed examples (document masks) are not taken: the
// caller (llmc/ops.h) sends those to the GEMM path.
#pragma once
#include <stdint.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>

typedef struct {
    int B, T, H, KVH, hd;
    int causal;            // 1: query t sees keys 0..t; 0: all T keys
} CudnnAttnShape;

// Why cuDNN cannot run shape s (a sentence for the log), or NULL when it may. Pure arithmetic (no
// GPU, no cuDNN call): head dims, grouping, sizes.
const char* attention_cudnn_refusal(CudnnAttnShape s);

// Builds (once per shape, then cached) the forward and backward graphs and their plans, and
// returns the workspace bytes the larger of the two needs; -1 with *why set when cuDNN has no
// engine for the shape on this GPU. Needs the GPU (cuDNN's heuristics ask the device).
int64_t attention_cudnn_prepare(CudnnAttnShape s, const char** why);

// o, lse = attention(q, k, v); work: at least attention_cudnn_prepare(s) bytes.
void attention_cudnn_forward(__nv_bfloat16* o, float* lse, const __nv_bfloat16* q, const __nv_bfloat16* k,
                             const __nv_bfloat16* v, CudnnAttnShape s, void* work, cudaStream_t st);

// dq, dk, dv from dout and the forward's q, k, v, o and lse (all written, none accumulated).
void attention_cudnn_backward(__nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, const __nv_bfloat16* dout,
                              const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                              const __nv_bfloat16* o, const float* lse, CudnnAttnShape s, void* work,
                              cudaStream_t st);

// cuDNN's version as "9.19.0" (the library loaded, not the header), for the trainers' attention line.
const char* attention_cudnn_version(void);
