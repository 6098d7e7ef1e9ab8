"""gpt-oss (gpt-oss-20b, -120b): attention with sinks, biases and alternating sliding-window layers (YaRN
rope), and a mixture of experts with a biased router (top-k logits, then a softmax over them), biased experts
and a clamped SwiGLU."""

from __future__ import annotations

import torch

from ..model_loader.errors import ModelLoadError
from ..quantization.mxfp4 import Mxfp4Stack
from .layers import WeightBag, moe_plan
from .llama import LlamaForCausalLM
from .plan import AttentionPlan, MoEMLP

# The clamped SwiGLU's constants the kernels implement (csrc/common/activation.h).
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0
_STACKS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss from a checkpoint with 16-bit (or float32) experts."""

    def __init__(self, config: dict, bag: WeightBag, max_positions: int, rope_freq_factors=None):
        alpha, limit = float(config.get("swiglu_alpha", SWIGLU_ALPHA)), float(config.get("swiglu_limit", SWIGLU_LIMIT))
        if (alpha, limit) != (SWIGLU_ALPHA, SWIGLU_LIMIT):
            raise ModelLoadError(
                f"{bag.source}: swiglu_alpha = {alpha}, swiglu_limit = {limit}: the kernels implement gpt-oss's "
                f"{SWIGLU_ALPHA} and {SWIGLU_LIMIT} only"
            )
        if any(n.endswith(("_blocks", "_scales")) for n in bag.tensors):
            raise ModelLoadError(
                f"{bag.source}: *_blocks / *_scales tensors but no quantization_config with quant_method "
                "'mxfp4' in config.json; the checkpoint is incomplete: re-download it"
            )
        super().__init__(config, bag, max_positions, rope_freq_factors)

    def attention(self, bag: WeightBag, p: str, i: int) -> AttentionPlan:
        """Layer i's attention (its config's attention_bias: q/k/v and o biases) with this rank's heads' sinks."""
        attn = super().attention(bag, p, i)
        sinks = bag.take(f"{p}.self_attn.sinks", torch.float32)
        if sinks.shape != (self.heads,):
            raise ModelLoadError(f"{bag.source}: {p}.self_attn.sinks has shape {list(sinks.shape)}, not [{self.heads}]")
        if bag.tp.size > 1:
            h0, n = bag.tp.share(self.heads)
            sinks = sinks[h0 : h0 + n]
        attn.sinks = sinks.contiguous()
        return attn

    def mlp(self, bag: WeightBag, p: str, i: int) -> MoEMLP:  # noqa: ARG002 - every layer's is a MoE
        """The layer's experts, unstacked: transformers keeps them as [experts, in, out] tensors with the gate and
        up features interleaved (even: gate, odd: up); each expert becomes a [out, in] gate, up and down."""
        c = self.config
        experts = int(c["num_local_experts"])
        prefix = f"{p}.mlp.experts"
        if f"{prefix}.gate_up_proj" in bag.tensors:
            self._unstack(bag, prefix, experts)
        # (else: a GGUF file, whose loader already wrote each expert's gate, up and down with their biases)
        return moe_plan(
            bag,
            f"{p}.mlp",
            num_experts=experts,
            top_k=int(c["num_experts_per_tok"]),
            act="swiglu_oai",
            router="router",
            scoring="topk_softmax",
            router_bias=True,
            expert_bias=True,
        )

    @staticmethod
    def _unstack(bag: WeightBag, prefix: str, experts: int) -> None:
        """transformers' stacks [experts, in, out] (gate and up interleaved: even gate, odd up), or MXFP4
        stacks [experts, out, in], as each expert's gate, up and down [out, in] with their biases."""
        stacks = {}
        for name in _STACKS:
            key = f"{prefix}.{name}"
            if isinstance(bag.tensors.get(key), Mxfp4Stack):
                t = bag.tensors.pop(key)
            else:
                t = bag.take(key, torch.float32 if name.endswith("bias") else None)
            if t.shape[0] != experts:
                raise ModelLoadError(
                    f"{bag.source}: {prefix}.{name} holds {t.shape[0]} experts; the config says {experts}"
                )
            stacks[name] = t
        gate_up, gate_up_b, down = stacks["gate_up_proj"], stacks["gate_up_proj_bias"], stacks["down_proj"]
        for e in range(experts):
            for part, rows in (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))):
                bag.tensors[f"{prefix}.{e}.{part}.weight"] = _expert(bag, gate_up, e, rows)
                bag.tensors[f"{prefix}.{e}.{part}.bias"] = gate_up_b[e][rows].contiguous()
            bag.tensors[f"{prefix}.{e}.down_proj.weight"] = _expert(bag, down, e, slice(None))
            bag.tensors[f"{prefix}.{e}.down_proj.bias"] = stacks["down_proj_bias"][e].contiguous()


def _expert(bag: WeightBag, stack, e: int, rows: slice):
    """Rows `rows` of expert e's [out, in] matrix: from an MXFP4 stack ([experts, out, in], kept exactly in the
    kernels' 5-bit form, or dequantized where float16 cannot hold a scale), or from transformers' dense
    parameter ([experts, in, out])."""
    if isinstance(stack, Mxfp4Stack):
        w = stack.weight((e,), rows)
        return w if w is not None else stack.dequantize(bag.dtype, (e,))[rows].contiguous()
    return stack[e].t()[rows].contiguous()
