// vit_fit_report.h: --dry-run --fit report for the ViT (llmc/train/fit_report.h): each memory mode's
// plan with --recompute auto's count under the budget (vit_fit_recompute), and its step predicted
// from the FLOPs per image (vit_flops_per_image, each recomputed block's forward counted again:
// vit_block_forward_flops).
#pragma once
#include "vit_plan.h"
#include "vit_step.h"
#include "../train/fit_report.h"

// One block's forward FLOPs per image: its linears' products (with their adapters) and attention's
// forward, a third of vit_flops_per_image's attention term, over the image's T tokens.
static double vit_block_forward_flops(const Vit* m) {
    const VitConfig* c = &m->cfg;
    double per_token = 4.0 * m->T * c->dim;
    for (int t = 0; t < N_TARGETS; t++) {
        int r = !m->modes.full && (m->modes.targets >> t & 1) ? m->modes.rank : 0;
        per_token += 2.0 * lin_in(c, t) * lin_out(c, t) + 2.0 * r * (double)(lin_in(c, t) + lin_out(c, t));
    }
    return m->T * per_token;
}

// A training run's calibration: its measured mean step and its own predicted ratio (its mode's
// cost at the blocks it recomputes).
static FitCalibration vit_fit_calibration(const Vit* m, const TrainOptions* o, double step_seconds) {
    int k = m->saved.ckpt.recomputed;
    FitCalibration cal = {step_seconds, fit_report_cost(vit_flops_per_image(m), vit_block_forward_flops(m), k), k,
                          o->act, o->norm};
    return cal;
}

// The report's rows for a micro-batch of o->batch images at h x w with `classes`, for `budget`
// bytes (as llama_fit_report's), calibrated by a training run's measured step (cal; NULL in a dry run).
static void vit_fit_report(const VitPlanCtx* pc, const TrainOptions* o, FitBudget budget, const FitCalibration* cal) {
    FitReportRow rows[FIT_REPORT_MODES];
    int world = pc->dist ? pc->dist->world : 1;
    for (int i = 0; i < FIT_REPORT_MODES; i++) {
        TrainOptions v = *o;
        v.act = fit_report_modes[i].act;
        v.norm = fit_report_modes[i].norm;
        v.recompute = "auto";
        TrainModes md = vit_fit_recompute(pc, train_modes_from(&v, target_names, N_TARGETS), o->batch, budget.bytes);
        Vit m;
        vit_setup(&m, pc->cfg, &md, o->batch, pc->h, pc->w, pc->classes, pc->src_bytes, pc->be, pc->dist);
        rows[i].bytes = vit_modes_plan_bytes(pc, md, o->batch, world);
        rows[i].fits = rows[i].bytes <= budget.bytes;
        rows[i].recomputed = m.saved.ckpt.recomputed;
        rows[i].predicted = fit_report_cost(vit_flops_per_image(&m), vit_block_forward_flops(&m), rows[i].recomputed);
        vit_free(&m);
    }
    fit_report_print(o, rows, pc->cfg->layers, budget.bytes, budget.source, cal);
}
