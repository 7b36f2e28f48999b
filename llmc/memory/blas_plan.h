// blas_plan.h: the size and alignment of the workspace cuBLAS and cuBLASLt share on the CUDA
// backend. It is a buffer of the memory plan (op_plan_matmul_workspace), so --dry-run and the
// measured-vs-planned line count it; the plan is made in every build, a CPU-only one planning the
// CUDA layout included, hence a header of its own without CUDA.
#pragma once

// 32 MiB: what cuBLAS recommends on Hopper (sm_90) for its own workspace and what cuBLASLt's
// Hopper kernels ask for at most; smaller GPUs need less and use what they need of it.
#define BLAS_WORKSPACE_BYTES ((size_t)32 << 20)
// cublasSetWorkspace requires a 256-byte aligned pointer; cudaMalloc's are, so the plan aligns
// the buffer's offset inside its arena.
#define BLAS_WORKSPACE_ALIGN 256
