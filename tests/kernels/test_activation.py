"""silu_and_mul / gelu_and_mul / gelu_tanh_and_mul against torch, per variant."""

import pytest
import torch
import torch.nn.functional as F

from .tolerances import DTYPES, assert_close

ACTS = {
    "silu_and_mul": lambda g: F.silu(g),
    "gelu_and_mul": lambda g: F.gelu(g),
    "gelu_tanh_and_mul": lambda g: F.gelu(g, approximate="tanh"),
}


@pytest.mark.parametrize("name", list(ACTS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 8), (4, 2 * 13), (3, 2 * 2048), (2, 5, 2 * 1536), (1, 2 * 8193), (0, 16)])
def test_act_and_mul(kernels, name, dtype, shape):
    x = torch.randn(shape, dtype=dtype) * 4
    d = shape[-1] // 2
    out = torch.empty((*shape[:-1], d), dtype=dtype)
    getattr(kernels, name)(out, x)
    g, u = x[..., :d].float(), x[..., d:].float()
    assert_close(out, ACTS[name](g) * u, dtype)


@pytest.mark.parametrize("name", list(ACTS))
def test_extreme_values(kernels, name):
    x = torch.tensor([[-100.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 100.0, 3.0] + [1.0] * 8], dtype=torch.float32)
    out = torch.empty(1, 8)
    getattr(kernels, name)(out, x)
    assert torch.isfinite(out).all()
    assert_close(out, ACTS[name](x[:, :8]) * x[:, 8:], torch.float32)


def test_act_bad_input(kernels):
    x = torch.randn(4, 10)
    with pytest.raises(ValueError, match="out must be"):
        kernels.silu_and_mul(torch.empty(4, 4), x)
    with pytest.raises(ValueError, match="must be even"):
        kernels.silu_and_mul(torch.empty(4, 4), torch.randn(4, 9))
    with pytest.raises(TypeError, match="out has dtype float16 but input is float32"):
        kernels.silu_and_mul(torch.empty(4, 5, dtype=torch.float16), x)
    with pytest.raises(ValueError, match="overlap"):
        kernels.silu_and_mul(x[:, :5], x)


@pytest.mark.parametrize("name, approximate", [("gelu", "none"), ("gelu_tanh", "tanh")])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (4, 13), (64, 3072), (2, 5, 1536), (1, 8193), (0, 16)])
def test_gelu(kernels, name, approximate, dtype, shape):
    """The plain activation (an encoder's MLP) against torch's in float32, in place too."""
    x = torch.randn(shape, dtype=dtype) * 4
    expected = F.gelu(x.float(), approximate=approximate)
    out = torch.empty_like(x)
    getattr(kernels, name)(out, x)
    assert_close(out, expected, dtype)
    getattr(kernels, name)(x, x)
    assert torch.equal(x, out)


def test_ops_gelu_names_a_bad_approximation():
    from cpuinfer import ops

    with pytest.raises(ValueError, match="approximate must be 'none' or 'tanh', got 'tanhh'"):
        ops.gelu(torch.ones(2, 8), "tanhh")
