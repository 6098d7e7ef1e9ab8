"""Front-end tokenization: prompts to token ids, ids to text, chat messages to a prompt.

Runs in the HTTP process (off the inference cores), or in the request-preparation workers (prep_pool.py) for
anything large or request-supplied. It wraps the model's tokenizer and chat template from the model loader's
ModelSpec, so the server needs no weights to tokenize.
"""

from __future__ import annotations

import re
from functools import cached_property, lru_cache
from typing import Any

from cpuinfer.entrypoints.score_inputs import encode_pairs
from cpuinfer.errors import InvalidRequestError

_SURROGATE = re.compile("[\ud800-\udfff]")
# encode_chat's own parameters: a chat_template_kwargs key with one of these names would replace it.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "add_special_tokens",
        "tools",
        "chat_template",
        "max_output_chars",
        "bos_token",
        "eos_token",
    }
)


def check_text(text: str, param: str) -> None:
    """Refuse text the tokenizer cannot take (lone UTF-16 surrogates), naming the field and the position."""
    m = _SURROGATE.search(text)
    if m is not None:
        raise InvalidRequestError(
            f"{param} holds an unpaired UTF-16 surrogate (U+{ord(m.group()):04X} at character {m.start()}), "
            "which is not valid Unicode text; send valid UTF-8 / properly paired \\u escapes",
            param,
        )


class Tokenization:
    """Encode, decode and chat-format for one model."""

    def __init__(self, spec: Any):
        self.spec = spec
        self.tokenizer = spec.tokenizer  # a tokenizers.Tokenizer
        self.vocab_size = int(spec.vocab_size)
        self._token_text = lru_cache(maxsize=65536)(self._decode_one)

    @cached_property
    def max_token_chars(self) -> int:
        """Characters of the longest token's text: a text longer than this times N tokens never fits N tokens."""
        if self.tokenizer is None:
            return 1
        n = self.tokenizer.get_vocab_size(with_added_tokens=True)
        texts = self.tokenizer.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
        return max(1, *(len(t) for t in texts))

    def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """Token ids of `text`. Through encode_batch, which releases the GIL (encode holds it): a long text
        tokenized on a worker thread then leaves the event loop free."""
        try:
            return list(self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
        except TypeError:  # tokenizers' message about its input types: say what is wrong with the text instead
            check_text(text, param)
            raise

    def encode_many(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text (one encode_batch call)."""
        try:
            return [list(e.ids) for e in self.tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)]
        except TypeError:
            for text in texts:
                check_text(text, "prompt")
            raise

    def encode_pairs(
        self, pairs: list[tuple[str, str]], max_length: int | None
    ) -> list[tuple[list[int], list[int] | None]]:
        """(token ids, token types) of each text pair as one cross-encoder input (score_inputs.encode_pairs)."""
        try:
            return encode_pairs(self.tokenizer, pairs, self.spec.type_vocab_size, max_length)
        except TypeError:
            for pair in pairs:
                for text in pair:
                    check_text(text, "text")
            raise

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids` (decode_batch releases the GIL, as encode_batch does)."""
        return self.tokenizer.decode_batch([list(token_ids)], skip_special_tokens=skip_special_tokens)[0]

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (for logprobs)."""
        return self._token_text(int(token_id))

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        continue_final_message: bool,
        add_special_tokens: bool,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
        template_kwargs: dict | None = None,
        max_output_chars: int | None = None,
    ) -> tuple[str, list[int]]:
        """(prompt text, token ids) of chat messages after the chat template (the model spec's helper)."""
        kwargs = dict(template_kwargs or {})
        clash = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if clash:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {', '.join(clash)}: use the request's own fields",
                "chat_template_kwargs",
            )
        if max_output_chars is not None:
            kwargs["max_output_chars"] = max_output_chars
        try:
            return self.spec.encode_chat(
                messages,
                add_generation_prompt,
                continue_final_message,
                add_special_tokens,
                tools,
                chat_template,
                **kwargs,
            )
        except TypeError:
            for m in messages:
                check_text(str(m.get("content") or ""), "messages")
            raise
