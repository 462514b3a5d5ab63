// Paged attention on the CPU: every query token reads its sequence's K/V in place through the block
// table (no gathered copy of the context), all query heads of one KV head together (GQA: each K/V
// row is loaded once per group), with an online softmax over one block at a time.
//
// Built at run time by hf_paged/backends/cpu_backend.py through torch's extension loader
// (-O3 -march=<this CPU>), registered as torch.ops.hf_paged_cpu.paged_attention. The PyTorch path
// (hf_paged/backends/torch_backend.py) is the reference it is tested against (tests/backends).
//
// Ragged layout, one entry per query token t (decode, prefill and packed steps alike):
//   query        [T, Hq, D]               f32 / bf16 / f16, the pools' dtype
//   k_pool/v_pool[Hkv, blocks, BS, D]     contiguous (torch_backend.py's pool layout)
//   block_tables int32 [R, W]             physical blocks of each sequence row
//   token_row    int32 [T]                the row of token t
//   token_pos    int32 [T]                stored index of token t, -1 = pad (its output is zeros)
// Token t sees the keys j of its row with j <= pos and, with window w > 0, pos - j < w.
// Scores, the softmax and the accumulators are float32 whatever the storage dtype.
// The loop itself is paged_attention_cpu.h (shared with the quantised op, paged_attention_cpu_quant.cpp).
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <type_traits>

#include "paged_attention_cpu.h"

namespace {

using namespace hfp_cpu;

// Model-dtype pools: a (head, block) tile is contiguous [block_size, D]; f32 tiles are read in place.
template <typename T>
struct PlainTiles {
  const T *k, *v;
  int64_t num_blocks, tile, head_dim;
  const float* keys(int64_t h, int64_t block, int64_t rows, float* buffer, bool) const {
    return float_tile(k + (h * num_blocks + block) * tile, buffer, rows * head_dim);
  }
  const float* values(int64_t h, int64_t block, int64_t rows, float* buffer, bool) const {
    return float_tile(v + (h * num_blocks + block) * tile, buffer, rows * head_dim);
  }
  const float* rotation() const { return nullptr; }
  bool rotates_query() const { return false; }
  bool hadamard() const { return false; }
  static constexpr bool kConverts = false;       // f32 read in place; 16-bit converted per item, as before
  static constexpr bool kBf16Keys = std::is_same_v<T, c10::BFloat16>;
  const uint16_t* key_bits(int64_t h, int64_t block) const {
    return reinterpret_cast<const uint16_t*>(k + (h * num_blocks + block) * tile);
  }
};

template <typename T>
void run(const at::Tensor& query, const at::Tensor& k_pool, const at::Tensor& v_pool, const Geometry& g,
         at::Tensor& out) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {      // decode steps by VDPBF16PS where built for it
    if (attend_decode_bf16(g, k_pool.data_ptr<T>(), v_pool.data_ptr<T>(), query.data_ptr<T>(), out.data_ptr<T>()))
      return;
  }
  const int64_t tile = g.block_size * g.head_dim;
  const PlainTiles<T> tiles{k_pool.data_ptr<T>(), v_pool.data_ptr<T>(), g.num_blocks, tile, g.head_dim};
  attend<T>(g, tiles, query.data_ptr<T>(), out.data_ptr<T>());
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& block_tables, const at::Tensor& token_row,
                           const at::Tensor& token_pos, double scale, int64_t window) {
  TORCH_CHECK(query.device().is_cpu() && k_pool.device().is_cpu() && v_pool.device().is_cpu(),
              "hf_paged_cpu.paged_attention: CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes(),
              "query must be [T, Hq, D] and the pools [Hkv, blocks, block_size, D] alike, got query ",
              query.sizes(), ", k_pool ", k_pool.sizes(), ", v_pool ", v_pool.sizes());
  TORCH_CHECK(query.scalar_type() == k_pool.scalar_type() && k_pool.scalar_type() == v_pool.scalar_type(),
              "query and pools must share one dtype, got ", query.scalar_type(), ", ", k_pool.scalar_type(),
              ", ", v_pool.scalar_type());
  TORCH_CHECK(query.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous(),
              "query and pools must be contiguous");
  check_step(query, k_pool.size(0), k_pool.size(3), block_tables, token_row, token_pos);
  const Geometry g = geometry(query, k_pool.size(0), k_pool.size(1), k_pool.size(2), block_tables, token_row,
                              token_pos, scale, window);
  at::Tensor out = at::empty(query.sizes(), query.options());
  switch (query.scalar_type()) {
    case at::kFloat: run<float>(query, k_pool, v_pool, g, out); break;
    case at::kBFloat16: run<c10::BFloat16>(query, k_pool, v_pool, g, out); break;
    case at::kHalf: run<c10::Half>(query, k_pool, v_pool, g, out); break;
    default: TORCH_CHECK(false, "hf_paged_cpu.paged_attention: float32, bfloat16 or float16, got ", query.scalar_type());
  }
  return out;
}

}  // namespace

// The quantised op's schema and implementation: paged_attention_cpu_quant.cpp (a second source of the
// same extension, TORCH_LIBRARY_FRAGMENT).
TORCH_LIBRARY(hf_paged_cpu, m) {
  m.def("paged_attention(Tensor query, Tensor k_pool, Tensor v_pool, Tensor block_tables, Tensor token_row, "
        "Tensor token_pos, float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(hf_paged_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
