"""The OTLP sender's TLS material from the ``OTEL_EXPORTER_OTLP_*`` variables, over both
protocols: the CA in ``..._CERTIFICATE`` makes a private-CA server reachable, a server
certificate that fails verification is named in one log line, and the client certificate and key
in ``..._CLIENT_CERTIFICATE`` / ``..._CLIENT_KEY`` are presented to a server that requires one.

The CA cases run against the collector's own TLS receivers on loopback. Those receivers cannot
require a client certificate, so the mTLS cases run against test-owned servers that do: grpc's
server with ``require_client_auth`` and Python's ``http.server`` behind an ``ssl`` context with
``CERT_REQUIRED``; each records the client certificate's common name it saw.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.server
import logging
import shutil
import ssl
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.agent.tls_material import make_certificate
from tests.collector.consumers import RecordingConsumer
from tests.collector.upstream import FLUSH_S, TINY_RETRY
from tokentrace.agent.otlp_config import SIGNAL_SPECS, OtlpExporterConfig, RetryConfig
from tokentrace.agent.otlp_export import OtlpSender
from tokentrace.collector.receivers.otlp_grpc import OtlpGrpcReceiver
from tokentrace.collector.receivers.otlp_http import OtlpHttpReceiver

ENV = "OTEL_EXPORTER_OTLP_"
PROTOCOLS = ("grpc", "http/protobuf")
_TIMEOUT_MS = "5000"
_QUICK_GIVE_UP = RetryConfig(initial_interval_s=0.01, max_interval_s=0.02, max_elapsed_s=0.3)
"""For a server that hangs up on a handshake without a client certificate: retryable, so
retried; give up soon."""
_SENDER_LOGGER = "tokentrace.agent.otlp_export"


def one_span_request(name: str) -> bytes:
    request = ExportTraceServiceRequest()
    span = request.resource_spans.add().scope_spans.add().spans.add()
    span.trace_id = bytes(range(1, 17))
    span.span_id = bytes(range(1, 9))
    span.name = name
    span.start_time_unix_nano = 1_700_000_000_000_000_000
    span.end_time_unix_nano = 1_700_000_000_500_000_000
    return request.SerializeToString()


def sender_from_env(environ: dict[str, str], *, retry: RetryConfig = TINY_RETRY) -> OtlpSender:
    """The traces sender the variables describe (as the in-process agent reads them)."""
    config = OtlpExporterConfig.from_env({**environ, f"{ENV}TIMEOUT": _TIMEOUT_MS}, signal="traces")
    assert config is not None
    return OtlpSender(dataclasses.replace(config, retry=retry), signal="traces")


def export(sender: OtlpSender, *names: str) -> dict[str, int]:
    """Send one span per name, one request each, and wait until each was sent or given up."""
    for name in names:
        assert sender.submit(one_span_request(name), 1)
        assert sender.force_flush(FLUSH_S)
    return sender.stats()


def error_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == _SENDER_LOGGER and record.levelno >= logging.ERROR
    ]


# --- the collector's TLS receivers ------------------------------------------------------------
@contextlib.contextmanager
def tls_receiver(
    protocol: str, certificate: tuple[str, str], consumer: RecordingConsumer
) -> Iterator[dict[str, str]]:
    """The collector's receiver of ``protocol`` with TLS on 127.0.0.1:0; yields the endpoint
    and protocol variables that point at it."""
    cert, key = certificate
    receiver_type = OtlpGrpcReceiver if protocol == "grpc" else OtlpHttpReceiver
    receiver = receiver_type(consumer, endpoint="127.0.0.1:0", tls_cert_file=cert, tls_key_file=key)
    receiver.start()
    try:
        yield {
            f"{ENV}ENDPOINT": f"https://127.0.0.1:{receiver.port}",
            f"{ENV}PROTOCOL": protocol,
        }
    finally:
        receiver.shutdown(grace_s=0)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_certificate_variable_makes_a_private_ca_server_reachable(
    protocol: str, tls_files: tuple[str, str], tmp_path: Path
) -> None:
    consumer = RecordingConsumer()
    ca_file = tmp_path / "ca.pem"
    shutil.copy(tls_files[0], ca_file)  # the self-signed certificate is its own CA
    with tls_receiver(protocol, tls_files, consumer) as environ:
        sender = sender_from_env({**environ, f"{ENV}CERTIFICATE": str(ca_file)})
        try:
            assert export(sender, "first")["sent_spans"] == 1
            # The CA was read when the connection was made, not per request.
            ca_file.unlink()
            stats = export(sender, "second")
        finally:
            sender.shutdown(FLUSH_S)
    assert (stats["sent_spans"], stats["dropped_spans"], stats["retries"]) == (2, 0, 0)
    assert consumer.span_names() == ["first", "second"]
    assert sender.misconfiguration is None


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("trusted", ["another CA", "the system's trust store"])
def test_an_untrusted_server_certificate_is_named_in_one_line_and_not_retried(
    protocol: str,
    trusted: str,
    tls_files: tuple[str, str],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    consumer = RecordingConsumer()
    caplog.set_level(logging.INFO)
    with tls_receiver(protocol, tls_files, consumer) as environ:
        if trusted == "another CA":
            other_ca, _ = make_certificate(tmp_path, "other-ca")
            environ[f"{ENV}CERTIFICATE"] = other_ca
        sender = sender_from_env(environ)
        try:
            stats = export(sender, "a", "b")
        finally:
            sender.shutdown(FLUSH_S)
    assert (stats["sent_spans"], stats["dropped_spans"], stats["retries"]) == (0, 2, 0)
    assert consumer.span_names() == []
    (line,) = error_lines(caplog)
    assert "\n" not in line and "is misconfigured" in line
    assert "the server's TLS certificate is not trusted by" in line
    assert "self-signed certificate)" in line.replace("self signed", "self-signed")
    assert f"set {ENV}CERTIFICATE to the PEM file of the CA" in line
    if trusted == "another CA":
        assert f"the CA file {environ[f'{ENV}CERTIFICATE']!r}" in line
    else:
        assert "the system's trust store" in line
    assert sender.misconfiguration is not None and sender.misconfiguration in line


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_certificate_for_another_host_is_named_as_such(
    protocol: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    consumer = RecordingConsumer()
    caplog.set_level(logging.INFO)
    elsewhere = make_certificate(tmp_path, "elsewhere", subject_alt_name="DNS:elsewhere.example")
    with tls_receiver(protocol, elsewhere, consumer) as environ:
        sender = sender_from_env({**environ, f"{ENV}CERTIFICATE": elsewhere[0]})
        try:
            stats = export(sender, "a")
        finally:
            sender.shutdown(FLUSH_S)
    assert (stats["sent_spans"], stats["dropped_spans"], stats["retries"]) == (0, 1, 0)
    (line,) = error_lines(caplog)
    assert "does not name the endpoint's host" in line
    assert f"in {ENV}ENDPOINT" in line


# --- mTLS: test-owned servers that require a client certificate -------------------------------
@dataclasses.dataclass
class MtlsServer:
    """Where a server requiring a client certificate listens, and the client common names it
    accepted a request from."""

    endpoint: str
    client_names: list[str]


@contextlib.contextmanager
def grpc_mtls_server(certificate: tuple[str, str], client_ca: str) -> Iterator[MtlsServer]:
    cert, key = (Path(path).read_bytes() for path in certificate)
    client_names: list[str] = []

    def export_call(request: bytes, context: grpc.ServicerContext) -> bytes:
        names: Any = context.auth_context().get("x509_common_name", [b"?"])  # a list of bytes
        client_names.append(names[0].decode())
        return b""  # an empty ExportTraceServiceResponse

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    method = SIGNAL_SPECS["traces"].grpc_method
    service, name = method.strip("/").split("/")
    handler = grpc.unary_unary_rpc_method_handler(export_call)  # raw bytes both ways
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service, {name: handler}),)
    )
    credentials = grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=Path(client_ca).read_bytes(), require_client_auth=True
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        yield MtlsServer(f"https://127.0.0.1:{port}", client_names)
    finally:
        server.stop(None)


@contextlib.contextmanager
def http_mtls_server(certificate: tuple[str, str], client_ca: str) -> Iterator[MtlsServer]:
    client_names: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            peer: Any = self.connection.getpeercert()
            subject = dict(pair for rdn in peer["subject"] for pair in rdn)
            client_names.append(subject["commonName"])
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*certificate)
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cafile=client_ca)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield MtlsServer(f"https://127.0.0.1:{server.server_address[1]}", client_names)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@contextlib.contextmanager
def mtls_server(
    protocol: str, certificate: tuple[str, str], client_ca: str
) -> Iterator[MtlsServer]:
    start = grpc_mtls_server if protocol == "grpc" else http_mtls_server
    with start(certificate, client_ca) as server:
        yield server


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_client_certificate_variables_are_presented_for_mtls(
    protocol: str, tls_files: tuple[str, str], tmp_path: Path
) -> None:
    client_cert, client_key = make_certificate(tmp_path, "tokentrace-client")
    with mtls_server(protocol, tls_files, client_ca=client_cert) as server:
        environ = {
            f"{ENV}ENDPOINT": server.endpoint,
            f"{ENV}PROTOCOL": protocol,
            f"{ENV}CERTIFICATE": tls_files[0],
        }
        sender = sender_from_env(
            {
                **environ,
                f"{ENV}TRACES_CLIENT_CERTIFICATE": client_cert,
                f"{ENV}TRACES_CLIENT_KEY": client_key,
            }
        )
        try:
            stats = export(sender, "mtls")
        finally:
            sender.shutdown(FLUSH_S)
        assert (stats["sent_spans"], stats["dropped_spans"]) == (1, 0)
        assert server.client_names == ["tokentrace-client"]
        # The same server refuses a sender without a client certificate: the test means it.
        without = sender_from_env(environ, retry=_QUICK_GIVE_UP)
        try:
            stats = export(without, "no-client-certificate")
        finally:
            without.shutdown(FLUSH_S)
        assert (stats["sent_spans"], stats["dropped_spans"]) == (0, 1)
        assert server.client_names == ["tokentrace-client"]


# --- the node agent's upstream ------------------------------------------------------------------
def test_the_node_agent_upstream_takes_the_tls_variables(
    tls_files: tuple[str, str], tmp_path: Path
) -> None:
    import argparse

    from tokentrace.agent.node_cli import NodeAgentCommand, config_from_args

    client_cert, client_key = make_certificate(tmp_path, "node-agent")
    parser = argparse.ArgumentParser()
    NodeAgentCommand().add_arguments(parser)
    environ = {
        f"{ENV}ENDPOINT": "https://collector:4317",
        f"{ENV}METRICS_ENDPOINT": "https://metrics:4318/v1/metrics",
        f"{ENV}METRICS_PROTOCOL": "http/protobuf",
        f"{ENV}CERTIFICATE": tls_files[0],
        f"{ENV}CLIENT_CERTIFICATE": client_cert,
        f"{ENV}CLIENT_KEY": client_key,
    }
    config = config_from_args(parser.parse_args([]), environ)
    assert config.metrics_exporter is not None
    for exporter in (config.exporter, config.metrics_exporter):
        assert (
            exporter.certificate_file,
            exporter.client_certificate_file,
            exporter.client_key_file,
        ) == (tls_files[0], client_cert, client_key)
    with pytest.raises(ValueError, match=f"^{ENV}METRICS_CERTIFICATE: "):
        config_from_args(
            parser.parse_args([]),
            {**environ, f"{ENV}METRICS_CERTIFICATE": str(tmp_path / "missing.pem")},
        )
