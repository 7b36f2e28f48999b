// cuda/matmul.cuh: matrix products of the CUDA backend through cuBLASLt, the twins of
// llmc/cpu/matmul.h, same row-major contract:
//   matmul_nt_cuda:  C[M,N] (+)= alpha * A[M,K] . B[N,K]^T   (linear forward: x W^T)
//   matmul_nn_cuda:  C[M,N] (+)= alpha * A[M,K] . B[K,N]     (input gradients: dy W)
//   matmul_tn_cuda:  C[M,N] (+)= alpha * A[K,M]^T . B[K,N]   (weight gradients: dy^T x)
//   matmul_nt_bias_cuda: the nt form plus a bias[N] per column of C, in the GEMM epilogue.
// accumulate = 1 adds to C (beta = 1), 0 overwrites it (C is then never read).
//
// Precision policy (the operand types pick the path, by overload):
//   bf16 x bf16 -> bf16   activations and frozen weights: tensor cores, fp32 accumulation
//                         (CUBLAS_COMPUTE_32F), one rounding to bf16 at the end.
//   bf16 x bf16 -> fp32   products whose result must not be rounded to bf16: LoRA and other
//                         trainable weight gradients (accumulated over micro-batches in fp32 with
//                         beta = 1), and logits for the loss. Same tensor-core speed.
//   fp32 x fp32 -> fp32   true fp32 (CUBLAS_COMPUTE_32F, no TF32), for small products whose
//                         operands are fp32 anyway (a classification head on fp32 features, a
//                         test). Not tensor cores: ~15x slower per FLOP, keep it to small shapes.
// LoRA: the fp32 master A and B (what AdamW updates) are cast to bf16 shadows once per optimizer
// step (cast_f32_to_bf16_cuda), which feed the bf16 products; their gradients come out of the
// bf16 x bf16 -> fp32 path straight into the fp32 gradient arena (llmc/cuda/linear.cuh).
//
// Row-major C = op(A) op(B) is computed as the column-major C^T = op(B)^T op(A)^T, so cuBLAS's
// first operand is our B. Every call asks the cuBLASLt heuristic for an algorithm with the true
// alignment of its buffers (the default assumes 256 bytes); when cuBLASLt has none (odd leading
// dimensions), it falls back to cublasGemmEx with the same types, and the bias to a kernel that
// the caller launches (MatmulBias).
// On the CPU emulator the same calls go to test/emu/emu_cublas.h, which checks each against
// cuBLAS's documented contract.
#pragma once
#include "common.cuh"
#include "misc.cuh"
#include "../memory/cuda_workspace.h"

typedef enum { MM_NT, MM_NN, MM_TN } MatmulForm;

// The process-wide cuBLAS state: the handles (GPU builds) and the one workspace both use. A
// trainer attaches the workspace its memory plan holds (cublas_attach_workspace), so the plan
// names every device byte it allocates; a program without a plan (the dev/cuda checks) gets one
// allocated here at the first product, which the emulator's cudaMemGetInfo counts like a GPU's.
// One workspace serves both handles because every product runs on the backend's one stream, in
// order (NCCL's second stream makes no product).
typedef struct {
    cublasLtHandle_t lt;
    cublasHandle_t blas;   // the fallback and the batched products
    void* workspace;
    size_t workspace_bytes;
    int owns_workspace;    // allocated here (no plan attached one)
    int ready;             // handles created
} CublasState;
static CublasState g_cublas;

static void matmul_plans_free(void);

static void cublas_setup(void) {
    if (!g_cublas.workspace) {
        g_cublas.workspace_bytes = BLAS_WORKSPACE_BYTES;
        g_cublas.workspace = cuda_malloc_checked(g_cublas.workspace_bytes, "the cuBLAS workspace");
        g_cublas.owns_workspace = 1;
    }
    if (g_cublas.ready) return;
    CUBLAS_CHECK(cublasLtCreate(&g_cublas.lt));
    CUBLAS_CHECK(cublasCreate(&g_cublas.blas));
    g_cublas.ready = 1;
}

// Makes `work` (device memory of `bytes` that the caller keeps, 256-byte aligned: the memory
// plan's buffer) the workspace of both handles, freeing one allocated here; NULL detaches it
// (before the caller frees it). The cached cuBLASLt plans were chosen for the old size: dropped
// when it changes.
static void cublas_attach_workspace(void* work, size_t bytes) {
    if (work && ((uintptr_t)work % BLAS_WORKSPACE_ALIGN || !bytes))
        fail("internal: the cuBLAS workspace %p (%zu bytes) is not %d-byte aligned device memory", work, bytes,
             BLAS_WORKSPACE_ALIGN);
    if (g_cublas.ready && bytes != g_cublas.workspace_bytes) matmul_plans_free();
    if (g_cublas.owns_workspace) CUDA_CHECK(cudaFree(g_cublas.workspace));
    g_cublas.owns_workspace = 0;
    g_cublas.workspace = work;
    g_cublas.workspace_bytes = work ? bytes : 0;
}

// Detaches `work` if it is the attached workspace (a model's free, which must not take another
// model's: a plan that was never allocated has none).
static void cublas_detach_workspace(const void* work) {
    if (work && g_cublas.workspace == work && !g_cublas.owns_workspace) cublas_attach_workspace(NULL, 0);
}

// The classic handle on `stream` with our workspace: cublasSetStream resets the workspace to
// cuBLAS's own pool (which it would allocate outside the plan), so it is set again every time.
static void cublas_use_stream(cudaStream_t stream) {
    CUBLAS_CHECK(cublasSetStream(g_cublas.blas, stream));
    CUBLAS_CHECK(cublasSetWorkspace(g_cublas.blas, g_cublas.workspace, g_cublas.workspace_bytes));
}

// The largest power of two (<= 256) that divides the address and every column start.
static uint32_t mm_alignment(const void* p, int64_t ld, size_t elem) {
    uint64_t a = (uint64_t)(uintptr_t)p | (uint64_t)(ld * (int64_t)elem) | 256u;
    return (uint32_t)(a & (~a + 1));
}

static size_t mm_elem_size(cudaDataType_t t) { return t == CUDA_R_16BF ? 2 : 4; }

// cuBLASLt plans (descriptors, layouts and the heuristic's algorithm) cached per shape, types and
// alignment: a model calls a few dozen distinct products thousands of times, and asking the
// heuristic each time costs tens of microseconds of host time per product, more than many of
// the products themselves take on the GPU (ViT-B, the LoRA ranks). Process-wide, like the handles.
typedef struct {
    MatmulForm form;
    cudaDataType_t ctype, abtype;
    int bias, M, N, K;
    uint32_t al_a, al_b, al_c;
} MatmulPlanKey;

typedef struct {
    MatmulPlanKey key;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulAlgo_t algo;
    int found;             // the heuristic had an algorithm; else the product takes the fallback
} MatmulPlan;

#define MATMUL_PLANS 512
static MatmulPlan g_matmul_plans[MATMUL_PLANS];
static int g_matmul_plan_count;

static void matmul_plan_build(MatmulPlan* p) {
    const MatmulPlanKey* k = &p->key;
    cublasOperation_t opa, opb;
    uint64_t arows, acols, lda, brows, bcols, ldb;
    int M = k->M, N = k->N, K = k->K;
    switch (k->form) {  // each operand's transpose, stored rows x cols and leading dimension
        case MM_NT:
            opa = CUBLAS_OP_T; arows = K; acols = N; lda = K;
            opb = CUBLAS_OP_N; brows = K; bcols = M; ldb = K;
            break;
        case MM_NN:
            opa = CUBLAS_OP_N; arows = N; acols = K; lda = N;
            opb = CUBLAS_OP_N; brows = K; bcols = M; ldb = K;
            break;
        default:
            opa = CUBLAS_OP_N; arows = N; acols = K; lda = N;
            opb = CUBLAS_OP_T; brows = M; bcols = K; ldb = M;
            break;
    }
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)));
    if (k->bias) {
        cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;  // bias of D's type, one per row of D^T
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
    }
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->la, k->abtype, arows, acols, lda));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->lb, k->abtype, brows, bcols, ldb));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->lc, k->ctype, N, M, N));
    cublasLtMatmulPreference_t pref;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                      &g_cublas.workspace_bytes, sizeof(g_cublas.workspace_bytes)));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &k->al_a,
                                                      sizeof(k->al_a)));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &k->al_b,
                                                      sizeof(k->al_b)));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &k->al_c,
                                                      sizeof(k->al_c)));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &k->al_c,
                                                      sizeof(k->al_c)));
    cublasLtMatmulHeuristicResult_t heur;
    int found = 0;
    cublasStatus_t st =
        cublasLtMatmulAlgoGetHeuristic(g_cublas.lt, p->desc, p->la, p->lb, p->lc, p->lc, pref, 1, &heur, &found);
    if (st != CUBLAS_STATUS_SUCCESS && st != CUBLAS_STATUS_NOT_SUPPORTED) CUBLAS_CHECK(st);
    p->found = st == CUBLAS_STATUS_SUCCESS && found > 0;
    if (p->found) p->algo = heur.algo;
    CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
}

static void matmul_plan_destroy(MatmulPlan* p) {
    if (!p->desc) return;
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(p->lc));
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(p->lb));
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(p->la));
    CUBLAS_CHECK(cublasLtMatmulDescDestroy(p->desc));
    p->desc = NULL;
}

static void matmul_plans_free(void) {
    for (int i = 0; i < g_matmul_plan_count; i++) matmul_plan_destroy(&g_matmul_plans[i]);
    g_matmul_plan_count = 0;
}

// The plan for key: from the cache, or built (and cached while there is room; a plan that does
// not fit stays in the last slot, rebuilt when the next uncached key comes).
static const MatmulPlan* matmul_plan_get(const MatmulPlanKey* key) {
    for (int i = 0; i < g_matmul_plan_count; i++)
        if (memcmp(&g_matmul_plans[i].key, key, sizeof(*key)) == 0) return &g_matmul_plans[i];
    MatmulPlan* p = &g_matmul_plans[g_matmul_plan_count < MATMUL_PLANS ? g_matmul_plan_count++ : MATMUL_PLANS - 1];
    matmul_plan_destroy(p);  // the overflow slot, when the cache is full
    memset(p, 0, sizeof(*p));
    p->key = *key;  // memset first: the key is compared bytewise, padding included
    matmul_plan_build(p);
    return p;
}

// Where a product's bias went: into cuBLASLt's epilogue (or there was none), or left for the
// caller to add (an empty sum, or the cublasGemmEx fallback): the caller launches
// add_bias_rows_kernel right after, so that the bias costs no call of its own below the op.
typedef enum { MM_BIAS_DONE, MM_BIAS_LEFT } MatmulBias;

// The one generic product behind every wrapper below. A and B share a type; C has its own.
static MatmulBias matmul_generic_cuda(MatmulForm form, void* C, cudaDataType_t ctype, const void* A, const void* B,
                                cudaDataType_t abtype, const void* bias, int M, int N, int K, float alpha,
                                int accumulate, cudaStream_t stream) {
    if (M <= 0 || N <= 0) return MM_BIAS_DONE;
    if (K <= 0) {  // an empty sum: C keeps its value (accumulate) or becomes 0, then the bias
        if (!accumulate) CUDA_CHECK(cudaMemsetAsync(C, 0, (size_t)M * N * mm_elem_size(ctype), stream));
        return bias ? MM_BIAS_LEFT : MM_BIAS_DONE;
    }
    cublas_setup();  // the workspace the product may use: planned, or allocated now
    // column-major view: D[N x M] = op1(B) op2(A); "a" below is cuBLAS's first operand (our B)
    uint64_t lda = form == MM_NT ? K : N, ldb = form == MM_TN ? M : K;
    float beta = accumulate ? 1.0f : 0.0f;
    size_t ab = mm_elem_size(abtype), cb = mm_elem_size(ctype);
    uint32_t al_a = mm_alignment(B, lda, ab), al_b = mm_alignment(A, ldb, ab), al_c = mm_alignment(C, N, cb);
    if (bias) { uint32_t al_bias = mm_alignment(bias, 0, cb); al_c = al_c < al_bias ? al_c : al_bias; }
    MatmulPlanKey key;
    memset(&key, 0, sizeof(key));  // compared bytewise
    key.form = form; key.ctype = ctype; key.abtype = abtype; key.bias = bias != NULL;
    key.M = M; key.N = N; key.K = K; key.al_a = al_a; key.al_b = al_b; key.al_c = al_c;
    const MatmulPlan* plan = matmul_plan_get(&key);
    if (plan->found) {
        if (bias)
            CUBLAS_CHECK(
                cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
        cublasStatus_t st =
            cublasLtMatmul(g_cublas.lt, plan->desc, &alpha, B, plan->la, A, plan->lb, &beta, C, plan->lc, C, plan->lc,
                           &plan->algo, g_cublas.workspace, g_cublas.workspace_bytes, stream);
        if (st != CUBLAS_STATUS_NOT_SUPPORTED) { CUBLAS_CHECK(st); return MM_BIAS_DONE; }
    }
    cublasOperation_t opa = form == MM_NT ? CUBLAS_OP_T : CUBLAS_OP_N, opb = form == MM_TN ? CUBLAS_OP_T : CUBLAS_OP_N;

    // fallback: classic cuBLAS, same types and compute precision, bias in a separate pass
    cublas_use_stream(stream);
    CUBLAS_CHECK(cublasGemmEx(g_cublas.blas, opa, opb, N, M, K, &alpha, B, abtype, (int)lda, A, abtype, (int)ldb, &beta,
                              C, ctype, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return bias ? MM_BIAS_LEFT : MM_BIAS_DONE;
}

// Typed wrappers: the overload (output type, operand type) selects the precision path.
#define LLMC_MATMUL_FORM(name, form)                                                                                  \
    static void name(bf16* C, const bf16* A, const bf16* B, int M, int N, int K, float alpha, int accumulate,         \
                     cudaStream_t stream) {                                                                           \
        matmul_generic_cuda(form, C, CUDA_R_16BF, A, B, CUDA_R_16BF, NULL, M, N, K, alpha, accumulate, stream);       \
    }                                                                                                                 \
    static void name(float* C, const bf16* A, const bf16* B, int M, int N, int K, float alpha, int accumulate,        \
                     cudaStream_t stream) {                                                                           \
        matmul_generic_cuda(form, C, CUDA_R_32F, A, B, CUDA_R_16BF, NULL, M, N, K, alpha, accumulate, stream);        \
    }                                                                                                                 \
    static void name(float* C, const float* A, const float* B, int M, int N, int K, float alpha, int accumulate,      \
                     cudaStream_t stream) {                                                                           \
        matmul_generic_cuda(form, C, CUDA_R_32F, A, B, CUDA_R_32F, NULL, M, N, K, alpha, accumulate, stream);         \
    }
LLMC_MATMUL_FORM(matmul_nt_cuda, MM_NT)
LLMC_MATMUL_FORM(matmul_nn_cuda, MM_NN)
LLMC_MATMUL_FORM(matmul_tn_cuda, MM_TN)
#undef LLMC_MATMUL_FORM

// Batched products with explicit row-major leading dimensions, one (A, B, C) per batch entry from
// device arrays of pointers (so entries may share an operand, as grouped-query heads share their
// kv head). Entries must not share C when accumulating. Through cublasGemmBatchedEx: tensor cores
// with bf16 operands, fp32 accumulation, C in bf16 or fp32.
static void matmul_batched_cuda(MatmulForm form, void* const* C, cudaDataType_t ctype, const void* const* A,
                                const void* const* B, int M, int N, int K, int lda, int ldb, int ldc, float alpha,
                                int accumulate, int batch, cudaStream_t stream) {
    if (M <= 0 || N <= 0 || batch <= 0) return;
    cublas_setup();
    cublas_use_stream(stream);
    cublasOperation_t opa = form == MM_NT ? CUBLAS_OP_T : CUBLAS_OP_N, opb = form == MM_TN ? CUBLAS_OP_T : CUBLAS_OP_N;
    float beta = accumulate ? 1.0f : 0.0f;
    // column-major C^T [N x M] = op(B) op(A): cuBLAS's first operand is our B
    cublasStatus_t st = cublasGemmBatchedEx(
        g_cublas.blas, opa, opb, N, M, K, &alpha, (const void* const*)B, CUDA_R_16BF, ldb, (const void* const*)A,
        CUDA_R_16BF, lda, &beta, (void* const*)C, ctype, ldc, batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS)  // its one user is the tensor-core attention, which has an alternative
        fail(
            "cuBLAS error: cublasGemmBatchedEx (%d x %d x %d, %d products): %s; LLMC_ATTENTION=flash runs attention "
            "without it",
            M, N, K, batch, cublasGetStatusString(st));
}

// C[M,N] (+)= alpha * A . B^T + bias[N]: the nt product with its bias in the epilogue (or added
// right after, where matmul_generic_cuda leaves it).
static void matmul_nt_bias_cuda(bf16* C, const bf16* A, const bf16* B, const bf16* bias, int M, int N, int K,
                                float alpha, int accumulate, cudaStream_t stream) {
    if (matmul_generic_cuda(MM_NT, C, CUDA_R_16BF, A, B, CUDA_R_16BF, bias, M, N, K, alpha, accumulate, stream) ==
        MM_BIAS_LEFT)
        launch_kernel(grid_for((int64_t)M * N, 256), 256, 0, stream, add_bias_rows_kernel<bf16>, C, bias, M, N);
}
static void matmul_nt_bias_cuda(float* C, const float* A, const float* B, const float* bias, int M, int N, int K,
                                float alpha, int accumulate, cudaStream_t stream) {
    if (matmul_generic_cuda(MM_NT, C, CUDA_R_32F, A, B, CUDA_R_32F, bias, M, N, K, alpha, accumulate, stream) ==
        MM_BIAS_LEFT)
        launch_kernel(grid_for((int64_t)M * N, 256), 256, 0, stream, add_bias_rows_kernel<float>, C, bias, M, N);
}
