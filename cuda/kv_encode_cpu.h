// Encoding of quantised KV rows on the CPU, for the quantising write (kv_write_cpu.cpp); the decoding side and
// the rotation are kv_codec_cpu.h's. One function per row format, kv_formats.quantize's codes and scales bit
// for bit on the same fp32 input.
#pragma once

#include "kv_codec_cpu.h"

namespace hfp_codec {

// The inverse direction, for the quantising write (kv_write_cpu.cpp): kv_formats.quantize bit for bit on
// the same fp32 input (fp32 math, the scale rounded to bf16 before use, 1 where it is not positive, fp8's
// searched among 16 candidates, codes from x / stored scale, clamped, then round-to-nearest-even or the
// fp8 conversion), as cuda/kv_quant.cuh. Scalar code without reductions over floats (the search's error
// sum is int64), so no ISA variant of the -march=native build can change a code.
// Scalar: a row is D elements, written once per token; the read side is what runs per step.
inline uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

inline uint16_t to_bf16(float x) {          // round to nearest even (finite inputs)
  const uint32_t u = bits_of(x);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline uint16_t stored_scale(float scale) {
  const uint16_t s = to_bf16(scale);
  return bf16(s) > 0.f ? s : static_cast<uint16_t>(0x3F80);     // bf16 1.0
}

inline int32_t round_even(float x) {        // torch.round: halves to even (the default rounding mode)
  const float r = std::nearbyint(x);
  return static_cast<int32_t>(r);
}

// fp32 -> fp8 (M mantissa bits, bias B), round to nearest even, |x| within the finite range (callers clamp).
template <int M, int B>
inline uint8_t fp8_code(float x) {
  const uint32_t bits = bits_of(x), sign = (bits >> 24) & 0x80u, mag = bits & 0x7FFFFFFFu;
  constexpr uint32_t kMinNormal = static_cast<uint32_t>(128 - B) << 23;       // 2^(1 - B)
  if (mag < kMinNormal)         // subnormal codes are multiples of 2^(1 - B - M): an exact scaling
    return static_cast<uint8_t>(sign | static_cast<uint32_t>(round_even(from_bits(mag) * static_cast<float>(1 << (B - 1 + M)))));
  constexpr int kDrop = 23 - M;
  const uint32_t rounded = mag + ((1u << (kDrop - 1)) - 1u) + ((mag >> kDrop) & 1u);
  return static_cast<uint8_t>(sign | ((rounded >> kDrop) - (static_cast<uint32_t>(127 - B) << M)));
}

inline uint8_t int8_code(float x) { return static_cast<uint8_t>(static_cast<int8_t>(round_even(x))); }

// Symmetric 8-bit row: `num_scales` groups along D, each scaled by its absolute maximum / code_max.
template <uint8_t (*Code)(float)>
inline void encode8(const float* x, int64_t d, int64_t num_scales, float code_max, uint8_t* codes, uint16_t* scales) {
  const int64_t group = d / num_scales;
  for (int64_t g = 0; g < num_scales; ++g) {
    float amax = 0.f;
    for (int64_t i = g * group; i < (g + 1) * group; ++i) amax = std::max(amax, std::fabs(x[i]));
    scales[g] = stored_scale(amax / code_max);
    const float s = bf16(scales[g]);
    for (int64_t i = g * group; i < (g + 1) * group; ++i) codes[i] = Code(std::min(std::max(x[i] / s, -code_max), code_max));
  }
}

// Asymmetric int4 row: S / 2 groups along D, (max - min) / 15 and the minimum, codes 0..15 two per byte.
inline void encode_int4(const float* x, int64_t d, int64_t num_scales, uint8_t* codes, uint16_t* scales) {
  const int64_t groups = num_scales / 2, group = d / groups;
  std::memset(codes, 0, static_cast<size_t>(d / 2));
  for (int64_t g = 0; g < groups; ++g) {
    float low = x[g * group], high = low;
    for (int64_t i = g * group; i < (g + 1) * group; ++i) low = std::min(low, x[i]), high = std::max(high, x[i]);
    scales[g] = stored_scale((high - low) / 15.f);
    scales[groups + g] = to_bf16(low);
    const float s = bf16(scales[g]), m = bf16(scales[groups + g]);
    for (int64_t i = g * group; i < (g + 1) * group; ++i) {
      const int32_t c = std::min(std::max(round_even((x[i] - m) / s), 0), 15);
      codes[i / 2] |= static_cast<uint8_t>(c << (4 * (i & 1)));
    }
  }
}

// The fp8 scale search, kv_formats._search_scale bit for bit: candidates bf16(amax / code_max * kScaleSteps[j])
// (fp32 2^(j/16), the same bit patterns as kv_formats.SCALE_STEP_BITS), each scored by the exact squared error
// of its dequantised group: x - code * scale is exact in fp32 (the product has <= 12 significant bits; the
// difference is within a factor 2 of x, or x itself), scaled by two powers of two to units of 2^(e - 151)
// (e: amax's biased exponent; below 2^21), rounded to an integer and squared into an int64 sum, which no
// summation order or FMA contraction changes. Least error wins, ties the smallest j.
constexpr uint32_t kScaleSteps[16] = {0x3F800000u, 0x3F85AAC3u, 0x3F8B95C2u, 0x3F91C3D3u, 0x3F9837F0u, 0x3F9EF532u, 0x3FA5FED7u, 0x3FAD583Fu,
                                      0x3FB504F3u, 0x3FBD08A4u, 0x3FC5672Au, 0x3FCE248Cu, 0x3FD744FDu, 0x3FE0CCDFu, 0x3FEAC0C7u, 0x3FF5257Du};

// Value(Code(y)) for |y| within the finite range, branch-free so that the search loop vectorises: a normal
// magnitude rounds to nearest even by adding below the kept mantissa bits and clearing them (the same
// integer steps as fp8_code, whose decoded value is that fp32 pattern); a subnormal one is a multiple of
// 2^(1 - B - M), rounded by an exact scaling. Equal to fp8_value(fp8_code(y)) bit for bit.
template <int M, int B>
inline float fp8_rounded(float y) {
  const uint32_t bits = bits_of(y), sign = bits & 0x80000000u, mag = bits & 0x7FFFFFFFu;
  constexpr uint32_t kMinNormal = static_cast<uint32_t>(128 - B) << 23;
  constexpr int kDrop = 23 - M;
  constexpr float kUp = static_cast<float>(1 << (B - 1 + M)), kDown = 1.0f / kUp;
  const uint32_t normal = (mag + ((1u << (kDrop - 1)) - 1u) + ((mag >> kDrop) & 1u)) & ~((1u << kDrop) - 1u);
  const uint32_t small = bits_of(std::nearbyint(from_bits(mag) * kUp) * kDown);
  return from_bits(sign | (mag < kMinNormal ? small : normal));
}

template <int M, int B>
inline int64_t squared_error(const float* x, int64_t n, float code_max, float s, float first, float second) {
  int64_t total = 0;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < n; ++i) {
    const float residual = x[i] - fp8_rounded<M, B>(std::min(std::max(x[i] / s, -code_max), code_max)) * s;
    const int64_t q = static_cast<int32_t>(std::nearbyint(residual * first * second));
    total += q * q;
  }
  return total;
}

template <uint8_t (*Code)(float), int M, int B>
inline void encode8_searched(const float* x, int64_t d, int64_t num_scales, float code_max, uint8_t* codes,
                             uint16_t* scales) {
  const int64_t group = d / num_scales;
  for (int64_t g = 0; g < num_scales; ++g) {
    const float* row = x + g * group;
    float amax = 0.f;
    for (int64_t i = 0; i < group; ++i) amax = std::max(amax, std::fabs(row[i]));
    const uint32_t exponent = (bits_of(amax) >> 23) & 0xFFu, low = exponent >> 1;
    const float first = from_bits((203u - low) << 23), second = from_bits((202u - (exponent - low)) << 23);
    const float base = amax / code_max;
    int64_t best_error = -1;
    uint16_t best = 0;
    for (const uint32_t step : kScaleSteps) {
      const uint16_t candidate = stored_scale(base * from_bits(step));
      const int64_t error = squared_error<M, B>(row, group, code_max, bf16(candidate), first, second);
      if (best_error < 0 || error < best_error) best_error = error, best = candidate;
    }
    scales[g] = best;
    const float s = bf16(best);
    for (int64_t i = 0; i < group; ++i) codes[g * group + i] = Code(std::min(std::max(row[i] / s, -code_max), code_max));
  }
}

// nvfp4 row, kv_formats._quantize_nvfp4 bit for bit: row scale bf16(amax / (6 * 448)) (1 where not positive);
// group g's e4m3 scale = e4m3(min(amax_g / 6 / row, 448)) (round to nearest even); codes from x / (e4m3 * row)
// (0 where that step is 0): e2m1 round to nearest, ties to the even code, saturating at 6, sign in bit 3
// (never on code 0). Codes and group scales share `codes`: D/2 bytes of nibbles, then D/16 bytes.
inline uint8_t e2m1_code(float v) {
  const float a = std::fabs(v);
  // thresholds between magnitudes k-1 and k: above the midpoint, at it only toward the even code (k even)
  const uint32_t code = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.f);
  return static_cast<uint8_t>(code | ((v < 0.f && code > 0) ? 8u : 0u));
}

inline void encode_nvfp4(const float* x, int64_t d, int64_t, uint8_t* codes, uint16_t* scales) {
  float amax = 0.f;
  for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(x[i]));
  scales[0] = stored_scale(amax / 2688.f);                                   // 6 * 448
  const float row = bf16(scales[0]);
  std::memset(codes, 0, static_cast<size_t>(d / 2));
  for (int64_t g = 0; g < d / kNvfp4Group; ++g) {
    const float* in = x + g * kNvfp4Group;
    float group_max = 0.f;
    for (int64_t i = 0; i < kNvfp4Group; ++i) group_max = std::max(group_max, std::fabs(in[i]));
    const uint8_t group = fp8_code<3, 7>(std::min(group_max / 6.f / row, 448.f));
    codes[d / 2 + g] = group;
    const float step = fp8_value<3, 7>(group) * row;
    if (!(step > 0.f)) continue;                                             // a zero group: codes 0
    for (int64_t i = 0; i < kNvfp4Group; ++i) {
      const int64_t at = g * kNvfp4Group + i;
      codes[at / 2] |= static_cast<uint8_t>(e2m1_code(in[i] / step) << (4 * (at & 1)));
    }
  }
}

using EncodeFn = void (*)(const float*, int64_t, int64_t, uint8_t*, uint16_t*);
inline void encode_int8(const float* x, int64_t d, int64_t s, uint8_t* c, uint16_t* sc) { encode8<int8_code>(x, d, s, 127.f, c, sc); }
inline void encode_e4m3(const float* x, int64_t d, int64_t s, uint8_t* c, uint16_t* sc) {
  encode8_searched<fp8_code<3, 7>, 3, 7>(x, d, s, 448.f, c, sc);
}
inline void encode_e5m2(const float* x, int64_t d, int64_t s, uint8_t* c, uint16_t* sc) {
  encode8_searched<fp8_code<2, 15>, 2, 15>(x, d, s, 57344.f, c, sc);
}

// The row encoder of a row format (kInt8, kFp8E4M3, kFp8E5M2, kInt4, kNvfp4); nullptr for others (KIVI seals
// whole blocks: kivi_write_cpu.cpp).
inline EncodeFn encode_function(int64_t format) {
  switch (format) {
    case kInt8: return encode_int8;
    case kFp8E4M3: return encode_e4m3;
    case kFp8E5M2: return encode_e5m2;
    case kInt4: return encode_int4;
    case kNvfp4: return encode_nvfp4;
  }
  return nullptr;
}

}  // namespace hfp_codec
