"""The one place a request is checked against the engine's limits, before any work is accepted.

`LLM`, `AsyncLLM` (and so the server) and the engine core all call
`validate_request`; the server maps its `InvalidRequestError` to a 400 naming
the field. Bounds that do not depend on the engine (ranges of sampling fields)
are checked by `SamplingParams` itself, with the same numbers as the HTTP schema.

Every limit is finite, so one request cannot hold the front end or the engine
for long: stop strings are matched against every generated token of every
sample (count x length), `n x max_tokens` is the work a request can ask for,
and retained logprobs are `n x max_tokens x (logprobs + 1)` Python objects. A request of several prompts (the
completions route) is held to the same caps over all its prompts by `validate_batch`, plus a cap on its prompt
tokens and sequences; one that could never fit the queue is a 400, not a retryable 503.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from cpuinfer.errors import InvalidRequestError
from cpuinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cpuinfer.models.pooler import PoolerConfig
    from cpuinfer.structured.manager import StructuredOutputManager


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask of this engine (the defaults are the CLI's)."""

    max_model_len: int
    vocab_size: int
    max_logprobs: int = 20
    max_stop_strings: int = 64  # OpenAI allows 4; generous, but finite
    max_stop_string_length: int = 1024  # characters
    max_stop_token_ids: int = 1024
    max_request_tokens: int = 2**19  # n x max_tokens
    max_retained_logprobs: int = 2**20  # n x max_tokens x (logprobs + 1)
    max_request_prompt_tokens: int = 2**17  # all prompts of one request
    max_request_sequences: int = 1024  # prompts x n
    queue_capacity: int | None = None  # running + waiting sequences the engine admits (None: unbounded)
    pooler: PoolerConfig | None = None  # set under the pooling runner: requests pool, none generates
    hidden_size: int = 0  # a pooling model's vector width (the most `dimensions` may ask)
    type_vocab_size: int = 1  # segment ids an encoder's inputs may carry (token_type_ids)

    @property
    def runner(self) -> str:
        """generate or pooling."""
        return "generate" if self.pooler is None else "pooling"

    @classmethod
    def from_config(cls, config) -> RequestLimits:
        """The limits an EngineConfig sets."""
        a = config.args
        return cls(
            max_model_len=config.max_model_len,
            vocab_size=config.spec.vocab_size,
            max_logprobs=a.max_logprobs,
            max_stop_strings=a.max_stop_strings,
            max_stop_string_length=a.max_stop_string_length,
            max_stop_token_ids=a.max_stop_token_ids,
            max_request_tokens=a.max_request_tokens,
            max_retained_logprobs=a.max_retained_logprobs,
            max_request_prompt_tokens=a.max_request_prompt_tokens,
            max_request_sequences=a.max_request_sequences,
            queue_capacity=config.max_num_seqs + a.max_waiting_requests,
            pooler=config.pooler,
            hidden_size=config.spec.hidden_size if config.pooler is not None else 0,
            type_vocab_size=config.spec.type_vocab_size,
        )


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    """Every id an int in [0, vocab_size); else an error naming the bad ids and the vocabulary size."""
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        shown = ", ".join(repr(t) for t in bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise InvalidRequestError(
            f"{param} has token id(s) outside the vocabulary: {shown}; this model's "
            f"vocabulary has {vocab_size} tokens (valid ids are 0..{vocab_size - 1})",
            param,
        )


def validate_request(
    prompt_token_ids: list[int],
    params: SamplingParams,
    limits: RequestLimits,
    grammars: StructuredOutputManager | None = None,
    compile_constraint: bool = True,
) -> int:
    """Check one request (all its n samples) before any work; returns its resolved max_tokens.

    A structured-output constraint is compiled by `grammars` (cached, so a later compile of the same text in
    this process is a lookup): a schema, regex or grammar that does not compile is refused here, naming it.
    `compile_constraint=False`: the caller compiles it later (the engine core, on its grammar thread).
    """
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
    check_runner(params, limits)
    if params.pooling is not None:
        return validate_pooling(prompt_token_ids, params.pooling, limits)
    ctx = limits.max_model_len
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequestError("The prompt is empty (0 tokens); send at least one token.", "prompt")
    check_token_ids(prompt_token_ids, limits.vocab_size, "prompt")
    if n >= ctx:
        raise InvalidRequestError(
            f"This model's maximum context length is {ctx} tokens. However, your request "
            f"has {n} input tokens. Please reduce the length of the input.",
            "prompt",
        )
    if params.max_tokens is None:
        max_tokens = ctx - n
    else:
        max_tokens = params.max_tokens
        if n + max_tokens > ctx:
            raise InvalidRequestError(
                f"'max_tokens' is too large: {max_tokens}. This model's maximum context length is {ctx} tokens "
                f"and your request has {n} input tokens ({max_tokens} > {ctx} - {n}).",
                "max_tokens",
            )
    if params.min_tokens > max_tokens:
        raise InvalidRequestError(
            f"min_tokens={params.min_tokens} is more than the {max_tokens} tokens this "
            f"request can generate (max_tokens, or what the {ctx}-token context leaves "
            f"after the {n}-token prompt)",
            "min_tokens",
        )
    stop = params.stop or []
    if len(stop) > limits.max_stop_strings:
        raise InvalidRequestError(
            f"stop has {len(stop)} strings; at most {limits.max_stop_strings} are allowed (--max-stop-strings)", "stop"
        )
    longest = max((len(s) for s in stop), default=0)
    if longest > limits.max_stop_string_length:
        raise InvalidRequestError(
            f"a stop string has {longest} characters; at most "
            f"{limits.max_stop_string_length} are allowed (--max-stop-string-length)",
            "stop",
        )
    stop_ids = params.stop_token_ids or []
    if len(stop_ids) > limits.max_stop_token_ids:
        raise InvalidRequestError(
            f"stop_token_ids has {len(stop_ids)} ids; at most {limits.max_stop_token_ids} "
            "are allowed (--max-stop-token-ids)",
            "stop_token_ids",
        )
    check_token_ids(stop_ids, limits.vocab_size, "stop_token_ids")
    check_token_ids(list(params.logit_bias or ()), limits.vocab_size, "logit_bias")
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and k > limits.max_logprobs:
            raise InvalidRequestError(
                f"{name}={k} is more than the server's limit of {limits.max_logprobs} (--max-logprobs)", name
            )
    _check_sequences(params.n, 1, limits)
    _check_totals(params, limits, params.n * max_tokens, n, f"n={params.n} x max_tokens={max_tokens}")
    if params.structured_outputs is not None:
        # The grammar decides where a constrained output ends: past its end only end-of-sequence is allowed.
        for name, value in (("min_tokens", params.min_tokens), ("ignore_eos", params.ignore_eos)):
            if value:
                raise InvalidRequestError(
                    f"{name} cannot be combined with a structured output (JSON schema, regex, "
                    "choice, grammar or tool choice): the grammar decides where it ends",
                    name,
                )
        if grammars is None:
            raise InvalidRequestError("structured outputs are not available in this engine", "structured_outputs")
        if compile_constraint:
            grammars.compile(params.structured_outputs)
    return max_tokens


def check_runner(params: SamplingParams, limits: RequestLimits) -> None:
    """A generation request to a pooling model, or a pooling one to a generating model: refused, naming the runner."""
    if params.pooling is None and limits.pooler is not None:
        raise InvalidRequestError(
            f"This model runs under the pooling runner (--runner pooling): it serves {_serves(limits.pooler)}, "
            "not text generation.",
            "model",
        )
    if params.pooling is not None and limits.pooler is None:
        raise InvalidRequestError(
            "This model runs under the generate runner: it generates text and serves no embeddings or scores; "
            "start it with --runner pooling (or --convert embed) to embed.",
            "model",
        )
    if params.pooling is not None:
        task, pooler = params.pooling.task, limits.pooler
        if (task == "embed") != (pooler.task == "embed"):
            raise InvalidRequestError(
                f"This model cannot {task}: it is {_model_kind(pooler)} and serves {_serves(pooler)}.", "model"
            )
        if task == "score" and pooler.num_labels != 1:
            raise InvalidRequestError(
                f"This classifier has {pooler.num_labels} labels; scoring text pairs (/score, /rerank, "
                "LLM.score) needs a one-label cross-encoder: use /classify (LLM.classify) for its label scores.",
                "model",
            )


def _model_kind(pooler: PoolerConfig) -> str:
    return "a sequence classifier (a cross-encoder or reranker)" if pooler.num_labels else "an embedding model"


def _serves(pooler: PoolerConfig) -> str:
    """What a pooling model's requests are, by route and LLM method."""
    if pooler.num_labels:
        return "scores (/score, /rerank, /classify; LLM.score, LLM.classify)"
    return "embeddings (/v1/embeddings, LLM.embed)"


def check_pooling_text(text: str | None, param: str = "input") -> None:
    """An input text to embed must hold something: an empty string is refused (its tokens would be only the
    tokenizer's special ones, whose vector says nothing about any text)."""
    if text is not None and not text.strip():
        raise InvalidRequestError(f"{param} contains an empty string; every text to embed must be non-empty.", param)


def validate_pooling(prompt_token_ids: list[int], pooling, limits: RequestLimits) -> int:
    """Check one pooling request (an input to embed); returns 1 (its one step's sequence, nothing sampled)."""
    ctx = limits.max_model_len
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequestError("The input is empty (0 tokens); send at least one token.", "input")
    check_token_ids(prompt_token_ids, limits.vocab_size, "input")
    if n > ctx:
        raise InvalidRequestError(
            f"This model's maximum context length is {ctx} tokens. However, your input has {n} tokens. "
            "Please reduce the length of the input, or set truncate_prompt_tokens.",
            "input",
        )
    types = pooling.token_type_ids
    if types is not None and (len(types) != n or any(not 0 <= t < limits.type_vocab_size for t in types)):
        raise InvalidRequestError(
            f"token_type_ids must give each of the input's {n} tokens a segment in 0..{limits.type_vocab_size - 1} "
            "(this model's type_vocab_size)",
            "input",
        )
    dims = pooling.dimensions
    if dims is not None:
        pooler = limits.pooler
        if not pooler.is_matryoshka:
            raise InvalidRequestError(
                "This model does not support matryoshka representation: 'dimensions' cannot be set "
                "(its config declares neither is_matryoshka nor matryoshka_dimensions).",
                "dimensions",
            )
        allowed = pooler.matryoshka_dimensions
        if (allowed and dims not in allowed) or dims > limits.hidden_size:
            shown = ", ".join(map(str, allowed)) if allowed else f"1..{limits.hidden_size}"
            raise InvalidRequestError(
                f"dimensions={dims} is not supported by this model; use one of {shown}.", "dimensions"
            )
    return 1


def _check_sequences(n: int, prompts: int, limits: RequestLimits, in_flight: int | None = None) -> None:
    seqs = n * prompts
    what = f"n={n}" if prompts == 1 else f"{prompts} prompts x n={n}"
    if seqs > limits.max_request_sequences:
        raise InvalidRequestError(
            f"{what} asks for {seqs} sequences; at most {limits.max_request_sequences} per request are allowed "
            "(--max-request-sequences): lower n or send fewer prompts",
            "n" if prompts == 1 else "prompt",
        )
    held = seqs if in_flight is None else min(seqs, in_flight)
    if limits.queue_capacity is not None and held > limits.queue_capacity:
        raise InvalidRequestError(
            f"{what} asks for {held} sequences at once, more than this server ever holds "
            f"({limits.queue_capacity}: --max-num-seqs + --max-waiting-requests): lower n or send fewer prompts",
            "n" if prompts == 1 else "prompt",
        )


def _check_totals(
    params: SamplingParams, limits: RequestLimits, generated: int, prompt_tokens: int, what: str, hint: str = ""
) -> None:
    """The caps on what one request generates and keeps, for one prompt (validate_request) or all of a request's
    (validate_batch): generated tokens, their logprob entries, the prompt logprob entries. `what` says how the
    generated total came about; `hint` is the way out that adds to lowering the numbers."""
    if generated > limits.max_request_tokens:
        raise InvalidRequestError(
            f"{what} asks for {generated} tokens; at most {limits.max_request_tokens} per request are allowed "
            f"(--max-request-tokens): lower n or max_tokens{hint}",
            "max_tokens",
        )
    if params.logprobs is not None and (retained := generated * (params.logprobs + 1)) > limits.max_retained_logprobs:
        raise InvalidRequestError(
            f"{what} x (logprobs={params.logprobs} + 1) would keep {retained} logprob entries; at most "
            f"{limits.max_retained_logprobs} are allowed (--max-retained-logprobs): lower n, max_tokens or "
            f"logprobs{hint}",
            "logprobs",
        )
    if params.prompt_logprobs is not None:
        retained = params.n * prompt_tokens * (params.prompt_logprobs + 1)
        if retained > limits.max_retained_logprobs:
            raise InvalidRequestError(
                f"n={params.n} x {prompt_tokens} prompt tokens x (prompt_logprobs={params.prompt_logprobs} + 1) "
                f"would keep {retained} logprob entries; at most {limits.max_retained_logprobs} are allowed "
                f"(--max-retained-logprobs): lower one of them{hint}",
                "prompt_logprobs",
            )


def validate_batch(
    prompt_lengths: list[int], params: SamplingParams, limits: RequestLimits, in_flight: int | None = None
) -> None:
    """Check the caps that hold over all prompts of one request (each prompt is `validate_request`'s): sequences,
    prompt tokens, generated tokens and retained logprobs, summed over the prompts. `in_flight`: the most sequences
    the request holds in the engine at once (its prompts may start one window at a time), against the queue."""
    if len(prompt_lengths) <= 1:
        return
    _check_sequences(params.n, len(prompt_lengths), limits, in_flight)
    prompt_tokens = sum(prompt_lengths)
    if prompt_tokens > limits.max_request_prompt_tokens:
        raise InvalidRequestError(
            f"the {len(prompt_lengths)} prompts hold {prompt_tokens} tokens in all; at most "
            f"{limits.max_request_prompt_tokens} per request are allowed (--max-request-prompt-tokens): "
            "send fewer or shorter prompts, or split them over several requests",
            "prompt",
        )
    ctx = limits.max_model_len
    total = sum(params.n * (params.max_tokens if params.max_tokens is not None else ctx - n) for n in prompt_lengths)
    what = f"{len(prompt_lengths)} prompts x n={params.n} x max_tokens"
    _check_totals(params, limits, total, prompt_tokens, what, ", or send fewer prompts")
