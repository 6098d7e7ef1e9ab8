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
#include <cstring>

#include "../common/vec.h"

#if defined(__AVX512BF16__) || defined(CPUINFER_SIMDE_AVX512BF16)

namespace cpuinfer::panel {

inline __m512bh as_bh(__m512i x) {
#if defined(CPUINFER_SIMDE_EMULATION)
    __m512bh r;
    std::memcpy(&r, &x, sizeof r);
    return r;
#else
    return (__m512bh)x;
#endif
}

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

#if !(defined(__AMX_BF16__) || defined(CPUINFER_SIMDE_AMX))
template <>
struct PanelKernel<bf16_t> : DpBf16Tiles {};
#endif

}  // namespace cpuinfer::panel

#endif
