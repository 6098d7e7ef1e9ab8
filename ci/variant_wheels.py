"""PEP 825 variant wheels cut from the fat wheel: each slim wheel keeps `generic` and one variant label's kernels.

    python ci/variant_wheels.py dist/cpuinfer-...-manylinux_2_34_x86_64.whl OUT/
        -> OUT/cpuinfer-...-manylinux_2_34_x86_64-x8664v3.whl, ...-x8664v4.whl

No rebuild: a slim wheel is the fat wheel minus the other variants' extension modules, plus
`*.dist-info/variant.json`, with RECORD rewritten. The fat wheel stays the default: installers without
variant support skip variant filenames (pip cannot parse them) and take it. ci/make_index.py serves both
and writes the index-level `{name}-{version}-variants.json`.

The labels come from the ISA table (cmake/isa_table.json, in the wheel as cpuinfer/_isa_table.json, the
dispatcher's), through the variant providers that installers ship:
- x86_64: `x86_64 :: level :: vN`, the psABI level of the variant's `-march=x86-64-vN`. uv's x86-64 provider
  (uv 0.13.8, `--preview-features wheel-variants`) reports only the level, so the v4 wheel holds every v4
  variant (avx512, avx512bf16, amx) and the dispatcher picks among them at import, as in the fat wheel.
- aarch64: `aarch64 :: <feature> :: on` for each CPU feature the variant needs (the names of the ISA table
  are the kernel's hwcap names, which the aarch64 provider plugin (provider-variant-aarch64) reports). A
  wheel also carries each variant the dispatcher may prefer on a CPU the wheel installs on (see
  slim_groups), so it picks what the fat wheel would. uv 0.13.8's aarch64 provider reports only
  `aarch64 :: version`: uv installs the fat wheel there.
Other platforms (s390x, macOS) have no provider: they ship the fat wheel only.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
import sys
import zipfile
from pathlib import Path

# uv 0.13.8 reads this schema (PEP 825's format with PEP 850's providers table); it names its built-in
# providers by the package in `requires`.
SCHEMA = "https://variants-schema.wheelnext.dev/peps/850/v0.2.0.json"
PROVIDERS = {
    "x86_64": {"requires": ["x86-64-variant-provider"]},
    "aarch64": {
        "requires": ["provider-variant-aarch64"],
        "plugin-api": "provider_variant_aarch64.plugin:AArch64Plugin",
    },
}
LABEL = re.compile(r"[0-9a-z_.]{1,16}")  # PEP 825's variant label


def slim_groups(platform: str, ptable: dict) -> dict[str, tuple[list[str], dict[str, list[str]]]]:
    """label -> (the kernel variants it holds besides generic, its properties {feature: [values]} in the
    platform's namespace), from one platform's ISA table. Empty for a platform without a variant provider."""
    groups: dict[str, tuple[list[str], dict[str, list[str]]]] = {}
    if platform == "x86_64":
        for name, entry in ptable.items():
            levels = [f.removeprefix("-march=x86-64-") for f in entry["flags"] if f.startswith("-march=x86-64-v")]
            if levels:
                groups.setdefault(f"x8664{levels[0]}", ([], {"level": levels}))[0].append(name)
    elif platform == "aarch64":

        def lowest(entry: dict) -> int:  # its priority where the dispatcher demotes it
            return int(entry.get("demote_unless", entry)["priority"])

        for name, entry in ptable.items():
            if not entry["features"]:
                continue
            # A CPU this wheel is installed on may also run a variant the dispatcher prefers to this one. Where
            # that variant's properties include all of this one's, an installer ranks its wheel first; else
            # this wheel carries it (neon_bf16 carries sve: a CPU with both features and wide SVE runs sve).
            mine = set(entry["features"])
            kernels = [name] + [
                other
                for other, e in ptable.items()
                if other != name and int(e["priority"]) > lowest(entry) and not mine <= set(e["features"])
            ]
            groups[f"a64{name.replace('_', '')}"] = (kernels, {f: ["on"] for f in entry["features"]})
    for label in groups:
        assert LABEL.fullmatch(label), label
    return groups


def variant_json(namespace: str, label: str, properties: dict[str, list[str]]) -> dict:
    """The `*.dist-info/variant.json` of one variant wheel (PEP 825)."""
    return {
        "$schema": SCHEMA,
        "default-priorities": {"namespace": [namespace]},
        "providers": {namespace: PROVIDERS[namespace]},
        "variants": {label: {namespace: properties}},
    }


def record_line(name: str, data: bytes) -> str:
    """A RECORD row: path, urlsafe-base64 sha256 without padding, size."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def wheel_platform(wheel: Path) -> str:
    """The machine in a Linux wheel's platform tag (x86_64, aarch64, ...)."""
    plat = wheel.name[: -len(".whl")].split("-")[-1]
    return next((m for m in ("x86_64", "aarch64", "s390x") if plat.endswith(m)), plat)


def kernel_module(name: str) -> str | None:
    """The variant of a wheel entry `cpuinfer/_C_<variant>.<suffix>.so`, else None."""
    m = re.fullmatch(r"cpuinfer/_C_([a-z0-9_]+)\.[^/]*\.so", name)
    return m.group(1) if m else None


def make_slim(fat: Path, out_dir: Path, label: str, keep: list[str], namespace: str, props: dict) -> Path:
    """fat minus every kernel variant not in generic + keep, with variant.json and a rewritten RECORD."""
    out = out_dir / f"{fat.name[: -len('.whl')]}-{label}.whl"
    keep_set = {"generic", *keep}
    with zipfile.ZipFile(fat) as src, zipfile.ZipFile(out, "w") as dst:
        names = src.namelist()
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/RECORD") and n.count("/") == 1)
        record = f"{dist_info}/RECORD"
        variant_path = f"{dist_info}/variant.json"
        variant = json.dumps(variant_json(namespace, label, props), indent=2, sort_keys=True).encode() + b"\n"
        dropped = {n for n in names if kernel_module(n) not in (None, *keep_set)}
        missing = keep_set - {kernel_module(n) for n in names}
        if missing:
            raise SystemExit(f"variant_wheels: {fat.name} has no kernels for {sorted(missing)} (label {label})")
        rows = []
        for info in src.infolist():
            if info.filename in dropped or info.filename in (record, variant_path):
                continue
            data = src.read(info)
            dst.writestr(info, data)
            rows.append(record_line(info.filename, data))
        dst.writestr(zipfile.ZipInfo(variant_path, date_time=(1980, 1, 1, 0, 0, 0)), variant, zipfile.ZIP_DEFLATED)
        rows += [record_line(variant_path, variant), f"{record},,"]
        dst.writestr(src.getinfo(record), "\n".join(rows) + "\n")
    return out


def make_variant_wheels(fat: Path, out_dir: Path) -> list[Path]:
    """Every slim wheel of fat's platform (none where the platform has no variant provider)."""
    namespace = wheel_platform(fat)
    with zipfile.ZipFile(fat) as zf:
        table = json.loads(zf.read("cpuinfer/_isa_table.json"))
    ptable = table["platforms"].get(namespace, {})
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        make_slim(fat, out_dir, label, kernels, namespace, props)
        for label, (kernels, props) in slim_groups(namespace, ptable).items()
    ]


def main(argv: list[str] | None = None) -> int:
    """Command line entry point."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheel", type=Path, help="the fat wheel (every variant)")
    ap.add_argument("out", type=Path, help="folder for the variant wheels")
    args = ap.parse_args(argv)
    print(f"{args.wheel.name}: {args.wheel.stat().st_size / 1e6:.2f} MB (fat)")
    for w in make_variant_wheels(args.wheel, args.out):
        print(f"{w.name}: {w.stat().st_size / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
