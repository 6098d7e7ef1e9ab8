"""Architecture name (config.json "architectures") -> model class, and the shapes the engine needs."""

from __future__ import annotations

import importlib

import torch

from ..model_loader.errors import ModelLoadError
from .config_utils import head_dim, sliding_windows

# architecture -> (module, class)
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "Qwen3ForCausalLM"),
    "Qwen3ForSequenceClassification": ("llama", "Qwen3ForSequenceClassification"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Gemma2ForCausalLM": ("gemma3", "Gemma2ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("moe", "MixtralForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
    "OPTForCausalLM": ("opt", "OPTForCausalLM"),
    "BertModel": ("bert", "BertModel"),
    "XLMRobertaModel": ("bert", "BertModel"),
    "BertForSequenceClassification": ("bert", "BertForSequenceClassification"),
    "XLMRobertaForSequenceClassification": ("bert", "BertForSequenceClassification"),
}
# Encoders: bidirectional attention over whole prompts, no KV cache; they serve the pooling runner only.
ENCODERS = frozenset(
    {"BertModel", "XLMRobertaModel", "BertForSequenceClassification", "XLMRobertaForSequenceClassification"}
)


def causal_lm_of_base_model(architecture: str) -> str | None:
    """The ForCausalLM architecture whose decoder a base-model checkpoint holds (Qwen3Model -> Qwen3ForCausalLM,
    Gemma3TextModel -> Gemma3ForCausalLM), or None when the name is not such a base model of ours."""
    if not architecture.endswith("Model"):
        return None
    stem = architecture.removesuffix("Model").removesuffix("Text")
    causal = f"{stem}ForCausalLM"
    return causal if causal in ARCHITECTURES else None


def check_supported(architecture: str, source: str) -> None:
    """Raise a clear error for an architecture we have no implementation of."""
    if architecture not in ARCHITECTURES:
        raise ModelLoadError(
            f"{source}: architecture {architecture!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )


def describe(architecture: str, config: dict, source: str) -> dict:
    """num_layers, num_kv_heads, head_size, sliding_window_layers, vocab_size, max_model_len for ModelSpec."""
    check_supported(architecture, source)
    try:
        n_layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        if architecture == "OPTForCausalLM" or architecture in ENCODERS:
            kv_heads, hs, windows = heads, int(config["hidden_size"]) // heads, [0] * n_layers
        else:
            kv_heads = int(config.get("num_key_value_heads") or heads)
            hs, windows = head_dim(config), sliding_windows(config, n_layers)
        vocab, max_len = int(config["vocab_size"]), int(config.get("max_position_embeddings") or 2048)
        if architecture in ENCODERS:
            from .bert import position_offset

            max_len -= position_offset(config)  # RoBERTa's first positions are padding_idx + 1 on
    except KeyError as e:
        raise ModelLoadError(f"{source}: config lacks {e.args[0]!r}, needed for {architecture}") from None
    return dict(
        num_layers=n_layers,
        num_kv_heads=kv_heads,
        head_size=hs,
        sliding_window_layers=windows,
        vocab_size=vocab,
        max_model_len=max_len,
    )


def build_model(spec, tensors: dict[str, torch.Tensor], extras: dict, tp=None, pp=None):
    """Instantiate the model class for spec from its loaded tensors (consumed), checking nothing is left over.

    tp (distributed.tensor_parallel.TPGroup): the tensor-parallel rank whose share of the weights to keep;
    pp (distributed.pipeline.PPStage): the pipeline stage whose layers to keep (the others are dropped)."""
    from ..distributed.pipeline import SINGLE_STAGE
    from ..distributed.tensor_parallel import SINGLE
    from .layers import WeightBag

    check_supported(spec.architecture, spec.path)
    module, name = ARCHITECTURES[spec.architecture]
    cls = getattr(importlib.import_module(f"{__package__}.{module}"), name)
    bag = WeightBag(tensors, spec.dtype, spec.path, tp or SINGLE, pp or SINGLE_STAGE)
    try:
        model = cls(spec.hf_config, bag, spec.max_model_len, extras.get("rope_freq_factors"))
    except ModelLoadError as e:  # every load error names the file (some checks deep in a builder cannot)
        if spec.path in str(e):
            raise
        raise ModelLoadError(f"{spec.path}: {e}") from None
    leftover = [n for n in bag.tensors if not n.endswith("rotary_emb.inv_freq")]
    if leftover:
        raise ModelLoadError(
            f"{spec.path}: {len(leftover)} checkpoint tensor(s) were not used by {spec.architecture}, "
            f"e.g. {', '.join(sorted(leftover)[:5])}; the config and weights do not match"
        )
    return model
