// train_vit.cu: fine-tuning of Vision Transformers (ViT-B/16 style) for image classification (LoRA
// adapters and a new head, or every weight with --full) with the memory-saving backward pass of
// "Reducing Fine-Tuning Memory Overhead by Approximate and Memory-Sharing Backpropagation"
// (ReGELU2 and MS-LN).
//
// The model is llmc/models/vit.h (config, parameters, forward, backward), read first; beside it
// its memory plan (llmc/models/vit_plan.h), its I/O (llmc/models/vit_io.h) and its training step
// (llmc/models/vit_step.h). This file holds what the ViT's run adds around them: the fine-tuning
// resolution, the image data, the dry run, the table the shared training loop drives
// (llmc/train/loop.h), the flags and main.
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

// ----------------------------------------------------------------------------------------------
// The run's resolution and data, and the dry run

// The fine-tuning resolution: --image-size S or HxW, else the checkpoint's.
static void vit_resolution(const VitConfig* c, const char* flag, int* h, int* w) {
    *h = c->image_h;
    *w = c->image_w;
    if (!flag) return;
    char extra;
    if (sscanf(flag, "%dx%d%c", h, w, &extra) == 2) {
    } else if (sscanf(flag, "%d%c", h, &extra) == 1) {
        *w = *h;
    } else {
        fail("flag --image-size: expected S or HxW, got \"%s\"", flag);
    }
    if (*h < 1 || *w < 1 || *h > 65536 || *w > 65536)
        fail("flag --image-size: expected sides in 1..65536, got \"%s\"", flag);
}

// --dry-run --json: the run's settings as the fields of a JSON object, into buf (plan_json writes them).
static void vit_settings_json(char* buf, size_t n, const TrainOptions* o, const Vit* m, const char* device) {
    snprintf(buf, n,
             "\"model\": \"vit\", \"device\": \"%s\", \"mode\": \"%s\", \"act\": \"%s\", \"norm\": \"%s\", "
             "\"recompute\": \"%s\", \"offload\": \"%s\", "
             "\"batch\": %d, \"image_size\": [%d, %d], \"tokens_per_image\": %d, \"classes\": %d, \"lora_rank\": %d, "
             "\"lora_dropout\": %g, \"lora_targets\": \"%s\"",
             device, o->mode, o->act, o->norm, o->recompute, o->offload, o->batch, m->img_h, m->img_w, m->T, m->classes,
             o->lora_rank, o->lora_dropout, o->lora_targets ? o->lora_targets : "q,k,v,proj,fc1,fc2");
}

typedef struct {           // what a run reads besides the model
    ImageShard train, val;
    ImageLoader tl, vl;
    int have_train, have_val;
} RunData;

// Opens the shards (the head's class count must cover their labels) and their loaders.
static void run_data_open(RunData* rd, const TrainOptions* o, const VitConfig* c, int h, int w, int* classes) {
    memset(rd, 0, sizeof(*rd));
    if (o->data_path) { image_shard_load(&rd->train, o->data_path); rd->have_train = 1; }
    if (o->val_path) { image_shard_load(&rd->val, o->val_path); rd->have_val = 1; }
    *classes = o->classes ? o->classes : rd->have_train ? rd->train.classes : rd->val.classes;
    // --eval-only of a model directory: the head it carries says (an export of a 7-class head reloads as one)
    int carried = o->eval_only && !o->classes && !o->adapter_dir ? vit_checkpoint_head_rows(o->model_dir) : 0;
    if (carried) *classes = carried;
    // --export-merged alone: the adapter's head says
    if (*classes == 0 && o->adapter_dir) *classes = peft_saved_module_rows(o->adapter_dir, vit_hf_head);
    if (*classes <= 0)
        fail("flag --classes: give the head's class count (no --data, --val or adapter head to take it from)");
    if (*classes == 1 && !o->classes)
        fail("%s: the header says 1 class; a 1-class head's loss is 0 by construction, nothing to learn; give "
             "--classes N (N >= 2) or a shard of 2 or more classes", rd->have_train ? o->data_path : o->val_path);
    if (rd->have_train && rd->train.classes > *classes)
        fail("%s: the shard has %d classes, more than --classes %d", o->data_path, rd->train.classes, *classes);
    if (rd->have_val && rd->val.classes > *classes)
        fail("%s: the shard has %d classes, more than the head's %d", o->val_path, rd->val.classes, *classes);
    if (rd->have_train) vit_preprocessor_check_images(&c->pre, o->data_path, rd->train.H, rd->train.W);
    if (rd->have_val) vit_preprocessor_check_images(&c->pre, o->val_path, rd->val.H, rd->val.W);
    if (rd->have_train)
        image_loader_init(&rd->tl, &rd->train, h, w, c->channels, c->mean, c->std, (uint64_t)o->seed, 1, o->hflip);
    if (rd->have_val) image_loader_init(&rd->vl, &rd->val, h, w, c->channels, c->mean, c->std, (uint64_t)o->seed, 0, 0);
}

// The largest source image of the open shards, in bytes (what the GPU's raw-image buffer holds).
static int64_t run_data_src_bytes(const RunData* rd) {
    int64_t m = 0;
    if (rd->have_train) m = (int64_t)rd->train.H * rd->train.W * rd->train.C;
    if (rd->have_val && (int64_t)rd->val.H * rd->val.W * rd->val.C > m) m = (int64_t)rd->val.H * rd->val.W * rd->val.C;
    return m;
}

static void run_data_close(RunData* rd) {
    if (rd->have_train) { image_loader_free(&rd->tl); image_shard_free(&rd->train); }
    if (rd->have_val) { image_loader_free(&rd->vl); image_shard_free(&rd->val); }
}

// --dry-run: the plan of the run these flags describe, and the baseline plan beside it (with
// --data or --val, for their class count and image size; else --classes or 10). Under mpirun, or for --ranks N, the
// plan is per rank (ZeRO-1 under --full).
static void vit_dry_run(const VitConfig* cfg, const TrainOptions* o, TrainModes md, const Dist* dist) {
    int cpu = strcmp(o->device, "cpu") == 0;  // a dry run plans the CUDA layout unless told otherwise
    Backend be = backend_for_plan(!cpu);
    Dist ranks = dist_for_plan(dist, o->ranks ? o->ranks : dist->world);
    int h, w, classes = o->classes > 0 ? o->classes : 10;
    int64_t src_bytes = 0;
    vit_resolution(cfg, o->image_size, &h, &w);
    if (o->data_path || o->val_path) {  // the shards' class count and image size, as a run has them
        RunData rd;
        run_data_open(&rd, o, cfg, h, w, &classes);
        src_bytes = run_data_src_bytes(&rd);
        run_data_close(&rd);
    }
    Vit m, base;
    size_t budget = o->gpu_mem > 0 || o->mem_limit > 0 ? fit_budget(o, !cpu, "--mem-limit").bytes : 0;
    VitPlanCtx pc = {cfg, h, w, classes, src_bytes, &be, &ranks};
    if (!strcmp(o->fit, "report")) {
        vit_fit_report(&pc, o, fit_budget(o, !cpu, "--fit report"), NULL);
        return;
    }
    TrainModes given = md;
    md = vit_fit_recompute(&pc, md, o->batch, budget);  // --recompute auto: none where no memory is known
    vit_setup(&m, cfg, &md, o->batch, h, w, classes, src_bytes, &be, &ranks);
    TrainModes bm = train_baseline_modes(md);
    vit_setup(&base, cfg, &bm, o->batch, h, w, classes, src_bytes, &be, NULL);
    char json[768], header[1024];
    vit_settings_json(json, sizeof(json), o, &m, cpu ? "cpu" : "cuda");
    snprintf(header, sizeof(header), "train_vit dry run: d=%d f=%d layers=%d heads=%d, image %dx%d patch %dx%d "
             "(%d tokens), %d classes, batch %d, ", cfg->dim, cfg->hidden, cfg->layers, cfg->heads, h, w,
             cfg->patch_h, cfg->patch_w, m.T, classes, o->batch);
    if (o->full) str_appendf(header, sizeof(header), "full fine-tuning");
    else
        str_appendf(header, sizeof(header), "LoRA r=%d on %s", o->lora_rank, o->lora_targets ? o->lora_targets : "all");
    if (ranks.world > 1) str_appendf(header, sizeof(header), ", one of %d ranks", ranks.world);
    if (given.recompute != 0 && given.recompute != RECOMPUTE_ALL) {  // auto or N: how many, and why
        char rec[160];
        fit_recompute_line(rec, sizeof(rec), o, m.saved.ckpt.recomputed, cfg->layers, budget);
        str_appendf(header, sizeof(header), "\n%s", rec);
    }
    str_appendf(json, sizeof(json), ", \"recomputed_blocks\": %d", m.saved.ckpt.recomputed);
    if (budget) {  // --mem-limit: the plan's verdict against it, as the run's fit check counts it
        size_t need = plan_total(&m.plan) + (be.cuda ? 0 : plan_host_bytes(&m.plan));
        str_appendf(json, sizeof(json), ", \"memory_bytes\": %zu, \"fits\": %s", budget,
                    need <= budget ? "true" : "false");
        char a[32], b[32];
        str_appendf(header, sizeof(header), "\n%s %s: the plan needs %s", need <= budget ? "fits" : "does not fit",
                    fit_size(a, sizeof(a), budget), fit_size(b, sizeof(b), need));
    }
    train_dry_run_report(o, &m.plan, &base.plan, &be, json, header);
    vit_free(&m);
    vit_free(&base);
}

// ----------------------------------------------------------------------------------------------
// The model as the shared training loop sees it (llmc/train/loop.h's Trainer)

// The run's state (llmc/train/run.h's `void* run`): the config and modes from the flags, the
// fine-tuning resolution and the head's classes, the model and the baseline planned beside it, the data.
typedef struct {
    VitConfig cfg;
    TrainModes md;         // as the flags give them
    TrainModes fitted;     // --recompute auto fitted to the memory (vit_fit_recompute)
    size_t avail;          // the memory it was fitted to (--mem-limit where that is less)
    int h, w, classes;
    Vit m, base;
    RunData rd;
} VitRun;

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
    const RunData* rd = &((VitRun*)run)->rd;
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
    VitPlanCtx pc = {&r->cfg, r->h, r->w, r->classes, run_data_src_bytes(&r->rd), r->m.be, dist};
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
    flag_choice(t, "offload", &o->offload, "none|host",
                "with --recompute block, N or auto: the recomputed blocks' checkpoints in pinned host memory, "
                "copied beside the compute");
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
    run_data_open(&r->rd, o, &r->cfg, r->h, r->w, &r->classes);
}

// The model at the run's resolution, checked against the memory (on either backend, before any
// allocation), and the baseline beside it.
static void vit_run_plan(void* run, const TrainOptions* o, const Backend* be, const Dist* dist) {
    VitRun* r = (VitRun*)run;
    int64_t src_bytes = run_data_src_bytes(&r->rd);
    VitPlanCtx pc = {&r->cfg, r->h, r->w, r->classes, src_bytes, be, dist};
    r->avail = fit_run_avail(be, o, dist->local_size);
    TrainModes md = r->md;  // --recompute auto (asked, or the default where the run would not fit otherwise)
    if (fit_recompute_auto(o)) md.recompute = RECOMPUTE_AUTO;
    size_t smallest = vit_modes_plan_bytes(&pc, md, o->batch, dist->world);
    char what[96];
    snprintf(what, sizeof(what), "recompute %d of %d blocks", md.recompute == RECOMPUTE_AUTO ? r->cfg.layers
             : train_recomputed_blocks(&md, r->cfg.layers), r->cfg.layers);
    fit_refuse_mem_limit(o, smallest, smallest, what);
    if (md.recompute == RECOMPUTE_AUTO && smallest > r->avail && strcmp(o->recompute, "auto") != 0) md = r->md;
    r->fitted = vit_fit_recompute(&pc, md, o->batch, r->avail);
    vit_setup(&r->m, &r->cfg, &r->fitted, o->batch, r->h, r->w, r->classes, src_bytes, be, dist);
    fit_check_plan(be, &r->m.plan, vit_plan_bytes, &pc, o, dist->world, dist->local_size);
    TrainModes bm = train_baseline_modes(r->md);
    vit_setup(&r->base, &r->cfg, &bm, o->batch, r->h, r->w, r->classes, src_bytes, be, dist);
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
    run_data_close(&r->rd);
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
