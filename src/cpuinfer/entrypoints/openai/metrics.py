"""Prometheus metrics of the server under vLLM's names (``vllm:...``) plus cpuinfer's own.

Per-request timings (TTFT, inter-token latency, end-to-end) are measured here in
the front end, where the client sees them; engine state (queue lengths, KV
blocks, prefix-cache counters, preemptions) is read from the engine's stats
snapshot at scrape time through a custom collector.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cpuinfer.engine.messages import EngineStats
from cpuinfer.entrypoints.openai.engine_adapter import CoreState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets, so dashboards built for vLLM read the same.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class _EngineCollector(Collector):
    """Exports the latest engine snapshot as gauges and (cumulative) counters."""

    def __init__(
        self, model_name: str, snapshot: Callable[[], EngineStats], cores: Callable[[], list[CoreState]] | None = None
    ):
        self.labels = {"model_name": model_name}
        self.snapshot = snapshot
        self.cores = cores or list

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=list(self.labels))
        g.add_metric(list(self.labels.values()), value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=list(self.labels))
        c.add_metric(list(self.labels.values()), value)
        return c

    def collect(self) -> Iterable[Metric]:
        s = self.snapshot()
        yield self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.", s.num_running)
        yield self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting)
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage)
        # vLLM < 0.10 spelling, still read by many dashboards.
        yield self._gauge("vllm:gpu_cache_usage_perc", "KV-cache usage (legacy name).", s.kv_cache_usage)
        yield self._gauge(
            "vllm:gpu_prefix_cache_hit_rate",
            "Prefix-cache hit rate since start (legacy name).",
            s.prefix_cache_hit_rate,
        )
        yield self._gauge(
            "cpuinfer:prefix_cache_hit_rate", "Prefix-cache token hit rate since start.", s.prefix_cache_hit_rate
        )
        yield self._gauge("cpuinfer:kv_cache_blocks_total", "KV-cache blocks in the pool.", s.num_kv_blocks)
        yield self._gauge(
            "cpuinfer:kv_cache_blocks_free", "KV-cache blocks not held by any request.", s.num_free_kv_blocks
        )
        yield self._counter("vllm:prefix_cache_queries", "Prefix-cache queries, in tokens.", s.prefix_cache_queries)
        yield self._counter("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens.", s.prefix_cache_hits)
        yield self._counter("vllm:num_preemptions", "Cumulative number of preemptions.", s.num_preemptions)
        yield from self._host_tier(s)
        yield from self._spec_decode(s)
        yield from self._per_core()

    def _host_tier(self, s) -> Iterable[Metric]:
        """The host prefix tier (--kv-offloading-size; zero without it): vLLM's external prefix-cache counters,
        and its bytes."""
        yield self._counter(
            "vllm:external_prefix_cache_queries",
            "Prompt tokens looked up in the host prefix tier (past the KV cache's hits).",
            s.external_prefix_cache_queries,
        )
        yield self._counter(
            "vllm:external_prefix_cache_hits",
            "Prompt tokens restored from the host prefix tier.",
            s.external_prefix_cache_hits,
        )
        yield self._gauge(
            "cpuinfer:kv_offload_capacity_bytes", "Size of the host prefix tier.", s.kv_offload_capacity_bytes
        )
        yield self._gauge(
            "cpuinfer:kv_offload_bytes", "Bytes of KV blocks the host prefix tier holds.", s.kv_offload_bytes
        )
        yield self._counter(
            "cpuinfer:kv_offload_stored_bytes",
            "Bytes of evicted KV blocks saved to the host prefix tier.",
            s.kv_offload_stored_bytes,
        )
        yield self._counter(
            "cpuinfer:kv_offload_restored_bytes",
            "Bytes of KV blocks copied back from the host prefix tier.",
            s.kv_offload_restored_bytes,
        )

    def _spec_decode(self, s) -> Iterable[Metric]:
        """vLLM's speculative-decoding counters (zero without speculation)."""
        yield self._counter(
            "vllm:spec_decode_num_drafts", "Sequence-steps that verified proposals.", s.spec_decode_num_drafts
        )
        yield self._counter(
            "vllm:spec_decode_num_draft_tokens", "Proposed (draft) tokens.", s.spec_decode_num_draft_tokens
        )
        yield self._counter(
            "vllm:spec_decode_num_accepted_tokens", "Accepted draft tokens.", s.spec_decode_num_accepted_tokens
        )
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by their position in the proposal.",
            labels=[*self.labels, "position"],
        )
        for pos, n in enumerate(s.spec_decode_accepted_per_pos):
            per_pos.add_metric([*self.labels.values(), str(pos)], n)
        yield per_pos

    def _per_core(self) -> Iterable[Metric]:
        """Each engine core (data-parallel rank) on its own: up, requests routed to it, its queues."""
        cores = self.cores()
        if not cores:
            return
        names = [*self.labels, "dp_rank"]
        up = GaugeMetricFamily("cpuinfer:engine_core_up", "1 while the engine core serves, 0 once dead.", labels=names)
        routed = CounterMetricFamily(
            "cpuinfer:engine_core_requests_routed", "Requests sent to this engine core since start.", labels=names
        )
        running = GaugeMetricFamily(
            "cpuinfer:engine_core_num_requests_running", "Running requests of this engine core.", labels=names
        )
        waiting = GaugeMetricFamily(
            "cpuinfer:engine_core_num_requests_waiting", "Waiting requests of this engine core.", labels=names
        )
        for c in cores:
            values = [*self.labels.values(), str(c.dp_rank)]
            up.add_metric(values, 1.0 if c.alive else 0.0)
            routed.add_metric(values, c.requests_routed)
            running.add_metric(values, c.num_running if c.alive else 0)
            waiting.add_metric(values, c.num_waiting if c.alive else 0)
        yield from (up, routed, running, waiting)


class ServerMetrics:
    """Every metric of one server, in its own registry."""

    def __init__(
        self, model_name: str, snapshot: Callable[[], EngineStats], cores: Callable[[], list[CoreState]] | None = None
    ):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r
        ).labels(model_name)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=r
        ).labels(model_name)
        self._success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            labels,
            buckets=ITL_BUCKETS,
            registry=r,
        ).labels(model_name)
        # vLLM < 0.10 name of the same measurement.
        self.tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            labels,
            buckets=ITL_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of end-to-end request latency in seconds.",
            labels,
            buckets=E2E_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens per request.",
            labels,
            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000),
            registry=r,
        ).labels(model_name)
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens per request.",
            labels,
            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000),
            registry=r,
        ).labels(model_name)
        self.pooling_inputs = Counter(
            "cpuinfer:pooling_inputs",
            "Inputs a pooling model finished: texts embedded (embed), text pairs scored (score: /score, /rerank) or "
            "texts classified (classify).",
            [*labels, "task"],
            registry=r,
        )
        self.aborted = Counter(
            "cpuinfer:requests_aborted", "Requests aborted (client gone or shutdown).", labels, registry=r
        ).labels(model_name)
        self.model_name = model_name
        self.registry.register(_EngineCollector(model_name, snapshot, cores))

    def request_finished(self, reason: str | None) -> None:
        """Count one request that ran to completion."""
        self._success.labels(self.model_name, reason or "unknown").inc()

    def render(self) -> bytes:
        """The exposition text for GET /metrics."""
        return generate_latest(self.registry)


class RequestTimer:
    """Times one request's tokens as the client receives them and feeds the histograms."""

    def __init__(self, metrics: ServerMetrics | None):
        self.metrics = metrics
        self.arrival = time.monotonic()
        self.first_token: float | None = None
        self.last_token: float | None = None

    def tokens(self, count: int) -> None:
        """Record that `count` new tokens arrived now."""
        if count <= 0:
            return
        now = time.monotonic()
        if self.first_token is None:
            self.first_token = now
            if self.metrics:
                self.metrics.ttft.observe(now - self.arrival)
            count -= 1
        elif self.metrics and self.last_token is not None:
            # Several tokens in one output share the gap evenly.
            gap = (now - self.last_token) / count
            for _ in range(count):
                self.metrics.itl.observe(gap)
                self.metrics.tpot.observe(gap)
        self.last_token = now

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first token (None before it)."""
        return None if self.first_token is None else self.first_token - self.arrival

    def elapsed(self) -> float:
        """Seconds since arrival."""
        return time.monotonic() - self.arrival
