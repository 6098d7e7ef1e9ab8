// Linear layer on a row-major weight, tuned for decode (small M, a GEMV):
// out = x · Wᵀ (+ bias). Packed weights take linear_packed.cpp; linear()
// below chooses.
//
// Decode multiplies a handful of activation rows by a large weight, so the
// cost is reading W once. Each task owns a block of output features; per
// tile it streams kNR weight rows through the vector unit once and FMAs them
// against up to kMR rows of x, keeping kNR * kMR f32 accumulators in
// registers. With more than kMR rows of x the same weight tile is reused from
// L1 for the next group. Accumulation is f32; the result is rounded once.
// Large M works too (prefill), chunked over rows; it is compute-bound there.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "dispatch_dtype.h"
#include "kernels.h"
#include "linear_packed.h"
#include "parallel.h"
#include "vec.h"

namespace cpuinfer {
namespace {

#ifndef CPUINFER_LINEAR_PREFETCH
#define CPUINFER_LINEAR_PREFETCH 1
#endif

constexpr int kNR = 4;  // weight rows per tile
constexpr int kMR = 4;  // x rows per tile (4 x 4 accumulators fill AVX2's 16 registers with some spill)

// c_j += a * b_j for j < NR.
template <int NR>
inline void mac(vec::vf a, vec::vf b0, vec::vf b1, vec::vf b2, vec::vf b3, vec::vf &c0, vec::vf &c1, vec::vf &c2,
                vec::vf &c3) {
    c0 = vec::fma(a, b0, c0);
    if constexpr (NR > 1) c1 = vec::fma(a, b1, c1);
    if constexpr (NR > 2) c2 = vec::fma(a, b2, c2);
    if constexpr (NR > 3) c3 = vec::fma(a, b3, c3);
}

// acc[m * NR + j] = dot(x row m, W row j) over K, for m < MR, j < NR.
// Accumulators are named variables, not arrays: SVE vectors are sizeless.
template <typename T, int NR, int MR>
inline void tile(const T *x, int64_t xs, const T *w, int64_t K, float *acc) {
    using namespace vec;
    const int W = width();
    const T *w0 = w, *w1 = w + (NR > 1 ? K : 0), *w2 = w + (NR > 2 ? 2 * K : 0), *w3 = w + (NR > 3 ? 3 * K : 0);
    const T *x0 = x, *x1 = x + (MR > 1 ? xs : 0), *x2 = x + (MR > 2 ? 2 * xs : 0), *x3 = x + (MR > 3 ? 3 * xs : 0);
    vf c00 = zero(), c01 = zero(), c02 = zero(), c03 = zero();
    vf c10 = zero(), c11 = zero(), c12 = zero(), c13 = zero();
    vf c20 = zero(), c21 = zero(), c22 = zero(), c23 = zero();
    vf c30 = zero(), c31 = zero(), c32 = zero(), c33 = zero();
    // One step: for every (x row m, weight row j), c_mj += LD(x_m + k) * LD(w_j + k).
#define CPUINFER_TILE_STEP(LD)                                                                  \
    do {                                                                                        \
        vf b0 = LD(w0 + k), b1 = b0, b2 = b0, b3 = b0;                                          \
        if constexpr (NR > 1) b1 = LD(w1 + k);                                                  \
        if constexpr (NR > 2) b2 = LD(w2 + k);                                                  \
        if constexpr (NR > 3) b3 = LD(w3 + k);                                                  \
        mac<NR>(LD(x0 + k), b0, b1, b2, b3, c00, c01, c02, c03);                                \
        if constexpr (MR > 1) mac<NR>(LD(x1 + k), b0, b1, b2, b3, c10, c11, c12, c13);          \
        if constexpr (MR > 2) mac<NR>(LD(x2 + k), b0, b1, b2, b3, c20, c21, c22, c23);          \
        if constexpr (MR > 3) mac<NR>(LD(x3 + k), b0, b1, b2, b3, c30, c31, c32, c33);          \
    } while (0)
    int64_t k = 0;
    // 2W elements of K per step through load2a/b (bf16 on x86 splits into
    // even/odd lanes with no shuffle; a dot product does not care about lane
    // order), one half at a time so that MR = 4 fits the registers. Every MR
    // accumulates in the same order, so a row's result does not depend on
    // how many rows are computed together.
    for (; k + 2 * W <= K; k += 2 * W) {
        // The weight streams from memory and each task walks its rows in
        // order: fetch ahead, one cache line per line consumed: the rows two
        // tiles ahead (adjacent in memory); measured on 2 cores, decode
        // projections from ~13 to ~17 GB/s.
        if (CPUINFER_LINEAR_PREFETCH && (k * int64_t(sizeof(T))) % tuning::kCacheLine == 0) {
            const T *next = w0 + 2 * NR * K + k;
            for (int j = 0; j < NR; ++j) __builtin_prefetch(next + j * K);
        }
        CPUINFER_TILE_STEP(load2a);
        CPUINFER_TILE_STEP(load2b);
    }
    for (; k + W <= K; k += W) CPUINFER_TILE_STEP(load);
#undef CPUINFER_TILE_STEP
    acc[0] = reduce_add(c00);
    if constexpr (NR > 1) acc[1] = reduce_add(c01);
    if constexpr (NR > 2) acc[2] = reduce_add(c02);
    if constexpr (NR > 3) acc[3] = reduce_add(c03);
    if constexpr (MR > 1) {
        acc[NR + 0] = reduce_add(c10);
        if constexpr (NR > 1) acc[NR + 1] = reduce_add(c11);
        if constexpr (NR > 2) acc[NR + 2] = reduce_add(c12);
        if constexpr (NR > 3) acc[NR + 3] = reduce_add(c13);
    }
    if constexpr (MR > 2) {
        acc[2 * NR + 0] = reduce_add(c20);
        if constexpr (NR > 1) acc[2 * NR + 1] = reduce_add(c21);
        if constexpr (NR > 2) acc[2 * NR + 2] = reduce_add(c22);
        if constexpr (NR > 3) acc[2 * NR + 3] = reduce_add(c23);
    }
    if constexpr (MR > 3) {
        acc[3 * NR + 0] = reduce_add(c30);
        if constexpr (NR > 1) acc[3 * NR + 1] = reduce_add(c31);
        if constexpr (NR > 2) acc[3 * NR + 2] = reduce_add(c32);
        if constexpr (NR > 3) acc[3 * NR + 3] = reduce_add(c33);
    }
    // K tail, scalar. An explicit fma: left to -ffp-contract, whether the
    // multiply and add fuse depended on MR (how GCC vectorised each tile), so
    // a row's f32 result depended on its batch.
    for (; k < K; ++k) {
        for (int m = 0; m < MR; ++m) {
            float xv = to_f32(x[m * xs + k]);
            for (int j = 0; j < NR; ++j) acc[m * NR + j] = std::fma(xv, to_f32(w[j * K + k]), acc[m * NR + j]);
        }
    }
}

// Output features [n0, n0 + NR) for every row of x.
template <typename T, int NR, typename O>
inline void rows_block(O *out, int64_t os, const T *x, int64_t xs, const T *w, const T *bias, int64_t M,
                       int64_t K, int64_t n0) {
    float acc[kMR * NR];
    const T *wn = w + n0 * K;
    for (int64_t m0 = 0; m0 < M; m0 += kMR) {
        const T *xm = x + m0 * xs;
        int64_t mr = std::min<int64_t>(kMR, M - m0);
        switch (mr) {
            case 1: tile<T, NR, 1>(xm, xs, wn, K, acc); break;
            case 2: tile<T, NR, 2>(xm, xs, wn, K, acc); break;
            case 3: tile<T, NR, 3>(xm, xs, wn, K, acc); break;
            default: tile<T, NR, 4>(xm, xs, wn, K, acc); break;
        }
        for (int64_t m = 0; m < mr; ++m) {
            O *o = out + (m0 + m) * os + n0;
            for (int j = 0; j < NR; ++j) {
                float v = acc[m * NR + j];
                if (bias) v += to_f32(bias[n0 + j]);
                o[j] = from_f32<O>(v);
            }
        }
    }
}

// O: the output's type, T or float (unrounded sums, linear()'s out_f32).
template <typename T, typename O>
void run(O *out, int64_t os, const T *x, int64_t xs, const T *w, const T *bias, int64_t M, int64_t N, int64_t K) {
    const int64_t blocks = N / kNR;
    // Each task gets at least ~64K multiply-adds (~128 KB of bf16 weight,
    // ~10 us from memory): waking the team costs a few microseconds on an
    // idle machine, and a decode step is a chain of ~100 such projections
    // that must each use every core to use the memory bandwidth of all of
    // them. (On oversubscribed cores each hand-off costs a scheduler slice
    // instead; give the engine dedicated cores.)
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (kNR * K * std::min<int64_t>(M, 64)));
    // Many rows (prefill): take x in chunks so that a chunk stays in cache
    // while the task's weight rows stream past it. Each output element is
    // computed the same way whatever M is, so results do not depend on batching.
    const int64_t m_chunk = 64;
    parallel_for(blocks + (N % kNR ? 1 : 0), grain, [&](int64_t b, int64_t e) {
        for (int64_t m0 = 0; m0 < M; m0 += m_chunk) {
            const T *xm = x + m0 * xs;
            O *om = out + m0 * os;
            int64_t mc = std::min(m_chunk, M - m0);
            for (int64_t t = b; t < e; ++t) {
                if (t < blocks) {
                    rows_block<T, kNR>(om, os, xm, xs, w, bias, mc, K, t * kNR);
                } else {
                    for (int64_t n = blocks * kNR; n < N; ++n) rows_block<T, 1>(om, os, xm, xs, w, bias, mc, K, n);
                }
            }
        }
    });
}

}  // namespace

void linear_row_major(DType dt, void *out, int64_t out_stride, const void *x, int64_t x_stride, const void *weight,
                      const void *bias, int64_t M, int64_t N, int64_t K, bool out_f32) {
    if (M <= 0 || N <= 0) return;
    with_float_types(dt, out_f32, [&](auto tag, auto out_tag) {
        using T = decltype(tag);
        using O = decltype(out_tag);
        run<T>(static_cast<O *>(out), out_stride, static_cast<const T *>(x), x_stride, static_cast<const T *>(weight),
               static_cast<const T *>(bias), M, N, K);
    });
}

// Dispatch. A packed weight takes the panel kernel at every M: its register
// tile is the GEMV for M <= kMaxRows (one pass over W, split over panels) and
// the blocked GEMM above (split over row chunks); both are the same chain of
// multiply-adds per output, so results do not depend on M. Measured on 2 Zen 4
// cores against this row-major kernel, bf16 SmolLM2/Gemma 3 shapes, 1 thread
// at M = 1: avx512bf16 (VDPBF16PS) 1.5-1.8x at M = 1, 2.4-2.8x from M = 8;
// avx512 / avx2 (f32 FMA tile) 1.2x / 1.3-1.5x at M = 1, 1.1-1.3x / 1.6-1.8x
// from M = 8 (benchmarks/bench_linear.py has the GEMM against torch).
// A row-major weight keeps the row-major kernel at every M, for the same
// reason (batch invariance): pack the weight (the model loader does) to get
// the GEMM. Panels need K % linear_pack_pair(dt) == 0 (the binding checks).
void linear(DType dt, void *out, int64_t out_stride, const void *x, int64_t x_stride, const void *weight,
            const void *bias, int64_t M, int64_t N, int64_t K, bool packed, bool out_f32, bool rounded) {
    if (M <= 0 || N <= 0) return;
    rounded = rounded && out_f32 && dt != DType::f32;
    // Columns [n0, N) of out, written unrounded, rounded in place (the row-major kernel's output; the panel
    // kernel rounds in its epilogue).
    auto round_cols = [&](int64_t n0) {
        if (!rounded || n0 >= N) return;
        with_float_type(dt, [&](auto tag) {
            using T = decltype(tag);
            for (int64_t m = 0; m < M; ++m) {
                float *o = static_cast<float *>(out) + m * out_stride;
                for (int64_t n = n0; n < N; ++n) o[n] = to_f32(from_f32<T>(o[n]));
            }
        });
    };
    if (!packed) {
        linear_row_major(dt, out, out_stride, x, x_stride, weight, bias, M, N, K, out_f32);
        round_cols(0);
        return;
    }
    const int64_t C = linear_pack_cols(), panels = N / C, es = dtype_size(dt), tail = panels * C;
    const int64_t os = out_f32 ? int64_t(sizeof(float)) : es;
    linear_panels(dt, out, out_stride, x, x_stride, weight, bias, M, panels, K, out_f32, rounded);
    if (tail < N) {  // rows past the last full panel are row-major
        linear_row_major(dt, static_cast<char *>(out) + tail * os, out_stride, x, x_stride,
                         static_cast<const char *>(weight) + tail * K * es,
                         bias ? static_cast<const char *>(bias) + tail * es : nullptr, M, N - tail, K, out_f32);
        round_cols(tail);
    }
}

// A LinearWeight is dense (the rule above) or quantized parts, each writing its own output columns.
void linear_weight(DType dt, void *out, int64_t out_stride, const void *x, int64_t x_stride, const LinearWeight &w,
                   const void *bias, int64_t M, int64_t N, int64_t K, bool out_f32) {
    if (w.parts == 0) {
        linear(dt, out, out_stride, x, x_stride, w.dense, bias, M, N, K, w.packed, out_f32);
        return;
    }
    const int64_t es = dtype_size(dt), os = out_f32 ? int64_t(sizeof(float)) : es;
    int64_t n0 = 0;
    for (int i = 0; i < w.parts; ++i) {
        const QuantMatrix &q = w.part[i];
        const void *b = bias ? static_cast<const char *>(bias) + n0 * es : nullptr;
        quant_linear(dt, static_cast<char *>(out) + n0 * os, out_stride, x, x_stride, q, b, M, out_f32);
        n0 += q.N;
    }
}

}  // namespace cpuinfer
