"""Turn a folder of wheels into a PEP 503 "simple" index (static files).

    python ci/make_index.py dist/ site/        -> site/simple/index.html, site/simple/<project>/index.html
                                                  and the wheels copied to site/packages/

Links carry #sha256= fragments (pip verifies them) and data-requires-python
from each wheel's metadata. Serve site/ with any static web server and
`pip install --extra-index-url https://HOST/simple cpuinfer`.

Variant wheels (PEP 825, `...-<platform>-<label>.whl`, made by ci/variant_wheels.py) are listed beside the
others, and each version that has any gets `<name>-<version>-variants.json`, linked on the same page: the
merge of its variant wheels' `*.dist-info/variant.json` (what an index that generates the file does).
"""

from __future__ import annotations

import argparse
import hashlib
import html
import json
import re
import shutil
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.utils import canonicalize_name, parse_wheel_filename

VARIANT_LABEL = re.compile(r"[0-9a-z_.]{1,16}")


def split_variant(filename: str) -> tuple[str, str | None]:
    """A wheel filename without its PEP 825 variant label, and the label (None for a non-variant wheel).
    A variant wheel has six dash-separated parts (seven with a build tag); a build tag starts with a digit."""
    parts = filename[: -len(".whl")].split("-")
    if len(parts) == 7 or (len(parts) == 6 and not parts[2][:1].isdigit()):
        if not VARIANT_LABEL.fullmatch(parts[-1]):
            raise SystemExit(
                f"make_index: {filename}: invalid variant label {parts[-1]!r} (PEP 825: [0-9a-z_.]{{1,16}})"
            )
        return "-".join(parts[:-1]) + ".whl", parts[-1]
    return filename, None


def wheel_json(wheel: Path, leaf: str) -> dict:
    """A JSON file of a wheel's top-level .dist-info folder."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(f".dist-info/{leaf}") and n.count("/") == 1)
        return json.loads(zf.read(name))


def merge_variants(wheels: list[Path]) -> dict:
    """The index-level variants.json of one version's variant wheels: their variant.json files merged (PEP 825:
    disjoint labels are joined, a label seen twice must map to the same properties, the rest must agree)."""
    merged: dict = {}
    for w in wheels:
        label = split_variant(w.name)[1]
        data = wheel_json(w, "variant.json")
        described = list(data.get("variants", {}))
        if described != [label]:
            raise SystemExit(f"make_index: {w.name}: variant.json describes {described}, not {label!r}")
        if not merged:
            merged = {**data, "variants": dict(data["variants"])}
            continue
        if merged["variants"].get(label, data["variants"][label]) != data["variants"][label]:
            raise SystemExit(f"make_index: {w.name}: label {label!r} has other properties in another wheel")
        merged["variants"][label] = data["variants"][label]
        ns = merged["default-priorities"]["namespace"]
        new_ns = data["default-priorities"]["namespace"]
        merged["default-priorities"]["namespace"] = ns + [n for n in new_ns if n not in ns]
        for namespace, provider in data.get("providers", {}).items():
            if merged.setdefault("providers", {}).setdefault(namespace, provider) != provider:
                raise SystemExit(f"make_index: {w.name}: provider of {namespace!r} differs from another wheel's")
        if data["$schema"] != merged["$schema"]:
            raise SystemExit(f"make_index: {w.name}: variant.json schema {data['$schema']} != {merged['$schema']}")
    return merged


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
        name = canonicalize_name(parse_wheel_filename(split_variant(w.name)[0])[0])  # also rejects malformed names
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
        versions: dict[str, list[Path]] = {}
        for w in files:
            if split_variant(w.name)[1] is not None:
                versions.setdefault(str(parse_wheel_filename(split_variant(w.name)[0])[1]), []).append(w)
        for version, variant_wheels in sorted(versions.items()):
            vj = packages / f"{name.replace('-', '_')}-{version}-variants.json"
            vj.write_text(json.dumps(merge_variants(variant_wheels), indent=2, sort_keys=True) + "\n")
            href = f"../../packages/{vj.name}#sha256={sha256(vj)}"
            links.append(f'<a href="{html.escape(href)}">{html.escape(vj.name)}</a>')
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
