// Cache writes and copy-on-write block copies (pool layout: hf_paged/backends/torch_backend.py; quantised
// pools: hf_paged/kv_formats.py and kv_quant.cuh).
#include "common.cuh"
#include "kv_quant.cuh"

namespace hfp {

// grid (N), 128 threads: token n's [Hkv, D] keys/values into pool slot slot_mapping[n] (-1: skip).
template <typename T>
__device__ __forceinline__ void write_kv_kernel(
    T* __restrict__ k_pool,                 // [Hkv, num_blocks * BS, D] (contiguous)
    T* __restrict__ v_pool,                 // [Hkv, num_blocks * BS, D] (contiguous)
    const T* __restrict__ key,              // [N, Hkv, D], strides below, unit stride over D
    const T* __restrict__ value,            // [N, Hkv, D], strides below, unit stride over D
    const long long* __restrict__ slot_mapping,  // [N]
    long long head_stride,                  // num_blocks * BS * D: elements per KV head of a pool
    int num_kv_heads, int head_dim,
    long long key_token_stride, long long key_head_stride,
    long long value_token_stride, long long value_head_stride) {
    const long long n = blockIdx.x;
    const long long slot = slot_mapping[n];
    if (slot < 0) return;  // whole block exits together; no barrier follows
    for (int i = threadIdx.x; i < num_kv_heads * head_dim; i += kThreads) {
        const int h = i / head_dim;
        const int d = i - h * head_dim;
        const long long dst = h * head_stride + slot * head_dim + d;
        k_pool[dst] = key[n * key_token_stride + h * key_head_stride + d];
        v_pool[dst] = value[n * value_token_stride + h * value_head_stride + d];
    }
}

}  // namespace hfp

#define HFP_WRITE_KV_ENTRY(TN)                                                                \
    extern "C" __global__ void __launch_bounds__(hfp::kThreads) hfp_write_kv_##TN(            \
        HFP_T(TN)* k_pool, HFP_T(TN)* v_pool, const HFP_T(TN)* key, const HFP_T(TN)* value,   \
        const long long* slot_mapping, long long head_stride, int num_kv_heads, int head_dim, \
        long long key_token_stride, long long key_head_stride,                                \
        long long value_token_stride, long long value_head_stride) {                          \
        hfp::write_kv_kernel<HFP_T(TN)>(k_pool, v_pool, key, value, slot_mapping, head_stride, \
            num_kv_heads, head_dim, key_token_stride, key_head_stride, value_token_stride,    \
            value_head_stride);                                                               \
    }                                                                                         \
    HFP_EXPORT_LAUNCHER(hfp_write_kv_##TN)

HFP_WRITE_KV_ENTRY(f16)
HFP_WRITE_KV_ENTRY(bf16)
HFP_WRITE_KV_ENTRY(f32)

namespace hfp {

// Quantise token n's keys (or values) [Hkv, D] into slot `slot` of a quantised pool, 8-bit formats:
// one warp per head (a warp-uniform loop, so the reduction's shuffles always see the full warp), the
// scale from the head's largest magnitude (fp8: searched from it, kv_quant.cuh searched_scale).
template <typename T, int F>
__device__ __forceinline__ void quantise_token_8bit(
    unsigned char* __restrict__ codes,      // [Hkv, num_blocks * BS, D]
    __nv_bfloat16* __restrict__ scales,     // [Hkv, num_blocks * BS, 1]
    const T* __restrict__ x,                // token n's [Hkv, D], head stride below, unit stride over D
    long long x_head_stride, long long slot, long long head_slots, int num_kv_heads, int head_dim) {
    using Fmt = KvFormat<F>;
    const int lane = threadIdx.x & 31;
    for (int h = threadIdx.x >> 5; h < num_kv_heads; h += kWarps) {
        const T* row = x + h * x_head_stride;
        float amax = 0.f;
        for (int d = lane; d < head_dim; d += 32) amax = fmaxf(amax, fabsf(to_float(row[d])));
        amax = warp_max(amax);
        __nv_bfloat16 scale;
        if constexpr (Fmt::kScaleSearch) {
            scale = searched_scale<F>(row, head_dim, lane, amax);
        } else {
            scale = stored_scale(amax / Fmt::kCodeMax);
        }
        const float s = __bfloat162float(scale);
        const long long r = h * head_slots + slot;      // (head, slot) row of the pool
        for (int d = lane; d < head_dim; d += 32) {
            codes[r * head_dim + d] = (unsigned char)Fmt::encode(to_float(row[d]) / s);
        }
        if (lane == 0) scales[r] = scale;
    }
}

// The same for int4: one thread per (head, group of 16), asymmetric: the scale spans the group's range
// and the bf16-rounded minimum is the offset. Groups write 8 code bytes with one 8-byte store.
template <typename T>
__device__ __forceinline__ void quantise_token_int4(
    unsigned char* __restrict__ codes,      // [Hkv, num_blocks * BS, D / 2]
    __nv_bfloat16* __restrict__ scales,     // [Hkv, num_blocks * BS, 2 * D / 16]
    const T* __restrict__ x, long long x_head_stride, long long slot, long long head_slots,
    int num_kv_heads, int head_dim) {
    using Fmt = KvFormat<HFP_KV_INT4>;
    constexpr int kGroup = Fmt::kGroup;
    const int groups = head_dim / kGroup;
    for (int i = threadIdx.x; i < num_kv_heads * groups; i += kThreads) {
        const int h = i / groups;
        const int g = i - h * groups;
        const T* src = x + h * x_head_stride + g * kGroup;
        float v[kGroup];
        float lo = to_float(src[0]);
        float hi = lo;
        for (int k = 0; k < kGroup; ++k) {
            v[k] = to_float(src[k]);
            lo = fminf(lo, v[k]);
            hi = fmaxf(hi, v[k]);
        }
        const __nv_bfloat16 scale = stored_scale((hi - lo) / Fmt::kCodeMax);
        const __nv_bfloat16 low = __float2bfloat16_rn(lo);
        const float s = __bfloat162float(scale);
        const float m = __bfloat162float(low);
        unsigned word[2] = {0u, 0u};            // 16 codes, element 2k in the low nibble of byte k
        for (int k = 0; k < kGroup; ++k) {
            word[k >> 3] |= Fmt::encode((v[k] - m) / s) << (4 * (k & 7));
        }
        const long long r = h * head_slots + slot;
        reinterpret_cast<uint2*>(codes + r * (head_dim / 2))[g] = make_uint2(word[0], word[1]);
        scales[r * 2 * groups + g] = scale;
        scales[r * 2 * groups + groups + g] = low;
    }
}

template <typename T, int F>
__device__ __forceinline__ void quantise_token(unsigned char* codes, __nv_bfloat16* scales, const T* x,
                                               long long x_head_stride, long long slot, long long head_slots,
                                               int num_kv_heads, int head_dim) {
    if constexpr (F == HFP_KV_INT4) {
        quantise_token_int4<T>(codes, scales, x, x_head_stride, slot, head_slots, num_kv_heads, head_dim);
    } else {
        quantise_token_8bit<T, F>(codes, scales, x, x_head_stride, slot, head_slots, num_kv_heads, head_dim);
    }
}

// grid (N), 128 threads: token n's [Hkv, D] keys and values quantised into slot slot_mapping[n] (-1:
// skip) of quantised pools (codes + scales, layout: kv_quant.cuh). Input in its own dtype T: the scales
// come from the values as the model made them, as kv_formats.quantize(x) computes them.
template <typename T, int F>
__device__ __forceinline__ void write_kv_quant_kernel(
    unsigned char* __restrict__ k_codes, __nv_bfloat16* __restrict__ k_scales,
    unsigned char* __restrict__ v_codes, __nv_bfloat16* __restrict__ v_scales,
    const T* __restrict__ key, const T* __restrict__ value,    // [N, Hkv, D], unit stride over D
    const long long* __restrict__ slot_mapping,                 // [N]
    long long head_slots,                                       // num_blocks * BS: slots per KV head
    int num_kv_heads, int head_dim,
    long long key_token_stride, long long key_head_stride,
    long long value_token_stride, long long value_head_stride) {
    const long long n = blockIdx.x;
    const long long slot = slot_mapping[n];
    if (slot < 0) return;  // whole block exits together; no barrier follows
    quantise_token<T, F>(k_codes, k_scales, key + n * key_token_stride, key_head_stride, slot, head_slots,
                         num_kv_heads, head_dim);
    quantise_token<T, F>(v_codes, v_scales, value + n * value_token_stride, value_head_stride, slot, head_slots,
                         num_kv_heads, head_dim);
}

// grid (P, num_pools), 128 threads: block dst = block src, every head, for pair blockIdx.x of pool
// blockIdx.y, in words of W (16, 4 or 1 bytes: the largest dividing the tile and every pool's
// address, chosen by the host). Every pool of one launch has the same shape in bytes; destinations are
// distinct and never sources (copy-on-write targets are fresh blocks), so blocks of one launch never overlap.
template <typename W>
__device__ __forceinline__ void copy_blocks_kernel(
    const unsigned long long* __restrict__ pools,  // [num_pools] addresses of [Hkv, num_blocks, ...] pools
    const long long* __restrict__ pairs,           // [P, 2] (src, dst) block ids
    int num_heads,                                 // Hkv
    long long head_words,                          // words per head (num_blocks tiles)
    long long block_words) {                       // words per (head, block) tile
    W* pool = reinterpret_cast<W*>(pools[blockIdx.y]);
    const long long src = pairs[2 * (long long)blockIdx.x] * block_words;
    const long long dst = pairs[2 * (long long)blockIdx.x + 1] * block_words;
    for (long long i = threadIdx.x; i < num_heads * block_words; i += kThreads) {
        const long long h = i / block_words;
        const long long w = i - h * block_words;
        pool[h * head_words + dst + w] = pool[h * head_words + src + w];
    }
}

}  // namespace hfp

#define HFP_WRITE_KV_QUANT_ENTRY(FN, F, TN)                                                   \
    extern "C" __global__ void __launch_bounds__(hfp::kThreads) hfp_write_kv_##FN##_##TN(     \
        unsigned char* k_codes, hfp_bf16* k_scales, unsigned char* v_codes, hfp_bf16* v_scales, \
        const HFP_T(TN)* key, const HFP_T(TN)* value, const long long* slot_mapping,          \
        long long head_slots, int num_kv_heads, int head_dim,                                 \
        long long key_token_stride, long long key_head_stride,                                \
        long long value_token_stride, long long value_head_stride) {                          \
        hfp::write_kv_quant_kernel<HFP_T(TN), F>(k_codes, k_scales, v_codes, v_scales, key,   \
            value, slot_mapping, head_slots, num_kv_heads, head_dim, key_token_stride,        \
            key_head_stride, value_token_stride, value_head_stride);                          \
    }                                                                                         \
    HFP_EXPORT_LAUNCHER(hfp_write_kv_##FN##_##TN)

#define HFP_WRITE_KV_QUANT_ENTRIES(FN, F)                                                     \
    HFP_WRITE_KV_QUANT_ENTRY(FN, F, f16) HFP_WRITE_KV_QUANT_ENTRY(FN, F, bf16)                \
    HFP_WRITE_KV_QUANT_ENTRY(FN, F, f32)

// Kernel-name tags of the formats (hf_paged/backends/kernel_registry.py KV_FORMAT_TAGS).
HFP_WRITE_KV_QUANT_ENTRIES(fp8e4m3, HFP_KV_FP8E4M3)
HFP_WRITE_KV_QUANT_ENTRIES(fp8e5m2, HFP_KV_FP8E5M2)
HFP_WRITE_KV_QUANT_ENTRIES(int8, HFP_KV_INT8)
HFP_WRITE_KV_QUANT_ENTRIES(int4, HFP_KV_INT4)

#define HFP_COPY_BLOCKS_ENTRY(NAME, W)                                                        \
    extern "C" __global__ void __launch_bounds__(hfp::kThreads) NAME(                         \
        const unsigned long long* pools, const long long* pairs, int num_heads,               \
        long long head_words, long long block_words) {                                        \
        hfp::copy_blocks_kernel<W>(pools, pairs, num_heads, head_words, block_words);         \
    }                                                                                         \
    HFP_EXPORT_LAUNCHER(NAME)

// 16-byte words for every model-dtype pool and, with block sizes 8/16/32, every codes and scales pool;
// 4- and 1-byte words for other geometries (e.g. a scales tile of BS * 2 bytes with BS = 2).
HFP_COPY_BLOCKS_ENTRY(hfp_copy_blocks, uint4)
HFP_COPY_BLOCKS_ENTRY(hfp_copy_blocks_w4, unsigned)
HFP_COPY_BLOCKS_ENTRY(hfp_copy_blocks_w1, unsigned char)
