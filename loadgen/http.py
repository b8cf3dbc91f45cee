"""A small asyncio HTTP/1.1 client for ``tokentrace load``.

Why not aiohttp or httpx: the load generator needs the clock reading of the socket read that
delivered each server-sent event (TTFT and inter-token gaps are measured from it), and the agent
extra must stay free of web client dependencies. The client speaks just enough HTTP/1.1 for
OpenAI-compatible endpoints: POST with a JSON body, responses framed by Content-Length, chunked
transfer coding or connection close, keep-alive connection reuse, and ``text/event-stream`` bodies.

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
import contextlib
import ipaddress
import re
import ssl
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from types import TracebackType
from typing import TypeVar
from urllib.parse import urlsplit

from tokentrace.agent.tcp_info import TcpFacts, read_tcp_info

__all__ = ["HttpClient", "HttpError", "Response", "parse_base_url"]

_DEFAULT_TIMEOUT_S = 600.0
_DEFAULT_MAX_IDLE_CONNECTIONS = 1024
_USER_AGENT = "tokentrace-load"
_DEFAULT_CONTENT_TYPE = "application/json"
_DEFAULT_PORTS = {"http": 80, "https": 443}

_READ_SIZE = 64 * 1024
_MAX_HEADER_BYTES = 64 * 1024
"""Largest response header block; also bounds one chunk-size line and the chunked trailers."""
_MAX_EVENT_BYTES = 16 * 1024 * 1024
"""Largest single server-sent event (the bytes buffered while waiting for its blank line)."""
_MAX_BODY_BYTES = 256 * 1024 * 1024
"""Largest body that :meth:`Response.read` collects."""
_CLOSE_WAIT_S = 1.0
"""How long :meth:`HttpClient.aclose` waits for idle connections to finish closing."""

_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")
_CONTENT_LENGTH = re.compile(r"[0-9]{1,20}")
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_HEADER_VALUE_FORBIDDEN = re.compile(r"[\r\n\x00]")
_TARGET_FORBIDDEN = re.compile(r"[^\x21-\x7e]")
_UTF8_BOM = b"\xef\xbb\xbf"
FRAMING_HEADERS = frozenset({"content-length", "transfer-encoding"})
"""Request headers the client computes itself; caller-given values are ignored."""

# How a response body is delimited.
_BODY_NONE = 0
_BODY_LENGTH = 1
_BODY_CHUNKED = 2
_BODY_UNTIL_EOF = 3

# Where the chunked decoder is.
_CHUNK_SIZE_LINE = 0
_CHUNK_DATA = 1
_CHUNK_DATA_END = 2
_CHUNK_TRAILERS = 3

_T = TypeVar("_T")

if sys.version_info >= (3, 11):

    async def _within(awaitable: Awaitable[_T], timeout_s: float) -> _T:
        # asyncio.timeout is a timer handle on the current task; wait_for (3.10) wraps a task.
        async with asyncio.timeout(timeout_s):
            return await awaitable

else:  # pragma: no cover - Python 3.10
    _within = asyncio.wait_for


class HttpError(Exception):
    """Connection refused/reset, timeout, protocol violation; message says what and where
    (host:port)."""


class _PeerClosed(HttpError):
    """The server closed (or reset) the connection before sending any byte of a response: the
    signature of a stale keep-alive connection, which :meth:`HttpClient.post` retries once."""


def _translate(exc: BaseException, action: str, where: str, timeout_s: float) -> HttpError | None:
    """The :class:`HttpError` for a socket-layer exception, or None for anything else
    (cancellation, programming errors), which propagates unchanged."""
    # Before OSError: since 3.11 asyncio's TimeoutError is the builtin, an OSError subclass.
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return HttpError(f"{action} {where} timed out after {timeout_s:g}s")
    detail = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, (ConnectionError, EOFError, ssl.SSLEOFError, ssl.SSLZeroReturnError)):
        return _PeerClosed(f"{action} {where} failed, connection closed by peer ({detail})")
    if isinstance(exc, OSError):
        return HttpError(f"{action} {where} failed ({detail})")
    return None


def _is_ip_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


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


class _Counters:
    __slots__ = (
        "connections_opened",
        "connections_reused",
        "idle_discarded",
        "limit_exceeded",
        "stale_retries",
    )

    def __init__(self) -> None:
        self.connections_opened = 0
        self.connections_reused = 0
        self.stale_retries = 0
        self.idle_discarded = 0
        self.limit_exceeded = 0


class _Connection:
    """One TCP (or TLS) connection with a read buffer (``buf`` from offset ``pos``) and the clock
    reading of its latest read. Every failure closes it and raises HttpError."""

    __slots__ = (
        "_clock",
        "_reader",
        "_timeout_s",
        "_writer",
        "buf",
        "closed",
        "connect_ns",
        "last_read_ns",
        "pos",
        "sock",
        "where",
    )

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        where: str,
        timeout_s: float,
        clock: Callable[[], int],
        connect_ns: int,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._timeout_s = timeout_s
        self._clock = clock
        self.where = where
        self.sock: object = writer.get_extra_info("socket")
        """The TCP socket (under TLS, the raw one), for TCP_INFO; None if the transport has none."""
        self.connect_ns = connect_ns
        """How long opening it took: name resolution and TLS included; for plain TCP to an IP
        address at most the kernel's measured round trip of its handshake."""
        self.buf = b""
        self.pos = 0
        self.last_read_ns = 0
        self.closed = False

    @classmethod
    async def open(
        cls,
        host: str,
        port: int,
        *,
        where: str,
        ssl_context: ssl.SSLContext | None,
        timeout_s: float,
        clock: Callable[[], int],
    ) -> _Connection:
        started_ns = clock()
        try:
            reader, writer = await _within(
                asyncio.open_connection(
                    host,
                    port,
                    ssl=ssl_context,
                    server_hostname=host if ssl_context is not None else None,
                ),
                timeout_s,
            )
        except BaseException as exc:
            error = _translate(exc, "connecting to", where, timeout_s)
            if error is None:
                raise
            raise error from exc
        connection = cls(
            reader,
            writer,
            where=where,
            timeout_s=timeout_s,
            clock=clock,
            connect_ns=clock() - started_ns,
        )
        if ssl_context is None and _is_ip_address(host):
            # Plain TCP, no name to resolve: the kernel completes the handshake in one round
            # trip, which it measured; opening took longer only when this client was late to run
            # (a busy loop, a starved process): the client's own time, not the connection's.
            facts = read_tcp_info(connection.sock)
            if facts is not None and facts.rtt_ns:
                connection.connect_ns = min(connection.connect_ns, facts.rtt_ns)
        return connection

    @property
    def buffered(self) -> int:
        return len(self.buf) - self.pos

    def _fail(self, exc: BaseException, action: str) -> HttpError | None:
        self.abort()
        return _translate(exc, action, self.where, self._timeout_s)

    async def send(self, data: bytes) -> None:
        try:
            self._writer.write(data)
            await _within(self._writer.drain(), self._timeout_s)
        except BaseException as exc:
            error = self._fail(exc, "sending request to")
            if error is None:
                raise
            raise error from exc

    async def fill(self) -> bool:
        """Read what the socket has (at most ``_READ_SIZE``) into the buffer; False at EOF."""
        try:
            data = await _within(self._reader.read(_READ_SIZE), self._timeout_s)
        except BaseException as exc:
            error = self._fail(exc, "reading response from")
            if error is None:
                raise
            raise error from exc
        self.last_read_ns = self._clock()
        if not data:
            return False
        if self.pos >= len(self.buf):
            self.buf = data  # the common case: everything before was consumed, no copy
        else:
            self.buf = self.buf[self.pos :] + data
        self.pos = 0
        return True

    def take(self, limit: int) -> bytes:
        """Up to ``limit`` buffered bytes (the caller made sure some are buffered)."""
        buf, pos = self.buf, self.pos
        end = pos + limit
        if pos == 0 and end >= len(buf):
            self.buf, self.pos = b"", 0
            return buf
        piece = buf[pos:end]
        self.pos = min(end, len(buf))
        return piece

    def buffered_line(self) -> bytes | None:
        """The next buffered line without its CRLF/LF, or None until a whole line is buffered
        (chunk-size lines and trailers)."""
        end = self.buf.find(b"\n", self.pos)
        if end < 0:
            if self.buffered > _MAX_HEADER_BYTES:
                self.abort()
                raise HttpError(
                    f"chunked body line from {self.where} is over {_size(_MAX_HEADER_BYTES)}"
                )
            return None
        line = self.buf[self.pos : end]
        self.pos = end + 1
        return line[:-1] if line.endswith(b"\r") else line

    def is_alive(self) -> bool:
        """False when the server closed the idle connection and the loop already saw it."""
        if self.closed or self.buffered:
            return False
        reader = self._reader
        return not (reader.at_eof() or reader.exception() is not None or self._writer.is_closing())

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._writer.close()

    def abort(self) -> None:
        """Close without a graceful shutdown: the connection is in an unknown state."""
        if not self.closed:
            self.closed = True
            self._writer.transport.abort()

    async def wait_closed(self) -> None:
        # Best effort: a peer that never acknowledges the close must not hang aclose().
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._writer.wait_closed(), _CLOSE_WAIT_S)


class Response:
    """A response whose status line and headers were read; the body is read with :meth:`read`
    or :meth:`events`. The connection goes back to the pool as soon as the body was read to its
    end (or on :meth:`aclose`); a response abandoned mid-body closes its connection."""

    __slots__ = (
        "_client",
        "_conn",
        "_done",
        "_end_ns",
        "_keep_alive",
        "_mode",
        "_remaining",
        "_sock",
        "_state",
        "_trailer_bytes",
        "connect_ns",
        "connection_reused",
        "end_tcp_facts",
        "first_byte_ns",
        "headers",
        "headers_ns",
        "reason",
        "sent_ns",
        "status",
    )

    def __init__(
        self,
        client: HttpClient,
        conn: _Connection,
        *,
        status: int,
        reason: str,
        headers: dict[str, str],
        sent_ns: int,
        first_byte_ns: int,
        headers_ns: int,
        connection_reused: bool,
        mode: int,
        length: int,
        keep_alive: bool,
    ) -> None:
        self.status = status
        self.reason = reason
        self.headers: Mapping[str, str] = headers
        self.sent_ns = sent_ns
        """Clock reading when the request's bytes were handed to the connection."""
        self.first_byte_ns = first_byte_ns
        """Clock reading of the read that delivered the response's first byte."""
        self.headers_ns = headers_ns
        self.connection_reused = connection_reused
        """The request went over a pooled connection (False: one opened for it)."""
        self.connect_ns = None if connection_reused else conn.connect_ns
        """How long opening the connection took; None when it was reused."""
        self.end_tcp_facts: TcpFacts | None = None
        """TCP_INFO taken right after the read that completed the body; None until then, or
        when the kernel could not tell."""
        self._client = client
        self._conn: _Connection | None = conn
        self._sock = conn.sock
        self._mode = mode
        self._remaining = length
        self._state = _CHUNK_SIZE_LINE
        self._trailer_bytes = 0
        self._keep_alive = keep_alive
        self._done = False
        self._end_ns = headers_ns  # the clock reading of the read that ended the body
        if mode == _BODY_NONE or (mode == _BODY_LENGTH and length == 0):
            self._finish()

    def __repr__(self) -> str:
        return f"<Response {self.status} {self.reason!r}>"

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def read(self) -> bytes:
        """The whole (remaining) body; HttpError beyond 256 MiB or when the connection ends
        mid-body."""
        parts: list[bytes] = []
        total = 0
        try:
            if self._mode == _BODY_LENGTH and self._remaining > _MAX_BODY_BYTES:
                raise self._over_limit(
                    f"response body of {self._remaining} bytes is over {_size(_MAX_BODY_BYTES)}"
                )
            while piece := await self._next_piece():
                total += len(piece)
                if total > _MAX_BODY_BYTES:
                    raise self._over_limit(f"response body is over {_size(_MAX_BODY_BYTES)}")
                parts.append(piece)
        except BaseException:
            self._abort()
            raise
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def events(self) -> AsyncIterator[tuple[int, str]]:
        """Server-sent events: ``(clock reading of the read that completed the event, data)``,
        with multi-line data joined by ``\\n``; events without data lines are skipped."""
        conn = self._conn
        if conn is None:
            if not self._done:
                raise HttpError("response was closed before its body was read")
            return
        pending = bytearray()  # normalized to \n line ends; at most one incomplete event
        scan_from = 0
        carry_cr = False  # a trailing \r whose \n may come with the next piece
        first = True
        try:
            while piece := await self._next_piece():
                read_ns = conn.last_read_ns  # read before any await or yield lets conn be reused
                if carry_cr:
                    piece = b"\r" + piece
                    carry_cr = False
                if piece.endswith(b"\r"):
                    piece = piece[:-1]
                    carry_cr = True
                if b"\r" in piece:
                    piece = piece.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
                if first:
                    first = False
                    if piece.startswith(_UTF8_BOM):
                        piece = piece[len(_UTF8_BOM) :]
                pending += piece
                while (end := pending.find(b"\n\n", scan_from)) >= 0:
                    data = _event_data(pending[:end])
                    del pending[: end + 2]  # bytearray drops a prefix without moving the rest
                    scan_from = 0
                    if data is not None:
                        yield read_ns, data
                scan_from = max(0, len(pending) - 1)
                if len(pending) > _MAX_EVENT_BYTES:
                    raise self._over_limit(f"a server-sent event is over {_size(_MAX_EVENT_BYTES)}")
            if pending:  # a last event that the stream ended without a blank line after
                data = _event_data(pending)
                if data is not None:
                    # Not conn.last_read_ns: a pooled connection may already serve another request.
                    yield self._end_ns, data
        except BaseException:  # includes cancellation and the consumer closing the generator
            self._abort()
            raise

    async def aclose(self) -> None:
        """Return the connection to the pool when the body was read and the connection is
        reusable; otherwise close it. Idempotent."""
        if self._conn is not None and not self._done:
            self._abort()

    def tcp_facts(self) -> TcpFacts | None:
        """TCP_INFO of the connection that carried this response, now; None when the kernel
        cannot tell (closed, not TCP, not Linux). Ask right after a read of this response and
        before awaiting anything: a connection whose response is complete may carry another
        request from the next await on."""
        return read_tcp_info(self._sock)

    # --- body decoding ---------------------------------------------------------------------------
    async def _next_piece(self) -> bytes:
        """The next piece of the decoded body as soon as any is available; b"" at its end."""
        if self._done:
            return b""
        conn = self._conn
        if conn is None:
            raise HttpError("response was closed before its body was read")
        mode = self._mode
        if mode == _BODY_LENGTH:
            if not conn.buffered and not await conn.fill():
                raise self._mid_body(f"{self._remaining} bytes of Content-Length missing")
            piece = conn.take(self._remaining)
            self._remaining -= len(piece)
            if self._remaining == 0:
                self._finish()  # pool the connection now, not on the caller's next call
            return piece
        if mode == _BODY_CHUNKED:
            return await self._next_chunk_piece(conn)
        if mode == _BODY_UNTIL_EOF:
            if not conn.buffered and not await conn.fill():
                return self._finish()
            return conn.take(conn.buffered)
        return self._finish()

    async def _next_chunk_piece(self, conn: _Connection) -> bytes:
        while True:
            if self._state == _CHUNK_DATA:
                if not conn.buffered and not await conn.fill():
                    raise self._mid_body("inside a chunk")
                piece = conn.take(self._remaining)
                self._remaining -= len(piece)
                if self._remaining == 0:
                    self._state = _CHUNK_DATA_END
                    # The last chunk and trailers often come in the same read: finishing now
                    # pools the connection even if the consumer stops at the last event.
                    self._parse_chunk_framing(conn)
                return piece
            if self._parse_chunk_framing(conn):
                return b""
            if self._state != _CHUNK_DATA and not await conn.fill():
                raise self._mid_body("inside chunked framing")

    def _parse_chunk_framing(self, conn: _Connection) -> bool:
        """Consume the buffered framing lines up to the next chunk's data; True at the body's
        end. Never reads from the socket."""
        while self._state != _CHUNK_DATA:
            line = conn.buffered_line()
            if line is None:
                return False
            state = self._state
            if state == _CHUNK_SIZE_LINE:
                # chunk-size [ ; extensions ]: extensions carry nothing we use
                size_text = line.split(b";", 1)[0].strip(b" \t")
                if not _CHUNK_SIZE.fullmatch(size_text):
                    self._abort()
                    raise HttpError(f"malformed chunk size {bytes(line[:40])!r} from {conn.where}")
                size = int(size_text, 16)
                if size:
                    self._remaining = size
                    self._state = _CHUNK_DATA
                else:
                    self._state = _CHUNK_TRAILERS
            elif state == _CHUNK_DATA_END:
                if line:
                    self._abort()
                    raise HttpError(f"chunk from {conn.where} is longer than its declared size")
                self._state = _CHUNK_SIZE_LINE
            else:  # trailer fields until the blank line; nothing in them is used
                if not line:
                    self._finish()
                    return True
                self._trailer_bytes += len(line)
                if self._trailer_bytes > _MAX_HEADER_BYTES:
                    raise self._over_limit(f"chunked trailers are over {_size(_MAX_HEADER_BYTES)}")
        return False

    def _finish(self) -> bytes:
        """The body ended: pool the connection when it can carry another request."""
        self._done = True
        conn = self._conn
        self._conn = None
        if conn is not None:
            self._end_ns = conn.last_read_ns
            self.end_tcp_facts = read_tcp_info(conn.sock)  # before the pool lends conn out
            if self._keep_alive:
                self._client._release(conn)
            else:
                conn.close()
        return b""

    def _abort(self) -> None:
        conn = self._conn
        self._conn = None
        if conn is not None:
            conn.abort()

    def _mid_body(self, detail: str) -> HttpError:
        where = self._conn.where if self._conn is not None else self._client._where
        self._abort()
        return HttpError(f"connection closed mid-body by {where} ({detail})")

    def _over_limit(self, message: str) -> HttpError:
        self._client._counters.limit_exceeded += 1
        where = self._conn.where if self._conn is not None else self._client._where
        self._abort()
        return HttpError(f"{message} ({where})")


def _event_data(block: bytearray) -> str | None:
    """The data of one event block (\\n line ends, no blank line), or None without data lines."""
    if b"\n" not in block:  # the usual vLLM event: one `data:` line
        if not block.startswith(b"data"):
            return None
        lines = [block]
    else:
        lines = block.split(b"\n")
    parts: list[bytes | bytearray] = []
    for line in lines:
        if line.startswith(b"data:"):
            value = line[5:]
            parts.append(value[1:] if value.startswith(b" ") else value)
        elif line == b"data":  # a field name without a colon has an empty value
            parts.append(b"")
        # comments (":...") and other fields (event, id, retry) carry nothing we use
    if not parts:
        return None
    joined = parts[0] if len(parts) == 1 else b"\n".join(parts)
    return joined.decode("utf-8", "replace")


def _size(limit: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if limit % scale == 0:
            return f"{limit // scale} {unit}"
    return f"{limit} bytes"


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
            sent_ns = self._clock()
            await conn.send(request)
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
            self,
            conn,
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
