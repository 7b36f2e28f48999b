// bnb.h: reading a Hugging Face checkpoint that bitsandbytes saved in 4-bit NF4 (config.json's
// quantization_config: quant_method "bitsandbytes", load_in_4bit, bnb_4bit_quant_type "nf4").
// Each quantized linear weight W is stored as (bitsandbytes' QuantState.as_dict(packed=True)):
//   W.weight                                  U8 [ceil(n/2), 1]  packed codes (llmc/nf4.h's order)
//   W.weight.absmax                           U8 [ceil(n/64)]    with double quantization; else F32
//   W.weight.quant_map                        F32 [16]           the NF4 values
//   W.weight.nested_absmax                    F32 [ceil(n/64/256)]  (double quantization only)
//   W.weight.nested_quant_map                 F32 [256]          the dynamic map (likewise)
//   W.weight.quant_state.bitsandbytes__nf4    U8  JSON: quant_type, blocksize, dtype, shape, and
//                                             with double quantization nested_blocksize, nested_dtype, nested_offset
// Every field is checked against the weight's expected shape; anything else (fp4, another block
// size, a quant_map that is not NF4's, a missing or mis-sized tensor) fails in one line naming
// the file and the tensor. Other quantizers (GPTQ, AWQ, 8-bit) are refused from config.json.
// The format's math is llmc/nf4.h's; this header only reads and checks.
#pragma once
#include "../common.h"
#include "json.h"
#include "safetensors.h"
#include "../nf4.h"

// 1 when model_dir/config.json declares a bitsandbytes 4-bit NF4 checkpoint, 0 when it declares
// no quantization; any other quantization fails.
static int bnb_config_nf4(const char* model_dir) {
    char* path = path_join(model_dir, "config.json");
    size_t n;
    char* text = read_file(path, &n);
    Json j = json_parse(text, n, path);
    const Json* q = json_get(&j, "quantization_config");
    int nf4 = 0;
    if (q && q->type != JSON_NULL) {
        const char* method = json_string_or(q, "quant_method", "");
        if (strcmp(method, "bitsandbytes") != 0)
            fail(
                "%s: quantization_config.quant_method \"%s\" is not supported (only bitsandbytes 4-bit NF4 checkpoints "
                "are read; "
                "GPTQ, AWQ and others are not)",
                path, method);
        if (!json_bool_or(q, "load_in_4bit", 0))
            fail(
                "%s: quantization_config is bitsandbytes but not load_in_4bit (8-bit checkpoints are not supported; "
                "NF4 only)",
                path);
        const char* type = json_string_or(q, "bnb_4bit_quant_type", "fp4");  // bitsandbytes' default
        if (strcmp(type, "nf4") != 0)
            fail("%s: quantization_config.bnb_4bit_quant_type \"%s\" is not supported (only nf4)", path, type);
        nf4 = 1;
    }
    json_free(&j);
    free(text);
    free(path);
    return nf4;
}

// One quantized weight as stored: its byte tensors are pointers into the mapped files; its float
// tensors are copies (`floats`, owned, bnb_free), since a safetensors file aligns nothing: an F32
// tensor that follows an odd-sized U8 one (the codes of a weight with an odd element count, say)
// starts at an odd offset, where a float load is misaligned (undefined behaviour; UBSan stops).
typedef struct {
    int64_t n;
    const uint8_t* codes;
    const uint8_t* qabsmax;    // double quantization: 8-bit absmax codes; else NULL
    const float* absmax;       // no double quantization: fp32 absmax; else NULL
    const float* nested;       // nested_absmax (double quantization)
    const float* dyn;          // nested_quant_map [256] (double quantization)
    float offset;              // nested_offset (double quantization)
    float* floats;             // owned: quant_map [16], then absmax, or nested_absmax and nested_quant_map
} BnbWeight;

static void bnb_free(BnbWeight* w) {
    free(w->floats);
    w->floats = NULL;
}

// The companion tensor name + suffix, required, with its dtype and element count.
static const StTensor* bnb_part(const StModel* sm, const char* name, const char* suffix, StDtype dtype, int64_t numel) {
    char full[320];
    snprintf(full, sizeof(full), "%s%s", name, suffix);
    const StTensor* t = st_model_find(sm, full);
    if (!t) fail("%s: bitsandbytes tensor \"%s\" lacks its quant state \"%s\"", sm->dir, name, full);
    if (t->dtype != dtype || st_numel(t) != numel)
        fail(
            "%s: bitsandbytes tensor \"%s\" is %s with %lld elements, expected %s with %lld (a corrupt or mismatched "
            "quant state)",
            t->file, full, st_dtype_name(t->dtype), (long long)st_numel(t), st_dtype_name(dtype), (long long)numel);
    return t;
}

// The companion F32 tensor name + suffix copied to `dst` (aligned memory, numel floats).
static const float* bnb_f32_part(const StModel* sm, const char* name, const char* suffix, int64_t numel, float* dst) {
    memcpy(dst, bnb_part(sm, name, suffix, ST_F32, numel)->data, sizeof(float) * numel);
    return dst;
}

// 1 when tensor `name` is stored in bitsandbytes' 4-bit layout (it has a packed quant state).
static int bnb_is_quantized(const StModel* sm, const char* name) {
    char full[320];
    snprintf(full, sizeof(full), "%s.quant_state.bitsandbytes__fp4", name);
    if (st_model_find(sm, full))
        fail("%s: tensor \"%s\" is bitsandbytes fp4, which is not supported (only nf4)", sm->dir, name);
    snprintf(full, sizeof(full), "%s.quant_state.bitsandbytes__nf4", name);
    if (st_model_find(sm, full)) return 1;
    snprintf(full, sizeof(full), "%s.absmax", name);
    return st_model_find(sm, full) != NULL;  // a quant state without its blob: bnb_read names what is missing
}

// Every float of a quant state must be finite, and so must each block's absmax as dequantized
// (dyn * nested_absmax + nested_offset can overflow from finite parts): a NaN or Inf there makes
// NaN weights, which would evaluate to "loss nan" or export as NaN without a word.
static void bnb_check_finite(const StModel* sm, const char* name, const char* suffix, const float* v, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        if (isfinite(v[i])) continue;
        char full[320];
        snprintf(full, sizeof(full), "%s%s", name, suffix);
        const char* file = st_model_require(sm, full)->file;
        fail("%s: bitsandbytes tensor \"%s\" holds a non-finite value (%g) at element %lld", file, full, v[i],
             (long long)i);
    }
}

static void bnb_check_quant_state(const StModel* sm, const char* name, const BnbWeight* w) {
    int64_t nb = nf4_blocks(w->n);
    if (w->absmax) { bnb_check_finite(sm, name, ".absmax", w->absmax, nb); return; }
    bnb_check_finite(sm, name, ".nested_absmax", w->nested, nf4_nested_blocks(w->n));
    bnb_check_finite(sm, name, ".nested_quant_map", w->dyn, NF4_DYN_SIZE);
    for (int64_t b = 0; b < nb; b++) {
        float a = nf4_absmax_at(w->qabsmax, w->nested, w->offset, w->dyn, b);
        if (!isfinite(a))
            fail("%s: bitsandbytes tensor \"%s\": the absmax of block %lld dequantizes to %g (nested_absmax x "
                 "nested_quant_map + nested_offset overflows float32)", st_model_require(sm, name)->file, name,
                 (long long)b, a);
    }
}

// Reads and checks the quantized weight `name` of shape [rows, cols].
static BnbWeight bnb_read(const StModel* sm, const char* name, int64_t rows, int64_t cols) {
    BnbWeight w;
    memset(&w, 0, sizeof(w));
    w.n = rows * cols;
    int64_t nb = nf4_blocks(w.n);
    char full[320], source[640];
    snprintf(full, sizeof(full), "%s.quant_state.bitsandbytes__nf4", name);
    const StTensor* qs = st_model_find(sm, full);
    if (!qs) fail("%s: bitsandbytes tensor \"%s\" lacks its quant state \"%s\"", sm->dir, name, full);
    if (qs->dtype != ST_U8)
        fail("%s: \"%s\" is %s, expected U8 (a JSON blob)", qs->file, full, st_dtype_name(qs->dtype));
    snprintf(source, sizeof(source), "%s: \"%s\"", qs->file, full);
    Json j = json_parse((const char*)qs->data, qs->nbytes, source);
    if (j.type != JSON_OBJECT) fail("%s: expected a JSON object", source);
    const char* type = json_string_or(&j, "quant_type", "");
    if (strcmp(type, "nf4") != 0) fail("%s: \"%s\" has quant_type \"%s\", expected nf4", qs->file, full, type);
    if (json_number_or(&j, "blocksize", 0) != NF4_BLOCK)
        fail("%s: \"%s\" has blocksize %g, expected %d", qs->file, full, json_number_or(&j, "blocksize", 0), NF4_BLOCK);
    const Json* shape = json_get(&j, "shape");
    if (!shape || shape->type != JSON_ARRAY || shape->count != 2 || shape->items[0].number != rows ||
        shape->items[1].number != cols)
        fail(
            "%s: \"%s\" does not record the shape [%lld, %lld] the model config gives this weight (a mismatched quant "
            "state)",
            qs->file, full, (long long)rows, (long long)cols);
    const StTensor* codes = bnb_part(sm, name, "", ST_U8, (w.n + 1) / 2);
    w.codes = codes->data;
    int64_t nn = nf4_nested_blocks(w.n);
    w.floats = (float*)xmalloc(sizeof(float) * (16 + (nb > nn + NF4_DYN_SIZE ? nb : nn + NF4_DYN_SIZE)));
    const float* qmap = bnb_f32_part(sm, name, ".quant_map", 16, w.floats);
    static const float nf4[16] = NF4_VALUES;
    if (memcmp(qmap, nf4, sizeof(nf4)) != 0)
        fail("%s: \"%s.quant_map\" is not the NF4 code table (another 4-bit type?)", sm->dir, name);
    if (json_get(&j, "nested_offset")) {  // double quantization
        if (json_number_or(&j, "nested_blocksize", 0) != NF4_ABSMAX_BLOCK)
            fail("%s: \"%s\" has nested_blocksize %g, expected %d", qs->file, full,
                 json_number_or(&j, "nested_blocksize", 0), NF4_ABSMAX_BLOCK);
        double offset = json_number_req(&j, "nested_offset", full);
        w.offset = (float)offset;
        if (!isfinite(w.offset)) fail("%s: \"%s\" has nested_offset %g, not a finite float32", qs->file, full, offset);
        w.qabsmax = bnb_part(sm, name, ".absmax", ST_U8, nb)->data;
        w.nested = bnb_f32_part(sm, name, ".nested_absmax", nn, w.floats + 16);
        w.dyn = bnb_f32_part(sm, name, ".nested_quant_map", NF4_DYN_SIZE, w.floats + 16 + nn);
    } else {
        w.absmax = bnb_f32_part(sm, name, ".absmax", nb, w.floats + 16);
    }
    json_free(&j);
    bnb_check_quant_state(sm, name, &w);
    return w;
}

// The fp32 weights (bitsandbytes' dequantization, llmc/nf4.h's math with the stored maps).
static void bnb_dequantize(const BnbWeight* w, float* out) {
    static const float nf4[16] = NF4_VALUES;
    for (int64_t b = 0; b < nf4_blocks(w->n); b++) {
        float a = w->qabsmax ? nf4_absmax_at(w->qabsmax, w->nested, w->offset, w->dyn, b) : w->absmax[b];
        for (int64_t i = b * NF4_BLOCK; i < w->n && i < (b + 1) * NF4_BLOCK; i++)
            out[i] = nf4[nf4_code_at(w->codes, i)] * a;
    }
}

// A double-quantized weight as it is, into llmc/nf4.h's layout (the bytes unchanged).
static void bnb_to_nf4(const BnbWeight* w, void* dst) {
    Nf4View q = nf4_view(dst, w->n);
    memcpy(q.codes, w->codes, (size_t)((w->n + 1) / 2));
    memcpy(q.qabsmax, w->qabsmax, (size_t)q.nb);
    memcpy(q.nested, w->nested, sizeof(float) * q.nn);
    *q.offset = w->offset;
}

// The names of a quantized weight's companion tensors, which an export of the dequantized model drops.
static int bnb_is_quant_state_name(const char* name) {
    static const char* const suffixes[] = {".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map",
                                           ".quant_state.bitsandbytes__nf4"};
    size_t n = strlen(name);
    for (int i = 0; i < 5; i++) {
        size_t k = strlen(suffixes[i]);
        if (n > k && strcmp(name + n - k, suffixes[i]) == 0) return 1;
    }
    return 0;
}

// config.json of model_dir without its quantization_config, to dst (a dequantized export).
static void bnb_write_config_unquantized(const char* model_dir, const char* dst) {
    char* path = path_join(model_dir, "config.json");
    size_t n;
    char* text = read_file(path, &n);
    Json j = json_parse(text, n, path);
    for (int i = 0; i < j.count; i++)
        if (!strcmp(j.keys[i], "quantization_config")) {
            json_free(&j.items[i]);
            free(j.keys[i]);
            memmove(j.items + i, j.items + i + 1, sizeof(Json) * (j.count - i - 1));
            memmove(j.keys + i, j.keys + i + 1, sizeof(char*) * (j.count - i - 1));
            j.count--;
            break;
        }
    AtomicFile a = atomic_open(dst);
    json_dump(a.f, &j, 0);
    fputc('\n', a.f);
    atomic_commit(&a);
    json_free(&j);
    free(text);
    free(path);
}
