"""cos/sin tables for rotary embeddings, with the RoPE scaling variants our model families use.

The table layout is vLLM's (and ops.rotary_embedding's): [max_positions, rot_dim] float32,
first half cos, second half sin.
"""

from __future__ import annotations

import math

import torch

from ..model_loader.errors import ModelLoadError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")


def rope_parameters(config: dict, layer_type: str | None = None) -> dict:
    """The rope settings (rope_theta, rope_type, scaling fields) for a layer type, from either config spelling.

    transformers 5 writes ``rope_parameters`` (per layer type for Gemma 3); older checkpoints write
    ``rope_theta`` + ``rope_scaling`` (+ ``rope_local_base_freq`` for Gemma 3 local layers).
    """
    params = config.get("rope_parameters")
    if isinstance(params, dict) and params:
        if layer_type is not None and layer_type in params and isinstance(params[layer_type], dict):
            params = params[layer_type]
        elif "full_attention" in params and isinstance(params["full_attention"], dict):
            params = params["full_attention"]
        out = dict(params)
    else:
        out = dict(config.get("rope_scaling") or {})
        out["rope_theta"] = config.get("rope_theta", 10000.0)
        if layer_type == "sliding_attention" and "rope_local_base_freq" in config:
            out = {"rope_theta": config["rope_local_base_freq"]}
    out["rope_type"] = out.get("rope_type", out.get("type", "default")) or "default"
    out.setdefault("rope_theta", 10000.0)
    if out["rope_type"] == "longrope":  # Phi-3: the model's declared and original contexts set the scaling
        out.setdefault("original_max_position_embeddings", config.get("original_max_position_embeddings"))
        out["max_position_embeddings"] = config.get("max_position_embeddings")
        if not out["original_max_position_embeddings"] or "short_factor" not in out or "long_factor" not in out:
            raise ModelLoadError(
                "longrope scaling needs original_max_position_embeddings, short_factor and long_factor in the config"
            )
    if out["rope_type"] == "yarn" and not out.get("original_max_position_embeddings"):
        # From the model's declared context, not the table length: that follows --max-model-len.
        factor = float(out.get("factor", 1.0) or 1.0)
        out["original_max_position_embeddings"] = (config.get("max_position_embeddings") or 2048) / factor
    return out


def rotary_dim(config: dict, head_size: int) -> int:
    """Features of each head that rotate (partial_rotary_factor: Phi-4-mini rotates 3/4 of each head)."""
    params = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
    factor = float(params.get("partial_rotary_factor") or config.get("partial_rotary_factor") or 1.0)
    dim = int(head_size * factor)
    if dim % 2 or not 0 < dim <= head_size:
        raise ModelLoadError(f"partial_rotary_factor = {factor} gives {dim} rotary features of {head_size}")
    return dim


def _inv_freq(params: dict, rot_dim: int) -> tuple[torch.Tensor, float]:
    base = float(params["rope_theta"])
    # float32 like transformers, so float32 runs match its tables bit for bit.
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    rope_type = params["rope_type"]
    factor = float(params.get("factor", 1.0) or 1.0)
    attention_factor = 1.0
    if rope_type in ("default", "dynamic"):
        # Dynamic NTK only changes anything beyond the original context length, which we do not extend.
        pass
    elif rope_type == "linear":
        inv_freq = inv_freq / factor
    elif rope_type == "llama3":
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif rope_type == "longrope":  # the short factors here; cos_sin_cache switches to the long ones past old_len
        inv_freq = _longrope_inv_freq(params, "short_factor", rot_dim)
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            old_len = float(params["original_max_position_embeddings"])
            factor = float(params.get("max_position_embeddings") or old_len) / old_len
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    elif rope_type == "yarn":
        old_len = float(params["original_max_position_embeddings"])
        beta_fast, beta_slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)
        mscale = lambda s, m=1.0: 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0  # noqa: E731
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            if params.get("mscale") and params.get("mscale_all_dim"):
                attention_factor = mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
            else:
                attention_factor = mscale(factor)

        def correction(n_rot):
            return (rot_dim * math.log(old_len / (n_rot * 2 * math.pi))) / (2 * math.log(base))

        low = correction(beta_fast)
        high = correction(beta_slow)
        if params.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, rot_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(rot_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        inv_freq = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    else:
        raise ModelLoadError(f"RoPE scaling type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    return inv_freq, float(attention_factor)


def cos_sin_cache(
    params: dict, rot_dim: int, max_positions: int, freq_factors: torch.Tensor | None = None
) -> torch.Tensor:
    """[max_positions, rot_dim] float32 table (cos | sin) for ops.rotary_embedding.

    max_positions is the engine's effective max_model_len, never the file's declared context: a model may
    declare 2**31 positions, which would be a 512 GiB table at rot_dim 64.
    """
    inv_freq, attention_factor = _inv_freq(params, rot_dim)
    if freq_factors is not None:  # llama.cpp stores llama3 scaling as per-frequency divisors (rope_freqs.weight)
        if freq_factors.shape != inv_freq.shape:
            raise ModelLoadError(
                f"rope_freqs.weight has {freq_factors.numel()} factors, but the rotary dimension "
                f"{rot_dim} has {inv_freq.numel()} frequencies; re-convert the model file"
            )
        inv_freq = inv_freq / freq_factors.float()
    if params["rope_type"] == "longrope" and max_positions > int(params["original_max_position_embeddings"]):
        # A context past the original one takes the long factors at every position, as llama.cpp decides by
        # its context size (transformers switches a sequence once it outgrows the original context, so its
        # keys depend on how the sequence was chunked; vLLM picks per position).
        inv_freq = _longrope_inv_freq(params, "long_factor", rot_dim)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    cache = torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1)
    return cache.contiguous()


def _longrope_inv_freq(params: dict, key: str, rot_dim: int) -> torch.Tensor:
    """LongRoPE's frequencies with the divisors under key (rot_dim / 2 of them), computed as transformers does."""
    factors = torch.tensor(params[key], dtype=torch.float32)
    if factors.shape != (rot_dim // 2,):
        raise ModelLoadError(
            f"longrope {key} has {factors.numel()} entries; the rotary dimension {rot_dim} needs {rot_dim // 2}"
        )
    exponent = torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim
    return 1.0 / (factors * float(params["rope_theta"]) ** exponent)
