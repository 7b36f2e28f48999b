// shard_header.h: the 64-byte header that opens both shard kinds in llmc/text/ (token shards,
// textdata.h; pair shards, pairdata.h), and the vocabulary checks they share. The header is
// little-endian: 4 magic bytes, u32 version (1), u64 count (tokens; pairs), u32 vocab_size, u32 a
// word of the kind's own (flags; the longest sequence), then bytes reserved up to byte 64.
#pragma once
#include "../common.h"

#define SHARD_HEADER_BYTES 64
#define TOKEN_SHARD_MAGIC "LMFT"  // textdata.h's
#define PAIR_SHARD_MAGIC "LMPR"   // pairdata.h's

// What one kind of shard is called in its refusals: its magic, the other data that is most often
// given in its place (and what to say it is), and the name its version error gives it.
typedef struct {
    const char* magic;          // e.g. "LMFT"
    const char* noun;           // "token shard": "not a token shard (bad magic ...)"
    const char* version_noun;   // "shard": "shard version 2, expected 1"
    const char* other_magic;    // the magic of the data most often mistaken for this kind
    const char* other_is;       // what a file with other_magic is, said in place of "bad magic"
} ShardKind;

typedef struct {
    uint32_t version;
    uint64_t count;             // token shards: tokens; pair shards: pairs
    uint32_t vocab;
    uint32_t word;              // token shards: flags; pair shards: the longest sequence in tokens
} ShardHeader;

// The header of a file read whole (buf, size bytes): its magic and version checked, one line each
// naming the file; what the fields mean past that is the kind's to check.
static ShardHeader shard_header_read(const uint8_t* buf, size_t size, const char* path, const ShardKind* kind) {
    if (size >= 4 && memcmp(buf, kind->other_magic, 4) == 0) fail("%s: %s", path, kind->other_is);
    if (size < SHARD_HEADER_BYTES || memcmp(buf, kind->magic, 4) != 0)
        fail("%s: not a %s (bad magic; expected \"%s\", made by scripts/data/prepare_text.py)", path, kind->noun,
             kind->magic);
    ShardHeader h;
    memcpy(&h.version, buf + 4, 4);
    memcpy(&h.count, buf + 8, 8);
    memcpy(&h.vocab, buf + 16, 4);
    memcpy(&h.word, buf + 20, 4);
    if (h.version != 1) fail("%s: %s version %u, expected 1", path, kind->version_noun, h.version);
    return h;
}

// The header's vocabulary against the model's (model_vocab 0: no model); returns the number of
// entries the token ids must stay below: the model's, or the header's where there is no model.
static int shard_check_vocab(const char* path, uint32_t vocab, int model_vocab) {
    if (model_vocab > 0 && (int)vocab > model_vocab)
        fail("%s: shard vocab_size %u exceeds the model's %d (tokenized for another model?)", path, vocab, model_vocab);
    return model_vocab > 0 ? model_vocab : (int)vocab;
}

static void shard_check_token_ids(const char* path, const uint32_t* tokens, int64_t count, int limit) {
    for (int64_t i = 0; i < count; i++)
        if (tokens[i] >= (uint32_t)limit)
            fail("%s: token %lld has id %u, but the vocabulary has %d entries", path, (long long)i, tokens[i], limit);
}
