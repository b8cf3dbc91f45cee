"""OTLP export of pre-encoded requests: a bounded queue, one worker thread, retry with backoff.

The one implementation of sending OTLP upstream, used by the in-process agent and by the
collector (which imports it; this module never imports the collector). Modelled on the
OpenTelemetry Python SDK's ``BatchSpanProcessor`` (bounded queue drained by a daemon worker
thread, re-initialised after ``fork``) and the OpenTelemetry Collector's ``exporterhelper`` (a
sending queue bounded in items, ``retry_on_failure`` with exponential backoff and jitter,
``max_elapsed_time``).

``OtlpSender.submit()`` never blocks the calling (serving) thread on the network and never raises:
the bytes of one serialised ``Export*ServiceRequest`` go to a bounded queue; when it is full they
are dropped and counted. The worker thread sends one request at a time over gRPC (the
pre-serialised bytes through a raw unary call; ``grpc`` is imported only then) or OTLP/HTTP
(``application/x-protobuf``, gzip), retries retryable failures and counts everything it could not
deliver. ``OtlpExporterConfig.from_env`` reads the standard ``OTEL_EXPORTER_OTLP_*`` variables.
"""

from __future__ import annotations

import contextlib
import datetime
import email.utils
import enum
import gzip
import http.client
import importlib.metadata
import logging
import math
import os
import random
import socket
import ssl
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol, TypeVar
from urllib.parse import unquote, urlsplit

from google.protobuf.message import DecodeError, Message
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

if TYPE_CHECKING:
    import grpc

logger = logging.getLogger(__name__)

PROTOCOL_GRPC: Final = "grpc"
PROTOCOL_HTTP_PROTOBUF: Final = "http/protobuf"
PROTOCOLS: Final = (PROTOCOL_GRPC, PROTOCOL_HTTP_PROTOBUF)
COMPRESSION_GZIP: Final = "gzip"
COMPRESSION_NONE: Final = "none"
COMPRESSIONS: Final = (COMPRESSION_GZIP, COMPRESSION_NONE)
SIGNAL_TRACES: Final = "traces"
SIGNAL_METRICS: Final = "metrics"
Signal = Literal["traces", "metrics"]
"""What one sender carries: ``ExportTraceServiceRequest`` or ``ExportMetricsServiceRequest``."""


def _installed_version() -> str:
    try:
        return importlib.metadata.version("tokentrace")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a bare source tree
        return ""


TOKENTRACE_VERSION: Final = _installed_version()
"""The installed tokentrace version; empty when running from a bare source tree."""

_DEFAULT_PROTOCOL: Final = PROTOCOL_HTTP_PROTOBUF
"""The OpenTelemetry exporter specification's default transport."""
_DEFAULT_TIMEOUT_S: Final = 10.0
_DEFAULT_COMPRESSION: Final = COMPRESSION_GZIP
"""Upstream links may leave the node: compress by default, as the OpenTelemetry Collector does."""
_DEFAULT_QUEUE_SIZE: Final = 10_000
_DEFAULT_MAX_BATCH_SPANS: Final = 512
_DEFAULT_RETRY_INITIAL_INTERVAL_S: Final = 0.5
_DEFAULT_RETRY_MAX_INTERVAL_S: Final = 5.0
_DEFAULT_RETRY_MAX_ELAPSED_S: Final = 60.0
_DEFAULT_FLUSH_TIMEOUT_S: Final = 10.0
_DEFAULT_SHUTDOWN_TIMEOUT_S: Final = 10.0
_DEFAULT_USER_AGENT: Final = f"tokentrace-agent/{TOKENTRACE_VERSION or 'dev'}"

_RETRY_MULTIPLIER: Final = 1.5
"""Backoff growth per retry (the Collector's exporterhelper value)."""
_RETRY_JITTER: Final = 0.5
"""Each delay is drawn uniformly from ``interval * [1 - jitter, 1 + jitter]``."""
_DROP_WARNING_INTERVAL_S: Final = 10.0
"""At most one drop warning per sender in this many seconds; the counters carry the rest."""
_SHUTDOWN_ABORT_GRACE_S: Final = 1.0
"""After the shutdown timeout, how long to wait for the cancelled in-flight call to unwind."""
_GZIP_LEVEL: Final = 6
_ERROR_BODY_PREVIEW_BYTES: Final = 200

_GRPC_RETRYABLE_CODES: Final = frozenset(
    {
        "CANCELLED",
        "DEADLINE_EXCEEDED",
        "RESOURCE_EXHAUSTED",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNAVAILABLE",
        "DATA_LOSS",
    }
)
"""The OTLP specification's retryable gRPC codes, by ``grpc.StatusCode`` name (grpc is imported
only by the gRPC transport); RESOURCE_EXHAUSTED honours RetryInfo."""
_HTTP_RETRYABLE: Final = frozenset({429, 502, 503, 504})
_GRPC_STATUS_DETAILS_KEY: Final = "grpc-status-details-bin"

_ENV_PREFIX: Final = "OTEL_EXPORTER_OTLP_"

_ConfigT = TypeVar("_ConfigT", bound="OtlpExporterConfig")


# --- configuration --------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class RetryConfig:
    """Exponential backoff for retryable failures (the Collector's ``retry_on_failure``)."""

    initial_interval_s: float = _DEFAULT_RETRY_INITIAL_INTERVAL_S
    max_interval_s: float = _DEFAULT_RETRY_MAX_INTERVAL_S
    max_elapsed_s: float = _DEFAULT_RETRY_MAX_ELAPSED_S
    """Give a batch up (drop and count it) once retrying would pass this; 0 never retries."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OtlpExporterConfig:
    """Where and how traces and metrics are sent as OTLP. ``validate()`` before use (an
    ``OtlpSender`` validates the one it is given).

    One configuration serves both signals, like the ``OTEL_EXPORTER_OTLP_*`` variables: a base
    ``endpoint`` plus optional per-signal endpoints that override it.
    """

    endpoint: str = ""
    """Base endpoint. gRPC: ``http://host:4317`` (plaintext), ``https://host:4317`` or
    ``host:4317`` (TLS). OTLP/HTTP: a base URL such as ``http://host:4318``; the signal path
    (``/v1/traces``, ``/v1/metrics``) is appended to it."""
    traces_endpoint: str = ""
    """Overrides ``endpoint`` for traces; for OTLP/HTTP the full URL, used as it is."""
    metrics_endpoint: str = ""
    """Overrides ``endpoint`` for metrics; for OTLP/HTTP the full URL, used as it is."""
    protocol: str = _DEFAULT_PROTOCOL
    """``grpc`` | ``http/protobuf``."""
    headers: Mapping[str, str] = field(default_factory=dict)
    """Sent with every request (gRPC metadata keys are lower-cased)."""
    timeout_s: float = _DEFAULT_TIMEOUT_S
    """Per attempt."""
    compression: str = _DEFAULT_COMPRESSION
    """``gzip`` | ``none``."""
    queue_size: int = _DEFAULT_QUEUE_SIZE
    """Items (spans, metric data points) waiting to be sent, at most; new batches beyond it are
    dropped and counted."""
    max_batch_spans: int = _DEFAULT_MAX_BATCH_SPANS
    """Items per request at most (spans for traces, data points for metrics); whoever forms the
    requests honours it (the sender sends each submitted payload as one request)."""
    retry: RetryConfig = field(default_factory=RetryConfig)
    insecure: bool | None = None
    """gRPC only: plaintext instead of TLS. None: from the endpoint scheme (``http://`` is
    plaintext; ``https://`` and scheme-less are TLS). OTLP/HTTP follows the URL scheme."""

    def endpoint_for(self, signal: str) -> str | None:
        """The endpoint ``signal`` (``traces`` | ``metrics``) is sent to; None when unset."""
        spec = _SIGNAL_SPECS[signal]
        specific = self.traces_endpoint if signal == SIGNAL_TRACES else self.metrics_endpoint
        if specific:
            return specific
        if not self.endpoint:
            return None
        if self.protocol == PROTOCOL_HTTP_PROTOBUF:
            return self.endpoint.rstrip("/") + spec.http_path
        return self.endpoint

    def uses_tls(self, endpoint: str) -> bool:
        """Whether sending to ``endpoint`` (one of this config's) uses TLS."""
        if self.protocol == PROTOCOL_GRPC and self.insecure is not None:
            return not self.insecure
        return _scheme(endpoint) != "http"

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol: {self.protocol!r} is not one of {PROTOCOLS}")
        endpoints = {
            "endpoint": self.endpoint,
            "traces_endpoint": self.traces_endpoint,
            "metrics_endpoint": self.metrics_endpoint,
        }
        if not any(endpoints.values()):
            raise ValueError("endpoint: no endpoint configured")
        for name, endpoint in endpoints.items():
            if endpoint:
                _validate_endpoint(name, endpoint, self.protocol)
                if (
                    self.protocol == PROTOCOL_HTTP_PROTOBUF
                    and self.insecure is not None
                    and self.insecure != (_scheme(endpoint) == "http")
                ):
                    raise ValueError(
                        f"insecure: OTLP/HTTP takes TLS from the URL scheme; "
                        f"insecure={self.insecure} contradicts {name} {endpoint!r}"
                    )
        for key, value in self.headers.items():
            if not isinstance(key, str) or not key or not isinstance(value, str):
                raise ValueError(f"headers: {key!r}={value!r} must be non-empty str = str")
            if any(char in key + value for char in "\r\n\0"):
                raise ValueError(f"headers: {key!r} contains a control character")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"timeout_s: must be > 0, got {self.timeout_s}")
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression: {self.compression!r} is not one of {COMPRESSIONS}")
        if self.max_batch_spans < 1:
            raise ValueError(f"max_batch_spans: must be >= 1, got {self.max_batch_spans}")
        if self.queue_size < self.max_batch_spans:
            raise ValueError(
                f"queue_size: must be >= max_batch_spans ({self.max_batch_spans}), "
                f"got {self.queue_size}"
            )
        retry = self.retry
        if not (math.isfinite(retry.initial_interval_s) and retry.initial_interval_s > 0):
            raise ValueError(
                f"retry.initial_interval_s: must be > 0, got {retry.initial_interval_s}"
            )
        if not (retry.max_interval_s >= retry.initial_interval_s):
            raise ValueError(
                f"retry.max_interval_s: must be >= initial_interval_s, got {retry.max_interval_s}"
            )
        if not (math.isfinite(retry.max_elapsed_s) and retry.max_elapsed_s >= 0):
            raise ValueError(f"retry.max_elapsed_s: must be >= 0, got {retry.max_elapsed_s}")

    @classmethod
    def from_env(
        cls: type[_ConfigT], environ: Mapping[str, str], *, signal: Signal | None = None
    ) -> _ConfigT | None:
        """The configuration the standard ``OTEL_EXPORTER_OTLP_*`` variables describe, or None
        when none of ``..._ENDPOINT``, ``..._TRACES_ENDPOINT``, ``..._METRICS_ENDPOINT`` is set.

        Read: ``ENDPOINT`` (for OTLP/HTTP the signal paths are appended), ``TRACES_ENDPOINT`` /
        ``METRICS_ENDPOINT`` (used as they are), ``PROTOCOL``, ``HEADERS`` (``k=v,k2=v2``,
        URL-encoded), ``TIMEOUT`` (milliseconds), ``COMPRESSION``, ``INSECURE`` (gRPC). With
        ``signal``, that signal's own variables (``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` ...)
        override the general ones, and the result is meant for that signal's sender only. Empty
        values count as unset. Invalid values raise ValueError naming the variable: better no
        export than export somewhere unintended.
        """
        options = options_from_env(environ, signal=signal)
        if options is None:
            return None
        config = cls(**options)
        config.validate()
        return config


def options_from_env(
    environ: Mapping[str, str], *, signal: Signal | None = None
) -> dict[str, Any] | None:
    """``OtlpExporterConfig`` keyword arguments from ``OTEL_EXPORTER_OTLP_*`` (see
    ``OtlpExporterConfig.from_env``), not yet validated: for callers that lay settings of their
    own over the environment. None when no endpoint variable is set."""
    if signal is not None and signal not in _SIGNAL_SPECS:
        raise ValueError(f"signal: {signal!r} is not one of {tuple(_SIGNAL_SPECS)}")
    specific_prefix = f"{_ENV_PREFIX}{signal.upper()}_" if signal is not None else None

    def read(name: str) -> tuple[str, str]:
        """The value of ``name`` and the variable it came from (the signal's own first)."""
        if specific_prefix is not None:
            variable = f"{specific_prefix}{name}"
            if value := environ.get(variable, "").strip():
                return value, variable
        variable = f"{_ENV_PREFIX}{name}"
        return environ.get(variable, "").strip(), variable

    options: dict[str, Any] = {
        "endpoint": environ.get(f"{_ENV_PREFIX}ENDPOINT", "").strip(),
        "traces_endpoint": environ.get(f"{_ENV_PREFIX}TRACES_ENDPOINT", "").strip(),
        "metrics_endpoint": environ.get(f"{_ENV_PREFIX}METRICS_ENDPOINT", "").strip(),
    }
    if not any(options.values()):
        return None
    # ``grpc://host:port`` (vLLM's --otlp-traces-endpoint convention, which vLLM also writes to
    # OTEL_EXPORTER_OTLP_TRACES_ENDPOINT in its processes): plaintext OTLP/gRPC.
    grpc_scheme = [key for key, value in options.items() if _scheme(value) == _GRPC_SCHEME]
    for key in grpc_scheme:
        options[key] = "http://" + options[key].split("://", 1)[1]
    protocol, variable = read("PROTOCOL")
    if protocol:
        if protocol not in PROTOCOLS:
            raise ValueError(f"{variable}: {protocol!r} is not one of {PROTOCOLS}")
        if grpc_scheme and protocol != PROTOCOL_GRPC:
            raise ValueError(
                f"{variable}: {protocol!r} contradicts the grpc:// endpoint in "
                f"{_ENV_PREFIX}{grpc_scheme[0].upper()}"
            )
        options["protocol"] = protocol
    elif grpc_scheme:
        options["protocol"] = PROTOCOL_GRPC
    headers, variable = read("HEADERS")
    if headers:
        options["headers"] = _parse_headers(variable, headers)
    timeout, variable = read("TIMEOUT")
    if timeout:
        try:
            timeout_ms = float(timeout)
        except ValueError:
            raise ValueError(f"{variable}: {timeout!r} is not a number of ms") from None
        if not (math.isfinite(timeout_ms) and timeout_ms > 0):
            raise ValueError(f"{variable}: must be > 0 ms, got {timeout!r}")
        options["timeout_s"] = timeout_ms / 1000.0
    compression, variable = read("COMPRESSION")
    compression = compression.lower()
    if compression:
        if compression not in COMPRESSIONS:
            raise ValueError(f"{variable}: {compression!r} is not one of {COMPRESSIONS}")
        options["compression"] = compression
    insecure, variable = read("INSECURE")
    insecure = insecure.lower()
    if insecure and options.get("protocol", _DEFAULT_PROTOCOL) == PROTOCOL_GRPC:
        if insecure not in ("true", "false"):
            raise ValueError(f"{variable}: {insecure!r} is not true or false")
        options["insecure"] = insecure == "true"
    return options


def _parse_headers(variable: str, value: str) -> dict[str, str]:
    """``k=v,k2=v2`` with URL-encoded keys and values (the W3C baggage format the spec uses)."""
    headers: dict[str, str] = {}
    for item in value.split(","):
        if not item.strip():
            continue
        key, separator, header_value = item.partition("=")
        key = unquote(key.strip())
        if not separator or not key:
            raise ValueError(f"{variable}: {item.strip()!r} is not key=value")
        headers[key] = unquote(header_value.strip())
    return headers


_GRPC_SCHEME: Final = "grpc"


def _scheme(endpoint: str) -> str:
    return endpoint.split("://", 1)[0].lower() if "://" in endpoint else ""


def _validate_endpoint(name: str, endpoint: str, protocol: str) -> None:
    if any(char.isspace() for char in endpoint):
        raise ValueError(f"{name}: {endpoint!r} contains whitespace")
    checked = endpoint
    if "://" not in endpoint and protocol == PROTOCOL_GRPC:
        checked = f"https://{endpoint}"  # a bare gRPC target: check it as host:port
    parts = urlsplit(checked)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{name}: {endpoint!r} needs an http:// or https:// scheme")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{name}: {endpoint!r} has an invalid port") from None
    if not parts.hostname:
        raise ValueError(f"{name}: {endpoint!r} has no host")
    if protocol == PROTOCOL_GRPC and port is None:
        raise ValueError(f"{name}: gRPC endpoint {endpoint!r} needs a port")


# --- one signal's wire details ---------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _SignalSpec:
    name: str
    item: str
    """What the counters count: ``spans`` | ``data_points``."""
    grpc_method: str
    http_path: str
    response_type: type[Message]
    rejected_field: str
    """The partial-success field counting rejected items."""


_SIGNAL_SPECS: Final = {
    SIGNAL_TRACES: _SignalSpec(
        name=SIGNAL_TRACES,
        item="spans",
        grpc_method="/opentelemetry.proto.collector.trace.v1.TraceService/Export",
        http_path="/v1/traces",
        response_type=ExportTraceServiceResponse,
        rejected_field="rejected_spans",
    ),
    SIGNAL_METRICS: _SignalSpec(
        name=SIGNAL_METRICS,
        item="data_points",
        grpc_method="/opentelemetry.proto.collector.metrics.v1.MetricsService/Export",
        http_path="/v1/metrics",
        response_type=ExportMetricsServiceResponse,
        rejected_field="rejected_data_points",
    ),
}


def _rejected_items(response: Message, signal: _SignalSpec) -> tuple[int, str]:
    partial = getattr(response, "partial_success", None)
    if partial is None:
        return 0, ""
    return int(getattr(partial, signal.rejected_field)), str(partial.error_message)


# --- transports -------------------------------------------------------------------------------
class _Result(enum.Enum):
    SENT = "sent"
    RETRYABLE = "retryable"
    PERMANENT = "permanent"


@dataclass(frozen=True, slots=True)
class _Outcome:
    result: _Result
    rejected: int = 0
    retry_after_s: float | None = None
    """The delay the server asked for (RetryInfo / Retry-After), if any."""
    detail: str = ""


class _Transport(Protocol):
    def prepare(self, payload: bytes) -> bytes:
        """Once per batch, before the first attempt (e.g. compress)."""

    def send(self, body: bytes, timeout_s: float) -> _Outcome:
        """One attempt; never raises for network or server errors."""

    def close(self) -> None:
        """Release the connection; may be called from another thread to cancel a send."""


def _identity(payload: bytes) -> bytes:
    return payload


class _GrpcTransport:
    """A raw unary call carrying the pre-serialised request bytes."""

    def __init__(
        self, config: OtlpExporterConfig, signal: _SignalSpec, endpoint: str, user_agent: str
    ) -> None:
        import grpc  # here, not at module level: an OTLP/HTTP sender never loads it

        self._signal = signal
        target = urlsplit(endpoint).netloc if "://" in endpoint else endpoint
        options = [("grpc.enable_retries", 0), ("grpc.primary_user_agent", user_agent)]
        compression = (
            grpc.Compression.Gzip
            if config.compression == COMPRESSION_GZIP
            else grpc.Compression.NoCompression
        )
        if config.uses_tls(endpoint):
            self._channel = grpc.secure_channel(
                target, grpc.ssl_channel_credentials(), options=options, compression=compression
            )
        else:
            self._channel = grpc.insecure_channel(target, options=options, compression=compression)
        self._call = self._channel.unary_unary(
            signal.grpc_method,
            request_serializer=_identity,
            response_deserializer=signal.response_type.FromString,
        )
        self._metadata = tuple((key.lower(), value) for key, value in config.headers.items())

    def prepare(self, payload: bytes) -> bytes:
        return payload  # the channel compresses

    def send(self, body: bytes, timeout_s: float) -> _Outcome:
        import grpc  # loaded by __init__ already: a module-cache lookup

        try:
            response = self._call(body, timeout=timeout_s, metadata=self._metadata)
        except grpc.RpcError as error:
            if not isinstance(error, grpc.Call):
                return _Outcome(_Result.RETRYABLE, detail=repr(error))
            code = error.code()
            detail = f"gRPC {code.name}: {error.details()}"
            if code.name in _GRPC_RETRYABLE_CODES:
                return _Outcome(
                    _Result.RETRYABLE, retry_after_s=_grpc_retry_delay(error), detail=detail
                )
            return _Outcome(_Result.PERMANENT, detail=detail)
        rejected, message = _rejected_items(response, self._signal)
        return _Outcome(_Result.SENT, rejected=rejected, detail=message)

    def close(self) -> None:
        self._channel.close()


def _grpc_retry_delay(error: grpc.Call) -> float | None:
    """The RetryInfo delay in the error's ``grpc-status-details-bin`` trailer, if any."""
    try:  # googleapis-common-protos, which grpc deployments normally carry
        from google.rpc import error_details_pb2, status_pb2
    except ImportError:  # pragma: no cover - then the delay comes from the backoff alone
        return None
    for key, value in error.trailing_metadata() or ():
        if key != _GRPC_STATUS_DETAILS_KEY or not isinstance(value, bytes):
            continue
        try:
            status = status_pb2.Status.FromString(value)
            for detail in status.details:
                if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                    info = error_details_pb2.RetryInfo()
                    detail.Unpack(info)
                    delay = info.retry_delay
                    return max(0.0, delay.seconds + delay.nanos / 1e9)
        except DecodeError:
            return None
    return None


class _HttpTransport:
    """OTLP/HTTP over one persistent ``http.client`` connection, re-opened after errors."""

    def __init__(
        self, config: OtlpExporterConfig, signal: _SignalSpec, url: str, user_agent: str
    ) -> None:
        self._signal = signal
        parts = urlsplit(url)
        path = parts.path or "/"
        self._path = f"{path}?{parts.query}" if parts.query else path
        self._host = parts.hostname or ""
        self._tls = parts.scheme == "https"
        self._port = parts.port or (443 if self._tls else 80)
        self._gzip = config.compression == COMPRESSION_GZIP
        self._headers = {
            "Content-Type": "application/x-protobuf",
            "User-Agent": user_agent,
            **config.headers,
        }
        if self._gzip:
            self._headers["Content-Encoding"] = "gzip"
        self._ssl_context = ssl.create_default_context() if self._tls else None
        self._lock = threading.Lock()
        self._connection: http.client.HTTPConnection | None = None

    def prepare(self, payload: bytes) -> bytes:
        return gzip.compress(payload, compresslevel=_GZIP_LEVEL) if self._gzip else payload

    def send(self, body: bytes, timeout_s: float) -> _Outcome:
        with self._lock:
            connection = self._connection
            reused = connection is not None
            if connection is None:
                connection = self._connection = self._new_connection(timeout_s)
        try:
            connection.timeout = timeout_s
            if connection.sock is not None:
                connection.sock.settimeout(timeout_s)
            try:
                status, reason, will_close, retry_after, data = self._post(connection, body)
            except (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected):
                if not reused:
                    raise
                # The server closed an idle keep-alive connection: one fresh attempt, not a retry.
                self._drop_connection(connection)
                with self._lock:
                    connection = self._connection = self._new_connection(timeout_s)
                status, reason, will_close, retry_after, data = self._post(connection, body)
        except (OSError, http.client.HTTPException, ValueError, AttributeError) as error:
            # ValueError/AttributeError: the connection was closed under us (shutdown abort).
            self._drop_connection(connection)
            return _Outcome(_Result.RETRYABLE, detail=f"connection error: {error!r}")
        if will_close:
            self._drop_connection(connection)
        if 200 <= status < 300:
            if not data:
                return _Outcome(_Result.SENT)
            try:
                response = self._signal.response_type.FromString(data)
            except DecodeError:
                return _Outcome(_Result.SENT, detail="undecodable response body")
            rejected, message = _rejected_items(response, self._signal)
            return _Outcome(_Result.SENT, rejected=rejected, detail=message)
        detail = f"HTTP {status} {reason}: {data[:_ERROR_BODY_PREVIEW_BYTES]!r}"
        if status in _HTTP_RETRYABLE:
            return _Outcome(
                _Result.RETRYABLE, retry_after_s=_parse_retry_after(retry_after), detail=detail
            )
        return _Outcome(_Result.PERMANENT, detail=detail)

    def _post(
        self, connection: http.client.HTTPConnection, body: bytes
    ) -> tuple[int, str, bool, str | None, bytes]:
        connection.request("POST", self._path, body=body, headers=self._headers)
        response = connection.getresponse()
        data = response.read()  # read fully so the connection can be reused
        return (
            response.status,
            response.reason,
            response.will_close,
            response.getheader("Retry-After"),
            data,
        )

    def _new_connection(self, timeout_s: float) -> http.client.HTTPConnection:
        if self._tls:
            return http.client.HTTPSConnection(
                self._host, self._port, timeout=timeout_s, context=self._ssl_context
            )
        return http.client.HTTPConnection(self._host, self._port, timeout=timeout_s)

    def _drop_connection(self, connection: http.client.HTTPConnection) -> None:
        with self._lock:
            if self._connection is connection:
                self._connection = None
        connection.close()

    def close(self) -> None:
        with self._lock:
            connection, self._connection = self._connection, None
        if connection is None:
            return
        sock = connection.sock
        if sock is not None:
            # Wakes a worker blocked in recv on this socket; close() alone would not.
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        connection.close()


def _parse_retry_after(value: str | None) -> float | None:
    """``Retry-After`` as seconds from now: delta-seconds or an HTTP date."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return max(0.0, (when - datetime.datetime.now(datetime.timezone.utc)).total_seconds())


def _make_transport(
    config: OtlpExporterConfig, signal: _SignalSpec, endpoint: str, user_agent: str
) -> _Transport:
    if config.protocol == PROTOCOL_GRPC:
        return _GrpcTransport(config, signal, endpoint, user_agent)
    return _HttpTransport(config, signal, endpoint, user_agent)


# --- the queue + worker + retry -------------------------------------------------------------------
class RateLimitedWarning:
    """Logs a warning the first time, then at most once per ``interval_s``, and says how many
    were suppressed: for drop counters, whose totals travel in ``stats()``. Safe to call from
    any thread; a forked child gets a fresh lock (the parent's may have been held at fork)."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        *,
        interval_s: float = _DROP_WARNING_INTERVAL_S,
        log: logging.Logger | None = None,
    ) -> None:
        """``clock``: seconds, monotonic; ``log``: this module's logger when None."""
        self._clock = clock
        self._interval_s = interval_s
        self._log = log or logger
        self._lock = threading.Lock()
        self._last = -math.inf
        self._suppressed = 0
        if hasattr(os, "register_at_fork"):
            reference = weakref.ref(self)

            def after_in_child() -> None:
                warning = reference()
                if warning is not None:
                    warning.reinit_after_fork()

            os.register_at_fork(after_in_child=after_in_child)

    def reinit_after_fork(self) -> None:
        self._lock = threading.Lock()

    def warn(self, message: str, *args: object, exc_info: bool = False) -> None:
        """``exc_info``: attach the exception being handled, when this one is logged."""
        with self._lock:
            now = self._clock()
            if now - self._last < self._interval_s:
                self._suppressed += 1
                return
            self._last = now
            suppressed, self._suppressed = self._suppressed, 0
        if suppressed:
            message += " (%d similar warnings suppressed)"
            args += (suppressed,)
        self._log.warning(message, *args, exc_info=exc_info)


class OtlpSender:
    """Sends serialised OTLP export requests of one signal from a bounded queue on one worker
    thread, with retry; the caller's side never blocks on the network and never raises.

    The queue is bounded in items (spans or data points), not requests. Each submitted payload
    is one complete ``ExportTraceServiceRequest`` / ``ExportMetricsServiceRequest`` and travels as
    one request; batching is the caller's. The worker thread starts on the first submission and
    is re-created after ``fork`` in the child, whose queue starts empty (the parent sends what it
    had queued). A sender without an endpoint for its signal is disabled: it takes nothing.
    """

    def __init__(
        self,
        config: OtlpExporterConfig,
        *,
        signal: Signal,
        user_agent: str = _DEFAULT_USER_AGENT,
        clock: Callable[[], float] | None = None,
        sleep: Callable[[float], None] | None = None,
        random_fraction: Callable[[], float] | None = None,
    ) -> None:
        """Raises ValueError for an invalid ``config`` or ``signal``. ``clock``/``sleep``/
        ``random_fraction`` (in [0, 1), for jitter) are for tests."""
        if signal not in _SIGNAL_SPECS:
            raise ValueError(f"signal: {signal!r} is not one of {tuple(_SIGNAL_SPECS)}")
        config.validate()
        self._config = config
        self._signal = _SIGNAL_SPECS[signal]
        self._endpoint = config.endpoint_for(signal)
        self._user_agent = user_agent
        self._clock = clock or time.monotonic
        self._sleep = sleep or self._interruptible_sleep
        self._random_fraction = random_fraction or random.random
        self._warning = RateLimitedWarning(self._clock)
        self._sent = 0
        self._dropped = 0
        self._rejected = 0
        self._retries = 0
        self._closed = False
        self._init_runtime_state()
        if hasattr(os, "register_at_fork"):
            reinit = weakref.WeakMethod(self._after_fork_in_child)

            def after_in_child() -> None:
                method = reinit()
                if method is not None:
                    method()

            os.register_at_fork(after_in_child=after_in_child)

    def _init_runtime_state(self) -> None:
        """Locks, queue, worker and connection: everything a forked child must not inherit."""
        self._lock = threading.Lock()
        self._work_ready = threading.Condition(self._lock)
        self._idle = threading.Condition(self._lock)
        self._queue: deque[tuple[bytes, int]] = deque()
        self._queued_items = 0
        self._in_flight_items = 0
        self._in_flight_abandoned = False
        self._aborted = False
        self._abort_event = threading.Event()
        self._worker: threading.Thread | None = None
        self._transport: _Transport | None = None

    def _after_fork_in_child(self) -> None:
        # The parent's connection and thread do not exist here; never close the inherited channel.
        self._init_runtime_state()
        # (self._warning re-creates its own lock in the child: see RateLimitedWarning.)

    @property
    def endpoint(self) -> str | None:
        """Where requests go; None when the configuration has none for this signal."""
        return self._endpoint

    @property
    def enabled(self) -> bool:
        """False without an endpoint for this signal: ``submit`` takes nothing, counts nothing."""
        return self._endpoint is not None

    # --- caller side (serving/pipeline thread): never blocks on the network, never raises -----
    def has_room(self, items: int) -> bool:
        """Whether ``items`` more would fit now: a cheap pre-check before serialising (then
        ``count_dropped`` what did not fit); ``submit`` decides for good."""
        return (
            self._endpoint is not None
            and not self._closed
            and self._queued_items + items <= self._config.queue_size
        )

    def submit(self, payload: bytes, items: int) -> bool:
        """Queue one serialised export request carrying ``items`` spans or data points. False
        when it was not taken: counted as dropped (queue full, sender shut down), or the sender
        is disabled (not counted)."""
        if self._endpoint is None:
            return False
        with self._lock:
            if self._closed:
                reason = "sender shut down"
            elif self._queued_items + items > self._config.queue_size:
                reason = "queue full"
            elif self._worker is None and not self._start_worker():
                reason = "no worker thread"
            else:
                self._queue.append((payload, items))
                self._queued_items += items
                self._work_ready.notify()
                return True
            self._dropped += items
        self._warn_dropped(items, reason)
        return False

    def count_dropped(self, items: int, reason: str | None = None) -> None:
        """Count ``items`` the caller gave up before submitting them (``has_room`` said no, or
        encoding failed); ``reason`` None: why ``has_room`` said no."""
        if reason is None:
            reason = "sender shut down" if self._closed else "queue full"
        with self._lock:
            self._dropped += items
        self._warn_dropped(items, reason)

    def _warn_dropped(self, items: int, reason: str) -> None:
        self._warning.warn(
            "OTLP %s export to %s dropped %d %s: %s",
            self._signal.name,
            self._endpoint,
            items,
            self._signal.item,
            reason,
        )

    def stats(self) -> dict[str, int]:
        """``sent_<items>``, ``dropped_<items>``, ``rejected_<items>`` (items: ``spans`` or
        ``data_points``; rejected: refused by the server in a partial success), ``retries`` and
        ``queue_len`` (items waiting, not counting the request in flight)."""
        item = self._signal.item
        with self._lock:
            return {
                f"sent_{item}": self._sent,
                f"dropped_{item}": self._dropped,
                f"rejected_{item}": self._rejected,
                "retries": self._retries,
                "queue_len": self._queued_items,
            }

    def force_flush(self, timeout_s: float = _DEFAULT_FLUSH_TIMEOUT_S) -> bool:
        """Wait until everything queued so far was sent or given up; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._queue or self._in_flight_items:
                if self._worker is None or not self._worker.is_alive():
                    return False
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._idle.wait(remaining)
        return True

    def shutdown(self, timeout_s: float = _DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
        """Send what can be sent within ``timeout_s``, then drop and count the rest. Later
        submissions are dropped and counted. Idempotent."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if self._closed:
                return
            self._closed = True
            worker = self._worker
            self._work_ready.notify_all()
        if worker is not None:
            worker.join(max(0.0, deadline - time.monotonic()))
        if worker is not None and worker.is_alive():
            # Out of time: stop retrying, cancel the call in flight, count what is left.
            with self._lock:
                self._aborted = True
                left = self._queued_items
                self._dropped += left
                self._queue.clear()
                self._queued_items = 0
                transport = self._transport
            self._abort_event.set()
            if transport is not None:
                transport.close()
            worker.join(_SHUTDOWN_ABORT_GRACE_S)
            with self._lock:
                if self._in_flight_items:  # the worker is stuck; it will not count this batch
                    left += self._in_flight_items
                    self._dropped += self._in_flight_items
                    self._in_flight_items = 0
                    self._in_flight_abandoned = True
            if left:
                self._warn_dropped(left, f"shutdown timeout ({timeout_s} s)")
        with self._lock:
            transport, self._transport = self._transport, None
        if transport is not None:
            transport.close()

    # --- worker thread ----------------------------------------------------------------------
    def _start_worker(self) -> bool:
        """Start the worker (the lock is held); False, logged, when no thread can be started."""
        worker = threading.Thread(
            target=self._run,
            name=f"tokentrace-otlp-{self._signal.name}-sender",
            daemon=True,  # like the SDK: never keeps the process alive; shutdown() flushes
        )
        try:
            worker.start()
        except RuntimeError:  # e.g. "can't start new thread": drop, and try again next time
            logger.exception("OTLP %s export: could not start the sender thread", self._signal.name)
            return False
        self._worker = worker
        return True

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._work_ready.wait()
                if not self._queue:
                    return  # closed and drained
                payload, items = self._queue.popleft()
                self._queued_items -= items
                self._in_flight_items = items
            rejected: int | None = None
            try:
                rejected = self._send_with_retry(payload, items)
            except Exception:  # the worker must survive anything one batch does
                logger.exception("OTLP %s export: unexpected error", self._signal.name)
            with self._lock:
                if not self._in_flight_abandoned:
                    if rejected is None:
                        self._dropped += items
                    else:
                        self._rejected += rejected
                        self._sent += items - rejected
                self._in_flight_items = 0
                self._idle.notify_all()

    def _get_transport(self) -> _Transport:
        with self._lock:
            transport = self._transport
        if transport is None:
            assert self._endpoint is not None  # nothing is queued without one
            transport = _make_transport(
                self._config, self._signal, self._endpoint, self._user_agent
            )
            with self._lock:
                self._transport = transport
        return transport

    def _send_with_retry(self, payload: bytes, items: int) -> int | None:
        """Deliver one request; the number of items the server rejected, or None if dropped."""
        try:
            transport = self._get_transport()
        except Exception as error:  # e.g. grpc not installed: rate-limited, unlike the worker's
            self._warn_dropped(items, f"no connection: {error!r}")
            return None
        body = transport.prepare(payload)
        retry = self._config.retry
        started = self._clock()
        interval = retry.initial_interval_s
        attempts = 0
        while True:
            if self._aborted:
                return None
            attempts += 1
            outcome = transport.send(body, self._config.timeout_s)
            if outcome.result is _Result.SENT:
                rejected = min(max(outcome.rejected, 0), items)
                if rejected:
                    self._warning.warn(
                        "OTLP %s export to %s: upstream rejected %d of %d %s: %s",
                        self._signal.name,
                        self._endpoint,
                        rejected,
                        items,
                        self._signal.item,
                        outcome.detail,
                    )
                return rejected
            if outcome.result is _Result.PERMANENT or self._aborted:
                self._warn_dropped(items, outcome.detail)
                return None
            if outcome.retry_after_s is not None:
                delay = outcome.retry_after_s
            else:
                jitter = 1.0 + _RETRY_JITTER * (2.0 * self._random_fraction() - 1.0)
                delay = interval * jitter
            interval = min(interval * _RETRY_MULTIPLIER, retry.max_interval_s)
            if self._clock() - started + delay > retry.max_elapsed_s:
                self._warn_dropped(items, f"gave up after {attempts} attempts ({outcome.detail})")
                return None
            with self._lock:
                self._retries += 1
            self._sleep(delay)

    def _interruptible_sleep(self, delay_s: float) -> None:
        self._abort_event.wait(delay_s)
