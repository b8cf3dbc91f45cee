"""``tokentrace proxy`` in-process, in front of the stand-in engine (recorded payloads of the
documented llama-server, TGI, Ollama and OpenAI shapes, with real delays: ``stand_in.py``), its
spans received by a real OTLP receiver."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from tests.collector.upstream import UpstreamOtlp
from tests.proxy.harness import (
    agent_runtime,
    attributes,
    proxy_url,
    received_spans,
    request_tree,
    running_proxy,
)
from tests.proxy.stand_in import StandInEngine
from tokentrace.agent import semconv
from tokentrace.agent.proxy_engines import NOT_REPORTED, NOT_REPORTED_UNSTREAMED
from tokentrace.agent.runtime import AgentRuntime

_MS = 1_000_000
_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}


@pytest.fixture(scope="module")
def upstream() -> Iterator[UpstreamOtlp]:
    with UpstreamOtlp() as receiver:
        yield receiver


@pytest.fixture
def runtime(upstream: UpstreamOtlp) -> Iterator[AgentRuntime]:
    agent = agent_runtime(upstream)
    yield agent
    agent.shutdown()


def _traceparent() -> tuple[bytes, bytes, str]:
    trace_id, parent = os.urandom(16), os.urandom(8)
    return trace_id, parent, f"00-{trace_id.hex()}-{parent.hex()}-01"


def _duration(span: Span) -> int:
    return span.end_time_unix_nano - span.start_time_unix_nano


def _post(url: str, body: dict[str, object], traceparent: str) -> tuple[httpx.Response, bytes]:
    with (
        httpx.Client(timeout=10) as client,
        client.stream("POST", url, json=body, headers={"traceparent": traceparent}) as response,
    ):
        return response, b"".join(response.iter_raw())


def test_a_llama_server_stream_gets_the_span_tree_with_prefill_from_its_timings(
    upstream: UpstreamOtlp, runtime: AgentRuntime
) -> None:
    with (
        StandInEngine("llama-server", queue_s=0.03, prefill_s=0.04, gap_s=0.01) as engine,
        running_proxy(engine.url, runtime=runtime) as proxy,
    ):
        trace_id, parent, traceparent = _traceparent()
        body = {**_CHAT, "max_tokens": 6, "temperature": 0.5}
        response, proxied = _post(proxy_url(proxy) + "/v1/chat/completions", body, traceparent)
        _, direct = _post(engine.url + "/v1/chat/completions", body, traceparent)
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream"
    assert proxied == direct  # the engine's bytes, unchanged
    spans = request_tree(upstream, runtime, trace_id)
    http, request = spans["http"], spans[semconv.SPAN_REQUEST]
    # traceparent both ways: the HTTP span is the caller's child, the engine got the HTTP span.
    assert http.parent_span_id == parent
    assert request.parent_span_id == http.span_id
    assert (
        engine.requests[0].headers["traceparent"] == f"00-{trace_id.hex()}-{http.span_id.hex()}-01"
    )
    assert http.name == "POST /v1/chat/completions"
    prefill, queue = spans[semconv.SPAN_PREFILL], spans[semconv.SPAN_QUEUE]
    decode = spans[semconv.SPAN_DECODE]
    assert _duration(prefill) == 40 * _MS  # prompt_ms, ending at the first content chunk
    assert 30 * _MS <= _duration(queue) <= 45 * _MS  # the engine's wait before it, and the hop
    assert queue.start_time_unix_nano == request.start_time_unix_nano
    offsets = attributes(decode)[semconv.DECODE_TOKEN_OFFSETS]
    assert len(offsets) == 6 and offsets[0] == 0
    assert 45_000 <= offsets[-1] <= 80_000  # five gaps of 10 ms
    assert http.start_time_unix_nano <= request.start_time_unix_nano
    assert request.end_time_unix_nano <= http.end_time_unix_nano
    values = attributes(request)
    assert values[semconv.GEN_AI_USAGE_INPUT_TOKENS] == 12  # prompt_n + cache_n
    assert values[semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] == 4
    assert values[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == 6
    assert values[semconv.GEN_AI_REQUEST_MODEL] == "tiny"
    assert values[semconv.GEN_AI_OPERATION_NAME] == semconv.OPERATION_CHAT
    assert values[semconv.GEN_AI_REQUEST_MAX_TOKENS] == 6
    assert values[semconv.GEN_AI_REQUEST_TEMPERATURE] == 0.5
    assert values[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == ["length"]
    assert values[semconv.REQUEST_ID] == "chatcmpl-standin"
    http_values = attributes(http)
    assert http_values[semconv.PROXY_ENGINE] == "llama-server"
    assert http_values[semconv.PROXY_NOT_REPORTED] == list(NOT_REPORTED["llama-server"])
    assert http_values[semconv.HTTP_RESPONSE_STATUS_CODE] == 200
    assert semconv.HTTP_FIRST_BODY_TIME in http_values


def test_an_ollama_stream_puts_its_load_duration_in_the_cold_start(
    upstream: UpstreamOtlp, runtime: AgentRuntime
) -> None:
    with (
        StandInEngine("ollama", queue_s=0.005, load_s=0.05, prefill_s=0.02, gap_s=0.005) as engine,
        running_proxy(engine.url, runtime=runtime, engine="ollama") as proxy,
    ):
        trace_id, _, traceparent = _traceparent()
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                "options": {"num_predict": 5}}  # fmt: skip
        response, proxied = _post(proxy_url(proxy) + "/api/chat", body, traceparent)
    assert response.headers["content-type"] == "application/x-ndjson"
    assert json.loads(proxied.splitlines()[-1])["done"] is True
    spans = request_tree(upstream, runtime, trace_id)
    request, queue = spans[semconv.SPAN_REQUEST], spans[semconv.SPAN_QUEUE]
    values = attributes(request)
    ready = values[semconv.COLD_START_READY_TIME]
    # Engine arrival is the handler's start (total_duration before the final object); the
    # model was ready load_duration later.
    assert ready - queue.start_time_unix_nano == 50 * _MS
    assert _duration(spans[semconv.SPAN_PREFILL]) == 20 * _MS
    assert values[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == 5
    assert values[semconv.GEN_AI_USAGE_INPUT_TOKENS] == 12
    assert values[semconv.GEN_AI_REQUEST_MAX_TOKENS] == 5
    assert values[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == ["length"]
    assert len(attributes(spans[semconv.SPAN_DECODE])[semconv.DECODE_TOKEN_OFFSETS]) == 5
    assert attributes(spans["http"])[semconv.PROXY_ENGINE] == "ollama"


def test_tgi_headers_give_the_queue_wait_of_an_unstreamed_generation(
    upstream: UpstreamOtlp, runtime: AgentRuntime
) -> None:
    with (
        StandInEngine("tgi", queue_s=0.03, prefill_s=0.02, gap_s=0.004) as engine,
        running_proxy(engine.url, runtime=runtime) as proxy,
    ):
        trace_id, _, traceparent = _traceparent()
        body = {"inputs": "hi", "parameters": {"max_new_tokens": 5}}
        response, proxied = _post(proxy_url(proxy) + "/generate", body, traceparent)
    assert response.headers["x-queue-time"] == "30"
    assert json.loads(proxied)["generated_text"]
    spans = request_tree(upstream, runtime, trace_id)
    queue, prefill = spans[semconv.SPAN_QUEUE], spans[semconv.SPAN_PREFILL]
    assert _duration(queue) == 30 * _MS  # x-queue-time
    assert 30 * _MS <= _duration(prefill) <= 45 * _MS  # x-inference-time (36 ms) to the body
    values = attributes(spans[semconv.SPAN_REQUEST])
    assert values[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == 5
    assert values[semconv.GEN_AI_USAGE_INPUT_TOKENS] == 12
    assert values[semconv.GEN_AI_OPERATION_NAME] == semconv.OPERATION_TEXT_COMPLETION
    http_values = attributes(spans["http"])
    assert http_values[semconv.PROXY_ENGINE] == "tgi"
    assert NOT_REPORTED_UNSTREAMED in http_values[semconv.PROXY_NOT_REPORTED]


def test_a_tgi_stream_has_no_timing_headers_and_says_so(
    upstream: UpstreamOtlp, runtime: AgentRuntime
) -> None:
    with (
        StandInEngine("tgi", queue_s=0.01, prefill_s=0.02, gap_s=0.004) as engine,
        running_proxy(engine.url, runtime=runtime) as proxy,
    ):
        trace_id, _, traceparent = _traceparent()
        body = {"inputs": "hi", "parameters": {"max_new_tokens": 4}}
        _post(proxy_url(proxy) + "/generate_stream", body, traceparent)
    spans = request_tree(upstream, runtime, trace_id)
    values = attributes(spans[semconv.SPAN_REQUEST])
    assert values[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == 4  # from the last event's details
    assert len(attributes(spans[semconv.SPAN_DECODE])[semconv.DECODE_TOKEN_OFFSETS]) == 4
    assert attributes(spans["http"])[semconv.PROXY_ENGINE] == "openai"


def test_a_generic_openai_stream_has_no_queue_split(
    upstream: UpstreamOtlp, runtime: AgentRuntime
) -> None:
    with (
        StandInEngine("openai", queue_s=0.02, prefill_s=0.02, gap_s=0.005) as engine,
        running_proxy(engine.url, runtime=runtime) as proxy,
    ):
        trace_id, _, traceparent = _traceparent()
        body = {"model": "m", "prompt": "hi", "max_tokens": 4, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        _post(proxy_url(proxy) + "/v1/completions", body, traceparent)
    spans = request_tree(upstream, runtime, trace_id)
    request, prefill = spans[semconv.SPAN_REQUEST], spans[semconv.SPAN_PREFILL]
    assert prefill.start_time_unix_nano == request.start_time_unix_nano
    assert _duration(spans[semconv.SPAN_QUEUE]) == 0
    assert attributes(request)[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == 4
    http_values = attributes(spans["http"])
    assert http_values[semconv.PROXY_ENGINE] == "openai"
    assert http_values[semconv.PROXY_NOT_REPORTED] == list(NOT_REPORTED["openai"])


def test_an_unstreamed_llama_server_completion_passes_through_unchanged(
    upstream: UpstreamOtlp, runtime: AgentRuntime
) -> None:
    with (
        StandInEngine("llama-server", queue_s=0.01, prefill_s=0.02, gap_s=0.002) as engine,
        running_proxy(engine.url, runtime=runtime) as proxy,
    ):
        trace_id, _, traceparent = _traceparent()
        body = {"prompt": "hi", "n_predict": 3, "max_tokens": 3}
        response, proxied = _post(proxy_url(proxy) + "/completion", body, traceparent)
        _, direct = _post(engine.url + "/completion", body, traceparent)
    assert response.headers["content-length"] == str(len(proxied))
    assert proxied == direct
    spans = request_tree(upstream, runtime, trace_id)
    values = attributes(spans[semconv.SPAN_REQUEST])
    assert values[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == 3
    assert values[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == ["length"]
    assert 20 * _MS <= _duration(spans[semconv.SPAN_PREFILL]) <= 35 * _MS
    assert attributes(spans["http"])[semconv.PROXY_ENGINE] == "llama-server"


def test_each_chunk_reaches_the_client_before_the_engine_sends_the_next(
    runtime: AgentRuntime,
) -> None:
    """No buffering: the engine sends chunk k+1 only after the client has read chunk k."""
    gate = threading.Semaphore(0)
    with (
        StandInEngine("llama-server", queue_s=0, prefill_s=0, gap_s=0, gate=gate) as engine,
        running_proxy(engine.url, runtime=runtime) as proxy,
        httpx.Client(timeout=5) as client,
        client.stream(
            "POST", proxy_url(proxy) + "/v1/chat/completions", json={**_CHAT, "max_tokens": 5}
        ) as response,
    ):
        seen = 0
        for line in response.iter_lines():
            if '"content"' in line:
                seen += 1
                gate.release()  # only now may the engine send the next one
    assert seen == 5


def test_requests_on_one_client_connection_share_one_upstream_connection(
    runtime: AgentRuntime,
) -> None:
    with (
        StandInEngine("llama-server", queue_s=0, prefill_s=0.001, gap_s=0) as engine,
        running_proxy(engine.url, runtime=runtime) as proxy,
        httpx.Client(timeout=5) as client,
    ):
        for _ in range(3):
            response = client.post(proxy_url(proxy) + "/v1/completions", json={"prompt": "x"})
            assert response.status_code == 200 and response.json()["usage"]
        assert client.get(proxy_url(proxy) + "/health").json() == {"status": "ok"}
        assert proxy.requests == 4 and proxy.traced_requests == 3
    assert engine.connections == 1


def test_an_upstream_that_is_down_gets_the_client_a_502(
    upstream: UpstreamOtlp, runtime: AgentRuntime
) -> None:
    with socket.socket() as placeholder:  # a port nobody listens on
        placeholder.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{placeholder.getsockname()[1]}"
    with running_proxy(dead, runtime=runtime) as proxy:
        trace_id, _, traceparent = _traceparent()
        response, body = _post(proxy_url(proxy) + "/v1/chat/completions", _CHAT, traceparent)
        assert proxy.upstream_errors == 1
    assert response.status_code == 502
    assert json.loads(body)["error"]["type"] == "upstream_unavailable"
    spans = request_tree(upstream, runtime, trace_id)
    assert spans["http"].status.code == Status.STATUS_CODE_ERROR
    assert attributes(spans["http"])[semconv.HTTP_RESPONSE_STATUS_CODE] == 502
    assert spans[semconv.SPAN_REQUEST].status.message == "upstream unavailable"


def test_a_client_that_leaves_mid_stream_closes_the_upstream_and_is_aborted(
    upstream: UpstreamOtlp, runtime: AgentRuntime
) -> None:
    with (
        StandInEngine("llama-server", queue_s=0, prefill_s=0.005, gap_s=0.05, tokens=100) as engine,
        running_proxy(engine.url, runtime=runtime) as proxy,
    ):
        trace_id, _, traceparent = _traceparent()
        with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
            body = json.dumps({**_CHAT, "max_tokens": 100}).encode()
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                b"application/json\r\ntraceparent: " + traceparent.encode() + b"\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
            received = b""
            while received.count(b"data:") < 2:
                received += sock.recv(65536)
        deadline = time.monotonic() + 5
        while engine.broken_streams < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.broken_streams == 1  # the engine saw its connection close
        assert proxy.aborted_requests == 1
    spans = request_tree(upstream, runtime, trace_id)
    assert spans[semconv.SPAN_REQUEST].status.message == "aborted"
    assert spans["http"].status.code == Status.STATUS_CODE_ERROR


def test_untraced_requests_pass_through_with_the_callers_traceparent(
    upstream: UpstreamOtlp, runtime: AgentRuntime
) -> None:
    with (
        StandInEngine("llama-server") as engine,
        running_proxy(engine.url, runtime=runtime) as proxy,
    ):
        trace_id, _, traceparent = _traceparent()
        response = httpx.get(proxy_url(proxy) + "/health", headers={"traceparent": traceparent})
    assert response.json() == {"status": "ok"}
    assert engine.requests[0].headers["traceparent"] == traceparent
    runtime.flush()
    assert not [s for s in received_spans(upstream) if s.trace_id == trace_id]


def test_a_chunked_request_body_is_forwarded_as_it_comes(runtime: AgentRuntime) -> None:
    body = json.dumps({**_CHAT, "max_tokens": 2}).encode()

    def pieces() -> Iterator[bytes]:
        for i in range(0, len(body), 7):
            yield body[i : i + 7]

    with (
        StandInEngine("llama-server", queue_s=0, prefill_s=0, gap_s=0) as engine,
        running_proxy(engine.url, runtime=runtime) as proxy,
    ):
        response = httpx.post(proxy_url(proxy) + "/v1/chat/completions", content=pieces())
    assert response.status_code == 200
    assert engine.requests[0].headers["transfer-encoding"] == "chunked"
    assert engine.requests[0].body == body


def test_an_upstream_connection_closed_while_idle_is_replaced(runtime: AgentRuntime) -> None:
    with (
        StandInEngine("llama-server", queue_s=0, prefill_s=0, gap_s=0) as engine,
        running_proxy(engine.url, runtime=runtime) as proxy,
        httpx.Client(timeout=5) as client,
    ):
        engine.close_after_each = True
        for _ in range(3):
            response = client.post(proxy_url(proxy) + "/v1/completions", json={"prompt": "x"})
            assert response.status_code == 200
            time.sleep(0.05)  # the engine's close reaches the proxy
        assert proxy.upstream_errors == 0
    assert engine.connections == 3


def test_expect_100_continue_is_answered_by_the_proxy(runtime: AgentRuntime) -> None:
    body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
    with (
        StandInEngine("llama-server", queue_s=0, prefill_s=0, gap_s=0) as engine,
        running_proxy(engine.url, runtime=runtime) as proxy,
        socket.create_connection(("127.0.0.1", proxy.port)) as sock,
    ):
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
        )
        assert sock.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        response = b""
        while data := sock.recv(65536):
            response += data
    assert response.startswith(b"HTTP/1.1 200 OK\r\n")
    assert "expect" not in engine.requests[0].headers
    assert engine.requests[0].body == body


def test_an_engine_error_ends_the_request_with_its_status(
    upstream: UpstreamOtlp, runtime: AgentRuntime
) -> None:
    with (
        StandInEngine("llama-server") as engine,
        running_proxy(engine.url, runtime=runtime) as proxy,
    ):
        trace_id, _, traceparent = _traceparent()
        response, _ = _post(proxy_url(proxy) + "/v1/chat/completions", {"bad": 1}, traceparent)
    assert response.status_code == 400
    spans = request_tree(upstream, runtime, trace_id)
    assert spans[semconv.SPAN_REQUEST].status.message == "HTTP 400"
    assert spans["http"].status.code != Status.STATUS_CODE_ERROR  # the client's error
