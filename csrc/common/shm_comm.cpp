#include "shm_comm.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <new>
#include <stdexcept>
#include <thread>

#include "dispatch_dtype.h"
#include "parallel.h"
#include "vec.h"

namespace cpuinfer {
namespace shm_detail {

// The segment: Header | RankLine x world | failure message x world | slots.
// Every field a peer polls sits on its own cache line (128 bytes covers
// Apple's lines too), written by one rank only.
constexpr uint64_t kMagic = 0x31736d6e69757063ull;  // "cpuinsm1"
constexpr uint32_t kVersion = 1;
constexpr int kMaxWorld = 64;
constexpr size_t kLine = 128;
constexpr size_t kMessageBytes = 256;
constexpr size_t kMinBuffer = 256;

enum State : int32_t { kActive = 0, kClosed = 1, kFailed = 2 };

struct alignas(kLine) Header {
    std::atomic<uint64_t> magic;  // stored last by the creator (release): the rest is then valid
    uint32_t version;
    int32_t world_size;
    uint64_t slot_bytes, slot_stride, slots_offset, total_bytes;
    alignas(kLine) std::atomic<int32_t> attached;
};

struct alignas(kLine) RankLine {
    std::atomic<uint64_t> gen;      // posts so far; stored with release after the slot's data
    std::atomic<uint64_t> call[2];  // the packed Call of post g at call[g & 1]
    std::atomic<int32_t> pid;       // 0 until the rank attached
    std::atomic<int32_t> state;     // State
};

static_assert(std::atomic<uint64_t>::is_always_lock_free, "cross-process atomics must be lock-free");
static_assert(std::atomic<int32_t>::is_always_lock_free, "cross-process atomics must be lock-free");

}  // namespace shm_detail

namespace {

using namespace shm_detail;
using Clock = std::chrono::steady_clock;

// Single-phase reduction (every rank sums every element) up to this many
// bytes per chunk: one meeting per chunk, the decode case. Larger chunks
// reduce-scatter then gather, two meetings, so each rank sums 1/N of them.
constexpr int64_t kOnePhaseBytes = 64 << 10;
// Copies and sums of at least this many bytes use the OpenMP team.
constexpr int64_t kParallelBytes = 1 << 20;
constexpr int64_t kBlock = 64;  // elements: reduce-scatter shares are whole blocks
// Busy polls before a waiting rank starts yielding its core (tens of us):
// there may be more ranks than cores (tests), and a peer that is computing
// needs the core more than we need the last microsecond.
constexpr uint64_t kBusySpins = 20000;
constexpr auto kCheckEvery = std::chrono::milliseconds(1);

size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string fmt_seconds(double s) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", s);
    return buf;
}

std::string errno_text(int err) { return std::strerror(err); }

// A process that has exited: gone, or a zombie its parent has not reaped yet
// (kill() still succeeds on those, and a rank's parent may be blocked in the
// same collective).
bool process_alive(int pid) {
    if (pid <= 0) return true;  // not attached yet: nothing to check
    if (kill(pid, 0) != 0 && errno == ESRCH) return false;
#if defined(__linux__)
    char path[64];
    std::snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = ::open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno != ENOENT;
    char buf[512];
    ssize_t n = ::read(fd, buf, sizeof buf - 1);
    ::close(fd);
    if (n <= 0) return true;
    buf[n] = 0;
    const char *paren = std::strrchr(buf, ')');  // the command name may contain spaces and ')'
    if (paren && paren[1] == ' ') return paren[2] != 'Z' && paren[2] != 'X';
#endif
    return true;
}

const char *op_name(uint32_t op) {
    switch (op) {
        case 1: return "barrier";
        case 2: return "all-reduce";
        case 3: return "all-gather";
        case 4: return "broadcast";
        default: return "collective";
    }
}

const char *dtype_word(DType d) {
    switch (d) {
        case DType::f32: return "float32";
        case DType::bf16: return "bfloat16";
        case DType::f16: return "float16";
        default: return "float8_e5m2";
    }
}

// op 4 bits | dtype 4 bits | root 8 bits | size 48 bits.
constexpr int64_t kMaxSize = (int64_t(1) << 48) - 1;

uint64_t pack(uint32_t op, DType dt, int root, int64_t size) {
    return uint64_t(op) | uint64_t(int(dt)) << 4 | uint64_t(root) << 8 | uint64_t(size) << 16;
}

std::string describe(uint64_t packed) {
    uint32_t op = packed & 15;
    DType dt = DType(int((packed >> 4) & 15));
    int root = int((packed >> 8) & 255);
    int64_t size = int64_t(packed >> 16);
    std::string s = op_name(op);
    switch (op) {
        case 2: return s + " of " + std::to_string(size) + " " + dtype_word(dt) + " elements";
        case 3: return s + " of " + std::to_string(size) + " bytes per rank";
        case 4: return s + " of " + std::to_string(size) + " bytes from rank " + std::to_string(root);
        default: return s;
    }
}

// Sums of n elements in rank order, through the vector layer.
template <typename T>
void sum_range(T *out, const T *const *src, int nsrc, int64_t begin, int64_t end) {
    using namespace vec;
    const int W = width();
    int64_t i = begin;
    for (; i + 2 * W <= end; i += 2 * W) {
        vf a = load(src[0] + i), b = load(src[0] + i + W);
        for (int r = 1; r < nsrc; ++r) {
            a = add(a, load(src[r] + i));
            b = add(b, load(src[r] + i + W));
        }
        store(out + i, a);
        store(out + i + W, b);
    }
    for (; i + W <= end; i += W) {
        vf a = load(src[0] + i);
        for (int r = 1; r < nsrc; ++r) a = add(a, load(src[r] + i));
        store(out + i, a);
    }
    if (i < end) {
        // The tail goes through the same vector instructions, so an element's
        // bits never depend on where it falls in a chunk or a share.
        const int64_t n = end - i;
        T buf[64] = {};
        std::memcpy(buf, src[0] + i, size_t(n) * sizeof(T));
        vf a = load(buf);
        for (int r = 1; r < nsrc; ++r) {
            std::memcpy(buf, src[r] + i, size_t(n) * sizeof(T));
            a = add(a, load(buf));
        }
        store(buf, a);
        std::memcpy(out + i, buf, size_t(n) * sizeof(T));
    }
}

void sum_elements(DType dt, void *out, char *const *src, int nsrc, int64_t begin, int64_t end) {
    with_float_type(dt, [&](auto tag) {
        using T = decltype(tag);
        const T *s[kMaxWorld];
        for (int r = 0; r < nsrc; ++r) s[r] = reinterpret_cast<const T *>(src[r]);
        T *o = static_cast<T *>(out);
        const int64_t bytes = (end - begin) * int64_t(sizeof(T));
        if (bytes < kParallelBytes) {
            sum_range(o, s, nsrc, begin, end);
            return;
        }
        const int64_t blocks = (end - begin + kBlock - 1) / kBlock;
        parallel_for(blocks, (256 << 10) / (kBlock * int64_t(sizeof(T))), [&](int64_t b, int64_t e) {
            sum_range(o, s, nsrc, begin + b * kBlock, std::min(end, begin + e * kBlock));
        });
    });
}

void copy_bytes(void *dst, const void *src, int64_t bytes) {
    if (bytes < kParallelBytes) {
        std::memcpy(dst, src, size_t(bytes));
        return;
    }
    constexpr int64_t block = 64 << 10;
    parallel_for((bytes + block - 1) / block, 4, [&](int64_t b, int64_t e) {
        int64_t lo = b * block, hi = std::min(bytes, e * block);
        std::memcpy(static_cast<char *>(dst) + lo, static_cast<const char *>(src) + lo, size_t(hi - lo));
    });
}

// Backs [offset, offset + bytes) of the segment with memory now, allocated by
// this rank (so on its NUMA node), and turns a full /dev/shm into an error
// here instead of a SIGBUS at the first write.
void reserve(int fd, size_t offset, size_t bytes, const std::string &name) {
#if defined(__linux__)
    int err = posix_fallocate(fd, off_t(offset), off_t(bytes));
    if (err == EINVAL || err == EOPNOTSUPP) return;  // a file system without fallocate
    if (err != 0)
        throw std::runtime_error("cannot reserve " + std::to_string(bytes >> 10) + " KiB of shared memory for '" + name +
                                 "': " + errno_text(err) +
                                 " (enlarge /dev/shm, e.g. docker run --shm-size, or pass a smaller buffer_bytes)");
#else
    (void)fd, (void)offset, (void)bytes, (void)name;
#endif
}

}  // namespace

ShmComm::ShmComm(const std::string &name, int rank, int world_size, size_t buffer_bytes, double timeout_s,
                 std::vector<int> watch, std::vector<std::string> labels)
    : watch_(std::move(watch)), labels_(std::move(labels)) {
    if (world_size < 1 || world_size > kMaxWorld)
        throw std::invalid_argument("world_size must be in [1, " + std::to_string(kMaxWorld) + "], got " +
                                    std::to_string(world_size));
    if (!labels_.empty() && labels_.size() != size_t(world_size))
        throw std::invalid_argument("labels must name all " + std::to_string(world_size) + " ranks, got " +
                                    std::to_string(labels_.size()));
    if (rank < 0 || rank >= world_size)
        throw std::invalid_argument("rank must be in [0, " + std::to_string(world_size) + "), got " +
                                    std::to_string(rank));
    if (buffer_bytes < kMinBuffer || buffer_bytes > (size_t(1) << 40))
        throw std::invalid_argument("buffer_bytes must be in [" + std::to_string(kMinBuffer) + ", 2^40], got " +
                                    std::to_string(buffer_bytes));
    if (!(timeout_s > 0) || !std::isfinite(timeout_s))
        throw std::invalid_argument("timeout_s must be a positive number of seconds, got " + fmt_seconds(timeout_s));
    std::string n = name.empty() || name[0] != '/' ? "/" + name : name;
    if (n.size() < 2 || n.size() > 200 || n.find('/', 1) != std::string::npos)
        throw std::invalid_argument("shared-memory name must be 1 to 199 characters without '/', got '" + name + "'");
    name_ = n;
    rank_ = rank;
    world_ = world_size;
    slot_bytes_ = buffer_bytes;
    half_bytes_ = buffer_bytes / 2 / kLine * kLine;
    timeout_s_ = timeout_s;
    try {
        attach(timeout_s);
    } catch (const std::exception &e) {
        // Tell the peers (when this rank's line is ours), so they stop waiting for us.
        bool mapped = base_ && messages_ + size_t(rank_ + 1) * kMessageBytes <= base_ + total_bytes_;
        if (mapped && lines_[rank_].pid.load(std::memory_order_acquire) == int32_t(getpid())) {
            std::snprintf(messages_ + size_t(rank_) * kMessageBytes, kMessageBytes, "%s", e.what());
            lines_[rank_].state.store(kFailed, std::memory_order_release);
        }
        if (!unlinked_ && base_) shm_unlink(name_.c_str());  // the group cannot form: let no name outlive it
        if (base_) munmap(base_, total_bytes_);
        if (fd_ >= 0) ::close(fd_);
        base_ = nullptr;
        fd_ = -1;
        throw;
    }
}

ShmComm::~ShmComm() { close(); }

void ShmComm::attach(double timeout_s) {
    const auto start = Clock::now();
    const size_t page = size_t(sysconf(_SC_PAGESIZE));
    const size_t meta = round_up(sizeof(Header) + world_ * (sizeof(RankLine) + kMessageBytes), page);
    const size_t stride = round_up(slot_bytes_, page);
    total_bytes_ = meta + stride * world_;
    auto map = [&](size_t bytes) {
        void *p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
        if (p == MAP_FAILED) throw std::runtime_error("mmap of shared memory '" + name_ + "' failed: " + errno_text(errno));
        base_ = static_cast<char *>(p);
        header_ = reinterpret_cast<Header *>(base_);
        lines_ = reinterpret_cast<RankLine *>(base_ + sizeof(Header));
        messages_ = base_ + sizeof(Header) + world_ * sizeof(RankLine);
    };
    if (rank_ == 0) {
        fd_ = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
        if (fd_ < 0) {
            int err = errno;
            if (err == EEXIST)
                throw std::runtime_error("shared-memory segment '" + name_ +
                                         "' already exists (another communicator uses this name, or a crashed run "
                                         "left it: remove /dev/shm" + name_ + ")");
            throw std::runtime_error("shm_open('" + name_ + "') failed: " + errno_text(err));
        }
        if (ftruncate(fd_, off_t(total_bytes_)) != 0) {
            int err = errno;
            shm_unlink(name_.c_str());
            throw std::runtime_error("sizing shared memory '" + name_ + "' to " + std::to_string(total_bytes_) +
                                     " bytes failed: " + errno_text(err));
        }
        try {
            map(total_bytes_);
        } catch (...) {
            shm_unlink(name_.c_str());
            throw;
        }
        reserve(fd_, 0, meta, name_);
        Header *h = new (header_) Header();
        h->version = kVersion;
        h->world_size = world_;
        h->slot_bytes = slot_bytes_;
        h->slot_stride = stride;
        h->slots_offset = meta;
        h->total_bytes = total_bytes_;
        for (int r = 0; r < world_; ++r) new (&lines_[r]) RankLine();
        reserve(fd_, meta, stride, name_);
        lines_[0].pid.store(int32_t(getpid()), std::memory_order_relaxed);
        h->attached.store(1, std::memory_order_relaxed);
        h->magic.store(kMagic, std::memory_order_release);
    } else {
        // Rank 0 may not have created it yet, or be between creating and
        // publishing it: retry until the magic says it is complete.
        for (;;) {
            fd_ = shm_open(name_.c_str(), O_RDWR, 0);
            if (fd_ >= 0) {
                struct stat st;
                if (fstat(fd_, &st) == 0 && size_t(st.st_size) >= sizeof(Header)) {
                    total_bytes_ = size_t(st.st_size);
                    map(total_bytes_);
                    if (header_->magic.load(std::memory_order_acquire) == kMagic) break;
                    munmap(base_, total_bytes_);
                    base_ = nullptr;
                }
                ::close(fd_);
                fd_ = -1;
            } else if (errno != ENOENT) {
                throw std::runtime_error("shm_open('" + name_ + "') failed: " + errno_text(errno));
            }
            if (seconds_since(start) > timeout_s)
                throw std::runtime_error(label(0) + " did not create the shared-memory segment '" + name_ +
                                         "' within " + fmt_seconds(timeout_s) + " s");
            std::this_thread::sleep_for(std::chrono::microseconds(500));
        }
        const Header &h = *header_;
        if (h.version != kVersion || h.world_size != world_ || h.slot_bytes != slot_bytes_ ||
            h.total_bytes != total_bytes_ || h.slots_offset != meta || h.slot_stride != stride)
            throw std::runtime_error("shared-memory segment '" + name_ + "' was created for " +
                                     std::to_string(h.world_size) + " ranks with buffer_bytes " +
                                     std::to_string(h.slot_bytes) + ", but rank " + std::to_string(rank_) +
                                     " was given " + std::to_string(world_) + " ranks and " +
                                     std::to_string(slot_bytes_));
        int32_t expected = 0;
        if (!lines_[rank_].pid.compare_exchange_strong(expected, int32_t(getpid()), std::memory_order_acq_rel)) {
            unlinked_ = true;  // the other process with this rank owns the group; leave its name alone
            throw std::runtime_error(label(rank_) + " is already attached to '" + name_ + "' by pid " +
                                     std::to_string(expected));
        }
        reserve(fd_, meta + stride * rank_, stride, name_);
        if (header_->attached.fetch_add(1, std::memory_order_acq_rel) + 1 == world_) {
            shm_unlink(name_.c_str());  // the last to attach: nobody needs the name any more
            unlinked_ = true;
        }
    }
    slots_offset_ = meta;
    slot_stride_ = stride;
    // Wait for the others, watching that the ones that attached stay alive.
    for (auto last = start;;) {
        if (header_->attached.load(std::memory_order_acquire) == world_) break;
        if (Clock::now() - last >= kCheckEvery) {
            last = Clock::now();
            std::string missing;
            for (int r = 0; r < world_; ++r) {
                int pid = lines_[r].pid.load(std::memory_order_acquire);
                if (r != rank_ && pid != 0 && !process_alive(pid))
                    throw std::runtime_error(label(r) + " (pid " + std::to_string(pid) +
                                             ") exited while the ranks were attaching");
                if (r != rank_ && lines_[r].state.load(std::memory_order_acquire) == kFailed)
                    throw std::runtime_error(label(r) + " (pid " + std::to_string(pid) +
                                             ") failed while the ranks were attaching");
                if (pid == 0) missing += (missing.empty() ? "" : ", ") + label(r);
            }
            for (int pid : watch_)
                if (!process_alive(pid))
                    throw std::runtime_error("process " + std::to_string(pid) +
                                             ", which this group waits on, exited while the ranks were attaching");
            if (seconds_since(start) > timeout_s)
                throw std::runtime_error((missing.empty() ? std::string("some rank") : missing) +
                                         " did not attach to the shared-memory segment '" + name_ + "' within " +
                                         fmt_seconds(timeout_s) + " s");
        }
        std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (rank_ == 0 && world_ == 1) shm_unlink(name_.c_str());
    unlinked_ = true;  // by the last rank to attach
    pids_.resize(world_);
    for (int r = 0; r < world_; ++r) pids_[r] = lines_[r].pid.load(std::memory_order_acquire);
    ::close(fd_);  // the mapping keeps the memory
    fd_ = -1;
}

void ShmComm::close() {
    if (!base_) return;
    if (failure_.empty()) lines_[rank_].state.store(kClosed, std::memory_order_release);
    munmap(base_, total_bytes_);
    base_ = nullptr;
    header_ = nullptr;
    lines_ = nullptr;
    messages_ = nullptr;
}

void ShmComm::check_usable() const {
    if (!failure_.empty())
        throw std::runtime_error("the tensor-parallel communicator is unusable after an earlier failure: " + failure_);
    if (!base_) throw std::runtime_error("the tensor-parallel communicator '" + name_ + "' was closed");
}

void ShmComm::fail(const std::string &message) {
    failure_ = message;
    if (base_) {
        char *m = messages_ + size_t(rank_) * kMessageBytes;
        std::snprintf(m, kMessageBytes, "%s", message.c_str());
        lines_[rank_].state.store(kFailed, std::memory_order_release);
    }
    throw std::runtime_error(message);
}

std::string ShmComm::label(int r) const {
    return labels_.empty() ? "tensor-parallel rank " + std::to_string(r) : labels_[size_t(r)];
}

std::string ShmComm::who(int r) const { return label(r) + " (pid " + std::to_string(pids_[r]) + ")"; }

char *ShmComm::slot(int r, uint64_t half) const {
    return base_ + slots_offset_ + size_t(r) * slot_stride_ + half * half_bytes_;
}

void ShmComm::post(const Call &call) {
    const uint64_t g = ++gen_;
    RankLine &me = lines_[rank_];
    me.call[g & 1].store(pack(uint32_t(call.op), call.dtype, call.root, call.size), std::memory_order_relaxed);
    me.gen.store(g, std::memory_order_release);
}

void ShmComm::wait_all(const Call &call) {
    const uint64_t g = gen_;
    const uint64_t want = pack(uint32_t(call.op), call.dtype, call.root, call.size);
    Clock::time_point start{}, last{};
    bool slow = false;
    for (int r = 0; r < world_; ++r) {
        if (r == rank_) continue;
        const RankLine &peer = lines_[r];
        for (uint64_t spins = 0; peer.gen.load(std::memory_order_acquire) < g; ++spins) {
            if (spins < kBusySpins) continue;
            if (!slow) {
                slow = true;
                start = last = Clock::now();
            }
            sched_yield();
            if ((spins & 15) == 0 && Clock::now() - last >= kCheckEvery) {
                last = Clock::now();
                check_peers(call, r, seconds_since(start));
            }
        }
        // A peer is at most one post ahead, and that post used the other entry.
        uint64_t got = peer.call[g & 1].load(std::memory_order_relaxed);
        if (got != want)
            fail("the ranks called different collectives: " + label(rank_) + ": " + describe(want) + "; " +
                 label(r) + ": " + describe(got) +
                 " (every rank must make the same calls in the same order)");
    }
}

void ShmComm::check_peers(const Call &call, int awaited, double waited_s) {
    const uint64_t g = gen_;
    const std::string where = std::string("the ") + op_name(uint32_t(call.op));
    auto arrived = [&](int r) { return lines_[r].gen.load(std::memory_order_acquire) >= g; };
    auto state = [&](int r) { return lines_[r].state.load(std::memory_order_acquire); };
    // The most direct cause first: a peer that left (closed, then maybe exited), one that died, then one
    // that gave up because of a third.
    for (int r = 0; r < world_; ++r)
        if (r != rank_ && state(r) == kClosed && !arrived(r))
            fail(who(r) + " closed the communicator before reaching " + where);
    for (int r = 0; r < world_; ++r)
        if (r != rank_ && !arrived(r) && !process_alive(pids_[r]) && !arrived(r) && state(r) != kClosed)
            fail(who(r) + " exited before reaching " + where);
    for (int r = 0; r < world_; ++r) {
        if (r != rank_ && state(r) == kFailed) {
            char msg[kMessageBytes];
            std::memcpy(msg, messages_ + size_t(r) * kMessageBytes, kMessageBytes);
            msg[kMessageBytes - 1] = 0;
            fail(who(r) + " failed: " + msg);
        }
    }
    if (waited_s > timeout_s_) fail(who(awaited) + " did not reach " + where + " within " + fmt_seconds(timeout_s_) + " s");
}

void ShmComm::reduce_chunk(char *data, int64_t n, DType dt, const Call &call) {
    const int64_t es = dtype_size(dt), bytes = n * es;
    const uint64_t half = step_++ & 1;
    char *src[kMaxWorld];
    for (int r = 0; r < world_; ++r) src[r] = slot(r, half);
    char *mine = src[rank_];
    copy_bytes(mine, data, bytes);
    post(call);
    wait_all(call);
    if (bytes <= kOnePhaseBytes) {
        sum_elements(dt, data, src, world_, 0, n);
        return;
    }
    // Reduce-scatter: rank r sums share r (whole blocks) into its own slot,
    // where only it reads share r until the second meeting; then gather.
    const int64_t blocks = (n + kBlock - 1) / kBlock, per = (blocks + world_ - 1) / world_ * kBlock;
    auto lo = [&](int r) { return std::min(n, r * per); };
    sum_elements(dt, mine, src, world_, lo(rank_), lo(rank_ + 1));
    post(call);
    wait_all(call);
    for (int r = 0; r < world_; ++r) copy_bytes(data + lo(r) * es, src[r] + lo(r) * es, (lo(r + 1) - lo(r)) * es);
}

void ShmComm::all_reduce(void *data, int64_t numel, DType dtype) {
    check_usable();
    if (dtype != DType::f32 && dtype != DType::bf16 && dtype != DType::f16)
        throw std::invalid_argument(std::string("all_reduce supports float32, bfloat16 and float16, not ") +
                                    dtype_word(dtype));
    if (numel < 0 || numel > kMaxSize) throw std::invalid_argument("all_reduce: bad element count " + std::to_string(numel));
    if (world_ == 1) return;
    const Call call{Op::all_reduce, dtype, numel, 0};
    const int64_t es = dtype_size(dtype), chunk = int64_t(half_bytes_) / es;
    char *p = static_cast<char *>(data);
    int64_t off = 0;
    do {  // an empty tensor still meets the peers, so mismatched calls are caught
        reduce_chunk(p + off * es, std::min(chunk, numel - off), dtype, call);
        off += chunk;
    } while (off < numel);
}

void ShmComm::all_gather(const void *in, void *out, int64_t bytes_per_rank) {
    check_usable();
    if (bytes_per_rank < 0 || bytes_per_rank > kMaxSize)
        throw std::invalid_argument("all_gather: bad size " + std::to_string(bytes_per_rank));
    char *o = static_cast<char *>(out);
    const char *i = static_cast<const char *>(in);
    if (world_ == 1) {
        if (o != i) std::memmove(o, i, size_t(bytes_per_rank));
        return;
    }
    const Call call{Op::all_gather, DType::f32, bytes_per_rank, 0};
    const int64_t chunk = int64_t(half_bytes_);
    for (int64_t off = 0; off == 0 || off < bytes_per_rank; off += chunk) {
        const int64_t n = std::min(chunk, bytes_per_rank - off);
        const uint64_t half = step_++ & 1;
        copy_bytes(slot(rank_, half), i + off, n);
        post(call);
        wait_all(call);
        for (int r = 0; r < world_; ++r) copy_bytes(o + r * bytes_per_rank + off, slot(r, half), n);
    }
}

void ShmComm::broadcast(void *data, int64_t bytes, int root) {
    check_usable();
    if (root < 0 || root >= world_)
        throw std::invalid_argument("broadcast root must be in [0, " + std::to_string(world_) + "), got " +
                                    std::to_string(root));
    if (bytes < 0 || bytes > kMaxSize) throw std::invalid_argument("broadcast: bad size " + std::to_string(bytes));
    if (world_ == 1) return;
    const Call call{Op::broadcast, DType::f32, bytes, root};
    char *p = static_cast<char *>(data);
    const int64_t chunk = int64_t(half_bytes_);
    for (int64_t off = 0; off == 0 || off < bytes; off += chunk) {
        const int64_t n = std::min(chunk, bytes - off);
        const uint64_t half = step_++ & 1;
        if (rank_ == root) copy_bytes(slot(root, half), p + off, n);
        post(call);
        wait_all(call);
        if (rank_ != root) copy_bytes(p + off, slot(root, half), n);
    }
}

void ShmComm::barrier() {
    check_usable();
    if (world_ == 1) return;
    const Call call{Op::barrier, DType::f32, 0, 0};
    post(call);
    wait_all(call);
}

}  // namespace cpuinfer
