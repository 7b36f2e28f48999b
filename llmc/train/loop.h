// loop.h: the pieces of the training loop both trainers share around their model: the
// fault-injection hooks, the non-finite step counter, the end of a step (global loss, optimizer
// step), when to validate, stop and save, resume, the start-up lines, the step's line, the run's
// log.csv and the closing summary; and the run skeleton that calls them: a model's Trainer table
// (its step, validation, save and export) driven by train_run, the same for every model.
#pragma once
#include "../common.h"
#include "../memory/plan.h"
#include "../backend.h"
#include "run_options.h"
#include "train_state.h"
#include "atomic_save.h"
#include "omp_policy.h"
#include "profile.h"
#include <omp.h>
#include <signal.h>

// LLMC_FAULT_NONFINITE_STEP=k makes step k's loss NaN (1-based), as a diverging run would: how the
// tests reach --nonfinite's two behaviours on demand. Unset, or a release build, it changes nothing.
static float train_fault_injected_loss(float loss, int step) {
#ifdef LLMC_FAULTS
    if (setting_count(SETTING_FAULT_NONFINITE_STEP) == step + 1) return NAN;
#endif
    (void)step;
    return loss;
}

// LLMC_FAULT_STOP_STEP=k stops this process as step k (1-based) begins: with an error (fail, as a
// bad read would), or, as k:kill, by SIGKILL (as the OOM killer or a lost node would). Set on one
// rank of an mpirun job, the others run on into the step's collectives: how the tests check that
// one rank's end stops the whole job instead of leaving it waiting. Unset, or a release build, it
// changes nothing.
static void train_fault_stop(int step) {
#ifdef LLMC_FAULTS
    const char* e = setting_text(SETTING_FAULT_STOP_STEP);
    if (!e || atoi(e) != step + 1) return;
    if (strstr(e, ":kill")) raise(SIGKILL);
    fail("step %d: stopped by LLMC_FAULT_STOP_STEP=%s (an injected fault)", step + 1, e);
#else
    (void)step;
#endif
}

// --nonfinite skip: a run that keeps producing NaN (or diverged steps) stops instead of skipping
// forever. `in_a_row` counts the skipped steps since the last update.
#define TRAIN_MAX_SKIPS_IN_A_ROW 10
static void train_count_skip(int* in_a_row, int skipped, int step) {
    *in_a_row = skipped ? *in_a_row + 1 : 0;
    if (*in_a_row >= TRAIN_MAX_SKIPS_IN_A_ROW)
        fail(
            "step %d: %d steps in a row were skipped for a non-finite loss or gradient, or a diverged or collapsed run "
            "(--nonfinite skip); lower --lr or check the data",
            step + 1, *in_a_row);
}

// One optimizer step as the loop reports it.
typedef struct {
    float loss, accuracy, grad_norm, lr;  // accuracy: NAN where the model counts none
    double items;          // global tokens or images of the step (all ranks)
    double comm_s;         // seconds spent in cross-rank communication
    int skipped;           // --nonfinite skip: no update this step
    const char* note;      // why no update was made (the log line says it), or NULL
    int n_extra;           // the model's further statistics (Trainer's extra_names), or 0
    double extra[8];
} StepResult;

// The names of a step's further statistics (StepResult's extra), as the step line and log.csv show them.
typedef struct {
    int n;
    const char* const* names;
    const char* val_accuracy;  // the name of validation's accuracy where a non-classifier reports one, or NULL
} ExtraStats;

// The end of a step on every rank, after its micro-batches: their sums (sums[0] the loss, sums[1]
// the final-norm rows whose statistics left fp32's range, sums[2] the correct predictions when n
// is 3) added across ranks, the means over `count` items (the targets that count: NaN loss when
// there are none), then the optimizer step on that global loss; `classes` (vocabulary or
// classes) sets the loss of uniform predictions for health.h. With the step's statistics on the
// device (trainable_step_stats) the sums come from there, with the gradient's sum of squares, in
// the step's one readback.
static StepResult train_step_finish(Trainable* tr, const TrainOptions* o, const Dist* dist, int step, double* sums,
                                    int n, double count, double items, int classes) {
    double t_comm = wall_seconds();
    trainable_sum_grads(tr, dist);
    double comm = wall_seconds() - t_comm;
    double ss = trainable_sum_squares(tr);
    if (trainable_step_stats(tr)) {
        double h[STEP_STATS];
        trainable_read_step_stats(tr, h);
        // added to the host's: a pass that left its statistics on the device returned none; a preference
        // step's pair loss is the host's (llmc/models/llama_pref.h)
        sums[0] += h[STEP_LOSS];
        sums[1] += h[STEP_OVERFLOWED];
        if (n > 2) sums[2] += h[STEP_CORRECT];
        ss = h[STEP_SUMSQ];
    }
    t_comm = wall_seconds();
    dist_allreduce_sum_f64(dist, sums, n);
    StepResult r;
    memset(&r, 0, sizeof(r));
    r.comm_s = comm + wall_seconds() - t_comm;
    r.items = items;
    r.loss = count > 0 ? (float)(sums[0] / count) : NAN;  // no target: no loss
    r.accuracy = n > 2 ? (float)(sums[2] / count) : NAN;
    r.loss = train_fault_injected_loss(r.loss, step);
    StepStats health = {r.loss, count, sums[1], classes};
    OptimStep os = trainable_step(tr, o, dist, step, &health, ss);
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
static void train_print_step(const TrainOptions* o, const Dist* dist, int step, int last, const StepResult* r,
                             double dt, const char* unit, double flops_per_item, double peak_flops, const char* val,
                             const ExtraStats* ex) {
    if ((step + 1) % o->log_every != 0 && !last && !val && !r->note) return;
    printf("step %4d/%d | loss %.4f", step + 1, o->steps, r->loss);
    if (!isnan(r->accuracy)) printf(" | acc %.4f", r->accuracy);
    for (int i = 0; i < r->n_extra && i < ex->n; i++) printf(" | %s %.4f", ex->names[i], r->extra[i]);
    printf(" | lr %.2e | grad norm %.4f | %.0f %s/s", r->lr, r->grad_norm, r->items / dt, unit);
    if (dist->world > 1)
        printf(" (%.0f per rank, %.0f%% in all-reduce)", r->items / dt / dist->world, 100.0 * r->comm_s / dt);
    print_mfu(r->items / dt / dist->world, flops_per_item, peak_flops);
    if (val) printf(" | %s", val);
    if (r->note) printf(" | %s", r->note);
    printf("\n");
    fflush(stdout);
}

// The opening of both mains: the ranks (under mpirun), the options' defaults, the trainer's flag
// table (register_flags), then the command line parsed and checked.
static void train_start(Dist* dist, TrainOptions* o, int* argc, char*** argv,
                        void (*register_flags)(FlagTable*, TrainOptions*)) {
    omp_policy_apply(*argv);  // before anything: it may execute the program again (llmc/train/omp_policy.h)
    dist_init(dist, argc, argv);
    settings_load();  // every environment setting, once, before anything asks (llmc/settings.h)
    train_options_defaults(o);
    FlagTable ft;
    memset(&ft, 0, sizeof(ft));
    register_flags(&ft, o);
    train_parse_flags(&ft, o, *argc, *argv);
    if (o->threads > 0) omp_set_num_threads(o->threads);  // before any plan: the CPU's per-call scratch is per thread
    char values[DIST_LINE_BYTES];
    flags_values(&ft, values, sizeof(values));
    dist_check_same(dist, "the flags", values);
}

// Parts of the start-up line (rank 0): what trains, and on what.
static void train_describe(const TrainOptions* o, const Backend* be, const Dist* dist, char* what, size_t nwhat,
                           char* where, size_t nwhere) {
    if (o->full) snprintf(what, nwhat, "full fine-tuning of every weight");
    else {
        int k = snprintf(what, nwhat, "LoRA r=%d alpha=%g on %s", o->lora_rank, o->lora_alpha,
                         o->lora_targets ? o->lora_targets : "all");
        if (o->lora_dropout > 0 && k >= 0 && (size_t)k < nwhat)
            snprintf(what + k, nwhat - k, ", dropout %g", o->lora_dropout);
    }
    if (be->cuda) snprintf(where, nwhere, "CUDA GPU %d x %d ranks", be->device, dist->world);
    else snprintf(where, nwhere, "CPU, %d threads x %d ranks", omp_get_max_threads(), dist->world);
}

// After the start-up line (rank 0): the memory plan beside the baseline's, and how the ranks
// share the gradients.
static void train_print_plan(const TrainOptions* o, const Backend* be, const Dist* dist, const MemPlan* plan,
                             const MemPlan* base, const Trainable* tr) {
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
    int64_t step = trainable_load_state(tr, o->resume_dir, settings, cursor);
    if (step > o->steps)  // the settings hold --steps, so only a corrupt state gets here
        fail("%s/train_state.bin: step %lld is beyond the schedule's %d steps (the state is corrupt)", o->resume_dir,
             (long long)step, o->steps);
    int start = (int)step;
    if (o->stop_at > 0 && o->stop_at < start)  // the run would go backwards: "trained -3 steps"
        fail("flag --stop-at: step %d is before the saved step %d of %s/train_state.bin; give a later --stop-at, or "
             "none to run to --steps %d", o->stop_at, start, o->resume_dir, o->steps);
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
    struct stat st;  // a FIFO there would block the open until read; a link is never followed
    if (lstat(lp, &st) == 0 && !S_ISREG(st.st_mode))
        fail("flag --%s: %s is %s, expected a regular file", o->out_dir ? "out" : "resume", lp,
             S_ISLNK(st.st_mode) ? "a symbolic link" : file_kind(st.st_mode));
    if (o->resume_dir) train_trim_log(lp, start, header);
    FILE* log = open_output(lp, o->resume_dir ? OUTPUT_APPEND : OUTPUT_TRUNCATE);
    if (!log) fail("flag --out: cannot write %s (%s)", lp, strerror(errno));
    if (!o->resume_dir) fprintf(log, "%s\n", header);
    free(lp);
    return log;
}

// The last lines of a training run (rank 0): steps and time, where the outputs went, and the
// planned memory beside the measured peak.
static void train_print_summary(const TrainOptions* o, int start, int stop, double seconds, double comm_s, int full,
                                const MemPlan* plan, const Backend* be) {
    const char* out = o->out_dir ? o->out_dir : o->resume_dir;
    int saved = out && stop > start;  // with no step there was nothing to save (log.csv only)
    printf("trained %d steps in %.1f s (%.1f s in all-reduce)%s%s\n", stop - start, seconds, comm_s,
           saved ? (full ? ", model and state in " : ", adapter and state in ") : "", saved ? out : "");
    if (stop < o->steps)
        printf("stopped at step %d of %d (--stop-at); continue with --resume %s\n", stop, o->steps, out ? out : "OUT");
    backend_print_memory(be, plan);
}

// ---- the run skeleton --------------------------------------------------------------------------

// What a validation pass reports: the mean loss over `items` (targets or images) and, for a
// classifier, its top-1 accuracy (NAN for a language model).
typedef struct {
    float loss, accuracy;
    int64_t items;
} EvalResult;

// A model as the shared run sees it: the model behind `model`, what the loop reports about it, and
// the functions the loop calls. Each driver fills one in (llama_trainer, vit_trainer).
typedef struct {
    void* model;                       // the driver's run state (its model and data)
    const char* unit;                  // what the throughput counts on a step's line: "tok", "img"
    const char* items;                 // the same in log.csv's column name: "tokens", "images"
    int classifier;                    // reports accuracy: log.csv gets the accuracy columns
    ExtraStats extra;                  // further statistics of a step (none: zero)
    double flops_per_item;             // training FLOPs per item, for the MFU
    Trainable* tr;
    const MemPlan* plan;
    const Backend* be;
    int full;                          // --full: a save writes the model, not an adapter
    int have_val;                      // --val was given
    int64_t* cursor;                   // the training data's position, saved with the state
    uint64_t data_fingerprint;         // the training data's identity (shard_fingerprint, ...)
    char settings[STATE_SETTINGS_BYTES];  // what a resumed run must share with the saved one
    StepResult (*step)(void* model, const TrainOptions* o, const Dist* dist, int step);
    EvalResult (*evaluate)(void* model, int batches);
    void (*save_adapter)(void* model, const TrainOptions* o, const char* dir);
    void (*export_merged)(void* model, const TrainOptions* o, const char* dir);
    // the model's start-up line, given what trains and where (train_describe)
    void (*print_start)(void* model, const TrainOptions* o, const char* what, const char* where);
    // --fit report on a training run (rank 0, after the steps): the table, calibrated by the run's
    // mean step after the first (llmc/train/fit_report.h)
    void (*fit_report)(void* model, const TrainOptions* o, const Dist* dist, double step_seconds);
} Trainer;

// The start of a run on rank 0: the device, the model's line, and the memory plan beside the
// baseline's (`base`).
static void train_print_start(const Trainer* t, const TrainOptions* o, const Dist* dist, const MemPlan* base) {
    backend_print_device(t->be, dist->world > 1 || dist_has_nccl(dist) ? dist_gpu_collectives(dist) : NULL);
    char what[160], where[64];
    train_describe(o, t->be, dist, what, sizeof(what), where, sizeof(where));
    t->print_start(t->model, o, what, where);
    settings_print_set();
    train_print_plan(o, t->be, dist, t->plan, base, t->tr);
}

// A validation result as the step's line shows it.
static void train_eval_text(const Trainer* t, EvalResult e, char* buf, size_t n) {
    if (t->extra.val_accuracy)
        snprintf(buf, n, "val loss %.4f | val %s %.4f", e.loss, t->extra.val_accuracy, e.accuracy);
    else if (t->classifier) snprintf(buf, n, "val loss %.4f | val acc %.4f", e.loss, e.accuracy);
    else snprintf(buf, n, "val loss %.4f", e.loss);
}

// log.csv's columns: the step's loss (and accuracy), rate, norm and throughput, then validation's.
static void train_log_header(const Trainer* t, char* buf, size_t n) {
    const char* acc = t->classifier ? ",accuracy" : "";
    const char* val_acc = t->classifier ? ",val_accuracy" : "";
    snprintf(buf, n, "step,loss%s,lr,grad_norm,%s_per_s", acc, t->items);
    for (int i = 0; i < t->extra.n; i++) str_appendf(buf, n, ",%s", t->extra.names[i]);
    str_appendf(buf, n, ",val_loss%s", val_acc);
    if (t->extra.val_accuracy) str_appendf(buf, n, ",val_%s", t->extra.val_accuracy);
}

// One row of log.csv: the step's columns (empty for step 0, the model before training) and the
// validation's (empty where none ran).
static void train_log_row(FILE* log, const Trainer* t, int step, const StepResult* r, double dt, EvalResult e) {
    if (!log) return;
    fprintf(log, "%d,", step);
    if (r) {
        fprintf(log, "%.6f,", r->loss);
        if (t->classifier) fprintf(log, "%.6f,", r->accuracy);
        fprintf(log, "%.6e,%.6f,%.1f,", r->lr, r->grad_norm, r->items / dt);
        for (int i = 0; i < t->extra.n; i++) fprintf(log, "%.6f,", i < r->n_extra ? r->extra[i] : NAN);
    } else {
        fprintf(log, t->classifier ? ",,,,," : ",,,,");
        for (int i = 0; i < t->extra.n; i++) fprintf(log, ",");
    }
    int val_acc = t->classifier || t->extra.val_accuracy;
    if (!isnan(e.loss)) fprintf(log, val_acc ? "%.6f,%.6f\n" : "%.6f\n", e.loss, e.accuracy);
    else fprintf(log, val_acc ? ",\n" : "\n");
    fflush(log);
}

// A save after `step` steps (every rank: a sharded master comes together on rank 0): rank 0
// stages the model (--full: a loadable model directory) or the adapter, every rank the state
// (which records the checksum of that file), then rank 0 commits them as one step (atomic_save.h).
static void train_save(const Trainer* t, const TrainOptions* o, const Dist* dist, const char* out, const char* settings,
                       int step) {
    int rank0 = dist->rank == 0;
    trainable_sync_host(t->tr, dist);
    char* stage = rank0 ? save_begin(out) : NULL;
    if (rank0 && t->full) t->export_merged(t->model, o, stage);
    else if (rank0) t->save_adapter(t->model, o, stage);
    const char* saved = t->full ? "model.safetensors" : "adapter_model.safetensors";
    trainable_save_state(t->tr, dist, stage, settings, step, *t->cursor, o->seed, saved);
    if (rank0) save_commit(out, stage, step);
}

// Whether this rank evaluates: rank 0, with the other ranks of its sequence-parallel group (each
// evaluates its slice of every sequence; llmc/train/seq_parallel.h). Rank 0 prints.
static int train_evaluates(const Dist* dist) { return dist->rank < dist_sp(dist); }

// Validation on rank 0 when this step is due for it (and --val was given), else no result.
static EvalResult train_validate_if_due(const Trainer* t, const TrainOptions* o, const Dist* dist, int step, int last) {
    EvalResult none = {NAN, NAN, 0};
    if (!train_evaluates(dist) || !t->have_val || !train_val_due(o, step, last)) return none;
    return t->evaluate(t->model, o->val_batches);
}

// Top-level keys of config.json that do not change the function a run trains: where the file came
// from and for which library version, and a cache switch of generation. Every other key counts.
static const char* const CONFIG_NOT_MATH[] = {"_name_or_path", "transformers_version", "_commit_hash", "use_cache"};
// The fields a config change most often touches, named in the settings so that a refused resume
// says which one changed; any other change shows as config_fingerprint.
static const char* const CONFIG_NAMED[] = {"rope_theta", "rms_norm_eps", "layer_norm_eps"};

// A parsed JSON value's fingerprint: an object's keys in any order give the same one. At the top
// level (CONFIG_TOP) the keys of CONFIG_NOT_MATH are left out.
typedef enum { CONFIG_NESTED, CONFIG_TOP } ConfigLevel;
static uint64_t json_value_fingerprint(const Json* j, ConfigLevel level) {
    Fingerprint f;
    fp_init(&f);
    int type = (int)j->type;
    fp_update(&f, &type, sizeof(type));
    uint64_t sum = 0;
    if (j->type == JSON_NUMBER) fp_update(&f, &j->number, sizeof(j->number));
    if (j->type == JSON_BOOL) fp_update(&f, &j->boolean, sizeof(j->boolean));
    if (j->type == JSON_STRING) fp_update(&f, j->string, strlen(j->string));
    for (int i = 0; j->type == JSON_ARRAY && i < j->count; i++) {
        uint64_t h = json_value_fingerprint(&j->items[i], CONFIG_NESTED);
        fp_update(&f, &h, sizeof(h));
    }
    for (int i = 0; j->type == JSON_OBJECT && i < j->count; i++) {
        int skip = 0;
        for (size_t k = 0; level == CONFIG_TOP && k < sizeof(CONFIG_NOT_MATH) / sizeof(CONFIG_NOT_MATH[0]); k++)
            skip |= !strcmp(j->keys[i], CONFIG_NOT_MATH[k]);
        if (skip) continue;
        Fingerprint kf;
        fp_init(&kf);
        uint64_t h = json_value_fingerprint(&j->items[i], CONFIG_NESTED);
        fp_update(&kf, j->keys[i], strlen(j->keys[i]));
        fp_update(&kf, &h, sizeof(h));
        sum += fp_final(&kf);
    }
    fp_update(&f, &sum, sizeof(sum));
    return fp_final(&f);
}

// The base model a run computes with: its tensors (0 under --random-init: --seed says which) and
// its config.json's math (rope_theta, the norms' epsilon, ...: what changes the function without
// changing a tensor), parsed, so that a reformatted or re-saved file is the same model.
typedef struct {
    uint64_t weights, config;
    char named[160];  // " rope_theta=... rms_norm_eps=..." for the fields config.json has
} BaseIdentity;

static BaseIdentity train_base_identity(const TrainOptions* o) {
    BaseIdentity id;
    memset(&id, 0, sizeof(id));
    id.weights = o->random_init ? 0 : st_model_fingerprint(o->model_dir);
    char* path = path_join(o->model_dir, "config.json");
    size_t n = 0;
    char* text = read_file(path, &n);
    Json cfg = json_parse(text, n, path);
    id.config = json_value_fingerprint(&cfg, CONFIG_TOP);
    for (size_t k = 0; k < sizeof(CONFIG_NAMED) / sizeof(CONFIG_NAMED[0]); k++) {
        const Json* v = json_get(&cfg, CONFIG_NAMED[k]);
        if (v && v->type == JSON_NUMBER)
            str_appendf(id.named, sizeof(id.named), " %s=%.9g", CONFIG_NAMED[k], v->number);
    }
    json_free(&cfg);
    free(text);
    free(path);
    return id;
}

// The run's settings with the identity of its base model and data appended: what a saved state
// records and a resume must match, and what every rank must share.
static void train_settings_with_identity(const Trainer* t, const BaseIdentity* base, char* buf, size_t n) {
    snprintf(buf, n, "model_fingerprint=%016llx%s config_fingerprint=%016llx data_fingerprint=%016llx ",
             (unsigned long long)base->weights, base->named, (unsigned long long)base->config,
             (unsigned long long)t->data_fingerprint);
    str_appendf(buf, n, "%s", t->settings);
}

// --export-merged, and every save of --full (a model directory: the base's files with the trained
// tensors in place), read the base checkpoint again: it must still be the model trained on (a file
// replaced meanwhile would get the adapter merged into another model, or lend a --full save its
// frozen tensors), else the write is refused. `what` names it.
static void train_check_base_unchanged(const TrainOptions* o, const BaseIdentity* start, const char* what) {
    BaseIdentity now = train_base_identity(o);
    if (now.weights == start->weights && now.config == start->config) return;
    fail("%s: the base model in --model %s changed during the run (its %s fingerprint was %016llx at the start, "
         "now %016llx); the write would take another model's tensors: put the original back and run again",
         what, o->model_dir, now.weights != start->weights ? "weights'" : "config.json's",
         (unsigned long long)(now.weights != start->weights ? start->weights : start->config),
         (unsigned long long)(now.weights != start->weights ? now.weights : now.config));
}

// --fit report after a training run: the model's table calibrated by the mean of the `timed` steps
// after the first (the first warms up), or why there is none.
static void train_fit_report(const Trainer* t, const TrainOptions* o, const Dist* dist, int timed_steps, double timed) {
    if (timed_steps < 1 || !t->fit_report) {
        printf("fit report: no timed step to calibrate by (the first step warms up: run at least 2 steps)\n");
        return;
    }
    t->fit_report(t->model, o, dist, timed / timed_steps);
}

// The training loop: resume, the model's validation before any update, then each step with its
// line, log row, validation and save, and the closing summary.
static void train_loop(const Trainer* t, const TrainOptions* o, const Dist* dist, const BaseIdentity* base) {
    int rank0 = dist->rank == 0;
    const char* out = o->out_dir ? o->out_dir : o->resume_dir;
    char settings[STATE_SETTINGS_BYTES];
    train_settings_with_identity(t, base, settings, sizeof(settings));
    dist_check_same(dist, "the model, the data and the run's settings", settings);
    int start = train_resume(t->tr, o, settings, t->cursor, dist);
    char header[512], val[96];
    train_log_header(t, header, sizeof(header));
    FILE* log = train_open_log(o, rank0, header, start);
    if (train_evaluates(dist) && t->have_val && start == 0) {  // the pretrained model (or new head) before any update
        EvalResult e = t->evaluate(t->model, o->val_batches);
        train_eval_text(t, e, val, sizeof(val));
        if (rank0) printf("step %4d/%d | %s", 0, o->steps, val);
        if (rank0 && t->classifier) printf(" (%lld images)", (long long)e.items);
        if (rank0) printf("\n");
        train_log_row(log, t, 0, NULL, 0.0, e);
    }
    double t0 = wall_seconds(), comm = 0.0, timed = 0.0;  // timed: the steps after the first (--fit report)
    int stop = train_stop_step(o), skips = 0;
    double peak = backend_peak_flops(t->be);
    for (int step = start; step < stop; step++) {
        double ts = wall_seconds();
        prof_step_begin(t->be->prof);
        train_fault_stop(step);
        StepResult r = t->step(t->model, o, dist, step);
        prof_step_end(t->be->prof, step == start && stop - start > 1);
        double dt = wall_seconds() - ts;
        if (step > start) timed += dt;
        comm += r.comm_s;
        train_count_skip(&skips, r.skipped, step);
        int last = step + 1 == stop;
        EvalResult e = train_validate_if_due(t, o, dist, step, last);
        train_eval_text(t, e, val, sizeof(val));
        if (rank0)
            train_print_step(o, dist, step, last, &r, dt, t->unit, t->flops_per_item, peak, isnan(e.loss) ? NULL : val,
                             &t->extra);
        train_log_row(log, t, step + 1, &r, dt, e);
        if (out && train_save_due(o, step + 1)) {
            if (t->full && rank0) train_check_base_unchanged(o, base, "flag --full's save");
            train_save(t, o, dist, out, settings, step + 1);
        }
    }
    if (rank0) train_print_summary(o, start, stop, wall_seconds() - t0, comm, t->full, t->plan, t->be);
    if (rank0) prof_print(t->be->prof, t->be->layout);
    if (rank0 && !strcmp(o->fit, "report")) train_fit_report(t, o, dist, stop - start - 1, timed);
    if (log) fclose(log);
}

// main's closing half, for every model: --eval-only's validation, or training on --data, then
// --export-merged (rank 0), from the base model the run started with.
static void train_run(const Trainer* t, const TrainOptions* o, const Dist* dist) {
    int trains = !o->eval_only && o->data_path, exports = o->export_merged && dist->rank == 0;
    BaseIdentity base;
    memset(&base, 0, sizeof(base));
    if (trains || exports) base = train_base_identity(o);
    if (o->eval_only && train_evaluates(dist)) {
        EvalResult e = t->evaluate(t->model, o->val_batches);
        if (dist->rank == 0 && t->classifier)
            printf("val loss %.6f | val acc %.6f (%lld images)\n", e.loss, e.accuracy, (long long)e.items);
        else if (dist->rank == 0) printf("val loss %.6f\n", e.loss);
    } else if (trains) {
        train_loop(t, o, dist, &base);
    }
    if (exports) {  // written whole or not at all (atomic_save.h); its directory was checked at start (run_options.h)
        train_check_base_unchanged(o, &base, "flag --export-merged");
        char* stage = export_dir_begin(o->export_merged, "flag --export-merged");
        t->export_merged(t->model, o, stage);
        export_dir_commit(o->export_merged, stage);
        printf("wrote merged model to %s\n", o->export_merged);
    }
}

// --dry-run's report: the plan beside the baseline's, as JSON (--json, the run's settings as the
// fields `settings_json`) or as the table under the run's `header` line.
static void train_dry_run_report(const TrainOptions* o, const MemPlan* plan, const MemPlan* base, const Backend* be,
                                 const char* settings_json, const char* header) {
    if (o->json) {
        plan_json(stdout, plan, base, settings_json);
    } else {
        printf("%s\n", header);
        plan_print(plan, base, o->mode, be->layout);
    }
}

// The backend a run computes on (--device), its profiler (--profile) and, on CUDA, NCCL.
static void train_backend_open(Backend* be, Profiler* prof, const TrainOptions* o, Dist* dist) {
    backend_init(be, o->device, dist->local_rank);
    if (o->profile) backend_profile(be, prof);
    if (be->cuda) dist_nccl_init(dist);
}
