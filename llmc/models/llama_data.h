// llama_data.h: what a LLaMA run reads besides the model (LlamaData): the token shards and their
// loaders (llmc/text/textdata.h), or, under a preference objective (--objective dpo|orpo|simpo),
// the pair shards and theirs (llmc/text/pairdata.h); opened from the flags and closed again.
#pragma once
#include "../common.h"
#include "../text/textdata.h"
#include "../text/pairdata.h"
#include "../train/run_options.h"
#include "../train/preference.h"

typedef struct {           // what a run reads besides the model
    TokenShard train, val;
    TextLoader tl, vl;
    int have_train, have_val;
    int pairs;             // --objective dpo|orpo|simpo: pair shards (llmc/text/pairdata.h) instead
    PairShard ptrain, pval;
    PairLoader pl, pvl;
} LlamaData;

// A preference objective's pair shards; a pair shard given to sft refused in one line.
static void llama_pairs_open(LlamaData* rd, const TrainOptions* o, int vocab) {
    const char* paths[2] = {o->data_path, o->val_path};
    if (objective_of(o) == OBJ_SFT) {
        for (int i = 0; i < 2; i++)
            if (paths[i] && file_is_pair_shard(paths[i]))
                fail("%s: a pair shard (preference data), not a token shard; train on it with --objective "
                     "dpo|orpo|simpo", paths[i]);
        return;
    }
    rd->pairs = 1;
    if (o->data_path) {
        pair_shard_load(&rd->ptrain, o->data_path, vocab);
        pair_loader_init(&rd->pl, &rd->ptrain, o->seq, (uint64_t)o->seed, 1);
        rd->have_train = 1;
    }
    if (o->val_path) {
        pair_shard_load(&rd->pval, o->val_path, vocab);
        pair_loader_init(&rd->pvl, &rd->pval, o->seq, (uint64_t)o->seed, 0);
        rd->have_val = 1;
    }
}

static void llama_data_open(LlamaData* rd, const TrainOptions* o, int vocab) {
    memset(rd, 0, sizeof(*rd));
    llama_pairs_open(rd, o, vocab);
    if (rd->pairs) return;
    if (o->data_path) {
        shard_load(&rd->train, o->data_path, vocab);
        loader_init(&rd->tl, &rd->train, o->seq, (uint64_t)o->seed, 1);
        rd->have_train = 1;
    }
    if (o->val_path) {
        shard_load(&rd->val, o->val_path, vocab);
        loader_init(&rd->vl, &rd->val, o->seq, (uint64_t)o->seed, 0);
        loader_require_eval_targets(&rd->vl, o->batch, o->val_batches);
        rd->have_val = 1;
    }
}

static void llama_data_close(LlamaData* rd) {
    if (rd->pairs) {
        if (rd->have_train) { pair_loader_free(&rd->pl); pair_shard_free(&rd->ptrain); }
        if (rd->have_val) { pair_loader_free(&rd->pvl); pair_shard_free(&rd->pval); }
        return;
    }
    if (rd->have_train) { loader_free(&rd->tl); shard_free(&rd->train); }
    if (rd->have_val) { loader_free(&rd->vl); shard_free(&rd->val); }
}
