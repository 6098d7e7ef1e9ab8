"""The llguidance backend (the default): Lark / JSON-schema / regex grammars, masks computed lazily in Rust."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from cpuinfer.structured.backend import GrammarBackend, GrammarState, invalid

# JSON with fixed separators (as json.dumps writes them) and no free whitespace: a small model sampled at
# temperature 1 otherwise drifts into runs of newlines until max_tokens cuts the object off.
_START_PROBES = 64  # allowed first tokens tried at compile time (see _can_start)
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class _State(GrammarState):
    __slots__ = ("matcher",)

    def __init__(self, matcher: Any):
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        return self.matcher.consume_token(token_id)

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def valid_prefix(self, token_ids: list[int]) -> int:
        return self.matcher.validate_tokens(token_ids) if token_ids else 0


class LLGuidanceBackend(GrammarBackend):
    """llguidance: a compiled grammar is a matcher at its start; each sequence gets a deep copy."""

    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]):
        super().__init__()
        import llguidance

        self._llg = llguidance
        # The tokenizers.Tokenizer serialized is exactly what llguidance reads (as from a tokenizer.json).
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids) or None
        )
        self.executor = llguidance.LLExecutor(max(1, min(8, (os.cpu_count() or 1))))

    def _compile(self, kind: str, text: str) -> Any:
        M = self._llg.LLMatcher
        try:
            if kind == "json":
                grammar = M.grammar_from_json_schema(text, defaults=_JSON_OPTIONS)
            elif kind == "json_object":
                grammar = M.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
            elif kind == "regex":
                grammar = M.grammar_from_regex(text)
            elif kind == "choice":
                grammar = self._llg.grammar_from("choice", text)
            else:
                grammar = self._llg.grammar_from("grammar", text)  # Lark, or GBNF/EBNF converted to Lark
        except ValueError as e:
            raise invalid(kind, str(e)) from e
        matcher = M(self.tokenizer, grammar, log_level=0)
        can_start = not matcher.is_error() and self._can_start(matcher)
        if matcher.is_error():  # also set by the first mask, for an empty language
            raise invalid(kind, matcher.get_error())
        if not can_start:
            raise invalid(
                kind,
                "no output can match it with this model's vocabulary (no token it allows at its "
                "start is accepted; a character it requires may have no token in this model)",
            )
        return matcher

    def _can_start(self, matcher: Any) -> bool:
        """Whether some token the start mask allows is accepted. llguidance's mask can allow a token its matcher
        then refuses: for a regex of U+40000 (bytes f1 80 80 80) on SmolLM2's vocabulary, which has no token for
        byte f1, the mask allows the 0x80 byte token alone. Checks up to _START_PROBES allowed tokens; a start
        with more is accepted as is (a later dead end fails the request with a 400 while generating)."""
        mask = np.frombuffer(bytes(matcher.compute_bitmask()), dtype="<u4")
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
        for tok in allowed[:_START_PROBES]:
            probe = matcher.deep_copy()
            if probe.consume_token(int(tok)):
                return True
        return len(allowed) > _START_PROBES

    def new_state(self, compiled: Any) -> GrammarState:
        return _State(compiled.deep_copy())

    def fill_bitmask(self, states: list[GrammarState], bitmask: torch.Tensor) -> None:
        # What llguidance.torch.fill_next_token_bitmask_par does, without importing that module: it applies
        # torch.compile at import, which loads torch._dynamo (1-2 s, measured: the first request paid it).
        if bitmask.dtype != torch.int32 or not bitmask.is_contiguous() or bitmask.shape[0] < len(states):
            raise ValueError("the bitmask must be a contiguous int32 tensor with a row per state")
        self.executor.unsafe_compute_mask_ptr(
            [(s.matcher, i) for i, s in enumerate(states)], bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0]
        )
