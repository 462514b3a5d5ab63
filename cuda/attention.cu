// Paged attention over block tables: decode (one new token per row, split-K with a log-sum-exp merge)
// and extend (several new tokens per row, padded [B, Hq, Q, D] + query_pos form).
//
// Pool layout (hf_paged/torch_attention.py): k_pool, v_pool [Hkv, num_blocks, BS, D], contiguous
// (head-major: each (head, block) is one contiguous [BS, D] tile). Stored token j of row b is at
// block block_tables[b, j / BS], offset j % BS.
//
// One block (CTA) serves one KV head of one row for a set of "query rows": the G query heads of the
// KV head's GQA group (decode), or G heads x QT query tokens (extend). Keys and values are staged
// tile by tile into shared memory and read by every query row of the CTA, so each KV head is read
// from global memory once per CTA, whatever the group size. Scores, softmax and accumulation in fp32,
// softmax in base 2 (queries are pre-scaled by scale * log2(e)).
//
// Shared memory (4-byte words; host mirror: hf_paged/kernel_registry.py attention_smem_bytes):
//   q     [R][D + 1]     fp32 scaled queries (padded row: conflict-free reads across rows)
//   acc   [R][D]         fp32 unnormalised output
//   s     [R][TILE + 1]  fp32 scores, then probabilities, of the current tile
//   m, l, alpha [R]      running max, running sum, rescale of the current tile
//   pos   [R]            int stored index of each query row, -1 = pad
//   k, v  [TILE][ROW]    raw key/value words, ROW = D * sizeof(T) / 4 + 1 (padded)
#include "common.cuh"

namespace hfp {

// Tokens per shared-memory tile: 16 KiB of keys per tile, a power of two in [16, 128].
__host__ __device__ constexpr int tile_tokens(int head_dim, int elem_bytes) {
    return 16384 / (head_dim * elem_bytes) >= 128 ? 128
         : 16384 / (head_dim * elem_bytes) >= 64  ? 64
         : 16384 / (head_dim * elem_bytes) >= 32  ? 32 : 16;
}

template <typename T, int D>
struct AttnSmem {
    static constexpr int kTile = tile_tokens(D, sizeof(T));
    static constexpr int kRowWords = D * (int)sizeof(T) / 4 + 1;
    static constexpr int kChunks = D * (int)sizeof(T) / 16;  // 16-byte loads per key row
    float* q;
    float* acc;
    float* s;
    float* m;
    float* l;
    float* alpha;
    int* pos;
    unsigned* k;
    unsigned* v;
    __device__ __forceinline__ AttnSmem(unsigned char* raw, int rows) {
        float* p = reinterpret_cast<float*>(raw);
        q = p;          p += rows * (D + 1);
        acc = p;        p += rows * D;
        s = p;          p += rows * (kTile + 1);
        m = p;          p += rows;
        l = p;          p += rows;
        alpha = p;      p += rows;
        pos = reinterpret_cast<int*>(p);
        k = reinterpret_cast<unsigned*>(p + rows);
        v = k + kTile * kRowWords;
    }
    __device__ __forceinline__ float key(int t, int d) const {
        return to_float(reinterpret_cast<const T*>(k + t * kRowWords)[d]);
    }
    __device__ __forceinline__ float value(int t, int d) const {
        return to_float(reinterpret_cast<const T*>(v + t * kRowWords)[d]);
    }
};

__device__ __forceinline__ bool key_visible(int j, int pos, int window) {
    return pos >= 0 && j <= pos && (window <= 0 || pos - j < window);
}

// Attend `rows` query rows (already in sm.q / sm.pos, acc/m/l initialised, not yet synchronised)
// to stored keys [beg, end) of one KV head. The first tile's barrier publishes the callers' writes;
// with no tile (beg >= end) nothing is synchronised, so callers then must not read shared memory.
// Ends synchronised, with sm.acc, sm.m, sm.l final.
template <typename T, int D>
__device__ __forceinline__ void attend_tiles(const AttnSmem<T, D>& sm, int rows, int beg, int end,
                                             const T* __restrict__ k_head,   // [num_blocks, BS, D] of head h
                                             const T* __restrict__ v_head,   // [num_blocks, BS, D] of head h
                                             const int* __restrict__ table,  // this row's block table
                                             int block_shift,                // log2(block size)
                                             int window) {
    constexpr int kTile = AttnSmem<T, D>::kTile;
    constexpr int kRowWords = AttnSmem<T, D>::kRowWords;
    constexpr int kChunks = AttnSmem<T, D>::kChunks;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;

    for (int t0 = beg; t0 < end; t0 += kTile) {
        // Stage the tile's keys and values (zeros past `end`, so that p = 0 never meets NaN).
        for (int i = tid; i < kTile * kChunks; i += kThreads) {
            const int t = i / kChunks;
            const int c = i - t * kChunks;
            const int j = t0 + t;
            uint4 kw = make_uint4(0u, 0u, 0u, 0u);
            uint4 vw = make_uint4(0u, 0u, 0u, 0u);
            if (j < end) {
                const long long slot = ((long long)table[j >> block_shift] << block_shift) +
                                       (j & ((1 << block_shift) - 1));
                kw = reinterpret_cast<const uint4*>(k_head + slot * D)[c];
                vw = reinterpret_cast<const uint4*>(v_head + slot * D)[c];
            }
            unsigned* kd = sm.k + t * kRowWords + c * 4;
            unsigned* vd = sm.v + t * kRowWords + c * 4;
            kd[0] = kw.x; kd[1] = kw.y; kd[2] = kw.z; kd[3] = kw.w;
            vd[0] = vw.x; vd[1] = vw.y; vd[2] = vw.z; vd[3] = vw.w;
        }
        __syncthreads();  // tile staged (first tile: also queries and row state)

        // Scores: consecutive threads take consecutive rows of one key (broadcast key reads).
        for (int i = tid; i < rows * kTile; i += kThreads) {
            const int t = i / rows;
            const int r = i - t * rows;
            const int j = t0 + t;
            float score = neg_inf();
            if (j < end && key_visible(j, sm.pos[r], window)) {
                const float* qr = sm.q + r * (D + 1);
                float dot = 0.f;
#pragma unroll 8
                for (int d = 0; d < D; ++d) dot += qr[d] * sm.key(t, d);
                score = dot;
            }
            sm.s[r * (kTile + 1) + t] = score;
        }
        __syncthreads();  // scores complete

        // Online softmax, one warp per row.
        for (int r = warp; r < rows; r += kWarps) {
            float* sr = sm.s + r * (kTile + 1);
            const float m_old = sm.m[r];
            const float l_old = sm.l[r];
            float mx = neg_inf();
            for (int t = lane; t < kTile; t += 32) mx = fmaxf(mx, sr[t]);
            const float m_new = fmaxf(m_old, warp_max(mx));
            float sum = 0.f;
            for (int t = lane; t < kTile; t += 32) {
                const float p = m_new == neg_inf() ? 0.f : exp2f(sr[t] - m_new);
                sr[t] = p;
                sum += p;
            }
            sum = warp_sum(sum);
            if (lane == 0) {
                const float a = m_old == neg_inf() ? 0.f : exp2f(m_old - m_new);
                sm.alpha[r] = a;
                sm.m[r] = m_new;
                sm.l[r] = l_old * a + sum;
            }
        }
        __syncthreads();  // probabilities and rescale factors complete

        // P @ V: consecutive threads take consecutive dims of one row (coalesced value reads).
        for (int i = tid; i < rows * D; i += kThreads) {
            const int r = i / D;
            const int d = i - r * D;
            const float* pr = sm.s + r * (kTile + 1);
            float a = sm.acc[i] * sm.alpha[r];
#pragma unroll 4
            for (int t = 0; t < kTile; ++t) a += pr[t] * sm.value(t, d);
            sm.acc[i] = a;
        }
        __syncthreads();  // tile consumed: the next one may overwrite k, v, s, alpha
    }
}

// Row state and scaled queries; `query_row(r)` gives row r's query pointer (nullptr = pad row).
template <typename T, int D, typename QueryRow, typename RowPos>
__device__ __forceinline__ void load_rows(const AttnSmem<T, D>& sm, int rows, float scale_log2,
                                          QueryRow query_row, RowPos row_pos) {
    for (int i = threadIdx.x; i < rows * D; i += kThreads) {
        const int r = i / D;
        const int d = i - r * D;
        const T* qr = query_row(r);
        sm.q[r * (D + 1) + d] = qr ? to_float(qr[d]) * scale_log2 : 0.f;
        sm.acc[i] = 0.f;
    }
    for (int r = threadIdx.x; r < rows; r += kThreads) {
        sm.m[r] = neg_inf();
        sm.l[r] = 0.f;
        sm.pos[r] = row_pos(r);
    }
}

// grid (Hkv, B, splits), 128 threads. Split z covers stored keys [lo + z * partition, +partition)
// where lo = max(0, L - window) (0 without a window). One split: writes `out`; several: writes the
// normalised partial output and its log2-sum-exp for hfp_decode_reduce.
template <typename T, int D>
__device__ __forceinline__ void decode_kernel(
    T* __restrict__ out,                   // [B, Hq, D]
    float* __restrict__ part_out,          // [B, Hq, splits, D]   (splits > 1)
    float* __restrict__ part_lse,          // [B, Hq, splits]      (splits > 1)
    const T* __restrict__ query,           // [B, Hq, D]
    const T* __restrict__ k_pool,          // [Hkv, num_blocks, BS, D]
    const T* __restrict__ v_pool,          // [Hkv, num_blocks, BS, D]
    const int* __restrict__ block_tables,  // [B, max_blocks]
    const int* __restrict__ context_lens,  // [B]
    long long head_stride,                 // num_blocks * BS * D: elements per KV head of a pool
    int block_shift,                       // log2(BS)
    int max_blocks, int num_kv_heads, int group, int window, int partition, float scale_log2) {
    HFP_DYNAMIC_SMEM(smem_raw);
    const AttnSmem<T, D> sm(smem_raw, group);
    const int h = blockIdx.x;
    const int b = blockIdx.y;
    const int split = blockIdx.z;
    const int splits = gridDim.z;
    const int num_q_heads = num_kv_heads * group;
    const int length = context_lens[b];
    const int lo = window > 0 ? imax(0, length - window) : 0;
    const int beg = lo + split * partition;
    const int end = imin(beg + partition, length);
    const T* q_base = query + ((long long)b * num_q_heads + (long long)h * group) * D;

    load_rows(sm, group, scale_log2,
              [&](int r) { return q_base + (long long)r * D; },
              [&](int) { return length - 1; });
    attend_tiles<T, D>(sm, group, beg, end, k_pool + h * head_stride, v_pool + h * head_stride,
                       block_tables + (long long)b * max_blocks, block_shift, window);

    const long long row0 = (long long)b * num_q_heads + (long long)h * group;  // first query head
    for (int i = threadIdx.x; i < group * D; i += kThreads) {
        const int r = i / D;
        const int d = i - r * D;
        const float l = beg < end ? sm.l[r] : 0.f;
        const float o = l > 0.f ? sm.acc[i] / l : 0.f;
        if (splits == 1) {
            out[(row0 + r) * D + d] = from_float<T>(o);
        } else {
            part_out[((row0 + r) * splits + split) * D + d] = o;
            if (d == 0) part_lse[(row0 + r) * splits + split] = l > 0.f ? sm.m[r] + log2f(l) : neg_inf();
        }
    }
}

// grid (Hq, B), 128 threads: merge the splits of each (row, query head) by their log2-sum-exp.
template <typename T>
__device__ __forceinline__ void decode_reduce_kernel(
    T* __restrict__ out,                   // [B, Hq, D]
    const float* __restrict__ part_out,    // [B, Hq, splits, D]
    const float* __restrict__ part_lse,    // [B, Hq, splits]
    int splits, int head_dim) {
    const long long row = (long long)blockIdx.y * gridDim.x + blockIdx.x;
    const float* lse = part_lse + row * splits;
    float m = neg_inf();
    for (int s = 0; s < splits; ++s) m = fmaxf(m, lse[s]);
    for (int d = threadIdx.x; d < head_dim; d += kThreads) {
        float num = 0.f;
        float den = 0.f;
        if (m != neg_inf()) {
            for (int s = 0; s < splits; ++s) {
                const float w = exp2f(lse[s] - m);  // 0 for empty splits (lse = -inf)
                num += w * part_out[(row * splits + s) * head_dim + d];
                den += w;
            }
        }
        out[row * head_dim + d] = from_float<T>(den > 0.f ? num / den : 0.f);
    }
}

// grid (Hkv, B, ceil(Q / q_per_cta)), 128 threads. Rows: r = g * q_per_cta + i for query head
// h * group + g and query token z * q_per_cta + i. Keys [first visible, last visible] of the rows.
template <typename T, int D>
__device__ __forceinline__ void extend_kernel(
    T* __restrict__ out,                   // [B, Hq, Q, D]
    const T* __restrict__ query,           // [B, Hq, Q, D]
    const T* __restrict__ k_pool,          // [Hkv, num_blocks, BS, D]
    const T* __restrict__ v_pool,          // [Hkv, num_blocks, BS, D]
    const int* __restrict__ block_tables,  // [B, max_blocks]
    const int* __restrict__ context_lens,  // [B]
    const int* __restrict__ query_pos,     // [B, Q], -1 = pad
    long long head_stride,                 // num_blocks * BS * D: elements per KV head of a pool
    int block_shift,                       // log2(BS)
    int max_blocks, int num_kv_heads, int group, int q_len, int q_per_cta, int window, float scale_log2) {
    HFP_DYNAMIC_SMEM(smem_raw);
    const int rows = group * q_per_cta;
    const AttnSmem<T, D> sm(smem_raw, rows);
    const int h = blockIdx.x;
    const int b = blockIdx.y;
    const int q0 = blockIdx.z * q_per_cta;
    const int num_q_heads = num_kv_heads * group;
    const int length = context_lens[b];
    const int* pos_row = query_pos + (long long)b * q_len;

    // Key range of this CTA (every thread computes the same; at most q_per_cta reads).
    int min_pos = 0x7fffffff;
    int max_pos = -1;
    for (int i = 0; i < q_per_cta && q0 + i < q_len; ++i) {
        const int p = pos_row[q0 + i];
        if (p >= 0) { min_pos = imin(min_pos, p); max_pos = imax(max_pos, p); }
    }
    const int end = imin(length, max_pos + 1);
    const int beg = window > 0 && max_pos >= 0 ? imax(0, min_pos - window + 1) : 0;

    auto head_row = [&](int r) {  // (query head, token) of row r; token -1 = outside Q
        const int g = r / q_per_cta;
        const int qi = q0 + (r - g * q_per_cta);
        return make_int2(h * group + g, qi < q_len ? qi : -1);
    };
    load_rows(sm, rows, scale_log2,
              [&](int r) {
                  const int2 hq = head_row(r);
                  return hq.y < 0 ? (const T*)nullptr
                                  : query + (((long long)b * num_q_heads + hq.x) * q_len + hq.y) * D;
              },
              [&](int r) { const int2 hq = head_row(r); return hq.y < 0 ? -1 : pos_row[hq.y]; });
    attend_tiles<T, D>(sm, rows, beg, end, k_pool + h * head_stride, v_pool + h * head_stride,
                       block_tables + (long long)b * max_blocks, block_shift, window);

    for (int i = threadIdx.x; i < rows * D; i += kThreads) {
        const int r = i / D;
        const int d = i - r * D;
        const int2 hq = head_row(r);
        if (hq.y < 0) continue;
        const float l = beg < end ? sm.l[r] : 0.f;
        out[(((long long)b * num_q_heads + hq.x) * q_len + hq.y) * D + d] =
            from_float<T>(l > 0.f ? sm.acc[i] / l : 0.f);
    }
}

}  // namespace hfp

#define HFP_DECODE_ENTRY(TN, D)                                                               \
    extern "C" __global__ void __launch_bounds__(hfp::kThreads) hfp_decode_##TN##_d##D(       \
        HFP_T(TN)* out, float* part_out, float* part_lse, const HFP_T(TN)* query,             \
        const HFP_T(TN)* k_pool, const HFP_T(TN)* v_pool, const int* block_tables,            \
        const int* context_lens, long long head_stride, int block_shift, int max_blocks,      \
        int num_kv_heads, int group, int window, int partition, float scale_log2) {           \
        hfp::decode_kernel<HFP_T(TN), D>(out, part_out, part_lse, query, k_pool, v_pool,      \
            block_tables, context_lens, head_stride, block_shift, max_blocks, num_kv_heads,   \
            group, window, partition, scale_log2);                                            \
    }                                                                                         \
    HFP_EXPORT_LAUNCHER(hfp_decode_##TN##_d##D)

#define HFP_EXTEND_ENTRY(TN, D)                                                               \
    extern "C" __global__ void __launch_bounds__(hfp::kThreads) hfp_extend_##TN##_d##D(       \
        HFP_T(TN)* out, const HFP_T(TN)* query, const HFP_T(TN)* k_pool,                      \
        const HFP_T(TN)* v_pool, const int* block_tables, const int* context_lens,            \
        const int* query_pos, long long head_stride, int block_shift, int max_blocks,         \
        int num_kv_heads, int group, int q_len, int q_per_cta, int window, float scale_log2) { \
        hfp::extend_kernel<HFP_T(TN), D>(out, query, k_pool, v_pool, block_tables,            \
            context_lens, query_pos, head_stride, block_shift, max_blocks, num_kv_heads,      \
            group, q_len, q_per_cta, window, scale_log2);                                     \
    }                                                                                         \
    HFP_EXPORT_LAUNCHER(hfp_extend_##TN##_d##D)

#define HFP_REDUCE_ENTRY(TN)                                                                  \
    extern "C" __global__ void __launch_bounds__(hfp::kThreads) hfp_decode_reduce_##TN(       \
        HFP_T(TN)* out, const float* part_out, const float* part_lse, int splits,             \
        int head_dim) {                                                                       \
        hfp::decode_reduce_kernel<HFP_T(TN)>(out, part_out, part_lse, splits, head_dim);      \
    }                                                                                         \
    HFP_EXPORT_LAUNCHER(hfp_decode_reduce_##TN)

#define HFP_ATTENTION_ENTRIES(D)                                                              \
    HFP_DECODE_ENTRY(f16, D) HFP_DECODE_ENTRY(bf16, D) HFP_DECODE_ENTRY(f32, D)               \
    HFP_EXTEND_ENTRY(f16, D) HFP_EXTEND_ENTRY(bf16, D) HFP_EXTEND_ENTRY(f32, D)

HFP_REDUCE_ENTRY(f16)
HFP_REDUCE_ENTRY(bf16)
HFP_REDUCE_ENTRY(f32)

// Head dims (must equal hf_paged/kernel_registry.py HEAD_DIMS; a test checks). Build-time selection:
// -DHFP_ONLY_HEAD_DIM=128 compiles only that head dim (0 or undefined: all). Block size is a runtime
// power of two (block_shift), so one kernel serves every block size.
#ifndef HFP_ONLY_HEAD_DIM
#define HFP_ONLY_HEAD_DIM 0
#endif
#define HFP_SELECTED(D) (HFP_ONLY_HEAD_DIM == 0 || HFP_ONLY_HEAD_DIM == (D))
#if HFP_SELECTED(64)
HFP_ATTENTION_ENTRIES(64)
#endif
#if HFP_SELECTED(80)
HFP_ATTENTION_ENTRIES(80)
#endif
#if HFP_SELECTED(96)
HFP_ATTENTION_ENTRIES(96)
#endif
#if HFP_SELECTED(128)
HFP_ATTENTION_ENTRIES(128)
#endif
#if HFP_SELECTED(256)
HFP_ATTENTION_ENTRIES(256)
#endif
