// peft.h: LoRA adapters in the Hugging Face PEFT layout, out and in. adapter_model.safetensors
// holds base_model.model.<module path>.lora_A.weight [r, in] and .lora_B.weight [out, r];
// adapter_config.json says peft_type LORA, r, lora_alpha, target_modules, task_type, and what the
// adapter computes (use_rslora: scale lora_alpha/sqrt(r) instead of lora_alpha/r). Reading is strict
// (docs/formats.md, PEFT adapters): an option that changes the math and is not implemented, an
// unknown key, or a tensor the run would not read is refused in one line naming it.
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
static void peft_save_ex(const char* dir, const PeftEntry* e, int n, const PeftExtra* extra, int nextra, int rank,
                         float alpha, int rslora, float dropout, const char* task_type, const char* base_model,
                         const char* const* target_modules, int ntm, const char* modules_to_save,
                         const char* bias_mode) {
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
    // every option that changes the math, written out (PEFT's defaults where ours are the same), so
    // that the file says what the adapter computes whatever defaults its reader has
    fprintf(a.f, ",\n  \"r\": %d,\n  \"lora_alpha\": %g,\n  \"use_rslora\": %s,\n  \"lora_dropout\": %g,\n"
                 "  \"bias\": \"%s\",\n  \"fan_in_fan_out\": false,\n  \"use_dora\": false,\n"
                 "  \"layers_to_transform\": null,\n  \"layers_pattern\": null,\n  \"rank_pattern\": {},\n"
                 "  \"alpha_pattern\": {},\n  \"init_lora_weights\": true,\n"
                 "  \"inference_mode\": true,\n  \"base_model_name_or_path\": ",
            rank, alpha, rslora ? "true" : "false", dropout, bias_mode);
    json_write_string(a.f, base_model ? base_model : "");
    fprintf(a.f, ",\n  \"target_modules\": [");
    for (int i = 0; i < ntm; i++) { fprintf(a.f, "%s", i ? ", " : ""); json_write_string(a.f, target_modules[i]); }
    fprintf(a.f, "],\n  \"modules_to_save\": %s\n}\n", modules_to_save ? modules_to_save : "null");
    atomic_commit(&a);
    free(path);
}

static void peft_save(const char* dir, const PeftEntry* e, int n, const PeftExtra* extra, int nextra, int rank,
                      float alpha, int rslora, float dropout, const char* task_type, const char* base_model,
                      const char* const* target_modules, int ntm, const char* modules_to_save) {
    peft_save_ex(dir, e, n, extra, nextra, rank, alpha, rslora, dropout, task_type, base_model, target_modules, ntm,
                 modules_to_save, "none");
}

// Tensor "base_model.model.<module>.<what>" of an adapter file, or NULL.
static const StTensor* peft_find(const StFile* f, const char* module, const char* what) {
    char name[200];
    snprintf(name, sizeof(name), "base_model.model.%s.%s", module, what);
    return st_find(f, name);
}

// ---- reading ----------------------------------------------------------------------------------

// What a trainer reads from an adapter besides each entry's lora_A and lora_B (lists end with NULL;
// a NULL list is empty), so that the loader can refuse what the run would pass over.
typedef struct {
    const char* const* saved_modules;  // modules_to_save names it accepts (ViT: the head, "classifier")
    const char* const* extra_tensors;  // whole tensors it reads (ViT: base_model.model.classifier.weight, .bias)
    const char* const* bias_modes;     // PEFT "bias" values it applies ("none"; ViT also "lora_only")
    int module_biases;                 // it reads each adapted module's bias when present (peft_module_bias)
} PeftReads;

static int peft_in_list(const char* const* list, const char* s) {
    for (; list && *list; list++)
        if (!strcmp(*list, s)) return 1;
    return 0;
}

// Options of PEFT's LoraConfig (0.13, and keys of later versions) that change what the adapter
// computes unless they hold their default: null, false, {} or [] (or are absent).
typedef struct {
    const char* key;
    const char* what;  // what a non-default value means, for the message
} PeftOption;

static const PeftOption peft_default_only[] = {
    {"fan_in_fan_out", "weights stored transposed, as for GPT-2's Conv1D"},
    {"use_dora", "DoRA: a learned magnitude rescales every output"},
    {"layers_to_transform", "adapters on a subset of the layers"},
    {"layers_pattern", "the layer naming of layers_to_transform"},
    {"rank_pattern", "a rank per module"},
    {"alpha_pattern", "a lora_alpha per module"},
    {"exclude_modules", "modules taken out of target_modules"},
    {"megatron_config", "Megatron's parallel linears"},
    {"loftq_config", "LoftQ: the adapter pairs with a quantized residual of the base weights"},
    {"eva_config", "EVA's data-driven initialisation"},
    {"corda_config", "CorDA: the adapter pairs with a residual of the base weights"},
    {"layer_replication", "base layers repeated"},
    {"lora_bias", "a bias on lora_B"},
    {"trainable_token_indices", "retrained rows of the embedding"},
    {"use_qalora", "QA-LoRA's pooled adapter input"},
    {"target_parameters", "adapters on parameters instead of modules"},
    {"enable_lora", "adapters on parts of a fused linear"},
    {"merge_weights", "loralib's weight merging"},
};

// Keys that leave the math to the tensors: bookkeeping, or settings of training only. Any value.
static const char* const peft_neutral_keys[] = {
    "task_type", "base_model_name_or_path", "revision", "inference_mode", "auto_mapping", "target_modules",
    "lora_dropout", "megatron_core", "qalora_group_size", "peft_version", "runtime_config", NULL};

static int peft_is_default(const Json* v) {
    return v->type == JSON_NULL || (v->type == JSON_BOOL && !v->boolean) ||
           ((v->type == JSON_ARRAY || v->type == JSON_OBJECT) && v->count == 0);
}

// modules_to_save: null, [] or names the trainer reads; "bias": a mode it applies.
static void peft_check_reads(const Json* j, const char* path, const PeftReads* reads) {
    const Json* ms = json_get(j, "modules_to_save");
    int count = !ms || ms->type == JSON_NULL ? 0 : ms->type == JSON_ARRAY ? ms->count : 1;
    for (int i = 0; i < count; i++) {
        const Json* m = ms->type == JSON_ARRAY ? &ms->items[i] : ms;
        if (m->type != JSON_STRING) fail("%s: modules_to_save must be null, a string or a list of strings", path);
        const char* head = reads->saved_modules ? reads->saved_modules[0] : NULL;
        if (!peft_in_list(reads->saved_modules, m->string))
            fail("%s: modules_to_save names \"%s\", a whole module this run does not read (only the LoRA pairs%s%s "
                 "are): refused", path, m->string, head ? " and " : "", head ? head : "");
    }
    const Json* b = json_get(j, "bias");
    const char* other = reads->bias_modes[1];
    if (b && b->type != JSON_NULL && (b->type != JSON_STRING || !peft_in_list(reads->bias_modes, b->string)))
        fail("%s: bias \"%s\" is not applied by this run (it applies bias \"%s\"%s%s%s): refused", path,
             b->type == JSON_STRING ? b->string : "(not a string)", reads->bias_modes[0], other ? " or \"" : "",
             other ? other : "", other ? "\"" : "");
}

// Every key of adapter_config.json is one this loader knows, and none asks for math it lacks.
static void peft_check_options(const Json* j, const char* path, const PeftReads* reads) {
    static const char* const handled[] = {"peft_type", "r", "lora_alpha", "use_rslora", "modules_to_save", "bias",
                                          "init_lora_weights", NULL};
    for (int i = 0; i < j->count; i++) {
        const char* k = j->keys[i];
        if (peft_in_list(handled, k) || peft_in_list(peft_neutral_keys, k)) continue;
        size_t o = 0, no = sizeof(peft_default_only) / sizeof(peft_default_only[0]);
        while (o < no && strcmp(peft_default_only[o].key, k) != 0) o++;
        if (o == no)
            fail("%s: unknown key \"%s\" (an option of another PEFT method or version may change what the adapter "
                 "computes: refused)", path, k);
        if (!peft_is_default(&j->items[i]))
            fail("%s: %s is set (%s), which this loader does not implement: refused (it reads plain LoRA, with %s "
                 "null, false or empty)", path, k, peft_default_only[o].what, k);
    }
    const Json* init = json_get(j, "init_lora_weights");
    if (init && init->type != JSON_BOOL && !(init->type == JSON_STRING && !strcmp(init->string, "gaussian")))
        fail("%s: init_lora_weights \"%s\": initialisations other than true, false and \"gaussian\" may pair the "
             "adapter with modified base weights (PiSSA, OLoRA, LoftQ, CorDA): refused", path,
             init->type == JSON_STRING ? init->string : "?");
    peft_check_reads(j, path, reads);
}

// Reads adapter_config.json of `dir` and checks it against the run: peft_type, the options
// (peft_check_options), r, lora_alpha and use_rslora equal to --lora-rank, --lora-alpha and
// --lora-rslora (the flags set the scale; an adapter of another scale would be silently rescaled).
static void peft_read_config(const char* dir, int rank, float alpha, int rslora, const PeftReads* reads) {
    char* path = path_join(dir, "adapter_config.json");
    size_t len;
    char* text = read_file(path, &len);
    Json j = json_parse(text, len, path);
    if (j.type != JSON_OBJECT) fail("%s: expected a JSON object", path);
    const char* type = json_string_or(&j, "peft_type", "");
    if (strcmp(type, "LORA") != 0) fail("%s: peft_type is \"%s\", expected \"LORA\"", path, type);
    peft_check_options(&j, path, reads);
    int r = json_int_req(&j, "r", path);
    if (r != rank) fail("%s: adapter rank r=%d, but --lora-rank is %d", path, r, rank);
    float a = (float)json_number_req(&j, "lora_alpha", path);
    if (a != alpha) fail("%s: adapter has lora_alpha %g, but --lora-alpha is %g", path, a, alpha);
    const Json* rs = json_get(&j, "use_rslora");
    if (rs && rs->type != JSON_BOOL && rs->type != JSON_NULL) fail("%s: use_rslora must be true or false", path);
    int use_rslora = rs && rs->type == JSON_BOOL && rs->boolean;
    if (use_rslora && !rslora)
        fail("%s: use_rslora is true (scale lora_alpha/sqrt(r)), but --lora-rslora is not given: give it, so that the "
             "run uses the adapter's scale", path);
    if (!use_rslora && rslora)
        fail("%s: use_rslora is false (scale lora_alpha/r), but --lora-rslora is given: drop it, so that the run uses "
             "the adapter's scale", path);
    json_free(&j);
    free(text);
    free(path);
}

// base_model.model.<module>.<part>.weight under either name PEFT saves it with (without, or with,
// the adapter name "default"); both present would be ambiguous and are refused.
static const StTensor* peft_find_part(const StFile* f, const char* module, const char* part) {
    char a[256], b[256];
    snprintf(a, sizeof(a), "base_model.model.%s.%s.weight", module, part);
    snprintf(b, sizeof(b), "base_model.model.%s.%s.default.weight", module, part);
    const StTensor *ta = st_find(f, a), *tb = st_find(f, b);
    if (ta && tb) fail("%s: holds both \"%s\" and \"%s\" (ambiguous: which one is the adapter?)", f->path, a, b);
    return ta ? ta : tb;
}

// The bias of an adapted module saved with the adapter (PEFT bias "lora_only"), or NULL: named
// "<module>.base_layer.bias" (PEFT 0.7 on) or "<module>.bias" (before; ours writes both, equal).
// Both present and different are ambiguous and refused.
static const StTensor* peft_module_bias(const StFile* f, const char* module) {
    char a[256], b[256];
    snprintf(a, sizeof(a), "base_model.model.%s.base_layer.bias", module);
    snprintf(b, sizeof(b), "base_model.model.%s.bias", module);
    const StTensor *ta = st_find(f, a), *tb = st_find(f, b);
    if (ta && tb && (ta->dtype != tb->dtype || ta->nbytes != tb->nbytes || memcmp(ta->data, tb->data, ta->nbytes) != 0))
        fail("%s: \"%s\" and \"%s\" differ (ambiguous: which one is the bias?)", f->path, a, b);
    return ta ? ta : tb;
}

// Marks the biases of the adapted modules as read (both names, when the file has both).
static void peft_mark_module_biases(const StFile* f, const PeftEntry* e, int n, char* used) {
    char name[256];
    for (int k = 0; k < n; k++) {
        if (!peft_module_bias(f, e[k].module)) continue;
        for (int v = 0; v < 2; v++) {
            const char* fmt = v ? "base_model.model.%s.bias" : "base_model.model.%s.base_layer.bias";
            snprintf(name, sizeof(name), fmt, e[k].module);
            const StTensor* t = st_find(f, name);
            if (t) used[t - f->tensors] = 1;
        }
    }
}

// Every tensor of the adapter file is one the run reads: a LoRA pair or bias marked in used[], or
// one of reads->extra_tensors. Anything else (the pair of a module outside --lora-targets, DoRA's
// magnitudes, another module's weights) would be passed over, computing something other than the
// adapter, and is refused naming it.
static void peft_check_all_read(const StFile* f, const char* used, const PeftReads* reads) {
    for (int i = 0; i < f->count; i++)
        if (!used[i] && !peft_in_list(reads->extra_tensors, f->tensors[i].name))
            fail("%s: tensor \"%s\" is not one this run reads (the adapter of a module outside --lora-targets, or a "
                 "part of another method): refused, since passing over it would compute something other than the "
                 "adapter", f->path, f->tensors[i].name);
}

// Loads an adapter directory into the entries' A/B (re-applying the merge for --ms-lora merged),
// after checking adapter_config.json against the run (peft_read_config). Entries missing from the
// file are an error, and so is a tensor the run would not read (peft_check_all_read).
static void peft_load(const char* dir, const PeftEntry* e, int n, int rank, float alpha, int rslora,
                      const PeftReads* reads) {
    peft_read_config(dir, rank, alpha, rslora, reads);
    char* st_path = path_join(dir, "adapter_model.safetensors");
    StFile f;
    st_open(&f, st_path);
    char* used = (char*)xcalloc(f.count + 1, 1);
    for (int i = 0; i < n; i++) {
        Linear* L = (Linear*)e[i].L;
        const StTensor* ta = peft_find_part(&f, e[i].module, "lora_A");
        const StTensor* tb = peft_find_part(&f, e[i].module, "lora_B");
        if (!ta || !tb)
            fail("%s: no LoRA weights for module %s (adapter trained with other --lora-targets?)", st_path,
                 e[i].module);
        used[ta - f.tensors] = used[tb - f.tensors] = 1;
        int64_t sa[2] = {rank, L->in}, sb[2] = {L->out, rank};
        st_check_shape(ta, 2, sa);
        st_check_shape(tb, 2, sb);
        float* tmp = (float*)xmalloc(sizeof(float) * rank * L->in);
        st_to_f32(ta, tmp);
        peft_scale_columns(L->A, tmp, e[i].gamma, rank, L->in, 0, e[i].module);
        st_to_f32(tb, L->B);
        free(tmp);
    }
    if (reads->module_biases) peft_mark_module_biases(&f, e, n, used);
    peft_check_all_read(&f, used, reads);
    free(used);
    st_close(&f);
    free(st_path);
}

// The bias an adapter carries for a module (either name of peft_put_bias) into out [n], fp32;
// 0 when it carries none.
static int peft_read_bias(const StFile* f, const char* module, float* out, int64_t n) {
    const StTensor* t = peft_module_bias(f, module);
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
