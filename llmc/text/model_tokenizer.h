// model_tokenizer.h: the tokenizer of a model directory for --generate: DIR/tokenizer.bin (the
// llama2.c format, tokenizer.h) when it is there, else DIR/tokenizer.json (a Hugging Face
// tokenizer, hf_tokenizer.h); one encode and decode over both, and the tokens that end generation.
//   tokenizer.bin: BOS and EOS as tokenizer.h reads them, config.json's eos_token_id, and every
//   eos_token_id of generation_config.json when there is one (as transformers' generate() takes them).
//   tokenizer.json: BOS is the post-processor's leading token, else tokenizer_config.json's
//   bos_token, else config.json's bos_token_id; generation ends at every eos_token_id of
//   generation_config.json and config.json (a number or a list) and at tokenizer_config.json's
//   eos_token, whichever of these files exist.
// Generation also ends at BOS, which starts a new document.
// --chat: the prompt becomes a user message (after an optional system message) rendered by the
// model's own chat template (tokenizer_config.json's chat_template, llmc/text/chat_template.h) with
// add_generation_prompt, and generation also ends at the template's end-of-turn token.
#pragma once
#include "tokenizer.h"
#include "hf_tokenizer.h"
#include "chat_template.h"

enum { MODEL_TOK_MAX_END = 16 };

typedef struct {
    int is_hf;
    Tokenizer bin;
    HfTokenizer hf;
    int bos_id;                      // starts an empty prompt; -1: none
    int end_ids[MODEL_TOK_MAX_END];  // generation stops at these
    int n_end;
} ModelTokenizer;

static void model_tok_add_end(ModelTokenizer* t, int id) {
    for (int k = 0; k < t->n_end; k++) if (t->end_ids[k] == id) return;
    if (t->n_end < MODEL_TOK_MAX_END) t->end_ids[t->n_end++] = id;
}

// A token id field that is a number or a list of them; each goes to the end tokens or, for a
// single number, is returned (-1 when absent).
static int model_tok_ids(ModelTokenizer* t, const Json* v, int vocab, const char* path, const char* key, int as_end) {
    if (!v || v->type == JSON_NULL) return -1;
    int n = v->type == JSON_ARRAY ? v->count : 1;
    for (int i = 0; i < n; i++) {
        const Json* x = v->type == JSON_ARRAY ? &v->items[i] : v;
        if (x->type != JSON_NUMBER || x->number != floor(x->number) || x->number < 0 || x->number >= vocab)
            fail("%s: %s must be a token id below the vocabulary size %d (or a list of them)", path, key, vocab);
        if (as_end) model_tok_add_end(t, (int)x->number);
    }
    return v->type == JSON_NUMBER ? (int)v->number : -1;
}

// tokenizer_config.json's bos_token / eos_token: a string or {"content": string}; -1 when absent.
static int model_tok_named(const HfTokenizer* hf, const Json* cfg, const char* key, const char* path) {
    const Json* v = json_get(cfg, key);
    const char* name = v && v->type == JSON_STRING   ? v->string
                       : v && v->type == JSON_OBJECT ? json_string_or(v, "content", NULL)
                                                     : NULL;
    if (!name) return -1;
    int id = hf_lookup(hf, name);
    if (id < 0) fail("%s: %s \"%s\" is not a token of tokenizer.json", path, key, name);
    return id;
}

// Parses DIR/name if it exists; returns 0 (and leaves *j alone) if not.
static int model_tok_read_json(const char* dir, const char* name, Json* j, char** path) {
    *path = path_join(dir, name);
    if (!optional_file_exists(*path)) return 0;
    size_t n;
    char* text = read_file(*path, &n);
    *j = json_parse(text, n, *path);
    free(text);
    return 1;
}

static void model_tok_load_hf(ModelTokenizer* t, const char* dir, const char* json_path, int vocab) {
    t->is_hf = 1;
    hf_tokenizer_load(&t->hf, json_path);
    if (t->hf.vocab_size > vocab)
        fail("%s: has token id %d but the model's vocab_size is %d", json_path, t->hf.vocab_size - 1, vocab);
    int cfg_bos = -1, tc_bos = -1;
    Json j;
    char* path;
    if (model_tok_read_json(dir, "generation_config.json", &j, &path)) {
        model_tok_ids(t, json_get(&j, "eos_token_id"), vocab, path, "eos_token_id", 1);
        json_free(&j);
    }
    free(path);
    if (model_tok_read_json(dir, "config.json", &j, &path)) {
        model_tok_ids(t, json_get(&j, "eos_token_id"), vocab, path, "eos_token_id", 1);
        cfg_bos = model_tok_ids(t, json_get(&j, "bos_token_id"), vocab, path, "bos_token_id", 0);
        json_free(&j);
    }
    free(path);
    if (model_tok_read_json(dir, "tokenizer_config.json", &j, &path)) {
        int eos = model_tok_named(&t->hf, &j, "eos_token", path);
        if (eos >= 0) model_tok_add_end(t, eos);
        tc_bos = model_tok_named(&t->hf, &j, "bos_token", path);
        json_free(&j);
    }
    free(path);
    t->bos_id = t->hf.n_prefix ? t->hf.prefix_ids[0] : tc_bos >= 0 ? tc_bos : cfg_bos;
}

// Loads DIR's tokenizer for a model of `vocab` tokens whose config.json says eos_token_id cfg_eos.
static void model_tokenizer_load(ModelTokenizer* t, const char* dir, int vocab, int cfg_eos) {
    memset(t, 0, sizeof(*t));
    char* bin = path_join(dir, "tokenizer.bin");
    char* json = path_join(dir, "tokenizer.json");
    if (optional_file_exists(bin)) {
        tokenizer_load(&t->bin, bin, vocab);
        t->bos_id = t->bin.bos_id;
        model_tok_add_end(t, cfg_eos);
        Json j;
        char* path;
        if (model_tok_read_json(dir, "generation_config.json", &j, &path)) {  // invalid JSON: one line naming it
            model_tok_ids(t, json_get(&j, "eos_token_id"), vocab, path, "eos_token_id", 1);
            json_free(&j);
        }
        free(path);
    } else if (optional_file_exists(json)) {
        model_tok_load_hf(t, dir, json, vocab);
    } else {
        fail(
            "%s: no tokenizer.bin or tokenizer.json; --generate needs the model's tokenizer (a Hugging Face model "
            "directory ships tokenizer.json)",
            dir);
    }
    free(bin);
    free(json);
}

// The ids of a prompt as --generate feeds it: with BOS where the tokenizer adds one, and BOS
// alone for an empty prompt (generation needs a first token). A malloc'd array; count in *n.
static int* model_tokenizer_encode(const ModelTokenizer* t, const char* text, int* n) {
    if (!t->is_hf) {
        int* ids = (int*)xmalloc(sizeof(int) * (strlen(text) + 3));
        *n = tokenizer_encode(&t->bin, text, 1, ids);
        return ids;
    }
    int* ids = hf_encode(&t->hf, text, 1, n);
    if (*n == 0) {
        if (t->bos_id < 0) fail("flag --prompt: empty, and the model's tokenizer has no BOS token to start from");
        ids[(*n)++] = t->bos_id;
    }
    return ids;
}

// The ids of text as it stands: no BOS added (a chat template renders its own).
static int* model_tokenizer_encode_plain(const ModelTokenizer* t, const char* text, int* n) {
    if (t->is_hf) return hf_encode(&t->hf, text, 0, n);
    int* ids = (int*)xmalloc(sizeof(int) * (strlen(text) + 3));
    *n = tokenizer_encode(&t->bin, text, 0, ids);
    return ids;
}

// Refuses a prompt (chat: a rendered chat template, fed without BOS) of more tokens than the
// `window` generation runs in: the model would see only the window's last half of it (the
// restart of a full cache), silently. `window_what` says what sets the window (a flag).
static void model_tokenizer_check_prompt(const ModelTokenizer* t, const char* text, int chat, int window,
                                         const char* window_what) {
    int n, *ids = chat ? model_tokenizer_encode_plain(t, text, &n) : model_tokenizer_encode(t, text, &n);
    free(ids);
    if (n > window)
        fail("flag --%s: %d tokens, more than the %d-token window generation runs in (%s); the model would see only "
             "its last %d tokens; give a shorter prompt%s", chat ? "chat" : "prompt", n, window, window_what,
             window / 2 > 0 ? window / 2 : 1, strstr(window_what, "--seq") ? " or a longer --seq" : "");
}

// Whether id is a token the tokenizer matches whole in text (an added or special token).
static int model_tokenizer_is_special(const ModelTokenizer* t, int id) {
    int n = t->is_hf ? t->hf.n_added : t->bin.n_special;
    const int* list = t->is_hf ? t->hf.added : t->bin.special_ids;
    for (int k = 0; k < n; k++) if (list[k] == id) return 1;
    return 0;
}

// tokenizer_config.json's bos_token / eos_token as a string ("" when absent).
static const char* model_tok_string(const Json* cfg, const char* key) {
    const Json* v = json_get(cfg, key);
    if (v && v->type == JSON_OBJECT) v = json_get(v, "content");
    return v && v->type == JSON_STRING ? v->string : "";
}

// The template's end-of-turn token: what its rendering puts right after an assistant reply (found
// after whatever the template puts before the reply, as Qwen3's empty <think> block), when that is
// a special token (<|im_end|>, <|eot_id|>); generation stops there too.
static void model_tok_add_turn_end(ModelTokenizer* t, const char* tmpl, const char* path, const char* bos,
                                   const char* eos) {
    static const char reply[] = "xyzzy";
    ChatMsg conv[2] = {{"user", "x"}, {"assistant", reply}};
    char* before = chat_template_render(tmpl, path, conv, 1, 1, bos, eos);
    char* after = chat_template_render(tmpl, path, conv, 2, 0, bos, eos);
    size_t n = strlen(before);
    const char* at = strncmp(after, before, n) == 0 ? strstr(after + n, reply) : NULL;
    if (at) {
        const char* rest = at + strlen(reply);
        while (*rest == ' ' || *rest == '\n') rest++;
        int k, *ids = model_tokenizer_encode_plain(t, rest, &k);
        if (k > 0 && model_tokenizer_is_special(t, ids[0])) model_tok_add_end(t, ids[0]);
        free(ids);
    }
    free(before);
    free(after);
}

// --chat: the text --generate starts from, prompt as the user's message (after system's, unless
// NULL) through DIR/tokenizer_config.json's chat_template with add_generation_prompt; adds the
// template's end-of-turn token to the tokens that end generation. A malloc'd string.
static char* model_tokenizer_chat(ModelTokenizer* t, const char* dir, const char* system, const char* prompt) {
    Json cfg;
    char* path;
    if (!model_tok_read_json(dir, "tokenizer_config.json", &cfg, &path))
        fail("flag --chat: %s: no such file; --chat renders the model's chat_template from it", path);
    const Json* tj = json_get(&cfg, "chat_template");
    const char* tmpl = tj && tj->type == JSON_STRING ? tj->string : NULL;
    for (int i = 0; tj && tj->type == JSON_ARRAY && i < tj->count && !tmpl; i++)  // named templates: the default
        if (!strcmp(json_string_or(&tj->items[i], "name", ""), "default"))
            tmpl = json_string_or(&tj->items[i], "template", NULL);
    if (!tmpl) fail("flag --chat: %s has no chat_template (a string, or a list holding one named \"default\")", path);
    char* name = (char*)xmalloc(strlen(path) + 16);
    sprintf(name, "%s: chat_template", path);
    const char *bos = model_tok_string(&cfg, "bos_token"), *eos = model_tok_string(&cfg, "eos_token");
    ChatMsg conv[2] = {{"system", system ? system : ""}, {"user", prompt}};
    char* text = chat_template_render(tmpl, name, system ? conv : conv + 1, system ? 2 : 1, 1, bos, eos);
    model_tok_add_turn_end(t, tmpl, name, bos, eos);
    free(name);
    json_free(&cfg);
    free(path);
    return text;
}

// The bytes of token id after prev (-1 at the start).
static const char* model_tokenizer_decode(const ModelTokenizer* t, int prev, int id, char byte_buf[2]) {
    return t->is_hf ? hf_decode(&t->hf, prev, id) : tokenizer_decode(&t->bin, prev, id, byte_buf);
}

static int model_tokenizer_ends(const ModelTokenizer* t, int id) {
    if (id == t->bos_id) return 1;
    for (int k = 0; k < t->n_end; k++) if (t->end_ids[k] == id) return 1;
    return 0;
}

static void model_tokenizer_free(ModelTokenizer* t) {
    if (t->is_hf) hf_tokenizer_free(&t->hf); else tokenizer_free(&t->bin);
}
