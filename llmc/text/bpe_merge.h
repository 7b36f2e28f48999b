// bpe_merge.h: the BPE merge loop both encoders share (tokenizer.h's tokenizer.bin, hf_tokenizer.h's
// tokenizer.json): merge the adjacent pair of best key, leftmost on ties, until no pair merges. A
// heap of candidate pairs and a linked list of symbols make that n log n for n symbols, where
// rescanning every pair after each merge is n^2 (a long prompt of one word took minutes). A
// candidate whose symbols changed after it was queued is skipped when it comes up; one whose two
// symbols are still adjacent and unchanged is still valid, since its merge depends on them alone.
#pragma once
#include "../common.h"

// Whether the pair (a, b) merges: if so, its key (lower merges first) in *key, the result in *to.
typedef int (*BpePairFn)(const void* ctx, int a, int b, double* key, int* to);

typedef struct {
    double key;
    int pos, a, b, to;
} BpeCand;

typedef struct {
    BpeCand* v;
    int n, cap;
} BpeHeap;

static int bpe_before(const BpeCand* x, const BpeCand* y) {
    return x->key != y->key ? x->key < y->key : x->pos < y->pos;
}

static void bpe_heap_push(BpeHeap* h, BpeCand c) {
    if (h->n == h->cap) {
        h->cap = h->cap ? 2 * h->cap : 64;
        h->v = (BpeCand*)realloc(h->v, sizeof(BpeCand) * h->cap);
        if (!h->v) fail("out of host memory merging %d symbols", h->n);
    }
    int i = h->n++;
    for (; i > 0 && bpe_before(&c, &h->v[(i - 1) / 2]); i = (i - 1) / 2) h->v[i] = h->v[(i - 1) / 2];
    h->v[i] = c;
}

static BpeCand bpe_heap_pop(BpeHeap* h) {
    BpeCand top = h->v[0], last = h->v[--h->n];
    int i = 0;
    for (int c = 1; c < h->n; i = c, c = 2 * i + 1) {
        if (c + 1 < h->n && bpe_before(&h->v[c + 1], &h->v[c])) c++;
        if (!bpe_before(&h->v[c], &last)) break;
        h->v[i] = h->v[c];
    }
    if (h->n) h->v[i] = last;
    return top;
}

static void bpe_queue(BpeHeap* h, BpePairFn pair, const void* ctx, const int* sym, int i, int j) {
    BpeCand c = {0.0, i, sym[i], sym[j], -1};
    if (pair(ctx, c.a, c.b, &c.key, &c.to)) bpe_heap_push(h, c);
}

// Merges sym[0..m) in place; returns the new count.
static int bpe_merge(int* sym, int m, BpePairFn pair, const void* ctx) {
    if (m < 2) return m;
    int* next = (int*)xmalloc(sizeof(int) * m);
    int* prev = (int*)xmalloc(sizeof(int) * m);
    for (int i = 0; i < m; i++) { next[i] = i + 1; prev[i] = i - 1; }
    BpeHeap h = {NULL, 0, 0};
    for (int i = 0; i + 1 < m; i++) bpe_queue(&h, pair, ctx, sym, i, i + 1);
    while (h.n) {
        BpeCand c = bpe_heap_pop(&h);
        int j = next[c.pos];
        if (sym[c.pos] != c.a || j >= m || sym[j] != c.b) continue;  // stale
        sym[c.pos] = c.to;  // the left symbol becomes the merge, the right one goes
        sym[j] = -1;
        next[c.pos] = next[j];
        if (next[j] < m) prev[next[j]] = c.pos;
        if (prev[c.pos] >= 0) bpe_queue(&h, pair, ctx, sym, prev[c.pos], c.pos);
        if (next[c.pos] < m) bpe_queue(&h, pair, ctx, sym, c.pos, next[c.pos]);
    }
    int k = 0;
    for (int i = 0; i < m; i = next[i]) sym[k++] = sym[i];  // position 0 is never merged away
    free(h.v);
    free(next);
    free(prev);
    return k;
}
