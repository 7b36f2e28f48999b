// health.h: whether a training step may update the weights, judged from what every rank already
// agrees on (the global loss, gradient norm, counted targets and overflowed norm rows), with the
// one-line diagnosis when it may not. Besides a non-finite loss or gradient, three finite states
// mean the run is lost:
//   - diverged activations: a final-norm row whose statistics left fp32's range (RMS above 2^64,
//     llmc/norm_math.h). The norms now compute such a row correctly, but no sane network's
//     activations are there: the weights have blown up.
//   - a diverged loss: the mean loss more than HEALTH_LOSS_MARGIN nats above ln(classes), the loss
//     of uniform predictions. Why that bound: cross-entropy is at most ln(classes) plus the margin
//     by which the top logit beats the target's (lse(z) <= max z + ln C), so the mean wrong-class
//     margin must exceed 100 nats. Training by cross-entropy stops widening margins once softmax
//     saturates (at ~17 nats p = 1 - e^-17 rounds to 1 in fp32 and that example's gradient is 0),
//     so a sane model's margins stay at a few tens of nats; e^-100 ~ 4e-44 is a target
//     probability below fp32's smallest normal number. Only weights that have blown up get there
//     (ViT at --lr 1e3 reaches losses of 1e4 in two steps).
//   - a collapse: a gradient of exactly zero while there are targets to learn, so the trainable
//     weights no longer change the loss and no step can recover. (An fp32 norm whose mean square
//     overflowed used to do this: r = 0, uniform predictions, the loss exactly ln(vocab), every
//     step, exit 0.) A head of one class is this state by construction, and says so.
// A step whose batches have no target at all (every position masked, on every rank) has no loss
// (0/0): it makes no update and says so, rather than logging loss 0 and gradient norm 0.
#pragma once
#include <math.h>
#include <stdio.h>

#define HEALTH_LOSS_MARGIN 100.0  // nats above ln(classes): a diverged loss (see above)

typedef struct {
    float loss;            // the step's mean loss over every rank (NaN when targets == 0)
    double targets;        // the targets that count (unmasked tokens, images), all ranks
    double overflowed;     // final-norm rows whose statistics left fp32's range, all ranks
    int classes;           // vocabulary size or number of classes
} StepStats;

typedef enum {
    STEP_HEALTHY,
    STEP_NO_TARGETS,
    STEP_DIVERGED_ACTIVATIONS,
    STEP_DIVERGED_LOSS,
    STEP_COLLAPSED
} StepHealth;

// The state of a step with a finite loss and gradient norm.
static StepHealth step_health(const StepStats* s, float grad_norm) {
    if (s->targets == 0) return STEP_NO_TARGETS;
    if (s->overflowed > 0) return STEP_DIVERGED_ACTIVATIONS;
    if (s->loss > log((double)s->classes) + HEALTH_LOSS_MARGIN) return STEP_DIVERGED_LOSS;
    if (grad_norm == 0.0f) return STEP_COLLAPSED;
    return STEP_HEALTHY;
}

// What the log line of a step not updated says after " | ".
static const char* step_health_note(StepHealth h) {
    switch (h) {
        case STEP_NO_TARGETS: return "no unmasked target in this step's batches: no loss, no update";
        case STEP_DIVERGED_ACTIVATIONS: return "skipped: diverged (final-norm input beyond fp32 range)";
        case STEP_DIVERGED_LOSS: return "skipped: diverged (loss far above uniform predictions)";
        case STEP_COLLAPSED: return "skipped: collapsed (zero gradient)";
        default: return NULL;
    }
}

// What a diverging run can try, after "; ": the schedule's knobs, and for LoRA the two factors
// that multiply every adapter update whatever the lr: the scale alpha/r (alpha/sqrt(r) with
// --lora-rslora) and dropout's 1/(1-p) on kept inputs. They are stated with their values rather
// than judged against a threshold: --lora-alpha 1e38 or --lora-dropout 0.999 diverge at any lr,
// and the user needs to see which factor is the large one.
typedef struct {
    float lr;            // this step's learning rate
    int lora;            // 1: LoRA adapters train (the two factors below apply), 0: --full
    float lora_scale;    // alpha/r, or alpha/sqrt(r) under --lora-rslora
    float lora_dropout;  // --lora-dropout p (0 = off)
} HealthAdvice;

static void health_advice_text(char* buf, size_t n, const HealthAdvice* a) {
    int k = snprintf(buf, n, "lower --lr (this step's lr: %.3g), lengthen --warmup or set --grad-clip 1", a->lr);
    if (a->lora && k >= 0 && (size_t)k < n)
        k += snprintf(buf + k, n - k, "; the adapters' scale (--lora-alpha over the rank) is %.3g", a->lora_scale);
    if (a->lora && a->lora_dropout > 0 && k >= 0 && (size_t)k < n)
        k += snprintf(buf + k, n - k, " and --lora-dropout %g multiplies kept inputs by %.3g", a->lora_dropout,
                      1.0 / (1.0 - (double)a->lora_dropout));
    if (k >= 0 && (size_t)k < n) snprintf(buf + k, n - k, "; --nonfinite skip skips such steps");
}

// The one-line error of an unhealthy step (not STEP_NO_TARGETS): what happened, what to try.
static void step_health_message(char* buf, size_t n, StepHealth h, const StepStats* s, int step,
                                const HealthAdvice* advice) {
    char tryit[320];
    health_advice_text(tryit, sizeof(tryit), advice);
    double uniform = log((double)s->classes);
    if (h == STEP_DIVERGED_ACTIVATIONS)
        snprintf(buf, n, "step %d: the run diverged: %.0f rows reached the final norm with an RMS beyond 2^64 ~1.8e19 "
                 "(their square overflows fp32; no sane network is there); %s", step, s->overflowed, tryit);
    else if (h == STEP_DIVERGED_LOSS)
        snprintf(buf, n,
                 "step %d: the run diverged: loss %.6g is over %.0f nats above ln(%d) = %.4f, the loss of uniform "
                 "predictions; %s",
                 step, s->loss, HEALTH_LOSS_MARGIN, s->classes, uniform, tryit);
    else if (s->classes == 1)  // no divergence: softmax over one class is 1 whatever the weights
        snprintf(buf, n,
                 "step %d: the head has 1 class, so its loss is 0 and its gradient 0 by construction: nothing to "
                 "learn; give --classes N (N >= 2, the classes the labels belong to) or data of 2 or more classes",
                 step);
    else
        snprintf(buf, n,
                 "step %d: the run collapsed: the gradient is exactly zero with %.0f targets to learn (loss %.4f, "
                 "uniform predictions ln(%d) = %.4f): the trained weights no longer affect the loss; check the model's "
                 "final norm and head (all zero?), else %s",
                 step, s->targets, s->loss, s->classes, uniform, tryit);
}
