"""Precompiled editable installs (_build_backend/_cpuinfer_build_backend.py).

The wheel checks run anywhere scikit-build-core is importable, on small
hand-made wheels. The end-to-end checks need an environment where cpuinfer was
installed with CPUINFER_USE_PRECOMPILED=1 (`nox -s precompiled` sets
CPUINFER_TEST_PRECOMPILED=1 there).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
E2E = os.environ.get("CPUINFER_TEST_PRECOMPILED") == "1"


@pytest.fixture(scope="module")
def backend():
    pytest.importorskip("scikit_build_core")
    spec = importlib.util.spec_from_file_location(
        "_cpuinfer_build_backend", ROOT / "_build_backend" / "_cpuinfer_build_backend.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_wheel(folder: Path, files: dict[str, bytes], tag: str | None = None) -> Path:
    """A cpuinfer wheel with the given files under cpuinfer/ and a correct RECORD."""
    from packaging.tags import sys_tags

    tag = tag or str(next(iter(sys_tags())))
    path = folder / f"cpuinfer-1.0-{tag}.whl"
    entries = {f"cpuinfer/{k}": v for k, v in files.items()}
    entries["cpuinfer-1.0.dist-info/METADATA"] = b"Metadata-Version: 2.1\nName: cpuinfer\nVersion: 1.0\n"
    rows = []
    for name, data in entries.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append(f"{name},sha256={digest},{len(data)}")
    rows.append("cpuinfer-1.0.dist-info/RECORD,,")
    entries["cpuinfer-1.0.dist-info/RECORD"] = ("\n".join(rows) + "\n").encode()
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
    return path


COMPLETE = {
    "_C_generic.abi3.so": b"\x7fELF",
    "_cpu_probe.abi3.so": b"\x7fELF",
    "_isa_table.json": b"{}",
    "_build_info.json": b'{"abi_stamp": "x"}',
}


def test_complete_wheel_yields_only_the_compiled_files(backend, tmp_path):
    wheel = make_wheel(tmp_path, {**COMPLETE, "ops.py": b"# also in src"})
    zf, _ = backend._check_wheel(wheel)
    names = sorted(m.split("/", 1)[1] for m in backend._compiled_members(zf))
    assert names == sorted(COMPLETE)  # ops.py exists in src/cpuinfer: never overwritten


def test_wheel_for_another_architecture_is_refused(backend, tmp_path):
    other = "aarch64" if platform.machine() != "aarch64" else "x86_64"
    wheel = make_wheel(tmp_path, COMPLETE, tag=f"cp311-cp311-manylinux_2_28_{other}")
    with pytest.raises(backend.PrecompiledError, match=r"which this interpreter .* cannot load"):
        backend._check_wheel(wheel)


def test_corrupt_wheel_is_refused(backend, tmp_path):
    wheel = make_wheel(tmp_path, COMPLETE)
    wheel.write_bytes(wheel.read_bytes()[:100])  # truncated download
    with pytest.raises(backend.PrecompiledError, match="not a readable wheel"):
        backend._check_wheel(wheel)


def test_tampered_file_is_refused(backend, tmp_path):
    wheel = make_wheel(tmp_path, COMPLETE)
    with zipfile.ZipFile(wheel, "a") as zf:  # a second, different copy of a listed file
        zf.writestr("cpuinfer/_isa_table.json", b'{"changed": 1}')
    with pytest.raises(backend.PrecompiledError, match="does not match its RECORD hash"):
        backend._check_wheel(wheel)


def test_wheel_missing_a_compiled_file_is_refused(backend, tmp_path):
    files = {k: v for k, v in COMPLETE.items() if not k.startswith("_C_generic")}
    zf, _ = backend._check_wheel(make_wheel(tmp_path, files))
    with pytest.raises(backend.PrecompiledError, match="lacks _C_generic"):
        backend._compiled_members(zf)


def test_missing_location_is_a_clear_error(backend, tmp_path):
    with pytest.raises(backend.PrecompiledError, match="no such file"):
        backend._fetch(str(tmp_path / "nope.whl"), tmp_path)


# --- end to end, in a precompiled editable install --------------------------------

e2e = pytest.mark.skipif(not E2E, reason="needs a precompiled editable install (nox -s precompiled)")


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("CPUINFER_")}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=600)


@e2e
def test_installed_from_the_checkout_with_a_marker():
    r = run("import cpuinfer; print(cpuinfer.__file__)")
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).resolve() == ROOT / "src" / "cpuinfer" / "__init__.py"
    marker = json.loads((ROOT / "src" / "cpuinfer" / "_precompiled.json").read_text())
    assert marker["wheel"].startswith("cpuinfer-") and marker["files"]
    assert all((ROOT / "src" / "cpuinfer" / f).is_file() for f in marker["files"])


@e2e
def test_python_edits_take_effect_without_reinstalling():
    probe = ROOT / "src" / "cpuinfer" / "_edit_probe_tmp.py"
    try:
        probe.write_text("VALUE = 41\n")
        assert run("from cpuinfer import _edit_probe_tmp as m; print(m.VALUE)").stdout.strip() == "41"
        probe.write_text("VALUE = 42\n")
        assert run("from cpuinfer import _edit_probe_tmp as m; print(m.VALUE)").stdout.strip() == "42"
    finally:
        probe.unlink(missing_ok=True)


@e2e
def test_edited_kernel_sources_make_the_precompiled_kernels_a_clear_error():
    stale = ROOT / "csrc" / "common" / "_stale_probe_tmp.h"
    try:
        stale.write_text("// a kernel source edit after the precompiled install\n")
        r = run("import cpuinfer")
        assert r.returncode != 0
        assert "do not match the sources" in r.stderr and "precompiled wheel built from other sources" in r.stderr
        assert "without CPUINFER_USE_PRECOMPILED" in r.stderr
    finally:
        stale.unlink(missing_ok=True)
    assert run("import cpuinfer").returncode == 0


@e2e
def test_pip_refuses_a_wheel_for_another_architecture(tmp_path):
    src = Path(os.environ["CPUINFER_PRECOMPILED_WHEEL_LOCATION"])
    other = "aarch64" if platform.machine() != "aarch64" else "x86_64"
    bad = tmp_path / src.name.replace(platform.machine(), other)
    shutil.copy(src, bad)
    env = {**os.environ, "CPUINFER_USE_PRECOMPILED": "1", "CPUINFER_PRECOMPILED_WHEEL_LOCATION": str(bad)}
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-e", str(ROOT)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode != 0
    assert "cannot load" in r.stdout + r.stderr and other in r.stdout + r.stderr
