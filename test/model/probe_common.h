// test/model/probe_common.h: what both model probes (test/model/llama_probe.cu, test/model/vit_probe.cu) do with
// the case and output files: typed lookups in the case, the adapters of one linear from it, and
// the gradients of one linear (its adapter's, or W's under --full) into the output.
#pragma once
#include "../../llmc/formats/safetensors.h"
#include "../../llmc/linear.h"

static const StTensor* case_tensor(const StFile* f, const char* name, StDtype dtype) {
    const StTensor* t = st_find(f, name);
    if (!t) fail("%s: missing tensor \"%s\"", f->path, name);
    if (t->dtype != dtype) fail("%s: tensor \"%s\" has dtype %s, expected %s", f->path, name, st_dtype_name(t->dtype), st_dtype_name(dtype));
    return t;
}

// lora.{layer}.{target}.A [r, in] and .B [out, r] of the case into L's adapter (if it has one).
static void probe_load_lora(const StFile* cf, Linear* L, int layer, const char* target, int rank) {
    if (!L->A) return;
    char name[128];
    int64_t sa[2] = {rank, L->in}, sb[2] = {L->out, rank};
    snprintf(name, sizeof(name), "lora.%d.%s.A", layer, target);
    const StTensor* a = case_tensor(cf, name, ST_F32);
    st_check_shape(a, 2, sa);
    memcpy(L->A, a->data, a->nbytes);
    snprintf(name, sizeof(name), "lora.%d.%s.B", layer, target);
    const StTensor* b = case_tensor(cf, name, ST_F32);
    st_check_shape(b, 2, sb);
    memcpy(L->B, b->data, b->nbytes);
}

// grad.{layer}.{target}.W (full fine-tuning) or grad.lora.{layer}.{target}.A/B into the output
// (the writer copies names; the data must live until it is saved).
static void probe_add_grads(StWriter* w, const Linear* L, int layer, const char* target, int rank) {
    char name[128];
    if (L->dW) {
        int64_t sw[2] = {L->out, L->in};
        snprintf(name, sizeof(name), "grad.%d.%s.W", layer, target);
        st_writer_add(w, name, ST_F32, 2, sw, L->dW);
    }
    if (L->dbias) {
        int64_t sb = L->out;
        snprintf(name, sizeof(name), "grad.%d.%s.b", layer, target);
        st_writer_add(w, name, ST_F32, 1, &sb, L->dbias);
    }
    if (!L->A) return;
    int64_t sa[2] = {rank, L->in}, sb[2] = {L->out, rank};
    snprintf(name, sizeof(name), "grad.lora.%d.%s.A", layer, target);
    st_writer_add(w, name, ST_F32, 2, sa, L->dA);
    snprintf(name, sizeof(name), "grad.lora.%d.%s.B", layer, target);
    st_writer_add(w, name, ST_F32, 2, sb, L->dB);
}
