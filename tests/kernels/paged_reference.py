"""Plain-torch reference for paged attention and helpers that build paged batches.

The reference gathers each sequence's blocks into a dense [ctx, kv_heads, D]
tensor, dequantizes to float32 and runs masked softmax attention in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

CACHE_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e5m2]


def cache_view(cache: torch.Tensor) -> torch.Tensor:
    """What the raw extension takes for a cache: fp8 crosses DLPack as its bytes."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e5m2 else cache


@dataclass
class PagedBatch:
    """A randomized batch over a paged KV cache with shuffled block tables."""

    query: torch.Tensor  # [T, Hq, D]
    key_cache: torch.Tensor  # [N, Hkv, bs, D]
    value_cache: torch.Tensor
    query_start_loc: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [S, max_blocks] int32
    scale: float

    def args(self):
        """Positional arguments after `out` for the raw kernel."""
        return (
            self.query,
            cache_view(self.key_cache),
            cache_view(self.value_cache),
            self.query_start_loc,
            self.seq_lens,
            self.block_tables,
            self.scale,
        )


def make_batch(
    seqs: list[tuple[int, int]],
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    spare_blocks: int = 3,
) -> PagedBatch:
    """seqs = [(q_len, seq_len)]; blocks of all sequences are scattered over the cache in random order."""
    need = [math.ceil(ctx / block_size) for _, ctx in seqs]
    max_blocks = max(need) + 1
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks).to(torch.int32)
    tables = torch.full((len(seqs), max_blocks), -1, dtype=torch.int32)
    used = 0
    for s, n in enumerate(need):
        tables[s, :n] = perm[used : used + n]
        used += n
    shape = (num_blocks, num_kv_heads, block_size, head_size)
    key_cache = torch.randn(shape).to(cache_dtype)
    value_cache = torch.randn(shape).to(cache_dtype)
    q_lens = [q for q, _ in seqs]
    qsl = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    query = torch.randn(sum(q_lens), num_q_heads, head_size).to(dtype)
    lens = torch.tensor([c for _, c in seqs], dtype=torch.int32)
    return PagedBatch(query, key_cache, value_cache, qsl, lens, tables, head_size**-0.5)


def gather(cache: torch.Tensor, table: torch.Tensor, ctx: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense [ctx, kv_heads, D] view of one sequence's cache blocks, in dtype (float32 by default)."""
    bs = cache.shape[2]
    n = math.ceil(ctx / bs)
    blocks = cache[table[:n].long()].to(dtype)  # [n, Hkv, bs, D]
    return blocks.permute(0, 2, 1, 3).reshape(n * bs, cache.shape[1], cache.shape[3])[:ctx]


def ref_paged_attention(
    b: PagedBatch,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
    dtype: torch.dtype = torch.float32,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Output [T, Hq, D] of causal GQA attention with optional window, soft-cap and attention sinks (a logit
    per query head as an extra softmax column with no value, as transformers' gpt-oss), computed in dtype
    (float32 by default; float64 for an exact reference)."""
    T, Hq, D = b.query.shape
    Hkv = b.key_cache.shape[1]
    out = torch.zeros(T, Hq, D, dtype=dtype)
    for s in range(b.seq_lens.numel()):
        q0, q1 = int(b.query_start_loc[s]), int(b.query_start_loc[s + 1])
        L, ctx = q1 - q0, int(b.seq_lens[s])
        if L == 0:
            continue
        k = gather(b.key_cache, b.block_tables[s], ctx, dtype).repeat_interleave(Hq // Hkv, dim=1)  # [ctx, Hq, D]
        v = gather(b.value_cache, b.block_tables[s], ctx, dtype).repeat_interleave(Hq // Hkv, dim=1)
        q = b.query[q0:q1].to(dtype)
        logits = torch.einsum("lhd,khd->hlk", q, k) * b.scale
        if soft_cap > 0:
            logits = soft_cap * torch.tanh(logits / soft_cap)
        qpos = torch.arange(ctx - L, ctx)[:, None]
        kpos = torch.arange(ctx)[None, :]
        visible = kpos <= qpos
        if sliding_window > 0:
            visible &= qpos - kpos < sliding_window
        logits = logits.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            column = sinks.to(dtype)[:, None, None].expand(Hq, L, 1)
            probs = torch.softmax(torch.cat([logits, column], dim=-1), dim=-1)[..., :ctx]
        else:
            probs = torch.softmax(logits, dim=-1)
        out[q0:q1] = torch.einsum("hlk,khd->lhd", probs, v)
    return out
