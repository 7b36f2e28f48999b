"""--lora-dropout P (llmc/lora_dropout.h): the adapter of every linear reads dropout(x) while
training, with a keep mask regenerated in the backward from a counter hash, never stored.

- the C model with dropout (build/test/llama_probe, CPU fp32, and the CUDA backend on the emulator)
  against the PyTorch reference given the mask from test/model/lora_dropout_mask.py, a separate
  implementation of the hash: logits, loss and every LoRA gradient. The forward's mask shows in the
  logits; the gradients of A (dax^T xa) and, through dx, of every earlier layer need the backward's
  regenerated mask to be the forward's. A reference keyed by another step must fail the same
  comparison (the check can tell masks apart);
- --lora-dropout 0 is bit for bit the run without the flag; evaluation and --generate do not
  depend on P; the plan's saved activations do not change (one scratch of the widest adapted
  input is added);
- 2 ranks x batch 2 equal 1 process x batch 2 x --grad-accum 2 bit for bit with dropout (the mask
  is keyed by the row in the step's global batch), and --stop-at then --resume equals the
  uninterrupted run (keyed by the optimizer step);
- train_vit: p = 0 is bit for bit no flag, its CUDA backend matches its CPU backend with dropout.
The mask's statistics (kept fraction, E[output]) and its regeneration bit for bit are
test/unit/lora_dropout.cu's; the CUDA kernels equal their CPU twins bit for bit in dev/cuda/matmul.cu."""
import json
import os

import numpy as np
import pytest
import torch

import llama_cases as lc
import lora_dropout_mask as ldm
import shards
import st_io
from cuda_backend import binaries, need, rel_l2
from cuda_backend import run as run_cmd
from test_llama_train import BIN, ENV, losses, run
from test_llama_system import mpirun

ref = lc.ref
torch.set_num_threads(1)
CUDA_TRAIN, CUDA_PROBE, CPU_TRAIN, CPU_PROBE = binaries("train_llama", "llama_probe")
P, SEED, STEP = 0.1, 5, 3
NAME = "gqa_untied"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_dropout")
    d = str(root / NAME)
    lc.write_model(d, lc.model_config(NAME), seed=1)
    model = ref.LlamaModel.load(d)
    B, T, r, alpha = lc.SHAPES[NAME]
    case = lc.make_case(model.cfg, B, T, r, seed=7)
    cp = os.path.join(d, "case.safetensors")
    st_io.save(cp, case)
    return d, model, case, cp, (B, T, r, alpha)


def reference(setup, act, norm, step=STEP, row0=0, ms_lora="exact"):
    d, model, case, cp, (B, T, r, alpha) = setup
    drop = ldm.reference_dropout(P, SEED, step, row0, list(ref.LORA_TARGETS), torch)
    return ref.run_case(model, case, act, norm, r, alpha, ms_lora=ms_lora, dropout=drop)


def probe(setup, exe, act, norm, rec, tag, row0=0, device="cpu", extra=()):
    d, model, case, cp, (B, T, r, alpha) = setup
    out = cp + f".{tag}.out"
    run_cmd([need(exe), "--model", d, "--case", cp, "--out-file", out, "--act", act, "--norm", norm, "--recompute", rec,
             "--lora-rank", r, "--lora-alpha", repr(float(alpha)), "--device", device, "--lora-dropout", P, "--seed", SEED,
             "--dropout-step", STEP, "--dropout-row0", row0, *extra])
    return st_io.load(out)


# exact activations: a gate pre-activation that dropout moves never crosses a ReSiLU2 breakpoint
# (the approximate backward is model-tested without dropout in test_llama_model.py; here the mask)
MODES = [("exact", "std", "none", "exact"), ("exact", "ms", "none", "exact"), ("exact", "std", "block", "exact"),
         ("exact", "ms", "none", "merged")]


@pytest.mark.parametrize("mode", MODES, ids=["-".join(m) for m in MODES])
def test_cpu_probe_with_dropout_matches_reference(setup, mode):
    """fp32 probe vs fp64 reference with the Python mask: llama_cases.TOL (fp32 reordering over
    sums of at most ~100 terms, ~1e-5 relative, with margin). row0 = 22 (the second micro-batch of
    a step) checks the global-row keying; a reference of the next step must not match."""
    act, norm, rec, ms_lora = mode
    B, T = setup[4][0], setup[4][1]
    got = probe(setup, CPU_PROBE, act, norm, rec, "-".join(mode), row0=B * T, extra=("--ms-lora", ms_lora))
    errs = lc.compare(reference(setup, act, norm, row0=B * T, ms_lora=ms_lora), got)
    lc.check_errors(errs, f"dropout {'-'.join(mode)}")
    wrong = lc.compare(reference(setup, act, norm, step=STEP + 1, row0=B * T, ms_lora=ms_lora), got)
    print(f"  against another step's mask: logits {wrong['logits']:.2e} grad {wrong['grad'][0]:.2e}")
    assert wrong["grad"][0] > 100 * lc.TOL["grad"] and wrong["logits"] > 100 * lc.TOL["logits"]


def test_dropout_zero_probe_equals_reference_without_dropout(setup):
    """P = 0 in the probe is the model without dropout: the reference without a dropout function."""
    d, model, case, cp, (B, T, r, alpha) = setup
    out = cp + ".p0.out"
    run_cmd([need(CPU_PROBE), "--model", d, "--case", cp, "--out-file", out, "--act", "exact", "--norm", "std",
             "--lora-rank", r, "--lora-alpha", repr(float(alpha)), "--device", "cpu", "--lora-dropout", 0, "--dropout-step", STEP])
    lc.check_errors(lc.compare(ref.run_case(model, case, "exact", "std", r, alpha), st_io.load(out)), "dropout 0")


# bf16 activations and frozen weights on CUDA: test/cuda/test_llama_cuda.py's TOL_EXACT (relative L2:
# logits 5 %, loss 1 %, any gradient tensor 15 %), measured drift ~1-6 %
@pytest.mark.parametrize("norm", ["std", "ms"])
def test_cuda_probe_with_dropout_matches_reference(setup, norm):
    B, T = setup[4][0], setup[4][1]
    got = probe(setup, CUDA_PROBE, "exact", norm, "none", f"cuda-{norm}", row0=B * T, device="cuda")
    for step, want_ok in ((STEP, True), (STEP + 1, False)):
        want = reference(setup, "exact", norm, step=step, row0=B * T)
        e_logits = rel_l2(got["logits"], want["logits"])
        e_loss = abs(float(got["loss"][0]) - float(want["loss"][0])) / abs(float(want["loss"][0]))
        e_grad, g_name = max((rel_l2(got[k], want[k]), k) for k in want if k.startswith("grad."))
        print(f"cuda {norm} vs reference of step {step}: logits {e_logits:.2e} loss {e_loss:.2e} grad {e_grad:.2e} ({g_name})")
        if want_ok:
            assert e_logits < 0.05 and e_loss < 1e-2 and e_grad < 0.15
        else:
            assert e_grad > 0.3, "another step's mask should not match"


# ---- the trainer ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("dropout_run")
    cfg = lc.model_config(NAME)
    lc.write_model(str(d / "model"), cfg, seed=4)
    rng = np.random.default_rng(1)
    toks = np.tile(rng.integers(3, cfg["vocab_size"], size=13), 400)
    mask = (rng.random(toks.size) > 0.2).astype(np.uint8)
    shards.write_shard(str(d / "train.bin"), toks.astype(np.uint32), mask, cfg["vocab_size"])
    shards.write_shard(str(d / "val.bin"), toks[:1500].astype(np.uint32), mask[:1500], cfg["vocab_size"])
    return d


def args(tiny, *extra):
    return ["--model", tiny / "model", "--data", tiny / "train.bin", "--seq", 24, "--lora-rank", 4, "--lr", 5e-3, "--seed", 11,
            "--threads", 1, "--mode", "lowmem", *extra]


def adapter(d):
    return st_io.load(str(d / "adapter_model.safetensors"))


def same_adapters(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def grad_norms(stdout):
    return [line.split("grad norm ")[1].split()[0] for line in stdout.splitlines() if "grad norm " in line]


def test_dropout_zero_is_no_flag_and_dropout_changes_training(tiny, tmp_path):
    none = run(args(tiny, "--steps", 4, "--batch", 2, "--out", tmp_path / "none"))
    zero = run(args(tiny, "--steps", 4, "--batch", 2, "--out", tmp_path / "zero", "--lora-dropout", 0))
    some = run(args(tiny, "--steps", 4, "--batch", 2, "--out", tmp_path / "some", "--lora-dropout", P))
    assert losses(none.stdout) == losses(zero.stdout) and grad_norms(none.stdout) == grad_norms(zero.stdout)
    assert (tmp_path / "none" / "adapter_model.safetensors").read_bytes() == (tmp_path / "zero" / "adapter_model.safetensors").read_bytes()
    assert grad_norms(some.stdout) != grad_norms(none.stdout)
    assert not same_adapters(adapter(tmp_path / "some"), adapter(tmp_path / "none"))
    assert json.loads((tmp_path / "some" / "adapter_config.json").read_text())["lora_dropout"] == pytest.approx(P)
    assert json.loads((tmp_path / "zero" / "adapter_config.json").read_text())["lora_dropout"] == 0


def test_evaluation_and_generation_do_not_depend_on_dropout(tmp_path):
    """Dropout acts only in training steps: --eval-only's loss and greedy --generate (the bundled
    demo model, which has a tokenizer) are the same bytes with P = 0 and P = 0.5."""
    demo = ["--model", os.path.join(lc.REPO, "data", "llama_demo"), "--lora-rank", 4, "--threads", 1]
    run(demo + ["--data", os.path.join(lc.REPO, "data", "llama_demo_ft_train.bin"), "--steps", 3, "--batch", 2, "--seq", 32,
                "--lr", 1e-2, "--out", tmp_path / "a", "--lora-dropout", P])
    val = os.path.join(lc.REPO, "data", "llama_demo_ft_val.bin")
    ev = [run(demo + ["--val", val, "--eval-only", "--seq", 32, "--batch", 2, "--val-batches", 2, "--adapter", tmp_path / "a",
                      "--lora-dropout", p]).stdout.split("val loss ")[-1] for p in (0, 0.5)]
    assert ev[0] == ev[1]
    gen = [run(demo + ["--generate", 16, "--temperature", 0, "--prompt", "Licensed under the", "--adapter", tmp_path / "a",
                       "--lora-dropout", p]).stdout for p in (0, 0.5)]
    gen = [g[g.index("Licensed under the"):] for g in gen]  # the text (the start-up lines name the free memory)
    assert gen[0] == gen[1] and len(gen[0]) > 16


def test_dry_run_saved_bytes_unchanged(tiny):
    def plan(*extra):
        p = run(["--model", tiny / "model", "--dry-run", "--json", "--seq", 24, "--batch", 2, "--lora-rank", 4, *extra])
        return json.loads(p.stdout)
    for dev in ("cpu", "cuda"):
        a, b = plan("--device", dev), plan("--device", dev, "--lora-dropout", P)
        ca, cb = a["categories"], b["categories"]
        assert ca["saved"] == cb["saved"] and a["activation_bytes"] == b["activation_bytes"] and ca["frozen"] == cb["frozen"]
        # one scratch buffer: the widest adapted input (down's, intermediate_size 100) of 2 x 24
        # tokens (a multiple of the plan's 64-byte alignment), give or take under 256 bytes of
        # padding where it moves a later 256-byte aligned buffer (the cuBLAS workspace: the padding
        # before it, 0 to 192 bytes, can grow or shrink)
        abytes = 4 if dev == "cpu" else 2
        assert abs(cb["scratch"] - ca["scratch"] - 2 * 24 * 100 * abytes) < 256
        assert b["lora_dropout"] == pytest.approx(P) and a["lora_dropout"] == 0


def test_two_ranks_equal_one_process_accumulating_with_dropout(tiny, tmp_path):
    """As test_llama_system's comparison, with dropout: rank r's micro-batch is the process's
    micro-batch r of the step, the same global rows, hence the same masks: the same bits."""
    one = run(args(tiny, "--steps", 4, "--batch", 2, "--grad-accum", 2, "--lora-dropout", P, "--out", tmp_path / "one"))
    two = mpirun(2, args(tiny, "--steps", 4, "--batch", 2, "--lora-dropout", P, "--out", tmp_path / "two"))
    assert losses(one.stdout) == losses(two.stdout) and grad_norms(one.stdout) == grad_norms(two.stdout)
    assert same_adapters(adapter(tmp_path / "one"), adapter(tmp_path / "two"))
    # and the masks matter: without the row offset both micro-batches would share one mask
    nodrop = run(args(tiny, "--steps", 4, "--batch", 2, "--grad-accum", 2, "--out", tmp_path / "nodrop"))
    assert grad_norms(nodrop.stdout) != grad_norms(one.stdout)


def test_stop_then_resume_equals_whole_run_with_dropout(tiny, tmp_path):
    run(args(tiny, "--steps", 6, "--batch", 2, "--lora-dropout", P, "--out", tmp_path / "whole"))
    run(args(tiny, "--steps", 6, "--batch", 2, "--lora-dropout", P, "--out", tmp_path / "cut", "--stop-at", 3))
    r = run(args(tiny, "--steps", 6, "--batch", 2, "--lora-dropout", P, "--resume", tmp_path / "cut"))
    assert "at step 3" in r.stdout
    assert same_adapters(adapter(tmp_path / "whole"), adapter(tmp_path / "cut"))
    p = run(args(tiny, "--steps", 6, "--batch", 2, "--lora-dropout", 0.2, "--resume", tmp_path / "cut"), check=False)
    assert p.returncode != 0 and "lora_dropout" in p.stderr


def test_cuda_training_with_dropout_tracks_cpu(tiny, tmp_path):
    """The CUDA backend (emulator) trains with the same masks: per-step losses within bf16 drift
    (test_llama_cuda.py's training comparison: 2 % relative over a few steps)."""
    a = ["--model", tiny / "model", "--data", tiny / "train.bin", "--seq", 24, "--lora-rank", 4, "--lr", 5e-3, "--seed", 11,
         "--mode", "lowmem", "--steps", 4, "--batch", 2, "--lora-dropout", 0.3]
    cpu = run_cmd([need(CPU_TRAIN), *a, "--device", "cpu"])
    cuda = run_cmd([need(CUDA_TRAIN), *a, "--device", "cuda"])
    lc_, lg = np.array(losses(cpu.stdout), float), np.array(losses(cuda.stdout), float)
    print("cpu", lc_, "cuda", lg)
    assert lc_.size == 4 and np.all(np.abs(lg - lc_) / lc_ < 0.02)


# ---- train_vit -------------------------------------------------------------------------------------

VIT_CUDA_TRAIN, VIT_CUDA_PROBE, VIT_CPU_TRAIN, VIT_CPU_PROBE = binaries("train_vit", "vit_probe")


@pytest.fixture(scope="module")
def vit_setup(tmp_path_factory):
    import vit_cases as vc
    root = tmp_path_factory.mktemp("vit_dropout")
    d = str(root / "square")
    vc.write_model(d, vc.model_config("square"), seed=1)
    model = vc.ref.VitModel.load(d)
    batch, r, alpha, classes = vc.SHAPES["square"]
    case = vc.make_case(model.cfg, batch, r, classes, seed=3)
    cp = os.path.join(d, "case.safetensors")
    st_io.save(cp, case)
    return vc, d, model, case, cp, (r, alpha)


def vit_probe(vit_setup, exe, norm, tag, device="cpu"):
    vc, d, model, case, cp, (r, alpha) = vit_setup
    out = cp + f".{tag}.out"
    run_cmd([need(exe), "--model", d, "--case", cp, "--out-file", out, "--act", "exact", "--norm", norm, "--lora-rank", r,
             "--lora-alpha", repr(float(alpha)), "--device", device, "--lora-dropout", P, "--seed", SEED, "--dropout-step", STEP,
             "--dropout-row0", 51])
    return st_io.load(out)


def vit_reference(vit_setup, norm, step):
    vc, d, model, case, cp, (r, alpha) = vit_setup
    drop = ldm.reference_dropout(P, SEED, step, 51, list(vc.ref.LORA_TARGETS), torch)
    return vc.ref.run_case(model, case, "exact", norm, r, alpha, dropout=drop)


@pytest.mark.parametrize("norm", ["std", "ms"])
def test_vit_cpu_probe_with_dropout_matches_reference(vit_setup, norm):
    """As for LLaMA, with LayerNorm: under MS-LN the adapters of q, k, v, fc1 read
    dropout(gamma*z + beta). vit_cases.TOL (fp32 vs fp64); another step's mask must not match."""
    vc = vit_setup[0]
    got = vit_probe(vit_setup, VIT_CPU_PROBE, norm, f"cpu-{norm}")
    vc.check_errors(vc.compare(vit_reference(vit_setup, norm, STEP), got), f"vit dropout exact-{norm}")
    wrong = vc.compare(vit_reference(vit_setup, norm, STEP + 1), got)
    print(f"  against another step's mask: logits {wrong['logits']:.2e} grad {wrong['grad'][0]:.2e}")
    assert wrong["grad"][0] > 100 * vc.TOL["grad"]


def test_vit_cuda_probe_with_dropout_matches_reference(vit_setup):
    """The CUDA backend (emulator) with dropout under MS-LN: test_vit_cuda.py's bf16 tolerances
    (relative L2: logits 5 %, loss 3 %, gradients 30 %) against the reference of its step, and far
    from the reference of another step."""
    got = vit_probe(vit_setup, VIT_CUDA_PROBE, "ms", "cuda-ms", device="cuda")
    for step, want_ok in ((STEP, True), (STEP + 1, False)):
        want = vit_reference(vit_setup, "ms", step)
        e_logits = rel_l2(got["logits"], want["logits"])
        e_loss = abs(float(got["loss"][0]) - float(want["loss"][0])) / abs(float(want["loss"][0]))
        e_grad, g_name = max((rel_l2(got[k], want[k]), k) for k in want if k.startswith("grad."))
        print(f"vit cuda vs reference of step {step}: logits {e_logits:.2e} loss {e_loss:.2e} grad {e_grad:.2e} ({g_name})")
        if want_ok:
            assert e_logits < 0.05 and e_loss < 0.03 and e_grad < 0.3
        else:
            assert e_grad > 0.6, "another step's mask should not match"


def test_vit_dropout_zero_is_no_flag(tmp_path):
    demo = ["--model", os.path.join(lc.REPO, "data", "vit_demo"), "--data", os.path.join(lc.REPO, "data", "vit_demo_ft_train.bin"),
            "--steps", 3, "--batch", 8, "--lora-rank", 4, "--lr", 3e-3, "--threads", 1]
    vit = need(VIT_CPU_TRAIN)
    run_cmd([vit, *demo, "--out", tmp_path / "none"])
    run_cmd([vit, *demo, "--out", tmp_path / "zero", "--lora-dropout", 0])
    run_cmd([vit, *demo, "--out", tmp_path / "some", "--lora-dropout", P])
    f = "adapter_model.safetensors"
    assert (tmp_path / "none" / f).read_bytes() == (tmp_path / "zero" / f).read_bytes()
    assert (tmp_path / "none" / f).read_bytes() != (tmp_path / "some" / f).read_bytes()
    assert json.loads((tmp_path / "some" / "adapter_config.json").read_text())["lora_dropout"] == pytest.approx(P)
