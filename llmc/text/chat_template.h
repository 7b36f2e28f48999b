// chat_template.h: renders a model's chat template (the Jinja text of tokenizer_config.json's
// chat_template) for --chat, in the subset of Jinja that SmolLM2's, Llama-3's, Qwen2.5's and
// Qwen3's templates use, as transformers' apply_chat_template does (trim_blocks, lstrip_blocks, no
// trailing newline). scripts/formats/chat_template.py renders any template with jinja2 itself, for
// prepare_text.py; test/formats/test_chat_template.py checks both against transformers.
//
// The subset: text, {{ expr }}, {% if/elif/else/endif %}, {% for x in expr %}...{% endfor %} (loop.
// index, index0, first, last, length, revindex, revindex0), {% set name = expr %}, {% set
// ns.attr = expr %} of a namespace(name=value, ...), {# comments #}, whitespace control ({%- -%}
// {{- -}}). Expressions: string, integer, true/false/none literals, list literals, names, x.attr,
// x[i] (of a string: a code point), slices x[a:b:step] of lists and strings (code points; any
// part left out, messages[::-1]), + - * // % ~, == != < > <= >=, in, not in, and, or, not, a if c
// else b, `is [not] defined|undefined|none|string|number|true|false`, the filters trim, length,
// count, string, first, last, the string methods strip, lstrip, rstrip (of whitespace or of the
// characters given), split([sep]), startswith, endswith, and raise_exception(msg). Anything else
// fails in one line naming the construct: a template is rendered exactly or not at all.
// Statements outside the subset fail when the template is read; filters, tests and calls outside
// it (with keyword arguments too) are read and fail when reached, so a template that keeps them in
// branches a conversation never takes (the tool calling of Llama-3.1's, Qwen2.5's and Qwen3's
// templates, Llama-3.2's `strftime_now is defined`) renders. A message with role "tool" is refused:
// tool calling is not supported.
#pragma once
#include <ctype.h>
#include <limits.h>
#include "../common.h"

typedef struct { const char* role; const char* content; } ChatMsg;

// ---- values and the arena that owns everything a rendering allocates ---------------------------

typedef enum { CT_UNDEF, CT_NONE, CT_BOOL, CT_INT, CT_STR, CT_LIST, CT_DICT, CT_NS } CtType;

// CT_NS, namespace(): a reference to one CT_DICT (items[0]) that {% set ns.x = ... %} replaces
// in place, so an assignment inside a loop is seen after it, as in Jinja.
typedef struct CtVal {
    CtType type;
    long long i;            // CT_BOOL, CT_INT
    const char* s;          // CT_STR
    struct CtVal* items;    // CT_LIST, CT_DICT values; CT_NS: its dict
    const char** keys;      // CT_DICT
    int n;
} CtVal;

typedef struct { void** p; int n, cap; size_t bytes; } CtArena;

// The renderer's limits, the same in scripts/formats/chat_template.py (docs/formats.md): a template
// is rendered within them or refused in one line, never by a crash, a hang or the OOM killer.
enum {
    CT_MAX_DEPTH = 100,          // nesting: of blocks ({% if %}, {% for %}, each elif), of brackets and unary operators
    CT_MAX_HEIGHT = 1000,        // an expression tree's height (a chain a ~ b ~ c ... is as high as it is long)
    CT_MAX_ITERATIONS = 1000000  // for-loop iterations in one rendering, all loops together
};
#define CT_MAX_ARENA ((size_t)256 << 20)  // bytes one rendering may allocate (strings, lists, the program)

typedef struct {
    const char* name;       // the template's file, for messages
    CtArena* arena;
} CtCtx;

static void* ct_alloc(CtArena* a, size_t size) {
    a->bytes += size;
    if (a->bytes > CT_MAX_ARENA) fail("chat template: the rendering needs more than %d MiB", (int)(CT_MAX_ARENA >> 20));
    if (a->n == a->cap) {
        a->cap = a->cap ? 2 * a->cap : 256;
        a->p = (void**)realloc(a->p, sizeof(void*) * a->cap);
        if (!a->p) fail("out of host memory (chat template)");
    }
    void* x = xcalloc(1, size ? size : 1);
    a->p[a->n++] = x;
    return x;
}

static void ct_arena_free(CtArena* a) {
    for (int i = 0; i < a->n; i++) free(a->p[i]);
    free(a->p);
    memset(a, 0, sizeof(*a));
}

static char* ct_strndup(CtArena* a, const char* s, size_t n) {
    char* d = (char*)ct_alloc(a, n + 1);
    memcpy(d, s, n);
    d[n] = 0;
    return d;
}

// No string or rendering grows past this: a template of doubling concatenations would otherwise
// exhaust memory in a few dozen statements.
enum { CT_MAX_TEXT = 64 << 20 };

static CtVal ct_str(CtArena* a, const char* s, size_t n) {
    if (n > CT_MAX_TEXT) fail("chat template: a string grows past %d MiB", CT_MAX_TEXT >> 20);
    CtVal v = {};
    v.type = CT_STR;
    v.s = ct_strndup(a, s, n);
    return v;
}
static CtVal ct_int(long long i) { CtVal v = {}; v.type = CT_INT; v.i = i; return v; }
static CtVal ct_bool(int b) { CtVal v = {}; v.type = CT_BOOL; v.i = b != 0; return v; }

static const char* ct_type_name(CtType t) {
    static const char* names[] = {"Undefined", "NoneType", "bool", "int", "str", "list", "dict", "Namespace"};
    return names[t];
}

// A growing byte string.
typedef struct { char* s; size_t n, cap; } CtBuf;

static void ct_buf_add(CtBuf* b, const char* s, size_t n) {
    if (b->n + n > CT_MAX_TEXT) fail("chat template: the rendering grows past %d MiB", CT_MAX_TEXT >> 20);
    if (b->n + n + 1 > b->cap) {
        b->cap = (b->n + n + 1) * 2;
        b->s = (char*)realloc(b->s, b->cap);
        if (!b->s) fail("out of host memory (chat template)");
    }
    memcpy(b->s + b->n, s, n);
    b->n += n;
    b->s[b->n] = 0;
}

// ---- lexing: the template into text and tags, with Jinja's whitespace rules --------------------

enum { TK_STR, TK_INT, TK_NAME, TK_OP };
typedef struct { int kind; const char* s; long long i; } CtTok;

enum { PART_TEXT, PART_OUT, PART_STMT };
typedef struct { int kind; const char* text; CtTok* toks; int n; } CtPart;

typedef struct { CtPart* p; int n, cap; } CtParts;

static CtPart* ct_part_push(CtParts* ps) {
    if (ps->n == ps->cap) {
        ps->cap = ps->cap ? 2 * ps->cap : 64;
        ps->p = (CtPart*)realloc(ps->p, sizeof(CtPart) * ps->cap);
        if (!ps->p) fail("out of host memory (chat template)");
    }
    memset(&ps->p[ps->n], 0, sizeof(CtPart));
    return &ps->p[ps->n++];
}

static int ct_is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

static const char* const CT_OPS[] = {"//", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<", ">", "|", ".",
                                     ",", ":", "(", ")", "[", "]", "="};

static void ct_tok_push(const CtCtx* c, CtPart* part, int* cap, CtTok t) {
    if (part->n == *cap) {
        *cap = *cap ? 2 * *cap : 16;
        CtTok* grown = (CtTok*)ct_alloc(c->arena, sizeof(CtTok) * *cap);
        if (part->n) memcpy(grown, part->toks, sizeof(CtTok) * part->n);
        part->toks = grown;
    }
    part->toks[part->n++] = t;
}

static void ct_put_utf8(char* out, size_t* n, unsigned cp) {
    if (cp < 0x80) out[(*n)++] = (char)cp;
    else if (cp < 0x800) { out[(*n)++] = (char)(0xC0 | cp >> 6); out[(*n)++] = (char)(0x80 | (cp & 0x3F)); }
    else { out[(*n)++] = (char)(0xE0 | cp >> 12); out[(*n)++] = (char)(0x80 | (cp >> 6 & 0x3F)); out[(*n)++] = (char)(0x80 | (cp & 0x3F)); }
}

// A quoted string at src[i] (its quote); returns the position after the closing quote.
static size_t ct_lex_string(const CtCtx* c, const char* src, size_t len, size_t i, CtTok* t) {
    char q = src[i++];
    char* out = (char*)ct_alloc(c->arena, len - i + 1);
    size_t n = 0;
    while (i < len && src[i] != q) {
        if (src[i] != '\\') { out[n++] = src[i++]; continue; }
        char e = i + 1 < len ? src[i + 1] : 0;
        unsigned cp = 0;
        if (e == 'u' && i + 6 <= len) {
            for (int k = 2; k < 6; k++) {
                char h = src[i + k];
                if (!isxdigit((unsigned char)h)) fail("%s: bad \\u escape at offset %zu", c->name, i);
                cp = cp * 16 + (unsigned)(isdigit((unsigned char)h) ? h - '0' : (tolower((unsigned char)h) - 'a' + 10));
            }
            if (cp >= 0xD800 && cp < 0xE000) fail("%s: unsupported construct: surrogate \\u escape at offset %zu", c->name, i);
            ct_put_utf8(out, &n, cp);
            i += 6;
            continue;
        }
        const char* from = "ntr\\'\"0";
        const char* to = "\n\t\r\\'\"";
        const char* at = e ? strchr(from, e) : NULL;
        if (!at) fail("%s: unsupported escape \\%c in a string at offset %zu", c->name, e ? e : ' ', i);
        out[n++] = at - from == 6 ? 0 : to[at - from];
        i += 2;
    }
    if (i >= len) fail("%s: unterminated string at end of template", c->name);
    out[n] = 0;
    t->kind = TK_STR;
    t->s = out;
    return i + 1;
}

// The tokens of one tag from src[i] to its closer ("}}" or "%}"); returns the position after the
// closer and sets *mod to its '-', '+' or 0.
static size_t ct_lex_tag(const CtCtx* c, const char* src, size_t len, size_t i, char closer, CtPart* part, char* mod) {
    int cap = 0;
    for (;;) {
        while (i < len && ct_is_ws(src[i])) i++;
        if (i >= len) fail("%s: unterminated tag at end of template", c->name);
        for (int m = 0; m < 3; m++) {
            const char* pre = m == 0 ? "-" : m == 1 ? "+" : "";
            size_t pl = strlen(pre);
            if (i + pl + 2 <= len && strncmp(src + i, pre, pl) == 0 && src[i + pl] == closer && src[i + pl + 1] == '}') {
                *mod = pl ? pre[0] : 0;
                return i + pl + 2;
            }
        }
        CtTok t = {};
        char ch = src[i];
        if (ch == '\'' || ch == '"') {
            i = ct_lex_string(c, src, len, i, &t);
        } else if (isdigit((unsigned char)ch)) {
            size_t j = i;
            long long v = 0;
            while (j < len && isdigit((unsigned char)src[j])) {
                if (v > (LLONG_MAX - 9) / 10) fail("%s: integer too large at offset %zu", c->name, i);
                v = v * 10 + (src[j++] - '0');
            }
            if (j + 1 < len && src[j] == '.' && isdigit((unsigned char)src[j + 1]))
                fail("%s: unsupported construct: floating-point number at offset %zu", c->name, i);
            t.kind = TK_INT;
            t.i = v;
            i = j;
        } else if (isalpha((unsigned char)ch) || ch == '_') {
            size_t j = i;
            while (j < len && (isalnum((unsigned char)src[j]) || src[j] == '_')) j++;
            t.kind = TK_NAME;
            t.s = ct_strndup(c->arena, src + i, j - i);
            i = j;
        } else {
            const char* op = NULL;
            for (size_t k = 0; k < sizeof(CT_OPS) / sizeof(CT_OPS[0]) && !op; k++)
                if (strncmp(src + i, CT_OPS[k], strlen(CT_OPS[k])) == 0) op = CT_OPS[k];
            if (!op) fail("%s: unsupported construct: character '%c' at offset %zu", c->name, ch, i);
            t.kind = TK_OP;
            t.s = op;
            i += strlen(op);
        }
        ct_tok_push(c, part, &cap, t);
    }
}

static size_t ct_find(const char* s, size_t len, size_t from, const char* what) {
    for (size_t i = from; i + strlen(what) <= len; i++) if (strncmp(s + i, what, strlen(what)) == 0) return i;
    return (size_t)-1;
}

// The template as text and tag parts. Whitespace: "-" inside a tag strips all whitespace on that
// side; otherwise the first newline after a block or comment tag goes (trim_blocks) and spaces
// and tabs from the start of a line up to a block or comment tag go (lstrip_blocks).
static CtParts ct_lex(const CtCtx* c, const char* template_text) {
    size_t len = strlen(template_text);
    char* src = (char*)ct_alloc(c->arena, len + 1);
    size_t m = 0;
    for (size_t i = 0; i < len; i++) if (!(template_text[i] == '\r' && template_text[i + 1] == '\n')) src[m++] = template_text[i];
    len = m;
    if (len && src[len - 1] == '\n') len--;  // keep_trailing_newline=False
    CtParts ps = {};
    size_t pos = 0;
    int trim_next = 0;  // 1: all whitespace, 2: one newline
    for (;;) {
        size_t at = len;
        for (size_t i = pos; i + 1 < len; i++)
            if (src[i] == '{' && (src[i + 1] == '{' || src[i + 1] == '%' || src[i + 1] == '#')) { at = i; break; }
        size_t t0 = pos, t1 = at;
        if (trim_next == 1) while (t0 < t1 && ct_is_ws(src[t0])) t0++;
        if (trim_next == 2 && t0 < t1 && src[t0] == '\n') t0++;
        CtPart* text = ct_part_push(&ps);
        text->kind = PART_TEXT;
        if (at == len) { text->text = ct_strndup(c->arena, src + t0, t1 - t0); break; }
        char kind = src[at + 1];
        size_t j = at + 2;
        char mod = j < len && (src[j] == '-' || src[j] == '+') ? src[j++] : 0;
        if (mod == '-') {
            while (t1 > t0 && ct_is_ws(src[t1 - 1])) t1--;
        } else if (kind != '{' && mod != '+') {
            size_t ls = t1;
            while (ls > t0 && (src[ls - 1] == ' ' || src[ls - 1] == '\t')) ls--;
            if (ls < t1 && (ls == t0 ? t0 == 0 || src[t0 - 1] == '\n' : src[ls - 1] == '\n')) t1 = ls;  // alone on its line
        }
        text->text = ct_strndup(c->arena, src + t0, t1 - t0);
        char close_mod = 0;
        if (kind == '#') {
            size_t end = ct_find(src, len, j, "#}");
            if (end == (size_t)-1) fail("%s: unterminated comment at offset %zu", c->name, at);
            close_mod = end > j && (src[end - 1] == '-' || src[end - 1] == '+') ? src[end - 1] : 0;
            pos = end + 2;
        } else {
            CtPart* tag = ct_part_push(&ps);
            tag->kind = kind == '{' ? PART_OUT : PART_STMT;
            pos = ct_lex_tag(c, src, len, j, kind == '{' ? '}' : '%', tag, &close_mod);
        }
        trim_next = close_mod == '-' ? 1 : kind != '{' && close_mod != '+' ? 2 : 0;
    }
    return ps;
}

// ---- parsing: tags into a tree ------------------------------------------------------------------

enum { E_LIT, E_VAR, E_LIST, E_ITEM, E_SLICE, E_OR, E_AND, E_NOT, E_COND, E_BIN, E_FILTER, E_TEST, E_CALL };

typedef struct CtExpr {
    int kind;
    const char* op;          // E_VAR name, E_BIN operator, E_FILTER/E_TEST name
    CtVal lit;               // E_LIT
    struct CtExpr *a, *b, *c, *d;  // E_SLICE: a[b:c:d], each of b, c, d optional (NULL)
    struct CtExpr** args;    // E_LIST items; E_CALL (a: the function), E_FILTER, E_TEST arguments
    const char** kws;        // each argument's keyword, NULL for a positional one
    int nargs;
    int paren;               // E_FILTER, E_TEST: written with (arguments)
    int nkw;                 // how many of the arguments were keyword arguments
    int height;              // of the tree below: 1 for a leaf (evaluation recurses this deep)
} CtExpr;

enum { S_TEXT, S_OUT, S_IF, S_FOR, S_SET };

typedef struct CtStmt {
    int kind;
    const char* text;        // S_TEXT
    const char* var;         // S_FOR (the first of nvars), S_SET
    const char* attr;        // S_SET of a namespace's attribute: {% set var.attr = e %}
    int nvars;
    CtExpr* e;               // S_OUT, S_SET value, S_FOR sequence, S_IF condition (NULL: else)
    struct CtStmt* body;     // S_IF, S_FOR
    struct CtStmt* orelse;   // S_IF: the next elif/else branch
    struct CtStmt* next;
} CtStmt;

typedef struct { const CtCtx* c; const CtTok* t; int n, i, depth; } CtParser;

static const CtTok* ct_peek(const CtParser* p, int kind, const char* s, int k) {
    if (p->i + k >= p->n) return NULL;
    const CtTok* t = &p->t[p->i + k];
    if (t->kind != kind || (s && strcmp(t->s, s) != 0)) return NULL;
    return t;
}

static const CtTok* ct_take(CtParser* p, int kind, const char* s) {
    const CtTok* t = ct_peek(p, kind, s, 0);
    if (t) p->i++;
    return t;
}

static const char* ct_tok_text(const CtParser* p) {
    if (p->i >= p->n) return "end of tag";
    const CtTok* t = &p->t[p->i];
    return t->kind == TK_STR ? "a string" : t->kind == TK_INT ? "an integer" : t->s;
}

static const CtTok* ct_need(CtParser* p, int kind, const char* s) {
    const CtTok* t = ct_take(p, kind, s);
    if (!t) fail("%s: expected %s, got '%s'", p->c->name, s ? s : kind == TK_NAME ? "a name" : "a token", ct_tok_text(p));
    return t;
}

static void ct_done(const CtParser* p) {
    if (p->i < p->n) fail("%s: unsupported construct: unexpected '%s'", p->c->name, ct_tok_text(p));
}

// Makes `child` a child of e as far as e's height goes.
static void ct_grow(const CtParser* p, CtExpr* e, const CtExpr* child) {
    if (!child || child->height < e->height) return;
    e->height = child->height + 1;
    if (e->height > CT_MAX_HEIGHT) fail("%s: an expression more than %d operations deep", p->c->name, CT_MAX_HEIGHT);
}

static CtExpr* ct_node(const CtParser* p, int kind, CtExpr* a, CtExpr* b) {
    CtExpr* e = (CtExpr*)ct_alloc(p->c->arena, sizeof(CtExpr));
    e->kind = kind;
    e->a = a;
    e->b = b;
    e->height = 1;
    ct_grow(p, e, a);
    ct_grow(p, e, b);
    return e;
}

// Entering one more level of nested syntax (brackets, unary operators); ct_leave on the way out.
static void ct_enter(CtParser* p) {
    if (++p->depth > CT_MAX_DEPTH) fail("%s: expressions nested more than %d deep", p->c->name, CT_MAX_DEPTH);
}
static void ct_leave(CtParser* p) { p->depth--; }

static CtExpr* ct_bin(const CtParser* p, const char* op, CtExpr* a, CtExpr* b) {
    CtExpr* e = ct_node(p, E_BIN, a, b);
    e->op = op;
    return e;
}

static CtExpr* ct_expr(CtParser* p);

static void ct_push_arg(CtParser* p, CtExpr* e, CtExpr* x, const char* kw) {
    CtExpr** grown = (CtExpr**)ct_alloc(p->c->arena, sizeof(CtExpr*) * (e->nargs + 1));
    const char** kws = (const char**)ct_alloc(p->c->arena, sizeof(char*) * (e->nargs + 1));
    if (e->nargs) memcpy(grown, e->args, sizeof(CtExpr*) * e->nargs);
    if (e->nargs) memcpy(kws, e->kws, sizeof(char*) * e->nargs);
    grown[e->nargs] = x;
    kws[e->nargs++] = kw;
    ct_grow(p, e, x);
    e->args = grown;
    e->kws = kws;
}

// Comma-separated expressions up to the closing token (the opening one taken). Keyword arguments
// are read (and counted): namespace() takes them; elsewhere a template may hold them in branches
// it never renders.
static void ct_parse_list(CtParser* p, CtExpr* e, const char* close) {
    while (!ct_take(p, TK_OP, close)) {
        const char* kw = NULL;
        if (ct_peek(p, TK_NAME, NULL, 0) && ct_peek(p, TK_OP, "=", 1)) { kw = p->t[p->i].s; p->i += 2; e->nkw++; }
        ct_push_arg(p, e, ct_expr(p), kw);
        if (!ct_take(p, TK_OP, ",")) { ct_need(p, TK_OP, close); break; }
    }
}

static CtExpr* ct_primary(CtParser* p) {
    if (p->i >= p->n) fail("%s: expected an expression, got end of tag", p->c->name);
    const CtTok* t = &p->t[p->i++];
    CtExpr* e = ct_node(p, E_LIT, NULL, NULL);
    if (t->kind == TK_INT) { e->lit = ct_int(t->i); return e; }
    if (t->kind == TK_STR) {  // adjacent literals join, as in Jinja
        CtBuf b = {};
        ct_buf_add(&b, t->s, strlen(t->s));
        while (ct_peek(p, TK_STR, NULL, 0)) { const char* s = p->t[p->i++].s; ct_buf_add(&b, s, strlen(s)); }
        e->lit = ct_str(p->c->arena, b.s ? b.s : "", b.n);
        free(b.s);
        return e;
    }
    if (t->kind == TK_NAME) {
        const char* s = t->s;
        if (!strcmp(s, "true") || !strcmp(s, "True")) e->lit = ct_bool(1);
        else if (!strcmp(s, "false") || !strcmp(s, "False")) e->lit = ct_bool(0);
        else if (!strcmp(s, "none") || !strcmp(s, "None")) e->lit.type = CT_NONE;
        else { e->kind = E_VAR; e->op = s; }
        return e;
    }
    if (!strcmp(t->s, "(")) {
        e = ct_expr(p);
        ct_need(p, TK_OP, ")");
        return e;
    }
    if (!strcmp(t->s, "[")) {
        e->kind = E_LIST;
        ct_parse_list(p, e, "]");
        return e;
    }
    fail("%s: unsupported construct: '%s' in an expression", p->c->name, t->s);
    return NULL;  // not reached: fail() exits
}

static int ct_is_one_of(const char* s, const char* const* list) {
    for (; *list; list++) if (!strcmp(s, *list)) return 1;
    return 0;
}

static const char* const CT_FILTERS[] = {"trim", "length", "count", "string", "first", "last", NULL};
static const char* const CT_TESTS[] = {"defined", "undefined", "none", "string", "number", "true", "false", NULL};
static const char* const CT_METHODS[] = {"strip", "lstrip", "rstrip", "startswith", "endswith", "split", NULL};

// fn(args): any call is read; raise_exception(msg), namespace(...) and the string methods
// render, others fail when rendered (a template may guard one with `is defined`, as Llama-3.2's strftime_now).
static CtExpr* ct_call(CtParser* p, CtExpr* fn) {
    CtExpr* call = ct_node(p, E_CALL, fn, NULL);
    ct_parse_list(p, call, ")");
    return call;
}

// obj[i], or a slice obj[start:stop:step] with any of the three left out (the "[" taken).
static CtExpr* ct_subscript(CtParser* p, CtExpr* obj) {
    CtExpr* lo = ct_peek(p, TK_OP, ":", 0) ? NULL : ct_expr(p);
    if (!ct_take(p, TK_OP, ":")) {
        ct_need(p, TK_OP, "]");
        return ct_node(p, E_ITEM, obj, lo);
    }
    CtExpr* e = ct_node(p, E_SLICE, obj, lo);
    if (!ct_peek(p, TK_OP, ":", 0) && !ct_peek(p, TK_OP, "]", 0)) e->c = ct_expr(p);
    if (ct_take(p, TK_OP, ":") && !ct_peek(p, TK_OP, "]", 0)) e->d = ct_expr(p);
    ct_grow(p, e, e->c);
    ct_grow(p, e, e->d);
    ct_need(p, TK_OP, "]");
    return e;
}

static CtExpr* ct_postfix(CtParser* p, CtExpr* e) {
    for (;;) {
        if (ct_take(p, TK_OP, ".")) {
            CtExpr* key = ct_node(p, E_LIT, NULL, NULL);
            const char* name = ct_need(p, TK_NAME, NULL)->s;
            key->lit = ct_str(p->c->arena, name, strlen(name));
            e = ct_node(p, E_ITEM, e, key);
        } else if (ct_take(p, TK_OP, "[")) {
            e = ct_subscript(p, e);
        } else if (ct_take(p, TK_OP, "(")) {
            e = ct_call(p, e);
        } else {
            return e;
        }
    }
}

// x | filter and x is [not] test: tighter than any binary operator, as in Jinja.
static CtExpr* ct_filters(CtParser* p, CtExpr* e) {
    for (;;) {
        if (ct_take(p, TK_OP, "|")) {  // any filter is read; one outside the subset fails when rendered
            const char* f = ct_need(p, TK_NAME, NULL)->s;
            e = ct_node(p, E_FILTER, e, NULL);
            e->op = f;
            if ((e->paren = ct_take(p, TK_OP, "(") != NULL)) ct_parse_list(p, e, ")");
        } else if (ct_take(p, TK_NAME, "is")) {
            int neg = ct_take(p, TK_NAME, "not") != NULL;
            const char* t = ct_need(p, TK_NAME, NULL)->s;
            e = ct_node(p, E_TEST, e, NULL);
            e->op = t;
            if ((e->paren = ct_take(p, TK_OP, "(") != NULL)) ct_parse_list(p, e, ")");
            if (neg) e = ct_node(p, E_NOT, e, NULL);
        } else {
            return e;
        }
    }
}

static CtExpr* ct_unary(CtParser* p) {
    if (ct_take(p, TK_OP, "-")) {
        CtExpr* zero = ct_node(p, E_LIT, NULL, NULL);
        zero->lit = ct_int(0);
        ct_enter(p);
        CtExpr* e = ct_bin(p, "-", zero, ct_unary(p));
        ct_leave(p);
        return e;
    }
    return ct_filters(p, ct_postfix(p, ct_primary(p)));
}

static const char* ct_take_op(CtParser* p, const char* const* ops) {
    for (; *ops; ops++) if (ct_take(p, TK_OP, *ops)) return *ops;
    return NULL;
}

// Jinja's precedence, loosest first: a if c else b, or, and, not, comparisons, + -, ~, * // %.
static CtExpr* ct_mul(CtParser* p) {
    static const char* const ops[] = {"*", "//", "/", "%", NULL};
    CtExpr* e = ct_unary(p);
    for (const char* op; (op = ct_take_op(p, ops)) != NULL;) e = ct_bin(p, op, e, ct_unary(p));
    return e;
}

static CtExpr* ct_concat(CtParser* p) {
    CtExpr* e = ct_mul(p);
    while (ct_take(p, TK_OP, "~")) e = ct_bin(p, "~", e, ct_mul(p));
    return e;
}

static CtExpr* ct_add(CtParser* p) {
    static const char* const ops[] = {"+", "-", NULL};
    CtExpr* e = ct_concat(p);
    for (const char* op; (op = ct_take_op(p, ops)) != NULL;) e = ct_bin(p, op, e, ct_concat(p));
    return e;
}

static CtExpr* ct_compare(CtParser* p) {
    static const char* const ops[] = {"==", "!=", "<=", ">=", "<", ">", NULL};
    CtExpr* e = ct_add(p);
    for (;;) {
        const char* op = ct_take_op(p, ops);
        if (op) e = ct_bin(p, op, e, ct_add(p));
        else if (ct_take(p, TK_NAME, "in")) e = ct_bin(p, "in", e, ct_add(p));
        else if (ct_peek(p, TK_NAME, "not", 0) && ct_peek(p, TK_NAME, "in", 1)) { p->i += 2; e = ct_node(p, E_NOT, ct_bin(p, "in", e, ct_add(p)), NULL); }
        else return e;
    }
}

static CtExpr* ct_not(CtParser* p) {
    if (ct_take(p, TK_NAME, "not")) {
        ct_enter(p);
        CtExpr* e = ct_node(p, E_NOT, ct_not(p), NULL);
        ct_leave(p);
        return e;
    }
    return ct_compare(p);
}

static CtExpr* ct_and(CtParser* p) {
    CtExpr* e = ct_not(p);
    while (ct_take(p, TK_NAME, "and")) e = ct_node(p, E_AND, e, ct_not(p));
    return e;
}

static CtExpr* ct_or(CtParser* p) {
    CtExpr* e = ct_and(p);
    while (ct_take(p, TK_NAME, "or")) e = ct_node(p, E_OR, e, ct_and(p));
    return e;
}

static CtExpr* ct_expr(CtParser* p) {
    ct_enter(p);
    CtExpr* e = ct_or(p);
    if (ct_take(p, TK_NAME, "if")) {
        CtExpr* cond = ct_or(p);
        CtExpr* other = NULL;
        if (ct_take(p, TK_NAME, "else")) other = ct_expr(p);
        else { other = ct_node(p, E_LIT, NULL, NULL); other->lit.type = CT_UNDEF; }
        e = ct_node(p, E_COND, cond, e);
        e->c = other;
        ct_grow(p, e, other);
    }
    ct_leave(p);
    return e;
}

// One tag's expression, all of its tokens from the k-th.
static CtExpr* ct_tag_expr(const CtCtx* c, const CtPart* part, int k, CtParser* rest) {
    CtParser p = {c, part->toks, part->n, k, 0};
    CtExpr* e = ct_expr(&p);
    if (rest) *rest = p; else ct_done(&p);
    return e;
}

typedef struct { const CtCtx* c; const CtParts* ps; int i, depth; } CtBody;

static CtStmt* ct_stmt_new(const CtCtx* c, int kind) {
    CtStmt* s = (CtStmt*)ct_alloc(c->arena, sizeof(CtStmt));
    s->kind = kind;
    return s;
}

// Statements until a tag whose keyword is one of ends (NULL-terminated; none: the template's
// end); *end gets that tag.
static CtStmt* ct_parse_body(CtBody* b, const char* const* ends, const CtPart** end);

// One more level of nested blocks (an if, a for, each elif of a chain); ct_unnest on the way out.
static void ct_nest(CtBody* b) {
    if (++b->depth > CT_MAX_DEPTH) fail("%s: blocks nested more than %d deep (each elif counts)", b->c->name, CT_MAX_DEPTH);
}
static void ct_unnest(CtBody* b) { b->depth--; }

static CtStmt* ct_parse_if(CtBody* b, const CtPart* tag) {
    static const char* const ends[] = {"endif", "elif", "else", NULL};  // the closer first: it names what is missing
    ct_nest(b);
    CtStmt* s = ct_stmt_new(b->c, S_IF);
    s->e = ct_tag_expr(b->c, tag, 1, NULL);
    const CtPart* end;
    s->body = ct_parse_body(b, ends, &end);
    const char* kw = end->toks[0].s;
    if (!strcmp(kw, "elif")) s->orelse = ct_parse_if(b, end);
    else if (!strcmp(kw, "else")) {
        if (end->n != 1) fail("%s: unsupported construct: unexpected '%s' after else", b->c->name, end->toks[1].s);
        static const char* const endif[] = {"endif", NULL};
        s->orelse = ct_stmt_new(b->c, S_IF);
        s->orelse->body = ct_parse_body(b, endif, &end);
    }
    ct_unnest(b);
    return s;
}

static CtStmt* ct_parse_stmt(CtBody* b, const CtPart* tag) {
    const char* kw = tag->toks[0].s;
    CtParser p = {b->c, tag->toks, tag->n, 1, 0};
    if (!strcmp(kw, "if")) return ct_parse_if(b, tag);
    if (!strcmp(kw, "for")) {
        CtStmt* s = ct_stmt_new(b->c, S_FOR);
        s->var = ct_need(&p, TK_NAME, NULL)->s;
        for (s->nvars = 1; ct_take(&p, TK_OP, ","); s->nvars++) ct_need(&p, TK_NAME, NULL);  // read; refused when rendered
        ct_need(&p, TK_NAME, "in");
        s->e = ct_tag_expr(b->c, tag, p.i, NULL);
        static const char* const ends[] = {"endfor", "else", NULL};
        const CtPart* end;
        ct_nest(b);
        s->body = ct_parse_body(b, ends, &end);
        ct_unnest(b);
        if (strcmp(end->toks[0].s, "endfor") != 0) fail("%s: unsupported construct: for ... else", b->c->name);
        return s;
    }
    if (!strcmp(kw, "set")) {
        CtStmt* s = ct_stmt_new(b->c, S_SET);
        s->var = ct_need(&p, TK_NAME, NULL)->s;
        if (ct_take(&p, TK_OP, ".")) s->attr = ct_need(&p, TK_NAME, NULL)->s;
        if (!ct_take(&p, TK_OP, "="))
            fail("%s: unsupported construct: set of %s without = (block set or several targets)", b->c->name, s->var);
        s->e = ct_tag_expr(b->c, tag, p.i, NULL);
        return s;
    }
    fail("%s: unsupported construct: {%% %s %%}", b->c->name, kw);
    return NULL;  // not reached
}

static CtStmt* ct_parse_body(CtBody* b, const char* const* ends, const CtPart** end) {
    CtStmt head = {}, *tail = &head;
    while (b->i < b->ps->n) {
        const CtPart* part = &b->ps->p[b->i++];
        CtStmt* s = NULL;
        if (part->kind == PART_TEXT) {
            if (!*part->text) continue;
            s = ct_stmt_new(b->c, S_TEXT);
            s->text = part->text;
        } else if (part->kind == PART_OUT) {
            s = ct_stmt_new(b->c, S_OUT);
            s->e = ct_tag_expr(b->c, part, 0, NULL);
        } else {
            if (!part->n || part->toks[0].kind != TK_NAME) fail("%s: empty or malformed {%% %%} tag", b->c->name);
            if (ends && ct_is_one_of(part->toks[0].s, ends)) { *end = part; return head.next; }
            s = ct_parse_stmt(b, part);
        }
        tail->next = s;
        tail = s;
    }
    if (ends) fail("%s: missing {%% %s %%} at end of template", b->c->name, ends[0]);
    return head.next;
}

// ---- evaluation -------------------------------------------------------------------------------

// Variables: a stack of scopes (the globals, then one per for-loop iteration, as Jinja scopes a
// loop body's set).
typedef struct { const char** names; CtVal* vals; int n, cap; } CtScope;
typedef struct { const CtCtx* c; CtScope* scopes; int depth; CtBuf out; long long iterations; } CtRun;

static void ct_scope_set(CtScope* s, const char* name, CtVal v) {
    for (int i = 0; i < s->n; i++) if (!strcmp(s->names[i], name)) { s->vals[i] = v; return; }
    if (s->n == s->cap) {
        s->cap = s->cap ? 2 * s->cap : 8;
        s->names = (const char**)realloc(s->names, sizeof(char*) * s->cap);
        s->vals = (CtVal*)realloc(s->vals, sizeof(CtVal) * s->cap);
        if (!s->names || !s->vals) fail("out of host memory (chat template)");
    }
    s->names[s->n] = name;
    s->vals[s->n++] = v;
}

static CtVal ct_lookup(const CtRun* r, const char* name) {
    for (int d = r->depth - 1; d >= 0; d--)
        for (int i = 0; i < r->scopes[d].n; i++)
            if (!strcmp(r->scopes[d].names[i], name)) return r->scopes[d].vals[i];
    CtVal u = {};
    return u;
}

static int ct_truthy(CtVal v) {
    switch (v.type) {
        case CT_UNDEF: case CT_NONE: return 0;
        case CT_BOOL: case CT_INT: return v.i != 0;
        case CT_STR: return v.s[0] != 0;
        case CT_NS: return 1;
        default: return v.n != 0;
    }
}

// A value as {{ }} prints it (Python's str()); lists and dicts are outside the subset.
static const char* ct_text(const CtRun* r, CtVal v) {
    switch (v.type) {
        case CT_UNDEF: return "";
        case CT_NONE: return "None";
        case CT_BOOL: return v.i ? "True" : "False";
        case CT_STR: return v.s;
        case CT_INT: {
            char buf[32];
            snprintf(buf, sizeof(buf), "%lld", v.i);
            return ct_strndup(r->c->arena, buf, strlen(buf));
        }
        default: fail("%s: unsupported construct: printing a %s", r->c->name, ct_type_name(v.type));
    }
    return "";  // not reached
}

static int ct_equal(CtVal a, CtVal b) {
    int an = a.type == CT_INT || a.type == CT_BOOL, bn = b.type == CT_INT || b.type == CT_BOOL;
    if (an && bn) return a.i == b.i;  // Python: True == 1
    if (a.type != b.type) return 0;
    if (a.type == CT_STR) return !strcmp(a.s, b.s);
    if (a.type == CT_NS) return a.items == b.items;  // the same namespace() object
    if (a.type == CT_LIST || a.type == CT_DICT) {
        if (a.n != b.n) return 0;
        for (int i = 0; i < a.n; i++)
            if ((a.type == CT_DICT && strcmp(a.keys[i], b.keys[i]) != 0) || !ct_equal(a.items[i], b.items[i])) return 0;
    }
    return 1;  // undefined, none, or equal containers
}

static CtVal ct_join(CtArena* ar, const char* x, const char* y) {
    size_t nx = strlen(x), ny = strlen(y);
    CtVal v = ct_str(ar, "", 0);
    if (nx + ny > CT_MAX_TEXT) fail("chat template: a string grows past %d MiB", CT_MAX_TEXT >> 20);
    char* d = (char*)ct_alloc(ar, nx + ny + 1);
    memcpy(d, x, nx);
    memcpy(d + nx, y, ny + 1);
    v.s = d;
    return v;
}

static long long ct_floordiv(long long a, long long b) { long long q = a / b; return (a % b != 0 && (a < 0) != (b < 0)) ? q - 1 : q; }

static CtVal ct_binop(CtRun* r, const char* op, CtVal a, CtVal b) {
    CtArena* ar = r->c->arena;
    if (!strcmp(op, "~")) return ct_join(ar, ct_text(r, a), ct_text(r, b));
    if (!strcmp(op, "==")) return ct_bool(ct_equal(a, b));
    if (!strcmp(op, "!=")) return ct_bool(!ct_equal(a, b));
    if (!strcmp(op, "in")) {
        if (b.type == CT_STR && a.type == CT_STR) return ct_bool(strstr(b.s, a.s) != NULL);
        if (b.type == CT_LIST) { for (int i = 0; i < b.n; i++) if (ct_equal(a, b.items[i])) return ct_bool(1); return ct_bool(0); }
        if (b.type == CT_DICT && a.type == CT_STR) { for (int i = 0; i < b.n; i++) if (!strcmp(a.s, b.keys[i])) return ct_bool(1); return ct_bool(0); }
        fail("%s: 'in' needs a string, list or mapping on its right", r->c->name);
    }
    int ints = a.type == CT_INT && b.type == CT_INT, strs = a.type == CT_STR && b.type == CT_STR;
    if (!strcmp(op, "+") && strs) return ct_join(ar, a.s, b.s);
    int cmp = ints ? (a.i > b.i) - (a.i < b.i) : strs ? strcmp(a.s, b.s) : 0;
    if ((ints || strs) && op[0] == '<') return ct_bool(op[1] ? cmp <= 0 : cmp < 0);
    if ((ints || strs) && op[0] == '>') return ct_bool(op[1] ? cmp >= 0 : cmp > 0);
    if (ints && strcmp(op, "/") != 0) {
        if ((op[0] == '%' || op[0] == '/') && b.i == 0) fail("%s: division by zero", r->c->name);
        long long v = 0;
        int over = 0;
        switch (op[0]) {
            case '+': over = __builtin_add_overflow(a.i, b.i, &v); break;
            case '-': over = __builtin_sub_overflow(a.i, b.i, &v); break;
            case '*': over = __builtin_mul_overflow(a.i, b.i, &v); break;
            case '%': v = b.i == -1 ? 0 : a.i - b.i * ct_floordiv(a.i, b.i); break;  // x % -1 is 0, even for the minimum
            case '/': over = b.i == -1 && a.i == LLONG_MIN; if (!over) v = ct_floordiv(a.i, b.i); break;
        }
        // Jinja's integers are Python's, of any size; a 64-bit result that wrapped would differ
        if (over) fail("%s: integer %lld %s %lld overflows 64 bits", r->c->name, a.i, op, b.i);
        return ct_int(v);
    }
    fail("%s: unsupported operation '%s' between %s and %s", r->c->name, op, ct_type_name(a.type), ct_type_name(b.type));
    return a;  // not reached
}

// The byte offset of each code point of s (a byte that is not a UTF-8 continuation starts one, as
// |length counts), and strlen(s) after the last: *n code points, *n + 1 offsets.
static size_t* ct_cp_offsets(const CtRun* r, const char* s, long long* n) {
    size_t len = strlen(s);
    size_t* at = (size_t*)ct_alloc(r->c->arena, sizeof(size_t) * (len + 1));
    *n = 0;
    for (size_t i = 0; i < len; i++) if (((unsigned char)s[i] & 0xC0) != 0x80) at[(*n)++] = i;
    at[*n] = len;
    return at;
}

// A dict's value for key set in place (the arrays grow by copying into the arena).
static void ct_dict_set(CtArena* a, CtVal* d, const char* key, CtVal v) {
    for (int i = 0; i < d->n; i++) if (!strcmp(d->keys[i], key)) { d->items[i] = v; return; }
    const char** keys = (const char**)ct_alloc(a, sizeof(char*) * (d->n + 1));
    CtVal* items = (CtVal*)ct_alloc(a, sizeof(CtVal) * (d->n + 1));
    if (d->n) memcpy(keys, d->keys, sizeof(char*) * d->n);
    if (d->n) memcpy(items, d->items, sizeof(CtVal) * d->n);
    keys[d->n] = key;
    items[d->n++] = v;
    d->keys = keys;
    d->items = items;
}

// obj[key]: a dict's or namespace's value, a list's item, a string's code point (Python's
// indices, negative ones from the end); anything else is undefined, as in Jinja.
static CtVal ct_item(const CtRun* r, CtVal obj, CtVal key) {
    CtVal u = {};
    if (obj.type == CT_NS) return ct_item(r, obj.items[0], key);
    if (obj.type == CT_DICT && key.type == CT_STR) {
        for (int i = 0; i < obj.n; i++) if (!strcmp(obj.keys[i], key.s)) return obj.items[i];
    } else if (obj.type == CT_LIST && key.type == CT_INT) {
        long long k = key.i < 0 ? key.i + obj.n : key.i;
        if (k >= 0 && k < obj.n) return obj.items[k];
    } else if (obj.type == CT_STR && key.type == CT_INT) {
        long long n;
        size_t* at = ct_cp_offsets(r, obj.s, &n);
        long long k = key.i < 0 ? key.i + n : key.i;
        if (k >= 0 && k < n) return ct_str(r->c->arena, obj.s + at[k], at[k + 1] - at[k]);
    } else if (obj.type == CT_UNDEF) {
        fail("%s: indexing an undefined value", r->c->name);
    }
    return u;
}

// One bound of a slice of n items as Python's slice.indices() clamps it (absent: from the end
// the step walks from, or to past the end it walks to).
static long long ct_slice_bound(const CtVal* x, long long n, long long step, int is_stop) {
    if (!x) return is_stop ? (step < 0 ? -1 : n) : (step < 0 ? n - 1 : 0);
    long long k = x->i < 0 ? x->i + n : x->i;
    if (k < 0) return step < 0 ? -1 : 0;
    if (k >= n) return step < 0 ? n - 1 : n;
    return k;
}

// Python's seq[lo:hi:step] of a list, or of a string by code points: any part absent (NULL),
// bounds negative from the end, a negative step walks backwards (messages[::-1]).
static CtVal ct_slice(const CtRun* r, CtVal obj, const CtVal* lo, const CtVal* hi, const CtVal* step) {
    if ((lo && lo->type != CT_INT) || (hi && hi->type != CT_INT) || (step && step->type != CT_INT))
        fail("%s: slicing needs integer bounds and step", r->c->name);
    if (obj.type != CT_LIST && obj.type != CT_STR) fail("%s: slicing a %s", r->c->name, ct_type_name(obj.type));
    long long st = step ? step->i : 1, n;
    if (st == 0) fail("%s: slice step cannot be zero", r->c->name);
    if (st < -LLONG_MAX) st = -LLONG_MAX;  // as far as any index goes, and -st stays defined
    size_t* at = obj.type == CT_STR ? ct_cp_offsets(r, obj.s, &n) : NULL;
    if (!at) n = obj.n;
    long long a = ct_slice_bound(lo, n, st, 0), b = ct_slice_bound(hi, n, st, 1);
    long long k = st > 0 ? (b > a ? (b - a - 1) / st + 1 : 0) : (a > b ? (a - b - 1) / -st + 1 : 0);
    CtVal v = obj;
    if (at) {  // each code point at most once: no longer than the string
        char* d = (char*)ct_alloc(r->c->arena, at[n] + 1);
        size_t m = 0;
        for (long long j = 0, i = a; j < k; j++, i += st) { memcpy(d + m, obj.s + at[i], at[i + 1] - at[i]); m += at[i + 1] - at[i]; }
        d[m] = 0;
        v.s = d;
        return v;
    }
    v.items = (CtVal*)ct_alloc(r->c->arena, sizeof(CtVal) * k);
    v.n = (int)k;
    for (long long j = 0, i = a; j < k; j++, i += st) v.items[j] = obj.items[i];
    return v;
}

// Python's str.isspace() code points, for strip(), split() and trim: the ASCII ones,
// U+001C-U+001F, U+0085, U+00A0, U+1680, U+2000-U+200A, U+2028, U+2029, U+202F, U+205F and U+3000.
static int ct_py_space(unsigned cp) {
    return (cp >= 9 && cp <= 13) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
           (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

// The code point of the UTF-8 sequence at s[i] of n bytes (*len its length; invalid bytes: 1).
static unsigned ct_utf8_at(const unsigned char* s, size_t i, size_t n, size_t* len) {
    unsigned c = s[i];
    int k = c < 0x80 ? 0 : (c & 0xE0) == 0xC0 ? 1 : (c & 0xF0) == 0xE0 ? 2 : (c & 0xF8) == 0xF0 ? 3 : -1;
    if (k < 0 || (k > 0 && i + k >= n)) { *len = 1; return c; }
    unsigned cp = k == 0 ? c : c & (0x3F >> k);
    for (int j = 1; j <= k; j++) cp = cp << 6 | (s[i + j] & 0x3F);
    *len = (size_t)k + 1;
    return cp;
}

// Whether cp is one that strip(chars) removes: one of chars' code points, or (chars NULL) a space.
static int ct_strips(unsigned cp, const char* chars) {
    if (!chars) return ct_py_space(cp);
    size_t n = strlen(chars), len;
    for (size_t i = 0; i < n; i += len) if (ct_utf8_at((const unsigned char*)chars, i, n, &len) == cp) return 1;
    return 0;
}

// Python's str.strip/lstrip/rstrip(chars), chars NULL for whitespace.
static CtVal ct_strip(const CtRun* r, const char* s, int left, int right, const char* chars) {
    const unsigned char* u = (const unsigned char*)s;
    size_t n = strlen(s), a = 0, b = n, len;
    while (left && a < n && ct_strips(ct_utf8_at(u, a, n, &len), chars)) a += len;
    while (right && b > a) {
        size_t st = b - 1;
        while (st > a && (u[st] & 0xC0) == 0x80) st--;
        if (!ct_strips(ct_utf8_at(u, st, n, &len), chars) || st + len != b) break;
        b = st;
    }
    return ct_str(r->c->arena, s + a, b - a);
}

// The end of the next part of s from i for split(): sep's next occurrence (or the end); with sep
// NULL, the end of the next run of non-spaces, *from set to where it starts (n: no more parts).
static size_t ct_split_next(const char* s, size_t n, size_t* from, const char* sep) {
    if (sep) { const char* hit = strstr(s + *from, sep); return hit ? (size_t)(hit - s) : n; }
    size_t i = *from, len;
    const unsigned char* u = (const unsigned char*)s;
    while (i < n && ct_py_space(ct_utf8_at(u, i, n, &len))) i += len;
    *from = i;
    while (i < n && !ct_py_space(ct_utf8_at(u, i, n, &len))) i += len;
    return i;
}

// Python's str.split(sep) (sep not empty), or str.split() on runs of whitespace; counted first,
// then filled. A million parts at most (a 64 MiB string of separators would take gigabytes).
enum { CT_MAX_PARTS = 1 << 20 };
static CtVal ct_split(const CtRun* r, const char* s, const char* sep) {
    size_t n = strlen(s), k = sep ? strlen(sep) : 0;
    CtVal v = {};
    v.type = CT_LIST;
    for (int fill = 0; fill < 2; fill++) {
        if (fill) v.items = (CtVal*)ct_alloc(r->c->arena, sizeof(CtVal) * v.n);
        int parts = 0;
        for (size_t from = 0;;) {
            size_t end = ct_split_next(s, n, &from, sep);
            if (!sep && from == n) break;
            if (fill) v.items[parts] = ct_str(r->c->arena, s + from, end - from);
            if (parts++ == CT_MAX_PARTS) fail("%s: split() into more than %d parts", r->c->name, CT_MAX_PARTS);
            if (end == n) break;
            from = end + k;
        }
        v.n = parts;
    }
    return v;
}

static CtVal ct_filter(const CtRun* r, const CtExpr* e, CtVal v) {
    const char* f = e->op;
    if (!ct_is_one_of(f, CT_FILTERS)) fail("%s: unsupported construct: filter %s", r->c->name, f);
    if (e->paren) fail("%s: unsupported construct: arguments to filter %s", r->c->name, f);
    if (!strcmp(f, "trim")) return ct_strip(r, ct_text(r, v), 1, 1, NULL);
    if (!strcmp(f, "string")) { const char* t = ct_text(r, v); return ct_str(r->c->arena, t, strlen(t)); }
    if ((!strcmp(f, "length") || !strcmp(f, "count")) && (v.type == CT_LIST || v.type == CT_DICT)) return ct_int(v.n);
    if ((!strcmp(f, "length") || !strcmp(f, "count")) && v.type == CT_STR) {
        long long n = 0;  // code points, as Python's len()
        for (const unsigned char* p = (const unsigned char*)v.s; *p; p++) n += (*p & 0xC0) != 0x80;
        return ct_int(n);
    }
    if ((!strcmp(f, "first") || !strcmp(f, "last")) && v.type == CT_LIST) {
        CtVal u = {};
        return v.n ? v.items[f[0] == 'f' ? 0 : v.n - 1] : u;
    }
    fail("%s: filter %s of a %s", r->c->name, f, ct_type_name(v.type));
    return v;  // not reached
}

static int ct_test(const CtRun* r, const CtExpr* e, CtVal v) {
    const char* t = e->op;
    int known = ct_is_one_of(t, CT_TESTS);
    if (!known || e->paren) fail("%s: unsupported construct: test 'is %s'%s", r->c->name, t, known ? " with arguments" : "");
    if (!strcmp(t, "defined")) return v.type != CT_UNDEF;
    if (!strcmp(t, "undefined")) return v.type == CT_UNDEF;
    if (!strcmp(t, "none")) return v.type == CT_NONE;
    if (!strcmp(t, "string")) return v.type == CT_STR;
    if (!strcmp(t, "true") || !strcmp(t, "false")) return v.type == CT_BOOL && v.i == (t[0] == 't');
    return v.type == CT_INT;  // number
}

static CtVal ct_eval(CtRun* r, const CtExpr* e);

// A string method: strip/lstrip/rstrip([chars]), split([sep]), startswith/endswith(s).
static CtVal ct_method(CtRun* r, const char* m, const CtExpr* e) {
    CtVal obj = ct_eval(r, e->a->a);
    if (obj.type != CT_STR) fail("%s: method %s() of a %s", r->c->name, m, ct_type_name(obj.type));
    CtVal arg = {};
    if (e->nargs == 1) arg = ct_eval(r, e->args[0]);
    int none = e->nargs == 0 || arg.type == CT_NONE;  // strip() and strip(none) alike
    int starts = !strcmp(m, "startswith"), ends = !strcmp(m, "endswith");
    if (e->nargs > 1 || (!none && arg.type != CT_STR) || ((starts || ends) && none))
        fail("%s: unsupported arguments to %s()", r->c->name, m);
    if (strstr(m, "strip")) return ct_strip(r, obj.s, m[0] != 'r', m[0] != 'l', none ? NULL : arg.s);
    if (!starts && !ends) {  // split
        if (!none && !arg.s[0]) fail("%s: split() with an empty separator", r->c->name);
        return ct_split(r, obj.s, none ? NULL : arg.s);
    }
    size_t n = strlen(obj.s), k = strlen(arg.s);
    if (k > n) return ct_bool(0);
    return ct_bool(memcmp(starts ? obj.s : obj.s + n - k, arg.s, k) == 0);
}

// namespace(name=value, ...): a CT_NS of its keyword arguments.
static CtVal ct_namespace(CtRun* r, const CtExpr* e) {
    if (e->nkw != e->nargs) fail("%s: unsupported construct: namespace() with positional arguments", r->c->name);
    CtVal ns = {};
    ns.type = CT_NS;
    ns.items = (CtVal*)ct_alloc(r->c->arena, sizeof(CtVal));
    ns.items[0].type = CT_DICT;
    for (int i = 0; i < e->nargs; i++) ct_dict_set(r->c->arena, &ns.items[0], e->kws[i], ct_eval(r, e->args[i]));
    return ns;
}

// raise_exception(msg), namespace(...) or a string method; any other call is outside the subset.
static CtVal ct_eval_call(CtRun* r, const CtExpr* e) {
    const CtExpr* fn = e->a;
    int method = fn->kind == E_ITEM && fn->b->kind == E_LIT && fn->b->lit.type == CT_STR;
    const char* what = fn->kind == E_VAR ? fn->op : method ? fn->b->lit.s : "a call";
    if (fn->kind == E_VAR && !strcmp(what, "namespace")) return ct_namespace(r, e);
    int known = (fn->kind == E_VAR && !strcmp(what, "raise_exception")) || (method && ct_is_one_of(what, CT_METHODS));
    if (!known || e->nkw) fail("%s: unsupported construct: call of %s()%s", r->c->name, what, known ? " with keyword arguments" : "");
    if (method) return ct_method(r, what, e);
    if (e->nargs != 1) fail("%s: unsupported construct: call of raise_exception() with %d arguments", r->c->name, e->nargs);
    fail("%s: the template raised: %s", r->c->name, ct_text(r, ct_eval(r, e->args[0])));
    return e->lit;  // not reached
}

static CtVal ct_eval(CtRun* r, const CtExpr* e) {
    switch (e->kind) {
        case E_LIT: return e->lit;
        case E_VAR: return ct_lookup(r, e->op);
        case E_LIST: {
            CtVal v = {};
            v.type = CT_LIST;
            v.n = e->nargs;
            v.items = (CtVal*)ct_alloc(r->c->arena, sizeof(CtVal) * e->nargs);
            for (int i = 0; i < e->nargs; i++) v.items[i] = ct_eval(r, e->args[i]);
            return v;
        }
        case E_ITEM: return ct_item(r, ct_eval(r, e->a), ct_eval(r, e->b));
        case E_SLICE: {
            CtVal obj = ct_eval(r, e->a), lo, hi, step;
            if (e->b) lo = ct_eval(r, e->b);
            if (e->c) hi = ct_eval(r, e->c);
            if (e->d) step = ct_eval(r, e->d);
            return ct_slice(r, obj, e->b ? &lo : NULL, e->c ? &hi : NULL, e->d ? &step : NULL);
        }
        case E_OR: { CtVal a = ct_eval(r, e->a); return ct_truthy(a) ? a : ct_eval(r, e->b); }
        case E_AND: { CtVal a = ct_eval(r, e->a); return ct_truthy(a) ? ct_eval(r, e->b) : a; }
        case E_NOT: return ct_bool(!ct_truthy(ct_eval(r, e->a)));
        case E_COND: return ct_truthy(ct_eval(r, e->a)) ? ct_eval(r, e->b) : ct_eval(r, e->c);
        case E_BIN: { CtVal a = ct_eval(r, e->a); return ct_binop(r, e->op, a, ct_eval(r, e->b)); }
        case E_FILTER: return ct_filter(r, e, ct_eval(r, e->a));
        case E_TEST: return ct_bool(ct_test(r, e, ct_eval(r, e->a)));
        default: return ct_eval_call(r, e);  // E_CALL
    }
}

static void ct_exec(CtRun* r, const CtStmt* s);

static void ct_exec_for(CtRun* r, const CtStmt* s) {
    if (s->nvars > 1) fail("%s: unsupported construct: for with several variables", r->c->name);
    CtVal seq = ct_eval(r, s->e);
    if (seq.type != CT_LIST) fail("%s: for over a %s; only lists are supported", r->c->name, ct_type_name(seq.type));
    static const char* const keys[] = {"index0", "index", "first", "last", "length", "revindex", "revindex0"};
    r->scopes = (CtScope*)realloc(r->scopes, sizeof(CtScope) * (r->depth + 1));
    if (!r->scopes) fail("out of host memory (chat template)");
    CtScope* sc = &r->scopes[r->depth++];
    memset(sc, 0, sizeof(*sc));
    CtVal loop = {};  // one object per loop, updated each iteration, as Jinja's loop is
    loop.type = CT_DICT;
    loop.n = 7;
    loop.keys = (const char**)keys;
    loop.items = (CtVal*)ct_alloc(r->c->arena, sizeof(CtVal) * 7);
    for (int i = 0; i < seq.n; i++) {
        if (++r->iterations > CT_MAX_ITERATIONS)
            fail("%s: more than %d loop iterations in one rendering", r->c->name, CT_MAX_ITERATIONS);
        long long n = seq.n;
        loop.items[0] = ct_int(i); loop.items[1] = ct_int(i + 1); loop.items[2] = ct_bool(i == 0);
        loop.items[3] = ct_bool(i == n - 1); loop.items[4] = ct_int(n); loop.items[5] = ct_int(n - i); loop.items[6] = ct_int(n - i - 1);
        sc = &r->scopes[r->depth - 1];
        sc->n = 0;  // a fresh scope per iteration
        ct_scope_set(sc, s->var, seq.items[i]);
        ct_scope_set(sc, "loop", loop);
        ct_exec(r, s->body);
    }
    sc = &r->scopes[--r->depth];
    free(sc->names);
    free(sc->vals);
}

// {% set x = e %} into the innermost scope, or {% set ns.x = e %} into a namespace().
static void ct_exec_set(CtRun* r, const CtStmt* s) {
    CtVal v = ct_eval(r, s->e);
    if (!s->attr) { ct_scope_set(&r->scopes[r->depth - 1], s->var, v); return; }
    CtVal ns = ct_lookup(r, s->var);
    if (ns.type != CT_NS) fail("%s: cannot assign attribute %s of %s, a %s (only of a namespace())", r->c->name, s->attr, s->var, ct_type_name(ns.type));
    ct_dict_set(r->c->arena, &ns.items[0], s->attr, v);
}

static void ct_exec(CtRun* r, const CtStmt* s) {
    for (; s; s = s->next) {
        switch (s->kind) {
            case S_TEXT: ct_buf_add(&r->out, s->text, strlen(s->text)); break;
            case S_OUT: { const char* t = ct_text(r, ct_eval(r, s->e)); ct_buf_add(&r->out, t, strlen(t)); break; }
            case S_SET: ct_exec_set(r, s); break;
            case S_FOR: ct_exec_for(r, s); break;
            case S_IF:
                for (const CtStmt* b = s; b; b = b->orelse)
                    if (!b->e || ct_truthy(ct_eval(r, b->e))) { ct_exec(r, b->body); break; }
                break;
        }
    }
}

// Everything one rendering allocates, owned by its caller: chat_render_free releases it whether
// the rendering returned or fail() left it midway (a fuzzer that catches fail() with longjmp).
typedef struct {
    CtArena arena;
    CtCtx ctx;
    CtParts parts;
    CtRun run;
} ChatRender;

static void chat_render_free(ChatRender* st) {
    free(st->parts.p);
    for (int d = 0; d < st->run.depth; d++) {
        free(st->run.scopes[d].names);
        free(st->run.scopes[d].vals);
    }
    free(st->run.scopes);
    free(st->run.out.s);
    ct_arena_free(&st->arena);
    memset(st, 0, sizeof(*st));
}

// The rendering into st (zeroed by the caller); its text stays in st->run.out (NULL: empty).
static void chat_template_render_into(ChatRender* st, const char* template_text, const char* name,
                                      const ChatMsg* msgs, int n_msgs, int add_generation_prompt,
                                      const char* bos_token, const char* eos_token) {
    st->ctx.name = name;
    st->ctx.arena = &st->arena;
    CtArena* arena = &st->arena;
    st->parts = ct_lex(&st->ctx, template_text);
    CtBody b = {&st->ctx, &st->parts, 0, 0};
    CtStmt* prog = ct_parse_body(&b, NULL, NULL);
    static const char* const msg_keys[] = {"role", "content"};
    CtVal messages = {};
    messages.type = CT_LIST;
    messages.n = n_msgs;
    messages.items = (CtVal*)ct_alloc(arena, sizeof(CtVal) * (n_msgs + 1));
    for (int i = 0; i < n_msgs; i++) {
        if (!strcmp(msgs[i].role, "tool"))
            fail("%s: tool calling is not supported (message %d has role \"tool\")", name, i + 1);
        CtVal* m = &messages.items[i];
        m->type = CT_DICT;
        m->n = 2;
        m->keys = (const char**)msg_keys;
        m->items = (CtVal*)ct_alloc(arena, sizeof(CtVal) * 2);
        m->items[0] = ct_str(arena, msgs[i].role, strlen(msgs[i].role));
        m->items[1] = ct_str(arena, msgs[i].content, strlen(msgs[i].content));
    }
    CtRun* r = &st->run;
    r->c = &st->ctx;
    r->scopes = (CtScope*)xcalloc(1, sizeof(CtScope));
    r->depth = 1;
    ct_scope_set(&r->scopes[0], "messages", messages);
    ct_scope_set(&r->scopes[0], "add_generation_prompt", ct_bool(add_generation_prompt));
    ct_scope_set(&r->scopes[0], "bos_token", ct_str(arena, bos_token, strlen(bos_token)));
    ct_scope_set(&r->scopes[0], "eos_token", ct_str(arena, eos_token, strlen(eos_token)));
    ct_exec(r, prog);
}

// The text of messages under the template, as transformers' apply_chat_template(tokenize=False);
// name (the template's file) goes into every error. A malloc'd string.
static char* chat_template_render(const char* template_text, const char* name, const ChatMsg* msgs, int n_msgs,
                                  int add_generation_prompt, const char* bos_token, const char* eos_token) {
    ChatRender st;
    memset(&st, 0, sizeof(st));
    chat_template_render_into(&st, template_text, name, msgs, n_msgs, add_generation_prompt, bos_token, eos_token);
    char* out = st.run.out.s ? st.run.out.s : xstrdup("");
    st.run.out.s = NULL;
    chat_render_free(&st);
    return out;
}
