"""Every routine job of cpuinfer, one nox session each.

    nox                      the default set: lint, tests (what CI runs)
    nox -s tests             build every variant of this architecture, run pytest
    nox -s lint              ruff
    nox -s cross -- aarch64  C++ kernel tests of every aarch64 variant under qemu-aarch64
                             (also: s390x, apple (Apple variants via clang), avx512 (SIMDe);
                             no argument: all four)

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


# --- C++ kernel tests: cross-compiled under qemu-user, and AVX-512 on SIMDe ---

CROSS_TARGETS = {
    # name: (toolchain file or None, extra cmake args, extra env for the test programs)
    "aarch64": ("cmake/toolchains/aarch64-linux-gnu.cmake", [], {"CPUINFER_TEST_REQUIRE_CPU": "1"}),
    # qemu-s390x 7.2 executes z15 (vxe2) instructions but does not advertise
    # them in its hwcaps, so the vxe2 program is told to run anyway.
    "s390x": ("cmake/toolchains/s390x-linux-gnu.cmake", [], {"CPUINFER_TEST_IGNORE_CPU": "1"}),
    "apple": ("cmake/toolchains/apple-check-clang.cmake", [], {"CPUINFER_TEST_REQUIRE_CPU": "1"}),
    "avx512": (None, ["-DCPUINFER_SIMDE_EMULATION=ON", "-DCPUINFER_ISAS=generic,avx512,avx512bf16,amx"],
               {"CPUINFER_TEST_REQUIRE_CPU": "0"}),
}


def run_cpp_tests(session: nox.Session, target: str) -> None:
    """Configure, build and ctest the C++ kernel test program for one target."""
    toolchain, extra, env = CROSS_TARGETS[target]
    build = f"build/nox-cpp-{target}"
    args = ["-S", ".", "-B", build, "-G", "Ninja", "-DCPUINFER_BUILD_PYTHON=OFF", "-DCPUINFER_BUILD_TESTS=ON"]
    if toolchain:
        args.append(f"-DCMAKE_TOOLCHAIN_FILE={toolchain}")
    if not any(a.startswith("-DCPUINFER_ISAS=") for a in extra):
        args.append("-DCPUINFER_ISAS=all")
    session.run("cmake", *args, *extra)
    session.run("cmake", "--build", build, "--parallel", str(os.cpu_count() or 2))
    session.run("ctest", "--test-dir", build, "--output-on-failure", "--no-tests=error", env=env)


@nox.session
def cross(session: nox.Session) -> None:
    """C++ kernel tests of other architectures' variants under qemu-user, and of AVX-512 on SIMDe."""
    targets = session.posargs or list(CROSS_TARGETS)
    unknown = [t for t in targets if t not in CROSS_TARGETS]
    if unknown:
        session.error(f"unknown cross target(s) {unknown}; choose from {list(CROSS_TARGETS)}")
    session.install("cmake>=3.26", "ninja")
    for target in targets:
        run_cpp_tests(session, target)
