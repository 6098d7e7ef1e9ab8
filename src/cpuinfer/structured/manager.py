"""What the engine holds for structured outputs: compile at admission (cached), a state per sequence, and each
step's batch mask, filled in one backend call and applied to the logits before sampling."""

from __future__ import annotations

from typing import Any

import torch

from cpuinfer.errors import InvalidRequestError
from cpuinfer.sampling_params import StructuredOutputsParams
from cpuinfer.structured.backend import GrammarBackend, GrammarState, make_backend
from cpuinfer.structured.bitmask import allocate_bitmask, apply_bitmask_


class StructuredOutputManager:
    """Grammar compilation and masking for one model; the backend is built on first use (imported lazily)."""

    def __init__(self, backend_name: str, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]):
        self.backend_name = backend_name
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
                raise InvalidRequestError("structured outputs need the model's tokenizer, and this model has none",
                                          "structured_outputs")
            self._backend = make_backend(self.backend_name, self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._backend

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar (cached by its text); raises InvalidRequestError if it does not compile."""
        return self.backend.compile(params)

    def new_state(self, params: StructuredOutputsParams) -> GrammarState:
        """A fresh grammar state for one sequence."""
        return self.backend.new_state(self.compile(params))

    def mask(self, logits: torch.Tensor, states: list[GrammarState | None]) -> None:
        """In place: mask row i of logits by states[i] (rows whose state is None are left alone)."""
        rows = [i for i, s in enumerate(states) if s is not None]
        if not rows:
            return
        if self._bitmask.shape[0] < len(rows):
            self._bitmask = allocate_bitmask(max(len(rows), 2 * self._bitmask.shape[0]), self.vocab_size)
        bitmask = self._bitmask[:len(rows)]
        self.backend.fill_bitmask([states[i] for i in rows], bitmask)
        with torch.inference_mode():  # the runner's logits are inference tensors
            apply_bitmask_(logits, bitmask, None if len(rows) == len(states) else rows)
