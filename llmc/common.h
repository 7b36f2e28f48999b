// common.h: error reporting, checked allocation, whole-file I/O, atomic writes and a wall clock.
// Every user-facing failure goes through fail(): one line on stderr, exit status 1, so bad input
// never ends in a crash or a partial output file.
#pragma once
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#ifdef __GNUC__
#define LLMC_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define LLMC_PRINTF(a, b)
#endif

// Hook for multi-process runs: when set, fail() calls it after printing so that the whole job
// stops (MPI_Abort) instead of leaving the other ranks waiting.
static void (*g_fail_hook)(int status) = NULL;

// Set by fail(): its line is the report, so the exit check of stdout (below) adds none.
static int g_failed = 0;

static void fail(const char* fmt, ...) LLMC_PRINTF(1, 2);
static void fail(const char* fmt, ...) {
    g_failed = 1;
    // the line goes out in one write: under mpirun each write is forwarded on its own, and the
    // launcher's abort banner must not land inside it
    char line[4096] = "error: ";  // PIPE_BUF on Linux
    size_t head = strlen(line);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line + head, sizeof line - head - 1, fmt, ap);
    va_end(ap);
    size_t len = strlen(line);
    line[len] = '\n';
    fflush(stdout);
    fflush(stderr);
    // at most PIPE_BUF bytes: one atomic write; to stderr's descriptor, which a caller may have
    // pointed elsewhere (test/fuzz/fuzz_parsers.cu silences the expected errors that way)
    ssize_t wrote = write(fileno(stderr), line, len + 1);
    (void)wrote;
    if (g_fail_hook) g_fail_hook(1);
    exit(1);
}

// At exit (atexit): output lost to a full disk or a failed write must not end in status 0, so
// stdout is flushed and its error flag read, and a failure is one line and status 1.
static void stdout_check_at_exit(void) {
    if (g_failed) return;
    int flush_failed = fflush(stdout) != 0;
    if (!flush_failed && !ferror(stdout)) return;
    char line[256];
    snprintf(line, sizeof line, "error: writing standard output failed (%s); the output is incomplete\n",
             flush_failed ? strerror(errno) : "an earlier write");
    ssize_t wrote = write(fileno(stderr), line, strlen(line));
    (void)wrote;
    _exit(1);  // exit() may not be called again from an atexit handler
}

// Registers stdout_check_at_exit once (every program calls it as it starts: flags_parse).
static void stdout_check_at_exit_register(void) {
    static int registered = 0;
    if (!registered) atexit(stdout_check_at_exit);
    registered = 1;
}

// Appends formatted text to the string in buf (n bytes in all), cut at the end of buf: for lines
// assembled piece by piece, where a long piece (a --lora-targets list) must not overflow.
static void str_appendf(char* buf, size_t n, const char* fmt, ...) LLMC_PRINTF(3, 4);
static void str_appendf(char* buf, size_t n, const char* fmt, ...) {
    size_t len = strnlen(buf, n);
    if (len + 1 >= n) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + len, n - len, fmt, ap);
    va_end(ap);
}

static void* xmalloc(size_t n) {
    void* p = malloc(n ? n : 1);
    if (!p) fail("out of host memory allocating %zu bytes", n);
    return p;
}

static void* xcalloc(size_t count, size_t size) {
    void* p = calloc(count ? count : 1, size ? size : 1);
    if (!p) fail("out of host memory allocating %zu x %zu bytes", count, size);
    return p;
}

static char* xstrdup(const char* s) {
    size_t n = strlen(s) + 1;
    char* p = (char*)xmalloc(n);
    memcpy(p, s, n);
    return p;
}

// What a path that is not a regular file is, for messages.
static const char* file_kind(mode_t mode) {
    if (S_ISDIR(mode)) return "a directory";
    if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
    if (S_ISCHR(mode)) return "a character device";
    if (S_ISBLK(mode)) return "a block device";
    if (S_ISSOCK(mode)) return "a socket";
    return "not a regular file";
}

// Fails naming what `path` is when it exists but is not a regular file. Only regular files are
// inputs: reading a FIFO blocks until a writer comes (forever, for a mistaken path), a device
// never ends or reads as empty, a directory has no contents.
static void fail_unless_regular(const char* path) {
    struct stat st;
    if (stat(path, &st) == 0 && !S_ISREG(st.st_mode))
        fail("%s: is %s, expected a regular file", path, file_kind(st.st_mode));
}

// Opens an input file for reading: O_NONBLOCK, so that a FIFO put there after a check opens
// without a writer instead of blocking, and fstat refuses it. Returns the descriptor, or -1 with
// errno set (ENODEV when it is not a regular file).
static int open_input(const char* path) {
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return -1;
    struct stat st;
    int err = fstat(fd, &st) != 0 ? errno : S_ISREG(st.st_mode) ? 0 : ENODEV;
    if (err) { close(fd); errno = err; return -1; }
    return fd;
}

typedef enum { OUTPUT_TRUNCATE, OUTPUT_APPEND } OutputMode;

// Opens an output file for writing (truncated, or appended to), created if absent.
// O_NONBLOCK for the same reason as open_input: a FIFO left at an output's path would otherwise
// block the open until a reader comes; fstat then refuses anything not a regular file. Returns
// NULL with errno set (ENODEV when the path is not a regular file). O_NOFOLLOW: a symbolic link
// planted at an output's name (log.csv, a save's X.tmp) fails (ELOOP) instead of being written
// through to wherever it points.
static FILE* open_output(const char* path, OutputMode mode) {
    int append = mode == OUTPUT_APPEND;
    int flags = O_WRONLY | O_CREAT | O_NONBLOCK | O_CLOEXEC | O_NOFOLLOW | (append ? O_APPEND : O_TRUNC);
    int fd = open(path, flags, 0644);
    if (fd < 0) return NULL;
    struct stat st;
    int err = fstat(fd, &st) != 0 ? errno : S_ISREG(st.st_mode) ? 0 : ENODEV;
    if (!err && fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0) err = errno;
    FILE* f = err ? NULL : fdopen(fd, append ? "ab" : "wb");
    if (!f) { if (!err) err = errno; close(fd); errno = err; }
    return f;
}

// Reads a whole file into a NUL-terminated buffer. Returns NULL (errno set) if it cannot be read
// or is not a regular file.
static char* read_file_or_null(const char* path, size_t* size_out) {
    int fd = open_input(path);
    FILE* f = fd >= 0 ? fdopen(fd, "rb") : NULL;
    if (!f) { int e = errno; if (fd >= 0) close(fd); errno = e; return NULL; }
    if (fseek(f, 0, SEEK_END) != 0) { fclose(f); return NULL; }
    long n = ftell(f);
    if (n < 0) { fclose(f); return NULL; }
    rewind(f);
    char* buf = (char*)xmalloc((size_t)n + 1);
    size_t got = fread(buf, 1, (size_t)n, f);
    fclose(f);
    if (got != (size_t)n) { free(buf); errno = EIO; return NULL; }
    buf[n] = 0;
    if (size_out) *size_out = (size_t)n;
    return buf;
}

static char* read_file(const char* path, size_t* size_out) {
    char* buf = read_file_or_null(path, size_out);
    if (!buf) {
        int err = errno;
        fail_unless_regular(path);
        fail("%s: cannot read file (%s)", path, strerror(err));
    }
    return buf;
}

static int file_exists(const char* path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

static int dir_exists(const char* path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

// An optional input file: 1 when it is there, 0 when absent. A directory, FIFO or device in its
// place is an error, since skipping it would silently change the result (ViT's normalisation, a
// tokenizer's ids).
static int optional_file_exists(const char* path) {
    fail_unless_regular(path);
    return file_exists(path);
}

// The index of the first of strings s[0..n) equal to an earlier one (*first: that earlier one's),
// or -1. A hash set: objects of 100k keys (a tokenizer's vocabulary) cost linear time.
static int first_repeated_string(const char* const* s, int n, int* first) {
    size_t cap = 16;
    while (cap < 2 * (size_t)n) cap *= 2;
    int* slot = (int*)xmalloc(sizeof(int) * cap);
    memset(slot, 0xff, sizeof(int) * cap);  // -1: empty
    int found = -1;
    for (int i = 0; i < n && found < 0; i++) {
        uint64_t h = 1469598103934665603ull;  // FNV-1a
        for (const unsigned char* c = (const unsigned char*)s[i]; *c; c++) h = (h ^ *c) * 1099511628211ull;
        size_t k = (size_t)h & (cap - 1);
        while (slot[k] >= 0 && strcmp(s[slot[k]], s[i]) != 0) k = (k + 1) & (cap - 1);
        if (slot[k] >= 0) { found = i; *first = slot[k]; }
        slot[k] = i;
    }
    free(slot);
    return found;
}

// Joins a directory and a file name into a fresh heap string.
static char* path_join(const char* dir, const char* name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char* p = (char*)xmalloc(n);
    snprintf(p, n, "%s/%s", dir, name);
    return p;
}

// Creates a directory (and its parents) if missing; fails naming the flag that asked for it.
static void make_dirs(const char* path, const char* what) {
    char buf[4096];
    if (strlen(path) >= sizeof(buf)) fail("%s: path too long: %s", what, path);
    strcpy(buf, path);
    for (char* p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(buf, 0755) != 0 && errno != EEXIST)
            fail("%s: cannot create directory %s (%s)", what, buf, strerror(errno));
        *p = '/';
    }
    if (mkdir(buf, 0755) != 0 && errno != EEXIST)
        fail("%s: cannot create directory %s (%s)", what, buf, strerror(errno));
    if (!dir_exists(buf)) fail("%s: %s exists and is not a directory", what, buf);
    if (access(buf, W_OK) != 0) fail("%s: directory %s is not writable", what, buf);
}

// Removes the plain files of a directory, then the directory (an abandoned save's staging
// directory: it holds files only). Best effort: what cannot go stays for the next clean-up. Never
// follows a symbolic link: one at `dir` is removed itself (its target untouched), and the
// directory is opened O_NOFOLLOW, so one put there meanwhile is not entered either; entries are
// unlinked, never recursed into.
static void remove_flat_dir(const char* dir) {
    struct stat st;
    if (lstat(dir, &st) != 0) return;
    if (S_ISLNK(st.st_mode)) { unlink(dir); return; }
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    DIR* d = fd >= 0 ? fdopendir(fd) : NULL;
    if (!d) { if (fd >= 0) close(fd); return; }
    for (struct dirent* e; (e = readdir(d)) != NULL;)
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) unlinkat(dirfd(d), e->d_name, 0);
    closedir(d);
    rmdir(dir);
}

// Makes a directory entry's changes (a rename into it, a new file) durable, as fsync does for a
// file's bytes. Returns 0 or -1 with errno set.
static int fsync_path(const char* path) {
    int fd = open(path, O_RDONLY);
    if (fd < 0) return -1;
    int r = fsync(fd);
    int err = errno;
    close(fd);
    errno = err;
    return r;
}

// A training save is staged in OUT/SAVE_STAGING (llmc/train/atomic_save.h). When one of its files cannot be
// written the whole unfinished save goes with it, so that a full disk is not left fuller.
#define SAVE_STAGING ".saving.tmp"

// Atomic file writing: everything goes to PATH.tmp, which is fsync'ed and renamed over PATH only
// when complete, so a crash never leaves a half-written checkpoint or adapter behind, and a
// failure (a full disk) removes PATH.tmp before it reports, so none is left behind either.
typedef struct {
    FILE* f;
    char* path;
    char* tmp_path;
} AtomicFile;

// The failure of an atomic write: the temporary file (and a staged save it belongs to) is
// removed, then the error names `shown` (the temporary file or the destination).
static void atomic_fail(AtomicFile* a, const char* shown, const char* what) {
    const char* why = strerror(errno);
    if (a->f) fclose(a->f);
    a->f = NULL;
    unlink(a->tmp_path);
    const char* slash = strrchr(a->path, '/');
    size_t dir_len = slash ? (size_t)(slash - a->path) : 0, n = strlen(SAVE_STAGING);
    if (dir_len >= n && memcmp(a->path + dir_len - n, SAVE_STAGING, n) == 0 &&
        (dir_len == n || a->path[dir_len - n - 1] == '/')) {
        char* stage = xstrdup(a->path);
        stage[dir_len] = 0;
        remove_flat_dir(stage);
        free(stage);
    }
    fail("%s: %s (%s)", shown, what, why);
}

static AtomicFile atomic_open(const char* path) {
    AtomicFile a;
    a.path = xstrdup(path);
    size_t n = strlen(path) + 5;
    a.tmp_path = (char*)xmalloc(n);
    snprintf(a.tmp_path, n, "%s.tmp", path);
    a.f = open_output(a.tmp_path, OUTPUT_TRUNCATE);
    if (!a.f && errno == ENODEV) {  // a FIFO or device at the staging path: say what it is, leave it
        struct stat st;
        const char* kind = stat(a.tmp_path, &st) == 0 ? file_kind(st.st_mode) : "not a regular file";
        fail("%s: is %s, expected a regular file or nothing", a.tmp_path, kind);
    }
    if (!a.f && errno == ELOOP)  // a symbolic link there: refused, neither followed nor removed
        fail("%s: is a symbolic link, expected a regular file or nothing (never written through)", a.tmp_path);
    if (!a.f) atomic_fail(&a, a.tmp_path, "cannot open for writing");
    return a;
}

static void atomic_write(AtomicFile* a, const void* data, size_t n) {
    if (n && fwrite(data, 1, n, a->f) != n) atomic_fail(a, a->tmp_path, "write failed");
}

static void atomic_commit(AtomicFile* a) {
    // ferror: a failed fprintf straight to a->f (the JSON writers) shows only here
    if (ferror(a->f) || fflush(a->f) != 0 || fsync(fileno(a->f)) != 0) atomic_fail(a, a->tmp_path, "flush failed");
    fclose(a->f);
    a->f = NULL;
    if (rename(a->tmp_path, a->path) != 0) atomic_fail(a, a->path, "cannot rename into place");
    free(a->path);
    free(a->tmp_path);
}

// Copies a file (through a temporary file and rename, like every writer here).
static void copy_file_atomic(const char* src, const char* dst) {
    size_t n;
    char* buf = read_file(src, &n);
    AtomicFile a = atomic_open(dst);
    atomic_write(&a, buf, n);
    atomic_commit(&a);
    free(buf);
}

static double wall_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

// Peak resident set size of this process so far (the CPU backend's measured memory): /proc's VmHWM,
// the high-water mark of this program's own address space. getrusage's ru_maxrss survives execve,
// so a trainer started by a large process (a test runner, a notebook) would report its parent's
// peak from before the exec; it is the fallback where /proc is not mounted.
static double peak_rss_mib(void) {
    FILE* f = fopen("/proc/self/status", "r");
    if (f) {
        char line[256];
        while (fgets(line, sizeof(line), f))
            if (!strncmp(line, "VmHWM:", 6)) {
                fclose(f);
                return atof(line + 6) / 1024.0;  // kB
            }
        fclose(f);
    }
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_maxrss / 1024.0;  // Linux reports KiB
}

static size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }
