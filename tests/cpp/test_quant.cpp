// The quantized linear layer (quant_pack / quant_linear, kernels.h) and its
// register tile (common/quant_tile.h), on every variant:
// - the variant's tile (quant::Tile, the ISA hook's) gives the portable
//   tile's bits (quant::QuantTile) for every value width, form, group and
//   row count, on random and on extreme values (the largest int32 sums);
// - a row's result does not depend on how many rows share the tile or the call;
// - quant_linear gives, bit for bit, the portable tile on x quantized as
//   quant_tile.h documents, so every variant gives the same bits;
// - and it matches a double-precision reference of the dequantized weight
//   within the int8 rounding of x (stated in check_linear).
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "common/kernels.h"
#include "common/quant_tile.h"
#include "harness.h"

using namespace cpuinfer;
using namespace cpuinfer::test;

namespace {

using quant::kBlock;
using quant::kLanes;

// A weight format: value bits, group, and zero points or minimums (group 16: zero points, Q6_K-style);
// fp4: MXFP4 (4-bit E2M1 codes, E8M0 exponents in z, no d; quant_tile.h).
struct Form {
    int bits;
    int64_t group;
    bool min;
    bool fp4 = false;
};
// 5 and 6 bits: the forms GGUF brings (Q5_0 zero points, Q5_1 / Q5_K minimums, Q6_K group 16).
const Form kForms[] = {{4, 32, false}, {4, 64, false}, {4, 128, false}, {4, 32, true},  {4, 64, true},
                       {4, 128, true}, {4, 16, false}, {5, 32, false},  {5, 128, false}, {5, 32, true},
                       {5, 64, true},  {6, 16, false}, {8, 32, false},  {8, 64, false},  {8, 128, false},
                       {8, 32, true},  {8, 64, true},  {8, 128, true},  {8, 16, false},  {4, 32, false, true}};

std::string label(const char *what, const Form &f, int64_t m, int64_t n, int64_t k) {
    return std::string(what) + (f.fp4 ? " mxfp4" : " q" + std::to_string(f.bits)) + (f.min ? " min" : " zero") + " group " +
           std::to_string(f.group) + " M=" + std::to_string(m) + " N=" + std::to_string(n) + " K=" + std::to_string(k);
}

// A random quantized weight [N, K]: one value per byte with per-row group parameters, and the
// packed panels quant_pack makes of them. Extreme: values, zero points and scales at their ends.
struct Weight {
    Form form;
    int64_t N, K, groups;
    std::vector<uint8_t> u, z, qs, zp;
    std::vector<f16_t> d, m, dp, mp;
    QuantMatrix mat;

    Weight(Form f, int64_t n, int64_t k, bool extreme) : form(f), N(n), K(k), groups(k / f.group) {
        const int top = (1 << f.bits) - 1;
        std::uniform_int_distribution<int> val(0, top), coin(0, 1);
        auto value = [&] { return uint8_t(extreme ? top * coin(rng()) : val(rng())); };
        u.resize(size_t(N * K));
        for (auto &v : u) v = value();
        // Extreme scales and minimums include f16 subnormals (the tiles widen f16 in their own ways).
        std::uniform_int_distribution<int> sub(1, 0x3ff), quarter(0, 3);
        auto f16 = [&](float v) { return extreme && quarter(rng()) == 0 ? f16_t{uint16_t(sub(rng()) | (coin(rng()) << 15))}
                                                                         : from_f32<f16_t>(v); };
        d.resize(size_t(N * groups));
        for (auto &v : d) v = f16((coin(rng()) ? 1.0f : -1.0f) * uniform(0.5f, 2.0f) / float(top + 1));
        if (f.min) {
            m.resize(d.size());
            for (auto &v : m) v = f16(uniform(-1.0f, 1.0f));
        } else if (f.fp4) {  // exponents: around 1 (2^-28 .. 2^22), extreme ones at both ends of the accepted 2..254
            z.resize(d.size());
            std::uniform_int_distribution<int> e(100, 150), pick(0, 3);
            const uint8_t ends[4] = {2, 50, 128, 200};
            for (auto &v : z) v = uint8_t(extreme ? ends[pick(rng())] : e(rng()));
            if (extreme)  // the codes of the largest magnitudes, +6 and -6 (u = 24 and 0)
                for (auto &v : u) v = coin(rng()) ? 7 : 15;
        } else {
            z.resize(d.size());
            for (auto &v : z) v = value();
        }
        const int64_t panels = quant_panels(N), blocks = K / kBlock;
        qs.resize(size_t(panels * blocks * quant::block_bytes(f.bits)));
        dp.resize(size_t(panels * groups * kLanes));
        if (f.min) mp.resize(dp.size());
        else zp.resize(dp.size());
        mat.bits = f.bits;
        mat.group = f.group;
        mat.N = N;
        mat.K = K;
        mat.fp4 = f.fp4;
        quant_pack(mat, u.data(), f.fp4 ? nullptr : d.data(), f.min ? nullptr : z.data(), f.min ? m.data() : nullptr,
                   qs.data(), f.fp4 ? nullptr : dp.data(), f.min ? nullptr : zp.data(), f.min ? mp.data() : nullptr);
        mat.qs = qs.data();
        mat.d = f.fp4 ? nullptr : dp.data();
        mat.z = f.min ? nullptr : zp.data();
        mat.m = f.min ? mp.data() : nullptr;
    }

    // The dequantized weight [N, K], in double.
    std::vector<double> dequantized() const {
        std::vector<double> w(size_t(N * K));
        for (int64_t n = 0; n < N; ++n)
            for (int64_t k = 0; k < K; ++k) {
                const size_t g = size_t(n * groups + k / form.group);
                if (form.fp4) {  // OCP MXFP4: E2M1 value (sign bit 3) times 2^(e - 127)
                    static const double kE2M1[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
                    const uint8_t c = u[size_t(n * K + k)];
                    w[size_t(n * K + k)] = (c & 8 ? -1.0 : 1.0) * kE2M1[c & 7] * std::ldexp(1.0, int(z[g]) - 127);
                    continue;
                }
                const double dd = to_f32(d[g]), uu = u[size_t(n * K + k)];
                w[size_t(n * K + k)] = form.min ? dd * uu + double(to_f32(m[g])) : dd * (uu - double(z[g]));
            }
        return w;
    }

    quant::QuantPanel panel(int64_t p) const {
        const int64_t blocks = K / kBlock, at = p * groups * kLanes;
        return {mat.qs + p * blocks * quant::block_bytes(form.bits), mat.d + at, mat.z ? mat.z + at : nullptr,
                mat.m ? mat.m + at : nullptr, blocks, form.group >= kBlock ? form.group / kBlock : 0};
    }
};

// Activation rows as the tile reads them (quant_tile.h): int8 values per block of 32 k with
// their scale dx, dx * sum, and the sum of each 16-k half.
struct Rows {
    int64_t M, K, nb;
    std::vector<int8_t> q;
    std::vector<float> dx, sx;
    std::vector<int32_t> s16;

    Rows(int64_t m, int64_t k) : M(m), K(k), nb(k / kBlock), q(size_t(m * k)), dx(size_t(m * nb)), sx(dx.size()),
                                 s16(size_t(2 * m * nb)) {}
    // Fills sx and s16 from q and dx.
    void sums() {
        for (int64_t r = 0; r < M; ++r)
            for (int64_t b = 0; b < nb; ++b) {
                int32_t h[2] = {0, 0};
                for (int k = 0; k < kBlock; ++k) h[k / 16] += q[size_t(r * K + b * kBlock + k)];
                s16[size_t(2 * (r * nb + b))] = h[0];
                s16[size_t(2 * (r * nb + b) + 1)] = h[1];
                sx[size_t(r * nb + b)] = dx[size_t(r * nb + b)] * float(h[0] + h[1]);
            }
    }
    quant::QuantRows view(int64_t r0) const {
        return {q.data() + r0 * K, dx.data() + r0 * nb, sx.data() + r0 * nb, s16.data() + 2 * r0 * nb, K, nb};
    }
};

// x [M, K] quantized as quant_tile.h documents (llama.cpp's q8 activations): per block of 32,
// dx = amax / 127, q = round-to-nearest-even(x / dx) (through the reciprocal), within +-127.
Rows quantize(const std::vector<float> &x, int64_t M, int64_t K) {
    Rows rows(M, K);
    for (int64_t r = 0; r < M; ++r)
        for (int64_t b = 0; b < rows.nb; ++b) {
            const float *xb = x.data() + r * K + b * kBlock;
            float amax = 0.0f;
            for (int k = 0; k < kBlock; ++k) amax = std::max(amax, std::fabs(xb[k]));
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            for (int k = 0; k < kBlock; ++k)
                rows.q[size_t(r * K + b * kBlock + k)] =
                    int8_t(std::min(127.0f, std::max(-127.0f, std::nearbyint(xb[k] * id))));
            rows.dx[size_t(r * rows.nb + b)] = d;
        }
    rows.sums();
    return rows;
}

// Random int8 rows; extreme: every value +-127 (with the weight's extremes, the largest sums).
Rows random_rows(int64_t M, int64_t K, bool extreme) {
    Rows rows(M, K);
    std::uniform_int_distribution<int> val(-127, 127), coin(0, 1);
    for (auto &v : rows.q) v = int8_t(extreme ? (coin(rng()) ? 127 : -127) : val(rng()));
    for (auto &v : rows.dx) v = uniform(0.001f, 0.05f);
    rows.sums();
    return rows;
}

bool same_bits(const float *a, const float *b, int64_t n) { return std::memcmp(a, b, size_t(n) * sizeof(float)) == 0; }

// Calls f(Tile, Portable) with the variant's and the portable tile types for the form.
template <typename F>
void with_tiles(const Form &form, F &&f) {
    auto go = [&](auto bits, auto min, auto g16) {
        constexpr int B = decltype(bits)::value;
        constexpr bool Mn = decltype(min)::value, G = decltype(g16)::value;
        f(quant::Tile<B, Mn, G>{}, quant::QuantTile<B, Mn, G>{});
    };
    using std::integral_constant;
    using T = integral_constant<bool, true>;
    using Fa = integral_constant<bool, false>;
    if (form.fp4) {
        f(quant::Tile<4, false, false, true>{}, quant::QuantTile<4, false, false, true>{});
    } else if (form.bits == 4) {
        if (form.group == 16) go(integral_constant<int, 4>{}, Fa{}, T{});
        else if (form.min) go(integral_constant<int, 4>{}, T{}, Fa{});
        else go(integral_constant<int, 4>{}, Fa{}, Fa{});
    } else if (form.bits == 5) {
        if (form.min) go(integral_constant<int, 5>{}, T{}, Fa{});
        else go(integral_constant<int, 5>{}, Fa{}, Fa{});
    } else if (form.bits == 6) {
        go(integral_constant<int, 6>{}, Fa{}, T{});
    } else {
        if (form.group == 16) go(integral_constant<int, 8>{}, Fa{}, T{});
        else if (form.min) go(integral_constant<int, 8>{}, T{}, Fa{});
        else go(integral_constant<int, 8>{}, Fa{}, Fa{});
    }
}

int max_rows(const Form &form) {
    int mr = 0;
    with_tiles(form, [&](auto tile, auto) { mr = decltype(tile)::kMaxRows; });
    return mr;
}

// The variant's tile against the portable one, for every row count 1..kMaxRows at the start and
// the end of the rows, on every panel; and each row as it is when alone in the tile.
void check_tile(const Form &form, const Weight &w, const Rows &x, const std::string &what) {
    with_tiles(form, [&](auto tile, auto portable) {
        using Tile = decltype(tile);
        using Portable = decltype(portable);
        bool same = true, alone = true;
        alignas(64) float got[16 * kLanes], want[16 * kLanes], one[kLanes];
        Tile::begin();  // as the driver does: AMX tiles need their configuration (and the OS's grant) first
        for (int64_t p = 0; p < quant_panels(w.N); ++p) {
            const quant::QuantPanel wp = w.panel(p);
            for (int mr = 1; mr <= Tile::kMaxRows && mr <= x.M; ++mr) {
                for (int64_t r0 : {int64_t(0), x.M - mr}) {
                    Tile::run(mr, x.view(r0), wp, got);
                    Portable::run(mr, x.view(r0), wp, want);
                    same = same && same_bits(got, want, mr * kLanes);
                    for (int r = 0; r < mr; ++r) {
                        Tile::run(1, x.view(r0 + r), wp, one);
                        alone = alone && same_bits(one, got + r * kLanes, kLanes);
                    }
                }
            }
        }
        Tile::end();
        expect_true(what + ": " + Tile::kName + " tile gives the portable tile's bits", same);
        expect_true(what + ": " + Tile::kName + " tile rows independent of the tile's row count", alone);
    });
}

// quant_linear (f32, with bias) on [M, K] x: the portable tile's bits on documented quantization
// (so the same on every variant, and each row as alone), and (reference) the double reference
// within the bound below. (The double loops are most of this test's time under qemu.)
void check_linear(const Form &form, const Weight &w, int64_t M, bool reference, const std::string &what) {
    const int64_t N = w.N, K = w.K;
    std::vector<float> x(static_cast<size_t>(M * K)), bias(static_cast<size_t>(N)), out(static_cast<size_t>(M * N), -1.0f);
    for (int64_t r = 0; r < M; ++r) {
        const float row_scale = std::ldexp(1.0f, int(r % 7) - 3);  // rows of different magnitudes
        for (int64_t k = 0; k < K; ++k) x[size_t(r * K + k)] = row_scale * normal();
    }
    if (M > 2) std::fill(x.begin() + K, x.begin() + K + kBlock, 0.0f);  // a block of zeros (dx = 0)
    for (auto &v : bias) v = normal();
    quant_linear(DType::f32, out.data(), N, x.data(), K, w.mat, bias.data(), M);

    const Rows xq = quantize(x, M, K);
    bool same = true;
    with_tiles(form, [&](auto, auto portable) {
        alignas(64) float acc[kLanes];
        for (int64_t p = 0; p < quant_panels(N); ++p)
            for (int64_t r = 0; r < M; ++r) {
                decltype(portable)::run(1, xq.view(r), w.panel(p), acc);
                for (int64_t f = 0; f < kLanes && p * kLanes + f < N; ++f) {
                    const float want = acc[f] + bias[size_t(p * kLanes + f)];
                    same = same && std::memcmp(&want, &out[size_t(r * N + p * kLanes + f)], sizeof(float)) == 0;
                }
            }
    });
    expect_true(what + ": quant_linear gives the portable tile's bits, each row as alone", same);
    if (!reference) return;

    // |quant_linear - exact| for one output is within x's int8 rounding (at most half a step dx of
    // its block, with slack for the reciprocal) times |w|, plus f32 rounding of the per-block terms
    // and their sum (1e-5 of the sum of |w x|); the integer dot products are exact.
    const std::vector<double> wd = w.dequantized();
    int64_t bad = 0, first = -1;
    double worst = 0.0;
    for (int64_t r = 0; r < M; ++r)
        for (int64_t n = 0; n < N; ++n) {
            double exact = bias[size_t(n)], rounding = 0.0, magnitude = 0.0;
            for (int64_t k = 0; k < K; ++k) {
                const double wk = wd[size_t(n * K + k)], xk = x[size_t(r * K + k)];
                exact += wk * xk;
                rounding += std::fabs(wk) * 0.5001 * xq.dx[size_t(r * xq.nb + k / kBlock)];
                magnitude += std::fabs(wk * xk);
            }
            const double err = std::fabs(double(out[size_t(r * N + n)]) - exact);
            if (!(err <= rounding + 1e-5 * magnitude + 1e-30)) {
                if (first < 0) first = r * N + n;
                ++bad;
                worst = std::max(worst, err);
            }
        }
    expect_true(what + ": quant_linear within the int8 rounding of x of the reference (" + std::to_string(bad) +
                    " outside, first " + std::to_string(first) + ", worst " + std::to_string(worst) + ")",
                bad == 0);
}

}  // namespace

CPUINFER_TEST(quant_tile_is_the_variants) {
    // Which tile each variant's ISA hook brings (cmake/isa_table.json, vec_layers "quant").
    const std::string variant = CPUINFER_TEST_VARIANT, name = quant_tile_impl();
    const char *expected = nullptr;
    const std::pair<const char *, const char *> table[] = {
        {"generic", "portable"},       {"avx2", "avx2"},         {"avx512", "avx2"},
        {"avx512bf16", "avx512vnni"},  {"amx", "amx-int8"},      {"neon", "neon_dotprod"},
        {"apple_m1", "neon_dotprod"},  {"neon_bf16", "neon_i8mm"}, {"apple_m2", "neon_i8mm"},
        {"sve", "sve_dotprod"},        {"vxe", "vxe"},           {"vxe2", "vxe"}};
    for (const auto &[v, t] : table)
        if (variant == v) expected = t;
    expect_true("quant_tile_impl() is this build's Tile", name == quant::Tile<4, false, false>::kName);
    if (expected) expect_true("variant " + variant + " runs the " + expected + " tile, not " + name, name == expected);
}

CPUINFER_TEST(quant_tile_matches_portable_bits) {
    for (const Form &form : kForms) {
        const int mr = max_rows(form);
        for (int64_t K : {std::max<int64_t>(kBlock, form.group), int64_t(384)}) {
            for (bool extreme : {false, true}) {
                const int64_t N = 37, M = mr + 3;  // 3 panels, the last with 5 features
                const Weight w(form, N, K, extreme);
                const Rows x = random_rows(M, K, extreme);
                check_tile(form, w, x, label(extreme ? "extreme values" : "random values", form, M, N, K));
            }
        }
    }
}

CPUINFER_TEST(quant_linear_matches_reference_and_portable) {
    for (const Form &form : kForms) {
        const int mr = max_rows(form);
        for (int64_t N : {int64_t(1), int64_t(37)}) {
            const int64_t K = 384;
            const Weight w(form, N, K, false);
            // Row counts around the tile's; the reference on the largest (its rows have the others' sizes).
            for (int64_t M : {int64_t(1), int64_t(2), int64_t(3), int64_t(mr), int64_t(mr + 1), int64_t(2 * mr + 3)})
                check_linear(form, w, M, M == 2 * mr + 3, label("quant_linear", form, M, N, K));
        }
    }
}

CPUINFER_TEST(mxfp4_is_the_zero_point_form_bit_for_bit) {
    // MXFP4 (fp4) against the same weight in the 5-bit zero-point form the kernels ran it in before (u = 2 *
    // value + 12, zero point 12, an f16 scale 2^(e - 128)): the same integers and f32 steps, so the same bits,
    // on every variant and row count.
    const int64_t N = 37, K = 384;
    Weight w(Form{4, 32, false, true}, N, K, false);
    std::uniform_int_distribution<int> e(104, 143);  // scales float16 holds exactly: 2^-24 .. 2^15
    for (auto &v : w.z) v = uint8_t(e(rng()));
    quant_pack(w.mat, w.u.data(), nullptr, w.z.data(), nullptr, w.qs.data(), nullptr, w.zp.data(), nullptr);
    Weight five(Form{5, 32, false}, N, K, false);
    for (size_t i = 0; i < five.u.size(); ++i) five.u[i] = quant::kFp4U[w.u[i]];
    for (size_t g = 0; g < five.d.size(); ++g) {
        five.d[g] = from_f32<f16_t>(std::ldexp(1.0f, int(w.z[g]) - 128));
        five.z[g] = uint8_t(quant::kFp4Zero);
    }
    quant_pack(five.mat, five.u.data(), five.d.data(), five.z.data(), nullptr, five.qs.data(), five.dp.data(),
               five.zp.data(), nullptr);
    for (int64_t M : {int64_t(1), int64_t(3), int64_t(20)}) {
        std::vector<float> x(size_t(M * K)), a(size_t(M * N)), b(size_t(M * N));
        for (auto &v : x) v = normal();
        quant_linear(DType::f32, a.data(), N, x.data(), K, w.mat, nullptr, M);
        quant_linear(DType::f32, b.data(), N, x.data(), K, five.mat, nullptr, M);
        expect_true("mxfp4 M=" + std::to_string(M) + ": the 5-bit zero-point form's bits", same_bits(a.data(), b.data(), M * N));
    }
}

CPUINFER_TEST(quant_linear_row_chunks) {
    // Enough rows of a long K that the x rows are split into chunks (linear_quant.cpp's kChunkBytes).
    for (const Form &form : {Form{4, 32, true}, Form{8, 16, false}}) {
        const int64_t N = 21, K = 4096, M = 67;
        const Weight w(form, N, K, false);
        check_linear(form, w, M, true, label("quant_linear, row chunks", form, M, N, K));
    }
}

CPUINFER_TEST(quant_linear_act16_matches_reference_and_is_batch_invariant) {
    // Weight-only formats (QuantMatrix::act16, common/quant_wide.h): bf16 x as it is (the x86 bf16 tile where
    // the variant has one, else the portable f32 one), f32 out. Within f32 accumulation of the double
    // reference (1e-5 of the sum of |w x|: no int8 rounding of x), and each row's bits as when alone.
    for (const Form &form : kForms) {
        if (form.bits == 5 || form.bits == 6 || form.group < kBlock || form.fp4) continue;  // no act16 tile for these
        const int64_t N = 37, K = 384, M = 20;
        Weight w(form, N, K, false);
        w.mat.act16 = true;
        std::vector<bf16_t> x(size_t(M * K));
        for (auto &v : x) v = from_f32<bf16_t>(normal());
        std::vector<float> out(static_cast<size_t>(M * N)), one(static_cast<size_t>(N));
        quant_linear(DType::bf16, out.data(), N, x.data(), K, w.mat, nullptr, M, true);
        const std::vector<double> wd = w.dequantized();
        int64_t bad = 0;
        bool same = true;
        for (int64_t r = 0; r < M; ++r) {
            quant_linear(DType::bf16, one.data(), N, x.data() + r * K, K, w.mat, nullptr, 1, true);
            same = same && std::memcmp(one.data(), out.data() + r * N, size_t(N) * sizeof(float)) == 0;
            for (int64_t n = 0; n < N; ++n) {
                double exact = 0.0, magnitude = 0.0;
                for (int64_t k = 0; k < K; ++k) {
                    const double p = wd[size_t(n * K + k)] * double(to_f32(x[size_t(r * K + k)]));
                    exact += p;
                    magnitude += std::fabs(p);
                }
                bad += !(std::fabs(double(out[size_t(r * N + n)]) - exact) <= 1e-5 * magnitude + 1e-30);
            }
        }
        const std::string what = label("quant_linear act16", form, M, N, K);
        expect_true(what + ": within f32 accumulation of the reference (" + std::to_string(bad) + " outside)", bad == 0);
        expect_true(what + ": each row's bits as when alone", same);
    }
}
