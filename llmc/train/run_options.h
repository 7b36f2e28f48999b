// run_options.h: what both trainers share around the model: the run options and their flag
// table entries, mode presets, LoRA target lists, the learning-rate schedule, the device choice
// and the claim on the output directories (llmc/train/out_dir.h). The models themselves live in
// llmc/models/ (llama.h, vit.h, ...).
#pragma once
#include "../common.h"
#include "flags.h"
#include "out_dir.h"
#include <limits.h>
#include <signal.h>
#include <omp.h>

typedef struct {
    // model and data
    const char* model_dir;
    const char* data_path;
    const char* val_path;
    const char* out_dir;
    const char* adapter_dir;  // load this LoRA adapter (PEFT layout) before training/generating
    const char* resume_dir;   // continue the run saved in this --out directory
    int save_every;
    int stop_at;            // stop (and save) after this step, keeping the --steps schedule
    const char* export_merged;  // write base + adapter folded in here (text models)
    int eval_only;
    int full;               // full fine-tuning instead of LoRA
    // schedule
    int steps, batch, seq, grad_accum, warmup, val_every, val_batches, log_every;
    float lr, min_lr_frac, weight_decay, grad_clip;
    const char* nonfinite;  // stop | skip: a step whose loss or gradient norm is NaN or Inf
    // the paper's switches
    const char* mode;
    const char* act;        // exact | approx
    const char* norm;       // std | ms
    const char* recompute;  // none | block | auto | N (blocks recomputed: the first N)
    int recompute_default;  // --recompute not given and the mode recomputes none: auto where the run does not fit
    float mem_limit;        // --mem-limit GIB: the most a run may plan (0: not given; the fit check's budget)
    const char* fit;        // none | report: --dry-run's table of modes x recomputed blocks (llmc/train/fit_report.h)
    const char* swiglu_product;  // keep | recompute (beyond the paper; LLaMA only)
    const char* offload;    // none | host: the recomputed blocks' checkpoints in pinned host memory
    const char* mlp_tile;   // auto | 0 (whole sequence) | tokens: the MLP's tile of tokens (LLaMA only)
    const char* ms_lora;  // exact | merged: what an adapter behind an MS norm sees (gamma*z + beta, or z: the paper's)
    const char* quant;      // none | nf4: frozen linear weights stored as NF4 (llmc/nf4.h; LLaMA only)
    // LoRA
    int lora_rank;
    float lora_alpha;
    int lora_rslora;        // scale alpha/sqrt(r) instead of alpha/r (PEFT's use_rslora)
    float lora_dropout;     // dropout probability on each adapter's input while training (0 = off)
    const char* lora_targets;
    // system
    const char* device;
    int seed, threads, dry_run, json;
    int profile;            // print where the step time goes at the end (llmc/train/profile.h)
    int ranks;              // --dry-run: plan one rank of this many (0: the launch's)
    int seq_parallel;       // --seq-parallel P: ranks per sequence (llmc/train/seq_parallel.h; LLaMA only)
    int random_init;        // benchmark: random frozen weights of config.json's shapes, no weight file
    int max_seq;            // --dry-run --max-seq: plan the longest --seq that fits (LLaMA only)
    float gpu_mem;          // --gpu-mem GIB: with --dry-run, plan for a card of this much memory (0: not given)
    // generation (text models)
    int generate;
    const char* prompt;
    int chat;               // --chat: wrap --prompt in the model's chat template
    const char* system;     // --system: with --chat, a system message before it
    float temperature;
    // images (image models)
    int classes;            // 0: the training shard's class count
    const char* image_size; // "S" or "HxW"; NULL: the checkpoint's
    int hflip;
    // preference objectives (llmc/train/preference.h registers and checks them)
    const char* objective;  // sft | dpo | orpo | simpo
    float beta;             // NAN: the objective's default
    float dpo_label_smoothing, simpo_gamma;
    const char* ref_logps;  // inline | precompute
} TrainOptions;

// Which flags a trainer offers: the text models' (--seq, generation) or the image models'.
typedef enum { TRAIN_TEXT, TRAIN_IMAGE } TrainTask;

static void train_options_defaults(TrainOptions* o) {
    memset(o, 0, sizeof(*o));
    o->steps = 20; o->batch = 4; o->seq = 256; o->grad_accum = 1; o->warmup = 0; o->val_every = 0; o->val_batches = 8;
    o->log_every = 1;
    o->lr = 1e-3f; o->min_lr_frac = 0.1f; o->weight_decay = 0.0f; o->grad_clip = 1.0f;
    o->mode = "lowmem";
    o->nonfinite = "stop";
    o->swiglu_product = "keep";
    o->offload = "none";
    o->fit = "none";
    o->mlp_tile = "auto";
    o->ms_lora = "exact";
    o->quant = "none";
    o->lora_rank = 8; o->lora_alpha = 16.0f;
    o->device = "auto";
    o->seed = 1337; o->threads = 0;
    o->prompt = "";
    o->temperature = 0.8f;
}

// The flags of a trainer, by --help's groups, in --help's order (train_flags_register_task below
// registers them all). `text`: the task is TRAIN_TEXT (a LLaMA-family model), else TRAIN_IMAGE.
static void train_flags_model_data(FlagTable* t, TrainOptions* o, int text) {
    t->group = "model and data";
    flag_string(t, "model", &o->model_dir, "model directory: config.json + model.safetensors (or sharded, with index)");
    flag_string(t, "data", &o->data_path,
                text ? "training data shard" : "training image shard (scripts/data/prepare_images.py)");
    flag_string(t, "val", &o->val_path, text ? "validation data shard" : "validation image shard");
    flag_string(t, "out", &o->out_dir,
                "output directory: log.csv, the PEFT adapter (end and every --save-every), train_state.bin");
    flag_int(t, "save-every", &o->save_every,
             "write the adapter and the resumable training state every N steps (0 = only at the end)");
    flag_int(t, "stop-at", &o->stop_at,
             "stop after this step, saving as at the end, with the schedule of --steps (resume later)");
    flag_string(t, "resume", &o->resume_dir, "continue the run whose --out directory this is (same model and flags)");
    flag_string(t, "adapter", &o->adapter_dir,
                "start from this LoRA adapter directory (ours or PEFT's) instead of a fresh one");
    flag_bool(t, "eval-only", &o->eval_only, "evaluate the model (+ --adapter) on --val and exit");
    if (!text) {
        flag_int(t, "classes", &o->classes, "classes of the new head (0 = the training shard's count)");
        flag_string(t, "image-size", &o->image_size,
                    "fine-tuning resolution S or HxW (default the checkpoint's; position embedding interpolated)");
        flag_bool(t, "hflip", &o->hflip, "random horizontal flip of training images");
    }
}

static void train_flags_training(FlagTable* t, TrainOptions* o, int text) {
    t->group = "training";
    flag_int(t, "steps", &o->steps, "optimizer steps");
    flag_int(t, "batch", &o->batch, text ? "sequences per micro-batch" : "images per micro-batch");
    if (text) flag_int(t, "seq", &o->seq, "tokens per sequence");
    flag_int(t, "grad-accum", &o->grad_accum, "micro-batches per optimizer step");
    flag_float(t, "lr", &o->lr, "peak learning rate");
    flag_float(t, "min-lr-frac", &o->min_lr_frac, "cosine floor as a fraction of --lr");
    flag_int(t, "warmup", &o->warmup, "linear warmup steps");
    flag_float(t, "weight-decay", &o->weight_decay, "AdamW weight decay");
    flag_float(t, "grad-clip", &o->grad_clip, "clip the global gradient norm to this (0 = off)");
    flag_choice(
        t, "nonfinite", &o->nonfinite, "stop|skip",
        "a step with a NaN/Inf loss or gradient: stop with an error, or skip its update (stops after 10 in a row)");
    flag_int(t, "val-every", &o->val_every, "evaluate on --val every N steps (0 = only at the end)");
    flag_int(t, "val-batches", &o->val_batches, "micro-batches per evaluation");
    flag_int(t, "log-every", &o->log_every, "print a log line every N steps");
}

static void train_flags_memory(FlagTable* t, TrainOptions* o) {
    t->group = "memory modes (the paper's layers)";
    flag_choice(t, "mode", &o->mode, "baseline|lowmem|ckpt",
                "preset: baseline = exact,std,none; lowmem = approx,ms,none; ckpt = exact,std,block");
    flag_choice(t, "act", &o->act, "exact|approx",
                "activation backward: exact, or 2-bit ReSiLU2/ReGELU2 (overrides --mode)");
    flag_choice(t, "norm", &o->norm, "std|ms",
                "norms: standard, or memory-sharing MS-RMSNorm/MS-LN (overrides --mode)");
    flag_string(t, "recompute", &o->recompute,
                "gradient checkpointing per block (overrides --mode): none, block (every block), N (the first N "
                "blocks) or auto (the fewest blocks whose plan fits the memory; the default where the run would "
                "not fit otherwise)");
    flag_choice(t, "fit", &o->fit, "none|report",
                "report each memory mode (baseline, lowmem, act-only, norm-only) with the fewest recomputed "
                "blocks that fit the memory, its plan and its predicted step time, the best marked: with "
                "--dry-run relative to the mode's step; after a training run's steps in ms, calibrated by its "
                "measured step");
    flag_float(t, "mem-limit", &o->mem_limit,
               "the most memory (GiB, > 0) the run may plan, on the GPU or the host (default: the fit check's "
               "budget, free GPU memory or MemAvailable); --recompute auto fits it");
}

static void train_flags_lora(FlagTable* t, TrainOptions* o, const char* targets_help) {
    t->group = "LoRA";
    flag_int(t, "lora-rank", &o->lora_rank, "adapter rank r");
    flag_float(t, "lora-alpha", &o->lora_alpha, "adapter scale alpha (update = alpha/r * B A x)");
    flag_bool(t, "lora-rslora", &o->lora_rslora,
              "rank-stabilized LoRA: update = alpha/sqrt(r) * B A x (PEFT's use_rslora; an --adapter must say the "
              "same)");
    flag_float(t, "lora-dropout", &o->lora_dropout,
               "dropout probability on each adapter's input while training, as PEFT's lora_dropout (the mask is "
               "regenerated in "
               "the backward from a hash of seed, step, layer and element: no memory kept)");
    flag_string(t, "lora-targets", &o->lora_targets, targets_help);
    flag_choice(
        t, "ms-lora", &o->ms_lora, "exact|merged",
        "under --norm ms, an adapter of a layer fed by a norm sees gamma*z + beta as in the original model (exact: the "
        "gradients of --norm std), or the merged input z (the paper's variant, for reproducing it: another "
        "parameterisation)");
    flag_bool(t, "full", &o->full,
              "full fine-tuning (fp32 masters + AdamW) instead of LoRA adapters: every weight (train_vit: all but the "
              "key bias, whose gradient is zero)");
}

static void train_flags_system(FlagTable* t, TrainOptions* o) {
    t->group = "system";
    flag_choice(t, "device", &o->device, "cpu|cuda|auto",
                "backend: auto takes a CUDA GPU when this binary has the CUDA backend and one is visible");
    flag_bool(t, "random-init", &o->random_init,
              "random frozen weights of config.json's shapes instead of reading them (speed and memory benchmarks)");
    flag_int(t, "seed", &o->seed, "seed for LoRA init, data order and sampling");
    flag_int(t, "threads", &o->threads, "CPU threads (0 = all cores)");
    flag_bool(t, "profile", &o->profile,
              "at the end, a table of where the training step's time goes: per module and pass, ms, share, "
              "GFLOP/s, GB/s (CUDA: events around each op); the first step is not counted");
    flag_bool(t, "dry-run", &o->dry_run,
              "print the memory plan for the config and exit (no weights read, nothing allocated)");
    flag_bool(t, "json", &o->json, "with --dry-run: print the plan as JSON");
    flag_int(t, "ranks", &o->ranks,
             "with --dry-run: plan one of N data-parallel ranks (ZeRO-1 under --full) without launching them");
}

static void train_flags_generation(FlagTable* t, TrainOptions* o) {
    t->group = "generation";
    flag_int(t, "generate", &o->generate, "after training (or alone, without --data), sample N tokens");
    flag_string(t, "prompt", &o->prompt, "prompt text for --generate (empty = start from BOS)");
    flag_float(t, "temperature", &o->temperature, "sampling temperature (0 = greedy)");
    flag_bool(t, "chat", &o->chat, "--prompt is a user message: render it with tokenizer_config.json's chat_template "
              "(add_generation_prompt) and stop at the template's end-of-turn token");
    flag_string(t, "system", &o->system, "with --chat: a system message before the prompt");
}

// Registers the flags of a trainer for `task`; `targets_help` lists the model's LoRA targets.
static void train_flags_register_task(FlagTable* t, TrainOptions* o, const char* targets_help, TrainTask task) {
    int text = task == TRAIN_TEXT;
    train_flags_model_data(t, o, text);
    train_flags_training(t, o, text);
    train_flags_memory(t, o);
    train_flags_lora(t, o, targets_help);
    train_flags_system(t, o);
    if (text) train_flags_generation(t, o);
}

// --offload, which both trainers add to the memory modes (in their own place in --help's order).
static void train_flag_offload(FlagTable* t, TrainOptions* o) {
    flag_choice(t, "offload", &o->offload, "none|host",
                "with --recompute block, N or auto: the recomputed blocks' checkpoints in pinned host memory, "
                "copied beside the compute");
}

static void train_flags_register(FlagTable* t, TrainOptions* o, const char* targets_help) {
    train_flags_register_task(t, o, targets_help, TRAIN_TEXT);
}

// Applies the --mode preset to the switches not given explicitly.
static void train_resolve_mode(TrainOptions* o) {
    const char *act = "approx", *norm = "ms", *rec = "none";
    if (strcmp(o->mode, "baseline") == 0) { act = "exact"; norm = "std"; }
    if (strcmp(o->mode, "ckpt") == 0) { act = "exact"; norm = "std"; rec = "block"; }
    if (!o->act) o->act = act;
    if (!o->norm) o->norm = norm;
    o->recompute_default = !o->recompute && !strcmp(rec, "none");
    if (!o->recompute) o->recompute = rec;
}


// --mlp-tile: MLP_TILE_AUTO picks the tile by the model's rule (llmc/models/llama_plan.h, llama_mlp_tile_rows).
#define MLP_TILE_AUTO (-1)
// The tokens of --mlp-tile as a count (0 or more, at most INT_MAX), or -1 when it is not one.
static int mlp_tile_tokens(const char* v) {
    if (!*v) return -1;
    long long n = 0;
    for (const char* c = v; *c; c++) {
        if (*c < '0' || *c > '9') return -1;
        n = n * 10 + (*c - '0');
        if (n > INT_MAX) return -1;
    }
    return (int)n;
}

// --recompute as a count of blocks: RECOMPUTE_ALL (block), RECOMPUTE_AUTO (auto: fitted to the
// memory by the trainer, llmc/train/fit.h), 0 (none) or N; -2 when it is none of these.
#define RECOMPUTE_ALL INT_MAX
#define RECOMPUTE_AUTO (-1)
static int recompute_count(const char* v) {
    if (!strcmp(v, "none")) return 0;
    if (!strcmp(v, "block")) return RECOMPUTE_ALL;
    if (!strcmp(v, "auto")) return RECOMPUTE_AUTO;
    int n = mlp_tile_tokens(v);  // a plain count, as --mlp-tile's
    return n < 0 ? -2 : n;
}

static void train_validate(const TrainOptions* o) {
    if (o->steps < 0) fail("flag --steps: expected >= 0, got %d", o->steps);
    if (o->batch < 1) fail("flag --batch: expected >= 1, got %d", o->batch);
    // at most 2^30: seq + 1 (a window with its next token) and every per-sequence count stay within int
    if (o->seq < 1 || o->seq > (1 << 30)) fail("flag --seq: expected 1..%d, got %d", 1 << 30, o->seq);
    if (o->grad_accum < 1) fail("flag --grad-accum: expected >= 1, got %d", o->grad_accum);
    if (o->lora_rank < 1) fail("flag --lora-rank: expected >= 1, got %d", o->lora_rank);
    if (o->warmup < 0) fail("flag --warmup: expected >= 0, got %d", o->warmup);
    if (o->lr < 0) fail("flag --lr: expected >= 0, got %g", o->lr);
    // values that would run without a word but not as asked: a negative clip is silently no clip,
    // a negative decay grows the weights, a floor above 1 raises the rate, alpha 0 trains nothing
    if (o->grad_clip < 0) fail("flag --grad-clip: expected >= 0 (0 = off), got %g", o->grad_clip);
    if (o->weight_decay < 0) fail("flag --weight-decay: expected >= 0, got %g", o->weight_decay);
    if (o->min_lr_frac < 0 || o->min_lr_frac > 1)
        fail("flag --min-lr-frac: expected a fraction in [0, 1], got %g", o->min_lr_frac);
    if (!(o->lora_dropout >= 0 && o->lora_dropout < 1))
        fail("flag --lora-dropout: expected a probability in [0, 1), got %g", o->lora_dropout);
    if (o->full && o->lora_dropout > 0) fail("flag --lora-dropout: only with LoRA adapters, not with --full");
    if (!o->full && !(o->lora_alpha > 0))
        fail("flag --lora-alpha: expected > 0 (the update is alpha/r B A x), got %g", o->lora_alpha);
    if (o->threads < 0) fail("flag --threads: expected >= 0, got %d", o->threads);
    if (o->generate < 0) fail("flag --generate: expected >= 0, got %d", o->generate);
    if (o->temperature < 0) fail("flag --temperature: expected >= 0, got %g", o->temperature);
    if (o->chat && !o->generate) fail("flag --chat: only with --generate N (it wraps the --prompt of generation)");
    if (o->system && !o->chat) fail("flag --system: only with --chat");
    if (o->val_batches < 1) fail("flag --val-batches: expected >= 1, got %d", o->val_batches);
    if (o->log_every < 1) fail("flag --log-every: expected >= 1, got %d", o->log_every);
    if (o->stop_at < 0) fail("flag --stop-at: expected >= 0, got %d", o->stop_at);
    if (o->save_every < 0) fail("flag --save-every: expected >= 0, got %d", o->save_every);
    if (o->resume_dir && o->adapter_dir)
        fail("flag --adapter: not with --resume (the training state holds the adapter)");
    if (o->full && o->lora_rslora) fail("flag --lora-rslora: only with LoRA adapters, not with --full");
    if (o->full && (o->lora_targets || o->adapter_dir))
        fail("flag --full: not with --lora-targets or --adapter (no adapters in full fine-tuning)");
    // one class has loss 0 and gradient 0 whatever the weights: nothing to learn
    if (o->classes < 0 || o->classes == 1)
        fail("flag --classes: expected 0 (from the data) or >= 2, got %d", o->classes);
    if (strcmp(o->mlp_tile, "auto") != 0 && mlp_tile_tokens(o->mlp_tile) < 0)
        fail("flag --mlp-tile: expected auto, 0 (the whole sequence) or a number of tokens >= 1, got \"%s\"",
             o->mlp_tile);
    if (recompute_count(o->recompute) == -2)
        fail("flag --recompute: expected none, block, auto or a number of blocks, got \"%s\"", o->recompute);
    if (strcmp(o->offload, "none") != 0 && !recompute_count(o->recompute))
        fail("flag --offload %s: only with --recompute block, N or auto (it moves the block checkpoints)", o->offload);
    if (o->mem_limit < 0) fail("flag --mem-limit: expected the memory in GiB, > 0, got %g", o->mem_limit);
    if (o->full && strcmp(o->quant, "none") != 0)
        fail(
            "flag --quant %s: not with --full (full fine-tuning trains the weights themselves, in fp32; quantization "
            "is for frozen weights)",
            o->quant);
    if (!strcmp(o->ms_lora, "merged") && (strcmp(o->norm, "ms") != 0 || o->full))
        fail("flag --ms-lora merged: only with --norm ms (or --mode lowmem) and LoRA, not with %s",
             o->full ? "--full" : "--norm std");
}

// --lora-rank above the hidden size is refused, not warned about: every adapted linear reads or
// writes the hidden size, so B A has rank at most that whatever r is, and a larger r only costs
// memory. A user asking for it has most likely mistyped; --full is the way to train whole matrices.
static void train_check_lora_rank(const TrainOptions* o, int hidden_size, const char* model_dir) {
    if (o->full || o->lora_rank <= hidden_size) return;
    fail(
        "flag --lora-rank: %d exceeds hidden_size %d of %s/config.json (every adapted linear reads or writes the "
        "hidden size, "
        "so a larger rank adds memory but no expressiveness; use a rank <= %d, or --full)",
        o->lora_rank, hidden_size, model_dir, hidden_size);
}

// The log's " | MFU x%" for a step (nothing when the peak is unknown: the CPU, an unlisted GPU):
// items/s on this GPU times the model FLOPs per item, over the GPU's peak.
static void print_mfu(double items_per_s_per_gpu, double flops_per_item, double peak_flops) {
    if (peak_flops > 0) printf(" | MFU %.1f%%", 100.0 * items_per_s_per_gpu * flops_per_item / peak_flops);
}

// Parses a comma list of target names into a bit mask over `names` (count n). NULL = all.
static unsigned parse_targets(const char* list, const char* const* names, int n, const char* flag) {
    if (!list) return (1u << n) - 1;
    unsigned mask = 0;
    char* buf = xstrdup(list);  // the whole list, however long: a cut one would drop targets silently
    char* save = NULL;
    for (char* tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        int found = -1;
        for (int i = 0; i < n; i++) if (strcmp(tok, names[i]) == 0) found = i;
        if (found < 0) {
            char all[128] = "";
            for (int i = 0; i < n; i++)
                snprintf(all + strlen(all), sizeof(all) - strlen(all), "%s%s", i ? "," : "", names[i]);
            fail("flag --%s: unknown target \"%s\", expected a comma list of %s", flag, tok, all);
        }
        mask |= 1u << found;
    }
    free(buf);
    if (!mask) fail("flag --%s: empty target list", flag);
    return mask;
}

// TrainModes.offload_staging before it is fitted to the memory (llmc/memory/offload.h)
enum { OFFLOAD_STAGING_AUTO = 0 };

// The switches a model reads, from the flags: the paper's memory modes and what trains.
typedef struct {
    int approx, ms;
    int recompute;          // blocks recomputed, the first ones (train_block_recomputes); RECOMPUTE_ALL, or
                            // RECOMPUTE_AUTO until the trainer fits it (train_modes_recompute; unfitted: none)
    int ms_lora_merged;     // --ms-lora merged: adapters behind an MS norm see its bare output z (the paper's)
    int recompute_product;  // --swiglu-product recompute (LLaMA only)
    int offload_host;       // --offload host (with blocks recomputed): their inputs kept in host memory
    int offload_staging;    // its device staging buffers: 1, 2, or OFFLOAD_STAGING_AUTO (fitted to the memory)
    int head_chunk_small;   // the LM head's chunk fitted to a memory that holds only the old, smaller one
    int mlp_tile;           // --mlp-tile: tokens per MLP tile, 0 the whole sequence, MLP_TILE_AUTO the planned rule
    int generate;           // --generate: plan the key/value cache and the logits it samples from (LLaMA only)
    int full;               // train the weights themselves instead of LoRA adapters
    int full_reference;     // --full --objective dpo: a frozen copy of the initial weights, DPO's reference
    int nf4;                // --quant nf4: frozen linear weights in NF4, dequantized before each product
    unsigned targets;       // bit t: linear t of every block carries an adapter
    int rank;
    float lora_scale;
    float lora_dropout;     // --lora-dropout (0: off; the state and its scratch exist only above 0)
    uint64_t seed;          // --seed: keys the dropout masks
} TrainModes;

// The factor of every adapter update: alpha/r, or alpha/sqrt(r) under --lora-rslora (PEFT forms
// lora_alpha / math.sqrt(r) in double; torch rounds it to float once).
static float train_lora_scale(const TrainOptions* o) {
    if (o->lora_rslora) return (float)((double)o->lora_alpha / sqrt((double)o->lora_rank));
    return o->lora_alpha / (float)o->lora_rank;
}

// target_names: the model's linears in its order, what --lora-targets names.
static TrainModes train_modes_from(const TrainOptions* o, const char* const* target_names, int n_targets) {
    TrainModes md;
    md.approx = strcmp(o->act, "approx") == 0;
    md.ms = strcmp(o->norm, "ms") == 0;
    md.recompute = recompute_count(o->recompute);
    md.recompute_product = strcmp(o->swiglu_product, "recompute") == 0;
    md.offload_host = md.recompute != 0 && strcmp(o->offload, "host") == 0;  // (train_validate refuses it alone)
    md.offload_staging = OFFLOAD_STAGING_AUTO;
    md.head_chunk_small = 0;
    md.ms_lora_merged = strcmp(o->ms_lora, "merged") == 0;
    md.mlp_tile = strcmp(o->mlp_tile, "auto") == 0 ? MLP_TILE_AUTO : mlp_tile_tokens(o->mlp_tile);
    md.full = o->full;
    md.full_reference = 0;  // train_llama's --objective dpo sets it
    md.nf4 = strcmp(o->quant, "nf4") == 0;
    md.targets = o->full ? 0 : parse_targets(o->lora_targets, target_names, n_targets, "lora-targets");
    md.rank = o->lora_rank;
    md.lora_scale = train_lora_scale(o);
    // a run that cannot train (--eval-only; --generate or --export-merged without --data) plans no
    // dropout scratch; a --dry-run plans the training run
    int trains = !o->eval_only && (o->data_path || o->dry_run);
    md.lora_dropout = o->full || !trains ? 0.0f : o->lora_dropout;
    md.seed = (uint64_t)(uint32_t)o->seed;
    md.generate = o->generate > 0;
    return md;
}

// Which blocks recompute: the first md->recompute of them. The plan is static (every arena lives
// for the whole step), so which N recompute does not change the planned peak; the first N give the
// most room where memory is freed as it goes and the most overlap: their checkpoints' copies to
// the host (--offload host) start at the top of the forward and run beside the kept blocks'
// forward, their fetches beside the kept blocks' backward, and the recomputed set is needed only
// after the kept blocks' backward is done. Block 0 then recomputes whenever any block does, so
// the shared scratch set planned by block 0 is the recomputed block's (a superset of what a kept
// block shares: llama_plan_block, vit_plan_blocks).
static int train_block_recomputes(const TrainModes* md, int l) { return l < md->recompute; }
// How many of `layers` blocks recompute (RECOMPUTE_AUTO not yet fitted: none).
static int train_recomputed_blocks(const TrainModes* md, int layers) {
    return md->recompute < 0 ? 0 : md->recompute < layers ? md->recompute : layers;
}
// md with k blocks recomputed (auto's choice): --offload host moves nothing when k is 0.
static TrainModes train_modes_recompute(TrainModes md, int k) {
    md.recompute = k;
    if (!k) md.offload_host = 0;
    return md;
}

// Refuses --recompute N beyond the model's blocks (one line, naming the count).
static void train_check_recompute(const TrainOptions* o, int layers, const char* model_dir) {
    int n = recompute_count(o->recompute);
    if (n > layers && n != RECOMPUTE_ALL)
        fail("flag --recompute: %d blocks, but %s/config.json has %d (use a number 0..%d, block or auto)", n,
             model_dir, layers, layers);
}

// The same run in --mode baseline: every memory-saving switch off (what plans are compared with).
static TrainModes train_baseline_modes(TrainModes md) {
    md.approx = 0; md.ms = 0; md.recompute = 0; md.recompute_product = 0; md.offload_host = 0;
    md.mlp_tile = 0;
    return md;
}

// Linear warmup to lr, then cosine decay to lr * min_frac at the last step.
static float lr_at_step(const TrainOptions* o, int step) {
    if (o->warmup > 0 && step < o->warmup) return o->lr * (float)(step + 1) / (float)o->warmup;
    int decay = o->steps - o->warmup;
    if (decay <= 1) return o->lr;
    float t = (float)(step - o->warmup) / (float)(decay - 1);
    float floor_lr = o->lr * o->min_lr_frac;
    return floor_lr + 0.5f * (o->lr - floor_lr) * (1.0f + cosf(3.14159265358979f * t));
}

// --grad-accum against what one step holds: the sequences or images of a step are counted in an
// int, and a text step reads all its micro-batches' tokens at once into host memory (inputs,
// targets, mask and positions: 16 bytes a token, indexed by int), so a huge count would end in
// an allocation failure that names no flag.
enum { STEP_HOST_BYTES_PER_TOKEN = 16 };
static void train_check_grad_accum(const TrainOptions* o, TrainTask task) {
    int64_t items = (int64_t)o->batch * o->grad_accum;
    if (items > INT_MAX)
        fail("flag --grad-accum: %d micro-batches of --batch %d are %lld per step, more than %d; use a smaller "
             "--grad-accum", o->grad_accum, o->batch, (long long)items, INT_MAX);
    if (task != TRAIN_TEXT) return;
    int64_t tokens = items * o->seq;
    double gib = (double)tokens * STEP_HOST_BYTES_PER_TOKEN / 1073741824.0;
    double host_gib = (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE) / 1073741824.0;
    if (tokens > INT_MAX || (host_gib > 0 && gib > host_gib))
        fail("flag --grad-accum: %d micro-batches of --batch %d x --seq %d are %lld tokens per step, held in host "
             "memory at once (%.1f GiB; at most %d tokens, and this host has %.1f GiB); use a smaller --grad-accum",
             o->grad_accum, o->batch, o->seq, (long long)tokens, gib, INT_MAX, host_gib);
}

// Parses argv with the trainer's flag table and applies the checks every trainer makes before it
// reads anything.
static void train_parse_flags(FlagTable* t, TrainOptions* o, int argc, char** argv) {
    flags_parse(t, argc, argv);
    train_resolve_mode(o);
    train_validate(o);
    train_check_grad_accum(o, flags_find(t, "seq") ? TRAIN_TEXT : TRAIN_IMAGE);
    if (!o->model_dir) fail("flag --model is required (a model directory with config.json and model.safetensors)");
    if (o->json && !o->dry_run) fail("flag --json: only valid with --dry-run");
    if (strcmp(o->fit, "none") != 0 && !o->dry_run && (!o->data_path || o->eval_only))
        fail("flag --fit %s: only with --dry-run, or on a training run (--data) whose steps calibrate it", o->fit);
    if (o->ranks < 0) fail("flag --ranks: expected >= 1, got %d", o->ranks);
    if (o->ranks && !o->dry_run) fail("flag --ranks: only valid with --dry-run (mpirun -np N launches the ranks)");
    if (o->max_seq && !o->dry_run)
        fail("flag --max-seq: only valid with --dry-run (it plans the longest --seq; a run takes the --seq it is "
             "given)");
    if (flag_seen(t, "mem-limit") && !(o->mem_limit > 0))
        fail("flag --mem-limit: expected the memory in GiB, > 0, got %g", o->mem_limit);
    if (flag_seen(t, "gpu-mem") && !(o->gpu_mem > 0))
        fail("flag --gpu-mem: expected the card's memory in GiB, > 0, got %g", o->gpu_mem);
    if (o->gpu_mem > 0 && !o->dry_run)
        fail("flag --gpu-mem: only valid with --dry-run (a run checks the memory of the GPU it has)");
    if (o->gpu_mem > 0 && strcmp(o->device, "cpu") == 0)
        fail("flag --gpu-mem: plans a CUDA card, not with --device cpu (whose plan is checked against the host's "
             "MemAvailable, or LLMC_HOST_MEMORY_BYTES)");
    if (o->adapter_dir && !dir_exists(o->adapter_dir))
        fail(
            "flag --adapter: %s is not a directory (expected one holding adapter_config.json and "
            "adapter_model.safetensors)",
            o->adapter_dir);
}

// Whether two paths name the same existing directory: device and inode, so that a symlink, "..",
// or a trailing slash cannot make the model's own directory look like another.
static int same_directory(const char* a, const char* b) {
    struct stat sa, sb;
    return stat(a, &sa) == 0 && stat(b, &sb) == 0 && S_ISDIR(sa.st_mode) && sa.st_dev == sb.st_dev &&
           sa.st_ino == sb.st_ino;
}

// --export-merged and --full's saves write model.safetensors and config.json: into --model's own
// directory they would overwrite the base model, so they are refused before anything runs.
static void train_refuse_model_dir_outputs(const TrainOptions* o) {
    if (o->export_merged && same_directory(o->export_merged, o->model_dir))
        fail(
            "flag --export-merged: %s is the model's own directory (--model %s); writing there would overwrite the "
            "base model, choose "
            "another directory",
            o->export_merged, o->model_dir);
    const char* out = o->out_dir ? o->out_dir : o->resume_dir;
    if (o->full && out && same_directory(out, o->model_dir))
        fail(
            "flag --%s: %s is the model's own directory (--model %s); --full saves model.safetensors there, over the "
            "base model, choose "
            "another directory",
            o->out_dir ? "out" : "resume", out, o->model_dir);
}

// --eval-only --resume DIR evaluates the adapter that DIR's run saved: it becomes --adapter DIR
// (what the drivers load), after rank 0 has finished or cleared an interrupted save there, under
// DIR's lock (a read-only DIR is only read). A --full run's save is a model directory, evaluated
// with --model: refused here.
static void train_eval_resumed(TrainOptions* o, int rank) {
    if (!dir_exists(o->resume_dir)) fail("flag --resume: %s is not a directory", o->resume_dir);
    if (o->full)
        fail("flag --eval-only --resume: a --full run saves a model directory; evaluate it with --eval-only --model %s",
             o->resume_dir);
    mode_t mode;
    if (rank == 0 && access(o->resume_dir, W_OK) == 0) {
        out_dir_lock(o->resume_dir, "resume");
        out_dir_check_names(o->resume_dir, "resume");
        save_dir_recover(o->resume_dir);
    } else if (rank == 0 && out_dir_entry(o->resume_dir, SAVE_COMMITTED, &mode)) {  // read-only: nothing to finish it
        fail("flag --eval-only --resume: %s holds a save interrupted mid-publish (%s), and cannot be written to "
             "finish it",
             o->resume_dir, SAVE_COMMITTED);
    }
    char* adapter = path_join(o->resume_dir, "adapter_model.safetensors");
    if (!file_exists(adapter))
        fail("flag --eval-only --resume: %s holds no saved adapter (%s is missing)", o->resume_dir, adapter);
    free(adapter);
    o->adapter_dir = o->resume_dir;
    o->resume_dir = NULL;
}

// Rank 0's claim on the directories the run writes, before anything is read: the lock of each
// (--out, --resume's), the names a save writes there, another run's save in a new run's --out,
// and --export-merged's directory against them. A write past the file size limit (SIGXFSZ,
// RLIMIT_FSIZE) fails with EFBIG, which the writers report in one line, removing their stage; a
// stop by SIGINT, SIGTERM or SIGHUP removes the stage too and says so (save_stop_on_signals).
static void train_claim_outputs(const TrainOptions* o) {
    signal(SIGXFSZ, SIG_IGN);
    if (o->out_dir || o->export_merged) save_stop_on_signals();
    out_dir_check_export(o->export_merged, o->out_dir, "out");  // before --out holds the lock file
    out_dir_check_export(o->export_merged, o->resume_dir, "resume");
    int trains = o->data_path && !o->eval_only;
    int same = o->out_dir && o->resume_dir && same_directory(o->out_dir, o->resume_dir);
    if (trains && o->resume_dir) {
        out_dir_lock(o->resume_dir, "resume");
        out_dir_check_names(o->resume_dir, "resume");
    }
    if (trains && o->out_dir && !same) {
        out_dir_lock(o->out_dir, "out");
        out_dir_check_names(o->out_dir, "out");
        out_dir_refuse_other_run(o->out_dir, o->full);
    }
    if (o->export_merged) {
        export_dir_check(o->export_merged, "flag --export-merged");
        out_dir_check_export_writable(o->export_merged);
    }
}

// The run-level checks and setup shared by the trainers (after the dry-run branch): flags that
// need each other, threads, and the output directory (made and claimed by rank 0). The backend is
// chosen by backend_init (llmc/backend.h).
static void train_prepare_run(TrainOptions* o, int rank) {
    if (o->eval_only && !o->val_path) fail("flag --eval-only: needs --val");
    if (o->eval_only && o->resume_dir) train_eval_resumed(o, rank);
    if (o->resume_dir && !o->data_path) fail("flag --resume: needs --data (the same training data as the saved run)");
    if (o->resume_dir && !dir_exists(o->resume_dir)) fail("flag --resume: %s is not a directory", o->resume_dir);
    if (o->stop_at && !o->out_dir && !o->resume_dir)
        fail("flag --stop-at: needs --out (where the run is saved to resume later)");
    train_refuse_model_dir_outputs(o);
    if (o->threads > 0) omp_set_num_threads(o->threads);
    if (o->out_dir && rank == 0) make_dirs(o->out_dir, "flag --out");
    if (rank == 0) train_claim_outputs(o);
}
