"""OTLP trace receivers (gRPC and HTTP) and what they share.

The receivers themselves live in :mod:`.otlp_grpc` and :mod:`.otlp_http`; this module stays light
(no grpc import) so that either can be used alone.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import threading
from dataclasses import dataclass

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tokentrace.collector.consumer import Overloaded, TraceConsumer, Unavailable
from tokentrace.collector.receivers.validate import DEFAULT_SPAN_LIMITS, SpanLimits, sanitize

__all__ = [
    "ConsumerFailed",
    "ReceiverCounters",
    "ReceiverStartError",
    "ValidExport",
    "bearer_token_matches",
    "count_spans",
    "deliver",
    "hand_over",
    "join_endpoint",
    "split_endpoint",
    "validate_export",
]

_log = logging.getLogger(__name__)


class ReceiverStartError(RuntimeError):
    """A receiver could not bind its endpoint (port taken, bad address, unreadable TLS files)."""


class ConsumerFailed(Exception):
    """The consumer raised something other than Overloaded/Unavailable (already logged)."""


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6addr]:port"`` -> (host without brackets, port); raises
    ValueError ``"expected HOST:PORT, got '...'"``.

    The one parser of a listening endpoint: the receivers bind with it (here, so that the node
    agent, which may load the receivers but not the rest of the collector, shares it), and the
    collector's config checks (``component.check_endpoint``) and describes its endpoints with it.
    """
    host, sep, port = endpoint.rpartition(":")
    if not (sep and host and port.isascii() and port.isdigit() and int(port) <= 65535):
        raise ValueError(f"expected HOST:PORT, got {endpoint!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def is_loopback_endpoint(endpoint: str, name: str = "endpoint") -> bool:
    """Whether ``HOST:PORT`` listens on loopback only (``localhost`` or a loopback IP); a
    wildcard, another address or any other host name is not. ValueError naming ``name`` when
    ``endpoint`` is not ``HOST:PORT``."""
    try:
        host, _ = split_endpoint(endpoint)
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any address


def is_wildcard_endpoint(endpoint: str) -> bool:
    """Whether ``HOST:PORT`` listens on every interface (``0.0.0.0`` or ``::``)."""
    host, _ = split_endpoint(endpoint)
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def join_endpoint(host: str, port: int) -> str:
    """``split_endpoint`` reversed: an IPv6 host goes back in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bearer_token_matches(authorization: str | None, expected_token: str) -> bool:
    """Constant-time check of an ``Authorization: Bearer <token>`` value (scheme is case-free)."""
    if not authorization:
        return False
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode(), expected_token.encode())


class ReceiverCounters:
    """Thread-safe counters every receiver exposes through ``stats()``.

    - accepted_spans: spans handed to the consumer and taken by it.
    - rejected_spans: invalid spans dropped by validation (reported back as partial success).
    - refused_requests: requests the consumer refused (Overloaded/Unavailable); sender retries.
    - failed_requests: requests the consumer failed on unexpectedly (INTERNAL / HTTP 500).
    - malformed_requests: undecodable or over-limit requests (HTTP 4xx, gRPC INVALID_ARGUMENT;
      gRPC answers over-size messages itself, before the receiver sees them).
    - unauthenticated_requests: missing or wrong bearer token.
    - refused_connections: HTTP connections closed at once because max_connections was reached.
    """

    __slots__ = (
        "_lock",
        "accepted_spans",
        "failed_requests",
        "malformed_requests",
        "refused_connections",
        "refused_requests",
        "rejected_spans",
        "unauthenticated_requests",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.accepted_spans = 0
        self.rejected_spans = 0
        self.refused_requests = 0
        self.failed_requests = 0
        self.malformed_requests = 0
        self.unauthenticated_requests = 0
        self.refused_connections = 0

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + amount)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {name: getattr(self, name) for name in self.__slots__ if name != "_lock"}


class OtlpReceiverBase:
    """What both OTLP receivers share: consumer, endpoint, auth token, TLS files, counters."""

    def __init__(
        self,
        consumer: TraceConsumer,
        *,
        endpoint: str,
        auth_token: str | None,
        tls_cert_file: str | None,
        tls_key_file: str | None,
        span_limits: SpanLimits = DEFAULT_SPAN_LIMITS,
    ) -> None:
        if (tls_cert_file is None) != (tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file must be given together")
        if auth_token is not None and not auth_token:
            raise ValueError("auth_token must not be empty (use None to disable auth)")
        self._consumer = consumer
        self._endpoint = endpoint
        self._auth_token = auth_token
        self._tls_cert_file = tls_cert_file
        self._tls_key_file = tls_key_file
        self._span_limits = span_limits
        self._counters = ReceiverCounters()
        self._port: int | None = None

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def _bind_address(self) -> tuple[str, int]:
        """(host, port) of the endpoint; raises ReceiverStartError when it is malformed."""
        try:
            return split_endpoint(self._endpoint)
        except ValueError as error:
            raise ReceiverStartError(f"invalid receiver endpoint: {error}") from None

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("receiver not started")
        return self._port

    @property
    def listening(self) -> str:
        """Where it listens, for people: ``HOST:PORT`` with the bound port (after ``start``)."""
        return join_endpoint(split_endpoint(self._endpoint)[0], self.port)

    def stats(self) -> dict[str, int]:
        return self._counters.snapshot()


def count_spans(request: ExportTraceServiceRequest) -> int:
    """The spans of an export request, counted per scope: len() of a repeated field does not
    touch the spans."""
    return sum(
        len(scope_spans.spans)
        for resource_spans in request.resource_spans
        for scope_spans in resource_spans.scope_spans
    )


@dataclass(frozen=True, slots=True)
class ValidExport:
    """A decoded export request after validation: what goes to the consumer, and the reply."""

    request: ExportTraceServiceRequest
    """The valid spans (validation removed the others in place)."""
    encoded: bytes | None
    """``request`` serialised, when it is still exactly what was received (see
    ``TraceConsumer.consume_traces``); None when validation changed it or it came as JSON."""
    accepted_spans: int
    response: ExportTraceServiceResponse
    """OK, with ``partial_success`` when spans were rejected."""


def validate_export(
    request: ExportTraceServiceRequest,
    *,
    encoded: bytes | None = None,
    limits: SpanLimits = DEFAULT_SPAN_LIMITS,
) -> ValidExport:
    """Validate ``request`` (decoded from the protobuf bytes ``encoded``, when given) against
    ``limits``."""
    sanitized = sanitize(request, limits, encoded=encoded)
    rejected_spans, error_message = sanitized
    # A stand-in for sanitize (the tests' bypass) may return a plain pair: assume a change.
    modified = getattr(sanitized, "modified", True)
    response = ExportTraceServiceResponse()
    if rejected_spans:
        response.partial_success.rejected_spans = rejected_spans
        response.partial_success.error_message = error_message
    return ValidExport(
        request,
        None if modified else encoded,
        count_spans(request),
        response,
    )


def hand_over(
    consumer: TraceConsumer, export: ValidExport, counters: ReceiverCounters
) -> ExportTraceServiceResponse:
    """Hand a validated export's spans to ``consumer`` (none: no call); count; the response.

    Raises Overloaded / Unavailable from the consumer unchanged (counted as refused) and
    ConsumerFailed for anything else the consumer raised (logged and counted here).
    """
    accepted_spans = export.accepted_spans
    if accepted_spans:
        try:
            consumer.consume_traces(export.request, encoded=export.encoded)
        except (Overloaded, Unavailable):
            counters.add("refused_requests")
            raise
        except Exception as error:
            counters.add("failed_requests")
            _log.error("trace consumer failed on a %d-span export", accepted_spans, exc_info=True)
            raise ConsumerFailed(f"consumer error: {type(error).__name__}") from error
        counters.add("accepted_spans", accepted_spans)
    rejected_spans = export.response.partial_success.rejected_spans
    if rejected_spans:
        counters.add("rejected_spans", rejected_spans)
    return export.response


def deliver(
    consumer: TraceConsumer,
    request: ExportTraceServiceRequest,
    counters: ReceiverCounters,
    *,
    encoded: bytes | None = None,
    limits: SpanLimits = DEFAULT_SPAN_LIMITS,
) -> ExportTraceServiceResponse:
    """Validate ``request`` (decoded from the protobuf bytes ``encoded``, when given), hand it
    to ``consumer`` and build the OTLP response: ``validate_export`` then ``hand_over``."""
    return hand_over(consumer, validate_export(request, encoded=encoded, limits=limits), counters)
