"""Prompt logprobs (vLLM's prompt_logprobs; echo with logprobs on the server): each prompt token's logprob given
the tokens before it. Reference: the engine's own generation logprobs of the same tokens (a greedy continuation
fed back as prompt must score as it was generated: rank 1, same logprob), and an unchunked prefill for a
chunked one."""

from __future__ import annotations

import math

import pytest

from cpuinfer import LLM, SamplingParams

PROMPT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"


@pytest.fixture(scope="module")
def llm(monkeypatch_module):  # noqa: ARG001 - the fixture sets the KV size
    return LLM(max_model_len=512, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_CPU_KVCACHE_SPACE", "0.25")
    yield mp
    mp.undo()


def test_a_greedy_continuation_scores_as_it_was_generated(llm):
    gen = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, logprobs=0), use_tqdm=False)[0]
    out = gen.outputs[0]
    ids = gen.prompt_token_ids + out.token_ids
    scored = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[
        0
    ]
    plp = scored.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    for i, tok in enumerate(ids[1:], start=1):
        assert tok in plp[i] and len(plp[i]) <= 3  # top 2 plus the prompt's own token
        assert plp[i][tok].decoded_token is not None
    for k, tok in enumerate(out.token_ids):
        got, want = plp[len(gen.prompt_token_ids) + k][tok], out.logprobs[k][tok]
        assert got.rank == 1
        assert math.isclose(got.logprob, want.logprob, abs_tol=0.15), (k, got, want)


def test_chunked_prefill_and_a_cached_prefix_give_the_same_prompt_logprobs(llm, monkeypatch_module):  # noqa: ARG001
    whole = llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0].prompt_logprobs
    chunked = LLM(max_model_len=512, max_num_batched_tokens=16, block_size=16)
    first = chunked.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    again = chunked.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    for other in (first.prompt_logprobs, again.prompt_logprobs):  # the second would hit the prefix cache
        assert len(other) == len(whole) and other[0] is None
        for a, b in zip(whole[1:], other[1:], strict=True):
            assert a.keys() == b.keys()  # prompt_logprobs=0: the prompt token alone
            tok = next(iter(a))
            assert math.isclose(a[tok].logprob, b[tok].logprob, abs_tol=0.15)


def test_prompt_logprobs_over_the_limit_are_refused(llm):
    with pytest.raises(ValueError, match="prompt_logprobs=21"):
        llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=21), use_tqdm=False)
