// test/resource_planted.cu: kernels planted to break each rule of scripts/check_resources.py
// (test/test_resource_check.py checks that each is caught and that the clean one passes). Compiled
// for its ptxas report only (nvcc -cubin), never run.
#include "../llmc/cuda/common.cuh"

#define PLANTED_LIVE 160   // values live at once: more registers than a 512-thread block may have
#define PLANTED_WARPS 16   // 16 warps of 32 threads: 512 threads, so at most 128 registers each

// PLANTED_LIVE values loaded in order (volatile: never reordered) and used only after the last
// load, so all of them are live at once.
static __device__ float planted_many_live(const volatile float* in) {
    float r[PLANTED_LIVE];
#pragma unroll
    for (int i = 0; i < PLANTED_LIVE; i++) r[i] = in[i * 1024 + threadIdx.x];
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < PLANTED_LIVE; i++) s = s * r[PLANTED_LIVE - 1 - i] + r[i];
    return s;
}

// > 128 registers x 512 threads: more than the 65,536 registers of an SM.
__global__ void planted_registers_kernel(float* out, const float* in) { out[threadIdx.x] = planted_many_live(in); }
// capped at 64 registers by its launch bounds: the live values spill.
__global__ void __launch_bounds__(1024) planted_spill_kernel(float* out, const float* in) { out[threadIdx.x] = planted_many_live(in); }
// launched with a block size only known at run time: the checker cannot vouch for it.
__global__ void planted_runtime_block_kernel(float* out) { out[threadIdx.x] = 1.0f; }
// never launched through launch_kernel: no block size at all.
__global__ void planted_unlaunched_kernel(float* out) { out[threadIdx.x] = 2.0f; }
// within every rule.
__global__ void planted_clean_kernel(float* out, const float* in) { out[threadIdx.x] = 2.0f * in[threadIdx.x]; }

void planted_launches(float* out, const float* in, int threads, cudaStream_t stream) {
    launch_kernel(1, dim3(32, PLANTED_WARPS), 0, stream, planted_registers_kernel, out, in);
    launch_kernel(1, 1024, 0, stream, planted_spill_kernel, out, in);
    launch_kernel(1, threads, 0, stream, planted_runtime_block_kernel, out);
    launch_kernel(grid_for(1000, 256), 256, 0, stream, planted_clean_kernel, out, in);
}
