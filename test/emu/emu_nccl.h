// test/emu/emu_nccl.h: the part of NCCL's API that llmc/train/dist.h calls, emulated over MPI for the CPU
// emulator (-DLLMC_CUDA_EMU), so that CI runs the trainers' NCCL code path (communicator set-up,
// the bucketed all-reduce and reduce-scatter, the in-place all-gather) and not only its
// host-and-MPI fallback. Each MPI rank emulates one GPU; "device" buffers are the emulator's
// registered host allocations.
//
// It checks what a GPU would only show as a hang, a crash or wrong numbers:
//   - every buffer lies inside one device allocation (host pointers are a bug with NCCL);
//   - the unique id reached every rank from rank 0 (the broadcast before ncclCommInitRank);
//   - nranks and rank agree with MPI;
//   - in-place calls use NCCL's definition of in place (all-gather: sendbuff = recvbuff +
//     rank * sendcount; reduce-scatter: recvbuff = sendbuff + rank * recvcount), and other calls
//     do not overlap their buffers;
//   - every rank makes the same sequence of collectives with the same counts and types;
//   - stream order (through emu.h's streams): a collective starts when issued (non-blocking MPI,
//     so ranks progress independently, as NCCL's kernels do) but its result lands only when its
//     stream runs it, as late as CUDA allows, so a consumer that does not wait for it reads stale
//     data; it must have waited for the default stream's earlier kernels; and its input must not
//     change before it runs.
// What it cannot check is NCCL's performance or its behaviour on real interconnects: only GPUs can.
// Without MPI (a single-process build) a communicator can only have one rank.
#pragma once
#ifndef LLMC_CUDA_EMU
#error "test/emu/emu_nccl.h is only for -DLLMC_CUDA_EMU builds"
#endif
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <memory>
#include <string>
#include <vector>
#include "../../llmc/cuda/common.cuh"
#ifdef LLMC_HAVE_MPI
#include <mpi.h>
#endif

#define NCCL_UNIQUE_ID_BYTES 128
typedef struct { char internal[NCCL_UNIQUE_ID_BYTES]; } ncclUniqueId;
typedef enum { ncclSuccess = 0, ncclInvalidArgument = 4, ncclInvalidUsage = 5 } ncclResult_t;
typedef enum { ncclFloat32 = 7, ncclFloat = 7, ncclBfloat16 = 9 } ncclDataType_t;
typedef enum { ncclSum = 0 } ncclRedOp_t;

typedef struct EmuNcclComm {
    int rank, nranks;
    long long calls;       // collectives so far: the sequence every rank must agree on
#ifdef LLMC_HAVE_MPI
    MPI_Comm mpi;          // a duplicate of MPI_COMM_WORLD: NCCL's traffic never meets the host's
    MPI_Comm check;        // another: the agreement checks made at issue, while data moves at run
#endif
} EmuNcclComm;
typedef EmuNcclComm* ncclComm_t;

static char emu_nccl_error[512];

static ncclResult_t emu_nccl_fail(ncclResult_t r, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
static ncclResult_t emu_nccl_fail(ncclResult_t r, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(emu_nccl_error, sizeof(emu_nccl_error), fmt, ap);
    va_end(ap);
    return r;
}

static const char* ncclGetErrorString(ncclResult_t r) {
    return r == ncclSuccess ? "no error" : r == ncclInvalidArgument ? "invalid argument" : "invalid usage";
}
static const char* ncclGetLastError(ncclComm_t comm) { (void)comm; return emu_nccl_error; }

static int emu_nccl_world(void) {
    int world = 1;
#ifdef LLMC_HAVE_MPI
    int up = 0;
    MPI_Initialized(&up);
    if (up) MPI_Comm_size(MPI_COMM_WORLD, &world);
#endif
    return world;
}

// The id names the job: its bytes are a tag and rank 0's process id, so a rank that did not get
// rank 0's id (a missing broadcast) is caught in ncclCommInitRank.
static ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
    memset(id, 0, sizeof(*id));
    snprintf(id->internal, sizeof(id->internal), "emu-nccl %ld", (long)getpid());
    return ncclSuccess;
}

static ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
    int world = emu_nccl_world();
    if (nranks != world)
        return emu_nccl_fail(ncclInvalidArgument, "ncclCommInitRank: nranks %d, but the job has %d processes", nranks,
                             world);
    if (rank < 0 || rank >= nranks)
        return emu_nccl_fail(ncclInvalidArgument, "ncclCommInitRank: rank %d outside [0, %d)", rank, nranks);
    if (strncmp(id.internal, "emu-nccl ", 9) != 0)
        return emu_nccl_fail(ncclInvalidArgument, "ncclCommInitRank: rank %d has no unique id from ncclGetUniqueId",
                             rank);
    EmuNcclComm* c = (EmuNcclComm*)calloc(1, sizeof(EmuNcclComm));
    c->rank = rank;
    c->nranks = nranks;
#ifdef LLMC_HAVE_MPI
    if (world > 1) {
        int mpi_rank;
        MPI_Comm_rank(MPI_COMM_WORLD, &mpi_rank);
        ncclUniqueId root = id;
        MPI_Bcast(&root, (int)sizeof(root), MPI_BYTE, 0, MPI_COMM_WORLD);
        if (memcmp(&root, &id, sizeof(id)) != 0) {
            free(c);
            return emu_nccl_fail(ncclInvalidArgument,
                                 "ncclCommInitRank: rank %d's unique id differs from rank 0's (was it broadcast?)",
                                 rank);
        }
        if (mpi_rank != rank) {
            free(c);
            return emu_nccl_fail(ncclInvalidArgument, "ncclCommInitRank: rank %d is MPI rank %d", rank, mpi_rank);
        }
        MPI_Comm_dup(MPI_COMM_WORLD, &c->mpi);
        MPI_Comm_dup(MPI_COMM_WORLD, &c->check);
    }
#endif
    *comm = c;
    return ncclSuccess;
}

// A communicator of the ranks of `comm` that pass the same color, ordered by key (NCCL 2.18's
// ncclCommSplit; config is not emulated and must be NULL).
typedef struct ncclConfig_v21700 ncclConfig_t;
static ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config) {
    if (config) return emu_nccl_fail(ncclInvalidArgument, "ncclCommSplit: a config is not emulated");
    EmuNcclComm* c = (EmuNcclComm*)calloc(1, sizeof(EmuNcclComm));
    c->rank = 0;
    c->nranks = 1;
#ifdef LLMC_HAVE_MPI
    if (comm->nranks > 1) {
        MPI_Comm_split(comm->mpi, color, key, &c->mpi);
        MPI_Comm_split(comm->check, color, key, &c->check);
        MPI_Comm_rank(c->mpi, &c->rank);
        MPI_Comm_size(c->mpi, &c->nranks);
        if (c->nranks == 1) { MPI_Comm_free(&c->mpi); MPI_Comm_free(&c->check); }
    }
#else
    (void)comm; (void)color; (void)key;
#endif
    *newcomm = c;
    return ncclSuccess;
}

static ncclResult_t ncclCommDestroy(ncclComm_t comm) {
#ifdef LLMC_HAVE_MPI
    cudaDeviceSynchronize();  // what it still holds runs first
    if (comm->nranks > 1) { MPI_Comm_free(&comm->mpi); MPI_Comm_free(&comm->check); }
#endif
    free(comm);
    return ncclSuccess;
}

static size_t emu_nccl_elem_bytes(ncclDataType_t t) { return t == ncclBfloat16 ? 2 : 4; }

// What every collective checks first: known type and op, device buffers, and (several ranks)
// that every rank is making the same call: kind, count and type.
static ncclResult_t emu_nccl_enter(ncclComm_t comm, const char* call, int kind, const void* send, size_t send_n,
                                   const void* recv, size_t recv_n, size_t count, ncclDataType_t type) {
    if (type != ncclFloat && type != ncclBfloat16)
        return emu_nccl_fail(ncclInvalidArgument, "%s: data type %d is not emulated", call, (int)type);
    size_t e = emu_nccl_elem_bytes(type);
    if (!emu_on_device((uintptr_t)send, send_n * e) || !emu_on_device((uintptr_t)recv, recv_n * e))
        return emu_nccl_fail(ncclInvalidArgument,
                             "%s: a buffer (send %p, %zu values; recv %p, %zu values) is not device memory", call, send,
                             send_n, recv, recv_n);
    if (emu_guard_overlap((uintptr_t)send, send_n * e) ||
        emu_guard_overlap((uintptr_t)recv, recv_n * e))  // emu.h's guard zones
        return emu_nccl_fail(
            ncclInvalidArgument,
            "%s: a buffer (send %p, %zu values; recv %p, %zu values) runs out of bounds into a guard zone", call, send,
            send_n, recv, recv_n);
    comm->calls++;
#ifdef LLMC_HAVE_MPI
    if (comm->nranks > 1) {
        long long mine[3] = {kind, (long long)count, (long long)type}, lo[3], hi[3];
        MPI_Allreduce(mine, lo, 3, MPI_LONG_LONG, MPI_MIN, comm->check);
        MPI_Allreduce(mine, hi, 3, MPI_LONG_LONG, MPI_MAX, comm->check);
        if (memcmp(lo, hi, sizeof(lo)) != 0)
            return emu_nccl_fail(ncclInvalidUsage,
                                 "%s: collective #%lld differs across ranks (rank %d: kind %d, %zu values, type %d)",
                                 call, comm->calls, comm->rank, kind, count, (int)type);
    }
#else
    (void)kind; (void)count;
#endif
    return ncclSuccess;
}

static int emu_nccl_overlap(const void* a, size_t an, const void* b, size_t bn) {
    const char *x = (const char*)a, *y = (const char*)b;
    return x < y + bn && y < x + an;
}

#ifdef LLMC_HAVE_MPI
static MPI_Datatype emu_nccl_mpi_type(ncclDataType_t t) { return t == ncclBfloat16 ? MPI_UINT16_T : MPI_FLOAT; }
#endif

// A collective in flight. It starts when issued, as NCCL's does (a non-blocking MPI call from a
// snapshot of the input into `out`, so every rank's progress is independent of when its host
// code waits, as on GPUs), and lands in the receive buffer only when stream order runs it: the
// snapshot is then compared with the input, whose change in between means the buffer was written
// while NCCL would be reading it (a race on a GPU).
typedef struct {
    std::vector<char> snap, out;
#ifdef LLMC_HAVE_MPI
    MPI_Request req;
#endif
} EmuNcclFlight;

// Issues a collective on `st` (emu.h's streams): start(f) begins it from f->snap into f->out;
// when it runs, `land` (bytes of f->out) is copied to `recv`.
static void emu_nccl_issue(cudaStream_t st, const char* call, const void* in, size_t in_bytes, void* recv, size_t land,
                           const std::function<void(EmuNcclFlight*)>& start) {
    if (st && in_bytes) {  // stream order: held-back work of `st` that touches the input runs first, since
        // NCCL reads the input only after the stream's earlier work (e.g. --seq-parallel's packing copies)
        EmuSpan span = {(uintptr_t)in, (uintptr_t)in, in_bytes};
        long long last = 0;
        long long first = st->issued - (long long)st->spans.size();  // the position of spans[0]
        for (size_t i = 0; i < st->spans.size(); i++)
            if (emu_spans_conflict(st->spans[i], span)) last = first + (long long)i + 1;
        emu_stream_run_until(st, last);
    }
    std::shared_ptr<EmuNcclFlight> f(new EmuNcclFlight());
    f->snap.assign((const char*)in, (const char*)in + in_bytes);
    f->out.resize(land + 1);
#ifdef LLMC_HAVE_MPI
    f->req = MPI_REQUEST_NULL;
#endif
    start(f.get());
    std::string name(call);
    emu_stream_submit(st, call, [=]() {
#ifdef LLMC_HAVE_MPI
        if (f->req != MPI_REQUEST_NULL) MPI_Wait(&f->req, MPI_STATUS_IGNORE);  // (one rank: no MPI at all)
#endif
        if (memcmp(f->snap.data(), in, in_bytes) != 0) {
            fprintf(stderr, "emu: race: the input of %s changed between its issue and its run on the stream "
                            "(written while NCCL reads it)\n", name.c_str());
            abort();
        }
        memcpy(recv, f->out.data(), land);
    });
}

static ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t op,
                                  ncclComm_t comm, cudaStream_t st) {
    ncclResult_t r = emu_nccl_enter(comm, "ncclAllReduce", 1, send, count, recv, count, count, type);
    if (r != ncclSuccess) return r;
    if (op != ncclSum || type != ncclFloat)
        return emu_nccl_fail(ncclInvalidArgument, "ncclAllReduce: only fp32 sums are emulated");
    if (send != recv && emu_nccl_overlap(send, count * 4, recv, count * 4))
        return emu_nccl_fail(ncclInvalidArgument, "ncclAllReduce: buffers overlap but are not the same");
    if (count > (1u << 30))
        return emu_nccl_fail(ncclInvalidArgument, "ncclAllReduce: %zu values is beyond the emulation", count);
    emu_nccl_issue(st, "ncclAllReduce", send, count * 4, recv, count * 4, [=](EmuNcclFlight* f) {
        memcpy(f->out.data(), f->snap.data(), count * 4);
#ifdef LLMC_HAVE_MPI
        if (comm->nranks > 1)
            MPI_Iallreduce(f->snap.data(), f->out.data(), (int)count, MPI_FLOAT, MPI_SUM, comm->mpi, &f->req);
#endif
    });
    return ncclSuccess;
}

// send: nranks * recvcount values; this rank's block of the sum lands in recv.
static ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t recvcount, ncclDataType_t type,
                                      ncclRedOp_t op, ncclComm_t comm, cudaStream_t st) {
    size_t total = recvcount * comm->nranks;
    ncclResult_t r = emu_nccl_enter(comm, "ncclReduceScatter", 2, send, total, recv, recvcount, recvcount, type);
    if (r != ncclSuccess) return r;
    if (op != ncclSum || type != ncclFloat)
        return emu_nccl_fail(ncclInvalidArgument, "ncclReduceScatter: only fp32 sums are emulated");
    int in_place = (const float*)recv == (const float*)send + (size_t)comm->rank * recvcount;
    if (!in_place && emu_nccl_overlap(send, total * 4, recv, recvcount * 4))
        return emu_nccl_fail(ncclInvalidArgument,
                             "ncclReduceScatter: recvbuff overlaps sendbuff but is not sendbuff + rank * recvcount");
    if (recvcount > (1u << 30))
        return emu_nccl_fail(ncclInvalidArgument, "ncclReduceScatter: %zu values per rank is beyond the emulation",
                             recvcount);
    emu_nccl_issue(st, "ncclReduceScatter", send, total * 4, recv, recvcount * 4, [=](EmuNcclFlight* f) {
        if (comm->nranks == 1) { memcpy(f->out.data(), f->snap.data(), recvcount * 4); return; }
#ifdef LLMC_HAVE_MPI
        MPI_Ireduce_scatter_block(f->snap.data(), f->out.data(), (int)recvcount, MPI_FLOAT, MPI_SUM, comm->mpi,
                                  &f->req);
#endif
    });
    return ncclSuccess;
}

// Every rank's sendcount values to recv (nranks * sendcount), rank r's at r * sendcount.
static ncclResult_t ncclAllGather(const void* send, void* recv, size_t sendcount, ncclDataType_t type, ncclComm_t comm,
                                  cudaStream_t st) {
    size_t e = emu_nccl_elem_bytes(type), total = sendcount * comm->nranks;
    ncclResult_t r = emu_nccl_enter(comm, "ncclAllGather", 3, send, sendcount, recv, total, sendcount, type);
    if (r != ncclSuccess) return r;
    const char* mine = (const char*)recv + (size_t)comm->rank * sendcount * e;
    int in_place = (const char*)send == mine;
    if (!in_place && emu_nccl_overlap(send, sendcount * e, recv, total * e))
        return emu_nccl_fail(ncclInvalidArgument,
                             "ncclAllGather: sendbuff overlaps recvbuff but is not recvbuff + rank * sendcount");
    if (sendcount > (1u << 30))
        return emu_nccl_fail(ncclInvalidArgument, "ncclAllGather: %zu values per rank is beyond the emulation",
                             sendcount);
    emu_nccl_issue(st, "ncclAllGather", send, sendcount * e, recv, total * e, [=](EmuNcclFlight* f) {
        memcpy(f->out.data() + (size_t)comm->rank * sendcount * e, f->snap.data(), sendcount * e);
#ifdef LLMC_HAVE_MPI
        if (comm->nranks > 1)
            MPI_Iallgather(f->snap.data(), (int)sendcount, emu_nccl_mpi_type(type), f->out.data(), (int)sendcount,
                           emu_nccl_mpi_type(type), comm->mpi, &f->req);
#endif
    });
    return ncclSuccess;
}

// Point-to-point (ncclSend, ncclRecv) inside ncclGroupStart / ncclGroupEnd, as --seq-parallel's
// all-to-all uses them (its sends first). Each starts when issued: a send is a non-blocking MPI
// send from its own copy of the data, completed at ncclGroupEnd (so a send to a rank, or to this
// one, whose receive comes later in the group cannot block it), a receive lands in its buffer
// when its stream runs it. Every rank must make the same sequence of calls with the same counts
// (the all-to-all's pattern); a send and the receive it meets must have the same count (MPI checks).
#ifdef LLMC_HAVE_MPI
typedef struct {
    MPI_Request req;
    std::vector<char> data;
} EmuNcclSend;
static std::vector<std::shared_ptr<EmuNcclSend>> emu_nccl_sends;  // the group's sends in flight
#endif
static int emu_nccl_group_depth;
static ncclResult_t ncclGroupStart(void) { emu_nccl_group_depth++; return ncclSuccess; }
static ncclResult_t ncclGroupEnd(void) {
    if (emu_nccl_group_depth <= 0) return emu_nccl_fail(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
    if (--emu_nccl_group_depth) return ncclSuccess;
#ifdef LLMC_HAVE_MPI
    for (size_t i = 0; i < emu_nccl_sends.size(); i++) MPI_Wait(&emu_nccl_sends[i]->req, MPI_STATUS_IGNORE);
    emu_nccl_sends.clear();
#endif
    return ncclSuccess;
}

static ncclResult_t emu_nccl_p2p(const char* call, int kind, const void* send, void* recv, size_t count,
                                 ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t st) {
    const void* buf = send ? send : recv;
    ncclResult_t r = emu_nccl_enter(comm, call, kind, buf, count, buf, count, count, type);
    if (r != ncclSuccess) return r;
    if (peer < 0 || peer >= comm->nranks)
        return emu_nccl_fail(ncclInvalidArgument, "%s: peer %d outside [0, %d)", call, peer, comm->nranks);
    if (comm->nranks == 1)
        return emu_nccl_fail(ncclInvalidArgument, "%s: not emulated on a one-rank communicator", call);
    if (!emu_nccl_group_depth)
        return emu_nccl_fail(ncclInvalidUsage, "%s: outside ncclGroupStart/ncclGroupEnd (the all-to-all needs a "
                             "group, or the ranks deadlock)", call);
    size_t bytes = count * emu_nccl_elem_bytes(type);
    if (bytes > (1u << 30))
        return emu_nccl_fail(ncclInvalidArgument, "%s: %zu bytes is beyond the emulation", call, bytes);
    static char nothing;
    emu_nccl_issue(st, call, send ? send : &nothing, send ? bytes : 0, send ? (void*)&nothing : recv, send ? 0 : bytes,
                   [=](EmuNcclFlight* f) {
#ifdef LLMC_HAVE_MPI
        if (send) {
            std::shared_ptr<EmuNcclSend> s(new EmuNcclSend());
            s->data = f->snap;
            MPI_Isend(s->data.data(), (int)bytes, MPI_BYTE, peer, 0, comm->mpi, &s->req);
            emu_nccl_sends.push_back(s);
        } else {
            MPI_Irecv(f->out.data(), (int)bytes, MPI_BYTE, peer, 0, comm->mpi, &f->req);
        }
#endif
    });
    return ncclSuccess;
}

static ncclResult_t ncclSend(const void* send, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                             cudaStream_t st) {
    return emu_nccl_p2p("ncclSend", 4, send, NULL, count, type, peer, comm, st);
}

static ncclResult_t ncclRecv(void* recv, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                             cudaStream_t st) {
    return emu_nccl_p2p("ncclRecv", 5, NULL, recv, count, type, peer, comm, st);
}
