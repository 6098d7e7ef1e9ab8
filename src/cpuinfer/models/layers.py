"""Building blocks shared by the decoder models: weight intake, fused attention and gated MLP.

Weights are plain contiguous tensors in the run dtype (no nn.Module): the forward is a fixed
sequence of GEMMs (ops.linear: our GEMV for decode, torch otherwise) and our kernels, with Q/K/V and
gate/up fused into one GEMM each.
"""

from __future__ import annotations

import torch

from .. import envs, ops
from ..attention import AttentionMetadata, paged_attention, reshape_and_cache
from ..attention.backend import uses_kernels
from ..distributed.pipeline import SINGLE_STAGE, PPStage
from ..distributed.tensor_parallel import SINGLE, TPGroup, kv_head_range, narrow, shard_vocab_rows, vocab_shard
from ..model_loader.errors import ModelLoadError
from ..quantization import concat, is_quantized


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
        if all(is_quantized(p) for p in parts):
            return concat([q for p in parts for q in p.parts])
        parts = [p.dequantize(self.dtype) if is_quantized(p) else p for p in parts]  # mixed: all dense
        out = torch.cat([p.to(self.dtype) for p in parts], dim=0).contiguous()
        del parts
        return out


class Attention:
    """Fused-QKV self-attention over the paged KV cache, with optional q/k RMS norm, bias, window and soft-cap."""

    def __init__(
        self,
        bag: WeightBag,
        prefix: str,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        cos_sin: torch.Tensor | None,
        scale: float,
        *,
        bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        norm_offset: float = 0.0,
        sliding_window: int = 0,
        soft_cap: float = 0.0,
        names: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj"),
    ):
        q, k, v, o = (f"{prefix}.{n}" for n in names)
        tp = self.tp = bag.tp
        if tp.size > 1:  # this rank's query heads and the KV heads they attend to; o_proj's matching columns
            (h0, num_heads), (kv0, local_kv) = tp.share(num_heads), kv_head_range(num_kv_heads, tp)
            rows = [(h0 * head_dim, num_heads * head_dim)] + [(kv0 * head_dim, local_kv * head_dim)] * 2
            num_kv_heads = local_kv
        else:
            rows = None
        self.qkv_w = bag.take_cat([f"{q}.weight", f"{k}.weight", f"{v}.weight"], rows=rows)
        self.qkv_b = bag.take_cat([f"{q}.bias", f"{k}.bias", f"{v}.bias"], rows=rows) if bias else None
        self.o_w = bag.take_shard(f"{o}.weight", 1, tp.rank * num_heads * head_dim, num_heads * head_dim)
        self.o_b = bag.take(f"{o}.bias") if o_bias else None
        if self.o_b is not None and tp.rank > 0:
            self.o_b = None  # added once, by rank 0, before the all-reduce
        self.q_norm = self.k_norm = None
        if qk_norm:
            self.q_norm = norm_weight(bag, f"{prefix}.q_norm.weight", norm_offset)
            self.k_norm = norm_weight(bag, f"{prefix}.k_norm.weight", norm_offset)
        self.norm_eps = norm_eps
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.cos_sin = cos_sin
        self.scale, self.sliding_window, self.soft_cap = scale, sliding_window, soft_cap
        self.packed = False  # qkv_w / o_w in ops.pack_weight's layout (see pack_layer)
        if self.qkv_w.shape[0] != self.q_size + 2 * self.kv_size:
            raise ModelLoadError(
                f"{bag.source}: {prefix} q/k/v weights have {self.qkv_w.shape[0]} rows in total, "
                f"expected {self.q_size + 2 * self.kv_size} from the config's head counts"
            )

    def __call__(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """Attention output [T, hidden] for hidden states x [T, hidden] at the given positions."""
        t = x.shape[0]
        hs = self.head_dim
        qkv = ops.linear(x, self.qkv_w, self.qkv_b, self.packed)
        q = qkv[:, : self.q_size]
        k = qkv[:, self.q_size : self.q_size + self.kv_size]
        v = qkv[:, self.q_size + self.kv_size :]
        if self.q_norm is not None:
            q = ops.rms_norm(q.reshape(t * self.num_heads, hs), self.q_norm, self.norm_eps).view(t, self.q_size)
            k = ops.rms_norm(k.reshape(t * self.num_kv_heads, hs), self.k_norm, self.norm_eps).view(t, self.kv_size)
        if self.cos_sin is not None:
            ops.rotary_embedding(positions, q, k, hs, self.cos_sin, True)
        key_cache, value_cache = kv_cache
        reshape_and_cache(
            k.view(t, self.num_kv_heads, hs), v.view(t, self.num_kv_heads, hs), key_cache, value_cache, meta
        )
        out = torch.empty(t, self.num_heads, hs, dtype=x.dtype)
        paged_attention(
            out,
            q.view(t, self.num_heads, hs),
            key_cache,
            value_cache,
            meta,
            self.scale,
            self.sliding_window,
            self.soft_cap,
        )
        return row_parallel(self.tp, out.view(t, self.q_size), self.o_w, self.o_b, self.packed)


def row_parallel(tp: TPGroup, x: torch.Tensor, weight, bias, packed: bool = False) -> torch.Tensor:
    """x @ weight.T (+ bias) for a row-parallel shard (o_proj, down_proj), summed over the tensor-parallel
    ranks: each rank's share stays float32, the ranks sum in float32 and the sum is rounded once to x's
    dtype, as one rank's whole product is (bf16 shares rounded before the sum drifted from one rank's
    greedy tokens; the fused decoder layer does the same in C++)."""
    if tp.size == 1:
        return ops.linear(x, weight, bias, packed)
    return tp.all_reduce_(ops.linear(x, weight, bias, packed, out_dtype=torch.float32)).to(x.dtype)


class GatedMLP:
    """down(act(gate(x)) * up(x)) with gate and up fused into one GEMM."""

    def __init__(self, bag: WeightBag, prefix: str, act: str, bias: bool = False):
        tp = self.tp = bag.tp
        rows = None
        if tp.size > 1:  # this rank's intermediate features: its gate rows, its up rows, down's matching columns
            inter = bag.tensors[f"{prefix}.down_proj.weight"].shape[1]
            rows = [tp.share(inter)] * 2
        gate_up = [f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"]
        self.gate_up_w = bag.take_cat(gate_up, rows=rows)
        self.gate_up_b = (
            bag.take_cat([f"{prefix}.gate_proj.bias", f"{prefix}.up_proj.bias"], rows=rows) if bias else None
        )
        start, length = rows[0] if rows else (0, 0)
        self.down_w = bag.take_shard(f"{prefix}.down_proj.weight", 1, start, length)
        self.down_b = bag.take(f"{prefix}.down_proj.bias") if bias and tp.rank == 0 else None
        if bias and tp.rank > 0:
            bag.take(f"{prefix}.down_proj.bias")  # added once, by rank 0
        self.packed = False  # gate_up_w / down_w in ops.pack_weight's layout (see pack_layer)
        if act in ("silu", "swish"):
            self.act, self.act_name = ops.silu_and_mul, "silu"
        elif act in ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast"):
            self.act, self.act_name = (lambda x: ops.gelu_and_mul(x, "tanh")), "gelu_tanh"
        elif act == "gelu":
            self.act, self.act_name = ops.gelu_and_mul, "gelu"
        else:
            raise ModelLoadError(f"activation {act!r} is not supported; supported: silu, gelu, gelu_pytorch_tanh")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """MLP output for x [T, hidden]."""
        gate_up = ops.linear(x, self.gate_up_w, self.gate_up_b, self.packed)
        return row_parallel(self.tp, self.act(gate_up), self.down_w, self.down_b, self.packed)


def pack_layer(attn: Attention, mlp: GatedMLP) -> None:
    """Repack a layer's four projection weights for ops.linear's one-stream layout, if all can be.

    A decode step streams every weight once, and a block of 4 interleaved rows streams faster than
    4 rows side by side (~23 against ~19 GB/s on 2 AVX2 cores). Results are identical either way.
    """
    if all(ops.can_pack(w) for w in (attn.qkv_w, attn.o_w, mlp.gate_up_w, mlp.down_w)):  # quantized: never
        attn.qkv_w, attn.o_w = ops.pack_weight(attn.qkv_w), ops.pack_weight(attn.o_w)
        mlp.gate_up_w, mlp.down_w = ops.pack_weight(mlp.gate_up_w), ops.pack_weight(mlp.down_w)
        attn.packed = mlp.packed = True


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


def finish_layer(layer, eps: float) -> None:
    """After a decoder layer's weights are in: pack its projections and build its fused kernel (layer.fused)."""
    pack_layer(layer.attn, layer.mlp)
    layer.fused = fused_layer(
        layer.in_norm,
        layer.post_norm,
        layer.attn,
        layer.mlp,
        eps,
        getattr(layer, "pre_ff_norm", None),
        getattr(layer, "post_ff_norm", None),
    )


def fused_layer(
    in_norm: torch.Tensor,
    post_attn_norm: torch.Tensor,
    attn: Attention,
    mlp: GatedMLP,
    eps: float,
    pre_ff_norm: torch.Tensor | None = None,
    post_ff_norm: torch.Tensor | None = None,
):
    """The layer as one kernel call (ops.DecoderLayer), or None where the per-op path runs instead.

    The fused layer calls the same kernels in the same order, so its results are identical; what it
    saves is the Python between them (~100 us per layer and step, a sixth of a small model's decode
    step). float32 keeps the per-op path: its GEMMs are torch's (see ops.linear).
    """
    if in_norm.dtype not in (torch.bfloat16, torch.float16) or not envs.FUSED_LAYERS.get():
        return None
    if not uses_kernels(attn.head_dim):
        return None  # attention runs on torch for this head size
    assert attn.packed == mlp.packed, "pack_layer packs a layer's four projections together"
    if attn.q_norm is not None and attn.norm_eps != eps:
        return None  # one epsilon serves every norm of the fused layer
    layer = ops.DecoderLayer(
        in_norm=in_norm,
        post_attn_norm=post_attn_norm,
        pre_ff_norm=pre_ff_norm,
        post_ff_norm=post_ff_norm,
        qkv_w=attn.qkv_w,
        qkv_b=attn.qkv_b,
        o_w=attn.o_w,
        o_b=attn.o_b,
        q_norm=attn.q_norm,
        k_norm=attn.k_norm,
        gate_up_w=mlp.gate_up_w,
        gate_up_b=mlp.gate_up_b,
        down_w=mlp.down_w,
        down_b=mlp.down_b,
        cos_sin=attn.cos_sin,
        num_heads=attn.num_heads,
        num_kv_heads=attn.num_kv_heads,
        head_size=attn.head_dim,
        act=mlp.act_name,
        eps=eps,
        scale=attn.scale,
        sliding_window=attn.sliding_window,
        soft_cap=attn.soft_cap,
        packed=attn.packed,
    )
    if attn.tp.size > 1:  # o_proj's and down_proj's partial sums meet in the kernel, through the same communicator
        layer.set_all_reduce(attn.tp.comm.native)
    return layer


def stage_stack(
    layers: list,
    h: torch.Tensor,
    residual: torch.Tensor | None,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    per_op,
    sample_idx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Run a pre-norm model's layers (this stage's): (h, residual) after them, and the rows of those to read.

    Each layer runs as its fused kernel when the step allows it (bf16/f16 layers, a kernel block size);
    otherwise per_op(layer, h, residual, kv) -> (h, residual) runs it op by op from Python. residual: None
    at the model's first layer (h starts the residual stream), else the stream the previous pipeline stage
    handed over with h.

    sample_idx: the rows whose outputs are read (None: all), each the last of its sequence's query rows, in
    order (the model runner's). The fused last layer then carries only those rows past its cache write:
    (h, residual) come back as theirs, and the rows to read as None; otherwise as given.
    """
    if layers and layers[0].fused is not None and uses_kernels(block_size=meta.block_size):
        first = residual is None
        if first:
            residual = torch.empty_like(h)
        pos, slots, qsl, lens, tables = (
            positions,
            meta.slot_mapping,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
        )
        last = len(layers) - 1
        for i, (layer, (k, v)) in enumerate(zip(layers, kv_caches, strict=True)):
            keep = sample_idx if i == last else None
            layer.fused.forward(
                h, residual, first and i == 0, pos, slots, qsl, lens, tables, ops.cache_view(k), ops.cache_view(v), keep
            )
        if sample_idx is not None:
            n = sample_idx.numel()
            return h[:n], residual[:n], None
    else:
        for layer, kv in zip(layers, kv_caches, strict=True):
            h, residual = per_op(layer, h, residual, kv)
    return h, residual, sample_idx


def final_rows(
    h: torch.Tensor, residual: torch.Tensor, sample_idx: torch.Tensor | None, final_norm: torch.Tensor, eps: float
) -> torch.Tensor:
    """The final norm of (h + residual) at the rows of sample_idx (all rows when None)."""
    h, residual = select_rows(h, sample_idx), select_rows(residual, sample_idx)
    ops.fused_add_rms_norm(h, residual, final_norm, eps)
    return h


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


def select_rows(x: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
    """x[idx] as a new contiguous tensor (all rows when idx is None)."""
    return x if idx is None else x.index_select(0, idx)
