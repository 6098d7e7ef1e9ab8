"""The host-memory prefix tier (vLLM's --kv-offloading-size, llama.cpp's --cache-ram): full prefix blocks that the
KV pool evicts are copied into a bounded RAM pool instead of being lost, and copied back when a later prompt
starts with them, so only the rest of that prompt is computed.

The tier has the KV cache's own layout: per layer, a K and a V buffer of `capacity` slots, each slot one block's
[kv_heads, block_size, head_size] elements, moved as raw bytes, so a restored block is bit for bit the block that
was computed (bf16, f32 and fp8-e5m2 caches alike). Opt-in (--kv-offloading-dtype fp8_e5m2), a bf16/f16/f32
cache's blocks are kept as fp8-e5m2 instead, half a bf16 block's bytes: a restored block then holds what an
fp8 cache would have held (the accuracy cost is measured in tests/engine/test_host_tier.py).

Slots are keyed by the prefix cache's chained block hash and verified on (parent hash, token ids) as the prefix
cache is; least recently used slots are reused first.
The buffers are mapped once but untouched pages take no memory: what the pool holds grows with its entries.
Copies run in the engine core's process, between scheduling and the model step, which is the only time the
cache is not being written: a block is saved before its new owner's tokens overwrite it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from cpuinfer.platform.memory import zeros_huge


@dataclass
class _Entry:
    slot: int
    parent_hash: bytes | None
    token_ids: tuple[int, ...]


class HostTier:
    """A bounded LRU store of evicted KV blocks in RAM, keyed by block hash."""

    def __init__(
        self,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        capacity_blocks: int,
        dtype: torch.dtype | None = None,
    ):
        """kv_caches: the model runner's per-layer (K, V) caches, [num_blocks, kv_heads, block_size, head_size].
        dtype: what the tier keeps, if not the caches' own bytes (torch.float8_e5m2: lossy, half of bf16's)."""
        if capacity_blocks <= 0:
            raise ValueError(f"the host prefix tier needs room for at least one block, got {capacity_blocks}")
        caches = [c for kv in kv_caches for c in kv]
        self.dtype = caches[0].dtype if dtype is None else dtype
        if self.dtype == caches[0].dtype:  # raw bytes, so that a copy never converts (fp8 included)
            self._device = [c.view(torch.uint8) for c in caches]
        else:
            self._device = caches
        host_dtype = torch.uint8 if self._device[0].dtype == torch.uint8 else self.dtype
        # Huge pages faulted in as slots are first used (platform.memory), lowest slots first.
        self._host = [zeros_huge((capacity_blocks, *c.shape[1:]), host_dtype) for c in self._device]
        self.capacity_blocks = capacity_blocks
        self.block_bytes = sum(h[0].numel() * h.element_size() for h in self._host)
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._free_slots: list[int] = []
        self.clear()
        # Counters for stats.
        self.stored_blocks = 0
        self.restored_blocks = 0
        self.query_tokens = 0
        self.hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        """Blocks held now."""
        return len(self._entries)

    def match(self, h: bytes, parent: bytes | None, token_ids: tuple[int, ...]) -> bool:
        """Whether the tier holds this block (verified on its parent and tokens)."""
        e = self._entries.get(h)
        return e is not None and e.parent_hash == parent and e.token_ids == token_ids

    def store(self, blocks: list, keep: frozenset[bytes] = frozenset()) -> None:
        """Save registered blocks (block_pool.Block: id, hash, parent, tokens) that the KV pool is about to reuse.
        A block already held is only marked used; the least recently used entries make room, except those
        whose hashes are in `keep` (about to be restored); with no room left, a block is not saved."""
        src, dst = [], []
        for b in blocks:
            e = self._entries.get(b.hash)
            if e is not None:
                self._entries.move_to_end(b.hash)
                continue
            slot = self._take_slot(keep)
            if slot is None:
                continue
            self._entries[b.hash] = _Entry(slot, b.parent_hash, b.token_ids)
            if slot in dst:  # an entry saved earlier in this batch gave its slot up again
                i = dst.index(slot)
                del src[i], dst[i]
            src.append(b.block_id)
            dst.append(slot)
        if src:
            _copy(self._device, self._host, src, dst)
            self.stored_blocks += len(src)

    def _take_slot(self, keep: frozenset[bytes]) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        victim = next((h for h in self._entries if h not in keep), None)
        return None if victim is None else self._entries.pop(victim).slot

    def restore(self, hashes: list[bytes], block_ids: list[int]) -> None:
        """Copy the held blocks `hashes` (all matched) into the KV blocks `block_ids`; they stay held, as used."""
        slots = []
        for h in hashes:
            self._entries.move_to_end(h)
            slots.append(self._entries[h].slot)
        _copy(self._host, self._device, slots, block_ids)
        self.restored_blocks += len(slots)

    def clear(self) -> None:
        """Forget every held block (every slot free, the lowest taken first)."""
        self._entries.clear()
        self._free_slots = list(range(self.capacity_blocks - 1, -1, -1))


def _copy(srcs: list[torch.Tensor], dsts: list[torch.Tensor], rows: list[int], to: list[int]) -> None:
    """dst[to[i]] = src[rows[i]] for each pair of buffers (converted where their dtypes differ). Where the
    destinations fall in a few runs of consecutive rows (fresh slots and fresh blocks mostly do), each run is
    gathered straight into its place; otherwise the rows are gathered and then scattered (twice the bytes
    moved)."""
    convert = srcs[0].dtype != dsts[0].dtype
    pairs = sorted(zip(to, rows, strict=True))
    runs = []  # (first destination row, source rows)
    for t, r in pairs:
        if runs and runs[-1][0] + len(runs[-1][1]) == t:
            runs[-1][1].append(r)
        else:
            runs.append((t, [r]))
    if len(runs) * 4 <= len(pairs):
        idx = [(t, len(rs), torch.tensor(rs)) for t, rs in runs]
        for src, dst in zip(srcs, dsts, strict=True):
            for t, n, r in idx:
                if convert:
                    dst[t : t + n].copy_(src.index_select(0, r))
                else:
                    torch.index_select(src, 0, r, out=dst[t : t + n])
    else:
        r, t = torch.tensor(rows), torch.tensor(to)
        for src, dst in zip(srcs, dsts, strict=True):
            rows_ = src.index_select(0, r).to(dst.dtype)
            # As bytes: index_copy_ has no fp8 kernel.
            dst.view(torch.uint8).index_copy_(0, t, rows_.view(torch.uint8))
