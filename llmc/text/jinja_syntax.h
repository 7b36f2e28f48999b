// jinja_syntax.h: the front half of the chat template renderer (llmc/text/chat_template.h): its
// values and the arena one rendering allocates from, the renderer's limits, the lexer (text and
// tags, with Jinja's whitespace rules) and the parser (tags into a tree of statements and
// expressions). What the tree means, and the rendering itself, are chat_template.h's.
#pragma once
#include <ctype.h>
#include <limits.h>
#include "../common.h"

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
    else if (cp < 0x800) { out[(*n)++] = (char)(0xC0 | cp >> 6); out[(*n)++] = (char)(0x80 | (cp & 0x3F));
    } else {
        out[(*n)++] = (char)(0xE0 | cp >> 12);
        out[(*n)++] = (char)(0x80 | (cp >> 6 & 0x3F));
        out[(*n)++] = (char)(0x80 | (cp & 0x3F));
    }
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
            if (cp >= 0xD800 && cp < 0xE000)
                fail("%s: unsupported construct: surrogate \\u escape at offset %zu", c->name, i);
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
            if (i + pl + 2 <= len && strncmp(src + i, pre, pl) == 0 && src[i + pl] == closer &&
                src[i + pl + 1] == '}') {
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
    for (size_t i = 0; i < len; i++)
        if (!(template_text[i] == '\r' && template_text[i + 1] == '\n')) src[m++] = template_text[i];
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
            if (ls < t1 && (ls == t0 ? t0 == 0 || src[t0 - 1] == '\n' : src[ls - 1] == '\n'))
                t1 = ls;  // alone on its line
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
    if (!t)
        fail("%s: expected %s, got '%s'", p->c->name, s ? s : kind == TK_NAME ? "a name" : "a token", ct_tok_text(p));
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
        else if (ct_peek(p, TK_NAME, "not", 0) && ct_peek(p, TK_NAME, "in", 1)) {
            p->i += 2;
            e = ct_node(p, E_NOT, ct_bin(p, "in", e, ct_add(p)), NULL);
        } else
            return e;
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
    if (++b->depth > CT_MAX_DEPTH)
        fail("%s: blocks nested more than %d deep (each elif counts)", b->c->name, CT_MAX_DEPTH);
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
        for (s->nvars = 1; ct_take(&p, TK_OP, ","); s->nvars++)
            ct_need(&p, TK_NAME, NULL);  // read; refused when rendered
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
