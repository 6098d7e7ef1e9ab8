"""Dispatch on a CPU without AVX-512, run by `nox -s emulated_avx2` under `qemu-x86_64 -cpu max`.

Also runs natively in the normal suite. Under the emulator the session sets
CPUINFER_TEST_EXPECT_VARIANT=avx2 and CPUINFER_TEST_PYTHON_WRAPPER (qemu-user
does not follow exec, so child interpreters are started through it too).
Kept short: torch under qemu is slow.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import cpuinfer
from cpuinfer import ops

SEL = cpuinfer._selection
WRAPPER = shlex.split(os.environ.get("CPUINFER_TEST_PYTHON_WRAPPER", ""))


def test_selects_expected_variant():
    expected = os.environ.get("CPUINFER_TEST_EXPECT_VARIANT")
    if not expected:
        pytest.skip("CPUINFER_TEST_EXPECT_VARIANT not set (only the emulated session knows the CPU)")
    assert SEL.name == expected, SEL.reason
    assert not SEL.forced
    if expected == "avx2":  # qemu's max x86 CPU: AVX2 but no AVX-512
        avx512 = next(c for c in SEL.candidates if c.name == "avx512")
        assert avx512.installed and "avx512f" in avx512.missing


def test_kernels_match_torch_on_this_cpu():
    x, w = torch.randn(3, 72), torch.randn(72)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), ref, atol=1e-5, rtol=1e-5)
    g = torch.randn(2, 2 * 40)
    torch.testing.assert_close(ops.silu_and_mul(g), F.silu(g[:, :40]) * g[:, 40:], atol=1e-5, rtol=1e-5)


def test_forcing_an_unrunnable_variant_is_exit_1_not_sigill():
    lacking = [c for c in SEL.candidates if c.installed and not c.runnable]
    if not lacking:
        pytest.skip("every installed variant runs on this CPU")
    c = lacking[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CPUINFER_")}
    env["CPUINFER_ISA"] = c.name
    r = subprocess.run(
        [*WRAPPER, sys.executable, "-c", "import cpuinfer"], capture_output=True, text=True, env=env, timeout=900
    )
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])  # SIGILL would be -4
    assert f"CPUINFER_ISA={c.name!r} cannot run on this CPU: it lacks" in r.stderr
