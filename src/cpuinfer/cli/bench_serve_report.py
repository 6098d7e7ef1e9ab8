"""The numbers of `cpuinfer bench serve`: what each request measured, the summary with vLLM's field names
(throughputs; mean / median / std / percentiles of TTFT, TPOT, ITL, end-to-end latency; goodput under SLOs),
and the report in vLLM's layout."""

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
    print("=" * 50)
