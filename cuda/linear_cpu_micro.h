// The float32 linear kernel's vector layer and micro-kernel (linear_cpu.cpp): kept free of torch so that
// tests/engine/linear_micro_check.cpp can build it for every ISA, aarch64 included (run under qemu-user), and
// check each build's sums bit for bit against the sequential std::fma the kernel promises.
//
// The vector type V of kLanes floats and kRows x kVecs accumulators per micro-kernel call, chosen at build time:
// AVX-512F, AVX2 + FMA, NEON (aarch64), else a plain 8-float struct with std::fma (fast only where the compiler
// makes std::fma one instruction: FP_FAST_FMAF; linear_cpu.cpp's linear_hardware_fma says so).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <utility>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#endif

namespace hfp_linear {

constexpr int64_t kPanel = 32;          // output columns per packed panel (the layout; every ISA reads it)
// Prefetch distances, in floats of the weight stream. Measured 2026-12-05 on a 2-core AVX-512 Xeon, SmolLM2's
// shapes, each variant reading the same packed weights in turn (allocation order alone moved a step by up to
// 20%), median of 7 rounds, time per step against the previous single L1 prefetch 2048 ahead: 0.89x at 8 rows,
// 0.90x at 14, 0.86x at 24, 0.80x at 32, 0.81x at 64, 0.78x at 96, 0.93x at 128, 0.99x at 512, 1.0x at 1 row
// (already at the memory floor). Into L2 rather than L1 gave the first ~10%, the next panel's stream the rest.
constexpr int64_t kAheadL2 = 4096;      // into L2 (16 KiB ahead): L1's fill buffers stay free for loads
constexpr int64_t kAheadL1 = 2048;      // into L1 (8 KiB ahead), from a panel that sits in L2

// How a micro-kernel call prefetches, by the number of row blocks (passes) that read one panel:
//   kSingle: one pass; the panel itself streams from memory into L2 (decode steps up to kRows rows).
//   kShared: 2..kMaxStreamedPasses passes; the first pass streams its own panel into L2 (a thread's first
//     panel), every pass streams its share of the *next* panel into L2, so memory works while the later
//     passes compute from cache (without it, a step of 32 rows took the stream's time plus the FMAs' time).
//   kCompute: more passes (prefill chunks): compute-bound; the panel is prefetched from L2 into L1.
enum class Stream { kSingle, kShared, kCompute };

#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kRows = 14;               // 14 rows x 2 vectors = 28 of 32 zmm accumulators
constexpr int kVecs = 2;                // vectors per row of a micro-kernel: kVecs * kLanes columns
constexpr int kComputeRows = kRows;     // the tile of compute-bound calls (Stream::kCompute)
constexpr int kComputeVecs = kVecs;
constexpr int kMaxStreamedPasses = 16;  // up to this many row blocks, the next panel streams during them
using V = __m512;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V a) { _mm512_storeu_ps(p, a); }
inline V vset1(float a) { return _mm512_set1_ps(a); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
#elif defined(__AVX2__) && defined(__FMA__)
// 3 rows x 4 vectors (the whole 32-column panel) = 12 of 16 ymm accumulators, three weight vectors in registers
// and the fourth folded into the FMAs' memory operand (keep_in_registers below). Against 6 rows x 2 vectors over
// two 16-column slices (each pass reading half of every 128-byte panel row), on Zen 4 with an -march=x86-64-v3
// build, SmolLM2's shapes, one process:
// 1.18x -> 1.05x the AVX-512 build's time at 14 rows, 1.07x -> 1.03x at 32, equal at 1-8 and 128-512 rows.
// Calls of 16 rows or more (more than kMaxStreamedPasses row blocks) take 6 rows x 2 vectors instead: each
// weight vector then serves 6 rows, not 3, which halves what the FMAs ask of L2. On a Zen 3 (AVX2 only, 512 KiB
// L2), 2 threads, SmolLM2's 30 layers, 2026-12-07: 1.5x (128 rows) and 1.3x (512) the speed of the 3 x 4 tile
// (a standalone copy of both); with the accumulator fix below, the kernel's speed went from 0.66-0.73x oneDNN's
// to 1.06-1.14x at 128-512 rows (325 -> 190 ms a step at 128 rows, 1142 -> 659 at 512; python -m bench linear).
constexpr int kLanes = 8;
constexpr int kRows = 3;
constexpr int kVecs = 4;
constexpr int kComputeRows = 6;
constexpr int kComputeVecs = 2;
constexpr int kMaxStreamedPasses = 5;   // 16+ rows: the compute tile (1.6x, 1.9x at 20, 48 rows; equal at 32; not at 14)
using V = __m256;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V a) { _mm256_storeu_ps(p, a); }
inline V vset1(float a) { return _mm256_set1_ps(a); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
#elif defined(__aarch64__) && defined(__ARM_NEON)
// 5 rows x 4 vectors of 4 (16 columns, two slices per panel) = 20 of 32 NEON registers, 4 for the weights, the
// x values multiplied by element (FMLA v.4s, v.s[0]). vfmaq_f32 rounds once, as std::fma: every build's bits.
// Not timed on an ARM CPU (none here); chosen from GCC 12's code: at 6 rows it reloads sums from the stack
// inside the k loop, at 4-5 it does not (it still stores the sums there each k, stores it never reads back).
constexpr int kLanes = 4;
constexpr int kRows = 5;
constexpr int kVecs = 4;
constexpr int kComputeRows = kRows;
constexpr int kComputeVecs = kVecs;
constexpr int kMaxStreamedPasses = 16;
using V = float32x4_t;
inline V vzero() { return vdupq_n_f32(0.f); }
inline V vload(const float* p) { return vld1q_f32(p); }
inline void vstore(float* p, V a) { vst1q_f32(p, a); }
inline V vset1(float a) { return vdupq_n_f32(a); }
inline V vfma(V a, V b, V c) { return vfmaq_f32(c, a, b); }
#else
constexpr int kLanes = 8;
constexpr int kRows = 4;
constexpr int kVecs = 2;
constexpr int kComputeRows = kRows;
constexpr int kComputeVecs = kVecs;
constexpr int kMaxStreamedPasses = 16;
struct V {
  float x[kLanes];
};
inline V vzero() { return V{}; }
inline V vload(const float* p) { V v; std::copy(p, p + kLanes, v.x); return v; }
inline void vstore(float* p, V a) { std::copy(a.x, a.x + kLanes, p); }
inline V vset1(float a) { V v; std::fill(v.x, v.x + kLanes, a); return v; }
inline V vfma(V a, V b, V c) {
  V v;
  for (int i = 0; i < kLanes; ++i) v.x[i] = std::fma(a.x[i], b.x[i], c.x[i]);
  return v;
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
inline void prefetch_l1(const float* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }
inline void prefetch_l2(const float* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1); }
#else
inline void prefetch_l1(const float* p) { __builtin_prefetch(p, 0, 3); }
inline void prefetch_l2(const float* p) { __builtin_prefetch(p, 0, 2); }
#endif

constexpr int kSlices = kPanel / (kVecs * kLanes);  // column slices of a panel (2 with NEON and scalar, else 1)
constexpr int kComputeSlices = kPanel / (kComputeVecs * kLanes);  // the same for the compute tile

// One weight step's prefetches (128 bytes at wk, float32's k or bf16's pair of k): its own panel ahead into L2
// (kSingle, and kShared's first pass) or from L2 into L1 (the other passes), and kShared's due share of the next
// panel's 64-byte lines (`due`: next_lines * step, less `steps` for every line prefetched so far).
template <Stream kMode>
inline void prefetch_step(const float* wk, bool own, const float*& next, int64_t next_lines, int64_t steps,
                          int64_t& due) {
  if (kMode == Stream::kSingle || (kMode == Stream::kShared && own)) {
    prefetch_l2(wk + kAheadL2);
    prefetch_l2(wk + kAheadL2 + 16);
  } else {
    prefetch_l1(wk + kAheadL1);
    prefetch_l1(wk + kAheadL1 + 16);
  }
  if (kMode == Stream::kShared)
    for (due += next_lines; due >= steps; due -= steps, next += 16) prefetch_l2(next);
}

// Keeps a tile's weight vectors in registers, as many as the 16 ymm registers hold beside the ROWS x VECS sums
// and the broadcast x (AVX2 only; a no-op elsewhere). Without it GCC 12 folded every weight load into the FMAs'
// memory operand: the 3 x 4 tile then loads 12 weight vectors and 3 broadcasts per 12 FMAs, which bound it by
// loads at half the FMA rate on a Zen 3 (~95 GFLOPS on 2 threads at 9-15 rows with its weights in L2, 109-123 with
// three weight vectors in registers and the fourth folded). Streaming SmolLM2's 30 layers from memory, 8
// interleaved pairs: fastest run 0.85x the time at 12-15 rows, medians 0.94-1.02x (that VM's memory contention
// moved single runs by 30%); standalone copy of the kernel, 2026-12-07. In the engine (the short workload, 8
// runs alternating with the build before, in both orders) no difference beyond that noise: its decode steps
// wait on the weight stream. An empty asm changes no value.
template <int ROWS, int VECS>
inline void keep_in_registers(V& w0, V& w1, V& w2, V& w3) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  constexpr int kFree = 16 - ROWS * VECS - 1;         // ymm registers left beside the sums and the broadcast x
  if (kFree >= 1) asm("" : "+x"(w0));
  if (VECS > 1 && kFree >= 2) asm("" : "+x"(w1));
  if (VECS > 2 && kFree >= 3) asm("" : "+x"(w2));
  if (VECS > 3 && kFree >= 4) asm("" : "+x"(w3));
#else
  (void)w0, (void)w1, (void)w2, (void)w3;
#endif
}

// rows x (VECS * kLanes) outputs of one column slice of a panel: x rows [ROWS][ldx], panel slice w (k-th row at
// w + k * kPanel), results to out (row stride ldo; `width` of the slice's columns are kept), plus bias when given.
// `next`/`next_lines` (kShared only): the 64-byte lines of the next panel this pass prefetches, spread evenly
// over its K steps; `own` (kShared): whether this pass also prefetches its own panel (the first pass does).
// The accumulators are one array per vector, indexed only in fully unrolled loops: with one [ROWS][VECS] array
// GCC 12 kept the AVX2 tile in registers but stored all twelve to the stack on every k (half the FMA rate).
template <int ROWS, int VECS, Stream kMode>
void micro(const float* x, int64_t ldx, int64_t K, const float* w, float* out, int64_t ldo, int64_t width,
           const float* bias, const float* next, int64_t next_lines, bool own) {
  static_assert(VECS >= 1 && VECS <= 4, "a tile row is 1 to 4 vectors");
  int64_t due = 0;  // kShared: next_lines * k, less K for every line prefetched so far
  V a0[ROWS], a1[ROWS], a2[ROWS], a3[ROWS];
#pragma GCC unroll 16
  for (int r = 0; r < ROWS; ++r) a0[r] = a1[r] = a2[r] = a3[r] = vzero();
  const float* wk = w;
  const float* xk = x;
  for (int64_t k = 0; k < K; ++k, wk += kPanel, ++xk) {
    prefetch_step<kMode>(wk, own, next, next_lines, K, due);
    V w0 = vload(wk);
    V w1 = VECS > 1 ? vload(wk + kLanes) : w0;
    V w2 = VECS > 2 ? vload(wk + 2 * kLanes) : w0;
    V w3 = VECS > 3 ? vload(wk + 3 * kLanes) : w0;
    keep_in_registers<ROWS, VECS>(w0, w1, w2, w3);
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r) {
      const V xv = vset1(xk[r * ldx]);
      a0[r] = vfma(xv, w0, a0[r]);
      if (VECS > 1) a1[r] = vfma(xv, w1, a1[r]);
      if (VECS > 2) a2[r] = vfma(xv, w2, a2[r]);
      if (VECS > 3) a3[r] = vfma(xv, w3, a3[r]);
    }
  }
  float tile[VECS * kLanes];
#pragma GCC unroll 16
  for (int r = 0; r < ROWS; ++r) {
    vstore(tile, a0[r]);
    if (VECS > 1) vstore(tile + kLanes, a1[r]);
    if (VECS > 2) vstore(tile + 2 * kLanes, a2[r]);
    if (VECS > 3) vstore(tile + 3 * kLanes, a3[r]);
    float* o = out + r * ldo;
    for (int64_t c = 0; c < width; ++c) o[c] = bias ? tile[c] + bias[c] : tile[c];
  }
}

using Micro = void (*)(const float*, int64_t, int64_t, const float*, float*, int64_t, int64_t, const float*,
                       const float*, int64_t, bool);

template <int VECS, Stream kMode, int... R>
constexpr auto micro_table(std::integer_sequence<int, R...>) {
  return std::array<Micro, sizeof...(R)>{&micro<R + 1, VECS, kMode>...};
}
const auto kMicroSingle = micro_table<kVecs, Stream::kSingle>(std::make_integer_sequence<int, kRows>{});
const auto kMicroShared = micro_table<kVecs, Stream::kShared>(std::make_integer_sequence<int, kRows>{});
const auto kMicroCompute = micro_table<kComputeVecs, Stream::kCompute>(std::make_integer_sequence<int, kComputeRows>{});

}  // namespace hfp_linear
