// vit_data.h: what a ViT run reads besides the model (VitData): the image shards and their loaders
// (llmc/vision/imagedata.h), opened from the flags with the head's class count taken from them (or
// from --classes, the checkpoint's head or the adapter's), and closed again.
#pragma once
#include "../common.h"
#include "../vision/imagedata.h"
#include "../vision/preprocessor.h"
#include "../formats/peft.h"
#include "../train/run_options.h"
#include "vit.h"
#include "vit_checkpoint.h"

typedef struct {           // what a run reads besides the model
    ImageShard train, val;
    ImageLoader tl, vl;
    int have_train, have_val;
} VitData;

// Opens the shards (the head's class count must cover their labels) and their loaders.
static void vit_data_open(VitData* rd, const TrainOptions* o, const VitConfig* c, int h, int w, int* classes) {
    memset(rd, 0, sizeof(*rd));
    if (o->data_path) { image_shard_load(&rd->train, o->data_path); rd->have_train = 1; }
    if (o->val_path) { image_shard_load(&rd->val, o->val_path); rd->have_val = 1; }
    *classes = o->classes ? o->classes : rd->have_train ? rd->train.classes : rd->val.classes;
    // --eval-only of a model directory: the head it carries says (an export of a 7-class head reloads as one)
    int carried = o->eval_only && !o->classes && !o->adapter_dir ? vit_checkpoint_head_rows(o->model_dir) : 0;
    if (carried) *classes = carried;
    // --export-merged alone: the adapter's head says
    if (*classes == 0 && o->adapter_dir) *classes = peft_saved_module_rows(o->adapter_dir, vit_hf_head);
    if (*classes <= 0)
        fail("flag --classes: give the head's class count (no --data, --val or adapter head to take it from)");
    if (*classes == 1 && !o->classes)
        fail("%s: the header says 1 class; a 1-class head's loss is 0 by construction, nothing to learn; give "
             "--classes N (N >= 2) or a shard of 2 or more classes", rd->have_train ? o->data_path : o->val_path);
    if (rd->have_train && rd->train.classes > *classes)
        fail("%s: the shard has %d classes, more than --classes %d", o->data_path, rd->train.classes, *classes);
    if (rd->have_val && rd->val.classes > *classes)
        fail("%s: the shard has %d classes, more than the head's %d", o->val_path, rd->val.classes, *classes);
    if (rd->have_train) vit_preprocessor_check_images(&c->pre, o->data_path, rd->train.H, rd->train.W);
    if (rd->have_val) vit_preprocessor_check_images(&c->pre, o->val_path, rd->val.H, rd->val.W);
    if (rd->have_train)
        image_loader_init(&rd->tl, &rd->train, h, w, c->channels, c->mean, c->std, (uint64_t)o->seed, 1, o->hflip);
    if (rd->have_val) image_loader_init(&rd->vl, &rd->val, h, w, c->channels, c->mean, c->std, (uint64_t)o->seed, 0, 0);
}

// The largest source image of the open shards, in bytes (what the GPU's raw-image buffer holds).
static int64_t vit_data_src_bytes(const VitData* rd) {
    int64_t m = 0;
    if (rd->have_train) m = (int64_t)rd->train.H * rd->train.W * rd->train.C;
    if (rd->have_val && (int64_t)rd->val.H * rd->val.W * rd->val.C > m) m = (int64_t)rd->val.H * rd->val.W * rd->val.C;
    return m;
}

static void vit_data_close(VitData* rd) {
    if (rd->have_train) { image_loader_free(&rd->tl); image_shard_free(&rd->train); }
    if (rd->have_val) { image_loader_free(&rd->vl); image_shard_free(&rd->val); }
}
