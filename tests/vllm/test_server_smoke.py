"""The shared real-vLLM server works the way the agent's tests rely on, traced as it is.

Completions and chat, streaming and not, 16 concurrent streams, and `/metrics` histograms that
count exactly the requests sent: the independent reference the tracing tests compare against.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import httpx
import pytest

from tests.vllm.openai_api import REQUEST_TIMEOUT_S, request_body, sse_events
from tests.vllm.prometheus import parse_histogram
from tests.vllm.shared_server import require_vllm, wait_until_idle
from tokentrace.loadgen.local_vllm import VllmServer

require_vllm()

pytestmark = pytest.mark.slow

_METRICS_SETTLE_TIMEOUT_S = 10.0
TTFT_HISTOGRAM = "vllm:time_to_first_token_seconds"


def streamed_completion(
    client: httpx.Client, server: VllmServer, max_tokens: int
) -> list[dict[str, Any]]:
    with client.stream(
        "POST",
        f"{server.base_url}/v1/completions",
        json=request_body(server, chat=False, stream=True, max_tokens=max_tokens),
    ) as response:
        assert response.status_code == 200, response.read()
        return sse_events(list(response.iter_lines()))


def ttft_observations(client: httpx.Client, server: VllmServer) -> float:
    text = client.get(f"{server.base_url}/metrics").text
    return parse_histogram(text, TTFT_HISTOGRAM, labels={"model_name": server.model_name}).count


def test_non_streaming_completion(vllm_server: VllmServer) -> None:
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        response = client.post(
            f"{vllm_server.base_url}/v1/completions",
            json=request_body(vllm_server, chat=False, stream=False, max_tokens=8),
        )
    assert response.status_code == 200, response.text
    doc = response.json()
    assert doc["model"] == vllm_server.model_name
    assert doc["usage"]["completion_tokens"] == 8
    assert doc["usage"]["prompt_tokens"] > 1  # bos plus the prompt's tokens
    choice = doc["choices"][0]
    assert choice["finish_reason"] == "length"
    assert isinstance(choice["text"], str)


def test_streaming_completion(vllm_server: VllmServer) -> None:
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        events = streamed_completion(client, vllm_server, max_tokens=12)
    token_events = [event for event in events if event["choices"]]
    usage_events = [event for event in events if event.get("usage")]
    assert len({event["id"] for event in events}) == 1
    # One event per decoded token at most; the first comes before the last token is generated.
    assert 1 <= len(token_events) <= 12
    assert token_events[-1]["choices"][0]["finish_reason"] == "length"
    assert usage_events[-1]["usage"]["completion_tokens"] == 12


def test_chat_completion_uses_the_models_chat_template(vllm_server: VllmServer) -> None:
    from transformers import AutoTokenizer

    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime number."},
    ]
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        response = client.post(
            f"{vllm_server.base_url}/v1/chat/completions",
            json={
                "model": vllm_server.model_name,
                "messages": messages,
                "max_tokens": 6,
                "temperature": 0.0,
                "ignore_eos": True,
            },
        )
    assert response.status_code == 200, response.text
    doc = response.json()
    assert doc["choices"][0]["message"]["role"] == "assistant"
    assert doc["usage"]["completion_tokens"] == 6
    tokenizer = AutoTokenizer.from_pretrained(vllm_server.model_dir)
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected_prompt_tokens = len(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    assert doc["usage"]["prompt_tokens"] == expected_prompt_tokens


def peak_overlap(intervals: list[tuple[float, float]]) -> int:
    """The largest number of (start, end) intervals that are open at the same moment."""
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    open_now = peak = 0
    for _, step in edges:
        open_now += step
        peak = max(peak, open_now)
    return peak


def test_sixteen_concurrent_streams(vllm_server: VllmServer) -> None:
    concurrency, max_tokens = 16, 32

    async def one_stream(client: httpx.AsyncClient) -> tuple[list[dict[str, Any]], float, float]:
        first_event_at = math.nan
        lines = []
        async with client.stream(
            "POST",
            f"{vllm_server.base_url}/v1/completions",
            json=request_body(vllm_server, chat=False, stream=True, max_tokens=max_tokens),
        ) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if math.isnan(first_event_at) and line.startswith("data: "):
                    first_event_at = time.monotonic()
                lines.append(line)
        return sse_events(lines), first_event_at, time.monotonic()

    async def all_streams() -> list[tuple[list[dict[str, Any]], float, float]]:
        limits = httpx.Limits(max_connections=concurrency)
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
            return await asyncio.gather(*(one_stream(client) for _ in range(concurrency)))

    results = asyncio.run(all_streams())
    ids = set()
    for events, _, _ in results:
        usage = [event["usage"] for event in events if event.get("usage")]
        assert usage[-1]["completion_tokens"] == max_tokens
        ids.add(events[0]["id"])
    assert len(ids) == concurrency
    # Batched, not serialised: most streams are mid-generation (first token seen, not finished)
    # at the same moment.
    in_generation = [(first, finished) for _, first, finished in results]
    assert peak_overlap(in_generation) >= concurrency // 2, in_generation


def test_metrics_ttft_histogram_counts_every_request(vllm_server: VllmServer) -> None:
    streamed, non_streamed = 3, 2
    wait_until_idle(vllm_server)  # the histogram's change is this test's requests alone
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        before = ttft_observations(client, vllm_server)
        for _ in range(streamed):
            streamed_completion(client, vllm_server, max_tokens=4)
        for _ in range(non_streamed):
            client.post(
                f"{vllm_server.base_url}/v1/completions",
                json=request_body(vllm_server, chat=False, stream=False, max_tokens=4),
            ).raise_for_status()
        # The frontend records stats right after handing out the step's outputs: allow a moment.
        expected = before + streamed + non_streamed
        deadline = time.monotonic() + _METRICS_SETTLE_TIMEOUT_S
        while (after := ttft_observations(client, vllm_server)) < expected:
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        text = client.get(f"{vllm_server.base_url}/metrics").text
    assert after == expected
    histogram = parse_histogram(text, TTFT_HISTOGRAM, labels={"model_name": vllm_server.model_name})
    counts = [count for _, count in histogram.bucket_counts()]
    assert counts == sorted(counts), "bucket counts must be cumulative"
    assert histogram.bucket_counts()[-1] == (math.inf, histogram.count)
    assert histogram.sum > 0
