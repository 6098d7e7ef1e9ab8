#include <cmath>

#include "dispatch_dtype.h"
#include "kernels.h"
#include "parallel.h"
#include "vec.h"

namespace cpuinfer {
namespace {

// Rows per parallel task: enough work per task to pay for the hand-off.
int64_t row_grain(int64_t hidden) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(hidden, 1)); }

// Rows are walked in pairs of vectors (vec::load2a/b, store2: the cheapest lane
// order for T), then single vectors, then scalars.
template <typename T>
float sum_squares(const T *x, int64_t n) {
    const int W = vec::width();
    vec::vf acc0 = vec::zero(), acc1 = vec::zero(), acc2 = vec::zero(), acc3 = vec::zero();
    int64_t i = 0;
    for (; i + 4 * W <= n; i += 4 * W) {
        vec::vf pa = vec::load2a(x + i), pb = vec::load2b(x + i);
        vec::vf qa = vec::load2a(x + i + 2 * W), qb = vec::load2b(x + i + 2 * W);
        acc0 = vec::fma(pa, pa, acc0);
        acc1 = vec::fma(pb, pb, acc1);
        acc2 = vec::fma(qa, qa, acc2);
        acc3 = vec::fma(qb, qb, acc3);
    }
    for (; i + W <= n; i += W) {
        vec::vf a = vec::load(x + i);
        acc0 = vec::fma(a, a, acc0);
    }
    float s = vec::reduce_add(vec::add(vec::add(acc0, acc1), vec::add(acc2, acc3)));
    for (; i < n; ++i) {
        float v = to_f32(x[i]);
        s += v * v;
    }
    return s;
}

template <typename T>
void scale_row(T *out, const T *x, const T *w, int64_t n, float inv) {
    const int W = vec::width();
    vec::vf s = vec::splat(inv);
    int64_t i = 0;
    for (; i + 2 * W <= n; i += 2 * W) {
        vec::store2(out + i, vec::mul(vec::mul(vec::load2a(x + i), s), vec::load2a(w + i)),
                    vec::mul(vec::mul(vec::load2b(x + i), s), vec::load2b(w + i)));
    }
    for (; i + W <= n; i += W) vec::store(out + i, vec::mul(vec::mul(vec::load(x + i), s), vec::load(w + i)));
    for (; i < n; ++i) out[i] = from_f32<T>(to_f32(x[i]) * inv * to_f32(w[i]));
}

// out <- x + residual, rounded to T (as an unfused add in T would be); out may be x or residual.
template <typename T>
void add_rows(T *out, const T *x, const T *residual, int64_t n) {
    const int W = vec::width();
    int64_t i = 0;
    for (; i + 2 * W <= n; i += 2 * W) {
        vec::store2(out + i, vec::add(vec::load2a(x + i), vec::load2a(residual + i)),
                    vec::add(vec::load2b(x + i), vec::load2b(residual + i)));
    }
    for (; i + W <= n; i += W) vec::store(out + i, vec::add(vec::load(x + i), vec::load(residual + i)));
    for (; i < n; ++i) out[i] = from_f32<T>(to_f32(x[i]) + to_f32(residual[i]));
}

}  // namespace

void rms_norm(DType dt, void *out, int64_t out_stride, const void *in, int64_t in_stride, const void *weight,
              int64_t rows, int64_t hidden, float eps) {
    with_float_type(dt, [&](auto tag) {
        using T = decltype(tag);
        T *o = static_cast<T *>(out);
        const T *x = static_cast<const T *>(in);
        const T *w = static_cast<const T *>(weight);
        parallel_for(rows, row_grain(hidden), [&](int64_t b, int64_t e) {
            for (int64_t r = b; r < e; ++r) {
                const T *xr = x + r * in_stride;
                float inv = 1.0f / std::sqrt(sum_squares(xr, hidden) / float(hidden) + eps);
                scale_row(o + r * out_stride, xr, w, hidden, inv);
            }
        });
    });
}

void fused_add_rms_norm(DType dt, void *x, int64_t x_stride, void *residual, int64_t res_stride,
                        const void *weight, int64_t rows, int64_t hidden, float eps) {
    with_float_type(dt, [&](auto tag) {
        using T = decltype(tag);
        T *xp = static_cast<T *>(x);
        T *rp = static_cast<T *>(residual);
        const T *w = static_cast<const T *>(weight);
        parallel_for(rows, row_grain(hidden), [&](int64_t b, int64_t e) {
            for (int64_t r = b; r < e; ++r) {
                T *xr = xp + r * x_stride;
                T *rr = rp + r * res_stride;
                add_rows(rr, xr, rr, hidden);
                float inv = 1.0f / std::sqrt(sum_squares(rr, hidden) / float(hidden) + eps);
                scale_row(xr, rr, w, hidden, inv);
            }
        });
    });
}

void add_layer_norm(DType dt, void *out, int64_t out_stride, const void *x, int64_t x_stride, const void *residual,
                    int64_t res_stride, const float *weight, const float *bias, int64_t rows, int64_t hidden, float eps) {
    with_float_type(dt, [&](auto tag) {
        using T = decltype(tag);
        const int W = vec::width();
        parallel_for(rows, row_grain(hidden), [&](int64_t b, int64_t e) {
            for (int64_t r = b; r < e; ++r) {
                T *o = static_cast<T *>(out) + r * out_stride;
                const T *xr = static_cast<const T *>(x) + r * x_stride;
                if (residual) {  // v = x + residual, rounded to T, into out
                    add_rows(o, xr, static_cast<const T *>(residual) + r * res_stride, hidden);
                    xr = o;
                }
                // The mean, then the variance around it (two passes: no cancellation), in f32.
                vec::vf acc = vec::zero();
                int64_t i = 0;
                for (; i + W <= hidden; i += W) acc = vec::add(acc, vec::load(xr + i));
                float sum = vec::reduce_add(acc);
                for (; i < hidden; ++i) sum += to_f32(xr[i]);
                const float mean = sum / float(hidden);
                const vec::vf m = vec::splat(mean);
                acc = vec::zero();
                for (i = 0; i + W <= hidden; i += W) {
                    const vec::vf c = vec::sub(vec::load(xr + i), m);
                    acc = vec::fma(c, c, acc);
                }
                float var = vec::reduce_add(acc);
                for (; i < hidden; ++i) var += (to_f32(xr[i]) - mean) * (to_f32(xr[i]) - mean);
                const float inv = 1.0f / std::sqrt(var / float(hidden) + eps);
                const vec::vf s = vec::splat(inv);
                for (i = 0; i + W <= hidden; i += W) {
                    const vec::vf n = vec::mul(vec::sub(vec::load(xr + i), m), s);
                    vec::store(o + i, vec::fma(n, vec::load(weight + i), vec::load(bias + i)));
                }
                for (; i < hidden; ++i) o[i] = from_f32<T>(std::fma((to_f32(xr[i]) - mean) * inv, weight[i], bias[i]));
            }
        });
    });
}

const char *vector_layer() { return vec::kName; }
int vector_width() { return vec::width(); }

}  // namespace cpuinfer
