"""Tensor-level entry points to the selected kernel variant.

Each function takes torch tensors (any CPU tensor that speaks DLPack works)
and calls the variant chosen at import. Validation happens in the compiled
binding, so bad shapes, dtypes or strides raise TypeError/ValueError/IndexError
naming the argument instead of crashing.
"""

from __future__ import annotations

import torch

from . import _C


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """x * rsqrt(mean(x^2, -1) + eps) * weight, computed in float32."""
    if out is None:
        out = torch.empty_like(x)
    _C.rms_norm(out, x, weight, eps)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual += x, then x = rms_norm(residual)."""
    _C.fused_add_rms_norm(x, residual, weight, eps)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None, head_size: int,
                     cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    """Rotate query (and key) in place by their positions (vLLM's signature)."""
    _C.rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)


def _act(fn, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        out = torch.empty(x.shape[:-1] + (x.shape[-1] // 2,), dtype=x.dtype)
    fn(out, x)
    return out


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:]."""
    return _act(_C.silu_and_mul, x, out)


def gelu_and_mul(x: torch.Tensor, approximate: str = "none", out: torch.Tensor | None = None) -> torch.Tensor:
    """gelu(x[..., :d]) * x[..., d:], with approximate 'none' (erf) or 'tanh'."""
    if approximate == "none":
        return _act(_C.gelu_and_mul, x, out)
    if approximate == "tanh":
        return _act(_C.gelu_tanh_and_mul, x, out)
    raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
