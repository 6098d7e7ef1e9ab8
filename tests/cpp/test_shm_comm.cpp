// The shared-memory communicator across forked processes, for every variant's
// vector layer (also under qemu): all-reduce bit-equal to an f32 sum in rank
// order rounded once, all-gather, broadcast, and a dead peer detected.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/shm_comm.h"
#include "harness.h"

using namespace cpuinfer;
using namespace cpuinfer::test;

namespace {

std::string fresh_name() {
    static int counter = 0;
    return "/cpuinfer-ctest-" + std::to_string(getpid()) + "-" + std::to_string(++counter);
}

// Rank r's input at element i of case `salt`, the same in every process.
float value(int rank, int64_t i, int salt) {
    uint32_t h = uint32_t(i) * 2654435761u ^ uint32_t(rank * 40503 + salt * 7919);
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    return (float(h & 0xffff) / 65536.f - 0.5f) * 8.f;
}

// One rank's side; returns its failures (printed here: a forked child has no harness).
int run_rank(const std::string &name, int rank, int world, size_t buffer) {
    int bad = 0;
    auto check = [&](bool ok, const std::string &what) {
        if (!ok && ++bad <= 5) std::printf("  rank %d of %d: %s\n", rank, world, what.c_str());
    };
    try {
        ShmComm comm(name, rank, world, buffer, 20.0);
        int salt = 0;
        for (DType dt : kFloatTypes) {
            for (int64_t n : {int64_t(1), int64_t(7), int64_t(4097), int64_t(100003)}) {
                ++salt;
                Buffer x(dt, n), want(dt, n);
                for (int64_t i = 0; i < n; ++i) {
                    x.set(i, value(rank, i, salt));
                    float acc = float(round_to(dt, value(0, i, salt)));
                    for (int r = 1; r < world; ++r) acc += float(round_to(dt, value(r, i, salt)));
                    want.set(i, acc);
                }
                comm.all_reduce(x.data(), n, dt);
                size_t bytes = size_t(n * dtype_size(dt));
                check(std::memcmp(x.data(), want.data(), bytes) == 0,
                      std::string("all_reduce ") + dtype_name(dt) + " n=" + std::to_string(n) + " differs");
            }
        }
        const int64_t n = 1001;
        std::vector<int32_t> in(n), out(size_t(n * world));
        for (int64_t i = 0; i < n; ++i) in[i] = rank * 100000 + int32_t(i);
        comm.all_gather(in.data(), out.data(), n * 4);
        bool gathered = true;
        for (int r = 0; r < world; ++r)
            for (int64_t i = 0; i < n; ++i) gathered &= out[r * n + i] == r * 100000 + int32_t(i);
        check(gathered, "all_gather");
        std::vector<int32_t> b(5000, rank);
        comm.broadcast(b.data(), int64_t(b.size() * 4), world - 1);
        bool same = true;
        for (int32_t v : b) same &= v == world - 1;
        check(same, "broadcast");
        comm.barrier();
    } catch (const std::exception &e) {
        check(false, std::string("threw: ") + e.what());
    }
    return bad;
}

void run_world(int world, size_t buffer) {
    std::string name = fresh_name();
    std::fflush(stdout);
    std::vector<pid_t> kids;
    for (int r = 1; r < world; ++r) {
        pid_t pid = fork();
        if (pid == 0) {
            int bad = run_rank(name, r, world, buffer);
            std::fflush(stdout);
            _exit(bad ? 1 : 0);
        }
        kids.push_back(pid);
    }
    std::string what = "world " + std::to_string(world) + " buffer " + std::to_string(buffer);
    expect_true(what + ": rank 0", run_rank(name, 0, world, buffer) == 0);
    for (pid_t kid : kids) {
        int status = 0;
        waitpid(kid, &status, 0);
        expect_true(what + ": a forked rank", WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
    int fd = shm_open(name.c_str(), O_RDONLY, 0);
    expect_true(what + ": the segment's name is gone", fd < 0 && errno == ENOENT);
    if (fd >= 0) close(fd);
}

}  // namespace

CPUINFER_TEST(shm_comm_collectives) {
    run_world(2, 4096);     // 2 KiB chunks: everything in many chunks
    run_world(2, 1 << 20);  // 512 KiB chunks: the reduce-scatter path
    run_world(3, 4096);
}

CPUINFER_TEST(shm_comm_dead_peer) {
    std::string name = fresh_name();
    std::fflush(stdout);
    pid_t kid = fork();
    if (kid == 0) {
        { ShmComm peer(name, 1, 2, 4096, 20.0); (void)peer; }
        _exit(0);  // closed: the next collective fails at once
    }
    pid_t kid2 = -1;
    {
        ShmComm comm(name, 0, 2, 4096, 20.0);
        auto t0 = std::chrono::steady_clock::now();
        std::string msg;
        try {
            float x = 1.f;
            comm.all_reduce(&x, 1, DType::f32);
        } catch (const std::runtime_error &e) {
            msg = e.what();
        }
        expect_true("closed peer: " + msg, msg.find("rank 1 (pid") != std::string::npos &&
                                               msg.find("closed") != std::string::npos);
        expect_true("closed peer noticed within 3 s",
                    std::chrono::steady_clock::now() - t0 < std::chrono::seconds(3));
    }
    waitpid(kid, nullptr, 0);
    // A peer killed without closing: unreaped (a zombie) while we wait, as a parent rank sees it.
    name = fresh_name();
    std::fflush(stdout);
    kid2 = fork();
    if (kid2 == 0) {
        ShmComm *peer = new ShmComm(name, 1, 2, 4096, 20.0);
        (void)peer;
        _exit(0);
    }
    {
        ShmComm comm(name, 0, 2, 4096, 20.0);
        std::string msg;
        try {
            comm.barrier();
        } catch (const std::runtime_error &e) {
            msg = e.what();
        }
        expect_true("exited peer: " + msg, msg.find("rank 1 (pid") != std::string::npos &&
                                               msg.find("exited") != std::string::npos);
        bool poisoned = false;
        try {
            comm.barrier();
        } catch (const std::runtime_error &e) {
            poisoned = std::string(e.what()).find("unusable") != std::string::npos;
        }
        expect_true("poisoned after a failure", poisoned);
    }
    waitpid(kid2, nullptr, 0);
}
