"""Tensor parallelism: every layer split over the ranks of one engine core (Megatron-style).

Each rank is a process on its own cores and NUMA node (cpuinfer.distributed.executor) and holds:
- column-parallel QKV and gate/up: its share of the query heads (q rows), of the KV heads (k, v rows)
  and of the intermediate features (gate rows and up rows);
- row-parallel o_proj and down_proj: the matching input columns; their partial products are summed over
  the ranks by one all-reduce each (in shared memory, cpuinfer.distributed.shm), and their biases are
  added once, by rank 0;
- a vocabulary-parallel embedding and lm_head: rows [r * V', (r + 1) * V') of the table, V' = ceil(V / tp)
  (the last shard padded with zero rows); a lookup takes the rows this rank holds and zeros elsewhere, then
  one all-reduce; logits are gathered over the ranks and trimmed to V.
GQA with fewer KV heads than ranks replicates: rank r holds KV head r * kv_heads // tp, the one its query
heads attend to. Norms, rotary tables and everything else are replicated.

Quantized weights are split in their packed layout (quantization/weight.py): rows at 16-row panel
boundaries, columns at group boundaries. A weight that cannot be cut there (GPTQ act-order columns, whose
groups are scattered over the input features) is dequantized for this rank's share, with one warning.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from ..quantization.weight import BLOCK, LANES, QuantWeight, is_quantized

logger = logging.getLogger("cpuinfer.distributed")


@dataclass(frozen=True)
class TPGroup:
    """This process's place among the tensor-parallel ranks, and their communicator (None when alone)."""

    rank: int = 0
    size: int = 1
    comm: Any = None  # cpuinfer.distributed.shm.ShmCommunicator

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum t over the ranks, in place (every rank gets the same bits)."""
        if self.size > 1:
            self.comm.all_reduce_(t)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's t concatenated along dim, in rank order."""
        return self.comm.all_gather(t, dim) if self.size > 1 else t

    def share(self, n: int) -> tuple[int, int]:
        """(start, length) of this rank's equal share of n (n divisible by the size)."""
        per = n // self.size
        return self.rank * per, per


SINGLE = TPGroup()


def check_divisible(spec, tp: int) -> None:
    """Raise ValueError naming --tensor-parallel-size when the model's heads cannot be split over tp ranks."""
    cfg = spec.hf_config
    heads = int(cfg.get("num_attention_heads") or 0)
    kv = spec.num_kv_heads
    problems = []
    if heads % tp:
        problems.append(f"its {heads} attention heads are not divisible by {tp}")
    if kv % tp and tp % kv:
        problems.append(f"its {kv} KV heads neither divide by {tp} nor divide {tp} (replication)")
    inter = cfg.get("intermediate_size") or cfg.get("ffn_dim")
    if inter and int(inter) % tp:
        problems.append(f"its intermediate size {inter} is not divisible by {tp}")
    if problems:
        raise ValueError(
            f"--tensor-parallel-size={tp} cannot split {spec.path}: {'; '.join(problems)}. "
            "Choose a size that divides the head counts"
        )


def kv_head_range(kv_heads: int, tp: TPGroup) -> tuple[int, int]:
    """(first KV head, count) this rank holds: its share, or the one head its query heads use."""
    if kv_heads >= tp.size:
        return tp.share(kv_heads)
    return tp.rank * kv_heads // tp.size, 1


_warned: set[str] = set()


def narrow(w, dim: int, start: int, length: int, what: str, dtype: torch.dtype):
    """w[start:start + length] along dim (0 = output rows, 1 = input columns), for dense and quantized weights
    (a quantized share that cannot be cut in its packed form is dequantized to dtype, the run dtype)."""
    if w is None:
        return None
    if not is_quantized(w):
        if start == 0 and length == w.shape[dim]:
            return w
        return w.narrow(dim, start, length).contiguous()
    if dim == 0:
        return _quant_rows(w, start, length, what, dtype)
    return _quant_cols(w, start, length, what, dtype)


def _dense_fallback(w: QuantWeight, dim: int, start: int, length: int, what: str, why: str, dtype) -> torch.Tensor:
    if what not in _warned:
        _warned.add(what)
        logger.warning(
            "tensor parallel: %s (%s) cannot be split in its packed form (%s); this rank keeps its share "
            "dequantized to %s",
            what,
            w.kind,
            why,
            dtype,
        )
    return w.dequantize(dtype).narrow(dim, start, length).contiguous()


def _quant_rows(w: QuantWeight, start: int, length: int, what: str, dtype):
    if start == 0 and length == w.n:
        return w
    if start % LANES or (length % LANES and start + length != w.n):
        return _dense_fallback(w, 0, start, length, what, f"rows {start}..{start + length} cut a 16-row panel", dtype)
    panels = -(-w.n // LANES)
    p0, p1 = start // LANES, -(-(start + length) // LANES)

    def cut(t):
        return None if t is None else t.view(panels, -1)[p0:p1].reshape(-1).clone()

    return dataclasses.replace(w, qs=cut(w.qs), d=cut(w.d), z=cut(w.z), m=cut(w.m), n=length)


def _quant_cols(w: QuantWeight, start: int, length: int, what: str, dtype):
    if start == 0 and length == w.k:
        return w
    step = math.lcm(BLOCK, w.group)
    if w.perm is not None:
        return _dense_fallback(w, 1, start, length, what, "its input features are in act-order", dtype)
    if start % step or length % step:
        return _dense_fallback(
            w, 1, start, length, what, f"columns {start}..{start + length} cut a {step}-group", dtype
        )
    panels, blocks, groups = -(-w.n // LANES), w.k // BLOCK, w.k // w.group
    b0, b1, g0, g1 = start // BLOCK, (start + length) // BLOCK, start // w.group, (start + length) // w.group

    def cut_qs(t):
        return t.view(panels, blocks, -1)[:, b0:b1].reshape(-1).clone()

    def cut_g(t):
        return None if t is None else t.view(panels, groups, LANES)[:, g0:g1].reshape(-1).clone()

    return dataclasses.replace(w, qs=cut_qs(w.qs), d=cut_g(w.d), z=cut_g(w.z), m=cut_g(w.m), k=length)


def vocab_shard(vocab: int, tp: TPGroup) -> tuple[int, int]:
    """(first row, rows per shard) of this rank's vocabulary shard: ceil(V / tp) rows, the last padded."""
    per = -(-vocab // tp.size)
    return tp.rank * per, per


def shard_vocab_rows(table, tp: TPGroup, what: str, dtype: torch.dtype):
    """This rank's rows of an embedding or lm_head table, zero-padded to the shard size (a ragged quantized
    shard becomes dense in dtype)."""
    if tp.size == 1 or table is None:
        return table
    vocab = table.shape[0]
    start, per = vocab_shard(vocab, tp)
    have = max(0, min(per, vocab - start))
    if is_quantized(table):
        if have == per:
            return narrow(table, 0, start, per, what, dtype)
        table = table.dequantize(dtype)  # a ragged last shard: dense (rare: V % (16 * tp) != 0)
    out = torch.zeros(per, table.shape[1], dtype=table.dtype)
    if have:
        out[:have] = table[start : start + have]
    return out
