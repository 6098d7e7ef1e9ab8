"""gpt-oss with MXFP4 experts (quantization_config quant_method "mxfp4", transformers' *_blocks / *_scales
stacks), written here by a round-to-nearest MXFP4 quantizer from a tiny transformers checkpoint:

- float32 (the stacks dequantized exactly): transformers' greedy tokens on the same MXFP4 checkpoint (which it
  dequantizes itself on a CPU), token for token;
- bfloat16: the experts kept packed as MXFP4 (4.25 bits) on the integer kernels, within stated teacher-forced
  bounds of the float32 run; the two executors equal bit for bit; tensor parallelism.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from cpuinfer.model_loader import load_model_spec
from cpuinfer.quantization.mxfp4 import Mxfp4Stack
from cpuinfer.worker import ModelRunner

from .greedy import executors_equal, greedy, hf_greedy
from .test_gguf_moe import teacher_forced
from .test_tiny_models import CASES, PROMPTS

transformers = pytest.importorskip("transformers")
FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)


def quantize_mxfp4(w: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """w [*lead, out, in] -> (blocks uint8 [*lead, out, in / 32, 16], scales uint8 [*lead, out, in / 32]):
    per block of 32 the smallest power-of-two scale that fits its largest magnitude in E2M1's 6, then each
    value rounded to the nearest E2M1 magnitude, low nibble first."""
    x = w.float().numpy().reshape(*w.shape[:-1], -1, 32)
    amax = np.abs(x).max(-1, keepdims=True)
    e = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)).clip(-127, 127)
    scaled = x / np.exp2(e)
    mag = np.abs(np.abs(scaled)[..., None] - FP4).argmin(-1).astype(np.uint8)
    codes = mag | ((scaled < 0) & (mag > 0)).astype(np.uint8) << 3
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.astype(np.uint8), (e[..., 0] + 127).astype(np.uint8)


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    cls, kwargs = CASES["gpt_oss"]
    config = getattr(transformers, cls)(**kwargs)
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    path = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    model.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors.pop(name).transpose(-1, -2))  # stored [experts, in, out]
        tensors[f"{name}_blocks"] = torch.from_numpy(np.ascontiguousarray(blocks))
        tensors[f"{name}_scales"] = torch.from_numpy(np.ascontiguousarray(scales))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (path / "config.json").write_text(json.dumps(cfg))
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)
    ).eval()
    return str(path), ref


def test_float32_equals_transformers(mxfp4_checkpoint):
    path, ref = mxfp4_checkpoint
    spec = load_model_spec(path, "float32")
    assert spec.quantization == "mxfp4"
    runner = ModelRunner(spec, block_size=16, num_blocks=64, cache_dtype=torch.float32)
    out, first = greedy(runner, PROMPTS, 32, batched=True, chunk=7)
    for i, prompt in enumerate(PROMPTS):
        tokens, logits = hf_greedy(ref, prompt, 32)
        assert out[i] == tokens, f"prompt {i}"
        torch.testing.assert_close(first[i], logits, atol=1e-4, rtol=1e-4)


def test_bf16_experts_stay_mxfp4_exactly(mxfp4_checkpoint, monkeypatch):
    path, ref = mxfp4_checkpoint
    runner, _, _ = executors_equal(path, monkeypatch, "MXFP4", batched=True, chunk=7)
    # Kept as the file has it (codes and exponent bytes, 4.25 bits a weight), exactly: a kept expert's
    # dequantization is the stack's own.
    w = runner.model.layers[0].plan.mlp.down_w[3]
    assert w.fp4 and w.bits == 4 and w.d is None
    assert w.nbytes * 8 == 4.25 * (-(-w.n // 16) * 16) * w.k
    exact = ModelRunner(load_model_spec(path, "float32"), block_size=16, num_blocks=64, cache_dtype=torch.float32)
    want = exact.model.layers[0].plan.mlp.down_w[3]
    assert torch.equal(w.dequantize(torch.float32), want)
    agree, errors = teacher_forced(runner, exact, ref, PROMPTS, 32)
    # Measured on Sapphire Rapids (amx): agreement 0.938, median relative L2 error 0.016; the int8 activations
    # (per block of 32, as llama.cpp runs MXFP4) are the only loss: the weights are exact.
    assert agree >= 0.85, f"teacher-forced agreement {agree:.1%}"
    assert errors.median() < 0.05, f"median relative L2 error {errors.median():.3f}"


def test_stack_codes_and_bad_stacks(tmp_path):
    """The reader's layout: byte j's low nibble is value 2j; bad stacks are a ModelLoadError naming them."""
    from cpuinfer.model_loader import ModelLoadError
    from cpuinfer.quantization.mxfp4 import rewrite

    w = torch.tensor([[0.5, -1.0, 6.0, -6.0] + [0.0] * 28])
    blocks, scales = quantize_mxfp4(w)
    stack = Mxfp4Stack(blocks, scales)
    assert torch.equal(stack.dequantize(torch.float32), w)
    assert torch.equal(stack.weight(()).dequantize(torch.float32), w)
    # An exponent the kernels cannot take exactly (255 is NaN in E8M0; below 2, f32 subnormal scales): no packed
    # weight, the caller dequantizes.
    for e in (0, 1, 255):
        assert Mxfp4Stack(blocks, np.full_like(scales, e)).weight(()) is None
    with pytest.raises(ModelLoadError, match="no x_scales"):
        rewrite({"x_blocks": torch.from_numpy(blocks)}, torch.bfloat16, str(tmp_path))
    with pytest.raises(ModelLoadError, match="not MXFP4 blocks"):
        rewrite(
            {"x_blocks": torch.from_numpy(blocks).float(), "x_scales": torch.from_numpy(scales)},
            torch.bfloat16,
            str(tmp_path),
        )


def test_gguf_gpt_oss_from_llama_cpp_converter(mxfp4_checkpoint, tmp_path, monkeypatch):
    """The same checkpoint converted by llama.cpp's own converter (`gpt-oss`, experts in GGUF's MXFP4 type,
    gate and up split, biases and sinks as tensors): float32 equals transformers token for token; bf16 keeps
    the MXFP4 experts packed (exactly) with the executors equal."""
    from .llama_cpp_convert import convert

    path, ref = mxfp4_checkpoint
    gguf = convert(path, str(tmp_path / "gpt-oss.gguf"), "f32")
    spec = load_model_spec(gguf, "float32")
    assert spec.architecture == "GptOssForCausalLM"
    runner = ModelRunner(spec, block_size=16, num_blocks=64, cache_dtype=torch.float32)
    out, first = greedy(runner, PROMPTS, 32, batched=True, chunk=7)
    for i, prompt in enumerate(PROMPTS):
        tokens, logits = hf_greedy(ref, prompt, 32)
        assert out[i] == tokens, f"prompt {i}"
        torch.testing.assert_close(first[i], logits, atol=1e-4, rtol=1e-4)
    executors_equal(gguf, monkeypatch, "MXFP4")
