// attn_docs.h: a packed micro-batch's documents as cuDNN's ragged ("THD") attention takes them.
// Pure host arithmetic on the batch's positions (no CUDA, no cuDNN): the trainer fills the arrays
// at each upload (llmc/models/llama_batch.h's llama_upload_batch), they travel to the device with the batch,
// and llmc/cuda/attention_cudnn.cu describes q, k, v, o and their gradients by them.
//
// A packed row holds several documents back to back; a document starts where the position is 0
// (the row's first token always is one) and runs while the position counts up by one: the
// document mask of llmc/cpu/attention.h (query t sees keys t - pos[t] .. t) is then causal
// attention within each document, which is what cuDNN's padding mask with per-entry sequence
// lengths, ragged offsets and a causal band computes when each document is one entry of its
// batch. Documents never cross rows (the loader restarts positions at each window), so the whole
// micro-batch is one list of documents, row after row: entry d covers tokens
// [start_d, start_d + len_d) of the [B*T, ...] activations.
//
// Positions of another shape (a run not starting at 0, a jump) have no such partition and are
// refused (attn_docs_count says why in one line); the caller runs them on the GEMM path.
//
// The arrays, one buffer (attn_docs_bytes for a capacity of `cap` entries: cap = B*T, a document
// per token at most), int64 first for alignment:
//   off_q     [cap+1] int64  start token * H*hd: q, o and their gradients ([N, H*hd] bf16)
//   off_kv    [cap+1] int64  start token * KVH*hd: k, v and their gradients
//   off_stats [cap+1] int64  start token * H: the statistics in token-major [N, H] fp32
//   seq_len   [cap]   int32  each entry's length (queries and keys alike)
// Entry `docs` onwards (up to the cuDNN batch, when it is padded) has length 0 and every offset
// at the end of the tokens, so the offsets stay a non-decreasing prefix sum.
#pragma once
#include <stdint.h>
#include <stddef.h>

typedef struct AttnDocs {
    int docs;            // documents in the micro-batch
    int batch;           // cuDNN's batch: docs, or more (zero-length entries past them)
    int max_len;         // cuDNN's sequence dimension: >= every document's length
    int64_t tokens;      // B*T of the micro-batch
    int64_t *off_q, *off_kv, *off_stats;  // device arrays (see above)
    int32_t* seq_len;
    const char* why;     // non-NULL: this micro-batch is not mapped (why, for the one-line refusal)
} AttnDocs;

typedef struct {
    int64_t *off_q, *off_kv, *off_stats;
    int32_t* seq_len;
} AttnDocArrays;

static inline size_t attn_docs_bytes(int64_t cap) { return (size_t)(3 * (cap + 1)) * 8 + (size_t)cap * 4; }

// The arrays' places in one buffer of attn_docs_bytes(cap).
static inline AttnDocArrays attn_docs_arrays(void* buf, int64_t cap) {
    AttnDocArrays a;
    a.off_q = (int64_t*)buf;
    a.off_kv = a.off_q + cap + 1;
    a.off_stats = a.off_kv + cap + 1;
    a.seq_len = (int32_t*)(a.off_stats + cap + 1);
    return a;
}

// Documents in the B rows of T positions: their count, and *max_len their longest; -1 with *why
// set when the positions are not documents one after another (see above).
static inline int attn_docs_count(const int* pos, int B, int T, int* max_len, const char** why) {
    int docs = 0, longest = 0;
    for (int b = 0; b < B; b++) {
        const int* p = pos + (int64_t)b * T;
        if (T > 0 && p[0] != 0) {
            *why = "a row whose first position is not 0";
            return -1;
        }
        int len = 0;
        for (int t = 0; t < T; t++) {
            if (p[t] == 0) {
                docs++;
                len = 0;
            } else if (p[t] != p[t - 1] + 1) {
                *why = "positions that neither restart at 0 nor count up by one";
                return -1;
            }
            len++;
            if (len > longest) longest = len;
        }
    }
    *max_len = longest;
    *why = NULL;
    return docs;
}

// The arrays for the B x T positions (whose documents attn_docs_count counted: docs <= batch)
// as cuDNN's `batch` entries, the rest zero-length; H, KVH query and key/value heads of hd.
static inline void attn_docs_fill(AttnDocArrays a, const int* pos, int B, int T, int batch, int H, int KVH, int hd) {
    int64_t N = (int64_t)B * T;
    int d = 0;
    for (int64_t n = 0; n <= N; n++) {
        if (n < N && pos[n] != 0) continue;
        if (d > 0) a.seq_len[d - 1] = (int32_t)(n - a.off_stats[d - 1] / H);
        if (n == N) break;
        a.off_q[d] = n * H * hd;
        a.off_kv[d] = n * KVH * hd;
        a.off_stats[d] = n * H;
        d++;
    }
    for (; d <= batch; d++) {  // the zero-length entries and the end of the last one
        if (d < batch) a.seq_len[d] = 0;
        a.off_q[d] = N * H * hd;
        a.off_kv[d] = N * KVH * hd;
        a.off_stats[d] = N * H;
    }
}
