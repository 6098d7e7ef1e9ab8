"""`LLMEngine`: tokenizer + output processor + an in-process engine core, driven by `step()`.

This is the synchronous engine under `LLM` and the CLI; `cpuinfer.engine.async_llm`
puts the same core in its own process for serving.
"""

from __future__ import annotations

import itertools

from cpuinfer.config import EngineArgs, EngineConfig
from cpuinfer.engine.core import EngineCore
from cpuinfer.engine.limits import validate_request
from cpuinfer.engine.messages import EngineStats
from cpuinfer.engine.output_processor import OutputProcessor
from cpuinfer.errors import InvalidRequestError
from cpuinfer.outputs import RequestOutput
from cpuinfer.sampling_params import SamplingParams

Prompt = str | list[int] | dict


def tokenize_prompt(tokenizer, prompt: Prompt) -> tuple[str | None, list[int]]:
    """(prompt text or None, token ids) of a str, a token-id list, or {"prompt": ...}/{"prompt_token_ids": ...}."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise InvalidRequestError("A prompt dict needs a 'prompt' or 'prompt_token_ids' key", "prompt")
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt, add_special_tokens=True).ids
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None, list(prompt)
    raise InvalidRequestError(
        f"A prompt must be a string or a list of token ids, got {type(prompt).__name__}", "prompt"
    )


class LLMEngine:
    """Add requests, call step() until has_unfinished_requests() is False."""

    def __init__(self, config: EngineConfig, core: EngineCore, tokenizer):
        self.config = config
        self.core = core
        self.tokenizer = tokenizer
        self.processor = OutputProcessor(tokenizer)
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, serving: bool = False) -> LLMEngine:
        """Check the options, load the model, allocate the KV cache."""
        config = args.create_engine_config(serving=serving)
        return cls(config, EngineCore.from_config(config), config.spec.tokenizer)

    def next_request_id(self) -> str:
        """A fresh request id."""
        return str(next(self._ids))

    def validate(self, prompt: Prompt, params: SamplingParams) -> tuple[str | None, list[int]]:
        """Tokenize and check a request against the limits; raises InvalidRequestError before any work."""
        text, ids = tokenize_prompt(self.tokenizer, prompt)
        validate_request(ids, params, self.core.limits, self.core.grammars)
        return text, ids

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams) -> None:
        """Queue a request (a str prompt is tokenized here)."""
        text, ids = self.validate(prompt, params)
        self.add_tokenized(request_id, text, ids, params)

    def add_tokenized(self, request_id: str, text: str | None, ids: list[int], params: SamplingParams) -> None:
        """Queue an already validated, tokenized request."""
        msg = self.processor.add_request(request_id, text, ids, params)
        try:
            self.core.add_request(msg)
        except ValueError:
            self.processor.abort(request_id)
            raise

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests now."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.core.abort(self.processor.child_ids(rid))
            self.processor.abort(rid)

    def step(self) -> list[RequestOutput]:
        """Run one model step; returns the RequestOutputs that changed."""
        outs, to_abort = self.processor.process(self.core.step())
        if to_abort:
            self.core.abort(to_abort)
        return outs

    def has_unfinished_requests(self) -> bool:
        """True while any request is queued or running."""
        return self.core.has_unfinished() or bool(self.processor.states)

    def get_stats(self) -> EngineStats:
        """The engine core's counters."""
        return self.core.stats()
