"""The HTTP server span (``agent/frameworks/asgi.py``) through the vLLM instrumentor's patch of
the real Starlette, on a real FastAPI app that drives the stand-in vLLM frontend the way vLLM's
OpenAI server does: ``add_request`` in the request's task, outputs while the response streams.

In process (httpx's ASGI transport) for the span's structure; behind a real uvicorn on loopback
for what needs the server's socket (the kernel's receive wait) and real send timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from starlette.background import BackgroundTask

from tests.agent.vllm_stand_ins import (
    LENGTH,
    QUEUED,
    SCHEDULED,
    AsyncLLM,
    Event,
    Output,
    Setup,
)
from tests.spanbuild import trace
from tokentrace.agent import semconv
from tokentrace.agent.frameworks import asgi
from tokentrace.agent.frameworks.asgi import HOOK_HTTP_SERVER, HttpServerTracer
from tokentrace.agent.recorder import RequestTimer, to_finished_request
from tokentrace.agent.span_encoding import SpanBatchEncoder
from tokentrace.agent.span_ids import format_traceparent
from tokentrace.agent.spans import SpanJob
from tokentrace.processors.budget import compute_budget
from tokentrace.processors.timeline import normalize

_BEFORE_ENGINE_S = 0.02
"""The route's work before the engine sees the request (templating, tokenisation)."""
_AFTER_LAST_TOKEN_S = 0.03
"""The response's tail after the last token (detokenisation, the last SSE events)."""
_BACKGROUND_S = 0.05
"""A background task's run after the response was sent."""
_CALLER_TRACE_ID = bytes(range(1, 17))
_CALLER_SPAN_ID = bytes(range(1, 9))
_TOKENS = 3
_NS_PER_MS = 1_000_000
_BEFORE_FIRST_CHUNK_S = 0.02
"""The streaming route's wait before it produces its first chunk."""
_LOOP_BLOCK_S = 0.3
"""How long a route blocks the server's event loop while another request waits in the kernel."""
_SOCKET_TIMEOUT_S = 10.0


@pytest.fixture(autouse=True, params=["C", "Python"])
def middleware_variant(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs with the middleware's await and send in C (``_asgi``) and with their
    Python twins."""
    if request.param == "C" and asgi._TRACED_AWAIT is None:
        pytest.skip("the C extension is not built here (or TOKENTRACE_PURE_PYTHON is set)")
    if request.param == "Python":
        monkeypatch.setattr(asgi, "_TRACED_AWAIT", None)
        monkeypatch.setattr(asgi, "_TRACED_SEND", asgi._traced_send)
    return str(request.param)


def completions_app(engine: AsyncLLM) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def complete(request: Request) -> StreamingResponse:
        body = await request.json()
        await asyncio.sleep(_BEFORE_ENGINE_S)
        external_id = body["id"]
        # vLLM forwards the caller's headers too; the HTTP span must win over them.
        await engine.add_request(
            external_id, "prompt", None, time.time(), trace_headers=dict(request.headers)
        )
        internal = f"{external_id}-internal"

        async def stream() -> AsyncIterator[str]:
            processor = engine.output_processor
            for index in range(_TOKENS):
                now = time.monotonic()
                events = [Event(QUEUED, now), Event(SCHEDULED, now)] if index == 0 else None
                finish = LENGTH if index == _TOKENS - 1 else None
                processor.process_outputs([Output(internal, [index], finish, events)], now)
                yield f"data: {index}\n\n"
            await asyncio.sleep(_AFTER_LAST_TOKEN_S)
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/with-background")
    async def with_background() -> JSONResponse:
        return JSONResponse({"ok": True}, background=BackgroundTask(asyncio.sleep, _BACKGROUND_S))

    @app.post("/boom")
    async def boom() -> None:
        raise RuntimeError("the route failed")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


def serve(
    app: FastAPI, method: str, path: str, *, headers: dict[str, str] | None = None, **body: Any
) -> httpx.Response:
    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://vllm") as client:
            return await client.request(method, path, headers=headers, json=body or None)

    return asyncio.run(call())


def http_spans(setup: Setup) -> list[SpanJob]:
    """The HTTP tracer's submissions, planned as the emitter's thread would."""
    return [job for deferred in setup.http_jobs for job in deferred()]


def encoded(jobs: list[SpanJob], timers: list[RequestTimer], setup: Setup) -> list[Span]:
    encoder = SpanBatchEncoder(resource_attributes={"service.name": "t"}, scope_name="t")
    finished_requests = [to_finished_request(timer, setup.http_clock) for timer in timers]
    payload, count = encoder.encode(finished_requests, jobs)
    message = ExportTraceServiceRequest.FromString(payload)
    spans = [span for rs in message.resource_spans for ss in rs.scope_spans for span in ss.spans]
    assert len(spans) == count
    return spans


@pytest.fixture
def app(vllm_stand_in: Setup) -> Iterator[FastAPI]:
    vllm_stand_in.instrument()
    yield completions_app(AsyncLLM())


def test_a_post_is_a_server_span_that_parents_llm_request_and_honours_traceparent(
    vllm_stand_in: Setup, app: FastAPI
) -> None:
    caller = format_traceparent(_CALLER_TRACE_ID, _CALLER_SPAN_ID)
    response = serve(app, "POST", "/v1/completions", headers={"traceparent": caller}, id="cmpl-1")
    assert response.status_code == 200 and response.text.endswith("[DONE]\n\n")
    (job,) = http_spans(vllm_stand_in)
    (span,) = job.spans
    assert (job.trace_id, job.parent_span_id) == (_CALLER_TRACE_ID, _CALLER_SPAN_ID)
    assert span.kind == 2 and span.name == "POST /v1/completions" and span.status_error is None
    attributes = dict(span.attributes)
    first_body = attributes.pop(semconv.HTTP_FIRST_BODY_TIME)
    assert isinstance(first_body, int) and span.start_ns < first_body <= span.end_ns
    # No receive wait: httpx's in-process transport is not uvicorn and has no socket.
    assert attributes == {
        semconv.HTTP_REQUEST_METHOD: "POST",
        semconv.URL_PATH: "/v1/completions",
        semconv.HTTP_RESPONSE_STATUS_CODE: 200,
        semconv.HTTP_ROUTE: "/v1/completions",
    }
    (timer,) = vllm_stand_in.finished
    assert job.fixed_ids is not None
    http_span_id = job.fixed_ids[span.local_id]
    assert (timer.trace_id, timer.parent_span_id) == (_CALLER_TRACE_ID, http_span_id)
    # The HTTP span holds the engine's whole part of the request, with room on both sides.
    unix = vllm_stand_in.http_clock.to_unix_ns
    assert span.start_ns + _BEFORE_ENGINE_S * 1e9 <= unix(timer.arrival_ns)
    assert unix(timer.token_ns[-1]) + _AFTER_LAST_TOKEN_S * 1e9 <= span.end_ns


def test_without_traceparent_the_http_span_is_the_root_of_a_new_trace(
    vllm_stand_in: Setup, app: FastAPI
) -> None:
    for index in range(2):
        assert serve(app, "POST", "/v1/completions", id=f"cmpl-{index}").status_code == 200
    jobs = http_spans(vllm_stand_in)
    assert [job.parent_span_id for job in jobs] == [b"", b""]
    assert jobs[0].trace_id != jobs[1].trace_id
    by_request = {timer.request_id: timer for timer in vllm_stand_in.finished}
    for index, job in enumerate(jobs):
        assert job.fixed_ids is not None
        assert by_request[f"cmpl-{index}-internal"].trace_id == job.trace_id
        assert by_request[f"cmpl-{index}-internal"].parent_span_id == job.fixed_ids[0]


def test_the_budget_takes_http_and_postprocess_from_the_http_span(
    vllm_stand_in: Setup, app: FastAPI
) -> None:
    serve(app, "POST", "/v1/completions", id="cmpl-budget")
    spans = encoded(http_spans(vllm_stand_in), vllm_stand_in.finished, vllm_stand_in)
    (http,) = [span for span in spans if span.kind == Span.SPAN_KIND_SERVER]
    (timeline,) = normalize(trace(*spans))
    assert (timeline.server_start, timeline.server_end) == (
        http.start_time_unix_nano,
        http.end_time_unix_nano,
    )
    budget = compute_budget(timeline)
    assert timeline.engine_arrival is not None and timeline.last_token is not None
    assert (
        budget.segments[semconv.SEGMENT_HTTP] == timeline.engine_arrival - http.start_time_unix_nano
    )
    assert budget.segments[semconv.SEGMENT_HTTP] >= _BEFORE_ENGINE_S * 1e9
    assert budget.segments[semconv.SEGMENT_POSTPROCESS] >= _AFTER_LAST_TOKEN_S * 1e9
    assert budget.e2e_ns == http.end_time_unix_nano - http.start_time_unix_nano


def test_gets_are_not_traced(vllm_stand_in: Setup, app: FastAPI) -> None:
    assert serve(app, "GET", "/health").json() == {"status": "ok"}
    assert vllm_stand_in.http_jobs == []


def test_a_route_that_raises_is_an_error_span_and_the_server_still_answers_500(
    vllm_stand_in: Setup, app: FastAPI
) -> None:
    assert serve(app, "POST", "/boom").status_code == 500
    (job,) = http_spans(vllm_stand_in)
    (span,) = job.spans
    assert span.status_error == "RuntimeError"
    assert span.attributes[semconv.ERROR_TYPE] == "RuntimeError"
    assert span.attributes[semconv.HTTP_RESPONSE_STATUS_CODE] == 500
    assert span.name == "POST /boom"


def test_an_unknown_path_is_named_by_its_method_alone_and_is_no_server_error(
    vllm_stand_in: Setup, app: FastAPI
) -> None:
    assert serve(app, "POST", "/v1/nothing-here/123").status_code == 404
    (job,) = http_spans(vllm_stand_in)
    (span,) = job.spans
    assert span.name == "POST" and span.status_error is None
    assert semconv.HTTP_ROUTE not in span.attributes
    assert span.attributes[semconv.URL_PATH] == "/v1/nothing-here/123"
    assert vllm_stand_in.http_tracer.stats() == {"http_server_spans": 1}


def test_an_app_built_before_uninstrument_serves_untraced_after_it(
    vllm_stand_in: Setup, app: FastAPI
) -> None:
    serve(app, "POST", "/v1/completions", id="cmpl-traced")
    assert len(vllm_stand_in.http_jobs) == 1
    vllm_stand_in.instrumentor.uninstrument()
    response = serve(app, "POST", "/v1/completions", id="cmpl-untraced")
    assert response.status_code == 200
    assert len(vllm_stand_in.http_jobs) == 1
    assert [timer.request_id for timer in vllm_stand_in.finished] == ["cmpl-traced-internal"]


@pytest.mark.parametrize("method", ["begin", "end"])
def test_a_failing_http_hook_is_disabled_and_requests_are_served_and_traced_without_it(
    vllm_stand_in: Setup, app: FastAPI, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    def broken(*_args: Any) -> None:
        raise KeyError("a scope we misread")

    monkeypatch.setattr(HttpServerTracer, method, broken)
    caller = format_traceparent(_CALLER_TRACE_ID, _CALLER_SPAN_ID)
    for index in range(2):
        response = serve(
            app, "POST", "/v1/completions", headers={"traceparent": caller}, id=f"cmpl-{index}"
        )
        assert response.status_code == 200 and response.text
    assert vllm_stand_in.guard.failures == {HOOK_HTTP_SERVER: 1}
    assert vllm_stand_in.http_jobs == []
    # The engine's spans still join the caller's trace: through vLLM's forwarded headers once
    # the hook is disabled (and, when ``end`` failed, under the first request's unsent span).
    finished = vllm_stand_in.finished
    assert [t.trace_id for t in finished] == [_CALLER_TRACE_ID] * 2
    assert finished[-1].parent_span_id == _CALLER_SPAN_ID
    if method == "begin":
        assert finished[0].parent_span_id == _CALLER_SPAN_ID


def test_the_span_ends_when_the_response_was_sent_not_after_the_apps_background_work(
    vllm_stand_in: Setup, app: FastAPI
) -> None:
    started = time.monotonic()
    assert serve(app, "POST", "/v1/with-background").json() == {"ok": True}
    assert time.monotonic() - started >= _BACKGROUND_S  # the app returned after its task
    (job,) = http_spans(vllm_stand_in)
    (span,) = job.spans
    assert span.end_ns - span.start_ns < _BACKGROUND_S * 1e9


# --- behind a real uvicorn ------------------------------------------------------------------------
class TimingApp:
    """Routes whose timing the tests control: a stream that notes when it produced its first
    chunk, a route that blocks the event loop until told, and a quick one."""

    def __init__(self) -> None:
        self.first_chunk_ns: list[int] = []
        """Monotonic ns at which the stream produced its first chunk."""
        self.blocking = threading.Event()
        """Set when the blocking route has started."""
        self.release = threading.Event()
        """The blocking route waits for this, then blocks the loop for ``_LOOP_BLOCK_S`` more."""

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/stream")
        async def stream() -> StreamingResponse:
            async def chunks() -> AsyncIterator[bytes]:
                await asyncio.sleep(_BEFORE_FIRST_CHUNK_S)
                self.first_chunk_ns.append(time.monotonic_ns())
                yield b"data: 0\n\n"
                await asyncio.sleep(_BEFORE_FIRST_CHUNK_S)
                yield b"data: [DONE]\n\n"

            return StreamingResponse(chunks(), media_type="text/event-stream")

        @app.post("/block")
        async def block() -> JSONResponse:
            # A blocking call in an async route: the whole event loop stops, as under overload.
            self.blocking.set()
            self.release.wait(_SOCKET_TIMEOUT_S)
            time.sleep(_LOOP_BLOCK_S)
            return JSONResponse({"blocked": True})

        @app.post("/quick")
        async def quick() -> JSONResponse:
            return JSONResponse({"quick": True})

        return app


@contextlib.contextmanager
def uvicorn_serving(app: FastAPI, *, loop: str, http: str) -> Iterator[int]:
    """``app`` served by uvicorn on 127.0.0.1 in a thread; yields the port."""
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        loop=loop,
        http=http,
        log_level="warning",
        access_log=False,
        lifespan="off",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn-http-span", daemon=True)
    thread.start()
    deadline = time.monotonic() + _SOCKET_TIMEOUT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=_SOCKET_TIMEOUT_S)


def post_bytes(path: str) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        "Content-Length: 2\r\nConnection: close\r\n\r\n{}"
    ).encode()


def response_of(connection: socket.socket) -> bytes:
    """Everything the server sent until it closed the connection."""
    connection.settimeout(_SOCKET_TIMEOUT_S)
    parts = []
    while data := connection.recv(65536):
        parts.append(data)
    connection.close()
    return b"".join(parts)


def planned_by_path(setup: Setup, count: int) -> dict[str, list[Any]]:
    """Once ``count`` requests were traced: their planned spans by URL path, in order."""
    deadline = time.monotonic() + _SOCKET_TIMEOUT_S
    while len(setup.http_jobs) < count:  # the server thread submits after the app returned
        assert time.monotonic() < deadline, f"{len(setup.http_jobs)} of {count} spans"
        time.sleep(0.01)
    by_path: dict[str, list[Any]] = {}
    for job in http_spans(setup):
        (span,) = job.spans
        by_path.setdefault(str(span.attributes[semconv.URL_PATH]), []).append(span)
    return by_path


# The stdlib loop with h11 and uvloop with httptools (vLLM's default): both send callables are
# a bound RequestResponseCycle.send, and their transports' sockets differ in type.
SERVERS = [("asyncio", "h11"), ("uvloop", "httptools")]


@pytest.mark.parametrize(("loop", "http"), SERVERS)
def test_first_body_time_is_when_the_first_chunk_went_out(
    vllm_stand_in: Setup, loop: str, http: str
) -> None:
    vllm_stand_in.instrument()
    timing = TimingApp()
    with uvicorn_serving(timing.app(), loop=loop, http=http) as port:
        response = httpx.post(f"http://127.0.0.1:{port}/stream", json={}, timeout=10)
        assert response.status_code == 200 and response.text.endswith("[DONE]\n\n")
        (span,) = planned_by_path(vllm_stand_in, 1)["/stream"]
    first_body = span.attributes[semconv.HTTP_FIRST_BODY_TIME]
    assert isinstance(first_body, int)
    assert span.start_ns < first_body <= span.end_ns
    (produced_ns,) = timing.first_chunk_ns
    assert first_body >= vllm_stand_in.http_clock.to_unix_ns(produced_ns)
    # The route's sleeps on both sides of it (uvloop's timers may fire up to a ms early).
    assert first_body - span.start_ns >= _BEFORE_FIRST_CHUNK_S * 1e9 * 0.8
    assert span.end_ns - first_body >= _BEFORE_FIRST_CHUNK_S * 1e9 * 0.8


@pytest.mark.parametrize(("loop", "http"), SERVERS)
def test_receive_wait_is_how_long_a_request_waited_for_a_busy_event_loop(
    vllm_stand_in: Setup, loop: str, http: str
) -> None:
    vllm_stand_in.instrument()
    timing = TimingApp()
    with uvicorn_serving(timing.app(), loop=loop, http=http) as port:
        blocker = socket.create_connection(("127.0.0.1", port), timeout=_SOCKET_TIMEOUT_S)
        blocker.sendall(post_bytes("/block"))
        assert timing.blocking.wait(_SOCKET_TIMEOUT_S), "the blocking route did not start"
        # Its bytes reach the server's kernel while the server's loop is blocked.
        waiting = socket.create_connection(("127.0.0.1", port), timeout=_SOCKET_TIMEOUT_S)
        waiting.sendall(post_bytes("/quick"))
        timing.release.set()
        assert b'{"blocked":true}' in response_of(blocker)
        assert b'{"quick":true}' in response_of(waiting)
        unloaded = socket.create_connection(("127.0.0.1", port), timeout=_SOCKET_TIMEOUT_S)
        unloaded.sendall(post_bytes("/quick"))
        assert b'{"quick":true}' in response_of(unloaded)
        spans = planned_by_path(vllm_stand_in, 3)
    (blocking,) = spans["/block"]
    waited, after = spans["/quick"]
    # Kernel ticks are up to 10 ms; the loop was blocked for _LOOP_BLOCK_S after the bytes came.
    assert waited.attributes[semconv.HTTP_RECEIVE_WAIT_NS] >= 200 * _NS_PER_MS
    for idle in (blocking, after):  # arrived at an idle loop: measured, and small
        assert 0 <= idle.attributes[semconv.HTTP_RECEIVE_WAIT_NS] < 50 * _NS_PER_MS
    assert vllm_stand_in.guard.failures == {}


def test_with_the_receive_wait_turned_off_no_socket_is_read_and_the_span_has_none(
    vllm_stand_in: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unexpected(send: object) -> None:
        raise AssertionError("the receive wait was read")

    monkeypatch.setattr(asgi, "_receive_wait_ns", unexpected)
    vllm_stand_in.http_tracer.receive_wait = False
    vllm_stand_in.instrument()
    with uvicorn_serving(TimingApp().app(), loop="uvloop", http="httptools") as port:
        response = httpx.post(f"http://127.0.0.1:{port}/quick", json={}, timeout=10)
        assert response.status_code == 200
        (span,) = planned_by_path(vllm_stand_in, 1)["/quick"]
    assert semconv.HTTP_RECEIVE_WAIT_NS not in span.attributes
    assert span.attributes[semconv.HTTP_RESPONSE_STATUS_CODE] == 200
    assert vllm_stand_in.guard.failures == {}


class _RaisingTransport:
    def get_extra_info(self, name: str) -> Any:
        raise RuntimeError("not a transport we know")


class _SocketlessTransport:
    def get_extra_info(self, name: str) -> Any:
        return None


class _UnixTransport:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def get_extra_info(self, name: str) -> Any:
        return self.sock


class _LookalikeCycle:
    """A server whose ``send`` is a bound method of an object with a ``transport``, like
    uvicorn's, whose transport is something else."""

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self.messages: list[dict[str, Any]] = []

    async def send(self, message: dict[str, Any]) -> None:
        self.messages.append(message)


@pytest.mark.parametrize("transport", ["raising", "socketless", "unix", "none"])
def test_a_send_that_is_not_uvicorns_gives_no_receive_wait_and_never_fails(
    vllm_stand_in: Setup, transport: str
) -> None:
    vllm_stand_in.instrument()
    app = TimingApp().app()
    unix, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    transports = {
        "raising": _RaisingTransport(),
        "socketless": _SocketlessTransport(),
        "unix": _UnixTransport(unix),
        "none": None,
    }
    cycle = _LookalikeCycle(transports[transport])
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/quick",
        "raw_path": b"/quick",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    with unix, peer:
        asyncio.run(app(scope, receive, cycle.send))
    assert [message["type"] for message in cycle.messages] == [
        "http.response.start",
        "http.response.body",
    ]
    (job,) = http_spans(vllm_stand_in)
    (span,) = job.spans
    assert semconv.HTTP_RECEIVE_WAIT_NS not in span.attributes
    assert span.attributes[semconv.HTTP_RESPONSE_STATUS_CODE] == 200
    assert span.start_ns <= span.attributes[semconv.HTTP_FIRST_BODY_TIME] <= span.end_ns
    assert vllm_stand_in.guard.failures == {}
