// CUDA-on-CPU shim: force-included by g++ (-x c++ -std=c++17 -include shim.h) to run the unchanged
// cuda/*.cu sources on the CPU, for tests only.
//
// Model: blocks of a grid run one after another; each CUDA thread of a block is a fiber (ucontext)
// on the calling OS thread. __syncthreads and warp collectives yield to a scheduler that picks the
// next runnable fiber by a schedule (in order, reverse, seeded random, or one warp running ahead).
// Checks: divergent or post-exit __syncthreads, warp collectives whose named lanes did not all arrive
// (or disagree on mask/kind), reads of lanes outside the mask, deadlocks; dynamic shared memory is
// filled with 0xFF (NaN) and surrounded by poisoned guard zones checked after every block; argument
// count and widths are checked at launch. Errors stop the launch and are returned as a message.
//
// Under ThreadSanitizer, fibers are announced to TSan (no synchronisation on a switch) and barriers
// and collectives are the only happens-before edges, as on a GPU, so shared-memory races are reported.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>
#include <sys/mman.h>
#include <ucontext.h>

#if defined(__SANITIZE_THREAD__)
#define CUDASHIM_TSAN 1
extern "C" {
void* __tsan_get_current_fiber(void);
void* __tsan_create_fiber(unsigned flags);
void __tsan_destroy_fiber(void* fiber);
void __tsan_switch_to_fiber(void* fiber, unsigned flags);
void __tsan_acquire(void* addr);
void __tsan_release(void* addr);
}
#endif
#if defined(__SANITIZE_ADDRESS__)
#define CUDASHIM_ASAN 1
extern "C" {
void __sanitizer_start_switch_fiber(void** fake_stack_save, const void* bottom, size_t size);
void __sanitizer_finish_switch_fiber(void* fake_stack_save, const void** bottom_old, size_t* size_old);
}
#endif

// ---------------------------------------------------------------------------------------------
// Qualifiers and built-in types
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __restrict__ __restrict
#define __shared__ static
#define __constant__ static
#define __align__(n) alignas(n)
#define __launch_bounds__(...)

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint3 { unsigned x, y, z; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(8) int2 { int x, y; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline int2 make_int2(int x, int y) { return {x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
constexpr int warpSize = 32;

// ---------------------------------------------------------------------------------------------
// fp16 / bf16 (storage types; conversions round to nearest even, as __float2half_rn does)
struct __half { unsigned short x; };
struct __nv_bfloat16 { unsigned short x; };
struct __half2 { __half x, y; };
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
inline float __half2float(__half h) {
    _Float16 f;
    std::memcpy(&f, &h.x, 2);
    return (float)f;
}
inline __half __float2half_rn(float v) {
    _Float16 f = (_Float16)v;  // IEEE round to nearest even
    __half h;
    std::memcpy(&h.x, &f, 2);
    return h;
}
inline __half __float2half(float v) { return __float2half_rn(v); }
inline float __bfloat162float(__nv_bfloat16 b) {
    uint32_t u = (uint32_t)b.x << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float v) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    __nv_bfloat16 b;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        b.x = (unsigned short)((u >> 16) | 0x40);  // quiet NaN
    } else {
        b.x = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    return b;
}
inline __nv_bfloat16 __float2bfloat16(float v) { return __float2bfloat16_rn(v); }

// Math and bit intrinsics used by device code.
inline float __expf(float x) { return expf(x); }
inline float __exp2f(float x) { return exp2f(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.f / sqrtf(x); }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline int __float2int_rn(float x) { return (int)std::nearbyint(x); }  // default rounding mode: nearest even
inline unsigned short __half_as_ushort(__half h) { return h.x; }
inline __half __ushort_as_half(unsigned short u) { return __half{u}; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.x; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
template <typename T> inline T __ldg(const T* p) { return *p; }
template <typename T> inline T atomicAdd(T* p, T v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline float atomicAdd(float* p, float v) {
    float old = *p;  // fibers of one block never run concurrently; blocks run one after another
    *p = old + v;
    return old;
}
template <typename T> inline T atomicMax(T* p, T v) { T old = *p; if (v > old) *p = v; return old; }
template <typename T> inline T atomicExch(T* p, T v) { T old = *p; *p = v; return old; }
inline void __threadfence() {}
inline void __threadfence_block() {}

// ---------------------------------------------------------------------------------------------
namespace cudashim {

enum Schedule { kInOrder = 0, kReverse = 1, kRandom = 2, kWarpAhead = 3 };
enum FiberState { kRunnable = 0, kAtBarrier = 1, kAtWarp = 2, kDone = 3 };
enum CollectiveKind { kShflXor = 1, kShfl = 2, kShflDown = 3, kShflUp = 4, kSyncWarp = 5, kMmaF16 = 6, kMmaBf16 = 7,
                      kLdsm = 8, kLdsmTrans = 9 };

// Passed from Python (ctypes) with every launch; mirrors tests/kernels/harness.py LaunchConfig.
struct LaunchConfig {
    unsigned grid[3];
    unsigned block[3];
    long long shared_mem;
    int schedule;
    int seed;
};

// One cp.async copy in flight: done (source read, destination written) only when its thread waits for
// its group; until then the destination holds 0xFF bytes (NaN in every float format).
struct AsyncCopy {
    unsigned char* dst;
    const unsigned char* src;  // nullptr: zero fill
    int bytes;
    int group;                 // -1 until committed
};

struct Fiber {
    ucontext_t ctx;
    char* stack = nullptr;
    unsigned tid = 0;
    uint3 idx{0, 0, 0};
    int state = kRunnable;
    int wait_line = 0;
    uint64_t result = 0;
    uint32_t matrix[4] = {0, 0, 0, 0};  // result registers of an mma / ldmatrix collective
    std::vector<struct AsyncCopy> copies;  // cp.async copies issued and not yet waited for
    int next_group = 0;                 // id the next cp.async.commit_group gives
    void* tsan_fiber = nullptr;
};

struct WarpSlot {
    unsigned arrived = 0;
    unsigned mask = 0;
    int kind = 0;
    int line = 0;
    int width = 32;
    uint64_t values[32];
    int args[32];
    uint32_t payload[32][10];  // mma: a[4], b[2], c[4] (c as float bits) per lane
};

constexpr size_t kStackBytes = 256 * 1024;
constexpr size_t kGuardBytes = 64 * 1024;
constexpr size_t kMaxSharedBytes = 227 * 1024;  // sm_90 opt-in limit

struct Runtime {
    dim3 grid, block;
    uint3 block_idx{0, 0, 0};
    unsigned nthreads = 0;
    std::vector<Fiber> fibers;
    std::vector<WarpSlot> warps;
    std::vector<char*> stacks;
    ucontext_t sched_ctx;
    void* sched_tsan_fiber = nullptr;
    Fiber* current = nullptr;
    unsigned char* smem_alloc = nullptr;  // guard | shared | guard
    size_t smem_bytes = 0;
    int schedule = kInOrder;
    std::mt19937 rng;
    unsigned lead_warp = 0;
    int at_barrier = 0;
    int done = 0;
    bool failed = false;
    std::string error;
    void (*body)(void*) = nullptr;
    void* body_arg = nullptr;
#if CUDASHIM_ASAN
    void* fake_stack = nullptr;
#endif
};

inline thread_local Runtime* g_rt = nullptr;
inline thread_local std::string g_last_error;
inline Runtime& rt() { return *g_rt; }

inline void switch_to_scheduler(Fiber* f) {
#if CUDASHIM_TSAN
    __tsan_switch_to_fiber(rt().sched_tsan_fiber, 1 /* no sync */);
#endif
#if CUDASHIM_ASAN
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, nullptr, 0);
    swapcontext(&f->ctx, &rt().sched_ctx);
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
    swapcontext(&f->ctx, &rt().sched_ctx);
#endif
}

// Record the first error and leave the fiber for good (its stack is reused by the next launch).
[[noreturn]] inline void fail(const std::string& msg) {
    Runtime& r = rt();
    if (!r.failed) {
        r.failed = true;
        char where[160];
        std::snprintf(where, sizeof where, " [block (%u,%u,%u), thread %u]", r.block_idx.x, r.block_idx.y,
                      r.block_idx.z, r.current ? r.current->tid : 0u);
        r.error = msg + where;
    }
    Fiber* f = r.current;
    f->state = kDone;
    switch_to_scheduler(f);
    std::abort();  // never resumed
}

inline void yield_now() { switch_to_scheduler(rt().current); }

inline void syncthreads(int line) {
    Runtime& r = rt();
    Fiber* f = r.current;
    f->state = kAtBarrier;
    f->wait_line = line;
#if CUDASHIM_TSAN
    __tsan_release(&r.at_barrier);
#endif
    if (++r.at_barrier + r.done == (int)r.nthreads) {
        if (r.done > 0) fail("__syncthreads at line " + std::to_string(line) + " after " +
                             std::to_string(r.done) + " thread(s) of the block exited");
        for (auto& g : r.fibers) {
            if (g.wait_line != line) {
                fail("divergent __syncthreads: thread " + std::to_string(g.tid) + " waits at line " +
                     std::to_string(g.wait_line) + ", others at line " + std::to_string(line));
            }
        }
        for (auto& g : r.fibers) g.state = kRunnable;
        r.at_barrier = 0;
    }
    yield_now();
#if CUDASHIM_TSAN
    __tsan_acquire(&r.at_barrier);
#endif
}

inline float half_bits_to_float(uint32_t bits, bool bf16) {
    if (bf16) {
        uint32_t u = bits << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
    _Float16 h;
    const uint16_t b = (uint16_t)bits;
    std::memcpy(&h, &b, 2);
    return (float)h;
}

inline bool in_dynamic_smem(const Runtime& r, const void* p, size_t bytes) {
    const unsigned char* c = (const unsigned char*)p;
    const unsigned char* lo = r.smem_alloc + kGuardBytes;
    return c >= lo && c + bytes <= lo + r.smem_bytes;
}

// mma.sync m16n8k16 (row.col, f32 accumulators) and ldmatrix.x4, computed for the whole warp once every
// lane has arrived, from the fragments as the PTX ISA lays them out (lane = 4 * group + t):
//   A (16x16): a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..)  [low half = lower column]
//   B (16x8):  b0 (k = 2t..2t+1, n = g), b1 (k = 2t+8.., n = g)
//   C, D:      c0 (g, 2t), c1 (g, 2t+1), c2 (g+8, 2t), c3 (g+8, 2t+1)
//   ldmatrix.x4: lanes 8m..8m+7 give the row addresses of matrix m (8 rows of 16 bytes); register m of
//   lane i holds row i/4, halves 2(i%4)..+1 (.trans: rows 2(i%4) and 2(i%4)+1, column i/4).
inline void complete_matrix(Runtime& r, WarpSlot& w, unsigned warp, int kind, const std::string& where) {
    if (w.mask != 0xffffffffu) fail("mma/ldmatrix" + where + ": needs the whole warp (.aligned)");
    if (kind == kMmaF16 || kind == kMmaBf16) {
        const bool bf16 = kind == kMmaBf16;
        float a[16][16], b[16][8];
        for (unsigned l = 0; l < 32; ++l) {
            const unsigned g = l >> 2, t = l & 3;
            const uint32_t* p = w.payload[l];
            const unsigned ar[4] = {g, g + 8, g, g + 8}, ac[4] = {2 * t, 2 * t, 2 * t + 8, 2 * t + 8};
            for (int i = 0; i < 4; ++i) {
                a[ar[i]][ac[i]] = half_bits_to_float(p[i] & 0xffffu, bf16);
                a[ar[i]][ac[i] + 1] = half_bits_to_float(p[i] >> 16, bf16);
            }
            for (int i = 0; i < 2; ++i) {
                b[2 * t + 8 * i][g] = half_bits_to_float(p[4 + i] & 0xffffu, bf16);
                b[2 * t + 8 * i + 1][g] = half_bits_to_float(p[4 + i] >> 16, bf16);
            }
        }
        for (unsigned l = 0; l < 32; ++l) {
            const unsigned g = l >> 2, t = l & 3;
            Fiber& f = r.fibers[warp * 32 + l];
            for (int i = 0; i < 4; ++i) {
                const unsigned row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
                float acc;
                std::memcpy(&acc, &w.payload[l][6 + i], 4);
                for (int k = 0; k < 16; ++k) acc += a[row][k] * b[k][col];
                std::memcpy(&f.matrix[i], &acc, 4);
            }
            f.state = kRunnable;
        }
        return;
    }
    for (unsigned l = 0; l < 32; ++l) {
        const void* p = (const void*)(uintptr_t)w.values[l];
        if ((uintptr_t)p % 16 || !in_dynamic_smem(r, p, 16)) {
            fail("ldmatrix" + where + ": lane " + std::to_string(l) +
                 " gives a row address that is not 16-byte aligned dynamic shared memory");
        }
    }
    for (unsigned l = 0; l < 32; ++l) {
        Fiber& f = r.fibers[warp * 32 + l];
        for (unsigned m = 0; m < 4; ++m) {
            if (kind == kLdsm) {
                const unsigned char* row = (const unsigned char*)(uintptr_t)w.values[8 * m + l / 4];
                std::memcpy(&f.matrix[m], row + 4 * (l % 4), 4);
            } else {
                const unsigned char* r0 = (const unsigned char*)(uintptr_t)w.values[8 * m + 2 * (l % 4)];
                const unsigned char* r1 = (const unsigned char*)(uintptr_t)w.values[8 * m + 2 * (l % 4) + 1];
                uint16_t lo, hi;
                std::memcpy(&lo, r0 + 2 * (l / 4), 2);
                std::memcpy(&hi, r1 + 2 * (l / 4), 2);
                f.matrix[m] = (uint32_t)lo | ((uint32_t)hi << 16);
            }
        }
        f.state = kRunnable;
    }
}

// A warp collective: every lane named in `mask` must arrive with the same kind, mask and width.
inline uint64_t collective(int kind, int line, unsigned mask, uint64_t value, int arg, int width) {
    Runtime& r = rt();
    Fiber* f = r.current;
    const unsigned lane = f->tid & 31u;
    const unsigned warp = f->tid >> 5;
    WarpSlot& w = r.warps[warp];
    const unsigned lanes_in_warp = std::min(32u, r.nthreads - warp * 32u);
    const unsigned existing = lanes_in_warp == 32 ? 0xffffffffu : ((1u << lanes_in_warp) - 1u);
    const std::string where = " at line " + std::to_string(line);
    if (!(mask >> lane & 1u)) fail("warp collective" + where + ": mask does not name the calling lane");
    if (mask & ~existing) fail("warp collective" + where + ": mask names lanes the block does not have");
    if (width <= 0 || width > 32 || (width & (width - 1))) fail("warp collective" + where + ": bad width");
    for (unsigned l = 0; l < 32; ++l) {
        if ((mask >> l & 1u) && r.fibers[warp * 32 + l].state == kDone) {
            fail("warp collective" + where + ": lane " + std::to_string(l) + " named in the mask has exited");
        }
    }
    if (w.arrived == 0) {
        w.kind = kind; w.mask = mask; w.line = line; w.width = width;
    } else if (w.kind != kind || w.mask != mask || w.width != width) {
        char buf[200];
        std::snprintf(buf, sizeof buf, ": lane %u (kind %d, mask %08x, width %d) meets lanes at line %d "
                      "(kind %d, mask %08x, width %d)", lane, kind, mask, width, w.line, w.kind, w.mask, w.width);
        fail("mismatched warp collective" + where + buf);
    }
    w.values[lane] = value;
    w.args[lane] = arg;
    w.arrived |= 1u << lane;
#if CUDASHIM_TSAN
    __tsan_release(&w);
#endif
    if ((w.arrived & mask) == mask && kind >= kMmaF16) {
        complete_matrix(r, w, warp, kind, where);
        w.arrived = 0;
    } else if ((w.arrived & mask) == mask) {
        for (unsigned l = 0; l < 32; ++l) {
            if (!(mask >> l & 1u)) continue;
            const unsigned seg = l & ~(unsigned)(w.width - 1);
            unsigned src = l;
            const int a = w.args[l];
            if (kind == kShflXor) src = l ^ (unsigned)a;
            else if (kind == kShfl) src = seg + ((unsigned)a & (unsigned)(w.width - 1));
            else if (kind == kShflDown) src = l + (unsigned)a;
            else if (kind == kShflUp) src = l - (unsigned)a;
            if (kind != kSyncWarp) {
                if (src < seg || src >= seg + (unsigned)w.width) src = l;  // outside the segment: own value
                if (!(mask >> src & 1u)) {
                    fail("shuffle" + where + ": lane " + std::to_string(l) + " reads lane " +
                         std::to_string(src) + ", which is not in the mask");
                }
            }
            Fiber& g = r.fibers[warp * 32 + l];
            g.result = w.values[src];
            g.state = kRunnable;
        }
        w.arrived = 0;
    } else {
        f->state = kAtWarp;
        f->wait_line = line;
    }
    yield_now();
#if CUDASHIM_TSAN
    __tsan_acquire(&w);
#endif
    return f->result;
}

template <typename T> inline uint64_t to_bits(T v) {
    static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
    uint64_t b = 0;
    std::memcpy(&b, &v, sizeof(T));
    return b;
}
template <typename T> inline T from_bits(uint64_t b) {
    T v;
    std::memcpy(&v, &b, sizeof(T));
    return v;
}

inline unsigned char* dynamic_smem() { return rt().smem_alloc + kGuardBytes; }

inline Fiber* pick(Runtime& r) {
    const int n = (int)r.nthreads;
    switch (r.schedule) {
        case kReverse:
            for (int i = n - 1; i >= 0; --i) if (r.fibers[i].state == kRunnable) return &r.fibers[i];
            return nullptr;
        case kRandom: {
            int count = 0;
            for (auto& f : r.fibers) count += f.state == kRunnable;
            if (!count) return nullptr;
            int k = (int)(r.rng() % (unsigned)count);
            for (auto& f : r.fibers) if (f.state == kRunnable && k-- == 0) return &f;
            return nullptr;
        }
        case kWarpAhead: {  // the lead warp first, as far as it gets; the others lag, last warp first
            const int lo = (int)r.lead_warp * 32, hi = std::min(n, lo + 32);
            for (int i = lo; i < hi; ++i) if (r.fibers[i].state == kRunnable) return &r.fibers[i];
            for (int i = n - 1; i >= 0; --i) if (r.fibers[i].state == kRunnable) return &r.fibers[i];
            return nullptr;
        }
        default:
            for (int i = 0; i < n; ++i) if (r.fibers[i].state == kRunnable) return &r.fibers[i];
            return nullptr;
    }
}

inline void fiber_main() {
    Runtime& r = rt();
#if CUDASHIM_ASAN
    __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
    r.body(r.body_arg);
    Fiber* f = r.current;
    f->state = kDone;
    ++r.done;
    if (r.at_barrier > 0 && r.at_barrier + r.done == (int)r.nthreads) {
        fail("thread " + std::to_string(f->tid) + " exited while others wait at __syncthreads (line " +
             std::to_string(r.fibers[0].wait_line) + "): barrier after an early return");
    }
    switch_to_scheduler(f);
    std::abort();
}

inline std::string deadlock_report(Runtime& r) {
    std::string s = "deadlock: no runnable thread;";
    int shown = 0;
    for (auto& f : r.fibers) {
        if (f.state == kDone || shown >= 8) continue;
        s += " thread " + std::to_string(f.tid) + (f.state == kAtBarrier ? " at __syncthreads" : " in a warp collective") +
             " line " + std::to_string(f.wait_line) + ";";
        ++shown;
    }
    return s;
}

inline void run_block(Runtime& r) {
    std::memset(r.smem_alloc, 0xff, r.smem_bytes + 2 * kGuardBytes);
    r.at_barrier = 0;
    r.done = 0;
    for (auto& w : r.warps) w.arrived = 0;
    for (unsigned t = 0; t < r.nthreads; ++t) {
        Fiber& f = r.fibers[t];
        f.tid = t;
        f.idx = {t % r.block.x, (t / r.block.x) % r.block.y, t / (r.block.x * r.block.y)};
        f.state = kRunnable;
        f.wait_line = 0;
        f.copies.clear();
        f.next_group = 0;
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack;
        f.ctx.uc_stack.ss_size = kStackBytes;
        f.ctx.uc_link = nullptr;
        makecontext(&f.ctx, fiber_main, 0);
#if CUDASHIM_TSAN
        if (!f.tsan_fiber) f.tsan_fiber = __tsan_create_fiber(0);
#endif
    }
    while (!r.failed) {
        Fiber* f = pick(r);
        if (!f) {
            if (r.done != (int)r.nthreads) {
                r.failed = true;
                r.error = deadlock_report(r);
            }
            break;
        }
        r.current = f;
#if CUDASHIM_TSAN
        __tsan_switch_to_fiber(f->tsan_fiber, 1);
#endif
#if CUDASHIM_ASAN
        void* fake = nullptr;
        __sanitizer_start_switch_fiber(&fake, f->stack, kStackBytes);
        swapcontext(&r.sched_ctx, &f->ctx);
        __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
        swapcontext(&r.sched_ctx, &f->ctx);
#endif
    }
    r.current = nullptr;
    if (r.failed) return;
    for (auto& f : r.fibers) {
        if (f.tid < r.nthreads && !f.copies.empty()) {
            r.failed = true;
            r.error = "thread " + std::to_string(f.tid) + " exited with " + std::to_string(f.copies.size()) +
                      " cp.async copies never waited for (cp.async.wait_group)";
            return;
        }
    }
    for (size_t i = 0; i < kGuardBytes; ++i) {
        if (r.smem_alloc[i] != 0xff || r.smem_alloc[kGuardBytes + r.smem_bytes + i] != 0xff) {
            r.failed = true;
            r.error = std::string("dynamic shared memory written out of range (") +
                      (r.smem_alloc[i] != 0xff ? "before the start" : "past the end") + ")";
            return;
        }
    }
}

inline Runtime& runtime_for(unsigned nthreads) {
    static thread_local Runtime* rt_ = nullptr;  // test-only shim: one runtime per OS thread
    if (!rt_) rt_ = new Runtime();
    Runtime& r = *rt_;
    while (r.stacks.size() < nthreads) {
        const size_t page = 4096;
        char* p = (char*)mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) std::abort();
        mprotect(p, page, PROT_NONE);  // guard page below the stack
        r.stacks.push_back(p + page);
    }
    if (r.fibers.size() < nthreads) r.fibers.resize(nthreads);
    for (unsigned t = 0; t < nthreads; ++t) r.fibers[t].stack = r.stacks[t];
#if CUDASHIM_TSAN
    if (!r.sched_tsan_fiber) r.sched_tsan_fiber = __tsan_get_current_fiber();
#endif
    return r;
}

inline int run_grid(const LaunchConfig* c, void (*body)(void*), void* arg) {
    const unsigned nthreads = c->block[0] * c->block[1] * c->block[2];
    if (nthreads == 0 || nthreads > 1024) { g_last_error = "bad block size " + std::to_string(nthreads); return 1; }
    if (c->shared_mem < 0 || (size_t)c->shared_mem > kMaxSharedBytes) {
        g_last_error = "dynamic shared memory " + std::to_string(c->shared_mem) + " bytes exceeds 227 KiB";
        return 1;
    }
    Runtime& r = runtime_for(nthreads);
    Runtime* saved = g_rt;
    g_rt = &r;
    r.grid = dim3(c->grid[0], c->grid[1], c->grid[2]);
    r.block = dim3(c->block[0], c->block[1], c->block[2]);
    r.nthreads = nthreads;
    r.warps.assign((nthreads + 31) / 32, WarpSlot());
    r.schedule = c->schedule;
    r.rng.seed((unsigned)c->seed);
    r.failed = false;
    r.error.clear();
    r.body = body;
    r.body_arg = arg;
    r.smem_bytes = (size_t)c->shared_mem;
    std::vector<unsigned char> smem(r.smem_bytes + 2 * kGuardBytes);
    r.smem_alloc = smem.data();
    const unsigned nwarps = (nthreads + 31) / 32;
    unsigned long long linear = 0;
    for (unsigned z = 0; z < r.grid.z && !r.failed; ++z)
        for (unsigned y = 0; y < r.grid.y && !r.failed; ++y)
            for (unsigned x = 0; x < r.grid.x && !r.failed; ++x) {
                r.block_idx = {x, y, z};
                r.lead_warp = (unsigned)((linear++ + (unsigned)c->seed) % nwarps);
                run_block(r);
            }
    r.smem_alloc = nullptr;
    g_rt = saved;
    if (r.failed) { g_last_error = r.error; return 1; }
    return 0;
}

// Unpack `args` (pointers to each argument's bytes, as ctypes passes them) into the kernel's
// parameter types, after checking their number and widths, and run the grid.
template <typename... A, size_t... I>
inline int launch_impl(void (*fn)(A...), const LaunchConfig* c, void** args, std::index_sequence<I...>) {
    std::tuple<std::decay_t<A>...> values{*static_cast<std::decay_t<A>*>(args[I])...};
    struct Call { void (*fn)(A...); std::tuple<std::decay_t<A>...>* values; };
    Call call{fn, &values};
    return run_grid(c, [](void* p) { Call* k = (Call*)p; std::apply(k->fn, *k->values); }, &call);
}

template <typename... A>
inline int launch(void (*fn)(A...), const char* name, const LaunchConfig* c, void** args,
                  const long long* arg_bytes, int nargs) {
    constexpr size_t sizes[] = {sizeof(std::decay_t<A>)..., 0};
    if (nargs != (int)sizeof...(A)) {
        g_last_error = std::string(name) + ": " + std::to_string(nargs) + " arguments given, kernel takes " +
                       std::to_string(sizeof...(A));
        return 1;
    }
    for (int i = 0; i < nargs; ++i) {
        if ((size_t)arg_bytes[i] != sizes[i]) {
            g_last_error = std::string(name) + ": argument " + std::to_string(i) + " has " +
                           std::to_string(arg_bytes[i]) + " bytes, kernel expects " + std::to_string(sizes[i]);
            return 1;
        }
    }
    return launch_impl(fn, c, args, std::index_sequence_for<A...>{});
}

}  // namespace cudashim

extern "C" inline const char* cudashim_last_error() { return cudashim::g_last_error.c_str(); }

// Built-in variables and synchronisation, as device code spells them.
#define threadIdx (::cudashim::rt().current->idx)
#define blockIdx (::cudashim::rt().block_idx)
#define blockDim (::cudashim::rt().block)
#define gridDim (::cudashim::rt().grid)
#define __syncthreads() ::cudashim::syncthreads(__LINE__)
#define __syncwarp(...) ::cudashim::syncwarp_(__LINE__, ##__VA_ARGS__)
#define __shfl_xor_sync(mask, v, lm, ...) ::cudashim::shfl_(::cudashim::kShflXor, __LINE__, mask, v, lm, ##__VA_ARGS__)
#define __shfl_sync(mask, v, src, ...) ::cudashim::shfl_(::cudashim::kShfl, __LINE__, mask, v, src, ##__VA_ARGS__)
#define __shfl_down_sync(mask, v, d, ...) ::cudashim::shfl_(::cudashim::kShflDown, __LINE__, mask, v, d, ##__VA_ARGS__)
#define __shfl_up_sync(mask, v, d, ...) ::cudashim::shfl_(::cudashim::kShflUp, __LINE__, mask, v, d, ##__VA_ARGS__)
namespace cudashim {
template <typename T>
inline T shfl_(int kind, int line, unsigned mask, T v, int arg, int width = 32) {
    return from_bits<T>(collective(kind, line, mask, to_bits(v), arg, width));
}
inline void syncwarp_(int line, unsigned mask = 0xffffffffu) { collective(kSyncWarp, line, mask, 0, 0, 32); }

// Tensor-core and async-copy instructions, for cuda/common.cuh's wrappers (HFP_CUDASHIM).
inline void mma_16816(int line, bool bf16, float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                      const float (&c)[4]) {
    Runtime& r = rt();
    uint32_t* p = r.warps[r.current->tid >> 5].payload[r.current->tid & 31u];
    for (int i = 0; i < 4; ++i) p[i] = a[i];
    p[4] = b[0];
    p[5] = b[1];
    for (int i = 0; i < 4; ++i) std::memcpy(&p[6 + i], &c[i], 4);
    collective(bf16 ? kMmaBf16 : kMmaF16, line, 0xffffffffu, 0, 0, 32);
    for (int i = 0; i < 4; ++i) std::memcpy(&d[i], &r.current->matrix[i], 4);
}

inline void ldsm_x4(int line, bool trans, unsigned (&out)[4], const void* row) {
    collective(trans ? kLdsmTrans : kLdsm, line, 0xffffffffu, (uint64_t)(uintptr_t)row, 0, 32);
    for (int i = 0; i < 4; ++i) out[i] = rt().current->matrix[i];
}

// cp.async.cg 16 bytes (fill = false: zeros, the source is not read). The destination is poisoned at
// issue and written only when the issuing thread waits for the copy's group.
inline void cp_async(void* dst, const void* src, int bytes, bool fill) {
    Runtime& r = rt();
    if ((uintptr_t)dst % bytes || (fill && (uintptr_t)src % bytes)) {
        fail("cp.async of " + std::to_string(bytes) + " bytes: misaligned source or destination");
    }
    if (!in_dynamic_smem(r, dst, (size_t)bytes)) fail("cp.async destination outside dynamic shared memory");
    std::memset(dst, 0xff, (size_t)bytes);
    r.current->copies.push_back({(unsigned char*)dst, fill ? (const unsigned char*)src : nullptr, bytes, -1});
}
inline void cp_async_commit() {
    Fiber* f = rt().current;
    for (auto& c : f->copies) if (c.group < 0) c.group = f->next_group;
    ++f->next_group;
}
// cp.async.wait_group n: every copy of a committed group but the n most recent is complete.
inline void cp_async_wait(int n) {
    Fiber* f = rt().current;
    const int last_done = f->next_group - 1 - n;
    std::vector<AsyncCopy> pending;
    for (auto& c : f->copies) {
        if (c.group >= 0 && c.group <= last_done) {
            if (c.src) std::memcpy(c.dst, c.src, (size_t)c.bytes);
            else std::memset(c.dst, 0, (size_t)c.bytes);
        } else {
            pending.push_back(c);
        }
    }
    f->copies.swap(pending);
}
}  // namespace cudashim
#define HFP_CUDASHIM 1

// Dynamic shared memory (the kernels' one way to declare it) and the per-kernel launcher export.
#define HFP_DYNAMIC_SMEM(name) unsigned char* name = ::cudashim::dynamic_smem()
#define HFP_EXPORT_LAUNCHER(name)                                                                    \
    extern "C" int name##__launch(const cudashim::LaunchConfig* c, void** args, const long long* bytes, \
                                  int nargs) {                                                       \
        return cudashim::launch(&name, #name, c, args, bytes, nargs);                                \
    }
