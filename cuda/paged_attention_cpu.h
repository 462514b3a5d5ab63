// The CPU paged-attention loop (see paged_attention_cpu.cpp for the op and its layout), shared by the
// model-dtype op and the quantised one (paged_attention_cpu_quant.cpp). It is written against a *tile
// source*: anything with
//   const float* keys(int64_t h, int64_t block, int64_t rows, float* buffer, bool own) const
//   const float* values(int64_t h, int64_t block, int64_t rows, float* buffer, bool own) const
//   const float* rotation() const        fp32 [D, D] R or nullptr: the pools hold x R (kv_formats), so each
//                                        query row is rotated once on entry and each output once on exit
//   bool rotates_query() const           false: R only unrotates the output (the keys are stored unrotated)
//   bool hadamard() const                R is_hadamard (then rotated by the fast transform)
//   static constexpr bool kConverts      tiles are made (dequantised), not read in place; then also
//   void key_rows(h, block, from, to, float* dst, bool own) const / value_rows(...): rows [from, to) into dst
// returning the first `rows` rows of KV head h's block as a float [rows, D] tile, either where they are
// (f32 pools) or converted / dequantised into `buffer` ([block_size, D] of this thread's scratch). `own`:
// the block holds the item's queries (Geometry::own_blocks: KIVI reads it in full precision, the blocks
// before it from codes; other sources read a block one way and never get own = true). Each
// tile is produced once per (KV head, block, work item) and serves every query of the item (the GQA
// group, and the tokens of a prefill row's chunk), so dequantisation costs once per stored row read.
// Decode items (one token) take dot products per key; prefill chunks go through the register-tiled query
// and key tiles of paged_attention_cpu_tile.h. A source may also declare
//   static constexpr bool kBf16Keys      its keys are bf16 in place: const uint16_t* key_bits(h, block) const
// and then, in a build for AVX-512 BF16, prefill chunks score them by VDPBF16PS (score_block_bf16) against
// the unscaled bf16 queries instead of converting them to float.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "paged_attention_cpu_tile.h"     // the prefill tile, exp_nonpositive
#include "paged_attention_cpu_util.h"     // rotate_row, TileCache

namespace hfp_cpu {

constexpr int kMaxGroup = 64;       // query heads per KV head (refused above this, with the limit named)

// The bf16 bits of a float that holds a bf16 value exactly (a converted bf16 query): its top half.
inline uint32_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u >> 16;
}

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
#if defined(__AVX512F__) && defined(__AVX512BW__)
// bf16 -> float is a 16-bit shift: 16 at a time through the codec's load_bf16 (the compiler's loop used 256-bit
// registers with a cross-lane extract, and a decode step's K/V tiles of a bf16 pool go through here).
template <>
inline void to_float<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, hfp_codec::load_bf16(reinterpret_cast<const uint16_t*>(src + i)));
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
#endif

template <typename T>
inline void from_float(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// A [rows, D] tile as float: f32 pools are read where they are, others are converted into `buffer`.
template <typename T>
inline const float* float_tile(const T* src, float* buffer, int64_t n) {
  to_float(src, buffer, n);
  return buffer;
}
template <>
inline const float* float_tile<float>(const float* src, float*, int64_t) { return src; }

// Scratch of one thread, for items of up to `queries` query rows (padded to kRowStep; padding rows are
// zero queries whose results are never read). Key tiles hold up to tile_keys keys: kTileKeys, or one
// block when a block holds more. kbuf / vbuf: converted tiles of 16-bit pools, one slot per tile key.
struct Scratch {
  int64_t rows, tile_keys;
  std::vector<float> q, qt, acc, m, l, corr, lo, hi, kbuf, vbuf, scores, row;
  std::vector<uint32_t> qt2;              // [D/2][R] bf16 query pairs (score_block_bf16)
  std::vector<TileBlock> blocks;
  std::vector<const float*> key_rows;     // the key tile's [D] rows, key by key across its blocks (score_tile)
  Scratch(int64_t queries, int64_t head_dim, int64_t block_size)
      : rows(pad(queries)), tile_keys(std::max(kTileKeys, block_size)), q(rows * head_dim), qt(head_dim * rows),
        acc(rows * head_dim), m(rows), l(rows), corr(rows), lo(rows), hi(rows), kbuf(tile_keys * head_dim),
        vbuf(tile_keys * head_dim), scores(tile_keys * rows), row(head_dim), qt2(head_dim / 2 * rows),
        blocks(tile_keys / block_size), key_rows(tile_keys) {}
  static int64_t pad(int64_t n) { return (n + kRowStep - 1) / kRowStep * kRowStep; }
};

#if defined(__AVX512F__)
// The 16 lane sums of v[0..15] as one vector (lane i: the sum of v[i]'s lanes): a transposing tree of 45
// unpacks, shuffles and adds, against about 7 operations for each separate horizontal sum.
inline __m512 lane_sums16(const __m512* v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)     // per 128-bit lane: v2i's and v2i+1's elements 0+2 and 1+3, interleaved
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)     // per 128-bit lane: that lane's sums of v4i .. v4i+3
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
  const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
}
#elif defined(__AVX2__) && defined(__FMA__)
// The 8 lane sums of v[0..7] as one vector, the same tree at AVX2's width: 15 unpacks, shuffles, permutes and
// adds against about 6 operations for each separate horizontal sum.
inline __m256 lane_sums8(const __m256* v) {
  __m256 a[4], b[2];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)     // per 128-bit lane: v2i's and v2i+1's elements 0+2 and 1+3, interleaved
    a[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)     // per 128-bit lane: that lane's sums of v4i .. v4i+3
    b[i] = _mm256_add_ps(_mm256_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44), _mm256_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
  return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
}
#endif

// sc[j] = q . k[j] for keys jlo <= j < jhi of a [keys, D] tile: four keys at a time, each with its own
// accumulator, so that the FMAs of one key do not wait on each other (one horizontal sum per key);
// with AVX-512 and head_dim % 16 == 0, sixteen keys at a time and one transposing sum for all of them; with
// AVX2 and head_dim % 8 == 0, eight (the four-key loop's sums wait on each other: 8 dependent FMAs a key at
// head_dim 64, and four chains do not fill two FMA pipes of latency 4).
inline void scores(const float* q, const float* k, int64_t jlo, int64_t jhi, int64_t head_dim, float* sc) {
  int64_t j = jlo;
#if defined(__AVX512F__)
  if (head_dim % 16 == 0) {       // 16 keys at a time, one accumulator each, one transposing sum for all
    for (; j + 16 <= jhi; j += 16) {
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t d = 0; d < head_dim; d += 16) {
        const __m512 qd = _mm512_loadu_ps(q + d);
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(qd, _mm512_loadu_ps(k + (j + i) * head_dim + d), acc[i]);
      }
      _mm512_storeu_ps(sc + j, lane_sums16(acc));
    }
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (head_dim % 8 == 0) {        // 8 keys at a time, one accumulator each, one transposing sum for all
    for (; j + 8 <= jhi; j += 8) {
      __m256 acc[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
      for (int64_t d = 0; d < head_dim; d += 8) {
        const __m256 qd = _mm256_loadu_ps(q + d);
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + (j + i) * head_dim + d), acc[i]);
      }
      _mm256_storeu_ps(sc + j, lane_sums8(acc));
    }
  }
#endif
  for (; j + 4 <= jhi; j += 4) {
    const float *k0 = k + j * head_dim, *k1 = k0 + head_dim, *k2 = k1 + head_dim, *k3 = k2 + head_dim;
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t d = 0; d < head_dim; ++d) {
      s0 += q[d] * k0[d];
      s1 += q[d] * k1[d];
      s2 += q[d] * k2[d];
      s3 += q[d] * k3[d];
    }
    sc[j] = s0, sc[j + 1] = s1, sc[j + 2] = s2, sc[j + 3] = s3;
  }
  for (; j < jhi; ++j) {
    const float* kj = k + j * head_dim;
    float s0 = 0.f;
#pragma omp simd reduction(+ : s0)
    for (int64_t d = 0; d < head_dim; ++d) s0 += q[d] * kj[d];
    sc[j] = s0;
  }
}

#if defined(__AVX512F__)
// accumulate for head_dim = 16 N: the whole row in N registers, each key's weight broadcast once and its row
// read once. Per channel the same operations in the same order as accumulate's loop (acc * corr, then
// + p[j] v[j] in key order).
template <int N>
inline void accumulate_row(float* acc, float corr, const float* p, const float* v, int64_t jlo, int64_t jhi) {
  __m512 a[N];
  const __m512 c = _mm512_set1_ps(corr);
  for (int i = 0; i < N; ++i) a[i] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * i), c);
  for (int64_t j = jlo; j < jhi; ++j) {
    const __m512 pj = _mm512_set1_ps(p[j]);
    const float* vj = v + j * 16 * N;
    for (int i = 0; i < N; ++i) a[i] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vj + 16 * i), a[i]);
  }
  for (int i = 0; i < N; ++i) _mm512_storeu_ps(acc + 16 * i, a[i]);
}
#elif defined(__AVX2__) && defined(__FMA__)
// The same at AVX2's width for N * 8 channels of rows `stride` floats apart: N accumulators in registers, so
// that N chains of FMAs run side by side (the loop below keeps one chain of 8 channels across all keys,
// bound by the add's latency).
template <int N>
inline void accumulate_row(float* acc, float corr, const float* p, const float* v, int64_t jlo, int64_t jhi,
                           int64_t stride) {
  __m256 a[N];
  const __m256 c = _mm256_set1_ps(corr);
#pragma GCC unroll 8
  for (int i = 0; i < N; ++i) a[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * i), c);
  for (int64_t j = jlo; j < jhi; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    const float* vj = v + j * stride;
#pragma GCC unroll 8
    for (int i = 0; i < N; ++i) a[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * i), a[i]);
  }
#pragma GCC unroll 8
  for (int i = 0; i < N; ++i) _mm256_storeu_ps(acc + 8 * i, a[i]);
}
#endif

// acc = acc * corr + sum_j p[j] v[j] over keys jlo <= j < jhi: eight channels at a time, held in one
// register across all keys (stored once per block, not once per key); with AVX-512 the whole row of the
// common head sizes, with AVX2 64 or 32 channels at a time, in registers (accumulate_row).
inline void accumulate(float* acc, float corr, const float* p, const float* v, int64_t jlo, int64_t jhi,
                       int64_t head_dim) {
#if defined(__AVX512F__)
  switch (head_dim) {              // the row in registers, see accumulate_row
    case 64: return accumulate_row<4>(acc, corr, p, v, jlo, jhi);
    case 128: return accumulate_row<8>(acc, corr, p, v, jlo, jhi);
    case 256: return accumulate_row<16>(acc, corr, p, v, jlo, jhi);
    default: break;
  }
#endif
  int64_t d0 = 0;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  for (; d0 + 64 <= head_dim; d0 += 64) accumulate_row<8>(acc + d0, corr, p, v + d0, jlo, jhi, head_dim);
  for (; d0 + 32 <= head_dim; d0 += 32) accumulate_row<4>(acc + d0, corr, p, v + d0, jlo, jhi, head_dim);
#endif
  for (; d0 + 8 <= head_dim; d0 += 8) {
    float a[8];
#pragma omp simd
    for (int e = 0; e < 8; ++e) a[e] = acc[d0 + e] * corr;
    for (int64_t j = jlo; j < jhi; ++j) {
      const float pj = p[j];
      const float* vj = v + j * head_dim + d0;
#pragma omp simd
      for (int e = 0; e < 8; ++e) a[e] += pj * vj[e];
    }
#pragma omp simd
    for (int e = 0; e < 8; ++e) acc[d0 + e] = a[e];
  }
  for (; d0 < head_dim; ++d0) {
    float a = acc[d0] * corr;
    for (int64_t j = jlo; j < jhi; ++j) a += p[j] * v[j * head_dim + d0];
    acc[d0] = a;
  }
}

// Online softmax over scores sc[jlo:jhi] of one query: updates its running max m and sum l, turns the
// scores into weights exp(s - m_new), and returns the factor exp(m_old - m_new) for its accumulator.
inline float softmax_update(float* sc, int64_t jlo, int64_t jhi, float& m, float& l) {
  // four running maxima, not one chain of dependent max instructions (perf put a third of the decode path's
  // samples on that chain); a max is the same in any order
  constexpr float kLow = -std::numeric_limits<float>::infinity();
  float m0 = kLow, m1 = kLow, m2 = kLow, m3 = kLow;
  int64_t i = jlo;
  for (; i + 4 <= jhi; i += 4)
    m0 = std::max(m0, sc[i]), m1 = std::max(m1, sc[i + 1]), m2 = std::max(m2, sc[i + 2]), m3 = std::max(m3, sc[i + 3]);
  for (; i < jhi; ++i) m0 = std::max(m0, sc[i]);
  const float block_max = std::max(std::max(m0, m1), std::max(m2, m3));
  const float new_max = std::max(m, block_max);
  const float corr = exp_nonpositive(m - new_max);        // ~0 on the first block (m = -inf)
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = jlo; j < jhi; ++j) {
    sc[j] = exp_nonpositive(sc[j] - new_max);
    sum += sc[j];
  }
  l = l * corr + sum;
  m = new_max;
  return corr;
}

// Decode path for one block: each of the token's `group` queries against the keys it sees.
inline void single_token(Scratch& s, int64_t pos, int64_t window, int64_t base, int64_t keys, int64_t group,
                         int64_t head_dim, const float* k, const float* v) {
  const int64_t first = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
  const int64_t jlo = std::max<int64_t>(first - base, 0), jhi = std::min(pos + 1 - base, keys);
  if (jlo >= jhi) return;
  for (int64_t g = 0; g < group; ++g) {
    float* sc = s.scores.data();
    scores(s.q.data() + g * head_dim, k, jlo, jhi, head_dim, sc);
    const float corr = softmax_update(sc, jlo, jhi, s.m[g], s.l[g]);
    accumulate(s.acc.data() + g * head_dim, corr, sc, v, jlo, jhi, head_dim);
  }
}

// Whether prefill chunks of `Tiles` score bf16 keys in place by VDPBF16PS (see the top of this file).
template <typename Tiles, typename = void>
struct HasBf16Keys : std::false_type {};
template <typename Tiles>
struct HasBf16Keys<Tiles, std::void_t<decltype(Tiles::kBf16Keys)>> : std::bool_constant<Tiles::kBf16Keys> {};

template <typename Tiles>
inline bool dot_scores(int64_t head_dim) {
#if defined(__AVX512BF16__)
  return HasBf16Keys<Tiles>::value && head_dim % 2 == 0;
#else
  (void)head_dim;
  return false;
#endif
}

// K and V tiles of one block for a work item, converted (16-bit pools) into kbuf / vbuf when not read in
// place: a prefill chunk of a converting source goes through the thread's cache instead (tiles shared by
// the row's chunks); decode items (one token, each block read once) convert into the scratch.
template <typename Tiles>
inline void block_tiles(const Tiles& tiles, TileCache& cache, int64_t h, int64_t block, int64_t num_blocks,
                        int64_t keys, int64_t head_dim, bool chunk, bool own, float* kbuf, float* vbuf,
                        const float*& k, const float*& v) {
  if constexpr (Tiles::kConverts) {
    if (chunk) {
      const int64_t id = ((h * num_blocks + block) * 2 + own) * 2;     // own and coded reads are other tiles
      k = cache.get(id, keys, head_dim,
                    [&](int64_t a, int64_t b, float* dst) { tiles.key_rows(h, block, a, b, dst, own); });
      v = cache.get(id + 1, keys, head_dim,
                    [&](int64_t a, int64_t b, float* dst) { tiles.value_rows(h, block, a, b, dst, own); });
      return;
    }
  }
  (void)cache, (void)chunk, (void)num_blocks;
  k = tiles.keys(h, block, keys, kbuf, own);
  v = tiles.values(h, block, keys, vbuf, own);
}

// The step's geometry and metadata, read once per call. chunk: tokens per prefill work item (kTargetRows
// query rows over the GQA group). own_blocks: a query reads its own block (position / block_size) otherwise
// than the earlier ones (KIVI), so a prefill item never spans two blocks of queries and each key block has
// one reading per item.
struct Geometry {
  int64_t tokens, num_q_heads, head_dim, num_kv_heads, num_blocks, block_size, group, width, rows, chunk;
  const int32_t *tables, *row_of, *pos_of;
  float scale;
  int64_t window;
  bool own_blocks = false;
};

// The block of table index b of `row`, checked against the pool.
inline int64_t table_block(const Geometry& g, int64_t row, int64_t b) {
  const int64_t block = g.tables[row * g.width + b];
  TORCH_CHECK(block >= 0 && block < g.num_blocks, "block-table entry ", block, " (row ", row, ", index ", b,
              ") outside the pool's ", g.num_blocks, " blocks");
  return block;
}

// Chunks of consecutive tokens of one row (at most g.chunk); pad tokens (pos < 0) join none (their output
// is zeroed by the caller). Checks every token's row and block-table width.
inline void make_chunks(const Geometry& g, std::vector<int64_t>& start, std::vector<int64_t>& count) {
  for (int64_t t = 0; t < g.tokens; ++t) {
    const int64_t pos = g.pos_of[t], row = g.row_of[t];
    if (pos < 0) continue;
    TORCH_CHECK(row >= 0 && row < g.rows, "token ", t, " names row ", row, " of ", g.rows, " block-table rows");
    TORCH_CHECK(pos / g.block_size < g.width, "token ", t, " at position ", pos, " needs block ", pos / g.block_size,
                " but its block-table row has ", g.width, " entries");
    const int64_t last = start.empty() ? -1 : start.back() + count.back() - 1;
    const bool same_block = !g.own_blocks || (last >= 0 && g.pos_of[last] / g.block_size == pos / g.block_size);
    if (last == t - 1 && last >= 0 && g.row_of[last] == row && count.back() < g.chunk && same_block) {
      ++count.back();
    } else {
      start.push_back(t);
      count.push_back(1);
    }
  }
}

// The keys [lo, hi) of a key tile (n keys from position base) each query row of the chunk sees, in tile
// coordinates; padding rows see none. Returns whether any row misses some key of the tile (masking needed).
inline bool tile_bounds(Scratch& s, const Geometry& g, int64_t t0, int64_t count, int64_t base, int64_t n,
                        int64_t padded) {
  bool masked = false;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t pos = g.pos_of[t0 + i];
    const int64_t first = g.window > 0 ? std::max<int64_t>(0, pos - g.window + 1) : 0;
    const int64_t lo = std::clamp<int64_t>(first - base, 0, n), hi = std::clamp<int64_t>(pos + 1 - base, 0, n);
    masked = masked || lo > 0 || hi < n;
    std::fill(s.lo.begin() + i * g.group, s.lo.begin() + (i + 1) * g.group, static_cast<float>(lo));
    std::fill(s.hi.begin() + i * g.group, s.hi.begin() + (i + 1) * g.group, static_cast<float>(hi));
  }
  std::fill(s.lo.begin() + count * g.group, s.lo.begin() + padded, 0.f);
  std::fill(s.hi.begin() + count * g.group, s.hi.begin() + padded, 0.f);
  return masked;
}

// Prefill chunk: its queries (already in s.q, scaled) transposed once, then key tiles of whole blocks
// [lo_key / BS, hi_key / BS]: scores of each block in place, one online-softmax step per tile, the values.
template <typename Tiles>
void chunk_item(Scratch& s, TileCache& cache, const Geometry& g, const Tiles& tiles, int64_t h, int64_t t0,
                int64_t count, int64_t lo_key, int64_t hi_key) {
  const int64_t head_dim = g.head_dim, live = count * g.group, rows = s.rows, row = g.row_of[t0];
  const int64_t own = g.own_blocks ? g.pos_of[t0] / g.block_size : -1;     // every query's block (make_chunks)
  const bool dot = dot_scores<Tiles>(head_dim);          // s.q then holds the unscaled bf16 queries' values
  if (dot) {
    for (int64_t p = 0; p < head_dim / 2; ++p) {
      uint32_t* pairs = s.qt2.data() + p * rows;
      for (int64_t r = 0; r < live; ++r)      // the exact bf16 bits: the top halves of the floats
        pairs[r] = bf16_bits(s.q[r * head_dim + 2 * p]) | bf16_bits(s.q[r * head_dim + 2 * p + 1]) << 16;
      std::fill(pairs + live, pairs + rows, 0u);
    }
  } else {
    for (int64_t d = 0; d < head_dim; ++d) {
      float* column = s.qt.data() + d * rows;
      for (int64_t r = 0; r < live; ++r) column[r] = s.q[r * head_dim + d];
      std::fill(column + live, column + rows, 0.f);
    }
  }
  const int64_t vectors = (live + simd::kLanes - 1) / simd::kLanes * simd::kLanes;   // rows the softmax runs
  std::fill(s.m.begin(), s.m.begin() + vectors, -std::numeric_limits<float>::infinity());
  std::fill(s.l.begin(), s.l.begin() + vectors, 0.f);
  const int64_t per_tile = s.tile_keys / g.block_size;
  for (int64_t b0 = lo_key / g.block_size; b0 * g.block_size < hi_key; b0 += per_tile) {
    int64_t n = 0, nb = 0;
    for (int64_t b = b0; b < b0 + per_tile && b * g.block_size < hi_key; ++b, ++nb) {
      const int64_t keys = std::min(g.block_size, hi_key - b * g.block_size);     // keys anyone sees
      const float *k = nullptr, *v;
      const int64_t block = table_block(g, row, b);
      if constexpr (HasBf16Keys<Tiles>::value) {
        if (dot) {                                       // keys scored in place; values as floats
          v = tiles.values(h, block, keys, s.vbuf.data() + n * head_dim, false);
          s.blocks[nb] = TileBlock{nullptr, v, keys, tiles.key_bits(h, block)};
          n += keys;
          continue;
        }
      }
      block_tiles(tiles, cache, h, block, g.num_blocks, keys, head_dim, true, b == own,
                  s.kbuf.data() + n * head_dim, s.vbuf.data() + n * head_dim, k, v);
      s.blocks[nb] = TileBlock{k, v, keys};
      for (int64_t j = 0; j < keys; ++j) s.key_rows[n + j] = k + j * head_dim;
      n += keys;
    }
    const bool masked = tile_bounds(s, g, t0, count, b0 * g.block_size, n, vectors);
    // Row slice by row slice: a slice's scores (n keys x kRowStep rows) go through the softmax while they are
    // still in L1, and its slice of qt serves every block of the tile (the same numbers as scoring the whole
    // tile first: rows are independent).
    const RowState state{s.m.data(), s.l.data(), s.corr.data(), s.lo.data(), s.hi.data()};
    for (int64_t r0 = 0; r0 < vectors; r0 += kRowStep) {
      simd::V scored_max[2] = {simd::set1(-std::numeric_limits<float>::infinity()),
                               simd::set1(-std::numeric_limits<float>::infinity())};
#if defined(__AVX512BF16__)
      if (dot) {
        for (int64_t b = 0, at = 0; b < nb; at += s.blocks[b].keys, ++b)
          score_block_bf16(s.blocks[b].kbits, s.blocks[b].keys, s.qt2.data(), head_dim, rows, r0, g.scale,
                           s.scores.data() + at * rows, scored_max);
      } else
#endif
        score_tile(s.key_rows.data(), n, s.qt.data(), head_dim, rows, r0, s.scores.data(), scored_max);
      softmax_rows(s.scores.data(), n, rows, r0, std::min(r0 + kRowStep, vectors), state, masked, scored_max);
    }
    value_tile(s.acc.data(), s.corr.data(), s.scores.data(), rows, s.blocks.data(), nb, live, head_dim);
  }
}

// Decode item: one token's `group` queries against each block it sees, dot products per key.
template <typename Tiles>
void decode_item(Scratch& s, TileCache& cache, const Geometry& g, const Tiles& tiles, int64_t h, int64_t t0,
                 int64_t lo_key, int64_t hi_key) {
  std::fill(s.m.begin(), s.m.begin() + g.group, -std::numeric_limits<float>::infinity());
  std::fill(s.l.begin(), s.l.begin() + g.group, 0.f);
  const int64_t own = g.own_blocks ? g.pos_of[t0] / g.block_size : -1;
  for (int64_t b = lo_key / g.block_size; b * g.block_size < hi_key; ++b) {
    const int64_t base = b * g.block_size, keys = std::min(g.block_size, hi_key - base);
    const float *k, *v;
    block_tiles(tiles, cache, h, table_block(g, g.row_of[t0], b), g.num_blocks, keys, g.head_dim, false, b == own,
                s.kbuf.data(), s.vbuf.data(), k, v);
    single_token(s, g.pos_of[t0], g.window, base, keys, g.group, g.head_dim, k, v);
  }
}

// One work item: KV head h and the chunk of `count` tokens from t0, over the blocks any of them sees.
template <typename T, typename Tiles>
void attend_item(Scratch& s, TileCache& cache, const Geometry& g, const Tiles& tiles, const T* q_data, T* o_data,
                 int64_t h, int64_t t0, int64_t count) {
  const int64_t head_dim = g.head_dim, group = g.group, queries = count * group;
  int64_t lo_key = std::numeric_limits<int64_t>::max(), hi_key = 0;     // keys any token of the chunk sees
  for (int64_t i = 0; i < count; ++i) {
    const int64_t pos = g.pos_of[t0 + i];
    lo_key = std::min(lo_key, g.window > 0 ? std::max<int64_t>(0, pos - g.window + 1) : 0);
    hi_key = std::max(hi_key, pos + 1);
    to_float(q_data + ((t0 + i) * g.num_q_heads + h * group) * head_dim, s.q.data() + i * group * head_dim,
             group * head_dim);
  }
  const float* rotation = tiles.rotation();
  const bool hadamard = tiles.hadamard();
  if (rotation != nullptr && tiles.rotates_query())
    for (int64_t qi = 0; qi < queries; ++qi)
      rotate_row(s.q.data() + qi * head_dim, rotation, head_dim, false, s.row.data(), hadamard);
  if (count == 1 || !dot_scores<Tiles>(head_dim))       // (VDPBF16PS scores are scaled after their sums)
    for (int64_t i = 0; i < queries * head_dim; ++i) s.q[i] *= g.scale;
  std::fill(s.acc.begin(), s.acc.begin() + queries * head_dim, 0.f);
  if (count == 1) {
    decode_item(s, cache, g, tiles, h, t0, lo_key, hi_key);
  } else {
    chunk_item(s, cache, g, tiles, h, t0, count, lo_key, hi_key);
  }
  for (int64_t qi = 0; qi < queries; ++qi) {
    float* acc = s.acc.data() + qi * head_dim;
    const float inv = s.l[qi] > 0.f ? 1.f / s.l[qi] : 0.f;
    for (int64_t d = 0; d < head_dim; ++d) acc[d] *= inv;
    if (rotation != nullptr) rotate_row(acc, rotation, head_dim, true, s.row.data(), hadamard);
    const int64_t i = qi / group, q = qi % group;
    from_float(acc, o_data + ((t0 + i) * g.num_q_heads + h * group + q) * head_dim, head_dim);
  }
}

// out [T, Hq, D] (query's dtype T) for every token of `g`, K/V tiles from `tiles`.
template <typename T, typename Tiles>
void attend(const Geometry& g, const Tiles& tiles, const T* q_data, T* o_data) {
  for (int64_t t = 0; t < g.tokens; ++t) {
    if (g.pos_of[t] < 0)
      std::fill(o_data + t * g.num_q_heads * g.head_dim, o_data + (t + 1) * g.num_q_heads * g.head_dim,
                static_cast<T>(0.f));
  }
  std::vector<int64_t> chunk_start, chunk_count;
  make_chunks(g, chunk_start, chunk_count);
  const int64_t num_chunks = static_cast<int64_t>(chunk_start.size()), items = g.num_kv_heads * num_chunks;
  // Work item = (KV head, chunk), head-major; worker w takes items w, w + workers, ...: a causal row's
  // chunks grow in cost, so striding balances the threads where contiguous ranges would not, and one
  // worker's items of a head still share its cached K/V tiles (quantised pools).
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), items);
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    Scratch s(g.chunk * g.group, g.head_dim, g.block_size);
    TileCache cache(g.block_size * g.head_dim);
    for (int64_t w = begin; w < end; ++w) {
      for (int64_t item = w; item < items; item += workers) {
        const int64_t h = item / num_chunks, c = item % num_chunks;
        cache.trim();
        attend_item(s, cache, g, tiles, q_data, o_data, h, chunk_start[c], chunk_count[c]);
      }
    }
  });
}

// A decode step of bf16 pools through VDPBF16PS (paged_attention_cpu_bf16.cpp), into o_data; false (nothing done)
// where it does not apply: a build without AVX-512 BF16, D not a multiple of 32, a row with several tokens.
bool attend_decode_bf16(const Geometry& g, const c10::BFloat16* k_pool, const c10::BFloat16* v_pool,
                        const c10::BFloat16* q_data, c10::BFloat16* o_data);

// The geometry of a call: query [T, Hq, D], pools of `num_blocks` blocks of `block_size` per KV head.
inline Geometry geometry(const at::Tensor& query, int64_t num_kv_heads, int64_t num_blocks, int64_t block_size,
                         const at::Tensor& block_tables, const at::Tensor& token_row, const at::Tensor& token_pos,
                         double scale, int64_t window) {
  Geometry g;
  g.tokens = query.size(0), g.num_q_heads = query.size(1), g.head_dim = query.size(2);
  g.num_kv_heads = num_kv_heads, g.num_blocks = num_blocks, g.block_size = block_size;
  g.group = g.num_q_heads / num_kv_heads, g.width = block_tables.size(1), g.rows = block_tables.size(0);
  g.tables = block_tables.data_ptr<int32_t>();
  g.row_of = token_row.data_ptr<int32_t>();
  g.pos_of = token_pos.data_ptr<int32_t>();
  g.scale = static_cast<float>(scale), g.window = window;
  g.chunk = std::max<int64_t>(1, kTargetRows / g.group);
  return g;
}

// Checks shared by both ops: devices, query shape and GQA, metadata tensors.
inline void check_step(const at::Tensor& query, int64_t num_kv_heads, int64_t head_dim, const at::Tensor& block_tables,
                       const at::Tensor& token_row, const at::Tensor& token_pos) {
  TORCH_CHECK(query.device().is_cpu() && query.dim() == 3 && query.is_contiguous(),
              "query must be a contiguous [T, Hq, D] CPU tensor, got ", query.sizes());
  TORCH_CHECK(query.size(2) == head_dim, "query head_dim ", query.size(2), " != pools' ", head_dim);
  TORCH_CHECK(num_kv_heads > 0 && query.size(1) % num_kv_heads == 0 && query.size(1) / num_kv_heads <= kMaxGroup,
              "query heads (", query.size(1), ") must be a multiple of KV heads (", num_kv_heads,
              ") with at most ", kMaxGroup, " per KV head");
  for (const at::Tensor* t : {&block_tables, &token_row, &token_pos}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() && t->device().is_cpu(),
                "block_tables, token_row and token_pos must be contiguous int32 CPU tensors");
  }
  TORCH_CHECK(block_tables.dim() == 2 && token_row.numel() == query.size(0) && token_pos.numel() == query.size(0),
              "block_tables must be [rows, W] and token_row/token_pos have one entry per query token");
}

}  // namespace hfp_cpu
