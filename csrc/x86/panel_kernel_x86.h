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
// columns are a B tile as they lie (rows of 64 bytes, 128 bytes apart); x is
// copied by pack_x into whole 16-row tiles, each k-step's 16 x 32 A tile one
// contiguous KB. A call takes up to 128 rows x one panel (32 columns):
//   for each block of kKBlock k (its 16 KB of the panel stay in L1):
//     for each 32 rows: four C tiles (32 x 32) from acc (or zero), the
//     block's k-steps (2 A and 2 B tiles, 4 products each), C back to acc.
// Measured on one Sapphire Rapids core (2-core VM, one thread): tile loads
// are fast from L1 and slow from L2 (a KB per 16-25 ns, against ~8 ns from
// L1), so the panel must stay in L1 across the row groups: K blocks of 256
// gave 1.1-1.2x the unblocked loop at K = 1536-2048, the same at K = 576.
// Tried and dropped: double-buffered 16 x 32 tiles (the loads of one step
// overlapping the products of the other: 1.7x in a loop with everything in
// L1, no better inside the GEMM) and software prefetch of the A tiles (0.9x).
// The k-steps run in the same order for every row count and C passes
// through f32 memory exactly, so a row's result does not depend on its
// batch; K not a multiple of 32 takes the VDPBF16PS tile for every row
// count instead. The C++ tests run it on the software tile model
// (emulation/amx_emulation.h).
struct AmxTiles {
    static constexpr int kPair = 2;
    static constexpr const char *kName = "amx";
    using X = bf16_t;
    static constexpr bool kPairOrder = false;
    static constexpr int kMaxRows = 128;  // the driver's acc holds 128 rows x 32 columns
    static constexpr int kRowPad = 16;
    static constexpr bool kCopyX = true;
    static constexpr int64_t kChunkBytes = 768 * 1024;  // x per row chunk: the panels stream from L3 once per chunk (2 MB L2); 1.05-1.2x over 192 KB at M = 2048
    static constexpr int64_t kKBlock = 256;  // k per block: 16 KB of panel, 8 KB of each A row group
    static int panels(int) { return 1; }

    // Our tile configuration, loaded per thread before a run of calls (see x86::load_tile_config).
    static void begin() { x86::load_tile_config(x86::full_tiles()); }
    static void end() { x86::release_tiles(); }

    // K % 32 == 0: x in 16-row tiles, [group][k / 32][16 rows][32 k] (the
    // returned stride K puts group r / 16 at x + r * K); else row-major for
    // the VDPBF16PS tile.
    static int64_t pack_x(bf16_t *dst, int64_t ds, const bf16_t *x, int64_t xs, int64_t rows, int64_t padded,
                          int64_t K) {
        if (K % 32 != 0) return RegisterTiles<DpBf16Tiles>::pack_x(dst, ds, x, xs, rows, padded, K);
        const __m512i zero = _mm512_setzero_si512();
        for (int64_t g = 0; g < padded; g += 16) {
            bf16_t *tile = dst + g * K;
            for (int64_t k = 0; k < K; k += 32, tile += 512)
                for (int64_t r = 0; r < 16; ++r)
                    _mm512_storeu_si512(tile + r * 32, g + r < rows ? _mm512_loadu_si512(x + (g + r) * xs + k) : zero);
        }
        return K;
    }

    // acc[r * 32 + j] for r < mr (<= 128), j < 32.
    static void run(int mr, int np, const bf16_t *x, int64_t xs, const bf16_t *w, int64_t ps, int64_t K,
                    float *acc) {
        (void)np;
        if (K % 32 != 0) {
            for (int r0 = 0; r0 < mr; r0 += 12)
                DpBf16Tiles::run(std::min(12, mr - r0), 1, x + r0 * xs, xs, w, ps, K, acc + r0 * 32);
            return;
        }
        const bool stream = mr <= 4;  // decode: the panel comes from memory
        for (int64_t k0 = 0; k0 < K; k0 += kKBlock) {
            const int64_t k1 = std::min(K, k0 + kKBlock);
            for (int g = 0; g < mr; g += 32) {
                const bool two = g + 16 < mr;
                float *c = acc + g * 32;
                if (k0 == 0) {
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                } else {
                    _tile_loadd(0, c, 128);
                    _tile_loadd(1, c + 16, 128);
                    if (two) {
                        _tile_loadd(2, c + 16 * 32, 128);
                        _tile_loadd(3, c + 16 * 32 + 16, 128);
                    }
                }
                const bf16_t *a0 = x + g * K, *a1 = x + (g + 16) * K;  // one KB per k-step each
                for (int64_t k = k0; k < k1; k += 32) {
                    const bf16_t *wk = w + k * 32;  // 16 k-pairs x 32 columns x 2
                    if (stream) prefetch_stream(wk, 2048);
                    _tile_loadd(4, a0 + k * 16, 64);
                    _tile_loadd(6, wk, 128);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_loadd(7, wk + 32, 128);
                    _tile_dpbf16ps(1, 4, 7);
                    if (two) {
                        _tile_loadd(5, a1 + k * 16, 64);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                }
                _tile_stored(0, c, 128);
                _tile_stored(1, c + 16, 128);
                if (two) {
                    _tile_stored(2, c + 16 * 32, 128);
                    _tile_stored(3, c + 16 * 32 + 16, 128);
                }
            }
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
