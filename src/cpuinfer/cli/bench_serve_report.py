"""The numbers of `cpuinfer bench serve`: what each request measured, the summary with vLLM's field names
(throughputs; mean / median / std / percentiles of TTFT, TPOT, ITL, end-to-end latency; goodput under SLOs;
speculative decoding's acceptance over the run), and the report in vLLM's layout. `cpuinfer bench latency` and
`throughput` print the same speculative-decoding section."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    """What one request measured."""

    ok: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None with fewer than two)."""
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """{'ttft': ms, ...} from METRIC:MS strings; a bad one is a ValueError naming it."""
    slos: dict[str, float] = {}
    for spec in specs or []:
        name, _, value = spec.partition(":")
        if name not in SLO_METRICS:
            raise ValueError(f"--goodput {spec!r}: the metric must be one of {', '.join(SLO_METRICS)}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {spec!r}: give METRIC:MILLISECONDS, e.g. ttft:500") from None
    return slos


def summarize(args, results: list[RequestResult], duration: float, slos: dict[str, float]) -> dict:
    """vLLM's result fields: counts, throughputs, and mean / median / std / percentiles of each metric (ms)."""
    import numpy as np

    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    values = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.latency for r in ok],
    }
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    s: dict = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "request_rate": args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
    }
    if slos:
        good = [r for r in ok if all(_metric_ms(r, m) is not None and _metric_ms(r, m) <= v for m, v in slos.items())]
        s["request_goodput"] = len(good) / duration
    for name, xs in values.items():
        arr = np.asarray(xs or [0.0]) * 1000
        s[f"mean_{name}_ms"] = float(arr.mean())
        s[f"median_{name}_ms"] = float(np.median(arr))
        s[f"std_{name}_ms"] = float(arr.std())
        for p in percentiles:
            s[f"p{p:g}_{name}_ms"] = float(np.percentile(arr, p))
    errors = [r.error for r in results if not r.ok]
    if errors:
        s["errors"] = errors[:5]
    return s


@dataclass
class SpecCounters:
    """The engine's cumulative speculative-decoding counters (vLLM's `vllm:spec_decode_*`)."""

    drafts: int = 0  # sequence-steps that verified proposals
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @classmethod
    def from_stats(cls, s) -> SpecCounters:
        """From an EngineStats."""
        return cls(
            s.spec_decode_num_drafts,
            s.spec_decode_num_draft_tokens,
            s.spec_decode_num_accepted_tokens,
            list(s.spec_decode_accepted_per_pos),
        )

    @classmethod
    def from_prometheus(cls, text: str) -> SpecCounters:
        """From a /metrics page (summed over its series: the data-parallel cores of one server)."""
        from prometheus_client.parser import text_string_to_metric_families

        c = cls()
        per_pos: dict[int, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if not sample.name.endswith("_total"):
                    continue
                name = sample.name.removesuffix("_total")
                if name == "vllm:spec_decode_num_drafts":
                    c.drafts += int(sample.value)
                elif name == "vllm:spec_decode_num_draft_tokens":
                    c.draft_tokens += int(sample.value)
                elif name == "vllm:spec_decode_num_accepted_tokens":
                    c.accepted_tokens += int(sample.value)
                elif name == "vllm:spec_decode_num_accepted_tokens_per_pos":
                    pos = int(sample.labels["position"])
                    per_pos[pos] = per_pos.get(pos, 0) + sample.value
        c.accepted_per_pos = [int(per_pos.get(i, 0)) for i in range(max(per_pos, default=-1) + 1)]
        return c


def spec_decode_summary(before: SpecCounters, after: SpecCounters) -> dict:
    """vLLM's speculative-decoding fields over a run (between two snapshots of the counters); {} if nothing was
    proposed. Acceptance rate: accepted / proposed tokens; acceptance length: tokens a verifying step produced on
    average (its accepted proposals + the one token it samples); per position: the share of steps whose i-th
    proposal was accepted."""
    drafts = after.drafts - before.drafts
    proposed = after.draft_tokens - before.draft_tokens
    if proposed <= 0 or drafts <= 0:
        return {}
    accepted = after.accepted_tokens - before.accepted_tokens
    old = before.accepted_per_pos + [0] * (len(after.accepted_per_pos) - len(before.accepted_per_pos))
    per_pos = [(a - b) / drafts for a, b in zip(after.accepted_per_pos, old, strict=True)]
    return {
        "spec_decode_acceptance_rate": 100.0 * accepted / proposed,
        "spec_decode_acceptance_length": 1.0 + accepted / drafts,
        "spec_decode_num_drafts": drafts,
        "spec_decode_draft_tokens": proposed,
        "spec_decode_accepted_tokens": accepted,
        "spec_decode_per_position_acceptance_rate": per_pos,
    }


def print_spec_decode(s: dict) -> None:
    """The speculative-decoding section of a report (nothing when nothing was proposed)."""
    if "spec_decode_acceptance_rate" not in s:
        return
    print("{s:{c}^{n}}".format(s="Speculative Decoding", n=50, c="-"))
    rows = [
        ("Acceptance rate (%):", f"{s['spec_decode_acceptance_rate']:.2f}"),
        ("Acceptance length:", f"{s['spec_decode_acceptance_length']:.2f}"),
        ("Drafts:", s["spec_decode_num_drafts"]),
        ("Draft tokens:", s["spec_decode_draft_tokens"]),
        ("Accepted tokens:", s["spec_decode_accepted_tokens"]),
    ]
    for k, v in rows:
        print(f"{k:<40} {v!s:<10}")
    per_pos = ", ".join(f"{100 * x:.1f}" for x in s["spec_decode_per_position_acceptance_rate"])
    print(f"{'Per-position acceptance (%):':<40} {per_pos}")


def _metric_ms(r: RequestResult, name: str) -> float | None:
    value = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.latency}[name]
    return None if value is None else value * 1000


def print_report(args, s: dict) -> None:
    """vLLM's layout."""
    rate = "inf" if s["request_rate"] == float("inf") else f"{s['request_rate']:g}"
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    rows = [
        ("Successful requests:", s["completed"]),
        ("Failed requests:", s["failed"]),
        ("Request rate configured (req/s):", rate),
        ("Maximum request concurrency:", s["max_concurrency"]),
        ("Benchmark duration (s):", f"{s['duration']:.2f}"),
        ("Total input tokens:", s["total_input_tokens"]),
        ("Total generated tokens:", s["total_output_tokens"]),
        ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
    ]
    if "request_goodput" in s:
        rows.append(("Request goodput (req/s):", f"{s['request_goodput']:.2f}"))
    rows += [
        ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
        ("Total Token throughput (tok/s):", f"{s['total_token_throughput']:.2f}"),
    ]
    for k, v in rows:
        print(f"{k:<40} {v!s:<10}")
    titles = {
        "ttft": "Time to First Token",
        "tpot": "Time per Output Token (excl. 1st token)",
        "itl": "Inter-token Latency",
        "e2el": "End-to-end Latency",
    }
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    for name in args.percentile_metrics.split(","):
        print("{s:{c}^{n}}".format(s=titles[name], n=50, c="-"))
        print(f"{'Mean ' + name.upper() + ' (ms):':<40} {s[f'mean_{name}_ms']:<10.2f}")
        print(f"{'Median ' + name.upper() + ' (ms):':<40} {s[f'median_{name}_ms']:<10.2f}")
        for p in percentiles:
            print(f"{f'P{p:g} ' + name.upper() + ' (ms):':<40} {s[f'p{p:g}_{name}_ms']:<10.2f}")
    print_spec_decode(s)
    print("=" * 50)
