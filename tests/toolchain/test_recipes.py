"""CONTRIBUTING.md's recipes and habits, checked where a step leaves a trace in the tree: a model
architecture is registered, tested against transformers and documented; a kernel variant's row and a
vector layer's row name files and CPU features that exist; the lint that pre-commit runs is nox's."""

from __future__ import annotations

import ast
import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
TABLE = json.loads((ROOT / "cmake" / "isa_table.json").read_text())
HOOKS = {"panel", "quant", "attention"}  # CPUINFER_<HOOK>_HOOKS


def registered_architectures() -> dict[str, tuple[str, str]]:
    """models/registry.py's ARCHITECTURES, read without importing the package."""
    tree = ast.parse((ROOT / "src" / "cpuinfer" / "models" / "registry.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "ARCHITECTURES" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("models/registry.py has no ARCHITECTURES table")


def test_every_architecture_is_implemented_tested_and_documented():
    """Recipe "add a model architecture": the class, its transformers comparison, the README row."""
    archs = registered_architectures()
    assert len(archs) >= 5
    tiny = (ROOT / "tests" / "models" / "test_tiny_models.py").read_text()
    readme = (ROOT / "README.md").read_text()
    problems = []
    for arch, (module, cls) in archs.items():
        source = ROOT / "src" / "cpuinfer" / "models" / f"{module}.py"
        if not source.is_file() or not re.search(rf"^class {cls}\b", source.read_text(), re.M):
            problems.append(f"{arch}: no class {cls} in models/{module}.py")
        # BertModel: an encoder's name; BertForSequenceClassification: its cross-encoder form
        family = arch.removesuffix("ForCausalLM").removesuffix("ForSequenceClassification").removesuffix("Model")
        if f'"{family}Config"' not in tiny and f'"{family}TextConfig"' not in tiny:
            problems.append(f"{arch}: tests/models/test_tiny_models.py builds no {family}Config checkpoint")
        if f"`{arch}`" not in readme:
            problems.append(f"{arch}: not in README's architecture table")
    assert not problems, "\n".join(problems)


def variants() -> dict[str, dict]:
    """platform/variant -> row of cmake/isa_table.json."""
    return {
        f"{platform}/{name}": row
        for platform, rows in TABLE["platforms"].items()
        if not platform.startswith("_")
        for name, row in rows.items()
        if isinstance(row, dict)
    }


def test_every_variant_row_names_a_vector_layer_and_probed_features():
    """Recipe "add a kernel variant": one row whose layer exists and whose features the probe reports."""
    layers = {k for k in TABLE["vec_layers"] if not k.startswith("_")}
    probed = (ROOT / "csrc" / "probe" / "cpu_probe.c").read_text() + (
        ROOT / "src" / "cpuinfer" / "_dispatch.py"
    ).read_text()
    problems = []
    for name, row in variants().items():
        if row.get("vec") not in layers:
            problems.append(f"{name}: vector layer {row.get('vec')!r} is not a row of vec_layers")
        if not row.get("flags") and not name.endswith("/generic"):
            problems.append(f"{name}: no compile flags")
        unprobed = [f for f in row.get("features", []) if f'"{f}"' not in probed]
        problems += [f"{name}: feature {f!r} is not one the probe reports" for f in unprobed]
    assert not problems, "\n".join(problems)


def test_every_vector_layer_row_names_existing_headers_and_is_used():
    """Recipe "add a vector layer": one header (plus hook headers) and one row, used by some variant."""
    used = {row.get("vec") for row in variants().values()}
    problems = []
    for layer, row in TABLE["vec_layers"].items():
        if layer.startswith("_"):
            continue
        if layer not in used:
            problems.append(f"vec_layers.{layer}: no variant uses it")
        if "header" not in row:
            problems.append(f"vec_layers.{layer}: no header")
        unknown = set(row) - HOOKS - {"header"}
        if unknown:
            problems.append(f"vec_layers.{layer}: unknown keys {sorted(unknown)} (hooks are {sorted(HOOKS)})")
        problems += [
            f"vec_layers.{layer}.{key}: csrc/{path} does not exist"
            for key, path in row.items()
            if not (ROOT / "csrc" / path).is_file()
        ]
    assert not problems, "\n".join(problems)


def test_pre_commit_runs_the_ruff_nox_runs():
    """One ruff version for `nox -s lint`, pre-commit and CI."""
    nox_pin = re.search(r'^RUFF = "ruff==([^"]+)"', (ROOT / "noxfile.py").read_text(), re.M)
    assert nox_pin, "noxfile.py pins no RUFF"
    hooks = (ROOT / ".pre-commit-config.yaml").read_text()
    pins = re.findall(r'"ruff==([^"]+)"', hooks)
    assert pins and set(pins) == {nox_pin.group(1)}, (pins, nox_pin.group(1))
    assert "ruff check" in hooks and "ruff format" in hooks
