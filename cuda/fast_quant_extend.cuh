// Quantised-pool extend on tensor cores (issue 24 item 5), included by fast_attention.cu (it includes fast_quant.cuh).
//
// ragged_kernel's work items, rows, tiles and mma.sync / ldmatrix compute, over pools of format F: each K/V
// tile's codes and bf16 scales are staged by 16-byte cp.async, as the quantised decode stages them (runs of
// kRun = 8 stored tokens, whole 16-byte words for every format and head dim, so a tile starts on a run and
// keys before the split's first key `beg` are masked), into a double-buffered raw ring; then one pass
// dequantises the tile into the T tiles [kKeys][D + 8] that ldmatrix reads (shared memory to registers to
// shared memory, lane_values: KvFormat<F>::decode, x scale, rounded once to T as kv_formats.dequantize).
//
// Why a shared-memory pass and not fragments built in registers: each element is then dequantised once
// per CTA, for all 4 warps (64 query rows), where register fragments would decode it once per warp; V's
// fragments run along keys (two tokens per register), which would need per-element byte gathers and two
// 8-bit scales per register; and the mma/ldmatrix loop stays the model-dtype kernel's, bit for bit (the
// tiles equal the dequantised pool in T, so the output equals hfp_ragged_<T> over that pool). The cost:
// the pass itself, two barriers per tile (the model-dtype kernel has three), and T tiles beside the raw
// ring (85 KB at head dim 128: 2 CTAs per SM on sm_90). The next tile's copies are in flight during the whole dequantise + QK^T + PV of this one.
// Keys outside [beg, end) are written as zeros, so unwritten pool slots (NaN bits) never reach the mma.
#pragma once
#include "fast_quant.cuh"

namespace hfp {

template <int F, int D>
struct QuantRaggedShape {
    using R = RaggedShape<D>;
    static constexpr int kKeys = R::kKeys, kStride = R::kStride, kChunks = R::kChunks, kRows = R::kRows;
    static constexpr int kCodeBytes = KvLayout<F>::code_bytes(D);
    static constexpr int kScales = KvLayout<F>::num_scales(D);
    static constexpr int kRun = 8;
    static constexpr int kCodeCopies = kKeys * kCodeBytes / 16;      // per tile, K (V the same)
    static constexpr int kCopies = kCodeCopies + kKeys * kScales * 2 / 16;
    static constexpr int kPerThread = (kCopies + kThreads - 1) / kThreads;
    static constexpr int kRawBytes = kKeys * (kCodeBytes + 2 * kScales);   // K or V of one raw buffer
    static_assert(kRun * kCodeBytes % 16 == 0 && kRun * kScales * 2 % 16 == 0, "runs are whole 16-byte words");
    static_assert(kKeys % kRun == 0 && kRawBytes % 16 == 0, "tile shape");
};

// Dequantise raw tile `raw` (codes [kKeys][CB], then scales [kKeys][S]) into dst [kKeys][kStride] of T;
// key k is stored token first_key + k, zeros outside [beg, end). All threads; the caller synchronises.
template <int F, typename T, int D>
__device__ __forceinline__ void dequant_tile(T* dst, const unsigned char* raw, int first_key, int beg, int end) {
    using Q = QuantRaggedShape<F, D>;
    const __nv_bfloat16* scales = reinterpret_cast<const __nv_bfloat16*>(raw + Q::kKeys * Q::kCodeBytes);
    for (int i = threadIdx.x; i < Q::kKeys * Q::kChunks; i += kThreads) {
        const int key = i / Q::kChunks, c = i - key * Q::kChunks, j = first_key + key;
        uint4 w = make_uint4(0u, 0u, 0u, 0u);
        if (j >= beg && j < end) {
            float v[8], s = 1.f;
            lane_values<F, D>(raw, scales, key, c, v, &s);
            w = make_uint4(pack2(v[0] * s, v[1] * s, T()), pack2(v[2] * s, v[3] * s, T()),
                           pack2(v[4] * s, v[5] * s, T()), pack2(v[6] * s, v[7] * s, T()));
        }
        *reinterpret_cast<uint4*>(dst + key * Q::kStride + c * 8) = w;
    }
}

// cp.async of tile t's K then V raw codes and scales (one commit group each) into raw buffer `buf`;
// copy i < kCodeCopies is code word i % (kRun * CB / 16) of run i / (..), the rest scale words; runs
// from `end` on are zero-filled.
template <int F, int D>
__device__ __forceinline__ void stage_raw_tile(unsigned char* raw, const unsigned char* k_codes,
                                               const __nv_bfloat16* k_scales, const unsigned char* v_codes,
                                               const __nv_bfloat16* v_scales, const int* table, int block_shift,
                                               int first_key, int end) {
    using Q = QuantRaggedShape<F, D>;
    constexpr int kCB = Q::kCodeBytes, kS = Q::kScales;
    long long src[Q::kPerThread];   // byte offset (codes) or element offset (scales) in the head, -1 = zeros
    int dst[Q::kPerThread];         // byte offset in the buffer's K (or V) part
#pragma unroll
    for (int k = 0; k < Q::kPerThread; ++k) {
        const int i = threadIdx.x + k * kThreads;
        const bool code = i < Q::kCodeCopies;
        const int per_run = code ? kCB * Q::kRun / 16 : kS * Q::kRun * 2 / 16;
        const int r = code ? i : i - Q::kCodeCopies;
        const int run = r / per_run, off = r - run * per_run;
        const int j0 = first_key + run * Q::kRun;
        const long long s0 = i < Q::kCopies && j0 < end ? pool_slot(table, j0, block_shift) : -1;
        src[k] = s0 < 0 ? -1 : code ? s0 * kCB + off * 16 : s0 * kS + off * 8;
        dst[k] = code ? run * Q::kRun * kCB + off * 16 : Q::kKeys * kCB + (run * Q::kRun * kS + off * 8) * 2;
    }
    for (int x = 0; x < 2; ++x) {
        const unsigned char* codes = x == 0 ? k_codes : v_codes;
        const __nv_bfloat16* scales = x == 0 ? k_scales : v_scales;
#pragma unroll
        for (int k = 0; k < Q::kPerThread; ++k) {
            const int i = threadIdx.x + k * kThreads;
            if (i >= Q::kCopies) continue;
            const void* from = src[k] < 0 ? (const void*)codes
                               : i < Q::kCodeCopies ? (const void*)(codes + src[k]) : (const void*)(scales + src[k]);
            cp_async_16(raw + x * Q::kRawBytes + dst[k], from, src[k] >= 0);
        }
        cp_async_commit();
    }
}

// One K/V tile of a warp's 16 rows, as ragged_kernel: S = Q K^T by mma, scale and mask (keys in [beg,
// end) visible from the row's position), online softmax (m, l), O = alpha O + P V by mma.
template <typename T, int D>
__device__ __forceinline__ void ragged_tile_mma(const T* sq, const T* kb, const T* vb, const int (&pos)[2], int k0,
                                                int beg, int end, int window, float scale_log2, float (&o)[D / 8][4],
                                                float (&m)[2], float (&l)[2]) {
    using S = RaggedShape<D>;
    constexpr int kKeys = S::kKeys, kStride = S::kStride;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t4 = lane & 3;
    float s[kKeys / 8][4];
#pragma unroll
    for (int n = 0; n < kKeys / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
        unsigned a[4];
        ldsm_x4<false>(a, sq + (warp * 16 + (lane & 15)) * kStride + ks * 16 + (lane >> 4) * 8);
#pragma unroll
        for (int n = 0; n < kKeys / 8; n += 2) {
            unsigned b[4];
            ldsm_x4<false>(b, kb + (n * 8 + (lane & 7) + (lane >> 4) * 8) * kStride + ks * 16 + ((lane >> 3) & 1) * 8);
            const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
            mma_16816<T>(s[n], a, b0);
            mma_16816<T>(s[n + 1], a, b1);
        }
    }
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int j = k0 + n * 8 + 2 * t4 + (i & 1);
            const float v = j >= beg && j < end && visible(j, pos[i >> 1], window) ? s[n][i] * scale_log2 : neg_inf();
            s[n][i] = v;
            mx[i >> 1] = fmaxf(mx[i >> 1], v);
        }
    }
    float base[2], alpha[2];
#pragma unroll
    for (int x = 0; x < 2; ++x) {
        mx[x] = fmaxf(mx[x], __shfl_xor_sync(kFullMask, mx[x], 1));
        mx[x] = fmaxf(mx[x], __shfl_xor_sync(kFullMask, mx[x], 2));
        alpha[x] = m[x] == neg_inf() ? 0.f : exp2f(m[x] - mx[x]);
        base[x] = mx[x] == neg_inf() ? 0.f : mx[x];
        m[x] = mx[x];
        l[x] *= alpha[x];
    }
#pragma unroll
    for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            s[n][i] = exp2f(s[n][i] - base[i >> 1]);
            l[i >> 1] += s[n][i];
        }
    }
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
        o[n][0] *= alpha[0]; o[n][1] *= alpha[0];
        o[n][2] *= alpha[1]; o[n][3] *= alpha[1];
    }
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
        const unsigned a[4] = {pack2(s[2 * kk][0], s[2 * kk][1], T()), pack2(s[2 * kk][2], s[2 * kk][3], T()),
                               pack2(s[2 * kk + 1][0], s[2 * kk + 1][1], T()),
                               pack2(s[2 * kk + 1][2], s[2 * kk + 1][3], T())};
#pragma unroll
        for (int n = 0; n < D / 8; n += 2) {
            unsigned b[4];
            ldsm_x4<true>(b, vb + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * kStride + n * 8 + (lane >> 4) * 8);
            const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
            mma_16816<T>(o[n], a, b0);
            mma_16816<T>(o[n + 1], a, b1);
        }
    }
}

template <int F, typename T, int D>
__device__ __forceinline__ void ragged_quant_kernel(
    T* __restrict__ out, float* __restrict__ part_out, float* __restrict__ part_lse,   // as ragged_kernel
    const T* __restrict__ query, long long q_token_stride, long long q_head_stride,
    const unsigned char* __restrict__ k_codes, const __nv_bfloat16* __restrict__ k_scales,
    const unsigned char* __restrict__ v_codes, const __nv_bfloat16* __restrict__ v_scales,
    long long head_slots,                                 // num_blocks * BS: tokens per KV head
    const int* __restrict__ block_tables, int max_blocks, int block_shift, const int* __restrict__ token_row,
    const int* __restrict__ token_pos, const int* __restrict__ chunks, int num_kv_heads, int group, int window,
    int partition, float scale_log2) {
    using Q = QuantRaggedShape<F, D>;
    constexpr int kKeys = Q::kKeys, kStride = Q::kStride, kChunks = Q::kChunks, kRows = Q::kRows;
    HFP_DYNAMIC_SMEM(smem_raw);
    T* sq = reinterpret_cast<T*>(smem_raw);                  // [kRows][kStride]
    T* sk = sq + kRows * kStride;                            // [kKeys][kStride]
    T* sv = sk + kKeys * kStride;                            // [kKeys][kStride]
    unsigned char* raw = reinterpret_cast<unsigned char*>(sv + kKeys * kStride);   // [2][K, V][kRawBytes]
    int* spos = reinterpret_cast<int*>(raw + 4 * Q::kRawBytes);                     // [kRows]

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int chunk = blockIdx.x / num_kv_heads;
    const int h = blockIdx.x - chunk * num_kv_heads;
    const int split = blockIdx.y, splits = gridDim.y;
    const int first = chunks[2 * chunk], count = chunks[2 * chunk + 1];
    const int rows_used = count * group;
    const int num_q_heads = num_kv_heads * group;
    int min_pos = 0x7fffffff, max_pos = -1;
    for (int i = 0; i < count; ++i) {
        const int p = token_pos[first + i];
        if (p >= 0) { min_pos = imin(min_pos, p); max_pos = imax(max_pos, p); }
    }
    const int* table = block_tables + (long long)(count > 0 ? token_row[first] : 0) * max_blocks;
    const int lo = window > 0 && max_pos >= 0 ? imax(0, min_pos - window + 1) : 0;
    const int beg = lo + split * partition;
    const int end = imin(imin(max_pos + 1, max_blocks << block_shift), beg + partition);
    const int first_key = beg & ~(Q::kRun - 1);              // tiles start on a run
    const int num_tiles = beg < end ? (end - first_key + kKeys - 1) / kKeys : 0;

    for (int r = tid; r < kRows; r += kThreads) spos[r] = r < rows_used ? token_pos[first + r / group] : -1;
    for (int i = tid; i < kRows * kChunks; i += kThreads) {
        const int r = i / kChunks, c = i - (i / kChunks) * kChunks;
        const bool real = r < rows_used && num_tiles > 0;
        const T* src = real ? query + (long long)(first + r / group) * q_token_stride +
                                  (long long)(h * group + r % group) * q_head_stride + c * 8
                            : query;
        cp_async_16(sq + r * kStride + c * 8, src, real);
    }
    cp_async_commit();

    const long long code_head = h * head_slots * Q::kCodeBytes, scale_head = h * head_slots * Q::kScales;
    auto stage = [&](int t, int buf) {
        stage_raw_tile<F, D>(raw + buf * 2 * Q::kRawBytes, k_codes + code_head, k_scales + scale_head,
                             v_codes + code_head, v_scales + scale_head, table, block_shift, first_key + t * kKeys, end);
    };
    const bool active = warp * 16 < rows_used;       // warp-uniform: a warp with no real rows only loads
    const int r0 = warp * 16 + (lane >> 2), t4 = lane & 3;
    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m[2] = {neg_inf(), neg_inf()};
    float l[2] = {0.f, 0.f};

    if (num_tiles > 0) stage(0, 0);
    for (int t = 0; t < num_tiles; ++t) {
        const int buf = t & 1, k0 = first_key + t * kKeys;
        stage_or_empty(t + 1 < num_tiles, stage, t + 1, buf ^ 1);
        cp_async_wait<2>();  // Q, K(t), V(t) have landed (K(t+1), V(t+1) may be in flight)
        __syncthreads();     // raw(t) visible to all, and every warp is done reading tile t - 1's sk, sv
        const unsigned char* kr = raw + buf * 2 * Q::kRawBytes;
        dequant_tile<F, T, D>(sk, kr, k0, beg, end);
        dequant_tile<F, T, D>(sv, kr + Q::kRawBytes, k0, beg, end);
        __syncthreads();     // the T tiles are complete, and raw buffer `buf` is free for tile t + 2's copies
        if (active) {
            const int pos[2] = {spos[r0], spos[r0 + 8]};
            ragged_tile_mma<T, D>(sq, sk, sv, pos, k0, beg, end, window, scale_log2, o, m, l);
        }
        // No barrier here: tile t + 1's pass writes sk, sv only after the next iteration's first barrier,
        // which every warp reaches after its mma of tile t; the raw buffer it refills was last read
        // before this iteration's second barrier.
    }
    cp_async_wait<0>();
    __syncthreads();         // spos visible even when there were no tiles

    if (!active) return;     // no barrier below
#pragma unroll
    for (int x = 0; x < 2; ++x) {
        l[x] += __shfl_xor_sync(kFullMask, l[x], 1);
        l[x] += __shfl_xor_sync(kFullMask, l[x], 2);
    }
#pragma unroll
    for (int x = 0; x < 2; ++x) {
        const int r = r0 + 8 * x;
        if (r >= rows_used) continue;
        const long long row = (long long)(first + r / group) * num_q_heads + h * group + r % group;
        const float inv = l[x] > 0.f ? 1.f / l[x] : 0.f;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            store_pair(out, part_out, row, n * 8 + 2 * t4, D, split, splits, o[n][2 * x] * inv, o[n][2 * x + 1] * inv);
        }
        if (splits > 1 && t4 == 0) part_lse[row * splits + split] = l[x] > 0.f ? m[x] + log2f(l[x]) : neg_inf();
    }
}

}  // namespace hfp
