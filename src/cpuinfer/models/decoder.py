"""The pre-norm decoder every plan-built architecture runs: embeddings, its layers' executors, final norm, head.

An architecture (llama.py, gemma.py, moe.py, phi3.py) only builds: it reads its config and checkpoint into
one LayerPlan per layer (models/plan.py) and sets the few model-level fields below (embedding scale, final
logit soft-cap). The forward is this one, for all of them.
"""

from __future__ import annotations

import torch

from .. import ops
from ..attention import AttentionMetadata
from ..attention.backend import uses_kernels
from .executor import Layer
from .layers import TokenHead, WeightBag, select_rows, stage_head, stage_layer_ids, stage_norm
from .plan import LayerPlan


class DecoderModel:
    """Pre-norm decoder over a list of layer plans (this pipeline stage's), with a residual stream."""

    embed_scale: torch.Tensor | None = None  # Gemma: embeddings times sqrt(hidden), in the run dtype
    final_soft_cap: float = 0.0  # Gemma 2/3: logits -> cap * tanh(logits / cap)
    tied_default = False  # tie_word_embeddings when the config does not say
    norm_offset = 0.0  # Gemma: the final norm's weight is (1 + w)

    def __init__(self, config: dict, bag: WeightBag, eps: float):
        self.config = config
        self.eps = eps
        self.stage = bag.pp
        self.carry_shape = (2, int(config["hidden_size"]))  # h and the residual stream, between pipeline stages
        n_layers = int(config["num_hidden_layers"])
        self.layers = [
            Layer(self.layer_plan(bag, i), bag.tp) for i in stage_layer_ids(bag, n_layers, "model.layers.{}")
        ]
        self.stack = fused_stack(self.layers)
        self.norm = stage_norm(bag, "model.norm.weight", self.norm_offset)
        tied = config.get("tie_word_embeddings", self.tied_default)
        self.head: TokenHead | None = stage_head(bag, "model.embed_tokens.weight", "lm_head.weight", tied)

    def layer_plan(self, bag: WeightBag, i: int) -> LayerPlan:
        """Layer i's plan, from its config and weights (each architecture's one job)."""
        raise NotImplementedError

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        sample_idx: torch.Tensor | None,
        carry: tuple[torch.Tensor, ...] | None = None,
        hidden: bool = False,
    ):
        """float32 logits for the tokens at sample_idx (all tokens when None); with hidden, the final-normed
        hidden states of those rows instead (a pooling model's output, in the run dtype: no head runs).

        On a pipeline stage: carry is the previous stage's (h, residual) (None on the first stage), and a stage
        before the last returns its (h, residual) of every token for the next."""
        if carry is None:
            h, residual = self.head.embed_tokens(input_ids), None
            if self.embed_scale is not None:
                h = h * self.embed_scale
        else:
            h, residual = carry
        keep = sample_idx if self.stage.last else None  # a stage before the last hands on every row
        h, residual, rows = stage_stack(self.layers, h, residual, positions, meta, kv_caches, keep, self.stack)
        if not self.stage.last:
            return h, residual
        h = final_rows(h, residual, rows, self.norm, self.eps)
        if hidden:
            return h
        logits = self.head.logits(h)
        if self.final_soft_cap > 0.0:
            logits = torch.tanh(logits / self.final_soft_cap) * self.final_soft_cap
        return logits


def fused_stack(layers: list[Layer]):
    """The layers' fused kernels as one ops.DecoderStack, or None where a layer runs its reference executor."""
    if not layers or any(layer.fused is None for layer in layers):
        return None
    return ops.DecoderStack([layer.fused for layer in layers])


def stage_stack(
    layers: list[Layer],
    h: torch.Tensor,
    residual: torch.Tensor | None,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    sample_idx: torch.Tensor | None = None,
    stack=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Run this stage's layers: (h, residual) after them, and the rows of those to read.

    Each layer runs as its fused kernel when the step allows it (bf16/f16 layers, a kernel block size);
    otherwise its Python reference executor runs it op by op. residual: None at the model's first layer (h
    starts the residual stream), else the stream the previous pipeline stage handed over with h.

    stack: the layers' fused kernels as one ops.DecoderStack (fused_stack, built once with the model), which runs
    the stage in one call; None where a layer has none (the reference executors run).

    sample_idx: the rows whose outputs are read (None: all), each the last of its sequence's query rows, in
    order (the model runner's). The fused last layer then carries only those rows past its cache write:
    (h, residual) come back as theirs, and the rows to read as None; otherwise as given.
    """
    if stack is not None and uses_kernels(block_size=meta.block_size):  # the whole stage in one kernel call
        first = residual is None
        if first:
            residual = torch.empty_like(h)
        keys = [ops.cache_view(k) for k, _ in kv_caches]
        values = [ops.cache_view(v) for _, v in kv_caches]
        stack.forward(
            h,
            residual,
            first,
            positions,
            meta.slot_mapping,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            keys,
            values,
            sample_idx,
        )
        if sample_idx is not None:
            n = sample_idx.numel()
            return h[:n], residual[:n], None
    else:
        for layer, kv in zip(layers, kv_caches, strict=True):
            h, residual = layer.reference(h, residual, positions, meta, kv)
    return h, residual, sample_idx


def final_rows(
    h: torch.Tensor, residual: torch.Tensor, sample_idx: torch.Tensor | None, final_norm: torch.Tensor, eps: float
) -> torch.Tensor:
    """The final norm of (h + residual) at the rows of sample_idx (all rows when None)."""
    h, residual = select_rows(h, sample_idx), select_rows(residual, sample_idx)
    ops.fused_add_rms_norm(h, residual, final_norm, eps)
    return h
