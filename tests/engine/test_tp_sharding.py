"""Tensor-parallel shares of quantized weights: cut in the packed layout where panels and groups allow, else a
dense share in the run dtype; each share equals the same slice of the whole weight dequantized."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cpuinfer.distributed.tensor_parallel import narrow
from cpuinfer.quantization.weight import QuantWeight, is_quantized


def weight(n: int, k: int, group: int, perm: bool = False) -> QuantWeight:
    rng = np.random.default_rng(0)
    u = rng.integers(0, 16, (n, k), dtype=np.uint8)
    d = (rng.random((n, k // group)) * 0.1 + 0.01).astype(np.float16)
    z = rng.integers(0, 16, (n, k // group), dtype=np.uint8)
    order = rng.permutation(k) if perm else None
    return QuantWeight.pack(u, d, z, bits=4, group=group, kind="test", perm=order)


@pytest.mark.parametrize("dim, start, length", [(0, 32, 48), (0, 64, 16), (1, 64, 128), (1, 0, 64)])
def test_aligned_shares_stay_packed(dim, start, length):
    w = weight(96, 256, 32)
    share = narrow(w, dim, start, length, "w", torch.bfloat16)
    assert is_quantized(share)
    whole = w.dequantize(torch.float32)
    assert torch.equal(share.dequantize(torch.float32), whole.narrow(dim, start, length))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("perm, dim, start, length", [(True, 1, 64, 128), (False, 0, 8, 40), (False, 1, 16, 64)])
def test_unaligned_or_act_order_shares_are_dense_in_the_run_dtype(dtype, perm, dim, start, length):
    """Act-order columns, a cut through a panel or a group: the share is dense, in the run dtype (not bf16
    whatever the run: an f16 run's fused layer refuses a bf16 weight)."""
    w = weight(96, 256, 32, perm)
    share = narrow(w, dim, start, length, "w", dtype)
    assert not is_quantized(share) and share.dtype == dtype
    assert torch.equal(share, w.dequantize(dtype).narrow(dim, start, length))
