"""The engine core: scheduler + model runner + sampler, stepping all live sequences together.

It speaks token ids only (no text), through the dataclasses of
`cpuinfer.engine.messages`, so it can run in this process (`LLMEngine`) or in
its own (`cpuinfer.engine.core_proc`).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

import torch

from cpuinfer.engine.block_pool import BlockPool
from cpuinfer.engine.host_tier import HostTier
from cpuinfer.engine.limits import RequestLimits, validate_request
from cpuinfer.engine.messages import AddRequest, EngineStats, SeqOutput
from cpuinfer.engine.request import Request
from cpuinfer.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from cpuinfer.errors import EngineBrokenError, InvalidRequestError, new_error_id
from cpuinfer.models.classifier import activate
from cpuinfer.models.pooler import finish_pooled
from cpuinfer.sampling.prompt_logprobs import prompt_token_logprobs
from cpuinfer.sampling.sampler import Sampler, SampleResult
from cpuinfer.spec_decode.decoder import SpecDecoder
from cpuinfer.structured.manager import MaskJob, StructuredOutputManager

logger = logging.getLogger("cpuinfer.engine")

# A request that fails on its own (in the model runner or the sampler) fails alone; the engine goes on.
# This many failed requests in a row, with no successful step between them, means the engine itself
# is broken (a bad model, a broken kernel): then the failure is fatal.
MAX_CONSECUTIVE_FAILURES = 8
# With nothing else to run, a step waits this long (at most) for a constraint being compiled, then returns so
# that the caller can read its messages.
COMPILE_POLL_SECONDS = 0.02


@dataclass
class _Compiling:
    """The sequences of a request whose constraint compiles on the grammar thread; outside the scheduler until
    it is done, so the other requests' steps go on meanwhile."""

    future: Future  # its result: the compiled grammar
    requests: list[Request]


class GrammarRejectedError(RuntimeError):
    """A constrained sequence's grammar refused the token its own mask allowed: the backend's mask and matcher
    disagree, which happens when what the grammar requires next has no token in this model's vocabulary (a
    character whose UTF-8 bytes the tokenizer cannot spell; the fuzz test found U+40000 in a regex). The
    request's constraint cannot be followed here: a client error (400), not the engine's."""

    param = "structured_outputs"

    def __init__(self, token_id: int, num_generated: int):
        super().__init__(
            f"The structured output constraint cannot be followed by this model after {num_generated} "
            f"generated tokens: its grammar allowed token {token_id} next and then refused it, which "
            "happens when the text the grammar requires has no token in this model's vocabulary (for "
            "example a character whose UTF-8 bytes the tokenizer cannot spell). Change the constraint."
        )


class EngineCore:
    """Owns the live sequences; `step()` runs one batch through the model and samples."""

    def __init__(
        self,
        runner,
        scheduler_config: SchedulerConfig,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        eos_token_ids: list[int],
        limits: RequestLimits,
        seed: int | None = 0,
        grammars: StructuredOutputManager | None = None,
        spec: SpecDecoder | None = None,
        host_tier: HostTier | None = None,
    ):
        self.runner = runner
        self.grammars = grammars
        self.spec = spec  # speculative decoding (None: off)
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching, host_tier)
        self.scheduler = Scheduler(scheduler_config, self.pool)
        self.sampler = Sampler(seed)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.limits = limits
        self.requests: dict[str, Request] = {}
        self._compiling: list[_Compiling] = []
        self._consecutive_failures = 0
        self._arrivals = 0
        self._stats = EngineStats(num_kv_blocks=num_blocks)
        self.step_seconds = 0.0
        self.layout: list = []  # worker.tp_executor.RankPlacement of each rank (from_config fills it)

    @classmethod
    def from_config(cls, config, warm_grammars: bool = False) -> EngineCore:
        """Bind threads, load the model and allocate the KV cache as `config` (an EngineConfig) says.
        `warm_grammars`: build the structured-output backend while the model loads (a server's core: see
        cpuinfer.structured.manager)."""
        from cpuinfer.spec_decode.draft import draft_runner
        from cpuinfer.worker.tp_executor import build_runner

        spec = config.spec
        grammars = StructuredOutputManager(
            config.args.structured_outputs_backend, spec.tokenizer, spec.vocab_size, spec.eos_token_ids
        )
        if warm_grammars and config.pooler is None:
            grammars.warm_up()
        runner, layout = build_runner(config)  # binds every rank's threads, loads the weights
        sched = SchedulerConfig(
            config.max_num_batched_tokens,
            config.max_num_seqs,
            config.max_model_len,
            config.args.long_prefill_token_threshold,
            whole_prompts=spec.is_encoder,
        )
        speculative = None
        if config.speculative is not None:
            speculative = SpecDecoder.build(
                config.speculative, config.max_model_len, lambda: draft_runner(config, config.speculative)
            )
        core = cls(
            runner,
            sched,
            config.num_blocks,
            config.block_size,
            # A pooling request reads the hidden states of its prompt rows, which a cached prefix skips.
            config.args.enable_prefix_caching and config.pooler is None,
            spec.eos_token_ids,
            RequestLimits.from_config(config),
            config.args.seed,
            grammars,
            speculative,
            # One rank only (EngineArgs checks): its runner, and so its KV cache, is in this process.
            HostTier(runner.kv_caches, config.kv_offloading_blocks, config.kv_offloading_dtype)
            if config.kv_offloading_blocks
            else None,
        )
        core.layout = layout
        return core

    @property
    def max_model_len(self) -> int:
        """Context limit of every sequence."""
        return self.limits.max_model_len

    def add_request(self, msg: AddRequest) -> None:
        """Queue a request's sequences; raises InvalidRequestError (and queues nothing) if it breaks a limit.

        A structured-output constraint not yet compiled here is compiled on the grammar thread while the other
        requests step: its sequences join the scheduler when it is done, or fail naming the constraint (as a
        400) if it does not compile. `LLMEngine` and the server's front end compile before they send, so there
        a bad constraint is refused before this."""
        ids = msg.sequence_ids
        taken = next((i for i in ids if i in self.requests), None)
        if taken is not None:
            raise InvalidRequestError(f"request id {taken!r} is already running")
        max_tokens = validate_request(
            msg.prompt_token_ids, msg.params, self.limits, self.grammars, compile_constraint=False
        )
        prompt = list(msg.prompt_token_ids)
        constraint = msg.params.structured_outputs
        compiled = None if constraint is None else self.grammars.cached(constraint)
        reqs = []
        for index, rid in enumerate(ids):
            params = msg.params if len(ids) == 1 else msg.params.for_sample(index)
            req = Request(rid, prompt, params, self._arrivals, max_tokens, self.eos_token_ids)
            req.pool_all_rows = params.pooling is not None and self.limits.pooler.all_rows
            if msg.prediction_token_ids and params.pooling is None:  # a pooled prompt is never decoded
                # Only a hint: what cannot fit the context is of no use to it.
                req.prediction_token_ids = list(msg.prediction_token_ids[: self.max_model_len])
                if self.spec is None:  # predicted outputs work without --speculative-config: for them only
                    self.spec = SpecDecoder.for_predictions(self.max_model_len)
            self._arrivals += 1
            self.requests[rid] = req
            reqs.append(req)
        if constraint is None or compiled is not None:
            self._admit(reqs, compiled)
        else:
            self._compiling.append(_Compiling(self.grammars.compile_async(constraint), reqs))

    def _admit(self, reqs: list[Request], compiled) -> None:
        """Into the scheduler, each sample with a state of its own in the compiled grammar (None: unconstrained)."""
        for req in reqs:
            if compiled is not None:
                req.grammar = self.grammars.backend.new_state(compiled)
            self.scheduler.add(req)

    def _admit_compiled(self) -> list[SeqOutput]:
        """Admit the requests whose constraint has compiled, in the order they came (among themselves: one whose
        constraint was cached is admitted at once, ahead of them); fail those whose constraint did not compile.
        Sequences aborted meanwhile are gone from self.requests."""
        # One done() per job: a compile that finished between two passes over the list would be in neither.
        done, pending = [], []
        for job in self._compiling:
            (done if job.future.done() else pending).append(job)
        self._compiling = pending
        failures = []
        for job in done:
            live = self._live(job)
            exc = job.future.exception()
            if exc is None:
                self._admit(live, job.future.result())
            else:  # a constraint that does not compile is the request's fault (a 400), any other error is ours
                failures += [self._fail(req, exc, isinstance(exc, InvalidRequestError)) for req in live]
        return failures

    def abort(self, request_ids: list[str]) -> None:
        """Drop sequences (unknown or finished ids are ignored). A compile no live sequence waits for any more is
        cancelled if it has not started, and no longer keeps the core busy if it has."""
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is not None:
                self.scheduler.abort(req)
                if self.spec is not None:
                    self.spec.drop(rid)
        wanted = []
        for job in self._compiling:
            if self._live(job):
                wanted.append(job)
            else:
                job.future.cancel()
        self._compiling = wanted

    def _live(self, job: _Compiling) -> list[Request]:
        """The sequences of a compiling request that are not aborted."""
        return [r for r in job.requests if self.requests.get(r.request_id) is r]

    def has_unfinished(self) -> bool:
        """True while any sequence is queued, running or waiting for its constraint to compile."""
        return self.scheduler.has_unfinished() or bool(self._compiling)

    def step(self) -> list[SeqOutput]:
        """Schedule, run the model once, sample; returns the new tokens of every sequence that got one (and the
        failure of each whose constraint did not compile). With only constraints compiling, waits for one up to
        COMPILE_POLL_SECONDS instead of running."""
        failures = self._admit_compiled() if self._compiling else []
        outputs = self._step()
        if self._compiling and not outputs and not failures and not self.scheduler.has_unfinished():
            wait([job.future for job in self._compiling], COMPILE_POLL_SECONDS, FIRST_COMPLETED)
        return failures + outputs

    def _step(self) -> list[SeqOutput]:
        t0 = time.perf_counter()
        if self.spec is not None:
            sch = self.scheduler
            free = sch.config.max_num_seqs - len(sch.running)
            self.spec.propose(sch.running, sch.waiting, free)
        sched = self.scheduler.schedule()
        if not sched:
            if self.scheduler.waiting and not self.scheduler.running:
                # Cannot happen when max_model_len fits the pool (checked at startup); never spin silently.
                req = self.scheduler.waiting[0]
                raise RuntimeError(
                    f"request {req.request_id!r} ({req.num_tokens} tokens) cannot fit the KV cache "
                    f"({self.pool.num_blocks} blocks of {self.pool.block_size})"
                )
            return []
        masks = None
        if self.grammars is not None and any(r.grammar is not None for r in sched.sampled):
            # During the forward pass, for the one-row requests (speculating ones are masked row by row later).
            masks = self.grammars.start_masks([r.grammar for r in sched.sampled if not r.spec_token_ids])
        try:
            logits = self.runner.execute(sched.seqs)
        except EngineBrokenError:
            raise  # a rank of a tensor-parallel group died: no request can run
        except Exception as exc:  # noqa: BLE001 - isolated below: one request's failure is not the engine's
            if masks is not None:
                masks.done.exception()  # wait: the states must not be read while the next step runs
            return self._isolate_runner_failure(sched, exc)
        if self.limits.pooler is not None:
            return self._pool_step(sched, logits, t0)
        if any(seq.prompt_logits for seq in sched.seqs):
            logits = self._take_prompt_logprobs(sched, logits)
        if any(r.spec_token_ids for r in sched.sampled):
            tokens, lps, failed = self._sample_spec(logits, sched.sampled, masks)
        else:
            tokens, lps, failed = self._sample(logits, sched.sampled, masks)
            tokens, lps = [[t] for t in tokens], [None if lp is None else [lp] for lp in lps]
        if failed:
            sched = sched.without({id(req) for req, _ in failed})
        failures = [self._fail(req, exc) for req, exc in failed]
        sampled = sched.sampled
        if sampled:
            self._consecutive_failures = 0
        finished = self.scheduler.update(sched, tokens)  # cuts a token list where its request stopped
        s = self._stats
        s.num_steps += 1
        for req, seq in sched.scheduled:
            if seq.start_pos < len(req.prompt_token_ids) or (seq.num_tokens > 1 and not seq.num_spec):
                s.prompt_tokens += seq.num_tokens
        s.generation_tokens += sum(len(t) for t in tokens)
        outputs = []
        for req, new, lp in zip(sampled, tokens, lps, strict=False):
            outputs.append(
                SeqOutput(
                    req.request_id,
                    new,
                    None if lp is None else lp[: len(new)],
                    req.finish_reason,
                    req.stop_reason,
                    req.num_prefix_hit_tokens,
                    accepted_prediction_tokens=req.num_accepted_prediction_tokens,
                    rejected_prediction_tokens=req.num_rejected_prediction_tokens,
                )
            )
            if req.prompt_logprobs is not None and len(req.output_token_ids) == len(new):  # its first tokens
                outputs[-1].prompt_logprobs = req.prompt_logprobs
        for req in finished:
            self.requests.pop(req.request_id, None)
            if self.spec is not None:
                self.spec.drop(req.request_id)
        self.step_seconds += time.perf_counter() - t0
        return outputs + failures

    def _pool_step(self, sched: SchedulerOutput, rows: torch.Tensor, t0: float) -> list[SeqOutput]:
        """A pooling model's step: fold each chunk's hidden rows into its request; a request whose prompt is
        done gets its pooled vector and finishes (pooling requests never decode)."""
        pooler = self.limits.pooler
        done, vecs, row = [], [], 0
        for req, seq in sched.scheduled:
            n = seq.logit_rows
            chunk, row = rows[row : row + n], row + n
            if req.pool_all_rows:
                first = req.pool_upto - seq.start_pos  # rows of this chunk already folded in (a recomputation)
                if 0 <= first < n:
                    new = chunk[first:].float()
                    if req.pool_upto == 0:
                        req.pool_first = new[0].clone()
                    part = new.sum(0)
                    req.pool_sum = part if req.pool_sum is None else req.pool_sum + part
                    req.pool_upto = seq.start_pos + n
            if not seq.sample:
                continue
            if pooler.pooling_type == "MEAN":
                vec = req.pool_sum / len(req.prompt_token_ids)
            elif pooler.pooling_type == "CLS":
                vec = req.pool_first
            else:
                vec = chunk[-1]
            done.append(req)
            vecs.append(vec)
        if pooler.task == "classify" and vecs:
            vecs = list(self.runner.classify(torch.stack(vecs).float()))  # one call for the step's finished inputs
        outputs = []
        for req, vec in zip(done, vecs, strict=True):
            p = req.params.pooling
            if pooler.task == "classify":
                vec = vec if p.activation is False else activate(vec, pooler.activation)
            else:
                vec = finish_pooled(vec, pooler.normalize if p.normalize is None else p.normalize, p.dimensions)
            outputs.append(SeqOutput(req.request_id, [], None, "stop", None, req.num_prefix_hit_tokens, pooled=vec))
        self._consecutive_failures = 0
        for req in self.scheduler.update(sched, []):
            self.requests.pop(req.request_id, None)
        s = self._stats
        s.num_steps += 1
        s.prompt_tokens += sum(seq.num_tokens for seq in sched.seqs)
        self.step_seconds += time.perf_counter() - t0
        return outputs

    @staticmethod
    def _take_prompt_logprobs(sched: SchedulerOutput, logits: torch.Tensor) -> torch.Tensor:
        """Record the prompt logprobs of the chunks that asked for every row's logits; returns the rows sampling
        reads (each sampled sequence's last 1 + num_spec).

        Row i of a chunk starting at position p predicts prompt token p + i + 1. A chunk computed again (after a
        preemption) adds nothing: each request's list grows only at its end."""
        sample_rows, row = [], 0
        for req, seq in sched.scheduled:
            n = seq.logit_rows
            if seq.prompt_logits:
                prompt = req.prompt_token_ids
                first = len(req.prompt_logprobs) - 1 - seq.start_pos  # the chunk's first row not yet recorded
                last = min(n, len(prompt) - 1 - seq.start_pos)  # rows that predict a prompt token
                if 0 <= first < last:
                    next_ids = prompt[seq.start_pos + first + 1 : seq.start_pos + last + 1]
                    k = req.params.prompt_logprobs
                    req.prompt_logprobs += prompt_token_logprobs(logits[row + first : row + last], next_ids, k)
            if seq.sample:
                sample_rows += range(row + n - 1 - seq.num_spec, row + n)
            row += n
        return logits[sample_rows]

    # ---- one request's failure ------------------------------------------------------------------
    def _sample(
        self, logits: torch.Tensor, reqs: list[Request], masks: MaskJob | None = None
    ) -> tuple[list[int], list, list]:
        """Sample the batch; if that fails, row by row. Returns (tokens, logprobs, [(request, error)])
        with tokens and logprobs of the requests that did not fail, in order."""
        if not reqs:
            return [], [], []
        try:
            return self._advance_grammars(reqs, self._masked_sample(logits, reqs, masks))
        except Exception as exc:  # noqa: BLE001 - narrowed to the failing rows below
            if len(reqs) == 1:
                return [], [], [(reqs[0], exc)]
        tokens, lps, failed = [], [], []
        for i, req in enumerate(reqs):
            try:
                result = self._masked_sample(logits[i : i + 1], [req])
            except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
                failed.append((req, exc))
                continue
            t, lp, f = self._advance_grammars([req], result)
            tokens, lps, failed = tokens + t, lps + lp, failed + f
        return tokens, lps, failed

    def _sample_spec(self, logits: torch.Tensor, reqs: list[Request], masks: MaskJob | None) -> tuple[list, list, list]:
        """A step where some requests verify proposals (their 1 + k rows; one row for the others). Returns
        (new tokens, their logprobs, [(request, error)]) per request that did not fail, in order."""
        starts, at = [], 0
        for r in reqs:
            starts.append(at)
            at += 1 + len(r.spec_token_ids)
        plain = [i for i, r in enumerate(reqs) if not r.spec_token_ids]
        spec = [i for i, r in enumerate(reqs) if r.spec_token_ids]
        results: dict[int, tuple[list[int], list | None]] = {}
        failed = []
        if plain:
            tokens, lps, failed = self._sample(logits[[starts[i] for i in plain]], [reqs[i] for i in plain], masks)
            ok = [i for i in plain if all(reqs[i] is not f for f, _ in failed)]
            for i, t, lp in zip(ok, tokens, lps, strict=True):
                results[i] = ([t], None if lp is None else [lp])
        try:
            verified = self._verify(logits, reqs, starts, spec)
        except Exception:  # noqa: BLE001 - narrowed to the failing requests below
            verified = {}
            for i in spec:
                try:
                    verified.update(self._verify(logits, reqs, starts, [i]))
                except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
                    failed.append((reqs[i], exc))
        for i, v in verified.items():
            if v.refused is not None:
                failed.append((reqs[i], GrammarRejectedError(v.refused, len(reqs[i].output_token_ids))))
                continue
            results[i] = (v.token_ids, v.logprobs)
        order = sorted(results)
        return [results[i][0] for i in order], [results[i][1] for i in order], failed

    def _verify(self, logits: torch.Tensor, reqs: list[Request], starts: list[int], idx: list[int]) -> dict:
        """spec_decode's verification of the requests reqs[i] for i in idx (rows from starts[i])."""
        rows = [starts[i] + j for i in idx for j in range(1 + len(reqs[i].spec_token_ids))]
        out = self.spec.verify(logits[rows], [reqs[i] for i in idx], self.sampler, self.grammars)
        return dict(zip(idx, out, strict=True))

    def _masked_sample(self, logits: torch.Tensor, reqs: list[Request], masks: MaskJob | None = None) -> SampleResult:
        """The sampler's pick, after masking (in place) the tokens each constrained row's grammar forbids."""
        if self.grammars is None or all(r.grammar is None for r in reqs):
            return self.sampler(logits, reqs)
        self.grammars.mask(logits, [r.grammar for r in reqs], masks)
        result = self.sampler(logits, reqs)
        # Extreme sampling parameters (a temperature near 0 overflowing the allowed logits, penalties)
        # can leave a constrained row's distribution degenerate (NaN), and the draw then lands on a
        # masked token; such a row takes its most likely allowed token instead (the fuzz test found it).
        for i, (req, tok) in enumerate(zip(reqs, result.token_ids, strict=True)):
            if req.grammar is not None and logits[i, tok] == float("-inf"):
                result.token_ids[i] = int(logits[i].argmax())
        return result

    @staticmethod
    def _advance_grammars(reqs: list[Request], result: SampleResult) -> tuple[list[int], list, list]:
        """Feed each sampled token to its sequence's grammar; a sequence whose grammar refuses it fails alone."""
        tokens, lps, failed = [], [], []
        for req, tok, lp in zip(reqs, result.token_ids, result.logprobs, strict=True):
            if req.grammar is not None and not req.grammar.accept(tok):
                failed.append((req, GrammarRejectedError(tok, len(req.output_token_ids))))
                continue
            tokens.append(tok)
            lps.append(lp)
        return tokens, lps, failed

    def _isolate_runner_failure(self, sched: SchedulerOutput, exc: Exception) -> list[SeqOutput]:
        """The model step failed: rerun each request alone; those that fail alone fail, the others are
        scheduled again next step (their state was not advanced). If each one runs fine alone, the
        batch as a whole is what fails: that is the engine's failure, not a request's."""
        if len(sched.scheduled) == 1:
            return [self._fail(sched.scheduled[0].request, exc)]
        failed = []
        for req, seq in sched.scheduled:
            try:
                self.runner.execute([seq])
            except Exception as solo_exc:  # noqa: BLE001 - this request fails, the others go on
                failed.append(self._fail(req, solo_exc))
        if not failed:
            raise EngineBrokenError(
                f"a batch of {len(sched.scheduled)} requests failed although each runs "
                f"alone: {type(exc).__name__}: {exc}"
            ) from exc
        return failed

    def _fail(self, req: Request, exc: BaseException, client_fault: bool = False) -> SeqOutput:
        """End one request with an error: log the details, free its blocks, tell the front end. `client_fault`:
        the request's own (a constraint that does not compile), like a GrammarRejectedError."""
        if isinstance(exc, MemoryError):
            raise exc
        error_id = new_error_id()
        reason = param = None
        if client_fault or isinstance(exc, GrammarRejectedError):  # the request's own fault: no traceback
            reason, param = str(exc), exc.param
            logger.warning("request %s failed (error id %s): %s", req.request_id, error_id, exc)
        else:
            self._consecutive_failures += 1
            logger.error(
                "request %s failed (error id %s): %s: %s",
                req.request_id,
                error_id,
                type(exc).__name__,
                exc,
                exc_info=exc,
            )
        self.requests.pop(req.request_id, None)
        self.scheduler.abort(req)
        if self.spec is not None:
            self.spec.drop(req.request_id)
        req.finish_reason = "error"
        if self._consecutive_failures >= MAX_CONSECUTIVE_FAILURES:
            raise EngineBrokenError(
                f"{self._consecutive_failures} requests failed in a row with no successful "
                f"step between them; the last: {type(exc).__name__}: {exc}"
            ) from exc
        return SeqOutput(
            req.request_id,
            [],
            None,
            "error",
            None,
            req.num_prefix_hit_tokens,
            error_id=error_id,
            error_reason=reason,
            error_param=param,
        )

    @property
    def vocab_size(self) -> int:
        """Size of the model's vocabulary."""
        return self.limits.vocab_size

    def stats(self) -> EngineStats:
        """Current queue sizes, KV usage, prefix-cache hit rate and counters."""
        s = self._stats
        s.num_running = len(self.scheduler.running)
        compiling = sum(len(self._live(job)) for job in self._compiling)
        s.num_waiting = len(self.scheduler.waiting) + compiling  # not an aborted one whose compile goes on
        s.kv_cache_usage = self.pool.usage()
        s.num_free_kv_blocks = self.pool.num_free
        s.prefix_cache_hit_rate = self.pool.hit_rate()
        s.prefix_cache_queries = self.pool.query_tokens
        s.prefix_cache_hits = self.pool.hit_tokens
        s.num_preemptions = self.scheduler.num_preemptions
        tier = self.pool.host_tier
        if tier is not None:
            s.kv_offload_capacity_bytes = tier.capacity_blocks * tier.block_bytes
            s.kv_offload_bytes = tier.num_blocks * tier.block_bytes
            s.kv_offload_stored_bytes = tier.stored_blocks * tier.block_bytes
            s.kv_offload_restored_bytes = tier.restored_blocks * tier.block_bytes
            s.external_prefix_cache_queries = tier.query_tokens
            s.external_prefix_cache_hits = tier.hit_tokens
        if self.spec is not None:
            st = self.spec.stats
            s.spec_decode_num_drafts = st.num_drafts
            s.spec_decode_num_draft_tokens = st.num_draft_tokens
            s.spec_decode_num_accepted_tokens = st.num_accepted_tokens
            s.spec_decode_accepted_per_pos = list(st.accepted_per_pos)
        return EngineStats(**vars(s))
