// Quantised-pool decode on sm_80+ (issue 24 item 5), included by fast_attention.cu after its helpers.
//
// Pools as kv_quant.cuh: codes uint8 [Hkv, num_blocks, BS, CB] and bf16 scales [Hkv, num_blocks, BS, S].
// Codes and scales are staged into shared memory by 16-byte cp.async in runs of kRun = 8 consecutive
// stored tokens: a run lies inside one block (block sizes are powers of two >= 8), and 8 tokens of
// codes (8 * CB bytes) and of scales (8 * S * 2 bytes) are whole 16-byte words at 16-byte aligned
// addresses for every format and head dim (int4 at head dim 80: CB = 40, S = 10). So tiles start at a
// multiple of 8 keys; keys before the split's first key `beg` are masked.
//
// Lane layout (bench/roofline_quant.py): head_dim is split across kBdx lanes, 8 elements each; the CTA's
// kSlots lane groups are key groups only, and every lane group serves the whole GQA group (up to
// kMaxGroup query heads: q and the accumulators of every head in registers). A lane thus decodes each
// of its key and value chunks ONCE for the group, through KvFormat<F>::decode (so a codec change in
// kv_quant.cuh carries over). 8-bit formats apply the (token, head) scale once to the score and once to
// p; int4 dequantises per element (code * scale + minimum), its group of 16 covering a lane's 8.
#pragma once
#include "kv_quant.cuh"

namespace hfp {

template <int F, int D>
struct QuantDecodeShape {
    using Fmt = KvFormat<F>;
    static constexpr int kBits = Fmt::kBits;
    static constexpr int kCodeBytes = KvLayout<F>::code_bytes(D);   // per token
    static constexpr int kScales = KvLayout<F>::num_scales(D);      // bf16 values per token
    static constexpr int kChunks = D / 8;                           // 8 elements per lane
    static constexpr int kBdx = DecodeShape<D>::kBdx;
    static constexpr int kSlots = kThreads / kBdx;                  // key groups
    static constexpr int kKeys = DecodeShape<D>::kKeys * 16 / kBits;   // the bf16 kernel's code bytes per stage
    static constexpr int kStages = 3;
    static constexpr int kRun = 8;
    static constexpr int kMaxGroup = 4;                             // registry FAST_DECODE_MAX_GROUP
    static constexpr int kPerSlot = kKeys / kSlots;                 // keys of a tile per key group
    static constexpr int kSub = kPerSlot < 8 ? kPerSlot : 8;        // keys per online-softmax step
    static constexpr int kCodeCopies = kKeys * kCodeBytes / 16;     // per tile, K (V the same)
    static constexpr int kScaleCopies = kKeys * kScales * 2 / 16;
    static constexpr int kCopies = kCodeCopies + kScaleCopies;
    static constexpr int kPerThread = (kCopies + kThreads - 1) / kThreads;
    static constexpr int kStageBytes = kKeys * (kCodeBytes + 2 * kScales);   // K or V of one stage
    static_assert(kRun * kCodeBytes % 16 == 0 && kRun * kScales * 2 % 16 == 0, "runs are whole 16-byte words");
    static_assert(kKeys % kRun == 0 && kKeys % kSlots == 0 && kPerSlot % kSub == 0, "tile shape");
    static_assert(!Fmt::kGroup || Fmt::kGroup % 8 == 0, "a lane's 8 elements share one scale group");
};

// A lane's 8 elements (dims 8 * tx ..) of stored token `key` of a staged tile, dequantised except for
// the 8-bit formats' scale, which is returned in *scale (1 for int4, whose values are complete).
template <int F, int D>
__device__ __forceinline__ void lane_values(const unsigned char* codes, const __nv_bfloat16* scales, int key,
                                            int tx, float (&v)[8], float* scale) {
    using Q = QuantDecodeShape<F, D>;
    using Fmt = typename Q::Fmt;
    if constexpr (Q::kBits == 8) {
        const uint2 w = *reinterpret_cast<const uint2*>(codes + key * Q::kCodeBytes + tx * 8);
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = Fmt::decode(((e < 4 ? w.x : w.y) >> (8 * (e & 3))) & 0xffu);
        *scale = __bfloat162float(scales[key]);
    } else {
        const unsigned w = *reinterpret_cast<const unsigned*>(codes + key * Q::kCodeBytes + tx * 4);
        const int group = tx * 8 / Fmt::kGroup;
        const float s = __bfloat162float(scales[key * Q::kScales + group]);
        const float m = __bfloat162float(scales[key * Q::kScales + D / Fmt::kGroup + group]);
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = Fmt::decode((w >> (4 * e)) & 0xfu) * s + m;
        *scale = 1.f;
    }
}

template <int F, typename T, int D>
__device__ __forceinline__ void decode_fast_quant_kernel(
    T* __restrict__ out, float* __restrict__ part_out, float* __restrict__ part_lse,   // as decode_fast_kernel
    const T* __restrict__ query,                          // [B, Hq, D]
    const unsigned char* __restrict__ k_codes, const __nv_bfloat16* __restrict__ k_scales,
    const unsigned char* __restrict__ v_codes, const __nv_bfloat16* __restrict__ v_scales,
    long long head_slots,                                 // num_blocks * BS: tokens per KV head
    const int* __restrict__ block_tables, int max_blocks, int block_shift, const int* __restrict__ context_lens,
    int num_kv_heads, int group, int window, int partition, float scale_log2) {
    using Q = QuantDecodeShape<F, D>;
    constexpr int kKeys = Q::kKeys, kBdx = Q::kBdx, kStages = Q::kStages, kG = Q::kMaxGroup;
    constexpr int kCB = Q::kCodeBytes, kS = Q::kScales;
    HFP_DYNAMIC_SMEM(smem_raw);
    // Per stage: K codes [kKeys][CB], K scales [kKeys][S], V codes, V scales; then the merge.
    float* merge = reinterpret_cast<float*>(smem_raw + 2 * kStages * Q::kStageBytes);  // [kSlots][kG][D + 2]

    const int tid = threadIdx.x, lane = tid & 31;
    const int b = blockIdx.x / num_kv_heads;
    const int h = blockIdx.x - b * num_kv_heads;
    const int split = blockIdx.y, splits = gridDim.y;
    const int length = context_lens[b];
    const int lo = window > 0 ? imax(0, length - window) : 0;
    const int beg = lo + split * partition;
    const int end = imin(beg + partition, imin(length, max_blocks << block_shift));
    const int first = beg & ~(Q::kRun - 1);             // tiles start on a run
    const int num_tiles = beg < end ? (end - first + kKeys - 1) / kKeys : 0;
    const int* table = block_tables + (long long)b * max_blocks;
    const int num_q_heads = num_kv_heads * group;
    const int tx = lane % kBdx, slot = tid / kBdx;
    const bool lane_real = tx < Q::kChunks;

    float q[kG][8];
#pragma unroll
    for (int g = 0; g < kG; ++g) {
        uint4 w = make_uint4(0u, 0u, 0u, 0u);
        if (lane_real && g < group) w = reinterpret_cast<const uint4*>(query + ((long long)b * num_q_heads + h * group + g) * D)[tx];
        const unsigned ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            q[g][2 * i] = unpack_lo(ws[i], T()) * scale_log2;
            q[g][2 * i + 1] = unpack_hi(ws[i], T()) * scale_log2;
        }
    }

    const long long code_head = h * head_slots * kCB, scale_head = h * head_slots * kS;
    // K then V of tile t into ring slot t % kStages, one commit group each. Copy i < kCodeCopies is
    // code word i % (kRun * CB / 16) of run i / (..), the rest scale words; runs from `end` on are zeros.
    auto stage = [&](int t) {
        unsigned char* base = smem_raw + (t % kStages) * 2 * Q::kStageBytes;
        long long src[Q::kPerThread];      // byte offset (codes) or element offset (scales) in the head
        int dst[Q::kPerThread];            // byte offset in the stage's K (or V) part
#pragma unroll
        for (int k = 0; k < Q::kPerThread; ++k) {
            const int i = tid + k * kThreads;
            const bool code = i < Q::kCodeCopies;
            const int per_run = code ? kCB * Q::kRun / 16 : kS * Q::kRun * 2 / 16;
            const int r = code ? i : i - Q::kCodeCopies;
            const int run = r / per_run, off = r - run * per_run;
            const int j0 = first + t * kKeys + run * Q::kRun;
            const long long s0 = i < Q::kCopies && j0 < end ? pool_slot(table, j0, block_shift) : -1;
            src[k] = s0 < 0 ? -1 : code ? s0 * kCB + off * 16 : s0 * kS + off * 8;
            dst[k] = code ? run * Q::kRun * kCB + off * 16 : kKeys * kCB + (run * Q::kRun * kS + off * 8) * 2;
        }
        for (int x = 0; x < 2; ++x) {
            const unsigned char* codes = (x == 0 ? k_codes : v_codes) + code_head;
            const __nv_bfloat16* scales = (x == 0 ? k_scales : v_scales) + scale_head;
#pragma unroll
            for (int k = 0; k < Q::kPerThread; ++k) {
                const int i = tid + k * kThreads;
                if (i >= Q::kCopies) continue;
                const void* from = src[k] < 0 ? (const void*)codes
                                   : i < Q::kCodeCopies ? (const void*)(codes + src[k]) : (const void*)(scales + src[k]);
                cp_async_16(base + x * Q::kStageBytes + dst[k], from, src[k] >= 0);
            }
            cp_async_commit();
        }
    };

    float acc[kG][8], m[kG], l[kG];
#pragma unroll
    for (int g = 0; g < kG; ++g) {
        m[g] = neg_inf();
        l[g] = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] = 0.f;
    }
#pragma unroll
    for (int t = 0; t < kStages - 1; ++t) stage_or_empty(t < num_tiles, stage, t);
    for (int t = 0; t < num_tiles; ++t) {
        stage_or_empty(t + kStages - 1 < num_tiles, stage, t + kStages - 1);
        cp_async_wait<2 * kStages - 2>();  // K(t) and V(t) have landed
        __syncthreads();
        const unsigned char* kc = smem_raw + (t % kStages) * 2 * Q::kStageBytes;
        const unsigned char* vc = kc + Q::kStageBytes;
        const __nv_bfloat16* ks = reinterpret_cast<const __nv_bfloat16*>(kc + kKeys * kCB);
        const __nv_bfloat16* vs = reinterpret_cast<const __nv_bfloat16*>(vc + kKeys * kCB);
        for (int c = 0; c < Q::kPerSlot / Q::kSub; ++c) {
            float s[Q::kSub][kG];
            bool valid[Q::kSub];
            float mx[kG];
#pragma unroll
            for (int g = 0; g < kG; ++g) mx[g] = m[g];
#pragma unroll
            for (int n = 0; n < Q::kSub; ++n) {
                const int key = (c * Q::kSub + n) * Q::kSlots + slot;
                const int j = first + t * kKeys + key;
                valid[n] = j >= beg && j < end && visible(j, length - 1, window);
                float kv[8], ksc = 0.f;
                if (lane_real) lane_values<F, D>(kc, ks, key, tx, kv, &ksc);
#pragma unroll
                for (int g = 0; g < kG; ++g) {
                    if (g < group) {                    // block-uniform: the shuffles stay warp-uniform
                        float dot = 0.f;
                        if (lane_real) {
#pragma unroll
                            for (int e = 0; e < 8; ++e) dot = fmaf(q[g][e], kv[e], dot);
                            dot *= ksc;
                        }
#pragma unroll
                        for (int off = kBdx / 2; off > 0; off >>= 1) dot += __shfl_xor_sync(kFullMask, dot, off);
                        s[n][g] = valid[n] ? dot : neg_inf();   // a garbage (NaN) score past `end` is dropped
                        mx[g] = fmaxf(mx[g], s[n][g]);
                    }
                }
            }
            float base[kG];
#pragma unroll
            for (int g = 0; g < kG; ++g) {
                const float alpha = m[g] == neg_inf() ? 0.f : exp2f(m[g] - mx[g]);
                base[g] = mx[g] == neg_inf() ? 0.f : mx[g];
                m[g] = mx[g];
                l[g] *= alpha;
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[g][e] *= alpha;
            }
#pragma unroll
            for (int n = 0; n < Q::kSub; ++n) {
                if (!valid[n]) continue;            // p = 0, and stale values may be NaN
                const int key = (c * Q::kSub + n) * Q::kSlots + slot;
                float vv[8], vsc = 0.f;
                if (lane_real) lane_values<F, D>(vc, vs, key, tx, vv, &vsc);
#pragma unroll
                for (int g = 0; g < kG; ++g) {
                    if (g < group) {
                        const float p = exp2f(s[n][g] - base[g]);
                        l[g] += p;
                        const float ps = p * vsc;
#pragma unroll
                        for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(ps, vv[e], acc[g][e]);
                    }
                }
            }
        }
        __syncthreads();  // ring slot t % kStages is free for tile t + kStages
    }
    cp_async_wait<0>();

    // Merge the key groups: slot s's (acc, m, l) of head g -> merge[s][g].
#pragma unroll
    for (int g = 0; g < kG; ++g) {
        if (g >= group) continue;
        float* mine = merge + (slot * kG + g) * (D + 2);
        if (lane_real) {
#pragma unroll
            for (int e = 0; e < 8; ++e) mine[tx * 8 + e] = acc[g][e];
        }
        if (tx == 0) { mine[D] = m[g]; mine[D + 1] = l[g]; }
    }
    __syncthreads();
    const long long row0 = (long long)b * num_q_heads + h * group;
    for (int i = tid; i < group * (D / 2); i += kThreads) {
        const int r = i / (D / 2), d = 2 * (i - r * (D / 2));
        float mx = neg_inf();
        for (int k = 0; k < Q::kSlots; ++k) mx = fmaxf(mx, merge[(k * kG + r) * (D + 2) + D]);
        float o0 = 0.f, o1 = 0.f, den = 0.f;
        if (mx != neg_inf()) {
            for (int k = 0; k < Q::kSlots; ++k) {
                const float* part = merge + (k * kG + r) * (D + 2);
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

}  // namespace hfp
