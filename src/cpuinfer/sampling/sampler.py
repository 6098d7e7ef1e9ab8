"""Turn one step's logits into tokens: penalties, temperature, min-p, top-k, top-p, seeded sampling, logprobs.

Order as in vLLM: stop tokens masked until min_tokens; logit_bias added; repetition / frequency /
presence penalties; then greedy rows take the argmax, the others are divided
by their temperature, filtered by min-p, top-k and top-p, and sampled with the
exponential-race trick (argmax of p / q, q ~ Exp(1)), which equals sampling from
p. A request with a seed draws its q from its own generator, once per token, so
its samples do not depend on which other requests share the batch. Logprobs are
of the raw model distribution (log_softmax of the logits), like vLLM's default.

The common case (all greedy, no penalties, no logprobs) is one argmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from cpuinfer import ops
from cpuinfer.sampling_params import SamplingParams


class SampleRequest(Protocol):
    """What the sampler reads of one sequence (the engine's Request has these; so can a test's stand-in)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    stop_ids: tuple[int, ...]  # masked until min_tokens are out
    generator: torch.Generator | None  # a seeded request's own; None: the sampler's


@dataclass
class SampleResult:
    """Sampled ids, plus per row (None unless requested) the top logprobs and the sampled token's."""

    token_ids: list[int]
    # For each row: None, or (sampled logprob, sampled rank, [top ids], [top logprobs]).
    logprobs: list[tuple[float, int, list[int], list[float]] | None]


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: list[int],
    output_ids: list[int],
    repetition: float,
    frequency: float,
    presence: float,
) -> None:
    """In place on one row [V]: vLLM's repetition (prompt+output), frequency and presence (output) penalties."""
    vocab = logits.shape[-1]
    out = torch.tensor(output_ids, dtype=torch.long)
    counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype) if output_ids else None
    if repetition != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor(prompt_ids, dtype=torch.long)] = True
        if counts is not None:
            seen |= counts > 0
        penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits.copy_(torch.where(seen, penalized, logits))
    if counts is not None:
        if frequency != 0.0:
            logits -= frequency * counts
        if presence != 0.0:
            logits -= presence * (counts > 0).to(logits.dtype)


def filter_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """In place [B,V]: drop tokens whose probability is below min_p times the top probability."""
    probs = logits.softmax(-1)
    top = probs.amax(-1, keepdim=True)
    logits.masked_fill_(probs < min_p.unsqueeze(1) * top, float("-inf"))


def filter_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> None:
    """In place [B,V]: keep the k largest logits per row (k = 0: keep all); ties at the k-th value are kept."""
    vocab = logits.shape[-1]
    k = torch.where(top_k <= 0, vocab, top_k.clamp(max=vocab))
    kmax = int(k.max())
    top_vals = logits.topk(kmax, dim=-1).values
    kth = top_vals.gather(1, (k - 1).unsqueeze(1))
    logits.masked_fill_(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> None:
    """In place [B,V]: keep the smallest set of most likely tokens whose probability reaches top_p."""
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    before = probs.cumsum(-1) - probs  # probability mass strictly ahead of each token
    drop = before >= top_p.unsqueeze(1)
    drop[:, 0] = False
    logits.scatter_(1, idx, sorted_logits.masked_fill(drop, float("-inf")))


class Sampler:
    """Samples one token per row of the step's logits."""

    def __init__(self, seed: int | None = 0):
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, reqs: list[SampleRequest]) -> SampleResult:
        """logits: float32 [len(reqs), V], rows in the order of reqs."""
        params = [r.params for r in reqs]
        want_lp = [p.logprobs is not None for p in params]
        raw = logits
        logits = self.adjust(logits, reqs)
        greedy = [p.greedy for p in params]
        tokens = ops.argmax(logits).tolist() if all(greedy) else self._sample(logits, reqs, params, greedy)
        lps: list = [None] * len(reqs)
        if any(want_lp):
            lps = self.logprobs(raw, tokens, reqs)
        return SampleResult(tokens, lps)

    @staticmethod
    def adjust(logits: torch.Tensor, reqs: list[SampleRequest]) -> torch.Tensor:
        """float32 logits after the stop-token mask (until min_tokens), logit_bias and the penalties (a copy if any
        applies)."""
        params = [r.params for r in reqs]
        logits = logits.float()
        # Stop tokens cannot be sampled before min_tokens.
        masked = False
        for i, (r, p) in enumerate(zip(reqs, params, strict=False)):
            if p.min_tokens and len(r.output_token_ids) < p.min_tokens and r.stop_ids:
                if not masked:
                    logits = logits.clone()
                    masked = True
                logits[i, list(r.stop_ids)] = float("-inf")
        for i, p in enumerate(params):
            if p.logit_bias:
                if not masked:
                    logits = logits.clone()
                    masked = True
                ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
                logits[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
        for i, (r, p) in enumerate(zip(reqs, params, strict=False)):
            if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty:
                if not masked:
                    logits = logits.clone()
                    masked = True
                apply_penalties(
                    logits[i],
                    r.prompt_token_ids,
                    r.output_token_ids,
                    p.repetition_penalty,
                    p.frequency_penalty,
                    p.presence_penalty,
                )
        return logits

    @staticmethod
    def distribution(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """[R, V] probabilities that non-greedy rows of adjusted logits are sampled from (temperature, min-p,
        top-k, top-p applied). Overwrites `logits`: pass a copy."""
        x = logits
        temp = torch.tensor([p.temperature for p in params], dtype=x.dtype)
        x /= temp.unsqueeze(1)
        min_p = [p.min_p for p in params]
        if any(min_p):
            filter_min_p(x, torch.tensor(min_p, dtype=x.dtype))
        top_k = [p.top_k for p in params]
        if any(top_k):
            filter_top_k(x, torch.tensor(top_k))
        top_p = [p.top_p for p in params]
        if any(t < 1.0 for t in top_p):
            filter_top_p(x, torch.tensor(top_p, dtype=x.dtype))
        return x.softmax(-1)

    def _sample(self, logits: torch.Tensor, reqs: list[SampleRequest], params: list, greedy: list[bool]) -> list[int]:
        rows = [i for i, g in enumerate(greedy) if not g]
        probs = self.distribution(logits[rows], [params[i] for i in rows])  # logits[rows] is a copy
        q = torch.empty_like(probs)
        unseeded = [j for j, i in enumerate(rows) if reqs[i].generator is None]
        if len(unseeded) == len(rows):
            q.exponential_(generator=self.generator)
        else:
            for j, i in enumerate(rows):
                g = reqs[i].generator
                if g is not None:
                    q[j].exponential_(generator=g)
            if unseeded:
                q[unseeded] = torch.empty(len(unseeded), q.shape[1]).exponential_(generator=self.generator)
        sampled = ops.argmax(probs / q).tolist()
        tokens = ops.argmax(logits).tolist() if len(rows) < len(reqs) else [0] * len(reqs)
        for j, i in enumerate(rows):
            tokens[i] = sampled[j]
        return tokens

    @classmethod
    def logprobs(cls, raw: torch.Tensor, tokens: list[int], reqs: list[SampleRequest]) -> list:
        """Per row, None or (the token's logprob, its rank, top ids, top logprobs) as the request asks."""
        params = [r.params for r in reqs]
        return cls._logprobs(raw, tokens, params, [p.logprobs is not None for p in params])

    @staticmethod
    def _logprobs(raw: torch.Tensor, tokens: list[int], params: list, want: list[bool]):
        rows = [i for i, w in enumerate(want) if w]
        lp = raw[rows].float().log_softmax(-1)
        k = max(params[i].logprobs for i in rows)
        picked = torch.tensor([tokens[i] for i in rows])
        sampled_lp = lp.gather(1, picked.unsqueeze(1)).squeeze(1)
        ranks = ((lp > sampled_lp.unsqueeze(1)).sum(-1) + 1).tolist()
        if k:
            top_lp, top_ids = lp.topk(k, dim=-1)
            top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
        out: list = [None] * len(tokens)
        for j, i in enumerate(rows):
            n = params[i].logprobs
            ids, vals = (top_ids[j][:n], top_lp[j][:n]) if n else ([], [])
            out[i] = (float(sampled_lp[j]), ranks[j], ids, vals)
        return out
