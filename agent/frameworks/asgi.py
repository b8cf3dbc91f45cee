"""The HTTP server span of each generation request an ASGI app serves (vLLM's FastAPI server).

Why: a request is the server's from the moment its HTTP server hands it to the app, well before
the engine sees it (parsing, chat templating, tokenisation), until the response's last bytes are
handed to the transport, after the engine's last token (detokenisation, SSE encoding). When the
server's event loop is busy (many concurrent streams on a few cores) both stretches grow to
seconds. Without this span the budget has no server start and end but the engine's, and can only
call that time ``network``; with it, the time is ``http`` (span start -> engine arrival) and
``postprocess`` (last token -> span end), as docs/architecture.md defines them.

The middleware wraps the app's whole middleware stack (it is the outermost layer). Per request:
one clock read at the start and one just before the response's last bytes are sent (so the span
ends before the client can see the response end, and a client span always contains it; the
app's background tasks after that are not the request's), one when the first non-empty body
bytes are sent (``tokentrace.http.first_body_time``: for a stream, the first token's delivery;
after it, one test of a flag per chunk), the ``traceparent`` header parsed, a span id chosen
and a context variable set, which the framework's hooks read when the request reaches the
engine (``current_http_span``), so that ``llm.request`` is the HTTP span's child. The span is
planned and encoded on the emitter's thread. Only ``POST`` requests are traced: health checks,
metrics scrapes and model listings would add a span per poll and carry no generation.

What happened before the span starts: the request's bytes may have waited in the kernel (the
accept queue, a busy event loop) before the app saw them. At the start, one ``TCP_INFO`` read on
the request's socket says how long ago the kernel received its last bytes
(``tokentrace.http.receive_wait_ns``, millisecond resolution), so the collector can tell the
server's backlog from the network. ASGI gives the app no socket: under uvicorn, the ``send``
the outermost layer receives is the bound ``RequestResponseCycle.send``, whose cycle holds the
transport. With any other server (or when anything in that chain is not what it looks like)
the attribute is absent; "measured 0" and "unknown" stay distinguishable. The read is the
largest single cost of the tracing in vLLM's busy API server (~10-16 µs of CPU there, cold
caches around a system call; docs/performance.md): ``TOKENTRACE_HTTP_RECEIVE_WAIT=false``
(``receive_wait=False``) leaves it out.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from functools import partial
from types import CoroutineType
from typing import Any, Final

from tokentrace.agent import compiled, semconv
from tokentrace.agent.hooks import HookGuard
from tokentrace.agent.recorder import MonotonicToUnix
from tokentrace.agent.span_ids import parse_traceparent, random_span_id_bytes, random_trace_id
from tokentrace.agent.spans import KIND_SERVER, AttrValue, DeferredSpans, PlannedSpan, SpanJob
from tokentrace.agent.tcp_info import read_tcp_info

__all__ = [
    "HOOK_HTTP_SERVER",
    "HttpServerSpan",
    "HttpServerTracer",
    "current_http_span",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
AsgiApp = Callable[[Scope, Receive, Send], Awaitable[None]]

HOOK_HTTP_SERVER: Final = "asgi.http_server"
_TRACED_METHODS: Final = frozenset({"POST"})
_TRACEPARENT_HEADER: Final = b"traceparent"
_RESPONSE_START: Final = "http.response.start"
_RESPONSE_BODY: Final = "http.response.body"
_SERVER_ERROR_STATUS: Final = 500
_ROOT_LOCAL_ID: Final = 0


@dataclass(slots=True)
class HttpServerSpan:
    """One traced HTTP request, as monotonic-ns integers until the emitter plans its span."""

    trace_id: bytes
    span_id: bytes
    parent_span_id: bytes
    """The caller's span (from ``traceparent``); empty: the HTTP span is the trace's root."""
    method: str
    path: str
    start_ns: int
    end_ns: int = 0
    """Read just before the response's last bytes are sent (0 until then)."""
    status_code: int = 0
    """From ``http.response.start``; 0 when the app sent no response."""
    route: str = ""
    """The matched route's template (FastAPI sets ``scope["route"]``), for the span's name."""
    error: str | None = None
    """The exception the app raised, by type name."""
    receive_wait_ns: int | None = None
    """How long the request's bytes had waited in the kernel when the app started (TCP_INFO,
    ms resolution); None when the server's socket could not be read."""
    first_body_ns: int = 0
    """Read when the first non-empty ``http.response.body`` was sent (0 until then)."""
    attributes: dict[str, AttrValue] | None = None
    """More attributes for the span (``tokentrace proxy``: whose timing report it read)."""


_current: contextvars.ContextVar[HttpServerSpan | None] = contextvars.ContextVar(
    "tokentrace_http_server_span", default=None
)


def current_http_span() -> HttpServerSpan | None:
    """The HTTP request the calling task serves (tasks the app starts inherit it), if traced."""
    return _current.get()


class HttpServerTracer:
    """Makes the tracing middleware and turns each finished ``HttpServerSpan`` into a span.

    ``submit`` is the emitter's (``SpanEmitter.submit``): it takes a ``DeferredSpans``, which
    the emitter calls on its own thread.
    """

    def __init__(
        self,
        submit: Callable[[DeferredSpans], None],
        *,
        guard: HookGuard,
        to_unix: MonotonicToUnix,
        monotonic_ns: Callable[[], int] = time.monotonic_ns,
        receive_wait: bool = True,
    ) -> None:
        """``receive_wait``: read each request's kernel wait (``_receive_wait_ns``: a system
        call per request); False leaves ``receive_wait_ns`` None."""
        self._submit = submit
        self.receive_wait = receive_wait
        self.guard = guard
        self._to_unix = to_unix
        self.clock = monotonic_ns
        self.traced_requests = 0

    def stats(self) -> dict[str, int]:
        return {"http_server_spans": self.traced_requests}

    def middleware(self, app: AsgiApp, *, enabled: Callable[[], bool]) -> AsgiApp:
        """``app`` wrapped: traced while ``enabled()`` (checked per request) and the hook is;
        ``app`` itself when it is this tracer's middleware already."""
        if isinstance(app, _TracingMiddleware):
            return app
        return _TracingMiddleware(app, self, enabled)

    def begin(self, scope: Scope, send: Send) -> HttpServerSpan:
        """The span of a request whose app starts now; ``send`` is the server's (see
        ``_receive_wait_ns``)."""
        start_ns = self.clock()
        receive_wait_ns = _receive_wait_ns(send) if self.receive_wait else None
        context = None
        for name, value in scope.get("headers") or ():
            if name == _TRACEPARENT_HEADER:
                context = parse_traceparent(value.decode("latin-1"))
                break
        trace_id, parent_span_id = context if context is not None else (random_trace_id(), b"")
        self.traced_requests += 1
        return HttpServerSpan(
            trace_id,
            random_span_id_bytes(),
            parent_span_id,
            str(scope["method"]),
            str(scope.get("path", "")),
            start_ns,
            receive_wait_ns=receive_wait_ns,
        )

    def end(self, span: HttpServerSpan, scope: Scope) -> None:
        """The app returned; the span ends when the response's last bytes were sent, else now
        (no complete response: an exception, a client that left)."""
        if not span.end_ns:
            span.end_ns = self.clock()
        route = getattr(scope.get("route"), "path", None)
        if isinstance(route, str):
            span.route = route
        self._submit(partial(self._plan, span))

    def _plan(self, span: HttpServerSpan) -> list[SpanJob]:
        return plan_http_server_span(span, self._to_unix)


def plan_http_server_span(span: HttpServerSpan, to_unix: MonotonicToUnix) -> list[SpanJob]:
    """On the emitter's thread: the HTTP SERVER span in Unix time (this middleware's, and
    ``tokentrace proxy``'s)."""
    unix = to_unix.to_unix_ns
    start = unix(span.start_ns)
    attributes: dict[str, AttrValue] = {
        semconv.HTTP_REQUEST_METHOD: span.method,
        semconv.URL_PATH: span.path,
    }
    status = span.status_code
    if status:
        attributes[semconv.HTTP_RESPONSE_STATUS_CODE] = status
    if span.route:
        attributes[semconv.HTTP_ROUTE] = span.route
    if span.receive_wait_ns is not None:
        attributes[semconv.HTTP_RECEIVE_WAIT_NS] = span.receive_wait_ns
    if span.first_body_ns:
        attributes[semconv.HTTP_FIRST_BODY_TIME] = unix(span.first_body_ns)
    if span.attributes:
        attributes.update(span.attributes)
    status_error = span.error
    if status_error is None and status >= _SERVER_ERROR_STATUS:
        status_error = f"HTTP {status}"  # 4xx is the client's error, not the server span's
    if status_error is not None:
        attributes[semconv.ERROR_TYPE] = span.error or str(status)
    # Semantic conventions: "{method} {route}", the method alone without a route (a raw
    # path would give every unknown URL a span name of its own).
    name = f"{span.method} {span.route}" if span.route else span.method
    planned = PlannedSpan(
        _ROOT_LOCAL_ID, -1, name, KIND_SERVER, start, max(unix(span.end_ns), start),
        attributes, status_error,
    )  # fmt: skip
    return [SpanJob(span.trace_id, span.parent_span_id, [planned], {_ROOT_LOCAL_ID: span.span_id})]


def _receive_wait_ns(send: Send) -> int | None:
    """TCP_INFO ``last_data_recv`` of the request's connection, if ``send`` is uvicorn's (a
    bound ``RequestResponseCycle.send``: ``send.__self__.transport`` is the connection's); None
    for any other server. Never raises: these are someone else's objects."""
    try:
        # getattr with defaults: no exception to pay for on the usual non-uvicorn path.
        transport = getattr(getattr(send, "__self__", None), "transport", None)
        if transport is None:
            return None
        facts = read_tcp_info(transport.get_extra_info("socket"))
    except Exception:
        return None
    return None if facts is None else facts.last_data_recv_ns


class _TracingMiddleware:
    """Pure ASGI (no ``BaseHTTPMiddleware``: its extra task and body buffering would change the
    app's timing); the app's own call always runs outside the guard.

    Not a coroutine function: a traced request's call returns the app's coroutine wrapped by
    ``_TRACED_AWAIT`` (C: no Python frame each time the request's task resumes, where a
    coroutine here would be one more in the chain of awaits), an untraced one the app's own.
    """

    __slots__ = ("_app", "_enabled", "_tracer")

    def __init__(self, app: AsgiApp, tracer: HttpServerTracer, enabled: Callable[[], bool]) -> None:
        self._app = app
        self._tracer = tracer
        self._enabled = enabled

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        tracer = self._tracer
        if (
            scope.get("type") != "http"
            or scope.get("method") not in _TRACED_METHODS
            or not self._enabled()
        ):
            return self._app(scope, receive, send)
        span: HttpServerSpan | None = tracer.guard.run(HOOK_HTTP_SERVER, tracer.begin, scope, send)
        if span is None:
            return self._app(scope, receive, send)
        # Set here, in the task that awaits this call (tasks the app starts inherit it).
        on_exit = partial(_end_request, tracer, span, scope, _current.set(span))
        try:
            call = self._app(scope, receive, _TRACED_SEND(send, span, tracer.clock))
        except BaseException as exc:  # an app that fails before it returns an awaitable
            on_exit(exc)
            raise
        if _TRACED_AWAIT is not None and type(call) is CoroutineType:
            return _TRACED_AWAIT(call, on_exit)
        return _traced_await(call, on_exit)


def _end_request(
    tracer: HttpServerTracer,
    span: HttpServerSpan,
    scope: Scope,
    token: contextvars.Token[HttpServerSpan | None],
    exc: BaseException | None,
) -> None:
    """The app's call ended (returned, raised, or was closed): the span is handed on."""
    if exc is not None:
        span.error = type(exc).__name__
    # Not contextlib.suppress: two Python calls more per request.
    try:  # noqa: SIM105
        _current.reset(token)
    except ValueError:  # closed by a finalizer, in a context that is not the request's
        pass
    tracer.guard.run(HOOK_HTTP_SERVER, tracer.end, span, scope)


async def _traced_await(
    call: Awaitable[Any], on_exit: Callable[[BaseException | None], object]
) -> Any:
    """The twin of ``_asgi.traced_await``: ``call`` awaited; ``on_exit`` once when it ends."""
    try:
        result = await call
    except BaseException as exc:
        on_exit(exc)
        raise
    on_exit(None)
    return result


def _traced_send(send: Send, span: HttpServerSpan, clock: Callable[[], int]) -> Send:
    """The twin of ``_asgi.traced_send``: the app's ``send``, which stamps ``span`` from each
    message before calling the server's ``send``."""
    first_body_pending = True  # a closure cell: cheaper per chunk than the span's attribute

    # Not a coroutine function: it hands back ``send``'s own awaitable, so a streamed chunk
    # costs no extra coroutine (created, started, finished) on the serving thread.
    def send_traced(message: Message) -> Awaitable[None]:
        nonlocal first_body_pending
        kind = message.get("type")
        if kind == _RESPONSE_BODY:
            if first_body_pending and message.get("body"):
                span.first_body_ns = clock()
                first_body_pending = False
            if not message.get("more_body", False):
                # Read before the last bytes are handed over, so that the span ends before
                # any client can see the response end (a client span always contains it).
                span.end_ns = clock()
        elif kind == _RESPONSE_START:
            status = message.get("status")
            if type(status) is int:
                span.status_code = status
        return send(message)

    return send_traced


_ASGI = compiled.load("tokentrace.agent._asgi")
_TRACED_AWAIT: Callable[[Any, Callable[[BaseException | None], object]], Awaitable[Any]] | None = (
    None if _ASGI is None else _ASGI.traced_await
)
"""``_asgi.c``'s wrapper of a traced request's coroutine, if built (``_traced_await`` is its
twin, and answers for an app whose call returns another kind of awaitable)."""
_TRACED_SEND: Callable[[Send, HttpServerSpan, Callable[[], int]], Send] = (
    _traced_send if _ASGI is None else _ASGI.traced_send
)
"""The app's ``send`` of a traced request: ``_asgi.c``'s if built, else ``_traced_send``."""
