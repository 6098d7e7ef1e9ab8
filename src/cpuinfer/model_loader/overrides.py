"""What vLLM's --tokenizer and --generation-config change in a loaded model's spec: the tokenizer (and its
chat template and special tokens) from another directory, the default sampling values from another
generation_config.json, or none ("vllm")."""

from __future__ import annotations

import dataclasses
import logging
import os

from cpuinfer.errors import ModelLoadError

from .hf_dir import SAMPLING_KEYS, read_json, tokenizer_info
from .spec import ModelSpec

logger = logging.getLogger("cpuinfer.model_loader")


def with_tokenizer(spec: ModelSpec, directory: str) -> ModelSpec:
    """spec with the tokenizer of `directory` (its tokenizer.json; its chat template when it has one)."""
    if not os.path.isdir(directory):
        raise ModelLoadError(f"--tokenizer {directory!r}: not a directory with tokenizer.json (or a hub id of one)")
    info = tokenizer_info(directory)
    tok = info["tokenizer"]
    if tok is None:
        raise ModelLoadError(f"--tokenizer {directory!r}: it has no tokenizer.json")
    size = tok.get_vocab_size(with_added_tokens=False)
    if size > spec.vocab_size:
        raise ModelLoadError(
            f"--tokenizer {directory!r}: it has {size} tokens but the model's vocabulary has {spec.vocab_size}; "
            "it belongs to another model"
        )
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    return dataclasses.replace(
        spec,
        tokenizer=tok,
        chat_template=info["chat_template"] or spec.chat_template,
        special_token_ids=special,
        bos_token=info["bos_token"] or spec.bos_token,
        eos_token=info["eos_token"] or spec.eos_token,
    )


def with_generation_config(spec: ModelSpec, choice: str) -> ModelSpec:
    """spec with the default sampling values --generation-config names: "auto" the model's own, "vllm" none
    (the engine's defaults), a directory its generation_config.json."""
    if choice == "auto":
        return spec
    if choice == "vllm":
        return dataclasses.replace(spec, generation_defaults={})
    path = os.path.join(choice, "generation_config.json")
    if not os.path.isfile(path):
        raise ModelLoadError(
            f"--generation-config {choice!r}: give auto, vllm or a directory holding generation_config.json "
            f"({path} does not exist)"
        )
    gen = read_json(path)
    defaults = {k: gen[k] for k in SAMPLING_KEYS if gen.get(k) is not None}
    logger.info("default sampling values from %s: %s", path, defaults)
    return dataclasses.replace(spec, generation_defaults=defaults)


def note_remote_code(spec: ModelSpec) -> None:
    """Say so when a model's config asks for remote code: cpuinfer never runs it (--trust-remote-code or not)."""
    if spec.hf_config.get("auto_map"):
        logger.warning(
            "%s: its config asks for remote code (auto_map); cpuinfer never runs code from a model repository: "
            "it runs %s with its own implementation",
            spec.path,
            spec.architecture,
        )
