"""The speculative-decoding section of `cpuinfer bench` (issue 32): acceptance over the timed run, from the
engine's counters offline and from a server's /metrics page."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from cpuinfer.cli.bench_serve_report import SpecCounters, spec_decode_summary
from cpuinfer.engine.messages import EngineStats


def test_the_counters_read_from_metrics_are_the_engines():
    """/metrics as the server renders it, parsed back: the same counters as the engine's stats."""
    from cpuinfer.entrypoints.openai.metrics import ServerMetrics

    stats = dataclasses.replace(
        EngineStats(),
        spec_decode_num_drafts=7,
        spec_decode_num_draft_tokens=28,
        spec_decode_num_accepted_tokens=13,
        spec_decode_accepted_per_pos=[6, 4, 2, 1],
    )
    page = ServerMetrics("m", lambda: stats).render().decode()
    assert SpecCounters.from_prometheus(page) == SpecCounters.from_stats(stats) == SpecCounters(7, 28, 13, [6, 4, 2, 1])
    s = spec_decode_summary(SpecCounters(2, 8, 3, [2, 1]), SpecCounters.from_stats(stats))
    assert s["spec_decode_acceptance_rate"] == pytest.approx(100 * 10 / 20)
    assert s["spec_decode_acceptance_length"] == pytest.approx(1 + 10 / 5)
    assert s["spec_decode_per_position_acceptance_rate"] == pytest.approx([4 / 5, 3 / 5, 2 / 5, 1 / 5])
    assert spec_decode_summary(SpecCounters(), SpecCounters()) == {}  # nothing proposed: no section


def test_bench_latency_reports_acceptance(smol_path, tmp_path):
    """SmolLM2 drafting for itself at the benchmark's temperature 1: the section is printed and saved, its numbers
    agree with each other, and with how tokens are made (the prefill samples one; each verifying step yields its
    accepted proposals plus one sampled token; a proposal is accepted only after every one before it)."""
    import os

    out_json = tmp_path / "lat.json"
    spec = json.dumps({"model": smol_path, "num_speculative_tokens": 3})
    cmd = [sys.executable, "-m", "cpuinfer", "bench", "latency", "--model", smol_path, "--input-len", "8"]
    cmd += ["--output-len", "24", "--batch-size", "1", "--num-iters-warmup", "0", "--num-iters", "1"]
    cmd += ["--max-model-len", "64", "--speculative-config", spec, "--output-json", str(out_json)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "0.05"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    r = json.loads(out_json.read_text())
    rate, drafts, proposed = (
        r["spec_decode_acceptance_rate"],
        r["spec_decode_num_drafts"],
        r["spec_decode_draft_tokens"],
    )
    accepted, per_pos = r["spec_decode_accepted_tokens"], r["spec_decode_per_position_acceptance_rate"]
    assert "Speculative Decoding" in out.stdout and f"{'Acceptance rate (%):':<40} {rate:.2f}" in out.stdout
    assert 0 < drafts <= proposed <= 3 * drafts and 0 <= accepted <= proposed
    assert rate == pytest.approx(100 * accepted / proposed)
    assert r["spec_decode_acceptance_length"] == pytest.approx(1 + accepted / drafts)
    assert accepted + drafts <= 24 - 1
    assert len(per_pos) <= 3 and per_pos == sorted(per_pos, reverse=True)
    assert sum(per_pos) * drafts == pytest.approx(accepted)
