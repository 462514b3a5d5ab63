// Cache writes and copy-on-write block copies (pool layout: hf_paged/torch_attention.py).
#include "common.cuh"

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

// grid (P, num_pools), 128 threads: block dst = block src, every head, for pair blockIdx.x of pool
// blockIdx.y, in 16-byte words. Every pool has the same shape in bytes; destinations are distinct and
// never sources (copy-on-write targets are fresh blocks), so blocks of one launch never overlap.
extern "C" __global__ void __launch_bounds__(hfp::kThreads) hfp_copy_blocks(
    const unsigned long long* __restrict__ pools,  // [num_pools] addresses of [Hkv, num_blocks, BS, D] pools
    const long long* __restrict__ pairs,           // [P, 2] (src, dst) block ids
    int num_heads,                                 // Hkv
    long long head_words,                          // 16-byte words per head (num_blocks tiles)
    long long block_words) {                       // 16-byte words per (head, block) tile
    uint4* pool = reinterpret_cast<uint4*>(pools[blockIdx.y]);
    const long long src = pairs[2 * (long long)blockIdx.x] * block_words;
    const long long dst = pairs[2 * (long long)blockIdx.x + 1] * block_words;
    for (long long i = threadIdx.x; i < num_heads * block_words; i += hfp::kThreads) {
        const long long h = i / block_words;
        const long long w = i - h * block_words;
        pool[h * head_words + dst + w] = pool[h * head_words + src + w];
    }
}
HFP_EXPORT_LAUNCHER(hfp_copy_blocks)
