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
#include "jinja_syntax.h"

typedef struct { const char* role; const char* content; } ChatMsg;

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

static long long ct_floordiv(long long a, long long b) {
    long long q = a / b;
    return (a % b != 0 && (a < 0) != (b < 0)) ? q - 1 : q;
}

static CtVal ct_binop(CtRun* r, const char* op, CtVal a, CtVal b) {
    CtArena* ar = r->c->arena;
    if (!strcmp(op, "~")) return ct_join(ar, ct_text(r, a), ct_text(r, b));
    if (!strcmp(op, "==")) return ct_bool(ct_equal(a, b));
    if (!strcmp(op, "!=")) return ct_bool(!ct_equal(a, b));
    if (!strcmp(op, "in")) {
        if (b.type == CT_STR && a.type == CT_STR) return ct_bool(strstr(b.s, a.s) != NULL);
        if (b.type == CT_LIST) {
            for (int i = 0; i < b.n; i++)
                if (ct_equal(a, b.items[i])) return ct_bool(1);
            return ct_bool(0);
        }
        if (b.type == CT_DICT && a.type == CT_STR) {
            for (int i = 0; i < b.n; i++)
                if (!strcmp(a.s, b.keys[i])) return ct_bool(1);
            return ct_bool(0);
        }
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
            case '%':
                v = b.i == -1 ? 0 : a.i - b.i * ct_floordiv(a.i, b.i);
                break;  // x % -1 is 0, even for the minimum
            case '/': over = b.i == -1 && a.i == LLONG_MIN; if (!over) v = ct_floordiv(a.i, b.i); break;
        }
        // Jinja's integers are Python's, of any size; a 64-bit result that wrapped would differ
        if (over) fail("%s: integer %lld %s %lld overflows 64 bits", r->c->name, a.i, op, b.i);
        return ct_int(v);
    }
    fail("%s: unsupported operation '%s' between %s and %s", r->c->name, op, ct_type_name(a.type),
         ct_type_name(b.type));
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
        for (long long j = 0, i = a; j < k; j++, i += st) {
            memcpy(d + m, obj.s + at[i], at[i + 1] - at[i]);
            m += at[i + 1] - at[i];
        }
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
           (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
           cp == 0x3000;
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
    if (!known || e->paren)
        fail("%s: unsupported construct: test 'is %s'%s", r->c->name, t, known ? " with arguments" : "");
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
    if (!known || e->nkw)
        fail("%s: unsupported construct: call of %s()%s", r->c->name, what, known ? " with keyword arguments" : "");
    if (method) return ct_method(r, what, e);
    if (e->nargs != 1)
        fail("%s: unsupported construct: call of raise_exception() with %d arguments", r->c->name, e->nargs);
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
        loop.items[3] = ct_bool(i == n - 1);
        loop.items[4] = ct_int(n);
        loop.items[5] = ct_int(n - i);
        loop.items[6] = ct_int(n - i - 1);
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
    if (ns.type != CT_NS)
        fail("%s: cannot assign attribute %s of %s, a %s (only of a namespace())", r->c->name, s->attr, s->var,
             ct_type_name(ns.type));
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
