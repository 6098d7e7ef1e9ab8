"""The xgrammar backend (vLLM's default, offered as --structured-outputs-backend xgrammar)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from cpuinfer.structured.backend import GrammarBackend, GrammarState, invalid


class _State(GrammarState):
    __slots__ = ("matcher",)

    def __init__(self, matcher: Any):
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self.matcher.is_completed() or self.matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)


class XGrammarBackend(GrammarBackend):
    """xgrammar: grammars precompiled against the vocabulary (its own cache by text, plus ours)."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]):
        super().__init__()
        import xgrammar as xgr

        self._xgr = xgr
        # What TokenizerInfo.from_huggingface reads off a transformers tokenizer, read off tokenizers' own.
        metadata = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.to_str())
        n = tokenizer.get_vocab_size(with_added_tokens=True)
        vocab = [""] * n
        for tok, i in tokenizer.get_vocab(with_added_tokens=True).items():
            if i < n:
                vocab[i] = tok
        info = xgr.TokenizerInfo(
            vocab,
            xgr.VocabType(metadata["vocab_type"]),
            vocab_size=vocab_size,
            stop_token_ids=list(eos_token_ids),
            add_prefix_space=metadata["add_prefix_space"],
        )
        threads = max(1, min(8, os.cpu_count() or 1))
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads)
        self.batch = xgr.BatchGrammarMatcher(threads)

    def _compile(self, kind: str, text: str) -> Any:
        c = self.compiler
        try:
            if kind == "json":
                return c.compile_json_schema(text, any_whitespace=False, separators=(", ", ": "))
            if kind == "json_object":
                return c.compile_builtin_json_grammar()
            if kind == "regex":
                return c.compile_regex(text)
            if kind == "choice":
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(x) for x in json.loads(text)))
            if "::=" in text:
                return c.compile_grammar(text)
            return c.compile_lark(text)
        except (RuntimeError, ValueError, self._xgr.InvalidJSONError) as e:
            raise invalid(kind, str(e)) from e

    def new_state(self, compiled: Any) -> GrammarState:
        return _State(self._xgr.GrammarMatcher(compiled))

    def fill_bitmask(self, states: list[GrammarState], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask([s.matcher for s in states], bitmask)
