"""ci/variant_wheels.py and ci/make_index.py: PEP 825 slim wheels cut from the fat wheel, served beside it.

The fat wheels here are built from the real ISA table with placeholder bytes for the extension modules; the
installer's choice with real wheels (uv's wheel-variant preview) is `nox -s index`.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import importlib.util
import json
import re
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TABLE = json.loads((ROOT / "cmake" / "isa_table.json").read_text())  # installed as cpuinfer/_isa_table.json


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "ci" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


variant_wheels = load("variant_wheels")
make_index = load("make_index")

TRIPLET = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}


def fat_wheel(folder: Path, machine: str, version: str = "1.0") -> Path:
    """A wheel laid out like the release wheel: every variant's module of the machine, probe, table, RECORD."""
    dist_info = f"cpuinfer-{version}.dist-info"
    files = {
        "cpuinfer/__init__.py": b"",
        "cpuinfer/_isa_table.json": json.dumps(TABLE).encode(),
        f"cpuinfer/_cpu_probe.cpython-311-{TRIPLET[machine]}.so": b"probe",
        **{
            f"cpuinfer/_C_{v}.cpython-311-{TRIPLET[machine]}.so": f"kernels {v}".encode() * 100
            for v in TABLE["platforms"][machine]
        },
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: cpuinfer\nVersion: {version}\n".encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: false\n",
    }
    path = folder / f"cpuinfer-{version}-cp311-cp311-manylinux_2_34_{machine}.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(f"{dist_info}/RECORD", "".join(f"{variant_wheels.record_line(n, d)}\n" for n, d in files.items()))
    return path


def check_record(zf: zipfile.ZipFile) -> None:
    """RECORD lists every other file once with its sha256 and size (computed here, independently)."""
    (record,) = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
    rows = [line.split(",") for line in zf.read(record).decode().splitlines()]
    assert sorted(r[0] for r in rows) == sorted(zf.namelist())
    for name, digest, size in rows:
        if name == record:
            assert digest == size == ""
            continue
        data = zf.read(name)
        expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        assert (digest, int(size)) == (f"sha256={expected}", len(data)), name


def kernels_of(zf: zipfile.ZipFile) -> set[str]:
    return {m.group(1) for n in zf.namelist() if (m := re.fullmatch(r"cpuinfer/_C_(\w+)\.cpython-.*\.so", n))}


@pytest.mark.parametrize(
    ("machine", "expected"),
    [
        ("x86_64", {"x8664v3": {"avx2"}, "x8664v4": {"avx512", "avx512bf16", "amx"}}),
        ("aarch64", {"a64neon": {"neon"}, "a64neonbf16": {"neon_bf16", "sve"}, "a64sve": {"sve", "neon_bf16"}}),
    ],
)
def test_slim_wheels_are_the_fat_wheel_minus_the_other_variants(tmp_path, machine, expected):
    fat = fat_wheel(tmp_path, machine)
    slim = variant_wheels.make_variant_wheels(fat, tmp_path / "out")
    with zipfile.ZipFile(fat) as zf:
        fat_files = set(zf.namelist())
    assert {p.name.removesuffix(".whl").split("-")[-1] for p in slim} == set(expected)
    ptable = TABLE["platforms"][machine]
    for path in slim:
        label = path.name.removesuffix(".whl").split("-")[-1]
        assert path.name == f"{fat.name.removesuffix('.whl')}-{label}.whl"
        with zipfile.ZipFile(path) as zf:
            assert kernels_of(zf) == {"generic", *expected[label]}
            dropped = {n for n in fat_files if n.startswith(tuple(f"cpuinfer/_C_{v}." for v in ptable))} - {
                n for n in fat_files if n.startswith(tuple(f"cpuinfer/_C_{v}." for v in {"generic", *expected[label]}))
            }
            variant_file = "cpuinfer-1.0.dist-info/variant.json"
            assert set(zf.namelist()) == (fat_files - dropped) | {variant_file}
            check_record(zf)
            meta = json.loads(zf.read(variant_file))
        assert meta["$schema"] == variant_wheels.SCHEMA
        assert meta["default-priorities"] == {"namespace": [machine]}
        (props,) = meta["variants"].values()
        assert list(meta["variants"]) == [label] and list(props) == [machine]
        if machine == "x86_64":  # the level is the psABI level every kernel in the wheel is compiled for
            for v in expected[label]:
                assert f"-march=x86-64-{props[machine]['level'][0]}" in ptable[v]["flags"]
        else:  # one property per CPU feature the wheel's own variant needs, and nothing else
            (own,) = [v for v in expected[label] if label == f"a64{v.replace('_', '')}"]
            assert props[machine] == {f: ["on"] for f in ptable[own]["features"]}


def test_platforms_without_a_provider_get_no_slim_wheels():
    assert variant_wheels.slim_groups("s390x", TABLE["platforms"]["s390x"]) == {}
    assert variant_wheels.slim_groups("arm64-apple", TABLE["platforms"]["arm64-apple"]) == {}


def test_missing_kernel_is_an_error(tmp_path):
    fat = fat_wheel(tmp_path, "x86_64")
    with pytest.raises(SystemExit, match=r"no kernels for \['sve'\]"):
        variant_wheels.make_slim(fat, tmp_path, "x", ["sve"], "x86_64", {"level": ["v3"]})


def test_index_serves_fat_and_slim_wheels_and_the_variants_json(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    fat = fat_wheel(wheels, "x86_64")
    fat_wheel(wheels, "aarch64")
    slim = [*variant_wheels.make_variant_wheels(fat, wheels)]
    slim += variant_wheels.make_variant_wheels(wheels / fat.name.replace("x86_64", "aarch64"), wheels)
    projects = make_index.build_index(wheels, tmp_path / "site")
    assert len(projects["cpuinfer"]) == 2 + len(slim)
    page = (tmp_path / "site" / "simple" / "cpuinfer" / "index.html").read_text()
    links = re.findall(r'href="([^"]+)"', page)
    assert sum(link.split("#")[0].endswith("cpuinfer-1.0-variants.json") for link in links) == 1
    assert all(f"{p.name}#sha256=" in page for p in slim)
    merged = json.loads((tmp_path / "site" / "packages" / "cpuinfer-1.0-variants.json").read_text())
    assert set(merged["variants"]) == {"x8664v3", "x8664v4", "a64neon", "a64neonbf16", "a64sve"}
    assert merged["variants"]["x8664v3"] == {"x86_64": {"level": ["v3"]}}
    assert merged["default-priorities"]["namespace"] == ["aarch64", "x86_64"]  # sorted wheel order
    assert set(merged["providers"]) == {"x86_64", "aarch64"}


def test_split_variant():
    assert make_index.split_variant("a-1-cp311-cp311-linux_x86_64.whl") == ("a-1-cp311-cp311-linux_x86_64.whl", None)
    assert make_index.split_variant("a-1-2b-cp311-cp311-linux_x86_64.whl")[1] is None  # a build tag
    assert make_index.split_variant("a-1-cp311-cp311-linux_x86_64-x8664v3.whl") == (
        "a-1-cp311-cp311-linux_x86_64.whl",
        "x8664v3",
    )
    assert make_index.split_variant("a-1-2b-py3-none-any-null.whl") == ("a-1-2b-py3-none-any.whl", "null")
    with pytest.raises(SystemExit, match="invalid variant label"):
        make_index.split_variant("a-1-py3-none-any-Bad.whl")


def test_a_label_with_two_meanings_is_an_error(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    fat = fat_wheel(tmp_path, "x86_64")
    variant_wheels.make_slim(fat, wheels, "x8664v3", ["avx2"], "x86_64", {"level": ["v3"]})
    other = fat_wheel(tmp_path, "x86_64").rename(tmp_path / fat.name.replace("cp311-cp311", "cp312-cp312"))
    variant_wheels.make_slim(other, wheels, "x8664v3", ["avx2"], "x86_64", {"level": ["v4"]})
    with pytest.raises(SystemExit, match="other properties"):
        make_index.build_index(wheels, tmp_path / "site")


def provider_properties(namespace: str, cpu) -> list:
    """What the published provider plugin reports on a CPU of archspec's catalog (the plugin asks archspec.cpu.host,
    here answered with that CPU), as variantlib properties in the plugin's order of preference."""
    from variantlib.models.variant import VariantProperty

    plugin_module = sys.modules[f"provider_variant_{namespace}.plugin"]
    plugin = plugin_module.X8664Plugin() if namespace == "x86_64" else plugin_module.AArch64Plugin()
    original = plugin_module.archspec.cpu.host
    plugin_module.archspec.cpu.host = lambda: cpu
    try:
        configs = plugin.get_supported_configs(None)
    finally:
        plugin_module.archspec.cpu.host = original
    return [VariantProperty(namespace, c.name, v) for c in configs for v in c.values]


def dispatcher_features(namespace: str, cpu) -> set[str]:
    """The names cpuinfer's CPU probe would report on that CPU (the OS enables every register state it has)."""
    feats = set(cpu.features)
    if namespace == "x86_64":
        feats |= {"lzcnt"} if "abm" in feats or "avx2" in feats else set()  # archspec lists lzcnt as abm (AMD)
        feats |= {"os_ymm"} if "avx" in feats else set()
        feats |= {"os_zmm"} if "avx512f" in feats else set()
        feats |= {"os_amx"} if "amx_tile" in feats else set()
    return feats


# Where the provider plugin reports less than the CPU has: archspec's catalog puts Cannon Lake under x86_64_v3
# although it has AVX-512 F/BW/CD/DQ/VL, so provider-variant-x86-64 reports level v3 there. (uv's built-in
# x86-64 provider, which the variant.json names, reads the CPU's flags and reports v4: `nox -s index`.)
UNDERREPORTED = {"x86_64": {"cannonlake": ("avx2", "avx512")}}


@pytest.mark.parametrize("namespace", ["x86_64", "aarch64"])
def test_on_every_cataloged_cpu_the_chosen_slim_wheel_selects_what_the_fat_wheel_selects(tmp_path, namespace):
    """For each CPU model the provider knows (archspec's catalog, which the plugins detect the host against): the PEP's
    reference resolution (variantlib) over the index's variants.json, with what the published provider reports
    there, picks a slim wheel (or none: the fat wheel), and the dispatcher picks the same variant from that wheel's
    kernels as from the fat wheel's. aarch64 with and without wide SVE (sve_wide, which no provider reports)."""
    pytest.importorskip("variantlib")
    # Each provider loads its own copy of archspec as the top-level `archspec`; the second one loaded in a process
    # finds `archspec.cpu` of the first and fails. Each namespace here gets its provider freshly imported.
    for name in [m for m in sys.modules if m.split(".")[0] in ("archspec", f"provider_variant_{namespace}")]:
        del sys.modules[name]
    archspec = pytest.importorskip(f"provider_variant_{namespace}.plugin").archspec
    from variantlib.resolver.lib import sort_and_filter_supported_variants
    from variantlib.variants_json import VariantsJson

    from cpuinfer._dispatch import rank

    ptable = TABLE["platforms"][namespace]
    fat = fat_wheel(tmp_path, namespace)
    kernels = {}
    for w in variant_wheels.make_variant_wheels(fat, tmp_path / "wheels"):
        with zipfile.ZipFile(w) as zf:
            kernels[w.name.removesuffix(".whl").split("-")[-1]] = kernels_of(zf)
    vjson = VariantsJson(make_index.merge_variants(sorted((tmp_path / "wheels").glob("*.whl"))))

    def selected(features: set[str], installed: set[str]) -> str:
        cands = rank(ptable, features, {n: "x" if n in installed else None for n in ptable})
        return next(c.name for c in cands if c.installed and c.runnable)

    cpus = [t for t in archspec.cpu.TARGETS.values() if t.family.name == namespace]
    chosen = {}
    for cpu in cpus:
        order = sort_and_filter_supported_variants(
            list(vjson.variants.values()), provider_properties(namespace, cpu), namespace_priorities=[namespace]
        )
        label = next((v.label for v in order if not v.is_null_variant()), None)
        chosen[cpu.name] = label
        for wide in [set(), {"sve_wide"}] if namespace == "aarch64" else [set()]:
            feats = dispatcher_features(namespace, cpu) | wide
            fat_pick = selected(feats, set(ptable))
            slim_pick = selected(feats, kernels[label]) if label else fat_pick
            if cpu.name in UNDERREPORTED.get(namespace, {}):  # the slim wheel runs, a lower variant than the fat's
                assert (slim_pick, fat_pick) == UNDERREPORTED[namespace][cpu.name]
                continue
            assert slim_pick == fat_pick, f"{cpu.name} {wide}: wheel {label} selects {slim_pick}, the fat {fat_pick}"
    # The catalog reaches every slim wheel, and the newest CPUs get the best ones.
    # The newest CPUs get the best wheels; every x86 wheel is reached. No cataloged aarch64 CPU has SVE and dotprod
    # without BF16 (a64sve's), and A64FX (SVE without dotprod) runs none of the aarch64 variants but generic.
    assert set(chosen.values()) - {None} == set(kernels) - ({"a64sve"} if namespace == "aarch64" else set()), chosen
    expected = {
        "x86_64": {"sapphirerapids": "x8664v4", "zen4": "x8664v4", "haswell": "x8664v3", "nehalem": None},
        "aarch64": {"neoverse_v1": "a64neonbf16", "neoverse_n1": "a64neon", "cortex_a72": None, "a64fx": None},
    }
    assert {k: chosen[k] for k in expected[namespace]} == expected[namespace]
