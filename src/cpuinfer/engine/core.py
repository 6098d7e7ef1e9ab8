"""The engine core: scheduler + model runner + sampler, stepping all live sequences together.

It speaks token ids only (no text), through the dataclasses of
`cpuinfer.engine.messages`, so it can run in this process (`LLMEngine`) or in
its own (`cpuinfer.engine.core_proc`).
"""

from __future__ import annotations

import time

from cpuinfer.engine.block_pool import BlockPool
from cpuinfer.engine.messages import AddRequest, EngineStats, SeqOutput
from cpuinfer.engine.request import Request
from cpuinfer.engine.scheduler import Scheduler, SchedulerConfig
from cpuinfer.sampling.sampler import Sampler
from cpuinfer.sampling_params import SamplingParams


def validate_request(prompt_token_ids: list[int], params: SamplingParams, max_model_len: int, vocab_size: int,
                     max_logprobs: int) -> int:
    """Check a request against the engine's limits before any work; returns its resolved max_tokens."""
    n = len(prompt_token_ids)
    if n == 0:
        raise ValueError("The prompt is empty: give at least one token")
    if n > max_model_len:
        raise ValueError(f"The prompt has {n} tokens, more than max_model_len={max_model_len}; shorten it or "
                         "raise --max-model-len")
    bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"Prompt token id {bad[0]!r} is out of the vocabulary [0, {vocab_size})")
    if params.max_tokens is None:
        max_tokens = max_model_len - n
        if max_tokens < 1:
            raise ValueError(f"The prompt has {n} tokens, which leaves no room to generate within "
                             f"max_model_len={max_model_len}")
    else:
        max_tokens = params.max_tokens
        if n + max_tokens > max_model_len:
            raise ValueError(f"max_tokens={max_tokens} plus the prompt's {n} tokens is {n + max_tokens}, more than "
                             f"max_model_len={max_model_len}; ask for at most {max_model_len - n} tokens")
    if params.logprobs is not None and params.logprobs > max_logprobs:
        raise ValueError(f"logprobs={params.logprobs} is more than --max-logprobs={max_logprobs}")
    return max_tokens


class EngineCore:
    """Owns the live sequences; `step()` runs one batch through the model and samples."""

    def __init__(self, runner, scheduler_config: SchedulerConfig, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool, eos_token_ids: list[int], vocab_size: int, seed: int | None = 0,
                 max_logprobs: int = 20):
        self.runner = runner
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(scheduler_config, self.pool)
        self.sampler = Sampler(seed)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs
        self.requests: dict[str, Request] = {}
        self._arrivals = 0
        self._stats = EngineStats(num_kv_blocks=num_blocks)
        self.step_seconds = 0.0

    @classmethod
    def from_config(cls, config) -> EngineCore:
        """Bind threads, load the model and allocate the KV cache as `config` (an EngineConfig) says."""
        from cpuinfer.platform.threads import bind_from_env
        from cpuinfer.worker.model_runner import ModelRunner

        bind_from_env()
        spec = config.spec
        runner = ModelRunner(spec, config.block_size, config.num_blocks, config.cache_dtype)
        sched = SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs, config.max_model_len,
                                config.args.long_prefill_token_threshold)
        return cls(runner, sched, config.num_blocks, config.block_size, config.args.enable_prefix_caching,
                   spec.eos_token_ids, spec.vocab_size, config.args.seed, config.args.max_logprobs)

    @property
    def max_model_len(self) -> int:
        """Context limit of every sequence."""
        return self.scheduler.config.max_model_len

    def add_request(self, msg: AddRequest) -> None:
        """Queue one sequence; raises ValueError (and queues nothing) if it breaks a limit."""
        if msg.request_id in self.requests:
            raise ValueError(f"request id {msg.request_id!r} is already running")
        max_tokens = validate_request(msg.prompt_token_ids, msg.params, self.max_model_len, self.vocab_size,
                                      self.max_logprobs)
        req = Request(msg.request_id, list(msg.prompt_token_ids), msg.params, self._arrivals, max_tokens,
                      self.eos_token_ids)
        self._arrivals += 1
        self.requests[msg.request_id] = req
        self.scheduler.add(req)

    def abort(self, request_ids: list[str]) -> None:
        """Drop sequences (unknown or finished ids are ignored)."""
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is not None:
                self.scheduler.abort(req)

    def has_unfinished(self) -> bool:
        """True while any sequence is queued or running."""
        return self.scheduler.has_unfinished()

    def step(self) -> list[SeqOutput]:
        """Schedule, run the model once, sample; returns the new tokens of every sequence that got one."""
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if not sched.requests:
            if self.scheduler.waiting and not self.scheduler.running:
                # Cannot happen when max_model_len fits the pool (checked at startup); never spin silently.
                req = self.scheduler.waiting[0]
                raise RuntimeError(f"request {req.request_id!r} ({req.num_tokens} tokens) cannot fit the KV cache "
                                   f"({self.pool.num_blocks} blocks of {self.pool.block_size})")
            return []
        sampled = sched.sampled
        tokens: list[int] = []
        lps: list = []
        logits = self.runner.execute(sched.seqs)
        if sampled:
            result = self.sampler(logits, sampled)
            tokens, lps = result.token_ids, result.logprobs
        finished = self.scheduler.update(sched, tokens)
        s = self._stats
        s.num_steps += 1
        for req, n, seq in zip(sched.requests, sched.num_tokens, sched.seqs, strict=False):
            if n > 1 or seq.start_pos < len(req.prompt_token_ids):
                s.prompt_tokens += n
        s.generation_tokens += len(tokens)
        outputs = []
        for req, lp in zip(sampled, lps, strict=False):
            outputs.append(SeqOutput(req.request_id, [req.output_token_ids[-1]], None if lp is None else [lp],
                                     req.finish_reason, req.stop_reason, req.num_prefix_hit_tokens))
        for req in finished:
            self.requests.pop(req.request_id, None)
        self.step_seconds += time.perf_counter() - t0
        return outputs

    def stats(self) -> EngineStats:
        """Current queue sizes, KV usage, prefix-cache hit rate and counters."""
        s = self._stats
        s.num_running = len(self.scheduler.running)
        s.num_waiting = len(self.scheduler.waiting)
        s.kv_cache_usage = self.pool.usage()
        s.prefix_cache_hit_rate = self.pool.hit_rate()
        s.prefix_cache_queries = self.pool.query_tokens
        s.prefix_cache_hits = self.pool.hit_tokens
        s.num_preemptions = self.scheduler.num_preemptions
        return EngineStats(**vars(s))
