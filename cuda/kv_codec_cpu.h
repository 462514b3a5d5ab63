// Dequantisation of quantised KV rows on the CPU (hf_paged/kv_formats.py and hf_paged/kivi.py lay them out),
// one small function per format, so that a change of a format's scale math changes one function here.
//
// Every function turns one stored row (D elements of one token and KV head) into D floats. Scales are bf16
// and read through the layout the pool has (`num_scales` per row, from the scales tensor's shape), never
// from constants: 8-bit formats use scale g for elements [g * D / S, (g + 1) * D / S); int4 (asymmetric)
// keeps S / 2 group scales then S / 2 group minima; KIVI keys use one scale and minimum per channel.
// A value is `code * scale` (8-bit) or `code * scale + minimum` (4-bit) in fp32; the SIMD paths may fuse
// the multiply-add (one rounding instead of two: within 1 ulp of kv_formats.dequantize).
//
// SIMD: AVX-512 (16 lanes) where the build targets it, else AVX2 (8 lanes), else scalar, chosen at build
// time by -march=native (cpu_backend.py). The scalar functions are always built: they serve tails and
// groups the vectors do not divide, and the test hook (dequantize_rows) compares both paths.
// fp8 codes never hold NaN/inf: kv_formats.quantize clamps to the finite range first.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace hfp_codec {

// Format ids of the op's k_format / v_format arguments (cpu_backend.py's FORMAT_IDS holds the same).
enum Format : int64_t { kInt8 = 0, kFp8E4M3 = 1, kFp8E5M2 = 2, kInt4 = 3, kKiviKey = 4, kNumFormats = 5 };

inline float bf16(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// fp8 -> fp32 in integer arithmetic: normal codes move their exponent/mantissa bits into fp32's fields and
// rebias the exponent (no denormal fp32 is ever formed, so DAZ/FTZ modes cannot change the result);
// subnormal codes (exponent 0) are mantissa * 2^(1 - bias - mantissa_bits).
template <int kMantissa, int kBias>
inline float fp8_value(uint8_t c) {
  const uint32_t em = c & 0x7Fu, sign = static_cast<uint32_t>(c & 0x80u) << 24;
  float magnitude;
  if (em < (1u << kMantissa)) {
    magnitude = static_cast<float>(em) * from_bits(static_cast<uint32_t>(127 + 1 - kBias - kMantissa) << 23);
  } else {
    magnitude = from_bits((em << (23 - kMantissa)) + (static_cast<uint32_t>(127 - kBias) << 23));
  }
  uint32_t bits;
  std::memcpy(&bits, &magnitude, sizeof bits);
  return from_bits(sign | bits);
}

inline float int8_value(uint8_t c) { return static_cast<float>(static_cast<int8_t>(c)); }

// ---------------------------------------------------------------------------------------------- scalar
template <float (*Value)(uint8_t)>
inline void row8_scalar(const uint8_t* codes, const uint16_t* scales, int64_t num_scales, int64_t d, float* out) {
  const int64_t group = d / num_scales;
  for (int64_t g = 0; g < num_scales; ++g) {
    const float s = bf16(scales[g]);
    for (int64_t i = g * group; i < (g + 1) * group; ++i) out[i] = Value(codes[i]) * s;
  }
}

inline void int4_scalar(const uint8_t* codes, const uint16_t* scales, int64_t num_scales, int64_t d, float* out) {
  const int64_t groups = num_scales / 2, group = d / groups;
  for (int64_t i = 0; i < d; ++i) {
    const int64_t g = i / group;
    const float code = static_cast<float>((codes[i / 2] >> (4 * (i & 1))) & 15);
    out[i] = code * bf16(scales[g]) + bf16(scales[groups + g]);
  }
}

// KIVI keys: `scales` is the block's [2, D] (channel scales, then channel minima).
inline void kivi_key_scalar(const uint8_t* codes, const uint16_t* scales, int64_t, int64_t d, float* out) {
  for (int64_t i = 0; i < d; ++i) {
    const float code = static_cast<float>((codes[i / 2] >> (4 * (i & 1))) & 15);
    out[i] = code * bf16(scales[i]) + bf16(scales[d + i]);
  }
}

// ---------------------------------------------------------------------------------------------- vectors
#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int64_t kLanes = 16;
using Vec = __m512;
using IVec = __m512i;
inline IVec load_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline IVec load_i8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline IVec widen_u8(__m128i b) { return _mm512_cvtepu8_epi32(b); }
inline Vec load_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline IVec iset(int32_t x) { return _mm512_set1_epi32(x); }
inline IVec iand(IVec a, IVec b) { return _mm512_and_si512(a, b); }
inline IVec ior(IVec a, IVec b) { return _mm512_or_si512(a, b); }
inline IVec iadd(IVec a, IVec b) { return _mm512_add_epi32(a, b); }
template <int N> inline IVec shl(IVec a) { return _mm512_slli_epi32(a, N); }
inline Vec tofloat(IVec a) { return _mm512_cvtepi32_ps(a); }
inline Vec asfloat(IVec a) { return _mm512_castsi512_ps(a); }
inline IVec asint(Vec a) { return _mm512_castps_si512(a); }
inline Vec vset(float x) { return _mm512_set1_ps(x); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec a) { _mm512_storeu_ps(p, a); }
inline Vec select_lt(IVec a, int32_t limit, Vec yes, Vec no) {   // a < limit ? yes : no
  return _mm512_mask_blend_ps(_mm512_cmplt_epi32_mask(a, iset(limit)), no, yes);
}
// 16 nibbles (8 bytes) in stored order: element 2i the low nibble of byte i.
inline IVec nibbles16(const uint8_t* p) {
  const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)), m = _mm_set1_epi8(15);
  return widen_u8(_mm_unpacklo_epi8(_mm_and_si128(x, m), _mm_and_si128(_mm_srli_epi16(x, 4), m)));
}
#define HFP_CODEC_SIMD 1
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kLanes = 8;
using Vec = __m256;
using IVec = __m256i;
inline IVec load_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline IVec load_i8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline IVec widen_u8(__m128i b) { return _mm256_cvtepu8_epi32(b); }
inline Vec load_bf16(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline IVec iset(int32_t x) { return _mm256_set1_epi32(x); }
inline IVec iand(IVec a, IVec b) { return _mm256_and_si256(a, b); }
inline IVec ior(IVec a, IVec b) { return _mm256_or_si256(a, b); }
inline IVec iadd(IVec a, IVec b) { return _mm256_add_epi32(a, b); }
template <int N> inline IVec shl(IVec a) { return _mm256_slli_epi32(a, N); }
inline Vec tofloat(IVec a) { return _mm256_cvtepi32_ps(a); }
inline Vec asfloat(IVec a) { return _mm256_castsi256_ps(a); }
inline IVec asint(Vec a) { return _mm256_castps_si256(a); }
inline Vec vset(float x) { return _mm256_set1_ps(x); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec a) { _mm256_storeu_ps(p, a); }
inline Vec select_lt(IVec a, int32_t limit, Vec yes, Vec no) {
  return _mm256_blendv_ps(no, yes, _mm256_castsi256_ps(_mm256_cmpgt_epi32(iset(limit), a)));
}
// 16 nibbles as two vectors of 8, elements 0..7 and 8..15.
inline void nibbles16(const uint8_t* p, IVec& first, IVec& second) {
  const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)), m = _mm_set1_epi8(15);
  const __m128i b = _mm_unpacklo_epi8(_mm_and_si128(x, m), _mm_and_si128(_mm_srli_epi16(x, 4), m));
  first = widen_u8(b);
  second = widen_u8(_mm_srli_si128(b, 8));
}
#define HFP_CODEC_SIMD 1
#endif

#ifdef HFP_CODEC_SIMD
template <int kMantissa, int kBias>
inline Vec fp8_vector(IVec c) {          // as fp8_value, lane-wise
  const IVec em = iand(c, iset(0x7F)), sign = shl<24>(iand(c, iset(0x80)));
  const Vec normal = asfloat(iadd(shl<23 - kMantissa>(em), iset((127 - kBias) << 23)));
  const Vec sub = vmul(tofloat(em), asfloat(iset((127 + 1 - kBias - kMantissa) << 23)));
  return asfloat(ior(asint(select_lt(em, 1 << kMantissa, sub, normal)), sign));
}

template <int64_t kFormat>
inline Vec code_vector(const uint8_t* p) {
  if constexpr (kFormat == kInt8) return tofloat(load_i8(p));
  else if constexpr (kFormat == kFp8E4M3) return fp8_vector<3, 7>(load_u8(p));
  else return fp8_vector<2, 15>(load_u8(p));
}

template <int64_t kFormat, float (*Value)(uint8_t)>
inline void row8(const uint8_t* codes, const uint16_t* scales, int64_t num_scales, int64_t d, float* out) {
  const int64_t group = d / num_scales;
  if (group % kLanes) return row8_scalar<Value>(codes, scales, num_scales, d, out);
  for (int64_t g = 0; g < num_scales; ++g) {
    const Vec s = vset(bf16(scales[g]));
    for (int64_t i = g * group; i < (g + 1) * group; i += kLanes) vstore(out + i, vmul(code_vector<kFormat>(codes + i), s));
  }
}

// 16 elements from 8 bytes of nibbles, times `s` plus `m` (one group's, or per channel for KIVI keys).
inline void nibble_block(const uint8_t* codes, float* out, Vec s0, Vec m0, Vec s1, Vec m1) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  (void)s1, (void)m1;
  vstore(out, vfma(tofloat(nibbles16(codes)), s0, m0));
#else
  IVec first, second;
  nibbles16(codes, first, second);
  vstore(out, vfma(tofloat(first), s0, m0));
  vstore(out + 8, vfma(tofloat(second), s1, m1));
#endif
}

inline void int4_row(const uint8_t* codes, const uint16_t* scales, int64_t num_scales, int64_t d, float* out) {
  const int64_t groups = num_scales / 2, group = d / groups;
  if (group % 16) return int4_scalar(codes, scales, num_scales, d, out);
  for (int64_t g = 0; g < groups; ++g) {
    const Vec s = vset(bf16(scales[g])), m = vset(bf16(scales[groups + g]));
    for (int64_t i = g * group; i < (g + 1) * group; i += 16) nibble_block(codes + i / 2, out + i, s, m, s, m);
  }
}

inline void kivi_key_row(const uint8_t* codes, const uint16_t* scales, int64_t num_scales, int64_t d, float* out) {
  if (d % 16) return kivi_key_scalar(codes, scales, num_scales, d, out);
  for (int64_t i = 0; i < d; i += 16) {
    const Vec s0 = load_bf16(scales + i), m0 = load_bf16(scales + d + i);
    const int64_t half = kLanes == 16 ? 0 : 8;      // AVX2: the second vector's 8 channels
    const Vec s1 = load_bf16(scales + i + half), m1 = load_bf16(scales + d + i + half);
    nibble_block(codes + i / 2, out + i, s0, m0, s1, m1);
  }
}
#endif

using RowFn = void (*)(const uint8_t*, const uint16_t*, int64_t, int64_t, float*);

// The row function of `format`; `simd` false gives the scalar one (the test hook compares both).
inline RowFn row_function(int64_t format, bool simd) {
#ifdef HFP_CODEC_SIMD
  if (simd) {
    switch (format) {
      case kInt8: return row8<kInt8, int8_value>;
      case kFp8E4M3: return row8<kFp8E4M3, fp8_value<3, 7>>;
      case kFp8E5M2: return row8<kFp8E5M2, fp8_value<2, 15>>;
      case kInt4: return int4_row;
      case kKiviKey: return kivi_key_row;
    }
  }
#endif
  (void)simd;
  switch (format) {
    case kInt8: return row8_scalar<int8_value>;
    case kFp8E4M3: return row8_scalar<fp8_value<3, 7>>;
    case kFp8E5M2: return row8_scalar<fp8_value<2, 15>>;
    case kInt4: return int4_scalar;
    case kKiviKey: return kivi_key_scalar;
  }
  return nullptr;
}

inline const char* simd_name() {
#if defined(HFP_CODEC_SIMD) && defined(__AVX512F__)
  return "avx512";
#elif defined(HFP_CODEC_SIMD)
  return "avx2";
#else
  return "scalar";
#endif
}

// ---------------------------------------------------------------------------------------------- encoding
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

template <uint8_t (*Code)(float), float (*Value)(uint8_t)>
inline int64_t squared_error(const float* x, int64_t n, float code_max, float s, float first, float second) {
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float residual = x[i] - Value(Code(std::min(std::max(x[i] / s, -code_max), code_max))) * s;
    const int64_t q = round_even(residual * first * second);
    total += q * q;
  }
  return total;
}

template <uint8_t (*Code)(float), float (*Value)(uint8_t)>
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
      const int64_t error = squared_error<Code, Value>(row, group, code_max, bf16(candidate), first, second);
      if (best_error < 0 || error < best_error) best_error = error, best = candidate;
    }
    scales[g] = best;
    const float s = bf16(best);
    for (int64_t i = 0; i < group; ++i) codes[g * group + i] = Code(std::min(std::max(row[i] / s, -code_max), code_max));
  }
}

using EncodeFn = void (*)(const float*, int64_t, int64_t, uint8_t*, uint16_t*);
inline void encode_int8(const float* x, int64_t d, int64_t s, uint8_t* c, uint16_t* sc) { encode8<int8_code>(x, d, s, 127.f, c, sc); }
inline void encode_e4m3(const float* x, int64_t d, int64_t s, uint8_t* c, uint16_t* sc) {
  encode8_searched<fp8_code<3, 7>, fp8_value<3, 7>>(x, d, s, 448.f, c, sc);
}
inline void encode_e5m2(const float* x, int64_t d, int64_t s, uint8_t* c, uint16_t* sc) {
  encode8_searched<fp8_code<2, 15>, fp8_value<2, 15>>(x, d, s, 57344.f, c, sc);
}

// The row encoder of a row format (kInt8, kFp8E4M3, kFp8E5M2, kInt4); nullptr for others (KIVI seals whole
// blocks in hf_paged.kivi).
inline EncodeFn encode_function(int64_t format) {
  switch (format) {
    case kInt8: return encode_int8;
    case kFp8E4M3: return encode_e4m3;
    case kFp8E5M2: return encode_e5m2;
    case kInt4: return encode_int4;
  }
  return nullptr;
}

// ---------------------------------------------------------------------------------------------- rotation
// Whether R [D, D] is the normalised Sylvester-Hadamard matrix (kv_formats.rotation_matrix for power-of-two
// D): R[i][j] = (-1)^popcount(i & j) / sqrt(D). Checked once per call (D^2 compares), so that any other R
// still takes the general product.
inline bool is_hadamard(const float* r, int64_t d) {
  if (d < 2 || (d & (d - 1)) || !(r[0] > 0.f)) return false;
  for (int64_t i = 0; i < d; ++i)
    for (int64_t j = 0; j < d; ++j)
      if (r[i * d + j] != (__builtin_popcountll(static_cast<uint64_t>(i & j)) & 1 ? -r[0] : r[0])) return false;
  return true;
}

// x <- x H for that matrix (symmetric, so also x H^T): the fast Walsh-Hadamard transform, D log D additions
// instead of D^2 multiply-adds, then the 1/sqrt(D) scale.
inline void hadamard_row(float* x, int64_t d, float scale) {
  for (int64_t h = 1; h < d; h *= 2) {
    for (int64_t i = 0; i < d; i += 2 * h) {
#pragma omp simd
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b, x[j + h] = a - b;
      }
    }
  }
  for (int64_t j = 0; j < d; ++j) x[j] *= scale;
}

}  // namespace hfp_codec
