"""Reading the per-architecture facts the models need out of a Hugging Face style config dict."""

from __future__ import annotations

from ..model_loader.errors import ModelLoadError


def head_dim(config: dict) -> int:
    """Attention head size (explicit head_dim, else hidden_size / num_attention_heads)."""
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def layer_types(config: dict, num_layers: int) -> list[str]:
    """'sliding_attention' or 'full_attention' per layer, following transformers' rules per family."""
    types = config.get("layer_types")
    if types:
        if len(types) != num_layers:
            raise ModelLoadError(f"config layer_types has {len(types)} entries for {num_layers} layers")
        return list(types)
    model_type = config.get("model_type", "")
    window = config.get("sliding_window")
    if model_type.startswith("gemma3"):
        pattern = int(config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6)
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if model_type == "gemma2":  # every other layer, from the first
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    if model_type == "qwen2":
        if not config.get("use_sliding_window") or window is None:
            return ["full_attention"] * num_layers
        first = int(config.get("max_window_layers", num_layers))
        return ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if model_type == "mistral" and window:
        return ["sliding_attention"] * num_layers
    return ["full_attention"] * num_layers


def sliding_windows(config: dict, num_layers: int) -> list[int]:
    """Per-layer sliding window in tokens (0 = full attention)."""
    window = int(config.get("sliding_window") or 0)
    return [window if t == "sliding_attention" else 0 for t in layer_types(config, num_layers)]
