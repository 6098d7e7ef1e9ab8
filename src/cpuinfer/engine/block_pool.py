"""The paged KV cache's block pool, with the prefix cache.

Physical blocks are numbered 0..num_blocks-1 and reference counted. A block
whose tokens are all in the cache ("full") can be registered in the prefix
cache under a chained hash of (parent block's hash, its token ids); a later
request with the same prefix finds it, checks that the parent hash and the
tokens really match, and shares it. Free blocks that still hold a cached
prefix stay findable until they are reused, least recently freed first;
blocks that hold nothing reusable are handed out before any cached one.

With a host tier (engine.host_tier, --kv-offloading-size), a cached block that is reused is first saved to RAM,
and a lookup goes on past the KV cache's hits into the tier: the blocks found there are copied into fresh
blocks, registered again, and shared as if they had never left.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass


def block_hash(parent: bytes | None, token_ids: list[int] | tuple[int, ...]) -> bytes:
    """Chained 128-bit hash of one full block (blake2b: collisions are not a practical concern)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass(eq=False)
class Block:
    """One physical KV block."""

    block_id: int
    ref_cnt: int = 0
    hash: bytes | None = None  # set while registered in the prefix cache
    parent_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()  # kept to verify a hit
    restored: bool = False  # copied back from the host tier and not yet counted as its hit


class NoFreeBlocks(Exception):
    """Raised internally when an allocation cannot be satisfied."""


class BlockPool:
    """Allocates KV blocks, shares full blocks by prefix, evicts cached free blocks LRU-first."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, host_tier=None):
        """host_tier: an engine.host_tier.HostTier over this pool's KV cache, or None."""
        if host_tier is not None and not enable_caching:
            raise ValueError("the host prefix tier (--kv-offloading-size) needs prefix caching")
        self.host_tier = host_tier
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks that hold no cached prefix: reused first (popped from the end, lowest ids first).
        self._free_plain: list[int] = list(range(num_blocks - 1, -1, -1))
        # Free blocks still registered in the cache, oldest-freed first (= LRU eviction order).
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._cache: dict[bytes, Block] = {}
        # Counters for stats.
        self.query_tokens = 0
        self.hit_tokens = 0

    # ---- capacity -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (including evictable cached ones)."""
        return len(self._free_plain) + len(self._free_cached)

    def usage(self) -> float:
        """Fraction of blocks held by requests."""
        return 1.0 - self.num_free / self.num_blocks if self.num_blocks else 0.0

    def hit_rate(self) -> float:
        """Prefix-cache hits over looked-up prompt tokens since start."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    # ---- allocation -----------------------------------------------------------------------------
    def allocate(self, n: int, keep: frozenset[bytes] = frozenset()) -> list[int]:
        """n fresh blocks with ref_cnt 1; raises NoFreeBlocks (allocating nothing) if too few are free. Cached
        blocks reused go to the host tier, if any (which keeps its entries `keep`)."""
        if n > self.num_free:
            raise NoFreeBlocks
        out = []
        evicted = []
        for _ in range(n):
            if self._free_plain:
                bid = self._free_plain.pop()
            else:
                bid, _ = self._free_cached.popitem(last=False)
                evicted.append(self.blocks[bid])
            self.blocks[bid].ref_cnt = 1
            out.append(bid)
        if evicted and self.host_tier is not None:
            self.host_tier.store(evicted, keep)
        for b in evicted:
            self._uncache(b)
        return out

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; pass them tail-first so a sequence's tail is evicted first."""
        for bid in block_ids:
            b = self.blocks[bid]
            b.ref_cnt -= 1
            assert b.ref_cnt >= 0, f"block {bid} freed twice"
            if b.ref_cnt == 0:
                if b.hash is not None:
                    self._free_cached[bid] = None
                else:
                    self._free_plain.append(bid)

    # ---- prefix cache ---------------------------------------------------------------------------
    def lookup(self, hashes: list[bytes], token_ids: list[int]) -> list[int]:
        """Take a reference on the longest cached run of full blocks matching `hashes` (verified on tokens)."""
        bs = self.block_size
        found: list[int] = []
        parent: bytes | None = None
        for i, h in enumerate(hashes):
            b = self._cache.get(h)
            if b is None or b.parent_hash != parent or b.token_ids != tuple(token_ids[i * bs : (i + 1) * bs]):
                break
            found.append(b.block_id)
            parent = h
        for bid in found:
            b = self.blocks[bid]
            if b.ref_cnt == 0:
                self._free_cached.pop(bid)
            b.ref_cnt += 1
        if self.host_tier is not None:
            found += self._restore(hashes[len(found) :], token_ids, len(found), parent)
        return found

    def _restore(self, hashes: list[bytes], token_ids: list[int], first: int, parent: bytes | None) -> list[int]:
        """The host tier's run of blocks `first`, `first` + 1, ... (hashes[0] onward), as many as fit the free
        blocks, copied into fresh blocks and registered in the prefix cache."""
        bs, tier = self.block_size, self.host_tier
        run = []
        for i, h in enumerate(hashes[: self.num_free]):
            tokens = tuple(token_ids[(first + i) * bs : (first + i + 1) * bs])
            if not tier.match(h, parent, tokens):
                break
            run.append((h, parent, tokens))
            parent = h
        if not run:
            return []
        keep = frozenset(h for h, _, _ in run)
        bids = self.allocate(len(run), keep)
        tier.restore([h for h, _, _ in run], bids)
        for bid, (h, p, tokens) in zip(bids, run, strict=True):
            self.cache_block(bid, h, p, list(tokens))
            self.blocks[bid].restored = True
        return bids

    def record_lookup(self, query_tokens: int, hit_blocks: list[int], count: bool = True) -> None:
        """A request admitted with the blocks `hit_blocks` that lookup gave it: counted (unless not `count`) for
        the hit rates, as the KV cache's hits and the host tier's (whose queries are the tokens the KV cache
        did not hold)."""
        restored = 0
        for bid in hit_blocks:
            restored += self.blocks[bid].restored
            self.blocks[bid].restored = False
        if not count:
            return
        local = (len(hit_blocks) - restored) * self.block_size
        self.query_tokens += query_tokens
        self.hit_tokens += local
        if self.host_tier is not None:
            self.host_tier.query_tokens += query_tokens - local
            self.host_tier.hit_tokens += restored * self.block_size

    def cache_block(self, bid: int, h: bytes, parent: bytes | None, token_ids: list[int]) -> None:
        """Register a now-full block under its hash (no-op if that hash is already cached)."""
        b = self.blocks[bid]
        if b.hash is not None or h in self._cache:
            return
        b.hash, b.parent_hash, b.token_ids = h, parent, tuple(token_ids)
        self._cache[h] = b

    def _uncache(self, b: Block) -> None:
        if b.hash is not None and self._cache.get(b.hash) is b:
            del self._cache[b.hash]
        b.hash, b.parent_hash, b.token_ids, b.restored = None, None, (), False

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their data)."""
        for b in list(self._cache.values()):
            self._uncache(b)
        self._free_plain.extend(self._free_cached)
        self._free_cached.clear()
        if self.host_tier is not None:
            self.host_tier.clear()
