"""Sampler against straightforward torch references; SamplingParams validation."""

from __future__ import annotations

import pytest
import torch

from cpuinfer.engine.request import Request
from cpuinfer.sampling.sampler import Sampler, apply_penalties, filter_min_p, filter_top_k, filter_top_p
from cpuinfer.sampling_params import SamplingParams

V = 50


def req(params, prompt=(1, 2, 3), out=(), rid="r"):
    r = Request(rid, list(prompt), params, 0, 100, frozenset([0]))
    for t in out:
        r.append_token(t)
    return r


def test_top_k_reference():
    x = torch.randn(4, V)
    k = torch.tensor([1, 5, 0, V])
    y = x.clone()
    filter_top_k(y, k)
    for i, kk in enumerate([1, 5, V, V]):
        keep = set(x[i].topk(kk).indices.tolist())
        assert set(torch.nonzero(y[i] > float("-inf")).flatten().tolist()) == keep


def test_top_p_reference():
    x = torch.randn(3, V)
    ps = [0.1, 0.5, 0.95]
    y = x.clone()
    filter_top_p(y, torch.tensor(ps))
    for i, p in enumerate(ps):
        probs = x[i].softmax(-1)
        order = probs.argsort(descending=True).tolist()
        keep, mass = [], 0.0
        for t in order:  # smallest set reaching p
            keep.append(t)
            mass += float(probs[t])
            if mass >= p:
                break
        assert set(torch.nonzero(y[i] > float("-inf")).flatten().tolist()) == set(keep)


def test_min_p_reference():
    x = torch.randn(2, V)
    y = x.clone()
    filter_min_p(y, torch.tensor([0.2, 0.0]))
    probs = x[0].softmax(-1)
    assert set(torch.nonzero(y[0] > float("-inf")).flatten().tolist()) == set(
        torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist()
    )
    assert torch.equal(y[1], x[1])


def test_penalties_reference():
    x = torch.randn(V)
    prompt, out = [1, 2, 3], [3, 4, 4, 4]
    y = x.clone()
    apply_penalties(y, prompt, out, 1.3, 0.5, 0.25)
    ref = x.clone()
    for t in set(prompt) | set(out):
        ref[t] = ref[t] / 1.3 if ref[t] > 0 else ref[t] * 1.3
    for t in set(out):
        ref[t] -= 0.5 * out.count(t) + 0.25
    torch.testing.assert_close(y, ref)


def test_greedy_and_logprobs_equal_log_softmax():
    logits = torch.randn(3, V)
    reqs = [
        req(SamplingParams(temperature=0, logprobs=5)),
        req(SamplingParams(temperature=0)),
        req(SamplingParams(temperature=0, logprobs=0)),
    ]
    res = Sampler()(logits, reqs)
    assert res.token_ids == logits.argmax(-1).tolist()
    lsm = logits.log_softmax(-1)
    lp, rank, ids, vals = res.logprobs[0]
    top = lsm[0].topk(5)
    assert ids == top.indices.tolist() and vals == pytest.approx(top.values.tolist(), abs=1e-6)
    assert lp == pytest.approx(float(lsm[0].max())) and rank == 1
    assert res.logprobs[1] is None
    assert res.logprobs[2][2] == [] and res.logprobs[2][0] == pytest.approx(float(lsm[2].max()))


def test_seeded_sampling_independent_of_batch():
    torch.manual_seed(1)
    rows = torch.randn(6, V)
    p = SamplingParams(temperature=0.8, top_p=0.9, seed=1234)

    def draw(batch_rows, target):
        r = req(p)
        others = [req(SamplingParams(temperature=1.0)) for _ in batch_rows]
        s = Sampler(seed=7)
        tokens = []
        for _step in range(20):
            logits = (
                torch.cat([rows[target : target + 1], rows[batch_rows]]) if batch_rows else rows[target : target + 1]
            )
            tokens.append(s(logits, [r, *others[: len(batch_rows)]]).token_ids[0])
            r.append_token(tokens[-1])
        return tokens

    alone = draw([], 0)
    assert draw([1, 2, 3], 0) == alone
    assert draw([4, 5], 0) == alone
    assert len(set(alone)) > 1  # actually sampling


def test_sampling_distribution_matches_filtered_softmax():
    logits = torch.randn(1, 8) * 2
    p = SamplingParams(temperature=0.7, top_k=4)
    s = Sampler(seed=0)
    counts = torch.zeros(8)
    r = req(p)
    for _ in range(4000):
        counts[s(logits, [r]).token_ids[0]] += 1
    ref = logits[0] / 0.7
    ref[ref < ref.topk(4).values[-1]] = float("-inf")
    torch.testing.assert_close(counts / counts.sum(), ref.softmax(-1), atol=0.03, rtol=0)


def test_min_tokens_masks_stop_tokens():
    logits = torch.zeros(1, V)
    logits[0, 0] = 100  # eos is by far the most likely
    r = req(SamplingParams(temperature=0, min_tokens=2))
    assert Sampler()(logits, [r]).token_ids[0] != 0
    r = req(SamplingParams(temperature=0, min_tokens=2), out=[5, 6])
    assert Sampler()(logits, [r]).token_ids[0] == 0


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(temperature=-1), r"temperature=-1.*\[0, 1e\+06\]"),
        (dict(temperature=2e6), r"temperature=2000000.0.*\[0, 1e\+06\]"),
        (dict(top_p=0), r"top_p=0.*\(0, 1\]"),
        (dict(top_p=1.5), r"top_p=1.5.*\(0, 1\]"),
        (dict(n=0), r"n=0.*\[1, 128\]"),
        (dict(n=129), r"n=129.*\[1, 128\]"),
        (dict(seed=2**64), "seed"),
        (dict(top_k=2**31), "top_k"),
        (dict(top_k=-2), "top_k=-2"),
        (dict(min_p=2), r"min_p=2.*\[0, 1\]"),
        (dict(max_tokens=0), r"max_tokens=0.*\[1, "),
        (dict(min_tokens=5, max_tokens=2), "min_tokens=5.*max_tokens=2"),
        (dict(presence_penalty=3), r"presence_penalty=3.*\[-2, 2\]"),
        (dict(repetition_penalty=0), r"repetition_penalty=0.*\(0, 10000\]"),
        (dict(repetition_penalty=50000), r"repetition_penalty=50000.*\(0, 10000\]"),
        (dict(stop_token_ids=[2**31]), "stop_token_ids"),
        (dict(logprobs=-1), "logprobs=-1"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_invalid_sampling_params(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_params_defaults_like_vllm():
    p = SamplingParams(stop="x", top_k=-1)
    assert p.stop == ["x"] and p.top_k == 0 and p.max_tokens == 16 and p.n == 1 and p.temperature == 1.0


def test_logit_bias_shifts_the_named_logits_only_for_its_row():
    torch.manual_seed(0)
    logits = torch.randn(2, V)
    top = int(logits[0].argmax())
    biased = SamplingParams(temperature=0.0, logit_bias={top: -100.0, 7: 100.0})
    out = Sampler(0)(logits.clone(), [req(biased, rid="a"), req(SamplingParams(temperature=0.0), rid="b")])
    assert out.token_ids == [7, int(logits[1].argmax())]
    # A sampled row too: +100 leaves essentially all of the probability on token 7.
    sampled = SamplingParams(temperature=1.0, seed=3, logit_bias={7: 100.0})
    assert Sampler(0)(logits.clone(), [req(sampled)]).token_ids == [7]


@pytest.mark.parametrize("bias", [{1: 101.0}, {-1: 1.0}, {"3": 1.0}, {1: float("nan")}, [1]])
def test_bad_logit_bias_is_refused(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)
