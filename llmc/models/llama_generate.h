// llama_generate.h: sampling from the LLaMA model with a key/value cache (--generate, --prompt,
// --chat): the prompt fed once, then one token per step through block_forward's cached attention.
#pragma once
#include "llama.h"
#include "llama_batch.h"
#include "../text/model_tokenizer.h"

static int sample_token(const float* logits, int V, float temperature, Rng* rng) {
    int best = 0;
    for (int v = 1; v < V; v++) if (logits[v] > logits[best]) best = v;
    if (temperature <= 0.0f) return best;
    double sum = 0.0;
    for (int v = 0; v < V; v++) sum += exp((logits[v] - logits[best]) / temperature);
    double u = rng_uniform(rng) * sum, acc = 0.0;
    for (int v = 0; v < V; v++) {
        acc += exp((logits[v] - logits[best]) / temperature);
        if (acc >= u) return v;
    }
    return V - 1;
}

// Samples n tokens after the prompt with a key/value cache: the prompt is fed once, then one
// token per step. The trainer's buffers hold one sequence of m->T tokens (the window); when the
// cache is full, it restarts from the last half window (positions then count from there).
// LLMC_NO_KV_CACHE=1 recomputes the whole window for every token instead (tests compare the two).
// The cache and the logits are buffers of the plan (TrainModes.generate).
// chat: prompt is a rendered chat template, fed as it stands (no BOS added).
static void llama_generate(Llama* m, const ModelTokenizer* tok, const char* prompt, int chat, int n, float temperature,
                           uint64_t seed) {
    const LlamaConfig* c = &m->cfg;
    const Backend* be = m->be;
    int len, window = m->T;
    int* prompt_ids =
        chat ? model_tokenizer_encode_plain(tok, prompt, &len) : model_tokenizer_encode(tok, prompt, &len);
    if (len == 0)
        fail(chat ? "flag --chat: the chat template rendered nothing to start from"
                  : "flag --prompt: empty, and the tokenizer adds no BOS to start from");
    int* ids = (int*)xmalloc(sizeof(int) * (len + n));
    memcpy(ids, prompt_ids, sizeof(int) * len);
    free(prompt_ids);
    int recompute = setting_on(SETTING_NO_KV_CACHE);  // the tests compare the window recomputed per token
    int64_t d = c->dim;
    if (!m->modes.generate) fail("internal: llama_generate needs a plan made with TrainModes.generate");
    KVCache kv = {m->scratch.kv_k, m->scratch.kv_v, 0, window};
    float* logits = m->scratch.gen_logits;
    float* last = (float*)xmalloc(sizeof(float) * c->vocab);
    Rng rng = rng_seeded(seed, 99);
    char bb[2];
    printf("%s", prompt);
    int fed = 0;  // ids[0, fed) are in the cache
    for (int i = 0; i < n; i++) {
        if (recompute || kv.len + (len - fed) > window) {  // (re)start the window
            kv.len = 0;
            int keep = recompute ? window : window / 2 > 0 ? window / 2 : 1;  // a window of 1 keeps its 1 token
            fed = len - keep;
            if (fed < 0) fed = 0;
        }
        int T = len - fed;
        for (int t = 0; t < T; t++) {
            m->io.h_inputs[t] = ids[fed + t];
            m->io.h_targets[t] = 0;
            m->io.h_mask[t] = 0.0f;
            m->io.h_pos[t] = kv.len + t;
        }
        llama_upload_batch(m, T);
        llama_forward_blocks(m, 1, T, &kv);
        kv.len += T;
        fed = len;
        LossStats st = {};  // the head on the last token only
        LmHead head = llama_lm_head(m);
        head.chunk = 1;
        head.dW = head.dgamma = NULL;
        const char* last_row = (char*)m->scratch.resid + (int64_t)(T - 1) * d * be->abytes;
        LmHeadCall call = {last_row, 1, m->io.targets, m->io.mask, 0.0f, NULL, logits, NULL, NULL};
        op_lm_head_loss(be, &head, &call, &st);
        backend_download(be, last, logits, sizeof(float) * c->vocab);
        int next = sample_token(last, c->vocab, temperature, &rng);
        if (model_tokenizer_ends(tok, next)) break;
        printf("%s", model_tokenizer_decode(tok, ids[len - 1], next, bb));
        fflush(stdout);
        ids[len++] = next;
    }
    printf("\n");
    free(ids);
    free(last);
}
