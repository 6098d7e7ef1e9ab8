#include "parallel.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>

#if defined(__linux__)
#include <dlfcn.h>
#include <link.h>
#include <sched.h>
#elif defined(__APPLE__)
#include <dlfcn.h>
#include <mach-o/dyld.h>
#endif

namespace cpuinfer {
namespace {

using GompParallel = void (*)(void (*)(void *), void *, unsigned, unsigned);
using IntFn = int (*)();

struct Runtime {
    GompParallel parallel = nullptr;
    IntFn thread_num = nullptr;
    IntFn num_threads = nullptr;
    IntFn max_threads = nullptr;
    std::string path;
};

bool is_openmp_library(const char *name) {
    const char *base = std::strrchr(name, '/');
    base = base ? base + 1 : name;
    return std::strncmp(base, "libgomp", 7) == 0 || std::strncmp(base, "libiomp", 7) == 0 ||
           std::strncmp(base, "libomp", 6) == 0;
}

#if defined(__linux__)
int find_loaded(struct dl_phdr_info *info, size_t, void *out) {
    if (info->dlpi_name && is_openmp_library(info->dlpi_name)) {
        *static_cast<std::string *>(out) = info->dlpi_name;
        return 1;
    }
    return 0;
}
std::string loaded_openmp_path() {
    std::string path;
    dl_iterate_phdr(find_loaded, &path);
    return path;
}
#elif defined(__APPLE__)
std::string loaded_openmp_path() {
    for (uint32_t i = 0, n = _dyld_image_count(); i < n; ++i) {
        const char *name = _dyld_get_image_name(i);
        if (name && is_openmp_library(name)) return name;
    }
    return "";
}
#endif

Runtime resolve() {
    Runtime rt;
#if defined(__linux__) || defined(__APPLE__)
    std::string path = loaded_openmp_path();
    if (path.empty()) return rt;
    // RTLD_NOLOAD: take a handle to the copy already mapped, never load one.
    void *h = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
    if (!h) return rt;
    rt.parallel = reinterpret_cast<GompParallel>(dlsym(h, "GOMP_parallel"));
    rt.thread_num = reinterpret_cast<IntFn>(dlsym(h, "omp_get_thread_num"));
    rt.num_threads = reinterpret_cast<IntFn>(dlsym(h, "omp_get_num_threads"));
    rt.max_threads = reinterpret_cast<IntFn>(dlsym(h, "omp_get_max_threads"));
    if (rt.parallel && rt.thread_num && rt.num_threads && rt.max_threads) {
        rt.path = path;
    } else {
        rt = Runtime{};
    }
#endif
    return rt;
}

// Resolved once, on first use: torch must be imported before the first
// kernel call for loops to be parallel (cpuinfer's package import does so).
const Runtime &runtime() {
    static const Runtime rt = resolve();
    return rt;
}

struct Job {
    const Runtime *rt;
    int64_t n, chunk;
    RangeFn fn;
    void *ctx;
};

void run_team_member(void *p) {
    const Job &job = *static_cast<const Job *>(p);
    int64_t tid = job.rt->thread_num();
    int64_t nth = job.rt->num_threads();
    for (int64_t b = tid * job.chunk; b < job.n; b += nth * job.chunk) {
        job.fn(job.ctx, b, std::min(job.n, b + job.chunk));
    }
}

}  // namespace

int max_threads() {
    const Runtime &rt = runtime();
    return rt.max_threads ? std::max(1, rt.max_threads()) : 1;
}

std::string threading_runtime() { return runtime().path; }

void parallel_for_raw(int64_t n, int64_t grain, RangeFn fn, void *ctx) {
    if (n <= 0) return;
    grain = std::max<int64_t>(grain, 1);
    const Runtime &rt = runtime();
    int64_t threads = std::min<int64_t>(max_threads(), (n + grain - 1) / grain);
    // Inside an existing parallel region (nested call) stay on this thread.
    if (threads <= 1 || !rt.parallel || rt.num_threads() > 1) {
        fn(ctx, 0, n);
        return;
    }
    Job job{&rt, n, (n + threads - 1) / threads, fn, ctx};
    rt.parallel(run_team_member, &job, unsigned(threads), 0);
}

int bind_threads(const int *cpus, int count) {
#if defined(__linux__)
    const Runtime &rt = runtime();
    if (count <= 0) return EINVAL;
    struct Ctx {
        const int *cpus;
        int count;
        std::atomic<int> err{0};
        const Runtime *rt;
    } ctx{cpus, count, {0}, &rt};
    auto pin = [](void *p) {
        Ctx &c = *static_cast<Ctx *>(p);
        int tid = c.rt->parallel ? c.rt->thread_num() : 0;
        if (tid >= c.count) return;
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(c.cpus[tid], &set);
        if (sched_setaffinity(0, sizeof(set), &set) != 0) {
            int expected = 0;
            c.err.compare_exchange_strong(expected, errno);
        }
    };
    if (rt.parallel) {
        rt.parallel(pin, &ctx, unsigned(count), 0);
    } else {
        pin(&ctx);
    }
    return ctx.err.load();
#else
    (void)cpus;
    (void)count;
    return ENOSYS;  // macOS has no thread-to-core binding API
#endif
}

}  // namespace cpuinfer
