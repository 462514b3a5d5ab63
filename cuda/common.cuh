// Shared helpers for the hf_paged kernels.
//
// Rules every kernel file follows (so the same source runs under NVRTC, nvcc and the CPU shim of
// tests/kernels/shim): includes limited to cuda_fp16.h / cuda_bf16.h; `extern "C"` entry points made
// by macro, each followed by HFP_EXPORT_LAUNCHER (empty on the GPU); dynamic shared memory only through
// HFP_DYNAMIC_SMEM; warp collectives always full-mask and warp-uniform; no __syncthreads after an
// early return; no communication between blocks.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef HFP_DYNAMIC_SMEM
#define HFP_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif
#ifndef HFP_EXPORT_LAUNCHER
#define HFP_EXPORT_LAUNCHER(name)
#endif

typedef __half hfp_f16;
typedef __nv_bfloat16 hfp_bf16;
typedef float hfp_f32;
#define HFP_T(tag) hfp_##tag  // element type of a kernel-name tag: f16, bf16, f32

namespace hfp {

constexpr int kThreads = 128;  // every kernel here runs 128 threads per block
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFullMask = 0xffffffffu;

// -inf without math headers (NVRTC has none): the IEEE bit pattern.
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }

// Full-warp butterfly reductions: every lane ends with the result. Callers keep them warp-uniform.
__device__ __forceinline__ float warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
    return v;
}
__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
    return v;
}

}  // namespace hfp
