"""Turn a folder of wheels into a PEP 503 "simple" index (static files).

    python ci/make_index.py dist/ site/        -> site/simple/index.html, site/simple/<project>/index.html
                                                  and the wheels copied to site/packages/

Links carry #sha256= fragments (pip verifies them) and data-requires-python
from each wheel's metadata. Serve site/ with any static web server and
`pip install --extra-index-url https://HOST/simple cpuinfer`.
"""

from __future__ import annotations

import argparse
import hashlib
import html
import shutil
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.utils import canonicalize_name, parse_wheel_filename


def requires_python(wheel: Path) -> str | None:
    """The Requires-Python of a wheel's METADATA, if any."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        return Parser().parsestr(zf.read(meta).decode()).get("Requires-Python")


def sha256(path: Path) -> str:
    """Hex sha256 of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def page(title: str, links: list[str]) -> str:
    """A PEP 503 HTML page."""
    body = "\n".join(f"    {link}<br/>" for link in links)
    return (
        f'<!DOCTYPE html>\n<html>\n  <head><meta name="pypi:repository-version" content="1.0">'
        f"<title>{html.escape(title)}</title></head>\n  <body>\n{body}\n  </body>\n</html>\n"
    )


def build_index(wheel_dir: Path, out: Path) -> dict[str, list[str]]:
    """Write the index for every *.whl in wheel_dir under out; returns project -> wheel names."""
    wheels = sorted(wheel_dir.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"make_index: no .whl files in {wheel_dir}")
    projects: dict[str, list[Path]] = {}
    for w in wheels:
        name = canonicalize_name(parse_wheel_filename(w.name)[0])  # also rejects malformed names
        projects.setdefault(name, []).append(w)
    packages = out / "packages"
    packages.mkdir(parents=True, exist_ok=True)
    simple = out / "simple"
    for name, files in projects.items():
        links = []
        for w in files:
            shutil.copy2(w, packages / w.name)
            rp = requires_python(w)
            attr = f' data-requires-python="{html.escape(rp)}"' if rp else ""
            href = f"../../packages/{w.name}#sha256={sha256(w)}"
            links.append(f'<a href="{html.escape(href)}"{attr}>{html.escape(w.name)}</a>')
        (simple / name).mkdir(parents=True, exist_ok=True)
        (simple / name / "index.html").write_text(page(f"Links for {name}", links))
    root_links = [f'<a href="{n}/">{n}</a>' for n in sorted(projects)]
    (simple / "index.html").write_text(page("Simple index", root_links))
    return {n: [w.name for w in fs] for n, fs in projects.items()}


def main(argv: list[str] | None = None) -> int:
    """Command line entry point."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheels", type=Path, help="folder of .whl files")
    ap.add_argument("out", type=Path, help="output folder (gets simple/ and packages/)")
    args = ap.parse_args(argv)
    for name, files in build_index(args.wheels, args.out).items():
        print(f"{name}: {len(files)} wheel(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
