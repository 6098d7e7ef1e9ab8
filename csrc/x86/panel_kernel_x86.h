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

template <>
struct PanelKernel<bf16_t> {
    static constexpr int kPair = 2;
    static constexpr const char *kName = "avx512bf16";
    using X = bf16_t;  // x as it lies: the pair broadcast reads it directly

    template <int MR>
    static void tile(const bf16_t *x, int64_t xs, const bf16_t *w, int64_t K, float *acc) {
        static_assert(MR >= 1 && MR <= kMaxRows, "tile rows");
#define CPUINFER_DECL(i) __m512 c##i##a = _mm512_setzero_ps(), c##i##b = _mm512_setzero_ps();
        CPUINFER_PANEL_ROWS(CPUINFER_DECL)
#undef CPUINFER_DECL
        const int64_t pairs = K / 2;
        for (int64_t p = 0; p < pairs; ++p) {
            const bf16_t *wp = w + p * 64;
            // Few rows (decode) stream the weight from memory: fetch ahead
            // as in the GEMV. With many rows the panel is already in cache.
            if constexpr (MR <= 4) {
                __builtin_prefetch(reinterpret_cast<const char *>(wp) + 2048);
                __builtin_prefetch(reinterpret_cast<const char *>(wp) + 2048 + 64);
            }
            __m512bh b0 = as_bh(_mm512_loadu_si512(wp)), b1 = as_bh(_mm512_loadu_si512(wp + 32));
#define CPUINFER_ROW(i)                                                       \
    if constexpr (i < MR) {                                                   \
        int32_t xp;                                                           \
        std::memcpy(&xp, x + i * xs + 2 * p, 4);                              \
        __m512bh a = as_bh(_mm512_set1_epi32(xp));                            \
        c##i##a = _mm512_dpbf16_ps(c##i##a, a, b0);                           \
        c##i##b = _mm512_dpbf16_ps(c##i##b, a, b1);                           \
    }
            CPUINFER_PANEL_ROWS(CPUINFER_ROW)
#undef CPUINFER_ROW
        }
#define CPUINFER_STORE(i)                           \
    if constexpr (i < MR) {                         \
        _mm512_storeu_ps(acc + i * 32, c##i##a);    \
        _mm512_storeu_ps(acc + i * 32 + 16, c##i##b); \
    }
        CPUINFER_PANEL_ROWS(CPUINFER_STORE)
#undef CPUINFER_STORE
    }

    // 12 independent VDPBF16PS chains (32 multiply-adds each per step).
    static int64_t peak(int64_t iters, float *sink) {
        const __m512bh a = as_bh(_mm512_set1_epi16(0x3000));  // bf16 ~4.7e-10
#define CPUINFER_DECL(i) __m512 c##i = _mm512_setzero_ps(); const __m512bh b##i = as_bh(_mm512_set1_epi16(0x3f80 + i));
        CPUINFER_PANEL_ROWS(CPUINFER_DECL)
#undef CPUINFER_DECL
        for (int64_t it = 0; it < iters; ++it) {
#define CPUINFER_STEP(i) c##i = _mm512_dpbf16_ps(c##i, a, b##i);
            CPUINFER_PANEL_ROWS(CPUINFER_STEP)
#undef CPUINFER_STEP
        }
        __m512 s = _mm512_setzero_ps();
#define CPUINFER_SUM(i) s = _mm512_add_ps(s, c##i);
        CPUINFER_PANEL_ROWS(CPUINFER_SUM)
#undef CPUINFER_SUM
        *sink = _mm512_reduce_add_ps(s);
        return 12 * iters * 32;
    }
};

}  // namespace cpuinfer::panel

#endif
