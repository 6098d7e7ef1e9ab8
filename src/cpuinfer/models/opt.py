"""OPT (facebook/opt-*, vLLM's example model): learned positions (offset 2), LayerNorm, ReLU MLP, biases."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import ops
from ..attention import AttentionMetadata
from ..model_loader.errors import ModelLoadError
from .executor import attention, row_parallel
from .layers import WeightBag, attention_plan, select_rows, stage_head, stage_layer_ids

_ACTS = {"relu": F.relu, "gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh")}
POSITION_OFFSET = 2  # OPT's learned position table starts at index 2 (a fairseq padding leftover)


class OPTForCausalLM:
    """OPT decoder (pre- or post-LayerNorm variants, optional project_in/out)."""

    def __init__(self, config: dict, bag: WeightBag, max_positions: int, rope_freq_factors=None):  # noqa: ARG002 - the registry's one signature
        # Some checkpoints (facebook/opt-*) name tensors "decoder.*" instead of "model.decoder.*".
        for name in [n for n in bag.tensors if n.startswith("decoder.")]:
            bag.tensors["model." + name] = bag.tensors.pop(name)
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        hs = hidden // heads
        bias = bool(config.get("enable_bias", True))
        affine = bool(config.get("layer_norm_elementwise_affine", True))
        self.pre_norm = bool(config.get("do_layer_norm_before", True))
        act = config.get("activation_function", "relu")
        if act not in _ACTS:
            raise ModelLoadError(f"OPT activation {act!r} is not supported; supported: {', '.join(_ACTS)}")
        self.act = _ACTS[act]
        self.hidden = hidden
        p = "model.decoder"
        self.tp = tp = bag.tp
        self.stage = pp = bag.pp
        self.carry_shape = (1, hidden)  # the residual stream, between pipeline stages
        if not pp.first:  # the token and position embeddings (and project_in) run on the first stage only
            for name in ("embed_positions.weight", "project_in.weight"):
                bag.tensors.pop(f"{p}.{name}", None)
        if not pp.last:
            bag.tensors.pop(f"{p}.project_out.weight", None)
        self.pos_embed = bag.take(f"{p}.embed_positions.weight") if pp.first else None
        self.project_in = bag.take_opt(f"{p}.project_in.weight")
        self.project_out = bag.take_opt(f"{p}.project_out.weight")

        def ln(prefix):
            return (bag.take(f"{prefix}.weight") if affine else None, bag.take(f"{prefix}.bias") if affine else None)

        self.layers = []
        for i in stage_layer_ids(bag, config["num_hidden_layers"], f"{p}.layers.{{}}"):
            lp = f"{p}.layers.{i}"
            layer = _OPTLayer()
            layer.attn_ln = ln(f"{lp}.self_attn_layer_norm")
            layer.ff_ln = ln(f"{lp}.final_layer_norm")
            layer.attn = attention_plan(
                bag,
                f"{lp}.self_attn",
                heads,
                heads,
                hs,
                None,
                hs**-0.5,
                bias=bias,
                o_bias=bias,
                names=("q_proj", "k_proj", "v_proj", "out_proj"),
            )
            # fc1 column-parallel, fc2 row-parallel (its bias added once, by rank 0, before the all-reduce)
            f0, fn = tp.share(bag.tensors[f"{lp}.fc2.weight"].shape[1])
            layer.fc1_w = bag.take_shard(f"{lp}.fc1.weight", 0, f0, fn)
            layer.fc1_b = bag.take_shard(f"{lp}.fc1.bias", 0, f0, fn) if bag.has(f"{lp}.fc1.bias") else None
            layer.fc2_w = bag.take_shard(f"{lp}.fc2.weight", 1, f0, fn)
            layer.fc2_b = bag.take_opt(f"{lp}.fc2.bias")
            if tp.rank > 0:
                layer.fc2_b = None
            self.layers.append(layer)
        has_final = self.pre_norm and not config.get("_remove_final_layer_norm", False)
        if not pp.last:
            bag.drop(f"{p}.final_layer_norm.")
        self.final_ln = ln(f"{p}.final_layer_norm") if has_final and pp.last else None
        tied = config.get("tie_word_embeddings", True)
        self.head = stage_head(bag, f"{p}.embed_tokens.weight", "lm_head.weight", tied)

    def _ln(self, x: torch.Tensor, wb) -> torch.Tensor:
        return F.layer_norm(x, (self.hidden,), wb[0], wb[1], 1e-5)

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

        On a pipeline stage: carry is the previous stage's (h,) (None on the first stage), and a stage before
        the last returns its (h,) of every token for the next."""
        if carry is None:
            h = self.head.embed_tokens(input_ids)
            if self.project_in is not None:
                h = ops.linear(h, self.project_in)
            h = h + F.embedding(positions + POSITION_OFFSET, self.pos_embed)
        else:
            (h,) = carry
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x = self._ln(h, layer.attn_ln) if self.pre_norm else h
            h = h + attention(layer.attn, False, self.tp, x, positions, meta, kv)
            if not self.pre_norm:
                h = self._ln(h, layer.attn_ln)
            x = self._ln(h, layer.ff_ln) if self.pre_norm else h
            h = h + row_parallel(self.tp, self.act(ops.linear(x, layer.fc1_w, layer.fc1_b)), layer.fc2_w, layer.fc2_b)
            if not self.pre_norm:
                h = self._ln(h, layer.ff_ln)
        if not self.stage.last:
            return (h,)
        h = select_rows(h, sample_idx)
        if self.final_ln is not None:
            h = self._ln(h, self.final_ln)
        if self.project_out is not None:
            h = ops.linear(h, self.project_out)
        return self.head.logits(h)


class _OPTLayer:
    __slots__ = ("attn", "attn_ln", "fc1_b", "fc1_w", "fc2_b", "fc2_w", "ff_ln")
