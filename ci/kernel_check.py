"""Torch-free check of an installed cpuinfer wheel's extension modules, run from outside the source tree.

    python kernel_check.py [VARIANT ...]     (default: generic)

`import cpuinfer` needs torch; this check does not. It loads the wheel's extension modules straight from the
installed package folder (without running cpuinfer/__init__.py): the CPU probe and every kernel module must load,
and each named variant's kernels must match a numpy reference on numpy arrays (the kernels take any DLPack /
buffer-protocol array). Used where no CPU torch wheel can be installed: the stable-ABI wheel on CPython 3.12 and
3.13 (`nox -s abi3`; PyPI's x86_64 torch for those is the CUDA build) and the s390x wheel (`nox -s foreign`).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

import numpy as np


def load(path: Path):
    """Load one extension module from its file, under its package name, without importing the package."""
    name = "cpuinfer." + path.name.split(".")[0]
    spec = importlib.util.spec_from_file_location(
        name, path, loader=importlib.machinery.ExtensionFileLoader(name, str(path))
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(variants: list[str]) -> int:
    """Run the checks; nonzero exit (via assert) on failure."""
    spec = importlib.util.find_spec("cpuinfer")  # finds the package without running its __init__
    assert spec is not None and spec.submodule_search_locations, "cpuinfer is not installed"
    pkg = Path(next(iter(spec.submodule_search_locations)))
    assert not (pkg.parent.parent / "csrc").is_dir(), f"cpuinfer found in a source checkout ({pkg})"
    modules = sorted(p for p in pkg.iterdir() if p.name.startswith(("_C_", "_cpu_probe.")) and p.suffix == ".so")
    print(f"{sys.implementation.cache_tag}: {[p.name for p in modules]} in {pkg}")
    arch, features = load(next(p for p in modules if p.name.startswith("_cpu_probe."))).features()
    print(f"probe: {arch}, {len(features)} features")
    kernels = {p.name.split(".")[0][len("_C_") :]: p for p in modules if p.name.startswith("_C_")}
    missing = [v for v in variants if v not in kernels]
    assert not missing, f"variants {missing} not in the wheel (it has {sorted(kernels)})"
    rng = np.random.default_rng(0)
    for variant in variants:
        C = load(kernels[variant])
        x = rng.standard_normal((7, 96), dtype=np.float32)
        w = rng.standard_normal(96, dtype=np.float32)
        out = np.empty_like(x)
        C.rms_norm(out, x, w, 1e-6)
        ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * w
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
        g = rng.standard_normal((5, 128), dtype=np.float32)
        act = np.empty((5, 64), dtype=np.float32)
        C.silu_and_mul(act, g)
        a, b = g[:, :64].astype(np.float64), g[:, 64:]
        np.testing.assert_allclose(act, a / (1 + np.exp(-a)) * b, rtol=1e-5, atol=1e-5)
        print(f"{variant}: rms_norm and silu_and_mul match numpy")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["generic"]))
