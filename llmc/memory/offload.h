// offload.h: --offload host. Under --recompute block each block keeps only its input (the block's
// checkpoint, [N, d] in the activation type); offloaded, the checkpoints live in host memory
// (pinned on CUDA: the plan's MEM_HOST arena) and the device holds two staging buffers of one
// block input each, or one where the memory holds only one (offload_staging_count): S staging
// buffers below.
//
//   forward, block l:  input -> staging[l % S] (compute stream), then staging -> host[l] on the
//                      copy stream once the compute stream has written it (event `written`);
//                      the compute stream waits for the copy out of a staging buffer (`saved`)
//                      before it writes the next block input there.
//   backward:          host[l] -> staging[l % S] on the copy stream, issued once the compute
//                      stream is done with that buffer (`released`, after block l + S's backward),
//                      so with S = 2 block l - 1's input is on its way while block l's backward
//                      runs (with S = 1 it comes after); the compute stream waits for it
//                      (`filled`) before it reads it.
//
// On the CPU backend the same calls copy with memcpy and wait for nothing, so the order of the
// copies, the plan and the numbers are tested there; on the CUDA emulator (test/emu/emu.h) an
// async copy on the copy stream runs only when a wait forces it, so a missing wait reads a
// poisoned (NaN) buffer or a stale checkpoint, and a copy issued before waiting for the compute
// stream aborts.
#pragma once
#include "../common.h"
#include "../backend.h"

enum { OFFLOAD_STAGING = 2 };  // device buffers at most: double buffered

// How many staging buffers: two (double buffered: one block input travels to or from the host while
// the other is in use) unless the run's memory holds only one; then the copies wait for the compute
// and the compute for the copies. The trainer fits it to the memory as --mlp-tile auto's tile
// (llmc/models/llama_plan.h, llama_fit_to_memory): two where the plan with two fits, else one. At a million
// positions one buffer costs little: a block input's copy moves N d activations while the block's
// attention does ~2 T N heads hd multiply-adds per pass (T the whole sequence, N this rank's
// tokens), so the copy's share of the block's time falls as 1 / T (a few percent at 2^20 positions
// for ~800 bf16 TFLOP/s behind a link of tens of GB/s; unmeasured on a GPU), while the second
// buffer is 8 KB per token at Llama-3.1-8B.
// The staging buffers to plan for `requested` (1, 2, or 0: not fitted, so 2), unless
// LLMC_OFFLOAD_STAGING=1|2 names them (to compare the two on a GPU; the numbers are the same, only
// the overlap differs).
static int offload_staging_count(int requested) {
    int named = setting_word(SETTING_OFFLOAD_STAGING);  // "1|2": index 0 or 1; -1: unset
    if (named >= 0) return named + 1;
    return requested > 0 ? requested : OFFLOAD_STAGING;
}

typedef struct {
    const Backend* be;
    void** host;                     // [blocks] the checkpoints, each [N, d] (MEM_HOST)
    void* staging[OFFLOAD_STAGING];  // [N, d] each of the first `slots`, on the device (MEM_SCRATCH)
    int slots;                       // staging buffers in use (offload_staging_count), set before the plan
    size_t bytes;                    // one block input
    int blocks;
#ifdef LLMC_HAVE_CUDA
    cudaStream_t copy;
    cudaEvent_t written[OFFLOAD_STAGING], saved[OFFLOAD_STAGING], released[OFFLOAD_STAGING], filled[OFFLOAD_STAGING];
#endif
} Offload;

static int offload_slot(const Offload* o, int block) { return block % o->slots; }

// After the plan's allocation bound host[] and staging[] (o->slots of them): the copy stream and its events.
static void offload_init(Offload* o, const Backend* be, int blocks, size_t bytes) {
    if (o->slots < 1 || o->slots > OFFLOAD_STAGING) fail("internal: %d offload staging buffers", o->slots);
    o->be = be;
    o->blocks = blocks;
    o->bytes = bytes;
#ifdef LLMC_HAVE_CUDA
    if (!be->cuda) return;
    // non-blocking: the legacy default stream, where the compute runs, must not serialise with it
    CUDA_CHECK(cudaStreamCreateWithFlags(&o->copy, cudaStreamNonBlocking));
    for (int i = 0; i < o->slots; i++) {
        CUDA_CHECK(cudaEventCreateWithFlags(&o->written[i], cudaEventDisableTiming));
        CUDA_CHECK(cudaEventCreateWithFlags(&o->saved[i], cudaEventDisableTiming));
        CUDA_CHECK(cudaEventCreateWithFlags(&o->released[i], cudaEventDisableTiming));
        CUDA_CHECK(cudaEventCreateWithFlags(&o->filled[i], cudaEventDisableTiming));
    }
#endif
}

static void offload_free(Offload* o) {
#ifdef LLMC_HAVE_CUDA
    if (!o->be || !o->be->cuda) return;
    CUDA_CHECK(cudaStreamSynchronize(o->copy));
    for (int i = 0; i < o->slots; i++) {
        CUDA_CHECK(cudaEventDestroy(o->written[i]));
        CUDA_CHECK(cudaEventDestroy(o->saved[i]));
        CUDA_CHECK(cudaEventDestroy(o->released[i]));
        CUDA_CHECK(cudaEventDestroy(o->filled[i]));
    }
    CUDA_CHECK(cudaStreamDestroy(o->copy));
#endif
}

// Forward: the staging buffer block l's input goes to, once its previous copy to the host is done.
static void* offload_staging_for_save(Offload* o, int block) {
    int i = offload_slot(o, block);
#ifdef LLMC_HAVE_CUDA
    if (o->be->cuda) CUDA_CHECK(cudaStreamWaitEvent(o->be->stream, o->saved[i], 0));
#endif
    return o->staging[i];
}

// Forward: block l's input (its first `bytes`: a generation step's rows), just written to its
// staging buffer by the compute stream, to the host.
static void offload_save(Offload* o, int block, size_t bytes) {
    int i = offload_slot(o, block);
#ifdef LLMC_HAVE_CUDA
    if (o->be->cuda) {
        CUDA_CHECK(cudaEventRecord(o->written[i], o->be->stream));
        CUDA_CHECK(cudaStreamWaitEvent(o->copy, o->written[i], 0));
        CUDA_CHECK(cudaMemcpyAsync(o->host[block], o->staging[i], bytes, cudaMemcpyDeviceToHost, o->copy));
        CUDA_CHECK(cudaEventRecord(o->saved[i], o->copy));
        return;
    }
#endif
    memcpy(o->host[block], o->staging[i], bytes);
}

// Backward: block l's input from the host into its staging buffer, once the compute stream is
// done with what that buffer held (the forward's last block inputs, or block l + slots' backward).
static void offload_fetch(Offload* o, int block) {
    if (block < 0) return;
    int i = offload_slot(o, block);
#ifdef LLMC_HAVE_CUDA
    if (o->be->cuda) {
        CUDA_CHECK(cudaEventRecord(o->released[i], o->be->stream));
        CUDA_CHECK(cudaStreamWaitEvent(o->copy, o->released[i], 0));
        CUDA_CHECK(cudaMemcpyAsync(o->staging[i], o->host[block], o->bytes, cudaMemcpyHostToDevice, o->copy));
        CUDA_CHECK(cudaEventRecord(o->filled[i], o->copy));
        return;
    }
#endif
    memcpy(o->staging[i], o->host[block], o->bytes);
}

// Backward: block l's input on the device, once its fetch has landed (the compute stream waits).
static void* offload_staging_fetched(Offload* o, int block) {
    int i = offload_slot(o, block);
#ifdef LLMC_HAVE_CUDA
    if (o->be->cuda) CUDA_CHECK(cudaStreamWaitEvent(o->be->stream, o->filled[i], 0));
#endif
    return o->staging[i];
}
