"""Where Ray puts the data-parallel engine cores: one placement group per core, as vLLM does.

Each core gets a placement group of one bundle `{"CPU": c}` (strategy STRICT_PACK: a core never straddles two
machines), where c is CPUINFER_RAY_CPUS_PER_ENGINE, by default the CPUs of the cluster's smallest node, so that
each core has a machine to itself. Ray picks the nodes; the cores that land on one machine (IP address) then
split it as the mp backend's cores split one: each gets its local rank among them (`data_parallel_rank_local` /
`data_parallel_size_local`), which places its threads (VLLM_CPU_OMP_THREADS_BIND).

Connecting: `ray.init()`, as vLLM does: RAY_ADDRESS or the cluster `ray start` left on this machine, else a
new local single-node cluster (cores then share this machine, which is what -dp on mp does better).
"""

from __future__ import annotations

import logging
import os
import socket

from cpuinfer import envs
from cpuinfer.engine.ray_core import RayCorePlace

logger = logging.getLogger("cpuinfer.engine")

PLACEMENT_TIMEOUT_S = 120.0  # for Ray to reserve every bundle (nodes may still be joining)


def _check_reachable(address: str) -> None:
    """A clear error for a RAY_ADDRESS nobody listens on (ray.init would retry for minutes)."""
    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        return  # "auto", ray://..., or a form Ray resolves itself
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as exc:
        raise ValueError(
            f"cannot reach the Ray cluster at RAY_ADDRESS={address} ({exc.strerror or exc}): start it with "
            "`ray start --head` (and `ray start --address=<head>:6379` on the other machines), or fix RAY_ADDRESS"
        ) from None


def connect() -> None:
    """ray.init() unless this process is connected already."""
    import ray

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS", "")
    if address:
        _check_reachable(address)
    where = address or "a running cluster on this machine, else a new local one"
    logger.info("connecting to Ray (%s)", where)
    # Ray's driver prints a stack dump on every SIGTERM, which for a server is the normal way to stop.
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    ray.init(log_to_driver=True)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    logger.info("Ray cluster: %d alive node(s), %g CPUs", len(nodes), sum(n["Resources"].get("CPU", 0) for n in nodes))


def cpus_per_engine(nodes: list[dict]) -> float:
    """CPUINFER_RAY_CPUS_PER_ENGINE, or the CPUs of the smallest node that has any."""
    given = envs.RAY_CPUS_PER_ENGINE.get()
    if given:
        return float(given)
    sizes = [n["Resources"].get("CPU", 0) for n in nodes if n["Resources"].get("CPU", 0) > 0]
    if not sizes:
        raise ValueError("the Ray cluster has no node with CPUs to run an engine core on")
    return min(sizes)


def place_engine_cores(dp: int) -> list[RayCorePlace]:
    """Reserve one bundle per engine core; raises ValueError (no bundle left behind) if they do not fit."""
    import ray
    from ray.util import placement_group, placement_group_table, remove_placement_group

    connect()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    cpus = cpus_per_engine(nodes)
    fits = sum(int(n["Resources"].get("CPU", 0) // cpus) for n in nodes)
    if fits < dp:
        raise ValueError(
            f"--data-parallel-size {dp} with the ray backend needs {dp} bundles of {cpus:g} CPUs, but the Ray "
            f"cluster's {len(nodes)} alive node(s) hold {fits}: add nodes (ray start --address=<head>), lower "
            f"-dp, or set CPUINFER_RAY_CPUS_PER_ENGINE"
        )
    groups = [
        placement_group([{"CPU": cpus}], strategy="STRICT_PACK", name=f"cpuinfer-dp-{rank}-{os.getpid()}")
        for rank in range(dp)
    ]
    try:
        ray.get([g.ready() for g in groups], timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        for g in groups:
            remove_placement_group(g)
        raise ValueError(
            f"Ray did not reserve {dp} bundles of {cpus:g} CPUs within {PLACEMENT_TIMEOUT_S:.0f} s (other jobs "
            "hold the CPUs?): free them, add nodes, or lower -dp / CPUINFER_RAY_CPUS_PER_ENGINE"
        ) from None
    ips = {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in nodes}
    places = []
    for rank, g in enumerate(groups):
        node_id = placement_group_table(g)["bundles_to_node_id"][0]
        places.append(RayCorePlace(rank, g, node_id, ips.get(node_id, "?"), cpus))
    return places


def local_ranks(places: list[RayCorePlace]) -> list[tuple[int, int]]:
    """(local rank, cores on that machine) of each core, in rank order: how the cores of one machine split it.

    A machine is an IP address: Ray nodes started side by side on one machine (as tests do) share its cores."""
    by_machine: dict[str, list[int]] = {}
    for p in places:
        by_machine.setdefault(p.node_ip, []).append(p.rank)
    return [(by_machine[p.node_ip].index(p.rank), len(by_machine[p.node_ip])) for p in places]


def release(places: list[RayCorePlace]) -> None:
    """Remove the placement groups (their actors were killed first)."""
    import ray
    from ray.util import remove_placement_group

    for p in places:
        try:
            remove_placement_group(p.placement_group)
        except (ray.exceptions.RayError, ValueError):
            logger.debug("could not remove the placement group of engine core %d", p.rank, exc_info=True)
