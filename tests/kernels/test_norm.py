"""rms_norm and fused_add_rms_norm against a float32 torch reference, per variant."""

import pytest
import torch

from .tolerances import DTYPES, assert_close


def ref_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (3, 17), (7, 4096), (2, 3, 576), (256, 1000), (0, 64)])
def test_rms_norm(kernels, dtype, shape):
    x = torch.randn(shape, dtype=dtype) * 3
    w = torch.randn(shape[-1], dtype=dtype)
    out = torch.empty_like(x)
    kernels.rms_norm(out, x, w, 1e-5)
    assert_close(out, ref_rms_norm(x, w, 1e-5), dtype)


def test_rms_norm_strided_rows_and_in_place(kernels):
    base = torch.randn(6, 200, dtype=torch.bfloat16)
    x = base[:, :128]  # rows 200 apart: a column slice, as q of a fused qkv
    w = torch.randn(128, dtype=torch.bfloat16)
    expected = ref_rms_norm(x, w, 1e-6)
    untouched = base[:, 128:].clone()
    kernels.rms_norm(x, x, w, 1e-6)
    assert_close(x, expected, torch.bfloat16)
    assert torch.equal(base[:, 128:], untouched)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (5, 333), (33, 2048)])
def test_fused_add_rms_norm(kernels, dtype, shape):
    x = torch.randn(shape, dtype=dtype)
    res = torch.randn(shape, dtype=dtype)
    w = torch.randn(shape[-1], dtype=dtype)
    summed = (x.float() + res.float()).to(dtype)  # the residual add rounds to the dtype
    expected = ref_rms_norm(summed, w, 1e-6)
    kernels.fused_add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(res, summed)
    assert_close(x, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_residual_add_rounds_every_bit_pattern_like_torch(kernels, dtype):
    """The 16-bit stores (vector pairs, single vectors, scalar tail) round to nearest even like torch.

    The residual add is one f32 add and one rounding, so it must match torch bit for bit on random
    bit patterns (subnormals, infinities, NaN), on exact ties and on carries into the exponent.
    """
    n = 4096 + 8 + 5  # whole vector pairs, then one vector, then a scalar tail on every layer
    bits = torch.randint(-(2**15), 2**15, (2, n), dtype=torch.int16)
    x, res = bits.view(dtype).clone()
    one = torch.ones(64, dtype=torch.float32)
    ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
    # 1 + half an ulp (tie, down to even), 1 + 1.5 ulp (tie, up to even), just under 2 (carry)
    x[:64] = one.to(dtype)
    res[:64] = torch.tensor([ulp / 2, ulp * 1.5, 1 - ulp / 2, -ulp / 4] * 16).to(dtype)
    expected = x.float() + res.float()
    expected = expected.to(dtype)
    w = torch.ones(n, dtype=dtype)
    kernels.fused_add_rms_norm(x.clone(), res, w, 1e-6)
    nan = expected.isnan()
    assert torch.equal(res.isnan(), nan)
    assert torch.equal(res[~nan].view(torch.int16), expected[~nan].view(torch.int16))


def test_numpy_arrays_and_views_into_a_larger_storage(kernels):
    """Torch tensors come in through DLPack's C exchange API, other DLPack arrays through nanobind's import."""
    np = pytest.importorskip("numpy")
    x = np.random.default_rng(0).standard_normal((3, 40)).astype(np.float32)
    w = np.linspace(0.5, 1.5, 40, dtype=np.float32)
    out = np.empty_like(x)
    kernels.rms_norm(out, x, w, 1e-6)
    assert_close(torch.from_numpy(out), ref_rms_norm(torch.from_numpy(x), torch.from_numpy(w), 1e-6), torch.float32)

    base = torch.randn(5, 48, dtype=torch.bfloat16)
    view = base[2:, 8:]  # starts 2 * 48 + 8 elements into the storage
    wt = torch.randn(40, dtype=torch.bfloat16)
    expected = ref_rms_norm(view, wt, 1e-6)
    before = base.clone()
    kernels.rms_norm(view, view, wt, 1e-6)
    assert_close(view, expected, torch.bfloat16)
    assert torch.equal(base[:2], before[:2]) and torch.equal(base[:, :8], before[:, :8])


def test_rms_norm_bad_input(kernels):
    x = torch.randn(4, 64)
    w = torch.randn(64)
    with pytest.raises(TypeError, match="weight has dtype bfloat16 but input is float32"):
        kernels.rms_norm(torch.empty_like(x), x, w.bfloat16(), 1e-6)
    with pytest.raises(ValueError, match="weight has 32 elements but input has hidden size 64"):
        kernels.rms_norm(torch.empty_like(x), x, w[:32], 1e-6)
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        kernels.rms_norm(torch.empty(64, 4).t(), x.t(), torch.randn(4), 1e-6)
    with pytest.raises(ValueError, match="out must have the shape of input"):
        kernels.rms_norm(torch.empty(3, 64), x, w, 1e-6)
    with pytest.raises(TypeError, match="dtype int64"):
        kernels.rms_norm(torch.empty(4, 64, dtype=torch.long), torch.ones(4, 64, dtype=torch.long), w, 1e-6)
    with pytest.raises(ValueError, match="epsilon"):
        kernels.rms_norm(torch.empty_like(x), x, w, -1.0)
    with pytest.raises(ValueError, match="overlap"):
        kernels.fused_add_rms_norm(x, x, w, 1e-6)
    with pytest.raises(ValueError, match="overlap"):
        kernels.rms_norm(x[1:], x[:-1], w, 1e-6)


def ref_layer_norm(v: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    vd = v.double()
    mean = vd.mean(-1, keepdim=True)
    var = (vd - mean).pow(2).mean(-1, keepdim=True)
    return ((vd - mean) / torch.sqrt(var + eps) * w.double() + b.double()).float()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (3, 17), (64, 768), (2, 3, 384), (5, 1000), (0, 64)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_layer_norm(kernels, dtype, shape, with_residual):
    """An encoder's post-norm block: LayerNorm(x + residual), the sum rounded to the dtype as torch's add, the
    statistics in float32 (a float64 reference), float32 weight and bias; in place into residual."""
    x = torch.randn(shape, dtype=dtype) * 3 + 1  # an offset: the variance is taken around the mean
    res = torch.randn(shape, dtype=dtype) if with_residual else None
    w, b = torch.randn(shape[-1]), torch.randn(shape[-1])
    v = (x.float() + res.float()).to(dtype) if with_residual else x
    expected = ref_layer_norm(v, w, b, 1e-12)
    out = res if with_residual else torch.empty_like(x)
    kernels.add_layer_norm(out, x, res, w, b, 1e-12)
    assert_close(out, expected, dtype)
    if dtype != torch.float32 and x.numel():  # torch's own bf16 / f16 LayerNorm of the same sum agrees as closely
        torch_ln = torch.nn.functional.layer_norm(v.float(), (shape[-1],), w, b, 1e-12)
        assert_close(out, torch_ln, dtype)


def test_add_layer_norm_bad_input(kernels):
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    w = torch.randn(64)
    with pytest.raises(TypeError, match="weight must be float32"):
        kernels.add_layer_norm(torch.empty_like(x), x, None, w.bfloat16(), w, 1e-5)
    with pytest.raises(ValueError, match="bias must be a contiguous 1-D tensor of 64"):
        kernels.add_layer_norm(torch.empty_like(x), x, None, w, torch.randn(32), 1e-5)
    with pytest.raises(ValueError, match="residual must have the shape of input"):
        kernels.add_layer_norm(torch.empty_like(x), x, torch.randn(4, 32, dtype=torch.bfloat16), w, w, 1e-5)
