"""AsyncLLM: the engine core in its own process, driven from asyncio (what `cpuinfer serve` builds on)."""

from __future__ import annotations

import asyncio
import gc
import os
import time

import pytest

from cpuinfer.config import EngineArgs
from cpuinfer.engine.async_llm import AsyncLLM
from cpuinfer.errors import EngineOverloadedError, InvalidRequestError
from cpuinfer.sampling_params import RequestOutputKind, SamplingParams


@pytest.fixture(scope="module")
def engine(smol_path):
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "0.05"
    try:
        eng = AsyncLLM.from_engine_args(EngineArgs(model=smol_path, max_model_len=512, block_size=16))
    finally:
        del os.environ["VLLM_CPU_KVCACHE_SPACE"]
    yield eng
    eng.shutdown()


def test_streams_abort_stats_and_errors(engine, smol_tokenizer):
    async def go():
        greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        delta = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        ids = smol_tokenizer.encode("The capital of France is").ids
        s1 = engine.add_request("a", ids, greedy)
        s2 = engine.add_request("b", ids, delta)
        s3 = engine.add_request(
            "c", smol_tokenizer.encode("Count: 1, 2, 3,").ids, SamplingParams(max_tokens=200, ignore_eos=True)
        )
        with pytest.raises(InvalidRequestError, match="maximum context length is 512"):
            engine.add_request("bad", [1] * 600, greedy)
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request("a", ids, greedy)

        async def collect(s):
            return [o async for o in s]

        async def abort_soon():
            first = await s3.__anext__()
            assert not first.finished
            await engine.abort("c")
            return [first] + [o async for o in s3]

        outs_a, outs_b, outs_c = await asyncio.gather(collect(s1), collect(s2), abort_soon())
        final = outs_a[-1].outputs[0]
        assert outs_a[-1].finished and len(final.token_ids) == 12
        assert final.text == smol_tokenizer.decode(final.token_ids)
        assert "".join(o.outputs[0].text for o in outs_b) == final.text
        assert outs_c[-1].finished and outs_c[-1].outputs[0].finish_reason == "abort"
        stats = await engine.get_stats()
        assert stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0.0
        assert stats.generation_tokens >= 24 and stats.prefix_cache_queries > 0
        # Same prompt, same greedy tokens again (now from the prefix cache).
        again = [o async for o in engine.generate("The capital of France is", greedy, "d")]
        assert again[-1].outputs[0].token_ids == final.token_ids

    asyncio.run(go())


async def _wait_idle(engine, timeout: float = 30.0):
    """Stats once nothing runs or waits and every KV block is free (fails after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await engine.get_stats()
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0.0:
            return stats
        assert time.monotonic() < deadline, f"engine still busy: {stats}"
        await asyncio.sleep(0.05)


def test_a_stream_dropped_without_aclose_is_aborted_and_frees_its_blocks(engine, smol_tokenizer):
    async def go():
        ids = smol_tokenizer.encode("Once upon a time").ids
        stream = engine.add_request("dropped", ids, SamplingParams(max_tokens=400, ignore_eos=True))
        first = await stream.__anext__()
        assert not first.finished
        stats = await engine.get_stats()
        assert stats.num_running == 1 and stats.kv_cache_usage > 0
        del stream, first
        gc.collect()
        await _wait_idle(engine)
        assert "dropped" not in engine.processor.states

    asyncio.run(go())


def test_every_limit_is_checked_before_the_request_starts(engine, smol_tokenizer):
    async def go():
        ids = smol_tokenizer.encode("hi").ids
        vocab = engine.limits.vocab_size
        bad = {
            "stop_token_ids": SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[2_000_000_000]),
            "min_tokens": SamplingParams(max_tokens=None, min_tokens=1_000_000),
            "stop": SamplingParams(stop=[f"s{i}" for i in range(engine.limits.max_stop_strings + 1)]),
            "logprobs": SamplingParams(logprobs=engine.limits.max_logprobs + 1),
        }
        for field, params in bad.items():
            with pytest.raises(InvalidRequestError) as info:
                engine.add_request(f"bad-{field}", ids, params)
            assert info.value.param == field, (field, info.value)
        with pytest.raises(InvalidRequestError, match=f"vocabulary has {vocab} tokens") as info:
            engine.add_request("bad-prompt", [1, vocab, vocab + 7], SamplingParams())
        assert str(vocab) in str(info.value) and info.value.param == "prompt"
        assert not engine.processor.states
        # Nothing of them reached the engine: it is idle and serves the next request.
        await _wait_idle(engine)
        out = [o async for o in engine.generate(ids, SamplingParams(max_tokens=3, ignore_eos=True), "ok")]
        assert len(out[-1].outputs[0].token_ids) == 3

    asyncio.run(go())


def test_a_full_waiting_queue_refuses_with_overloaded(engine, smol_tokenizer):
    async def go():
        ids = smol_tokenizer.encode("hi").ids
        saved = engine.max_queued_seqs
        engine.max_queued_seqs = 3
        try:
            s1 = engine.add_request("q1", ids, SamplingParams(n=2, max_tokens=50, ignore_eos=True))
            with pytest.raises(EngineOverloadedError, match="capacity"):
                engine.add_request("q2", ids, SamplingParams(n=2, max_tokens=50, ignore_eos=True))
            s3 = engine.add_request("q3", ids, SamplingParams(max_tokens=50, ignore_eos=True))
            await s1.aclose()
            await s3.aclose()
        finally:
            engine.max_queued_seqs = saved
        await _wait_idle(engine)

    asyncio.run(go())


def test_the_core_runs_the_config_it_is_given(smol_path):
    """The flags are resolved once, in the front end: the core process loads exactly the EngineConfig it is handed
    (here one whose KV pool was changed after resolution), and never resolves the flags again."""
    import dataclasses

    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "0.05"
    try:
        config = EngineArgs(model=smol_path, max_model_len=256, block_size=16).create_engine_config(serving=True)
    finally:
        del os.environ["VLLM_CPU_KVCACHE_SPACE"]
    assert config.num_blocks != 37
    eng = AsyncLLM(dataclasses.replace(config, num_blocks=37))
    try:
        assert eng.num_blocks == 37
        assert asyncio.run(eng.get_stats()).num_kv_blocks == 37
    finally:
        eng.shutdown()
