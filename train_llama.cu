// train_llama.cu: fine-tuning of LLaMA-family models (LoRA adapters, or every weight with --full)
// with the memory-saving backward pass of "Reducing Fine-Tuning Memory Overhead by Approximate
// and Memory-Sharing Backpropagation" (ReSiLU2, MS-RMSNorm).
//
// This file is the driver: the flags the model adds, its table of operations and one call into
// the run every model shares (llmc/train/run.h: options -> config -> plan -> fit -> load -> train
// -> export). Read the model first: llmc/models/llama.h (config, parameters, forward, backward),
// then beside it llama_plan.h (memory plan, fit, dry run), llama_batch.h (the batch's upload),
// llama_io.h (weights, adapters, merged export), llama_step.h (training step, evaluation) and
// llama_generate.h (sampling). The operations the model calls are llmc/ops.h, on the CPU
// (llmc/cpu/) or CUDA (llmc/cuda/); the loop is llmc/train/loop.h, the optimizer llmc/train/zero.h.
#include "llmc/common.h"
#include "llmc/train/flags.h"
#include "llmc/text/model_tokenizer.h"
#include "llmc/text/textdata.h"
#include "llmc/train/run_options.h"
#include "llmc/train/loop.h"
#include "llmc/train/run.h"
#include "llmc/models/llama.h"
#include "llmc/models/llama_plan.h"
#include "llmc/models/llama_fit_report.h"
#include "llmc/models/llama_batch.h"
#include "llmc/models/llama_io.h"
#include "llmc/models/llama_step.h"
#include "llmc/models/llama_generate.h"
#include "llmc/models/llama_pref.h"

// Everything a resumed run must share with the saved one, as "key=value" words (rslora=1 last and only
// when set, so that states saved before the flag existed still match). The memory modes that change no
// number (--recompute, --offload, --mlp-tile, --swiglu-product) are not in it: a run may resume with
// another, e.g. with --recompute block on a smaller card.
static void llama_settings_line(char* buf, size_t n, const Llama* m, const TrainOptions* o, const Dist* d,
                                int64_t data_tokens) {
    const LlamaConfig* c = &m->cfg;
    snprintf(buf, n,
             "d=%d f=%d layers=%d heads=%d kv_heads=%d vocab=%d full=%d act=%s norm=%s ms_lora=%s rank=%d "
             "alpha=%g targets=0x%x "
             "lora_dropout=%g batch=%d seq=%d grad_accum=%d world=%d steps=%d lr=%g warmup=%d min_lr_frac=%g "
             "weight_decay=%g grad_clip=%g seed=%d data_tokens=%lld quant=%s%s",
             c->dim, c->hidden, c->layers, c->heads, c->kv_heads, c->vocab, o->full, o->act, o->norm, o->ms_lora,
             o->lora_rank, o->lora_alpha, m->modes.targets, o->lora_dropout, o->batch, o->seq,
             o->grad_accum, d->world, o->steps, o->lr, o->warmup, o->min_lr_frac, o->weight_decay, o->grad_clip,
             o->seed, (long long)data_tokens, o->quant, o->lora_rslora ? " rslora=1" : "");
    if (dist_sp(d) > 1) str_appendf(buf, n, " seq_parallel=%d", dist_sp(d));  // the data order follows world / P
    if (objective_of(o) != OBJ_SFT)  // (sft: not named, so that states saved before the flag still match)
        str_appendf(buf, n, " objective=%s beta=%g label_smoothing=%g simpo_gamma=%g", o->objective,
                    objective_beta(o), o->dpo_label_smoothing, o->simpo_gamma);
}

// ----------------------------------------------------------------------------------------------
// The run's data and the model's table of operations

typedef struct {           // what a run reads besides the model
    TokenShard train, val;
    TextLoader tl, vl;
    int have_train, have_val;
    int pairs;             // --objective dpo|orpo|simpo: pair shards (llmc/text/pairdata.h) instead
    PairShard ptrain, pval;
    PairLoader pl, pvl;
} RunData;

// A preference objective's pair shards; a pair shard given to sft refused in one line.
static void run_pairs_open(RunData* rd, const TrainOptions* o, int vocab) {
    const char* paths[2] = {o->data_path, o->val_path};
    if (objective_of(o) == OBJ_SFT) {
        for (int i = 0; i < 2; i++)
            if (paths[i] && file_is_pair_shard(paths[i]))
                fail("%s: a pair shard (preference data), not a token shard; train on it with --objective "
                     "dpo|orpo|simpo", paths[i]);
        return;
    }
    rd->pairs = 1;
    if (o->data_path) {
        pair_shard_load(&rd->ptrain, o->data_path, vocab);
        pair_loader_init(&rd->pl, &rd->ptrain, o->seq, (uint64_t)o->seed, 1);
        rd->have_train = 1;
    }
    if (o->val_path) {
        pair_shard_load(&rd->pval, o->val_path, vocab);
        pair_loader_init(&rd->pvl, &rd->pval, o->seq, (uint64_t)o->seed, 0);
        rd->have_val = 1;
    }
}

static void run_data_open(RunData* rd, const TrainOptions* o, int vocab) {
    memset(rd, 0, sizeof(*rd));
    run_pairs_open(rd, o, vocab);
    if (rd->pairs) return;
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
    if (rd->pairs) {
        if (rd->have_train) { pair_loader_free(&rd->pl); pair_shard_free(&rd->ptrain); }
        if (rd->have_val) { pair_loader_free(&rd->pvl); pair_shard_free(&rd->pval); }
        return;
    }
    if (rd->have_train) { loader_free(&rd->tl); shard_free(&rd->train); }
    if (rd->have_val) { loader_free(&rd->vl); shard_free(&rd->val); }
}

// The run's state (llmc/train/run.h's `void* run`): the config and modes from the flags, the
// model and the baseline planned beside it, the data, and generation's tokenizer and prompt.
typedef struct {
    LlamaConfig cfg;
    TrainModes md;         // as the flags give them
    TrainModes fitted;     // auto's choices fitted to the memory (llama_fit_to_memory)
    size_t avail;          // the memory they were fitted to (--mem-limit where that is less)
    int B, T;              // the planned micro-batch (generation alone: one sequence)
    Llama m, base;
    RunData rd;
    PrefObjective po;      // --objective (sft: unused)
    RefTable ref, val_ref;  // --ref-logps precompute (DPO): the training and validation pairs', else empty
    ModelTokenizer tok;
    char* chat_prompt;
} LlamaRun;

static StepResult llama_run_step(void* run, const TrainOptions* o, const Dist* dist, int step) {
    LlamaRun* r = (LlamaRun*)run;
    if (r->rd.pairs) return llama_pref_step(&r->m, &r->rd.pl, &r->po, &r->ref, o, dist, step);
    return llama_train_step(&r->m, &r->rd.tl, o, dist, step);
}

static EvalResult llama_run_evaluate(void* run, int batches) {
    LlamaRun* r = (LlamaRun*)run;
    if (r->rd.pairs) return llama_pref_evaluate(&r->m, &r->rd.pvl, &r->po, &r->val_ref, batches);
    EvalResult e = {llama_evaluate(&r->m, &r->rd.vl, batches), NAN, 0};
    return e;
}

static void llama_run_save_adapter(void* run, const TrainOptions* o, const char* dir) {
    llama_save_adapter(&((LlamaRun*)run)->m, dir, o);
}

static void llama_run_export(void* run, const TrainOptions* o, const char* dir) {
    llama_export_merged(&((LlamaRun*)run)->m, o, dir);
}

static void llama_print_start(void* run, const TrainOptions* o, const char* what, const char* where) {
    const Llama* m = &((LlamaRun*)run)->m;
    const LlamaConfig* c = &m->cfg;
    printf(
        "train_llama: %s | d=%d f=%d layers=%d heads=%d/%d vocab=%d | act=%s norm=%s recompute=%s | %s (%lld "
        "trainable) "
        "| %s\n",
        o->model_dir, c->dim, c->hidden, c->layers, c->heads, c->kv_heads, c->vocab, o->act, o->norm, o->recompute,
        what, (long long)m->w.tr.count, where);
}

// --fit report after training: the table for the memory this run's choices were fitted to.
static void llama_run_fit_report(void* run, const TrainOptions* o, const Dist* dist, double step_seconds) {
    LlamaRun* r = (LlamaRun*)run;
    FitBudget budget = {r->avail, "the memory this run fitted its choices to"};
    FitCalibration cal = llama_fit_calibration(&r->m, o, step_seconds);
    llama_fit_report(&r->cfg, o, !r->m.be->cuda, dist, budget, &cal);
}

// The model as the shared training loop sees it.
static void llama_trainer(void* run, Trainer* t, const TrainOptions* o, const Dist* dist) {
    LlamaRun* r = (LlamaRun*)run;
    Llama* m = &r->m;
    run_trainer_init(t, run, &m->w.tr, &m->plan, m->be, m->modes.full);
    t->unit = "tok";
    t->items = "tokens";
    t->flops_per_item = llama_flops_per_token(m);
    t->have_val = r->rd.have_val;
    t->cursor = r->rd.pairs ? &r->rd.pl.cursor : &r->rd.tl.cursor;
    if (r->rd.have_train)
        t->data_fingerprint = r->rd.pairs ? pair_shard_fingerprint(&r->rd.ptrain) : shard_fingerprint(&r->rd.train);
    int64_t data_tokens = r->rd.pairs ? r->rd.ptrain.count : r->rd.train.count;
    llama_settings_line(t->settings, sizeof(t->settings), m, o, dist, data_tokens);
    if (r->rd.pairs) {  // TRL's names beside the loss; validation's preference accuracy
        ExtraStats ex = {PREF_NLL - 1, pref_metric_names + 1, "rewards/accuracies"};
        t->extra = ex;
    }
    t->step = llama_run_step;
    t->evaluate = llama_run_evaluate;
    t->save_adapter = llama_run_save_adapter;
    t->export_merged = llama_run_export;
    t->print_start = llama_print_start;
    t->fit_report = llama_run_fit_report;
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
    preference_flags_register(t, o);
    t->group = "memory modes (the paper's layers)";
    flag_choice(t, "swiglu-product", &o->swiglu_product, "keep|recompute",
                "keep the down projection's input, or rebuild it from silu(g)*u in backward (beyond the paper)");
    flag_choice(t, "offload", &o->offload, "none|host",
                "with --recompute block, N or auto: the recomputed blocks' checkpoints in pinned host memory, "
                "copied beside the compute");
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

// ----------------------------------------------------------------------------------------------
// The model's operations, in the order llmc/train/run.h's train_main calls them

static void llama_run_config(void* run, TrainOptions* o, const Dist* dist) {
    LlamaRun* r = (LlamaRun*)run;
    llama_config_load(&r->cfg, o->model_dir);
    train_check_lora_rank(o, r->cfg.dim, o->model_dir);
    preference_check(o, TRAIN_TEXT);
    if (!strcmp(o->ref_logps, "precompute") && objective_of(o) != OBJ_DPO)
        fail("flag --ref-logps precompute: only with --objective dpo (%s has no reference model)", o->objective);
    r->po = pref_objective_from(o);
    train_check_recompute(o, r->cfg.layers, o->model_dir);
    r->md = train_modes_from(o, target_names, N_TARGETS);
    r->md.full_reference = r->md.full && r->po.kind == OBJ_DPO;  // the initial weights, frozen (dpo_reference)
    TrainOptions sp_checked = *o;
    if (o->dry_run && o->max_seq) sp_checked.seq = o->seq_parallel;  // --max-seq searches multiples of P instead
    seqpar_check(&sp_checked, r->cfg.heads, r->cfg.kv_heads);
}

static void llama_run_dry_run(void* run, const TrainOptions* o, const Dist* dist) {
    LlamaRun* r = (LlamaRun*)run;
    if (!strcmp(o->fit, "report")) {
        int cpu = !strcmp(o->device, "cpu");
        llama_fit_report(&r->cfg, o, cpu, dist, fit_budget(o, !cpu, "--fit report"), NULL);
        return;
    }
    TrainOptions planned = *o;
    planned.seq = llama_dry_run(&r->cfg, o, r->md, dist);
    if (objective_of(o) != OBJ_SFT && !o->json)  // the pair layout: the plan is the SFT one of the same rows
        printf("objective %s: --batch %d rows = %d pairs (each chosen row beside its rejected one)%s\n", o->objective,
               o->batch, o->batch / 2,
               objective_of(o) != OBJ_DPO ? ""
               : o->full ? "; the reference pass (the frozen initial weights: dpo_reference; nothing kept) "
                           "reuses the planned buffers"
                         : "; the reference pass (adapters off, nothing kept) reuses the planned buffers: no memory "
                           "beyond this plan");
    llama_warn_seq(&r->cfg, &planned);
}

static void llama_run_check(void* run, const TrainOptions* o) {
    if (!o->data_path && !o->generate && !o->eval_only && !o->export_merged)
        fail(
            "nothing to do: give --data to train, --val with --eval-only, --generate N to sample, or --export-merged "
            "DIR");
}

static void llama_run_open(void* run, const TrainOptions* o, Dist* dist) {
    LlamaRun* r = (LlamaRun*)run;
    dist_seq_parallel_init(dist, o->seq_parallel);
    run_data_open(&r->rd, o, r->cfg.vocab);
    if (o->generate) model_tokenizer_load(&r->tok, o->model_dir, r->cfg.vocab, r->cfg.eos_id);
    if (o->chat) r->chat_prompt = model_tokenizer_chat(&r->tok, o->model_dir, o->system, o->prompt);
}

// auto's choices fitted to r->avail: --recompute auto (asked, or the default where the run would not
// fit otherwise: fit_recompute_auto) first, then the rest (llama_fit_to_memory). A --mem-limit that
// not even auto's smallest plan fits is refused in one line naming that plan's size; where the
// default auto does not fit either, the flags as given go to the fit check, which says what would.
static void llama_run_fit(LlamaRun* r, const TrainOptions* o, const Backend* be, const Dist* dist) {
    TrainModes md = r->md;
    if (fit_recompute_auto(o)) md.recompute = RECOMPUTE_AUTO;
    TrainModes least = llama_smallest_choices(md, r->B, r->T, dist);
    size_t smallest = llama_modes_plan_bytes(&r->cfg, &least, r->B, r->T, be, dist);
    char what[96];
    snprintf(what, sizeof(what), "recompute %d of %d blocks, auto's smallest choices",
             train_recomputed_blocks(&least, r->cfg.layers), r->cfg.layers);
    fit_refuse_mem_limit(o, smallest, smallest, what);
    if (md.recompute == RECOMPUTE_AUTO && smallest > r->avail && strcmp(o->recompute, "auto") != 0) md = r->md;
    r->fitted = llama_fit_to_memory(&r->cfg, md, r->B, r->T, be, dist, r->avail);
}

// The model at the run's shape with auto's choices fitted to the memory, checked against it (on
// either backend, before any allocation), and the baseline beside it.
static void llama_run_plan(void* run, const TrainOptions* o, const Backend* be, const Dist* dist) {
    LlamaRun* r = (LlamaRun*)run;
    int sized = o->data_path || o->eval_only;  // generation alone needs one sequence
    r->B = sized ? o->batch : 1;
    r->T = sized ? o->seq : (r->cfg.max_seq < 256 ? r->cfg.max_seq : 256);
    if (o->generate)  // a prompt longer than the window would be cut to its last half: refused instead
        model_tokenizer_check_prompt(&r->tok, r->chat_prompt ? r->chat_prompt : o->prompt, o->chat, r->T,
                                     sized ? "--seq" : "the generation window: max_position_embeddings, at most 256");
    // --recompute auto, then --mlp-tile auto: the fewest blocks, the largest tile that fit the memory
    // the fit check checks against
    r->avail = fit_run_avail(be, o, dist->local_size);
    llama_run_fit(r, o, be, dist);
    llama_setup(&r->m, &r->cfg, &r->fitted, r->B, r->T, be, dist);
    TrainOptions planned = *o;
    planned.batch = r->B;
    LlamaPlanCtx pc = {&r->cfg, be, dist, r->T, r->avail};
    fit_check_plan(be, &r->m.plan, llama_plan_bytes, &pc, &planned, dist->world, dist->local_size);
    TrainModes bm = train_baseline_modes(r->md);
    llama_setup(&r->base, &r->cfg, &bm, r->B, r->T, be, dist);
}

static void llama_run_load(void* run, const TrainOptions* o) {
    LlamaRun* r = (LlamaRun*)run;
    Llama* m = &r->m;
    m->io.micro_batches = o->grad_accum;
    llama_allocate(m);
    if (o->random_init) llama_random_weights(m, (uint64_t)o->seed);
    else llama_load_weights(m, o->model_dir);
    llama_rope_tables(m);
    if (!r->md.full) llama_init_lora(m, (uint64_t)o->seed);
    if (o->adapter_dir) llama_load_adapter(m, o->adapter_dir, o);
    llama_reference_freeze(m);  // --full DPO: before the resume replaces the arena's values
    if (r->rd.pairs && r->rd.have_train && !o->eval_only && !strcmp(o->ref_logps, "precompute")) {
        const char* dir = o->out_dir ? o->out_dir : o->resume_dir;
        RefOrigin origin = o->resume_dir ? REF_RESUMED : REF_FRESH;
        llama_ref_table_prepare(m, &r->ref, &r->rd.ptrain, dir, "ref_logps.bin", origin, m->dist->rank == 0);
        if (r->rd.have_val)  // validation reads its reference logps too
            llama_ref_table_prepare(m, &r->val_ref, &r->rd.pval, dir, "ref_logps_val.bin", origin,
                                    m->dist->rank == 0);
    }
}

// Rank 0's start-up lines on what auto chose from the memory, and on --seq past the pretrained context.
static void llama_run_started(void* run, const TrainOptions* o, const Dist* dist) {
    LlamaRun* r = (LlamaRun*)run;
    const Llama* m = &r->m;
    int64_t N = llama_rank_tokens(r->B, r->T, dist);
    // the tile auto fitted to the memory, where it is not the whole sequence
    if (r->md.mlp_tile == MLP_TILE_AUTO && r->fitted.mlp_tile != MLP_TILE_AUTO && m->mlp_tile < N) {
        char a[32];
        printf("mlp tile: %lld of %lld tokens (%lld tiles; auto: the largest whose plan fits the %s %s)\n",
               (long long)m->mlp_tile, (long long)N, (long long)((N + m->mlp_tile - 1) / m->mlp_tile),
               fit_size(a, sizeof(a), r->avail), m->be->cuda ? "free on the GPU" : "of host memory available");
    }
    if (m->saved.ckpt.host && m->saved.ckpt.offload.slots == 1)  // the copies no longer overlap the compute
        printf("offload: one device staging buffer, not two: the memory holds no second (LLMC_OFFLOAD_STAGING=2 "
               "asks for it)\n");
    if (fit_recompute_auto(o) || (r->md.recompute > 0 && r->md.recompute != RECOMPUTE_ALL)) {  // auto or N: why
        char line[160];
        fit_recompute_line(line, sizeof(line), o, m->saved.ckpt.recomputed, r->cfg.layers, r->avail);
        printf("%s\n", line);
    }
    llama_warn_seq(&r->cfg, o);
}

static const MemPlan* llama_run_base_plan(void* run) { return &((LlamaRun*)run)->base.plan; }
static void llama_run_free_base(void* run) { llama_free(&((LlamaRun*)run)->base); }

static void llama_run_finish(void* run, const TrainOptions* o, const Dist* dist) {
    LlamaRun* r = (LlamaRun*)run;
    if (o->generate && dist->rank == 0)
        llama_generate(&r->m, &r->tok, r->chat_prompt ? r->chat_prompt : o->prompt, o->chat, o->generate,
                       o->temperature, (uint64_t)o->seed);
    if (o->generate) model_tokenizer_free(&r->tok);
}

static void llama_run_close(void* run) {
    LlamaRun* r = (LlamaRun*)run;
    free(r->chat_prompt);
    free(r->ref.logp);
    free(r->val_ref.logp);
    run_data_close(&r->rd);
    llama_free(&r->m);
}

static const ModelOps llama_ops = {
    llama_flags,     llama_run_config,    llama_run_dry_run,   llama_run_check,  llama_run_open,
    llama_run_plan,  llama_run_load,      llama_trainer,       llama_run_started, llama_run_base_plan,
    llama_run_free_base, llama_run_finish, llama_run_close,
};

#ifndef TESTING
int main(int argc, char** argv) {
    static LlamaRun run;  // zeroed; large (two models' tables), so not on the stack
    return train_main(&llama_ops, &run, argc, argv);
}
#endif
