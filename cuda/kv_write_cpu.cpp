// The quantising KV write on the CPU: torch.ops.hf_paged_cpu.write_kv_quant.
//
//   key, value      [N, Hkv, D]  f32 / bf16 / f16, any strides (the layer's states, unrotated)
//   slot_mapping    int64 [N]    slot s = token s % BS of block s // BS; -1 = skip
//   k_codes/v_codes, k_scales/v_scales: a QuantizedPool's tensors (hf_paged/kv_formats.py's layout), written
//   rotation        fp32 [D, D] or None: each row is stored as x R (kv_formats.rotation_matrix)
// Each (token, head) row is converted to fp32, rotated (the fast Walsh-Hadamard transform when R is the
// normalised Hadamard matrix, else y_j = sum_i x_i R_ij in i order; fp32), and encoded
// by its format's function (kv_encode_cpu.h; kv_formats.quantize's codes bit for bit on the same rotated row;
// the rotation's summation order differs from torch's matmul in the last bits, so a code at a rounding
// boundary may differ by one step from the PyTorch path's). Replaces, per layer, the PyTorch path's ~10
// small ops per pool (rotate, amax, divide, clamp, round, cast, two index_copy_).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "kv_encode_cpu.h"
#include "paged_attention_cpu_simd.h"

namespace {

struct Pool {
  uint8_t* codes;
  uint16_t* scales;
  int64_t code_row, num_scales, heads, slots;
  hfp_codec::EncodeFn encode;
};

Pool pool_of(const char* which, const at::Tensor& codes, const at::Tensor& scales, int64_t format, int64_t head_dim) {
  const hfp_codec::EncodeFn encode = (format >= 0 && format < hfp_codec::kNumFormats) ? hfp_codec::encode_function(format) : nullptr;
  TORCH_CHECK(encode != nullptr, which, "_format ", format, " has no row encoder (0..3: int8, fp8_e4m3, fp8_e5m2, "
              "int4, 5: nvfp4; KIVI pools write through hf_paged.kivi)");
  TORCH_CHECK(codes.scalar_type() == at::kByte && scales.scalar_type() == at::kBFloat16 && codes.dim() == 4 &&
              scales.dim() == 4 && codes.is_contiguous() && scales.is_contiguous() && codes.device().is_cpu() &&
              scales.device().is_cpu(), which, " codes / scales must be contiguous uint8 / bf16 [Hkv, blocks, BS, *] "
              "CPU tensors, got ", codes.sizes(), " and ", scales.sizes());
  TORCH_CHECK(codes.sizes().slice(0, 3) == scales.sizes().slice(0, 3), which, " scales ", scales.sizes(),
              " need one row per stored row of codes ", codes.sizes());
  const int64_t s = scales.size(3);
  const bool four_bit = format == hfp_codec::kInt4, nvfp4 = format == hfp_codec::kNvfp4;
  TORCH_CHECK(nvfp4 ? head_dim % hfp_codec::kNvfp4Group == 0 && codes.size(3) == hfp_codec::nvfp4_row_bytes(head_dim)
                    : codes.size(3) * (four_bit ? 2 : 1) == head_dim,
              which, " codes hold ", codes.size(3), " bytes per row for head_dim ", head_dim);
  TORCH_CHECK(nvfp4 ? s == 1
                    : four_bit ? (s % 2 == 0 && head_dim % (s / 2) == 0 && (head_dim / (s / 2)) % 2 == 0) : head_dim % s == 0,
              which, " scales: ", s, " per row do not split head_dim ", head_dim, " into groups");
  return Pool{codes.data_ptr<uint8_t>(), reinterpret_cast<uint16_t*>(scales.data_ptr<at::BFloat16>()), codes.size(3), s,
              codes.size(0), codes.size(1) * codes.size(2), encode};
}

// One row: fp32 copy (rotated when R is given) then encoded into its slot.
template <typename T>
void write_row(const T* x, int64_t stride, int64_t d, const float* rotation, bool hadamard, float* in, float* out,
               const Pool& pool, int64_t head, int64_t slot) {
  for (int64_t i = 0; i < d; ++i) in[i] = static_cast<float>(x[i * stride]);
  const float* row = in;
  if (hadamard) {
    hfp_codec::hadamard_row(in, d, rotation[0]);
  } else if (rotation != nullptr) {
    std::fill(out, out + d, 0.f);
    for (int64_t i = 0; i < d; ++i) {
      const float xi = in[i];
      const float* r = rotation + i * d;
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) out[j] += xi * r[j];
    }
    row = out;
  }
  const int64_t at = head * pool.slots + slot;
  pool.encode(row, d, pool.num_scales, pool.codes + at * pool.code_row, pool.scales + at * pool.num_scales);
}

template <typename T>
void write_all(const at::Tensor& key, const at::Tensor& value, const int64_t* slots, const Pool& k, const Pool& v,
               const float* rotation) {
  const int64_t n = key.size(0), heads = key.size(1), d = key.size(2);
  const T* kd = key.data_ptr<T>();
  const T* vd = value.data_ptr<T>();
  const bool hadamard = rotation != nullptr && hfp_codec::is_hadamard(rotation, d);
  // A row pair costs 0.3 (int8) to 1 us (fp8's scale search): a decode step's few dozen rows already pay
  // for the second thread (SmolLM2, 14 tokens x 3 heads: fp8 90 -> 50 us per layer).
  at::parallel_for(0, n * heads, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> in(d), out(d);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / heads, h = item % heads, slot = slots[t];
      if (slot < 0) continue;
      write_row(kd + t * key.stride(0) + h * key.stride(1), key.stride(2), d, rotation, hadamard, in.data(), out.data(), k, h, slot);
      write_row(vd + t * value.stride(0) + h * value.stride(1), value.stride(2), d, rotation, hadamard, in.data(), out.data(), v,
                h, slot);
    }
  });
}

void write_kv_quant(const at::Tensor& key, const at::Tensor& value, const at::Tensor& slot_mapping,
                    const at::Tensor& k_codes, const at::Tensor& k_scales, const at::Tensor& v_codes,
                    const at::Tensor& v_scales, int64_t k_format, int64_t v_format,
                    const std::optional<at::Tensor>& rotation) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.scalar_type() == value.scalar_type() &&
              key.device().is_cpu() && value.device().is_cpu(),
              "key and value must be [N, Hkv, D] CPU tensors alike, got ", key.sizes(), " and ", value.sizes());
  const int64_t d = key.size(2);
  const Pool k = pool_of("k", k_codes, k_scales, k_format, d), v = pool_of("v", v_codes, v_scales, v_format, d);
  TORCH_CHECK(k.heads == key.size(1) && v.heads == key.size(1) && k.slots == v.slots, "states have ", key.size(1),
              " KV heads, the pools ", k.heads, " and ", v.heads, " (and ", k.slots, " / ", v.slots, " slots)");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == key.size(0),
              "slot_mapping must be contiguous int64 [N] with N = ", key.size(0), ", got ", slot_mapping.sizes());
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < key.size(0); ++t)
    TORCH_CHECK(slots[t] < k.slots, "slot ", slots[t], " (token ", t, ") outside the pool's ", k.slots, " slots");
  const float* r = nullptr;
  at::Tensor contiguous;                  // QR-made rotations are column-major
  if (rotation.has_value()) {
    TORCH_CHECK(rotation->scalar_type() == at::kFloat && rotation->dim() == 2 && rotation->size(0) == d &&
                rotation->size(1) == d, "rotation must be fp32 [D, D] (D = ", d, "), got ", rotation->sizes());
    contiguous = rotation->contiguous();
    r = contiguous.data_ptr<float>();
  }
  switch (key.scalar_type()) {
    case at::kFloat: write_all<float>(key, value, slots, k, v, r); break;
    case at::kBFloat16: write_all<c10::BFloat16>(key, value, slots, k, v, r); break;
    case at::kHalf: write_all<c10::Half>(key, value, slots, k, v, r); break;
    default: TORCH_CHECK(false, "write_kv_quant: float32, bfloat16 or float16 states, got ", key.scalar_type());
  }
}

// The model-dtype write: torch.ops.hf_paged_cpu.write_kv. Pools [Hkv, blocks, BS, D] (contiguous, one dtype),
// key / value [N, Hkv, D] of the pools' dtype with any strides (the layer's projections, read in place);
// row t goes to slot slot_mapping[t] of every head, -1 = skip. A copy, so the pools hold what index_copy_
// would store, bit for bit; one call per layer instead of two index_copy_ calls on transposed views.
template <typename T>
void copy_rows(const at::Tensor& key, const at::Tensor& value, const int64_t* slots, T* k_pool, T* v_pool,
               int64_t pool_slots) {
  const int64_t n = key.size(0), heads = key.size(1), d = key.size(2);
  const T* kd = key.data_ptr<T>();
  const T* vd = value.data_ptr<T>();
  // Strides read once: Tensor::stride() in the inner loop is a call the compiler cannot hoist past the stores,
  // and unit-stride rows (the projections' usual layout) become plain vectorised copies.
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1), ks2 = key.stride(2);
  const int64_t vs0 = value.stride(0), vs1 = value.stride(1), vs2 = value.stride(2);
  at::parallel_for(0, n * heads, std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / heads, h = item % heads, slot = slots[t];
      if (slot < 0) continue;
      T* kout = k_pool + (h * pool_slots + slot) * d;
      T* vout = v_pool + (h * pool_slots + slot) * d;
      const T* kin = kd + t * ks0 + h * ks1;
      const T* vin = vd + t * vs0 + h * vs1;
      if (ks2 == 1) {
        std::copy(kin, kin + d, kout);
      } else {
        for (int64_t i = 0; i < d; ++i) kout[i] = kin[i * ks2];
      }
      if (vs2 == 1) {
        std::copy(vin, vin + d, vout);
      } else {
        for (int64_t i = 0; i < d; ++i) vout[i] = vin[i * vs2];
      }
    }
  });
}

void write_kv(const at::Tensor& key, const at::Tensor& value, const at::Tensor& slot_mapping, const at::Tensor& k_pool,
              const at::Tensor& v_pool) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.device().is_cpu() && value.device().is_cpu(),
              "key and value must be [N, Hkv, D] CPU tensors alike, got ", key.sizes(), " and ", value.sizes());
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes() && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  k_pool.device().is_cpu() && v_pool.device().is_cpu(),
              "k_pool and v_pool must be contiguous CPU [Hkv, blocks, BS, D] tensors alike, got ", k_pool.sizes(), " and ",
              v_pool.sizes());
  TORCH_CHECK(key.scalar_type() == k_pool.scalar_type() && value.scalar_type() == k_pool.scalar_type() &&
                  v_pool.scalar_type() == k_pool.scalar_type(),
              "write_kv: states and pools must share one dtype, got ", key.scalar_type(), " / ", value.scalar_type(),
              " states for ", k_pool.scalar_type(), " pools");
  TORCH_CHECK(key.size(1) == k_pool.size(0) && key.size(2) == k_pool.size(3), "states [N, ", key.size(1), ", ",
              key.size(2), "] do not fit pools ", k_pool.sizes());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == key.size(0),
              "slot_mapping must be contiguous int64 [N] with N = ", key.size(0), ", got ", slot_mapping.sizes());
  const int64_t pool_slots = k_pool.size(1) * k_pool.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < key.size(0); ++t)
    TORCH_CHECK(slots[t] < pool_slots, "slot ", slots[t], " (token ", t, ") outside the pool's ", pool_slots, " slots");
  switch (key.scalar_type()) {
    case at::kFloat: copy_rows<float>(key, value, slots, k_pool.data_ptr<float>(), v_pool.data_ptr<float>(), pool_slots); break;
    case at::kBFloat16:
      copy_rows<c10::BFloat16>(key, value, slots, k_pool.data_ptr<c10::BFloat16>(), v_pool.data_ptr<c10::BFloat16>(), pool_slots);
      break;
    case at::kHalf:
      copy_rows<c10::Half>(key, value, slots, k_pool.data_ptr<c10::Half>(), v_pool.data_ptr<c10::Half>(), pool_slots);
      break;
    default: TORCH_CHECK(false, "write_kv: float32, bfloat16 or float16 pools, got ", key.scalar_type());
  }
}

// The search's vectors (16 lanes with AVX-512, 8 with AVX2 + FMA) are the attention kernel's (simd::V): the test
// hooks below run at the width the search runs.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define HFP_SEARCH_HOOKS 1
namespace simd = hfp_cpu::simd;
#endif

#if defined(HFP_SEARCH_HOOKS)
// How many of the fp32 bit patterns [from, to) `vector` maps otherwise than `scalar` does (both given one
// pattern's float; vector a whole simd::V of them), over 64 parts in parallel.
template <typename Vector, typename Scalar>
int64_t count_mismatches(uint32_t from, uint32_t to, const Vector& vector, const Scalar& scalar) {
  std::vector<int64_t> failures(64, 0);
  const uint32_t span = (to - from) / 64 + 1;
  at::parallel_for(0, 64, 1, [&](int64_t begin, int64_t end) {
    for (int64_t part = begin; part < end; ++part) {
      const uint32_t lo = from + static_cast<uint32_t>(part) * span, hi = std::min(to, lo + span);
      constexpr uint32_t kLanes = simd::kLanes;
      float x[kLanes], got[kLanes];
      for (uint32_t u = lo; u < hi; u += kLanes) {
        const uint32_t lanes = std::min(kLanes, hi - u);
        for (uint32_t l = 0; l < kLanes; ++l) x[l] = hfp_codec::from_bits(u + std::min(l, lanes - 1));
        simd::store(got, vector(simd::load(x)));
        for (uint32_t l = 0; l < lanes; ++l) failures[part] += hfp_codec::bits_of(got[l]) != hfp_codec::bits_of(scalar(x[l]));
      }
    }
  });
  int64_t total = 0;
  for (const int64_t f : failures) total += f;
  return total;
}
#endif

// Test hook: how many of the 2^30 pairs (x, s), x an fp32 in [1, 2), s a bf16 in [1, 2), divide_by_reciprocal
// (kv_encode_cpu.h, the fp8 scale search's division; AVX-512's or AVX2's) gets other than x / s; -1 where the build
// has neither (then the search divides).
int64_t exact_division_failures() {
#if defined(HFP_SEARCH_HOOKS)
  int64_t total = 0;
  for (uint32_t k = 0; k < 128; ++k) {
    const float s = hfp_codec::from_bits(0x3F800000u | k << 16);
    const simd::V scale = simd::set1(s), reciprocal = simd::set1(1.0f / s);
    total += count_mismatches(0x3F800000u, 0x40000000u,
                              [&](simd::V x) { return hfp_codec::divide_by_reciprocal(x, scale, reciprocal); },
                              [&](float x) { return x / s; });
  }
  return total;
#else
  return -1;
#endif
}

// Test hook: how many normal-range magnitudes y in [2^(1 - B), code_max] of e4m3 and e5m2 (every fp32 there)
// fp8_rounded_normal (kv_encode_cpu.h, the search's rounding; AVX-512's or AVX2's) rounds otherwise than
// fp8_rounded; -1 without either.
int64_t fp8_rounding_failures() {
#if defined(HFP_SEARCH_HOOKS)
  return count_mismatches(static_cast<uint32_t>(128 - 7) << 23, hfp_codec::bits_of(448.f) + 1,
                          [](simd::V y) { return hfp_codec::fp8_rounded_normal<3, 7>(y); }, hfp_codec::fp8_rounded<3, 7>) +
         count_mismatches(static_cast<uint32_t>(128 - 15) << 23, hfp_codec::bits_of(57344.f) + 1,
                          [](simd::V y) { return hfp_codec::fp8_rounded_normal<2, 15>(y); }, hfp_codec::fp8_rounded<2, 15>);
#else
  return -1;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_paged_cpu, m) {
  m.def("write_kv(Tensor key, Tensor value, Tensor slot_mapping, Tensor(a!) k_pool, Tensor(b!) v_pool) -> ()");
  m.def("write_kv_quant(Tensor key, Tensor value, Tensor slot_mapping, Tensor(a!) k_codes, Tensor(b!) k_scales, "
        "Tensor(c!) v_codes, Tensor(d!) v_scales, int k_format, int v_format, Tensor? rotation) -> ()");
  m.def("exact_division_failures() -> int", &exact_division_failures);     // no tensor argument: a catch-all kernel
  m.def("fp8_rounding_failures() -> int", &fp8_rounding_failures);
}

TORCH_LIBRARY_IMPL(hf_paged_cpu, CPU, m) {
  m.impl("write_kv_quant", &write_kv_quant);
  m.impl("write_kv", &write_kv);
}
