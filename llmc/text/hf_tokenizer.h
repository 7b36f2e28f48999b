// hf_tokenizer.h: a Hugging Face tokenizer.json (the `tokenizers` library's format) read into a
// BPE encoder and decoder, for the two families LLaMA-type models ship:
//   - byte-level BPE (GPT-2, Llama-3, SmolLM2, Qwen2): pre-tokenizer ByteLevel, alone or after
//     Digits and/or a Split on the regex of GPT-2, Llama-3 or Qwen2 (recognised by its text,
//     matched by hand: pretok_regex.h); normalizer none or NFC (Qwen2, unicode_nfc.h); every
//     byte is mapped to a printable character (GPT-2's bytes_to_unicode) before BPE; decoder
//     ByteLevel;
//   - SentencePiece-style BPE (Llama-2): normalizer Prepend("▁") + Replace(" ", "▁") or
//     pre-tokenizer Metaspace; byte_fallback to "<0xXX>" tokens, unk; decoder Replace +
//     ByteFallback + Fuse + Strip.
// Encoding as the library does it: added tokens (special or not) are matched in the text first,
// leftmost then longest (a trie: literal_trie.h), and never merged; each stretch between them is
// normalized and split into words; each word starts as one symbol per character and merges the
// adjacent pair of lowest merge rank (leftmost on ties) until no listed pair is left (a heap:
// bpe_merge.h); the ids grow with the text, as byte fallback makes up to 4 of a character and
// Metaspace 3 of a space (a fixed 2 per byte once overflowed); the post-processor's special tokens before
// the sequence (TemplateProcessing, e.g. Llama's BOS) lead. Anything else (another model type,
// normalizer, pre-tokenizer, regex or decoder, BPE dropout, added tokens with lstrip, rstrip or
// single_word) is refused in one line naming the file and what was found. That includes the
// Metaspace decoder: the library's joins the words of pieces that span a "▁", and the LLaMA
// family ships the Replace + ByteFallback + Fuse + Strip one.
// Known differences: post-processor tokens after the sequence are not added (generation continues
// the text); added tokens are matched before normalization and in one pass, also those marked
// "normalized", which the library matches in a second pass (the LLaMA family marks its own not
// normalized); decoding goes token by token and writes raw bytes
// where the library puts U+FFFD for invalid UTF-8; the regex classes and NFC follow the Unicode
// version of unicode_classes.h and unicode_nfc.h.
#pragma once
#include <stdint.h>
#include "../common.h"
#include "../formats/json.h"
#include "bpe_merge.h"
#include "literal_trie.h"
#include "pretok_regex.h"
#include "unicode_nfc.h"

enum { HF_BYTE_LEVEL = 1, HF_METASPACE = 2 };
enum { HF_RE_NONE, HF_RE_GPT2, HF_RE_LLAMA3, HF_RE_QWEN2 };
enum { HF_MAX_STEPS = 4 };
enum { HF_STEP_DIGITS, HF_STEP_SPLIT, HF_STEP_BYTE_LEVEL, HF_STEP_METASPACE };

typedef struct {
    int kind;        // HF_STEP_*
    int arg;         // Digits: individual_digits; Split: HF_RE_*; ByteLevel: use_regex
    int prefix;      // ByteLevel: add_prefix_space; Metaspace: 0 never, 1 first, 2 always
    int split;       // Metaspace: split words before each "▁"
} HfPreStep;

typedef struct {
    uint64_t* keys;  // 0 = empty
    int* vals;
    size_t mask;
} HfMap;

typedef struct {
    int kind;                 // HF_BYTE_LEVEL or HF_METASPACE
    int vocab_size;           // largest id + 1
    char** names;             // per id: the token's string in tokenizer.json (NULL: no token)
    char** pieces;            // per id: the bytes it decodes to
    HfMap by_name;            // hash of the name -> id
    HfMap merges;             // (left id, right id) -> rank
    int* merge_to;            // per rank: the token the merge makes
    int* added;               // added tokens, by id
    int n_added;
    LiteralTrie added_trie;   // the added tokens, matched in the text
    int prepend;              // normalizer Prepend("▁") + Replace(" ", "▁")
    int nfc;                  // normalizer NFC (Qwen2)
    HfPreStep steps[HF_MAX_STEPS];
    int n_steps;
    int byte_fallback, unk_id, fuse_unk, ignore_merges;
    int strip_first;          // the decoder drops the first token's leading space
    int bytes_decoded;        // the decoder turns "<0xXX>" pieces into their byte (ByteFallback)
    int prefix_ids[4];        // post-processor tokens before the text
    int n_prefix;
    unsigned short byte_char[256];  // byte-level: the code point each byte is written as
    short char_byte[512];           // and back (-1: no byte's)
} HfTokenizer;

// ---------------------------------------------------------------------------------------------
// small hash maps of 64-bit keys (never 0) to ints

static uint64_t hf_hash(uint64_t x) {
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL; x ^= x >> 33;
    return x;
}

static uint64_t hf_hash_str(const char* s, size_t n) {
    uint64_t h = 1469598103934665603ULL;  // FNV-1a
    for (size_t i = 0; i < n; i++) { h ^= (unsigned char)s[i]; h *= 1099511628211ULL; }
    return h ? h : 1;
}

static void hf_map_init(HfMap* m, size_t n) {
    size_t cap = 16;
    while (cap < 2 * n) cap *= 2;
    m->keys = (uint64_t*)xcalloc(cap, sizeof(uint64_t));
    m->vals = (int*)xmalloc(cap * sizeof(int));
    m->mask = cap - 1;
}

static void hf_map_free(HfMap* m) { free(m->keys); free(m->vals); memset(m, 0, sizeof(*m)); }

// Pair keys are exact; name keys are hashes, so lookups by name compare the name too.
static size_t hf_map_slot(const HfMap* m, uint64_t key) {
    size_t i = hf_hash(key) & m->mask;
    while (m->keys[i] && m->keys[i] != key) i = (i + 1) & m->mask;
    return i;
}

static uint64_t hf_pair_key(int a, int b) { return ((uint64_t)(uint32_t)a << 32 | (uint32_t)b) + 1; }

static int hf_merge_rank(const HfTokenizer* t, int a, int b) {
    size_t i = hf_map_slot(&t->merges, hf_pair_key(a, b));
    return t->merges.keys[i] ? t->merges.vals[i] : -1;
}

static int hf_lookup_n(const HfTokenizer* t, const char* s, size_t n) {
    uint64_t h = hf_hash_str(s, n);
    for (size_t i = hf_hash(h) & t->by_name.mask; t->by_name.keys[i]; i = (i + 1) & t->by_name.mask) {
        if (t->by_name.keys[i] != h) continue;
        const char* name = t->names[t->by_name.vals[i]];
        if (strlen(name) == n && memcmp(name, s, n) == 0) return t->by_name.vals[i];
    }
    return -1;
}

static int hf_lookup(const HfTokenizer* t, const char* s) { return hf_lookup_n(t, s, strlen(s)); }

// ---------------------------------------------------------------------------------------------
// words: the pre-tokenizer's output, each an owned byte string

typedef struct {
    char** w;
    int n, cap;
} HfWords;

static void hf_words_push(HfWords* ws, const char* s, size_t len) {
    if (ws->n == ws->cap) {
        ws->cap = ws->cap ? 2 * ws->cap : 16;
        ws->w = (char**)realloc(ws->w, ws->cap * sizeof(char*));
        if (!ws->w) fail("out of memory splitting text into words");
    }
    char* p = (char*)xmalloc(len + 1);
    memcpy(p, s, len);
    p[len] = 0;
    ws->w[ws->n++] = p;
}

static void hf_words_free(HfWords* ws) {
    for (int i = 0; i < ws->n; i++) free(ws->w[i]);
    free(ws->w);
    memset(ws, 0, sizeof(*ws));
}

// Splits one word by a pre-tokenizer step that cuts words without changing their text.
static void hf_split_word(const HfPreStep* st, const char* word, HfWords* out) {
    int len = (int)strlen(word), n = 0;
    uint32_t* cp = (uint32_t*)xmalloc(sizeof(uint32_t) * (len + 1));
    int* off = (int*)xmalloc(sizeof(int) * (len + 1));
    for (int b = 0; b < len; n++) { off[n] = b; b += hf_utf8((const unsigned char*)word + b, len - b, &cp[n]); }
    off[n] = len;
    for (int i = 0; i < n;) {
        int j;
        if (st->kind == HF_STEP_DIGITS) {  // digits isolated (each alone, or runs of them)
            if (hf_is_number(cp[i])) j = st->arg ? i + 1 : hf_run(cp, i, n, hf_is_number);
            else { j = i; while (j < n && !hf_is_number(cp[j])) j++; }
        } else {
            int re = st->kind == HF_STEP_SPLIT ? st->arg : HF_RE_GPT2;
            j = re == HF_RE_GPT2 ? hf_re_gpt2(cp, i, n) : hf_re_llama3(cp, i, n, re == HF_RE_LLAMA3 ? 3 : 1);
        }
        hf_words_push(out, word + off[i], off[j] - off[i]);
        i = j;
    }
    free(cp);
    free(off);
}

// Metaspace: spaces become "▁", one is prepended (always, or only at the start of the text:
// prepend_first) unless the word starts with one, and with split the word is cut before each.
static void hf_metaspace_word(const HfPreStep* st, const char* w, int prepend_first, HfWords* out) {
    size_t len = strlen(w), n = 0;
    char* m = (char*)xmalloc(3 * len + 4);
    for (size_t i = 0; i < len; i++)
        if (w[i] == ' ') { memcpy(m + n, "\xE2\x96\x81", 3); n += 3; } else m[n++] = w[i];
    int lead = n >= 3 && memcmp(m, "\xE2\x96\x81", 3) == 0;
    if (!lead && (st->prefix == 2 || (st->prefix == 1 && prepend_first))) {
        memmove(m + 3, m, n);
        memcpy(m, "\xE2\x96\x81", 3);
        n += 3;
    }
    size_t start = 0;
    for (size_t i = 1; st->split && i + 3 <= n; i++)
        if (memcmp(m + i, "\xE2\x96\x81", 3) == 0) { hf_words_push(out, m + start, i - start); start = i; }
    hf_words_push(out, m + start, n - start);
    free(m);
}

// ByteLevel: a space prepended if asked (to every word, as the library does), GPT-2's regex if
// use_regex, then each byte written as its printable character.
static void hf_byte_level_word(const HfTokenizer* t, const HfPreStep* st, const char* w, HfWords* out) {
    HfWords parts = {NULL, 0, 0};
    char* pre = NULL;
    if (st->prefix && w[0] != ' ') { pre = (char*)xmalloc(strlen(w) + 2); pre[0] = ' '; strcpy(pre + 1, w); w = pre; }
    if (st->arg) hf_split_word(st, w, &parts); else hf_words_push(&parts, w, strlen(w));
    for (int p = 0; p < parts.n; p++) {
        size_t n = 0, len = strlen(parts.w[p]);
        char* m = (char*)xmalloc(2 * len + 1);
        for (size_t i = 0; i < len; i++) n += hf_put_utf8(m + n, t->byte_char[(unsigned char)parts.w[p][i]]);
        hf_words_push(out, m, n);
        free(m);
    }
    hf_words_free(&parts);
    free(pre);
}

// Applies one pre-tokenizer step to every word. first: the words come from the start of the text.
static void hf_pre_step(const HfTokenizer* t, const HfPreStep* st, HfWords* ws, int first) {
    HfWords out = {NULL, 0, 0};
    for (int k = 0; k < ws->n; k++) {
        if (st->kind == HF_STEP_METASPACE) hf_metaspace_word(st, ws->w[k], first && k == 0, &out);
        else if (st->kind == HF_STEP_BYTE_LEVEL) hf_byte_level_word(t, st, ws->w[k], &out);
        else hf_split_word(st, ws->w[k], &out);
    }
    hf_words_free(ws);
    *ws = out;
}

// ---------------------------------------------------------------------------------------------
// BPE on one word

// The ids of a text as they are made: a growing array (a character can become several byte
// tokens, and Metaspace makes 3 bytes of a space, so no bound on the count holds for every file).
typedef struct {
    int* v;
    int n, cap;
} HfIds;

// Makes room for `more` ids after the n there are.
static void hf_ids_reserve(HfIds* ids, int more) {
    if (ids->n + more <= ids->cap) return;
    while (ids->n + more > ids->cap) ids->cap = ids->cap ? 2 * ids->cap : 64;
    ids->v = (int*)realloc(ids->v, sizeof(int) * ids->cap);
    if (!ids->v) fail("out of host memory encoding text (%d tokens)", ids->n);
}

static void hf_ids_push(HfIds* ids, int id) {
    hf_ids_reserve(ids, 1);
    ids->v[ids->n++] = id;
}

// The merges' BPE rule (bpe_merge.h): a listed pair, the lowest rank first.
static int hf_pair(const void* ctx, int a, int b, double* key, int* to) {
    const HfTokenizer* t = (const HfTokenizer*)ctx;
    int r = hf_merge_rank(t, a, b);
    if (r < 0) return 0;
    *key = r;
    *to = t->merge_to[r];
    return 1;
}

// Appends the ids of one word.
static void hf_bpe_word(const HfTokenizer* t, const char* w, HfIds* ids) {
    int len = (int)strlen(w);
    if (t->ignore_merges) {
        int id = hf_lookup_n(t, w, len);
        if (id >= 0) { hf_ids_push(ids, id); return; }
    }
    int start = ids->n;
    for (int b = 0; b < len;) {
        uint32_t c;
        int l = hf_utf8((const unsigned char*)w + b, len - b, &c);
        int id = hf_lookup_n(t, w + b, l);
        if (id >= 0) hf_ids_push(ids, id);
        else {
            int ok = t->byte_fallback;
            char name[8];
            for (int k = 0; ok && k < l; k++) {
                snprintf(name, sizeof(name), "<0x%02X>", (unsigned char)w[b + k]);
                ok = hf_lookup(t, name) >= 0;
            }
            if (ok) {
                for (int k = 0; k < l; k++) {
                    snprintf(name, sizeof(name), "<0x%02X>", (unsigned char)w[b + k]);
                    hf_ids_push(ids, hf_lookup(t, name));
                }
            } else if (t->unk_id >= 0 && !(t->fuse_unk && ids->n > start && ids->v[ids->n - 1] == t->unk_id)) {
                hf_ids_push(ids, t->unk_id);
            }  // no unk token: the character is dropped, as the library does
        }
        b += l;
    }
    ids->n = start + bpe_merge(ids->v + start, ids->n - start, hf_pair, t);
}

// The NFC form of s[0..len), malloc'd; at most 3 len bytes (in Unicode's data no code point of
// k bytes decomposes into more than 3 k).
static char* hf_nfc(const char* s, size_t len, size_t* out_len) {
    uint32_t* cp = (uint32_t*)xmalloc(sizeof(uint32_t) * (len + 1));
    uint32_t* norm = (uint32_t*)xmalloc(sizeof(uint32_t) * (4 * len + 1));
    int n = 0;
    for (size_t b = 0; b < len; n++) b += hf_utf8((const unsigned char*)s + b, (int)(len - b), &cp[n]);
    int m = nfc(cp, n, norm);
    char* out = (char*)xmalloc(4 * (size_t)m + 1);
    size_t k = 0;
    for (int i = 0; i < m; i++) k += hf_put_utf8(out + k, norm[i]);
    out[k] = 0;
    *out_len = k;
    free(cp);
    free(norm);
    return out;
}

// Encodes a stretch of text between added tokens; first: it starts the text.
static void hf_encode_stretch(const HfTokenizer* t, const char* s, size_t len, int first, HfIds* ids) {
    if (len == 0) return;
    HfWords ws = {NULL, 0, 0};
    if (t->nfc) {
        size_t k;
        char* norm = hf_nfc(s, len, &k);
        hf_words_push(&ws, norm, k);
        free(norm);
    } else if (t->prepend) {  // Prepend("▁") + Replace(" ", "▁")
        char* m = (char*)xmalloc(3 * len + 4);
        size_t k = 3;
        memcpy(m, "\xE2\x96\x81", 3);
        for (size_t i = 0; i < len; i++)
            if (s[i] == ' ') { memcpy(m + k, "\xE2\x96\x81", 3); k += 3; } else m[k++] = s[i];
        hf_words_push(&ws, m, k);
        free(m);
    } else {
        hf_words_push(&ws, s, len);
    }
    for (int k = 0; k < t->n_steps; k++) hf_pre_step(t, &t->steps[k], &ws, first);
    for (int k = 0; k < ws.n; k++) hf_bpe_word(t, ws.w[k], ids);
    hf_words_free(&ws);
}

// The ids of text, with the post-processor's leading tokens if specials; a malloc'd array (room for
// one more id) whose count goes to *n_out.
static int* hf_encode(const HfTokenizer* t, const char* text, int specials, int* n_out) {
    size_t len = strlen(text);
    HfIds ids = {NULL, 0, 0};
    hf_ids_reserve(&ids, (int)(len < (1u << 24) ? len + 8 : 1u << 24));  // most texts need no more
    if (specials) for (int k = 0; k < t->n_prefix; k++) hf_ids_push(&ids, t->prefix_ids[k]);
    size_t start = 0;
    for (size_t pos = 0;; pos++) {
        int hit_len = 0, hit = pos < len ? literal_trie_match(&t->added_trie, text + pos, len - pos, &hit_len) : -1;
        if (hit < 0 && pos < len) continue;
        hf_encode_stretch(t, text + start, pos - start, start == 0, &ids);
        if (hit < 0) break;
        hf_ids_push(&ids, hit);
        pos += hit_len - 1;
        start = pos + 1;
    }
    hf_ids_reserve(&ids, 1);  // the room for one more
    *n_out = ids.n;
    return ids.v;
}

// The bytes of token id, given the one before it: -1 at the start, where the decoder's Strip
// drops a leading space, as it does after the post-processor's leading tokens (the library skips
// those when it decodes).
static const char* hf_decode(const HfTokenizer* t, int prev, int id) {
    if (id < 0 || id >= t->vocab_size || !t->pieces[id]) return "";
    const char* p = t->pieces[id];
    int first = prev < 0;
    for (int k = 0; k < t->n_prefix; k++) first |= prev == t->prefix_ids[k];
    if (t->strip_first && first && p[0] == ' ') p++;
    return p;
}

// ---------------------------------------------------------------------------------------------
// loading

static const char* hf_type(const Json* j) { return json_string_or(j, "type", "?"); }

// GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the others for 256 + i.
static void hf_byte_chars(HfTokenizer* t) {
    int extra = 0;
    for (int b = 0; b < 256; b++) {
        int printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        t->byte_char[b] = (unsigned short)(printable ? b : 256 + extra++);
    }
    for (int c = 0; c < 512; c++) t->char_byte[c] = -1;
    for (int b = 0; b < 256; b++) t->char_byte[t->byte_char[b]] = (short)b;
}

// The decoded bytes of a byte-level name; the name itself if a character is not a byte's.
static char* hf_unmap_bytes(const HfTokenizer* t, const char* name) {
    int len = (int)strlen(name), n = 0;
    char* out = (char*)xmalloc(len + 1);
    for (int b = 0; b < len;) {
        uint32_t c;
        b += hf_utf8((const unsigned char*)name + b, len - b, &c);
        int byte = c < 512 ? t->char_byte[c] : -1;
        if (byte < 0) { strcpy(out, name); return out; }
        out[n++] = (char)byte;
    }
    out[n] = 0;
    return out;
}

static char* hf_metaspace_piece(const HfTokenizer* t, const char* name) {
    unsigned v;
    char* out = (char*)xmalloc(strlen(name) + 1);
    if (t->bytes_decoded && strlen(name) == 6 && sscanf(name, "<0x%02X>", &v) == 1) {
        out[0] = (char)v;
        out[1] = 0;
        return out;
    }
    size_t n = 0;
    for (const char* c = name; *c;)
        if (strncmp(c, "\xE2\x96\x81", 3) == 0) { out[n++] = ' '; c += 3; } else out[n++] = *c++;
    out[n] = 0;
    return out;
}

static void hf_set_token(HfTokenizer* t, int id, const char* name, const char* path) {
    if (id < 0 || id >= t->vocab_size) fail("%s: token id %d out of range", path, id);
    if (t->names[id] && strcmp(t->names[id], name) != 0)
        fail("%s: token id %d is both \"%s\" and \"%s\"", path, id, t->names[id], name);
    if (!t->names[id]) t->names[id] = xstrdup(name);
}

static int hf_json_id(const Json* v, const char* path, const char* what) {
    if (!v || v->type != JSON_NUMBER || v->number != floor(v->number) || v->number < 0 || v->number >= (1 << 24))
        fail("%s: %s must be a token id below 2^24", path, what);
    return (int)v->number;
}

static int hf_cmp_int(const void* a, const void* b) { return *(const int*)a - *(const int*)b; }

// The added tokens by id (a content listed twice keeps its smallest id, as before), and their trie.
static void hf_index_added(HfTokenizer* t) {
    qsort(t->added, t->n_added, sizeof(int), hf_cmp_int);
    const char** strs = (const char**)xmalloc(sizeof(char*) * (t->n_added + 1));
    int* lens = (int*)xmalloc(sizeof(int) * (t->n_added + 1));
    for (int k = 0; k < t->n_added; k++) {
        strs[k] = t->names[t->added[k]];
        lens[k] = (int)strlen(strs[k]);
    }
    literal_trie_build(&t->added_trie, strs, lens, t->added, t->n_added);
    free(strs);
    free(lens);
}

static void hf_load_vocab(HfTokenizer* t, const Json* model, const Json* added, const char* path) {
    const Json* vocab = json_get(model, "vocab");
    if (!vocab || vocab->type != JSON_OBJECT) fail("%s: model.vocab must be an object of token -> id", path);
    int max_id = -1;
    for (int i = 0; i < vocab->count; i++) {
        int id = hf_json_id(&vocab->items[i], path, "model.vocab values");
        if (id > max_id) max_id = id;
    }
    for (int i = 0; added && i < added->count; i++) {
        int id = hf_json_id(json_get(&added->items[i], "id"), path, "added_tokens[].id");
        if (id > max_id) max_id = id;
    }
    t->vocab_size = max_id + 1;
    t->names = (char**)xcalloc(t->vocab_size, sizeof(char*));
    for (int i = 0; i < vocab->count; i++) hf_set_token(t, (int)vocab->items[i].number, vocab->keys[i], path);
    t->added = (int*)xmalloc(sizeof(int) * (added ? added->count + 1 : 1));
    for (int i = 0; added && i < added->count; i++) {
        const Json* a = &added->items[i];
        const char* content = json_string_or(a, "content", NULL);
        if (!content || !*content) fail("%s: added_tokens[%d] has no content", path, i);
        if (json_bool_or(a, "lstrip", 0) || json_bool_or(a, "rstrip", 0) || json_bool_or(a, "single_word", 0))
            fail("%s: added token \"%s\" uses lstrip, rstrip or single_word, which is not supported", path, content);
        int id = (int)json_get(a, "id")->number;
        hf_set_token(t, id, content, path);
        t->added[t->n_added++] = id;
    }
    hf_map_init(&t->by_name, t->vocab_size);
    for (int id = 0; id < t->vocab_size; id++) {
        if (!t->names[id]) continue;
        uint64_t h = hf_hash_str(t->names[id], strlen(t->names[id]));
        size_t s = hf_hash(h) & t->by_name.mask;
        while (t->by_name.keys[s]) s = (s + 1) & t->by_name.mask;  // equal hashes chain on
        t->by_name.keys[s] = h;
        t->by_name.vals[s] = id;
    }
    hf_index_added(t);
}

static void hf_load_merges(HfTokenizer* t, const Json* merges, const char* path) {
    if (!merges || merges->type != JSON_ARRAY) fail("%s: model.merges must be an array", path);
    hf_map_init(&t->merges, merges->count);
    t->merge_to = (int*)xmalloc(sizeof(int) * (merges->count + 1));
    for (int r = 0; r < merges->count; r++) {
        const Json* m = &merges->items[r];
        char* left = NULL;
        const char* right = NULL;
        if (m->type == JSON_STRING && strchr(m->string, ' ')) {  // "a b"
            left = xstrdup(m->string);
            *strchr(left, ' ') = 0;
            right = strchr(m->string, ' ') + 1;
        } else if (m->type == JSON_ARRAY && m->count == 2 && m->items[0].type == JSON_STRING &&
                   m->items[1].type == JSON_STRING) {
            left = xstrdup(m->items[0].string);
            right = m->items[1].string;
        } else {
            fail("%s: model.merges[%d] is not \"a b\" or [\"a\", \"b\"]", path, r);
        }
        int a = hf_lookup(t, left), b = hf_lookup(t, right);
        size_t la = strlen(left), lr = strlen(right);
        char* both = (char*)xmalloc(la + lr + 1);
        memcpy(both, left, la);
        memcpy(both + la, right, lr + 1);
        t->merge_to[r] = hf_lookup(t, both);
        if (a < 0 || b < 0 || t->merge_to[r] < 0)
            fail("%s: model.merges[%d] (\"%s\" \"%s\") names a token not in the vocabulary", path, r, left, right);
        size_t s = hf_map_slot(&t->merges, hf_pair_key(a, b));
        t->merges.keys[s] = hf_pair_key(a, b);
        t->merges.vals[s] = r;  // a pair listed twice keeps its last rank, as the library's map does
        free(both);
        free(left);
    }
}

// The regex of a Split pre-tokenizer, recognised by its text.
static int hf_split_regex(const Json* step, const char* path) {
    static const char* gpt2 = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
    static const char* llama3 =
        "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
        "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
    static const char* qwen2 =
        "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
        "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
    const char* re = json_string_or(json_get(step, "pattern"), "Regex", NULL);
    const char* behavior = json_string_or(step, "behavior", "?");
    if (!re) fail("%s: pre-tokenizer Split on a plain string is not supported (expected a Regex)", path);
    if (strcmp(behavior, "Isolated") != 0 || json_bool_or(step, "invert", 0))
        fail("%s: pre-tokenizer Split with behavior %s%s is not supported (expected Isolated)", path, behavior,
             json_bool_or(step, "invert", 0) ? " inverted" : "");
    if (strcmp(re, gpt2) == 0) return HF_RE_GPT2;
    if (strcmp(re, llama3) == 0) return HF_RE_LLAMA3;
    if (strcmp(re, qwen2) == 0) return HF_RE_QWEN2;
    fail("%s: pre-tokenizer Split regex %s is not supported (expected GPT-2's, Llama-3's or Qwen2's)", path, re);
    return 0;
}

static int hf_metaspace_scheme(const Json* j, const char* path) {
    const char* r = json_string_or(j, "replacement", "\xE2\x96\x81");
    if (strcmp(r, "\xE2\x96\x81") != 0)
        fail("%s: Metaspace replacement \"%s\" is not supported (expected \"\xE2\x96\x81\")", path, r);
    const char* scheme =
        json_string_or(j, "prepend_scheme", json_bool_or(j, "add_prefix_space", 1) ? "always" : "never");
    if (strcmp(scheme, "never") == 0) return 0;
    if (strcmp(scheme, "first") == 0) return 1;
    if (strcmp(scheme, "always") == 0) return 2;
    fail("%s: Metaspace prepend_scheme \"%s\" is not supported", path, scheme);
    return 0;
}

static void hf_add_step(HfTokenizer* t, const Json* j, const char* path) {
    if (t->n_steps == HF_MAX_STEPS) fail("%s: more than %d pre-tokenizers", path, HF_MAX_STEPS);
    HfPreStep* st = &t->steps[t->n_steps++];
    memset(st, 0, sizeof(*st));
    const char* type = hf_type(j);
    if (strcmp(type, "Digits") == 0) { st->kind = HF_STEP_DIGITS; st->arg = json_bool_or(j, "individual_digits", 0); }
    else if (strcmp(type, "Split") == 0) { st->kind = HF_STEP_SPLIT; st->arg = hf_split_regex(j, path); }
    else if (strcmp(type, "ByteLevel") == 0) {
        st->kind = HF_STEP_BYTE_LEVEL;
        st->arg = json_bool_or(j, "use_regex", 1);
        st->prefix = json_bool_or(j, "add_prefix_space", 1);
    } else if (strcmp(type, "Metaspace") == 0) {
        st->kind = HF_STEP_METASPACE;
        st->prefix = hf_metaspace_scheme(j, path);
        st->split = json_bool_or(j, "split", 1);
    } else fail("%s: pre-tokenizer %s is not supported (expected ByteLevel, Digits, Split or Metaspace)", path, type);
}

static void hf_load_pre_tokenizer(HfTokenizer* t, const Json* pre, const char* path) {
    if (pre && pre->type == JSON_OBJECT && strcmp(hf_type(pre), "Sequence") == 0) {
        const Json* list = json_get(pre, "pretokenizers");
        if (!list || list->type != JSON_ARRAY) fail("%s: pre_tokenizer Sequence needs a pretokenizers array", path);
        for (int i = 0; i < list->count; i++) hf_add_step(t, &list->items[i], path);
    } else if (pre && pre->type == JSON_OBJECT) {
        hf_add_step(t, pre, path);
    }
    int byte_level = 0, metaspace = 0;
    for (int i = 0; i < t->n_steps; i++) {
        if (t->steps[i].kind == HF_STEP_BYTE_LEVEL && i != t->n_steps - 1)
            fail("%s: pre-tokenizer ByteLevel must come last", path);
        byte_level |= t->steps[i].kind == HF_STEP_BYTE_LEVEL;
        metaspace |= t->steps[i].kind == HF_STEP_METASPACE;
    }
    if (metaspace && t->n_steps != 1) fail("%s: pre-tokenizer Metaspace must come alone", path);
    t->kind = byte_level ? HF_BYTE_LEVEL : (metaspace || t->prepend) ? HF_METASPACE : 0;
    if (!t->kind)
        fail("%s: neither a ByteLevel nor a Metaspace (or Prepend + Replace) tokenizer: not a LLaMA-family BPE", path);
    if (metaspace && t->nfc) fail("%s: an NFC normalizer with a Metaspace pre-tokenizer is not supported", path);
    if (byte_level && t->prepend)
        fail("%s: a Prepend normalizer with a ByteLevel pre-tokenizer is not supported", path);
}

// Llama-2's normalizer: Sequence [Prepend("▁"), Replace(" " -> "▁")]; Qwen2's: NFC; or none.
static void hf_load_normalizer(HfTokenizer* t, const Json* norm, const char* path) {
    if (!norm || norm->type == JSON_NULL) return;
    if (strcmp(hf_type(norm), "NFC") == 0) { t->nfc = 1; return; }
    const Json* list = json_get(norm, "normalizers");
    int ok = strcmp(hf_type(norm), "Sequence") == 0 && list && list->type == JSON_ARRAY && list->count == 2;
    if (ok) {
        const Json *p = &list->items[0], *r = &list->items[1];
        ok = strcmp(hf_type(p), "Prepend") == 0 && strcmp(json_string_or(p, "prepend", ""), "\xE2\x96\x81") == 0 &&
             strcmp(hf_type(r), "Replace") == 0 &&
             strcmp(json_string_or(json_get(r, "pattern"), "String", ""), " ") == 0 &&
             strcmp(json_string_or(r, "content", ""), "\xE2\x96\x81") == 0;
    }
    if (!ok)
        fail(
            "%s: normalizer %s is not supported (expected none, NFC, or Llama-2's Prepend(\"\xE2\x96\x81\") + "
            "Replace(\" \", \"\xE2\x96\x81\"))",
            path, hf_type(norm));
    t->prepend = 1;
}

// Leading special tokens of a TemplateProcessing post-processor (directly or in a Sequence).
static void hf_load_post_processor(HfTokenizer* t, const Json* post, const char* path) {
    if (!post || post->type != JSON_OBJECT) return;
    const char* type = hf_type(post);
    if (strcmp(type, "Sequence") == 0) {
        const Json* list = json_get(post, "processors");
        for (int i = 0; list && list->type == JSON_ARRAY && i < list->count; i++)
            hf_load_post_processor(t, &list->items[i], path);
        return;
    }
    if (strcmp(type, "ByteLevel") == 0) return;  // offsets only
    if (strcmp(type, "TemplateProcessing") != 0)
        fail("%s: post_processor %s is not supported (expected TemplateProcessing or ByteLevel)", path, type);
    const Json* single = json_get(post, "single");
    for (int i = 0; single && single->type == JSON_ARRAY && i < single->count; i++) {
        const Json* sp = json_get(&single->items[i], "SpecialToken");
        if (!sp) break;  // the sequence: what follows it is not added
        const char* name = json_string_or(sp, "id", "");
        int id = hf_lookup(t, name);
        if (id < 0) fail("%s: post_processor special token \"%s\" is not in the vocabulary", path, name);
        if (t->n_prefix == 4) fail("%s: post_processor has more than 4 leading special tokens", path);
        t->prefix_ids[t->n_prefix++] = id;
    }
}

// The decoder must be the one of the tokenizer's family; sets strip_first.
static void hf_check_decoder(HfTokenizer* t, const Json* dec, const char* path) {
    const char* type = dec && dec->type == JSON_OBJECT ? hf_type(dec) : "none";
    if (t->kind == HF_BYTE_LEVEL) {
        if (strcmp(type, "ByteLevel") != 0)
            fail("%s: decoder %s is not supported with a ByteLevel pre-tokenizer (expected ByteLevel)", path, type);
        return;
    }
    const Json* list = json_get(dec, "decoders");
    int ok = strcmp(type, "Sequence") == 0 && list && list->type == JSON_ARRAY;
    int fused = 0;
    for (int i = 0; ok && i < list->count; i++) {
        const Json* d = &list->items[i];
        const char* dt = hf_type(d);
        if (strcmp(dt, "Strip") == 0) {  // after Fuse it strips the start of the whole text
            ok = fused && i == list->count - 1 && strcmp(json_string_or(d, "content", ""), " ") == 0 &&
                 json_number_or(d, "start", 0) == 1 && json_number_or(d, "stop", 0) == 0;
            t->strip_first = 1;
        } else if (strcmp(dt, "Replace") == 0) {
            ok = strcmp(json_string_or(json_get(d, "pattern"), "String", ""), "\xE2\x96\x81") == 0 &&
                 strcmp(json_string_or(d, "content", ""), " ") == 0;
        } else if (strcmp(dt, "ByteFallback") == 0) {
            t->bytes_decoded = 1;
        } else {
            ok = strcmp(dt, "Fuse") == 0;
            fused = 1;
        }
    }
    if (!ok)
        fail(
            "%s: decoder %s is not supported for a SentencePiece-style BPE (expected Replace + ByteFallback + Fuse + "
            "Strip)",
            path, type);
}

static void hf_tokenizer_load(HfTokenizer* t, const char* path) {
    memset(t, 0, sizeof(*t));
    size_t size;
    char* text = read_file(path, &size);
    Json j = json_parse(text, size, path);
    free(text);
    const Json* model = json_get(&j, "model");
    if (!model || model->type != JSON_OBJECT) fail("%s: no \"model\" object: not a tokenizer.json", path);
    const char* type = json_string_or(model, "type", "BPE");  // older files leave BPE's type out
    if (strcmp(type, "BPE") != 0)
        fail("%s: model type %s is not supported (expected BPE: byte-level or SentencePiece-style)", path, type);
    const Json* dropout = json_get(model, "dropout");
    if (dropout && dropout->type != JSON_NULL) fail("%s: BPE dropout is not supported", path);
    const char* affixes[2] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (int k = 0; k < 2; k++)
        if (*json_string_or(model, affixes[k], "")) fail("%s: BPE %s is not supported", path, affixes[k]);
    hf_byte_chars(t);
    const Json* added = json_get(&j, "added_tokens");
    if (added && added->type != JSON_ARRAY) fail("%s: added_tokens must be an array", path);
    hf_load_vocab(t, model, added, path);
    hf_load_merges(t, json_get(model, "merges"), path);
    hf_load_normalizer(t, json_get(&j, "normalizer"), path);
    hf_load_pre_tokenizer(t, json_get(&j, "pre_tokenizer"), path);
    hf_load_post_processor(t, json_get(&j, "post_processor"), path);
    hf_check_decoder(t, json_get(&j, "decoder"), path);
    t->byte_fallback = json_bool_or(model, "byte_fallback", 0);
    t->fuse_unk = json_bool_or(model, "fuse_unk", 0);
    t->ignore_merges = json_bool_or(model, "ignore_merges", 0);
    const char* unk = json_string_or(model, "unk_token", NULL);
    t->unk_id = unk ? hf_lookup(t, unk) : -1;
    t->pieces = (char**)xcalloc(t->vocab_size, sizeof(char*));
    for (int id = 0; id < t->vocab_size; id++)
        if (t->names[id])
            t->pieces[id] =
                t->kind == HF_BYTE_LEVEL ? hf_unmap_bytes(t, t->names[id]) : hf_metaspace_piece(t, t->names[id]);
    json_free(&j);
}

static void hf_tokenizer_free(HfTokenizer* t) {
    for (int i = 0; i < t->vocab_size; i++) { free(t->names[i]); free(t->pieces[i]); }
    free(t->names); free(t->pieces); free(t->added); free(t->merge_to);
    literal_trie_free(&t->added_trie);
    hf_map_free(&t->by_name);
    hf_map_free(&t->merges);
    memset(t, 0, sizeof(*t));
}
