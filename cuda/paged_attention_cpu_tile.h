// The prefill tile of the CPU paged-attention loop (paged_attention_cpu.h): a query tile of R rows (up to
// kTargetRows: consecutive tokens of one row x the GQA group of one KV head) against a key tile of
// consecutive blocks (up to kTileKeys keys), K and V read in place from the block tiles.
//
// Layout, chosen so that no micro-kernel reduces across lanes and no K/V is copied:
//   qt [D][R]      the tile's queries transposed (once per work item), rows padded to kRowStep with zeros
//   st [keys][R]   scores S^T = K Q^T: key-major, query-minor, so that the online softmax of a query row is
//                  lane-wise across rows (running max, sum and correction are vectors of rows)
//   acc [R][D]     the rows' accumulators, acc = acc * corr + P V
// Micro-kernels (register tiles, kLanes = 16 AVX-512 / 8 AVX2 / 8 scalar fallback):
//   scores: kKeyRegs keys x kRowStep rows, a broadcast K element times a row of qt, one K row per key in place
//           (a register tile may span two blocks of the key tile)
//   values: kRowRegs rows x 2 vectors of channels, a broadcast weight times a V row segment in place
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "paged_attention_cpu_simd.h"

namespace hfp_cpu {

constexpr int64_t kKeyRegs = 6;                        // keys per score register tile
constexpr int64_t kRowRegs = 6;                        // query rows per value register tile
constexpr int64_t kRowStep = 2 * simd::kLanes;         // query rows per score register tile; R is padded to it
constexpr int64_t kTileKeys = 64;                      // keys per key tile (more when one block holds more)
constexpr int64_t kTargetRows = 128;                   // query rows per work item: tokens = this / GQA group

// One block of a key tile: its K and V rows ([keys, D] floats, where the tile source put them); kbits: the
// block's bf16 K rows in place, when the tile's scores are made from them (score_block_bf16; k is then unused).
struct TileBlock {
  const float *k, *v;
  int64_t keys;
  const uint16_t* kbits = nullptr;
};

// st[kb][r0 : r0 + kRowStep] = k[kb] . qt[:, r0 : r0 + kRowStep] for KB keys, k[kb] each a [D] row where its
// block holds it (so a register tile may span two blocks); tmax (two vectors) takes the lane-wise maximum of the
// stored scores, in key order.
template <int KB>
inline void score_keys(const float* const* k, const float* qt, int64_t head_dim, int64_t rows, int64_t r0, float* st,
                       simd::V* tmax) {
  using namespace simd;
  V a[KB][2];
  for (int kb = 0; kb < KB; ++kb) a[kb][0] = a[kb][1] = set1(0.f);
  for (int64_t d = 0; d < head_dim; ++d) {
    const V q0 = load(qt + d * rows + r0), q1 = load(qt + d * rows + r0 + kLanes);
    for (int kb = 0; kb < KB; ++kb) {
      const V kd = set1(k[kb][d]);
      a[kb][0] = fma(kd, q0, a[kb][0]);
      a[kb][1] = fma(kd, q1, a[kb][1]);
    }
  }
  for (int kb = 0; kb < KB; ++kb) {
    store(st + kb * rows + r0, a[kb][0]);
    store(st + kb * rows + r0 + kLanes, a[kb][1]);
    tmax[0] = max(tmax[0], a[kb][0]);
    tmax[1] = max(tmax[1], a[kb][1]);
  }
}

// Scores of a key tile's n keys (key_rows: each key's [D] row, across the tile's blocks) against query rows
// [r0, r0 + kRowStep), into st. The register tiles run across block boundaries, so a tile of 16-key blocks
// ends in one narrow tile, not one per block (a 4-key tile keeps 8 sums: FMA-latency-bound, ~1.8x the time
// per key of the 6-key one on a Zen 3). Each score is the same sum in the same order either way.
inline void score_tile(const float* const* key_rows, int64_t n, const float* qt, int64_t head_dim, int64_t rows,
                       int64_t r0, float* st, simd::V* tmax) {
  int64_t j = 0;
  for (; j + kKeyRegs <= n; j += kKeyRegs)
    score_keys<kKeyRegs>(key_rows + j, qt, head_dim, rows, r0, st + j * rows, tmax);
  const float* const* kj = key_rows + j;
  float* sj = st + j * rows;
  switch (n - j) {           // the tile's last keys: a narrower register tile
    case 5: score_keys<5>(kj, qt, head_dim, rows, r0, sj, tmax); break;
    case 4: score_keys<4>(kj, qt, head_dim, rows, r0, sj, tmax); break;
    case 3: score_keys<3>(kj, qt, head_dim, rows, r0, sj, tmax); break;
    case 2: score_keys<2>(kj, qt, head_dim, rows, r0, sj, tmax); break;
    case 1: score_keys<1>(kj, qt, head_dim, rows, r0, sj, tmax); break;
    default: break;
  }
}

#if defined(__AVX512BF16__)
// score_keys for bf16 keys read in place and bf16 queries in pairs: qt2 [D/2][R] holds each row's
// (q[2p], q[2p+1]) as one 32-bit lane, a key's (k[2p], k[2p+1]) is broadcast, and VDPBF16PS adds both products
// (exact in float) to float sums: half the instructions of the float kernel. The sums are then scaled (the
// queries arrive unscaled: a bf16 query times a non-power-of-two scale would round).
template <int KB>
inline void score_keys_bf16(const uint16_t* k, const uint32_t* qt2, int64_t head_dim, int64_t rows, int64_t r0,
                            float scale, float* st, __m512* tmax) {
  __m512 a[KB][2];
  for (int kb = 0; kb < KB; ++kb) a[kb][0] = a[kb][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < head_dim / 2; ++p) {
    const __m512bh q0 = (__m512bh)_mm512_loadu_si512(qt2 + p * rows + r0);
    const __m512bh q1 = (__m512bh)_mm512_loadu_si512(qt2 + p * rows + r0 + 16);
    for (int kb = 0; kb < KB; ++kb) {
      int32_t pair;
      std::memcpy(&pair, k + kb * head_dim + 2 * p, sizeof pair);
      const __m512bh kp = (__m512bh)_mm512_set1_epi32(pair);
      a[kb][0] = _mm512_dpbf16_ps(a[kb][0], q0, kp);
      a[kb][1] = _mm512_dpbf16_ps(a[kb][1], q1, kp);
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int kb = 0; kb < KB; ++kb) {
    const __m512 x0 = _mm512_mul_ps(a[kb][0], s), x1 = _mm512_mul_ps(a[kb][1], s);
    _mm512_storeu_ps(st + kb * rows + r0, x0);
    _mm512_storeu_ps(st + kb * rows + r0 + 16, x1);
    tmax[0] = _mm512_max_ps(tmax[0], x0);
    tmax[1] = _mm512_max_ps(tmax[1], x1);
  }
}

// score_tile for one block's bf16 keys in place (see score_keys_bf16).
inline void score_block_bf16(const uint16_t* k, int64_t keys, const uint32_t* qt2, int64_t head_dim, int64_t rows,
                             int64_t r0, float scale, float* st, __m512* tmax) {
  int64_t j = 0;
  for (; j + kKeyRegs <= keys; j += kKeyRegs)
    score_keys_bf16<kKeyRegs>(k + j * head_dim, qt2, head_dim, rows, r0, scale, st + j * rows, tmax);
  const uint16_t* kj = k + j * head_dim;
  float* sj = st + j * rows;
  switch (keys - j) {
    case 5: score_keys_bf16<5>(kj, qt2, head_dim, rows, r0, scale, sj, tmax); break;
    case 4: score_keys_bf16<4>(kj, qt2, head_dim, rows, r0, scale, sj, tmax); break;
    case 3: score_keys_bf16<3>(kj, qt2, head_dim, rows, r0, scale, sj, tmax); break;
    case 2: score_keys_bf16<2>(kj, qt2, head_dim, rows, r0, scale, sj, tmax); break;
    case 1: score_keys_bf16<1>(kj, qt2, head_dim, rows, r0, scale, sj, tmax); break;
    default: break;
  }
}
#endif

// Per-row state of the online softmax, [R] each. lo/hi: the tile's keys row r sees, lo <= j < hi (tile
// coordinates, as floats: exact below 2^24); padding rows have lo = hi = 0 and see none.
struct RowState {
  float *m, *l, *corr, *lo, *hi;
};

// Online softmax over the key tile's n keys for rows [begin, end) (multiples of kLanes): masks the scores
// outside [lo, hi) (when `masked`; otherwise every row sees every key), updates m and l, turns st into the
// weights exp(s - m_new) and sets corr = exp(m_old - m_new). A row that has seen no key keeps m = -inf, l = 0
// and gets corr = 0 (its accumulator is 0 anyway). Each vector of rows is independent of the others.
// scored_max: the scores' maximum per row from score_keys (rows from `begin`), used when nothing is masked.
inline void softmax_rows(float* st, int64_t n, int64_t rows, int64_t begin, int64_t end, const RowState& rs,
                         bool masked, const simd::V* scored_max) {
  using namespace simd;
  for (int64_t r0 = begin; r0 < end; r0 += kLanes) {
    const V old_max = load(rs.m + r0);
    V tile_max = scored_max[(r0 - begin) / kLanes];
    if (masked) {                                      // the maximum of what the rows see, after masking
      const V lo = load(rs.lo + r0), hi = load(rs.hi + r0);
      tile_max = set1(-std::numeric_limits<float>::infinity());
      for (int64_t j = 0; j < n; ++j) {
        float* s = st + j * rows + r0;
        const V x = keep_between(load(s), set1(static_cast<float>(j)), lo, hi);
        store(s, x);
        tile_max = max(tile_max, x);
      }
    }
    const V new_max = max(old_max, tile_max), shift = finite_or_zero(new_max);
    const V corr = exp_nonpositive(sub(old_max, shift));
    V sum = set1(0.f);
    for (int64_t j = 0; j < n; ++j) {
      float* s = st + j * rows + r0;
      const V p = exp_nonpositive(sub(load(s), shift));
      store(s, p);
      sum = add(sum, p);
    }
    store(rs.l + r0, fma(load(rs.l + r0), corr, sum));
    store(rs.m + r0, new_max);
    store(rs.corr + r0, corr);
  }
}

// acc[r0 + r][d0 : d0 + NV * kLanes] = acc * corr + sum_j p[j][r0 + r] v[j] for RB rows, keys of every block.
template <int RB, int NV>
inline void value_rows(float* acc, const float* corr, const float* pt, int64_t rows, const TileBlock* blocks,
                       int64_t num_blocks, int64_t r0, int64_t d0, int64_t head_dim) {
  using namespace simd;
  V a[RB][NV];
  for (int r = 0; r < RB; ++r) {
    const V c = set1(corr[r0 + r]);
    for (int e = 0; e < NV; ++e) a[r][e] = mul(load(acc + (r0 + r) * head_dim + d0 + e * kLanes), c);
  }
  const float* p = pt + r0;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const float* v = blocks[b].v + d0;
    for (int64_t j = 0; j < blocks[b].keys; ++j, p += rows, v += head_dim) {
      V x[NV];
      for (int e = 0; e < NV; ++e) x[e] = load(v + e * kLanes);
      for (int r = 0; r < RB; ++r) {
        const V w = set1(p[r]);
        for (int e = 0; e < NV; ++e) a[r][e] = fma(w, x[e], a[r][e]);
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int e = 0; e < NV; ++e) store(acc + (r0 + r) * head_dim + d0 + e * kLanes, a[r][e]);
}

template <int NV>
inline void value_block_rows(int64_t rb, float* acc, const float* corr, const float* pt, int64_t rows,
                             const TileBlock* blocks, int64_t num_blocks, int64_t r0, int64_t d0, int64_t head_dim) {
  switch (rb) {
    case 6: return value_rows<6, NV>(acc, corr, pt, rows, blocks, num_blocks, r0, d0, head_dim);
    case 5: return value_rows<5, NV>(acc, corr, pt, rows, blocks, num_blocks, r0, d0, head_dim);
    case 4: return value_rows<4, NV>(acc, corr, pt, rows, blocks, num_blocks, r0, d0, head_dim);
    case 3: return value_rows<3, NV>(acc, corr, pt, rows, blocks, num_blocks, r0, d0, head_dim);
    case 2: return value_rows<2, NV>(acc, corr, pt, rows, blocks, num_blocks, r0, d0, head_dim);
    default: return value_rows<1, NV>(acc, corr, pt, rows, blocks, num_blocks, r0, d0, head_dim);
  }
}

// Channels [d0, D) that fill no vector (D not a multiple of kLanes): plain loops.
inline void value_tail(float* acc, const float* corr, const float* pt, int64_t rows, const TileBlock* blocks,
                       int64_t num_blocks, int64_t live, int64_t d0, int64_t head_dim) {
  for (int64_t r = 0; r < live; ++r) {
    for (int64_t d = d0; d < head_dim; ++d) {
      float a = acc[r * head_dim + d] * corr[r];
      const float* p = pt + r;
      for (int64_t b = 0; b < num_blocks; ++b)
        for (int64_t j = 0; j < blocks[b].keys; ++j, p += rows) a += *p * blocks[b].v[j * head_dim + d];
      acc[r * head_dim + d] = a;
    }
  }
}

// The values of a key tile for the first `live` (unpadded) query rows.
inline void value_tile(float* acc, const float* corr, const float* pt, int64_t rows, const TileBlock* blocks,
                       int64_t num_blocks, int64_t live, int64_t head_dim) {
  constexpr int64_t kWide = 2 * simd::kLanes;
  // AVX-512's 32 registers hold 6 rows x 4 vectors of sums (64 channels): each weight broadcast and each pt read
  // serve twice the channels. (AVX2's 16 would spill.) A channel's sum is the same either way.
  constexpr bool kFour = simd::kLanes == 16;
  for (int64_t r0 = 0; r0 < live; r0 += kRowRegs) {
    const int64_t rb = std::min(kRowRegs, live - r0);
    int64_t d0 = 0;
    if constexpr (kFour) {
      for (; d0 + 2 * kWide <= head_dim; d0 += 2 * kWide)
        value_block_rows<4>(rb, acc, corr, pt, rows, blocks, num_blocks, r0, d0, head_dim);
    }
    for (; d0 + kWide <= head_dim; d0 += kWide)
      value_block_rows<2>(rb, acc, corr, pt, rows, blocks, num_blocks, r0, d0, head_dim);
    for (; d0 + simd::kLanes <= head_dim; d0 += simd::kLanes)
      value_block_rows<1>(rb, acc, corr, pt, rows, blocks, num_blocks, r0, d0, head_dim);
  }
  const int64_t tail = head_dim - head_dim % simd::kLanes;
  if (tail < head_dim) value_tail(acc, corr, pt, rows, blocks, num_blocks, live, tail, head_dim);
}

}  // namespace hfp_cpu
