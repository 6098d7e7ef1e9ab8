"""Phi-3 / Phi-3.5 / Phi-4-mini: Llama's layer from fused qkv_proj and gate_up_proj checkpoint tensors."""

from __future__ import annotations

from .layers import WeightBag
from .llama import LlamaForCausalLM
from .plan import AttentionPlan, DenseMLP


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3: q/k/v in one checkpoint tensor and gate/up in another, split at load so tensor parallelism takes
    each one's share; optional sliding window on every layer."""

    def attention(self, bag: WeightBag, p: str, i: int) -> AttentionPlan:
        """Layer i's attention from qkv_proj."""
        return super().attention(bag, p, i, fused_qkv="qkv_proj")

    def mlp(self, bag: WeightBag, p: str, i: int) -> DenseMLP:
        """Layer i's MLP from gate_up_proj."""
        return super().mlp(bag, p, i, fused_gate_up="gate_up_proj")
