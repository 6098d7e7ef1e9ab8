"""Front-end side of a request: fan-out of n samples, detokenization, stop strings, RequestOutput objects.

Runs where the tokenizer lives (the caller's process), never in the engine core.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from cpuinfer.detokenizer import IncrementalDetokenizer
from cpuinfer.engine.messages import AddRequest, SeqOutput
from cpuinfer.errors import InvalidRequestError, new_error_id
from cpuinfer.outputs import CompletionOutput, Logprob, RequestOutput
from cpuinfer.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("cpuinfer.engine")


def child_id(request_id: str, index: int, n: int) -> str:
    """Engine-core id of sample `index` of a request (the request id itself when n == 1)."""
    return request_id if n == 1 else f"{index}_{request_id}"


@dataclass
class _Sample:
    index: int
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0  # for DELTA outputs
    prediction_tokens: tuple[int, int] = (0, 0)  # (accepted, rejected) of the request's prediction so far


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample]
    num_cached_tokens: int = 0
    error_id: str | None = None
    error_reason: str | None = None
    error_param: str | None = None
    prompt_logprobs: list | None = None  # PromptLogprobs, once the core has sent them
    prompt_logprobs_sent: bool = False  # for DELTA outputs: they go out once
    pooled: object = None  # a pooling request's vector (torch float32), once the core has sent it


class OutputProcessor:
    """Turns the core's per-sequence token outputs into RequestOutputs."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, _RequestState] = {}
        self._child: dict[str, tuple[_RequestState, _Sample]] = {}

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams
    ) -> AddRequest:
        """Register a request; returns the one message that starts its n sequences in the core (each
        sample draws its own numbers; a seeded one uses seed + index, as vLLM)."""
        if request_id in self.states:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        samples = []
        for i in range(params.n):
            detok = None
            if params.detokenize and self.tokenizer is not None:
                detok = IncrementalDetokenizer(
                    self.tokenizer,
                    prompt_token_ids,
                    params.skip_special_tokens,
                    params.stop,
                    params.include_stop_str_in_output,
                )
            samples.append(
                _Sample(
                    i,
                    detok,
                    logprobs=[] if params.logprobs is not None else None,
                    cumulative_logprob=0.0 if params.logprobs is not None else None,
                )
            )
        state = _RequestState(request_id, prompt, prompt_token_ids, params, samples)
        self.states[request_id] = state
        ids = [child_id(request_id, i, params.n) for i in range(params.n)]
        for s, cid in zip(samples, ids, strict=True):
            self._child[cid] = (state, s)
        prediction = None
        if params.prediction and self.tokenizer is not None:
            prediction = self.tokenizer.encode(params.prediction, add_special_tokens=False).ids
        return AddRequest(request_id, prompt_token_ids, params, ids if params.n > 1 else [], prediction)

    def child_ids(self, request_id: str) -> list[str]:
        """Core ids of a request's unfinished sequences."""
        state = self.states.get(request_id)
        if state is None:
            return []
        n = state.params.n
        return [child_id(request_id, s.index, n) for s in state.samples if s.finish_reason is None]

    def abort(self, request_id: str) -> RequestOutput | None:
        """Mark a request aborted and forget it; returns its final output."""
        state = self.states.get(request_id)
        if state is None:
            return None
        for s in state.samples:
            if s.finish_reason is None:
                s.finish_reason = "abort"
        out = self._make_output(state, True)
        self._forget(state)
        return out

    def process(self, outputs: list[SeqOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step; returns (RequestOutputs to hand out, core ids to abort: a stop string hit, or the
        request failed). A failure while processing one request (e.g. in its detokenizer) fails that request
        alone, with an error id in its output and the details in the log."""
        touched: dict[str, _RequestState] = {}
        to_abort = []
        for o in outputs:
            found = self._child.get(o.request_id)
            if found is None:  # aborted or already stopped by a stop string
                continue
            state, s = found
            if s.finish_reason is not None:
                continue
            touched[state.request_id] = state
            if o.error_id is not None:
                to_abort += self._fail(state, o.error_id, o.error_reason, o.error_param)
                continue
            try:
                self._apply(state, s, o, to_abort)
            except Exception as exc:  # logged below: this request fails; the others go on
                error_id = new_error_id()
                logger.error(
                    "request %s failed in the output processor (error id %s)", state.request_id, error_id, exc_info=exc
                )
                to_abort += self._fail(state, error_id)
        results = []
        for state in touched.values():
            finished = all(s.finish_reason is not None for s in state.samples)
            if state.params.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
                continue
            results.append(self._make_output(state, finished))
            if finished:
                self._forget(state)
        return results, to_abort

    def _apply(self, state: _RequestState, s: _Sample, o: SeqOutput, to_abort: list[str]) -> None:
        """One sequence's new tokens: logprobs, detokenization, stop strings, finish reason."""
        state.num_cached_tokens = max(state.num_cached_tokens, o.num_cached_tokens)
        if o.pooled is not None:
            state.pooled = o.pooled
        s.prediction_tokens = (o.accepted_prediction_tokens, o.rejected_prediction_tokens)
        p = state.params
        if o.prompt_logprobs is not None and state.prompt_logprobs is None:  # every sample sends them: keep one
            prompt = state.prompt_token_ids
            state.prompt_logprobs = [None] + [
                self._logprob_dict(tok, lp) for tok, lp in zip(prompt[1:], o.prompt_logprobs[1:], strict=True)
            ]
        for k, tok in enumerate(o.new_token_ids):
            s.token_ids.append(tok)
            if o.new_logprobs is not None and s.logprobs is not None:
                s.logprobs.append(self._logprob_dict(tok, o.new_logprobs[k]))
                s.cumulative_logprob += o.new_logprobs[k][0]
            if s.detok is not None:
                new = s.detok.add_token(tok)
                if new and len(s.token_ids) >= p.min_tokens:
                    hit = s.detok.check_stop(len(new))
                    if hit is not None:
                        s.finish_reason, s.stop_reason = "stop", hit
                        if o.finish_reason is None:
                            to_abort.append(o.request_id)
                        return
        if s.finish_reason is None and o.finish_reason is not None:
            s.finish_reason, s.stop_reason = o.finish_reason, o.stop_reason

    def _fail(
        self, state: _RequestState, error_id: str, reason: str | None = None, param: str | None = None
    ) -> list[str]:
        """End every sample of a failed request with "error"; returns the core ids still to abort."""
        state.error_id, state.error_reason, state.error_param = error_id, reason, param
        live = self.child_ids(state.request_id)
        for s in state.samples:
            if s.finish_reason is None:
                s.finish_reason = "error"
        return live

    def _logprob_dict(self, tok: int, lp: tuple) -> dict[int, Logprob]:
        sampled_lp, rank, ids, vals = lp
        d = {}
        for r, (i, v) in enumerate(zip(ids, vals, strict=False), start=1):
            d[i] = Logprob(v, r, self._token_text(i))
        if tok not in d:
            d[tok] = Logprob(sampled_lp, rank, self._token_text(tok))
        else:
            d[tok] = Logprob(d[tok].logprob, rank, d[tok].decoded_token)
        return d

    def _token_text(self, tok: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([tok], skip_special_tokens=False)

    def _make_output(self, state: _RequestState, finished: bool) -> RequestOutput:
        delta = state.params.output_kind == RequestOutputKind.DELTA
        outs = []
        for s in state.samples:
            done = s.finish_reason is not None
            if delta:
                text = s.detok.take_delta(done) if s.detok else ""
                ids = s.token_ids[s.sent_tokens :]
                lps = s.logprobs[s.sent_tokens :] if s.logprobs is not None else None
                s.sent_tokens = len(s.token_ids)
            else:
                text = s.detok.streamable(done) if s.detok else ""
                ids, lps = list(s.token_ids), (list(s.logprobs) if s.logprobs is not None else None)
            outs.append(CompletionOutput(s.index, text, ids, s.cumulative_logprob, lps, s.finish_reason, s.stop_reason))
        prompt_logprobs = state.prompt_logprobs
        if delta and prompt_logprobs is not None:
            prompt_logprobs, state.prompt_logprobs_sent = (
                (None if state.prompt_logprobs_sent else prompt_logprobs),
                True,
            )
        return RequestOutput(
            state.request_id,
            state.prompt,
            state.prompt_token_ids,
            outs,
            finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=state.num_cached_tokens,
            error_id=state.error_id,
            error_reason=state.error_reason,
            error_param=state.error_param,
            pooled=state.pooled,
            metrics=self._prediction_metrics(state),
        )

    @staticmethod
    def _prediction_metrics(state: _RequestState) -> dict:
        """OpenAI's accepted / rejected prediction tokens, summed over the samples (for a request with one)."""
        if not state.params.prediction:
            return {}
        return {
            "accepted_prediction_tokens": sum(s.prediction_tokens[0] for s in state.samples),
            "rejected_prediction_tokens": sum(s.prediction_tokens[1] for s in state.samples),
        }

    def _forget(self, state: _RequestState) -> None:
        self.states.pop(state.request_id, None)
        n = state.params.n
        for s in state.samples:
            self._child.pop(child_id(state.request_id, s.index, n), None)
