"""A Hugging Face model directory: config.json, safetensors shards, tokenizer files, generation_config.json."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch

from .errors import ModelLoadError

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def read_json(path: str, required: bool = True) -> dict:
    """A JSON file as a dict ({} when optional and absent); a clear error when unreadable."""
    if not os.path.isfile(path):
        if required:
            raise ModelLoadError(f"{path} does not exist; a model directory needs config.json, *.safetensors "
                                 "and (for text prompts) tokenizer.json")
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e


def safetensors_files(directory: str) -> list[str]:
    """The checkpoint's safetensors files (the index's shards when sharded)."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json(index).get("weight_map") or {}
        files = sorted({os.path.join(directory, f) for f in weight_map.values()})
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ModelLoadError(f"{index} lists shard(s) that do not exist: {', '.join(missing)}")
        return files
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        other = [os.path.basename(p) for p in glob.glob(os.path.join(directory, "*.bin"))]
        hint = f" (found {', '.join(other)}: convert to safetensors first)" if other else ""
        raise ModelLoadError(f"{directory} has no *.safetensors weights{hint}")
    return files


def safetensors_tensors(directory: str, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor; matrices in dtype right away, vectors (norms, biases) as stored."""
    from safetensors import SafetensorError, safe_open

    for path in safetensors_files(directory):
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    t = f.get_tensor(name)
                    yield name, (t.to(dtype) if t.dim() >= 2 else t)
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise ModelLoadError(f"{path} is not a readable safetensors file ({e}); re-download or re-save it") from e


def tokenizer_info(directory: str) -> dict:
    """tokenizer (tokenizers.Tokenizer or None), chat_template, bos/eos token strings from the tokenizer files."""
    from tokenizers import Tokenizer

    out: dict = {"tokenizer": None, "chat_template": None, "bos_token": None, "eos_token": None}
    tok_path = os.path.join(directory, "tokenizer.json")
    if os.path.isfile(tok_path):
        try:
            out["tokenizer"] = Tokenizer.from_file(tok_path)
        except Exception as e:
            raise ModelLoadError(f"{tok_path} is not a readable tokenizers file: {e}") from e
    cfg = read_json(os.path.join(directory, "tokenizer_config.json"), required=False)
    template = cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    jinja = os.path.join(directory, "chat_template.jinja")
    if template is None and os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            template = f.read()
    if template is None:
        template = read_json(os.path.join(directory, "chat_template.json"), required=False).get("chat_template")
    out["chat_template"] = template
    for key in ("bos_token", "eos_token"):
        value = cfg.get(key)
        out[key] = value.get("content") if isinstance(value, dict) else value
    return out
