// x86 fast paths for the QK^T and PV tiles of paged attention, used when the
// query and the KV cache are both bf16 (products of bf16 values are exact in
// f32, so these paths only change the summation order):
//   avx512bf16: QK^T with VDPBF16PS (pairs of bf16 multiplied and summed into
//               f32) on keys transposed once per block, 16 keys to a vector; PV
//               on the vector layer's f32 FMAs (attention_tile.h)
//   amx:        every unit (any row count; head sizes that are multiples of 32)
//               as flash attention on AMX-BF16 tiles, QK^T and PV, the softmax
//               weights in two bf16 terms; other head sizes (80) as avx512bf16
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

#if defined(CPUINFER_ATTN_DPBF16)
using x86::as_bh;

// 32 bf16 at p (or 16, zero-extended, for the last chunk of D = 80).
inline __m512i load_bf16x32(const bf16_t *p, int64_t n) {
    if (n >= 32) return _mm512_loadu_si512(reinterpret_cast<const void *>(p));
    return _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)), 0);
}

// 16 x 16 32-bit transpose of r[0..15] in place. (The AMX path's flash_pack
// uses it too: amx builds always have AVX512-BF16.)
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

#if defined(CPUINFER_ATTN_AMX)
// amx: every unit (query rows of one KV head: a prefill chunk or a decode step) runs as
// flash attention on AMX-BF16 tiles, 32 keys at a time:
//   S = Q K^T   A: Q (16 rows x 32 d, straight from the query rows)
//               B: K^T in VNNI form (16 d-pairs x 16 keys), packed per chunk
//   softmax     on S's rows in f32 (scale, soft-cap, causal/window mask,
//               online max and sum), as the vector path does
//   O += P V    A: P (16 rows x 32 keys)  B: V in VNNI form (16 key-pairs x 16 d)
// The keys of a chunk are packed once and serve every 16-row tile of the
// unit (up to 4), so packing costs a fraction of the tile work; packing
// reads key rows one by one, so chunks may straddle KV blocks of any size.
//
// Precision: Q and K are bf16 already, and their products are exact in
// the f32 accumulators. P is not: rounding it to bf16 (as flash-attention
// kernels on GPUs do) cost ~2^-9 per weight, which measured on real models
// (SmolLM2 Q4_1, Gemma 3) moved first-token logits 2-8x further from
// transformers than the f32 paths. So P goes in as two bf16 terms, hi =
// bf16(P) and lo = bf16(P - hi) (P to ~2^-17), in two tile products: the
// output is then as exact as the f32 FMA path's, for half again the tile
// work (PV is half the FLOPs).
constexpr int64_t kFlashKeys = 32;


// Per-thread buffers of the AMX path: packed chunks (chunk c at c * D * 16 of
// each), as many as the unit has when the accumulator stays in tiles (D <= 64).
struct FlashScratch {
    std::vector<uint32_t> kt;  // K^T chunk: [D/32][2 key halves][16 d-pairs][16 keys]
    std::vector<uint16_t> vv;  // V chunk: [D/16][16 key-pairs][16 d][2]
    std::vector<uint8_t> packed;  // per chunk: packed yet
    void reserve(int64_t D, int64_t chunks) {
        if (int64_t(kt.size()) < chunks * D * 16) kt.resize(size_t(chunks * D * 16)), vv.resize(size_t(chunks * D * 32));
        packed.assign(size_t(chunks), 0);
    }
};

inline void amx_begin() { x86::load_tile_config(x86::full_tiles()); }

// e^x for the softmax's x <= 0 (x - the row's max), in 12 instructions instead of vec::exp's 18:
// n = round(x log2(e)), r = x - n ln(2) in two steps (Cody-Waite, as vec::exp), a degree-6 Taylor
// polynomial of e^r (|r| <= ln(2) / 2: relative error < 2e-7 over the whole range), times 2^n by
// VSCALEFPS (which underflows to 0 by itself; vec::exp builds 2^n from bits and must clamp).
inline __m512 exp_nonpos(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));  // -inf (a masked key) to a finite 0 weight
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

inline void amx_end() { x86::release_tiles(); }

// Packs keys [c0, c0 + n) (n <= 32; the rest zero) as K^T and V tiles.
// key(j) and value(j) give the rows of absolute key j.
template <typename KeyRow, typename ValueRow>
inline void flash_pack(int64_t D, int64_t c0, int64_t n, KeyRow &&key, ValueRow &&value, uint32_t *kt, uint16_t *vv) {
    const __m512i zero = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {
        const bf16_t *rows[16];
        for (int j = 0; j < 16; ++j) rows[j] = 16 * h + j < n ? key(c0 + 16 * h + j) : nullptr;
        for (int64_t ch = 0; ch < D / 32; ++ch) {
            __m512i r[16];
            for (int j = 0; j < 16; ++j) r[j] = rows[j] ? _mm512_loadu_si512(rows[j] + ch * 32) : zero;
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
        const bf16_t *a = 2 * i < n ? value(c0 + 2 * i) : nullptr, *b = 2 * i + 1 < n ? value(c0 + 2 * i + 1) : nullptr;
        for (int64_t g = 0; g < D / 32; ++g) {
            const __m512i va = a ? _mm512_loadu_si512(a + 32 * g) : zero, vb = b ? _mm512_loadu_si512(b + 32 * g) : zero;
            _mm512_storeu_si512(vv + ((2 * g) * 16 + i) * 32, _mm512_permutex2var_epi16(va, ilo, vb));
            _mm512_storeu_si512(vv + ((2 * g + 1) * 16 + i) * 32, _mm512_permutex2var_epi16(va, ihi, vb));
        }
    }
}

// One 16-row tile's softmax step over a chunk: S (16 x 32 f32, from the QK
// tiles) -> the weights as bf16 hi + lo parts, the rows' m and l updated, and
// alpha[r] the factor of row r's accumulator. Returns whether any alpha is not 1.
inline bool flash_softmax(const FlashUnit &u, int64_t r0, int R, int64_t c0, int64_t n, const float *s,
                          bf16_t *p_hi, bf16_t *p_lo, float *alpha) {
    using namespace vec;
    const int64_t W = u.window;
    const int64_t *pos = u.pos + r0;
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const vf ninf = splat(-std::numeric_limits<float>::infinity());
    bool any_rescale = false;
    for (int r = 0; r < 16; ++r) {
        const float *sr = s + r * 32;
        int64_t lo = c0, hi = c0 + n;
        if (r < R) {
            lo = std::max(lo, W > 0 ? pos[r] - W + 1 : int64_t(0));
            hi = std::min(hi, pos[r] + 1);
        }
        alpha[r] = 1.f;
        if (r >= R || lo >= hi) {  // nothing to add: zero weights
            _mm512_storeu_si512(p_hi + r * 32, _mm512_setzero_si512());
            _mm512_storeu_si512(p_lo + r * 32, _mm512_setzero_si512());
            continue;
        }
        vf e0, e1;
        float mold = u.m[r0 + r], mnew;
        if (u.soft_cap <= 0.f && lo == c0 && hi == c0 + kFlashKeys) {
            // Every key of a full chunk visible (all but the diagonal chunks): no masks, and the
            // scale folded into the exponent, max(s) * scale being max(s * scale) for scale > 0.
            const vf s0 = load(sr), s1 = load(sr + 16);
            mnew = std::max(mold, reduce_max(max(s0, s1)) * u.qscale);
            const vf qs = splat(u.qscale), nm = splat(-mnew);
            e0.v = exp_nonpos(vec::fma(s0, qs, nm).v);
            e1.v = exp_nonpos(vec::fma(s1, qs, nm).v);
        } else {
            // Keys [lo, hi) of the chunk, as lane indices.
            const vf vlo = splat(float(lo - c0)), vhi = splat(float(hi - c0));
            vf x0 = mul(load(sr), splat(u.qscale)), x1 = mul(load(sr + 16), splat(u.qscale));
            if (u.soft_cap > 0.f) {
                x0 = mul(splat(u.soft_cap), vec::tanh(x0));
                x1 = mul(splat(u.soft_cap), vec::tanh(x1));
            }
            const vf j0 = {iota}, j1 = {_mm512_add_ps(iota, _mm512_set1_ps(16.f))};
            const __mmask16 m0 = _mm512_cmp_ps_mask(j0.v, vlo.v, _CMP_GE_OQ) & _mm512_cmp_ps_mask(j0.v, vhi.v, _CMP_LT_OQ);
            const __mmask16 m1 = _mm512_cmp_ps_mask(j1.v, vlo.v, _CMP_GE_OQ) & _mm512_cmp_ps_mask(j1.v, vhi.v, _CMP_LT_OQ);
            x0.v = _mm512_mask_mov_ps(ninf.v, m0, x0.v);
            x1.v = _mm512_mask_mov_ps(ninf.v, m1, x1.v);
            mnew = std::max(mold, reduce_max(max(x0, x1)));
            e0.v = _mm512_maskz_mov_ps(m0, exp_nonpos(sub(x0, splat(mnew)).v));
            e1.v = _mm512_maskz_mov_ps(m1, exp_nonpos(sub(x1, splat(mnew)).v));
        }
        // hi and lo parts of the weights (see above).
        store(p_hi + r * 32, e0);
        store(p_hi + r * 32 + 16, e1);
        store(p_lo + r * 32, sub(e0, load(p_hi + r * 32)));
        store(p_lo + r * 32 + 16, sub(e1, load(p_hi + r * 32 + 16)));
        alpha[r] = mold == mnew ? 1.f : std::exp(mold - mnew);  // 0 when mold is -inf
        u.l[r0 + r] = u.l[r0 + r] * alpha[r] + reduce_add(add(e0, e1));
        u.m[r0 + r] = mnew;
        any_rescale |= alpha[r] != 1.f;
    }
    return any_rescale;
}

// S of rows [r0, r0 + 16) against a packed chunk, into s (tiles 0-3).
inline void flash_qk(const FlashUnit &u, int64_t r0, const uint32_t *kt, float *s) {
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t ch = 0; ch < u.D / 32; ++ch) {
        _tile_loadd(2, u.q + r0 * u.D + ch * 32, u.D * 2);
        _tile_loadd(3, kt + (ch * 2) * 256, 64);
        _tile_dpbf16ps(0, 2, 3);
        _tile_loadd(3, kt + (ch * 2 + 1) * 256, 64);
        _tile_dpbf16ps(1, 2, 3);
    }
    _tile_stored(0, s, 128);
    _tile_stored(1, s + 16, 128);
}

// The whole unit: every chunk of 32 keys against every 16-row tile that sees
// any of them. Rows are token-major, so positions never decrease with the row.
// D <= 64: tile after tile, each through all its chunks with its accumulator
// in tiles 4-7 (D / 16 of them), out to memory only when a row's max grows
// (then scaled there) and at the end; the chunks are packed once for the unit.
// Larger D: chunk after chunk, the products of each added to the accumulator
// in memory. A row's operations do not depend on the other rows of its tile
// (a chunk only other rows see adds exact zeros, a factor of 1 is exact), so
// its result does not depend on its batch.
template <typename KeyRow, typename ValueRow>
inline void flash_unit_amx(const FlashUnit &u, KeyRow &&key, ValueRow &&value) {
    const int64_t D = u.D, W = u.window;
    const int64_t chunks = (u.k1 - u.k0 + kFlashKeys - 1) / kFlashKeys;
    const bool in_tiles = D <= 64;
    thread_local FlashScratch tls;
    FlashScratch &f = tls;  // one TLS lookup: each access to a thread_local in a shared library calls
    f.reserve(D, in_tiles ? chunks : 1);  // __tls_get_addr (it was in the PV loop, with a vzeroupper)
    alignas(64) float s[16 * 32], o[16 * 16], alpha[16], ta[16 * 64];
    alignas(64) bf16_t p_hi[16 * 32], p_lo[16 * 32];
    auto sees = [&](int64_t r0, int R, int64_t c0, int64_t n) {  // some row of the tile sees a key of the chunk
        const int64_t *pos = u.pos + r0;
        return !(pos[R - 1] < c0 || (W > 0 && pos[0] - W + 1 >= c0 + n));
    };
    amx_begin();
    if (in_tiles) {
        const int64_t oc = D / 16;  // accumulator tiles
        for (int64_t r0 = 0; r0 < u.rows; r0 += 16) {
            const int R = int(std::min<int64_t>(16, u.rows - r0));
            // The tile's accumulator rows, 64 floats apart (rows past R zero, never copied back).
            float *acc = u.acc + r0 * D;
            for (int r = 0; r < 16; ++r)
                for (int64_t d = 0; d < 64; d += 16)
                    _mm512_store_ps(ta + r * 64 + d, r < R && d < D ? _mm512_loadu_ps(acc + r * D + d) : _mm512_setzero_ps());
            auto load_acc = [&] {
                _tile_loadd(4, ta, 256);
                _tile_loadd(5, ta + 16, 256);
                if (oc > 2) {
                    _tile_loadd(6, ta + 32, 256);
                    _tile_loadd(7, ta + 48, 256);
                }
            };
            auto store_acc = [&] {
                _tile_stored(4, ta, 256);
                _tile_stored(5, ta + 16, 256);
                if (oc > 2) {
                    _tile_stored(6, ta + 32, 256);
                    _tile_stored(7, ta + 48, 256);
                }
            };
            load_acc();
            for (int64_t c = 0; c < chunks; ++c) {
                const int64_t c0 = u.k0 + c * kFlashKeys, n = std::min(kFlashKeys, u.k1 - c0);
                if (!sees(r0, R, c0, n)) continue;
                uint32_t *kt = f.kt.data() + c * D * 16;
                uint16_t *vv = f.vv.data() + c * D * 32;
                if (!f.packed[size_t(c)]) {
                    flash_pack(D, c0, n, key, value, kt, vv);
                    f.packed[size_t(c)] = 1;
                }
                flash_qk(u, r0, kt, s);
                if (flash_softmax(u, r0, R, c0, n, s, p_hi, p_lo, alpha)) {
                    store_acc();
                    for (int r = 0; r < R; ++r) {
                        if (alpha[r] == 1.f) continue;
                        const __m512 al = _mm512_set1_ps(alpha[r]);
                        for (int64_t d = 0; d < D; d += 16)
                            _mm512_store_ps(ta + r * 64 + d, _mm512_mul_ps(_mm512_load_ps(ta + r * 64 + d), al));
                    }
                    load_acc();
                }
                _tile_loadd(0, p_hi, 64);
                _tile_loadd(1, p_lo, 64);
                _tile_loadd(2, vv, 64);
                _tile_dpbf16ps(4, 0, 2);
                _tile_dpbf16ps(4, 1, 2);
                _tile_loadd(3, vv + 16 * 32, 64);
                _tile_dpbf16ps(5, 0, 3);
                _tile_dpbf16ps(5, 1, 3);
                if (oc > 2) {
                    _tile_loadd(2, vv + 2 * 16 * 32, 64);
                    _tile_dpbf16ps(6, 0, 2);
                    _tile_dpbf16ps(6, 1, 2);
                    _tile_loadd(3, vv + 3 * 16 * 32, 64);
                    _tile_dpbf16ps(7, 0, 3);
                    _tile_dpbf16ps(7, 1, 3);
                }
            }
            store_acc();
            for (int r = 0; r < R; ++r)
                for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(acc + r * D + d, _mm512_load_ps(ta + r * 64 + d));
        }
        amx_end();
        return;
    }
    uint32_t *kt = f.kt.data();
    uint16_t *vv = f.vv.data();
    for (int64_t c0 = u.k0; c0 < u.k1; c0 += kFlashKeys) {
        const int64_t n = std::min(kFlashKeys, u.k1 - c0);
        bool packed = false;
        for (int64_t r0 = 0; r0 < u.rows; r0 += 16) {
            const int R = int(std::min<int64_t>(16, u.rows - r0));
            if (!sees(r0, R, c0, n)) continue;
            if (!packed) {
                flash_pack(D, c0, n, key, value, kt, vv);
                packed = true;
            }
            flash_qk(u, r0, kt, s);
            const bool any_rescale = flash_softmax(u, r0, R, c0, n, s, p_hi, p_lo, alpha);
            _tile_loadd(5, p_hi, 64);
            _tile_loadd(4, p_lo, 64);
            for (int64_t dc = 0; dc < D / 16; ++dc) {
                _tile_zero(7);
                _tile_loadd(6, vv + dc * 16 * 32, 64);
                _tile_dpbf16ps(7, 5, 6);
                _tile_dpbf16ps(7, 4, 6);
                _tile_stored(7, o, 64);
                for (int r = 0; r < R; ++r) {
                    float *a = u.acc + (r0 + r) * D + dc * 16;
                    __m512 prev = _mm512_loadu_ps(a);
                    if (any_rescale) prev = _mm512_mul_ps(prev, _mm512_set1_ps(alpha[r]));
                    _mm512_storeu_ps(a, _mm512_add_ps(prev, _mm512_load_ps(o + r * 16)));
                }
            }
        }
    }
    amx_end();
}
#endif

// The hooks of common/attention_tile.h this build fills.
#if defined(CPUINFER_ATTN_DPBF16)
template <>
struct QkBf16<bf16_t, bf16_t> {
    static constexpr bool kAvailable = true;
    static void pack(const bf16_t *k, int64_t D, int64_t bs, int64_t j0, int64_t j1, std::vector<uint32_t> &buf) {
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
template <>
struct WholeUnit<bf16_t, bf16_t> {
    // Every row count, decode included, so that a row's result does not depend
    // on its batch (the engine's greedy outputs rely on it, as on the GEMM's).
    static bool applies(int64_t, int64_t D) { return D % 32 == 0; }
    template <typename KeyRow, typename ValueRow>
    static void run(const FlashUnit &u, KeyRow &&key, ValueRow &&value) {
        flash_unit_amx(u, key, value);
    }
};
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
