"""Front-end tokenization: prompts to token ids, ids to text, chat messages to a prompt.

Runs in the HTTP process (off the inference cores). It wraps the model's
tokenizer and chat template from the model loader's ModelSpec, so the server
needs no weights to tokenize.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any


class Tokenization:
    """Encode, decode and chat-format for one model."""

    def __init__(self, spec: Any):
        self.spec = spec
        self.tokenizer = spec.tokenizer  # a tokenizers.Tokenizer
        self.vocab_size = int(spec.vocab_size)
        self._token_text = lru_cache(maxsize=65536)(self._decode_one)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Through encode_batch, which releases the GIL (encode holds it): a long text
        tokenized on a worker thread then leaves the event loop free."""
        return list(self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

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
    ) -> tuple[str, list[int]]:
        """(prompt text, token ids) of chat messages after the chat template (the model spec's helper)."""
        return self.spec.encode_chat(
            messages,
            add_generation_prompt,
            continue_final_message,
            add_special_tokens,
            tools,
            chat_template,
            **(template_kwargs or {}),
        )
