"""Gemma 3 (text): sandwich norms with (1 + w), GELU-tanh gating, q/k norm, scaled embeddings,
sliding-window local layers with their own rope base, optional attention / final logit soft-caps."""

from __future__ import annotations

import torch

from .. import ops
from ..attention import AttentionMetadata
from .config_utils import head_dim, layer_types
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
from .llama import _Layer
from .rotary import cos_sin_cache, rope_parameters


class Gemma3ForCausalLM:
    """Gemma 3 text decoder."""

    def __init__(self, config: dict, bag: WeightBag, max_positions: int, rope_freq_factors=None):  # noqa: ARG002 - the registry's one signature
        n_layers = config["num_hidden_layers"]
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        heads = config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads") or heads
        hs = head_dim(config)
        scale = float(config.get("query_pre_attn_scalar") or hs) ** -0.5
        soft_cap = float(config.get("attn_logit_softcapping") or 0.0)
        self.final_soft_cap = float(config.get("final_logit_softcapping") or 0.0)
        window = int(config.get("sliding_window") or 0)
        types = layer_types(config, n_layers)
        tables = {t: cos_sin_cache(rope_parameters(config, t), hs, max_positions) for t in set(types)}
        bias = bool(config.get("attention_bias", False))
        # transformers multiplies by sqrt(hidden) cast to the run dtype; do the same so bf16 matches.
        self.embed_scale = torch.tensor(config["hidden_size"] ** 0.5, dtype=bag.dtype)
        self.stage = bag.pp
        self.carry_shape = (2, int(config["hidden_size"]))  # h and the residual stream, between pipeline stages
        self.layers = []
        for i in stage_layer_ids(bag, n_layers, "model.layers.{}"):
            kind = types[i]
            p = f"model.layers.{i}"
            layer = _Layer()
            layer.in_norm = norm_weight(bag, f"{p}.input_layernorm.weight", 1.0)
            layer.post_norm = norm_weight(bag, f"{p}.post_attention_layernorm.weight", 1.0)
            layer.pre_ff_norm = norm_weight(bag, f"{p}.pre_feedforward_layernorm.weight", 1.0)
            layer.post_ff_norm = norm_weight(bag, f"{p}.post_feedforward_layernorm.weight", 1.0)
            layer.attn = Attention(
                bag,
                f"{p}.self_attn",
                heads,
                kv_heads,
                hs,
                tables[kind],
                scale,
                bias=bias,
                o_bias=bias,
                qk_norm=True,
                norm_eps=self.eps,
                norm_offset=1.0,
                sliding_window=window if kind == "sliding_attention" else 0,
                soft_cap=soft_cap,
            )
            layer.mlp = GatedMLP(bag, f"{p}.mlp", config.get("hidden_activation") or "gelu_pytorch_tanh")
            finish_layer(layer, self.eps)
            self.layers.append(layer)
        self.norm = stage_norm(bag, "model.norm.weight", 1.0)
        tied = config.get("tie_word_embeddings", True)
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
        """float32 logits for the tokens at sample_idx (all tokens when None); on a pipeline stage, carry and the
        result of a stage before the last are (h, residual), as LlamaForCausalLM.forward's."""
        if carry is None:
            h, residual = self.head.embed_tokens(input_ids) * self.embed_scale, None
        else:
            h, residual = carry

        def per_op(layer, h, residual, kv):
            h, residual = input_norm(h, residual, layer.in_norm, self.eps)
            h = layer.attn(h, positions, meta, kv)
            h = ops.rms_norm(h, layer.post_norm, self.eps, out=h)
            ops.fused_add_rms_norm(h, residual, layer.pre_ff_norm, self.eps)
            h = layer.mlp(h)
            return ops.rms_norm(h, layer.post_ff_norm, self.eps, out=h), residual

        keep = sample_idx if self.stage.last else None  # a stage before the last hands on every row
        h, residual, rows = stage_stack(self.layers, h, residual, positions, meta, kv_caches, per_op, keep)
        if not self.stage.last:
            return h, residual
        logits = self.head.logits(final_rows(h, residual, rows, self.norm, self.eps))
        if self.final_soft_cap > 0.0:
            logits = torch.tanh(logits / self.final_soft_cap) * self.final_soft_cap
        return logits
