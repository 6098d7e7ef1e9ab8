// amx: flash attention on AMX-BF16 tiles, the whole-unit path of
// attention_x86.h (included there, after the VDPBF16PS helpers it uses:
// transpose16). Every unit (query rows of one KV head: a prefill chunk or a
// decode step) runs as
//   S = Q K^T   A: Q (16 rows x 32 d, straight from the query rows)
//               B: K^T in VNNI form (16 d-pairs x 16 keys), packed per chunk
//   softmax     on S's rows in f32 (scale, soft-cap, causal/window mask,
//               online max and sum), as the vector path does
//   O += P V    A: P (16 rows x 32 keys)  B: V in VNNI form (16 key-pairs x 16 d)
// Keys are packed in chunks of 32 (one k-step of the PV product) that serve
// every 16-row tile of the unit (up to 16), so packing costs a fraction of the
// tile work; packing reads key rows in runs of 16 (one block's, or row by
// row where a run's rows are not D apart), so chunks may straddle KV blocks
// of any size. A unit of a single tile (a decode step) computes S^T = K Q^T
// instead, K straight from the cache, and packs only V (qkt_chunk).
//
// The softmax runs over blocks of up to kFlashBlock keys (512), not chunk by
// chunk: each step of it is a round trip between the tile unit and the
// vector unit through memory (S stored from tiles and read by vector loads,
// P stored by vector stores and read by tile loads), whose latency the
// out-of-order window cannot hide, and each row pays a max and a sum
// reduction and a scalar exp per step. Measured on one Sapphire Rapids
// core pair, a 2048-token causal prefill at SmolLM2's heads (9q/3kv, D = 64):
// 32-key steps spent ~40% of the kernel's time on the stall of the first PV
// product after the P stores and on the S stores; see bench_attention.py.
//
// Where blocks and chunks sit depends on key positions only (multiples of
// kFlashBlock and 32, clipped to the unit's keys), and a row's keys outside what it
// sees are exact zeros in P (and in V, outside the unit's keys), so a row's
// result does not depend on its batch, the rows beside it in a tile, or
// which chunks its tile skips (the engine's greedy outputs rely on it).
//
// Caches: bf16, or fp8_e5m2 widened to bf16 as the rows are packed (or, for
// a single-tile unit's K, copied: see key_run), exactly (cache_bf16x32), so
// an fp8 cache gives the bits of a bf16 cache holding its values.
//
// Precision: Q and K are bf16, and their products are exact in
// the f32 accumulators. P is not: rounding it to bf16 (as flash-attention
// kernels on GPUs do) cost ~2^-9 per weight, which measured on real models
// (SmolLM2 Q4_1, Gemma 3) moved first-token logits 2-8x further from
// transformers than the f32 paths. So P goes in as two bf16 terms, hi =
// top 16 bits of P and lo = bf16(P - hi) (P to 2^-16), in two tile products: the
// output is then as exact as the f32 FMA path's (bf16 outputs carry 2^-9),
// for half again the tile work (PV is half the FLOPs).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "../common/aligned.h"
#include "../common/vec.h"
#include "bf16_x86.h"

namespace cpuinfer::attn {

constexpr int64_t kFlashKeys = 32;    // keys per packed chunk: one k-step of the PV tile product
// Keys per softmax step (16 chunks), at multiples of 512: a row's per-step work (two reductions, its
// factor, its masks) and the stage hand-offs amortised over more keys. Measured, 2048-token prefill layer at
// SmolLM2's heads, 2 threads, alternating builds: 128 keys 8.2-8.3 ms, 256 7.6-8.2, 512 7.4-7.6; decode
// batches no different. 512 is also the flash-decoding partition (paged_attention.cpp's kPartKeys).
constexpr int64_t kFlashBlock = 512;
constexpr int kFlashChunks = int(kFlashBlock / kFlashKeys);

// Per-thread buffers of the AMX path: three blocks' packed chunks (slot c at
// c * D * 16 of kt, c * D * 32 of vv), and two of each per-item buffer, the
// pipeline's stages working on consecutive items (see flash_unit_amx).
struct FlashScratch {
    LineVector<uint32_t> kt;  // K^T chunk: [D/32][2 key halves][16 d-pairs][16 keys]
    LineVector<uint16_t> vv;  // V chunk: [D/16][16 key-pairs][16 d][2]
    LineVector<float> o;      // an item's products, [16 rows][D], two items apart by 16 * D
    LineVector<uint32_t> qt;  // a single-tile unit's Q^T: [D/32][16 d-pairs][16 rows] (qkt_chunk)
    LineVector<bf16_t> krun;  // key rows copied for qkt_chunk's A tiles: [2 chunks][2 runs][16 keys][D]
    std::vector<uint8_t> started;  // a unit's 16-row tiles that have had an item (flash_unit_amx)
    alignas(64) float st[2 * 2 * 256];  // qkt_chunk's S^T tiles: [2 chunks][2 runs][16 keys][16 rows]
    struct Item {
        alignas(64) float s[16 * kFlashBlock];            // scores over a block, rows kFlashBlock apart
        alignas(64) bf16_t p_hi[kFlashChunks * 16 * 32];  // weights, chunk c's 16 x 32 A tile at c * 512
        alignas(64) bf16_t p_lo[kFlashChunks * 16 * 32];
        alignas(64) float alpha[16];  // the rows' accumulator factors
        // Per row, the chunks from the first that may hold nonzero weights (p_hi / p_lo are written only by
        // flash_softmax): a row that sees no key zeroes just those. A decode unit's tile has 1-15 such rows
        // in every item, and zeroing all their chunks again was 2 x 64 B of stores a row and chunk.
        uint8_t dirty[16] = {kFlashChunks, kFlashChunks, kFlashChunks, kFlashChunks, kFlashChunks, kFlashChunks,
                             kFlashChunks, kFlashChunks, kFlashChunks, kFlashChunks, kFlashChunks, kFlashChunks,
                             kFlashChunks, kFlashChunks, kFlashChunks, kFlashChunks};
    } item[2];
    struct ItemPlan {
        int64_t b, r0, a0, a1;  // its block, its tile's first row, its chunks [a0, a1)
        int R;                  // its tile's rows
        bool first;             // its tile's first item
        int set;                // which of the three sets holds its block's packed chunks
        int64_t pk0, pk1;       // a block's first item: the block's chunks to pack, [pk0, pk1) (else empty)
    };
    std::vector<ItemPlan> plan;  // a unit's items in order (flash_unit_amx; item[] holds two items' buffers)
    void reserve(int64_t D) {
        if (int64_t(kt.size()) < 3 * kFlashChunks * D * 16) {
            kt.resize(size_t(3 * kFlashChunks * D * 16)), vv.resize(size_t(3 * kFlashChunks * D * 32));
            o.resize(size_t(2 * 16 * D));
            qt.resize(size_t(D / 32 * 256)), krun.resize(size_t(4 * 16 * D));
        }
    }
};

inline void amx_begin() { x86::load_tile_config(x86::full_tiles()); }
inline void amx_end() { x86::release_tiles(); }

// 2^x for the softmax's weights, x <= 0 (in log2 units: the score's scale times log2(e) folded into the
// FMA that subtracts the max) in the lanes of `keep`, 0 in the others (whatever they hold, -inf included):
// n = round(x), r = x - n exactly (|r| <= 1/2), a degree-5 polynomial of 2^r fitted to the relative error
// over it (< 1.9e-7 in f32), times 2^n by VSCALEFPS (which underflows to 0 by itself: no clamp). 8
// instructions against the 11 of the natural-units e^x it replaced, whose Cody-Waite steps (r = x - n ln 2
// in two FMAs) and clamp are the price of natural units; log2(e) costs nothing in the FMA before it.
// Measured, 1024-token causal prefill at SmolLM2's heads: as many outputs off the rounded float64 result
// as with e^x (0.41% and 0.17% of them, at two score spreads); a degree-4 polynomial (2.9e-6) was 2-4%
// faster but moved 5% more of them, and took Gemma 3's first-token logits from 4.1% to 5.3% of their
// range off transformers' (test_gguf_models.py allows 5%). A 2048-token layer, 2 threads, alternating
// builds: 7.7-8.2 -> 7.1-7.7 ms. The accumulators' factors take it too, their exponent formed in double
// (one rounding).
inline __m512 exp2_nonpos(__m512 x, __mmask16 keep) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(0.001326472731307149f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.009671512991189957f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.05550733581185341f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.24022242426872253f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.6931470036506653f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_maskz_scalef_ps(keep, p, n);
}

// The weights of 32 keys (e0: the first 16, e1: the rest) as the bf16 terms of P: hi, their top 16 bits
// (one shuffle for both), and lo = bf16(e - hi), exact before its rounding: hi + lo is e to 2^-16 (the
// rounded hi before, at three more instructions a vector, gave 2^-17; bf16 outputs carry 2^-9).
inline void split_weights(__m512 e0, __m512 e1, bf16_t *hi, bf16_t *lo) {
    alignas(64) static const uint16_t top_idx[32] = {1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31,
                                                     33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
    const __m512i i0 = _mm512_castps_si512(e0), i1 = _mm512_castps_si512(e1), top = _mm512_set1_epi32(int(0xffff0000u));
    _mm512_store_si512(hi, _mm512_permutex2var_epi16(i0, _mm512_load_si512(top_idx), i1));
    const __m512 l0 = _mm512_sub_ps(e0, _mm512_castsi512_ps(_mm512_and_si512(i0, top)));
    const __m512 l1 = _mm512_sub_ps(e1, _mm512_castsi512_ps(_mm512_and_si512(i1, top)));
    _mm512_store_si512(lo, (__m512i)_mm512_cvtne2ps_pbh(l1, l0));
}

// out[i] = row(j + i) for the keys j + i in [lo, hi), else nullptr (i < 16).
// The run's ends are looked up, and its rows between them taken as D apart
// when the ends are (row() must allow that: see flash_unit_amx); a lookup
// through a paged cache's block table (a division by the block size and two
// loads) per row was ~30% of the packing, and the packing about a third of
// a decode unit (3 rows, 192 keys, in L2).
template <typename E, typename Row>
inline void run_rows(int64_t D, int64_t j, int64_t lo, int64_t hi, Row &&row, const E **out) {
    const int64_t a = std::max(j, lo), b = std::min(j + 16, hi);
    for (int i = 0; i < 16; ++i) out[i] = nullptr;
    if (a >= b) return;
    const E *first = row(a), *last = b - 1 > a ? row(b - 1) : first;
    const bool straight = last == first + (b - 1 - a) * D;
    for (int64_t k = a; k < b; ++k) out[k - j] = straight ? first + (k - a) * D : row(k);
}

// The element type of a cache's rows, as key(j) / value(j) give them: bf16_t or fp8_e5m2_t.
template <typename Row>
using RowElem = std::remove_cv_t<std::remove_pointer_t<std::invoke_result_t<Row, int64_t>>>;

// 32 consecutive elements of a cache row as bf16, for the tiles. fp8_e5m2 widens exactly: an e5m2 byte is
// the top byte of an f16 (1-5-2: every finite value, its subnormals 2^-16 .. 3 * 2^-16 included, is a
// normal f32 and, with 2 mantissa bits and bf16's 8-bit exponent, a bf16 value; inf and NaN stay inf and
// NaN), so f16 -> f32 -> bf16 rounds nothing and a tile sees the same values as the vector path's
// vec::load. The AMX tiles' bf16 inputs flush denormals, which no widened e5m2 value is.
inline __m512i cache_bf16x32(const bf16_t *p) { return _mm512_loadu_si512(p); }
inline __m512i cache_bf16x32(const fp8_e5m2_t *p) {
    return (__m512i)_mm512_cvtne2ps_pbh(vec::load(p + 16).v, vec::load(p).v);  // vec::load: exact, through f16
}

// Packs the chunk of keys [a0, a0 + 32) as K^T (unless !keys) and V tiles;
// keys outside [lo, hi) are zero. key(j) and value(j) give the rows of
// absolute key j.
template <typename KeyRow, typename ValueRow>
inline void flash_pack(int64_t D, int64_t a0, int64_t lo, int64_t hi, KeyRow &&key, ValueRow &&value, uint32_t *kt,
                       uint16_t *vv, bool keys = true) {
    const __m512i zero = _mm512_setzero_si512();
    const RowElem<KeyRow> *krows[32];
    const RowElem<ValueRow> *vrows[32];
    if (keys) {
        run_rows(D, a0, lo, hi, key, krows);
        run_rows(D, a0 + 16, lo, hi, key, krows + 16);
    }
    run_rows(D, a0, lo, hi, value, vrows);
    run_rows(D, a0 + 16, lo, hi, value, vrows + 16);
    for (int h = 0; h < 2 && keys; ++h) {
        const auto *const *rows = krows + 16 * h;
        for (int64_t ch = 0; ch < D / 32; ++ch) {
            __m512i r[16];
            for (int j = 0; j < 16; ++j) r[j] = rows[j] ? cache_bf16x32(rows[j] + ch * 32) : zero;
            transpose16(r);
            uint32_t *dst = kt + (ch * 2 + h) * 256;
            for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + i * 16, r[i]);
        }
    }
    // Element 2i of the result from a[i], 2i + 1 from b[i] (i < 16 or, for hi, 16 + i).
    alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                   8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i ilo = _mm512_load_si512(lo_idx), ihi = _mm512_add_epi16(ilo, _mm512_set1_epi16(16));
    for (int64_t i = 0; i < 16; ++i) {
        const auto *a = vrows[2 * i], *b = vrows[2 * i + 1];
        for (int64_t g = 0; g < D / 32; ++g) {
            const __m512i va = a ? cache_bf16x32(a + 32 * g) : zero, vb = b ? cache_bf16x32(b + 32 * g) : zero;
            _mm512_storeu_si512(vv + ((2 * g) * 16 + i) * 32, _mm512_permutex2var_epi16(va, ilo, vb));
            _mm512_storeu_si512(vv + ((2 * g + 1) * 16 + i) * 32, _mm512_permutex2var_epi16(va, ihi, vb));
        }
    }
}

// The bits of lanes [lo, hi) of a 16-lane vector (lo, hi clamped to [0, 16]).
inline __mmask16 lanes(int64_t lo, int64_t hi) {
    lo = std::clamp<int64_t>(lo, 0, 16), hi = std::clamp<int64_t>(hi, 0, 16);
    return __mmask16(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}

// One 16-row tile's softmax step over the chunks [a0, a1) of a block (S in
// f.s from the QK products) -> the weights as bf16 hi + lo parts in f.p_hi /
// f.p_lo, the rows' m and l updated, and f.alpha[r] the factor of row r's
// accumulator. tick(r) after each row r of the second pass (the pipeline
// issues tile work there).
template <typename Tick>
inline void flash_softmax(const FlashUnit &u, int64_t r0, int R, int64_t a0, int64_t a1, FlashScratch::Item &f,
                          Tick &&tick) {
    const int64_t W = u.window;
    const int nv = int((a1 - a0) / 16);
    const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    const vec::vf qs = vec::splat(u.qscale), cap = vec::splat(u.soft_cap);
    // Without a soft-cap (and with scale > 0, as always) the scale folds into the exponent: max(s) * scale
    // is max(s * scale), and a weight's exponent, (s * scale - m) log2(e) for exp2_nonpos, is one FMA
    // (factor scale * log2(e), addend -m log2(e); without the fold, the factor is log2(e) on the scaled s).
    // Every row takes the same formula either way.
    const bool fold = u.soft_cap <= 0.f && u.qscale > 0.f;
    constexpr double kLog2e = 1.44269504088896341;
    const __m512 to_log2 = _mm512_set1_ps(float(fold ? double(u.qscale) * kLog2e : kLog2e));
    // Two passes over the rows, each row's work independent of the other rows' in a pass, so that the
    // out-of-order core overlaps rows (a row's exps wait for its max, through a chain of maxima and a
    // reduction).
    alignas(64) float mnew[16], to_alpha[16];  // the rows' new max; log2 of their factor, where `live`
    __mmask16 mk[16][kFlashBlock / 16];
    uint32_t sees = 0;  // rows that see a key here
    __mmask16 live = 0;  // rows that see a key here, with keys seen before (a finite max)
    for (int r = 0; r < 16; ++r) {
        mnew[r] = to_alpha[r] = 0.f;
        int64_t lo = a0, hi = a0;  // keys of the chunks row r sees (none past R)
        if (r < R) {
            const int64_t p = u.pos[r0 + r];
            lo = std::max({a0, u.k0, W > 0 ? p - W + 1 : int64_t(0)});
            hi = std::min({a1, u.k1, p + 1});
        }
        if (lo >= hi) continue;
        sees |= 1u << r;
        const bool all = lo == a0 && hi == a1;
        float *sr = f.s + r * kFlashBlock;
        __m512 vmax = ninf;
        for (int v = 0; v < nv; ++v) {
            mk[r][v] = all ? __mmask16(0xffff) : lanes(lo - a0 - 16 * v, hi - a0 - 16 * v);
            __m512 x = _mm512_load_ps(sr + 16 * v);
            if (!fold) {
                vec::vf y = vec::mul(vec::vf{x}, qs);
                if (u.soft_cap > 0.f) y = vec::mul(cap, vec::tanh(y));
                x = y.v;
                _mm512_store_ps(sr + 16 * v, x);
            }
            vmax = _mm512_mask_max_ps(vmax, mk[r][v], vmax, x);
        }
        const float bmax = _mm512_reduce_max_ps(vmax), mold = u.m[r0 + r];
        mnew[r] = std::max(mold, fold ? bmax * u.qscale : bmax);
        if (mold > -std::numeric_limits<float>::infinity()) {
            to_alpha[r] = float((double(mold) - double(mnew[r])) * kLog2e);
            live |= __mmask16(1u << r);
        }
    }
    // The rows' factors at once: 1 where the max holds (2^0 is exactly 1), 0 where it was -inf (the row's
    // first keys: its accumulator holds nothing yet).
    _mm512_store_ps(f.alpha, exp2_nonpos(_mm512_load_ps(to_alpha), live));
    for (int r = 0; r < 16; ++r) {
        bf16_t *ph = f.p_hi + r * 32, *pl = f.p_lo + r * 32;  // chunk c's row at + c * 512
        if (!(sees >> r & 1)) {  // nothing to add: zero weights (where they may not be already)
            f.alpha[r] = 1.f;
            const int nz = std::min(nv, 2 * int(f.dirty[r]));
            for (int v = 0; v < nz; v += 2) {
                _mm512_store_si512(ph + v * 256, _mm512_setzero_si512());
                _mm512_store_si512(pl + v * 256, _mm512_setzero_si512());
            }
            if (nz == 2 * int(f.dirty[r])) f.dirty[r] = 0;
            tick(r);
            continue;
        }
        f.dirty[r] = uint8_t(std::max(int(f.dirty[r]), nv / 2));
        const float *sr = f.s + r * kFlashBlock;
        const __m512 nm = _mm512_set1_ps(float(-double(mnew[r]) * kLog2e));
        __m512 sum = _mm512_setzero_ps();
        for (int v = 0; v < nv; v += 2) {
            const __m512 s0 = _mm512_load_ps(sr + 16 * v), s1 = _mm512_load_ps(sr + 16 * v + 16);
            const __m512 x0 = _mm512_fmadd_ps(s0, to_log2, nm), x1 = _mm512_fmadd_ps(s1, to_log2, nm);
            const __m512 e0 = exp2_nonpos(x0, mk[r][v]), e1 = exp2_nonpos(x1, mk[r][v + 1]);
            sum = _mm512_add_ps(_mm512_add_ps(sum, e0), e1);
            split_weights(e0, e1, ph + v * 256, pl + v * 256);  // chunk v / 2's row
        }
        u.l[r0 + r] = u.l[r0 + r] * f.alpha[r] + _mm512_reduce_add_ps(sum);
        u.m[r0 + r] = mnew[r];
        tick(r);
    }
}

// S of 16 rows (q) against one packed chunk (kt), into s (rows kFlashBlock
// apart): the chunk's 16 x 32 scores in C tiles 0-1 or 2-3, the pair
// alternating with the chunk, so that a chunk's products start while the
// previous chunk's stores drain (zeroing a tile waits for its store, which
// waits for its last product: one set of four C tiles for two chunks ran at
// half the speed); the rows' Q in tiles 4-5 (kept across chunks for D <= 64),
// K^T alternating between tiles 6 and 7.
template <int C0, int Q>
inline void qk_step(const uint32_t *k) {  // k: the chunk's K^T for one 32-d slice (two 16-key halves)
    _tile_loadd(6, k, 64);
    x86::tdpbf16ps<C0, Q, 6>();
    _tile_loadd(7, k + 256, 64);
    x86::tdpbf16ps<C0 + 1, Q, 7>();
}
template <int C0>
inline void qk_chunk(const bf16_t *q, int64_t D, bool keep, const uint32_t *kt, float *s) {
    x86::tile_zero<C0>();
    x86::tile_zero<C0 + 1>();
    for (int64_t ch = 0; ch < D / 32; ++ch) {
        if (ch % 2 == 0) {
            if (!keep) _tile_loadd(4, q + ch * 32, D * 2);
            qk_step<C0, 4>(kt + ch * 512);
        } else {
            if (!keep) _tile_loadd(5, q + ch * 32, D * 2);
            qk_step<C0, 5>(kt + ch * 512);
        }
    }
    x86::tile_store<C0>(s, kFlashBlock * 4);
    x86::tile_store<C0 + 1>(s + 16, kFlashBlock * 4);
}

// A unit of one tile (up to 16 rows: a decode step's) takes S^T = K Q^T
// instead of qk_chunk's S = Q K^T: A = 16 keys' rows (32 d) as they lie in
// the cache, B = Q^T in VNNI form (packed once per unit), C = S^T (16 keys x
// 16 rows), put back as S by one vector transpose per 16 keys. qk_chunk's
// operand is K^T, packed by two 16 x 16 transposes per 16 keys at D = 64
// (four at 128), which a prefill unit shares among up to 16 tiles but a
// decode unit spends on one; and the packed copy spilled to L2 next to a
// block's V. Each score is the same chain over d in order either way (the
// bf16 products are exact in f32), so the bits are qk_chunk's, and a row's
// result still does not depend on its batch. Measured on Sapphire Rapids,
// SmolLM2's heads (9q/3kv, D = 64): a decode unit of 192 keys in L2, one
// thread, 3.05 -> 2.28 us; 32 x 192 decode over 30 cold caches, 2 threads,
// 0.36-0.38 -> 0.33-0.36 ms a layer (the rest is the K/V stream); engine W2
// (32 sequences decoding) 881 -> 922 tok/s. Tried with it and dropped: V
// packed after the softmax with its rows prefetched during QK (no faster
// cold, 10-20% slower in cache), and the whole unit sequence of a thread as
// one pipeline, so that a unit's hand-offs and K/V loads overlap the next
// unit's (bit-identical, no faster: a decode unit is bound by its own work).

// Q^T of a tile's 16 rows (rows past the unit's are zero) for d-slice ch at qt + 256 ch: [16 d-pairs][16 rows].
inline void pack_qt(const bf16_t *q, int64_t D, uint32_t *qt) {
    for (int64_t ch = 0; ch < D / 32; ++ch) {
        __m512i r[16];
        for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(q + j * D + ch * 32);
        transpose16(r);
        for (int i = 0; i < 16; ++i) _mm512_store_si512(qt + ch * 256 + i * 16, r[i]);
    }
}

// The rows of keys [a, a + 16), D apart, for A tiles: the cache's own when all
// sixteen are in [lo, hi) and lie D apart (bf16 caches), else a copy in tmp
// ([16][D], fp8 rows widened to bf16) with zero rows outside [lo, hi) (which
// may not be in the cache at all).
// (The common case checks its two ends itself: going through run_rows's 16
// row pointers for it made a decode unit of 192 keys 7-12% slower.)
template <typename KeyRow>
inline const bf16_t *key_run(int64_t D, int64_t a, int64_t lo, int64_t hi, KeyRow &&key, bf16_t *tmp) {
    using E = RowElem<KeyRow>;
    if constexpr (std::is_same_v<E, bf16_t>) {
        if (a >= lo && a + 16 <= hi) {
            const bf16_t *first = key(a);
            if (key(a + 15) == first + 15 * D) return first;
        }
    }
    const E *rows[16];
    run_rows(D, a, lo, hi, key, rows);
    for (int j = 0; j < 16; ++j)
        for (int64_t d = 0; d < D; d += 32)
            _mm512_store_si512(tmp + j * D + d, rows[j] ? cache_bf16x32(rows[j] + d) : _mm512_setzero_si512());
    return tmp;
}

// S^T of one chunk: its two 16-key runs (rows k0, k1) against Q^T, in C tiles C0 and C0 + 1 (the pair
// alternating with the chunk, as in qk_chunk), stored to st ([2 runs][16 keys][16 rows]). A in tiles 4-5,
// Q^T in 6-7 (kept across chunks for D <= 64).
template <int C0>
inline void qkt_chunk(const bf16_t *k0, const bf16_t *k1, int64_t D, bool keep, const uint32_t *qt, float *st) {
    x86::tile_zero<C0>();
    x86::tile_zero<C0 + 1>();
    for (int64_t ch = 0; ch < D / 32; ++ch) {
        if (ch % 2 == 0) {
            if (!keep) _tile_loadd(6, qt + ch * 256, 64);
            _tile_loadd(4, k0 + ch * 32, D * 2);
            x86::tdpbf16ps<C0, 4, 6>();
            _tile_loadd(5, k1 + ch * 32, D * 2);
            x86::tdpbf16ps<C0 + 1, 5, 6>();
        } else {
            if (!keep) _tile_loadd(7, qt + ch * 256, 64);
            _tile_loadd(4, k0 + ch * 32, D * 2);
            x86::tdpbf16ps<C0, 4, 7>();
            _tile_loadd(5, k1 + ch * 32, D * 2);
            x86::tdpbf16ps<C0 + 1, 5, 7>();
        }
    }
    x86::tile_store<C0>(st, 64);
    x86::tile_store<C0 + 1>(st + 256, 64);
}

// Rows r < R of a chunk's S (32 keys, into s at rows kFlashBlock apart) from its S^T tiles.
inline void st_to_s(const float *st, int R, float *s) {
    for (int h = 0; h < 2; ++h) {
        __m512i r[16];
        for (int j = 0; j < 16; ++j) r[j] = _mm512_load_si512(st + h * 256 + j * 16);
        transpose16(r);
        for (int i = 0; i < R; ++i) _mm512_store_si512(s + i * kFlashBlock + h * 16, r[i]);
    }
}

// Chunk c (of an item's nc) of o[:, 16 I] = P V for the I of a pass's d slices (16 wide; v: the first
// chunk's slice), P's hi and lo terms each: slice I accumulates in tile 4 + I (zeroed at the first chunk,
// stored at the last), its V tile alternating between tiles 2 and 3; P's terms in tiles 0 and 1.
template <int... I>
inline void pv_chunk(std::integer_sequence<int, I...>, int64_t D, int64_t c, int64_t nc, const uint16_t *v,
                     const FlashScratch::Item &f, float *o) {
    if (c == 0) (x86::tile_zero<4 + I>(), ...);
    v += c * D * 32;
    _tile_loadd(0, f.p_hi + c * 512, 64);
    _tile_loadd(1, f.p_lo + c * 512, 64);
    ((x86::tile_load<2 + I % 2>(v + I * 16 * 32, 64), x86::tdpbf16ps<4 + I, 0, 2 + I % 2>(),
      x86::tdpbf16ps<4 + I, 1, 2 + I % 2>()),
     ...);
    if (c == nc - 1) (x86::tile_store<4 + I>(o + 16 * I, D * 4), ...);
}

template <typename F>
inline void with_slices(int n, F &&f) {
    switch (n) {
        case 1: f(std::integral_constant<int, 1>()); break;
        case 2: f(std::integral_constant<int, 2>()); break;
        case 3: f(std::integral_constant<int, 3>()); break;
        default: f(std::integral_constant<int, 4>()); break;
    }
}

// The whole unit, as a pipeline over items (a block of kFlashBlock keys at a
// multiple of it, and a 16-row tile that sees some of it; blocks in order,
// the tiles of each in order). Rows are token-major, so positions never
// decrease with the row, and the keys a tile sees are [its first row's window
// start, its last row's position]; an item takes just the chunks of its block
// that its tile sees. Each item goes through
//   pack   its block's chunks, once for every tile, before the block's first
//          item's QK (vector stores)
//   QK     S = Q K^T into its score buffer (tile stores); a single-tile unit
//          (a decode step) S^T = K Q^T, put back as S (see qkt_chunk)
//   soft   S -> P, the rows' m, l and alpha (vector loads and stores)
//   PV     o = P V, 64 d at a time (tile loads, stores); a whole tile's first
//          item (every item of a prefill: a unit is one partition, and
//          partitions are one block wherever the block size divides 512)
//          stores its products straight into the rows' acc
//   add    acc = acc * alpha + o for its rows (vector), unless PV wrote acc
// Item i's softmax runs with its neighbours' tile work issued a chunk at a
// time between its rows: the packing of item i + 1's block (when i + 1 is the
// block's first item), item i + 1's QK and item i - 1's PV; item i - 2's add
// comes just before it. So each stage reads what was stored at least a
// stage earlier, with other work between (a tile load cannot take data from
// the store buffer, and a vector load of what a tile just stored waits for
// the tile product), and the tile unit has work queued while the vector unit
// runs the softmax. Measured, 2048-token prefill layer at SmolLM2's heads, 2
// threads, alternating builds: issuing the neighbours' tile work between the
// softmax's rows instead of all before it, 6.43 -> 6.01 ms (one chunk between
// every few pairs of score vectors: no better). Tile work and vector work
// overlap less than that would suggest: without the softmax the layer took
// 3.5 ms, without the tile products 3.6 ms. The tile work is bound by its tile
// loads (~3.4 ns a KB from L1, ~6 from L2 on this CPU, against 4.4 ns a
// product), each waiting for the product before it on the same register.
// What keeps the two from overlapping, measured in a micro-benchmark of this
// softmax (16 x 512 scores in L1, one core) with tile work issued between its
// rows: bare TDPBF16PS overlap with it almost fully when issued a few at a
// time (12 products a row: 1.84 us an item alone, 0.92 tiles alone, 2.15
// together), but tile loads do not (loads from L1 added: 1.42 alone, 2.86
// together), and with tile stores as well the pair ran above the sum of its
// parts (1.57 alone, 3.6 together), however finely interleaved. The tile
// loads and stores per product are already the fewest eight tiles allow
// (two products per V load, four per P load), so the softmax's own
// instructions and these memory operations are what a faster layer must cut.
// Buffers: items alternate between two sets of S, P, alpha and o (item i - 1's
// P is read by its PV while item i's softmax writes its own; item i + 1's QK
// writes the S that item i - 1's softmax read), and the blocks between three
// sets of packed chunks (a block is packed while items of the two blocks
// before it may still run PV).
// A row's accumulator sees its blocks' products in block order, each after its
// factor, whatever the tile or the batch.
// key(j) / value(j): the rows of absolute key j, with keys i < j whose rows
// are (j - i) * D apart having their keys between them in the rows between
// (as in a paged cache: rows D apart within a block, and blocks, of at least
// one whole row each, laid out so that two keys' rows sit that far apart
// only inside one block or across blocks that follow each other).
template <typename KeyRow, typename ValueRow>
inline void flash_unit_amx(const FlashUnit &u, KeyRow &&key, ValueRow &&value) {
    const int64_t D = u.D, W = u.window;
    thread_local FlashScratch tls;
    FlashScratch &f = tls;  // one TLS lookup: each access to a thread_local in a shared library calls
    f.reserve(D);           // __tls_get_addr (it was in the PV loop, with a vzeroupper)
    const bool single = u.rows <= 16;  // one tile: S^T = K Q^T, V packed alone
    const bool keep = D <= 64;         // Q (Q^T) stays in its tiles across an item's chunks
    // Keys [lo, hi) of block b that the rows from r0 to r1 - 1 see (none if lo >= hi).
    auto seen = [&](int64_t b, int64_t r0, int64_t r1, int64_t &lo, int64_t &hi) {
        lo = std::max({u.k0, b, W > 0 ? u.pos[r0] - W + 1 : int64_t(0)});
        hi = std::min({u.k1, b + kFlashBlock, u.pos[r1 - 1] + 1});
        return lo < hi;
    };
    // The items, and every row's state from scratch (acc: written by its tile's first item, else zero).
    auto &plan = f.plan;
    plan.clear();
    f.started.assign(size_t((u.rows + 15) / 16), 0);
    for (int64_t r = 0; r < u.rows; ++r) u.m[r] = -std::numeric_limits<float>::infinity(), u.l[r] = 0.f;
    int packed = 0;  // blocks with items so far
    for (int64_t b = u.k0 / kFlashBlock * kFlashBlock; b < u.k1; b += kFlashBlock) {
        int64_t blo, bhi;
        if (!seen(b, 0, u.rows, blo, bhi)) continue;
        const size_t first_of_block = plan.size();
        for (int64_t r0 = 0; r0 < u.rows; r0 += 16) {
            const int R = int(std::min<int64_t>(16, u.rows - r0));
            int64_t lo, hi;
            if (!seen(b, r0, r0 + R, lo, hi)) continue;
            plan.push_back({b, r0, lo / kFlashKeys * kFlashKeys, (hi + kFlashKeys - 1) / kFlashKeys * kFlashKeys, R,
                            !f.started[size_t(r0 / 16)], packed % 3, 0, 0});
            f.started[size_t(r0 / 16)] = 1;
        }
        if (plan.size() > first_of_block) {
            plan[first_of_block].pk0 = blo / kFlashKeys * kFlashKeys, plan[first_of_block].pk1 = bhi;
            ++packed;
        }
    }
    for (int64_t t = 0; t < int64_t(f.started.size()); ++t)  // tiles that see no key: nothing to add
        if (!f.started[size_t(t)])
            std::memset(u.acc + t * 16 * D, 0, sizeof(float) * size_t((std::min(u.rows, t * 16 + 16) - t * 16) * D));
    const int64_t n = int64_t(plan.size());
    using ItemPlan = FlashScratch::ItemPlan;
    // Chunk a of an item's block in the packed sets.
    auto slot = [&](const ItemPlan &it, int64_t a) { return it.set * kFlashChunks + (a - it.b) / kFlashKeys; };
    auto direct = [&](const ItemPlan &it) { return it.first && it.R == 16; };
    auto o_of = [&](int64_t j) { return direct(plan[j]) ? u.acc + plan[j].r0 * D : f.o.data() + (j % 2) * 16 * D; };

    // A step's tile work, in groups of a chunk: [packing of qk's block] [QK of qk] [PV of pv, pass by pass].
    int64_t w_pv = -1, w_qk = -1, g_pk = 0, g_qk = 0, nc_pv = 0, g_total = 0, g_done = 0;
    auto plan_step = [&](int64_t pv, int64_t qk) {
        w_pv = pv, w_qk = qk, g_done = 0;
        g_pk = qk >= 0 ? (plan[qk].pk1 - plan[qk].pk0 + kFlashKeys - 1) / kFlashKeys : 0;
        g_qk = qk >= 0 ? (plan[qk].a1 - plan[qk].a0) / kFlashKeys : 0;
        nc_pv = pv >= 0 ? (plan[pv].a1 - plan[pv].a0) / kFlashKeys : 0;
        g_total = g_pk + g_qk + nc_pv * ((D + 63) / 64);
    };
    auto pack_chunk = [&](const ItemPlan &it, int64_t g) {
        const int64_t a = it.pk0 + g * kFlashKeys, c = slot(it, a);
        flash_pack(D, a, u.k0, u.k1, key, value, f.kt.data() + c * D * 16, f.vv.data() + c * D * 32, !single);
        if (u.ahead) u.ahead->next();
    };
    auto qk_group = [&](const ItemPlan &it, int64_t c, float *s) {
        if (!single) {
            const bf16_t *q = u.q + it.r0 * D;
            if (c == 0 && keep) {
                _tile_loadd(4, q, D * 2);
                if (D > 32) _tile_loadd(5, q + 32, D * 2);
            }
            const uint32_t *kt = f.kt.data() + slot(it, it.a0 + c * kFlashKeys) * D * 16;
            if (c % 2 == 0) qk_chunk<0>(q, D, keep, kt, s + c * kFlashKeys);
            else qk_chunk<2>(q, D, keep, kt, s + c * kFlashKeys);
            return;
        }
        // S^T of the chunk's two 16-key runs; the chunk before it goes back to S after this one's products
        // are issued, so that it reads tile stores that have landed.
        const uint32_t *qt = f.qt.data();
        if (c == 0 && keep) {
            _tile_loadd(6, qt, 64);
            if (D > 32) _tile_loadd(7, qt + 256, 64);
        }
        const int64_t a = it.a0 + c * kFlashKeys;
        bf16_t *tmp = f.krun.data() + (c % 2) * 32 * D;
        const bf16_t *k0 = key_run(D, a, u.k0, u.k1, key, tmp), *k1 = key_run(D, a + 16, u.k0, u.k1, key, tmp + 16 * D);
        if (u.ahead) u.ahead->next();
        if (c % 2 == 0) qkt_chunk<0>(k0, k1, D, keep, qt, f.st);
        else qkt_chunk<2>(k0, k1, D, keep, qt, f.st + 512);
        if (c > 0) st_to_s(f.st + (c - 1) % 2 * 512, it.R, s + (c - 1) * kFlashKeys);
        if (c == (it.a1 - it.a0) / kFlashKeys - 1) st_to_s(f.st + c % 2 * 512, it.R, s + c * kFlashKeys);
    };
    auto pv_groups = [&](int64_t j, int64_t g0, int64_t g1) {  // PV groups [g0, g1) of item j
        const ItemPlan &it = plan[j];
        const FlashScratch::Item &fi = f.item[j % 2];
        float *o = o_of(j);
        while (g0 < g1) {  // a pass's chunks at a time
            const int64_t d0 = g0 / nc_pv * 64, end = std::min(g1, (g0 / nc_pv + 1) * nc_pv);
            const uint16_t *vv = f.vv.data() + slot(it, it.a0) * D * 32 + d0 * 32;
            with_slices(int(std::min<int64_t>(4, (D - d0) / 16)), [&](auto ns) {
                for (int64_t g = g0; g < end; ++g)
                    pv_chunk(std::make_integer_sequence<int, decltype(ns)::value>(), D, g % nc_pv, nc_pv, vv, fi, o + d0);
            });
            g0 = end;
        }
    };
    auto issue = [&](int64_t k) {  // the step's next k groups
        const int64_t end = std::min(g_total, g_done + k);
        for (; g_done < end && g_done < g_pk; ++g_done) pack_chunk(plan[w_qk], g_done);
        for (; g_done < end && g_done < g_pk + g_qk; ++g_done) qk_group(plan[w_qk], g_done - g_pk, f.item[w_qk % 2].s);
        if (g_done < end) pv_groups(w_pv, g_done - g_pk - g_qk, end - g_pk - g_qk), g_done = end;
    };
    auto issue_rest = [&] { issue(g_total - g_done); };
    auto add = [&](int64_t j) {  // item j's products into its rows' acc, unless its PV stored them there
        const ItemPlan &it = plan[j];
        if (direct(it)) return;
        const float *o = o_of(j), *alpha = f.item[j % 2].alpha;
        for (int r = 0; r < it.R; ++r) {
            float *a = u.acc + (it.r0 + r) * D;
            if (it.first) {  // the row's first products: its factor is 0, or 1 with no weights
                std::memcpy(a, o + r * D, sizeof(float) * size_t(D));
                continue;
            }
            const __m512 al = _mm512_set1_ps(alpha[r]);
            for (int64_t d = 0; d < D; d += 16)
                _mm512_storeu_ps(a + d, _mm512_fmadd_ps(_mm512_loadu_ps(a + d), al, _mm512_loadu_ps(o + r * D + d)));
        }
    };

    if (single) pack_qt(u.q, D, f.qt.data());
    amx_begin();
    // Step i: item i - 2's add, then item i's softmax with item i + 1's packing and QK and item i - 1's PV
    // issued between its rows; steps -1 (item 0's QK alone) to n + 1 (item n - 1's add alone).
    auto item_or_none = [&](int64_t j) { return j >= 0 && j < n ? j : int64_t(-1); };
    for (int64_t i = -1; i <= n + 1; ++i) {
        if (item_or_none(i - 2) >= 0) add(i - 2);
        plan_step(item_or_none(i - 1), item_or_none(i + 1));
        if (item_or_none(i) >= 0) {
            const ItemPlan &it = plan[i];
            // After each of the softmax's 16 rows, an even share of what is left.
            flash_softmax(u, it.r0, it.R, it.a0, it.a1, f.item[i % 2],
                          [&](int r) {
                              if (g_done < g_total) issue((g_total - g_done + 15 - r) / (16 - r));
                          });
        }
        issue_rest();
    }
    amx_end();
}

}  // namespace cpuinfer::attn
