// Collectives between the tensor-parallel ranks of one machine, through POSIX
// shared memory: each rank is a process (one per NUMA node), and the ranks
// meet in one segment with a slot per rank and a generation counter per rank.
//
//   ShmComm comm("/cpuinfer-tp-1234", rank, world_size, 16 << 20, 30.0);
//   comm.all_reduce(x, numel, DType::bf16);   // every rank: x = sum over ranks
//
// Every rank calls the same collectives, with the same sizes, in the same
// order (a mismatch is detected and raised, not silently mixed). Results are
// deterministic and bit-identical on every rank: each element is summed in f32
// in rank order 0..N-1 and rounded once.
//
// Failure never hangs: a rank waiting for its peers checks their pids and the
// timeout, and throws std::runtime_error naming the rank that exited or did
// not arrive; the communicator is then unusable (every later call throws at
// once), and its peers stop waiting as soon as they see it failed.
//
// Not thread-safe: one thread of each rank calls it (the one running the
// model); large reductions use the OpenMP team internally (parallel.h).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "dtype.h"

namespace cpuinfer {

namespace shm_detail {
struct Header;
struct RankLine;
}  // namespace shm_detail

class ShmComm {
  public:
    // Rank 0 creates the segment `name` (a POSIX shm name; a leading '/' is
    // added if missing), the others attach to it, retrying until it exists.
    // Returns once every rank has attached, then the name is unlinked, so a
    // killed process leaves nothing in /dev/shm. buffer_bytes is each rank's
    // slot (two halves used alternately, so one collective moves at most
    // buffer_bytes / 2 per rank at a time; larger tensors go in chunks); the
    // segment is world_size slots plus a few pages. timeout_s bounds every
    // wait (attaching, and each collective). Throws std::invalid_argument for
    // bad arguments, std::runtime_error for everything else.
    // watch: processes that are to join the group (or whose work it serves)
    // but may die before they attach, e.g. the workers a launcher just
    // spawned: any of them gone ends the wait for the others at once
    // (a peer that attached is watched anyway).
    // labels: what each member is called in errors, e.g. "rank 3 (pp stage
    // 1)" for a pipeline link whose members are global ranks 1 and 3; empty
    // means "tensor-parallel rank r". Every member should pass the same ones.
    ShmComm(const std::string &name, int rank, int world_size, size_t buffer_bytes, double timeout_s,
            std::vector<int> watch = {}, std::vector<std::string> labels = {});
    ~ShmComm();
    ShmComm(const ShmComm &) = delete;
    ShmComm &operator=(const ShmComm &) = delete;

    // In place: data[i] = sum over ranks of data[i], for f32, bf16 and f16.
    void all_reduce(void *data, int64_t numel, DType dtype);
    // out[r * bytes_per_rank, (r + 1) * bytes_per_rank) = rank r's in, for
    // every r. in may be out's own block (out + rank * bytes_per_rank) and
    // must not overlap the rest of out.
    void all_gather(const void *in, void *out, int64_t bytes_per_rank);
    // Every rank's data = root's data.
    void broadcast(void *data, int64_t bytes, int root);
    void barrier();
    // Detaches (peers still waiting on this rank fail at once: it closed).
    // Idempotent; later collectives throw.
    void close();

    int rank() const { return rank_; }
    int world_size() const { return world_; }
    size_t buffer_bytes() const { return slot_bytes_; }
    const std::string &name() const { return name_; }
    bool closed() const { return base_ == nullptr; }

  private:
    enum class Op : uint32_t { barrier = 1, all_reduce = 2, all_gather = 3, broadcast = 4 };
    struct Call {  // the collective in progress, checked against every peer's
        Op op;
        DType dtype;
        int64_t size;  // elements (all-reduce) or bytes
        int root;
    };

    void attach(double timeout_s);
    void check_usable() const;
    [[noreturn]] void fail(const std::string &message);
    void post(const Call &call);
    void wait_all(const Call &call);
    void check_peers(const Call &call, int awaited, double waited_s);
    std::string who(int r) const;    // label(r) and its pid
    std::string label(int r) const;  // labels_[r], or "tensor-parallel rank r"
    char *slot(int r, uint64_t half) const;
    void reduce_chunk(char *data, int64_t n, DType dt, const Call &call);

    std::string name_;
    int rank_ = 0, world_ = 1;
    size_t slot_bytes_ = 0, half_bytes_ = 0, total_bytes_ = 0;
    double timeout_s_ = 30.0;
    char *base_ = nullptr;
    int fd_ = -1;
    bool unlinked_ = false;
    shm_detail::Header *header_ = nullptr;
    shm_detail::RankLine *lines_ = nullptr;
    char *messages_ = nullptr;  // each rank's failure message
    size_t slots_offset_ = 0, slot_stride_ = 0;
    uint64_t gen_ = 0;   // this rank's posts so far (the same count on every rank)
    uint64_t step_ = 0;  // collective steps so far: which half of the slots
    std::vector<int> pids_;
    std::vector<int> watch_;  // see the constructor
    std::vector<std::string> labels_;  // see the constructor
    std::string failure_;  // set once a collective failed: the communicator is poisoned
};

}  // namespace cpuinfer
