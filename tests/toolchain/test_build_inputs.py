"""Build-time variables: a malformed value stops CMake's configure step with a clear message.

Configure only (no compile), with the Python extensions off, in a scratch build dir.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD_VARS = ("CPUINFER_ISAS", "VLLM_CPU_AVX512BF16", "CPUINFER_CPU_AVX512BF16", "MAX_JOBS")


def configure(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("cmake not installed")
    full = {k: v for k, v in os.environ.items() if k not in BUILD_VARS}
    full.update(env)
    return subprocess.run(
        [cmake, "-S", str(ROOT), "-B", str(tmp_path / "build"), "-DCPUINFER_BUILD_PYTHON=OFF"],
        capture_output=True,
        text=True,
        env=full,
        timeout=300,
    )


@pytest.mark.parametrize(
    "env,message",
    [
        ({"CPUINFER_ISAS": "avx2,avx9"}, "CPUINFER_ISAS names unknown variant 'avx9'"),
        ({"VLLM_CPU_AVX512BF16": "maybe"}, "VLLM_CPU_AVX512BF16='maybe' is not a boolean; use 1 or 0"),
        ({"CPUINFER_CPU_AVX512BF16": "2"}, "CPUINFER_CPU_AVX512BF16='2' is not a boolean"),
        ({"MAX_JOBS": "two"}, "MAX_JOBS='two' is not a positive integer"),
        ({"MAX_JOBS": "0"}, "MAX_JOBS='0' is not a positive integer"),
    ],
)
def test_malformed_build_variable_is_a_clear_configure_error(tmp_path, env, message):
    r = configure(tmp_path, **env)
    assert r.returncode != 0
    out = " ".join((r.stdout + r.stderr).split())  # CMake wraps long messages
    assert message in out, out[-3000:]


def test_unknown_isa_lists_the_valid_ones(tmp_path):
    r = configure(tmp_path, CPUINFER_ISAS="bogus")
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode != 0 and "'all' / 'native'" in out
    valid = out.split("Valid: ", 1)[1].split(", or 'all'")[0].split(", ")
    assert "generic" in valid and len(valid) >= 3


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 switch")
def test_well_formed_values_configure(tmp_path):
    r = configure(tmp_path, CPUINFER_ISAS="generic", VLLM_CPU_AVX512BF16="1", MAX_JOBS="3")
    assert r.returncode == 0, r.stderr
    assert "variants: generic, avx512bf16" in r.stdout
    assert "at most 3 parallel compile jobs" in r.stdout
