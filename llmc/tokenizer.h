// tokenizer.h: the llama2.c tokenizer.bin format (int32 max_token_length, then per token:
// float32 score, int32 length, bytes) with its score-driven BPE encoder and a decoder that turns
// byte pieces "<0xXX>" into raw bytes. The model directory carries it as tokenizer.bin.
#pragma once
#include "common.h"

typedef struct {
    int vocab_size;
    char** pieces;
    int* lengths;
    float* scores;
    int* sorted;          // token ids sorted by piece, for binary search
    int bos_id, eos_id;
} Tokenizer;

static const Tokenizer* g_sort_tok;  // only used during qsort in tokenizer_load
static int tok_cmp_ids(const void* a, const void* b) {
    const Tokenizer* t = g_sort_tok;
    int x = *(const int*)a, y = *(const int*)b;
    int c = strcmp(t->pieces[x], t->pieces[y]);
    return c ? c : x - y;
}

static void tokenizer_load(Tokenizer* t, const char* path, int expected_vocab) {
    size_t size;
    char* buf = read_file(path, &size);
    memset(t, 0, sizeof(*t));
    if (size < 4) fail("%s: too short to be a tokenizer.bin", path);
    size_t pos = 4, cap = 1024;
    t->pieces = (char**)xmalloc(cap * sizeof(char*));
    t->lengths = (int*)xmalloc(cap * sizeof(int));
    t->scores = (float*)xmalloc(cap * sizeof(float));
    while (pos < size) {
        if (pos + 8 > size) fail("%s: truncated at token %d", path, t->vocab_size);
        float score; int32_t len;
        memcpy(&score, buf + pos, 4);
        memcpy(&len, buf + pos + 4, 4);
        pos += 8;
        if (len < 0 || pos + (size_t)len > size) fail("%s: token %d has a bad length %d", path, t->vocab_size, len);
        if ((size_t)t->vocab_size == cap) {
            cap *= 2;
            t->pieces = (char**)realloc(t->pieces, cap * sizeof(char*));
            t->lengths = (int*)realloc(t->lengths, cap * sizeof(int));
            t->scores = (float*)realloc(t->scores, cap * sizeof(float));
        }
        char* p = (char*)xmalloc(len + 1);
        memcpy(p, buf + pos, len);
        p[len] = 0;
        pos += len;
        t->pieces[t->vocab_size] = p;
        t->lengths[t->vocab_size] = len;
        t->scores[t->vocab_size] = score;
        t->vocab_size++;
    }
    free(buf);
    if (expected_vocab > 0 && t->vocab_size != expected_vocab)
        fail("%s: has %d tokens but the model's vocab_size is %d", path, t->vocab_size, expected_vocab);
    t->sorted = (int*)xmalloc(t->vocab_size * sizeof(int));
    for (int i = 0; i < t->vocab_size; i++) t->sorted[i] = i;
    g_sort_tok = t;
    qsort(t->sorted, t->vocab_size, sizeof(int), tok_cmp_ids);
    t->bos_id = 1;
    t->eos_id = 2;
}

static void tokenizer_free(Tokenizer* t) {
    for (int i = 0; i < t->vocab_size; i++) free(t->pieces[i]);
    free(t->pieces); free(t->lengths); free(t->scores); free(t->sorted);
    memset(t, 0, sizeof(*t));
}

static int tokenizer_lookup(const Tokenizer* t, const char* s) {
    int lo = 0, hi = t->vocab_size - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2, id = t->sorted[mid];
        int c = strcmp(t->pieces[id], s);
        if (c == 0) {  // several ids may share a piece: take the smallest
            while (mid > 0 && strcmp(t->pieces[t->sorted[mid - 1]], s) == 0) mid--;
            return t->sorted[mid];
        }
        if (c < 0) lo = mid + 1; else hi = mid - 1;
    }
    return -1;
}

// Encodes text (with a leading BOS if bos) into ids; returns the count. ids holds strlen(text)+3.
static int tokenizer_encode(const Tokenizer* t, const char* text, int bos, int* ids) {
    int n = 0;
    if (bos) ids[n++] = t->bos_id;
    if (!*text) return n;
    int space = tokenizer_lookup(t, " ");  // the dummy prefix of sentencepiece models
    if (space >= 0) ids[n++] = space;
    char cp[8];
    for (const char* c = text; *c;) {
        int len = 1;  // one UTF-8 code point
        while (len < 4 && ((unsigned char)c[len] & 0xC0) == 0x80) len++;
        memcpy(cp, c, len);
        cp[len] = 0;
        int id = tokenizer_lookup(t, cp);
        if (id >= 0) ids[n++] = id;
        else for (int k = 0; k < len; k++) ids[n++] = (unsigned char)cp[k] + 3;  // byte fallback
        c += len;
    }
    char* merged = (char*)xmalloc(2 * 256 + 2);
    for (;;) {  // merge the best-scoring adjacent pair until none is a token
        float best = -1e30f;
        int best_id = -1, best_at = -1;
        for (int i = (bos ? 1 : 0); i + 1 < n; i++) {
            if (t->lengths[ids[i]] + t->lengths[ids[i + 1]] > 512) continue;
            snprintf(merged, 2 * 256 + 2, "%s%s", t->pieces[ids[i]], t->pieces[ids[i + 1]]);
            int id = tokenizer_lookup(t, merged);
            if (id >= 0 && t->scores[id] > best) { best = t->scores[id]; best_id = id; best_at = i; }
        }
        if (best_at < 0) break;
        ids[best_at] = best_id;
        memmove(ids + best_at + 1, ids + best_at + 2, (n - best_at - 2) * sizeof(int));
        n--;
    }
    free(merged);
    return n;
}

// The bytes one token stands for, given the previous token (a leading space after BOS is dropped).
static const char* tokenizer_decode(const Tokenizer* t, int prev, int id, char byte_buf[2]) {
    if (id < 0 || id >= t->vocab_size) return "";
    const char* p = t->pieces[id];
    if (prev == t->bos_id && p[0] == ' ') p++;
    unsigned v;
    if (strlen(p) == 6 && sscanf(p, "<0x%02X>", &v) == 1) { byte_buf[0] = (char)v; byte_buf[1] = 0; return byte_buf; }
    return p;
}
