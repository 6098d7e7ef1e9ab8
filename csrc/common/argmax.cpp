// Greedy sampling's argmax over each row of logits, with torch.argmax's
// answer: the first index of the maximum, or of the first NaN if the row has
// one (so greedy tokens equal transformers' argmax, ties included).
//
// torch's argmax reduces ~0.7 G elements/s on 2 threads: 2-4 ms for a
// 32-row step over a 49152-token vocabulary, a few percent of a batched
// decode step. Here each row is one pass of vector max over blocks of
// kBlock elements, remembering the first block holding the row's maximum,
// then a scalar search inside that block only.
#include <algorithm>
#include <cmath>

#include "dispatch_dtype.h"
#include "kernels.h"
#include "parallel.h"
#include "vec.h"

namespace cpuinfer {
namespace {

constexpr int64_t kBlock = 512;  // a multiple of every layer's width (SVE: up to 64 lanes)

// The exact answer by a scalar scan (rows with NaN, or inf + -inf in a block's check sum).
template <typename T>
int64_t argmax_scalar(const T *x, int64_t n) {
    int64_t best = 0;
    float m = -INFINITY;  // an all -inf row keeps index 0
    for (int64_t i = 0; i < n; ++i) {
        const float v = to_f32(x[i]);
        if (std::isnan(v)) return i;
        if (v > m) m = v, best = i;
    }
    return best;
}

template <typename T>
int64_t argmax_row(const T *x, int64_t n) {
    const int64_t W = vec::width();
    float best = 0.f;
    int64_t best_block = -1;
    for (int64_t b0 = 0; b0 < n; b0 += kBlock) {
        const int64_t b1 = std::min(n, b0 + kBlock);
        // vec::max's NaN handling differs between layers, so a NaN is found
        // through a sum instead: NaN in, NaN out (inf + -inf too: then the
        // scalar scan decides, still exactly).
        vec::vf m = vec::splat(-INFINITY), s = vec::zero();
        int64_t i = b0;
        for (; i + W <= b1; i += W) {
            const vec::vf v = vec::load(x + i);
            m = vec::max(m, v);
            s = vec::add(s, v);
        }
        float bm = vec::reduce_max(m), bs = vec::reduce_add(s);
        for (; i < b1; ++i) {
            const float v = to_f32(x[i]);
            bm = v > bm ? v : bm;
            bs += v;
        }
        if (std::isnan(bs)) return argmax_scalar(x, n);
        if (best_block < 0 || bm > best) best = bm, best_block = b0;  // strict: the first block keeps a tie
    }
    const int64_t end = std::min(n, best_block + kBlock);
    for (int64_t i = best_block; i < end; ++i)
        if (to_f32(x[i]) == best) return i;
    return best_block;  // not reached: the block holds its maximum (-inf included)
}

}  // namespace

void argmax_rows(DType dt, int64_t *out, const void *x, int64_t x_stride, int64_t rows, int64_t cols) {
    if (rows <= 0 || cols <= 0) return;
    with_float_type(dt, [&](auto tag) {
        using T = decltype(tag);
        const T *p = static_cast<const T *>(x);
        // A row is at least a few thousand elements in practice (a vocabulary): one row per task.
        parallel_for(rows, std::max<int64_t>(1, 32768 / cols), [&](int64_t b, int64_t e) {
            for (int64_t r = b; r < e; ++r) out[r] = argmax_row(p + r * x_stride, cols);
        });
    });
}

}  // namespace cpuinfer
