// The linear layer on a packed weight: one kernel for decode (a few rows, a
// GEMV reading W once) and for prefill and batches (a blocked GEMM).
//
// Layout (linear_pack_weight): output features in panels of
// C = linear_pack_cols() (2 vectors of this build); a panel is K x C elements,
// k-major, each column's kPair consecutive k adjacent (panel_kernel.h). Rows
// past the last full panel stay row-major and take the row-major kernel.
//
// Work: the rows of x are cut into chunks sized so that a chunk of x stays in
// L2 while the weight panels pass by; a task is (row chunk, panel), ordered
// chunk-major, and parallel_for hands each thread one contiguous run of
// tasks. So a long prefill splits over rows (each thread keeps its own x in
// its L2 and reads the small weight from L3), a short batch or a decode step
// splits over panels (each thread reads half of W once). Inside a task the
// chunk's rows go through the register tile in even groups of at most
// kMaxRows rows; the panel stays in L1/L2 between groups.
//
// Determinism and batch invariance: every output element is the same chain
// of multiply-adds in k order, one f32 rounding to the output type at the
// end, whatever M, the chunking, the grouping or the thread count; so a row's
// result does not depend on the batch it was computed in (the engine's greedy
// outputs rely on that; tests/kernels/test_linear.py checks it across the
// decode/prefill sizes).
#include "linear_packed.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "dispatch_dtype.h"
#include "panel_kernel.h"
#include "parallel.h"
#include "vec.h"

namespace cpuinfer {
namespace {

constexpr int64_t kChunkBytes = 192 * 1024;  // x bytes per row chunk: half of a 1-2 MB L2 with the panel
constexpr int kMaxLanes = 64;                // f32 lanes of the widest vector (SVE 2048-bit)

template <typename F>
inline void with_tile_rows(int r, F &&f) {
    switch (r) {
#define CPUINFER_CASE(i) \
    case i + 1:          \
        if constexpr (i < panel::kMaxRows) f(std::integral_constant<int, i + 1>{}); \
        break;
        CPUINFER_PANEL_ROWS(CPUINFER_CASE)
#undef CPUINFER_CASE
        default: break;
    }
}

template <typename T>
void run(T *out, int64_t os, const T *x, int64_t xs, const T *w, const T *bias, int64_t M, int64_t panels,
         int64_t K) {
    using Kernel = panel::PanelKernel<T>;
    using X = typename Kernel::X;
    const int W = vec::width();
    const int64_t C = 2 * int64_t(W), MR = panel::kMaxRows;
    // Row chunks: at most kChunkBytes of x each, of equal size, and a
    // multiple of the thread count of them (while that leaves chunks of
    // at least 2 tiles), so that every thread gets the same rows:
    // parallel_for splits the tasks into equal contiguous runs. Measured on
    // 2 cores: unequal chunks (156, 156, 156, 44 rows at M = 512) cost ~20%.
    int64_t chunks = 1;
    const int64_t max_rows = std::max<int64_t>(MR, kChunkBytes / (K * int64_t(sizeof(T))));
    if (M > max_rows) {
        const int64_t nth = max_threads();
        chunks = (M + max_rows - 1) / max_rows;
        const int64_t even = (chunks + nth - 1) / nth * nth;
        if (M / even >= 2 * MR) chunks = even;
    }
    const int64_t chunk = (M + chunks - 1) / chunks, tasks = chunks * panels;
    // As the row-major GEMV: at least ~64K multiply-adds per thread, so that
    // a decode step's small projections do not pay for waking the team.
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (C * K * std::min<int64_t>(chunk, 64)));
    parallel_for(tasks, grain, [&](int64_t b, int64_t e) {
        alignas(64) float acc[panel::kMaxRows * 2 * kMaxLanes];
        alignas(64) float bias_f[2 * kMaxLanes];
        thread_local std::vector<float> x_f32;  // the row chunk widened, for tiles that take f32 x
        int64_t widened = -1;                   // which chunk x_f32 holds
        for (int64_t t = b; t < e; ++t) {
            const int64_t c = t / panels, p = t % panels;
            const int64_t m_begin = c * chunk, rows = std::min(chunk, M - m_begin);
            if (rows <= 0) continue;
            const X *xc;
            int64_t xcs;
            if constexpr (std::is_same_v<X, T>) {
                xc = x + m_begin * xs;
                xcs = xs;
            } else {
                if (widened != c) {
                    if (int64_t(x_f32.size()) < rows * K) x_f32.resize(size_t(rows * K));
                    for (int64_t r = 0; r < rows; ++r) {
                        const T *src = x + (m_begin + r) * xs;
                        float *dst = x_f32.data() + r * K;
                        int64_t k = 0;
                        for (; k + W <= K; k += W) vec::store(dst + k, vec::load(src + k));
                        for (; k < K; ++k) dst[k] = to_f32(src[k]);
                    }
                    widened = c;
                }
                xc = x_f32.data();
                xcs = K;
            }
            const T *wp = w + p * C * K;
            if (bias)
                for (int64_t j = 0; j < C; j += W) vec::store(bias_f + j, vec::load(bias + p * C + j));
            const int64_t groups = (rows + MR - 1) / MR, per = (rows + groups - 1) / groups;
            for (int64_t r0 = 0; r0 < rows; r0 += per) {
                const int mr = int(std::min(per, rows - r0));
                const int64_t m0 = m_begin + r0;
                with_tile_rows(mr, [&](auto R) { Kernel::template tile<decltype(R)::value>(xc + r0 * xcs, xcs, wp, K, acc); });
                for (int r = 0; r < mr; ++r) {
                    T *o = out + (m0 + r) * os + p * C;
                    const float *a = acc + r * C;
                    for (int64_t j = 0; j < C; j += W) {
                        vec::vf v = vec::load(a + j);
                        if (bias) v = vec::add(v, vec::load(bias_f + j));
                        vec::store(o + j, v);
                    }
                }
            }
        }
    });
}

}  // namespace

int64_t linear_pack_cols() { return 2 * int64_t(vec::width()); }

int64_t linear_pack_pair(DType dt) {
    int64_t pair = 1;
    with_float_type(dt, [&](auto tag) { pair = panel::PanelKernel<decltype(tag)>::kPair; });
    return pair;
}

const char *linear_tile_impl(DType dt) {
    const char *name = "";
    with_float_type(dt, [&](auto tag) { name = panel::PanelKernel<decltype(tag)>::kName; });
    return name;
}

void linear_pack_weight(DType dt, void *dst, const void *src, int64_t N, int64_t K) {
    const int64_t C = linear_pack_cols(), P = linear_pack_pair(dt), es = dtype_size(dt);
    const char *in = static_cast<const char *>(src);
    char *o = static_cast<char *>(dst);
    const int64_t panels = N / C;
    parallel_for(panels, 4, [&](int64_t b, int64_t e) {
        for (int64_t p = b; p < e; ++p) {
            const char *rows = in + p * C * K * es;
            char *to = o + p * C * K * es;
            for (int64_t k = 0; k < K; k += P)
                for (int64_t j = 0; j < C; ++j, to += P * es) std::memcpy(to, rows + (j * K + k) * es, size_t(P * es));
        }
    });
    // The tail rows stay row-major.
    std::memcpy(o + panels * C * K * es, in + panels * C * K * es, size_t((N - panels * C) * K * es));
}

void linear_panels(DType dt, void *out, int64_t out_stride, const void *x, int64_t x_stride, const void *weight,
                   const void *bias, int64_t M, int64_t panels, int64_t K) {
    if (M <= 0 || panels <= 0) return;
    with_float_type(dt, [&](auto tag) {
        using T = decltype(tag);
        run<T>(static_cast<T *>(out), out_stride, static_cast<const T *>(x), x_stride,
               static_cast<const T *>(weight), static_cast<const T *>(bias), M, panels, K);
    });
}

}  // namespace cpuinfer
