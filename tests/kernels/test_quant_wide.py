"""The quantized linear layer with 16-bit activations (act16 weights: GPTQ, AWQ, compressed-tensors W4A16 /
W8A16) against torch on the dequantized weight.

The activations are not quantized: the only rounding is f32 accumulation (and bf16 / f16 output), so the
result is held to float64's product on the exact dequantized weight within f32 accumulation error, far
tighter than the int8 path gets (checked too, so the two paths cannot be confused).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cpuinfer.quantization import QuantStack, QuantWeight, concat

from .test_quant_linear import int8_rows


def weight(n: int, k: int, bits: int, group: int, minimum: bool, seed: int = 0, perm: bool = False) -> QuantWeight:
    """A random act16 weight in zero-point (or minimum) form, optionally packed in a permuted k order."""
    rng = np.random.default_rng(seed)
    u = rng.integers(0, 2**bits, (n, k), dtype=np.uint8)
    d = (rng.random((n, k // group)) * 0.02 + 1e-3).astype(np.float16)
    z = None if minimum else rng.integers(0, 2**bits, (n, k // group), dtype=np.uint8)
    m = (rng.standard_normal((n, k // group)) * 0.05).astype(np.float16) if minimum else None
    p = rng.permutation(k).astype(np.int32) if perm else None
    return QuantWeight.pack(u, d, z, m, bits=bits, group=group, kind="test", perm=p, act16=True)


def exact(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """float64 x @ W.T on the dequantized weight (input-feature order)."""
    return x.double() @ w.dequantize().double().T


FORMS = [(4, 32, False), (4, 128, False), (4, 64, True), (8, 32, False), (8, 128, True)]


@pytest.mark.parametrize(("bits", "group", "minimum"), FORMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 3, 9, 40])
def test_matches_torch_on_the_dequantized_weight(kernels, bits, group, minimum, dtype, m):
    """f32 out: float64's product within f32 accumulation error, for every form, run dtype and row count."""
    w = weight(72, 512, bits, group, minimum, seed=m)  # 72: a partial last panel
    x = torch.randn(m, 512).to(dtype)
    out = torch.empty(m, 72)
    kernels.quant_linear(out, x, w, None)
    ref = exact(x, w)
    scale = (x.double().abs() @ w.dequantize().double().abs().T).max().item()  # the sums' magnitude
    assert (out.double() - ref).abs().max().item() <= 1e-5 * scale
    # Far closer than int8 activations get (the path this replaces).
    int8 = (int8_rows(x.float()).double() @ w.dequantize().double().T - ref).abs().max().item()
    assert (out.double() - ref).abs().max().item() < 0.1 * int8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_output_and_bias_round_once(kernels, dtype):
    """bf16/f16 out with a bias: the f32 sums plus the bias, rounded once."""
    w = weight(48, 256, 4, 64, False)
    x = torch.randn(5, 256).to(dtype)
    bias = torch.randn(48).to(dtype)
    out, wide = torch.empty(5, 48, dtype=dtype), torch.empty(5, 48)
    kernels.quant_linear(out, x, w, bias)
    kernels.quant_linear(wide, x, w, bias)
    assert torch.equal(out, wide.to(dtype))
    torch.testing.assert_close(wide.double(), exact(x, w) + bias.double(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("bits", "group", "minimum"), FORMS)
@pytest.mark.parametrize("perm", [False, True])
def test_batch_invariant(kernels, bits, group, minimum, perm):
    """A row's result is the same alone or in any batch, bit for bit (row groups of 1-2 rows stream the weight
    with prefetch, up to 8 share a tile, 17-64 rows run panel by panel through several chunks)."""
    w = weight(80, 512, bits, group, minimum, perm=perm)
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(100, 512).to(dtype)
        batch = torch.empty(100, 80)
        kernels.quant_linear(batch, x, w, None)
        for rows in ([0], [37, 38], [50, 51, 52], list(range(60, 76)), [99, 3, 17, 42, 8], list(range(10, 42))):
            part = torch.empty(len(rows), 80)
            kernels.quant_linear(part, x[rows], w, None)
            assert torch.equal(part, batch[rows]), (dtype, rows)
        torch.testing.assert_close(batch.double(), exact(x, w), rtol=1e-5, atol=1e-4)


def test_act16_and_int8_parts_stay_apart(kernels):
    """concat keeps an act16 weight and an int8-activation one as separate parts, each on its own path."""
    a = weight(32, 128, 4, 32, False, seed=1)
    b = QuantWeight(**{**weight(32, 128, 4, 32, False, seed=2).__dict__, "act16": False})
    stack = concat([a, b])
    assert isinstance(stack, QuantStack) and len(stack.parts) == 2
    x = torch.randn(3, 128)
    out = torch.empty(3, 64)
    kernels.quant_linear(out, x, stack, None)
    torch.testing.assert_close(out[:, :32].double(), exact(x, a), rtol=1e-5, atol=1e-4)
    int8 = int8_rows(x).double() @ b.dequantize().double().T
    torch.testing.assert_close(out[:, 32:].double(), int8, rtol=1e-5, atol=1e-4)


def test_unsupported_form_is_refused(kernels):
    """act16 on a form without a 16-bit-activation tile (5 bits, groups of 16): a ValueError naming the fix."""
    x, out = torch.randn(2, 128), torch.empty(2, 32)
    five = QuantWeight.empty(32, 128, 5, 32, has_min=False, kind="test")
    five.act16 = True
    with pytest.raises(ValueError, match="no 16-bit-activation kernel for 5-bit values in groups of 32"):
        kernels.quant_linear(out, x, five, None)
    g16 = QuantWeight.empty(32, 128, 4, 16, has_min=False, kind="test")
    g16.act16 = True
    with pytest.raises(ValueError, match="set act16=False"):
        kernels.quant_linear(out, x, g16, None)
