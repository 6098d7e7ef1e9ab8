"""ModelSpec: everything the engine needs to know about a model before (and without) loading its weights."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .chat_template import DEFAULT_MAX_OUTPUT_CHARS, render_chat_template

DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float": torch.float32,
    "fp32": torch.float32,
}


def resolve_dtype(requested: str | torch.dtype, checkpoint_dtype: str | None) -> torch.dtype:
    """'auto' runs 16-bit (and quantized) checkpoints in bfloat16 on CPU and keeps float32 ones in float32."""
    if isinstance(requested, torch.dtype):
        if requested not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"dtype {requested} is not supported; use auto, bfloat16, float16 or float32")
        return requested
    if requested == "auto":
        return torch.float32 if checkpoint_dtype in (None, "float32") else torch.bfloat16
    if requested not in DTYPES:
        raise ValueError(f"dtype {requested!r} is not supported; use auto, bfloat16, float16 or float32")
    return DTYPES[requested]


@dataclass
class ModelSpec:
    """Config, tokenizer and shapes of a model (no weights); the engine sizes the KV cache from it."""

    path: str
    architecture: str
    dtype: torch.dtype
    vocab_size: int
    max_model_len: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    sliding_window_layers: list[int]  # per layer, 0 = full attention
    eos_token_ids: list[int]
    bos_token_id: int | None
    tokenizer: Any  # tokenizers.Tokenizer, or None for a checkpoint without tokenizer files (token-id prompts only)
    chat_template: str | None
    special_token_ids: set[int]
    generation_defaults: dict
    hf_config: dict = field(repr=False, default_factory=dict)
    format: str = "hf"  # "hf" (directory with safetensors) or "gguf"
    quantization: str | None = None  # "gguf", "gptq", "awq", "compressed-tensors" (quantization/checkpoint.py)
    bos_token: str | None = None
    eos_token: str | None = None
    # A base-model checkpoint (Qwen3Model, LlamaModel: sentence-transformers saves decoders so): the decoder
    # without its language-model head, served by the pooling runner only.
    base_model: bool = False

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
        *,
        max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
        **template_kwargs,
    ) -> str:
        """Render messages with the model's chat template (encode the result without adding BOS again).

        As transformers' apply_chat_template: `tools` (OpenAI-style function definitions) and any extra variables
        reach the template; messages may carry `tool_calls` (assistant) and `tool_call_id` (role "tool").
        `chat_template` replaces the model's own.
        continue_final_message: the conversation is rendered whole, then cut after the final (partial)
        assistant message, so the model continues it instead of starting a new turn (as transformers does).
        """
        template = chat_template or self.chat_template
        if not template:
            raise ValueError(f"{self.path} has no chat template; pass a plain prompt instead of chat messages")
        kwargs = dict(
            template_kwargs, bos_token=self.bos_token, eos_token=self.eos_token, max_output_chars=max_output_chars
        )
        if tools is not None:
            kwargs["tools"] = tools
        if not continue_final_message:
            return render_chat_template(template, messages, add_generation_prompt=add_generation_prompt, **kwargs)
        text = render_chat_template(template, messages, add_generation_prompt=False, **kwargs)
        final = messages[-1]["content"]
        cut = text.rfind(final) if final else -1
        return text[: cut + len(final)] if cut >= 0 else text

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
        *,
        max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
        **template_kwargs,
    ) -> tuple[str, list[int]]:
        """(prompt text, token ids) of a conversation: the one helper that applies the chat template and encodes.

        The template writes the special tokens as text, so BOS is not added again by default. encode_batch,
        unlike encode, releases the GIL: a long conversation can be encoded on a worker thread.
        """
        text = self.apply_chat_template(
            messages,
            add_generation_prompt,
            continue_final_message,
            tools,
            chat_template,
            max_output_chars=max_output_chars,
            **template_kwargs,
        )
        return text, list(self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    @property
    def is_encoder(self) -> bool:
        """True for an encoder (BERT): whole prompts per step, no KV cache, the pooling runner only."""
        from ..models.registry import ENCODERS

        return self.architecture in ENCODERS

    @property
    def is_classifier(self) -> bool:
        """True for a sequence-classification model (a cross-encoder or reranker): the pooling runner only."""
        return self.architecture.endswith("ForSequenceClassification")

    @property
    def type_vocab_size(self) -> int:
        """Segment ids (token_type_ids) the model's inputs may carry: an encoder's type_vocab_size, else 1."""
        return int(self.hf_config.get("type_vocab_size") or 1) if self.is_encoder else 1

    @property
    def hidden_size(self) -> int:
        """Width of the model's hidden states (a pooling model's output vector)."""
        return int(self.hf_config["hidden_size"])

    def kv_heads_per_rank(self, tp: int = 1) -> int:
        """KV heads each of `tp` tensor-parallel ranks holds: its share, or one replicated head when the model
        has fewer KV heads than ranks (every rank needs the head its query heads attend to)."""
        return max(1, self.num_kv_heads // tp)

    def kv_bytes_per_token(self, cache_dtype: torch.dtype, tp: int = 1) -> int:
        """KV-cache bytes one token takes across all layers (K and V), on one of `tp` tensor-parallel ranks."""
        item = torch.empty(0, dtype=cache_dtype).element_size()
        return self.num_layers * 2 * self.kv_heads_per_rank(tp) * self.head_size * item
