"""``tokentrace load`` end to end against a fake OpenAI-compatible server on loopback.

The fake server (Starlette on uvicorn) streams tokens with known delays, reports usage the
client cannot guess, records every request it got (headers, body, client port) and can fail on
purpose; client spans go to the real OTLP test receiver (``tests/collector/upstream.py``). Each
test runs the command through ``tokentrace.agent.cli.main`` and checks the run record, the
exported spans and what the server saw against each other.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import uvicorn
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.collector.upstream import UpstreamOtlp, iter_spans
from tokentrace.agent import semconv
from tokentrace.agent.cli import main as tokentrace_main
from tokentrace.loadgen import http as http_module
from tokentrace.loadgen import record as run_record
from tokentrace.loadgen.results import RequestResult
from tokentrace.loadgen.workload import arrival_offsets_s

_MODEL = "fake-model"
_FIRST_TOKEN_DELAY_S = 0.010
"""The fake server's sleep before the first token (its "prefill")."""
_TOKEN_GAP_S = 0.002
"""Its sleep between two tokens."""
_USAGE_DELAY_S = 0.015
"""Its sleep between the last token and the usage chunk: E2E must not include it."""
_CHAT_TEMPLATE_TOKENS = 7
"""Added to the prompt's word count in ``usage.prompt_tokens``, so the client cannot guess it."""
_NS_PER_S = 1_000_000_000
_NS_PER_MS = 1_000_000
_MS_ROUNDING = 6e-4
"""The summary rounds milliseconds to 3 decimals."""
_SERVER_START_TIMEOUT_S = 10.0
_SPAN_WAIT_S = 5.0
_CLIENT_BLOCK_S = 0.5
"""How long a test blocks the client's event loop right after it sent a request."""
_CLIENT_SIDE_ATTRIBUTES = {
    semconv.CLIENT_FIRST_BYTE_TIME: "first_byte_ns",
    semconv.CLIENT_STREAM: "stream",
    semconv.CLIENT_CONNECTION_REUSED: "connection_reused",
    semconv.CLIENT_CONNECT_NS: "connect_ns",
    semconv.CLIENT_SEND_WAIT_NS: "send_wait_ns",
    semconv.CLIENT_FIRST_TOKEN_READ_WAIT_NS: "first_token_read_wait_ns",
    semconv.CLIENT_READ_WAIT_NS: "read_wait_ns",
    semconv.CLIENT_RTT_NS: "rtt_ns",
}
"""Client span attribute -> the run record's field it carries (absent: None)."""


# --- the fake OpenAI-compatible server ------------------------------------------------------------
@dataclass(slots=True)
class SeenRequest:
    """One POST as the fake server got it."""

    sequence: int
    """1-based arrival order at the server."""
    arrived_ns: int
    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    client_port: int
    prompt_tokens: int
    """What the server reports in ``usage.prompt_tokens``."""
    choice_chunks: int
    """Stream events carrying a choice the server sends when the request succeeds."""
    answer: str
    """``ok`` | ``http 500`` | ``error event``."""

    @property
    def traceparent(self) -> str | None:
        return self.headers.get("traceparent")

    @property
    def trace_id(self) -> str:
        assert self.traceparent is not None, f"request {self.sequence} carried no traceparent"
        return self.traceparent.split("-")[1]

    @property
    def span_id(self) -> str:
        assert self.traceparent is not None, f"request {self.sequence} carried no traceparent"
        return self.traceparent.split("-")[2]


class FakeOpenAI:
    """``GET /v1/models``, ``POST /v1/chat/completions`` and ``POST /v1/completions``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: list[SeenRequest] = []
        self.fail_every = 0
        """Answer 500 to every n-th POST (by arrival); 0: never."""
        self.error_event_at: int | None = None
        """The arrival sequence whose stream breaks off with an ``{"error": ...}`` event."""
        self.api_key: str | None = None
        """Set: every request without ``Authorization: Bearer <api_key>`` is refused (401)."""
        self.model_listings = 0
        """``GET /v1/models`` requests answered."""

    def reset(self) -> None:
        with self._lock:
            self._seen.clear()
        self.fail_every = 0
        self.error_event_at = None
        self.api_key = None
        self.model_listings = 0

    def _refused(self, request: Request) -> Response | None:
        if self.api_key is None or request.headers.get("authorization") == f"Bearer {self.api_key}":
            return None
        return JSONResponse({"error": {"message": "bad key", "code": 401}}, status_code=401)

    @property
    def seen(self) -> list[SeenRequest]:
        with self._lock:
            return list(self._seen)

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/chat/completions", self._generate, methods=["POST"]),
                Route("/v1/completions", self._generate, methods=["POST"]),
            ]
        )

    async def _models(self, request: Request) -> Response:
        self.model_listings += 1
        if (refused := self._refused(request)) is not None:
            return refused
        return JSONResponse({"object": "list", "data": [{"id": _MODEL, "object": "model"}]})

    async def _generate(self, request: Request) -> Response:
        if (refused := self._refused(request)) is not None:
            return refused
        arrived_ns = time.time_ns()
        body = await request.json()
        chat = request.url.path.endswith("/chat/completions")
        tokens = int(body["max_tokens"])
        if chat:
            words = sum(len(message["content"].split()) for message in body["messages"])
            prompt_tokens = words + _CHAT_TEMPLATE_TOKENS
        else:
            prompt_tokens = len(body["prompt"].split())
        client_port = request.client.port if request.client is not None else 0
        with self._lock:
            sequence = len(self._seen) + 1
            if self.fail_every and sequence % self.fail_every == 0:
                answer = "http 500"
            elif sequence == self.error_event_at:
                answer = "error event"
            else:
                answer = "ok"
            self._seen.append(
                SeenRequest(
                    sequence=sequence,
                    arrived_ns=arrived_ns,
                    path=request.url.path,
                    headers=dict(request.headers),
                    body=body,
                    client_port=client_port,
                    prompt_tokens=prompt_tokens,
                    # vLLM sends a role chunk with the first token of a chat stream.
                    choice_chunks=tokens + 1 if chat else tokens,
                    answer=answer,
                )
            )
        if answer == "http 500":
            error = {"message": "fake overload", "type": "InternalServerError", "code": 500}
            return JSONResponse({"error": error}, status_code=500)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": tokens,
            "total_tokens": prompt_tokens + tokens,
        }
        if not body.get("stream"):
            await asyncio.sleep(_FIRST_TOKEN_DELAY_S + _TOKEN_GAP_S * (tokens - 1))
            return JSONResponse(_whole_response(chat=chat, tokens=tokens, usage=usage))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        events = _events(
            chat=chat,
            tokens=tokens,
            usage=usage if include_usage else None,
            break_off=answer == "error event",
        )
        return StreamingResponse(events, media_type="text/event-stream")


def _sse(message: object) -> bytes:
    return f"data: {json.dumps(message)}\n\n".encode()


def _chunk(*, chat: bool, index: int, tokens: int) -> dict[str, Any]:
    finish = "length" if index == tokens - 1 else None
    if chat:
        choice: dict[str, Any] = {"index": 0, "delta": {"content": f" tok{index}"}}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": f" tok{index}"}
        kind = "text_completion"
    choice["finish_reason"] = finish
    return {"id": "fake-1", "object": kind, "model": _MODEL, "choices": [choice]}


async def _events(
    *, chat: bool, tokens: int, usage: dict[str, int] | None, break_off: bool
) -> AsyncIterator[bytes]:
    await asyncio.sleep(_FIRST_TOKEN_DELAY_S)
    if chat:
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        yield _sse({"id": "fake-1", "object": "chat.completion.chunk", "choices": [role]})
    for index in range(tokens):
        if index:
            await asyncio.sleep(_TOKEN_GAP_S)
        if break_off and index == tokens // 2:
            yield _sse({"error": {"message": "fake engine failure", "code": 500}})
            yield b"data: [DONE]\n\n"
            return
        yield _sse(_chunk(chat=chat, index=index, tokens=tokens))
    await asyncio.sleep(_USAGE_DELAY_S)
    if usage is not None:
        yield _sse(
            {"id": "fake-1", "object": "chat.completion.chunk", "choices": [], "usage": usage}
        )
    yield b"data: [DONE]\n\n"


def _whole_response(*, chat: bool, tokens: int, usage: dict[str, int]) -> dict[str, Any]:
    text = "".join(f" tok{index}" for index in range(tokens))
    if chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
    else:
        choice = {"index": 0, "text": text}
    choice["finish_reason"] = "length"
    return {"id": "fake-1", "model": _MODEL, "choices": [choice], "usage": usage}


@dataclass(frozen=True, slots=True)
class Served:
    fake: FakeOpenAI
    url: str


@pytest.fixture(scope="module")
def _served() -> Iterator[Served]:
    fake = FakeOpenAI()
    config = uvicorn.Config(
        fake.app(),
        host="127.0.0.1",
        port=0,
        log_level="warning",
        access_log=False,
        lifespan="off",
        # The stdlib loop: uvloop's timers run off a clock cached per loop iteration and can
        # fire a little early, and the tests rely on the server's sleeps as lower bounds.
        loop="asyncio",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="fake-openai", daemon=True)
    thread.start()
    deadline = time.monotonic() + _SERVER_START_TIMEOUT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield Served(fake, f"http://127.0.0.1:{port}")
    server.should_exit = True
    thread.join(timeout=_SERVER_START_TIMEOUT_S)


@pytest.fixture
def served(_served: Served) -> Served:
    _served.fake.reset()
    return _served


@pytest.fixture(autouse=True)
def _no_otel_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --otlp-endpoint nothing may be exported to wherever the environment points."""
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)


# --- helpers --------------------------------------------------------------------------------------
def _load(url: str, out: Path, *options: str) -> int:
    return tokentrace_main(["load", url, "--out", str(out), "--quiet", *options])


def _client_spans(upstream: UpstreamOtlp, count: int) -> dict[tuple[str, str], Span]:
    """The exported client spans by (trace id, span id) hex, once ``count`` arrived."""
    assert upstream.wait_for_spans(count, timeout_s=_SPAN_WAIT_S)
    spans = [span for _, _, span in iter_spans(upstream.trace_requests)]
    assert len(spans) == count
    return {(span.trace_id.hex(), span.span_id.hex()): span for span in spans}


def _attributes(span: Span) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for entry in span.attributes:
        kind = entry.value.WhichOneof("value")
        values[entry.key] = getattr(entry.value, kind) if kind else None
    return values


def _e2e_ns(result: RequestResult) -> int:
    """To the last token chunk when streaming, else to the complete response."""
    end = result.last_token_ns if result.last_token_ns is not None else result.end_ns
    return end - result.start_ns


def _assert_summary_matches(
    metrics: dict[str, dict[str, Any]], results: list[RequestResult], labels: dict[str, float]
) -> None:
    """The summary's percentiles are numpy's (linear) over values computed here from raw times."""
    done = [result for result in results if result.ok]
    ttft = [r.first_token_ns - r.start_ns for r in done if r.first_token_ns is not None]
    e2e = [_e2e_ns(r) for r in done]
    itl = [gap for r in done for gap in r.chunk_gaps_ns]
    tpot = [
        (_e2e_ns(r) - (r.first_token_ns - r.start_ns)) / (r.output_tokens - 1)
        for r in done
        if r.first_token_ns is not None and r.output_tokens is not None and r.output_tokens >= 2
    ]
    expected = {
        semconv.METRIC_TTFT: ttft,
        semconv.METRIC_E2E: e2e,
        semconv.METRIC_ITL: itl,
        semconv.METRIC_TPOT: tpot,
    }
    for metric, values in expected.items():
        summary = metrics[metric]
        assert summary["count"] == len(values), metric
        if not values:
            continue
        assert summary["mean"] == pytest.approx(np.mean(values) / _NS_PER_MS, abs=_MS_ROUNDING)
        for label, percent in labels.items():
            want = float(np.percentile(values, percent)) / _NS_PER_MS
            assert summary[label] == pytest.approx(want, abs=_MS_ROUNDING), (metric, label)


def _assert_client_side_facts(result: RequestResult, *, stream: bool) -> None:
    """What every successful request knows about its own side of the wire."""
    assert result.stream is stream
    assert result.first_byte_ns is not None
    assert result.start_ns < result.first_byte_ns <= result.end_ns
    if result.first_token_ns is not None:
        assert result.first_byte_ns <= result.first_token_ns
    assert isinstance(result.connection_reused, bool)
    if result.connection_reused:
        assert result.connect_ns is None
    else:
        assert result.connect_ns is not None and result.connect_ns > 0
    assert result.send_wait_ns is not None and result.send_wait_ns >= 0
    assert result.rtt_ns is not None and result.rtt_ns > 0
    assert result.read_wait_ns is not None and result.read_wait_ns >= 0
    if stream:
        assert result.first_token_read_wait_ns is not None
        assert result.first_token_read_wait_ns >= 0
    else:
        assert result.first_token_read_wait_ns is None


def _assert_span_carries_client_side_facts(span: Span, result: RequestResult) -> None:
    attributes = _attributes(span)
    for attribute, field_name in _CLIENT_SIDE_ATTRIBUTES.items():
        assert attributes.get(attribute) == getattr(result, field_name), attribute


def _closed_port() -> int:
    with socket.socket() as probe:  # nothing listens on it once the probe is closed
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# --- tests ----------------------------------------------------------------------------------------
def test_closed_loop_chat_stream_traces_and_measures_every_request(
    served: Served, upstream: UpstreamOtlp, tmp_path: Path
) -> None:
    out = tmp_path / "run.json"
    code = _load(
        served.url,
        out,
        "--concurrency", "4",
        "--requests", "20",
        "--output-tokens", "8",
        "--prompt-tokens", "16",
        "--percentiles", "25,50,90,99.5",
        "--otlp-endpoint", upstream.grpc_endpoint,
    )  # fmt: skip
    assert code == 0
    run = run_record.load(out)
    assert run.model == _MODEL
    results = run.results
    assert [result.index for result in results] == list(range(20))
    assert all(result.ok and result.status == 200 for result in results)

    seen = served.fake.seen
    assert len(seen) == 20
    by_trace = {request.trace_id: request for request in seen}
    assert set(by_trace) == {result.trace_id for result in results}
    for result in results:
        request = by_trace[result.trace_id]
        assert request.span_id == result.span_id
        assert request.traceparent == f"00-{result.trace_id}-{result.span_id}-01"
        assert request.path == "/v1/chat/completions"
        assert request.body["model"] == _MODEL
        assert request.body["max_tokens"] == 8 and request.body["stream"] is True
        assert result.output_tokens == 8
        assert result.prompt_tokens == request.prompt_tokens
        assert result.first_token_ns is not None and result.last_token_ns is not None
        # The role chunk is the first "token", as in vllm bench: one gap per later chunk.
        assert len(result.chunk_gaps_ns) == request.choice_chunks - 1
        assert sum(result.chunk_gaps_ns) == result.last_token_ns - result.first_token_ns
        assert result.first_token_ns - result.start_ns >= _FIRST_TOKEN_DELAY_S * _NS_PER_S
        assert _e2e_ns(result) >= (_FIRST_TOKEN_DELAY_S + 7 * _TOKEN_GAP_S) * _NS_PER_S
        assert result.start_ns < result.first_token_ns <= result.last_token_ns <= result.end_ns
    # The usage chunk comes _USAGE_DELAY_S after the last token: outside E2E, inside the span.
    tails = sorted(
        result.end_ns - result.last_token_ns for result in results if result.last_token_ns
    )
    assert tails[len(tails) // 2] >= _USAGE_DELAY_S * _NS_PER_S / 2

    summary = run.summary
    assert (summary["requests"], summary["completed"], summary["failed"]) == (20, 20, 0)
    assert summary["input_tokens"] == sum(request.prompt_tokens for request in seen)
    assert summary["output_tokens"] == 20 * 8
    labels = {"p25": 25.0, "p50": 50.0, "p90": 90.0, "p99.5": 99.5}
    _assert_summary_matches(summary["metrics"], results, labels)

    spans = _client_spans(upstream, 20)
    assert set(spans) == {(result.trace_id, result.span_id) for result in results}
    assert run.export["sent_spans"] == 20
    for result in results:
        span = spans[(result.trace_id, result.span_id)]
        assert span.name == semconv.SPAN_CLIENT_REQUEST
        assert span.kind == Span.SPAN_KIND_CLIENT
        assert span.parent_span_id == b""
        assert span.status.code == Status.STATUS_CODE_UNSET
        assert (span.start_time_unix_nano, span.end_time_unix_nano) == (
            result.start_ns,
            result.end_ns,
        )
        attributes = _attributes(span)
        first_token = attributes[semconv.CLIENT_FIRST_TOKEN_TIME]
        assert span.start_time_unix_nano < first_token <= span.end_time_unix_nano
        assert first_token == result.first_token_ns
        assert attributes[semconv.GEN_AI_OPERATION_NAME] == semconv.OPERATION_CHAT
        assert attributes[semconv.GEN_AI_REQUEST_MODEL] == _MODEL
        assert attributes[semconv.URL_PATH] == "/v1/chat/completions"
        assert attributes[semconv.HTTP_RESPONSE_STATUS_CODE] == 200
        assert attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == 8
        assert attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS] == result.prompt_tokens
        _assert_client_side_facts(result, stream=True)
        _assert_span_carries_client_side_facts(span, result)
        first_byte = attributes[semconv.CLIENT_FIRST_BYTE_TIME]
        assert span.start_time_unix_nano < first_byte <= first_token
    # Four workers: each opened one connection for its first request and reused it after.
    opened = [result for result in results if not result.connection_reused]
    assert len(opened) == run.http["connections_opened"] == 4


def _bodies_by_index(run: run_record.RunRecord, seen: list[SeenRequest]) -> list[dict[str, Any]]:
    index_of = {result.trace_id: result.index for result in run.results}
    by_index = {index_of[request.trace_id]: request.body for request in seen}
    return [by_index[index] for index in range(len(run.results))]


def test_open_loop_completions_whole_responses_are_reproducible(
    served: Served, tmp_path: Path
) -> None:
    options = (
        "--rate", "200",
        "--requests", "30",
        "--api", "completions",
        "--no-stream",
        "--output-tokens", "4",
        "--prompt-tokens", "12",
    )  # fmt: skip
    fake = served.fake
    assert _load(served.url, tmp_path / "a.json", *options, "--seed", "7") == 0
    first = run_record.load(tmp_path / "a.json")
    first_seen = fake.seen
    assert len(first.results) == 30 and len(first_seen) == 30
    whole_delay_ns = (_FIRST_TOKEN_DELAY_S + 3 * _TOKEN_GAP_S) * _NS_PER_S
    for result in first.results:
        assert result.ok and result.status == 200
        assert result.first_token_ns is None and result.chunk_gaps_ns == []
        _assert_client_side_facts(result, stream=False)
        assert result.output_tokens == 4
        assert result.end_ns - result.start_ns >= whole_delay_ns
    for request in first_seen:
        assert request.path == "/v1/completions"
        assert request.body["stream"] is False and "stream_options" not in request.body
        assert isinstance(request.body["prompt"], str)
    metrics = first.summary["metrics"]
    assert metrics[semconv.METRIC_TTFT]["count"] == 0
    assert metrics[semconv.METRIC_TPOT]["count"] == 0
    assert metrics[semconv.METRIC_ITL]["count"] == 0
    assert metrics[semconv.METRIC_E2E]["count"] == 30
    _assert_summary_matches(metrics, first.results, {"p50": 50.0, "p99": 99.0})
    # Poisson arrivals: the server cannot see them closer together than the schedule allows.
    offsets = [offset for _, offset in zip(range(30), arrival_offsets_s(200, seed=7), strict=False)]
    arrivals = [request.arrived_ns for request in first_seen]
    assert max(arrivals) - min(arrivals) >= (offsets[-1] - offsets[0]) * _NS_PER_S / 2

    fake.reset()
    assert _load(served.url, tmp_path / "b.json", *options, "--seed", "7") == 0
    again = _bodies_by_index(run_record.load(tmp_path / "b.json"), fake.seen)
    assert again == _bodies_by_index(first, first_seen)

    fake.reset()
    assert _load(served.url, tmp_path / "c.json", *options, "--seed", "8") == 0
    other = _bodies_by_index(run_record.load(tmp_path / "c.json"), fake.seen)
    assert all(
        mine["prompt"] != theirs["prompt"]
        for mine, theirs in zip(other, _bodies_by_index(first, first_seen), strict=True)
    )


def test_http_errors_are_counted_and_their_spans_marked(
    served: Served, upstream: UpstreamOtlp, tmp_path: Path
) -> None:
    served.fake.fail_every = 5
    out = tmp_path / "run.json"
    code = _load(
        served.url,
        out,
        "--concurrency", "4",
        "--requests", "20",
        "--output-tokens", "4",
        "--prompt-tokens", "8",
        "--otlp-endpoint", upstream.grpc_endpoint,
    )  # fmt: skip
    assert code == 0
    run = run_record.load(out)
    summary = run.summary
    assert (summary["requests"], summary["completed"], summary["failed"]) == (20, 16, 4)
    assert summary["errors"] == {"http 500": 4}
    assert summary["metrics"][semconv.METRIC_TTFT]["count"] == 16
    assert summary["metrics"][semconv.METRIC_E2E]["count"] == 16
    assert summary["output_tokens"] == 16 * 4

    refused = {request.trace_id for request in served.fake.seen if request.answer == "http 500"}
    failed = [result for result in run.results if not result.ok]
    assert {result.trace_id for result in failed} == refused
    spans = _client_spans(upstream, 20)
    for result in run.results:
        span = spans[(result.trace_id, result.span_id)]
        attributes = _attributes(span)
        if result.ok:
            assert span.status.code == Status.STATUS_CODE_UNSET
            assert attributes[semconv.HTTP_RESPONSE_STATUS_CODE] == 200
            continue
        assert result.status == 500 and result.first_token_ns is None
        assert result.error is not None and result.error.startswith("http 500")
        assert "fake overload" in result.error
        assert span.status.code == Status.STATUS_CODE_ERROR
        assert span.status.message == result.error
        assert attributes[semconv.HTTP_RESPONSE_STATUS_CODE] == 500
        assert semconv.CLIENT_FIRST_TOKEN_TIME not in attributes


def test_error_event_mid_stream_fails_that_request(
    served: Served, upstream: UpstreamOtlp, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    served.fake.error_event_at = 3
    out = tmp_path / "run.json"
    code = _load(
        served.url,
        out,
        "--concurrency", "2",
        "--requests", "6",
        "--output-tokens", "6",
        "--prompt-tokens", "8",
        "--otlp-endpoint", upstream.grpc_endpoint,
    )  # fmt: skip
    assert code == 0
    run = run_record.load(out)
    assert run.summary["failed"] == 1 and run.summary["errors"] == {"server error": 1}
    broken = next(request for request in served.fake.seen if request.answer == "error event")
    failed = [result for result in run.results if not result.ok]
    assert [result.trace_id for result in failed] == [broken.trace_id]
    (result,) = failed
    assert result.status == 200
    assert result.error is not None and result.error.startswith("server error")
    assert "fake engine failure" in result.error
    span = _client_spans(upstream, 6)[(result.trace_id, result.span_id)]
    assert span.status.code == Status.STATUS_CODE_ERROR
    assert "fake engine failure" in span.status.message
    printed = capsys.readouterr().out
    assert "server error x1" in printed


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (["--concurrency", "0"], "--concurrency"),
        (["--percentiles", "50,abc"], "--percentiles"),
        (["--slo", "missing-slo.yaml"], "--slo"),
        (["--duration", "soon"], "--duration"),
        (["--otlp-protocol", "grpc"], "--otlp-protocol"),
        (["--header", "X-Tenant blue"], "--header"),
        (["--header", "traceparent: 00-ab-cd-01"], "--header traceparent"),
        (["--header", "Content-Length: 5"], "--header Content-Length"),
        (["--header", "X-Bad\u00e9: v"], "--header"),
    ],
)
def test_bad_options_exit_2_naming_the_option(
    served: Served,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    options: list[str],
    named: str,
) -> None:
    out = tmp_path / "run.json"
    resolved = [
        str(tmp_path / option) if option.endswith(".yaml") else option for option in options
    ]
    assert _load(served.url, out, "--requests", "2", *resolved) == 2
    err = capsys.readouterr().err
    assert err.startswith("tokentrace load: ")
    assert named in err
    assert "Traceback" not in err
    assert not out.exists()
    assert served.fake.seen == []
    assert served.fake.model_listings == 0  # rejected before anything reached the server


def test_unreachable_server_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    port = _closed_port()
    out = tmp_path / "run.json"
    assert _load(f"http://127.0.0.1:{port}", out, "--requests", "2") == 1
    err = capsys.readouterr().err
    assert "cannot reach" in err and f"127.0.0.1:{port}" in err
    assert "Traceback" not in err
    assert not out.exists()


def test_every_request_failing_exits_1_with_a_record(
    served: Served, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    served.fake.fail_every = 1
    out = tmp_path / "run.json"
    assert _load(served.url, out, "--requests", "3", "--output-tokens", "2") == 1
    run = run_record.load(out)
    assert (run.summary["completed"], run.summary["failed"]) == (0, 3)
    assert "http 500 x3" in capsys.readouterr().out


_SLO_FILE = """\
targets:
  - {name: ttft-p95, metric: ttft, percentile: 95, threshold: 1s}
  - {name: q, metric: queue, percentile: 50, threshold: 1s}
  - {name: e2e-tight, metric: e2e, percentile: 50, threshold: 1ms}
"""


def test_slo_targets_are_judged_client_side(
    served: Served, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    slo = tmp_path / "slo.yaml"
    slo.write_text(_SLO_FILE, encoding="utf-8")
    out = tmp_path / "run.json"
    code = _load(
        served.url,
        out,
        "--concurrency", "2",
        "--requests", "6",
        "--output-tokens", "4",
        "--prompt-tokens", "8",
        "--slo", str(slo),
    )  # fmt: skip
    assert code == 0
    run = run_record.load(out)
    entries = {entry["target"]: entry for entry in run.slo}
    assert set(entries) == {"ttft-p95", "q", "e2e-tight"}

    ttft = entries["ttft-p95"]
    assert ttft["met"] is True and ttft["compliance"] == 1.0 and ttft["requests"] == 6
    assert ttft["threshold_ms"] == 1000
    ttfts = [r.first_token_ns - r.start_ns for r in run.results if r.first_token_ns is not None]
    assert ttft["value_ms"] == pytest.approx(
        float(np.percentile(ttfts, 95)) / _NS_PER_MS, abs=_MS_ROUNDING
    )
    # Every E2E is at least the server's first-token delay, far above 1 ms.
    tight = entries["e2e-tight"]
    assert tight["met"] is False and tight["compliance"] == 0.0 and tight["requests"] == 6

    queue = entries["q"]
    assert "note" in queue and "met" not in queue and "compliance" not in queue

    printed = capsys.readouterr().out
    assert "SLO targets" in printed
    assert "ttft-p95" in printed and "MISSED" in printed and "not judged" in printed


def test_connections_are_reused_by_default(served: Served, tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    options = ("--concurrency", "4", "--requests", "20", "--warmup", "2", "--output-tokens", "2")
    assert _load(served.url, out, *options) == 0
    run = run_record.load(out)
    http = run.http
    seen = served.fake.seen
    assert len(seen) == 22
    assert 1 <= http["connections_opened"] <= 4
    assert http["connections_opened"] + http["connections_reused"] == 22
    # The warm-up opened connections too: most measured requests went over a reused one.
    assert sum(1 for result in run.results if result.connection_reused) >= 20 - 4
    for result in run.results:
        _assert_client_side_facts(result, stream=True)
    # Kept-alive connections stay open for the whole run, so their client ports are distinct.
    assert len({request.client_port for request in seen}) == http["connections_opened"]


def test_no_reuse_opens_a_connection_per_request(served: Served, tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    options = ("--concurrency", "4", "--requests", "20", "--warmup", "2", "--output-tokens", "2")
    assert _load(served.url, out, *options, "--no-reuse-connections") == 0
    run = run_record.load(out)
    http = run.http
    seen = served.fake.seen
    assert len(seen) == 22
    assert http["connections_opened"] == 22
    assert http["connections_reused"] == 0
    assert all(request.headers.get("connection") == "close" for request in seen)
    for result in run.results:
        assert result.connection_reused is False
        _assert_client_side_facts(result, stream=True)


def test_a_blocked_client_loop_shows_as_read_wait_not_as_send_wait(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = ("--requests", "2", "--output-tokens", "2", "--prompt-tokens", "8")
    assert _load(served.url, tmp_path / "free.json", *options) == 0
    free = run_record.load(tmp_path / "free.json").results

    send = http_module._Connection.send

    async def send_then_block(connection: Any, data: bytes) -> None:
        await send(connection, data)
        # The client's loop stalls (a saturated client) while the response arrives.
        time.sleep(_CLIENT_BLOCK_S)

    monkeypatch.setattr(http_module._Connection, "send", send_then_block)
    assert _load(served.url, tmp_path / "blocked.json", *options) == 0
    blocked = run_record.load(tmp_path / "blocked.json").results
    for result in [*free, *blocked]:
        assert result.ok
        _assert_client_side_facts(result, stream=True)
    block_ns = _CLIENT_BLOCK_S * _NS_PER_S
    # The server answers in about 30 ms: most of the block, the bytes waited in the kernel.
    # Bounded below only (a loaded machine adds its own delays).
    for free_result, blocked_result in zip(free, blocked, strict=True):
        assert blocked_result.read_wait_ns is not None and free_result.read_wait_ns is not None
        assert blocked_result.read_wait_ns - free_result.read_wait_ns >= block_ns / 2
        first_wait, free_first_wait = (
            blocked_result.first_token_read_wait_ns,
            free_result.first_token_read_wait_ns,
        )
        assert first_wait is not None and free_first_wait is not None
        assert first_wait - free_first_wait >= block_ns / 2
        # Sent before the block: the wait to send does not include it.
        assert blocked_result.send_wait_ns is not None
        assert blocked_result.send_wait_ns < block_ns / 2


def test_a_record_from_before_the_client_side_facts_still_loads(
    served: Served, tmp_path: Path
) -> None:
    out = tmp_path / "run.json"
    assert _load(served.url, out, "--requests", "2", "--output-tokens", "2") == 0
    data = json.loads(out.read_text(encoding="utf-8"))
    for entry in data["requests"]:
        for field_name in _CLIENT_SIDE_ATTRIBUTES.values():
            del entry[field_name]
    out.write_text(json.dumps(data), encoding="utf-8")
    results = run_record.load(out).results
    assert len(results) == 2
    for result in results:
        assert result.ok
        assert all(getattr(result, name) is None for name in _CLIENT_SIDE_ATTRIBUTES.values())


def test_warmup_requests_are_untraced_and_unrecorded(
    served: Served, upstream: UpstreamOtlp, tmp_path: Path
) -> None:
    out = tmp_path / "run.json"
    code = _load(
        served.url,
        out,
        "--warmup", "3",
        "--concurrency", "2",
        "--requests", "5",
        "--output-tokens", "4",
        "--prompt-tokens", "8",
        "--otlp-endpoint", upstream.grpc_endpoint,
    )  # fmt: skip
    assert code == 0
    run = run_record.load(out)
    seen = sorted(served.fake.seen, key=lambda request: request.sequence)
    assert len(seen) == 8
    warmups, measured = seen[:3], seen[3:]
    assert all(request.traceparent is None for request in warmups)
    assert {request.trace_id for request in measured} == {r.trace_id for r in run.results}
    assert [result.index for result in run.results] == list(range(5))
    assert run.summary["requests"] == 5 and run.warmup_failed == 0
    # Warm-up prompts are their own (plans -1, -2, -3), not copies of measured ones.
    measured_bodies = [request.body for request in measured]
    assert all(request.body not in measured_bodies for request in warmups)
    spans = _client_spans(upstream, 5)
    assert set(spans) == {(result.trace_id, result.span_id) for result in run.results}
    assert run.window_start_ns == min(result.start_ns for result in run.results)


_API_KEY = "sk-test-not-for-the-record"


def test_api_key_and_headers_reach_the_server_and_stay_out_of_the_record(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    served.fake.api_key = _API_KEY
    out = tmp_path / "run.json"
    options = ("--requests", "3", "--output-tokens", "2", "--header", "X-Tenant:  blue ")
    assert _load(served.url, out, *options, "--api-key", _API_KEY) == 0
    assert run_record.load(out).summary["completed"] == 3
    seen = served.fake.seen
    assert len(seen) == 3
    for request in seen:
        assert request.headers["authorization"] == f"Bearer {_API_KEY}"
        assert request.headers["x-tenant"] == "blue"
        assert request.traceparent is not None
    assert _API_KEY not in out.read_text(encoding="utf-8")


def test_the_api_key_comes_from_openai_api_key_by_default(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", _API_KEY)
    served.fake.api_key = _API_KEY
    out = tmp_path / "run.json"
    assert _load(served.url, out, "--requests", "2", "--output-tokens", "2") == 0
    assert run_record.load(out).summary["completed"] == 2


def test_a_refused_key_exits_1_saying_how_to_give_one(
    served: Served,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    served.fake.api_key = _API_KEY
    out = tmp_path / "run.json"
    assert _load(served.url, out, "--requests", "2") == 1
    err = capsys.readouterr().err
    assert "401" in err and "--api-key" in err and "OPENAI_API_KEY" in err
    assert "Traceback" not in err
    assert not out.exists()


def test_a_request_ends_with_the_read_that_completed_its_body(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client's own work after the last byte (here: its event loop blocked while it returns
    the connection, as a starved load generator would be) is not part of the request, so it
    cannot pose as time outside the server (network)."""
    from tokentrace.loadgen import http_response

    blocked_s = 1.0
    original = http_response.Response.aclose

    async def blocking_aclose(self: http_response.Response) -> None:
        time.sleep(blocked_s)  # the loop cannot run
        await original(self)

    monkeypatch.setattr(http_response.Response, "aclose", blocking_aclose)
    out = tmp_path / "run.json"
    code = _load(served.url, out, "--concurrency", "1", "--requests", "2", "--output-tokens", "4")
    assert code == 0
    results = run_record.load(out).results
    assert len(results) == 2 and all(result.ok for result in results)
    for result in results:
        assert result.last_token_ns is not None
        # Without the body's end as the request's end, each would end >= blocked_s later.
        assert result.end_ns - result.last_token_ns < blocked_s * 1e9
    # The second request started after the first one's blocked close: the block was real.
    assert results[1].start_ns - results[0].end_ns >= blocked_s * 1e9


def test_a_request_is_stamped_sent_when_its_bytes_left(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client descheduled between deciding to send and writing (a starved process) was late
    itself: the wait is its own (send wait), not time the request spent travelling (network).
    Seen in CI: a request stamped sent 2 s before its bytes reached the server on loopback."""
    blocked_s = 0.5
    original = asyncio.StreamWriter.write

    def late_write(self: asyncio.StreamWriter, data: bytes | bytearray | memoryview) -> None:
        time.sleep(blocked_s)  # nothing runs: the bytes leave this much later
        original(self, data)

    monkeypatch.setattr(asyncio.StreamWriter, "write", late_write)
    out = tmp_path / "run.json"
    code = _load(served.url, out, "--concurrency", "1", "--requests", "2", "--output-tokens", "4")
    assert code == 0
    results = run_record.load(out).results
    assert len(results) == 2 and all(result.ok for result in results)
    for result in results:
        assert result.send_wait_ns is not None and result.send_wait_ns >= blocked_s * 1e9
