"""Rotary embedding (NeoX and GPT-J, partial rotary) against a torch reference."""

import pytest
import torch

from .tolerances import DTYPES, assert_close


def cos_sin_cache(max_pos: int, rot_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def ref_rotary(positions, x, head_size, cache, neox):
    """x: [T, H*hs] -> rotated copy in f32 (HF's rotate_half / rotate_every_two)."""
    t = x.shape[0]
    x = x.float().view(t, -1, head_size).clone()
    rot_dim = cache.shape[1]
    cos, sin = cache[positions].float().chunk(2, dim=-1)  # [T, rot/2]
    cos, sin = cos[:, None, :], sin[:, None, :]
    r = x[..., :rot_dim]
    if neox:
        a, b = r[..., : rot_dim // 2], r[..., rot_dim // 2 :]
        r = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    else:
        a, b = r[..., 0::2], r[..., 1::2]
        r = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    x[..., :rot_dim] = r
    return x.view(t, -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("head_size,rot_dim", [(64, 64), (128, 128), (80, 80), (128, 64), (256, 256), (96, 48)])
def test_rotary(kernels, dtype, neox, head_size, rot_dim):
    tokens, q_heads, k_heads, max_pos = 11, 4, 2, 4096
    cache = cos_sin_cache(max_pos, rot_dim)
    positions = torch.randint(0, max_pos, (tokens,))
    q = torch.randn(tokens, q_heads * head_size, dtype=dtype)
    k = torch.randn(tokens, k_heads * head_size, dtype=dtype)
    eq, ek = ref_rotary(positions, q, head_size, cache, neox), ref_rotary(positions, k, head_size, cache, neox)
    kernels.rotary_embedding(positions, q, k, head_size, cache, neox)
    assert_close(q, eq, dtype)
    assert_close(k, ek, dtype)


def test_rotary_views_of_fused_qkv_and_cache_dtype(kernels):
    """q and k as column slices of a fused qkv output (token stride > row), 3-D views, bf16 cache, no key."""
    tokens, hs, qh, kh = 5, 64, 4, 2
    qkv = torch.randn(tokens, (qh + 2 * kh) * hs, dtype=torch.bfloat16)
    q = qkv[:, : qh * hs]
    k = qkv[:, qh * hs : (qh + kh) * hs].view(tokens, kh, hs)
    v_before = qkv[:, (qh + kh) * hs :].clone()
    cache = cos_sin_cache(64, hs).bfloat16()
    positions = torch.arange(tokens) + 3
    eq, ek = ref_rotary(positions, q, hs, cache, True), ref_rotary(positions, k.reshape(tokens, -1), hs, cache, True)
    kernels.rotary_embedding(positions, q, k, hs, cache, True)
    assert_close(q, eq, torch.bfloat16)
    assert_close(k.reshape(tokens, -1), ek, torch.bfloat16)
    assert torch.equal(qkv[:, (qh + kh) * hs :], v_before)
    q2 = torch.randn(tokens, qh * hs)
    e2 = ref_rotary(positions, q2, hs, cache.float(), False)
    kernels.rotary_embedding(positions, q2, None, hs, cache.float(), False)
    assert_close(q2, e2, torch.float32)


def test_rotary_bad_input(kernels):
    cache = cos_sin_cache(16, 64)
    q = torch.randn(3, 128)
    with pytest.raises(IndexError, match=r"positions\[1\] = 16 is outside the cos_sin_cache \(16 positions\)"):
        kernels.rotary_embedding(torch.tensor([0, 16, 2]), q, None, 64, cache, True)
    with pytest.raises(IndexError, match="outside"):
        kernels.rotary_embedding(torch.tensor([0, -1, 2]), q, None, 64, cache, True)
    with pytest.raises(TypeError, match="positions must be an int64"):
        kernels.rotary_embedding(torch.tensor([0, 1, 2], dtype=torch.int32), q, None, 64, cache, True)
    with pytest.raises(ValueError, match="not a multiple of head_size"):
        kernels.rotary_embedding(torch.arange(3), torch.randn(3, 100), None, 64, cache, True)
    with pytest.raises(ValueError, match="rot_dim must be even and at most head_size"):
        kernels.rotary_embedding(torch.arange(3), q, None, 32, cache, True)
    with pytest.raises(ValueError, match="one entry per token"):
        kernels.rotary_embedding(torch.arange(2), q, None, 64, cache, True)
    with pytest.raises(ValueError, match="key has 2 tokens but query has 3"):
        kernels.rotary_embedding(torch.arange(3), q, torch.randn(2, 64), 64, cache, True)
