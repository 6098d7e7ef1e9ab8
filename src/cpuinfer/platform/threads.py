"""Pin the inference threads (torch's OpenMP team, which the kernels share) and memory to cores / a NUMA node.

`VLLM_CPU_OMP_THREADS_BIND` (or `CPUINFER_OMP_THREADS_BIND`), as in vLLM:
- `auto` (default): one thread per physical core of the rank's NUMA node
  (hyper-thread siblings skipped), minus `VLLM_CPU_NUM_OF_RESERVED_CPU` cores
  kept free for the front end; `CPU_VISIBLE_MEMORY_NODES` picks the nodes.
- a core list, e.g. `0-29` or `0,2,4-7`; `a|b` gives one list per tensor-parallel rank.
- `nobind`: leave OMP_NUM_THREADS and the OS scheduler alone.
Thread i of the team is pinned to cpus[i]; memory allocation is bound to the
cores' node with set_mempolicy where the OS allows (a container that denies
it gets one warning, not a failure).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from dataclasses import dataclass

from cpuinfer import envs
from cpuinfer.envs import EnvError

logger = logging.getLogger(__name__)
SYS_CPU = "/sys/devices/system/cpu"
SYS_NODE = "/sys/devices/system/node"


def parse_cpu_list(text: str, name: str = "cpu list") -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]; a malformed list raises EnvError naming `name`."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if lo > hi or lo < 0:
                    raise ValueError
                cpus.extend(range(lo, hi + 1))
            else:
                c = int(part)
                if c < 0:
                    raise ValueError
                cpus.append(c)
        except ValueError:
            raise EnvError(
                f"{name}={text!r} is not a CPU list; use e.g. 0-29 or 0,2,4-7 ('|' between ranks), auto or nobind"
            ) from None
    if len(set(cpus)) != len(cpus):
        raise EnvError(f"{name}={text!r} lists a CPU twice")
    return cpus


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def numa_nodes() -> dict[int, list[int]]:
    """NUMA node -> its CPUs (one node holding every CPU when /sys has no node info)."""
    nodes = {}
    if os.path.isdir(SYS_NODE):
        for entry in sorted(os.listdir(SYS_NODE)):
            if entry.startswith("node") and entry[4:].isdigit():
                text = _read(f"{SYS_NODE}/{entry}/cpulist")
                if text:
                    nodes[int(entry[4:])] = parse_cpu_list(text, f"{SYS_NODE}/{entry}/cpulist")
    if not nodes:
        nodes[0] = sorted(os.sched_getaffinity(0))
    return nodes


def physical_cores(cpus: list[int]) -> list[int]:
    """The first hardware thread of each physical core among `cpus` (hyper-thread siblings dropped)."""
    chosen, seen = [], set()
    for c in sorted(cpus):
        siblings = _read(f"{SYS_CPU}/cpu{c}/topology/thread_siblings_list")
        key = tuple(parse_cpu_list(siblings, "thread_siblings_list")) if siblings else (c,)
        if key not in seen:
            seen.add(key)
            chosen.append(c)
    return chosen


@dataclass
class Binding:
    """Where one rank's threads go: None = leave alone."""

    cpus: list[int] | None
    node: int | None = None


def resolve_binding(rank: int = 0, world_size: int = 1) -> Binding:
    """Read the variables and work out this rank's CPUs and NUMA node; malformed values raise EnvError."""
    raw = envs.OMP_THREADS_BIND.raw()
    name, value = raw if raw else (envs.OMP_THREADS_BIND.names[-1], "auto")
    reserved = envs.NUM_OF_RESERVED_CPU.raw()
    n_reserved = envs.NUM_OF_RESERVED_CPU.get() if reserved else (1 if world_size > 1 else 0)
    nodes = numa_nodes()
    visible_raw = envs.VISIBLE_MEMORY_NODES.raw()
    if visible_raw:
        vname, vvalue = visible_raw
        visible = parse_cpu_list(vvalue, vname)
        unknown = [n for n in visible if n not in nodes]
        if unknown:
            raise EnvError(
                f"{vname}={vvalue!r} names NUMA node {unknown[0]}, but this machine has nodes {sorted(nodes)}"
            )
    else:
        visible = [n for n in sorted(nodes) if nodes[n]]
    allowed = os.sched_getaffinity(0)

    if value == "nobind":
        return Binding(None)
    if value == "auto":
        if rank >= len(visible):
            raise EnvError(f"{name}=auto: rank {rank} has no NUMA node (visible nodes: {visible})")
        node = visible[rank]
        cores = [c for c in physical_cores(nodes[node]) if c in allowed] or sorted(allowed)
        if n_reserved >= len(cores):
            raise EnvError(
                f"VLLM_CPU_NUM_OF_RESERVED_CPU={n_reserved} leaves no core for inference on node {node} "
                f"({len(cores)} usable physical cores)"
            )
        return Binding(cores[: len(cores) - n_reserved] if n_reserved else cores, node)
    per_rank = value.split("|")
    if len(per_rank) != world_size:
        raise EnvError(
            f"{name}={value!r} gives {len(per_rank)} CPU lists for {world_size} rank(s); separate one "
            "list per tensor-parallel rank with '|'"
        )
    cpus = parse_cpu_list(per_rank[rank], name)
    missing = [c for c in cpus if c not in allowed]
    if missing:
        raise EnvError(
            f"{name}={value!r} names CPU {missing[0]}, which this process may not use "
            f"(allowed: {_fmt(sorted(allowed))})"
        )
    node = next((n for n, cs in nodes.items() if cpus[0] in cs), None)
    return Binding(cpus, node)


def _fmt(cpus: list[int]) -> str:
    return ",".join(map(str, cpus))


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
