// test/llama_probe.cu: runs one forward + backward of train_llama's model on a batch given in a
// safetensors "case" file (tokens, mask, LoRA weights) and writes logits, loss and every LoRA
// gradient to another safetensors file, for comparison with the PyTorch reference
// (scripts/reference_llama.py, test/test_llama_model.py). Same flags as train_llama.
#define TESTING
#include "../train_llama.cu"

static const StTensor* case_tensor(const StFile* f, const char* name, StDtype dtype) {
    const StTensor* t = st_find(f, name);
    if (!t) fail("%s: missing tensor \"%s\"", f->path, name);
    if (t->dtype != dtype) fail("%s: tensor \"%s\" has dtype %s, expected %s", f->path, name, st_dtype_name(t->dtype), st_dtype_name(dtype));
    return t;
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
    flags_parse(&ft, argc, argv);
    train_resolve_mode(&o);
    if (!o.model_dir || !case_path || !out_path) fail("llama_probe needs --model, --case and --out-file");
    LlamaConfig cfg;
    llama_config_load(&cfg, o.model_dir);
    LlamaModes md = llama_modes_from(&o);
    StFile cf;
    st_open(&cf, case_path);
    const StTensor* tokens = case_tensor(&cf, "tokens", ST_I32);
    const StTensor* mask = case_tensor(&cf, "mask", ST_F32);
    int B = (int)tokens->shape[0], T = (int)tokens->shape[1] - 1;
    Llama m;
    llama_setup(&m, &cfg, &md, B, T, 4, 4, NULL);
    plan_allocate_host(&m.plan);
    llama_bind(&m);
    llama_load_weights(&m, o.model_dir);
    llama_rope_tables(&m);
    const int32_t* tk = (const int32_t*)tokens->data;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            m.inputs[b * T + t] = tk[b * (T + 1) + t];
            m.targets[b * T + t] = tk[b * (T + 1) + t + 1];
        }
    memcpy(m.mask, mask->data, sizeof(float) * B * T);
    // optional "starts" U8 [B, T]: 1 where an input token begins a packed example
    const StTensor* starts = st_find(&cf, "starts");
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            int s0 = t == 0 || (starts && starts->data[b * T + t]);
            m.pos[b * T + t] = s0 ? 0 : m.pos[b * T + t - 1] + 1;
        }
    char name[128];
    for (int l = 0; l < cfg.layers; l++)
        for (int t = 0; t < N_TARGETS; t++) {
            Linear* L = &m.layers[l].lin[t];
            if (!L->A) continue;
            snprintf(name, sizeof(name), "lora.%d.%s.A", l, target_names[t]);
            const StTensor* a = case_tensor(&cf, name, ST_F32);
            int64_t sa[2] = {md.rank, L->in}, sb[2] = {L->out, md.rank};
            st_check_shape(a, 2, sa);
            memcpy(L->A, a->data, a->nbytes);
            snprintf(name, sizeof(name), "lora.%d.%s.B", l, target_names[t]);
            const StTensor* bt = case_tensor(&cf, name, ST_F32);
            st_check_shape(bt, 2, sb);
            memcpy(L->B, bt->data, bt->nbytes);
        }
    double count = count_mask(m.mask, (int64_t)B * T);
    float* logits = (float*)xmalloc(sizeof(float) * B * T * cfg.vocab);
    LossStats st = llama_forward_backward(&m, B, T, count > 0 ? (float)(1.0 / count) : 0.0f, 1, logits);
    float loss = count > 0 ? (float)(st.loss_sum / count) : 0.0f;
    StWriter w;
    memset(&w, 0, sizeof(w));
    int64_t ls[3] = {B, T, cfg.vocab}, one = 1;
    st_writer_add(&w, "logits", ST_F32, 3, ls, logits);
    st_writer_add(&w, "loss", ST_F32, 1, &one, &loss);
    static char names[2 * N_TARGETS * 256][64];
    int k = 0;
    for (int l = 0; l < cfg.layers; l++)
        for (int t = 0; t < N_TARGETS && md.full; t++) {  // --full: the gradient of every linear weight
            Linear* L = &m.layers[l].lin[t];
            int64_t sw[2] = {L->out, L->in};
            snprintf(names[k], 64, "grad.%d.%s.W", l, target_names[t]);
            st_writer_add(&w, names[k++], ST_F32, 2, sw, L->dW);
        }
    for (int l = 0; l < cfg.layers; l++)
        for (int t = 0; t < N_TARGETS; t++) {
            Linear* L = &m.layers[l].lin[t];
            if (!L->A) continue;
            if (k + 2 > (int)(sizeof(names) / sizeof(names[0]))) fail("too many adapters for the probe");
            int64_t sa[2] = {md.rank, L->in}, sb[2] = {L->out, md.rank};
            snprintf(names[k], 64, "grad.lora.%d.%s.A", l, target_names[t]);
            st_writer_add(&w, names[k++], ST_F32, 2, sa, L->dA);
            snprintf(names[k], 64, "grad.lora.%d.%s.B", l, target_names[t]);
            st_writer_add(&w, names[k++], ST_F32, 2, sb, L->dB);
        }
    st_writer_save(&w, out_path, NULL);
    st_writer_free(&w);
    free(logits);
    st_close(&cf);
    llama_free(&m);
    return 0;
}
