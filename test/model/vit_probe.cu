// test/model/vit_probe.cu: runs train_vit's model and loader on inputs given in files and writes what
// they computed to a safetensors file, for comparison with the PyTorch reference
// (test/model/reference_vit.py, test/model/test_vit_model.py), or for backend-against-backend checks
// (--device cuda vs --device cpu, test/cuda/test_vit_cuda.py). Same flags as train_vit, plus:
//   --case CASE --out-file OUT    one forward + backward of a batch:
//       CASE: pixels F32 [B, C, H, W] (normalised, at the fine-tuning resolution), labels I32 [B],
//             lora.{l}.{t}.A [r, in] / .B [out, r], head.weight [K, d], head.bias [K]
//       OUT:  logits [B, K], loss [1], grad.lora.{l}.{t}.A/B, grad.head.weight, grad.head.bias
//             (--full: the case's adapters are ignored; instead of the LoRA gradients those of
//             every weight: grad.{l}.{t}.W / .b of each linear (of the merged layer under --norm
//             ms), grad.{l}.ln1.g / ln1.b / ln2.g / ln2.b (--norm std), grad.patch_w [d, C, ph, pw],
//             grad.patch_b, grad.cls [1, 1, d], grad.pos [1, T, d], grad.norm_g, grad.norm_b)
//   --data SHARD --dump-batches N --out-file OUT    the loader's first N training batches:
//       OUT:  pixels F32 [N*B, C, H, W], labels I32 [N*B], index I32 (image in the shard),
//             flip I32 (1 = flipped)
#define TESTING
#include "../../train_vit.cu"
#include "probe_common.h"

static void dump_batches(const VitConfig* cfg, const TrainOptions* o, int batches, const char* out_path) {
    ImageShard s;
    image_shard_load(&s, o->data_path);
    int h, w, B = o->batch, C = cfg->channels;
    vit_resolution(cfg, o->image_size, &h, &w);
    vit_preprocessor_check_images(&cfg->pre, o->data_path, s.H, s.W);
    ImageLoader L;
    image_loader_init(&L, &s, h, w, C, cfg->mean, cfg->std, (uint64_t)o->seed, 1, o->hflip);
    int64_t n = (int64_t)batches * B, per = (int64_t)C * h * w;
    float* pixels = (float*)xmalloc(sizeof(float) * n * per);
    int32_t *labels = (int32_t*)xmalloc(4 * n), *index = (int32_t*)xmalloc(4 * n), *flip = (int32_t*)xmalloc(4 * n);
    for (int k = 0; k < batches; k++) {
        for (int b = 0; b < B; b++) {  // what the next call will pick, from the same rules
            int64_t g = L.cursor + b;
            index[k * B + b] = (int32_t)image_loader_index(&L, g);
            flip[k * B + b] = image_loader_flip(&L, g);
        }
        image_loader_next(&L, B, 0, 1, pixels + k * B * per, labels + k * B);
    }
    StWriter wr;
    memset(&wr, 0, sizeof(wr));
    int64_t ps[4] = {n, C, h, w};
    st_writer_add(&wr, "pixels", ST_F32, 4, ps, pixels);
    st_writer_add(&wr, "labels", ST_I32, 1, &n, labels);
    st_writer_add(&wr, "index", ST_I32, 1, &n, index);
    st_writer_add(&wr, "flip", ST_I32, 1, &n, flip);
    st_writer_save(&wr, out_path, NULL);
    st_writer_free(&wr);
    free(pixels); free(labels); free(index); free(flip);
    image_loader_free(&L);
    image_shard_free(&s);
}

// The host mirror of a gradient in the trainable arena (backend pointer g).
static float* host_grad(const Vit* m, const float* g) { return m->params.tr.h_grads + (g - m->params.tr.grads); }

// --full: the gradients of the embeddings and the norms.
static void add_full_grads(StWriter* wr, const Vit* m) {
    const VitConfig* c = &m->cfg;
    int64_t d = c->dim, spw[4] = {d, c->channels, c->patch_h, c->patch_w}, sc[3] = {1, 1, d}, sp[3] = {1, m->T, d};
    st_writer_add(wr, "grad.patch_w", ST_F32, 4, spw, m->params.patch.dW);
    st_writer_add(wr, "grad.patch_b", ST_F32, 1, &d, host_grad(m, m->params.dpatch_b));
    st_writer_add(wr, "grad.cls", ST_F32, 3, sc, host_grad(m, m->params.dcls));
    st_writer_add(wr, "grad.pos", ST_F32, 3, sp, host_grad(m, m->params.dpos));
    st_writer_add(wr, "grad.norm_g", ST_F32, 1, &d, host_grad(m, m->params.dnorm_g));
    st_writer_add(wr, "grad.norm_b", ST_F32, 1, &d, host_grad(m, m->params.dnorm_b));
    const char* names[N_LN] = {"ln1.g", "ln1.b", "ln2.g", "ln2.b"};
    char name[64];
    for (int l = 0; l < c->layers; l++)
        for (int k = 0; k < N_LN && m->params.layers[l].ln_grad[k]; k++) {
            snprintf(name, sizeof(name), "grad.%d.%s", l, names[k]);
            st_writer_add(wr, name, ST_F32, 1, &d, host_grad(m, m->params.layers[l].ln_grad[k]));
        }
}

// Given pixels [B, C, H, W] (fp32, host) and labels (in h_labels): the batch on the backend.
static void vit_set_batch(Vit* m, const float* pixels, int B) {
    const VitConfig* c = &m->cfg;
    int64_t n = (int64_t)B * c->channels * m->img_h * m->img_w;
    backend_upload_weights(m->be, m->batch.pixels, pixels, n);  // bf16 on CUDA
    backend_upload(m->be, m->batch.labels, m->batch.h_labels, sizeof(int) * B);
}

int main(int argc, char** argv) {
    TrainOptions o;
    train_options_defaults(&o);
    const char *case_path = NULL, *out_path = NULL;
    int dump = 0;
    FlagTable ft;
    memset(&ft, 0, sizeof(ft));
    vit_flags(&ft, &o);
    ft.program = "vit_probe";
    ft.group = "probe";
    flag_string(&ft, "case", &case_path,
                "input safetensors: pixels F32 [B,C,H,W], labels I32 [B], lora.{l}.{t}.A/B, head.weight, head.bias");
    flag_string(&ft, "out-file", &out_path,
                "output safetensors: logits, loss, grad.lora.{l}.{t}.A/B, grad.head.weight/bias");
    flag_int(&ft, "dump-batches", &dump, "with --data: write the loader's first N batches instead");
    int drop_step = 0, drop_row0 = 0;
    flag_int(&ft, "dropout-step", &drop_step, "with --lora-dropout: the optimizer step that keys the masks");
    flag_int(&ft, "dropout-row0", &drop_row0, "with --lora-dropout: the batch's first row in the step's global batch");
    flags_parse(&ft, argc, argv);
    train_resolve_mode(&o);
    if (!o.model_dir || !out_path || (!case_path && !dump))
        fail("vit_probe needs --model, --out-file and --case (or --data with --dump-batches)");
    VitConfig cfg;
    vit_config_load(&cfg, o.model_dir);
    if (dump) {
        if (!o.data_path) fail("flag --dump-batches needs --data");
        dump_batches(&cfg, &o, dump, out_path);
        return 0;
    }
    TrainModes md = train_modes_from(&o, target_names, N_TARGETS);
    md.lora_dropout = o.full ? 0.0f : o.lora_dropout;  // a training pass, without --data
    StFile cf;
    st_open(&cf, case_path);
    const StTensor* px = case_tensor(&cf, "pixels", ST_F32);
    const StTensor* lb = case_tensor(&cf, "labels", ST_I32);
    const StTensor* hw = case_tensor(&cf, "head.weight", ST_F32);
    if (px->ndim != 4 || px->shape[1] != cfg.channels)
        fail("%s: pixels must be [B, %d, H, W]", case_path, cfg.channels);
    if (hw->ndim != 2) fail("%s: head.weight must be [classes, d]", case_path);
    int B = (int)px->shape[0], h = (int)px->shape[2], w = (int)px->shape[3], K = (int)hw->shape[0];
    int64_t lshape[1] = {B}, hshape[2] = {K, cfg.dim};
    st_check_shape(lb, 1, lshape);
    st_check_shape(hw, 2, hshape);
    Backend be;
    backend_init(&be, o.device, 0);
    Vit m;
    vit_setup(&m, &cfg, &md, B, h, w, K, 0, &be, NULL);
    vit_allocate(&m);
    vit_load_weights(&m, o.model_dir);
    const int32_t* labels = (const int32_t*)lb->data;
    for (int b = 0; b < B; b++) {
        if (labels[b] < 0 || labels[b] >= K) fail("%s: label %d outside [0, %d)", case_path, labels[b], K);
        m.batch.h_labels[b] = labels[b];
    }
    vit_set_batch(&m, (const float*)px->data, B);
    memcpy(m.params.h_head_w, hw->data, hw->nbytes);
    const StTensor* hb = case_tensor(&cf, "head.bias", ST_F32);
    st_check_shape(hb, 1, &hshape[0]);
    memcpy(m.params.h_head_b, hb->data, hb->nbytes);
    for (int l = 0; l < cfg.layers; l++)
        for (int t = 0; t < N_TARGETS; t++)
            probe_load_lora(&cf, &m.params.layers[l].lin[t], l, target_names[t], md.rank);
    trainable_to_device(&m.params.tr);
    trainable_zero_grads(&m.params.tr);
    float* logits = (float*)xmalloc(sizeof(float) * B * K);
    m.drop.step = (uint64_t)drop_step;  // a training pass: dropout on, as vit_train_step sets it
    m.drop.row0 = drop_row0;
    batch_values_set_loss_scale(&m.batch.bv, 1.0f / B);  // (CUDA: the kernels read these from device memory)
    staging_begin(&m.batch.staging);
    batch_values_stage(&m.batch.bv, &m.batch.staging, &m.drop);
    staging_end(&m.batch.staging);
    m.drop.active = 1;
    LossStats st = vit_forward_backward(&m, B, 1.0f / B, 1, logits, NULL);
    trainable_to_host(&m.params.tr, 1);
    float loss = (float)(st.loss_sum / B);
    StWriter wr;
    memset(&wr, 0, sizeof(wr));
    int64_t ls[2] = {B, K}, one = 1;
    st_writer_add(&wr, "logits", ST_F32, 2, ls, logits);
    st_writer_add(&wr, "loss", ST_F32, 1, &one, &loss);
    st_writer_add(&wr, "grad.head.weight", ST_F32, 2, hshape, m.params.h_dhead_w);
    st_writer_add(&wr, "grad.head.bias", ST_F32, 1, &hshape[0], m.params.h_dhead_b);
    for (int l = 0; l < cfg.layers; l++)
        for (int t = 0; t < N_TARGETS; t++)
            probe_add_grads(&wr, &m.params.layers[l].lin[t], l, target_names[t], md.rank);
    if (md.full) add_full_grads(&wr, &m);
    st_writer_save(&wr, out_path, NULL);
    st_writer_free(&wr);
    free(logits);
    st_close(&cf);
    vit_free(&m);
    return 0;
}
