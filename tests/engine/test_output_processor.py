"""LLMEngine's front end (n samples, stop strings, output kinds) over the fake model and the real tokenizer."""

from __future__ import annotations

import pytest

from cpuinfer.engine.core import EngineCore
from cpuinfer.engine.limits import RequestLimits
from cpuinfer.engine.llm_engine import LLMEngine
from cpuinfer.engine.scheduler import SchedulerConfig
from cpuinfer.sampling_params import RequestOutputKind, SamplingParams

from .fake_runner import VOCAB, FakeRunner, reference_greedy


@pytest.fixture
def engine(smol_tokenizer):
    core = EngineCore(
        FakeRunner(64, 16),
        SchedulerConfig(64, 8, 256),
        64,
        16,
        True,
        [],
        RequestLimits(max_model_len=256, vocab_size=VOCAB),
    )
    return LLMEngine(None, core, smol_tokenizer)


def drain(engine):
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def test_text_and_tokens(engine, smol_tokenizer):
    p = [40, 41, 42]
    engine.add_request("a", p, SamplingParams(temperature=0, max_tokens=12))
    final = drain(engine)["a"][-1]
    ref = reference_greedy(p, 12)
    assert final.finished and final.outputs[0].token_ids == ref
    assert final.outputs[0].text == smol_tokenizer.decode(ref)
    assert final.outputs[0].finish_reason == "length"
    assert final.prompt_token_ids == p


def test_stop_string_truncates_and_frees(engine, smol_tokenizer):
    p = [40, 41, 42]
    ref = reference_greedy(p, 30)
    full = smol_tokenizer.decode(ref)
    stop = full[10:14]
    engine.add_request("a", p, SamplingParams(temperature=0, max_tokens=30, stop=[stop]))
    final = drain(engine)["a"][-1].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == full[: full.index(stop)]
    assert len(final.token_ids) < 30
    assert engine.core.pool.num_free == engine.core.pool.num_blocks and not engine.core.requests


def test_delta_outputs_add_up(engine):
    p = [7, 8, 9]
    engine.add_request("c", p, SamplingParams(temperature=0, max_tokens=15))
    engine.add_request("d", p, SamplingParams(temperature=0, max_tokens=15, output_kind=RequestOutputKind.DELTA))
    engine.add_request("f", p, SamplingParams(temperature=0, max_tokens=15, output_kind=RequestOutputKind.FINAL_ONLY))
    outs = drain(engine)
    cum = outs["c"][-1].outputs[0]
    assert "".join(o.outputs[0].text for o in outs["d"]) == cum.text
    assert [t for o in outs["d"] for t in o.outputs[0].token_ids] == cum.token_ids
    assert len(outs["f"]) == 1 and outs["f"][0].outputs[0].text == cum.text


def test_n_samples_seeded(engine):
    p = [3, 4, 5]
    sp = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10, logprobs=2)
    engine.add_request("s", p, sp)
    first = drain(engine)["s"][-1]
    engine.add_request("s2", p, sp)
    second = drain(engine)["s2"][-1]
    assert [o.index for o in first.outputs] == [0, 1, 2]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in second.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1
    for o in first.outputs:
        assert len(o.logprobs) == len(o.token_ids)
        for tok, lp in zip(o.token_ids, o.logprobs, strict=True):
            assert tok in lp and len(lp) <= 3
        assert o.cumulative_logprob == pytest.approx(
            sum(lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs, strict=True))
        )


def test_bad_request_rejected_others_finish(engine):
    engine.add_request("ok", [1, 2], SamplingParams(temperature=0, max_tokens=5))
    engine.step()
    with pytest.raises(ValueError, match="maximum context length is 256"):
        engine.add_request("bad", [1] * 300, SamplingParams())
    with pytest.raises(ValueError, match=r"too large: 250.*256"):
        engine.add_request("bad2", [1] * 10, SamplingParams(max_tokens=250))
    outs = drain(engine)
    assert outs["ok"][-1].finished and "bad" not in outs


def test_abort(engine):
    engine.add_request("x", [1, 2], SamplingParams(max_tokens=100))
    engine.step()
    engine.abort_request("x")
    assert not engine.has_unfinished_requests()
    assert engine.core.pool.num_free == engine.core.pool.num_blocks
