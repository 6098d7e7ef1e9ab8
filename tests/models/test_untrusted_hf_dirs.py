"""A Hugging Face model directory is untrusted input too: config numbers, vocab against the embedding, and
shard paths that must stay inside the directory."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from cpuinfer.model_loader import ModelLoadError, load_model_spec
from cpuinfer.worker import ModelRunner

from .untrusted import HUGE_CONTEXT, check_huge_context, refused

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        max_position_embeddings=128,
    )
    path = tmp_path_factory.mktemp("tiny_llama")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def _copy(src, tmp_path, name="model"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def _write_tokenizer(d, n_tokens: int):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {f"t{i}": i for i in range(n_tokens)}
    Tokenizer(WordLevel(vocab, unk_token="t0")).save(str(d / "tokenizer.json"))


def test_hf_huge_context_sizes_nothing_from_it(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path)
    _edit_config(d, max_position_embeddings=HUGE_CONTEXT)
    check_huge_context(str(d))


def test_hf_vocab_size_disagrees_with_embedding(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path)
    _edit_config(d, vocab_size=65)
    spec = load_model_spec(str(d))
    with pytest.raises(
        ModelLoadError,
        match=r"config\.json: vocab_size = 65 but (model\.embed_tokens|lm_head)\.weight "
        r"has 64 rows; the config and weights do not belong together",
    ):
        ModelRunner(spec, 16, 4, torch.float32)


def test_hf_tokenizer_larger_than_vocab(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path)
    _write_tokenizer(d, 100)
    refused(
        d,
        r"the tokenizer has 100 tokens but the model's vocab_size is 64; the tokenizer belongs to another "
        r"model",
    )


def test_hf_tokenizer_smaller_than_vocab_is_padding(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path)
    _write_tokenizer(d, 50)
    assert load_model_spec(str(d)).vocab_size == 64


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(num_attention_heads=0), r"config\.json: num_attention_heads = 0 is not a positive integer"),
        (dict(num_hidden_layers=2**40), r"num_hidden_layers = 1099511627776 is not a plausible layer count"),
        (dict(num_hidden_layers="2"), r"num_hidden_layers = '2' is not a positive integer"),
        (dict(vocab_size=10**12), r"vocab_size = 1000000000000 is not a plausible vocabulary size"),
        (dict(num_attention_heads=3, num_key_value_heads=2), r"num_key_value_heads = 2 is not a divisor of the 3"),
        (dict(max_position_embeddings=-1), r"max_position_embeddings = -1 is not a positive integer"),
        (dict(rope_theta=float("inf")), r"rope_theta = inf is not a finite positive number"),
        (dict(eos_token_id=64), r"eos token id 64 is not a token id of the 64-token vocabulary"),
        (dict(bos_token_id=-1), r"bos token id -1 is not a token id of the 64-token vocabulary"),
    ],
)
def test_hf_bad_config_numbers(tiny_dir, tmp_path, changes, match):
    d = _copy(tiny_dir, tmp_path)
    _edit_config(d, **changes)
    (d / "generation_config.json").unlink(missing_ok=True)  # its ids would be read first
    refused(d, match)


def test_hf_config_not_an_object_or_too_deep(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path)
    (d / "config.json").write_text("[1, 2]")
    refused(d, r"config\.json holds a JSON list, not an object")
    (d / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    refused(d, r"config\.json is not valid JSON: RecursionError")


def _sharded(tiny_dir, tmp_path, shard_name: str):
    d = _copy(tiny_dir, tmp_path)
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": shard_name}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return d


@pytest.mark.parametrize(
    "shard",
    ["../outside.safetensors", "sub/../../outside.safetensors", "/etc/outside.safetensors", "..\\outside.safetensors"],
)
def test_weight_map_outside_directory(tiny_dir, tmp_path, shard):
    (tmp_path / "outside.safetensors").write_bytes((tiny_dir / "model.safetensors").read_bytes())
    d = _sharded(tiny_dir, tmp_path, shard)
    refused(d, r"model\.safetensors\.index\.json: weight_map names shard .*, a path outside the model directory")


def test_weight_map_symlink_outside_directory(tiny_dir, tmp_path):
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(tiny_dir / "model.safetensors", outside)
    d = _sharded(tiny_dir, tmp_path, "link.safetensors")
    (d / "link.safetensors").symlink_to(outside)
    refused(
        d,
        r"weight file\(s\) .*link\.safetensors are symlinks to .*elsewhere\.safetensors, outside the model "
        r"directory; copy the real files into the directory",
    )
    (d / "model.safetensors.index.json").unlink()  # the unsharded layout: every *.safetensors is checked too
    refused(d, "link.safetensors are symlinks to")


def test_weight_map_not_a_mapping(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": 3}}))
    refused(d, r"weight_map is not an object of tensor name -> shard file name")


def test_hugging_face_cache_snapshot_symlinks_load(tiny_dir, tmp_path):
    """A hub cache snapshot's files are symlinks into the repository's blobs folder: that stays allowed."""
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in os.listdir(tiny_dir):
        blob = repo / "blobs" / f"sha-{f}"
        shutil.copy(tiny_dir / f, blob)
        (snapshot / f).symlink_to(os.path.relpath(blob, snapshot))
    spec = load_model_spec(str(snapshot))
    ModelRunner(spec, 16, 4, torch.float32)
