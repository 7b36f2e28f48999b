// preprocessor.h: a ViT checkpoint's preprocessor_config.json, read whole as transformers' image
// processors apply it (ViTImageProcessor, CLIPImageProcessor and their older *FeatureExtractor
// names), or refused in one line naming the key. Every key is one of three kinds:
//   pixel values  do_rescale / rescale_factor, do_normalize / image_mean / image_std: applied by the
//                 trainer's image loader (llmc/vision/imagedata.h): (x * rescale - mean) / std
//   geometry      do_resize / size (height x width, or shortest_edge) / resample, do_center_crop /
//                 crop_size: applied by data preparation (scripts/data/prepare_images.py
//                 --preprocessor, with PIL as transformers does). The trainer checks that each
//                 image of the shard is one on which they are the identity (already at the
//                 processor's output size), so that what it feeds the model is what the processor
//                 gives; any other image is refused, naming the key.
//   names         image_processor_type / feature_extractor_type (one of the processors above),
//                 processor_class, do_convert_rgb (grayscale shards are made RGB by the loader).
// A file that names no processor type and no geometry key holds normalisation alone: the images
// are then resized to the model's resolution by the loader (bilinear, llmc/vision/resample.h).
// image_mean / image_std: a list of one value per channel, or one number for all (a list of
// another length is refused, as transformers' normalize refuses it). Without the file: 0.5 / 0.5.
#pragma once
#include <math.h>
#include <string.h>
#include "../common.h"
#include "../formats/json.h"

typedef enum { PRE_VIT, PRE_CLIP } PreprocessorKind;

typedef struct {
    // on pixels / 255, what the loader takes: (x / 255 - mean) / std = (x * rescale - image_mean) / image_std
    float mean[3], std[3];
    int geometry;           // the file gives a resize or crop (the shard must be where they do nothing)
    int resize_h, resize_w; // do_resize to height x width, or 0
    int shortest_edge;      // do_resize of the shorter side to this, or 0
    int crop_h, crop_w;     // do_center_crop to height x width, or 0
    char path[512];         // the file, for messages
} VitPreprocessor;

enum { PRE_MAX_SIDE = 1 << 16 };

static const char* const pre_type_names[] = {"ViTImageProcessor", "ViTFeatureExtractor", "CLIPImageProcessor",
                                             "CLIPFeatureExtractor", NULL};
static const char* const pre_common_keys[] = {"image_processor_type", "feature_extractor_type", "processor_class",
                                              "do_resize", "size", "resample", "do_rescale", "rescale_factor",
                                              "do_normalize", "image_mean", "image_std", NULL};
static const char* const pre_clip_keys[] = {"do_center_crop", "crop_size", "do_convert_rgb", NULL};

static int pre_in(const char* const* list, const char* s) {
    for (int i = 0; list[i]; i++)
        if (strcmp(list[i], s) == 0) return 1;
    return 0;
}

// The processor the file names (image_processor_type, else feature_extractor_type); ViT when none.
static PreprocessorKind pre_kind(const Json* j, const char* path, int* named) {
    const char* keys[] = {"image_processor_type", "feature_extractor_type"};
    for (int k = 0; k < 2; k++) {
        const Json* v = json_get(j, keys[k]);
        if (!v) continue;
        if (v->type != JSON_STRING || !pre_in(pre_type_names, v->string))
            fail("%s: %s \"%s\" is not a processor train_vit applies exactly (expected ViTImageProcessor, "
                 "CLIPImageProcessor or their *FeatureExtractor names)",
                 path, keys[k], v->type == JSON_STRING ? v->string : "(not a string)");
        *named = 1;
        return strncmp(v->string, "CLIP", 4) == 0 ? PRE_CLIP : PRE_VIT;
    }
    *named = 0;
    return PRE_VIT;
}

typedef enum { ABSENT_IS_FALSE, ABSENT_IS_TRUE } PreDefault;  // a boolean key's value when it is absent

static int pre_bool(const Json* j, const char* key, PreDefault dflt, const char* path) {
    const Json* v = json_get(j, key);
    if (!v) return dflt == ABSENT_IS_TRUE;
    if (v->type != JSON_BOOL) fail("%s: %s must be true or false", path, key);
    return v->boolean;
}

// image_mean / image_std: n numbers, or one number for all n.
static void pre_channels(const Json* j, const char* key, int n, const char* path, float* out) {
    const Json* v = json_get(j, key);
    if (!v) return;
    if (v->type == JSON_NUMBER) {
        for (int i = 0; i < n; i++) out[i] = (float)v->number;
        return;
    }
    if (v->type != JSON_ARRAY || v->count != n)
        fail("%s: %s must be a list of %d numbers (one per channel) or one number, as transformers' normalize "
             "takes it",
             path, key, n);
    for (int i = 0; i < n; i++) {
        if (v->items[i].type != JSON_NUMBER) fail("%s: %s must be a list of %d numbers", path, key, n);
        out[i] = (float)v->items[i].number;
    }
}

static int pre_side(const Json* obj, const char* key, const char* what, const char* path) {
    const Json* v = json_get(obj, key);
    double x = v && v->type == JSON_NUMBER ? v->number : -1;
    if (x != floor(x) || x < 1 || x > PRE_MAX_SIDE)
        fail("%s: %s needs \"%s\", an integer in [1, %d]", path, what, key, PRE_MAX_SIDE);
    return (int)x;
}

// How a size dictionary may be given: height/width or an integer side (ViT's size, crop_size), or
// also shortest_edge, which an integer then means (CLIP's size).
typedef enum { SIZE_SQUARE_OR_HW, SIZE_EDGE_OR_HW } SizeRule;

// A size dictionary as transformers' get_size_dict reads it: {"height", "width"}, {"shortest_edge"},
// or one integer (by `rule`). Other keys are refused.
static void pre_size(const Json* j, const char* key, SizeRule rule, const char* path, int* h, int* w, int* edge) {
    int edge_ok = rule == SIZE_EDGE_OR_HW;
    const Json* v = json_get(j, key);
    *h = *w = *edge = 0;
    if (v->type == JSON_NUMBER) {
        int s = pre_side(j, key, key, path);
        if (edge_ok) *edge = s;
        else *h = *w = s;
        return;
    }
    if (v->type != JSON_OBJECT) fail("%s: %s must be an integer or a dictionary", path, key);
    for (int i = 0; i < v->count; i++)
        if (strcmp(v->keys[i], "height") && strcmp(v->keys[i], "width") &&
            (!edge_ok || strcmp(v->keys[i], "shortest_edge")))
            fail("%s: %s.%s is not applied by train_vit (expected %s)", path, key, v->keys[i],
                 edge_ok ? "height and width, or shortest_edge" : "height and width");
    if (json_get(v, "shortest_edge") && v->count == 1) {
        *edge = pre_side(v, "shortest_edge", key, path);
        return;
    }
    *h = pre_side(v, "height", key, path);
    *w = pre_side(v, "width", key, path);
    if (v->count != 2) fail("%s: %s must hold height and width, or shortest_edge alone", path, key);
}

// The resize and crop (the geometry keys), with the processor's defaults where a key is absent.
static void pre_geometry(VitPreprocessor* p, const Json* j, PreprocessorKind kind, const char* path) {
    const Json* r = json_get(j, "resample");
    if (r && (r->type != JSON_NUMBER || r->number != floor(r->number) || r->number < 0 || r->number > 5))
        fail("%s: resample must be one of PIL's filters 0-5", path);
    if (pre_bool(j, "do_resize", ABSENT_IS_TRUE, path)) {
        SizeRule rule = kind == PRE_CLIP ? SIZE_EDGE_OR_HW : SIZE_SQUARE_OR_HW;
        if (json_get(j, "size")) pre_size(j, "size", rule, path, &p->resize_h, &p->resize_w, &p->shortest_edge);
        else if (kind == PRE_CLIP) p->shortest_edge = 224;
        else p->resize_h = p->resize_w = 224;
    }
    if (pre_bool(j, "do_center_crop", kind == PRE_CLIP ? ABSENT_IS_TRUE : ABSENT_IS_FALSE, path)) {
        int edge = 0;
        if (json_get(j, "crop_size")) pre_size(j, "crop_size", SIZE_SQUARE_OR_HW, path, &p->crop_h, &p->crop_w, &edge);
        else p->crop_h = p->crop_w = 224;
    }
    if (p->shortest_edge && !p->crop_h)
        fail("%s: size.shortest_edge without do_center_crop gives each image its own size; train_vit needs one", path);
}

// Reads model_dir/preprocessor_config.json (when there is one) for a model of `channels` channels.
static void vit_preprocessor_load(VitPreprocessor* p, const char* model_dir, int channels) {
    memset(p, 0, sizeof(*p));
    for (int i = 0; i < 3; i++) { p->mean[i] = 0.5f; p->std[i] = 0.5f; }
    char* path = path_join(model_dir, "preprocessor_config.json");
    snprintf(p->path, sizeof(p->path), "%s", path);
    if (!optional_file_exists(path)) { free(path); return; }
    size_t n;
    char* text = read_file(path, &n);
    Json j = json_parse(text, n, path);
    if (j.type != JSON_OBJECT) fail("%s: expected a JSON object", path);
    int named;
    PreprocessorKind kind = pre_kind(&j, path, &named);
    for (int i = 0; i < j.count; i++)
        if (!pre_in(pre_common_keys, j.keys[i]) && !(kind == PRE_CLIP && pre_in(pre_clip_keys, j.keys[i])))
            fail("%s: key \"%s\" is not applied by train_vit (%s reads: do_resize, size, resample, do_rescale, "
                 "rescale_factor, do_normalize, image_mean, image_std%s)",
                 path, j.keys[i], kind == PRE_CLIP ? "CLIPImageProcessor" : "ViTImageProcessor",
                 kind == PRE_CLIP ? ", do_center_crop, crop_size, do_convert_rgb" : "");
    float mean[3] = {0.5f, 0.5f, 0.5f}, std[3] = {0.5f, 0.5f, 0.5f};
    if (kind == PRE_CLIP) {  // transformers' OPENAI_CLIP_MEAN / OPENAI_CLIP_STD
        const float cm[3] = {0.48145466f, 0.4578275f, 0.40821073f}, cs[3] = {0.26862954f, 0.26130258f, 0.27577711f};
        memcpy(mean, cm, sizeof(mean));
        memcpy(std, cs, sizeof(std));
    }
    pre_channels(&j, "image_mean", channels, path, mean);
    pre_channels(&j, "image_std", channels, path, std);
    if (!pre_bool(&j, "do_normalize", ABSENT_IS_TRUE, path))
        for (int c = 0; c < 3; c++) { mean[c] = 0.0f; std[c] = 1.0f; }
    pre_bool(&j, "do_convert_rgb", ABSENT_IS_TRUE, path);  // checked only: the loader makes grayscale RGB
    double rescale = 1.0;
    if (pre_bool(&j, "do_rescale", ABSENT_IS_TRUE, path))
        rescale = json_number_opt(&j, "rescale_factor", path, 1.0 / 255);
    if (!(rescale > 0) || !isfinite(rescale)) fail("%s: rescale_factor must be a positive number", path);
    for (int c = 0; c < channels; c++) {
        if (!(std[c] > 0) || !isfinite(std[c]) || !isfinite(mean[c]))
            fail("%s: image_std must be positive and image_mean finite", path);
        p->mean[c] = (float)(mean[c] / (255.0 * rescale));  // (x r - m) / s = (x / 255 - m / (255 r)) / (s / (255 r))
        p->std[c] = (float)(std[c] / (255.0 * rescale));
    }
    static const char* const geometry_keys[] = {"do_resize", "size", "resample", "do_center_crop", "crop_size", NULL};
    p->geometry = named;
    for (int i = 0; i < j.count; i++) p->geometry |= pre_in(geometry_keys, j.keys[i]);
    if (p->geometry) pre_geometry(p, &j, kind, path);
    json_free(&j);
    free(text);
    free(path);
}

// Refuses, naming the key, a shard whose H x W images the processor's geometry would change: each
// resize and crop must be the identity on them (prepared by prepare_images.py --preprocessor). What
// the loader then feeds the model is the processor's output, or, at another resolution (--image-size,
// or a model directory trained at one), that output resized by the loader's bilinear rule.
static void vit_preprocessor_check_images(const VitPreprocessor* p, const char* shard, int H, int W) {
    if (!p->geometry) return;
    if (p->resize_h && (H != p->resize_h || W != p->resize_w))
        fail("%s: size %dx%d resizes %s's %dx%d images, which train_vit does not do as transformers does: prepare the "
             "shard with scripts/data/prepare_images.py --preprocessor",
             p->path, p->resize_h, p->resize_w, shard, H, W);
    if (p->shortest_edge && (H < W ? H : W) != p->shortest_edge)
        fail("%s: size.shortest_edge %d resizes %s's %dx%d images, which train_vit does not do as transformers does: "
             "prepare the shard with scripts/data/prepare_images.py --preprocessor",
             p->path, p->shortest_edge, shard, H, W);
    if (p->crop_h && (H != p->crop_h || W != p->crop_w))
        fail("%s: crop_size %dx%d crops %s's %dx%d images, which train_vit does not do: prepare the shard with "
             "scripts/data/prepare_images.py --preprocessor",
             p->path, p->crop_h, p->crop_w, shard, H, W);
}
