// vit_io.h: what the ViT (llmc/models/vit.h) reads and writes: its config (config.json and
// preprocessor_config.json), the checkpoint's weights in (or random ones), fresh adapters and
// head, PEFT adapters out and in, the settings a resumed run must share, and the merged export
// (--export-merged, and the output of --full). The checkpoints' layouts and the rewriting of them
// are llmc/models/vit_checkpoint.h.
#pragma once
#include "vit.h"
#include "../formats/json.h"
#include "../formats/safetensors.h"
#include "../formats/peft.h"
#include "../rng.h"
#include "../vision/resample.h"
#include "../train/run_options.h"

// ----------------------------------------------------------------------------------------------
// Config: config.json of a Hugging Face ViT (ViTModel / ViTForImageClassification), and its
// preprocessor_config.json (llmc/vision/preprocessor.h; 0.5 / 0.5 when absent, the Hugging Face
// ViT default).

// image_size and patch_size sides: far beyond any ViT's 224-518 pixels; the limit keeps pixel counts
// far from overflow.
enum { MIN_SIDE = 1, MAX_SIDE = 16384 };

static void vit_config_load(VitConfig* c, const char* model_dir) {
    if (!dir_exists(model_dir)) fail("flag --model: %s is not a directory", model_dir);
    char* path = path_join(model_dir, "config.json");
    size_t n;
    char* text = read_file(path, &n);
    Json j = json_parse(text, n, path);
    memset(c, 0, sizeof(*c));
    // Another model's directory is named as such, not as a ViT missing image_size (timm's configs have
    // no model_type; Hugging Face's say "vit")
    const char* type = json_string_or(&j, "model_type", "vit");
    int llama_family = !strcmp(type, "llama") || !strcmp(type, "mistral") || !strcmp(type, "qwen2") ||
                       !strcmp(type, "qwen3") || !strcmp(type, "phi3");
    if (strcmp(type, "vit") != 0)
        fail("%s: model_type \"%.60s\" is not a ViT (train_vit reads model_type vit%s)", path, type,
             llama_family ? "; a LLaMA-family model is train_llama's" : "");
    // Ranges: every real ViT lies well inside (ViT-22B: hidden 6144, intermediate 24576, 48 layers,
    // 48 heads); beyond them a config is corrupt, and the limits keep size products far from overflow.
    c->dim = json_int_in(&j, "hidden_size", path, 1, 1 << 16);
    c->hidden = json_int_in(&j, "intermediate_size", path, 1, 1 << 18);
    c->layers = json_int_in(&j, "num_hidden_layers", path, 1, 1024);
    c->heads = json_int_in(&j, "num_attention_heads", path, 1, 1024);
    if (c->dim % c->heads)
        fail("%s: num_attention_heads (%d) does not divide hidden_size (%d)", path, c->heads, c->dim);
    c->head_dim = c->dim / c->heads;
    json_hw_pair(&j, "image_size", path, MIN_SIDE, MAX_SIDE, &c->image_h, &c->image_w);
    json_hw_pair(&j, "patch_size", path, MIN_SIDE, MAX_SIDE, &c->patch_h, &c->patch_w);
    if (c->image_h % c->patch_h || c->image_w % c->patch_w)
        fail("%s: image_size %dx%d is not a multiple of patch_size %dx%d", path, c->image_h, c->image_w, c->patch_h,
             c->patch_w);
    c->channels = json_get(&j, "num_channels") ? json_int_in(&j, "num_channels", path, 1, 3) : 3;
    if (c->channels != 1 && c->channels != 3) fail("%s: num_channels %d, expected 1 or 3", path, c->channels);
    // a non-positive epsilon divides by zero on a constant row: a NaN later blamed on --lr or the data
    c->norm_eps = json_positive_float(json_number_opt(&j, "layer_norm_eps", path, 1e-12), "layer_norm_eps", path);
    c->qkv_bias = json_bool_or(&j, "qkv_bias", 1);
    const char* act = json_string_or(&j, "hidden_act", "gelu");
    if (strcmp(act, "gelu") == 0) c->gelu_tanh = 0;
    else if (strcmp(act, "gelu_pytorch_tanh") == 0 || strcmp(act, "gelu_new") == 0) c->gelu_tanh = 1;
    else fail("%s: hidden_act \"%s\" is not supported (expected gelu, gelu_pytorch_tanh or gelu_new)", path, act);
    json_free(&j);
    free(text);
    free(path);
    vit_preprocessor_load(&c->pre, model_dir, c->channels);  // llmc/vision/preprocessor.h
    memcpy(c->mean, c->pre.mean, sizeof(c->mean));
    memcpy(c->std, c->pre.std, sizeof(c->std));
}

// ----------------------------------------------------------------------------------------------
// Weights: Hugging Face ViT layout (vit.embeddings..., vit.encoder.layer.N...; also without the
// "vit." prefix, as ViTModel saves it) or timm layout (blocks.N.attn.qkv fused), told apart by
// their key names and named by llmc/models/vit_checkpoint.h, read (any float dtype) into fp32 on
// the host. The classifier in the checkpoint, if any, is ignored: the head is new. The position
// embedding is interpolated to the fine-tuning grid, and MS-LN merges each norm's gamma and beta
// into every linear that consumes it, once, here; then each tensor goes to the backend (bf16 on
// CUDA). The linears' fp32 W and bias stay on the host as well (on the CPU they are the
// backend's): adapters and the export are computed from them.

static void read_1d(const StModel* sm, const char* name, int64_t n, float* dst) {
    st_model_read_f32(sm, name, 1, &n, dst);
}
static void read_2d(const StModel* sm, const char* name, int64_t rows, int64_t cols, float* dst) {
    int64_t s[2] = {rows, cols};
    st_model_read_f32(sm, name, 2, s, dst);
}

// The checkpoint's position embedding [1, 1 + gh0*gw0, d] -> pos [T, d] (host): the class token's
// row as is, the patch grid resized bicubically (align_corners=False) when the grid differs, as
// Hugging Face's interpolate_pos_encoding does (timm also antialiases when shrinking; we do not).
static void vit_load_pos_embed(const Vit* m, const StModel* sm, const char* name, float* pos) {
    const VitConfig* c = &m->cfg;
    int gh0 = c->image_h / c->patch_h, gw0 = c->image_w / c->patch_w;
    int64_t rows = 1 + (int64_t)gh0 * gw0, d = c->dim;
    int64_t shape[3] = {1, rows, d};
    float* pos0 = (float*)xmalloc(sizeof(float) * rows * d);
    st_model_read_f32(sm, name, 3, shape, pos0);
    memcpy(pos, pos0, sizeof(float) * d);
    if (gh0 == m->grid_h && gw0 == m->grid_w) memcpy(pos + d, pos0 + d, sizeof(float) * (rows - 1) * d);
    else bicubic_resize_hwc(pos + d, pos0 + d, gh0, gw0, m->grid_h, m->grid_w, (int)d);
    free(pos0);
}

// The host fp32 W and bias of L to the backend (nothing to do on the CPU, where they are the
// same). A trained W (--full) is the trainable arena's host mirror: trainable_to_device sends it
// on, with its bf16 shadow (vit_init_trainable, after the weights).
static void vit_upload_linear(Vit* m, Linear* L) {
    if (!L->dW) backend_upload_weights(m->be, *linear_weight_slot(m->be, L), L->W, (int64_t)L->out * L->in);
    if (!L->dbias) backend_upload_weights(m->be, *linear_bias_slot(m->be, L), L->bias, L->out);
}

// Block l's frozen LayerNorm vectors (host) to the backend (trained ones go with the arena).
static void vit_upload_norms(Vit* m, int l) {
    VitLayer* layer = &m->params.layers[l];
    if (layer->ln_grad[0]) return;
    void* dst[N_LN] = {layer->ln1_g, layer->ln1_b, layer->ln2_g, layer->ln2_b};
    for (int k = 0; k < N_LN; k++) backend_upload_weights(m->be, dst[k], vit_norm_host(m, l, k), m->cfg.dim);
}

// MS-LN: gamma and beta of block l's norms into the linears that consume them (host fp32).
static void vit_merge_norms(Vit* m, const VitCheckpoint* ck, int l) {
    VitLayer* layer = &m->params.layers[l];
    char name[VIT_NAME_BYTES];
    for (int t = T_Q; t <= T_V; t++)
        linear_merge_norm_affine(&layer->lin[t], vit_norm_host(m, l, LN1_G), vit_norm_host(m, l, LN1_B),
                                 vit_linear_name(name, ck, l, t, VIT_WEIGHT));
    linear_merge_norm_affine(&layer->lin[T_FC1], vit_norm_host(m, l, LN2_G), vit_norm_host(m, l, LN2_B),
                             vit_linear_name(name, ck, l, T_FC1, VIT_WEIGHT));
}

// The patch embedding's kernel [d, C*ph*pw] (host fp32) to the backend, and to the trainable
// arena's host mirror where --full trains it.
static void vit_set_patch_weight(Vit* m, const float* w) {
    Linear* P = &m->params.patch;
    backend_set_weight(m->be, *linear_weight_slot(m->be, P), P->dW ? P->W : NULL, w, m->cfg.dim * patch_len(&m->cfg));
}

// The embeddings and the final norm: read (host, tmp holds d * max(C*ph*pw, T)) and stored.
static void vit_load_embeddings(Vit* m, const StModel* sm, const VitCheckpoint* ck, float* tmp) {
    const VitConfig* c = &m->cfg;
    VitParams* p = &m->params;
    int64_t d = c->dim;
    char name[VIT_NAME_BYTES];
    int64_t cls_shape[3] = {1, 1, d}, pw_shape[4] = {d, c->channels, c->patch_h, c->patch_w};
    st_model_read_f32(sm, vit_tensor_name(name, ck, VIT_CLS), 3, cls_shape, tmp);
    backend_set_weight(m->be, p->cls, p->h_cls, tmp, d);
    vit_load_pos_embed(m, sm, vit_tensor_name(name, ck, VIT_POS), tmp);
    backend_set_weight(m->be, p->pos, p->h_pos, tmp, m->T * d);
    st_model_read_f32(sm, vit_tensor_name(name, ck, VIT_PATCH_W), 4, pw_shape, tmp);
    vit_set_patch_weight(m, tmp);
    read_1d(sm, vit_tensor_name(name, ck, VIT_PATCH_B), d, tmp);
    backend_set_weight(m->be, p->patch_b, p->h_patch_b, tmp, d);
    read_1d(sm, vit_tensor_name(name, ck, VIT_NORM_G), d, tmp);
    backend_set_weight(m->be, p->norm_g, p->h_norm_g, tmp, d);
    read_1d(sm, vit_tensor_name(name, ck, VIT_NORM_B), d, tmp);
    backend_set_weight(m->be, p->norm_b, p->h_norm_b, tmp, d);
}

static void vit_load_weights(Vit* m, const char* dir) {
    const VitConfig* c = &m->cfg;
    int64_t d = c->dim;
    StModel sm;
    st_model_open(&sm, dir);
    VitCheckpoint ck = vit_detect_layout(&sm);
    float* tmp = (float*)xmalloc(sizeof(float) * d * (patch_len(c) > m->T ? patch_len(c) : m->T));
    vit_load_embeddings(m, &sm, &ck, tmp);
    free(tmp);
    char name[VIT_NAME_BYTES];
    for (int l = 0; l < c->layers; l++) {
        VitLayer* layer = &m->params.layers[l];
        for (int k = 0; k < N_LN; k++) read_1d(&sm, vit_norm_name(name, &ck, l, k), d, vit_norm_host(m, l, k));
        for (int t = 0; t < N_TARGETS; t++) {
            Linear* lin = &layer->lin[t];
            vit_read_linear(&sm, &ck, l, t, c->qkv_bias, lin->out, lin->in, lin->W, lin->bias);
        }
        if (m->modes.ms) vit_merge_norms(m, &ck, l);
        vit_upload_norms(m, l);
        for (int t = 0; t < N_TARGETS; t++) vit_upload_linear(m, &layer->lin[t]);
    }
    st_model_close(&sm);
}

// --random-init (benchmarks without a checkpoint, e.g. a ViT-B/16 config.json alone): weights,
// class token and positions drawn from N(0, 0.02^2), biases and betas 0, gammas 1 (so the MS
// merge is the identity and is skipped). One random buffer serves every tensor: their values do
// not matter for speed or memory.
static void vit_random_weights(Vit* m, uint64_t seed) {
    const VitConfig* c = &m->cfg;
    VitParams* p = &m->params;
    int64_t d = c->dim, biggest = d * (patch_len(c) > m->T ? patch_len(c) : m->T);
    for (int t = 0; t < N_TARGETS; t++)
        if (lin_in(c, t) * lin_out(c, t) > biggest) biggest = lin_in(c, t) * lin_out(c, t);
    float* tmp = (float*)xmalloc(sizeof(float) * biggest);
    Rng rng = rng_seeded(seed, 11);
    for (int64_t i = 0; i < biggest; i++) tmp[i] = 0.02f * rng_normal(&rng);
    float* zeros = (float*)xcalloc(d, sizeof(float));
    float* ones = (float*)xmalloc(sizeof(float) * d);
    for (int64_t i = 0; i < d; i++) ones[i] = 1.0f;
    backend_set_weight(m->be, p->cls, p->h_cls, tmp, d);
    backend_set_weight(m->be, p->pos, p->h_pos, tmp, m->T * d);
    vit_set_patch_weight(m, tmp);
    backend_set_weight(m->be, p->patch_b, p->h_patch_b, zeros, d);
    backend_set_weight(m->be, p->norm_g, p->h_norm_g, ones, d);
    backend_set_weight(m->be, p->norm_b, p->h_norm_b, zeros, d);
    for (int l = 0; l < c->layers; l++) {
        memcpy(vit_norm_host(m, l, LN1_G), ones, sizeof(float) * d);
        memcpy(vit_norm_host(m, l, LN2_G), ones, sizeof(float) * d);
        vit_upload_norms(m, l);  // betas: zero since allocation
        for (int t = 0; t < N_TARGETS; t++) {
            Linear* L = &p->layers[l].lin[t];
            memcpy(L->W, tmp, sizeof(float) * L->out * L->in);
            memset(L->bias, 0, sizeof(float) * L->out);
            vit_upload_linear(m, L);
        }
    }
    free(tmp); free(zeros); free(ones);
}

// Fresh adapters (llmc/linear.h: A kaiming-uniform, B = 0) and a new head: W ~ N(0, 0.02) (the
// Hugging Face initializer_range), b = 0. Drawn on the host from the seed, so every backend starts
// identical; AdamW moments start at zero. Then the whole trainable arena (with --full's loaded
// weights) goes to the backend.
static void vit_init_trainable(Vit* m, uint64_t seed) {
    Rng rng = rng_seeded(seed, 7);
    for (int l = 0; l < m->cfg.layers; l++)
        for (int t = 0; t < N_TARGETS; t++) {
            Linear* L = &m->params.layers[l].lin[t];
            if (L->A) lora_init(L, m->modes.rank, &rng);
        }
    Rng hr = rng_seeded(seed, 8);
    for (int64_t i = 0; i < (int64_t)m->classes * m->cfg.dim; i++) m->params.h_head_w[i] = 0.02f * rng_normal(&hr);
    memset(m->params.h_head_b, 0, sizeof(float) * m->classes);
    trainable_to_device(&m->params.tr);
}
// ----------------------------------------------------------------------------------------------
// Adapters and training state. The adapter directory is PEFT's layout for a
// ViTForImageClassification base (llmc/formats/peft.h): lora_A/lora_B of each adapted module
// (vit.encoder.layer.N.<module>), the new head as the saved module "classifier". Under MS-LN the
// adapters see gamma*z + beta, as in the original model, so they are written and read as they are.
// Under the paper's variant (--ms-lora merged) an adapter of q, k, v or fc1 lives on the merged
// layer, whose input is z, while the original layer sees gamma*z + beta: on the way out A becomes
// A diag(1/gamma), and the constant scale*B*A_orig*beta that beta leaves behind goes into the
// layer's bias, so the adapter carries the biases of its modules (PEFT bias "lora_only"):
//   exported bias = b' - (W' + scale*B*A) (beta / gamma)     (b', W': the merged bias and weight)
// which is the original bias minus that constant; loading inverts it. A save (vit_save) stages the
// adapter, or under --full the model directory, and the training state beside it.

// The gamma (beta) that MS-LN merged into linear t of block l (host), or NULL.
static const float* vit_merged_gamma(const Vit* m, int l, int t) {
    if (!m->modes.ms) return NULL;
    if (t <= T_V) return vit_norm_host(m, l, LN1_G);
    return t == T_FC1 ? vit_norm_host(m, l, LN2_G) : NULL;
}

static const float* vit_merged_beta(const Vit* m, int l, int t) {
    if (!m->modes.ms) return NULL;
    if (t <= T_V) return vit_norm_host(m, l, LN1_B);
    return t == T_FC1 ? vit_norm_host(m, l, LN2_B) : NULL;
}

// --ms-lora merged (the paper's variant): adapters behind an MS-LN live in the merged input space.
static int vit_adapters_merged(const Vit* m) { return m->modes.ms && !m->modes.full && m->modes.ms_lora_merged; }

static int vit_peft_entries(Vit* m, PeftEntry* e) {
    int n = 0;
    for (int l = 0; l < m->cfg.layers; l++)
        for (int t = 0; t < N_TARGETS; t++)
            n = peft_add_entry(e, n, &m->params.layers[l].lin[t], "vit.encoder.layer", l, vit_hf_modules[t],
                               vit_adapters_merged(m) ? vit_merged_gamma(m, l, t) : NULL);
    return n;
}

// The block and target of an adapter entry's linear.
static void vit_entry_place(const Vit* m, const PeftEntry* e, int* l, int* t) {
    for (*l = 0; *l < m->cfg.layers; (*l)++)
        for (*t = 0; *t < N_TARGETS; (*t)++)
            if (&m->params.layers[*l].lin[*t] == e->L) return;
    fail("internal: adapter entry %s is no linear of the model", e->module);
}

// out = W beta, what MS-LN added to the bias of linear (l, t) at load time: the merged bias (host)
// minus the checkpoint's own bias (read again; zero for q, k, v of a model without them).
static void vit_merged_bias_shift(float* out, const Vit* m, const char* model_dir, int l, int t) {
    const Linear* L = &m->params.layers[l].lin[t];
    StModel sm;
    st_model_open(&sm, model_dir);
    VitCheckpoint ck = vit_detect_layout(&sm);
    float* b = (float*)xmalloc(sizeof(float) * L->out);
    vit_read_linear(&sm, &ck, l, t, m->cfg.qkv_bias, L->out, L->in, NULL, b);
    for (int k = 0; k < L->out; k++) out[k] = L->bias[k] - b[k];
    free(b);
    st_model_close(&sm);
}

// --ms-lora merged: the bias that the adapter of entry e carries, the original model's (host;
// the caller frees it).
static float* vit_adapter_bias(const Vit* m, const PeftEntry* e) {
    const Linear* L = e->L;
    int l, t;
    vit_entry_place(m, e, &l, &t);
    float* bias = (float*)xmalloc(sizeof(float) * L->out);
    memcpy(bias, L->bias, sizeof(float) * L->out);
    if (!vit_merged_gamma(m, l, t)) return bias;
    float* shift = (float*)xmalloc(sizeof(float) * L->out);
    lora_merged_shift(shift, L, m->modes.rank, m->modes.lora_scale, vit_merged_gamma(m, l, t), vit_merged_beta(m, l, t),
                      e->module);
    for (int k = 0; k < L->out; k++) bias[k] -= shift[k];
    free(shift);
    return bias;
}

static void vit_save_adapter(Vit* m, const char* dir, const TrainOptions* o) {
    const VitConfig* c = &m->cfg;
    trainable_to_host(&m->params.tr, 0);
    PeftEntry* e = (PeftEntry*)xcalloc(c->layers * N_TARGETS, sizeof(PeftEntry));
    int n = vit_peft_entries(m, e);
    PeftExtra* ex = (PeftExtra*)xcalloc(2 * n + 2, sizeof(PeftExtra));
    float** biases = (float**)xcalloc(n + 1, sizeof(float*));
    // full module paths: PEFT matches target_modules by suffix, and "output.dense" (fc2) is
    // also the suffix of "attention.output.dense" (proj)
    const char** modules = (const char**)xmalloc(sizeof(char*) * (n + 1));
    int nex = 0;
    for (int i = 0; i < n; i++) {
        modules[i] = e[i].module;
        if (!vit_adapters_merged(m)) continue;
        biases[i] = vit_adapter_bias(m, &e[i]);
        nex = peft_put_bias(ex, nex, e[i].module, biases[i], e[i].L->out);
    }
    nex = peft_put_module_to_save(ex, nex, vit_hf_head, m->params.h_head_w, m->params.h_head_b, m->classes, c->dim);
    peft_save_ex(dir, e, n, ex, nex, m->modes.rank, o->lora_alpha, o->lora_rslora, o->lora_dropout, NULL, o->model_dir,
                 modules, n, "[\"classifier\"]", vit_adapters_merged(m) ? "lora_only" : "none");
    for (int i = 0; i < n; i++) free(biases[i]);
    free(biases); free(ex); free(modules); free(e);
}

// The bias the adapter carries for entry e's module, if any, into the merged layer under MS-LN:
// --ms-lora merged maps it forward, else the adapter's bias replaces b and keeps W beta.
static void vit_load_adapter_bias(Vit* m, const StFile* f, const PeftEntry* e, const char* model_dir) {
    Linear* L = (Linear*)e->L;
    float* b = (float*)xmalloc(sizeof(float) * L->out);
    if (!peft_read_bias(f, e->module, b, L->out)) { free(b); return; }
    int l, t;
    vit_entry_place(m, e, &l, &t);
    float* shift = (float*)xcalloc(L->out, sizeof(float));
    if (vit_adapters_merged(m) && vit_merged_gamma(m, l, t))
        lora_merged_shift(shift, L, m->modes.rank, m->modes.lora_scale, vit_merged_gamma(m, l, t),
                          vit_merged_beta(m, l, t), e->module);
    else if (m->modes.ms && vit_merged_gamma(m, l, t))
        vit_merged_bias_shift(shift, m, model_dir, l, t);
    for (int k = 0; k < L->out; k++) L->bias[k] = b[k] + shift[k];
    free(shift);
    free(b);
    backend_upload_weights(m->be, *linear_bias_slot(m->be, L), L->bias, L->out);
}

// --adapter: A, B (llmc/formats/peft.h), then the biases of the adapted modules if the adapter carries them
// (mapped into the merged layer under MS-LN), then the head if it carries "classifier" (its shape
// must match --classes); without one the head stays new. PEFT's SEQ_CLS task adds "score" to
// modules_to_save: ViT has no such module, so no tensor of it can be there (peft_load checks).
static void vit_load_adapter(Vit* m, const char* dir, const TrainOptions* o, int need_head) {
    const VitConfig* c = &m->cfg;
    PeftEntry* e = (PeftEntry*)xcalloc(c->layers * N_TARGETS, sizeof(PeftEntry));
    int n = vit_peft_entries(m, e);
    static const char* const saved[] = {"classifier", "score", NULL};
    static const char* const head[] = {"base_model.model.classifier.weight", "base_model.model.classifier.bias", NULL};
    static const char* const bias_modes[] = {"none", "lora_only", NULL};
    PeftReads reads = {saved, head, bias_modes, 1};
    peft_load(dir, e, n, m->modes.rank, o->lora_alpha, o->lora_rslora, &reads);
    char* path = path_join(dir, "adapter_model.safetensors");
    StFile f;
    st_open(&f, path);
    for (int i = 0; i < n; i++) vit_load_adapter_bias(m, &f, &e[i], o->model_dir);
    VitParams* p = &m->params;
    int have_head = peft_read_module_to_save(&f, vit_hf_head, p->h_head_w, p->h_head_b, m->classes, c->dim);
    if (!have_head && need_head)
        fail(
            "%s: no classifier.weight/bias (an adapter saved by train_vit or PEFT with "
            "modules_to_save=[\"classifier\"]); --eval-only needs the trained head",
            path);
    st_close(&f);
    free(path);
    free(e);
    trainable_to_device(&m->params.tr);
}

// Everything a resumed run must share with the saved one, as "key=value" words; not --recompute or
// --offload, which change no number (a run may resume with another).
static void vit_settings_line(char* buf, size_t n, const Vit* m, const TrainOptions* o, const Dist* d, int64_t images) {
    const VitConfig* c = &m->cfg;
    snprintf(buf, n,
             "d=%d f=%d layers=%d heads=%d patch=%dx%d image=%dx%d classes=%d full=%d act=%s norm=%s ms_lora=%s "
             "rank=%d alpha=%g targets=0x%x lora_dropout=%g batch=%d grad_accum=%d world=%d steps=%d "
             "lr=%g warmup=%d min_lr_frac=%g weight_decay=%g grad_clip=%g hflip=%d seed=%d data_images=%lld%s",
             c->dim, c->hidden, c->layers, c->heads, c->patch_h, c->patch_w, m->img_h, m->img_w, m->classes, o->full,
             o->act, o->norm, o->ms_lora, o->lora_rank, o->lora_alpha, m->modes.targets, o->lora_dropout,
             o->batch, o->grad_accum, d->world, o->steps, o->lr, o->warmup, o->min_lr_frac, o->weight_decay,
             o->grad_clip, o->hflip, o->seed, (long long)images, o->lora_rslora ? " rslora=1" : "");
}

// ----------------------------------------------------------------------------------------------
// Export: --export-merged (and the output of --full) writes the input checkpoint (Hugging Face or
// timm layout, its tensor names and dtypes) with every adapter folded in, W + alpha/r * B A, or the
// fully fine-tuned weights, and the trained head as its classifier; llmc/models/vit_checkpoint.h
// rewrites the checkpoint, asking the model here for each linear in the original model's terms. An
// adapter that sees the original input (LoRA, --ms-lora exact) folds into the checkpoint's W as it
// is, its bias unchanged. A W' that --full trained under MS-LN, or an adapter of --ms-lora merged,
// lives on the merged layer (y = W' z + b', z the plain normalised input) and is mapped back to the
// original one, y = W (gamma*z + beta) + b:
//   W = W' diag(1/gamma),   b = b' - W beta = b' - W' (beta / gamma)
// with W' the trained (or adapted) merged weight and b' the merged bias as loaded; a zero gamma
// has no inverse and fails.

// The linear (l, t) in the original layout: W [out, in] and b [out], fp32.
static void vit_linear_original(const Vit* m, int l, int t, float* W, float* b) {
    const Linear* L = &m->params.layers[l].lin[t];
    int64_t n = (int64_t)L->out * L->in;
    memcpy(W, L->W, sizeof(float) * n);
    if (L->A) matmul_nn(W, L->B, L->A, L->out, L->in, m->modes.rank, m->modes.lora_scale, 1);
    memcpy(b, L->bias, sizeof(float) * L->out);
    const float* g = vit_merged_gamma(m, l, t);
    if (!g) return;
    char module[160];
    snprintf(module, sizeof(module), "vit.encoder.layer.%d.%s", l, vit_hf_modules[t]);
    unmerge_norm_affine(W, b, L->out, L->in, g, vit_merged_beta(m, l, t), module);
}

// VitExportSource's questions (model: the Vit).
static int vit_linear_changed(const void* model, int l, int t) {
    const Linear* L = &((const Vit*)model)->params.layers[l].lin[t];
    return L->A || L->dW;
}

static void vit_linear_export(const void* model, int l, int t, VitPart part, float* v) {
    const Vit* m = (const Vit*)model;
    const Linear* L = &m->params.layers[l].lin[t];
    if (L->A && m->modes.ms && !vit_adapters_merged(m)) {  // an original-layout adapter on the checkpoint's W
        if (part == VIT_WEIGHT) matmul_nn(v, L->B, L->A, L->out, L->in, m->modes.rank, m->modes.lora_scale, 1);
        return;
    }
    float* W = (float*)xmalloc(sizeof(float) * L->out * L->in);
    float* b = (float*)xmalloc(sizeof(float) * L->out);
    vit_linear_original(m, l, t, W, b);
    if (part == VIT_WEIGHT) memcpy(v, W, sizeof(float) * L->out * L->in);
    else memcpy(v, b, sizeof(float) * L->out);
    free(W); free(b);
}

// Under MS-LN the mapping back gives q, k, v a bias (b' - W beta) when their merged layer trained.
static int vit_qkv_bias_needed(const void* model, int l) {
    const Vit* m = (const Vit*)model;
    int need = 0;
    for (int t = T_Q; t <= T_V; t++) {
        const Linear* L = &m->params.layers[l].lin[t];
        need |= (m->modes.ms && (L->dW || (L->A && vit_adapters_merged(m)))) || L->dbias;
    }
    return need;
}

static const float* vit_trained_norm(const void* model, int l, int which) {
    const Vit* m = (const Vit*)model;
    return vit_trains_block_norms(&m->modes) ? vit_norm_host(m, l, which) : NULL;
}

static void vit_export_merged(Vit* m, const TrainOptions* o, const char* dir) {
    trainable_to_host(&m->params.tr, 0);
    int full = m->modes.full, resized = full && (m->img_h != m->cfg.image_h || m->img_w != m->cfg.image_w);
    VitExportSource s;
    memset(&s, 0, sizeof(s));
    s.model = m;
    s.layers = m->cfg.layers;
    s.dim = m->cfg.dim;
    s.classes = m->classes;
    s.qkv_bias = m->cfg.qkv_bias;
    const VitParams* p = &m->params;
    const float* trained[VIT_TENSORS] = {p->h_cls, p->h_pos, p->patch.W, p->h_patch_b, p->h_norm_g, p->h_norm_b};
    for (int k = VIT_CLS; k < VIT_HEAD_W; k++) s.trained[k] = full ? trained[k] : NULL;
    s.trained[VIT_HEAD_W] = m->params.h_head_w;
    s.trained[VIT_HEAD_B] = m->params.h_head_b;
    s.positions = m->T;
    s.image_h = resized ? m->img_h : 0;
    s.image_w = resized ? m->img_w : 0;
    s.trained_norm = vit_trained_norm;
    s.linear_changed = vit_linear_changed;
    s.linear_export = vit_linear_export;
    s.qkv_bias_needed = vit_qkv_bias_needed;
    vit_write_merged(&s, o->model_dir, dir);
}

// A model directory written by --export-merged or --full carries its trained head: --eval-only
// without --adapter uses it (classifier.* / head.*; its class count must match the head's).
static void vit_load_checkpoint_head(Vit* m, const char* dir) {
    StModel sm;
    st_model_open(&sm, dir);
    VitCheckpoint ck = vit_detect_layout(&sm);
    char wn[VIT_NAME_BYTES], bn[VIT_NAME_BYTES];
    vit_tensor_name(wn, &ck, VIT_HEAD_W);
    vit_tensor_name(bn, &ck, VIT_HEAD_B);
    if (!st_model_find(&sm, wn) || !st_model_find(&sm, bn))
        fail(
            "%s: no %s / %s; --eval-only needs a trained head (give --adapter, or a model written by --export-merged "
            "or --full)",
            dir, wn, bn);
    read_2d(&sm, wn, m->classes, m->cfg.dim, m->params.h_head_w);
    read_1d(&sm, bn, m->classes, m->params.h_head_b);
    st_model_close(&sm);
    trainable_to_device(&m->params.tr);
}
