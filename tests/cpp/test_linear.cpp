// linear (row-major and packed weights) against a double-precision reference,
// on every variant: the packed layout's step is 2 vectors of the variant, so
// NEON, SVE at each vector length and VXE each pack differently.
#include <cmath>
#include <string>
#include <vector>

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
    const int64_t C = linear_pack_cols();
    for (DType dt : kFloatTypes) {
        const int64_t P = linear_pack_pair(dt);
        expect_true("pack pair is 1 or 2", P == 1 || P == 2);
        // M crosses the GEMV / GEMM boundary (the tile's rows, 4, 6 or 12) and
        // the row chunks; N has whole panels and a tail, and 4 panels side by
        // side for one or two rows (the decode tiles); K odd where the pair allows.
        // reduced(): an M on each side of every tile height (and of amx's 16), row chunks left to
        // linear_packed_gemm_row_chunks.
        const std::vector<int64_t> Ms = reduced() ? std::vector<int64_t>{1, 2, 5, 13, 40}
                                                  : std::vector<int64_t>{1, 2, 3, 5, 9, 13, 25, 40, 131};
        for (int64_t M : Ms) {
            for (int64_t N : {int64_t(1), int64_t(7), C, 2 * C + 3, 4 * C + 3}) {
                if (N > 2 * C + 3 && M > 2) continue;
                for (int64_t K : {int64_t(2), C, 3 * C + 5, 3 * C + 6}) {
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
                    if (K % P != 0) continue;
                    Buffer packed(dt, N * K);
                    linear_pack_weight(dt, packed.data(), w.data(), N, K);
                    // The documented layout: panels of C rows, k-major, P k per column adjacent; tail rows as they were.
                    bool layout_ok = true;
                    for (int64_t n = 0; n < N; ++n)
                        for (int64_t k = 0; k < K; ++k) {
                            const int64_t at = n < N / C * C ? n / C * C * K + k / P * C * P + n % C * P + k % P
                                                             : n * K + k;
                            layout_ok = layout_ok && packed.get(at) == w.get(n * K + k);
                        }
                    expect_true(label("packed layout", dt, M, N, K), layout_ok);
                    linear(dt, outp.data(), N, x.data(), K, packed.data(), bias.data(), M, N, K, true);
                    expect_close(label("linear packed", dt, M, N, K), outp.to_floats().data(), want.data(), M * N,
                                 t.atol + 1e-5 * double(K), t.rtol);
                    // Batch invariance: each row alone gives the bits it had in the batch.
                    bool same = true;
                    Buffer one(dt, N);
                    for (int64_t m = 0; m < M; ++m) {
                        Buffer xm(dt, K);
                        for (int64_t k = 0; k < K; ++k) xm.set(k, x.get(m * K + k));
                        linear(dt, one.data(), N, xm.data(), K, packed.data(), bias.data(), 1, N, K, true);
                        for (int64_t n = 0; n < N; ++n) same = same && one.get(n) == outp.get(m * N + n);
                    }
                    expect_true(label("packed rows independent of the batch", dt, M, N, K), same);
                }
            }
        }
    }
}

CPUINFER_TEST(linear_tile_matches_variant) {
    // The ISA bf16 fast paths are the ones that run (a build slip would silently test the portable tile).
    const std::string variant = CPUINFER_TEST_VARIANT, tile = linear_tile_impl(DType::bf16);
    if (variant == "amx" || variant == "avx512bf16") expect_true("bf16 tile of " + variant, tile == variant);
#if defined(CPUINFER_SIMDE_EMULATION)
    // The software AMX model has AMX-FP16.
    if (variant == "amx") expect_true("f16 tile of amx", std::string(linear_tile_impl(DType::f16)) == "amx-fp16");
#endif
    if (variant == "neon_bf16" || variant == "apple_m2") expect_true("bf16 tile of " + variant, tile == "bfdot");
    if (variant == "neon" || variant == "apple_m1" || variant == "sve") expect_true("bf16 tile of " + variant, tile == "fma");
    const std::string f16 = linear_tile_impl(DType::f16);
    if (variant == "neon_bf16" || variant == "apple_m1" || variant == "apple_m2")
        expect_true("f16 tile of " + variant, f16 == "fmlal");
}

// f16 products are exact in f32, so every variant's packed f16 tile gives the
// f32 FMA chain in k order bit for bit: the portable FMA tile, AMX-FP16 on amx
// where the CPU has it (on SIMDe here), and amx's AVX-512 pair tile for K not
// a multiple of 32. With f32 output that chain plus the bias is what comes out.
CPUINFER_TEST(linear_packed_f16_is_the_fma_chain) {
    const DType dt = DType::f16;
    const int64_t C = linear_pack_cols(), N = 4 * C;  // whole panels (tail rows take the row-major kernel)
    for (int64_t M : {1, 2, 5, 17, 40, 131}) {
        // Multiples of 32 (one tile step, and past a 256-k block), and not.
        for (int64_t K : {64, 288, 70, 2}) {
            if (K % linear_pack_pair(dt) != 0) continue;
            Buffer x(dt, M * K), w(dt, N * K), packed(dt, N * K), bias(dt, N);
            x.fill_normal(1.f);
            w.fill_normal(1.f / float(K));
            bias.fill_normal(0.5f);
            linear_pack_weight(dt, packed.data(), w.data(), N, K);
            std::vector<float> out(size_t(M * N));
            linear(dt, out.data(), N, x.data(), K, packed.data(), bias.data(), M, N, K, true, true);
            int64_t differ = 0;
            for (int64_t m = 0; m < M; ++m)
                for (int64_t n = 0; n < N; ++n) {
                    float acc = 0.f;
                    for (int64_t k = 0; k < K; ++k) acc = std::fma(x.get(m * K + k), w.get(n * K + k), acc);
                    differ += (acc + bias.get(n)) != out[size_t(m * N + n)];
                }
            expect_true(label("f16 packed = the FMA chain", dt, M, N, K) + " (" + std::to_string(differ) + " differ)",
                        differ == 0);
        }
    }
}

// rounded (the logits): f32 out holding the element type's output, bit for bit, from the panels' epilogue
// and from the row-major kernels (a tail past the last panel, and a row-major weight), at decode and GEMM
// row counts; and each is the unrounded f32 output rounded once.
CPUINFER_TEST(linear_rounded_f32_out_is_the_typed_output) {
    const int64_t C = linear_pack_cols();
    for (DType dt : {DType::bf16, DType::f16}) {
        const int64_t P = linear_pack_pair(dt), N = 3 * C + 5;
        for (int64_t M : {1, 3, 32, 70}) {
            for (int64_t K : {int64_t(64), int64_t(96)}) {
                if (K % P != 0) continue;
                Buffer x(dt, M * K), w(dt, N * K), packed(dt, N * K), bias(dt, N), typed(dt, M * N);
                x.fill_normal(1.f);
                w.fill_normal(1.f / float(K));
                bias.fill_normal(0.5f);
                linear_pack_weight(dt, packed.data(), w.data(), N, K);
                for (bool pk : {false, true}) {
                    const void *wt = pk ? packed.data() : w.data();
                    std::vector<float> wide(size_t(M * N)), out(size_t(M * N), NAN);
                    linear(dt, typed.data(), N, x.data(), K, wt, bias.data(), M, N, K, pk);
                    linear(dt, wide.data(), N, x.data(), K, wt, bias.data(), M, N, K, pk, true);
                    linear(dt, out.data(), N, x.data(), K, wt, bias.data(), M, N, K, pk, true, true);
                    int64_t differ = 0, unrounded = 0;
                    for (int64_t i = 0; i < M * N; ++i) {
                        differ += out[size_t(i)] != typed.get(i) || out[size_t(i)] != round_to(dt, wide[size_t(i)]);
                        unrounded += out[size_t(i)] != wide[size_t(i)];
                    }
                    const std::string what = label(pk ? "rounded f32 packed" : "rounded f32", dt, M, N, K);
                    expect_true(what + " (" + std::to_string(differ) + " differ)", differ == 0);
                    expect_true(what + " rounds", unrounded > 0);
                }
            }
        }
    }
}

// Many rows and a long K: several row chunks (each a bounded number of bytes
// of x), split over threads when there are any, with a tail past the last
// panel; each row alone gives the bits it had in the batch. K = 2048 puts
// bf16 rows 4 KB apart, which the kernel reads through a copy.
CPUINFER_TEST(linear_packed_gemm_row_chunks) {
    const int64_t C = linear_pack_cols();
    for (DType dt : {DType::bf16, DType::f16}) {
        const int64_t M = 150, N = 2 * C + 3, K = 2048;
        Buffer x(dt, M * K), w(dt, N * K), packed(dt, N * K), bias(dt, N), out(dt, M * N), one(dt, N);
        x.fill_normal(1.f);
        w.fill_normal(1.f / float(K));
        bias.fill_normal(0.5f);
        auto want = ref_linear(x, w, &bias, M, N, K);
        linear_pack_weight(dt, packed.data(), w.data(), N, K);
        linear(dt, out.data(), N, x.data(), K, packed.data(), bias.data(), M, N, K, true);
        Tol t = tol_for(dt);
        expect_close(label("linear packed, row chunks", dt, M, N, K), out.to_floats().data(), want.data(), M * N,
                     t.atol + 1e-5 * double(K), t.rtol);
        bool same = true;
        for (int64_t m : {int64_t(0), int64_t(47), int64_t(48), int64_t(149)}) {
            Buffer xm(dt, K);
            for (int64_t k = 0; k < K; ++k) xm.set(k, x.get(m * K + k));
            linear(dt, one.data(), N, xm.data(), K, packed.data(), bias.data(), 1, N, K, true);
            for (int64_t n = 0; n < N; ++n) same = same && one.get(n) == out.get(m * N + n);
        }
        expect_true(label("packed rows independent of the batch, row chunks", dt, M, N, K), same);
    }
}

// act(g) * u in double, g and u rounded to dt first (the GEMM's output).
static double ref_glu(Activation act, DType dt, double g, double u) {
    g = round_to(dt, g), u = round_to(dt, u);
    switch (act) {
        case Activation::silu: return g / (1.0 + std::exp(-g)) * u;
        case Activation::gelu: return 0.5 * g * (1.0 + std::erf(g / std::sqrt(2.0))) * u;
        default: return 0.5 * g * (1.0 + std::tanh(0.7978845608028654 * (g + 0.044715 * g * g * g))) * u;
    }
}

// The gated MLP's fused gate/up epilogue gives, bit for bit, the packed GEMM
// into [M, 2I] followed by act_and_mul, on every variant's tile (the register
// tiles' pair lane order included): every activation, with and without a
// bias, across the GEMV / GEMM boundary and several row chunks; and both are
// within the type's tolerance of the activation applied in double to a
// double-precision GEMM.
CPUINFER_TEST(linear_glu_is_linear_then_act_and_mul) {
    const int64_t C = linear_pack_cols(), I = 3 * C, N = 2 * I;
    for (DType dt : {DType::bf16, DType::f16}) {
        const std::vector<int64_t> Ms = reduced() ? std::vector<int64_t>{1, 3, 17}
                                                  : std::vector<int64_t>{1, 2, 3, 7, 17, 40, 131};
        for (int64_t M : Ms) {
            for (int64_t K : {64, 70}) {
                if (K % linear_pack_pair(dt) != 0) continue;
                Buffer x(dt, M * K), w(dt, N * K), packed(dt, N * K), bias(dt, N), both(dt, M * N);
                x.fill_normal(1.f);
                w.fill_normal(2.f / float(K));
                bias.fill_normal(0.5f);
                linear_pack_weight(dt, packed.data(), w.data(), N, K);
                for (Activation act : {Activation::silu, Activation::gelu, Activation::gelu_tanh}) {
                    for (bool with_bias : {false, true}) {
                        const void *b = with_bias ? bias.data() : nullptr;
                        Buffer want(dt, M * I), got(dt, M * I);
                        linear(dt, both.data(), N, x.data(), K, packed.data(), b, M, N, K, true);
                        act_and_mul(dt, act, want.data(), I, both.data(), N, M, I);
                        linear_glu(dt, act, got.data(), I, x.data(), K, packed.data(), b, M, I, K);
                        int64_t differ = 0;
                        for (int64_t i = 0; i < M * I; ++i) differ += got.half[size_t(i)] != want.half[size_t(i)];
                        const std::string what = label("linear_glu", dt, M, N, K) + " act " +
                                                 std::to_string(int(act)) + (with_bias ? " bias" : "");
                        expect_true(what + " = linear + act_and_mul (" + std::to_string(differ) + " differ)",
                                    differ == 0);
                        const auto lin = ref_linear(x, w, with_bias ? &bias : nullptr, M, N, K);
                        std::vector<double> want64(size_t(M * I));
                        for (int64_t m = 0; m < M; ++m)
                            for (int64_t i = 0; i < I; ++i)
                                want64[size_t(m * I + i)] =
                                    ref_glu(act, dt, lin[size_t(m * N + i)], lin[size_t(m * N + I + i)]);
                        Tol t = tol_for(dt);
                        expect_close(what + " against double", got.to_floats().data(), want64.data(), M * I,
                                     2 * t.atol, 2 * t.rtol);
                    }
                }
            }
        }
    }
}
