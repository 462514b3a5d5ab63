// Checks the float32 linear micro-kernel of cuda/linear_cpu_micro.h, built for one ISA, against the sequential
// fused multiply-add the kernel promises on every CPU (linear_cpu.cpp's summation-order invariant): for every
// row count 1..kRows, every prefetch mode, full and partial column slices, with and without bias, each output
// bit for bit equal to  acc = 0; for k in 0..K-1: acc = fma(x[t, k], w[n, k], acc); out = acc + bias[n].
// Torch-free, so that tests/engine/test_linear_micro_isa.py builds it for AVX-512, AVX2, plain x86-64 and
// aarch64 (NEON; run under qemu-user) alike. Prints "ok lanes=L rows=R vecs=V compute=RxV" and exits 0, else says what
// differed and exits 1. Build with -ffp-contract=off, as the extension is (cpu_ops.py).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "linear_cpu_micro.h"

using namespace hfp_linear;

namespace {

int failures = 0;

// `micros`: one micro-kernel per row count 1..rows_max, each writing `vecs` vectors per row of a column slice.
template <typename Table>
void check(const Table& micros, const char* mode, int rows_max, int vecs, int64_t K, std::mt19937& gen) {
  std::normal_distribution<float> normal(0.f, 1.f);
  const int64_t ldx = K + 3, slice = vecs * kLanes, slices = kPanel / slice;
  std::vector<float> x(rows_max * ldx), w(K * kPanel), next(K * kPanel), bias(kPanel);
  for (float& v : x) v = normal(gen);
  for (float& v : w) v = normal(gen);
  for (float& v : bias) v = normal(gen);
  for (int rows = 1; rows <= rows_max; ++rows)
    for (int64_t width : {slice, slice - 5})
      for (bool with_bias : {false, true})
        for (int64_t s = 0; s < slices; ++s) {
          std::vector<float> out(rows_max * kPanel, -7.f);
          const float* b = with_bias ? bias.data() + s * slice : nullptr;
          micros[rows - 1](x.data(), ldx, K, w.data() + s * slice, out.data() + s * slice, kPanel, width, b,
                           next.data(), K * 2 / 3, s == 0);
          for (int r = 0; r < rows; ++r)
            for (int64_t c = 0; c < slice; ++c) {
              const int64_t col = s * slice + c;
              float want = -7.f;                          // columns past `width` are left as they were
              if (c < width) {
                float acc = 0.f;
                for (int64_t k = 0; k < K; ++k) acc = std::fma(x[r * ldx + k], w[k * kPanel + col], acc);
                want = with_bias ? acc + bias[col] : acc;
              }
              const float got = out[r * kPanel + col];
              if (std::memcmp(&got, &want, sizeof got) != 0 && failures++ < 5)
                std::printf("%s K=%lld rows=%d width=%lld bias=%d slice=%lld: out[%d][%lld] = %.9g, want %.9g\n",
                            mode, static_cast<long long>(K), rows, static_cast<long long>(width), with_bias,
                            static_cast<long long>(s), r, static_cast<long long>(col), got, want);
            }
        }
}

}  // namespace

int main() {
  std::mt19937 gen(7);
  for (int64_t K : {1, 2, 17, 64, 129}) {
    check(kMicroSingle, "single", kRows, kVecs, K, gen);
    check(kMicroShared, "shared", kRows, kVecs, K, gen);
    check(kMicroCompute, "compute", kComputeRows, kComputeVecs, K, gen);
  }
  if (failures) {
    std::printf("%d outputs differ from the sequential fma\n", failures);
    return 1;
  }
  std::printf("ok lanes=%d rows=%d vecs=%d compute=%dx%d\n", kLanes, kRows, kVecs, kComputeRows, kComputeVecs);
  return 0;
}
