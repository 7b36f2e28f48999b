// checksum.h: CRC-32 (the IEEE polynomial of zlib, gzip and PNG: reflected 0xEDB88320, start and
// final xor 0xFFFFFFFF), the integrity check that saved files carry: train_state.bin in its last
// four bytes, safetensors files we write in their header's __metadata__ (st_writer_save). A CRC
// catches every single-bit flip, every burst of up to 32 bits and any one changed float, which
// is what a bad sector, a torn copy or a hand edit does; zlib.crc32 computes the same value, so a
// test checks it independently. Slicing by 8 bytes: a few GB/s, small beside the file I/O.
#pragma once
#include <stdint.h>
#include <string.h>

typedef struct {
    uint32_t table[8][256];  // table[k][b]: the CRC of byte b followed by k zero bytes
    uint32_t crc;            // running value, before the final xor
} Crc32;

static void crc32_init(Crc32* c) {
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t r = b;
        for (int i = 0; i < 8; i++) r = (r >> 1) ^ (0xEDB88320u & (0u - (r & 1)));
        c->table[0][b] = r;
    }
    for (int k = 1; k < 8; k++)
        for (int b = 0; b < 256; b++) c->table[k][b] = (c->table[k - 1][b] >> 8) ^ c->table[0][c->table[k - 1][b] & 0xff];
    c->crc = 0xFFFFFFFFu;
}

// Feeds n bytes (any split into calls gives the same value; little-endian hosts).
static void crc32_update(Crc32* c, const void* data, size_t n) {
    const uint8_t* p = (const uint8_t*)data;
    uint32_t crc = c->crc;
    const uint32_t(*t)[256] = c->table;
    for (; n >= 8; n -= 8, p += 8) {
        uint32_t a, b;
        memcpy(&a, p, 4);
        memcpy(&b, p + 4, 4);
        a ^= crc;
        crc = t[7][a & 0xff] ^ t[6][(a >> 8) & 0xff] ^ t[5][(a >> 16) & 0xff] ^ t[4][a >> 24] ^ t[3][b & 0xff] ^ t[2][(b >> 8) & 0xff] ^
              t[1][(b >> 16) & 0xff] ^ t[0][b >> 24];
    }
    for (; n; n--, p++) crc = t[0][(crc ^ *p) & 0xff] ^ (crc >> 8);
    c->crc = crc;
}

static uint32_t crc32_final(const Crc32* c) { return c->crc ^ 0xFFFFFFFFu; }

// A fast 64-bit fingerprint of bytes, for identity rather than integrity (that is CRC-32's job):
// which base model and which data a saved run trained on, so that a resume onto another model or
// other data of the same shape is refused (train_state.h). Four independent lanes of a
// multiply-rotate mix, so it runs at memory speed; not meant to resist a deliberate collision.
typedef struct { uint64_t lane[4]; uint64_t bytes; } Fingerprint;

static uint64_t fp_mix(uint64_t h, uint64_t w) {
    h ^= w * 0x9E3779B97F4A7C15ull;
    h = (h << 31) | (h >> 33);
    return h * 0xC2B2AE3D27D4EB4Full;
}

static void fp_init(Fingerprint* f) {
    for (int i = 0; i < 4; i++) f->lane[i] = 0x243F6A8885A308D3ull + (uint64_t)i;
    f->bytes = 0;
}

// Feeds n bytes. The value depends on the bytes and on how they were split into calls: callers
// feed the same things in the same calls every time (a tensor's name, shape and data, say).
static void fp_update(Fingerprint* f, const void* data, size_t n) {
    const uint8_t* p = (const uint8_t*)data;
    uint64_t w[4];
    f->bytes += n;
    for (; n >= 32; n -= 32, p += 32) {
        memcpy(w, p, 32);
        for (int i = 0; i < 4; i++) f->lane[i] = fp_mix(f->lane[i], w[i]);
    }
    uint64_t tail[4] = {0, 0, 0, 0};
    memcpy(tail, p, n);
    for (int i = 0; i < 4; i++) f->lane[i] = fp_mix(f->lane[i], tail[i] ^ n);
}

static uint64_t fp_final(const Fingerprint* f) {
    uint64_t h = fp_mix(f->bytes, 0x5851F42D4C957F2Dull);
    for (int i = 0; i < 4; i++) h = fp_mix(h, f->lane[i]);
    return h;
}

// The CRC-32 of one buffer.
static uint32_t crc32_of(const void* data, size_t n) {
    Crc32 c;
    crc32_init(&c);
    crc32_update(&c, data, n);
    return crc32_final(&c);
}
