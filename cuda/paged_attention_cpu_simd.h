// The vector layer of the CPU paged-attention kernel's prefill tiles (paged_attention_cpu_tile.h): one float
// vector type V of kLanes lanes and the few operations the micro-kernels use, chosen at build time by
// -march=native (cpu_backend.py), as kv_codec_cpu.h chooses its codec: AVX-512F (16 lanes), AVX2 + FMA (8),
// else a plain 8-float struct whose loops the compiler vectorises as it can (the scalar fallback).
// Every operation is lane-wise; the micro-kernels never reduce across lanes, so results do not depend on the
// lane count beyond the fp32 summation order.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace hfp_cpu {

// e^x for x <= 0 (scores minus their running max), vectorisable: x = n ln2 + r with |r| <= ln2/2 and a
// degree-6 polynomial for e^r (relative error ~1e-7, as expf). x below -87 gives ~1e-38, not 0; a weight
// that small changes no float sum it joins.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.44269504088896341f;
  const float n = (t + 12582912.0f) - 12582912.0f;        // round to nearest (1.5 * 2^23 trick)
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  float p = 1.f + r * (1.f + r * (0.5f + r * (1.6666666666666666e-1f + r * (4.1666666666666664e-2f +
            r * (8.3333333333333332e-3f + r * 1.3888888888888889e-3f)))));
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

namespace simd {

constexpr float kExpFloor = -87.0f;     // vector exp: inputs below this (masked keys: -inf) give exactly 0

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using V = __m512;
inline V load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, V a) { _mm512_storeu_ps(p, a); }
inline V set1(float a) { return _mm512_set1_ps(a); }
inline V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V mul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V add(V a, V b) { return _mm512_add_ps(a, b); }
inline V sub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V max(V a, V b) { return _mm512_max_ps(a, b); }
// s where lo <= j < hi, else -inf.
inline V keep_between(V s, V j, V lo, V hi) {
  const __mmask16 in = _mm512_cmp_ps_mask(lo, j, _CMP_LE_OQ) & _mm512_cmp_ps_mask(j, hi, _CMP_LT_OQ);
  return _mm512_mask_blend_ps(in, set1(-std::numeric_limits<float>::infinity()), s);
}
// m, with -inf (a row that has seen no key yet) replaced by 0, so that s - m stays -inf or finite.
inline V finite_or_zero(V m) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m, set1(-std::numeric_limits<float>::infinity()), _CMP_EQ_OQ), m,
                              _mm512_setzero_ps());
}
inline V exp_scale(V n) {       // 2^n for integral n in [-126, 0]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
inline V zero_below(V x, V value) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, set1(kExpFloor), _CMP_LT_OQ), value, _mm512_setzero_ps());
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kLanes = 8;
using V = __m256;
inline V load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, V a) { _mm256_storeu_ps(p, a); }
inline V set1(float a) { return _mm256_set1_ps(a); }
inline V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V mul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V add(V a, V b) { return _mm256_add_ps(a, b); }
inline V sub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V max(V a, V b) { return _mm256_max_ps(a, b); }
inline V keep_between(V s, V j, V lo, V hi) {
  const V in = _mm256_and_ps(_mm256_cmp_ps(lo, j, _CMP_LE_OQ), _mm256_cmp_ps(j, hi, _CMP_LT_OQ));
  return _mm256_blendv_ps(set1(-std::numeric_limits<float>::infinity()), s, in);
}
inline V finite_or_zero(V m) {
  return _mm256_blendv_ps(m, _mm256_setzero_ps(),
                          _mm256_cmp_ps(m, set1(-std::numeric_limits<float>::infinity()), _CMP_EQ_OQ));
}
inline V exp_scale(V n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline V zero_below(V x, V value) {
  return _mm256_blendv_ps(value, _mm256_setzero_ps(), _mm256_cmp_ps(x, set1(kExpFloor), _CMP_LT_OQ));
}
#else
constexpr int64_t kLanes = 8;
struct V {
  float x[kLanes];
};
#define HFP_LANEWISE(expr)                 \
  V out;                                   \
  for (int64_t i = 0; i < kLanes; ++i) out.x[i] = (expr); \
  return out
inline V load(const float* p) { HFP_LANEWISE(p[i]); }
inline void store(float* p, V a) { std::copy(a.x, a.x + kLanes, p); }
inline V set1(float a) { HFP_LANEWISE(a); }
inline V fma(V a, V b, V c) { HFP_LANEWISE(a.x[i] * b.x[i] + c.x[i]); }
inline V mul(V a, V b) { HFP_LANEWISE(a.x[i] * b.x[i]); }
inline V add(V a, V b) { HFP_LANEWISE(a.x[i] + b.x[i]); }
inline V sub(V a, V b) { HFP_LANEWISE(a.x[i] - b.x[i]); }
inline V max(V a, V b) { HFP_LANEWISE(std::max(a.x[i], b.x[i])); }
inline V keep_between(V s, V j, V lo, V hi) {
  HFP_LANEWISE(lo.x[i] <= j.x[i] && j.x[i] < hi.x[i] ? s.x[i] : -std::numeric_limits<float>::infinity());
}
inline V finite_or_zero(V m) { HFP_LANEWISE(m.x[i] == -std::numeric_limits<float>::infinity() ? 0.f : m.x[i]); }
inline V exp_scale(V n) {
  V out;
  for (int64_t i = 0; i < kLanes; ++i) {
    const int32_t bits = (static_cast<int32_t>(n.x[i]) + 127) << 23;
    std::memcpy(&out.x[i], &bits, sizeof bits);
  }
  return out;
}
inline V zero_below(V x, V value) { HFP_LANEWISE(x.x[i] < kExpFloor ? 0.f : value.x[i]); }
#undef HFP_LANEWISE
#endif

// exp_nonpositive lane-wise, except that inputs below kExpFloor (masked keys, -inf) give exactly 0.
inline V exp_nonpositive(V x) {
  const V clamped = max(x, set1(kExpFloor));
  const V t = mul(clamped, set1(1.44269504088896341f));
  const V n = sub(add(t, set1(12582912.0f)), set1(12582912.0f));
  const V r = fma(n, set1(-1.428606765330187e-06f), fma(n, set1(-0.693145751953125f), clamped));
  V p = set1(1.3888888888888889e-3f);
  for (float c : {8.3333333333333332e-3f, 4.1666666666666664e-2f, 1.6666666666666666e-1f, 0.5f, 1.f, 1.f})
    p = fma(p, r, set1(c));
  return zero_below(x, mul(p, exp_scale(n)));
}

}  // namespace simd
}  // namespace hfp_cpu
