// textdata.h: token shards and the batch loader. A shard is a 64-byte little-endian header (shard_header.h)
// (magic "LMFT", u32 version 1, u64 count, u32 vocab_size, u32 flags: bit0 = has mask), then
// count uint32 tokens, then count uint8 mask bytes (1 = that token is a prediction target), then,
// when flags bit1 is set (packed instruction data), count uint8 example-start bytes (1 = the
// token begins an example: attention and positions restart there).
// The loader cuts the stream into non-overlapping windows of seq+1 tokens, visits them in a
// seeded random order per epoch, and shards each global batch by rank.
#pragma once
#include "../common.h"
#include "../rng.h"
#include "../formats/checksum.h"
#include "shard_header.h"

typedef struct {
    char* path;
    int64_t count;
    int vocab_size;
    uint32_t* tokens;
    uint8_t* mask;
    uint8_t* starts;       // example starts, or NULL (one continuous stream)
} TokenShard;

static const ShardKind TOKEN_SHARD = {
    TOKEN_SHARD_MAGIC, "token shard", "shard", "IMGS",  // "IMGS": llmc/vision/imagedata.h's, the other trainer's data
    "an image shard (scripts/data/prepare_images.py's, for train_vit), not a token shard (\"LMFT\", made by "
    "scripts/data/prepare_text.py)"};

static void shard_load(TokenShard* s, const char* path, int model_vocab) {
    size_t size;
    uint8_t* buf = (uint8_t*)read_file(path, &size);
    memset(s, 0, sizeof(*s));
    s->path = xstrdup(path);
    ShardHeader h = shard_header_read(buf, size, path, &TOKEN_SHARD);
    uint64_t count = h.count;
    uint32_t flags = h.word;
    if (!(flags & 1)) fail("%s: shard has no loss mask (flags bit 0), expected one", path);
    if (flags & ~3u) fail("%s: unknown shard flags 0x%x (expected bits 0-1)", path, flags);
    uint64_t per_token = (flags & 2) ? 6 : 5;
    if (count > (size - SHARD_HEADER_BYTES) / per_token || SHARD_HEADER_BYTES + count * per_token != size)
        fail("%s: header says %llu tokens, which needs %llu bytes, but the file has %zu (truncated?)", path,
             (unsigned long long)count, (unsigned long long)(SHARD_HEADER_BYTES + count * per_token), size);
    int limit = shard_check_vocab(path, h.vocab, model_vocab);
    s->count = (int64_t)count;
    s->vocab_size = (int)h.vocab;
    s->tokens = (uint32_t*)xmalloc(count * 4 + 4);
    s->mask = (uint8_t*)xmalloc(count + 1);
    memcpy(s->tokens, buf + SHARD_HEADER_BYTES, count * 4);
    memcpy(s->mask, buf + SHARD_HEADER_BYTES + count * 4, count);
    if (flags & 2) {
        s->starts = (uint8_t*)xmalloc(count + 1);
        memcpy(s->starts, buf + SHARD_HEADER_BYTES + count * 5, count);
    }
    free(buf);
    shard_check_token_ids(path, s->tokens, s->count, limit);
}

static void shard_free(TokenShard* s) {
    free(s->path); free(s->tokens); free(s->mask); free(s->starts);
    memset(s, 0, sizeof(*s));
}

// The identity of a shard's contents (checksum.h's Fingerprint), recorded with a saved run so a
// resume on other data of the same size is refused.
static uint64_t shard_fingerprint(const TokenShard* s) {
    Fingerprint f;
    fp_init(&f);
    fp_update(&f, s->tokens, sizeof(uint32_t) * (size_t)s->count);
    if (s->mask) fp_update(&f, s->mask, (size_t)s->count);
    if (s->starts) fp_update(&f, s->starts, (size_t)s->count);
    return fp_final(&f);
}

typedef struct {
    const TokenShard* shard;
    int seq;
    int64_t windows;       // windows of seq+1 tokens, stride seq
    uint64_t seed;
    int shuffle;
    int64_t cursor;        // global index into the sequence of windows over all epochs
    int64_t* order;        // permutation of windows for the current epoch
    int64_t order_epoch;
} TextLoader;

// A shard whose every target is masked has no loss to train on or evaluate (0/0; it trained with
// "loss 0, grad norm 0" and exited 0): refused at load, naming the file. The targets are the
// tokens the loader's windows predict: 1 .. windows * seq.
static void loader_require_targets(const TextLoader* L) {
    int64_t last = L->windows * L->seq;
    for (int64_t i = 1; i <= last; i++)
        if (L->shard->mask[i]) return;
    fail(
        "%s: every target is masked (the loss mask is 0 at all %lld tokens the batches predict): nothing to train on "
        "or "
        "evaluate; prompt/response data with empty responses?",
        L->shard->path, (long long)last);
}

static void loader_init(TextLoader* L, const TokenShard* s, int seq, uint64_t seed, int shuffle) {
    memset(L, 0, sizeof(*L));
    if (s->count < seq + 1)
        fail("%s: holds %lld tokens, fewer than --seq + 1 = %d", s->path, (long long)s->count, seq + 1);
    L->shard = s;
    L->seq = seq;
    L->windows = (s->count - 1) / seq;
    L->seed = seed;
    L->shuffle = shuffle;
    L->order = (int64_t*)xmalloc(L->windows * sizeof(int64_t));
    L->order_epoch = -1;
    loader_require_targets(L);
}

static void loader_free(TextLoader* L) { free(L->order); }

static int64_t loader_window(TextLoader* L, int64_t global_index) {
    return rng_epoch_item(L->order, &L->order_epoch, L->windows, L->shuffle, L->seed, global_index);
}

// Whether a row's targets count (its mask as the shard has it) or are all masked out (padding).
typedef enum { ROW_COUNTS, ROW_MASKED } RowTargets;

// One row of a batch: window w's seq inputs, targets, mask and positions (the position of each
// input token within its example, restarting at example starts; window start = 0).
static void loader_fill_row(const TextLoader* L, int64_t w, RowTargets counts, int* inputs, int* targets, float* mask,
                            int* pos) {
    int T = L->seq;
    const uint32_t* tok = L->shard->tokens + w * T;
    const uint8_t* m = L->shard->mask + w * T;
    for (int t = 0; t < T; t++) {
        inputs[t] = (int)tok[t];
        targets[t] = (int)tok[t + 1];
        mask[t] = counts == ROW_COUNTS && m[t + 1] ? 1.0f : 0.0f;
        int start = t == 0 || (L->shard->starts && L->shard->starts[w * T + t]);
        pos[t] = start ? 0 : pos[t - 1] + 1;
    }
}

// ---- validation: one exact pass ----------------------------------------------------------------
// A validation pass visits windows 0 .. n-1 in file order, each once: n = min(windows, batches * B),
// in ceil(n / B) micro-batches whose last one may be partial. A partial batch keeps the model's
// shape B x seq: its rows past the set hold the last window again with every mask 0, so they add
// nothing to the loss sum or the target count (the mean is over the set's targets alone).

// The windows a pass of up to `batches` micro-batches of B rows covers.
static int64_t loader_eval_windows(const TextLoader* L, int B, int batches) {
    int64_t most = (int64_t)B * batches;
    return L->windows < most ? L->windows : most;
}

static int64_t loader_eval_batches(const TextLoader* L, int B, int batches) {
    return (loader_eval_windows(L, B, batches) + B - 1) / B;
}

// Refuses, in one line naming the file, a pass whose windows hold no target while the shard has
// some (loader_require_targets): its mean would be 0/0. The flags that chose the set are named.
static void loader_require_eval_targets(const TextLoader* L, int B, int batches) {
    int64_t n = loader_eval_windows(L, B, batches), last = n * L->seq;
    for (int64_t i = 1; i <= last; i++)
        if (L->shard->mask[i]) return;
    fail("%s: the %lld validation windows that --val-batches %d x --batch %d cover hold no target (every mask 0); "
         "the shard's targets lie further on: raise --val-batches",
         L->shard->path, (long long)n, batches, B);
}

// Fills micro-batch i of the pass over `n` windows (loader_eval_windows) as loader_next does, rows
// past the set masked out; returns the rows that are windows of the set.
static int loader_eval_batch(const TextLoader* L, int64_t n, int64_t i, int B, int* inputs, int* targets, float* mask,
                             int* pos) {
    int64_t first = i * B;
    int T = L->seq;
    int rows = (int)(n - first < B ? n - first : B);
    for (int b = 0; b < B; b++)
        loader_fill_row(L, first + (b < rows ? b : rows - 1), b < rows ? ROW_COUNTS : ROW_MASKED,
                        inputs + b * T, targets + b * T, mask + b * T, pos + b * T);
    return rows;
}

// Fills rows [0, B) of inputs (B x seq), targets (B x seq), mask (B x seq) and pos (B x seq: the
// position of each input token within its example, restarting at example starts; window start = 0)
// with the windows rank*B .. rank*B+B-1 of the next global batch of world*B windows, then advances
// the cursor.
static void loader_next(TextLoader* L, int B, int rank, int world, int* inputs, int* targets, float* mask, int* pos) {
    int T = L->seq;
    for (int b = 0; b < B; b++)
        loader_fill_row(L, loader_window(L, L->cursor + (int64_t)rank * B + b), ROW_COUNTS, inputs + b * T,
                        targets + b * T, mask + b * T, pos + b * T);
    L->cursor += (int64_t)world * B;
}
