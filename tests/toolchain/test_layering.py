"""The import direction of CONTRIBUTING.md, enforced: entrypoints -> engine -> worker -> models / model
loader / attention / ops / sampling -> kernels. No module imports a layer above its own. And the
common kernel sources carry no architecture conditions."""

from __future__ import annotations

import ast
import pathlib
import re

import cpuinfer

LAYERS = {
    "cli": 0,
    "entrypoints": 0,
    "engine": 1,
    "worker": 2,
    "quantization": 3,
    "models": 3,
    "model_loader": 3,
    "attention": 3,
    "ops": 3,
    "sampling": 3,
    "structured": 3,
}
ROOT = pathlib.Path(cpuinfer.__file__).parent


def imported_modules(path: pathlib.Path) -> list[str]:
    """Absolute names of the cpuinfer modules a file imports (relative imports resolved)."""
    package = path.relative_to(ROOT).parts[:-1]
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                names.append(".".join(["cpuinfer", *base, *([node.module] if node.module else [])]))
            elif node.module:
                names.append(node.module)
    return [n for n in names if n.startswith("cpuinfer.")]


def test_no_layer_imports_a_layer_above_it():
    sources = sorted(ROOT.rglob("*.py"))
    assert len(sources) > 30, f"found only {len(sources)} sources under {ROOT}"
    upward = []
    for path in sources:
        layer = path.relative_to(ROOT).parts[0].removesuffix(".py")
        if layer not in LAYERS:
            continue
        for name in imported_modules(path):
            target = name.split(".")[1]
            if target in LAYERS and LAYERS[target] < LAYERS[layer]:
                upward.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not upward, "imports against the layer direction (see CONTRIBUTING.md):\n" + "\n".join(upward)


ARCH_CONDITION = re.compile(
    r"__x86_64__|__aarch64__|__s390x__|__AVX|__AMX|__ARM_"
    r"|CPUINFER_VEC_[A-Z0-9]+\b(?<!HEADER)|CPUINFER_ATTN_(AMX|DPBF16|IMPL)|CPUINFER_SIMDE"
)


def test_common_kernels_have_no_architecture_conditions():
    """csrc/common is arch-free: fast paths come in through the hooks named in cmake/isa_table.json."""
    common = pathlib.Path(__file__).resolve().parents[2] / "csrc" / "common"
    sources = sorted([*common.glob("*.h"), *common.glob("*.cpp")])
    assert len(sources) > 10, f"found only {len(sources)} kernel sources under {common}"
    found = []
    for path in sources:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            directive = line.strip()
            if directive.startswith(("#if", "#elif")) and ARCH_CONDITION.search(directive):
                found.append(f"{path.name}:{n}: {directive}")
            if directive.startswith("#include") and re.search(r'"\.\./(x86|arm|s390x|apple)/', directive):
                found.append(f"{path.name}:{n}: {directive}")
    assert not found, "architecture conditions in csrc/common (use a hook instead):\n" + "\n".join(found)
