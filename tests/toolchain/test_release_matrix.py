"""The cibuildwheel matrix in pyproject.toml is the one the release promises."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYTHONS = ["cp310", "cp311", "cp312", "cp313"]


def identifiers(platform: str, archs: str) -> set[str]:
    exe = shutil.which("cibuildwheel") or shutil.which("cibuildwheel", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("cibuildwheel is not installed (pip install -e '.[test]')")
    r = subprocess.run(
        [exe, "--print-build-identifiers", "--platform", platform, "--archs", archs, str(ROOT)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    return set(r.stdout.split())


def test_linux_matrix():
    got = identifiers("linux", "x86_64,aarch64,s390x")
    want = {f"{py}-manylinux_{arch}" for py in PYTHONS for arch in ("x86_64", "aarch64", "s390x")}
    assert got == want  # no musllinux, PyPy, 32-bit or free-threaded builds


def test_macos_matrix():
    assert identifiers("macos", "arm64") == {f"{py}-macosx_arm64" for py in PYTHONS}


def test_workflow_copy_is_current():
    """GitHub reads .github/workflows/; ci/release.yml is the maintained original."""
    assert (ROOT / ".github" / "workflows" / "release.yml").read_text() == (ROOT / "ci" / "release.yml").read_text()
