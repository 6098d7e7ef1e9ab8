"""Mixture-of-experts decoders on the Llama layer: Qwen3-MoE (q/k norm, sparse layers by step) and Mixtral."""

from __future__ import annotations

from ..model_loader.errors import ModelLoadError
from .layers import WeightBag, dense_mlp_plan, moe_plan
from .llama import MistralForCausalLM, Qwen3ForCausalLM
from .plan import DenseMLP, MoEMLP


def check_router(config: dict, source: str) -> None:
    """Refuse router kinds these families do not have (DeepSeek-style sigmoid or grouped routing)."""
    scoring = config.get("scoring_func", "softmax")
    if scoring != "softmax":
        raise ModelLoadError(f"{source}: scoring_func = {scoring!r}: only softmax routing is supported here")
    for key in ("n_group", "topk_group", "n_shared_experts", "shared_expert_intermediate_size"):
        if config.get(key):
            raise ModelLoadError(f"{source}: {key} = {config[key]!r}: grouped and shared experts are not supported")


def num_experts(config: dict) -> int:
    """The expert count, under either spelling (Qwen's num_experts; Mixtral's, and transformers 5's for both,
    num_local_experts); 0 for none."""
    return int(config.get("num_experts") or config.get("num_local_experts") or 0)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE (Qwen3-30B-A3B, -235B-A22B): Qwen3's attention; MoE MLPs on every decoder_sparse_step-th layer
    not listed in mlp_only_layers, softmax top-k routing renormalized when norm_topk_prob."""

    def mlp(self, bag: WeightBag, p: str, i: int) -> DenseMLP | MoEMLP:
        """Layer i's MLP: sparse (the config's rule) or dense."""
        c = self.config
        check_router(c, bag.source)
        step = int(c.get("decoder_sparse_step") or 1)
        experts = num_experts(c)
        if experts == 0 or i in (c.get("mlp_only_layers") or []) or (i + 1) % step != 0:
            return dense_mlp_plan(bag, f"{p}.mlp", c.get("hidden_act", "silu"))
        return moe_plan(
            bag,
            f"{p}.mlp",
            num_experts=experts,
            top_k=int(c["num_experts_per_tok"]),
            act=c.get("hidden_act", "silu"),
            renormalize=bool(c.get("norm_topk_prob", False)),
        )


class MixtralForCausalLM(MistralForCausalLM):
    """Mixtral 8x7B / 8x22B: Mistral's attention, every MLP a mixture of experts (w1 gate, w3 up, w2 down),
    softmax top-k routing renormalized over the chosen experts."""

    def mlp(self, bag: WeightBag, p: str, i: int) -> MoEMLP:  # noqa: ARG002 - every layer is sparse
        """Layer i's MoE MLP."""
        c = self.config
        check_router(c, bag.source)
        return moe_plan(
            bag,
            f"{p}.block_sparse_moe",
            num_experts=num_experts(c),
            top_k=int(c["num_experts_per_tok"]),
            act=c.get("hidden_act", "silu"),
            names=("w1", "w3", "w2"),
        )
