// atomic_save.h: a training save as one step on disk. Its files (the adapter, or under --full the
// model directory's files, and train_state.bin) are written into OUT/.saving.tmp; once all are
// complete and fsynced, that directory is renamed to OUT/.saving.done (the commit), then its
// files move into OUT, train_state.bin first, and it goes. A kill before the commit leaves the
// previous save whole (the staging directory is deleted by the next save or resume); a kill after
// it is finished by save_dir_recover, which every save and every resume runs first. So a resume
// always finds the state and the adapter of one step, and OUT never holds an adapter newer than
// its state, even mid-publish.
#pragma once
#include <signal.h>
#include "../common.h"
#include "../settings.h"

#define SAVE_COMMITTED ".saving.done"
#define SAVE_STATE_NAME "train_state.bin"

// LLMC_FAULT_KILL_SAVE=STEP:POINT kills the process (SIGKILL, as the OOM killer or a scheduler
// would) inside the save after step STEP at POINT: "staged" (all files written, not committed),
// "committed" (renamed to .saving.done, nothing published) or "state" (train_state.bin published,
// the rest not). How the tests reach the moments between the renames. Unset, it changes nothing.
static void save_fault_point(int64_t step, const char* point) {
#ifdef LLMC_FAULTS
    const char* e = setting_text(SETTING_FAULT_KILL_SAVE);
    const char* colon = e ? strchr(e, ':') : NULL;
    if (colon && atoll(e) == step && strcmp(colon + 1, point) == 0) raise(SIGKILL);
#else
    (void)step; (void)point;
#endif
}

// A file system that cannot sync a directory (EINVAL: some network and FUSE file systems) orders
// the renames as well as it can without; any other failure is an error.
static void save_fsync_dir(const char* dir) {
    if (fsync_path(dir) != 0 && errno != EINVAL && errno != ENOTSUP)
        fail("%s: cannot sync the directory (%s)", dir, strerror(errno));
}

// Moves one committed file into OUT.
static void save_publish_file(const char* done, const char* out, const char* name) {
    char* src = path_join(done, name);
    char* dst = path_join(out, name);
    if (rename(src, dst) != 0) fail("%s: cannot move the saved file into place (%s)", dst, strerror(errno));
    free(src);
    free(dst);
}

// Moves the committed save's files into OUT: the state first, so that OUT's adapter is never newer
// than OUT's state; then the rest, and the empty directory goes.
static void save_publish(const char* out, int64_t step) {
    char* done = path_join(out, SAVE_COMMITTED);
    char* state = path_join(done, SAVE_STATE_NAME);
    if (file_exists(state)) {
        save_publish_file(done, out, SAVE_STATE_NAME);
        save_fsync_dir(out);
    }
    save_fault_point(step, "state");
    for (int moved = 1; moved;) {  // until empty: readdir may skip entries while others are renamed away
        DIR* d = opendir(done);
        if (!d) fail("%s: cannot list the committed save (%s)", done, strerror(errno));
        moved = 0;
        for (struct dirent* e; (e = readdir(d)) != NULL;)
            if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
                save_publish_file(done, out, e->d_name);
                moved = 1;
            }
        closedir(d);
    }
    if (rmdir(done) != 0) fail("%s: cannot remove the published save's directory (%s)", done, strerror(errno));
    save_fsync_dir(out);
    free(state);
    free(done);
}

// Brings OUT to one consistent save: finishes a committed one (a kill mid-publish), deletes an
// uncommitted staging directory and the temporary files that interrupted writes of older
// versions left beside the outputs. Run by rank 0 before a save and before a resume reads OUT.
static void save_dir_recover(const char* out) {
    char* done = path_join(out, SAVE_COMMITTED);
    if (dir_exists(done)) save_publish(out, -1);
    char* stage = path_join(out, SAVE_STAGING);
    if (dir_exists(stage)) remove_flat_dir(stage);
    static const char* const names[] = {SAVE_STATE_NAME,
                                        "adapter_model.safetensors",
                                        "adapter_config.json",
                                        "model.safetensors",
                                        "config.json",
                                        "generation_config.json",
                                        "tokenizer.bin",
                                        "tokenizer.json",
                                        "tokenizer_config.json",
                                        "special_tokens_map.json",
                                        "preprocessor_config.json",
                                        "log.csv"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        char tmp[4096];
        if ((size_t)snprintf(tmp, sizeof(tmp), "%s/%s.tmp", out, names[i]) < sizeof(tmp) && file_exists(tmp))
            unlink(tmp);
    }
    free(stage);
    free(done);
}

// Starts a save into OUT: recovers OUT, then returns the fresh staging directory to write into.
static char* save_begin(const char* out) {
    save_dir_recover(out);
    char* stage = path_join(out, SAVE_STAGING);
    if (mkdir(stage, 0755) != 0) fail("%s: cannot create the save's staging directory (%s)", stage, strerror(errno));
    return stage;
}

// Commits the staged save (every file in it complete and fsynced by its writer) and publishes it.
static void save_commit(const char* out, char* stage, int64_t step) {
    save_fsync_dir(stage);
    save_fault_point(step, "staged");
    char* done = path_join(out, SAVE_COMMITTED);
    if (rename(stage, done) != 0) fail("%s: cannot commit the save (%s)", done, strerror(errno));
    save_fsync_dir(out);
    save_fault_point(step, "committed");
    save_publish(out, step);
    free(done);
    free(stage);
}

// ---------------------------------------------------------------------------------------------
// --export-merged's model directory, written whole or not at all. It is staged in a sibling,
// DIR.export.tmp, renamed to DIR once complete; a failure (a full disk) removes the stage on the
// way out (fail() exits, and an atexit handler clears it), so DIR is left as it was: neither
// half-written nor created empty. An existing DIR is replaced whole, so no file of an earlier
// export outlives it (a stale tokenizer.bin would win over a new tokenizer.json: model_tokenizer.h
// reads tokenizer.bin first); so DIR may hold only the files an export writes, else it is refused.

static const char* const EXPORT_DIR_FILES[] = {"model.safetensors",     "config.json",
                                               "generation_config.json", "tokenizer.bin",
                                               "tokenizer.json",        "tokenizer_config.json",
                                               "special_tokens_map.json", "preprocessor_config.json"};

// Whether name is a file an export writes, or the temporary file of one.
static int export_dir_own_file(const char* name) {
    for (size_t i = 0; i < sizeof(EXPORT_DIR_FILES) / sizeof(EXPORT_DIR_FILES[0]); i++) {
        size_t n = strlen(EXPORT_DIR_FILES[i]);
        if (!strncmp(name, EXPORT_DIR_FILES[i], n) && (!name[n] || !strcmp(name + n, ".tmp"))) return 1;
    }
    return 0;
}

// DIR without trailing slashes (a malloc'd copy); "." and ".." cannot be renamed, so are refused.
static char* export_dir_name(const char* dir, const char* what) {
    char* d = xstrdup(dir);
    size_t n = strlen(d);
    while (n > 1 && d[n - 1] == '/') d[--n] = 0;
    const char* base = strrchr(d, '/') ? strrchr(d, '/') + 1 : d;
    if (!strcmp(base, ".") || !strcmp(base, "..") || !strcmp(d, "/"))
        fail("%s: %s: name the directory itself (it is replaced whole), not . or ..", what, dir);
    return d;
}

// Refuses a dir that is not a directory, or that holds anything an export does not write.
static void export_dir_check_contents(const char* dir, const char* what) {
    struct stat st;
    if (stat(dir, &st) != 0) return;
    if (!S_ISDIR(st.st_mode)) fail("%s: %s exists and is not a directory", what, dir);
    DIR* d = opendir(dir);
    if (!d) fail("%s: cannot list %s (%s)", what, dir, strerror(errno));
    for (struct dirent* e; (e = readdir(d)) != NULL;)
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..") && !export_dir_own_file(e->d_name))
            fail("%s: %s holds %s, which an export does not write; the export replaces the whole directory, so give "
                 "a new or empty one (or one an earlier export wrote)", what, dir, e->d_name);
    closedir(d);
}

// Refuses a DIR an export cannot replace; run before the training, so as not to refuse after it.
static void export_dir_check(const char* dir, const char* what) {
    char* d = export_dir_name(dir, what);
    export_dir_check_contents(d, what);
    free(d);
}

static char* g_export_stage;  // the stage being written, removed at exit unless committed

static void export_dir_cleanup(void) {
    if (g_export_stage) remove_flat_dir(g_export_stage);
}

// Starts an export into DIR: checks DIR, clears a stage a killed export left, and returns the
// fresh stage to write into.
static char* export_dir_begin(const char* dir, const char* what) {
    char* d = export_dir_name(dir, what);
    export_dir_check_contents(d, what);
    char* stage = (char*)xmalloc(strlen(d) + 16);
    sprintf(stage, "%s.export.tmp", d);
    export_dir_check_contents(stage, what);
    if (dir_exists(stage)) remove_flat_dir(stage);
    make_dirs(stage, what);
    static int registered;
    if (!registered) registered = atexit(export_dir_cleanup) == 0;
    g_export_stage = stage;
    free(d);
    return stage;
}

// Puts the complete stage in DIR's place (an earlier DIR, checked by export_dir_begin, goes).
static void export_dir_commit(const char* dir, char* stage) {
    char* d = export_dir_name(dir, "export");
    save_fsync_dir(stage);
    char* old = NULL;
    if (dir_exists(d)) {
        old = (char*)xmalloc(strlen(d) + 16);
        sprintf(old, "%s.replaced.tmp", d);
        if (dir_exists(old)) remove_flat_dir(old);
        if (rename(d, old) != 0) fail("%s: cannot move the earlier export aside (%s)", d, strerror(errno));
    }
    if (rename(stage, d) != 0) fail("%s: cannot move the export into place (%s)", d, strerror(errno));
    g_export_stage = NULL;
    if (old) remove_flat_dir(old);
    char* parent = xstrdup(d);
    char* slash = strrchr(parent, '/');
    if (slash) *(slash == parent ? slash + 1 : slash) = 0;
    save_fsync_dir(slash ? parent : ".");
    free(parent);
    free(old);
    free(stage);
    free(d);
}
