"""What proposes draft tokens, and the n-gram prompt-lookup proposer.

A proposer sees the engine's sequences through `SpecSequence` and returns at most k_i tokens for sequence i;
the engine verifies them all in its next step. New proposers (a draft model here; EAGLE-style heads or
multi-token-prediction layers next) implement the same two calls.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class SpecSequence(Protocol):
    """What a proposer reads of one sequence (the engine's Request has these)."""

    request_id: str
    all_token_ids: list[int]  # prompt + generated so far (the last one not yet in the KV cache)
    output_token_ids: list[int]
    prediction_token_ids: list[int] | None  # OpenAI's predicted output, tokenized; None: none given


class Proposer(Protocol):
    """Proposes draft tokens for sequences that are decoding."""

    def propose(self, seqs: list[SpecSequence], ks: list[int]) -> list[list[int]]:
        """At most ks[i] draft tokens to follow seqs[i].all_token_ids, for every i."""
        ...

    def drop(self, request_id: str) -> None:
        """Forget a finished (or preempted) sequence's state."""
        ...


def find_continuation(
    haystack: np.ndarray, pattern: np.ndarray, k: int, min_n: int = 1, near: int | None = None
) -> tuple[int, int]:
    """(start, count) of the (at most k) tokens to propose from haystack after an occurrence of pattern's last n
    tokens.

    The longest n in pattern's length down to min_n with an occurrence that has a continuation wins; among its
    occurrences the last one (the most recent repetition), or with `near` the one whose continuation starts
    closest to it. (0, 0) when nothing matches."""
    for n in range(len(pattern), min_n - 1, -1):
        if len(haystack) <= n:
            continue
        windows = sliding_window_view(haystack[:-1], n)  # a match at i continues at i + n <= len - 1
        hits = np.flatnonzero((windows == pattern[-n:]).all(axis=1))
        if hits.size:
            i = int(hits[-1]) if near is None else int(hits[np.abs(hits + n - near).argmin()])
            return i + n, min(k, len(haystack) - i - n)
    return 0, 0


class NgramProposer:
    """Prompt lookup (vLLM's "ngram"): the tokens that followed the sequence's last n tokens where they occurred
    before in its own context, for n from prompt_lookup_max down to prompt_lookup_min. With a prediction
    (OpenAI's predicted outputs), the prediction is searched first: at the start the proposal is its head."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.lo = prompt_lookup_min
        self.hi = prompt_lookup_max
        # request id -> (index in its prediction of the last proposal's first token, len(all_token_ids) then)
        self._pred_pos: dict[str, tuple[int, int]] = {}
        self.from_prediction: dict[str, bool] = {}  # request id -> did its last proposal come from the prediction

    def propose(self, seqs: list[SpecSequence], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] tokens per sequence (empty where nothing matches)."""
        return [self._one(s, k) for s, k in zip(seqs, ks, strict=True)]

    def _one(self, seq: SpecSequence, k: int) -> list[int]:
        self.from_prediction[seq.request_id] = False
        if k <= 0:
            return []
        tokens = seq.all_token_ids
        pred = seq.prediction_token_ids
        if pred:
            got = self._from_prediction(seq, pred, k)
            if got:
                self.from_prediction[seq.request_id] = True
                return got
        ctx = np.asarray(tokens, dtype=np.int64)
        n_max = min(self.hi, len(ctx) - 1)
        if n_max < self.lo:
            return []
        start, n = find_continuation(ctx, ctx[-n_max:], k, self.lo)
        return ctx[start : start + n].tolist()

    def _from_prediction(self, seq: SpecSequence, pred: list[int], k: int) -> list[int]:
        out = seq.output_token_ids
        rid = seq.request_id
        now = len(seq.all_token_ids)
        if len(out) <= 1 and rid not in self._pred_pos:
            # The first generated token is already out: propose the prediction after it if it starts there.
            head = pred[len(out) :] if out == pred[: len(out)] else []
            if head:
                self._pred_pos[rid] = (len(out), now)
                return head[:k]
        pos, then = self._pred_pos.get(rid, (len(out), now))
        near = pos + (now - then)  # where the prediction should be, if what was generated followed it
        suffix = np.asarray(out[-self.hi :], dtype=np.int64)
        if suffix.size == 0:
            return []
        hay = np.asarray(pred, dtype=np.int64)
        # A lone matching token is enough in a prediction (it is the text the client expects back), but the
        # continuation must come after a match of at least one token of what was generated.
        start, n = find_continuation(hay, suffix, k, 1, near)
        if n == 0:
            return []
        self._pred_pos[rid] = (start, now)
        return pred[start : start + n]

    def drop(self, request_id: str) -> None:
        """Forget a sequence's prediction alignment."""
        self._pred_pos.pop(request_id, None)
        self.from_prediction.pop(request_id, None)
