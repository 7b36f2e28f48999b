// llama.h: the LLaMA-family model (LLaMA, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3 text), read
// top to bottom: its config (LlamaConfig, llmc/models/llama_family.h), its parameters with their shapes,
// the buffers a block keeps for its backward, then the forward (block_forward: attention and the
// MLP), the backward (block_backward), the LM head and one micro-batch's forward + backward
// (llama_forward_backward). Trained with the memory-saving backward pass of "Reducing Fine-Tuning
// Memory Overhead by Approximate and Memory-Sharing Backpropagation": ReSiLU2 (exact SiLU forward,
// 2-bit backward; Gemma's GeGLU: ReGELU2 on the tanh GELU) and MS-RMSNorm (gamma merged into the
// next linears; backward from the normalised output and one scalar per row).
//
// The model is written once; the operations it calls (llmc/ops.h) run on the backend chosen by
// --device: the CPU (fp32) or a CUDA GPU (bf16 activations and frozen weights, fp32 statistics,
// LoRA masters, gradients and AdamW state). Beside this file: llama_plan.h (every buffer in the
// memory plan, bound after allocation; the fit to the memory and the dry run), llama_batch.h (the
// batch's way to the device), llama_io.h (weights in, LoRA init, adapters, merged export),
// llama_step.h (the training step and evaluation) and llama_generate.h (sampling).
#pragma once
#include "../common.h"
#include "../rng.h"
#include "../memory/plan.h"
#include "../memory/checkpoints.h"
#include "../linear.h"
#include "../backend.h"
#include "../ops.h"
#include "../attn_docs.h"
#include "../nf4.h"
#include "../train/run_options.h"
#include "../train/dist.h"
#include "../train/trainable.h"
#include "../train/batch_values.h"
#include "../train/seq_parallel.h"
#include "../train/run.h"
#include "llama_family.h"

// ----------------------------------------------------------------------------------------------
// Parameters. Frozen weights live in one arena, LoRA weights (and their grads and AdamW moments)
// in flat arenas of identical layout, so the optimizer and gradient norm see one array. The
// linear layer with its adapter (Linear) is shared with train_vit: llmc/linear.h.

enum { T_Q, T_K, T_V, T_O, T_GATE, T_UP, T_DOWN, N_TARGETS };
static const char* const target_names[N_TARGETS] = {"q", "k", "v", "o", "gate", "up", "down"};
static_assert(sizeof(llama_hf_modules) / sizeof(llama_hf_modules[0]) == N_TARGETS, "one module name per target");

// Phi-3's fused modules (qkv_proj = q, k, v; gate_up_proj = gate, up) are kept as their parts: three
// (two) Linears whose W are the module's row blocks, so the forward and backward above read q, k, v,
// gate and up in their own buffers exactly as for the other families. Their LoRA adapter is PEFT's
// one adapter over the fused output, y = x W^T + s (x A^T) B^T with A [r, in] and B [rows, r]: the
// parts share one A (and one A gradient, to which each part's backward adds its share, which sums
// dA over the parts as the fused product would) and each takes its rows of B, which lie one after
// the other in the arena (llama_bind), so the fused B is one contiguous [rows, r] block for saving,
// loading and the merged export. The alternative, one fused Linear whose output is split, would
// have needed a strided q, k, v (or a copy) in every pass.

// Weights and activations are backend buffers (`void*`: fp32 on the CPU, bf16 on CUDA); norm
// statistics and the attention lse are fp32 on both.
typedef struct {
    void* attn_norm;       // gamma [d] (merged into q,k,v under MS-RMSNorm; their adapters still apply it)
    void* mlp_norm;        // gamma [d] (merged into gate, up under MS-RMSNorm; likewise)
    Linear lin[N_TARGETS]; // with a bias where the config says (Qwen2: q, k, v; attention_bias, mlp_bias)
    void *q_norm, *k_norm; // Qwen3: gamma [hd] of the RMSNorm over each head of q and k (NULL otherwise)
    // --full with standard norms trains the gammas too: gradients and host mirrors, else NULL
    float *dattn_norm, *dmlp_norm, *h_attn_norm, *h_mlp_norm;
    float *dq_norm, *dk_norm, *h_q_norm, *h_k_norm;  // --full: Qwen3's q/k norms train (under MS norms too)
    // Gemma's sandwich norms: gamma [d] of the norms on the attention's and the MLP's output (NULL
    // otherwise). Standard in every mode: their output feeds the residual stream, no linear to merge
    // into. --full trains them (gradients and host mirrors, else NULL).
    void *post_attn_norm, *post_mlp_norm;
    float *dpost_attn_norm, *dpost_mlp_norm, *h_post_attn_norm, *h_post_mlp_norm;
} LlamaLayer;

// The parameters: the weights, their gradients under --full, the trainable arena, and the fixed
// tables the forward reads (RoPE; NF4's under --quant nf4).
typedef struct {
    void* embed;           // [V, d]
    void* final_norm;      // [d] (kept standard: the head is tied to the embedding)
    void* lm_head;         // [V, d] (== embed when tied)
    // --full trains these too: their gradients and host mirrors (NULL when frozen)
    float *dembed, *dlm_head, *dfinal_norm, *h_embed, *h_lm_head, *h_final_norm;
    LlamaLayer* layers;    // [layers]
    float* gamma_host;     // [layers][2][d] the norms' gammas on the host (MS merge, adapters)
    float *rope_cos, *rope_sin;  // [T, hd/2]
    float *rope_local_cos, *rope_local_sin;  // Gemma 3: [T, hd/2] the sliding layers' own base (NULL otherwise)
    void* embed_scale;     // Gemma: [d] each sqrt(hidden) in the embedding's dtype, the embeddings' scale (else NULL)
    Trainable tr;          // LoRA A/B, or (--full) every weight: one flat array (ZeRO-1 across ranks)
    int64_t* layer_off;    // [layers] where each block's trainable values start in the arena
    void* ref_arena;       // --full DPO: the arena's kernel-read values at step 0 (llmc/models/llama_pref.h)
    // --quant nf4: the tables (NF4 values, dynamic map; backend and host copies) and the scratch
    // every linear's W is dequantized into before its products (llmc/nf4.h), else NULL
    float* nf4_tables;
    float h_nf4_tables[NF4_TABLE_FLOATS];
    void* nf4_scratch;
} LlamaWeights;

// The buffers one block keeps for its backward (or, where not kept, a shared scratch copy).
typedef struct {
    void* x_in;            // block input          (standard attention RMSNorm)
    float* r1;             // 1/rms per token      (attention norm)
    void* z1;              // attention norm output = q,k,v input
    void *q, *k, *v, *o;   // attention (q, k after RoPE); o = o-proj input
    // Qwen3's q/k norms (llama_qk_norm_ms): their inputs, the q, k projections (standard: kept
    // for the norm's backward), or their normalised outputs before gamma and RoPE (MS: kept, and
    // q, k rebuilt from them in backward, so only these are kept), and 1/rms per head row.
    void *q_pre, *k_pre, *qz, *kz;
    float *rq, *rk;        // [N*H], [N*KVH]
    float* lse;            // [B, H, T] log-sum-exp
    void* ax[N_TARGETS];   // LoRA A x per adapter
    void* h_mid;           // residual after attention (standard MLP RMSNorm)
    float* r2;
    void* z2;              // MLP norm output = gate, up input
    void* g;               // gate pre-activation (exact SiLU / GELU backward)
    uint8_t* codes;        // 2-bit ReSiLU2 codes of g (Gemma's GeGLU: ReGELU2's)
    void *sg, *u;          // silu(g) and up: the product's operands
    void* p;               // silu(g) * u = down input (Gemma: gelu_tanh(g) * u, sg the GELU)
    // Gemma's sandwich norms: the attention's and the MLP's output before its post norm [N, d] and
    // 1/rms per token (standard norms, kept for their backward), and post, the shared [N, d] rows the
    // normalised output passes through onto the residual stream (the branch's gradient in backward)
    void *ya, *ym, *post;
    float *ra, *rm;
} BlockActs;

// The saved activations: what each block keeps for its backward.
typedef struct {
    BlockActs* block;      // [layers]
    Checkpoints ckpt;      // each recomputed block's input [N, d] (--offload host: on the host)
} LlamaSaved;

// Scratch: the residual stream, the activation gradients (with the activations' element type),
// the ops' and the adapters' work buffers, the loss chunk, and generation's cache.
typedef struct {
    BlockActs tmp;         // scratch set (recompute, or buffers not kept)
    void *resid, *resid_tmp, *dres, *dz, *dq, *dk, *dv, *dout, *dp, *dg, *du, *dax;
    void* att_work;        // CUDA attention: the tensor-core path's chunk of scores (llmc/memory/cuda_workspace.h)
    size_t att_work_bytes;
    void **kv_k, **kv_v;   // --generate: [layers] the key/value cache, [T, KVH*hd] each
    float* gen_logits;     // --generate: [V] the last position's logits
    void* blas_work;       // CUDA: cuBLAS's and cuBLASLt's workspace (llmc/memory/cuda_workspace.h)
    void* lora_norm_work;  // MS norms, --ms-lora exact: the adapters' scratch (llmc/linear.h), else NULL
    void* drop_work;       // --lora-dropout: the adapters' input scratch (llmc/lora_dropout.h)
    LossBuffers loss;
    int loss_chunk;
} LlamaScratch;

// Batch I/O: the micro-batch on the backend and on the host (the loader's side), and its way up.
typedef struct {
    int *inputs, *targets; // [N] on the backend
    int *embed_order, *h_embed_order;  // --full: the batch's positions sorted by token (embedding_token_order)
    int* pos;              // [N] position of each token within its (packed) example
    int pos_restarts;      // the uploaded batch packs examples (a position is not its column): attention masks by pos
    void *docs_buf, *h_docs_buf;  // CUDA, cuDNN's ragged attention: the packed batch's documents (llmc/attn_docs.h)
    AttnDocs docs;         // and what attention reads of them (device arrays in docs_buf), else unused
    char docs_why[160];    // why a batch's positions are not mapped (docs.why)
    float* mask;           // [N]
    int *h_inputs, *h_targets, *h_pos;  // the batch as the loader writes it (host; == the above on the CPU)
    float* h_mask;
    BatchValues bv;        // CUDA: the loss scale and dropout key the kernels read from device memory
    BatchStaging staging;  // CUDA: the batch's way up, double buffered (llmc/backend.h)
    int micro_batches;     // per optimizer step (--grad-accum; 0: one), which sizes the staging
} LlamaBatch;

typedef struct {
    LlamaConfig cfg;
    TrainModes modes;
    const Backend* be;
    const Dist* dist;
    int B, T;              // planned micro-batch shape (T: this rank's tokens of each under --seq-parallel)
    int64_t mlp_tile;      // tokens per MLP tile (llama_mlp_tile_rows): rows of the wide intermediates not kept
    SeqPar sp;             // --seq-parallel: the group sharing each sequence (sp.T the whole sequence), else P = 1
    LoraDropout drop;      // --lora-dropout: the masks' key (llmc/lora_dropout.h)
    LlamaWeights w;
    LlamaSaved saved;
    LlamaScratch scratch;
    LlamaBatch io;
    MemPlan plan;
    RunGraph graph;        // LLMC_CUDA_GRAPH=1: each micro-batch's forward + backward replayed as one CUDA graph
} Llama;

static int64_t lin_in(const LlamaConfig* c, int t) {
    return t == T_O ? (int64_t)c->heads * c->head_dim : t == T_DOWN ? c->hidden : c->dim;
}
static int64_t lin_out(const LlamaConfig* c, int t) {
    switch (t) {
        case T_Q: return (int64_t)c->heads * c->head_dim;
        case T_K: case T_V: return (int64_t)c->kv_heads * c->head_dim;
        case T_GATE: case T_UP: return c->hidden;
        default: return c->dim;
    }
}

// The first row of linear t within its checkpoint module, and the module's rows (t's own unless fused).
static int64_t llama_module_row0(const LlamaConfig* c, int t) {
    int64_t r = 0;
    for (int k = llama_fused_lead(c, t); k < t; k++) r += lin_out(c, k);
    return r;
}
static int64_t llama_module_rows(const LlamaConfig* c, int t) {
    int lead = llama_fused_lead(c, t);
    int64_t r = 0;
    for (int k = lead; k < N_TARGETS && llama_fused_lead(c, k) == lead; k++) r += lin_out(c, k);
    return r;
}

// A fused module carries one adapter: --lora-targets names all of its parts or none of them.
static void llama_check_fused_targets(const LlamaConfig* c, unsigned targets) {
    for (int t = 0; t < N_TARGETS; t++) {
        int lead = llama_fused_lead(c, t);
        if ((targets >> t & 1) != (targets >> lead & 1))
            fail("flag --lora-targets: %s fuses %s and %s into %s (one adapter): name all of its parts or none",
                 c->family, target_names[lead], target_names[t], llama_hf_module(c, t));
    }
}

// Under MS-RMSNorm (and LoRA), W' = W diag(gamma) absorbed the gamma of the norm that feeds q, k,
// v (gate, up), but the adapters keep acting on gamma*z as in the original model (llmc/linear.h),
// so they train exactly what --norm std trains; --ms-lora merged puts them on z (the paper's).
static int llama_adapters_see_gamma(const Llama* m) {
    return m->modes.ms && !m->modes.full && !m->modes.ms_lora_merged;
}

// Qwen3's q/k norms feed RoPE, not a linear, so no merge applies to them. Under MS norms with a
// frozen gamma (LoRA) the block keeps their normalised output z and 1/rms alone: the norm's
// backward needs only those (dx = r (g dy - z mean(g dy z))), and q, k after RoPE, which attention's
// backward reads, are rebuilt from z (RoPE(g z), elementwise) instead of being kept beside it.
// Otherwise (standard norms, or --full, which trains gamma) the block keeps the norm's input.
static int llama_qk_norm_ms(const Llama* m) { return m->cfg.qk_norm && m->modes.ms && !m->modes.full; }

// Where the exchanges of o and the gradients receive in each pass: a buffer dead meanwhile
// (llama_seqpar_lends, decided once by the plan: sp.lent), or the group's own.
typedef enum { EXCHANGE_FORWARD, EXCHANGE_RECOMPUTED_FORWARD, EXCHANGE_BACKWARD } ExchangePass;
static void* llama_seqpar_work(const Llama* m, ExchangePass pass) {
    if (!m->sp.lent) return m->sp.work;
    return pass == EXCHANGE_FORWARD ? m->scratch.dres : m->scratch.resid;
}

// Attention's document mask: the batch's positions when it packs examples, else NULL (the same
// mask, and the only one cuDNN's attention takes: llmc/ops.h).
static const int* llama_attention_pos(const Llama* m) { return m->io.pos_restarts ? m->io.pos : NULL; }
// and its documents for cuDNN's ragged attention, where they are described (llama_describe_documents)
static const AttnDocs* llama_attention_docs(const Llama* m) {
    return m->io.pos_restarts && m->io.docs_buf ? &m->io.docs : NULL;
}

// The window every layer's CUDA GEMM attention tiles follow (AttnShape.tile_window): the model's
// sliding window where some layer slides, so that its full layers keep the sliding layers' layout
// and the path's pointer tables (and a CUDA graph's key) stay put from layer to layer; 0 otherwise.
static int llama_tile_window(const LlamaConfig* c) {
    for (int l = 0; l < c->layers; l++)
        if (llama_layer_window(c, l)) return c->sliding_window;
    return 0;
}

// Attention's shape for layer l over B rows of T: causal, the batch's document mask, and the
// layer's sliding window (llama_layer_window: 0 on full layers), the scores' scale and soft-cap.
static AttnShape llama_attn_shape(const Llama* m, int l, int B, int T) {
    const LlamaConfig* c = &m->cfg;
    AttnShape as = {B, T, c->heads, c->kv_heads, c->head_dim, 1, llama_attention_pos(m), llama_attention_docs(m),
                    llama_layer_window(c, l), c->attn_scale, c->attn_softcap, llama_tile_window(c)};
    return as;
}

// ----------------------------------------------------------------------------------------------
// Forward

// Generation's key/value cache: per layer, the keys (after RoPE) and values of every position fed
// so far, [cap, KVH*hd] in the backend's activation type.
typedef struct {
    void **k, **v;
    int len, cap;
} KVCache;

// The RoPE tables [T, hd/2] of a block: Gemma 3's local (sliding) layers have their own base.
typedef struct {
    const float *cos, *sin;
} RopeTables;
static RopeTables llama_rope_of(const Llama* m, const LlamaLayer* layer) {
    RopeTables r = {m->w.rope_cos, m->w.rope_sin};
    if (m->w.rope_local_cos && m->cfg.layer_sliding[layer - m->w.layers]) {
        r.cos = m->w.rope_local_cos;
        r.sin = m->w.rope_local_sin;
    }
    return r;
}

// q (t = T_Q) or k (T_K) of a block into a->q / a->k: the projection of z1, Qwen3's RMSNorm over
// each head, then RoPE. Under MS norms the norm's output z is what the block keeps and the rotated
// q, k are built from it (llama_qk_norm_ms), here and again, identically, in backward.
static void llama_qk_forward(Llama* m, const LlamaLayer* layer, BlockActs* a, int t, int64_t N, int T) {
    const Backend* be = m->be;
    const LlamaConfig* c = &m->cfg;
    int is_q = t == T_Q, heads = is_q ? c->heads : c->kv_heads;
    void* y = is_q ? a->q : a->k;
    if (!c->qk_norm) {
        op_linear_forward(be, y, a->z1, &layer->lin[t], a->ax[t], N, m->modes.rank, m->modes.lora_scale, OUT_WRITE);
    } else {
        void* pre = is_q ? a->q_pre : a->k_pre;
        const void* gamma = is_q ? layer->q_norm : layer->k_norm;
        float* r = is_q ? a->rq : a->rk;
        op_linear_forward(be, pre, a->z1, &layer->lin[t], a->ax[t], N, m->modes.rank, m->modes.lora_scale, OUT_WRITE);
        if (llama_qk_norm_ms(m)) {
            void* z = is_q ? a->qz : a->kz;
            op_rmsnorm_forward(be, z, r, pre, NULL, N * heads, c->head_dim, c->norm_eps);
            op_scale_columns(be, y, z, gamma, N * heads, c->head_dim);
        } else {
            op_rmsnorm_forward(be, y, r, pre, gamma, N * heads, c->head_dim, c->norm_eps);
        }
    }
    RopeTables rt = llama_rope_of(m, layer);
    op_rope(be, y, rt.cos, rt.sin, m->io.pos, N, T, heads, c->head_dim, c->rot_dim, ROPE_FORWARD);
}

// The MLP buffers' rows from token t0 on: a kept buffer's (whole sequence) from row t0, one of the
// shared set's (one tile, llama_plan_block) from its start.
static void* llama_tile_rows(void* buf, const void* shared, int64_t offset_bytes) {
    return !buf || buf == shared ? buf : (char*)buf + offset_bytes;
}

// a's MLP buffers (norm, gate/up/down with their LoRA A x, SwiGLU) for the tile of tokens from t0;
// the attention's as in a.
static BlockActs llama_mlp_tile_acts(const Llama* m, const BlockActs* a, int64_t t0) {
    const BlockActs* s = &m->scratch.tmp;
    int64_t d = m->cfg.dim, f = m->cfg.hidden, ab = m->be->abytes, r = m->modes.rank;
    BlockActs t = *a;
    t.h_mid = llama_tile_rows(a->h_mid, s->h_mid, t0 * d * ab);
    t.r2 = (float*)llama_tile_rows(a->r2, s->r2, t0 * 4);
    t.z2 = llama_tile_rows(a->z2, s->z2, t0 * d * ab);
    t.g = llama_tile_rows(a->g, s->g, t0 * f * ab);
    t.codes = (uint8_t*)llama_tile_rows(a->codes, s->codes, t0 * f / 4);  // whole bytes: llama_mlp_tile_rows
    t.sg = llama_tile_rows(a->sg, s->sg, t0 * f * ab);
    t.u = llama_tile_rows(a->u, s->u, t0 * f * ab);
    t.p = llama_tile_rows(a->p, s->p, t0 * f * ab);
    t.ym = llama_tile_rows(a->ym, s->ym, t0 * d * ab);
    t.rm = (float*)llama_tile_rows(a->rm, s->rm, t0 * 4);
    t.post = a->post ? (char*)a->post + t0 * d * ab : NULL;  // whole-sequence rows in every view
    for (int k = T_GATE; k <= T_DOWN; k++) t.ax[k] = llama_tile_rows(a->ax[k], s->ax[k], t0 * r * ab);
    return t;
}

// A branch's last linear (o or down) onto the residual stream x [n, d]: added straight on, or under
// Gemma's sandwich norms written to y, normalised by the post norm (gamma applied) into post and
// added from there; y and r (1/rms) stay for the backward.
static void llama_branch_forward(Llama* m, void* x, const void* in, const Linear* lin, void* ax, void* y, float* r,
                                 const void* post_norm, void* post, int64_t n) {
    const Backend* be = m->be;
    int d = m->cfg.dim;
    if (!post_norm) {
        op_linear_forward(be, x, in, lin, ax, n, m->modes.rank, m->modes.lora_scale, OUT_ADD);
        return;
    }
    op_linear_forward(be, y, in, lin, ax, n, m->modes.rank, m->modes.lora_scale, OUT_WRITE);
    op_rmsnorm_forward(be, post, r, y, post_norm, n, d, m->cfg.norm_eps);
    op_add(be, x, post, n * d);
}

// The gradient w.r.t. a branch's linear output from dy (w.r.t. the residual stream after it): dy
// itself, or through Gemma's post norm into post (with its gamma's gradient under --full).
static const void* llama_branch_backward(Llama* m, const void* dy, const void* y, const float* r,
                                         const void* post_norm, float* dgamma, void* post, int64_t n) {
    const Backend* be = m->be;
    int d = m->cfg.dim;
    if (!post_norm) return dy;
    op_zero(be, post, (size_t)n * d * be->abytes);
    if (dgamma) op_rmsnorm_gamma_grad(be, dgamma, dy, y, r, n, d);
    op_rmsnorm_backward(be, post, dy, y, r, post_norm, n, d);
    return post;
}

// Gemma's GELU is the tanh form (hidden_activation gelu_pytorch_tanh); ReGELU2 codes under lowmem.
#define LLAMA_GELU_TANH_FORM 1

// The MLP and its norm of block l, one op over the N tokens of the residual stream x [N, d] after
// attention (updated in place), tile by tile: m->mlp_tile tokens at a time, t the tile's view of
// a's buffers (llama_mlp_tile_acts). The backward (MLP_BACKWARD) turns each tile's rows of
// m->scratch.dres (the gradient w.r.t. the block output) into the gradient w.r.t. the MLP's input,
// in place, through their rows of m->scratch.dz; the wide gradients dp, dg, du hold one tile;
// weight and LoRA gradients accumulate. It first recomputes each tile's forward from x where x is
// given (--recompute block; NULL: the forward's buffers are kept). Every product and pass works row
// by row, so a token's results do not depend on the tile it is in, as long as the products' rows
// are independent of the row count (docs/memory.md: the CPU's are; cuBLAS is not promised to be).
// --lora-dropout's masks follow each token's row in the batch, whatever its tile (the tile's first
// row an offset of the shape, row_off, beside the micro-batch's row0).
typedef enum { MLP_FORWARD, MLP_BACKWARD } MlpPass;
static void llama_mlp(Llama* m, int l, MlpPass pass, void* x_rows, const BlockActs* a, int64_t N) {
    LlamaScratch* sc = &m->scratch;
    const Backend* be = m->be;
    const LlamaConfig* c = &m->cfg;
    const LlamaLayer* layer = &m->w.layers[l];
    const Linear *gate = &layer->lin[T_GATE], *up = &layer->lin[T_UP], *down = &layer->lin[T_DOWN];
    int r = m->modes.rank, d = c->dim;
    float s = m->modes.lora_scale;
    int64_t row_bytes = (int64_t)d * be->abytes;
    for (int64_t t0 = 0; t0 < N; t0 += m->mlp_tile) {
        int64_t n = N - t0 < m->mlp_tile ? N - t0 : m->mlp_tile, nf = n * c->hidden;
        BlockActs tile = llama_mlp_tile_acts(m, a, t0), *t = &tile;
        m->drop.row_off = t0;
        if (x_rows) {  // the forward, or the backward's recomputed forward
            void* x = (char*)x_rows + t0 * row_bytes;
            if (t->h_mid) op_copy(be, t->h_mid, x, n * c->dim);
            op_rmsnorm_forward(be, t->z2, t->r2, x, m->modes.ms ? NULL : layer->mlp_norm, n, c->dim, c->norm_eps);
            op_linear_forward(be, t->g, t->z2, gate, t->ax[T_GATE], n, r, s, OUT_WRITE);
            op_linear_forward(be, t->u, t->z2, up, t->ax[T_UP], n, r, s, OUT_WRITE);
            if (c->gemma) {  // GeGLU: the product of gelu_tanh(g) and u
                op_gelu_forward(be, t->sg, m->modes.approx ? t->codes : NULL, t->g, nf, LLAMA_GELU_TANH_FORM);
                op_mul(be, t->p, t->sg, t->u, nf);
            } else {
                op_swiglu_forward(be, t->p, t->sg, m->modes.approx ? t->codes : NULL, t->g, t->u, nf);
            }
            llama_branch_forward(m, x, t->p, down, t->ax[T_DOWN], t->ym, t->rm, layer->post_mlp_norm, t->post, n);
        }
        if (pass == MLP_FORWARD) continue;
        void *dy = (char*)sc->dres + t0 * row_bytes, *dz = (char*)sc->dz + t0 * row_bytes;
        if (m->modes.recompute_product && (down->A || down->dW))  // beyond the paper: rebuild the down input
            op_mul(be, t->p, t->sg, t->u, nf);
        const void* dyb =
            llama_branch_backward(m, dy, t->ym, t->rm, layer->post_mlp_norm, layer->dpost_mlp_norm, t->post, n);
        op_linear_backward(be, sc->dp, dyb, t->p, t->ax[T_DOWN], down, sc->dax, n, r, s, OUT_WRITE);
        if (c->gemma) {  // GeGLU: du = dp gelu(g), dg = dp u gelu'(g) (exact from g, or ReGELU2's level of its code)
            op_mul(be, sc->du, sc->dp, t->sg, nf);
            op_mul(be, sc->dg, sc->dp, t->u, nf);
            op_gelu_backward(be, sc->dg, sc->dg, m->modes.approx ? NULL : t->g, t->codes, nf, LLAMA_GELU_TANH_FORM);
        } else {
            op_swiglu_backward(be, sc->dg, sc->du, sc->dp, t->sg, t->u, m->modes.approx ? NULL : t->g, t->codes, nf);
        }
        op_linear_backward(be, dz, sc->dg, t->z2, t->ax[T_GATE], gate, sc->dax, n, r, s, OUT_WRITE);
        op_linear_backward(be, dz, sc->du, t->z2, t->ax[T_UP], up, sc->dax, n, r, s, OUT_ADD);
        if (layer->dmlp_norm) op_rmsnorm_gamma_grad(be, layer->dmlp_norm, dz, t->h_mid, t->r2, n, d);
        if (m->modes.ms) op_rmsnorm_ms_backward(be, dy, dz, t->z2, t->r2, n, d);
        else op_rmsnorm_backward(be, dy, dz, t->h_mid, t->r2, layer->mlp_norm, n, d);
    }
    m->drop.row_off = 0;
}

// What block_forward runs: the whole block, or (--recompute block) its attention half, whose
// MLP the backward recomputes tile by tile (llama_mlp).
typedef enum { BLOCK_WHOLE, BLOCK_ATTENTION } BlockPart;

// Attention of block l over a's q, k, v into a->o (and its lse), each query over the keys before
// it in its own document (a packed batch's positions, llama_attention_pos/docs): with
// generation's cache (B = 1: the T new tokens at positions kv->len.., their keys and values join
// the cache), across a --seq-parallel group (a->q, k, v, o keep the head layout; the exchanges'
// scratch as the pass allows, llama_seqpar_work), or over the batch. Returns the o projection's
// input: a->o, or under --seq-parallel this rank's tokens of it.
static const void* llama_attention_forward(Llama* m, int l, BlockActs* a, int B, int T, const KVCache* kv,
                                           BlockPart part) {
    const Backend* be = m->be;
    const LlamaConfig* c = &m->cfg;
    int64_t N = (int64_t)B * T;
    if (kv) {
        int64_t kvd = (int64_t)c->kv_heads * c->head_dim, at = (int64_t)kv->len * kvd * be->abytes;
        op_copy(be, (char*)kv->k[l] + at, a->k, N * kvd);
        op_copy(be, (char*)kv->v[l] + at, a->v, N * kvd);
        op_attention_cached(be, a->o, a->q, kv->k[l], kv->v[l], T, kv->len, llama_attn_shape(m, l, 1, T));
        return a->o;
    }
    AttnShape as = llama_attn_shape(m, l, B, T);
    if (m->sp.P > 1) as = seqpar_qkv_to_heads(&m->sp, a->q, a->k, a->v, &as);  // this rank's heads, every token
    op_attention_forward(be, a->o, a->lse, a->q, a->k, a->v, as,
                         op_attention_work_fitting(be, as, m->scratch.att_work, m->scratch.att_work_bytes));
    if (m->sp.P == 1) return a->o;
    // the attention half is only ever the recomputed forward (llama_recompute_block)
    ExchangePass exchange = part == BLOCK_ATTENTION ? EXCHANGE_RECOMPUTED_FORWARD : EXCHANGE_FORWARD;
    return seqpar_output_to_tokens(&m->sp, a->o, llama_seqpar_work(m, exchange));
}

// One block, updating the residual stream x [B*T, d] in place and filling a's buffers: the
// attention norm, q, k (Qwen3's norms, RoPE), v, attention, the o projection onto the residual
// stream, then the MLP (with its norm) onto it, tile by tile. kv: generation's cache, else NULL.
static void block_forward(Llama* m, int l, void* x, BlockActs* a, int B, int T, const KVCache* kv, BlockPart part) {
    const Backend* be = m->be;
    const LlamaConfig* c = &m->cfg;
    const LlamaLayer* layer = &m->w.layers[l];
    int64_t N = (int64_t)B * T, d = c->dim;
    int r = m->modes.rank;
    float s = m->modes.lora_scale;
    if (a->x_in) op_copy(be, a->x_in, x, N * d);
    op_rmsnorm_forward(be, a->z1, a->r1, x, m->modes.ms ? NULL : layer->attn_norm, N, (int)d, c->norm_eps);
    llama_qk_forward(m, layer, a, T_Q, N, T);
    llama_qk_forward(m, layer, a, T_K, N, T);
    op_linear_forward(be, a->v, a->z1, &layer->lin[T_V], a->ax[T_V], N, r, s, OUT_WRITE);
    const void* o_in = llama_attention_forward(m, l, a, B, T, kv, part);
    llama_branch_forward(m, x, o_in, &layer->lin[T_O], a->ax[T_O], a->ya, a->ra, layer->post_attn_norm, a->post, N);
    if (part == BLOCK_WHOLE) llama_mlp(m, l, MLP_FORWARD, x, a, N);
}

// Embedding and all blocks over the uploaded batch; leaves the final norm's input in m->scratch.resid.
// Each part first waits for its weights' all-gather when ZeRO-1 overlaps it with this forward
// (the embedding, head and final norm lie below the first block in the arena).
static void llama_forward_blocks(Llama* m, int B, int T, const KVCache* kv) {
    LlamaScratch* sc = &m->scratch;
    int64_t N = (int64_t)B * T;
    int layers = m->cfg.layers;
    trainable_weights_ready(&m->w.tr, 0, m->w.layer_off[0]);
    op_embed(m->be, sc->resid, m->w.embed, m->io.inputs, N, m->cfg.dim);
    if (m->w.embed_scale) op_scale_columns(m->be, sc->resid, sc->resid, m->w.embed_scale, N, m->cfg.dim);
    for (int l = 0; l < layers; l++) {
        trainable_weights_ready(&m->w.tr, m->w.layer_off[l], l + 1 < layers ? m->w.layer_off[l + 1] : m->w.tr.padded);
        if (train_block_recomputes(&m->modes, l))
            checkpoint_save(&m->saved.ckpt, m->be, l, sc->resid, N * m->cfg.dim);
        block_forward(m, l, sc->resid, &m->saved.block[l], B, T, kv, BLOCK_WHOLE);
    }
}

// ----------------------------------------------------------------------------------------------
// Backward

// Under MS norms, Qwen3's rotated q (t = T_Q) or k (T_K) for attention's backward: RoPE(gamma z) from
// the kept z, as the forward built them; under --seq-parallel exchanged, as the forward's were, to
// the head layout (z holds this rank's tokens: the norm and RoPE are per token and per head).
static void llama_qk_rebuild(Llama* m, const LlamaLayer* layer, BlockActs* a, int t, int64_t N, int T) {
    const LlamaConfig* c = &m->cfg;
    int is_q = t == T_Q, heads = is_q ? c->heads : c->kv_heads;
    void* y = is_q ? a->q : a->k;
    op_scale_columns(m->be, y, is_q ? a->qz : a->kz, is_q ? layer->q_norm : layer->k_norm, N * heads, c->head_dim);
    RopeTables rt = llama_rope_of(m, layer);
    op_rope(m->be, y, rt.cos, rt.sin, m->io.pos, N, T, heads, c->head_dim, c->rot_dim, ROPE_FORWARD);
    if (m->sp.P > 1) seqpar_rebuilt_to_heads(&m->sp, y, is_q ? SEQPAR_QUERY_HEADS : SEQPAR_KV_HEADS);
}

// The gradient w.r.t. the q (t = T_Q) or k (T_K) projection's output, from dy, the gradient w.r.t.
// the rotated q or k with RoPE already undone: dy itself without Qwen3's norm, else dy through
// the norm into m->scratch.dout (free once attention's backward has run; dy is clobbered under MS norms).
static const void* llama_qk_norm_backward(Llama* m, const LlamaLayer* layer, BlockActs* a, int t, void* dy, int64_t N) {
    LlamaScratch* sc = &m->scratch;
    const Backend* be = m->be;
    const LlamaConfig* c = &m->cfg;
    if (!c->qk_norm) return dy;
    int is_q = t == T_Q;
    int64_t rows = N * (is_q ? c->heads : c->kv_heads);
    const void* gamma = is_q ? layer->q_norm : layer->k_norm;
    const float* r = is_q ? a->rq : a->rk;
    op_zero(be, sc->dout, (size_t)rows * c->head_dim * be->abytes);
    if (llama_qk_norm_ms(m)) {  // dz = gamma dy, then the MS backward from z and r
        op_scale_columns(be, dy, dy, gamma, rows, c->head_dim);
        op_rmsnorm_ms_backward(be, sc->dout, dy, is_q ? a->qz : a->kz, r, rows, c->head_dim);
    } else {
        const void* pre = is_q ? a->q_pre : a->k_pre;
        float* dgamma = is_q ? layer->dq_norm : layer->dk_norm;
        if (dgamma) op_rmsnorm_gamma_grad(be, dgamma, dy, pre, r, rows, c->head_dim);
        op_rmsnorm_backward(be, sc->dout, dy, pre, r, gamma, rows, c->head_dim);
    }
    return sc->dout;
}

// The recomputed block (--recompute block) as its backward reads it: its input on the device,
// and the residual stream after its recomputed attention, the MLP's input [N, d].
typedef struct {
    const void* block_input;
    void* mlp_input;
} Recomputed;

// The o projection's input as attention's forward left it (token layout): a->o, or under
// --seq-parallel this rank's tokens of it, exchanged again into scratch free at the time.
static const void* llama_attention_output(Llama* m, const BlockActs* a) {
    if (m->sp.P == 1) return a->o;
    return seqpar_attention_output(&m->sp, a->o, llama_seqpar_work(m, EXCHANGE_BACKWARD));
}

// Attention's backward, from dout (the gradient w.r.t. its output) to dq, dk, dv, over the batch
// or across the --seq-parallel group, with the same document mask as its forward.
static void llama_attention_backward(Llama* m, int l, const BlockActs* a, int B, int T) {
    LlamaScratch* sc = &m->scratch;
    AttnShape as = llama_attn_shape(m, l, B, T);
    if (m->sp.P > 1) as = seqpar_dout_to_heads(&m->sp, sc->dout, &as);
    op_attention_backward(m->be, sc->dq, sc->dk, sc->dv, sc->dout, a->q, a->k, a->v, a->o, a->lse, as, sc->att_work);
    if (m->sp.P > 1) seqpar_grads_to_tokens(&m->sp, sc->dq, sc->dk, sc->dv, llama_seqpar_work(m, EXCHANGE_BACKWARD));
}

// Backpropagates m->scratch.dres (gradient w.r.t. the block output) to the block input, in place:
// the MLP tile by tile (down, SwiGLU exact or ReSiLU2, gate/up, its norm; recomputed first under
// --recompute block), then the o projection, attention, RoPE, q/k/v and the attention norm.
// rc: the recomputed block (NULL: not recomputed; a->x_in, the kept MLP buffers then).
static void block_backward(Llama* m, int l, BlockActs* a, const Recomputed* rc, int B, int T) {
    LlamaScratch* sc = &m->scratch;
    const Backend* be = m->be;
    const LlamaConfig* c = &m->cfg;
    const LlamaLayer* layer = &m->w.layers[l];
    int64_t N = (int64_t)B * T, d = c->dim;
    int r = m->modes.rank;
    float s = m->modes.lora_scale;
    const void* x_in = rc ? rc->block_input : a->x_in;
    llama_mlp(m, l, MLP_BACKWARD, rc ? rc->mlp_input : NULL, a, N);
    const void* o_in = llama_attention_output(m, a);
    const void* dyo = llama_branch_backward(m, sc->dres, a->ya, a->ra, layer->post_attn_norm, layer->dpost_attn_norm,
                                            a->post, N);
    op_linear_backward(be, sc->dout, dyo, o_in, a->ax[T_O], &layer->lin[T_O], sc->dax, N, r, s, OUT_WRITE);
    if (llama_qk_norm_ms(m) && !rc) {  // (a recomputed block has just built them)
        llama_qk_rebuild(m, layer, a, T_Q, N, T);
        llama_qk_rebuild(m, layer, a, T_K, N, T);
    }
    llama_attention_backward(m, l, a, B, T);
    RopeTables rt = llama_rope_of(m, layer);
    op_rope(be, sc->dq, rt.cos, rt.sin, m->io.pos, N, T, c->heads, c->head_dim, c->rot_dim, ROPE_INVERSE);
    op_rope(be, sc->dk, rt.cos, rt.sin, m->io.pos, N, T, c->kv_heads, c->head_dim, c->rot_dim, ROPE_INVERSE);
    op_linear_backward(be, sc->dz, llama_qk_norm_backward(m, layer, a, T_Q, sc->dq, N), a->z1, a->ax[T_Q],
                       &layer->lin[T_Q], sc->dax, N, r, s, OUT_WRITE);
    op_linear_backward(be, sc->dz, llama_qk_norm_backward(m, layer, a, T_K, sc->dk, N), a->z1, a->ax[T_K],
                       &layer->lin[T_K], sc->dax, N, r, s, OUT_ADD);
    op_linear_backward(be, sc->dz, sc->dv, a->z1, a->ax[T_V], &layer->lin[T_V], sc->dax, N, r, s, OUT_ADD);
    if (layer->dattn_norm) op_rmsnorm_gamma_grad(be, layer->dattn_norm, sc->dz, x_in, a->r1, N, (int)d);
    if (m->modes.ms) op_rmsnorm_ms_backward(be, sc->dres, sc->dz, a->z1, a->r1, N, (int)d);
    else op_rmsnorm_backward(be, sc->dres, sc->dz, x_in, a->r1, layer->attn_norm, N, (int)d);
}

// --recompute block: block l's attention activations rebuilt from its checkpoint by the same
// forward (so the same bits); its MLP's are rebuilt tile by tile in the backward. Returns the
// checkpoint on the device, which the backward of standard norms reads (the forward then runs on
// a copy; under MS norms in place), and the MLP's input.
static Recomputed llama_recompute_block(Llama* m, int l, int B, int T) {
    int64_t N = (int64_t)B * T;
    void* x = checkpoint_input(&m->saved.ckpt, l);
    void* stream = x;
    if (!m->modes.ms) {
        op_copy(m->be, m->scratch.resid_tmp, x, N * m->cfg.dim);
        stream = m->scratch.resid_tmp;
    }
    block_forward(m, l, stream, &m->saved.block[l], B, T, NULL, BLOCK_ATTENTION);
    Recomputed rc = {x, stream};
    return rc;
}

static void llama_backward_blocks(Llama* m, int B, int T) {
    int layers = m->cfg.layers;
    checkpoints_prefetch_last(&m->saved.ckpt);  // (--offload host)
    for (int l = layers - 1; l >= 0; l--) {
        int recomputes = train_block_recomputes(&m->modes, l);
        Recomputed rc = {};
        if (recomputes) rc = llama_recompute_block(m, l, B, T);
        block_backward(m, l, &m->saved.block[l], recomputes ? &rc : NULL, B, T);
        checkpoints_prefetch_below(&m->saved.ckpt, l);  // (--offload host) into this block's staging buffer
        trainable_grads_final_from(&m->w.tr, m->dist, m->w.layer_off[l]);  // this block's are final
    }
}

// The final norm and the head, with their gradients under --full, as the loss reads them.
static LmHead llama_lm_head(const Llama* m) {
    LmHead h = {m->w.final_norm,       m->cfg.norm_eps, m->w.lm_head,  m->cfg.vocab,     m->cfg.dim,
                m->scratch.loss_chunk, &m->scratch.loss, m->w.dlm_head, m->w.dfinal_norm, m->cfg.final_softcap};
    return h;
}

// After the forward (llama_forward_blocks): the fused head + loss over the uploaded batch's mask
// (+ its gradient), then the backward. Preference objectives call it with their per-token weights
// in the mask (llmc/models/llama_pref.h).
static LossStats llama_head_backward(Llama* m, int B, int T, float grad_scale, int backward, float* logits_out,
                                     double* step_stats) {
    const LlamaConfig* c = &m->cfg;
    LlamaScratch* sc = &m->scratch;
    int64_t N = (int64_t)B * T;
    LossStats st = {};
    if (backward) op_zero(m->be, sc->dres, (size_t)N * c->dim * m->be->abytes);
    LmHead head = llama_lm_head(m);
    LmHeadCall call = {sc->resid,  N,          m->io.targets, m->io.mask,         grad_scale,
                       backward ? sc->dres : NULL, logits_out, step_stats, m->io.bv.grad_scale};
    op_lm_head_loss(m->be, &head, &call, &st);
    if (!backward) return st;
    llama_backward_blocks(m, B, T);
    if (m->w.dembed && m->w.embed_scale) op_scale_columns(m->be, sc->dres, sc->dres, m->w.embed_scale, N, c->dim);
    if (m->w.dembed)
        op_embedding_backward(m->be, m->w.dembed, sc->dres, m->io.inputs, m->io.embed_order, N, c->dim,
                              c->pad_skip);  // dres: d loss / d embeddings
    return st;
}

// One micro-batch (already uploaded): forward, fused head + loss (+ its gradient), backward. LoRA
// grads accumulate. grad_scale = 1 / (unmasked tokens in the whole optimizer step). logits_out
// (backend memory, fp32 [B*T, V]): tests and generation only. step_stats (CUDA, or NULL): the loss
// statistics are added there on the device and the returned LossStats stay zero (llmc/ops.h).
static LossStats llama_forward_backward(Llama* m, int B, int T, float grad_scale, int backward, float* logits_out,
                                        double* step_stats) {
    batch_values_check(&m->io.bv, grad_scale, backward, &m->drop, "llama_upload_batch");
    llama_forward_blocks(m, B, T, NULL);
    return llama_head_backward(m, B, T, grad_scale, backward, logits_out, step_stats);
}
