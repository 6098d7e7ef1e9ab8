"""Malformed GPTQ / AWQ / compressed-tensors checkpoints and a wrong --quantization: a ModelLoadError naming the
tensor (or setting) and what was expected, never a crash; and the method detected, flagged and listed."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from cpuinfer.config import EngineArgs
from cpuinfer.errors import ModelLoadError
from cpuinfer.model_loader import load_model_spec, load_weights
from cpuinfer.quantization.checkpoint import describe

from .quant_checkpoints import quantize_dir
from .test_tiny_models import COMMON

transformers = pytest.importorskip("transformers")
LAYER = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    config = transformers.LlamaConfig(**COMMON)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny")
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def good(tiny, tmp_path_factory):
    """One small checkpoint per format: the starting point each test breaks in one way."""
    root = tmp_path_factory.mktemp("good")
    out = {}
    for method, opts in (
        ("gptq", dict(bits=4, group=32, sym=False, act_order=True)),
        ("awq", dict(group=64)),
        ("compressed-tensors", dict(scheme="W4A16", group=32, sym=False)),
    ):
        out[method] = str(root / method)
        quantize_dir(tiny, out[method], method, **opts)
    return out


def broken(good: dict, method: str, tmp_path, tensors=None, config=None) -> str:
    """A copy of good[method] with tensors(dict) / config(dict) edited in place."""
    path = str(tmp_path / f"bad-{method}")
    shutil.copytree(good[method], path)
    if tensors is not None:
        t = load_file(os.path.join(path, "model.safetensors"))
        tensors(t)
        save_file(t, os.path.join(path, "model.safetensors"))
    if config is not None:
        with open(os.path.join(path, "config.json")) as f:
            c = json.load(f)
        config(c["quantization_config"])
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(c, f)
    return path


def load(path: str, quantization: str | None = None) -> None:
    load_weights(load_model_spec(path, "bfloat16", quantization))


def _set(d: dict, key: str, value):
    d[key] = value


TENSOR_CASES = {
    "qweight rows": (
        "gptq",
        lambda t: _set(t, f"{LAYER}.qweight", t[f"{LAYER}.qweight"][:-1].clone()),
        r"gptq tensor 'model\.layers\.0\.self_attn\.q_proj\.qweight' packs 120 inputs, not a multiple "
        r"of 32",
    ),
    "qweight dtype": (
        "gptq",
        lambda t: _set(t, f"{LAYER}.qweight", t[f"{LAYER}.qweight"].float()),
        r"q_proj\.qweight' is float32, expected int32",
    ),
    "g_idx range": (
        "gptq",
        lambda t: t[f"{LAYER}.g_idx"].__setitem__(3, 99),
        r"q_proj\.g_idx' holds group 99, outside the 4 groups",
    ),
    "g_idx uneven": (
        "gptq",
        lambda t: t[f"{LAYER}.g_idx"].__setitem__(slice(0, 40), 0),
        r"q_proj\.g_idx' puts \d+ inputs in group \d, expected 32 \(group_size = 32\)",
    ),
    "scales shape": (
        "gptq",
        lambda t: _set(t, f"{LAYER}.scales", t[f"{LAYER}.scales"][:, :-8].clone()),
        r"q_proj\.scales' has shape \[4, 120\], expected \[4, 128\]",
    ),
    "missing qzeros": ("gptq", lambda t: t.pop(f"{LAYER}.qzeros"), r"q_proj\.qzeros' is missing"),
    "awq qzeros": (
        "awq",
        lambda t: _set(t, f"{LAYER}.qzeros", t[f"{LAYER}.qzeros"][:1].clone()),
        r"q_proj\.qzeros' has shape \[1, 16\], expected \[2, 16\]",
    ),
    "ct packed": (
        "compressed-tensors",
        lambda t: _set(t, f"{LAYER}.weight_packed", t[f"{LAYER}.weight_packed"][:, :-1].clone()),
        r"q_proj\.weight_packed' has shape \[128, 15\], expected \[128, 16\]",
    ),
    "ct zero point": (
        "compressed-tensors",
        lambda t: t.pop(f"{LAYER}.weight_zero_point"),
        r"q_proj\.weight_zero_point' is missing \(the scheme is asymmetric\)",
    ),
}


@pytest.mark.parametrize("case", list(TENSOR_CASES))
def test_malformed_tensor(good, tmp_path, case):
    method, edit, message = TENSOR_CASES[case]
    with pytest.raises(ModelLoadError, match=message):
        load(broken(good, method, tmp_path, tensors=edit))


CONFIG_CASES = {
    "gptq 3 bit": ("gptq", lambda c: _set(c, "bits", 3), r"GPTQ with bits = 3 is not supported"),
    "gptq group": ("gptq", lambda c: _set(c, "group_size", 48), r"GPTQ group_size = 48 is not supported"),
    "gptq marlin": (
        "gptq",
        lambda c: _set(c, "checkpoint_format", "marlin"),
        r"GPTQ checkpoint_format 'marlin' is not supported",
    ),
    "method": (
        "gptq",
        lambda c: _set(c, "quant_method", "bitsandbytes"),
        r"quant_method 'bitsandbytes' is not supported; cpuinfer reads gptq, awq, compressed-tensors",
    ),
    "awq gemv": ("awq", lambda c: _set(c, "version", "gemv"), r"AWQ version 'gemv' is not supported"),
    "ct fp8": (
        "compressed-tensors",
        lambda c: _set(c, "format", "float-quantized") or c["config_groups"]["group_0"].pop("format"),
        r"compressed-tensors format 'float-quantized' is not supported",
    ),
    "ct 2 bit": (
        "compressed-tensors",
        lambda c: c["config_groups"]["group_0"]["weights"].__setitem__("num_bits", 2),
        r"2-bit int weights in pack-quantized are not supported",
    ),
    "ct ignored": (
        "compressed-tensors",
        lambda c: _set(c, "ignore", ["lm_head", f"re:.*{LAYER}"]),
        r"layer 'model\.layers\.0\.self_attn\.q_proj' holds quantized tensors but .* ignore list",
    ),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_unsupported_config(good, tmp_path, case):
    method, edit, message = CONFIG_CASES[case]
    with pytest.raises(ModelLoadError, match=message):
        load(broken(good, method, tmp_path, config=edit))


def test_truncated_file(good, tmp_path):
    """A safetensors file cut short is the loader's clear error, not a crash."""
    path = broken(good, "gptq", tmp_path)
    f = os.path.join(path, "model.safetensors")
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) - 1000)
    with pytest.raises(ModelLoadError, match="not a readable safetensors file"):
        load(path)


def test_quantization_flag(good, tiny):
    """--quantization: detected when omitted, accepted when it matches, a clear error when it does not."""
    assert load_model_spec(good["awq"]).quantization == "awq"
    assert load_model_spec(good["awq"], quantization="awq").quantization == "awq"
    assert load_model_spec(tiny).quantization is None
    with pytest.raises(
        ModelLoadError,
        match=r"--quantization=gptq but .* is a awq checkpoint; pass "
        r"--quantization=awq or drop the flag",
    ):
        load_model_spec(good["awq"], quantization="gptq")
    with pytest.raises(ModelLoadError, match=r"--quantization=gptq but .* is not quantized"):
        load_model_spec(tiny, quantization="gptq")
    with pytest.raises(ValueError, match=r"--quantization='int4' is not one of gguf, gptq, awq, compressed-tensors"):
        EngineArgs(model=tiny, quantization="int4").create_engine_config()
    config = EngineArgs(model=good["compressed-tensors"], quantization="compressed-tensors").create_engine_config()
    assert config.spec.quantization == "compressed-tensors"


def test_info_lists_the_format(good, monkeypatch):
    """`cpuinfer info --model` names the method, its scheme and the kernel path: 16-bit activations for a
    weight-only format, int8 ones under the W4A8 opt-in (either spelling)."""
    from cpuinfer import _C, envs

    d = describe(good["gptq"])
    assert d["quantization"] == "gptq" and d["linear layers"] == "GPTQ-4bit-g32-act"
    assert d["kernel"] == f"16-bit activations, {_C.quant_wide_impl('bfloat16')} tile"
    ct = describe(good["compressed-tensors"])
    assert ct["linear layers"] == "W4A16-g32-asym" and ct["kernel"].startswith("16-bit activations")
    for name in envs.INT4_W4A8.names:
        monkeypatch.setenv(name, "1")
        assert describe(good["gptq"])["kernel"] == f"int8 activations, integer kernels, {_C.quant_tile_impl()} tile"
        monkeypatch.delenv(name)
    monkeypatch.setenv(envs.INT4_W4A8.names[1], "maybe")
    with pytest.raises(envs.EnvError, match="VLLM_CPU_INT4_W4A8='maybe' is not a boolean"):
        describe(good["gptq"])
