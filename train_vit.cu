// train_vit.cu: fine-tuning of Vision Transformers (ViT-B/16 style) for image classification (LoRA
// adapters and a new head, or every weight with --full) with the memory-saving backward pass of
// "Reducing Fine-Tuning Memory Overhead by Approximate and Memory-Sharing Backpropagation":
// ReGELU2 (exact GELU forward, 2-bit backward) and MS-LN (gamma and beta merged into the next
// linears; backward from the normalised output and one scalar per row).
//
// Read top to bottom: config -> parameters -> memory plan -> weight loading -> forward -> backward
// -> training step and evaluation -> adapters and state -> export -> main (the data, the dry run,
// the training loop, the flags, main). The checkpoints' layouts (Hugging Face, timm) and the
// merged export's rewriting of them are llmc/models/vit_checkpoint.h; the loop's shared pieces are
// llmc/train/loop.h, the optimizer llmc/train/zero.h. The model is written once; the operations
// it calls (llmc/ops.h) run on the backend chosen by --device: the CPU (fp32) or a CUDA GPU (bf16
// activations and frozen weights, fp32 statistics, LoRA masters, the head, gradients and AdamW
// state). Same shape as train_llama.cu, with which it shares the LoRA linear (llmc/linear.h), the
// plan, the flags, the backend and the optimizer.
#include <omp.h>
#include "llmc/common.h"
#include "llmc/formats/json.h"
#include "llmc/formats/safetensors.h"
#include "llmc/train/flags.h"
#include "llmc/rng.h"
#include "llmc/vision/imagedata.h"
#include "llmc/vision/preprocessor.h"
#include "llmc/vision/resample.h"
#include "llmc/memory/plan.h"
#include "llmc/train/run_options.h"
#include "llmc/linear.h"
#include "llmc/formats/peft.h"
#include "llmc/models/vit_checkpoint.h"
#include "llmc/train/train_state.h"
#include "llmc/train/batch_values.h"
#include "llmc/train/dist.h"
#include "llmc/train/trainable.h"
#include "llmc/train/zero.h"
#include "llmc/train/loop.h"
#include "llmc/backend.h"
#include "llmc/ops.h"
#ifdef LLMC_HAVE_CUDA
#include "llmc/cuda/graph.cuh"
#endif
#include "llmc/train/fit.h"
#include "llmc/memory/checkpoints.h"

// ----------------------------------------------------------------------------------------------
// Config: config.json of a Hugging Face ViT (ViTModel / ViTForImageClassification), and its
// preprocessor_config.json (llmc/vision/preprocessor.h; 0.5 / 0.5 when absent, the Hugging Face
// ViT default).

typedef struct {
    int dim, hidden, layers, heads, head_dim, channels;
    int image_h, image_w, patch_h, patch_w;  // pretraining resolution: the position embedding's grid
    float norm_eps;
    int gelu_tanh;         // hidden_act gelu_pytorch_tanh / gelu_new: the tanh form
    int qkv_bias;          // false: q, k, v have no bias in the checkpoint (zeros here)
    float mean[3], std[3]; // per channel, on pixels scaled to [0, 1] (pre's)
    VitPreprocessor pre;   // preprocessor_config.json
} VitConfig;

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
// Parameters. Frozen weights live in one arena (of the backend). The trainable ones (LoRA
// adapters or, under --full, every weight; then the new classification head), their grads and
// AdamW moments live in flat arenas of identical layout, so the optimizer and gradient norm see
// one array.

// The linears of a block, in the order of the checkpoints' names (llmc/models/vit_checkpoint.h).
enum { T_Q = VIT_Q, T_K = VIT_K, T_V = VIT_V, T_PROJ = VIT_PROJ, T_FC1 = VIT_FC1, T_FC2 = VIT_FC2,
       N_TARGETS = VIT_LINEARS };
static const char* const target_names[N_TARGETS] = {"q", "k", "v", "proj", "fc1", "fc2"};

// The four LayerNorm vectors of a block, in this order in Vit.norms_host.
enum { LN1_G = VIT_LN1_G, LN1_B = VIT_LN1_B, LN2_G = VIT_LN2_G, LN2_B = VIT_LN2_B, N_LN = VIT_BLOCK_NORMS };

// Weights and activations are backend buffers (`void*`: fp32 on the CPU, bf16 on CUDA); norm
// statistics and the attention lse are fp32 on both.
typedef struct {
    void *ln1_g, *ln1_b;   // attention LayerNorm (merged into q,k,v under MS-LN; their adapters still apply it)
    void *ln2_g, *ln2_b;   // MLP LayerNorm (merged into fc1 under MS-LN)
    float* ln_host[N_LN];  // the same on the host, fp32 (Vit.norms_host, or the trainable arena's mirror)
    float* ln_grad[N_LN];  // --full with standard norms: their gradients (backend, fp32); else NULL
    Linear lin[N_TARGETS]; // W and bias also on the host in fp32 (adapters and export read them)
} VitLayer;

// The buffers one block keeps for its backward (or, where not kept, a shared scratch copy).
typedef struct {
    void* x_in;            // block input          (standard attention LayerNorm)
    float *mean1, *r1;     // per token            (mean: standard LayerNorm only)
    void* z1;              // attention norm output = q,k,v input
    void *q, *k, *v, *o;   // attention; o = proj input
    float* lse;            // [B, H, T] log-sum-exp
    void* ax[N_TARGETS];   // LoRA A x per adapter
    void* h_mid;           // residual after attention (standard MLP LayerNorm)
    float *mean2, *r2;
    void* z2;              // MLP norm output = fc1 input
    void* h;               // fc1 output = GELU input (exact GELU backward)
    uint8_t* codes;        // 2-bit ReGELU2 codes of h
    void* g;               // gelu(h) = fc2 input
} BlockActs;

typedef struct {
    VitConfig cfg;
    TrainModes modes;
    const Backend* be;
    int B;                 // planned micro-batch (images)
    int img_h, img_w;      // fine-tuning resolution
    int grid_h, grid_w;    // patch grid at that resolution
    int T;                 // tokens per image: class token + grid_h * grid_w patches
    int classes;
    const Dist* dist;      // ZeRO-1 sharding of the AdamW state under --full (NULL: one process)
    Linear patch;          // the patch embedding as a linear layer over unfolded patches: W [d, C*ph*pw]
                           // (the conv kernel [d, C, ph, pw], flattened); no bias here, since the
                           // class-token rows take none: op_patch_embed_finish adds it
    void* patch_b;         // [d]
    void* cls;             // [d] class token
    void* pos;             // [T, d] at the fine-tuning resolution (interpolated at load)
    void *norm_g, *norm_b; // final LayerNorm (kept standard: only the class token goes through it)
    // --full trains the above too: their fp32 masters' host mirrors (what loading fills) and their
    // gradients (backend, fp32); NULL when frozen
    float *h_patch_b, *h_cls, *h_pos, *h_norm_g, *h_norm_b;
    float *dpatch_b, *dcls, *dpos, *dnorm_g, *dnorm_b;
    VitLayer* layers;
    float* norms_host;     // [layers][N_LN][d] the blocks' LayerNorm vectors on the host (MS merge, adapters, export)
    float* lin_host;       // CUDA: the host fp32 W and bias of every linear (the plan holds them on the CPU)
    Trainable tr;          // flat trainable arenas: LoRA (or, --full, every weight), then head W, head b
    float *head_w, *head_b, *dhead_w, *dhead_b;  // [classes, d], [classes] inside the backend's arenas
    float *h_head_w, *h_head_b, *h_dhead_w, *h_dhead_b;  // the same in the host mirror
    BlockActs* acts;       // [layers]
    BlockActs tmp;         // scratch set (recompute, or buffers not kept)
    Checkpoints ckpt;      // --recompute block: each block's input [N, d] (--offload host: on the host)
    // scratch (activation gradients have the activations' element type)
    void* pixels;          // [B, C, H, W] normalised input: fp32 from the CPU loader, or bf16 resized on the GPU
    int* labels;           // [B]
    int* h_labels;         // the labels as the loader writes them (host; == labels on the CPU)
    // CUDA: the raw images go up and the GPU resizes, flips and normalises them
    uint8_t *raw, *h_raw;  // [B, source bytes] (pinned staging on the host)
    int *flip, *h_flip;    // [B]
    BatchStaging staging;  // CUDA: the batch's way up, double buffered (llmc/backend.h)
    int micro_batches;     // per optimizer step (--grad-accum; 0: one), which sizes the staging
    void* taps;            // ResampleTaps [img_h + img_w]: rows, then columns
    int64_t src_bytes;     // the largest source image of the run's shards
    void* patches;         // [B*T, C*ph*pw] unfolded patches (class-token rows zero)
    void *resid, *resid_tmp, *dres, *dz, *dq, *dk, *dv, *dout, *dh, *dax;
    void* att_work;        // CUDA attention: the tensor-core path's chunk of scores (llmc/memory/cuda_workspace.h)
    size_t att_work_bytes;
    void* blas_work;       // CUDA: cuBLAS's and cuBLASLt's workspace (llmc/memory/cuda_workspace.h)
    void* lora_norm_work;  // MS-LN, --ms-lora exact: the adapters' scratch (llmc/linear.h), else NULL
    LoraDropout drop;      // --lora-dropout: the masks' key and the adapters' input scratch (llmc/lora_dropout.h)
    void* drop_work;
    BatchValues bv;        // CUDA: the loss scale and dropout key the kernels read from device memory
    int64_t* layer_off;    // [layers] where each block's trainable values start in the arena
    // the head on the class tokens [B, .]: final LayerNorm in the activation type, then fp32
    void *xcls, *zcls, *dzcls, *dxcls;
    float *mcls, *rcls;
    float *zcls32, *dzcls32;   // fp32 copies of zcls / dzcls for the fp32 head (the same buffers on the CPU)
    float *logits, *dlogits;   // [B, classes] fp32
    CeBuffers ce;
    MemPlan plan;
#ifdef LLMC_HAVE_CUDA
    CudaGraph graph;       // LLMC_CUDA_GRAPH=1: each micro-batch's forward + backward replayed as one CUDA graph
#endif
} Vit;

static int64_t lin_in(const VitConfig* c, int t) { return t == T_FC2 ? c->hidden : c->dim; }
static int64_t lin_out(const VitConfig* c, int t) { return t == T_FC1 ? c->hidden : c->dim; }
static int64_t patch_len(const VitConfig* c) { return (int64_t)c->channels * c->patch_h * c->patch_w; }

// Under MS-LN (and LoRA), q, k, v (fc1) absorbed the gamma and beta of the norm that feeds them
// (W' = W diag(gamma), b' = b + W beta), but their adapters keep acting on gamma*z + beta as in the
// original model (llmc/linear.h), so they train exactly what --norm std trains; --ms-lora merged
// puts them on z (the paper's variant).
static int vit_adapters_see_affine(const Vit* m) { return m->modes.ms && !m->modes.full && !m->modes.ms_lora_merged; }
static int vit_lora_behind_norm(const Vit* m) {
    unsigned normed = (1u << T_Q) | (1u << T_K) | (1u << T_V) | (1u << T_FC1);
    return vit_adapters_see_affine(m) && (m->modes.targets & normed);
}

// ----------------------------------------------------------------------------------------------
// The memory plan: every buffer, by module, with the element sizes of the planned backend
// (`wbytes` / `abytes`: fp32 on the CPU, bf16 on CUDA). Per token and block, LoRA on all six
// linears, the baseline keeps 16d + 4f bytes in bf16 (docs/memory.md):
//   attn_norm x_in 2d (+ mean, r), qkv_input z1 2d, attention q,k,v,o 8d (+ lse), mlp_norm h_mid 2d,
//   fc1_input z2 2d, gelu h 2f, fc2_input g 2f
// and lowmem 12d + 2.25f: MS-LN drops x_in and h_mid (z1, z2 are kept anyway), ReGELU2 keeps
// f/4 bytes of codes instead of h. Without LoRA on fc2, g is not kept at all.

static void plan_block_act(MemPlan* p, int l, int keep, const char* module, const char* name, size_t bytes,
                           void* saved_slot, void* tmp_slot) {
    char nm[64];
    snprintf(nm, sizeof(nm), "L%d.%.40s", l, name);
    if (keep) plan_add(p, MEM_SAVED, module, l, nm, bytes, saved_slot);
    else if (l == 0) plan_add(p, MEM_SCRATCH, module, PLAN_SHARED_BLOCK, name, bytes, tmp_slot);
}

// What --full trains besides the linear weights and the head: the embeddings and the final norm;
// the blocks' norms when standard (MS-LN merged them into the linears, which train them); the
// linears' biases, except q and v of a model without them (under MS-LN they carry the merged
// beta) and the key bias always: its gradient is zero in exact arithmetic (softmax ignores a
// shift shared by every score of a query), so AdamW would only walk it by rounding noise.
static int vit_trains_block_norms(const TrainModes* md) { return md->full && !md->ms; }
static int vit_trains_bias(const Vit* m, int t) {
    return m->modes.full && t != T_K && (t > T_V || m->cfg.qkv_bias || m->modes.ms);
}

// The trainable arena's size: adapters (or, --full, every weight), then the head.
static int64_t vit_trainable_count(const Vit* m) {
    const VitConfig* c = &m->cfg;
    const TrainModes* md = &m->modes;
    int64_t d = c->dim, r = md->rank, n = (int64_t)m->classes * d + m->classes;
    if (md->full)
        n += d * patch_len(c) + 2 * d + m->T * d + 2 * d +
             (vit_trains_block_norms(md) ? (int64_t)N_LN * d * c->layers : 0);
    for (int l = 0; l < c->layers; l++)
        for (int t = 0; t < N_TARGETS; t++) {
            if (md->full) n += lin_in(c, t) * lin_out(c, t) + (vit_trains_bias(m, t) ? lin_out(c, t) : 0);
            else if (md->targets >> t & 1) n += r * (lin_in(c, t) + lin_out(c, t));
        }
    return n;
}

// The frozen weights (under --full only what it does not train: the MS-merged norm vectors).
static void vit_plan_weights(Vit* m, MemPlan* p) {
    const Backend* be = m->be;
    const VitConfig* c = &m->cfg;
    int64_t T = m->T, d = c->dim, w = be->wbytes;
    if (!m->modes.full) {
        plan_add(p, MEM_FROZEN, "patch_embed", -1, "patch_w", d * patch_len(c) * w, linear_weight_slot(be, &m->patch));
        plan_add(p, MEM_FROZEN, "patch_embed", -1, "patch_b", d * w, &m->patch_b);
        plan_add(p, MEM_FROZEN, "embeddings", -1, "cls", d * w, &m->cls);
        plan_add(p, MEM_FROZEN, "embeddings", -1, "pos", T * d * w, &m->pos);
        plan_add(p, MEM_FROZEN, "final_norm", -1, "norm_g", d * w, &m->norm_g);
        plan_add(p, MEM_FROZEN, "final_norm", -1, "norm_b", d * w, &m->norm_b);
    }
    for (int l = 0; l < c->layers; l++) {
        VitLayer* layer = &m->layers[l];
        if (!vit_trains_block_norms(&m->modes)) {
            plan_add(p, MEM_FROZEN, "attn_norm", l, "ln1_g", d * w, &layer->ln1_g);
            plan_add(p, MEM_FROZEN, "attn_norm", l, "ln1_b", d * w, &layer->ln1_b);
            plan_add(p, MEM_FROZEN, "mlp_norm", l, "ln2_g", d * w, &layer->ln2_g);
            plan_add(p, MEM_FROZEN, "mlp_norm", l, "ln2_b", d * w, &layer->ln2_b);
        }
        if (m->modes.full) {  // the frozen q, k, v biases of a model without them (zeros)
            for (int t = 0; t < N_TARGETS; t++)
                if (!vit_trains_bias(m, t))
                    plan_add(p, MEM_FROZEN, target_names[t], l, "bias", lin_out(c, t) * w,
                             linear_bias_slot(be, &layer->lin[t]));
            continue;
        }
        for (int t = 0; t < N_TARGETS; t++) {
            plan_add(p, MEM_FROZEN, target_names[t], l, target_names[t], lin_in(c, t) * lin_out(c, t) * w,
                     linear_weight_slot(be, &layer->lin[t]));
            plan_add(p, MEM_FROZEN, target_names[t], l, "bias", lin_out(c, t) * w,
                     linear_bias_slot(be, &layer->lin[t]));
        }
    }
}

// Saved activations, block by block (the table above).
static void vit_plan_blocks(Vit* m, MemPlan* p) {
    const VitConfig* c = &m->cfg;
    const TrainModes* md = &m->modes;
    int64_t N = (int64_t)m->B * m->T, d = c->dim, f = c->hidden, r = md->rank, a = m->be->abytes;
    int keep = !md->recompute_block, std_norm = !md->ms;
    // a linear keeps its input when its own backward needs it: it has an adapter or trains W
    int lora_qkv = md->full || (md->targets & ((1u << T_Q) | (1u << T_K) | (1u << T_V)));
    for (int l = 0; l < c->layers; l++) {
        BlockActs* A = &m->acts[l];
        BlockActs* s = &m->tmp;
        char nm[48];
        if (md->recompute_block)  // the checkpoint [N, d]: on the device, or (--offload host) in pinned host memory
            checkpoints_plan_block(p, &m->ckpt, l, N * d * a);
        if (std_norm && keep) plan_block_act(p, l, 1, "attn_norm", "x_in", N * d * a, &A->x_in, NULL);
        if (std_norm) plan_block_act(p, l, keep, "attn_norm", "mean1", N * 4, &A->mean1, &s->mean1);
        plan_block_act(p, l, keep, "attn_norm", "r1", N * 4, &A->r1, &s->r1);
        plan_block_act(p, l, keep && (md->ms || lora_qkv), "qkv_input", "z1", N * d * a, &A->z1, &s->z1);
        plan_block_act(p, l, keep, "attention", "q", N * d * a, &A->q, &s->q);
        plan_block_act(p, l, keep, "attention", "k", N * d * a, &A->k, &s->k);
        plan_block_act(p, l, keep, "attention", "v", N * d * a, &A->v, &s->v);
        plan_block_act(p, l, keep, "attention", "o", N * d * a, &A->o, &s->o);
        plan_block_act(p, l, keep, "attention", "lse", N * c->heads * 4, &A->lse, &s->lse);
        for (int t = 0; t < N_TARGETS; t++) {
            if (!(md->targets >> t & 1)) continue;
            snprintf(nm, sizeof(nm), "lora_%s_ax", target_names[t]);
            plan_block_act(p, l, keep, "lora", nm, N * r * a, &A->ax[t], &s->ax[t]);
        }
        if (std_norm) plan_block_act(p, l, keep, "mlp_norm", "h_mid", N * d * a, &A->h_mid, &s->h_mid);
        if (std_norm) plan_block_act(p, l, keep, "mlp_norm", "mean2", N * 4, &A->mean2, &s->mean2);
        plan_block_act(p, l, keep, "mlp_norm", "r2", N * 4, &A->r2, &s->r2);
        plan_block_act(p, l, keep && (md->ms || md->full || (md->targets >> T_FC1 & 1)), "fc1_input", "z2", N * d * a,
                       &A->z2, &s->z2);
        // under ReGELU2 fc1's output h is a forward temporary in dh (vit_bind): the codes are kept
        if (!md->approx) plan_block_act(p, l, keep, "gelu", "h", N * f * a, &A->h, &s->h);
        if (md->approx)
            plan_block_act(p, l, keep, "gelu", "codes", (size_t)packed_codes_bytes(N * f), &A->codes, &s->codes);
        plan_block_act(p, l, keep && (md->full || (md->targets >> T_FC2 & 1)), "fc2_input", "g", N * f * a, &A->g,
                       &s->g);
    }
}

// Scratch of the forward and backward passes, and the head.
static void vit_plan_scratch(Vit* m, MemPlan* p) {
    const Backend* be = m->be;
    const VitConfig* c = &m->cfg;
    int64_t B = m->B, N = B * m->T, d = c->dim, f = c->hidden, r = m->modes.rank, K = m->classes, a = be->abytes;
    plan_add(p, MEM_SCRATCH, "batch", -1, "pixels", B * c->channels * (int64_t)m->img_h * m->img_w * a, &m->pixels);
    plan_add(p, MEM_SCRATCH, "batch", -1, "labels", B * 4, &m->labels);
    if (be->cuda) {
        plan_add(p, MEM_SCRATCH, "batch", -1, "raw_images", B * m->src_bytes, &m->raw);
        plan_add(p, MEM_SCRATCH, "batch", -1, "flips", B * 4, &m->flip);
        plan_add(p, MEM_SCRATCH, "batch", -1, "resize_taps", ((int64_t)m->img_h + m->img_w) * sizeof(ResampleTaps),
                 &m->taps);
    }
    batch_values_plan(&m->bv, be, p, m->modes.lora_dropout > 0 && m->modes.targets);
    plan_add(p, MEM_SCRATCH, "patch_embed", -1, "patches", N * patch_len(c) * a, &m->patches);
    plan_add(p, MEM_SCRATCH, "residual", -1, "resid", N * d * a, &m->resid);
    // the recomputed forward's residual stream: a copy of the checkpoint where the backward reads the
    // block input (standard norms); under MS norms it runs in place on the checkpoint
    if (m->modes.recompute_block && !m->modes.ms)
        plan_add(p, MEM_SCRATCH, "residual", -1, "resid_tmp", N * d * a, &m->resid_tmp);
    // block inputs [N, d]: with two, one travels to or from the host while the other is in use;
    // the ViT's sequences are short, so its memory never holds fewer (llmc/memory/offload.h)
    checkpoints_plan_staging(p, &m->ckpt, m->modes.offload_staging, N * d * a);
    plan_add(p, MEM_SCRATCH, "grads", -1, "dres", N * d * a, &m->dres);
    plan_add(p, MEM_SCRATCH, "grads", -1, "dz", N * d * a, &m->dz);
    plan_add(p, MEM_SCRATCH, "grads", -1, "dq", N * d * a, &m->dq);
    plan_add(p, MEM_SCRATCH, "grads", -1, "dk", N * d * a, &m->dk);
    plan_add(p, MEM_SCRATCH, "grads", -1, "dv", N * d * a, &m->dv);
    plan_add(p, MEM_SCRATCH, "grads", -1, "dout", N * d * a, &m->dout);
    plan_add(p, MEM_SCRATCH, "grads", -1, "dh", N * f * a, &m->dh);
    plan_add(p, MEM_SCRATCH, "grads", -1, "dax", N * r * a, &m->dax);
    if (vit_lora_behind_norm(m))
        plan_add(p, MEM_SCRATCH, "lora", -1, "lora_norm_work", lora_norm_work_bytes((int)r, (int)d, (int)a),
                 &m->lora_norm_work);
    if (m->modes.lora_dropout > 0 &&
        m->modes.targets) {  // one adapter input at a time, the widest: regenerated, not kept
        int64_t widest = 0;
        for (int t = 0; t < N_TARGETS; t++)
            if ((m->modes.targets >> t & 1) && lin_in(c, t) > widest) widest = lin_in(c, t);
        plan_add(p, MEM_SCRATCH, "lora", -1, "lora_dropout_input", N * widest * a, &m->drop_work);
    }
    AttnShape as = {m->B, m->T, c->heads, c->heads, c->head_dim, 0, NULL, NULL};
    m->att_work_bytes = op_plan_attention_work(be, p, as, &m->att_work);
    op_plan_matmul_workspace(be, p, &m->blas_work);
    // the head works on the B class tokens only and consumes its buffers at once (fused with the
    // loss, as train_llama's head): scratch, not saved
    plan_add(p, MEM_SCRATCH, "head", -1, "xcls", B * d * a, &m->xcls);
    plan_add(p, MEM_SCRATCH, "head", -1, "mcls", B * 4, &m->mcls);
    plan_add(p, MEM_SCRATCH, "head", -1, "rcls", B * 4, &m->rcls);
    plan_add(p, MEM_SCRATCH, "head", -1, "zcls", B * d * a, &m->zcls);
    plan_add(p, MEM_SCRATCH, "head", -1, "logits", B * K * 4, &m->logits);
    plan_add(p, MEM_SCRATCH, "head", -1, "dlogits", B * K * 4, &m->dlogits);
    plan_add(p, MEM_SCRATCH, "head", -1, "dzcls", B * d * a, &m->dzcls);
    plan_add(p, MEM_SCRATCH, "head", -1, "dxcls", B * d * a, &m->dxcls);
    if (be->cuda) {  // the fp32 head's input and its gradient (on the CPU zcls and dzcls are fp32 already)
        plan_add(p, MEM_SCRATCH, "head", -1, "zcls_f32", B * d * 4, &m->zcls32);
        plan_add(p, MEM_SCRATCH, "head", -1, "dzcls_f32", B * d * 4, &m->dzcls32);
    }
    op_plan_ce_rows(be, p, "head", &m->ce, B);
}

static void vit_plan(Vit* m, MemPlan* p) {
    const VitConfig* c = &m->cfg;
    const TrainModes* md = &m->modes;
    memset(p, 0, sizeof(*p));
    p->tokens = (int64_t)m->B * m->T;
    p->blocks = c->layers;
    vit_plan_weights(m, p);
    // The head's kernels read its fp32 master (m->head_w), so ZeRO-1 keeps every rank's master whole.
    trainable_plan(&m->tr, p, md->full ? "all weights" : "lora+head", vit_trainable_count(m),
                   md->full ? SHARD_OPTIM : SHARD_NONE, m->dist, m->be);
    vit_plan_blocks(m, p);
    vit_plan_scratch(m, p);
}

// The linear (l, t): W, and under --full its bias, from *off in the trainable arena (host mirror,
// bf16 shadow on CUDA, gradients), or its adapter; the host copies of what stays frozen from *h
// (CUDA; *h is NULL on the CPU, where the backend's fp32 buffers are the host's).
static void vit_bind_linear(Vit* m, Linear* L, int t, int64_t* off, float** h) {
    int full = m->modes.full;
    if (*h && !(full && vit_trains_bias(m, t))) { L->bias = *h; *h += L->out; }
    if (*h && !full) { L->W = *h; *h += (int64_t)L->in * L->out; }
    if (full) {  // W (and its bias) and the gradients live in the flat arenas (L->W: the host mirror)
        trainable_bind_linear_weight(&m->tr, off, L);
        if (vit_trains_bias(m, t)) trainable_bind_linear_bias(&m->tr, off, L);
    } else if (m->modes.targets >> t & 1) {
        trainable_bind_adapter(&m->tr, off, L, m->modes.rank);
    }
}

// After allocation: points the buffers a block does not keep at the shared scratch set, wires the
// trainable weights into the flat arenas (LoRA: layer-major, target order, A then B; --full: the
// embeddings, then block by block its norms (standard) and each linear's W and bias, then the
// final norm; then head W, head b), and sets up the host side: the trainable arena's mirror, every
// linear's fp32 W and bias, the norms and the batch.
static void vit_bind(Vit* m) {
    const VitConfig* c = &m->cfg;
    const Backend* be = m->be;
    // fc1's output [N, f] under ReGELU2 lives in the gradient scratch dh, which no forward uses
    // (the recomputed one runs before its block's backward) and whose backward reads only the codes
    if (m->modes.approx) m->tmp.h = m->dh;
    for (int l = 0; l < c->layers; l++) {
        void** a = (void**)&m->acts[l];
        void** s = (void**)&m->tmp;
        for (size_t i = 0; i < sizeof(BlockActs) / sizeof(void*); i++) if (!a[i]) a[i] = s[i];
    }
    m->patch.in = (int)patch_len(c);
    m->patch.out = c->dim;
    m->patch.name = "patch embed";
    trainable_bind_host(&m->tr);
    lora_dropout_init(&m->drop, m->modes.lora_dropout, m->modes.seed, m->drop_work);
    int full = m->modes.full;
    int64_t off = 0, host_lin = 0, d = c->dim;
    for (int t = 0; t < N_TARGETS; t++) host_lin += (full ? 1 : lin_in(c, t) + 1) * lin_out(c, t);
    if (be->cuda) m->lin_host = (float*)xcalloc(host_lin * c->layers, sizeof(float));
    m->norms_host = (float*)xcalloc((int64_t)c->layers * N_LN * d, sizeof(float));
    if (full) {
        trainable_bind_linear_weight(&m->tr, &off, &m->patch);
        m->h_patch_b = trainable_bind_tensor(&m->tr, &off, d, &m->patch_b, &m->dpatch_b, NULL);
        m->h_cls = trainable_bind_tensor(&m->tr, &off, d, &m->cls, &m->dcls, NULL);
        m->h_pos = trainable_bind_tensor(&m->tr, &off, m->T * d, &m->pos, &m->dpos, NULL);
    }
    float* h = m->lin_host;
    for (int l = 0; l < c->layers; l++) {
        VitLayer* layer = &m->layers[l];
        m->layer_off[l] = off;
        void** ln_dev[N_LN] = {&layer->ln1_g, &layer->ln1_b, &layer->ln2_g, &layer->ln2_b};
        for (int k = 0; k < N_LN; k++)
            layer->ln_host[k] = vit_trains_block_norms(&m->modes)
                                    ? trainable_bind_tensor(&m->tr, &off, d, ln_dev[k], &layer->ln_grad[k], NULL)
                                    : m->norms_host + ((int64_t)l * N_LN + k) * d;
        for (int t = 0; t < N_TARGETS; t++) {
            Linear* L = &layer->lin[t];
            L->in = (int)lin_in(c, t);
            L->out = (int)lin_out(c, t);
            L->name = target_names[t];
            vit_bind_linear(m, L, t, &off, &h);
            int attn = t <= T_V;
            if (L->A && vit_adapters_see_affine(m) && (attn || t == T_FC1))
                lora_norm_bind(L, attn ? layer->ln1_g : layer->ln2_g, attn ? layer->ln1_b : layer->ln2_b,
                               m->lora_norm_work);
            if (L->A && m->drop_work) lora_dropout_bind(L, &m->drop, (uint32_t)(l * N_TARGETS + t));
        }
    }
    if (full) {
        m->h_norm_g = trainable_bind_tensor(&m->tr, &off, d, &m->norm_g, &m->dnorm_g, NULL);
        m->h_norm_b = trainable_bind_tensor(&m->tr, &off, d, &m->norm_b, &m->dnorm_b, NULL);
    }
    int64_t hw = (int64_t)m->classes * d;
    m->head_w = m->tr.params + off; m->dhead_w = m->tr.grads + off;
    m->h_head_w = m->tr.h_params + off; m->h_dhead_w = m->tr.h_grads + off;
    m->head_b = m->head_w + hw; m->dhead_b = m->dhead_w + hw;
    m->h_head_b = m->h_head_w + hw; m->h_dhead_b = m->h_dhead_w + hw;
    trainable_plan_buckets(&m->tr, m->layer_off, c->layers);  // the final norm and the head lie above the last block
    m->h_raw = (uint8_t*)backend_host_side(be, m->raw, m->B * m->src_bytes);
    m->h_flip = (int*)backend_host_side(be, m->flip, sizeof(int) * m->B);
    m->h_labels = (int*)backend_host_side(be, m->labels, sizeof(int) * m->B);
    size_t taps = sizeof(ResampleTaps);  // rows, then columns: two uploads
    size_t batch_bytes = staging_align(m->B * m->src_bytes) + 2 * staging_align(sizeof(int) * m->B) +
                         staging_align(m->img_h * taps) + staging_align(m->img_w * taps);
    batch_bytes += batch_values_bind(&m->bv, be, &m->drop);
    staging_init(&m->staging, be, batch_bytes, m->micro_batches);
    if (!m->zcls32) { m->zcls32 = (float*)m->zcls; m->dzcls32 = (float*)m->dzcls; }  // the CPU's are fp32 already
}

// The host-side LayerNorm vector `which` (LN1_G ...) of block l.
static float* vit_norm_host(const Vit* m, int l, int which) {
    return m->layers[l].ln_host[which];
}

// A batch of B images into pixels and labels. The CPU loader resizes and normalises on the host;
// on CUDA only the raw bytes (a quarter of the fp32 pixels, or less) cross to the GPU, which
// resizes, flips and normalises them with the same arithmetic (image_resize_normalize_cuda).
// idx/flip: which shard images (and whether mirrored), labels already in h_labels.
static void vit_images_to_device(Vit* m, const ImageLoader* loader, const int64_t* idx, int B) {
    const VitConfig* c = &m->cfg;
    const ImageShard* s = loader->shard;
    int64_t per = (int64_t)s->H * s->W * s->C;
    if (per > m->src_bytes)
        fail("internal: %s has images of %lld bytes, planned for %lld", s->path, (long long)per,
             (long long)m->src_bytes);
    image_loader_gather(loader, idx, B, m->h_raw);
    BatchStaging* st = &m->staging;
    staging_begin(st);
    staging_upload(st, m->raw, m->h_raw, (size_t)(B * per));
    staging_upload(st, m->flip, m->h_flip, sizeof(int) * B);
    staging_upload(st, m->labels, m->h_labels, sizeof(int) * B);
    staging_upload(st, m->taps, loader->ty, sizeof(ResampleTaps) * m->img_h);
    staging_upload(st, (ResampleTaps*)m->taps + m->img_h, loader->tx, sizeof(ResampleTaps) * m->img_w);
    batch_values_stage(&m->bv, st, &m->drop);
    staging_end(st);
    op_resize_normalize_images(m->be, m->pixels, m->raw, (const ResampleTaps*)m->taps,
                               (const ResampleTaps*)m->taps + m->img_h, m->flip, B, s->H, s->W, s->C, m->img_h,
                               m->img_w, c->channels, loader->mean, loader->std);
}

// This rank's part of the next training batch, on the backend.
static void vit_next_batch(Vit* m, ImageLoader* loader, int B, int rank, int world) {
    if (!m->be->cuda) { image_loader_next(loader, B, rank, world, (float*)m->pixels, m->h_labels); return; }
    int64_t* idx = (int64_t*)xmalloc(sizeof(int64_t) * B);
    image_loader_pick(loader, B, rank, world, idx, m->h_flip, m->h_labels);
    vit_images_to_device(m, loader, idx, B);
    free(idx);
}

// Images [start, start+B) in file order, unflipped (evaluation), on the backend.
static void vit_range_batch(Vit* m, const ImageLoader* loader, int64_t start, int B) {
    if (!m->be->cuda) { image_loader_range(loader, start, B, (float*)m->pixels, m->h_labels); return; }
    int64_t* idx = (int64_t*)xmalloc(sizeof(int64_t) * B);
    for (int b = 0; b < B; b++) {
        idx[b] = start + b;
        m->h_flip[b] = 0;
        m->h_labels[b] = loader->shard->labels[start + b];
    }
    vit_images_to_device(m, loader, idx, B);
    free(idx);
}

// Declares the model's memory for a micro-batch of B images at img_h x img_w on backend `be`;
// nothing is allocated until vit_allocate (a dry run stops at the plan). The fine-tuning
// resolution must be a whole number of patches.
// src_bytes: the largest source image of the run's shards (0: none, as in a dry run: the model's
// input size is planned).
static void vit_setup(Vit* m, const VitConfig* cfg, const TrainModes* modes, int B, int img_h, int img_w, int classes,
                      int64_t src_bytes, const Backend* be, const Dist* dist) {
    memset(m, 0, sizeof(*m));
    m->be = be;
    m->dist = dist;
    if (img_h % cfg->patch_h || img_w % cfg->patch_w)
        fail("flag --image-size: %dx%d is not a multiple of the patch size %dx%d", img_h, img_w, cfg->patch_h,
             cfg->patch_w);
    m->cfg = *cfg;
    m->modes = *modes;
    m->B = B;
    m->img_h = img_h;
    m->img_w = img_w;
    m->grid_h = img_h / cfg->patch_h;
    m->grid_w = img_w / cfg->patch_w;
    m->T = 1 + m->grid_h * m->grid_w;
    m->classes = classes;
    m->src_bytes = src_bytes > 0 ? src_bytes : (int64_t)cfg->channels * img_h * img_w;
    m->layers = (VitLayer*)xcalloc(cfg->layers, sizeof(VitLayer));
    m->acts = (BlockActs*)xcalloc(cfg->layers, sizeof(BlockActs));
    checkpoints_init(&m->ckpt, cfg->layers, modes->offload_host);
    m->layer_off = (int64_t*)xcalloc(cfg->layers, sizeof(int64_t));
    vit_plan(m, &m->plan);
}

static void vit_allocate(Vit* m) {
    backend_allocate_plan(m->be, &m->plan);
    op_attach_matmul_workspace(m->be, m->blas_work);
    vit_bind(m);
    checkpoints_start(&m->ckpt, m->be, m->cfg.layers, (size_t)m->B * m->T * m->cfg.dim * m->be->abytes);
}

// Frees what vit_setup planned and vit_allocate made (either may be all there was: a dry run).
static void vit_free(Vit* m) {
    trainable_free_host(&m->tr);
    staging_free(&m->staging);
    backend_free_host_side(m->be, m->h_raw);
    backend_free_host_side(m->be, m->h_flip);
    backend_free_host_side(m->be, m->h_labels);
    batch_values_free(&m->bv, m->be);
    free(m->lin_host);
    op_detach_matmul_workspace(m->be, m->blas_work);  // before the plan's memory goes
    checkpoints_free(&m->ckpt);  // the copy stream done, before the plan's memory goes
#ifdef LLMC_HAVE_CUDA
    if (m->be->cuda) cuda_graph_free(&m->graph);
#endif
    backend_free_plan(m->be, &m->plan);
    free(m->layers); free(m->acts); free(m->norms_host); free(m->layer_off);

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
    VitLayer* layer = &m->layers[l];
    if (layer->ln_grad[0]) return;
    void* dst[N_LN] = {layer->ln1_g, layer->ln1_b, layer->ln2_g, layer->ln2_b};
    for (int k = 0; k < N_LN; k++) backend_upload_weights(m->be, dst[k], vit_norm_host(m, l, k), m->cfg.dim);
}

// MS-LN: gamma and beta of block l's norms into the linears that consume them (host fp32).
static void vit_merge_norms(Vit* m, const VitCheckpoint* ck, int l) {
    VitLayer* layer = &m->layers[l];
    char name[VIT_NAME_BYTES];
    for (int t = T_Q; t <= T_V; t++)
        linear_merge_norm_affine(&layer->lin[t], vit_norm_host(m, l, LN1_G), vit_norm_host(m, l, LN1_B),
                                 vit_linear_name(name, ck, l, t, VIT_WEIGHT));
    linear_merge_norm_affine(&layer->lin[T_FC1], vit_norm_host(m, l, LN2_G), vit_norm_host(m, l, LN2_B),
                             vit_linear_name(name, ck, l, T_FC1, VIT_WEIGHT));
}

// The embeddings and the final norm: read (host, tmp holds d * max(C*ph*pw, T)) and stored.
static void vit_load_embeddings(Vit* m, const StModel* sm, const VitCheckpoint* ck, float* tmp) {
    const VitConfig* c = &m->cfg;
    int64_t d = c->dim;
    char name[VIT_NAME_BYTES];
    int64_t cls_shape[3] = {1, 1, d}, pw_shape[4] = {d, c->channels, c->patch_h, c->patch_w};
    st_model_read_f32(sm, vit_tensor_name(name, ck, VIT_CLS), 3, cls_shape, tmp);
    backend_set_weight(m->be, m->cls, m->h_cls, tmp, d);
    vit_load_pos_embed(m, sm, vit_tensor_name(name, ck, VIT_POS), tmp);
    backend_set_weight(m->be, m->pos, m->h_pos, tmp, m->T * d);
    st_model_read_f32(sm, vit_tensor_name(name, ck, VIT_PATCH_W), 4, pw_shape, tmp);
    backend_set_weight(m->be, *linear_weight_slot(m->be, &m->patch), m->patch.dW ? m->patch.W : NULL, tmp,
                       d * patch_len(c));
    read_1d(sm, vit_tensor_name(name, ck, VIT_PATCH_B), d, tmp);
    backend_set_weight(m->be, m->patch_b, m->h_patch_b, tmp, d);
    read_1d(sm, vit_tensor_name(name, ck, VIT_NORM_G), d, tmp);
    backend_set_weight(m->be, m->norm_g, m->h_norm_g, tmp, d);
    read_1d(sm, vit_tensor_name(name, ck, VIT_NORM_B), d, tmp);
    backend_set_weight(m->be, m->norm_b, m->h_norm_b, tmp, d);
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
        VitLayer* layer = &m->layers[l];
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
    int64_t d = c->dim, biggest = d * (patch_len(c) > m->T ? patch_len(c) : m->T);
    for (int t = 0; t < N_TARGETS; t++)
        if (lin_in(c, t) * lin_out(c, t) > biggest) biggest = lin_in(c, t) * lin_out(c, t);
    float* tmp = (float*)xmalloc(sizeof(float) * biggest);
    Rng rng = rng_seeded(seed, 11);
    for (int64_t i = 0; i < biggest; i++) tmp[i] = 0.02f * rng_normal(&rng);
    float* zeros = (float*)xcalloc(d, sizeof(float));
    float* ones = (float*)xmalloc(sizeof(float) * d);
    for (int64_t i = 0; i < d; i++) ones[i] = 1.0f;
    backend_set_weight(m->be, m->cls, m->h_cls, tmp, d);
    backend_set_weight(m->be, m->pos, m->h_pos, tmp, m->T * d);
    backend_set_weight(m->be, *linear_weight_slot(m->be, &m->patch), m->patch.dW ? m->patch.W : NULL, tmp,
                       d * patch_len(c));
    backend_set_weight(m->be, m->patch_b, m->h_patch_b, zeros, d);
    backend_set_weight(m->be, m->norm_g, m->h_norm_g, ones, d);
    backend_set_weight(m->be, m->norm_b, m->h_norm_b, zeros, d);
    for (int l = 0; l < c->layers; l++) {
        memcpy(vit_norm_host(m, l, LN1_G), ones, sizeof(float) * d);
        memcpy(vit_norm_host(m, l, LN2_G), ones, sizeof(float) * d);
        vit_upload_norms(m, l);  // betas: zero since allocation
        for (int t = 0; t < N_TARGETS; t++) {
            Linear* L = &m->layers[l].lin[t];
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
            Linear* L = &m->layers[l].lin[t];
            if (L->A) lora_init(L, m->modes.rank, &rng);
        }
    Rng hr = rng_seeded(seed, 8);
    for (int64_t i = 0; i < (int64_t)m->classes * m->cfg.dim; i++) m->h_head_w[i] = 0.02f * rng_normal(&hr);
    memset(m->h_head_b, 0, sizeof(float) * m->classes);
    trainable_to_device(&m->tr);
}

// ----------------------------------------------------------------------------------------------
// Forward

// Patch embedding as one product: every ph x pw patch, unfolded in the conv kernel's (c, i, j)
// order, times the kernel [d, C*ph*pw]. Token 0 of each image is the class token; its patch row
// is zero so the product lands straight in the residual stream. Then bias and positions.
static void vit_embed(Vit* m, int B) {
    const VitConfig* c = &m->cfg;
    int64_t N = (int64_t)B * m->T;
    op_patch_unfold(m->be, m->patches, m->pixels, B, c->channels, m->img_h, m->img_w, c->patch_h, c->patch_w);
    op_linear_forward(m->be, m->resid, m->patches, &m->patch, NULL, N, 0, 0.0f, OUT_WRITE);
    op_patch_embed_finish(m->be, m->resid, m->cls, m->patch_b, m->pos, N, m->T, c->dim);
}

// One pre-LN block, updating the residual stream x [B*T, d] in place and filling a's buffers.
static void block_forward(Vit* m, int l, void* x, BlockActs* a, int B) {
    const Backend* be = m->be;
    const VitConfig* c = &m->cfg;
    const VitLayer* layer = &m->layers[l];
    int64_t N = (int64_t)B * m->T, d = c->dim;
    int r = m->modes.rank, ms = m->modes.ms;
    float s = m->modes.lora_scale;
    AttnShape as = {B, m->T, c->heads, c->heads, c->head_dim, 0, NULL, NULL};  // bidirectional, one image per row
    if (a->x_in) op_copy(be, a->x_in, x, N * d);
    op_layernorm_forward(be, a->z1, a->r1, ms ? NULL : a->mean1, x, ms ? NULL : layer->ln1_g, ms ? NULL : layer->ln1_b,
                         N, (int)d, c->norm_eps);
    op_linear_forward(be, a->q, a->z1, &layer->lin[T_Q], a->ax[T_Q], N, r, s, OUT_WRITE);
    op_linear_forward(be, a->k, a->z1, &layer->lin[T_K], a->ax[T_K], N, r, s, OUT_WRITE);
    op_linear_forward(be, a->v, a->z1, &layer->lin[T_V], a->ax[T_V], N, r, s, OUT_WRITE);
    op_attention_forward(be, a->o, a->lse, a->q, a->k, a->v, as,
                             op_attention_work_fitting(be, as, m->att_work, m->att_work_bytes));
    op_linear_forward(be, x, a->o, &layer->lin[T_PROJ], a->ax[T_PROJ], N, r, s, OUT_ADD);
    if (a->h_mid) op_copy(be, a->h_mid, x, N * d);
    op_layernorm_forward(be, a->z2, a->r2, ms ? NULL : a->mean2, x, ms ? NULL : layer->ln2_g, ms ? NULL : layer->ln2_b,
                         N, (int)d, c->norm_eps);
    op_linear_forward(be, a->h, a->z2, &layer->lin[T_FC1], a->ax[T_FC1], N, r, s, OUT_WRITE);
    op_gelu_forward(be, a->g, m->modes.approx ? a->codes : NULL, a->h, N * c->hidden, c->gelu_tanh);
    op_linear_forward(be, x, a->g, &layer->lin[T_FC2], a->ax[T_FC2], N, r, s, OUT_ADD);
}

// Embedding and all blocks over the uploaded batch; leaves the final norm's input in m->resid.
static void vit_forward_blocks(Vit* m, int B) {
    int64_t N = (int64_t)B * m->T;
    vit_embed(m, B);
    for (int l = 0; l < m->cfg.layers; l++) {
        if (m->modes.recompute_block) checkpoint_save(&m->ckpt, m->be, l, m->resid, N * m->cfg.dim);
        block_forward(m, l, m->resid, &m->acts[l], B);
    }
}

// Final LayerNorm on the class tokens, head, softmax cross-entropy against m->labels. In training
// the same pass writes the head's gradients (accumulated) and the gradient w.r.t. the class-token
// rows of the residual stream into m->dres (zero elsewhere). grad_scale = 1 / (images in the
// optimizer step). The norm runs in the activation type, the head in fp32 (llmc/ops.h).
static LossStats vit_head_loss(Vit* m, int B, float grad_scale, int backward, double* step_stats) {
    const Backend* be = m->be;
    const VitConfig* c = &m->cfg;
    int d = c->dim, K = m->classes;
    int64_t T = m->T, nd = (int64_t)B * d;
    op_copy_rows(be, m->xcls, d, m->resid, T * d, B, d);
    op_layernorm_forward(be, m->zcls, m->rcls, m->mcls, m->xcls, m->norm_g, m->norm_b, B, d, c->norm_eps);
    op_acts_to_f32(be, m->zcls32, m->zcls, nd);
    op_linear_f32_forward(be, m->logits, m->zcls32, m->head_w, m->head_b, B, K, d);
    LossStats st = {};
    st.overflowed = op_norm_overflowed_rows(be, m->rcls, B, step_stats);
    op_softmax_ce_rows(be, m->dlogits, m->logits, m->labels, B, K, grad_scale, backward, &m->ce, &st, step_stats,
                       m->bv.grad_scale);
    if (!backward) return st;
    op_linear_f32_backward(be, m->dzcls32, m->dhead_w, m->dhead_b, m->dlogits, m->zcls32, m->head_w, B, K, d);
    op_f32_to_acts(be, m->dzcls, m->dzcls32, nd);
    op_zero(be, m->dxcls, (size_t)nd * be->abytes);
    op_layernorm_backward(be, m->dxcls, m->dzcls, m->xcls, m->mcls, m->rcls, m->norm_g, B, d);
    if (m->dnorm_g) op_layernorm_affine_grad(be, m->dnorm_g, m->dnorm_b, m->dzcls, m->xcls, m->mcls, m->rcls, B, d);
    op_zero(be, m->dres, (size_t)B * T * d * be->abytes);
    op_copy_rows(be, m->dres, T * d, m->dxcls, d, B, d);
    return st;
}

// ----------------------------------------------------------------------------------------------
// Backward

// Backpropagates m->dres (gradient w.r.t. the block output) to the block input, in place.
// block_input: the recomputed block's input on the device (NULL: not recomputed; a->x_in then).
static void block_backward(Vit* m, int l, BlockActs* a, const void* block_input, int B) {
    const Backend* be = m->be;
    const VitConfig* c = &m->cfg;
    const VitLayer* layer = &m->layers[l];
    int64_t N = (int64_t)B * m->T, d = c->dim;
    int r = m->modes.rank, ms = m->modes.ms;
    float s = m->modes.lora_scale;
    AttnShape as = {B, m->T, c->heads, c->heads, c->head_dim, 0, NULL, NULL};
    const void* x_in = block_input ? block_input : a->x_in;
    // MLP: fc2, GELU (exact from h, or ReGELU2 from the codes), fc1, MLP norm
    op_linear_backward(be, m->dh, m->dres, a->g, a->ax[T_FC2], &layer->lin[T_FC2], m->dax, N, r, s, OUT_WRITE);
    op_gelu_backward(be, m->dh, m->dh, m->modes.approx ? NULL : a->h, a->codes, N * c->hidden, c->gelu_tanh);
    op_linear_backward(be, m->dz, m->dh, a->z2, a->ax[T_FC1], &layer->lin[T_FC1], m->dax, N, r, s, OUT_WRITE);
    if (layer->ln_grad[LN2_G])
        op_layernorm_affine_grad(be, layer->ln_grad[LN2_G], layer->ln_grad[LN2_B], m->dz, a->h_mid, a->mean2, a->r2, N,
                                 (int)d);
    if (ms) op_layernorm_ms_backward(be, m->dres, m->dz, a->z2, a->r2, N, (int)d);
    else op_layernorm_backward(be, m->dres, m->dz, a->h_mid, a->mean2, a->r2, layer->ln2_g, N, (int)d);
    // attention: proj, attention, q/k/v, attention norm
    op_linear_backward(be, m->dout, m->dres, a->o, a->ax[T_PROJ], &layer->lin[T_PROJ], m->dax, N, r, s, OUT_WRITE);
    op_attention_backward(be, m->dq, m->dk, m->dv, m->dout, a->q, a->k, a->v, a->o, a->lse, as, m->att_work);
    op_linear_backward(be, m->dz, m->dq, a->z1, a->ax[T_Q], &layer->lin[T_Q], m->dax, N, r, s, OUT_WRITE);
    op_linear_backward(be, m->dz, m->dk, a->z1, a->ax[T_K], &layer->lin[T_K], m->dax, N, r, s, OUT_ADD);
    op_linear_backward(be, m->dz, m->dv, a->z1, a->ax[T_V], &layer->lin[T_V], m->dax, N, r, s, OUT_ADD);
    if (layer->ln_grad[LN1_G])
        op_layernorm_affine_grad(be, layer->ln_grad[LN1_G], layer->ln_grad[LN1_B], m->dz, x_in, a->mean1, a->r1, N,
                                 (int)d);
    if (ms) op_layernorm_ms_backward(be, m->dres, m->dz, a->z1, a->r1, N, (int)d);
    else op_layernorm_backward(be, m->dres, m->dz, x_in, a->mean1, a->r1, layer->ln1_g, N, (int)d);
}

// The blocks in reverse, then (--full) the embeddings: m->dres is then the gradient of the first
// block's input, whose class-token rows are cls + pos[0] and whose patch rows are the patch
// product + patch_b + pos (the class rows of the unfolded patches are zero, so they add nothing
// to the patch weight's gradient). Without --full nothing upstream trains and it stops there.
// --recompute block: block l's activations rebuilt from its checkpoint by the same forward (so
// the same bits); returns the checkpoint on the device, which the backward of standard norms
// reads (the forward then runs on a copy; under MS norms in place: the backward never reads it).
static const void* vit_recompute_block(Vit* m, int l, int B) {
    int64_t N = (int64_t)B * m->T;
    void* x = checkpoint_input(&m->ckpt, l);
    void* stream = x;
    if (!m->modes.ms) {
        op_copy(m->be, m->resid_tmp, x, N * m->cfg.dim);
        stream = m->resid_tmp;
    }
    block_forward(m, l, stream, &m->acts[l], B);
    return x;
}

static void vit_backward_blocks(Vit* m, int B) {
    int64_t N = (int64_t)B * m->T;
    int layers = m->cfg.layers;
    checkpoints_prefetch_last(&m->ckpt, layers);  // (--offload host)
    for (int l = layers - 1; l >= 0; l--) {
        const void* block_input = m->modes.recompute_block ? vit_recompute_block(m, l, B) : NULL;
        block_backward(m, l, &m->acts[l], block_input, B);
        checkpoints_prefetch_below(&m->ckpt, l);  // (--offload host) into this block's staging buffer
        // this block's, the final norm's and the head's gradients are final
        trainable_grads_final_from(&m->tr, m->dist, m->layer_off[l]);
    }
    if (!m->modes.full) return;
    op_patch_embed_finish_backward(m->be, m->dcls, m->dpatch_b, m->dpos, m->dres, N, m->T, m->cfg.dim);
    op_linear_backward(m->be, NULL, m->dres, m->patches, NULL, &m->patch, NULL, N, 0, 0.0f, OUT_WRITE);
}

// One micro-batch of B <= m->B images (already uploaded): forward, fused head + loss (+ its
// gradient), backward. Trainable grads accumulate. logits_out (host, [B, classes]): tests only.
// step_stats (CUDA, or NULL): the loss statistics are added there on the device and the returned
// LossStats stay zero (llmc/ops.h).
static LossStats vit_forward_backward(Vit* m, int B, float grad_scale, int backward, float* logits_out,
                                      double* step_stats) {
    batch_values_check(&m->bv, grad_scale, backward, &m->drop, "the images' upload");
    vit_forward_blocks(m, B);
    LossStats st = vit_head_loss(m, B, grad_scale, backward, step_stats);
    if (logits_out) backend_download(m->be, logits_out, m->logits, sizeof(float) * B * m->classes);
    if (backward) vit_backward_blocks(m, B);
    return st;
}

#ifdef LLMC_HAVE_CUDA
// Once per model, at its first training step: whether LLMC_CUDA_GRAPH=1 can be honoured (said in
// one line): what the micro-batch holds that no capture can (llmc/cuda/graph.cuh).
static void vit_graph_decide(Vit* m, const Dist* dist) {
    GraphHazards h = {!m->be->stream, !trainable_step_stats(&m->tr), dist_sums_grads(dist), m->modes.offload_host,
                      m->drop_work && !m->bv.drop_at};
    if (m->be->cuda) cuda_graph_decide(&m->graph, &h, !dist || dist->rank == 0);
    m->graph.decided = 1;
}

// What the captured forward + backward depends on besides device memory: the micro-batch's
// images, the loss scale where it is a kernel argument of the head (LLMC_LOSS_SCALE=args; by
// default the kernel reads it from device memory) and the GEMM attention path's pointer-table
// cache (as train_llama.cu's llama_graph_key; --lora-dropout's key is read from device memory too).
static CudaGraphKey vit_graph_key(const Vit* m, int B, float grad_scale) {
    CudaGraphKey k;
    memset(&k, 0, sizeof(k));
    k.shape[0] = B;
    uint32_t bits;
    memcpy(&bits, &grad_scale, sizeof(bits));
    k.values[0] = m->bv.grad_scale ? 0 : bits;  // read from device memory, it changes nothing captured
    k.values[1] = g_attn_tables.builds;
    return k;
}
#endif

// One training micro-batch (already uploaded), through a CUDA graph with LLMC_CUDA_GRAPH=1 as
// train_llama.cu's llama_train_micro_batch: eagerly at a shape's first time, captured when its key
// changes, replayed with one launch otherwise.
static LossStats vit_train_micro_batch(Vit* m, int B, float grad_scale, double* step_stats) {
#ifdef LLMC_HAVE_CUDA
    CudaGraph* g = &m->graph;
    CudaGraphKey key = vit_graph_key(m, B, grad_scale);
    GraphStep what = g->on ? cuda_graph_next(g, &key) : GRAPH_EAGER;
    if (what != GRAPH_EAGER) {
        if (what == GRAPH_CAPTURE) {
            int profiling = prof_pause(m->be->prof);  // its events would be captured too
            cuda_graph_capture_begin(g, m->be->stream);
            vit_forward_backward(m, B, grad_scale, 1, NULL, step_stats);
            CudaGraphKey after = vit_graph_key(m, B, grad_scale);  // the host caches the capture filled
            cuda_graph_capture_end(g, m->be->stream, &after);
            prof_resume(m->be->prof, profiling);
        }
        PROF_SCOPE(m->be, "forward + backward graph", "f+b", 0.0, 0.0);
        cuda_graph_launch(g, m->be->stream);
        LossStats none = {};
        return none;  // the statistics are in step_stats
    }
#endif
    return vit_forward_backward(m, B, grad_scale, 1, NULL, step_stats);
}

// ----------------------------------------------------------------------------------------------
// Training step and evaluation

// One optimizer step over grad_accum micro-batches on every rank; the loss is the mean over all
// images of the global step, so accumulation and data parallelism both equal one big batch.
// Gradients are summed across ranks before clipping: the norm is the global one and every rank
// applies the same update.
static StepResult vit_train_step(Vit* m, ImageLoader* loader, const TrainOptions* o, const Dist* dist, int step) {
    int B = m->B, K = o->grad_accum;
    float scale = 1.0f / (float)((double)B * K * dist->world);
    batch_values_set_loss_scale(&m->bv, scale);  // uploaded with each micro-batch's images below
    trainable_zero_grads(&m->tr);
#ifdef LLMC_HAVE_CUDA
    if (!m->graph.decided) vit_graph_decide(m, dist);
#endif
    m->drop.step = (uint64_t)step;
    double sums[3] = {0.0, 0.0, 0.0};  // loss, final-norm rows that overflowed (health.h), correct
    for (int k = 0; k < K; k++) {
        if (k == K - 1) trainable_buckets_begin(&m->tr, dist);  // the last backward sends buckets as they finish
        // (before the upload: CUDA's dropout kernels read it from device memory)
        m->drop.row0 = lora_dropout_row0(k, dist->rank, dist->world, (int64_t)B * m->T);
        {
            PROF_SCOPE(m->be, "data", "step", 0.0, 0.0);  // decoding, resizing, normalising, upload
            vit_next_batch(m, loader, B, dist->rank, dist->world);
        }
        m->drop.active = 1;  // training only: evaluation sees the adapters' whole input
        // on CUDA the loss stays on the device until the step's one readback (llmc/train/zero.h)
        LossStats st = vit_train_micro_batch(m, B, scale, trainable_step_stats(&m->tr));
        m->drop.active = 0;
        sums[0] += st.loss_sum;
        sums[1] += st.overflowed;
        sums[2] += st.correct;
    }
    double images = (double)B * K * dist->world;
    PROF_SCOPE(m->be, "optimizer", "step", 0.0, 0.0);  // gradient all-reduce, clipping and AdamW
    return train_step_finish(&m->tr, o, dist, step, sums, 3, images, images, m->classes);
}

// Model FLOPs of one image's forward and backward: every token through the block linears
// (linear_train_flops), the patch embedding, bidirectional attention (12 T d per layer per token:
// QK^T, PV and their four backward products) and the head. The convention of scripts/bench/bench_gpu.sh.
static double vit_flops_per_image(const Vit* m) {
    const VitConfig* c = &m->cfg;
    int full = m->modes.full;
    double per_token = 0.0;
    for (int t = 0; t < N_TARGETS; t++)
        per_token += c->layers * linear_train_flops(lin_in(c, t), lin_out(c, t), full,
                                                    !full && (m->modes.targets >> t & 1) ? m->modes.rank : 0);
    per_token += c->layers * 12.0 * m->T * c->dim;
    double patches = (double)(m->T - 1) * linear_train_flops(patch_len(c), c->dim, full, 0);
    return m->T * per_token + patches + linear_train_flops(c->dim, m->classes, 1, 0);
}

// Mean loss and top-1 accuracy over the first `batches` micro-batches of the validation shard, in
// file order (the last one may be short), or the whole shard when it is smaller.
static EvalResult vit_evaluate(Vit* m, const ImageLoader* loader, int batches) {
    int64_t n = loader->shard->n;
    double ls = 0.0, cor = 0.0;
    int64_t seen = 0;
    for (int i = 0; i < batches && seen < n; i++) {
        int B = (int)(n - seen < m->B ? n - seen : m->B);
        vit_range_batch(m, loader, seen, B);
        LossStats st = vit_forward_backward(m, B, 0.0f, 0, NULL, NULL);
        ls += st.loss_sum;
        cor += st.correct;
        seen += B;
    }
    EvalResult r = {(float)(ls / seen), (float)(cor / seen), seen};
    return r;
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
            n = peft_add_entry(e, n, &m->layers[l].lin[t], "vit.encoder.layer", l, vit_hf_modules[t],
                               vit_adapters_merged(m) ? vit_merged_gamma(m, l, t) : NULL);
    return n;
}

// The block and target of an adapter entry's linear.
static void vit_entry_place(const Vit* m, const PeftEntry* e, int* l, int* t) {
    for (*l = 0; *l < m->cfg.layers; (*l)++)
        for (*t = 0; *t < N_TARGETS; (*t)++)
            if (&m->layers[*l].lin[*t] == e->L) return;
    fail("internal: adapter entry %s is no linear of the model", e->module);
}

// out = W beta, what MS-LN added to the bias of linear (l, t) at load time: the merged bias (host)
// minus the checkpoint's own bias (read again; zero for q, k, v of a model without them).
static void vit_merged_bias_shift(float* out, const Vit* m, const char* model_dir, int l, int t) {
    const Linear* L = &m->layers[l].lin[t];
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
    trainable_to_host(&m->tr, 0);
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
    nex = peft_put_module_to_save(ex, nex, vit_hf_head, m->h_head_w, m->h_head_b, m->classes, c->dim);
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
    if (!peft_read_module_to_save(&f, vit_hf_head, m->h_head_w, m->h_head_b, m->classes, c->dim) && need_head)
        fail(
            "%s: no classifier.weight/bias (an adapter saved by train_vit or PEFT with "
            "modules_to_save=[\"classifier\"]); --eval-only needs the trained head",
            path);
    st_close(&f);
    free(path);
    free(e);
    trainable_to_device(&m->tr);
}

// Everything a resumed run must share with the saved one, as "key=value" words.
static void vit_settings_line(char* buf, size_t n, const Vit* m, const TrainOptions* o, const Dist* d, int64_t images) {
    const VitConfig* c = &m->cfg;
    snprintf(buf, n,
             "d=%d f=%d layers=%d heads=%d patch=%dx%d image=%dx%d classes=%d full=%d act=%s norm=%s ms_lora=%s "
             "recompute=%s rank=%d alpha=%g targets=0x%x lora_dropout=%g batch=%d grad_accum=%d world=%d steps=%d "
             "lr=%g warmup=%d min_lr_frac=%g weight_decay=%g grad_clip=%g hflip=%d seed=%d data_images=%lld%s",
             c->dim, c->hidden, c->layers, c->heads, c->patch_h, c->patch_w, m->img_h, m->img_w, m->classes, o->full,
             o->act, o->norm, o->ms_lora, o->recompute, o->lora_rank, o->lora_alpha, m->modes.targets, o->lora_dropout,
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
    const Linear* L = &m->layers[l].lin[t];
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
    const Linear* L = &((const Vit*)model)->layers[l].lin[t];
    return L->A || L->dW;
}

static void vit_linear_export(const void* model, int l, int t, VitPart part, float* v) {
    const Vit* m = (const Vit*)model;
    const Linear* L = &m->layers[l].lin[t];
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
        const Linear* L = &m->layers[l].lin[t];
        need |= (m->modes.ms && (L->dW || (L->A && vit_adapters_merged(m)))) || L->dbias;
    }
    return need;
}

static const float* vit_trained_norm(const void* model, int l, int which) {
    const Vit* m = (const Vit*)model;
    return vit_trains_block_norms(&m->modes) ? vit_norm_host(m, l, which) : NULL;
}

static void vit_export_merged(Vit* m, const TrainOptions* o, const char* dir) {
    trainable_to_host(&m->tr, 0);
    int full = m->modes.full, resized = full && (m->img_h != m->cfg.image_h || m->img_w != m->cfg.image_w);
    VitExportSource s;
    memset(&s, 0, sizeof(s));
    s.model = m;
    s.layers = m->cfg.layers;
    s.dim = m->cfg.dim;
    s.classes = m->classes;
    s.qkv_bias = m->cfg.qkv_bias;
    const float* trained[VIT_TENSORS] = {m->h_cls, m->h_pos, m->patch.W, m->h_patch_b, m->h_norm_g, m->h_norm_b};
    for (int k = VIT_CLS; k < VIT_HEAD_W; k++) s.trained[k] = full ? trained[k] : NULL;
    s.trained[VIT_HEAD_W] = m->h_head_w;
    s.trained[VIT_HEAD_B] = m->h_head_b;
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
    read_2d(&sm, wn, m->classes, m->cfg.dim, m->h_head_w);
    read_1d(&sm, bn, m->classes, m->h_head_b);
    st_model_close(&sm);
    trainable_to_device(&m->tr);
}

// ----------------------------------------------------------------------------------------------
// main

// The fine-tuning resolution: --image-size S or HxW, else the checkpoint's.
static void vit_resolution(const VitConfig* c, const char* flag, int* h, int* w) {
    *h = c->image_h;
    *w = c->image_w;
    if (!flag) return;
    char extra;
    if (sscanf(flag, "%dx%d%c", h, w, &extra) == 2) {
    } else if (sscanf(flag, "%d%c", h, &extra) == 1) {
        *w = *h;
    } else {
        fail("flag --image-size: expected S or HxW, got \"%s\"", flag);
    }
    if (*h < 1 || *w < 1 || *h > 65536 || *w > 65536)
        fail("flag --image-size: expected sides in 1..65536, got \"%s\"", flag);
}

// --dry-run --json: the run's settings as the fields of a JSON object, into buf (plan_json writes them).
static void vit_settings_json(char* buf, size_t n, const TrainOptions* o, const Vit* m, const char* device) {
    snprintf(buf, n,
             "\"model\": \"vit\", \"device\": \"%s\", \"mode\": \"%s\", \"act\": \"%s\", \"norm\": \"%s\", "
             "\"recompute\": \"%s\", \"offload\": \"%s\", "
             "\"batch\": %d, \"image_size\": [%d, %d], \"tokens_per_image\": %d, \"classes\": %d, \"lora_rank\": %d, "
             "\"lora_dropout\": %g, \"lora_targets\": \"%s\"",
             device, o->mode, o->act, o->norm, o->recompute, o->offload, o->batch, m->img_h, m->img_w, m->T, m->classes,
             o->lora_rank, o->lora_dropout, o->lora_targets ? o->lora_targets : "q,k,v,proj,fc1,fc2");
}

// What fit_check_plan plans with: the run's model, resolution, classes, backend and ranks.
typedef struct {
    const VitConfig* cfg;
    int h, w, classes;
    int64_t src_bytes;
    const Backend* be;
    const Dist* dist;
} VitPlanCtx;

static size_t vit_plan_bytes(const void* ctx, const TrainOptions* o, int batch, int world) {
    const VitPlanCtx* c = (const VitPlanCtx*)ctx;
    TrainModes md = train_modes_from(o, target_names, N_TARGETS);
    Dist ranks = dist_for_plan(c->dist, world);
    Vit m;
    vit_setup(&m, c->cfg, &md, batch, c->h, c->w, c->classes, c->src_bytes, c->be, &ranks);
    size_t bytes = plan_total(&m.plan);
    vit_free(&m);
    return bytes;
}

typedef struct {           // what a run reads besides the model
    ImageShard train, val;
    ImageLoader tl, vl;
    int have_train, have_val;
} RunData;

// Opens the shards (the head's class count must cover their labels) and their loaders.
static void run_data_open(RunData* rd, const TrainOptions* o, const VitConfig* c, int h, int w, int* classes) {
    memset(rd, 0, sizeof(*rd));
    if (o->data_path) { image_shard_load(&rd->train, o->data_path); rd->have_train = 1; }
    if (o->val_path) { image_shard_load(&rd->val, o->val_path); rd->have_val = 1; }
    *classes = o->classes ? o->classes : rd->have_train ? rd->train.classes : rd->val.classes;
    // --eval-only of a model directory: the head it carries says (an export of a 7-class head reloads as one)
    int carried = o->eval_only && !o->classes && !o->adapter_dir ? vit_checkpoint_head_rows(o->model_dir) : 0;
    if (carried) *classes = carried;
    // --export-merged alone: the adapter's head says
    if (*classes == 0 && o->adapter_dir) *classes = peft_saved_module_rows(o->adapter_dir, vit_hf_head);
    if (*classes <= 0)
        fail("flag --classes: give the head's class count (no --data, --val or adapter head to take it from)");
    if (rd->have_train && rd->train.classes > *classes)
        fail("%s: the shard has %d classes, more than --classes %d", o->data_path, rd->train.classes, *classes);
    if (rd->have_val && rd->val.classes > *classes)
        fail("%s: the shard has %d classes, more than the head's %d", o->val_path, rd->val.classes, *classes);
    if (rd->have_train) vit_preprocessor_check_images(&c->pre, o->data_path, rd->train.H, rd->train.W);
    if (rd->have_val) vit_preprocessor_check_images(&c->pre, o->val_path, rd->val.H, rd->val.W);
    if (rd->have_train)
        image_loader_init(&rd->tl, &rd->train, h, w, c->channels, c->mean, c->std, (uint64_t)o->seed, 1, o->hflip);
    if (rd->have_val) image_loader_init(&rd->vl, &rd->val, h, w, c->channels, c->mean, c->std, (uint64_t)o->seed, 0, 0);
}

// The largest source image of the open shards, in bytes (what the GPU's raw-image buffer holds).
static int64_t run_data_src_bytes(const RunData* rd) {
    int64_t m = 0;
    if (rd->have_train) m = (int64_t)rd->train.H * rd->train.W * rd->train.C;
    if (rd->have_val && (int64_t)rd->val.H * rd->val.W * rd->val.C > m) m = (int64_t)rd->val.H * rd->val.W * rd->val.C;
    return m;
}

static void run_data_close(RunData* rd) {
    if (rd->have_train) { image_loader_free(&rd->tl); image_shard_free(&rd->train); }
    if (rd->have_val) { image_loader_free(&rd->vl); image_shard_free(&rd->val); }
}

// --dry-run: the plan of the run these flags describe, and the baseline plan beside it (with
// --data or --val, for their class count and image size; else --classes or 10). Under mpirun, or for --ranks N, the
// plan is per rank (ZeRO-1 under --full).
static void vit_dry_run(const VitConfig* cfg, const TrainOptions* o, TrainModes md, const Dist* dist) {
    int cpu = strcmp(o->device, "cpu") == 0;  // a dry run plans the CUDA layout unless told otherwise
    Backend be = backend_for_plan(!cpu);
    Dist ranks = dist_for_plan(dist, o->ranks ? o->ranks : dist->world);
    int h, w, classes = o->classes > 0 ? o->classes : 10;
    int64_t src_bytes = 0;
    vit_resolution(cfg, o->image_size, &h, &w);
    if (o->data_path || o->val_path) {  // the shards' class count and image size, as a run has them
        RunData rd;
        run_data_open(&rd, o, cfg, h, w, &classes);
        src_bytes = run_data_src_bytes(&rd);
        run_data_close(&rd);
    }
    Vit m, base;
    vit_setup(&m, cfg, &md, o->batch, h, w, classes, src_bytes, &be, &ranks);
    TrainModes bm = train_baseline_modes(md);
    vit_setup(&base, cfg, &bm, o->batch, h, w, classes, src_bytes, &be, NULL);
    char json[768], header[1024];
    vit_settings_json(json, sizeof(json), o, &m, cpu ? "cpu" : "cuda");
    snprintf(header, sizeof(header), "train_vit dry run: d=%d f=%d layers=%d heads=%d, image %dx%d patch %dx%d "
             "(%d tokens), %d classes, batch %d, ", cfg->dim, cfg->hidden, cfg->layers, cfg->heads, h, w,
             cfg->patch_h, cfg->patch_w, m.T, classes, o->batch);
    if (o->full) str_appendf(header, sizeof(header), "full fine-tuning");
    else
        str_appendf(header, sizeof(header), "LoRA r=%d on %s", o->lora_rank, o->lora_targets ? o->lora_targets : "all");
    if (ranks.world > 1) str_appendf(header, sizeof(header), ", one of %d ranks", ranks.world);
    train_dry_run_report(o, &m.plan, &base.plan, &be, json, header);
    vit_free(&m);
    vit_free(&base);
}

// What train_run drives (llmc/train/loop.h): the model and the data it trains and validates on.
typedef struct {
    Vit* m;
    RunData* rd;
} VitRun;

static StepResult vit_run_step(void* run, const TrainOptions* o, const Dist* dist, int step) {
    VitRun* r = (VitRun*)run;
    return vit_train_step(r->m, &r->rd->tl, o, dist, step);
}

static EvalResult vit_run_evaluate(void* run, int batches) {
    VitRun* r = (VitRun*)run;
    return vit_evaluate(r->m, &r->rd->vl, batches);
}

static void vit_run_save_adapter(void* run, const TrainOptions* o, const char* dir) {
    vit_save_adapter(((VitRun*)run)->m, dir, o);
}

static void vit_run_export(void* run, const TrainOptions* o, const char* dir) {
    vit_export_merged(((VitRun*)run)->m, o, dir);
}

static void vit_print_start(void* run, const TrainOptions* o, const char* what, const char* where) {
    const Vit* m = ((VitRun*)run)->m;
    const RunData* rd = ((VitRun*)run)->rd;
    const VitConfig* c = &m->cfg;
    printf("train_vit: %s | d=%d f=%d layers=%d heads=%d | image %dx%d (checkpoint %dx%d) patch %dx%d, %d tokens | "
           "%d classes | act=%s norm=%s recompute=%s | %s + head (%lld trainable params) | %s\n", o->model_dir, c->dim,
           c->hidden, c->layers, c->heads, m->img_h, m->img_w, c->image_h, c->image_w, c->patch_h, c->patch_w, m->T,
           m->classes, o->act, o->norm, o->recompute, what, (long long)m->tr.count, where);
    if (rd->have_train)
        printf("data: %s (%lld images %dx%dx%d, %d classes)", o->data_path, (long long)rd->train.n, rd->train.H,
               rd->train.W, rd->train.C, rd->train.classes);
    if (rd->have_val)
        printf("%sval %s (%lld images)", rd->have_train ? ", " : "data: ", o->val_path, (long long)rd->val.n);
    printf("\n");
}

// The model as the shared training loop sees it.
static void vit_trainer(Trainer* t, VitRun* run, const TrainOptions* o, const Dist* dist) {
    Vit* m = run->m;
    memset(t, 0, sizeof(*t));
    t->model = run;
    t->unit = "img";
    t->items = "images";
    t->classifier = 1;
    t->flops_per_item = vit_flops_per_image(m);
    t->tr = &m->tr;
    t->plan = &m->plan;
    t->be = m->be;
    t->full = m->modes.full;
    t->have_val = run->rd->have_val;
    t->cursor = &run->rd->tl.cursor;
    if (run->rd->have_train) t->data_fingerprint = image_shard_fingerprint(&run->rd->train);
    vit_settings_line(t->settings, sizeof(t->settings), m, o, dist, run->rd->train.n);
    t->step = vit_run_step;
    t->evaluate = vit_run_evaluate;
    t->save_adapter = vit_run_save_adapter;
    t->export_merged = vit_run_export;
    t->print_start = vit_print_start;
}

static void vit_flags(FlagTable* t, TrainOptions* o) {
    t->program = "train_vit";
    t->usage =
        "--model DIR [--data TRAIN.bin --val VAL.bin] [flags]   (fine-tunes a ViT image classifier: LoRA and a new "
        "head, or every weight with --full)";
    train_flags_register_task(t, o, "comma list of q,k,v,proj,fc1,fc2 (default all)", TRAIN_IMAGE);
    t->group = "memory modes (the paper's layers)";
    flag_choice(t, "offload", &o->offload, "none|host",
                "with --recompute block: the block checkpoints in pinned host memory, copied beside the compute");
    t->group = "model and data";
    flag_string(t, "export-merged", &o->export_merged,
                "after training (or alone, with --adapter), write the model with the adapter folded in and the trained "
                "head to this directory");
}

#ifndef TESTING
int main(int argc, char** argv) {
    Dist dist;
    TrainOptions o;
    train_start(&dist, &o, &argc, &argv, vit_flags);
    VitConfig cfg;
    vit_config_load(&cfg, o.model_dir);
    train_check_lora_rank(&o, cfg.dim, o.model_dir);
    TrainModes md = train_modes_from(&o, target_names, N_TARGETS);
    if (o.dry_run) { if (dist.rank == 0) vit_dry_run(&cfg, &o, md, &dist); dist_finalize(&dist); return 0; }
    if (!o.data_path && !o.eval_only && !o.export_merged)
        fail(
            "nothing to do: give --data (an image shard from scripts/data/prepare_images.py), --val with --eval-only, "
            "or --export-merged DIR with --adapter");
    if (!o.data_path && !o.eval_only && !o.adapter_dir)
        fail("flag --export-merged: alone, it needs --adapter (the adapter and head to fold in)");
    train_prepare_run(&o, dist.rank);
    // without a checkpoint there is nothing to rewrite and no trained head to read
    if (o.random_init && (o.export_merged || (o.full && (o.out_dir || o.resume_dir))))
        fail(
            "flag --random-init: not with --export-merged or --full --out (they rewrite the checkpoint's tensors, and "
            "there is none)");
    if (o.random_init && o.eval_only && !o.adapter_dir)
        fail("flag --random-init: --eval-only needs --adapter (the trained head)");

    int h, w, classes;
    vit_resolution(&cfg, o.image_size, &h, &w);
    RunData rd;
    run_data_open(&rd, &o, &cfg, h, w, &classes);
    Backend be;
    Profiler prof;
    train_backend_open(&be, &prof, &o, &dist);
    Vit m, base;
    vit_setup(&m, &cfg, &md, o.batch, h, w, classes, run_data_src_bytes(&rd), &be, &dist);
    VitPlanCtx pc = {&cfg, h, w, classes, run_data_src_bytes(&rd), &be, &dist};
    fit_check_plan(&be, &m.plan, vit_plan_bytes, &pc, &o, dist.world, dist.local_size);  // before any allocation
    TrainModes bm = train_baseline_modes(md);
    vit_setup(&base, &cfg, &bm, o.batch, h, w, classes, run_data_src_bytes(&rd), &be, &dist);
    m.micro_batches = o.grad_accum;
    vit_allocate(&m);
    if (o.random_init) vit_random_weights(&m, (uint64_t)o.seed);
    else vit_load_weights(&m, o.model_dir);
    vit_init_trainable(&m, (uint64_t)o.seed);
    if (o.adapter_dir) vit_load_adapter(&m, o.adapter_dir, &o, o.eval_only || !o.data_path);
    else if (o.eval_only) vit_load_checkpoint_head(&m, o.model_dir);
    VitRun run = {&m, &rd};
    Trainer trainer;
    vit_trainer(&trainer, &run, &o, &dist);
    if (dist.rank == 0) train_print_start(&trainer, &o, &dist, &base.plan);
    vit_free(&base);
    train_run(&trainer, &o, &dist);
    run_data_close(&rd);
    vit_free(&m);
    dist_finalize(&dist);
    return 0;
}
#endif
