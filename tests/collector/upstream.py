"""A real OTLP receiver on loopback for tests: what an upstream tracing/metrics backend sees.

It speaks OTLP/gRPC (the generated ``*_service_pb2_grpc`` servicers) and OTLP/HTTP with protobuf
bodies (``http.server``) and records every ``ExportTraceServiceRequest`` and
``ExportMetricsServiceRequest`` it accepts. Knobs let a test fail the next N calls (gRPC status /
HTTP status, optionally with RetryInfo / Retry-After), report partial success, delay every call,
or hold calls until released. It deliberately shares no code with the collector's own receivers.

Usage::

    with UpstreamOtlp() as upstream:
        exporter = OtlpTraceExporter(OtlpExporterConfig(endpoint=upstream.grpc_endpoint, ...))
        ...
        upstream.wait_for_spans(10)
"""

from __future__ import annotations

import datetime
import gzip
import http.server
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import grpc
from google.protobuf.duration_pb2 import Duration
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tokentrace.agent.otlp_config import OtlpExporterConfig, RetryConfig

_TRACES_PATH = "/v1/traces"
_METRICS_PATH = "/v1/metrics"
_WAIT_TIMEOUT_S = 5.0
_HOLD_TIMEOUT_S = 30.0
"""A held call gives up after this long so that a forgotten ``release()`` cannot hang a test."""


@dataclass(slots=True)
class ReceivedCall:
    """One export call as the upstream saw it, accepted or failed."""

    transport: str
    """``grpc`` | ``http``."""
    signal: str
    """``traces`` | ``metrics``."""
    headers: dict[str, str]
    """gRPC invocation metadata or HTTP request headers, keys lower-cased."""
    accepted: bool


@dataclass(slots=True)
class _Failure:
    grpc_code: grpc.StatusCode
    http_status: int
    retry_after_s: float | None


@dataclass(slots=True)
class _State:
    """Everything the two servers share, guarded by ``lock``."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    changed: threading.Condition = field(init=False)
    calls: list[ReceivedCall] = field(default_factory=list)
    trace_requests: list[trace_service_pb2.ExportTraceServiceRequest] = field(default_factory=list)
    metric_requests: list[metrics_service_pb2.ExportMetricsServiceRequest] = field(
        default_factory=list
    )
    failures: list[_Failure] = field(default_factory=list)
    rejections: list[tuple[int, str]] = field(default_factory=list)
    delay_s: float = 0.0
    started_calls: int = 0
    gate: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.changed = threading.Condition(self.lock)
        self.gate.set()


@dataclass(slots=True)
class _Decision:
    """What to answer to one call, decided before it is recorded."""

    failure: _Failure | None
    rejected: int = 0
    rejection_message: str = ""


class UpstreamOtlp:
    """OTLP/gRPC + OTLP/HTTP receiver on 127.0.0.1 with ephemeral ports, recording requests."""

    def __init__(self, *, grpc_workers: int = 4) -> None:
        self._state = _State()
        self._grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=grpc_workers))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(
            _TraceServicer(self), self._grpc_server
        )
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(
            _MetricsServicer(self), self._grpc_server
        )
        self.grpc_port = self._grpc_server.add_insecure_port("127.0.0.1:0")
        self._http_server = http.server.ThreadingHTTPServer(
            ("127.0.0.1", 0), _make_http_handler(self)
        )
        self._http_server.daemon_threads = True
        self.http_port = int(self._http_server.server_address[1])
        self._http_thread: threading.Thread | None = None

    # --- lifecycle -----------------------------------------------------------------------------
    def start(self) -> UpstreamOtlp:
        self._grpc_server.start()
        self._http_thread = threading.Thread(
            target=self._http_server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="upstream-otlp-http",
            daemon=True,
        )
        self._http_thread.start()
        return self

    def stop(self) -> None:
        self.release()
        self._grpc_server.stop(grace=None)
        self._http_server.shutdown()
        self._http_server.server_close()
        if self._http_thread is not None:
            self._http_thread.join(timeout=_WAIT_TIMEOUT_S)

    def __enter__(self) -> UpstreamOtlp:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        """Base URL; the exporter appends ``/v1/traces`` or ``/v1/metrics``."""
        return f"http://127.0.0.1:{self.http_port}"

    # --- knobs ---------------------------------------------------------------------------------
    def fail_next(
        self,
        count: int,
        *,
        grpc_code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
        http_status: int = 503,
        retry_after_s: float | None = None,
    ) -> None:
        """Fail the next ``count`` calls (either transport, either signal).

        ``retry_after_s`` adds gRPC RetryInfo (in ``grpc-status-details-bin``) or an HTTP
        ``Retry-After`` header (whole seconds, rounded up).
        """
        with self._state.lock:
            self._state.failures.extend(
                _Failure(grpc_code, http_status, retry_after_s) for _ in range(count)
            )

    def fail_forever(self, *, grpc_code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        """Fail every call from now on (a very large ``fail_next``)."""
        self.fail_next(1_000_000, grpc_code=grpc_code)

    def reject_next(self, rejected: int, message: str = "rejected by test") -> None:
        """Answer the next accepted call with a partial success rejecting ``rejected`` items."""
        with self._state.lock:
            self._state.rejections.append((rejected, message))

    def set_delay(self, delay_s: float) -> None:
        """Sleep this long in every call before answering."""
        with self._state.lock:
            self._state.delay_s = delay_s

    def hold(self) -> None:
        """Make every call wait (after it is counted as started) until ``release()``."""
        self._state.gate.clear()

    def release(self) -> None:
        self._state.gate.set()

    # --- what arrived --------------------------------------------------------------------------
    @property
    def calls(self) -> list[ReceivedCall]:
        with self._state.lock:
            return list(self._state.calls)

    @property
    def trace_requests(self) -> list[trace_service_pb2.ExportTraceServiceRequest]:
        with self._state.lock:
            return list(self._state.trace_requests)

    @property
    def metric_requests(self) -> list[metrics_service_pb2.ExportMetricsServiceRequest]:
        with self._state.lock:
            return list(self._state.metric_requests)

    @property
    def started_calls(self) -> int:
        """Calls that reached the handler (including ones still held or delayed)."""
        with self._state.lock:
            return self._state.started_calls

    def span_count(self) -> int:
        return sum(
            len(scope_spans.spans)
            for request in self.trace_requests
            for resource_spans in request.resource_spans
            for scope_spans in resource_spans.scope_spans
        )

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float = _WAIT_TIMEOUT_S) -> bool:
        """Wait until ``predicate()`` holds, re-checking after every call; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            with self._state.changed:
                # The short cap covers a notification that lands between check and wait.
                self._state.changed.wait(min(remaining, 0.05))
        return True

    def wait_for_spans(self, count: int, timeout_s: float = _WAIT_TIMEOUT_S) -> bool:
        return self.wait_for(lambda: self.span_count() >= count, timeout_s)

    def wait_for_started_calls(self, count: int, timeout_s: float = _WAIT_TIMEOUT_S) -> bool:
        return self.wait_for(lambda: self.started_calls >= count, timeout_s)

    # --- shared by both transports -------------------------------------------------------------
    def _begin_call(self) -> _Decision:
        """Count the call, apply delay/hold, and decide its outcome (failure or partial success)."""
        state = self._state
        with state.changed:
            state.started_calls += 1
            delay_s = state.delay_s
            state.changed.notify_all()
        if delay_s > 0:
            time.sleep(delay_s)
        state.gate.wait(_HOLD_TIMEOUT_S)
        with state.lock:
            if state.failures:
                return _Decision(failure=state.failures.pop(0))
            if state.rejections:
                rejected, message = state.rejections.pop(0)
                return _Decision(failure=None, rejected=rejected, rejection_message=message)
        return _Decision(failure=None)

    def _record(
        self,
        *,
        transport: str,
        signal: str,
        headers: dict[str, str],
        request: trace_service_pb2.ExportTraceServiceRequest
        | metrics_service_pb2.ExportMetricsServiceRequest
        | None,
    ) -> None:
        with self._state.changed:
            self._state.calls.append(
                ReceivedCall(
                    transport=transport,
                    signal=signal,
                    headers=headers,
                    accepted=request is not None,
                )
            )
            if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
                self._state.trace_requests.append(request)
            elif isinstance(request, metrics_service_pb2.ExportMetricsServiceRequest):
                self._state.metric_requests.append(request)
            self._state.changed.notify_all()


def _grpc_abort(context: grpc.ServicerContext, failure: _Failure) -> None:
    if failure.retry_after_s is not None:
        delay = Duration()
        delay.FromTimedelta(datetime.timedelta(seconds=failure.retry_after_s))
        status = status_pb2.Status(code=failure.grpc_code.value[0], message="test failure")
        status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        context.set_trailing_metadata((("grpc-status-details-bin", status.SerializeToString()),))
    context.abort(failure.grpc_code, "test failure")


def _metadata_dict(context: grpc.ServicerContext) -> dict[str, str]:
    return {
        key.lower(): value if isinstance(value, str) else value.decode("latin-1")
        for key, value in context.invocation_metadata()
    }


class _TraceServicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, upstream: UpstreamOtlp) -> None:
        self._upstream = upstream

    def Export(
        self,
        request: trace_service_pb2.ExportTraceServiceRequest,
        context: grpc.ServicerContext,
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        decision = self._upstream._begin_call()
        headers = _metadata_dict(context)
        if decision.failure is not None:
            self._upstream._record(transport="grpc", signal="traces", headers=headers, request=None)
            _grpc_abort(context, decision.failure)
        self._upstream._record(transport="grpc", signal="traces", headers=headers, request=request)
        response = trace_service_pb2.ExportTraceServiceResponse()
        if decision.rejected:
            response.partial_success.rejected_spans = decision.rejected
            response.partial_success.error_message = decision.rejection_message
        return response


class _MetricsServicer(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, upstream: UpstreamOtlp) -> None:
        self._upstream = upstream

    def Export(
        self,
        request: metrics_service_pb2.ExportMetricsServiceRequest,
        context: grpc.ServicerContext,
    ) -> metrics_service_pb2.ExportMetricsServiceResponse:
        decision = self._upstream._begin_call()
        headers = _metadata_dict(context)
        if decision.failure is not None:
            self._upstream._record(
                transport="grpc", signal="metrics", headers=headers, request=None
            )
            _grpc_abort(context, decision.failure)
        self._upstream._record(transport="grpc", signal="metrics", headers=headers, request=request)
        response = metrics_service_pb2.ExportMetricsServiceResponse()
        if decision.rejected:
            response.partial_success.rejected_data_points = decision.rejected
            response.partial_success.error_message = decision.rejection_message
        return response


def _make_http_handler(upstream: UpstreamOtlp) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as real backends do

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            body = self.rfile.read(length)
            headers = {key.lower(): value for key, value in self.headers.items()}
            if self.path == _TRACES_PATH:
                signal = "traces"
            elif self.path == _METRICS_PATH:
                signal = "metrics"
            else:
                self._answer(404, b"")
                return
            decision = upstream._begin_call()
            if decision.failure is not None:
                upstream._record(transport="http", signal=signal, headers=headers, request=None)
                extra: dict[str, str] = {}
                if decision.failure.retry_after_s is not None:
                    extra["Retry-After"] = str(max(1, round(decision.failure.retry_after_s + 0.49)))
                self._answer(decision.failure.http_status, b"test failure", extra)
                return
            if headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            request: (
                trace_service_pb2.ExportTraceServiceRequest
                | metrics_service_pb2.ExportMetricsServiceRequest
            )
            if signal == "traces":
                request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                trace_response = trace_service_pb2.ExportTraceServiceResponse()
                if decision.rejected:
                    trace_response.partial_success.rejected_spans = decision.rejected
                    trace_response.partial_success.error_message = decision.rejection_message
                payload = trace_response.SerializeToString()
            else:
                request = metrics_service_pb2.ExportMetricsServiceRequest.FromString(body)
                metric_response = metrics_service_pb2.ExportMetricsServiceResponse()
                if decision.rejected:
                    metric_response.partial_success.rejected_data_points = decision.rejected
                    metric_response.partial_success.error_message = decision.rejection_message
                payload = metric_response.SerializeToString()
            upstream._record(transport="http", signal=signal, headers=headers, request=request)
            self._answer(200, payload, {"Content-Type": "application/x-protobuf"})

        def _answer(self, status: int, body: bytes, extra: dict[str, str] | None = None) -> None:
            self.send_response(status)
            for key, value in (extra or {}).items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            """Quiet: tests read ``upstream.calls`` instead of stderr."""

    return Handler


def iter_spans(
    requests: list[trace_service_pb2.ExportTraceServiceRequest],
) -> Iterator[tuple[Resource, InstrumentationScope, Span]]:
    """Every (resource, scope, span) in ``requests``."""
    for request in requests:
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    yield resource_spans.resource, scope_spans.scope, span


def endpoint_of(upstream: UpstreamOtlp, protocol: str) -> str:
    """The receiver's endpoint for an OTLP exporter speaking ``protocol``."""
    return upstream.grpc_endpoint if protocol == "grpc" else upstream.http_endpoint


PROTOCOLS = ["grpc", "http/protobuf"]
TINY_RETRY = RetryConfig(initial_interval_s=0.01, max_interval_s=0.02, max_elapsed_s=2.0)
"""Retry timings short enough that retry tests take milliseconds."""
FLUSH_S = 5.0


def exporter_options(endpoint: str, protocol: str, **overrides: Any) -> dict[str, Any]:
    """Keyword options of an OTLP exporter config aimed at this receiver, with test timings."""
    return {
        "endpoint": endpoint,
        "protocol": protocol,
        "timeout_s": 2.0,
        "retry": TINY_RETRY,
        **overrides,
    }


def make_config(endpoint: str, protocol: str, **overrides: Any) -> OtlpExporterConfig:
    return OtlpExporterConfig(**exporter_options(endpoint, protocol, **overrides))
