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

// --- sm_80+ instructions: tensor-core mma, ldmatrix, cp.async -----------------------------------
// On the GPU these are inline PTX; under the CPU shim (HFP_CUDASHIM) the shim computes the same
// fragments for the whole warp (tests/backends/shim/shim.h documents the layouts). Every call is
// warp-wide (all 32 lanes, .aligned) and warp-uniform.

// d = a * b + c for one m16n8k16 tile, fp32 accumulators; T (__half or __nv_bfloat16) is the type of
// the a and b fragments (two values per 32-bit register, lower column / row in the low half).
template <typename A, typename B> struct IsSame { static constexpr bool value = false; };
template <typename A> struct IsSame<A, A> { static constexpr bool value = true; };

template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
#ifdef HFP_CUDASHIM
    ::cudashim::mma_16816(__LINE__, !IsSame<T, __half>::value, d, a, b, d);
#else
    if constexpr (IsSame<T, __half>::value) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    } else {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
#endif
}

// ldmatrix.x4 (.trans): lanes 8m..8m+7 give the 16-byte-aligned shared-memory rows of 8x8 matrix m.
template <bool Trans>
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const void* row) {
#ifdef HFP_CUDASHIM
    ::cudashim::ldsm_x4(__LINE__, Trans, r, row);
#else
    const unsigned addr = (unsigned)__cvta_generic_to_shared(row);
    if constexpr (Trans) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
    } else {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
    }
#endif
}

// 16 bytes global -> shared, asynchronously (cp.async.cg: bypasses L1). fill = false writes zeros and
// reads nothing. Complete only after cp_async_wait<n>() of a later group, then a barrier for the block.
__device__ __forceinline__ void cp_async_16(void* smem, const void* global, bool fill) {
#ifdef HFP_CUDASHIM
    ::cudashim::cp_async(smem, global, 16, fill);
#else
    const unsigned addr = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(addr), "l"(global), "r"(fill ? 16 : 0));
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#ifdef HFP_CUDASHIM
    ::cudashim::cp_async_commit();
#else
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}
// Wait until at most n of this thread's most recent committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifdef HFP_CUDASHIM
    ::cudashim::cp_async_wait(N);
#else
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N));
#endif
}

// One pipeline step's copies: stage(args...) (a tile's K then V, two commit groups) while has_tile, else
// two empty groups, so that every step commits the same number and cp_async_wait's counts stay fixed.
template <class Stage, class... Args>
__device__ __forceinline__ void stage_or_empty(bool has_tile, const Stage& stage, Args... args) {
    if (has_tile) {
        stage(args...);
    } else {
        cp_async_commit();
        cp_async_commit();
    }
}

// The low / high value of a register of T pairs, as float.
__device__ __forceinline__ float unpack_lo(unsigned w, __half) { return __half2float(__ushort_as_half((unsigned short)w)); }
__device__ __forceinline__ float unpack_hi(unsigned w, __half) {
    return __half2float(__ushort_as_half((unsigned short)(w >> 16)));
}
__device__ __forceinline__ float unpack_lo(unsigned w, __nv_bfloat16) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float unpack_hi(unsigned w, __nv_bfloat16) { return __uint_as_float(w & 0xffff0000u); }

// Two floats as one register of T pairs (low half = a).
__device__ __forceinline__ unsigned pack2(float a, float b, __half) {
    return (unsigned)__half_as_ushort(__float2half_rn(a)) | ((unsigned)__half_as_ushort(__float2half_rn(b)) << 16);
}
__device__ __forceinline__ unsigned pack2(float a, float b, __nv_bfloat16) {
    return (unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(a)) |
           ((unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(b)) << 16);
}

}  // namespace hfp
