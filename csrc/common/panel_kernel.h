// The register tile of the packed linear layer (linear_packed.cpp): MR rows
// of x against one panel of the packed weight, over all of K.
//
// A panel is kCols = 2 * vec::width() consecutive output features stored
// k-major: for each group of kPair consecutive k, the kCols columns one after
// the other, each column's kPair elements adjacent. The tile keeps MR x 2
// vectors of f32 accumulators in registers, lanes along the output features,
// so no horizontal sum is ever needed; each output element is one chain of
// multiply-adds in k order, whatever MR is, which makes a row's result
// independent of the batch it is computed in.
//
// PanelKernel<T> is the portable tile, written against vec.h (elements
// widened to f32, then FMA; kPair = 1). An ISA folder may specialise it for a
// type with a faster tile (csrc/x86/panel_kernel_x86.h: bf16 pairs through
// VDPBF16PS, kPair = 2); the layout follows the specialisation's kPair.
// Accumulators are named variables, not arrays: SVE vectors are sizeless.
#pragma once
#include <cstdint>

#include "dtype.h"
#include "vec.h"

namespace cpuinfer::panel {

// Rows per tile: 2 * MR accumulators plus 2 weight vectors and one broadcast
// must fit the register file (16 on AVX2, and NEON spends two per vf).
#if defined(CPUINFER_VEC_AVX2) || defined(CPUINFER_VEC_NEON) || defined(CPUINFER_VEC_SCALAR)
constexpr int kMaxRows = 6;
#else
constexpr int kMaxRows = 12;
#endif

#define CPUINFER_PANEL_ROWS(OP) OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7) OP(8) OP(9) OP(10) OP(11)

template <typename T>
struct PanelKernel {
    static constexpr int kPair = 1;
    static constexpr const char *kName = "fma";
    // The tile's x: rows widened to f32 once per row chunk by the caller
    // (a scalar f16 -> f32 per row and k would cost more than the FMAs).
    using X = float;

    // acc[r * 2W + j] = sum_k x[r * xs + k] * panel(k, j), r < MR, j < 2W.
    template <int MR>
    static void tile(const X *x, int64_t xs, const T *w, int64_t K, float *acc) {
        static_assert(MR >= 1 && MR <= kMaxRows, "tile rows");
        using namespace vec;
        const int W = width();
#define CPUINFER_DECL(i) vf c##i##a = zero(), c##i##b = zero();
        CPUINFER_PANEL_ROWS(CPUINFER_DECL)
#undef CPUINFER_DECL
        for (int64_t k = 0; k < K; ++k) {
            const T *wk = w + k * 2 * W;
            vf b0 = in_register(load(wk)), b1 = in_register(load(wk + W));
#define CPUINFER_ROW(i)                                   \
    if constexpr (i < MR) {                               \
        vf a = splat(x[i * xs + k]);                        \
        c##i##a = fma(a, b0, c##i##a);                    \
        c##i##b = fma(a, b1, c##i##b);                    \
    }
            CPUINFER_PANEL_ROWS(CPUINFER_ROW)
#undef CPUINFER_ROW
        }
#define CPUINFER_STORE(i)                          \
    if constexpr (i < MR) {                        \
        store(acc + i * 2 * W, c##i##a);           \
        store(acc + i * 2 * W + W, c##i##b);       \
    }
        CPUINFER_PANEL_ROWS(CPUINFER_STORE)
#undef CPUINFER_STORE
    }

    // The tile's instruction at its best: 12 independent chains in registers,
    // `iters` times each. Returns the multiply-adds done (for the peak).
    static int64_t peak(int64_t iters, float *sink) {
        using namespace vec;
        vf a = splat(1e-9f);
#define CPUINFER_DECL(i) vf c##i = zero(), b##i = splat(1.0f + 0.125f * i);
        CPUINFER_PANEL_ROWS(CPUINFER_DECL)
#undef CPUINFER_DECL
        for (int64_t it = 0; it < iters; ++it) {
#define CPUINFER_STEP(i) c##i = fma(a, b##i, c##i);
            CPUINFER_PANEL_ROWS(CPUINFER_STEP)
#undef CPUINFER_STEP
        }
        vf s = zero();
#define CPUINFER_SUM(i) s = add(s, c##i);
        CPUINFER_PANEL_ROWS(CPUINFER_SUM)
#undef CPUINFER_SUM
        *sink = reduce_add(s);
        return 12 * iters * width();
    }
};

}  // namespace cpuinfer::panel

// ISA-specific specialisations (a selector like vec.h's: nothing else in it).
#if defined(CPUINFER_VEC_AVX512)
#include "../x86/panel_kernel_x86.h"
#endif
