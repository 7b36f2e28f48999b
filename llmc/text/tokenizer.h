// tokenizer.h: the llama2.c tokenizer.bin format (int32 max_token_length, then per token:
// float32 score, int32 length, bytes) with its score-driven BPE encoder and a decoder that turns
// byte pieces "<0xXX>" into raw bytes. The model directory carries it as tokenizer.bin (without
// one, --generate reads the Hugging Face tokenizer.json: hf_tokenizer.h, model_tokenizer.h).
//
// A tokenizer_config.json beside tokenizer.bin may hold a "tokenizer_bin" block (written by
// scripts/export/export_llama.py --gguf): {"type": "sentencepiece" (default) | "byte_level", "bos_id",
// "eos_id", "add_bos", "special_ids": [...], "pretokenizer": "gpt2" | "gpt2_digits" | "none"}.
// Without one: llama2.c's sentencepiece rules, BOS 1, EOS 2, add_bos. With add_bos false, encode
// adds the BOS it is asked for only to an empty text (generation needs a first token).
// "byte_level" is a GPT-2 style byte-level BPE whose pieces are the raw bytes and whose scores
// are minus the merge rank:
//   - encode: no dummy-prefix space; special tokens are matched literally in the text (longest
//     first) and never merged; the text between them is split into pre-tokens by GPT-2's regex
//     's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//     ("gpt2_digits": every digit alone, as SmolLM2/StarCoder split them first; "none": no
//     split); each pre-token starts as one token per byte (a byte without a token is dropped) and
//     is merged like llama2.c's (best-scoring adjacent pair first);
//   - decode: the piece's bytes, exactly (no BOS-space stripping, no "<0xXX>" parsing).
// Approximations: the regex classes are ASCII ones, with every byte >= 0x80 a letter (so
// non-ASCII punctuation, symbols and digits join words); and merges are ranked by the token they
// make, not by the pair (real BPE merges only listed pairs). On English text the ids equal the
// real tokenizer's (test/formats/test_gguf_export.py checks SmolLM2 against an exact BPE of its merges);
// wherever they differ they still decode to the same text. scripts/formats/llama2c_tokenizer.py
// implements the same rules in Python. C strings: the byte 0 cannot be encoded and prints as
// nothing.
#pragma once
#include "../common.h"
#include "../formats/json.h"
#include "bpe_merge.h"
#include "literal_trie.h"

typedef struct {
    int vocab_size;
    char** pieces;
    int* lengths;
    float* scores;
    int* sorted;          // token ids sorted by piece, for binary search
    int bos_id, eos_id;
    int add_bos;          // encode(bos=1) adds BOS: always for llama2.c; per the config if byte-level
    int byte_level;       // GPT-2 style byte-level BPE (see above)
    int pretok;           // byte-level pre-tokenizer: TOK_PRE_NONE, TOK_PRE_GPT2, TOK_PRE_GPT2_DIGITS
    int byte_ids[256];    // byte-level: the token of each single byte, -1 if it has none
    char* special;        // byte-level: 1 for tokens matched literally and never merged (or NULL)
    int* special_ids;     // the same tokens, longest piece first
    int n_special;
    LiteralTrie special_trie;  // the same tokens, matched in the text
    int max_length;       // of a piece
} Tokenizer;

enum { TOK_PRE_NONE, TOK_PRE_GPT2, TOK_PRE_GPT2_DIGITS };

static const Tokenizer* g_sort_tok;  // only used during qsort in tokenizer_load
static int tok_cmp_ids(const void* a, const void* b) {
    const Tokenizer* t = g_sort_tok;
    int x = *(const int*)a, y = *(const int*)b;
    int c = strcmp(t->pieces[x], t->pieces[y]);
    return c ? c : x - y;
}

static const Tokenizer* g_sort_special;  // only used during qsort in tokenizer_read_config
static int tok_cmp_special(const void* a, const void* b) {
    int x = *(const int*)a, y = *(const int*)b;
    int d = g_sort_special->lengths[y] - g_sort_special->lengths[x];
    return d ? d : x - y;
}

static int tok_config_id(const Json* block, const char* key, int dflt, int vocab, const char* src) {
    const Json* v = json_get(block, key);
    if (!v) return dflt;
    if (v->type != JSON_NUMBER || v->number != floor(v->number) || v->number < 0 || v->number >= vocab)
        fail("%s: tokenizer_bin.%s must be a token id below the vocabulary size %d", src, key, vocab);
    return (int)v->number;
}

// The trie of the special tokens: in tok_cmp_special's order, so a piece listed twice keeps its
// smallest id.
static void tokenizer_index_specials(Tokenizer* t) {
    const char** strs = (const char**)xmalloc(sizeof(char*) * (t->n_special + 1));
    for (int k = 0; k < t->n_special; k++) strs[k] = t->pieces[t->special_ids[k]];
    int* lens = (int*)xmalloc(sizeof(int) * (t->n_special + 1));
    for (int k = 0; k < t->n_special; k++) lens[k] = (int)strlen(strs[k]);  // matched as C strings
    literal_trie_build(&t->special_trie, strs, lens, t->special_ids, t->n_special);
    free(strs);
    free(lens);
}

// Reads the "tokenizer_bin" block of DIR/tokenizer_config.json, DIR being tokenizer.bin's folder.
static void tokenizer_read_config(Tokenizer* t, const char* path) {
    const char* slash = strrchr(path, '/');
    char* dir = slash ? xstrdup(path) : xstrdup(".");
    if (slash) dir[slash - path] = 0;
    char* cfg_path = path_join(dir, "tokenizer_config.json");  // "/x.bin": dir "" gives "/tokenizer_config.json"
    free(dir);
    if (!optional_file_exists(cfg_path)) { free(cfg_path); return; }
    size_t n;
    char* text = read_file(cfg_path, &n);
    Json j = json_parse(text, n, cfg_path);
    const Json* b = json_get(&j, "tokenizer_bin");
    if (b) {
        if (b->type != JSON_OBJECT) fail("%s: tokenizer_bin must be an object", cfg_path);
        const char* type = json_string_or(b, "type", "sentencepiece");
        if (strcmp(type, "byte_level") == 0) t->byte_level = 1;
        else if (strcmp(type, "sentencepiece") != 0)
            fail("%s: tokenizer_bin.type \"%s\" is not sentencepiece or byte_level", cfg_path, type);
        t->bos_id = tok_config_id(b, "bos_id", t->bos_id, t->vocab_size, cfg_path);
        t->eos_id = tok_config_id(b, "eos_id", t->eos_id, t->vocab_size, cfg_path);
        t->add_bos = json_bool_or(b, "add_bos", 1);
        const char* pre = json_string_or(b, "pretokenizer", "none");
        if (strcmp(pre, "gpt2") == 0) t->pretok = TOK_PRE_GPT2;
        else if (strcmp(pre, "gpt2_digits") == 0) t->pretok = TOK_PRE_GPT2_DIGITS;
        else if (strcmp(pre, "none") != 0)
            fail("%s: tokenizer_bin.pretokenizer \"%s\" is not gpt2, gpt2_digits or none", cfg_path, pre);
        const Json* sp = json_get(b, "special_ids");
        if (t->byte_level && sp) {
            if (sp->type != JSON_ARRAY) fail("%s: tokenizer_bin.special_ids must be an array", cfg_path);
            t->special = (char*)xcalloc(t->vocab_size, 1);
            t->special_ids = (int*)xmalloc(sizeof(int) * (sp->count + 1));
            for (int i = 0; i < sp->count; i++) {
                const Json* v = &sp->items[i];
                if (v->type != JSON_NUMBER || v->number != floor(v->number) || v->number < 0 ||
                    v->number >= t->vocab_size)
                    fail("%s: tokenizer_bin.special_ids[%d] is not a token id below %d", cfg_path, i, t->vocab_size);
                int id = (int)v->number;
                if (!t->special[id] && t->lengths[id] > 0) t->special_ids[t->n_special++] = id;
                t->special[id] = 1;
            }
            g_sort_special = t;
            qsort(t->special_ids, t->n_special, sizeof(int), tok_cmp_special);
            tokenizer_index_specials(t);
        }
    }
    json_free(&j);
    free(text);
    free(cfg_path);
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
    t->add_bos = 1;
    tokenizer_read_config(t, path);
    for (int i = 0; i < t->vocab_size; i++)
        if (t->lengths[i] > t->max_length) t->max_length = t->lengths[i];
    for (int b = 0; b < 256; b++) t->byte_ids[b] = -1;
    if (t->byte_level)
        for (int i = t->vocab_size - 1; i >= 0; i--)  // the smallest id wins
            if (t->lengths[i] == 1 && !(t->special && t->special[i])) t->byte_ids[(unsigned char)t->pieces[i][0]] = i;
}

static void tokenizer_free(Tokenizer* t) {
    for (int i = 0; i < t->vocab_size; i++) free(t->pieces[i]);
    free(t->pieces); free(t->lengths); free(t->scores); free(t->sorted);
    free(t->special); free(t->special_ids);
    literal_trie_free(&t->special_trie);
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

// llama2.c's merge rule (bpe_merge.h): a pair merges when its two pieces joined are a token (not a
// special one), the best-scoring first. Scores at or below -1e30 (or NaN) never merge, as before.
typedef struct {
    const Tokenizer* t;
    char* joined;  // room for two pieces
} TokPairCtx;

static int tokenizer_pair(const void* ctx, int a, int b, double* key, int* to) {
    const Tokenizer* t = ((const TokPairCtx*)ctx)->t;
    char* joined = ((const TokPairCtx*)ctx)->joined;
    size_t la = strlen(t->pieces[a]), lb = strlen(t->pieces[b]);  // C strings, as the lookup compares them
    memcpy(joined, t->pieces[a], la);
    memcpy(joined + la, t->pieces[b], lb + 1);
    int id = tokenizer_lookup(t, joined);
    if (id < 0 || (t->special && t->special[id]) || !(t->scores[id] > -1e30f)) return 0;
    *key = -(double)t->scores[id];
    *to = id;
    return 1;
}

// Merges ids[0..n) by that rule, leftmost on ties, until no pair merges; returns the new count.
static int tokenizer_merge(const Tokenizer* t, int* ids, int n) {
    TokPairCtx ctx = {t, (char*)xmalloc(2 * (size_t)t->max_length + 1)};
    n = bpe_merge(ids, n, tokenizer_pair, &ctx);
    free(ctx.joined);
    return n;
}

// Byte classes of the pre-tokenizer regex: ASCII letters and every byte >= 0x80 are letters.
enum { TOK_OTHER, TOK_LETTER, TOK_DIGIT, TOK_SPACE };
static int tok_class(unsigned char c) {
    if (c >= 0x80 || (unsigned)((c | 32) - 'a') < 26u) return TOK_LETTER;
    if ((unsigned)(c - '0') < 10u) return TOK_DIGIT;
    if (c == ' ' || (c >= '\t' && c <= '\r')) return TOK_SPACE;
    return TOK_OTHER;
}

// The end of the pre-token that starts at s[i] (i < n), n being the end of the stretch; see the
// regex in the header comment. digits_alone: each digit is its own piece and ends the text
// around it, as a split on \p{N} before the regex does.
static int tok_pretoken_end(const unsigned char* s, int i, int n, int digits_alone) {
    if (s[i] == '\'' && i + 1 < n) {
        unsigned char a = s[i + 1], b = i + 2 < n ? s[i + 2] : 0;
        if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 2;
        if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return i + 3;
    }
    int c = tok_class(s[i]);
    if (c == TOK_DIGIT && digits_alone) return i + 1;
    int j = i;
    if (s[i] == ' ' && i + 1 < n && tok_class(s[i + 1]) != TOK_SPACE &&
        !(digits_alone && tok_class(s[i + 1]) == TOK_DIGIT))
        c = tok_class(s[++j]);  // " ?" before a word, a number or punctuation
    if (c != TOK_SPACE) {
        while (j < n && tok_class(s[j]) == c) j++;
        return j;
    }
    while (j < n && tok_class(s[j]) == TOK_SPACE) j++;
    if (j == n || (digits_alone && tok_class(s[j]) == TOK_DIGIT)) return j;  // to the end of the text
    return j - i > 1 ? j - 1 : j;  // \s+(?!\S) leaves the last one to what follows; else \s+
}

// Byte-level encoding of text after the optional BOS (see the header comment).
static int tokenizer_encode_byte_level(const Tokenizer* t, const char* text, int* ids) {
    int n = 0, start = 0, len = (int)strlen(text);
    const unsigned char* s = (const unsigned char*)text;
    for (int pos = 0;; pos++) {
        int hit_len = 0, hit = s[pos] ? literal_trie_match(&t->special_trie, text + pos, len - pos, &hit_len) : -1;
        if (hit < 0 && s[pos]) continue;
        // the stretch [start, pos): pre-tokens, each one token per byte, then merges
        for (int a = start; a < pos;) {
            int b = t->pretok == TOK_PRE_NONE ? pos : tok_pretoken_end(s, a, pos, t->pretok == TOK_PRE_GPT2_DIGITS);
            int seg = n;
            for (int i = a; i < b; i++)
                if (t->byte_ids[s[i]] >= 0) ids[n++] = t->byte_ids[s[i]];
            n = seg + tokenizer_merge(t, ids + seg, n - seg);
            a = b;
        }
        if (hit < 0) break;  // end of text
        ids[n++] = hit;
        pos += hit_len - 1;
        start = pos + 1;
    }
    return n;
}

// Encodes text (with a leading BOS if bos) into ids; returns the count. ids holds strlen(text)+3.
static int tokenizer_encode(const Tokenizer* t, const char* text, int bos, int* ids) {
    int n = 0;
    if (bos && (t->add_bos || !*text)) ids[n++] = t->bos_id;  // an empty text still needs a start
    if (t->byte_level) return n + tokenizer_encode_byte_level(t, text, ids + n);
    if (!*text) return n;
    int head = n;  // merges start after the BOS
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
        else  // byte fallback: <0xXX> is token 3 + XX in sentencepiece vocabularies; <unk> if the vocabulary is smaller
            for (int k = 0; k < len; k++)
                ids[n++] = (unsigned char)cp[k] + 3 < t->vocab_size ? (unsigned char)cp[k] + 3 : 0;
        c += len;
    }
    return head + tokenizer_merge(t, ids + head, n - head);
}

// The bytes one token stands for, given the previous token (a leading space after BOS is dropped).
static const char* tokenizer_decode(const Tokenizer* t, int prev, int id, char byte_buf[2]) {
    if (id < 0 || id >= t->vocab_size) return "";
    const char* p = t->pieces[id];
    if (t->byte_level) return p;
    if (prev == t->bos_id && p[0] == ' ') p++;
    unsigned v;
    if (strlen(p) == 6 && sscanf(p, "<0x%02X>", &v) == 1) { byte_buf[0] = (char)v; byte_buf[1] = 0; return byte_buf; }
    return p;
}
