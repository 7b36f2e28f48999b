// test/emu/emu_cublas.h: the cuBLAS and cuBLASLt calls of llmc/cuda/matmul.cuh on the CPU emulator
// (test/emu/emu.h), each checked against its documented contract before it computes: so the
// backend's GEMM code runs the same calls on the emulator as on a GPU, and a call a GPU would
// refuse or run into garbage is an error here, not a silently correct loop.
// Checked (cuBLAS / cuBLASLt API reference):
//   - dimensions: m, n, k >= 0; column-major leading dimensions lda >= rows of A as stored (k when
//     A is transposed, else m), ldb likewise, ldc >= m: else CUBLAS_STATUS_INVALID_VALUE;
//     cuBLASLt layouts must agree with op(A) [m x k], op(B) [k x n], C and D [m x n];
//   - types: with CUBLAS_COMPUTE_32F and fp32 scale, A/B bf16 with C/D bf16 or fp32, or all fp32
//     (what the backend uses; the library has more): else CUBLAS_STATUS_NOT_SUPPORTED;
//   - memory: every operand, from its pointer to its last element ((cols - 1) * ld + rows), inside
//     one device allocation and out of the guard zones, aligned to its element; the pointer arrays
//     of a batched call on the device; C is not read when beta = 0, as in cuBLAS;
//   - cuBLASLt alignment: an algorithm chosen under CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES
//     (default 256) needs every pointer and leading dimension (in bytes) that aligned;
//   - workspaces: cublasLtMatmul's at least what the algorithm needs (CUBLAS_STATUS_INVALID_VALUE),
//     device memory, 256-byte aligned; cublasSetWorkspace's 256-byte aligned;
//   - the bias epilogue: a bias pointer of D's type with one element per row of D.
// The emulated heuristic offers no algorithm when an alignment below 16 bytes is declared (so the
// cublasGemmEx fallback of matmul.cuh runs on the emulator too); its algorithms need min(the
// allowed workspace, 4 bytes per element of D) of workspace (split-K partial sums).
// Products are fp32 sums in k order of the operands converted to float, rounded once to D's type.
#pragma once
#include <cublasLt.h>
#include <cublas_v2.h>

struct cublasContext {        // cublasHandle_t
    cudaStream_t stream;
};
struct cublasLtContext {      // cublasLtHandle_t
    int unused;
};
typedef struct {              // behind cublasLtMatmulDesc_t
    cublasComputeType_t compute;
    cudaDataType_t scale;
    cublasOperation_t transa, transb;
    cublasLtEpilogue_t epilogue;
    const void* bias;
} EmuLtDesc;
typedef struct {              // behind cublasLtMatrixLayout_t
    cudaDataType_t type;
    uint64_t rows, cols;
    int64_t ld;
} EmuLtLayout;
typedef struct {              // behind cublasLtMatmulPreference_t
    size_t max_workspace;
    uint32_t min_align[4];    // A, B, C, D
} EmuLtPref;
#define EMU_LT_ALGO_MAGIC 0x656d75616c676fULL  // in cublasLtMatmulAlgo_t.data[0]: one of ours

// A contract violation cuBLAS reports by a status: said on stderr, status returned.
static cublasStatus_t emu_blas_status(cublasStatus_t st, const char* call, const char* why) {
    fprintf(stderr, "emu: %s: %s (%s)\n", call, why, cublasGetStatusString(st));
    return st;
}
// One cuBLAS would not notice and run into garbage or a fault on a GPU: the run ends here.
static void emu_blas_fatal(const char* call, const char* why) {
    fprintf(stderr, "emu: %s: %s\n", call, why);
    exit(1);
}

static size_t emu_blas_elem(cudaDataType_t t) {
    return t == CUDA_R_16BF || t == CUDA_R_16F ? 2 : t == CUDA_R_32F ? 4 : 0;
}
static float emu_blas_load(const void* p, cudaDataType_t t, int64_t i) {
    return t == CUDA_R_16BF ? __bfloat162float(((const __nv_bfloat16*)p)[i]) : ((const float*)p)[i];
}

// The (A/B, C/D) type pairs supported with CUBLAS_COMPUTE_32F and an fp32 scale (the subset used).
static int emu_blas_types_ok(cudaDataType_t ab, cudaDataType_t c, cublasComputeType_t compute) {
    if (compute != CUBLAS_COMPUTE_32F) return 0;
    return (ab == CUDA_R_16BF && (c == CUDA_R_16BF || c == CUDA_R_32F)) || (ab == CUDA_R_32F && c == CUDA_R_32F);
}

// A stored column-major rows x cols matrix with leading dimension ld at p: device memory, inside
// one allocation, clear of the guard zones, element-aligned.
static void emu_blas_operand(const char* call, const char* which, const void* p, cudaDataType_t t, int64_t rows,
                             int64_t cols, int64_t ld) {
    if (rows <= 0 || cols <= 0) return;
    char why[160];
    size_t e = emu_blas_elem(t);
    if (!p) { snprintf(why, sizeof(why), "%s is NULL", which); emu_blas_fatal(call, why); }
    if ((uintptr_t)p % e) {
        snprintf(why, sizeof(why), "%s at %p is not aligned to its %zu-byte element", which, p, e);
        emu_blas_fatal(call, why);
    }
    emu_check_side((uintptr_t)p, (size_t)((cols - 1) * ld + rows) * e, 1, call, which);
}

// The largest power of two (<= 256) dividing both the address and the leading dimension in bytes.
static uint32_t emu_blas_alignment(const void* p, int64_t ld, size_t e) {
    uint64_t a = (uint64_t)(uintptr_t)p | (uint64_t)(ld * (int64_t)e) | 256u;
    return (uint32_t)(a & (~a + 1));
}

// D[m x n] = alpha op(A) op(B) + beta C (+ bias[i] per row), column-major; C is not read when
// beta = 0. Operands go to float first: op(A) as [m][k], op(B) as [n][k], so each sum runs in k order.
static void emu_blas_gemm(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, float alpha,
                          const void* A, int64_t lda, const void* B, int64_t ldb, cudaDataType_t abtype, float beta,
                          const void* C, int64_t ldc, void* D, int64_t ldd, cudaDataType_t ctype, const void* bias) {
    std::vector<float> a((size_t)(m * k)), b((size_t)(n * k));
    for (int64_t i = 0; i < m; i++)
        for (int64_t p = 0; p < k; p++)
            a[i * k + p] = emu_blas_load(A, abtype, ta == CUBLAS_OP_N ? i + p * lda : p + i * lda);
    for (int64_t j = 0; j < n; j++)
        for (int64_t p = 0; p < k; p++)
            b[j * k + p] = emu_blas_load(B, abtype, tb == CUBLAS_OP_N ? p + j * ldb : j + p * ldb);
    for (int64_t j = 0; j < n; j++)
        for (int64_t i = 0; i < m; i++) {
            const float *ai = &a[i * k], *bj = &b[j * k];
            float s = 0.0f;
            for (int64_t p = 0; p < k; p++) s += ai[p] * bj[p];
            float c = alpha * s + (beta != 0.0f ? beta * emu_blas_load(C, ctype, i + j * ldc) : 0.0f) +
                      (bias ? emu_blas_load(bias, ctype, i) : 0.0f);
            if (ctype == CUDA_R_16BF) ((__nv_bfloat16*)D)[i + j * ldd] = __float2bfloat16(c);
            else ((float*)D)[i + j * ldd] = c;
        }
}

// ---- classic cuBLAS ----------------------------------------------------------------------------

extern "C" {
const char* cublasGetStatusString(cublasStatus_t st) {
    switch (st) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    default: return "CUBLAS_STATUS (other)";
    }
}
cublasStatus_t cublasCreate_v2(cublasHandle_t* h) {
    *h = new cublasContext();
    (*h)->stream = NULL;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy_v2(cublasHandle_t h) { delete h; return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasSetStream_v2(cublasHandle_t h, cudaStream_t st) { h->stream = st; return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t h, void* ws, size_t bytes) {
    (void)h;
    if (bytes && (uintptr_t)ws % 256)
        return emu_blas_status(CUBLAS_STATUS_INVALID_VALUE, "cublasSetWorkspace",
                               "the workspace is not 256-byte aligned");
    if (bytes) emu_check_side((uintptr_t)ws, bytes, 1, "cublasSetWorkspace", "workspace");
    return CUBLAS_STATUS_SUCCESS;
}
}

// The checks cublasGemmEx and cublasGemmBatchedEx share; CUBLAS_STATUS_SUCCESS when they pass.
static cublasStatus_t emu_gemm_ex_check(const char* call, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                                        int k, cudaDataType_t at, int lda, cudaDataType_t bt, int ldb,
                                        cudaDataType_t ct, int ldc, cublasComputeType_t compute) {
    char why[200];
    if (m < 0 || n < 0 || k < 0) {
        snprintf(why, sizeof(why), "negative size m=%d n=%d k=%d", m, n, k);
        return emu_blas_status(CUBLAS_STATUS_INVALID_VALUE, call, why);
    }
    int arows = ta == CUBLAS_OP_N ? m : k, brows = tb == CUBLAS_OP_N ? k : n;
    if (lda < (arows > 1 ? arows : 1) || ldb < (brows > 1 ? brows : 1) || ldc < (m > 1 ? m : 1)) {
        snprintf(why, sizeof(why),
                 "leading dimension too small: lda=%d (A has %d rows), ldb=%d (B has %d rows), ldc=%d (C has %d rows)",
                 lda, arows, ldb, brows, ldc, m);
        return emu_blas_status(CUBLAS_STATUS_INVALID_VALUE, call, why);
    }
    if (at != bt || !emu_blas_types_ok(at, ct, compute)) {
        snprintf(why, sizeof(why), "types A %d, B %d, C %d with compute type %d", (int)at, (int)bt, (int)ct,
                 (int)compute);
        return emu_blas_status(CUBLAS_STATUS_NOT_SUPPORTED, call, why);
    }
    return CUBLAS_STATUS_SUCCESS;
}

// A checked product's computation: run now on `stream`, or recorded when the stream captures a
// CUDA graph (emu.h; `compute` then holds copies of everything it reads on the host).
static void emu_blas_issue(cudaStream_t stream, const std::function<void()>& compute) {
    if (emu_capturing(stream)) {
        emu_capture_record(EMU_OP_BLAS, [=]() { emu_counts.blas_calls++; compute(); });
        return;
    }
    if (!stream && emu_capture.graph) {
        emu_capture_refuses("a cuBLAS call", "a product on the legacy stream", cudaErrorStreamCaptureImplicit);
        emu_blas_fatal("cuBLAS", "a product on the legacy stream during a capture");
    }
    emu_stream_issue(stream);
    emu_counts.blas_calls++;
    compute();
}

extern "C" {
cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                            const void* alpha, const void* A, cudaDataType at, int lda, const void* B, cudaDataType bt,
                            int ldb, const void* beta, void* C, cudaDataType ct, int ldc, cublasComputeType_t compute,
                            cublasGemmAlgo_t algo) {
    (void)algo;
    cublasStatus_t st = emu_gemm_ex_check("cublasGemmEx", ta, tb, m, n, k, at, lda, bt, ldb, ct, ldc, compute);
    if (st != CUBLAS_STATUS_SUCCESS) return st;
    if (!m || !n) return CUBLAS_STATUS_SUCCESS;
    float a = *(const float*)alpha, b = *(const float*)beta;
    emu_blas_issue(h->stream, [=]() {
        if (k) {
            emu_blas_operand("cublasGemmEx", "A", A, at, ta == CUBLAS_OP_N ? m : k, ta == CUBLAS_OP_N ? k : m, lda);
            emu_blas_operand("cublasGemmEx", "B", B, bt, tb == CUBLAS_OP_N ? k : n, tb == CUBLAS_OP_N ? n : k, ldb);
        }
        emu_blas_operand("cublasGemmEx", "C", C, ct, m, n, ldc);
        emu_blas_gemm(ta, tb, m, n, k, a, A, lda, B, ldb, at, b, C, ldc, C, ldc, ct, NULL);
        emu_guards_check("cublasGemmEx");
    });
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGemmBatchedEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                                   const void* alpha, const void* const Aarray[], cudaDataType at, int lda,
                                   const void* const Barray[], cudaDataType bt, int ldb, const void* beta,
                                   void* const Carray[], cudaDataType ct, int ldc, int batch,
                                   cublasComputeType_t compute, cublasGemmAlgo_t algo) {
    (void)algo;
    const char* call = "cublasGemmBatchedEx";
    cublasStatus_t st = emu_gemm_ex_check(call, ta, tb, m, n, k, at, lda, bt, ldb, ct, ldc, compute);
    if (st != CUBLAS_STATUS_SUCCESS) return st;
    if (batch < 0) return emu_blas_status(CUBLAS_STATUS_INVALID_VALUE, call, "negative batch count");
    if (!m || !n || !batch) return CUBLAS_STATUS_SUCCESS;
    // the pointer arrays are read by the GPU: they must be device memory (read when the product runs)
    emu_check_side((uintptr_t)Aarray, sizeof(void*) * batch, 1, call, "Aarray");
    emu_check_side((uintptr_t)Barray, sizeof(void*) * batch, 1, call, "Barray");
    emu_check_side((uintptr_t)Carray, sizeof(void*) * batch, 1, call, "Carray");
    float a = *(const float*)alpha, b = *(const float*)beta;
    emu_blas_issue(h->stream, [=]() {
        for (int e = 0; e < batch; e++) {
            if (k) {
                int64_t ar = ta == CUBLAS_OP_N ? m : k, ac = ta == CUBLAS_OP_N ? k : m;
                int64_t br = tb == CUBLAS_OP_N ? k : n, bc = tb == CUBLAS_OP_N ? n : k;
                emu_blas_operand(call, "A[i]", Aarray[e], at, ar, ac, lda);
                emu_blas_operand(call, "B[i]", Barray[e], bt, br, bc, ldb);
            }
            emu_blas_operand(call, "C[i]", Carray[e], ct, m, n, ldc);
            emu_blas_gemm(ta, tb, m, n, k, a, Aarray[e], lda, Barray[e], ldb, at, b, Carray[e], ldc, Carray[e], ldc,
                          ct, NULL);
        }
        emu_guards_check(call);
    });
    return CUBLAS_STATUS_SUCCESS;
}

// ---- cuBLASLt ----------------------------------------------------------------------------------

cublasStatus_t cublasLtCreate(cublasLtHandle_t* h) { *h = new cublasLtContext(); return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) { delete h; return CUBLAS_STATUS_SUCCESS; }

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* d, cublasComputeType_t compute, cudaDataType_t scale) {
    EmuLtDesc* e = new EmuLtDesc();
    e->compute = compute;
    e->scale = scale;
    e->transa = e->transb = CUBLAS_OP_N;
    e->epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    e->bias = NULL;
    *d = (cublasLtMatmulDesc_t)e;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) { delete (EmuLtDesc*)d; return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr,
                                              const void* buf, size_t size) {
    EmuLtDesc* e = (EmuLtDesc*)d;
    const char* call = "cublasLtMatmulDescSetAttribute";
    switch (attr) {
    case CUBLASLT_MATMUL_DESC_TRANSA:
    case CUBLASLT_MATMUL_DESC_TRANSB:
        if (size != sizeof(int32_t))
            return emu_blas_status(CUBLAS_STATUS_INVALID_VALUE, call, "transpose attribute is an int32_t");
        memcpy(attr == CUBLASLT_MATMUL_DESC_TRANSA ? &e->transa : &e->transb, buf, size);
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_EPILOGUE:
        if (size != sizeof(uint32_t))
            return emu_blas_status(CUBLAS_STATUS_INVALID_VALUE, call, "epilogue attribute is a uint32_t");
        memcpy(&e->epilogue, buf, size);
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER:
        if (size != sizeof(void*))
            return emu_blas_status(CUBLAS_STATUS_INVALID_VALUE, call, "bias pointer attribute is a pointer");
        memcpy(&e->bias, buf, size);
        return CUBLAS_STATUS_SUCCESS;
    default:
        emu_blas_fatal(call, "an attribute the emulator does not model");
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* l, cudaDataType type, uint64_t rows, uint64_t cols,
                                          int64_t ld) {
    if (ld < (int64_t)(rows > 1 ? rows : 1))
        return emu_blas_status(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatrixLayoutCreate",
                               "leading dimension smaller than the rows");
    EmuLtLayout* e = new EmuLtLayout();
    e->type = type;
    e->rows = rows;
    e->cols = cols;
    e->ld = ld;
    *l = (cublasLtMatrixLayout_t)e;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
    delete (EmuLtLayout*)l;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* p) {
    EmuLtPref* e = new EmuLtPref();
    e->max_workspace = 0;
    for (int i = 0; i < 4; i++) e->min_align[i] = 256;  // cuBLASLt's default: 256-byte aligned operands
    *p = (cublasLtMatmulPreference_t)e;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
    delete (EmuLtPref*)p;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void* buf,
                                                    size_t size) {
    EmuLtPref* e = (EmuLtPref*)p;
    const char* call = "cublasLtMatmulPreferenceSetAttribute";
    if (attr == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES) {
        if (size != sizeof(uint64_t))
            return emu_blas_status(CUBLAS_STATUS_INVALID_VALUE, call, "max workspace is a uint64_t");
        memcpy(&e->max_workspace, buf, size);
        return CUBLAS_STATUS_SUCCESS;
    }
    int which = attr == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES   ? 0
                : attr == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES ? 1
                : attr == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES ? 2
                : attr == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES ? 3
                                                                     : -1;
    if (which < 0) emu_blas_fatal(call, "an attribute the emulator does not model");
    if (size != sizeof(uint32_t)) return emu_blas_status(CUBLAS_STATUS_INVALID_VALUE, call, "alignment is a uint32_t");
    memcpy(&e->min_align[which], buf, size);
    return CUBLAS_STATUS_SUCCESS;
}
}

// Whether the descriptor and layouts describe one valid product D = op(A) op(B) (+ C); else the
// status cuBLASLt returns, said on stderr.
static cublasStatus_t emu_lt_check_shapes(const char* call, const EmuLtDesc* d, const EmuLtLayout* a,
                                          const EmuLtLayout* b, const EmuLtLayout* c, const EmuLtLayout* dd) {
    char why[240];
    uint64_t am = d->transa == CUBLAS_OP_N ? a->rows : a->cols, ak = d->transa == CUBLAS_OP_N ? a->cols : a->rows;
    uint64_t bk = d->transb == CUBLAS_OP_N ? b->rows : b->cols, bn = d->transb == CUBLAS_OP_N ? b->cols : b->rows;
    if (am != dd->rows || bn != dd->cols || ak != bk || c->rows != dd->rows || c->cols != dd->cols) {
        snprintf(why, sizeof(why),
                 "shapes do not agree: op(A) %llu x %llu, op(B) %llu x %llu, C %llu x %llu, D %llu x %llu",
                 (unsigned long long)am, (unsigned long long)ak, (unsigned long long)bk, (unsigned long long)bn,
                 (unsigned long long)c->rows, (unsigned long long)c->cols, (unsigned long long)dd->rows,
                 (unsigned long long)dd->cols);
        return emu_blas_status(CUBLAS_STATUS_INVALID_VALUE, call, why);
    }
    if (a->type != b->type || c->type != dd->type || d->scale != CUDA_R_32F ||
        !emu_blas_types_ok(a->type, dd->type, d->compute)) {
        snprintf(why, sizeof(why), "types A %d, B %d, C %d, D %d, scale %d with compute type %d", (int)a->type,
                 (int)b->type, (int)c->type, (int)dd->type, (int)d->scale, (int)d->compute);
        return emu_blas_status(CUBLAS_STATUS_NOT_SUPPORTED, call, why);
    }
    if (d->epilogue != CUBLASLT_EPILOGUE_DEFAULT && d->epilogue != CUBLASLT_EPILOGUE_BIAS)
        return emu_blas_status(CUBLAS_STATUS_NOT_SUPPORTED, call, "an epilogue the emulator does not model");
    return CUBLAS_STATUS_SUCCESS;
}

extern "C" {
// One algorithm when the product is valid and every declared alignment is at least 16 bytes.
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t la,
                                              cublasLtMatrixLayout_t lb, cublasLtMatrixLayout_t lc,
                                              cublasLtMatrixLayout_t ld, cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t results[], int* count) {
    (void)h;
    const char* call = "cublasLtMatmulAlgoGetHeuristic";
    *count = 0;
    if (requested <= 0) return emu_blas_status(CUBLAS_STATUS_INVALID_VALUE, call, "requestedAlgoCount <= 0");
    const EmuLtDesc* d = (const EmuLtDesc*)desc;
    const EmuLtLayout* dd = (const EmuLtLayout*)ld;
    cublasStatus_t st =
        emu_lt_check_shapes(call, d, (const EmuLtLayout*)la, (const EmuLtLayout*)lb, (const EmuLtLayout*)lc, dd);
    if (st != CUBLAS_STATUS_SUCCESS) return st;
    const EmuLtPref* p = (const EmuLtPref*)pref;
    for (int i = 0; i < 4; i++)
        if (p->min_align[i] < 16) return CUBLAS_STATUS_NOT_SUPPORTED;
    memset(&results[0], 0, sizeof(results[0]));
    size_t want = (size_t)(dd->rows * dd->cols * 4);
    results[0].workspaceSize = want < p->max_workspace ? want : p->max_workspace;
    results[0].algo.data[0] = EMU_LT_ALGO_MAGIC;
    results[0].algo.data[1] = results[0].workspaceSize;
    for (int i = 0; i < 4; i++) results[0].algo.data[2 + i] = p->min_align[i];
    results[0].state = CUBLAS_STATUS_SUCCESS;
    results[0].wavesCount = 1.0f;
    *count = 1;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t desc, const void* alpha, const void* A,
                              cublasLtMatrixLayout_t la, const void* B, cublasLtMatrixLayout_t lb, const void* beta,
                              const void* C, cublasLtMatrixLayout_t lc, void* D, cublasLtMatrixLayout_t ldd,
                              const cublasLtMatmulAlgo_t* algo, void* workspace, size_t ws_bytes, cudaStream_t stream) {
    (void)h;
    const char* call = "cublasLtMatmul";
    char why[200];
    const EmuLtDesc* d = (const EmuLtDesc*)desc;
    const EmuLtLayout *a = (const EmuLtLayout*)la, *b = (const EmuLtLayout*)lb, *c = (const EmuLtLayout*)lc,
                      *dd = (const EmuLtLayout*)ldd;
    cublasStatus_t st = emu_lt_check_shapes(call, d, a, b, c, dd);
    if (st != CUBLAS_STATUS_SUCCESS) return st;
    if (!algo || algo->data[0] != EMU_LT_ALGO_MAGIC)
        emu_blas_fatal(call, "the algorithm is not one cublasLtMatmulAlgoGetHeuristic returned");
    if (ws_bytes < algo->data[1]) {
        snprintf(why, sizeof(why), "workspace of %zu bytes, the algorithm needs %llu", ws_bytes,
                 (unsigned long long)algo->data[1]);
        return emu_blas_status(CUBLAS_STATUS_INVALID_VALUE, call, why);
    }
    if (ws_bytes) {
        if ((uintptr_t)workspace % 256) emu_blas_fatal(call, "the workspace is not 256-byte aligned");
        emu_check_side((uintptr_t)workspace, ws_bytes, 1, call, "workspace");
    }
    const void* ptrs[4] = {A, B, C, D};
    const EmuLtLayout* lays[4] = {a, b, c, dd};
    for (int i = 0; i < 4; i++) {  // the alignment the algorithm was chosen for
        uint32_t have = emu_blas_alignment(ptrs[i], lays[i]->ld, emu_blas_elem(lays[i]->type));
        if (have < algo->data[2 + i]) {
            snprintf(why, sizeof(why),
                     "%c at %p with leading dimension %lld is %u-byte aligned, the algorithm was chosen for %llu",
                     "ABCD"[i], ptrs[i], (long long)lays[i] -> ld, have, (unsigned long long)algo -> data[2 + i]);
            emu_blas_fatal(call, why);
        }
    }
    float fa = *(const float*)alpha, fb = *(const float*)beta;
    int64_t k = d->transa == CUBLAS_OP_N ? (int64_t)a->cols : (int64_t)a->rows;
    const void* bias = NULL;
    if (d->epilogue == CUBLASLT_EPILOGUE_BIAS) {
        if (!d->bias) emu_blas_fatal(call, "CUBLASLT_EPILOGUE_BIAS without CUBLASLT_MATMUL_DESC_BIAS_POINTER");
        bias = d->bias;
    }
    // the descriptors by value: a plan changed after a capture does not change the captured product
    EmuLtDesc dv = *d;
    EmuLtLayout av = *a, bv = *b, cv = *c, dl = *dd;
    emu_blas_issue(stream, [=]() {
        if (k) {
            emu_blas_operand(call, "A", A, av.type, av.rows, av.cols, av.ld);
            emu_blas_operand(call, "B", B, bv.type, bv.rows, bv.cols, bv.ld);
        }
        if (fb != 0.0f) emu_blas_operand(call, "C", C, cv.type, cv.rows, cv.cols, cv.ld);
        emu_blas_operand(call, "D", D, dl.type, dl.rows, dl.cols, dl.ld);
        if (bias)
            emu_blas_operand(call, "bias (one element of D's type per row of D)", bias, dl.type, dl.rows, 1, dl.rows);
        emu_blas_gemm(dv.transa, dv.transb, dl.rows, dl.cols, k, fa, A, av.ld, B, bv.ld, av.type, fb, C, cv.ld, D,
                      dl.ld, dl.type, bias);
        emu_guards_check(call);
    });
    return CUBLAS_STATUS_SUCCESS;
}
}
