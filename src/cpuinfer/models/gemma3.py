"""Gemma 2 and 3 (text): sandwich norms with (1 + w), GELU-tanh gating, scaled embeddings, alternating
sliding-window layers, attention and final logit soft-caps; Gemma 3 adds q/k norm and a rope base per
layer type."""

from __future__ import annotations

import torch

from .config_utils import head_dim, layer_types
from .decoder import DecoderModel
from .layers import WeightBag, attention_plan, dense_mlp_plan, norm_weight
from .plan import LayerPlan
from .rotary import cos_sin_cache, rope_parameters


class Gemma3ForCausalLM(DecoderModel):
    """Gemma 3 text decoder."""

    tied_default = True
    norm_offset = 1.0
    qk_norm = True

    def __init__(self, config: dict, bag: WeightBag, max_positions: int, rope_freq_factors=None):  # noqa: ARG002 - the registry's one signature
        n_layers = int(config["num_hidden_layers"])
        self.heads = config["num_attention_heads"]
        self.kv_heads = config.get("num_key_value_heads") or self.heads
        self.head_size = hs = head_dim(config)
        self.scale = float(config.get("query_pre_attn_scalar") or hs) ** -0.5
        self.soft_cap = float(config.get("attn_logit_softcapping") or 0.0)
        self.final_soft_cap = float(config.get("final_logit_softcapping") or 0.0)
        self.window = int(config.get("sliding_window") or 0)
        self.types = layer_types(config, n_layers)
        self.tables = {t: cos_sin_cache(self.rope(config, t), hs, max_positions) for t in set(self.types)}
        # transformers multiplies by sqrt(hidden) cast to the run dtype; do the same so bf16 matches.
        self.embed_scale = torch.tensor(config["hidden_size"] ** 0.5, dtype=bag.dtype)
        super().__init__(config, bag, float(config.get("rms_norm_eps", 1e-6)))

    @staticmethod
    def rope(config: dict, layer_type: str) -> dict:
        """The rope settings of a layer type (Gemma 3: local layers have their own base)."""
        return rope_parameters(config, layer_type)

    def layer_plan(self, bag: WeightBag, i: int) -> LayerPlan:
        """Layer i: (1 + w) RMSNorms around both blocks (the sandwich), attention, GELU-tanh MLP."""
        p, kind = f"model.layers.{i}", self.types[i]
        bias = bool(self.config.get("attention_bias", False))
        return LayerPlan(
            in_norm=norm_weight(bag, f"{p}.input_layernorm.weight", 1.0),
            post_attn_norm=norm_weight(bag, f"{p}.post_attention_layernorm.weight", 1.0),
            pre_ff_norm=norm_weight(bag, f"{p}.pre_feedforward_layernorm.weight", 1.0),
            post_ff_norm=norm_weight(bag, f"{p}.post_feedforward_layernorm.weight", 1.0),
            attn=attention_plan(
                bag,
                f"{p}.self_attn",
                self.heads,
                self.kv_heads,
                self.head_size,
                self.tables[kind],
                self.scale,
                bias=bias,
                o_bias=bias,
                qk_norm=self.qk_norm,
                norm_offset=1.0,
                sliding_window=self.window if kind == "sliding_attention" else 0,
                soft_cap=self.soft_cap,
            ),
            mlp=dense_mlp_plan(bag, f"{p}.mlp", self.config.get("hidden_activation") or "gelu_pytorch_tanh"),
            eps=self.eps,
        )


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2: Gemma 3's layer without q/k norm, one rope base, every other layer sliding (from layer 0)."""

    qk_norm = False

    @staticmethod
    def rope(config: dict, layer_type: str) -> dict:  # noqa: ARG004 - one base for both layer types
        """One rope setting for every layer."""
        return rope_parameters(config)
