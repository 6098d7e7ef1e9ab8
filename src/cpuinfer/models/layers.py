"""What the architectures build their plans from: weight intake (WeightBag), the plan builders for
attention, dense and mixture-of-experts MLPs (models/plan.py), the token head and pipeline-stage helpers.

Weights are plain contiguous tensors in the run dtype or quantized weights (no nn.Module), with Q/K/V and
gate/up fused into one weight each.
"""

from __future__ import annotations

import torch

from .. import ops
from ..distributed.pipeline import SINGLE_STAGE, PPStage
from ..distributed.tensor_parallel import SINGLE, TPGroup, kv_head_range, narrow, shard_vocab_rows, vocab_shard
from ..model_loader.errors import ModelLoadError
from ..quantization import concat, is_quantized
from .plan import AttentionPlan, DenseMLP, MoEMLP, activation


class WeightBag:
    """The checkpoint's tensors by Hugging Face name; models take() what they need, then check nothing is missing."""

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        dtype: torch.dtype,
        source: str,
        tp: TPGroup = SINGLE,
        pp: PPStage = SINGLE_STAGE,
    ):
        self.tensors = tensors
        self.dtype = dtype
        self.source = source
        self.tp = tp  # this process's tensor-parallel rank: models take only its share of each weight
        self.pp = pp  # this process's pipeline stage: models take only its layers (and drop() the others)

    def drop(self, prefix: str) -> None:
        """Forget every tensor whose name starts with prefix (another pipeline stage's layer or table)."""
        for name in [n for n in self.tensors if n.startswith(prefix)]:
            del self.tensors[name]

    def has(self, name: str) -> bool:
        """True if the checkpoint holds this tensor."""
        return name in self.tensors

    def take(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Remove and return one tensor, contiguous in the run dtype (or `dtype`); quantized weights as they are."""
        try:
            t = self.tensors.pop(name)
        except KeyError:
            raise ModelLoadError(f"{self.source}: weight {name!r} is missing from the checkpoint") from None
        if is_quantized(t):
            return t if dtype is None else t.dequantize(dtype)
        return t.to(dtype or self.dtype).contiguous()

    def take_opt(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """Like take(), but None when the checkpoint has no such tensor."""
        return self.take(name, dtype) if name in self.tensors else None

    def split(self, name: str, names: list[str], rows: list[int]) -> None:
        """Replace a fused tensor (Phi-3's qkv_proj, gate_up_proj) by its row blocks under the given names."""
        t = self.take(name)
        if is_quantized(t):
            t = t.dequantize(self.dtype)
        if t.shape[0] != sum(rows):
            raise ModelLoadError(
                f"{self.source}: {name} has {t.shape[0]} rows, expected {sum(rows)} ({' + '.join(map(str, rows))})"
            )
        for part_name, part in zip(names, torch.split(t, rows, dim=0), strict=True):
            self.tensors[part_name] = part.contiguous()

    def take_shard(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        """take(name) cut to [start, start + length) along dim (a tensor-parallel share)."""
        return self.take(name) if self.tp.size == 1 else narrow(self.take(name), dim, start, length, name, self.dtype)

    def take_cat(
        self, names: list[str], required: bool = True, rows: list[tuple[int, int]] | None = None
    ) -> torch.Tensor | None:
        """Concatenate tensors along dim 0 (fused QKV / gate_up), freeing the pieces; rows[i] = (start, length)
        keeps only those rows of names[i] (this rank's tensor-parallel share)."""
        if not required and not all(n in self.tensors for n in names):
            return None
        parts = [self.tensors.pop(n) if n in self.tensors else self.take(n) for n in names]
        if rows is not None:
            parts = [narrow(p, 0, a, n, name, self.dtype) for p, (a, n), name in zip(parts, rows, names, strict=True)]
        return cat_rows(parts, self.dtype)


def cat_rows(parts: list, dtype: torch.dtype):
    """Weights stacked along their rows (a fused QKV or gate_up): quantized ones stay packed (one weight, or a stack
    of their forms); a mix of quantized and dense is all dense, in dtype."""
    if all(is_quantized(p) for p in parts):
        return concat([q for p in parts for q in p.parts])
    parts = [p.dequantize(dtype) if is_quantized(p) else p for p in parts]
    return torch.cat([p.to(dtype) for p in parts], dim=0).contiguous()


def attention_plan(
    bag: WeightBag,
    prefix: str,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    cos_sin: torch.Tensor | None,
    scale: float,
    *,
    bias: bool = False,
    o_bias: bool = False,
    qk_norm: bool = False,
    norm_offset: float = 0.0,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
    names: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj"),
    fused_qkv: str | None = None,
) -> AttentionPlan:
    """This rank's attention weights for the layer at prefix: q/k/v fused into one weight (this rank's query
    heads and the KV heads they attend to), o_proj's matching columns. fused_qkv: the checkpoint's one
    [q + 2 kv, hidden] tensor's name (Phi-3's qkv_proj) instead of three."""
    q, k, v, o = (f"{prefix}.{n}" for n in names)
    tp = bag.tp
    q_rows, kv_rows = num_heads * head_size, num_kv_heads * head_size
    if tp.size > 1:
        (h0, num_heads), (kv0, local_kv) = tp.share(num_heads), kv_head_range(num_kv_heads, tp)
        rows = [(h0 * head_size, num_heads * head_size)] + [(kv0 * head_size, local_kv * head_size)] * 2
        num_kv_heads = local_kv
    else:
        rows = None
    if fused_qkv is not None:  # split into q, k and v first, so tensor parallelism takes each one's share
        bag.split(
            f"{prefix}.{fused_qkv}.weight", [f"{q}.weight", f"{k}.weight", f"{v}.weight"], [q_rows, kv_rows, kv_rows]
        )
        if bias:
            bag.split(f"{prefix}.{fused_qkv}.bias", [f"{q}.bias", f"{k}.bias", f"{v}.bias"], [q_rows, kv_rows, kv_rows])
    plan = AttentionPlan(
        qkv_w=bag.take_cat([f"{q}.weight", f"{k}.weight", f"{v}.weight"], rows=rows),
        o_w=bag.take_shard(f"{o}.weight", 1, tp.rank * num_heads * head_size, num_heads * head_size),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        scale=scale,
        qkv_b=bag.take_cat([f"{q}.bias", f"{k}.bias", f"{v}.bias"], rows=rows) if bias else None,
        cos_sin=cos_sin,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    if o_bias:
        o_b = bag.take(f"{o}.bias")
        plan.o_b = o_b if tp.rank == 0 else None  # added once, by rank 0, before the all-reduce
    if qk_norm:
        plan.q_norm = norm_weight(bag, f"{prefix}.q_norm.weight", norm_offset)
        plan.k_norm = norm_weight(bag, f"{prefix}.k_norm.weight", norm_offset)
    if plan.qkv_w.shape[0] != plan.q_size + 2 * plan.kv_size:
        raise ModelLoadError(
            f"{bag.source}: {prefix} q/k/v weights have {plan.qkv_w.shape[0]} rows in total, "
            f"expected {plan.q_size + 2 * plan.kv_size} from the config's head counts"
        )
    return plan


def dense_mlp_plan(
    bag: WeightBag,
    prefix: str,
    act: str,
    bias: bool = False,
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    fused_gate_up: str | None = None,
) -> DenseMLP:
    """This rank's gated MLP at prefix: its gate rows then its up rows in one weight, down's matching columns.
    fused_gate_up: the checkpoint's one [2 intermediate, hidden] tensor's name (Phi-3's gate_up_proj)."""
    gate, up, down = (f"{prefix}.{n}" for n in names)
    tp = bag.tp
    inter = _shape(bag, f"{down}.weight")[1]
    if fused_gate_up is not None:
        bag.split(f"{prefix}.{fused_gate_up}.weight", [f"{gate}.weight", f"{up}.weight"], [inter, inter])
    rows = [tp.share(inter)] * 2 if tp.size > 1 else None
    start, length = rows[0] if rows else (0, 0)
    mlp = DenseMLP(
        gate_up_w=bag.take_cat([f"{gate}.weight", f"{up}.weight"], rows=rows),
        down_w=bag.take_shard(f"{down}.weight", 1, start, length),
        act=activation(act, bag.source),
        gate_up_b=bag.take_cat([f"{gate}.bias", f"{up}.bias"], rows=rows) if bias else None,
    )
    if bias:
        down_b = bag.take(f"{down}.bias")
        mlp.down_b = down_b if tp.rank == 0 else None  # added once, by rank 0
    return mlp


def moe_plan(
    bag: WeightBag,
    prefix: str,
    *,
    num_experts: int,
    top_k: int,
    act: str,
    router: str = "gate",
    experts: str = "experts.{}",
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    scoring: str = "softmax",
    renormalize: bool = True,
    router_bias: bool = False,
    expert_bias: bool = False,
) -> MoEMLP:
    """This rank's mixture-of-experts MLP at prefix: the router and, per expert, its gate/up rows in one weight
    and down's matching columns (tensor parallelism splits every expert's intermediate features, as vLLM)."""
    where = f"{bag.source}: {prefix}"
    if not 1 <= top_k <= num_experts:
        raise ModelLoadError(
            f"{where}: num_experts_per_tok = {top_k} must be between 1 and the expert count ({num_experts})"
        )
    router_w = bag.take(f"{prefix}.{router}.weight", bag.dtype)  # dense even where a file quantized it
    if router_w.shape[0] != num_experts:
        raise ModelLoadError(
            f"{where}.{router}.weight has {router_w.shape[0]} rows; the config says {num_experts} experts"
        )
    tp = bag.tp
    gate_up, down, gate_up_b, down_b = [], [], [], []
    inter = None
    for e in range(num_experts):
        p = f"{prefix}.{experts.format(e)}"
        g, u, d = (f"{p}.{n}.weight" for n in names)
        shapes = [_shape(bag, n) for n in (g, u, d)]
        i = shapes[2][1]
        inter = i if inter is None else inter
        if shapes[0] != shapes[1] or shapes[0][0] != i or i != inter:
            raise ModelLoadError(
                f"{where}: expert {e}'s weights have mismatched shapes (gate {list(shapes[0])}, up "
                f"{list(shapes[1])}, down {list(shapes[2])}; expert 0's intermediate size is {inter})"
            )
        rows = [tp.share(i)] * 2 if tp.size > 1 else None
        start, length = rows[0] if rows else (0, 0)
        gate_up.append(bag.take_cat([g, u], rows=rows))
        down.append(bag.take_shard(d, 1, start, length))
        if expert_bias:
            gate_up_b.append(bag.take_cat([n.removesuffix("weight") + "bias" for n in (g, u)], rows=rows))
            bias = bag.take(d.removesuffix("weight") + "bias")
            down_b.append(bias if tp.rank == 0 else torch.zeros_like(bias))  # added once, by rank 0
    return MoEMLP(
        router_w=router_w,
        gate_up_w=gate_up,
        down_w=down,
        top_k=top_k,
        act=activation(act, bag.source),
        scoring=scoring,
        renormalize=renormalize,
        router_b=bag.take(f"{prefix}.{router}.bias") if router_bias else None,
        gate_up_b=gate_up_b or None,
        down_b=down_b or None,
    )


def _shape(bag: WeightBag, name: str) -> tuple[int, ...]:
    """A tensor's shape without taking it (a ModelLoadError naming it when the checkpoint lacks it)."""
    if not bag.has(name):
        raise ModelLoadError(f"{bag.source}: weight {name!r} is missing from the checkpoint")
    t = bag.tensors[name]
    return tuple(t.shape) if not is_quantized(t) else (t.n, t.k)


class TokenHead:
    """The embedding table and the lm_head (the same tensor when tied), the lm_head packed for ops.linear.

    Under tensor parallelism both are vocabulary-parallel (see distributed.tensor_parallel): this rank holds
    rows [vocab_start, vocab_start + shard rows) of each.
    """

    def __init__(self, embed: torch.Tensor, lm_head: torch.Tensor | None, dtype: torch.dtype, tp: TPGroup = SINGLE):
        self.dtype = dtype  # of the activations (quantized tables are dequantized to it row by row)
        self.tp = tp
        tied = lm_head is None or lm_head is embed
        self.vocab_size = embed.shape[0]
        self.vocab_start, self.shard_rows = vocab_shard(self.vocab_size, tp)
        embed = shard_vocab_rows(embed, tp, "embed_tokens", dtype)
        lm_head = None if tied else shard_vocab_rows(lm_head, tp, "lm_head", dtype)
        head = embed if tied else lm_head
        self.packed = ops.can_pack(head)
        if self.packed:
            head = ops.pack_weight(head)
        self.lm_head = head
        # A tied table is stored once: embedding rows are read back out of the packed layout.
        self.embed = head if tied else embed
        self.embed_packed = tied and self.packed

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows for ids, as a new tensor."""
        if self.tp.size == 1:
            return self._rows(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_rows)
        rows = self._rows(local.masked_fill(outside, 0))
        rows[outside] = 0  # another rank's row: it adds it in the all-reduce (x + 0 is exact)
        return self.tp.all_reduce_(rows)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed_packed:
            return ops.packed_rows(self.embed, ids)
        if is_quantized(self.embed):
            return self.embed.rows(ids, self.dtype)
        return torch.nn.functional.embedding(ids, self.embed)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits for hidden states h [T, hidden] (rounded to the model's dtype, as its lm_head's output)."""
        if self.tp.size == 1:  # straight into float32: no bf16 logits and .float() (~0.3 ms a 32-sequence step)
            return ops.linear(h, self.lm_head, None, self.packed, torch.float32, rounded=True)
        logits = ops.linear(h, self.lm_head, None, self.packed)
        logits = self.tp.all_gather(logits.contiguous(), -1)[:, : self.vocab_size]
        return logits.float()


def stage_layer_ids(bag: WeightBag, num_layers: int, prefix: str) -> list[int]:
    """The layers this pipeline stage builds (all without a pipeline); the others' tensors are dropped.

    prefix: a layer's tensor-name prefix with {} for its index ("model.layers.{}")."""
    pp = bag.pp
    for i in range(num_layers):
        if not pp.holds(i):
            bag.drop(prefix.format(i) + ".")
    return [i for i in range(num_layers) if pp.holds(i)]


def stage_head(bag: WeightBag, embed_name: str, lm_head_name: str, tied: bool) -> TokenHead | None:
    """The TokenHead this pipeline stage needs: all of it without a pipeline; the embedding on the first
    stage, the lm_head on the last (the embedding table itself when tied); None on a middle stage."""
    pp = bag.pp
    tied = tied or not bag.has(lm_head_name)
    if pp.size == 1:
        embed = bag.take(embed_name)
        head = TokenHead(embed, None if tied else bag.take(lm_head_name), bag.dtype, bag.tp)
    elif pp.first:  # the table serves as the embedding only (its logits are never asked for)
        head = TokenHead(bag.take(embed_name), None, bag.dtype, bag.tp)
    elif pp.last:  # the table serves as the lm_head only
        head = TokenHead(bag.take(embed_name if tied else lm_head_name), None, bag.dtype, bag.tp)
    else:
        head = None
    bag.tensors.pop(embed_name, None)
    bag.tensors.pop(lm_head_name, None)
    return head


def stage_norm(bag: WeightBag, name: str, offset: float = 0.0) -> torch.Tensor | None:
    """The final norm's weight on the last pipeline stage (norm_weight), dropped elsewhere (None)."""
    if bag.pp.last:
        return norm_weight(bag, name, offset)
    bag.tensors.pop(name, None)
    return None


def norm_weight(bag: WeightBag, name: str, offset: float = 0.0) -> torch.Tensor:
    """An RMSNorm weight in the run dtype; offset=1 folds Gemma's (1 + w) in at load, computed in float32."""
    w = bag.take(name, torch.float32)
    if offset:
        w = w + offset
    return w.to(bag.dtype).contiguous()


def select_rows(x: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
    """x[idx] as a new contiguous tensor (all rows when idx is None)."""
    return x if idx is None else x.index_select(0, idx)
