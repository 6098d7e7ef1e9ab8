"""linear (decode GEMV, any M) against a float32 torch reference, per variant, and ops.linear's routing."""

import numpy as np
import pytest
import torch

from cpuinfer import ops

from .tolerances import DTYPES, TOL

# f32 outputs carry accumulation-order differences over K terms, not just one rounding.
LINEAR_TOL = {**TOL, torch.float32: dict(atol=1e-4, rtol=1e-4)}


def _reference(x, w, b):
    out = x.float() @ w.float().T
    return out + b.float() if b is not None else out


def _check(out, x, w, b, dtype):
    torch.testing.assert_close(out.float(), _reference(x, w, b), **LINEAR_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 16, 70])
@pytest.mark.parametrize("n,k", [(64, 64), (37, 72), (130, 100), (9, 15), (3, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear(kernels, dtype, m, n, k, bias):
    x = torch.randn(m, k, dtype=dtype)
    w = (torch.randn(n, k) / k**0.5).to(dtype)
    b = torch.randn(n, dtype=dtype) if bias else None
    out = torch.empty(m, n, dtype=dtype)
    kernels.linear(out, x, w, b)
    _check(out, x, w, b, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_strided_rows(kernels, dtype):
    # x rows are a column slice of a wider tensor and out is a slice too: only the last dim is contiguous.
    big = torch.randn(5, 200, dtype=dtype)
    x = big[:, 7 : 7 + 131]
    w = (torch.randn(70, 131) / 131**0.5).to(dtype)
    out_big = torch.full((5, 90), 7.0, dtype=dtype)
    out = out_big[:, 10:80]
    kernels.linear(out, x, w, None)
    _check(out, x, w, None, dtype)
    assert (out_big[:, :10] == 7).all() and (out_big[:, 80:] == 7).all()


def test_linear_decode_shape(kernels):
    # A SmolLM2-sized projection: K and N large enough to split over threads.
    x = torch.randn(2, 576, dtype=torch.bfloat16)
    w = (torch.randn(1536, 576) / 24).to(torch.bfloat16)
    out = torch.empty(2, 1536, dtype=torch.bfloat16)
    kernels.linear(out, x, w, None)
    _check(out, x, w, None, torch.bfloat16)


def test_linear_bad_input(kernels):
    x, w, out = torch.randn(2, 8), torch.randn(4, 8), torch.empty(2, 4)
    with pytest.raises(TypeError, match="weight has dtype bfloat16 but input is float32"):
        kernels.linear(out, x, w.bfloat16(), None)
    with pytest.raises(TypeError, match="out has dtype float16 but input is float32"):
        kernels.linear(out.half(), x, w, None)
    with pytest.raises(TypeError, match="bias has dtype"):
        kernels.linear(out, x, w, torch.zeros(4, dtype=torch.float16))
    with pytest.raises(TypeError, match="supported dtypes"):
        kernels.linear(out, x.int(), w, None)
    with pytest.raises(ValueError, match="in_features"):
        kernels.linear(out, torch.randn(2, 9), w, None)
    with pytest.raises(ValueError, match="out must be"):
        kernels.linear(torch.empty(2, 5), x, w, None)
    with pytest.raises(ValueError, match="bias must be 1-D"):
        kernels.linear(out, x, w, torch.zeros(5))
    with pytest.raises(ValueError, match="weight must be 2-D"):
        kernels.linear(out, x, torch.randn(4, 8, 1), None)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        kernels.linear(out, x, torch.randn(8, 8)[:, :4].T.contiguous().T[:4], None)
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        kernels.linear(out, torch.randn(8, 2).T, w, None)
    with pytest.raises(ValueError, match="overlap"):
        buf = torch.randn(2, 8)
        kernels.linear(buf[:, :4], buf, w, None)
    with pytest.raises(ValueError, match="overlap"):
        w8 = torch.randn(8, 8)
        kernels.linear(w8[:2], x, w8, None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ops_linear_leading_dims_and_fallback(dtype):
    w = (torch.randn(48, 40) / 40**0.5).to(dtype)
    b = torch.randn(48, dtype=dtype)
    for shape in [(3, 40), (2, 3, 40), (40,), (70, 40), (0, 40)]:
        x = torch.randn(shape, dtype=dtype)
        out = ops.linear(x, w, b)
        assert out.shape == (*shape[:-1], 48) and out.dtype == dtype
        torch.testing.assert_close(out.float(), (x.float() @ w.float().T + b.float()), **LINEAR_TOL[dtype])
    # Each row's result does not depend on how many rows are computed together.
    x = torch.randn(70, 40, dtype=dtype)
    full = ops.linear(x, w, b)
    assert all(torch.equal(ops.linear(x[i:j], w, b), full[i:j]) for i, j in [(0, 1), (3, 8), (5, 21), (64, 70)])
    # Non-contiguous weight and strided-last-dim x take torch's path, still correct.
    wt = w.T.contiguous().T
    x = torch.randn(4, 80, dtype=dtype)[:, ::2]
    torch.testing.assert_close(ops.linear(x, wt).float(), x.float() @ w.float().T, **LINEAR_TOL[dtype])


def _layout(kernels, dtype):
    return ops.pack_layout(dtype, kernels)


def _pack(kernels, w):
    packed = torch.empty_like(w)
    kernels.linear_pack_weight(packed, w)
    return packed


def _reference64(x, w, b):
    out = x.double() @ w.double().T
    return out + b.double() if b is not None else out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [4, 23, 70])
def test_packed_weight_layout(kernels, dtype, n):
    """The packed layout is the documented panel interleave; tail rows stay as they were."""
    cols, pair = _layout(kernels, dtype)
    assert pair in (1, 2) and cols % 2 == 0
    k = 3 * cols + 2
    w = (torch.randn(n, k) / k**0.5).to(dtype)
    packed = _pack(kernels, w)
    full = n // cols * cols
    # Independent statement of the layout: element (n, k) of panel n // C at (k // P) * C * P + (n % C) * P + k % P.
    want = w[:full].reshape(full // cols, cols, k // pair, pair).permute(0, 2, 1, 3).reshape(full, k)
    assert torch.equal(packed[:full], want) and torch.equal(packed[full:], w[full:])


# Rows crossing the register tile (6 or 12 rows: GEMV below, GEMM above), primes, and a row count that
# spans several row chunks; out features with and without a tail past the last panel; K odd where the
# layout allows it (pair 1), K not a multiple of the vector width.
GEMM_ROWS = [1, 2, 3, 5, 7, 8, 11, 12, 13, 16, 17, 23, 24, 25, 31, 32, 37, 64, 97, 128, 131]


@pytest.mark.parametrize("dtype", DTYPES)
# (96, 576): K a multiple of 32 over several of the AMX tile's K blocks, which up to 32 rows it streams unblocked.
@pytest.mark.parametrize("n,k", [(64, 64), (37, 72), (130, 100), (96, 33), (2, 8), (256, 1000), (96, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_every_m(kernels, dtype, n, k, bias):
    """Packed linear against a float64 reference for every M across the GEMV/GEMM boundary."""
    _cols, pair = _layout(kernels, dtype)
    if k % pair:
        k += 1
    w = (torch.randn(n, k) / k**0.5).to(dtype)
    b = torch.randn(n, dtype=dtype) if bias else None
    packed = _pack(kernels, w)
    x_all = torch.randn(max(GEMM_ROWS), k, dtype=dtype)
    outs = {}
    for m in GEMM_ROWS:
        x = x_all[:m]
        out = torch.empty(m, n, dtype=dtype)
        kernels.linear(out, x, packed, b, packed=True)
        torch.testing.assert_close(out.double(), _reference64(x, w, b), **LINEAR_TOL[dtype], check_dtype=False)
        outs[m] = out
    # Batch invariance: a row's bits do not depend on how many rows are computed with it.
    full = outs[max(GEMM_ROWS)]
    for m, out in outs.items():
        assert torch.equal(out, full[:m]), f"rows 0..{m} differ when computed in a batch of {m}"


def test_packed_linear_long_prefill(kernels):
    """Several row chunks and both threads' ranges: a 2048-token prefill on a Gemma-sized down projection."""
    k, n, m = 2048, 640, 2048
    w = (torch.randn(n, k) / k**0.5).bfloat16()
    x = torch.randn(m, k, dtype=torch.bfloat16)
    b = torch.randn(n, dtype=torch.bfloat16)
    out = torch.empty(m, n, dtype=torch.bfloat16)
    packed = _pack(kernels, w)
    kernels.linear(out, x, packed, b, packed=True)
    torch.testing.assert_close(out.float(), _reference(x, w, b), **LINEAR_TOL[torch.bfloat16])
    one = torch.empty(3, n, dtype=torch.bfloat16)
    kernels.linear(one, x[1000:1003], packed, b, packed=True)
    assert torch.equal(one, out[1000:1003])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_linear_strided_and_misaligned(kernels, dtype):
    """x and out as column slices (rows strided, start not vector aligned, an odd element offset)."""
    cols, _pair = _layout(kernels, dtype)
    k, n, m = 6 * cols, 2 * cols + 5, 40
    big = torch.randn(m, k + 9, dtype=dtype)
    x = big[:, 3 : 3 + k]
    w = (torch.randn(n, k) / k**0.5).to(dtype)
    out_big = torch.full((m, n + 11), 7.0, dtype=dtype)
    out = out_big[:, 5 : 5 + n]
    kernels.linear(out, x, _pack(kernels, w), None, packed=True)
    _check(out, x, w, None, dtype)
    assert (out_big[:, :5] == 7).all() and (out_big[:, 5 + n :] == 7).all()


def test_packed_weight_bad_input(kernels):
    cols, pair = _layout(kernels, torch.bfloat16)
    if pair > 1:
        w = torch.randn(8, 2 * cols + 1, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=f"multiple of {pair}"):
            kernels.linear_pack_weight(torch.empty_like(w), w)
        x, out = torch.randn(1, 2 * cols + 1, dtype=torch.bfloat16), torch.empty(1, 8, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="packed layout"):
            kernels.linear(out, x, w, None, packed=True)
    w = torch.randn(8, cols, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="shape of weight"):
        kernels.linear_pack_weight(torch.empty(4, cols, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="overlap"):
        kernels.linear_pack_weight(w, w)
    with pytest.raises(TypeError, match="out has dtype float16 but weight is bfloat16"):
        kernels.linear_pack_weight(torch.empty(8, cols, dtype=torch.float16), w)
    with pytest.raises(ValueError, match="dtype must be"):
        kernels.linear_pack_pair("int8")
    packed = _pack(kernels, w)
    with pytest.raises(ValueError, match="in_features"):
        kernels.linear(
            torch.empty(2, 8, dtype=torch.bfloat16),
            torch.randn(2, cols + 2, dtype=torch.bfloat16),
            packed,
            None,
            packed=True,
        )
    with pytest.raises(ValueError, match="out must be"):
        kernels.linear(
            torch.empty(2, 9, dtype=torch.bfloat16),
            torch.randn(2, cols, dtype=torch.bfloat16),
            packed,
            None,
            packed=True,
        )
    with pytest.raises(TypeError, match="input has dtype int32; supported dtypes"):
        kernels.linear(
            torch.empty(2, 8, dtype=torch.bfloat16), torch.zeros(2, cols, dtype=torch.int32), packed, None, packed=True
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_rows_prefill_sized_batch(kernels, dtype):
    """Thousands of ids (a prefill's: the rows split over threads), every variant's layout, tail rows included."""
    cols, pair = _layout(kernels, dtype)
    n, k = cols * 40 + 5, 24 * pair
    w = torch.randn(n, k).to(dtype)
    packed = _pack(kernels, w)
    ids = torch.randint(0, n, (5000,))
    ids[:3] = torch.tensor([n - 1, 0, cols * 40])
    out = torch.empty(ids.numel(), k, dtype=dtype)
    kernels.linear_packed_rows(out, packed, ids)
    assert torch.equal(out, w[ids])
    with pytest.raises(TypeError, match="ids must be an int64"):
        kernels.linear_packed_rows(out, packed, ids.int())
    with pytest.raises(ValueError, match="out must be"):
        kernels.linear_packed_rows(out[:-1], packed, ids)


def test_packed_rows_read_embeddings_back():
    """A tied embedding table is stored packed once: lookups read the original rows back, tail rows included."""
    cols, _ = ops.pack_layout(torch.bfloat16)
    n = cols * 5 + 3
    w = torch.randn(n, 2 * cols, dtype=torch.bfloat16)
    assert ops.can_pack(w) and not ops.can_pack(w.float())
    packed = ops.pack_weight(w)
    ids = torch.tensor([0, 3, 4, n - 1, n - 2, n - 3, n - 4, cols, cols + 1, 7, 7])
    assert torch.equal(ops.packed_rows(packed, ids), w[ids])
    assert torch.equal(ops.packed_rows(packed, ids[:4]), w[ids[:4]])
    x = torch.randn(2, w.shape[1], dtype=torch.bfloat16)
    torch.testing.assert_close(
        ops.linear(x, packed, packed=True).float(), x.float() @ w.float().T, **LINEAR_TOL[torch.bfloat16]
    )
    for bad in ([n], [-1], [0, n + 5]):
        with pytest.raises(IndexError, match="token ids"):
            ops.packed_rows(packed, torch.tensor(bad))
    with pytest.raises(ValueError, match="packed weight"):
        ops.linear(x.float(), packed.float(), packed=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("m", [1, 3, 13, 32, 70])
def test_float32_out_unrounded_and_rounded(kernels, dtype, packed, m):
    """out float32 (a tensor-parallel rank's share of a row-parallel projection): the f32 sums (+ bias) before
    the one rounding, so rounding them to dtype gives the dtype output's bits, and they are the float64
    product to f32 accuracy. With rounded=True (the logits): those sums rounded to dtype by torch, as float32,
    bit for bit. Row-major and packed weights, panels and the row-major tail of a packed one."""
    cols, pair = _layout(kernels, dtype)
    n, k = 2 * cols + 5, 64 * pair
    x = torch.randn(m, k, dtype=dtype)
    w = (torch.randn(n, k) / k**0.5).to(dtype)
    b = torch.randn(n, dtype=dtype)
    weight = _pack(kernels, w) if packed else w
    native, wide, rounded = torch.empty(m, n, dtype=dtype), torch.empty(m, n), torch.full((m, n), float("nan"))
    kernels.linear(native, x, weight, b, packed=packed)
    kernels.linear(wide, x, weight, b, packed=packed)
    kernels.linear(rounded, x, weight, b, packed=packed, rounded=True)
    assert torch.equal(wide.to(dtype), native)
    torch.testing.assert_close(wide.double(), _reference64(x, w, b), atol=1e-5, rtol=1e-5)
    assert torch.equal(rounded, wide.to(dtype).float())
    assert not torch.equal(rounded, wide)  # the rounding happened (some of the m * n sums are not dtype values)
    with pytest.raises(TypeError, match="out must be the input's dtype, or float32"):
        other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
        kernels.linear(torch.empty(m, n, dtype=other), x, weight, b, packed=packed)
    with pytest.raises(ValueError, match="rounded=True needs a float32 out"):
        kernels.linear(native, x, weight, b, packed=packed, rounded=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rounded_float32_out_past_the_caches(kernels, dtype):
    """A rounded float32 out larger than the L2 (logits of a decode batch) takes streaming stores on x86:
    still the unrounded sums rounded to dtype by torch, in whole panels and the tail, and when out's rows are
    not aligned (plain stores)."""
    cols, pair = _layout(kernels, dtype)
    m, n, k = 24, 1024 * cols + 5, 32 * pair  # 3 MB of out
    x = torch.randn(m, k, dtype=dtype)
    w = (torch.randn(n, k) / k**0.5).to(dtype)
    packed = _pack(kernels, w)
    wide = torch.empty(m, n)
    kernels.linear(wide, x, packed, None, packed=True)
    width = (n + 1 + 63) // 64 * 64  # rows 256 bytes apart: aligned for any vector
    for pad in (0, 1):  # rows starting at a vector multiple, and one float off it
        buf = torch.full((m, width), float("nan"))
        out = buf[:, pad : pad + n]
        assert (out.data_ptr() % 64 == 0) == (pad == 0)
        kernels.linear(out, x, packed, None, packed=True, rounded=True)
        assert torch.equal(out, wide.to(dtype).float())


def test_ops_linear_rounded():
    """ops.linear(out_dtype=float32, rounded=True) is linear(...).float() on every path: our dense kernel
    (row-major, packed), a quantized weight and torch's float32 (where rounding changes nothing)."""
    from cpuinfer.quantization import QuantWeight

    x = torch.randn(7, 64, dtype=torch.bfloat16)
    w = (torch.randn(40, 64) / 8).to(torch.bfloat16)
    for weight, packed in [(w, False), (ops.pack_weight(w), True)]:
        out = ops.linear(x, weight, None, packed, torch.float32, rounded=True)
        assert out.dtype == torch.float32 and torch.equal(out, ops.linear(x, weight, None, packed).float())
    rng = np.random.default_rng(0)
    u = rng.integers(0, 16, (40, 64), dtype=np.uint8)
    d = (rng.random((40, 2)) * 0.01 + 1e-3).astype(np.float16)
    z = rng.integers(0, 16, (40, 2), dtype=np.uint8)
    q = QuantWeight.pack(u, d, z, bits=4, group=32, kind="test")
    out = ops.linear(x, q, None, False, torch.float32, rounded=True)
    assert out.dtype == torch.float32 and torch.equal(out, ops.linear(x, q).float())
    xf, wf = x.float(), w.float()
    assert torch.equal(ops.linear(xf, wf, None, False, torch.float32, rounded=True), ops.linear(xf, wf))
    with pytest.raises(ValueError, match=r"rounded=True needs out_dtype=torch\.float32"):
        ops.linear(x, w, rounded=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_ops_linear_out_dtype(dtype):
    """ops.linear(out_dtype=torch.float32): the unrounded sums on every path (packed, row-major, torch's for
    float32 input); rounded, the default output's bits. Only float32 may differ from the input's dtype."""
    x = torch.randn(9, 64, dtype=dtype)
    w = (torch.randn(40, 64) / 8).to(dtype)
    b = torch.randn(40, dtype=dtype)
    weights = [(w, False)] + ([(ops.pack_weight(w), True)] if dtype != torch.float32 else [])
    for weight, packed in weights:
        wide = ops.linear(x, weight, b, packed, out_dtype=torch.float32)
        assert wide.dtype == torch.float32
        assert torch.equal(wide.to(dtype), ops.linear(x, weight, b, packed))
        torch.testing.assert_close(wide.double(), _reference64(x, w, b), atol=1e-5, rtol=1e-5)
        with pytest.raises(ValueError, match="out_dtype must be the input's dtype"):
            ops.linear(x, weight, b, packed, out_dtype=torch.float64)
