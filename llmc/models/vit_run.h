// vit_run.h: a ViT run's state as the driver's operations (train_vit.cu, llmc/train/run.h's ModelOps)
// share it -- the config and modes from the flags, the fine-tuning resolution and the head's classes,
// the model and the baseline beside it, the data (llmc/models/vit_data.h) -- and its plan: the
// resolution, the dry run (the plan printed beside the baseline's), and the model at the run's
// resolution with --recompute auto fitted to the memory, checked against it.
#pragma once
#include "vit.h"
#include "vit_plan.h"
#include "vit_fit_report.h"
#include "vit_data.h"
#include "../train/fit.h"

// The run's state (llmc/train/run.h's `void* run`): the config and modes from the flags, the
// fine-tuning resolution and the head's classes, the model and the baseline planned beside it, the data.
typedef struct {
    VitConfig cfg;
    TrainModes md;         // as the flags give them
    TrainModes fitted;     // --recompute auto fitted to the memory (vit_fit_recompute)
    size_t avail;          // the memory it was fitted to (--mem-limit where that is less)
    int h, w, classes;
    Vit m, base;
    VitData rd;
} VitRun;

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
        VitData rd;
        vit_data_open(&rd, o, cfg, h, w, &classes);
        src_bytes = vit_data_src_bytes(&rd);
        vit_data_close(&rd);
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

// The model at the run's resolution, checked against the memory (on either backend, before any
// allocation), and the baseline beside it.
static void vit_run_plan(void* run, const TrainOptions* o, const Backend* be, const Dist* dist) {
    VitRun* r = (VitRun*)run;
    int64_t src_bytes = vit_data_src_bytes(&r->rd);
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
