// train/batch_values.h: the values of a training micro-batch that the CUDA kernels read from device
// memory instead of as arguments, so that one CUDA graph of the micro-batch serves every step
// (llmc/cuda/graph.cuh): the loss's gradient scale (1 / the step's targets, read by the
// cross-entropy kernels) and --lora-dropout's optimizer step and first row (read by the mask
// kernels, llmc/lora_dropout.h). Each goes up with the micro-batch's staged upload (llmc/backend.h), from a
// pinned host side the trainer sets before it. Both trainers hold one; on the CPU it stays empty.
#pragma once
#include "../backend.h"
#include "../lora_dropout.h"

typedef struct {
    float *grad_scale, *h_grad_scale;    // [1] device and pinned host; NULL on the CPU
    LoraDropoutAt *drop_at, *h_drop_at;  // device and pinned host; NULL on the CPU and without dropout
    int planted_stale_key;               // LLMC_FAULT_DROPOUT_KEY=1 (test builds; the graph tests): see
                                         // batch_values_stage
} BatchValues;

// Their device buffers in the plan's batch scratch (CUDA only); `dropout`: the run trains with
// --lora-dropout on some adapter.
static void batch_values_plan(BatchValues* v, const Backend* be, MemPlan* p, int dropout) {
    if (!be->cuda) return;
    plan_add(p, MEM_SCRATCH, "batch", -1, "grad_scale", sizeof(float), &v->grad_scale);
    if (dropout) plan_add(p, MEM_SCRATCH, "batch", -1, "dropout_key", sizeof(LoraDropoutAt), &v->drop_at);
}

// After the plan's memory is bound: the pinned host sides, and the dropout state pointed at the
// device copy its kernels read. Returns the staging bytes the values add to each upload.
static size_t batch_values_bind(BatchValues* v, const Backend* be, LoraDropout* drop) {
    size_t bytes = 0;
    drop->at = v->drop_at;
    if (v->grad_scale) {
        v->h_grad_scale = (float*)backend_host_side(be, v->grad_scale, sizeof(float));
        v->h_grad_scale[0] = 0.0f;
        bytes += staging_align(sizeof(float));
    }
    if (v->drop_at) {
        v->h_drop_at = (LoraDropoutAt*)backend_host_side(be, v->drop_at, sizeof(LoraDropoutAt));
        memset(v->h_drop_at, 0, sizeof(LoraDropoutAt));
        bytes += staging_align(sizeof(LoraDropoutAt));
#ifdef LLMC_FAULTS
        v->planted_stale_key = setting_on(SETTING_FAULT_DROPOUT_KEY);
#endif
    }
    return bytes;
}

// The step's loss scale, uploaded with the next micro-batch (a no-op on the CPU).
static void batch_values_set_loss_scale(BatchValues* v, float scale) {
    if (v->h_grad_scale) v->h_grad_scale[0] = scale;
}

// Into the micro-batch's upload (between staging_begin and staging_end): the loss scale, and the
// dropout masks' step and first row as `drop` holds them now (set them before the upload).
static void batch_values_stage(BatchValues* v, BatchStaging* s, const LoraDropout* drop) {
    if (v->grad_scale) staging_upload(s, v->grad_scale, v->h_grad_scale, sizeof(float));
    if (!v->drop_at) return;
    v->h_drop_at->step = drop->step;
    v->h_drop_at->row0 = drop->row0;
    // the planted bug of a stale key (test/cuda/test_*_cuda.py): the second step's first
    // micro-batch not uploaded, so its kernels draw the masks of the micro-batch before
    if (!(v->planted_stale_key && drop->step == 1 && drop->row0 == 0))
        staging_upload(s, v->drop_at, v->h_drop_at, sizeof(LoraDropoutAt));
}

// Stops the run when a pass's loss scale (`backward` passes only) or dropout key is not what its
// kernels will read: it was set after `upload` ran, and the pass would use another micro-batch's.
static void batch_values_check(const BatchValues* v, float grad_scale, int backward, const LoraDropout* drop,
                               const char* upload) {
    if (backward && v->h_grad_scale && v->h_grad_scale[0] != grad_scale)
        fail("internal: the loss scale uploaded with the batch (%g) is not this pass's (%g): set it before %s",
             v->h_grad_scale[0], grad_scale, upload);
    const LoraDropoutAt* at = v->h_drop_at;
    if (drop->active && at && (at->step != drop->step || at->row0 != drop->row0))
        fail("internal: the dropout key uploaded with the batch (step %llu, row %lld) is not this pass's (step %llu, "
             "row %lld): set them before %s", (unsigned long long)at->step, (long long)at->row0,
             (unsigned long long)drop->step, (long long)drop->row0, upload);
}

static void batch_values_free(BatchValues* v, const Backend* be) {
    if (v->h_grad_scale) backend_free_host_side(be, v->h_grad_scale);
    if (v->h_drop_at) backend_free_host_side(be, v->h_drop_at);
}
