"""The full engine on SmolLM2: greedy tokens do not depend on batching, chunking, prefix caching, preemption;
the fp8 cache path is self-consistent; LLM.generate matches transformers greedy."""

from __future__ import annotations

import pytest

from cpuinfer.engine.core import EngineCore
from cpuinfer.engine.limits import RequestLimits
from cpuinfer.engine.llm_engine import LLMEngine
from cpuinfer.engine.scheduler import SchedulerConfig
from cpuinfer.sampling_params import SamplingParams

from .conftest import BLOCK, NUM_BLOCKS

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village, there lived an old clockmaker who",  # > 1 block
    "The capital of France is a city where",  # shares a prefix with the first
]
NEW = 6


def engine_on(
    runner, model, num_blocks=NUM_BLOCKS, batched=4096, seqs=256, caching=True, threshold=0, max_model_len=1024, **core
):
    """An engine over `runner` for `model` (a ModelSpec); `core`: EngineCore's optional parts (spec= a SpecDecoder,
    host_tier=)."""
    engine_core = EngineCore(
        runner,
        SchedulerConfig(batched, seqs, max_model_len, threshold),
        num_blocks,
        BLOCK,
        caching,
        model.eos_token_ids,
        RequestLimits(max_model_len=max_model_len, vocab_size=model.vocab_size),
        **core,
    )
    return LLMEngine(None, engine_core, model.tokenizer)


def run(engine, prompts, n_new=NEW):
    sp = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True)
    ids = []
    for p in prompts:
        rid = engine.next_request_id()
        engine.add_request(rid, p, sp)
        ids.append(rid)
    final = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o.outputs[0].token_ids
    return [final[r] for r in ids]


@pytest.fixture(scope="module")
def alone(smol_runner, smol_spec):
    """Each prompt run by itself: the reference."""
    return [run(engine_on(smol_runner, smol_spec), [p])[0] for p in PROMPTS]


def long_prompt(i):
    return f"Story {i}: " + "the quick brown fox jumps over the lazy dog " * (3 + i % 4)


def test_batch_of_32_mixed(smol_runner, smol_spec, alone):
    others = [long_prompt(i) for i in range(32 - len(PROMPTS))]
    got = run(engine_on(smol_runner, smol_spec), PROMPTS + others)
    assert got[: len(PROMPTS)] == alone


@pytest.mark.parametrize(
    "kw",
    [
        dict(batched=16),  # chunked prefill in tiny chunks
        dict(threshold=5),  # long-prefill threshold
        dict(caching=False),
    ],
)
def test_same_greedy_tokens(smol_runner, smol_spec, alone, kw):
    eng = engine_on(smol_runner, smol_spec, **kw)
    got = run(eng, PROMPTS)
    assert got == alone
    stats = eng.get_stats()
    if kw.get("caching", True):
        assert stats.prefix_cache_queries > 0
    assert stats.kv_cache_usage == 0.0


def test_preemption_gives_same_tokens(smol_runner, smol_spec):
    # 14-token prompts fill one block each; at token 16 every request needs a second one: a 4-block pool
    # must preempt (recompute) the newest requests, and the oldest must never starve.
    prompts = [smol_spec.tokenizer.encode(long_prompt(i)).ids[:14] for i in range(4)]
    ref = [run(engine_on(smol_runner, smol_spec, caching=False), [p])[0] for p in prompts]
    for caching in (False, True):
        eng = engine_on(smol_runner, smol_spec, num_blocks=4, caching=caching)
        assert run(eng, prompts) == ref
        assert eng.get_stats().num_preemptions > 0


def test_prefix_cache_hit_gives_same_tokens(smol_runner, smol_spec):
    eng = engine_on(smol_runner, smol_spec)
    shared = "You are a helpful assistant. Answer briefly and precisely. " * 3
    first = run(eng, [shared + "Question: what is 2+2?"])
    second = run(eng, [shared + "Question: what is 3+3?", shared + "Question: what is 2+2?"])
    assert eng.get_stats().prefix_cache_hits >= 2 * BLOCK
    assert second[1] == first[0]
    assert second[0] == run(engine_on(smol_runner, smol_spec, caching=False), [shared + "Question: what is 3+3?"])[0]


def test_fp8_cache_consistent(smol_runner_fp8, smol_spec):
    ps = [PROMPTS[2], long_prompt(0)]
    alone8 = [run(engine_on(smol_runner_fp8, smol_spec, caching=False), [p])[0] for p in ps]
    mixed = run(engine_on(smol_runner_fp8, smol_spec, batched=16), ps + [long_prompt(i) for i in range(1, 3)])
    assert mixed[:2] == alone8
    cached = engine_on(smol_runner_fp8, smol_spec)
    run(cached, ps[1:])
    assert run(cached, ps[1:]) == alone8[1:]  # served from fp8 prefix-cache blocks
    assert cached.get_stats().prefix_cache_hits > 0


def test_bad_request_does_not_disturb_others(smol_runner, smol_spec, alone):
    eng = engine_on(smol_runner, smol_spec)
    sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    eng.add_request("good", PROMPTS[0], sp)
    eng.step()
    with pytest.raises(ValueError, match="maximum context length is 1024"):
        eng.add_request("long", [1] * 1025, sp)
    with pytest.raises(ValueError, match="too large: 2000"):
        eng.add_request("overflow", PROMPTS[1], SamplingParams(max_tokens=2000))
    final = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            final = o
    assert final.request_id == "good" and final.outputs[0].token_ids == alone[0]
