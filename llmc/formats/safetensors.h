// safetensors.h: reading (mmap, validated) and writing (atomic) of safetensors files, plus
// a model-directory view over model.safetensors or sharded model-*.safetensors with an index.
// Format: u64 little-endian header length, JSON header {name: {dtype, shape, data_offsets}},
// then the data, offsets relative to the end of the header. Files we write record the CRC-32 of
// their data section in __metadata__ as "llmc_crc32" (8 hex digits; metadata is a string map,
// which PEFT and the safetensors package carry along and ignore); st_open verifies it when present.
#pragma once
#include <fcntl.h>
#include <sys/mman.h>
#include "../common.h"
#include "json.h"
#include "checksum.h"

typedef enum { ST_F32, ST_F16, ST_BF16, ST_I32, ST_I64, ST_U8, ST_UNKNOWN } StDtype;

static const char* st_dtype_name(StDtype d) {
    static const char* names[] = {"F32", "F16", "BF16", "I32", "I64", "U8", "?"};
    return names[d];
}

static size_t st_dtype_size(StDtype d) {
    static const size_t sizes[] = {4, 2, 2, 4, 8, 1, 0};
    return sizes[d];
}

static StDtype st_dtype_parse(const char* s) {
    for (int d = 0; d < ST_UNKNOWN; d++)
        if (strcmp(s, st_dtype_name((StDtype)d)) == 0) return (StDtype)d;
    return ST_UNKNOWN;
}

#define ST_MAX_DIMS 8
// The largest header a reader parses: a bound on the memory a hostile file can make the JSON parser take
// (a real header is kilobytes to a few megabytes).
#define ST_MAX_HEADER_BYTES ((uint64_t)100 << 20)

typedef struct {
    const char* name;
    StDtype dtype;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    const uint8_t* data;
    size_t nbytes;
    const char* file;     // the file it came from, for messages
} StTensor;

typedef struct {
    char* path;
    uint8_t* map;
    size_t map_size;
    int count;
    StTensor* tensors;
    Json header;
} StFile;

// The element count of a shape, multiplied with overflow checks: 0 when it would not fit in
// 64 bits (a shape with a zero dimension has 0 elements whatever the others say).
static int st_shape_numel(const int64_t* shape, int ndim, uint64_t* numel) {
    *numel = 1;
    for (int i = 0; i < ndim; i++)
        if (shape[i] == 0) { *numel = 0; return 1; }
    for (int i = 0; i < ndim; i++)
        if (__builtin_mul_overflow(*numel, (uint64_t)shape[i], numel)) return 0;
    return 1;
}

// Elements of a tensor st_open accepted (its byte count was checked, so this cannot overflow).
static int64_t st_numel(const StTensor* t) {
    uint64_t n;
    st_shape_numel(t->shape, t->ndim, &n);
    return (int64_t)n;
}

// A JSON number usable as a size or offset: a non-negative integer that a double holds exactly.
static int st_json_index(double v) { return v >= 0 && v <= 9007199254740992.0 && v == floor(v); }

static void st_parse_entry(StFile* f, const char* name, const Json* e, const uint8_t* data, size_t data_size,
                           StTensor* t) {
    const char* path = f->path;
    if (e->type != JSON_OBJECT) fail("%s: header entry \"%s\" is not an object", path, name);
    const Json* dt = json_get(e, "dtype");
    const Json* shape = json_get(e, "shape");
    const Json* offs = json_get(e, "data_offsets");
    if (!dt || dt->type != JSON_STRING) fail("%s: tensor \"%s\" has no dtype", path, name);
    if (!shape || shape->type != JSON_ARRAY || shape->count > ST_MAX_DIMS)
        fail("%s: tensor \"%s\" has a bad shape", path, name);
    if (!offs || offs->type != JSON_ARRAY || offs->count != 2)
        fail("%s: tensor \"%s\" has bad data_offsets", path, name);
    t->name = name;
    t->file = path;
    t->dtype = st_dtype_parse(dt->string);
    if (t->dtype == ST_UNKNOWN) fail("%s: tensor \"%s\" has unsupported dtype %s", path, name, dt->string);
    t->ndim = shape->count;
    for (int i = 0; i < t->ndim; i++) {
        double v = shape->items[i].number;
        if (shape->items[i].type != JSON_NUMBER || !st_json_index(v))
            fail("%s: tensor \"%s\" has a bad shape (dimension %d is not an integer in [0, 2^53])", path, name, i);
        t->shape[i] = (int64_t)v;
    }
    double b = offs->items[0].number, en = offs->items[1].number;
    if (offs->items[0].type != JSON_NUMBER || offs->items[1].type != JSON_NUMBER || !st_json_index(b) ||
        !st_json_index(en))
        fail("%s: tensor \"%s\" has bad data_offsets (expected two non-negative integers)", path, name);
    if (en < b || en > (double)data_size)
        fail("%s: tensor \"%s\" data_offsets [%.0f, %.0f] lie outside the %zu data bytes (file truncated?)", path, name,
             b, en, data_size);
    t->nbytes = (size_t)(en - b);
    uint64_t numel, need;
    if (!st_shape_numel(t->shape, t->ndim, &numel) ||
        __builtin_mul_overflow(numel, (uint64_t)st_dtype_size(t->dtype), &need))
        fail("%s: tensor \"%s\" has a shape whose size overflows 64 bits", path, name);
    if (need != t->nbytes)
        fail("%s: tensor \"%s\" holds %zu bytes but its shape and dtype need %llu", path, name, t->nbytes,
             (unsigned long long)need);
    t->data = data + (size_t)b;
}

static int st_by_offset(const void* a, const void* b) {
    const StTensor *x = *(const StTensor* const*)a, *y = *(const StTensor* const*)b;
    if (x->data != y->data) return x->data < y->data ? -1 : 1;
    return x->nbytes < y->nbytes ? -1 : x->nbytes > y->nbytes;
}

// The format requires the tensors' bytes to tile the data section: sorted by offset, each starts
// where the previous one ends, the first at 0 and the last at the end. Overlaps would let one
// tensor silently read another's weights; gaps and trailing bytes would hide other content.
static void st_check_tiling(const StFile* f, const uint8_t* data, size_t data_size) {
    const StTensor** order = (const StTensor**)xcalloc(f->count, sizeof(StTensor*));
    for (int i = 0; i < f->count; i++) order[i] = &f->tensors[i];
    qsort(order, f->count, sizeof(*order), st_by_offset);
    size_t end = 0;
    const char* prev = NULL;
    for (int i = 0; i < f->count; i++) {
        size_t b = (size_t)(order[i]->data - data);
        if (b != end) {
            char name[256];
            snprintf(name, sizeof(name), "%s", order[i]->name);
            free(order);
            if (b < end)
                fail(
                    "%s: tensor \"%s\" data_offsets start at %zu, inside the bytes of tensor \"%s\" (which end at "
                    "%zu): overlapping tensors",
                    f->path, name, b, prev, end);
            fail(
                "%s: tensor \"%s\" data_offsets start at %zu, leaving a gap after byte %zu (the format requires "
                "contiguous tensors)",
                f->path, name, b, end);
        }
        end = b + order[i]->nbytes;
        prev = order[i]->name;
    }
    free(order);
    if (end != data_size)
        fail(
            "%s: the tensors cover %zu of the %zu data bytes (trailing bytes after the last tensor: not a valid "
            "safetensors file)",
            f->path, end, data_size);
}

// The CRC-32 of the data section that the header's __metadata__ records (llmc_crc32): 1 and
// *crc, or 0 when none is recorded (files from other writers).
static int st_recorded_crc(const StFile* f, uint32_t* crc) {
    const Json* meta = json_get(&f->header, "__metadata__");
    const Json* v = meta && meta->type == JSON_OBJECT ? json_get(meta, "llmc_crc32") : NULL;
    if (!v) return 0;
    char* end = NULL;
    unsigned long x = v->type == JSON_STRING ? strtoul(v->string, &end, 16) : 0;
    if (!end || end == v->string || *end || strlen(v->string) != 8)
        fail("%s: __metadata__ llmc_crc32 is not 8 hex digits (the header is corrupt)", f->path);
    *crc = (uint32_t)x;
    return 1;
}

// A recorded checksum must match the data: a flipped bit or a torn copy is named, not trained on.
static void st_verify_crc(const StFile* f, const uint8_t* data, size_t data_size) {
    uint32_t want;
    if (!st_recorded_crc(f, &want)) return;
    uint32_t got = crc32_of(data, data_size);
    if (got != want)
        fail(
            "%s: checksum mismatch: the data's CRC-32 is %08x, the header records %08x (the file is corrupt; use an "
            "intact copy)",
            f->path, got, want);
}

static void st_open(StFile* f, const char* path) {
    memset(f, 0, sizeof(*f));
    f->path = xstrdup(path);
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);  // O_NONBLOCK: a FIFO opens, to be refused below
    if (fd < 0) fail("%s: cannot open (%s)", path, strerror(errno));
    struct stat st;
    int stat_ok = fstat(fd, &st) == 0, stat_errno = errno;
    if (!stat_ok || !S_ISREG(st.st_mode) || st.st_size < 8) close(fd);  // every refusal below closes it first
    if (!stat_ok) fail("%s: cannot stat (%s)", path, strerror(stat_errno));
    if (!S_ISREG(st.st_mode)) fail("%s: is %s, expected a safetensors file", path, file_kind(st.st_mode));
    f->map_size = (size_t)st.st_size;
    if (f->map_size < 8) fail("%s: too short to be a safetensors file (%zu bytes)", path, f->map_size);
    f->map = (uint8_t*)mmap(NULL, f->map_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (f->map == MAP_FAILED) fail("%s: cannot mmap (%s)", path, strerror(errno));
    uint64_t hlen;
    memcpy(&hlen, f->map, 8);
    if (hlen > f->map_size - 8)
        fail("%s: header length %llu does not fit in the %zu-byte file (truncated or not safetensors)", path,
             (unsigned long long)hlen, f->map_size);
    if (hlen > ST_MAX_HEADER_BYTES)
        fail("%s: header length %llu exceeds the cap of %llu bytes (100 MiB) on a safetensors header (corrupt, or "
             "not safetensors)", path, (unsigned long long)hlen, (unsigned long long)ST_MAX_HEADER_BYTES);
    f->header = json_parse((const char*)f->map + 8, (size_t)hlen, path);
    if (f->header.type != JSON_OBJECT) fail("%s: header is not a JSON object", path);
    const uint8_t* data = f->map + 8 + hlen;
    size_t data_size = f->map_size - 8 - hlen;
    f->tensors = (StTensor*)xcalloc(f->header.count, sizeof(StTensor));
    for (int i = 0; i < f->header.count; i++) {
        if (strcmp(f->header.keys[i], "__metadata__") == 0) continue;
        st_parse_entry(f, f->header.keys[i], &f->header.items[i], data, data_size, &f->tensors[f->count++]);
    }
    st_check_tiling(f, data, data_size);
    st_verify_crc(f, data, data_size);
}

static void st_close(StFile* f) {
    if (f->map && f->map != MAP_FAILED) munmap(f->map, f->map_size);
    json_free(&f->header);
    free(f->tensors);
    free(f->path);
    memset(f, 0, sizeof(*f));
}

static const StTensor* st_find(const StFile* f, const char* name) {
    for (int i = 0; i < f->count; i++)
        if (strcmp(f->tensors[i].name, name) == 0) return &f->tensors[i];
    return NULL;
}

// ---- conversions to fp32 -------------------------------------------------------------------

static float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint16_t f32_to_bf16(float f) {  // round to nearest even; NaN stays NaN
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

static float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0) {
        if (man == 0) u = sign;
        else {  // subnormal: renormalise
            int e = -1;
            do { e++; man <<= 1; } while (!(man & 0x400));
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) u = sign | 0x7f800000 | (man << 13);
    else u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint16_t f32_to_f16(float f) {  // round to nearest even; overflow to inf, NaN stays NaN
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000, absu = u & 0x7fffffff;
    if (absu > 0x7f800000) return (uint16_t)(sign | 0x7e00);
    if (absu >= 0x477ff000) return (uint16_t)(sign | 0x7c00);  // rounds past the largest half
    if (absu < 0x38800000) {  // subnormal half (or zero): scale into the 10-bit mantissa
        float a;
        memcpy(&a, &absu, 4);
        return (uint16_t)(sign | (uint32_t)lrintf(a * 16777216.0f));  // a / 2^-24, ties to even
    }
    uint32_t r = absu + 0xfff + ((absu >> 13) & 1) - (112u << 23);
    return (uint16_t)(sign | (r >> 13));
}

// Converts n fp32 values to a floating dtype's bytes (F32, BF16 or F16) for writing.
static void f32_to_dtype(void* dst, const float* src, int64_t n, StDtype dtype) {
    uint16_t* h = (uint16_t*)dst;
    switch (dtype) {
        case ST_F32: memcpy(dst, src, sizeof(float) * n); break;
        case ST_BF16: for (int64_t i = 0; i < n; i++) h[i] = f32_to_bf16(src[i]); break;
        case ST_F16: for (int64_t i = 0; i < n; i++) h[i] = f32_to_f16(src[i]); break;
        default: fail("internal: cannot write floats as %s", st_dtype_name(dtype));
    }
}

// Copies a floating tensor into dst as fp32 (dst holds numel floats). Every float a model or an
// adapter loads passes here, so here a NaN or Inf is refused: a corrupt file, not something to
// train on or evaluate (it would end in "loss nan" or a NaN export, exit 0).
static void st_to_f32(const StTensor* t, float* dst) {
    int64_t n = st_numel(t);
    switch (t->dtype) {
        case ST_F32: memcpy(dst, t->data, n * 4); break;
        case ST_BF16:
            for (int64_t i = 0; i < n; i++) {
                uint16_t h;
                memcpy(&h, t->data + 2 * i, 2);
                dst[i] = bf16_to_f32(h);
            }
            break;
        case ST_F16:
            for (int64_t i = 0; i < n; i++) {
                uint16_t h;
                memcpy(&h, t->data + 2 * i, 2);
                dst[i] = f16_to_f32(h);
            }
            break;
        default:
            fail("%s: tensor \"%s\" has dtype %s, expected F32, F16 or BF16", t->file, t->name,
                 st_dtype_name(t->dtype));
    }
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(dst[i]))
            fail("%s: tensor \"%s\" holds a non-finite value (%g) at element %lld", t->file, t->name, dst[i],
                 (long long)i);
}

// Checks a tensor's shape against the expected one (ndim dims), failing with both shapes.
static void st_check_shape(const StTensor* t, int ndim, const int64_t* shape) {
    int ok = t->ndim == ndim;
    for (int i = 0; ok && i < ndim; i++) ok = t->shape[i] == shape[i];
    if (ok) return;
    char got[128] = "", want[128] = "";
    for (int i = 0; i < t->ndim; i++)
        snprintf(got + strlen(got), sizeof(got) - strlen(got), "%s%lld", i ? "," : "", (long long)t->shape[i]);
    for (int i = 0; i < ndim; i++)
        snprintf(want + strlen(want), sizeof(want) - strlen(want), "%s%lld", i ? "," : "", (long long)shape[i]);
    fail("%s: tensor \"%s\" has shape [%s], expected [%s]", t->file, t->name, got, want);
}

// ---- a model directory: one file or shards named by model.safetensors.index.json ----------

typedef struct {
    int nfiles;
    StFile* files;
    char* dir;
    char prefix[32];   // names are looked up as prefix + name (a model inside a bigger checkpoint); "" none
} StModel;

// A sharded checkpoint must say one thing: each tensor of the index's weight_map is in the shard
// it names, and no tensor is in two shards. Which copy counts otherwise depends on the reader
// (transformers loads every shard whole, in sorted order, so the last one wins; a lookup by the
// index takes the named one; st_model_find the first), so such a file is refused, naming the tensor.
static void st_model_check_shards(const StModel* m, const Json* map, const char* index) {
    for (int i = 0; i < map->count; i++) {
        const StFile* f = m->files;
        while (strcmp(strrchr(f->path, '/') + 1, map->items[i].string) != 0) f++;
        if (!st_find(f, map->keys[i]))
            fail("%s: weight_map puts tensor \"%s\" in %s, which does not hold it", index, map->keys[i], f->path);
    }
    int total = 0;
    for (int k = 0; k < m->nfiles; k++) total += m->files[k].count;
    const char** names = (const char**)xmalloc(sizeof(char*) * (total + 1));
    const char** files = (const char**)xmalloc(sizeof(char*) * (total + 1));
    total = 0;
    for (int k = 0; k < m->nfiles; k++)
        for (int i = 0; i < m->files[k].count; i++, total++) {
            names[total] = m->files[k].tensors[i].name;
            files[total] = m->files[k].path;
        }
    int first, dup = first_repeated_string(names, total, &first);
    if (dup >= 0)
        fail("%s: tensor \"%s\" is stored in two shards, %s and %s (ambiguous: readers differ on which copy counts)",
             index, names[dup], files[first], files[dup]);
    free(names);
    free(files);
}

static void st_model_open(StModel* m, const char* dir) {
    memset(m, 0, sizeof(*m));
    m->dir = xstrdup(dir);
    char* single = path_join(dir, "model.safetensors");
    char* index = path_join(dir, "model.safetensors.index.json");
    if (optional_file_exists(single)) {
        m->nfiles = 1;
        m->files = (StFile*)xcalloc(1, sizeof(StFile));
        st_open(&m->files[0], single);
    } else if (optional_file_exists(index)) {
        size_t n;
        char* text = read_file(index, &n);
        Json j = json_parse(text, n, index);
        const Json* map = json_get(&j, "weight_map");
        if (!map || map->type != JSON_OBJECT) fail("%s: missing object \"weight_map\"", index);
        // Distinct shard names, in order of first appearance.
        m->files = (StFile*)xcalloc(map->count ? map->count : 1, sizeof(StFile));
        for (int i = 0; i < map->count; i++) {
            if (map->items[i].type != JSON_STRING)
                fail("%s: weight_map entry \"%s\" is not a file name", index, map->keys[i]);
            const char* shard = map->items[i].string;
            if (strchr(shard, '/')) fail("%s: shard name \"%s\" must be a plain file name", index, shard);
            int seen = 0;
            for (int k = 0; k < m->nfiles && !seen; k++) seen = strcmp(strrchr(m->files[k].path, '/') + 1, shard) == 0;
            if (seen) continue;
            char* p = path_join(dir, shard);
            st_open(&m->files[m->nfiles++], p);
            free(p);
        }
        st_model_check_shards(m, map, index);
        json_free(&j);
        free(text);
    } else {
        fail("%s: no model.safetensors or model.safetensors.index.json in the model directory", dir);
    }
    free(single);
    free(index);
}

static const StTensor* st_model_find(const StModel* m, const char* name) {
    char full[512];
    if (m->prefix[0]) {
        snprintf(full, sizeof(full), "%s%s", m->prefix, name);
        name = full;
    }
    for (int i = 0; i < m->nfiles; i++) {
        const StTensor* t = st_find(&m->files[i], name);
        if (t) return t;
    }
    return NULL;
}

static const StTensor* st_model_require(const StModel* m, const char* name) {
    const StTensor* t = st_model_find(m, name);
    if (!t) fail("%s: checkpoint is missing tensor \"%s%s\"", m->dir, m->prefix, name);
    return t;
}

// Reads tensor `name` of the model into dst as fp32 after checking its shape (ndim dims); a
// non-finite value is an error (st_to_f32).
static void st_model_read_f32(const StModel* m, const char* name, int ndim, const int64_t* shape, float* dst) {
    const StTensor* t = st_model_require(m, name);
    st_check_shape(t, ndim, shape);
    st_to_f32(t, dst);
}

static void st_model_close(StModel* m) {
    for (int i = 0; i < m->nfiles; i++) st_close(&m->files[i]);
    free(m->files);
    free(m->dir);
    memset(m, 0, sizeof(*m));
}

// The identity of a model directory's weights (checksum.h's Fingerprint): of every tensor's name,
// dtype, shape and data, summed over tensors, so the same weights sharded otherwise are the same
// model. A resume checks it (llmc/train/loop.h): another model of the same shape is refused.
static uint64_t st_model_fingerprint(const char* dir) {
    StModel m;
    st_model_open(&m, dir);
    uint64_t sum = 0;
    for (int i = 0; i < m.nfiles; i++)
        for (int k = 0; k < m.files[i].count; k++) {
            const StTensor* t = &m.files[i].tensors[k];
            Fingerprint f;
            fp_init(&f);
            fp_update(&f, t->name, strlen(t->name));
            fp_update(&f, &t->dtype, sizeof(t->dtype));
            fp_update(&f, t->shape, sizeof(t->shape[0]) * t->ndim);
            fp_update(&f, t->data, t->nbytes);
            sum += fp_final(&f);
        }
    st_model_close(&m);
    return sum;
}

// ---- writing ------------------------------------------------------------------------------

typedef struct {
    char name[256];
    StDtype dtype;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    const void* data;     // borrowed until st_writer_save
} StEntry;

typedef struct {
    int count, cap;
    StEntry* entries;
} StWriter;

static void st_writer_add(StWriter* w, const char* name, StDtype dtype, int ndim, const int64_t* shape,
                          const void* data) {
    if (w->count == w->cap) {
        w->cap = w->cap ? 2 * w->cap : 32;
        w->entries = (StEntry*)realloc(w->entries, w->cap * sizeof(StEntry));
        if (!w->entries) fail("out of host memory");
    }
    StEntry* e = &w->entries[w->count++];
    if (strlen(name) >= sizeof(e->name)) fail("tensor name too long: %s", name);
    strcpy(e->name, name);
    e->dtype = dtype;
    e->ndim = ndim;
    memcpy(e->shape, shape, ndim * sizeof(int64_t));
    e->data = data;
}

static size_t st_entry_bytes(const StEntry* e) {
    size_t n = st_dtype_size(e->dtype);
    for (int i = 0; i < e->ndim; i++) n *= (size_t)e->shape[i];
    return n;
}

// Writes all entries atomically. metadata_json is the inner text of "__metadata__" or NULL; the
// data's CRC-32 is added to it.
static void st_writer_save(StWriter* w, const char* path, const char* metadata_json) {
    size_t cap = 256 + (size_t)w->count * 400 + (metadata_json ? strlen(metadata_json) : 0);
    char* h = (char*)xmalloc(cap);
    size_t n = 0, off = 0;
    Crc32 crc;
    crc32_init(&crc);
    for (int i = 0; i < w->count; i++) crc32_update(&crc, w->entries[i].data, st_entry_bytes(&w->entries[i]));
    n += snprintf(h + n, cap - n, "{\"__metadata__\":{%s%s\"llmc_crc32\":\"%08x\"}", metadata_json ? metadata_json : "",
                  metadata_json ? "," : "", crc32_final(&crc));
    for (int i = 0; i < w->count; i++) {
        StEntry* e = &w->entries[i];
        size_t bytes = st_entry_bytes(e);
        n += snprintf(h + n, cap - n, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[", e->name, st_dtype_name(e->dtype));
        for (int d = 0; d < e->ndim; d++) n += snprintf(h + n, cap - n, "%s%lld", d ? "," : "", (long long)e->shape[d]);
        n += snprintf(h + n, cap - n, "],\"data_offsets\":[%zu,%zu]}", off, off + bytes);
        off += bytes;
    }
    n += snprintf(h + n, cap - n, "}");
    while (n % 8) h[n++] = ' ';  // keep the data 8-byte aligned
    uint64_t hlen = n;
    AtomicFile a = atomic_open(path);
    atomic_write(&a, &hlen, 8);
    atomic_write(&a, h, n);
    for (int i = 0; i < w->count; i++) atomic_write(&a, w->entries[i].data, st_entry_bytes(&w->entries[i]));
    atomic_commit(&a);
    free(h);
}

static void st_writer_free(StWriter* w) {
    free(w->entries);
    memset(w, 0, sizeof(*w));
}
