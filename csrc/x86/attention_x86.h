// x86 fast paths for the QK^T and PV tiles of paged attention, used when the
// query and the KV cache are both bf16 (products of bf16 values are exact in
// f32, so these paths only change the summation order):
//   avx512bf16: QK^T with VDPBF16PS (pairs of bf16 multiplied and summed into f32)
//   amx:        QK^T and PV as AMX-BF16 tile products for tiles of >= 8 query rows
//               (prefill chunks, decode with >= 8 query heads per KV head); PV
//               rounds the softmax weights to bf16, as flash-attention kernels do
// Under CPUINFER_SIMDE_EMULATION (the C++ test program on CPUs without
// AVX-512) the same code runs on SIMDe and on a software model of the AMX
// tiles (amx_emulation.h).
#pragma once
#include <cstdint>
#include <cstring>

#include "../common/attention_tile.h"
#include "../common/vec.h"
#include "bf16_x86.h"

#if defined(__AVX512BF16__) || defined(CPUINFER_SIMDE_AVX512BF16)
#define CPUINFER_ATTN_DPBF16 1
#endif
#if defined(__AMX_BF16__) || defined(CPUINFER_SIMDE_AMX)
#define CPUINFER_ATTN_AMX 1
#endif

#if defined(CPUINFER_ATTN_AMX)
#define CPUINFER_ATTN_IMPL "amx"
#elif defined(CPUINFER_ATTN_DPBF16)
#define CPUINFER_ATTN_IMPL "avx512bf16"
#endif

namespace cpuinfer::attn {

#if defined(CPUINFER_ATTN_DPBF16)
using x86::as_bh;

// 32 bf16 at p (or 16, zero-extended, for the last chunk of D = 80).
inline __m512i load_bf16x32(const bf16_t *p, int64_t n) {
    if (n >= 32) return _mm512_loadu_si512(reinterpret_cast<const void *>(p));
    return _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)), 0);
}

// s[r * s_stride + j] = dot(q[r * D ..], k[j * D ..]) for bf16 q and k (D a multiple of 16).
template <int R>
inline void qk_tile_dpbf16(const bf16_t *q, int64_t D, const bf16_t *k, int64_t j0, int64_t j1, float *s,
                           int64_t s_stride) {
    constexpr int U = R <= kTileRows / 2 ? 2 : 1;  // keys at once: 2 x R independent chains
    int64_t j = j0;
    for (; j < j1; j += U) {
        const bool two = U == 2 && j + 1 < j1;
        const bf16_t *k0p = k + j * D, *k1p = k + (two ? j + 1 : j) * D;
#define CPUINFER_ROWS(OP) \
    OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7) OP(8) OP(9) OP(10) OP(11) OP(12) OP(13) OP(14) OP(15)
#define DECL(i) __m512 a##i = _mm512_setzero_ps(), b##i = _mm512_setzero_ps();
        CPUINFER_ROWS(DECL)
#undef DECL
        for (int64_t c = 0; c < D; c += 32) {
            const int64_t n = D - c;
            __m512bh kv0 = as_bh(load_bf16x32(k0p + c, n)), kv1 = kv0;
            if constexpr (U == 2) kv1 = as_bh(load_bf16x32(k1p + c, n));
#define STEP(i)                                                   \
    if constexpr (i < R) {                                        \
        __m512bh qv = as_bh(load_bf16x32(q + i * D + c, n));      \
        a##i = _mm512_dpbf16_ps(a##i, qv, kv0);                   \
        if constexpr (U == 2) b##i = _mm512_dpbf16_ps(b##i, qv, kv1); \
    }
            CPUINFER_ROWS(STEP)
#undef STEP
        }
#define OUT(i)                                                                          \
    if constexpr (i < R) {                                                              \
        s[i * s_stride + j] = _mm512_reduce_add_ps(a##i);                               \
        if constexpr (U == 2) if (two) s[i * s_stride + j + 1] = _mm512_reduce_add_ps(b##i); \
    }
        CPUINFER_ROWS(OUT)
#undef OUT
#undef CPUINFER_ROWS
        if (U == 2 && !two) break;  // the odd last key was done as key j
    }
}
#endif

#if defined(CPUINFER_ATTN_AMX)
constexpr int kAmxMinRows = 8;  // below this a 16-row tile wastes too much of itself

// Tile registers: QK^T  C^T[16 keys x 16 rows] = K[16 keys x D] . Q^T
//   0: C (16 x 16 f32)   1: K chunk (16 keys x 32 bf16)   2: Q^T chunk, VNNI (16 pairs x 16 rows)
//   3, 4: the same for the last 16 columns of D = 80
// PV  O[16 rows x 16 d] = P[16 rows x 16 keys] . V[16 keys x 16 d]
//   5: P (16 x 16 bf16)   6: V chunk, VNNI (8 key pairs x 16 d)   7: O (16 x 16 f32)
using x86::TileConfig;

inline TileConfig make_tile_config() {
    TileConfig c;
    std::memset(&c, 0, sizeof c);
    c.palette = 1;
    const int rows[8] = {16, 16, 16, 16, 8, 16, 8, 16};
    const int colsb[8] = {64, 64, 64, 32, 64, 32, 64, 64};
    for (int t = 0; t < 8; ++t) c.rows[t] = uint8_t(rows[t]), c.colsb[t] = uint16_t(colsb[t]);
    return c;
}

// Our tile configuration, loaded at the start of every work unit (see
// x86::load_tile_config for why not once per thread).
inline void amx_begin() {
    static const TileConfig cfg = make_tile_config();
    x86::load_tile_config(cfg);
}

inline void amx_end() { x86::release_tiles(); }

// Q^T in VNNI layout for one tile of R <= 16 rows: qv[(c * 16 + i) * 16 + m]
// holds the bf16 pair (q[m][32c + 2i], q[m][32c + 2i + 1]); rows >= R are 0.
inline void amx_pack_q(uint32_t *qv, const bf16_t *q, int64_t D, int R) {
    for (int64_t i = 0; i < D / 2; ++i)
        for (int m = 0; m < 16; ++m) {
            uint32_t pair = 0;
            if (m < R) std::memcpy(&pair, q + m * D + 2 * i, 4);
            qv[i * 16 + m] = pair;
        }
}

// s[r * s_stride + j] = dot(q_r, k_j) for j in [j0, j1), r < R, from the packed Q^T.
inline void qk_tile_amx(const uint32_t *qv, int R, int64_t D, const bf16_t *k, int64_t j0, int64_t j1, float *s,
                        int64_t s_stride) {
    alignas(64) float c[16 * 16];
    const int64_t full = D / 32;
    for (int64_t g = j0 / 16 * 16; g < j1; g += 16) {  // blocks are multiples of 16 keys
        _tile_zero(0);
        for (int64_t ch = 0; ch < full; ++ch) {
            _tile_loadd(1, k + g * D + ch * 32, D * 2);
            _tile_loadd(2, qv + ch * 16 * 16, 64);
            _tile_dpbf16ps(0, 1, 2);
        }
        if (D % 32) {
            _tile_loadd(3, k + g * D + full * 32, D * 2);
            _tile_loadd(4, qv + full * 16 * 16, 64);
            _tile_dpbf16ps(0, 3, 4);
        }
        _tile_stored(0, c, 64);
        for (int64_t j = std::max(j0, g); j < std::min(j1, g + 16); ++j)
            for (int r = 0; r < R; ++r) s[r * s_stride + j] = c[(j - g) * 16 + r];
    }
}

// acc[r] = acc[r] * alpha[r] + sum_j p[r][j] v[j] for j in [j0, j1), r < R.
inline void pv_tile_amx(float *acc, int R, int64_t D, const float *alpha, const float *p, int64_t p_stride,
                        const bf16_t *v, int64_t j0, int64_t j1, uint16_t *vv) {
    alignas(64) uint16_t pb[16 * 16];
    alignas(64) float o[16 * 16];
    for (int r = 0; r < R; ++r) {
        vec::vf al = vec::splat(alpha[r]);
        for (int64_t d = 0; d < D; d += 16) vec::store(acc + r * D + d, vec::mul(vec::load(acc + r * D + d), al));
    }
    for (int64_t g = j0 / 16 * 16; g < j1; g += 16) {
        for (int m = 0; m < 16; ++m)
            for (int j = 0; j < 16; ++j) {
                const bool live = m < R && g + j >= j0 && g + j < j1;
                pb[m * 16 + j] = live ? f32_to_bf16_bits(p[m * p_stride + g + j]) : 0;
            }
        // V rows 2i and 2i+1 interleaved: vv[(dc * 8 + i) * 32 + n * 2 + {0,1}].
        for (int64_t i = 0; i < 8; ++i)
            for (int64_t d = 0; d < D; ++d) {
                uint16_t *dst = vv + ((d / 16) * 8 + i) * 32 + (d % 16) * 2;
                dst[0] = v[(g + 2 * i) * D + d].bits;
                dst[1] = v[(g + 2 * i + 1) * D + d].bits;
            }
        _tile_loadd(5, pb, 32);
        for (int64_t dc = 0; dc < D / 16; ++dc) {
            _tile_zero(7);
            _tile_loadd(6, vv + dc * 8 * 32, 64);
            _tile_dpbf16ps(7, 5, 6);
            _tile_stored(7, o, 64);
            for (int r = 0; r < R; ++r) {
                float *a = acc + r * D + dc * 16;
                vec::store(a, vec::add(vec::load(a), vec::load(o + r * 16)));
            }
        }
    }
}
#endif

}  // namespace cpuinfer::attn
