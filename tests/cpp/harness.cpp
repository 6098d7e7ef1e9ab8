// Runs every registered case of the kernel test program (see harness.h).
#include "harness.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "common/kernels.h"

extern "C" const char *cpuinfer_probe_features(void);
extern "C" const char *cpuinfer_probe_arch(void);

namespace cpuinfer::test {
namespace {

struct Case {
    const char *name;
    TestFn fn;
};
std::vector<Case> &registry() {
    static std::vector<Case> cases;
    return cases;
}
int g_failures_in_case = 0;
const char *g_case = "";

// The features this variant was compiled for (from cmake/isa_table.json);
// returns the ones this CPU lacks, so a variant it cannot run is skipped
// instead of dying of SIGILL.
std::vector<std::string> missing_features() {
    std::vector<std::string> missing;
#if !defined(CPUINFER_TEST_SKIP_CPU_CHECK)
    std::string have = std::string(cpuinfer_probe_features()) + ";";
    std::stringstream need(CPUINFER_TEST_FEATURES);
    std::string f;
    while (std::getline(need, f, ',')) {
        if (!f.empty() && have.find(";" + f + ";") == std::string::npos) missing.push_back(f);
    }
#endif
    return missing;
}

}  // namespace

Registrar::Registrar(const char *name, TestFn fn) { registry().push_back({name, fn}); }

bool reduced() {
    static const bool on = [] {
        const char *v = std::getenv("CPUINFER_TEST_REDUCED");
        return v && std::strcmp(v, "1") == 0;
    }();
    return on;
}

std::mt19937 &rng() {
    static std::mt19937 gen(1234);
    return gen;
}

float uniform(float lo, float hi) {
    const float u = float(rng()() >> 8) * 0x1p-24f;  // 24 random bits: every value exact, in [0, 1)
    return lo + (hi - lo) * u;
}

float normal(float mean, float sd) {
    const double u1 = 1.0 - double(uniform()), u2 = double(uniform());  // u1 in (0, 1]: log finite
    return mean + sd * float(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

void fail(const std::string &message) {
    if (++g_failures_in_case <= 5) std::printf("  FAIL %s: %s\n", g_case, message.c_str());
}

bool close(double actual, double expected, double atol, double rtol) {
    if (std::isnan(expected) || std::isnan(actual)) return std::isnan(expected) && std::isnan(actual);
    if (std::isinf(expected)) return actual == expected;
    return std::fabs(actual - expected) <= atol + rtol * std::fabs(expected);
}

void expect_close(const std::string &what, const float *actual, const double *expected, int64_t n, double atol,
                  double rtol) {
    int64_t bad = 0, first = -1;
    double worst = 0;
    for (int64_t i = 0; i < n; ++i) {
        if (!close(actual[i], expected[i], atol, rtol)) {
            if (first < 0) first = i;
            ++bad;
            worst = std::max(worst, std::fabs(actual[i] - expected[i]));
        }
    }
    if (bad) {
        char msg[256];
        std::snprintf(msg, sizeof msg, "%lld of %lld values differ (first at %lld: got %.8g, want %.8g; worst abs %.3g)",
                      (long long)bad, (long long)n, (long long)first, actual[first], expected[first], worst);
        fail(what + ": " + msg);
    }
}

void expect_true(const std::string &what, bool ok) {
    if (!ok) fail(what);
}

}  // namespace cpuinfer::test

int main(int argc, char **argv) {
    using namespace cpuinfer::test;
    std::printf("cpuinfer kernel tests: variant %s, vector layer %s (%d f32 lanes), cpu %s\n", CPUINFER_TEST_VARIANT,
                cpuinfer::vector_layer(), cpuinfer::vector_width(), cpuinfer_probe_arch());
    std::vector<std::string> missing = missing_features();
    // CPUINFER_TEST_IGNORE_CPU=1: run anyway (an emulator that implements
    // instructions it does not advertise in its hwcaps, e.g. qemu-s390x 7.2 and vxe2).
    const char *ignore = std::getenv("CPUINFER_TEST_IGNORE_CPU");
    if (!missing.empty() && ignore && std::strcmp(ignore, "1") == 0) {
        std::printf("note: CPU lacks some features of this variant; running anyway (CPUINFER_TEST_IGNORE_CPU=1)\n");
        missing.clear();
    }
    // CPUINFER_TEST_REQUIRE_CPU=1: a variant this CPU cannot run fails instead of
    // being skipped (the cross-arch runs under qemu -cpu max expect to run all).
    const char *require = std::getenv("CPUINFER_TEST_REQUIRE_CPU");
    if (!missing.empty()) {
        std::string m;
        for (auto &f : missing) m += " " + f;
        std::printf("SKIPPED: this CPU lacks%s\n", m.c_str());
        if (require && std::strcmp(require, "1") == 0) return 1;
        return 77;  // ctest SKIP_RETURN_CODE
    }
    const char *filter = argc > 1 ? argv[1] : nullptr;
    int passed = 0, failed = 0;
    for (const auto &c : registry()) {
        if (filter && !std::strstr(c.name, filter)) continue;
        g_case = c.name;
        g_failures_in_case = 0;
        const auto t0 = std::chrono::steady_clock::now();
        c.fn();
        // Each case's seconds: what an emulated run (qemu, SIMDe) spends where, for sizing CI's cross session.
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (g_failures_in_case) {
            ++failed;
            std::printf("FAILED %s (%d checks, %.2f s)\n", c.name, g_failures_in_case, s);
        } else {
            ++passed;
            std::printf("ok %s (%.2f s)\n", c.name, s);
        }
        std::fflush(stdout);
    }
    std::printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
