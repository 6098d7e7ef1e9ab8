"""Shared fixtures: every kernel test runs once per kernel variant this CPU can run."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

import cpuinfer

RUNNABLE = [c.name for c in cpuinfer._selection.candidates if c.installed and c.runnable]
NOT_RUNNABLE = {c.name: c.missing for c in cpuinfer._selection.candidates if c.installed and not c.runnable}


def pytest_report_header():
    sel = cpuinfer._selection
    lines = [f"cpuinfer: platform {sel.platform}, selected {sel.name}; testing variants: {', '.join(RUNNABLE)}"]
    for name, missing in NOT_RUNNABLE.items():
        lines.append(f"cpuinfer: variant {name} is installed but this CPU lacks {', '.join(missing)}: not tested here")
    return lines


@pytest.fixture(params=RUNNABLE)
def kernels(request):
    """The extension module of one runnable variant (loaded directly, which is safe: this CPU runs it)."""
    return importlib.import_module(f"cpuinfer._C_{request.param}")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


_START_AFFINITY = os.sched_getaffinity(0)


@pytest.fixture(autouse=True)
def _main_thread_affinity():
    """Every test starts with the CPUs the session started with. An engine run in this process binds its
    OpenMP team, and the main thread is thread 0: it stays pinned to the first inference CPU, and a process
    started from it later (an engine core, a server, a tensor-parallel rank) would inherit that one CPU."""
    if os.sched_getaffinity(0) != _START_AFFINITY:
        os.sched_setaffinity(0, _START_AFFINITY)
    yield
