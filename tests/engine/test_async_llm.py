"""AsyncLLM: the engine core in its own process, driven from asyncio (what `cpuinfer serve` builds on)."""

from __future__ import annotations

import asyncio
import os

import pytest

from cpuinfer.config import EngineArgs
from cpuinfer.engine.async_llm import AsyncLLM
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
        ids = engine.encode("The capital of France is")
        s1 = engine.add_request("a", ids, greedy)
        s2 = engine.add_request("b", ids, delta)
        s3 = engine.add_request("c", engine.encode("Count: 1, 2, 3,"), SamplingParams(max_tokens=200,
                                                                                       ignore_eos=True))
        with pytest.raises(ValueError, match="max_model_len=512"):
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
