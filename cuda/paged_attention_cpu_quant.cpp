// Paged attention on the CPU over quantised pools, read in place: torch.ops.hf_paged_cpu.paged_attention_quant.
//
// The same loop, step layout and semantics as paged_attention (paged_attention_cpu.cpp, the loop in
// paged_attention_cpu.h); K/V tiles come from codes and bf16 scales (hf_paged/kv_formats.py's layout):
//   codes   uint8 [Hkv, blocks, BS, D * bits / 8]   (nvfp4: D / 2 + D / 16, the group scales after the codes)
//   scales  bf16  [Hkv, blocks, BS, S]   row formats (int8, fp8_e4m3, fp8_e5m2, int4, nvfp4, KIVI values)
//           bf16  [Hkv, blocks, 2, D]    KIVI keys: per-channel scales, then minima, of the block
// Each stored row a decode item reads is dequantised once (kv_codec_cpu.h, one function per format) into
// the thread's [BS, D] float tile, which then serves all the item's queries (the GQA group); a prefill
// row's chunks share one dequantised copy per block and thread (TileCache, paged_attention_cpu.h, bounded),
// so a block is dequantised once per thread and call, not once per chunk. Without `rotation`, the query
// arrives rotated (q R) and the output leaves rotated (sum p v R), as the padded PyTorch functions take them.
// KIVI (hf_paged/kivi.py's read rule): k_kivi / v_kivi = [open, open_slot, fresh, fresh_slot, sink, sink_slot],
// model-dtype rows in the query's dtype found per block through int64 [blocks] maps (-1 = none):
//   open  [Hkv, capacity, BS, D]  open blocks        fresh [Hkv, n, BS, D]  blocks the latest write sealed
//   sink  [Hkv, capacity, D]      row 0 of the block holding a sequence's position 0
// A query reads its own block (position / BS) from open, else fresh, else codes; earlier blocks from codes,
// row 0 from sink where the block has one. Prefill items then never span two blocks of queries
// (Geometry::own_blocks), so that each key block is read one way per item.
// With `rotation` R given, the query arrives unrotated and the output leaves unrotated: each query row is
// rotated once per work item and each output row unrotated once (paged_attention_cpu.h), never per key.
// With `rotate_query` false as well (KIVI: keys are stored unrotated, values rotated), only the output is
// unrotated: the query arrives as the keys hold it.
// dequantize_rows is the test hook that runs one format's row function (SIMD or scalar) alone.
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <optional>

#include "kv_codec_cpu.h"
#include "paged_attention_cpu.h"

namespace {

using namespace hfp_cpu;
using hfp_codec::RowFn;

// KIVI rows kept beside the codes in the model's dtype, found per block (see the top of this file).
template <typename T>
struct SideRows {
  const T* rows = nullptr;                // [Hkv, capacity, entry_rows, D]
  const int64_t* slot = nullptr;          // [blocks], -1 = none; null: no such store
  int64_t capacity = 0, entry_rows = 0;

  // The rows of KV head h kept for `block`, or nullptr.
  const T* find(int64_t h, int64_t block, int64_t head_dim) const {
    if (slot == nullptr) return nullptr;
    const int64_t s = slot[block];
    if (s < 0) return nullptr;
    TORCH_CHECK(s < capacity, "block ", block, " names side entry ", s, " of ", capacity);
    return rows + (h * capacity + s) * entry_rows * head_dim;
  }
};

// One pool (keys or values) as the loop reads it.
template <typename T>
struct QuantSide {
  const uint8_t* codes;
  const uint16_t* scales;                 // bf16 bits
  int64_t code_row, code_tile;            // bytes per stored row / per (head, block)
  int64_t scale_row, scale_tile;          // bf16 per stored row (0: one set per block) / per (head, block)
  int64_t num_scales;                     // S, as the row function reads it
  RowFn row;
  SideRows<T> open, fresh, sink;          // KIVI's, or none
};

template <typename T>
struct QuantTiles {
  QuantSide<T> k, v;
  int64_t num_blocks, block_size, head_dim;
  const float* rotate = nullptr;          // R, or none: the query and output are in the pools' space
  bool is_hadamard_ = false;              // R is the normalised Sylvester-Hadamard matrix
  bool rotates_query_ = true;             // false: R unrotates the output only (the keys are not rotated)
  const float* rotation() const { return rotate; }
  bool rotates_query() const { return rotates_query_; }
  bool hadamard() const { return is_hadamard_; }

  static constexpr bool kConverts = true;

  // The full-precision rows of KV head h's block for a query inside it (KIVI): its open slot, else the rows
  // the latest write sealed it with; nullptr when it has neither (then it is read from its codes).
  const T* full_rows(const QuantSide<T>& side, int64_t h, int64_t block) const {
    const T* rows = side.open.find(h, block, head_dim);
    return rows != nullptr ? rows : side.fresh.find(h, block, head_dim);
  }
  // Rows [from, to) of KV head h's block as floats into dst; `own`: read by a query inside the block.
  void rows(const QuantSide<T>& side, int64_t h, int64_t block, int64_t from, int64_t to, float* dst, bool own) const {
    if (own) {
      if (const T* full = full_rows(side, h, block)) return to_float(full + from * head_dim, dst, (to - from) * head_dim);
    }
    const int64_t at = h * num_blocks + block;
    const uint8_t* codes = side.codes + at * side.code_tile;
    const uint16_t* scales = side.scales + at * side.scale_tile;
    int64_t r = from;
    if (r == 0 && r < to) {                 // a sequence's position 0: the sink row, never its code
      if (const T* sink = side.sink.find(h, block, head_dim)) to_float(sink, dst, head_dim), ++r;
    }
    for (; r < to; ++r)
      side.row(codes + r * side.code_row, scales + r * side.scale_row, side.num_scales, head_dim, dst + (r - from) * head_dim);
  }
  const float* tile(const QuantSide<T>& side, int64_t h, int64_t block, int64_t n, float* buffer, bool own) const {
    if (own) {
      if (const T* full = full_rows(side, h, block)) return float_tile(full, buffer, n * head_dim);   // f32: in place
    }
    rows(side, h, block, 0, n, buffer, false);
    return buffer;
  }
  void key_rows(int64_t h, int64_t block, int64_t from, int64_t to, float* dst, bool own) const {
    rows(k, h, block, from, to, dst, own);
  }
  void value_rows(int64_t h, int64_t block, int64_t from, int64_t to, float* dst, bool own) const {
    rows(v, h, block, from, to, dst, own);
  }
  const float* keys(int64_t h, int64_t block, int64_t rows, float* buffer, bool own) const {
    return tile(k, h, block, rows, buffer, own);
  }
  const float* values(int64_t h, int64_t block, int64_t rows, float* buffer, bool own) const {
    return tile(v, h, block, rows, buffer, own);
  }
};

// Checks one side's tensors against the format and geometry; names what was wrong.
void check_side(const char* which, const at::Tensor& codes, const at::Tensor& scales, int64_t format,
                int64_t head_dim) {
  TORCH_CHECK(format >= 0 && format < hfp_codec::kNumFormats, which, "_format ", format, " unknown (0..",
              hfp_codec::kNumFormats - 1, ", cpu_backend.FORMAT_IDS)");
  TORCH_CHECK(codes.device().is_cpu() && scales.device().is_cpu() && codes.is_contiguous() && scales.is_contiguous(),
              which, " codes and scales must be contiguous CPU tensors");
  TORCH_CHECK(codes.scalar_type() == at::kByte && scales.scalar_type() == at::kBFloat16 && codes.dim() == 4 &&
              scales.dim() == 4, which, " codes must be uint8 [Hkv, blocks, BS, bytes] and scales bf16 4-d, got ",
              codes.scalar_type(), " ", codes.sizes(), " and ", scales.scalar_type(), " ", scales.sizes());
  const bool four_bit = format == hfp_codec::kInt4 || format == hfp_codec::kKiviKey;
  if (format == hfp_codec::kNvfp4) {
    TORCH_CHECK(head_dim % hfp_codec::kNvfp4Group == 0 && codes.size(3) == hfp_codec::nvfp4_row_bytes(head_dim), which,
                " nvfp4 codes hold ", codes.size(3), " bytes per row, not head_dim / 2 + head_dim / 16 for head_dim ",
                head_dim);
  } else {
    TORCH_CHECK(codes.size(3) * (four_bit ? 2 : 1) == head_dim, which, " codes hold ", codes.size(3),
                " bytes per row, not head_dim ", head_dim, (four_bit ? " / 2" : ""));
  }
  TORCH_CHECK(scales.size(0) == codes.size(0) && scales.size(1) == codes.size(1), which,
              " scales ", scales.sizes(), " do not follow codes ", codes.sizes(), " in heads and blocks");
  const int64_t s = scales.size(3);
  if (format == hfp_codec::kKiviKey) {
    TORCH_CHECK(scales.size(2) == 2 && s == head_dim, which, " KIVI key scales must be [Hkv, blocks, 2, D], got ",
                scales.sizes());
    return;
  }
  TORCH_CHECK(scales.size(2) == codes.size(2), which, " scales ", scales.sizes(), " need one row per stored row");
  if (format == hfp_codec::kNvfp4) {
    TORCH_CHECK(s == 1, which, " nvfp4 scales: one row scale per row, got ", s);
  } else if (format == hfp_codec::kInt4) {
    TORCH_CHECK(s % 2 == 0 && head_dim % (s / 2) == 0 && (head_dim / (s / 2)) % 2 == 0, which, " int4 scales: ",
                s, " per row must be scales then minima of even groups dividing head_dim ", head_dim);
  } else {
    TORCH_CHECK(s > 0 && head_dim % s == 0, which, " 8-bit scales: ", s, " per row must divide head_dim ", head_dim);
  }
}

// One KIVI side store: rows [Hkv, capacity, (BS,) D] in the query's dtype and its int64 [blocks] map.
template <typename T>
SideRows<T> side_rows(const char* which, const char* name, const at::Tensor& rows, const at::Tensor& slot,
                      const at::Tensor& codes, const at::Tensor& query, bool per_block) {
  const int64_t dims = per_block ? 4 : 3;
  TORCH_CHECK(rows.scalar_type() == query.scalar_type() && rows.is_contiguous() && rows.dim() == dims &&
                  rows.size(0) == codes.size(0) && rows.size(dims - 1) == query.size(2) &&
                  (!per_block || rows.size(2) == codes.size(2)),
              which, "_kivi ", name, " must be contiguous [Hkv, capacity, ", (per_block ? "BS, " : ""),
              "D] in the query's dtype, got ", rows.scalar_type(), " ", rows.sizes());
  TORCH_CHECK(slot.scalar_type() == at::kLong && slot.is_contiguous() && slot.numel() == codes.size(1), which,
              "_kivi ", name, " map must be contiguous int64 [blocks] (", codes.size(1), "), got ", slot.sizes());
  SideRows<T> side;
  side.rows = rows.numel() ? rows.data_ptr<T>() : nullptr;
  side.slot = slot.data_ptr<int64_t>(), side.capacity = rows.size(1), side.entry_rows = per_block ? rows.size(2) : 1;
  return side;
}

template <typename T>
QuantSide<T> make_side(const char* which, const at::Tensor& codes, const at::Tensor& scales, int64_t format,
                       const at::Tensor& query, at::TensorList kivi) {
  check_side(which, codes, scales, format, query.size(2));
  QuantSide<T> side;
  side.codes = codes.data_ptr<uint8_t>();
  side.scales = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  side.code_row = codes.size(3), side.code_tile = codes.size(2) * codes.size(3);
  side.scale_row = format == hfp_codec::kKiviKey ? 0 : scales.size(3);
  side.scale_tile = scales.size(2) * scales.size(3), side.num_scales = scales.size(3);
  side.row = hfp_codec::row_function(format, true);
  TORCH_CHECK(kivi.empty() || kivi.size() == 6, which, "_kivi must be empty or [open, open_slot, fresh, fresh_slot, "
              "sink, sink_slot], got ", kivi.size(), " tensors");
  if (!kivi.empty()) {
    side.open = side_rows<T>(which, "open", kivi[0], kivi[1], codes, query, true);
    side.fresh = side_rows<T>(which, "fresh", kivi[2], kivi[3], codes, query, true);
    side.sink = side_rows<T>(which, "sink", kivi[4], kivi[5], codes, query, false);
  }
  return side;
}

template <typename T>
void run(const at::Tensor& query, const Geometry& g, const QuantSide<T>& k, const QuantSide<T>& v,
         const std::optional<at::Tensor>& rotation, bool rotate_query, at::Tensor& out) {
  QuantTiles<T> tiles{k, v, g.num_blocks, g.block_size, g.head_dim};
  tiles.rotates_query_ = rotate_query;
  at::Tensor r;                           // a contiguous R (QR-made ones are column-major), alive for the call
  if (rotation.has_value()) {
    TORCH_CHECK(rotation->scalar_type() == at::kFloat && rotation->dim() == 2 && rotation->size(0) == g.head_dim &&
                rotation->size(1) == g.head_dim, "rotation must be fp32 [D, D] (D = ", g.head_dim, "), got ",
                rotation->scalar_type(), " ", rotation->sizes());
    r = rotation->contiguous();
    tiles.rotate = r.data_ptr<float>();
    tiles.is_hadamard_ = hfp_codec::is_hadamard(tiles.rotate, g.head_dim);
  }
  attend<T>(g, tiles, query.data_ptr<T>(), out.data_ptr<T>());
}

template <typename T>
void dispatch(const at::Tensor& query, const Geometry& g, const at::Tensor& k_codes, const at::Tensor& k_scales,
              const at::Tensor& v_codes, const at::Tensor& v_scales, int64_t k_format, int64_t v_format,
              at::TensorList k_kivi, at::TensorList v_kivi, const std::optional<at::Tensor>& rotation, bool rotate_query,
              at::Tensor& out) {
  const QuantSide<T> k = make_side<T>("k", k_codes, k_scales, k_format, query, k_kivi);
  const QuantSide<T> v = make_side<T>("v", v_codes, v_scales, v_format, query, v_kivi);
  run<T>(query, g, k, v, rotation, rotate_query, out);
}

at::Tensor paged_attention_quant(const at::Tensor& query, const at::Tensor& k_codes, const at::Tensor& k_scales,
                                 const at::Tensor& v_codes, const at::Tensor& v_scales,
                                 const at::Tensor& block_tables, const at::Tensor& token_row,
                                 const at::Tensor& token_pos, double scale, int64_t window, int64_t k_format,
                                 int64_t v_format, std::optional<at::TensorList> k_kivi,
                                 std::optional<at::TensorList> v_kivi, const std::optional<at::Tensor>& rotation,
                                 bool rotate_query) {
  TORCH_CHECK(k_codes.dim() == 4 && k_codes.sizes() == v_codes.sizes(),
              "k_codes and v_codes must be [Hkv, blocks, BS, bytes] alike, got ", k_codes.sizes(), " and ",
              v_codes.sizes());
  check_step(query, k_codes.size(0), query.size(2), block_tables, token_row, token_pos);
  Geometry g = geometry(query, k_codes.size(0), k_codes.size(1), k_codes.size(2), block_tables, token_row, token_pos,
                        scale, window);
  const at::TensorList k_side = k_kivi.value_or(at::TensorList()), v_side = v_kivi.value_or(at::TensorList());
  g.own_blocks = !k_side.empty() || !v_side.empty();
  at::Tensor out = at::empty(query.sizes(), query.options());
  switch (query.scalar_type()) {
#define HFP_CASE(kind, type)                                                                                    \
  case kind:                                                                                                    \
    dispatch<type>(query, g, k_codes, k_scales, v_codes, v_scales, k_format, v_format, k_side, v_side, rotation, \
                   rotate_query, out);                                                                          \
    break;
    HFP_CASE(at::kFloat, float)
    HFP_CASE(at::kBFloat16, c10::BFloat16)
    HFP_CASE(at::kHalf, c10::Half)
#undef HFP_CASE
    default: TORCH_CHECK(false, "hf_paged_cpu.paged_attention_quant: float32, bfloat16 or float16 queries, got ",
                         query.scalar_type());
  }
  return out;
}

// Test hook: codes [N, bytes] with scales [N, S] (row formats) or [2, D] (KIVI keys) -> fp32 [N, D].
at::Tensor dequantize_rows(const at::Tensor& codes, const at::Tensor& scales, int64_t format, int64_t head_dim,
                           bool simd) {
  check_side("rows", codes.view({1, 1, codes.size(0), codes.size(1)}),
             format == hfp_codec::kKiviKey ? scales.view({1, 1, 2, scales.size(-1)})
                                           : scales.view({1, 1, scales.size(0), scales.size(1)}),
             format, head_dim);
  at::Tensor out = at::empty({codes.size(0), head_dim}, codes.options().dtype(at::kFloat));
  const RowFn row = hfp_codec::row_function(format, simd);
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  const int64_t scale_row = format == hfp_codec::kKiviKey ? 0 : scales.size(1);
  for (int64_t r = 0; r < codes.size(0); ++r)
    row(c + r * codes.size(1), s + r * scale_row, scales.size(-1), head_dim, out.data_ptr<float>() + r * head_dim);
  return out;
}

// Test hook: rows x [N, D] fp32 through rotate_row (x R, or x R^T where transposed) as the kernel rotates
// queries and outputs -> (the rotated rows, whether R was taken for the Sylvester-Hadamard matrix).
std::tuple<at::Tensor, bool> rotate_rows(const at::Tensor& x, const at::Tensor& rotation, bool transposed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && rotation.scalar_type() == at::kFloat &&
              rotation.dim() == 2 && rotation.size(0) == x.size(1) && rotation.size(1) == x.size(1),
              "rotate_rows: fp32 x [N, D] and R [D, D], got ", x.sizes(), " and ", rotation.sizes());
  const at::Tensor r = rotation.contiguous();
  at::Tensor out = x.contiguous().clone();
  const int64_t d = x.size(1);
  const bool hadamard = hfp_codec::is_hadamard(r.data_ptr<float>(), d);
  std::vector<float> tmp(d);
  for (int64_t i = 0; i < x.size(0); ++i)
    hfp_cpu::rotate_row(out.data_ptr<float>() + i * d, r.data_ptr<float>(), d, transposed, tmp.data(), hadamard);
  return {out, hadamard};
}

// SIMD lanes of the build's codec (16 AVX-512, 8 AVX2, 1 scalar): what -march=native chose on this CPU.
int64_t codec_lanes() {
#ifdef HFP_CODEC_SIMD
  return hfp_codec::kLanes;
#else
  return 1;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_paged_cpu, m) {
  m.def("paged_attention_quant(Tensor query, Tensor k_codes, Tensor k_scales, Tensor v_codes, Tensor v_scales, "
        "Tensor block_tables, Tensor token_row, Tensor token_pos, float scale, int window, int k_format, "
        "int v_format, Tensor[]? k_kivi=None, Tensor[]? v_kivi=None, Tensor? rotation=None, bool rotate_query=True) -> Tensor");
  m.def("dequantize_rows(Tensor codes, Tensor scales, int format, int head_dim, bool simd) -> Tensor");
  m.def("codec_lanes() -> int", &codec_lanes);       // no tensor argument: a catch-all kernel
  m.def("rotate_rows(Tensor x, Tensor rotation, bool transposed) -> (Tensor, bool)");
}

TORCH_LIBRARY_IMPL(hf_paged_cpu, CPU, m) {
  m.impl("paged_attention_quant", &paged_attention_quant);
  m.impl("dequantize_rows", &dequantize_rows);
  m.impl("rotate_rows", &rotate_rows);
}
