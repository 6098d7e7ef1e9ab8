// A tiny test harness for the C++ kernel core: no framework to download, so
// the same program cross-compiles for every architecture and runs under qemu.
//
//   CPUINFER_TEST(name) { ... expect_close(...); }   registers a test case
//   Buffer<T>                                         typed storage + f32 view
//   expect_close / expect_true                        record failures (a case
//                                                     fails if any check fails)
// main() (harness.cpp) runs every case, prints "N passed, N failed" and exits
// nonzero on failure. Add a kernel family by adding a test_<family>.cpp.
#pragma once
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"

namespace cpuinfer::test {

using TestFn = void (*)();
struct Registrar {
    Registrar(const char *name, TestFn fn);
};

#define CPUINFER_TEST(name)                                                              \
    static void name();                                                                  \
    static ::cpuinfer::test::Registrar name##_registrar(#name, name);                    \
    static void name()

// Records one failed check of the running case (the first few are printed).
void fail(const std::string &message);

// |actual - expected| <= atol + rtol * |expected|, NaN only matches NaN.
bool close(double actual, double expected, double atol, double rtol);

// Compares n values; `what` names the check in the failure message.
void expect_close(const std::string &what, const float *actual, const double *expected, int64_t n, double atol,
                  double rtol);
void expect_true(const std::string &what, bool ok);

// Tolerances per element type: the kernels compute in f32 and round once to
// the output type, so the error is about one rounding step of that type.
struct Tol {
    double atol, rtol;
};
inline Tol tol_for(DType dt) {
    switch (dt) {
        case DType::bf16: return {1e-2, 8e-3};
        case DType::f16: return {1e-3, 1e-3};
        default: return {1e-5, 1e-5};
    }
}
inline const char *dtype_name(DType dt) {
    switch (dt) {
        case DType::bf16: return "bf16";
        case DType::f16: return "f16";
        case DType::f32: return "f32";
        default: return "?";
    }
}
constexpr DType kFloatTypes[] = {DType::f32, DType::bf16, DType::f16};

std::mt19937 &rng();

// CPUINFER_TEST_REDUCED=1: the costliest cases (the attention matrices, and the linear ones, whose panels
// are two vectors wide) run fewer and smaller shapes, every kernel path they cross still crossed. Set for SVE
// at 256 and 2048 bits under qemu (tests/cpp/CMakeLists.txt): there each program took 4.5-7 minutes (the
// attention cases ~10x their time at 128 bits, the linear ones growing with the panel width), where the full
// shapes run at 128 bits and natively.
bool reduced();

// Random floats for test data, drawn from rng() directly. Not through
// std::uniform_real_distribution or std::normal_distribution: both call
// std::generate_canonical, which libstdc++ writes with a long double log of
// the generator's range; GCC folds it, clang does not, and on aarch64 long
// double is IEEE quad in software, so under clang every number cost a soft-float
// logl (the Apple programs' attention tests ran 10x GCC's time under qemu).
float uniform(float lo = 0.f, float hi = 1.f);  // [lo, hi)
float normal(float mean = 0.f, float sd = 1.f);  // Box-Muller

// Storage for n elements of a runtime dtype, filled and read through f32.
struct Buffer {
    DType dt;
    std::vector<uint16_t> half;  // bf16 / f16 bits
    std::vector<float> f32;

    Buffer(DType dt, int64_t n) : dt(dt) {
        if (dt == DType::f32) f32.assign(size_t(n), 0.f); else half.assign(size_t(n), 0);
    }
    int64_t size() const { return dt == DType::f32 ? int64_t(f32.size()) : int64_t(half.size()); }
    void *data() { return dt == DType::f32 ? static_cast<void *>(f32.data()) : static_cast<void *>(half.data()); }
    float get(int64_t i) const {
        if (dt == DType::f32) return f32[size_t(i)];
        return dt == DType::bf16 ? to_f32(bf16_t{half[size_t(i)]}) : to_f32(f16_t{half[size_t(i)]});
    }
    // Stores x rounded to the element type (so references see the same input).
    void set(int64_t i, float x) {
        if (dt == DType::f32) f32[size_t(i)] = x;
        else if (dt == DType::bf16) half[size_t(i)] = f32_to_bf16_bits(x);
        else half[size_t(i)] = f32_to_half_bits(x);
    }
    void fill_normal(float scale = 1.f, float mean = 0.f) {
        for (int64_t i = 0; i < size(); ++i) set(i, normal(mean, scale));
    }
    std::vector<float> to_floats() const {
        std::vector<float> v(static_cast<size_t>(size()));
        for (int64_t i = 0; i < size(); ++i) v[size_t(i)] = get(i);
        return v;
    }
};

// Rounds a double to dt and back (what storing a result in dt does).
inline double round_to(DType dt, double x) {
    Buffer b(dt, 1);
    b.set(0, float(x));
    return b.get(0);
}

}  // namespace cpuinfer::test
