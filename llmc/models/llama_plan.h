// llama_plan.h: the LLaMA model's memory (llmc/models/llama.h) as data: every buffer planned by
// module before anything is allocated (llama_setup), with the element sizes of the planned backend;
// then allocated and bound (llama_allocate: the buffers a block does not keep pointed at the shared
// scratch set, the trainable weights wired into their flat arenas), and freed (llama_free). Below:
// the MLP's tile rule, the fit of auto's choices (MLP tile, offload staging, LM head chunk) to the
// memory, and the dry run that prints the plan beside the baseline's.
#pragma once
#include "llama.h"
#include "../train/fit.h"
#include "../train/loop.h"

// ----------------------------------------------------------------------------------------------
// The memory plan: every buffer, by module, with the element sizes of the planned backend
// (`wbytes` / `abytes`: fp32 on the CPU, bf16 on CUDA).

static void plan_block_act(MemPlan* p, Llama* m, int l, int keep, const char* module, const char* name, size_t bytes,
                           void* saved_slot, void* tmp_slot) {
    char nm[64];
    snprintf(nm, sizeof(nm), "L%d.%.40s", l, name);
    if (keep) plan_add(p, MEM_SAVED, module, l, nm, bytes, saved_slot);
    else if (l == 0) plan_add(p, MEM_SCRATCH, module, PLAN_SHARED_BLOCK, name, bytes, tmp_slot);
    (void)m;
}

// Frozen weights (bf16 on CUDA, NF4 linears under --quant nf4) and the trainable arena: LoRA's A
// and B, or under --full every weight but the MS-merged gammas.
static void llama_plan_weights(Llama* m, MemPlan* p) {
    const Backend* be = m->be;
    int wbytes = be->wbytes;
    const LlamaConfig* c = &m->cfg;
    const TrainModes* md = &m->modes;
    int64_t d = c->dim, V = c->vocab, r = md->rank;
    int train_norms = md->full && !md->ms;
    if (!md->full) {
        plan_add(p, MEM_FROZEN, "embedding", -1, "embed", V * d * wbytes, &m->w.embed);
        plan_add(p, MEM_FROZEN, "final_norm", -1, "final_norm", d * wbytes, &m->w.final_norm);
        if (!c->tied) plan_add(p, MEM_FROZEN, "lm_head", -1, "lm_head", V * d * wbytes, &m->w.lm_head);
    }
    for (int l = 0; l < c->layers; l++) {
        LlamaLayer* layer = &m->w.layers[l];
        if (!train_norms) {
            plan_add(p, MEM_FROZEN, "attn_norm", l, "attn_norm", d * wbytes, &layer->attn_norm);
            plan_add(p, MEM_FROZEN, "mlp_norm", l, "mlp_norm", d * wbytes, &layer->mlp_norm);
        }
        if (c->gemma && !md->full) {  // the sandwich norms (trained under --full: the arena's)
            plan_add(p, MEM_FROZEN, "post_norm", l, "post_attn_norm", d * wbytes, &layer->post_attn_norm);
            plan_add(p, MEM_FROZEN, "post_norm", l, "post_mlp_norm", d * wbytes, &layer->post_mlp_norm);
        }
        if (c->qk_norm && !md->full) {
            plan_add(p, MEM_FROZEN, "qk_norm", l, "q_norm", c->head_dim * wbytes, &layer->q_norm);
            plan_add(p, MEM_FROZEN, "qk_norm", l, "k_norm", c->head_dim * wbytes, &layer->k_norm);
        }
        if (md->full) continue;  // the linear weights and biases are the trainable arena then (fp32)
        for (int t = 0; t < N_TARGETS; t++) {
            Linear* L = &layer->lin[t];
            int64_t n = lin_in(c, t) * lin_out(c, t);
            if (llama_linear_has_bias(c, t))
                plan_add(p, MEM_FROZEN, target_names[t], l, "bias", lin_out(c, t) * wbytes, linear_bias_slot(be, L));
            if (md->nf4)
                plan_add(p, MEM_FROZEN, target_names[t], l, target_names[t], (size_t)nf4_tensor_bytes(n),
                         (void*)&L->nf4);
            else plan_add(p, MEM_FROZEN, target_names[t], l, target_names[t], n * wbytes, linear_weight_slot(be, L));
        }
    }
    if (md->nf4) {  // the tables, and one scratch of the largest linear's weights, refilled before each product
        int64_t biggest = 0;
        for (int t = 0; t < N_TARGETS; t++)
            biggest = lin_in(c, t) * lin_out(c, t) > biggest ? lin_in(c, t) * lin_out(c, t) : biggest;
        plan_add(p, MEM_FROZEN, "nf4", -1, "nf4_tables", sizeof(float) * NF4_TABLE_FLOATS, &m->w.nf4_tables);
        plan_add(p, MEM_SCRATCH, "nf4", -1, "nf4_dequant", biggest * wbytes, &m->w.nf4_scratch);
    }
    if (c->gemma) plan_add(p, MEM_FROZEN, "embedding", -1, "embed_scale", d * wbytes, &m->w.embed_scale);
    int64_t n_params = md->full ? V * d * (c->tied ? 1 : 2) + d + (train_norms ? 2 * c->layers * d : 0) : 0;
    if (md->full && c->gemma) n_params += 2 * c->layers * d;  // the post norms train in every norm mode
    if (md->full && c->qk_norm) n_params += 2 * c->layers * c->head_dim;
    for (int l = 0; l < c->layers; l++)
        for (int t = 0; t < N_TARGETS; t++) {
            if (md->full) n_params += lin_in(c, t) * lin_out(c, t) + (llama_linear_has_bias(c, t) ? lin_out(c, t) : 0);
            else if (md->targets >> t & 1)  // a fused module's parts share its A (llmc/models/llama.h)
                n_params += r * ((llama_module_lead(c, t) ? lin_in(c, t) : 0) + lin_out(c, t));
        }
    trainable_plan(&m->w.tr, p, md->full ? "all weights" : "lora", n_params,
                   md->full ? SHARD_OPTIM_AND_MASTER : SHARD_NONE, m->dist, be);
    if (md->full && md->full_reference)  // DPO's reference: the weights the kernels read (wbytes each) at step 0
        plan_add(p, MEM_FROZEN, "dpo_reference", -1, "reference_weights", m->w.tr.padded * wbytes, &m->w.ref_arena);
}

// Whether the block keeps the down projection's input p = silu(g) * u [N, f] for its backward.
static int llama_keeps_down_input(const Llama* m) {
    const TrainModes* md = &m->modes;
    return (md->full || (md->targets >> T_DOWN & 1)) && !md->recompute_product;
}

// --mlp-tile auto fits its tile to the memory (llama_fit_mlp_tile). Where it has none to fit (a
// dry run that checks none) or not even its smallest tile fits, it takes this fixed rule: the
// sequence in equal tiles of at most this many tokens. Each MLP product then still has thousands
// of rows (enough to fill a GPU), while its [tile, f] intermediates stop growing with the sequence
// (8192 x 14336 bf16 = 224 MiB each at Llama-3.1-8B).
#define MLP_TILE_AUTO_MAX 8192
// auto tiles are a multiple of this many tokens, so that every tile's rows start 256-byte aligned
// in every MLP buffer (4 bytes per token and more), as cuBLASLt's default alignment assumes
#define MLP_TILE_AUTO_ALIGN 64

// auto fits no tile below this many tokens: every tile re-reads the MLP's three weights (and under
// --quant nf4 dequantizes them again), which at 1M tokens in 64-token tiles would be ~15k passes
// over them per layer; 1024-token tiles cost the longest context ~0.2 % (Llama-3.1-8B, 80 GB)
#define MLP_TILE_AUTO_MIN 1024

// The tile of N tokens cut into k equal tiles: ceil(N / k) rounded up to MLP_TILE_AUTO_ALIGN, or N
// (the whole sequence, one tile) where that reaches N. It shrinks as k grows, down to about
// MLP_TILE_AUTO_MIN at k = llama_mlp_most_tiles(N) (N itself where N is shorter).
static int64_t llama_mlp_equal_tile(int64_t N, int64_t k) {
    int64_t tile = (N + k - 1) / k;
    tile = (tile + MLP_TILE_AUTO_ALIGN - 1) / MLP_TILE_AUTO_ALIGN * MLP_TILE_AUTO_ALIGN;
    return tile < N ? tile : N;
}
static int64_t llama_mlp_most_tiles(int64_t N) {
    return N > MLP_TILE_AUTO_MIN ? N / MLP_TILE_AUTO_MIN : 1;  // floor: each of them >= MLP_TILE_AUTO_MIN
}

// Tokens per MLP tile for N tokens (llmc/train/run_options.h: --mlp-tile): N when the whole
// sequence is one tile (0, or a tile of N or more), else at most N, and, when the intermediate
// size f is not a multiple of 4, a multiple of 4 tokens, so that no byte of ReSiLU2's packed 2-bit
// codes (4 per byte) is shared by two tiles. MLP_TILE_AUTO here is the fixed rule (the callers
// that know the memory have replaced it by the fitted tile: llama_fit_mlp_tile).
static int64_t llama_mlp_tile_rows(int mlp_tile, int64_t N, int64_t f) {
    int64_t tile = mlp_tile;
    if (mlp_tile == MLP_TILE_AUTO) tile = llama_mlp_equal_tile(N, (N + MLP_TILE_AUTO_MAX - 1) / MLP_TILE_AUTO_MAX);
    if (f % 4) tile = (tile + 3) / 4 * 4;
    return tile <= 0 || tile >= N ? N : tile;
}

// What block l keeps for its backward (the table of docs/memory.md), or, where it keeps nothing
// (--recompute block, or a buffer its mode does not keep), the shared scratch set. Under
// --recompute block that set is what the mode keeps (its recomputed forward makes it for the
// backward: ReSiLU2's codes, not g; MS norms' z, not their input) plus the forward's own
// temporaries (z1, z2 where no linear keeps them; Qwen3's q, k under MS norms, rebuilt anyway).
// Temporaries no backward reads live in gradient scratch instead (llama_bind_forward_temporaries).
// The MLP and its norm run in tiles of m->mlp_tile tokens (llama_mlp), so the shared
// set's MLP buffers hold one tile: a forward temporary lives for one tile, and under --recompute
// block the backward recomputes the MLP tile by tile just before that tile's backward.
static void llama_plan_block(Llama* m, MemPlan* p, int l) {
    const LlamaConfig* c = &m->cfg;
    const TrainModes* md = &m->modes;
    int recomputes = train_block_recomputes(md, l);
    int abytes = m->be->abytes, keep = !recomputes, msqk = llama_qk_norm_ms(m);
    int64_t N = (int64_t)m->B * m->T, d = c->dim, f = c->hidden, qd = (int64_t)c->heads * c->head_dim,
            kvd = (int64_t)c->kv_heads * c->head_dim, r = md->rank;
    // a linear keeps its input when its own backward needs it: it has an adapter or trains W
    int lora_qkv = md->full || (md->targets & ((1u << T_Q) | (1u << T_K) | (1u << T_V)));
    int lora_gu = md->full || (md->targets & ((1u << T_GATE) | (1u << T_UP)));
    BlockActs* a = &m->saved.block[l];
    BlockActs* s = &m->scratch.tmp;
    char nm[48];
    if (recomputes)  // the checkpoint [N, d]: on the device, or (--offload host) in pinned host memory
        checkpoints_plan_block(p, &m->saved.ckpt, l, N * d * abytes);
    if (!md->ms && !recomputes)
        plan_block_act(p, m, l, 1, "attn_norm", "x_in", N * d * abytes, &a->x_in, NULL);
    plan_block_act(p, m, l, keep, "attn_norm", "r1", N * 4, &a->r1, &s->r1);
    plan_block_act(p, m, l, keep && (md->ms || lora_qkv), "qkv_input", "z1", N * d * abytes, &a->z1, &s->z1);
    if (c->qk_norm) {
        if (!msqk) plan_block_act(p, m, l, keep, "qk_norm", "q_pre", N * qd * abytes, &a->q_pre, &s->q_pre);
        if (!msqk) plan_block_act(p, m, l, keep, "qk_norm", "k_pre", N * kvd * abytes, &a->k_pre, &s->k_pre);
        if (msqk) plan_block_act(p, m, l, keep, "qk_norm", "q_normed", N * qd * abytes, &a->qz, &s->qz);
        if (msqk) plan_block_act(p, m, l, keep, "qk_norm", "k_normed", N * kvd * abytes, &a->kz, &s->kz);
        plan_block_act(p, m, l, keep, "qk_norm", "rq", N * c->heads * 4, &a->rq, &s->rq);
        plan_block_act(p, m, l, keep, "qk_norm", "rk", N * c->kv_heads * 4, &a->rk, &s->rk);
    }
    plan_block_act(p, m, l, keep && !msqk, "attention", "q", N * qd * abytes, &a->q, &s->q);
    // k and v keep attention's layout: under --seq-parallel with fewer key/value heads than ranks
    // that is one replicated head for the whole sequence, wider than this rank's tokens' kv heads
    int64_t kv_kept = N * seqpar_kv_width(&m->sp) * abytes;
    plan_block_act(p, m, l, keep && !msqk, "attention", "k", kv_kept, &a->k, &s->k);
    plan_block_act(p, m, l, keep, "attention", "v", kv_kept, &a->v, &s->v);
    plan_block_act(p, m, l, keep, "attention", "o", N * qd * abytes, &a->o, &s->o);
    plan_block_act(p, m, l, keep, "attention", "lse", N * c->heads * 4, &a->lse, &s->lse);
    if (c->gemma) {  // the post norms' inputs and 1/rms (standard norms: their backward reads the input)
        plan_block_act(p, m, l, keep, "post_norm_std", "attn_out", N * d * abytes, &a->ya, &s->ya);
        plan_block_act(p, m, l, keep, "post_norm_std", "attn_out_r", N * 4, &a->ra, &s->ra);
    }
    int64_t tile = m->mlp_tile, rows = keep ? N : tile;  // rows of the MLP's kept (N) or shared (tile) buffers
    for (int t = 0; t < N_TARGETS; t++) {  // a fused module's parts share A x: the lead's (llama_bind)
        if (!(md->targets >> t & 1) || !llama_module_lead(c, t)) continue;
        snprintf(nm, sizeof(nm), "lora_%s_ax", target_names[t]);
        int64_t ax_rows = t >= T_GATE ? rows : N;
        plan_block_act(p, m, l, keep, "lora", nm, ax_rows * r * abytes, &a->ax[t], &s->ax[t]);
    }
    int keep_z2 = keep && (md->ms || lora_gu);
    if (!md->ms) plan_block_act(p, m, l, keep, "mlp_norm", "h_mid", rows * d * abytes, &a->h_mid, &s->h_mid);
    plan_block_act(p, m, l, keep, "mlp_norm", "r2", rows * 4, &a->r2, &s->r2);
    plan_block_act(p, m, l, keep_z2, "gate_up_input", "z2", (keep_z2 ? N : tile) * d * abytes, &a->z2, &s->z2);
    const char *act = c->gemma ? "gelu" : "silu", *prod = c->gemma ? "geglu_product" : "swiglu_product";
    if (!md->approx) plan_block_act(p, m, l, keep, act, "g", rows * f * abytes, &a->g, &s->g);
    if (md->approx)
        plan_block_act(p, m, l, keep, act, "codes", (size_t)packed_codes_bytes(rows * f), &a->codes, &s->codes);
    plan_block_act(p, m, l, keep, prod, c->gemma ? "gelu_g" : "silu_g", rows * f * abytes, &a->sg, &s->sg);
    plan_block_act(p, m, l, keep, prod, "up", rows * f * abytes, &a->u, &s->u);
    if (llama_keeps_down_input(m))
        plan_block_act(p, m, l, keep, "down_input", "product", rows * f * abytes, &a->p, &s->p);
    if (c->gemma) {
        plan_block_act(p, m, l, keep, "post_norm_std", "mlp_out", rows * d * abytes, &a->ym, &s->ym);
        plan_block_act(p, m, l, keep, "post_norm_std", "mlp_out_r", rows * 4, &a->rm, &s->rm);
    }
}

// Scratch of the forward and backward passes: the residual stream, the activation gradients, the
// adapters' and the ops' work buffers, the batch, the loss chunk and (--generate) the KV cache.
// Whether dout, the gradient w.r.t. attention's output [N, heads*hd], lives in dz's buffer [N, d]
// (itself resid's). Their lives in a block's backward do not overlap: the MLP's backward is done
// with dz before the o projection's backward writes dout, and attention's backward has read dout
// before the q projection's backward writes dz. Not when dout is the wider (heads*hd > d), nor
// under Qwen3's q/k norms, whose backward uses dout as scratch while dz is being written.
static int llama_dout_shares_dz(const Llama* m) {
    return !m->cfg.qk_norm && (int64_t)m->cfg.heads * m->cfg.head_dim <= m->cfg.dim;
}

// --seq-parallel's exchange scratch (llmc/train/seq_parallel.h), lent by the gradient scratch
// where dout lives in dz's buffer (resid's, [N, d], then at least [N, heads*hd]), instead of two
// buffers [N, heads*hd] of its own: attention's output in token layout, the o projection's input,
// lives in dq, dead from the q projection's backward until attention's backward writes it again;
// it also holds the packed q, k, v (forward) and dout (backward) before it is written. The
// exchanges of o and of the gradients receive into a buffer [N, d] dead at the time
// (llama_seqpar_work): dres in the forward (the gradient stream lives in the backward only),
// resid in the recomputed forward and the backward (the recomputed forward's stream is the
// checkpoint or resid_tmp; in the backward o's exchange comes after the MLP's backward is done
// with dz, and the gradients' after attention's backward has read dout, both before their
// buffer's next writer, the o and the q projection's backward). LLMC_SEQPAR_LEND=0 plans the
// group's own two buffers instead (the same numbers; to rule the lending out on a GPU).
static int llama_seqpar_lends(const Llama* m) {
    return m->sp.P > 1 && llama_dout_shares_dz(m) && setting_on(SETTING_SEQPAR_LEND);
}

// The attention shape whose scratch is the largest of the model's layers (a sliding layer's
// window shrinks it, so a model of full and sliding layers plans its full ones): whole sequences
// and this rank's heads under --seq-parallel. Every layer's call then fits the workspace.
static AttnShape llama_plan_attn_shape(const Llama* m) {
    const LlamaConfig* c = &m->cfg;
    AttnShape best;
    memset(&best, 0, sizeof(best));  // every layer's shape replaces it (layer 0 first)
    size_t most = 0;
    for (int l = 0; l < c->layers; l++) {
        AttnShape as = {m->B, m->T, c->heads, c->kv_heads, c->head_dim, 1, NULL, NULL,
                        llama_layer_window(c, l), c->attn_scale, c->attn_softcap, llama_tile_window(c)};
        if (m->sp.P > 1) as = seqpar_attn_shape(&m->sp, &as);
        size_t bytes = m->be->cuda ? op_attention_work_bytes(m->be, as) : attention_scratch_bytes(as, 1);
        if (l == 0 || bytes > most) best = as, most = bytes;
    }
    return best;
}

static void llama_plan_scratch(Llama* m, MemPlan* p) {
    const Backend* be = m->be;
    int abytes = be->abytes;
    const LlamaConfig* c = &m->cfg;
    const TrainModes* md = &m->modes;
    int64_t N = (int64_t)m->B * m->T, d = c->dim, f = c->hidden, qd = (int64_t)c->heads * c->head_dim,
            kvd = (int64_t)c->kv_heads * c->head_dim, V = c->vocab, r = md->rank;
    int lora_norm_inputs =
        md->full || (md->targets & ((1u << T_Q) | (1u << T_K) | (1u << T_V) | (1u << T_GATE) | (1u << T_UP)));
    plan_add(p, MEM_SCRATCH, "residual", -1, "resid", N * d * abytes, &m->scratch.resid);
    // the recomputed forward's residual stream: a copy of the checkpoint where the backward reads
    // the block input (standard norms); under MS norms it runs in place on the checkpoint
    if (m->saved.ckpt.recomputed && !md->ms)
        plan_add(p, MEM_SCRATCH, "residual", -1, "resid_tmp", N * d * abytes, &m->scratch.resid_tmp);
    // block inputs [N, d]: with two, one travels to or from the host while the other is in use;
    // one where the memory holds no more (llama_fit_to_memory, llmc/memory/offload.h)
    checkpoints_plan_staging(p, &m->saved.ckpt, md->offload_staging, N * d * abytes);
    plan_add(p, MEM_SCRATCH, "grads", -1, "dres", N * d * abytes, &m->scratch.dres);
    // dz [N, d] has no buffer of its own: it is resid's (llama_bind), by lifetime. resid's last
    // reader is the head (the final norm's input); dz's first writer is the first block's backward.
    // dout too, where it can (llama_dout_shares_dz).
    plan_add(p, MEM_SCRATCH, "grads", -1, "dq", N * qd * abytes, &m->scratch.dq);
    int64_t kv_grad = N * seqpar_kv_width(&m->sp) * abytes;  // attention's layout (llama_plan_block's k, v)
    plan_add(p, MEM_SCRATCH, "grads", -1, "dk", kv_grad, &m->scratch.dk);
    plan_add(p, MEM_SCRATCH, "grads", -1, "dv", kv_grad, &m->scratch.dv);
    if (!llama_dout_shares_dz(m)) plan_add(p, MEM_SCRATCH, "grads", -1, "dout", N * qd * abytes, &m->scratch.dout);
    // the MLP's gradients (and the forward temporaries bound to them) for one tile of tokens
    plan_add(p, MEM_SCRATCH, "grads", -1, "dp", m->mlp_tile * f * abytes, &m->scratch.dp);
    plan_add(p, MEM_SCRATCH, "grads", -1, "dg", m->mlp_tile * f * abytes, &m->scratch.dg);
    plan_add(p, MEM_SCRATCH, "grads", -1, "du", m->mlp_tile * f * abytes, &m->scratch.du);
    plan_add(p, MEM_SCRATCH, "grads", -1, "dax", N * r * abytes, &m->scratch.dax);
    if (m->cfg.gemma)  // the post norms' output on its way to the residual stream, their gradient in backward
        plan_add(p, MEM_SCRATCH, "post_norm", -1, "post", N * d * abytes, &m->scratch.tmp.post);
    if (llama_adapters_see_gamma(m) && lora_norm_inputs)
        plan_add(p, MEM_SCRATCH, "lora", -1, "lora_norm_work", lora_norm_work_bytes((int)r, (int)d, abytes),
                 &m->scratch.lora_norm_work);
    if (md->lora_dropout > 0 && md->targets) {  // one adapter input at a time, the largest: regenerated, not kept
        int64_t largest = 0;  // elements: the MLP's linears see one tile of rows, the others all N
        for (int t = 0; t < N_TARGETS; t++) {
            int64_t n = (t >= T_GATE ? m->mlp_tile : N) * lin_in(c, t);
            if ((md->targets >> t & 1) && n > largest) largest = n;
        }
        plan_add(p, MEM_SCRATCH, "lora", -1, "lora_dropout_input", largest * abytes, &m->scratch.drop_work);
    }
    m->scratch.att_work_bytes = op_plan_attention_work(be, p, llama_plan_attn_shape(m), &m->scratch.att_work);
    op_plan_matmul_workspace(be, p, &m->scratch.blas_work);
    plan_add(p, MEM_SCRATCH, "batch", -1, "inputs", N * 4, &m->io.inputs);
    plan_add(p, MEM_SCRATCH, "batch", -1, "targets", N * 4, &m->io.targets);
    plan_add(p, MEM_SCRATCH, "batch", -1, "mask", N * 4, &m->io.mask);
    batch_values_plan(&m->io.bv, be, p, md->lora_dropout > 0 && md->targets);
    plan_add(p, MEM_SCRATCH, "batch", -1, "pos", N * 4, &m->io.pos);
    if (m->sp.P == 1 && op_attention_wants_docs(be))  // at most a document per token
        plan_add(p, MEM_SCRATCH, "batch", -1, "attention documents", attn_docs_bytes(N), &m->io.docs_buf);
    seqpar_plan(&m->sp, p, llama_seqpar_lends(m));
    if (m->modes.full) plan_add(p, MEM_SCRATCH, "batch", -1, "embed_order", N * 4, &m->io.embed_order);
    HeadChunkRule rule;
    m->scratch.loss_chunk =
        (int)lm_head_chunk(be, N, d, V, md->head_chunk_small ? HEAD_CHUNK_WANT_SMALL : HEAD_CHUNK_WANT_PLAN,
                                       &rule);
    p->loss_chunk_rows = m->scratch.loss_chunk;
    p->loss_chunk_rule = head_chunk_rule_names[rule];
    op_plan_lm_head_loss(be, p, &m->scratch.loss, m->scratch.loss_chunk, d, V);
    if (!md->generate) return;
    char nm[48];  // one window of m->T positions (llama_generate)
    for (int l = 0; l < c->layers; l++) {
        snprintf(nm, sizeof(nm), "L%d.key_cache", l);
        plan_add(p, MEM_SCRATCH, "generation", -1, nm, m->T * kvd * abytes, &m->scratch.kv_k[l]);
        snprintf(nm, sizeof(nm), "L%d.value_cache", l);
        plan_add(p, MEM_SCRATCH, "generation", -1, nm, m->T * kvd * abytes, &m->scratch.kv_v[l]);
    }
    plan_add(p, MEM_SCRATCH, "generation", -1, "generation_logits", V * 4, &m->scratch.gen_logits);
}

static void llama_plan(Llama* m, MemPlan* p) {
    const LlamaConfig* c = &m->cfg;
    memset(p, 0, sizeof(*p));
    p->tokens = (int64_t)m->B * m->T;
    p->blocks = c->layers;
    p->recomputed = m->saved.ckpt.recomputed;
    llama_plan_weights(m, p);
    int64_t rope_bytes = (int64_t)m->sp.T * (c->rot_dim / 2) * 4;  // [T, rot/2] fp32: 2 GiB at 8M positions
    plan_add(p, MEM_SCRATCH, "rope", -1, "rope_cos", rope_bytes, &m->w.rope_cos);
    plan_add(p, MEM_SCRATCH, "rope", -1, "rope_sin", rope_bytes, &m->w.rope_sin);
    if (c->rope_local_theta > 0.0f) {  // Gemma 3's local layers: their own base
        plan_add(p, MEM_SCRATCH, "rope", -1, "rope_local_cos", rope_bytes, &m->w.rope_local_cos);
        plan_add(p, MEM_SCRATCH, "rope", -1, "rope_local_sin", rope_bytes, &m->w.rope_local_sin);
    }
    for (int l = 0; l < c->layers; l++) llama_plan_block(m, p, l);
    llama_plan_scratch(m, p);
}

// Forward temporaries no backward reads, in gradient scratch, which no forward uses (the
// recomputed one runs before its block's backward): the gate pre-activation g [N, f] under
// ReSiLU2 (its 2-bit codes are kept), the product p [N, f] where the down projection's input is
// not kept (a rebuilt one, --swiglu-product recompute, is dead before du is written), and under
// MS norms Qwen3's q, k projections before their norm [N, qd], [N, kvd] (z is kept).
static void llama_bind_forward_temporaries(Llama* m) {
    if (m->modes.approx) m->scratch.tmp.g = m->scratch.dg;
    if (!llama_keeps_down_input(m)) m->scratch.tmp.p = m->scratch.du;
    if (llama_qk_norm_ms(m)) { m->scratch.tmp.q_pre = m->scratch.dq; m->scratch.tmp.k_pre = m->scratch.dk; }
}

// Wires the trainable weights into the flat arena (layer-major, target order; LoRA A then B, or W
// under --full) where the kernels read them: tr->params (CPU) or tr->params16 (CUDA). Called again
// with those pointing elsewhere, it points the model there (DPO's frozen reference under --full).
static void llama_bind_weights(Llama* m) {
    const LlamaConfig* c = &m->cfg;
    int64_t off = 0, r = m->modes.rank, d = c->dim, V = c->vocab;
    if (m->modes.full) {  // arena: embedding, head (untied), final norm, then block by block
        m->w.h_embed = trainable_bind_tensor(&m->w.tr, &off, V * d, &m->w.embed, &m->w.dembed, NULL);
        if (!c->tied)
            m->w.h_lm_head = trainable_bind_tensor(&m->w.tr, &off, V * d, &m->w.lm_head, &m->w.dlm_head, NULL);
        m->w.h_final_norm = trainable_bind_tensor(&m->w.tr, &off, d, &m->w.final_norm, &m->w.dfinal_norm, NULL);
    }
    if (c->tied) { m->w.lm_head = m->w.embed; m->w.dlm_head = m->w.dembed; m->w.h_lm_head = m->w.h_embed; }
    for (int l = 0; l < c->layers; l++)
        for (int t = 0; t < N_TARGETS; t++) {
            Linear* L = &m->w.layers[l].lin[t];
            if (t == 0) {
                m->w.layer_off[l] = off;
                LlamaLayer* layer = &m->w.layers[l];
                if (m->modes.full && !m->modes.ms) {  // the gammas train too (MS merged them into W)
                    layer->h_attn_norm =
                        trainable_bind_tensor(&m->w.tr, &off, d, &layer->attn_norm, &layer->dattn_norm, NULL);
                    layer->h_mlp_norm =
                        trainable_bind_tensor(&m->w.tr, &off, d, &layer->mlp_norm, &layer->dmlp_norm, NULL);
                }
                if (m->modes.full && c->gemma) {  // the sandwich norms train in every norm mode (standard)
                    layer->h_post_attn_norm = trainable_bind_tensor(&m->w.tr, &off, d, &layer->post_attn_norm,
                                                                    &layer->dpost_attn_norm, NULL);
                    layer->h_post_mlp_norm = trainable_bind_tensor(&m->w.tr, &off, d, &layer->post_mlp_norm,
                                                                   &layer->dpost_mlp_norm, NULL);
                }
                if (m->modes.full && c->qk_norm) {  // Qwen3's q/k norms train in every norm mode (no merge took them)
                    layer->h_q_norm =
                        trainable_bind_tensor(&m->w.tr, &off, c->head_dim, &layer->q_norm, &layer->dq_norm, NULL);
                    layer->h_k_norm =
                        trainable_bind_tensor(&m->w.tr, &off, c->head_dim, &layer->k_norm, &layer->dk_norm, NULL);
                }
            }
            L->in = (int)lin_in(c, t);
            L->out = (int)lin_out(c, t);
            L->name = target_names[t];
            if (m->modes.nf4) {
                L->nf4_tables = m->w.nf4_tables;
                *linear_weight_slot(m->be, L) = m->w.nf4_scratch;
            }
            if (m->modes.full) {
                trainable_bind_linear_weight(&m->w.tr, &off, L);  // full fine-tuning: W (and its bias) train
                if (llama_linear_has_bias(c, t)) trainable_bind_linear_bias(&m->w.tr, &off, L);
            } else if (m->modes.targets >> t & 1) {
                int lead = llama_fused_lead(c, t);  // a fused module's parts share its A (llmc/models/llama.h)
                if (lead == t) trainable_bind_adapter(&m->w.tr, &off, L, (int)r);
                else trainable_bind_adapter_shared_a(&m->w.tr, &off, L, &m->w.layers[l].lin[lead], (int)r);
                const void* gamma = t <= T_V                   ? m->w.layers[l].attn_norm
                                    : t == T_GATE || t == T_UP ? m->w.layers[l].mlp_norm
                                                               : NULL;
                if (gamma && llama_adapters_see_gamma(m)) lora_norm_bind(L, gamma, NULL, m->scratch.lora_norm_work);
                // the parts of a fused module read one input, dropped out once: the lead's mask
                if (m->scratch.drop_work) lora_dropout_bind(L, &m->drop, (uint32_t)(l * N_TARGETS + lead));
            }
        }
}

// After allocation: points the buffers a block does not keep at the shared scratch set, wires the
// trainable weights into the flat arenas (layer-major, target order; LoRA A then B, or W under
// --full), and sets up the host side of the batch and of the trainable arena.
static void llama_bind(Llama* m) {
    const LlamaConfig* c = &m->cfg;
    llama_bind_forward_temporaries(m);
    // [N, d] both: the residual stream dies at the head, before any backward writes dz
    m->scratch.dz = m->scratch.resid;
    if (llama_dout_shares_dz(m)) m->scratch.dout = m->scratch.dz;
    if (m->sp.lent) m->sp.tok = m->scratch.dq;
    for (int l = 0; l < c->layers; l++) {
        void** a = (void**)&m->saved.block[l];
        void** s = (void**)&m->scratch.tmp;
        for (size_t i = 0; i < sizeof(BlockActs) / sizeof(void*); i++) if (!a[i]) a[i] = s[i];
        for (int t = 0; t < N_TARGETS; t++) {  // a fused module's parts: the same A x, so the lead's buffer
            m->saved.block[l].ax[t] = m->saved.block[l].ax[llama_fused_lead(c, t)];
            m->scratch.tmp.ax[t] = m->scratch.tmp.ax[llama_fused_lead(c, t)];
        }
    }
    trainable_bind_host(&m->w.tr);
    lora_dropout_init(&m->drop, m->modes.lora_dropout, m->modes.seed, m->scratch.drop_work);
    llama_bind_weights(m);
    trainable_plan_buckets(&m->w.tr, m->w.layer_off,
                           c->layers);  // embedding, head and final norm lie below the first block
    int64_t N = (int64_t)m->B * m->T;
    m->io.h_inputs = (int*)backend_host_side(m->be, m->io.inputs, sizeof(int) * N);
    m->io.h_targets = (int*)backend_host_side(m->be, m->io.targets, sizeof(int) * N);
    m->io.h_pos = (int*)backend_host_side(m->be, m->io.pos, sizeof(int) * N);
    m->io.h_mask = (float*)backend_host_side(m->be, m->io.mask, sizeof(float) * N);
    if (m->sp.P > 1) m->sp.h_pos = (int*)backend_host_side(m->be, m->sp.pos, sizeof(int) * m->sp.N);
    if (m->io.embed_order) m->io.h_embed_order = (int*)backend_host_side(m->be, m->io.embed_order, sizeof(int) * N);
    size_t batch_bytes = 4 * staging_align(sizeof(int) * N) + (m->io.embed_order ? staging_align(sizeof(int) * N) : 0);
    if (m->sp.P > 1) batch_bytes += staging_align(sizeof(int) * m->sp.N);  // --seq-parallel: every token's position
    if (m->io.docs_buf) {  // its four arrays, each uploaded as far as the batch uses it (llama_upload_documents)
        m->io.h_docs_buf = backend_host_side(m->be, m->io.docs_buf, attn_docs_bytes(N));
        batch_bytes += 3 * staging_align(sizeof(int64_t) * (N + 1)) + staging_align(sizeof(int32_t) * N);
    }
    batch_bytes += batch_values_bind(&m->io.bv, m->be, &m->drop);
    staging_init(&m->io.staging, m->be, batch_bytes, m->io.micro_batches);
}

// Declares the model's memory for a micro-batch of B x T on backend `be`; nothing is allocated
// until llama_allocate (a dry run stops at the plan).
static void llama_setup(Llama* m, const LlamaConfig* cfg, const TrainModes* modes, int B, int T, const Backend* be,
                        const Dist* dist) {
    memset(m, 0, sizeof(*m));
    m->be = be;
    m->dist = dist;
    m->cfg = *cfg;
    m->modes = *modes;
    llama_check_fused_targets(cfg, modes->targets);
    m->B = B;
    seqpar_setup(&m->sp, dist, be, B, T, cfg->heads, cfg->kv_heads, cfg->head_dim);
    m->T = T / m->sp.P;  // this rank's slice of each sequence (the whole batch's N / P tokens)
    m->mlp_tile = llama_mlp_tile_rows(modes->mlp_tile, (int64_t)B * m->T, cfg->hidden);
    m->w.layers = (LlamaLayer*)xcalloc(cfg->layers, sizeof(LlamaLayer));
    m->saved.block = (BlockActs*)xcalloc(cfg->layers, sizeof(BlockActs));
    checkpoints_init(&m->saved.ckpt, cfg->layers, train_recomputed_blocks(modes, cfg->layers), modes->offload_host);
    m->w.layer_off = (int64_t*)xcalloc(cfg->layers, sizeof(int64_t));
    m->scratch.kv_k = (void**)xcalloc(cfg->layers, sizeof(void*));
    m->scratch.kv_v = (void**)xcalloc(cfg->layers, sizeof(void*));
    llama_plan(m, &m->plan);
}

// Allocates the plan (llmc/train/run.h's run_allocate_plan), binds it and starts the checkpoints' copies.
static void llama_allocate(Llama* m) {
    run_allocate_plan(m->be, &m->plan, &m->scratch.blas_work);
    llama_bind(m);
    checkpoints_start(&m->saved.ckpt, m->be, m->cfg.layers, (size_t)m->B * m->T * m->cfg.dim * m->be->abytes);
}

// Frees what llama_setup planned and llama_allocate made (a dry run: the plan alone).
static void llama_free(Llama* m) {
    RunMemory r = {&m->w.tr, &m->io.staging, &m->io.bv, m->scratch.blas_work, &m->saved.ckpt, &m->graph,
                   {m->io.h_inputs, m->io.h_targets, m->io.h_pos, m->io.h_mask, m->io.h_embed_order, m->sp.h_pos,
                    m->io.h_docs_buf}};
    run_free(m->be, &m->plan, &r);
    free(m->w.layers);
    free(m->saved.block);
    free(m->w.gamma_host);
    free(m->w.layer_off);
    free(m->scratch.kv_k);
    free(m->scratch.kv_v);
}

// The bytes of md's plan at B x T on these ranks, as fit_check_plan counts them.
static size_t llama_modes_plan_bytes(const LlamaConfig* cfg, const TrainModes* md, int B, int T, const Backend* be,
                                     const Dist* ranks) {
    Llama m;
    llama_setup(&m, cfg, md, B, T, be, ranks);
    size_t bytes = plan_total(&m.plan) + (be->cuda ? 0 : plan_host_bytes(&m.plan));  // (CPU: all host memory)
    llama_free(&m);
    return bytes;
}

// --mlp-tile as a count for the k-th candidate of auto: k equal tiles of the rank's N tokens (0:
// the whole sequence, which the other rules also plan as one tile).
static int llama_mlp_candidate(int64_t N, int64_t k) {
    int64_t tile = llama_mlp_equal_tile(N, k);
    return tile >= N ? 0 : (int)tile;
}

// The tokens per MLP tile each rank holds: its slice of B x T (--seq-parallel P: B x T / P).
static int64_t llama_rank_tokens(int B, int T, const Dist* ranks) { return (int64_t)B * (T / dist_sp(ranks)); }

// --mlp-tile auto fitted to `budget` bytes (0: no memory to fit): md with the largest tile whose
// plan fits, among equal tiles (k = 1, 2, ... tiles of llama_mlp_equal_tile; k = 1 the whole
// sequence). A plan grows with its tile and the tile shrinks as k grows, so a bisection on k finds
// the fewest tiles that fit: fits(hi) and !fits(lo) throughout. md is returned unchanged (auto's
// fixed rule, llama_mlp_tile_rows) when its tile is not auto or not even the smallest tile fits
// (the fit check then says what the plan needs, as without tiling).
static TrainModes llama_fit_mlp_tile(const LlamaConfig* cfg, TrainModes md, int B, int T, const Backend* be,
                                     const Dist* ranks, size_t budget) {
    int64_t N = llama_rank_tokens(B, T, ranks), most = llama_mlp_most_tiles(N);
    if (md.mlp_tile != MLP_TILE_AUTO || N > INT_MAX) return md;
    TrainModes at = md;
    at.mlp_tile = llama_mlp_candidate(N, most);
    if (llama_modes_plan_bytes(cfg, &at, B, T, be, ranks) > budget) return md;
    int64_t lo = 0, hi = most;  // k = 0 stands for no tile at all: !fits(lo), fits(hi)
    while (hi - lo > 1) {
        int64_t mid = lo + (hi - lo) / 2;
        at.mlp_tile = llama_mlp_candidate(N, mid);
        if (llama_modes_plan_bytes(cfg, &at, B, T, be, ranks) <= budget) hi = mid;
        else lo = mid;
    }
    md.mlp_tile = llama_mlp_candidate(N, hi);
    return md;
}

// md's smallest plan of what auto chooses: auto's smallest tile, one offload staging buffer and the
// old LM head chunk. A length or batch fits under auto exactly when this does (llama_fit_to_memory
// finds the rest).
static TrainModes llama_smallest_choices(TrainModes md, int B, int T, const Dist* ranks) {
    int64_t N = llama_rank_tokens(B, T, ranks);
    if (md.recompute == RECOMPUTE_AUTO) md.recompute = RECOMPUTE_ALL;  // auto's smallest: every block
    if (md.mlp_tile == MLP_TILE_AUTO && N <= INT_MAX) md.mlp_tile = llama_mlp_candidate(N, llama_mlp_most_tiles(N));
    if (md.offload_host && md.offload_staging == OFFLOAD_STAGING_AUTO) md.offload_staging = 1;
    md.head_chunk_small = 1;
    return md;
}

// --recompute auto fitted to `budget` bytes: the fewest recomputed blocks k whose plan, with the
// other auto choices at their smallest (llama_smallest_choices), fits; every block where none does
// (the fit check then refuses). A direct scan from k = 0 up, not a bisection: the plan is not
// monotone in k (the first recomputed block adds the shared set its recomputed forward makes and,
// under standard norms, a copy of the residual stream), and each plan is cheap (nothing allocated).
static int llama_fit_recompute(const LlamaConfig* cfg, const TrainModes* md, int B, int T, const Backend* be,
                               const Dist* ranks, size_t budget) {
    for (int k = 0; k < cfg->layers; k++) {
        TrainModes at = llama_smallest_choices(train_modes_recompute(*md, k), B, T, ranks);
        if (llama_modes_plan_bytes(cfg, &at, B, T, be, ranks) <= budget) return k;
    }
    return cfg->layers;
}

// What auto leaves to the memory, fitted to `budget` bytes (0: none known; md unchanged, so two
// staging buffers, the plan's LM head chunk and auto's fixed tile rule), one choice after another,
// each the larger one where the plan with it and the others' smallest fits: first --offload host's
// staging buffers, two (the copies overlap the compute) else one; then the LM head's chunk, the
// plan's (few passes over the head) else the old one (llmc/memory/loss_buffers.h); then the largest
// MLP tile that fits beside them (llama_fit_mlp_tile). That order: the second buffer is one block
// input, [N, d], and the larger chunk a fixed ~1.5 GiB at 8B, where a tile's worth of MLP rows is less.
static TrainModes llama_fit_to_memory(const LlamaConfig* cfg, TrainModes md, int B, int T, const Backend* be,
                                      const Dist* ranks, size_t budget) {
    if (md.recompute == RECOMPUTE_AUTO)  // first the blocks recomputed (none where no memory is known)
        md = train_modes_recompute(md, budget ? llama_fit_recompute(cfg, &md, B, T, be, ranks, budget) : 0);
    if (!budget) return md;
    if (md.offload_host && md.offload_staging == OFFLOAD_STAGING_AUTO) {
        TrainModes two = llama_smallest_choices(md, B, T, ranks);
        two.offload_staging = 2;
        md.offload_staging = llama_modes_plan_bytes(cfg, &two, B, T, be, ranks) <= budget ? 2 : 1;
    }
    TrainModes big = llama_smallest_choices(md, B, T, ranks);
    big.head_chunk_small = 0;
    md.head_chunk_small = llama_modes_plan_bytes(cfg, &big, B, T, be, ranks) > budget;
    return llama_fit_mlp_tile(cfg, md, B, T, be, ranks, budget);
}

// What fit_check_plan plans with: the run's model, backend and ranks at sequence length T, and the
// memory --mlp-tile auto fits its tile to (0: none, auto's fixed rule).
typedef struct {
    const LlamaConfig* cfg;
    const Backend* be;
    const Dist* dist;
    int T;
    size_t fit_budget;  // the memory auto's choices fit (llama_fit_to_memory; 0: none)
} LlamaPlanCtx;

// Under auto with a budget this is the plan of auto's smallest choices (llama_smallest_choices):
// auto finds its tile and staging buffers exactly when that plan fits, so comparing these bytes
// with the budget is auto's verdict (one plan, where the fitted tile takes a bisection; the
// searches over --batch and --seq call this many times).
static size_t llama_plan_bytes(const void* ctx, const TrainOptions* o, int batch, int world) {
    const LlamaPlanCtx* c = (const LlamaPlanCtx*)ctx;
    TrainModes md = train_modes_from(o, target_names, N_TARGETS);
    Dist ranks = dist_for_plan(c->dist, world);
    if (c->fit_budget) md = llama_smallest_choices(md, batch, c->T, &ranks);
    return llama_modes_plan_bytes(c->cfg, &md, batch, c->T, c->be, &ranks);
}

// --dry-run --max-seq's planner: the run's plan at `step` x j tokens (step: --seq-parallel's P, whose
// ranks each hold 1/P of the sequence, so --seq is a multiple of P), as fit_check_plan counts it.
typedef struct {
    LlamaPlanCtx pc;
    int world, step;
} LlamaSeqPlanCtx;

static size_t llama_plan_bytes_at_steps(const void* ctx, const TrainOptions* o, int j) {
    const LlamaSeqPlanCtx* c = (const LlamaSeqPlanCtx*)ctx;
    LlamaPlanCtx at = c->pc;
    at.T = j * c->step;
    return llama_plan_bytes(&at, o, o->batch, c->world);
}

// The memory a --dry-run with --max-seq or --gpu-mem plans for; its verdict, and with --max-seq
// the longest --seq that fits, go beside the plan (JSON fields in `json`, a line in `line`).
// Returns the --seq to plan: the longest that fits, or o->seq; *md gets --mlp-tile auto's tile
// fitted to that memory at that length (unchanged without --max-seq or --gpu-mem: nothing to fit).
static int llama_dry_run_fit(const LlamaConfig* cfg, const TrainOptions* o, const Backend* be, const Dist* ranks,
                             TrainModes* md, char* json, size_t njson, char* line, size_t nline) {
    if (!o->max_seq && !(o->gpu_mem > 0) && !(o->mem_limit > 0)) {
        *md = llama_fit_to_memory(cfg, *md, o->batch, o->seq, be, ranks, 0);  // (--recompute auto: none)
        return o->seq;
    }
    FitBudget budget = fit_budget(o, be->cuda, o->max_seq ? "--max-seq" : o->gpu_mem > 0 ? "--gpu-mem" : "--mem-limit");
    int P = dist_sp(ranks);
    LlamaSeqPlanCtx ctx = {{cfg, be, ranks, o->seq, budget.bytes}, ranks->world, P};
    int seq = o->seq, most = 0;
    char a[32], b[32];
    if (o->max_seq) {
        most = 1 << 30;  // train_validate's bound on --seq (a sliding window's layers plan its memory instead)
        most = most / P * P;  // --seq-parallel P: a multiple of P (seqpar_check)
        seq = P * fit_longest_seq(llama_plan_bytes_at_steps, &ctx, o, most / P, budget.bytes);
        if (!seq)
            fail("flag --max-seq: not even --seq %d fits %s (%s): its plan needs %s; try --mode lowmem, --recompute "
                 "block, --offload host or --quant nf4%s", P, fit_size(a, sizeof(a), budget.bytes), budget.source,
                 fit_size(b, sizeof(b), llama_plan_bytes_at_steps(&ctx, o, 1)),
                 P > 1 ? " (or a larger --seq-parallel)" : "");
    }
    *md = llama_fit_to_memory(cfg, *md, o->batch, seq, be, ranks, budget.bytes);
    Llama at;
    llama_setup(&at, cfg, md, o->batch, seq, be, ranks);
    size_t need = plan_total(&at.plan) + (be->cuda ? 0 : plan_host_bytes(&at.plan)), pinned = plan_host_bytes(&at.plan);
    llama_free(&at);
    str_appendf(json, njson, ", \"memory_bytes\": %zu, \"memory_source\": \"%s\", \"fits\": %s", budget.bytes,
                budget.source, need <= budget.bytes ? "true" : "false");
    // max_seq_bound: the search stopped at its bound (--seq's limit), not at the memory
    int bound = o->max_seq && seq == most;
    if (o->max_seq) str_appendf(json, njson, ", \"max_seq\": %d, \"max_seq_bound\": %d", seq, bound);
    const char* what = be->cuda ? "device" : "host";
    char host[96] = "";  // the pinned host memory the length needs (--offload host; on the CPU, part of `need`)
    if (be->cuda && o->max_seq && pinned)
        snprintf(host, sizeof(host), ", %s of pinned host memory%s", fit_size(b, sizeof(b), pinned),
                 ranks->world > 1 ? " per rank" : "");
    char group[64] = "";  // --seq-parallel P: each rank holds seq / P of each sequence
    if (P > 1) snprintf(group, sizeof(group), " (%d on each of its %d ranks)", seq / P, P);
    if (o->max_seq)
        snprintf(line, nline, "longest --seq that fits %s (%s) at batch %d: %d tokens%s (%s of %s memory%s%s%s)",
                 fit_size(a, sizeof(a), budget.bytes), budget.source, o->batch, seq, group,
                 fit_size(b, sizeof(b), need), what, ranks->world > 1 ? " per rank" : "", host,
                 bound ? "; the search's bound: --seq's limit" : "");
    else
        snprintf(line, nline, "%s %s (%s): the plan needs %s of %s memory",
                 need <= budget.bytes ? "fits" : "does not fit", fit_size(a, sizeof(a), budget.bytes), budget.source,
                 fit_size(b, sizeof(b), need), what);
    return seq;
}

// The dry run's line on the MLP's tile: its tokens, how many tiles, and where auto's came from.
static void llama_tile_line(char* buf, size_t n, const Llama* m, const TrainOptions* o, const TrainModes* given,
                            const TrainModes* fitted) {
    int64_t N = (int64_t)m->B * m->T, tiles = (N + m->mlp_tile - 1) / m->mlp_tile;
    str_appendf(buf, n, "\nMLP tile: %lld of %lld tokens (%lld tile%s; ", (long long)m->mlp_tile, (long long)N,
                (long long)tiles, tiles == 1 ? "" : "s");
    if (given->mlp_tile != MLP_TILE_AUTO) str_appendf(buf, n, "--mlp-tile %s)", o->mlp_tile);
    else if (fitted->mlp_tile != MLP_TILE_AUTO) str_appendf(buf, n, "auto: the largest that fits)");
    else if (o->max_seq || o->gpu_mem > 0)
        str_appendf(buf, n, "auto: none fits, so equal tiles of at most %d)", MLP_TILE_AUTO_MAX);
    else
        str_appendf(buf, n, "auto without a memory to fit: equal tiles of at most %d; --gpu-mem GIB fits it)",
                    MLP_TILE_AUTO_MAX);
    if (m->saved.ckpt.host)  // two unless the memory holds one only (llama_fit_to_memory)
        str_appendf(buf, n, "\noffload: %d device staging buffer%s of one block input%s", m->saved.ckpt.offload.slots,
                    m->saved.ckpt.offload.slots == 1 ? "" : "s",
                    m->saved.ckpt.offload.slots == 1 ? " (the copies do not overlap the compute)" : "");
}

// --dry-run --json: the run's settings as the fields of a JSON object, into buf (plan_json writes them).
static void llama_settings_json(char* buf, size_t n, const TrainOptions* o, const char* device) {
    snprintf(buf, n, "\"model\": \"llama\", \"device\": \"%s\", \"mode\": \"%s\", \"act\": \"%s\", \"norm\": \"%s\", "
             "\"recompute\": \"%s\", \"batch\": %d, \"seq\": %d, \"lora_rank\": %d, \"lora_dropout\": %g, "
             "\"quant\": \"%s\", \"offload\": \"%s\"",
             device, o->mode, o->act, o->norm, o->recompute, o->batch, o->seq, o->lora_rank, o->lora_dropout, o->quant,
             o->offload);
}

// --dry-run: the plan of the run these flags describe, and the baseline plan beside it.
// Under mpirun, or for --ranks N, the plan is per rank (ZeRO-1 divides full fine-tuning's
// optimizer state, and on CUDA its fp32 master). With --max-seq, at the longest --seq that fits.
// Returns the --seq it planned.
static int llama_dry_run(const LlamaConfig* cfg, const TrainOptions* o_given, TrainModes md, const Dist* dist) {
    TrainOptions opts = *o_given;
    TrainOptions* o = &opts;
    int cpu = strcmp(o->device, "cpu") == 0;  // a dry run plans the CUDA layout unless told otherwise
    Backend be = backend_for_plan(!cpu);
    Dist ranks = dist_for_plan(dist, o->ranks ? o->ranks : dist->world);
    ranks.sp = o->seq_parallel;  // one rank's share of each sequence
    if (ranks.world % dist_sp(&ranks))
        fail("flag --seq-parallel: %d does not divide the %d ranks planned (--ranks)", o->seq_parallel, ranks.world);
    char fit_json[256] = "", fit_line[320] = "";
    TrainModes given = md;
    o->seq = llama_dry_run_fit(cfg, o, &be, &ranks, &md, fit_json, sizeof(fit_json), fit_line, sizeof(fit_line));
    Llama m, base;
    llama_setup(&m, cfg, &md, o->batch, o->seq, &be, &ranks);
    TrainModes bm = train_baseline_modes(md);
    Dist base_ranks = dist_for_plan(NULL, 1);  // the baseline: no ZeRO-1, but the same share of each sequence
    base_ranks.sp = ranks.sp;
    llama_setup(&base, cfg, &bm, o->batch, o->seq, &be, &base_ranks);
    char json[1024], header[1024];
    llama_settings_json(json, sizeof(json), o, cpu ? "cpu" : "cuda");
    str_appendf(json, sizeof(json), "%s", fit_json);
    snprintf(header, sizeof(header), "train_llama dry run: d=%d f=%d layers=%d heads=%d kv_heads=%d vocab=%d, "
             "batch %d x seq %d, %s", cfg->dim, cfg->hidden, cfg->layers, cfg->heads, cfg->kv_heads, cfg->vocab,
             o->batch, o->seq, o->full ? "full fine-tuning" : "LoRA");
    if (!o->full) str_appendf(header, sizeof(header), " r=%d", o->lora_rank);
    if (md.nf4) str_appendf(header, sizeof(header), ", frozen linears NF4");
    if (md.full && md.full_reference) {  // --full DPO's frozen copy of the initial weights (llama_plan_weights)
        size_t ref = (size_t)m.w.tr.padded * be.wbytes;
        str_appendf(header, sizeof(header), "\ndpo_reference: %.2f MiB of frozen weights (the initial weights, "
                    "DPO's reference model)", ref / 1048576.0);
        str_appendf(json, sizeof(json), ", \"dpo_reference_bytes\": %zu", ref);
    }
    if (ranks.world > 1) str_appendf(header, sizeof(header), ", one of %d ranks", ranks.world);
    if (dist_sp(&ranks) > 1) str_appendf(header, sizeof(header), " (%d per sequence)", dist_sp(&ranks));
    if (*fit_line) str_appendf(header, sizeof(header), "\n%s", fit_line);
    if (given.recompute != 0 && given.recompute != RECOMPUTE_ALL) {  // auto or N: how many, and why
        char rec[160];
        int known = o->max_seq || o->gpu_mem > 0 || o->mem_limit > 0;  // (the budget llama_dry_run_fit fitted to)
        fit_recompute_line(rec, sizeof(rec), o, m.saved.ckpt.recomputed, cfg->layers,
                           known ? fit_budget(o, !cpu, "--dry-run").bytes : 0);
        str_appendf(header, sizeof(header), "\n%s", rec);
    }
    llama_tile_line(header, sizeof(header), &m, o, &given, &md);
    if (cfg->gemma)  // which of Gemma's norms the memory-sharing backward takes, and which stay standard
        str_appendf(header, sizeof(header), "\nnorms: attn_norm, mlp_norm%s: MS under --norm ms (they feed linears); "
                    "post_norm_std (attention's and MLP's output) and the final norm (tied head): standard in every "
                    "mode", cfg->qk_norm ? ", q/k norms" : "");
    str_appendf(json, sizeof(json), ", \"mlp_tile\": %lld, \"offload_staging\": %d, \"recomputed_blocks\": %d",
                (long long)m.mlp_tile, m.saved.ckpt.host ? m.saved.ckpt.offload.slots : 0, m.saved.ckpt.recomputed);
    train_dry_run_report(o, &m.plan, &base.plan, &be, json, header);
    llama_free(&m);
    llama_free(&base);
    return o->seq;
}
