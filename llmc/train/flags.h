// flags.h: the command-line flag table. One table per program is both the parser and the
// --help text, so the two can never disagree. Flags are `--name value`, `--name=value`, or a bare
// `--name` for booleans; unknown flags and malformed values are one-line errors.
#pragma once
#include <float.h>
#include <limits.h>
#include <math.h>
#include "../common.h"
#include "../settings.h"

typedef enum { FLAG_INT, FLAG_FLOAT, FLAG_STRING, FLAG_BOOL, FLAG_CHOICE } FlagKind;

typedef struct {
    const char* name;      // without the leading dashes
    FlagKind kind;
    void* target;          // int*, float*, const char**, int* (bool), const char** (choice)
    const char* choices;   // FLAG_CHOICE: "a|b|c"
    const char* help;
    const char* group;     // section heading in --help
    int seen;
} Flag;

typedef struct {
    const char* program;
    const char* usage;
    int count;
    Flag flags[96];
    const char* group;     // group of the flags added next
} FlagTable;

static Flag* flag_add(FlagTable* t, const char* name, FlagKind kind, void* target, const char* choices,
                      const char* help) {
    if (t->count == (int)(sizeof(t->flags) / sizeof(t->flags[0]))) fail("internal: flag table full");
    Flag* f = &t->flags[t->count++];
    memset(f, 0, sizeof(*f));
    f->name = name; f->kind = kind; f->target = target; f->choices = choices; f->help = help; f->group = t->group;
    return f;
}
static void flag_int(FlagTable* t, const char* name, int* v, const char* help) {
    flag_add(t, name, FLAG_INT, v, NULL, help);
}
static void flag_float(FlagTable* t, const char* name, float* v, const char* help) {
    flag_add(t, name, FLAG_FLOAT, v, NULL, help);
}
static void flag_string(FlagTable* t, const char* name, const char** v, const char* help) {
    flag_add(t, name, FLAG_STRING, v, NULL, help);
}
static void flag_bool(FlagTable* t, const char* name, int* v, const char* help) {
    flag_add(t, name, FLAG_BOOL, v, NULL, help);
}
static void flag_choice(FlagTable* t, const char* name, const char** v, const char* choices, const char* help) {
    flag_add(t, name, FLAG_CHOICE, v, choices, help);
}

static int choice_valid(const char* choices, const char* v) {
    size_t n = strlen(v);
    for (const char* p = choices; *p;) {
        const char* bar = strchr(p, '|');
        size_t len = bar ? (size_t)(bar - p) : strlen(p);
        if (len == n && strncmp(p, v, n) == 0) return 1;
        if (!bar) break;
        p = bar + 1;
    }
    return 0;
}

static void flag_set(Flag* f, const char* v) {
    char* end;
    switch (f->kind) {
        case FLAG_INT: {
            errno = 0;
            long x = strtol(v, &end, 10);
            if (!*v || *end || errno || x < INT_MIN || x > INT_MAX)
                fail("flag --%s: expected an integer, got \"%s\"", f->name, v);
            *(int*)f->target = (int)x;
            break;
        }
        case FLAG_FLOAT: {
            errno = 0;
            float x = strtof(v, &end);
            if (!*v || *end || isnan(x)) fail("flag --%s: expected a number, got \"%s\"", f->name, v);
            // strtof sets ERANGE when the literal underflows (to 0 or a subnormal) or overflows to
            // inf: a nonzero value read as 0 would be a silent change of meaning (--lr 1e-50).
            if (errno == ERANGE || !isfinite(x))
                fail("flag --%s: \"%s\" is outside float's range (magnitude %g to %g, or 0)", f->name, v,
                     (double)FLT_MIN, (double)FLT_MAX);
            *(float*)f->target = x;
            break;
        }
        case FLAG_CHOICE:
            if (!choice_valid(f->choices, v)) fail("flag --%s: expected one of %s, got \"%s\"", f->name, f->choices, v);
            *(const char**)f->target = v;
            break;
        case FLAG_STRING: *(const char**)f->target = v; break;
        case FLAG_BOOL:
            if (strcmp(v, "1") == 0 || strcmp(v, "true") == 0) *(int*)f->target = 1;
            else if (strcmp(v, "0") == 0 || strcmp(v, "false") == 0) *(int*)f->target = 0;
            else fail("flag --%s: expected true or false, got \"%s\"", f->name, v);
            break;
    }
    f->seen = 1;
}

// One line of --help: the flag, its argument, its help and its default (none when empty).
static void flag_print_line(const Flag* f) {
    char lhs[64];
    const char* arg = f->kind == FLAG_INT ? " N" : f->kind == FLAG_FLOAT ? " X" : f->kind == FLAG_STRING ? " S" : "";
    if (f->kind == FLAG_CHOICE) snprintf(lhs, sizeof(lhs), "--%s %s", f->name, f->choices);
    else snprintf(lhs, sizeof(lhs), "--%s%s", f->name, arg);
    char dflt[64] = "";
    switch (f->kind) {
        case FLAG_INT: snprintf(dflt, sizeof(dflt), " (default %d)", *(int*)f->target); break;
        case FLAG_FLOAT: snprintf(dflt, sizeof(dflt), " (default %g)", *(float*)f->target); break;
        case FLAG_STRING: case FLAG_CHOICE: {
            const char* v = *(const char**)f->target;
            if (v && *v) snprintf(dflt, sizeof(dflt), " (default %s)", v);
            break;
        }
        case FLAG_BOOL: break;
    }
    printf("  %-34s %s%s\n", lhs, f->help, dflt);
}

static int flag_same_group(const Flag* a, const Flag* b) {
    return a->group == b->group || (a->group && b->group && strcmp(a->group, b->group) == 0);
}

// The usage line, then every flag under its group's heading, groups in the order they first
// appear (a trainer may add flags to a shared group after the shared flags).
static void flags_print_help(const FlagTable* t) {
    printf("usage: %s %s\n", t->program, t->usage);
    for (int i = 0; i < t->count; i++) {
        int first = 1;
        for (int j = 0; j < i && first; j++) first = !flag_same_group(&t->flags[j], &t->flags[i]);
        if (!first) continue;
        if (t->flags[i].group) printf("\n%s:\n", t->flags[i].group);
        for (int k = i; k < t->count; k++)
            if (flag_same_group(&t->flags[k], &t->flags[i])) flag_print_line(&t->flags[k]);
    }
    printf("  %-34s %s\n", "--help", "print this help and exit");
    settings_print_help();
}

// The shortest %g text that reads back as x (so 2e-3 prints as 0.002, not 0.00200000009).
static void float_shortest(char* buf, size_t n, float x) {
    for (int digits = 6; digits <= 9; digits++) {
        snprintf(buf, n, "%.*g", digits, x);
        if (strtof(buf, NULL) == x) return;
    }
}

// Every flag's value as "--name=value" words, in the table's order (what ranks compare at start).
static void flags_values(const FlagTable* t, char* buf, size_t n) {
    buf[0] = 0;
    for (int i = 0; i < t->count; i++) {
        const Flag* f = &t->flags[i];
        switch (f->kind) {
            case FLAG_INT: case FLAG_BOOL: str_appendf(buf, n, "--%s=%d ", f->name, *(int*)f->target); break;
            case FLAG_FLOAT: {
                char x[32];
                float_shortest(x, sizeof(x), *(float*)f->target);
                str_appendf(buf, n, "--%s=%s ", f->name, x);
                break;
            }
            case FLAG_STRING: case FLAG_CHOICE: {
                const char* v = *(const char**)f->target;
                str_appendf(buf, n, "--%s=%s ", f->name, v ? v : "(none)");
                break;
            }
        }
    }
}

static Flag* flags_find(FlagTable* t, const char* name) {
    for (int i = 0; i < t->count; i++)
        if (strcmp(t->flags[i].name, name) == 0) return &t->flags[i];
    return NULL;
}

// Whether flag `name` was given on the command line (for a flag whose every value, its default
// too, may be given, so that the default cannot tell).
static int flag_seen(const FlagTable* t, const char* name) {
    for (int i = 0; i < t->count; i++)
        if (strcmp(t->flags[i].name, name) == 0) return t->flags[i].seen;
    return 0;
}

// Parses argv against the table. --help prints the table and exits 0.
static void flags_parse(FlagTable* t, int argc, char** argv) {
    stdout_check_at_exit_register();  // --help's text too
    for (int i = 1; i < argc; i++) {
        const char* a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) { flags_print_help(t); exit(0); }
        if (strncmp(a, "--", 2) != 0) fail("unexpected argument \"%s\" (flags start with --; see --help)", a);
        char name[64];
        const char* eq = strchr(a + 2, '=');
        size_t n = eq ? (size_t)(eq - a - 2) : strlen(a + 2);
        if (n >= sizeof(name)) fail("unknown flag %s (see --help)", a);
        memcpy(name, a + 2, n);
        name[n] = 0;
        Flag* f = flags_find(t, name);
        if (!f) fail("unknown flag --%s (see --help)", name);
        if (eq) flag_set(f, eq + 1);
        else if (f->kind == FLAG_BOOL) flag_set(f, "1");
        else if (i + 1 < argc) flag_set(f, argv[++i]);
        else fail("flag --%s needs a value", name);
    }
}
