// train_vit.cu: fine-tuning of Vision Transformers (ViT-B/16 style) for image classification (LoRA
// adapters and a new head, or every weight with --full) with the memory-saving backward pass of
// "Reducing Fine-Tuning Memory Overhead by Approximate and Memory-Sharing Backpropagation"
// (ReGELU2 and MS-LN).
//
// This file is the driver: the flags the model adds, its table of operations and one call into
// the run every model shares (llmc/train/run.h). The model is llmc/models/vit.h (config,
// parameters, forward, backward), read first; beside it its memory plan (llmc/models/vit_plan.h),
// its I/O (llmc/models/vit_io.h), its training step (llmc/models/vit_step.h), its image data
// (llmc/models/vit_data.h) and the run's state, resolution, dry run and fitted plan
// (llmc/models/vit_run.h).
#include "llmc/common.h"
#include "llmc/train/flags.h"
#include "llmc/vision/imagedata.h"
#include "llmc/train/run_options.h"
#include "llmc/train/loop.h"
#include "llmc/train/run.h"
#include "llmc/train/preference.h"
#include "llmc/models/vit.h"
#include "llmc/models/vit_plan.h"
#include "llmc/models/vit_fit_report.h"
#include "llmc/models/vit_io.h"
#include "llmc/models/vit_step.h"
#include "llmc/models/vit_data.h"
#include "llmc/models/vit_run.h"

// ----------------------------------------------------------------------------------------------
// The model as the shared training loop sees it (llmc/train/loop.h's Trainer)

static StepResult vit_run_step(void* run, const TrainOptions* o, const Dist* dist, int step) {
    VitRun* r = (VitRun*)run;
    return vit_train_step(&r->m, &r->rd.tl, o, dist, step);
}

static EvalResult vit_run_evaluate(void* run, int batches) {
    VitRun* r = (VitRun*)run;
    return vit_evaluate(&r->m, &r->rd.vl, batches);
}

static void vit_run_save_adapter(void* run, const TrainOptions* o, const char* dir) {
    vit_save_adapter(&((VitRun*)run)->m, dir, o);
}

static void vit_run_export(void* run, const TrainOptions* o, const char* dir) {
    vit_export_merged(&((VitRun*)run)->m, o, dir);
}

static void vit_print_start(void* run, const TrainOptions* o, const char* what, const char* where) {
    const Vit* m = &((VitRun*)run)->m;
    const VitData* rd = &((VitRun*)run)->rd;
    const VitConfig* c = &m->cfg;
    printf("train_vit: %s | d=%d f=%d layers=%d heads=%d | image %dx%d (checkpoint %dx%d) patch %dx%d, %d tokens | "
           "%d classes | act=%s norm=%s recompute=%s | %s + head (%lld trainable params) | %s\n", o->model_dir, c->dim,
           c->hidden, c->layers, c->heads, m->img_h, m->img_w, c->image_h, c->image_w, c->patch_h, c->patch_w, m->T,
           m->classes, o->act, o->norm, o->recompute, what, (long long)m->params.tr.count, where);
    if (rd->have_train)
        printf("data: %s (%lld images %dx%dx%d, %d classes)", o->data_path, (long long)rd->train.n, rd->train.H,
               rd->train.W, rd->train.C, rd->train.classes);
    if (rd->have_val)
        printf("%sval %s (%lld images)", rd->have_train ? ", " : "data: ", o->val_path, (long long)rd->val.n);
    printf("\n");
}

// --fit report after training: the table for the memory this run's choices were fitted to.
static void vit_run_fit_report(void* run, const TrainOptions* o, const Dist* dist, double step_seconds) {
    VitRun* r = (VitRun*)run;
    VitPlanCtx pc = {&r->cfg, r->h, r->w, r->classes, vit_data_src_bytes(&r->rd), r->m.be, dist};
    FitBudget budget = {r->avail, "the memory this run fitted its choices to"};
    FitCalibration cal = vit_fit_calibration(&r->m, o, step_seconds);
    vit_fit_report(&pc, o, budget, &cal);
}

static void vit_trainer(void* run, Trainer* t, const TrainOptions* o, const Dist* dist) {
    VitRun* r = (VitRun*)run;
    Vit* m = &r->m;
    run_trainer_init(t, run, &m->params.tr, &m->plan, m->be, m->modes.full);
    t->unit = "img";
    t->items = "images";
    t->classifier = 1;
    t->flops_per_item = vit_flops_per_image(m);
    t->have_val = r->rd.have_val;
    t->cursor = &r->rd.tl.cursor;
    if (r->rd.have_train) t->data_fingerprint = image_shard_fingerprint(&r->rd.train);
    vit_settings_line(t->settings, sizeof(t->settings), m, o, dist, r->rd.train.n);
    t->step = vit_run_step;
    t->evaluate = vit_run_evaluate;
    t->save_adapter = vit_run_save_adapter;
    t->export_merged = vit_run_export;
    t->print_start = vit_print_start;
    t->fit_report = vit_run_fit_report;
}

static void vit_flags(FlagTable* t, TrainOptions* o) {
    t->program = "train_vit";
    t->usage =
        "--model DIR [--data TRAIN.bin --val VAL.bin] [flags]   (fine-tunes a ViT image classifier: LoRA and a new "
        "head, or every weight with --full)";
    train_flags_register_task(t, o, "comma list of q,k,v,proj,fc1,fc2 (default all)", TRAIN_IMAGE);
    preference_flags_register(t, o);
    t->group = "memory modes (the paper's layers)";
    train_flag_offload(t, o);
    t->group = "model and data";
    flag_string(t, "export-merged", &o->export_merged,
                "after training (or alone, with --adapter), write the model with the adapter folded in and the trained "
                "head to this directory");
}

// ----------------------------------------------------------------------------------------------
// The model's operations, in the order llmc/train/run.h's train_main calls them

static void vit_run_config(void* run, TrainOptions* o, const Dist* dist) {
    VitRun* r = (VitRun*)run;
    vit_config_load(&r->cfg, o->model_dir);
    train_check_lora_rank(o, r->cfg.dim, o->model_dir);
    preference_check(o, TRAIN_IMAGE);
    train_check_recompute(o, r->cfg.layers, o->model_dir);
    r->md = train_modes_from(o, target_names, N_TARGETS);
}

static void vit_run_dry_run(void* run, const TrainOptions* o, const Dist* dist) {
    VitRun* r = (VitRun*)run;
    vit_dry_run(&r->cfg, o, r->md, dist);
}

static void vit_run_check(void* run, const TrainOptions* o) {
    if (!o->data_path && !o->eval_only && !o->export_merged)
        fail(
            "nothing to do: give --data (an image shard from scripts/data/prepare_images.py), --val with --eval-only, "
            "or --export-merged DIR with --adapter");
    if (!o->data_path && !o->eval_only && !o->adapter_dir)
        fail("flag --export-merged: alone, it needs --adapter (the adapter and head to fold in)");
}

// (The --random-init checks come after train_prepare_run, where they always stood.)
static void vit_run_open(void* run, const TrainOptions* o, Dist* dist) {
    VitRun* r = (VitRun*)run;
    // without a checkpoint there is nothing to rewrite and no trained head to read
    if (o->random_init && (o->export_merged || (o->full && (o->out_dir || o->resume_dir))))
        fail(
            "flag --random-init: not with --export-merged or --full --out (they rewrite the checkpoint's tensors, and "
            "there is none)");
    if (o->random_init && o->eval_only && !o->adapter_dir)
        fail("flag --random-init: --eval-only needs --adapter (the trained head)");
    vit_resolution(&r->cfg, o->image_size, &r->h, &r->w);
    vit_data_open(&r->rd, o, &r->cfg, r->h, r->w, &r->classes);
}


static void vit_run_load(void* run, const TrainOptions* o) {
    VitRun* r = (VitRun*)run;
    Vit* m = &r->m;
    m->batch.micro_batches = o->grad_accum;
    vit_allocate(m);
    if (o->random_init) vit_random_weights(m, (uint64_t)o->seed);
    else vit_load_weights(m, o->model_dir);
    vit_init_trainable(m, (uint64_t)o->seed);
    if (o->adapter_dir) vit_load_adapter(m, o->adapter_dir, o, o->eval_only || !o->data_path);
    else if (o->eval_only) vit_load_checkpoint_head(m, o->model_dir);
}

// Rank 0's start-up line on the blocks recomputed, under --recompute auto or N.
static void vit_run_started(void* run, const TrainOptions* o, const Dist* dist) {
    VitRun* r = (VitRun*)run;
    if (!fit_recompute_auto(o) && !(r->md.recompute > 0 && r->md.recompute != RECOMPUTE_ALL)) return;
    char line[160];
    fit_recompute_line(line, sizeof(line), o, r->m.saved.ckpt.recomputed, r->cfg.layers, r->avail);
    printf("%s\n", line);
}

static const MemPlan* vit_run_base_plan(void* run) { return &((VitRun*)run)->base.plan; }
static void vit_run_free_base(void* run) { vit_free(&((VitRun*)run)->base); }

static void vit_run_close(void* run) {
    VitRun* r = (VitRun*)run;
    vit_data_close(&r->rd);
    vit_free(&r->m);
}

static const ModelOps vit_ops = {
    vit_flags,     vit_run_config,  vit_run_dry_run, vit_run_check,     vit_run_open,
    vit_run_plan,  vit_run_load,    vit_trainer,     vit_run_started,   vit_run_base_plan,
    vit_run_free_base, NULL,        vit_run_close,
};

#ifndef TESTING
int main(int argc, char** argv) {
    static VitRun run;  // zeroed; large (two models' tables), so not on the stack
    return train_main(&vit_ops, &run, argc, argv);
}
#endif
