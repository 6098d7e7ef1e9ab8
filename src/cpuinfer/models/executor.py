"""The two executors of a LayerPlan: the fused C++ layer, and the Python reference through cpuinfer.ops.

Both read the same plan (models/plan.py) and call the same kernels in the same order, so bf16/f16 runs
give identical bits either way (tests/models/test_executors.py). The reference runs where the fused
layer does not: float32 (its GEMMs are torch's), head sizes the attention kernels lack (torch attention),
`CPUINFER_FUSED_LAYERS=0` (debugging).
"""

from __future__ import annotations

import torch

from .. import envs, ops
from ..attention import AttentionMetadata, paged_attention, reshape_and_cache
from ..attention.backend import uses_kernels
from ..distributed.tensor_parallel import SINGLE, TPGroup
from .plan import AttentionPlan, DenseMLP, LayerPlan, MoEMLP


class Layer:
    """A layer's plan and how it runs: `fused` (the kernel, or None where it cannot run) and `reference`."""

    __slots__ = ("_moe_kernel", "fused", "plan", "tp")

    def __init__(self, plan: LayerPlan, tp: TPGroup = SINGLE):
        pack(plan)
        self.plan, self.tp = plan, tp
        self.fused = fused_layer(plan, tp)
        self._moe_kernel = None

    def reference(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual) after this layer, op by op from Python (residual None: the model's first layer)."""
        p = self.plan
        h, residual = input_norm(h, residual, p.in_norm, p.eps)
        h = attention(p.attn, p.packed, self.tp, h, positions, meta, kv, p.eps)
        if p.pre_ff_norm is not None:  # Gemma's sandwich: the attention output normed before the residual add
            h = ops.rms_norm(h, p.post_attn_norm, p.eps, out=h)
            ops.fused_add_rms_norm(h, residual, p.pre_ff_norm, p.eps)
        else:
            ops.fused_add_rms_norm(h, residual, p.post_attn_norm, p.eps)
        h = self._moe(h) if isinstance(p.mlp, MoEMLP) else dense_mlp(p.mlp, p.packed, self.tp, h)
        if p.post_ff_norm is not None:
            h = ops.rms_norm(h, p.post_ff_norm, p.eps, out=h)
        return h, residual

    def _moe(self, x: torch.Tensor) -> torch.Tensor:
        mlp = self.plan.mlp
        if x.dtype == torch.float32:  # float32 runs torch's GEMMs, as the dense layers do
            out = moe_torch(mlp, x)
            return self.tp.all_reduce_(out) if self.tp.size > 1 else out
        if self._moe_kernel is None:
            self._moe_kernel = ops.MoE(mlp, self.plan.packed)
        if self.tp.size == 1:
            out = torch.empty_like(x)
            self._moe_kernel.forward(out, x)
            return out
        share = torch.empty(x.shape, dtype=torch.float32)  # summed over the ranks in f32, rounded once
        self._moe_kernel.forward(share, x)
        return self.tp.all_reduce_(share).to(x.dtype)


def pack(plan: LayerPlan) -> None:
    """Repack every projection of the layer for ops.linear's one-stream layout, if all of them can be.

    A decode step streams every weight once, and a block of 4 interleaved rows streams faster than 4 rows
    side by side (~23 against ~19 GB/s on 2 AVX2 cores). Results are identical either way. A MoE layer's
    experts are packed too unless CPUINFER_MOE_PREPACK=0 (vLLM's VLLM_CPU_MOE_PREPACK) keeps the whole
    layer row-major: no repacking pass at load, the GEMV kernel at every batch size.
    """
    a, m = plan.attn, plan.mlp
    if plan.packed:
        return
    if isinstance(m, MoEMLP):
        if not envs.MOE_PREPACK.get():
            return
        weights = [a.qkv_w, a.o_w, m.router_w, *m.gate_up_w, *m.down_w]
    else:
        weights = [a.qkv_w, a.o_w, m.gate_up_w, m.down_w]
    if not all(ops.can_pack(w) for w in weights):  # quantized or float32: never
        return
    a.qkv_w, a.o_w = ops.pack_weight(a.qkv_w), ops.pack_weight(a.o_w)
    if isinstance(m, MoEMLP):
        m.router_w = ops.pack_weight(m.router_w)
        m.gate_up_w = [ops.pack_weight(w) for w in m.gate_up_w]
        m.down_w = [ops.pack_weight(w) for w in m.down_w]
    else:
        m.gate_up_w, m.down_w = ops.pack_weight(m.gate_up_w), ops.pack_weight(m.down_w)
    plan.packed = True


def fused_layer(plan: LayerPlan, tp: TPGroup = SINGLE):
    """The layer as one kernel call (ops.DecoderLayer built from the plan), or None where the reference runs.

    The fused layer calls the same kernels in the same order, so its results are identical; what it saves
    is the Python between them (~100 us per layer and step, a sixth of a small model's decode step).
    float32 keeps the reference: its GEMMs are torch's (see ops.linear).
    """
    if plan.in_norm.dtype not in (torch.bfloat16, torch.float16) or not envs.FUSED_LAYERS.get():
        return None
    if not uses_kernels(plan.attn.head_size):
        return None  # attention runs on torch for this head size
    layer = ops.DecoderLayer(plan)
    if tp.size > 1:  # the row-parallel outputs' partial sums meet in the kernel, through the same communicator
        layer.set_all_reduce(tp.comm.native)
    return layer


def input_norm(
    h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm block's input: (rms_norm(residual + h), the new residual), in place after the first layer.

    The first layer has no residual yet: h itself starts the residual stream.
    """
    if residual is None:
        return ops.rms_norm(h, weight, eps), h
    ops.fused_add_rms_norm(h, residual, weight, eps)
    return h, residual


def attention(
    a: AttentionPlan,
    packed: bool,
    tp: TPGroup,
    x: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    eps: float = 1e-6,
) -> torch.Tensor:
    """Attention output [T, hidden] for hidden states x [T, hidden] at the given positions."""
    t, hs = x.shape[0], a.head_size
    qkv = ops.linear(x, a.qkv_w, a.qkv_b, packed)
    q = qkv[:, : a.q_size]
    k = qkv[:, a.q_size : a.q_size + a.kv_size]
    v = qkv[:, a.q_size + a.kv_size :]
    if a.q_norm is not None:
        q = ops.rms_norm(q.reshape(t * a.num_heads, hs), a.q_norm, eps).view(t, a.q_size)
        k = ops.rms_norm(k.reshape(t * a.num_kv_heads, hs), a.k_norm, eps).view(t, a.kv_size)
    if a.cos_sin is not None:
        ops.rotary_embedding(positions, q, k, hs, a.cos_sin, True)
    key_cache, value_cache = kv_cache
    reshape_and_cache(k.view(t, a.num_kv_heads, hs), v.view(t, a.num_kv_heads, hs), key_cache, value_cache, meta)
    out = torch.empty(t, a.num_heads, hs, dtype=x.dtype)
    paged_attention(
        out, q.view(t, a.num_heads, hs), key_cache, value_cache, meta, a.scale, a.sliding_window, a.soft_cap, a.sinks
    )
    return row_parallel(tp, out.view(t, a.q_size), a.o_w, a.o_b, packed)


_ACTS = {
    "silu": ops.silu_and_mul,
    "gelu": ops.gelu_and_mul,
    "gelu_tanh": lambda x: ops.gelu_and_mul(x, "tanh"),
    "swiglu_oai": ops.swiglu_oai_and_mul,
}


def dense_mlp(m: DenseMLP, packed: bool, tp: TPGroup, x: torch.Tensor) -> torch.Tensor:
    """down(act(gate(x)) * up(x)) for x [T, hidden]."""
    gate_up = ops.linear(x, m.gate_up_w, m.gate_up_b, packed)
    return row_parallel(tp, _ACTS[m.act](gate_up), m.down_w, m.down_b, packed)


def moe_route(m: MoEMLP, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [T, k], their float32 weights [T, k]) from router logits [T, E], as transformers routes."""
    if m.scoring == "topk_softmax":
        top, ids = torch.topk(logits.float(), m.top_k, dim=-1)
        return ids, torch.softmax(top, dim=-1)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, m.top_k, dim=-1)
    if m.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def moe_torch(m: MoEMLP, x: torch.Tensor) -> torch.Tensor:
    """The MoE MLP on torch and ops.linear, expert by expert (float32 runs; the kernel's reference in tests)."""
    ids, weights = moe_route(m, ops.linear(x, m.router_w, m.router_b))
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in torch.unique(ids).tolist():
        rows, slot = torch.nonzero(ids == e, as_tuple=True)
        biases = (m.gate_up_b[e] if m.gate_up_b else None, m.down_b[e] if m.down_b else None)
        y = dense_mlp(DenseMLP(m.gate_up_w[e], m.down_w[e], m.act, *biases), False, SINGLE, x[rows])
        out.index_add_(0, rows, y.float() * weights[rows, slot, None])
    return out.to(x.dtype)


def row_parallel(tp: TPGroup, x: torch.Tensor, weight, bias, packed: bool = False) -> torch.Tensor:
    """x @ weight.T (+ bias) for a row-parallel shard (o_proj, down_proj), summed over the tensor-parallel
    ranks: each rank's share stays float32, the ranks sum in float32 and the sum is rounded once to x's
    dtype, as one rank's whole product is (bf16 shares rounded before the sum drifted from one rank's
    greedy tokens; the fused decoder layer does the same in C++)."""
    if tp.size == 1:
        return ops.linear(x, weight, bias, packed)
    return tp.all_reduce_(ops.linear(x, weight, bias, packed, out_dtype=torch.float32)).to(x.dtype)
