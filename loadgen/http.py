"""A small asyncio HTTP/1.1 client for ``tokentrace load``: this module sends requests over a
pool of keep-alive connections and parses response heads; ``http_connection.py`` holds one
connection (socket, bounded read buffer, errors), ``http_response.py`` a response's body
(framing, server-sent events, limits).

Why not httpx or aiohttp: the load generator needs the clock reading of the socket read that
delivered each server-sent event (TTFT and inter-token gaps are measured from it) and of the
request's send, and both cost that accuracy (``bench/load_http_client.py``; numbers in
docs/performance.md). httpx needs 1.7-15x this client's CPU per event and reads events 1.5-6x
later. aiohttp reads as promptly, but before Python 3.12 it writes each request from a task of
its own one event-loop turn later, so the send time it reports is early by 3.5 ms at 16 streams
and 11 ms at 64 (this client: 0.09 and 1.3 ms), time the runner would book as the server's or
the network's; nor does it give the first byte's read or TCP_INFO right after connecting. The
client speaks just enough HTTP/1.1 for OpenAI-compatible endpoints: POST with a JSON body,
responses framed by Content-Length, chunked transfer coding or connection close, keep-alive
connection reuse, and ``text/event-stream`` bodies.

Each :class:`Response` also says what the client's side of the wire did, for the collector to
split the time the client saw but the server did not: whether its connection was reused (else
how long opening it took: for plain TCP to an IP address at most the round trip the kernel
measured for its handshake, the rest being the client late to run), when the request was handed
to the socket and when the response's first byte was read, and the kernel's view of the
connection (``agent/tcp_info.py``) when the body was complete: how long its last bytes had
waited before the client read them, and the smoothed round-trip time.
:meth:`Response.tcp_facts` gives the same on demand (the load runner asks once, at the first
token). None of this adds work per chunk: the client asks the kernel once per response, when its
body is complete, and reads the clock anew only around opening a connection.

Every socket-level failure (refused, reset, TLS, timeout, protocol violation) surfaces as
:class:`HttpError` naming ``host:port``; every buffer is bounded.
"""

from __future__ import annotations

import asyncio
import re
import ssl
import time
from collections import deque
from collections.abc import Callable, Mapping
from types import TracebackType
from urllib.parse import urlsplit

from tokentrace.loadgen.http_connection import (
    _MAX_HEADER_BYTES,
    HttpError,
    _Connection,
    _Counters,
    _PeerClosed,
    _size,
)
from tokentrace.loadgen.http_response import (
    _BODY_CHUNKED,
    _BODY_LENGTH,
    _BODY_NONE,
    _BODY_UNTIL_EOF,
    Response,
)

__all__ = ["HttpClient", "HttpError", "Response", "parse_base_url"]

_DEFAULT_TIMEOUT_S = 600.0
_DEFAULT_MAX_IDLE_CONNECTIONS = 1024
_USER_AGENT = "tokentrace-load"
_DEFAULT_CONTENT_TYPE = "application/json"
_DEFAULT_PORTS = {"http": 80, "https": 443}
_CONTENT_LENGTH = re.compile(r"[0-9]{1,20}")
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_HEADER_VALUE_FORBIDDEN = re.compile(r"[\r\n\x00]")
_TARGET_FORBIDDEN = re.compile(r"[^\x21-\x7e]")
FRAMING_HEADERS = frozenset({"content-length", "transfer-encoding"})
"""Request headers the client computes itself; caller-given values are ignored."""


def parse_base_url(url: str) -> tuple[str, str, int, str]:
    """(scheme ``'http'``/``'https'``, host, port, base path without trailing ``/``).

    Raises ValueError naming the problem: no scheme, unsupported scheme, no host, bad port,
    credentials, query or fragment.
    """
    if "://" not in url:
        raise ValueError(f"base URL {url!r} has no scheme; expected http://HOST[:PORT][/PATH]")
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise ValueError(f"base URL {url!r} has unsupported scheme {parts.scheme!r}; use http(s)")
    if "?" in url or "#" in url:
        raise ValueError(f"base URL {url!r} must not have a query or fragment")
    if "@" in parts.netloc:
        raise ValueError(
            f"base URL {url!r} must not carry credentials; pass an Authorization header"
        )
    host = parts.hostname
    if not host:
        raise ValueError(f"base URL {url!r} has no host")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"base URL {url!r} has a bad port ({exc})") from exc
    if port is None:
        port = _DEFAULT_PORTS[scheme]
    elif port == 0:
        raise ValueError(f"base URL {url!r} has a bad port (0)")
    path = parts.path.rstrip("/")
    if _TARGET_FORBIDDEN.search(path):
        raise ValueError(f"base URL {url!r} has spaces or control characters in its path")
    return scheme, host, port, path


def check_header(name: str, value: str) -> None:
    """ValueError unless ``name: value`` can be sent as an HTTP/1.1 request header."""
    if not _HEADER_NAME.fullmatch(name):
        raise ValueError(f"invalid HTTP header name {name!r}")
    if _HEADER_VALUE_FORBIDDEN.search(value):
        raise ValueError(f"HTTP header {name!r} has a line break or NUL in its value")
    try:
        value.encode("latin-1")
    except UnicodeEncodeError as exc:
        raise ValueError(f"HTTP header {name!r} has characters outside Latin-1") from exc


def _has_token(value: str | None, token: str) -> bool:
    return value is not None and any(item.strip().lower() == token for item in value.split(","))


class HttpClient:
    """POSTs to one base URL over a pool of keep-alive connections."""

    def __init__(
        self,
        base_url: str,
        *,
        reuse_connections: bool = True,
        timeout_s: float = _DEFAULT_TIMEOUT_S,
        headers: Mapping[str, str] | None = None,
        ssl_context: ssl.SSLContext | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
        max_idle_connections: int = _DEFAULT_MAX_IDLE_CONNECTIONS,
    ) -> None:
        scheme, host, port, base_path = parse_base_url(base_url)
        if not timeout_s > 0:  # also rejects NaN
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        if max_idle_connections < 0:
            raise ValueError(f"max_idle_connections must be >= 0, got {max_idle_connections}")
        self._host = host
        self._port = port
        host_text = f"[{host}]" if ":" in host else host
        self._where = f"{host_text}:{port}"
        self._base_path = base_path
        self._reuse = reuse_connections
        self._timeout_s = timeout_s
        self._clock = clock
        self._max_idle = max_idle_connections if reuse_connections else 0
        # An ssl_context given with an http:// URL is ignored: the URL decides.
        self._ssl: ssl.SSLContext | None = None
        if scheme == "https":
            self._ssl = ssl_context if ssl_context is not None else ssl.create_default_context()
        host_header = host_text if port == _DEFAULT_PORTS[scheme] else self._where
        # Lower-cased name -> (name as sent, value); later sources override earlier ones.
        self._headers: dict[str, tuple[str, str]] = {
            "host": ("Host", host_header),
            "user-agent": ("User-Agent", _USER_AGENT),
            "content-type": ("Content-Type", _DEFAULT_CONTENT_TYPE),
        }
        self._merge(self._headers, headers)
        self._idle: deque[_Connection] = deque()
        self._counters = _Counters()
        self._closed = False

    async def __aenter__(self) -> HttpClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def post(
        self, path: str, body: bytes, *, headers: Mapping[str, str] | None = None
    ) -> Response:
        """Send ``POST base_path + path`` and read the response's status line and headers."""
        if self._closed:
            raise HttpError(f"client for {self._where} is closed")
        request, close_requested = self._request(path, body, headers)
        conn, reused = await self._acquire(fresh=False)
        try:
            return await self._exchange(conn, request, close_requested, reused=reused)
        except _PeerClosed:
            if not reused:
                raise
            # The server closed the idle connection as we sent: resend once on a fresh one.
            self._counters.stale_retries += 1
        conn, reused = await self._acquire(fresh=True)
        return await self._exchange(conn, request, close_requested, reused=reused)

    async def aclose(self) -> None:
        """Close idle connections; later :meth:`post` calls raise HttpError. Responses still
        being read finish normally and then close their connections."""
        self._closed = True
        idle = list(self._idle)
        self._idle.clear()
        for conn in idle:
            conn.close()
        if idle:
            await asyncio.gather(*(conn.wait_closed() for conn in idle))

    def stats(self) -> dict[str, int]:
        """connections_opened, connections_reused, stale_retries, idle (pooled now), and the
        idle connections found closed by the server or evicted (idle_discarded) and the responses
        that hit a size limit (limit_exceeded)."""
        counters = self._counters
        return {
            "connections_opened": counters.connections_opened,
            "connections_reused": counters.connections_reused,
            "stale_retries": counters.stale_retries,
            "idle": len(self._idle),
            "idle_discarded": counters.idle_discarded,
            "limit_exceeded": counters.limit_exceeded,
        }

    # --- internals -------------------------------------------------------------------------------
    @staticmethod
    def _merge(into: dict[str, tuple[str, str]], headers: Mapping[str, str] | None) -> None:
        if headers:
            for name, value in headers.items():
                check_header(name, value)
                lower = name.lower()
                if lower not in FRAMING_HEADERS:
                    into[lower] = (name, value)

    def _request(
        self, path: str, body: bytes, headers: Mapping[str, str] | None
    ) -> tuple[bytes, bool]:
        """The request bytes, and whether it asks the server to close the connection."""
        target = self._base_path + (path if path.startswith("/") else "/" + path)
        if _TARGET_FORBIDDEN.search(target):
            raise ValueError(f"request path {path!r} has spaces or control characters")
        merged = self._headers
        if headers:
            merged = dict(merged)
            self._merge(merged, headers)
        lines = [f"POST {target} HTTP/1.1"]
        lines.extend(f"{name}: {value}" for name, value in merged.values())
        lines.append(f"Content-Length: {len(body)}")
        connection = merged.get("connection")
        close_requested = _has_token(connection[1] if connection else None, "close")
        if not self._reuse and not close_requested:
            lines.append("Connection: close")
            close_requested = True
        lines.append("\r\n")
        return "\r\n".join(lines).encode("latin-1") + body, close_requested

    async def _acquire(self, *, fresh: bool) -> tuple[_Connection, bool]:
        """(connection, whether it came from the pool)."""
        if not fresh:
            idle = self._idle
            while idle:
                conn = idle.pop()  # most recently used first: the least likely to be stale
                if conn.is_alive():
                    self._counters.connections_reused += 1
                    return conn, True
                conn.close()
                self._counters.idle_discarded += 1
        conn = await _Connection.open(
            self._host,
            self._port,
            where=self._where,
            ssl_context=self._ssl,
            timeout_s=self._timeout_s,
            clock=self._clock,
        )
        self._counters.connections_opened += 1
        return conn, False

    def _release(self, conn: _Connection) -> None:
        if self._closed or self._max_idle == 0 or not conn.is_alive():
            conn.close()
            return
        self._idle.append(conn)
        if len(self._idle) > self._max_idle:
            self._idle.popleft().close()
            self._counters.idle_discarded += 1

    async def _exchange(
        self, conn: _Connection, request: bytes, close_requested: bool, *, reused: bool
    ) -> Response:
        try:
            await conn.send(request)
            sent_ns = conn.last_write_ns
            version, status, reason, headers, first_byte_ns = await self._read_head(conn)
            # Interim responses (100 Continue, 103 Early Hints) precede the real one.
            while 100 <= status < 200 and status != 101:
                version, status, reason, headers, _ = await self._read_head(conn)
            return self._response(
                conn,
                version,
                status,
                reason,
                headers,
                sent_ns=sent_ns,
                first_byte_ns=first_byte_ns,
                reused=reused,
                close_requested=close_requested,
            )
        except BaseException:
            conn.abort()
            raise

    async def _read_head(self, conn: _Connection) -> tuple[bytes, int, str, dict[str, str], int]:
        """(version, status, reason, headers, clock reading of the read that delivered the
        head's first byte)."""
        received_any = conn.buffered > 0
        first_read_ns = conn.last_read_ns  # what is buffered came with the latest read
        scanned = 0  # bytes after conn.pos already searched for the blank line
        while True:
            buf, pos = conn.buf, conn.pos
            start = pos + max(0, scanned - 3)
            # The blank line ends the block: \r\n\r\n, or a bare-LF variant of it.
            crlf, lf = buf.find(b"\n\r\n", start), buf.find(b"\n\n", start)
            if crlf >= 0 and (lf < 0 or crlf < lf):
                head_end, block_end = crlf, crlf + 3
            elif lf >= 0:
                head_end, block_end = lf, lf + 2
            else:
                head_end = block_end = -1
            if block_end >= 0 and block_end - pos <= _MAX_HEADER_BYTES:
                break
            if block_end >= 0 or conn.buffered > _MAX_HEADER_BYTES:
                self._counters.limit_exceeded += 1
                conn.abort()
                raise HttpError(
                    f"response header block from {self._where} is over {_size(_MAX_HEADER_BYTES)}"
                )
            scanned = conn.buffered
            try:
                more = await conn.fill()
            except _PeerClosed as exc:
                if received_any:
                    raise HttpError(str(exc)) from exc.__cause__
                raise
            if not more:
                conn.abort()
                if received_any:
                    raise HttpError(f"connection closed by {self._where} inside response headers")
                raise _PeerClosed(f"{self._where} closed the connection without a response")
            if not received_any:
                first_read_ns = conn.last_read_ns
                received_any = True
        head = buf[pos:head_end]
        conn.pos = block_end
        lines = head.split(b"\n")
        status_line = lines[0].rstrip(b"\r")
        parts = status_line.split(b" ", 2)
        if (
            len(parts) < 2
            or not parts[0].startswith(b"HTTP/1.")
            or len(parts[1]) != 3
            or not parts[1].isdigit()
        ):
            conn.abort()
            raise HttpError(f"malformed status line {bytes(status_line[:80])!r} from {self._where}")
        reason = parts[2].decode("latin-1") if len(parts) == 3 else ""
        headers: dict[str, str] = {}
        last_name = ""
        for raw in lines[1:]:
            line = raw.rstrip(b"\r").decode("latin-1")
            if line[:1] in (" ", "\t") and last_name:  # obsolete line folding
                headers[last_name] = f"{headers[last_name]} {line.strip()}"
                continue
            name, colon, value = line.partition(":")
            name = name.strip().lower()
            if not colon or not name:
                conn.abort()
                raise HttpError(f"malformed header line {line[:80]!r} from {self._where}")
            value = value.strip(" \t")
            previous = headers.get(name)
            headers[name] = value if previous is None else f"{previous}, {value}"
            last_name = name
        return parts[0], int(parts[1]), reason, headers, first_read_ns

    def _response(
        self,
        conn: _Connection,
        version: bytes,
        status: int,
        reason: str,
        headers: dict[str, str],
        *,
        sent_ns: int,
        first_byte_ns: int,
        reused: bool,
        close_requested: bool,
    ) -> Response:
        keep_alive = (
            self._reuse
            and not close_requested
            and version == b"HTTP/1.1"
            and not _has_token(headers.get("connection"), "close")
        )
        length = 0
        transfer_encoding = headers.get("transfer-encoding")
        content_length = headers.get("content-length")
        if status < 200 or status in (204, 304):
            mode = _BODY_NONE
        elif transfer_encoding is not None:
            if transfer_encoding.rsplit(",", 1)[-1].strip().lower() == "chunked":
                mode = _BODY_CHUNKED
                # Both framings at once is how request smuggling starts: do not reuse.
                keep_alive = keep_alive and content_length is None
            else:
                mode = _BODY_UNTIL_EOF
        elif content_length is not None:
            values = {value.strip() for value in content_length.split(",")}
            value = values.pop()
            if values or not _CONTENT_LENGTH.fullmatch(value):
                conn.abort()
                raise HttpError(f"invalid Content-Length {content_length!r} from {self._where}")
            mode = _BODY_LENGTH
            length = int(value)
        else:
            mode = _BODY_UNTIL_EOF
        if mode == _BODY_UNTIL_EOF:
            keep_alive = False
        return Response(
            conn,
            release=self._release,
            counters=self._counters,
            status=status,
            reason=reason,
            headers=headers,
            sent_ns=sent_ns,
            first_byte_ns=first_byte_ns,
            headers_ns=conn.last_read_ns,
            connection_reused=reused,
            mode=mode,
            length=length,
            keep_alive=keep_alive,
        )
