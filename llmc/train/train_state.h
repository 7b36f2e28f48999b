// train_state.h: the resumable training state: trainable weights, AdamW moments, the step, the
// data cursor, the seed, and a settings line that must match on resume (the base model's tensors
// and config.json, the data, model shape, modes, LoRA shape, batch geometry). Written atomically
// (temporary file, fsync, rename), so a run killed at any moment resumes from the last complete
// save. Its last four bytes are the CRC-32 of everything before them, and it records the CRC-32
// of the file saved with it (the adapter, or under --full the model), so a resume catches a
// corrupt state and a pair from two saves.
#pragma once
#include <math.h>
#include "../common.h"
#include "../formats/checksum.h"
#include "../formats/safetensors.h"
#include "zero.h"

#define STATE_MAGIC "LMFTSTAT"
#define STATE_VERSION 3u  // 3: the settings hold config.json's identity (llmc/train/loop.h)
#define STATE_SETTINGS_BYTES 1024
#define STATE_COMPANION_BYTES 64

typedef struct {
    int64_t step;          // optimizer steps completed
    int64_t cursor;        // training data loader cursor (global window index)
    uint64_t seed;
    char settings[STATE_SETTINGS_BYTES];
    int64_t count;         // floats in each of params, m, v
    char companion[STATE_COMPANION_BYTES];  // the file saved beside it ("adapter_model.safetensors"), or ""
    uint32_t companion_crc;  // that file's data CRC-32 (what its __metadata__ records)
    uint32_t reserved;
} StateHeader;

// Writes bytes to the state file and into its running checksum.
static void state_put(AtomicFile* a, Crc32* c, const void* data, size_t n) {
    atomic_write(a, data, n);
    crc32_update(c, data, n);
}

static void state_save(const char* path, const StateHeader* h, const float* params, const float* m, const float* v) {
    AtomicFile a = atomic_open(path);
    Crc32 c;
    crc32_init(&c);
    uint32_t version = STATE_VERSION;
    state_put(&a, &c, STATE_MAGIC, 8);
    state_put(&a, &c, &version, 4);
    state_put(&a, &c, h, sizeof(*h));
    state_put(&a, &c, params, sizeof(float) * h->count);
    state_put(&a, &c, m, sizeof(float) * h->count);
    state_put(&a, &c, v, sizeof(float) * h->count);
    uint32_t crc = crc32_final(&c);
    atomic_write(&a, &crc, 4);  // last: a file cut short anywhere has no valid checksum
    atomic_commit(&a);
}

// Names the first "key=value" of two space-separated settings lines that differs (into err).
static void state_explain_mismatch(char* err, size_t n, const char* path, const char* saved, const char* now) {
    char a[STATE_SETTINGS_BYTES], b[STATE_SETTINGS_BYTES];
    snprintf(a, sizeof(a), "%s", saved);
    snprintf(b, sizeof(b), "%s", now);
    char *sa, *sb;
    char* ta = strtok_r(a, " ", &sa);
    char* tb = strtok_r(b, " ", &sb);
    while (ta && tb && strcmp(ta, tb) == 0) { ta = strtok_r(NULL, " ", &sa); tb = strtok_r(NULL, " ", &sb); }
    const char* key = ta ? ta : tb ? tb : "";
    const char* hint = !strncmp(key, "config_fingerprint=", 19) ? "the model directory's config.json changed; " : "";
    snprintf(err, n,
             "%s: the saved run does not match this one: saved %s, now %s (%sresume with the same model and flags)",
             path, ta ? ta : "(nothing)", tb ? tb : "(nothing)", hint);
}

// The first value of the state's three arrays that no training run can have saved (a skipped
// step never updates, so a saved state is finite): NaN or Inf anywhere, or a negative second
// moment (AdamW's v is a mean of squares). Returns 1 and says which in err.
static int state_find_impossible(char* err, size_t n, const char* path, const float* p, int64_t count) {
    static const char* what[3] = {"trainable value", "first AdamW moment", "second AdamW moment"};
    for (int k = 0; k < 3; k++)
        for (int64_t i = 0; i < count; i++) {
            float x = p[k * count + i];
            if (isfinite(x) && !(k == 2 && x < 0)) continue;
            snprintf(err, n,
                     "%s: %s %lld of %lld is %g, which no saved run holds (the state is corrupt or the run had "
                     "diverged: resume "
                     "from an intact copy, or start again)",
                     path, what[k], (long long)i, (long long)count, x);
            return 1;
        }
    return 0;
}

// Checks a state file's bytes: magic, version, checksum, then that it belongs to this run
// (`settings`, `count`) and holds possible values. Returns 1, or 0 with the reason in err.
static int state_check(char* err, size_t n, const char* path, const char* buf, size_t size, StateHeader* h,
                       const char* settings, int64_t count) {
    size_t need = 12 + sizeof(*h), body = need + 3 * sizeof(float) * (size_t)count;
    uint32_t version = 0, crc;
    if (size < need + 4 || memcmp(buf, STATE_MAGIC, 8) != 0) {
        snprintf(err, n, "%s: not a training state (bad magic)", path);
        return 0;
    }
    memcpy(&version, buf + 8, 4);
    if (version != STATE_VERSION) {
        snprintf(
            err, n,
            "%s: training state version %u, expected %u (from another version of this trainer: start the run again)",
            path, version, STATE_VERSION);
        return 0;
    }
    memcpy(&crc, buf + size - 4, 4);
    uint32_t got = crc32_of(buf, size - 4);
    if (got != crc) {
        snprintf(err, n,
                 "%s: checksum mismatch: the contents' CRC-32 is %08x, the file records %08x (corrupt or cut short: "
                 "resume from "
                 "an intact copy)",
                 path, got, crc);
        return 0;
    }
    memcpy(h, buf + 12, sizeof(*h));
    h->settings[STATE_SETTINGS_BYTES - 1] = 0;
    h->companion[STATE_COMPANION_BYTES - 1] = 0;
    if (strcmp(h->settings, settings) != 0) { state_explain_mismatch(err, n, path, h->settings, settings); return 0; }
    if (h->count != count) {
        snprintf(err, n, "%s: holds %lld trainable values, this run has %lld", path, (long long)h->count,
                 (long long)count);
        return 0;
    }
    if (size != body + 4) { snprintf(err, n, "%s: %zu bytes, expected %zu", path, size, body + 4); return 0; }
    // a checksum proves the bytes are the ones written, not that they make sense
    if (h->step < 0 || h->cursor < 0) {
        snprintf(err, n, "%s: step %lld, data cursor %lld: no saved run holds a negative one (the state is corrupt)",
                 path, (long long)h->step, (long long)h->cursor);
        return 0;
    }
    float* values = (float*)(buf + need);  // 4-byte aligned: need is a multiple of 4 and malloc aligns
    return !state_find_impossible(err, n, path, values, count);
}

// Reads a state; its settings must equal `settings` and its size `count`. The file's buffer is
// freed before any error, so a refused resume leaks nothing (make test-asan checks leaks).
static void state_load(const char* path, StateHeader* h, const char* settings, int64_t count, float* params, float* m,
                       float* v) {
    size_t size;
    char* buf = read_file(path, &size);
    char err[STATE_SETTINGS_BYTES * 2 + 512];
    if (!state_check(err, sizeof(err), path, buf, size, h, settings, count)) {
        free(buf);
        fail("%s", err);
    }
    const char* p = buf + 12 + sizeof(*h);
    memcpy(params, p, sizeof(float) * count);
    memcpy(m, p + sizeof(float) * count, sizeof(float) * count);
    memcpy(v, p + 2 * sizeof(float) * count, sizeof(float) * count);
    free(buf);
}

// A Trainable's state in that file (trainable.h; ZeRO-1's shards gathered by zero.h).

// The CRC-32 that a safetensors file we wrote records for its data (st_open checks it on the way).
static uint32_t saved_file_crc(const char* path) {
    StFile f;
    st_open(&f, path);
    uint32_t crc = 0;
    if (!st_recorded_crc(&f, &crc)) fail("%s: records no checksum", path);
    st_close(&f);
    return crc;
}

// Writes DIR/train_state.bin, recording the checksum of DIR/companion (the file saved with it, or
// NULL). Called on every rank (ZeRO-1 gathers the moments); rank 0 writes.
static void trainable_save_state(Trainable* tr, const Dist* dist, const char* dir, const char* settings, int64_t step,
                                 int64_t cursor, int seed, const char* companion) {
    trainable_sync_host(tr, dist);
    float *own_m = tr->adam_m, *own_v = tr->adam_v;  // this rank's moments, on the host
    if (trainable_on_device(tr)) {  // the moments come to the host for the file
        own_m = (float*)xmalloc(sizeof(float) * (tr->shard + 1));
        own_v = (float*)xmalloc(sizeof(float) * (tr->shard + 1));
        backend_download(tr->be, own_m, tr->adam_m, sizeof(float) * tr->shard);
        backend_download(tr->be, own_v, tr->adam_v, sizeof(float) * tr->shard);
    }
    float* adam_m = tr->zero1 ? trainable_gather_shards(tr, dist, own_m) : own_m;
    float* adam_v = tr->zero1 ? trainable_gather_shards(tr, dist, own_v) : own_v;
    if (!dist || dist->rank == 0) {
        StateHeader h;
        memset(&h, 0, sizeof(h));
        h.step = step;
        h.cursor = cursor;
        h.seed = (uint64_t)seed;
        h.count = tr->count;
        snprintf(h.settings, sizeof(h.settings), "%s", settings);
        if (companion) {
            char* cp = path_join(dir, companion);
            snprintf(h.companion, sizeof(h.companion), "%s", companion);
            h.companion_crc = saved_file_crc(cp);
            free(cp);
        }
        char* path = path_join(dir, "train_state.bin");
        state_save(path, &h, tr->h_params, adam_m, adam_v);
        free(path);
    }
    if (tr->zero1) { free(adam_m); free(adam_v); }
    if (own_m != tr->adam_m) { free(own_m); free(own_v); }
}

// A resume's check that DIR's adapter (or --full model) is the one saved with the state: its data
// must match its own checksum (st_open checks) and the one the state recorded. A missing file is
// no error: the state alone resumes, and the next save writes the file again.
static void train_check_companion(const char* dir, const StateHeader* h) {
    if (!h->companion[0]) return;
    char* path = path_join(dir, h->companion);
    if (file_exists(path)) {
        StFile f;
        st_open(&f, path);
        uint32_t crc = 0;
        int recorded = st_recorded_crc(&f, &crc);
        st_close(&f);
        if (!recorded || crc != h->companion_crc)
            fail(
                "%s: not the file saved with %s/train_state.bin (its data checksum %s%08x, the state recorded %08x): "
                "the two are from "
                "different saves; put back the pair, or delete %s to resume from the state alone",
                path, dir, recorded ? "" : "(none) ", crc, h->companion_crc, path);
    }
    free(path);
}

// Reads DIR/train_state.bin on every rank (each keeps its own shard of the moments under ZeRO-1);
// returns the step to continue from and sets *cursor, the training loader's position.
static int64_t trainable_load_state(Trainable* tr, const char* dir, const char* settings, int64_t* cursor) {
    char* path = path_join(dir, "train_state.bin");
    StateHeader h;
    int dev = trainable_on_device(tr), staged = tr->zero1 || dev;
    float *adam_m = tr->adam_m, *adam_v = tr->adam_v;
    if (staged) {  // the file's moments (arena order) on the host first
        adam_m = (float*)xcalloc(tr->padded + 1, sizeof(float));
        adam_v = (float*)xcalloc(tr->padded + 1, sizeof(float));
    }
    state_load(path, &h, settings, tr->count, tr->h_params, adam_m, adam_v);
    if (tr->rank == 0) train_check_companion(dir, &h);
    if (staged) {  // this rank's part of the moments where the optimizer keeps them
        float* own_m = dev ? (float*)xmalloc(sizeof(float) * (tr->shard + 1)) : tr->adam_m;
        float* own_v = dev ? (float*)xmalloc(sizeof(float) * (tr->shard + 1)) : tr->adam_v;
        trainable_shard_from_arena(tr, adam_m, own_m, tr->zero1 ? tr->rank : 0);
        trainable_shard_from_arena(tr, adam_v, own_v, tr->zero1 ? tr->rank : 0);
        if (dev) {
            backend_upload(tr->be, tr->adam_m, own_m, sizeof(float) * tr->shard);
            backend_upload(tr->be, tr->adam_v, own_v, sizeof(float) * tr->shard);
            trainable_to_device(tr);
            free(own_m);
            free(own_v);
        }
        free(adam_m);
        free(adam_v);
    }
    free(path);
    *cursor = h.cursor;
    return h.step;
}
