// train_loop.h: the pieces of the training loop both trainers share around their model: the
// fault-injection hook, the non-finite step counter, when to stop and save, resume, the run's
// log.csv and the closing summary.
#pragma once
#include "common.h"
#include "plan.h"
#include "backend.h"
#include "train_common.h"
#include "checkpoint.h"

// LLMC_FAULT_NONFINITE_STEP=k makes step k's loss NaN (1-based), as a diverging run would: how the
// tests reach --nonfinite's two behaviours on demand. Unset, it changes nothing.
static float train_fault_injected_loss(float loss, int step) {
    const char* e = getenv("LLMC_FAULT_NONFINITE_STEP");
    return e && atoi(e) == step + 1 ? NAN : loss;
}

// --nonfinite skip: a run that keeps producing NaN stops instead of skipping forever. `in_a_row`
// counts the skipped steps since the last update.
#define TRAIN_MAX_SKIPS_IN_A_ROW 10
static void train_count_skip(int* in_a_row, int skipped, int step) {
    *in_a_row = skipped ? *in_a_row + 1 : 0;
    if (*in_a_row >= TRAIN_MAX_SKIPS_IN_A_ROW)
        fail("step %d: %d steps in a row had a non-finite loss or gradient (--nonfinite skip); lower --lr or check the data", step + 1,
             *in_a_row);
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

// --resume: every rank loads the saved state; returns the step to continue from (0 without).
static int train_resume(Trainable* tr, const TrainOptions* o, const char* settings, int64_t* cursor, int rank0) {
    if (!o->resume_dir) return 0;
    int start = (int)trainable_load_state(tr, o->resume_dir, settings, cursor);
    if (rank0) printf("resumed %s/train_state.bin at step %d\n", o->resume_dir, start);
    return start;
}

// The run's log.csv in its output directory (rank 0 only, else NULL): appended to on resume,
// otherwise started with the CSV header line.
static FILE* train_open_log(const TrainOptions* o, int rank0, const char* header) {
    const char* out = o->out_dir ? o->out_dir : o->resume_dir;
    if (!out || !rank0) return NULL;
    char* lp = path_join(out, "log.csv");
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
