"""BERT encoders (`BertModel`: bge, e5, all-MiniLM): bidirectional attention, no KV cache.

A first, plain form: post-norm layers (LayerNorm with bias), GELU MLP, absolute positions and token types,
each linear on cpuinfer.ops (our GEMM in bf16/f16, torch's in float32), attention by torch's SDPA one sequence
at a time over a flat batch without padding (cu_seqlens, as the engine lays sequences out). It is not on the
engine's scheduler yet: `BertEncoder.embed` runs a list of token-id lists in batches of a token budget.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import ops
from ..model_loader.config_check import check_config
from ..model_loader.errors import ModelLoadError
from ..model_loader.hf_dir import read_json, safetensors_tensors
from .pooler import PoolerConfig, finish_pooled, resolve_pooler

_ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh")}


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


class BertEncoder:
    """A BertModel checkpoint directory, loaded for embedding (pooled per sentence-transformers' files)."""

    def __init__(self, path: str, dtype: torch.dtype = torch.float32, pooler_config: str | dict | None = None):
        config = read_json(os.path.join(path, "config.json"))
        check_config(config, os.path.join(path, "config.json"))
        arch = (config.get("architectures") or ["BertModel"])[0]
        if arch != "BertModel" or config.get("position_embedding_type", "absolute") != "absolute":
            raise ModelLoadError(
                f"{path}: {arch} with {config.get('position_embedding_type')} positions is not supported"
            )
        act = config.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ModelLoadError(f"{path}: hidden_act {act!r} is not supported; use one of {', '.join(_ACTIVATIONS)}")
        self.act = _ACTIVATIONS[act]
        self.dtype = dtype
        self.hidden = int(config["hidden_size"])
        self.heads = int(config["num_attention_heads"])
        self.eps = float(config.get("layer_norm_eps", 1e-12))
        self.max_model_len = int(config.get("max_position_embeddings", 512))
        self.vocab_size = int(config["vocab_size"])
        self.pooler: PoolerConfig = resolve_pooler(path, config, pooler_config)
        t = {k.removeprefix("bert."): v for k, v in safetensors_tensors(path, dtype)}
        # bf16/f16 weights in our GEMM's panel layout (row-major ones would take the GEMV kernel at every M).
        self.packed = dtype in (torch.bfloat16, torch.float16)

        def take(name: str, dt: torch.dtype = dtype) -> torch.Tensor:
            if name not in t:
                raise ModelLoadError(f"{path}: the checkpoint has no tensor {name}")
            return t.pop(name).to(dt).contiguous()

        def ln(prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
            return take(f"{prefix}.weight", torch.float32), take(f"{prefix}.bias", torch.float32)

        self.word = take("embeddings.word_embeddings.weight", torch.float32)
        self.pos = take("embeddings.position_embeddings.weight", torch.float32)
        self.types = take("embeddings.token_type_embeddings.weight", torch.float32)
        self.emb_ln = ln("embeddings.LayerNorm")
        self.layers = []
        for i in range(int(config["num_hidden_layers"])):
            p = f"encoder.layer.{i}."
            qkv = [take(f"{p}attention.self.{n}.weight") for n in ("query", "key", "value")]
            mat = self._matrix
            qkv_b = [take(f"{p}attention.self.{n}.bias") for n in ("query", "key", "value")]
            self.layers.append(
                _BertLayer(
                    mat(torch.cat(qkv)),
                    torch.cat(qkv_b).contiguous(),
                    mat(take(f"{p}attention.output.dense.weight")),
                    take(f"{p}attention.output.dense.bias"),
                    ln(f"{p}attention.output.LayerNorm"),
                    mat(take(f"{p}intermediate.dense.weight")),
                    take(f"{p}intermediate.dense.bias"),
                    mat(take(f"{p}output.dense.weight")),
                    take(f"{p}output.dense.bias"),
                    ln(f"{p}output.LayerNorm"),
                )
            )

    def _matrix(self, w: torch.Tensor) -> torch.Tensor:
        """A linear's weight as ops.linear takes it here (packed in bf16/f16)."""
        return ops.pack_weight(w) if self.packed else w.contiguous()

    def _linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, w, b, packed=self.packed)

    def _ln(self, x: torch.Tensor, wb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """LayerNorm in float32, back in the run dtype."""
        return F.layer_norm(x.float(), (self.hidden,), wb[0], wb[1], self.eps).to(self.dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        """Final hidden states [tokens, hidden] of a flat batch of whole sequences (cu_seqlens: their bounds)."""
        types = torch.zeros_like(input_ids)
        h = F.embedding(input_ids, self.word) + F.embedding(positions, self.pos) + F.embedding(types, self.types)
        h = F.layer_norm(h, (self.hidden,), *self.emb_ln, self.eps).to(self.dtype)
        d = self.hidden // self.heads
        for layer in self.layers:
            qkv = self._linear(h, layer.qkv_w, layer.qkv_b)
            q, k, v = qkv.view(-1, 3, self.heads, d).unbind(1)
            attn = torch.empty(h.shape[0], self.heads, d, dtype=h.dtype)
            for a, b in itertools.pairwise(cu_seqlens):
                # [heads, L, d] per sequence: every token sees every other (no mask, no padding).
                o = F.scaled_dot_product_attention(
                    q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1)
                )
                attn[a:b] = o.transpose(0, 1)
            h = self._ln(h + self._linear(attn.view(-1, self.hidden), layer.out_w, layer.out_b), layer.ln1)
            up = self.act(self._linear(h, layer.up_w, layer.up_b))
            h = self._ln(h + self._linear(up, layer.down_w, layer.down_b), layer.ln2)
        return h

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
            h = self.forward(flat, pos, bounds).float()
            for a, b in itertools.pairwise(bounds):
                rows = h[a:b]
                kind = self.pooler.pooling_type
                vec = rows.mean(0) if kind == "MEAN" else rows[0] if kind == "CLS" else rows[-1]
                out.append(finish_pooled(vec, norm, dimensions))
            batch = [ids] if ids is not None else []
        return torch.stack(out)
