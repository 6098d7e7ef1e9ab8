"""Pipeline parallelism: consecutive layers on consecutive stages, micro-batches flowing through them.

Rank r of a tensor-parallel x pipeline-parallel engine core is stage r // tp, tensor-parallel rank r % tp.
Stage s holds layers `stage_layers(L, pp, s)` (vLLM's split: L // pp each, the remainder one layer each to
the stages just before the last, which also carries the final norm and lm_head), their KV caches, the
embedding on the first stage and the head on the last (a tied table on both).

Between stages, rank (s, t) hands its micro-batch's hidden states (and the residual stream of pre-norm
models) to rank (s + 1, t) through a two-rank shared-memory communicator used as a send/recv
(`broadcast_` from the sender; the receiver knows the shape from the step it was sent). A send waits for
the receiver to arrive, so each stage runs micro-batch i + 1 while the next stage runs micro-batch i. The
last stage keeps its micro-batches' logits and its tensor-parallel rank 0 sends them, once per step, to
rank 0 (which samples): a send of logits between micro-batches would wait on rank 0 while rank 0 waits to
hand its next micro-batch on, a cycle.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

# A stage may wait for its predecessor's whole micro-batch (a long prefill on a slow CPU): a dead peer is
# still noticed within milliseconds (its pid), this bounds only a live peer that never arrives.
P2P_TIMEOUT_S = 600.0
# A decode step is memory-bound: each micro-batch streams the stage's weights again, so splitting 16 decodes
# into 2 micro-batches made a 2-stage SmolLM2 step 1.21x slower on 2 AVX2 cores, while 2 x 128 prefill tokens
# ran in 0.77x the time (benchmarks/bench_pipeline.py; 0.75 is perfect overlap). Micro-batches of fewer
# tokens than this are not split off.
MIN_MICRO_TOKENS = 64


def stage_layers(num_layers: int, pp: int, stage: int) -> tuple[int, int]:
    """[start, end) of the layers stage `stage` of `pp` holds (vllm.distributed.utils.get_pp_indices)."""
    sizes = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        sizes[-i] += 1
    start = sum(sizes[:stage])
    return start, start + sizes[stage]


def micro_batches(lens: list[int], most: int, min_tokens: int = MIN_MICRO_TOKENS) -> list[tuple[int, int]]:
    """[lo, hi) of each micro-batch of a step whose sequences compute lens[i] tokens: up to `most` runs of
    consecutive sequences with near-equal token counts, each of at least min_tokens (every rank computes the
    same split from the same step)."""
    n, total = len(lens), sum(lens)
    k = max(1, min(n, most, total // max(1, min_tokens)))
    bounds, acc, m = [0], 0, 0
    for j in range(1, k):
        while m < n and (acc + lens[m] / 2) < total * j / k:  # a sequence goes where most of its tokens fall
            acc += lens[m]
            m += 1
        m = min(max(m, bounds[-1] + 1), n - (k - j))
        acc = sum(lens[:m])
        bounds.append(m)
    bounds.append(n)
    return list(itertools.pairwise(bounds))


@dataclass(frozen=True)
class PPStage:
    """This rank's pipeline stage: which layers it holds, and its links to the neighbouring stages."""

    stage: int = 0
    size: int = 1
    start: int = 0  # first layer held
    end: int | None = None  # one past the last (None: every layer, no pipeline)
    prev: Any = None  # ShmCommunicator with rank (stage - 1, t): this rank is its rank 1
    next: Any = None  # ShmCommunicator with rank (stage + 1, t): this rank is its rank 0
    logits: Any = None  # last stage's tp rank 0 (rank 0 of it) -> global rank 0 (rank 1 of it)
    micro: int = 1  # most micro-batches per step (every rank has the same)
    min_tokens: int = MIN_MICRO_TOKENS  # fewest tokens of a micro-batch split off

    @property
    def first(self) -> bool:
        """Holds the embedding (and takes token ids)."""
        return self.stage == 0

    @property
    def last(self) -> bool:
        """Holds the final norm and the head (and produces logits)."""
        return self.stage == self.size - 1

    def holds(self, layer: int) -> bool:
        """Whether this stage holds layer `layer` (a global index)."""
        return self.start <= layer and (self.end is None or layer < self.end)

    def send(self, tensors: tuple[torch.Tensor, ...]) -> None:
        """Hand a micro-batch's activations to the next stage (waits until it takes them)."""
        for t in tensors:
            self.next.broadcast_(t.contiguous(), 0)

    def recv(self, count: int, rows: int, width: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """The previous stage's `count` activations of [rows, width] for this micro-batch."""
        out = tuple(torch.empty(rows, width, dtype=dtype) for _ in range(count))
        for t in out:
            self.prev.broadcast_(t, 0)
        return out

    def comms(self) -> list:
        """Every communicator this stage opened (to close them)."""
        return [c for c in (self.prev, self.next, self.logits) if c is not None]


SINGLE_STAGE = PPStage()
