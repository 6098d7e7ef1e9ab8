"""Load a model's description (ModelSpec) and weights from a Hugging Face directory or a GGUF file."""

from __future__ import annotations

import os

import torch

from .config_check import check_config, is_int
from .errors import ModelLoadError
from .spec import ModelSpec, resolve_dtype

__all__ = ["ModelLoadError", "ModelSpec", "load_model_spec", "load_weights"]


def _as_list(x) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _check_token_ids(ids: list, vocab_size: int, what: str, source: str) -> None:
    """Special-token ids from a model file must be ids of the model's vocabulary (never a silent no-op stop)."""
    for i in ids:
        if not is_int(i) or not 0 <= i < vocab_size:
            raise ModelLoadError(
                f"{source}: {what} {i!r} is not a token id of the {vocab_size}-token vocabulary; "
                "the model's config is corrupt: fix it or re-download the model"
            )


def load_model_spec(
    path: str, dtype: str | torch.dtype = "auto", quantization: str | None = None, hf_overrides: dict | None = None
) -> ModelSpec:
    """Read config + tokenizer (no weights yet) from an HF directory or a .gguf file.

    quantization (vLLM's --quantization): None reads the method from the checkpoint; a name must match it.
    hf_overrides (vLLM's): config keys replacing the file's, `architectures` included.
    """
    from ..models import registry
    from ..quantization import checkpoint

    path = os.fspath(path)
    if not os.path.exists(path):
        raise ModelLoadError(f"model path {path!r} does not exist; pass a Hugging Face model directory or a .gguf file")
    spec_kwargs = _hf_spec(path, dtype) if os.path.isdir(path) else _gguf_spec(path, dtype)
    config = spec_kwargs["hf_config"]
    if hf_overrides:
        config.update(hf_overrides)
        if hf_overrides.get("architectures"):
            spec_kwargs["architecture"] = hf_overrides["architectures"][0]
    found = "gguf" if spec_kwargs["format"] == "gguf" else checkpoint.declared(config, f"{path}/config.json")
    spec_kwargs["quantization"] = checkpoint.resolve(quantization, found, path)
    arch = spec_kwargs["architecture"]
    causal = registry.causal_lm_of_base_model(arch)
    if causal is not None:  # a base model (sentence-transformers saves its decoder so): its weights lack "model."
        arch = spec_kwargs["architecture"] = causal
        spec_kwargs["base_model"] = True
    shape = registry.describe(arch, config, path)
    _check_token_ids(spec_kwargs["eos_token_ids"], shape["vocab_size"], "eos token id", path)
    _check_token_ids(_as_list(spec_kwargs["bos_token_id"]), shape["vocab_size"], "bos token id", path)
    if not isinstance(spec_kwargs["chat_template"], (str, type(None))):
        raise ModelLoadError(
            f"{path}: the chat template is a {type(spec_kwargs['chat_template']).__name__}, not "
            "text; fix tokenizer.chat_template (GGUF) or chat_template (tokenizer_config.json)"
        )
    tok = spec_kwargs["tokenizer"]
    # A tokenizer smaller than the vocabulary is normal (embedding rows padded to a multiple of 64 or 128); a
    # larger one would produce ids with no embedding row. Added tokens past it (Gemma 3's image token) are left
    # to the request checks, which refuse ids >= vocab_size.
    if tok is not None and tok.get_vocab_size(with_added_tokens=False) > shape["vocab_size"]:
        raise ModelLoadError(
            f"{path}: the tokenizer has {tok.get_vocab_size(with_added_tokens=False)} tokens but "
            f"the model's vocab_size is {shape['vocab_size']}; the tokenizer belongs to another "
            "model: use the tokenizer files of this checkpoint"
        )
    if config.get("classifier_from_token"):
        config["classifier_from_token_ids"] = _classifier_token_ids(config["classifier_from_token"], tok, path)
    special = set()
    if tok is not None:
        special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    return ModelSpec(path=path, special_token_ids=special, **shape, **spec_kwargs)


def _classifier_token_ids(tokens, tok, source: str) -> list[int]:
    """vLLM's classifier_from_token (a decoder reranker's label tokens, e.g. ["no", "yes"]) as vocabulary ids."""
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ModelLoadError(f"{source}: classifier_from_token must be a list of token strings, got {tokens!r}")
    if tok is None:
        raise ModelLoadError(f"{source}: classifier_from_token needs the model's tokenizer, and it has none")
    ids = [tok.token_to_id(t) for t in tokens]
    missing = [t for t, i in zip(tokens, ids, strict=True) if i is None]
    if missing:
        raise ModelLoadError(f"{source}: classifier_from_token {missing} are not tokens of the model's vocabulary")
    return ids


def _hf_spec(directory: str, dtype) -> dict:
    from .hf_dir import SAMPLING_KEYS, read_json, safetensors_files, tokenizer_info

    config = read_json(os.path.join(directory, "config.json"))
    check_config(config, os.path.join(directory, "config.json"))
    archs = config.get("architectures") or []
    if not archs:
        raise ModelLoadError(f"{directory}/config.json names no architectures")
    safetensors_files(directory)  # fail now, not at weight load, when there are none
    gen = read_json(os.path.join(directory, "generation_config.json"), required=False)
    tok = tokenizer_info(directory)
    eos = _as_list(gen.get("eos_token_id")) or _as_list(config.get("eos_token_id"))
    if not eos and tok["tokenizer"] is not None and tok["eos_token"]:
        eos = _as_list(tok["tokenizer"].token_to_id(tok["eos_token"]))
    bos = gen.get("bos_token_id", config.get("bos_token_id"))
    checkpoint_dtype = config.get("dtype") or config.get("torch_dtype")
    return dict(
        architecture=archs[0],
        dtype=resolve_dtype(dtype, checkpoint_dtype),
        eos_token_ids=eos,
        bos_token_id=bos,
        tokenizer=tok["tokenizer"],
        chat_template=tok["chat_template"],
        generation_defaults={k: gen[k] for k in SAMPLING_KEYS if gen.get(k) is not None},
        hf_config=config,
        format="hf",
        bos_token=tok["bos_token"],
        eos_token=tok["eos_token"],
    )


def _gguf_spec(path: str, dtype) -> dict:
    from .gguf_file import GGUFFile
    from .gguf_tokenizer import tokenizer_from_gguf

    g = GGUFFile(path)
    config = g.config()
    tokens = g.get("tokenizer.ggml.tokens") or []
    tokenizer = tokenizer_from_gguf(g.get, path)
    bos, eos = g.get("tokenizer.ggml.bos_token_id"), g.get("tokenizer.ggml.eos_token_id")
    eos_ids = _as_list(eos)
    eot = g.get("tokenizer.ggml.eot_token_id")
    if eot is not None and eot not in eos_ids:
        eos_ids.append(eot)
    name = lambda i: tokens[i] if is_int(i) and 0 <= i < len(tokens) else None  # noqa: E731
    return dict(
        architecture=config["architectures"][0],
        dtype=resolve_dtype(dtype, "bfloat16"),
        eos_token_ids=eos_ids,
        bos_token_id=bos,
        tokenizer=tokenizer,
        chat_template=g.get("tokenizer.chat_template"),
        generation_defaults={},
        hf_config=config,
        format="gguf",
        bos_token=name(bos),
        eos_token=name(eos),
    )


def load_weights(spec: ModelSpec) -> tuple[dict[str, torch.Tensor], dict]:
    """All tensors by Hugging Face name (matrices in the run dtype), plus extras (e.g. GGUF rope frequency factors)."""
    if spec.format == "gguf":
        from .gguf_file import GGUFFile

        g = GGUFFile(spec.path)
        tensors = dict(_progress(g.tensors(spec.dtype, spec.hf_config), len(g.reader.tensors)))
        return tensors, {"rope_freq_factors": g.rope_freq_factors()}
    from .hf_dir import safetensors_tensors

    if spec.quantization is not None:
        from ..quantization.checkpoint import quantized_weights

        raw = dict(_progress(safetensors_tensors(spec.path, None)))  # packed integers and f16 scales as stored
        tensors = quantized_weights(spec.quantization, spec.hf_config, raw, spec.dtype, spec.path)
    else:
        tensors = dict(_progress(safetensors_tensors(spec.path, spec.dtype)))
    if spec.base_model:  # the decoder's names as the ForCausalLM checkpoint has them
        tensors = {n if n.startswith("model.") else f"model.{n}": t for n, t in tensors.items()}
    _check_hf_vocab(spec, tensors)
    return tensors, {}


def _progress(items, total: int | None = None):
    """The checkpoint's tensors with a tqdm bar on stderr (as vLLM and transformers show), shown only once the
    load has taken a second: the bundled model loads quietly, a large one shows how far it is."""
    from tqdm.auto import tqdm

    return tqdm(items, total=total, desc="Loading weights", unit=" tensors", delay=1.0, dynamic_ncols=True)


def _check_hf_vocab(spec: ModelSpec, tensors: dict[str, torch.Tensor]) -> None:
    """config.json's vocab_size must be the embedding's (and lm_head's) rows: it sizes the logits."""
    config = os.path.join(spec.path, "config.json")
    for name, t in tensors.items():
        if (name.endswith("embed_tokens.weight") or name == "lm_head.weight") and t.shape[0] != spec.vocab_size:
            raise ModelLoadError(
                f"{config}: vocab_size = {spec.vocab_size} but {name} has {t.shape[0]} rows; the "
                "config and weights do not belong together: fix vocab_size or re-download the model"
            )
