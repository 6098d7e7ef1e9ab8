"""Incremental detokenization and stop strings.

Text is produced by decoding a short window of recent tokens and emitting what
the newest token added, as vLLM and TGI do: decoding only a window keeps each
step O(1), and starting the window a few tokens back keeps word-boundary
spacing right. A window whose text ends in U+FFFD (an incomplete UTF-8
sequence of a byte-level token) is held back until the next token completes it,
so no broken character is ever emitted.

Stop strings are searched in the text added at each step plus the tail of the
earlier text (a stop string may span tokens). While streaming, the last
len(longest stop) - 1 characters are held back so a stop string that is only
partly generated is never shown.
"""

from __future__ import annotations

_PROMPT_CONTEXT = 5  # prompt tokens decoded with the first outputs, for correct leading spaces


class IncrementalDetokenizer:
    """Text of one sequence's generated tokens, grown one token at a time."""

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output
        self.hold = max((len(s) for s in self.stop), default=1) - 1 if not include_stop_str_in_output else 0
        self._streamed = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str:
        """Append one token; returns the text it completes ('' while a character is incomplete)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += new
            return new
        return ""

    def check_stop(self, new_text_len: int) -> str | None:
        """After add_token: the stop string now present (text is truncated at it), else None."""
        if not self.stop or not new_text_len:
            return None
        longest = max(len(s) for s in self.stop)
        start = max(0, len(self.text) - new_text_len - longest + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        return s

    def streamable(self, finished: bool) -> str:
        """Text that may be shown now (all of it once finished)."""
        end = len(self.text) if finished else max(self._streamed, len(self.text) - self.hold)
        return self.text[:end]

    def take_delta(self, finished: bool) -> str:
        """Text shown since the previous call."""
        visible = self.streamable(finished)
        delta = visible[self._streamed :]
        self._streamed = len(visible)
        return delta
