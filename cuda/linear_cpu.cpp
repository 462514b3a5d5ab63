// The engine's float32 linear layers on the CPU: torch.ops.hf_paged_fused.pack_linear / .linear
//
//   pack_linear(weight [N, K] float32) -> packed [P, K, 32], P = ceil(N / 32), columns past N zero
//   linear(x [T, K] float32, packed [P, K, 32], bias [N] float32 or None, N) -> [T, N] = x @ weight.T + bias
//
// Why not oneDNN: at the engine's decode steps (T = a few to a few dozen rows) a forward streams every
// weight from memory once per step, and oneDNN's fp32 matmul overlapped that stream with its arithmetic
// poorly on the 2-core Xeon this was measured on (SmolLM2-135M's 30 layers + LM head, 2 threads: 37-54 ms
// per step at 14-32 rows against 27-44 ms here; about equal at 512 rows; bench/linear_cpu.py).
// (The vector layer and float32 micro-kernel, per ISA, are in linear_cpu_micro.h, free of torch for the ISA checks.)
// Here a work item is one panel of 32 output columns and a block of up to kRows rows, with rows x 32
// accumulators in registers; a panel's weights ([K][32], contiguous, 128 bytes a k) are read once per row block.
// How the weight stream is prefetched depends on how many row blocks share a panel (Stream below): the point
// is to keep memory busy while the FMA units are, since a decode step is a race between the two.
//
// Summation order (the invariant the tests pin): every output is
//   acc = 0; for k in 0..K-1: acc = fma(x[t, k], w[n, k], acc); out = acc + bias[n]
// whatever the ISA (AVX-512, AVX2 + FMA, NEON, scalar std::fma), the thread count and the other rows of the call.
// So a row's result does not depend on the batch it came in (batch invariance), unlike a library matmul
// that picks its kernel by shape.
//
// bfloat16 (built where the compiler targets AVX-512 BF16; linear_bf16_available() says so): the same panels and
// streaming over pairs of k, packed [P, ceil(K / 2), 32, 2] (a zero pair element past K), 128 bytes per step as
// float32's k; every output is acc = 0; for each pair j in order: acc = VDPBF16PS(acc, x[t, 2j:2j+2],
// w[n, 2j:2j+2]); out = bf16(acc + bias[n]) rounded as c10::BFloat16 rounds (nearest even; NaN 0x7FC0; 16 at a
// time by VCVTNEPS2BF16 where no lane is NaN or denormal: 1.03-1.06x at 24-64 rows on Zen 4). The instruction's own
// rounding of the pair's sum (and its flushing of denormals) is the CPU's, so bf16 results are pinned per CPU
// (batch invariance, equality to each row alone) and against float32 sums within bf16 tolerance. Measured on
// an AMD EPYC Zen 4 (AVX-512 BF16, no AMX), where oneDNN's bf16 matmul read weights at 13-17 GB/s at 1-14
// rows against 31 GB/s that memory gives: see prepack.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/bit_cast.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>

#include "linear_cpu_micro.h"

namespace {

using namespace hfp_linear;

#if defined(__AVX512BF16__)
// The bf16 micro-kernel: as micro, over pairs of k (`steps` = ceil(K / 2); x's last pair padded with zero when
// K is odd), weights w [steps][32 columns][2], results rounded to bf16. Offsets in bf16 elements: 2 per float.
template <int ROWS, Stream kMode>
void micro_bf16(const uint16_t* x, int64_t ldx, int64_t K, const uint16_t* w, uint16_t* out, int64_t ldo,
                int64_t width, const uint16_t* bias, const uint16_t* next, int64_t next_lines, bool own) {
  const int64_t steps = (K + 1) / 2, full = K / 2;
  int64_t due = 0;
  const float* next_line = reinterpret_cast<const float*>(next);
  __m512 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  auto step = [&](int64_t j, bool tail) {
    const uint16_t* wj = w + j * 2 * kPanel;
    prefetch_step<kMode>(reinterpret_cast<const float*>(wj), own, next_line, next_lines, steps, due);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wj), w1 = (__m512bh)_mm512_loadu_si512(wj + 32);
    for (int r = 0; r < ROWS; ++r) {
      const uint16_t* xr = x + r * ldx + 2 * j;
      int32_t pair;
      if (tail) pair = xr[0];
      else std::memcpy(&pair, xr, 4);                 // one broadcast load: no scalar work per row
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);
    }
  };
  for (int64_t j = 0; j < full; ++j) step(j, false);
  if (full < steps) step(full, true);
  // Epilogue: bias in float32, rounded to bf16 16 lanes at a time by VCVTNEPS2BF16 (nearest even, as torch
  // rounds); a vector holding a NaN or a denormal (which the instruction quiets / flushes, torch does not)
  // takes torch's scalar rounding instead.
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  const __mmask16 m0 = width >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << width) - 1);
  const __mmask16 m1 = width >= 32 ? __mmask16(0xFFFF) : width <= 16 ? __mmask16(0) : __mmask16((1u << (width - 16)) - 1);
  if (bias) {
    b0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m0, bias)), 16));
    b1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m1, bias + 16)), 16));
  }
  for (int r = 0; r < ROWS; ++r) {
    const __m512 v0 = bias ? _mm512_add_ps(acc[r][0], b0) : acc[r][0];   // no + 0: a -0 sum stays -0
    const __m512 v1 = bias ? _mm512_add_ps(acc[r][1], b1) : acc[r][1];
    uint16_t* o = out + r * ldo;
    const int odd = 0x01 | 0x80 | 0x20;               // QNaN, SNaN, denormal
    if ((_mm512_fpclass_ps_mask(v0, odd) | _mm512_fpclass_ps_mask(v1, odd)) == 0) {
      _mm256_mask_storeu_epi16(o, m0, (__m256i)_mm512_cvtneps_pbh(v0));
      if (m1) _mm256_mask_storeu_epi16(o + 16, m1, (__m256i)_mm512_cvtneps_pbh(v1));
    } else {
      float tile[32];
      _mm512_storeu_ps(tile, v0);
      _mm512_storeu_ps(tile + 16, v1);
      for (int64_t c = 0; c < width; ++c) o[c] = c10::bit_cast<uint16_t>(c10::BFloat16(tile[c]));
    }
  }
}

using MicroBf16 = void (*)(const uint16_t*, int64_t, int64_t, const uint16_t*, uint16_t*, int64_t, int64_t,
                           const uint16_t*, const uint16_t*, int64_t, bool);
template <Stream kMode, int... R>
constexpr auto micro_bf16_table(std::integer_sequence<int, R...>) {
  return std::array<MicroBf16, sizeof...(R)>{&micro_bf16<R + 1, kMode>...};
}
const auto kBf16Single = micro_bf16_table<Stream::kSingle>(std::make_integer_sequence<int, kRows>{});
const auto kBf16Shared = micro_bf16_table<Stream::kShared>(std::make_integer_sequence<int, kRows>{});
const auto kBf16Compute = micro_bf16_table<Stream::kCompute>(std::make_integer_sequence<int, kRows>{});
constexpr bool kHasBf16 = true;
#else
constexpr bool kHasBf16 = false;
#endif

// Work items over (column unit, row block) for `rows` rows and `steps` weight steps of 128 bytes per panel; calls
// run(mode, unit, first row, row count, next-panel line offset, lines, first pass) for each (see linear). A unit
// is a panel, except in compute-bound calls that take a narrower tile (compute_slices units per panel, each a
// column slice, with row blocks of up to compute_rows).
template <typename Run>
void for_each_item(int64_t rows, int64_t steps, int64_t panels, int64_t compute_rows, int64_t compute_slices,
                   const Run& run) {
  // Row blocks of equal size (32 rows: 11 + 11 + 10, not 14 + 14 + 4); a row's outputs do not depend on its block.
  int64_t row_blocks = (rows + kRows - 1) / kRows;
  const Stream mode = row_blocks == 1 ? Stream::kSingle
                      : row_blocks <= kMaxStreamedPasses ? Stream::kShared : Stream::kCompute;
  int64_t units = panels;
  if (mode == Stream::kCompute) {
    row_blocks = (rows + compute_rows - 1) / compute_rows;
    units = panels * compute_slices;
  }
  const int64_t block_rows = (rows + row_blocks - 1) / row_blocks, panel_lines = steps * 2;
  const int64_t share = (panel_lines + row_blocks - 1) / row_blocks;  // kShared: next-panel lines per pass
  // Items unit-major: a thread's consecutive items reuse one panel's (or slice's) weights from its cache while
  // the rows of x (read in place) pass by. (Copying row chunks of x k-major and looping panels inside them
  // measured slower here, 1.0-1.3x the time at 64-512 rows.)
  at::parallel_for(0, units * row_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t u = item / row_blocks, block = item % row_blocks, r0 = block * block_rows;
      const int64_t count = std::min<int64_t>(block_rows, rows - r0);
      // kShared: this pass's share of the next panel's lines
      const int64_t first = std::min(block * share, panel_lines);
      const int64_t lines = mode == Stream::kShared && u + 1 < panels ? std::min(share, panel_lines - first) : 0;
      run(mode, u, r0, count, (u + 1) * panel_lines + first, lines, block == 0);
    }
  });
}

// float32, or bfloat16 where this build has the bf16 kernel.
void check_matrix(const at::Tensor& t, const char* name) {
  const bool ok = t.scalar_type() == at::kFloat || (kHasBf16 && t.scalar_type() == at::kBFloat16);
  TORCH_CHECK(t.device().is_cpu() && ok, "hf_paged_fused linear: ", name, " must be a float32",
              kHasBf16 ? " or bfloat16" : "", " CPU tensor, got ", t.scalar_type(), " on ", t.device(),
              kHasBf16 ? "" : " (bfloat16 needs a build for a CPU with AVX-512 BF16)");
}

bool linear_bf16_available() { return kHasBf16; }

// Whether the float32 sums are hardware fused multiply-adds: SIMD FMA, or a std::fma the compiler makes one
// instruction (FP_FAST_FMAF: aarch64, POWER, ...). Without (a plain x86-64 build), std::fma is a libm routine
// emulating the single rounding, ~70x slower end to end (measured: the engine at 2.9 tokens/s against 200), and
// the engine leaves float32 linears to oneDNN (prepack.kernel_takes).
bool linear_hardware_fma() {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__)) || defined(FP_FAST_FMAF)
  return true;
#else
  return false;
#endif
}

// float32 [P, K, 32]; bfloat16 [P, ceil(K / 2), 64] (each step: 32 columns x a pair of k).
at::Tensor pack_linear(const at::Tensor& weight) {
  check_matrix(weight, "weight");
  TORCH_CHECK(weight.dim() == 2, "pack_linear: weight must be [N, K], got ", weight.sizes());
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kPanel - 1) / kPanel;
  const at::Tensor w = weight.contiguous();
  if (weight.scalar_type() == at::kBFloat16) {
    const int64_t steps = (k + 1) / 2;
    at::Tensor packed = at::zeros({panels, steps, 2 * kPanel}, weight.options());
    const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
    uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p)
        for (int64_t c = 0; c < kPanel && p * kPanel + c < n; ++c)
          for (int64_t j = 0; j < k; ++j) dst[((p * steps + j / 2) * kPanel + c) * 2 + j % 2] = src[(p * kPanel + c) * k + j];
    });
    return packed;
  }
  at::Tensor packed = at::zeros({panels, k, kPanel}, weight.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t c = 0; c < kPanel && p * kPanel + c < n; ++c)
        for (int64_t j = 0; j < k; ++j) dst[(p * k + j) * kPanel + c] = src[(p * kPanel + c) * k + j];
  });
  return packed;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias, int64_t n) {
  check_matrix(x, "x");
  check_matrix(packed, "packed");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "linear: x must be [T, K] with contiguous rows, got ", x.sizes(),
              " strides ", x.strides());
  const int64_t rows = x.size(0), k = x.size(1), panels = packed.size(0), steps = bf16 ? (k + 1) / 2 : k;
  const int64_t width = bf16 ? 2 * kPanel : kPanel;
  TORCH_CHECK(packed.scalar_type() == x.scalar_type() && packed.dim() == 3 && packed.size(1) == steps &&
                  packed.size(2) == width && packed.is_contiguous() && n > 0 && (n + kPanel - 1) / kPanel == panels,
              "linear: packed must be pack_linear's ", x.scalar_type(), " [", (n + kPanel - 1) / kPanel, ", ", steps,
              ", ", width, "] for N=", n, ", got ", packed.scalar_type(), " ", packed.sizes());
  const void* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->device().is_cpu() && bias->dim() == 1 &&
                    bias->size(0) == n && bias->is_contiguous(),
                "linear: bias must be a contiguous ", x.scalar_type(), " [", n, "], got ", bias->scalar_type(), " ",
                bias->sizes());
    bias_ptr = bias->data_ptr();
  }
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;
  const int64_t ldx = x.stride(0);
#if defined(__AVX512BF16__)
  if (bf16) {
    const uint16_t* xd = reinterpret_cast<const uint16_t*>(x.data_ptr());
    const uint16_t* wd = reinterpret_cast<const uint16_t*>(packed.data_ptr());
    const uint16_t* bd = static_cast<const uint16_t*>(bias_ptr);
    uint16_t* od = reinterpret_cast<uint16_t*>(out.data_ptr());
    for_each_item(rows, steps, panels, kRows, 1, [&](Stream mode, int64_t p, int64_t r0, int64_t count,
                                                     int64_t next_line, int64_t lines, bool own) {
      const auto& micros = mode == Stream::kSingle ? kBf16Single : mode == Stream::kShared ? kBf16Shared : kBf16Compute;
      const int64_t col = p * kPanel;
      micros[count - 1](xd + r0 * ldx, ldx, k, wd + p * steps * width, od + r0 * n + col, n,
                        std::min<int64_t>(kPanel, n - col), bd ? bd + col : nullptr,
                        lines ? wd + next_line * 32 : nullptr, lines, own);
    });
    return out;
  }
#endif
  const float* xd = x.data_ptr<float>();
  const float* wd = packed.data_ptr<float>();
  const float* bd = static_cast<const float*>(bias_ptr);
  float* od = out.data_ptr<float>();
  for_each_item(rows, k, panels, kComputeRows, kComputeSlices, [&](Stream mode, int64_t u, int64_t r0, int64_t count,
                                                                   int64_t next_line, int64_t lines, bool own) {
    if (mode == Stream::kCompute) {       // u: one column slice of the compute tile's width
      const int64_t slice = kComputeVecs * kLanes, p = u / kComputeSlices, s = u % kComputeSlices;
      const int64_t col = p * kPanel + s * slice, width = std::min<int64_t>(slice, n - col);
      if (width > 0)
        kMicroCompute[count - 1](xd + r0 * ldx, ldx, k, wd + p * k * kPanel + s * slice, od + r0 * n + col, n,
                                 width, bd ? bd + col : nullptr, nullptr, 0, own);
      return;
    }
    const auto& micros = mode == Stream::kSingle ? kMicroSingle : kMicroShared;
    const int64_t slice = kVecs * kLanes;
    lines /= kSlices;                     // split between the panel's column slices
    for (int64_t s = 0; s < kSlices; ++s) {
      const int64_t col = u * kPanel + s * slice, width = std::min<int64_t>(slice, n - col);
      if (width <= 0) break;
      micros[count - 1](xd + r0 * ldx, ldx, k, wd + u * k * kPanel + s * slice, od + r0 * n + col, n, width,
                        bd ? bd + col : nullptr, lines ? wd + (next_line + s * lines) * 16 : nullptr, lines, own);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_paged_fused, m) {
  m.def("pack_linear(Tensor weight) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.def("linear_bf16_available() -> bool", &linear_bf16_available);   // no tensor to dispatch on: catch-all
  m.def("linear_hardware_fma() -> bool", &linear_hardware_fma);
}

TORCH_LIBRARY_IMPL(hf_paged_fused, CPU, m) {
  m.impl("pack_linear", &pack_linear);
  m.impl("linear", &linear);
}
