// llama_pref.h: the LLaMA model's preference step and validation (--objective dpo|orpo|simpo,
// llmc/train/preference.h) over pair micro-batches (llmc/text/pairdata.h: each pair's chosen row,
// then its rejected row). A micro-batch:
//   1. DPO's reference: the forward with the adapters switched off (scale 0: the base's exact
//      function) and no dropout, then the head per row for each completion's summed logp; no
//      gradient, so nothing it writes is kept (as llama_evaluate's pass);
//   2. the policy's forward, which keeps its activations, and the head per row again (no gradient);
//   3. each pair's loss and its gradient w.r.t. each sequence's logp (pair_loss), written into the
//      mask as each completion token's weight: the head's gradient of the weighted cross-entropy
//      sum w * CE is then the objective's (d CE = -d logp), and the backward runs as for SFT.
#pragma once
#include "llama.h"
#include "llama_batch.h"
#include "../text/pairdata.h"
#include "../train/preference.h"
#include "../train/loop.h"

enum { HEAD_AND_BACKWARD = 1 };  // llama_head_backward's `backward`: the head's gradient, then the blocks'

// The micro-batch row (of B rows of sp.T tokens) that local token j belongs to: under
// --seq-parallel this rank holds the flattened batch's tokens [g n, (g+1) n) (llmc/train/seq_parallel.h),
// so each local row of m->T = sp.T / P tokens lies within one whole row.
static int llama_row_of(const Llama* m, int64_t j) { return (int)(((int64_t)m->sp.g * m->sp.n + j) / m->sp.T); }

// Each row's summed completion logp (the negated CE over its mask) and its completion length, from
// the forward's final-norm input (m->scratch.resid): one head pass per local row, no gradient; under
// --seq-parallel the sums of the rows' pieces added across the group. Returns this rank's rows that overflowed.
static double llama_row_logps(Llama* m, double* logp, double* len) {
    LmHead head = llama_lm_head(m);
    int B = m->B, T = m->T;
    double overflowed = 0.0, *both = (double*)xcalloc(2 * B, sizeof(double));  // [logp B][len B]
    for (int b = 0; b < B; b++) {
        LossStats st = {};
        int64_t o = (int64_t)b * T;
        LmHeadCall call = {(char*)m->scratch.resid + o * m->cfg.dim * m->be->abytes, T, m->io.targets + o,
                           m->io.mask + o, 0.0f, NULL, NULL, NULL, NULL};
        op_lm_head_loss(m->be, &head, &call, &st);
        int row = llama_row_of(m, o);
        both[row] += -st.loss_sum;
        both[B + row] += st.count;
        overflowed += st.overflowed;
    }
    dist_sp_allreduce_sum_f64(m->dist, both, 2 * B);  // (every rank of the group then holds whole sequences')
    memcpy(logp, both, sizeof(double) * B);
    memcpy(len, both + B, sizeof(double) * B);
    free(both);
    return overflowed;
}

// --full DPO: the reference is the model as it started, a frozen copy (m->w.ref_arena, planned as
// dpo_reference) of the values the kernels read, taken once after loading (on a resumed run too:
// the arena then still holds --model's weights, which the saved state's fingerprint pins; the
// resume overwrites them afterwards). CPU: the fp32 arena; CUDA: its bf16 shadow (wbytes each).
static void llama_reference_freeze(Llama* m) {
    if (!m->w.ref_arena) return;
    Trainable* tr = &m->w.tr;
    const void* now = trainable_on_device(tr) ? tr->params16 : (const void*)tr->params;
    op_copy(m->be, m->w.ref_arena, now, tr->padded);  // (op_copy moves abytes each: == wbytes on both backends)
}

// Points the model's weights at the frozen copy and back (pointers only: the arena's pointer is
// swapped with the copy's and the tensors re-bound; no value moves). The CPU's kernels read the
// host arena itself, CUDA's the bf16 shadow.
static void llama_reference_swap(Llama* m) {
    Trainable* tr = &m->w.tr;
    void* ref = m->w.ref_arena;
    if (trainable_on_device(tr)) {
        m->w.ref_arena = tr->params16;
        tr->params16 = ref;
    } else {
        m->w.ref_arena = tr->params;
        tr->params = tr->h_params = (float*)ref;
    }
    llama_bind_weights(m);
}

// DPO's reference logps of the uploaded batch: the base model, adapters off, no dropout (LoRA), or
// under --full the frozen initial weights.
static void llama_reference_logps(Llama* m, double* logp, double* len) {
    float scale = m->modes.lora_scale;
    int dropping = m->drop.active;
    m->modes.lora_scale = 0.0f;  // y = W x + 0 * B A x: the base's bits
    m->drop.active = 0;
    if (m->w.ref_arena) llama_reference_swap(m);
    llama_forward_blocks(m, m->B, m->T, NULL);
    llama_row_logps(m, logp, len);  // (under --full the head and the final norm are the frozen ones too)
    if (m->w.ref_arena) llama_reference_swap(m);
    m->modes.lora_scale = scale;
    m->drop.active = dropping;
}

// A micro-batch's sequences: the policy's and the reference's logps and the completion lengths.
typedef struct {
    double *pi, *ref, *len;  // [B]
} RowLogps;

static RowLogps row_logps_alloc(int B) {
    RowLogps r = {(double*)xcalloc(B, sizeof(double)), (double*)xcalloc(B, sizeof(double)),
                  (double*)xcalloc(B, sizeof(double))};
    return r;
}
static void row_logps_free(RowLogps* r) { free(r->pi); free(r->ref); free(r->len); }

// Pair i's loss, its terms added into sums (PREF_*); its rows' gradient w.r.t. their summed logps in d[2].
static PairLoss llama_pair(const PrefObjective* po, const RowLogps* rl, int i, double* sums) {
    PairLogps p = {rl->pi[2 * i], rl->pi[2 * i + 1], rl->ref[2 * i], rl->ref[2 * i + 1], rl->len[2 * i],
                   rl->len[2 * i + 1]};
    PairLoss l = pair_loss(po->kind, &p, po->beta, po->smoothing, po->gamma);
    pref_sums_add(sums, &l);
    sums[PREF_NLL] += -p.pi_c;  // the chosen completion's CE (ORPO's NLL term)
    return l;
}

// --ref-logps precompute: DPO's reference logps of every training pair, [pairs][2] (chosen,
// rejected), computed once before training and stored beside the run (ref_logps.bin), so that a
// resumed run reads them instead of computing them again.
typedef struct {
    double* logp;          // NULL: computed in each step (--ref-logps inline)
    int64_t pairs;
} RefTable;

// The micro-batch's reference logps: from the table (ids: its pairs) or by the reference forward.
static void llama_pair_references(Llama* m, const RefTable* rt, const int64_t* ids, RowLogps* rl) {
    if (!rt || !rt->logp) {
        llama_reference_logps(m, rl->ref, rl->len);
        return;
    }
    for (int i = 0; i < m->B / 2; i++) {
        rl->ref[2 * i] = rt->logp[2 * ids[i]];
        rl->ref[2 * i + 1] = rt->logp[2 * ids[i] + 1];
    }
}

// Logps of the uploaded micro-batch (the reference's for DPO, then the policy's with the forward's
// activations kept, with --lora-dropout in training); returns the final-norm rows that overflowed.
typedef enum { PREF_EVAL, PREF_TRAIN } PrefPass;
static double llama_pref_forward(Llama* m, const PrefObjective* po, const RefTable* rt, const int64_t* ids,
                                 RowLogps* rl, PrefPass pass) {
    if (po->kind == OBJ_DPO) llama_pair_references(m, rt, ids, rl);
    m->drop.active = pass == PREF_TRAIN;
    llama_forward_blocks(m, m->B, m->T, NULL);
    return llama_row_logps(m, rl->pi, rl->len);
}

// One training micro-batch (uploaded, its mask the completions'): the pair losses added into sums,
// and their gradient accumulated. pairs: the step's pairs over every rank; chosen: its chosen
// completion tokens (ORPO's NLL is their mean).
static double llama_pref_micro_batch(Llama* m, const PrefObjective* po, const RefTable* rt, const int64_t* ids,
                                     double pairs, double chosen, double* sums) {
    int B = m->B, T = m->T;
    RowLogps rl = row_logps_alloc(B);
    double overflowed = llama_pref_forward(m, po, rt, ids, &rl, PREF_TRAIN);
    double* w = (double*)xmalloc(sizeof(double) * B);  // each row's completion-token weight
    for (int i = 0; i < B / 2; i++) {
        PairLoss l = llama_pair(po, &rl, i, sums);
        // d step loss / d CE of a completion token = -(1/pairs) d pair loss / d logp (+ ORPO's NLL: 1/chosen)
        w[2 * i] = -l.d_c / pairs + (po->kind == OBJ_ORPO ? 1.0 / chosen : 0.0);
        w[2 * i + 1] = -l.d_r / pairs;
    }
    for (int64_t j = 0; j < (int64_t)B * T; j++) m->io.h_mask[j] *= (float)w[llama_row_of(m, j)];
    free(w);
    row_logps_free(&rl);
    llama_upload_batch(m, (int64_t)B * T);  // the weights up (CUDA: the host mask is staged)
    m->drop.active = 1;
    LossStats st = llama_head_backward(m, B, T, 1.0f, HEAD_AND_BACKWARD, NULL, NULL);
    m->drop.active = 0;
    return overflowed + st.overflowed;
}

static double count_chosen(const float* mask, int B, int T) {
    double s = 0.0;
    for (int b = 0; b < B; b += 2)
        for (int t = 0; t < T; t++) s += mask[(int64_t)b * T + t];
    return s;
}

// One optimizer step over grad_accum pair micro-batches on every rank: the loss is the mean pair loss
// over the global step's pairs (ORPO: plus the mean CE of its chosen tokens), so accumulation and data
// parallelism equal one big batch, as for SFT (llama_train_step).
static StepResult llama_pref_step(Llama* m, PairLoader* loader, const PrefObjective* po, const RefTable* rt,
                                  const TrainOptions* o, const Dist* dist, int step) {
    int B = m->B, K = o->grad_accum;
    int64_t N = m->sp.N, n = m->sp.n;  // the whole micro-batch's tokens, this rank's (N without --seq-parallel)
    int* in_all = (int*)xmalloc(sizeof(int) * N * K * 3);
    int *tg_all = in_all + N * K, *pos_all = in_all + 2 * N * K;
    float* mk_all = (float*)xmalloc(sizeof(float) * N * K);
    int64_t* ids = (int64_t*)xmalloc(sizeof(int64_t) * (B / 2) * K);
    double chosen = 0.0;
    for (int k = 0; k < K; k++) {
        pair_loader_next(loader, B, dist_dp_rank(dist), dist_dp_world(dist), in_all + k * N, tg_all + k * N,
                         mk_all + k * N, pos_all + k * N, ids + k * (B / 2));
        if (m->sp.g == 0) chosen += count_chosen(mk_all + k * N, B, m->sp.T);  // (once per group)
    }
    dist_allreduce_sum_f64(dist, &chosen, 1);
    double pairs = (double)(B / 2) * K * dist_dp_world(dist);
    batch_values_set_loss_scale(&m->io.bv, 1.0f);  // the weights are in the mask
    trainable_zero_grads(&m->w.tr);
    m->drop.step = (uint64_t)step;
    double sums[PREF_SUMS] = {0}, overflowed = 0.0;
    for (int k = 0; k < K; k++) {
        if (k == K - 1) trainable_buckets_begin(&m->w.tr, dist);
        int64_t first = seqpar_slice(&m->sp, in_all + k * N, tg_all + k * N, mk_all + k * N, pos_all + k * N,
                                     m->io.h_inputs, m->io.h_targets, m->io.h_mask, m->io.h_pos);
        m->drop.row0 = lora_dropout_row0(k, dist_dp_rank(dist), dist_dp_world(dist), N) + first;
        llama_upload_batch(m, n);
        overflowed += llama_pref_micro_batch(m, po, rt, ids + k * (B / 2), pairs, chosen, sums);
    }
    free(in_all);
    free(mk_all);
    free(ids);
    // --seq-parallel: every rank of a group computed the same pair losses; its first one reports them
    if (m->sp.g) memset(sums, 0, sizeof(sums));
    PROF_SCOPE(m->be, "optimizer", "step", 0.0, 0.0);
    double nll = po->kind == OBJ_ORPO && chosen > 0 ? sums[PREF_NLL] * pairs / chosen : 0.0;
    double finish[2] = {sums[PREF_LOSS] + nll, overflowed};  // summed across ranks by train_step_finish
    dist_allreduce_sum_f64(dist, sums, PREF_SUMS);
    StepResult r = train_step_finish(&m->w.tr, o, dist, step, finish, 2, pairs, (double)N * K * dist_dp_world(dist),
                                     m->cfg.vocab);
    r.n_extra = PREF_NLL - 1;
    for (int i = 1; i < PREF_NLL; i++) r.extra[i - 1] = sums[i] / pairs;
    return r;
}

// Validation over pairs 0 .. n-1 of the shard (n: up to `batches` micro-batches of B/2 pairs), each
// once: the mean pair loss (ORPO: plus the chosen tokens' mean CE) and the preference accuracy, the
// share of pairs whose chosen reward is above the rejected's.
// rt: the validation shard's precomputed reference logps (--ref-logps precompute), or NULL.
static EvalResult llama_pref_evaluate(Llama* m, const PairLoader* L, const PrefObjective* po, const RefTable* rt,
                                      int batches) {
    int B = m->B, per = B / 2;
    int64_t N = m->sp.N, n = L->shard->pairs < (int64_t)batches * per ? L->shard->pairs : (int64_t)batches * per;
    double sums[PREF_SUMS] = {0}, chosen = 0.0;
    RowLogps rl = row_logps_alloc(B);
    int* in = (int*)xmalloc(sizeof(int) * N * 3);  // inputs, targets, positions of the whole micro-batch
    float* mk = (float*)xmalloc(sizeof(float) * N);
    int64_t* ids = (int64_t*)xmalloc(sizeof(int64_t) * per);  // the batch's pairs (padding: its last one again)
    for (int64_t i = 0; i * per < n; i++) {
        int rows = pair_eval_batch(L, n, i, B, in, in + N, mk, in + 2 * N);
        for (int k = 0; k < per; k++) ids[k] = i * per + (k < rows ? k : rows - 1);
        chosen += count_chosen(mk, B, m->sp.T);
        seqpar_slice(&m->sp, in, in + N, mk, in + 2 * N, m->io.h_inputs, m->io.h_targets, m->io.h_mask, m->io.h_pos);
        llama_upload_batch(m, m->sp.n);
        llama_pref_forward(m, po, rt, ids, &rl, PREF_EVAL);  // (whole sequences' logps on every rank of a group)
        for (int k = 0; k < rows; k++) llama_pair(po, &rl, k, sums);
    }
    free(ids);
    free(in);
    free(mk);
    row_logps_free(&rl);
    double nll = po->kind == OBJ_ORPO && chosen > 0 ? sums[PREF_NLL] / chosen : 0.0;
    EvalResult e = {(float)(sums[PREF_LOSS] / n + nll), (float)(sums[PREF_ACCURATE] / n), n};
    return e;
}

// ---- --ref-logps precompute -------------------------------------------------------------------

#define REF_TABLE_MAGIC "LMRF"
#define REF_TABLE_HEADER_BYTES 32  // magic, u32 version 1, u64 pairs, u64 the pair shard's fingerprint

// The reference logps of every pair of the shard, B/2 pairs per micro-batch (the last one padded
// with its last pair, whose rows are dropped).
static void llama_ref_table_compute(Llama* m, const PairShard* s, double* out) {
    int B = m->B, T = m->sp.T, per = B / 2;
    int64_t N = m->sp.N;
    RowLogps rl = row_logps_alloc(B);
    int* in = (int*)xmalloc(sizeof(int) * N * 3);  // inputs, targets, positions of the whole micro-batch
    float* mk = (float*)xmalloc(sizeof(float) * N);
    for (int64_t first = 0; first < s->pairs; first += per) {
        for (int i = 0; i < per; i++)
            for (int side = PAIR_CHOSEN; side <= PAIR_REJECTED; side++) {
                int64_t o = (int64_t)(2 * i + side) * T, p = first + i < s->pairs ? first + i : s->pairs - 1;
                pair_fill_row(s, p, (PairSide)side, PAIR_ROW_COUNTS, T, in + o, in + N + o, mk + o, in + 2 * N + o);
            }
        seqpar_slice(&m->sp, in, in + N, mk, in + 2 * N, m->io.h_inputs, m->io.h_targets, m->io.h_mask, m->io.h_pos);
        llama_upload_batch(m, m->sp.n);
        llama_reference_logps(m, rl.ref, rl.len);
        for (int i = 0; i < per && first + i < s->pairs; i++) {
            out[2 * (first + i)] = rl.ref[2 * i];
            out[2 * (first + i) + 1] = rl.ref[2 * i + 1];
        }
    }
    free(in);
    free(mk);
    row_logps_free(&rl);
}

// The table as ref_logps.bin in `dir` holds it, if it is there and made from this shard.
static int ref_table_read(RefTable* rt, const char* path, const PairShard* s) {
    size_t n = 0;
    char* buf = read_file_or_null(path, &n);
    uint64_t hdr[3] = {0, 0, 0};
    if (buf && n == REF_TABLE_HEADER_BYTES + sizeof(double) * 2 * (size_t)s->pairs) memcpy(hdr, buf + 8, 16);
    int ok = buf && n >= 8 && !memcmp(buf, REF_TABLE_MAGIC, 4) && hdr[0] == (uint64_t)s->pairs &&
             hdr[1] == pair_shard_fingerprint(s);
    if (ok) memcpy(rt->logp, buf + REF_TABLE_HEADER_BYTES, sizeof(double) * 2 * s->pairs);
    free(buf);
    return ok;
}

static void ref_table_write(const RefTable* rt, const char* path, const PairShard* s) {
    char hdr[REF_TABLE_HEADER_BYTES] = {0};
    uint32_t version = 1;
    uint64_t pairs = (uint64_t)s->pairs, fp = pair_shard_fingerprint(s);
    memcpy(hdr, REF_TABLE_MAGIC, 4);
    memcpy(hdr + 4, &version, 4);
    memcpy(hdr + 8, &pairs, 8);
    memcpy(hdr + 16, &fp, 8);
    AtomicFile a = atomic_open(path);
    atomic_write(&a, hdr, sizeof(hdr));
    atomic_write(&a, rt->logp, sizeof(double) * 2 * s->pairs);
    atomic_commit(&a);
}

// The run's table: a resumed run reads it back from its directory (whose saved state the resume
// checks against this model and data); otherwise it is computed on every rank (the same numbers)
// and written there by rank 0. dir NULL: in memory only.
typedef enum { REF_FRESH, REF_RESUMED } RefOrigin;
// name: the file's (ref_logps.bin for the training shard, ref_logps_val.bin for --val's).
static void llama_ref_table_prepare(Llama* m, RefTable* rt, const PairShard* s, const char* dir, const char* name,
                                    RefOrigin origin, int rank0) {
    rt->pairs = s->pairs;
    rt->logp = (double*)xcalloc(2 * s->pairs, sizeof(double));
    char* path = dir ? path_join(dir, name) : NULL;
    if (path && origin == REF_RESUMED && ref_table_read(rt, path, s)) {
        if (rank0) printf("reference logps: read from %s (%lld pairs)\n", path, (long long)s->pairs);
    } else {
        double t0 = wall_seconds();
        llama_ref_table_compute(m, s, rt->logp);
        if (rank0 && path) ref_table_write(rt, path, s);
        if (rank0)
            printf("reference logps: precomputed over %lld pairs in %.1f s%s%s\n", (long long)s->pairs,
                   wall_seconds() - t0, path ? ", stored in " : " (no --out: kept in memory)", path ? path : "");
    }
    free(path);
}
