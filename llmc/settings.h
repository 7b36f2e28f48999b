// settings.h: every environment setting of the trainers in one table: its name, the values it
// takes, its default and what it selects. The table is the one place in llmc/ that reads the
// environment for a setting of ours: settings_load reads every row once (train_start calls it before
// anything uses a setting; a probe or unit program that never calls it loads the table at its first
// question), and a bad value ends the run with one line naming the variable and what it takes.
// --help lists the table (settings_print_help) and the start-up line is followed by the settings
// that are not at their default (settings_print_set).
//
// Four roles: run-time choices a first GPU run still decides (SETTING_RUNTIME); test and debug
// settings (SETTING_TEST), which the tests and GPU sessions use to reach a path or fix a figure; the
// fault injectors (SETTING_FAULT), rows only in the test builds (-DLLMC_FAULTS, Makefile's
// build/test/ and build/emu/ trainers), which plant a fault on demand (a release build has no fault
// rows and refuses an LLMC_FAULT_* variable in one line instead of running as if it took effect);
// and variables of other programs that the trainers only look at (SETTING_OUTSIDE): the launchers'
// rank counts (OMPI_COMM_WORLD_SIZE, PMI_SIZE, PMIX_SIZE, SLURM_NTASKS with SLURM_STEP_ID, read by
// llmc/train/dist.h: set by mpirun or Slurm, never by a user to choose anything) and libgomp's
// OMP_WAIT_POLICY and GOMP_SPINCOUNT (llmc/train/omp_policy.h sets the first for OpenMP and
// re-executes, unless the user set either). They are rows so that --help lists every variable the
// trainers read; they are read as their programs read them (setting_outside: set, even empty, is
// set; no form checked), when asked, and the start-up line does not name them.
#pragma once
#include "common.h"

typedef enum {
    // run-time choices
    SETTING_ATTENTION,
    SETTING_CUDNN_PACKED,
    SETTING_CUDA_GRAPH,
    SETTING_LORA_FUSED,
    SETTING_HEAD_CHUNK,
    // test and debug settings
    SETTING_CUDA_SYNC,
    SETTING_NO_KV_CACHE,
    SETTING_EMU_TRACE_SYNCS,
    SETTING_ATTN_CHUNK,
    SETTING_ATTN_KEYS,
    SETTING_ATTN_KEY_BLOCKS,
    SETTING_PEAK_TFLOPS,
    SETTING_HOST_MEMORY_BYTES,
    SETTING_GRAD_BUCKET_BYTES,
    SETTING_OFFLOAD_STAGING,
    SETTING_NCCL,
    SETTING_NCCL_SELFTEST,
    SETTING_SEQPAR_LEND,
#ifdef LLMC_FAULTS
    // fault injectors (test builds only)
    SETTING_FAULT_KILL_SAVE,
    SETTING_FAULT_NONFINITE_STEP,
    SETTING_FAULT_STOP_STEP,
    SETTING_FAULT_STAGING_REWRITE,
    SETTING_FAULT_GRAPH_NO_REFUSAL,
    SETTING_FAULT_DROPOUT_KEY,
#endif
    // other programs' variables, looked at
    SETTING_OMPI_WORLD_SIZE,
    SETTING_PMI_SIZE,
    SETTING_PMIX_SIZE,
    SETTING_SLURM_NTASKS,
    SETTING_SLURM_STEP_ID,
    SETTING_OMP_WAIT_POLICY,
    SETTING_GOMP_SPINCOUNT,
    SETTING_COUNT
} SettingId;

typedef enum { SETTING_RUNTIME, SETTING_TEST, SETTING_FAULT, SETTING_OUTSIDE } SettingRole;
static const char* const setting_role_names[] = {"run-time choice", "test or debug", "fault injector, test builds",
                                                 "read from the launcher or OpenMP, not set by us"};

// What a setting takes besides (or instead of) its words.
typedef enum {
    SETTING_WORDS,   // one of `words` only
    SETTING_INT,     // an integer >= min (or one of `words`, when there are any)
    SETTING_REAL,    // a number >= min
    SETTING_TEXT,    // any text, checked by its one reader (`words` says its form, for --help)
} SettingForm;

typedef struct {
    const char* name;     // the environment variable
    SettingRole role;
    SettingForm form;
    const char* words;    // "a|b": the words it takes (SETTING_TEXT: the form, for --help); NULL: none
    double min;           // SETTING_INT, SETTING_REAL: the least number it takes
    const char* dflt;     // what unset means (a word of `words` where it is one)
    const char* selects;  // what it selects, for --help
} Setting;

// The table. Unset and empty are the same: the default.
static const Setting settings_table[SETTING_COUNT] = {
    {"LLMC_ATTENTION", SETTING_RUNTIME, SETTING_WORDS, "cudnn|gemm", 0, "cudnn where built, else gemm",
     "the CUDA attention: cuDNN's fused kernels or the GEMM tiles (llmc/ops.h)"},
    {"LLMC_CUDNN_PACKED", SETTING_RUNTIME, SETTING_WORDS, "ragged|gemm", 0, "ragged",
     "packed documents under cuDNN: its ragged call, or the GEMM path with the document mask"},
    {"LLMC_CUDA_GRAPH", SETTING_RUNTIME, SETTING_WORDS, "0|1", 0, "0",
     "1: each micro-batch's forward + backward captured once as a CUDA graph and replayed"},
    {"LLMC_LORA_FUSED", SETTING_RUNTIME, SETTING_WORDS, "0|1", 0, "1",
     "1: the adapter's products in the frozen product's epilogue; 0: after it (llmc/cuda/linear.cuh)"},
    {"LLMC_HEAD_CHUNK", SETTING_RUNTIME, SETTING_INT, "plan|old", 1, "plan",
     "the LM head's rows per chunk: the plan's rule, the old 64 MiB of logits, or a row count"},
    {"LLMC_CUDA_SYNC", SETTING_TEST, SETTING_WORDS, "0|1", 0, "0",
     "1: every CUDA launch synchronises, so a fault is reported at the launch that made it"},
    {"LLMC_NO_KV_CACHE", SETTING_TEST, SETTING_WORDS, "0|1", 0, "0",
     "1: generation recomputes the whole window for every token (the tests compare the two)"},
    {"LLMC_EMU_TRACE_SYNCS", SETTING_TEST, SETTING_WORDS, "0|1", 0, "0",
     "1: the CPU emulator reports every host synchronisation with its stack on stderr"},
    {"LLMC_ATTN_CHUNK", SETTING_TEST, SETTING_INT, NULL, 1, "by memory",
     "the GEMM attention's query rows per tile, at most (llmc/memory/cuda_workspace.h)"},
    {"LLMC_ATTN_KEYS", SETTING_TEST, SETTING_INT, NULL, 1, "by memory",
     "the GEMM attention's keys per tile (key blocks of n keys)"},
    {"LLMC_ATTN_KEY_BLOCKS", SETTING_TEST, SETTING_WORDS, "0|1", 0, "1",
     "0: the GEMM attention's old tiles (whole keys always, rows shrinking with the sequence)"},
    {"LLMC_PEAK_TFLOPS", SETTING_TEST, SETTING_REAL, NULL, 1e-9, "by compute capability",
     "the GPU's dense bf16 peak in TFLOP/s, MFU's denominator"},
    {"LLMC_HOST_MEMORY_BYTES", SETTING_TEST, SETTING_INT, NULL, 1, "MemAvailable",
     "the host memory the CPU plan may take, in bytes (llmc/train/fit.h)"},
    {"LLMC_GRAD_BUCKET_BYTES", SETTING_TEST, SETTING_INT, NULL, 1, "33554432",
     "gradient bytes waiting before a bucket is summed across ranks (llmc/train/trainable.h)"},
    {"LLMC_OFFLOAD_STAGING", SETTING_TEST, SETTING_WORDS, "1|2", 0, "as fitted",
     "--offload host's device staging buffers (llmc/memory/offload.h)"},
    {"LLMC_NCCL", SETTING_TEST, SETTING_WORDS, "0|1", 0, "1",
     "0: device collectives through the host and MPI instead of NCCL (llmc/train/dist.h)"},
    {"LLMC_NCCL_SELFTEST", SETTING_TEST, SETTING_WORDS, "0|1", 0, "0",
     "1: one rank makes an NCCL communicator too, so a single GPU runs the multi-rank path"},
    {"LLMC_SEQPAR_LEND", SETTING_TEST, SETTING_WORDS, "0|1", 0, "1",
     "0: sequence parallelism plans its own exchange buffers instead of lending dead ones"},
#ifdef LLMC_FAULTS
    {"LLMC_FAULT_KILL_SAVE", SETTING_FAULT, SETTING_TEXT, "STEP:staged|committed|state", 0, "off",
     "SIGKILL inside the save after step STEP at that point (llmc/train/atomic_save.h)"},
    {"LLMC_FAULT_NONFINITE_STEP", SETTING_FAULT, SETTING_INT, NULL, 1, "off",
     "step k's loss (1-based) made NaN, as a diverging run's"},
    {"LLMC_FAULT_STOP_STEP", SETTING_FAULT, SETTING_TEXT, "K or K:kill", 0, "off",
     "this process stops as step K begins: with an error, or by SIGKILL"},
    {"LLMC_FAULT_STAGING_REWRITE", SETTING_FAULT, SETTING_WORDS, "0|1", 0, "0",
     "1: a staged upload's host set rewritten while its copy may still read it"},
    {"LLMC_FAULT_GRAPH_NO_REFUSAL", SETTING_FAULT, SETTING_WORDS, "0|1", 0, "0",
     "1: LLMC_CUDA_GRAPH=1 captures even what it should refuse"},
    {"LLMC_FAULT_DROPOUT_KEY", SETTING_FAULT, SETTING_WORDS, "0|1", 0, "0",
     "1: the second step's first dropout key not uploaded (a stale key)"},
#endif
    {"OMPI_COMM_WORLD_SIZE", SETTING_OUTSIDE, SETTING_TEXT, "a count", 0, "unset",
     "Open MPI's rank count: above 1, the ranks join through MPI (llmc/train/dist.h)"},
    {"PMI_SIZE", SETTING_OUTSIDE, SETTING_TEXT, "a count", 0, "unset",
     "MPICH/Hydra's rank count, likewise"},
    {"PMIX_SIZE", SETTING_OUTSIDE, SETTING_TEXT, "a count", 0, "unset",
     "PMIx's rank count, likewise"},
    {"SLURM_NTASKS", SETTING_OUTSIDE, SETTING_TEXT, "a count", 0, "unset",
     "Slurm's task count, likewise, inside a job step only (SLURM_STEP_ID set)"},
    {"SLURM_STEP_ID", SETTING_OUTSIDE, SETTING_TEXT, "any", 0, "unset",
     "set: the process is a Slurm job step's (srun), so SLURM_NTASKS counts its ranks"},
    {"OMP_WAIT_POLICY", SETTING_OUTSIDE, SETTING_TEXT, "any", 0, "unset",
     "libgomp's; unset (and GOMP_SPINCOUNT unset): set to passive and the program re-executed "
     "(llmc/train/omp_policy.h)"},
    {"GOMP_SPINCOUNT", SETTING_OUTSIDE, SETTING_TEXT, "any", 0, "unset",
     "libgomp's; set: OMP_WAIT_POLICY left as it is (llmc/train/omp_policy.h)"},
};

typedef struct {
    const char* text;  // as set; NULL: unset (or empty)
    int word;          // index into the row's words: as set, or the default's; -1: none
    long long count;   // SETTING_INT given a number
    double number;     // SETTING_INT, SETTING_REAL given a number
} SettingValue;

static SettingValue settings_values[SETTING_COUNT];
static int settings_loaded = 0;

// The index of `v` among "a|b|c", or -1.
static int setting_word_index(const char* words, const char* v) {
    if (!words || !v) return -1;
    size_t n = strlen(v);
    int i = 0;
    for (const char* p = words;; i++) {
        const char* bar = strchr(p, '|');
        size_t len = bar ? (size_t)(bar - p) : strlen(p);
        if (len == n && strncmp(p, v, n) == 0) return i;
        if (!bar) return -1;
        p = bar + 1;
    }
}

// What a row takes, as the error line and --help say it: "a, b or c", "an integer >= 1", ...
static void setting_expected(const Setting* s, char* buf, size_t n) {
    buf[0] = 0;
    int words = 0;
    for (const char* p = s->words; s->form != SETTING_TEXT && p && *p; words++) {
        const char* bar = strchr(p, '|');
        int len = bar ? (int)(bar - p) : (int)strlen(p);
        int last = !bar && s->form == SETTING_WORDS;
        str_appendf(buf, n, "%s%.*s", words == 0 ? "" : last ? " or " : ", ", len, p);
        p = bar ? bar + 1 : p + len;
    }
    const char* sep = words ? " or " : "";
    if (s->form == SETTING_INT) str_appendf(buf, n, "%san integer >= %.0f", sep, s->min);
    if (s->form == SETTING_REAL) str_appendf(buf, n, "%sa number >= %g", sep, s->min);
    if (s->form == SETTING_TEXT) snprintf(buf, n, "%s", s->words);
}

static void setting_parse(const Setting* s, SettingValue* v, const char* e) {
    memset(v, 0, sizeof(*v));
    v->word = setting_word_index(s->words, s->dflt);
    if (!e || !*e) return;
    v->text = e;
    if (s->form == SETTING_TEXT) return;
    int w = setting_word_index(s->words, e);
    if (w >= 0) { v->word = w; return; }
    char* end = NULL;
    errno = 0;
    if (s->form == SETTING_INT) {
        v->count = strtoll(e, &end, 10);
        v->number = (double)v->count;
    } else if (s->form == SETTING_REAL) {
        v->number = strtod(e, &end);
    }
    if (s->form != SETTING_WORDS && end != e && !*end && !errno && v->number >= s->min) {
        v->word = -1;
        return;
    }
    char want[128];
    setting_expected(s, want, sizeof(want));
    fail("%s=%s: expected %s", s->name, e, want);
}

// Switches removed with the old forms of the step without host synchronisation (docs/gpu-testing.md):
// one still set is refused, so that a script comparing it does not compare a run with itself.
// So are the kernel switches LLMC_ELEMWISE and LLMC_CE_KERNEL: the production code has one kernel per op
// (the reference versions are dev/cuda's).
static const char* const settings_removed[] = {"LLMC_STREAM",      "LLMC_UPLOAD",     "LLMC_STEP_READBACK",
                                               "LLMC_ADAMW_STEP",  "LLMC_LOSS_SCALE", "LLMC_DROPOUT_KEY",
                                               "LLMC_FAULT_GRAPH_KEY", "LLMC_ELEMWISE", "LLMC_CE_KERNEL"};
static void settings_refuse_removed(void) {
    for (size_t i = 0; i < sizeof(settings_removed) / sizeof(settings_removed[0]); i++)
        if (getenv(settings_removed[i]))
            fail("environment variable %s: removed (its old form is gone, docs/gpu-testing.md); unset it",
                 settings_removed[i]);
}

// A release build has no fault injectors: one set anyway is refused, not ignored.
static void settings_refuse_faults(void) {
#ifndef LLMC_FAULTS
    for (char** p = environ; p && *p; p++)
        if (strncmp(*p, "LLMC_FAULT_", 11) == 0) {
            const char* eq = strchr(*p, '=');
            int len = eq ? (int)(eq - *p) : (int)strlen(*p);
            fail("environment variable %.*s: fault injectors are compiled only into the test builds "
                 "(build/test/, build/emu/), not this binary", len, *p);
        }
#endif
}

// Reads every setting: once (SETTINGS_ONCE: a trainer, and any first question), or again
// (SETTINGS_AGAIN: a test program that changes its own environment with setenv between cases).
typedef enum { SETTINGS_ONCE, SETTINGS_AGAIN } SettingsRead;
static void settings_read(SettingsRead when) {
    if (settings_loaded && when == SETTINGS_ONCE) return;
    for (int i = 0; i < SETTING_COUNT; i++)
        setting_parse(&settings_table[i], &settings_values[i], getenv(settings_table[i].name));
    settings_refuse_removed();
    settings_refuse_faults();
    settings_loaded = 1;
}

// Called by train_start before anything asks; any question loads the table too.
static void settings_load(void) { settings_read(SETTINGS_ONCE); }

static const SettingValue* setting_value(SettingId id) {
    settings_load();
    return &settings_values[id];
}

// Whether the variable is set (and not empty).
static int setting_is_set(SettingId id) { return setting_value(id)->text != NULL; }
// The word chosen (its index in the row's words), the default's where unset; -1: a number, or unset
// where the default is not a word.
static int setting_word(SettingId id) { return setting_value(id)->word; }
// A "0|1" row as 0 or 1 (its default where unset).
static int setting_on(SettingId id) { return setting_value(id)->word == 1; }
// The integer given (SETTING_INT), or 0 where unset or a word.
static long long setting_count(SettingId id) {
    const SettingValue* v = setting_value(id);
    return v->text && v->word < 0 ? v->count : 0;
}
// The number given (SETTING_INT, SETTING_REAL), or 0 where unset or a word.
static double setting_number(SettingId id) {
    const SettingValue* v = setting_value(id);
    return v->text && v->word < 0 ? v->number : 0.0;
}
// The text as set, or NULL (SETTING_TEXT rows: their reader checks it).
static const char* setting_text(SettingId id) { return setting_value(id)->text; }

// A SETTING_OUTSIDE row as its own program reads it: the text as set now (set and empty is set), or
// NULL. Read when asked, not from the table's values, and without loading the table: the first asks
// come before the table is read (omp_policy_apply may re-execute the program, dist_init starts MPI
// before a bad value of ours may end the run in one line) and after the process set the variable.
static const char* setting_outside(SettingId id) {
    if (settings_table[id].role != SETTING_OUTSIDE)
        fail("setting_outside(%s): not a variable of another program", settings_table[id].name);
    return getenv(settings_table[id].name);
}

// --help's section: one line per row.
static void settings_print_help(void) {
    printf("\nenvironment settings (NAME=value; unset: the default):\n");
    for (int i = 0; i < SETTING_COUNT; i++) {
        const Setting* s = &settings_table[i];
        char want[128];
        setting_expected(s, want, sizeof(want));
        printf("  %-27s %s (default %s; %s)\n      %s\n", s->name, want, s->dflt, setting_role_names[s->role],
               s->selects);
    }
}

// The settings that are not at their default, on one line after the start-up line (rank 0); nothing
// when every one is.
static void settings_print_set(void) {
    char line[1024] = "";
    for (int i = 0; i < SETTING_COUNT; i++) {
        const SettingValue* v = setting_value((SettingId)i);
        if (settings_table[i].role == SETTING_OUTSIDE) continue;  // not ours to name (see the top of this file)
        if (v->text && strcmp(v->text, settings_table[i].dflt) != 0)
            str_appendf(line, sizeof(line), "%s%s=%s", *line ? " " : "", settings_table[i].name, v->text);
    }
    if (*line) printf("environment settings: %s\n", line);
}
