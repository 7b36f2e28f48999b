// llama_family.h: which LLaMA-architecture checkpoints train_llama understands, read strictly.
// LlamaConfig is config.json of a Hugging Face LLaMA, Mistral, Qwen2/2.5, Qwen3 (dense) or Phi-3/Phi-4 model;
// llama_check_tensor_names proves that every tensor of the checkpoint is one the model uses.
//
// The families differ from LLaMA in small ways, each of which changes the math:
//   llama    attention_bias (q, k, v, o carry biases), mlp_bias (gate, up, down), head_dim
//   mistral  sliding_window (attention sees only the last W positions)
//   qwen2    q, k, v always carry biases; use_sliding_window / sliding_window / max_window_layers
//   qwen3    q_norm / k_norm: an RMSNorm over each head of q and k before RoPE, an explicit head_dim,
//            attention_bias; the sliding-window keys of qwen2
//   phi3     Phi-3, Phi-3.5, Phi-4, Phi-4-mini: q, k, v stored as one qkv_proj and gate, up as one
//            gate_up_proj (split by rows on load: llama_hf_module); partial_rotary_factor (RoPE on the
//            first factor*head_dim dims of each head); LongRoPE (rope_scaling longrope/su); a sliding
//            window on every layer where sliding_window is set
//   gemma2   RMSNorm scaling by (1 + w) in fp32; embeddings scaled by sqrt(hidden) (in the weights'
//            dtype); GeGLU with the tanh GELU; sandwich norms (post-attention and post-feedforward
//            norms on each branch's output); final-logit soft-capping; query_pre_attn_scalar;
//            a sliding window on the even layers; tied embeddings by default
//   gemma3_text  gemma2's without soft-capping, with qwen3's q/k norms (scaling by 1 + w), local
//            layers (sliding_window_pattern or layer_types) with their own RoPE base
//            (rope_local_base_freq), linear RoPE scaling on the global layers
//   gemma3   the multimodal directory (Gemma3ForConditionalGeneration): its text_config is read as a
//            gemma3_text config, its language_model.* tensors as that model's; the vision part is not
//            read (llama_config_gemma3_outer, llama_text_name)
// Anything else is refused in one line naming it, never passed over: another model_type or
// architecture, a config key this file does not know (it could change the math), a value of a
// known key that the trainer does not implement (rope_scaling types but llama3, a partial rotary
// factor, attention dropout), and a tensor of
// the checkpoint that the model would not use.
#pragma once
#include <string.h>
#include "../common.h"
#include "../formats/json.h"
#include "../formats/safetensors.h"
#include "../formats/bnb.h"

#define LLAMA_MAX_LAYERS 1024               // num_hidden_layers is refused above this
#define LLAMA_MAX_ROPE_PAIRS 512            // head_dim is at most 1024: at most 512 rotated pairs

typedef struct {
    char family[16];                       // model_type: llama, mistral, qwen2 or qwen3
    int dim, hidden, layers, heads, kv_heads, head_dim, vocab, max_seq;
    float norm_eps, rope_theta;
    int tied;
    int rope_llama3;                       // Llama-3.1 frequency scaling
    float rs_factor, rs_low_freq, rs_high_freq;
    int rs_original_ctx;
    int bos_id, eos_id;
    int qkv_bias, o_bias, mlp_bias;        // which linears carry a bias (q,k,v / o / gate,up,down)
    int qk_norm;                           // Qwen3: RMSNorm (eps norm_eps) over each head of q and k before RoPE
    int sliding_window;                    // W: a sliding layer's position attends to the last W positions (0: none)
    unsigned char layer_sliding[LLAMA_MAX_LAYERS];  // [layers] 1: layer l is a sliding (local) layer
    float attn_scale;                      // the scores' scale: head_dim^-0.5 (Gemma: query_pre_attn_scalar^-0.5)
    float attn_softcap, final_softcap;     // Gemma 2: scores and logits become c*tanh(x/c) (0: none)
    int fused;                             // Phi-3: the checkpoint fuses q,k,v (qkv_proj) and gate,up (gate_up_proj)
    int rot_dim;                           // RoPE rotates dims [0, rot_dim) of each head (head_dim unless partial)
    // Phi-3 LongRoPE: inv_freq[i] = 1 / (factor[i] * theta^(2i/rot_dim)), factor the long list when the
    // run's sequence exceeds rs_original_ctx, else the short one; cos and sin scaled by rope_attn_factor
    int rope_longrope;
    float rope_attn_factor;
    float long_factor[LLAMA_MAX_ROPE_PAIRS], short_factor[LLAMA_MAX_ROPE_PAIRS];  // [rot_dim / 2]
    int gemma;                             // Gemma 2/3: norms scale by 1 + w (llama_io.h holds the gammas as
                                           // 1 + w), embeddings by embed_scale, GeGLU (tanh GELU), sandwich norms
    float rope_local_theta;                // Gemma 3: the RoPE base of the sliding (local) layers (0: rope_theta)
    float rope_linear;                     // linear RoPE scaling: positions divided by this (0: none)
    int pad_skip;                          // pad_token_id, the embedding row transformers' padding_idx leaves
                                           // without a gradient (--full); -1: none (llama_config_pad)
    int multimodal;                        // a gemma3 directory (Gemma3ForConditionalGeneration): this is its
                                           // text_config, the tensors are under LLAMA_MM_PREFIX (llama_text_name)
} LlamaConfig;

// A gemma3 directory's checkpoint, as released (Gemma3ForConditionalGeneration saves its language model,
// a Gemma3ForCausalLM, as the attribute language_model): the text model's tensors are these names with
// this prefix; the vision part's are under LLAMA_MM_VISION's prefixes, and not read.
#define LLAMA_MM_PREFIX "language_model."
static const char* const LLAMA_MM_VISION[2] = {"vision_tower.", "multi_modal_projector."};

// The window layer l attends over: 0 for every position before it, else the last W positions.
static inline int llama_layer_window(const LlamaConfig* c, int l) {
    return c->sliding_window && c->layer_sliding[l] ? c->sliding_window : 0;
}

// ---- the keys of config.json ---------------------------------------------------------------------

// Keys that do not change a causal LM's training math: bookkeeping, generation defaults, token ids
// (read where used), and keys whose values llama_config_load reads and checks itself.
static const char* const llama_known_keys[] = {
    // read and checked below
    "model_type", "architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta",
    "rope_scaling", "tie_word_embeddings", "hidden_act", "attention_bias", "mlp_bias", "attention_dropout",
    "sliding_window", "use_sliding_window", "max_window_layers", "layer_types", "partial_rotary_factor",
    "quantization_config", "bos_token_id", "eos_token_id", "pruned_heads",
    // Phi-3's (llama_config_phi3 refuses them elsewhere and checks their values)
    "original_max_position_embeddings", "embd_pdrop", "resid_pdrop", "lm_head_bias", "full_attn_mod",
    "interpolate_factor",
    // Gemma 2 / Gemma 3 (llama_config_gemma)
    "hidden_activation", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
    "sliding_window_pattern", "rope_local_base_freq", "use_bidirectional_attention",
    // the KV cache's kind for generation in transformers (no change in math)
    "cache_implementation",
    // bookkeeping of transformers' PretrainedConfig and of the exporters
    "_name_or_path", "torch_dtype", "dtype", "transformers_version", "use_cache", "initializer_range", "pad_token_id",
    "sep_token_id", "decoder_start_token_id", "tokenizer_class", "output_attentions", "output_hidden_states",
    "return_dict", "torchscript", "use_bfloat16", "tf_legacy_loss", "is_decoder", "is_encoder_decoder",
    "add_cross_attention", "tie_encoder_decoder", "cross_attention_hidden_size", "chunk_size_feed_forward",
    "id2label", "label2id", "problem_type", "finetuning_task", "prefix", "task_specific_params",
    "_attn_implementation_autoset", "use_return_dict", "auto_map",
    // tensor parallelism of the original Llama-2 training: the same products, split (no change in math)
    "pretraining_tp",
    // generation defaults (generate reads its own flags)
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores", "return_dict_in_generate",
    "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens",
};

static void llama_check_known_keys(const Json* j, const char* path) {
    int n = (int)(sizeof(llama_known_keys) / sizeof(llama_known_keys[0]));
    for (int i = 0; i < j->count; i++) {
        int known = 0;
        for (int k = 0; k < n && !known; k++) known = strcmp(j->keys[i], llama_known_keys[k]) == 0;
        if (!known)
            fail("%s: config key \"%s\" is not one train_llama knows (it may change the model's math; "
                 "refused rather than ignored)", path, j->keys[i]);
    }
}

// model_type and architectures: the five families as causal LMs, nothing else.
static void llama_config_family(LlamaConfig* c, const Json* j, const char* path) {
    static const char* const types[] = {"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text"};
    static const char* const archs[] = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                        "Qwen3ForCausalLM", "Phi3ForCausalLM", "Gemma2ForCausalLM",
                                        "Gemma3ForCausalLM"};
    const int n_types = (int)(sizeof(types) / sizeof(types[0]));
    const Json* mt = json_get(j, "model_type");
    if (!mt && c->multimodal) {  // Gemma3Config builds Gemma3TextConfig(**text_config) whatever it names
        snprintf(c->family, sizeof(c->family), "gemma3_text");
        return;
    }
    if (!mt || mt->type != JSON_STRING)
        fail("%s: no model_type string (expected llama, mistral, qwen2, qwen3, phi3, gemma2 or "
             "gemma3_text)", path);
    int f = 0;
    while (f < n_types && strcmp(mt->string, types[f]) != 0) f++;
    if (f == n_types)
        fail("%s: model_type \"%.60s\" is not supported (train_llama reads llama, mistral, qwen2, qwen3, gemma2, "
             "gemma3_text and gemma3's text model%s)", path, mt->string,
             strcmp(mt->string, "vit") == 0 ? "; a ViT is train_vit's"
             : "");
    if (c->multimodal && strcmp(types[f], "gemma3_text") != 0)
        fail("%s: text_config.model_type \"%s\" is not gemma3_text (Gemma3Config reads text_config as one)", path,
             types[f]);
    snprintf(c->family, sizeof(c->family), "%s", types[f]);
    const Json* ar = json_get(j, "architectures");
    if (!ar || ar->type == JSON_NULL) return;
    if (ar->type != JSON_ARRAY) fail("%s: architectures must be a list", path);
    for (int i = 0; i < ar->count; i++)
        if (ar->items[i].type != JSON_STRING || strcmp(ar->items[i].string, archs[f]) != 0)
            fail("%s: architecture %.60s is not supported for model_type %s (expected %s)", path,
                 ar->items[i].type == JSON_STRING ? ar->items[i].string : "(not a string)", types[f], archs[f]);
}

// A boolean key: absent or null gives dflt; anything but true/false is refused (1 is not a bool).
static int llama_config_bool(const Json* j, const char* key, const char* path, int dflt) {
    const Json* v = json_get(j, key);
    if (!v || v->type == JSON_NULL) return dflt;
    if (v->type != JSON_BOOL) fail("%s: field \"%s\" must be true or false", path, key);
    return v->boolean;
}

// LongRoPE's factor list `key` of rope_scaling: rot_dim / 2 positive numbers, as transformers checks.
static void llama_config_rope_factors(float* out, const Json* rs, const char* key, int pairs, const char* path) {
    const Json* a = json_get(rs, key);
    if (!a || a->type != JSON_ARRAY || a->count != pairs)
        fail("%s: rope_scaling.%s must be a list of %d numbers (the rotated dims / 2)", path, key, pairs);
    for (int i = 0; i < pairs; i++) {
        if (a->items[i].type != JSON_NUMBER) fail("%s: rope_scaling.%s[%d] is not a number", path, key, i);
        out[i] = json_positive_float(a->items[i].number, key, path);
    }
}

// Phi-3's LongRoPE, as transformers computes it (modeling_rope_utils.py's longrope parameters): the
// original context is the top-level original_max_position_embeddings (Phi3Config's default 4096);
// the attention factor is rope_scaling.attention_factor when given, else sqrt(1 + ln s / ln orig)
// with s = max_position_embeddings / orig (1 when s <= 1). Which list applies is decided by the
// run's sequence (llama_rope_tables).
static void llama_config_longrope(LlamaConfig* c, const Json* j, const Json* rs, const char* path) {
    c->rope_longrope = 1;
    c->rs_original_ctx = json_get(j, "original_max_position_embeddings") &&
                                 json_get(j, "original_max_position_embeddings")->type != JSON_NULL
                             ? json_int_in(j, "original_max_position_embeddings", path, 1, 1 << 26) : 4096;
    int pairs = c->rot_dim / 2;
    llama_config_rope_factors(c->long_factor, rs, "long_factor", pairs, path);
    llama_config_rope_factors(c->short_factor, rs, "short_factor", pairs, path);
    const Json* af = json_get(rs, "attention_factor");
    double s = (double)c->max_seq / c->rs_original_ctx;
    if (af && af->type != JSON_NULL)
        c->rope_attn_factor = json_positive_float(json_number_req(rs, "attention_factor", path),
                                                  "rope_scaling.attention_factor", path);
    else c->rope_attn_factor = s <= 1.0 ? 1.0f : (float)sqrt(1.0 + log(s) / log((double)c->rs_original_ctx));
    for (int k = 0; k < rs->count; k++) {
        const char* key = rs->keys[k];
        if (strcmp(key, "type") && strcmp(key, "rope_type") && strcmp(key, "long_factor") &&
            strcmp(key, "short_factor") && strcmp(key, "attention_factor") && strcmp(key, "factor"))
            fail("%s: rope_scaling key \"%.40s\" is not one LongRoPE reads here (refused rather than ignored)",
                 path, key);
    }
}

// rope_scaling: absent, null, {"rope_type": "default"}, Llama-3.1's {"rope_type": "llama3", ...}, or
// (phi3 only) LongRoPE {"type": "longrope" or "su", "long_factor": [..], "short_factor": [..]}.
static void llama_config_rope_scaling(LlamaConfig* c, const Json* j, const char* path) {
    const Json* rs = json_get(j, "rope_scaling");
    if (!rs || rs->type == JSON_NULL) return;
    if (rs->type != JSON_OBJECT) fail("%s: rope_scaling must be an object or null", path);
    const char* type = json_string_or(rs, "rope_type", json_string_or(rs, "type", ""));
    if (strcmp(type, "default") == 0) return;
    if (c->fused && (strcmp(type, "longrope") == 0 || strcmp(type, "su") == 0)) {
        llama_config_longrope(c, j, rs, path);
        return;
    }
    if (strcmp(type, "linear") == 0 && !strcmp(c->family, "gemma3_text")) {  // Gemma 3: on the global layers
        c->rope_linear = json_positive_float(json_number_req(rs, "factor", path), "rope_scaling.factor", path);
        return;
    }
    if (strcmp(type, "llama3") != 0)
        fail("%s: rope_scaling type \"%.40s\" is not supported (expected %s or default)", path, type,
             c->fused ? "longrope, su" : !strcmp(c->family, "gemma3_text") ? "llama3, linear" : "llama3");
    c->rope_llama3 = 1;
    c->rs_factor = json_positive_float(json_number_req(rs, "factor", path), "rope_scaling.factor", path);
    c->rs_low_freq =
        json_positive_float(json_number_req(rs, "low_freq_factor", path), "rope_scaling.low_freq_factor", path);
    c->rs_high_freq =
        json_positive_float(json_number_req(rs, "high_freq_factor", path), "rope_scaling.high_freq_factor", path);
    c->rs_original_ctx = json_int_in(rs, "original_max_position_embeddings", path, 1, 1 << 26);
    // the smooth band between the two wavelengths divides by their difference
    if (!(c->rs_high_freq > c->rs_low_freq))
        fail("%s: rope_scaling.high_freq_factor (%g) must exceed low_freq_factor (%g)", path, c->rs_high_freq,
             c->rs_low_freq);
}

// bos/eos ids: the number when it is one an int holds (a cast of 1e12 would be undefined), else
// the default (also for a list, as Llama-3.1's eos is).
static int llama_token_id_or(const Json* j, const char* key, int dflt) {
    const Json* v = json_get(j, key);
    if (!v || v->type != JSON_NUMBER || !(v->number >= 0 && v->number < 2147483647.0)) return dflt;
    return (int)v->number;
}

// The sliding window and the layers it applies to (layer_sliding), as transformers decides them:
// Mistral and Phi-3 window every layer (sliding_window null: none); Qwen2 and Qwen3 window the layers at
// index >= max_window_layers when use_sliding_window is true; an explicit layer_types list names
// each layer itself. Attention takes each layer's window (llama.h's llama_attn_shape,
// llmc/cpu/attention.h's AttnShape.window).
static void llama_config_window(LlamaConfig* c, const Json* j, const char* path) {
    // Mistral and Phi-3 window every layer
    int mistral = strcmp(c->family, "mistral") == 0 || c->fused;
    int use = llama_config_bool(j, "use_sliding_window", path, 0);
    int from = mistral ? 0 : c->layers;
    if (!mistral && use) from = json_get(j, "max_window_layers") && json_get(j, "max_window_layers")->type != JSON_NULL
                                    ? json_int_in(j, "max_window_layers", path, 0, 1 << 30) : 28;
    for (int l = 0; l < c->layers; l++) c->layer_sliding[l] = l >= from;
    if (!strcmp(c->family, "gemma2"))  // transformers' Gemma2: the even layers are the sliding ones
        for (int l = 0; l < c->layers; l++) c->layer_sliding[l] = l % 2 == 0;
    if (!strcmp(c->family, "gemma3_text")) {  // every layer but each pattern-th one is local
        const Json* pt = json_get(j, "sliding_window_pattern");
        int pattern = pt && pt->type != JSON_NULL ? json_int_in(j, "sliding_window_pattern", path, 1, 1 << 20) : 6;
        for (int l = 0; l < c->layers; l++) c->layer_sliding[l] = (l + 1) % pattern != 0;
    }
    const Json* lt = json_get(j, "layer_types");
    if (lt && lt->type != JSON_NULL) {
        if (lt->type != JSON_ARRAY) fail("%s: layer_types must be a list", path);
        if (lt->count != c->layers)
            fail("%s: layer_types has %d entries for %d layers", path, lt->count, c->layers);
        for (int i = 0; i < lt->count; i++) {
            const Json* e = &lt->items[i];
            int sliding = e->type == JSON_STRING && strcmp(e->string, "sliding_attention") == 0;
            if (!sliding && !(e->type == JSON_STRING && strcmp(e->string, "full_attention") == 0))
                fail("%s: layer_types[%d] is not supported (expected full_attention or sliding_attention)", path, i);
            c->layer_sliding[i] = (unsigned char)sliding;
        }
    }
    int any = 0;
    for (int l = 0; l < c->layers; l++) any |= c->layer_sliding[l];
    const Json* w = json_get(j, "sliding_window");
    if (any && c->gemma && !w) { c->sliding_window = 4096; return; }  // both Gemma configs' default
    if (!any || !w || w->type == JSON_NULL) return;
    c->sliding_window = json_int_in(j, "sliding_window", path, 1, 1 << 30);
}

// Gemma 2 and Gemma 3 text: their own keys and defaults (transformers' Gemma2Config and
// Gemma3TextConfig), read after the common ones: the attention scale, both soft-caps (attention's
// in llmc/cpu/attention.h and the CUDA paths, the logits' in the chunked loss). Another family
// with a Gemma key set is refused (transformers would ignore it: a config that says what its model does not do).
static void llama_config_gemma(LlamaConfig* c, const Json* j, const char* path) {
    static const char* const keys[] = {"hidden_activation", "query_pre_attn_scalar", "attn_logit_softcapping",
                                       "final_logit_softcapping", "sliding_window_pattern", "rope_local_base_freq",
                                       "use_bidirectional_attention"};
    int g2 = !strcmp(c->family, "gemma2"), g3 = !strcmp(c->family, "gemma3_text");
    for (int k = 0; k < 7; k++) {
        const Json* v = json_get(j, keys[k]);
        int g3_only = k >= 4;
        if (v && v->type != JSON_NULL && (!(g2 || g3) || (g2 && g3_only)))
            fail("%s: \"%s\" is a %s key, not a %s one (refused rather than ignored)", path, keys[k],
                 g3_only ? "gemma3_text" : "Gemma", c->family);
    }
    if (!g2 && !g3) return;
    c->gemma = 1;
    const char* act = json_string_or(j, "hidden_activation", "gelu_pytorch_tanh");
    if (strcmp(act, "gelu_pytorch_tanh") != 0)
        fail("%s: hidden_activation \"%.40s\" is not supported (expected gelu_pytorch_tanh)", path, act);
    double qs = json_number_opt(j, "query_pre_attn_scalar", path, g2 ? 224.0 : 256.0);
    c->attn_scale = (float)(1.0 / sqrt(json_positive_float(qs, "query_pre_attn_scalar", path)));
    const Json* ac = json_get(j, "attn_logit_softcapping");
    if (ac && ac->type != JSON_NULL)
        c->attn_softcap = json_positive_float(json_number_req(j, "attn_logit_softcapping", path),
                                              "attn_logit_softcapping", path);
    else if (g2 && !ac) c->attn_softcap = 50.0f;  // Gemma2Config's default
    const Json* fc = json_get(j, "final_logit_softcapping");
    if (fc && fc->type != JSON_NULL)
        c->final_softcap = json_positive_float(json_number_req(j, "final_logit_softcapping", path),
                                               "final_logit_softcapping", path);
    else if (g2 && !fc) c->final_softcap = 30.0f;  // Gemma2Config's default
    if (llama_config_bool(j, "use_bidirectional_attention", path, 0))
        fail("%s: use_bidirectional_attention is not supported (a causal LM attends to the past only)", path);
    if (!json_get(j, "tie_word_embeddings")) c->tied = 1;  // both configs tie by default
    if (g3 && !json_get(j, "rope_theta")) c->rope_theta = 1000000.0f;
    if (g3)
        c->rope_local_theta = json_positive_float(json_number_opt(j, "rope_local_base_freq", path, 10000.0),
                                                  "rope_local_base_freq", path);
    c->qk_norm = g3;
}

// Values of known keys that the trainer does not implement, refused.
static void llama_config_refusals(const LlamaConfig* c, const Json* j, const char* path) {
    // Gemma's MLP reads hidden_activation (llama_config_gemma); a hidden_act beside it must agree
    const char* want = !strncmp(c->family, "gemma", 5) ? "gelu_pytorch_tanh" : "silu";
    const char* act = json_string_or(j, "hidden_act", want);
    if (strcmp(act, want) != 0) fail("%s: hidden_act \"%.40s\" is not supported (expected %s)", path, act, want);
    if (strcmp(c->family, "phi3") != 0) {
        if (json_number_opt(j, "partial_rotary_factor", path, 1.0) != 1.0)
            fail("%s: partial_rotary_factor %g is not supported (RoPE rotates the whole head here)", path,
                 json_number_or(j, "partial_rotary_factor", 1.0));
        static const char* const phi3_keys[] = {"original_max_position_embeddings", "embd_pdrop", "resid_pdrop",
                                                "lm_head_bias", "full_attn_mod", "interpolate_factor"};
        for (int k = 0; k < 6; k++)
            if (json_get(j, phi3_keys[k])) fail("%s: config key \"%s\" is a phi3 key, not one of this family", path,
                                                phi3_keys[k]);
    }
    if (json_number_opt(j, "attention_dropout", path, 0.0) != 0.0)
        fail("%s: attention_dropout %g is not supported (attention has no dropout here)", path,
             json_number_or(j, "attention_dropout", 0.0));
    const Json* ph = json_get(j, "pruned_heads");
    if (ph && ph->type != JSON_NULL && ph->count > 0) fail("%s: pruned_heads is not supported", path);
}

// Phi-3's own keys, after the sizes: the fused checkpoint, the rotated dims (partial_rotary_factor:
// int(factor * head_dim), as transformers rounds it), and the keys whose other values would change
// the math refused: dropouts on the embedding and the residual (none here), a head bias, biases on
// the linears (transformers' Phi3 has none, whatever attention_bias says), and Phi-4-mini's
// full_attn_mod / interpolate_factor, which transformers' Phi3 does not read, at any value but 1.
static void llama_config_phi3(LlamaConfig* c, const Json* j, const char* path) {
    c->rot_dim = c->head_dim;
    if (strcmp(c->family, "phi3") != 0) return;
    c->fused = 1;
    double f = json_number_opt(j, "partial_rotary_factor", path, 1.0);
    if (!(f > 0.0 && f <= 1.0)) fail("%s: partial_rotary_factor %g must lie in (0, 1]", path, f);
    c->rot_dim = (int)(c->head_dim * f);
    if (c->rot_dim < 2 || c->rot_dim % 2)
        fail("%s: partial_rotary_factor %g rotates %d dims of %d (expected a positive even count)", path, f,
             c->rot_dim, c->head_dim);
    static const char* const zero[] = {"embd_pdrop", "resid_pdrop"};
    for (int k = 0; k < 2; k++)
        if (json_number_opt(j, zero[k], path, 0.0) != 0.0)
            fail("%s: %s %g is not supported (no dropout there here)", path, zero[k], json_number_or(j, zero[k], 0));
    static const char* const one[] = {"full_attn_mod", "interpolate_factor"};
    for (int k = 0; k < 2; k++)
        if (json_number_opt(j, one[k], path, 1.0) != 1.0)
            fail("%s: %s %g is not supported (expected 1)", path, one[k], json_number_or(j, one[k], 1));
    static const char* const off[] = {"lm_head_bias", "attention_bias", "mlp_bias"};
    for (int k = 0; k < 3; k++)
        if (llama_config_bool(j, off[k], path, 0))
            fail("%s: %s true is not supported for phi3 (its linears have no biases)", path, off[k]);
}

// Sizes. Ranges: every real model lies well inside (Llama-3.1-405B: hidden 16384, intermediate
// 53248, 126 layers, 128 heads, vocab 128256); beyond them a config is corrupt, and the limits keep
// every product of sizes the code forms far from 64-bit overflow.
static int llama_int_or(const Json* j, const char* key, const char* path, int lo, int hi, int dflt) {
    return json_get(j, key) && json_get(j, key)->type != JSON_NULL ? json_int_in(j, key, path, lo, hi) : dflt;
}

// The sizes' defaults where config.json leaves them out: none (a missing size is refused), but for
// gemma3_text Gemma3TextConfig's own, which released gemma3 directories rely on (their text_config
// names hidden_size, intermediate_size and num_hidden_layers, not the heads or the vocabulary).
static void llama_config_sizes(LlamaConfig* c, const Json* j, const char* path) {
    int g3 = !strcmp(c->family, "gemma3_text"), req = -1;
    c->dim = llama_int_or(j, "hidden_size", path, 1, 1 << 16, g3 ? 2304 : req);
    c->hidden = llama_int_or(j, "intermediate_size", path, 1, 1 << 18, g3 ? 9216 : req);
    c->layers = llama_int_or(j, "num_hidden_layers", path, 1, LLAMA_MAX_LAYERS, g3 ? 26 : req);
    c->heads = llama_int_or(j, "num_attention_heads", path, 1, 1024, g3 ? 8 : req);
    c->kv_heads = llama_int_or(j, "num_key_value_heads", path, 1, 1024, g3 ? 4 : c->heads);
    c->vocab = llama_int_or(j, "vocab_size", path, 1, 1 << 22, g3 ? 262208 : req);
    static const char* const need[] = {"hidden_size", "intermediate_size", "num_hidden_layers",
                                       "num_attention_heads", "vocab_size"};
    int got[] = {c->dim, c->hidden, c->layers, c->heads, c->vocab};
    for (int k = 0; k < 5; k++)
        if (got[k] == req) fail("%s: missing field \"%s\"", path, need[k]);
    if (json_get(j, "head_dim") && json_get(j, "head_dim")->type != JSON_NULL) {
        c->head_dim = json_int_in(j, "head_dim", path, 2, 1024);
    } else if (!strncmp(c->family, "gemma", 5)) {
        c->head_dim = 256;  // Gemma2Config's and Gemma3TextConfig's default
    } else {
        if (c->dim % c->heads)
            fail("%s: num_attention_heads (%d) does not divide hidden_size (%d)", path, c->heads, c->dim);
        c->head_dim = c->dim / c->heads;
    }
    if (c->heads % c->kv_heads)
        fail("%s: num_key_value_heads (%d) does not divide num_attention_heads (%d)", path, c->kv_heads, c->heads);
    if (c->head_dim <= 0 || c->head_dim % 2)
        fail("%s: head dimension %d must be positive and even (RoPE rotates pairs)", path, c->head_dim);
    c->attn_scale = 1.0f / sqrtf((float)c->head_dim);
    c->max_seq = json_get(j, "max_position_embeddings") && json_get(j, "max_position_embeddings")->type != JSON_NULL
                     ? json_int_in(j, "max_position_embeddings", path, 1, 1 << 26) : g3 ? 131072 : 2048;
}

// pad_token_id: transformers builds every family's embedding with padding_idx = pad_token_id, so
// under --full that row gets no gradient from the lookup. Absent, the config class's default:
// Gemma 0, Phi-3 32000, the others none; null or outside the vocabulary: none.
static void llama_config_pad(LlamaConfig* c, const Json* j, const char* path) {
    (void)path;
    const Json* pad = json_get(j, "pad_token_id");
    int dflt = c->gemma ? 0 : c->fused ? 32000 : -1;
    c->pad_skip = !pad ? dflt : pad->type == JSON_NULL ? -1 : llama_token_id_or(j, "pad_token_id", -1);
    if (c->pad_skip >= c->vocab) c->pad_skip = -1;
}

// A gemma3 directory (Gemma3ForConditionalGeneration): its text_config is read as a gemma3_text
// config.json (with Gemma3TextConfig's defaults) and returned; vision_config is the vision tower's,
// not read. The top-level keys accepted beside them do not touch the text model's math: the image
// tokens' bookkeeping (mm_tokens_per_image, the boi/eoi/image token ids and their *_id aliases, which
// only place image embeddings among the text's), the vision part's initializer_range, token ids for
// generation (the text model's own are text_config's), and the exporters' bookkeeping. Anything
// else, or a quantization_config (a bitsandbytes multimodal checkpoint is not read here), is refused.
static const Json* llama_config_gemma3_outer(LlamaConfig* c, const Json* j, const char* path) {
    static const char* const keys[] = {
        "model_type", "architectures", "text_config", "vision_config", "mm_tokens_per_image", "boi_token_index",
        "eoi_token_index", "image_token_index", "boi_token_id", "eoi_token_id", "image_token_id",
        "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id", "_name_or_path", "torch_dtype", "dtype",
        "transformers_version", "use_cache"};
    const int nk = (int)(sizeof(keys) / sizeof(keys[0]));
    for (int i = 0; i < j->count; i++) {
        int known = 0;
        for (int k = 0; k < nk && !known; k++) known = strcmp(j->keys[i], keys[k]) == 0;
        if (!known)
            fail("%s: config key \"%.60s\" of a gemma3 directory is not one train_llama knows (it may change the "
                 "text model's math; refused rather than ignored)", path, j->keys[i]);
    }
    const Json* ar = json_get(j, "architectures");
    if (ar && ar->type != JSON_NULL) {
        if (ar->type != JSON_ARRAY) fail("%s: architectures must be a list", path);
        for (int i = 0; i < ar->count; i++)
            if (ar->items[i].type != JSON_STRING || strcmp(ar->items[i].string, "Gemma3ForConditionalGeneration"))
                fail("%s: architecture %.60s is not supported for model_type gemma3 (expected "
                     "Gemma3ForConditionalGeneration)", path,
                     ar->items[i].type == JSON_STRING ? ar->items[i].string : "(not a string)");
    }
    const Json* vc = json_get(j, "vision_config");
    if (vc && vc->type != JSON_NULL && vc->type != JSON_OBJECT) fail("%s: vision_config must be an object", path);
    const Json* tc = json_get(j, "text_config");
    if (!tc || tc->type != JSON_OBJECT)
        fail("%s: a gemma3 directory needs a text_config object (its language model's config)", path);
    if (json_get(tc, "quantization_config"))  // bnb_config_nf4 reads the top level's: refused rather than ignored
        fail("%s: text_config.quantization_config is not supported (a quantized gemma3 directory is not read)", path);
    c->multimodal = 1;
    return tc;
}

static void llama_config_load(LlamaConfig* c, const char* model_dir) {
    char* path = path_join(model_dir, "config.json");
    if (!dir_exists(model_dir)) fail("flag --model: %s is not a directory", model_dir);
    size_t n;
    char* text = read_file(path, &n);
    Json top = json_parse(text, n, path);
    if (top.type != JSON_OBJECT) fail("%s: expected a JSON object", path);
    memset(c, 0, sizeof(*c));
    const Json* mt = json_get(&top, "model_type");
    int gemma3 = mt && mt->type == JSON_STRING && !strcmp(mt->string, "gemma3");
    const Json j = gemma3 ? *llama_config_gemma3_outer(c, &top, path) : top;  // a view: freed with top
    char* file = path;  // errors in a gemma3 directory's text config name it as text_config
    if (gemma3) {
        path = (char*)xmalloc(strlen(file) + 16);
        sprintf(path, "%s text_config", file);
    }
    llama_config_family(c, &j, path);
    llama_check_known_keys(&j, path);
    llama_config_refusals(c, &j, path);
    llama_config_sizes(c, &j, path);
    // A non-positive epsilon divides by zero on an all-zero row; a non-positive base makes RoPE's
    // frequencies NaN: either would surface later as a NaN loss blamed on --lr or the data.
    c->norm_eps = json_positive_float(json_number_opt(&j, "rms_norm_eps", path, 1e-6), "rms_norm_eps", path);
    c->rope_theta = json_positive_float(json_number_opt(&j, "rope_theta", path, 10000.0), "rope_theta", path);
    c->tied = llama_config_bool(&j, "tie_word_embeddings", path, 0);
    c->bos_id = llama_token_id_or(&j, "bos_token_id", 1);
    c->eos_id = llama_token_id_or(&j, "eos_token_id", 2);
    llama_config_phi3(c, &j, path);
    llama_config_rope_scaling(c, &j, path);
    c->gemma = !strncmp(c->family, "gemma", 5);  // (the window's default reads it; llama_config_gemma sets the rest)
    llama_config_window(c, &j, path);
    int qwen2 = strcmp(c->family, "qwen2") == 0, qwen3 = strcmp(c->family, "qwen3") == 0;
    int attention_bias = llama_config_bool(&j, "attention_bias", path, 0);
    if (qwen2 && json_get(&j, "attention_bias"))
        fail("%s: attention_bias is not a qwen2 key (Qwen2's q, k, v always carry biases)", path);
    c->qkv_bias = qwen2 || attention_bias;
    c->o_bias = attention_bias;
    c->mlp_bias = llama_config_bool(&j, "mlp_bias", path, 0);
    if (c->mlp_bias && strcmp(c->family, "llama") != 0)
        fail("%s: mlp_bias is a llama key, not a %s one", path, c->family);
    c->qk_norm = qwen3;
    // a quantization_config other than bitsandbytes NF4 is refused here, before any work
    if (bnb_config_nf4(model_dir) && c->fused)
        fail("%s: a bitsandbytes 4-bit phi3 checkpoint is not supported (its fused weights would be split across "
             "quantization blocks); load the unquantized model with --quant nf4", path);
    llama_config_gemma(c, &j, path);
    llama_config_pad(c, &j, path);
    json_free(&top);
    free(text);
    if (path != file) free(file);
    free(path);
}

// ---- the tensors of the checkpoint --------------------------------------------------------------

// The Hugging Face module path of each linear of a block, in the order q, k, v, o, gate, up, down
// (llmc/models/llama.h's targets).
static const char* const llama_hf_modules[7] = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"};
// Phi-3's: q, k, v are the rows of one qkv_proj [q out + k out + v out, d] in that order, gate and up
// those of one gate_up_proj [2 hidden, d] (transformers' Phi3MLP chunks its output gate first).
static const char* const phi3_hf_modules[7] = {"self_attn.qkv_proj", "self_attn.qkv_proj", "self_attn.qkv_proj",
                                               "self_attn.o_proj",   "mlp.gate_up_proj",   "mlp.gate_up_proj",
                                               "mlp.down_proj"};

// The checkpoint's module that holds linear t, and the first linear of that module (t itself
// unless the checkpoint fuses it with the ones before it).
static const char* llama_hf_module(const LlamaConfig* c, int t) {
    return (c->fused ? phi3_hf_modules : llama_hf_modules)[t];
}
static int llama_fused_lead(const LlamaConfig* c, int t) {
    int lead = t;
    while (lead > 0 && strcmp(llama_hf_module(c, lead - 1), llama_hf_module(c, t)) == 0) lead--;
    return lead;
}
// Is linear t the first of its checkpoint module (and so the one that names it)?
static int llama_module_lead(const LlamaConfig* c, int t) { return llama_fused_lead(c, t) == t; }

// Does linear t (in llama_hf_modules' order) carry a bias in this config?
static int llama_linear_has_bias(const LlamaConfig* c, int t) {
    return t <= 2 ? c->qkv_bias : t == 3 ? c->o_bias : c->mlp_bias;
}

// Is `rest`, a tensor name after "model.layers.N.", one that this config reads in every block?
// RoPE's inv_freq (a buffer older checkpoints saved, no weight) is skipped; a bitsandbytes quant
// state ("<linear>.weight.absmax", ...) belongs to its weight.
static int llama_layer_tensor_is_used(const LlamaConfig* c, const char* rest, const char* name, int bnb) {
    if (!strcmp(rest, "input_layernorm.weight") || !strcmp(rest, "post_attention_layernorm.weight")) return 1;
    if (c->gemma && (!strcmp(rest, "pre_feedforward_layernorm.weight") ||
                     !strcmp(rest, "post_feedforward_layernorm.weight")))
        return 1;
    if (c->qk_norm && (!strcmp(rest, "self_attn.q_norm.weight") || !strcmp(rest, "self_attn.k_norm.weight"))) return 1;
    if (!strcmp(rest, "self_attn.rotary_emb.inv_freq")) return 1;
    for (int t = 0; t < 7; t++) {
        size_t k = strlen(llama_hf_module(c, t));
        if (strncmp(rest, llama_hf_module(c, t), k) != 0) continue;
        const char* part = rest + k;
        if (!strcmp(part, ".weight") || (llama_linear_has_bias(c, t) && !strcmp(part, ".bias"))) return 1;
        if (bnb && !strncmp(part, ".weight.", 8) && bnb_is_quant_state_name(name)) return 1;
    }
    return 0;
}

// Is `name` a tensor this config reads?
static int llama_tensor_is_used(const LlamaConfig* c, const char* name, int bnb) {
    if (!strcmp(name, "model.embed_tokens.weight") || !strcmp(name, "model.norm.weight")) return 1;
    if (!strcmp(name, "lm_head.weight")) return 1;  // tied: checked against the embedding by the caller
    int l = -1, at = 0;
    if (sscanf(name, "model.layers.%d.%n", &l, &at) != 1 || at == 0 || l < 0 || l >= c->layers) return 0;
    char first[32];
    snprintf(first, sizeof(first), "model.layers.%d.", l);
    if (strncmp(name, first, strlen(first)) != 0) return 0;  // "model.layers.01." is not layer 1
    return llama_layer_tensor_is_used(c, name + strlen(first), name, bnb);
}

// The text model's name of checkpoint tensor `name` (model.layers.N..., model.norm.weight, lm_head.weight),
// or NULL for a gemma3 directory's vision tensor; a name that is neither stays as it is (and is refused
// by llama_check_tensor_names).
static const char* llama_text_name(const LlamaConfig* c, const char* name) {
    if (!c->multimodal) return name;
    size_t k = strlen(LLAMA_MM_PREFIX);
    if (!strncmp(name, LLAMA_MM_PREFIX, k)) return name + k;
    for (int v = 0; v < 2; v++)
        if (!strncmp(name, LLAMA_MM_VISION[v], strlen(LLAMA_MM_VISION[v]))) return NULL;
    return name;
}

// The checkpoint seen as the text model's: a gemma3 directory's tensors are looked up under LLAMA_MM_PREFIX.
static void llama_checkpoint_view(const LlamaConfig* c, StModel* sm) {
    if (c->multimodal) snprintf(sm->prefix, sizeof(sm->prefix), "%s", LLAMA_MM_PREFIX);
}

// Every tensor of the checkpoint is one the model reads, or the load is refused naming the first
// that is not; with tied embeddings a stored lm_head.weight must equal the embedding (transformers
// ties them, so a different one would be dropped there too, silently). A gemma3 directory's vision
// tensors are not read: one line says so, with their count.
static void llama_check_tensor_names(const LlamaConfig* c, const StModel* sm, int bnb) {
    int vision = 0;
    for (int f = 0; f < sm->nfiles; f++)
        for (int i = 0; i < sm->files[f].count; i++) {
            const StTensor* t = &sm->files[f].tensors[i];
            const char* name = llama_text_name(c, t->name);
            if (!name) { vision++; continue; }
            if (name == t->name && c->multimodal)
                fail("%s: tensor \"%.120s\" is neither the language model's (" LLAMA_MM_PREFIX "*) nor the vision "
                     "part's of a gemma3 checkpoint (refused rather than ignored)", t->file, t->name);
            if (!llama_tensor_is_used(c, name, bnb))
                fail("%s: tensor \"%.120s\" is not part of a %s model with this config.json (refused rather than "
                     "ignored)", t->file, t->name, c->family);
        }
    if (c->multimodal)
        printf("gemma3: the language model (" LLAMA_MM_PREFIX "*) is trained; the %d vision tensors (vision_tower.*, "
               "multi_modal_projector.*) are not read (the merged export copies them unchanged)\n", vision);
    const StTensor* head = st_model_find(sm, "lm_head.weight");
    if (!c->tied || !head) return;
    const StTensor* emb = st_model_require(sm, "model.embed_tokens.weight");
    if (head->dtype != emb->dtype || head->nbytes != emb->nbytes || memcmp(head->data, emb->data, head->nbytes) != 0)
        fail("%s: tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight", head->file);
}
