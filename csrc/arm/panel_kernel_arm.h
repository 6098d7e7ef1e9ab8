// Arm specialisations of the packed linear tile (see common/panel_kernel.h):
// multiply-adds by element, whose x operand is one lane of a 128-bit load of
// an x row, so x is read as it lies (one load per row every 8 elements, no
// broadcast, no widening copy) and the weights enter the instruction as they
// are stored. A panel is 16 columns; each output element is one chain in k
// order whatever the row count, so a row's result does not depend on its
// batch. The C++ tests run both tiles under qemu-aarch64 (GCC, and clang for
// the Apple variants); neither was timed, with no Arm hardware at hand.
//
// bf16, FEAT_BF16 (neon_bf16, apple_m2): BFDOT by element, kPair = 2 (the
// x86 VDPBF16PS layout): a q register holds 4 columns x 2 consecutive k, and
// each instruction does 8 multiply-adds (the portable tile's FMLA does 4,
// after widening the weights). BFDOT ignores FPCR: the two products, their
// sum and the add to the accumulator are rounded to odd, denormal inputs and
// results flushed to zero (Arm ARM BFDotAdd without FEAT_EBF16), so the bits
// differ from the other variants' within the tests' bf16 tolerance. BFMMLA
// (2 rows x 2 columns x 4 k) is specified as two such steps in the same
// order and would give these bits too; untried for want of hardware.
//
// f16, FEAT_FHM (neon_bf16, apple_m1, apple_m2): FMLAL/FMLAL2 by element,
// kPair = 1: f16 x f16 widened and fused into the f32 accumulator. The
// product is exact in f32, so each step is the portable tile's FMA and the
// bits are the f32 FMA chain's, as on every variant; it saves the tile's
// weight conversions and x broadcasts.
#pragma once
#include <arm_neon.h>

#include <cstring>

#include "../common/vec.h"

#if defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC) || defined(__ARM_FEATURE_FP16_FML)

namespace cpuinfer::panel {

// The R-th of six values (x rows of a tile).
template <int R, typename V>
inline V pick_row(V a0, V a1, V a2, V a3, V a4, V a5) {
    if constexpr (R < 4) return pick<R>(a0, a1, a2, a3);
    else if constexpr (R == 4) return a4;
    else return a5;
}

// One instruction family of a lane tile, as LaneTiles reads it:
//   T, kPair, kName; V (a q register of T)
//   kStepElems   panel elements per step (16 columns x kPair)
//   load_x1(p)   one step's x (kPair elements at p) in lane 0
//   mac<L>(c0..c3, w, a)   the 16 columns' accumulators += the step at w x lane L of a
//   peak(iters, sink)      independent chains of the instruction, in registers

#if defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)
struct BfDotOp {
    using T = bf16_t;
    using V = bfloat16x8_t;
    static constexpr int kPair = 2;
    static constexpr const char *kName = "bfdot";
    static constexpr int kStepElems = 32;
    static V load(const T *p) { return vld1q_bf16(reinterpret_cast<const bfloat16_t *>(p)); }
    static V load_x1(const T *p) {
        uint32_t v;
        std::memcpy(&v, p, 4);
        return vreinterpretq_bf16_u32(vdupq_n_u32(v));
    }
    template <int L>
    static void mac(float32x4_t &c0, float32x4_t &c1, float32x4_t &c2, float32x4_t &c3, const T *w, V a) {
        c0 = vbfdotq_laneq_f32(c0, load(w), a, L);
        c1 = vbfdotq_laneq_f32(c1, load(w + 8), a, L);
        c2 = vbfdotq_laneq_f32(c2, load(w + 16), a, L);
        c3 = vbfdotq_laneq_f32(c3, load(w + 24), a, L);
    }
    static V splat(uint16_t bits) { return vreinterpretq_bf16_u16(vdupq_n_u16(bits)); }
    static float32x4_t peak_step(float32x4_t c, V a, V b) { return vbfdotq_f32(c, a, b); }
    static constexpr int kPeakMadds = 8;  // per instruction
    static constexpr uint16_t kTiny = 0x3000, kOne = 0x3f80;  // bf16 ~4.7e-10, 1.0
};
#endif

#if defined(__ARM_FEATURE_FP16_FML)
struct FmlalOp {
    using T = f16_t;
    using V = float16x8_t;
    static constexpr int kPair = 1;
    static constexpr const char *kName = "fmlal";
    static constexpr int kStepElems = 16;
    static V load(const T *p) { return vreinterpretq_f16_u16(vld1q_u16(reinterpret_cast<const uint16_t *>(p))); }
    static V load_x1(const T *p) { return vreinterpretq_f16_u16(vld1q_dup_u16(reinterpret_cast<const uint16_t *>(p))); }
    // FMLAL/FMLAL2 by element encode the element's register in 4 bits (v0-v15).
    // clang before LLVM 17 ignores that for vfmlalq_laneq_*_f16 and silently
    // encodes v24 as v8 (llvm-project#64104; clang 14 here gave wrong sums), so
    // the instructions are written out with the "x" constraint (v0-v15).
    template <int L>
    static void fmlal(float32x4_t &c, V b, V a) {
        asm("fmlal %0.4s, %1.4h, %2.h[%c3]" : "+w"(c) : "w"(b), "x"(a), "i"(L));
    }
    template <int L>
    static void fmlal2(float32x4_t &c, V b, V a) {
        asm("fmlal2 %0.4s, %1.4h, %2.h[%c3]" : "+w"(c) : "w"(b), "x"(a), "i"(L));
    }
    template <int L>
    static void mac(float32x4_t &c0, float32x4_t &c1, float32x4_t &c2, float32x4_t &c3, const T *w, V a) {
        const V lo = load(w), hi = load(w + 8);
        fmlal<L>(c0, lo, a);
        fmlal2<L>(c1, lo, a);
        fmlal<L>(c2, hi, a);
        fmlal2<L>(c3, hi, a);
    }
    static V splat(uint16_t bits) { return vreinterpretq_f16_u16(vdupq_n_u16(bits)); }
    static float32x4_t peak_step(float32x4_t c, V a, V b) { return vfmlalq_low_f16(c, a, b); }
    static constexpr int kPeakMadds = 4;
    static constexpr uint16_t kTiny = 0x0400, kOne = 0x3c00;  // f16 ~6.1e-5, 1.0
};
#endif

template <typename Op>
struct LaneTiles : RegisterTiles<LaneTiles<Op>> {
    using T = typename Op::T;
    using V = typename Op::V;
    using X = T;  // x as it lies
    static constexpr int kPair = Op::kPair;
    static constexpr const char *kName = Op::kName;
    static constexpr bool kPairOrder = false;  // accumulators in natural column order
    static constexpr int kSteps = 8 / kPair;   // steps per 128-bit load of x
    // At most 16 accumulators (4 rows; 2 panels for 2 rows, 4 for one): with
    // 24 (the portable tile's 6 rows, or 3 rows x 2 panels), plus the x rows
    // and a step's weights, GCC 12 spilled in every such tile (object code).
    static constexpr int kMaxRows = 4;
    static constexpr int panels(int mr) { return mr == 1 ? 4 : mr == 2 ? 2 : 1; }

    template <int MR, int NP>
    static void tile(const T *x, int64_t xs, const T *w, int64_t ps, int64_t K, float *acc) {
        static_assert(MR >= 1 && MR <= kMaxRows && NP >= 1 && NP <= 4 && MR * NP <= 12, "tile shape");
        static_assert(kMaxRows <= 6, "pick_row takes six rows");
        constexpr int64_t S = Op::kStepElems;
        const T *w0 = w, *w1 = w + (NP > 1 ? ps : 0), *w2 = w + (NP > 2 ? 2 * ps : 0), *w3 = w + (NP > 3 ? 3 * ps : 0);
        const T *x0 = x, *x1 = x + (MR > 1 ? xs : 0), *x2 = x + (MR > 2 ? 2 * xs : 0), *x3 = x + (MR > 3 ? 3 * xs : 0),
                *x4 = x + (MR > 4 ? 4 * xs : 0), *x5 = x + (MR > 5 ? 5 * xs : 0);
        // Slot s (row s / NP, panel s % NP): columns 4g..4g+3 in c<s><g>.
#define CPUINFER_DECL(s) float32x4_t c##s##0 = vdupq_n_f32(0.f), c##s##1 = c##s##0, c##s##2 = c##s##0, c##s##3 = c##s##0;
        CPUINFER_PANEL_SLOTS(CPUINFER_DECL)
#undef CPUINFER_DECL
        // Step at panel offset O with x in lane L of a0..a5.
#define CPUINFER_SLOT(s, O, L)                                                                                      \
    if constexpr (s < MR * NP) {                                                                                    \
        constexpr int r = s / NP, q = s % NP;                                                                       \
        Op::template mac<L>(c##s##0, c##s##1, c##s##2, c##s##3, pick<q>(w0, w1, w2, w3) + (O),                      \
                            pick_row<r>(a0, a1, a2, a3, a4, a5));                                                   \
    }
#define CPUINFER_STEP(O, L)                                                                                         \
    if constexpr (L < kSteps) {                                                                                     \
        CPUINFER_SLOT(0, O, L) CPUINFER_SLOT(1, O, L) CPUINFER_SLOT(2, O, L) CPUINFER_SLOT(3, O, L)                 \
        CPUINFER_SLOT(4, O, L) CPUINFER_SLOT(5, O, L) CPUINFER_SLOT(6, O, L) CPUINFER_SLOT(7, O, L)                 \
        CPUINFER_SLOT(8, O, L) CPUINFER_SLOT(9, O, L) CPUINFER_SLOT(10, O, L) CPUINFER_SLOT(11, O, L)               \
    }
#define CPUINFER_ROWS(LOAD, k)                                                                                      \
    V a0 = LOAD(x0 + (k)), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;                                             \
    if constexpr (MR > 1) a1 = LOAD(x1 + (k));                                                                      \
    if constexpr (MR > 2) a2 = LOAD(x2 + (k));                                                                      \
    if constexpr (MR > 3) a3 = LOAD(x3 + (k));                                                                      \
    if constexpr (MR > 4) a4 = LOAD(x4 + (k));                                                                      \
    if constexpr (MR > 5) a5 = LOAD(x5 + (k));
        const int64_t steps = K / kPair;
        int64_t t = 0;
        for (; t + kSteps <= steps; t += kSteps) {
            const int64_t o = t * S;  // 8 k x 16 columns: 256 bytes of each panel
            // Decode streams the weight from memory: fetch ahead as the GEMV
            // does. With at most 4 rows per tile, prefill tiles fetch too: a
            // hint per cache line of a panel already in cache (not timed on Arm).
            prefetch_stream(w0 + o, 256);
            if constexpr (NP > 1) prefetch_stream(w1 + o, 256);
            if constexpr (NP > 2) prefetch_stream(w2 + o, 256);
            if constexpr (NP > 3) prefetch_stream(w3 + o, 256);
            CPUINFER_ROWS(Op::load, t * kPair)
            CPUINFER_STEP(o, 0)
            CPUINFER_STEP(o + S, 1)
            CPUINFER_STEP(o + 2 * S, 2)
            CPUINFER_STEP(o + 3 * S, 3)
            CPUINFER_STEP(o + 4 * S, 4)
            CPUINFER_STEP(o + 5 * S, 5)
            CPUINFER_STEP(o + 6 * S, 6)
            CPUINFER_STEP(o + 7 * S, 7)
        }
        // The last steps one at a time, in the same order.
        for (; t < steps; ++t) {
            CPUINFER_ROWS(Op::load_x1, t * kPair)
            CPUINFER_STEP(t * S, 0)
        }
#undef CPUINFER_ROWS
#undef CPUINFER_STEP
#undef CPUINFER_SLOT
#define CPUINFER_STORE(s)                      \
    if constexpr (s < MR * NP) {               \
        vst1q_f32(acc + s * 16, c##s##0);      \
        vst1q_f32(acc + s * 16 + 4, c##s##1);  \
        vst1q_f32(acc + s * 16 + 8, c##s##2);  \
        vst1q_f32(acc + s * 16 + 12, c##s##3); \
    }
        CPUINFER_PANEL_SLOTS(CPUINFER_STORE)
#undef CPUINFER_STORE
    }

    // 24 independent chains of the instruction, four weight registers among
    // them so that everything stays in the 32 registers.
    static int64_t peak(int64_t iters, float *sink) {
        const V a = Op::splat(Op::kTiny), b0 = Op::splat(Op::kOne), b1 = Op::splat(Op::kOne + 1),
                b2 = Op::splat(Op::kOne + 2), b3 = Op::splat(Op::kOne + 3);
#define CPUINFER_DECL(i) float32x4_t c##i##a = vdupq_n_f32(0.f), c##i##b = c##i##a;
        CPUINFER_PANEL_SLOTS(CPUINFER_DECL)
#undef CPUINFER_DECL
        for (int64_t it = 0; it < iters; ++it) {
#define CPUINFER_STEP(i)                                                         \
    c##i##a = Op::peak_step(c##i##a, a, pick<(i) % 4>(b0, b1, b2, b3));          \
    c##i##b = Op::peak_step(c##i##b, a, pick<((i) + 1) % 4>(b0, b1, b2, b3));
            CPUINFER_PANEL_SLOTS(CPUINFER_STEP)
#undef CPUINFER_STEP
        }
        float32x4_t s = vdupq_n_f32(0.f);
#define CPUINFER_SUM(i) s = vaddq_f32(s, vaddq_f32(c##i##a, c##i##b));
        CPUINFER_PANEL_SLOTS(CPUINFER_SUM)
#undef CPUINFER_SUM
        *sink = vaddvq_f32(s);
        return 24 * iters * Op::kPeakMadds;
    }
};

#if defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)
template <>
struct PanelKernel<bf16_t> : LaneTiles<BfDotOp> {};
#endif
#if defined(__ARM_FEATURE_FP16_FML)
template <>
struct PanelKernel<f16_t> : LaneTiles<FmlalOp> {};
#endif

}  // namespace cpuinfer::panel

#endif
