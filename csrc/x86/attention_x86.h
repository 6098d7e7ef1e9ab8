// x86 fast paths for the QK^T and PV tiles of paged attention, used when the
// query and the KV cache are both bf16, and on amx for bf16 queries on an
// fp8_e5m2 cache too (products of bf16 values are exact in f32, so these
// paths only change the summation order):
//   avx512bf16: QK^T with VDPBF16PS (pairs of bf16 multiplied and summed into
//               f32) on keys transposed once per block, 16 keys to a vector; PV
//               on the vector layer's f32 FMAs (attention_tile.h)
//   amx:        every unit (any row count; head sizes that are multiples of 32)
//               as flash attention on AMX-BF16 tiles, QK^T and PV, the softmax
//               weights in two bf16 terms; other head sizes (80) as avx512bf16
// and on every variant of this layer, for units of many rows (a prefill
// chunk's) that no path above takes, any query and cache type: QK^T with 16
// keys across the lanes and PV with its accumulators in registers, with the
// portable tiles' bits (the ManyRows hook, below).
// Under CPUINFER_SIMDE_EMULATION (the C++ test program on CPUs without
// AVX-512) the same code runs on SIMDe and on a software model of the AMX
// tiles (amx_emulation.h).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "../common/vec.h"
#include "bf16_x86.h"

#if defined(__AVX512BF16__) || defined(CPUINFER_SIMDE_AVX512BF16)
#define CPUINFER_ATTN_DPBF16 1
#endif
#if defined(__AMX_BF16__) || defined(CPUINFER_SIMDE_AMX)
#define CPUINFER_ATTN_AMX 1
#endif


namespace cpuinfer::attn {

// 16 x 16 32-bit transpose of r[0..15] in place (AVX512F: every variant of this layer; the AMX path's
// flash_pack, the VDPBF16PS keys and the tree keys below use it).
inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    // Each 128-bit lane now holds a transposed 4 x 4 block; two rounds of
    // 128-bit shuffles put the blocks in place.
    for (int i = 0; i < 8; ++i) {
        const int a = (i / 4) * 8 + i % 4, b = a + 4;
        t[a] = _mm512_shuffle_i32x4(r[a], r[b], 0x88);
        t[b] = _mm512_shuffle_i32x4(r[a], r[b], 0xdd);
    }
    for (int i = 0; i < 8; ++i) {
        const int a = i, b = i + 8;
        r[a] = _mm512_shuffle_i32x4(t[a], t[b], 0x88);
        r[b] = _mm512_shuffle_i32x4(t[a], t[b], 0xdd);
    }
}

#if !defined(CPUINFER_ATTN_DPBF16)
// Without AVX512-BF16 (the avx512 variant), attention reads bf16 and fp8 caches as even/odd lanes, as the avx2
// layer does everywhere: 32 bf16 are one 64-byte load, the even ones a 16-bit shift of each 32-bit lane away
// from f32 and the odd ones a mask (fp8: 32 bytes, a shift or a mask of each 16-bit lane, then the f16
// conversion), where natural order widens every 16 through a cross-lane shuffle first (vpmovzxwd / vpmovzxbw).
// For attention alone: the vector layer keeps natural order for the GEMV and the norms, and the BF16 variants
// keep it for their VDPBF16PS and AMX paths, whose outputs are in natural order. Measured (Skylake-SP, one
// decode layer at SmolLM2's heads, 16384 keys, 2 threads, alternating builds in one process, medians of 60
// rounds, together with unroll()'s four keys for 3 rows): streamed from memory bf16 1.164-1.419 ->
// 1.122-1.352 ms (4-6%), fp8 1.235-1.242 -> 1.147-1.150 (7-8%); in cache bf16 1.200 -> 1.061.
struct KvLanesEvenOdd {
    // x[32c .. 32c + 32) from natural order to its 16 even elements then its 16 odd ones, and back.
    static void pair_order(float *x, int64_t n) {
        shuffle(x, n, _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30),
                _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31));
    }
    static void natural_order(float *x, int64_t n) {
        shuffle(x, n, _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23),
                _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31));
    }
    // Each whole 32 of x as (its lanes ia, its lanes ib) of the pair of vectors it is.
    static void shuffle(float *x, int64_t n, __m512i ia, __m512i ib) {
        for (int64_t i = 0; i + 32 <= n; i += 32) {
            const __m512 lo = _mm512_loadu_ps(x + i), hi = _mm512_loadu_ps(x + i + 16);
            _mm512_storeu_ps(x + i, _mm512_permutex2var_ps(lo, ia, hi));
            _mm512_storeu_ps(x + i + 16, _mm512_permutex2var_ps(lo, ib, hi));
        }
    }
};
template <>
struct KvLanes<bf16_t> : KvLanesEvenOdd {
    static vec::vf a(const bf16_t *p) { return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(p), 16))}; }
    static vec::vf b(const bf16_t *p) {
        return {_mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(p), _mm512_set1_epi32(int(0xffff0000u))))};
    }
};
template <>
struct KvLanes<fp8_e5m2_t> : KvLanesEvenOdd {
    static __m256i bytes(const fp8_e5m2_t *p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)); }
    static vec::vf a(const fp8_e5m2_t *p) { return {_mm512_cvtph_ps(_mm256_slli_epi16(bytes(p), 8))}; }
    static vec::vf b(const fp8_e5m2_t *p) {
        return {_mm512_cvtph_ps(_mm256_and_si256(bytes(p), _mm256_set1_epi16(int16_t(0xff00))))};
    }
};
#endif

// Head-dim step t (d = 16 t .. 16 t + 15 in natural order) of a cache row as qk_tile and pv_tile meet it: a
// half of a whole KvLanes pair of 32, or the natural 16 of a tail (D = 80's last).
template <typename C>
inline __m512 kv_step(const C *row, int64_t t, int64_t D) {
    const int64_t c = 32 * (t / 2);
    if (c + 32 > D) return vec::load(row + 16 * t).v;
    return (t % 2 ? KvLanes<C>::b(row + c) : KvLanes<C>::a(row + c)).v;
}

// QK^T with qk_tile's bits for units of many rows (attention_tile.h's ManyRows hook), on every variant of this
// layer. qk_tile gives a score as a dot product along d: lane l of a vector accumulates the chain
// k[l] q[l], k[16 + l] q[16 + l], ... in FMAs (in KvLanes' order: step t's lane l, kv_step), and reduce_add's
// tree sums the 16 lanes. That costs a horizontal reduction per score (reduce_add16: ~3 instructions a score
// beside its D / 16 FMAs, ~half of a prefill's QK time measured at SmolLM2's heads) and reloads every query
// vector per key. Here the keys lie across the lanes instead (16 keys to a vector, transposed once per block for
// all the unit's rows), each lane class's chain is one vector of 16 keys, and the tree is 15 vertical adds a
// row and 16 keys: the same products, chains and tree, so the same bits. Measured on a Skylake-SP (avx512
// variant, one thread, a 2048-token chunk after 2048 at SmolLM2's heads): QK^T ~208 -> ~93 ms of the chunk's
// time by perf samples, the chunk 378 -> 291 ms with this path alone.

// kt layout of a block's keys: for 16-key group g and head-dim step t (kv_step's 16 elements), 16 vectors, one
// per lane class l: lane l of step t of the group's 16 keys, at kt + ((g * T + t) * 16 + l) * 16 (T = D / 16).
inline int64_t tree_keys_size(int64_t D, int64_t bs) { return bs * D; }

// Packs the groups of a block's keys (k: its first key row) that hold keys [j0, j1): whole groups (block sizes
// are multiples of 16), the keys outside [j0, j1) from the block's memory; their scores are never read.
template <typename C>
inline void pack_keys_tree(const C *k, int64_t D, int64_t j0, int64_t j1, float *kt) {
    const int64_t T = D / 16;
    for (int64_t g = j0 / 16; g * 16 < j1; ++g) {
        const C *kg = k + g * 16 * D;
        for (int64_t t = 0; t < T; ++t) {
            __m512i r[16];
            for (int i = 0; i < 16; ++i) r[i] = _mm512_castps_si512(kv_step(kg + i * D, t, D));
            transpose16(r);
            float *dst = kt + (g * T + t) * 256;
            for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + i * 16, _mm512_castsi512_ps(r[i]));
        }
    }
}

// The sums of lane classes l and l + 8 (the tree's first level) for RB rows x NB groups from g: each class's
// chain over the head-dim steps in order, from zero, as qk_tile's accumulators.
template <int RB, int NB>
inline void tree_pairs(const float *q, int64_t D, const float *kt, int64_t g, int l, __m512 (&y)[RB][NB]) {
    const int64_t T = D / 16;
    __m512 a[RB][NB], b[RB][NB];
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
        for (int n = 0; n < NB; ++n) a[r][n] = b[r][n] = _mm512_setzero_ps();
    for (int64_t t = 0; t < T; ++t) {
        __m512 ka[NB], kb[NB];
#pragma GCC unroll 4
        for (int n = 0; n < NB; ++n) {
            const float *kt_n = kt + ((g + n) * T + t) * 256;
            ka[n] = _mm512_loadu_ps(kt_n + l * 16);
            kb[n] = _mm512_loadu_ps(kt_n + (l + 8) * 16);
        }
#pragma GCC unroll 4
        for (int r = 0; r < RB; ++r) {
            const __m512 qa = _mm512_set1_ps(q[r * D + 16 * t + l]), qb = _mm512_set1_ps(q[r * D + 16 * t + l + 8]);
#pragma GCC unroll 4
            for (int n = 0; n < NB; ++n) {
                a[r][n] = _mm512_fmadd_ps(qa, ka[n], a[r][n]);
                b[r][n] = _mm512_fmadd_ps(qb, kb[n], b[r][n]);
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
        for (int n = 0; n < NB; ++n) y[r][n] = _mm512_add_ps(a[r][n], b[r][n]);
}

template <int RB, int NB>
inline void add_into(__m512 (&x)[RB][NB], const __m512 (&y)[RB][NB]) {
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
        for (int n = 0; n < NB; ++n) x[r][n] = _mm512_add_ps(x[r][n], y[r][n]);
}

// s[r * ss + 16 (g + n) ..] for RB rows and NB groups from g: reduce_add's tree (vec_avx512.h) over the
// classes' sums, y_l = c_l + c_{l+8}, then ((y0 + y4) + (y2 + y6)) + ((y1 + y5) + (y3 + y7)).
template <int RB, int NB>
inline void qk_tree_groups(const float *q, int64_t D, const float *kt, int64_t g, float *s, int64_t ss) {
    __m512 x[RB][NB], y[RB][NB], z[RB][NB];
    tree_pairs<RB, NB>(q, D, kt, g, 0, x);
    tree_pairs<RB, NB>(q, D, kt, g, 4, y);
    add_into(x, y);  // y0 + y4
    tree_pairs<RB, NB>(q, D, kt, g, 2, y);
    tree_pairs<RB, NB>(q, D, kt, g, 6, z);
    add_into(y, z);  // y2 + y6
    add_into(x, y);  // the left half
    tree_pairs<RB, NB>(q, D, kt, g, 1, y);
    tree_pairs<RB, NB>(q, D, kt, g, 5, z);
    add_into(y, z);  // y1 + y5
    __m512 w[RB][NB];
    tree_pairs<RB, NB>(q, D, kt, g, 3, z);
    tree_pairs<RB, NB>(q, D, kt, g, 7, w);
    add_into(z, w);  // y3 + y7
    add_into(y, z);  // the right half
    add_into(x, y);
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
        for (int n = 0; n < NB; ++n) _mm512_storeu_ps(s + r * ss + (g + n) * 16, x[r][n]);
}

// s[r * ss + j] for R rows (q: f32, stride D) and keys [j0, j1) of a block packed by pack_keys_tree; other
// lanes of the 16-key groups touched get scores too. Groups in pairs, and for each pair the rows in pairs, so
// that a pair of groups' keys (8 KB at D = 64) stays in L1 while every row passes over them. pf: a step per row
// pair and pair of groups (all at once, a block's V stalled on full fill buffers: ~20% of attend's own time).
template <int R>
inline void qk_tile_tree(const float *q, int64_t D, const float *kt, int64_t j0, int64_t j1, float *s, int64_t ss,
                         Prefetch &pf) {
    const int64_t g1 = (j1 + 15) / 16;
    pf.pace((g1 - j0 / 16 + 1) / 2 * ((R + 1) / 2));
    for (int64_t g = j0 / 16; g < g1; g += 2) {
        const bool two = g + 2 <= g1;
        int r = 0;
        for (; r + 2 <= R; r += 2) {
            pf.next();
            if (two) qk_tree_groups<2, 2>(q + r * D, D, kt, g, s + r * ss, ss);
            else qk_tree_groups<2, 1>(q + r * D, D, kt, g, s + r * ss, ss);
        }
        if (r < R) {
            pf.next();
            if (two) qk_tree_groups<1, 2>(q + r * D, D, kt, g, s + r * ss, ss);
            else qk_tree_groups<1, 1>(q + r * D, D, kt, g, s + r * ss, ss);
        }
    }
}

// pv_tile's products for R rows (R <= 8) and U vectors of d from c, over all the keys [j0, j1) with the
// accumulators in registers: the same chain per element (acc * alpha, then an FMA a key in order), so the same
// bits. pv_tile keeps 16 rows' accumulators for one vector of d and passes of 16 keys, so that every FMA
// loads its weight through a pointer of its own row (16 of them: GCC spilled them, ~a third of pv_tile's
// instructions in a prefill) and every row reloads its accumulator per pass.
template <int R, int U, typename C>
inline void pv_block(float *acc, int64_t D, const float *alpha, const float *p, int64_t ps, const C *v, int64_t j0,
                     int64_t j1, int64_t c, Prefetch &pf) {
    __m512 a[R][U];
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 2
        for (int u = 0; u < U; ++u) {
            a[i][u] = _mm512_loadu_ps(acc + i * D + c + 16 * u);
            if (alpha) a[i][u] = _mm512_mul_ps(a[i][u], _mm512_set1_ps(alpha[i]));
        }
    for (int64_t j = j0; j < j1; ++j) {
        pf.next();
        __m512 vv[U];
        if constexpr (U == 2) {  // a whole KvLanes pair (pv_tile_rows: c steps by 32)
            vv[0] = KvLanes<C>::a(v + j * D + c).v;
            vv[1] = KvLanes<C>::b(v + j * D + c).v;
        } else {
            vv[0] = vec::load(v + j * D + c).v;  // the natural tail of 16
        }
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) {
            const __m512 pb = _mm512_set1_ps(p[i * ps + j]);
#pragma GCC unroll 2
            for (int u = 0; u < U; ++u) a[i][u] = _mm512_fmadd_ps(pb, vv[u], a[i][u]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 2
        for (int u = 0; u < U; ++u) _mm512_storeu_ps(acc + i * D + c + 16 * u, a[i][u]);
}

// pv_tile over all of [j0, j1) for R rows (D a multiple of 16): rows in eights, d in pairs of vectors (8 x 2
// accumulators: a key's two value vectors and eight weights loaded for 16 FMAs).
template <int R, typename C>
inline void pv_tile_rows(float *acc, int64_t D, const float *alpha, const float *p, int64_t ps, const C *v,
                         int64_t j0, int64_t j1, Prefetch &pf) {
    constexpr int RB = R < 8 ? R : 8;
    int64_t c = 0;
    for (; c + 32 <= D; c += 32) pv_block<RB, 2>(acc, D, alpha, p, ps, v, j0, j1, c, pf);
    if (c < D) pv_block<RB, 1>(acc, D, alpha, p, ps, v, j0, j1, c, pf);
    if constexpr (R > 8)
        pv_tile_rows<R - 8>(acc + 8 * D, D, alpha ? alpha + 8 : nullptr, p + 8 * ps, ps, v, j0, j1, pf);
}


#if defined(CPUINFER_ATTN_DPBF16)
using x86::as_bh;

// 32 bf16 at p (or 16, zero-extended, for the last chunk of D = 80).
inline __m512i load_bf16x32(const bf16_t *p, int64_t n) {
    if (n >= 32) return _mm512_loadu_si512(reinterpret_cast<const void *>(p));
    return _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)), 0);
}

// QK^T on VDPBF16PS with the keys transposed, 16 keys to a vector: one
// VDPBF16PS per query row and d-pair (the row's pair broadcast) adds that pair
// to 16 keys' scores at once, and no score needs a horizontal sum. The keys of
// a block are transposed once (pack_keys_dpbf16) and serve every tile of the
// unit's rows. (Computing each score as a dot product along d, as before, took
// a 16-lane reduction per score: about 8 instructions beside its D / 32
// VDPBF16PS.) Every row count takes this path, decode included, so a row's
// score has the same summation order, and bits, whatever its batch.

// The kt layout of a block's keys: for 16-key group g (keys 16g .. 16g + 15
// of the block) and d-pair p < D / 2, one vector of the 16 keys' pairs
// (k[2p], k[2p + 1]) at kt + (g * D / 2 + p) * 16.
inline int64_t packed_keys_size(int64_t D, int64_t bs) { return bs / 16 * (D / 2) * 16; }

// Packs the groups of a block's keys (k: its first key row) that hold keys
// [j0, j1). Whole groups, since block sizes are multiples of 16: the keys of
// the first and last group outside [j0, j1) (before j0, past the sequence's
// end, the partition or the causal limit) are packed too, from the block's
// memory; their scores are never read.
inline void pack_keys_dpbf16(const bf16_t *k, int64_t D, int64_t j0, int64_t j1, uint32_t *kt) {
    const int64_t P = D / 2;
    for (int64_t g = j0 / 16; g * 16 < j1; ++g) {
        const bf16_t *kg = k + g * 16 * D;
        uint32_t *dst = kt + g * P * 16;
        for (int64_t p0 = 0; p0 < P; p0 += 16) {
            const int64_t np = std::min<int64_t>(16, P - p0);  // 16, or 8 for D = 80's last pairs
            __m512i r[16];
            for (int i = 0; i < 16; ++i) r[i] = load_bf16x32(kg + i * D + 2 * p0, 2 * np);
            transpose16(r);
            for (int64_t i = 0; i < np; ++i) _mm512_storeu_si512(dst + (p0 + i) * 16, r[i]);
        }
    }
}

// A query row's d-pair p, as the 32-bit lane VDPBF16PS multiplies.
inline int32_t query_pair(const bf16_t *q, int64_t p) {
    int32_t v;
    std::memcpy(&v, q + 2 * p, sizeof v);
    return v;
}

// s[r * s_stride + 16 * g ..] for R rows and NG 16-key groups from g, from the packed keys.
template <int R, int NG>
inline void qk_groups_dpbf16(const bf16_t *q, int64_t D, const uint32_t *kt, int64_t g, float *s, int64_t s_stride) {
    const int64_t P = D / 2;
    __m512 acc[NG][R];
#pragma GCC unroll 4
    for (int n = 0; n < NG; ++n)
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) acc[n][r] = _mm512_setzero_ps();
    const uint32_t *k = kt + g * P * 16;
    for (int64_t p = 0; p < P; ++p) {
#pragma GCC unroll 4
        for (int n = 0; n < NG; ++n) {
            const __m512bh kv = as_bh(_mm512_loadu_si512(k + (n * P + p) * 16));
#pragma GCC unroll 16
            for (int r = 0; r < R; ++r)
                acc[n][r] = _mm512_dpbf16_ps(acc[n][r], as_bh(_mm512_set1_epi32(query_pair(q + r * D, p))), kv);
        }
    }
#pragma GCC unroll 4
    for (int n = 0; n < NG; ++n)
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) _mm512_storeu_ps(s + r * s_stride + (g + n) * 16, acc[n][r]);
}

// s[r * s_stride + j] = dot(q[r * D ..], key j) for j in [j0, j1) of a block packed by pack_keys_dpbf16, for
// bf16 query rows q (D a multiple of 16). Other lanes of the 16-key groups touched get scores too.
template <int R>
inline void qk_tile_dpbf16(const bf16_t *q, int64_t D, const uint32_t *kt, int64_t j0, int64_t j1, float *s,
                           int64_t s_stride) {
    // Groups at once, for more independent accumulator chains (NG x R, within the 32 registers) where the
    // tile's keys span that many groups; a tile of one group (block size 16) has R chains.
    constexpr int NG = R <= 2 ? 4 : R <= 8 ? 2 : 1;
    int64_t g = j0 / 16;
    const int64_t g1 = (j1 + 15) / 16;
    for (; g + NG <= g1; g += NG) qk_groups_dpbf16<R, NG>(q, D, kt, g, s, s_stride);
    for (; g < g1; ++g) qk_groups_dpbf16<R, 1>(q, D, kt, g, s, s_stride);
}
#endif

}  // namespace cpuinfer::attn

#if defined(CPUINFER_ATTN_AMX)
#include "attention_amx.h"
#endif

namespace cpuinfer::attn {

// The hooks of common/attention_tile.h this build fills.
template <typename C>
struct ManyRowsAvx512 {
    static constexpr bool kAvailable = true;
    static bool applies(int64_t D) { return D % 16 == 0; }
    static void pack(const C *k, int64_t D, int64_t bs, int64_t j0, int64_t j1, LineVector<float> &buf) {
        const int64_t n = tree_keys_size(D, bs);
        if (int64_t(buf.size()) < n) buf.resize(size_t(n));
        pack_keys_tree(k, D, j0, j1, buf.data());
    }
    template <int R>
    static void qk(const float *q, int64_t D, const float *kt, int64_t j0, int64_t j1, float *s, int64_t ss,
                   Prefetch &pf) {
        qk_tile_tree<R>(q, D, kt, j0, j1, s, ss, pf);
    }
    template <int R>
    static void pv(float *acc, int64_t D, const float *alpha, const float *p, int64_t ps, const C *v, int64_t j0,
                   int64_t j1, Prefetch &pf) {
        pf.pace((j1 - j0) * ((R + 7) / 8) * ((D + 31) / 32));  // pv_block's keys, for each of its calls
        pv_tile_rows<R>(acc, D, alpha, p, ps, v, j0, j1, pf);
    }
};
template <>
struct ManyRows<float> : ManyRowsAvx512<float> {};
template <>
struct ManyRows<bf16_t> : ManyRowsAvx512<bf16_t> {};
template <>
struct ManyRows<f16_t> : ManyRowsAvx512<f16_t> {};
template <>
struct ManyRows<fp8_e5m2_t> : ManyRowsAvx512<fp8_e5m2_t> {};
#if defined(CPUINFER_ATTN_DPBF16)
template <>
struct QkBf16<bf16_t, bf16_t> {
    static constexpr bool kAvailable = true;
    static void pack(const bf16_t *k, int64_t D, int64_t bs, int64_t j0, int64_t j1, LineVector<uint32_t> &buf) {
        const int64_t n = packed_keys_size(D, bs);
        if (int64_t(buf.size()) < n) buf.resize(size_t(n));
        pack_keys_dpbf16(k, D, j0, j1, buf.data());
    }
    template <int R>
    static void run(const bf16_t *q, int64_t D, const uint32_t *kt, int64_t j0, int64_t j1, float *s, int64_t ss) {
        qk_tile_dpbf16<R>(q, D, kt, j0, j1, s, ss);
    }
};
#endif

#if defined(CPUINFER_ATTN_AMX)
// bf16 queries on a bf16 or an fp8_e5m2 cache (whose rows the packing widens to bf16 exactly).
struct WholeUnitAmx {
    // Every row count, decode included, so that a row's result does not depend
    // on its batch (the engine's greedy outputs rely on it, as on the GEMM's).
    static bool applies(int64_t, int64_t D) { return D % 32 == 0; }
    // Units of up to 512 rows: a unit packs the keys it sees once for all its tiles, and packing was 13% of
    // a 2048-token prefill layer at 64 rows (SmolLM2's heads, 2 threads: 10.0 -> 8.5 ms; 256 -> 512 rows
    // 7.4-7.6 -> 7.1-7.2 ms, 1024 no better). The plan halves it, down to 256, for a batch with fewer
    // units than 4 a thread (a 128-token prompt's 3 units of 384 rows ran 15% slower than 6 smaller ones).
    static constexpr int64_t kChunkRows = 512;
    template <typename KeyRow, typename ValueRow>
    static void run(const FlashUnit &u, KeyRow &&key, ValueRow &&value) {
        flash_unit_amx(u, key, value);
    }
};
template <>
struct WholeUnit<bf16_t, bf16_t> : WholeUnitAmx {};
template <>
struct WholeUnit<bf16_t, fp8_e5m2_t> : WholeUnitAmx {};
template <>
struct Impl<void> {
    static constexpr const char *kName = "amx";
};
#elif defined(CPUINFER_ATTN_DPBF16)
template <>
struct Impl<void> {
    static constexpr const char *kName = "avx512bf16";
};
#endif

}  // namespace cpuinfer::attn
