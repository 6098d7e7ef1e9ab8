"""The numbers a model config declares, checked before anything is sized from them or divided by them.

A config (config.json, or GGUF metadata turned into one) is untrusted input: a head count of 0 divides
by zero, a layer count of 2**40 builds a 2**40-entry per-layer list, a NaN epsilon makes a silently
wrong model. A huge context length is allowed: the engine sizes the KV cache and the rotary tables from
the effective --max-model-len, which must fit the KV-cache budget.
"""

from __future__ import annotations

import math

from .errors import ModelLoadError

MAX_LAYERS = 4096  # the deepest released models have ~130 layers
# The largest released vocabularies are ~262k tokens; a vocab_size of 1e12 took 43 s to be refused further on.
MAX_VOCAB = 2**24
_POSITIVE_INTS = (
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "original_max_position_embeddings",
    "num_experts",  # Qwen3-MoE
    "num_local_experts",  # Mixtral, gpt-oss
    "num_experts_per_tok",
    "moe_intermediate_size",
    "decoder_sparse_step",
)
_POSITIVE_FLOATS = ("rms_norm_eps", "layer_norm_eps", "rope_theta", "factor")
_NON_NEGATIVE_FLOATS = ("final_logit_softcapping", "attn_logit_softcapping")  # 0 = no soft-capping


def is_int(value) -> bool:
    """True for a real integer (bool is an int to Python, never to a config)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_config(config: dict, source: str, names: dict[str, str] | None = None) -> None:
    """Raise a ModelLoadError naming the key (as spelled in the file, via `names`) of the first bad number."""

    def bad(key: str, value, want: str):
        return ModelLoadError(
            f"{source}: {(names or {}).get(key, key)} = {value!r} is not {want}; "
            "the model file is corrupt or hand-edited: fix the value or re-download the model"
        )

    for key in _POSITIVE_INTS:
        value = config.get(key)
        if value is not None and (not is_int(value) or value < 1):
            raise bad(key, value, "a positive integer")
    layers = config.get("num_hidden_layers")
    if layers is not None and layers > MAX_LAYERS:
        raise bad("num_hidden_layers", layers, f"a plausible layer count (at most {MAX_LAYERS})")
    vocab = config.get("vocab_size")
    if vocab is not None and vocab > MAX_VOCAB:
        raise bad("vocab_size", vocab, f"a plausible vocabulary size (at most {MAX_VOCAB})")
    window = config.get("sliding_window")
    if window is not None and (not is_int(window) or window < 0):
        raise bad("sliding_window", window, "a non-negative integer")
    for keys, least, want in (
        (_POSITIVE_FLOATS, 0, "a finite positive number"),
        (_NON_NEGATIVE_FLOATS, None, "a finite non-negative number"),
    ):
        for key in keys:
            value = config.get(key)
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value < 0
                or value == least
            ):
                raise bad(key, value, want)
    experts, top_k = config.get("num_experts") or config.get("num_local_experts"), config.get("num_experts_per_tok")
    if experts is not None and top_k is not None and top_k > experts:
        raise bad("num_experts_per_tok", top_k, f"at most the expert count ({experts})")
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise bad("num_key_value_heads", kv_heads, f"a divisor of the {heads} attention heads")
