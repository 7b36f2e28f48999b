// emu_nccl_probe: checks the NCCL emulation of test/emu/emu_nccl.h under mpirun (CPU emulator
// build only), so that "the NCCL path passes on the emulator" means something: the collectives
// compute what NCCL's documentation says, and misuse that a GPU would show as a hang or garbage
// is reported. test/cuda/test_emu_nccl.py runs it:
//   emu_nccl_probe ok              every collective the trainers use, checked value by value
//   emu_nccl_probe host-pointer    a host buffer passed to ncclAllReduce
//   emu_nccl_probe bad-in-place    an all-gather whose send buffer is inside recv at the wrong rank
//   emu_nccl_probe count-mismatch  the ranks disagree on a collective's count
//   emu_nccl_probe no-broadcast    every rank makes its own unique id
//   emu_nccl_probe missing-wait    a collective on a second stream that did not wait for the default
//                                  stream's earlier work
//   emu_nccl_probe write-in-flight a collective's input overwritten before the collective ran
// Each misuse must end the job with an error naming it (non-zero exit); "ok" prints one line.
#include "../../llmc/train/dist.h"

static void check(int ok, const char* what, int rank) {
    if (!ok) fail("emu_nccl_probe rank %d: %s", rank, what);
}

static float* device_floats(int64_t n) {
    float* p;
    CUDA_CHECK(cudaMalloc((void**)&p, sizeof(float) * n));
    return p;
}

static void run_ok(Dist* d) {
    int r = d->rank, w = d->world;
    const int64_t n = 10;
    float* x = device_floats(n * w);
    // all-reduce in place: sum over ranks of (rank + 1) * (i + 1)
    for (int64_t i = 0; i < n; i++) x[i] = (float)((r + 1) * (i + 1));
    dist_allreduce_sum_f32_device(d, x, n, 0);
    float ranks = (float)(w * (w + 1) / 2);
    for (int64_t i = 0; i < n; i++) check(x[i] == ranks * (float)(i + 1), "ncclAllReduce sum", r);
    // reduce-scatter, out of place and in place (recv = send + rank * n)
    float* full = device_floats(n * w);
    float* piece = device_floats(n);
    for (int64_t i = 0; i < n * w; i++) full[i] = (float)(i + r);
    NCCL_CHECK(ncclReduceScatter(full, piece, (size_t)n, ncclFloat, ncclSum, d->nccl, 0));
    for (int64_t i = 0; i < n; i++)
        check(piece[i] == (float)(w * (r * n + i) + w * (w - 1) / 2), "ncclReduceScatter", r);
    for (int64_t i = 0; i < n * w; i++) full[i] = (float)(i + r);
    dist_reduce_scatter_sum_f32_device_inplace(d, full, n, 0);
    for (int64_t i = 0; i < n; i++)
        check(full[r * n + i] == (float)(w * (r * n + i) + w * (w - 1) / 2), "in-place ncclReduceScatter", r);
    // all-gather in place, fp32 and bf16: rank q's piece holds q * 100 + i
    for (int64_t i = 0; i < n; i++) x[r * n + i] = (float)(r * 100 + i);
    dist_allgather_f32_device(d, x, n, 0);
    for (int q = 0; q < w; q++)
        for (int64_t i = 0; i < n; i++) check(x[q * n + i] == (float)(q * 100 + i), "in-place ncclAllGather (fp32)", r);
    uint16_t* h;
    CUDA_CHECK(cudaMalloc((void**)&h, 2 * n * w));
    for (int64_t i = 0; i < n; i++) h[r * n + i] = (uint16_t)(r * 1000 + i);
    dist_allgather_bf16_device(d, h, n, 0);
    for (int q = 0; q < w; q++)
        for (int64_t i = 0; i < n; i++)
            check(h[q * n + i] == (uint16_t)(q * 1000 + i), "in-place ncclAllGather (bf16)", r);
    // on a second stream the sum runs as late as stream order allows: not before the default
    // stream waits for it (a consumer that forgot to wait reads the old values, and tests fail)
    cudaStream_t comm;
    cudaEvent_t ready, done;
    CUDA_CHECK(cudaStreamCreateWithFlags(&comm, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    CUDA_CHECK(cudaMemset(x, 0, sizeof(float) * n));
    for (int64_t i = 0; i < n; i++) x[i] = (float)(r + 1);
    CUDA_CHECK(cudaEventRecord(ready, 0));
    CUDA_CHECK(cudaStreamWaitEvent(comm, ready, 0));
    dist_allreduce_sum_f32_device(d, x, n, comm);
    CUDA_CHECK(cudaEventRecord(done, comm));
    check(x[0] == (float)(r + 1), "the second stream's sum ran before anything waited for it", r);
    CUDA_CHECK(cudaStreamWaitEvent(0, done, 0));
    check(x[0] == ranks, "cudaStreamWaitEvent did not run the second stream's sum", r);
    CUDA_CHECK(cudaEventDestroy(ready)); CUDA_CHECK(cudaEventDestroy(done)); CUDA_CHECK(cudaStreamDestroy(comm));
    if (r == 0)
        printf(
            "emu_nccl_probe: %d ranks: all-reduce, reduce-scatter (out of place, in place), all-gather (fp32, bf16), "
            "stream order ok\n",
            w);
    CUDA_CHECK(cudaFree(x)); CUDA_CHECK(cudaFree(full)); CUDA_CHECK(cudaFree(piece)); CUDA_CHECK(cudaFree(h));
}

int main(int argc, char** argv) {
    Dist d;
    dist_init(&d, &argc, &argv);
    const char* mode = argc > 1 ? argv[1] : "ok";
    if (!strcmp(mode, "no-broadcast")) {  // what dist_nccl_init would do without its MPI_Bcast
        ncclUniqueId id;
        NCCL_CHECK(ncclGetUniqueId(&id));
        NCCL_CHECK(ncclCommInitRank(&d.nccl, d.world, id, d.rank));
        fail("emu_nccl_probe: ncclCommInitRank accepted ids that were never broadcast");
    }
    setenv("LLMC_NCCL_SELFTEST", "1", 1);
    settings_read(SETTINGS_AGAIN);
    dist_nccl_init(&d);
    check(dist_has_nccl(&d), "no communicator", d.rank);
    float* x = device_floats(8 * d.world);
    if (!strcmp(mode, "ok")) run_ok(&d);
    else if (!strcmp(mode, "host-pointer")) {
        float host[8] = {0};
        NCCL_CHECK(ncclAllReduce(host, host, 8, ncclFloat, ncclSum, d.nccl, 0));
    } else if (!strcmp(mode, "bad-in-place")) {
        int wrong = (d.rank + 1) % d.world;
        NCCL_CHECK(ncclAllGather(x + wrong * 8, x, 8, ncclFloat, d.nccl, 0));
        if (d.world == 1) fail("emu_nccl_probe: bad-in-place needs two ranks");
    } else if (!strcmp(mode, "count-mismatch")) {
        NCCL_CHECK(ncclAllReduce(x, x, d.rank == 0 ? 4 : 5, ncclFloat, ncclSum, d.nccl, 0));
    } else if (!strcmp(mode, "missing-wait") || !strcmp(mode, "write-in-flight")) {
        cudaStream_t comm;
        cudaEvent_t ready;
        CUDA_CHECK(cudaStreamCreateWithFlags(&comm, cudaStreamNonBlocking));
        CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
        CUDA_CHECK(cudaMemset(x, 0, sizeof(float) * 8));  // default-stream work the sum depends on
        if (!strcmp(mode, "write-in-flight")) {           // waits for it, but its input is then overwritten
            CUDA_CHECK(cudaEventRecord(ready, 0));
            CUDA_CHECK(cudaStreamWaitEvent(comm, ready, 0));
        }
        NCCL_CHECK(ncclAllReduce(x, x, 8, ncclFloat, ncclSum, d.nccl, comm));
        CUDA_CHECK(cudaMemset(x, 1, sizeof(float) * 8));
        CUDA_CHECK(cudaStreamSynchronize(comm));
    } else fail("emu_nccl_probe: unknown mode %s", mode);
    if (strcmp(mode, "ok")) fail("emu_nccl_probe: %s was not reported", mode);
    CUDA_CHECK(cudaFree(x));
    dist_finalize(&d);
    return 0;
}
