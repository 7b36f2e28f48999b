// llama_io.h: the LLaMA model's tensors in and out: weights read from safetensors (any float dtype,
// or bitsandbytes NF4) into fp32 on the host, MS-RMSNorm's gamma merged into the linears that
// consume it, then sent to the backend; random weights (--random-init); the RoPE tables; fresh
// LoRA adapters; adapters saved and loaded in PEFT's layout; the merged export; and the settings a
// resumed run must share (llama_settings_line).
#pragma once
#include "llama.h"
#include "../formats/safetensors.h"
#include "../formats/peft.h"
#include "../formats/bnb.h"
#include "../train/run_options.h"
#include "../train/preference.h"

// ----------------------------------------------------------------------------------------------
// Weights: read from safetensors (any float dtype) into fp32 on the host; MS-RMSNorm merges each
// norm's gamma into the columns of every linear that consumes it (W' = W diag(gamma)), once,
// here; then each tensor goes to the backend (bf16 on CUDA).

static void load_tensor(const StModel* sm, const char* name, float* dst, int64_t rows, int64_t cols) {
    const StTensor* t = st_model_require(sm, name);
    if (t->dtype == ST_U8)  // bitsandbytes quantizes the blocks' linears only (not the embedding, head or norms)
        fail("%s: tensor \"%s\" is stored quantized (U8); only the blocks' linear weights may be 4-bit", t->file, name);
    int64_t shape2[2] = {rows, cols};
    st_check_shape(t, cols ? 2 : 1, cols ? shape2 : &rows);
    st_to_f32(t, dst);  // refuses a non-finite value
}

// Reads tensor `name` [rows, cols] into the host buffer tmp, then into the weight (backend_set_weight).
static void load_weight(Llama* m, const StModel* sm, const char* name, void* dst, float* host_mirror, float* tmp,
                        int64_t rows, int64_t cols) {
    load_tensor(sm, name, tmp, rows, cols);
    backend_set_weight(m->be, dst, host_mirror, tmp, rows * (cols ? cols : 1));
}

// A linear's weight from fp32 host values: frozen, to the backend (bf16 on CUDA); trained under
// --full, to the trainable arena's host mirror (trainable_to_device sends it on, with its shadow).
// Under --quant nf4 the weight is quantized here, on the host, and its NF4 bytes go to the backend.
static void llama_set_linear_weight(Llama* m, Linear* lin, const float* w) {
    int64_t n = (int64_t)lin->out * lin->in;
    if (m->modes.full) { memcpy(lin->W, w, sizeof(float) * n); return; }
    if (!m->modes.nf4) { backend_upload_weights(m->be, *linear_weight_slot(m->be, lin), w, n); return; }
    void* q = xmalloc((size_t)nf4_tensor_bytes(n));
    float* absmax = (float*)xmalloc(sizeof(float) * nf4_blocks(n));
    nf4_quantize(nf4_view(q, n), w, m->w.h_nf4_tables, absmax);
    backend_upload(m->be, (void*)lin->nf4, q, (size_t)nf4_tensor_bytes(n));
    free(absmax);
    free(q);
}

// --quant nf4: the tables every NF4 weight is quantized and dequantized with (host and backend).
static void llama_set_nf4_tables(Llama* m, const float* tables) {
    if (!m->modes.nf4) return;
    memcpy(m->w.h_nf4_tables, tables, sizeof(m->w.h_nf4_tables));
    backend_upload(m->be, m->w.nf4_tables, tables, sizeof(m->w.h_nf4_tables));
}

// Under --quant nf4, the fp32 weights a linear's products use: its NF4 tensor read back from the
// backend and dequantized (merged under MS norms). w: out*in floats.
static void llama_linear_weights_f32(const Llama* m, const Linear* L, float* w) {
    int64_t n = (int64_t)L->out * L->in;
    void* q = xmalloc((size_t)nf4_tensor_bytes(n));
    backend_download(m->be, q, L->nf4, (size_t)nf4_tensor_bytes(n));
    nf4_dequantize(w, nf4_view(q, n), m->w.h_nf4_tables);
    free(q);
}

// A bitsandbytes checkpoint: the dynamic map of its first quantized weight becomes the model's
// (every weight must carry the same one), so that its NF4 bytes are used as they are.
static void llama_bnb_tables(const Llama* m, const StModel* sm, float* tables) {
    char name[256];
    snprintf(name, sizeof(name), "model.layers.0.%s.weight", llama_hf_module(&m->cfg, 0));
    if (!bnb_is_quantized(sm, name)) return;
    BnbWeight w = bnb_read(sm, name, lin_out(&m->cfg, 0), lin_in(&m->cfg, 0));
    if (w.dyn) {
        for (int i = 0; i < NF4_DYN_SIZE; i++)  // bitsandbytes' fp32 linspace: a few ulps from ours
            if (!(fabsf(w.dyn[i] - tables[16 + i]) <= 1e-6f * fabsf(tables[16 + i])))
                fail("%s: \"%s.nested_quant_map\" is not bitsandbytes' dynamic map (entry %d is %g, expected %g)",
                     sm->dir, name, i, w.dyn[i], tables[16 + i]);
        memcpy(tables + 16, w.dyn, sizeof(float) * NF4_DYN_SIZE);
    }
    bnb_free(&w);
}

// Linear `lin`'s weight `name` into tmp (fp32), or, when it is a bitsandbytes NF4 weight that can
// stay as stored (--quant nf4, double-quantized, no norm to merge into it), straight to the
// backend: returns 1 then.
static int llama_read_linear(Llama* m, const StModel* sm, int bnb, const char* name, Linear* lin, float* tmp,
                             int merging) {
    if (!bnb || !bnb_is_quantized(sm, name)) { load_tensor(sm, name, tmp, lin->out, lin->in); return 0; }
    BnbWeight w = bnb_read(sm, name, lin->out, lin->in);
    if (w.dyn && memcmp(w.dyn, m->w.h_nf4_tables + 16, sizeof(float) * NF4_DYN_SIZE) != 0 && m->modes.nf4)
        fail("%s: \"%s.nested_quant_map\" differs from the first weight's (a mismatched quant state)", sm->dir, name);
    if (m->modes.nf4 && w.qabsmax && !merging) {
        int64_t n = (int64_t)lin->out * lin->in;
        void* q = xcalloc(1, (size_t)nf4_tensor_bytes(n));
        bnb_to_nf4(&w, q);
        backend_upload(m->be, (void*)lin->nf4, q, (size_t)nf4_tensor_bytes(n));
        free(q);
        bnb_free(&w);
        return 1;
    }
    bnb_dequantize(&w, tmp);  // to fp32: for the MS merge (requantized after it), or for a run without --quant nf4
    bnb_free(&w);
    return 0;
}

// Gemma's RMSNorms scale by (1 + w) in fp32: the model holds gamma = 1 + w (the same fp32 value
// transformers multiplies by), so every norm, merge and gradient path stays that of gamma; the
// checkpoint's w comes back as gamma - 1 (llama_trained_tensor).
static float llama_norm_offset(const LlamaConfig* c) { return c->gemma ? 1.0f : 0.0f; }

// A norm's gamma [n] from tensor `name` into g (host), the (1 + w) of Gemma's norms applied.
static void llama_load_gamma(const Llama* m, const StModel* sm, const char* name, float* g, int64_t n) {
    load_tensor(sm, name, g, n, 0);
    for (int64_t i = 0; i < n; i++) g[i] += llama_norm_offset(&m->cfg);
}

// The block's norms by their Hugging Face names: Gemma's MLP norm is pre_feedforward_layernorm and its
// post_attention_layernorm the attention's post norm; LLaMA's post_attention_layernorm is the MLP's.
static const char* llama_mlp_norm_name(const LlamaConfig* c) {
    return c->gemma ? "pre_feedforward_layernorm" : "post_attention_layernorm";
}

// Gemma: the sandwich norms' gammas, and the embeddings' scale sqrt(hidden) rounded to the
// embedding's stored dtype, as transformers computes it in the model's dtype (a bf16 checkpoint's
// sqrt(3584) is 59.75, an fp32 one's 59.866...).
static void llama_load_gemma(Llama* m, const StModel* sm, float* tmp) {
    const LlamaConfig* c = &m->cfg;
    if (!c->gemma) return;
    char name[256];
    int64_t d = c->dim;
    for (int l = 0; l < c->layers; l++) {
        LlamaLayer* layer = &m->w.layers[l];
        snprintf(name, sizeof(name), "model.layers.%d.post_attention_layernorm.weight", l);
        llama_load_gamma(m, sm, name, tmp, d);
        backend_set_weight(m->be, layer->post_attn_norm, layer->h_post_attn_norm, tmp, d);
        snprintf(name, sizeof(name), "model.layers.%d.post_feedforward_layernorm.weight", l);
        llama_load_gamma(m, sm, name, tmp, d);
        backend_set_weight(m->be, layer->post_mlp_norm, layer->h_post_mlp_norm, tmp, d);
    }
    StDtype dt = st_model_require(sm, "model.embed_tokens.weight")->dtype;
    float scale = sqrtf((float)d);
    uint16_t h;
    if (dt == ST_BF16 || dt == ST_F16) {
        f32_to_dtype(&h, &scale, 1, dt);
        scale = dt == ST_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
    }
    for (int64_t i = 0; i < d; i++) tmp[i] = scale;
    backend_set_weight(m->be, m->w.embed_scale, NULL, tmp, d);
}

static void llama_load_weights(Llama* m, const char* dir) {
    const LlamaConfig* c = &m->cfg;
    int64_t d = c->dim, biggest = (int64_t)c->vocab * d;
    for (int t = 0; t < N_TARGETS; t++)  // a fused module is read whole (llama_read_module)
        if (lin_in(c, t) * llama_module_rows(c, t) > biggest) biggest = lin_in(c, t) * llama_module_rows(c, t);
    float* tmp = (float*)xmalloc(sizeof(float) * biggest);
    m->w.gamma_host = (float*)xmalloc(sizeof(float) * 2 * c->layers * d);
    int bnb = bnb_config_nf4(dir);
    StModel sm;
    st_model_open(&sm, dir);
    llama_checkpoint_view(c, &sm);
    llama_check_tensor_names(c, &sm, bnb);
    float tables[NF4_TABLE_FLOATS];
    nf4_fill_tables(tables);
    if (bnb) llama_bnb_tables(m, &sm, tables);
    llama_set_nf4_tables(m, tables);
    char name[256];
    load_weight(m, &sm, "model.embed_tokens.weight", m->w.embed, m->w.h_embed, tmp, c->vocab, d);
    llama_load_gamma(m, &sm, "model.norm.weight", tmp, d);
    backend_set_weight(m->be, m->w.final_norm, m->w.h_final_norm, tmp, d);
    if (!c->tied) load_weight(m, &sm, "lm_head.weight", m->w.lm_head, m->w.h_lm_head, tmp, c->vocab, d);
    for (int l = 0; l < c->layers; l++) {
        LlamaLayer* layer = &m->w.layers[l];
        float *g_attn = m->w.gamma_host + 2 * l * d, *g_mlp = g_attn + d;
        snprintf(name, sizeof(name), "model.layers.%d.input_layernorm.weight", l);
        llama_load_gamma(m, &sm, name, g_attn, d);
        backend_set_weight(m->be, layer->attn_norm, layer->h_attn_norm, g_attn, d);
        snprintf(name, sizeof(name), "model.layers.%d.%s.weight", l, llama_mlp_norm_name(c));
        llama_load_gamma(m, &sm, name, g_mlp, d);
        backend_set_weight(m->be, layer->mlp_norm, layer->h_mlp_norm, g_mlp, d);
        if (c->qk_norm) {
            snprintf(name, sizeof(name), "model.layers.%d.self_attn.q_norm.weight", l);
            llama_load_gamma(m, &sm, name, tmp, c->head_dim);
            backend_set_weight(m->be, layer->q_norm, layer->h_q_norm, tmp, c->head_dim);
            snprintf(name, sizeof(name), "model.layers.%d.self_attn.k_norm.weight", l);
            llama_load_gamma(m, &sm, name, tmp, c->head_dim);
            backend_set_weight(m->be, layer->k_norm, layer->h_k_norm, tmp, c->head_dim);
        }
        for (int t = 0; t < N_TARGETS; t++) {
            Linear* lin = &layer->lin[t];
            if (llama_linear_has_bias(c, t)) {  // RMSNorm has no beta: the MS merge leaves a bias as it is
                snprintf(name, sizeof(name), "model.layers.%d.%s.bias", l, llama_hf_module(c, t));
                load_weight(m, &sm, name, *linear_bias_slot(m->be, lin), m->modes.full ? lin->bias : NULL, tmp,
                            lin->out, 0);
            }
            snprintf(name, sizeof(name), "model.layers.%d.%s.weight", l, llama_hf_module(c, t));
            const float* gamma = !m->modes.ms ? NULL : t <= T_V ? g_attn : (t == T_GATE || t == T_UP) ? g_mlp : NULL;
            float* w = tmp;
            if (c->fused) {  // Phi-3: this linear's rows of its module (bitsandbytes checkpoints are refused)
                load_tensor(&sm, name, tmp, llama_module_rows(c, t), lin->in);
                w = tmp + llama_module_row0(c, t) * lin->in;
            } else if (llama_read_linear(m, &sm, bnb, name, lin, tmp, gamma != NULL)) {
                continue;
            }
            if (gamma) merge_norm_affine(w, NULL, lin->out, lin->in, gamma, NULL, name);
            llama_set_linear_weight(m, lin, w);
        }
    }
    llama_load_gemma(m, &sm, tmp);
    st_model_close(&sm);
    free(tmp);
    if (m->modes.full) trainable_to_device(&m->w.tr);
}

// --random-init (benchmarks): weights drawn from N(0, 0.02^2), gammas 1, for a config.json alone.
// One random buffer serves every tensor (their values do not matter for speed or memory, and
// drawing billions of normals would take longer than the benchmark).
static void llama_random_weights(Llama* m, uint64_t seed) {
    const LlamaConfig* c = &m->cfg;
    int64_t d = c->dim, biggest = (int64_t)c->vocab * d;
    for (int t = 0; t < N_TARGETS; t++)
        if (lin_in(c, t) * lin_out(c, t) > biggest) biggest = lin_in(c, t) * lin_out(c, t);
    float* tmp = (float*)xmalloc(sizeof(float) * biggest);
    Rng rng = rng_seeded(seed, 11);
    int64_t drawn = biggest < (1 << 22) ? biggest : (1 << 22);  // 4M normals, repeated
    for (int64_t i = 0; i < drawn; i++) tmp[i] = 0.02f * rng_normal(&rng);
    for (int64_t i = drawn; i < biggest; i += drawn)
        memcpy(tmp + i, tmp, sizeof(float) * (biggest - i < drawn ? biggest - i : drawn));
    m->w.gamma_host = (float*)xmalloc(sizeof(float) * 2 * c->layers * d);
    for (int64_t i = 0; i < 2 * c->layers * d; i++) m->w.gamma_host[i] = 1.0f;
    int64_t widest = 0;
    for (int t = 0; t < N_TARGETS; t++) widest = lin_out(c, t) > widest ? lin_out(c, t) : widest;
    float* zeros = (float*)xcalloc(widest + c->head_dim, sizeof(float));  // biases 0, then the q/k norms' gammas 1
    float* qk_ones = zeros + widest;
    for (int i = 0; i < c->head_dim; i++) qk_ones[i] = 1.0f;
    float tables[NF4_TABLE_FLOATS];
    nf4_fill_tables(tables);
    llama_set_nf4_tables(m, tables);
    backend_set_weight(m->be, m->w.embed, m->w.h_embed, tmp, c->vocab * d);
    backend_set_weight(m->be, m->w.final_norm, m->w.h_final_norm, m->w.gamma_host, d);
    if (!c->tied) backend_set_weight(m->be, m->w.lm_head, m->w.h_lm_head, tmp, c->vocab * d);
    for (int l = 0; l < c->layers; l++) {
        LlamaLayer* layer = &m->w.layers[l];
        backend_set_weight(m->be, layer->attn_norm, layer->h_attn_norm, m->w.gamma_host, d);
        backend_set_weight(m->be, layer->mlp_norm, layer->h_mlp_norm, m->w.gamma_host, d);
        if (c->qk_norm) {
            backend_set_weight(m->be, layer->q_norm, layer->h_q_norm, qk_ones, c->head_dim);
            backend_set_weight(m->be, layer->k_norm, layer->h_k_norm, qk_ones, c->head_dim);
        }
        if (c->gemma) {  // the sandwich norms' gammas 1 (w = 0)
            backend_set_weight(m->be, layer->post_attn_norm, layer->h_post_attn_norm, m->w.gamma_host, d);
            backend_set_weight(m->be, layer->post_mlp_norm, layer->h_post_mlp_norm, m->w.gamma_host, d);
        }
        for (int t = 0; t < N_TARGETS; t++) {
            Linear* lin = &layer->lin[t];
            llama_set_linear_weight(m, lin, tmp);
            if (llama_linear_has_bias(c, t))
                backend_set_weight(m->be, *linear_bias_slot(m->be, lin), m->modes.full ? lin->bias : NULL, zeros,
                                   lin->out);
        }
    }
    if (c->gemma) {  // the embeddings' scale as an fp32 checkpoint's (llama_load_gemma)
        for (int64_t i = 0; i < d; i++) zeros[i] = sqrtf((float)d);
        backend_set_weight(m->be, m->w.embed_scale, NULL, zeros, d);
    }
    free(zeros);
    free(tmp);
    if (m->modes.full) trainable_to_device(&m->w.tr);
}

// Which RoPE table: the model's, or Gemma 3's local layers' (their own base, no scaling).
typedef enum { ROPE_GLOBAL, ROPE_LOCAL } RopeKind;

// RoPE's frequency i of rot_dim / 2 (rot_dim: head_dim, or Phi-3's rotated part). The global table
// takes the configured scaling: Llama-3.1's wavelength-dependent one, Gemma 3's linear one, or
// Phi-3's LongRoPE factor (the long list when the run's sequence T exceeds the original context,
// as transformers picks it for positions up to T); Gemma 3's local table has its own base and none.
static double llama_rope_inv_freq(const LlamaConfig* c, RopeKind kind, int i, int T) {
    double theta = kind == ROPE_LOCAL ? c->rope_local_theta : c->rope_theta;
    double inv = pow(theta, -2.0 * i / c->rot_dim);
    if (kind == ROPE_LOCAL) return inv;
    if (c->rope_linear > 0.0f) return inv / c->rope_linear;
    if (c->rope_longrope) return inv / (T > c->rs_original_ctx ? c->long_factor[i] : c->short_factor[i]);
    if (!c->rope_llama3) return inv;
    double wavelen = 2.0 * M_PI / inv;
    double low_wl = c->rs_original_ctx / c->rs_low_freq, high_wl = c->rs_original_ctx / c->rs_high_freq;
    if (wavelen > low_wl) return inv / c->rs_factor;
    if (wavelen < high_wl) return inv;
    double smooth = (c->rs_original_ctx / wavelen - c->rs_low_freq) / (c->rs_high_freq - c->rs_low_freq);
    return (1.0 - smooth) * inv / c->rs_factor + smooth * inv;
}

// One RoPE table pair (cos, sin [T, rot_dim / 2]) to the backend; LongRoPE scales cos and sin by its
// attention factor.
static void llama_rope_table(Llama* m, RopeKind kind, float* dev_cos, float* dev_sin) {
    const LlamaConfig* c = &m->cfg;
    int half = c->rot_dim / 2;
    int T = m->sp.T;  // every position of the whole sequence (a sequence-parallel rank's slice starts past 0)
    double scale = c->rope_longrope ? c->rope_attn_factor : 1.0;
    float* cs = (float*)xmalloc(sizeof(float) * 2 * T * half);
    float* sn = cs + (int64_t)T * half;
    for (int i = 0; i < half; i++) {
        double inv = llama_rope_inv_freq(c, kind, i, T);
        for (int t = 0; t < T; t++) {
            cs[(int64_t)t * half + i] = (float)(scale * cos(t * inv));
            sn[(int64_t)t * half + i] = (float)(scale * sin(t * inv));
        }
    }
    backend_upload(m->be, dev_cos, cs, sizeof(float) * T * half);
    backend_upload(m->be, dev_sin, sn, sizeof(float) * T * half);
    free(cs);
}

static void llama_rope_tables(Llama* m) {
    llama_rope_table(m, ROPE_GLOBAL, m->w.rope_cos, m->w.rope_sin);
    if (m->w.rope_local_cos) llama_rope_table(m, ROPE_LOCAL, m->w.rope_local_cos, m->w.rope_local_sin);
}

// Fresh adapters: A ~ kaiming-uniform (bound 1/sqrt(in), as PEFT), B = 0, so step 0 is exactly
// the pretrained model. Drawn on the host from the seed, so every backend starts identical.
static void llama_init_lora(Llama* m, uint64_t seed) {
    Rng rng = rng_seeded(seed, 7);
    for (int l = 0; l < m->cfg.layers; l++)
        for (int t = 0; t < N_TARGETS; t++) {
            Linear* L = &m->w.layers[l].lin[t];
            if (L->A && llama_module_lead(&m->cfg, t)) lora_init(L, m->modes.rank, &rng);
            else if (L->A) memset(L->B, 0, sizeof(float) * m->modes.rank * L->out);  // A: its module lead's
        }
    trainable_to_device(&m->w.tr);
}

// ----------------------------------------------------------------------------------------------
// Adapters and training state

// The gamma that MS-RMSNorm merged into linear t of layer l, or NULL (standard norms, o, down).
static const float* llama_merged_gamma(const Llama* m, int l, int t) {
    if (!m->modes.ms) return NULL;
    const float* g = m->w.gamma_host + 2 * (int64_t)l * m->cfg.dim;
    if (t == T_Q || t == T_K || t == T_V) return g;
    if (t == T_GATE || t == T_UP) return g + m->cfg.dim;
    return NULL;
}

// The gamma an adapter of linear t of layer l is mapped through between our layout and the
// original model's (A_orig = A diag(1/gamma)): only under the paper's variant (--ms-lora merged),
// where the adapter sees the merged input. Otherwise adapters are the original model's as they are.
static const float* llama_adapter_gamma(const Llama* m, int l, int t) {
    return m->modes.ms_lora_merged ? llama_merged_gamma(m, l, t) : NULL;
}

// The linear of the checkpoint module that linear t of layer l leads, as one Linear: t itself, or for
// Phi-3's fused modules a view with the module's rows, whose W (under --full), B and their gradients
// are the parts' one after the other in the arena and whose A is the one they share (llmc/models/llama.h).
static Linear llama_module_view(const Llama* m, int l, int t) {
    Linear v = m->w.layers[l].lin[t];
    v.out = (int)llama_module_rows(&m->cfg, t);
    return v;
}

// A gemma3 directory's blocks as current transformers' Gemma3ForConditionalGeneration names its modules
// (model.language_model.layers.N; PEFT writes them under base_model.model.): the adapter's module paths.
// transformers 4.50-4.51 (the release of Gemma 3) named them language_model.model.layers.N: --adapter
// reads an adapter under either (llama_adapter_layers).
#define LLAMA_MM_PEFT_LAYERS "model.language_model.layers"
#define LLAMA_MM_PEFT_LAYERS_450 "language_model.model.layers"

// The module path prefix of the blocks in adapter directory dir (NULL: this run's own when saving).
static const char* llama_adapter_layers(const LlamaConfig* c, const char* dir) {
    if (!c->multimodal) return "model.layers";
    if (!dir) return LLAMA_MM_PEFT_LAYERS;
    char* path = path_join(dir, "adapter_model.safetensors");
    StFile f;
    st_open(&f, path);
    const char* layers = LLAMA_MM_PEFT_LAYERS;
    const char* old = "base_model.model." LLAMA_MM_PEFT_LAYERS_450 ".";
    for (int i = 0; i < f.count; i++)
        if (!strncmp(f.tensors[i].name, old, strlen(old))) layers = LLAMA_MM_PEFT_LAYERS_450;
    st_close(&f);
    free(path);
    return layers;
}

// The PEFT view of the adapters: Hugging Face module paths (one adapter per fused module: views[],
// [layers * N_TARGETS], holds them); under --ms-lora merged, layers merged with an MS norm carry
// that norm's gamma so the adapter is mapped back to (and from) the original model's layout.
static int llama_peft_entries(Llama* m, PeftEntry* e, Linear* views, const char* layers) {
    int n = 0;
    for (int l = 0; l < m->cfg.layers; l++)
        for (int t = 0; t < N_TARGETS; t++) {
            if (!llama_module_lead(&m->cfg, t)) continue;
            Linear* v = &views[l * N_TARGETS + t];
            *v = llama_module_view(m, l, t);
            n = peft_add_entry(e, n, v, layers, l, llama_hf_module(&m->cfg, t), llama_adapter_gamma(m, l, t));
        }
    return n;
}

static void llama_save_adapter(Llama* m, const char* dir, const TrainOptions* o) {
    trainable_to_host(&m->w.tr, 0);
    PeftEntry* e = (PeftEntry*)xcalloc(m->cfg.layers * N_TARGETS, sizeof(PeftEntry));
    Linear* views = (Linear*)xcalloc(m->cfg.layers * N_TARGETS, sizeof(Linear));
    int n = llama_peft_entries(m, e, views, llama_adapter_layers(&m->cfg, NULL));
    const char* tm[N_TARGETS];
    int ntm = 0;
    for (int t = 0; t < N_TARGETS; t++)
        if ((m->modes.targets >> t & 1) && llama_module_lead(&m->cfg, t))
            tm[ntm++] = strchr(llama_hf_module(&m->cfg, t), '.') + 1;
    peft_save(dir, e, n, NULL, 0, m->modes.rank, o->lora_alpha, o->lora_rslora, o->lora_dropout, "CAUSAL_LM",
              o->model_dir, tm, ntm, NULL);
    free(views);
    free(e);
}

// --adapter: the LoRA pairs only (no biases, no whole modules: PEFT bias "none", no modules_to_save).
static void llama_load_adapter(Llama* m, const char* dir, const TrainOptions* o) {
    PeftEntry* e = (PeftEntry*)xcalloc(m->cfg.layers * N_TARGETS, sizeof(PeftEntry));
    Linear* views = (Linear*)xcalloc(m->cfg.layers * N_TARGETS, sizeof(Linear));
    int n = llama_peft_entries(m, e, views, llama_adapter_layers(&m->cfg, dir));
    static const char* const bias_modes[] = {"none", NULL};
    PeftReads reads = {NULL, NULL, bias_modes, 0};
    peft_load(dir, e, n, m->modes.rank, o->lora_alpha, o->lora_rslora, &reads);
    free(views);
    free(e);
    trainable_to_device(&m->w.tr);
}

// The linear whose Hugging Face weight is `name` into *view (a fused module's: llama_module_view),
// its layer and (lead) target; returns 0 when none is.
static int llama_linear_named(Llama* m, const char* name, Linear* view, int* layer, int* target) {
    char buf[256];
    for (int l = 0; l < m->cfg.layers; l++)
        for (int t = 0; t < N_TARGETS; t++) {
            if (!llama_module_lead(&m->cfg, t)) continue;
            snprintf(buf, sizeof(buf), "model.layers.%d.%s.weight", l, llama_hf_module(&m->cfg, t));
            if (strcmp(buf, name) == 0) { *layer = l; *target = t; *view = llama_module_view(m, l, t); return 1; }
        }
    return 0;
}

// Under --full, the host mirror of the trained non-linear weight whose Hugging Face name is
// `name` (embedding, head, final norm, block norms under standard norms, Qwen3's q/k norms, Gemma's
// sandwich norms, the linears' biases), or NULL. *offset: what the model added to the stored values
// (Gemma's norms hold 1 + w: llama_norm_offset), to be taken off again.
static const float* llama_trained_norm(const Llama* m, const char* name, float* offset) {
    *offset = llama_norm_offset(&m->cfg);
    if (!strcmp(name, "model.norm.weight")) return m->w.h_final_norm;
    char buf[128];
    for (int l = 0; l < m->cfg.layers; l++) {
        const LlamaLayer* L = &m->w.layers[l];
        snprintf(buf, sizeof(buf), "model.layers.%d.input_layernorm.weight", l);
        if (!strcmp(name, buf)) return L->h_attn_norm;
        snprintf(buf, sizeof(buf), "model.layers.%d.%s.weight", l, llama_mlp_norm_name(&m->cfg));
        if (!strcmp(name, buf)) return L->h_mlp_norm;
        snprintf(buf, sizeof(buf), "model.layers.%d.self_attn.q_norm.weight", l);
        if (!strcmp(name, buf)) return L->h_q_norm;
        snprintf(buf, sizeof(buf), "model.layers.%d.self_attn.k_norm.weight", l);
        if (!strcmp(name, buf)) return L->h_k_norm;
        if (!m->cfg.gemma) continue;
        snprintf(buf, sizeof(buf), "model.layers.%d.post_attention_layernorm.weight", l);
        if (!strcmp(name, buf)) return L->h_post_attn_norm;
        snprintf(buf, sizeof(buf), "model.layers.%d.post_feedforward_layernorm.weight", l);
        if (!strcmp(name, buf)) return L->h_post_mlp_norm;
    }
    *offset = 0.0f;
    return NULL;
}

static const float* llama_trained_tensor(const Llama* m, const char* name, float* offset) {
    *offset = 0.0f;
    if (!m->modes.full) return NULL;
    if (!strcmp(name, "model.embed_tokens.weight")) return m->w.h_embed;
    if (!strcmp(name, "lm_head.weight")) return m->cfg.tied ? NULL : m->w.h_lm_head;
    const float* norm = llama_trained_norm(m, name, offset);
    if (norm) return norm;
    char buf[128];
    for (int l = 0; l < m->cfg.layers; l++) {
        for (int t = 0; t < N_TARGETS; t++) {  // biases, where the model has them (L->bias: the host mirror)
            snprintf(buf, sizeof(buf), "model.layers.%d.%s.bias", l, llama_hf_module(&m->cfg, t));
            if (!strcmp(name, buf)) return m->w.layers[l].lin[t].dbias ? m->w.layers[l].lin[t].bias : NULL;
        }
    }
    return NULL;
}

// An NF4 linear of the export, as PEFT merges a 4-bit model: the dequantized W (a bitsandbytes
// checkpoint's own, or under --quant nf4 the NF4 copy the run used with the MS merge undone) plus
// alpha/r B A, in bf16 for a bitsandbytes input, else in the input tensor's dtype. Added to the
// writer under t's name; returns the buffer (the writer's until it is saved).
static void* llama_export_nf4_linear(Llama* m, const StModel* sm, int from_bnb, int l, int tg, const Linear* L,
                                     const StTensor* t, StWriter* w) {
    int64_t n = (int64_t)L->out * L->in, shape[2] = {L->out, L->in};
    float* W = (float*)xmalloc(sizeof(float) * n);
    if (from_bnb) {
        BnbWeight bw = bnb_read(sm, t->name, L->out, L->in);
        bnb_dequantize(&bw, W);
        bnb_free(&bw);
    } else {  // each part of a fused module (L its view) holds its own NF4 tensor
        for (int p = tg; p < N_TARGETS && llama_fused_lead(&m->cfg, p) == tg; p++) {
            const Linear* P = &m->w.layers[l].lin[p];
            float* Wp = W + llama_module_row0(&m->cfg, p) * L->in;
            llama_linear_weights_f32(m, P, Wp);
            peft_scale_columns(Wp, Wp, llama_merged_gamma(m, l, p), P->out, P->in, 1, t->name);
        }
    }
    if (L->A) {
        int r = m->modes.rank;
        float* A = (float*)xmalloc(sizeof(float) * r * L->in);
        peft_scale_columns(A, L->A, llama_adapter_gamma(m, l, tg), r, L->in, 1, t->name);
        matmul_nn(W, L->B, A, L->out, L->in, r, m->modes.lora_scale, 1);
        free(A);
    }
    StDtype dt = from_bnb ? ST_BF16 : t->dtype;
    void* out = xmalloc(st_dtype_size(dt) * n);
    f32_to_dtype(out, W, n, dt);
    st_writer_add(w, t->name, dt, 2, shape, out);
    free(W);
    return out;
}

// --export-merged (and the output of --full): the input checkpoint with every adapter folded in,
// W + alpha/r * B A (A in the original layout, from the checkpoint's W), or the fully fine-tuned W,
// in the original layout (a W' that --full trained under MS norms, or an adapter of --ms-lora
// merged, is mapped back first, so the norms keep their original gamma), in each tensor's original
// dtype; every other tensor is copied unchanged.
static void llama_export_merged(Llama* m, const TrainOptions* o, const char* dir) {
    make_dirs(dir, "flag --export-merged");
    trainable_to_host(&m->w.tr, 0);
    StModel sm;
    st_model_open(&sm, o->model_dir);
    int bnb = bnb_config_nf4(o->model_dir);
    StWriter w;
    memset(&w, 0, sizeof(w));
    int total = 0, k = 0, r = m->modes.rank;
    for (int f = 0; f < sm.nfiles; f++) total += sm.files[f].count;
    void** owned = (void**)xcalloc(total + 1, sizeof(void*));
    for (int f = 0; f < sm.nfiles; f++)
        for (int i = 0; i < sm.files[f].count; i++) {
            const StTensor* t = &sm.files[f].tensors[i];
            const char* name = llama_text_name(&m->cfg, t->name);  // NULL: a gemma3 vision tensor, as it is
            int l = 0, tg = 0;
            Linear view;
            const Linear* L = name && llama_linear_named(m, name, &view, &l, &tg) ? &view : NULL;
            float offset = 0.0f;
            const float* trained = name ? llama_trained_tensor(m, name, &offset) : NULL;
            if (trained) {  // --full: embedding, head or a norm, as trained (a Gemma norm's w = gamma - 1)
                owned[k] = xmalloc(st_dtype_size(t->dtype) * st_numel(t));
                float* stored = (float*)xmalloc(sizeof(float) * st_numel(t));
                for (int64_t i = 0; i < st_numel(t); i++) stored[i] = trained[i] - offset;
                f32_to_dtype(owned[k], stored, st_numel(t), t->dtype);
                free(stored);
                st_writer_add(&w, t->name, t->dtype, t->ndim, t->shape, owned[k++]);
                continue;
            }
            if (bnb && bnb_is_quant_state_name(t->name)) continue;  // the export is dequantized
            if (L && !L->dW &&
                (L->nf4 || (bnb && t->dtype == ST_U8))) {  // NF4: bf16 (or the input's dtype), dequantized
                owned[k] = llama_export_nf4_linear(m, &sm, bnb && t->dtype == ST_U8, l, tg, L, t, &w);
                k++;
                continue;
            }
            if (!L || (!L->A && !L->dW)) { st_writer_add(&w, t->name, t->dtype, t->ndim, t->shape, t->data); continue; }
            float* W = (float*)xmalloc(sizeof(float) * L->out * L->in);
            if (L->dW) {  // full fine-tuning trained W' = W diag(gamma): undo the merge
                peft_scale_columns(W, L->W, llama_merged_gamma(m, l, tg), L->out, L->in, 1, t->name);
            } else {
                float* A = (float*)xmalloc(sizeof(float) * r * L->in);
                st_to_f32(t, W);
                peft_scale_columns(A, L->A, llama_adapter_gamma(m, l, tg), r, L->in, 1, t->name);
                matmul_nn(W, L->B, A, L->out, L->in, r, m->modes.lora_scale, 1);
                free(A);
            }
            owned[k] = xmalloc(st_dtype_size(t->dtype) * L->out * L->in);
            f32_to_dtype(owned[k], W, (int64_t)L->out * L->in, t->dtype);
            st_writer_add(&w, t->name, t->dtype, t->ndim, t->shape, owned[k++]);
            free(W);
        }
    char* path = path_join(dir, "model.safetensors");
    st_writer_save(&w, path, "\"format\":\"pt\"");
    free(path);
    const char* aux[] = {"config.json",    "generation_config.json", "tokenizer.bin",
                         "tokenizer.json", "tokenizer_config.json",  "special_tokens_map.json"};
    for (int i = 0; i < 6; i++) {
        char* src = path_join(o->model_dir, aux[i]);
        char* dst = path_join(dir, aux[i]);
        if (bnb && i == 0) bnb_write_config_unquantized(o->model_dir, dst);  // dequantized: no quantization_config
        else if (file_exists(src)) copy_file_atomic(src, dst);
        free(src); free(dst);
    }
    for (int i = 0; i < k; i++) free(owned[i]);
    free(owned);
    st_writer_free(&w);
    st_model_close(&sm);
}

// ----------------------------------------------------------------------------------------------
// The settings a resumed run must share (llmc/train/loop.h's Trainer.settings)

// Everything a resumed run must share with the saved one, as "key=value" words (rslora=1 last and only
// when set, so that states saved before the flag existed still match). The memory modes that change no
// number (--recompute, --offload, --mlp-tile, --swiglu-product) are not in it: a run may resume with
// another, e.g. with --recompute block on a smaller card.
static void llama_settings_line(char* buf, size_t n, const Llama* m, const TrainOptions* o, const Dist* d,
                                int64_t data_tokens) {
    const LlamaConfig* c = &m->cfg;
    snprintf(buf, n,
             "d=%d f=%d layers=%d heads=%d kv_heads=%d vocab=%d full=%d act=%s norm=%s ms_lora=%s rank=%d "
             "alpha=%g targets=0x%x "
             "lora_dropout=%g batch=%d seq=%d grad_accum=%d world=%d steps=%d lr=%g warmup=%d min_lr_frac=%g "
             "weight_decay=%g grad_clip=%g seed=%d data_tokens=%lld quant=%s%s",
             c->dim, c->hidden, c->layers, c->heads, c->kv_heads, c->vocab, o->full, o->act, o->norm, o->ms_lora,
             o->lora_rank, o->lora_alpha, m->modes.targets, o->lora_dropout, o->batch, o->seq,
             o->grad_accum, d->world, o->steps, o->lr, o->warmup, o->min_lr_frac, o->weight_decay, o->grad_clip,
             o->seed, (long long)data_tokens, o->quant, o->lora_rslora ? " rslora=1" : "");
    if (dist_sp(d) > 1) str_appendf(buf, n, " seq_parallel=%d", dist_sp(d));  // the data order follows world / P
    if (objective_of(o) != OBJ_SFT)  // (sft: not named, so that states saved before the flag still match)
        str_appendf(buf, n, " objective=%s beta=%g label_smoothing=%g simpo_gamma=%g", o->objective,
                    objective_beta(o), o->dpo_label_smoothing, o->simpo_gamma);
}
