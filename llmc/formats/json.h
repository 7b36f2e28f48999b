// json.h: a small strict JSON reader (config.json, safetensors headers, index files), the few
// lookups the loaders need, and the writer of a parsed value (an exported config.json). Parse
// errors name the source and the byte offset.
#pragma once
#include <math.h>
#include "../common.h"

typedef enum { JSON_NULL, JSON_BOOL, JSON_NUMBER, JSON_STRING, JSON_ARRAY, JSON_OBJECT } JsonType;

typedef struct Json {
    JsonType type;
    double number;
    int boolean;
    char* string;          // JSON_STRING value (decoded); unused otherwise
    int count;             // array/object element count
    char** keys;           // object keys, count of them
    struct Json* items;    // array/object elements
} Json;

typedef struct {
    const char* s;
    size_t pos, len;
    const char* source;    // file name for messages
} JsonParser;

static void json_error(JsonParser* p, const char* what) {
    fail("%s: invalid JSON at byte %zu: %s", p->source, p->pos, what);
}

static void json_skip_ws(JsonParser* p) {
    while (p->pos < p->len &&
           (p->s[p->pos] == ' ' || p->s[p->pos] == '\n' || p->s[p->pos] == '\r' || p->s[p->pos] == '\t'))
        p->pos++;
}

static void json_parse_value(JsonParser* p, Json* out, int depth);

static void json_append_utf8(char* buf, size_t* n, unsigned cp) {
    if (cp < 0x80) buf[(*n)++] = (char)cp;
    else if (cp < 0x800) { buf[(*n)++] = (char)(0xC0 | (cp >> 6)); buf[(*n)++] = (char)(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        buf[(*n)++] = (char)(0xE0 | (cp >> 12));
        buf[(*n)++] = (char)(0x80 | ((cp >> 6) & 0x3F));
        buf[(*n)++] = (char)(0x80 | (cp & 0x3F));
    } else {
        buf[(*n)++] = (char)(0xF0 | (cp >> 18));
        buf[(*n)++] = (char)(0x80 | ((cp >> 12) & 0x3F));
        buf[(*n)++] = (char)(0x80 | ((cp >> 6) & 0x3F));
        buf[(*n)++] = (char)(0x80 | (cp & 0x3F));
    }
}

static unsigned json_hex4(JsonParser* p) {
    if (p->pos + 4 > p->len) json_error(p, "truncated \\u escape");
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        char c = p->s[p->pos++];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= c - '0';
        else if (c >= 'a' && c <= 'f') v |= c - 'a' + 10;
        else if (c >= 'A' && c <= 'F') v |= c - 'A' + 10;
        else json_error(p, "bad \\u escape");
    }
    return v;
}

// The length of the UTF-8 sequence at s (n bytes available), or 0 when it is not valid UTF-8 (a
// stray continuation byte, an overlong form, a surrogate, a code point past U+10FFFF). JSON text
// is UTF-8; Python's json and serde_json (the tokenizers and safetensors libraries) refuse the rest.
static size_t json_utf8_len(const unsigned char* s, size_t n) {
    unsigned c = s[0], need;
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c < 0xE0) need = 1;
    else if (c >= 0xE0 && c < 0xF0) need = 2;
    else if (c >= 0xF0 && c < 0xF5) need = 3;
    else return 0;  // a continuation byte, or the lead byte of an overlong or too large form
    if (need >= n) return 0;
    unsigned cp = c & (0x3F >> need);
    for (unsigned i = 1; i <= need; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        cp = cp << 6 | (s[i] & 0x3F);
    }
    int overlong = (need == 2 && cp < 0x800) || (need == 3 && cp < 0x10000);
    if (overlong || cp > 0x10FFFF || (cp >= 0xD800 && cp < 0xE000)) return 0;
    return need + 1;
}

// A \u escape's code point, a surrogate pair taken whole. A lone surrogate is refused (it is no
// character: serde_json refuses it, Python's json keeps it, so the readers would disagree).
static unsigned json_escape_code_point(JsonParser* p) {
    unsigned cp = json_hex4(p);
    if (cp >= 0xD800 && cp < 0xDC00 && p->pos + 6 <= p->len && p->s[p->pos] == '\\' && p->s[p->pos + 1] == 'u') {
        p->pos += 2;
        unsigned lo = json_hex4(p);
        if (lo < 0xDC00 || lo >= 0xE000) json_error(p, "a \\u escape of a high surrogate is not followed by a low one");
        return 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
    }
    if (cp >= 0xD800 && cp < 0xE000) json_error(p, "a \\u escape of a lone surrogate (not a character)");
    return cp;
}

static char* json_parse_string(JsonParser* p) {
    if (p->s[p->pos] != '"') json_error(p, "expected a string");
    p->pos++;
    size_t end = p->pos;  // the closing quote (or the end of input): decoded text is never longer
    while (end < p->len && p->s[end] != '"') end += p->s[end] == '\\' ? 2 : 1;
    char* buf = (char*)xmalloc((end < p->len ? end : p->len) - p->pos + 1);
    size_t n = 0;
    for (;;) {
        if (p->pos >= p->len) json_error(p, "unterminated string");
        unsigned char c = (unsigned char)p->s[p->pos++];
        if (c == '"') break;
        if (c < 0x20) json_error(p, "control character in string");
        if (c >= 0x80) {  // a multi-byte character, copied whole once checked
            size_t k = json_utf8_len((const unsigned char*)p->s + p->pos - 1, p->len - p->pos + 1);
            if (!k) { p->pos--; json_error(p, "invalid UTF-8 in a string"); }
            memcpy(buf + n, p->s + p->pos - 1, k);
            n += k;
            p->pos += k - 1;
            continue;
        }
        if (c != '\\') { buf[n++] = (char)c; continue; }
        if (p->pos >= p->len) json_error(p, "unterminated escape");
        char e = p->s[p->pos++];
        switch (e) {
            case '"': buf[n++] = '"'; break;
            case '\\': buf[n++] = '\\'; break;
            case '/': buf[n++] = '/'; break;
            case 'b': buf[n++] = '\b'; break;
            case 'f': buf[n++] = '\f'; break;
            case 'n': buf[n++] = '\n'; break;
            case 'r': buf[n++] = '\r'; break;
            case 't': buf[n++] = '\t'; break;
            case 'u': {
                unsigned cp = json_escape_code_point(p);
                // a C string cannot hold U+0000: the text would end there (a tensor "w\u0000x" read as "w")
                if (!cp) {
                    buf[n] = 0;
                    fail("%s: invalid JSON at byte %zu: the string \"%.80s\" continues after a \\u0000 (NUL), which "
                         "this reader cannot hold", p->source, p->pos, buf);
                }
                json_append_utf8(buf, &n, cp);
                break;
            }
            default: json_error(p, "bad escape");
        }
    }
    buf[n] = 0;
    return buf;
}

// A key twice in one object is refused, naming it: readers disagree on which value counts
// (Python's json takes the last, a first-match lookup like json_get the first).
static void json_check_unique_keys(const JsonParser* p, const Json* obj) {
    int first, dup = first_repeated_string((const char* const*)obj->keys, obj->count, &first);
    if (dup >= 0)
        fail("%s: key \"%s\" appears twice in one JSON object (ambiguous: Python's json would take the last value, a "
             "first-match reader the first)", p->source, obj->keys[dup]);
}

static void json_parse_container(JsonParser* p, Json* out, int depth, int is_object) {
    char close = is_object ? '}' : ']';
    p->pos++;
    int cap = 8;
    out->type = is_object ? JSON_OBJECT : JSON_ARRAY;
    out->count = 0;
    out->items = (Json*)xcalloc(cap, sizeof(Json));
    out->keys = is_object ? (char**)xcalloc(cap, sizeof(char*)) : NULL;
    json_skip_ws(p);
    if (p->pos < p->len && p->s[p->pos] == close) { p->pos++; return; }
    for (;;) {
        if (out->count == cap) {
            cap *= 2;
            out->items = (Json*)realloc(out->items, cap * sizeof(Json));
            if (is_object) out->keys = (char**)realloc(out->keys, cap * sizeof(char*));
            if (!out->items || (is_object && !out->keys)) fail("out of memory parsing %s", p->source);
        }
        json_skip_ws(p);
        if (is_object) {
            if (p->pos >= p->len) json_error(p, "unterminated object");
            out->keys[out->count] = json_parse_string(p);
            json_skip_ws(p);
            if (p->pos >= p->len || p->s[p->pos] != ':') json_error(p, "expected ':'");
            p->pos++;
        }
        json_parse_value(p, &out->items[out->count], depth + 1);
        out->count++;
        json_skip_ws(p);
        if (p->pos >= p->len) json_error(p, "unterminated container");
        char c = p->s[p->pos++];
        if (c == close) break;
        if (c != ',') json_error(p, "expected ',' or end of container");
    }
    if (is_object) json_check_unique_keys(p, out);
}

static void json_parse_value(JsonParser* p, Json* out, int depth) {
    memset(out, 0, sizeof(*out));
    if (depth > 64) json_error(p, "nesting too deep");
    json_skip_ws(p);
    if (p->pos >= p->len) json_error(p, "unexpected end of input");
    char c = p->s[p->pos];
    if (c == '{' || c == '[') { json_parse_container(p, out, depth, c == '{'); return; }
    if (c == '"') { out->type = JSON_STRING; out->string = json_parse_string(p); return; }
    const char* words[3] = {"true", "false", "null"};
    for (int w = 0; w < 3; w++) {
        size_t n = strlen(words[w]);
        if (p->len - p->pos >= n && strncmp(p->s + p->pos, words[w], n) == 0) {
            p->pos += n;
            out->type = w == 2 ? JSON_NULL : JSON_BOOL;
            out->boolean = w == 0;
            return;
        }
    }
    if (c == '-' || (c >= '0' && c <= '9')) {
        char tmp[64];
        size_t n = 0;
        while (p->pos < p->len && n < sizeof(tmp) - 1 && strchr("+-0123456789.eE", p->s[p->pos]))
            tmp[n++] = p->s[p->pos++];
        tmp[n] = 0;
        char* end;
        out->type = JSON_NUMBER;
        out->number = strtod(tmp, &end);
        if (*end) json_error(p, "bad number");
        return;
    }
    json_error(p, "unexpected character");
}

// Parses text of the given length; `source` names it in error messages.
static Json json_parse(const char* text, size_t len, const char* source) {
    JsonParser p = {text, 0, len, source};
    Json root;
    json_parse_value(&p, &root, 0);
    json_skip_ws(&p);
    if (p.pos != p.len) json_error(&p, "trailing characters after the value");
    return root;
}

static void json_free(Json* j) {
    if (j->type == JSON_STRING) free(j->string);
    if (j->type == JSON_ARRAY || j->type == JSON_OBJECT) {
        for (int i = 0; i < j->count; i++) {
            json_free(&j->items[i]);
            if (j->keys) free(j->keys[i]);
        }
        free(j->items);
        free(j->keys);
    }
    memset(j, 0, sizeof(*j));
}

static const Json* json_get(const Json* obj, const char* key) {
    if (!obj || obj->type != JSON_OBJECT) return NULL;
    for (int i = 0; i < obj->count; i++)
        if (strcmp(obj->keys[i], key) == 0) return &obj->items[i];
    return NULL;
}

// Numeric field lookups. The _req variants fail naming the file and the field.
static double json_number_or(const Json* obj, const char* key, double dflt) {
    const Json* v = json_get(obj, key);
    return (v && v->type == JSON_NUMBER) ? v->number : dflt;
}

static double json_number_req(const Json* obj, const char* key, const char* source) {
    const Json* v = json_get(obj, key);
    if (!v) fail("%s: missing field \"%s\"", source, key);
    if (v->type != JSON_NUMBER) fail("%s: field \"%s\" must be a number", source, key);
    return v->number;
}

// An integer field within [lo, hi]; the message names the file, the field and the range.
static int json_int_in(const Json* obj, const char* key, const char* source, int lo, int hi) {
    double x = json_number_req(obj, key, source);
    if (x != floor(x) || x < lo || x > hi)
        fail("%s: field \"%s\" must be an integer in [%d, %d], got %g", source, key, lo, hi, x);
    return (int)x;
}

static int json_int_req(const Json* obj, const char* key, const char* source) {
    return json_int_in(obj, key, source, 0, 2147483647);
}

// An optional number: dflt when the field is absent or null, an error when it is something else.
static double json_number_opt(const Json* obj, const char* key, const char* source, double dflt) {
    const Json* v = json_get(obj, key);
    if (!v || v->type == JSON_NULL) return dflt;
    if (v->type != JSON_NUMBER) fail("%s: field \"%s\" must be a number", source, key);
    return v->number;
}

// A positive, finite float (a norm's epsilon, RoPE's base): checked after the conversion to
// float, where 1e-50 becomes 0 and 1e39 becomes infinity, because the kernels see the float.
static float json_positive_float(double x, const char* key, const char* source) {
    float f = (float)x;
    if (!(f > 0) || !isfinite(f))
        fail("%s: field \"%s\" must be a positive finite number (as a float32), got %g", source, key, x);
    return f;
}

// A field that is an integer or a pair [height, width] of integers (image_size and patch_size of a
// vision config), each in [lo, hi]; an integer gives both. Absent or malformed: fails naming the
// file and the field.
static void json_hw_pair(const Json* obj, const char* key, const char* source, int lo, int hi, int* h,
                         int* w) {
    const Json* v = json_get(obj, key);
    if (!v) fail("%s: missing field \"%s\"", source, key);
    if (v->type == JSON_NUMBER) {
        *h = *w = json_int_in(obj, key, source, lo, hi);
        return;
    }
    if (v->type != JSON_ARRAY || v->count != 2)
        fail("%s: field \"%s\" must be an integer or a pair [height, width]", source, key);
    for (int i = 0; i < 2; i++) {
        double x = v->items[i].number;
        if (v->items[i].type != JSON_NUMBER || x != floor(x) || x < lo || x > hi)
            fail("%s: field \"%s\" must be an integer or a pair [height, width] of integers in [%d, %d]", source, key,
                 lo, hi);
    }
    *h = (int)v->items[0].number;
    *w = (int)v->items[1].number;
}

static int json_bool_or(const Json* obj, const char* key, int dflt) {
    const Json* v = json_get(obj, key);
    return (v && v->type == JSON_BOOL) ? v->boolean : dflt;
}

static const char* json_string_or(const Json* obj, const char* key, const char* dflt) {
    const Json* v = json_get(obj, key);
    return (v && v->type == JSON_STRING) ? v->string : dflt;
}

// Writes s as a JSON string literal (with quotes) to f.
static void json_write_string(FILE* f, const char* s) {
    fputc('"', f);
    for (const unsigned char* c = (const unsigned char*)s; *c; c++) {
        if (*c == '"' || *c == '\\') fprintf(f, "\\%c", *c);
        else if (*c < 0x20) fprintf(f, "\\u%04x", *c);
        else fputc(*c, f);
    }
    fputc('"', f);
}

// JSON out, as parsed (numbers that are integers print as integers).
static void json_dump(FILE* f, const Json* j, int indent) {
    switch (j->type) {
    case JSON_NULL: fputs("null", f); break;
    case JSON_BOOL: fputs(j->boolean ? "true" : "false", f); break;
    case JSON_NUMBER:
        if (j->number == floor(j->number) && fabs(j->number) < 1e15) fprintf(f, "%lld", (long long)j->number);
        else {  // the shortest form that reads back to the same double
            char b[40];
            for (int prec = 15; prec <= 17; prec++) {
                snprintf(b, sizeof(b), "%.*g", prec, j->number);
                if (strtod(b, NULL) == j->number) break;
            }
            fputs(b, f);
        }
        break;
    case JSON_STRING: json_write_string(f, j->string); break;
    case JSON_ARRAY:
        fputc('[', f);
        for (int i = 0; i < j->count; i++) { if (i) fputs(", ", f); json_dump(f, &j->items[i], indent); }
        fputc(']', f);
        break;
    case JSON_OBJECT:
        fputs("{", f);
        for (int i = 0; i < j->count; i++) {
            fprintf(f, "%s\n%*s", i ? "," : "", indent + 2, "");
            json_write_string(f, j->keys[i]);
            fputs(": ", f);
            json_dump(f, &j->items[i], indent + 2);
        }
        fprintf(f, "\n%*s}", indent, "");
        break;
    }
}
