// out_dir.h: the output directory as one run's own place. A run that writes --out (or continues
// in --resume's directory) holds an advisory lock on DIR/.lock for its whole life, so a second
// run there is refused naming the holder's pid instead of deleting the first one's staging
// directory; before the first step it refuses what a save would meet only after training: a
// symbolic link or a foreign file at a name the save writes or stages in (atomic_save.h never
// follows one either), another run's save in a new run's --out, and an --export-merged directory
// that is --out, or inside it, or holds it. Rank 0 calls these: it is the only rank that writes.
#pragma once
#include <limits.h>
#include <sys/file.h>
#include "../common.h"
#include "atomic_save.h"

#define OUT_LOCK_NAME ".lock"

// The holder's pid as its lock file says (it writes it just after taking the lock, so a few
// short waits cover the moment between the two), or "unknown".
static void out_dir_lock_holder(int fd, char* pid, size_t n) {
    for (int tries = 0; tries < 50; tries++) {
        ssize_t got = pread(fd, pid, n - 1, 0);
        if (got > 0) {
            pid[got] = 0;
            pid[strcspn(pid, "\n")] = 0;
            if (pid[0]) return;
        }
        usleep(10000);
    }
    snprintf(pid, n, "unknown");
}

// The lock files this process holds: removed at exit while still held (the descriptors close
// after the atexit handlers), so a finished run leaves none behind. A run that takes a lock checks
// that the file it locked is still the one at the path, so one removed meanwhile is not shared.
static char* g_out_locks[2];

static void out_dir_unlock(void) {
    for (int i = 0; i < 2; i++)
        if (g_out_locks[i]) unlink(g_out_locks[i]);
}

// Opens and locks DIR/.lock: its descriptor, or -1 when the file was replaced before the lock was
// taken (try again). Fails naming the holder when another process holds it.
static int out_dir_try_lock(const char* dir, const char* path, const char* flag) {
    int fd = open(path, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK, 0644);
    if (fd < 0 && errno == ELOOP)
        fail("flag --%s: %s is a symbolic link, where the run keeps its lock (never followed: remove it)", flag, path);
    if (fd < 0) fail("flag --%s: cannot open %s (%s)", flag, path, strerror(errno));
    struct stat st, now;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
        fail("flag --%s: %s is %s, where the run keeps its lock (remove it)", flag, path, file_kind(st.st_mode));
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        if (errno != EWOULDBLOCK) fail("flag --%s: cannot lock %s (%s)", flag, path, strerror(errno));
        char pid[32];
        out_dir_lock_holder(fd, pid, sizeof(pid));
        fail("flag --%s: %s is in use by another run (pid %s holds %s); wait for it to end, or choose another "
             "directory",
             flag, dir, pid, path);
    }
    if (lstat(path, &now) == 0 && now.st_dev == st.st_dev && now.st_ino == st.st_ino) return fd;
    close(fd);  // its holder removed it as it ended: that file locks nothing now
    return -1;
}

// Takes DIR's lock for the rest of the process (the descriptor stays open; the kernel drops the
// lock when the process ends, however it ends) and writes this pid into the lock file.
static void out_dir_lock(const char* dir, const char* flag) {
    char* path = path_join(dir, OUT_LOCK_NAME);
    int fd = -1;
    for (int tries = 0; fd < 0 && tries < 100; tries++) fd = out_dir_try_lock(dir, path, flag);
    if (fd < 0) fail("flag --%s: cannot lock %s: it keeps being replaced", flag, path);
    char line[32];
    int n = snprintf(line, sizeof(line), "%ld\n", (long)getpid());
    if (ftruncate(fd, 0) != 0 || pwrite(fd, line, (size_t)n, 0) != n)
        fail("flag --%s: cannot write %s (%s)", flag, path, strerror(errno));
    int slot = g_out_locks[0] ? 1 : 0;
    if (!g_out_locks[0] && atexit(out_dir_unlock) != 0) fail("flag --%s: cannot register the lock's removal", flag);
    g_out_locks[slot] = path;
}

// What is at DIR/NAME, without following a link: 0 when nothing, else its mode in *mode.
static int out_dir_entry(const char* dir, const char* name, mode_t* mode) {
    char* p = path_join(dir, name);
    struct stat st;
    int there = lstat(p, &st) == 0;
    free(p);
    if (there) *mode = st.st_mode;
    return there;
}

static const char* out_dir_kind(mode_t mode) { return S_ISLNK(mode) ? "a symbolic link" : file_kind(mode); }

// DIR/NAME, a file the run writes (renamed over, or appended to): nothing or a regular file.
static void out_dir_check_file(const char* dir, const char* name, const char* flag) {
    mode_t mode;
    if (out_dir_entry(dir, name, &mode) && !S_ISREG(mode))
        fail("flag --%s: %s/%s is %s, where the run writes a file (never followed or replaced: remove it)", flag, dir,
             name, out_dir_kind(mode));
}

// DIR/NAME, a staging directory of the saves: nothing or a directory itself.
static void out_dir_check_stage(const char* dir, const char* name, const char* flag) {
    mode_t mode;
    if (out_dir_entry(dir, name, &mode) && !S_ISDIR(mode))
        fail("flag --%s: %s/%s is %s, where the run stages its saves (never followed or replaced: remove it)", flag,
             dir, name, out_dir_kind(mode));
}

// The names the run will write in DIR, and their NAME.tmp, hold nothing a save cannot use.
static void out_dir_check_names(const char* dir, const char* flag) {
    char tmp[PATH_MAX];
    for (size_t i = 0; i < SAVE_OUTPUT_COUNT; i++) {
        out_dir_check_file(dir, SAVE_OUTPUT_NAMES[i], flag);
        snprintf(tmp, sizeof(tmp), "%s.tmp", SAVE_OUTPUT_NAMES[i]);
        out_dir_check_file(dir, tmp, flag);
    }
    out_dir_check_stage(dir, SAVE_STAGING, flag);
    out_dir_check_stage(dir, SAVE_COMMITTED, flag);
    if (access(dir, W_OK) != 0) fail("flag --%s: directory %s is not writable", flag, dir);
}

// A new run's DIR must not hold another run's output: it would be overwritten (the save) or cut
// (log.csv) by a run that never owned it. `full`: the run saves a model directory's files.
static void out_dir_refuse_other_run(const char* dir, int full) {
    static const char* const any[] = {SAVE_STATE_NAME, "log.csv", SAVE_STAGING, SAVE_COMMITTED};
    static const char* const lora[] = {"adapter_model.safetensors", "adapter_config.json"};
    static const char* const model[] = {"model.safetensors", "config.json"};
    const char* found = NULL;
    mode_t mode;
    for (int i = 0; i < 4 && !found; i++)
        if (out_dir_entry(dir, any[i], &mode)) found = any[i];
    for (int i = 0; i < 2 && !found; i++)
        if (out_dir_entry(dir, full ? model[i] : lora[i], &mode)) found = full ? model[i] : lora[i];
    if (found)
        fail("flag --out: %s already holds a run's output (%s): continue that run with --resume %s, or remove it or "
             "choose another --out",
             dir, found, dir);
}

// The absolute form of a path that may not exist yet, with no link or ".." in its existing part:
// its longest existing ancestor through realpath, the rest appended as given.
static char* out_dir_canonical(const char* path) {
    char* full = xstrdup(path);
    size_t n = strlen(full);
    while (n > 1 && full[n - 1] == '/') full[--n] = 0;
    char* head = xstrdup(full);  // the part realpath resolves: cut at its last '/' until it exists
    char real[PATH_MAX];
    while (!realpath(head[0] ? head : full[0] == '/' ? "/" : ".", real)) {
        if (!head[0]) fail("%s: cannot resolve the path (%s)", path, strerror(errno));
        char* slash = strrchr(head, '/');
        *(slash ? slash : head) = 0;
    }
    const char* tail = full + strlen(head);  // "", "/rest", or a relative path whole
    size_t k = strlen(real);
    if (k == 1 && tail[0]) real[--k] = 0;  // "/" + "/rest"
    char* out = (char*)xmalloc(k + strlen(tail) + 2);
    sprintf(out, "%s%s%s", real, tail[0] && tail[0] != '/' ? "/" : "", tail);
    free(head);
    free(full);
    return out;
}

// Whether directory a is b, or inside it (canonical paths).
static int out_dir_within(const char* a, const char* b) {
    size_t n = strlen(b);
    return strncmp(a, b, n) == 0 && (a[n] == 0 || a[n] == '/' || !strcmp(b, "/"));
}

// --export-merged EXPORT against the run's directory DIR (--out or --resume): the export replaces
// its directory whole and the saves write into theirs, so neither may hold the other.
static void out_dir_check_export(const char* export_dir, const char* dir, const char* flag) {
    if (!export_dir || !dir) return;
    char* e = out_dir_canonical(export_dir);
    char* d = out_dir_canonical(dir);
    const char* how = !strcmp(e, d) ? "is" : out_dir_within(e, d) ? "is inside" : out_dir_within(d, e) ? "holds" : NULL;
    if (how)
        fail("flag --export-merged: %s %s the run's directory (--%s %s): the export replaces its directory whole; "
             "choose one apart from it",
             export_dir, how, flag, dir);
    free(d);
    free(e);
}

// The export writes its stage beside EXPORT: the nearest existing directory above it must be writable.
static void out_dir_check_export_writable(const char* export_dir) {
    char* p = out_dir_canonical(export_dir);
    struct stat st;
    for (char* slash; (slash = strrchr(p, '/')) != NULL;) {
        *(slash == p ? slash + 1 : slash) = 0;
        if (stat(p, &st) == 0) break;
        if (slash == p) break;
    }
    if (access(p, W_OK) != 0)
        fail("flag --export-merged: cannot write %s: directory %s is not writable", export_dir, p);
    free(p);
}
