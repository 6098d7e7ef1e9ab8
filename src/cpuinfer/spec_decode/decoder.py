"""Speculative decoding in the engine's step: who speculates how far, and what came of it.

Before the scheduler runs, `propose` gives each decoding sequence up to k draft tokens (its `spec_token_ids`);
the scheduler runs them with the sequence's pending token as one k + 1 row chunk in the step's single forward
pass, and `verify` turns that sequence's k + 1 logit rows into its new tokens.

When it speculates: a decode step on a CPU reads every weight once whatever its row count, so at small batches
the extra rows are nearly free; a large batch is already compute-bound and gains nothing. So:
- no speculation while more than `disable_by_batch_size` sequences decode, or while a prefill chunk of more
  than MAX_PREFILL_ROWS tokens may join the step (the verification pass asks the model for every row's
  logits, prefill rows included: worker.model_runner says why);
- each sequence's k is the one that maximises expected tokens per unit of step time, from its running
  per-token acceptance rate a (exponential averages of accepted proposals over proposals tried: a run of A
  accepted out of k tried A + 1 of them, or k if all passed): a step of k proposals yields
  (1 - a^(k+1)) / (1 - a) tokens and costs 1 + ROW_COST * k plain steps. When no k beats plain decoding the
  sequence stops proposing for a while (4, 8, ... up to 64 steps) and then tries again, so speculation that
  does not pay costs little.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cpuinfer.sampling.sampler import Sampler
from cpuinfer.spec_decode.config import SpeculativeConfig
from cpuinfer.spec_decode.grammar import advance, grammar_prefix, mask_rows
from cpuinfer.spec_decode.proposer import NgramProposer, Proposer
from cpuinfer.spec_decode.verify import Verified, verify

DEFAULT_DISABLE_BY_BATCH_SIZE = 8
# Each extra verification row's cost in plain decode steps: a 5-row step of SmolLM2 (bf16, batch 1, 300
# tokens of context) took 1.74-1.85x a 1-row step (bench_spec.py, 2 shared cores), i.e. about 0.2 a row.
ROW_COST = 0.2
PREDICTION_K = 8  # proposals per step from a prediction when the engine was started without speculation
MAX_PREFILL_ROWS = 256
EMA = 0.5  # weight of the newest step in the acceptance rate


@dataclass
class SeqSpecState:
    """One sequence's acceptance history."""

    accepted: float = 1.0  # exponential averages of proposals accepted and proposals tried
    tried: float = 1.0
    off_steps: int = 0  # steps left without proposals
    backoff: int = 4  # length of the next pause


@dataclass
class SpecStats:
    """vLLM's spec-decode counters (cumulative)."""

    num_drafts: int = 0  # sequence-steps that carried proposals
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [j]: drafts accepted at position j


class SpecDecoder:
    """Proposes before a step and verifies after it; owns the proposer and the acceptance statistics."""

    def __init__(
        self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int, predictions_only: bool = False
    ):
        self.config = config
        self.predictions_only = predictions_only  # only requests with a prediction speculate
        self.proposer = proposer
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.disable_by_batch_size = config.disable_by_batch_size or DEFAULT_DISABLE_BY_BATCH_SIZE
        self.state: dict[str, SeqSpecState] = {}
        self.stats = SpecStats(accepted_per_pos=[0] * self.k)

    @classmethod
    def for_predictions(cls, max_model_len: int) -> SpecDecoder:
        """The decoder of an engine started without speculation when a request brings a prediction: n-gram
        lookup in the prediction, for such requests only."""
        config = SpeculativeConfig("ngram", PREDICTION_K, 2, 4)
        return cls(config, NgramProposer(2, 4), max_model_len, predictions_only=True)

    @classmethod
    def build(cls, config: SpeculativeConfig, max_model_len: int, draft_runner_factory=None) -> SpecDecoder:
        """The decoder of a config: n-gram lookup, or a draft model made by draft_runner_factory()."""
        if config.method == "ngram":
            return cls(config, NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max), max_model_len)
        from cpuinfer.spec_decode.draft import DraftModelProposer

        return cls(config, DraftModelProposer(draft_runner_factory(), config.num_speculative_tokens), max_model_len)

    # ---- before the step ------------------------------------------------------------------------
    def propose(self, running: list, waiting, free_slots: int) -> None:
        """Set spec_token_ids of every running sequence (empty where it does not speculate this step);
        free_slots: how many waiting sequences may start this step."""
        decoding = []
        prefill_rows = 0
        for r in running:
            r.spec_token_ids = []
            if r.num_pending == 1 and r.params.pooling is None:  # a pooling request's prompt is never decoded
                decoding.append(r)
            else:
                prefill_rows += r.num_pending
        for i, r in enumerate(waiting):
            if i >= free_slots or prefill_rows > MAX_PREFILL_ROWS:
                break
            prefill_rows += r.num_pending
        if not decoding or len(decoding) > self.disable_by_batch_size or prefill_rows > MAX_PREFILL_ROWS:
            return
        seqs, ks = [], []
        for r in decoding:
            k = self._k(r)
            if k > 0:
                seqs.append(r)
                ks.append(k)
        if not seqs:
            return
        for r, drafts in zip(seqs, self.proposer.propose(seqs, ks), strict=True):
            r.spec_token_ids = list(drafts) if r.grammar is None else grammar_prefix(r.grammar, list(drafts))

    def _k(self, r) -> int:
        """How many tokens r may speculate now (0: none)."""
        if self.predictions_only and not r.prediction_token_ids:
            return 0
        s = self.state.setdefault(r.request_id, SeqSpecState())
        if s.off_steps > 0:
            s.off_steps -= 1
            return 0
        room = min(r.max_tokens - len(r.output_token_ids) - 1, self.max_model_len - r.num_tokens)
        return min(best_k(s.accepted / s.tried, self.k), room)

    # ---- after the step -------------------------------------------------------------------------
    def verify(self, logits: torch.Tensor, reqs: list, sampler: Sampler, grammars=None) -> list[Verified]:
        """New tokens of each sequence from its k + 1 rows (reqs' spec_token_ids are the drafts); keeps the
        statistics. A constrained sequence's rows are masked by its grammar (`grammars`, the engine's
        StructuredOutputManager) and its grammar advanced by the new tokens (Verified.refused: a token it
        refused)."""
        drafts = [r.spec_token_ids for r in reqs]
        if any(r.grammar is not None for r in reqs):
            logits = logits.clone()  # masked in place below
            at = 0
            for r, d in zip(reqs, drafts, strict=True):
                if r.grammar is not None:
                    mask_rows(grammars, r.grammar, d, logits[at : at + len(d) + 1])
                at += len(d) + 1
        out = verify(logits, reqs, drafts, sampler)  # proposals are certain (q one-hot): n-gram, greedy draft
        for r, v in zip(reqs, out, strict=True):
            if r.grammar is not None:
                v.refused = advance(r.grammar, v.token_ids)
        st = self.stats
        for r, d, v in zip(reqs, drafts, out, strict=True):
            st.num_drafts += 1
            st.num_draft_tokens += len(d)
            st.num_accepted_tokens += v.num_accepted
            for j in range(v.num_accepted):
                st.accepted_per_pos[j] += 1
            if getattr(self.proposer, "from_prediction", {}).get(r.request_id):
                r.num_accepted_prediction_tokens += v.num_accepted
                r.num_rejected_prediction_tokens += len(d) - v.num_accepted
            s = self.state.setdefault(r.request_id, SeqSpecState())
            tried = v.num_accepted + (v.num_accepted < len(d))
            s.accepted = (1 - EMA) * s.accepted + EMA * v.num_accepted
            s.tried = (1 - EMA) * s.tried + EMA * tried
            if best_k(s.accepted / s.tried, self.k) == 0:
                s.off_steps, s.backoff = s.backoff, min(64, 2 * s.backoff)
                s.accepted, s.tried = 0.4, 1.0  # after the pause, k = 1: one more miss pauses it again, longer
            elif v.num_accepted:
                s.backoff = 4
        return out

    def drop(self, request_id: str) -> None:
        """Forget a sequence (finished or aborted)."""
        self.state.pop(request_id, None)
        self.proposer.drop(request_id)


def best_k(a: float, k_max: int) -> int:
    """The k in 0..k_max with the most expected tokens per unit of step time at per-token acceptance rate a."""
    best, best_gain, expect, term = 0, 1.0, 1.0, 1.0
    for k in range(1, k_max + 1):
        term *= a
        expect += term  # 1 + a + ... + a^k
        gain = expect / (1.0 + ROW_COST * k)
        if gain > best_gain + 1e-9:
            best, best_gain = k, gain
    return best
