"""cpuinfer's PEP 517 backend: scikit-build-core, plus precompiled editable installs.

Every hook is scikit-build-core's, except that an editable install with
``CPUINFER_USE_PRECOMPILED=1`` (or vLLM's ``VLLM_USE_PRECOMPILED=1``) runs no
compiler and needs no CMake: it takes the compiled files (kernel variants, CPU
probe, ISA table, build facts — whatever the wheel holds under ``cpuinfer/``
that the source tree does not) from a prebuilt cpuinfer wheel, unpacks them
into ``src/cpuinfer/``, writes ``_precompiled.json`` (the dispatcher reads it
to explain a stale-kernel ABI mismatch), and returns an editable wheel whose
``.pth`` puts ``src/`` on ``sys.path``.

Where the wheel comes from: ``CPUINFER_PRECOMPILED_WHEEL_LOCATION`` (or
``VLLM_PRECOMPILED_WHEEL_LOCATION``), a local path or an http(s) URL; else
``pip download cpuinfer`` from ``CPUINFER_WHEEL_INDEX`` or pip's configured
index. The module name is prefixed so it cannot shadow anything on PyPI.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.util
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path

from scikit_build_core import build as _skbuild
from scikit_build_core.build import (  # re-exported hooks
    build_sdist,
    build_wheel,
    get_requires_for_build_sdist,
    get_requires_for_build_wheel,
    prepare_metadata_for_build_wheel,
)

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "cpuinfer"
MARKER = "_precompiled.json"


class PrecompiledError(RuntimeError):
    """The prebuilt wheel cannot be used for a precompiled editable install."""


def _envs():
    """src/cpuinfer/envs.py, loaded by path (importing cpuinfer would import torch)."""
    spec = importlib.util.spec_from_file_location("_cpuinfer_envs", PACKAGE / "envs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up while building the class
    spec.loader.exec_module(module)
    return module


def _use_precompiled() -> bool:
    return bool(_envs().USE_PRECOMPILED.get())


def get_requires_for_build_editable(config_settings=None):
    """scikit-build-core's list; nothing extra (no cmake, no ninja) when precompiled."""
    if _use_precompiled():
        return []
    return _skbuild.get_requires_for_build_editable(config_settings)


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    """scikit-build-core's metadata; when precompiled, the same made without looking for CMake."""
    if _use_precompiled():
        return _write_metadata(Path(metadata_directory))
    return _skbuild.prepare_metadata_for_build_editable(metadata_directory, config_settings)


def _write_metadata(dest: Path) -> str:
    """The .dist-info (METADATA, entry_points.txt) from pyproject.toml, version from git (setuptools-scm).

    scikit-build-core searches for CMake even to write metadata, which a
    precompiled install must not need; it uses the same pyproject-metadata
    library underneath, so the result is the same.
    """
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    from packaging.version import Version

    try:  # scikit-build-core vendors it
        from scikit_build_core._vendor.pyproject_metadata import StandardMetadata
    except ImportError:
        from pyproject_metadata import StandardMetadata
    from setuptools_scm import get_version

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = pyproject["project"]
    project["version"] = str(Version(get_version(root=str(ROOT), fallback_version="0.0.0")))
    project["dynamic"] = [d for d in project.get("dynamic", []) if d != "version"]
    meta = StandardMetadata.from_pyproject(pyproject, project_dir=ROOT)
    dist_info = dest / f"{meta.canonical_name.replace('-', '_')}-{meta.version}.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_bytes(bytes(meta.as_rfc822()))
    groups = {"console_scripts": meta.scripts, "gui_scripts": meta.gui_scripts, **meta.entrypoints}
    lines = []
    for group, entries in groups.items():
        if entries:
            lines.append(f"[{group}]")
            lines += [f"{name} = {target}" for name, target in entries.items()]
            lines.append("")
    if lines:
        (dist_info / "entry_points.txt").write_text("\n".join(lines))
    return dist_info.name


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    """A normal scikit-build-core editable build, or a precompiled one (see module docstring)."""
    if not _use_precompiled():
        return _skbuild.build_editable(wheel_directory, config_settings, metadata_directory)
    try:
        return _build_precompiled_editable(Path(wheel_directory))
    except PrecompiledError as exc:
        # One clear paragraph instead of a traceback from inside pip.
        sys.stderr.write(f"\ncpuinfer precompiled install failed: {exc}\n\n")
        raise SystemExit(1) from None


# --- finding the wheel --------------------------------------------------------


def _fetch(location: str, dest: Path) -> Path:
    """A local path, file:// or http(s) URL, copied or downloaded into dest."""
    parsed = urllib.parse.urlparse(location)
    if parsed.scheme in ("http", "https"):
        name = Path(urllib.parse.unquote(parsed.path)).name
        target = dest / name
        try:
            with urllib.request.urlopen(location, timeout=120) as resp, open(target, "wb") as out:
                shutil.copyfileobj(resp, out)
        except OSError as exc:
            raise PrecompiledError(f"could not download the prebuilt wheel {location}: {exc}") from None
        return target
    path = Path(urllib.parse.unquote(parsed.path) if parsed.scheme == "file" else location).expanduser()
    if not path.is_file():
        raise PrecompiledError(
            f"CPUINFER_PRECOMPILED_WHEEL_LOCATION={location!r}: no such file. Give the path or URL of a cpuinfer "
            f"wheel (e.g. dist/cpuinfer-*.whl from `nox -s wheel`)."
        )
    return path


def _download_from_index(dest: Path, version: str | None) -> Path:
    """`pip download` the cpuinfer wheel for this interpreter from the configured index."""
    envs = _envs()
    index = envs.WHEEL_INDEX.get()
    req = f"cpuinfer=={version}" if version else "cpuinfer"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(dest), req]
    if index:
        cmd += ["--index-url", index]
    # pip runs this backend in an isolated environment whose PYTHONPATH hides the
    # interpreter's own site-packages (and so pip itself): give the child the plain one.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PIP_BUILD_TRACKER")}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wheels = sorted(dest.glob("cpuinfer-*.whl"))
    if r.returncode != 0 or not wheels:
        raise PrecompiledError(
            f"no prebuilt wheel for {req} found on {'index ' + index if index else pip_index_hint()}:\n"
            f"{(r.stderr or r.stdout).strip()[-2000:]}\n"
            f"Set CPUINFER_PRECOMPILED_WHEEL_LOCATION to a wheel path/URL, or CPUINFER_WHEEL_INDEX to an index "
            f"that has one, or build from source without CPUINFER_USE_PRECOMPILED."
        )
    return wheels[0]


def pip_index_hint() -> str:
    """How the index was chosen, for error messages."""
    return "pip's configured index (PIP_INDEX_URL / pip.conf)"


def _checkout_version() -> str | None:
    """This checkout's release version, or None for a development version (use the newest wheel then)."""
    try:
        from setuptools_scm import get_version

        version = get_version(root=str(ROOT), fallback_version="0.0.0")
    except Exception as e:  # noqa: BLE001 - no git, no scm metadata: a development checkout
        print(
            f"cpuinfer: no release version from git ({type(e).__name__}: {e}); taking the newest wheel", file=sys.stderr
        )
        return None
    return None if any(part in version for part in ("dev", "+")) else version


# --- checking the wheel -------------------------------------------------------


def _check_wheel(path: Path) -> tuple[zipfile.ZipFile, str]:
    """Open and validate the wheel; returns it and its dist-info directory name."""
    from packaging.tags import sys_tags
    from packaging.utils import InvalidWheelFilename, parse_wheel_filename

    try:
        name, _version, _build, tags = parse_wheel_filename(path.name)
    except InvalidWheelFilename as exc:
        raise PrecompiledError(f"{path} is not a wheel file name: {exc}") from None
    if name != "cpuinfer":
        raise PrecompiledError(f"{path.name} is a wheel of {name!r}, not cpuinfer")
    supported = set(sys_tags())
    if not any(t in supported for t in tags):
        raise PrecompiledError(
            f"{path.name} is built for {', '.join(sorted(map(str, tags)))}, which this interpreter "
            f"(Python {platform.python_version()} on {platform.machine()}) cannot load. Use a wheel for this "
            f"platform (e.g. build one here with `nox -s wheel`)."
        )
    try:
        zf = zipfile.ZipFile(path)
        bad = zf.testzip()
    except (zipfile.BadZipFile, OSError) as exc:
        raise PrecompiledError(f"{path} is not a readable wheel (corrupt or truncated zip: {exc})") from None
    if bad is not None:
        raise PrecompiledError(f"{path} is corrupt: {bad} fails its CRC check")
    dist_info = next((n.split("/")[0] for n in zf.namelist() if n.split("/")[0].endswith(".dist-info")), None)
    if dist_info is None or f"{dist_info}/RECORD" not in zf.namelist():
        raise PrecompiledError(f"{path} has no .dist-info/RECORD: not a complete wheel")
    _check_record(zf, dist_info, path)
    return zf, dist_info


def _check_record(zf: zipfile.ZipFile, dist_info: str, path: Path) -> None:
    """Every file's sha256 must match the wheel's RECORD (catches tampered or mixed-up contents)."""
    rows = csv.reader(io.StringIO(zf.read(f"{dist_info}/RECORD").decode()))
    for row in rows:
        if len(row) < 2 or not row[1]:
            continue
        name, digest = row[0], row[1]
        algo, _, expected = digest.partition("=")
        try:
            data = zf.read(name)
        except KeyError:
            raise PrecompiledError(f"{path} lists {name} in RECORD but does not contain it") from None
        actual = base64.urlsafe_b64encode(hashlib.new(algo, data).digest()).rstrip(b"=").decode()
        if actual != expected:
            raise PrecompiledError(f"{path} is corrupt: {name} does not match its RECORD hash")


def _compiled_members(zf: zipfile.ZipFile) -> list[str]:
    """The wheel's files under cpuinfer/ that the source tree does not have: the compiled part."""
    out = []
    for name in zf.namelist():
        if name.startswith("cpuinfer.libs/") and not name.endswith("/"):
            out.append(name)  # libraries auditwheel grafted in (found via RPATH $ORIGIN/../cpuinfer.libs)
            continue
        if not name.startswith("cpuinfer/") or name.endswith("/") or "__pycache__" in name:
            continue
        rel = name[len("cpuinfer/") :]
        if not (PACKAGE / rel).exists() or _was_extracted(rel):
            out.append(name)
    required = {"_isa_table.json", "_build_info.json"}
    names = {m[len("cpuinfer/") :] for m in out if m.startswith("cpuinfer/")}
    missing = sorted(required - names)
    if not any(n.startswith("_cpu_probe") for n in names):
        missing.append("_cpu_probe.*")
    if not any(n.startswith("_C_generic") for n in names):
        missing.append("_C_generic.*")
    if missing:
        raise PrecompiledError(
            f"the wheel lacks {', '.join(missing)}: it is not a complete cpuinfer binary wheel "
            f"(an sdist-built or pure-Python wheel cannot supply precompiled kernels)"
        )
    return out


def _previous() -> dict:
    marker = PACKAGE / MARKER
    if marker.is_file():
        try:
            return json.loads(marker.read_text())
        except ValueError:
            return {}
    return {}


def _was_extracted(rel: str) -> bool:
    return rel in _previous().get("files", [])


# --- the editable wheel ---------------------------------------------------------


def _build_precompiled_editable(wheel_directory: Path) -> str:
    envs = _envs()
    location = envs.PRECOMPILED_WHEEL_LOCATION.get()
    with tempfile.TemporaryDirectory(prefix="cpuinfer-precompiled-") as tmp:
        tmp = Path(tmp)
        wheel = _fetch(location, tmp) if location else _download_from_index(tmp, _checkout_version())
        zf, _ = _check_wheel(wheel)
        with zf:
            members = _compiled_members(zf)
            info = json.loads(zf.read("cpuinfer/_build_info.json"))
            # Replace what an earlier precompiled install unpacked, then unpack.
            for rel in _previous().get("files", []):
                (PACKAGE / rel).unlink(missing_ok=True)
            files = []
            for name in members:
                rel = name[len("cpuinfer/") :] if name.startswith("cpuinfer/") else f"../{name}"
                target = PACKAGE / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(zf.read(name))
                if name.endswith(".so"):
                    target.chmod(0o755)
                files.append(rel)
        sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
        marker = {
            "wheel": wheel.name,
            "source": location or "wheel index",
            "sha256": sha,
            "abi_stamp": info.get("abi_stamp"),
            "files": sorted(files),
        }
        (PACKAGE / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        print(f"cpuinfer: unpacked {len(files)} compiled files from {wheel.name} into {PACKAGE}", file=sys.stderr)

        meta_dir = tmp / "meta"
        dist_info_name = _write_metadata(meta_dir)
        return _write_editable_wheel(wheel_directory, meta_dir / dist_info_name)


def _write_editable_wheel(wheel_directory: Path, dist_info: Path) -> str:
    """A py3-none-any wheel holding the metadata and a .pth that puts src/ on sys.path."""
    name, version = dist_info.name[: -len(".dist-info")].split("-", 1)
    wheel_name = f"{name}-{version}-py3-none-any.whl"
    files: dict[str, bytes] = {"_cpuinfer_editable.pth": (str(ROOT / "src") + "\n").encode()}
    for path in sorted(dist_info.rglob("*")):
        if path.is_file() and path.name != "RECORD":
            files[f"{dist_info.name}/{path.relative_to(dist_info).as_posix()}"] = path.read_bytes()
    files[f"{dist_info.name}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: cpuinfer-precompiled\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for fname, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        writer.writerow([fname, f"sha256={digest}", str(len(data))])
    writer.writerow([f"{dist_info.name}/RECORD", "", ""])
    files[f"{dist_info.name}/RECORD"] = record.getvalue().encode()
    wheel_directory.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel_directory / wheel_name, "w", zipfile.ZIP_DEFLATED) as out:
        for fname, data in files.items():
            out.writestr(fname, data)
    return wheel_name


__all__ = [
    "build_editable",
    "build_sdist",
    "build_wheel",
    "get_requires_for_build_editable",
    "get_requires_for_build_sdist",
    "get_requires_for_build_wheel",
    "prepare_metadata_for_build_editable",
    "prepare_metadata_for_build_wheel",
]
