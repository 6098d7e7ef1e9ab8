"""A single GGUF file: its metadata as a Hugging Face style config, and its tensors dequantized.

Tensor names follow llama.cpp (blk.N.attn_q ...); we rename them to the Hugging Face names the
models load, undo the Q/K row permutation llama.cpp's converter applies to llama-arch models,
and shift Gemma's norm weights back (llama.cpp stores 1 + w).
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from collections.abc import Iterator

import numpy as np
import torch

from .. import envs
from ..quantization import QuantWeight, gguf_blocks
from ..quantization.gguf_blocks import KEPT_TYPES
from .config_check import check_config
from .errors import ModelLoadError
from .gguf_reader import GGUFReader

logger = logging.getLogger(__name__)

SUPPORTED_TENSOR_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "MXFP4",
)

# general.architecture -> (HF architecture, HF model_type)
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "gpt-oss": ("GptOssForCausalLM", "gpt_oss"),
    "bert": ("BertModel", "bert"),  # an encoder: the pooling runner's
}
# llama.cpp writes Mixtral as "llama" with experts (llama.expert_count).
_MIXTRAL = ("MixtralForCausalLM", "mixtral")

_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.layer_norm_epsilon": "layer_norm_eps",  # BERT's LayerNorm
    "attention.key_length": "head_dim",
    "attention.sliding_window": "sliding_window",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
    "final_logit_softcapping": "final_logit_softcapping",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA_LAYER_NAMES = dict(
    _LAYER_NAMES,
    ffn_norm="pre_feedforward_layernorm",
    post_attention_norm="post_attention_layernorm",
    post_ffw_norm="post_feedforward_layernorm",
)
# Mixture-of-experts layers: the router, and each projection of every expert stacked in one 3-D tensor
# [experts, out, in] (split into the Hugging Face per-expert names at load).
_MOE_ROUTER = "ffn_gate_inp"
_MOE_STACKS = {"ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}  # -> gate, up, down
# (router name, expert name pattern, (gate, up, down) names) per Hugging Face architecture
_MOE_HF_NAMES = {
    "Qwen3MoeForCausalLM": ("mlp.gate", "mlp.experts.{}", ("gate_proj", "up_proj", "down_proj")),
    "MixtralForCausalLM": ("block_sparse_moe.gate", "block_sparse_moe.experts.{}", ("w1", "w3", "w2")),
    "GptOssForCausalLM": ("mlp.router", "mlp.experts.{}", ("gate_proj", "up_proj", "down_proj")),
}
# gpt-oss: its pre-MLP norm is post_attention_norm in llama.cpp, and its attention sinks are a vector per layer.
_GPT_OSS_LAYER_NAMES = dict(_LAYER_NAMES, post_attention_norm="post_attention_layernorm", attn_sinks="self_attn.sinks")
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# BERT (llama.cpp's `bert`: gguf-py's MODEL_TENSORS[MODEL_ARCH.BERT]) -> BertModel's names (models/bert.py).
_BERT_GLOBAL_NAMES = {
    "token_embd": "embeddings.word_embeddings",
    "position_embd": "embeddings.position_embeddings",
    "token_types": "embeddings.token_type_embeddings",
    "token_embd_norm": "embeddings.LayerNorm",
}
_BERT_LAYER_NAMES = {
    "attn_q": "attention.self.query",
    "attn_k": "attention.self.key",
    "attn_v": "attention.self.value",
    "attn_output": "attention.output.dense",
    "attn_output_norm": "attention.output.LayerNorm",
    "ffn_up": "intermediate.dense",
    "ffn_down": "output.dense",
    "layer_output_norm": "output.LayerNorm",
}
# llama.cpp's enum llama_pooling_type (bert.pooling_type) -> the pooler's names (models/pooler.py); NONE (0, one
# vector per token) and RANK (4, a reranker's classifier head) are not embedding poolings this engine runs.
BERT_POOLING = {1: "MEAN", 2: "CLS", 3: "LAST"}
_BERT_TABLES = ("token_embd", "position_embd", "token_types")  # embedding tables: rows looked up, float32, no bias
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


class GGUFFile:
    """Metadata and tensors of one .gguf file (memory-mapped; tensors are read on demand)."""

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise ModelLoadError(f"GGUF file {path!r} does not exist")
        self.reader = GGUFReader(path)
        self.path = path
        self.fields = self.reader.fields
        self.arch = self.get("general.architecture")
        if self.arch not in GGUF_ARCHITECTURES:
            raise ModelLoadError(
                f"{path}: GGUF architecture {self.arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}"
            )
        self.tensor_names = {t.name for t in self.reader.tensors}
        self.architecture, self.model_type = self._architecture()
        self._moe_names = _MOE_HF_NAMES.get(self.architecture)  # a MoE architecture's tensor names

    def get(self, key: str, default=None):
        """The metadata value for key (python scalar, str or list), or default."""
        return self.fields.get(key, default)

    def _architecture(self) -> tuple[str, str]:
        """(HF architecture, model_type) the metadata declares."""
        architecture, model_type = GGUF_ARCHITECTURES[self.arch]
        name = str(self.get("general.name", "") or "").lower()
        if self.arch == "llama" and "mistral" in name:
            architecture, model_type = GGUF_ARCHITECTURES["mistral"]
        if self.arch == "llama" and self.get("llama.expert_count"):
            architecture, model_type = _MIXTRAL
        return architecture, model_type

    def config(self) -> dict:
        """A Hugging Face style config dict built from the metadata."""
        arch, architecture = self.arch, self.architecture
        cfg: dict = {"architectures": [architecture], "model_type": self.model_type}
        for key, hf_key in _CONFIG_KEYS.items():
            value = self.get(f"{arch}.{key}")
            if value is not None:
                cfg[hf_key] = value
        for key in ("block_count", "embedding_length", "attention.head_count"):
            if f"{arch}.{key}" not in self.fields:
                raise ModelLoadError(f"{self.path}: GGUF metadata lacks {arch}.{key}")
        if isinstance(cfg.get("num_key_value_heads"), list) or isinstance(cfg.get("num_attention_heads"), list):
            raise ModelLoadError(f"{self.path}: per-layer head counts are not supported")
        names = {hf_key: f"{arch}.{key}" for key, hf_key in _CONFIG_KEYS.items()}
        check_config(cfg, self.path, names)
        cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
        if "head_dim" not in cfg:
            rope_dim = self.get(f"{arch}.rope.dimension_count")
            cfg["head_dim"] = rope_dim or cfg["hidden_size"] // cfg["num_attention_heads"]
            check_config(cfg, self.path, dict(names, head_dim=f"{arch}.rope.dimension_count"))
        self._check_layers(cfg["num_hidden_layers"])
        cfg["vocab_size"] = self._check_vocab(cfg.get("vocab_size"))
        cfg["tie_word_embeddings"] = "output.weight" not in self.tensor_names
        rope_scaling = self._rope_scaling()
        if arch == "bert":
            self._bert_config(cfg)
        elif arch == "gemma3":
            cfg["hidden_activation"] = "gelu_pytorch_tanh"
            cfg["query_pre_attn_scalar"] = cfg["head_dim"]
            full = {"rope_theta": cfg.get("rope_theta", 1e6), "rope_type": "default", **rope_scaling}
            # llama.cpp hard-codes base 10000 for Gemma 3's local (sliding) layers, as transformers does.
            cfg["rope_parameters"] = {
                "full_attention": full,
                "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
            }
        else:
            cfg["hidden_act"] = "silu"
            if "num_experts" in cfg:
                # llama.cpp renormalizes the top-k weights of both (build_moe_ffn's norm_w); Mixtral's and
                # gpt-oss's counts go by their own name.
                cfg["norm_topk_prob"] = True
                if architecture in (_MIXTRAL[0], "GptOssForCausalLM"):
                    cfg["num_local_experts"] = cfg.pop("num_experts")
            if arch == "gpt-oss":
                self._gpt_oss_config(cfg, rope_scaling)
                rope_scaling = {}
            if rope_scaling:
                cfg["rope_scaling"] = rope_scaling
        for tok_key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
            value = self.get(f"tokenizer.ggml.{tok_key}")
            if value is not None:
                cfg[hf_key] = value
        return cfg

    def _bert_config(self, cfg: dict) -> None:
        """BERT's settings llama.cpp's metadata leaves implicit or puts in tensor shapes: the GELU MLP, absolute
        positions (position_embd's rows), the segment count (token_types' rows), every layer's tensors present
        (named as in the file when one is missing), and the pooling (bert.pooling_type)."""
        path = self.path
        if self.get("bert.attention.causal", False):
            raise ModelLoadError(
                f"{path}: bert.attention.causal is true, but a BERT encoder attends both ways; re-convert the file"
            )
        if self.get("bert.pooling_type") == 4 or any(n.startswith("cls.") for n in self.tensor_names):
            raise ModelLoadError(
                f"{path}: a BERT reranker (bert.pooling_type RANK, cls.* classifier tensors) is not supported as "
                "GGUF; serve its Hugging Face checkpoint (BertForSequenceClassification) instead"
            )
        parts = [
            *_BERT_GLOBAL_NAMES,
            *(f"blk.{i}.{n}" for i in range(cfg["num_hidden_layers"]) for n in _BERT_LAYER_NAMES),
        ]
        for name in (
            f"{p}.{suffix}"
            for p in parts
            for suffix in ("weight", "bias")
            if p not in _BERT_TABLES or suffix == "weight"
        ):
            if name not in self.tensor_names:
                raise ModelLoadError(
                    f"{path}: tensor {name!r} is missing; a bert file has token_embd, position_embd, token_types, "
                    "token_embd_norm and each layer's attention and MLP: the file is corrupt or of another "
                    "architecture, re-convert it"
                )
        shapes = {t.name: t.shape for t in self.reader.tensors}
        for name in (f"{t}.weight" for t in _BERT_TABLES):
            shape = shapes[name]
            if len(shape) != 2 or shape[1] != cfg["hidden_size"]:
                raise ModelLoadError(
                    f"{path}: tensor {name!r} has shape {list(shape)}, not [rows, {cfg['hidden_size']}] "
                    "(bert.embedding_length); the file is corrupt: re-convert it"
                )
        positions = int(shapes["position_embd.weight"][0])
        context = cfg.setdefault("max_position_embeddings", positions)
        if context > positions:
            raise ModelLoadError(
                f"{path}: bert.context_length = {context}, but position_embd.weight has {positions} rows (one per "
                "position); the file is corrupt: re-convert it"
            )
        types = int(shapes["token_types.weight"][0])
        declared = self.get("tokenizer.ggml.token_type_count")
        if declared is not None and declared != types:
            raise ModelLoadError(
                f"{path}: tokenizer.ggml.token_type_count = {declared!r}, but token_types.weight has {types} rows; "
                "the file is corrupt: re-convert it"
            )
        cfg.update(type_vocab_size=types, hidden_act="gelu", position_embedding_type="absolute")
        cfg.setdefault("layer_norm_eps", 1e-12)
        # Read by the pooler (models/pooler.py): None when the file declares no embedding pooling (NONE, absent).
        cfg["gguf_pooling_type"] = BERT_POOLING.get(self.get("bert.pooling_type"))

    def _gpt_oss_config(self, cfg: dict, rope_scaling: dict) -> None:
        """gpt-oss's settings llama.cpp leaves implicit: every other layer slides (from the first), biases on
        the attention, the expert's feed-forward length as intermediate_size, YaRN without truncation (the
        model's definition in transformers; llama.cpp rounds the correction range)."""
        n = cfg["num_hidden_layers"]
        cfg["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        cfg["attention_bias"] = True
        if "moe_intermediate_size" in cfg:
            cfg["intermediate_size"] = cfg.pop("moe_intermediate_size")
        rope = {"rope_theta": cfg.get("rope_theta", 150000.0), "rope_type": "default", **rope_scaling}
        if rope["rope_type"] == "yarn":
            rope["truncate"] = False
            for key in ("yarn_beta_fast", "yarn_beta_slow"):
                value = self.get(f"gpt-oss.rope.scaling.{key}")
                if value is not None:
                    rope[key.removeprefix("yarn_")] = float(value)
        cfg["rope_parameters"] = rope

    def _check_layers(self, n_layers: int) -> None:
        """block_count must match the blk.N tensors: it sizes per-layer lists before any weight is read."""
        present = {int(m.group(1)) for name in self.tensor_names if (m := _BLOCK.match(name))}
        found = max(present) + 1 if present else 0
        if n_layers > found:
            raise ModelLoadError(
                f"{self.path}: {self.arch}.block_count = {n_layers}, but the file has tensors for "
                f"{found} layer(s); the file is corrupt: re-download or re-convert it"
            )

    def _check_vocab(self, declared: int | None) -> int:
        """The model's vocabulary size, checked against the token list and the embedding's rows.

        More tokens than embedding rows would look up rows that do not exist; a declared vocab_size other
        than the rows would size the logits wrongly. Fewer tokens than rows is padding, as in HF checkpoints.
        """
        tokens = self.fields.get("tokenizer.ggml.tokens")
        n_tokens = len(tokens) if isinstance(tokens, list) else 0
        shapes = {t.name: t.shape for t in self.reader.tensors}
        embd = shapes.get("token_embd.weight")
        if embd is None:
            return declared or n_tokens  # the weight load names the missing tensor
        if len(embd) != 2:
            raise ModelLoadError(
                f"{self.path}: token_embd.weight has shape {list(embd)}, not [vocab, hidden]; "
                "the file is corrupt: re-download or re-convert it"
            )
        rows = embd[0]
        if n_tokens > rows:
            raise ModelLoadError(
                f"{self.path}: the tokenizer has {n_tokens} tokens (tokenizer.ggml.tokens) but the "
                f"embedding token_embd.weight has only {rows} rows; the tokenizer and weights do "
                "not belong together: re-download or re-convert the file"
            )
        if declared is not None and declared != rows:
            raise ModelLoadError(
                f"{self.path}: {self.arch}.vocab_size = {declared} but token_embd.weight has {rows} "
                "rows; the file is corrupt: re-download or re-convert it"
            )
        out = shapes.get("output.weight")
        if out is not None and out[0] != rows:
            raise ModelLoadError(
                f"{self.path}: output.weight has {out[0]} rows but token_embd.weight has {rows}; "
                "the file is corrupt: re-download or re-convert it"
            )
        return rows

    def _rope_scaling(self) -> dict:
        kind = self.get(f"{self.arch}.rope.scaling.type")
        if kind in (None, "none"):
            return {}
        out = {"rope_type": kind, "factor": self.get(f"{self.arch}.rope.scaling.factor", 1.0)}
        orig = self.get(f"{self.arch}.rope.scaling.original_context_length")
        if orig:
            out["original_max_position_embeddings"] = orig
        check_config(
            out,
            self.path,
            {
                "factor": f"{self.arch}.rope.scaling.factor",
                "original_max_position_embeddings": f"{self.arch}.rope.scaling.original_context_length",
            },
        )
        out["factor"] = float(out["factor"])
        return out

    def rope_freq_factors(self) -> torch.Tensor | None:
        """llama.cpp's precomputed llama3 rope scaling (rope_freqs.weight), if the file has it."""
        for t in self.reader.tensors:
            if t.name == "rope_freqs.weight":
                if t.type_id != 0 or len(t.shape) != 1:  # F32 vector, one divisor per rotary frequency
                    raise ModelLoadError(
                        f"{self.path}: rope_freqs.weight must be a float32 vector, got type id "
                        f"{t.type_id} and shape {list(t.shape)}; re-convert the file"
                    )
                return torch.from_numpy(t.data.view(np.float32).copy())
        return None

    def check_tensor_types(self) -> None:
        """Raise naming the first tensor whose type we cannot dequantize."""
        from gguf import GGMLQuantizationType

        for t in self.reader.tensors:
            type_name = GGMLQuantizationType(t.type_id).name
            if type_name not in SUPPORTED_TENSOR_TYPES:
                raise ModelLoadError(
                    f"{self.path}: tensor {t.name!r} has GGUF type {type_name}, which "
                    f"cpuinfer cannot read; supported types: {', '.join(SUPPORTED_TENSOR_TYPES)}"
                )

    def hf_name(self, name: str) -> str | None:
        """The Hugging Face name of a GGUF tensor (None for tensors the models do not use)."""
        if name.startswith("rope_freqs"):
            return None
        base, _, suffix = name.rpartition(".")
        if self.arch == "bert":
            return self._bert_name(base, suffix, name)
        if base in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[base]}.{suffix}"
        m = _BLOCK.match(name)
        if m is None:
            return None
        if m.group(2) == _MOE_ROUTER and self._moe_names:
            return f"model.layers.{m.group(1)}.{self._moe_names[0]}.{m.group(3)}"
        names = {"gemma3": _GEMMA_LAYER_NAMES, "gpt-oss": _GPT_OSS_LAYER_NAMES}.get(self.arch, _LAYER_NAMES)
        part = names.get(m.group(2))
        if part is None:
            return None
        if part == "self_attn.sinks":
            return f"model.layers.{m.group(1)}.{part}"
        return f"model.layers.{m.group(1)}.{part}.{m.group(3)}"

    def _bert_name(self, base: str, suffix: str, name: str) -> str | None:
        if base in _BERT_GLOBAL_NAMES:
            return f"{_BERT_GLOBAL_NAMES[base]}.{suffix}"
        m = _BLOCK.match(name)
        part = _BERT_LAYER_NAMES.get(m.group(2)) if m else None
        return None if part is None else f"encoder.layer.{m.group(1)}.{part}.{m.group(3)}"

    def tensors(self, dtype: torch.dtype, config: dict) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
        """(hf_name, weight) for every tensor the models use; norms stay float32 for exact offsets.

        In a bf16/f16 run, matrices of the block-quant types the kernels take (KEPT_TYPES) stay
        quantized (a QuantWeight, never a second dequantized copy); float32 runs, the reference
        mode, dequantize everything, as do types the kernels do not take (Q2_K, Q3_K) and
        CPUINFER_GGUF_DEQUANTIZE=1.
        """
        self.check_tensor_types()
        permute = self.arch in ("llama", "mistral")
        n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
        keep = dtype in (torch.bfloat16, torch.float16) and not envs.GGUF_DEQUANTIZE.get()
        kept: Counter = Counter()
        dequantized: Counter = Counter()
        for t in self.reader.tensors:
            m = _BLOCK.match(t.name)
            if m is not None and m.group(2) in _MOE_STACKS:
                yield from self._experts(t, m, keep, kept, dequantized, dtype)
                continue
            hf = self.hf_name(t.name)
            if hf is None:
                continue
            is_norm = "norm" in t.name
            # Norms, gpt-oss's sinks and BERT's embedding tables (rows looked up, summed in float32) stay float32.
            vector_f32 = is_norm or ".attn_sinks." in t.name or (self.arch == "bert" and hf.startswith("embeddings."))
            heads = n_head if permute and ".attn_q." in t.name else n_kv if permute and ".attn_k." in t.name else 0
            type_name = _type_name(t.type_id)
            if keep and not vector_f32 and len(t.shape) == 2 and type_name in KEPT_TYPES and t.shape[-1] % 32 == 0:
                order = _unpermute_order(t.shape[0], heads) if heads else None
                try:
                    w = gguf_blocks.unpack(type_name, t.data, int(t.shape[0]), int(t.shape[-1]), order)
                except ValueError as e:
                    raise ModelLoadError(
                        f"{self.path}: tensor {t.name!r} ({type_name}): {e}; the file is corrupt: "
                        "re-download or re-convert it"
                    ) from None
                kept[type_name] += 1
                yield hf, w
                continue
            if type_name not in ("F32", "F16", "BF16") and not vector_f32:
                dequantized[type_name] += 1
            w = self._dequantize(t, torch.float32 if vector_f32 else dtype)
            if heads:
                w = _unpermute(w, heads)
            if self.arch == "gemma3" and is_norm:
                w = w - 1.0  # llama.cpp stored (1 + w); the model folds the 1 back in at load
            yield hf, w
        if kept:
            logger.info(
                "%s: %s tensors kept quantized (integer kernels, %s tile)",
                os.path.basename(self.path),
                _counts(kept),
                _tile_name(),
            )
        if dequantized:
            why = (
                "no quantized kernel for these types"
                if keep
                else "CPUINFER_GGUF_DEQUANTIZE=1"
                if envs.GGUF_DEQUANTIZE.get()
                else "float32 runs dequantize"
            )
            logger.info(
                "%s: %s tensors dequantized to %s (%s)",
                os.path.basename(self.path),
                _counts(dequantized),
                str(dtype).removeprefix("torch."),
                why,
            )

    def _experts(self, t, m, keep: bool, kept: Counter, dequantized: Counter, dtype: torch.dtype):
        """A stacked expert tensor [experts, out, in] as one (hf_name, weight) per expert; each expert's rows
        are a contiguous run of the file's blocks, so a kept quantized type is sliced, never dequantized."""
        want = 2 if m.group(3) == "bias" else 3
        if self._moe_names is None or len(t.shape) != want:
            raise ModelLoadError(
                f"{self.path}: tensor {t.name!r} has shape {list(t.shape)}: expert stacks must be "
                f"{'[experts, out]' if want == 2 else '[experts, out, in]'} in a mixture-of-experts architecture; "
                "the file is corrupt or not supported"
            )
        _, pattern, parts = self._moe_names
        layer, experts, rows, cols = m.group(1), int(t.shape[0]), int(t.shape[1]), int(t.shape[-1])
        part = parts[_MOE_STACKS[m.group(2)]]
        type_name = _type_name(t.type_id)
        names = [f"model.layers.{layer}.{pattern.format(e)}.{part}.{m.group(3)}" for e in range(experts)]
        if want == 2:  # per-expert biases (gpt-oss), float32
            stack = self._dequantize(t, torch.float32)
            for e, name in enumerate(names):
                yield name, stack[e].clone()
            return
        if keep and type_name in KEPT_TYPES and cols % 32 == 0:
            per_expert = t.data.reshape(experts, -1)
            for e, name in enumerate(names):
                try:
                    w = gguf_blocks.unpack(type_name, per_expert[e], rows, cols, None)
                except ValueError as err:
                    raise ModelLoadError(
                        f"{self.path}: tensor {t.name!r} ({type_name}), expert {e}: {err}; the file is corrupt: "
                        "re-download or re-convert it"
                    ) from None
                yield name, w
            kept[type_name] += experts
            return
        if type_name not in ("F32", "F16", "BF16"):
            dequantized[type_name] += experts
        stack = self._dequantize(t, dtype)
        for e, name in enumerate(names):
            yield name, stack[e].clone()
        del stack

    def _dequantize(self, t, dtype: torch.dtype) -> torch.Tensor:
        from gguf import GGMLQuantizationType, dequantize

        qtype = GGMLQuantizationType(t.type_id)
        shape = t.shape
        if qtype == GGMLQuantizationType.F32:
            return torch.from_numpy(t.data.view(np.float32).copy()).reshape(shape).to(dtype)
        if qtype == GGMLQuantizationType.F16:
            return torch.from_numpy(t.data.view(np.float16).copy()).reshape(shape).to(dtype)
        if qtype == GGMLQuantizationType.BF16:
            return torch.from_numpy(t.data.view(np.int16).copy()).view(torch.bfloat16).reshape(shape).to(dtype)
        cols = shape[-1]
        out = torch.empty(shape, dtype=dtype)
        flat = out.view(-1, cols)
        src = t.data.reshape(flat.shape[0], -1)
        step = max(1, (1 << 22) // cols)  # ~16 MB of float32 at a time keeps the load peak low
        for i in range(0, flat.shape[0], step):
            chunk = dequantize(src[i : i + step], qtype)
            flat[i : i + step] = torch.from_numpy(chunk.reshape(-1, cols))
        return out


def _type_name(type_id: int) -> str:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(type_id).name


def _counts(c: Counter) -> str:
    return ", ".join(f"{n} {k}" for k, n in sorted(c.items()))


def _tile_name() -> str:
    from .. import _C

    return _C.quant_tile_impl()


def _unpermute_order(rows: int, n_head: int) -> np.ndarray:
    """The row order _unpermute applies, as indices (for weights unpermuted before packing)."""
    return np.arange(rows).reshape(n_head, rows // n_head // 2, 2).transpose(0, 2, 1).reshape(-1)


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order (rotary pairs interleaved) back to Hugging Face's halves layout."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()
