// pretok_regex.h: the regexes that tokenizer.json pre-tokenizers split text with, matched by
// hand on code points: GPT-2's (also ByteLevel's own), and Llama-3's and Qwen2's (the same but for
// the digit runs: 3 at most, or 1); with the UTF-8 decoding and the Unicode classes (\p{L}, \p{N},
// \s from unicode_classes.h) they need. Each matcher returns the end of the match at cp[i]; as
// every character is a letter, a number, a space or none of these, some alternative always
// matches, so the matches tile the text.
#pragma once
#include <stdint.h>
#include "../formats/json.h"
#include "unicode_classes.h"

// ---------------------------------------------------------------------------------------------
// UTF-8 and character classes

// Decodes the code point at s[0..n) (n > 0) into *cp; returns its length (1 for a stray byte).
static int hf_utf8(const unsigned char* s, int n, uint32_t* cp) {
    int len = s[0] < 0x80 ? 1 : s[0] >= 0xF0 ? 4 : s[0] >= 0xE0 ? 3 : s[0] >= 0xC0 ? 2 : 1;
    if (len > n) len = 1;
    for (int k = 1; k < len; k++) if ((s[k] & 0xC0) != 0x80) len = 1;
    uint32_t v = len == 1 ? s[0] : (uint32_t)(s[0] & (0x7F >> len));
    for (int k = 1; k < len; k++) v = v << 6 | (s[k] & 0x3F);
    *cp = v;
    return len;
}

static int hf_put_utf8(char* out, uint32_t cp) {
    size_t n = 0;
    json_append_utf8(out, &n, cp);
    return (int)n;
}

static int hf_is_letter(uint32_t c) {
    return c < 0x80 ? ((c | 32) - 'a' < 26u) : uni_in(UNI_LETTER, UNI_COUNT(UNI_LETTER), c);
}
static int hf_is_number(uint32_t c) {
    return c < 0x80 ? (c - '0' < 10u) : uni_in(UNI_NUMBER, UNI_COUNT(UNI_NUMBER), c);
}
static int hf_is_space(uint32_t c) { return uni_in(UNI_SPACE, UNI_COUNT(UNI_SPACE), c); }
static int hf_is_other(uint32_t c) { return !hf_is_space(c) && !hf_is_letter(c) && !hf_is_number(c); }
static int hf_is_newline(uint32_t c) { return c == '\r' || c == '\n'; }

// ---------------------------------------------------------------------------------------------
// the pre-tokenizer regexes, on code points cp[i..n): each returns the end of the match at i

// 's|'t|'re|'ve|'m|'ll|'d, ASCII case folded when icase
static int hf_re_contraction(const uint32_t* cp, int i, int n, int icase) {
    if (cp[i] != '\'' || i + 1 >= n) return -1;
    uint32_t a = cp[i + 1], b = i + 2 < n ? cp[i + 2] : 0;
    if (icase) { if (a < 0x80) a |= 32; if (b < 0x80) b |= 32; }
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 2;
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return i + 3;
    return -1;
}

static int hf_run(const uint32_t* cp, int i, int n, int (*cls)(uint32_t)) {
    while (i < n && cls(cp[i])) i++;
    return i;
}

// \s+(?!\S) then \s+: a whitespace run leaves its last character to a word that follows
static int hf_re_spaces(const uint32_t* cp, int i, int n) {
    int j = hf_run(cp, i, n, hf_is_space);
    if (j == i) return -1;
    return (j < n && j - 1 > i) ? j - 1 : j;
}

// 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
static int hf_re_gpt2(const uint32_t* cp, int i, int n) {
    int e = hf_re_contraction(cp, i, n, 0);
    if (e >= 0) return e;
    int s = (cp[i] == ' ' && i + 1 < n) ? i + 1 : i;
    int (*classes[3])(uint32_t) = {hf_is_letter, hf_is_number, hf_is_other};
    for (int k = 0; k < 3; k++) {
        if (classes[k](cp[s])) return hf_run(cp, s, n, classes[k]);  // (a space is in no class)
    }
    return hf_re_spaces(cp, i, n);
}

// Llama-3 (max_digits 3) and Qwen2 (1):
// (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,K}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
static int hf_re_llama3(const uint32_t* cp, int i, int n, int max_digits) {
    int e = hf_re_contraction(cp, i, n, 1);
    if (e >= 0) return e;
    uint32_t c = cp[i];
    if (!hf_is_newline(c) && !hf_is_letter(c) && !hf_is_number(c) && i + 1 < n && hf_is_letter(cp[i + 1]))
        return hf_run(cp, i + 1, n, hf_is_letter);
    if (hf_is_letter(c)) return hf_run(cp, i, n, hf_is_letter);
    if (hf_is_number(c)) {
        int j = i;
        while (j < n && j - i < max_digits && hf_is_number(cp[j])) j++;
        return j;
    }
    int s = (c == ' ' && i + 1 < n && hf_is_other(cp[i + 1])) ? i + 1 : i;
    if (hf_is_other(cp[s])) return hf_run(cp, hf_run(cp, s, n, hf_is_other), n, hf_is_newline);
    int j = hf_run(cp, i, n, hf_is_space), last_nl = -1;
    for (int k = i; k < j; k++) if (hf_is_newline(cp[k])) last_nl = k;
    if (last_nl >= 0) return last_nl + 1;  // \s*[\r\n]+, \s* backing off to the last newline
    return hf_re_spaces(cp, i, n);
}
