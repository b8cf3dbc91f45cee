"""The OTLP/HTTP receiver's request handling: a raw ASGI app, and the OTLP body codecs.

No web framework and no server here: :mod:`.otlp_http` serves this app with uvicorn. The app
answers every request itself (status codes, ``google.rpc.Status`` bodies, ``Retry-After``).

Where each request's work runs: a small protobuf body (at most ``inline_max_bytes``, also once
decompressed) is decoded and validated on the event loop, and handed to the consumer there too
when the consumer declares that it never blocks (``consumer.never_blocks``); a consumer that may
block (the collector's pipeline waiting for the spool's fsync) is called on the thread pool.
Larger bodies and OTLP/JSON (decoded in Python, several times slower per byte) go to the thread
pool whole. So neither a consumer that waits nor a large body stalls the event loop that serves
every other connection, while a small export to a consumer that never blocks costs no thread
switch: handing work to a pool thread and its result back (two wake-ups and two handovers of
the GIL, about 0.2 ms) took about 40% off what one sequential sender got through. Decoding a
large body on a pool thread does not free the loop either (the GIL), but the loop gets its turn
every switch interval (5 ms) instead of waiting for the end.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import time
import zlib
from collections.abc import Awaitable, Callable, MutableMapping
from concurrent.futures import Executor
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Final

from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message
from google.rpc import code_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tokentrace.collector.consumer import Overloaded, TraceConsumer, Unavailable, never_blocks
from tokentrace.collector.receivers import (
    ConsumerFailed,
    ReceiverCounters,
    ValidExport,
    bearer_token_matches,
    hand_over,
    validate_export,
)
from tokentrace.collector.receivers.validate import DEFAULT_SPAN_LIMITS, SpanLimits

__all__ = ["TRACES_PATH", "OtlpHttpApp", "otlp_json_to_request"]

_log = logging.getLogger(__name__.rpartition(".")[0] + ".otlp_http")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

TRACES_PATH = "/v1/traces"
_PROTOBUF = "application/x-protobuf"
_JSON = "application/json"
_DECOMPRESS_CHUNK = 64 * 1024
_DEFAULT_INLINE_MAX_BYTES: Final = 64 * 1024
"""Protobuf bodies up to this size (decompressed) are decoded and validated on the event loop:
about half a millisecond of work (a 500-span export is about 190 KB and takes 2 ms), less than
the GIL switch interval for which decoding on a pool thread would hold the loop up anyway."""
# Unavailable carries no delay of its own: ask for a short pause (the sender may be routed to
# another replica meanwhile).
_UNAVAILABLE_RETRY_AFTER_S = 1
# Before closing a connection whose request body was not read (see OtlpHttpApp._drain): at most
# this long and this much in all, and no longer than _LINGER_IDLE_S without a byte.
_LINGER_S = 1.0
_LINGER_IDLE_S = 0.25
_LINGER_MAX_BYTES = 2 * 1024 * 1024

# OTLP/JSON ids are hex, while protobuf's JSON mapping expects base64 for bytes fields.
_SPAN_ID_KEYS = ("traceId", "trace_id", "spanId", "span_id", "parentSpanId", "parent_span_id")
_LINK_ID_KEYS = ("traceId", "trace_id", "spanId", "span_id")

_RPC_CODES: dict[HTTPStatus, int] = {
    HTTPStatus.BAD_REQUEST: code_pb2.INVALID_ARGUMENT,
    HTTPStatus.UNAUTHORIZED: code_pb2.UNAUTHENTICATED,
    HTTPStatus.NOT_FOUND: code_pb2.UNIMPLEMENTED,
    HTTPStatus.METHOD_NOT_ALLOWED: code_pb2.UNIMPLEMENTED,
    HTTPStatus.REQUEST_TIMEOUT: code_pb2.DEADLINE_EXCEEDED,
    HTTPStatus.LENGTH_REQUIRED: code_pb2.INVALID_ARGUMENT,
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: code_pb2.RESOURCE_EXHAUSTED,
    HTTPStatus.UNSUPPORTED_MEDIA_TYPE: code_pb2.INVALID_ARGUMENT,
    HTTPStatus.TOO_MANY_REQUESTS: code_pb2.RESOURCE_EXHAUSTED,
    HTTPStatus.INTERNAL_SERVER_ERROR: code_pb2.INTERNAL,
    HTTPStatus.SERVICE_UNAVAILABLE: code_pb2.UNAVAILABLE,
}


class _BadRequest(Exception):
    """The body cannot be decoded: 400 (or ``status`` when given)."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> None:
        super().__init__(message)
        self.status = status


class _DecompressedTooLarge(_BadRequest):
    """The body inflates past the limit given to ``_decompress``: 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"decompressed body exceeds {limit} bytes", HTTPStatus.REQUEST_ENTITY_TOO_LARGE
        )


# -- OTLP body codecs ---------------------------------------------------------------------------


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
                    raise _DecompressedTooLarge(limit)
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


def _decode(
    body: bytes, content_type: str, encoding: str, limit: int
) -> tuple[ExportTraceServiceRequest, bytes | None]:
    """Decompress and decode one request body: the request, and the protobuf bytes it was
    decoded from (None for JSON). Raises _BadRequest."""
    if encoding in ("gzip", "deflate") and body:
        body = _decompress(body, encoding, limit)
    if content_type == _JSON:
        try:
            return otlp_json_to_request(json.loads(body)), None
        except (ValueError, TypeError, RecursionError, json_format.ParseError) as error:
            raise _BadRequest(f"invalid OTLP/JSON: {error}") from error
    try:
        return ExportTraceServiceRequest.FromString(body), body
    except (DecodeError, RecursionError) as error:
        raise _BadRequest(f"invalid OTLP protobuf: {error}") from error


def _encode(content_type: str, message: Message) -> bytes:
    if content_type == _JSON:
        return json_format.MessageToJson(message, indent=None).encode()
    return message.SerializeToString()


def _retry_after_header(retry_after_s: float) -> str:
    # Retry-After takes whole seconds; round up so the sender never comes back early.
    if not math.isfinite(retry_after_s):
        return "1"
    return str(max(0, math.ceil(retry_after_s)))


# -- replies ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Reply:
    status: HTTPStatus
    content_type: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()
    close: bool = False


def _status_reply(
    status: HTTPStatus,
    content_type: str,
    message: str,
    *,
    close: bool = False,
    headers: tuple[tuple[str, str], ...] = (),
) -> _Reply:
    error = status_pb2.Status(code=_RPC_CODES.get(status, code_pb2.UNKNOWN), message=message)
    return _Reply(status, content_type, _encode(content_type, error), headers, close)


def _shutting_down_reply() -> _Reply:
    return _status_reply(
        HTTPStatus.SERVICE_UNAVAILABLE,
        _PROTOBUF,
        "receiver shutting down",
        close=True,
        headers=(("Retry-After", str(_UNAVAILABLE_RETRY_AFTER_S)),),
    )


def _header_values(scope: Scope) -> dict[str, list[str]]:
    """Every header of the request by lowercase name, values in arrival order."""
    values: dict[str, list[str]] = {}
    for raw_name, raw_value in scope["headers"]:
        name = raw_name.decode("latin-1").lower()
        values.setdefault(name, []).append(raw_value.decode("latin-1"))
    return values


def _framing_error(headers: dict[str, list[str]]) -> str | None:
    """Why the request's framing is ambiguous (request smuggling), or None."""
    lengths = {
        part.strip() for value in headers.get("content-length", ()) for part in value.split(",")
    }
    if len(lengths) > 1:
        return "conflicting Content-Length headers"
    if lengths and "transfer-encoding" in headers:
        return "both Content-Length and Transfer-Encoding"
    return None


def _media_type(headers: dict[str, list[str]]) -> str | None:
    values = headers.get("content-type")
    if not values:
        return None
    media_type = values[0].split(";", 1)[0].strip().lower()
    return media_type if media_type in (_PROTOBUF, _JSON) else None


class _BodyUnread:
    """Whether the request body may still have bytes on the way (then: drain before closing)."""

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending = True


class OtlpHttpApp:
    """ASGI 3 app for ``POST /v1/traces``: OTLP protobuf and JSON, gzip/deflate, bearer token.

    Status codes follow OTLP 1.x: 200 (``partial_success`` when spans were rejected), 400 (also
    ambiguous framing: conflicting Content-Length headers, Content-Length with
    Transfer-Encoding), 401, 404, 405, 408, 411, 413, 415, 429/503 with ``Retry-After``, 500.
    The reply uses the request's content type; errors carry a ``google.rpc.Status``.
    ``executor`` runs what may not run on the event loop (module docstring).
    """

    def __init__(
        self,
        consumer: TraceConsumer,
        counters: ReceiverCounters,
        executor: Executor,
        *,
        max_request_body_size: int,
        auth_token: str | None,
        read_timeout_s: float,
        inline_max_bytes: int = _DEFAULT_INLINE_MAX_BYTES,
        span_limits: SpanLimits = DEFAULT_SPAN_LIMITS,
    ) -> None:
        self._consumer = consumer
        self._consumer_never_blocks = never_blocks(consumer)
        self._counters = counters
        self._executor = executor
        self._limit = max_request_body_size
        self._inline_limit = min(inline_max_bytes, max_request_body_size)
        self._auth_token = auth_token
        self._read_timeout_s = read_timeout_s
        self._span_limits = span_limits
        self.stopping = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan is off and websockets are not served
            return
        unread = _BodyUnread()
        try:
            reply = await self._handle(scope, receive, unread)
        except asyncio.CancelledError:
            if not self.stopping:
                raise
            # The server's shutdown grace ran out while the consumer still had this request:
            # ask the sender to retry rather than leave it with a bare 500.
            reply = _shutting_down_reply()
        except Exception:
            self._counters.add("failed_requests")
            _log.error("OTLP HTTP export failed inside the receiver", exc_info=True)
            reply = _status_reply(
                HTTPStatus.INTERNAL_SERVER_ERROR, _PROTOBUF, "receiver error", close=True
            )
        if reply is not None:  # None: the client went away
            await self._send(reply, send, receive, unread)

    async def _handle(self, scope: Scope, receive: Receive, unread: _BodyUnread) -> _Reply | None:
        headers = _header_values(scope)
        counters = self._counters
        if self.stopping:  # a request that arrived while the server shuts down
            return _shutting_down_reply()
        framing_error = _framing_error(headers)
        if framing_error is not None:
            counters.add("malformed_requests")
            return _status_reply(HTTPStatus.BAD_REQUEST, _PROTOBUF, framing_error, close=True)
        if scope["path"] != TRACES_PATH:
            return _status_reply(HTTPStatus.NOT_FOUND, _PROTOBUF, "unknown path", close=True)
        if scope["method"] != "POST":
            return _status_reply(
                HTTPStatus.METHOD_NOT_ALLOWED,
                _PROTOBUF,
                "only POST is allowed",
                close=True,
                headers=(("Allow", "POST"),),
            )
        media_type = _media_type(headers)
        content_type = media_type or _PROTOBUF
        if self._auth_token is not None:
            authorization = headers.get("authorization")
            if not bearer_token_matches(
                authorization[0] if authorization else None, self._auth_token
            ):
                counters.add("unauthenticated_requests")
                return _status_reply(
                    HTTPStatus.UNAUTHORIZED,
                    content_type,
                    "missing or invalid bearer token",
                    close=True,
                    headers=(("WWW-Authenticate", "Bearer"),),
                )
        if media_type is None:
            counters.add("malformed_requests")
            declared = headers.get("content-type")
            return _status_reply(
                HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                _PROTOBUF,
                f"unsupported content type {declared[0] if declared else None!r}; "
                f"use {_PROTOBUF} or {_JSON}",
                close=True,
            )
        encodings = headers.get("content-encoding")
        encoding = (encodings[0] if encodings else "identity").strip().lower()
        if encoding not in ("identity", "gzip", "deflate", "none"):
            counters.add("malformed_requests")
            return _status_reply(
                HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                content_type,
                f"unsupported content encoding {encoding!r}",
                close=True,
            )
        lengths = headers.get("content-length")
        if not lengths:
            counters.add("malformed_requests")
            return _status_reply(
                HTTPStatus.LENGTH_REQUIRED, content_type, "Content-Length required", close=True
            )
        length_text = lengths[0].split(",", 1)[0].strip()
        if not length_text.isdigit():  # the HTTP parser already refuses these
            counters.add("malformed_requests")
            return _status_reply(
                HTTPStatus.BAD_REQUEST, content_type, "invalid Content-Length", close=True
            )
        length = int(length_text)
        if length > self._limit:
            counters.add("malformed_requests")
            # Not reading the body: the connection closes (its bytes may still be in flight).
            return _status_reply(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                content_type,
                f"body of {length} bytes exceeds the limit of {self._limit} bytes",
                close=True,
            )
        try:
            body = await self._read_body(receive, unread)
        except asyncio.TimeoutError:
            return _status_reply(
                HTTPStatus.REQUEST_TIMEOUT, content_type, "request body too slow", close=True
            )
        if body is None:
            return None
        loop = asyncio.get_running_loop()
        if content_type == _PROTOBUF and len(body) <= self._inline_limit:
            validated = self._validate(body, content_type, encoding, self._inline_limit)
            if isinstance(validated, _Reply):
                return validated
            if validated is not None:
                if self._consumer_never_blocks or not validated.accepted_spans:
                    return self._hand_over(validated, content_type)
                return await loop.run_in_executor(
                    self._executor, self._hand_over, validated, content_type
                )
            # None: it inflates past the inline limit; decoded again on a pool thread.
        return await loop.run_in_executor(
            self._executor, self._export, body, content_type, encoding
        )

    async def _read_body(self, receive: Receive, unread: _BodyUnread) -> bytes | None:
        """The whole body, or None when the client went away (the HTTP parser enforces the
        declared length, so a body never exceeds it)."""
        chunks: list[bytes] = []
        while True:
            message = await asyncio.wait_for(receive(), self._read_timeout_s)
            if message["type"] == "http.disconnect":
                unread.pending = False
                return None
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                unread.pending = False
                return b"".join(chunks)

    def _export(self, body: bytes, content_type: str, encoding: str) -> _Reply:
        """Decode, validate and deliver (on the thread pool): the reply to send."""
        validated = self._validate(body, content_type, encoding, self._limit)
        assert validated is not None  # only a lower limit than the body limit gives None
        if isinstance(validated, _Reply):
            return validated
        return self._hand_over(validated, content_type)

    def _validate(
        self, body: bytes, content_type: str, encoding: str, limit: int
    ) -> ValidExport | _Reply | None:
        """Decode (inflating to at most ``limit`` bytes) and validate: the export, or the
        reply to an undecodable body. None when the body inflates past a ``limit`` lower than
        the body limit (it is not malformed: decode it again with the body limit)."""
        try:
            request, encoded = _decode(body, content_type, encoding, limit)
        except _BadRequest as error:
            if isinstance(error, _DecompressedTooLarge) and limit < self._limit:
                return None
            self._counters.add("malformed_requests")
            return _status_reply(error.status, content_type, str(error)[:512])
        return validate_export(request, encoded=encoded, limits=self._span_limits)

    def _hand_over(self, validated: ValidExport, content_type: str) -> _Reply:
        """The consumer call (on the loop only when the consumer never blocks): the reply."""
        try:
            response = hand_over(self._consumer, validated, self._counters)
        except Overloaded as refusal:
            return _status_reply(
                HTTPStatus.TOO_MANY_REQUESTS,
                content_type,
                str(refusal) or "collector overloaded",
                headers=(("Retry-After", _retry_after_header(refusal.retry_after_s)),),
            )
        except Unavailable as refusal:
            return _status_reply(
                HTTPStatus.SERVICE_UNAVAILABLE,
                content_type,
                str(refusal) or "collector unavailable",
                headers=(("Retry-After", str(_UNAVAILABLE_RETRY_AFTER_S)),),
            )
        except ConsumerFailed as failure:
            return _status_reply(HTTPStatus.INTERNAL_SERVER_ERROR, content_type, str(failure))
        return _Reply(HTTPStatus.OK, content_type, _encode(content_type, response))

    async def _send(self, reply: _Reply, send: Send, receive: Receive, unread: _BodyUnread) -> None:
        headers = [
            (b"Content-Type", reply.content_type.encode("latin-1")),
            (b"Content-Length", str(len(reply.body)).encode("ascii")),
        ]
        headers.extend(
            (name.encode("latin-1"), value.encode("latin-1")) for name, value in reply.headers
        )
        if reply.close:
            headers.append((b"Connection", b"close"))
        await send({"type": "http.response.start", "status": int(reply.status), "headers": headers})
        if not (reply.close and unread.pending):
            await send({"type": "http.response.body", "body": reply.body})
            return
        # Closing a socket with unread request bytes makes the kernel send RST, which can
        # destroy the reply before the client reads it (a 413 while the client is still
        # sending). The reply goes out now; the connection closes after a bounded drain.
        await send({"type": "http.response.body", "body": reply.body, "more_body": True})
        await self._drain(receive)
        await send({"type": "http.response.body", "body": b""})

    @staticmethod
    async def _drain(receive: Receive) -> None:
        deadline = time.monotonic() + _LINGER_S
        drained = 0
        while drained < _LINGER_MAX_BYTES:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                message = await asyncio.wait_for(receive(), min(remaining, _LINGER_IDLE_S))
            except asyncio.TimeoutError:
                return
            if message["type"] != "http.request" or not message.get("more_body", False):
                return
            drained += len(message.get("body", b""))
