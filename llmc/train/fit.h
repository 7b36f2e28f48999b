// fit.h: whether a run's memory plan fits the GPU (or, on the CPU backend, the host's available
// memory, where Linux would otherwise let the run start and kill it later), checked before
// anything is allocated, and when
// it does not, what would: the largest --batch that fits with the run's own flags, with
// --mode lowmem, with --mode ckpt and (LoRA, train_llama) with --mode lowmem --quant nf4 (each
// found by planning, which allocates nothing), with the
// --grad-accum that keeps the tokens or images per step, and under --full the fewest ranks
// whose ZeRO-1 shards fit. A memory-bound user gets one line that says what to change, instead
// of an out-of-memory error after minutes of loading.
#pragma once
#include "../common.h"
#include "../memory/plan.h"
#include "../backend.h"
#include "run_options.h"

// A trainer's planner: the bytes of one rank's plan of the run `o` describes at micro-batch
// `batch` over `world` ranks (the model is set up, planned and freed; nothing is allocated).
typedef size_t (*PlanBytesFn)(const void* ctx, const TrainOptions* o, int batch, int world);

// Memory the plan may take, in bytes: the GPU's free memory, or on the CPU the kernel's estimate
// of what can be allocated without swapping (MemAvailable in /proc/meminfo; SIZE_MAX when there
// is none, and the check then passes). LLMC_HOST_MEMORY_BYTES (llmc/settings.h) replaces the host's
// figure (tests).
static const char* host_memory_source(void) {
    return setting_is_set(SETTING_HOST_MEMORY_BYTES) ? "LLMC_HOST_MEMORY_BYTES" : "MemAvailable";
}
static size_t host_available_bytes(void) {
    if (setting_is_set(SETTING_HOST_MEMORY_BYTES)) return (size_t)setting_count(SETTING_HOST_MEMORY_BYTES);
    FILE* f = fopen("/proc/meminfo", "r");
    if (!f) return SIZE_MAX;
    char line[256];
    unsigned long long kb = 0;
    int found = 0;
    while (!found && fgets(line, sizeof(line), f)) found = sscanf(line, "MemAvailable: %llu kB", &kb) == 1;
    fclose(f);
    return found ? (size_t)kb * 1024 : SIZE_MAX;
}
static size_t backend_free_bytes(const Backend* be) {
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) {
        size_t fr, tot;
        CUDA_CHECK(cudaMemGetInfo(&fr, &tot));
        return fr;
    }
#endif
    (void)be;
    return host_available_bytes();
}

// The largest micro-batch up to `most` whose plan under o's switches fits `avail` bytes, or 0.
// (A plan grows with the batch, so a bisection finds it.)
static int fit_largest_batch(PlanBytesFn plan_bytes, const void* ctx, const TrainOptions* o, int most, int world,
                             size_t avail) {
    if (plan_bytes(ctx, o, most, world) <= avail) return most;
    int lo = 0, hi = most;  // fits(lo) (0: nothing yet), !fits(hi)
    while (hi - lo > 1) {
        int mid = lo + (hi - lo) / 2;
        if (plan_bytes(ctx, o, mid, world) <= avail) lo = mid;
        else hi = mid;
    }
    return lo;
}

// A trainer's planner by sequence length: the bytes of one rank's plan of o's run (its --batch,
// its ranks) at `seq` tokens per sequence, counted as fit_check_plan counts them.
typedef size_t (*SeqPlanBytesFn)(const void* ctx, const TrainOptions* o, int seq);

// The longest sequence up to `most` whose plan fits `avail` bytes, or 0 when not even one token
// does. A bisection on the plan itself, as fit_largest_batch (a plan grows with the sequence):
// every step keeps fits(lo) and !fits(hi), so the answer fits and one token more does not.
static int fit_longest_seq(SeqPlanBytesFn plan_bytes, const void* ctx, const TrainOptions* o, int most, size_t avail) {
    if (plan_bytes(ctx, o, most) <= avail) return most;
    int lo = 0, hi = most;  // fits(lo) (0: nothing yet), !fits(hi)
    while (hi - lo > 1) {
        int mid = lo + (hi - lo) / 2;
        if (plan_bytes(ctx, o, mid) <= avail) lo = mid;
        else hi = mid;
    }
    return lo;
}

// The memory a dry run plans for (--max-seq, --gpu-mem): `bytes`, and where the figure comes from.
typedef struct {
    size_t bytes;
    char source[96];
} FitBudget;

// --mem-limit GIB in bytes (0: not given).
static size_t fit_mem_limit_bytes(const TrainOptions* o) {
    return o->mem_limit > 0 ? (size_t)((double)o->mem_limit * 1073741824.0) : 0;
}

// b capped by --mem-limit where that is less.
static FitBudget fit_budget_capped(FitBudget b, const TrainOptions* o) {
    size_t limit = fit_mem_limit_bytes(o);
    if (!limit || limit >= b.bytes) return b;
    b.bytes = limit;
    snprintf(b.source, sizeof(b.source), "--mem-limit %g", o->mem_limit);
    return b;
}

// The CUDA plan's budget (capped by --mem-limit): --gpu-mem GIB when given, else the free memory of the GPU present (as
// a run's fit check takes it); the CPU plan's: the host's MemAvailable, as the CPU fit check
// takes it. Fails (one line) where there is nothing to plan for.
static FitBudget fit_budget(const TrainOptions* o, int cuda_plan, const char* flag) {
    FitBudget b;
    memset(&b, 0, sizeof(b));
    if (o->gpu_mem > 0) {
        b.bytes = (size_t)((double)o->gpu_mem * 1073741824.0);
        snprintf(b.source, sizeof(b.source), "--gpu-mem %g", o->gpu_mem);
        return fit_budget_capped(b, o);
    }
    if (o->mem_limit > 0 && cuda_plan) {  // the card is unknown here: the limit is the budget
        b.bytes = fit_mem_limit_bytes(o);
        snprintf(b.source, sizeof(b.source), "--mem-limit %g", o->mem_limit);
        return b;
    }
    if (!cuda_plan) {
        b.bytes = host_available_bytes();
        if (b.bytes == SIZE_MAX) fail("flag %s: this host reports no MemAvailable in /proc/meminfo; set "
                                      "LLMC_HOST_MEMORY_BYTES to the bytes to plan for", flag);
        snprintf(b.source, sizeof(b.source), "%s", host_memory_source());
        return fit_budget_capped(b, o);
    }
#ifdef LLMC_HAVE_CUDA
    if (backend_cuda_devices() > 0) {
        size_t fr, tot;
        CUDA_CHECK(cudaMemGetInfo(&fr, &tot));
        b.bytes = fr;
        snprintf(b.source, sizeof(b.source), "free on GPU 0");
        return fit_budget_capped(b, o);
    }
#endif
    fail("flag %s: no CUDA GPU here to plan for; give --gpu-mem GIB (the card's memory the run may take) or "
         "--device cpu (this host's memory)", flag);
    return b;
}

// Appends "[MODE ]--batch b --grad-accum k" for the largest batch that fits under o's switches and
// divides the step's sequences or images, so that b k is exactly what was asked (a rounded-up k
// would suggest a bigger step than asked: 42 sequences for 40 with a batch of 6), or that not
// even one fits.
static void fit_suggest(char* buf, size_t n, const char* mode, PlanBytesFn plan_bytes, const void* ctx,
                        const TrainOptions* o, int world, size_t avail) {
    int b = fit_largest_batch(plan_bytes, ctx, o, o->batch, world, avail);
    size_t len = strlen(buf);
    const char* sep = len ? "; " : "";
    if (b == 0) { snprintf(buf + len, n - len, "%s%s%snot even --batch 1", sep, mode, *mode ? ": " : ""); return; }
    int64_t per_step = (int64_t)o->batch * o->grad_accum;
    while (per_step % b) b--;  // a smaller batch fits too (a plan grows with the batch); 1 divides
    int accum = (int)(per_step / b);
    snprintf(buf + len, n - len, "%s%s%s--batch %d --grad-accum %d", sep, mode, *mode ? " " : "", b, accum);
}

// "12.34 GiB" or, below 1 GiB, "56.7 MiB".
static const char* fit_size(char* buf, size_t n, size_t bytes) {
    if (bytes >= ((size_t)1 << 30)) snprintf(buf, n, "%.2f GiB", bytes / 1073741824.0);
    else snprintf(buf, n, "%.1f MiB", bytes / 1048576.0);
    return buf;
}

// On CUDA, fails (one line) when the plan's pinned host memory (--offload host) is more than the
// host has available: page-locked memory cannot be swapped, so an overcommitted host would fail
// the allocation or start swapping everything else.
static void fit_check_host(const Backend* be, const MemPlan* plan, int local_ranks) {
    size_t need = plan_host_bytes(plan), avail = host_available_bytes();
    if (!be->cuda || !need || avail == SIZE_MAX) return;
    if (local_ranks > 1) avail /= (size_t)local_ranks;
    if (need <= avail) return;
    char a[32], b[32];
    fail("flag --offload host: the block checkpoints need %s of pinned host memory but %s is available (%s%s); "
         "try a smaller --batch/--seq or --offload none", fit_size(a, sizeof(a), need), fit_size(b, sizeof(b), avail),
         host_memory_source(),
         local_ranks > 1 ? ", divided among the node's ranks" : "");
}

// The memory a run's plan may take (fit_check_plan): the device's free memory, or on the CPU the
// host's available memory shared by the node's `local_ranks` (SIZE_MAX: unknown, everything fits).
static size_t fit_avail_bytes(const Backend* be, int local_ranks) {
    size_t avail = backend_free_bytes(be);
    if (!be->cuda && avail != SIZE_MAX && local_ranks > 1) avail /= (size_t)local_ranks;
    return avail;
}

// What a run may plan: fit_avail_bytes, capped by --mem-limit where that is less.
static size_t fit_run_avail(const Backend* be, const TrainOptions* o, int local_ranks) {
    size_t avail = fit_avail_bytes(be, local_ranks), limit = fit_mem_limit_bytes(o);
    return limit && limit < avail ? limit : avail;
}

// Whether --recompute auto applies: asked for, or (a run, not a dry run) the default of a mode that
// recomputes nothing, where the run would not fit otherwise (the trainer falls back to the flags as
// given when not even every block recomputed fits, so the fit check says what would).
static int fit_recompute_auto(const TrainOptions* o) {
    return !strcmp(o->recompute, "auto") || (o->recompute_default && !o->dry_run);
}

// The start-up line on the blocks recomputed: "recompute K of L blocks (why)", into buf.
static void fit_recompute_line(char* buf, size_t n, const TrainOptions* o, int k, int layers, size_t budget) {
    char a[32];
    if (fit_recompute_auto(o) && budget && budget != SIZE_MAX)
        snprintf(buf, n, "recompute %d of %d blocks (the fewest that fit %s%s)", k, layers,
                 fit_size(a, sizeof(a), budget), o->mem_limit > 0 ? ", --mem-limit" : "");
    else if (fit_recompute_auto(o))
        snprintf(buf, n, "recompute %d of %d blocks (no memory known to fit)", k, layers);
    else snprintf(buf, n, "recompute %d of %d blocks (--recompute %s)", k, layers, o->recompute);
}

// --mem-limit below every plan the run's flags can make: refused in one line naming the smallest
// budget that would fit (`smallest`: the plan of the flags with every choice at its least; `what`
// says which).
static void fit_refuse_mem_limit(const TrainOptions* o, size_t need, size_t smallest, const char* what) {
    size_t limit = fit_mem_limit_bytes(o);
    if (!limit || need <= limit) return;
    char a[32], b[32];
    fail("flag --mem-limit: %s is below anything these flags fit; the smallest budget that would fit is %s (%s)",
         fit_size(a, sizeof(a), limit), fit_size(b, sizeof(b), smallest), what);
}

// Fails (one line) when `plan` needs more than the device has free (the host has available,
// shared by the node's `local_ranks`): what the plan needs by category, what is free, and what
// would fit.
static void fit_check_plan(const Backend* be, const MemPlan* plan, PlanBytesFn plan_bytes, const void* ctx,
                           const TrainOptions* o, int world, int local_ranks) {
    fit_check_host(be, plan, local_ranks);
    // on the CPU the host arena is host memory like the rest
    size_t need = plan_total(plan) + (be->cuda ? 0 : plan_host_bytes(plan)), avail = fit_run_avail(be, o, local_ranks);
    if (need <= avail) return;
    char parts[320] = "", hint[512] = "", a[32], b[32];
    for (int c = 0; c < MEM_CATS; c++)
        if (plan->cat_bytes[c]) {
            size_t len = strlen(parts);
            snprintf(parts + len, sizeof(parts) - len, "%s%s %s", len ? ", " : "", mem_category_key[c],
                     fit_size(a, sizeof(a), plan->cat_bytes[c]));
        }
    TrainOptions v = *o;
    fit_suggest(hint, sizeof(hint), "", plan_bytes, ctx, &v, world, avail);
    int is_lowmem = !strcmp(o->act, "approx") && !strcmp(o->norm, "ms") && !strcmp(o->recompute, "none");
    int is_ckpt_preset = !strcmp(o->act, "exact") && !strcmp(o->norm, "std") && !strcmp(o->recompute, "block");
    if (!is_lowmem) {
        v.act = "approx";
        v.norm = "ms";
        v.recompute = "none";
        fit_suggest(hint, sizeof(hint), "--mode lowmem", plan_bytes, ctx, &v, world, avail);
    }
    if (!is_ckpt_preset) {
        v.act = "exact";
        v.norm = "std";
        v.recompute = "block";
        fit_suggest(hint, sizeof(hint), "--mode ckpt", plan_bytes, ctx, &v, world, avail);
    }
    if (!o->full &&
        !strcmp(o->quant, "none")) {  // frozen linears in NF4, where the trainer offers it (its plan shrinks)
        TrainOptions q = *o;
        q.act = "approx"; q.norm = "ms"; q.recompute = "none"; q.quant = "nf4";
        TrainOptions p = q;
        p.quant = "none";
        if (plan_bytes(ctx, &q, 1, world) < plan_bytes(ctx, &p, 1, world))
            fit_suggest(hint, sizeof(hint), "--mode lowmem --quant nf4", plan_bytes, ctx, &q, world, avail);
    }
    if (o->full) {  // ZeRO-1 divides the optimizer state (and on train_llama the fp32 master) by the ranks
        for (int w = 2 * world; w <= 4096; w *= 2)
            if (plan_bytes(ctx, o, o->batch, w) <= avail) {
                size_t len = strlen(hint);
                snprintf(hint + len, sizeof(hint) - len,
                         "; these flags on %d ranks (ZeRO-1 shards; --dry-run --ranks N plans them)", w);
                break;
            }
    }
    char where[128], share[64] = "";
    if (local_ranks > 1) snprintf(share, sizeof(share), ", divided among the node's %d ranks", local_ranks);
    if (fit_mem_limit_bytes(o) == avail) snprintf(where, sizeof(where), "is the --mem-limit");
    else if (be->cuda) snprintf(where, sizeof(where), "is free on GPU %d", be->device);
    else
        snprintf(where, sizeof(where), "is available (%s%s)",
                 host_memory_source(), share);
    fail("the memory plan needs %s of %s memory (%s) but %s %s; would fit: %s", fit_size(a, sizeof(a), need),
         be->cuda ? "GPU" : "host", parts, fit_size(b, sizeof(b), avail), where, hint);
}
