// The register tile of the packed linear layer (linear_packed.cpp): MR rows
// of x against one panel of the packed weight, over all of K.
//
// A panel is C = 2 * vec::width() consecutive output features stored
// k-major: for each group of kPair consecutive k, the C columns one after
// the other, each column's kPair elements adjacent. The tile keeps MR x NP x 2
// vectors of f32 accumulators in registers, lanes along the output features,
// so no horizontal sum is ever needed; each output element is one chain of
// multiply-adds in k order, whatever MR is, which makes a row's result
// independent of the batch it is computed in.
//
// PanelKernel<T> is the portable tile, written against vec.h (elements
// widened to f32, then FMA; kPair = 1). An ISA folder may specialise it for a
// type with a faster tile (csrc/x86/panel_kernel_x86.h: bf16 pairs through
// VDPBF16PS on avx512bf16, AMX-BF16 tiles on amx, f16 on AMX-FP16 where the
// CPU has it, all kPair = 2; csrc/arm/panel_kernel_arm.h: BFDOT, kPair = 2,
// and FMLAL for f16, kPair = 1); the layout follows the specialisation's kPair.
// Accumulators are named variables, not arrays: SVE vectors are sizeless.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "dispatch_dtype.h"
#include "dtype.h"
#include "vec.h"

namespace cpuinfer::panel {

// Rows per tile: 2 * MR accumulators plus 2 weight vectors and one broadcast
// must fit the register file (the vector layer's budget).
constexpr int kMaxRows = vec::kPanelRows;

// Panels per tile for MR rows. One to three rows give too few independent
// accumulator chains to hide the multiply-add latency, so they take 4 or 2
// adjacent panels at once; each output element still sees the same chain in
// k order. Measured, AVX2, M = 1, 1 thread, against the row-major GEMV: one
// panel with plain loads ~0.65x; 4 panels through load2a/load2b with the
// weight vectors not pinned (below) 1.3-1.5x.
constexpr int panels_for_rows(int mr) { return mr == 1 ? 4 : mr <= 3 ? 2 : 1; }

// Accumulator slots: slot s is row s / NP, panel s % NP (at most 12 slots).
#define CPUINFER_PANEL_SLOTS(OP) OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7) OP(8) OP(9) OP(10) OP(11)

// The q-th of four values (named variables, since SVE vectors cannot be array elements).
template <int Q, typename V>
inline V pick(V a, V b, V c, V d) {
    if constexpr (Q == 0) return a;
    else if constexpr (Q == 1) return b;
    else if constexpr (Q == 2) return c;
    else return d;
}

// Fetch ahead in a weight stream when few rows use it (decode: memory-bound).
inline void prefetch_stream(const void *p, int64_t bytes) {
    const char *c = static_cast<const char *>(p) + 2048;
    for (int64_t off = 0; off < bytes; off += tuning::kCacheLine) __builtin_prefetch(c + off);
}

// What the driver (linear_packed.cpp) needs of a kernel besides its layout
// (kPair, X, kPairOrder): for register tiles, rows and panels are template
// arguments of Derived::tile, dispatched here from the runtime counts.
template <typename Derived>
struct RegisterTiles {
    static constexpr int kMaxRows = panel::kMaxRows;  // rows per call of run()
    static constexpr int kRowPad = 1;                  // x copies padded to a multiple of this many rows
    static constexpr bool kCopyX = false;              // read x through a copy even when X is T
    static constexpr int64_t kChunkBytes = 192 * 1024; // x bytes per row chunk: half of a 1-2 MB L2 with the panel
    static constexpr int panels(int mr) { return panels_for_rows(mr); }
    static void begin() {}  // per thread, before a run of calls (tile registers, ...)
    static void end() {}

    // Copies rows [0, rows) of x (row stride xs) into dst as run() reads them,
    // zero rows up to `padded`, and returns the x stride to pass to run():
    // here row-major, each row widened to X, rows ds elements apart.
    template <typename X, typename T>
    static int64_t pack_x(X *dst, int64_t ds, const T *x, int64_t xs, int64_t rows, int64_t padded, int64_t K) {
        if (padded > rows) std::memset(dst + rows * ds, 0, size_t((padded - rows) * ds) * sizeof(X));
        for (int64_t r = 0; r < rows; ++r) {
            const T *src = x + r * xs;
            X *d = dst + r * ds;
            if constexpr (std::is_same_v<X, T>) {
                std::memcpy(d, src, size_t(K) * sizeof(T));
            } else {
                const int W = vec::width();
                int64_t k = 0;
                for (; k + W <= K; k += W) vec::store(d + k, vec::load(src + k));
                for (; k < K; ++k) d[k] = to_f32(src[k]);
            }
        }
        return ds;
    }

    // Derived::tile<mr, np>, for mr <= Derived::kMaxRows and np <= Derived::panels(mr).
    template <typename X, typename T>
    static void run(int mr, int np, const X *x, int64_t xs, const T *w, int64_t ps, int64_t K, float *acc) {
        switch (mr) {
#define CPUINFER_CASE(i)                                                                                  \
    case i + 1:                                                                                           \
        if constexpr (i < Derived::kMaxRows) {                                                            \
            constexpr int kNP = Derived::panels(i + 1);                                                   \
            if (kNP >= 4 && np == 4) Derived::template tile<i + 1, (kNP >= 4 ? 4 : 1)>(x, xs, w, ps, K, acc); \
            else if (kNP >= 2 && np >= 2) Derived::template tile<i + 1, (kNP >= 2 ? 2 : 1)>(x, xs, w, ps, K, acc); \
            else Derived::template tile<i + 1, 1>(x, xs, w, ps, K, acc);                                  \
        }                                                                                                 \
        break;
            CPUINFER_PANEL_SLOTS(CPUINFER_CASE)
#undef CPUINFER_CASE
            default: break;
        }
    }
};

template <typename T>
struct PanelKernel : RegisterTiles<PanelKernel<T>> {
    static constexpr int kPair = 1;
    static constexpr const char *kName = "fma";
    // The tile's x: rows widened to f32 once per row chunk by the caller
    // (a scalar f16 -> f32 per row and k would cost more than the FMAs).
    using X = float;
    // Weights are read through load2a/load2b (x86 splits bf16 into even and
    // odd columns with one shift or mask per 2W elements, half the widening
    // work of two plain loads), so accumulators hold the columns in that lane
    // order; the caller stores them through store2, which puts them back.
    static constexpr bool kPairOrder = true;

    // acc[(r * NP + q) * 2W + j] = sum_k x[r * xs + k] * panel_q(k, j) for
    // r < MR, q < NP, j < 2W (j in load2a/load2b lane order if kPairOrder);
    // panel q starts at w + q * ps.
    template <int MR, int NP>
    static void tile(const X *x, int64_t xs, const T *w, int64_t ps, int64_t K, float *acc) {
        static_assert(MR >= 1 && MR <= kMaxRows && NP >= 1 && NP <= 4 && MR * NP <= 12, "tile shape");
        using namespace vec;
        const int W = width();
        const int64_t step = 2 * int64_t(W);  // elements of one k in a panel
        // Prefetch: a cache line per line consumed, when the weight comes from memory.
        const int64_t every = std::max<int64_t>(1, tuning::kCacheLine / int64_t(step * sizeof(T)));
        const T *w0 = w, *w1 = w + (NP > 1 ? ps : 0), *w2 = w + (NP > 2 ? 2 * ps : 0), *w3 = w + (NP > 3 ? 3 * ps : 0);
#define CPUINFER_DECL(s) vf c##s##a = zero(), c##s##b = zero();
        CPUINFER_PANEL_SLOTS(CPUINFER_DECL)
#undef CPUINFER_DECL
        for (int64_t k = 0; k < K; ++k) {
            const int64_t o = k * step;
            if (MR <= 4 && k % every == 0) {
                prefetch_stream(w0 + o, step * int64_t(sizeof(T)));
                if constexpr (NP > 1) prefetch_stream(w1 + o, step * int64_t(sizeof(T)));
                if constexpr (NP > 2) prefetch_stream(w2 + o, step * int64_t(sizeof(T)));
                if constexpr (NP > 3) prefetch_stream(w3 + o, step * int64_t(sizeof(T)));
            }
            // A weight vector used by several rows is loaded once into a
            // register; with one row, pinning all 2 * NP of them would spill
            // an accumulator on AVX2 (measured: M = 1 at half speed).
            auto pin = [](vf v) { return MR > 1 ? in_register(v) : v; };
            vf b0a = pin(load2a(w0 + o)), b0b = pin(load2b(w0 + o));
            vf b1a = b0a, b1b = b0b, b2a = b0a, b2b = b0b, b3a = b0a, b3b = b0b;
            if constexpr (NP > 1) b1a = pin(load2a(w1 + o)), b1b = pin(load2b(w1 + o));
            if constexpr (NP > 2) b2a = pin(load2a(w2 + o)), b2b = pin(load2b(w2 + o));
            if constexpr (NP > 3) b3a = pin(load2a(w3 + o)), b3b = pin(load2b(w3 + o));
#define CPUINFER_SLOT(s)                                                              \
    if constexpr (s < MR * NP) {                                                      \
        constexpr int r = s / NP, q = s % NP;                                         \
        vf a = splat(x[r * xs + k]);                                                  \
        c##s##a = fma(a, pick<q>(b0a, b1a, b2a, b3a), c##s##a);                       \
        c##s##b = fma(a, pick<q>(b0b, b1b, b2b, b3b), c##s##b);                       \
    }
            CPUINFER_PANEL_SLOTS(CPUINFER_SLOT)
#undef CPUINFER_SLOT
        }
#define CPUINFER_STORE(s)                          \
    if constexpr (s < MR * NP) {                   \
        store(acc + s * step, c##s##a);            \
        store(acc + s * step + W, c##s##b);        \
    }
        CPUINFER_PANEL_SLOTS(CPUINFER_STORE)
#undef CPUINFER_STORE
    }

    // The tile's instruction at its best: 12 independent chains in registers,
    // `iters` times each. Returns the multiply-adds done (for the peak).
    static int64_t peak(int64_t iters, float *sink) {
        using namespace vec;
        vf a = splat(1e-9f);
#define CPUINFER_DECL(i) vf c##i = zero(), b##i = splat(1.0f + 0.125f * i);
        CPUINFER_PANEL_SLOTS(CPUINFER_DECL)
#undef CPUINFER_DECL
        for (int64_t it = 0; it < iters; ++it) {
#define CPUINFER_STEP(i) c##i = fma(a, b##i, c##i);
            CPUINFER_PANEL_SLOTS(CPUINFER_STEP)
#undef CPUINFER_STEP
        }
        vf s = zero();
#define CPUINFER_SUM(i) s = add(s, c##i);
        CPUINFER_PANEL_SLOTS(CPUINFER_SUM)
#undef CPUINFER_SUM
        *sink = reduce_add(s);
        return 12 * iters * width();
    }
};

// The tile T runs on this CPU: PanelKernel<T>, unless the vector layer's hooks
// choose between two at run time (amx: f16 on AMX-FP16 tiles where the CPU has
// them). with(f) calls f with a null pointer of the kernel's type; the packed
// layout (kPair) follows the choice, so pack in the process that runs.
template <typename T>
struct KernelChoice {
    template <typename F>
    static void with(F &&f) {
        f(static_cast<PanelKernel<T> *>(nullptr));
    }
};

// f(kernel) for dt's element type, kernel a null pointer of the tile this CPU runs for it.
template <typename F>
void with_kernel(DType dt, F &&f) {
    with_float_type(dt, [&](auto tag) { KernelChoice<decltype(tag)>::with(f); });
}

}  // namespace cpuinfer::panel

// The vector layer's specialisations, if it has any (cmake/isa_table.json).
#if defined(CPUINFER_PANEL_HOOKS)
#include CPUINFER_PANEL_HOOKS
#endif
