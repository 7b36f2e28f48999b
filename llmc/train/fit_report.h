// fit_report.h: --dry-run --fit report, the table of the fastest run that fits: for each memory
// mode (baseline, lowmem, and the act-only and norm-only halves) the fewest recomputed blocks whose
// plan fits the budget (--recompute auto's choice, llmc/train/fit.h), its planned memory and its
// predicted step time, the fastest row that fits marked. The trainers fill the rows (their plans);
// this header holds the modes, the cost model and the printing.
//
// The cost model counts FLOPs per token (llmc/linear.h's linear_train_flops, the trainers'
// flops_per_token / flops_per_image): a step is the model's training FLOPs, and each recomputed
// block adds its forward again (its linears' products and its attention's forward). The time is
// predicted relative to the same mode's step with no block recomputed ("x1.00"); the memory modes'
// own costs (ReSiLU2's 2-bit codes, MS norms' merged gamma) are not modelled, so every mode's
// kept step is the same 1.00. A measured step calibrates it: scripts/bench/bench_fit.py multiplies
// the ratio by the measured baseline step (--profile's table gives the split by op).
#pragma once
#include "../common.h"
#include "run_options.h"
#include "fit.h"

typedef struct {
    const char* name;  // what the table calls it
    const char *act, *norm;
} FitReportMode;

enum { FIT_REPORT_MODES = 4 };
static const FitReportMode fit_report_modes[FIT_REPORT_MODES] = {
    {"baseline", "exact", "std"}, {"lowmem", "approx", "ms"},
    {"act-only", "approx", "std"}, {"norm-only", "exact", "ms"}};

typedef struct {
    int fits;         // the plan with `recomputed` blocks fits the budget (none fits: every block, and 0)
    int recomputed;   // --recompute auto's count under the budget
    size_t bytes;     // its plan, as the fit check counts it
    double predicted; // step time relative to the mode's step with no block recomputed
} FitReportRow;

// The predicted step of k recomputed blocks over the kept one: (step + k * block forward) / step,
// per token (or image), in FLOPs.
static double fit_report_cost(double step_flops, double block_forward_flops, int k) {
    return (step_flops + k * block_forward_flops) / step_flops;
}

// The index of the fastest row that fits (the less memory on a tie), or -1 where none fits.
static int fit_report_best(const FitReportRow* rows, int n) {
    int best = -1;
    for (int i = 0; i < n; i++) {
        if (!rows[i].fits) continue;
        if (best < 0 || rows[i].predicted < rows[best].predicted ||
            (rows[i].predicted == rows[best].predicted && rows[i].bytes < rows[best].bytes))
            best = i;
    }
    return best;
}

// Prints the table (or with --json one object: the budget and the rows).
static void fit_report_print(const TrainOptions* o, const FitReportRow* rows, int layers, size_t budget,
                             const char* source) {
    int best = fit_report_best(rows, FIT_REPORT_MODES);
    if (o->json) {
        printf("{\"budget_bytes\": %zu, \"budget_source\": \"%s\", \"layers\": %d, \"best\": %s%s%s, \"rows\": [",
               budget, source, layers, best < 0 ? "" : "\"", best < 0 ? "null" : fit_report_modes[best].name,
               best < 0 ? "" : "\"");
        for (int i = 0; i < FIT_REPORT_MODES; i++)
            printf("%s{\"mode\": \"%s\", \"act\": \"%s\", \"norm\": \"%s\", \"fits\": %s, \"recomputed_blocks\": %d, "
                   "\"planned_bytes\": %zu, \"predicted_step\": %.4f}", i ? ", " : "", fit_report_modes[i].name,
                   fit_report_modes[i].act, fit_report_modes[i].norm, rows[i].fits ? "true" : "false",
                   rows[i].recomputed, rows[i].bytes, rows[i].predicted);
        printf("]}\n");
        return;
    }
    char a[32];
    printf("fit report: budget %s (%s); the fewest recomputed blocks that fit, and the step predicted from "
           "FLOPs (each recomputed block's forward counted again) relative to the mode's step with none\n",
           fit_size(a, sizeof(a), budget), source);
    printf("  %-10s %-10s %-8s %12s %10s\n", "mode", "act,norm", "recompute", "planned", "predicted");
    for (int i = 0; i < FIT_REPORT_MODES; i++) {
        char act_norm[24], rec[24];
        snprintf(act_norm, sizeof(act_norm), "%s,%s", fit_report_modes[i].act, fit_report_modes[i].norm);
        snprintf(rec, sizeof(rec), "%d of %d", rows[i].recomputed, layers);
        printf("  %-10s %-10s %-9s %9.2f MiB %9.3fx%s\n", fit_report_modes[i].name, act_norm,
               rows[i].fits ? rec : "no fit", rows[i].bytes / 1048576.0, rows[i].predicted,
               i == best ? "  <- best" : "");
    }
    if (best < 0) printf("  none fits %s\n", a);
}
