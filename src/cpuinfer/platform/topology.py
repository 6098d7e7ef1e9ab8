"""The machine as the thread binding sees it: NUMA nodes, SMT siblings, and the CPUs this process may use.

Everything is read from a sysfs tree under a root directory (`SYSFS_ROOT`, "/" on a real machine; a test
passes a fake tree), once, into a `Topology`:
- `sys/devices/system/node/node*/cpulist`: the CPUs of each NUMA node (no node directories, as in many
  containers and on non-NUMA kernels: one node 0 holding every online CPU);
- `sys/devices/system/cpu/cpu*/topology/thread_siblings_list`: the hardware threads of each CPU's core;
- `sys/devices/system/cpu/online`: offline CPUs are dropped everywhere (a node lists only its online CPUs);
- the cgroup cpuset: v2 `sys/fs/cgroup/<cgroup>/cpuset.cpus.effective`, v1
  `sys/fs/cgroup/cpuset/<cgroup>/cpuset.effective_cpus`, `<cgroup>` from `proc/self/cgroup` (the nearest
  ancestor that has the file: inside a container the mount's root is the container's own cgroup).
The CPUs a process may use are online ∩ cgroup cpuset ∩ its affinity mask (`os.sched_getaffinity(0)` as first
read, before any binding; or the `affinity` a caller passes).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from cpuinfer.envs import EnvError

SYSFS_ROOT = "/"  # where `sys/` and `proc/` are read from; tests point Topology.read(root=...) at a fake tree
_process_affinity: frozenset[int] | None = None


def process_affinity() -> frozenset[int]:
    """The CPUs this process was given, as first read here: binding an engine pins this (main) thread to one CPU,
    and a second engine in the same process must still see every CPU the process had, not that one."""
    global _process_affinity
    if _process_affinity is None:
        _process_affinity = frozenset(os.sched_getaffinity(0))
    return _process_affinity


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


def format_cpu_list(cpus: Iterable[int]) -> str:
    """[0, 1, 2, 3, 8] -> '0-3,8' (runs of consecutive CPUs in the order given)."""
    cpus = list(cpus)
    out, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            out.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(out)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _cpu_file(path: str) -> list[int] | None:
    """A sysfs CPU list file; None when absent or empty (an empty list means 'nothing to say' there)."""
    text = _read(path)
    return parse_cpu_list(text, path) if text else None


def _cgroup_cpuset(root: str) -> set[int] | None:
    """The CPUs of this process's cgroup cpuset (v2, else v1); None where no cpuset file is found."""
    groups = {}  # "v2" / "v1" -> path of this process's cgroup inside that hierarchy
    for line in (_read(os.path.join(root, "proc/self/cgroup")) or "").splitlines():
        num, controllers, path = [*line.split(":", 2), "", ""][:3]
        if num == "0" and controllers == "":
            groups["v2"] = path
        elif "cpuset" in controllers.split(","):
            groups["v1"] = path
    for kind, mount, name in (
        ("v2", "sys/fs/cgroup", "cpuset.cpus.effective"),
        ("v1", "sys/fs/cgroup/cpuset", "cpuset.effective_cpus"),
    ):
        parts = [p for p in groups.get(kind, "/").split("/") if p]
        for depth in range(len(parts), -1, -1):  # nearest ancestor with the file, up to the mount's root
            cpus = _cpu_file(os.path.join(root, mount, *parts[:depth], name))
            if cpus is not None:
                return set(cpus)
    return None


@dataclass(frozen=True)
class Topology:
    """NUMA nodes, SMT siblings and usable CPUs of one machine, as read once by `Topology.read`."""

    nodes: dict[int, list[int]]  # NUMA node -> its online CPUs, ascending
    allowed: frozenset[int]  # CPUs this process may run on: online ∩ cgroup cpuset ∩ affinity
    siblings: dict[int, tuple[int, ...]] = field(default_factory=dict)  # CPU -> its core's threads
    online: frozenset[int] | None = None  # None: the kernel did not say (every CPU counts as online)

    @classmethod
    def read(cls, root: str | None = None, affinity: Iterable[int] | None = None) -> Topology:
        """Read the tree under `root` (default SYSFS_ROOT); `affinity` defaults to process_affinity()."""
        root = SYSFS_ROOT if root is None else root
        cpu_dir = os.path.join(root, "sys/devices/system/cpu")
        node_dir = os.path.join(root, "sys/devices/system/node")
        online_list = _cpu_file(os.path.join(cpu_dir, "online"))
        online = None if online_list is None else frozenset(online_list)
        allowed = set(process_affinity() if affinity is None else affinity)
        if online is not None:
            allowed &= online
        cpuset = _cgroup_cpuset(root)
        if cpuset is not None:
            allowed &= cpuset

        nodes: dict[int, list[int]] = {}
        entries = sorted(os.listdir(node_dir)) if os.path.isdir(node_dir) else []
        for entry in entries:
            if entry.startswith("node") and entry[4:].isdigit():
                cpus = _cpu_file(os.path.join(node_dir, entry, "cpulist")) or []
                nodes[int(entry[4:])] = sorted(c for c in cpus if online is None or c in online)
        if not any(c in allowed for cpus in nodes.values() for c in cpus):
            # No NUMA information, or none that covers a CPU we may use (some sandboxes): one node.
            nodes = {0: sorted(online if online is not None else allowed)}

        siblings = {}
        for c in sorted({c for cpus in nodes.values() for c in cpus}):
            path = os.path.join(cpu_dir, f"cpu{c}", "topology", "thread_siblings_list")
            threads = _cpu_file(path)
            siblings[c] = tuple(sorted(threads)) if threads else (c,)
        return cls(dict(sorted(nodes.items())), frozenset(allowed), siblings, online)

    def physical_cores(self, cpus: Iterable[int]) -> list[int]:
        """One CPU per physical core among `cpus`: the lowest-numbered of its threads that `cpus` holds."""
        chosen, seen = [], set()
        for c in sorted(cpus):
            core = self.siblings.get(c, (c,))
            if core not in seen:
                seen.add(core)
                chosen.append(c)
        return chosen

    def usable_cores(self, node: int) -> list[int]:
        """The node's physical cores this process may use: allowed CPUs first, then one per core."""
        return self.physical_cores(c for c in self.nodes.get(node, []) if c in self.allowed)

    def node_of(self, cpu: int) -> int | None:
        """The NUMA node holding `cpu` (None if no node lists it)."""
        return next((n for n, cpus in self.nodes.items() if cpu in cpus), None)
