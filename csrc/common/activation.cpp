#include <stdexcept>

#include "activation.h"
#include "dispatch_dtype.h"
#include "kernels.h"
#include "parallel.h"
#include "vec.h"

namespace cpuinfer {
namespace {

// Gated: out = gated<A>(in[:, :d], in[:, d:]); else out = activate<A>(in).
template <Activation A, bool Gated, typename T>
void run(T *out, int64_t out_stride, const T *in, int64_t in_stride, int64_t rows, int64_t d) {
    auto f = [](vec::vf g, vec::vf u) {
        if constexpr (Gated) return gated<A>(g, u);
        else return (void)u, activate<A>(g);
    };
    const int64_t up = Gated ? d : 0;  // the up half's offset (read and ignored without Gated)
    const int W = vec::width();
    // Columns are split too, so that a single row (batch-1 decode) still
    // uses every thread.
    const int64_t col_block = 1024;
    const int64_t col_tasks = (d + col_block - 1) / col_block;
    parallel_for(rows * col_tasks, 4, [&](int64_t b, int64_t e) {
        // Spill buffer for the scalar tail: the tail goes through the same
        // vector code so that every element gets identical rounding.
        float gate[64], upv[64];
        for (int64_t t = b; t < e; ++t) {
            int64_t r = t / col_tasks, c0 = (t % col_tasks) * col_block, c1 = std::min(d, c0 + col_block);
            const T *x = in + r * in_stride;
            T *o = out + r * out_stride;
            int64_t i = c0;
            for (; i + 2 * W <= c1; i += 2 * W) {
                vec::store2(o + i, f(vec::load2a(x + i), vec::load2a(x + up + i)),
                            f(vec::load2b(x + i), vec::load2b(x + up + i)));
            }
            for (; i + W <= c1; i += W) {
                vec::store(o + i, f(vec::load(x + i), vec::load(x + up + i)));
            }
            if (i < c1) {
                int64_t n = c1 - i;
                for (int64_t j = 0; j < W; ++j) {
                    gate[j] = j < n ? to_f32(x[i + j]) : 0.f;
                    upv[j] = j < n ? to_f32(x[up + i + j]) : 0.f;
                }
                vec::store(gate, f(vec::load(gate), vec::load(upv)));
                for (int64_t j = 0; j < n; ++j) o[i + j] = from_f32<T>(gate[j]);
            }
        }
    });
}

}  // namespace

void act_and_mul(DType dt, Activation act, void *out, int64_t out_stride, const void *in, int64_t in_stride,
                 int64_t rows, int64_t d) {
    with_float_type(dt, [&](auto tag) {
        using T = decltype(tag);
        T *o = static_cast<T *>(out);
        const T *x = static_cast<const T *>(in);
        with_activation(act, [&](auto a) { run<decltype(a)::value, true>(o, out_stride, x, in_stride, rows, d); });
    });
}

void act(DType dt, Activation a, void *out, int64_t out_stride, const void *in, int64_t in_stride, int64_t rows,
         int64_t d) {
    with_float_type(dt, [&](auto tag) {
        using T = decltype(tag);
        T *o = static_cast<T *>(out);
        const T *x = static_cast<const T *>(in);
        with_activation(a, [&](auto f) {
            constexpr Activation A = decltype(f)::value;
            if constexpr (A == Activation::swiglu_oai)
                throw std::invalid_argument("act: swiglu_oai is a gated activation (act_and_mul), not an elementwise one");
            else
                run<A, false>(o, out_stride, x, in_stride, rows, d);
        });
    });
}

}  // namespace cpuinfer
