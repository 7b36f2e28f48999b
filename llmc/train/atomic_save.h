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
#include <sys/syscall.h>
#include "../common.h"
#include "../settings.h"

#define SAVE_COMMITTED ".saving.done"
#define SAVE_STATE_NAME "train_state.bin"

// LLMC_FAULT_KILL_SAVE=STEP:POINT kills the process (SIGKILL, as the OOM killer or a scheduler
// would) inside the save after step STEP at POINT: "staged" (all files written, not committed),
// "committed" (renamed to .saving.done, nothing published) or "state" (train_state.bin published,
// the rest not); STEP:POINT:term stops it with SIGTERM instead (a scheduler's polite stop, which
// save_stop_on_signals handles). How the tests reach the moments between the renames. Unset, it
// changes nothing.
static void save_fault_point(int64_t step, const char* point) {
#ifdef LLMC_FAULTS
    const char* e = setting_text(SETTING_FAULT_KILL_SAVE);
    const char* colon = e ? strchr(e, ':') : NULL;
    if (!colon || atoll(e) != step) return;
    size_t n = strlen(point);
    if (strncmp(colon + 1, point, n) != 0) return;
    if (colon[1 + n] == 0) raise(SIGKILL);
    if (strcmp(colon + 1 + n, ":term") == 0) raise(SIGTERM);
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

// Whether path is a directory itself; a symbolic link there is refused, never followed (its
// target's files would be moved into OUT, or deleted). run_options.h checks the names at start.
static int save_real_dir(const char* path) {
    struct stat st;
    if (lstat(path, &st) != 0) return 0;
    if (S_ISLNK(st.st_mode)) fail("%s: is a symbolic link, where the trainer stages its saves (never followed)", path);
    if (!S_ISDIR(st.st_mode))
        fail("%s: is %s, where the trainer stages its saves (remove it)", path, file_kind(st.st_mode));
    return 1;
}

// Every file a save or the run writes into OUT, whatever the model: the state, the adapter, a --full
// model directory's files, the log. Each is written as NAME.tmp, then renamed to NAME.
static const char* const SAVE_OUTPUT_NAMES[] = {SAVE_STATE_NAME,         "adapter_model.safetensors",
                                                "adapter_config.json",   "model.safetensors",
                                                "config.json",           "generation_config.json",
                                                "tokenizer.bin",         "tokenizer.json",
                                                "tokenizer_config.json", "special_tokens_map.json",
                                                "preprocessor_config.json", "log.csv"};
#define SAVE_OUTPUT_COUNT (sizeof(SAVE_OUTPUT_NAMES) / sizeof(SAVE_OUTPUT_NAMES[0]))

// Brings OUT to one consistent save: finishes a committed one (a kill mid-publish), deletes an
// uncommitted staging directory and the temporary files that interrupted writes of older
// versions left beside the outputs. Run by rank 0 before a save and before a resume reads OUT.
static void save_dir_recover(const char* out) {
    char* done = path_join(out, SAVE_COMMITTED);
    if (save_real_dir(done)) save_publish(out, -1);
    char* stage = path_join(out, SAVE_STAGING);
    remove_flat_dir(stage);  // a symbolic link there goes itself, its target untouched
    for (size_t i = 0; i < SAVE_OUTPUT_COUNT; i++) {
        char tmp[4096];
        struct stat st;  // a link there goes itself (unlink never follows one)
        int fits = (size_t)snprintf(tmp, sizeof(tmp), "%s/%s.tmp", out, SAVE_OUTPUT_NAMES[i]) < sizeof(tmp);
        if (fits && lstat(tmp, &st) == 0 && (S_ISREG(st.st_mode) || S_ISLNK(st.st_mode)))
            unlink(tmp);
    }
    free(stage);
    free(done);
}

// A stage emptied and removed with async-signal-safe calls only (open, getdents64, unlinkat,
// rmdir), for a signal handler: the stage holds plain files, no subdirectory.
static void stage_remove_in_handler(const char* dir) {
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return;
    char buf[4096];
    for (long n; (n = syscall(SYS_getdents64, fd, buf, sizeof(buf))) > 0;)
        for (long at = 0; at < n;) {
            struct linux_dirent64 {
                uint64_t ino;
                int64_t off;
                unsigned short reclen;
                unsigned char type;
                char name[];
            }* e = (struct linux_dirent64*)(buf + at);
            if (strcmp(e->name, ".") && strcmp(e->name, "..")) unlinkat(fd, e->name, 0);
            at += e->reclen;
        }
    close(fd);
    rmdir(dir);
}

// Appends s to the line being built in a signal handler (no stdio there).
static size_t handler_line_add(char* line, size_t len, size_t cap, const char* s) {
    while (*s && len + 1 < cap) line[len++] = *s++;
    line[len] = 0;
    return len;
}

// SIGINT (Ctrl-C), SIGTERM (a scheduler's stop, or mpirun passing one on) or SIGHUP (a closed
// terminal) while a save or an export is being staged: the stage goes, one line says what stopped
// the run, and the signal then ends the process as it would have. The last complete save stands
// (a stop after a save's commit is finished by the next resume, save_dir_recover).
static char* g_save_stage;
static char* g_export_stage;

static void save_on_signal(int sig) {
    const char* stage = g_save_stage ? g_save_stage : g_export_stage;
    if (stage) stage_remove_in_handler(stage);
    char line[1024];
    size_t n = handler_line_add(line, 0, sizeof(line), "error: stopped by ");
    n = handler_line_add(line, n, sizeof(line), sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : "SIGHUP");
    if (stage) {
        n = handler_line_add(line, n, sizeof(line), "; the unfinished ");
        n = handler_line_add(line, n, sizeof(line), stage);
        n = handler_line_add(line, n, sizeof(line), " was removed");
    }
    n = handler_line_add(line, n, sizeof(line), " (--resume continues from the last complete save, if there is one)\n");
    ssize_t w = write(STDERR_FILENO, line, n);
    (void)w;
    signal(sig, SIG_DFL);
    raise(sig);
}

static void save_stop_on_signals(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = save_on_signal;
    sigemptyset(&sa.sa_mask);
    const int sigs[] = {SIGINT, SIGTERM, SIGHUP};
    for (int i = 0; i < 3; i++) sigaction(sigs[i], &sa, NULL);
}

// Starts a save into OUT: recovers OUT, then returns the fresh staging directory to write into.
// mkdir fails on any existing name (a link, a file, another run's directory), so the stage written
// into is always the one made here. A save that fails on the way (fail() exits) removes it.

static void save_stage_cleanup(void) {
    if (g_save_stage) remove_flat_dir(g_save_stage);
}

static char* save_begin(const char* out) {
    save_dir_recover(out);
    char* stage = path_join(out, SAVE_STAGING);
    if (mkdir(stage, 0755) != 0) fail("%s: cannot create the save's staging directory (%s)", stage, strerror(errno));
    static int registered;
    if (!registered) registered = atexit(save_stage_cleanup) == 0;
    g_save_stage = stage;
    return stage;
}

// Commits the staged save (every file in it complete and fsynced by its writer) and publishes it.
static void save_commit(const char* out, char* stage, int64_t step) {
    save_fsync_dir(stage);
    save_fault_point(step, "staged");
    char* done = path_join(out, SAVE_COMMITTED);
    if (rename(stage, done) != 0) fail("%s: cannot commit the save (%s)", done, strerror(errno));
    g_save_stage = NULL;  // committed: the next save or resume finishes it
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

// Refuses a dir that is not a directory, or that holds anything an export does not write. With
// `link` EXPORT_NO_LINK (the stage names DIR.export.tmp, DIR.replaced.tmp) a symbolic link there is
// refused too: they are deleted and renamed, and a link would carry that to its target.
typedef enum { EXPORT_LINK_OK, EXPORT_NO_LINK } ExportLink;
static void export_dir_check_contents(const char* dir, const char* what, ExportLink link) {
    struct stat st;
    if (lstat(dir, &st) != 0) return;
    if (S_ISLNK(st.st_mode) && link == EXPORT_NO_LINK)
        fail("%s: %s is a symbolic link, where the export stages its files (never followed: remove it)", what, dir);
    if (stat(dir, &st) != 0) return;
    if (!S_ISDIR(st.st_mode)) fail("%s: %s exists and is not a directory", what, dir);
    DIR* d = opendir(dir);
    if (!d) fail("%s: cannot list %s (%s)", what, dir, strerror(errno));
    for (struct dirent* e; (e = readdir(d)) != NULL;)
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..") && !export_dir_own_file(e->d_name)) {
            closedir(d);
            fail("%s: %s holds %s, which an export does not write; the export replaces the whole directory, so give "
                 "a new or empty one (or one an earlier export wrote)", what, dir, e->d_name);
        }
    closedir(d);
}

// DIR with a suffix (".export.tmp", ".replaced.tmp"): the export's stage names beside it.
static char* export_dir_sibling(const char* d, const char* suffix) {
    char* p = (char*)xmalloc(strlen(d) + strlen(suffix) + 1);
    sprintf(p, "%s%s", d, suffix);
    return p;
}

// Refuses a DIR an export cannot replace, or stage names it could not use; run before the
// training, so as not to refuse after it.
static void export_dir_check(const char* dir, const char* what) {
    char* d = export_dir_name(dir, what);
    export_dir_check_contents(d, what, EXPORT_LINK_OK);
    char* stage = export_dir_sibling(d, ".export.tmp");
    char* old = export_dir_sibling(d, ".replaced.tmp");
    export_dir_check_contents(stage, what, EXPORT_NO_LINK);
    export_dir_check_contents(old, what, EXPORT_NO_LINK);
    free(old);
    free(stage);
    free(d);
}

static void export_dir_cleanup(void) {
    if (g_export_stage) remove_flat_dir(g_export_stage);
}

// Starts an export into DIR: checks DIR, clears a stage a killed export left, and returns the
// fresh stage to write into.
static char* export_dir_begin(const char* dir, const char* what) {
    export_dir_check(dir, what);
    char* d = export_dir_name(dir, what);
    char* stage = export_dir_sibling(d, ".export.tmp");
    remove_flat_dir(stage);
    make_dirs(stage, what);
    struct stat st;  // made here, not a link put in its place since
    if (lstat(stage, &st) != 0 || !S_ISDIR(st.st_mode)) fail("%s: %s is not the directory just made", what, stage);
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
        old = export_dir_sibling(d, ".replaced.tmp");
        remove_flat_dir(old);  // a link goes itself, never its target
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
