"""Llama-family decoders: Llama 2/3, Mistral, SmolLM2, Qwen2 (q/k/v bias), Qwen3 (q/k RMS norm)."""

from __future__ import annotations

import torch

from .classifier import ClassifierHead, from_2_way_softmax
from .config_utils import head_dim, sliding_windows
from .decoder import DecoderModel
from .layers import WeightBag, attention_plan, dense_mlp_plan, norm_weight
from .plan import AttentionPlan, DenseMLP, LayerPlan, MoEMLP
from .rotary import cos_sin_cache, rope_parameters, rotary_dim


class LlamaForCausalLM(DecoderModel):
    """Pre-norm decoder with RMSNorm, rotary attention (GQA) and a SiLU-gated MLP."""

    qkv_bias_default = False
    qk_norm = False

    def __init__(self, config: dict, bag: WeightBag, max_positions: int, rope_freq_factors: torch.Tensor | None = None):
        n_layers = int(config["num_hidden_layers"])
        self.heads = config["num_attention_heads"]
        self.kv_heads = config.get("num_key_value_heads") or self.heads
        self.head_size = head_dim(config)
        self.cos_sin = cos_sin_cache(
            rope_parameters(config), rotary_dim(config, self.head_size), max_positions, rope_freq_factors
        )
        self.windows = sliding_windows(config, n_layers)
        super().__init__(config, bag, float(config.get("rms_norm_eps", 1e-6)))

    def layer_plan(self, bag: WeightBag, i: int) -> LayerPlan:
        """Layer i: RMSNorm, attention, RMSNorm, MLP."""
        p = f"model.layers.{i}"
        return LayerPlan(
            in_norm=norm_weight(bag, f"{p}.input_layernorm.weight"),
            post_attn_norm=norm_weight(bag, f"{p}.post_attention_layernorm.weight"),
            attn=self.attention(bag, p, i),
            mlp=self.mlp(bag, p, i),
            eps=self.eps,
        )

    def attention(self, bag: WeightBag, p: str, i: int, **extra) -> AttentionPlan:
        """Layer i's attention (rotary, GQA, the family's biases and q/k norm, its sliding window); extra:
        attention_plan's keywords a family adds (Phi-3's fused_qkv)."""
        config = self.config
        return attention_plan(
            bag,
            f"{p}.self_attn",
            self.heads,
            self.kv_heads,
            self.head_size,
            self.cos_sin,
            self.head_size**-0.5,
            bias=bool(config.get("attention_bias", self.qkv_bias_default)),
            o_bias=bool(config.get("attention_bias", False)),
            qk_norm=self.qk_norm,
            sliding_window=self.windows[i],
            **extra,
        )

    def mlp(self, bag: WeightBag, p: str, i: int, **extra) -> DenseMLP | MoEMLP:  # noqa: ARG002 - MoE families choose by i
        """Layer i's MLP: a gated dense one; extra: dense_mlp_plan's keywords a family adds (Phi-3's
        fused_gate_up)."""
        c = self.config
        return dense_mlp_plan(
            bag, f"{p}.mlp", c.get("hidden_act", "silu"), bias=bool(c.get("mlp_bias", False)), **extra
        )


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama with an optional sliding window on every layer."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with biases on q/k/v (not o); its config has no attention_bias key."""

    qkv_bias_default = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama with per-head RMS norm on q and k before rotary."""

    qk_norm = True


class Qwen3ForSequenceClassification(Qwen3ForCausalLM):
    """Qwen3 rerankers as vLLM serves them: the decoder, its last token's final hidden state through a linear
    `score`. A Qwen3ForSequenceClassification checkpoint has score.weight; the original Qwen3-Reranker (a causal LM
    served with hf_overrides classifier_from_token ["no", "yes"] and is_original_qwen3_reranker) gets its from
    the language-model head's rows of those tokens: yes minus no (one label: sigmoid of it is the softmax of the
    two logits' yes), or each token's row (method no_post_processing)."""

    def __init__(self, config: dict, bag: WeightBag, max_positions: int, rope_freq_factors: torch.Tensor | None = None):
        self.classifier = ClassifierHead(self._score_weight(config, bag))
        super().__init__(config, bag, max_positions, rope_freq_factors)

    @staticmethod
    def _score_weight(config: dict, bag: WeightBag) -> torch.Tensor:
        ids = config.get("classifier_from_token_ids")
        if ids is None:
            return bag.take("score.weight", torch.float32)
        tied = config.get("tie_word_embeddings", False) or not bag.has("lm_head.weight")
        head = bag.tensors["model.embed_tokens.weight" if tied else "lm_head.weight"]
        rows = head[ids].float()
        if not tied:
            bag.tensors.pop("lm_head.weight")  # no logits are ever asked of a classifier
        return rows[1:2] - rows[0:1] if from_2_way_softmax(config) else rows
