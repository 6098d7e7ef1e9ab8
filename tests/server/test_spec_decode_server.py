"""`cpuinfer serve --speculative-config`: replies unchanged by speculation, OpenAI's `prediction` reported in
usage.completion_tokens_details, vLLM's spec-decode counters on /metrics."""

from __future__ import annotations

import json

import httpx
import pytest

from .conftest import metric, running_server

openai = pytest.importorskip("openai")

CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
ASK = "Repeat this code exactly, nothing else:\n\n" + CODE


@pytest.fixture(scope="module")
def servers():
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4})
    with running_server() as plain, running_server("--speculative-config", spec) as fast:
        yield plain, fast


def client(server):
    return openai.OpenAI(base_url=server.v1, api_key=server.api_key)


def chat(server, **kw):
    c = client(server)
    model = c.models.list().data[0].id
    return c.chat.completions.create(
        model=model, messages=[{"role": "user", "content": ASK}], max_tokens=48, temperature=0, **kw
    )


def test_same_reply_and_prediction_usage(servers):
    plain, fast = servers
    ref = chat(plain)
    got = chat(fast)
    assert got.choices[0].message.content == ref.choices[0].message.content
    assert got.usage.completion_tokens == ref.usage.completion_tokens
    assert (
        got.usage.completion_tokens_details is None
        or not got.usage.completion_tokens_details.accepted_prediction_tokens
    )
    # The prediction works on a server started without --speculative-config too.
    for server in (plain, fast):
        pred = chat(server, prediction={"type": "content", "content": ref.choices[0].message.content})
        assert pred.choices[0].message.content == ref.choices[0].message.content
        details = pred.usage.completion_tokens_details
        assert details.accepted_prediction_tokens > 0
        assert details.rejected_prediction_tokens >= 0
    text = httpx.get(f"{fast.url}/metrics", headers=fast.headers()).text
    assert (
        metric(text, "vllm:spec_decode_num_draft_tokens_total")
        >= metric(text, "vllm:spec_decode_num_accepted_tokens_total")
        > 0
    )
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total" in text


def test_bad_config_is_one_clear_line(capsys):
    from cpuinfer.cli.main import main

    for bad, says in (
        ('{"method": "eagle", "num_speculative_tokens": 2}', "--speculative-config method 'eagle' is not supported"),
        ('{"method": "ngram", "num_speculative_tokens": 99}', "num_speculative_tokens=99 must be an integer in 1..16"),
    ):
        with pytest.raises(SystemExit) as e:
            main(["generate", "hi", "--speculative-config", bad])
        assert e.value.code == 2
        assert says in capsys.readouterr().err


def test_bench_serve_reports_acceptance_over_its_run(servers, tmp_path):
    """`cpuinfer bench serve` reads the server's counters before and after its run: the acceptance it reports is
    the difference (what this run proposed and accepted), equal to /metrics' own difference."""
    import subprocess
    import sys

    _, fast = servers
    data = [{"id": "0", "conversations": [{"from": "human", "value": ASK}, {"from": "gpt", "value": CODE}]}]
    (tmp_path / "copy.json").write_text(json.dumps(data))

    def counters():
        text = httpx.get(f"{fast.url}/metrics", headers=fast.headers()).text
        return [metric(text, f"vllm:spec_decode_num_{n}_total") for n in ("drafts", "draft_tokens", "accepted_tokens")]

    before = counters()
    cmd = [sys.executable, "-m", "cpuinfer", "bench", "serve", "--base-url", fast.url, "--api-key", fast.api_key]
    cmd += ["--dataset-name", "sharegpt", "--dataset-path", str(tmp_path / "copy.json"), "--num-prompts", "1"]
    cmd += ["--num-warmups", "0", "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    drafts, proposed, accepted = (a - b for a, b in zip(counters(), before, strict=True))
    r = json.loads((tmp_path / "r.json").read_text())
    assert "Acceptance rate (%):" in out.stdout and accepted > 0
    assert (r["spec_decode_num_drafts"], r["spec_decode_draft_tokens"], r["spec_decode_accepted_tokens"]) == (
        drafts,
        proposed,
        accepted,
    )
    assert r["spec_decode_acceptance_rate"] == pytest.approx(100 * accepted / proposed)
