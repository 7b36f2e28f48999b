// test/unit/formats.cu: the file formats: safetensors written and read, bf16/f16 conversions,
// CRC-32, the JSON reader.
#include "unit.h"
#include "../../llmc/formats/json.h"
#include "../../llmc/formats/safetensors.h"

// ---- formats -------------------------------------------------------------------------------

void test_safetensors_roundtrip(void) {
    const char* path = "test/tmp_units.safetensors";
    float a[6] = {1, -2, 3.5f, 0, 1e-3f, -7};
    int32_t b[3] = {7, -1, 123456};
    StWriter w;
    memset(&w, 0, sizeof(w));
    int64_t sa[2] = {2, 3}, sb[1] = {3};
    st_writer_add(&w, "a", ST_F32, 2, sa, a);
    st_writer_add(&w, "b.x", ST_I32, 1, sb, b);
    st_writer_save(&w, path, "\"format\":\"pt\"");
    st_writer_free(&w);
    StFile f;
    st_open(&f, path);
    const StTensor* ta = st_find(&f, "a");
    const StTensor* tb = st_find(&f, "b.x");
    int ok = f.count == 2 && ta && tb && ta->ndim == 2 && ta->shape[1] == 3 && memcmp(ta->data, a, sizeof(a)) == 0 && tb->dtype == ST_I32 &&
             memcmp(tb->data, b, sizeof(b)) == 0;
    st_close(&f);
    remove(path);
    check(ok, "safetensors write then read gives the same tensors", 0);
    // bf16/f16 conversion of exactly representable values
    uint16_t h1 = f32_to_bf16(-3.5f), h2 = 0x3C00 /* f16 1.0 */, h3 = 0x0001 /* f16 smallest subnormal */;
    int ok2 = bf16_to_f32(h1) == -3.5f && f16_to_f32(h2) == 1.0f && f16_to_f32(h3) == ldexpf(1.0f, -24) && f32_to_bf16(1.00390625f) == 0x3F80;
    // f32 -> f16 -> f32 against the exact rounding of random values (and the special cases)
    Rng r = rng_seeded(12, 0);
    int ok3 = f32_to_f16(65504.0f) == 0x7BFF && f32_to_f16(1e6f) == 0x7C00 && f32_to_f16(-0.0f) == 0x8000 &&
              f32_to_f16(ldexpf(1.0f, -24)) == 0x0001 && f32_to_f16(ldexpf(1.0f, -25)) == 0x0000 && f32_to_f16(1.0f + ldexpf(1.0f, -11)) == 0x3C00;
    for (int i = 0; i < 20000 && ok3; i++) {
        float x = rng_normal(&r) * ldexpf(1.0f, (int)rng_below(&r, 40) - 26);
        float y = f16_to_f32(f32_to_f16(x));
        // y must be a nearest half: no half lies strictly closer (the neighbours differ by one ulp)
        uint16_t hy = f32_to_f16(x);
        float up = f16_to_f32((uint16_t)(hy + 1)), dn = f16_to_f32((uint16_t)(hy - 1));
        if (fabsf(x) < 65504.0f && (fabsf(up - x) < fabsf(y - x) || ((hy & 0x7fff) && fabsf(dn - x) < fabsf(y - x)))) ok3 = 0;
    }
    check(ok2 && ok3, "bf16 / f16 conversions (round to nearest even, subnormals, overflow)", 0);
}

// CRC-32 against the standard check value (CRC-32/ISO-HDLC of "123456789" is cbf43926, the
// value zlib.crc32 gives), any split into updates giving the same value (the slicing-by-8 path
// and the byte path), and a flipped bit in a safetensors file's data refused by st_open's check.
void test_crc32(void) {
    const char* s = "123456789";
    int ok = crc32_of(s, 9) == 0xCBF43926u && crc32_of("", 0) == 0;
    unsigned char buf[1000];
    for (int i = 0; i < 1000; i++) buf[i] = (unsigned char)(i * 7 + 3);
    uint32_t whole = crc32_of(buf, sizeof(buf));
    for (int cut = 0; cut <= 1000 && ok; cut += 37) {
        Crc32 c;
        crc32_init(&c);
        crc32_update(&c, buf, cut);
        crc32_update(&c, buf + cut, 1000 - cut);
        ok = crc32_final(&c) == whole;
    }
    buf[500] ^= 1;
    ok = ok && crc32_of(buf, sizeof(buf)) != whole;
    const char* path = "test/tmp_units_crc.safetensors";
    float a[4] = {1, 2, 3, 4};
    int64_t sa[1] = {4};
    StWriter w;
    memset(&w, 0, sizeof(w));
    st_writer_add(&w, "a", ST_F32, 1, sa, a);
    st_writer_save(&w, path, "\"format\":\"pt\"");
    st_writer_free(&w);
    StFile f;
    st_open(&f, path);
    uint32_t rec = 0;
    ok = ok && st_recorded_crc(&f, &rec) && rec == crc32_of(a, sizeof(a));
    st_close(&f);
    remove(path);
    check(ok, "CRC-32: check value, split updates, a flipped bit; safetensors records its data's CRC", 0);
}

void test_json(void) {
    const char* text = "{\"a\": 3, \"b\": [1, 2.5e1, -3], \"s\": \"x\\n\\u00e9\", \"t\": true, \"n\": null, \"o\": {\"k\": \"v\"}}";
    Json j = json_parse(text, strlen(text), "inline");
    const Json* b = json_get(&j, "b");
    int ok = json_number_or(&j, "a", 0) == 3 && b && b->count == 3 && b->items[1].number == 25 && strcmp(json_string_or(&j, "s", ""), "x\n\xc3\xa9") == 0 &&
             json_bool_or(&j, "t", 0) == 1 && json_get(&j, "n")->type == JSON_NULL && strcmp(json_string_or(json_get(&j, "o"), "k", ""), "v") == 0;
    json_free(&j);
    check(ok, "JSON reader: numbers, strings with escapes, nesting, literals", 0);
}
