// fp16/bf16 paged attention on sm_80+: a cp.async-pipelined CUDA-core decode for small GQA groups, and
// a tensor-core (mma.sync m16n8k16) kernel over a ragged token layout for everything else: prefill,
// chunked prefill, the engine's packed steps, and decode with large groups.
//
// Pools as attention.cu: k_pool, v_pool [Hkv, num_blocks, BS, D]; stored token j of a row is at block
// block_tables[row, j >> block_shift], offset j & (BS - 1). A query at stored index pos (-1 = pad) sees
// keys j <= pos (and pos - j < window when window > 0). Softmax in base 2, fp32; scale_log2 = scale *
// log2(e). Splits: grid.y > 1 divides each work item's key range into `partition`-key parts; each writes
// its normalised partial output and log2-sum-exp, and hfp_merge_splits combines them.
#include "common.cuh"

namespace hfp {

// Pool slot of stored token j (block size 1 << block_shift).
__device__ __forceinline__ long long pool_slot(const int* __restrict__ table, int j, int block_shift) {
    return ((long long)table[j >> block_shift] << block_shift) + (j & ((1 << block_shift) - 1));
}

__device__ __forceinline__ bool visible(int j, int pos, int window) {
    return pos >= 0 && j <= pos && (window <= 0 || pos - j < window);
}

// Write one normalised result pair (o0, o1) of output row `row` at dims d, d + 1: to `out` [rows, D]
// (T) with one split, else to part_out [rows, splits, D] (fp32).
template <typename T>
__device__ __forceinline__ void store_pair(T* out, float* part_out, long long row, int d, int head_dim, int split,
                                           int splits, float o0, float o1) {
    if (splits == 1) {
        reinterpret_cast<unsigned*>(out + row * head_dim + d)[0] = pack2(o0, o1, T());
    } else {
        float* dst = part_out + (row * splits + split) * head_dim + d;
        dst[0] = o0;
        dst[1] = o1;
    }
}

// ------------------------------------------------------------------------------------------------
// Tensor-core ragged attention. One CTA = one work item (a chunk of consecutive query tokens of one row,
// one KV head) x one split. Its 64 query rows are (token, query head of the group) pairs, row r = token
// r / group, head r % group; warp w owns rows 16w..16w+15 (FlashAttention-2: Q and the K/V tiles in
// shared memory, S and O in registers, online softmax per row). K and V tiles arrive by cp.async into
// two buffers each, V one group behind K, so V's loads overlap QK^T and the next tile's loads overlap
// the whole tile.
template <int D>
struct RaggedShape {
    static constexpr int kRows = 64;                  // query rows per CTA (4 warps x 16)
    static constexpr int kKeys = D <= 128 ? 64 : 32;  // keys per K/V tile
    static constexpr int kStride = D + 8;             // elements per shared row: +16 B, conflict-free ldmatrix
    static constexpr int kChunks = D / 8;             // 16-byte chunks per row
    static constexpr int kPerThread = kKeys * kChunks / kThreads;
    static_assert(D % 16 == 0 && (D / 8) % 2 == 0 && kKeys * kChunks % kThreads == 0, "tile shape");
};

template <typename T, int D>
__device__ __forceinline__ void ragged_kernel(
    T* __restrict__ out,                    // [tokens, Hq, D]
    float* __restrict__ part_out,           // [tokens, Hq, splits, D]   (splits > 1)
    float* __restrict__ part_lse,           // [tokens, Hq, splits]      (splits > 1)
    const T* __restrict__ query,            // token t, head q at query + t * q_token_stride + q * q_head_stride
    long long q_token_stride, long long q_head_stride,
    const T* __restrict__ k_pool, const T* __restrict__ v_pool, long long head_stride,
    const int* __restrict__ block_tables, int max_blocks, int block_shift,
    const int* __restrict__ token_row,      // [tokens] block-table row of each token
    const int* __restrict__ token_pos,      // [tokens] stored index, -1 = pad
    const int* __restrict__ chunks,         // [num_chunks, 2] (first token, count); count * group <= 64
    int num_kv_heads, int group, int window, int partition, float scale_log2) {
    using S = RaggedShape<D>;
    constexpr int kKeys = S::kKeys, kStride = S::kStride, kChunks = S::kChunks;
    HFP_DYNAMIC_SMEM(smem_raw);
    T* sq = reinterpret_cast<T*>(smem_raw);             // [kRows][kStride]
    T* sk = sq + S::kRows * kStride;                     // [2][kKeys][kStride]
    T* sv = sk + 2 * kKeys * kStride;                    // [2][kKeys][kStride]
    int* spos = reinterpret_cast<int*>(sv + 2 * kKeys * kStride);  // [kRows]

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int chunk = blockIdx.x / num_kv_heads;
    const int h = blockIdx.x - chunk * num_kv_heads;
    const int split = blockIdx.y, splits = gridDim.y;
    const int first = chunks[2 * chunk], count = chunks[2 * chunk + 1];
    const int rows_used = count * group;
    const int num_q_heads = num_kv_heads * group;

    // Key range of the chunk (the same in every thread): [lo, max pos], then this split's part of it.
    int min_pos = 0x7fffffff, max_pos = -1;
    for (int i = 0; i < count; ++i) {
        const int p = token_pos[first + i];
        if (p >= 0) { min_pos = imin(min_pos, p); max_pos = imax(max_pos, p); }
    }
    const int* table = block_tables + (long long)(count > 0 ? token_row[first] : 0) * max_blocks;
    const int lo = window > 0 && max_pos >= 0 ? imax(0, min_pos - window + 1) : 0;
    const int beg = lo + split * partition;
    const int end = imin(imin(max_pos + 1, max_blocks << block_shift), beg + partition);
    const int num_tiles = beg < end ? (end - beg + kKeys - 1) / kKeys : 0;

    for (int r = tid; r < S::kRows; r += kThreads) spos[r] = r < rows_used ? token_pos[first + r / group] : -1;
    for (int i = tid; i < S::kRows * kChunks; i += kThreads) {
        const int r = i / kChunks, c = i - (i / kChunks) * kChunks;
        const bool real = r < rows_used && num_tiles > 0;
        const T* src = real ? query + (long long)(first + r / group) * q_token_stride +
                                  (long long)(h * group + r % group) * q_head_stride + c * 8
                            : query;
        cp_async_16(sq + r * kStride + c * 8, src, real);
    }
    cp_async_commit();

    const T* kh = k_pool + h * head_stride;
    const T* vh = v_pool + h * head_stride;
    auto stage = [&](int t, int buf) {  // K then V of tile t, two commit groups; zeros past `end`
        long long slot[S::kPerThread];
#pragma unroll
        for (int k = 0; k < S::kPerThread; ++k) {
            const int j = beg + t * kKeys + (tid + k * kThreads) / kChunks;
            slot[k] = j < end ? pool_slot(table, j, block_shift) : -1;
        }
        for (int x = 0; x < 2; ++x) {   // K, then V: one commit group each
            T* dst = (x == 0 ? sk : sv) + buf * kKeys * kStride;
            const T* head = x == 0 ? kh : vh;
#pragma unroll
            for (int k = 0; k < S::kPerThread; ++k) {
                const int i = tid + k * kThreads, key = i / kChunks, c = i - key * kChunks;
                cp_async_16(dst + key * kStride + c * 8, head + (slot[k] < 0 ? 0 : slot[k] * D + c * 8), slot[k] >= 0);
            }
            cp_async_commit();
        }
    };

    const bool active = warp * 16 < rows_used;       // warp-uniform: a warp with no real rows only loads
    const int g = lane >> 2, t4 = lane & 3;
    const int r0 = warp * 16 + g;                     // this lane's rows r0 and r0 + 8
    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m[2] = {neg_inf(), neg_inf()};
    float l[2] = {0.f, 0.f};                          // partial sums of this lane's columns

    if (num_tiles > 0) stage(0, 0);
    for (int t = 0; t < num_tiles; ++t) {
        const int buf = t & 1;
        stage_or_empty(t + 1 < num_tiles, stage, t + 1, buf ^ 1);
        cp_async_wait<3>();  // Q and K(t) have landed (V(t), K(t+1), V(t+1) may be in flight)
        __syncthreads();
        const T* kb = sk + buf * kKeys * kStride;
        const T* vb = sv + buf * kKeys * kStride;
        float s[kKeys / 8][4];
        if (active) {
#pragma unroll
            for (int n = 0; n < kKeys / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
            for (int ks = 0; ks < D / 16; ++ks) {
                unsigned a[4];
                ldsm_x4<false>(a, sq + (warp * 16 + (lane & 15)) * kStride + ks * 16 + (lane >> 4) * 8);
#pragma unroll
                for (int n = 0; n < kKeys / 8; n += 2) {
                    unsigned b[4];
                    ldsm_x4<false>(b, kb + (n * 8 + (lane & 7) + (lane >> 4) * 8) * kStride + ks * 16 +
                                          ((lane >> 3) & 1) * 8);
                    const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
                    mma_16816<T>(s[n], a, b0);
                    mma_16816<T>(s[n + 1], a, b1);
                }
            }
            // Scale, mask, online softmax (each row's max over its 4 lanes).
            const int pos[2] = {spos[r0], spos[r0 + 8]};
            const int k0 = beg + t * kKeys;
            float mx[2] = {m[0], m[1]};
#pragma unroll
            for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int j = k0 + n * 8 + 2 * t4 + (i & 1);
                    const float v = j < end && visible(j, pos[i >> 1], window) ? s[n][i] * scale_log2 : neg_inf();
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
        }
        cp_async_wait<2>();  // V(t) has landed
        __syncthreads();
        if (active) {
#pragma unroll
            for (int kk = 0; kk < kKeys / 16; ++kk) {
                const unsigned a[4] = {pack2(s[2 * kk][0], s[2 * kk][1], T()), pack2(s[2 * kk][2], s[2 * kk][3], T()),
                                       pack2(s[2 * kk + 1][0], s[2 * kk + 1][1], T()),
                                       pack2(s[2 * kk + 1][2], s[2 * kk + 1][3], T())};
#pragma unroll
                for (int n = 0; n < D / 8; n += 2) {
                    unsigned b[4];
                    ldsm_x4<true>(b, vb + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * kStride + n * 8 +
                                         (lane >> 4) * 8);
                    const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
                    mma_16816<T>(o[n], a, b0);
                    mma_16816<T>(o[n + 1], a, b1);
                }
            }
        }
        __syncthreads();  // tile t's buffers are free for tile t + 2
    }
    cp_async_wait<0>();
    __syncthreads();      // spos visible even when there were no tiles

    if (!active) return;  // no barrier below
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

// ------------------------------------------------------------------------------------------------
// CUDA-core decode for small groups. One CTA = (row, KV head) x split. head_dim is split across kBdx
// lanes, one 16-byte chunk (8 values) each, so q and the accumulators live in registers; the CTA's
// kSlots = 128 / kBdx lane groups are (query head, key group) pairs: key group kg takes keys
// [kg * sub, (kg + 1) * sub) of every tile. Dot products are reduced across the kBdx lanes by shuffles.
// K and V tiles arrive through a kStages-deep cp.async ring (V one commit group behind K). Key groups
// are merged through shared memory at the end.
template <int D>
struct DecodeShape {
    static constexpr int kChunks = D / 8;
    static constexpr int kBdx = kChunks <= 8 ? 8 : kChunks <= 16 ? 16 : 32;
    static constexpr int kSlots = kThreads / kBdx;
    static constexpr int kKeys = D <= 128 ? 32 : 16;   // keys per stage
    static constexpr int kStages = 3;
};

template <typename T, int D>
__device__ __forceinline__ void decode_fast_kernel(
    T* __restrict__ out,                    // [B, Hq, D]
    float* __restrict__ part_out,           // [B, Hq, splits, D]   (splits > 1)
    float* __restrict__ part_lse,           // [B, Hq, splits]      (splits > 1)
    const T* __restrict__ query,            // [B, Hq, D]
    const T* __restrict__ k_pool, const T* __restrict__ v_pool, long long head_stride,
    const int* __restrict__ block_tables, int max_blocks, int block_shift,
    const int* __restrict__ context_lens,   // [B]
    int num_kv_heads, int group, int key_groups, int window, int partition, float scale_log2) {
    using S = DecodeShape<D>;
    constexpr int kKeys = S::kKeys, kChunks = S::kChunks, kBdx = S::kBdx, kStages = S::kStages;
    HFP_DYNAMIC_SMEM(smem_raw);
    T* sk = reinterpret_cast<T*>(smem_raw);              // [kStages][kKeys][D]
    T* sv = sk + kStages * kKeys * D;                    // [kStages][kKeys][D]
    float* merge = reinterpret_cast<float*>(sv + kStages * kKeys * D);  // [kSlots][D + 2]

    const int tid = threadIdx.x, lane = tid & 31;
    const int b = blockIdx.x / num_kv_heads;
    const int h = blockIdx.x - b * num_kv_heads;
    const int split = blockIdx.y, splits = gridDim.y;
    const int length = context_lens[b];
    const int lo = window > 0 ? imax(0, length - window) : 0;
    const int beg = lo + split * partition;
    const int end = imin(beg + partition, imin(length, max_blocks << block_shift));
    const int num_tiles = beg < end ? (end - beg + kKeys - 1) / kKeys : 0;
    const int* table = block_tables + (long long)b * max_blocks;
    const int num_q_heads = num_kv_heads * group;

    // Lane group (slot) -> (query head, key group). Slots past group * key_groups repeat another
    // slot's work (so that every warp runs the same shuffles) and are not merged.
    const int tx = lane % kBdx;
    const int slot = tid / kBdx;
    const int qh = slot % group;
    const int kg = (slot / group) % key_groups;
    const int sub = kKeys / key_groups;
    const bool lane_real = tx < kChunks;

    float q[8];
    {
        const long long row = (long long)b * num_q_heads + h * group + qh;
        uint4 w = make_uint4(0u, 0u, 0u, 0u);
        if (lane_real) w = reinterpret_cast<const uint4*>(query + row * D)[tx];
        const unsigned ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            q[2 * i] = unpack_lo(ws[i], T()) * scale_log2;
            q[2 * i + 1] = unpack_hi(ws[i], T()) * scale_log2;
        }
    }

    const T* kh = k_pool + h * head_stride;
    const T* vh = v_pool + h * head_stride;
    // K then V of tile t into ring slot t % kStages, two commit groups; each thread's block-table
    // lookups are done once for both (src: element offset in the head's pool, -1 = zero fill).
    constexpr int kPerThread = (kKeys * kChunks + kThreads - 1) / kThreads;
    auto stage = [&](int t) {
        const int buf = t % kStages;
        long long src[kPerThread];
#pragma unroll
        for (int k = 0; k < kPerThread; ++k) {
            const int i = tid + k * kThreads, key = i / kChunks, c = i - key * kChunks, j = beg + t * kKeys + key;
            src[k] = i < kKeys * kChunks && j < end ? pool_slot(table, j, block_shift) * D + c * 8 : -1;
        }
        for (int x = 0; x < 2; ++x) {   // K, then V: one commit group each
            T* dst = (x == 0 ? sk : sv) + buf * kKeys * D;
            const T* head = x == 0 ? kh : vh;
#pragma unroll
            for (int k = 0; k < kPerThread; ++k) {
                const int i = tid + k * kThreads, key = i / kChunks, c = i - key * kChunks;
                if (i < kKeys * kChunks) cp_async_16(dst + key * D + c * 8, head + (src[k] < 0 ? 0 : src[k]), src[k] >= 0);
            }
            cp_async_commit();
        }
    };

    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    float m = neg_inf(), l = 0.f;
#pragma unroll
    for (int t = 0; t < kStages - 1; ++t) stage_or_empty(t < num_tiles, stage, t);
    for (int t = 0; t < num_tiles; ++t) {
        stage_or_empty(t + kStages - 1 < num_tiles, stage, t + kStages - 1);
        cp_async_wait<2 * kStages - 1>();  // K(t) has landed
        __syncthreads();
        const int buf = t % kStages;
        const int k0 = beg + t * kKeys + kg * sub;
        float s[kKeys];
        float tile_max = neg_inf();
#pragma unroll
        for (int i = 0; i < kKeys; ++i) {
            if (i < sub) {
                float dot = 0.f;
                if (lane_real) {
                    const uint4 w = reinterpret_cast<const uint4*>(sk + (buf * kKeys + kg * sub + i) * D)[tx];
                    const unsigned ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
                    for (int k = 0; k < 4; ++k) {
                        dot = fmaf(q[2 * k], unpack_lo(ws[k], T()), dot);
                        dot = fmaf(q[2 * k + 1], unpack_hi(ws[k], T()), dot);
                    }
                }
#pragma unroll
                for (int off = kBdx / 2; off > 0; off >>= 1) dot += __shfl_xor_sync(kFullMask, dot, off);
                const int j = k0 + i;
                s[i] = j < end && visible(j, length - 1, window) ? dot : neg_inf();
                tile_max = fmaxf(tile_max, s[i]);
            }
        }
        const float m_new = fmaxf(m, tile_max);
        const float alpha = m == neg_inf() ? 0.f : exp2f(m - m_new);
        const float base = m_new == neg_inf() ? 0.f : m_new;
        m = m_new;
        l *= alpha;
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[k] *= alpha;
        cp_async_wait<2 * kStages - 2>();  // V(t) has landed
        __syncthreads();
#pragma unroll
        for (int i = 0; i < kKeys; ++i) {
            if (i < sub) {
                const float p = exp2f(s[i] - base);
                l += p;
                if (lane_real) {
                    const uint4 w = reinterpret_cast<const uint4*>(sv + (buf * kKeys + kg * sub + i) * D)[tx];
                    const unsigned ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
                    for (int k = 0; k < 4; ++k) {
                        acc[2 * k] = fmaf(p, unpack_lo(ws[k], T()), acc[2 * k]);
                        acc[2 * k + 1] = fmaf(p, unpack_hi(ws[k], T()), acc[2 * k + 1]);
                    }
                }
            }
        }
        __syncthreads();  // ring slot t % kStages is free for tile t + kStages
    }
    cp_async_wait<0>();

    // Merge the key groups of each query head: slot s's (m, l, acc) -> merge[s].
    float* mine = merge + slot * (D + 2);
    if (lane_real) {
#pragma unroll
        for (int k = 0; k < 8; ++k) mine[tx * 8 + k] = acc[k];
    }
    if (tx == 0) { mine[D] = m; mine[D + 1] = l; }
    __syncthreads();
    const long long row0 = (long long)b * num_q_heads + h * group;
    for (int i = tid; i < group * (D / 2); i += kThreads) {
        const int r = i / (D / 2), d = 2 * (i - r * (D / 2));
        float mx = neg_inf();
        for (int k = 0; k < key_groups; ++k) mx = fmaxf(mx, merge[(k * group + r) * (D + 2) + D]);
        float o0 = 0.f, o1 = 0.f, den = 0.f;
        if (mx != neg_inf()) {
            for (int k = 0; k < key_groups; ++k) {
                const float* part = merge + (k * group + r) * (D + 2);
                const float w = exp2f(part[D] - mx);
                den += w * part[D + 1];
                o0 += w * part[d];
                o1 += w * part[d + 1];
            }
        }
        const float inv = den > 0.f ? 1.f / den : 0.f;
        store_pair(out, part_out, row0 + r, d, D, split, splits, o0 * inv, o1 * inv);
        if (splits > 1 && d == 0) part_lse[(row0 + r) * splits + split] = den > 0.f ? mx + log2f(den) : neg_inf();
    }
}

// grid (rows), 128 threads: out[row] = the log2-sum-exp-weighted mean of its splits' partial outputs.
template <typename T>
__device__ __forceinline__ void merge_splits_kernel(T* __restrict__ out, const float* __restrict__ part_out,
                                                    const float* __restrict__ part_lse, int splits, int head_dim) {
    const long long row = blockIdx.x;
    const float* lse = part_lse + row * splits;
    float m = neg_inf();
    for (int s = 0; s < splits; ++s) m = fmaxf(m, lse[s]);
    for (int d = threadIdx.x; d < head_dim; d += kThreads) {
        float num = 0.f, den = 0.f;
        if (m != neg_inf()) {
            for (int s = 0; s < splits; ++s) {
                const float w = exp2f(lse[s] - m);
                num += w * part_out[(row * splits + s) * head_dim + d];
                den += w;
            }
        }
        out[row * head_dim + d] = from_float<T>(den > 0.f ? num / den : 0.f);
    }
}

}  // namespace hfp

#include "fast_quant_extend.cuh"

#define HFP_RAGGED_ENTRY(TN, D)                                                                \
    extern "C" __global__ void __launch_bounds__(hfp::kThreads, 2) hfp_ragged_##TN##_d##D(        \
        HFP_T(TN)* out, float* part_out, float* part_lse, const HFP_T(TN)* query,              \
        long long q_token_stride, long long q_head_stride, const HFP_T(TN)* k_pool,            \
        const HFP_T(TN)* v_pool, long long head_stride, const int* block_tables, int max_blocks, \
        int block_shift, const int* token_row, const int* token_pos, const int* chunks,        \
        int num_kv_heads, int group, int window, int partition, float scale_log2) {            \
        hfp::ragged_kernel<HFP_T(TN), D>(out, part_out, part_lse, query, q_token_stride,       \
            q_head_stride, k_pool, v_pool, head_stride, block_tables, max_blocks, block_shift, \
            token_row, token_pos, chunks, num_kv_heads, group, window, partition, scale_log2); \
    }                                                                                          \
    HFP_EXPORT_LAUNCHER(hfp_ragged_##TN##_d##D)

#define HFP_DECODE_FAST_ENTRY(TN, D)                                                           \
    extern "C" __global__ void __launch_bounds__(hfp::kThreads, 2) hfp_decode_fast_##TN##_d##D(   \
        HFP_T(TN)* out, float* part_out, float* part_lse, const HFP_T(TN)* query,              \
        const HFP_T(TN)* k_pool, const HFP_T(TN)* v_pool, long long head_stride,               \
        const int* block_tables, int max_blocks, int block_shift, const int* context_lens,     \
        int num_kv_heads, int group, int key_groups, int window, int partition, float scale_log2) { \
        hfp::decode_fast_kernel<HFP_T(TN), D>(out, part_out, part_lse, query, k_pool, v_pool,  \
            head_stride, block_tables, max_blocks, block_shift, context_lens, num_kv_heads,    \
            group, key_groups, window, partition, scale_log2);                                 \
    }                                                                                          \
    HFP_EXPORT_LAUNCHER(hfp_decode_fast_##TN##_d##D)

#define HFP_MERGE_ENTRY(TN)                                                                    \
    extern "C" __global__ void __launch_bounds__(hfp::kThreads) hfp_merge_splits_##TN(         \
        HFP_T(TN)* out, const float* part_out, const float* part_lse, int splits, int head_dim) { \
        hfp::merge_splits_kernel<HFP_T(TN)>(out, part_out, part_lse, splits, head_dim);        \
    }                                                                                          \
    HFP_EXPORT_LAUNCHER(hfp_merge_splits_##TN)

// Quantised pools, format F (tag FN, kernel_registry.KV_FORMAT_TAGS): T is the query's dtype.
#define HFP_DECODE_FAST_QUANT_ENTRY(FN, F, TN, D)                                              \
    extern "C" __global__ void __launch_bounds__(hfp::kThreads, 2) hfp_decode_fast_##FN##_##TN##_d##D( \
        HFP_T(TN)* out, float* part_out, float* part_lse, const HFP_T(TN)* query,              \
        const unsigned char* k_codes, const hfp_bf16* k_scales, const unsigned char* v_codes,  \
        const hfp_bf16* v_scales, long long head_slots, const int* block_tables, int max_blocks, \
        int block_shift, const int* context_lens, int num_kv_heads, int group, int window,     \
        int partition, float scale_log2) {                                                     \
        hfp::decode_fast_quant_kernel<F, HFP_T(TN), D>(out, part_out, part_lse, query, k_codes, \
            k_scales, v_codes, v_scales, head_slots, block_tables, max_blocks, block_shift,     \
            context_lens, num_kv_heads, group, window, partition, scale_log2);                 \
    }                                                                                          \
    HFP_EXPORT_LAUNCHER(hfp_decode_fast_##FN##_##TN##_d##D)

#define HFP_RAGGED_QUANT_ENTRY(FN, F, TN, D)                                                   \
    extern "C" __global__ void __launch_bounds__(hfp::kThreads, 2) hfp_ragged_##FN##_##TN##_d##D( \
        HFP_T(TN)* out, float* part_out, float* part_lse, const HFP_T(TN)* query,              \
        long long q_token_stride, long long q_head_stride, const unsigned char* k_codes,       \
        const hfp_bf16* k_scales, const unsigned char* v_codes, const hfp_bf16* v_scales,      \
        long long head_slots, const int* block_tables, int max_blocks, int block_shift,        \
        const int* token_row, const int* token_pos, const int* chunks, int num_kv_heads,       \
        int group, int window, int partition, float scale_log2) {                              \
        hfp::ragged_quant_kernel<F, HFP_T(TN), D>(out, part_out, part_lse, query, q_token_stride, \
            q_head_stride, k_codes, k_scales, v_codes, v_scales, head_slots, block_tables,     \
            max_blocks, block_shift, token_row, token_pos, chunks, num_kv_heads, group, window, \
            partition, scale_log2);                                                            \
    }                                                                                          \
    HFP_EXPORT_LAUNCHER(hfp_ragged_##FN##_##TN##_d##D)

// One (head dim, KV format) per module: -DHFP_ONLY_KV_FORMAT as attention.cu (1 or undefined: the
// model-dtype kernels; a quantised format: its kernels; 0: everything).
#ifndef HFP_ONLY_KV_FORMAT
#define HFP_ONLY_KV_FORMAT 1
#endif
#define HFP_FAST_FORMAT(F) (HFP_ONLY_KV_FORMAT == 0 || HFP_ONLY_KV_FORMAT == (F))
#if HFP_FAST_FORMAT(HFP_KV_MODEL)
#define HFP_FAST_MODEL(D) HFP_RAGGED_ENTRY(f16, D) HFP_RAGGED_ENTRY(bf16, D) \
    HFP_DECODE_FAST_ENTRY(f16, D) HFP_DECODE_FAST_ENTRY(bf16, D)
#else
#define HFP_FAST_MODEL(D)
#endif
#define HFP_FAST_QUANT_PAIR(FN, F, D) HFP_DECODE_FAST_QUANT_ENTRY(FN, F, f16, D) HFP_DECODE_FAST_QUANT_ENTRY(FN, F, bf16, D) \
    HFP_RAGGED_QUANT_ENTRY(FN, F, f16, D) HFP_RAGGED_QUANT_ENTRY(FN, F, bf16, D)
#if HFP_FAST_FORMAT(HFP_KV_FP8E4M3)
#define HFP_FAST_FP8E4M3(D) HFP_FAST_QUANT_PAIR(fp8e4m3, HFP_KV_FP8E4M3, D)
#else
#define HFP_FAST_FP8E4M3(D)
#endif
#if HFP_FAST_FORMAT(HFP_KV_FP8E5M2)
#define HFP_FAST_FP8E5M2(D) HFP_FAST_QUANT_PAIR(fp8e5m2, HFP_KV_FP8E5M2, D)
#else
#define HFP_FAST_FP8E5M2(D)
#endif
#if HFP_FAST_FORMAT(HFP_KV_INT8)
#define HFP_FAST_INT8(D) HFP_FAST_QUANT_PAIR(int8, HFP_KV_INT8, D)
#else
#define HFP_FAST_INT8(D)
#endif
#if HFP_FAST_FORMAT(HFP_KV_INT4)
#define HFP_FAST_INT4(D) HFP_FAST_QUANT_PAIR(int4, HFP_KV_INT4, D)
#else
#define HFP_FAST_INT4(D)
#endif
#define HFP_FAST_ENTRIES(D) HFP_FAST_MODEL(D) HFP_FAST_FP8E4M3(D) HFP_FAST_FP8E5M2(D) HFP_FAST_INT8(D) HFP_FAST_INT4(D)

HFP_MERGE_ENTRY(f16)
HFP_MERGE_ENTRY(bf16)

// One head dim per module (-DHFP_ONLY_HEAD_DIM, kernel_registry.py); 0 or undefined: all.
#ifndef HFP_ONLY_HEAD_DIM
#define HFP_ONLY_HEAD_DIM 0
#endif
#define HFP_FAST_SELECTED(D) (HFP_ONLY_HEAD_DIM == 0 || HFP_ONLY_HEAD_DIM == (D))
#if HFP_FAST_SELECTED(64)
HFP_FAST_ENTRIES(64)
#endif
#if HFP_FAST_SELECTED(80)
HFP_FAST_ENTRIES(80)
#endif
#if HFP_FAST_SELECTED(96)
HFP_FAST_ENTRIES(96)
#endif
#if HFP_FAST_SELECTED(128)
HFP_FAST_ENTRIES(128)
#endif
#if HFP_FAST_SELECTED(256)
HFP_FAST_ENTRIES(256)
#endif
