// Encoding of quantised KV rows on the CPU, for the quantising write (kv_write_cpu.cpp); the decoding side and
// the rotation are kv_codec_cpu.h's. One function per row format, kv_formats.quantize's codes and scales bit
// for bit on the same fp32 input.
#pragma once

#include "kv_codec_cpu.h"

namespace hfp_codec {

// The inverse direction, for the quantising write (kv_write_cpu.cpp): kv_formats.quantize bit for bit on
// the same fp32 input (fp32 math, the scale rounded to bf16 before use, 1 where it is not positive, fp8's
// searched among 16 candidates, codes from x / stored scale, clamped, then round-to-nearest-even or the
// fp8 conversion), as cuda/kv_quant.cuh. No sums over floats (the search's error sum is int64; the absolute
// maximum is order-free), so no ISA variant of the -march=native build can change a code: with AVX-512 the
// maximum, the search's error and the codes run 16 lanes at a time by the scalar code's own steps, with AVX2
// (no AVX-512) those of the 8-bit formats 8 at a time (the scalar loops stay for other ISAs and tails;
// tests/backends/test_codec_isa.py compares the builds). On a Zen 3 (AVX2 only) the AVX2 search took an fp8
// engine run's KV writes from 1.21 s to 0.21 s (SmolLM2, the short workload; the fp32 pool's: 0.02 s).
// A row is written once per token, but every token of every layer: an fp8 row's search is 16 x D divisions.
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

#if defined(__AVX2__) && !defined(__AVX512F__)
inline __m256 abs8(__m256 x) { return _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))); }
// 8 int32 lanes, each 0..255 or -128..127, as their low bytes in order (8 bytes at out).
inline void store_low_bytes(__m256i v, uint8_t* out) {
  const __m256i low = _mm256_and_si256(v, _mm256_set1_epi32(0xFF));
  const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(low), _mm256_extracti128_si256(low, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packus_epi16(words, words));
}
#endif

// The largest |x[i]|, i < n, as a loop of std::max(amax, |x[i]|) from 0 finds it (a NaN element is passed
// over: _mm512_max_ps returns its second operand when either is NaN).
inline float abs_max(const float* x, int64_t n) {
  float amax = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 lanes = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) lanes = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + i)), lanes);
  amax = _mm512_reduce_max_ps(lanes);
#elif defined(__AVX2__)
  __m256 lanes = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) lanes = _mm256_max_ps(abs8(_mm256_loadu_ps(x + i)), lanes);
  alignas(32) float each[8];
  _mm256_store_ps(each, lanes);
  for (const float e : each) amax = std::max(amax, e);      // no NaN in the lanes: the order does not matter
#endif
  for (; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  return amax;
}

// codes[i] = Code(x[i] / s clamped to +-code_max), i < n. With AVX-512, 16 lanes at a time by the same integer
// steps: fp8_code<M, B> (M > 0) or int8_code (M = 0; _mm512_cvtps_epi32 rounds to nearest even as round_even).
template <uint8_t (*Code)(float), int M, int B>
inline void encode_codes(const float* x, int64_t n, float s, float code_max, uint8_t* codes) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 scale = _mm512_set1_ps(s), high = _mm512_set1_ps(code_max), low = _mm512_set1_ps(-code_max);
  for (; i + 16 <= n; i += 16) {
    const __m512 y = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), scale), low), high);
    __m512i code;
    if constexpr (M == 0) {
      code = _mm512_cvtps_epi32(y);
    } else {
      constexpr int kDrop = 23 - M;
      const __m512i bits = _mm512_castps_si512(y), magnitude = _mm512_set1_epi32(0x7FFFFFFF);
      const __m512i mag = _mm512_and_si512(bits, magnitude);
      const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(mag, _mm512_set1_epi32((1 << (kDrop - 1)) - 1)),
                                               _mm512_and_si512(_mm512_srli_epi32(mag, kDrop), _mm512_set1_epi32(1)));
      const __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(rounded, kDrop), _mm512_set1_epi32((127 - B) << M));
      const __m512i small = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(mag), _mm512_set1_ps(static_cast<float>(1 << (B - 1 + M)))));
      const __mmask16 subnormal = _mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32(static_cast<int32_t>(static_cast<uint32_t>(128 - B) << 23)));
      code = _mm512_or_si512(_mm512_srli_epi32(_mm512_andnot_si512(magnitude, bits), 24), _mm512_mask_blend_epi32(subnormal, normal, small));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), _mm512_cvtepi32_epi8(code));
  }
#elif defined(__AVX2__)
  const __m256 scale = _mm256_set1_ps(s), high = _mm256_set1_ps(code_max), low = _mm256_set1_ps(-code_max);
  for (; i + 8 <= n; i += 8) {      // the AVX-512 steps above, 8 lanes at a time
    const __m256 y = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), scale), low), high);
    __m256i code;
    if constexpr (M == 0) {
      code = _mm256_cvtps_epi32(y);
    } else {
      constexpr int kDrop = 23 - M;
      const __m256i bits = _mm256_castps_si256(y), magnitude = _mm256_set1_epi32(0x7FFFFFFF);
      const __m256i mag = _mm256_and_si256(bits, magnitude);
      const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(mag, _mm256_set1_epi32((1 << (kDrop - 1)) - 1)),
                                               _mm256_and_si256(_mm256_srli_epi32(mag, kDrop), _mm256_set1_epi32(1)));
      const __m256i normal = _mm256_sub_epi32(_mm256_srli_epi32(rounded, kDrop), _mm256_set1_epi32((127 - B) << M));
      const __m256i small = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_castsi256_ps(mag), _mm256_set1_ps(static_cast<float>(1 << (B - 1 + M)))));
      // mag <= 0x7FFFFFFF: the signed comparison is the unsigned one
      const __m256i subnormal = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(static_cast<uint32_t>(128 - B) << 23)), mag);
      code = _mm256_or_si256(_mm256_srli_epi32(_mm256_andnot_si256(magnitude, bits), 24), _mm256_blendv_epi8(normal, small, subnormal));
    }
    store_low_bytes(code, codes + i);
  }
#endif
  for (; i < n; ++i) codes[i] = Code(std::min(std::max(x[i] / s, -code_max), code_max));
}

// Symmetric 8-bit row: `num_scales` groups along D, each scaled by its absolute maximum / code_max.
template <uint8_t (*Code)(float), int M, int B>
inline void encode8(const float* x, int64_t d, int64_t num_scales, float code_max, uint8_t* codes, uint16_t* scales) {
  const int64_t group = d / num_scales;
  for (int64_t g = 0; g < num_scales; ++g) {
    scales[g] = stored_scale(abs_max(x + g * group, group) / code_max);
    encode_codes<Code, M, B>(x + g * group, group, bf16(scales[g]), code_max, codes + g * group);
  }
}

#if defined(__AVX512F__)
// 16 int32 codes 0..15 -> 8 bytes, code 2i in the low nibble of byte i: each 64-bit lane holds codes 2i (low
// half) and 2i + 1 (high half); shifted right by 28 the high one lands at bits 4..7 of the low byte.
inline void store_nibbles(__m512i codes, uint8_t* out) {
  const __m128i bytes = _mm512_cvtepi64_epi8(_mm512_or_si512(codes, _mm512_srli_epi64(codes, 28)));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), bytes);
}
#elif defined(__AVX2__)
// 8 int32 codes 0..15 -> 4 bytes, the same packing: the low byte of each 64-bit lane, gathered per 128-bit half.
inline void store_nibbles(__m256i codes, uint8_t* out) {
  const __m256i pairs = _mm256_or_si256(codes, _mm256_srli_epi64(codes, 28));
  const __m256i gather = _mm256_setr_epi8(0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i bytes = _mm256_shuffle_epi8(pairs, gather);
  const uint32_t word = static_cast<uint32_t>(_mm256_extract_epi16(bytes, 0)) |
                        static_cast<uint32_t>(_mm256_extract_epi16(bytes, 8)) << 16;
  std::memcpy(out, &word, sizeof word);
}
#endif

// Asymmetric int4 row: S / 2 groups along D, (max - min) / 15 and the minimum, codes 0..15 two per byte.
// With AVX-512 and groups of a multiple of 16, the same steps 16 lanes at a time (_mm512_min_ps / max_ps with
// the running value second: a NaN element is passed over as by std::min / std::max).
inline void encode_int4(const float* x, int64_t d, int64_t num_scales, uint8_t* codes, uint16_t* scales) {
  const int64_t groups = num_scales / 2, group = d / groups;
  std::memset(codes, 0, static_cast<size_t>(d / 2));
  for (int64_t g = 0; g < groups; ++g) {
#if defined(__AVX512F__)
    if (group % 16 == 0) {
      const float* in = x + g * group;
      __m512 low = _mm512_set1_ps(in[0]), high = low;
      for (int64_t i = 0; i < group; i += 16) {
        const __m512 v = _mm512_loadu_ps(in + i);
        low = _mm512_min_ps(v, low), high = _mm512_max_ps(v, high);
      }
      scales[g] = stored_scale((_mm512_reduce_max_ps(high) - _mm512_reduce_min_ps(low)) / 15.f);
      scales[groups + g] = to_bf16(_mm512_reduce_min_ps(low));
      const __m512 s = _mm512_set1_ps(bf16(scales[g])), m = _mm512_set1_ps(bf16(scales[groups + g]));
      for (int64_t i = 0; i < group; i += 16) {
        const __m512i c = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_sub_ps(_mm512_loadu_ps(in + i), m), s));
        store_nibbles(_mm512_min_epi32(_mm512_max_epi32(c, _mm512_setzero_si512()), _mm512_set1_epi32(15)),
                      codes + (g * group + i) / 2);
      }
      continue;
    }
#elif defined(__AVX2__)
    if (group % 8 == 0) {             // the AVX-512 steps above, 8 lanes at a time
      const float* in = x + g * group;
      __m256 low = _mm256_set1_ps(in[0]), high = low;
      for (int64_t i = 0; i < group; i += 8) {
        const __m256 v = _mm256_loadu_ps(in + i);
        low = _mm256_min_ps(v, low), high = _mm256_max_ps(v, high);
      }
      alignas(32) float lows[8], highs[8];
      _mm256_store_ps(lows, low);
      _mm256_store_ps(highs, high);
      float lo = lows[0], hi = highs[0];                 // no NaN in the lanes: the order does not matter
      for (int l = 1; l < 8; ++l) lo = std::min(lo, lows[l]), hi = std::max(hi, highs[l]);
      scales[g] = stored_scale((hi - lo) / 15.f);
      scales[groups + g] = to_bf16(lo);
      const __m256 s = _mm256_set1_ps(bf16(scales[g])), m = _mm256_set1_ps(bf16(scales[groups + g]));
      for (int64_t i = 0; i < group; i += 8) {
        const __m256i c = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(in + i), m), s));
        store_nibbles(_mm256_min_epi32(_mm256_max_epi32(c, _mm256_setzero_si256()), _mm256_set1_epi32(15)),
                      codes + (g * group + i) / 2);
      }
      continue;
    }
#endif
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

// The squared error of candidate scale s on x[0:n] in units of 2^(e - 151) (see kScaleSteps).
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

#if defined(__AVX512F__) || defined(__AVX2__)
constexpr float kReciprocalLow = 0x1p-50f, kReciprocalHigh = 0x1p50f;   // see divide_by_reciprocal
#endif

#if defined(__AVX512F__)
// x / s, correctly rounded, from r = RN(1 / s) without a division (vdivps issues once per 16 cycles; the search
// divides each element by 16 candidates): q0 = RN(x r) is within an ulp, the remainder x - q0 s is exact (an FMA),
// and RN(q0 + (x - q0 s) r) is RN(x / s) (Markstein's theorem) where nothing underflows or overflows: s in
// [2^-50, 2^50], x = 0 or x >= 2^-50 (and x / s <= ~code_max: s is a candidate for x's row), which
// `reciprocal_divides` checks per candidate and row. The quotient's bits then depend on the mantissas only, and
// exact_division_failures (kv_write_cpu.cpp) checks all 2^23 x 2^7 pairs of an fp32 and a bf16 mantissa
// (tests/backends/test_cpu_kernel_quant.py).
inline __m512 divide_by_reciprocal(__m512 x, __m512 s, __m512 r) {
  const __m512 q0 = _mm512_mul_ps(x, r);
  return _mm512_fmadd_ps(_mm512_fnmadd_ps(q0, s, x), r, q0);
}

// Value(Code(y)) for 16 normal magnitudes y (>= 2^(1 - B), <= code_max) without integer steps: Veltkamp's
// splitting, t = y (2^(23 - M) + 1), y's top M + 1 significant bits = t - (t - y), rounded to nearest even. Equal to
// fp8_rounded<M, B> on every such fp32 (fp8_rounding_failures, kv_write_cpu.cpp, checks them all). The product is
// _mm512_mul_round_ps so that no compiler contracts it with the subtraction into an FMA (which would change t - y).
template <int M, int B>
inline __m512 fp8_rounded_normal(__m512 y) {
  const __m512 t = _mm512_mul_round_ps(y, _mm512_set1_ps(static_cast<float>((1u << (23 - M)) + 1)),
                                       _MM_FROUND_CUR_DIRECTION);
  return _mm512_sub_ps(t, _mm512_sub_ps(t, y));
}

// The search below for a group of n = 16k <= 256 elements, in explicit intrinsics: the row's magnitudes loaded
// once, the constants set once. On |x|: the error is even in x (the division, the clamp, the rounding of
// magnitudes, the exact x - code * s and round-half-even are all symmetric), so q(-x) = -q(x). q squared into
// int64 by vpmuldq on the even and the odd int32 lanes (exact, order-free). Every candidate's whole error is
// summed, four candidates at a time in independent chains: stopping a candidate early (once its partial sum
// passed the best) saved arithmetic but serialised the candidates behind unpredictable branches (0.43 us per
// 64-element row, 1 thread, against 0.31 us with the chains and 0.28 us with fp8_rounded_normal and one units
// factor as well: README "Quantised pools in one call too"). Least error wins, ties the smallest j.
template <int M, int B>
struct Fp8Error {
  static constexpr float kUp = static_cast<float>(1 << (B - 1 + M)), kDown = 1.0f / kUp;
  __m512 high, to_units, to_units2, up, down, min_normal;
  bool one_factor;                          // first * second is exact and one multiply gives the same units

  // first, second: powers of two (see kScaleSteps). Where both are >= 1 neither step can round (the values only
  // grow, to below 2^21), so one multiply by their product (normal: it is 2^(151 - e) with e >= 24 here) is exact too.
  Fp8Error(float code_max, float first, float second)
      : high(_mm512_set1_ps(code_max)), to_units(_mm512_set1_ps(first)), to_units2(_mm512_set1_ps(second)),
        up(_mm512_set1_ps(kUp)), down(_mm512_set1_ps(kDown)),
        min_normal(_mm512_set1_ps(from_bits(static_cast<uint32_t>(128 - B) << 23))),
        one_factor(first >= 1.f && second >= 1.f && first * second <= 0x1p126f) {
    if (one_factor) to_units = _mm512_set1_ps(first * second);
  }

  // sums + the squared errors (in int64 pairs) of 16 magnitudes ax under scale s (reciprocal r, or a division).
  __m512i add(__m512i sums, __m512 ax, __m512 scale, __m512 reciprocal, bool by_reciprocal) const {
    const __m512 quotient = by_reciprocal ? divide_by_reciprocal(ax, scale, reciprocal) : _mm512_div_ps(ax, scale);
    const __m512 y = _mm512_min_ps(quotient, high);
    __m512 rounded = fp8_rounded_normal<M, B>(y);
    const __mmask16 subnormal = _mm512_cmp_ps_mask(y, min_normal, _CMP_LT_OQ);
    if (subnormal) {                          // multiples of 2^(1 - B - M), rounded by an exact scaling
      const __m512 small = _mm512_mul_ps(
          _mm512_roundscale_ps(_mm512_mul_ps(y, up), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), down);
      rounded = _mm512_mask_mov_ps(rounded, subnormal, small);
    }
    const __m512 residual = _mm512_sub_ps(ax, _mm512_mul_ps(rounded, scale));
    const __m512 units = one_factor ? _mm512_mul_ps(residual, to_units)
                                    : _mm512_mul_ps(_mm512_mul_ps(residual, to_units), to_units2);
    const __m512i q = _mm512_cvtps_epi32(units);
    const __m512i odd = _mm512_srli_epi64(q, 32);
    return _mm512_add_epi64(_mm512_add_epi64(sums, _mm512_mul_epi32(q, q)), _mm512_mul_epi32(odd, odd));
  }
};

template <int M, int B>
inline uint16_t search_scale_avx512(const float* x, int64_t n, float code_max, float base, float first, float second) {
  const Fp8Error<M, B> term(code_max, first, second);
  __m512 ax[16];
  const int64_t vectors = n / 16;
  bool tiny = false;                        // an element in (0, 2^-50): divide_by_reciprocal's range excludes it
  for (int64_t v = 0; v < vectors; ++v) {
    ax[v] = _mm512_abs_ps(_mm512_loadu_ps(x + 16 * v));
    tiny |= (_mm512_cmp_ps_mask(ax[v], _mm512_set1_ps(kReciprocalLow), _CMP_LT_OQ) &
             _mm512_cmp_ps_mask(ax[v], _mm512_setzero_ps(), _CMP_GT_OQ)) != 0;
  }
  constexpr int kChains = 4;
  int64_t best_error = -1;
  uint16_t best = 0;
  for (int j = 0; j < 16; j += kChains) {
    uint16_t candidate[kChains];
    __m512 scale[kChains], reciprocal[kChains];
    bool by_reciprocal[kChains];
    __m512i sums[kChains];
    for (int c = 0; c < kChains; ++c) {
      candidate[c] = stored_scale(base * from_bits(kScaleSteps[j + c]));
      const float s = bf16(candidate[c]);
      scale[c] = _mm512_set1_ps(s), reciprocal[c] = _mm512_set1_ps(1.0f / s);
      by_reciprocal[c] = !tiny && s >= kReciprocalLow && s <= kReciprocalHigh;
      sums[c] = _mm512_setzero_si512();
    }
    for (int64_t v = 0; v < vectors; ++v)
      for (int c = 0; c < kChains; ++c) sums[c] = term.add(sums[c], ax[v], scale[c], reciprocal[c], by_reciprocal[c]);
    for (int c = 0; c < kChains; ++c) {
      const int64_t error = _mm512_reduce_add_epi64(sums[c]);
      if (best_error < 0 || error < best_error) best_error = error, best = candidate[c];
    }
  }
  return best;
}
#elif defined(__AVX2__) && defined(__FMA__)
// The AVX-512 search above, 8 lanes at a time (AVX2 has no mask registers, no rounding-mode operands and no
// 64-bit reduction: blends, an empty asm that keeps the product from being contracted into an FMA, and four
// extracts). The same exhaustive test hooks check its division and its rounding.
inline __m256 divide_by_reciprocal(__m256 x, __m256 s, __m256 r) {
  const __m256 q0 = _mm256_mul_ps(x, r);
  return _mm256_fmadd_ps(_mm256_fnmadd_ps(q0, s, x), r, q0);
}

template <int M, int B>
inline __m256 fp8_rounded_normal(__m256 y) {
  __m256 t = _mm256_mul_ps(y, _mm256_set1_ps(static_cast<float>((1u << (23 - M)) + 1)));
  __asm__("" : "+x"(t));                    // t rounded as a product of its own, never fused with t - y
  return _mm256_sub_ps(t, _mm256_sub_ps(t, y));
}

template <int M, int B>
struct Fp8Error8 {
  static constexpr float kUp = static_cast<float>(1 << (B - 1 + M)), kDown = 1.0f / kUp;
  __m256 high, to_units, to_units2, up, down, min_normal;
  bool one_factor;                          // as Fp8Error's

  Fp8Error8(float code_max, float first, float second)
      : high(_mm256_set1_ps(code_max)), to_units(_mm256_set1_ps(first)), to_units2(_mm256_set1_ps(second)),
        up(_mm256_set1_ps(kUp)), down(_mm256_set1_ps(kDown)),
        min_normal(_mm256_set1_ps(from_bits(static_cast<uint32_t>(128 - B) << 23))),
        one_factor(first >= 1.f && second >= 1.f && first * second <= 0x1p126f) {
    if (one_factor) to_units = _mm256_set1_ps(first * second);
  }

  __m256i add(__m256i sums, __m256 ax, __m256 scale, __m256 reciprocal, bool by_reciprocal) const {
    const __m256 quotient = by_reciprocal ? divide_by_reciprocal(ax, scale, reciprocal) : _mm256_div_ps(ax, scale);
    const __m256 y = _mm256_min_ps(quotient, high);
    __m256 rounded = fp8_rounded_normal<M, B>(y);
    const __m256 subnormal = _mm256_cmp_ps(y, min_normal, _CMP_LT_OQ);
    if (_mm256_movemask_ps(subnormal)) {
      const __m256 small = _mm256_mul_ps(
          _mm256_round_ps(_mm256_mul_ps(y, up), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), down);
      rounded = _mm256_blendv_ps(rounded, small, subnormal);
    }
    const __m256 residual = _mm256_sub_ps(ax, _mm256_mul_ps(rounded, scale));
    const __m256 units = one_factor ? _mm256_mul_ps(residual, to_units)
                                    : _mm256_mul_ps(_mm256_mul_ps(residual, to_units), to_units2);
    const __m256i q = _mm256_cvtps_epi32(units);
    const __m256i odd = _mm256_srli_epi64(q, 32);
    return _mm256_add_epi64(_mm256_add_epi64(sums, _mm256_mul_epi32(q, q)), _mm256_mul_epi32(odd, odd));
  }
};

template <int M, int B>
inline uint16_t search_scale_avx2(const float* x, int64_t n, float code_max, float base, float first, float second) {
  const Fp8Error8<M, B> term(code_max, first, second);
  __m256 ax[32];
  const int64_t vectors = n / 8;
  bool tiny = false;                        // an element in (0, 2^-50): divide_by_reciprocal's range excludes it
  for (int64_t v = 0; v < vectors; ++v) {
    ax[v] = abs8(_mm256_loadu_ps(x + 8 * v));
    tiny |= _mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(ax[v], _mm256_set1_ps(kReciprocalLow), _CMP_LT_OQ),
                                             _mm256_cmp_ps(ax[v], _mm256_setzero_ps(), _CMP_GT_OQ))) != 0;
  }
  constexpr int kChains = 4;
  int64_t best_error = -1;
  uint16_t best = 0;
  for (int j = 0; j < 16; j += kChains) {
    uint16_t candidate[kChains];
    __m256 scale[kChains], reciprocal[kChains];
    bool by_reciprocal[kChains];
    __m256i sums[kChains];
    for (int c = 0; c < kChains; ++c) {
      candidate[c] = stored_scale(base * from_bits(kScaleSteps[j + c]));
      const float s = bf16(candidate[c]);
      scale[c] = _mm256_set1_ps(s), reciprocal[c] = _mm256_set1_ps(1.0f / s);
      by_reciprocal[c] = !tiny && s >= kReciprocalLow && s <= kReciprocalHigh;
      sums[c] = _mm256_setzero_si256();
    }
    for (int64_t v = 0; v < vectors; ++v)
      for (int c = 0; c < kChains; ++c) sums[c] = term.add(sums[c], ax[v], scale[c], reciprocal[c], by_reciprocal[c]);
    for (int c = 0; c < kChains; ++c) {
      const int64_t error = _mm256_extract_epi64(sums[c], 0) + _mm256_extract_epi64(sums[c], 1) +
                            _mm256_extract_epi64(sums[c], 2) + _mm256_extract_epi64(sums[c], 3);
      if (best_error < 0 || error < best_error) best_error = error, best = candidate[c];
    }
  }
  return best;
}
#endif

template <uint8_t (*Code)(float), int M, int B>
inline void encode8_searched(const float* x, int64_t d, int64_t num_scales, float code_max, uint8_t* codes,
                             uint16_t* scales) {
  const int64_t group = d / num_scales;
  for (int64_t g = 0; g < num_scales; ++g) {
    const float* row = x + g * group;
    const float amax = abs_max(row, group);
    const uint32_t exponent = (bits_of(amax) >> 23) & 0xFFu, low = exponent >> 1;
    const float first = from_bits((203u - low) << 23), second = from_bits((202u - (exponent - low)) << 23);
    const float base = amax / code_max;
    uint16_t best = 0;
#if defined(__AVX512F__)
    if (group % 16 == 0 && group <= 256) {
      best = search_scale_avx512<M, B>(row, group, code_max, base, first, second);
    } else
#elif defined(__AVX2__) && defined(__FMA__)
    if (group % 8 == 0 && group <= 256) {
      best = search_scale_avx2<M, B>(row, group, code_max, base, first, second);
    } else
#endif
    {
      int64_t best_error = -1;
      for (const uint32_t step : kScaleSteps) {
        const uint16_t candidate = stored_scale(base * from_bits(step));
        const int64_t error = squared_error<M, B>(row, group, code_max, bf16(candidate), first, second);
        if (best_error < 0 || error < best_error) best_error = error, best = candidate;
      }
    }
    scales[g] = best;
    encode_codes<Code, M, B>(row, group, bf16(best), code_max, codes + g * group);
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

#if defined(__AVX512F__)
// A group's 16 e2m1 codes, e2m1_code's comparisons in the lanes (one mask per threshold), packed as nibbles.
inline void e2m1_group(const float* in, float step, uint8_t* out) {
  const __m512 v = _mm512_div_ps(_mm512_loadu_ps(in), _mm512_set1_ps(step)), a = _mm512_abs_ps(v);
  const __m512i one = _mm512_set1_epi32(1);
  __m512i code = _mm512_setzero_si512();
  code = _mm512_mask_add_epi32(code, _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.25f), _CMP_GT_OQ), code, one);
  code = _mm512_mask_add_epi32(code, _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.75f), _CMP_GE_OQ), code, one);
  code = _mm512_mask_add_epi32(code, _mm512_cmp_ps_mask(a, _mm512_set1_ps(1.25f), _CMP_GT_OQ), code, one);
  code = _mm512_mask_add_epi32(code, _mm512_cmp_ps_mask(a, _mm512_set1_ps(1.75f), _CMP_GE_OQ), code, one);
  code = _mm512_mask_add_epi32(code, _mm512_cmp_ps_mask(a, _mm512_set1_ps(2.5f), _CMP_GT_OQ), code, one);
  code = _mm512_mask_add_epi32(code, _mm512_cmp_ps_mask(a, _mm512_set1_ps(3.5f), _CMP_GE_OQ), code, one);
  code = _mm512_mask_add_epi32(code, _mm512_cmp_ps_mask(a, _mm512_set1_ps(5.f), _CMP_GT_OQ), code, one);
  const __mmask16 negative = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LT_OQ) &
                             _mm512_cmpgt_epi32_mask(code, _mm512_setzero_si512());
  store_nibbles(_mm512_mask_or_epi32(code, negative, code, _mm512_set1_epi32(8)), out);
}
#elif defined(__AVX2__)
// The same, 8 lanes at a time: each threshold's mask (all ones: -1) subtracted from the code.
inline void e2m1_group(const float* in, float step, uint8_t* out) {
  for (int half = 0; half < 2; ++half) {
    const __m256 v = _mm256_div_ps(_mm256_loadu_ps(in + 8 * half), _mm256_set1_ps(step)), a = abs8(v);
    __m256i code = _mm256_setzero_si256();
    const auto count = [&](float threshold, int predicate) {
      const __m256 mask = predicate == _CMP_GT_OQ ? _mm256_cmp_ps(a, _mm256_set1_ps(threshold), _CMP_GT_OQ)
                                                  : _mm256_cmp_ps(a, _mm256_set1_ps(threshold), _CMP_GE_OQ);
      code = _mm256_sub_epi32(code, _mm256_castps_si256(mask));
    };
    count(0.25f, _CMP_GT_OQ), count(0.75f, _CMP_GE_OQ), count(1.25f, _CMP_GT_OQ), count(1.75f, _CMP_GE_OQ);
    count(2.5f, _CMP_GT_OQ), count(3.5f, _CMP_GE_OQ), count(5.f, _CMP_GT_OQ);
    const __m256i negative = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ)),
                                              _mm256_cmpgt_epi32(code, _mm256_setzero_si256()));
    store_nibbles(_mm256_or_si256(code, _mm256_and_si256(negative, _mm256_set1_epi32(8))), out + 4 * half);
  }
}
#endif

inline void encode_nvfp4(const float* x, int64_t d, int64_t, uint8_t* codes, uint16_t* scales) {
  scales[0] = stored_scale(abs_max(x, d) / 2688.f);                          // 6 * 448
  const float row = bf16(scales[0]);
  std::memset(codes, 0, static_cast<size_t>(d / 2));
  for (int64_t g = 0; g < d / kNvfp4Group; ++g) {
    const float* in = x + g * kNvfp4Group;
    const uint8_t group = fp8_code<3, 7>(std::min(abs_max(in, kNvfp4Group) / 6.f / row, 448.f));
    codes[d / 2 + g] = group;
    const float step = fp8_value<3, 7>(group) * row;
    if (!(step > 0.f)) continue;                                             // a zero group: codes 0
#if defined(__AVX512F__) || defined(__AVX2__)
    static_assert(kNvfp4Group == 16, "one AVX-512 vector or two AVX2 vectors per group");
    e2m1_group(in, step, codes + g * kNvfp4Group / 2);
#else
    for (int64_t i = 0; i < kNvfp4Group; ++i) {
      const int64_t at = g * kNvfp4Group + i;
      codes[at / 2] |= static_cast<uint8_t>(e2m1_code(in[i] / step) << (4 * (at & 1)));
    }
#endif
  }
}

using EncodeFn = void (*)(const float*, int64_t, int64_t, uint8_t*, uint16_t*);
inline void encode_int8(const float* x, int64_t d, int64_t s, uint8_t* c, uint16_t* sc) { encode8<int8_code, 0, 0>(x, d, s, 127.f, c, sc); }
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
