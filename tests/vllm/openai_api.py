"""Requests to the real vLLM's OpenAI-compatible API, for every real-vLLM test: request bodies
with exact token counts, endpoints, a caller's trace context, and what the responses carry."""

from __future__ import annotations

import json
import os
from typing import Any

from tokentrace.loadgen.local_vllm import VllmServer

PROMPT = "def fibonacci(n):\n    return"
REQUEST_TIMEOUT_S = 60.0


def request_body(
    server: VllmServer, *, chat: bool, stream: bool, max_tokens: int
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": server.model_name,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,  # a random model may sample eos at any step: exact token counts
        "stream": stream,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": "Name a prime number."}]
    else:
        body["prompt"] = PROMPT
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def endpoint_path(*, chat: bool) -> str:
    return f"/v1/{'chat/completions' if chat else 'completions'}"


def endpoint(server: VllmServer, *, chat: bool) -> str:
    return f"{server.base_url}{endpoint_path(chat=chat)}"


def sse_events(lines: list[str]) -> list[dict[str, Any]]:
    """The JSON events of a server-sent-event stream; asserts it ends with `[DONE]`."""
    payloads = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert payloads and payloads[-1] == "[DONE]", payloads[-3:]
    return [json.loads(payload) for payload in payloads[:-1]]


def usage_of(response_text: str, *, stream: bool) -> dict[str, int]:
    """The token usage a response reports (a stream's last usage event)."""
    if not stream:
        usage: dict[str, int] = json.loads(response_text)["usage"]
        return usage
    events = sse_events(response_text.splitlines())
    usages = [event["usage"] for event in events if event.get("usage")]
    return usages[-1]


def new_traceparent() -> tuple[str, bytes, bytes]:
    """A caller's W3C ``traceparent`` header, its trace id and its span id."""
    trace_id, span_id = os.urandom(16), os.urandom(8)
    return f"00-{trace_id.hex()}-{span_id.hex()}-01", trace_id, span_id
