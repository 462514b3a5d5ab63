// One decoder layer of an engine step in one call: the ops that LeanLayer._direct (hf_paged/engine/fused_lean.py)
// calls, on the same tensors in the same order (so the same numbers, bit for bit), through the dispatcher
// instead of from Python (SmolLM2-135M, 2 threads: the short workload 1.03x in bf16, 1.01x in fp32, README's
// "One call per layer"). Registered as torch.ops.hf_paged_fused.lean_layer (model-dtype pools: write_kv and
// paged_attention), lean_layer_quant (quantised row formats: write_kv_quant and paged_attention_quant, the calls
// CpuKernelBackend.write_kv and CpuStep.attend make for such pools) and lean_layer_kivi (KIVI pools: kivi_write_kv and
// paged_attention_quant, see below) in the fused-ops extension (hf_paged/engine/cpu_ops.py); for the CPU kernel's
// steps only.
//
//   hidden       [N, H] rows (contiguous last dim), the layer's input
//   norms        input, post-attention, then (qk_norm) q_norm, k_norm, then (sandwich) GLM-4's post-attention and
//                post-MLP norms: RMSNorm weights, with their eps in the same order
//   weights      the packed products of (q, k, v), o, (gate, up), down (prepack._Packed.packed), with biases and
//                output widths; kernel_linear: hf_paged_fused.linear (float32; bf16 where prepack.kernel_takes), else
//                oneDNN's _linear_pointwise
//   qkv_heads    heads of q, k and v in the qkv product; cos / sin [N, R] (fused_lean.rotary_rows)
//   k_pool ...   the step's pools and metadata as CpuStep.write_direct / attend_direct pass them
//   k_codes ...  (lean_layer_quant) the quantised pools' codes and scales, their formats (cpu_backend.FORMAT_IDS) and
//                R (or None), as CpuStep.quant_metadata passes them: keys and values stored rotated by R, the query
//                rotated and the output unrotated by the attention op
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// The ops the layer calls, looked up once per process (they live in this extension and in the CPU kernel's
// extension hf_paged_cpu, loaded before any CPU-kernel step).
struct LayerOps {
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, double)> rms_norm;
  c10::TypedOperatorHandle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double)> add_rms_norm;
  c10::TypedOperatorHandle<void(Tensor, Tensor, const Tensor&, const Tensor&, bool)> rotary;
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&)> silu_mul;
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const OptTensor&, int64_t)> linear;
  c10::TypedOperatorHandle<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&)> write_kv;
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                  const Tensor&, double, int64_t)> attention;
};

// The quantised pools' write and attention (the CPU kernel's extension, cuda/kv_write_cpu.cpp and
// cuda/paged_attention_cpu_quant.cpp).
struct QuantOps {
  c10::TypedOperatorHandle<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                const Tensor&, int64_t, int64_t, const OptTensor&)> write_kv;
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                  const Tensor&, const Tensor&, const Tensor&, double, int64_t, int64_t, int64_t,
                                  std::optional<at::TensorList>, std::optional<at::TensorList>, const OptTensor&, bool)>
      attention;
  // KIVI's write of a layer's keys and values (cuda/kivi_write_cpu.cpp): -> the fresh rows of each pool
  c10::TypedOperatorHandle<std::tuple<Tensor, Tensor>(
      const Tensor&, const Tensor&, const OptTensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
      const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
      const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&)>
      kivi_write;
};

template <typename Sig>
c10::TypedOperatorHandle<Sig> find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

const LayerOps& layer_ops() {
  static const LayerOps ops{
      find<Tensor(const Tensor&, const Tensor&, double)>("hf_paged_fused::rms_norm"),
      find<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double)>("hf_paged_fused::add_rms_norm"),
      find<void(Tensor, Tensor, const Tensor&, const Tensor&, bool)>("hf_paged_fused::rotary_"),
      find<Tensor(const Tensor&, const Tensor&)>("hf_paged_fused::silu_mul"),
      find<Tensor(const Tensor&, const Tensor&, const OptTensor&, int64_t)>("hf_paged_fused::linear"),
      find<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&)>("hf_paged_cpu::write_kv"),
      find<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, double,
                  int64_t)>("hf_paged_cpu::paged_attention")};
  return ops;
}

const QuantOps& quant_ops() {
  static const QuantOps ops{
      find<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                int64_t, int64_t, const OptTensor&)>("hf_paged_cpu::write_kv_quant"),
      find<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                  const Tensor&, const Tensor&, double, int64_t, int64_t, int64_t, std::optional<at::TensorList>,
                  std::optional<at::TensorList>, const OptTensor&, bool)>("hf_paged_cpu::paged_attention_quant"),
      find<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const OptTensor&, const Tensor&, const Tensor&,
                                      const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                      const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                      const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                      const Tensor&)>("hf_paged_cpu::kivi_write_kv")};
  return ops;
}

// prepack._Packed.product: rows x [M, K] -> [M, n].
Tensor product(const LayerOps& ops, bool kernel, const Tensor& x, const Tensor& packed, const OptTensor& bias,
               int64_t n) {
  if (kernel) return ops.linear.call(x.stride(-1) == 1 ? x : x.contiguous(), packed, bias, n);
  // oneDNN's op (looked up on first use: float32 layers never need it), boxed: its C++ signature is torch's own
  // and has changed between releases. Arguments (X, W, B, attr, scalars, algorithm) as _Packed.product's.
  static const c10::OperatorHandle onednn = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias, "none", c10::List<std::optional<c10::Scalar>>(), ""};
  onednn.callBoxed(stack);
  return stack[0].toTensor();
}

// The layer around its keys and values: `attend(query, key, value)` writes the step's keys and values into
// the pools and returns attention's output [N, Hq, D] (the one thing lean_layer and lean_layer_quant differ in).
template <typename Attend>
Tensor layer(const Tensor& hidden, at::TensorList norms, at::ArrayRef<double> eps, at::TensorList weights,
             const c10::List<OptTensor>& biases, at::IntArrayRef widths, at::IntArrayRef qkv_heads, int64_t head_dim,
             bool kernel_linear, bool qk_norm, bool sandwich, bool interleaved, const Tensor& cos, const Tensor& sin,
             const Attend& attend) {
  const int64_t want = 2 + 2 * qk_norm + 2 * sandwich;
  TORCH_CHECK(hidden.dim() == 2 && hidden.stride(1) == 1, "hidden must be [N, H] rows, got ", hidden.sizes());
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == want && static_cast<int64_t>(eps.size()) == want,
              "lean_layer: ", want, " norms and eps expected (qk_norm ", qk_norm, ", sandwich ", sandwich, "), got ",
              norms.size(), " and ", eps.size());
  TORCH_CHECK(weights.size() == 4 && biases.size() == 4 && widths.size() == 4 && qkv_heads.size() == 3,
              "lean_layer: the qkv, o, gate_up and down products (weights, biases, widths) and 3 qkv head counts");
  const LayerOps& ops = layer_ops();
  const int64_t n = hidden.size(0);
  auto linear = [&](const Tensor& x, int64_t i) { return product(ops, kernel_linear, x, weights[i], biases.get(i), widths[i]); };

  const Tensor qkv = linear(ops.rms_norm.call(hidden, norms[0], eps[0]), 0);
  std::vector<Tensor> parts = qkv.view({n, -1, head_dim}).split_with_sizes(qkv_heads, 1);
  Tensor query = parts[0], key = parts[1];
  const Tensor& value = parts[2];
  if (qk_norm) {
    query = ops.rms_norm.call(query.reshape({-1, head_dim}), norms[2], eps[2]).view({n, -1, head_dim});
    key = ops.rms_norm.call(key.reshape({-1, head_dim}), norms[3], eps[3]).view({n, -1, head_dim});
  }
  ops.rotary.call(query, key, cos, sin, interleaved);
  Tensor out = linear(attend(query.contiguous(), key, value).view({n, -1}), 1);
  const int64_t s = 2 + 2 * qk_norm;         // the sandwich norms' index
  if (sandwich) out = ops.rms_norm.call(out, norms[s], eps[s]);
  auto [total, normed] = ops.add_rms_norm.call(out, hidden, norms[1], eps[1]);
  const Tensor gate_up = linear(normed, 2);
  const int64_t half = gate_up.size(-1) / 2;
  out = linear(ops.silu_mul.call(gate_up.slice(1, 0, half), gate_up.slice(1, half)), 3);
  if (sandwich) out = ops.rms_norm.call(out, norms[s + 1], eps[s + 1]);
  return total.add_(out);               // (total: add_rms_norm's own new tensor)
}

Tensor lean_layer(const Tensor& hidden, at::TensorList norms, at::ArrayRef<double> eps, at::TensorList weights,
                  const c10::List<OptTensor>& biases, at::IntArrayRef widths, at::IntArrayRef qkv_heads,
                  int64_t head_dim, bool kernel_linear, bool qk_norm, bool sandwich, bool interleaved,
                  const Tensor& cos, const Tensor& sin, const Tensor& k_pool, const Tensor& v_pool,
                  const Tensor& slot_mapping, const Tensor& block_tables, const Tensor& token_row,
                  const Tensor& token_pos, double scale, int64_t window) {
  const LayerOps& ops = layer_ops();
  return layer(hidden, norms, eps, weights, biases, widths, qkv_heads, head_dim, kernel_linear, qk_norm, sandwich,
               interleaved, cos, sin, [&](const Tensor& query, const Tensor& key, const Tensor& value) {
                 ops.write_kv.call(key, value, slot_mapping, k_pool, v_pool);
                 return ops.attention.call(query, k_pool, v_pool, block_tables, token_row, token_pos, scale, window);
               });
}

Tensor lean_layer_quant(const Tensor& hidden, at::TensorList norms, at::ArrayRef<double> eps, at::TensorList weights,
                        const c10::List<OptTensor>& biases, at::IntArrayRef widths, at::IntArrayRef qkv_heads,
                        int64_t head_dim, bool kernel_linear, bool qk_norm, bool sandwich, bool interleaved,
                        const Tensor& cos, const Tensor& sin, const Tensor& k_codes, const Tensor& k_scales,
                        const Tensor& v_codes, const Tensor& v_scales, int64_t k_format, int64_t v_format,
                        const OptTensor& rotation, const Tensor& slot_mapping, const Tensor& block_tables,
                        const Tensor& token_row, const Tensor& token_pos, double scale, int64_t window) {
  const QuantOps& ops = quant_ops();
  return layer(hidden, norms, eps, weights, biases, widths, qkv_heads, head_dim, kernel_linear, qk_norm, sandwich,
               interleaved, cos, sin, [&](const Tensor& query, const Tensor& key, const Tensor& value) {
                 ops.write_kv.call(key, value, slot_mapping, k_codes, k_scales, v_codes, v_scales, k_format, v_format,
                                   rotation);
                 return ops.attention.call(query, k_codes, k_scales, v_codes, v_scales, block_tables, token_row,
                                           token_pos, scale, window, k_format, v_format, std::nullopt, std::nullopt,
                                           rotation, true);
               });
}

// KIVI pools (hf_paged.kivi): the layer's write through kivi_write_kv, as kivi.write_kv makes it when one call
// does (kivi.one_call_args: the plan applied to the shared entries, the side stores fitted), then the attention
// as CpuStep.attend makes it for KIVI pools (keys unrotated, values stored x R: the output unrotated), with each
// pool's side rows [open, open_slot, fresh, fresh_slot, sink, sink_slot] where `fresh` is what the write just
// sealed. Returns (out, the key pool's fresh rows, the value pool's), for the caller to keep in the pools.
//   plan      kivi_write_kv's ten index tensors: src, dst, seal_blocks, seal_slots, seal_rows, seal_sink,
//             sink_rows, sink_entries, new_src, new_dst (kivi_plan.KiviStep.kv_args)
//   k_stores  the key pool's open rows, sink rows, codes and scales (written); v_stores: the value pool's
//   k_maps    the key pool's open_slot, fresh_slot, sink_slot maps; v_maps: the value pool's
//   k_format, v_format: KIVI keys' and values' format ids (cpu_backend.KIVI_KEY_ID / KIVI_VALUE_ID)
std::tuple<Tensor, Tensor, Tensor> lean_layer_kivi(
    const Tensor& hidden, at::TensorList norms, at::ArrayRef<double> eps, at::TensorList weights,
    const c10::List<OptTensor>& biases, at::IntArrayRef widths, at::IntArrayRef qkv_heads, int64_t head_dim,
    bool kernel_linear, bool qk_norm, bool sandwich, bool interleaved, const Tensor& cos, const Tensor& sin,
    const OptTensor& rotation, int64_t k_format, int64_t v_format, at::TensorList plan, at::TensorList k_stores,
    at::TensorList v_stores, at::TensorList k_maps, at::TensorList v_maps, const Tensor& block_tables,
    const Tensor& token_row, const Tensor& token_pos, double scale, int64_t window) {
  TORCH_CHECK(plan.size() == 10 && k_stores.size() == 4 && v_stores.size() == 4 && k_maps.size() == 3 &&
                  v_maps.size() == 3,
              "lean_layer_kivi: 10 plan tensors, 4 stores (open, sink, codes, scales) and 3 maps (open_slot, "
              "fresh_slot, sink_slot) per pool, got ", plan.size(), ", ", k_stores.size(), "/", v_stores.size(),
              " and ", k_maps.size(), "/", v_maps.size());
  const QuantOps& ops = quant_ops();
  Tensor k_fresh, v_fresh;
  Tensor out = layer(hidden, norms, eps, weights, biases, widths, qkv_heads, head_dim, kernel_linear, qk_norm,
                     sandwich, interleaved, cos, sin, [&](const Tensor& query, const Tensor& key, const Tensor& value) {
    std::tie(k_fresh, v_fresh) = ops.kivi_write.call(
        key, value, rotation, plan[0], plan[1], plan[2], plan[3], plan[4], plan[5], plan[6], plan[7], plan[8],
        plan[9], k_stores[0], k_stores[1], k_stores[2], k_stores[3], v_stores[0], v_stores[1], v_stores[2],
        v_stores[3]);
    const std::vector<Tensor> k_side{k_stores[0], k_maps[0], k_fresh, k_maps[1], k_stores[1], k_maps[2]};
    const std::vector<Tensor> v_side{v_stores[0], v_maps[0], v_fresh, v_maps[1], v_stores[1], v_maps[2]};
    return ops.attention.call(query, k_stores[2], k_stores[3], v_stores[2], v_stores[3], block_tables, token_row,
                              token_pos, scale, window, k_format, v_format, at::TensorList(k_side),
                              at::TensorList(v_side), rotation, false);
  });
  return {out, k_fresh, v_fresh};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_paged_fused, m) {
  m.def("lean_layer(Tensor hidden, Tensor[] norms, float[] eps, Tensor[] weights, Tensor?[] biases, int[] widths, "
        "int[] qkv_heads, int head_dim, bool kernel_linear, bool qk_norm, bool sandwich, bool interleaved, "
        "Tensor cos, Tensor sin, Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor slot_mapping, Tensor block_tables, "
        "Tensor token_row, Tensor token_pos, float scale, int window) -> Tensor");
  m.def("lean_layer_quant(Tensor hidden, Tensor[] norms, float[] eps, Tensor[] weights, Tensor?[] biases, int[] widths, "
        "int[] qkv_heads, int head_dim, bool kernel_linear, bool qk_norm, bool sandwich, bool interleaved, "
        "Tensor cos, Tensor sin, Tensor(a!) k_codes, Tensor(b!) k_scales, Tensor(c!) v_codes, Tensor(d!) v_scales, "
        "int k_format, int v_format, Tensor? rotation, Tensor slot_mapping, Tensor block_tables, Tensor token_row, "
        "Tensor token_pos, float scale, int window) -> Tensor");
  m.def("lean_layer_kivi(Tensor hidden, Tensor[] norms, float[] eps, Tensor[] weights, Tensor?[] biases, int[] widths, "
        "int[] qkv_heads, int head_dim, bool kernel_linear, bool qk_norm, bool sandwich, bool interleaved, "
        "Tensor cos, Tensor sin, Tensor? rotation, int k_format, int v_format, Tensor[] plan, Tensor(a!)[] k_stores, "
        "Tensor(b!)[] v_stores, Tensor[] k_maps, Tensor[] v_maps, Tensor block_tables, Tensor token_row, "
        "Tensor token_pos, float scale, int window) -> (Tensor, Tensor, Tensor)");
}

// bf16 layers pass oneDNN's packed weights (MkldnnCPU tensors), which route the call by that key.
TORCH_LIBRARY_IMPL(hf_paged_fused, CPU, m) {
  m.impl("lean_layer", &lean_layer);
  m.impl("lean_layer_quant", &lean_layer_quant);
  m.impl("lean_layer_kivi", &lean_layer_kivi);
}
TORCH_LIBRARY_IMPL(hf_paged_fused, MkldnnCPU, m) {
  m.impl("lean_layer", &lean_layer);
  m.impl("lean_layer_quant", &lean_layer_quant);
  m.impl("lean_layer_kivi", &lean_layer_kivi);
}
