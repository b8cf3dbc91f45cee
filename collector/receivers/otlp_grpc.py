"""OTLP/gRPC trace receiver (``opentelemetry.proto.collector.trace.v1.TraceService/Export``).

Status mapping (OTLP 1.x): invalid spans -> OK with ``partial_success``; undecodable request ->
INVALID_ARGUMENT (the receiver parses the bytes itself, so a bad payload never reaches grpc's
deserializer, which would answer INTERNAL and log a traceback); consumer Overloaded ->
RESOURCE_EXHAUSTED with a ``google.rpc.RetryInfo`` (retryable only with it, per the spec);
Unavailable -> UNAVAILABLE; any other consumer error -> INTERNAL; bad bearer token ->
UNAUTHENTICATED. Oversized messages are answered by grpc itself (RESOURCE_EXHAUSTED) before the
servicer runs; compressed messages (gzip) reach it decompressed.

Client errors are logged without a traceback, at most one line per reason per
``_LOG_INTERVAL_S`` (with the number suppressed); the counters in ``stats()`` carry the totals.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc
from google.protobuf.any_pb2 import Any as AnyMessage
from google.protobuf.duration_pb2 import Duration
from google.protobuf.message import DecodeError
from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tokentrace.collector.consumer import Overloaded, TraceConsumer, Unavailable
from tokentrace.collector.receivers import (
    ConsumerFailed,
    OtlpReceiverBase,
    ReceiverCounters,
    ReceiverStartError,
    bearer_token_matches,
    deliver,
)
from tokentrace.collector.receivers.validate import DEFAULT_SPAN_LIMITS, SpanLimits

__all__ = ["OtlpGrpcReceiver", "ReceiverStartError"]

_log = logging.getLogger(__name__)

_DEFAULT_ENDPOINT = "127.0.0.1:4317"
_DEFAULT_MAX_RECV_MSG_SIZE = 4 * 1024 * 1024
_DEFAULT_MAX_WORKERS = 4
# RPCs queued or running at once; grpc answers RESOURCE_EXHAUSTED beyond it (bounded memory).
_DEFAULT_MAX_CONCURRENT_RPCS = 64
_DEFAULT_SHUTDOWN_GRACE_S = 5.0

# The standard place for error details (read by the Go/Java/.NET exporters) ...
_STATUS_DETAILS_KEY = "grpc-status-details-bin"
# ... and the key the Python OTLP exporter reads RetryInfo from.
_RETRY_INFO_KEY = "google.rpc.retryinfo-bin"

_SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
_LOG_INTERVAL_S = 10.0
"""At most one log line per reason (undecodable request, receiver error) in this many seconds."""


class _RateLimitedLog:
    """One line per reason at most every ``interval_s``, saying how many were suppressed."""

    def __init__(
        self, interval_s: float = _LOG_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def log(
        self, level: int, reason: str, message: str, *args: object, exc_info: bool = False
    ) -> None:
        with self._lock:
            now = self._clock()
            last = self._last.get(reason)
            if last is not None and now - last < self._interval_s:
                self._suppressed[reason] = self._suppressed.get(reason, 0) + 1
                return
            self._last[reason] = now
            suppressed = self._suppressed.pop(reason, 0)
        if suppressed:
            message += " (%d more since the last such line)"
            args += (suppressed,)
        _log.log(level, message, *args, exc_info=exc_info)


def _retry_info_trailers(
    message: str, retry_after_s: float
) -> tuple[tuple[str, bytes], tuple[str, bytes]]:
    delay = Duration()
    seconds = max(0.0, retry_after_s) if math.isfinite(retry_after_s) else 1.0
    delay.FromNanoseconds(int(seconds * 1e9))
    retry_info = error_details_pb2.RetryInfo(retry_delay=delay)
    detail = AnyMessage()
    detail.Pack(retry_info)
    status = status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message=message, details=[detail])
    return (
        (_STATUS_DETAILS_KEY, status.SerializeToString()),
        (_RETRY_INFO_KEY, retry_info.SerializeToString()),
    )


class _TraceServicer:
    """``Export`` on the request's raw bytes (registered without a request deserializer)."""

    def __init__(
        self,
        consumer: TraceConsumer,
        counters: ReceiverCounters,
        auth_token: str | None,
        log: _RateLimitedLog,
        span_limits: SpanLimits,
    ) -> None:
        self._consumer = consumer
        self._counters = counters
        self._auth_token = auth_token
        self._log = log
        self._span_limits = span_limits

    def Export(self, data: bytes, context: grpc.ServicerContext) -> ExportTraceServiceResponse:
        if self._auth_token is not None and not self._authorized(context):
            self._counters.add("unauthenticated_requests")
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
        try:
            request = ExportTraceServiceRequest.FromString(data)
        except (DecodeError, RecursionError, ValueError) as error:
            # The client's fault: one rate-limited line, no traceback.
            self._counters.add("malformed_requests")
            self._log.log(
                logging.WARNING,
                "undecodable",
                "OTLP gRPC receiver: undecodable %d-byte export request from %s answered "
                "INVALID_ARGUMENT (%s)",
                len(data),
                context.peer(),
                error,
            )
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "request is not a valid ExportTraceServiceRequest protobuf",
            )
        try:
            # The bytes as received: the spool keeps them when validation changed nothing.
            return deliver(
                self._consumer,
                request,
                self._counters,
                encoded=data,
                limits=self._span_limits,
            )
        except Overloaded as refusal:
            message = str(refusal) or "collector overloaded"
            context.set_trailing_metadata(_retry_info_trailers(message, refusal.retry_after_s))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        except Unavailable as refusal:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(refusal) or "collector unavailable")
        except ConsumerFailed as failure:
            context.abort(grpc.StatusCode.INTERNAL, str(failure))
        except Exception:
            # Not the consumer: a receiver bug. Still answer, never take the server down.
            self._counters.add("failed_requests")
            self._log.log(
                logging.ERROR,
                "receiver error",
                "OTLP gRPC export failed inside the receiver",
                exc_info=True,
            )
            context.abort(grpc.StatusCode.INTERNAL, "receiver error")

    def _authorized(self, context: grpc.ServicerContext) -> bool:
        assert self._auth_token is not None
        for key, value in context.invocation_metadata():
            if key == "authorization" and isinstance(value, str):
                return bearer_token_matches(value, self._auth_token)
        return False


class OtlpGrpcReceiver(OtlpReceiverBase):
    """Serves OTLP/gRPC trace exports and hands valid spans to ``consumer``.

    Binds loopback by default; TLS (both files) and a bearer token are opt-in. ``port`` is the
    bound port after ``start()`` (endpoint port 0 picks a free one). At most
    ``max_concurrent_rpcs`` exports are queued or running; grpc refuses more with
    RESOURCE_EXHAUSTED (not counted in ``stats()``, like oversized messages; undecodable ones
    are answered INVALID_ARGUMENT here and counted as ``malformed_requests``).
    """

    def __init__(
        self,
        consumer: TraceConsumer,
        *,
        endpoint: str = _DEFAULT_ENDPOINT,
        max_recv_msg_size: int = _DEFAULT_MAX_RECV_MSG_SIZE,
        max_workers: int = _DEFAULT_MAX_WORKERS,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
        auth_token: str | None = None,
        max_concurrent_rpcs: int = _DEFAULT_MAX_CONCURRENT_RPCS,
        span_limits: SpanLimits = DEFAULT_SPAN_LIMITS,
    ) -> None:
        super().__init__(
            consumer,
            endpoint=endpoint,
            auth_token=auth_token,
            tls_cert_file=tls_cert_file,
            tls_key_file=tls_key_file,
            span_limits=span_limits,
        )
        if max_recv_msg_size <= 0 or max_workers <= 0 or max_concurrent_rpcs < max_workers:
            raise ValueError(
                "max_recv_msg_size and max_workers must be positive, "
                "max_concurrent_rpcs at least max_workers"
            )
        self._max_recv_msg_size = max_recv_msg_size
        self._max_workers = max_workers
        self._max_concurrent_rpcs = max_concurrent_rpcs
        self._server: grpc.Server | None = None
        self._log = _RateLimitedLog()

    def start(self) -> None:
        """Bind and serve in grpc's threads; raises ReceiverStartError if binding fails."""
        if self._server is not None:
            raise RuntimeError("receiver already started")
        self._bind_address()  # reject malformed endpoints with a clear message
        credentials = self._server_credentials()
        server = grpc.server(
            futures.ThreadPoolExecutor(
                max_workers=self._max_workers, thread_name_prefix="otlp-grpc"
            ),
            options=[
                ("grpc.max_receive_message_length", self._max_recv_msg_size),
                # grpc sets SO_REUSEPORT by default, which would let a second receiver
                # "bind" a port that is already serving and silently split its traffic.
                ("grpc.so_reuseport", 0),
            ],
            maximum_concurrent_rpcs=self._max_concurrent_rpcs,
        )
        servicer = _TraceServicer(
            self._consumer, self._counters, self._auth_token, self._log, self._span_limits
        )
        export = grpc.unary_unary_rpc_method_handler(
            servicer.Export,
            request_deserializer=None,  # raw bytes: Export parses them, INVALID_ARGUMENT if bad
            response_serializer=ExportTraceServiceResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(_SERVICE, {"Export": export}),)
        )
        try:
            if credentials is None:
                port = server.add_insecure_port(self._endpoint)
            else:
                port = server.add_secure_port(self._endpoint, credentials)
        except RuntimeError as error:  # grpc >= 1.5x raises on bind failure
            server.stop(None)
            raise ReceiverStartError(
                f"OTLP gRPC receiver cannot bind {self._endpoint}: {error}"
            ) from error
        if port == 0:  # older grpc signals a bind failure this way
            server.stop(None)
            raise ReceiverStartError(
                f"OTLP gRPC receiver cannot bind {self._endpoint} (address in use or invalid)"
            )
        server.start()
        self._server = server
        self._port = port
        _log.debug("OTLP gRPC receiver listening on %s (port %d)", self._endpoint, port)

    def shutdown(self, grace_s: float = _DEFAULT_SHUTDOWN_GRACE_S) -> None:
        """Stop accepting, let in-flight exports finish for up to ``grace_s``. Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.stop(grace_s).wait()

    def _server_credentials(self) -> grpc.ServerCredentials | None:
        if self._tls_cert_file is None or self._tls_key_file is None:
            return None
        try:
            certificate_chain = Path(self._tls_cert_file).read_bytes()
            private_key = Path(self._tls_key_file).read_bytes()
        except OSError as error:
            raise ReceiverStartError(
                f"OTLP gRPC receiver on {self._endpoint}: cannot read TLS files: {error}"
            ) from error
        return grpc.ssl_server_credentials([(private_key, certificate_chain)])
