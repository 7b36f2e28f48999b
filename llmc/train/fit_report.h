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
// kept step is the same 1.00. A measured step calibrates it: `--fit report` on a training run
// (not a dry run) prints the table after the run's steps, each row's step in ms, from the run's
// own mean step after the first (the kept step is that over the run's own predicted ratio);
// scripts/bench/bench_fit.py does the same with --profile's step.
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

// A training run's measured step, which turns the rows' ratios into times (step_seconds 0: a dry
// run, ratios only). run_predicted: the run's own ratio (its mode's cost at its recomputed blocks).
typedef struct {
    double step_seconds;    // the run's mean step after the first
    double run_predicted;   // fit_report_cost at the run's own recomputed blocks
    int run_recomputed;
    const char *act, *norm; // the run's mode
} FitCalibration;

// A row's predicted step in seconds: the run's kept step (measured / its own ratio) times the row's ratio.
static double fit_report_seconds(const FitCalibration* cal, const FitReportRow* row) {
    return cal->step_seconds / cal->run_predicted * row->predicted;
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

// Prints the table (or with a dry run's --json one object: the budget and the rows); with a
// training run's calibration (cal non-NULL) each row's step in ms beside its ratio.
static void fit_report_print(const TrainOptions* o, const FitReportRow* rows, int layers, size_t budget,
                             const char* source, const FitCalibration* cal) {
    int best = fit_report_best(rows, FIT_REPORT_MODES);
    if (o->json) {  // a dry run's (--json is one): ratios only
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
    if (cal)
        printf("  calibrated by this run's measured step: %.1f ms (act %s, norm %s, recompute %d of %d blocks)\n",
               1e3 * cal->step_seconds, cal->act, cal->norm, cal->run_recomputed, layers);
    printf("  %-10s %-10s %-8s %12s %10s%s\n", "mode", "act,norm", "recompute", "planned", "predicted",
           cal ? "    ms/step" : "");
    for (int i = 0; i < FIT_REPORT_MODES; i++) {
        char act_norm[24], rec[24], ms[24] = "";
        snprintf(act_norm, sizeof(act_norm), "%s,%s", fit_report_modes[i].act, fit_report_modes[i].norm);
        snprintf(rec, sizeof(rec), "%d of %d", rows[i].recomputed, layers);
        if (cal) snprintf(ms, sizeof(ms), " %10.1f", 1e3 * fit_report_seconds(cal, &rows[i]));
        printf("  %-10s %-10s %-9s %9.2f MiB %9.3fx%s%s\n", fit_report_modes[i].name, act_norm,
               rows[i].fits ? rec : "no fit", rows[i].bytes / 1048576.0, rows[i].predicted, ms,
               i == best ? "  <- best" : "");
    }
    if (best < 0) printf("  none fits %s\n", a);
}
