// x86 specialisation of the packed linear tile (see common/panel_kernel.h).
//
// avx512bf16 / amx: bf16 weights are packed in pairs of k (kPair = 2), the
// layout VDPBF16PS reads: one zmm holds 16 output features x 2 consecutive k.
// A row of x contributes the same pair (x[k], x[k+1]) to all 16 lanes, a
// 32-bit broadcast straight from x (no activation packing: the broadcast is
// the instruction's memory operand). Each instruction does 32 multiply-adds
// with one f32 rounding per pair of products; the order is fixed by k, so the
// result is deterministic and independent of MR.
// Under CPUINFER_SIMDE_EMULATION the same code runs on SIMDe.
#pragma once
#include <algorithm>
#include <cstring>

#include "../common/vec.h"
#include "bf16_x86.h"

#if defined(__AVX512BF16__) || defined(CPUINFER_SIMDE_AVX512BF16)

namespace cpuinfer::panel {

using x86::as_bh;

// The VDPBF16PS register tile (the avx512bf16 variant's bf16 kernel; the amx
// variant's for K not a multiple of 32).
struct DpBf16Tiles : RegisterTiles<DpBf16Tiles> {
    static constexpr int kPair = 2;
    static constexpr const char *kName = "avx512bf16";
    using X = bf16_t;  // x as it lies: the pair broadcast reads it directly
    static constexpr bool kPairOrder = false;  // accumulators in natural column order

    template <int MR, int NP>
    static void tile(const bf16_t *x, int64_t xs, const bf16_t *w, int64_t ps, int64_t K, float *acc) {
        static_assert(MR >= 1 && MR <= kMaxRows && NP >= 1 && NP <= 4 && MR * NP <= 12, "tile shape");
        const bf16_t *w0 = w, *w1 = w + (NP > 1 ? ps : 0), *w2 = w + (NP > 2 ? 2 * ps : 0), *w3 = w + (NP > 3 ? 3 * ps : 0);
#define CPUINFER_DECL(s) __m512 c##s##a = _mm512_setzero_ps(), c##s##b = _mm512_setzero_ps();
        CPUINFER_PANEL_SLOTS(CPUINFER_DECL)
#undef CPUINFER_DECL
        const int64_t pairs = K / 2;
        for (int64_t p = 0; p < pairs; ++p) {
            const int64_t o = p * 64;  // a pair of k for 32 columns
            // Few rows (decode) stream the weight from memory: fetch ahead
            // as in the GEMV. With many rows the panel is already in cache.
            if constexpr (MR <= 4) {
                prefetch_stream(w0 + o, 128);
                if constexpr (NP > 1) prefetch_stream(w1 + o, 128);
                if constexpr (NP > 2) prefetch_stream(w2 + o, 128);
                if constexpr (NP > 3) prefetch_stream(w3 + o, 128);
            }
            __m512bh b0a = as_bh(_mm512_loadu_si512(w0 + o)), b0b = as_bh(_mm512_loadu_si512(w0 + o + 32));
            __m512bh b1a = b0a, b1b = b0b, b2a = b0a, b2b = b0b, b3a = b0a, b3b = b0b;
            if constexpr (NP > 1) b1a = as_bh(_mm512_loadu_si512(w1 + o)), b1b = as_bh(_mm512_loadu_si512(w1 + o + 32));
            if constexpr (NP > 2) b2a = as_bh(_mm512_loadu_si512(w2 + o)), b2b = as_bh(_mm512_loadu_si512(w2 + o + 32));
            if constexpr (NP > 3) b3a = as_bh(_mm512_loadu_si512(w3 + o)), b3b = as_bh(_mm512_loadu_si512(w3 + o + 32));
#define CPUINFER_SLOT(s)                                                              \
    if constexpr (s < MR * NP) {                                                      \
        constexpr int r = s / NP, q = s % NP;                                         \
        int32_t xp;                                                                   \
        std::memcpy(&xp, x + r * xs + 2 * p, 4);                                      \
        __m512bh a = as_bh(_mm512_set1_epi32(xp));                                    \
        c##s##a = _mm512_dpbf16_ps(c##s##a, a, pick<q>(b0a, b1a, b2a, b3a));          \
        c##s##b = _mm512_dpbf16_ps(c##s##b, a, pick<q>(b0b, b1b, b2b, b3b));          \
    }
            CPUINFER_PANEL_SLOTS(CPUINFER_SLOT)
#undef CPUINFER_SLOT
        }
#define CPUINFER_STORE(s)                             \
    if constexpr (s < MR * NP) {                      \
        _mm512_storeu_ps(acc + s * 32, c##s##a);      \
        _mm512_storeu_ps(acc + s * 32 + 16, c##s##b); \
    }
        CPUINFER_PANEL_SLOTS(CPUINFER_STORE)
#undef CPUINFER_STORE
    }

    // 12 independent VDPBF16PS chains (32 multiply-adds each per step).
    static int64_t peak(int64_t iters, float *sink) {
        const __m512bh a = as_bh(_mm512_set1_epi16(0x3000));  // bf16 ~4.7e-10
#define CPUINFER_DECL(i) __m512 c##i = _mm512_setzero_ps(); const __m512bh b##i = as_bh(_mm512_set1_epi16(0x3f80 + i));
        CPUINFER_PANEL_SLOTS(CPUINFER_DECL)
#undef CPUINFER_DECL
        for (int64_t it = 0; it < iters; ++it) {
#define CPUINFER_STEP(i) c##i = _mm512_dpbf16_ps(c##i, a, b##i);
            CPUINFER_PANEL_SLOTS(CPUINFER_STEP)
#undef CPUINFER_STEP
        }
        __m512 s = _mm512_setzero_ps();
#define CPUINFER_SUM(i) s = _mm512_add_ps(s, c##i);
        CPUINFER_PANEL_SLOTS(CPUINFER_SUM)
#undef CPUINFER_SUM
        *sink = _mm512_reduce_add_ps(s);
        return 12 * iters * 32;
    }
};

#if defined(__AMX_BF16__) || defined(CPUINFER_SIMDE_AMX)

// amx: AMX-BF16 tiles on the same packed layout. A panel's 16 k-pairs x 16
// columns are a B tile as they lie (rows of 64 bytes, 128 bytes apart), 16
// rows x 32 k of x an A tile, so up to 32 rows x one panel run as four 16 x 16
// f32 accumulator tiles (0-3), two A tiles (4, 5) and two B tiles (6, 7),
// with no repacking. x is read through the driver's copy, zero-padded to
// whole 16-row tiles. Every row count takes this path (decode too: the B
// loads are the same weight bytes), so a row's result does not depend on
// its batch; K not a multiple of 32 takes the VDPBF16PS tile for every row
// count instead. Not timed here (no AMX on the development machine); the
// C++ tests run it on the software tile model (amx_emulation.h).
struct AmxTiles {
    static constexpr int kPair = 2;
    static constexpr const char *kName = "amx";
    using X = bf16_t;
    static constexpr bool kPairOrder = false;
    static constexpr int kMaxRows = 32;
    static constexpr int kRowPad = 16;
    static constexpr bool kCopyX = true;
    static int panels(int) { return 1; }

    static const x86::TileConfig &config() {
        static const x86::TileConfig cfg = [] {
            x86::TileConfig c;
            std::memset(&c, 0, sizeof c);
            c.palette = 1;
            for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
            return c;
        }();
        return cfg;
    }
    // Our tile configuration, loaded per thread before a run of calls (see x86::load_tile_config).
    static void begin() { x86::load_tile_config(config()); }
    static void end() { x86::release_tiles(); }

    // acc[r * 32 + j] for r < mr (<= 32), j < 32; x has whole 16-row tiles.
    static void run(int mr, int np, const bf16_t *x, int64_t xs, const bf16_t *w, int64_t ps, int64_t K,
                    float *acc) {
        (void)np;
        if (K % 32 != 0) {
            for (int r0 = 0; r0 < mr; r0 += 12)
                DpBf16Tiles::run(std::min(12, mr - r0), 1, x + r0 * xs, xs, w, ps, K, acc + r0 * 32);
            return;
        }
        const bool two = mr > 16;
        const int64_t xb = xs * int64_t(sizeof(bf16_t));
        _tile_zero(0);
        _tile_zero(1);
        if (two) {
            _tile_zero(2);
            _tile_zero(3);
        }
        for (int64_t k = 0; k < K; k += 32) {
            const bf16_t *wk = w + k * 32;  // 16 k-pairs x 32 columns x 2
            if (mr <= 4) prefetch_stream(wk, 2048);
            _tile_loadd(6, wk, 128);
            _tile_loadd(7, wk + 32, 128);
            _tile_loadd(4, x + k, xb);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (two) {
                _tile_loadd(5, x + 16 * xs + k, xb);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, acc, 128);
        _tile_stored(1, acc + 16, 128);
        if (two) {
            _tile_stored(2, acc + 16 * 32, 128);
            _tile_stored(3, acc + 16 * 32 + 16, 128);
        }
    }

    // Four independent TDPBF16PS chains (16 x 16 x 32 multiply-adds each).
    static int64_t peak(int64_t iters, float *sink) {
        alignas(64) static const uint16_t zeros[16 * 32] = {};
        alignas(64) float c[16 * 16];
        begin();
        _tile_zero(0);  // tile numbers are immediates: no loop
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        _tile_loadd(4, zeros, 64);
        _tile_loadd(5, zeros, 64);
        _tile_loadd(6, zeros, 64);
        _tile_loadd(7, zeros, 64);
        for (int64_t it = 0; it < iters; ++it) {
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, c, 64);
        end();
        *sink = c[0];
        return iters * 4 * 16 * 16 * 32;
    }
};

template <>
struct PanelKernel<bf16_t> : AmxTiles {};
#else
template <>
struct PanelKernel<bf16_t> : DpBf16Tiles {};
#endif

}  // namespace cpuinfer::panel

#endif
