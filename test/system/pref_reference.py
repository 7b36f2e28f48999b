"""An independent reference of one preference step (DPO, cDPO, ORPO, SimPO) in PyTorch autograd
on the Hugging Face stack: transformers' LlamaForCausalLM (float64) with a PEFT adapter, the DPO
reference model being PEFT's disable_adapter(). Over every pair of a pair shard (one step's batch),
it prints the step's loss, TRL's statistics and the adapter's gradient norm, as JSON.
--full: a full fine-tune instead (no adapter: every parameter trains; DPO's reference model a
frozen copy of the initial model), over --steps steps of AdamW (our llmc/cpu/adamw.h's update:
beta1 0.9, beta2 0.999, eps 1e-8, no weight decay, constant --lr), each step over every pair; it
prints one JSON object per step. --merge-gammas: the parameterization of --norm ms under --full
(each block's two norm gammas folded into the linears that read them, the norms then fixed at 1).
--act approx swaps each MLP's SiLU for ReSiLU2's (exact forward, the 2-bit backward of
test/model/reference_llama.py); where a gate pre-activation lies within the fp32 error of a
breakpoint (fp32 may code it either way), it reports the gradient norm under each coding.
Run by test/system/test_preference.py under build/hfvenv's python (transformers + peft)."""
import argparse
import copy
import json
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [os.path.join(REPO, "scripts", "formats"), os.path.join(REPO, "test", "model")]
import shards  # noqa: E402
import reference_llama as ref  # noqa: E402


def seq_logp(model, prompt, comp):
    """Summed log-probability of the completion after the prompt, and its token count."""
    ids = torch.tensor([list(prompt) + list(comp)], dtype=torch.long)
    logits = model(input_ids=ids).logits[0, :-1]
    logp = torch.log_softmax(logits.to(torch.float64), -1)
    targets = ids[0, 1:]
    tok = logp.gather(1, targets[:, None])[:, 0]
    return tok[len(prompt) - 1:].sum(), len(comp)


def pair_terms(objective, beta, smoothing, gamma, pc, pr, rc, rr, lc, lr):
    """One pair: its loss, rewards and the logps TRL reports (tensors)."""
    if objective == "dpo":
        z = beta * ((pc - rc) - (pr - rr))
        loss = -(1 - smoothing) * F.logsigmoid(z) - smoothing * F.logsigmoid(-z)
        return loss, beta * (pc - rc), beta * (pr - rr), pc, pr
    mc, mr = pc / lc, pr / lr
    if objective == "simpo":
        loss = -F.logsigmoid(beta * mc - beta * mr - gamma)
    else:  # orpo: TRL's odds ratio term (its NLL term is added over the batch)
        log_odds = (mc - mr) - (torch.log1p(-torch.exp(mc)) - torch.log1p(-torch.exp(mr)))
        loss = -beta * F.logsigmoid(log_odds)
    return loss, beta * mc, beta * mr, mc, mr


# ReSiLU2 with its codes overridable per element: CODES[(call, flat index)] = code. The codes of
# gate pre-activations within the fp32 error of a breakpoint are ambiguous (fp32 may put them on
# either side); the step is computed under each assignment of those.
CODES = {}
CALLS = []  # the gate pre-activations of each act_fn call, in order (None: no gradient flows through it)


class ReSiLU2Codes(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, call):
        code = ref.resilu2_codes(x)
        for (c, i), v in CODES.items():
            if c == call:
                code.view(-1)[i] = v
        ctx.save_for_backward(code)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, dy):
        (code,) = ctx.saved_tensors
        return dy * torch.from_numpy(ref.resilu2_levels()).to(dy.dtype)[code], None


class ReSiLU2Act(torch.nn.Module):
    def forward(self, x):
        CALLS.append(x.detach().to(torch.float64) if torch.is_grad_enabled() else None)
        return ReSiLU2Codes.apply(x, len(CALLS) - 1)


def load(a, dtype, approx):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.float32, attn_implementation="eager",
                                                use_safetensors=True).to(dtype)
    model = PeftModel.from_pretrained(base, a.adapter, is_trainable=True).to(dtype)
    model.train()  # (lora_dropout 0: train and eval modes compute the same)
    if approx:
        for layer in model.base_model.model.model.layers:
            layer.mlp.act_fn = ReSiLU2Act()
    return model


def load_full(a, dtype, approx):
    """--full: the model itself trains; DPO's reference is a frozen copy of it as loaded."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.float32, attn_implementation="eager",
                                                 use_safetensors=True).to(dtype)
    if approx:
        for layer in model.model.layers:
            layer.mlp.act_fn = ReSiLU2Act()
    if a.merge_gammas:
        with torch.no_grad():
            for layer in model.model.layers:
                at, mlp = layer.self_attn, layer.mlp
                for norm, lins in ((layer.input_layernorm, (at.q_proj, at.k_proj, at.v_proj)),
                                   (layer.post_attention_layernorm, (mlp.gate_proj, mlp.up_proj))):
                    for lin in lins:
                        lin.weight.mul_(norm.weight[None, :])
                    norm.weight.fill_(1.0)
                    norm.weight.requires_grad_(False)
    model.train()
    ref_model = copy.deepcopy(model)
    for q in ref_model.parameters():
        q.requires_grad_(False)
    model.ref_model = [ref_model]  # (a list: not registered as a submodule, so not among the parameters)
    return model


def reference_logps(model, p, c, r):
    if hasattr(model, "ref_model"):
        with torch.no_grad():
            return seq_logp(model.ref_model[0], p, c)[0], seq_logp(model.ref_model[0], p, r)[0]
    with torch.no_grad(), model.disable_adapter():
        return seq_logp(model, p, c)[0], seq_logp(model, p, r)[0]


def trained(model):
    full = hasattr(model, "ref_model")
    return [(n, q) for n, q in model.named_parameters() if q.requires_grad and (full or "lora_" in n)]


def adamw(model, lr, t, state):
    """One update of our AdamW (llmc/cpu/adamw.h, no weight decay) on every trained parameter."""
    b1, b2, eps = 0.9, 0.999, 1e-8
    with torch.no_grad():
        for n, q in trained(model):
            g = q.grad if q.grad is not None else torch.zeros_like(q)
            m, v = state.get(n, (torch.zeros_like(q), torch.zeros_like(q)))
            m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
            state[n] = (m, v)
            q -= lr * ((m / (1 - b1 ** t)) / (torch.sqrt(v / (1 - b2 ** t)) + eps))


def step(a, model, pairs):
    """The step over every pair: its statistics and the trained parameters' gradient norm."""
    CALLS.clear()
    model.zero_grad()
    rows = []
    for p, c, r in pairs:
        pc, lc = seq_logp(model, p, c)
        pr, lr = seq_logp(model, p, r)
        rc = rr = torch.zeros((), dtype=torch.float64)
        if a.objective == "dpo":
            rc, rr = reference_logps(model, p, c, r)
        rows.append(pair_terms(a.objective, a.beta, a.smoothing, a.gamma, pc, pr, rc, rr, lc, lr) + (pc, lc))
    n = len(rows)
    loss = sum(t[0] for t in rows) / n
    if a.objective == "orpo":  # the mean CE over the batch's chosen completion tokens
        loss = loss - sum(t[5] for t in rows) / sum(t[6] for t in rows)
    loss.backward()
    sq = sum(float((q.grad.to(torch.float64) ** 2).sum()) for name, q in trained(model) if q.grad is not None)
    return {"loss": float(loss), "rewards/chosen": float(sum(t[1] for t in rows) / n),
            "rewards/rejected": float(sum(t[2] for t in rows) / n),
            "rewards/accuracies": float(sum(float(t[1] > t[2]) for t in rows) / n),
            "rewards/margins": float(sum(t[1] - t[2] for t in rows) / n),
            "logps/chosen": float(sum(t[3] for t in rows) / n), "logps/rejected": float(sum(t[4] for t in rows) / n),
            "grad_norm": sq ** 0.5}


def ambiguous_codes(a, pairs):
    """The gate elements whose ReSiLU2 code fp32 may set either way: within 4x the largest fp32 vs
    fp64 gate error of this very case (measured here) of a breakpoint; each with both codes."""
    out = step(a, load(a, torch.float64, True), pairs)
    g64 = list(CALLS)
    step(a, load(a, torch.float32, True), pairs)
    eps = 4 * max(float((x - y).abs().max()) for x, y in zip(g64, CALLS) if x is not None)
    amb = []
    for call, g in enumerate(g64):
        for c in ref.RESILU2_C if g is not None else ():
            for i in torch.nonzero((g.view(-1) - c).abs() < eps).flatten().tolist():
                code = int(ref.resilu2_codes(g.view(-1)[i:i + 1])[0])
                amb.append(((call, i), (code, code - 1 if g.view(-1)[i] > c else code + 1)))
    return out, amb, eps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--pairs", required=True)
    ap.add_argument("--objective", required=True, choices=("dpo", "orpo", "simpo"))
    ap.add_argument("--beta", type=float, required=True)
    ap.add_argument("--smoothing", type=float, default=0.0)
    ap.add_argument("--gamma", type=float, default=0.5)
    ap.add_argument("--act", choices=("exact", "approx"), default="exact")
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--merge-gammas", action="store_true")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--lr", type=float, default=0.0)
    a = ap.parse_args()
    pairs, _ = shards.read_pair_shard(a.pairs)
    if a.full:
        full_steps(a, pairs)
        return
    if a.act == "exact":
        out = step(a, load(a, torch.float64, False), pairs)
        out["grad_norms"] = [out["grad_norm"]]
        print(json.dumps(out))
        return
    out, amb, eps = ambiguous_codes(a, pairs)
    if len(amb) > 8:
        sys.exit(f"{len(amb)} gate pre-activations lie within {eps:.2g} of a ReSiLU2 breakpoint: too many to try")
    model = load(a, torch.float64, True)
    norms = []
    for k in range(1 << len(amb)):
        CODES.clear()
        CODES.update({key: choice[k >> j & 1] for j, (key, choice) in enumerate(amb)})
        norms.append(step(a, model, pairs)["grad_norm"])
    out.update(grad_norms=norms, ambiguous=len(amb), eps=eps)
    print(json.dumps(out))


def run_full(a, pairs, dtype):
    """--full: each step's statistics, and each step's gate pre-activations (ReSiLU2's inputs)."""
    model = load_full(a, dtype, a.act == "approx")
    outs, calls, state = [], [], {}
    for t in range(1, a.steps + 1):
        outs.append(step(a, model, pairs))
        calls.append(list(CALLS))
        adamw(model, a.lr, t, state)
    return outs, calls


def full_steps(a, pairs):
    """One JSON object per step. Under --act approx it also counts, per step, the gate elements within
    4x the fp32 vs fp64 gate error of a ReSiLU2 breakpoint (their code may differ in fp32; one that
    does fails the caller's comparison, which reports the count)."""
    outs, calls = run_full(a, pairs, torch.float64)
    if a.act == "approx":
        _, calls32 = run_full(a, pairs, torch.float32)
        for out, g64, g32 in zip(outs, calls, calls32):
            eps = 4 * max(float((x - y).abs().max()) for x, y in zip(g64, g32) if x is not None)
            out["ambiguous"] = sum(int(((g.view(-1) - c).abs() < eps).sum()) for g in g64 if g is not None
                                   for c in ref.RESILU2_C)
    for out in outs:
        out["grad_norms"] = [out["grad_norm"]]
        print(json.dumps(out))


if __name__ == "__main__":
    main()
