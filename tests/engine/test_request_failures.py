"""One request's failure (model runner, sampler, detokenizer) fails that request alone: its blocks are freed,
every other request finishes with the tokens it would have produced anyway. A failure of the engine itself
(every request fails, or a batch fails that runs fine one by one) is fatal."""

from __future__ import annotations

import pytest

from cpuinfer.engine.core import MAX_CONSECUTIVE_FAILURES, EngineBrokenError, EngineCore
from cpuinfer.engine.limits import RequestLimits
from cpuinfer.engine.llm_engine import LLMEngine
from cpuinfer.engine.messages import AddRequest
from cpuinfer.engine.scheduler import SchedulerConfig
from cpuinfer.sampling_params import SamplingParams

from .fake_runner import VOCAB, FakeRunner, reference_greedy

POISON = 13  # a prompt holding this token makes the poisoned runner raise
NEW = 6


class PoisonedRunner(FakeRunner):
    """Raises for any batch holding a sequence whose tokens include POISON (a kernel's Python error)."""

    def execute(self, seqs):
        if any(POISON in s.token_ids for s in seqs):
            raise ValueError("kernel refused a shape")
        return super().execute(seqs)


class BatchOnlyFailure(FakeRunner):
    """Fails every batch of more than one sequence, though each runs fine alone: the engine's fault."""

    def execute(self, seqs):
        if len(seqs) > 1:
            raise RuntimeError("broken batching")
        return super().execute(seqs)


def make_core(runner, num_blocks=64):
    core = EngineCore(
        runner,
        SchedulerConfig(4096, 16, 256),
        num_blocks,
        16,
        True,
        [],
        RequestLimits(max_model_len=256, vocab_size=VOCAB),
    )
    return core


def drain(core):
    tokens: dict[str, list[int]] = {}
    ends: dict[str, tuple] = {}
    while core.has_unfinished():
        for o in core.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                ends[o.request_id] = (o.finish_reason, o.error_id)
    return tokens, ends


PROMPTS = {"a": [1, 2, 3, 4], "poisoned": [5, POISON, 7], "c": list(range(20, 40))}


def greedy():
    return SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def test_a_request_that_fails_in_the_runner_fails_alone():
    core = make_core(PoisonedRunner(64, 16))
    for rid, p in PROMPTS.items():
        core.add_request(AddRequest(rid, p, greedy()))
    tokens, ends = drain(core)
    assert ends["poisoned"][0] == "error" and ends["poisoned"][1].startswith("err-")
    for rid in ("a", "c"):
        assert ends[rid] == ("length", None)
        assert tokens[rid] == reference_greedy(PROMPTS[rid], NEW)
    assert core.pool.num_free == core.pool.num_blocks and not core.requests
    # The engine goes on: a new request after the failure runs normally.
    core.add_request(AddRequest("after", [9, 8, 7], greedy()))
    tokens, ends = drain(core)
    assert tokens["after"] == reference_greedy([9, 8, 7], NEW)


def test_a_request_that_fails_in_the_sampler_fails_alone():
    core = make_core(FakeRunner(64, 16))
    real = core.sampler

    def sampler(logits, reqs):
        if any(r.request_id == "poisoned" for r in reqs):
            raise IndexError("index 2000000000 is out of bounds")
        return real(logits, reqs)

    core.sampler = sampler
    for rid, p in PROMPTS.items():
        core.add_request(AddRequest(rid, p, greedy()))
    tokens, ends = drain(core)
    assert ends["poisoned"][0] == "error"
    for rid in ("a", "c"):
        assert tokens[rid] == reference_greedy(PROMPTS[rid], NEW)
    assert core.pool.num_free == core.pool.num_blocks


def test_n_samples_share_one_message_and_each_has_its_own_seed():
    core = make_core(FakeRunner(64, 16))
    params = SamplingParams(n=3, temperature=1.0, seed=2**63 - 1, max_tokens=NEW, ignore_eos=True)
    core.add_request(AddRequest("r", [1, 2, 3], params, ["0_r", "1_r", "2_r"]))
    assert sorted(core.requests) == ["0_r", "1_r", "2_r"]
    seeds = [core.requests[f"{i}_r"].params.seed for i in range(3)]
    assert seeds == [2**63 - 1, -(2**63), -(2**63) + 1]  # seed + index, wrapped into 64 bits
    tokens, _ = drain(core)
    assert all(len(tokens[f"{i}_r"]) == NEW for i in range(3))


def test_every_request_failing_means_the_engine_is_broken():
    core = make_core(PoisonedRunner(256, 16), num_blocks=256)
    with pytest.raises(EngineBrokenError, match="in a row"):
        for i in range(MAX_CONSECUTIVE_FAILURES):
            core.add_request(AddRequest(f"p{i}", [POISON, i], greedy()))
            drain(core)


def test_a_batch_that_fails_while_each_request_runs_alone_is_the_engines_failure():
    core = make_core(BatchOnlyFailure(64, 16))
    core.add_request(AddRequest("a", [1, 2], greedy()))
    core.add_request(AddRequest("b", [3, 4], greedy()))
    with pytest.raises(EngineBrokenError, match="each runs alone"):
        drain(core)


class FlakyTokenizer:
    """The real tokenizer, except that decoding a sequence holding `bad` raises (a detokenizer bug)."""

    def __init__(self, tok, bad: int):
        self.tok, self.bad = tok, bad

    def decode(self, ids, skip_special_tokens=True):
        if self.bad in ids:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_a_request_that_fails_in_the_detokenizer_fails_alone(smol_tokenizer):
    core = make_core(FakeRunner(64, 16))
    first_a = reference_greedy(PROMPTS["a"], 1)[0]
    engine = LLMEngine(None, core, FlakyTokenizer(smol_tokenizer, first_a))
    engine.add_request("a", PROMPTS["a"], greedy())
    engine.add_request("c", PROMPTS["c"], greedy())
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["a"].outputs[0].finish_reason == "error" and finals["a"].error_id.startswith("err-")
    assert finals["c"].error_id is None
    assert finals["c"].outputs[0].token_ids == reference_greedy(PROMPTS["c"], NEW)
    assert core.pool.num_free == core.pool.num_blocks and not core.requests
