"""LLM.generate (the whole engine, float32) gives transformers' greedy tokens on SmolLM2."""

from __future__ import annotations

import pytest
import torch

from cpuinfer import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def add(a, b):"]
NEW = 10


def transformers_greedy(spec, prompt_ids):
    """Greedy continuation by transformers' Llama built from the same GGUF weights (float32)."""
    transformers = pytest.importorskip("transformers")
    from cpuinfer.model_loader import load_weights

    config = transformers.AutoConfig.for_model(**{k: v for k, v in spec.hf_config.items() if k != "architectures"})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors, _ = load_weights(spec)
    model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    model.tie_weights()
    outs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            y = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=NEW,
                min_new_tokens=NEW,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(y[0, len(ids) :].tolist())
    return outs


def test_llm_generate_matches_transformers(smol_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.05")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    llm = LLM(model=smol_path, dtype="float32", max_model_len=256, block_size=16)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)
    assert [o.prompt for o in outs] == PROMPTS
    ref = transformers_greedy(llm.llm_engine.config.spec, [o.prompt_token_ids for o in outs])
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
