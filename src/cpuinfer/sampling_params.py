"""`SamplingParams`: how to pick tokens for one request, with vLLM's field names and defaults.

Every value is checked when the object is built, so a bad request fails with a
`ValueError` naming the field, the value and the allowed range before any work
starts.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any

_GREEDY_EPS = 1e-5  # vLLM treats temperatures below this as greedy

# The bounds of every field, shared with the HTTP schema (entrypoints/openai/protocol.py) so that a value
# the server's schema accepts is never refused later, mid-stream, by SamplingParams (and the reverse).
# Limits that depend on the engine (vocabulary, context, --max-logprobs, stop-list sizes) are checked
# by the engine's request validation, cpuinfer.engine.limits.
MAX_N = 128  # OpenAI's own cap on `n`
PENALTY_RANGE = (-2.0, 2.0)  # presence / frequency penalty, as OpenAI
MAX_REPETITION_PENALTY = 1e4  # > 0; 1 = no penalty
MAX_TEMPERATURE = 1e6  # anything past ~100 is already uniform sampling
INT32_MAX = 2**31 - 1  # token ids, token counts, top_k, logprobs
POOLING_TASKS = ("embed", "classify", "score")
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seed: what torch.Generator.manual_seed takes
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's bound on each logit_bias value
MAX_LOGIT_BIAS = 1024  # entries of logit_bias (OpenAI allows 300; vLLM does not bound it)


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output (vLLM's fields): exactly one of json, regex, choice, grammar, json_object.

    Only the shape is checked here; whether a schema, regex or grammar compiles is the engine's request
    validation's (cpuinfer.engine.limits), which refuses it before any work starts.
    """

    json: str | dict | None = None  # a JSON schema (text or object)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF) or Lark, as the backend reads it
    json_object: bool | None = None  # any JSON object

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                "StructuredOutputsParams needs exactly one of json, regex, choice, grammar, "
                f"json_object; got {', '.join(given) or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("StructuredOutputsParams.json must be a JSON schema (a str or a dict)")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise ValueError(f"StructuredOutputsParams.{name} must be a str")
        if self.choice is not None:
            if (
                not isinstance(self.choice, (list, tuple))
                or not self.choice
                or not all(isinstance(c, str) for c in self.choice)
            ):
                raise ValueError("StructuredOutputsParams.choice must be a non-empty list of strings")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        """Which constraint this is: json, regex, choice, grammar or json_object."""
        return (
            next(n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None)
            if not self.json_object
            else "json_object"
        )


class RequestOutputKind(enum.Enum):
    """What each streamed RequestOutput holds (as in vLLM)."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class PoolingParams:
    """How to pool one request's prompt on a pooling model (vLLM's fields): no tokens are generated.

    dimensions: keep the first k of the pooled vector (Matryoshka), renormalised when normalising; the
    engine checks the model declares it. normalize: None takes the model's pooler (sentence-transformers'
    Normalize module, or --pooler-config). truncate_prompt_tokens is the front end's: it keeps the last k
    tokens of the prompt before the request is made.

    task: embed (a vector), classify (a classifier's scores per label) or score (a cross-encoder's one score of a
    text pair); the engine checks the model serves it. activation: whether the classifier's activation (sigmoid or
    softmax) is applied; None: yes. token_type_ids: a cross-encoder pair's segment of each prompt token (BERT's 0
    for the first text, 1 for the second); None: all 0.
    """

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    task: str = "embed"
    activation: bool | None = None
    token_type_ids: list[int] | None = None

    def __post_init__(self) -> None:
        for name in ("dimensions", "truncate_prompt_tokens"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= INT32_MAX):
                raise ValueError(f"PoolingParams.{name}={v!r} is invalid: must be an integer >= 1 or None")
        for name in ("normalize", "activation"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"PoolingParams.{name}={v!r} is invalid: must be a bool or None")
        if self.task not in POOLING_TASKS:
            raise ValueError(f"PoolingParams.task={self.task!r} is invalid: must be one of {', '.join(POOLING_TASKS)}")

    def as_sampling(self) -> SamplingParams:
        """The SamplingParams the engine carries a pooling request in (one sequence, nothing to sample)."""
        return SamplingParams(max_tokens=1, detokenize=False, pooling=self)


@dataclass
class SamplingParams:
    """Sampling parameters of one request (vLLM-compatible)."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    # OpenAI's predicted output ({"type": "content", "content": ...}'s text): the text the client expects
    # back (a file being edited); it feeds the speculative proposer. Output is unchanged by it.
    prediction: str | None = None
    # Added to the logits of these token ids before sampling (OpenAI's logit_bias; -100 bans, 100 forces).
    logit_bias: dict[int, float] | None = None
    # Set on a pooling model's requests (PoolingParams.as_sampling): the prompt's pooled hidden state comes
    # back instead of tokens.
    pooling: PoolingParams | None = None
    # Filled by the engine: the model's end-of-sequence ids (stop unless ignore_eos).
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.top_k == -1:  # vLLM's older spelling of "disabled"
            self.top_k = 0
        self._verify()
        if self.temperature < _GREEDY_EPS:
            # Greedy: the filters cannot change the argmax, so drop them (cheaper, as vLLM does).
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        self.all_stop_token_ids = set(self.stop_token_ids) | set(self.all_stop_token_ids)

    def _verify(self) -> None:
        def bad(name: str, limit: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}={getattr(self, name)!r} is invalid: {limit}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be an integer in [1, {MAX_N}]")
        lo, hi = PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not lo <= v <= hi:
                raise bad(name, f"must be in [{lo:g}, {hi:g}]")
        if not is_num(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise bad("repetition_penalty", f"must be in (0, {MAX_REPETITION_PENALTY:g}] (1 = no penalty)")
        if not is_num(self.temperature) or not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise bad("temperature", f"must be in [0, {MAX_TEMPERATURE:g}] (0 = greedy)")
        if not is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or not 0 <= self.top_k <= INT32_MAX:
            raise bad("top_k", f"must be 0 or -1 (disabled) or an integer in [1, {INT32_MAX}]")
        if not is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and (not is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX):
            raise bad("seed", "must be a 64-bit signed integer or None")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT32_MAX):
            raise bad("max_tokens", f"must be an integer in [1, {INT32_MAX}] (or None: up to the context length)")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= INT32_MAX:
            raise bad("min_tokens", f"must be an integer in [0, {INT32_MAX}]")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or not 0 <= v <= INT32_MAX):
                raise bad(name, "must be an integer >= 0 or None")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if any(not is_int(t) or not 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"must be token ids in [0, {INT32_MAX}]")
        if self.logit_bias is not None:
            self._verify_logit_bias(bad)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams or None")
        if self.prediction is not None and not isinstance(self.prediction, str):
            raise bad("prediction", "must be a string or None")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", "must be a RequestOutputKind")

    def _verify_logit_bias(self, bad) -> None:
        bias = self.logit_bias
        lo, hi = LOGIT_BIAS_RANGE
        if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
            raise bad("logit_bias", f"must be a dict of at most {MAX_LOGIT_BIAS} token id -> bias entries")
        for k, v in bias.items():
            if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= INT32_MAX:
                raise bad("logit_bias", f"has key {k!r}: keys must be token ids in [0, {INT32_MAX}]")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
                raise bad("logit_bias", f"has value {v!r} for token {k}: values must be in [{lo:g}, {hi:g}]")

    @property
    def greedy(self) -> bool:
        """True when the most likely token is always taken."""
        return self.temperature < _GREEDY_EPS

    def clone(self, **changes: Any) -> SamplingParams:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def for_sample(self, index: int) -> SamplingParams:
        """The params of sample `index` of an n > 1 request: n = 1, and a seeded request's seed + index
        (as vLLM), wrapped into the 64-bit range so the largest seed still works."""
        seed = None if self.seed is None else (self.seed + index - INT64_MIN) % 2**64 + INT64_MIN
        return self.clone(n=1, seed=seed)
