"""The proxy in-process (its own event loop on a thread), an agent exporting to a real OTLP
receiver (``UpstreamOtlp``), and helpers to read the spans it received."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tests.collector.upstream import UpstreamOtlp
from tokentrace.agent import semconv
from tokentrace.agent.config import load_agent_config
from tokentrace.agent.proxy import ProxyServer
from tokentrace.agent.runtime import AgentRuntime

_TIMEOUT_S = 10.0


def agent_runtime(upstream: UpstreamOtlp) -> AgentRuntime:
    return AgentRuntime(
        load_agent_config(
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": upstream.grpc_endpoint,
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                "OTEL_SERVICE_NAME": "proxy-test",
            }
        )
    )


@contextmanager
def running_proxy(
    upstream_url: str, *, runtime: AgentRuntime | None, engine: str = "auto"
) -> Iterator[ProxyServer]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="proxy-loop", daemon=True)
    thread.start()
    proxy = ProxyServer(upstream_url, runtime=runtime, engine=engine)
    try:
        asyncio.run_coroutine_threadsafe(proxy.start(), loop).result(_TIMEOUT_S)
        yield proxy
    finally:
        asyncio.run_coroutine_threadsafe(proxy.close(), loop).result(_TIMEOUT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(_TIMEOUT_S)
        loop.close()


def proxy_url(proxy: ProxyServer) -> str:
    return f"http://127.0.0.1:{proxy.port}"


def received_spans(upstream: UpstreamOtlp) -> list[Span]:
    return [
        span
        for request in upstream.trace_requests
        for resource_spans in request.resource_spans
        for scope_spans in resource_spans.scope_spans
        for span in scope_spans.spans
    ]


def attributes(span: Span) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for kv in span.attributes:
        kind = kv.value.WhichOneof("value")
        if kind == "array_value":
            values[kv.key] = [
                getattr(v, v.WhichOneof("value") or "string_value")
                for v in kv.value.array_value.values
            ]
        else:
            values[kv.key] = getattr(kv.value, kind or "string_value")
    return values


def request_tree(upstream: UpstreamOtlp, runtime: AgentRuntime, trace_id: bytes) -> dict[str, Span]:
    """The request's spans by name (HTTP span under ``"http"``), once all six arrived."""
    runtime.flush()

    def tree() -> dict[str, Span]:
        spans = [s for s in received_spans(upstream) if s.trace_id == trace_id]
        named = {s.name: s for s in spans}
        for span in spans:
            if span.kind == Span.SPAN_KIND_SERVER:
                named["http"] = span
        return named

    upstream.wait_for(lambda: {"http", semconv.SPAN_REQUEST}.issubset(tree()), timeout_s=_TIMEOUT_S)
    return tree()


def trace_of(upstream: UpstreamOtlp, runtime: AgentRuntime, count: int) -> list[bytes]:
    """The trace ids of the received ``llm.request`` spans, once ``count`` arrived."""
    runtime.flush()

    def ids() -> list[bytes]:
        return [s.trace_id for s in received_spans(upstream) if s.name == semconv.SPAN_REQUEST]

    upstream.wait_for(lambda: len(ids()) >= count, timeout_s=_TIMEOUT_S)
    return ids()
