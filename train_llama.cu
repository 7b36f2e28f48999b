// train_llama.cu: fine-tuning of LLaMA-family models (LoRA adapters, or every weight with --full)
// with the memory-saving backward pass of "Reducing Fine-Tuning Memory Overhead by Approximate
// and Memory-Sharing Backpropagation": ReSiLU2 (exact SiLU forward, 2-bit backward) and
// MS-RMSNorm (gamma merged into the next linears; backward from the normalised output and one
// scalar per row).
//
// Read top to bottom: config -> parameters -> memory plan -> weight loading -> forward -> backward
// -> training step (with evaluation and generation) -> the dry run -> adapters, state and export
// -> main (the training loop, the flags, main). The loop's shared pieces are llmc/train/loop.h,
// the optimizer llmc/train/zero.h. The model is written once; the operations
// it calls (llmc/ops.h) run on the backend chosen by --device: the CPU (fp32) or a CUDA GPU (bf16
// activations and frozen weights, fp32 statistics, LoRA masters, gradients and AdamW state).
#include <omp.h>
#include "llmc/common.h"
#include "llmc/formats/json.h"
#include "llmc/formats/safetensors.h"
#include "llmc/train/flags.h"
#include "llmc/rng.h"
#include "llmc/text/model_tokenizer.h"
#include "llmc/text/textdata.h"
#include "llmc/memory/plan.h"
#include "llmc/memory/checkpoints.h"
#include "llmc/train/run_options.h"
#include "llmc/linear.h"
#include "llmc/formats/peft.h"
#include "llmc/train/train_state.h"
#include "llmc/train/dist.h"
#include "llmc/train/trainable.h"
#include "llmc/train/zero.h"
#include "llmc/train/loop.h"
#include "llmc/backend.h"
#include "llmc/ops.h"
#include "llmc/attn_docs.h"
#include "llmc/train/batch_values.h"
#ifdef LLMC_HAVE_CUDA
#include "llmc/cuda/graph.cuh"
#endif
#include "llmc/train/fit.h"
#include "llmc/train/seq_parallel.h"
#include "llmc/nf4.h"
#include "llmc/formats/bnb.h"
#include "llmc/models/llama_family.h"

// ----------------------------------------------------------------------------------------------
// Config: config.json of a LLaMA, Mistral, Qwen2 or Qwen3 checkpoint, read strictly (llmc/models/llama_family.h)

// ----------------------------------------------------------------------------------------------
// Parameters. Frozen weights live in one arena, LoRA weights (and their grads and AdamW moments)
// in flat arenas of identical layout, so the optimizer and gradient norm see one array. The
// linear layer with its adapter (Linear) is shared with train_vit: llmc/linear.h.

enum { T_Q, T_K, T_V, T_O, T_GATE, T_UP, T_DOWN, N_TARGETS };
static const char* const target_names[N_TARGETS] = {"q", "k", "v", "o", "gate", "up", "down"};
static const char* const* const hf_module_names = llama_hf_modules;  // [N_TARGETS], the checkpoint's names
static_assert(sizeof(llama_hf_modules) / sizeof(llama_hf_modules[0]) == N_TARGETS, "one module name per target");

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
} LlamaLayer;

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
    void* g;               // gate pre-activation (exact SiLU backward)
    uint8_t* codes;        // 2-bit ReSiLU2 codes of g
    void *sg, *u;          // silu(g) and up: the product's operands
    void* p;               // silu(g) * u = down input
} BlockActs;

typedef struct {
    LlamaConfig cfg;
    TrainModes modes;
    const Backend* be;
    int B, T;              // planned micro-batch shape (T: this rank's tokens of each under --seq-parallel)
    int64_t mlp_tile;      // tokens per MLP tile (llama_mlp_tile_rows): rows of the wide intermediates not kept
    SeqPar sp;             // --seq-parallel: the group sharing each sequence (sp.T the whole sequence), else P = 1
    void* embed;           // [V, d]
    void* final_norm;      // [d] (kept standard: the head is tied to the embedding)
    void* lm_head;         // [V, d] (== embed when tied)
    // --full trains these too: their gradients and host mirrors (NULL when frozen)
    float *dembed, *dlm_head, *dfinal_norm, *h_embed, *h_lm_head, *h_final_norm;
    LlamaLayer* layers;
    float* gamma_host;     // [layers][2][d] the norms' gammas on the host (MS merge, adapters)
    float *rope_cos, *rope_sin;  // [T, hd/2]
    Trainable tr;          // LoRA A/B, or (--full) every weight: one flat array (ZeRO-1 across ranks)
    const Dist* dist;
    BlockActs* acts;       // [layers]
    BlockActs tmp;         // scratch set (recompute, or buffers not kept)
    Checkpoints ckpt;      // --recompute block: each block's input [N, d] (--offload host: on the host)
    int64_t* layer_off;    // [layers] where each block's trainable values start in the arena
    // scratch (activation gradients have the activations' element type)
    void *resid, *resid_tmp, *dres, *dz, *dq, *dk, *dv, *dout, *dp, *dg, *du, *dax;
    void* att_work;        // CUDA attention: the tensor-core path's chunk of scores (llmc/memory/cuda_workspace.h)
    size_t att_work_bytes;
    void **kv_k, **kv_v;   // --generate: [layers] the key/value cache, [T, KVH*hd] each
    float* gen_logits;     // --generate: [V] the last position's logits
    void* blas_work;       // CUDA: cuBLAS's and cuBLASLt's workspace (llmc/memory/cuda_workspace.h)
    // --quant nf4: the tables (NF4 values, dynamic map; backend and host copies) and the scratch
    // every linear's W is dequantized into before its products (llmc/formats/nf4.h), else NULL
    float* nf4_tables;
    float h_nf4_tables[NF4_TABLE_FLOATS];
    void* nf4_scratch;
    void* lora_norm_work;  // MS norms, --ms-lora exact: the adapters' scratch (llmc/linear.h), else NULL
    LoraDropout drop;      // --lora-dropout: the masks' key and the adapters' input scratch (llmc/lora_dropout.h)
    void* drop_work;
    int *inputs, *targets; // on the backend
    int *embed_order, *h_embed_order;  // --full: the batch's positions sorted by token (embedding_token_order)
    int* pos;              // position of each token within its (packed) example
    int pos_restarts;      // the uploaded batch packs examples (a position is not its column): attention masks by pos
    void *docs_buf, *h_docs_buf;  // CUDA, cuDNN's ragged attention: the packed batch's documents (llmc/attn_docs.h)
    AttnDocs docs;         // and what attention reads of them (device arrays in docs_buf), else unused
    char docs_why[160];    // why a batch's positions are not mapped (docs.why)
    float* mask;
    int *h_inputs, *h_targets, *h_pos;  // the batch as the loader writes it (host; == the above on the CPU)
    float* h_mask;
    BatchValues bv;        // CUDA: the loss scale and dropout key the kernels read from device memory
    BatchStaging staging;  // CUDA: the batch's way up, double buffered (llmc/backend.h)
    int micro_batches;     // per optimizer step (--grad-accum; 0: one), which sizes the staging
    LossBuffers loss;
    int loss_chunk;
    MemPlan plan;
#ifdef LLMC_HAVE_CUDA
    CudaGraph graph;       // LLMC_CUDA_GRAPH=1: each micro-batch's forward + backward replayed as one CUDA graph
#endif
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
        plan_add(p, MEM_FROZEN, "embedding", -1, "embed", V * d * wbytes, &m->embed);
        plan_add(p, MEM_FROZEN, "final_norm", -1, "final_norm", d * wbytes, &m->final_norm);
        if (!c->tied) plan_add(p, MEM_FROZEN, "lm_head", -1, "lm_head", V * d * wbytes, &m->lm_head);
    }
    for (int l = 0; l < c->layers; l++) {
        LlamaLayer* layer = &m->layers[l];
        if (!train_norms) {
            plan_add(p, MEM_FROZEN, "attn_norm", l, "attn_norm", d * wbytes, &layer->attn_norm);
            plan_add(p, MEM_FROZEN, "mlp_norm", l, "mlp_norm", d * wbytes, &layer->mlp_norm);
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
        plan_add(p, MEM_FROZEN, "nf4", -1, "nf4_tables", sizeof(float) * NF4_TABLE_FLOATS, &m->nf4_tables);
        plan_add(p, MEM_SCRATCH, "nf4", -1, "nf4_dequant", biggest * wbytes, &m->nf4_scratch);
    }
    int64_t n_params = md->full ? V * d * (c->tied ? 1 : 2) + d + (train_norms ? 2 * c->layers * d : 0) : 0;
    if (md->full && c->qk_norm) n_params += 2 * c->layers * c->head_dim;
    for (int l = 0; l < c->layers; l++)
        for (int t = 0; t < N_TARGETS; t++) {
            if (md->full) n_params += lin_in(c, t) * lin_out(c, t) + (llama_linear_has_bias(c, t) ? lin_out(c, t) : 0);
            else if (md->targets >> t & 1) n_params += r * (lin_in(c, t) + lin_out(c, t));
        }
    trainable_plan(&m->tr, p, md->full ? "all weights" : "lora", n_params,
                   md->full ? SHARD_OPTIM_AND_MASTER : SHARD_NONE, m->dist, be);
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
// The MLP and its norm run in tiles of m->mlp_tile tokens (llama_mlp_forward_tile), so the shared
// set's MLP buffers hold one tile: a forward temporary lives for one tile, and under --recompute
// block the backward recomputes the MLP tile by tile just before that tile's backward.
static void llama_plan_block(Llama* m, MemPlan* p, int l) {
    const LlamaConfig* c = &m->cfg;
    const TrainModes* md = &m->modes;
    int abytes = m->be->abytes, keep = !md->recompute_block, msqk = llama_qk_norm_ms(m);
    int64_t N = (int64_t)m->B * m->T, d = c->dim, f = c->hidden, qd = (int64_t)c->heads * c->head_dim,
            kvd = (int64_t)c->kv_heads * c->head_dim, r = md->rank;
    // a linear keeps its input when its own backward needs it: it has an adapter or trains W
    int lora_qkv = md->full || (md->targets & ((1u << T_Q) | (1u << T_K) | (1u << T_V)));
    int lora_gu = md->full || (md->targets & ((1u << T_GATE) | (1u << T_UP)));
    BlockActs* a = &m->acts[l];
    BlockActs* s = &m->tmp;
    char nm[48];
    if (md->recompute_block)  // the checkpoint [N, d]: on the device, or (--offload host) in pinned host memory
        checkpoints_plan_block(p, &m->ckpt, l, N * d * abytes);
    if (!md->ms && !md->recompute_block)
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
    int64_t tile = m->mlp_tile, rows = keep ? N : tile;  // rows of the MLP's kept (N) or shared (tile) buffers
    for (int t = 0; t < N_TARGETS; t++) {
        if (!(md->targets >> t & 1)) continue;
        snprintf(nm, sizeof(nm), "lora_%s_ax", target_names[t]);
        int64_t ax_rows = t >= T_GATE ? rows : N;
        plan_block_act(p, m, l, keep, "lora", nm, ax_rows * r * abytes, &a->ax[t], &s->ax[t]);
    }
    int keep_z2 = keep && (md->ms || lora_gu);
    if (!md->ms) plan_block_act(p, m, l, keep, "mlp_norm", "h_mid", rows * d * abytes, &a->h_mid, &s->h_mid);
    plan_block_act(p, m, l, keep, "mlp_norm", "r2", rows * 4, &a->r2, &s->r2);
    plan_block_act(p, m, l, keep_z2, "gate_up_input", "z2", (keep_z2 ? N : tile) * d * abytes, &a->z2, &s->z2);
    if (!md->approx) plan_block_act(p, m, l, keep, "silu", "g", rows * f * abytes, &a->g, &s->g);
    if (md->approx)
        plan_block_act(p, m, l, keep, "silu", "codes", (size_t)packed_codes_bytes(rows * f), &a->codes, &s->codes);
    plan_block_act(p, m, l, keep, "swiglu_product", "silu_g", rows * f * abytes, &a->sg, &s->sg);
    plan_block_act(p, m, l, keep, "swiglu_product", "up", rows * f * abytes, &a->u, &s->u);
    if (llama_keeps_down_input(m))
        plan_block_act(p, m, l, keep, "down_input", "product", rows * f * abytes, &a->p, &s->p);
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
    const char* e = getenv("LLMC_SEQPAR_LEND");
    return m->sp.P > 1 && llama_dout_shares_dz(m) && !(e && strcmp(e, "0") == 0);
}

// Where the exchanges of o and the gradients receive in each pass: a buffer dead meanwhile
// (llama_seqpar_lends, decided once by the plan: sp.lent), or the group's own.
typedef enum { EXCHANGE_FORWARD, EXCHANGE_RECOMPUTED_FORWARD, EXCHANGE_BACKWARD } ExchangePass;
static void* llama_seqpar_work(const Llama* m, ExchangePass pass) {
    if (!m->sp.lent) return m->sp.work;
    return pass == EXCHANGE_FORWARD ? m->dres : m->resid;
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
    plan_add(p, MEM_SCRATCH, "residual", -1, "resid", N * d * abytes, &m->resid);
    // the recomputed forward's residual stream: a copy of the checkpoint where the backward reads
    // the block input (standard norms); under MS norms it runs in place on the checkpoint
    if (md->recompute_block && !md->ms)
        plan_add(p, MEM_SCRATCH, "residual", -1, "resid_tmp", N * d * abytes, &m->resid_tmp);
    // block inputs [N, d]: with two, one travels to or from the host while the other is in use;
    // one where the memory holds no more (llama_fit_to_memory, llmc/memory/offload.h)
    checkpoints_plan_staging(p, &m->ckpt, md->offload_staging, N * d * abytes);
    plan_add(p, MEM_SCRATCH, "grads", -1, "dres", N * d * abytes, &m->dres);
    // dz [N, d] has no buffer of its own: it is resid's (llama_bind), by lifetime. resid's last
    // reader is the head (the final norm's input); dz's first writer is the first block's backward.
    // dout too, where it can (llama_dout_shares_dz).
    plan_add(p, MEM_SCRATCH, "grads", -1, "dq", N * qd * abytes, &m->dq);
    int64_t kv_grad = N * seqpar_kv_width(&m->sp) * abytes;  // attention's layout (llama_plan_block's k, v)
    plan_add(p, MEM_SCRATCH, "grads", -1, "dk", kv_grad, &m->dk);
    plan_add(p, MEM_SCRATCH, "grads", -1, "dv", kv_grad, &m->dv);
    if (!llama_dout_shares_dz(m)) plan_add(p, MEM_SCRATCH, "grads", -1, "dout", N * qd * abytes, &m->dout);
    // the MLP's gradients (and the forward temporaries bound to them) for one tile of tokens
    plan_add(p, MEM_SCRATCH, "grads", -1, "dp", m->mlp_tile * f * abytes, &m->dp);
    plan_add(p, MEM_SCRATCH, "grads", -1, "dg", m->mlp_tile * f * abytes, &m->dg);
    plan_add(p, MEM_SCRATCH, "grads", -1, "du", m->mlp_tile * f * abytes, &m->du);
    plan_add(p, MEM_SCRATCH, "grads", -1, "dax", N * r * abytes, &m->dax);
    if (llama_adapters_see_gamma(m) && lora_norm_inputs)
        plan_add(p, MEM_SCRATCH, "lora", -1, "lora_norm_work", lora_norm_work_bytes((int)r, (int)d, abytes),
                 &m->lora_norm_work);
    if (md->lora_dropout > 0 && md->targets) {  // one adapter input at a time, the largest: regenerated, not kept
        int64_t largest = 0;  // elements: the MLP's linears see one tile of rows, the others all N
        for (int t = 0; t < N_TARGETS; t++) {
            int64_t n = (t >= T_GATE ? m->mlp_tile : N) * lin_in(c, t);
            if ((md->targets >> t & 1) && n > largest) largest = n;
        }
        plan_add(p, MEM_SCRATCH, "lora", -1, "lora_dropout_input", largest * abytes, &m->drop_work);
    }
    AttnShape as = {m->B, m->T, c->heads, c->kv_heads, c->head_dim, 1, NULL, NULL};
    if (m->sp.P > 1) as = seqpar_attn_shape(&m->sp);  // whole sequences, this rank's heads
    m->att_work_bytes = op_plan_attention_work(be, p, as, &m->att_work);
    op_plan_matmul_workspace(be, p, &m->blas_work);
    plan_add(p, MEM_SCRATCH, "batch", -1, "inputs", N * 4, &m->inputs);
    plan_add(p, MEM_SCRATCH, "batch", -1, "targets", N * 4, &m->targets);
    plan_add(p, MEM_SCRATCH, "batch", -1, "mask", N * 4, &m->mask);
    batch_values_plan(&m->bv, be, p, md->lora_dropout > 0 && md->targets);
    plan_add(p, MEM_SCRATCH, "batch", -1, "pos", N * 4, &m->pos);
    if (m->sp.P == 1 && op_attention_wants_docs(be))  // at most a document per token
        plan_add(p, MEM_SCRATCH, "batch", -1, "attention documents", attn_docs_bytes(N), &m->docs_buf);
    seqpar_plan(&m->sp, p, llama_seqpar_lends(m));
    if (m->modes.full) plan_add(p, MEM_SCRATCH, "batch", -1, "embed_order", N * 4, &m->embed_order);
    HeadChunkRule rule;
    m->loss_chunk = (int)lm_head_chunk(be, N, d, V, md->head_chunk_small ? HEAD_CHUNK_WANT_SMALL : HEAD_CHUNK_WANT_PLAN,
                                       &rule);
    p->loss_chunk_rows = m->loss_chunk;
    p->loss_chunk_rule = head_chunk_rule_names[rule];
    op_plan_lm_head_loss(be, p, &m->loss, m->loss_chunk, d, V);
    if (!md->generate) return;
    char nm[48];  // one window of m->T positions (llama_generate)
    for (int l = 0; l < c->layers; l++) {
        snprintf(nm, sizeof(nm), "L%d.key_cache", l);
        plan_add(p, MEM_SCRATCH, "generation", -1, nm, m->T * kvd * abytes, &m->kv_k[l]);
        snprintf(nm, sizeof(nm), "L%d.value_cache", l);
        plan_add(p, MEM_SCRATCH, "generation", -1, nm, m->T * kvd * abytes, &m->kv_v[l]);
    }
    plan_add(p, MEM_SCRATCH, "generation", -1, "generation_logits", V * 4, &m->gen_logits);
}

static void llama_plan(Llama* m, MemPlan* p) {
    const LlamaConfig* c = &m->cfg;
    memset(p, 0, sizeof(*p));
    p->tokens = (int64_t)m->B * m->T;
    p->blocks = c->layers;
    p->recomputed = m->modes.recompute_block;
    llama_plan_weights(m, p);
    int64_t rope_bytes = (int64_t)m->sp.T * (c->head_dim / 2) * 4;  // [T, hd/2] fp32: 2 GiB at 8M positions
    plan_add(p, MEM_SCRATCH, "rope", -1, "rope_cos", rope_bytes, &m->rope_cos);
    plan_add(p, MEM_SCRATCH, "rope", -1, "rope_sin", rope_bytes, &m->rope_sin);
    for (int l = 0; l < c->layers; l++) llama_plan_block(m, p, l);
    llama_plan_scratch(m, p);
}

// Forward temporaries no backward reads, in gradient scratch, which no forward uses (the
// recomputed one runs before its block's backward): the gate pre-activation g [N, f] under
// ReSiLU2 (its 2-bit codes are kept), the product p [N, f] where the down projection's input is
// not kept (a rebuilt one, --swiglu-product recompute, is dead before du is written), and under
// MS norms Qwen3's q, k projections before their norm [N, qd], [N, kvd] (z is kept).
static void llama_bind_forward_temporaries(Llama* m) {
    if (m->modes.approx) m->tmp.g = m->dg;
    if (!llama_keeps_down_input(m)) m->tmp.p = m->du;
    if (llama_qk_norm_ms(m)) { m->tmp.q_pre = m->dq; m->tmp.k_pre = m->dk; }
}

// After allocation: points the buffers a block does not keep at the shared scratch set, wires the
// trainable weights into the flat arenas (layer-major, target order; LoRA A then B, or W under
// --full), and sets up the host side of the batch and of the trainable arena.
static void llama_bind(Llama* m) {
    const LlamaConfig* c = &m->cfg;
    llama_bind_forward_temporaries(m);
    m->dz = m->resid;  // [N, d] both: the residual stream dies at the head, before any backward writes dz
    if (llama_dout_shares_dz(m)) m->dout = m->dz;
    if (m->sp.lent) m->sp.tok = m->dq;
    for (int l = 0; l < c->layers; l++) {
        void** a = (void**)&m->acts[l];
        void** s = (void**)&m->tmp;
        for (size_t i = 0; i < sizeof(BlockActs) / sizeof(void*); i++) if (!a[i]) a[i] = s[i];
    }
    trainable_bind_host(&m->tr);
    lora_dropout_init(&m->drop, m->modes.lora_dropout, m->modes.seed, m->drop_work);
    int64_t off = 0, r = m->modes.rank, d = c->dim, V = c->vocab;
    if (m->modes.full) {  // arena: embedding, head (untied), final norm, then block by block
        m->h_embed = trainable_bind_tensor(&m->tr, &off, V * d, &m->embed, &m->dembed, NULL);
        if (!c->tied) m->h_lm_head = trainable_bind_tensor(&m->tr, &off, V * d, &m->lm_head, &m->dlm_head, NULL);
        m->h_final_norm = trainable_bind_tensor(&m->tr, &off, d, &m->final_norm, &m->dfinal_norm, NULL);
    }
    if (c->tied) { m->lm_head = m->embed; m->dlm_head = m->dembed; m->h_lm_head = m->h_embed; }
    for (int l = 0; l < c->layers; l++)
        for (int t = 0; t < N_TARGETS; t++) {
            Linear* L = &m->layers[l].lin[t];
            if (t == 0) {
                m->layer_off[l] = off;
                LlamaLayer* layer = &m->layers[l];
                if (m->modes.full && !m->modes.ms) {  // the gammas train too (MS merged them into W)
                    layer->h_attn_norm =
                        trainable_bind_tensor(&m->tr, &off, d, &layer->attn_norm, &layer->dattn_norm, NULL);
                    layer->h_mlp_norm =
                        trainable_bind_tensor(&m->tr, &off, d, &layer->mlp_norm, &layer->dmlp_norm, NULL);
                }
                if (m->modes.full && c->qk_norm) {  // Qwen3's q/k norms train in every norm mode (no merge took them)
                    layer->h_q_norm =
                        trainable_bind_tensor(&m->tr, &off, c->head_dim, &layer->q_norm, &layer->dq_norm, NULL);
                    layer->h_k_norm =
                        trainable_bind_tensor(&m->tr, &off, c->head_dim, &layer->k_norm, &layer->dk_norm, NULL);
                }
            }
            L->in = (int)lin_in(c, t);
            L->out = (int)lin_out(c, t);
            L->name = target_names[t];
            if (m->modes.nf4) {
                L->nf4_tables = m->nf4_tables;
                *linear_weight_slot(m->be, L) = m->nf4_scratch;
            }
            if (m->modes.full) {
                trainable_bind_linear_weight(&m->tr, &off, L);  // full fine-tuning: W (and its bias) train in the arena
                if (llama_linear_has_bias(c, t)) trainable_bind_linear_bias(&m->tr, &off, L);
            } else if (m->modes.targets >> t & 1) {
                trainable_bind_adapter(&m->tr, &off, L, (int)r);
                const void* gamma = t <= T_V                   ? m->layers[l].attn_norm
                                    : t == T_GATE || t == T_UP ? m->layers[l].mlp_norm
                                                               : NULL;
                if (gamma && llama_adapters_see_gamma(m)) lora_norm_bind(L, gamma, NULL, m->lora_norm_work);
                if (m->drop_work) lora_dropout_bind(L, &m->drop, (uint32_t)(l * N_TARGETS + t));
            }
        }
    trainable_plan_buckets(&m->tr, m->layer_off,
                           c->layers);  // embedding, head and final norm lie below the first block
    int64_t N = (int64_t)m->B * m->T;
    m->h_inputs = (int*)backend_host_side(m->be, m->inputs, sizeof(int) * N);
    m->h_targets = (int*)backend_host_side(m->be, m->targets, sizeof(int) * N);
    m->h_pos = (int*)backend_host_side(m->be, m->pos, sizeof(int) * N);
    m->h_mask = (float*)backend_host_side(m->be, m->mask, sizeof(float) * N);
    if (m->sp.P > 1) m->sp.h_pos = (int*)backend_host_side(m->be, m->sp.pos, sizeof(int) * m->sp.N);
    if (m->embed_order) m->h_embed_order = (int*)backend_host_side(m->be, m->embed_order, sizeof(int) * N);
    size_t batch_bytes = 4 * staging_align(sizeof(int) * N) + (m->embed_order ? staging_align(sizeof(int) * N) : 0);
    if (m->sp.P > 1) batch_bytes += staging_align(sizeof(int) * m->sp.N);  // --seq-parallel: every token's position
    if (m->docs_buf) {  // its four arrays, each uploaded as far as the batch uses it (llama_upload_documents)
        m->h_docs_buf = backend_host_side(m->be, m->docs_buf, attn_docs_bytes(N));
        batch_bytes += 3 * staging_align(sizeof(int64_t) * (N + 1)) + staging_align(sizeof(int32_t) * N);
    }
    batch_bytes += batch_values_bind(&m->bv, m->be, &m->drop);
    staging_init(&m->staging, m->be, batch_bytes, m->micro_batches);
}

// Attention's document mask: the batch's positions when it packs examples, else NULL (the same
// mask, and the only one cuDNN's attention takes: llmc/ops.h).
static const int* llama_attention_pos(const Llama* m) { return m->pos_restarts ? m->pos : NULL; }
// and its documents for cuDNN's ragged attention, where they are described (llama_describe_documents)
static const AttnDocs* llama_attention_docs(const Llama* m) { return m->pos_restarts && m->docs_buf ? &m->docs : NULL; }

static int pow2_at_least(int x) {
    int p = 1;
    while (p < x) p *= 2;
    return p;
}

// The documents of the first n tokens of the host batch (packed examples) as cuDNN's ragged entries,
// into the host side of docs_buf (uploaded with the batch). cuDNN's sequence dimension is the
// longest document rounded up to a power of two (at most T), and its batch the document count:
// both pick the plan (llmc/cuda/attention_cudnn.cu caches one per pair) and are part of the CUDA
// graph's key. Where cuDNN takes zero-length entries (9.25 on), the batch is padded to a power of
// two and both only ever grow (the largest seen so far), so that a run settles on one plan and one
// graph; before, every document count is its own plan (and graph).
static void llama_describe_documents(Llama* m, int64_t n) {
    AttnDocs* d = &m->docs;
    int rows = (int)(n / m->T), max_len = 0, pad = 0;
    const char* why = NULL;
    int docs = (int64_t)rows * m->T == n ? attn_docs_count(m->h_pos, rows, m->T, &max_len, &why) : -1;
    if (docs <= 0) {
        snprintf(m->docs_why, sizeof(m->docs_why),
                 "packed examples whose positions are not documents one after another (%s)",
                 why ? why : "not whole rows");
        d->why = m->docs_why;
        return;
    }
#ifdef LLMC_HAVE_CUDNN
    pad = attention_cudnn_takes_empty_documents();
#endif
    int len = pow2_at_least(max_len), batch = docs;
    if (len > m->T) len = m->T;
    if (pad) {
        batch = pow2_at_least(docs);
        if (batch > n) batch = (int)n;
        if (d->batch > batch) batch = d->batch;
        if (d->max_len > len) len = d->max_len;
    }
    int64_t cap = (int64_t)m->B * m->T;
    attn_docs_fill(attn_docs_arrays(m->h_docs_buf, cap), m->h_pos, rows, m->T, batch, m->cfg.heads, m->cfg.kv_heads,
                   m->cfg.head_dim);
    AttnDocArrays dev = attn_docs_arrays(m->docs_buf, cap);
    d->docs = docs;
    d->batch = batch;
    d->max_len = len;
    d->tokens = n;
    d->off_q = dev.off_q;
    d->off_kv = dev.off_kv;
    d->off_stats = dev.off_stats;
    d->seq_len = dev.seq_len;
    d->why = NULL;
}

// Describes the documents and stages the part of each array that cuDNN's batch reads.
static void llama_upload_documents(Llama* m, BatchStaging* s, int64_t n) {
    llama_describe_documents(m, n);
    if (m->docs.why) return;
    int64_t cap = (int64_t)m->B * m->T, e = m->docs.batch;
    AttnDocArrays h = attn_docs_arrays(m->h_docs_buf, cap), dev = attn_docs_arrays(m->docs_buf, cap);
    staging_upload(s, dev.off_q, h.off_q, sizeof(int64_t) * (e + 1));
    staging_upload(s, dev.off_kv, h.off_kv, sizeof(int64_t) * (e + 1));
    staging_upload(s, dev.off_stats, h.off_stats, sizeof(int64_t) * (e + 1));
    staging_upload(s, dev.seq_len, h.seq_len, sizeof(int32_t) * e);
}


// The first n tokens of the host batch to the backend.
static void llama_upload_batch(Llama* m, int64_t n) {
    m->pos_restarts = 0;  // positions 0..T-1 in every row: no document mask (cuDNN's attention can take it)
    for (int64_t i = 0; i < n && !m->pos_restarts; i++) m->pos_restarts = m->h_pos[i] != i % m->T;
    BatchStaging* s = &m->staging;
    staging_begin(s);
    staging_upload(s, m->inputs, m->h_inputs, sizeof(int) * n);
    staging_upload(s, m->targets, m->h_targets, sizeof(int) * n);
    staging_upload(s, m->mask, m->h_mask, sizeof(float) * n);
    staging_upload(s, m->pos, m->h_pos, sizeof(int) * n);
    if (m->pos_restarts && m->docs_buf) llama_upload_documents(m, s, n);
    if (m->sp.P > 1) staging_upload(s, m->sp.pos, m->sp.h_pos, sizeof(int) * m->sp.N);  // every token's position
    batch_values_stage(&m->bv, s, &m->drop);  // the step's loss scale and dropout key (train)
    if (m->embed_order) {
        embedding_token_order(m->h_embed_order, m->h_inputs, n);
        staging_upload(s, m->embed_order, m->h_embed_order, sizeof(int) * n);
    }
    staging_end(s);
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
    m->B = B;
    seqpar_setup(&m->sp, dist, be, B, T, cfg->heads, cfg->kv_heads, cfg->head_dim);
    m->T = T / m->sp.P;  // this rank's slice of each sequence (the whole batch's N / P tokens)
    m->mlp_tile = llama_mlp_tile_rows(modes->mlp_tile, (int64_t)B * m->T, cfg->hidden);
    m->layers = (LlamaLayer*)xcalloc(cfg->layers, sizeof(LlamaLayer));
    m->acts = (BlockActs*)xcalloc(cfg->layers, sizeof(BlockActs));
    checkpoints_init(&m->ckpt, cfg->layers, modes->offload_host);
    m->layer_off = (int64_t*)xcalloc(cfg->layers, sizeof(int64_t));
    m->kv_k = (void**)xcalloc(cfg->layers, sizeof(void*));
    m->kv_v = (void**)xcalloc(cfg->layers, sizeof(void*));
    llama_plan(m, &m->plan);
}

static void llama_allocate(Llama* m) {
    backend_allocate_plan(m->be, &m->plan);
    op_attach_matmul_workspace(m->be, m->blas_work);
    llama_bind(m);
    checkpoints_start(&m->ckpt, m->be, m->cfg.layers, (size_t)m->B * m->T * m->cfg.dim * m->be->abytes);
}

static void llama_free(Llama* m) {
    checkpoints_free(&m->ckpt);  // the copy stream done, before the plan's memory goes
    if (m->plan.arena[MEM_SCRATCH] || m->plan.arena[MEM_FROZEN]) {  // allocated (not a dry run)
        trainable_free_host(&m->tr);
        staging_free(&m->staging);
        backend_free_host_side(m->be, m->h_inputs); backend_free_host_side(m->be, m->h_targets);
        backend_free_host_side(m->be, m->h_pos); backend_free_host_side(m->be, m->h_mask);
        backend_free_host_side(m->be, m->h_embed_order);
        if (m->sp.h_pos) backend_free_host_side(m->be, m->sp.h_pos);
        if (m->h_docs_buf) backend_free_host_side(m->be, m->h_docs_buf);
        batch_values_free(&m->bv, m->be);
        op_detach_matmul_workspace(m->be, m->blas_work);
#ifdef LLMC_HAVE_CUDA
        if (m->be->cuda) cuda_graph_free(&m->graph);
#endif
        backend_free_plan(m->be, &m->plan);
    } else {
        plan_free(&m->plan);
    }
    free(m->layers);
    free(m->acts);
    free(m->gamma_host);
    free(m->layer_off);
    free(m->kv_k);
    free(m->kv_v);
}

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
    nf4_quantize(nf4_view(q, n), w, m->h_nf4_tables, absmax);
    backend_upload(m->be, (void*)lin->nf4, q, (size_t)nf4_tensor_bytes(n));
    free(absmax);
    free(q);
}

// --quant nf4: the tables every NF4 weight is quantized and dequantized with (host and backend).
static void llama_set_nf4_tables(Llama* m, const float* tables) {
    if (!m->modes.nf4) return;
    memcpy(m->h_nf4_tables, tables, sizeof(m->h_nf4_tables));
    backend_upload(m->be, m->nf4_tables, tables, sizeof(m->h_nf4_tables));
}

// Under --quant nf4, the fp32 weights a linear's products use: its NF4 tensor read back from the
// backend and dequantized (merged under MS norms). w: out*in floats.
static void llama_linear_weights_f32(const Llama* m, const Linear* L, float* w) {
    int64_t n = (int64_t)L->out * L->in;
    void* q = xmalloc((size_t)nf4_tensor_bytes(n));
    backend_download(m->be, q, L->nf4, (size_t)nf4_tensor_bytes(n));
    nf4_dequantize(w, nf4_view(q, n), m->h_nf4_tables);
    free(q);
}

// A bitsandbytes checkpoint: the dynamic map of its first quantized weight becomes the model's
// (every weight must carry the same one), so that its NF4 bytes are used as they are.
static void llama_bnb_tables(const Llama* m, const StModel* sm, float* tables) {
    char name[256];
    snprintf(name, sizeof(name), "model.layers.0.%s.weight", hf_module_names[0]);
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
    if (w.dyn && memcmp(w.dyn, m->h_nf4_tables + 16, sizeof(float) * NF4_DYN_SIZE) != 0 && m->modes.nf4)
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

static void llama_load_weights(Llama* m, const char* dir) {
    const LlamaConfig* c = &m->cfg;
    int64_t d = c->dim, biggest = (int64_t)c->vocab * d;
    for (int t = 0; t < N_TARGETS; t++)
        if (lin_in(c, t) * lin_out(c, t) > biggest) biggest = lin_in(c, t) * lin_out(c, t);
    float* tmp = (float*)xmalloc(sizeof(float) * biggest);
    m->gamma_host = (float*)xmalloc(sizeof(float) * 2 * c->layers * d);
    int bnb = bnb_config_nf4(dir);
    StModel sm;
    st_model_open(&sm, dir);
    llama_check_tensor_names(c, &sm, bnb);
    float tables[NF4_TABLE_FLOATS];
    nf4_fill_tables(tables);
    if (bnb) llama_bnb_tables(m, &sm, tables);
    llama_set_nf4_tables(m, tables);
    char name[256];
    load_weight(m, &sm, "model.embed_tokens.weight", m->embed, m->h_embed, tmp, c->vocab, d);
    load_weight(m, &sm, "model.norm.weight", m->final_norm, m->h_final_norm, tmp, d, 0);
    if (!c->tied) load_weight(m, &sm, "lm_head.weight", m->lm_head, m->h_lm_head, tmp, c->vocab, d);
    for (int l = 0; l < c->layers; l++) {
        LlamaLayer* layer = &m->layers[l];
        float *g_attn = m->gamma_host + 2 * l * d, *g_mlp = g_attn + d;
        snprintf(name, sizeof(name), "model.layers.%d.input_layernorm.weight", l);
        load_tensor(&sm, name, g_attn, d, 0);
        backend_set_weight(m->be, layer->attn_norm, layer->h_attn_norm, g_attn, d);
        snprintf(name, sizeof(name), "model.layers.%d.post_attention_layernorm.weight", l);
        load_tensor(&sm, name, g_mlp, d, 0);
        backend_set_weight(m->be, layer->mlp_norm, layer->h_mlp_norm, g_mlp, d);
        if (c->qk_norm) {
            snprintf(name, sizeof(name), "model.layers.%d.self_attn.q_norm.weight", l);
            load_weight(m, &sm, name, layer->q_norm, layer->h_q_norm, tmp, c->head_dim, 0);
            snprintf(name, sizeof(name), "model.layers.%d.self_attn.k_norm.weight", l);
            load_weight(m, &sm, name, layer->k_norm, layer->h_k_norm, tmp, c->head_dim, 0);
        }
        for (int t = 0; t < N_TARGETS; t++) {
            Linear* lin = &layer->lin[t];
            if (llama_linear_has_bias(c, t)) {  // RMSNorm has no beta: the MS merge leaves a bias as it is
                snprintf(name, sizeof(name), "model.layers.%d.%s.bias", l, hf_module_names[t]);
                load_weight(m, &sm, name, *linear_bias_slot(m->be, lin), m->modes.full ? lin->bias : NULL, tmp,
                            lin->out, 0);
            }
            snprintf(name, sizeof(name), "model.layers.%d.%s.weight", l, hf_module_names[t]);
            const float* gamma = !m->modes.ms ? NULL : t <= T_V ? g_attn : (t == T_GATE || t == T_UP) ? g_mlp : NULL;
            if (llama_read_linear(m, &sm, bnb, name, lin, tmp, gamma != NULL)) continue;
            if (gamma) merge_norm_affine(tmp, NULL, lin->out, lin->in, gamma, NULL, name);
            llama_set_linear_weight(m, lin, tmp);
        }
    }
    st_model_close(&sm);
    free(tmp);
    if (m->modes.full) trainable_to_device(&m->tr);
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
    m->gamma_host = (float*)xmalloc(sizeof(float) * 2 * c->layers * d);
    for (int64_t i = 0; i < 2 * c->layers * d; i++) m->gamma_host[i] = 1.0f;
    int64_t widest = 0;
    for (int t = 0; t < N_TARGETS; t++) widest = lin_out(c, t) > widest ? lin_out(c, t) : widest;
    float* zeros = (float*)xcalloc(widest + c->head_dim, sizeof(float));  // biases 0, then the q/k norms' gammas 1
    float* qk_ones = zeros + widest;
    for (int i = 0; i < c->head_dim; i++) qk_ones[i] = 1.0f;
    float tables[NF4_TABLE_FLOATS];
    nf4_fill_tables(tables);
    llama_set_nf4_tables(m, tables);
    backend_set_weight(m->be, m->embed, m->h_embed, tmp, c->vocab * d);
    backend_set_weight(m->be, m->final_norm, m->h_final_norm, m->gamma_host, d);
    if (!c->tied) backend_set_weight(m->be, m->lm_head, m->h_lm_head, tmp, c->vocab * d);
    for (int l = 0; l < c->layers; l++) {
        LlamaLayer* layer = &m->layers[l];
        backend_set_weight(m->be, layer->attn_norm, layer->h_attn_norm, m->gamma_host, d);
        backend_set_weight(m->be, layer->mlp_norm, layer->h_mlp_norm, m->gamma_host, d);
        if (c->qk_norm) {
            backend_set_weight(m->be, layer->q_norm, layer->h_q_norm, qk_ones, c->head_dim);
            backend_set_weight(m->be, layer->k_norm, layer->h_k_norm, qk_ones, c->head_dim);
        }
        for (int t = 0; t < N_TARGETS; t++) {
            Linear* lin = &layer->lin[t];
            llama_set_linear_weight(m, lin, tmp);
            if (llama_linear_has_bias(c, t))
                backend_set_weight(m->be, *linear_bias_slot(m->be, lin), m->modes.full ? lin->bias : NULL, zeros,
                                   lin->out);
        }
    }
    free(zeros);
    free(tmp);
    if (m->modes.full) trainable_to_device(&m->tr);
}

// RoPE tables, with the Llama-3.1 wavelength-dependent frequency scaling when configured.
static void llama_rope_tables(Llama* m) {
    const LlamaConfig* c = &m->cfg;
    int half = c->head_dim / 2;
    int T = m->sp.T;  // every position of the whole sequence (a sequence-parallel rank's slice starts past 0)
    float* cs = (float*)xmalloc(sizeof(float) * 2 * T * half);
    float* sn = cs + (int64_t)T * half;
    for (int i = 0; i < half; i++) {
        double inv = pow((double)c->rope_theta, -2.0 * i / c->head_dim);
        if (c->rope_llama3) {
            double wavelen = 2.0 * M_PI / inv;
            double low_wl = c->rs_original_ctx / c->rs_low_freq, high_wl = c->rs_original_ctx / c->rs_high_freq;
            if (wavelen > low_wl) inv /= c->rs_factor;
            else if (wavelen >= high_wl) {
                double smooth = (c->rs_original_ctx / wavelen - c->rs_low_freq) / (c->rs_high_freq - c->rs_low_freq);
                inv = (1.0 - smooth) * inv / c->rs_factor + smooth * inv;
            }
        }
        for (int t = 0; t < T; t++) {
            cs[(int64_t)t * half + i] = (float)cos(t * inv);
            sn[(int64_t)t * half + i] = (float)sin(t * inv);
        }
    }
    backend_upload(m->be, m->rope_cos, cs, sizeof(float) * T * half);
    backend_upload(m->be, m->rope_sin, sn, sizeof(float) * T * half);
    free(cs);
}

// Fresh adapters: A ~ kaiming-uniform (bound 1/sqrt(in), as PEFT), B = 0, so step 0 is exactly
// the pretrained model. Drawn on the host from the seed, so every backend starts identical.
static void llama_init_lora(Llama* m, uint64_t seed) {
    Rng rng = rng_seeded(seed, 7);
    for (int l = 0; l < m->cfg.layers; l++)
        for (int t = 0; t < N_TARGETS; t++) {
            Linear* L = &m->layers[l].lin[t];
            if (L->A) lora_init(L, m->modes.rank, &rng);
        }
    trainable_to_device(&m->tr);
}

// ----------------------------------------------------------------------------------------------
// Forward

// Generation's key/value cache: per layer, the keys (after RoPE) and values of every position fed
// so far, [cap, KVH*hd] in the backend's activation type.
typedef struct {
    void **k, **v;
    int len, cap;
} KVCache;

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
    op_rope(be, y, m->rope_cos, m->rope_sin, m->pos, N, T, heads, c->head_dim, ROPE_FORWARD);
}

// The MLP buffers' rows from token t0 on: a kept buffer's (whole sequence) from row t0, one of the
// shared set's (one tile, llama_plan_block) from its start.
static void* llama_tile_rows(void* buf, const void* shared, int64_t offset_bytes) {
    return !buf || buf == shared ? buf : (char*)buf + offset_bytes;
}

// a's MLP buffers (norm, gate/up/down with their LoRA A x, SwiGLU) for the tile of tokens from t0;
// the attention's as in a.
static BlockActs llama_mlp_tile_acts(const Llama* m, const BlockActs* a, int64_t t0) {
    const BlockActs* s = &m->tmp;
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
    for (int k = T_GATE; k <= T_DOWN; k++) t.ax[k] = llama_tile_rows(a->ax[k], s->ax[k], t0 * r * ab);
    return t;
}

// The MLP and its norm over n tokens: x [n, d], their rows of the residual stream (updated in
// place), and t, the tile's view of the block's buffers (llama_mlp_tile_acts). Every product and
// pass here works row by row, so a token's results do not depend on the tile it is in, as long as
// the products' rows are independent of the row count (docs/memory.md: the CPU's are; cuBLAS is
// not promised to be).
static void llama_mlp_forward_tile(Llama* m, const LlamaLayer* layer, void* x, BlockActs* t, int64_t n) {
    const Backend* be = m->be;
    const LlamaConfig* c = &m->cfg;
    int r = m->modes.rank;
    float s = m->modes.lora_scale;
    if (t->h_mid) op_copy(be, t->h_mid, x, n * c->dim);
    op_rmsnorm_forward(be, t->z2, t->r2, x, m->modes.ms ? NULL : layer->mlp_norm, n, c->dim, c->norm_eps);
    op_linear_forward(be, t->g, t->z2, &layer->lin[T_GATE], t->ax[T_GATE], n, r, s, OUT_WRITE);
    op_linear_forward(be, t->u, t->z2, &layer->lin[T_UP], t->ax[T_UP], n, r, s, OUT_WRITE);
    op_swiglu_forward(be, t->p, t->sg, m->modes.approx ? t->codes : NULL, t->g, t->u, n * c->hidden);
    op_linear_forward(be, x, t->p, &layer->lin[T_DOWN], t->ax[T_DOWN], n, r, s, OUT_ADD);
}

// The MLP's backward over n tokens: dy [n, d], their rows of m->dres (the gradient w.r.t. the
// block output), becomes the gradient w.r.t. the MLP's input, in place; dz [n, d]: their rows of
// m->dz. The wide gradients dp, dg, du hold one tile. Weight and LoRA gradients accumulate.
static void llama_mlp_backward_tile(Llama* m, const LlamaLayer* layer, BlockActs* t, void* dy, void* dz, int64_t n) {
    const Backend* be = m->be;
    int64_t nf = n * m->cfg.hidden;
    int r = m->modes.rank, d = m->cfg.dim;
    float s = m->modes.lora_scale;
    const Linear *gate = &layer->lin[T_GATE], *up = &layer->lin[T_UP], *down = &layer->lin[T_DOWN];
    if (m->modes.recompute_product && (down->A || down->dW))  // beyond the paper: rebuild the down input
        op_mul(be, t->p, t->sg, t->u, nf);
    op_linear_backward(be, m->dp, dy, t->p, t->ax[T_DOWN], down, m->dax, n, r, s, OUT_WRITE);
    op_swiglu_backward(be, m->dg, m->du, m->dp, t->sg, t->u, m->modes.approx ? NULL : t->g, t->codes, nf);
    op_linear_backward(be, dz, m->dg, t->z2, t->ax[T_GATE], gate, m->dax, n, r, s, OUT_WRITE);
    op_linear_backward(be, dz, m->du, t->z2, t->ax[T_UP], up, m->dax, n, r, s, OUT_ADD);
    if (layer->dmlp_norm) op_rmsnorm_gamma_grad(be, layer->dmlp_norm, dz, t->h_mid, t->r2, n, d);
    if (m->modes.ms) op_rmsnorm_ms_backward(be, dy, dz, t->z2, t->r2, n, d);
    else op_rmsnorm_backward(be, dy, dz, t->h_mid, t->r2, layer->mlp_norm, n, d);
}

// Which tiles the MLP's forward or backward of block l makes: the forward over the rows of x (the
// residual stream after attention [N, d]); the backward from m->dres, after recomputing each
// tile's forward from x first where x is given (--recompute block; NULL: the forward's buffers are
// kept). --lora-dropout's masks follow each token's row in the batch, whatever its tile (the
// tile's first row an offset of the shape, row_off, beside the micro-batch's row0).
typedef enum { MLP_FORWARD, MLP_BACKWARD } MlpPass;
static void llama_mlp_tiles(Llama* m, int l, MlpPass pass, void* x, const BlockActs* a, int64_t N) {
    const LlamaLayer* layer = &m->layers[l];
    int64_t row_bytes = (int64_t)m->cfg.dim * m->be->abytes;
    for (int64_t t0 = 0; t0 < N; t0 += m->mlp_tile) {
        int64_t n = N - t0 < m->mlp_tile ? N - t0 : m->mlp_tile;
        BlockActs t = llama_mlp_tile_acts(m, a, t0);
        m->drop.row_off = t0;
        if (x) llama_mlp_forward_tile(m, layer, (char*)x + t0 * row_bytes, &t, n);
        if (pass == MLP_BACKWARD)
            llama_mlp_backward_tile(m, layer, &t, (char*)m->dres + t0 * row_bytes, (char*)m->dz + t0 * row_bytes, n);
    }
    m->drop.row_off = 0;
}

// What block_forward runs: the whole block, or (--recompute block) its attention half, whose
// MLP the backward recomputes tile by tile (llama_mlp_tiles).
typedef enum { BLOCK_WHOLE, BLOCK_ATTENTION } BlockPart;

// One block, updating the residual stream x [B*T, d] in place and filling a's buffers. With a
// cache (generation, B = 1), the T new tokens sit at positions kv->len.., their keys and values
// join the cache and attention reads it.
static void block_forward(Llama* m, int l, void* x, BlockActs* a, int B, int T, const KVCache* kv, BlockPart part) {
    const Backend* be = m->be;
    const LlamaConfig* c = &m->cfg;
    const LlamaLayer* layer = &m->layers[l];
    int64_t N = (int64_t)B * T, d = c->dim;
    int r = m->modes.rank;
    float s = m->modes.lora_scale;
    AttnShape as = {B, T, c->heads, c->kv_heads, c->head_dim, 1, llama_attention_pos(m), llama_attention_docs(m)};
    const void* o_in = a->o;  // the o projection's input (token layout)
    if (a->x_in) op_copy(be, a->x_in, x, N * d);
    op_rmsnorm_forward(be, a->z1, a->r1, x, m->modes.ms ? NULL : layer->attn_norm, N, (int)d, c->norm_eps);
    llama_qk_forward(m, layer, a, T_Q, N, T);
    llama_qk_forward(m, layer, a, T_K, N, T);
    op_linear_forward(be, a->v, a->z1, &layer->lin[T_V], a->ax[T_V], N, r, s, OUT_WRITE);
    if (kv) {
        int64_t kvd = (int64_t)c->kv_heads * c->head_dim, at = (int64_t)kv->len * kvd * be->abytes;
        op_copy(be, (char*)kv->k[l] + at, a->k, N * kvd);
        op_copy(be, (char*)kv->v[l] + at, a->v, N * kvd);
        op_attention_cached(be, a->o, a->q, kv->k[l], kv->v[l], T, kv->len, c->heads, c->kv_heads, c->head_dim);
    } else if (m->sp.P > 1) {  // a->q, k, v, o keep the head layout; o_in is this rank's tokens
        // the attention half is only ever the recomputed forward (llama_recompute_block)
        ExchangePass exchange = part == BLOCK_ATTENTION ? EXCHANGE_RECOMPUTED_FORWARD : EXCHANGE_FORWARD;
        o_in = seqpar_attention_forward(&m->sp, be, a->o, a->lse, a->q, a->k, a->v, llama_seqpar_work(m, exchange),
                                        m->att_work, m->att_work_bytes);
    } else {
        op_attention_forward(be, a->o, a->lse, a->q, a->k, a->v, as,
                             op_attention_work_fitting(be, as, m->att_work, m->att_work_bytes));
    }
    op_linear_forward(be, x, o_in, &layer->lin[T_O], a->ax[T_O], N, r, s, OUT_ADD);
    if (part == BLOCK_WHOLE) llama_mlp_tiles(m, l, MLP_FORWARD, x, a, N);
}

// Embedding and all blocks over the uploaded batch; leaves the final norm's input in m->resid.
// Each part first waits for its weights' all-gather when ZeRO-1 overlaps it with this forward
// (the embedding, head and final norm lie below the first block in the arena).
static void llama_forward_blocks(Llama* m, int B, int T, const KVCache* kv) {
    int64_t N = (int64_t)B * T;
    int layers = m->cfg.layers;
    trainable_weights_ready(&m->tr, 0, m->layer_off[0]);
    op_embed(m->be, m->resid, m->embed, m->inputs, N, m->cfg.dim);
    for (int l = 0; l < layers; l++) {
        trainable_weights_ready(&m->tr, m->layer_off[l], l + 1 < layers ? m->layer_off[l + 1] : m->tr.padded);
        if (m->modes.recompute_block) checkpoint_save(&m->ckpt, m->be, l, m->resid, N * m->cfg.dim);
        block_forward(m, l, m->resid, &m->acts[l], B, T, kv, BLOCK_WHOLE);
    }
}

// ----------------------------------------------------------------------------------------------
// Backward

// Under MS norms, Qwen3's rotated q (t = T_Q) or k (T_K) for attention's backward: RoPE(gamma z) from
// the kept z, as the forward built them.
static void llama_qk_rebuild(Llama* m, const LlamaLayer* layer, BlockActs* a, int t, int64_t N, int T) {
    const LlamaConfig* c = &m->cfg;
    int is_q = t == T_Q, heads = is_q ? c->heads : c->kv_heads;
    void* y = is_q ? a->q : a->k;
    op_scale_columns(m->be, y, is_q ? a->qz : a->kz, is_q ? layer->q_norm : layer->k_norm, N * heads, c->head_dim);
    op_rope(m->be, y, m->rope_cos, m->rope_sin, m->pos, N, T, heads, c->head_dim, ROPE_FORWARD);
}

// The gradient w.r.t. the q (t = T_Q) or k (T_K) projection's output, from dy, the gradient w.r.t.
// the rotated q or k with RoPE already undone: dy itself without Qwen3's norm, else dy through
// the norm into m->dout (free once attention's backward has run; dy is clobbered under MS norms).
static const void* llama_qk_norm_backward(Llama* m, const LlamaLayer* layer, BlockActs* a, int t, void* dy, int64_t N) {
    const Backend* be = m->be;
    const LlamaConfig* c = &m->cfg;
    if (!c->qk_norm) return dy;
    int is_q = t == T_Q;
    int64_t rows = N * (is_q ? c->heads : c->kv_heads);
    const void* gamma = is_q ? layer->q_norm : layer->k_norm;
    const float* r = is_q ? a->rq : a->rk;
    op_zero(be, m->dout, (size_t)rows * c->head_dim * be->abytes);
    if (llama_qk_norm_ms(m)) {  // dz = gamma dy, then the MS backward from z and r
        op_scale_columns(be, dy, dy, gamma, rows, c->head_dim);
        op_rmsnorm_ms_backward(be, m->dout, dy, is_q ? a->qz : a->kz, r, rows, c->head_dim);
    } else {
        const void* pre = is_q ? a->q_pre : a->k_pre;
        float* dgamma = is_q ? layer->dq_norm : layer->dk_norm;
        if (dgamma) op_rmsnorm_gamma_grad(be, dgamma, dy, pre, r, rows, c->head_dim);
        op_rmsnorm_backward(be, m->dout, dy, pre, r, gamma, rows, c->head_dim);
    }
    return m->dout;
}

// The recomputed block (--recompute block) as its backward reads it: its input on the device,
// and the residual stream after its recomputed attention, the MLP's input [N, d].
typedef struct {
    const void* block_input;
    void* mlp_input;
} Recomputed;

// Backpropagates m->dres (gradient w.r.t. the block output) to the block input, in place.
// rc: the recomputed block (NULL: not recomputed; a->x_in, the kept MLP buffers then).
static void block_backward(Llama* m, int l, BlockActs* a, const Recomputed* rc, int B, int T) {
    const Backend* be = m->be;
    const LlamaConfig* c = &m->cfg;
    const LlamaLayer* layer = &m->layers[l];
    int64_t N = (int64_t)B * T, d = c->dim;
    int r = m->modes.rank;
    float s = m->modes.lora_scale;
    AttnShape as = {B, T, c->heads, c->kv_heads, c->head_dim, 1, llama_attention_pos(m), llama_attention_docs(m)};
    const void* x_in = rc ? rc->block_input : a->x_in;
    // MLP, tile by tile: down, SwiGLU (exact or ReSiLU2), gate/up, MLP norm (recomputed first)
    llama_mlp_tiles(m, l, MLP_BACKWARD, rc ? rc->mlp_input : NULL, a, N);
    // attention: o-proj, attention, RoPE, q/k/v, attention norm
    void* sp_work = llama_seqpar_work(m, EXCHANGE_BACKWARD);
    const void* o_in = m->sp.P > 1 ? seqpar_attention_output(&m->sp, a->o, sp_work) : a->o;
    op_linear_backward(be, m->dout, m->dres, o_in, a->ax[T_O], &layer->lin[T_O], m->dax, N, r, s, OUT_WRITE);
    if (llama_qk_norm_ms(m) && !m->modes.recompute_block) {  // (a recomputed block has just built them)
        llama_qk_rebuild(m, layer, a, T_Q, N, T);
        llama_qk_rebuild(m, layer, a, T_K, N, T);
    }
    if (m->sp.P > 1)
        seqpar_attention_backward(&m->sp, be, m->dq, m->dk, m->dv, m->dout, a->q, a->k, a->v, a->o, a->lse,
                                  sp_work, m->att_work);
    else op_attention_backward(be, m->dq, m->dk, m->dv, m->dout, a->q, a->k, a->v, a->o, a->lse, as, m->att_work);
    op_rope(be, m->dq, m->rope_cos, m->rope_sin, m->pos, N, T, c->heads, c->head_dim, ROPE_INVERSE);
    op_rope(be, m->dk, m->rope_cos, m->rope_sin, m->pos, N, T, c->kv_heads, c->head_dim, ROPE_INVERSE);
    op_linear_backward(be, m->dz, llama_qk_norm_backward(m, layer, a, T_Q, m->dq, N), a->z1, a->ax[T_Q],
                       &layer->lin[T_Q], m->dax, N, r, s, OUT_WRITE);
    op_linear_backward(be, m->dz, llama_qk_norm_backward(m, layer, a, T_K, m->dk, N), a->z1, a->ax[T_K],
                       &layer->lin[T_K], m->dax, N, r, s, OUT_ADD);
    op_linear_backward(be, m->dz, m->dv, a->z1, a->ax[T_V], &layer->lin[T_V], m->dax, N, r, s, OUT_ADD);
    if (layer->dattn_norm) op_rmsnorm_gamma_grad(be, layer->dattn_norm, m->dz, x_in, a->r1, N, (int)d);
    if (m->modes.ms) op_rmsnorm_ms_backward(be, m->dres, m->dz, a->z1, a->r1, N, (int)d);
    else op_rmsnorm_backward(be, m->dres, m->dz, x_in, a->r1, layer->attn_norm, N, (int)d);
}

// --recompute block: block l's attention activations rebuilt from its checkpoint by the same
// forward (so the same bits); its MLP's are rebuilt tile by tile in the backward. Returns the
// checkpoint on the device, which the backward of standard norms reads (the forward then runs on
// a copy; under MS norms in place), and the MLP's input.
static Recomputed llama_recompute_block(Llama* m, int l, int B, int T) {
    int64_t N = (int64_t)B * T;
    void* x = checkpoint_input(&m->ckpt, l);
    void* stream = x;
    if (!m->modes.ms) {
        op_copy(m->be, m->resid_tmp, x, N * m->cfg.dim);
        stream = m->resid_tmp;
    }
    block_forward(m, l, stream, &m->acts[l], B, T, NULL, BLOCK_ATTENTION);
    Recomputed rc = {x, stream};
    return rc;
}

static void llama_backward_blocks(Llama* m, int B, int T) {
    int layers = m->cfg.layers;
    checkpoints_prefetch_last(&m->ckpt, layers);  // (--offload host)
    for (int l = layers - 1; l >= 0; l--) {
        Recomputed rc = {};
        if (m->modes.recompute_block) rc = llama_recompute_block(m, l, B, T);
        block_backward(m, l, &m->acts[l], m->modes.recompute_block ? &rc : NULL, B, T);
        checkpoints_prefetch_below(&m->ckpt, l);  // (--offload host) into this block's staging buffer
        trainable_grads_final_from(&m->tr, m->dist, m->layer_off[l]);  // this block's are final
    }
}

// The final norm and the head, with their gradients under --full, as the loss reads them.
static LmHead llama_lm_head(const Llama* m) {
    LmHead h = {m->final_norm, m->cfg.norm_eps, m->lm_head,  m->cfg.vocab,  m->cfg.dim,
                m->loss_chunk, &m->loss,        m->dlm_head, m->dfinal_norm};
    return h;
}

// One micro-batch (already uploaded): forward, fused head + loss (+ its gradient), backward. LoRA
// grads accumulate. grad_scale = 1 / (unmasked tokens in the whole optimizer step). logits_out
// (backend memory, fp32 [B*T, V]): tests and generation only. step_stats (CUDA, or NULL): the loss
// statistics are added there on the device and the returned LossStats stay zero (llmc/ops.h).
static LossStats llama_forward_backward(Llama* m, int B, int T, float grad_scale, int backward, float* logits_out,
                                        double* step_stats) {
    batch_values_check(&m->bv, grad_scale, backward, &m->drop, "llama_upload_batch");
    int64_t N = (int64_t)B * T;
    const LlamaConfig* c = &m->cfg;
    llama_forward_blocks(m, B, T, NULL);
    LossStats st = {};
    if (backward) op_zero(m->be, m->dres, (size_t)N * c->dim * m->be->abytes);
    LmHead head = llama_lm_head(m);
    LmHeadCall call = {m->resid, N, m->targets, m->mask, grad_scale, backward ? m->dres : NULL, logits_out, step_stats,
                       m->bv.grad_scale};
    op_lm_head_loss(m->be, &head, &call, &st);
    if (!backward) return st;
    llama_backward_blocks(m, B, T);
    if (m->dembed)
        op_embedding_backward(m->be, m->dembed, m->dres, m->inputs, m->embed_order, N,
                              c->dim);  // dres: d loss / d embeddings
    return st;
}

#ifdef LLMC_HAVE_CUDA
// Once per model, at its first training step: whether LLMC_CUDA_GRAPH=1 can be honoured (said in
// one line): what the micro-batch holds that no capture can (llmc/cuda/graph.cuh).
static void llama_graph_decide(Llama* m, const Dist* dist) {
    GraphHazards h = {!m->be->stream, !trainable_step_stats(&m->tr), dist_sums_grads(dist) || m->sp.P > 1,
                      m->modes.offload_host, m->drop_work && !m->bv.drop_at};
    if (m->be->cuda) cuda_graph_decide(&m->graph, &h, !dist || dist->rank == 0);
    m->graph.decided = 1;
}

// What the captured forward + backward depends on besides device memory (llmc/cuda/graph.cuh): the
// shape and attention's document mask pick the work (on cuDNN's ragged path also its batch of
// documents and their sequence dimension, which pick cuDNN's plan); the loss scale, where it is a
// kernel argument (LLMC_LOSS_SCALE=args; by default the kernels read it from device memory); the GEMM
// attention path's pointer tables are a host-side cache (a rebuild since the capture means the
// captured work assumes other contents). --lora-dropout's key is not in it: its per-micro-batch
// part is read from device memory (m->bv; under LLMC_DROPOUT_KEY=args the graph is refused).
static CudaGraphKey llama_graph_key(const Llama* m, int B, int T, float grad_scale) {
    CudaGraphKey k;
    memset(&k, 0, sizeof(k));
    k.shape[0] = B;
    k.shape[1] = T;
    k.shape[2] = m->pos_restarts;
    const AttnDocs* docs = llama_attention_docs(m);  // cuDNN's ragged plan: its batch and sequence dimension
    k.shape[3] = docs && !docs->why ? (int64_t)docs->batch << 32 | docs->max_len : 0;
    uint32_t bits;
    memcpy(&bits, &grad_scale, sizeof(bits));
    k.values[0] = m->bv.grad_scale ? 0 : bits;  // read from device memory, it changes nothing captured
    k.values[1] = g_attn_tables.builds;
    // the planted bug of a stale graph (test/cuda/test_llama_cuda.py, under LLMC_LOSS_SCALE=args): the
    // scale left out of the key, so a step whose scale changed replays the kernels captured with the old one
    if (backend_switch_is("LLMC_FAULT_GRAPH_KEY", "1")) k.values[0] = 0;
    return k;
}
#endif

// One training micro-batch (already uploaded): forward, head + loss, backward, the loss statistics
// added into step_stats on the device (CUDA; NULL: returned). With a CUDA graph (LLMC_CUDA_GRAPH=1)
// the work is run eagerly the first time its shape is seen, captured the next time (or whenever its
// key changes), and replayed with one launch after that.
static LossStats llama_train_micro_batch(Llama* m, int B, int T, float grad_scale, double* step_stats) {
#ifdef LLMC_HAVE_CUDA
    CudaGraph* g = &m->graph;
    CudaGraphKey key = llama_graph_key(m, B, T, grad_scale);
    GraphStep what = g->on ? cuda_graph_next(g, &key) : GRAPH_EAGER;
    if (what != GRAPH_EAGER) {
        if (what == GRAPH_CAPTURE) {
            int profiling = prof_pause(m->be->prof);  // its events would be captured too
            cuda_graph_capture_begin(g, m->be->stream);
            llama_forward_backward(m, B, T, grad_scale, 1, NULL, step_stats);
            CudaGraphKey after = llama_graph_key(m, B, T, grad_scale);  // the host caches the capture filled
            cuda_graph_capture_end(g, m->be->stream, &after);
            prof_resume(m->be->prof, profiling);
        }
        PROF_SCOPE(m->be, "forward + backward graph", "f+b", 0.0, 0.0);
        cuda_graph_launch(g, m->be->stream);
        LossStats none = {};
        return none;  // the statistics are in step_stats
    }
#endif
    return llama_forward_backward(m, B, T, grad_scale, 1, NULL, step_stats);
}

// ----------------------------------------------------------------------------------------------
// Training step, evaluation, generation

static double count_mask(const float* mask, int64_t n) {
    double s = 0.0;
    for (int64_t i = 0; i < n; i++) s += mask[i];
    return s;
}

// One optimizer step over grad_accum micro-batches on every rank. The loss is normalised by the
// unmasked tokens of the whole global step, counted before any forward pass, so accumulation and
// data parallelism both equal one big batch; gradients are summed across ranks before clipping,
// so the norm is the global one and every rank applies the same update.
// Under --seq-parallel each group of P ranks reads the same micro-batches (data parallelism runs
// across groups) and each rank trains its slice; the mask is counted on the slices, so the sum
// over the world is still every target of the global step.
static StepResult llama_train_step(Llama* m, TextLoader* loader, const TrainOptions* o, const Dist* dist, int step) {
    int B = m->B, K = o->grad_accum;
    int64_t N = m->sp.N, n = m->sp.n;  // the whole micro-batch's tokens, this rank's (N without --seq-parallel)
    int* in_all = (int*)xmalloc(sizeof(int) * N * K);
    int* tg_all = (int*)xmalloc(sizeof(int) * N * K);
    float* mk_all = (float*)xmalloc(sizeof(float) * N * K);
    int* pos_all = (int*)xmalloc(sizeof(int) * N * K);
    ProfMark pd = prof_start(m->be->prof);
    for (int k = 0; k < K; k++)
        loader_next(loader, B, dist_dp_rank(dist), dist_dp_world(dist), in_all + k * N, tg_all + k * N,
                    mk_all + k * N, pos_all + k * N);
    prof_stop(m->be->prof, pd, "data", "step", 0.0, (double)N * K * 13);
    double total = 0.0;
    for (int k = 0; k < K; k++) total += count_mask(mk_all + k * N + m->sp.g * n, n);
    dist_allreduce_sum_f64(dist, &total, 1);
    float scale = total > 0 ? (float)(1.0 / total) : 0.0f;
    batch_values_set_loss_scale(&m->bv, scale);  // uploaded with each micro-batch below
    trainable_zero_grads(&m->tr);
#ifdef LLMC_HAVE_CUDA
    if (!m->graph.decided) llama_graph_decide(m, dist);
#endif
    m->drop.step = (uint64_t)step;
    double sums[2] = {0.0, 0.0};  // loss, final-norm rows that overflowed (health.h)
    for (int k = 0; k < K; k++) {
        if (k == K - 1) trainable_buckets_begin(&m->tr, dist);  // the last backward sends buckets as they finish
        int64_t first = seqpar_slice(&m->sp, in_all + k * N, tg_all + k * N, mk_all + k * N, pos_all + k * N,
                                     m->h_inputs, m->h_targets, m->h_mask, m->h_pos);
        // dropout is keyed by the global token: the slice's first row in the step's batch (uploaded
        // with the batch where the kernels read it from device memory)
        m->drop.row0 = lora_dropout_row0(k, dist_dp_rank(dist), dist_dp_world(dist), N) + first;
        llama_upload_batch(m, n);
        m->drop.active = 1;  // training only: evaluation and generation see the adapters' whole input
        // on CUDA the loss stays on the device until the step's one readback (llmc/train/zero.h)
        LossStats st = llama_train_micro_batch(m, B, m->T, scale, trainable_step_stats(&m->tr));
        m->drop.active = 0;
        sums[0] += st.loss_sum;
        sums[1] += st.overflowed;
    }
    free(in_all); free(tg_all); free(mk_all); free(pos_all);
    PROF_SCOPE(m->be, "optimizer", "step", 0.0, 0.0);  // gradient all-reduce, clipping and AdamW
    return train_step_finish(&m->tr, o, dist, step, sums, 2, total, (double)N * K * dist_dp_world(dist), m->cfg.vocab);
}

// Model FLOPs of one token's forward and backward at sequence length T: every linear layer
// (linear_train_flops) and the head, plus causal attention, 6 T q_dim per layer (QK^T, PV and
// their four backward products, halved by the mask). The convention of scripts/bench/bench_gpu.sh.
static double llama_flops_per_token(const Llama* m) {
    const LlamaConfig* c = &m->cfg;
    int full = m->modes.full;
    double f = 0.0;
    for (int t = 0; t < N_TARGETS; t++)
        f += c->layers * linear_train_flops(lin_in(c, t), lin_out(c, t), full,
                                            !full && (m->modes.targets >> t & 1) ? m->modes.rank : 0);
    f += linear_train_flops(c->dim, c->vocab, full, 0);
    f += c->layers * 6.0 * m->sp.T * c->heads * c->head_dim;
    return f;
}

// Mean loss over one pass of the validation windows up to `batches` micro-batches hold, each window
// once, the last batch partial (textdata.h's loader_eval_batch; under --seq-parallel each rank its
// slice of each, summed over the group).
static float llama_evaluate(Llama* m, const TextLoader* loader, int batches) {
    double sums[2] = {0.0, 0.0};  // loss, targets
    int64_t N = m->sp.N, windows = loader_eval_windows(loader, m->B, batches);
    int* in = (int*)xmalloc(sizeof(int) * N * 3);  // inputs, targets, positions of the whole micro-batch
    float* mk = (float*)xmalloc(sizeof(float) * N);
    for (int64_t i = 0; i < loader_eval_batches(loader, m->B, batches); i++) {
        loader_eval_batch(loader, windows, i, m->B, in, in + N, mk, in + 2 * N);
        seqpar_slice(&m->sp, in, in + N, mk, in + 2 * N, m->h_inputs, m->h_targets, m->h_mask, m->h_pos);
        llama_upload_batch(m, m->sp.n);
        LossStats st = llama_forward_backward(m, m->B, m->T, 0.0f, 0, NULL, NULL);
        sums[0] += st.loss_sum;
        sums[1] += st.count;
    }
    free(in);
    free(mk);
    dist_sp_allreduce_sum_f64(m->dist, sums, 2);
    return (float)(sums[0] / sums[1]);  // > 0 targets: loader_require_eval_targets at start-up
}

static int sample_token(const float* logits, int V, float temperature, Rng* rng) {
    int best = 0;
    for (int v = 1; v < V; v++) if (logits[v] > logits[best]) best = v;
    if (temperature <= 0.0f) return best;
    double sum = 0.0;
    for (int v = 0; v < V; v++) sum += exp((logits[v] - logits[best]) / temperature);
    double u = rng_uniform(rng) * sum, acc = 0.0;
    for (int v = 0; v < V; v++) {
        acc += exp((logits[v] - logits[best]) / temperature);
        if (acc >= u) return v;
    }
    return V - 1;
}

// Samples n tokens after the prompt with a key/value cache: the prompt is fed once, then one
// token per step. The trainer's buffers hold one sequence of m->T tokens (the window); when the
// cache is full, it restarts from the last half window (positions then count from there).
// LLMC_NO_KV_CACHE=1 recomputes the whole window for every token instead (tests compare the two).
// The cache and the logits are buffers of the plan (TrainModes.generate).
// chat: prompt is a rendered chat template, fed as it stands (no BOS added).
static void llama_generate(Llama* m, const ModelTokenizer* tok, const char* prompt, int chat, int n, float temperature,
                           uint64_t seed) {
    const LlamaConfig* c = &m->cfg;
    const Backend* be = m->be;
    int len, window = m->T;
    int* prompt_ids =
        chat ? model_tokenizer_encode_plain(tok, prompt, &len) : model_tokenizer_encode(tok, prompt, &len);
    if (len == 0)
        fail(chat ? "flag --chat: the chat template rendered nothing to start from"
                  : "flag --prompt: empty, and the tokenizer adds no BOS to start from");
    int* ids = (int*)xmalloc(sizeof(int) * (len + n));
    memcpy(ids, prompt_ids, sizeof(int) * len);
    free(prompt_ids);
    const char* nc = getenv("LLMC_NO_KV_CACHE");
    int recompute = nc && strcmp(nc, "1") == 0;
    int64_t d = c->dim;
    if (!m->modes.generate) fail("internal: llama_generate needs a plan made with TrainModes.generate");
    KVCache kv = {m->kv_k, m->kv_v, 0, window};
    float* logits = m->gen_logits;
    float* last = (float*)xmalloc(sizeof(float) * c->vocab);
    Rng rng = rng_seeded(seed, 99);
    char bb[2];
    printf("%s", prompt);
    int fed = 0;  // ids[0, fed) are in the cache
    for (int i = 0; i < n; i++) {
        if (recompute || kv.len + (len - fed) > window) {  // (re)start the window
            kv.len = 0;
            int keep = recompute ? window : window / 2 > 0 ? window / 2 : 1;  // a window of 1 keeps its 1 token
            fed = len - keep;
            if (fed < 0) fed = 0;
        }
        int T = len - fed;
        for (int t = 0; t < T; t++) {
            m->h_inputs[t] = ids[fed + t];
            m->h_targets[t] = 0;
            m->h_mask[t] = 0.0f;
            m->h_pos[t] = kv.len + t;
        }
        llama_upload_batch(m, T);
        llama_forward_blocks(m, 1, T, &kv);
        kv.len += T;
        fed = len;
        LossStats st = {};  // the head on the last token only
        LmHead head = llama_lm_head(m);
        head.chunk = 1;
        head.dW = head.dgamma = NULL;
        LmHeadCall call = {
            (char*)m->resid + (int64_t)(T - 1) * d * be->abytes, 1, m->targets, m->mask, 0.0f, NULL, logits, NULL,
            NULL};
        op_lm_head_loss(be, &head, &call, &st);
        backend_download(be, last, logits, sizeof(float) * c->vocab);
        int next = sample_token(last, c->vocab, temperature, &rng);
        if (model_tokenizer_ends(tok, next)) break;
        printf("%s", model_tokenizer_decode(tok, ids[len - 1], next, bb));
        fflush(stdout);
        ids[len++] = next;
    }
    printf("\n");
    free(ids);
    free(last);
}

// ----------------------------------------------------------------------------------------------
// Adapters and training state

// The gamma that MS-RMSNorm merged into linear t of layer l, or NULL (standard norms, o, down).
static const float* llama_merged_gamma(const Llama* m, int l, int t) {
    if (!m->modes.ms) return NULL;
    const float* g = m->gamma_host + 2 * (int64_t)l * m->cfg.dim;
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

// The PEFT view of the adapters: Hugging Face module paths; under --ms-lora merged, layers merged
// with an MS norm carry that norm's gamma so the adapter is mapped back to (and from) the original
// model's layout.
static int llama_peft_entries(Llama* m, PeftEntry* e) {
    int n = 0;
    for (int l = 0; l < m->cfg.layers; l++)
        for (int t = 0; t < N_TARGETS; t++)
            n = peft_add_entry(e, n, &m->layers[l].lin[t], "model.layers", l, hf_module_names[t],
                               llama_adapter_gamma(m, l, t));
    return n;
}

static void llama_save_adapter(Llama* m, const char* dir, const TrainOptions* o) {
    trainable_to_host(&m->tr, 0);
    PeftEntry* e = (PeftEntry*)xcalloc(m->cfg.layers * N_TARGETS, sizeof(PeftEntry));
    int n = llama_peft_entries(m, e);
    const char* tm[N_TARGETS];
    int ntm = 0;
    for (int t = 0; t < N_TARGETS; t++) if (m->modes.targets >> t & 1) tm[ntm++] = strchr(hf_module_names[t], '.') + 1;
    peft_save(dir, e, n, NULL, 0, m->modes.rank, o->lora_alpha, o->lora_rslora, o->lora_dropout, "CAUSAL_LM",
              o->model_dir, tm, ntm, NULL);
    free(e);
}

// --adapter: the LoRA pairs only (no biases, no whole modules: PEFT bias "none", no modules_to_save).
static void llama_load_adapter(Llama* m, const char* dir, const TrainOptions* o) {
    PeftEntry* e = (PeftEntry*)xcalloc(m->cfg.layers * N_TARGETS, sizeof(PeftEntry));
    int n = llama_peft_entries(m, e);
    static const char* const bias_modes[] = {"none", NULL};
    PeftReads reads = {NULL, NULL, bias_modes, 0};
    peft_load(dir, e, n, m->modes.rank, o->lora_alpha, o->lora_rslora, &reads);
    free(e);
    trainable_to_device(&m->tr);
}

// The adapted Linear whose Hugging Face weight is `name`, or NULL.
static const Linear* llama_linear_named(Llama* m, const char* name, int* layer, int* target) {
    char buf[256];
    for (int l = 0; l < m->cfg.layers; l++)
        for (int t = 0; t < N_TARGETS; t++) {
            snprintf(buf, sizeof(buf), "model.layers.%d.%s.weight", l, hf_module_names[t]);
            if (strcmp(buf, name) == 0) { *layer = l; *target = t; return &m->layers[l].lin[t]; }
        }
    return NULL;
}

// Under --full, the host mirror of the trained non-linear weight whose Hugging Face name is
// `name` (embedding, head, final norm, block norms under standard norms, Qwen3's q/k norms, the
// linears' biases), or NULL.
static const float* llama_trained_tensor(const Llama* m, const char* name) {
    if (!m->modes.full) return NULL;
    if (!strcmp(name, "model.embed_tokens.weight")) return m->h_embed;
    if (!strcmp(name, "model.norm.weight")) return m->h_final_norm;
    if (!strcmp(name, "lm_head.weight")) return m->cfg.tied ? NULL : m->h_lm_head;
    char buf[128];
    for (int l = 0; l < m->cfg.layers; l++) {
        snprintf(buf, sizeof(buf), "model.layers.%d.input_layernorm.weight", l);
        if (!strcmp(name, buf)) return m->layers[l].h_attn_norm;
        snprintf(buf, sizeof(buf), "model.layers.%d.post_attention_layernorm.weight", l);
        if (!strcmp(name, buf)) return m->layers[l].h_mlp_norm;
        snprintf(buf, sizeof(buf), "model.layers.%d.self_attn.q_norm.weight", l);
        if (!strcmp(name, buf)) return m->layers[l].h_q_norm;
        snprintf(buf, sizeof(buf), "model.layers.%d.self_attn.k_norm.weight", l);
        if (!strcmp(name, buf)) return m->layers[l].h_k_norm;
        for (int t = 0; t < N_TARGETS; t++) {  // biases, where the model has them (L->bias: the host mirror)
            snprintf(buf, sizeof(buf), "model.layers.%d.%s.bias", l, hf_module_names[t]);
            if (!strcmp(name, buf)) return m->layers[l].lin[t].dbias ? m->layers[l].lin[t].bias : NULL;
        }
    }
    return NULL;
}

// An NF4 linear of the export, as PEFT merges a 4-bit model: the dequantized W (a bitsandbytes
// checkpoint's own, or under --quant nf4 the NF4 copy the run used with the MS merge undone) plus
// alpha/r B A, in bf16 for a bitsandbytes input, else in the input tensor's dtype. Added to the
// writer under t's name; returns the buffer (the writer's until it is saved).
static void* llama_export_nf4_linear(Llama* m, const StModel* sm, int from_bnb, int l, int tg, const StTensor* t,
                                     StWriter* w) {
    const Linear* L = &m->layers[l].lin[tg];
    int64_t n = (int64_t)L->out * L->in, shape[2] = {L->out, L->in};
    float* W = (float*)xmalloc(sizeof(float) * n);
    if (from_bnb) {
        BnbWeight bw = bnb_read(sm, t->name, L->out, L->in);
        bnb_dequantize(&bw, W);
        bnb_free(&bw);
    } else {
        llama_linear_weights_f32(m, L, W);
        peft_scale_columns(W, W, llama_merged_gamma(m, l, tg), L->out, L->in, 1, t->name);
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
    trainable_to_host(&m->tr, 0);
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
            int l = 0, tg = 0;
            const Linear* L = llama_linear_named(m, t->name, &l, &tg);
            const float* trained = llama_trained_tensor(m, t->name);
            if (trained) {  // --full: embedding, head or a norm, as trained
                owned[k] = xmalloc(st_dtype_size(t->dtype) * st_numel(t));
                f32_to_dtype(owned[k], trained, st_numel(t), t->dtype);
                st_writer_add(&w, t->name, t->dtype, t->ndim, t->shape, owned[k++]);
                continue;
            }
            if (bnb && bnb_is_quant_state_name(t->name)) continue;  // the export is dequantized
            if (L && !L->dW &&
                (L->nf4 || (bnb && t->dtype == ST_U8))) {  // NF4: bf16 (or the input's dtype), dequantized
                owned[k] = llama_export_nf4_linear(m, &sm, bnb && t->dtype == ST_U8, l, tg, t, &w);
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

// Everything a resumed run must share with the saved one, as "key=value" words (rslora=1 last and only
// when set, so that states saved before the flag existed still match).
static void llama_settings_line(char* buf, size_t n, const Llama* m, const TrainOptions* o, const Dist* d,
                                int64_t data_tokens) {
    const LlamaConfig* c = &m->cfg;
    snprintf(buf, n,
             "d=%d f=%d layers=%d heads=%d kv_heads=%d vocab=%d full=%d act=%s norm=%s ms_lora=%s recompute=%s rank=%d "
             "alpha=%g targets=0x%x "
             "lora_dropout=%g batch=%d seq=%d grad_accum=%d world=%d steps=%d lr=%g warmup=%d min_lr_frac=%g "
             "weight_decay=%g grad_clip=%g seed=%d data_tokens=%lld quant=%s%s",
             c->dim, c->hidden, c->layers, c->heads, c->kv_heads, c->vocab, o->full, o->act, o->norm, o->ms_lora,
             o->recompute, o->lora_rank, o->lora_alpha, m->modes.targets, o->lora_dropout, o->batch, o->seq,
             o->grad_accum, d->world, o->steps, o->lr, o->warmup, o->min_lr_frac, o->weight_decay, o->grad_clip,
             o->seed, (long long)data_tokens, o->quant, o->lora_rslora ? " rslora=1" : "");
    if (dist_sp(d) > 1) str_appendf(buf, n, " seq_parallel=%d", dist_sp(d));  // the data order follows world / P
}

// ----------------------------------------------------------------------------------------------
// main

typedef struct {           // what a run reads besides the model
    TokenShard train, val;
    TextLoader tl, vl;
    int have_train, have_val;
} RunData;

static void run_data_open(RunData* rd, const TrainOptions* o, int vocab) {
    memset(rd, 0, sizeof(*rd));
    if (o->data_path) {
        shard_load(&rd->train, o->data_path, vocab);
        loader_init(&rd->tl, &rd->train, o->seq, (uint64_t)o->seed, 1);
        rd->have_train = 1;
    }
    if (o->val_path) {
        shard_load(&rd->val, o->val_path, vocab);
        loader_init(&rd->vl, &rd->val, o->seq, (uint64_t)o->seed, 0);
        loader_require_eval_targets(&rd->vl, o->batch, o->val_batches);
        rd->have_val = 1;
    }
}

static void run_data_close(RunData* rd) {
    if (rd->have_train) { loader_free(&rd->tl); shard_free(&rd->train); }
    if (rd->have_val) { loader_free(&rd->vl); shard_free(&rd->val); }
}

// --dry-run --json: the run's settings as the fields of a JSON object, into buf (plan_json writes them).
static void llama_settings_json(char* buf, size_t n, const TrainOptions* o, const char* device) {
    snprintf(buf, n, "\"model\": \"llama\", \"device\": \"%s\", \"mode\": \"%s\", \"act\": \"%s\", \"norm\": \"%s\", "
             "\"recompute\": \"%s\", \"batch\": %d, \"seq\": %d, \"lora_rank\": %d, \"lora_dropout\": %g, "
             "\"quant\": \"%s\", \"offload\": \"%s\"",
             device, o->mode, o->act, o->norm, o->recompute, o->batch, o->seq, o->lora_rank, o->lora_dropout, o->quant,
             o->offload);
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
    if (md.mlp_tile == MLP_TILE_AUTO && N <= INT_MAX) md.mlp_tile = llama_mlp_candidate(N, llama_mlp_most_tiles(N));
    if (md.offload_host && md.offload_staging == OFFLOAD_STAGING_AUTO) md.offload_staging = 1;
    md.head_chunk_small = 1;
    return md;
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
    if (!o->max_seq && !(o->gpu_mem > 0)) return o->seq;
    FitBudget budget = fit_budget(o, be->cuda, o->max_seq ? "--max-seq" : "--gpu-mem");
    int P = dist_sp(ranks);
    LlamaSeqPlanCtx ctx = {{cfg, be, ranks, o->seq, budget.bytes}, ranks->world, P};
    int seq = o->seq, most = 0;
    char a[32], b[32];
    if (o->max_seq) {
        most = 1 << 30;  // train_validate's bound on --seq; a sliding window bounds it further
        if (cfg->sliding_window && cfg->sliding_window < most) most = cfg->sliding_window;
        most = most / P * P;  // --seq-parallel P: a multiple of P (seqpar_check)
        if (!most) fail("flag --max-seq: the sliding window (%d) is shorter than --seq-parallel %d",
                        cfg->sliding_window, P);
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
    // max_seq_bound: the search stopped at its bound (--seq's limit or the sliding window), not at the memory
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
                 bound ? "; the search's bound: --seq's limit or the sliding window" : "");
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
    if (m->modes.offload_host)  // two unless the memory holds one only (llama_fit_to_memory)
        str_appendf(buf, n, "\noffload: %d device staging buffer%s of one block input%s", m->ckpt.offload.slots,
                    m->ckpt.offload.slots == 1 ? "" : "s",
                    m->ckpt.offload.slots == 1 ? " (the copies do not overlap the compute)" : "");
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
    if (ranks.world > 1) str_appendf(header, sizeof(header), ", one of %d ranks", ranks.world);
    if (dist_sp(&ranks) > 1) str_appendf(header, sizeof(header), " (%d per sequence)", dist_sp(&ranks));
    if (*fit_line) str_appendf(header, sizeof(header), "\n%s", fit_line);
    llama_tile_line(header, sizeof(header), &m, o, &given, &md);
    str_appendf(json, sizeof(json), ", \"mlp_tile\": %lld, \"offload_staging\": %d", (long long)m.mlp_tile,
                m.modes.offload_host ? m.ckpt.offload.slots : 0);
    train_dry_run_report(o, &m.plan, &base.plan, &be, json, header);
    llama_free(&m);
    llama_free(&base);
    return o->seq;
}

// What train_run drives (llmc/train/loop.h): the model and the data it trains and validates on.
typedef struct {
    Llama* m;
    RunData* rd;
} LlamaRun;

static StepResult llama_run_step(void* run, const TrainOptions* o, const Dist* dist, int step) {
    LlamaRun* r = (LlamaRun*)run;
    return llama_train_step(r->m, &r->rd->tl, o, dist, step);
}

static EvalResult llama_run_evaluate(void* run, int batches) {
    LlamaRun* r = (LlamaRun*)run;
    EvalResult e = {llama_evaluate(r->m, &r->rd->vl, batches), NAN, 0};
    return e;
}

static void llama_run_save_adapter(void* run, const TrainOptions* o, const char* dir) {
    llama_save_adapter(((LlamaRun*)run)->m, dir, o);
}

static void llama_run_export(void* run, const TrainOptions* o, const char* dir) {
    llama_export_merged(((LlamaRun*)run)->m, o, dir);
}

static void llama_print_start(void* run, const TrainOptions* o, const char* what, const char* where) {
    const Llama* m = ((LlamaRun*)run)->m;
    const LlamaConfig* c = &m->cfg;
    printf(
        "train_llama: %s | d=%d f=%d layers=%d heads=%d/%d vocab=%d | act=%s norm=%s recompute=%s | %s (%lld "
        "trainable) "
        "| %s\n",
        o->model_dir, c->dim, c->hidden, c->layers, c->heads, c->kv_heads, c->vocab, o->act, o->norm, o->recompute,
        what, (long long)m->tr.count, where);
}

// The model as the shared training loop sees it.
static void llama_trainer(Trainer* t, LlamaRun* run, const TrainOptions* o, const Dist* dist) {
    Llama* m = run->m;
    memset(t, 0, sizeof(*t));
    t->model = run;
    t->unit = "tok";
    t->items = "tokens";
    t->flops_per_item = llama_flops_per_token(m);
    t->tr = &m->tr;
    t->plan = &m->plan;
    t->be = m->be;
    t->full = m->modes.full;
    t->have_val = run->rd->have_val;
    t->cursor = &run->rd->tl.cursor;
    if (run->rd->have_train) t->data_fingerprint = shard_fingerprint(&run->rd->train);
    llama_settings_line(t->settings, sizeof(t->settings), m, o, dist, run->rd->train.count);
    t->step = llama_run_step;
    t->evaluate = llama_run_evaluate;
    t->save_adapter = llama_run_save_adapter;
    t->export_merged = llama_run_export;
    t->print_start = llama_print_start;
}

// --seq beyond max_position_embeddings is a warning, not an error: RoPE is defined at every
// position and training past the pretrained context is how long-context fine-tunes are made, but
// a user who did not mean it should hear that quality may drop. Printed once the run has passed
// every input check, so that a bad input still ends in exactly one line.
static void llama_warn_seq(const LlamaConfig* c, const TrainOptions* o) {
    if ((o->data_path || o->eval_only || o->dry_run) && o->seq > c->max_seq)
        fprintf(
            stderr,
            "warning: flag --seq: %d exceeds max_position_embeddings %d of %s/config.json (positions beyond it were "
            "not pretrained; RoPE extends to them, but quality may drop)\n",
            o->seq, c->max_seq, o->model_dir);
}

static void llama_flags(FlagTable* t, TrainOptions* o) {
    t->program = "train_llama";
    t->usage =
        "--model DIR [--data TRAIN.bin --val VAL.bin] [flags]   (fine-tunes a LLaMA-family model: LoRA, or every "
        "weight with --full)";
    train_flags_register(t, o, "comma list of q,k,v,o,gate,up,down (default all)");
    t->group = "memory modes (the paper's layers)";
    flag_choice(t, "swiglu-product", &o->swiglu_product, "keep|recompute",
                "keep the down projection's input, or rebuild it from silu(g)*u in backward (beyond the paper)");
    flag_choice(t, "offload", &o->offload, "none|host",
                "with --recompute block: the block checkpoints in pinned host memory, copied beside the compute");
    flag_string(t, "mlp-tile", &o->mlp_tile,
                "tokens per tile of the MLP and its norm: auto (the largest equal tile, a multiple of 64 or the "
                "whole sequence, whose plan fits the memory the fit check takes; in a dry run --gpu-mem or "
                "--max-seq's; where none fits or none is known, equal tiles of at most 8192), 0 (the whole "
                "sequence) or a count; the wide intermediates not kept exist for one tile");
    o->seq_parallel = 1;
    flag_int(t, "seq-parallel", &o->seq_parallel,
             "ranks per sequence: each holds 1/P of every sequence's tokens, attention exchanges heads (DeepSpeed "
             "Ulysses); P divides the ranks, --seq and the heads, and divides or is a multiple of the key/value "
             "heads (fewer than P are replicated) (LoRA)");
    t->group = "model and data";
    flag_string(
        t, "export-merged", &o->export_merged,
        "after training (or alone, with --adapter), write the model with the adapter folded in to this directory");
    t->group = "memory modes (the paper's layers)";
    flag_choice(t, "quant", &o->quant, "none|nf4",
                "frozen linear weights: as read (bf16 on CUDA, fp32 on the CPU), or QLoRA's NF4 with double "
                "quantization (after the MS merge)");
    t->group = "system";
    flag_bool(t, "max-seq", &o->max_seq,
              "with --dry-run: plan the longest --seq (at --batch) whose plan fits the memory, found by planning "
              "(with --mlp-tile auto's tile at each length; with --seq-parallel P, one rank's share, multiples of P)");
    flag_float(t, "gpu-mem", &o->gpu_mem,
               "with --dry-run: plan for a card of this many GiB (> 0) the run may take; not given: the free "
               "memory of the GPU present");
}

#ifndef TESTING
int main(int argc, char** argv) {
    Dist dist;
    TrainOptions o;
    train_start(&dist, &o, &argc, &argv, llama_flags);
    LlamaConfig cfg;
    llama_config_load(&cfg, o.model_dir);
    train_check_lora_rank(&o, cfg.dim, o.model_dir);
    TrainModes md = train_modes_from(&o, target_names, N_TARGETS);
    TrainOptions sp_checked = o;
    if (o.dry_run && o.max_seq) sp_checked.seq = o.seq_parallel;  // --max-seq searches multiples of P instead
    seqpar_check(&sp_checked, cfg.heads, cfg.kv_heads, cfg.qk_norm);
    if (o.dry_run) {
        if (!o.max_seq) llama_check_window(&cfg, o.seq, o.model_dir, "flag --seq");
        if (dist.rank == 0) {
            TrainOptions planned = o;
            planned.seq = llama_dry_run(&cfg, &o, md, &dist);
            llama_warn_seq(&cfg, &planned);
        }
        dist_finalize(&dist);
        return 0;
    }
    if (!o.data_path && !o.generate && !o.eval_only && !o.export_merged)
        fail(
            "nothing to do: give --data to train, --val with --eval-only, --generate N to sample, or --export-merged "
            "DIR");
    train_prepare_run(&o, dist.rank);
    dist_seq_parallel_init(&dist, o.seq_parallel);

    RunData rd;
    run_data_open(&rd, &o, cfg.vocab);
    ModelTokenizer tok;
    char* chat_prompt = NULL;
    if (o.generate) model_tokenizer_load(&tok, o.model_dir, cfg.vocab, cfg.eos_id);
    if (o.chat) chat_prompt = model_tokenizer_chat(&tok, o.model_dir, o.system, o.prompt);

    Backend be;
    Profiler prof;
    train_backend_open(&be, &prof, &o, &dist);
    Llama m, base;
    int sized = o.data_path || o.eval_only;  // generation alone needs one sequence
    int B = sized ? o.batch : 1, T = sized ? o.seq : (cfg.max_seq < 256 ? cfg.max_seq : 256);
    llama_check_window(&cfg, T, o.model_dir, sized ? "flag --seq" : "the generation window");
    // --mlp-tile auto: the largest tile that fits the memory the fit check checks against
    size_t avail = fit_avail_bytes(&be, dist.local_size);
    TrainModes fitted = llama_fit_to_memory(&cfg, md, B, T, &be, &dist, avail);
    llama_setup(&m, &cfg, &fitted, B, T, &be, &dist);
    TrainOptions planned = o;
    planned.batch = B;
    LlamaPlanCtx pc = {&cfg, &be, &dist, T, avail};
    fit_check_plan(&be, &m.plan, llama_plan_bytes, &pc, &planned, dist.world,
                   dist.local_size);  // before any allocation, on either backend
    TrainModes bm = train_baseline_modes(md);
    llama_setup(&base, &cfg, &bm, B, T, &be, &dist);
    m.micro_batches = o.grad_accum;
    llama_allocate(&m);
    if (o.random_init) llama_random_weights(&m, (uint64_t)o.seed);
    else llama_load_weights(&m, o.model_dir);
    llama_rope_tables(&m);
    if (!md.full) llama_init_lora(&m, (uint64_t)o.seed);
    if (o.adapter_dir) llama_load_adapter(&m, o.adapter_dir, &o);
    LlamaRun run = {&m, &rd};
    Trainer trainer;
    llama_trainer(&trainer, &run, &o, &dist);
    if (dist.rank == 0) {
        train_print_start(&trainer, &o, &dist, &base.plan);
        int64_t N = llama_rank_tokens(B, T, &dist);
        if (md.mlp_tile == MLP_TILE_AUTO && fitted.mlp_tile != MLP_TILE_AUTO && m.mlp_tile < N) {  // memory-dependent
            char a[32];
            printf("mlp tile: %lld of %lld tokens (%lld tiles; auto: the largest whose plan fits the %s %s)\n",
                   (long long)m.mlp_tile, (long long)N, (long long)((N + m.mlp_tile - 1) / m.mlp_tile),
                   fit_size(a, sizeof(a), avail), be.cuda ? "free on the GPU" : "of host memory available");
        }
        if (m.modes.offload_host && m.ckpt.offload.slots == 1)  // the copies no longer overlap the compute
            printf("offload: one device staging buffer, not two: the memory holds no second (LLMC_OFFLOAD_STAGING=2 "
                   "asks for it)\n");
        llama_warn_seq(&cfg, &o);
    }
    llama_free(&base);
    train_run(&trainer, &o, &dist);
    if (o.generate && dist.rank == 0)
        llama_generate(&m, &tok, chat_prompt ? chat_prompt : o.prompt, o.chat, o.generate, o.temperature,
                       (uint64_t)o.seed);
    if (o.generate) model_tokenizer_free(&tok);
    free(chat_prompt);
    run_data_close(&rd);
    llama_free(&m);
    dist_finalize(&dist);
    return 0;
}
#endif
