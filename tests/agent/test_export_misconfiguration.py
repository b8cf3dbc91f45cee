"""A misconfigured OTLP endpoint is named in one log line and not retried: OTLP/HTTP sent to a
gRPC port, TLS against a plain-text server and plain text against a TLS server, a path with no
OTLP/HTTP receiver, gRPC sent to an HTTP/1.1 server. Against real loopback servers on port 0."""

from __future__ import annotations

import contextlib
import http.server
import logging
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from tests.collector.upstream import FLUSH_S, TINY_RETRY
from tokentrace.agent.otlp_config import OtlpExporterConfig, RetryConfig
from tokentrace.agent.otlp_export import OtlpSender

_H2_SETTINGS = bytes.fromhex(
    "000018040000000000"  # SETTINGS, 24 bytes, stream 0: what grpc's server sends first
    "000400400000000500400000000600004000fe0300000001"
)
_H2_GOAWAY = bytes.fromhex("0000080700000000000000000000000001")
_TLS_ALERT = b"\x15\x03\x01\x00\x02\x02\x46"  # fatal alert: protocol_version
_BATCHES = 3
_SPANS = 5
_AGENT_LOGGERS = "tokentrace"


# --- servers ---------------------------------------------------------------------------------
class SocketServer:
    """Accepts on 127.0.0.1:0 in a thread and runs ``handle`` on each connection; counts them."""

    def __init__(self, handle: Callable[[socket.socket], None]) -> None:
        self._handle = handle
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self.connections = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            with connection:
                connection.settimeout(5)
                with contextlib.suppress(OSError):
                    self._handle(connection)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept (Linux)
        self._listener.close()
        self._thread.join(5)


@pytest.fixture
def serve() -> Iterator[Callable[[Callable[[socket.socket], None]], SocketServer]]:
    servers: list[SocketServer] = []

    def start(handle: Callable[[socket.socket], None]) -> SocketServer:
        servers.append(SocketServer(handle))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def read_http_request(connection: socket.socket) -> None:
    """The whole request (headers, then Content-Length bytes): a server that closes with a
    request's body unread resets the connection, and the client may see the reset first."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = connection.recv(65536)
        if not chunk:
            return
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
         if line.lower().startswith(b"content-length:")),
        0,
    )  # fmt: skip
    while len(body) < length:
        chunk = connection.recv(65536)
        if not chunk:
            return
        body += chunk


def answer_http2(connection: socket.socket) -> None:
    read_http_request(connection)
    connection.sendall(_H2_SETTINGS + _H2_GOAWAY)


def answer_tls_alert(connection: socket.socket) -> None:
    read_http_request(connection)
    connection.sendall(_TLS_ALERT)


def answer_plain_http_400(connection: socket.socket) -> None:
    connection.recv(65536)  # a TLS ClientHello, to a plain HTTP server: 400
    connection.sendall(
        b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )


class TlsServer:
    """A TLS server (Python's ssl, i.e. OpenSSL) answering any request with 200; counts the
    handshakes that failed on plain text and those that succeeded."""

    def __init__(self, certificate: tuple[str, str]) -> None:
        self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._context.load_cert_chain(*certificate)
        self.plain_text_refused = 0
        self.handshakes = 0
        self._server = SocketServer(self._handle)
        self.port = self._server.port

    def _handle(self, connection: socket.socket) -> None:
        try:
            tls = self._context.wrap_socket(connection, server_side=True)
        except ssl.SSLError:
            self.plain_text_refused += 1
            return
        self.handshakes += 1
        with tls:
            tls.recv(65536)

    def close(self) -> None:
        self._server.close()


class HttpServer:
    """A plain HTTP/1.1 server answering every POST with ``status``; counts the requests."""

    def __init__(self, status: int) -> None:
        self.status = status
        self.paths: list[str] = []
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                owner.paths.append(self.path)
                self.send_response(owner.status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# --- the sender --------------------------------------------------------------------------------
def sender_to(endpoint: str, protocol: str = "http/protobuf", **options: Any) -> OtlpSender:
    config = OtlpExporterConfig(
        **{
            "traces_endpoint": endpoint,
            "protocol": protocol,
            "timeout_s": 2.0,
            "retry": TINY_RETRY,  # ~100 attempts in 2 s if it were retried: unmistakable
            "compression": "none",
            **options,
        }
    )
    return OtlpSender(config, signal="traces")


def export_batches(sender: OtlpSender, batches: int = _BATCHES) -> dict[str, int]:
    for _ in range(batches):
        assert sender.submit(b"\x0a\x00", _SPANS)
    sender.shutdown(FLUSH_S)
    return sender.stats()


def agent_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.name.startswith(_AGENT_LOGGERS) and record.levelno >= logging.WARNING
    ]


def assert_named_once_and_dropped(
    caplog: pytest.LogCaptureFixture, stats: dict[str, int], *phrases: str
) -> str:
    assert (stats["dropped_spans"], stats["sent_spans"], stats["retries"]) == (
        _BATCHES * _SPANS,
        0,
        0,
    )
    (line,) = agent_lines(caplog)
    assert "is misconfigured" in line and "without retrying" in line
    for phrase in phrases:
        assert phrase in line
    return line


# --- OTLP/HTTP to a gRPC port ----------------------------------------------------------------
def test_http_export_to_a_real_grpc_server_names_grpc_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokentrace.agent import otlp_transport

    posts = []
    real_post = otlp_transport._HttpTransport._post

    def counting_post(self: Any, connection: Any, body: bytes) -> Any:
        posts.append(body)
        return real_post(self, connection, body)

    monkeypatch.setattr(otlp_transport._HttpTransport, "_post", counting_post)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        caplog.set_level(logging.INFO)
        sender = sender_to(f"http://127.0.0.1:{port}/v1/traces")
        stats = export_batches(sender)
    finally:
        server.stop(None)
    line = assert_named_once_and_dropped(
        caplog, stats, "speaks gRPC (HTTP/2)", "OTEL_EXPORTER_OTLP_PROTOCOL=grpc"
    )
    assert "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" in line and "4318" in line
    assert len(posts) == 1  # one attempt; the later batches are dropped without sending
    assert sender.misconfiguration is not None and "gRPC" in sender.misconfiguration


def test_http_export_to_an_http2_socket_makes_one_connection(
    serve: Callable[..., SocketServer], caplog: pytest.LogCaptureFixture
) -> None:
    server = serve(answer_http2)
    caplog.set_level(logging.INFO)
    stats = export_batches(sender_to(f"http://127.0.0.1:{server.port}/v1/traces"))
    assert_named_once_and_dropped(caplog, stats, "speaks gRPC (HTTP/2)")
    assert server.connections == 1


def test_base_endpoint_names_the_general_variable(
    serve: Callable[..., SocketServer], caplog: pytest.LogCaptureFixture
) -> None:
    server = serve(answer_http2)
    caplog.set_level(logging.INFO)
    config = OtlpExporterConfig(
        endpoint=f"http://127.0.0.1:{server.port}", timeout_s=2.0, retry=TINY_RETRY
    )
    sender = OtlpSender(config, signal="traces")
    line = assert_named_once_and_dropped(
        caplog, export_batches(sender), "point OTEL_EXPORTER_OTLP_ENDPOINT at"
    )
    assert "TRACES_ENDPOINT" not in line


# --- TLS against plain text, plain text against TLS -------------------------------------------
def test_https_export_to_a_plain_text_server_names_tls(
    serve: Callable[..., SocketServer], caplog: pytest.LogCaptureFixture
) -> None:
    server = serve(answer_plain_http_400)
    caplog.set_level(logging.INFO)
    stats = export_batches(sender_to(f"https://127.0.0.1:{server.port}/v1/traces"))
    assert_named_once_and_dropped(caplog, stats, "does not speak TLS", "use an http:// URL")
    assert server.connections == 1


def test_https_export_to_a_real_grpc_plain_text_port_names_tls(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        caplog.set_level(logging.INFO)
        stats = export_batches(sender_to(f"https://127.0.0.1:{port}/v1/traces"))
    finally:
        server.stop(None)
    assert_named_once_and_dropped(caplog, stats, "does not speak TLS")


def test_http_export_to_a_tls_server_names_tls(
    tls_files: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    server = TlsServer(tls_files)
    try:
        caplog.set_level(logging.INFO)
        stats = export_batches(sender_to(f"http://127.0.0.1:{server.port}/v1/traces"))
    finally:
        server.close()
    assert_named_once_and_dropped(caplog, stats, "speaks TLS", "use an https:// URL")
    # One plain-text request (the server hung up on it) and one TLS probe, nothing more.
    assert (server.plain_text_refused, server.handshakes) == (1, 1)


def test_http_export_to_a_server_answering_a_tls_alert_names_tls(
    serve: Callable[..., SocketServer], caplog: pytest.LogCaptureFixture
) -> None:
    server = serve(answer_tls_alert)
    caplog.set_level(logging.INFO)
    stats = export_batches(sender_to(f"http://127.0.0.1:{server.port}/v1/traces"))
    assert_named_once_and_dropped(caplog, stats, "speaks TLS")
    assert server.connections == 1


def test_a_server_hanging_up_without_tls_is_still_retried(
    serve: Callable[..., SocketServer], caplog: pytest.LogCaptureFixture
) -> None:
    # Closing without a word is not proof of TLS: the probe says no, the retries go on.
    server = serve(lambda connection: connection.recv(65536))
    caplog.set_level(logging.INFO)
    retry = RetryConfig(initial_interval_s=0.01, max_interval_s=0.02, max_elapsed_s=0.3)
    sender = sender_to(f"http://127.0.0.1:{server.port}/v1/traces", retry=retry)
    assert sender.submit(b"\x0a\x00", _SPANS)
    sender.shutdown(FLUSH_S)
    stats = sender.stats()
    assert stats["dropped_spans"] == _SPANS and stats["retries"] > 1
    assert sender.misconfiguration is None
    assert not any("misconfigured" in line for line in agent_lines(caplog))


# --- a path with no OTLP/HTTP receiver --------------------------------------------------------
def test_404_names_the_path_tried_and_the_one_expected(caplog: pytest.LogCaptureFixture) -> None:
    server = HttpServer(404)
    try:
        caplog.set_level(logging.INFO)
        # A signal endpoint is used as it is: without /v1/traces it posts to "/".
        stats = export_batches(sender_to(f"http://127.0.0.1:{server.port}"))
    finally:
        server.close()
    line = assert_named_once_and_dropped(
        caplog,
        stats,
        "404 for path '/'",
        "expects /v1/traces",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    )
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in line
    assert server.paths == ["/"]


def test_the_endpoint_is_tried_again_after_the_recheck_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = HttpServer(404)
    now = [1000.0]
    config = OtlpExporterConfig(
        traces_endpoint=f"http://127.0.0.1:{server.port}/v1/traces",
        timeout_s=2.0,
        retry=TINY_RETRY,
    )
    sender = OtlpSender(config, signal="traces", clock=lambda: now[0])
    caplog.set_level(logging.INFO)
    try:
        for _ in range(2):
            assert sender.submit(b"\x0a\x00", _SPANS)
        assert sender.force_flush(FLUSH_S)
        assert server.paths == ["/v1/traces"]
        assert "no OTLP/HTTP traces receiver there" in (sender.misconfiguration or "")
        server.status = 200  # fixed (e.g. the right server started on that port)
        assert sender.submit(b"\x0a\x00", _SPANS) and sender.force_flush(FLUSH_S)
        assert len(server.paths) == 1  # still inside the recheck interval: not sent
        now[0] += 31.0
        assert sender.submit(b"\x0a\x00", _SPANS) and sender.force_flush(FLUSH_S)
        assert len(server.paths) == 2 and sender.misconfiguration is None
        sender.shutdown(FLUSH_S)
    finally:
        server.close()
    stats = sender.stats()
    assert (stats["dropped_spans"], stats["sent_spans"], stats["retries"]) == (
        3 * _SPANS,
        _SPANS,
        0,
    )
    assert len(agent_lines(caplog)) == 1


# --- gRPC to an HTTP/1.1 server, gRPC with TLS to plain text ----------------------------------
def test_grpc_export_to_an_http1_server_names_http(caplog: pytest.LogCaptureFixture) -> None:
    server = HttpServer(200)
    try:
        caplog.set_level(logging.INFO)
        stats = export_batches(sender_to(f"http://127.0.0.1:{server.port}", protocol="grpc"))
    finally:
        server.close()
    line = assert_named_once_and_dropped(
        caplog, stats, "speaks HTTP/1.1, not gRPC", "OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf"
    )
    assert "4317" in line


def test_grpc_tls_export_to_a_plain_text_grpc_server_names_tls(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        caplog.set_level(logging.INFO)
        stats = export_batches(sender_to(f"https://127.0.0.1:{port}", protocol="grpc"))
    finally:
        server.stop(None)
    assert_named_once_and_dropped(
        caplog, stats, "does not speak TLS", "OTEL_EXPORTER_OTLP_INSECURE=true"
    )
