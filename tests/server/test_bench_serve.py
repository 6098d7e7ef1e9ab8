"""`cpuinfer bench serve` (vLLM's serving benchmark) against a running `cpuinfer serve`: random and
ShareGPT-format datasets, concurrency, goodput, the JSON result file (issue 33)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx


def bench(server, tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    cmd = [
        sys.executable,
        "-m",
        "cpuinfer",
        "bench",
        "serve",
        "--base-url",
        server.url,
        "--api-key",
        server.api_key,
        "--save-result",
        "--result-dir",
        str(tmp_path),
        "--result-filename",
        "out.json",
        *args,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    return out, json.loads((tmp_path / "out.json").read_text())


def test_random_dataset_with_concurrency_and_goodput(server, tmp_path):
    out, result = bench(
        server,
        tmp_path,
        "--num-prompts",
        "4",
        "--random-input-len",
        "16",
        "--random-output-len",
        "5",
        "--max-concurrency",
        "2",
        "--request-rate",
        "50",
        "--goodput",
        "ttft:1000000",
        "e2el:1000000",
        "--metric-percentiles",
        "50,99",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
    )
    assert "Serving Benchmark Result" in out.stdout and "P99 TTFT (ms):" in out.stdout
    assert result["completed"] == 4 and result["failed"] == 0
    assert result["total_input_tokens"] == 4 * 16 and result["total_output_tokens"] == 4 * 5
    assert result["request_goodput"] == result["request_throughput"]  # every request meets a 1000 s SLO
    for key in ("mean_ttft_ms", "median_tpot_ms", "p50_itl_ms", "p99_e2el_ms"):
        assert result[key] > 0


def test_sharegpt_dataset_output_lengths_are_the_answers(server, tmp_path):
    answers = ["Paris is the capital of France.", "Two plus two is four.", "Blue."]
    data = [
        {"id": str(i), "conversations": [{"from": "human", "value": f"Question {i}?"}, {"from": "gpt", "value": a}]}
        for i, a in enumerate(answers)
    ]
    data.append({"id": "x", "conversations": [{"from": "human", "value": "no answer"}]})  # skipped
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    _, result = bench(server, tmp_path, "--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", "3")
    counts = [
        httpx.post(server.url + "/tokenize", json={"prompt": a}, headers=server.headers()).json()["count"]
        for a in answers
    ]
    assert result["completed"] == 3 and result["total_output_tokens"] == sum(counts)


def test_bad_flags_are_one_line(tmp_path):
    cmd = [sys.executable, "-m", "cpuinfer", "bench", "serve", "--goodput", "latency:5"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--goodput 'latency:5'" in out.stderr
    cmd = [sys.executable, "-m", "cpuinfer", "bench", "serve", "--dataset-name", "sharegpt", "--port", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "cpuinfer bench serve:" in out.stderr
    assert not list(tmp_path.iterdir())
