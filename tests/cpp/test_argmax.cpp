// argmax_rows against a scalar scan with torch.argmax's rule: the first index
// of the maximum, or of the first NaN. Run on every variant (its vector
// layer's max, add and reductions), under qemu and SIMDe too.
#include <cmath>
#include <limits>
#include <string>

#include "common/kernels.h"
#include "harness.h"

using namespace cpuinfer;
using namespace cpuinfer::test;

namespace {

int64_t ref_argmax(const Buffer &b, int64_t off, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 0; i < n; ++i) {
        const float v = b.get(off + i), m = b.get(off + best);
        if (std::isnan(v)) return i;
        if (v > m) best = i;
    }
    return best;
}

void check(const Buffer &b, int64_t rows, int64_t cols, int64_t stride, const std::string &what) {
    std::vector<int64_t> out(size_t(rows), -7);
    argmax_rows(b.dt, out.data(), const_cast<Buffer &>(b).data(), stride, rows, cols);
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t want = ref_argmax(b, r * stride, cols);
        if (out[size_t(r)] != want)
            fail(what + " row " + std::to_string(r) + ": " + std::to_string(out[size_t(r)]) + ", want " +
                 std::to_string(want));
    }
}

}  // namespace

CPUINFER_TEST(argmax_is_torchs_first_maximum_or_first_nan) {
    const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
    for (DType dt : kFloatTypes) {
        for (int64_t cols : {1, 3, 16, 17, 511, 512, 513, 1031, 4099}) {
            const int64_t rows = 10, stride = cols + 5;  // rows apart by more than their length
            Buffer b(dt, rows * stride);
            b.fill_normal();
            const float top = 1000.f;
            auto at = [&](int64_t r, int64_t i, float v) {
                if (i < cols) b.set(r * stride + i, v);
            };
            at(1, cols / 2, top), at(1, cols - 1, top);  // a tie: the first
            at(2, 0, top), at(2, cols - 1, top);
            for (int64_t i = 0; i < cols; ++i) b.set(3 * stride + i, -inf);  // all -inf: 0
            at(4, cols - 1, nan), at(4, 0, inf);                              // a NaN wins
            at(5, cols / 3, nan), at(5, cols - 1, nan);                       // the first NaN
            at(6, 0, -inf), at(6, cols - 1, inf);                             // inf and -inf in one row
            at(7, 511, top), at(7, 512, top);                                 // a tie across a block edge
            for (int64_t i = 0; i < cols; ++i) b.set(8 * stride + i, top);    // every element
            check(b, rows, cols, stride, std::string(dtype_name(dt)) + " cols=" + std::to_string(cols));
        }
    }
}
