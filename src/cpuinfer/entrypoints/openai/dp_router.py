"""Which data-parallel engine core gets a request.

The rule: among the live cores whose load (unfinished sequences, the n samples of every running or waiting
request) is within `slack` of the least loaded one, take the core that already saw the longest run of the
prompt's leading full KV blocks; ties go to the less loaded core, then the lower rank. With no shared prefix
this is plain least-loaded routing. The slack, max(2, 25% of the least load), lets a request follow its prefix
to a core a little busier than the idlest one (a prefix hit saves its whole prefill there) but never piles a
popular prefix onto one core while others idle.

"Saw" is remembered per core as the hash chains of full prompt blocks (block i's hash covers blocks 0..i,
as the engine's prefix cache keys them), the most recent `capacity` blocks per core (the core's KV pool
cannot hold more): an estimate of the core's prefix cache, which may have evicted since.
"""

from __future__ import annotations

from collections import OrderedDict

SLACK_MIN_SEQS = 2
SLACK_FRACTION = 0.25


class NoLiveCoreError(RuntimeError):
    """Every engine core is dead."""


class PrefixAwareRouter:
    """Least-loaded routing with prefix affinity (see the module docstring)."""

    def __init__(self, num_cores: int, block_size: int, capacity: int):
        self.block_size = block_size
        self.capacity = max(1, capacity)
        self.seen: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_cores)]

    def block_hashes(self, token_ids: list[int]) -> list[int]:
        """Hash chain of the prompt's full blocks."""
        out, h, bs = [], 0, self.block_size
        for start in range(0, len(token_ids) - bs + 1, bs):
            h = hash((h, tuple(token_ids[start : start + bs])))
            out.append(h)
        return out

    def matched(self, rank: int, hashes: list[int]) -> int:
        """Leading blocks of the prompt that core `rank` saw."""
        seen = self.seen[rank]
        n = 0
        for h in hashes:
            if h not in seen:
                break
            n += 1
        return n

    def choose(self, token_ids: list[int], loads: list[int | None]) -> int:
        """The rank for a prompt, given each core's load (None: dead); remembers the prompt's blocks there."""
        alive = [r for r, load in enumerate(loads) if load is not None]
        if not alive:
            raise NoLiveCoreError("every data-parallel engine core is dead")
        least = min(loads[r] for r in alive)
        limit = least + max(SLACK_MIN_SEQS, int(least * SLACK_FRACTION))
        hashes = self.block_hashes(token_ids)
        candidates = [r for r in alive if loads[r] <= limit]
        rank = min(candidates, key=lambda r: (-self.matched(r, hashes), loads[r], r))
        self.remember(rank, hashes)
        return rank

    def remember(self, rank: int, hashes: list[int]) -> None:
        """Record that core `rank` now holds these blocks (most recent last; the oldest beyond capacity go)."""
        seen = self.seen[rank]
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity:
            seen.popitem(last=False)
