"""The two ways one OTLP export request is sent: OTLP/gRPC and OTLP/HTTP.

Each transport makes one attempt per ``send`` and classifies its outcome (sent, with how many
items the server rejected; retryable, with the delay the server asked for; permanent) by the
OTLP specification's rules; what to do about it (retry, backoff, giving up) is the sender's
(``otlp_export``). ``grpc`` is imported only when a gRPC transport is made.

A transport also recognises a misconfigured endpoint from the first answer, and names it in
``SendOutcome.misconfiguration`` (a permanent outcome): OTLP/HTTP sent to a gRPC port (the server
answers with an HTTP/2 frame), TLS spoken to a plain-text server and plain text to a TLS server,
an HTTP 404 (no OTLP/HTTP receiver at that path), gRPC sent to an HTTP/1.1 server or with
TLS to a plain-text one, and a server certificate that fails verification (not signed by a
trusted CA, or not naming the endpoint's host).

Over TLS a transport trusts the CA file of ``OtlpExporterConfig.certificate_file`` (else the
system's trust store) and presents the client certificate and key it names (mTLS); it reads
them once, when it is made. A server that requires a client certificate and gets none hangs up
without saying why (gRPC: "Socket closed", Python's ssl: an EOF), which a passing network error
looks the same as: that stays retryable.
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
    SIGNAL_TRACES,
    OtlpExporterConfig,
    SignalSpec,
)

if TYPE_CHECKING:
    import grpc

_GZIP_LEVEL: Final = 1
"""zlib's fastest level: 3-4x cheaper than the default 6 for 5-7 % more bytes on OTLP spans
(docs/performance.md). gRPC compresses at its own fixed level (6)."""
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
_HTTP2_FRAME_HEADER_BYTES: Final = 9
_HTTP2_CONNECTION_FRAMES: Final = frozenset({"\x04", "\x07"})
"""SETTINGS and GOAWAY: what an HTTP/2 (gRPC) server sends first, on stream 0."""
_TLS_RECORD_TYPES: Final = frozenset({"\x15", "\x16"})
"""A TLS alert or handshake record, as the first byte a TLS server answers plain text with."""
_NOT_TLS_REASONS: Final = frozenset(
    {"WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG", "UNKNOWN_PROTOCOL"}
)
"""``ssl.SSLError.reason`` when the server answered a TLS handshake with something else."""
_TLS_PROBE_TIMEOUT_S: Final = 3.0
_GRPC_SAW_HTTP1: Final = ("Failed parsing HTTP/2", "http1.x server", "Expected SETTINGS frame")
"""What grpc's connection error says when the server answered HTTP/1.x."""
_CERTIFICATE_UNTRUSTED: Final = "CERTIFICATE_VERIFY_FAILED"
"""In grpc's connection error and ``ssl.SSLError.reason``: the server's certificate failed
verification."""
_GRPC_HOSTNAME_MISMATCH: Final = "Hostname Verification Check failed"
_HOST_MISMATCH_CODES: Final = frozenset({62, 64})
"""``X509_V_ERR_HOSTNAME_MISMATCH``, ``X509_V_ERR_IP_ADDRESS_MISMATCH``: the certificate names
another host, as ``ssl.SSLCertVerificationError.verify_code``."""
_VERIFY_REASON_MAX_CHARS: Final = 120


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
    misconfiguration: str = ""
    """With PERMANENT: what about the endpoint is wrong and which setting fixes it (one line,
    for the user); retrying cannot help, and nor can the next batch until it is fixed."""


class _Settings:
    """The names of the settings that fix a misconfiguration: the ``OTEL_EXPORTER_OTLP_*``
    variables (a config file's ``endpoint`` / ``protocol`` / ``insecure`` keys mean the same)."""

    def __init__(self, config: OtlpExporterConfig, signal: SignalSpec) -> None:
        specific = (
            config.traces_endpoint if signal.name == SIGNAL_TRACES else config.metrics_endpoint
        )
        self.endpoint_is_full_url = bool(specific)
        self.endpoint = (
            f"{_ENV_PREFIX}{signal.name.upper()}_ENDPOINT" if specific else f"{_ENV_PREFIX}ENDPOINT"
        )
        self.protocol = f"{_ENV_PREFIX}PROTOCOL"
        self.insecure = f"{_ENV_PREFIX}INSECURE"
        self.certificate = f"{_ENV_PREFIX}CERTIFICATE"
        self.certificate_file = config.certificate_file

    def untrusted_certificate(self, why: str) -> str:
        """The line for a server certificate that failed verification for reason ``why``."""
        why = why.strip().rstrip(".")[:_VERIFY_REASON_MAX_CHARS]
        trusted = (
            f"the CA file {self.certificate_file!r}"
            if self.certificate_file
            else "the system's trust store"
        )
        return (
            f"the server's TLS certificate is not trusted by {trusted} ({why}): set "
            f"{self.certificate} to the PEM file of the CA that signed it"
        )

    def hostname_mismatch(self, why: str) -> str:
        """The line for a server certificate that does not name the endpoint's host."""
        why = why.strip().rstrip(".")[:_VERIFY_REASON_MAX_CHARS]
        return (
            f"the server's TLS certificate does not name the endpoint's host ({why}): use a "
            f"host name the certificate names in {self.endpoint}"
        )


def _misconfigured(message: str, detail: str) -> SendOutcome:
    return SendOutcome(SendResult.PERMANENT, detail=detail, misconfiguration=message)


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
        self._settings = _Settings(config, signal)
        self._tls = config.uses_tls(endpoint)
        target = urlsplit(endpoint).netloc if "://" in endpoint else endpoint
        options = [("grpc.enable_retries", 0), ("grpc.primary_user_agent", user_agent)]
        compression = (
            grpc.Compression.Gzip
            if config.compression == COMPRESSION_GZIP
            else grpc.Compression.NoCompression
        )
        if self._tls:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read_optional(config.certificate_file),
                private_key=_read_optional(config.client_key_file),
                certificate_chain=_read_optional(config.client_certificate_file),
            )
            self._channel = grpc.secure_channel(
                target, credentials, options=options, compression=compression
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
            if code.name == "UNAVAILABLE" and (misconfigured := self._misconfiguration(error)):
                return _misconfigured(misconfigured, detail)
            if code.name in _GRPC_RETRYABLE_CODES:
                return SendOutcome(
                    SendResult.RETRYABLE, retry_after_s=_grpc_retry_delay(error), detail=detail
                )
            return SendOutcome(SendResult.PERMANENT, detail=detail)
        rejected, message = _rejected_items(response, self._signal)
        return SendOutcome(SendResult.SENT, rejected=rejected, detail=message)

    def _misconfiguration(self, error: grpc.Call) -> str:
        """What grpc's connection error says is wrong with the endpoint; empty if nothing."""
        details = error.details() or ""
        settings = self._settings
        if any(sign in details for sign in _GRPC_SAW_HTTP1):
            return (
                f"the endpoint speaks HTTP/1.1, not gRPC: set {settings.protocol}=http/protobuf "
                f"to export OTLP/HTTP there, or point {settings.endpoint} at the gRPC port "
                f"(4317 by default)"
            )
        if self._tls and any(reason in details for reason in _NOT_TLS_REASONS):
            return (
                f"the endpoint does not speak TLS (plain-text gRPC): use an http:// URL in "
                f"{settings.endpoint}, or set {settings.insecure}=true"
            )
        if self._tls and _CERTIFICATE_UNTRUSTED in details:
            # "...CERTIFICATE_VERIFY_FAILED: self signed certificate: OK": the verify message.
            why = details.split(_CERTIFICATE_UNTRUSTED, 1)[1].lstrip(": ").split(":", 1)[0]
            return settings.untrusted_certificate(why or "certificate verify failed")
        if self._tls and _GRPC_HOSTNAME_MISMATCH in details:
            return settings.hostname_mismatch(_GRPC_HOSTNAME_MISMATCH)
        return ""

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
        self._settings = _Settings(config, signal)
        self._probe_tls = True  # at most one TLS probe until a request goes through
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
        self._ssl_context = _client_ssl_context(config) if self._tls else None
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
                reused = False
                with self._lock:
                    connection = self._connection = self._new_connection(timeout_s)
                status, reason, will_close, retry_after, data = self._post(connection, body)
        except (OSError, http.client.HTTPException, ValueError, AttributeError) as error:
            # ValueError/AttributeError: the connection was closed under us (shutdown abort).
            self._drop_connection(connection)
            detail = f"connection error: {error!r}"
            if misconfigured := self._misconfiguration(
                error, fresh=not reused, timeout_s=timeout_s
            ):
                return _misconfigured(misconfigured, detail)
            return SendOutcome(SendResult.RETRYABLE, detail=detail)
        if will_close:
            self._drop_connection(connection)
        self._probe_tls = True
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
        if status == http.client.NOT_FOUND:
            return _misconfigured(self._wrong_path(), detail)
        return SendOutcome(SendResult.PERMANENT, detail=detail)

    def _misconfiguration(self, error: Exception, *, fresh: bool, timeout_s: float) -> str:
        """What ``error`` says is wrong with the endpoint (not a passing failure); empty if
        nothing. ``fresh``: it happened on a new connection, whose first answer it is."""
        settings = self._settings
        speaks_tls = (
            f"the endpoint speaks TLS, not plain text: use an https:// URL in {settings.endpoint}"
        )
        if isinstance(error, http.client.BadStatusLine):
            line = str(error.args[0]) if error.args else ""
            if _is_http2_frame(line):
                return (
                    f"the endpoint speaks gRPC (HTTP/2), not OTLP/HTTP: set "
                    f"{settings.protocol}=grpc to export with gRPC there, or point "
                    f"{settings.endpoint} at the OTLP/HTTP port (4318 by default)"
                )
            if line[:1] in _TLS_RECORD_TYPES and line[1:2] == "\x03" and not self._tls:
                return speaks_tls
            return ""
        if isinstance(error, ssl.SSLCertVerificationError) and self._tls:
            why = error.verify_message or str(error)
            if error.verify_code in _HOST_MISMATCH_CODES:
                return settings.hostname_mismatch(why)
            return settings.untrusted_certificate(why)
        if isinstance(error, ssl.SSLError) and self._tls:
            if getattr(error, "reason", None) in _NOT_TLS_REASONS:
                return (
                    f"the endpoint does not speak TLS (plain text): use an http:// URL in "
                    f"{settings.endpoint}"
                )
            return ""
        if (
            fresh
            and not self._tls
            and self._probe_tls
            and isinstance(error, (ConnectionResetError, http.client.RemoteDisconnected))
        ):
            # A TLS server hangs up on plain text without a word (OpenSSL, BoringSSL); ask it
            # once whether it speaks TLS rather than retrying into the same wall.
            self._probe_tls = False
            if _speaks_tls(self._host, self._port, min(timeout_s, _TLS_PROBE_TIMEOUT_S)):
                return speaks_tls
        return ""

    def _wrong_path(self) -> str:
        path, expected = self._path, self._signal.http_path
        settings = self._settings
        if path.split("?", 1)[0].endswith(expected):
            return (
                f"the server answered 404 for path {path!r}: it has no OTLP/HTTP "
                f"{self._signal.name} receiver there; check that {settings.endpoint} names the "
                f"collector's OTLP/HTTP port (4318 by default)"
            )
        if settings.endpoint_is_full_url:
            hint = (
                f"{settings.endpoint} is used as it is: give the full URL ending in {expected}, "
                f"or set {_ENV_PREFIX}ENDPOINT to the base URL and {expected} is appended"
            )
        else:
            hint = (
                f"{expected} is appended to {settings.endpoint}, which should be the base URL "
                f"(scheme, host and port, e.g. http://collector:4318)"
            )
        return (
            f"the server answered 404 for path {path!r}: OTLP/HTTP expects {expected} there; {hint}"
        )

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


def _read_optional(path: str) -> bytes | None:
    """The bytes of the file at ``path``; None for an empty path (the setting is unset)."""
    if not path:
        return None
    with open(path, "rb") as file:
        return file.read()


def _client_ssl_context(config: OtlpExporterConfig) -> ssl.SSLContext:
    """Verifies the server against ``certificate_file`` (else the system's trust store) and
    presents the client certificate, if the configuration names one."""
    context = ssl.create_default_context(cafile=config.certificate_file or None)
    if config.client_certificate_file:
        # No prompt for a passphrase: validate() refused encrypted keys, this fails if one came.
        context.load_cert_chain(
            config.client_certificate_file, config.client_key_file, password=lambda: b""
        )
    return context


def _is_http2_frame(line: str) -> bool:
    """Whether an HTTP/1 status line is really an HTTP/2 server's first frame (SETTINGS or
    GOAWAY on stream 0), as ``http.client`` read it (latin-1)."""
    return (
        len(line) >= _HTTP2_FRAME_HEADER_BYTES
        and line[3] in _HTTP2_CONNECTION_FRAMES
        and line[5:9] == "\x00\x00\x00\x00"
    )


def _speaks_tls(host: str, port: int, timeout_s: float) -> bool:
    """Whether a TLS handshake with ``host:port`` gets a TLS answer (no certificate checks:
    this only asks which protocol the server speaks, nothing is sent over it)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with (
            socket.create_connection((host, port), timeout=timeout_s) as raw,
            context.wrap_socket(raw, server_hostname=host or None),
        ):
            return True
    except ssl.SSLError as error:  # a TLS alert (e.g. a client certificate required) is TLS too
        return str(getattr(error, "reason", "")).startswith(("TLSV1", "SSLV3", "TLSV13"))
    except (OSError, ValueError):
        return False


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
