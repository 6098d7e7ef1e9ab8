// silu/gelu/gelu_tanh _and_mul against double-precision references.
#include <cmath>
#include <string>

#include "common/kernels.h"
#include "harness.h"

using namespace cpuinfer;
using namespace cpuinfer::test;

namespace {

double ref_act(Activation a, double x) {
    switch (a) {
        case Activation::silu: return x / (1.0 + std::exp(-x));
        case Activation::gelu: return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0)));
        case Activation::gelu_tanh: {
            const double k = std::sqrt(2.0 / M_PI);
            return 0.5 * x * (1.0 + std::tanh(k * (x + 0.044715 * x * x * x)));
        }
    }
    return 0;
}
const char *act_name(Activation a) {
    return a == Activation::silu ? "silu" : a == Activation::gelu ? "gelu" : "gelu_tanh";
}
constexpr Activation kActs[] = {Activation::silu, Activation::gelu, Activation::gelu_tanh};

void check(Activation act, DType dt, int64_t rows, int64_t d, float scale) {
    const int64_t in_stride = 2 * d + 3, out_stride = d + 2;
    Buffer in(dt, rows * in_stride), out(dt, rows * out_stride);
    in.fill_normal(scale);
    act_and_mul(dt, act, out.data(), out_stride, in.data(), in_stride, rows, d);
    std::vector<float> got(size_t(rows * d));
    std::vector<double> want(got.size());
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < d; ++i) {
            got[r * d + i] = out.get(r * out_stride + i);
            want[r * d + i] = ref_act(act, in.get(r * in_stride + i)) * in.get(r * in_stride + d + i);
        }
    Tol t = tol_for(dt);
    // f32 transcendentals: a few ulp of f32 on top of the output rounding.
    double rtol = std::max(t.rtol, 2e-6), atol = std::max(t.atol, 1e-6 * scale);
    expect_close(std::string(act_name(act)) + "_and_mul " + dtype_name(dt) + " rows=" + std::to_string(rows) +
                     " d=" + std::to_string(d) + " scale=" + std::to_string(scale),
                 got.data(), want.data(), rows * d, atol, rtol);
}

}  // namespace

CPUINFER_TEST(act_and_mul_matches_reference) {
    for (Activation act : kActs)
        for (DType dt : kFloatTypes)
            for (int64_t d : {1, 5, 8, 16, 37, 1024, 1500}) check(act, dt, 3, d, 2.f);
}

CPUINFER_TEST(act_and_mul_extreme_inputs) {
    // Large |x| exercises exp's clamping: silu(-80) -> -0, silu(80) -> 80, no NaN or inf.
    for (Activation act : kActs)
        for (DType dt : {DType::f32, DType::bf16}) check(act, dt, 2, 100, 30.f);
    const int64_t d = 16;
    Buffer in(DType::f32, 2 * d), out(DType::f32, d);
    const float xs[] = {-1e4f, -200.f, -88.f, -87.f, -10.f, -1e-30f, 0.f, 1e-30f,
                        1e-6f, 0.5f, 10.f, 87.f, 88.f, 89.f, 200.f, 1e4f};
    for (int64_t i = 0; i < d; ++i) {
        in.set(i, xs[i]);
        in.set(d + i, 1.f);
    }
    for (Activation act : kActs) {
        act_and_mul(DType::f32, act, out.data(), d, in.data(), 2 * d, 1, d);
        std::vector<double> want(d);
        for (int64_t i = 0; i < d; ++i) want[size_t(i)] = ref_act(act, xs[i]);
        expect_close(std::string(act_name(act)) + " at extreme inputs", out.to_floats().data(), want.data(), d, 1e-6,
                     2e-6);
    }
}
