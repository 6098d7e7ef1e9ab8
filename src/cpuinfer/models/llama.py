"""Llama-family decoders: Llama 2/3, Mistral, SmolLM2, Qwen2 (q/k/v bias), Qwen3 (q/k RMS norm)."""

from __future__ import annotations

import torch

from .. import ops
from ..attention import AttentionMetadata
from .config_utils import head_dim, sliding_windows
from .layers import (
    Attention,
    GatedMLP,
    WeightBag,
    final_rows,
    finish_layer,
    input_norm,
    norm_weight,
    stage_head,
    stage_layer_ids,
    stage_norm,
    stage_stack,
)
from .rotary import cos_sin_cache, rope_parameters


class LlamaForCausalLM:
    """Pre-norm decoder with RMSNorm, rotary attention (GQA) and a SiLU-gated MLP."""

    qkv_bias_default = False
    qk_norm = False

    def __init__(self, config: dict, bag: WeightBag, max_positions: int, rope_freq_factors: torch.Tensor | None = None):
        self.config = config
        n_layers = config["num_hidden_layers"]
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        heads, kv_heads, hs = (
            config["num_attention_heads"],
            config.get("num_key_value_heads") or config["num_attention_heads"],
            head_dim(config),
        )
        qkv_bias = bool(config.get("attention_bias", self.qkv_bias_default))
        o_bias = bool(config.get("attention_bias", False))
        mlp_bias = bool(config.get("mlp_bias", False))
        cos_sin = cos_sin_cache(rope_parameters(config), hs, max_positions, rope_freq_factors)
        windows = sliding_windows(config, n_layers)
        self.stage = bag.pp
        self.carry_shape = (2, int(config["hidden_size"]))  # h and the residual stream, between pipeline stages
        self.layers = []
        for i in stage_layer_ids(bag, n_layers, "model.layers.{}"):
            p = f"model.layers.{i}"
            layer = _Layer()
            layer.in_norm = norm_weight(bag, f"{p}.input_layernorm.weight")
            layer.post_norm = norm_weight(bag, f"{p}.post_attention_layernorm.weight")
            layer.attn = Attention(
                bag,
                f"{p}.self_attn",
                heads,
                kv_heads,
                hs,
                cos_sin,
                hs**-0.5,
                bias=qkv_bias,
                o_bias=o_bias,
                qk_norm=self.qk_norm,
                norm_eps=self.eps,
                sliding_window=windows[i],
            )
            layer.mlp = GatedMLP(bag, f"{p}.mlp", config.get("hidden_act", "silu"), bias=mlp_bias)
            finish_layer(layer, self.eps)
            self.layers.append(layer)
        self.norm = stage_norm(bag, "model.norm.weight")
        tied = config.get("tie_word_embeddings", False)
        self.head = stage_head(bag, "model.embed_tokens.weight", "lm_head.weight", tied)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        sample_idx: torch.Tensor | None,
        carry: tuple[torch.Tensor, ...] | None = None,
    ):
        """float32 logits for the tokens at sample_idx (all tokens when None).

        On a pipeline stage: carry is the previous stage's (h, residual) (None on the first stage), and a stage
        before the last returns its (h, residual) of every token for the next."""
        h, residual = (self.head.embed_tokens(input_ids), None) if carry is None else carry

        def per_op(layer, h, residual, kv):
            h, residual = input_norm(h, residual, layer.in_norm, self.eps)
            h = layer.attn(h, positions, meta, kv)
            ops.fused_add_rms_norm(h, residual, layer.post_norm, self.eps)
            return layer.mlp(h), residual

        keep = sample_idx if self.stage.last else None  # a stage before the last hands on every row
        h, residual, rows = stage_stack(self.layers, h, residual, positions, meta, kv_caches, per_op, keep)
        if not self.stage.last:
            return h, residual
        return self.head.logits(final_rows(h, residual, rows, self.norm, self.eps))


class _Layer:
    __slots__ = ("attn", "fused", "in_norm", "mlp", "post_ff_norm", "post_norm", "pre_ff_norm")


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama with an optional sliding window on every layer."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with biases on q/k/v (not o); its config has no attention_bias key."""

    qkv_bias_default = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama with per-head RMS norm on q and k before rotary."""

    qk_norm = True
