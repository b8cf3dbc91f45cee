"""DelayProxy against real loopback servers: injected delay, no accumulation, integrity, close."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import http.server
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from tests.loadgen.delay_proxy import DelayProxy

_DELAY_S = 0.05
_ROUND_TRIP_SLACK_S = 0.08
"""Generous: the machine is shared, and a scheduling hiccup must not fail the suite."""
_IO_TIMEOUT_S = 5.0


class _AsyncEchoServer:
    """An asyncio echo server on its own thread: echoes every chunk, closes after the peer's EOF."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self.port = 0

    def __enter__(self) -> _AsyncEchoServer:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._on_client, "127.0.0.1", 0), self._loop
        ).result(timeout=_IO_TIMEOUT_S)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc_info: object) -> None:
        asyncio.run_coroutine_threadsafe(self._shut_down(), self._loop).result(_IO_TIMEOUT_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=_IO_TIMEOUT_S)
        self._loop.close()

    async def _shut_down(self) -> None:
        if self._server is not None:
            self._server.close()
        for handler in self._handlers:
            handler.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handler = asyncio.get_running_loop().create_task(self._echo(reader, writer))
        self._handlers.add(handler)
        handler.add_done_callback(self._handlers.discard)

    @staticmethod
    async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while chunk := await reader.read(64 * 1024):
                writer.write(chunk)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()


class _ReversingHandler(http.server.BaseHTTPRequestHandler):
    """POST answers the request body reversed; GET answers the path."""

    def do_GET(self) -> None:
        self._answer(f"path={self.path}".encode())

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self._answer(body[::-1])

    def _answer(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # keep test output quiet
        pass


@pytest.fixture
def echo_port() -> Iterator[int]:
    with _AsyncEchoServer() as server:
        yield server.port


@pytest.fixture
def http_port() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ReversingHandler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=_IO_TIMEOUT_S)


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=_IO_TIMEOUT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no Nagle wait between sends
    return sock


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    received = bytearray()
    while len(received) < size:
        chunk = sock.recv(size - len(received))
        if not chunk:
            raise AssertionError(f"EOF after {len(received)} of {size} bytes")
        received += chunk
    return bytes(received)


def _recv_until_eof(sock: socket.socket) -> bytes:
    received = bytearray()
    while chunk := sock.recv(64 * 1024):
        received += chunk
    return bytes(received)


def _round_trip_s(sock: socket.socket, message: bytes) -> float:
    started = time.monotonic()
    sock.sendall(message)
    echoed = _recv_exactly(sock, len(message))
    elapsed = time.monotonic() - started
    assert echoed == message
    return elapsed


def test_round_trip_gains_twice_the_one_way_delay(echo_port: int) -> None:
    with (
        DelayProxy(("127.0.0.1", echo_port), one_way_delay_s=_DELAY_S) as proxy,
        _connect(proxy.port) as sock,
    ):
        elapsed = _round_trip_s(sock, b"ping")
    assert 2 * _DELAY_S <= elapsed < 2 * _DELAY_S + _ROUND_TRIP_SLACK_S


def test_zero_delay_adds_almost_nothing(echo_port: int) -> None:
    with (
        DelayProxy(("127.0.0.1", echo_port), one_way_delay_s=0.0) as proxy,
        _connect(proxy.port) as sock,
    ):
        # The best of a few: a single round trip may lose the CPU to another process.
        elapsed = min(_round_trip_s(sock, b"ping-%d" % i) for i in range(5))
    assert elapsed < 0.02


def test_delay_does_not_accumulate_across_back_to_back_messages(echo_port: int) -> None:
    messages = [b"message-%d" % i for i in range(5)]  # equal lengths: easy to split the echo
    size = len(messages[0])
    with (
        DelayProxy(("127.0.0.1", echo_port), one_way_delay_s=_DELAY_S) as proxy,
        _connect(proxy.port) as sock,
    ):
        sent_at = []
        for message in messages:
            sent_at.append(time.monotonic())
            sock.sendall(message)
            time.sleep(0.01)
        # All sends finish (~50 ms) before the first echo is due (100 ms), so the loop below
        # is already blocked in recv when each echo lands.
        received = bytearray()
        arrived_at: list[float] = []
        while len(arrived_at) < len(messages):
            chunk = sock.recv(4096)
            now = time.monotonic()
            assert chunk, "EOF before every echo arrived"
            received += chunk
            while len(arrived_at) < min(len(received) // size, len(messages)):
                arrived_at.append(now)
    assert bytes(received) == b"".join(messages)
    round_trips = [arrived - sent for sent, arrived in zip(sent_at, arrived_at, strict=True)]
    for round_trip in round_trips:
        assert 2 * _DELAY_S <= round_trip <= 2 * _DELAY_S + 0.06, round_trips


@pytest.mark.parametrize(
    ("max_queued_chunks", "chunk_size"),
    [(1024, 64 * 1024), (2, 64 * 1024)],
    ids=["default-bounds", "tiny-queue"],
)
def test_two_megabytes_echo_back_byte_identical(
    echo_port: int, max_queued_chunks: int, chunk_size: int
) -> None:
    payload = os.urandom(2 * 1024 * 1024)
    with DelayProxy(
        ("127.0.0.1", echo_port),
        one_way_delay_s=0.01,
        max_queued_chunks=max_queued_chunks,
        chunk_size=chunk_size,
    ) as proxy:
        with _connect(proxy.port) as sock:
            # Send from a thread: the echo pushes back once the client's receive buffer is full.
            sender = threading.Thread(target=sock.sendall, args=(payload,), daemon=True)
            sender.start()
            echoed = _recv_exactly(sock, len(payload))
            sender.join(timeout=_IO_TIMEOUT_S)
        stats = proxy.stats()
    assert echoed == payload
    assert stats["bytes_up"] == stats["bytes_down"] == len(payload)
    assert stats["connections"] == 1
    if max_queued_chunks == 2:  # 2 MB cannot fit in 2 queued chunks: the reader must wait
        assert stats["backpressure_waits"] > 0


def test_http_round_trip_through_the_proxy(http_port: int) -> None:
    request_body = os.urandom(100_000)
    with DelayProxy(("127.0.0.1", http_port), one_way_delay_s=_DELAY_S) as proxy:
        connection = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=_IO_TIMEOUT_S)
        try:
            started = time.monotonic()
            connection.request("POST", "/v1/completions", body=request_body)
            response = connection.getresponse()
            response_body = response.read()
            elapsed = time.monotonic() - started
            connection.request("GET", "/health")  # HTTP/1.0 upstream: a fresh connection
            health = connection.getresponse().read()
        finally:
            connection.close()
    assert response.status == 200
    assert response_body == request_body[::-1]
    assert health == b"path=/health"
    assert 2 * _DELAY_S <= elapsed < 2 * _DELAY_S + _ROUND_TRIP_SLACK_S


def test_half_close_is_forwarded_after_the_delay(echo_port: int) -> None:
    with (
        DelayProxy(("127.0.0.1", echo_port), one_way_delay_s=_DELAY_S) as proxy,
        _connect(proxy.port) as sock,
    ):
        started = time.monotonic()
        sock.sendall(b"last words")
        sock.shutdown(socket.SHUT_WR)  # the echo server closes once it sees this EOF
        echoed = _recv_until_eof(sock)
        elapsed = time.monotonic() - started
    assert echoed == b"last words"
    assert 2 * _DELAY_S <= elapsed < 2 * _DELAY_S + _ROUND_TRIP_SLACK_S


def test_stop_closes_open_connections_and_the_port(echo_port: int) -> None:
    proxy = DelayProxy(("127.0.0.1", echo_port), one_way_delay_s=_DELAY_S)
    proxy.start()
    port = proxy.port
    with _connect(port) as sock:
        _round_trip_s(sock, b"hello")  # the upstream leg is certainly open now
        assert proxy.stats()["open_connections"] == 1
        started = time.monotonic()
        proxy.stop()
        stop_s = time.monotonic() - started
        assert sock.recv(1) == b""  # EOF, not a hang until the timeout
    proxy.stop()  # idempotent
    assert stop_s < 1.0
    assert proxy.stats()["open_connections"] == 0
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=_IO_TIMEOUT_S).close()


def test_unreachable_upstream_closes_the_client_and_is_counted() -> None:
    # A bound but not listening socket: connecting to its port is refused, and nobody else can
    # take the port while this test holds it.
    with socket.socket() as unreachable:
        unreachable.bind(("127.0.0.1", 0))
        with DelayProxy(unreachable.getsockname(), one_way_delay_s=_DELAY_S) as proxy:
            # A reset also tells the client that the connection is gone.
            with _connect(proxy.port) as sock, contextlib.suppress(ConnectionResetError):
                assert sock.recv(1) == b""
            stats = proxy.stats()
    assert stats["upstream_connect_failures"] == 1
    assert stats["connections"] == 1
