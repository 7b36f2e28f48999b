// peft.h: LoRA adapters in the Hugging Face PEFT layout, out and in. adapter_model.safetensors
// holds base_model.model.<module path>.lora_A.weight [r, in] and .lora_B.weight [out, r];
// adapter_config.json says peft_type LORA, r, lora_alpha, target_modules, task_type.
// Adapters are the original model's as they are, also under MS norms (llmc/linear.h: the adapter
// of a merged layer still sees gamma*z + beta). Only the paper's variant (--ms-lora merged) trains
// them in the merged input space; its entries carry gamma, and they are mapped back to the
// original model on the way out (A_orig = A diag(1/gamma), docs/architecture.md, the method) and
// forward again on the way in (A = A_orig diag(gamma)). Beside the adapters a file may carry the
// biases of the adapted modules (PEFT bias "lora_only") and modules saved whole (modules_to_save:
// ViT's new classifier), written as PeftExtra tensors and read back by name.
#pragma once
#include "../common.h"
#include "json.h"
#include "safetensors.h"
#include "../linear.h"

typedef struct {
    char module[160];      // Hugging Face module path, e.g. model.layers.3.self_attn.q_proj
    const Linear* L;
    const float* gamma;    // the merged norm's gamma (--ms-lora merged), or NULL
} PeftEntry;

typedef struct {           // a whole tensor saved alongside (ViT: the new classifier)
    char name[160];
    const float* data;
    int ndim;
    int64_t shape[2];
} PeftExtra;

// Appends the entry of linear L of block l when it carries an adapter: its Hugging Face module
// path "<prefix>.<l>.<module>" and the norm gamma MS merged into it (or NULL). Returns the count.
static int peft_add_entry(PeftEntry* e, int n, const Linear* L, const char* prefix, int l, const char* module, const float* gamma) {
    if (!L->A) return n;
    snprintf(e[n].module, sizeof(e[n].module), "%s.%d.%s", prefix, l, module);
    e[n].L = L;
    e[n].gamma = gamma;
    return n + 1;
}

// The bias of an adapted module, under both names PEFT has used: "<module>.bias" (before 0.7) and
// "<module>.base_layer.bias" (0.7 on, where the adapted layer wraps the original). Appends to
// extra (bias borrowed until the save); returns the count.
static int peft_put_bias(PeftExtra* extra, int n, const char* module, const float* bias, int64_t out) {
    static const char* const names[2] = {"%.150s.bias", "%.140s.base_layer.bias"};
    for (int v = 0; v < 2; v++) {
        snprintf(extra[n].name, sizeof(extra[n].name), names[v], module);
        extra[n].data = bias;
        extra[n].ndim = 1;
        extra[n].shape[0] = out;
        n++;
    }
    return n;
}

// A module saved whole (modules_to_save): "<module>.weight" [rows, cols] and "<module>.bias" [rows].
// Appends to extra (W and b borrowed until the save); returns the count.
static int peft_put_module_to_save(PeftExtra* extra, int n, const char* module, const float* W, const float* b,
                                   int64_t rows, int64_t cols) {
    snprintf(extra[n].name, sizeof(extra[n].name), "%.150s.weight", module);
    extra[n].data = W; extra[n].ndim = 2; extra[n].shape[0] = rows; extra[n].shape[1] = cols;
    n++;
    snprintf(extra[n].name, sizeof(extra[n].name), "%.150s.bias", module);
    extra[n].data = b; extra[n].ndim = 1; extra[n].shape[0] = rows;
    return n + 1;
}

// A [r, in] scaled per input column: out[:, j] = A[:, j] * (invert ? 1/gamma_j : gamma_j).
static void peft_scale_columns(float* out, const float* A, const float* gamma, int rank, int in, int invert, const char* module) {
    for (int j = 0; j < in; j++) {
        float g = gamma ? gamma[j] : 1.0f;
        if (invert && g == 0.0f)
            fail("cannot export the adapter of %s to the original model: its norm's gamma[%d] is 0, so the merged layer has no inverse "
                 "(train with --norm std, or use the merged-weights export)", module, j);
        float s = invert ? 1.0f / g : g;
        for (int i = 0; i < rank; i++) out[(int64_t)i * in + j] = A[(int64_t)i * in + j] * s;
    }
}

// task_type NULL writes null (PEFT has no task type for image classification). bias_mode is
// PEFT's "bias" field: "none", or "lora_only" when the extras carry the biases of the adapted
// modules (ViT under MS-LN with --ms-lora merged: the merged beta leaves a constant that only a
// bias can carry).
static void peft_save_ex(const char* dir, const PeftEntry* e, int n, const PeftExtra* extra, int nextra, int rank, float alpha,
                         float dropout, const char* task_type, const char* base_model, const char* const* target_modules, int ntm,
                         const char* modules_to_save, const char* bias_mode) {
    make_dirs(dir, "flag --out");
    StWriter w;
    memset(&w, 0, sizeof(w));
    char (*names)[200] = (char(*)[200])xmalloc(sizeof(*names) * (2 * n + nextra + 1));
    float** copies = (float**)xcalloc(n + 1, sizeof(float*));
    int k = 0;
    for (int i = 0; i < n; i++) {
        const Linear* L = e[i].L;
        copies[i] = (float*)xmalloc(sizeof(float) * rank * L->in);
        peft_scale_columns(copies[i], L->A, e[i].gamma, rank, L->in, 1, e[i].module);
        int64_t sa[2] = {rank, L->in}, sb[2] = {L->out, rank};
        snprintf(names[k], 200, "base_model.model.%s.lora_A.weight", e[i].module);
        st_writer_add(&w, names[k++], ST_F32, 2, sa, copies[i]);
        snprintf(names[k], 200, "base_model.model.%s.lora_B.weight", e[i].module);
        st_writer_add(&w, names[k++], ST_F32, 2, sb, L->B);
    }
    for (int i = 0; i < nextra; i++) {
        snprintf(names[k], 200, "base_model.model.%s", extra[i].name);
        st_writer_add(&w, names[k++], ST_F32, extra[i].ndim, extra[i].shape, extra[i].data);
    }
    char* path = path_join(dir, "adapter_model.safetensors");
    st_writer_save(&w, path, "\"format\":\"pt\"");
    free(path);
    st_writer_free(&w);
    for (int i = 0; i < n; i++) free(copies[i]);
    free(copies);
    free(names);
    path = path_join(dir, "adapter_config.json");
    AtomicFile a = atomic_open(path);
    fprintf(a.f, "{\n  \"peft_type\": \"LORA\",\n  \"task_type\": ");
    if (task_type) json_write_string(a.f, task_type);
    else fprintf(a.f, "null");
    fprintf(a.f, ",\n  \"r\": %d,\n  \"lora_alpha\": %g,\n  \"lora_dropout\": %g,\n"
                 "  \"bias\": \"%s\",\n  \"fan_in_fan_out\": false,\n  \"inference_mode\": true,\n  \"base_model_name_or_path\": ",
            rank, alpha, dropout, bias_mode);
    json_write_string(a.f, base_model ? base_model : "");
    fprintf(a.f, ",\n  \"target_modules\": [");
    for (int i = 0; i < ntm; i++) { fprintf(a.f, "%s", i ? ", " : ""); json_write_string(a.f, target_modules[i]); }
    fprintf(a.f, "],\n  \"modules_to_save\": %s\n}\n", modules_to_save ? modules_to_save : "null");
    atomic_commit(&a);
    free(path);
}

static void peft_save(const char* dir, const PeftEntry* e, int n, const PeftExtra* extra, int nextra, int rank, float alpha,
                      float dropout, const char* task_type, const char* base_model, const char* const* target_modules, int ntm,
                      const char* modules_to_save) {
    peft_save_ex(dir, e, n, extra, nextra, rank, alpha, dropout, task_type, base_model, target_modules, ntm, modules_to_save, "none");
}

// Tensor "base_model.model.<module>.<what>" of an adapter file, or NULL.
static const StTensor* peft_find(const StFile* f, const char* module, const char* what) {
    char name[200];
    snprintf(name, sizeof(name), "base_model.model.%s.%s", module, what);
    return st_find(f, name);
}

// Loads an adapter directory into the entries' A/B (re-applying the merge for --ms-lora merged). The
// adapter's rank must equal `rank`; entries missing from the file are an error.
static void peft_load(const char* dir, const PeftEntry* e, int n, int rank, float* alpha_out) {
    char* cfg_path = path_join(dir, "adapter_config.json");
    size_t len;
    char* text = read_file(cfg_path, &len);
    Json j = json_parse(text, len, cfg_path);
    const char* type = json_string_or(&j, "peft_type", "");
    if (strcmp(type, "LORA") != 0) fail("%s: peft_type is \"%s\", expected \"LORA\"", cfg_path, type);
    int r = json_int_req(&j, "r", cfg_path);
    if (r != rank) fail("%s: adapter rank r=%d, but --lora-rank is %d", cfg_path, r, rank);
    if (alpha_out) *alpha_out = (float)json_number_req(&j, "lora_alpha", cfg_path);
    json_free(&j);
    free(text);
    free(cfg_path);
    char* st_path = path_join(dir, "adapter_model.safetensors");
    StFile f;
    st_open(&f, st_path);
    for (int i = 0; i < n; i++) {
        Linear* L = (Linear*)e[i].L;
        // PEFT saves without the adapter name
        const char* a_names[2] = {"lora_A.weight", "lora_A.default.weight"};
        const char* b_names[2] = {"lora_B.weight", "lora_B.default.weight"};
        const StTensor *ta = NULL, *tb = NULL;
        for (int v = 0; v < 2 && !ta; v++) {
            ta = peft_find(&f, e[i].module, a_names[v]);
            tb = peft_find(&f, e[i].module, b_names[v]);
        }
        if (!ta || !tb) fail("%s: no LoRA weights for module %s (adapter trained with other --lora-targets?)", st_path, e[i].module);
        int64_t sa[2] = {rank, L->in}, sb[2] = {L->out, rank};
        st_check_shape(ta, 2, sa);
        st_check_shape(tb, 2, sb);
        float* tmp = (float*)xmalloc(sizeof(float) * rank * L->in);
        st_to_f32(ta, tmp);
        peft_scale_columns(L->A, tmp, e[i].gamma, rank, L->in, 0, e[i].module);
        st_to_f32(tb, L->B);
        free(tmp);
    }
    st_close(&f);
    free(st_path);
}

// The bias an adapter carries for a module (either name of peft_put_bias) into out [n], fp32;
// 0 when it carries none.
static int peft_read_bias(const StFile* f, const char* module, float* out, int64_t n) {
    const StTensor* t = peft_find(f, module, "base_layer.bias");
    if (!t) t = peft_find(f, module, "bias");
    if (!t) return 0;
    st_check_shape(t, 1, &n);
    st_to_f32(t, out);
    return 1;
}

// A module saved whole (peft_put_module_to_save) into W [rows, cols] and b [rows], fp32; 0 (and
// W, b untouched) when the adapter lacks its weight or its bias.
static int peft_read_module_to_save(const StFile* f, const char* module, float* W, float* b, int64_t rows,
                                    int64_t cols) {
    const StTensor* tw = peft_find(f, module, "weight");
    const StTensor* tb = peft_find(f, module, "bias");
    if (!tw || !tb) return 0;
    int64_t shape[2] = {rows, cols};
    st_check_shape(tw, 2, shape);
    st_check_shape(tb, 1, &rows);
    st_to_f32(tw, W);
    st_to_f32(tb, b);
    return 1;
}

// The rows of a module saved whole in the adapter directory dir (ViT: the classifier's classes),
// or 0 when it carries none.
static int peft_saved_module_rows(const char* dir, const char* module) {
    char* path = path_join(dir, "adapter_model.safetensors");
    StFile f;
    st_open(&f, path);
    const StTensor* w = peft_find(&f, module, "weight");
    int rows = w && w->ndim == 2 ? (int)w->shape[0] : 0;
    st_close(&f);
    free(path);
    return rows;
}
