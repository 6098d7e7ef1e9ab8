"""Verification of proposed tokens against the target model's logits of one step.

A sequence with k proposed tokens d_1..d_k brings k + 1 logit rows: row j is the target's distribution after
the context plus d_1..d_j. Row j is read as plain decoding would read it, with the sequence's sampling state
as if d_1..d_j had been accepted (min_tokens, penalties), so:

- greedy: row j's argmax is plain decoding's token there; the drafts are accepted while they equal it, and the
  first argmax that differs (or row k's, if all match) is the step's last token. With batch-invariant kernels
  the output is plain decoding's, token for token.
- sampling: the standard rule (Leviathan et al. 2023, Chen et al. 2023): accept d_j with probability
  min(1, p_j(d_j) / q_j(d_j)), else draw the last token from max(p_j - q_j, 0) normalised, and after k
  acceptances draw one more from p_k. The output is distributed exactly as the target's. A proposer that
  gives no distribution (n-gram, a greedy draft) proposes d_j with certainty: q_j is one-hot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpuinfer import ops
from cpuinfer.sampling.sampler import Sampler, SampleRequest
from cpuinfer.sampling_params import SamplingParams


@dataclass
class RowView:
    """The sampler's view of one verification row: its sequence as if the drafts before the row were accepted."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    stop_ids: tuple[int, ...]
    generator: torch.Generator | None


def row_views(req: SampleRequest, drafts: list[int]) -> list[RowView]:
    """One view per row (len(drafts) + 1)."""
    out = req.output_token_ids
    return [
        RowView(req.params, req.prompt_token_ids, out + drafts[:j] if j else out, req.stop_ids, req.generator)
        for j in range(len(drafts) + 1)
    ]


@dataclass
class Verified:
    """One sequence's result: its new tokens (the accepted drafts, then one more) and their logprobs."""

    token_ids: list[int]
    logprobs: list | None  # per token, as SampleResult's; None when the request wants none
    num_accepted: int  # drafts accepted
    refused: int | None = None  # under a grammar: a new token the grammar refused (the sequence then fails)


def verify(
    logits: torch.Tensor,
    reqs: list[SampleRequest],
    drafts: list[list[int]],
    sampler: Sampler,
    draft_probs: list[torch.Tensor | None] | None = None,
) -> list[Verified]:
    """Accept or reject each sequence's drafts. logits: [sum(len(d) + 1), V], each sequence's rows in order;
    draft_probs[i]: [len(drafts[i]), V] proposal distributions, or None for certain proposals."""
    views, starts = [], []
    for req, d in zip(reqs, drafts, strict=True):
        starts.append(len(views))
        views += row_views(req, d)
    if len(views) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} logit rows for {len(views)} verification rows")
    adjusted = sampler.adjust(logits, views)
    greedy = [i for i, r in enumerate(reqs) if r.params.greedy]
    results: list[Verified | None] = [None] * len(reqs)
    if greedy:
        rows = [starts[i] + j for i in greedy for j in range(len(drafts[i]) + 1)]
        argmax = ops.argmax(adjusted[rows]).tolist()  # the sampler's own argmax: the same ties
        at = 0
        for i in greedy:
            d = drafts[i]
            best = argmax[at : at + len(d) + 1]
            at += len(d) + 1
            a = 0
            while a < len(d) and d[a] == best[a]:
                a += 1
            results[i] = Verified(best[: a + 1], None, a)
    sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
    if sampled:
        rows = [starts[i] + j for i in sampled for j in range(len(drafts[i]) + 1)]
        probs = sampler.distribution(adjusted[rows], [views[r].params for r in rows])
        at = 0
        for i in sampled:
            n = len(drafts[i]) + 1
            q = draft_probs[i] if draft_probs is not None else None
            g = reqs[i].generator or sampler.generator
            tokens, a = rejection_sample(probs[at : at + n], drafts[i], q, g)
            results[i] = Verified(tokens, None, a)
            at += n
    for i, req in enumerate(reqs):
        if req.params.logprobs is not None:
            r = results[i]
            rows = [starts[i] + j for j in range(len(r.token_ids))]
            r.logprobs = sampler.logprobs(logits[rows], r.token_ids, [views[j] for j in rows])
    return results


def rejection_sample(
    p: torch.Tensor, drafts: list[int], q: torch.Tensor | None, generator: torch.Generator
) -> tuple[list[int], int]:
    """The standard rule over one sequence's rows: p [k + 1, V] target probabilities, q [k, V] proposal
    probabilities (None: each draft proposed with certainty). Returns (new tokens, drafts accepted)."""
    out = []
    for j, x in enumerate(drafts):
        qx = 1.0 if q is None else float(q[j, x])
        px = float(p[j, x])
        u = float(torch.rand(1, generator=generator))
        if qx > 0 and u * qx < px:  # u < p/q without dividing by a tiny q
            out.append(x)
            continue
        if q is None:
            residual = p[j].clone()
            residual[x] = 0.0
        else:
            residual = (p[j] - q[j]).clamp_(min=0.0)
        total = float(residual.sum())
        # p == q on the support (nothing left): the rejection had probability 0; draw from p.
        residual = residual / total if total > 0 else p[j]
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out, j
    out.append(int(torch.multinomial(p[len(drafts)], 1, generator=generator)))
    return out, len(drafts)
