"""What the engine holds for structured outputs: compile at admission (cached), a state per sequence, and each
step's batch mask, filled in one backend call and applied to the logits before sampling.

The fill can start before the model's forward pass (`start_masks`): the grammar states are final once the previous
step's tokens are accepted, and the backends fill on their own threads with the GIL released, so the mask is
usually ready when the logits are.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from cpuinfer.errors import InvalidRequestError
from cpuinfer.sampling_params import StructuredOutputsParams
from cpuinfer.structured.backend import GrammarBackend, GrammarState, make_backend
from cpuinfer.structured.bitmask import allocate_bitmask, apply_bitmask_


@dataclass
class MaskJob:
    """A batch's bitmask being filled in the background, for exactly these states (rows)."""

    states: list[GrammarState | None]
    rows: list[int]
    bitmask: torch.Tensor
    done: Future


class StructuredOutputManager:
    """Grammar compilation and masking for one model; the backend is built on first use (imported lazily)."""

    def __init__(
        self, backend_name: str, tokenizer: Any, vocab_size: int, eos_token_ids: list[int], overlap: bool = True
    ):
        self.backend_name = backend_name
        self.overlap = overlap  # fill masks during the forward pass (start_masks); False: only in mask()
        self._pool: ThreadPoolExecutor | None = None
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._backend: GrammarBackend | None = None
        self._bitmask = allocate_bitmask(0, vocab_size)

    @property
    def backend(self) -> GrammarBackend:
        """The grammar backend (built on the first structured request)."""
        if self._backend is None:
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "structured outputs need the model's tokenizer, and this model has none", "structured_outputs"
                )
            try:
                self._backend = make_backend(self.backend_name, self.tokenizer, self.vocab_size, self.eos_token_ids)
            except ImportError as e:  # a broken install: say which package, refuse the request, keep serving
                raise InvalidRequestError(
                    f"structured outputs need the {self.backend_name} package, which cannot "
                    f"be imported here ({e}); pip install {self.backend_name}",
                    "structured_outputs",
                ) from e
        return self._backend

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar (cached by its text); raises InvalidRequestError if it does not compile."""
        return self.backend.compile(params)

    def new_state(self, params: StructuredOutputsParams) -> GrammarState:
        """A fresh grammar state for one sequence."""
        return self.backend.new_state(self.compile(params))

    def start_masks(self, states: list[GrammarState | None]) -> MaskJob | None:
        """Start filling the bitmask of these rows in the background (None when no row is constrained)."""
        rows = [i for i, s in enumerate(states) if s is not None]
        if not rows or not self.overlap:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="cpuinfer-grammar")
        bitmask = allocate_bitmask(len(rows), self.vocab_size)  # its own buffer: mask() may run meanwhile
        done = self._pool.submit(self.backend.fill_bitmask, [states[i] for i in rows], bitmask)
        return MaskJob(list(states), rows, bitmask, done)

    def mask(self, logits: torch.Tensor, states: list[GrammarState | None], job: MaskJob | None = None) -> None:
        """In place: mask row i of logits by states[i] (rows whose state is None are left alone); uses `job`'s
        bitmask when it was started for exactly these states."""
        rows = [i for i, s in enumerate(states) if s is not None]
        if not rows:
            return
        if (
            job is not None
            and len(job.states) == len(states)
            and all(a is b for a, b in zip(job.states, states, strict=True))
        ):
            job.done.result()
            with torch.inference_mode():
                apply_bitmask_(logits, job.bitmask, None if len(rows) == len(states) else rows)
            return
        if self._bitmask.shape[0] < len(rows):
            self._bitmask = allocate_bitmask(max(len(rows), 2 * self._bitmask.shape[0]), self.vocab_size)
        bitmask = self._bitmask[: len(rows)]
        self.backend.fill_bitmask([states[i] for i in rows], bitmask)
        with torch.inference_mode():  # the runner's logits are inference tensors
            apply_bitmask_(logits, bitmask, None if len(rows) == len(states) else rows)
