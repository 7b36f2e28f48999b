#!/usr/bin/env python3
"""scripts/gen/unicode_nfc.py: writes llmc/unicode_nfc.h, the data of Unicode's NFC normalization
(the normalizer of Qwen2's tokenizer.json) from this Python's unicodedata: canonical combining
classes, canonical decompositions (one level; applied recursively), and the primary composites
(pairs that NFC recomposes: a canonical pair decomposition whose result NFC keeps, which leaves out
the composition exclusions and non-starter decompositions). Hangul syllables are algorithmic
(in the header, not in the tables).

    python3 scripts/gen/unicode_nfc.py > llmc/unicode_nfc.h
"""
import sys
import unicodedata


def rows(items, fmt, per_line):
    out = []
    for k in range(0, len(items), per_line):
        out.append("    " + " ".join(fmt(x) for x in items[k:k + per_line]))
    return "\n".join(out)


CODE = r"""
#define NFC_COUNT(t) ((int)(sizeof(t) / sizeof((t)[0])))
enum { NFC_SBASE = 0xAC00, NFC_LBASE = 0x1100, NFC_VBASE = 0x1161, NFC_TBASE = 0x11A7,
       NFC_LCOUNT = 19, NFC_VCOUNT = 21, NFC_TCOUNT = 28, NFC_SCOUNT = 19 * 21 * 28 };

static int nfc_ccc(uint32_t cp) {
    int lo = 0, hi = NFC_COUNT(NFC_CCC) - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        if (cp < NFC_CCC[mid][0]) hi = mid - 1;
        else if (cp > NFC_CCC[mid][1]) lo = mid + 1;
        else return (int)NFC_CCC[mid][2];
    }
    return 0;
}

// The row of table t (n rows of 3, sorted by the first `keys` columns) matching a (and b); or -1.
static int nfc_find(const uint32_t (*t)[3], int n, uint32_t a, uint32_t b, int keys) {
    int lo = 0, hi = n - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        uint32_t x = t[mid][0], y = keys == 2 ? t[mid][1] : b;
        if (a < x || (a == x && b < y)) hi = mid - 1;
        else if (a > x || b > y) lo = mid + 1;
        else return mid;
    }
    return -1;
}

// Appends the full canonical decomposition of cp to out[*n].
static void nfc_decompose(uint32_t cp, uint32_t* out, int* n) {
    if (cp >= NFC_SBASE && cp < NFC_SBASE + NFC_SCOUNT) {
        uint32_t s = cp - NFC_SBASE;
        out[(*n)++] = NFC_LBASE + s / (NFC_VCOUNT * NFC_TCOUNT);
        out[(*n)++] = NFC_VBASE + (s % (NFC_VCOUNT * NFC_TCOUNT)) / NFC_TCOUNT;
        if (s % NFC_TCOUNT) out[(*n)++] = NFC_TBASE + s % NFC_TCOUNT;
        return;
    }
    int r = nfc_find(NFC_DECOMP, NFC_COUNT(NFC_DECOMP), cp, 0, 1);
    if (r < 0) { out[(*n)++] = cp; return; }
    nfc_decompose(NFC_DECOMP[r][1], out, n);
    if (NFC_DECOMP[r][2]) nfc_decompose(NFC_DECOMP[r][2], out, n);
}

// The primary composite of a and b, or 0.
static uint32_t nfc_compose(uint32_t a, uint32_t b) {
    if (a >= NFC_LBASE && a < NFC_LBASE + NFC_LCOUNT && b >= NFC_VBASE && b < NFC_VBASE + NFC_VCOUNT)
        return NFC_SBASE + ((a - NFC_LBASE) * NFC_VCOUNT + (b - NFC_VBASE)) * NFC_TCOUNT;
    if (a >= NFC_SBASE && a < NFC_SBASE + NFC_SCOUNT && (a - NFC_SBASE) % NFC_TCOUNT == 0 &&
        b > NFC_TBASE && b < NFC_TBASE + NFC_TCOUNT)
        return a + (b - NFC_TBASE);
    int r = nfc_find(NFC_COMP, NFC_COUNT(NFC_COMP), a, b, 2);
    return r < 0 ? 0 : NFC_COMP[r][2];
}

// NFC of the n code points cp (decomposed forms take at most 4 code points each in Unicode's
// data; out holds 4 n): decompose, order marks by combining class, recompose (UAX #15).
// Returns the count written to out.
static int nfc(const uint32_t* cp, int n, uint32_t* out) {
    int m = 0;
    for (int i = 0; i < n; i++) nfc_decompose(cp[i], out, &m);
    for (int i = 1; i < m; i++) {  // stable insertion sort of each run of marks
        int c = nfc_ccc(out[i]);
        for (int j = i; c && j > 0 && nfc_ccc(out[j - 1]) > c; j--) {
            uint32_t t = out[j]; out[j] = out[j - 1]; out[j - 1] = t;
        }
    }
    if (m == 0) return 0;
    int w = 1, starter = 0, last = nfc_ccc(out[0]) ? 256 : 0;
    for (int i = 1; i < m; i++) {
        int c = nfc_ccc(out[i]);
        uint32_t comp = nfc_compose(out[starter], out[i]);
        if (comp && (last < c || last == 0)) { out[starter] = comp; continue; }
        if (c == 0) starter = w;
        last = c;
        out[w++] = out[i];
    }
    return w;
}"""


def main():
    ccc = []  # (first, last, class) for class != 0
    for cp in range(0x110000):
        c = unicodedata.combining(chr(cp))
        if c:
            if ccc and ccc[-1][1] == cp - 1 and ccc[-1][2] == c:
                ccc[-1][1] = cp
            else:
                ccc.append([cp, cp, c])
    decomp, comp = [], []
    for cp in range(0x110000):
        if 0xAC00 <= cp <= 0xD7A3:
            continue  # Hangul: algorithmic
        d = unicodedata.decomposition(chr(cp))
        if not d or d.startswith("<"):
            continue
        parts = [int(x, 16) for x in d.split()]
        decomp.append((cp, parts[0], parts[1] if len(parts) > 1 else 0))
        if len(parts) == 2 and unicodedata.normalize("NFC", chr(cp)) == chr(cp):
            comp.append((parts[0], parts[1], cp))
    comp.sort()
    print(f"""// unicode_nfc.h: Unicode NFC data (canonical combining classes, canonical decompositions,
// primary composites) and nfc() on UTF-8. Generated by scripts/gen/unicode_nfc.py from Python
// {sys.version_info.major}.{sys.version_info.minor}'s unicodedata, Unicode {unicodedata.unidata_version}; do not edit the tables.
#pragma once
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// (first, last, combining class) for every class other than 0
static const uint32_t NFC_CCC[][3] = {{
{rows(ccc, lambda r: f"{{0x{r[0]:X}, 0x{r[1]:X}, {r[2]}}},", 5)}
}};

// (code point, first, second or 0): canonical decompositions, one level, sorted
static const uint32_t NFC_DECOMP[][3] = {{
{rows(decomp, lambda r: f"{{0x{r[0]:X}, 0x{r[1]:X}, 0x{r[2]:X}}},", 4)}
}};

// (first, second, composite): the pairs NFC composes, sorted
static const uint32_t NFC_COMP[][3] = {{
{rows(comp, lambda r: f"{{0x{r[0]:X}, 0x{r[1]:X}, 0x{r[2]:X}}},", 4)}
}};""" + CODE)


if __name__ == "__main__":
    main()
