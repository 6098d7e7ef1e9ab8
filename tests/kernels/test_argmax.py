"""argmax (greedy sampling) against torch.argmax, per variant: ties, NaN, infinities, every tail length."""

import pytest
import torch

from .tolerances import DTYPES

NAN, INF = float("nan"), float("inf")


def check(kernels, x: torch.Tensor) -> None:
    out = torch.full((x.shape[:-1].numel(),), -7, dtype=torch.int64)
    kernels.argmax(out, x)
    assert out.tolist() == x.argmax(-1).reshape(-1).tolist()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [1, 2, 7, 15, 16, 17, 511, 512, 513, 1024, 1031, 49152 + 3])
def test_random_rows_every_tail(kernels, dtype, cols):
    check(kernels, torch.randn(9, cols).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_take_the_first_index(kernels, dtype):
    x = torch.randn(6, 3000).to(dtype)
    top = x.float().abs().max().item() + 1
    x[0, [5, 6]] = top  # in one vector
    x[1, [100, 2999]] = top  # in different blocks
    x[2, [511, 512]] = top  # at a block edge
    x[3, :] = top  # every element
    x[4, [2998, 2999]] = top  # in the tail
    x[5, :] = -0.0
    x[5, 1] = 0.0  # -0 == +0: the first
    check(kernels, x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_infinities(kernels, dtype):
    x = torch.randn(8, 2000).to(dtype)
    x[0, 700] = NAN  # a NaN is torch's answer, wherever the maximum is
    x[0, 5] = INF
    x[1, [900, 30]] = NAN  # the first NaN
    x[2, :] = -INF  # all -inf: index 0
    x[3, [10, 1500]] = INF  # ties at +inf
    x[4, :100] = -INF
    x[4, 1999] = INF  # inf and -inf in one row (a NaN check sum)
    x[5, 1999] = NAN  # in the tail
    x[6, :] = NAN
    x[7, 3] = -INF  # a masked token (as min_tokens and grammars do)
    check(kernels, x)


def test_strided_and_batched_shapes(kernels):
    base = torch.randn(5, 700)
    check(kernels, base[:, :600])  # rows 700 apart
    check(kernels, torch.randn(2, 3, 333))  # leading dimensions are rows
    check(kernels, torch.randn(0, 10))  # no rows: nothing to do


def test_bad_arguments_are_errors(kernels):
    x = torch.randn(3, 10)
    out = torch.empty(3, dtype=torch.int64)
    with pytest.raises(TypeError, match="out must be an int64"):
        kernels.argmax(torch.empty(3, dtype=torch.int32), x)
    with pytest.raises(ValueError, match="one entry per row"):
        kernels.argmax(torch.empty(4, dtype=torch.int64), x)
    with pytest.raises(TypeError, match="logits"):
        kernels.argmax(out, torch.ones(3, 10, dtype=torch.int64))
    with pytest.raises(ValueError, match="contiguous"):
        kernels.argmax(out, torch.randn(10, 3).t())
    with pytest.raises(ValueError, match="0 elements"):
        kernels.argmax(out, torch.randn(3, 0))


def test_ops_argmax_keeps_the_leading_shape():
    from cpuinfer import ops

    x = torch.randn(2, 3, 50)
    assert torch.equal(ops.argmax(x), x.argmax(-1))
