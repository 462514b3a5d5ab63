// Helpers of the CPU paged-attention loop (paged_attention_cpu.h): the query/output rotation of quantised
// pools and the per-thread cache of dequantised tiles.
#pragma once

#include <algorithm>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "kv_codec_cpu.h"     // hadamard_row

namespace hfp_cpu {

// x[0:D] <- x R (transposed: x R^T) for fp32 R [D, D] row-major, through `tmp` [D]; `hadamard`: R passed
// is_hadamard.
inline void rotate_row(float* x, const float* r, int64_t d, bool transposed, float* tmp, bool hadamard) {
  if (hadamard) return hfp_codec::hadamard_row(x, d, r[0]);
  if (transposed) {
    for (int64_t j = 0; j < d; ++j) {
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < d; ++i) sum += x[i] * r[j * d + i];
      tmp[j] = sum;
    }
  } else {
    std::fill(tmp, tmp + d, 0.f);
    for (int64_t i = 0; i < d; ++i) {
      const float xi = x[i];
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) tmp[j] += xi * r[i * d + j];
    }
  }
  std::copy(tmp, tmp + d, x);
}

// Float tiles one thread has made in this call, kept so that the chunks of one prefill row (consecutive work
// items of one thread, head-major) dequantise each block once instead of once per chunk. Valid for the whole
// call: the pools do not change during it. Bounded by kMaxTiles; trimmed only between work items, so a
// pointer it returned stays valid for the rest of that item.
class TileCache {
 public:
  explicit TileCache(int64_t tile_floats) : tile_floats_(tile_floats) {}
  void trim() {
    if (static_cast<int64_t>(tiles_.size()) >= kMaxTiles) index_.clear(), tiles_.clear();
  }
  // Rows [0, rows) of tile `id`; fill(from, to, dst) makes the rows not made yet.
  template <typename Fill>
  const float* get(int64_t id, int64_t rows, int64_t head_dim, Fill&& fill) {
    auto it = index_.find(id);
    if (it == index_.end()) {
      tiles_.emplace_back(tile_floats_);
      it = index_.emplace(id, Entry{static_cast<int64_t>(tiles_.size()) - 1, 0}).first;
    }
    Entry& e = it->second;
    float* data = tiles_[e.index].data();
    if (e.rows < rows) {
      fill(e.rows, rows, data + e.rows * head_dim);
      e.rows = rows;
    }
    return data;
  }

 private:
  static constexpr int64_t kMaxTiles = 2048;          // 2048 x 16 x 64 floats = 8 MiB at block 16, d64
  struct Entry {
    int64_t index, rows;
  };
  int64_t tile_floats_;
  std::unordered_map<int64_t, Entry> index_;
  std::vector<std::vector<float>> tiles_;            // inner buffers never move when the outer one grows
};

}  // namespace hfp_cpu
