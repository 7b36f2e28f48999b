// cuda/attention_cudnn.cu: attention forward and backward through cuDNN's fused flash attention
// (the graph API's scaled-dot-product-attention node, SDPA), behind llmc/cuda/attention_cudnn.h.
// Built by make as its own object (build/cudnn/) only when cuDNN and its C++ frontend are found;
// the trainers then link it and define LLMC_HAVE_CUDNN.
//
// Why the C++ frontend (cudnn_frontend, header-only, from the nvidia-cudnn-frontend wheel) and not
// cuDNN's backend C API directly: through the backend API the fused attention is not one
// operation but a pattern the engines recognise (matmul, scale, causal mask from index
// generators and a select, max and sum reductions, exp, log, divide, matmul, and about twice that
// for the backward), each node and virtual tensor a descriptor with a dozen attributes; an engine
// that does not match the exact pattern simply reports "not supported". That pattern is what the
// frontend's sdpa() / sdpa_backward() emit and NVIDIA keeps in step with each cuDNN release. With
// no GPU to try a hand-built pattern on, the frontend is the version that can be right first time.
// The frontend only builds descriptors and calls libcudnn; nothing of it runs on the device.
//
// Layout: cuDNN takes each tensor as dims [B, heads, T, hd] with explicit strides, so ours are
// described in place (no copies): q/o strides {T*H*hd, hd, H*hd, 1}, k/v {T*KVH*hd, hd, KVH*hd, 1}
// (grouped-query attention is the frontend's h_k < h_q), the statistics [B, H, T, 1] packed.
// Causal: the diagonal band aligned top-left with right bound 0 (key <= query).
// Packed examples (llmc/attn_docs.h): cuDNN's ragged ("THD") layout, as in cudnn-frontend's own
// tests: q, k, v, o and the gradients [docs_batch, heads, docs_len, hd] with the same per-token
// strides and a ragged offset per entry (INT64, docs_batch + 1 of them: start token x heads x hd),
// the statistics token-major with offsets start token x H, the padding mask with each entry's
// length for queries and keys, and the causal band within each entry. cuDNN takes ragged layouts
// on Hopper and later (Ampere from 9.18.1, not with the token-major statistics the backward wants
// here): where it has no engine the build of the plan says so, and the caller runs GEMM.
// Plans are cached per shape (B, T, H, KVH, hd, causal, docs_batch, docs_len) for the life of the
// process: a graph is built and its plan chosen by cuDNN's heuristics (mode A) on first use, then
// executed with new pointers each call.
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <cudnn.h>
#include <cudnn_frontend.h>
#include "../common.h"
#include "attention_cudnn.h"

namespace fe = cudnn_frontend;

// Tensor uids of the variant packs (fixed, so a cached plan takes new pointers each call).
enum { UID_Q = 1, UID_K, UID_V, UID_O, UID_STATS, UID_DO, UID_DQ, UID_DK, UID_DV,
       UID_SEQ_Q, UID_SEQ_KV, UID_OFF_Q, UID_OFF_KV, UID_OFF_STATS };

static cudnnHandle_t cudnn_handle(void) {
    static cudnnHandle_t h = NULL;  // the trainers drive one GPU per process
    if (!h) {
        cudnnStatus_t st = cudnnCreate(&h);
        if (st != CUDNN_STATUS_SUCCESS)
            fail("cuDNN: cudnnCreate failed: %s (LLMC_ATTENTION=gemm runs attention without cuDNN)",
                 cudnnGetErrorString(st));
    }
    return h;
}

const char* attention_cudnn_version(void) {
    static char v[32];
    size_t n = cudnnGetVersion();  // major*10000 + minor*100 + patch since cuDNN 9
    snprintf(v, sizeof(v), "%d.%d.%d", (int)(n / 10000), (int)(n / 100 % 100), (int)(n % 100));
    return v;
}

// cuDNN's own tests waive zero-length ragged entries below 9.25 (the engines return NaN rows there:
// cudnn-frontend issue 943), so below it a batch of documents is never padded.
int attention_cudnn_takes_empty_documents(void) { return cudnnGetVersion() >= 92500; }

const char* attention_cudnn_refusal(CudnnAttnShape s) {
    // Head dims: the fused kernels take multiples of 8 up to 128 on sm_80 and sm_90 alike (Hopper
    // goes to 256, Ampere does not: 128 keeps one rule for both builds).
    if (s.hd % 8 != 0 || s.hd > 128) return "cuDNN's fused attention needs a head dim that is a multiple of 8, <= 128";
    if (s.KVH <= 0 || s.H % s.KVH != 0) return "query heads are not a multiple of kv heads";
    if ((int64_t)s.B * s.T * s.H == 0) return "an empty batch";
    if (s.docs_batch > 0 && (s.docs_len <= 0 || s.docs_len > s.T)) return "internal: documents longer than a row";
    return NULL;
}

static int ragged(const CudnnAttnShape& s) { return s.docs_batch > 0; }

// Dims and strides of a [B*T, heads*hd] activation seen as [B, heads, T, hd]; packed examples:
// as [docs_batch, heads, docs_len, hd], each entry placed by its ragged offset.
static std::vector<int64_t> act_dim(const CudnnAttnShape& s, int heads) {
    return ragged(s) ? std::vector<int64_t>{s.docs_batch, heads, s.docs_len, s.hd}
                     : std::vector<int64_t>{s.B, heads, s.T, s.hd};
}
static std::vector<int64_t> act_stride(const CudnnAttnShape& s, int heads) {
    int64_t rows = ragged(s) ? s.docs_len : s.T;
    return {rows * heads * s.hd, s.hd, (int64_t)heads * s.hd, 1};
}
// The statistics: lse [B, H, T, 1]; packed examples: token-major [B*T, H] (each entry's rows at its
// offset), the layout cuDNN's ragged backward sizes its workspace for (max_total_seq_len below).
static std::vector<int64_t> stats_dim(const CudnnAttnShape& s) {
    return ragged(s) ? std::vector<int64_t>{s.docs_batch, s.H, s.docs_len, 1} : std::vector<int64_t>{s.B, s.H, s.T, 1};
}
static std::vector<int64_t> stats_stride(const CudnnAttnShape& s) {
    return ragged(s) ? std::vector<int64_t>{(int64_t)s.docs_len * s.H, 1, s.H, 1}
                     : std::vector<int64_t>{(int64_t)s.H * s.T, s.T, 1, 1};
}

typedef std::shared_ptr<fe::graph::Tensor_attributes> TensorPtr;

// The documents' tensors of a ragged graph (all NULL for B rows of T).
struct Docs {
    TensorPtr seq_q, seq_kv, off_q, off_kv, off_stats;
};

static TensorPtr index_tensor(fe::graph::Graph& g, const char* name, int64_t uid, int64_t n, fe::DataType_t type) {
    return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim({n, 1, 1, 1})
                        .set_stride({1, 1, 1, 1}).set_data_type(type));
}

static Docs docs_tensors(fe::graph::Graph& g, const CudnnAttnShape& s) {
    Docs d;
    if (!ragged(s)) return d;
    // one length per entry for queries and keys alike (the same array: causal self-attention)
    d.seq_q = index_tensor(g, "seq_len_q", UID_SEQ_Q, s.docs_batch, fe::DataType_t::INT32);
    d.seq_kv = index_tensor(g, "seq_len_kv", UID_SEQ_KV, s.docs_batch, fe::DataType_t::INT32);
    d.off_q = index_tensor(g, "ragged_q", UID_OFF_Q, s.docs_batch + 1, fe::DataType_t::INT64);
    d.off_kv = index_tensor(g, "ragged_kv", UID_OFF_KV, s.docs_batch + 1, fe::DataType_t::INT64);
    d.off_stats = index_tensor(g, "ragged_stats", UID_OFF_STATS, s.docs_batch + 1, fe::DataType_t::INT64);
    return d;
}

static TensorPtr act_tensor(fe::graph::Graph& g, const char* name, int64_t uid, const CudnnAttnShape& s, int heads,
                            const TensorPtr& off) {
    auto t = fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(act_dim(s, heads)).set_stride(
        act_stride(s, heads));
    if (off) t.set_ragged_offset(off);
    return g.tensor(t);
}

// An output of the graph (o, a gradient) in the activation layout.
static void act_output(const TensorPtr& t, int64_t uid, const CudnnAttnShape& s, int heads, const TensorPtr& off) {
    t->set_output(true).set_uid(uid).set_dim(act_dim(s, heads)).set_stride(act_stride(s, heads));
    if (off) t->set_ragged_offset(off);
}

static std::shared_ptr<fe::graph::Graph> new_graph(void) {
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(fe::DataType_t::BFLOAT16)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    return g;
}

// The masks both directions share: causal (the band aligned top-left, right bound 0: key <=
// query, within each entry for packed examples), and for packed examples the padding mask that
// makes cuDNN read each entry's length.
// A sliding window is the band's left bound: the frontend keeps a score where key + left_bound > query
// (cudnn_frontend/utils/attn_score_modifiers.h), i.e. query - window < key, the window of
// llmc/cpu/attention.h; per entry, so packed documents restart it as the CPU twin does.
template <typename Attrs> static void set_masks(Attrs& opt, const CudnnAttnShape& s, const Docs& d) {
    if (s.causal) opt.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT).set_diagonal_band_right_bound(0);
    if (s.causal && s.window > 0) opt.set_diagonal_band_left_bound(s.window);
    if (ragged(s)) opt.set_padding_mask(true).set_seq_len_q(d.seq_q).set_seq_len_kv(d.seq_kv);
}

static std::shared_ptr<fe::graph::Graph> forward_graph(const CudnnAttnShape& s) {
    auto g = new_graph();
    Docs d = docs_tensors(*g, s);
    auto q = act_tensor(*g, "q", UID_Q, s, s.H, d.off_q), k = act_tensor(*g, "k", UID_K, s, s.KVH, d.off_kv),
         v = act_tensor(*g, "v", UID_V, s, s.KVH, d.off_kv);
    auto opt =
        fe::graph::SDPA_attributes().set_name("attention_forward").set_generate_stats(true).set_attn_scale(s.scale);
    set_masks(opt, s, d);
    auto outs = g->sdpa(q, k, v, opt);
    act_output(outs[0], UID_O, s, s.H, d.off_q);
    outs[1]->set_output(true).set_uid(UID_STATS).set_data_type(fe::DataType_t::FLOAT).set_dim(stats_dim(s))
        .set_stride(stats_stride(s));
    if (d.off_stats) outs[1]->set_ragged_offset(d.off_stats);
    return g;
}

static std::shared_ptr<fe::graph::Graph> backward_graph(const CudnnAttnShape& s) {
    auto g = new_graph();
    Docs d = docs_tensors(*g, s);
    auto q = act_tensor(*g, "q", UID_Q, s, s.H, d.off_q), k = act_tensor(*g, "k", UID_K, s, s.KVH, d.off_kv),
         v = act_tensor(*g, "v", UID_V, s, s.KVH, d.off_kv), o = act_tensor(*g, "o", UID_O, s, s.H, d.off_q),
         dout = act_tensor(*g, "dout", UID_DO, s, s.H, d.off_q);
    auto st = fe::graph::Tensor_attributes().set_name("stats").set_uid(UID_STATS).set_data_type(fe::DataType_t::FLOAT)
                  .set_dim(stats_dim(s)).set_stride(stats_stride(s));
    if (d.off_stats) st.set_ragged_offset(d.off_stats);
    auto stats = g->tensor(st);
    auto opt = fe::graph::SDPA_backward_attributes().set_name("attention_backward").set_attn_scale(s.scale);
    set_masks(opt, s, d);
    if (ragged(s)) {
        // The fp32 accumulators (dQ, and dK/dV at every query head for grouped queries) sized by
        // the tokens, not docs_batch x docs_len; rounded up to a 128-row tile, as a tile of the
        // last entry may run past the last token.
        int64_t tokens = ((int64_t)s.B * s.T + 127) / 128 * 128;
        opt.set_max_total_seq_len_q(tokens).set_max_total_seq_len_kv(tokens);
    }
    auto grads = g->sdpa_backward(q, k, v, o, dout, stats, opt);
    act_output(grads[0], UID_DQ, s, s.H, d.off_q);
    act_output(grads[1], UID_DK, s, s.KVH, d.off_kv);
    act_output(grads[2], UID_DV, s, s.KVH, d.off_kv);
    return g;
}

// Validates g, lowers it to cuDNN and picks a plan; "" on success, else what failed.
static std::string build_plan(fe::graph::Graph& g, int64_t* workspace) {
    cudnnHandle_t h = cudnn_handle();
    fe::error_t e = g.validate();
    if (e.is_good()) e = g.build_operation_graph(h);
    if (e.is_good()) e = g.create_execution_plans({fe::HeurMode_t::A});
    if (e.is_good()) e = g.check_support(h);
    if (e.is_good()) e = g.build_plans(h);
    if (e.is_good()) e = g.get_workspace_size(*workspace);
    return e.is_good() ? std::string() : e.get_message();
}

typedef std::tuple<int, int, int, int, int, int, int, int, int, float> ShapeKey;
struct CachedPlans {
    std::shared_ptr<fe::graph::Graph> fwd, bwd;
    int64_t workspace;     // the larger of the two plans' needs, or -1: no engine
    std::string why;       // why not, when workspace is -1
};

static CachedPlans& plans_for(const CudnnAttnShape& s) {
    static std::map<ShapeKey, CachedPlans> cache;
    ShapeKey key{s.B, s.T, s.H, s.KVH, s.hd, s.causal, s.docs_batch, s.docs_len, s.window, s.scale};
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
    CachedPlans& c = cache[key];
    int64_t wf = 0, wb = 0;
    c.fwd = forward_graph(s);
    c.bwd = backward_graph(s);
    std::string ef = build_plan(*c.fwd, &wf), eb = ef.empty() ? build_plan(*c.bwd, &wb) : std::string();
    if (!ef.empty() || !eb.empty()) {
        c.workspace = -1;
        c.why = !ef.empty() ? "forward: " + ef : "backward: " + eb;
    } else {
        c.workspace = wf > wb ? wf : wb;
    }
    return c;
}

int64_t attention_cudnn_prepare(CudnnAttnShape s, const char** why) {
    const char* refused = attention_cudnn_refusal(s);
    if (refused) {
        if (why) *why = refused;
        return -1;
    }
    CachedPlans& c = plans_for(s);
    if (why) *why = c.workspace < 0 ? c.why.c_str() : NULL;
    return c.workspace;
}

static void execute(fe::graph::Graph& g, std::unordered_map<int64_t, void*>& pack, void* work, cudaStream_t st,
                    const char* what) {
    cudnnHandle_t h = cudnn_handle();
    cudnnStatus_t ss = cudnnSetStream(h, st);
    if (ss != CUDNN_STATUS_SUCCESS) fail("cuDNN: cudnnSetStream failed: %s", cudnnGetErrorString(ss));
    fe::error_t e = g.execute(h, pack, work);
    if (!e.is_good()) fail("cuDNN: the %s failed to run: %s (LLMC_ATTENTION=gemm avoids cuDNN)", what,
                           e.get_message().c_str());
}

static CachedPlans& plans_or_fail(const CudnnAttnShape& s) {
    const char* why = NULL;
    if (attention_cudnn_prepare(s, &why) < 0)
        fail("internal: cuDNN attention called for a shape it refused (%s)", why ? why : "?");
    return plans_for(s);
}

// The documents' arrays into a variant pack (packed examples), or nothing.
static void pack_docs(std::unordered_map<int64_t, void*>& pack, const CudnnAttnShape& s, const AttnDocs* docs) {
    if (!ragged(s)) return;
    if (!docs || docs->batch != s.docs_batch)
        fail("internal: cuDNN's ragged attention called without the documents of its shape");
    pack[UID_SEQ_Q] = docs->seq_len;
    pack[UID_SEQ_KV] = docs->seq_len;
    pack[UID_OFF_Q] = docs->off_q;
    pack[UID_OFF_KV] = docs->off_kv;
    pack[UID_OFF_STATS] = docs->off_stats;
}

void attention_cudnn_forward(__nv_bfloat16* o, float* lse, const __nv_bfloat16* q, const __nv_bfloat16* k,
                             const __nv_bfloat16* v, CudnnAttnShape s, const AttnDocs* docs, void* work,
                             cudaStream_t st) {
    CachedPlans& c = plans_or_fail(s);
    std::unordered_map<int64_t, void*> pack = {{UID_Q, (void*)q}, {UID_K, (void*)k}, {UID_V, (void*)v},
                                               {UID_O, (void*)o}, {UID_STATS, (void*)lse}};
    pack_docs(pack, s, docs);
    execute(*c.fwd, pack, work, st, "attention forward");
}

void attention_cudnn_backward(__nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, const __nv_bfloat16* dout,
                              const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                              const __nv_bfloat16* o, const float* lse, CudnnAttnShape s, const AttnDocs* docs,
                              void* work, cudaStream_t st) {
    CachedPlans& c = plans_or_fail(s);
    std::unordered_map<int64_t, void*> pack = {{UID_Q, (void*)q},   {UID_K, (void*)k},   {UID_V, (void*)v},
                                               {UID_O, (void*)o},   {UID_DO, (void*)dout},
                                               {UID_DQ, (void*)dq}, {UID_DK, (void*)dk}, {UID_DV, (void*)dv},
                                               {UID_STATS, (void*)lse}};
    pack_docs(pack, s, docs);
    execute(*c.bwd, pack, work, st, "attention backward");
}
