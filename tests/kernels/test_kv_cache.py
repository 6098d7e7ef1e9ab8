"""reshape_and_cache against torch indexing and torch's own float8_e5m2 conversion, per variant."""

import pytest
import torch

from cpuinfer import ops

from .paged_reference import CACHE_DTYPES, cache_view

MODEL_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def write(kernels, key, value, kc, vc, slots):
    kernels.reshape_and_cache(key, value, cache_view(kc), cache_view(vc), slots)


def expected_cache(cache, rows, slots):
    """torch reference: rows [T, H, D] placed at slots of a [N, H, bs, D] cache; negative slots skipped."""
    n, h, bs, d = cache.shape
    flat = cache.clone().permute(0, 2, 1, 3).reshape(n * bs, h, d)
    keep = slots >= 0
    flat[slots[keep]] = rows[keep].to(cache.dtype)
    return flat.view(n, bs, h, d).permute(0, 2, 1, 3)


def same_bits(a, b):
    if a.dtype == torch.float8_e5m2:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(
        a.contiguous().view(
            torch.int8 if a.element_size() == 1 else torch.int16 if a.element_size() == 2 else torch.int32
        ),
        b.contiguous().view(
            torch.int8 if b.element_size() == 1 else torch.int16 if b.element_size() == 2 else torch.int32
        ),
    )


@pytest.mark.parametrize("dtype", MODEL_DTYPES)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("block_size,head_size", [(16, 64), (32, 80), (16, 256), (48, 96)])
def test_write_matches_torch(kernels, dtype, cache_dtype, block_size, head_size):
    n_blocks, heads, tokens = 6, 3, 37
    kc = torch.randn(n_blocks, heads, block_size, head_size).to(cache_dtype)
    vc = torch.randn(n_blocks, heads, block_size, head_size).to(cache_dtype)
    key = (torch.randn(tokens, heads, head_size) * 100).to(dtype)
    value = torch.randn(tokens, heads, head_size).to(dtype)
    slots = torch.randperm(n_blocks * block_size)[:tokens]
    slots[::5] = -1  # padding tokens
    want_k, want_v = expected_cache(kc, key, slots), expected_cache(vc, value, slots)
    write(kernels, key, value, kc, vc, slots)
    assert same_bits(kc, want_k)
    assert same_bits(vc, want_v)


def test_strided_key_value_from_fused_qkv(kernels):
    """key and value as slices of one [T, (q + k + v) features] projection output."""
    tokens, heads, d = 9, 2, 64
    qkv = torch.randn(tokens, (4 + 2 * heads) * d).bfloat16()
    key = qkv[:, 4 * d : (4 + heads) * d].view(tokens, heads, d)
    value = qkv[:, (4 + heads) * d :].view(tokens, heads, d)
    kc = torch.zeros(2, heads, 16, d, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    slots = torch.arange(5, 5 + tokens)
    write(kernels, key, value, kc, vc, slots)
    assert torch.equal(kc, expected_cache(torch.zeros_like(kc), key, slots))
    assert torch.equal(vc, expected_cache(torch.zeros_like(vc), value, slots))


def fp8_roundtrip(kernels, x: torch.Tensor) -> torch.Tensor:
    """x (any float dtype, numel a multiple of 64) written into a float8 cache with head_size 64."""
    rows = x.reshape(-1, 1, 64)
    kc = torch.zeros(rows.shape[0], 1, 1, 64, dtype=torch.float8_e5m2)
    vc = torch.zeros_like(kc)
    write(kernels, rows, rows, kc, vc, torch.arange(rows.shape[0]))
    assert torch.equal(kc.view(torch.uint8), vc.view(torch.uint8))
    return kc.reshape(-1)


def test_fp8_every_half_value(kernels):
    """Every f16 bit pattern (incl. subnormals, inf, NaN) from f16 and from f32 inputs rounds like torch."""
    halves = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    for x in (halves, halves.float()):
        got = fp8_roundtrip(kernels, x)
        assert torch.equal(got.view(torch.uint8), x.to(torch.float8_e5m2).view(torch.uint8))


def test_fp8_random_f32_and_bf16_bits(kernels):
    """Random f32 bit patterns over the whole range, ties between e5m2 neighbours, and overflow."""
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 18,), dtype=torch.int64).to(torch.int32)
    ties = (torch.arange(0, 256, dtype=torch.int32) << 8 | 0x80).to(torch.int16).view(torch.float16).float()
    special = torch.tensor(
        [
            57344.0,
            61439.99,
            61440.0,
            65535.0,
            65536.0,
            1e30,
            -1e30,
            2.0**-17,
            3 * 2.0**-17,
            -(2.0**-16) * 0.5,
            float("inf"),
            float("-inf"),
            float("nan"),
        ]
        + [0.0] * 51
    )
    for x in (bits.view(torch.float32), ties, special, bits.view(torch.float32).bfloat16()):
        got = fp8_roundtrip(kernels, x)
        assert torch.equal(got.view(torch.uint8), x.to(torch.float8_e5m2).view(torch.uint8))


def test_ops_wrapper_float8_cache():
    kc = torch.zeros(2, 1, 16, 64, dtype=torch.float8_e5m2)
    vc = torch.zeros_like(kc)
    key = torch.randn(3, 1, 64)
    ops.reshape_and_cache(key, -key, kc, vc, torch.tensor([0, 17, -1]))
    assert torch.equal(kc[0, 0, 0].view(torch.uint8), key[0, 0].to(torch.float8_e5m2).view(torch.uint8))
    assert torch.equal(vc[1, 0, 1].view(torch.uint8), (-key[1, 0]).to(torch.float8_e5m2).view(torch.uint8))
    assert torch.count_nonzero(kc.view(torch.uint8)) == torch.count_nonzero(
        key[:2].to(torch.float8_e5m2).view(torch.uint8)
    )


def test_bad_input(kernels):
    kc = torch.zeros(2, 2, 16, 64, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    key = torch.randn(3, 2, 64)
    slots = torch.tensor([0, 5, 31])
    with pytest.raises(IndexError, match=r"slot_mapping\[2\] = 32 is outside the cache \(2 blocks of 16 slots\)"):
        kernels.reshape_and_cache(key, key, kc, vc, torch.tensor([0, 5, 32]))
    with pytest.raises(ValueError, match="the cache holds 2 KV heads of size 64"):
        kernels.reshape_and_cache(key[:, :1], key[:, :1], kc, vc, slots)
    with pytest.raises(ValueError, match="key and value must have the same shape"):
        kernels.reshape_and_cache(key, key[:2], kc, vc, slots)
    with pytest.raises(ValueError, match="slot_mapping has 2 entries for 3 tokens"):
        kernels.reshape_and_cache(key, key, kc, vc, slots[:2])
    with pytest.raises(TypeError, match="slot_mapping must be an int64 tensor"):
        kernels.reshape_and_cache(key, key, kc, vc, slots.int())
    with pytest.raises(TypeError, match="value has dtype float16 but key is float32"):
        kernels.reshape_and_cache(key, key.half(), kc, vc, slots)
    with pytest.raises(ValueError, match="must be contiguous"):
        kernels.reshape_and_cache(key, key, kc.transpose(1, 2), vc.transpose(1, 2), slots)
    with pytest.raises(ValueError, match="must be different tensors"):
        kernels.reshape_and_cache(key, key, kc, kc, slots)
    with pytest.raises(TypeError, match="KV-cache dtypes"):
        kernels.reshape_and_cache(key, key, kc.int(), vc.int(), slots)
