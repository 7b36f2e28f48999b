// pairdata.h: pair shards (preference data: a prompt, a chosen and a rejected completion per
// example) and their loader. A pair shard is a 64-byte little-endian header (shard_header.h: magic "LMPR", u32
// version 1, u64 pairs, u32 vocab_size, u32 max_len: the longest prompt + completion in tokens),
// then pairs x 3 uint32 lengths (prompt, chosen, rejected), then each pair's tokens as uint32:
// its prompt, its chosen completion, its rejected completion. scripts/data/prepare_text.py writes
// them (docs/formats.md). A micro-batch of B rows holds B/2 pairs, each pair's chosen row and then
// its rejected row, so both see the same dropout key and rank; only completion tokens are targets.
#pragma once
#include "../common.h"
#include "../rng.h"
#include "../formats/checksum.h"
#include "shard_header.h"

typedef struct {
    char* path;
    int64_t pairs;
    int vocab_size, max_len;
    uint32_t* lens;        // [pairs, 3] prompt, chosen, rejected
    int64_t* offset;       // [pairs] where each pair's tokens start in tokens
    uint32_t* tokens;
    int64_t count;         // tokens
} PairShard;

// The bytes after the header that `pairs` and `count` tokens take, or -1 where they overflow.
static int64_t pair_payload_bytes(uint64_t pairs, uint64_t count) {
    if (pairs > ((uint64_t)1 << 40) || count > ((uint64_t)1 << 40)) return -1;
    return (int64_t)(pairs * 12 + count * 4);
}

// Each pair's lengths checked (a prompt and two completions, each at least one token) and summed.
static int64_t pair_check_lengths(const PairShard* s, const uint8_t* lens_bytes, int64_t room) {
    int64_t count = 0;
    int longest = 0;
    for (int64_t i = 0; i < s->pairs; i++) {
        uint32_t l[3];
        memcpy(l, lens_bytes + i * 12, 12);
        if (l[0] < 1 || l[1] < 1 || l[2] < 1)
            fail("%s: pair %lld has lengths prompt %u, chosen %u, rejected %u; each must be at least 1 token "
                 "(scripts/data/prepare_text.py skips a pair whose completion is empty)",
                 s->path, (long long)i, l[0], l[1], l[2]);
        if ((int64_t)l[0] + l[1] > room || (int64_t)l[0] + l[2] > room || (count += (int64_t)l[0] + l[1] + l[2]) > room)
            fail("%s: pair %lld's lengths run past the end of the file (truncated?)", s->path, (long long)i);
        int a = (int)(l[0] + l[1]), b = (int)(l[0] + l[2]);
        if (a > longest) longest = a;
        if (b > longest) longest = b;
    }
    if (longest != s->max_len)
        fail("%s: header says the longest sequence has %d tokens, the pairs' longest has %d", s->path, s->max_len,
             longest);
    return count;
}

static const ShardKind PAIR_SHARD = {
    PAIR_SHARD_MAGIC, "pair shard", "pair shard", TOKEN_SHARD_MAGIC,
    "a token shard (for --objective sft), not a pair shard (\"LMPR\", scripts/data/prepare_text.py from "
    "chosen/rejected JSONL)"};

static void pair_shard_load(PairShard* s, const char* path, int model_vocab) {
    size_t size;
    uint8_t* buf = (uint8_t*)read_file(path, &size);
    memset(s, 0, sizeof(*s));
    s->path = xstrdup(path);
    ShardHeader h = shard_header_read(buf, size, path, &PAIR_SHARD);
    uint64_t pairs = h.count;
    uint32_t vocab = h.vocab, max_len = h.word;
    if (pairs < 1) fail("%s: holds no pair", path);
    if (max_len > (1u << 30)) fail("%s: header's longest sequence %u is beyond 2^30 tokens", path, max_len);
    int64_t room = (int64_t)(size - SHARD_HEADER_BYTES);
    if (pair_payload_bytes(pairs, 0) < 0 || pair_payload_bytes(pairs, 0) > room)
        fail("%s: header says %llu pairs, whose lengths alone need more than the file's %zu bytes (truncated?)", path,
             (unsigned long long)pairs, size);
    int limit = shard_check_vocab(path, vocab, model_vocab);
    s->pairs = (int64_t)pairs;
    s->vocab_size = (int)vocab;
    s->max_len = (int)max_len;
    const uint8_t* lens = buf + SHARD_HEADER_BYTES;
    s->count = pair_check_lengths(s, lens, (room - (int64_t)pairs * 12) / 4);
    if (pair_payload_bytes(pairs, (uint64_t)s->count) != room)
        fail("%s: the pairs' lengths need %lld bytes after the header, the file has %lld", path,
             (long long)pair_payload_bytes(pairs, (uint64_t)s->count), (long long)room);
    s->lens = (uint32_t*)xmalloc(sizeof(uint32_t) * 3 * s->pairs);
    s->offset = (int64_t*)xmalloc(sizeof(int64_t) * s->pairs);
    s->tokens = (uint32_t*)xmalloc(sizeof(uint32_t) * s->count);
    memcpy(s->lens, lens, sizeof(uint32_t) * 3 * s->pairs);
    memcpy(s->tokens, lens + 12 * s->pairs, sizeof(uint32_t) * s->count);
    free(buf);
    for (int64_t i = 0, at = 0; i < s->pairs; i++) {
        s->offset[i] = at;
        at += (int64_t)s->lens[3 * i] + s->lens[3 * i + 1] + s->lens[3 * i + 2];
    }
    shard_check_token_ids(path, s->tokens, s->count, limit);
}

static void pair_shard_free(PairShard* s) {
    free(s->path); free(s->lens); free(s->offset); free(s->tokens);
    memset(s, 0, sizeof(*s));
}

static uint64_t pair_shard_fingerprint(const PairShard* s) {
    Fingerprint f;
    fp_init(&f);
    fp_update(&f, s->lens, sizeof(uint32_t) * 3 * (size_t)s->pairs);
    fp_update(&f, s->tokens, sizeof(uint32_t) * (size_t)s->count);
    return fp_final(&f);
}

// Whether a file is a pair shard (its magic), to refuse the wrong objective in one line; anything
// not a regular file is not (the shard's reader then refuses it, naming what it is).
static int file_is_pair_shard(const char* path) {
    int fd = open_input(path);
    char magic[4] = {0};
    int is = fd >= 0 && read(fd, magic, 4) == 4 && !memcmp(magic, PAIR_SHARD_MAGIC, 4);
    if (fd >= 0) close(fd);
    return is;
}

typedef struct {
    const PairShard* shard;
    int seq;
    uint64_t seed;
    int shuffle;
    int64_t cursor;        // global index into the sequence of pairs over all epochs
    int64_t* order;        // permutation of pairs for the current epoch
    int64_t order_epoch;
} PairLoader;

static void pair_loader_init(PairLoader* L, const PairShard* s, int seq, uint64_t seed, int shuffle) {
    memset(L, 0, sizeof(*L));
    if (s->max_len - 1 > seq)  // a sequence of L tokens is L-1 inputs and L-1 targets
        fail("%s: its longest prompt + completion has %d tokens, which needs --seq >= %d (prepare it with "
             "prepare_text.py --seq %d to truncate as TRL does)", s->path, s->max_len, s->max_len - 1, seq);
    L->shard = s;
    L->seq = seq;
    L->seed = seed;
    L->shuffle = shuffle;
    L->order = (int64_t*)xmalloc(s->pairs * sizeof(int64_t));
    L->order_epoch = -1;
}

static void pair_loader_free(PairLoader* L) { free(L->order); }

// The pair at a global index: a seeded permutation per epoch, as the token loader's windows.
static int64_t pair_loader_pair(PairLoader* L, int64_t global_index) {
    return rng_epoch_item(L->order, &L->order_epoch, L->shard->pairs, L->shuffle, L->seed, global_index);
}

// Which completion of a pair a row holds, and whether its targets count (a padding row's do not).
typedef enum { PAIR_CHOSEN, PAIR_REJECTED } PairSide;
typedef enum { PAIR_ROW_MASKED, PAIR_ROW_COUNTS } PairRowTargets;

// One row: the pair's prompt and one completion as seq inputs and targets (padding past its end
// with mask 0), the completion's targets counted when `counts`.
static void pair_fill_row(const PairShard* s, int64_t p, PairSide side, PairRowTargets counts, int T, int* inputs,
                          int* targets, float* mask, int* pos) {
    const uint32_t* l = s->lens + 3 * p;
    const uint32_t* prompt = s->tokens + s->offset[p];
    const uint32_t* comp = prompt + l[0] + (side == PAIR_REJECTED ? l[1] : 0);
    int P = (int)l[0], L = P + (int)l[1 + side];
    for (int t = 0; t < T; t++) {
        int a = t, b = t + 1;
        inputs[t] = a < L ? (int)(a < P ? prompt[a] : comp[a - P]) : 0;
        targets[t] = b < L ? (int)(b < P ? prompt[b] : comp[b - P]) : 0;
        mask[t] = counts && b >= P && b < L ? 1.0f : 0.0f;
        pos[t] = t;
    }
}

// Rows [0, B) with the pairs rank*B/2 .. of the next global batch of world*B/2 pairs (chosen, then
// rejected), then advances the cursor; ids [B/2] receives the pairs' indices in the shard.
static void pair_loader_next(PairLoader* L, int B, int rank, int world, int* inputs, int* targets, float* mask,
                             int* pos, int64_t* ids) {
    int T = L->seq, pairs = B / 2;
    for (int i = 0; i < pairs; i++) {
        int64_t p = pair_loader_pair(L, L->cursor + (int64_t)rank * pairs + i);
        ids[i] = p;
        for (int side = PAIR_CHOSEN; side <= PAIR_REJECTED; side++) {
            int64_t o = (int64_t)(2 * i + side) * T;
            pair_fill_row(L->shard, p, (PairSide)side, PAIR_ROW_COUNTS, T, inputs + o, targets + o, mask + o, pos + o);
        }
    }
    L->cursor += (int64_t)world * pairs;
}

// Validation: pairs 0 .. n-1 in file order, n = min(pairs, batches * B/2); micro-batch i of the pass,
// rows past the set masked out (their pair repeats the last, uncounted). Returns the pairs counted.
static int pair_eval_batch(const PairLoader* L, int64_t n, int64_t i, int B, int* inputs, int* targets, float* mask,
                           int* pos) {
    int T = L->seq, pairs = B / 2;
    int64_t first = i * pairs;
    int rows = (int)(n - first < pairs ? n - first : pairs);
    for (int k = 0; k < pairs; k++)
        for (int side = PAIR_CHOSEN; side <= PAIR_REJECTED; side++) {
            int64_t o = (int64_t)(2 * k + side) * T;
            pair_fill_row(L->shard, first + (k < rows ? k : rows - 1), (PairSide)side,
                          k < rows ? PAIR_ROW_COUNTS : PAIR_ROW_MASKED, T, inputs + o, targets + o, mask + o, pos + o);
        }
    return rows;
}
