// linear (row-major and packed weights) against a double-precision reference,
// on every variant: the packed layout's step is 2 vectors of the variant, so
// NEON, SVE at each vector length and VXE each pack differently.
#include <string>

#include "common/kernels.h"
#include "harness.h"

using namespace cpuinfer;
using namespace cpuinfer::test;

namespace {

std::string label(const char *what, DType dt, int64_t m, int64_t n, int64_t k) {
    return std::string(what) + " " + dtype_name(dt) + " M=" + std::to_string(m) + " N=" + std::to_string(n) +
           " K=" + std::to_string(k);
}

// out[m, n] = sum_k x[m, k] * w[n, k] + bias[n], in double.
std::vector<double> ref_linear(const Buffer &x, const Buffer &w, const Buffer *bias, int64_t M, int64_t N, int64_t K) {
    std::vector<double> out(size_t(M * N));
    for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
            double s = bias ? bias->get(n) : 0.0;
            for (int64_t k = 0; k < K; ++k) s += double(x.get(m * K + k)) * w.get(n * K + k);
            out[size_t(m * N + n)] = s;
        }
    return out;
}

}  // namespace

CPUINFER_TEST(linear_matches_reference_row_major_and_packed) {
    const int64_t step = linear_pack_step();
    expect_true("pack step is positive and even", step >= 2 && step % 2 == 0);
    for (DType dt : kFloatTypes) {
        for (int64_t M : {1, 3, 5, 9}) {
            for (int64_t N : {1, 4, 7, 13}) {
                for (int64_t K : {step, 3 * step, 3 * step + 5}) {
                    Buffer x(dt, M * K), w(dt, N * K), bias(dt, N), out(dt, M * N), outp(dt, M * N);
                    x.fill_normal(1.f);
                    w.fill_normal(1.f / float(K));
                    bias.fill_normal(0.5f);
                    auto want = ref_linear(x, w, &bias, M, N, K);
                    linear(dt, out.data(), N, x.data(), K, w.data(), bias.data(), M, N, K);
                    // Accumulated in f32 over K terms, then rounded once to dt.
                    Tol t = tol_for(dt);
                    expect_close(label("linear", dt, M, N, K), out.to_floats().data(), want.data(), M * N,
                                 t.atol + 1e-5 * double(K), t.rtol);
                    if (K % step != 0) continue;
                    Buffer packed(dt, N * K);
                    linear_pack_weight(dt, packed.data(), w.data(), N, K);
                    // The documented layout: blocks of 4 rows interleaved per step, tail rows as they were.
                    bool layout_ok = true;
                    for (int64_t n = 0; n < N; ++n)
                        for (int64_t k = 0; k < K; ++k) {
                            const int64_t blk = n / 4, j = n % 4;
                            const int64_t at = n < N / 4 * 4 ? blk * 4 * K + (k / step) * 4 * step + j * step + k % step
                                                             : n * K + k;
                            layout_ok = layout_ok && packed.get(at) == w.get(n * K + k);
                        }
                    expect_true(label("packed layout", dt, M, N, K), layout_ok);
                    linear(dt, outp.data(), N, x.data(), K, packed.data(), bias.data(), M, N, K, true);
                    bool same = true;  // the same sums in the same order: bit for bit
                    for (int64_t i = 0; i < M * N; ++i) same = same && outp.get(i) == out.get(i);
                    expect_true(label("packed equals row-major", dt, M, N, K), same);
                }
            }
        }
    }
}
