"""Phi-3 / Phi-4 on train_llama's CUDA backend against its CPU backend (the CPU one is exact against
transformers and the reference: test/model/test_phi3_model.py): one forward + backward of the probe
in the baseline and lowmem modes (block recompute too), on the fused checkpoints with PEFT's fused
adapters, LongRoPE at both lengths and partial rotary on both RoPE kernels (the scalar one: 12 of 16
dims; the vectorised one: 16 of 32). Where the CUDA side runs and the bf16 tolerances:
test/cuda/test_llama_cuda.py."""
import os

import pytest

import phi3_cases as pc
import st_io
from test_llama_cuda import check_logits_and_worst_grad, check_probe, cuda_and_cpu, tol_for

MODES = {"baseline": ("exact", "std", "none"), "lowmem": ("approx", "ms", "none"),
         "lowmem_block": ("approx", "ms", "block")}
CASES = [("phi3", 2, 10), ("phi3_longrope", 2, 12), ("phi4_mini", 2, 6), ("phi_partial_vec", 2, 9)]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("phi3_cuda")
    out = {}
    for name, B, T in CASES:
        d = str(root / name)
        cfg = pc.write_phi3_model(d, pc.model_config(name), seed=2)
        cp = os.path.join(d, f"case.T{T}.safetensors")
        st_io.save(cp, pc.make_phi3_case(cfg, B, T, seed=3))
        out[(name, T)] = (d, cp)
    return out


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name,B,T", CASES, ids=[f"{n}-T{t}" for n, _, t in CASES])
def test_cuda_phi3_matches_cpu(cases, name, B, T, mode):
    d, cp = cases[(name, T)]
    act, norm, rec = MODES[mode]
    got, want = cuda_and_cpu(d, cp, mode, act, norm, rec, pc.RANK, pc.ALPHA, [])
    check_probe(got, want, tol_for(act), f"{name} T{T} {mode}")


@pytest.mark.parametrize("mode", ["baseline", "lowmem"])
@pytest.mark.parametrize("name,B,T", [CASES[0], CASES[2]], ids=[f"{n}-T{t}" for n, _, t in (CASES[0], CASES[2])])
def test_cuda_phi3_full_finetuning_matches_cpu(cases, name, B, T, mode):
    """--full: every part of the fused weights trains on CUDA as on the CPU (fp32 masters, bf16 shadows)."""
    d, cp = cases[(name, T)]
    act, norm, rec = MODES[mode]
    got, want = cuda_and_cpu(d, cp, f"full.{mode}", act, norm, rec, pc.RANK, pc.ALPHA, ["--full"])
    assert set(got) == set(want) and sum(k.endswith(".W") for k in want) == 2 * 7
    check_logits_and_worst_grad(got, want, tol_for(act), f"full {name} T{T} {mode}")
