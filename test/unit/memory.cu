// test/unit/memory.cu: the layout of memory: gradient buckets and ZeRO-1 shards over the trainable
// arena, aligned buffers in the memory plan.
#include "unit.h"
#include "../../llmc/train/trainable.h"
#include "../../llmc/memory/plan.h"
#include "../../llmc/memory/cuda_workspace.h"

// ---- gradient buckets and the ZeRO-1 shard layout ------------------------------------------

// For several arena sizes, world sizes, block layouts and bucket sizes: the buckets tile the
// padded arena from the top down, each splits into equal pieces per rank, 1-byte buckets give
// every block its own; the ranks' shards tile [0, shard) and, written back in arena order,
// rebuild the arena exactly.
void test_grad_buckets(void) {
    int ok = 1;
    const int64_t counts[] = {1, 7, 1000, 4099};
    const char* bytes[] = {"1", "64", "1000000000"};
    for (int ci = 0; ci < 4; ci++)
        for (int world = 1; world <= 4; world++)
            for (int bi = 0; bi < 3; bi++) {
                int64_t count = counts[ci], off[5];
                int blocks = 0;
                for (int64_t o = count / 7; o < count && blocks < 5; o += count / 5 + 1)
                    off[blocks++] = o;  // blocks above a stem
                setenv("LLMC_GRAD_BUCKET_BYTES", bytes[bi], 1);
                settings_read(SETTINGS_AGAIN);
                Trainable tr;
                memset(&tr, 0, sizeof(tr));
                tr.count = count; tr.world = world; tr.zero1 = world > 1;
                tr.shard = tr.zero1 ? (count + world - 1) / world : count;
                tr.padded = tr.zero1 ? tr.shard * world : count;
                trainable_plan_buckets(&tr, off, blocks);
                int64_t hi = tr.padded, align = tr.zero1 ? world : 1;
                for (int i = 0; i < tr.n_buckets; i++) {
                    const GradBucket* b = &tr.buckets[i];
                    ok &= b->hi == hi && b->lo < b->hi && (b->hi - b->lo) % align == 0 && b->shard_off * align == b->lo;
                    hi = b->lo;
                }
                // 1-byte buckets: one per distinct (rounded) block start, plus the stem's; 1 GB: one
                int expect = 1;
                for (int l = 0; l < blocks; l++) {
                    int64_t lo = (off[l] + align - 1) / align * align,
                            prev = l ? (off[l - 1] + align - 1) / align * align : 0;
                    expect += lo > 0 && lo < tr.padded && lo != prev;
                }
                ok &= hi == 0 && tr.n_buckets == (bi == 0 ? expect : bi == 2 ? 1 : tr.n_buckets);
                float* arena = (float*)xmalloc(sizeof(float) * tr.padded);
                float* back = (float*)xcalloc(tr.padded, sizeof(float));
                float* shard = (float*)xmalloc(sizeof(float) * tr.shard);
                for (int64_t i = 0; i < tr.padded; i++) arena[i] = (float)i;
                for (int r = 0; r < world; r++) {
                    int64_t seen = 0;
                    trainable_shard_from_arena(&tr, arena, shard, tr.zero1 ? r : 0);
                    trainable_shard_to_arena(&tr, shard, back, tr.zero1 ? r : 0);
                    for (int i = 0; i < tr.n_buckets; i++) seen += bucket_piece(&tr, &tr.buckets[i]);
                    ok &= seen == tr.shard;
                }
                ok &= memcmp(arena, back, sizeof(float) * tr.padded) == 0;
                free(arena); free(back); free(shard); free(tr.buckets);
            }
    unsetenv("LLMC_GRAD_BUCKET_BYTES");
    settings_read(SETTINGS_AGAIN);
    check(ok, "gradient buckets: ZeRO-1 pieces tile the padded arena", 0);
}

// A buffer planned with an alignment (the cuBLAS workspace: 256 bytes) starts at such an offset,
// its padding counts in the arena, and the buffers around it keep PLAN_ALIGN and do not overlap.
void test_plan_alignment(void) {
    MemPlan p;
    memset(&p, 0, sizeof(p));
    void *a, *w, *b;
    plan_add(&p, MEM_SCRATCH, "m", -1, "a", 100, &a);  // offset 0, next free 128
    plan_add_aligned(&p, MEM_SCRATCH, "cublas", -1, "w", BLAS_WORKSPACE_BYTES, &w, BLAS_WORKSPACE_ALIGN);
    plan_add(&p, MEM_SCRATCH, "m", -1, "b", 3, &b);
    const PlanBuffer* B = p.bufs;
    int ok = B[0].offset == 0 && B[1].offset == 256 && B[2].offset == 256 + BLAS_WORKSPACE_BYTES &&
             p.cat_bytes[MEM_SCRATCH] == 256 + BLAS_WORKSPACE_BYTES + PLAN_ALIGN;
    plan_free(&p);
    check(ok, "plan: a 256-byte aligned buffer between two others", 0);
}
