// train_llama.cu: fine-tuning of LLaMA-family models (LoRA adapters, or every weight with --full)
// with the memory-saving backward pass of "Reducing Fine-Tuning Memory Overhead by Approximate
// and Memory-Sharing Backpropagation" (ReSiLU2, MS-RMSNorm).
//
// This file is the driver: the flags the model adds, its table of operations and one call into
// the run every model shares (llmc/train/run.h: options -> config -> plan -> fit -> load -> train
// -> export). Read the model first: llmc/models/llama.h (config, parameters, forward, backward),
// then beside it llama_plan.h (memory plan, fit, dry run), llama_batch.h (the batch's upload),
// llama_io.h (weights, adapters, merged export), llama_step.h (training step, evaluation),
// llama_generate.h (sampling), llama_data.h (the shards) and llama_run.h (the run's state and its
// plan fitted to the memory). The operations the model calls are llmc/ops.h, on the CPU
// (llmc/cpu/) or CUDA (llmc/cuda/); the loop is llmc/train/loop.h, the optimizer llmc/train/zero.h.
#include "llmc/common.h"
#include "llmc/train/flags.h"
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
#include "llmc/models/llama_data.h"
#include "llmc/models/llama_run.h"

// ----------------------------------------------------------------------------------------------
// The model as the shared training loop sees it (llmc/train/loop.h's Trainer)

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
    train_flag_offload(t, o);
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
    llama_data_open(&r->rd, o, r->cfg.vocab);
    if (o->generate) model_tokenizer_load(&r->tok, o->model_dir, r->cfg.vocab, r->cfg.eos_id);
    if (o->chat) r->chat_prompt = model_tokenizer_chat(&r->tok, o->model_dir, o->system, o->prompt);
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
    llama_data_close(&r->rd);
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
