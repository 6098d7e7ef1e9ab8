// rms_norm and fused_add_rms_norm against a double-precision reference.
#include <cmath>
#include <string>

#include "common/kernels.h"
#include "harness.h"

using namespace cpuinfer;
using namespace cpuinfer::test;

namespace {

const int64_t kHidden[] = {1, 3, 8, 17, 64, 100, 1024, 4099};

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, in double.
std::vector<double> ref_rms_norm(const std::vector<float> &x, int64_t stride, const std::vector<float> &w,
                                 int64_t rows, int64_t hidden, double eps) {
    std::vector<double> out(size_t(rows * hidden));
    for (int64_t r = 0; r < rows; ++r) {
        double ss = 0;
        for (int64_t i = 0; i < hidden; ++i) ss += double(x[r * stride + i]) * x[r * stride + i];
        double inv = 1.0 / std::sqrt(ss / double(hidden) + eps);
        for (int64_t i = 0; i < hidden; ++i) out[r * hidden + i] = x[r * stride + i] * inv * w[i];
    }
    return out;
}

std::vector<float> rows_of(const Buffer &b, int64_t stride, int64_t rows, int64_t hidden) {
    std::vector<float> v(size_t(rows * hidden));
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < hidden; ++i) v[r * hidden + i] = b.get(r * stride + i);
    return v;
}

std::string label(const char *kernel, DType dt, int64_t hidden) {
    return std::string(kernel) + " " + dtype_name(dt) + " hidden=" + std::to_string(hidden);
}

}  // namespace

CPUINFER_TEST(rms_norm_matches_reference) {
    for (DType dt : kFloatTypes) {
        for (int64_t hidden : kHidden) {
            const int64_t rows = 5, in_stride = hidden + 3, out_stride = hidden + 1;  // padded rows
            Buffer x(dt, rows * in_stride), w(dt, hidden), out(dt, rows * out_stride);
            x.fill_normal(2.f);
            w.fill_normal(0.5f, 1.f);
            rms_norm(dt, out.data(), out_stride, x.data(), in_stride, w.data(), rows, hidden, 1e-6f);
            auto want = ref_rms_norm(x.to_floats(), in_stride, w.to_floats(), rows, hidden, 1e-6);
            Tol t = tol_for(dt);
            expect_close(label("rms_norm", dt, hidden), rows_of(out, out_stride, rows, hidden).data(), want.data(),
                         rows * hidden, t.atol, t.rtol);
        }
    }
}

CPUINFER_TEST(rms_norm_in_place_and_large_values) {
    // Values near the f16 limit: the sum of squares must not overflow (it is f32).
    for (DType dt : kFloatTypes) {
        const int64_t rows = 2, hidden = 40;
        Buffer x(dt, rows * hidden), w(dt, hidden);
        x.fill_normal(dt == DType::f16 ? 20000.f : 1e5f);
        w.fill_normal(0.1f, 1.f);
        auto want = ref_rms_norm(x.to_floats(), hidden, w.to_floats(), rows, hidden, 1e-5);
        rms_norm(dt, x.data(), hidden, x.data(), hidden, w.data(), rows, hidden, 1e-5f);
        Tol t = tol_for(dt);
        expect_close(label("rms_norm in place", dt, hidden), x.to_floats().data(), want.data(), rows * hidden,
                     t.atol, t.rtol);
    }
}

CPUINFER_TEST(fused_add_rms_norm_matches_reference) {
    for (DType dt : kFloatTypes) {
        for (int64_t hidden : kHidden) {
            const int64_t rows = 4, xs = hidden + 2, rs = hidden + 5;
            Buffer x(dt, rows * xs), res(dt, rows * rs), w(dt, hidden);
            x.fill_normal();
            res.fill_normal(3.f);
            w.fill_normal(0.5f, 1.f);
            // Reference: residual += x rounded to dt (an unfused add in dt), then rms_norm of it.
            std::vector<float> sum(size_t(rows * hidden));
            std::vector<double> want_res(sum.size());
            for (int64_t r = 0; r < rows; ++r)
                for (int64_t i = 0; i < hidden; ++i) {
                    double s = round_to(dt, double(x.get(r * xs + i)) + res.get(r * rs + i));
                    sum[r * hidden + i] = float(s);
                    want_res[r * hidden + i] = s;
                }
            auto want = ref_rms_norm(sum, hidden, w.to_floats(), rows, hidden, 1e-6);
            fused_add_rms_norm(dt, x.data(), xs, res.data(), rs, w.data(), rows, hidden, 1e-6f);
            Tol t = tol_for(dt);
            expect_close(label("fused_add_rms_norm residual", dt, hidden), rows_of(res, rs, rows, hidden).data(),
                         want_res.data(), rows * hidden, 0, 0);
            expect_close(label("fused_add_rms_norm out", dt, hidden), rows_of(x, xs, rows, hidden).data(),
                         want.data(), rows * hidden, t.atol, t.rtol);
        }
    }
}

CPUINFER_TEST(norm_leaves_padding_untouched) {
    const int64_t rows = 3, hidden = 19, stride = 24;
    Buffer x(DType::bf16, rows * stride), w(DType::bf16, hidden), out(DType::bf16, rows * stride);
    x.fill_normal();
    w.fill_normal();
    for (int64_t i = 0; i < out.size(); ++i) out.set(i, -7.f);
    rms_norm(DType::bf16, out.data(), stride, x.data(), stride, w.data(), rows, hidden, 1e-6f);
    bool ok = true;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = hidden; i < stride; ++i) ok = ok && out.get(r * stride + i) == -7.f;
    expect_true("rms_norm wrote outside its rows", ok);
}
