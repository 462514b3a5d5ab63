// Decode steps of bf16 pools on the CPU, for torch.ops.hf_paged_cpu.paged_attention (paged_attention_cpu.cpp
// calls attend_decode_bf16 first): every row one token, D a multiple of 32, a build for AVX-512 BF16. Keys are
// scored where they lie by VDPBF16PS against the unscaled bf16 query, into float accumulators, and the sum then
// scaled (as a bf16 matmul with float accumulation and a float scale computes it), sixteen keys at a time with
// one transposing sum (lane_sums16); values are converted per block as attend's decode items convert them, with
// the same online softmax and accumulation (paged_attention_cpu.h). Measured (SmolLM2's heads, 32 sequences of
// 100-200 tokens, 2 threads, Zen 4): 1.2-1.3x faster than converting the keys to float first.
// A translation unit of its own: the same code inside paged_attention_cpu.cpp (as a branch of decode_item or a
// driver beside attend) slowed the bf16 prefill chunks there by ~15% (GCC), though it never ran for them.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "paged_attention_cpu.h"

namespace hfp_cpu {

#if defined(__AVX512BF16__)
namespace {

// sc[j] = scale * (q . k[j]) for keys jlo <= j < jhi of a bf16 [keys, D] tile, q the unscaled bf16 query.
void scores_bf16(const uint16_t* q, const uint16_t* k, int64_t jlo, int64_t jhi, int64_t head_dim, float scale,
                 float* sc) {
  const __m512 s = _mm512_set1_ps(scale);
  int64_t j = jlo;
  for (; j + 16 <= jhi; j += 16) {
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 32) {
      const __m512bh qd = (__m512bh)_mm512_loadu_si512(q + d);
      for (int i = 0; i < 16; ++i)
        acc[i] = _mm512_dpbf16_ps(acc[i], qd, (__m512bh)_mm512_loadu_si512(k + (j + i) * head_dim + d));
    }
    _mm512_storeu_ps(sc + j, _mm512_mul_ps(lane_sums16(acc), s));
  }
  for (; j < jhi; ++j) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 32)
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + d), (__m512bh)_mm512_loadu_si512(k + j * head_dim + d));
    sc[j] = _mm512_reduce_add_ps(acc) * scale;
  }
}

}  // namespace
#endif

bool attend_decode_bf16(const Geometry& g, const c10::BFloat16* k_pool, const c10::BFloat16* v_pool,
                        const c10::BFloat16* q_data, c10::BFloat16* o_data) {
#if defined(__AVX512BF16__)
  if (g.head_dim % 32 != 0) return false;
  // A decode step: no two consecutive tokens of one row (make_chunks would join them: attend's prefill chunks,
  // which reuse each block for the chunk's tokens). Checked here without make_chunks, so that prefill steps
  // (answered false) do not build their chunks twice.
  for (int64_t t = 1; t < g.tokens; ++t)
    if (g.pos_of[t] >= 0 && g.pos_of[t - 1] >= 0 && g.row_of[t] == g.row_of[t - 1]) return false;
  std::vector<int64_t> start, count;
  make_chunks(g, start, count);                   // checks every token's row and table width
  const int64_t d = g.head_dim, group = g.group, items = g.num_kv_heads * g.tokens, tile = g.block_size * d;
  const uint16_t* q_bits = reinterpret_cast<const uint16_t*>(q_data);
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> vbuf(tile), sc(g.block_size), m(group), l(group), acc(group * d);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / g.tokens, t = item % g.tokens, pos = g.pos_of[t];
      c10::BFloat16* out = o_data + (t * g.num_q_heads + h * group) * d;
      if (pos < 0) {                                          // a pad token: zeros, as attend gives it
        std::fill(out, out + group * d, static_cast<c10::BFloat16>(0.f));
        continue;
      }
      const uint16_t* q = q_bits + (t * g.num_q_heads + h * group) * d;
      const int64_t first = g.window > 0 ? std::max<int64_t>(0, pos - g.window + 1) : 0;
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = first / g.block_size; b * g.block_size <= pos; ++b) {
        const int64_t base = b * g.block_size, keys = std::min(g.block_size, pos + 1 - base);
        const int64_t at = (h * g.num_blocks + table_block(g, g.row_of[t], b)) * tile;
        const int64_t jlo = std::max<int64_t>(first - base, 0);
        to_float(v_pool + at, vbuf.data(), keys * d);
        const uint16_t* k = reinterpret_cast<const uint16_t*>(k_pool + at);
        for (int64_t i = 0; i < group; ++i) {
          scores_bf16(q + i * d, k, jlo, keys, d, g.scale, sc.data());
          const float corr = softmax_update(sc.data(), jlo, keys, m[i], l[i]);
          accumulate(acc.data() + i * d, corr, sc.data(), vbuf.data(), jlo, keys, d);
        }
      }
      for (int64_t i = 0; i < group; ++i) {
        const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
        float* a = acc.data() + i * d;
        for (int64_t c = 0; c < d; ++c) a[c] *= inv;
        from_float(a, out + i * d, d);
      }
    }
  });
  return true;
#else
  (void)g, (void)k_pool, (void)v_pool, (void)q_data, (void)o_data;
  return false;
#endif
}

}  // namespace hfp_cpu
