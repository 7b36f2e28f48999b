// imagedata.h: image shards and the image batch loader.
// A shard (written by scripts/data/prepare_images.py) is, little-endian:
//   64-byte header: magic "IMGS", u32 version (1), u32 n, u32 H, u32 W, u32 C (1 or 3),
//                   u32 classes, then zeros up to byte 64
//   n * H * W * C   uint8 pixels, image after image, each row-major HWC (native resolution)
//   n               uint16 labels, each < classes (uint16: up to 65535 classes, e.g. ImageNet-21k)
// The loader resizes each image on the fly to the model's resolution (bilinear, PyTorch's
// F.interpolate rule: llmc/vision/resample.h), scales to [0, 1], normalises per channel with the
// checkpoint's mean/std, replicates a grayscale channel when the model wants RGB, optionally flips
// horizontally, and writes CHW floats. Order: a seeded permutation per epoch; each global batch of
// world*B images is sharded by rank, like llmc/text/textdata.h.
#pragma once
#include "../common.h"
#include "../rng.h"
#include "../formats/checksum.h"
#include "resample.h"

#define IMAGE_SHARD_MAGIC "IMGS"
#define IMAGE_SHARD_HEADER_BYTES 64

typedef struct {
    char* path;
    int64_t n;
    int H, W, C, classes;
    uint8_t* pixels;       // [n, H, W, C]
    uint16_t* labels;      // [n]
} ImageShard;

static void image_shard_load(ImageShard* s, const char* path) {
    size_t size;
    uint8_t* buf = (uint8_t*)read_file(path, &size);
    memset(s, 0, sizeof(*s));
    s->path = xstrdup(path);
    if (size >= 4 && memcmp(buf, "LMFT", 4) == 0)  // the other trainer's data: say whose
        fail("%s: a token shard (scripts/data/prepare_text.py's, for train_llama), not an image shard (\"IMGS\", made "
             "by scripts/data/prepare_images.py)", path);
    if (size < IMAGE_SHARD_HEADER_BYTES || memcmp(buf, IMAGE_SHARD_MAGIC, 4) != 0)
        fail("%s: not an image shard (bad magic; expected \"IMGS\", made by scripts/data/prepare_images.py)", path);
    uint32_t h[7];
    memcpy(h, buf + 4, sizeof(h));
    uint32_t version = h[0], n = h[1], H = h[2], W = h[3], C = h[4], classes = h[5];
    if (version != 1) fail("%s: image shard version %u, expected 1", path, version);
    for (int i = 28; i < IMAGE_SHARD_HEADER_BYTES; i++)
        if (buf[i]) fail("%s: header byte %d is %u, expected 0 (reserved; corrupt header?)", path, i, buf[i]);
    if (n < 1) fail("%s: header says 0 images", path);
    if (H < 1 || W < 1 || H > 65536 || W > 65536)
        fail("%s: header image size %ux%u, expected 1..65536 per side", path, H, W);
    if (C != 1 && C != 3) fail("%s: header says %u channels, expected 1 or 3", path, C);
    if (classes < 1 || classes > 65535) fail("%s: header says %u classes, expected 1..65535", path, classes);
    uint64_t per = (uint64_t)H * W * C;
    uint64_t need = IMAGE_SHARD_HEADER_BYTES + (uint64_t)n * (per + 2);
    if (need != size)
        fail(
            "%s: header says %u images of %ux%ux%u, which needs %llu bytes, but the file has %zu (truncated or wrong "
            "size?)",
            path, n, H, W, C, (unsigned long long)need, size);
    s->n = n;
    s->H = (int)H; s->W = (int)W; s->C = (int)C; s->classes = (int)classes;
    s->pixels = (uint8_t*)xmalloc(n * per);
    s->labels = (uint16_t*)xmalloc((size_t)n * 2);
    memcpy(s->pixels, buf + IMAGE_SHARD_HEADER_BYTES, n * per);
    memcpy(s->labels, buf + IMAGE_SHARD_HEADER_BYTES + n * per, (size_t)n * 2);
    free(buf);
    for (int64_t i = 0; i < s->n; i++)
        if (s->labels[i] >= classes)
            fail("%s: image %lld has label %u, but the header says %u classes", path, (long long)i, s->labels[i],
                 classes);
}

static void image_shard_free(ImageShard* s) {
    free(s->path); free(s->pixels); free(s->labels);
    memset(s, 0, sizeof(*s));
}

// The identity of a shard's contents (checksum.h's Fingerprint), recorded with a saved run so a
// resume on other images of the same count is refused.
static uint64_t image_shard_fingerprint(const ImageShard* s) {
    Fingerprint f;
    fp_init(&f);
    fp_update(&f, s->pixels, (size_t)s->n * s->H * s->W * s->C);
    fp_update(&f, s->labels, sizeof(uint16_t) * (size_t)s->n);
    return fp_final(&f);
}

typedef struct {
    const ImageShard* shard;
    int H, W, C;           // the model's input
    float mean[3], std[3]; // per model channel
    uint64_t seed;
    int shuffle, hflip;
    int64_t cursor;        // global index into the sequence of images over all epochs
    int64_t* order;        // permutation of images for the current epoch
    int64_t order_epoch;
    ResampleTaps *ty, *tx; // bilinear taps shard -> model resolution
} ImageLoader;

// mean/std hold one value per model channel. Fails when the shard's channels cannot feed the model.
static void image_loader_init(ImageLoader* L, const ImageShard* s, int H, int W, int C, const float* mean,
                              const float* std, uint64_t seed, int shuffle, int hflip) {
    memset(L, 0, sizeof(*L));
    if (!(s->C == C || (s->C == 1 && C == 3)))
        fail("%s: images have %d channels, but the model wants %d (only grayscale -> RGB is converted)", s->path, s->C,
             C);
    L->shard = s;
    L->H = H; L->W = W; L->C = C;
    for (int c = 0; c < C; c++) {
        L->mean[c] = mean[c];
        L->std[c] = std[c];
    }
    L->seed = seed;
    L->shuffle = shuffle;
    L->hflip = hflip;
    L->order = (int64_t*)xmalloc(s->n * sizeof(int64_t));
    L->order_epoch = -1;
    L->ty = (ResampleTaps*)xmalloc(sizeof(ResampleTaps) * H);
    L->tx = (ResampleTaps*)xmalloc(sizeof(ResampleTaps) * W);
    bilinear_taps(L->ty, s->H, H);
    bilinear_taps(L->tx, s->W, W);
}

static void image_loader_free(ImageLoader* L) {
    free(L->order); free(L->ty); free(L->tx);
}

static int64_t image_loader_index(ImageLoader* L, int64_t global_index) {
    return rng_epoch_item(L->order, &L->order_epoch, L->shard->n, L->shuffle, L->seed, global_index);
}

// Image `idx` of the shard into dst [C, H, W]: bilinear resize, /255, (x - mean) / std, optional
// flip of the resized image. The resize is linear with weights summing to 1, so resizing the raw
// pixels and normalising afterwards equals normalising first.
static void image_loader_convert(const ImageLoader* L, int64_t idx, int flip, float* dst) {
    const ImageShard* s = L->shard;
    const uint8_t* img = s->pixels + idx * (int64_t)s->H * s->W * s->C;
    for (int c = 0; c < L->C; c++) {
        int sc = s->C == 1 ? 0 : c;
        float scale = 1.0f / (255.0f * L->std[c]), shift = L->mean[c] / L->std[c];
        float* out = dst + (int64_t)c * L->H * L->W;
        for (int y = 0; y < L->H; y++) {
            const ResampleTaps* ty = &L->ty[y];
            for (int x = 0; x < L->W; x++) {
                const ResampleTaps* tx = &L->tx[flip ? L->W - 1 - x : x];
                float v = 0.0f;
                for (int a = 0; a < 2; a++)
                    for (int b = 0; b < 2; b++)
                        v += ty->w[a] * tx->w[b] * img[((int64_t)ty->idx[a] * s->W + tx->idx[b]) * s->C + sc];
                out[(int64_t)y * L->W + x] = v * scale - shift;
            }
        }
    }
}

// The flip of the image at a global position: a function of (seed, position) only, so it does not
// depend on the rank or on how the batches were cut.
static int image_loader_flip(const ImageLoader* L, int64_t global_index) {
    if (!L->hflip) return 0;
    Rng r = rng_seeded(L->seed, 2000000 + (uint64_t)global_index);
    return (int)(rng_next_u64(&r) >> 63);
}

// Which images are this rank's part of the next global batch of world*B: rank*B .. rank*B+B-1,
// their shard indices, flips and labels; advances the cursor.
static void image_loader_pick(ImageLoader* L, int B, int rank, int world, int64_t* idx, int* flip, int* labels) {
    for (int b = 0; b < B; b++) {
        int64_t g = L->cursor + (int64_t)rank * B + b;
        idx[b] = image_loader_index(L, g);
        flip[b] = image_loader_flip(L, g);
        labels[b] = L->shard->labels[idx[b]];
    }
    L->cursor += (int64_t)world * B;
}

// Fills pixels [B, C, H, W] and labels [B] with this rank's images of the next global batch.
static void image_loader_next(ImageLoader* L, int B, int rank, int world, float* pixels, int* labels) {
    int64_t* idx = (int64_t*)xmalloc(sizeof(int64_t) * B);
    int* flip = (int*)xmalloc(sizeof(int) * B);
    image_loader_pick(L, B, rank, world, idx, flip, labels);
    int64_t per = (int64_t)L->C * L->H * L->W;
#pragma omp parallel for schedule(static)
    for (int b = 0; b < B; b++) image_loader_convert(L, idx[b], flip[b], pixels + b * per);
    free(idx);
    free(flip);
}

// The shard's raw images idx[0..B) (uint8, [sH, sW, sC] each) packed into raw: what a GPU resizes
// and normalises itself (llmc/cuda/misc.cuh image_resize_normalize_cuda, the same arithmetic).
static void image_loader_gather(const ImageLoader* L, const int64_t* idx, int B, uint8_t* raw) {
    const ImageShard* s = L->shard;
    int64_t per = (int64_t)s->H * s->W * s->C;
#pragma omp parallel for schedule(static)
    for (int b = 0; b < B; b++) memcpy(raw + b * per, s->pixels + idx[b] * per, per);
}

// Images [start, start+count) in file order, unflipped (evaluation).
static void image_loader_range(const ImageLoader* L, int64_t start, int count, float* pixels, int* labels) {
    int64_t per = (int64_t)L->C * L->H * L->W;
    for (int b = 0; b < count; b++) labels[b] = L->shard->labels[start + b];
#pragma omp parallel for schedule(static)
    for (int b = 0; b < count; b++) image_loader_convert(L, start + b, 0, pixels + b * per);
}
