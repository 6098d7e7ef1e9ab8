"""Thread binding from VLLM_CPU_OMP_THREADS_BIND & co., read back from /proc."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cpuinfer.envs import EnvError
from cpuinfer.platform import threads


def test_parse_cpu_list():
    assert threads.parse_cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    for bad in ("0-", "a", "3-1", "1,1", "-2"):
        with pytest.raises(EnvError, match="X="):
            threads.parse_cpu_list(bad, "X")


@pytest.mark.parametrize("value", ["0-x", "0,,1", "0|1"])
def test_malformed_bind_names_variable(monkeypatch, value):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", value)
    with pytest.raises(EnvError, match="VLLM_CPU_OMP_THREADS_BIND"):
        threads.resolve_binding()


def test_cpuinfer_spelling_wins(monkeypatch):
    cpu = min(os.sched_getaffinity(0))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "garbage")
    monkeypatch.setenv("CPUINFER_OMP_THREADS_BIND", str(cpu))
    assert threads.resolve_binding().cpus == [cpu]


def test_auto_uses_physical_cores_minus_reserved(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    b = threads.resolve_binding()
    allowed = os.sched_getaffinity(0)
    assert b.cpus and set(b.cpus) <= allowed
    assert b.cpus == threads.physical_cores(b.cpus)  # no two siblings of one core
    if len(b.cpus) > 1:
        monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
        assert threads.resolve_binding().cpus == b.cpus[:-1]
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", str(len(b.cpus)))
    with pytest.raises(EnvError, match="RESERVED"):
        threads.resolve_binding()
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "-1")
    with pytest.raises(EnvError, match="VLLM_CPU_NUM_OF_RESERVED_CPU"):
        threads.resolve_binding()


def test_visible_memory_nodes_checked(monkeypatch):
    monkeypatch.setenv("CPU_VISIBLE_MEMORY_NODES", "99")
    with pytest.raises(EnvError, match="CPU_VISIBLE_MEMORY_NODES"):
        threads.resolve_binding()


def test_nobind_leaves_everything(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert threads.resolve_binding().cpus is None


BIND_CHECK = r"""
import os, re, torch, cpuinfer
from cpuinfer.platform.threads import bind_from_env
b = bind_from_env()
x = torch.randn(256, 256); (x @ x).sum()  # wake the team
lists = []
for tid in os.listdir('/proc/self/task'):
    status = open(f'/proc/self/task/{tid}/status').read()
    lists.append(re.search(r'Cpus_allowed_list:\s*(\S+)', status).group(1))
print(b.cpus, torch.get_num_threads(), sorted(lists))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="Linux-only affinity")
def test_threads_pinned_one_per_cpu():
    cpus = sorted(os.sched_getaffinity(0))[:2]
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cpus[::-1])))
    r = subprocess.run([sys.executable, "-c", BIND_CHECK], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip()
    assert line.startswith(str(cpus[::-1]))
    assert f"] {len(cpus)} [" in line
    # Each requested CPU is the sole allowed CPU of at least one thread (thread i -> cpus[i]).
    for c in cpus:
        assert f"'{c}'" in line, line


def test_a_second_binding_in_one_process_sees_every_cpu():
    """Binding pins the calling (main) thread to one CPU; a second engine in the same process (or a benchmark's
    child processes) must still be given every CPU the process had, not that one."""
    import subprocess
    import sys

    code = (
        "import os; from cpuinfer.platform.threads import bind_from_env; "
        "first = bind_from_env(); second = bind_from_env(); print(first.cpus == second.cpus, len(first.cpus))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "True", out
