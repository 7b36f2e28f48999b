// plan.h: the memory plan. Every buffer a run allocates is first declared here as data (name,
// owning module, block, category, bytes, where its pointer goes); arenas, one per category, are
// then sized and allocated in one go, so `--dry-run` can print exactly what a run would allocate
// without touching weights, and the log can print the plan beside the measured peak.
#pragma once
#include "../common.h"
#include "../formats/json.h"

// MEM_HOST is the one category not on the device: pinned host memory (--offload host's block
// checkpoints), plain host memory on the CPU backend. plan_total counts the device's categories.
typedef enum {
    MEM_FROZEN, MEM_TRAINABLE, MEM_GRADS, MEM_OPTIM, MEM_SAVED, MEM_SCRATCH, MEM_HOST, MEM_CATS
} MemCategory;
static const char* mem_category_name[MEM_CATS] = {"frozen weights", "trainable weights", "gradients", "optimizer state",
                                                  "saved activations", "scratch", "pinned host memory"};
static const char* mem_category_key[MEM_CATS] = {"frozen", "trainable", "grads", "optimizer", "saved", "scratch",
                                                 "host"};
#define MEM_DEVICE_CATS MEM_HOST  // the categories before it live on the device

#define PLAN_ALIGN 64
// The block of a buffer that belongs to no one block but to the scratch set every block's forward
// (and, under --recompute block, its recomputed forward and backward) uses in turn.
#define PLAN_SHARED_BLOCK (-2)
// The CPU emulator of the CUDA backend (test/emu/emu.h) is given a guard zone after every
// buffer, so that an out-of-bounds access inside an arena is caught (backend.h registers them).
#ifdef LLMC_CUDA_EMU
#define PLAN_GUARD 256
#else
#define PLAN_GUARD 0
#endif

typedef struct {
    char name[48];
    const char* module;    // owning module: a row of the per-block table
    int block;             // -1: not per block; PLAN_SHARED_BLOCK: a block's buffer in the set all blocks share
    MemCategory cat;
    size_t bytes;
    void** bind;           // receives the buffer's address at allocation (may be NULL)
    size_t offset;
} PlanBuffer;

typedef struct {
    PlanBuffer* bufs;
    int count, cap;
    size_t cat_bytes[MEM_CATS];
    uint8_t* arena[MEM_CATS];
    int64_t tokens;        // tokens per micro-batch (B*T), for per-token figures
    int blocks;
    int recomputed;        // blocks whose forward runs again before their backward (--recompute block: all; N: N)
    // Heap scratch beside the arenas that a kernel takes for the length of one call and that grows
    // with the tokens (the CPU attention's packed keys and partial sums): the largest such call.
    // Not in any arena; a run's peak is the arenas plus at most this (0 on CUDA: all planned).
    size_t percall_bytes;
    // The LM head's chunk (llmc/memory/loss_buffers.h): rows of logits at once, and the rule that
    // chose it ("plan", "old", "rows": LLMC_HEAD_CHUNK); 0 where the model has no such head.
    int64_t loss_chunk_rows;
    const char* loss_chunk_rule;
} MemPlan;

// Declares a buffer at an offset of its category's arena that is a multiple of align (a power of
// two, at least PLAN_ALIGN; arenas start 256-byte aligned); the padding before it counts in the arena.
static void plan_add_aligned(MemPlan* p, MemCategory cat, const char* module, int block, const char* name, size_t bytes,
                             void* bind, size_t align) {
    if (p->count == p->cap) {
        p->cap = p->cap ? 2 * p->cap : 256;
        p->bufs = (PlanBuffer*)realloc(p->bufs, p->cap * sizeof(PlanBuffer));
        if (!p->bufs) fail("out of host memory");
    }
    PlanBuffer* b = &p->bufs[p->count++];
    memset(b, 0, sizeof(*b));
    snprintf(b->name, sizeof(b->name), "%.47s", name);
    b->module = module;
    b->block = block;
    b->cat = cat;
    b->bytes = bytes;
    b->bind = (void**)bind;
    b->offset = round_up(p->cat_bytes[cat], align);
    p->cat_bytes[cat] = b->offset + round_up(bytes, PLAN_ALIGN) + PLAN_GUARD;
}

static void plan_add(MemPlan* p, MemCategory cat, const char* module, int block, const char* name, size_t bytes,
                     void* bind) {
    plan_add_aligned(p, cat, module, block, name, bytes, bind, PLAN_ALIGN);
}

// The device's bytes (on the CPU backend: all but the host arena).
static size_t plan_total(const MemPlan* p) {
    size_t t = 0;
    for (int c = 0; c < MEM_DEVICE_CATS; c++) t += p->cat_bytes[c];
    return t;
}
static size_t plan_host_bytes(const MemPlan* p) { return p->cat_bytes[MEM_HOST]; }

// Exact bytes (not rounded to the arena alignment) of one block's share of the shared scratch set:
// what one block's forward writes beyond what it keeps, or under --recompute block, everything
// its recomputed forward makes for its backward.
static size_t plan_shared_block_bytes(const MemPlan* p) {
    size_t s = 0;
    for (int i = 0; i < p->count; i++)
        if (p->bufs[i].cat == MEM_SCRATCH && p->bufs[i].block == PLAN_SHARED_BLOCK) s += p->bufs[i].bytes;
    return s;
}

// The recomputed block's peak: every scratch byte (exact, not rounded to the arena alignment),
// which a block's recomputed forward and its backward run within. Buffers whose lives do not
// overlap are one plan entry bound twice by the model (LLaMA: dz and dout in resid's buffer), so
// the peak is the sum of the entries, the whole scratch arena.
static size_t plan_block_peak_bytes(const MemPlan* p) {
    size_t s = 0;
    for (int i = 0; i < p->count; i++) if (p->bufs[i].cat == MEM_SCRATCH) s += p->bufs[i].bytes;
    return s;
}

// The parts of that peak: the shared block set (PLAN_SHARED_BLOCK) as "block set", every other
// scratch buffer under its module, in order of first appearance (at most max; returns the count).
static int plan_block_peak_parts(const MemPlan* p, const char** names, size_t* bytes, int max) {
    int n = 0;
    for (int i = 0; i < p->count; i++) {
        const PlanBuffer* b = &p->bufs[i];
        if (b->cat != MEM_SCRATCH) continue;
        const char* name = b->block == PLAN_SHARED_BLOCK ? "block set" : b->module;
        int k = 0;
        while (k < n && strcmp(names[k], name) != 0) k++;
        if (k == n) {
            if (n == max) continue;
            names[n] = name;
            bytes[n++] = 0;
        }
        bytes[k] += b->bytes;
    }
    return n;
}

#define PLAN_MAX_PARTS 32

// Allocates (zeroed) arenas and writes every buffer's address to its bind.
static void plan_allocate_host(MemPlan* p) {
    for (int c = 0; c < MEM_CATS; c++) {
        p->arena[c] = NULL;
        if (!p->cat_bytes[c]) continue;
        p->arena[c] = (uint8_t*)calloc(1, p->cat_bytes[c]);
        if (!p->arena[c])
            fail(
                "cannot allocate %.1f MiB of host memory for %s (try a smaller --batch/--seq, --mode lowmem or --mode "
                "ckpt)",
                p->cat_bytes[c] / 1048576.0, mem_category_name[c]);
    }
    for (int i = 0; i < p->count; i++)
        if (p->bufs[i].bind) *p->bufs[i].bind = p->arena[p->bufs[i].cat] + p->bufs[i].offset;
}

static void plan_free(MemPlan* p) {
    for (int c = 0; c < MEM_CATS; c++) free(p->arena[c]);
    free(p->bufs);
    memset(p, 0, sizeof(*p));
}

// Saved-activation bytes of one module in one block (block -1: the non-block buffers).
static size_t plan_module_bytes(const MemPlan* p, const char* module, int block) {
    size_t s = 0;
    for (int i = 0; i < p->count; i++) {
        const PlanBuffer* b = &p->bufs[i];
        if (b->cat == MEM_SAVED && b->block == block && strcmp(b->module, module) == 0) s += b->bytes;
    }
    return s;
}

// The distinct saved modules of both plans, in order of first appearance (at most max).
static int plan_modules(const MemPlan* a, const MemPlan* b, const char** out, int max) {
    int n = 0;
    const MemPlan* ps[2] = {a, b};
    for (int k = 0; k < 2; k++) {
        if (!ps[k]) continue;
        for (int i = 0; i < ps[k]->count; i++) {
            const PlanBuffer* buf = &ps[k]->bufs[i];
            if (buf->cat != MEM_SAVED) continue;
            int seen = 0;
            for (int j = 0; j < n && !seen; j++) seen = strcmp(out[j], buf->module) == 0;
            if (!seen && n < max) out[n++] = buf->module;
        }
    }
    return n;
}

static double mib(size_t b) { return b / 1048576.0; }

// The per-module table: bytes per token per block of the chosen plan beside the baseline plan.
static void plan_print(const MemPlan* p, const MemPlan* base, const char* mode_name, const char* layout) {
    const char* mods[32];
    int n = plan_modules(base, p, mods, 32);
    double N = (double)p->tokens;
    printf("activation memory plan (%s layout, %lld tokens per micro-batch, %d blocks)\n", layout, (long long)p->tokens,
           p->blocks);
    printf("  %-22s %16s %16s   bytes per token per block\n", "module", "baseline", mode_name);
    size_t tb = 0, tp = 0;
    for (int i = 0; i < n; i++) {
        size_t b = plan_module_bytes(base, mods[i], 0), q = plan_module_bytes(p, mods[i], 0);
        tb += b; tp += q;
        if (b || q) printf("  %-22s %16.1f %16.1f\n", mods[i], b / N, q / N);
    }
    printf("  %-22s %16.1f %16.1f\n", "per block", tb / N, tp / N);
    size_t nb_p = 0;
    for (int i = 0; i < n; i++) nb_p += plan_module_bytes(p, mods[i], -1);
    size_t sb = base->cat_bytes[MEM_SAVED], sp = p->cat_bytes[MEM_SAVED];
    printf("  saved activations: baseline %.2f MiB, %s %.2f MiB (%+.1f%%); non-block %.2f MiB\n", mib(sb), mode_name,
           mib(sp), sb ? 100.0 * ((double)sp - (double)sb) / (double)sb : 0.0, mib(nb_p));
    if (plan_shared_block_bytes(p))
        printf("  block scratch set (shared by the blocks): %.1f bytes per token\n", plan_shared_block_bytes(p) / N);
    printf("  all arenas:");
    for (int c = 0; c < MEM_DEVICE_CATS; c++)
        printf(" %s %.2f MiB%s", mem_category_key[c], mib(p->cat_bytes[c]), c + 1 < MEM_DEVICE_CATS ? "," : "");
    printf(" = %.2f MiB\n", mib(plan_total(p)));
    if (plan_host_bytes(p)) printf("  pinned host memory: %.2f MiB\n", mib(plan_host_bytes(p)));
    if (p->percall_bytes) printf("  per-call scratch beside the arenas: up to %.2f MiB\n", mib(p->percall_bytes));
    if (p->loss_chunk_rows)
        printf("  LM head chunk: %lld rows of logits at a time (rule %s, LLMC_HEAD_CHUNK)\n",
               (long long)p->loss_chunk_rows, p->loss_chunk_rule);
    if (!p->recomputed) return;
    const char* names[PLAN_MAX_PARTS];
    size_t bytes[PLAN_MAX_PARTS];
    int parts = plan_block_peak_parts(p, names, bytes, PLAN_MAX_PARTS);
    printf("  recomputed block's peak (all scratch; buffers of disjoint lives share an entry): %.1f bytes per "
           "token\n   ",
           plan_block_peak_bytes(p) / N);
    for (int i = 0; i < parts; i++) printf(" %s %.1f%s", names[i], bytes[i] / N, i + 1 < parts ? "," : "\n");
}

static void plan_json_per_block(FILE* f, const MemPlan* p, const char** mods, int n) {
    fprintf(f, "{");
    int first = 1;
    for (int i = 0; i < n; i++) {
        size_t q = plan_module_bytes(p, mods[i], 0);
        if (!q) continue;
        fprintf(f, "%s", first ? "" : ", ");
        json_write_string(f, mods[i]);
        fprintf(f, ": %zu", q);
        first = 0;
    }
    fprintf(f, "}");
}

// Exact saved bytes (not rounded to the arena alignment).
static size_t plan_saved_bytes(const MemPlan* p) {
    size_t s = 0;
    for (int i = 0; i < p->count; i++) if (p->bufs[i].cat == MEM_SAVED) s += p->bufs[i].bytes;
    return s;
}

static void plan_json(FILE* f, const MemPlan* p, const MemPlan* base, const char* settings_json) {
    const char* mods[32];
    int n = plan_modules(base, p, mods, 32);
    fprintf(f, "{%s, \"tokens\": %lld, \"blocks\": %d, \"activation_bytes\": %zu, \"per_block\": ", settings_json,
            (long long)p->tokens, p->blocks, plan_saved_bytes(p));
    plan_json_per_block(f, p, mods, n);
    fprintf(f, ", \"categories\": {");
    for (int c = 0; c < MEM_DEVICE_CATS; c++)
        fprintf(f, "%s\"%s\": %zu", c ? ", " : "", mem_category_key[c], p->cat_bytes[c]);
    fprintf(f, "}, \"total_bytes\": %zu, \"host_bytes\": %zu, \"percall_bytes\": %zu, \"block_scratch_bytes\": %zu",
            plan_total(p), plan_host_bytes(p), p->percall_bytes, plan_shared_block_bytes(p));
    if (p->loss_chunk_rows) {
        fprintf(f, ", \"loss_chunk_rows\": %lld, \"loss_chunk_rule\": ", (long long)p->loss_chunk_rows);
        json_write_string(f, p->loss_chunk_rule);
    }
    if (p->recomputed) {
        const char* names[PLAN_MAX_PARTS];
        size_t bytes[PLAN_MAX_PARTS];
        int parts = plan_block_peak_parts(p, names, bytes, PLAN_MAX_PARTS);
        fprintf(f, ", \"block_peak_bytes\": %zu, \"block_peak_bytes_per_token\": %.3f, \"block_peak_parts\": {",
                plan_block_peak_bytes(p), (double)plan_block_peak_bytes(p) / (double)p->tokens);
        for (int i = 0; i < parts; i++) {
            fprintf(f, "%s", i ? ", " : "");
            json_write_string(f, names[i]);
            fprintf(f, ": %zu", bytes[i]);
        }
        fprintf(f, "}");
    }
    fprintf(f, ", \"baseline\": {\"activation_bytes\": %zu, \"per_block\": ", plan_saved_bytes(base));
    plan_json_per_block(f, base, mods, n);
    fprintf(f, "}}\n");
}
