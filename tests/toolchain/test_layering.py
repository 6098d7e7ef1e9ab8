"""The import direction of CONTRIBUTING.md, enforced over src/cpuinfer with ast:

    entrypoints (cli, entrypoints) -> engine -> worker, spec_decode -> models (models, model_loader, quantization's
    checkpoint formats, sampling, structured) -> attention / ops (and the kernel-facing weight type,
    quantization.weight) -> kernels (_C, the dispatcher)

No module imports a layer above its own (imports inside functions included); the shared leaf modules
import no layer at all; every module has a place. And the common kernel sources carry no architecture
conditions."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2] / "src" / "cpuinfer"

# Module (or package) -> layer, lowest first; the longest matching name decides.
LAYERS = {
    "cli": 0,
    "entrypoints": 0,
    "engine": 1,
    "worker": 2,
    "spec_decode": 2,
    "models": 3,
    "model_loader": 3,
    "quantization": 3,
    "sampling": 3,
    "structured": 3,
    "attention": 4,
    "distributed": 4,
    "ops": 4,
    "quantization.weight": 4,
    "_C": 5,
    "_dispatch": 5,
    "_abi": 5,
    "_cpu_probe": 5,
    "_info": 5,
}
# Anyone may import these; they import no layer (only each other).
LEAVES = {"errors", "envs", "sampling_params", "outputs", "detokenizer", "platform", "engine.step", "json_arg"}
# Above the layers: the package root (lazy re-exports), `python -m cpuinfer`, and the engine's
# configuration, which reads the model to size the engine.
ROOTS = {"__init__", "__main__", "config"}


def module_name(path: pathlib.Path) -> str:
    """Dotted name under cpuinfer of a source file (a package's __init__ is the package)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def imported_modules(path: pathlib.Path) -> list[str]:
    """Dotted names under cpuinfer of what a file imports."""
    return imports_in(path.read_text(), list(path.relative_to(ROOT).parts[:-1]))


def imports_in(source: str, package: list[str]) -> list[str]:
    """Dotted names under cpuinfer of what source in package imports (relative imports resolved, imports inside
    functions included; `from pkg import mod` names mod too)."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(["cpuinfer", *package[: len(package) - (node.level - 1)]])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            names.append(module)
            names += [f"{module}.{a.name}" for a in node.names]  # submodules; other names match nothing below
    return sorted({n.removeprefix("cpuinfer.") for n in names if n.startswith("cpuinfer.")})


def place(name: str) -> tuple[str, int | None] | None:
    """(kind, layer) of a module: ("layer", n), ("leaf", None), ("root", None), or None if it has no place."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in LEAVES:  # a leaf inside a layer's package (engine.step) is still a leaf
            return "leaf", None
        if prefix in LAYERS:
            return "layer", LAYERS[prefix]
    if parts[0] in ROOTS:
        return "root", None
    return None


def sources() -> list[pathlib.Path]:
    found = sorted(ROOT.rglob("*.py"))
    assert len(found) > 30, f"found only {len(found)} sources under {ROOT}"
    return found


def test_every_module_has_a_place():
    """A new package or top-level module is put in the direction (here and in CONTRIBUTING.md) on purpose."""
    homeless = [str(p.relative_to(ROOT)) for p in sources() if place(module_name(p)) is None]
    assert not homeless, "modules in no layer (add them to LAYERS or LEAVES and to CONTRIBUTING.md):\n" + "\n".join(
        homeless
    )


def test_no_layer_imports_a_layer_above_it():
    upward = []
    for path in sources():
        kind, layer = place(module_name(path))
        for name in imported_modules(path):
            target = place(name)
            if target is None or target[0] != "layer":
                continue
            if kind == "leaf" or (kind == "layer" and target[1] < layer):
                upward.append(f"{path.relative_to(ROOT)} imports cpuinfer.{name}")
    assert not upward, "imports against the layer direction (see CONTRIBUTING.md):\n" + "\n".join(upward)


def test_the_check_sees_imports_against_the_direction():
    """The checker itself: a lower layer importing a higher one (relative, absolute, inside a function) is seen."""
    assert place("ops") == ("layer", 4) and place("quantization.weight") == ("layer", 4)
    assert place("quantization.gptq") == ("layer", 3) and place("engine.core") == ("layer", 1)
    assert place("engine.step") == ("leaf", None) and place("platform.memory") == ("leaf", None)
    code = "from ..engine import core\ndef f():\n    from cpuinfer.models import llama\n    import cpuinfer.worker\n"
    assert imports_in(code, ["attention"]) == ["engine", "engine.core", "models", "models.llama", "worker"]


def test_contributing_names_every_layer():
    """CONTRIBUTING.md's import direction lists every package this test places."""
    text = (ROOT.parents[1] / "CONTRIBUTING.md").read_text()
    missing = [name for name in [*LAYERS, *LEAVES] if name.replace(".", "/") not in text]
    assert not missing, f"CONTRIBUTING.md does not mention {missing}"


ARCH_CONDITION = re.compile(
    r"__x86_64__|__aarch64__|__s390x__|__AVX|__AMX|__ARM_"
    r"|CPUINFER_VEC_[A-Z0-9]+\b(?<!HEADER)|CPUINFER_ATTN_(AMX|DPBF16|IMPL)|CPUINFER_SIMDE"
)


def test_common_kernels_have_no_architecture_conditions():
    """csrc/common is arch-free: fast paths come in through the hooks named in cmake/isa_table.json."""
    common = ROOT.parents[1] / "csrc" / "common"
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


# One contract per concept (CONTRIBUTING.md): each defined once in src/cpuinfer, the rest import it.
ONE_DEFINITION = ["EngineStats", "EngineDeadError", "CACHE_DTYPES", "ModelLoadError", "IsaError", "EnvError"]


def test_each_concept_is_defined_once():
    defined: dict[str, list[str]] = {name: [] for name in ONE_DEFINITION}
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names = [node.name]
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [t.id for t in targets if isinstance(t, ast.Name)]
            else:
                continue
            for name in names:
                if name in defined:
                    defined[name].append(str(path.relative_to(ROOT)))
    wrong = {name: where for name, where in defined.items() if len(where) != 1}
    assert not wrong, f"defined more than once (or never): {wrong}"


WIDE_STRUCTS = re.compile(r"\b(PagedAttentionArgs|DecoderBatch|DecoderLayerWeights)\s+\w+\s*\{\s*[^}\s]")


def test_wide_structs_are_filled_by_field_name():
    """kernels.h's wide argument structs are value-initialised (`{}`) and filled field by field, never by position."""
    root = ROOT.parents[1]
    found = [
        f"{path.relative_to(root)}:{n}: {line.strip()}"
        for path in sorted([*root.glob("csrc/**/*.h"), *root.glob("csrc/**/*.cpp"), *root.glob("tests/cpp/*.cpp")])
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if WIDE_STRUCTS.search(line)
    ]
    assert not found, "positional initialisation of a wide struct:\n" + "\n".join(found)


def test_emulation_headers_live_in_their_own_folder():
    """SIMDe and the AMX software model are test-only: csrc/x86/emulation/, nowhere else."""
    root = ROOT.parents[1] / "csrc"
    emulation = {p.name for p in (root / "x86" / "emulation").glob("*.h")}
    assert {"amx_emulation.h", "simde_avx512_shim.h"} <= emulation
    stray = [
        str(p.relative_to(root)) for p in root.rglob("*.h") if "emulation" in p.name and p.parent.name != "emulation"
    ]
    assert not stray, stray
