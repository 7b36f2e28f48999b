// llama_batch.h: the LLaMA model's micro-batch on its way to the backend (llmc/models/llama.h's
// LlamaBatch): the tokens, targets, mask and positions staged and uploaded together, and, for a
// batch that packs examples, its documents as cuDNN's ragged attention reads them (llmc/attn_docs.h).
#pragma once
#include "llama.h"

static int pow2_at_least(int x) {
    int p = 1;
    while (p < x) p *= 2;
    return p;
}

// The documents of the first n tokens of the host batch (packed examples) as cuDNN's ragged entries,
// into the host side of docs_buf (uploaded with the batch). cuDNN's sequence dimension is the
// longest document rounded up to a power of two (at most T), and its batch the document count:
// both pick the plan (llmc/cuda/attention_cudnn.cu caches one per pair) and are part of the CUDA
// graph's key. Where cuDNN takes zero-length entries (9.25 on), the batch is padded to a power of
// two and both only ever grow (the largest seen so far), so that a run settles on one plan and one
// graph; before, every document count is its own plan (and graph).
static void llama_describe_documents(Llama* m, int64_t n) {
    AttnDocs* d = &m->io.docs;
    int rows = (int)(n / m->T), max_len = 0, pad = 0;
    const char* why = NULL;
    int docs = (int64_t)rows * m->T == n ? attn_docs_count(m->io.h_pos, rows, m->T, &max_len, &why) : -1;
    if (docs <= 0) {
        snprintf(m->io.docs_why, sizeof(m->io.docs_why),
                 "packed examples whose positions are not documents one after another (%s)",
                 why ? why : "not whole rows");
        d->why = m->io.docs_why;
        return;
    }
#ifdef LLMC_HAVE_CUDNN
    pad = attention_cudnn_takes_empty_documents();
#endif
    int len = pow2_at_least(max_len), batch = docs;
    if (len > m->T) len = m->T;
    if (pad) {
        batch = pow2_at_least(docs);
        if (batch > n) batch = (int)n;
        if (d->batch > batch) batch = d->batch;
        if (d->max_len > len) len = d->max_len;
    }
    int64_t cap = (int64_t)m->B * m->T;
    attn_docs_fill(attn_docs_arrays(m->io.h_docs_buf, cap), m->io.h_pos, rows, m->T, batch, m->cfg.heads,
                   m->cfg.kv_heads,
                   m->cfg.head_dim);
    AttnDocArrays dev = attn_docs_arrays(m->io.docs_buf, cap);
    d->docs = docs;
    d->batch = batch;
    d->max_len = len;
    d->tokens = n;
    d->off_q = dev.off_q;
    d->off_kv = dev.off_kv;
    d->off_stats = dev.off_stats;
    d->seq_len = dev.seq_len;
    d->why = NULL;
}

// Describes the documents and stages the part of each array that cuDNN's batch reads.
static void llama_upload_documents(Llama* m, BatchStaging* s, int64_t n) {
    llama_describe_documents(m, n);
    if (m->io.docs.why) return;
    int64_t cap = (int64_t)m->B * m->T, e = m->io.docs.batch;
    AttnDocArrays h = attn_docs_arrays(m->io.h_docs_buf, cap), dev = attn_docs_arrays(m->io.docs_buf, cap);
    staging_upload(s, dev.off_q, h.off_q, sizeof(int64_t) * (e + 1));
    staging_upload(s, dev.off_kv, h.off_kv, sizeof(int64_t) * (e + 1));
    staging_upload(s, dev.off_stats, h.off_stats, sizeof(int64_t) * (e + 1));
    staging_upload(s, dev.seq_len, h.seq_len, sizeof(int32_t) * e);
}


// The first n tokens of the host batch to the backend.
static void llama_upload_batch(Llama* m, int64_t n) {
    m->io.pos_restarts = 0;  // positions 0..T-1 in every row: no document mask (cuDNN's attention can take it)
    for (int64_t i = 0; i < n && !m->io.pos_restarts; i++) m->io.pos_restarts = m->io.h_pos[i] != i % m->T;
    BatchStaging* s = &m->io.staging;
    staging_begin(s);
    staging_upload(s, m->io.inputs, m->io.h_inputs, sizeof(int) * n);
    staging_upload(s, m->io.targets, m->io.h_targets, sizeof(int) * n);
    staging_upload(s, m->io.mask, m->io.h_mask, sizeof(float) * n);
    staging_upload(s, m->io.pos, m->io.h_pos, sizeof(int) * n);
    if (m->io.pos_restarts && m->io.docs_buf) llama_upload_documents(m, s, n);
    if (m->sp.P > 1) staging_upload(s, m->sp.pos, m->sp.h_pos, sizeof(int) * m->sp.N);  // every token's position
    batch_values_stage(&m->io.bv, s, &m->drop);  // the step's loss scale and dropout key (train)
    if (m->io.embed_order) {
        embedding_token_order(m->io.h_embed_order, m->io.h_inputs, n);
        staging_upload(s, m->io.embed_order, m->io.h_embed_order, sizeof(int) * n);
    }
    staging_end(s);
}
