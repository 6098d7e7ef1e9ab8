"""Every routine job of cpuinfer, one nox session each.

    nox                      the default set: lint, tests (what CI runs)
    nox -s tests             build every variant of this architecture, run pytest
    nox -s lint              ruff

torch is always installed first and pinned: on these machines
`pip install torch==2.13.0` takes the CPU build that lies on disk, while an
unpinned request pulls a multi-GB CUDA build. Override with CPUINFER_TORCH_SPEC
(e.g. "torch --index-url https://download.pytorch.org/whl/cpu").
"""

from __future__ import annotations

import os
import shlex

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["lint", "tests"]

TORCH = shlex.split(os.environ.get("CPUINFER_TORCH_SPEC", "torch==2.13.0"))


def install_torch(session: nox.Session) -> None:
    """Install the pinned CPU torch before anything that depends on torch."""
    session.install(*TORCH)


def install_cpuinfer(session: nox.Session, *extras: str, isas: str = "all") -> None:
    """Build and install cpuinfer (non-editable) with the given kernel variants."""
    spec = f".[{','.join(extras)}]" if extras else "."
    session.install(spec, env={"CPUINFER_ISAS": isas})


@nox.session
def lint(session: nox.Session) -> None:
    """Static checks: ruff over the Python sources, tests, benchmarks and this file."""
    session.install("ruff")
    session.run("ruff", "check", "src", "tests", "noxfile.py", *(["benchmarks"] if os.path.isdir("benchmarks") else []))


@nox.session
def tests(session: nox.Session) -> None:
    """Build every variant of this architecture and run the test suite against the installed package."""
    install_torch(session)
    install_cpuinfer(session, "test")
    session.run("pytest", *(session.posargs or ["tests"]))
