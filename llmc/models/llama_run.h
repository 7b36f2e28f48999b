// llama_run.h: a LLaMA run's state as the driver's operations (train_llama.cu, llmc/train/run.h's
// ModelOps) share it -- the config and modes from the flags, the model and the baseline beside it,
// the data (llmc/models/llama_data.h), generation's tokenizer and prompt -- and its plan: the
// model at the run's shape with auto's choices fitted to the memory, checked against it.
#pragma once
#include "llama.h"
#include "llama_plan.h"
#include "llama_data.h"
#include "llama_pref.h"
#include "../text/model_tokenizer.h"
#include "../train/fit.h"

// The run's state (llmc/train/run.h's `void* run`): the config and modes from the flags, the
// model and the baseline planned beside it, the data, and generation's tokenizer and prompt.
typedef struct {
    LlamaConfig cfg;
    TrainModes md;         // as the flags give them
    TrainModes fitted;     // auto's choices fitted to the memory (llama_fit_to_memory)
    size_t avail;          // the memory they were fitted to (--mem-limit where that is less)
    int B, T;              // the planned micro-batch (generation alone: one sequence)
    Llama m, base;
    LlamaData rd;
    PrefObjective po;      // --objective (sft: unused)
    RefTable ref, val_ref;  // --ref-logps precompute (DPO): the training and validation pairs', else empty
    ModelTokenizer tok;
    char* chat_prompt;
} LlamaRun;

// auto's choices fitted to r->avail: --recompute auto (asked, or the default where the run would not
// fit otherwise: fit_recompute_auto) first, then the rest (llama_fit_to_memory). A --mem-limit that
// not even auto's smallest plan fits is refused in one line naming that plan's size; where the
// default auto does not fit either, the flags as given go to the fit check, which says what would.
static void llama_run_fit(LlamaRun* r, const TrainOptions* o, const Backend* be, const Dist* dist) {
    TrainModes md = r->md;
    if (fit_recompute_auto(o)) md.recompute = RECOMPUTE_AUTO;
    TrainModes least = llama_smallest_choices(md, r->B, r->T, dist);
    size_t smallest = llama_modes_plan_bytes(&r->cfg, &least, r->B, r->T, be, dist);
    char what[96];
    snprintf(what, sizeof(what), "recompute %d of %d blocks, auto's smallest choices",
             train_recomputed_blocks(&least, r->cfg.layers), r->cfg.layers);
    fit_refuse_mem_limit(o, smallest, smallest, what);
    if (md.recompute == RECOMPUTE_AUTO && smallest > r->avail && strcmp(o->recompute, "auto") != 0) md = r->md;
    r->fitted = llama_fit_to_memory(&r->cfg, md, r->B, r->T, be, dist, r->avail);
}

// The model at the run's shape with auto's choices fitted to the memory, checked against it (on
// either backend, before any allocation), and the baseline beside it.
static void llama_run_plan(void* run, const TrainOptions* o, const Backend* be, const Dist* dist) {
    LlamaRun* r = (LlamaRun*)run;
    int sized = o->data_path || o->eval_only;  // generation alone needs one sequence
    r->B = sized ? o->batch : 1;
    r->T = sized ? o->seq : (r->cfg.max_seq < 256 ? r->cfg.max_seq : 256);
    if (o->generate)  // a prompt longer than the window would be cut to its last half: refused instead
        model_tokenizer_check_prompt(&r->tok, r->chat_prompt ? r->chat_prompt : o->prompt, o->chat, r->T,
                                     sized ? "--seq" : "the generation window: max_position_embeddings, at most 256");
    // --recompute auto, then --mlp-tile auto: the fewest blocks, the largest tile that fit the memory
    // the fit check checks against
    r->avail = fit_run_avail(be, o, dist->local_size);
    llama_run_fit(r, o, be, dist);
    llama_setup(&r->m, &r->cfg, &r->fitted, r->B, r->T, be, dist);
    TrainOptions planned = *o;
    planned.batch = r->B;
    LlamaPlanCtx pc = {&r->cfg, be, dist, r->T, r->avail};
    fit_check_plan(be, &r->m.plan, llama_plan_bytes, &pc, &planned, dist->world, dist->local_size);
    TrainModes bm = train_baseline_modes(r->md);
    llama_setup(&r->base, &r->cfg, &bm, r->B, r->T, be, dist);
}
