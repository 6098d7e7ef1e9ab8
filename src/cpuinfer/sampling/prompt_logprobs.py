"""Prompt logprobs (vLLM's `prompt_logprobs`, and what `echo` with `logprobs` shows): the model's log-probability
of each prompt token given the tokens before it, from the logits of the positions before it."""

from __future__ import annotations

import torch


def prompt_token_logprobs(logits: torch.Tensor, next_ids: list[int], k: int) -> list[tuple]:
    """For rows of logits [n, V] and the token that followed each: (logprob, rank, top k ids, top k logprobs),
    the sampler's logprob format, of the raw distribution (log_softmax of the logits, as vLLM's default)."""
    lp = logits.float().log_softmax(-1)
    ids = torch.tensor(next_ids, dtype=torch.long)
    chosen = lp.gather(1, ids.unsqueeze(1)).squeeze(1)
    ranks = ((lp > chosen.unsqueeze(1)).sum(-1) + 1).tolist()
    top_ids: list = [[] for _ in next_ids]
    top_lps: list = [[] for _ in next_ids]
    if k:
        values, indices = lp.topk(min(k, lp.shape[-1]), dim=-1)
        top_ids, top_lps = indices.tolist(), values.tolist()
    return [(float(chosen[j]), ranks[j], top_ids[j], top_lps[j]) for j in range(len(next_ids))]
