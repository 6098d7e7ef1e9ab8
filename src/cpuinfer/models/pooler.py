"""How a pooling model turns its prompt's final hidden states into one vector, read as sentence-transformers does.

A sentence-transformers checkpoint says it in `modules.json`: a `Pooling` module whose `config.json` sets the
mode (`pooling_mode_cls_token`, `pooling_mode_mean_tokens`, `pooling_mode_lasttoken`) and, after it, an
optional `Normalize` module. vLLM's `--pooler-config '{"pooling_type": "LAST", "normalize": true}'` overrides
either. A bare decoder (no modules.json) pools its last token, normalised: vLLM's default for
Qwen3-Embedding. Matryoshka truncation is allowed where the model's config declares it (`is_matryoshka`, or
`matryoshka_dimensions`), as vLLM reads it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from cpuinfer.json_arg import json_object

POOLING_TYPES = ("LAST", "MEAN", "CLS")
_ST_MODES = {  # sentence-transformers' Pooling config keys, in the order it checks them
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_lasttoken": "LAST",
}

_ST_MODE_NAMES = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}


@dataclass(frozen=True)
class PoolerConfig:
    """The resolved pooler of one pooling model."""

    pooling_type: str = "LAST"
    normalize: bool = True
    is_matryoshka: bool = False  # any `dimensions` <= hidden size may be asked for
    matryoshka_dimensions: tuple[int, ...] | None = None  # only these (when given)
    # A sequence-classification model (a cross-encoder, a reranker): its pooled vector goes through the model's
    # classifier head, then this activation (models.classifier); it serves classify and score, not embed.
    num_labels: int = 0  # 0: an embedding model
    activation: str = "identity"

    @property
    def task(self) -> str:
        """embed (vectors) or classify (a classifier's scores: LLM.classify, LLM.score)."""
        return "classify" if self.num_labels else "embed"

    @property
    def all_rows(self) -> bool:
        """True when pooling reads every prompt row (mean, CLS's first), not only the last one."""
        return self.pooling_type != "LAST"


def resolve_pooler(
    model_dir: str | None, model_config: dict, override: str | dict | None, classifier: tuple[int, str] | None = None
) -> PoolerConfig:
    """The pooler of a model: a GGUF encoder's bert.pooling_type, else sentence-transformers' modules (if any),
    then --pooler-config's fields on top.

    classifier: (num_labels, activation) of a sequence-classification model, which pools its first token (an
    encoder: BERT's pooler reads it) or its last (a decoder), unnormalised, and reads no modules.json."""
    pooling_type, normalize = "LAST", True
    override = dict(json_object(override, "--pooler-config") or {})
    if "gguf_pooling_type" in model_config and classifier is None:
        # A GGUF encoder's own bert.pooling_type (model_loader/gguf_file.py), normalised as llama.cpp's server
        # and vLLM do by default; a file that declares none (NONE: a vector per token) needs --pooler-config.
        st = model_config["gguf_pooling_type"], True
        if st[0] is None and "pooling_type" not in override:
            raise ValueError(
                f"{model_dir}: bert.pooling_type declares no pooling to one vector per text (NONE, or absent); "
                'choose one with --pooler-config \'{"pooling_type": "CLS"}\' (or MEAN, LAST)'
            )
    else:
        st = _sentence_transformers_pooler(model_dir) if model_dir and classifier is None else None
    if st is not None:
        pooling_type, normalize = st
    unknown = sorted(set(override) - {"pooling_type", "normalize", "dimensions"})
    if unknown:
        raise ValueError(f"--pooler-config has unsupported field(s) {', '.join(unknown)}; use pooling_type, normalize")
    if "pooling_type" in override:
        pooling_type = str(override["pooling_type"]).upper()
        if pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"--pooler-config pooling_type={override['pooling_type']!r} is not one of {', '.join(POOLING_TYPES)}"
            )
    if "normalize" in override:
        if not isinstance(override["normalize"], bool):
            raise ValueError(f"--pooler-config normalize={override['normalize']!r} must be true or false")
        normalize = override["normalize"]
    dims = model_config.get("matryoshka_dimensions")
    if classifier is not None:
        pooling_type = str(override.get("pooling_type", classifier_pooling(model_config))).upper()
        return PoolerConfig(pooling_type, False, num_labels=classifier[0], activation=classifier[1])
    return PoolerConfig(
        pooling_type,
        normalize,
        bool(model_config.get("is_matryoshka") or dims),
        tuple(int(d) for d in dims) if dims else None,
    )


def classifier_pooling(model_config: dict) -> str:
    """Where a sequence classifier reads its input: the first token of an encoder, the last of a decoder."""
    from .registry import ENCODERS

    return "CLS" if (model_config.get("architectures") or [""])[0] in ENCODERS else "LAST"


def _sentence_transformers_pooler(model_dir: str) -> tuple[str, bool] | None:
    """(pooling type, normalize) from a sentence-transformers checkpoint's modules.json; None if there is none."""
    if os.path.isfile(model_dir):
        model_dir = os.path.dirname(model_dir)
    path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        modules = json.load(f)
    pooling_type, normalize = None, False
    for m in modules:
        kind = str(m.get("type", ""))
        if kind.endswith("Pooling"):
            with open(os.path.join(model_dir, m.get("path", ""), "config.json")) as f:
                cfg = json.load(f)
            modes = [t for key, t in _ST_MODES.items() if cfg.get(key)]
            if "pooling_mode" in cfg:  # sentence-transformers >= 6 writes the mode by name
                modes = [_ST_MODE_NAMES.get(cfg["pooling_mode"], repr(cfg["pooling_mode"]))]
            if cfg.get("include_prompt") is False:
                raise ValueError(f"{path}: pooling without the prompt (include_prompt false) is not supported")
            if len(modes) != 1 or modes[0] not in POOLING_TYPES:
                raise ValueError(
                    f"{path}: the Pooling module must set exactly one of {', '.join(_ST_MODES)} "
                    f"(this engine pools one way), got {modes or 'none'}"
                )
            pooling_type = modes[0]
        elif kind.endswith("Normalize"):
            normalize = True
        elif not kind.endswith("Transformer"):
            raise ValueError(f"{path}: sentence-transformers module {kind!r} is not supported")
    if pooling_type is None:
        return None
    return pooling_type, normalize


def sentence_transformers_max_len(model_dir: str) -> int | None:
    """sentence_bert_config.json's max_seq_length (the inputs sentence-transformers keeps), if the file has one."""
    if os.path.isfile(model_dir):
        return None
    path = os.path.join(model_dir, "sentence_bert_config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        value = json.load(f).get("max_seq_length")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def finish_pooled(vec: torch.Tensor, normalize: bool, dimensions: int | None) -> torch.Tensor:
    """The request's vector: Matryoshka truncation first, then (when asked) L2 normalisation, in float32."""
    vec = vec.float()
    if dimensions is not None:
        vec = vec[:dimensions]
    if normalize:
        vec = torch.nn.functional.normalize(vec, p=2, dim=-1)
    return vec
