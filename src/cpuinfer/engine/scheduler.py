"""Continuous batching: which tokens of which requests run in the next model step.

Each step fills a token budget (`max_num_batched_tokens`) in this order:
1. one decode token for every running request that is generating,
2. the next prefill chunk of running requests whose prompt is not fully in the cache,
3. the first chunk of waiting requests (up to `max_num_seqs` running), after a prefix-cache lookup.
So a decode is never stalled behind a long prefill. When the block pool runs
dry, the newest running request is preempted: its blocks are freed and it
goes back to the head of the queue to be recomputed later (its full blocks
usually survive in the prefix cache). The oldest request is never preempted
for a newer one, so every request finishes.
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from cpuinfer.engine.block_pool import BlockPool
from cpuinfer.engine.request import Request, Status
from cpuinfer.engine.step import ScheduledSeq


@dataclass
class SchedulerConfig:
    """Limits of one step."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    long_prefill_token_threshold: int = 0  # 0 = no per-request cap on a prefill chunk
    whole_prompts: bool = False  # an encoder's: a prompt runs in one step or waits (no chunks, no KV cache)


class Scheduled(NamedTuple):
    """One scheduled sequence: its request, and its share of the step as the model runner sees it."""

    request: Request
    seq: ScheduledSeq


@dataclass
class SchedulerOutput:
    """One step: a record per scheduled sequence, in the order of the runner's rows."""

    scheduled: list[Scheduled] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.scheduled)

    @property
    def seqs(self) -> list[ScheduledSeq]:
        """What the model runner executes."""
        return [s.seq for s in self.scheduled]

    @property
    def sampled(self) -> list[Request]:
        """The requests that sample this step (their chunk ends at their newest token), in row order."""
        return [s.request for s in self.scheduled if s.seq.sample]

    def without(self, drop: set[int]) -> SchedulerOutput:
        """The step minus the requests whose id() is in `drop` (they failed; the rest go on)."""
        return SchedulerOutput([s for s in self.scheduled if id(s.request) not in drop])


class Scheduler:
    """Owns the waiting and running queues and the block pool."""

    def __init__(self, config: SchedulerConfig, pool: BlockPool):
        self.config = config
        self.pool = pool
        self.block_size = pool.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ---- queue management ---------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a new request."""
        req.update_hashes(self.block_size)
        self.waiting.append(req)

    def abort(self, req: Request) -> None:
        """Drop a request wherever it is and free its blocks."""
        if req.status == Status.FINISHED:
            return
        if req in self.running:
            self.running.remove(req)
        else:
            with contextlib.suppress(ValueError):  # not queued either: it already finished
                self.waiting.remove(req)
        self._finish(req, "abort")

    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""
        return bool(self.waiting or self.running)

    # ---- scheduling ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick the next step's work (may preempt)."""
        cfg = self.config
        out = SchedulerOutput()
        budget = cfg.max_num_batched_tokens
        chosen: dict[int, int] = {}  # id(req) -> tokens this step
        preempted_now = False

        decoding = [r for r in self.running if r.num_pending == 1]
        prefilling = [r for r in self.running if r.num_pending > 1]
        for req in decoding + prefilling:
            if budget <= 0:
                break
            if req.status != Status.RUNNING:  # preempted earlier in this loop
                continue
            n = self._chunk(req, budget)
            if n == 0:  # a whole prompt that does not fit this step's budget
                continue
            if req.spec_token_ids:  # a decoding request's proposals join its pending token, as budget allows
                req.spec_token_ids = req.spec_token_ids[: min(budget, 1 + len(req.spec_token_ids)) - 1]
                n = 1 + len(req.spec_token_ids)
            while not self._grow(req, n):
                victim = max(self.running, key=lambda r: r.arrival)
                budget += chosen.pop(id(victim), 0)
                self._preempt(victim)
                preempted_now = True
                if victim is req:
                    break
            if req.status == Status.RUNNING:
                chosen[id(req)] = n
                budget -= n

        # New requests only when nothing had to be preempted (the pool is tight otherwise).
        while not preempted_now and self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[0]
            hit_blocks: list[int] = []
            fresh = not req.block_ids and req.num_computed_tokens == 0
            # A request for prompt logprobs computes its whole prompt (as vLLM): cached blocks have no logits.
            if fresh and self.pool.enable_caching and req.params.prompt_logprobs is None:
                # At least the last token is computed, so its logits exist.
                n_lookup = (req.num_tokens - 1) // self.block_size
                hit_blocks = self.pool.lookup(req.block_hashes[:n_lookup], req.all_token_ids)
                req.block_ids = list(hit_blocks)
                req.num_computed_tokens = len(hit_blocks) * self.block_size
                req.num_cached_blocks = len(hit_blocks)
            n = self._chunk(req, budget)
            if n == 0 or not self._grow(req, n):
                if hit_blocks:  # give the shared prefix back; retry next step
                    self.pool.free(hit_blocks[::-1])
                    req.block_ids, req.num_computed_tokens, req.num_cached_blocks = [], 0, 0
                break
            if fresh:
                self.pool.record_lookup(req.num_tokens, hit_blocks, count=req.num_preemptions == 0)
            if fresh and req.num_preemptions == 0:
                req.num_prefix_hit_tokens = len(hit_blocks) * self.block_size
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            chosen[id(req)] = n
            budget -= n

        for req in self.running:
            n = chosen.get(id(req))
            if n is None:
                req.spec_token_ids = []
                continue
            start = req.num_computed_tokens
            spec = req.spec_token_ids
            sample = start + n - len(spec) == req.num_tokens
            ids = req.all_token_ids[start : start + n - len(spec)] + spec
            all_rows = req.prompt_logprobs is not None or req.pool_all_rows
            prompt_logits = all_rows and start < len(req.prompt_token_ids)
            seq = ScheduledSeq(ids, start, req.block_ids, sample, len(spec), prompt_logits)
            pooling = req.params.pooling
            if pooling is not None and pooling.token_type_ids is not None:
                seq.token_type_ids = pooling.token_type_ids[start : start + n]
            out.scheduled.append(Scheduled(req, seq))
        return out

    def _chunk(self, req: Request, budget: int) -> int:
        if self.config.whole_prompts:
            return req.num_pending if req.num_pending <= budget else 0
        n = min(req.num_pending, budget)
        t = self.config.long_prefill_token_threshold
        if t > 0 and n > 1:
            n = min(n, t)
        return n

    def _grow(self, req: Request, n: int) -> bool:
        """Make req's blocks cover n more tokens; False (nothing allocated) if the pool is short."""
        need = -(-(req.num_computed_tokens + n) // self.block_size) - len(req.block_ids)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        req.block_ids.extend(self.pool.allocate(need))
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        req.spec_token_ids = []
        self.pool.free(req.block_ids[::-1])
        req.block_ids = []
        req.num_computed_tokens = 0
        req.num_cached_blocks = 0
        req.num_preemptions += 1
        req.status = Status.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- after the model step -----------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled_tokens: list[list[int]]) -> list[Request]:
        """Advance the scheduled requests by their computed tokens and new ids (per sampling request, in order:
        its accepted proposals and one more token); returns those that finished. A request's rejected
        proposals are dropped: their KV slots lie past its computed tokens (to be overwritten), and the
        blocks that held only them go back to the pool. Where a request stops part-way through its new
        tokens, the rest are cut off the list, in place."""
        bs = self.block_size
        caching = self.pool.enable_caching
        tokens = iter(sampled_tokens)
        finished = []
        for req, seq in out.scheduled:
            n = seq.num_tokens
            pooled = req.params.pooling is not None  # its prompt's last chunk ends it: nothing is generated
            decodes = seq.sample and not pooled
            new = next(tokens) if decodes else []
            num_spec = len(req.spec_token_ids)
            req.spec_token_ids = []
            stopped = False
            for i, t in enumerate(new):
                req.append_token(t)
                if req.check_stop(self.config.max_model_len):
                    del new[i + 1 :]
                    stopped = True
                    break
            # A sampling request has every token but its newest in the cache (its accepted proposals included;
            # those after a stop no longer count); a prefill chunk (or a pooled prompt's last) adds its tokens.
            req.num_computed_tokens = req.num_tokens - 1 if decodes else req.num_computed_tokens + n
            if num_spec:
                keep = -(-req.num_computed_tokens // bs)
                if len(req.block_ids) > keep:  # blocks allocated for the rejected proposals only
                    self.pool.free(req.block_ids[keep:][::-1])
                    del req.block_ids[keep:]
            if len(req.all_token_ids) // bs > len(req.block_hashes):
                req.update_hashes(bs)
            if caching:
                full = req.num_computed_tokens // bs
                while req.num_cached_blocks < full:
                    i = req.num_cached_blocks
                    parent = req.block_hashes[i - 1] if i else None
                    self.pool.cache_block(
                        req.block_ids[i], req.block_hashes[i], parent, req.all_token_ids[i * bs : (i + 1) * bs]
                    )
                    req.num_cached_blocks += 1
            if seq.sample and pooled:
                req.finish_reason, stopped = "stop", True
            if stopped:
                self.running.remove(req)
                self._finish(req, req.finish_reason)
                finished.append(req)
        return finished

    def _finish(self, req: Request, reason: str | None) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.pool.free(req.block_ids[::-1])
        req.block_ids = []
