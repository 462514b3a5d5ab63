// Paged attention over block tables: decode (one new token per row, split-K with a log-sum-exp merge)
// and extend (several new tokens per row, padded [B, Hq, Q, D] + query_pos form).
//
// Pool layout (hf_paged/backends/torch_backend.py): k_pool, v_pool [Hkv, num_blocks, BS, D], contiguous
// (head-major: each (head, block) is one contiguous [BS, D] tile). Stored token j of row b is at
// block block_tables[b, j / BS], offset j % BS. Quantised pools (hf_paged/kv_formats.py, kv_quant.cuh)
// have the same geometry: codes [Hkv, num_blocks, BS, D * bits / 8] and bf16 scales [Hkv, num_blocks, BS, S].
//
// One block (CTA) serves one KV head of one row for a set of "query rows": the G query heads of the
// KV head's GQA group (decode), or G heads x QT query tokens (extend). Keys and values are staged
// tile by tile into shared memory and read by every query row of the CTA, so each KV head is read
// from global memory once per CTA, whatever the group size. Scores, softmax and accumulation in fp32,
// softmax in base 2 (queries are pre-scaled by scale * log2(e)). A "pools" object (PlainPools,
// QuantPools) stages each tile: model-dtype pools are copied; quantised ones are loaded as codes and
// scales, dequantised in registers and stored as T (the query dtype), so the shared-memory tile and
// every loop after staging are the same for both.
//
// Shared memory (4-byte words; host mirror: hf_paged/kernel_registry.py attention_smem_bytes):
//   q     [R][D + 1]     fp32 scaled queries (padded row: conflict-free reads across rows)
//   acc   [R][D]         fp32 unnormalised output
//   s     [R][TILE + 1]  fp32 scores, then probabilities, of the current tile
//   m, l, alpha [R]      running max, running sum, rescale of the current tile
//   pos   [R]            int stored index of each query row, -1 = pad
//   k, v  [TILE][ROW]    key/value words of T values, ROW = D * sizeof(T) / 4 + 1 (padded)
#include "common.cuh"
#include "kv_quant.cuh"

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

// Pool slot of stored token j of a row (block table `table`, block size 1 << block_shift).
__device__ __forceinline__ long long stored_slot(const int* __restrict__ table, int j, int block_shift) {
    return ((long long)table[j >> block_shift] << block_shift) + (j & ((1 << block_shift) - 1));
}

// Model-dtype pools of one KV head: a tile is copied into shared memory in 16-byte words.
template <typename T, int D>
struct PlainHead {
    const T* __restrict__ k;  // [num_blocks, BS, D] of head h
    const T* __restrict__ v;
    // Stage keys and values of tokens [t0, t0 + kTile) (zeros past `end`, so that p = 0 never meets
    // NaN). Writes sm.k and sm.v only; no barrier (the caller synchronises).
    __device__ __forceinline__ void stage(const AttnSmem<T, D>& sm, int t0, int end, const int* __restrict__ table,
                                          int block_shift) const {
        constexpr int kTile = AttnSmem<T, D>::kTile;
        constexpr int kRowWords = AttnSmem<T, D>::kRowWords;
        constexpr int kChunks = AttnSmem<T, D>::kChunks;
        for (int i = threadIdx.x; i < kTile * kChunks; i += kThreads) {
            const int t = i / kChunks;
            const int c = i - t * kChunks;
            const int j = t0 + t;
            uint4 kw = make_uint4(0u, 0u, 0u, 0u);
            uint4 vw = make_uint4(0u, 0u, 0u, 0u);
            if (j < end) {
                const long long slot = stored_slot(table, j, block_shift);
                kw = reinterpret_cast<const uint4*>(k + slot * D)[c];
                vw = reinterpret_cast<const uint4*>(v + slot * D)[c];
            }
            unsigned* kd = sm.k + t * kRowWords + c * 4;
            unsigned* vd = sm.v + t * kRowWords + c * 4;
            kd[0] = kw.x; kd[1] = kw.y; kd[2] = kw.z; kd[3] = kw.w;
            vd[0] = vw.x; vd[1] = vw.y; vd[2] = vw.z; vd[3] = vw.w;
        }
    }
};

template <typename T, int D>
struct PlainPools {
    const T* k;               // [Hkv, num_blocks, BS, D]
    const T* v;
    long long head_stride;    // num_blocks * BS * D: elements per KV head
    __device__ __forceinline__ PlainHead<T, D> head(int h) const {
        return {k + h * head_stride, v + h * head_stride};
    }
};

// Select<C, A, B>::type: A if C else B (std::conditional; NVRTC has no <type_traits> here).
template <bool C, typename A, typename B> struct Select { using type = A; };
template <typename A, typename B> struct Select<false, A, B> { using type = B; };

// T bits of a float, rounded to nearest even (2-byte types), for packing two values into one word.
__device__ __forceinline__ unsigned half_bits(__half x) { return __half_as_ushort(x); }
__device__ __forceinline__ unsigned half_bits(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }

// Dequantised values v[0..N) stored as T into consecutive shared-memory words from `dst`.
template <typename T, int N>
__device__ __forceinline__ void store_values(unsigned* dst, const float (&v)[N]) {
    if constexpr (sizeof(T) == 4) {
#pragma unroll
        for (int k = 0; k < N; ++k) dst[k] = __float_as_uint(v[k]);
    } else {
#pragma unroll
        for (int k = 0; k < N; k += 2) {
            dst[k / 2] = half_bits(from_float<T>(v[k])) | (half_bits(from_float<T>(v[k + 1])) << 16);
        }
    }
}

// Quantised pools of one KV head (format F, kv_quant.cuh): each thread loads one 16-byte word of a
// token's codes (8 bytes where the row is not a multiple of 16: int4 at head dim 80) and the scales
// that word needs, dequantises in registers and stores T values, so that the tile is what a
// model-dtype pool of dequantised values would have staged.
template <int F, typename T, int D>
struct QuantHead {
    using Fmt = KvFormat<F>;
    static constexpr int kCodeBytes = KvLayout<F>::code_bytes(D);          // per token
    static constexpr int kScales = KvLayout<F>::num_scales(D);             // bf16 per token
    static constexpr int kLoadBytes = kCodeBytes % 16 == 0 ? 16 : 8;
    static constexpr int kLoads = kCodeBytes / kLoadBytes;                 // loads per token
    static constexpr int kPerLoad = kLoadBytes * 8 / Fmt::kBits;           // elements per load
    static_assert(kCodeBytes % kLoadBytes == 0 && (!Fmt::kGroup || kPerLoad % Fmt::kGroup == 0),
                  "a load holds whole groups of whole tokens");
    using Word = typename Select<kLoadBytes == 16, uint4, uint2>::type;

    const unsigned char* __restrict__ k_codes;   // [num_blocks, BS, kCodeBytes] of head h
    const unsigned char* __restrict__ v_codes;
    const __nv_bfloat16* __restrict__ k_scales;  // [num_blocks, BS, kScales] of head h
    const __nv_bfloat16* __restrict__ v_scales;

    // Element k of a load (bytes of the words in order; int4: element 2i low nibble of byte i).
    __device__ static __forceinline__ unsigned code(const unsigned (&w)[kLoadBytes / 4], int k) {
        if constexpr (Fmt::kBits == 8) {
            return (w[k >> 2] >> (8 * (k & 3))) & 0xffu;
        } else {
            return (w[k >> 3] >> (4 * (k & 7))) & 0xfu;
        }
    }

    // Load c of token `slot`: codes -> values (code * scale, + minimum for int4), fp32, exact up to the
    // int4 addition (kv_quant.cuh); T rounding happens in store_values.
    __device__ static __forceinline__ void dequantise(const unsigned (&w)[kLoadBytes / 4],
                                                      const __nv_bfloat16* __restrict__ scales, int c,
                                                      float (&out)[kPerLoad]) {
        if constexpr (Fmt::kGroup == 0) {
            const float s = __bfloat162float(scales[0]);
#pragma unroll
            for (int k = 0; k < kPerLoad; ++k) out[k] = Fmt::decode(code(w, k)) * s;
        } else {
            constexpr int kGroups = kPerLoad / Fmt::kGroup;
            constexpr int kAllGroups = D / Fmt::kGroup;
#pragma unroll
            for (int g = 0; g < kGroups; ++g) {
                const int group = c * kGroups + g;
                const float s = __bfloat162float(scales[group]);
                const float m = __bfloat162float(scales[kAllGroups + group]);
#pragma unroll
                for (int k = g * Fmt::kGroup; k < (g + 1) * Fmt::kGroup; ++k) out[k] = Fmt::decode(code(w, k)) * s + m;
            }
        }
    }

    __device__ static __forceinline__ void words(const Word& x, unsigned (&w)[kLoadBytes / 4]) {
        if constexpr (kLoadBytes == 16) {
            w[0] = x.x; w[1] = x.y; w[2] = x.z; w[3] = x.w;
        } else {
            w[0] = x.x; w[1] = x.y;
        }
    }

    // As PlainHead::stage: tokens [t0, t0 + kTile), zeros past `end`; writes sm.k and sm.v only.
    __device__ __forceinline__ void stage(const AttnSmem<T, D>& sm, int t0, int end, const int* __restrict__ table,
                                          int block_shift) const {
        constexpr int kTile = AttnSmem<T, D>::kTile;
        constexpr int kRowWords = AttnSmem<T, D>::kRowWords;
        constexpr int kOutWords = kPerLoad * (int)sizeof(T) / 4;           // shared-memory words per load
        for (int i = threadIdx.x; i < kTile * kLoads; i += kThreads) {
            const int t = i / kLoads;
            const int c = i - t * kLoads;
            const int j = t0 + t;
            float kv[kPerLoad];
            float vv[kPerLoad];
            if (j < end) {
                const long long slot = stored_slot(table, j, block_shift);
                unsigned kw[kLoadBytes / 4];
                unsigned vw[kLoadBytes / 4];
                words(reinterpret_cast<const Word*>(k_codes + slot * kCodeBytes)[c], kw);  // both loads first
                words(reinterpret_cast<const Word*>(v_codes + slot * kCodeBytes)[c], vw);
                dequantise(kw, k_scales + slot * kScales, c, kv);
                dequantise(vw, v_scales + slot * kScales, c, vv);
            } else {
#pragma unroll
                for (int k = 0; k < kPerLoad; ++k) kv[k] = vv[k] = 0.f;
            }
            store_values<T>(sm.k + t * kRowWords + c * kOutWords, kv);
            store_values<T>(sm.v + t * kRowWords + c * kOutWords, vv);
        }
    }
};

template <int F, typename T, int D>
struct QuantPools {
    const unsigned char* k_codes;   // [Hkv, num_blocks, BS, code bytes]
    const unsigned char* v_codes;
    const __nv_bfloat16* k_scales;  // [Hkv, num_blocks, BS, S]
    const __nv_bfloat16* v_scales;
    long long head_slots;           // num_blocks * BS: tokens per KV head
    __device__ __forceinline__ QuantHead<F, T, D> head(int h) const {
        using H = QuantHead<F, T, D>;
        const long long codes = h * head_slots * H::kCodeBytes;
        const long long scales = h * head_slots * H::kScales;
        return {k_codes + codes, v_codes + codes, k_scales + scales, v_scales + scales};
    }
};

// Attend `rows` query rows (already in sm.q / sm.pos, acc/m/l initialised, not yet synchronised)
// to stored keys [beg, end) of one KV head, whose tiles `kv` (a PlainHead or QuantHead) stages. The
// first tile's barrier publishes the callers' writes; with no tile (beg >= end) nothing is
// synchronised, so callers then must not read shared memory. Ends synchronised, with sm.acc, sm.m,
// sm.l final.
template <typename T, int D, typename Head>
__device__ __forceinline__ void attend_tiles(const AttnSmem<T, D>& sm, int rows, int beg, int end, const Head& kv,
                                             const int* __restrict__ table,  // this row's block table
                                             int block_shift,                // log2(block size)
                                             int window) {
    constexpr int kTile = AttnSmem<T, D>::kTile;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;

    for (int t0 = beg; t0 < end; t0 += kTile) {
        kv.stage(sm, t0, end, table, block_shift);
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
template <typename T, int D, typename Pools>
__device__ __forceinline__ void decode_kernel(
    T* __restrict__ out,                   // [B, Hq, D]
    float* __restrict__ part_out,          // [B, Hq, splits, D]   (splits > 1)
    float* __restrict__ part_lse,          // [B, Hq, splits]      (splits > 1)
    const T* __restrict__ query,           // [B, Hq, D]
    const Pools& pools,                    // PlainPools<T, D> or QuantPools<F, T, D>
    const int* __restrict__ block_tables,  // [B, max_blocks]
    const int* __restrict__ context_lens,  // [B]
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
    attend_tiles<T, D>(sm, group, beg, end, pools.head(h), block_tables + (long long)b * max_blocks, block_shift,
                       window);

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

// grid (Hkv * ceil(Q / q_per_cta), B), 128 threads: x = h + Hkv * z (x holds up to 2^31 - 1 CTAs, so
// long prompts fit). Rows: r = g * q_per_cta + i for query head h * group + g and query token
// z * q_per_cta + i. Keys [first visible, last visible] of the rows.
template <typename T, int D, typename Pools>
__device__ __forceinline__ void extend_kernel(
    T* __restrict__ out,                   // [B, Hq, Q, D]
    const T* __restrict__ query,           // [B, Hq, Q, D]
    const Pools& pools,                    // PlainPools<T, D> or QuantPools<F, T, D>
    const int* __restrict__ block_tables,  // [B, max_blocks]
    const int* __restrict__ context_lens,  // [B]
    const int* __restrict__ query_pos,     // [B, Q], -1 = pad
    int block_shift,                       // log2(BS)
    int max_blocks, int num_kv_heads, int group, int q_len, int q_per_cta, int window, float scale_log2) {
    HFP_DYNAMIC_SMEM(smem_raw);
    const int rows = group * q_per_cta;
    const AttnSmem<T, D> sm(smem_raw, rows);
    const int h = blockIdx.x % num_kv_heads;
    const int b = blockIdx.y;
    const int q0 = (blockIdx.x / num_kv_heads) * q_per_cta;
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
    attend_tiles<T, D>(sm, rows, beg, end, pools.head(h), block_tables + (long long)b * max_blocks, block_shift,
                       window);

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
        const hfp::PlainPools<HFP_T(TN), D> pools{k_pool, v_pool, head_stride};               \
        hfp::decode_kernel<HFP_T(TN), D>(out, part_out, part_lse, query, pools, block_tables, \
            context_lens, block_shift, max_blocks, num_kv_heads, group, window, partition,    \
            scale_log2);                                                                      \
    }                                                                                         \
    HFP_EXPORT_LAUNCHER(hfp_decode_##TN##_d##D)

#define HFP_EXTEND_ENTRY(TN, D)                                                               \
    extern "C" __global__ void __launch_bounds__(hfp::kThreads) hfp_extend_##TN##_d##D(       \
        HFP_T(TN)* out, const HFP_T(TN)* query, const HFP_T(TN)* k_pool,                      \
        const HFP_T(TN)* v_pool, const int* block_tables, const int* context_lens,            \
        const int* query_pos, long long head_stride, int block_shift, int max_blocks,         \
        int num_kv_heads, int group, int q_len, int q_per_cta, int window, float scale_log2) { \
        const hfp::PlainPools<HFP_T(TN), D> pools{k_pool, v_pool, head_stride};               \
        hfp::extend_kernel<HFP_T(TN), D>(out, query, pools, block_tables, context_lens,       \
            query_pos, block_shift, max_blocks, num_kv_heads, group, q_len, q_per_cta, window, \
            scale_log2);                                                                      \
    }                                                                                         \
    HFP_EXPORT_LAUNCHER(hfp_extend_##TN##_d##D)

#define HFP_REDUCE_ENTRY(TN)                                                                  \
    extern "C" __global__ void __launch_bounds__(hfp::kThreads) hfp_decode_reduce_##TN(       \
        HFP_T(TN)* out, const float* part_out, const float* part_lse, int splits,             \
        int head_dim) {                                                                       \
        hfp::decode_reduce_kernel<HFP_T(TN)>(out, part_out, part_lse, splits, head_dim);      \
    }                                                                                         \
    HFP_EXPORT_LAUNCHER(hfp_decode_reduce_##TN)

// Quantised pools, format F (tag FN): T is the query's dtype, which the codes are dequantised into.
#define HFP_DECODE_QUANT_ENTRY(FN, F, TN, D)                                                  \
    extern "C" __global__ void __launch_bounds__(hfp::kThreads) hfp_decode_##FN##_##TN##_d##D( \
        HFP_T(TN)* out, float* part_out, float* part_lse, const HFP_T(TN)* query,             \
        const unsigned char* k_codes, const hfp_bf16* k_scales, const unsigned char* v_codes, \
        const hfp_bf16* v_scales, const int* block_tables, const int* context_lens,           \
        long long head_slots, int block_shift, int max_blocks, int num_kv_heads, int group,   \
        int window, int partition, float scale_log2) {                                        \
        const hfp::QuantPools<F, HFP_T(TN), D> pools{k_codes, v_codes, k_scales, v_scales, head_slots}; \
        hfp::decode_kernel<HFP_T(TN), D>(out, part_out, part_lse, query, pools, block_tables, \
            context_lens, block_shift, max_blocks, num_kv_heads, group, window, partition,    \
            scale_log2);                                                                      \
    }                                                                                         \
    HFP_EXPORT_LAUNCHER(hfp_decode_##FN##_##TN##_d##D)

#define HFP_EXTEND_QUANT_ENTRY(FN, F, TN, D)                                                  \
    extern "C" __global__ void __launch_bounds__(hfp::kThreads) hfp_extend_##FN##_##TN##_d##D( \
        HFP_T(TN)* out, const HFP_T(TN)* query, const unsigned char* k_codes,                 \
        const hfp_bf16* k_scales, const unsigned char* v_codes, const hfp_bf16* v_scales,     \
        const int* block_tables, const int* context_lens, const int* query_pos,               \
        long long head_slots, int block_shift, int max_blocks, int num_kv_heads, int group,   \
        int q_len, int q_per_cta, int window, float scale_log2) {                             \
        const hfp::QuantPools<F, HFP_T(TN), D> pools{k_codes, v_codes, k_scales, v_scales, head_slots}; \
        hfp::extend_kernel<HFP_T(TN), D>(out, query, pools, block_tables, context_lens,       \
            query_pos, block_shift, max_blocks, num_kv_heads, group, q_len, q_per_cta, window, \
            scale_log2);                                                                      \
    }                                                                                         \
    HFP_EXPORT_LAUNCHER(hfp_extend_##FN##_##TN##_d##D)

#define HFP_ATTENTION_ENTRIES(D)                                                              \
    HFP_DECODE_ENTRY(f16, D) HFP_DECODE_ENTRY(bf16, D) HFP_DECODE_ENTRY(f32, D)               \
    HFP_EXTEND_ENTRY(f16, D) HFP_EXTEND_ENTRY(bf16, D) HFP_EXTEND_ENTRY(f32, D)

#define HFP_QUANT_ENTRIES(FN, F, D)                                                           \
    HFP_DECODE_QUANT_ENTRY(FN, F, f16, D) HFP_DECODE_QUANT_ENTRY(FN, F, bf16, D)              \
    HFP_DECODE_QUANT_ENTRY(FN, F, f32, D) HFP_EXTEND_QUANT_ENTRY(FN, F, f16, D)               \
    HFP_EXTEND_QUANT_ENTRY(FN, F, bf16, D) HFP_EXTEND_QUANT_ENTRY(FN, F, f32, D)

HFP_REDUCE_ENTRY(f16)
HFP_REDUCE_ENTRY(bf16)
HFP_REDUCE_ENTRY(f32)

// Build-time selection of one module (hf_paged/backends/kernel_registry.py KernelSpec.defines):
// -DHFP_ONLY_KV_FORMAT=<id> (kv_quant.cuh: 1 model dtype, 2 fp8e4m3, 3 fp8e5m2, 4 int8, 5 int4)
// compiles only that format's kernels, -DHFP_ONLY_HEAD_DIM=128 only that head dim (0 or undefined:
// all). Every module also holds the reduce kernels above. Block size is a runtime power of two
// (block_shift), so one kernel serves every block size.
#ifndef HFP_ONLY_KV_FORMAT
#define HFP_ONLY_KV_FORMAT 0
#endif
#define HFP_FORMAT_SELECTED(F) (HFP_ONLY_KV_FORMAT == 0 || HFP_ONLY_KV_FORMAT == (F))
#if HFP_FORMAT_SELECTED(HFP_KV_MODEL)
#define HFP_WITH_MODEL(entries) entries
#else
#define HFP_WITH_MODEL(entries)
#endif
#if HFP_FORMAT_SELECTED(HFP_KV_FP8E4M3)
#define HFP_WITH_FP8E4M3(entries) entries
#else
#define HFP_WITH_FP8E4M3(entries)
#endif
#if HFP_FORMAT_SELECTED(HFP_KV_FP8E5M2)
#define HFP_WITH_FP8E5M2(entries) entries
#else
#define HFP_WITH_FP8E5M2(entries)
#endif
#if HFP_FORMAT_SELECTED(HFP_KV_INT8)
#define HFP_WITH_INT8(entries) entries
#else
#define HFP_WITH_INT8(entries)
#endif
#if HFP_FORMAT_SELECTED(HFP_KV_INT4)
#define HFP_WITH_INT4(entries) entries
#else
#define HFP_WITH_INT4(entries)
#endif

// Every selected format of one head dim; format tags as kernel_registry.py KV_FORMAT_TAGS.
#define HFP_HEAD_DIM_ENTRIES(D)                                                               \
    HFP_WITH_MODEL(HFP_ATTENTION_ENTRIES(D))                                                  \
    HFP_WITH_FP8E4M3(HFP_QUANT_ENTRIES(fp8e4m3, HFP_KV_FP8E4M3, D))                           \
    HFP_WITH_FP8E5M2(HFP_QUANT_ENTRIES(fp8e5m2, HFP_KV_FP8E5M2, D))                           \
    HFP_WITH_INT8(HFP_QUANT_ENTRIES(int8, HFP_KV_INT8, D))                                    \
    HFP_WITH_INT4(HFP_QUANT_ENTRIES(int4, HFP_KV_INT4, D))

// Head dims (must equal kernel_registry.py HEAD_DIMS; a test checks; int4 needs D % 16 == 0).
#ifndef HFP_ONLY_HEAD_DIM
#define HFP_ONLY_HEAD_DIM 0
#endif
#define HFP_SELECTED(D) (HFP_ONLY_HEAD_DIM == 0 || HFP_ONLY_HEAD_DIM == (D))
#if HFP_SELECTED(64)
HFP_HEAD_DIM_ENTRIES(64)
#endif
#if HFP_SELECTED(80)
HFP_HEAD_DIM_ENTRIES(80)
#endif
#if HFP_SELECTED(96)
HFP_HEAD_DIM_ENTRIES(96)
#endif
#if HFP_SELECTED(128)
HFP_HEAD_DIM_ENTRIES(128)
#endif
#if HFP_SELECTED(256)
HFP_HEAD_DIM_ENTRIES(256)
#endif
