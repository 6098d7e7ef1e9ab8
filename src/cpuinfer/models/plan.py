"""A decoder layer as data: what the layer is and the weights it runs on, with no code of its own.

An architecture module turns its config and checkpoint into one LayerPlan per layer; two executors run a
plan (models/executor.py): the fused C++ layer (ops.DecoderLayer, which reads these fields by name) and
a Python reference that walks the same fields through cpuinfer.ops. A new layer feature is a field here
plus one change in each executor; tests/models/test_executors.py holds the two equal.

Weights are whatever the loader kept: dense tensors in the run dtype (packed for ops.linear when `packed`),
or quantized weights (cpuinfer.quantization). Norm weights have their offset folded in at load (Gemma's
1 + w), so every norm here is the plain RMSNorm x / rms(x) * w.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..model_loader.errors import ModelLoadError

# Checkpoint activation names -> the kernels' (the gated MLP's act(gate) * up).
ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "swiglu_oai": "swiglu_oai",  # gpt-oss (its config says silu; the builder names this)
}


def activation(name: str, source: str = "config") -> str:
    """The kernels' name for a checkpoint's gated-MLP activation, or a ModelLoadError naming the supported ones."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ModelLoadError(
            f"{source}: activation {name!r} is not supported; supported: {', '.join(ACTIVATIONS)}"
        ) from None


@dataclass
class AttentionPlan:
    """Self-attention over the paged KV cache: fused QKV projection, per-head q/k norm, rotary, o projection."""

    qkv_w: Any  # [q + 2 kv, hidden]: this rank's query heads, then its key and value heads
    o_w: Any  # [hidden, q]
    num_heads: int  # this rank's
    num_kv_heads: int  # this rank's
    head_size: int
    scale: float  # on q . k (1/sqrt(head_size), or the config's query_pre_attn_scalar)
    qkv_b: torch.Tensor | None = None
    o_b: torch.Tensor | None = None  # rank 0's only under tensor parallelism (added once, before the all-reduce)
    q_norm: torch.Tensor | None = None  # [head_size]: RMS norm of each head before rotary (with k_norm)
    k_norm: torch.Tensor | None = None
    cos_sin: torch.Tensor | None = None  # [max_positions, rot_dim] rotary table (NeoX pairs); None: no rotary
    sliding_window: int = 0  # keys within this many positions (0: all)
    soft_cap: float = 0.0  # logits -> cap * tanh(logits / cap) (0: off)
    sinks: torch.Tensor | None = None  # [num_heads] float32: a logit per head joining the softmax sum (gpt-oss)

    @property
    def q_size(self) -> int:
        """Query features of this rank."""
        return self.num_heads * self.head_size

    @property
    def kv_size(self) -> int:
        """Key (and value) features of this rank."""
        return self.num_kv_heads * self.head_size


@dataclass
class DenseMLP:
    """down(act(gate(x)) * up(x)), gate and up fused into one weight."""

    gate_up_w: Any  # [2 intermediate, hidden]: gate rows, then up rows
    down_w: Any  # [hidden, intermediate]
    act: str  # the kernels' name: silu, gelu, gelu_tanh, swiglu_oai
    gate_up_b: torch.Tensor | None = None
    down_b: torch.Tensor | None = None  # rank 0's only under tensor parallelism
    kind: Literal["dense"] = "dense"


@dataclass
class MoEMLP:
    """A mixture of gated experts: a router picks each token's top_k experts and weighs their outputs."""

    router_w: torch.Tensor  # [num_experts, hidden], the run dtype
    gate_up_w: list  # one [2 intermediate, hidden] weight per expert (this rank's share of its intermediate)
    down_w: list  # one [hidden, intermediate] weight per expert
    top_k: int
    act: str
    # softmax: a softmax over every expert's logit, then the top k (Qwen3-MoE, Mixtral);
    # topk_softmax: the top k logits, then a softmax over them (gpt-oss).
    scoring: Literal["softmax", "topk_softmax"] = "softmax"
    renormalize: bool = True  # softmax scoring: the k weights rescaled to sum to 1
    router_b: torch.Tensor | None = None
    gate_up_b: list | None = None  # one [2 intermediate] bias per expert (gpt-oss), or None
    down_b: list | None = None  # one [hidden] bias per expert; rank 0's only under tensor parallelism
    kind: Literal["moe"] = "moe"

    @property
    def num_experts(self) -> int:
        """How many experts the router chooses among."""
        return len(self.gate_up_w)


@dataclass
class LayerPlan:
    """One pre-norm decoder layer: in_norm -> attention -> (sandwich) norms -> MLP, on a residual stream."""

    in_norm: torch.Tensor  # [hidden]
    post_attn_norm: torch.Tensor  # [hidden]: the pre-MLP norm, or Gemma's norm of the attention output
    attn: AttentionPlan
    mlp: DenseMLP | MoEMLP
    eps: float  # every norm of the layer (q/k norms included)
    pre_ff_norm: torch.Tensor | None = None  # Gemma's sandwich norms: pre-MLP norm (with post_ff_norm)
    post_ff_norm: torch.Tensor | None = None
    packed: bool = False  # every projection is in ops.pack_weight's layout (see executor.pack)


def describe(plan: LayerPlan, kernels: str) -> str:
    """One line saying what the layer is and how it runs, for `cpuinfer info --model M --layers`."""
    a, m = plan.attn, plan.mlp
    attn = f"attention {a.num_heads}q/{a.num_kv_heads}kv x {a.head_size}"
    attn += f", sliding {a.sliding_window}" if a.sliding_window else ", full"
    attn += f", soft-cap {a.soft_cap:g}" if a.soft_cap else ""
    attn += ", q/k norm" if a.q_norm is not None else ""
    attn += ", bias" if a.qkv_b is not None else ""
    attn += ", sinks" if a.sinks is not None else ""
    if isinstance(m, MoEMLP):
        rule = f"{m.scoring}{' renormalized' if m.scoring == 'softmax' and m.renormalize else ''}"
        mlp = f"MoE {m.num_experts} experts top-{m.top_k} ({rule}) x {_format(m.gate_up_w[0], plan.packed)}"
    else:
        mlp = f"dense {_format(m.gate_up_w, plan.packed)}"
    norms = "sandwich norms" if plan.pre_ff_norm is not None else "pre-norm"
    return f"{attn}; {m.act} {mlp}; {norms}; {kernels}"


def _format(w, packed: bool) -> str:
    """A weight's storage: its quantized kind, or its dtype and layout."""
    if isinstance(w, torch.Tensor):
        return f"{str(w.dtype).removeprefix('torch.')}{' packed' if packed else ''}"
    return getattr(w, "kind", None) or type(w).__name__
