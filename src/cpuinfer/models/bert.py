"""BERT encoders (`BertModel`: bge, e5, all-MiniLM; `XLMRobertaModel`: bge-m3's dense form): bidirectional
attention, no KV cache; and their cross-encoder forms (`*ForSequenceClassification`: bge-reranker).

A first, plain form: post-norm layers (LayerNorm with bias), GELU MLP, absolute positions and token types,
each linear on cpuinfer.ops (our packed GEMM in bf16/f16, torch's in float32). Attention over a flat batch
without padding (the engine's layout: query_start_loc bounds each sequence): in the engine, the paged attention
kernel with causal=False over the step's own cache blocks (head sizes it takes: 64 and up), else torch's SDPA
one sequence at a time. `BertModel` is the engine's (pooling runner only; the scheduler hands it whole prompts);
`BertEncoder` loads a directory on its own and embeds token-id lists in batches of a token budget.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import ops
from ..attention import AttentionMetadata
from ..attention.backend import uses_kernels
from ..model_loader.config_check import check_config
from ..model_loader.errors import ModelLoadError
from ..model_loader.hf_dir import read_json, safetensors_tensors
from ..quantization import is_quantized
from .classifier import ClassifierHead
from .layers import cat_rows, select_rows
from .pooler import PoolerConfig, finish_pooled, resolve_pooler

# In place, on the kernels' own activations (torch's bf16 GELU took ~1.3 ms of a 64-token BERT-base query).
_ACTIVATIONS = {"gelu": lambda x: ops.gelu(x, out=x), "gelu_new": lambda x: ops.gelu(x, "tanh", out=x)}
# The base models' pooler (an NSP head, which no embedding reads) and buffers some checkpoints carry.
_UNUSED = ("pooler.dense.weight", "pooler.dense.bias", "embeddings.position_ids", "embeddings.token_type_ids")
_PREFIXES = ("bert.", "roberta.")  # BertFor* / XLMRobertaFor* checkpoints keep the encoder under these


def is_roberta(config: dict) -> bool:
    """True for the (XLM-)RoBERTa form: positions counted from padding_idx + 1, not 0."""
    arch = (config.get("architectures") or [""])[0]
    return config.get("model_type") in ("roberta", "xlm-roberta") or "Roberta" in arch


def position_offset(config: dict) -> int:
    """The first position id of a sequence: RoBERTa's embeddings number real tokens from padding_idx + 1 (its
    create_position_ids_from_input_ids), BERT's from 0."""
    return int(config.get("pad_token_id", 1)) + 1 if is_roberta(config) else 0


@dataclass
class _BertLayer:
    """One post-norm encoder layer's weights (the fused QKV projection as one matrix)."""

    qkv_w: torch.Tensor
    qkv_b: torch.Tensor
    out_w: torch.Tensor
    out_b: torch.Tensor
    ln1: tuple[torch.Tensor, torch.Tensor]
    up_w: torch.Tensor
    up_b: torch.Tensor
    down_w: torch.Tensor
    down_b: torch.Tensor
    ln2: tuple[torch.Tensor, torch.Tensor]


class BertWeights:
    """A BertModel's weights and shapes, taken by name (take(name, dtype); dtype None: a matrix as the loader kept
    it, a GGUF file's quantized blocks packed for the integer kernels) and run by forward()."""

    def __init__(self, config: dict, take: Callable[[str, torch.dtype], torch.Tensor], dtype: torch.dtype, source: str):
        arch = (config.get("architectures") or ["BertModel"])[0]
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise ModelLoadError(
                f"{source}: {arch} with {config['position_embedding_type']} positions is not supported"
            )
        act = config.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ModelLoadError(f"{source}: hidden_act {act!r} is not supported; use one of {', '.join(_ACTIVATIONS)}")
        self.act = _ACTIVATIONS[act]
        self.dtype = dtype
        self.hidden = int(config["hidden_size"])
        self.heads = int(config["num_attention_heads"])
        self.eps = float(config.get("layer_norm_eps", 1e-12))
        self.pos_offset = position_offset(config)
        # bf16/f16 weights in our GEMM's panel layout (row-major ones would take the GEMV kernel at every M).
        self.packed = dtype in (torch.bfloat16, torch.float16)

        def mat(*names: str) -> torch.Tensor:
            """One weight, or several stacked by rows (the fused QKV); quantized ones stay as they are."""
            w = cat_rows([take(n, None) for n in names], dtype) if len(names) > 1 else take(names[0], None)
            return ops.pack_weight(w) if self.packed and not is_quantized(w) else w

        def ln(prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
            return take(f"{prefix}.weight", torch.float32), take(f"{prefix}.bias", torch.float32)

        self.word = take("embeddings.word_embeddings.weight", torch.float32)
        self.pos = take("embeddings.position_embeddings.weight", torch.float32)
        self.types = take("embeddings.token_type_embeddings.weight", torch.float32)
        self.emb_ln = ln("embeddings.LayerNorm")
        self.layers = []
        for i in range(int(config["num_hidden_layers"])):
            p = f"encoder.layer.{i}."
            self.layers.append(
                _BertLayer(
                    mat(*(f"{p}attention.self.{n}.weight" for n in ("query", "key", "value"))),
                    torch.cat([take(f"{p}attention.self.{n}.bias", dtype) for n in ("query", "key", "value")]),
                    mat(f"{p}attention.output.dense.weight"),
                    take(f"{p}attention.output.dense.bias", dtype),
                    ln(f"{p}attention.output.LayerNorm"),
                    mat(f"{p}intermediate.dense.weight"),
                    take(f"{p}intermediate.dense.bias", dtype),
                    mat(f"{p}output.dense.weight"),
                    take(f"{p}output.dense.bias", dtype),
                    ln(f"{p}output.LayerNorm"),
                )
            )

    def _linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, w, b, packed=self.packed)

    def _add_ln(self, y: torch.Tensor, h: torch.Tensor, wb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """h <- LayerNorm(h + y) (the sum in the run dtype, the statistics in float32), in place."""
        return ops.add_layer_norm(y, h, wb[0], wb[1], self.eps, out=h)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        bounds: list[int],
        token_types: torch.Tensor | None = None,
        paged: tuple[list, AttentionMetadata] | None = None,
    ) -> torch.Tensor:
        """Final hidden states [tokens, hidden] of a flat batch of whole sequences (bounds: their row offsets;
        positions count from 0 in each; token_types: segment ids, all 0 when None). paged: the engine's
        (KV caches, metadata), whose caches the attention kernel reads the keys and values from (each step's
        own: nothing is kept between steps); None: torch's SDPA."""
        types = torch.zeros_like(input_ids) if token_types is None else token_types
        positions = positions + self.pos_offset
        h = F.embedding(input_ids, self.word) + F.embedding(positions, self.pos) + F.embedding(types, self.types)
        h = F.layer_norm(h, (self.hidden,), *self.emb_ln, self.eps).to(self.dtype)
        d = self.hidden // self.heads
        if paged is not None and not uses_kernels(d, paged[1].block_size):
            paged = None  # a head size the kernels do not take (all-MiniLM's 32)
        for i, layer in enumerate(self.layers):
            q, k, v = self._linear(h, layer.qkv_w, layer.qkv_b).view(-1, 3, self.heads, d).unbind(1)
            attn = torch.empty(h.shape[0], self.heads, d, dtype=h.dtype)
            if paged is not None:
                # The flat batch's keys and values into this step's cache blocks, then one kernel call over all
                # sequences (query_start_loc bounds each; no padding), every row seeing its whole sequence.
                (kc, vc), meta = paged[0][i], paged[1]
                ops.reshape_and_cache(k, v, kc, vc, meta.slot_mapping)
                ops.paged_attention(
                    attn, q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_tables, d**-0.5, causal=False
                )
            else:
                for a, b in itertools.pairwise(bounds):
                    # [1, heads, L, d] per sequence: every token sees every other (no mask, no padding). Four
                    # dimensions: torch's fused CPU attention takes them; 3-D inputs fall back to its math path
                    # (~3x slower in bf16 here: separate matmuls, softmax and masking passes).
                    qs, ks, vs = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
                    attn[a:b] = F.scaled_dot_product_attention(qs, ks, vs)[0].transpose(0, 1)
            h = self._add_ln(self._linear(attn.view(-1, self.hidden), layer.out_w, layer.out_b), h, layer.ln1)
            up = self.act(self._linear(h, layer.up_w, layer.up_b))
            h = self._add_ln(self._linear(up, layer.down_w, layer.down_b), h, layer.ln2)
        return h


class BertModel:
    """The engine's BERT encoder (registry: BertModel): whole prompts in, final hidden states of asked rows out."""

    is_encoder = True
    # Attention on the paged kernel (bidirectional, over the step's cache blocks) where it takes the head size;
    # False: torch's SDPA per sequence (bench_embed compares the two).
    paged_attention = True

    def __init__(self, config: dict, bag, max_positions: int, rope_freq_factors=None):  # noqa: ARG002 - the registry's one signature
        for name in list(bag.tensors):
            if name.startswith(_PREFIXES):
                bag.tensors[name.split(".", 1)[1]] = bag.tensors.pop(name)
        self.classifier = self._classifier(config, bag)
        for name in _UNUSED:
            bag.tensors.pop(name, None)
        self.weights = BertWeights(config, bag.take, bag.dtype, bag.source)
        self.layers = self.weights.layers
        self.carry_shape = (1, self.weights.hidden)

    def _classifier(self, config: dict, bag) -> ClassifierHead | None:  # noqa: ARG002 - the subclasses' signature
        """The sequence-classification head on the pooled vector (None: an embedding model)."""
        return None

    @torch.inference_mode()
    def forward(
        self,
        input_ids,
        positions,
        meta,
        kv_caches,
        sample_idx,
        carry=None,
        hidden: bool = False,
        token_types=None,
    ):
        """The final hidden states of the rows at sample_idx; every sequence must be whole in this step."""
        if not hidden or carry is not None:
            raise ValueError("a BERT encoder only pools (--runner pooling) on one rank")
        if list(meta.context_lens) != list(meta.query_lens):
            raise ValueError("an encoder step must hold whole prompts (bidirectional attention, no KV cache)")
        paged = (kv_caches, meta) if self.paged_attention else None
        h = self.weights.forward(input_ids, positions, meta.query_start_loc.tolist(), token_types, paged)
        return select_rows(h, sample_idx)


class BertForSequenceClassification(BertModel):
    """A cross-encoder (bge-reranker, ms-marco MiniLM): the encoder, its first token pooled, then BERT's pooler
    (dense + tanh) and classifier, or XLM-RoBERTa's classification head (the same two layers, other names)."""

    def _classifier(self, config: dict, bag) -> ClassifierHead:
        """BERT: pooler.dense + classifier; (XLM-)RoBERTa: classifier.dense + classifier.out_proj."""
        f32 = torch.float32
        roberta = is_roberta(config)
        dense, out = ("classifier.dense", "classifier.out_proj") if roberta else ("pooler.dense", "classifier")
        return ClassifierHead(
            bag.take(f"{out}.weight", f32),
            bag.take(f"{out}.bias", f32),
            bag.take(f"{dense}.weight", f32),
            bag.take(f"{dense}.bias", f32),
        )


class BertEncoder:
    """A BertModel checkpoint directory loaded on its own, for embedding (pooled per sentence-transformers' files)."""

    def __init__(self, path: str, dtype: torch.dtype = torch.float32, pooler_config: str | dict | None = None):
        config = read_json(os.path.join(path, "config.json"))
        check_config(config, os.path.join(path, "config.json"))
        t = {k.split(".", 1)[1] if k.startswith(_PREFIXES) else k: v for k, v in safetensors_tensors(path, dtype)}

        def take(name: str, dt: torch.dtype | None) -> torch.Tensor:
            if name not in t:
                raise ModelLoadError(f"{path}: the checkpoint has no tensor {name}")
            return t.pop(name).to(dt or dtype).contiguous()

        self.weights = BertWeights(config, take, dtype, path)
        self.hidden = self.weights.hidden
        self.max_model_len = int(config.get("max_position_embeddings", 512)) - position_offset(config)
        self.vocab_size = int(config["vocab_size"])
        self.pooler: PoolerConfig = resolve_pooler(path, config, pooler_config)

    def embed(
        self,
        prompts: list[list[int]],
        normalize: bool | None = None,
        dimensions: int | None = None,
        max_batch_tokens: int = 8192,
    ) -> torch.Tensor:
        """Pooled float32 vectors [len(prompts), hidden] of token-id lists, run in flat batches of whole inputs."""
        for i, ids in enumerate(prompts):
            if not ids or len(ids) > self.max_model_len:
                raise ValueError(f"input {i} has {len(ids)} tokens; this model takes 1..{self.max_model_len}")
            if min(ids) < 0 or max(ids) >= self.vocab_size:
                raise ValueError(f"input {i} has token ids outside the vocabulary of {self.vocab_size}")
        if not prompts:
            return torch.empty(0, dimensions or self.hidden)
        norm = self.pooler.normalize if normalize is None else normalize
        out, batch = [], []
        for ids in [*prompts, None]:
            if ids is not None and (not batch or sum(map(len, batch)) + len(ids) <= max_batch_tokens):
                batch.append(ids)
                continue
            bounds = [0]
            for b in batch:
                bounds.append(bounds[-1] + len(b))
            flat = torch.tensor([t for b in batch for t in b], dtype=torch.int64)
            pos = torch.cat([torch.arange(len(b)) for b in batch])
            h = self.weights.forward(flat, pos, bounds).float()
            for a, b in itertools.pairwise(bounds):
                rows = h[a:b]
                kind = self.pooler.pooling_type
                vec = rows.mean(0) if kind == "MEAN" else rows[0] if kind == "CLS" else rows[-1]
                out.append(finish_pooled(vec, norm, dimensions))
            batch = [ids] if ids is not None else []
        return torch.stack(out)
