// Quantised KV codes: the formats of hf_paged/kv_formats.py (layout and the PyTorch reference codec).
//
//   codes  : uint8 [Hkv, num_blocks, BS, D * bits / 8]   fp8: float8 bits; int8: two's complement;
//                                                        int4: element 2i low nibble, 2i + 1 high, 0..15
//   scales : bf16  [Hkv, num_blocks, BS, S]              8-bit: S = 1; int4: D/16 scales then D/16 minima
//
// Encoding matches kv_formats.quantize bit for bit (tests/backends/test_quantised_kernels.py): fp32
// math, the scale rounded to bf16 before use (an all-zero row or group gets 1; fp8: the least-error one
// of 16 candidates, searched_scale below), codes from
// x / stored scale (IEEE division: these kernels are never built with fast math), clamped, then
// round-to-nearest-even (integers) or the fp8 conversion below. Decoding is exact in fp32 up to the
// int4 minimum's addition: a code has at most 8 significant bits and a bf16 scale 8, so
// code * scale is exact and FMA contraction cannot change a result; values then round once to T,
// as kv_formats.dequantize(..., T) does.
#pragma once
#include "common.cuh"

// Format ids: the -DHFP_ONLY_KV_FORMAT values of attention.cu's modules (host mirror:
// hf_paged/backends/kernel_registry.py KV_FORMAT_IDS).
#define HFP_KV_MODEL 1     // unquantised, the model dtype
#define HFP_KV_FP8E4M3 2
#define HFP_KV_FP8E5M2 3
#define HFP_KV_INT8 4
#define HFP_KV_INT4 5

namespace hfp {

// float -> 8-bit float with M mantissa bits and exponent bias B (e4m3fn: 3, 7; e5m2: 2, 15), round to
// nearest even, sign kept (-0 and values rounding to 0 give 0x80 when negative), as torch's
// .to(torch.float8_*) does. |x| must not exceed the format's largest finite value: callers clamp to
// code_max first, as kv_formats.quantize does (so "satfinite" never has to act). NaN gives 0x7f | sign.
// Integer arithmetic only, so the CPU shim runs exactly what the GPU runs (no cuda_fp8.h needed).
template <int M, int B>
__device__ __forceinline__ unsigned float_to_fp8(float x) {
    const unsigned bits = __float_as_uint(x);
    const unsigned sign = (bits >> 24) & 0x80u;
    const unsigned mag = bits & 0x7fffffffu;
    if (mag > 0x7f800000u) return sign | 0x7fu;
    constexpr unsigned kMinNormal = (unsigned)(128 - B) << 23;        // fp32 bits of 2^(1 - B)
    if (mag < kMinNormal) {
        // Subnormal codes are multiples of 2^(1 - B - M): scale exactly, round to an integer (2^M = the
        // smallest normal code, whose bits are the same integer).
        return sign | (unsigned)__float2int_rn(__uint_as_float(mag) * (float)(1 << (B - 1 + M)));
    }
    constexpr int kDrop = 23 - M;                                      // mantissa bits dropped
    const unsigned rounded = mag + ((1u << (kDrop - 1)) - 1u) + ((mag >> kDrop) & 1u);  // a carry bumps the exponent
    return sign | ((rounded >> kDrop) - ((unsigned)(127 - B) << M));
}

// The inverse for finite codes (the ones float_to_fp8 writes): the code's exponent and mantissa placed
// in an fp32 pattern with its bias 127, then an exact multiply by 2^(127 - B) (subnormal codes become
// fp32 subnormals, which the multiply handles: no flush-to-zero in these builds).
template <int M, int B>
__device__ __forceinline__ float fp8_to_float(unsigned code) {
    const float shifted = __uint_as_float(((code & 0x80u) << 24) | ((code & 0x7fu) << (23 - M)));
    return shifted * __uint_as_float((unsigned)(254 - B) << 23);
}

// Format traits: kBits per element, kGroup elements per scale along head_dim (0 = the whole head),
// kCodeMax the largest code magnitude, kScaleSearch whether the row scale is searched (searched_scale);
// encode(x) of an already scaled, unclamped x; decode(code).
template <int F> struct KvFormat;

template <> struct KvFormat<HFP_KV_FP8E4M3> {
    static constexpr int kBits = 8, kGroup = 0;
    static constexpr bool kScaleSearch = true;
    static constexpr float kCodeMax = 448.f;
    __device__ static __forceinline__ unsigned encode(float x) {
        return float_to_fp8<3, 7>(fminf(fmaxf(x, -kCodeMax), kCodeMax));
    }
    __device__ static __forceinline__ float decode(unsigned c) { return fp8_to_float<3, 7>(c); }
};

template <> struct KvFormat<HFP_KV_FP8E5M2> {
    static constexpr int kBits = 8, kGroup = 0;
    static constexpr bool kScaleSearch = true;
    static constexpr float kCodeMax = 57344.f;
    __device__ static __forceinline__ unsigned encode(float x) {
        return float_to_fp8<2, 15>(fminf(fmaxf(x, -kCodeMax), kCodeMax));
    }
    __device__ static __forceinline__ float decode(unsigned c) { return fp8_to_float<2, 15>(c); }
};

template <> struct KvFormat<HFP_KV_INT8> {
    static constexpr int kBits = 8, kGroup = 0;
    static constexpr bool kScaleSearch = false;
    static constexpr float kCodeMax = 127.f;
    __device__ static __forceinline__ unsigned encode(float x) {
        return (unsigned)__float2int_rn(fminf(fmaxf(x, -kCodeMax), kCodeMax)) & 0xffu;
    }
    __device__ static __forceinline__ float decode(unsigned c) { return (float)(int)(signed char)c; }
};

// Asymmetric: x is (value - minimum) / scale; codes 0..15.
template <> struct KvFormat<HFP_KV_INT4> {
    static constexpr int kBits = 4, kGroup = 16;
    static constexpr bool kScaleSearch = false;
    static constexpr float kCodeMax = 15.f;
    __device__ static __forceinline__ unsigned encode(float x) {
        return (unsigned)imin(imax(__float2int_rn(x), 0), 15);   // rounding first, then clamping, as torch
    }
    __device__ static __forceinline__ float decode(unsigned c) { return (float)c; }
};

template <int F>
struct KvLayout {
    static constexpr int kBits = KvFormat<F>::kBits;
    static constexpr int kGroup = KvFormat<F>::kGroup;
    // Per (token, head): code bytes and bf16 scale values (scales, then minima when grouped).
    __host__ __device__ static constexpr int code_bytes(int head_dim) { return head_dim * kBits / 8; }
    __host__ __device__ static constexpr int num_scales(int head_dim) { return kGroup ? 2 * head_dim / kGroup : 1; }
};

// The scale as stored: bf16-rounded, and 1 where it is not positive (an all-zero row or a constant group).
__device__ __forceinline__ __nv_bfloat16 stored_scale(float scale) {
    const __nv_bfloat16 s = __float2bfloat16_rn(scale);
    return __bfloat162float(s) > 0.f ? s : __float2bfloat16_rn(1.f);
}

// The fp8 scale search, kv_formats._search_scale bit for bit (kv_encode_cpu.h encode8_searched is the CPU's):
// candidates bf16(amax / code_max * 2^(j/16)), j < 16 (kv_formats.SCALE_STEP_BITS), each scored by the exact
// squared error of the dequantised row: x - code * scale is exact in fp32 (so FMA contraction cannot change
// it), scaled by two powers of two to units of 2^(e - 151) (e: amax's biased exponent field; |q| < 2^21),
// rounded to an integer and squared into an int64 warp sum, which no order of addition changes. Least error
// wins, ties the smallest j. One warp per row: every lane holds the same sums, so the choice is warp-uniform.
constexpr int kScaleSteps = 16;

__device__ __forceinline__ float scale_step(int j) {
    const unsigned bits[kScaleSteps] = {0x3F800000u, 0x3F85AAC3u, 0x3F8B95C2u, 0x3F91C3D3u, 0x3F9837F0u,
                                        0x3F9EF532u, 0x3FA5FED7u, 0x3FAD583Fu, 0x3FB504F3u, 0x3FBD08A4u,
                                        0x3FC5672Au, 0x3FCE248Cu, 0x3FD744FDu, 0x3FE0CCDFu, 0x3FEAC0C7u,
                                        0x3FF5257Du};
    return __uint_as_float(bits[j]);
}

__device__ __forceinline__ long long warp_sum_exact(long long v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
    return v;
}

// row: one (token, head) row of head_dim elements, lane's elements lane, lane + 32, ...; amax: the row's
// largest magnitude (warp-reduced). Called by all 32 lanes.
template <int F, typename T>
__device__ __forceinline__ __nv_bfloat16 searched_scale(const T* row, int head_dim, int lane, float amax) {
    using Fmt = KvFormat<F>;
    const unsigned exponent = (__float_as_uint(amax) >> 23) & 0xFFu;
    const unsigned low = exponent >> 1;
    const float first = __uint_as_float((203u - low) << 23);                 // 2^(76 - e//2)
    const float second = __uint_as_float((202u - (exponent - low)) << 23);   // 2^(75 - (e - e//2))
    const float base = amax / Fmt::kCodeMax;
    long long best_error = -1;
    __nv_bfloat16 best = stored_scale(base);
    for (int j = 0; j < kScaleSteps; ++j) {
        const __nv_bfloat16 candidate = stored_scale(base * scale_step(j));
        const float s = __bfloat162float(candidate);
        long long error = 0;
        for (int d = lane; d < head_dim; d += 32) {
            const float x = to_float(row[d]);
            const float residual = x - Fmt::decode(Fmt::encode(x / s)) * s;
            const long long q = __float2int_rn(residual * first * second);
            error += q * q;
        }
        error = warp_sum_exact(error);
        if (best_error < 0 || error < best_error) {
            best_error = error;
            best = candidate;
        }
    }
    return best;
}

}  // namespace hfp
