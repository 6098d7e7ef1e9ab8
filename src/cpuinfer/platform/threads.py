"""Pin each rank's inference threads (torch's OpenMP team, which the kernels share) and memory to cores / a NUMA node.

`VLLM_CPU_OMP_THREADS_BIND` (or `CPUINFER_OMP_THREADS_BIND`), as in vLLM's CPU docs:
- `auto` (default): each rank gets physical cores of one NUMA node, with its memory on that node.
- a core list, e.g. `0-29` or `0,2,4-7`; `a|b` gives one list per rank on this machine.
- `nobind`: leave OMP_NUM_THREADS and the OS scheduler alone.

Ranks: `world_size` is every rank on this machine (data-parallel engine cores x tensor-parallel x
pipeline-parallel ranks) and `rank` the machine-wide index (config.ParallelConfig.global_rank).

The `auto` rule, exactly (`describe_layout`):
1. Usable CPUs are online ∩ cgroup cpuset ∩ affinity (topology.py). A node's usable cores are its usable
   CPUs, one per physical core: the lowest-numbered usable thread of each SMT sibling group (vLLM on x86
   takes the highest; either way one thread per core).
2. Nodes, in order: `CPU_VISIBLE_MEMORY_NODES` as written (its order is the binding order, as vLLM
   documents: "masking nodes and changing nodes binding sequence"), else every node with a usable core,
   ascending. A visible node must exist and have a usable core.
3. `per_node = ceil(world_size / len(nodes))`; rank r goes to node `nodes[r // per_node]`. With no more
   ranks than nodes that is vLLM's rule, rank N on the N-th node; with more (e.g. -dp 2 on one node, or
   -tp 4 on two), consecutive ranks share a node, so one data-parallel replica's TP ranks stay together.
4. A node's k ranks split its usable cores into k contiguous runs in rank order, sizes differing by at
   most one (the first `len % k` ranks take one more). More ranks than cores on a node is an EnvError.
5. `VLLM_CPU_NUM_OF_RESERVED_CPU` cores (unset: 0 with one rank, 1 per rank with several, as vLLM) are
   taken off the end of each rank's run for the front end. A value that is set and leaves a rank no
   core is an EnvError; the unset default leaves a rank of one core alone (newer vLLM, too, drops the
   reservation rather than fail when cores are that few).
A core list names each rank's CPUs directly (every CPU usable, a CPU in two ranks is a warning); its node is the
node of its first CPU. Thread i of the team is pinned to cpus[i]; memory allocation is bound to the
node with set_mempolicy where the OS allows (a container that denies it gets one warning, not a failure).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from cpuinfer import envs
from cpuinfer.envs import EnvError
from cpuinfer.platform.topology import Topology, format_cpu_list, parse_cpu_list

logger = logging.getLogger(__name__)


def numa_nodes(topology: Topology | None = None) -> dict[int, list[int]]:
    """NUMA node -> its online CPUs (one node holding every CPU when /sys has no node info)."""
    return (topology or Topology.read()).nodes


def physical_cores(cpus: Iterable[int], topology: Topology | None = None) -> list[int]:
    """The first hardware thread of each physical core among `cpus` (hyper-thread siblings dropped)."""
    return (topology or Topology.read()).physical_cores(cpus)


@dataclass
class Binding:
    """Where one rank's threads go: None = leave alone."""

    cpus: list[int] | None
    node: int | None = None


def visible_nodes(topology: Topology) -> list[int]:
    """The NUMA nodes `auto` places ranks on, in binding order (rule 2 of the module docstring)."""
    raw = envs.VISIBLE_MEMORY_NODES.raw()
    if not raw:
        nodes = [n for n in topology.nodes if topology.usable_cores(n)]
        if not nodes:
            raise EnvError(
                "this process may use no online CPU (affinity, cgroup cpuset and /sys/devices/system/cpu/online "
                "have nothing in common); set VLLM_CPU_OMP_THREADS_BIND=nobind or fix the CPU restriction"
            )
        return nodes
    vname, vvalue = raw
    try:
        visible = parse_cpu_list(vvalue, vname)
    except EnvError:
        raise EnvError(f"{vname}={vvalue!r} is not a list of NUMA nodes; use e.g. 0,1 or 0-3") from None
    for n in visible:
        if n not in topology.nodes:
            raise EnvError(
                f"{vname}={vvalue!r} names NUMA node {n}, but this machine has nodes {sorted(topology.nodes)}"
            )
        if not topology.usable_cores(n):
            raise EnvError(
                f"{vname}={vvalue!r} names NUMA node {n}, which has no CPU this process may use (offline, "
                f"or outside its affinity / cgroup cpuset); usable CPUs: {format_cpu_list(sorted(topology.allowed))}"
            )
    return visible


def _reserved(world_size: int) -> tuple[str | None, int]:
    """(the variable's name if set, cores reserved per rank) from VLLM_CPU_NUM_OF_RESERVED_CPU."""
    raw = envs.NUM_OF_RESERVED_CPU.raw()
    if raw:
        return raw[0], envs.NUM_OF_RESERVED_CPU.get()
    return None, 1 if world_size > 1 else 0


def _auto_layout(name: str, world_size: int, topology: Topology) -> list[Binding]:
    """Rules 2-5 of the module docstring."""
    nodes = visible_nodes(topology)
    rname, n_reserved = _reserved(world_size)
    per_node = -(-world_size // len(nodes))
    layout = []
    for rank in range(world_size):
        i, j = divmod(rank, per_node)
        node = nodes[i]
        cores = topology.usable_cores(node)
        k = min(per_node, world_size - i * per_node)  # ranks on this node
        if k > len(cores):
            raise EnvError(
                f"{name}=auto: {world_size} ranks put {k} on NUMA node {node}, which has {len(cores)} usable "
                f"physical core(s) ({format_cpu_list(cores)}); use fewer ranks (-dp/-tp/-pp), more nodes "
                "(CPU_VISIBLE_MEMORY_NODES) or a core list per rank with '|'"
            )
        size, extra = divmod(len(cores), k)
        start = j * size + min(j, extra)
        share = cores[start : start + size + (j < extra)]
        keep = len(share) - n_reserved
        if keep < 1 and rname is None:
            keep = len(share)  # the unset default never takes a rank's only core
        if keep < 1:
            raise EnvError(
                f"{rname}={n_reserved} leaves no core for inference on node {node} ({len(share)} usable "
                f"physical cores for rank {rank} of {world_size}); lower it or use fewer ranks"
            )
        layout.append(Binding(share[:keep], node))
    return layout


def _list_layout(name: str, value: str, world_size: int, topology: Topology) -> list[Binding]:
    """One core list per rank, '|' between ranks."""
    per_rank = value.split("|")
    if len(per_rank) != world_size:
        raise EnvError(
            f"{name}={value!r} gives {len(per_rank)} CPU lists for {world_size} rank(s); separate one "
            "list per tensor-parallel rank with '|' (one per rank on this machine: data-parallel x "
            "tensor-parallel x pipeline-parallel)"
        )
    layout, owner = [], {}
    for rank, text in enumerate(per_rank):
        cpus = parse_cpu_list(text, name)
        for c in cpus:
            if c not in topology.allowed:
                why = "which is offline" if topology.online is not None and c not in topology.online else None
                raise EnvError(
                    f"{name}={value!r} names CPU {c}, {why or 'which this process may not use'} "
                    f"(allowed: {format_cpu_list(sorted(topology.allowed))})"
                )
            if c in owner and owner[c] != rank:
                logger.warning(
                    "%s=%r gives CPU %d to ranks %d and %d: they will share it", name, value, c, owner[c], rank
                )
            owner.setdefault(c, rank)
        layout.append(Binding(cpus, topology.node_of(cpus[0])))
    return layout


def _bind_setting() -> tuple[str, str]:
    """(name, value) of VLLM_CPU_OMP_THREADS_BIND as set, or its default `auto`."""
    raw = envs.OMP_THREADS_BIND.raw()
    return raw if raw else (envs.OMP_THREADS_BIND.names[-1], "auto")


def describe_layout(world_size: int = 1, topology: Topology | None = None) -> list[Binding]:
    """Every rank's Binding (index = machine-wide rank) from the variables; malformed values raise EnvError."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    name, value = _bind_setting()
    topology = topology or Topology.read()
    # Malformed values are errors whatever the mode, though only auto uses them.
    if value != "auto" and envs.VISIBLE_MEMORY_NODES.raw():
        visible_nodes(topology)
    envs.NUM_OF_RESERVED_CPU.get()
    if value == "nobind":
        return [Binding(None) for _ in range(world_size)]
    if value == "auto":
        return _auto_layout(name, world_size, topology)
    return _list_layout(name, value, world_size, topology)


def resolve_binding(rank: int = 0, world_size: int = 1, topology: Topology | None = None) -> Binding:
    """This rank's CPUs and NUMA node (describe_layout's entry `rank`); malformed values raise EnvError."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    return describe_layout(world_size, topology)[rank]


def describe_rank(rank: int, cpus: list[int] | None, node: int | None) -> str:
    """'rank 0 -> cores 0-15 -> NUMA node 0' (the startup log's and `cpuinfer info`'s line)."""
    where = "unbound (nobind)" if cpus is None else format_cpu_list(cpus)
    return f"rank {rank} -> cores {where}" + ("" if node is None else f" -> NUMA node {node}")


def format_layout(layout: list[Binding]) -> list[str]:
    """describe_rank for every rank of a layout, rank order."""
    return [describe_rank(rank, b.cpus, b.node) for rank, b in enumerate(layout)]


def layout_report(topology: Topology | None = None, world_sizes: Iterable[int] = ()) -> dict[str, Any]:
    """JSON-able layouts for `cpuinfer info`: one rank, one rank per visible node (or the list's ranks), and
    `world_sizes` (what `cpuinfer info -dp N -tp M` asks for)."""
    name, value = _bind_setting()
    report: dict[str, Any] = {"bind": f"{name}={value}", "layouts": []}
    try:
        topology = topology or Topology.read()
        sizes = [1, *world_sizes]
        if value == "auto":
            sizes.append(len(visible_nodes(topology)))
        elif value != "nobind":
            sizes = [len(value.split("|")), *world_sizes]
    except EnvError as e:
        report["error"] = str(e)
        return report
    for size in sorted(set(sizes)):
        entry: dict[str, Any] = {"world_size": size}
        try:
            entry["ranks"] = [{"cpus": b.cpus, "node": b.node} for b in describe_layout(size, topology)]
        except EnvError as e:
            entry["error"] = str(e)
        report["layouts"].append(entry)
    return report


_warned = False


def bind_memory(node: int) -> bool:
    """set_mempolicy(MPOL_BIND, node) for this process's future allocations; False (one warning) if denied."""
    global _warned
    nodes = numa_nodes()
    if len(nodes) <= 1:
        return True  # one node: nothing to choose
    MPOL_BIND = 2
    mask = ctypes.c_ulong(1 << node)
    err = 0
    lib = ctypes.util.find_library("numa")
    try:
        if lib:
            numa = ctypes.CDLL(lib, use_errno=True)
            rc = numa.set_mempolicy(MPOL_BIND, ctypes.byref(mask), ctypes.c_ulong(node + 2))
        else:
            libc = ctypes.CDLL(None, use_errno=True)
            nr = {"x86_64": 238, "aarch64": 237, "s390x": 270, "ppc64le": 261}.get(os.uname().machine)
            if nr is None:
                raise OSError("unknown syscall number")
            rc = libc.syscall(nr, MPOL_BIND, ctypes.byref(mask), ctypes.c_ulong(node + 2))
        err = ctypes.get_errno() if rc != 0 else 0
    except (OSError, AttributeError) as exc:
        err = -1
        if not _warned:
            logger.warning("cpuinfer: cannot bind memory to NUMA node %d (%s); continuing unbound", node, exc)
            _warned = True
        return False
    if err and not _warned:
        logger.warning(
            "cpuinfer: the OS denied binding memory to NUMA node %d (%s); continuing unbound "
            "(containers often need --cap-add SYS_NICE)",
            node,
            os.strerror(err),
        )
        _warned = True
    return err == 0


def apply_binding(binding: Binding) -> None:
    """Size torch's thread team to the CPUs and pin thread i to cpus[i]; bind memory to the node."""
    if binding.cpus is None:
        return
    import torch

    import cpuinfer

    torch.set_num_threads(len(binding.cpus))
    cpuinfer._C.bind_threads(binding.cpus)
    if binding.node is not None:
        bind_memory(binding.node)


def bind_from_env(rank: int = 0, world_size: int = 1) -> Binding:
    """resolve_binding + apply_binding; returns what was applied."""
    binding = resolve_binding(rank, world_size)
    apply_binding(binding)
    return binding
