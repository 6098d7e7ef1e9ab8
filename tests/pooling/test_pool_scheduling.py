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
        assert all(
            s.start_pos == 0 and len(s.token_ids) == len(r.prompt_token_ids)
            for r, s in zip(out.requests, out.seqs, strict=True)
        )
        steps.append([r.request_id for r in out.requests])
        sched.update(out, [])
    # 40 fits; 30 would need a chunk of 10, so it waits (and the queue stays in order) for the next step.
    assert steps == [["0"], ["1", "2"]]
    assert all(r.finish_reason == "stop" and not r.output_token_ids for r in reqs)
