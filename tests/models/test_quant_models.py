"""Tiny random Llama checkpoints in GPTQ, AWQ and compressed-tensors, run by us against transformers.

transformers runs the reference: the same checkpoint with every projection replaced by the format's own
dequantization (quant_checkpoints.py). Tolerances, per run mode:
- float32 (the reference mode: weights dequantized at load): GPTQ and AWQ are exact (f16 scales), so
  greedy tokens equal transformers' and logits agree to 1e-4; compressed-tensors' float32 scales are
  rounded to f16 (2**-11), measured relative logits error 0.0006-0.0012: checked < 0.01, and tokens
  teacher-forced (below) within 0.02 x RMS (measured <= 0.0001).
- bfloat16 (weights kept quantized; 16-bit activations for the weight-only formats, int8 per block of 32
  for W8A8): measured relative L2 error of the first-token logits 0.018-0.039 on these models when every
  format ran with int8 activations (GPTQ 0.018-0.039, AWQ 0.021-0.030, compressed-tensors 0.018-0.034):
  checked < 0.1 (test_quant_agreement.py holds the 16-bit path to a plain bf16 run). Tiny random models
  have near ties, so tokens are checked teacher-forced: every token we chose is within 0.25 x the logits' RMS of the
  reference's best at that step (measured <= 0.093), and batching changes no token.
"""

from __future__ import annotations

import pytest
import torch

from cpuinfer.model_loader import load_model_spec
from cpuinfer.quantization import is_quantized
from cpuinfer.worker import ModelRunner

from .greedy import greedy, hf_greedy
from .quant_checkpoints import quantize_dir
from .test_tiny_models import COMMON

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 7, 8, 120, 33, 2, 64, 91, 11, 200, 19, 45, 61, 72], list(range(30, 67)), [9, 8]]
NEW_TOKENS = 16
CASES = {
    f"gptq-{b}bit-g{g}-{'sym' if s else 'asym'}{'-act' if a else ''}": (
        "gptq",
        dict(bits=b, group=g, sym=s, act_order=a),
    )
    for b in (4, 8)
    for g in (32, 128, -1)
    for s in (True, False)
    for a in (False, True)
}
CASES["gptq-4bit-g32-asym-act-v2"] = ("gptq", dict(bits=4, group=32, sym=False, act_order=True, v1=False))
CASES.update({f"awq-g{g}": ("awq", dict(group=g)) for g in (64, 128)})
CASES.update(
    {
        "ct-w8a8": ("compressed-tensors", dict(scheme="W8A8")),
        "ct-w8a8-asym": ("compressed-tensors", dict(scheme="W8A8", sym=False)),
        "ct-w4a16-g32": ("compressed-tensors", dict(scheme="W4A16", group=32)),
        "ct-w4a16-g128-asym": ("compressed-tensors", dict(scheme="W4A16", group=128, sym=False)),
        "ct-w4a16-channel": ("compressed-tensors", dict(scheme="W4A16")),
    }
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama in float32, written by transformers."""
    config = transformers.LlamaConfig(**COMMON, tie_word_embeddings=False)
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tiny, tmp_path_factory):
    method, opts = CASES[request.param]
    path = str(tmp_path_factory.mktemp("q") / request.param)
    ref_dir = quantize_dir(tiny, path, method, **opts)
    model = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    return request.param, method, opts, path, model


def _runner(path: str, dtype: str) -> ModelRunner:
    spec = load_model_spec(path, dtype)
    return ModelRunner(spec, block_size=16, num_blocks=32, cache_dtype=getattr(torch, dtype))


def near_reference(
    model, name: str, out: list[list[int]], first: list[torch.Tensor], rel_tol: float, gap_tol: float
) -> None:
    """First-token logits within rel_tol (relative L2) of transformers', and every greedy token, teacher-forced,
    within gap_tol x the logits' RMS of the reference's best at its step."""
    for i, p in enumerate(PROMPTS):
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([p + out[i][:-1]])).logits[0, len(p) - 1 :].float()
        rel = ((first[i] - logits[0]).norm() / logits[0].norm()).item()
        assert rel < rel_tol, f"{name} prompt {i}: relative logits error {rel:.4f}"
        chosen = logits[torch.arange(NEW_TOKENS), torch.tensor(out[i])]
        gap = (logits.amax(-1) - chosen) / logits.pow(2).mean(-1).sqrt()
        assert gap.max() <= gap_tol, f"{name} prompt {i}: a token {gap.max():.3f} RMS below the reference's best"


def test_float32_reference_mode_matches_transformers(case):
    """float32 runs dequantize at load: transformers' greedy tokens and logits within the stated tolerance."""
    name, method, _, path, model = case
    runner = _runner(path, "float32")
    assert runner.spec.quantization == method
    out, first = greedy(runner, PROMPTS, NEW_TOKENS)
    if method == "compressed-tensors":
        near_reference(model, name, out, first, rel_tol=0.01, gap_tol=0.02)
        return
    for i, p in enumerate(PROMPTS):
        toks, logits = hf_greedy(model, p, NEW_TOKENS)
        assert out[i] == toks, f"{name} prompt {i}"
        torch.testing.assert_close(first[i], logits, atol=1e-4, rtol=1e-4)


def test_quantized_run_matches_transformers(case):
    """bf16 runs keep every projection quantized: logits and teacher-forced tokens within the stated tolerance,
    and the same tokens whether prompts run alone or batched with chunked prefill."""
    name, _, opts, path, model = case
    runner = _runner(path, "bfloat16")
    layer = runner.model.layers[0]
    weights = (layer.plan.attn.qkv_w, layer.plan.attn.o_w, layer.plan.mlp.gate_up_w, layer.plan.mlp.down_w)
    assert all(is_quantized(w) for w in weights), name
    if opts.get("act_order") and opts["group"] != -1:  # k in more than one group: read through a perm
        assert all((p.perm is not None) == (p.k > opts["group"]) for w in weights for p in w.parts)
    out, first = greedy(runner, PROMPTS, NEW_TOKENS)
    near_reference(model, name, out, first, rel_tol=0.1, gap_tol=0.25)
    batched, _ = greedy(runner, PROMPTS, NEW_TOKENS, batched=True, chunk=7)
    assert batched == out, name
