// train/preference.h: preference fine-tuning's objectives (--objective dpo|orpo|simpo, beside sft's
// next-token loss): their flags and checks, and the pair loss of one example from its sequences'
// log-probabilities, with the loss's gradient with respect to each sequence's summed
// log-probability. The model turns that gradient into each completion token's weight in the
// chunked LM-head loss (llmc/models/llama_pref.h), so the head's usual gradient, scaled per token,
// is the objective's. The losses are TRL's:
//   DPO   -(1-e) log s(z) - e log s(-z), z = beta [(pi(c) - ref(c)) - (pi(r) - ref(r))] (summed logps;
//         e = --dpo-label-smoothing, cDPO); rewards beta (pi - ref)
//   ORPO  NLL of the chosen completions (mean over their tokens) - beta log s(lo(c) - lo(r)),
//         lo(y) = m(y) - log(1 - exp(m(y))), m the length-averaged logp; rewards beta m
//   SimPO -log s(beta m(c) - beta m(r) - gamma); rewards beta m; no reference model
#pragma once
#include <math.h>
#include <string.h>
#include "../common.h"
#include "flags.h"
#include "run_options.h"

typedef enum { OBJ_SFT, OBJ_DPO, OBJ_ORPO, OBJ_SIMPO } Objective;

static Objective objective_of(const TrainOptions* o) {
    if (!strcmp(o->objective, "dpo")) return OBJ_DPO;
    if (!strcmp(o->objective, "orpo")) return OBJ_ORPO;
    if (!strcmp(o->objective, "simpo")) return OBJ_SIMPO;
    return OBJ_SFT;
}

// --beta's default where not given: TRL's (DPO and ORPO 0.1, SimPO 2.0).
static float objective_beta(const TrainOptions* o) {
    if (!isnan(o->beta)) return o->beta;
    return objective_of(o) == OBJ_SIMPO ? 2.0f : 0.1f;
}

// The flags, in the training group of both trainers (train_vit takes sft alone: preference_check).
static void preference_flags_register(FlagTable* t, TrainOptions* o) {
    o->objective = "sft";
    o->beta = NAN;
    o->simpo_gamma = 0.5f;
    o->ref_logps = "inline";
    t->group = "preference (pair shards, docs/formats.md)";
    flag_choice(t, "objective", &o->objective, "sft|dpo|orpo|simpo",
                "sft: next-token loss on a token shard; dpo, orpo, simpo: preference losses (TRL's) on a pair shard");
    flag_float(t, "beta", &o->beta,
               "dpo: the KL weight beta (default 0.1); orpo: lambda (default 0.1); simpo: beta (default 2.0)");
    flag_float(t, "dpo-label-smoothing", &o->dpo_label_smoothing,
               "dpo: the probability that a pair's labels are flipped (cDPO), in [0, 0.5) (default 0)");
    flag_float(t, "simpo-gamma", &o->simpo_gamma, "simpo: the target reward margin gamma (default 0.5)");
    flag_choice(t, "ref-logps", &o->ref_logps, "inline|precompute",
                "dpo: the reference log-probabilities (the base, adapters off) computed in each step (inline) or once "
                "over the data before training, stored in --out as ref_logps.bin (--val's: ref_logps_val.bin; "
                "precompute)");
}

// One-line refusals of what the objectives do not take.
static void preference_check(const TrainOptions* o, TrainTask task) {
    Objective k = objective_of(o);
    if (task != TRAIN_TEXT && k != OBJ_SFT)
        fail("flag --objective %s: train_vit trains classifiers with sft alone (preference objectives are "
             "train_llama's)", o->objective);
    if (!(objective_beta(o) > 0)) fail("flag --beta: expected > 0, got %g", objective_beta(o));
    if (!(o->dpo_label_smoothing >= 0 && o->dpo_label_smoothing < 0.5f))
        fail("flag --dpo-label-smoothing: expected a probability in [0, 0.5), got %g", o->dpo_label_smoothing);
    if (!isfinite(o->simpo_gamma)) fail("flag --simpo-gamma: expected a finite number, got %g", o->simpo_gamma);
    if (k == OBJ_SFT) return;
    if (k != OBJ_DPO && o->dpo_label_smoothing > 0)
        fail("flag --dpo-label-smoothing: only with --objective dpo, not %s", o->objective);
    if (o->batch % 2)
        fail("flag --batch: %d sequences; --objective %s puts a pair's chosen and rejected in one micro-batch, so it "
             "takes an even count", o->batch, o->objective);
}

// A pair's sequences as the loss reads them: the policy's and the reference's summed completion
// logps, and the completion lengths (targets counted).
typedef struct {
    double pi_c, pi_r, ref_c, ref_r;
    double len_c, len_r;
} PairLogps;

// The loss of one pair and its gradient w.r.t. the policy's summed logps of chosen (d_c) and
// rejected (d_r); the rewards and the logps the step reports (sums for DPO, means otherwise).
// ORPO's NLL term is not in it: it is the chosen tokens' mean CE over the step (the caller's).
typedef struct {
    double loss, d_c, d_r;
    double reward_c, reward_r, logp_c, logp_r;
} PairLoss;

static double log_sigmoid(double z) { return z >= 0 ? -log1p(exp(-z)) : z - log1p(exp(z)); }
static double sigmoid(double z) { return z >= 0 ? 1.0 / (1.0 + exp(-z)) : exp(z) / (1.0 + exp(z)); }

// log(1 - exp(m)) for m < 0, accurately at both ends
static double log1m_exp(double m) { return m > -0.693147 ? log(-expm1(m)) : log1p(-exp(m)); }

static PairLoss pair_loss(Objective k, const PairLogps* p, double beta, double smoothing, double gamma) {
    PairLoss r;
    memset(&r, 0, sizeof(r));
    if (k == OBJ_DPO) {
        r.reward_c = beta * (p->pi_c - p->ref_c);
        r.reward_r = beta * (p->pi_r - p->ref_r);
        double z = r.reward_c - r.reward_r;
        r.loss = -(1 - smoothing) * log_sigmoid(z) - smoothing * log_sigmoid(-z);
        double dz = -(1 - smoothing) * sigmoid(-z) + smoothing * sigmoid(z);
        r.d_c = beta * dz;
        r.d_r = -beta * dz;
        r.logp_c = p->pi_c;
        r.logp_r = p->pi_r;
        return r;
    }
    double mc = p->pi_c / p->len_c, mr = p->pi_r / p->len_r;
    r.logp_c = mc;
    r.logp_r = mr;
    r.reward_c = beta * mc;
    r.reward_r = beta * mr;
    double dmc, dmr;
    if (k == OBJ_SIMPO) {
        double z = beta * (mc - mr) - gamma;
        r.loss = -log_sigmoid(z);
        dmc = -beta * sigmoid(-z);
        dmr = -dmc;
    } else {  // ORPO: d lo(m)/dm = 1 / (1 - exp(m))
        double z = (mc - log1m_exp(mc)) - (mr - log1m_exp(mr));
        r.loss = -beta * log_sigmoid(z);
        double dz = -beta * sigmoid(-z);
        dmc = dz / -expm1(mc);
        dmr = -dz / -expm1(mr);
    }
    r.d_c = dmc / p->len_c;
    r.d_r = dmr / p->len_r;
    return r;
}

// What a step or a validation pass sums over its pairs (added across ranks), in TRL's names.
enum { PREF_LOSS, PREF_REWARD_C, PREF_REWARD_R, PREF_ACCURATE, PREF_MARGIN, PREF_LOGP_C, PREF_LOGP_R, PREF_NLL,
       PREF_SUMS };
static const char* const pref_metric_names[PREF_NLL] = {
    "loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
    "logps/rejected"};

static void pref_sums_add(double* sums, const PairLoss* l) {
    sums[PREF_LOSS] += l->loss;
    sums[PREF_REWARD_C] += l->reward_c;
    sums[PREF_REWARD_R] += l->reward_r;
    sums[PREF_ACCURATE] += l->reward_c > l->reward_r;
    sums[PREF_MARGIN] += l->reward_c - l->reward_r;
    sums[PREF_LOGP_C] += l->logp_c;
    sums[PREF_LOGP_R] += l->logp_r;
}

// The objective as a step computes it.
typedef struct {
    Objective kind;
    double beta, smoothing, gamma;
} PrefObjective;

static PrefObjective pref_objective_from(const TrainOptions* o) {
    PrefObjective p = {objective_of(o), objective_beta(o), o->dpo_label_smoothing, o->simpo_gamma};
    return p;
}
