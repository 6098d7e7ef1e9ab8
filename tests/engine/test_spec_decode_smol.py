"""Speculative decoding on SmolLM2 (the bundled GGUF, bf16): greedy tokens and their logprobs with n-gram
speculation (k = 1..8; batching, chunked prefill, prefix caching, preemption; bf16 and fp8_e5m2 KV caches)
equal plain decoding's, token for token. The kernels are batch-invariant, so a verification row's logits are
plain decoding's."""

from __future__ import annotations

import pytest

from cpuinfer.sampling_params import SamplingParams
from cpuinfer.spec_decode.config import SpeculativeConfig
from cpuinfer.spec_decode.decoder import SpecDecoder
from cpuinfer.spec_decode.proposer import NgramProposer

from .conftest import NUM_BLOCKS
from .test_engine_e2e import engine_on as plain_engine

CODE = """def add(a, b):
    return a + b


def sub(a, b):
    return a - b


def mul(a, b):
    return a * b
"""
PROMPTS = [
    "Repeat this code exactly:\n" + CODE + "\nHere it is again:\n",
    "one two three four five six seven one two three four five six seven one two three",
    "The capital of France is",
    "List: apple, banana, cherry, apple, banana, cherry, apple,",
]
NEW = 40


def engine_on(runner, spec, k=0, num_blocks=NUM_BLOCKS, batched=4096, caching=True, lookup=(2, 4)):
    decoder = None
    if k:
        cfg = SpeculativeConfig.parse(
            {
                "method": "ngram",
                "num_speculative_tokens": k,
                "prompt_lookup_min": lookup[0],
                "prompt_lookup_max": lookup[1],
            }
        )
        decoder = SpecDecoder(cfg, NgramProposer(*lookup), 1024)
    return plain_engine(runner, spec, num_blocks, batched, caching=caching, spec=decoder)


def run(engine, prompts, params):
    ids = []
    for p in prompts:
        rid = engine.next_request_id()
        engine.add_request(rid, p, params)
        ids.append(rid)
    final = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o.outputs[0]
    return [final[r] for r in ids]


GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def plain(smol_runner, smol_spec):
    """Each prompt alone without speculation: the reference."""
    return [run(engine_on(smol_runner, smol_spec), [p], GREEDY)[0] for p in PROMPTS]


def same(got, ref):
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [o.text for o in got] == [o.text for o in ref]
    assert [o.logprobs for o in got] == [o.logprobs for o in ref]


@pytest.mark.parametrize("k", [1, 4, 8])
def test_batch_identical_to_plain(smol_runner, smol_spec, plain, k):
    eng = engine_on(smol_runner, smol_spec, k=k)
    same(run(eng, PROMPTS, GREEDY), plain)
    st = eng.core.spec.stats
    assert st.num_accepted_tokens > 0
    assert eng.get_stats().kv_cache_usage == 0.0


@pytest.mark.parametrize(
    "kw",
    [
        dict(batched=16),  # chunked prefill in tiny chunks, proposals cut to the budget
        dict(caching=False),
        dict(lookup=(1, 2)),  # shorter patterns: more, worse proposals
    ],
)
def test_scheduling_variants_identical(smol_runner, smol_spec, plain, kw):
    eng = engine_on(smol_runner, smol_spec, k=4, **kw)
    same(run(eng, PROMPTS, GREEDY), plain)


def test_preemption_identical(smol_runner, smol_spec):
    prompts = [[*smol_spec.tokenizer.encode(PROMPTS[1]).ids[:14], i] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref = [run(engine_on(smol_runner, smol_spec, caching=False), [p], params)[0] for p in prompts]
    eng = engine_on(smol_runner, smol_spec, k=4, num_blocks=6)
    same(run(eng, prompts, params), ref)
    assert eng.get_stats().num_preemptions > 0


def test_fp8_cache_identical_to_plain_fp8(smol_runner_fp8, smol_spec):
    """On an fp8_e5m2 KV cache: speculation (with chunked prefill and prefix caching, then with preemption)
    gives plain fp8 decoding's tokens and logprobs (the verification rows read the same fp8 keys and values)."""
    ref = [run(engine_on(smol_runner_fp8, smol_spec, caching=False), [p], GREEDY)[0] for p in PROMPTS]
    eng = engine_on(smol_runner_fp8, smol_spec, k=4, batched=16)
    same(run(eng, PROMPTS, GREEDY), ref)
    assert eng.core.spec.stats.num_accepted_tokens > 0
    same(run(eng, PROMPTS[:1], GREEDY), ref[:1])  # its prompt's blocks now from the fp8 prefix cache
    assert eng.get_stats().prefix_cache_hits > 0
    prompts = [[*smol_spec.tokenizer.encode(PROMPTS[1]).ids[:14], i] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref = [run(engine_on(smol_runner_fp8, smol_spec, caching=False), [p], params)[0] for p in prompts]
    eng = engine_on(smol_runner_fp8, smol_spec, k=4, num_blocks=6)
    same(run(eng, prompts, params), ref)
    assert eng.get_stats().num_preemptions > 0


def test_stop_strings_and_n(smol_runner, smol_spec):
    params = SamplingParams(temperature=0, max_tokens=NEW, stop=["mul"], n=2)
    ref = run(engine_on(smol_runner, smol_spec), [PROMPTS[0]], params)
    got = run(engine_on(smol_runner, smol_spec, k=4), [PROMPTS[0]], params)
    same(got, ref)
    assert got[0].finish_reason == ref[0].finish_reason


def test_prediction_without_speculative_config(smol_runner, smol_spec, plain):
    """OpenAI's predicted outputs on an engine started without speculation: the prediction feeds the proposer
    of that request alone; output unchanged; accepted and rejected prediction tokens counted."""
    edited = plain[0].text.replace("sub", "minus")  # the client's expectation, partly wrong
    for prediction, all_right in ((plain[0].text, True), (edited, False)):
        params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=2, prediction=prediction)
        eng = engine_on(smol_runner, smol_spec)
        got = run(eng, [PROMPTS[0], PROMPTS[2]], params)
        same(got, [plain[0], plain[2]])
        out = None
        eng2 = engine_on(smol_runner, smol_spec)
        eng2.add_request("p", PROMPTS[0], params)
        while eng2.has_unfinished_requests():
            for o in eng2.step():
                out = o
        accepted = out.metrics["accepted_prediction_tokens"]
        rejected = out.metrics["rejected_prediction_tokens"]
        assert accepted > NEW // 2
        assert (rejected == 0) if all_right else (rejected > 0)
        # Where the prediction has no match, the request's own context is looked up (not counted as prediction).
        assert eng2.get_stats().spec_decode_num_accepted_tokens >= accepted


class StepSpy:
    """The runner, counting the steps that verify proposals and score a prompt at once."""

    def __init__(self, runner):
        self.runner = runner
        self.mixed = 0

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute(self, seqs, checked=False):
        if any(s.num_spec for s in seqs) and any(s.prompt_logits for s in seqs):
            self.mixed += 1
        return self.runner.execute(seqs, checked)


def outputs(engine, steps=None):
    """Step to the end (or `steps` times); every RequestOutput, in order."""
    got = []
    while engine.has_unfinished_requests() and (steps is None or len(got) < steps):
        got += engine.step()
    return got


SCORE = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=2)


def test_prompt_logprobs_beside_verification(smol_runner, smol_spec, plain):
    """One step with a sequence verifying proposals (its last k + 1 rows) and a prompt being scored (every row of
    its chunk): each gets its rows; tokens, logprobs and prompt logprobs equal each request's alone."""
    alone = engine_on(smol_runner, smol_spec)
    alone.add_request("s", PROMPTS[3], SCORE)
    ref = outputs(alone)[-1]
    spy = StepSpy(smol_runner)
    eng = engine_on(spy, smol_spec, k=4)
    eng.add_request("copy", PROMPTS[0], GREEDY)
    outputs(eng, steps=4)  # the prefill, then decode steps with proposals
    eng.add_request("s", PROMPTS[3], SCORE)
    final = {o.request_id: o for o in outputs(eng) if o.finished}
    assert spy.mixed > 0
    same(final["copy"].outputs, [plain[0]])
    assert final["s"].prompt_logprobs == ref.prompt_logprobs
    same(final["s"].outputs, ref.outputs)


def test_prompt_logprobs_of_a_request_that_speculates_from_its_last_prompt_token(smol_runner, smol_spec):
    """A prompt whose last chunk is one token proposes from there (its prediction), so its first step may hand
    out several tokens: the prompt logprobs go out with them."""
    ids = smol_spec.tokenizer.encode(PROMPTS[0]).ids
    ids = ids[: 16 * (len(ids) // 16) - 15]  # 16 m + 1 tokens: chunks of 16, then one
    params = SCORE.clone(max_tokens=NEW)
    alone = engine_on(smol_runner, smol_spec, batched=16)
    alone.add_request("r", ids, params)
    ref = outputs(alone)[-1]
    eng = engine_on(smol_runner, smol_spec, batched=16)
    eng.add_request("r", ids, params.clone(prediction=ref.outputs[0].text))
    got = [o for o in outputs(eng) if o.outputs[0].token_ids]
    assert len(got[0].outputs[0].token_ids) > 1  # the first tokens: the one after the prompt and accepted ones
    assert got[-1].prompt_logprobs == ref.prompt_logprobs
    same(got[-1].outputs, ref.outputs)
