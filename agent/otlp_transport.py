"""The two ways one OTLP export request is sent: OTLP/gRPC and OTLP/HTTP.

Each transport makes one attempt per ``send`` and classifies its outcome (sent, with how many
items the server rejected; retryable, with the delay the server asked for; permanent) by the
OTLP specification's rules; what to do about it (retry, backoff, giving up) is the sender's
(``otlp_export``). ``grpc`` is imported only when a gRPC transport is made.
"""

from __future__ import annotations

import contextlib
import datetime
import email.utils
import enum
import gzip
import http.client
import socket
import ssl
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol
from urllib.parse import urlsplit

from google.protobuf.message import DecodeError, Message

from tokentrace.agent.otlp_config import (
    COMPRESSION_GZIP,
    PROTOCOL_GRPC,
    OtlpExporterConfig,
    SignalSpec,
)

if TYPE_CHECKING:
    import grpc

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


# --- transports -------------------------------------------------------------------------------
def _rejected_items(response: Message, signal: SignalSpec) -> tuple[int, str]:
    partial = getattr(response, "partial_success", None)
    if partial is None:
        return 0, ""
    return int(getattr(partial, signal.rejected_field)), str(partial.error_message)


class SendResult(enum.Enum):
    """How one attempt ended: what the sender's retry policy decides on."""

    SENT = "sent"
    RETRYABLE = "retryable"
    PERMANENT = "permanent"


@dataclass(frozen=True, slots=True)
class SendOutcome:
    """One attempt's result, with what the server said about it."""

    result: SendResult
    rejected: int = 0
    retry_after_s: float | None = None
    """The delay the server asked for (RetryInfo / Retry-After), if any."""
    detail: str = ""


class Transport(Protocol):
    """What the sender needs of a transport: one attempt at a time, cancellable by ``close``."""

    def prepare(self, payload: bytes) -> bytes:
        """Once per batch, before the first attempt (e.g. compress)."""

    def send(self, body: bytes, timeout_s: float) -> SendOutcome:
        """One attempt; never raises for network or server errors."""

    def close(self) -> None:
        """Release the connection; may be called from another thread to cancel a send."""


def _identity(payload: bytes) -> bytes:
    return payload


class _GrpcTransport:
    """A raw unary call carrying the pre-serialised request bytes."""

    def __init__(
        self, config: OtlpExporterConfig, signal: SignalSpec, endpoint: str, user_agent: str
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

    def send(self, body: bytes, timeout_s: float) -> SendOutcome:
        import grpc  # loaded by __init__ already: a module-cache lookup

        try:
            response = self._call(body, timeout=timeout_s, metadata=self._metadata)
        except grpc.RpcError as error:
            if not isinstance(error, grpc.Call):
                return SendOutcome(SendResult.RETRYABLE, detail=repr(error))
            code = error.code()
            detail = f"gRPC {code.name}: {error.details()}"
            if code.name in _GRPC_RETRYABLE_CODES:
                return SendOutcome(
                    SendResult.RETRYABLE, retry_after_s=_grpc_retry_delay(error), detail=detail
                )
            return SendOutcome(SendResult.PERMANENT, detail=detail)
        rejected, message = _rejected_items(response, self._signal)
        return SendOutcome(SendResult.SENT, rejected=rejected, detail=message)

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
        self, config: OtlpExporterConfig, signal: SignalSpec, url: str, user_agent: str
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

    def send(self, body: bytes, timeout_s: float) -> SendOutcome:
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
            return SendOutcome(SendResult.RETRYABLE, detail=f"connection error: {error!r}")
        if will_close:
            self._drop_connection(connection)
        if 200 <= status < 300:
            if not data:
                return SendOutcome(SendResult.SENT)
            try:
                response = self._signal.response_type.FromString(data)
            except DecodeError:
                return SendOutcome(SendResult.SENT, detail="undecodable response body")
            rejected, message = _rejected_items(response, self._signal)
            return SendOutcome(SendResult.SENT, rejected=rejected, detail=message)
        detail = f"HTTP {status} {reason}: {data[:_ERROR_BODY_PREVIEW_BYTES]!r}"
        if status in _HTTP_RETRYABLE:
            return SendOutcome(
                SendResult.RETRYABLE, retry_after_s=_parse_retry_after(retry_after), detail=detail
            )
        return SendOutcome(SendResult.PERMANENT, detail=detail)

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


def make_transport(
    config: OtlpExporterConfig, signal: SignalSpec, endpoint: str, user_agent: str
) -> Transport:
    """The transport of ``config.protocol`` to ``endpoint``; gRPC loads ``grpc`` here."""
    if config.protocol == PROTOCOL_GRPC:
        return _GrpcTransport(config, signal, endpoint, user_agent)
    return _HttpTransport(config, signal, endpoint, user_agent)
