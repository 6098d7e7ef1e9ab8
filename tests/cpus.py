"""The CPUs this test process may hand to ranks.

Not os.sched_getaffinity(0) alone: an engine run in the test process (LLM, in-process EngineCore) pins the
main thread, as OpenMP thread 0, to the first inference CPU, and later tests would then see one CPU.
"""

from __future__ import annotations

import os


def machine_cpus() -> list[int]:
    """Online CPUs in this process's cgroup cpuset (whatever its main thread is pinned to now)."""
    from cpuinfer.platform.topology import Topology

    return sorted(Topology.read(affinity=range(os.cpu_count() or 1)).allowed)
