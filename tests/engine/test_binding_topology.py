"""`auto` binding and core lists on fake sysfs trees: every rank's CPUs and NUMA node, written out by hand
from vLLM's documented rule (rank N on the N-th visible node, its physical cores, reserved cores off the
end) and ours for more ranks than nodes (ceil(ranks / nodes) consecutive ranks per node, cores split
contiguously). Pure Python: nothing is bound."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from cpuinfer.envs import EnvError
from cpuinfer.platform import threads
from cpuinfer.platform.threads import Binding, Topology

VARS = (
    "VLLM_CPU_OMP_THREADS_BIND",
    "CPUINFER_OMP_THREADS_BIND",
    "VLLM_CPU_NUM_OF_RESERVED_CPU",
    "CPUINFER_NUM_OF_RESERVED_CPU",
    "CPU_VISIBLE_MEMORY_NODES",
    "CPUINFER_VISIBLE_MEMORY_NODES",
)
EVERY_CPU = range(256)  # the affinity mask the trees are read with unless a test narrows it


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in VARS:
        monkeypatch.delenv(name, raising=False)


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def make_tree(root: Path, nodes: dict[int, str], siblings, online: str | None = None) -> Path:
    """A sysfs tree: node cpulists, each CPU's thread_siblings_list (siblings(cpu) -> text), the online list."""
    for node, cpulist in nodes.items():
        write(root, f"sys/devices/system/node/node{node}/cpulist", cpulist)
    for cpu in range(64):
        text = siblings(cpu)
        if text is not None:
            write(root, f"sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list", text)
    if online is not None:
        write(root, "sys/devices/system/cpu/online", online)
    return root


def two_sockets(root: Path, online: str = "0-31") -> Path:
    """2 nodes x 8 cores, SMT-2 numbered the Intel way: CPU c and c+16 share a core ("0,16")."""
    return make_tree(
        root,
        {0: "0-7,16-23", 1: "8-15,24-31"},
        lambda c: f"{c % 16},{c % 16 + 16}" if c < 32 else None,
        online,
    )


def four_nodes(root: Path) -> Path:
    """4 nodes x 4 cores, SMT-2 numbered the AMD/Arm way: CPUs 2k and 2k+1 share a core ("0-1")."""
    return make_tree(
        root,
        {n: f"{8 * n}-{8 * n + 7}" for n in range(4)},
        lambda c: f"{c - c % 2}-{c - c % 2 + 1}" if c < 32 else None,
        "0-31",
    )


def layout(root: Path, world_size: int, affinity=EVERY_CPU) -> list[tuple[list[int] | None, int | None]]:
    return [(b.cpus, b.node) for b in threads.describe_layout(world_size, Topology.read(str(root), affinity))]


# --- auto, as many ranks as nodes or fewer: vLLM's rule ------------------------------------------------


def test_two_sockets_one_rank_takes_node0_physical_cores(tmp_path):
    assert layout(two_sockets(tmp_path), 1) == [([0, 1, 2, 3, 4, 5, 6, 7], 0)]


def test_two_sockets_two_ranks_reserve_one_core_each_by_default(tmp_path):
    assert layout(two_sockets(tmp_path), 2) == [([0, 1, 2, 3, 4, 5, 6], 0), ([8, 9, 10, 11, 12, 13, 14], 1)]


def test_two_sockets_reserved_zero_and_two(tmp_path, monkeypatch):
    root = two_sockets(tmp_path)
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    assert layout(root, 2) == [([0, 1, 2, 3, 4, 5, 6, 7], 0), ([8, 9, 10, 11, 12, 13, 14, 15], 1)]
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "2")
    assert layout(root, 1) == [([0, 1, 2, 3, 4, 5], 0)]
    assert layout(root, 2) == [([0, 1, 2, 3, 4, 5], 0), ([8, 9, 10, 11, 12, 13], 1)]


def test_four_nodes_adjacent_siblings(tmp_path, monkeypatch):
    root = four_nodes(tmp_path)
    assert layout(root, 4) == [([0, 2, 4], 0), ([8, 10, 12], 1), ([16, 18, 20], 2), ([24, 26, 28], 3)]
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    assert layout(root, 4) == [([0, 2, 4, 6], 0), ([8, 10, 12, 14], 1), ([16, 18, 20, 22], 2), ([24, 26, 28, 30], 3)]
    assert layout(root, 2) == [([0, 2, 4, 6], 0), ([8, 10, 12, 14], 1)]


def test_visible_memory_nodes_mask_and_order(tmp_path, monkeypatch):
    root = four_nodes(tmp_path)
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    monkeypatch.setenv("CPU_VISIBLE_MEMORY_NODES", "3,1")
    assert layout(root, 2) == [([24, 26, 28, 30], 3), ([8, 10, 12, 14], 1)]
    assert layout(root, 1) == [([24, 26, 28, 30], 3)]
    monkeypatch.setenv("CPU_VISIBLE_MEMORY_NODES", "2")
    assert layout(root, 1) == [([16, 18, 20, 22], 2)]
    monkeypatch.setenv("CPUINFER_VISIBLE_MEMORY_NODES", "0-1")  # the CPUINFER_ spelling wins
    assert layout(root, 2) == [([0, 2, 4, 6], 0), ([8, 10, 12, 14], 1)]


# --- auto, more ranks than nodes: ceil(ranks / nodes) per node, cores split contiguously ------------------


def test_two_ranks_on_one_node(tmp_path, monkeypatch):
    root = two_sockets(tmp_path)
    monkeypatch.setenv("CPU_VISIBLE_MEMORY_NODES", "1")  # -dp 2 on one node
    assert layout(root, 2) == [([8, 9, 10], 1), ([12, 13, 14], 1)]
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    assert layout(root, 2) == [([8, 9, 10, 11], 1), ([12, 13, 14, 15], 1)]


def test_four_ranks_on_two_nodes(tmp_path, monkeypatch):
    root = two_sockets(tmp_path)
    assert layout(root, 4) == [([0, 1, 2], 0), ([4, 5, 6], 0), ([8, 9, 10], 1), ([12, 13, 14], 1)]
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    assert layout(root, 4) == [([0, 1, 2, 3], 0), ([4, 5, 6, 7], 0), ([8, 9, 10, 11], 1), ([12, 13, 14, 15], 1)]
    # 3 ranks: two share node 0, the third has node 1 to itself.
    assert layout(root, 3) == [([0, 1, 2, 3], 0), ([4, 5, 6, 7], 0), ([8, 9, 10, 11, 12, 13, 14, 15], 1)]


def test_more_ranks_than_nodes_on_four_nodes(tmp_path, monkeypatch):
    root = four_nodes(tmp_path)
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    assert layout(root, 8) == [
        ([0, 2], 0),
        ([4, 6], 0),
        ([8, 10], 1),
        ([12, 14], 1),
        ([16, 18], 2),
        ([20, 22], 2),
        ([24, 26], 3),
        ([28, 30], 3),
    ]
    # 6 ranks: ceil(6 / 4) = 2 per node fills nodes 0-2; node 3 stays free.
    assert layout(root, 6) == [([0, 2], 0), ([4, 6], 0), ([8, 10], 1), ([12, 14], 1), ([16, 18], 2), ([20, 22], 2)]
    assert layout(root, 5) == [([0, 2], 0), ([4, 6], 0), ([8, 10], 1), ([12, 14], 1), ([16, 18, 20, 22], 2)]


def test_uneven_split_gives_the_first_ranks_one_more(tmp_path, monkeypatch):
    root = make_tree(tmp_path, {0: "0-4"}, lambda c: str(c) if c < 5 else None, "0-4")
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    assert layout(root, 2) == [([0, 1, 2], 0), ([3, 4], 0)]
    assert layout(root, 3) == [([0, 1], 0), ([2, 3], 0), ([4], 0)]
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU")
    assert layout(root, 2) == [([0, 1], 0), ([3], 0)]
    # The unset default never takes a rank's only core: -tp 2 on a 2-core machine still runs.
    small = make_tree(tmp_path / "small", {0: "0-1"}, lambda c: str(c) if c < 2 else None, "0-1")
    assert layout(small, 2) == [([0], 0), ([1], 0)]


def test_more_ranks_than_cores_is_an_error(tmp_path):
    root = make_tree(tmp_path, {0: "0-1"}, lambda c: str(c) if c < 2 else None, "0-1")
    with pytest.raises(EnvError, match=r"VLLM_CPU_OMP_THREADS_BIND=auto: 3 ranks put 3 on NUMA node 0, which has 2"):
        layout(root, 3)


def test_reserved_leaving_no_core_is_an_error(tmp_path, monkeypatch):
    root = two_sockets(tmp_path)
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "4")
    assert layout(root, 2) == [([0, 1, 2, 3], 0), ([8, 9, 10, 11], 1)]
    with pytest.raises(EnvError, match=r"VLLM_CPU_NUM_OF_RESERVED_CPU=4 leaves no core .* node 0 \(4 usable"):
        layout(root, 4)
    monkeypatch.setenv("CPUINFER_NUM_OF_RESERVED_CPU", "8")
    with pytest.raises(EnvError, match="CPUINFER_NUM_OF_RESERVED_CPU=8"):
        layout(root, 1)


# --- what the tree says about usable CPUs: offline, SMT, cgroup, affinity --------------------------------


def test_offline_cpus_are_never_chosen(tmp_path, monkeypatch):
    # CPUs 3 and 5 are offline (node 0 still lists them); their siblings 19 and 21 are online, so cores 3
    # and 5 are reached through them. The other hyper-threads are siblings of chosen CPUs.
    root = two_sockets(tmp_path, online="0-2,4,6-31")
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    assert layout(root, 1) == [([0, 1, 2, 4, 6, 7, 19, 21], 0)]
    # Core 3 is wholly off when both its threads are.
    root = two_sockets(tmp_path / "b", online="0-2,4-18,20-31")
    assert layout(root, 2) == [([0, 1, 2, 4, 5, 6, 7], 0), ([8, 9, 10, 11, 12, 13, 14, 15], 1)]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "3")
    with pytest.raises(EnvError, match="names CPU 3, which is offline"):
        layout(root, 1)


def test_no_smt_and_no_numa_directory(tmp_path):
    root = make_tree(tmp_path, {}, lambda c: str(c) if c < 4 else None, "0-3")
    assert layout(root, 1) == [([0, 1, 2, 3], 0)]
    assert layout(root, 2) == [([0], 0), ([2], 0)]


def test_cgroup_v2_root_cpuset(tmp_path, monkeypatch):
    root = two_sockets(tmp_path)
    write(root, "sys/fs/cgroup/cpuset.cpus.effective", "4-11,20-27")
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    assert layout(root, 1) == [([4, 5, 6, 7], 0)]
    assert layout(root, 2) == [([4, 5, 6, 7], 0), ([8, 9, 10, 11], 1)]


def test_cgroup_v2_nearest_cpuset_wins(tmp_path, monkeypatch):
    root = two_sockets(tmp_path)
    write(root, "proc/self/cgroup", "0::/kubepods/pod1/ctr")
    write(root, "sys/fs/cgroup/cpuset.cpus.effective", "0-31")
    write(root, "sys/fs/cgroup/kubepods/pod1/cpuset.cpus.effective", "8-15")  # ctr/ has no cpuset file
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    assert layout(root, 1) == [([8, 9, 10, 11, 12, 13, 14, 15], 1)]  # node 0 has no usable core: not visible
    assert layout(root, 2) == [([8, 9, 10, 11], 1), ([12, 13, 14, 15], 1)]
    monkeypatch.setenv("CPU_VISIBLE_MEMORY_NODES", "0")
    with pytest.raises(EnvError, match="CPU_VISIBLE_MEMORY_NODES='0' names NUMA node 0, which has no CPU"):
        layout(root, 1)


def test_cgroup_v1_cpuset_inside_a_container(tmp_path, monkeypatch):
    root = two_sockets(tmp_path)
    write(root, "proc/self/cgroup", "4:memory:/docker/abc\n3:cpuset:/docker/abc\n0::/")
    write(root, "sys/fs/cgroup/cpuset/cpuset.effective_cpus", "0-3,16-19")  # the container's own root
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    assert layout(root, 1) == [([0, 1, 2, 3], 0)]


def test_affinity_mask_narrows_too(tmp_path, monkeypatch):
    root = two_sockets(tmp_path)
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    assert layout(root, 2, affinity={0, 1, 2, 3, 8, 9}) == [([0, 1, 2, 3], 0), ([8, 9], 1)]
    assert layout(root, 2, affinity={16, 17, 24}) == [([16, 17], 0), ([24], 1)]  # hyper-threads only


# --- core lists --------------------------------------------------------------------------------------------


def test_core_lists_per_rank(tmp_path, monkeypatch):
    root = four_nodes(tmp_path)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3|8-11")
    assert layout(root, 2) == [([0, 1, 2, 3], 0), ([8, 9, 10, 11], 1)]  # as written: siblings kept
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "24,26|0-1,8")
    assert layout(root, 2) == [([24, 26], 3), ([0, 1, 8], 0)]  # a list's node is its first CPU's
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "3")  # only auto reserves
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1|2|3")
    assert layout(root, 4) == [([0], 0), ([1], 0), ([2], 0), ([3], 0)]


def test_core_list_errors_name_the_variable(tmp_path, monkeypatch, caplog):
    root = four_nodes(tmp_path)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3|8-11")
    with pytest.raises(EnvError, match=r"VLLM_CPU_OMP_THREADS_BIND='0-3\|8-11' gives 2 CPU lists for 3 rank"):
        layout(root, 3)
    with pytest.raises(EnvError, match="names CPU 8, which this process may not use"):
        layout(root, 2, affinity=range(8))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3|2-5")
    with caplog.at_level(logging.WARNING, logger="cpuinfer.platform.threads"):
        assert layout(root, 2) == [([0, 1, 2, 3], 0), ([2, 3, 4, 5], 0)]
    assert "gives CPU 2 to ranks 0 and 1" in caplog.text
    monkeypatch.setenv("CPUINFER_OMP_THREADS_BIND", "0-x")
    with pytest.raises(EnvError, match="CPUINFER_OMP_THREADS_BIND='0-x' is not a CPU list"):
        layout(root, 1)


def test_nobind_for_every_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert layout(four_nodes(tmp_path), 3) == [(None, None)] * 3


def test_visible_memory_nodes_errors(tmp_path, monkeypatch):
    root = four_nodes(tmp_path)
    monkeypatch.setenv("CPU_VISIBLE_MEMORY_NODES", "7")
    with pytest.raises(
        EnvError, match=r"CPU_VISIBLE_MEMORY_NODES='7' names NUMA node 7, but this machine has nodes \[0, 1, 2, 3\]"
    ):
        layout(root, 1)
    monkeypatch.setenv("CPU_VISIBLE_MEMORY_NODES", "one")
    with pytest.raises(EnvError, match="CPU_VISIBLE_MEMORY_NODES='one' is not a list of NUMA nodes"):
        layout(root, 1)


def test_resolve_binding_is_the_layout_entry(tmp_path):
    topo = Topology.read(str(four_nodes(tmp_path)), EVERY_CPU)
    assert threads.resolve_binding(2, 4, topo) == Binding([16, 18, 20], 2)
    with pytest.raises(ValueError, match="outside world size"):
        threads.resolve_binding(4, 4, topo)


# --- the one-line-per-rank description ---------------------------------------------------------------


def test_format_layout_lines(tmp_path, monkeypatch):
    assert threads.format_cpu_list([0, 2, 4, 5, 6, 9]) == "0,2,4-6,9"
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    topo = Topology.read(str(two_sockets(tmp_path)), EVERY_CPU)
    assert threads.format_layout(threads.describe_layout(2, topo)) == [
        "rank 0 -> cores 0-7 -> NUMA node 0",
        "rank 1 -> cores 8-15 -> NUMA node 1",
    ]
    assert threads.describe_rank(3, None, None) == "rank 3 -> cores unbound (nobind)"


def test_layout_report_for_info(tmp_path, monkeypatch):
    topo = Topology.read(str(four_nodes(tmp_path)), EVERY_CPU)
    report = threads.layout_report(topo)
    assert report["bind"] == "VLLM_CPU_OMP_THREADS_BIND=auto"
    assert [e["world_size"] for e in report["layouts"]] == [1, 4]
    assert report["layouts"][0]["ranks"] == [{"cpus": [0, 2, 4, 6], "node": 0}]
    assert report["layouts"][1]["ranks"][3] == {"cpus": [24, 26, 28], "node": 3}
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3|8-11")
    report = threads.layout_report(topo)
    assert [e["world_size"] for e in report["layouts"]] == [2]
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "-1")
    report = threads.layout_report(topo)
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" in report["layouts"][0]["error"]


def test_info_renders_the_layout(tmp_path, monkeypatch):
    from cpuinfer._info import _layout_lines

    topo = Topology.read(str(two_sockets(tmp_path)), EVERY_CPU)
    assert _layout_lines(threads.layout_report(topo)) == [
        "Layout:     VLLM_CPU_OMP_THREADS_BIND=auto (world size = data x tensor x pipeline parallel size)",
        "  world size 1: rank 0 -> cores 0-7 -> NUMA node 0",
        "  world size 2: rank 0 -> cores 0-6 -> NUMA node 0",
        "                rank 1 -> cores 8-14 -> NUMA node 1",
    ]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert _layout_lines(threads.layout_report(topo))[1] == "  world size 1: rank 0 -> cores unbound (nobind)"
