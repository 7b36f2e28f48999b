// llama_fit_report.h: --dry-run --fit report for the LLaMA model (llmc/train/fit_report.h): each
// memory mode's plan with --recompute auto's count under the budget (llama_fit_to_memory), and its
// step predicted from the FLOPs per token (llama_flops_per_token, each recomputed block's forward
// counted again: llama_block_forward_flops).
#pragma once
#include "llama_plan.h"
#include "llama_step.h"
#include "../train/fit_report.h"

// One block's forward FLOPs per token: its linears' products (with their adapters) and attention's
// forward, a third of llama_flops_per_token's attention term (forward, and twice that backward).
static double llama_block_forward_flops(const Llama* m) {
    const LlamaConfig* c = &m->cfg;
    double f = 2.0 * m->sp.T * c->heads * c->head_dim;
    for (int t = 0; t < N_TARGETS; t++) {
        int r = !m->modes.full && (m->modes.targets >> t & 1) ? m->modes.rank : 0;
        f += 2.0 * lin_in(c, t) * lin_out(c, t) + 2.0 * r * (double)(lin_in(c, t) + lin_out(c, t));
    }
    return f;
}

// A training run's calibration: its measured mean step and its own predicted ratio (its mode's
// cost at the blocks it recomputes).
static FitCalibration llama_fit_calibration(const Llama* m, const TrainOptions* o, double step_seconds) {
    int k = m->saved.ckpt.recomputed;
    FitCalibration cal = {step_seconds, fit_report_cost(llama_flops_per_token(m), llama_block_forward_flops(m), k), k,
                          o->act, o->norm};
    return cal;
}

// The report's rows at o's shape for `budget` bytes (a dry run's: --gpu-mem, --mem-limit, or the
// device's; a training run's: the memory its own choices were fitted to), calibrated by a
// training run's measured step (cal; NULL in a dry run).
static void llama_fit_report(const LlamaConfig* cfg, const TrainOptions* o, int cpu, const Dist* dist,
                             FitBudget budget, const FitCalibration* cal) {
    Backend be = backend_for_plan(!cpu);
    Dist ranks = dist_for_plan(dist, o->ranks ? o->ranks : dist->world);
    ranks.sp = o->seq_parallel;
    FitReportRow rows[FIT_REPORT_MODES];
    for (int i = 0; i < FIT_REPORT_MODES; i++) {
        TrainOptions v = *o;
        v.act = fit_report_modes[i].act;
        v.norm = fit_report_modes[i].norm;
        v.recompute = "auto";
        TrainModes md = train_modes_from(&v, target_names, N_TARGETS);
        md = llama_fit_to_memory(cfg, md, o->batch, o->seq, &be, &ranks, budget.bytes);
        Llama m;
        llama_setup(&m, cfg, &md, o->batch, o->seq, &be, &ranks);
        rows[i].bytes = plan_total(&m.plan) + (be.cuda ? 0 : plan_host_bytes(&m.plan));
        rows[i].fits = rows[i].bytes <= budget.bytes;
        rows[i].recomputed = m.saved.ckpt.recomputed;
        rows[i].predicted =
            fit_report_cost(llama_flops_per_token(&m), llama_block_forward_flops(&m), rows[i].recomputed);
        llama_free(&m);
    }
    fit_report_print(o, rows, cfg->layers, budget.bytes, budget.source, cal);
}
