// vit_checkpoint.h: the ViT checkpoints train_vit reads and writes, in either layout:
//   Hugging Face  ViTForImageClassification (vit.embeddings..., vit.encoder.layer.N..., classifier.*)
//                 or ViTModel (the same without the "vit." prefix)
//   timm          cls_token, pos_embed, blocks.N (q, k, v fused into attn.qkv), head.*
// It defines which layout a checkpoint has (vit_detect_layout), the name of each of its tensors,
// the reading of a block's linear in either layout (timm's fused rows split), and the merged
// export (--export-merged, and the output of --full, vit_write_merged): the input checkpoint, its
// tensor names and dtypes, rewritten with what training changed and the new head, and its
// config.json with the head's class count. The export asks the trained model for its values
// through VitExportSource, so this file knows the layouts and nothing of llmc/models/vit.h's types.
#pragma once
#include <string.h>
#include "../common.h"
#include "../formats/json.h"
#include "../formats/safetensors.h"

// ---- the tensors of a checkpoint ------------------------------------------------------------

// The linears of a block from VIT_Q on (llmc/models/vit.h's targets, in this order), and timm's fused
// q, k, v: one [3d, d] linear whose rows are q's, then k's, then v's.
enum { VIT_QKV = -1, VIT_Q, VIT_K, VIT_V, VIT_PROJ, VIT_FC1, VIT_FC2, VIT_LINEARS };
// The LayerNorm vectors of a block: before attention (gamma, beta), before the MLP.
enum { VIT_LN1_G, VIT_LN1_B, VIT_LN2_G, VIT_LN2_B, VIT_BLOCK_NORMS };
// The tensors outside the blocks; the head comes last.
typedef enum { VIT_CLS, VIT_POS, VIT_PATCH_W, VIT_PATCH_B, VIT_NORM_G, VIT_NORM_B, VIT_HEAD_W, VIT_HEAD_B,
               VIT_TENSORS } VitTensor;
typedef enum { VIT_WEIGHT, VIT_BIAS, VIT_PARTS } VitPart;
enum { VIT_NAME_BYTES = 256 };  // a tensor name's buffer

// Hugging Face's classifier module, which PEFT saves whole (modules_to_save).
static const char* const vit_hf_head = "classifier";

static const char* const vit_hf_modules[VIT_LINEARS] = {
    "attention.attention.query", "attention.attention.key", "attention.attention.value", "attention.output.dense",
    "intermediate.dense", "output.dense"};
static const char* const vit_timm_modules[VIT_LINEARS] = {"attn.qkv", "attn.qkv", "attn.qkv", "attn.proj", "mlp.fc1",
                                                          "mlp.fc2"};
static const char* const vit_hf_norms[VIT_BLOCK_NORMS] = {"layernorm_before.weight", "layernorm_before.bias",
                                                          "layernorm_after.weight", "layernorm_after.bias"};
static const char* const vit_timm_norms[VIT_BLOCK_NORMS] = {"norm1.weight", "norm1.bias", "norm2.weight",
                                                            "norm2.bias"};
// Hugging Face's names follow the prefix, except the classifier's: it sits beside the "vit." body.
static const char* const vit_hf_tensors[VIT_TENSORS] = {
    "embeddings.cls_token", "embeddings.position_embeddings", "embeddings.patch_embeddings.projection.weight",
    "embeddings.patch_embeddings.projection.bias", "layernorm.weight", "layernorm.bias", "classifier.weight",
    "classifier.bias"};
static const char* const vit_timm_tensors[VIT_TENSORS] = {
    "cls_token", "pos_embed", "patch_embed.proj.weight", "patch_embed.proj.bias", "norm.weight", "norm.bias",
    "head.weight", "head.bias"};

typedef enum { VIT_LAYOUT_HF, VIT_LAYOUT_TIMM } VitLayout;

typedef struct {
    VitLayout layout;
    const char* prefix;    // Hugging Face: "vit." (ViTForImageClassification) or "" (ViTModel); timm: ""
} VitCheckpoint;

// The layout, told apart by the class token's name. A timm model that pools the patches (fc_norm)
// instead of reading the class token is refused.
static VitCheckpoint vit_detect_layout(const StModel* sm) {
    VitCheckpoint ck = {VIT_LAYOUT_HF, "vit."};
    if (st_model_find(sm, "vit.embeddings.cls_token")) return ck;
    ck.prefix = "";
    if (st_model_find(sm, "embeddings.cls_token")) return ck;
    ck.layout = VIT_LAYOUT_TIMM;
    if (st_model_find(sm, "cls_token")) {
        if (st_model_find(sm, "fc_norm.weight"))
            fail("%s: timm checkpoint with fc_norm (global average pooling) is not supported; "
                 "expected a class-token ViT", sm->dir);
        return ck;
    }
    fail("%s: checkpoint is neither a Hugging Face ViT (vit.embeddings.cls_token) nor a timm ViT (cls_token)", sm->dir);
    return ck;
}

static int vit_fuses_qkv(const VitCheckpoint* ck) { return ck->layout == VIT_LAYOUT_TIMM; }

// The name of a tensor outside the blocks, into name [VIT_NAME_BYTES]; returns name.
static const char* vit_tensor_name(char* name, const VitCheckpoint* ck, VitTensor which) {
    int head = which >= VIT_HEAD_W;
    if (vit_fuses_qkv(ck)) snprintf(name, VIT_NAME_BYTES, "%s", vit_timm_tensors[which]);
    else snprintf(name, VIT_NAME_BYTES, "%s%s", head ? "" : ck->prefix, vit_hf_tensors[which]);
    return name;
}

// The class count of the head a model directory carries (classifier.* or head.*: its weight's
// rows; an --export-merged or --full output has the trained one), or 0 when it has none.
static int vit_checkpoint_head_rows(const char* dir) {
    StModel sm;
    st_model_open(&sm, dir);
    VitCheckpoint ck = vit_detect_layout(&sm);
    char wn[VIT_NAME_BYTES];
    vit_tensor_name(wn, &ck, VIT_HEAD_W);
    const StTensor* t = st_model_find(&sm, wn);
    int rows = t && t->ndim == 2 && t->shape[0] > 0 && t->shape[0] <= (1 << 24) ? (int)t->shape[0] : 0;
    st_model_close(&sm);
    return rows;
}

// The name of LayerNorm vector `which` (VIT_LN1_G ...) of block `layer`; returns name.
static const char* vit_norm_name(char* name, const VitCheckpoint* ck, int layer, int which) {
    if (vit_fuses_qkv(ck)) snprintf(name, VIT_NAME_BYTES, "blocks.%d.%s", layer, vit_timm_norms[which]);
    else snprintf(name, VIT_NAME_BYTES, "%sencoder.layer.%d.%s", ck->prefix, layer, vit_hf_norms[which]);
    return name;
}

// The name of the weight or bias of linear `linear` of block `layer` (VIT_QKV: timm's fused one;
// timm's q, k and v name it too); returns name.
static const char* vit_linear_name(char* name, const VitCheckpoint* ck, int layer, int linear, VitPart part) {
    const char* what = part == VIT_BIAS ? "bias" : "weight";
    if (vit_fuses_qkv(ck)) {
        const char* module = linear == VIT_QKV ? "attn.qkv" : vit_timm_modules[linear];
        snprintf(name, VIT_NAME_BYTES, "blocks.%d.%s.%s", layer, module, what);
    } else {
        if (linear == VIT_QKV) fail("internal: a Hugging Face ViT has no fused qkv");
        snprintf(name, VIT_NAME_BYTES, "%sencoder.layer.%d.%s.%s", ck->prefix, layer, vit_hf_modules[linear], what);
    }
    return name;
}

// Rows [first, first + n) of tensor `name` (shape [rows, cols], or [rows] when cols is 0) into dst,
// fp32, checked as st_model_read_f32 checks.
static void vit_read_rows(const StModel* sm, const char* name, int64_t rows, int64_t cols, int64_t first, int64_t n,
                          float* dst) {
    int64_t shape[2] = {rows, cols}, width = cols ? cols : 1;
    float* all = rows == n ? dst : (float*)xmalloc(sizeof(float) * rows * width);
    st_model_read_f32(sm, name, cols ? 2 : 1, shape, all);
    if (all == dst) return;
    memcpy(dst, all + first * width, sizeof(float) * n * width);
    free(all);
}

// Linear `linear` of block `layer` as the model uses it: W [out, in] (unless W is NULL) and b
// [out], fp32. timm's fused q, k, v give each its rows. q, k, v without a bias read as zeros: a
// timm qkv that has none, and every Hugging Face one when config.json's qkv_bias is false (a
// stored one is then ignored, as transformers ignores it).
static void vit_read_linear(const StModel* sm, const VitCheckpoint* ck, int layer, int linear, int qkv_bias,
                            int64_t out, int64_t in, float* W, float* b) {
    int qkv = linear <= VIT_V, fused = qkv && vit_fuses_qkv(ck);
    int64_t rows = fused ? 3 * out : out, first = fused ? linear * out : 0;
    char name[VIT_NAME_BYTES];
    if (W) vit_read_rows(sm, vit_linear_name(name, ck, layer, linear, VIT_WEIGHT), rows, in, first, out, W);
    vit_linear_name(name, ck, layer, linear, VIT_BIAS);
    int no_bias = qkv && (fused ? !st_model_find(sm, name) : !qkv_bias);
    if (no_bias) memset(b, 0, sizeof(float) * out);
    else vit_read_rows(sm, name, rows, 0, first, out, b);
}

// ---- the merged export ----------------------------------------------------------------------
// The input checkpoint with every tensor that training changed rewritten in the original model's
// terms (by the trained model: VitExportSource), and the trained head as its classifier
// (classifier.* / head.*, with the new class count, in the checkpoint head's dtype); every other
// tensor unchanged. q, k, v that the checkpoint has no bias for get one when the trained model
// says they need it (MS-LN mapped back gives them one). config.json: the input's, with num_labels
// and qkv_bias as they now are, and image_size when trained positions changed the resolution.

// What the export asks of the trained model, fp32 on the host, in the original model's terms.
typedef struct {
    const void* model;                     // passed to the callbacks
    int layers, dim, classes;
    int qkv_bias;                          // config.json's qkv_bias (false: stored q, k, v biases are ignored)
    const float* trained[VIT_TENSORS];     // the trained value of each tensor outside the blocks, NULL where
                                           // the checkpoint's stays; the head's are always given
    int positions;                         // rows of trained[VIT_POS] (1 + the fine-tuning grid)
    int image_h, image_w;                  // the resolution of trained positions when it differs from
                                           // config.json's, else 0
    // the trained LayerNorm vector `which` of block `layer`, or NULL where the checkpoint's stays
    const float* (*trained_norm)(const void* model, int layer, int which);
    // did training change this linear (an adapter, or a trained W)?
    int (*linear_changed)(const void* model, int layer, int linear);
    // v holds the checkpoint's weight [out, in] or bias [out] of the linear (zeros where it has none):
    // replaced by the trained model's
    void (*linear_export)(const void* model, int layer, int linear, VitPart part, float* v);
    // do q, k, v of block `layer` need a bias now, whether or not the checkpoint has one?
    int (*qkv_bias_needed)(const void* model, int layer);
} VitExportSource;

enum { VIT_NOT_A_LINEAR = -1 };

// A tensor name the export may rewrite, with what it is: a linear's weight or bias (its block,
// the linear, VIT_QKV for timm's fused one, and the part), or a trained tensor that is no linear's
// (layer VIT_NOT_A_LINEAR).
typedef struct {
    char name[VIT_NAME_BYTES];
    int layer, linear;
    VitPart part;
    const float* trained;    // no linear's: its trained value
} VitExportName;

typedef struct {
    const VitExportSource* src;
    const StModel* sm;
    VitCheckpoint ck;
    VitExportName* names;    // every tensor name the export may rewrite, built once
    int nnames, cap_names;
    StWriter w;
    void** owned;            // the tensors converted for the writer, freed after the save
    int nowned, cap_owned;
} VitExport;

// A new entry of the table (zeroed), to be named by the caller.
static VitExportName* vit_export_name_new(VitExport* x) {
    if (x->nnames == x->cap_names) fail("internal: the export name table is full");
    return &x->names[x->nnames++];
}

static char* vit_export_name_trained(VitExport* x, const float* trained) {
    VitExportName* e = vit_export_name_new(x);
    e->layer = VIT_NOT_A_LINEAR;
    e->trained = trained;
    return e->name;
}

static char* vit_export_name_linear(VitExport* x, int layer, int linear, VitPart part) {
    VitExportName* e = vit_export_name_new(x);
    e->layer = layer;
    e->linear = linear;
    e->part = part;
    return e->name;
}

// The table: the trained tensors outside the blocks (the head is written apart: its class count is
// new), then block by block its trained norms and each linear's weight and bias.
static void vit_export_names(VitExport* x) {
    const VitExportSource* s = x->src;
    x->cap_names = s->layers * (VIT_BLOCK_NORMS + VIT_PARTS * (VIT_LINEARS + 1)) + VIT_TENSORS;
    x->names = (VitExportName*)xcalloc(x->cap_names, sizeof(VitExportName));
    for (int k = VIT_CLS; k < VIT_HEAD_W; k++)
        if (s->trained[k]) vit_tensor_name(vit_export_name_trained(x, s->trained[k]), &x->ck, (VitTensor)k);
    int fused = vit_fuses_qkv(&x->ck);
    for (int l = 0; l < s->layers; l++) {
        for (int k = 0; k < VIT_BLOCK_NORMS; k++) {
            const float* v = s->trained_norm(s->model, l, k);
            if (v) vit_norm_name(vit_export_name_trained(x, v), &x->ck, l, k);
        }
        for (int t = fused ? VIT_QKV : VIT_Q; t < VIT_LINEARS; t++) {
            if (fused && t >= VIT_Q && t <= VIT_V) continue;  // named by the fused one
            for (int p = VIT_WEIGHT; p < VIT_PARTS; p++)
                vit_linear_name(vit_export_name_linear(x, l, t, (VitPart)p), &x->ck, l, t, (VitPart)p);
        }
    }
}

static const VitExportName* vit_export_name_find(const VitExport* x, const char* name) {
    for (int i = 0; i < x->nnames; i++)
        if (!strcmp(x->names[i].name, name)) return &x->names[i];
    return NULL;
}

// The linears a tensor holds: `linear` alone, or q, k and v for timm's fused one.
static int vit_span_first(int linear) { return linear == VIT_QKV ? VIT_Q : linear; }
static int vit_span_last(int linear) { return linear == VIT_QKV ? VIT_V : linear; }

static int vit_export_changed(const VitExport* x, const VitExportName* e) {
    int changed = 0;
    for (int t = vit_span_first(e->linear); t <= vit_span_last(e->linear); t++)
        changed |= x->src->linear_changed(x->src->model, e->layer, t);
    return changed;
}

// Adds tensor `name` of the given shape, converted from fp32 v to dtype dt.
static void vit_export_put(VitExport* x, const char* name, StDtype dt, int ndim, const int64_t* shape, const float* v) {
    int64_t numel = 1;
    for (int i = 0; i < ndim; i++) numel *= shape[i];
    if (x->nowned == x->cap_owned) fail("internal: the export's tensor list is full");
    void* data = xmalloc(st_dtype_size(dt) * numel);
    f32_to_dtype(data, v, numel, dt);
    x->owned[x->nowned++] = data;
    st_writer_add(&x->w, name, dt, ndim, shape, data);
}

// A tensor outside the linears that training changed; the positions at the fine-tuning grid ([1, T,
// d]: config.json's image_size follows).
static void vit_export_trained(VitExport* x, const StTensor* t, const VitExportName* e) {
    int64_t pos_shape[3] = {1, x->src->positions, x->src->dim};
    if (e->trained == x->src->trained[VIT_POS]) vit_export_put(x, t->name, t->dtype, 3, pos_shape, e->trained);
    else vit_export_put(x, t->name, t->dtype, t->ndim, t->shape, e->trained);
}

// A linear's weight or bias that training changed; the parts of timm's fused q, k, v that it did
// not change stay as they are.
static void vit_export_linear(VitExport* x, const StTensor* t, const VitExportName* e) {
    const VitExportSource* s = x->src;
    int first = vit_span_first(e->linear), last = vit_span_last(e->linear);
    int64_t numel = st_numel(t), per = numel / (last - first + 1);
    float* v = (float*)xmalloc(sizeof(float) * numel);
    st_to_f32(t, v);
    for (int lin = first; lin <= last; lin++)
        if (s->linear_changed(s->model, e->layer, lin))
            s->linear_export(s->model, e->layer, lin, e->part, v + (lin - first) * per);
    vit_export_put(x, t->name, t->dtype, t->ndim, t->shape, v);
    free(v);
}

// Every tensor of the checkpoint but the head, in its order.
static void vit_export_tensors(VitExport* x) {
    char head_w[VIT_NAME_BYTES], head_b[VIT_NAME_BYTES];
    vit_tensor_name(head_w, &x->ck, VIT_HEAD_W);
    vit_tensor_name(head_b, &x->ck, VIT_HEAD_B);
    for (int f = 0; f < x->sm->nfiles; f++)
        for (int i = 0; i < x->sm->files[f].count; i++) {
            const StTensor* t = &x->sm->files[f].tensors[i];
            if (!strcmp(t->name, head_w) || !strcmp(t->name, head_b)) continue;
            const VitExportName* e = vit_export_name_find(x, t->name);
            if (e && e->trained) vit_export_trained(x, t, e);
            else if (e && vit_export_changed(x, e)) vit_export_linear(x, t, e);
            else st_writer_add(&x->w, t->name, t->dtype, t->ndim, t->shape, t->data);
        }
}

// The q, k, v biases that the checkpoint lacks and the trained model needs (in the dtype of their
// weights). Returns whether every q, k, v of the output has a bias (config.json's qkv_bias).
static int vit_export_qkv_biases(VitExport* x) {
    const VitExportSource* s = x->src;
    int hf = !vit_fuses_qkv(&x->ck), all = 1, qkv = hf ? VIT_Q : VIT_QKV;
    int64_t d = s->dim, fused_rows = 3 * d;
    char name[VIT_NAME_BYTES];
    for (int l = 0; l < s->layers; l++) {
        int need = s->qkv_bias_needed(s->model, l);
        // a stored Hugging Face q bias is ignored without qkv_bias (and then was written only if rewritten)
        if (st_model_find(x->sm, vit_linear_name(name, &x->ck, l, qkv, VIT_BIAS)) && (!hf || s->qkv_bias || need))
            continue;
        if (!need) { all = 0; continue; }
        const StTensor* wt = st_model_find(x->sm, vit_linear_name(name, &x->ck, l, qkv, VIT_WEIGHT));
        StDtype dt = wt ? wt->dtype : ST_F32;
        float* b = (float*)xcalloc(fused_rows, sizeof(float));
        for (int t = VIT_Q; t <= VIT_V; t++)
            if (s->linear_changed(s->model, l, t)) s->linear_export(s->model, l, t, VIT_BIAS, b + t * d);
        if (hf) {
            for (int t = VIT_Q; t <= VIT_V; t++)
                vit_export_put(x, vit_linear_name(name, &x->ck, l, t, VIT_BIAS), dt, 1, &d, b + t * d);
        } else {
            vit_export_put(x, vit_linear_name(name, &x->ck, l, VIT_QKV, VIT_BIAS), dt, 1, &fused_rows, b);
        }
        free(b);
    }
    return all;
}

// The trained head as the classifier, in the dtype of the checkpoint's (fp32 when it has none).
static void vit_export_head(VitExport* x) {
    const VitExportSource* s = x->src;
    char name[VIT_NAME_BYTES];
    const StTensor* old = st_model_find(x->sm, vit_tensor_name(name, &x->ck, VIT_HEAD_W));
    StDtype dt = old ? old->dtype : ST_F32;
    int64_t w_shape[2] = {s->classes, s->dim}, b_shape = s->classes;
    vit_export_put(x, name, dt, 2, w_shape, s->trained[VIT_HEAD_W]);
    vit_export_put(x, vit_tensor_name(name, &x->ck, VIT_HEAD_B), dt, 1, &b_shape, s->trained[VIT_HEAD_B]);
}

// config.json of the exported model: the input's, without id2label / label2id / num_labels /
// qkv_bias (and image_size when the positions were trained at another resolution), then those
// as they now are.
static void vit_export_config(const VitExportSource* s, const char* model_dir, const char* dir, int qkv_bias) {
    static const char* const rewritten[] = {"id2label", "label2id", "num_labels", "qkv_bias"};
    int resized = s->image_h > 0;
    char* src = path_join(model_dir, "config.json");
    size_t n;
    char* text = read_file(src, &n);
    Json j = json_parse(text, n, src);
    char* buf = NULL;
    size_t len = 0;
    FILE* f = open_memstream(&buf, &len);
    if (!f) fail("out of memory");
    fputs("{", f);
    int k = 0;
    for (int i = 0; i < j.count; i++) {
        const char* key = j.keys[i];
        int drop = resized && !strcmp(key, "image_size");
        for (size_t r = 0; r < sizeof(rewritten) / sizeof(rewritten[0]); r++) drop |= !strcmp(key, rewritten[r]);
        if (drop) continue;
        fprintf(f, "%s\n  ", k++ ? "," : "");
        json_write_string(f, key);
        fputs(": ", f);
        json_dump(f, &j.items[i], 2);
    }
    if (resized) fprintf(f, "%s\n  \"image_size\": [%d, %d]", k++ ? "," : "", s->image_h, s->image_w);
    fprintf(f, "%s\n  \"num_labels\": %d,\n  \"qkv_bias\": %s\n}\n", k ? "," : "", s->classes,
            qkv_bias ? "true" : "false");
    fclose(f);
    char* dst = path_join(dir, "config.json");
    AtomicFile a = atomic_open(dst);
    atomic_write(&a, buf, len);
    atomic_commit(&a);
    free(buf); free(dst); json_free(&j); free(text); free(src);
}

// Writes the merged model of the checkpoint in model_dir to dir: model.safetensors, config.json,
// and preprocessor_config.json as it is (when there is one).
static void vit_write_merged(const VitExportSource* s, const char* model_dir, const char* dir) {
    make_dirs(dir, "flag --export-merged");
    StModel sm;
    st_model_open(&sm, model_dir);
    VitExport x;
    memset(&x, 0, sizeof(x));
    x.src = s;
    x.sm = &sm;
    x.ck = vit_detect_layout(&sm);
    for (int f = 0; f < sm.nfiles; f++) x.cap_owned += sm.files[f].count;
    x.cap_owned += VIT_LINEARS * s->layers + VIT_PARTS;  // the q, k, v biases added, the head
    x.owned = (void**)xcalloc(x.cap_owned, sizeof(void*));
    vit_export_names(&x);
    vit_export_tensors(&x);
    int qkv_bias = vit_export_qkv_biases(&x);
    vit_export_head(&x);
    char* path = path_join(dir, "model.safetensors");
    st_writer_save(&x.w, path, "\"format\":\"pt\"");
    free(path);
    vit_export_config(s, model_dir, dir, qkv_bias);
    char* src = path_join(model_dir, "preprocessor_config.json");
    char* dst = path_join(dir, "preprocessor_config.json");
    if (file_exists(src)) copy_file_atomic(src, dst);
    free(src); free(dst);
    for (int i = 0; i < x.nowned; i++) free(x.owned[i]);
    free(x.owned); free(x.names);
    st_writer_free(&x.w);
    st_model_close(&sm);
}
