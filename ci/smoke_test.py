"""Post-install check of a cpuinfer wheel, run from outside the source tree.

Used by `nox -s wheel`, `nox -s index`, `nox -s precompiled` and cibuildwheel's
test step: the package imports from site-packages (not the checkout), a
variant is selected, and every kernel family matches a plain torch reference.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import cpuinfer
from cpuinfer import ops


def main() -> int:
    """Run the checks; nonzero exit (via assert) on failure."""
    expect_editable = "--editable" in sys.argv
    pkg = Path(cpuinfer.__file__).resolve().parent
    in_checkout = (pkg.parent.parent / "csrc").is_dir()
    assert in_checkout == expect_editable, f"cpuinfer imported from {pkg} (editable expected: {expect_editable})"
    info = cpuinfer.info()
    print(f"cpuinfer {cpuinfer.__version__} from {pkg}: selected {info['selected']} of {sorted(info['variants'])}")
    torch.manual_seed(0)
    x = torch.randn(7, 96)
    w = torch.randn(96)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), ref, atol=1e-5, rtol=1e-5)
    g = torch.randn(5, 2 * 64)
    torch.testing.assert_close(ops.silu_and_mul(g), F.silu(g[:, :64]) * g[:, 64:], atol=1e-5, rtol=1e-5)
    print("kernel smoke test passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
