"""The scheduler's whole-prompt mode (encoders): a prompt runs in one step or waits; never a chunk."""

from __future__ import annotations

from cpuinfer.engine.block_pool import BlockPool
from cpuinfer.engine.request import Request
from cpuinfer.engine.scheduler import Scheduler, SchedulerConfig
from cpuinfer.sampling_params import PoolingParams


def test_whole_prompts_wait_instead_of_chunking():
    sched = Scheduler(SchedulerConfig(50, 8, 64, whole_prompts=True), BlockPool(32, 16, False))
    params = PoolingParams().as_sampling()
    reqs = [Request(str(i), list(range(1, n + 1)), params, i, 1) for i, n in enumerate((40, 30, 8))]
    for r in reqs:
        sched.add(r)
    steps = []
    while sched.has_unfinished():
        out = sched.schedule()
        assert all(s.start_pos == 0 and len(s.token_ids) == len(r.prompt_token_ids) for r, s in out.scheduled)
        steps.append([r.request_id for r, _ in out.scheduled])
        sched.update(out, [])
    # 40 fits; 30 would need a chunk of 10, so it waits (and the queue stays in order) for the next step.
    assert steps == [["0"], ["1", "2"]]
    assert all(r.finish_reason == "stop" and not r.output_token_ids for r in reqs)


def test_pooling_requests_never_speculate():
    """A pooling request whose prompt has one token left looks like a decoding one: the speculative decoder
    proposes nothing for it (a generation request beside it still gets its proposals)."""
    from cpuinfer.sampling_params import SamplingParams
    from cpuinfer.spec_decode.config import SpeculativeConfig
    from cpuinfer.spec_decode.decoder import SpecDecoder

    spec = SpecDecoder.build(SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3}), 64)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    pooled = Request("p", prompt, PoolingParams().as_sampling(), 0, 8)  # room for proposals: refused all the same
    gen = Request("g", prompt, SamplingParams(max_tokens=8), 1, 8)
    for r in (pooled, gen):
        r.num_computed_tokens = len(prompt) - 1  # one token pending
    spec.propose([pooled, gen], [], 0)
    assert pooled.spec_token_ids == []
    assert gen.spec_token_ids  # the n-gram 1 2 -> 3 1 2
