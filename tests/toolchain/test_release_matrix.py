"""The cibuildwheel matrix in pyproject.toml is the one the release promises."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYTHONS = ["cp310", "cp311", "cp312", "cp313"]


def cibuildwheel_command() -> list[str]:
    """This environment's cibuildwheel (the test extra's, the version ci/release.yml pins)."""
    if importlib.util.find_spec("cibuildwheel") is None:
        pytest.skip("cibuildwheel is not installed (pip install -e '.[test]'; it needs Python 3.11+)")
    return [sys.executable, "-m", "cibuildwheel"]


def identifiers(platform: str, archs: str) -> set[str]:
    r = subprocess.run(
        [*cibuildwheel_command(), "--print-build-identifiers", "--platform", platform, "--archs", archs, str(ROOT)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    return set(r.stdout.split())


def test_release_pins_the_tested_cibuildwheel():
    """The identifiers below are printed by the cibuildwheel that the release workflow runs."""
    cibuildwheel_command()
    (pin,) = re.findall(r"uses: pypa/cibuildwheel@v(\S+)", (ROOT / "ci" / "release.yml").read_text())
    assert metadata.version("cibuildwheel") == pin
    assert int(pin.split(".")[0]) >= 4  # the options used in pyproject.toml (audit-command, test-sources)


def test_linux_matrix():
    got = identifiers("linux", "x86_64,aarch64,s390x")
    want = {f"{py}-manylinux_{arch}" for py in PYTHONS for arch in ("x86_64", "aarch64", "s390x")}
    assert got == want  # no musllinux, PyPy, 32-bit or free-threaded builds


def test_macos_matrix():
    assert identifiers("macos", "arm64") == {f"{py}-macosx_arm64" for py in PYTHONS}


def test_workflow_copy_is_current():
    """GitHub reads .github/workflows/; ci/release.yml is the maintained original."""
    assert (ROOT / ".github" / "workflows" / "release.yml").read_text() == (ROOT / "ci" / "release.yml").read_text()


def test_abi3_session_audits_with_the_release_auditor():
    """`nox -s abi3` runs the abi3audit that cibuildwheel's audit step pins (its constraints for CPython 3.12)."""
    cibuildwheel_command()
    from importlib import resources

    constraints = (resources.files("cibuildwheel") / "resources" / "constraints-python312.txt").read_text()
    (release,) = re.findall(r"^abi3audit==(\S+)", constraints, re.M)
    (nox_pin,) = re.findall(r'^ABI3AUDIT = "abi3audit==([^"]+)"', (ROOT / "noxfile.py").read_text(), re.M)
    assert nox_pin == release
