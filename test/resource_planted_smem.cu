// test/resource_planted_smem.cu: a kernel planted with more than 48 KiB of static shared memory,
// for test/test_resource_check.py (ptxas itself refuses it; the checker must report it too).
#include "../llmc/cuda/common.cuh"

__global__ void planted_smem_kernel(float* out) {
    __shared__ float big[13000];  // 52,000 bytes
    big[threadIdx.x] = 1.0f;
    __syncthreads();
    out[threadIdx.x] = big[12999 - threadIdx.x];
}

void planted_smem_launch(float* out, cudaStream_t stream) { launch_kernel(1, 128, 0, stream, planted_smem_kernel, out); }
