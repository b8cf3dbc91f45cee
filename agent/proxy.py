"""``tokentrace proxy``: a reverse proxy beside an engine the agent cannot patch.

llama.cpp's ``llama-server`` (C++), TGI (Rust) and Ollama (Go) run no Python to instrument. The
proxy sits in front of one of them (or any OpenAI-compatible server) and gives each generation
request the span tree of the in-process agents, as far as the engine's own timing report allows
(``proxy_engines.py``; docs/proxy.md)::

    POST /v1/chat/completions   SERVER  request head received -> just before the last bytes sent
    └─ llm.request                      request fully received -> response complete
       ├─ llm.queue                     the engine's queue wait, if it reports one
       ├─ llm.prefill                   first scheduled (from the engine's report) -> first token
       ├─ llm.decode                    first -> last content chunk; one time per content chunk
       └─ llm.postprocess               last content chunk -> response complete

Data path (asyncio and stdlib streams, one event loop): HTTP/1.1 with keep-alive, one upstream
connection per client connection, reused. The request body is forwarded as it arrives; the
response is forwarded read by read, the bytes exactly as the engine sent them (chunked framing,
SSE, NDJSON, content-length or close-delimited bodies), each read written to the client before
the next is awaited: nothing is buffered. Per read of a streamed response (``text/event-stream``,
``application/x-ndjson``) the proxy does one clock read, one regular-expression scan for events
carrying generated text, and appends the time once per such event (``RequestTimer.token_ns``);
the framing scan of a chunked body is a few ``find`` calls. The last few payload pieces are kept
(references, no copy) and, when the response ends, the final event is parsed for the engine's
report, folded into the timer (``proxy_engines.fold``) and handed to the recorder: spans are
built and exported on the agent's emitter thread, as for every other instrumentation.

``traceparent``: the proxy's HTTP SERVER span is the child of the incoming one (or a new trace's
root), and the engine receives a ``traceparent`` naming that span, so that an engine's own spans
(TGI's) join the trace. An upstream that cannot be reached gets the client a 502 with a short
JSON error (``upstream_errors``); a client that goes away mid-response closes the upstream
connection (the engine stops generating) and the request ends with error ``aborted``.

Only ``POST`` requests are traced (as ``asgi.py``); those to a generation path
(``GENERATION_PATHS``) also get ``llm.request``. Everything else is proxied untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import re
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Final
from urllib.parse import urlsplit

from tokentrace.agent import semconv
from tokentrace.agent.frameworks.asgi import HttpServerSpan, plan_http_server_span
from tokentrace.agent.otlp_export import RateLimitedWarning
from tokentrace.agent.proxy_engines import (
    ENGINE_AUTO,
    ENGINES,
    NOT_REPORTED,
    NOT_REPORTED_UNSTREAMED,
    Observed,
    final_objects,
    fold,
    read_report,
)
from tokentrace.agent.recorder import Recorder, RequestTimer
from tokentrace.agent.runtime import AgentRuntime
from tokentrace.agent.span_ids import (
    format_traceparent,
    parse_traceparent,
    random_span_id_bytes,
    random_trace_id,
)
from tokentrace.agent.tcp_info import read_tcp_info

__all__ = ["GENERATION_PATHS", "ProxyError", "ProxyServer", "parse_listen", "parse_upstream"]

_log = logging.getLogger(__name__)

GENERATION_PATHS: Final = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/chat/completions",
        "/completions",
        "/completion",  # llama-server's own
        "/infill",
        "/generate",  # TGI's own
        "/generate_stream",
        "/api/generate",  # Ollama's own
        "/api/chat",
        "/v1/responses",
        "/v1/messages",
    }
)
"""Request paths whose POSTs are generations (``llm.request``); other POSTs get the HTTP span."""

_CHAT_PATHS: Final = frozenset(
    {"/v1/chat/completions", "/chat/completions", "/api/chat", "/v1/responses", "/v1/messages"}
)
_READ_SIZE: Final = 65_536
_MAX_HEAD_BYTES: Final = 65_536
_MAX_KEPT_REQUEST_BYTES: Final = 1 << 20
"""Request bodies up to this size are kept (references) to read the model and sampling
parameters from, and to resend once when a reused upstream connection turns out closed."""
_MAX_KEPT_RESPONSE_BYTES: Final = 4 << 20
"""An unstreamed response body is kept up to this size to read the engine's report from."""
_STREAM_TAIL_PIECES: Final = 8
_CONNECT_TIMEOUT_S: Final = 10.0
_ERROR_ABORTED: Final = "aborted"
_ERROR_UPSTREAM_UNAVAILABLE: Final = "upstream unavailable"
_ERROR_UPSTREAM_CLOSED: Final = "upstream closed the response early"
_WARNING_INTERVAL_S: Final = 60.0
_HOP_HEADERS: Final = frozenset({b"host", b"traceparent", b"expect", b"proxy-connection"})
_STREAM_TYPES: Final = (b"text/event-stream", b"application/x-ndjson", b"application/jsonl")
# An event carrying generated text: OpenAI's "content" / "text", TGI's token "text", Ollama's
# "response" / message "content", llama-server's "content"; an empty string does not count.
_CONTENT: Final = re.compile(rb'"(?:content|text|response)"\s*:\s*"(?:[^"]|\\")')
_REQUEST_FIELDS: Final = re.compile(
    rb'(?<![\\\w])"(model|max_tokens|max_completion_tokens|max_new_tokens|num_predict|'
    rb'temperature|top_p)"\s*:\s*("(?:[^"\\]|\\.)*"|[-+0-9.eE]+)'
)
_MAX_TOKENS_FIELDS: Final = (b"max_tokens", b"max_completion_tokens", b"max_new_tokens")
_CLIENT_ERROR_STATUS: Final = 400


class ProxyError(ValueError):
    """A bad argument (upstream URL, listen address), with a one-line message."""


@dataclass(frozen=True, slots=True)
class Upstream:
    host: str
    port: int
    prefix: bytes
    """The URL's path without its trailing slash, prepended to every request's target."""
    host_header: bytes
    url: str


def parse_upstream(url: str) -> Upstream:
    parts = urlsplit(url.strip())
    if parts.scheme != "http":
        raise ProxyError(f"--upstream must be an http:// URL, got {url!r}")
    try:
        port = parts.port or 80
    except ValueError:
        raise ProxyError(f"--upstream has a bad port: {url!r}") from None
    if not parts.hostname:
        raise ProxyError(f"--upstream has no host: {url!r}")
    if parts.query or parts.fragment:
        raise ProxyError(f"--upstream must not have a query or fragment: {url!r}")
    return Upstream(
        parts.hostname,
        port,
        parts.path.rstrip("/").encode("latin-1"),
        parts.netloc.encode("latin-1"),
        url,
    )


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port_text = value.strip().rpartition(":")
    if not sep or not port_text.isdigit() or int(port_text) > 65_535:
        raise ProxyError(f"--listen must be HOST:PORT (port 0: any free port), got {value!r}")
    return host.strip("[]") or "127.0.0.1", int(port_text)


class _BadRequest(Exception):
    pass


class _Chunked:
    """Finds where a chunked body ends in the raw bytes read, without copying them; hands each
    payload piece to ``out`` (the response's kept tail) when one is given."""

    __slots__ = ("_line", "_remaining", "_state", "out")
    _SIZE, _DATA, _DATA_END, _TRAILER = range(4)

    def __init__(self, out: Callable[[bytes], object] | None = None) -> None:
        self._state = self._SIZE
        self._remaining = 0
        self._line = b""
        self.out = out

    def feed(self, data: bytes) -> int:
        """The offset just after the body's end in ``data``, or -1 when it goes on."""
        i, n = 0, len(data)
        while i < n:
            state = self._state
            if state == self._DATA:
                take = min(self._remaining, n - i)
                if self.out is not None:
                    self.out(data[i : i + take])
                i += take
                self._remaining -= take
                if not self._remaining:
                    self._state = self._DATA_END
                continue
            j = data.find(b"\n", i)
            if j < 0:
                if state != self._DATA_END:
                    self._line += data[i:]
                    if len(self._line) > _MAX_HEAD_BYTES:
                        raise _BadRequest("chunk line too long")
                return -1
            line, self._line = self._line + data[i:j], b""
            i = j + 1
            if state == self._DATA_END:
                self._state = self._SIZE
            elif state == self._SIZE:
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise _BadRequest("bad chunk size") from None
                if size:
                    self._remaining = size
                    self._state = self._DATA
                else:
                    self._state = self._TRAILER
            elif not line.strip():  # the blank line after the trailers: the end
                return i
        return -1


@dataclass(slots=True)
class _Exchange:
    """One request/response through the proxy."""

    span: HttpServerSpan | None
    timer: RequestTimer | None
    request_body: list[bytes] = field(default_factory=list)
    request_body_size: int = 0
    status: int = 0
    headers: dict[bytes, bytes] = field(default_factory=dict)
    streamed: bool = False
    tail: deque[bytes] = field(default_factory=lambda: deque(maxlen=_STREAM_TAIL_PIECES))
    body: list[bytes] = field(default_factory=list)
    body_size: int = 0
    finished: bool = False
    forwarded_ns: int | None = None
    """When the request's last bytes were handed to the engine (read before the write: the
    engine cannot start before it); ``llm.request``'s start."""

    def keep_body(self, piece: bytes) -> None:
        if self.streamed:
            self.tail.append(piece)
        elif self.body_size < _MAX_KEPT_RESPONSE_BYTES:
            self.body.append(piece)
            self.body_size += len(piece)


class ProxyServer:
    """The proxy's listening server. ``await start()``; ``port`` is then the bound port;
    ``await close()`` stops it. ``runtime``: the agent (spans); None proxies without tracing."""

    def __init__(
        self,
        upstream: str,
        *,
        runtime: AgentRuntime | None,
        engine: str = ENGINE_AUTO,
        host: str = "127.0.0.1",
        port: int = 0,
        connect_timeout_s: float = _CONNECT_TIMEOUT_S,
    ) -> None:
        if engine not in ENGINES:
            raise ProxyError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        self.upstream = parse_upstream(upstream)
        self.engine = engine
        self.host = host
        self.port = port
        self.connect_timeout_s = connect_timeout_s
        self.runtime = runtime
        self.recorder: Recorder | None = None if runtime is None else runtime.recorder
        self.clock: Callable[[], int] = (
            time.monotonic_ns if self.recorder is None else self.recorder.clock
        )
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._ids = itertools.count(1)
        self.requests = 0
        self.traced_requests = 0
        self.upstream_errors = 0
        """Requests answered 502: the upstream could not be reached or closed before answering."""
        self.aborted_requests = 0
        self.proxy_errors = 0
        """Connections ended by a malformed request or an unexpected error in the proxy."""
        self.tracing_errors = 0
        self._warning = RateLimitedWarning(interval_s=_WARNING_INTERVAL_S, log=_log)
        if runtime is not None:
            runtime.add_stats_source(self.stats)

    def stats(self) -> dict[str, int]:
        return {
            "proxy.requests": self.requests,
            "proxy.traced_requests": self.traced_requests,
            "proxy.upstream_errors": self.upstream_errors,
            "proxy.aborted_requests": self.aborted_requests,
            "proxy.errors": self.proxy_errors,
            "proxy.tracing_errors": self.tracing_errors,
        }

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._accept, self.host, self.port, limit=_READ_SIZE
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        connection = _Connection(self, reader, writer)
        try:
            await connection.serve()
        except asyncio.CancelledError:
            pass
        except Exception as error:  # a bug or a malformed exchange costs this connection only
            self.proxy_errors += 1
            self._warning.warn(
                "tokentrace proxy: a connection ended on an error (%s: %s); %d so far",
                type(error).__name__,
                error,
                self.proxy_errors,
            )
            _log.debug("tokentrace proxy: connection error", exc_info=True)
        finally:
            connection.close()
            self._connections.discard(task)

    # --- spans (off the data path: planned on the emitter's thread) ----------------------------
    def submit_http_span(self, span: HttpServerSpan) -> None:
        if self.runtime is not None:
            self.runtime.emitter.submit(partial(plan_http_server_span, span, self.runtime.clock))


class _Connection:
    """One client connection and its upstream connection (opened on first use, kept alive)."""

    def __init__(
        self, proxy: ProxyServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.proxy = proxy
        self.reader = reader
        self.writer = writer
        self.buf = bytearray()
        """Client bytes read past the current request (pipelining)."""
        self.watch: asyncio.Task[bytes] | None = None
        """A read of the client while its response streams: EOF means the client left."""
        self.client_gone = False
        self.up_reader: asyncio.StreamReader | None = None
        self.up_writer: asyncio.StreamWriter | None = None
        self.up_buf = b""

    def close(self) -> None:
        if self.watch is not None:
            self.watch.cancel()
        self._close_upstream()
        with contextlib.suppress(Exception):
            self.writer.close()

    def _close_upstream(self) -> None:
        if self.up_writer is not None:
            with contextlib.suppress(Exception):
                self.up_writer.transport.abort()
        self.up_reader = self.up_writer = None
        self.up_buf = b""

    async def _client_read(self) -> bytes:
        watch = self.watch
        if watch is not None:
            self.watch = None
            try:
                return await watch
            except (ConnectionError, OSError):
                return b""
        try:
            return await self.reader.read(_READ_SIZE)
        except (ConnectionError, OSError):
            return b""

    async def serve(self) -> None:
        while True:
            head, start_ns = await self._read_head()
            if head is None:
                return
            try:
                keep_alive = await self._exchange(head, start_ns)
            except _BadRequest as error:
                self.proxy.proxy_errors += 1
                await self._reply_error(400, "bad_request", str(error))
                return
            if not keep_alive or self.client_gone:
                return

    async def _read_head(self) -> tuple[bytes | None, int]:
        start_ns = self.proxy.clock()
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end >= 0:
                head = bytes(self.buf[: end + 4])
                del self.buf[: end + 4]
                return head, start_ns
            if len(self.buf) > _MAX_HEAD_BYTES:
                await self._reply_error(431, "bad_request", "request head too large")
                return None, 0
            data = await self._client_read()
            if not data:
                return None, 0
            if not self.buf:
                start_ns = self.proxy.clock()  # the span starts with the request's first bytes
            self.buf += data

    # --- one request ----------------------------------------------------------------------------
    async def _exchange(self, head: bytes, start_ns: int) -> bool:
        proxy = self.proxy
        proxy.requests += 1
        lines = head[:-4].split(b"\r\n")
        try:
            method, target, version = lines[0].split(b" ", 2)
        except ValueError:
            raise _BadRequest("bad request line") from None
        headers: dict[bytes, bytes] = {}
        forwarded = [method + b" " + proxy.upstream.prefix + target + b" " + version]
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise _BadRequest("bad header line")
            name = name.strip().lower()
            headers[name] = value.strip()
            if name not in _HOP_HEADERS:
                forwarded.append(line)
        if b"expect" in headers:  # answered here: the body is forwarded as it comes anyway
            self.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        path = target.split(b"?", 1)[0].decode("latin-1")
        http_span: HttpServerSpan | None = None
        if method == b"POST" and proxy.runtime is not None:
            http_span = self._begin_span(headers, path, start_ns)
        trace = http_span
        if trace is None:  # untraced: pass a caller's traceparent on unchanged
            incoming = headers.get(b"traceparent")
            if incoming is not None:
                forwarded.append(b"traceparent: " + incoming)
        else:
            forwarded.append(
                b"traceparent: " + format_traceparent(trace.trace_id, trace.span_id).encode()
            )
        forwarded.append(b"host: " + proxy.upstream.host_header)
        upstream_head = b"\r\n".join(forwarded) + b"\r\n\r\n"
        keep_alive = _keep_alive(version, headers)
        exchange = _Exchange(http_span, None)

        # The request: head and body to the upstream as they come.
        reused = self.up_writer is not None and not self._upstream_stale()
        if not reused and not await self._connect():
            await self._read_body(headers, exchange, None)
            exchange.timer = self._begin_timer(http_span, path, headers)
            return await self._fail(exchange, _ERROR_UPSTREAM_UNAVAILABLE, keep_alive=False)
        assert self.up_writer is not None
        exchange.forwarded_ns = self._clock()
        self.up_writer.write(upstream_head)
        await self._read_body(headers, exchange, self.up_writer)
        if http_span is not None and path in GENERATION_PATHS:
            exchange.timer = self._begin_timer(
                http_span, path, headers, arrival_ns=exchange.forwarded_ns
            )
        self.watch = asyncio.ensure_future(self.reader.read(_READ_SIZE))
        self.watch.add_done_callback(self._on_client_event)

        if not await self._response_head(exchange):
            if self.client_gone:
                self.proxy.aborted_requests += 1
                self._finish(exchange, _ERROR_ABORTED)
                return False
            replay = (
                reused
                and not self.client_gone
                and exchange.request_body_size <= _MAX_KEPT_REQUEST_BYTES
            )
            if not (replay and await self._connect()):
                return await self._fail(exchange, _ERROR_UPSTREAM_UNAVAILABLE, keep_alive=False)
            assert self.up_writer is not None
            self.up_writer.write(upstream_head + b"".join(exchange.request_body))
            if not await self._response_head(exchange):
                return await self._fail(exchange, _ERROR_UPSTREAM_UNAVAILABLE, keep_alive=False)
        return await self._response_body(method, exchange, keep_alive)

    def _begin_span(
        self, headers: Mapping[bytes, bytes], path: str, start_ns: int
    ) -> HttpServerSpan:
        incoming = headers.get(b"traceparent")
        context = None if incoming is None else parse_traceparent(incoming.decode("latin-1"))
        trace_id, parent = context if context is not None else (random_trace_id(), b"")
        facts = read_tcp_info(self.writer.get_extra_info("socket"))
        self.proxy.traced_requests += 1
        return HttpServerSpan(
            trace_id,
            random_span_id_bytes(),
            parent,
            "POST",
            path,
            start_ns,
            # A route names a template: the generation paths are, any other path is not.
            route=path if path in GENERATION_PATHS else "",
            receive_wait_ns=None if facts is None else facts.last_data_recv_ns,
        )

    def _clock(self) -> int | None:
        recorder = self.proxy.recorder
        return None if recorder is None else recorder.clock()

    def _begin_timer(
        self,
        span: HttpServerSpan | None,
        path: str,
        headers: Mapping[bytes, bytes],
        *,
        arrival_ns: int | None = None,
    ) -> RequestTimer | None:
        """``llm.request`` begins at ``arrival_ns`` (default: now): the request was fully
        received and handed to the engine."""
        recorder = self.proxy.recorder
        if span is None or recorder is None or path not in GENERATION_PATHS:
            return None
        timer = recorder.begin(f"proxy-{next(self.proxy._ids)}", arrival_ns=arrival_ns)
        if timer is None:
            return None
        timer.trace_id = span.trace_id
        timer.parent_span_id = span.span_id
        timer.attributes["operation"] = (
            semconv.OPERATION_CHAT if path in _CHAT_PATHS else semconv.OPERATION_TEXT_COMPLETION
        )
        return timer

    async def _read_body(
        self,
        headers: Mapping[bytes, bytes],
        exchange: _Exchange,
        upstream: asyncio.StreamWriter | None,
    ) -> None:
        """The request body, forwarded to ``upstream`` (None: read and dropped) as it comes."""
        keep = exchange.request_body

        def forward(piece: bytes) -> None:
            if exchange.request_body_size <= _MAX_KEPT_REQUEST_BYTES:
                keep.append(piece)
            exchange.request_body_size += len(piece)
            if upstream is not None:
                # Stamped before the write: the engine starts once it has the last piece, and a
                # loaded machine may deschedule this thread between a write and a clock read
                # (CI saw the stamp 7 ms late, a queue wait shorter than the engine's own).
                exchange.forwarded_ns = self._clock()
                upstream.write(piece)

        if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
            scanner = _Chunked()
            while True:
                data = bytes(self.buf)
                self.buf.clear()
                end = scanner.feed(data) if data else -1
                if end >= 0:
                    forward(data[:end])
                    self.buf += data[end:]
                    break
                if data:
                    forward(data)
                data = await self._client_read()
                if not data:
                    raise _BadRequest("the client closed the request body early")
                self.buf += data
        else:
            try:
                remaining = int(headers.get(b"content-length", b"0"))
            except ValueError:
                raise _BadRequest("bad content-length") from None
            while remaining > 0:
                if not self.buf:
                    data = await self._client_read()
                    if not data:
                        raise _BadRequest("the client closed the request body early")
                    self.buf += data
                piece = bytes(self.buf[:remaining])
                del self.buf[:remaining]
                remaining -= len(piece)
                forward(piece)
        if upstream is not None:
            with contextlib.suppress(ConnectionError, OSError):
                await upstream.drain()

    def _on_client_event(self, task: asyncio.Task[bytes]) -> None:
        """The watch read ended: EOF (or an error) means the client left mid-response."""
        if task.cancelled():
            return
        error = task.exception()
        if error is None and task.result():
            return  # a pipelined request: ``_client_read`` takes it from the task
        self.watch = None
        self.client_gone = True
        if self.up_writer is not None:  # the engine sees the connection close and stops
            with contextlib.suppress(Exception):
                self.up_writer.transport.abort()

    def _upstream_stale(self) -> bool:
        assert self.up_reader is not None and self.up_writer is not None
        return self.up_reader.at_eof() or self.up_writer.transport.is_closing()

    async def _connect(self) -> bool:
        self._close_upstream()
        upstream = self.proxy.upstream
        try:
            self.up_reader, self.up_writer = await asyncio.wait_for(
                asyncio.open_connection(upstream.host, upstream.port, limit=_READ_SIZE),
                self.proxy.connect_timeout_s,
            )
        except (OSError, asyncio.TimeoutError):
            return False
        return True

    async def _response_head(self, exchange: _Exchange) -> bool:
        """Reads the upstream's response head (1xx responses forwarded); False when the upstream
        closed first. The head is written to the client; body bytes read with it stay in
        ``up_buf``."""
        reader = self.up_reader
        assert reader is not None
        data = b""
        while True:
            end = data.find(b"\r\n\r\n")
            if end < 0:
                if len(data) > _MAX_HEAD_BYTES:
                    return False
                try:
                    more = await reader.read(_READ_SIZE)
                except (ConnectionError, OSError):
                    more = b""
                if not more:
                    return False
                data += more
                continue
            head, data = data[: end + 4], data[end + 4 :]
            lines = head[:-4].split(b"\r\n")
            try:
                status = int(lines[0].split(b" ", 2)[1])
            except (IndexError, ValueError):
                return False
            if 100 <= status < 200 and status != 101:
                if status != 100:  # ours went out already (Expect was answered here)
                    self.writer.write(head)
                continue
            headers = exchange.headers
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                headers[name.strip().lower()] = value.strip()
            exchange.status = status
            content_type = headers.get(b"content-type", b"").lower()
            exchange.streamed = content_type.startswith(_STREAM_TYPES)
            if exchange.span is not None:
                exchange.span.status_code = status
            self.up_buf = data
            self.writer.write(head)
            return True

    async def _response_body(self, method: bytes, exchange: _Exchange, keep_alive: bool) -> bool:
        """Forwards the body read by read; the request's end is timed before its last bytes are
        written. Returns whether the client connection stays open."""
        headers = exchange.headers
        status = exchange.status
        chunked = content_length = None
        if method == b"HEAD" or status in (204, 304):
            content_length = 0
        elif b"chunked" in headers.get(b"transfer-encoding", b"").lower():
            chunked = _Chunked(exchange.keep_body)
        else:
            try:
                content_length = int(headers[b"content-length"])
            except (KeyError, ValueError):
                content_length = None  # the body ends when the upstream closes
        upstream_keeps = chunked is not None or content_length is not None
        if headers.get(b"connection", b"").lower() == b"close":
            upstream_keeps = False
        keep_alive = keep_alive and upstream_keeps
        timer = exchange.timer
        tokens = None if timer is None or status >= _CLIENT_ERROR_STATUS else timer.token_ns
        streamed = exchange.streamed
        span = exchange.span
        clock = self.proxy.clock
        writer = self.writer
        reader = self.up_reader
        assert reader is not None
        content = _CONTENT
        first_body = span is not None
        data = self.up_buf
        self.up_buf = b""
        remaining = content_length
        while True:
            if data:
                now = clock()
                if tokens is not None:
                    if streamed:
                        count = len(content.findall(data))
                        if count == 1:
                            tokens.append(now)
                        elif count:
                            tokens.extend([now] * count)
                    elif not tokens:
                        tokens.append(now)
                if first_body and span is not None:
                    span.first_body_ns = now
                    first_body = False
                if chunked is not None:
                    end = chunked.feed(data)
                    if end >= 0:
                        data = data[:end]  # anything after it would be a protocol error
                        self._finish(exchange, None)
                        writer.write(data)
                        break
                elif remaining is not None:
                    if len(data) >= remaining:
                        data = data[:remaining]
                        exchange.keep_body(data)
                        self._finish(exchange, None)
                        writer.write(data)
                        break
                    remaining -= len(data)
                    exchange.keep_body(data)
                else:
                    exchange.keep_body(data)
                writer.write(data)
                try:
                    await writer.drain()
                except (ConnectionError, OSError):
                    self.client_gone = True
            elif remaining == 0:  # no body
                self._finish(exchange, None)
                break
            if self.client_gone:
                self.proxy.aborted_requests += 1
                self._finish(exchange, _ERROR_ABORTED)
                self._close_upstream()
                return False
            try:
                data = await reader.read(_READ_SIZE)
            except (ConnectionError, OSError):
                data = b""
            if not data:
                if self.client_gone:
                    continue  # counted above, on the next turn
                self._close_upstream()
                if chunked is None and remaining is None:  # close-delimited: this is the end
                    self._finish(exchange, None)
                    return False
                self._finish(exchange, _ERROR_UPSTREAM_CLOSED)
                return False
        try:
            await writer.drain()
        except (ConnectionError, OSError):
            return False
        if not upstream_keeps:
            self._close_upstream()
        return keep_alive

    async def _fail(self, exchange: _Exchange, error: str, *, keep_alive: bool) -> bool:
        """The upstream could not be reached, or closed before answering: 502."""
        self.proxy.upstream_errors += 1
        self._close_upstream()
        if exchange.span is not None:
            exchange.span.status_code = 502
        self._finish(exchange, error)
        await self._reply_error(502, "upstream_unavailable", f"{error}: {self.proxy.upstream.url}")
        return keep_alive

    async def _reply_error(self, status: int, kind: str, message: str) -> None:
        body = json.dumps(
            {"error": {"message": f"tokentrace proxy: {message}", "type": kind, "code": status}}
        ).encode()
        reason = {400: "Bad Request", 431: "Request Header Fields Too Large"}.get(
            status, "Bad Gateway"
        )
        self.writer.write(
            f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode()
            + body
        )
        with contextlib.suppress(ConnectionError, OSError):
            await self.writer.drain()

    # --- the request's end ----------------------------------------------------------------------
    def _finish(self, exchange: _Exchange, error: str | None) -> None:
        """Folds the engine's report into the timer and hands both spans to the emitter; the end
        is read here, before the last bytes are written (a client span always contains it)."""
        if exchange.finished:
            return
        exchange.finished = True
        try:
            self._fold(exchange, error)
        except Exception:  # tracing never costs the request
            self.proxy.tracing_errors += 1
            _log.debug("tokentrace proxy: could not trace a request", exc_info=True)
            if exchange.timer is not None and self.proxy.recorder is not None:
                self.proxy.recorder.finish(exchange.timer.request_id, status_error=error)
        span = exchange.span
        if span is not None:
            span.end_ns = self.proxy.clock()
            if error in (_ERROR_ABORTED, _ERROR_UPSTREAM_CLOSED):
                span.error = error
            self.proxy.submit_http_span(span)

    def _fold(self, exchange: _Exchange, error: str | None) -> None:
        timer = exchange.timer
        recorder = self.proxy.recorder
        span = exchange.span
        if timer is None or recorder is None:
            return
        report_ns = self.proxy.clock()
        status = exchange.status
        if error is None and status >= _CLIENT_ERROR_STATUS:
            error = f"HTTP {status}"
        attributes = timer.attributes
        _read_request_fields(b"".join(exchange.request_body), attributes)
        if status and status < _CLIENT_ERROR_STATUS:
            payload = b"".join(exchange.tail if exchange.streamed else exchange.body)
            objects = final_objects(payload, event_stream=exchange.streamed)
            report = read_report(self.proxy.engine, exchange.headers, objects)
            tokens = timer.token_ns
            seen = Observed(
                timer.arrival_ns,
                tokens[0] if tokens else None,
                tokens[-1] if tokens else None,
                report_ns,
                exchange.streamed,
            )
            bounds = fold(report, seen)
            timer.queued_ns = bounds.queued_ns
            timer.first_scheduled_ns = bounds.first_scheduled_ns
            timer.ready_ns = bounds.ready_ns
            if report.model and "model" not in attributes:
                attributes["model"] = report.model
            if report.response_id:
                attributes["request_id"] = report.response_id
            output = report.output_tokens
            if output is None and exchange.streamed and error is None:
                output = len(tokens)
            for name, value in (
                ("input_tokens", report.input_tokens),
                ("output_tokens", output),
                ("cached_tokens", report.cached_tokens),
                ("finish_reason", report.finish_reason),
            ):
                if value is not None:
                    attributes[name] = value
            if span is not None:
                not_reported = NOT_REPORTED[report.engine]
                if not exchange.streamed:
                    not_reported = (*not_reported, NOT_REPORTED_UNSTREAMED)
                span.attributes = {
                    semconv.PROXY_ENGINE: report.engine,
                    semconv.PROXY_NOT_REPORTED: not_reported,
                }
        recorder.finish(timer.request_id, status_error=error)


def _keep_alive(version: bytes, headers: Mapping[bytes, bytes]) -> bool:
    connection = headers.get(b"connection", b"").lower()
    if version.strip().upper() == b"HTTP/1.0":
        return b"keep-alive" in connection
    return b"close" not in connection


def _read_request_fields(body: bytes, attributes: dict[str, object]) -> None:
    """Model and sampling parameters from the request's JSON, each at its first mention (a
    scan, not a parse: the prompt can be long, and this runs on the event loop)."""
    seen: set[bytes] = set()
    for match in _REQUEST_FIELDS.finditer(body):
        name, raw = match.group(1), match.group(2)
        if name in seen:
            continue
        seen.add(name)
        try:
            value = json.loads(raw)
        except ValueError:
            continue
        if name == b"model":
            if isinstance(value, str) and value:
                attributes["model"] = value
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        elif name in _MAX_TOKENS_FIELDS or name == b"num_predict":
            attributes.setdefault("max_tokens", int(value))
        else:
            attributes[name.decode()] = float(value)
