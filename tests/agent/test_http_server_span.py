"""The HTTP server span (``agent/frameworks/asgi.py``) through the vLLM instrumentor's patch of
the real Starlette, on a real FastAPI app that drives the stand-in vLLM frontend the way vLLM's
OpenAI server does: ``add_request`` in the request's task, outputs while the response streams.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
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
from tokentrace.agent.frameworks.asgi import HOOK_HTTP_SERVER, HttpServerTracer
from tokentrace.agent.recorder import RequestTimer, to_recording
from tokentrace.agent.spans import RecordingEncoder, SpanJob, format_traceparent
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
    encoder = RecordingEncoder(resource_attributes={"service.name": "t"}, scope_name="t")
    recordings = [to_recording(timer, setup.http_clock) for timer in timers]
    payload, count = encoder.encode(recordings, jobs)
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
    assert span.kind == 2 and span.name == "POST /v1/completions" and span.error is None
    assert span.attributes == {
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
    assert timeline.arrival is not None and timeline.last_token is not None
    assert budget.segments[semconv.SEGMENT_HTTP] == timeline.arrival - http.start_time_unix_nano
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
    assert span.error == "RuntimeError"
    assert span.attributes[semconv.ERROR_TYPE] == "RuntimeError"
    assert span.attributes[semconv.HTTP_RESPONSE_STATUS_CODE] == 500
    assert span.name == "POST /boom"


def test_an_unknown_path_is_named_by_its_method_alone_and_is_no_server_error(
    vllm_stand_in: Setup, app: FastAPI
) -> None:
    assert serve(app, "POST", "/v1/nothing-here/123").status_code == 404
    (job,) = http_spans(vllm_stand_in)
    (span,) = job.spans
    assert span.name == "POST" and span.error is None
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


def test_a_failing_http_hook_is_disabled_and_requests_are_served_and_traced_without_it(
    vllm_stand_in: Setup, app: FastAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: HttpServerTracer, scope: Any) -> None:
        raise KeyError("a scope we misread")

    monkeypatch.setattr(HttpServerTracer, "begin", broken)
    caller = format_traceparent(_CALLER_TRACE_ID, _CALLER_SPAN_ID)
    for index in range(2):
        response = serve(
            app, "POST", "/v1/completions", headers={"traceparent": caller}, id=f"cmpl-{index}"
        )
        assert response.status_code == 200
    assert vllm_stand_in.guard.failures == {HOOK_HTTP_SERVER: 1}
    assert vllm_stand_in.http_jobs == []
    # The engine's spans still join the caller's trace, through vLLM's forwarded headers.
    assert [(t.trace_id, t.parent_span_id) for t in vllm_stand_in.finished] == [
        (_CALLER_TRACE_ID, _CALLER_SPAN_ID)
    ] * 2


def test_the_span_ends_when_the_response_was_sent_not_after_the_apps_background_work(
    vllm_stand_in: Setup, app: FastAPI
) -> None:
    started = time.monotonic()
    assert serve(app, "POST", "/v1/with-background").json() == {"ok": True}
    assert time.monotonic() - started >= _BACKGROUND_S  # the app returned after its task
    (job,) = http_spans(vllm_stand_in)
    (span,) = job.spans
    assert span.end_ns - span.start_ns < _BACKGROUND_S * 1e9
