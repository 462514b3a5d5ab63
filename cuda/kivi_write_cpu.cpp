// KIVI's write on the CPU: torch.ops.hf_paged_cpu.kivi_write (hf_paged/kivi.py's KiviPool.write_planned).
//
// One call per pool and step, in two phases:
//   1. rows into open slots: open_rows.view(H, capacity * BS, D)[:, dst[i]] = states[src[i]] (the model's dtype,
//      copied as they are);
//   2. the blocks ``seal_blocks`` [m] sealed: block j's BS rows, from its open slot ``seal_slots[j]`` (after
//      phase 1) or, where that is -1, from ``states`` rows ``seal_rows[j]`` [BS] (offset order), are copied to
//      ``fresh`` [H, m, BS, D] and quantised into ``codes`` / ``scales`` at block seal_blocks[j]:
//        keys (is_key): per channel over the block's rows, row 0 left out where seal_sink[j] (its sink is
//          read instead), scales [H, blocks, 2, D] = (channel scales, channel minima);
//        values: per row, groups of G = D / (scales.size(3) / 2) channels, scales [H, blocks, BS, 2 * D / G]
//          = (group scales, group minima): int4's row encoding (kv_encode_cpu.h encode_int4).
//      Codes: asymmetric 4-bit, element 2i in the low nibble of byte i.
// KiviPool.quantize_blocks bit for bit on the same rows: fp32 math, min and max exact, scale =
// bf16((max - min) / 15) (1 where not positive), minimum bf16, code = clamp(round-half-even((x - min) / scale),
// 0, 15). No float reduction depends on the order, so no ISA or thread count can change a code.
//
// torch.ops.hf_paged_cpu.kivi_write_kv: a layer's keys and values in one call (hf_paged/kivi.py write_kv, for
// the writes that reopen no block): the values rotated first, each row x R in fp32 through rotate_row (the
// fast Walsh-Hadamard transform when R is Hadamard) and rounded to the model's dtype, as rotate_rows + .to(dtype)
// give them; then per pool the sink rows (sink[:, sink_entries[i]] = states[sink_rows[i]]), the two phases
// above, and the rows of the blocks this write opens into their new slots (open rows at new_dst = states[new_src],
// after the sealing, which may have freed those slots). Returns the fresh rows of keys and values.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "kv_encode_cpu.h"
#include "paged_attention_cpu_util.h"     // rotate_row

namespace {

constexpr float kCodeMax = 15.f;

struct Geometry {
  int64_t heads, capacity, bs, d;
};

// A key's code, clamped in float: a sink's row 0 lies outside its block's channel range (its code is never
// read), so (x - low) / scale may be far beyond what int4's integer clamp (encode_int4) could take.
inline uint8_t code_of(float x, float low, float scale) {
  const float r = std::nearbyint((x - low) / scale);            // halves to even, as torch.round
  return static_cast<uint8_t>(std::min(std::max(r, 0.f), kCodeMax));
}

#if defined(__AVX512F__)
// seal_keys below for d a multiple of 16: channels in the lanes (the running minimum and maximum second, as
// std::min / std::max pass a NaN over), codes as code_of (sub, div, round half even, clamp in float).
void seal_keys_avx512(const float* x, int64_t bs, int64_t d, bool sink, uint8_t* codes, uint16_t* scales) {
  for (int64_t c = 0; c < d; c += 16) {
    __m512 low = _mm512_set1_ps(std::numeric_limits<float>::infinity()), high = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t r = sink ? 1 : 0; r < bs; ++r) {
      const __m512 v = _mm512_loadu_ps(x + r * d + c);
      low = _mm512_min_ps(v, low), high = _mm512_max_ps(v, high);
    }
    alignas(64) float lows[16], ranges[16];
    _mm512_store_ps(lows, low);
    _mm512_store_ps(ranges, _mm512_div_ps(_mm512_sub_ps(high, low), _mm512_set1_ps(kCodeMax)));
    for (int64_t i = 0; i < 16; ++i) {
      scales[c + i] = hfp_codec::stored_scale(ranges[i]);
      scales[d + c + i] = hfp_codec::to_bf16(lows[i]);
    }
  }
  for (int64_t c = 0; c < d; c += 16) {
    alignas(64) float lows[16], steps[16];
    for (int64_t i = 0; i < 16; ++i) lows[i] = hfp_codec::bf16(scales[d + c + i]), steps[i] = hfp_codec::bf16(scales[c + i]);
    const __m512 low = _mm512_load_ps(lows), step = _mm512_load_ps(steps);
    for (int64_t r = 0; r < bs; ++r) {
      const __m512 q = _mm512_roundscale_ps(_mm512_div_ps(_mm512_sub_ps(_mm512_loadu_ps(x + r * d + c), low), step),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512i code = _mm512_cvttps_epi32(_mm512_min_ps(_mm512_max_ps(q, _mm512_setzero_ps()), _mm512_set1_ps(kCodeMax)));
      hfp_codec::store_nibbles(code, codes + (r * d + c) / 2);
    }
  }
}
#endif

// The rows [bs][d] (fp32) of one (head, block): keys per channel.
void seal_keys(const float* x, int64_t bs, int64_t d, bool sink, uint8_t* codes, uint16_t* scales) {
#if defined(__AVX512F__)
  if (d % 16 == 0) return seal_keys_avx512(x, bs, d, sink, codes, scales);
#endif
  for (int64_t c = 0; c < d; ++c) {
    float low = std::numeric_limits<float>::infinity(), high = -low;
    for (int64_t r = sink ? 1 : 0; r < bs; ++r) {
      low = std::min(low, x[r * d + c]);
      high = std::max(high, x[r * d + c]);
    }
    scales[c] = hfp_codec::stored_scale((high - low) / kCodeMax);
    scales[d + c] = hfp_codec::to_bf16(low);
  }
  for (int64_t r = 0; r < bs; ++r) {
    for (int64_t c = 0; c < d; c += 2) {
      const uint8_t lo = code_of(x[r * d + c], hfp_codec::bf16(scales[d + c]), hfp_codec::bf16(scales[c]));
      const uint8_t hi = code_of(x[r * d + c + 1], hfp_codec::bf16(scales[d + c + 1]), hfp_codec::bf16(scales[c + 1]));
      codes[r * d / 2 + c / 2] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

// One state row of d channels at channel stride `stride` into out (a plain copy where the channels are contiguous:
// the engine's states are row-strided views of the q/k/v product).
template <typename T>
inline void copy_row(const T* in, int64_t stride, int64_t d, T* out) {
  if (stride == 1) {
    std::copy(in, in + d, out);
  } else {
    for (int64_t c = 0; c < d; ++c) out[c] = in[c * stride];
  }
}

template <typename T>
void run(const at::Tensor& states, const int64_t* src, const int64_t* dst, int64_t copies, T* open, const Geometry& g,
         const int64_t* blocks, const int64_t* slots, const int64_t* rows, const bool* sinks, int64_t sealed,
         uint8_t* codes, uint16_t* scales, int64_t num_blocks, bool is_key, int64_t value_group, T* fresh) {
  const T* x = states.data_ptr<T>();
  const int64_t s0 = states.stride(0), s1 = states.stride(1), s2 = states.stride(2), d = g.d, bs = g.bs;
  auto state_row = [&](int64_t row, int64_t h, T* out) {
    copy_row(x + row * s0 + h * s1, s2, d, out);
  };
  // 1. rows into their open slots
  at::parallel_for(0, copies * g.heads, 256, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / g.heads, h = item % g.heads;
      state_row(src[i], h, open + (h * g.capacity * bs + dst[i]) * d);
    }
  });
  // 2. sealed blocks: fresh rows, then their codes and scales
  const int64_t code_row = d / 2, key_scales = 2 * d, value_scales = bs * 2 * (d / value_group);
  at::parallel_for(0, sealed * g.heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> block(bs * d);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t j = item / g.heads, h = item % g.heads;
      T* out = fresh + (h * sealed + j) * bs * d;
      if (slots[j] >= 0) {
        std::copy(open + (h * g.capacity + slots[j]) * bs * d, open + (h * g.capacity + slots[j] + 1) * bs * d, out);
      } else {
        for (int64_t r = 0; r < bs; ++r) state_row(rows[j * bs + r], h, out + r * d);
      }
      for (int64_t i = 0; i < bs * d; ++i) block[i] = static_cast<float>(out[i]);
      const int64_t at = h * num_blocks + blocks[j];
      if (is_key) {
        seal_keys(block.data(), bs, d, sinks[j], codes + at * bs * code_row, scales + at * key_scales);
      } else {
        // values: each row as an int4 row of groups of value_group channels (scales then minima, per row)
        const int64_t row_scales = 2 * (d / value_group);
        for (int64_t r = 0; r < bs; ++r)
          hfp_codec::encode_int4(block.data() + r * d, d, row_scales, codes + (at * bs + r) * code_row,
                                 scales + at * value_scales + r * row_scales);
      }
    }
  });
}

void check_index(const char* name, const at::Tensor& t, int64_t n) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && t.device().is_cpu() && t.numel() == n, name,
              " must be contiguous int64 CPU [", n, "], got ", t.sizes(), " ", t.scalar_type());
}

void kivi_write(const at::Tensor& states, const at::Tensor& src, const at::Tensor& dst, const at::Tensor& open_rows,
                const at::Tensor& seal_blocks, const at::Tensor& seal_slots, const at::Tensor& seal_rows,
                const at::Tensor& seal_sink, const at::Tensor& codes, const at::Tensor& scales, bool is_key,
                const at::Tensor& fresh) {
  TORCH_CHECK(open_rows.dim() == 4 && open_rows.is_contiguous() && open_rows.device().is_cpu(),
              "open_rows must be a contiguous CPU [H, capacity, BS, D] tensor, got ", open_rows.sizes());
  const Geometry g{open_rows.size(0), open_rows.size(1), open_rows.size(2), open_rows.size(3)};
  TORCH_CHECK(states.dim() == 3 && states.size(1) == g.heads && states.size(2) == g.d &&
              states.scalar_type() == open_rows.scalar_type() && states.device().is_cpu(),
              "states must be CPU [N, ", g.heads, ", ", g.d, "] in the open rows' dtype, got ", states.sizes(), " ",
              states.scalar_type());
  TORCH_CHECK(g.d % 2 == 0, "head_dim must be even, got ", g.d);
  const int64_t copies = src.numel(), sealed = seal_blocks.numel(), n = states.size(0);
  check_index("src", src, copies);
  check_index("dst", dst, copies);
  check_index("seal_slots", seal_slots, sealed);
  check_index("seal_rows", seal_rows, sealed * g.bs);
  check_index("seal_blocks", seal_blocks, sealed);
  TORCH_CHECK(seal_sink.scalar_type() == at::kBool && seal_sink.is_contiguous() && seal_sink.numel() == sealed,
              "seal_sink must be contiguous bool [", sealed, "], got ", seal_sink.sizes());
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 4 && codes.size(0) == g.heads &&
              codes.size(2) == g.bs && codes.size(3) == g.d / 2, "codes must be contiguous uint8 [", g.heads,
              ", blocks, ", g.bs, ", ", g.d / 2, "], got ", codes.sizes());
  const int64_t num_blocks = codes.size(1);
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.is_contiguous() && scales.dim() == 4 &&
              scales.size(0) == g.heads && scales.size(1) == num_blocks &&
              (is_key ? scales.size(2) == 2 && scales.size(3) == g.d
                      : scales.size(2) == g.bs && scales.size(3) % 2 == 0 && scales.size(3) > 0 &&
                            g.d % (scales.size(3) / 2) == 0 && (g.d / (scales.size(3) / 2)) % 2 == 0),
              is_key ? "key" : "value", " scales ", scales.sizes(), " do not fit codes ", codes.sizes());
  TORCH_CHECK(fresh.scalar_type() == open_rows.scalar_type() && fresh.is_contiguous() && fresh.dim() == 4 &&
              fresh.size(0) == g.heads && fresh.size(1) == sealed && fresh.size(2) == g.bs && fresh.size(3) == g.d,
              "fresh must be contiguous [", g.heads, ", ", sealed, ", ", g.bs, ", ", g.d, "] in the open rows' dtype, got ",
              fresh.sizes());
  const int64_t* s = src.data_ptr<int64_t>();
  const int64_t* t = dst.data_ptr<int64_t>();
  for (int64_t i = 0; i < copies; ++i)
    TORCH_CHECK(s[i] >= 0 && s[i] < n && t[i] >= 0 && t[i] < g.capacity * g.bs, "copy ", i, ": row ", s[i], " of ", n,
                " into slot row ", t[i], " of ", g.capacity * g.bs);
  const int64_t* b = seal_blocks.data_ptr<int64_t>();
  const int64_t* sl = seal_slots.data_ptr<int64_t>();
  const int64_t* r = seal_rows.data_ptr<int64_t>();
  for (int64_t j = 0; j < sealed; ++j) {
    TORCH_CHECK(b[j] >= 0 && b[j] < num_blocks && sl[j] < g.capacity, "sealed block ", b[j], " (slot ", sl[j],
                ") outside the pool's ", num_blocks, " blocks / ", g.capacity, " slots");
    for (int64_t k = 0; sl[j] < 0 && k < g.bs; ++k)
      TORCH_CHECK(r[j * g.bs + k] >= 0 && r[j * g.bs + k] < n, "sealed block ", b[j], ": row ", r[j * g.bs + k],
                  " outside the ", n, " states");
  }
  const int64_t value_group = is_key ? g.d : g.d / (scales.size(3) / 2);
  uint8_t* c = codes.data_ptr<uint8_t>();
  uint16_t* sc = reinterpret_cast<uint16_t*>(scales.data_ptr<at::BFloat16>());
  const bool* sink = seal_sink.data_ptr<bool>();
  switch (states.scalar_type()) {
    case at::kFloat:
      run<float>(states, s, t, copies, open_rows.data_ptr<float>(), g, b, sl, r, sink, sealed, c, sc, num_blocks, is_key,
                 value_group, fresh.data_ptr<float>());
      break;
    case at::kBFloat16:
      run<c10::BFloat16>(states, s, t, copies, open_rows.data_ptr<c10::BFloat16>(), g, b, sl, r, sink, sealed, c, sc,
                         num_blocks, is_key, value_group, fresh.data_ptr<c10::BFloat16>());
      break;
    case at::kHalf:
      run<c10::Half>(states, s, t, copies, open_rows.data_ptr<c10::Half>(), g, b, sl, r, sink, sealed, c, sc, num_blocks,
                     is_key, value_group, fresh.data_ptr<c10::Half>());
      break;
    default: TORCH_CHECK(false, "kivi_write: float32, bfloat16 or float16 states, got ", states.scalar_type());
  }
}

// Rows copied as they are: rows.view(H, capacity * per_entry / D, D)[:, dst[i]] = states[src[i]] (sinks: one row
// per entry; open slots: BS rows per entry).
template <typename T>
void copy_rows(const at::Tensor& states, const at::Tensor& src, const at::Tensor& dst, const at::Tensor& rows) {
  const int64_t n = src.numel(), heads = rows.size(0), d = rows.size(-1), per_head = rows.numel() / heads / d;
  check_index("rows", src, n);
  check_index("row slots", dst, n);
  const int64_t* s = src.data_ptr<int64_t>();
  const int64_t* t = dst.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(s[i] >= 0 && s[i] < states.size(0) && t[i] >= 0 && t[i] < per_head, "row ", s[i], " of ",
                states.size(0), " into entry row ", t[i], " of ", per_head);
  const T* x = states.data_ptr<T>();
  T* out = rows.data_ptr<T>();
  const int64_t s0 = states.stride(0), s1 = states.stride(1), s2 = states.stride(2);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < heads; ++h) copy_row(x + s[i] * s0 + h * s1, s2, d, out + (h * per_head + t[i]) * d);
}

// value [N, H, D] -> contiguous [N, H, D] in value's dtype: each row x R (rotate_row), rounded to the dtype.
template <typename T>
at::Tensor rotated(const at::Tensor& value, const at::Tensor& rotation) {
  const int64_t n = value.size(0), heads = value.size(1), d = value.size(2);
  at::Tensor out = at::empty({n, heads, d}, value.options());
  const float* r = rotation.data_ptr<float>();
  const bool hadamard = hfp_codec::is_hadamard(r, d);
  const T* x = value.data_ptr<T>();
  T* y = out.data_ptr<T>();
  const int64_t s0 = value.stride(0), s1 = value.stride(1), s2 = value.stride(2);
  at::parallel_for(0, n * heads, 256, [&](int64_t begin, int64_t end) {
    std::vector<float> row(d), tmp(d);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / heads, h = item % heads;
      const T* in = x + i * s0 + h * s1;
      if (s2 == 1) {
        for (int64_t c = 0; c < d; ++c) row[c] = static_cast<float>(in[c]);
      } else {
        for (int64_t c = 0; c < d; ++c) row[c] = static_cast<float>(in[c * s2]);
      }
      hfp_cpu::rotate_row(row.data(), r, d, false, tmp.data(), hadamard);
      for (int64_t c = 0; c < d; ++c) y[item * d + c] = static_cast<T>(row[c]);
    }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> kivi_write_kv(
    const at::Tensor& key, const at::Tensor& value, const std::optional<at::Tensor>& rotation, const at::Tensor& src,
    const at::Tensor& dst, const at::Tensor& seal_blocks, const at::Tensor& seal_slots, const at::Tensor& seal_rows,
    const at::Tensor& seal_sink, const at::Tensor& sink_rows, const at::Tensor& sink_entries, const at::Tensor& new_src,
    const at::Tensor& new_dst, const at::Tensor& k_open, const at::Tensor& k_sink, const at::Tensor& k_codes,
    const at::Tensor& k_scales, const at::Tensor& v_open, const at::Tensor& v_sink, const at::Tensor& v_codes,
    const at::Tensor& v_scales) {
  TORCH_CHECK(key.sizes() == value.sizes() && key.scalar_type() == value.scalar_type() && value.dim() == 3 &&
              key.scalar_type() == k_open.scalar_type() && v_open.scalar_type() == k_open.scalar_type(),
              "keys and values must be [N, H, D] in the open rows' dtype ", k_open.scalar_type(), ", got ",
              key.sizes(), " ", key.scalar_type(), " and ", value.sizes(), " ", value.scalar_type());
  for (const at::Tensor* sink : {&k_sink, &v_sink})
    TORCH_CHECK(sink->dim() == 3 && sink->is_contiguous() && sink->scalar_type() == k_open.scalar_type() &&
                sink->size(0) == k_open.size(0) && sink->size(2) == k_open.size(3),
                "sink rows must be contiguous [H, capacity, D] in the open rows' dtype, got ", sink->sizes());
  const int64_t sealed = seal_blocks.numel();
  auto fresh_of = [&](const at::Tensor& open) {
    return at::empty({open.size(0), sealed, open.size(2), open.size(3)}, open.options());
  };
  at::Tensor k_fresh = fresh_of(k_open), v_fresh = fresh_of(v_open);
  at::Tensor values = value, r;
  if (rotation.has_value()) {
    r = rotation->contiguous();
    TORCH_CHECK(r.scalar_type() == at::kFloat && r.dim() == 2 && r.size(0) == value.size(2) &&
                r.size(1) == value.size(2), "rotation must be fp32 [D, D], got ", r.sizes(), " ", r.scalar_type());
  }
  switch (key.scalar_type()) {
#define HFP_CASE(kind, type)                                                                                      \
  case kind:                                                                                                      \
    if (rotation.has_value()) values = rotated<type>(value, r);                                                   \
    copy_rows<type>(key, sink_rows, sink_entries, k_sink);                                                        \
    copy_rows<type>(values, sink_rows, sink_entries, v_sink);                                                     \
    break;
    HFP_CASE(at::kFloat, float)
    HFP_CASE(at::kBFloat16, c10::BFloat16)
    HFP_CASE(at::kHalf, c10::Half)
#undef HFP_CASE
    default: TORCH_CHECK(false, "kivi_write_kv: float32, bfloat16 or float16 states, got ", key.scalar_type());
  }
  kivi_write(key, src, dst, k_open, seal_blocks, seal_slots, seal_rows, seal_sink, k_codes, k_scales, true, k_fresh);
  kivi_write(values, src, dst, v_open, seal_blocks, seal_slots, seal_rows, seal_sink, v_codes, v_scales, false, v_fresh);
  if (new_src.numel() > 0) {
    switch (key.scalar_type()) {
      case at::kFloat: copy_rows<float>(key, new_src, new_dst, k_open), copy_rows<float>(values, new_src, new_dst, v_open); break;
      case at::kBFloat16:
        copy_rows<c10::BFloat16>(key, new_src, new_dst, k_open), copy_rows<c10::BFloat16>(values, new_src, new_dst, v_open);
        break;
      default: copy_rows<c10::Half>(key, new_src, new_dst, k_open), copy_rows<c10::Half>(values, new_src, new_dst, v_open);
    }
  }
  return {k_fresh, v_fresh};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_paged_cpu, m) {
  m.def("kivi_write(Tensor states, Tensor src, Tensor dst, Tensor(a!) open_rows, Tensor seal_blocks, Tensor seal_slots, "
        "Tensor seal_rows, Tensor seal_sink, Tensor(b!) codes, Tensor(c!) scales, bool is_key, Tensor(d!) fresh) -> ()");
  m.def("kivi_write_kv(Tensor key, Tensor value, Tensor? rotation, Tensor src, Tensor dst, Tensor seal_blocks, "
        "Tensor seal_slots, Tensor seal_rows, Tensor seal_sink, Tensor sink_rows, Tensor sink_entries, Tensor new_src, "
        "Tensor new_dst, Tensor(a!) k_open, Tensor(b!) k_sink, Tensor(c!) k_codes, Tensor(d!) k_scales, "
        "Tensor(e!) v_open, Tensor(f!) v_sink, Tensor(g!) v_codes, Tensor(h!) v_scales) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(hf_paged_cpu, CPU, m) {
  m.impl("kivi_write", &kivi_write);
  m.impl("kivi_write_kv", &kivi_write_kv);
}
