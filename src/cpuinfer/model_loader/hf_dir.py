"""A Hugging Face model directory: config.json, safetensors shards, tokenizer files, generation_config.json."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch

from .errors import ModelLoadError

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
MAX_JSON_BYTES = 64 << 20  # config, generation, tokenizer-config and index files are kilobytes to a few MB


def read_json(path: str, required: bool = True) -> dict:
    """A JSON object as a dict ({} when optional and absent); a clear error when unreadable, huge or not an object."""
    if not os.path.isfile(path):
        if required:
            raise ModelLoadError(
                f"{path} does not exist; a model directory needs config.json, *.safetensors "
                "and (for text prompts) tokenizer.json"
            )
        return {}
    try:
        if os.path.getsize(path) > MAX_JSON_BYTES:
            raise ModelLoadError(
                f"{path} is {os.path.getsize(path)} bytes, more than the {MAX_JSON_BYTES} a model "
                "config file can plausibly need; the file is corrupt: re-download it"
            )
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: nesting deeper than the parser allows
        if isinstance(e, ModelLoadError):
            raise
        raise ModelLoadError(f"{path} is not valid JSON: {type(e).__name__}: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} holds a JSON {type(data).__name__}, not an object; re-download the model")
    return data


def _weight_roots(directory: str) -> list[str]:
    """Where a model directory's weight files may resolve: inside it, or (for a Hugging Face cache snapshot,
    whose files are symlinks into ../../blobs) that repository's blobs folder."""
    real = os.path.realpath(directory)
    roots = [real]
    if os.path.basename(os.path.dirname(real)) == "snapshots":
        roots.append(os.path.join(os.path.dirname(os.path.dirname(real)), "blobs"))
    return roots


def _inside(path: str, roots: list[str]) -> bool:
    real = os.path.realpath(path)
    return any(os.path.commonpath([real, root]) == root for root in roots)


def safetensors_files(directory: str) -> list[str]:
    """The checkpoint's safetensors files (the index's shards when sharded), none of them outside the directory."""
    index = os.path.join(directory, "model.safetensors.index.json")
    roots = _weight_roots(directory)
    if os.path.isfile(index):
        weight_map = read_json(index).get("weight_map") or {}
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ModelLoadError(
                f"{index}: weight_map is not an object of tensor name -> shard file name; re-download the model"
            )
        for name in sorted(set(weight_map.values())):
            parts = name.replace("\\", "/").split("/")
            if not name or os.path.isabs(name) or ".." in parts or parts[0].endswith(":"):
                raise ModelLoadError(
                    f"{index}: weight_map names shard {name!r}, a path outside the model "
                    "directory; shards must lie inside it: fix the index or re-download the model"
                )
        files = sorted({os.path.join(directory, f) for f in weight_map.values()})
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ModelLoadError(f"{index} lists shard(s) that do not exist: {', '.join(missing)}")
    else:
        files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
        if not files:
            other = [os.path.basename(p) for p in glob.glob(os.path.join(directory, "*.bin"))]
            hint = f" (found {', '.join(other)}: convert to safetensors first)" if other else ""
            raise ModelLoadError(f"{directory} has no *.safetensors weights{hint}")
    outside = [f for f in files if not _inside(f, roots)]
    if outside:
        raise ModelLoadError(
            f"{directory}: weight file(s) {', '.join(outside)} are symlinks to "
            f"{', '.join(os.path.realpath(f) for f in outside)}, outside the model directory; "
            "copy the real files into the directory"
        )
    return files


def safetensors_tensors(directory: str, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor; matrices in dtype right away (all as stored for None), vectors (norms,
    biases) as stored."""
    from safetensors import SafetensorError, safe_open

    for path in safetensors_files(directory):
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has keys() but is not iterable
                    t = f.get_tensor(name)
                    yield name, (t.to(dtype) if dtype is not None and t.dim() >= 2 else t)
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
            # The engine never pads (its batches are flat) and refuses or truncates an over-long input itself
            # (truncate_prompt_tokens), as vLLM: a tokenizer.json's own padding (BERT's often pads to 128) and
            # truncation would change what the model sees.
            out["tokenizer"].no_padding()
            out["tokenizer"].no_truncation()
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
