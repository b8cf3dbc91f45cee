"""A response of the load generator's HTTP client (``http.py``): its body, delimited by
Content-Length, the chunked transfer coding or the connection's end, read whole or as
server-sent events stamped with the clock reading of the socket read that completed each; every
buffer bounded."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable, Mapping
from types import TracebackType

from tokentrace.agent.tcp_info import TcpFacts, read_tcp_info
from tokentrace.loadgen.http_connection import (
    _MAX_HEADER_BYTES,
    HttpError,
    _Connection,
    _Counters,
    _size,
)

_MAX_EVENT_BYTES = 16 * 1024 * 1024
"""Largest single server-sent event (the bytes buffered while waiting for its blank line)."""
_MAX_BODY_BYTES = 256 * 1024 * 1024
"""Largest body that :meth:`Response.read` collects."""
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")
_UTF8_BOM = b"\xef\xbb\xbf"

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


class Response:
    """A response whose status line and headers were read; the body is read with :meth:`read`
    or :meth:`events`. The connection goes back to the pool as soon as the body was read to its
    end (or on :meth:`aclose`); a response abandoned mid-body closes its connection."""

    __slots__ = (
        "_conn",
        "_counters",
        "_done",
        "_end_ns",
        "_keep_alive",
        "_mode",
        "_release",
        "_remaining",
        "_sock",
        "_state",
        "_trailer_bytes",
        "_where",
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
        conn: _Connection,
        *,
        release: Callable[[_Connection], None],
        counters: _Counters,
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
        self._release = release
        """Takes a connection whose response is complete back into the pool."""
        self._counters = counters
        self._where = conn.where
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

    @property
    def body_end_ns(self) -> int | None:
        """The clock reading of the read that completed the body (the response's end as the
        client saw it); None while the body is not complete."""
        return self._end_ns if self._done else None

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
                self._release(conn)
            else:
                conn.close()
        return b""

    def _abort(self) -> None:
        conn = self._conn
        self._conn = None
        if conn is not None:
            conn.abort()

    def _mid_body(self, detail: str) -> HttpError:
        self._abort()
        return HttpError(f"connection closed mid-body by {self._where} ({detail})")

    def _over_limit(self, message: str) -> HttpError:
        self._counters.limit_exceeded += 1
        self._abort()
        return HttpError(f"{message} ({self._where})")


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
