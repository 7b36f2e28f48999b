// cuda/attention_cudnn.h: the interface of llmc/cuda/attention_cudnn.cu, attention forward and
// backward through cuDNN's fused flash attention (SDPA), compiled in its own translation unit and
// linked only when make finds cuDNN and its C++ frontend (the build defines LLMC_HAVE_CUDNN then).
// Same layout and meaning as the in-house kernels (llmc/cuda/attention.cuh, attention_gemm.cuh):
// q and o [B*T, H*hd], k and v [B*T, KVH*hd] in bf16 (token n = b*T + t, head h at columns h*hd,
// query head h reads kv head h / (H/KVH)), lse [B, H, T] fp32, the natural-log log-sum-exp of each
// query row's scaled scores: the statistic cuDNN saves for its backward ("Stats"), so a forward of
// one path and a backward of another agree.
// Packed examples (several documents per row, llmc/attn_docs.h) run as cuDNN's ragged layout: each
// document one entry of cuDNN's batch (docs_batch entries of at most docs_len tokens), described
// by the AttnDocs arrays in device memory (lengths, and the offsets of each entry's rows in q/k/v/o
// and their gradients), causal within the entry. Their statistics are then token-major, [B*T, H]
// (the layout cuDNN's ragged backward sizes its workspace for): the caller (llmc/ops.h) converts
// them from and to lse [B, H, T], so that every path still saves the same lse.
#pragma once
#include <stdint.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include "../attn_docs.h"

typedef struct {
    int B, T, H, KVH, hd;
    int causal;            // 1: query t sees keys 0..t; 0: all T keys
    int docs_batch;        // packed examples: cuDNN's batch of documents (AttnDocs.batch); 0: B rows of T
    int docs_len;          // and its sequence dimension (AttnDocs.max_len bound)
    int window;            // causal: query t sees keys t - window < j <= t (cuDNN's diagonal band left bound; 0: none)
    float scale;           // the scores' scale
} CudnnAttnShape;

// Why cuDNN cannot run shape s (a sentence for the log), or NULL when it may. Pure arithmetic (no
// GPU, no cuDNN call): head dims, grouping, sizes.
const char* attention_cudnn_refusal(CudnnAttnShape s);

// Builds (once per shape, then cached) the forward and backward graphs and their plans, and
// returns the workspace bytes the larger of the two needs; -1 with *why set when cuDNN has no
// engine for the shape on this GPU. Needs the GPU (cuDNN's heuristics ask the device).
int64_t attention_cudnn_prepare(CudnnAttnShape s, const char** why);

// o, lse = attention(q, k, v); work: at least attention_cudnn_prepare(s) bytes. docs: the
// documents' arrays when s.docs_batch > 0 (lse then token-major [B*T, H]), else NULL.
void attention_cudnn_forward(__nv_bfloat16* o, float* lse, const __nv_bfloat16* q, const __nv_bfloat16* k,
                             const __nv_bfloat16* v, CudnnAttnShape s, const AttnDocs* docs, void* work,
                             cudaStream_t st);

// dq, dk, dv from dout and the forward's q, k, v, o and lse (all written, none accumulated).
void attention_cudnn_backward(__nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, const __nv_bfloat16* dout,
                              const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                              const __nv_bfloat16* o, const float* lse, CudnnAttnShape s, const AttnDocs* docs,
                              void* work, cudaStream_t st);

// Whether this cuDNN takes zero-length entries in a ragged batch (9.25 and later; before, an entry
// of length 0 gives NaN rows): then the caller may pad its batch of documents to a fixed size.
int attention_cudnn_takes_empty_documents(void);

// cuDNN's version as "9.19.0" (the library loaded, not the header), for the trainers' attention line.
const char* attention_cudnn_version(void);
