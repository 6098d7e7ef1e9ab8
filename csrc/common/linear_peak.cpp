// The machine's peak for the packed linear tile, measured: benchmarks report
// their GFLOP/s as a share of it (one core; multiply by the cores in use).
#include <algorithm>
#include <chrono>
#include <type_traits>

#include "kernels.h"
#include "panel_kernel.h"

namespace cpuinfer {

double linear_peak_flops(DType dt, double seconds) {
    double best = 0;
    panel::with_kernel(dt, [&](auto *kernel) {
        using Kernel = std::remove_pointer_t<decltype(kernel)>;
        using clock = std::chrono::steady_clock;
        float sink = 0;
        int64_t iters = 1 << 16;
        // Grow the loop until one run takes ~1/10 of the budget, then keep the best of the rest.
        const auto end = clock::now() + std::chrono::duration<double>(seconds);
        while (clock::now() < end) {
            auto t0 = clock::now();
            int64_t madds = Kernel::peak(iters, &sink);
            double dt_s = std::chrono::duration<double>(clock::now() - t0).count();
            if (dt_s > 0) best = std::max(best, 2.0 * double(madds) / dt_s);
            if (dt_s < seconds / 10) iters *= 2;
        }
        volatile float keep = sink;
        (void)keep;
    });
    return best;
}

}  // namespace cpuinfer
