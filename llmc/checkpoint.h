// checkpoint.h: the resumable training state: trainable weights, AdamW moments, the step, the
// data cursor, the seed, and a settings line that must match on resume (model shape, modes,
// LoRA shape, batch geometry). Written atomically (temporary file, fsync, rename), so a run
// killed at any moment resumes from the last complete save.
#pragma once
#include "common.h"
#include "zero.h"

#define STATE_MAGIC "LMFTSTAT"
#define STATE_VERSION 1u
#define STATE_SETTINGS_BYTES 1024

typedef struct {
    int64_t step;          // optimizer steps completed
    int64_t cursor;        // training data loader cursor (global window index)
    uint64_t seed;
    char settings[STATE_SETTINGS_BYTES];
    int64_t count;         // floats in each of params, m, v
} StateHeader;

static void state_save(const char* path, const StateHeader* h, const float* params, const float* m, const float* v) {
    AtomicFile a = atomic_open(path);
    uint32_t version = STATE_VERSION;
    atomic_write(&a, STATE_MAGIC, 8);
    atomic_write(&a, &version, 4);
    atomic_write(&a, h, sizeof(*h));
    atomic_write(&a, params, sizeof(float) * h->count);
    atomic_write(&a, m, sizeof(float) * h->count);
    atomic_write(&a, v, sizeof(float) * h->count);
    atomic_commit(&a);
}

// Names the first "key=value" of two space-separated settings lines that differs.
static void state_explain_mismatch(const char* path, const char* saved, const char* now) {
    char a[STATE_SETTINGS_BYTES], b[STATE_SETTINGS_BYTES];
    snprintf(a, sizeof(a), "%s", saved);
    snprintf(b, sizeof(b), "%s", now);
    char *sa, *sb;
    char* ta = strtok_r(a, " ", &sa);
    char* tb = strtok_r(b, " ", &sb);
    while (ta && tb && strcmp(ta, tb) == 0) { ta = strtok_r(NULL, " ", &sa); tb = strtok_r(NULL, " ", &sb); }
    fail("%s: the saved run does not match this one: saved %s, now %s (resume with the same model and flags)", path,
         ta ? ta : "(nothing)", tb ? tb : "(nothing)");
}

// Reads a state; its settings must equal `settings` and its size `count`. The file's buffer is
// freed before any error, so a refused resume leaks nothing (make test-asan checks leaks).
static void state_load(const char* path, StateHeader* h, const char* settings, int64_t count, float* params, float* m, float* v) {
    size_t size;
    char* buf = read_file(path, &size);
    size_t need = 12 + sizeof(*h);
    uint32_t version = 0;
    int magic_ok = size >= need && memcmp(buf, STATE_MAGIC, 8) == 0;
    if (magic_ok) {
        memcpy(&version, buf + 8, 4);
        memcpy(h, buf + 12, sizeof(*h));
        h->settings[STATE_SETTINGS_BYTES - 1] = 0;
    }
    int fits = magic_ok && version == STATE_VERSION && h->count == count && size == need + 3 * sizeof(float) * (size_t)count;
    if (fits && strcmp(h->settings, settings) == 0) {
        const char* p = buf + need;
        memcpy(params, p, sizeof(float) * count);
        memcpy(m, p + sizeof(float) * count, sizeof(float) * count);
        memcpy(v, p + 2 * sizeof(float) * count, sizeof(float) * count);
        free(buf);
        return;
    }
    free(buf);
    if (!magic_ok) fail("%s: not a training state (bad magic)", path);
    if (version != STATE_VERSION) fail("%s: training state version %u, expected %u", path, version, STATE_VERSION);
    if (strcmp(h->settings, settings) != 0) state_explain_mismatch(path, h->settings, settings);
    if (h->count != count) fail("%s: holds %lld trainable values, this run has %lld", path, (long long)h->count, (long long)count);
    fail("%s: truncated (%zu bytes, expected %zu)", path, size, need + 3 * sizeof(float) * (size_t)count);
}

// A Trainable's state in that file (trainable.h; ZeRO-1's shards gathered by zero.h).

// Writes DIR/train_state.bin. Called on every rank (ZeRO-1 gathers the moments); rank 0 writes.
static void trainable_save_state(Trainable* tr, const Dist* dist, const char* dir, const char* settings, int64_t step,
                                 int64_t cursor, int seed) {
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
        char* path = path_join(dir, "train_state.bin");
        state_save(path, &h, tr->h_params, adam_m, adam_v);
        free(path);
    }
    if (tr->zero1) { free(adam_m); free(adam_v); }
    if (own_m != tr->adam_m) { free(own_m); free(own_v); }
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
