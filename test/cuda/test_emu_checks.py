"""The CPU emulator of the CUDA programming model (test/emu/emu.h, emu_cublas.h) catches the bug
classes a GPU shows as crashes, garbage or compute-sanitizer reports: each class is planted and
must be reported, with a message that names it.

Two kinds of plants:
  - test/cuda/emu_checks_probe.cu: small kernels and cuBLAS calls with a bug behind a mode (the same
    code without the bug, mode "ok", must pass);
  - one-line bugs planted in a scratch copy of the production kernels (llmc/cuda), whose
    dev/cuda check then has to fail.
"""
import os
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROBE = os.path.join(REPO, "build/emu/emu_checks_probe")
NVCC = shutil.which("nvcc")
CUDA_INC = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(NVCC))), "include") if NVCC else None
HAVE_CUDA_HEADERS = bool(CUDA_INC) and os.path.isfile(os.path.join(CUDA_INC, "cuda_bf16.h"))
needs_headers = pytest.mark.skipif(not HAVE_CUDA_HEADERS, reason="no CUDA toolkit headers: the emulator is not built (as make cuda-emu-check)")


def run(cmd, timeout=300, env=None):
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))


def probe():
    if not os.path.isfile(PROBE):
        pytest.fail(f"{PROBE} is missing: build it with `make build/emu/emu_checks_probe`")
    return PROBE


@needs_headers
def test_probe_ok():
    p = run([probe(), "ok"])
    assert p.returncode == 0, p.stdout + p.stderr
    assert "emu_checks_probe: ok:" in p.stdout
    assert "emu:" not in p.stderr, p.stderr


# (mode, what the report must say)
PLANTED = [
    ("oob-write", "emu: out-of-bounds write by fill_kernel: byte 0 of the guard zone after the cudaMalloc of 4000 bytes"),
    ("oob-write-arena", "emu: out-of-bounds write by fill_kernel: byte 0 of the guard zone after first was written"),
    ("oob-copy", "emu: cudaMemcpy: destination"),
    ("oob-read", "sum_kernel gave -nan, want 100"),
    ("grid-stride", "fill_no_stride_kernel left element 768 of 5000 unwritten"),
    ("shared-unwritten", "block 0 thread 32 read -nan from shared memory"),
    ("shared-carry", "block 1 thread 0 read -nan from shared memory"),
    ("thread-order", "(a missing __syncthreads)"),
    ("block-order", "(it depends on another block's output)"),
    ("shfl-exited", "emu: __shfl_xor_sync with mask 0xffffffff in warp_sum_kernel, block (0,0,0), warp 0: lane 16 has exited"),
    ("shfl-partial", "warp 1: lane 16 does not exist (partial warp)"),
    ("launch-block", "launch of empty_kernel: invalid configuration argument"),
    ("launch-grid", "launch of empty_kernel: invalid configuration argument"),
    ("launch-smem", "launch of empty_kernel: invalid argument"),
    ("blas-lda", "emu: cublasGemmEx: leading dimension too small: lda=63"),
    ("blas-types", "emu: cublasGemmEx: types A 0, B 0, C 14 with compute type 68 (CUBLAS_STATUS_NOT_SUPPORTED)"),
    ("blas-oob", "runs past the end of its device allocation (out of bounds)"),
    ("blas-align", "is 4-byte aligned, the algorithm was chosen for 16"),
    ("blas-workspace", "the algorithm needs 6016 (CUBLAS_STATUS_INVALID_VALUE)"),
    ("async-unwaited", "async-unwaited: sum_kernel gave -nan, want 100"),
    ("async-unordered", "emu: race: cudaMemcpyAsync issued on stream"),
    ("graph-sync", "emu: cudaStreamSynchronize while stream"),
    ("graph-malloc", "emu: cudaMalloc while stream"),
    ("graph-legacy", "launch of fill_kernel: operation would make the legacy stream depend on a capturing blocking stream"),
    ("graph-pageable", "a copy with pageable host memory"),
    ("vec-misaligned", "emu: misaligned 16-byte load at"),
]


@needs_headers
@pytest.mark.parametrize("mode,message", PLANTED, ids=[m for m, _ in PLANTED])
def test_planted_bug_is_reported(mode, message):
    p = run([probe(), mode])
    out = p.stdout + p.stderr
    assert p.returncode != 0, f"{mode}: went unnoticed\n{out}"
    assert message in out, out[-2000:]
    assert "went unnoticed" not in out


@needs_headers
def test_oob_read_reported_at_the_access_under_asan(tmp_path):
    """Built with AddressSanitizer the guard zones are poisoned too, so a read past the end is
    reported where it happens (without ASan it reads the NaN poison: test above)."""
    exe = tmp_path / "emu_checks_probe_asan"
    build = run(["g++", "-O1", "-g", "-std=gnu++17", "-x", "c++", "-DLLMC_CUDA_EMU", "-fsanitize=address", "-w", f"-I{CUDA_INC}",
                 "test/cuda/emu_checks_probe.cu", "-o", exe, "-lm", "-fopenmp"], timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    env = {"ASAN_OPTIONS": "detect_leaks=0:detect_stack_use_after_return=0"}
    ok = run([exe, "ok"], env=env)
    assert ok.returncode == 0, ok.stderr[-3000:]
    bad = run([exe, "oob-read"], env=env)
    assert bad.returncode != 0
    assert "ERROR: AddressSanitizer: use-after-poison" in bad.stderr and "sum_kernel" in bad.stderr, bad.stderr[-3000:]


# One-line bugs in a scratch copy of the production kernels: (id, file, text, replacement, the
# dev/cuda check that must fail, what its output must say).
PRODUCTION_PLANTS = [
    # the block reduction without its second barrier (caught before this emulator too: must stay)
    ("missing-syncthreads", "llmc/cuda/common.cuh",
     "    if (lane == 0) partial[warp] = v;\n    __syncthreads();\n    v = lane < nwarps ? partial[lane] : 0.0f;",
     "    if (lane == 0) partial[warp] = v;\n    v = lane < nwarps ? partial[lane] : 0.0f;", "common", "FAIL"),
    # the block reduction reading all 32 partial sums, of which only nwarps were written
    ("shared-unwritten", "llmc/cuda/common.cuh",
     "    v = lane < nwarps ? partial[lane] : 0.0f;\n    return warp_reduce_sum(v);\n}\nstatic __device__ double",
     "    v = partial[lane];\n    return warp_reduce_sum(v);\n}\nstatic __device__ double", "common", "FAIL"),
    # a kernel template's shared tile left unwritten past the last key (read, then multiplied by 0)
    ("shared-unwritten-template", "llmc/cuda/attention.cuh",
     "        tile[rr][dim] = val;\n",
     "        if (t < s.T) tile[rr][dim] = val;\n", "attention", "FAIL  attn fwd"),
    # one element past the end (the product's one-element path: its tail, or all of it when misaligned)
    ("oob-write", "llmc/cuda/misc.cuh",
     "for (int64_t i = 8 * nv + thread_index_1d(); i < n; i += grid_stride_1d()) "
     "out[i] = f2bf(bf2f(a[i]) * bf2f(b[i]));",
     "for (int64_t i = 8 * nv + thread_index_1d(); i <= n; i += grid_stride_1d()) "
     "out[i] = f2bf(bf2f(a[i]) * bf2f(b[i]));",
     "misc", "emu: out-of-bounds write by multiply_kernel"),
    # the grid-stride step dropped (caught by the misaligned run, whose one-element path covers every element)
    ("grid-stride", "llmc/cuda/misc.cuh",
     "for (int64_t i = 8 * nv + thread_index_1d(); i < n; i += grid_stride_1d()) "
     "out[i] = f2bf(bf2f(a[i]) * bf2f(b[i]));",
     "for (int64_t i = 8 * nv + thread_index_1d(); i < n; i += n) out[i] = f2bf(bf2f(a[i]) * bf2f(b[i]));", "misc",
     "FAIL  multiply"),
    # the column sums' barrier between the partial sums and their total
    ("thread-order", "llmc/cuda/common.cuh",
     "    for (int k = 0; k < Term::K; k++) part[k][threadIdx.y][threadIdx.x] = s[k];\n    __syncthreads();",
     "    for (int k = 0; k < Term::K; k++) part[k][threadIdx.y][threadIdx.x] = s[k];", "misc", "FAIL"),
    # the tensor-core attention's online softmax not rescaling the o sums to a new running max
    ("attn-online-rescale", "llmc/cuda/attention_gemm.cuh",
     "o32[r * s.hd + d] *= corr;", "o32[r * s.hd + d] *= 1.0f;", "attention", "FAIL  attn gemm fwd o"),
    # its two-pass backward not clearing one key block's dk sums before the next
    ("attn-key-block-sums", "llmc/cuda/attention_gemm.cuh",
     "        CUDA_CHECK(cudaMemsetAsync(w.dk32, 0, sizeof(float) * local, st));\n", "", "attention",
     "FAIL  attn gemm bwd dk"),
    # the two-pass cross-entropy's vector loads from the row's start, aligned or not (a GPU faults)
    ("vec-misaligned", "llmc/cuda/loss.cuh",
     "    int head = elems_to_align16(x);\n", "    int head = 0;\n", "loss", "emu: misaligned 16-byte load"),
    # a cuBLASLt layout with the wrong leading dimension (the nn form's first operand)
    ("cublas-ld", "llmc/cuda/matmul.cuh",
     "case MM_NN:\n            opa = CUBLAS_OP_N; arows = N; acols = K; lda = N;",
     "case MM_NN:\n            opa = CUBLAS_OP_N; arows = N; acols = K; lda = K;", "matmul", "emu: cublasLt"),
]


@needs_headers
@pytest.mark.parametrize("name,path,text,planted,check,message", PRODUCTION_PLANTS, ids=[p[0] for p in PRODUCTION_PLANTS])
def test_planted_production_bug_fails_its_check(tmp_path, name, path, text, planted, check, message):
    for d in ("llmc", "dev/cuda", "test/emu"):
        shutil.copytree(os.path.join(REPO, d), tmp_path / d)
    f = tmp_path / path
    src = f.read_text()
    assert src.count(text) == 1, f"{name}: the line to plant the bug in is gone from {path}"
    f.write_text(src.replace(text, planted))
    exe = tmp_path / check
    # -O0: a scratch build, compiled as fast as possible (make cuda-emu-check builds with -O1)
    build = run(["g++", "-O0", "-std=gnu++17", "-x", "c++", "-DLLMC_CUDA_EMU", "-w", f"-I{CUDA_INC}", tmp_path / f"dev/cuda/{check}.cu",
                 "-o", exe, "-lm"], timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    p = run([exe], timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode != 0, f"{name}: planted in {path}, {check} still passes\n{out[-2000:]}"
    assert message in out, out[-2000:]
