"""Paged attention in plain torch: the reference semantics of ops.reshape_and_cache / ops.paged_attention.

Used when the selected kernel module has no paged-attention kernels (or rejects a variant); also the
independent reference the kernel tests can compare against.
"""

from __future__ import annotations

import torch

from .metadata import AttentionMetadata


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [T, kv_heads, head_size] into the caches at slot_mapping (slots < 0 are skipped)."""
    block_size = key_cache.shape[2]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - blocks * block_size
    key_cache[blocks, :, offsets] = key.to(key_cache.dtype)
    value_cache[blocks, :, offsets] = value.to(value_cache.dtype)


def _mask(meta: AttentionMetadata, s: int, window: int) -> torch.Tensor | None:
    """Additive f32 mask [qlen, ctx] for sequence s (None when nothing is masked), cached per step."""
    key = ("mask", s, window)
    cache = meta._torch_cache
    if key in cache:
        return cache[key]
    qlen, ctx = meta.query_lens[s], meta.context_lens[s]
    pos = torch.arange(ctx - qlen, ctx).unsqueeze(1)
    kpos = torch.arange(ctx).unsqueeze(0)
    visible = kpos <= pos
    if window > 0:
        visible &= (pos - kpos) < window
    mask = None
    if not bool(visible.all()):
        mask = torch.zeros(qlen, ctx).masked_fill_(~visible, float("-inf"))
    cache[key] = mask
    return mask


def _blocks(meta: AttentionMetadata, s: int) -> torch.Tensor:
    key = ("blocks", s)
    cache = meta._torch_cache
    if key not in cache:
        nblocks = -(-meta.context_lens[s] // meta.block_size)
        cache[key] = meta.block_tables[s, :nblocks].long()
    return cache[key]


def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> None:
    """out[T, q_heads, hs] = causal attention of query over the cached keys/values, computed in float32.

    sinks: a logit per query head that joins each row's softmax sum and contributes no value (gpt-oss)."""
    num_kv_heads, _block_size, head_size = key_cache.shape[1:]
    q_heads = query.shape[1]
    group = q_heads // num_kv_heads
    start = 0
    for s in range(meta.num_seqs):
        qlen, ctx = meta.query_lens[s], meta.context_lens[s]
        blocks = _blocks(meta, s)
        # [nb, kvh, bs, hs] -> [kvh, ctx, hs]
        k = key_cache[blocks].transpose(0, 1).reshape(num_kv_heads, -1, head_size)[:, :ctx].float()
        v = value_cache[blocks].transpose(0, 1).reshape(num_kv_heads, -1, head_size)[:, :ctx].float()
        q = query[start : start + qlen].float().view(qlen, num_kv_heads, group, head_size).permute(1, 2, 0, 3)
        q = q.reshape(num_kv_heads, group * qlen, head_size)
        scores = torch.bmm(q, k.transpose(1, 2)).mul_(scale)  # [kvh, group*qlen, ctx]
        if soft_cap > 0.0:
            scores = torch.tanh(scores.div_(soft_cap)).mul_(soft_cap)
        mask = _mask(meta, s, sliding_window)
        if mask is not None:
            scores = scores.view(num_kv_heads, group, qlen, ctx).add_(mask).view(num_kv_heads, group * qlen, ctx)
        if sinks is not None:  # one more column per row, dropped after the softmax
            sink = sinks.float().view(num_kv_heads, group, 1, 1).expand(num_kv_heads, group, qlen, 1)
            scores = torch.cat([scores, sink.reshape(num_kv_heads, group * qlen, 1)], dim=-1)
            probs = torch.softmax(scores, dim=-1)[..., :ctx]
        else:
            probs = torch.softmax(scores, dim=-1)
        o = torch.bmm(probs, v).view(num_kv_heads, group, qlen, head_size).permute(2, 0, 1, 3)
        out[start : start + qlen] = o.reshape(qlen, q_heads, head_size).to(out.dtype)
        start += qlen
