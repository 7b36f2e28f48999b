// literal_trie.h: a set of strings matched whole in a text (a tokenizer's added or special tokens):
// the longest one that starts at a given place, in time of that match's length, whatever the size
// of the set. A byte trie whose edges, (node, byte) -> child, live in one open-addressing table;
// a bitmap of the strings' first bytes turns most places away with one test. Strings equal to an
// earlier one keep the earlier one's id (callers insert the smallest id first).
#pragma once
#include <stdint.h>
#include "../common.h"

typedef struct {
    uint64_t* keys;            // edge (node << 8 | byte) + 1; 0 = empty slot
    int* child;                // per slot: the node the edge leads to
    size_t mask;
    int* id;                   // per node: the id of the string that ends there, -1 for none
    int n_nodes;
    uint64_t first_bytes[4];   // bit b: some string starts with byte b
} LiteralTrie;

static uint64_t lt_hash(uint64_t x) {
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL; x ^= x >> 33;
    return x;
}

static size_t lt_slot(const LiteralTrie* t, uint64_t key) {
    size_t i = lt_hash(key) & t->mask;
    while (t->keys[i] && t->keys[i] != key) i = (i + 1) & t->mask;
    return i;
}

static uint64_t lt_key(int node, unsigned char byte) { return ((uint64_t)node << 8 | byte) + 1; }

// Builds the trie of the n strings strs[k] (lens[k] bytes each, none empty) with ids ids[k].
static void literal_trie_build(LiteralTrie* t, const char* const* strs, const int* lens, const int* ids, int n) {
    memset(t, 0, sizeof(*t));
    size_t bytes = 0, cap = 16;
    for (int k = 0; k < n; k++) bytes += (size_t)lens[k];
    while (cap < 2 * bytes + 2) cap *= 2;  // at most one edge per byte: the table stays half empty
    t->keys = (uint64_t*)xcalloc(cap, sizeof(uint64_t));
    t->child = (int*)xmalloc(cap * sizeof(int));
    t->mask = cap - 1;
    t->id = (int*)xmalloc((bytes + 1) * sizeof(int));
    t->id[0] = -1;
    t->n_nodes = 1;
    for (int k = 0; k < n; k++) {
        const unsigned char* s = (const unsigned char*)strs[k];
        int node = 0;
        for (int i = 0; i < lens[k]; i++) {
            size_t slot = lt_slot(t, lt_key(node, s[i]));
            if (!t->keys[slot]) {
                t->keys[slot] = lt_key(node, s[i]);
                t->child[slot] = t->n_nodes;
                t->id[t->n_nodes++] = -1;
            }
            node = t->child[slot];
        }
        if (lens[k] > 0 && t->id[node] < 0) t->id[node] = ids[k];
        if (lens[k] > 0) t->first_bytes[s[0] >> 6] |= 1ULL << (s[0] & 63);
    }
}

// The id of the longest string that starts at s (of n bytes), its length in *len; -1 if none.
static int literal_trie_match(const LiteralTrie* t, const char* s, size_t n, int* len) {
    const unsigned char* u = (const unsigned char*)s;
    int found = -1, node = 0;
    if (!t->keys || n == 0 || !(t->first_bytes[u[0] >> 6] >> (u[0] & 63) & 1)) return -1;
    for (size_t i = 0; i < n; i++) {
        size_t slot = lt_slot(t, lt_key(node, u[i]));
        if (!t->keys[slot]) break;
        node = t->child[slot];
        if (t->id[node] >= 0) { found = t->id[node]; *len = (int)i + 1; }
    }
    return found;
}

static void literal_trie_free(LiteralTrie* t) {
    free(t->keys);
    free(t->child);
    free(t->id);
    memset(t, 0, sizeof(*t));
}
