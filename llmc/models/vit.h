// vit.h: the Vision Transformer (ViT-B/16 style) image classifier that train_vit.cu fine-tunes, as
// one unit: its config, its parameters (shapes beside them), what it keeps for the backward and
// its scratch, then the forward and the backward in reading order: patch embedding, pre-LN blocks
// (attention, MLP), final norm on the class token, head and cross-entropy; and back.
//
// Two memory-saving layers of "Reducing Fine-Tuning Memory Overhead by Approximate and
// Memory-Sharing Backpropagation" are modes of it: ReGELU2 (exact GELU forward, 2-bit backward)
// and MS-LN (gamma and beta merged into the next linears; backward from the normalised output and
// one scalar per row). The operations it calls (llmc/ops.h) run on the backend chosen by --device:
// the CPU (fp32) or a CUDA GPU (bf16 activations and frozen weights, fp32 statistics, LoRA
// masters, the head, gradients and AdamW state).
//
// Beside it: llmc/models/vit_plan.h (the memory plan and binding: where every buffer below comes
// from), llmc/models/vit_io.h (config.json, weights in, adapters, merged export),
// llmc/models/vit_step.h (the batch's way up, a training step, evaluation) and
// llmc/models/vit_checkpoint.h (the checkpoints' layouts).
#pragma once
#include "../common.h"
#include "../linear.h"
#include "../lora_dropout.h"
#include "../backend.h"
#include "../ops.h"
#include "../memory/plan.h"
#include "../memory/checkpoints.h"
#include "../train/run_options.h"
#include "../train/dist.h"
#include "../train/trainable.h"
#include "../train/batch_values.h"
#include "../train/run.h"
#include "../vision/preprocessor.h"
#include "vit_checkpoint.h"

// ----------------------------------------------------------------------------------------------
// Config: config.json of a Hugging Face ViT (ViTModel / ViTForImageClassification), and its
// preprocessor_config.json (llmc/vision/preprocessor.h; 0.5 / 0.5 when absent, the Hugging Face
// ViT default), both read by vit_config_load (llmc/models/vit_io.h).

typedef struct {
    int dim, hidden, layers, heads, head_dim, channels;
    int image_h, image_w, patch_h, patch_w;  // pretraining resolution: the position embedding's grid
    float norm_eps;
    int gelu_tanh;         // hidden_act gelu_pytorch_tanh / gelu_new: the tanh form
    int qkv_bias;          // false: q, k, v have no bias in the checkpoint (zeros here)
    float mean[3], std[3]; // per channel, on pixels scaled to [0, 1] (pre's)
    VitPreprocessor pre;   // preprocessor_config.json
} VitConfig;

// ----------------------------------------------------------------------------------------------
// Parameters. Frozen weights live in one arena (of the backend). The trainable ones (LoRA
// adapters or, under --full, every weight; then the new classification head), their grads and
// AdamW moments live in flat arenas of identical layout, so the optimizer and gradient norm see
// one array.

// The linears of a block, in the order of the checkpoints' names (llmc/models/vit_checkpoint.h).
enum { T_Q = VIT_Q, T_K = VIT_K, T_V = VIT_V, T_PROJ = VIT_PROJ, T_FC1 = VIT_FC1, T_FC2 = VIT_FC2,
       N_TARGETS = VIT_LINEARS };
static const char* const target_names[N_TARGETS] = {"q", "k", "v", "proj", "fc1", "fc2"};

// The four LayerNorm vectors of a block, in this order in VitParams.norms_host.
enum { LN1_G = VIT_LN1_G, LN1_B = VIT_LN1_B, LN2_G = VIT_LN2_G, LN2_B = VIT_LN2_B, N_LN = VIT_BLOCK_NORMS };

// Weights and activations are backend buffers (`void*`: fp32 on the CPU, bf16 on CUDA); norm
// statistics and the attention lse are fp32 on both. d = dim, f = hidden.
typedef struct {
    void *ln1_g, *ln1_b;   // [d] attention LayerNorm (merged into q,k,v under MS-LN; their adapters still apply it)
    void *ln2_g, *ln2_b;   // [d] MLP LayerNorm (merged into fc1 under MS-LN)
    float* ln_host[N_LN];  // the same on the host, fp32 (VitParams.norms_host, or the trainable arena's mirror)
    float* ln_grad[N_LN];  // --full with standard norms: their gradients (backend, fp32); else NULL
    Linear lin[N_TARGETS]; // q, k, v, proj [d, d], fc1 [f, d], fc2 [d, f]; W and bias also on the host in
                           // fp32 (adapters and export read them)
} VitLayer;

typedef struct {
    Linear patch;          // the patch embedding as a linear layer over unfolded patches: W [d, C*ph*pw]
                           // (the conv kernel [d, C, ph, pw], flattened); no bias here, since the
                           // class-token rows take none: op_patch_embed_finish adds it
    void* patch_b;         // [d]
    void* cls;             // [d] class token
    void* pos;             // [T, d] at the fine-tuning resolution (interpolated at load)
    void *norm_g, *norm_b; // [d] final LayerNorm (kept standard: only the class token goes through it)
    // --full trains the above too: their fp32 masters' host mirrors (what loading fills) and their
    // gradients (backend, fp32); NULL when frozen
    float *h_patch_b, *h_cls, *h_pos, *h_norm_g, *h_norm_b;
    float *dpatch_b, *dcls, *dpos, *dnorm_g, *dnorm_b;
    VitLayer* layers;      // [layers]
    float* norms_host;     // [layers][N_LN][d] the blocks' LayerNorm vectors on the host (MS merge, adapters, export)
    float* lin_host;       // CUDA: the host fp32 W and bias of every linear (the plan holds them on the CPU)
    Trainable tr;          // flat trainable arenas: LoRA (or, --full, every weight), then head W, head b
    float *head_w, *head_b, *dhead_w, *dhead_b;  // [classes, d], [classes] inside the backend's arenas
    float *h_head_w, *h_head_b, *h_dhead_w, *h_dhead_b;  // the same in the host mirror
    int64_t* layer_off;    // [layers] where each block's trainable values start in the arena
} VitParams;

// The buffers one block keeps for its backward (or, where not kept, a shared scratch copy); N = B*T.
typedef struct {
    void* x_in;            // [N, d] block input          (standard attention LayerNorm)
    float *mean1, *r1;     // [N] per token            (mean: standard LayerNorm only)
    void* z1;              // [N, d] attention norm output = q,k,v input
    void *q, *k, *v, *o;   // [N, d] attention; o = proj input
    float* lse;            // [B, H, T] log-sum-exp
    void* ax[N_TARGETS];   // [N, r] LoRA A x per adapter
    void* h_mid;           // [N, d] residual after attention (standard MLP LayerNorm)
    float *mean2, *r2;     // [N]
    void* z2;              // [N, d] MLP norm output = fc1 input
    void* h;               // [N, f] fc1 output = GELU input (exact GELU backward)
    uint8_t* codes;        // [N, f] 2-bit ReGELU2 codes of h (f/4 bytes a row)
    void* g;               // [N, f] gelu(h) = fc2 input
} BlockActs;

// What the forward saves for the backward.
typedef struct {
    BlockActs* blocks;     // [layers]
    BlockActs shared;      // scratch set (recompute, or buffers not kept)
    Checkpoints ckpt;      // each recomputed block's input [N, d] (--offload host: on the host)
} VitSaved;

// Scratch of the forward and backward passes (activation gradients have the activations' element type).
typedef struct {
    void* patches;         // [B*T, C*ph*pw] unfolded patches (class-token rows zero)
    void* resid;           // [N, d] the residual stream
    void* resid_tmp;       // [N, d] --recompute block, standard norms: the recomputed block's stream
    void *dres, *dz, *dq, *dk, *dv, *dout;  // [N, d]
    void* dh;              // [N, f]
    void* dax;             // [N, r]
    void* att_work;        // CUDA attention: the tensor-core path's chunk of scores (llmc/memory/cuda_workspace.h)
    size_t att_work_bytes;
    void* blas_work;       // CUDA: cuBLAS's and cuBLASLt's workspace (llmc/memory/cuda_workspace.h)
    void* lora_norm_work;  // MS-LN, --ms-lora exact: the adapters' scratch (llmc/linear.h), else NULL
    void* drop_work;       // --lora-dropout: the adapters' input [N, widest in] (llmc/lora_dropout.h)
    // the head on the class tokens [B, .]: final LayerNorm in the activation type, then fp32
    void *xcls, *zcls, *dzcls, *dxcls;  // [B, d]
    float *mcls, *rcls;                 // [B]
    float *zcls32, *dzcls32;   // [B, d] fp32 copies of zcls / dzcls for the fp32 head (the same buffers on the CPU)
    float *logits, *dlogits;   // [B, classes] fp32
    CeBuffers ce;
} VitScratch;

// The batch on its way in: the images and labels, and (CUDA) what the GPU resizes them from.
typedef struct {
    void* pixels;          // [B, C, H, W] normalised input: fp32 from the CPU loader, or bf16 resized on the GPU
    int* labels;           // [B]
    int* h_labels;         // the labels as the loader writes them (host; == labels on the CPU)
    // CUDA: the raw images go up and the GPU resizes, flips and normalises them
    uint8_t *raw, *h_raw;  // [B, source bytes] (pinned staging on the host)
    int *flip, *h_flip;    // [B]
    void* taps;            // ResampleTaps [img_h + img_w]: rows, then columns
    int64_t src_bytes;     // the largest source image of the run's shards
    BatchStaging staging;  // CUDA: the batch's way up, double buffered (llmc/backend.h)
    int micro_batches;     // per optimizer step (--grad-accum; 0: one), which sizes the staging
    BatchValues bv;        // CUDA: the loss scale and dropout key the kernels read from device memory
} VitBatch;

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
    VitParams params;
    VitSaved saved;
    VitScratch scratch;
    VitBatch batch;
    LoraDropout drop;      // --lora-dropout: the masks' key (llmc/lora_dropout.h)
    MemPlan plan;          // every buffer above, by module (llmc/models/vit_plan.h)
    RunGraph graph;        // LLMC_CUDA_GRAPH=1: each micro-batch's forward + backward replayed as one CUDA graph
} Vit;

static int64_t lin_in(const VitConfig* c, int t) { return t == T_FC2 ? c->hidden : c->dim; }
static int64_t lin_out(const VitConfig* c, int t) { return t == T_FC1 ? c->hidden : c->dim; }
static int64_t patch_len(const VitConfig* c) { return (int64_t)c->channels * c->patch_h * c->patch_w; }

// The host-side LayerNorm vector `which` (LN1_G ...) of block l.
static float* vit_norm_host(const Vit* m, int l, int which) {
    return m->params.layers[l].ln_host[which];
}

// ----------------------------------------------------------------------------------------------
// Forward

// Patch embedding as one product: every ph x pw patch, unfolded in the conv kernel's (c, i, j)
// order, times the kernel [d, C*ph*pw]. Token 0 of each image is the class token; its patch row
// is zero so the product lands straight in the residual stream. Then bias and positions.
static void vit_embed(Vit* m, int B) {
    const VitConfig* c = &m->cfg;
    const VitParams* p = &m->params;
    VitScratch* s = &m->scratch;
    int64_t N = (int64_t)B * m->T;
    op_patch_unfold(m->be, s->patches, m->batch.pixels, B, c->channels, m->img_h, m->img_w, c->patch_h, c->patch_w);
    op_linear_forward(m->be, s->resid, s->patches, &p->patch, NULL, N, 0, 0.0f, OUT_WRITE);
    op_patch_embed_finish(m->be, s->resid, p->cls, p->patch_b, p->pos, N, m->T, c->dim);
}

// A block's LayerNorm of x [N, d] into z, as the norm mode has it: standard (keeps the mean, applies
// gamma and beta) or MS-LN (gamma and beta live in the linears that follow; only 1/std is kept).
// x_saved: where the standard norm's backward finds its input (NULL: not kept, or not needed).
static void vit_norm_forward(const Vit* m, void* z, float* r, float* mean, void* x_saved, const void* x,
                             const void* g, const void* b, int64_t N) {
    int ms = m->modes.ms;
    if (x_saved) op_copy(m->be, x_saved, x, N * m->cfg.dim);
    op_layernorm_forward(m->be, z, r, ms ? NULL : mean, x, ms ? NULL : g, ms ? NULL : b, N, m->cfg.dim,
                         m->cfg.norm_eps);
}

// One pre-LN block, updating the residual stream x [B*T, d] in place and filling a's buffers.
static void block_forward(Vit* m, int l, void* x, BlockActs* a, int B) {
    const Backend* be = m->be;
    const VitConfig* c = &m->cfg;
    const VitLayer* layer = &m->params.layers[l];
    int64_t N = (int64_t)B * m->T;
    int r = m->modes.rank;
    float s = m->modes.lora_scale;
    // bidirectional, one image per row
    AttnShape as = {B, m->T, c->heads, c->heads, c->head_dim, 0, NULL, NULL, 0, 0.0f, 0.0f, 0};
    const VitScratch* sc = &m->scratch;
    vit_norm_forward(m, a->z1, a->r1, a->mean1, a->x_in, x, layer->ln1_g, layer->ln1_b, N);
    op_linear_forward(be, a->q, a->z1, &layer->lin[T_Q], a->ax[T_Q], N, r, s, OUT_WRITE);
    op_linear_forward(be, a->k, a->z1, &layer->lin[T_K], a->ax[T_K], N, r, s, OUT_WRITE);
    op_linear_forward(be, a->v, a->z1, &layer->lin[T_V], a->ax[T_V], N, r, s, OUT_WRITE);
    op_attention_forward(be, a->o, a->lse, a->q, a->k, a->v, as,
                         op_attention_work_fitting(be, as, sc->att_work, sc->att_work_bytes));
    op_linear_forward(be, x, a->o, &layer->lin[T_PROJ], a->ax[T_PROJ], N, r, s, OUT_ADD);
    vit_norm_forward(m, a->z2, a->r2, a->mean2, a->h_mid, x, layer->ln2_g, layer->ln2_b, N);
    op_linear_forward(be, a->h, a->z2, &layer->lin[T_FC1], a->ax[T_FC1], N, r, s, OUT_WRITE);
    op_gelu_forward(be, a->g, m->modes.approx ? a->codes : NULL, a->h, N * c->hidden, c->gelu_tanh);
    op_linear_forward(be, x, a->g, &layer->lin[T_FC2], a->ax[T_FC2], N, r, s, OUT_ADD);
}

// Embedding and all blocks over the uploaded batch; leaves the final norm's input in scratch.resid.
static void vit_forward_blocks(Vit* m, int B) {
    int64_t N = (int64_t)B * m->T;
    vit_embed(m, B);
    for (int l = 0; l < m->cfg.layers; l++) {
        if (train_block_recomputes(&m->modes, l))
            checkpoint_save(&m->saved.ckpt, m->be, l, m->scratch.resid, N * m->cfg.dim);
        block_forward(m, l, m->scratch.resid, &m->saved.blocks[l], B);
    }
}

// Final LayerNorm on the class tokens, head, softmax cross-entropy against batch.labels. In training
// the same pass writes the head's gradients (accumulated) and the gradient w.r.t. the class-token
// rows of the residual stream into scratch.dres (zero elsewhere). grad_scale = 1 / (images in the
// optimizer step). The norm runs in the activation type, the head in fp32 (llmc/ops.h).
static LossStats vit_head_loss(Vit* m, int B, float grad_scale, int backward, double* step_stats) {
    const Backend* be = m->be;
    const VitConfig* c = &m->cfg;
    const VitParams* p = &m->params;
    VitScratch* s = &m->scratch;
    int d = c->dim, K = m->classes;
    int64_t T = m->T, nd = (int64_t)B * d;
    op_copy_rows(be, s->xcls, d, s->resid, T * d, B, d);
    op_layernorm_forward(be, s->zcls, s->rcls, s->mcls, s->xcls, p->norm_g, p->norm_b, B, d, c->norm_eps);
    op_acts_to_f32(be, s->zcls32, s->zcls, nd);
    op_linear_f32_forward(be, s->logits, s->zcls32, p->head_w, p->head_b, B, K, d);
    LossStats st = {};
    st.overflowed = op_norm_overflowed_rows(be, s->rcls, B, step_stats);
    op_softmax_ce_rows(be, s->dlogits, s->logits, m->batch.labels, B, K, grad_scale, backward, &s->ce, &st, step_stats,
                       m->batch.bv.grad_scale);
    if (!backward) return st;
    op_linear_f32_backward(be, s->dzcls32, p->dhead_w, p->dhead_b, s->dlogits, s->zcls32, p->head_w, B, K, d);
    op_f32_to_acts(be, s->dzcls, s->dzcls32, nd);
    op_zero(be, s->dxcls, (size_t)nd * be->abytes);
    op_layernorm_backward(be, s->dxcls, s->dzcls, s->xcls, s->mcls, s->rcls, p->norm_g, B, d);
    if (p->dnorm_g) op_layernorm_affine_grad(be, p->dnorm_g, p->dnorm_b, s->dzcls, s->xcls, s->mcls, s->rcls, B, d);
    op_zero(be, s->dres, (size_t)B * T * d * be->abytes);
    op_copy_rows(be, s->dres, T * d, s->dxcls, d, B, d);
    return st;
}

// ----------------------------------------------------------------------------------------------
// Backward

// The backward of vit_norm_forward: dz (gradient w.r.t. z) back to dx. x: the norm's input (the
// standard norm reads it), z: its output (MS-LN reads it); dg, db: gamma's and beta's gradients
// where --full trains them (else NULL).
static void vit_norm_backward(const Vit* m, void* dx, const void* dz, const void* x, const void* z, const float* mean,
                              const float* r, const void* g, float* dg, float* db, int64_t N) {
    int d = m->cfg.dim;
    if (dg) op_layernorm_affine_grad(m->be, dg, db, dz, x, mean, r, N, d);
    if (m->modes.ms) op_layernorm_ms_backward(m->be, dx, dz, z, r, N, d);
    else op_layernorm_backward(m->be, dx, dz, x, mean, r, g, N, d);
}

// Backpropagates scratch.dres (gradient w.r.t. the block output) to the block input, in place.
// block_input: the recomputed block's input on the device (NULL: not recomputed; a->x_in then).
static void block_backward(Vit* m, int l, BlockActs* a, const void* block_input, int B) {
    const Backend* be = m->be;
    const VitConfig* c = &m->cfg;
    const VitLayer* layer = &m->params.layers[l];
    VitScratch* sc = &m->scratch;
    int64_t N = (int64_t)B * m->T;
    int r = m->modes.rank;
    float s = m->modes.lora_scale;
    AttnShape as = {B, m->T, c->heads, c->heads, c->head_dim, 0, NULL, NULL, 0, 0.0f, 0.0f, 0};
    const void* x_in = block_input ? block_input : a->x_in;
    float* const* dln = layer->ln_grad;
    // MLP: fc2, GELU (exact from h, or ReGELU2 from the codes), fc1, MLP norm
    op_linear_backward(be, sc->dh, sc->dres, a->g, a->ax[T_FC2], &layer->lin[T_FC2], sc->dax, N, r, s, OUT_WRITE);
    op_gelu_backward(be, sc->dh, sc->dh, m->modes.approx ? NULL : a->h, a->codes, N * c->hidden, c->gelu_tanh);
    op_linear_backward(be, sc->dz, sc->dh, a->z2, a->ax[T_FC1], &layer->lin[T_FC1], sc->dax, N, r, s, OUT_WRITE);
    vit_norm_backward(m, sc->dres, sc->dz, a->h_mid, a->z2, a->mean2, a->r2, layer->ln2_g, dln[LN2_G], dln[LN2_B], N);
    // attention: proj, attention, q/k/v, attention norm
    op_linear_backward(be, sc->dout, sc->dres, a->o, a->ax[T_PROJ], &layer->lin[T_PROJ], sc->dax, N, r, s, OUT_WRITE);
    op_attention_backward(be, sc->dq, sc->dk, sc->dv, sc->dout, a->q, a->k, a->v, a->o, a->lse, as, sc->att_work);
    op_linear_backward(be, sc->dz, sc->dq, a->z1, a->ax[T_Q], &layer->lin[T_Q], sc->dax, N, r, s, OUT_WRITE);
    op_linear_backward(be, sc->dz, sc->dk, a->z1, a->ax[T_K], &layer->lin[T_K], sc->dax, N, r, s, OUT_ADD);
    op_linear_backward(be, sc->dz, sc->dv, a->z1, a->ax[T_V], &layer->lin[T_V], sc->dax, N, r, s, OUT_ADD);
    vit_norm_backward(m, sc->dres, sc->dz, x_in, a->z1, a->mean1, a->r1, layer->ln1_g, dln[LN1_G], dln[LN1_B], N);
}

// --recompute block: block l's activations rebuilt from its checkpoint by the same forward (so
// the same bits); returns the checkpoint on the device, which the backward of standard norms
// reads (the forward then runs on a copy; under MS norms in place: the backward never reads it).
static const void* vit_recompute_block(Vit* m, int l, int B) {
    int64_t N = (int64_t)B * m->T;
    void* x = checkpoint_input(&m->saved.ckpt, l);
    void* stream = x;
    if (!m->modes.ms) {
        op_copy(m->be, m->scratch.resid_tmp, x, N * m->cfg.dim);
        stream = m->scratch.resid_tmp;
    }
    block_forward(m, l, stream, &m->saved.blocks[l], B);
    return x;
}

// The blocks in reverse, then (--full) the embeddings: scratch.dres is then the gradient of the first
// block's input, whose class-token rows are cls + pos[0] and whose patch rows are the patch
// product + patch_b + pos (the class rows of the unfolded patches are zero, so they add nothing
// to the patch weight's gradient). Without --full nothing upstream trains and it stops there.
static void vit_backward_blocks(Vit* m, int B) {
    VitParams* p = &m->params;
    VitScratch* s = &m->scratch;
    int64_t N = (int64_t)B * m->T;
    int layers = m->cfg.layers;
    checkpoints_prefetch_last(&m->saved.ckpt);  // (--offload host)
    for (int l = layers - 1; l >= 0; l--) {
        const void* block_input = train_block_recomputes(&m->modes, l) ? vit_recompute_block(m, l, B) : NULL;
        block_backward(m, l, &m->saved.blocks[l], block_input, B);
        checkpoints_prefetch_below(&m->saved.ckpt, l);  // (--offload host) into this block's staging buffer
        // this block's, the final norm's and the head's gradients are final
        trainable_grads_final_from(&p->tr, m->dist, p->layer_off[l]);
    }
    if (!m->modes.full) return;
    op_patch_embed_finish_backward(m->be, p->dcls, p->dpatch_b, p->dpos, s->dres, N, m->T, m->cfg.dim);
    op_linear_backward(m->be, NULL, s->dres, s->patches, NULL, &p->patch, NULL, N, 0, 0.0f, OUT_WRITE);
}

// One micro-batch of B <= m->B images (already uploaded): forward, fused head + loss (+ its
// gradient), backward. Trainable grads accumulate. logits_out (host, [B, classes]): tests only.
// step_stats (CUDA, or NULL): the loss statistics are added there on the device and the returned
// LossStats stay zero (llmc/ops.h).
static LossStats vit_forward_backward(Vit* m, int B, float grad_scale, int backward, float* logits_out,
                                      double* step_stats) {
    batch_values_check(&m->batch.bv, grad_scale, backward, &m->drop, "the images' upload");
    vit_forward_blocks(m, B);
    LossStats st = vit_head_loss(m, B, grad_scale, backward, step_stats);
    if (logits_out) backend_download(m->be, logits_out, m->scratch.logits, sizeof(float) * B * m->classes);
    if (backward) vit_backward_blocks(m, B);
    return st;
}

// ----------------------------------------------------------------------------------------------
// What trains: the modes' rules the plan, the binding, the adapters and the export share.

// Under MS-LN (and LoRA), q, k, v (fc1) absorbed the gamma and beta of the norm that feeds them
// (W' = W diag(gamma), b' = b + W beta), but their adapters keep acting on gamma*z + beta as in the
// original model (llmc/linear.h), so they train exactly what --norm std trains; --ms-lora merged
// puts them on z (the paper's variant).
static int vit_adapters_see_affine(const Vit* m) { return m->modes.ms && !m->modes.full && !m->modes.ms_lora_merged; }
static int vit_lora_behind_norm(const Vit* m) {
    unsigned normed = (1u << T_Q) | (1u << T_K) | (1u << T_V) | (1u << T_FC1);
    return vit_adapters_see_affine(m) && (m->modes.targets & normed);
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
