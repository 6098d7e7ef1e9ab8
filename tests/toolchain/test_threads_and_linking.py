"""One OpenMP runtime per process, and kernels that never link libtorch."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

import cpuinfer

OPENMP = re.compile(r"lib(gomp|iomp5|omp)[-.\w]*\.(so|dylib)")


def test_one_openmp_runtime_after_a_kernel_call():
    code = (
        "import re, torch, cpuinfer\n"
        "from cpuinfer import ops\n"
        "x = torch.randn(512, 4096); ops.rms_norm(x, torch.ones(4096), 1e-6); ops.silu_and_mul(x)\n"
        "libs = {m.group(0) for line in open('/proc/self/maps') for m in [re.search("
        + repr(OPENMP.pattern)
        + ", line)] if m}\n"
        "print(sorted(libs)); print(cpuinfer._C.threading_runtime())\n"
    )
    if sys.platform != "linux":
        pytest.skip("/proc/self/maps is Linux-only")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    libs, runtime = r.stdout.strip().splitlines()
    assert len(eval(libs)) <= 1, libs
    # The kernels run on the runtime torch loaded, not serially.
    assert runtime and any(name in runtime for name in eval(libs))


def test_kernels_use_torch_thread_count():
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert cpuinfer._C.max_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert cpuinfer._C.max_threads() == before


@pytest.mark.skipif(shutil.which("readelf") is None, reason="readelf (binutils) not installed")
def test_extensions_do_not_link_torch():
    for name, path in cpuinfer.info()["variants"].items():
        needed = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
        libs = re.findall(r"\(NEEDED\).*\[(.+?)\]", needed)
        assert not [lib for lib in libs if "torch" in lib or "c10" in lib], (name, libs)
        assert not [lib for lib in libs if OPENMP.search(lib)], (name, libs)


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) not installed")
def test_simd_variants_use_their_registers():
    """avx2 holds ymm but no zmm code; avx512* hold zmm; generic holds neither ymm nor zmm."""
    variants = cpuinfer.info()["variants"]
    for name, path in variants.items():
        asm = subprocess.run(
            ["objdump", "-d", "--no-show-raw-insn", path], capture_output=True, text=True, check=True
        ).stdout
        has_zmm, has_ymm = "%zmm" in asm, "%ymm" in asm
        if name == "generic":
            assert not has_zmm and not has_ymm, name
        elif name == "avx2":
            assert has_ymm and not has_zmm, name
        elif name.startswith("avx512") or name == "amx":
            assert has_zmm, name
