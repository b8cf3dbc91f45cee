"""OTLP/HTTP trace receiver (``POST /v1/traces``) served by uvicorn.

Binary protobuf (``application/x-protobuf``) and OTLP/JSON (``application/json``: hex trace and
span ids, lowerCamelCase keys, int64 as strings) with ``Content-Encoding`` gzip, deflate or
identity. The request handling is a raw ASGI app (:mod:`.otlp_http_app`); here it is served by
uvicorn on its own thread and event loop:

- the socket is bound before the thread starts (``:0`` gives a free port, a taken port fails in
  the caller); uvicorn on a thread other than the main one leaves SIGINT/SIGTERM to the host;
- at most ``max_connections`` connections: one more gets a 503 with ``Retry-After`` at once;
- every reply goes out in one write (uvicorn writes status line, headers and body separately,
  which costs a round of delayed ACKs on a kept-alive connection without TCP_NODELAY);
- HTTP parse errors (bad request line, invalid or conflicting Content-Length) get 400 and count
  as malformed; they are logged at DEBUG, not once per request at WARNING.

The HTTP parser is httptools (llhttp, in C) when it is installed, else h11 (pure Python, always
installed with uvicorn): with httptools one sequential sender gets through about half as much
again. Both refuse ambiguous framing with 400. They differ where HTTP leaves the choice: the
same Content-Length twice is one length to h11 and a 400 from httptools (RFC 9110 allows
either), and httptools writes the reply's header names in lower case.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Final

from tokentrace.collector.consumer import TraceConsumer
from tokentrace.collector.receivers import (
    OtlpReceiverBase,
    ReceiverCounters,
    ReceiverStartError,
)
from tokentrace.collector.receivers.otlp_http_app import (
    TRACES_PATH,
    OtlpHttpApp,
    otlp_json_to_request,
)
from tokentrace.collector.receivers.validate import DEFAULT_SPAN_LIMITS, SpanLimits

__all__ = [
    "HTTP_PARSERS",
    "TRACES_PATH",
    "OtlpHttpReceiver",
    "ReceiverStartError",
    "default_http_parser",
    "otlp_json_to_request",
]

_log = logging.getLogger(__name__)

_DEFAULT_ENDPOINT: Final = "127.0.0.1:4318"
_DEFAULT_MAX_REQUEST_BODY_SIZE: Final = 20 * 1024 * 1024
_DEFAULT_MAX_CONNECTIONS: Final = 64
_DEFAULT_SOCKET_TIMEOUT_S: Final = 30.0
_DEFAULT_SHUTDOWN_GRACE_S: Final = 5.0
_START_TIMEOUT_S: Final = 10.0
_START_POLL_S: Final = 0.005
# uvicorn notices should_exit within one 0.1 s tick and pauses 0.1 s before closing connections.
_STOP_OVERHEAD_S: Final = 1.0
_MIN_GRACE_S: Final = 0.05
_LISTEN_BACKLOG: Final = 128
HTTP_PARSERS: Final = ("httptools", "h11")
_OVER_CAPACITY_RESPONSE: Final = (
    b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\n"
    b"Content-Length: 0\r\nConnection: close\r\n\r\n"
)

if TYPE_CHECKING:
    _LoggerAdapter = logging.LoggerAdapter[logging.Logger]
else:
    _LoggerAdapter = logging.LoggerAdapter


class _ServerLog(_LoggerAdapter):
    """uvicorn's per-connection log, under this module's name, with its warnings (one per
    malformed request) demoted to DEBUG; errors stay errors."""

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        if level == logging.WARNING:
            level = logging.DEBUG
        super().log(level, msg, *args, **kwargs)

    @property
    def level(self) -> int:  # uvicorn compares it with its TRACE level per connection
        return self.logger.getEffectiveLevel()


class _CoalescingTransport(asyncio.Transport):
    """Joins what the protocol writes in one turn of the event loop into one ``write``.

    uvicorn's h11 protocol writes a reply as status line and headers, body, and end of message:
    here they leave in one send (one TCP segment when it fits), flushed at the end of the turn
    or before the connection closes.
    """

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if self._pending is None:
            self._pending = [bytes(data)]
            self._loop.call_soon(self._flush)
        else:
            self._pending.append(bytes(data))

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def _flush(self) -> None:
        pending, self._pending = self._pending, None
        if pending and not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending = None
        self._transport.abort()

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        pending = sum(len(data) for data in self._pending or ())
        return self._transport.get_write_buffer_size() + pending

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()


def default_http_parser() -> str:
    """``httptools`` when it is installed, else ``h11``."""
    try:
        import httptools  # noqa: F401
    except ImportError:
        return "h11"
    return "httptools"


def _protocol_class(
    max_connections: int, counters: ReceiverCounters, *, http_parser: str = "h11"
) -> type[asyncio.Protocol]:
    """uvicorn's protocol for ``http_parser`` with a connection cap, one write per reply and
    counted 400s."""
    base: type[Any]  # either: both take the same hooks
    if http_parser == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        base = HttpToolsProtocol
    else:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        base = H11Protocol

    class OtlpHttpProtocol(base):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.logger = _ServerLog(_log)
            self._refused = False

        def connection_made(self, transport: asyncio.Transport) -> None:
            if len(self.connections) >= max_connections:
                # Answered at once, before any request: the sender backs off and retries.
                self._refused = True
                counters.add("refused_connections")
                transport.write(_OVER_CAPACITY_RESPONSE)
                transport.close()
                return
            super().connection_made(_CoalescingTransport(transport, self.loop))

        def connection_lost(self, exc: Exception | None) -> None:
            if not self._refused:
                super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if not self._refused:
                super().data_received(data)

        def send_400_response(self, msg: str) -> None:
            # The HTTP parser refused the request (bad request line, bad or conflicting
            # Content-Length, header too large): count it like any other malformed request.
            counters.add("malformed_requests")
            super().send_400_response(msg)

    return OtlpHttpProtocol


class OtlpHttpReceiver(OtlpReceiverBase):
    """Serves OTLP/HTTP trace exports on ``POST /v1/traces`` and hands valid spans to ``consumer``.

    One uvicorn server on a daemon thread. Small protobuf exports are decoded on its event loop
    and, when the consumer declares ``never_blocks``, handed to it there; the rest runs on a pool
    of at most ``max_connections`` threads (see :mod:`.otlp_http_app`). At most
    ``max_connections`` connections at once (further connections get 503 and count as
    ``refused_connections``); idle keep-alive connections and request bodies that stall close
    after ``socket_timeout_s``. Binds loopback by default; TLS and a bearer token are opt-in.
    ``http_parser``: one of ``HTTP_PARSERS``; by default httptools when it is installed.
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
        http_parser: str | None = None,
        span_limits: SpanLimits = DEFAULT_SPAN_LIMITS,
    ) -> None:
        super().__init__(
            consumer,
            endpoint=endpoint,
            auth_token=auth_token,
            tls_cert_file=tls_cert_file,
            tls_key_file=tls_key_file,
            span_limits=span_limits,
        )
        if max_request_body_size <= 0 or max_connections <= 0 or socket_timeout_s <= 0:
            raise ValueError(
                "max_request_body_size, max_connections and socket_timeout_s must be positive"
            )
        if http_parser is not None and http_parser not in HTTP_PARSERS:
            raise ValueError(f"http_parser must be one of {HTTP_PARSERS}, got {http_parser!r}")
        self._http_parser = http_parser
        self._max_request_body_size = max_request_body_size
        self._max_connections = max_connections
        self._socket_timeout_s = socket_timeout_s
        self._server: Any = None
        self._app: OtlpHttpApp | None = None
        self._socket: socket.socket | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Bind and serve on a daemon thread; raises ReceiverStartError if that fails."""
        if self._server is not None:
            raise RuntimeError("receiver already started")
        host, port = self._bind_address()
        self._check_tls_files()
        try:
            import uvicorn
        except ImportError as error:
            raise ReceiverStartError(
                f"OTLP HTTP receiver on {self._endpoint} needs uvicorn: {error}"
            ) from None
        http_parser = self._http_parser or default_http_parser()
        if http_parser == "httptools" and default_http_parser() != "httptools":
            raise ReceiverStartError(
                f"OTLP HTTP receiver on {self._endpoint}: httptools is not installed"
            )
        sock = self._listen(host, port)
        executor = ThreadPoolExecutor(
            max_workers=self._max_connections, thread_name_prefix="otlp-http-export"
        )
        app = OtlpHttpApp(
            self._consumer,
            self._counters,
            executor,
            max_request_body_size=self._max_request_body_size,
            auth_token=self._auth_token,
            read_timeout_s=self._socket_timeout_s,
            span_limits=self._span_limits,
        )
        tls: dict[str, Any] = {}
        if self._tls_cert_file is not None:
            tls = {"ssl_certfile": self._tls_cert_file, "ssl_keyfile": self._tls_key_file}
        try:
            config = uvicorn.Config(
                app,
                http=_protocol_class(
                    self._max_connections, self._counters, http_parser=http_parser
                ),
                loop="asyncio",  # never installs an event-loop policy in the host process
                interface="asgi3",
                lifespan="off",
                ws="none",  # nor a websocket library loaded
                # The host's logging configuration stays as it is; uvicorn's own loggers say
                # only warnings (as the API server's do), not "running on ... CTRL+C".
                log_config=None,
                log_level="warning",
                access_log=False,
                server_header=False,
                proxy_headers=False,
                timeout_keep_alive=max(1, round(self._socket_timeout_s)),
                timeout_graceful_shutdown=int(_DEFAULT_SHUTDOWN_GRACE_S),
                backlog=_LISTEN_BACKLOG,
                **tls,
            )
            config.load()  # TLS files and the app, here in the caller
        except (OSError, ssl.SSLError, ValueError) as error:
            sock.close()
            executor.shutdown(wait=False)
            raise ReceiverStartError(
                f"OTLP HTTP receiver on {self._endpoint} cannot start: {error}"
            ) from error
        server = uvicorn.Server(config)
        self._socket, self._executor, self._app, self._server = sock, executor, app, server
        self._port = int(sock.getsockname()[1])
        self._thread = threading.Thread(
            target=self._serve, args=(server, sock), name=f"otlp-http-{self.port}", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.shutdown(0)
                raise ReceiverStartError(
                    f"OTLP HTTP receiver on {self._endpoint} did not start "
                    f"within {_START_TIMEOUT_S:g} s"
                )
            time.sleep(_START_POLL_S)
        _log.debug(
            "OTLP HTTP receiver listening on %s (port %d, %s)",
            self._endpoint,
            self.port,
            http_parser,
        )

    @staticmethod
    def _serve(server: Any, sock: socket.socket) -> None:
        try:
            server.run(sockets=[sock])
        except BaseException:  # SystemExit from a failed startup included: log, never raise
            _log.error("OTLP HTTP receiver stopped on an error", exc_info=True)

    def _listen(self, host: str, port: int) -> socket.socket:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as error:
            raise ReceiverStartError(
                f"OTLP HTTP receiver cannot bind {self._endpoint}: {error}"
            ) from error
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(_LISTEN_BACKLOG)
        except (OSError, UnicodeError, OverflowError) as error:
            sock.close()
            raise ReceiverStartError(
                f"OTLP HTTP receiver cannot bind {self._endpoint}: {error}"
            ) from error
        return sock

    def shutdown(self, grace_s: float = _DEFAULT_SHUTDOWN_GRACE_S) -> None:
        """Stop accepting, close the listening socket and idle connections, and give requests
        being handled up to ``grace_s`` to finish (then they are cancelled). Waits for the
        server thread; a request arriving meanwhile gets 503. Idempotent."""
        server, self._server = self._server, None
        thread, self._thread = self._thread, None
        if server is None:
            return
        if self._app is not None:
            self._app.stopping = True
        # (uvicorn reports a zero timeout as exceeded even with nothing left to wait for.)
        server.config.timeout_graceful_shutdown = max(_MIN_GRACE_S, grace_s)
        server.should_exit = True
        if thread is not None:
            thread.join(max(0.0, grace_s) + _STOP_OVERHEAD_S)
            if thread.is_alive():
                _log.warning("OTLP HTTP receiver on port %d did not stop in time", self.port)
        if self._socket is not None:
            self._socket.close()  # uvicorn closed it already; this covers a failed start
            self._socket = None
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def _check_tls_files(self) -> None:
        if self._tls_cert_file is None or self._tls_key_file is None:
            return
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(self._tls_cert_file, self._tls_key_file)
        except (OSError, ssl.SSLError) as error:
            raise ReceiverStartError(
                f"OTLP HTTP receiver on {self._endpoint}: cannot load TLS files: {error}"
            ) from error
