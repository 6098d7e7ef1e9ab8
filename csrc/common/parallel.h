// Parallel loops on the process's one OpenMP runtime.
//
// Kernels never link an OpenMP runtime of their own: torch has already loaded
// one (libgomp, or LLVM libomp on macOS), and a second runtime in the process
// means two thread pools fighting for the same cores. At first use we look up
// the runtime that is already mapped and call its GOMP_parallel entry point,
// so kernels run on torch's intra-op threads, with torch's thread count and
// whatever CPU binding was applied to them. With no runtime loaded (the plain
// C++ test program, or a process without torch) loops run serially.
#pragma once
#include <cstdint>
#include <string>

namespace cpuinfer {

// Body called as fn(begin, end) on disjoint ranges covering [0, n).
using RangeFn = void (*)(void *ctx, int64_t begin, int64_t end);

int max_threads();
// Path of the OpenMP runtime in use, or "" when loops run serially.
std::string threading_runtime();
void parallel_for_raw(int64_t n, int64_t grain, RangeFn fn, void *ctx);

// Splits [0, n) into at most max_threads() ranges of at least `grain` items.
template <typename F>
inline void parallel_for(int64_t n, int64_t grain, const F &f) {
    parallel_for_raw(n, grain, [](void *ctx, int64_t b, int64_t e) { (*static_cast<const F *>(ctx))(b, e); },
                     const_cast<F *>(&f));
}

// Pins thread i of the runtime's team to cpus[i] (count threads in all).
// Returns 0, or the errno of the first failing sched_setaffinity.
int bind_threads(const int *cpus, int count);

}  // namespace cpuinfer
