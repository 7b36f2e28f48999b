// vit_plan.h: where the ViT's buffers (llmc/models/vit.h) come from: the memory plan of every
// buffer by module, before anything is allocated (a dry run stops there); the binding after
// allocation (the trainable arenas' layout, the shared scratch set, the host side); setup,
// allocate and free; and the plan's size at another batch or rank count for fit_check_plan
// (llmc/train/fit.h).
#pragma once
#include "vit.h"
#include "../vision/resample.h"
#include "../train/fit.h"

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
        plan_add(p, MEM_FROZEN, "patch_embed", -1, "patch_w", d * patch_len(c) * w,
                 linear_weight_slot(be, &m->params.patch));
        plan_add(p, MEM_FROZEN, "patch_embed", -1, "patch_b", d * w, &m->params.patch_b);
        plan_add(p, MEM_FROZEN, "embeddings", -1, "cls", d * w, &m->params.cls);
        plan_add(p, MEM_FROZEN, "embeddings", -1, "pos", T * d * w, &m->params.pos);
        plan_add(p, MEM_FROZEN, "final_norm", -1, "norm_g", d * w, &m->params.norm_g);
        plan_add(p, MEM_FROZEN, "final_norm", -1, "norm_b", d * w, &m->params.norm_b);
    }
    for (int l = 0; l < c->layers; l++) {
        VitLayer* layer = &m->params.layers[l];
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
    int std_norm = !md->ms;
    // a linear keeps its input when its own backward needs it: it has an adapter or trains W
    int lora_qkv = md->full || (md->targets & ((1u << T_Q) | (1u << T_K) | (1u << T_V)));
    for (int l = 0; l < c->layers; l++) {
        BlockActs* A = &m->saved.blocks[l];
        BlockActs* s = &m->saved.shared;
        char nm[48];
        int keep = !train_block_recomputes(md, l);  // (block 0 recomputes whenever any does: its shared set)
        if (!keep)  // the checkpoint [N, d]: on the device, or (--offload host) in pinned host memory
            checkpoints_plan_block(p, &m->saved.ckpt, l, N * d * a);
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
    int64_t pixels = B * c->channels * (int64_t)m->img_h * m->img_w;
    plan_add(p, MEM_SCRATCH, "batch", -1, "pixels", pixels * a, &m->batch.pixels);
    plan_add(p, MEM_SCRATCH, "batch", -1, "labels", B * 4, &m->batch.labels);
    if (be->cuda) {
        plan_add(p, MEM_SCRATCH, "batch", -1, "raw_images", B * m->batch.src_bytes, &m->batch.raw);
        plan_add(p, MEM_SCRATCH, "batch", -1, "flips", B * 4, &m->batch.flip);
        plan_add(p, MEM_SCRATCH, "batch", -1, "resize_taps", ((int64_t)m->img_h + m->img_w) * sizeof(ResampleTaps),
                 &m->batch.taps);
    }
    batch_values_plan(&m->batch.bv, be, p, m->modes.lora_dropout > 0 && m->modes.targets);
    plan_add(p, MEM_SCRATCH, "patch_embed", -1, "patches", N * patch_len(c) * a, &m->scratch.patches);
    plan_add(p, MEM_SCRATCH, "residual", -1, "resid", N * d * a, &m->scratch.resid);
    // the recomputed forward's residual stream: a copy of the checkpoint where the backward reads the
    // block input (standard norms); under MS norms it runs in place on the checkpoint
    if (m->saved.ckpt.recomputed && !m->modes.ms)
        plan_add(p, MEM_SCRATCH, "residual", -1, "resid_tmp", N * d * a, &m->scratch.resid_tmp);
    // block inputs [N, d]: with two, one travels to or from the host while the other is in use;
    // the ViT's sequences are short, so its memory never holds fewer (llmc/memory/offload.h)
    checkpoints_plan_staging(p, &m->saved.ckpt, m->modes.offload_staging, N * d * a);
    plan_add(p, MEM_SCRATCH, "grads", -1, "dres", N * d * a, &m->scratch.dres);
    plan_add(p, MEM_SCRATCH, "grads", -1, "dz", N * d * a, &m->scratch.dz);
    plan_add(p, MEM_SCRATCH, "grads", -1, "dq", N * d * a, &m->scratch.dq);
    plan_add(p, MEM_SCRATCH, "grads", -1, "dk", N * d * a, &m->scratch.dk);
    plan_add(p, MEM_SCRATCH, "grads", -1, "dv", N * d * a, &m->scratch.dv);
    plan_add(p, MEM_SCRATCH, "grads", -1, "dout", N * d * a, &m->scratch.dout);
    plan_add(p, MEM_SCRATCH, "grads", -1, "dh", N * f * a, &m->scratch.dh);
    plan_add(p, MEM_SCRATCH, "grads", -1, "dax", N * r * a, &m->scratch.dax);
    if (vit_lora_behind_norm(m))
        plan_add(p, MEM_SCRATCH, "lora", -1, "lora_norm_work", lora_norm_work_bytes((int)r, (int)d, (int)a),
                 &m->scratch.lora_norm_work);
    if (m->modes.lora_dropout > 0 &&
        m->modes.targets) {  // one adapter input at a time, the widest: regenerated, not kept
        int64_t widest = 0;
        for (int t = 0; t < N_TARGETS; t++)
            if ((m->modes.targets >> t & 1) && lin_in(c, t) > widest) widest = lin_in(c, t);
        plan_add(p, MEM_SCRATCH, "lora", -1, "lora_dropout_input", N * widest * a, &m->scratch.drop_work);
    }
    AttnShape as = {m->B, m->T, c->heads, c->heads, c->head_dim, 0, NULL, NULL, 0, 0.0f, 0.0f, 0};
    m->scratch.att_work_bytes = op_plan_attention_work(be, p, as, &m->scratch.att_work);
    op_plan_matmul_workspace(be, p, &m->scratch.blas_work);
    // the head works on the B class tokens only and consumes its buffers at once (fused with the
    // loss, as train_llama's head): scratch, not saved
    plan_add(p, MEM_SCRATCH, "head", -1, "xcls", B * d * a, &m->scratch.xcls);
    plan_add(p, MEM_SCRATCH, "head", -1, "mcls", B * 4, &m->scratch.mcls);
    plan_add(p, MEM_SCRATCH, "head", -1, "rcls", B * 4, &m->scratch.rcls);
    plan_add(p, MEM_SCRATCH, "head", -1, "zcls", B * d * a, &m->scratch.zcls);
    plan_add(p, MEM_SCRATCH, "head", -1, "logits", B * K * 4, &m->scratch.logits);
    plan_add(p, MEM_SCRATCH, "head", -1, "dlogits", B * K * 4, &m->scratch.dlogits);
    plan_add(p, MEM_SCRATCH, "head", -1, "dzcls", B * d * a, &m->scratch.dzcls);
    plan_add(p, MEM_SCRATCH, "head", -1, "dxcls", B * d * a, &m->scratch.dxcls);
    if (be->cuda) {  // the fp32 head's input and its gradient (on the CPU zcls and dzcls are fp32 already)
        plan_add(p, MEM_SCRATCH, "head", -1, "zcls_f32", B * d * 4, &m->scratch.zcls32);
        plan_add(p, MEM_SCRATCH, "head", -1, "dzcls_f32", B * d * 4, &m->scratch.dzcls32);
    }
    op_plan_ce_rows(be, p, "head", &m->scratch.ce, B);
}

static void vit_plan(Vit* m, MemPlan* p) {
    const VitConfig* c = &m->cfg;
    const TrainModes* md = &m->modes;
    memset(p, 0, sizeof(*p));
    p->tokens = (int64_t)m->B * m->T;
    p->blocks = c->layers;
    vit_plan_weights(m, p);
    // The head's kernels read its fp32 master (m->params.head_w), so ZeRO-1 keeps every rank's master whole.
    trainable_plan(&m->params.tr, p, md->full ? "all weights" : "lora+head", vit_trainable_count(m),
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
        trainable_bind_linear_weight(&m->params.tr, off, L);
        if (vit_trains_bias(m, t)) trainable_bind_linear_bias(&m->params.tr, off, L);
    } else if (m->modes.targets >> t & 1) {
        trainable_bind_adapter(&m->params.tr, off, L, m->modes.rank);
    }
}

// After allocation: points the buffers a block does not keep at the shared scratch set.
static void vit_bind_saved(Vit* m) {
    // fc1's output [N, f] under ReGELU2 lives in the gradient scratch dh, which no forward uses
    // (the recomputed one runs before its block's backward) and whose backward reads only the codes
    if (m->modes.approx) m->saved.shared.h = m->scratch.dh;
    for (int l = 0; l < m->cfg.layers; l++) {
        void** a = (void**)&m->saved.blocks[l];
        void** s = (void**)&m->saved.shared;
        for (size_t i = 0; i < sizeof(BlockActs) / sizeof(void*); i++) if (!a[i]) a[i] = s[i];
    }
}

// Block l's norms and linears: the norms' host side (the trainable arena's mirror under --full with
// standard norms, else norms_host), each linear's shape, arena or host slots, and what its adapter
// reads besides (the norm it sits behind, the dropout masks).
static void vit_bind_block(Vit* m, int l, int64_t* off, float** h) {
    const VitConfig* c = &m->cfg;
    VitParams* p = &m->params;
    VitLayer* layer = &p->layers[l];
    int64_t d = c->dim;
    p->layer_off[l] = *off;
    void** ln_dev[N_LN] = {&layer->ln1_g, &layer->ln1_b, &layer->ln2_g, &layer->ln2_b};
    for (int k = 0; k < N_LN; k++)
        layer->ln_host[k] = vit_trains_block_norms(&m->modes)
                                ? trainable_bind_tensor(&p->tr, off, d, ln_dev[k], &layer->ln_grad[k], NULL)
                                : p->norms_host + ((int64_t)l * N_LN + k) * d;
    for (int t = 0; t < N_TARGETS; t++) {
        Linear* L = &layer->lin[t];
        L->in = (int)lin_in(c, t);
        L->out = (int)lin_out(c, t);
        L->name = target_names[t];
        vit_bind_linear(m, L, t, off, h);
        int attn = t <= T_V;
        if (L->A && vit_adapters_see_affine(m) && (attn || t == T_FC1))
            lora_norm_bind(L, attn ? layer->ln1_g : layer->ln2_g, attn ? layer->ln1_b : layer->ln2_b,
                           m->scratch.lora_norm_work);
        if (L->A && m->scratch.drop_work) lora_dropout_bind(L, &m->drop, (uint32_t)(l * N_TARGETS + t));
    }
}

// Wires the trainable weights into the flat arenas (LoRA: layer-major, target order, A then B;
// --full: the embeddings, then block by block its norms (standard) and each linear's W and bias,
// then the final norm; then head W, head b), and sets up the host side: the trainable arena's
// mirror, every linear's fp32 W and bias and the norms.
static void vit_bind_params(Vit* m) {
    const VitConfig* c = &m->cfg;
    VitParams* p = &m->params;
    p->patch.in = (int)patch_len(c);
    p->patch.out = c->dim;
    p->patch.name = "patch embed";
    trainable_bind_host(&p->tr);
    int full = m->modes.full;
    int64_t off = 0, host_lin = 0, d = c->dim;
    for (int t = 0; t < N_TARGETS; t++) host_lin += (full ? 1 : lin_in(c, t) + 1) * lin_out(c, t);
    if (m->be->cuda) p->lin_host = (float*)xcalloc(host_lin * c->layers, sizeof(float));
    p->norms_host = (float*)xcalloc((int64_t)c->layers * N_LN * d, sizeof(float));
    if (full) {
        trainable_bind_linear_weight(&p->tr, &off, &p->patch);
        p->h_patch_b = trainable_bind_tensor(&p->tr, &off, d, &p->patch_b, &p->dpatch_b, NULL);
        p->h_cls = trainable_bind_tensor(&p->tr, &off, d, &p->cls, &p->dcls, NULL);
        p->h_pos = trainable_bind_tensor(&p->tr, &off, m->T * d, &p->pos, &p->dpos, NULL);
    }
    float* h = p->lin_host;
    for (int l = 0; l < c->layers; l++) vit_bind_block(m, l, &off, &h);
    if (full) {
        p->h_norm_g = trainable_bind_tensor(&p->tr, &off, d, &p->norm_g, &p->dnorm_g, NULL);
        p->h_norm_b = trainable_bind_tensor(&p->tr, &off, d, &p->norm_b, &p->dnorm_b, NULL);
    }
    int64_t hw = (int64_t)m->classes * d;
    p->head_w = p->tr.params + off; p->dhead_w = p->tr.grads + off;
    p->h_head_w = p->tr.h_params + off; p->h_dhead_w = p->tr.h_grads + off;
    p->head_b = p->head_w + hw; p->dhead_b = p->dhead_w + hw;
    p->h_head_b = p->h_head_w + hw; p->h_dhead_b = p->h_dhead_w + hw;
    trainable_plan_buckets(&p->tr, p->layer_off, c->layers);  // the final norm and the head lie above the last block
}

// The batch's host side and its staging (CUDA: the raw images, flips, labels and resize taps go up
// together, with the loss scale and dropout key), and the fp32 head's buffers.
static void vit_bind_batch(Vit* m) {
    const Backend* be = m->be;
    VitBatch* b = &m->batch;
    b->h_raw = (uint8_t*)backend_host_side(be, b->raw, m->B * b->src_bytes);
    b->h_flip = (int*)backend_host_side(be, b->flip, sizeof(int) * m->B);
    b->h_labels = (int*)backend_host_side(be, b->labels, sizeof(int) * m->B);
    size_t taps = sizeof(ResampleTaps);  // rows, then columns: two uploads
    size_t batch_bytes = staging_align(m->B * b->src_bytes) + 2 * staging_align(sizeof(int) * m->B) +
                         staging_align(m->img_h * taps) + staging_align(m->img_w * taps);
    batch_bytes += batch_values_bind(&b->bv, be, &m->drop);
    staging_init(&b->staging, be, batch_bytes, b->micro_batches);
    VitScratch* s = &m->scratch;
    if (!s->zcls32) { s->zcls32 = (float*)s->zcls; s->dzcls32 = (float*)s->dzcls; }  // the CPU's are fp32 already
}

// After allocation: every pointer the plan did not set (llmc/models/vit.h's structs, part by part).
static void vit_bind(Vit* m) {
    vit_bind_saved(m);
    lora_dropout_init(&m->drop, m->modes.lora_dropout, m->modes.seed, m->scratch.drop_work);
    vit_bind_params(m);
    vit_bind_batch(m);
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
    m->batch.src_bytes = src_bytes > 0 ? src_bytes : (int64_t)cfg->channels * img_h * img_w;
    m->params.layers = (VitLayer*)xcalloc(cfg->layers, sizeof(VitLayer));
    m->saved.blocks = (BlockActs*)xcalloc(cfg->layers, sizeof(BlockActs));
    checkpoints_init(&m->saved.ckpt, cfg->layers, train_recomputed_blocks(modes, cfg->layers), modes->offload_host);
    m->params.layer_off = (int64_t*)xcalloc(cfg->layers, sizeof(int64_t));
    vit_plan(m, &m->plan);
}

static void vit_allocate(Vit* m) {
    run_allocate_plan(m->be, &m->plan, &m->scratch.blas_work);
    vit_bind(m);
    checkpoints_start(&m->saved.ckpt, m->be, m->cfg.layers, (size_t)m->B * m->T * m->cfg.dim * m->be->abytes);
}

// Frees what vit_setup planned and vit_allocate made (either may be all there was: a dry run).
static void vit_free(Vit* m) {
    VitBatch* b = &m->batch;
    RunMemory mem = {&m->params.tr, &b->staging, &b->bv, m->scratch.blas_work, &m->saved.ckpt, &m->graph,
                     {b->h_raw, b->h_flip, b->h_labels}};
    run_free(m->be, &m->plan, &mem);
    free(m->params.lin_host);
    free(m->params.layers); free(m->saved.blocks); free(m->params.norms_host); free(m->params.layer_off);
}

// What fit_check_plan plans with: the run's model, resolution, classes, backend and ranks.
typedef struct {
    const VitConfig* cfg;
    int h, w, classes;
    int64_t src_bytes;
    const Backend* be;
    const Dist* dist;
} VitPlanCtx;

// The bytes of md's plan at `batch` images over `world` ranks (--recompute auto: its smallest, every
// block recomputed), as fit_check_plan counts them (on the CPU the host arena is host memory too).
static size_t vit_modes_plan_bytes(const VitPlanCtx* c, TrainModes md, int batch, int world) {
    Dist ranks = dist_for_plan(c->dist, world);
    if (md.recompute == RECOMPUTE_AUTO) md.recompute = RECOMPUTE_ALL;
    Vit m;
    vit_setup(&m, c->cfg, &md, batch, c->h, c->w, c->classes, c->src_bytes, c->be, &ranks);
    size_t bytes = plan_total(&m.plan) + (c->be->cuda ? 0 : plan_host_bytes(&m.plan));
    vit_free(&m);
    return bytes;
}

static size_t vit_plan_bytes(const void* ctx, const TrainOptions* o, int batch, int world) {
    return vit_modes_plan_bytes((const VitPlanCtx*)ctx, train_modes_from(o, target_names, N_TARGETS), batch, world);
}

// --recompute auto fitted to `budget` bytes (0: none known): md with the fewest recomputed blocks
// whose plan fits, every block where none does (the fit check then refuses). A direct scan, as
// llmc/models/llama_plan.h's llama_fit_recompute (the plan is not monotone in the count).
static TrainModes vit_fit_recompute(const VitPlanCtx* c, TrainModes md, int batch, size_t budget) {
    if (md.recompute != RECOMPUTE_AUTO) return md;
    int k = 0;
    if (budget)
        while (k < c->cfg->layers &&
               vit_modes_plan_bytes(c, train_modes_recompute(md, k), batch, c->dist ? c->dist->world : 1) > budget)
            k++;
    return train_modes_recompute(md, k);
}
