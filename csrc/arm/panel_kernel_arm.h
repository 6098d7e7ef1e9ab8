// Arm specialisation of the packed linear tile (see common/panel_kernel.h).
//
// neon_bf16 / apple_m2 (FEAT_BF16): bf16 weights are packed in pairs of k
// (kPair = 2, the layout of the x86 VDPBF16PS tile): a q register holds 4
// output features x 2 consecutive k, a panel's 16 columns four registers.
// BFDOT by element (vbfdotq_laneq_f32) takes its x operand from one of the
// four k-pairs a 128-bit load of an x row holds, so x is read as it lies,
// one load per row every 4 pairs, with no broadcast and no packing. Each
// instruction does 8 multiply-adds (the portable tile's FMLA does 4, after
// widening the weights).
//
// Numerics: BFDOT ignores FPCR; the two products, their sum and the add to
// the accumulator are rounded to odd, and denormal inputs and results are
// flushed to zero (Arm ARM BFDotAdd, without FEAT_EBF16). Every output
// element is one chain of BFDOTs in k order whatever the row count, so a
// row's result does not depend on its batch; its bits differ from the other
// variants' within the tests' bf16 tolerance. BFMMLA (2 rows x 2 columns x 4
// k per instruction) is specified as two such BFDOT steps in the same order,
// so a BFMMLA tile would give these bits too; untried, with no Arm hardware
// to measure it on. The C++ tests run this tile under qemu-aarch64.
#pragma once
#include <arm_neon.h>

#include <cstring>

#include "../common/vec.h"

#if defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)

namespace cpuinfer::panel {

// The R-th of six values (x rows of a tile).
template <int R, typename V>
inline V pick_row(V a0, V a1, V a2, V a3, V a4, V a5) {
    if constexpr (R < 4) return pick<R>(a0, a1, a2, a3);
    else if constexpr (R == 4) return a4;
    else return a5;
}

struct BfDotTiles : RegisterTiles<BfDotTiles> {
    static constexpr int kPair = 2;
    static constexpr const char *kName = "bfdot";
    using X = bf16_t;                          // x as it lies: BFDOT by element picks each pair from a load
    static constexpr bool kPairOrder = false;  // accumulators in natural column order

    static bfloat16x8_t load8(const bf16_t *p) { return vld1q_bf16(reinterpret_cast<const bfloat16_t *>(p)); }
    // One k-pair of x in every 32-bit lane (lane 0 is the one read).
    static bfloat16x8_t load_pair(const bf16_t *p) {
        uint32_t v;
        std::memcpy(&v, p, 4);
        return vreinterpretq_bf16_u32(vdupq_n_u32(v));
    }

    template <int MR, int NP>
    static void tile(const bf16_t *x, int64_t xs, const bf16_t *w, int64_t ps, int64_t K, float *acc) {
        static_assert(MR >= 1 && MR <= kMaxRows && NP >= 1 && NP <= 4 && MR * NP <= 12, "tile shape");
        static_assert(kMaxRows <= 6, "pick_row takes six rows");
        const bf16_t *w0 = w, *w1 = w + (NP > 1 ? ps : 0), *w2 = w + (NP > 2 ? 2 * ps : 0), *w3 = w + (NP > 3 ? 3 * ps : 0);
        const bf16_t *x0 = x, *x1 = x + (MR > 1 ? xs : 0), *x2 = x + (MR > 2 ? 2 * xs : 0),
                     *x3 = x + (MR > 3 ? 3 * xs : 0), *x4 = x + (MR > 4 ? 4 * xs : 0), *x5 = x + (MR > 5 ? 5 * xs : 0);
        // Slot s (row s / NP, panel s % NP): four accumulators, columns 4g..4g+3 in c<s><g>.
#define CPUINFER_DECL(s) float32x4_t c##s##0 = vdupq_n_f32(0.f), c##s##1 = c##s##0, c##s##2 = c##s##0, c##s##3 = c##s##0;
        CPUINFER_PANEL_SLOTS(CPUINFER_DECL)
#undef CPUINFER_DECL
        // One k-pair (element offset O into the panels: 16 columns x 2), x's pair in lane L of a0..a5.
#define CPUINFER_SLOT(s, L)                                                            \
    if constexpr (s < MR * NP) {                                                       \
        constexpr int r = s / NP, q = s % NP;                                          \
        const bfloat16x8_t a = pick_row<r>(a0, a1, a2, a3, a4, a5);                    \
        c##s##0 = vbfdotq_laneq_f32(c##s##0, pick<q>(b00, b10, b20, b30), a, L);       \
        c##s##1 = vbfdotq_laneq_f32(c##s##1, pick<q>(b01, b11, b21, b31), a, L);       \
        c##s##2 = vbfdotq_laneq_f32(c##s##2, pick<q>(b02, b12, b22, b32), a, L);       \
        c##s##3 = vbfdotq_laneq_f32(c##s##3, pick<q>(b03, b13, b23, b33), a, L);       \
    }
#define CPUINFER_PAIR(O, L)                                                                                    \
    do {                                                                                                       \
        bfloat16x8_t b00 = load8(w0 + (O)), b01 = load8(w0 + (O) + 8), b02 = load8(w0 + (O) + 16),             \
                     b03 = load8(w0 + (O) + 24);                                                               \
        bfloat16x8_t b10 = b00, b11 = b01, b12 = b02, b13 = b03, b20 = b00, b21 = b01, b22 = b02, b23 = b03;   \
        bfloat16x8_t b30 = b00, b31 = b01, b32 = b02, b33 = b03;                                               \
        if constexpr (NP > 1)                                                                                  \
            b10 = load8(w1 + (O)), b11 = load8(w1 + (O) + 8), b12 = load8(w1 + (O) + 16), b13 = load8(w1 + (O) + 24); \
        if constexpr (NP > 2)                                                                                  \
            b20 = load8(w2 + (O)), b21 = load8(w2 + (O) + 8), b22 = load8(w2 + (O) + 16), b23 = load8(w2 + (O) + 24); \
        if constexpr (NP > 3)                                                                                  \
            b30 = load8(w3 + (O)), b31 = load8(w3 + (O) + 8), b32 = load8(w3 + (O) + 16), b33 = load8(w3 + (O) + 24); \
        CPUINFER_SLOT(0, L) CPUINFER_SLOT(1, L) CPUINFER_SLOT(2, L) CPUINFER_SLOT(3, L)                        \
        CPUINFER_SLOT(4, L) CPUINFER_SLOT(5, L) CPUINFER_SLOT(6, L) CPUINFER_SLOT(7, L)                        \
        CPUINFER_SLOT(8, L) CPUINFER_SLOT(9, L) CPUINFER_SLOT(10, L) CPUINFER_SLOT(11, L)                      \
    } while (0)
        const int64_t pairs = K / 2;
        int64_t p = 0;
        // Four pairs per step: each x row's 8 elements in one register.
        for (; p + 4 <= pairs; p += 4) {
            const int64_t o = p * 32;  // 4 pairs x 16 columns x 2 = 256 bytes of each panel
            // Few rows (decode) stream the weight from memory: fetch ahead as the GEMV does.
            if constexpr (MR <= 4) {
                prefetch_stream(w0 + o, 256);
                if constexpr (NP > 1) prefetch_stream(w1 + o, 256);
                if constexpr (NP > 2) prefetch_stream(w2 + o, 256);
                if constexpr (NP > 3) prefetch_stream(w3 + o, 256);
            }
            bfloat16x8_t a0 = load8(x0 + 2 * p), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
            if constexpr (MR > 1) a1 = load8(x1 + 2 * p);
            if constexpr (MR > 2) a2 = load8(x2 + 2 * p);
            if constexpr (MR > 3) a3 = load8(x3 + 2 * p);
            if constexpr (MR > 4) a4 = load8(x4 + 2 * p);
            if constexpr (MR > 5) a5 = load8(x5 + 2 * p);
            CPUINFER_PAIR(o, 0);
            CPUINFER_PAIR(o + 32, 1);
            CPUINFER_PAIR(o + 64, 2);
            CPUINFER_PAIR(o + 96, 3);
        }
        // The last pairs one at a time, in the same order.
        for (; p < pairs; ++p) {
            bfloat16x8_t a0 = load_pair(x0 + 2 * p), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
            if constexpr (MR > 1) a1 = load_pair(x1 + 2 * p);
            if constexpr (MR > 2) a2 = load_pair(x2 + 2 * p);
            if constexpr (MR > 3) a3 = load_pair(x3 + 2 * p);
            if constexpr (MR > 4) a4 = load_pair(x4 + 2 * p);
            if constexpr (MR > 5) a5 = load_pair(x5 + 2 * p);
            CPUINFER_PAIR(p * 32, 0);
        }
#undef CPUINFER_PAIR
#undef CPUINFER_SLOT
#define CPUINFER_STORE(s)                            \
    if constexpr (s < MR * NP) {                     \
        vst1q_f32(acc + s * 16, c##s##0);            \
        vst1q_f32(acc + s * 16 + 4, c##s##1);        \
        vst1q_f32(acc + s * 16 + 8, c##s##2);        \
        vst1q_f32(acc + s * 16 + 12, c##s##3);       \
    }
        CPUINFER_PANEL_SLOTS(CPUINFER_STORE)
#undef CPUINFER_STORE
    }

    // 24 independent BFDOT chains (8 multiply-adds each per step), four weight
    // registers among them so that everything stays in the 32 registers.
    static int64_t peak(int64_t iters, float *sink) {
        const bfloat16x8_t a = vreinterpretq_bf16_u16(vdupq_n_u16(0x3000));  // bf16 ~4.7e-10
        const bfloat16x8_t b0 = vreinterpretq_bf16_u16(vdupq_n_u16(0x3f80)), b1 = vreinterpretq_bf16_u16(vdupq_n_u16(0x3f81)),
                           b2 = vreinterpretq_bf16_u16(vdupq_n_u16(0x3f82)), b3 = vreinterpretq_bf16_u16(vdupq_n_u16(0x3f83));
#define CPUINFER_DECL(i) float32x4_t c##i##a = vdupq_n_f32(0.f), c##i##b = c##i##a;
        CPUINFER_PANEL_SLOTS(CPUINFER_DECL)
#undef CPUINFER_DECL
        for (int64_t it = 0; it < iters; ++it) {
#define CPUINFER_STEP(i)                                                  \
    c##i##a = vbfdotq_f32(c##i##a, a, pick<(i) % 4>(b0, b1, b2, b3));     \
    c##i##b = vbfdotq_f32(c##i##b, a, pick<(i + 1) % 4>(b0, b1, b2, b3));
            CPUINFER_PANEL_SLOTS(CPUINFER_STEP)
#undef CPUINFER_STEP
        }
        float32x4_t s = vdupq_n_f32(0.f);
#define CPUINFER_SUM(i) s = vaddq_f32(s, vaddq_f32(c##i##a, c##i##b));
        CPUINFER_PANEL_SLOTS(CPUINFER_SUM)
#undef CPUINFER_SUM
        *sink = vaddvq_f32(s);
        return 24 * iters * 8;
    }
};

template <>
struct PanelKernel<bf16_t> : BfDotTiles {};

}  // namespace cpuinfer::panel

#endif
