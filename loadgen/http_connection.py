"""One connection of the load generator's HTTP client (``http.py``): a TCP or TLS socket with its
bounded read buffer and the clock reading of its latest read, and the errors every socket-level
failure becomes (:class:`HttpError`, naming ``host:port``)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import ssl
import sys
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tokentrace.agent.tcp_info import read_tcp_info

_READ_SIZE = 64 * 1024
_MAX_HEADER_BYTES = 64 * 1024
"""Largest response header block; also bounds one chunk-size line and the chunked trailers."""
_CLOSE_WAIT_S = 1.0
"""How long :meth:`HttpClient.aclose` waits for idle connections to finish closing."""

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


class _Counters:
    """What the client counts for its ``stats()``; responses count the limits they hit."""

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
    readings of its latest read and write. Every failure closes it and raises HttpError."""

    __slots__ = (
        "_clock",
        "_reader",
        "_timeout_s",
        "_writer",
        "buf",
        "closed",
        "connect_ns",
        "last_read_ns",
        "last_write_ns",
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
        self.last_write_ns = 0
        """Read right after the latest ``send`` handed its bytes to the transport (which writes
        to the socket at once when nothing is queued): the request left then, not when the
        client meant to send it (a process descheduled in between was late, not the network)."""
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
            self.last_write_ns = self._clock()
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


def _size(limit: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if limit % scale == 0:
            return f"{limit // scale} {unit}"
    return f"{limit} bytes"
