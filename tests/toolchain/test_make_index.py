"""ci/make_index.py: a folder of wheels becomes a PEP 503 index pip understands."""

from __future__ import annotations

import hashlib
import importlib.util
import re
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("make_index", ROOT / "ci" / "make_index.py")
make_index = importlib.util.module_from_spec(spec)
spec.loader.exec_module(make_index)


def fake_wheel(folder: Path, name: str, version: str, requires_python: str = ">=3.10") -> Path:
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(
            f"{name}-{version}.dist-info/METADATA",
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nRequires-Python: {requires_python}\n",
        )
    return path


def test_index_pages_links_and_hashes(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    a = fake_wheel(wheels, "cpuinfer", "1.0")
    fake_wheel(wheels, "cpuinfer", "1.1")
    fake_wheel(wheels, "Other_Pkg", "2.0", ">=3.9")
    out = tmp_path / "site"
    projects = make_index.build_index(wheels, out)
    assert set(projects) == {"cpuinfer", "other-pkg"}  # PEP 503 normalised names
    root = (out / "simple" / "index.html").read_text()
    assert '<a href="cpuinfer/">cpuinfer</a>' in root and '<a href="other-pkg/">' in root
    page = (out / "simple" / "cpuinfer" / "index.html").read_text()
    links = re.findall(r'href="([^"]+)"', page)
    assert len(links) == 2
    digest = hashlib.sha256(a.read_bytes()).hexdigest()
    assert f"../../packages/{a.name}#sha256={digest}" in links
    assert 'data-requires-python="&gt;=3.10"' in page
    for link in links:  # every link resolves to the copied wheel, relative to the project page
        target = (out / "simple" / "cpuinfer" / link.split("#")[0]).resolve()
        assert target.is_file()


def test_empty_folder_is_an_error(tmp_path):
    with pytest.raises(SystemExit, match=r"no \.whl files"):
        make_index.build_index(tmp_path, tmp_path / "site")
