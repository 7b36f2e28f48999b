// test/model/llama_probe.cu: runs one forward + backward of train_llama's model on a batch given in a
// safetensors "case" file (tokens, mask, LoRA weights) and writes logits, loss and every LoRA
// gradient to another safetensors file, for comparison with the PyTorch reference
// (test/model/reference_llama.py, test/model/test_llama_model.py), or for backend-against-backend checks
// (--device cuda vs --device cpu, test/cuda/test_llama_cuda.py). Same flags as train_llama.
#define TESTING
#include "../../train_llama.cu"
#include "probe_common.h"

// Memory outside the plan, for the probe's download buffer (the trainers plan everything they
// allocate, so this lives here, not in llmc/backend.h): malloc or cudaMalloc.
static void* probe_alloc(const Backend* be, size_t bytes, const char* what) {
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) return cuda_malloc_checked(bytes, what);
#endif
    (void)be;
    void* p = calloc(1, bytes ? bytes : 1);
    if (!p) fail("cannot allocate %.1f MiB of host memory for %s", bytes / 1048576.0, what);
    return p;
}
static void probe_free(const Backend* be, void* p) {
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) { CUDA_CHECK(cudaFree(p)); return; }
#endif
    (void)be;
    free(p);
}

int main(int argc, char** argv) {
    TrainOptions o;
    train_options_defaults(&o);
    const char *case_path = NULL, *out_path = NULL;
    FlagTable ft;
    memset(&ft, 0, sizeof(ft));
    llama_flags(&ft, &o);
    ft.program = "llama_probe";
    ft.group = "probe";
    flag_string(&ft, "case", &case_path, "input safetensors: tokens I32 [B,T+1], mask F32 [B,T], lora.{l}.{t}.A/B");
    flag_string(&ft, "out-file", &out_path, "output safetensors: logits, loss, grad.lora.{l}.{t}.A/B");
    int drop_step = 0, drop_row0 = 0;
    flag_int(&ft, "dropout-step", &drop_step, "with --lora-dropout: the optimizer step that keys the masks");
    flag_int(&ft, "dropout-row0", &drop_row0, "with --lora-dropout: the batch's first row in the step's global batch");
    flags_parse(&ft, argc, argv);
    train_resolve_mode(&o);
    if (!o.model_dir || !case_path || !out_path) fail("llama_probe needs --model, --case and --out-file");
    LlamaConfig cfg;
    llama_config_load(&cfg, o.model_dir);
    TrainModes md = train_modes_from(&o, target_names, N_TARGETS);
    md.lora_dropout = o.full ? 0.0f : o.lora_dropout;  // a training pass, without --data
    StFile cf;
    st_open(&cf, case_path);
    const StTensor* tokens = case_tensor(&cf, "tokens", ST_I32);
    const StTensor* mask = case_tensor(&cf, "mask", ST_F32);
    int B = (int)tokens->shape[0], T = (int)tokens->shape[1] - 1;
    Backend be;
    backend_init(&be, o.device, 0);
    Llama m;
    llama_setup(&m, &cfg, &md, B, T, &be, NULL);
    llama_allocate(&m);
    llama_load_weights(&m, o.model_dir);
    llama_rope_tables(&m);
    const int32_t* tk = (const int32_t*)tokens->data;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            m.io.h_inputs[b * T + t] = tk[b * (T + 1) + t];
            m.io.h_targets[b * T + t] = tk[b * (T + 1) + t + 1];
        }
    memcpy(m.io.h_mask, mask->data, sizeof(float) * B * T);
    // optional "starts" U8 [B, T]: 1 where an input token begins a packed example
    const StTensor* starts = st_find(&cf, "starts");
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            int s0 = t == 0 || (starts && starts->data[b * T + t]);
            m.io.h_pos[b * T + t] = s0 ? 0 : m.io.h_pos[b * T + t - 1] + 1;
        }
    double count = count_mask(m.io.h_mask, (int64_t)B * T);
    float grad_scale = count > 0 ? (float)(1.0 / count) : 0.0f;
    batch_values_set_loss_scale(&m.io.bv, grad_scale);  // (CUDA: the loss kernels read it from device memory)
    m.drop.step = (uint64_t)drop_step;     // a training pass: dropout on, as llama_train_step sets it (before
    m.drop.row0 = drop_row0;               // the upload: CUDA's dropout kernels read them from device memory)
    llama_upload_batch(&m, (int64_t)B * T);
    for (int l = 0; l < cfg.layers; l++)
        for (int t = 0; t < N_TARGETS; t++) probe_load_lora(&cf, &m.w.layers[l].lin[t], l, target_names[t], md.rank);
    trainable_to_device(&m.w.tr);
    int64_t nlogits = (int64_t)B * T * cfg.vocab;
    float* logits_be = (float*)probe_alloc(&be, sizeof(float) * nlogits, "probe logits");
    float* logits = (float*)xmalloc(sizeof(float) * nlogits);
    m.drop.active = 1;
    LossStats st = llama_forward_backward(&m, B, T, grad_scale, 1, logits_be, NULL);
    backend_download(&be, logits, logits_be, sizeof(float) * nlogits);
    probe_free(&be, logits_be);
    trainable_to_host(&m.w.tr, 1);
    float loss = count > 0 ? (float)(st.loss_sum / count) : 0.0f;
    StWriter w;
    memset(&w, 0, sizeof(w));
    int64_t ls[3] = {B, T, cfg.vocab}, one = 1;
    st_writer_add(&w, "logits", ST_F32, 3, ls, logits);
    st_writer_add(&w, "loss", ST_F32, 1, &one, &loss);
    for (int l = 0; l < cfg.layers; l++)
        for (int t = 0; t < N_TARGETS; t++) probe_add_grads(&w, &m.w.layers[l].lin[t], l, target_names[t], md.rank);
    // --full: the other trained weights' gradients, from the host mirror of the gradient arena
    int64_t vd[2] = {cfg.vocab, cfg.dim}, dd = cfg.dim;
    char nm[64];
#define HOST_GRAD(g) (m.w.tr.h_grads + ((g) - m.w.tr.grads))
    if (m.w.dembed) st_writer_add(&w, "grad.embed", ST_F32, 2, vd, HOST_GRAD(m.w.dembed));
    if (m.w.dlm_head && !cfg.tied) st_writer_add(&w, "grad.lm_head", ST_F32, 2, vd, HOST_GRAD(m.w.dlm_head));
    if (m.w.dfinal_norm) st_writer_add(&w, "grad.final_norm", ST_F32, 1, &dd, HOST_GRAD(m.w.dfinal_norm));
    int64_t hd = cfg.head_dim;
    for (int l = 0; l < cfg.layers; l++) {  // the block norms (standard norms), Qwen3's q/k norms, Gemma's post norms
        const LlamaLayer* L = &m.w.layers[l];
        const char* names[6] = {"attn_norm", "mlp_norm", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm"};
        const float* grads[6] = {L->dattn_norm, L->dmlp_norm, L->dq_norm, L->dk_norm, L->dpost_attn_norm,
                                 L->dpost_mlp_norm};
        for (int k = 0; k < 6; k++) {
            if (!grads[k]) continue;
            snprintf(nm, sizeof(nm), "grad.%d.%s", l, names[k]);
            st_writer_add(&w, nm, ST_F32, 1, k == 2 || k == 3 ? &hd : &dd, HOST_GRAD(grads[k]));
        }
    }
#undef HOST_GRAD
    st_writer_save(&w, out_path, NULL);
    st_writer_free(&w);
    free(logits);
    st_close(&cf);
    llama_free(&m);
    return 0;
}
