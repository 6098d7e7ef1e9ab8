// Inner loops of paged attention on one tile: R query rows (R <= kTileRows,
// a compile-time count so the row accumulators live in registers) against
// consecutive keys of one KV-cache block. Written against vec.h, so every
// variant has them; ISA folders add faster QK^T paths (attention_x86.h).
//
// Accumulators are separate named variables rather than an array because SVE
// vectors are sizeless types that cannot be array elements.
#pragma once
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "aligned.h"
#include "vec.h"

namespace cpuinfer::attn {

constexpr int kTileRows = vec::kAttnRows;  // accumulator rows that fit the layer's registers

// Prefetches a byte range a little at a time, about `per` bytes (whole
// cache lines) per call of next() in some loop, so that the reads of a later
// phase are in flight while this one computes, without a burst that fills
// the miss queue. rest() issues whatever is left. An empty one does nothing.
// pace(steps): a loop that calls next() at its own rate spreads what is left
// over its `steps` calls instead.
struct Prefetch {
    const char *p = nullptr, *end = nullptr;
    int64_t per = 0;
    Prefetch() = default;
    Prefetch(const void *ptr, int64_t bytes, int64_t per_step)
        : p(static_cast<const char *>(ptr)), end(p + bytes), per(whole_lines(per_step)) {}
    void pace(int64_t steps) { per = whole_lines((end - p + steps - 1) / std::max<int64_t>(steps, 1)); }
    void next() {
        const char *e = end - p > per ? p + per : end;
        for (; p < e; p += tuning::kCacheLine) __builtin_prefetch(p);
    }
    void rest() {
        for (; p < end; p += tuning::kCacheLine) __builtin_prefetch(p);
    }
    static int64_t whole_lines(int64_t bytes) {
        return (bytes + tuning::kCacheLine - 1) / tuning::kCacheLine * tuning::kCacheLine;
    }
};

// Prefetches a few byte ranges (up to kMax; the rest are dropped) into L2,
// `per` bytes per call of next() across them in order: the next unit's key
// and value rows while a thread works on this unit (see paged_attention.cpp's
// run_unit). Every line: prefetching one in two or four, for the L2's own
// prefetchers to fill in, left the next unit colder (a W2-like decode layer
// 0.30 -> 0.36-0.38 ms), and into L1 (T0) or non-temporally was slower still.
struct PrefetchRanges {
    static constexpr int kMax = 16;
    const char *p[kMax], *end[kMax];
    int n = 0, cur = 0;
    int64_t per = 0;
    void add(const void *ptr, int64_t bytes) {
        if (n == kMax || bytes <= 0) return;
        p[n] = static_cast<const char *>(ptr), end[n] = p[n] + bytes, ++n;
    }
    int64_t bytes() const {
        int64_t b = 0;
        for (int i = cur; i < n; ++i) b += end[i] - p[i];
        return b;
    }
    void next() {
        for (int64_t budget = per; cur < n && budget > 0; ++cur) {
            for (; p[cur] < end[cur] && budget > 0; p[cur] += tuning::kCacheLine, budget -= tuning::kCacheLine)
                __builtin_prefetch(p[cur], 0, 2);
            if (p[cur] < end[cur]) return;
        }
    }
};

// Calls f(std::integral_constant<int, R>) for the runtime row count r.
template <typename F>
inline void with_rows(int r, F &&f) {
    switch (r) {
        case 1: f(std::integral_constant<int, 1>{}); break;
        case 2: f(std::integral_constant<int, 2>{}); break;
        case 3: f(std::integral_constant<int, 3>{}); break;
        case 4: f(std::integral_constant<int, 4>{}); break;
        case 5: f(std::integral_constant<int, 5>{}); break;
        case 6: f(std::integral_constant<int, 6>{}); break;
        case 7: f(std::integral_constant<int, 7>{}); break;
        case 8: f(std::integral_constant<int, 8>{}); break;
#define CPUINFER_WIDE_ROWS(i) \
    case i:                   \
        if constexpr (i <= kTileRows) f(std::integral_constant<int, i>{}); \
        break;
        CPUINFER_WIDE_ROWS(9) CPUINFER_WIDE_ROWS(10) CPUINFER_WIDE_ROWS(11) CPUINFER_WIDE_ROWS(12)
        CPUINFER_WIDE_ROWS(13) CPUINFER_WIDE_ROWS(14) CPUINFER_WIDE_ROWS(15) CPUINFER_WIDE_ROWS(16)
#undef CPUINFER_WIDE_ROWS
        default: break;
    }
}

// Applies OP(i) for i in [0, R): the row loop, unrolled at compile time.
#define CPUINFER_ROWS(OP) \
    OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7) OP(8) OP(9) OP(10) OP(11) OP(12) OP(13) OP(14) OP(15)

// How many keys (QK) or output chunks (PV) a tile of R rows works on at
// once: FMA latency is ~4 cycles, so a loop needs about 8 independent
// accumulator chains to keep both FMA pipes busy, within the register budget
// (kTileRows is 16 where there are 32 vector registers, 8 where 16): a
// decode's few rows (a GQA group of 3 or 4) take four keys at a time. Only
// the schedule: every lane's chain of FMAs and every reduction are the same.
// Measured (Skylake-SP, avx512, one decode layer at SmolLM2's heads, 16384
// keys in cache, 2 threads): 1.147 -> 1.050 ms with four keys for 3 rows.
template <int R>
constexpr int unroll() {
    return R <= kTileRows / 4 ? 4 : R <= kTileRows / 2 ? 2 : 1;
}

// The lane order in which attention reads a cache of element type C: 2 * width() elements of a key or value
// row as two vectors a(p), b(p), and the f32 query rows and output accumulators that meet them kept in the
// same order (pair_order / natural_order, in place over whole 2 * width() chunks, the tail natural). By
// default the vector layer's load2a/b; an ISA attention header may choose another order for attention alone
// (attention_x86.h: bf16 and fp8 as even/odd lanes on AVX-512 without BF16), where the vector layer keeps
// natural order for its other users.
template <typename C>
struct KvLanes {
    static vec::vf a(const C *p) { return vec::load2a(p); }
    static vec::vf b(const C *p) { return vec::load2b(p); }
    static void pair_order(float *x, int64_t n) { vec::pair_order(x, n, static_cast<const C *>(nullptr)); }
    static void natural_order(float *x, int64_t n) { vec::natural_order(x, n, static_cast<const C *>(nullptr)); }
};

// Head dimensions are walked as whole KvLanes pairs (keys and values in the
// cheapest lane order for C, one half at a time), then single vectors.
// Query rows and output accumulators are kept in the matching order
// (KvLanes<C>::pair_order), so every product meets its own element.
// BODY(LD, ck, cq) handles the W elements at offset ck of a key/value row
// (loaded with LD) and at offset cq of a query/accumulator row.
#define CPUINFER_HEAD_DIM_LOOP(BODY)                 \
    {                                                \
        int64_t c_ = 0;                              \
        for (; c_ + 2 * W <= Dv; c_ += 2 * W) {      \
            BODY(KvLanes<C>::a, c_, c_)              \
            BODY(KvLanes<C>::b, c_, c_ + W)          \
        }                                            \
        for (; c_ < Dv; c_ += W) { BODY(load, c_, c_) } \
    }

// s[r * s_stride + j] = dot(q[r * D ..], k[j * D ..]) for j in [j0, j1); q rows in pair order.
// Calls pf.next() once per key.
template <int R, typename C>
inline void qk_tile(const float *q, int64_t D, const C *k, int64_t j0, int64_t j1, float *s, int64_t s_stride,
                    Prefetch &pf) {
    using namespace vec;
    constexpr int U = unroll<R>();
    const int64_t W = width();
    const int64_t Dv = D - D % W;
    // Where the layer reduces 16 vectors at once (vec.h's reduce_add16), the keys of each whole run of 16
    // from j0 keep their rows' accumulators here and are reduced together at the run's end; the same bits
    // as one by one. (Such a layer's width is kReduceKeys; the size is 1 where there is none.)
    constexpr int kRun = kReduceKeys > 0 ? 16 : 1;
    alignas(64) float part[R][kRun * (kReduceKeys > 0 ? kReduceKeys : 1)];
    int64_t j = j0;
    for (; j + U <= j1; j += U) {
        const C *kj = k + j * D;
        for (int u = 0; u < U; ++u) pf.next();
#define DECL(i) vf a##i = zero(), b##i = zero(), c##i = zero(), d##i = zero();
        CPUINFER_ROWS(DECL)
#undef DECL
#define BODY(LD, ck, cq)                                                              \
        {                                                                             \
            const int64_t cq_ = cq;                                                   \
            vf k0 = LD(kj + ck), k1 = k0, k2 = k0, k3 = k0;                           \
            if constexpr (U >= 2) k1 = LD(kj + D + ck);                               \
            if constexpr (U >= 4) k2 = LD(kj + 2 * D + ck), k3 = LD(kj + 3 * D + ck); \
            CPUINFER_ROWS(STEP)                                                       \
        }
#define STEP(i)                                                                       \
    if constexpr (i < R) {                                                            \
        vf qv = in_register(load(q + i * D + cq_));                                   \
        a##i = fma(qv, k0, a##i);                                                     \
        if constexpr (U >= 2) b##i = fma(qv, k1, b##i);                               \
        if constexpr (U >= 4) c##i = fma(qv, k2, c##i), d##i = fma(qv, k3, d##i);     \
    }
        CPUINFER_HEAD_DIM_LOOP(BODY)
#undef STEP
#undef BODY
        if constexpr (kReduceKeys > 0) {
            const int64_t run = j0 + (j - j0) / 16 * 16;  // the run of 16 keys that j is in
            if (run + 16 <= j1) {
                const int64_t at = (j - run) * W;
#define OUT(i)                                                                                 \
    if constexpr (i < R) {                                                                     \
        store(part[i] + at, a##i);                                                             \
        if constexpr (U >= 2) store(part[i] + at + W, b##i);                                   \
        if constexpr (U >= 4) store(part[i] + at + 2 * W, c##i), store(part[i] + at + 3 * W, d##i); \
    }
                CPUINFER_ROWS(OUT)
#undef OUT
                if (j + U == run + 16)
                    for (int r = 0; r < R; ++r) reduce_add16(part[r], s + r * s_stride + run);
                continue;
            }
        }
        // The R x U sums, four at a time (reduce_add4: one transposed
        // reduction): a row's four keys (U = 4), two rows' two keys (U = 2)
        // or four rows' key (U = 1).
        float t[4];
        if constexpr (U == 4) {
#define OUT(i) if constexpr (i < R) reduce_add4(a##i, b##i, c##i, d##i, s + i * s_stride + j);
            CPUINFER_ROWS(OUT)
#undef OUT
        } else if constexpr (U == 2) {
#define OUT(i, k)                                                                             \
    if constexpr (k < R) {                                                                    \
        reduce_add4(a##i, b##i, a##k, b##k, t);                                               \
        s[i * s_stride + j] = t[0], s[i * s_stride + j + 1] = t[1];                           \
        s[k * s_stride + j] = t[2], s[k * s_stride + j + 1] = t[3];                           \
    } else if constexpr (i < R) {                                                             \
        s[i * s_stride + j] = reduce_add(a##i), s[i * s_stride + j + 1] = reduce_add(b##i);   \
    }
            OUT(0, 1) OUT(2, 3) OUT(4, 5) OUT(6, 7) OUT(8, 9) OUT(10, 11) OUT(12, 13) OUT(14, 15)
#undef OUT
        } else {
#define ONE(i) if constexpr (i < R) s[i * s_stride + j] = reduce_add(a##i);
#define OUT(i, k, l, m)                                                  \
    if constexpr (m < R) {                                               \
        reduce_add4(a##i, a##k, a##l, a##m, t);                          \
        s[i * s_stride + j] = t[0], s[k * s_stride + j] = t[1];          \
        s[l * s_stride + j] = t[2], s[m * s_stride + j] = t[3];          \
    } else {                                                             \
        ONE(i) ONE(k) ONE(l)                                             \
    }
            OUT(0, 1, 2, 3) OUT(4, 5, 6, 7) OUT(8, 9, 10, 11) OUT(12, 13, 14, 15)
#undef ONE
#undef OUT
        }
    }
    for (; j < j1; ++j) {  // keys left over from the unrolled loop
        const C *kj = k + j * D;
        pf.next();
#define DECL(i) vf a##i = zero();
        CPUINFER_ROWS(DECL)
#undef DECL
#define BODY(LD, ck, cq)                  \
        {                                 \
            const int64_t cq_ = cq;       \
            vf kv = LD(kj + ck);          \
            CPUINFER_ROWS(STEP)           \
        }
#define STEP(i) if constexpr (i < R) a##i = fma(load(q + i * D + cq_), kv, a##i);
        CPUINFER_HEAD_DIM_LOOP(BODY)
#undef STEP
#undef BODY
#define OUT(i) if constexpr (i < R) s[i * s_stride + j] = reduce_add(a##i);
        CPUINFER_ROWS(OUT)
#undef OUT
    }
    if (Dv < D) {  // only when the vector width does not divide D (wide SVE)
        for (int64_t jj = j0; jj < j1; ++jj)
            for (int64_t c = Dv; c < D; ++c) {
                float kc = to_f32(k[jj * D + c]);
                for (int r = 0; r < R; ++r) s[r * s_stride + jj] += q[r * D + c] * kc;
            }
    }
}

// acc[r] = acc[r] * alpha[r] + sum_j p[r * p_stride + j] * v[j * D ..] for j in [j0, j1); acc rows in pair order.
// alpha null: no rescale (acc[r] += ...).
// Calls pf.next() once per width() output lanes.
template <int R, typename C>
inline void pv_tile(float *acc, int64_t D, const float *alpha, const float *p, int64_t p_stride, const C *v,
                    int64_t j0, int64_t j1, Prefetch &pf) {
    using namespace vec;
    constexpr int U = unroll<R>();
    const int64_t W = width();
    const int64_t Dv = D - D % W;
    const int64_t D2 = Dv - Dv % (2 * W);  // whole KvLanes pairs
    // acc[i * D + c ..] loaded and rescaled
    auto scaled = [&](int i, int64_t c) { return alpha ? mul(load(acc + i * D + c), splat(alpha[i])) : load(acc + i * D + c); };
    int64_t c = 0;
    if constexpr (U >= 2) {  // U * W is a whole number of pairs
        for (; c + U * W <= D2; c += U * W) {
            for (int u = 0; u < U; ++u) pf.next();
#define DECL(i)                                                                        \
    vf a##i = zero(), b##i = zero(), c##i = zero(), d##i = zero();                     \
    if constexpr (i < R) {                                                             \
        a##i = scaled(i, c);                                                           \
        b##i = scaled(i, c + W);                                                       \
        if constexpr (U >= 4) c##i = scaled(i, c + 2 * W), d##i = scaled(i, c + 3 * W); \
    }
            CPUINFER_ROWS(DECL)
#undef DECL
            for (int64_t j = j0; j < j1; ++j) {
                const C *vj = v + j * D + c;
                vf v0 = KvLanes<C>::a(vj), v1 = KvLanes<C>::b(vj), v2 = v0, v3 = v0;
                if constexpr (U >= 4) v2 = KvLanes<C>::a(vj + 2 * W), v3 = KvLanes<C>::b(vj + 2 * W);
#define STEP(i)                                                    \
    if constexpr (i < R) {                                         \
        vf pj = splat(p[i * p_stride + j]);                        \
        a##i = fma(pj, v0, a##i);                                  \
        b##i = fma(pj, v1, b##i);                                  \
        if constexpr (U >= 4) c##i = fma(pj, v2, c##i), d##i = fma(pj, v3, d##i); \
    }
                CPUINFER_ROWS(STEP)
#undef STEP
            }
#define OUT(i)                                                                   \
    if constexpr (i < R) {                                                       \
        store(acc + i * D + c, a##i);                                            \
        store(acc + i * D + c + W, b##i);                                        \
        if constexpr (U >= 4) store(acc + i * D + c + 2 * W, c##i), store(acc + i * D + c + 3 * W, d##i); \
    }
            CPUINFER_ROWS(OUT)
#undef OUT
        }
    }
    // Chunks left over from the unrolled loop (all of them when U == 1):
    // W accumulator lanes at offset ca, values loaded with LD at offset cv.
#define BODY(LD, cv, ca)                                                                       \
    {                                                                                          \
        const int64_t ca_ = ca, cv_ = cv;                                                      \
        pf.next();                                                                             \
        CPUINFER_ROWS(DECL)                                                                    \
        for (int64_t j = j0; j < j1; ++j) {                                                    \
            vf vv = LD(v + j * D + cv_);                                                       \
            CPUINFER_ROWS(STEP)                                                                \
        }                                                                                      \
        CPUINFER_ROWS(OUT)                                                                     \
    }
#define DECL(i) vf a##i = zero(); if constexpr (i < R) a##i = scaled(i, ca_);
#define STEP(i) if constexpr (i < R) a##i = fma(splat(p[i * p_stride + j]), vv, a##i);
#define OUT(i) if constexpr (i < R) store(acc + i * D + ca_, a##i);
    for (; c + 2 * W <= D2; c += 2 * W) {
        BODY(KvLanes<C>::a, c, c)
        BODY(KvLanes<C>::b, c, c + W)
    }
    for (; c < Dv; c += W) BODY(load, c, c)
#undef OUT
#undef STEP
#undef DECL
#undef BODY
    for (c = Dv; c < D; ++c) {
        for (int r = 0; r < R; ++r) {
            float a = alpha ? acc[r * D + c] * alpha[r] : acc[r * D + c];
            for (int64_t j = j0; j < j1; ++j) a += p[r * p_stride + j] * to_f32(v[j * D + c]);
            acc[r * D + c] = a;
        }
    }
}

#undef CPUINFER_HEAD_DIM_LOOP
#undef CPUINFER_ROWS

// ISA hooks of paged attention (paged_attention.cpp), with their portable
// defaults here; the vector layer's attention header (cmake/isa_table.json)
// specialises them for the types it speeds up.

// QK^T of raw bf16 query rows against bf16 keys, in two steps: pack() lays
// out the keys [j0, j1) of one block (k: its first key row; bs: the block
// size) in buf, once per block, and run<R>() then gives the scores of R query
// rows (q[r * D ..]) against keys [j0, j1) (inside pack's range) of them:
// s[r * ss + j]. run may also write other j < bs of the row (whole 16-key
// groups), which the caller never reads.
template <typename T, typename C>
struct QkBf16 {
    static constexpr bool kAvailable = false;
    static void pack(const bf16_t *, int64_t, int64_t, int64_t, int64_t, LineVector<uint32_t> &) {}
    template <int R>
    static void run(const bf16_t *, int64_t, const uint32_t *, int64_t, int64_t, float *, int64_t) {}
};

// The ISA's paths for units of many rows (a prefill chunk's share of a KV head), with the bits of the tiles
// above, so that a unit may take either path and a row's result does not depend on which (a prefill row
// against its decode). applies(D): the head sizes they handle.
//   pack() lays out the keys [j0, j1) of one block (k: its first key row) in buf, once per block for all the
//   unit's tiles; qk<R>() then gives the scores of R f32 query rows (in KvLanes<C>' order, as qk_tile
//   reads them) against them: s[r * ss + j] for j in [j0, j1), and possibly other j of the same 16-key
//   groups, never read. qk_tile's bits: every lane's chain of FMAs and the vector layer's reduce_add tree.
//   pv<R>() is pv_tile over all of [j0, j1) at once (alpha: the rescale, or null): pv_tile's bits, the same
//   chain of FMAs per output element. Both pace `pf` (Prefetch::pace) over their own loops.
template <typename C>
struct ManyRows {
    static constexpr bool kAvailable = false;
    static bool applies(int64_t) { return false; }
    static void pack(const C *, int64_t, int64_t, int64_t, int64_t, LineVector<float> &) {}
    template <int R>
    static void qk(const float *, int64_t, const float *, int64_t, int64_t, float *, int64_t, Prefetch &) {}
    template <int R>
    static void pv(float *, int64_t, const float *, const float *, int64_t, const C *, int64_t, int64_t, Prefetch &) {}
};

// One unit's query rows and running softmax state (natural d order), for a
// path that takes a whole unit at once.
struct FlashUnit {
    const bf16_t *q;     // [whole 16-row tiles][D] raw query rows (rows past `rows` readable, ignored)
    int64_t rows, D;
    const int64_t *pos;  // [rows] the position of each row's token
    int64_t k0, k1;      // the unit's keys
    int64_t window;      // sliding window (0: none)
    float qscale, soft_cap;
    float *m, *l, *acc;  // [rows], [rows], [rows][D]: the rows' softmax over [k0, k1), all set by the unit
    PrefetchRanges *ahead = nullptr;  // another unit's rows to fetch, a step at a time (next()), if any
};

// A whole unit at once where applies(rows, D); key(j) / value(j) give the
// cache rows of absolute key j (a run of keys whose end rows are as far
// apart as their keys times D is one straight run of rows: see
// flash_unit_amx).
template <typename T, typename C>
struct WholeUnit {
    static bool applies(int64_t, int64_t) { return false; }
    static constexpr int64_t kChunkRows = 64;  // query rows per unit (a group's share of a prefill chunk)
    template <typename KeyRow, typename ValueRow>
    static void run(const FlashUnit &, KeyRow &&, ValueRow &&) {}
};

// The name `attention_impl()` reports for this build's fast paths.
template <typename = void>
struct Impl {
    static constexpr const char *kName = "vec";
};

}  // namespace cpuinfer::attn

#if defined(CPUINFER_ATTENTION_HOOKS)
#include CPUINFER_ATTENTION_HOOKS
#endif

