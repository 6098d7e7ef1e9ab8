"""The one place the HTTP front end touches the engine.

The serving layer sees an :class:`EngineAdapter`: it streams per-choice
:class:`ChoiceDelta` objects for a request, aborts requests, reports stats and
health. The adapter turns that into calls on the engine's asyncio client
(which runs the engine core in its own process) and turns the engine's
outputs into deltas.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from cpuinfer.engine.messages import EngineStats
from cpuinfer.errors import EngineDeadError  # noqa: F401 - re-exported: what the streams raise
from cpuinfer.sampling_params import SamplingParams


@dataclass
class TokenLogprob:
    """Logprob of one generated token and the best alternatives (best first)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None  # of token_id in the distribution (1 = most likely)


@dataclass
class ChoiceDelta:
    """What one choice of a request produced since its last delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # With the first delta of a request that asked for prompt logprobs: one per prompt token (None first).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # A pooling request's vector (torch float32), with its final delta.
    pooled: Any = None
    # A request with a prediction: its (accepted, rejected) prediction tokens so far, all its choices.
    prediction_tokens: tuple[int, int] | None = None


@dataclass
class CoreState:
    """One engine core as /metrics shows it (several with data parallelism)."""

    dp_rank: int
    alive: bool
    requests_routed: int  # requests sent to it since start
    num_running: int = 0
    num_waiting: int = 0


class EngineAdapter:
    """The interface the serving layer uses (implemented by the real engine binding)."""

    model_path: str
    max_model_len: int
    tokenization: Any  # cpuinfer.entrypoints.openai.tokenization.Tokenization
    limits: Any  # cpuinfer.engine.limits.RequestLimits: what one request may ask
    generation_defaults: dict
    runner: str = "generate"  # or "pooling": what the model serves (/v1/models says it)

    @property
    def healthy(self) -> bool:
        """True while the engine serves requests."""
        raise NotImplementedError

    @property
    def dead(self) -> bool:
        """True once the engine has failed for good (not merely shutting down)."""
        raise NotImplementedError

    def status_text(self) -> str:
        """Why the engine is not healthy (or 'ready')."""
        raise NotImplementedError

    def degraded(self) -> str | None:
        """While the engine serves with part of itself gone (a data-parallel core died): what is gone."""
        return None

    def core_states(self) -> list[CoreState]:
        """Each engine core's state as of the last stats() (empty: not broken down)."""
        return []

    def submit(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[list[ChoiceDelta]]:
        """Start one request (all n choices) now and return its deltas; leaving the iterator early aborts it.

        Raises at once, before anything is sent to the client: InvalidRequestError (a limit),
        EngineOverloadedError (the queue is full), EngineDeadError. The iterator raises
        RequestFailedError or EngineDeadError if the request fails later.
        """
        raise NotImplementedError

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Check a prompt as submit() would, without starting it (InvalidRequestError); for prompts of a request
        that start later, as earlier ones finish."""

    def compile_constraint(self, constraint: Any) -> None:
        """Compile a structured-output constraint into the engine's cache (InvalidRequestError if it does not
        compile); called on a worker thread, so the later check at submit() is a lookup, not work on the loop."""

    def abort(self, request_id: str) -> None:
        """Abort a request without waiting (safe to call from cancellation paths)."""
        raise NotImplementedError

    async def stats(self) -> EngineStats:
        """A fresh snapshot of the engine's state."""
        raise NotImplementedError

    async def shutdown(self) -> None:
        """Abort what is left and stop the engine process."""
        raise NotImplementedError
