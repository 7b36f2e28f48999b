// loop.h: the pieces of the training loop both trainers share around their model: the
// fault-injection hook, the non-finite step counter, the end of a step (global loss, optimizer
// step), when to validate, stop and save, resume, the start-up lines, the step's line, the run's
// log.csv and the closing summary. Each trainer's loop (llama_train, vit_train) calls them in order.
#pragma once
#include "../common.h"
#include "../memory/plan.h"
#include "../backend.h"
#include "run_options.h"
#include "train_state.h"
#include "atomic_save.h"
#include "omp_policy.h"
#include <omp.h>

// LLMC_FAULT_NONFINITE_STEP=k makes step k's loss NaN (1-based), as a diverging run would: how the
// tests reach --nonfinite's two behaviours on demand. Unset, it changes nothing.
static float train_fault_injected_loss(float loss, int step) {
    const char* e = getenv("LLMC_FAULT_NONFINITE_STEP");
    return e && atoi(e) == step + 1 ? NAN : loss;
}

// --nonfinite skip: a run that keeps producing NaN (or diverged steps) stops instead of skipping
// forever. `in_a_row` counts the skipped steps since the last update.
#define TRAIN_MAX_SKIPS_IN_A_ROW 10
static void train_count_skip(int* in_a_row, int skipped, int step) {
    *in_a_row = skipped ? *in_a_row + 1 : 0;
    if (*in_a_row >= TRAIN_MAX_SKIPS_IN_A_ROW)
        fail("step %d: %d steps in a row were skipped for a non-finite loss or gradient, or a diverged or collapsed run "
             "(--nonfinite skip); lower --lr or check the data", step + 1, *in_a_row);
}

// One optimizer step as the loop reports it.
typedef struct {
    float loss, accuracy, grad_norm, lr;  // accuracy: NAN where the model counts none
    double items;          // global tokens or images of the step (all ranks)
    double comm_s;         // seconds spent in cross-rank communication
    int skipped;           // --nonfinite skip: no update this step
    const char* note;      // why no update was made (the log line says it), or NULL
} StepResult;

// The end of a step on every rank, after its micro-batches: their sums (sums[0] the loss, sums[1]
// the final-norm rows whose statistics left fp32's range, sums[2] the correct predictions when n
// is 3) added across ranks, the means over `count` items (the targets that count: NaN loss when
// there are none), then the optimizer step on that global loss; `classes` (vocabulary or
// classes) sets the loss of uniform predictions for health.h.
static StepResult train_step_finish(Trainable* tr, const TrainOptions* o, const Dist* dist, int step, double* sums, int n, double count,
                                    double items, int classes) {
    double t_comm = wall_seconds();
    dist_allreduce_sum_f64(dist, sums, n);
    StepResult r;
    r.comm_s = wall_seconds() - t_comm;
    r.items = items;
    r.loss = count > 0 ? (float)(sums[0] / count) : NAN;  // no target: no loss
    r.accuracy = n > 2 ? (float)(sums[2] / count) : NAN;
    r.loss = train_fault_injected_loss(r.loss, step);
    StepStats health = {r.loss, count, sums[1], classes};
    OptimStep os = trainable_step(tr, o, dist, step, &health);
    r.skipped = os.skipped;
    r.note = os.note;
    r.grad_norm = os.grad_norm;
    r.lr = os.lr;
    r.comm_s += os.comm_s;
    return r;
}

// Whether this step's validation runs: every --val-every steps, and at the last.
static int train_val_due(const TrainOptions* o, int step, int last) {
    return (o->val_every > 0 && (step + 1) % o->val_every == 0) || last;
}

// The step's line on stdout (rank 0): every --log-every steps, the last, one with validation
// (`val`: its text, or NULL) and one without an update (with its note). `unit`: what the throughput counts (tok, img).
static void train_print_step(const TrainOptions* o, const Dist* dist, int step, int last, const StepResult* r, double dt, const char* unit,
                             double flops_per_item, double peak_flops, const char* val) {
    if ((step + 1) % o->log_every != 0 && !last && !val && !r->note) return;
    printf("step %4d/%d | loss %.4f", step + 1, o->steps, r->loss);
    if (!isnan(r->accuracy)) printf(" | acc %.4f", r->accuracy);
    printf(" | lr %.2e | grad norm %.4f | %.0f %s/s", r->lr, r->grad_norm, r->items / dt, unit);
    if (dist->world > 1) printf(" (%.0f per rank, %.0f%% in all-reduce)", r->items / dt / dist->world, 100.0 * r->comm_s / dt);
    print_mfu(r->items / dt / dist->world, flops_per_item, peak_flops);
    if (val) printf(" | %s", val);
    if (r->note) printf(" | %s", r->note);
    printf("\n");
    fflush(stdout);
}

// The opening of both mains: the ranks (under mpirun), the options' defaults, the trainer's flag
// table (register_flags), then the command line parsed and checked.
static void train_start(Dist* dist, TrainOptions* o, int* argc, char*** argv, void (*register_flags)(FlagTable*, TrainOptions*)) {
    omp_policy_apply(*argv);  // before anything: it may execute the program again (llmc/train/omp_policy.h)
    dist_init(dist, argc, argv);
    train_options_defaults(o);
    FlagTable ft;
    memset(&ft, 0, sizeof(ft));
    register_flags(&ft, o);
    train_parse_flags(&ft, o, *argc, *argv);
}

// Parts of the start-up line (rank 0): what trains, and on what.
static void train_describe(const TrainOptions* o, const Backend* be, const Dist* dist, char* what, size_t nwhat, char* where, size_t nwhere) {
    if (o->full) snprintf(what, nwhat, "full fine-tuning of every weight");
    else {
        int k = snprintf(what, nwhat, "LoRA r=%d alpha=%g on %s", o->lora_rank, o->lora_alpha, o->lora_targets ? o->lora_targets : "all");
        if (o->lora_dropout > 0 && k >= 0 && (size_t)k < nwhat) snprintf(what + k, nwhat - k, ", dropout %g", o->lora_dropout);
    }
    if (be->cuda) snprintf(where, nwhere, "CUDA GPU %d x %d ranks", be->device, dist->world);
    else snprintf(where, nwhere, "CPU, %d threads x %d ranks", omp_get_max_threads(), dist->world);
}

// After the start-up line (rank 0): the memory plan beside the baseline's, and how the ranks
// share the gradients.
static void train_print_plan(const TrainOptions* o, const Backend* be, const Dist* dist, const MemPlan* plan, const MemPlan* base,
                             const Trainable* tr) {
    char layout[64];
    snprintf(layout, sizeof(layout), "%s%s", be->layout, dist->world > 1 ? ", per rank" : "");
    plan_print(plan, base, o->mode, layout);
    trainable_print_parallel(tr, dist);
}

// The step at which this run stops: --steps, or earlier with --stop-at (the schedule stays that
// of --steps, so a later --resume continues as if never stopped).
static int train_stop_step(const TrainOptions* o) {
    return o->stop_at > 0 && o->stop_at < o->steps ? o->stop_at : o->steps;
}

// Whether to write the adapter/model and the state after `step` steps (1-based).
static int train_save_due(const TrainOptions* o, int step) {
    return step == train_stop_step(o) || (o->save_every > 0 && step % o->save_every == 0);
}

// --resume: rank 0 first finishes or clears an interrupted save in the directory (atomic_save.h),
// then every rank loads the saved state; returns the step to continue from (0 without).
static int train_resume(Trainable* tr, const TrainOptions* o, const char* settings, int64_t* cursor, const Dist* dist) {
    if (!o->resume_dir) return 0;
    int rank0 = !dist || dist->rank == 0;
    if (rank0) save_dir_recover(o->resume_dir);
    dist_barrier(dist);
    int start = (int)trainable_load_state(tr, o->resume_dir, settings, cursor);
    if (rank0) printf("resumed %s/train_state.bin at step %d\n", o->resume_dir, start);
    return start;
}

// A resumed run's log.csv keeps its header and the rows of steps up to `start`: the steps about to
// be replayed would otherwise appear twice (and a row cut short by a kill goes too). Rewritten
// through a temporary file, so a kill here leaves the old log.
static void train_trim_log(const char* path, int start, const char* header) {
    size_t n = 0;
    char* text = read_file_or_null(path, &n);
    AtomicFile a = atomic_open(path);
    if (!text || n == 0 || text[0] < 'a' || text[0] > 'z') fprintf(a.f, "%s\n", header);
    for (char *line = text, *end; line && (end = strchr(line, '\n')); line = end + 1) {
        int is_row = line[0] >= '0' && line[0] <= '9';
        if (!is_row || atoll(line) <= start) fwrite(line, 1, (size_t)(end - line) + 1, a.f);
    }
    atomic_commit(&a);
    free(text);
}

// The run's log.csv in its output directory (rank 0 only, else NULL): on resume, trimmed to the
// resumed step and appended to; otherwise started with the CSV header line.
static FILE* train_open_log(const TrainOptions* o, int rank0, const char* header, int start) {
    const char* out = o->out_dir ? o->out_dir : o->resume_dir;
    if (!out || !rank0) return NULL;
    char* lp = path_join(out, "log.csv");
    if (o->resume_dir) train_trim_log(lp, start, header);
    FILE* log = fopen(lp, o->resume_dir ? "a" : "w");
    if (!log) fail("flag --out: cannot write %s (%s)", lp, strerror(errno));
    if (!o->resume_dir) fprintf(log, "%s\n", header);
    free(lp);
    return log;
}

// The last lines of a training run (rank 0): steps and time, where the outputs went, and the
// planned memory beside the measured peak.
static void train_print_summary(const TrainOptions* o, int start, int stop, double seconds, double comm_s, int full, const MemPlan* plan,
                                const Backend* be) {
    const char* out = o->out_dir ? o->out_dir : o->resume_dir;
    printf("trained %d steps in %.1f s (%.1f s in all-reduce)%s%s\n", stop - start, seconds, comm_s,
           out ? (full ? ", model and state in " : ", adapter and state in ") : "", out ? out : "");
    if (stop < o->steps) printf("stopped at step %d of %d (--stop-at); continue with --resume %s\n", stop, o->steps, out ? out : "OUT");
    backend_print_memory(be, plan);
}
