"""`speculative_config`: vLLM's keys, checked once into a `SpeculativeConfig` (a bad one is one clear error)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cpuinfer.json_arg import json_object

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
# vLLM keys we honour; the others in vLLM's SpeculativeConfig (EAGLE, MTP, draft parallelism) are refused by name.
KEYS = (
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "disable_by_batch_size",
    "quantization",
    "dtype",
    "revision",
)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Resolved speculative decoding settings."""

    method: str  # "ngram" or "draft_model"
    num_speculative_tokens: int  # k: the most tokens proposed per sequence and step
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # The draft model (an HF directory, a .gguf file or a Hugging Face id: the engine config resolves an id to its
    # local snapshot, at `revision`, with the target's --download-dir); method "draft_model".
    model: str | None = None
    revision: str | None = None
    quantization: str | None = None  # the draft checkpoint's; None: read from it
    dtype: str = "auto"  # the draft's; auto: the target's dtype
    # No speculation in a step with more running sequences than this (the step is compute-bound there);
    # 0: the engine's default (spec_decode.decoder.DEFAULT_DISABLE_BY_BATCH_SIZE).
    disable_by_batch_size: int = 0

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """A SpeculativeConfig from a JSON string or dict (vLLM's keys); None for None. Raises ValueError."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "--speculative-config")
        unknown = sorted(set(value) - set(KEYS))
        if unknown:
            raise _error(f"has unknown key(s) {', '.join(unknown)}; known: {', '.join(KEYS)}")
        method = value.get("method")
        model = value.get("model")
        if method is None:
            method = "draft_model" if model is not None else None
        if method in ("ngram", "[ngram]") or model in ("ngram", "[ngram]"):  # vLLM's older spelling: model=ngram
            method, model = "ngram", None
        if method not in METHODS:
            raise _error(
                f"method {method!r} is not supported; use one of {', '.join(METHODS)} (a draft model: give 'model')"
            )
        k = value.get("num_speculative_tokens")
        if not _int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise _error(f"num_speculative_tokens={k!r} must be an integer in 1..{MAX_SPECULATIVE_TOKENS}")
        lo = value.get("prompt_lookup_min")
        hi = value.get("prompt_lookup_max")
        if method == "ngram":
            if lo is None and hi is None:
                lo, hi = 2, 4
            elif lo is None:
                lo = min(2, hi) if _int(hi) else None
            elif hi is None:
                hi = max(4, lo) if _int(lo) else None
            if not (_int(lo) and _int(hi) and 1 <= lo <= hi <= 64):
                raise _error(
                    f"prompt_lookup_min={lo!r} and prompt_lookup_max={hi!r} must be integers with 1 <= min <= max <= 64"
                )
            if model is not None:
                raise _error("method 'ngram' takes no 'model'")
        else:
            if lo is not None or hi is not None:
                raise _error("prompt_lookup_min/max are n-gram settings; method 'draft_model' takes none")
            if not isinstance(model, str) or not model:
                raise _error(
                    "method 'draft_model' needs 'model': an HF model directory, a .gguf file or a Hugging Face id"
                )
            lo, hi = 2, 4
        revision = value.get("revision")
        if revision is not None and (method != "draft_model" or not isinstance(revision, str)):
            raise _error(f"revision={revision!r}: a draft model's revision is a string (method 'draft_model' only)")
        batch = value.get("disable_by_batch_size", 0)
        if batch is None:
            batch = 0
        if not _int(batch) or batch < 0:
            raise _error(f"disable_by_batch_size={batch!r} must be an integer >= 0")
        return cls(
            method=method,
            num_speculative_tokens=k,
            prompt_lookup_min=lo,
            prompt_lookup_max=hi,
            model=model,
            quantization=value.get("quantization"),
            dtype=value.get("dtype") or "auto",
            disable_by_batch_size=batch,
            revision=revision,
        )


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _error(what: str) -> ValueError:
    return ValueError(f"--speculative-config {what}")
