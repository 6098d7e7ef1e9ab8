// Binding of the shared-memory communicator (common/shm_comm.h) between the
// tensor-parallel ranks' processes. Every call that meets the peers releases
// the GIL; failures (a peer exited, a timeout, mismatched calls) raise
// RuntimeError, bad arguments ValueError / TypeError as the kernels do.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <string>

#include "../common/shm_comm.h"
#include "tensor_checks.h"

namespace cpuinfer::bind {

// Elements of a CPU tensor that must be contiguous (row-major, any shape).
template <typename A>
inline int64_t contiguous_numel(const A &a, const char *name) {
    check_cpu(a, name);
    int64_t numel = 1;
    for (size_t i = 0; i < a.ndim(); ++i) numel *= int64_t(a.shape(i));
    int64_t expect = 1;
    for (size_t i = a.ndim(); i-- > 0;) {
        if (a.shape(i) != 1 && a.stride(i) != expect)
            fail_value(std::string(name) + " must be contiguous; call .contiguous() first");
        expect *= int64_t(a.shape(i));
    }
    return numel;
}

inline bool same_dtype(nb::dlpack::dtype a, nb::dlpack::dtype b) {
    return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes;
}

inline void bind_comm(nb::module_ &m) {
    nb::class_<ShmComm>(m, "ShmComm",
                        "Collectives between the tensor-parallel ranks (processes) of one machine through POSIX "
                        "shared memory. Every rank calls the same collectives in the same order; all-reduce sums "
                        "in float32 in rank order and rounds once, so every rank gets the same bits. A peer that "
                        "exits, or does not arrive within timeout_s, raises RuntimeError here, and the "
                        "communicator is then unusable.")
        .def(
            "__init__",
            [](ShmComm *self, const std::string &name, int rank, int world_size, int64_t buffer_bytes,
               double timeout_s, std::vector<int> watch, std::vector<std::string> labels) {
                if (buffer_bytes < 0) fail_value("buffer_bytes must be positive, got " + std::to_string(buffer_bytes));
                nb::gil_scoped_release nogil;
                new (self) ShmComm(name, rank, world_size, size_t(buffer_bytes), timeout_s, std::move(watch),
                                   std::move(labels));
            },
            nb::arg("name"), nb::arg("rank"), nb::arg("world_size"), nb::arg("buffer_bytes") = int64_t(16) << 20,
            nb::arg("timeout_s") = 30.0, nb::arg("watch") = std::vector<int>{},
            nb::arg("labels") = std::vector<std::string>{},
            "Rank 0 creates the segment `name`, the others attach (retrying until it exists); returns once all "
            "world_size ranks attached, when the name is unlinked (nothing is left in /dev/shm). buffer_bytes is "
            "each rank's slot: a collective moves at most buffer_bytes / 2 per rank at once, larger tensors go "
            "in chunks. watch: pids of processes (e.g. workers just spawned) whose exit ends the wait for the "
            "ranks at once, with a RuntimeError, instead of after timeout_s. labels: what each rank is called in "
            "errors (all world_size of them, e.g. the global ranks of a pipeline link); default 'tensor-parallel "
            "rank r'.")
        .def(
            "all_reduce_",
            [](ShmComm &c, Out t) {
                DType dt = float_dtype(t, "tensor");
                int64_t n = contiguous_numel(t, "tensor");
                nb::gil_scoped_release nogil;
                c.all_reduce(t.data(), n, dt);
            },
            nb::arg("tensor"),
            "In place: tensor = its sum over the ranks (float32, bfloat16 or float16, contiguous; f32 "
            "accumulation in rank order, rounded once).")
        .def(
            "all_gather",
            [](ShmComm &c, In inp, Out out) {
                check_cpu(inp, "inp");
                check_cpu(out, "out");
                if (!same_dtype(inp.dtype(), out.dtype()))
                    fail_type("out has dtype " + dtype_name(out.dtype()) + " but inp has " + dtype_name(inp.dtype()));
                int64_t n = contiguous_numel(inp, "inp"), m_out = contiguous_numel(out, "out");
                if (m_out != n * c.world_size())
                    fail_value("out must have world_size x inp's elements (" + std::to_string(c.world_size()) +
                               " x " + std::to_string(n) + "), got " + std::to_string(m_out));
                int64_t bytes = n * int64_t(inp.itemsize());
                const char *i0 = static_cast<const char *>(inp.data()), *o0 = static_cast<const char *>(out.data());
                bool own_block = i0 == o0 + int64_t(c.rank()) * bytes;
                if (bytes > 0 && !own_block && i0 < o0 + m_out * int64_t(out.itemsize()) && o0 < i0 + bytes)
                    fail_value("inp and out overlap in memory (only out's own rank block may be inp)");
                nb::gil_scoped_release nogil;
                c.all_gather(inp.data(), out.data(), bytes);
            },
            nb::arg("inp"), nb::arg("out"),
            "out = every rank's inp in rank order: out, seen flat, holds rank r's elements at [r * inp.numel(), "
            "(r + 1) * inp.numel()) (e.g. out of shape [world_size, *inp.shape]). Same dtype (any), both "
            "contiguous.")
        .def(
            "broadcast_",
            [](ShmComm &c, Out t, int root) {
                int64_t n = contiguous_numel(t, "tensor");
                if (root < 0 || root >= c.world_size())
                    fail_value("root must be in [0, " + std::to_string(c.world_size()) + "), got " +
                               std::to_string(root));
                nb::gil_scoped_release nogil;
                c.broadcast(t.data(), n * int64_t(t.itemsize()), root);
            },
            nb::arg("tensor"), nb::arg("root"), "In place: every rank's tensor = root's (any dtype, contiguous).")
        .def(
            "barrier",
            [](ShmComm &c) {
                nb::gil_scoped_release nogil;
                c.barrier();
            },
            "Return once every rank has called barrier().")
        .def("close", &ShmComm::close,
             "Detach (idempotent); peers still waiting on this rank fail at once, later calls raise.")
        .def_prop_ro("rank", &ShmComm::rank)
        .def_prop_ro("world_size", &ShmComm::world_size)
        .def_prop_ro("buffer_bytes", &ShmComm::buffer_bytes)
        .def_prop_ro("name", &ShmComm::name)
        .def_prop_ro("closed", &ShmComm::closed);
}

}  // namespace cpuinfer::bind
