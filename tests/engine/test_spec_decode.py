"""Speculative decoding through the engine core on the fake model (tests/engine/fake_runner.py): proposals of
known quality, verified in the step's one forward pass, leave greedy output token for token as plain decoding
(batching, chunked prefill, prefix caching, preemption, stops, n > 1, logprobs), and every block comes back."""

from __future__ import annotations

import random

import pytest
import torch

from cpuinfer.engine.core import EngineCore
from cpuinfer.engine.limits import RequestLimits
from cpuinfer.engine.messages import AddRequest
from cpuinfer.engine.scheduler import SchedulerConfig
from cpuinfer.sampling_params import SamplingParams
from cpuinfer.spec_decode.config import SpeculativeConfig
from cpuinfer.spec_decode.decoder import SpecDecoder
from cpuinfer.spec_decode.proposer import NgramProposer

from .chi2 import chi2_pvalue
from .fake_runner import VOCAB, FakeRunner, reference_greedy, reference_logits


class OracleProposer:
    """Proposes the fake model's own greedy continuation, each token wrong with probability `noise`."""

    def __init__(self, noise: float, seed: int = 0):
        self.noise = noise
        self.rng = random.Random(seed)

    def propose(self, seqs, ks):
        out = []
        for s, k in zip(seqs, ks, strict=True):
            truth = reference_greedy(s.all_token_ids, k)
            out.append([t if self.rng.random() >= self.noise else (t + 1) % VOCAB for t in truth])
        return out

    def drop(self, request_id):
        pass


def make_core(
    proposer=None,
    k=4,
    num_blocks=64,
    block_size=16,
    batched=4096,
    seqs=256,
    max_len=512,
    caching=True,
    threshold=0,
    eos=(),
    batch_off=0,
):
    runner = FakeRunner(num_blocks, block_size)
    spec = None
    if proposer is not None:
        cfg = SpeculativeConfig("ngram", k, disable_by_batch_size=batch_off or 1000)
        spec = SpecDecoder(cfg, proposer, max_len)
    core = EngineCore(
        runner,
        SchedulerConfig(batched, seqs, max_len, threshold),
        num_blocks,
        block_size,
        caching,
        list(eos),
        RequestLimits(max_model_len=max_len, vocab_size=VOCAB),
        spec=spec,
    )
    return core, runner


def run(core, prompts, max_tokens, params=None):
    out = {i: [] for i in range(len(prompts))}
    lps = {i: [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        core.add_request(AddRequest(str(i), p, params or SamplingParams(temperature=0, max_tokens=max_tokens)))
    for _ in range(10000):
        if not core.has_unfinished():
            break
        for o in core.step():
            out[int(o.request_id)].extend(o.new_token_ids)
            if o.new_logprobs:
                lps[int(o.request_id)].extend(o.new_logprobs)
    assert not core.has_unfinished()
    return [out[i] for i in range(len(prompts))], [lps[i] for i in range(len(prompts))]


def prompts_(n, seed=0, shared=0):
    rng = random.Random(seed)
    prefix = [rng.randrange(VOCAB) for _ in range(shared)]
    return [prefix + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 70))] for _ in range(n)]


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(batched=16),  # chunked prefill forced small: proposals cut to the budget
        dict(threshold=5),
        dict(caching=False),
        dict(num_blocks=12, max_len=160),  # tiny pool: preemption by recompute
        dict(seqs=3),
    ],
)
def test_greedy_identical_to_plain(k, kw):
    ps = prompts_(12, shared=40)
    core, runner = make_core(OracleProposer(0.3), k=k, **kw)
    got, _ = run(core, ps, 20)
    for p, g in zip(ps, got, strict=True):
        assert g == reference_greedy(p, 20)
    assert core.pool.num_free == core.pool.num_blocks  # rejected proposals' blocks came back too
    st = core.spec.stats
    assert st.num_draft_tokens > st.num_accepted_tokens > 0
    assert any(n > 1 and sample for step in runner.steps for _, n, sample in step)
    if kw.get("num_blocks") == 12:
        assert core.stats().num_preemptions > 0
    if "batched" in kw:
        assert max(sum(n for _, n, _ in step) for step in runner.steps) <= kw["batched"]


def test_perfect_proposals_cut_steps():
    p = prompts_(1)[0]
    core, runner = make_core(OracleProposer(0.0), k=4)
    got, _ = run(core, [p], 41)
    assert got[0] == reference_greedy(p, 41)
    assert len(runner.steps) == 1 + 8  # the prefill (1 token), then 5 tokens a step
    assert core.stats().generation_tokens == 41


def test_stops_inside_accepted_tokens():
    p = [5, 6, 7]
    ref = reference_greedy(p, 12)
    core, _ = make_core(OracleProposer(0.0), k=8, eos=[ref[4]])
    assert run(core, [p], 12)[0][0] == ref[: ref.index(ref[4]) + 1]
    core, _ = make_core(OracleProposer(0.0), k=8)
    params = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[ref[6]], min_tokens=2)
    assert run(core, [p], 12, params)[0][0] == ref[: ref.index(ref[6]) + 1]
    for n in (1, 2, 6, 7):  # max_tokens never overshot, however the proposals line up
        core, _ = make_core(OracleProposer(0.0), k=4)
        assert run(core, [p], n)[0][0] == ref[:n]
        assert core.pool.num_free == core.pool.num_blocks


def test_max_model_len_respected():
    p = list(range(40))
    core, _ = make_core(OracleProposer(0.0), k=8, max_len=48)
    got, _ = run(core, [p], 100, SamplingParams(temperature=0, max_tokens=None))
    assert got[0] == reference_greedy(p, 8)


def test_logprobs_of_accepted_tokens_equal_plain():
    ps = prompts_(3)
    params = SamplingParams(temperature=0, max_tokens=15, logprobs=3)
    plain, plain_lp = run(make_core()[0], ps, 15, params)
    spec, spec_lp = run(make_core(OracleProposer(0.2), k=4)[0], ps, 15, params)
    assert spec == plain
    assert spec_lp == plain_lp


def test_penalties_and_n_samples_greedy():
    p = prompts_(1, seed=3)[0]
    params = SamplingParams(temperature=0, max_tokens=15, repetition_penalty=1.3, n=3)
    core, _ = make_core()
    core.add_request(AddRequest("r", p, params, child_ids=["0", "1", "2"]))
    ref = {}
    while core.has_unfinished():
        for o in core.step():
            ref.setdefault(o.request_id, []).extend(o.new_token_ids)
    core, _ = make_core(OracleProposer(0.2), k=4)
    core.add_request(AddRequest("r", p, params, child_ids=["0", "1", "2"]))
    got = {}
    while core.has_unfinished():
        for o in core.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert got == ref
    assert core.spec.stats.num_accepted_tokens > 0


def test_ngram_proposer_on_a_repetitive_sequence():
    prop = NgramProposer(2, 4)

    class S:
        request_id = "s"
        prediction_token_ids = None
        output_token_ids = ()

    s = S()
    s.all_token_ids = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    assert prop.propose([s], [3]) == [[4, 5, 9]]
    s.all_token_ids = [1, 2, 3, 4, 7, 3, 4]  # the most recent earlier occurrence of the longest suffix
    assert prop.propose([s], [5]) == [[7, 3, 4]]
    s.all_token_ids = [1, 2, 3, 4, 5, 6]  # nothing repeats
    assert prop.propose([s], [4]) == [[]]
    s.all_token_ids = [8, 3, 6, 8, 3]
    assert prop.propose([s], [0]) == [[]]
    s.output_token_ids = [10]
    s.prediction_token_ids = [10, 11, 12, 13]
    s.all_token_ids = [1, 2, 10]
    assert prop.propose([s], [2]) == [[11, 12]]


def test_adaptive_k_and_large_batches():
    ps = prompts_(6)
    core, _ = make_core(OracleProposer(1.0), k=4)  # every proposal wrong
    got, _ = run(core, ps, 40)
    assert got == [reference_greedy(p, 40) for p in ps]
    st = core.spec.stats
    assert st.num_accepted_tokens == 0
    assert st.num_draft_tokens < 6 * 40 / 2  # sequences mostly stop proposing
    core, _ = make_core(OracleProposer(0.0), k=4, batch_off=4)
    run(core, ps, 10)
    assert core.spec.stats.num_drafts == 0  # 6 decoding sequences > 4: no speculation


def test_ngram_greedy_identical_on_repetitive_prompts():
    rng = random.Random(1)
    ps = [[rng.randrange(5) for _ in range(60)] for _ in range(4)]  # a tiny alphabet: n-grams repeat
    plain, _ = run(make_core()[0], ps, 30)
    core, _ = make_core(NgramProposer(1, 3), k=4)
    got, _ = run(core, ps, 30)
    assert got == plain
    assert core.spec.stats.num_draft_tokens > 0


def top4(ctx):
    """The fake model's four most likely next tokens after ctx, with their top-k=4 probabilities."""
    t = reference_logits(ctx).topk(4)
    return list(zip(t.indices.tolist(), t.values.softmax(-1).tolist(), strict=True))


class RankProposer:
    """Proposes the rank-th most likely token (of top4) at each position."""

    def __init__(self, rank):
        self.rank = rank

    def propose(self, seqs, ks):
        out = []
        for s, k in zip(seqs, ks, strict=True):
            ctx = list(s.all_token_ids)
            for _ in range(k):
                ctx.append(top4(ctx)[self.rank][0])
            out.append(ctx[len(s.all_token_ids) :])
        return out

    def drop(self, rid):
        pass


def joint_expectation(prompt, n):
    """Target probabilities of the first n generated tokens (top_k=4, temperature 1)."""
    out = {(): 1.0}
    for _ in range(n):
        out = {(*k, t): pk * pt for k, pk in out.items() for t, pt in top4([*prompt, *k])}
    return out


def sample_counts(proposer, prompt, params, n):
    core, _ = make_core(proposer, k=2, seqs=512, num_blocks=600)
    core.add_request(AddRequest("r", prompt, params, child_ids=[str(i) for i in range(n)]))
    got: dict[str, list[int]] = {}
    while core.has_unfinished():
        for o in core.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    st = core.spec.stats
    assert st.num_draft_tokens > st.num_accepted_tokens > 0
    counts: dict[tuple[int, ...], int] = {}
    for toks in got.values():
        counts[tuple(toks)] = counts.get(tuple(toks), 0) + 1
    return counts


PROMPT = [3, 1, 4]


@pytest.mark.parametrize("rank", [0, 2])
def test_rejection_sampling_through_the_engine_keeps_the_distribution(rank):
    """Seeded sampling with top_k=4: the joint frequencies of the first four generated tokens (the later ones
    verified against proposals of the rank-th most likely token) match the target's probabilities (chi-square)."""
    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=4, seed=None)
    n = 3000
    counts = sample_counts(RankProposer(rank), PROMPT, params, n)
    expect = joint_expectation(PROMPT, 4)
    assert set(counts) <= set(expect)
    assert chi2_pvalue(counts, expect, n) > 1e-3


def test_chi_square_catches_a_broken_acceptance_rule(monkeypatch):
    """The same test fails for a wrong rule: on rejection, drawing from p instead of the residual."""
    import cpuinfer.spec_decode.verify as verify_mod

    def broken(p, drafts, q, generator):  # noqa: ARG001 - rejection_sample's signature
        out = []
        for j, x in enumerate(drafts):
            if float(torch.rand(1, generator=generator)) < float(p[j, x]):
                out.append(x)
                continue
            out.append(int(torch.multinomial(p[j], 1, generator=generator)))
            return out, j
        out.append(int(torch.multinomial(p[len(drafts)], 1, generator=generator)))
        return out, len(drafts)

    monkeypatch.setattr(verify_mod, "rejection_sample", broken)
    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=4)
    counts = sample_counts(RankProposer(0), PROMPT, params, 3000)
    assert chi2_pvalue(counts, joint_expectation(PROMPT, 4), 3000) < 1e-6


@pytest.mark.parametrize("with_q", [False, True])
def test_rejection_sample_rule_with_and_without_a_draft_distribution(with_q):
    """The rule alone, on a 6-token vocabulary: the first emitted token is distributed as p_0, whether the
    draft token is certain (q one-hot) or drawn from a draft distribution q."""
    from cpuinfer.spec_decode.verify import rejection_sample

    g = torch.Generator().manual_seed(7)
    p = torch.rand(3, 6, generator=g).softmax(-1) ** 2
    p /= p.sum(-1, keepdim=True)
    q = torch.rand(2, 6, generator=g).softmax(-1)
    n = 20000
    counts: dict = {}
    for _ in range(n):
        d = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(2)] if with_q else [2, 4]
        toks, _ = rejection_sample(p, d, q if with_q else None, g)
        counts[(toks[0],)] = counts.get((toks[0],), 0) + 1
    expect = {(t,): float(p[0, t]) for t in range(6)}
    assert chi2_pvalue(counts, expect, n) > 1e-3


def test_stop_before_accepted_proposals_end_caches_only_real_tokens():
    """A stop token early in a run of accepted proposals: the blocks registered in the prefix cache hold the
    sequence's own tokens only, and a later request with that prefix still decodes as plain decoding."""
    p = list(range(10, 38))  # 28 tokens: the next block boundary (32) falls inside the accepted proposals
    ref = reference_greedy(p, 12)
    assert ref[1] != ref[0]
    core, _ = make_core(OracleProposer(0.0), k=8)
    got, _ = run(core, [p], 12, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[ref[1]]))
    assert got[0] == ref[:2]
    assert core.spec.stats.num_accepted_tokens == 8  # the stop came first of 9 new tokens
    assert core.pool.num_free == core.pool.num_blocks
    got, _ = run(core, [p + ref[:4]], 6)
    assert got[0] == reference_greedy(p + ref[:4], 6)
