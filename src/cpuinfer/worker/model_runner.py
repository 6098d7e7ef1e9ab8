"""ModelRunner: owns the weights and the paged KV cache; executes one flat batch per step.

The engine decides what runs (ScheduledSeq per sequence: the tokens to compute this step, how many
of its tokens are already cached, and its block table). The runner builds the flat metadata once
per step (input ids, positions, slot mapping, query_start_loc, seq_lens, block tables), runs the
model under inference_mode and returns float32 logits only for the sequences that sample.

A sequence verifying speculative tokens (num_spec > 0) wants the logits of its last num_spec + 1 rows, one
scoring its prompt (prompt_logits) those of every row of its chunk. The model's fused last layer can keep only
each sequence's last row, so a step with any sequence wanting more than one row asks the model for every row's
logits and picks the rows here. What that costs: the last layer and the LM head over the step's other rows too
(for SmolLM2 about a quarter of a row's work), which is why the engine does not speculate in a step that
carries a long prefill chunk (spec_decode.decoder).
"""

from __future__ import annotations

import numpy as np
import torch

from ..attention import AttentionMetadata
from ..attention.cache_dtypes import CACHE_DTYPES
from ..distributed.pipeline import SINGLE_STAGE, PPStage, micro_batches
from ..distributed.tensor_parallel import SINGLE, TPGroup
from ..engine.step import ScheduledSeq
from ..model_loader import ModelSpec, load_weights
from ..models import build_model
from ..platform.memory import release_free_heap, weight_arena, zeros_huge


class ModelRunner:
    """Weights + KV cache of one model; execute() runs one scheduled step."""

    def __init__(
        self,
        spec: ModelSpec,
        block_size: int,
        num_blocks: int,
        cache_dtype: torch.dtype | str | None = None,
        tp: TPGroup = SINGLE,
        pp: PPStage = SINGLE_STAGE,
        pooling: bool = False,
    ):
        """Load weights, allocate the KV cache ([num_blocks, kv_heads, block_size, head_size] K and V per layer).

        Under tensor parallelism (tp.size > 1) this process keeps rank tp.rank's share of the weights and its
        KV heads; every rank runs the same steps, and each returns the full logits. Under pipeline parallelism
        (pp.size > 1) it keeps stage pp.stage's layers and their KV caches only; rank 0 (the first stage's
        tensor-parallel rank 0) gets the logits from the last stage, the other ranks return no rows."""
        if cache_dtype == "auto":
            cache_dtype = None
        elif isinstance(cache_dtype, str):
            if cache_dtype not in CACHE_DTYPES:
                raise ValueError(
                    f"cache dtype {cache_dtype!r} is not supported; use one of auto, {', '.join(CACHE_DTYPES)}"
                )
            cache_dtype = CACHE_DTYPES[cache_dtype]
        if block_size <= 0 or num_blocks <= 0:
            raise ValueError(f"block_size and num_blocks must be positive, got {block_size} and {num_blocks}")
        self.spec = spec
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.cache_dtype = cache_dtype or spec.dtype
        tensors, extras = load_weights(spec)
        # A pooling model returns the final-normed hidden states of the requested rows instead of logits.
        self.pooling = pooling
        self.tp = tp
        self.pp = pp
        # The packed weights in huge pages: a decode step streams them all (platform.memory).
        with weight_arena():
            self.model = build_model(spec, tensors, extras, tp, pp)
        del tensors
        release_free_heap()  # the checkpoint's freed tensors, before the KV cache takes its memory
        shape = (num_blocks, spec.kv_heads_per_rank(tp.size), block_size, spec.head_size)
        # Huge pages where the OS offers them: attention reads the cache block by block at scattered places.
        self.kv_caches = [
            (zeros_huge(shape, self.cache_dtype), zeros_huge(shape, self.cache_dtype)) for _ in self.model.layers
        ]

    def _prepare(self, seqs: list[ScheduledSeq]):
        """Flat tensors and attention metadata for one step (built once, shared by every layer)."""
        bs = self.block_size
        qlens = [len(s.token_ids) for s in seqs]
        ctx = [s.start_pos + n for s, n in zip(seqs, qlens, strict=False)]
        total = sum(qlens)
        input_ids = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.int64)
        positions = np.empty(total, dtype=np.int64)
        slots = np.empty(total, dtype=np.int64)
        max_blocks = max(-(-c // bs) for c in ctx)
        tables = np.zeros((len(seqs), max_blocks), dtype=np.int32)
        start = 0
        for i, (s, n, c) in enumerate(zip(seqs, qlens, ctx, strict=False)):
            need = -(-c // bs)
            if len(s.block_table) < need:
                raise ValueError(
                    f"sequence {i}: block_table has {len(s.block_table)} blocks but positions up to "
                    f"{c - 1} need {need} (block_size {bs})"
                )
            table = np.asarray(s.block_table[:need], dtype=np.int64)
            pos = np.arange(s.start_pos, c, dtype=np.int64)
            positions[start : start + n] = pos
            slots[start : start + n] = table[pos // bs] * bs + pos % bs
            tables[i, :need] = table
            start += n
        qsl = np.zeros(len(seqs) + 1, dtype=np.int32)
        np.cumsum(qlens, out=qsl[1:])
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots),
            query_start_loc=torch.from_numpy(qsl),
            seq_lens=torch.tensor(ctx, dtype=torch.int32),
            block_tables=torch.from_numpy(tables),
            block_size=bs,
            query_lens=qlens,
            context_lens=ctx,
            max_query_len=max(qlens),
        )
        sample_rows = [
            row for i, s in enumerate(seqs) for row in range(int(qsl[i + 1]) - s.logit_rows, int(qsl[i + 1]))
        ]
        sample_idx = None if len(sample_rows) == total else torch.tensor(sample_rows, dtype=torch.int64)
        return input_ids, torch.from_numpy(positions), meta, sample_idx, len(sample_rows)

    def check(self, seqs: list[ScheduledSeq]) -> None:
        """Raise ValueError for a step the model cannot run (before any rank starts it)."""
        for s in seqs:
            if not s.token_ids:
                raise ValueError("every scheduled sequence must compute at least one token")
            if s.start_pos + len(s.token_ids) > self.spec.max_model_len:
                raise ValueError(
                    f"position {s.start_pos + len(s.token_ids) - 1} exceeds the model's maximum length "
                    f"{self.spec.max_model_len}"
                )

    @torch.inference_mode()
    def execute(self, seqs: list[ScheduledSeq], checked: bool = False) -> torch.Tensor:
        """Run one flat step; float32 logits [sum of the seqs' logit_rows, vocab]: per sequence in order, its last
        token's row (sample=True), its last num_spec + 1 rows (verifying proposals) or every token's
        (prompt_logits=True)."""
        if not seqs:
            return torch.empty(0, self.out_width, dtype=torch.float32)
        if not checked:
            self.check(seqs)
        if self.pp.size > 1:
            return self._execute_stage(seqs)
        return self._forward(seqs)

    def _forward(self, seqs: list[ScheduledSeq], carry=None):
        """The model over one (micro-)batch: logits, or a stage before the last's activations for the next."""
        input_ids, positions, meta, sample_idx, n_sample = self._prepare(seqs)
        if n_sample == 0:
            sample_idx = torch.empty(0, dtype=torch.int64)
        pick = None
        if sample_idx is not None and any(s.logit_rows > 1 for s in seqs):
            pick, sample_idx = sample_idx, None  # several rows of one sequence: all rows' outputs, picked below
        if self.pooling and any(s.token_type_ids for s in seqs):
            types = torch.tensor([t for s in seqs for t in s.token_type_ids or [0] * len(s.token_ids)])
            out = self.model.forward(
                input_ids, positions, meta, self.kv_caches, sample_idx, hidden=True, token_types=types
            )
        elif self.pooling:
            out = self.model.forward(input_ids, positions, meta, self.kv_caches, sample_idx, carry, hidden=True)
        elif carry is None:
            out = self.model.forward(input_ids, positions, meta, self.kv_caches, sample_idx)
        else:
            out = self.model.forward(input_ids, positions, meta, self.kv_caches, sample_idx, carry)
        return out if pick is None or not self.pp.last else out[pick]

    @torch.inference_mode()
    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """A sequence classifier's logits [n, num_labels] of its pooled vectors [n, hidden] (its head, float32)."""
        return self.model.classifier(pooled)

    @property
    def out_width(self) -> int:
        """Columns of execute()'s rows: the vocabulary (logits), or the hidden size on a pooling model."""
        return self.spec.hidden_size if self.pooling else self.spec.vocab_size

    def _execute_stage(self, seqs: list[ScheduledSeq]) -> torch.Tensor:
        """This pipeline stage's share of a step: each micro-batch from the previous stage (or the token ids),
        through this stage's layers, to the next stage; the last stage's logits go to rank 0 once, at the end
        (distributed.pipeline says why)."""
        pp = self.pp
        count, width = self.model.carry_shape
        outs = []
        for lo, hi in micro_batches([len(s.token_ids) for s in seqs], pp.micro, pp.min_tokens):
            mb = seqs[lo:hi]
            carry = None
            if not pp.first:
                carry = pp.recv(count, sum(len(s.token_ids) for s in mb), width, self.spec.dtype)
            out = self._forward(mb, carry)
            if pp.last:
                outs.append(out)
            else:
                pp.send(out)
        n_sample = sum(s.logit_rows for s in seqs)
        if pp.last:
            logits = torch.cat(outs) if len(outs) > 1 else outs[0]
            if pp.logits is not None:
                pp.logits.broadcast_(logits.contiguous(), 0)
            return logits
        if pp.logits is not None:  # rank 0: the step's logits, from the last stage
            return pp.logits.broadcast_(torch.empty(n_sample, self.out_width, dtype=torch.float32), 0)
        return torch.empty(0, self.out_width, dtype=torch.float32)
