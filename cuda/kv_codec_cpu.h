// Dequantisation of quantised KV rows on the CPU (hf_paged/kv_formats.py and hf_paged/kivi.py lay them out),
// one small function per format, so that a change of a format's scale math changes one function here.
//
// Every function turns one stored row (D elements of one token and KV head) into D floats. Scales are bf16
// and read through the layout the pool has (`num_scales` per row, from the scales tensor's shape), never
// from constants: 8-bit formats use scale g for elements [g * D / S, (g + 1) * D / S); int4 (asymmetric)
// keeps S / 2 group scales then S / 2 group minima; KIVI keys use one scale and minimum per channel;
// nvfp4 rows hold D/2 bytes of e2m1 codes, then D/16 e4m3 group scales, beside one bf16 row scale (S = 1).
// A value is `code * scale` (8-bit), `code * scale + minimum` (4-bit) or `e2m1(code) * (e4m3(group) * row)`
// (nvfp4) in fp32; the SIMD paths may fuse the multiply-add (one rounding instead of two: within 1 ulp of
// kv_formats.dequantize), and give the products bit for bit.
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
enum Format : int64_t { kInt8 = 0, kFp8E4M3 = 1, kFp8E5M2 = 2, kInt4 = 3, kKiviKey = 4, kNvfp4 = 5, kNumFormats = 6 };

// nvfp4: e2m1 magnitudes of codes 0..7 (bit 3 the sign; code 8 is -0), groups of 16 elements.
constexpr float kE2M1[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
constexpr int64_t kNvfp4Group = 16;
inline int64_t nvfp4_row_bytes(int64_t d) { return d / 2 + d / kNvfp4Group; }

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

// nvfp4: `scales` is the row's one bf16 scale; group g's e4m3 scale is byte D/2 + g of the codes.
inline float e2m1_value(uint32_t code) { return (code & 8u) ? -kE2M1[code & 7u] : kE2M1[code & 7u]; }

inline void nvfp4_scalar(const uint8_t* codes, const uint16_t* scales, int64_t, int64_t d, float* out) {
  const float row = bf16(scales[0]);
  for (int64_t i = 0; i < d; ++i) {
    const float step = fp8_value<3, 7>(codes[d / 2 + i / kNvfp4Group]) * row;
    out[i] = e2m1_value((codes[i / 2] >> (4 * (i & 1))) & 15u) * step;
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
inline Vec lookup8(IVec index, Vec table) { return _mm512_permutexvar_ps(index, table); }   // table[index], index < 8
inline Vec table8(const float* t) { return _mm512_castps256_ps512(_mm256_loadu_ps(t)); }
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
inline Vec lookup8(IVec index, Vec table) { return _mm256_permutevar8x32_ps(table, index); }
inline Vec table8(const float* t) { return _mm256_loadu_ps(t); }
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

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 16 fp8 codes through the fp16 conversion (vcvtph2ps): e5m2 is the top byte of an fp16 (the same exponent
// bias), e4m3 (bias 7) shifted in as an fp16 (bias 15) is its value * 2^-8, subnormals included; every finite
// code exactly. The caller multiplies e4m3 by 256 * scale (exact: a power of two), so the product is the
// same single rounding of the same real number as fp8_value(code) * scale.
template <int64_t kFormat>
inline Vec fp8_half_vector(const uint8_t* p) {
  // each code in the top byte of a 16-bit lane: e5m2 is then an fp16; e4m3 is that shifted right by one with
  // its sign copied and the copy (bit 14) cleared, sign << 15 | exponent and mantissa << 7
  const __m256i top = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 8);
  if constexpr (kFormat == kFp8E5M2) return _mm512_cvtph_ps(top);
  return _mm512_cvtph_ps(_mm256_and_si256(_mm256_srai_epi16(top, 1), _mm256_set1_epi16(static_cast<int16_t>(0xBF80))));
}
constexpr float kE4m3HalfScale = 256.f;
#define HFP_FP8_HALF 1
#elif defined(__F16C__)
// The same through AVX2's F16C (vcvtph2ps on 8 halves): 8 fp8 codes at a time.
template <int64_t kFormat>
inline Vec fp8_half_vector(const uint8_t* p) {
  // each code into the top byte of a 16-bit lane in one unpack (e5m2 is then an fp16), e4m3 as above
  const __m128i top = _mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  if constexpr (kFormat == kFp8E5M2) return _mm256_cvtph_ps(top);
  return _mm256_cvtph_ps(_mm_and_si128(_mm_srai_epi16(top, 1), _mm_set1_epi16(static_cast<int16_t>(0xBF80))));
}
constexpr float kE4m3HalfScale = 256.f;
#define HFP_FP8_HALF 1
#endif

template <int64_t kFormat>
inline Vec code_vector(const uint8_t* p) {
  if constexpr (kFormat == kInt8) return tofloat(load_i8(p));
#if defined(HFP_FP8_HALF)
  else return fp8_half_vector<kFormat>(p);           // e4m3: value / 256 (row8 folds the 256 into the scale)
#else
  else if constexpr (kFormat == kFp8E4M3) return fp8_vector<3, 7>(load_u8(p));
  else return fp8_vector<2, 15>(load_u8(p));
#endif
}

template <int64_t kFormat, float (*Value)(uint8_t)>
inline void row8(const uint8_t* codes, const uint16_t* scales, int64_t num_scales, int64_t d, float* out) {
  const int64_t group = d / num_scales;
  if (group % kLanes) return row8_scalar<Value>(codes, scales, num_scales, d, out);
  for (int64_t g = 0; g < num_scales; ++g) {
#if defined(HFP_FP8_HALF)
    const Vec s = vset(kFormat == kFp8E4M3 ? bf16(scales[g]) * kE4m3HalfScale : bf16(scales[g]));
#else
    const Vec s = vset(bf16(scales[g]));
#endif
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

// e2m1 codes (0..15) lane-wise: the magnitude from the table, bit 3 as the sign bit (code 8: -0, as torch's).
inline Vec e2m1_vector(IVec code, Vec table) {
  return asfloat(ior(asint(lookup8(iand(code, iset(7)), table)), shl<28>(iand(code, iset(8)))));
}

inline void nvfp4_row(const uint8_t* codes, const uint16_t* scales, int64_t num_scales, int64_t d, float* out) {
  if (d % kNvfp4Group) return nvfp4_scalar(codes, scales, num_scales, d, out);
  const Vec table = table8(kE2M1);
  const float row = bf16(scales[0]);
  for (int64_t g = 0; g < d / kNvfp4Group; ++g) {
    const Vec step = vset(fp8_value<3, 7>(codes[d / 2 + g]) * row);
    const uint8_t* c = codes + g * kNvfp4Group / 2;
    float* o = out + g * kNvfp4Group;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    vstore(o, vmul(e2m1_vector(nibbles16(c), table), step));
#else
    IVec first, second;
    nibbles16(c, first, second);
    vstore(o, vmul(e2m1_vector(first, table), step));
    vstore(o + 8, vmul(e2m1_vector(second, table), step));
#endif
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
      case kNvfp4: return nvfp4_row;
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
    case kNvfp4: return nvfp4_scalar;
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

// ---------------------------------------------------------------------------------------------- rotation
// Whether R [D, D] is the normalised Sylvester-Hadamard matrix (kv_formats.rotation_matrix for power-of-two
// D): R[i][j] = (-1)^popcount(i & j) / sqrt(D). Checked once per call (D^2 compares, 16 at a time with AVX-512),
// so that any other R still takes the general product.
inline bool is_hadamard(const float* r, int64_t d) {
  if (d < 2 || (d & (d - 1)) || !(r[0] > 0.f)) return false;
#if defined(__AVX512F__)
  if (d % 16 == 0) {           // 16 entries per compare: i & (j0 + l) splits into the disjoint bits i & j0, i & l
    const __m512 plus = _mm512_set1_ps(r[0]), minus = _mm512_set1_ps(-r[0]);
    for (int64_t i = 0; i < d; ++i) {
      uint32_t lanes = 0;                      // lane l negative where popcount(i & l) is odd
      for (int64_t l = 0; l < 16; ++l) lanes |= static_cast<uint32_t>(__builtin_popcountll(static_cast<uint64_t>(i & l)) & 1) << l;
      for (int64_t j = 0; j < d; j += 16) {
        const __mmask16 negative = static_cast<__mmask16>(__builtin_popcountll(static_cast<uint64_t>(i & j)) & 1 ? ~lanes : lanes);
        // NEQ_UQ: a NaN entry also fails, as the scalar != does
        if (_mm512_cmp_ps_mask(_mm512_loadu_ps(r + i * d + j), _mm512_mask_blend_ps(negative, plus, minus), _CMP_NEQ_UQ))
          return false;
      }
    }
    return true;
  }
#endif
  for (int64_t i = 0; i < d; ++i)
    for (int64_t j = 0; j < d; ++j)
      if (r[i * d + j] != (__builtin_popcountll(static_cast<uint64_t>(i & j)) & 1 ? -r[0] : r[0])) return false;
  return true;
}

#if defined(__AVX512F__)
// One butterfly stage of distance h < 16 inside a 16-lane vector: lane j (bit h clear) gets a + b, lane j + h
// gets a - b, with a = x[j], b = x[j + h]: the scalar loop's two operations on the same operands.
template <int H>
inline __m512 hadamard_lanes(__m512 v) {
  __m512 partner;
  if constexpr (H == 8) partner = _mm512_shuffle_f32x4(v, v, 0x4E);          // 256-bit halves swapped
  else if constexpr (H == 4) partner = _mm512_shuffle_f32x4(v, v, 0xB1);     // 128-bit lanes swapped in pairs
  else if constexpr (H == 2) partner = _mm512_permute_ps(v, 0x4E);           // 64-bit pairs swapped
  else partner = _mm512_permute_ps(v, 0xB1);                                 // neighbours swapped
  constexpr __mmask16 kUpper = H == 8 ? 0xFF00 : H == 4 ? 0xF0F0 : H == 2 ? 0xCCCC : 0xAAAA;
  return _mm512_mask_sub_ps(_mm512_add_ps(v, partner), kUpper, partner, v);
}
#elif defined(__AVX2__)
// The same inside an 8-lane vector (h = 4, 2, 1).
template <int H>
inline __m256 hadamard_lanes(__m256 v) {
  __m256 partner;
  if constexpr (H == 4) partner = _mm256_permute2f128_ps(v, v, 0x01);        // 128-bit halves swapped
  else if constexpr (H == 2) partner = _mm256_permute_ps(v, 0x4E);           // 64-bit pairs swapped
  else partner = _mm256_permute_ps(v, 0xB1);                                 // neighbours swapped
  constexpr int kUpper = H == 4 ? 0xF0 : H == 2 ? 0xCC : 0xAA;
  return _mm256_blend_ps(_mm256_add_ps(v, partner), _mm256_sub_ps(partner, v), kUpper);
}
#endif

// x <- x H for that matrix (symmetric, so also x H^T): the fast Walsh-Hadamard transform, D log D additions
// instead of D^2 multiply-adds, then the 1/sqrt(D) scale. With AVX-512 and D a multiple of 16 (the stages
// below 16 inside each vector, the others between vectors; AVX2: 8 and 8) every element sees the scalar loop's
// additions in the same order: the same result bit for bit.
inline void hadamard_row(float* x, int64_t d, float scale) {
#if defined(__AVX512F__)
  if (d % 16 == 0 && d <= 256) {
    __m512 v[16];
    const int64_t n = d / 16;
    for (int64_t i = 0; i < n; ++i) {
      v[i] = _mm512_loadu_ps(x + 16 * i);
      v[i] = hadamard_lanes<8>(hadamard_lanes<4>(hadamard_lanes<2>(hadamard_lanes<1>(v[i]))));
    }
    for (int64_t h = 1; h < n; h *= 2)
      for (int64_t i = 0; i < n; i += 2 * h)
        for (int64_t j = i; j < i + h; ++j) {
          const __m512 a = v[j], b = v[j + h];
          v[j] = _mm512_add_ps(a, b), v[j + h] = _mm512_sub_ps(a, b);
        }
    const __m512 s = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < n; ++i) _mm512_storeu_ps(x + 16 * i, _mm512_mul_ps(v[i], s));
    return;
  }
#elif defined(__AVX2__)
  if (d % 8 == 0 && d <= 256) {      // as above, 8 lanes: the stages below 8 inside each vector
    __m256 v[32];
    const int64_t n = d / 8;
    for (int64_t i = 0; i < n; ++i)
      v[i] = hadamard_lanes<4>(hadamard_lanes<2>(hadamard_lanes<1>(_mm256_loadu_ps(x + 8 * i))));
    for (int64_t h = 1; h < n; h *= 2)
      for (int64_t i = 0; i < n; i += 2 * h)
        for (int64_t j = i; j < i + h; ++j) {
          const __m256 a = v[j], b = v[j + h];
          v[j] = _mm256_add_ps(a, b), v[j + h] = _mm256_sub_ps(a, b);
        }
    const __m256 s = _mm256_set1_ps(scale);
    for (int64_t i = 0; i < n; ++i) _mm256_storeu_ps(x + 8 * i, _mm256_mul_ps(v[i], s));
    return;
  }
#endif
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
