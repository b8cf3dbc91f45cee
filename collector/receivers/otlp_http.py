"""OTLP/HTTP trace receiver (``POST /v1/traces``), standard library only.

Binary protobuf (``application/x-protobuf``) and OTLP/JSON (``application/json``: hex trace and
span ids, lowerCamelCase keys, int64 as strings) with ``Content-Encoding`` gzip, deflate or
identity. The response uses the request's content type; errors carry a ``google.rpc.Status``.
Status codes follow OTLP 1.x: 200 (``partial_success`` when spans were rejected), 400, 401, 404,
405, 411, 413, 415, 429/503 with ``Retry-After``, 500.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import socket
import ssl
import threading
import time
import zlib
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast
from urllib.parse import urlsplit

from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message
from google.rpc import code_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tokentrace.collector.consumer import Overloaded, TraceConsumer, Unavailable
from tokentrace.collector.receivers import (
    ConsumerFailed,
    OtlpReceiverBase,
    ReceiverStartError,
    bearer_token_matches,
    deliver,
)

__all__ = ["OtlpHttpReceiver", "ReceiverStartError", "otlp_json_to_request"]

_log = logging.getLogger(__name__)

_DEFAULT_ENDPOINT = "127.0.0.1:4318"
_DEFAULT_MAX_REQUEST_BODY_SIZE = 20 * 1024 * 1024
_DEFAULT_MAX_CONNECTIONS = 64
_DEFAULT_SOCKET_TIMEOUT_S = 30.0
_DEFAULT_SHUTDOWN_GRACE_S = 5.0
# Unavailable carries no delay of its own: ask for a short pause (the sender may be routed to
# another replica meanwhile).
_UNAVAILABLE_RETRY_AFTER_S = 1

TRACES_PATH = "/v1/traces"
_PROTOBUF = "application/x-protobuf"
_JSON = "application/json"
_DECOMPRESS_CHUNK = 64 * 1024
# Before closing a connection whose request body was not read (see _drain_before_close).
_LINGER_S = 1.0
_LINGER_MAX_BYTES = 2 * 1024 * 1024
_OVER_CAPACITY_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\n"
    b"Content-Length: 0\r\nConnection: close\r\n\r\n"
)

# OTLP/JSON ids are hex, while protobuf's JSON mapping expects base64 for bytes fields.
_SPAN_ID_KEYS = ("traceId", "trace_id", "spanId", "span_id", "parentSpanId", "parent_span_id")
_LINK_ID_KEYS = ("traceId", "trace_id", "spanId", "span_id")


class _BadRequest(Exception):
    """The body cannot be decoded: 400 (or ``status`` when given)."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> None:
        super().__init__(message)
        self.status = status


def _hex_ids_to_base64(container: dict[str, Any], keys: tuple[str, ...]) -> None:
    for key in keys:
        value = container.get(key)
        if isinstance(value, str):
            try:
                container[key] = base64.b64encode(bytes.fromhex(value)).decode("ascii")
            except ValueError:
                # Not hex: leave the id empty so validation rejects just this span.
                container[key] = ""


def _items(container: Any, *keys: str) -> list[Any]:
    """The list under the first present key, or [] (shape errors surface in ParseDict)."""
    if isinstance(container, dict):
        for key in keys:
            value = container.get(key)
            if isinstance(value, list):
                return value
    return []


def otlp_json_to_request(document: Any) -> ExportTraceServiceRequest:
    """Build a request from a decoded OTLP/JSON document (rewrites its hex ids in place).

    Raises ``json_format.ParseError`` (or TypeError/ValueError) when it is not a valid request.
    """
    for resource_spans in _items(document, "resourceSpans", "resource_spans"):
        for scope_spans in _items(resource_spans, "scopeSpans", "scope_spans"):
            for span in _items(scope_spans, "spans"):
                if not isinstance(span, dict):
                    continue
                _hex_ids_to_base64(span, _SPAN_ID_KEYS)
                for link in _items(span, "links"):
                    if isinstance(link, dict):
                        _hex_ids_to_base64(link, _LINK_ID_KEYS)
    request = ExportTraceServiceRequest()
    json_format.ParseDict(document, request, ignore_unknown_fields=True)
    return request


def _decompress(body: bytes, encoding: str, limit: int) -> bytes:
    """Inflate ``body`` (gzip: all members; deflate: zlib or raw) to at most ``limit`` bytes."""
    if encoding == "gzip":
        wbits = 16 + zlib.MAX_WBITS
    elif body[:1] and (body[0] & 0x0F) == 8 and int.from_bytes(body[:2], "big") % 31 == 0:
        wbits = zlib.MAX_WBITS  # zlib-wrapped, what HTTP "deflate" means
    else:
        wbits = -zlib.MAX_WBITS  # raw deflate, which some clients send instead
    output: list[bytes] = []
    produced = 0
    remaining = body
    try:
        while True:
            inflater = zlib.decompressobj(wbits)
            pending = remaining
            while True:
                # max_length bounds memory: a bomb never expands past limit + one chunk.
                chunk = inflater.decompress(pending, _DECOMPRESS_CHUNK)
                produced += len(chunk)
                if produced > limit:
                    raise _BadRequest(
                        f"decompressed body exceeds {limit} bytes",
                        HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                    )
                output.append(chunk)
                pending = inflater.unconsumed_tail
                if inflater.eof:
                    break
                if not chunk and not pending:
                    raise _BadRequest(f"truncated {encoding} body")
            remaining = inflater.unused_data
            if encoding != "gzip" or not remaining:
                break
    except zlib.error as error:
        raise _BadRequest(f"invalid {encoding} body: {error}") from error
    return b"".join(output)


def _status_body(content_type: str, code: int, message: str) -> bytes:
    status = status_pb2.Status(code=code, message=message)
    return _encode(content_type, status)


def _encode(content_type: str, message: Message) -> bytes:
    if content_type == _JSON:
        return json_format.MessageToJson(message, indent=None).encode()
    return message.SerializeToString()


def _retry_after_header(retry_after_s: float) -> str:
    # Retry-After takes whole seconds; round up so the sender never comes back early.
    if not math.isfinite(retry_after_s):
        return "1"
    return str(max(0, math.ceil(retry_after_s)))


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # No request queue beyond the listen backlog: connections above max_connections get 503.
    request_queue_size = 128

    def __init__(
        self,
        address: tuple[str, int],
        receiver: OtlpHttpReceiver,
        *,
        address_family: socket.AddressFamily,
        max_connections: int,
        tls_context: ssl.SSLContext | None,
    ) -> None:
        self.address_family = address_family
        self.receiver = receiver
        self._connection_slots = threading.BoundedSemaphore(max_connections)
        self._tls_context = tls_context
        self.stopping = False
        super().__init__(address, _Handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        connection, address = super().get_request()
        if self._tls_context is not None:
            # The handshake happens lazily in the connection's own thread, so a slow client
            # cannot stall the accept loop.
            connection = self._tls_context.wrap_socket(
                connection, server_side=True, do_handshake_on_connect=False
            )
        return connection, address

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._connection_slots.acquire(blocking=False):
            self.receiver._counters.add("refused_connections")
            # Plain TCP: a best-effort 503 (short timeout, this is the accept thread). TLS: the
            # handshake has not happened yet and must not happen here, so just close.
            if not isinstance(request, ssl.SSLSocket):
                try:
                    request.settimeout(0.5)
                    request.sendall(_OVER_CAPACITY_RESPONSE)
                except OSError:
                    pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._connection_slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Client resets, TLS failures, timeouts: not worth a traceback on stderr.
        _log.debug("OTLP HTTP connection from %s failed", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    server_version = "tokentrace-otlp"
    sys_version = ""
    server: _Server
    _head_only = False
    _unread_input = False

    def setup(self) -> None:
        super().setup()
        # Bounds idle keep-alive connections and slow senders (each holds a thread).
        self.connection.settimeout(self.server.receiver._socket_timeout_s)

    # -- methods --------------------------------------------------------------------------
    def do_POST(self) -> None:
        receiver = self.server.receiver
        content_type = _PROTOBUF
        try:
            if self.server.stopping:  # a keep-alive connection outliving shutdown()
                self._reply_status(
                    HTTPStatus.SERVICE_UNAVAILABLE,
                    content_type,
                    "receiver shutting down",
                    close=True,
                    extra_headers=(("Retry-After", str(_UNAVAILABLE_RETRY_AFTER_S)),),
                )
                return
            if urlsplit(self.path).path != TRACES_PATH:
                self._reply_status(HTTPStatus.NOT_FOUND, content_type, "unknown path", close=True)
                return
            content_type = self._media_type() or _PROTOBUF
            if receiver._auth_token is not None and not bearer_token_matches(
                self.headers.get("Authorization"), receiver._auth_token
            ):
                receiver._counters.add("unauthenticated_requests")
                self._reply_status(
                    HTTPStatus.UNAUTHORIZED,
                    content_type,
                    "missing or invalid bearer token",
                    close=True,
                    extra_headers=(("WWW-Authenticate", "Bearer"),),
                )
                return
            request = self._read_request(content_type)
            if request is None:
                return
            try:
                response = deliver(receiver._consumer, request, receiver._counters)
            except Overloaded as refusal:
                self._reply_status(
                    HTTPStatus.TOO_MANY_REQUESTS,
                    content_type,
                    str(refusal) or "collector overloaded",
                    extra_headers=(("Retry-After", _retry_after_header(refusal.retry_after_s)),),
                )
                return
            except Unavailable as refusal:
                self._reply_status(
                    HTTPStatus.SERVICE_UNAVAILABLE,
                    content_type,
                    str(refusal) or "collector unavailable",
                    extra_headers=(("Retry-After", str(_UNAVAILABLE_RETRY_AFTER_S)),),
                )
                return
            except ConsumerFailed as failure:
                self._reply_status(HTTPStatus.INTERNAL_SERVER_ERROR, content_type, str(failure))
                return
            self._reply(HTTPStatus.OK, content_type, _encode(content_type, response))
        except (ConnectionError, TimeoutError, ssl.SSLError):
            self.close_connection = True
        except Exception:
            receiver._counters.add("failed_requests")
            _log.error("OTLP HTTP export failed inside the receiver", exc_info=True)
            try:
                self._reply_status(
                    HTTPStatus.INTERNAL_SERVER_ERROR, content_type, "receiver error", close=True
                )
            except OSError:
                self.close_connection = True

    def _wrong_method(self) -> None:
        if urlsplit(self.path).path != TRACES_PATH:
            self._reply_status(HTTPStatus.NOT_FOUND, _PROTOBUF, "unknown path", close=True)
        else:
            self._reply_status(
                HTTPStatus.METHOD_NOT_ALLOWED,
                _PROTOBUF,
                "only POST is allowed",
                close=True,
                extra_headers=(("Allow", "POST"),),
            )

    do_GET = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _wrong_method

    def do_HEAD(self) -> None:
        self._head_only = True
        self._wrong_method()

    # -- request --------------------------------------------------------------------------
    def _media_type(self) -> str | None:
        header = self.headers.get("Content-Type")
        if header is None:
            return None
        media_type = header.split(";", 1)[0].strip().lower()
        return media_type if media_type in (_PROTOBUF, _JSON) else None

    def _read_request(self, content_type: str) -> ExportTraceServiceRequest | None:
        """Read, decompress and decode the body; on failure reply and return None."""
        receiver = self.server.receiver
        counters = receiver._counters
        limit = receiver._max_request_body_size
        if self._media_type() is None:
            counters.add("malformed_requests")
            self._reply_status(
                HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                _PROTOBUF,
                f"unsupported content type {self.headers.get('Content-Type')!r}; "
                f"use {_PROTOBUF} or {_JSON}",
                close=True,
            )
            return None
        encoding = (self.headers.get("Content-Encoding") or "identity").strip().lower()
        if encoding not in ("identity", "gzip", "deflate", "none"):
            counters.add("malformed_requests")
            self._reply_status(
                HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                content_type,
                f"unsupported content encoding {encoding!r}",
                close=True,
            )
            return None
        length_header = self.headers.get("Content-Length")
        if length_header is None:
            counters.add("malformed_requests")
            self._reply_status(
                HTTPStatus.LENGTH_REQUIRED, content_type, "Content-Length required", close=True
            )
            return None
        if not length_header.strip().isdigit():
            counters.add("malformed_requests")
            self._reply_status(
                HTTPStatus.BAD_REQUEST, content_type, "invalid Content-Length", close=True
            )
            return None
        length = int(length_header)
        if length > limit:
            counters.add("malformed_requests")
            # Not reading the body: the connection must close (its bytes are still in flight).
            self._reply_status(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                content_type,
                f"body of {length} bytes exceeds the limit of {limit} bytes",
                close=True,
            )
            return None
        body = self.rfile.read(length)
        if len(body) != length:  # client went away mid-body
            self.close_connection = True
            return None
        try:
            if encoding in ("gzip", "deflate") and body:
                body = _decompress(body, encoding, limit)
            if content_type == _JSON:
                try:
                    document = json.loads(body)
                    return otlp_json_to_request(document)
                except (ValueError, TypeError, RecursionError, json_format.ParseError) as error:
                    raise _BadRequest(f"invalid OTLP/JSON: {error}") from error
            try:
                return ExportTraceServiceRequest.FromString(body)
            except (DecodeError, RecursionError) as error:
                raise _BadRequest(f"invalid OTLP protobuf: {error}") from error
        except _BadRequest as error:
            counters.add("malformed_requests")
            self._reply_status(error.status, content_type, str(error)[:512])
            return None

    # -- response -------------------------------------------------------------------------
    def _reply_status(
        self,
        status: HTTPStatus,
        content_type: str,
        message: str,
        *,
        close: bool = False,
        extra_headers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        body = _status_body(content_type, _RPC_CODES.get(status, code_pb2.UNKNOWN), message)
        self._reply(status, content_type, body, close=close, extra_headers=extra_headers)

    def _reply(
        self,
        status: HTTPStatus,
        content_type: str,
        body: bytes,
        *,
        close: bool = False,
        extra_headers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in extra_headers:
            self.send_header(name, value)
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
            self._unread_input = True
        self.end_headers()
        if not self._head_only:
            self.wfile.write(body)

    def finish(self) -> None:
        super().finish()  # flushes the response
        if self._unread_input:
            self._drain_before_close()

    def _drain_before_close(self) -> None:
        # Closing a socket with unread request bytes makes the kernel send RST, which can
        # destroy the error response before the client reads it (e.g. a 413 while the client is
        # still sending). Half-close, then discard a bounded amount for a bounded time.
        try:
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(_LINGER_S)
            deadline = time.monotonic() + _LINGER_S
            drained = 0
            while drained < _LINGER_MAX_BYTES and time.monotonic() < deadline:
                chunk = self.connection.recv(_DECOMPRESS_CHUNK)
                if not chunk:
                    break
                drained += len(chunk)
        except OSError:
            pass

    def log_message(self, format: str, *args: Any) -> None:
        _log.debug("%s - " + format, self.address_string(), *args)


_RPC_CODES: dict[HTTPStatus, int] = {
    HTTPStatus.BAD_REQUEST: code_pb2.INVALID_ARGUMENT,
    HTTPStatus.UNAUTHORIZED: code_pb2.UNAUTHENTICATED,
    HTTPStatus.NOT_FOUND: code_pb2.UNIMPLEMENTED,
    HTTPStatus.METHOD_NOT_ALLOWED: code_pb2.UNIMPLEMENTED,
    HTTPStatus.LENGTH_REQUIRED: code_pb2.INVALID_ARGUMENT,
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: code_pb2.RESOURCE_EXHAUSTED,
    HTTPStatus.UNSUPPORTED_MEDIA_TYPE: code_pb2.INVALID_ARGUMENT,
    HTTPStatus.TOO_MANY_REQUESTS: code_pb2.RESOURCE_EXHAUSTED,
    HTTPStatus.INTERNAL_SERVER_ERROR: code_pb2.INTERNAL,
    HTTPStatus.SERVICE_UNAVAILABLE: code_pb2.UNAVAILABLE,
}


class OtlpHttpReceiver(OtlpReceiverBase):
    """Serves OTLP/HTTP trace exports on ``POST /v1/traces`` and hands valid spans to ``consumer``.

    One daemon thread per connection, at most ``max_connections`` at once (further connections
    get 503 and count as ``refused_connections``); idle keep-alive connections close after
    ``socket_timeout_s``. Binds loopback by default; TLS and a bearer token are opt-in.
    """

    def __init__(
        self,
        consumer: TraceConsumer,
        *,
        endpoint: str = _DEFAULT_ENDPOINT,
        max_request_body_size: int = _DEFAULT_MAX_REQUEST_BODY_SIZE,
        auth_token: str | None = None,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
        max_connections: int = _DEFAULT_MAX_CONNECTIONS,
        socket_timeout_s: float = _DEFAULT_SOCKET_TIMEOUT_S,
    ) -> None:
        super().__init__(
            consumer,
            endpoint=endpoint,
            auth_token=auth_token,
            tls_cert_file=tls_cert_file,
            tls_key_file=tls_key_file,
        )
        if max_request_body_size <= 0 or max_connections <= 0 or socket_timeout_s <= 0:
            raise ValueError(
                "max_request_body_size, max_connections and socket_timeout_s must be positive"
            )
        self._max_request_body_size = max_request_body_size
        self._max_connections = max_connections
        self._socket_timeout_s = socket_timeout_s
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Bind and serve in a daemon thread; raises ReceiverStartError if binding fails."""
        if self._server is not None:
            raise RuntimeError("receiver already started")
        host, port = self._bind_address()
        tls_context = self._tls_context()
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            server = _Server(
                (host, port),
                self,
                address_family=family,
                max_connections=self._max_connections,
                tls_context=tls_context,
            )
        except (OSError, UnicodeError) as error:
            raise ReceiverStartError(
                f"OTLP HTTP receiver cannot bind {self._endpoint}: {error}"
            ) from error
        self._server = server
        self._port = cast(int, server.server_address[1])
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.1},
            name=f"otlp-http-{self.port}",
            daemon=True,
        )
        self._thread.start()
        _log.debug("OTLP HTTP receiver listening on %s (port %d)", self._endpoint, self.port)

    def shutdown(self, grace_s: float = _DEFAULT_SHUTDOWN_GRACE_S) -> None:
        """Stop accepting and close the listening socket (waits up to ``grace_s`` for the loop).

        Requests already being handled finish on their own threads; later requests on kept-alive
        connections get 503 and the connection closes. Idempotent.
        """
        server, self._server = self._server, None
        thread, self._thread = self._thread, None
        if server is None:
            return
        server.stopping = True
        server.shutdown()
        if thread is not None:
            thread.join(grace_s)
        server.server_close()

    def _tls_context(self) -> ssl.SSLContext | None:
        if self._tls_cert_file is None or self._tls_key_file is None:
            return None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(self._tls_cert_file, self._tls_key_file)
        except (OSError, ssl.SSLError) as error:
            raise ReceiverStartError(
                f"OTLP HTTP receiver on {self._endpoint}: cannot load TLS files: {error}"
            ) from error
        return context
