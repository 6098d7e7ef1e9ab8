"""64 concurrent streaming clients on loopback, a quarter of which hang up mid-stream.

Afterwards every KV block is free again, the server is healthy, and every
completed greedy response equals the same prompt served alone.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai

from .conftest import metric

CLIENTS = 64
MAX_TOKENS = 8
PROMPTS = [f"Write a short note about the number {i}:" for i in range(8)]
DEADLINE = 600.0  # seconds for the whole blast; the test fails rather than hang


def test_concurrent_streams_with_disconnects(server, model_name):
    blast_and_check(server, model_name)


def blast_and_check(server, model_name) -> None:
    """The test above, for any server (data-parallel ones too): sequential reference, the 64-client blast, every
    KV block free afterwards, still healthy and still correct."""
    client = openai.OpenAI(base_url=server.v1, api_key=server.api_key, max_retries=0, timeout=120)
    reference = {}
    for p in PROMPTS:  # sequential reference, one request at a time
        out = client.completions.create(model=model_name, prompt=p, max_tokens=MAX_TOKENS, temperature=0)
        reference[p] = out.choices[0].text

    async def one(i: int, aclient: openai.AsyncOpenAI) -> tuple[str, str | None]:
        prompt = PROMPTS[i % len(PROMPTS)]
        leave_early = i % 4 == 0
        # A client that hangs up asks for many tokens, so that its request is surely still running when it leaves
        # (with MAX_TOKENS a fast server could finish it before the hang-up arrives, and nothing is aborted).
        stream = await aclient.completions.create(
            model=model_name, prompt=prompt, max_tokens=256 if leave_early else MAX_TOKENS, temperature=0, stream=True
        )
        text, chunks = "", 0
        async for chunk in stream:
            chunks += 1
            text += chunk.choices[0].text if chunk.choices else ""
            if leave_early and chunks == 2:
                await stream.close()  # hang up mid-stream
                return prompt, None
        return prompt, text

    async def blast():
        async with openai.AsyncOpenAI(
            base_url=server.v1,
            api_key=server.api_key,
            max_retries=0,
            timeout=DEADLINE,
            http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=CLIENTS + 4), timeout=DEADLINE),
        ) as ac:
            return await asyncio.wait_for(asyncio.gather(*(one(i, ac) for i in range(CLIENTS))), DEADLINE)

    results = asyncio.run(blast())
    completed = [(p, t) for p, t in results if t is not None]
    assert len(completed) == CLIENTS - CLIENTS // 4
    mismatched = [(p, t, reference[p]) for p, t in completed if t != reference[p]]
    assert not mismatched, mismatched[:3]

    # Every KV block must be free again (aborted requests included) almost at once.
    deadline = time.monotonic() + 10
    while True:
        text = httpx.get(server.url + "/metrics", headers=server.headers(), timeout=10).text
        free, total = metric(text, "cpuinfer:kv_cache_blocks_free"), metric(text, "cpuinfer:kv_cache_blocks_total")
        running, waiting = metric(text, "vllm:num_requests_running"), metric(text, "vllm:num_requests_waiting")
        if (free, running, waiting) == (total, 0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert (running, waiting) == (0, 0)
    assert free == total > 0
    assert metric(text, "vllm:kv_cache_usage_perc") == 0
    assert metric(text, "cpuinfer:requests_aborted_total") >= CLIENTS // 4
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    # And it still answers correctly.
    out = client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].text == reference[PROMPTS[0]]
