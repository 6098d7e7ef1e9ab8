"""The quantized linear layer against the formats' own dequantization (the `gguf` package) and torch.

GGUF legacy blocks are made by gguf's own quantizer; K-quant blocks (which gguf cannot quantize) are
random bytes with finite scales, which ggml reads like any other. The reference weight is always
gguf.dequantize's, never ours.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cpuinfer.quantization import QuantStack, QuantWeight, concat
from cpuinfer.quantization.gguf_blocks import KEPT_TYPES, unpack

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
K_SCALE_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # the f16 fields of a K-quant block


def gguf_tensor(kind: str, rows: int, cols: int, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """(raw blocks [rows, bytes], the reference float32 weight from gguf.dequantize)."""
    rng = np.random.default_rng(seed)
    if kind in BLOCK_BYTES:
        n = rows * cols // 256
        raw = rng.integers(0, 256, (n, BLOCK_BYTES[kind]), dtype=np.uint8)
        for off in K_SCALE_OFFSETS[kind]:  # finite, modest super-block scales
            raw[:, off : off + 2] = (rng.random(n) * 0.01 + 1e-4).astype(np.float16).view(np.uint8).reshape(n, 2)
        raw = raw.reshape(rows, -1)
    else:
        raw = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, Q[kind])
    ref = torch.from_numpy(gguf.dequantize(raw, Q[kind]).reshape(rows, cols).astype(np.float32))
    return raw, ref


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: each row quantized per block of 32 to int8 with scale amax / 127."""
    xb = x.float().reshape(x.shape[0], -1, 32)
    dx = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(dx != 0, 1 / dx, torch.zeros_like(dx))
    return (torch.round(xb * inv).clamp(-127, 127) * dx).reshape(x.shape)


@pytest.mark.parametrize("kind", KEPT_TYPES)
def test_unpack_matches_gguf_dequantize(kind):
    """Our QuantWeight of a GGUF tensor dequantizes to gguf's own result (K-quant scales within f16 rounding)."""
    raw, ref = gguf_tensor(kind, 48, 512)
    w = unpack(kind, raw, 48, 512)
    got = w.dequantize()
    if kind.endswith("_K"):
        # The group's scale d * sc and minimum dmin * mn are stored as f16, each within 2^-11 of itself:
        # |d * sc| * u spans the group's range and |dmin * mn| is at most its largest magnitude.
        group = 16 if kind == "Q6_K" else 32
        g = ref.reshape(48, -1, group)
        bound = (g.amax(-1) - g.amin(-1) + g.abs().amax(-1)) * 2.0**-11
        assert ((got - ref).abs().reshape(48, -1, group) <= bound.unsqueeze(-1) * 1.01 + 1e-12).all()
    else:
        assert torch.equal(got, ref)
    # Never a dequantized copy, and values at their own width (5 and 6 bits too): bits + f16 scale (+ u8 zero
    # point or f16 minimum) per group, at most Q6_K's 7.5 bits per weight against its file's 6.56 (its group
    # scales are int8 there). MXFP4 stays as the file has it (codes and exponent bytes): 4.25 bits, the same bytes.
    assert w.bits == {"Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6, "Q8_0": 8}.get(kind, 4)
    assert w.fp4 == (kind == "MXFP4")
    if kind == "MXFP4":
        assert w.d is None and w.nbytes == raw.nbytes
    else:
        assert w.nbytes <= raw.nbytes * 1.15


@pytest.mark.parametrize("kind", KEPT_TYPES)
@pytest.mark.parametrize("m", [1, 3, 17, 64])
def test_quant_linear_matches_torch(kernels, kind, m):
    """f32 out equals the int8-activation product to f32 accuracy, and torch's product on gguf's weight within 2%."""
    rows, cols = 72, 512  # 72: a partial last panel
    raw, ref = gguf_tensor(kind, rows, cols, seed=m)
    w = unpack(kind, raw, rows, cols)
    x = torch.randn(m, cols)
    out = torch.empty(m, rows)
    kernels.quant_linear(out, x, w, None)
    deq = w.dequantize().double()
    exact = int8_rows(x).double() @ deq.T
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
    full = x.double() @ ref.double().T
    assert (out.double() - full).abs().max() <= 0.02 * full.abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quant_linear_half_inputs_and_bias(kernels, dtype):
    """bf16/f16 activations and bias: the f32 result plus bias, rounded once."""
    raw, _ = gguf_tensor("Q4_1", 48, 256)
    w = unpack("Q4_1", raw, 48, 256)
    x = torch.randn(5, 256).to(dtype)
    bias = torch.randn(48).to(dtype)
    out = torch.empty(5, 48, dtype=dtype)
    kernels.quant_linear(out, x, w, bias)
    ref32 = torch.empty(5, 48)
    kernels.quant_linear(ref32, x.float(), w, None)
    assert torch.equal(out, (ref32 + bias.float()).to(dtype))


@pytest.mark.parametrize("kind", KEPT_TYPES)
def test_batch_invariant_and_same_on_every_variant(kernels, kind):
    """A row's result is the same alone or in any batch, bit for bit, and equal to the generic build's: the
    row groups of 1-4 rows, 5-16 rows (amx: AMX-INT8 tiles from 5 rows) and 100 rows take different tiles,
    and 17-64 rows (amx: several 16-row chunks) run panel by panel through every chunk."""
    raw, _ = gguf_tensor(kind, 80, 512)
    w = unpack(kind, raw, 80, 512)
    x = torch.randn(100, 512)  # float32 out: every bit of the accumulation shows
    batch = torch.empty(100, 80)
    kernels.quant_linear(batch, x, w, None)
    for rows in (
        [0],
        [37, 38, 39],
        list(range(50, 59)),
        list(range(60, 76)),
        [99, 3, 17, 42, 8],
        list(range(10, 42)),
        list(range(20, 60)),
    ):
        part = torch.empty(len(rows), 80)
        kernels.quant_linear(part, x[rows], w, None)
        assert torch.equal(part, batch[rows])
    generic = pytest.importorskip("cpuinfer._C_generic")
    ref = torch.empty_like(batch)
    generic.quant_linear(ref, x, w, None)
    assert torch.equal(ref, batch)


def test_stack_of_formats(kernels):
    """A QuantStack (q, k, v in different formats) writes each part's columns: the same as each part alone."""
    parts = [
        unpack(kind, gguf_tensor(kind, n, 256, seed=i)[0], n, 256)
        for i, (kind, n) in enumerate([("Q5_0", 64), ("Q8_0", 32), ("Q4_K", 40)])
    ]
    stack = concat(parts)
    assert isinstance(stack, QuantStack) and stack.n == 136
    x = torch.randn(4, 256)
    out = torch.empty(4, 136)
    kernels.quant_linear(out, x, stack, None)
    col = 0
    for p in parts:
        alone = torch.empty(4, p.n)
        kernels.quant_linear(alone, x, p, None)
        assert torch.equal(out[:, col : col + p.n], alone)
        col += p.n
    same = concat([unpack("Q8_0", gguf_tensor("Q8_0", 32, 256, seed=s)[0], 32, 256) for s in (1, 2)])
    assert isinstance(same, QuantWeight) and same.n == 64  # one format: merged into one weight


def test_rows_lookup():
    """rows(ids) returns the dequantized rows (an embedding lookup), in the requested dtype."""
    raw, ref = gguf_tensor("Q8_0", 50, 128)
    w = unpack("Q8_0", raw, 50, 128)
    ids = torch.tensor([3, 0, 49, 3])
    assert torch.equal(w.rows(ids), ref[ids])
    assert torch.equal(w.rows(ids, torch.bfloat16), ref[ids].to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"ids must be in \[0, 50\)"):
        w.rows(torch.tensor([50]))


def test_malformed_weights_are_refused(kernels):
    """Sizes that do not fit the claimed shape, bad bits or groups: a ValueError naming the problem."""
    raw, _ = gguf_tensor("Q4_0", 32, 128)
    w = unpack("Q4_0", raw, 32, 128)
    x, out = torch.randn(2, 128), torch.empty(2, 32)
    bad = QuantWeight(**{**w.__dict__, "qs": w.qs[:-1]})
    with pytest.raises(ValueError, match=r"weight\.qs has \d+ elements, the weight's shape needs"):
        kernels.quant_linear(out, x, bad, None)
    with pytest.raises(ValueError, match="bits must be 4, 5, 6 or 8, got 3"):
        kernels.quant_linear(out, x, QuantWeight(**{**w.__dict__, "bits": 3}), None)
    six = QuantWeight.empty(32, 128, 6, 32, has_min=True, kind="test")
    with pytest.raises(ValueError, match="no kernel for 6-bit values with minimums in groups of 32"):
        kernels.quant_linear(out, x, six, None)
    with pytest.raises(ValueError, match="group 48 must be 16, or a multiple of 32"):
        kernels.quant_linear(out, x, QuantWeight(**{**w.__dict__, "group": 48}), None)
    with pytest.raises(TypeError, match=r"weight\.d must be a float16 tensor"):
        kernels.quant_linear(out, x, QuantWeight(**{**w.__dict__, "d": w.d.float()}), None)
    with pytest.raises(ValueError, match="input has 64 features but the weight's in_features is 128"):
        kernels.quant_linear(out, torch.randn(2, 64), w, None)
    with pytest.raises(ValueError, match="Q4_0 data holds"):
        unpack("Q4_0", raw[:-1], 32, 128)
    for bits in (4, 5):
        with pytest.raises(ValueError, match=f"u holds {2**bits}, more than {bits} bits"):
            QuantWeight.pack(
                np.full((16, 32), 2**bits, np.uint8),
                np.ones((16, 1), np.float16),
                np.zeros((16, 1), np.uint8),
                bits=bits,
                group=32,
                kind="test",
            )


def permuted_weight(n: int, k: int, bits: int, seed: int = 0) -> tuple[QuantWeight, torch.Tensor]:
    """A zero-point weight packed in a random k order (as GPTQ act-order), and its dequantization in input order."""
    rng = np.random.default_rng(seed)
    u = rng.integers(0, 2**bits, (n, k), dtype=np.uint8)
    d = (rng.random((n, k // 32)) * 0.01 + 1e-3).astype(np.float16)
    z = rng.integers(0, 2**bits, (n, k // 32), dtype=np.uint8)
    perm = rng.permutation(k).astype(np.int32)
    w = QuantWeight.pack(u, d, z, bits=bits, group=32, kind="test", perm=perm)
    packed = np.repeat(d.astype(np.float32), 32, 1) * (u.astype(np.float32) - np.repeat(z, 32, 1))
    ref = np.empty_like(packed)
    ref[:, perm] = packed  # packed k j is input feature perm[j]
    return w, torch.from_numpy(ref)


@pytest.mark.parametrize("bits", [4, 5, 8])
def test_permuted_k_order(kernels, bits):
    """A weight packed in a permuted k order: x is read through perm (torch on the unpermuted weight), rows in
    input order, batch invariant and the same bits on every variant."""
    w, ref = permuted_weight(40, 256, bits)
    assert torch.equal(w.dequantize(), ref)
    x = torch.randn(9, 256, dtype=torch.bfloat16)
    out = torch.empty(9, 40)
    kernels.quant_linear(out, x.float(), w, None)
    xp = x.float()[:, w.perm.long()]  # the kernel quantizes the gathered row per block of 32
    exact = int8_rows(xp).double() @ ref[:, w.perm.long()].double().T
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
    batch = torch.empty(9, 40, dtype=torch.bfloat16)
    kernels.quant_linear(batch, x, w, None)
    one = torch.empty(1, 40, dtype=torch.bfloat16)
    kernels.quant_linear(one, x[4:5], w, None)
    assert torch.equal(one, batch[4:5])
    generic = pytest.importorskip("cpuinfer._C_generic")
    same = torch.empty_like(batch)
    generic.quant_linear(same, x, w, None)
    assert torch.equal(same, batch)


def test_parts_in_different_k_orders_stay_apart(kernels):
    """concat keeps weights of different perms as separate parts (each reads x its own way); equal perms merge."""
    a, _ = permuted_weight(32, 128, 4, seed=1)
    b, _ = permuted_weight(32, 128, 4, seed=2)
    stack = concat([a, b])
    assert isinstance(stack, QuantStack) and len(stack.parts) == 2
    x = torch.randn(3, 128)
    out = torch.empty(3, 64)
    kernels.quant_linear(out, x, stack, None)
    for i, p in enumerate((a, b)):
        alone = torch.empty(3, 32)
        kernels.quant_linear(alone, x, p, None)
        assert torch.equal(out[:, 32 * i : 32 * i + 32], alone)
    twin = QuantWeight(**{**a.__dict__, "perm": a.perm.clone()})
    merged = concat([a, twin])
    assert isinstance(merged, QuantWeight) and merged.n == 64 and torch.equal(merged.perm, a.perm)


def test_bad_perm_is_refused(kernels):
    """A perm that is not a permutation of 0..k-1 is a ValueError naming it (it is read by index)."""
    w, _ = permuted_weight(16, 64, 4)
    x, out = torch.randn(1, 64), torch.empty(1, 16)
    dup = w.perm.clone()
    dup[0] = dup[1]
    with pytest.raises(ValueError, match=r"weight\.perm is not a permutation of 0\.\.63"):
        kernels.quant_linear(out, x, QuantWeight(**{**w.__dict__, "perm": dup}), None)
    with pytest.raises(ValueError, match=r"weight\.perm has 63 elements"):
        kernels.quant_linear(out, x, QuantWeight(**{**w.__dict__, "perm": w.perm[:63].clone()}), None)
    with pytest.raises(ValueError, match="perm must be a permutation"):
        QuantWeight.pack(
            np.zeros((16, 64), np.uint8),
            np.ones((16, 2), np.float16),
            np.zeros((16, 2), np.uint8),
            bits=4,
            group=32,
            kind="test",
            perm=np.zeros(64, np.int32),
        )


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_activation_makes_its_row_nan_and_only_its_row(kernels, bad):
    """As torch's product would be inf or NaN: the row holding it is NaN (on every variant alike), the rest exact."""
    raw, _ = gguf_tensor("Q4_0", 48, 256)
    w = unpack("Q4_0", raw, 48, 256)
    x = torch.randn(20, 256)
    x[7, 100] = bad
    out = torch.empty(20, 48)
    kernels.quant_linear(out, x, w, None)
    assert out[7].isnan().all()
    keep = [r for r in range(20) if r != 7]
    exact = int8_rows(x[keep]).double() @ w.dequantize().double().T
    torch.testing.assert_close(out[keep].double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())


@pytest.mark.parametrize("kind", ["Q4_1", "Q5_0", "Q6_K", "Q8_0"])
def test_float32_out_is_the_unrounded_sum(kernels, kind):
    """out float32 (a tensor-parallel rank's share of a row-parallel projection): the f32 sums (+ bias), which
    round to the bfloat16 output's bits; also through a stack of two formats."""
    raw, _ = gguf_tensor(kind, 40, 256, seed=3)
    other, _ = gguf_tensor("Q4_0", 24, 256, seed=4)
    x = torch.randn(7, 256, dtype=torch.bfloat16)
    for w in (unpack(kind, raw, 40, 256), concat([unpack(kind, raw, 40, 256), unpack("Q4_0", other, 24, 256)])):
        b = torch.randn(w.n, dtype=torch.bfloat16)
        rounded, wide = torch.empty(7, w.n, dtype=torch.bfloat16), torch.empty(7, w.n)
        kernels.quant_linear(rounded, x, w, b)
        kernels.quant_linear(wide, x, w, b)
        assert torch.equal(wide.to(torch.bfloat16), rounded)
        exact = int8_rows(x).double() @ w.dequantize().double().T + b.double()
        torch.testing.assert_close(wide.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
    with pytest.raises(TypeError, match="out must be the input's dtype, or float32"):
        kernels.quant_linear(torch.empty(7, w.n, dtype=torch.float16), x, w, b)
