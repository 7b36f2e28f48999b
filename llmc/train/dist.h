// dist.h: data parallelism across processes. Under mpirun each rank is one process (one GPU on
// the CUDA backend, chosen by local rank); gradients and loss statistics are summed across ranks
// with MPI on the CPU backend. A plain single-process run needs no MPI at all, and a binary built
// without MPI refuses a multi-rank launch instead of silently training N independent copies.
// On the CUDA backend built with NCCL (LLMC_HAVE_NCCL, nvcc builds only) the device gradients are
// summed by NCCL on the GPU; without it they go through host memory and MPI.
#pragma once
#include "../common.h"
#include "../settings.h"
#ifdef LLMC_HAVE_MPI
#include <mpi.h>
#endif
// NCCL needs the real CUDA runtime: plain C++ builds ignore LLMC_HAVE_NCCL, so one set of flags
// can serve every build and the CPU paths stay unchanged. The CPU emulator of the CUDA backend
// always has NCCL, emulated over MPI (test/emu/emu_nccl.h), so that CI runs the NCCL code path too.
#if defined(LLMC_HAVE_NCCL) && defined(__CUDACC__) && !defined(LLMC_CUDA_EMU)
#define LLMC_DIST_NCCL 1
#include <nccl.h>
#elif defined(LLMC_CUDA_EMU)
#define LLMC_DIST_NCCL 1
#include "../../test/emu/emu_nccl.h"
#endif

typedef struct {
    int rank, world, local_rank;
    int local_size;        // ranks on this node (they share its host memory)
    int mpi;               // MPI was initialised by us
    // --seq-parallel P (llmc/train/seq_parallel.h): consecutive ranks in groups of P share one
    // sequence; sp = 0 or 1: off. sp_rank: this rank's place in its group (its slice of the tokens).
    int sp, sp_rank;
#ifdef LLMC_HAVE_MPI
    MPI_Comm sp_comm;      // the group's communicator (MPI_COMM_NULL when off)
#endif
#ifdef LLMC_DIST_NCCL
    int has_nccl;          // `nccl` is live (dist_nccl_init ran), dist_finalize destroys it
    ncclComm_t nccl;
    int has_sp_nccl;       // --seq-parallel: `sp_nccl` is the group's communicator (split from `nccl`)
    ncclComm_t sp_nccl;
#endif
} Dist;

#ifdef LLMC_DIST_NCCL
static void nccl_check(ncclResult_t r, const char* call, const char* file, int line) {
    // ncclGetLastError carries the detail (which peer, which socket) that the code alone lacks.
    if (r != ncclSuccess)
        fail("NCCL error at %s:%d: %s: %s (%s)", file, line, call, ncclGetErrorString(r), ncclGetLastError(NULL));
}
#define NCCL_CHECK(call) nccl_check((call), #call, __FILE__, __LINE__)
#endif

// Ranks announced by the common launchers (Open MPI, MPICH/Hydra, Slurm), or 1. The launchers'
// variables, not settings of ours: rows of llmc/settings.h's table of the role SETTING_OUTSIDE.
static int launcher_world_size(void) {
    const SettingId vars[] = {SETTING_OMPI_WORLD_SIZE, SETTING_PMI_SIZE, SETTING_PMIX_SIZE, SETTING_SLURM_NTASKS};
    for (int i = 0; i < 4; i++) {
        const char* v = setting_outside(vars[i]);
        if (v && atoi(v) > 1 && (i < 3 || setting_outside(SETTING_SLURM_STEP_ID))) return atoi(v);
    }
    return 1;
}

#ifdef LLMC_HAVE_MPI
static void dist_abort_hook(int status) { MPI_Abort(MPI_COMM_WORLD, status); }
#endif

static void dist_init(Dist* d, int* argc, char*** argv) {
    memset(d, 0, sizeof(*d));
    d->world = d->local_size = 1;
    int launched = launcher_world_size();
#ifdef LLMC_HAVE_MPI
    if (launched > 1) {
        MPI_Init(argc, argv);
        d->mpi = 1;
        MPI_Comm_rank(MPI_COMM_WORLD, &d->rank);
        MPI_Comm_size(MPI_COMM_WORLD, &d->world);
        MPI_Comm local;
        MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, d->rank, MPI_INFO_NULL, &local);
        MPI_Comm_rank(local, &d->local_rank);
        MPI_Comm_size(local, &d->local_size);
        MPI_Comm_free(&local);
        g_fail_hook = dist_abort_hook;  // a failing rank stops the whole job, with its message
    }
#else
    (void)argc; (void)argv;
    if (launched > 1)
        fail(
            "launched as one of %d ranks, but this binary was built without MPI (install an MPI, e.g. Debian's "
            "libopenmpi-dev, and rebuild)",
            launched);
#endif
}

static void dist_allreduce_sum_f32(const Dist* d, float* x, int64_t n) {
#ifdef LLMC_HAVE_MPI
    if (d->world > 1)
        for (int64_t off = 0; off < n; off += 1 << 28) {  // MPI counts are int
            int c = (int)(n - off < (1 << 28) ? n - off : (1 << 28));
            MPI_Allreduce(MPI_IN_PLACE, x + off, c, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        }
#else
    (void)d; (void)x; (void)n;
#endif
}

static void dist_allreduce_sum_f64(const Dist* d, double* x, int n) {
#ifdef LLMC_HAVE_MPI
    if (d->world > 1) MPI_Allreduce(MPI_IN_PLACE, x, n, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
#else
    (void)d; (void)x; (void)n;
#endif
}

// Sequence parallelism's groups: ranks sharing one sequence, and the data-parallel groups across them.
static int dist_sp(const Dist* d) { return d && d->sp > 1 ? d->sp : 1; }
static int dist_dp_rank(const Dist* d) { return d->rank / dist_sp(d); }
static int dist_dp_world(const Dist* d) { return d->world / dist_sp(d); }

// Splits the world into groups of P consecutive ranks sharing one sequence (--seq-parallel P); P
// must divide the world size. Every rank calls it (MPI_Comm_split is collective).
static void dist_seq_parallel_init(Dist* d, int P) {
    if (P <= 1) return;
    if (d->world % P != 0)
        fail("flag --seq-parallel: %d does not divide the %d ranks launched (groups of P ranks share one sequence)", P,
             d->world);
    d->sp = P;
    d->sp_rank = d->rank % P;
#ifdef LLMC_HAVE_MPI
    d->sp_comm = MPI_COMM_NULL;
    if (d->world > 1) MPI_Comm_split(MPI_COMM_WORLD, d->rank / P, d->rank, &d->sp_comm);
#endif
}

// Sums n doubles over this rank's sequence-parallel group (evaluation's loss over one sequence's slices).
static void dist_sp_allreduce_sum_f64(const Dist* d, double* x, int n) {
#ifdef LLMC_HAVE_MPI
    if (dist_sp(d) > 1) MPI_Allreduce(MPI_IN_PLACE, x, n, MPI_DOUBLE, MPI_SUM, d->sp_comm);
#else
    (void)d; (void)x; (void)n;
#endif
}

// All-to-all within the sequence-parallel group: block j (`bytes` bytes at send + j * bytes) goes
// to group rank j, and group rank j's block for this rank lands at recv + j * bytes. Host memory.
static void dist_sp_alltoall(const Dist* d, const void* send, void* recv, int64_t bytes) {
#ifdef LLMC_HAVE_MPI
    if (bytes > INT32_MAX) fail("sequence-parallel exchange of %lld bytes per rank is too large for one MPI call",
                                (long long)bytes);
    MPI_Alltoall(send, (int)bytes, MPI_BYTE, recv, (int)bytes, MPI_BYTE, d->sp_comm);
#else
    (void)d; (void)send; (void)recv; (void)bytes;
    fail("internal: a sequence-parallel exchange in a binary built without MPI");
#endif
}

// Refuses a job whose ranks were started differently: every rank sends its `line` (space-separated
// "key=value" words: its flags, or its run's settings with the identity of its model and data),
// and every rank names the first word where a rank differs from rank 0, before any collective
// that a mismatch would hang or corrupt (a different --lora-rank overflows the gradient buffers,
// a different --steps waits forever, a different --lr or --seed silently diverges).
#define DIST_LINE_BYTES 8192
static void dist_check_same(const Dist* d, const char* what, const char* line) {
#ifdef LLMC_HAVE_MPI
    if (d->world <= 1) return;
    char* all = (char*)xcalloc((size_t)d->world, DIST_LINE_BYTES);
    char mine[DIST_LINE_BYTES];
    snprintf(mine, sizeof(mine), "%s", line);
    MPI_Allgather(mine, DIST_LINE_BYTES, MPI_CHAR, all, DIST_LINE_BYTES, MPI_CHAR, MPI_COMM_WORLD);
    for (int r = 1; r < d->world; r++) {
        const char *a = all, *b = all + (size_t)r * DIST_LINE_BYTES;
        if (strcmp(a, b) == 0) continue;
        while (*a && *a == *b) { a++; b++; }  // back to the start of the differing word
        while (a > all && a[-1] != ' ') { a--; b--; }
        int la = (int)strcspn(a, " "), lb = (int)strcspn(b, " ");
        fail("rank %d was started with %.*s, rank 0 with %.*s (%s must be the same on every rank)", r, lb, b, la, a,
             what);
    }
    free(all);
#else
    (void)d; (void)what; (void)line;
#endif
}

// Every rank waits here until all have arrived (rank 0 has finished something the others read).
static void dist_barrier(const Dist* d) {
#ifdef LLMC_HAVE_MPI
    if (d && d->world > 1) MPI_Barrier(MPI_COMM_WORLD);
#else
    (void)d;
#endif
}

static void dist_finalize(Dist* d) {
#ifdef LLMC_HAVE_MPI
    if (d->sp > 1 && d->sp_comm != MPI_COMM_NULL) MPI_Comm_free(&d->sp_comm);
#endif
#ifdef LLMC_DIST_NCCL
    // Before MPI_Finalize: NCCL's teardown may still talk to the other ranks.
    if (d->has_sp_nccl) { NCCL_CHECK(ncclCommDestroy(d->sp_nccl)); d->has_sp_nccl = 0; }
    if (d->has_nccl) { NCCL_CHECK(ncclCommDestroy(d->nccl)); d->has_nccl = 0; }
#endif
#ifdef LLMC_HAVE_MPI
    if (d->mpi) { g_fail_hook = NULL; MPI_Finalize(); }
#endif
    d->mpi = 0;
}

// The GPU communicator. The CUDA trainers call this right after cudaSetDevice(local_rank), since
// the communicator binds to the current device. Defined in every build, as a no-op without NCCL,
// so that callers need no #ifdef. LLMC_NCCL=0 keeps NCCL out (the device sums then go through the
// host and MPI), to rule NCCL out when a multi-GPU job hangs or fails. One rank makes a (1-rank)
// communicator only when LLMC_NCCL_SELFTEST=1: the gradients then take the multi-rank path
// through NCCL (the sum over one rank changes nothing; --full is ZeRO-1 with one piece), which
// proves an NCCL build on a single GPU, while ordinary single-GPU runs spend neither NCCL's
// start-up nor its buffers.
static void dist_nccl_init(Dist* d) {
#ifdef LLMC_DIST_NCCL
    if (!setting_on(SETTING_NCCL)) return;
    if (d->has_nccl || (d->world == 1 && !setting_on(SETTING_NCCL_SELFTEST))) return;
    ncclUniqueId id;
    memset(&id, 0, sizeof(id));
    if (d->rank == 0) NCCL_CHECK(ncclGetUniqueId(&id));
#ifdef LLMC_HAVE_MPI
    if (d->world > 1) MPI_Bcast(&id, (int)sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
#endif
    NCCL_CHECK(ncclCommInitRank(&d->nccl, d->world, id, d->rank));
    d->has_nccl = 1;
    if (d->sp > 1 && d->world > 1) {  // the sequence-parallel group's exchanges (dist_sp_alltoall_device)
        NCCL_CHECK(ncclCommSplit(d->nccl, d->rank / d->sp, d->rank, &d->sp_nccl, NULL));
        d->has_sp_nccl = 1;
    }
#else
    (void)d;
#endif
}

// Whether device collectives go through NCCL (else through the host and MPI).
static int dist_has_nccl(const Dist* d) {
#ifdef LLMC_DIST_NCCL
    return d && d->has_nccl;
#else
    (void)d;
    return 0;
#endif
}

// What a plan for one of `world` ranks sees (--dry-run --ranks, the fit check's suggestions): this
// process's Dist with another world size (rank 0: every rank's plan is the same).
static Dist dist_for_plan(const Dist* d, int world) {
    Dist p;
    memset(&p, 0, sizeof(p));
    if (d) p = *d;
    p.world = world;
    p.rank = 0;
    return p;
}

// Whether gradients cross ranks: more than one rank, or the one-rank NCCL self-test.
static int dist_sums_grads(const Dist* d) { return d && (d->world > 1 || dist_has_nccl(d)); }

// What sums the device gradients, for the trainers' start-up line.
static const char* dist_gpu_collectives(const Dist* d) {
#ifdef LLMC_DIST_NCCL
    if (d->has_nccl) return "NCCL";
#endif
    return d->world > 1 ? "MPI via host" : "none";
}

// ZeRO-1 pieces: `full` holds world * shard floats. Sums every rank's `full`, in place: this
// rank's shard of the sum lands at rank * shard of `full` (MPI puts it at the start of the buffer;
// it moves to the rank's own piece, as NCCL's in-place form leaves it).
static void dist_reduce_scatter_sum_f32_inplace(const Dist* d, float* full, int64_t shard) {
#ifdef LLMC_HAVE_MPI
    if (shard > (1 << 30)) fail("ZeRO-1 shard of %lld floats is too large for one MPI call", (long long)shard);
    MPI_Reduce_scatter_block(MPI_IN_PLACE, full, (int)shard, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    if (d->rank > 0) memmove(full + (int64_t)d->rank * shard, full, sizeof(float) * shard);
#else
    (void)d; (void)full; (void)shard;
#endif
}

// Every rank's shard (in place at rank * shard of `full`) to every rank.
static void dist_allgather_f32(const Dist* d, float* full, int64_t shard) {
#ifdef LLMC_HAVE_MPI
    if (d->world > 1) MPI_Allgather(MPI_IN_PLACE, 0, MPI_FLOAT, full, (int)shard, MPI_FLOAT, MPI_COMM_WORLD);
#else
    (void)d; (void)full; (void)shard;
#endif
}

// Every rank's `shard_in` to rank 0's `full_out` (world * shard floats; ignored on other ranks).
static void dist_gather_f32(const Dist* d, const float* shard_in, float* full_out, int64_t shard) {
#ifdef LLMC_HAVE_MPI
    if (d->world > 1) {
        MPI_Gather(shard_in, (int)shard, MPI_FLOAT, full_out, (int)shard, MPI_FLOAT, 0, MPI_COMM_WORLD);
        return;
    }
#endif
    (void)d;
    memcpy(full_out, shard_in, sizeof(float) * shard);
}

#if defined(__CUDACC__) || defined(LLMC_CUDA_EMU)
#include "../cuda/common.cuh"
// Sums n floats of device memory across ranks, in place (the CUDA backend's gradient all-reduce).
// With a communicator (dist_nccl_init) NCCL sums on the GPU in stream order, with no host sync:
// the kernels queued after it on `stream` see the sum. Otherwise the sum goes through host memory
// and MPI: correct, but slower than NCCL.
static void dist_allreduce_sum_f32_device(const Dist* d, float* x, int64_t n, cudaStream_t stream) {
    if (!d || n == 0) return;
#ifdef LLMC_DIST_NCCL
    if (d->has_nccl) { NCCL_CHECK(ncclAllReduce(x, x, (size_t)n, ncclFloat, ncclSum, d->nccl, stream)); return; }
#endif
    if (d->world <= 1) return;
    float* h = (float*)xmalloc(sizeof(float) * n);
    CUDA_CHECK(cudaMemcpyAsync(h, x, sizeof(float) * n, cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    dist_allreduce_sum_f32(d, h, n);
    CUDA_CHECK(cudaMemcpyAsync(x, h, sizeof(float) * n, cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    free(h);
}

// ZeRO-1 on the device: every rank's `full` (world * shard floats) summed in place, this rank's
// shard of the sum at rank * shard of `full` (NCCL, or MPI through the host).
static void dist_reduce_scatter_sum_f32_device_inplace(const Dist* d, float* full, int64_t shard, cudaStream_t stream) {
    float* mine = full + (int64_t)d->rank * shard;
#ifdef LLMC_DIST_NCCL
    if (d->has_nccl) {
        NCCL_CHECK(ncclReduceScatter(full, mine, (size_t)shard, ncclFloat, ncclSum, d->nccl, stream));
        return;
    }
#endif
    int64_t n = shard * d->world;
    float* h = (float*)xmalloc(sizeof(float) * n);
    CUDA_CHECK(cudaMemcpyAsync(h, full, sizeof(float) * n, cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    dist_reduce_scatter_sum_f32_inplace(d, h, shard);
    CUDA_CHECK(
        cudaMemcpyAsync(mine, h + (int64_t)d->rank * shard, sizeof(float) * shard, cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    free(h);
}

// Every rank's shard of `elem`-byte values (in place at rank * shard of the device array `full`)
// to every rank: NCCL, or MPI through the host.
static void dist_allgather_device(const Dist* d, void* full, int64_t shard, int elem, cudaStream_t stream) {
#ifdef LLMC_DIST_NCCL
    if (d->has_nccl) {
        char* mine = (char*)full + (int64_t)d->rank * shard * elem;
        NCCL_CHECK(ncclAllGather(mine, full, (size_t)shard, elem == 2 ? ncclBfloat16 : ncclFloat, d->nccl, stream));
        return;
    }
#endif
    if (d->world <= 1) return;
#ifdef LLMC_HAVE_MPI
    int64_t bytes = shard * elem, n = bytes * d->world;
    if (bytes > INT32_MAX) fail("ZeRO-1 piece of %lld bytes is too large for one MPI call", (long long)bytes);
    char* h = (char*)xmalloc(n);
    CUDA_CHECK(cudaMemcpyAsync(h + (int64_t)d->rank * bytes, (char*)full + (int64_t)d->rank * bytes, bytes,
                               cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    MPI_Allgather(MPI_IN_PLACE, 0, MPI_BYTE, h, (int)bytes, MPI_BYTE, MPI_COMM_WORLD);
    CUDA_CHECK(cudaMemcpyAsync(full, h, n, cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    free(h);
#endif
}

// Whether the sequence-parallel group exchanges device memory through NCCL (else host copies and MPI).
static int dist_sp_has_nccl(const Dist* d) {
#ifdef LLMC_DIST_NCCL
    return d && d->has_sp_nccl;
#else
    (void)d;
    return 0;
#endif
}

// dist_sp_alltoall on device memory, through NCCL in stream order (dist_sp_has_nccl): grouped sends
// and receives, block j of `bytes` to and from group rank j. All sends are posted before the receives.
static void dist_sp_alltoall_device(const Dist* d, const void* send, void* recv, int64_t bytes, cudaStream_t stream) {
#ifdef LLMC_DIST_NCCL
    if (bytes % 2) fail("internal: sequence-parallel exchange of %lld bytes (bf16 values expected)", (long long)bytes);
    size_t count = (size_t)bytes / 2;  // as bf16 values: the bytes move unchanged
    NCCL_CHECK(ncclGroupStart());
    for (int j = 0; j < d->sp; j++)
        NCCL_CHECK(ncclSend((const char*)send + j * bytes, count, ncclBfloat16, j, d->sp_nccl, stream));
    for (int j = 0; j < d->sp; j++)
        NCCL_CHECK(ncclRecv((char*)recv + j * bytes, count, ncclBfloat16, j, d->sp_nccl, stream));
    NCCL_CHECK(ncclGroupEnd());
#else
    (void)d; (void)send; (void)recv; (void)bytes; (void)stream;
    fail("internal: a device all-to-all without NCCL");
#endif
}

static void dist_allgather_f32_device(const Dist* d, float* full, int64_t shard, cudaStream_t stream) {
    dist_allgather_device(d, full, shard, 4, stream);
}

// The bf16 shadow's pieces (a sharded fp32 master: each rank casts its own piece, the ranks
// exchange half the bytes of fp32).
static void dist_allgather_bf16_device(const Dist* d, uint16_t* full, int64_t shard, cudaStream_t stream) {
    dist_allgather_device(d, full, shard, 2, stream);
}
#endif
