"""The node agent's receivers: bearer token, TLS, and no open receiver off loopback.

The node agent relays what it receives to the collector under its own upstream credentials, so
its receivers take the collector's receiver options (``auth_token``, TLS files). These tests run
it with real sockets on 127.0.0.1 (port 0) against a test upstream, with the official OTLP
exporters, and the in-process agent's own sender configured from ``OTEL_EXPORTER_OTLP_HEADERS``,
as clients.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as GrpcSpanExporter,
)
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter as HttpSpanExporter,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.collector.upstream import UpstreamOtlp
from tests.node.node_agent_process import listening_ports, start_node_agent
from tests.node.test_node_agent import _request, _span, relayed
from tokentrace.agent import semconv
from tokentrace.agent.node.sampler import NvmlSampler
from tokentrace.agent.node.service import NodeAgent, NodeAgentConfig, bind_endpoint
from tokentrace.agent.node_cli import NodeAgentCommand, config_from_args
from tokentrace.agent.otlp_config import OtlpExporterConfig
from tokentrace.agent.otlp_export import OtlpSender
from tokentrace.collector.receivers import is_loopback_endpoint

TOKEN = "node-agent-token-0123456789"


class _NoNvml(NvmlSampler):
    """A CPU node: spans are relayed unchanged, at once."""

    def open(self) -> bool:
        self.unavailable_reason = "test: no NVML"
        return False


def _sdk_spans(name: str = "llm.request") -> list[ReadableSpan]:
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "auth-test"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    with provider.get_tracer("test").start_as_current_span(name):
        pass
    provider.shutdown()
    return list(memory.get_finished_spans())


def _relayed_names(upstream: UpstreamOtlp) -> list[str]:
    return [span.name for _, span in relayed(upstream)]


def _agent(upstream: UpstreamOtlp, **options: Any) -> NodeAgent:
    config = NodeAgentConfig(
        grpc_endpoint="127.0.0.1:0",
        http_endpoint="127.0.0.1:0",
        exporter=OtlpExporterConfig(endpoint=upstream.grpc_endpoint, protocol="grpc"),
        max_hold_s=0.0,
        **options,
    )
    agent = NodeAgent(config, sampler=_NoNvml(), environ={"K8S_NODE_NAME": "gpu-node-1"})
    agent.start()
    return agent


@pytest.fixture
def agent_with_token(upstream: UpstreamOtlp) -> Iterator[tuple[NodeAgent, int, int]]:
    """A node agent requiring ``TOKEN``; yields it with its gRPC and HTTP ports."""
    agent = _agent(upstream, auth_token=TOKEN)
    try:
        grpc_receiver, http_receiver = agent.receivers
        yield agent, grpc_receiver.port, http_receiver.port
    finally:
        agent.shutdown(2.0)


# -- bearer token --------------------------------------------------------------------------------


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong-token"),)])
def test_grpc_export_without_or_with_a_wrong_token_is_unauthenticated(
    agent_with_token: tuple[NodeAgent, int, int],
    upstream: UpstreamOtlp,
    metadata: tuple[tuple[str, str], ...],
) -> None:
    agent, grpc_port, _ = agent_with_token
    request = _request([_span(semconv.SPAN_REQUEST, 1, 2)])
    with (
        grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel,
        pytest.raises(grpc.RpcError) as raised,
    ):
        TraceServiceStub(channel).Export(request, metadata=metadata, timeout=5)
    assert raised.value.code() is grpc.StatusCode.UNAUTHENTICATED
    # The official exporter gives up at once (UNAUTHENTICATED is not retryable).
    exporter = GrpcSpanExporter(
        endpoint=f"127.0.0.1:{grpc_port}", insecure=True, headers=dict(metadata), timeout=5
    )
    try:
        assert exporter.export(_sdk_spans()) is SpanExportResult.FAILURE
    finally:
        exporter.shutdown()
    assert agent.stats()["OtlpGrpcReceiver.unauthenticated_requests"] == 2
    assert agent.stats()["OtlpGrpcReceiver.accepted_spans"] == 0
    time.sleep(0.2)
    assert upstream.trace_requests == []


@pytest.mark.parametrize("authorization", [None, "Bearer wrong-token", f"Basic {TOKEN}"])
def test_http_export_without_or_with_a_wrong_token_is_401(
    agent_with_token: tuple[NodeAgent, int, int],
    upstream: UpstreamOtlp,
    authorization: str | None,
) -> None:
    agent, _, http_port = agent_with_token
    headers = {"Content-Type": "application/x-protobuf"}
    if authorization is not None:
        headers["Authorization"] = authorization
    body = _request([_span(semconv.SPAN_REQUEST, 1, 2)]).SerializeToString()
    post = urllib.request.Request(
        f"http://127.0.0.1:{http_port}/v1/traces", data=body, headers=headers, method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(post, timeout=5)
    assert raised.value.code == 401
    raised.value.close()
    exporter = HttpSpanExporter(
        endpoint=f"http://127.0.0.1:{http_port}/v1/traces",
        headers={} if authorization is None else {"authorization": authorization},
        timeout=5,
    )
    try:
        assert exporter.export(_sdk_spans()) is SpanExportResult.FAILURE
    finally:
        exporter.shutdown()
    assert agent.stats()["OtlpHttpReceiver.unauthenticated_requests"] == 2
    time.sleep(0.2)
    assert upstream.trace_requests == []


def test_exports_with_the_right_token_are_relayed_upstream(
    agent_with_token: tuple[NodeAgent, int, int], upstream: UpstreamOtlp
) -> None:
    agent, grpc_port, http_port = agent_with_token
    grpc_exporter = GrpcSpanExporter(
        endpoint=f"127.0.0.1:{grpc_port}",
        insecure=True,
        headers={"authorization": f"Bearer {TOKEN}"},
        timeout=5,
    )
    http_exporter = HttpSpanExporter(
        endpoint=f"http://127.0.0.1:{http_port}/v1/traces",
        headers={"authorization": f"Bearer {TOKEN}"},
        timeout=5,
    )
    try:
        assert grpc_exporter.export(_sdk_spans("over-grpc")) is SpanExportResult.SUCCESS
        assert http_exporter.export(_sdk_spans("over-http")) is SpanExportResult.SUCCESS
    finally:
        grpc_exporter.shutdown()
        http_exporter.shutdown()
    assert upstream.wait_for(lambda: len(relayed(upstream)) == 2)
    assert sorted(_relayed_names(upstream)) == ["over-grpc", "over-http"]
    # Node identity is added; the node agent's token does not travel upstream.
    assert all(resource[semconv.K8S_NODE_NAME] == "gpu-node-1" for resource, _ in relayed(upstream))
    assert all(TOKEN not in value for call in upstream.calls for value in call.headers.values())
    assert agent.stats()["OtlpGrpcReceiver.unauthenticated_requests"] == 0


def test_the_in_process_agent_sends_the_token_from_otel_exporter_otlp_headers(
    agent_with_token: tuple[NodeAgent, int, int],
    upstream: UpstreamOtlp,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What docs/node-agent.md tells inference pods to set: the standard variable, URL-encoded,
    read by the in-process agent's sender and by the OpenTelemetry SDK's exporters alike."""
    _, grpc_port, http_port = agent_with_token
    environ = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{grpc_port}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_HEADERS": f"authorization=Bearer%20{TOKEN}",
    }
    config = OtlpExporterConfig.from_env(environ, signal="traces")
    assert config is not None
    sender = OtlpSender(config, signal="traces")
    try:
        now = time.time_ns()
        assert sender.submit(
            _request([_span("from-agent", now - 1000, now)]).SerializeToString(), 1
        )
        assert sender.force_flush(5.0)
    finally:
        sender.shutdown(1.0)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"authorization=Bearer%20{TOKEN}")
    sdk_exporter = HttpSpanExporter(endpoint=f"http://127.0.0.1:{http_port}/v1/traces", timeout=5)
    try:
        assert sdk_exporter.export(_sdk_spans("from-sdk")) is SpanExportResult.SUCCESS
    finally:
        sdk_exporter.shutdown()
    assert upstream.wait_for(lambda: len(relayed(upstream)) == 2)
    assert sorted(_relayed_names(upstream)) == ["from-agent", "from-sdk"]


# -- TLS -----------------------------------------------------------------------------------------


def test_tls_and_token_on_both_receivers(
    tls_files: tuple[str, str], upstream: UpstreamOtlp, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = tls_files
    # requests lets these override the exporter's certificate_file (session.verify).
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    monkeypatch.delenv("CURL_CA_BUNDLE", raising=False)
    agent = _agent(upstream, auth_token=TOKEN, tls_cert_file=cert, tls_key_file=key)
    try:
        grpc_receiver, http_receiver = agent.receivers
        authorization = {"authorization": f"Bearer {TOKEN}"}
        grpc_exporter = GrpcSpanExporter(
            endpoint=f"localhost:{grpc_receiver.port}",
            credentials=grpc.ssl_channel_credentials(Path(cert).read_bytes()),
            headers=authorization,
            timeout=5,
        )
        http_exporter = HttpSpanExporter(
            endpoint=f"https://127.0.0.1:{http_receiver.port}/v1/traces",
            certificate_file=cert,
            headers=authorization,
            timeout=5,
        )
        try:
            assert grpc_exporter.export(_sdk_spans("tls-grpc")) is SpanExportResult.SUCCESS
            assert http_exporter.export(_sdk_spans("tls-http")) is SpanExportResult.SUCCESS
        finally:
            grpc_exporter.shutdown()
            http_exporter.shutdown()
        assert upstream.wait_for(lambda: len(relayed(upstream)) == 2)
        assert sorted(_relayed_names(upstream)) == ["tls-grpc", "tls-http"]
        # Plaintext to a TLS receiver gets nowhere.
        body = _request([_span(semconv.SPAN_REQUEST, 1, 2)]).SerializeToString()
        post = urllib.request.Request(
            f"http://127.0.0.1:{http_receiver.port}/v1/traces",
            data=body,
            headers={"Content-Type": "application/x-protobuf", **authorization},
            method="POST",
        )
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            urllib.request.urlopen(post, timeout=5)
    finally:
        agent.shutdown(2.0)
    assert len(relayed(upstream)) == 2


# -- exposure ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "loopback"),
    [
        ("127.0.0.1:4317", True),
        ("127.0.0.2:0", True),
        ("localhost:4317", True),
        ("[::1]:4317", True),
        ("0.0.0.0:4317", False),
        ("[::]:4317", False),
        ("10.1.2.3:4317", False),
        ("fd00::5:4317", False),
        ("node-agent:4317", False),
    ],
)
def test_loopback_endpoints(endpoint: str, loopback: bool) -> None:
    assert is_loopback_endpoint(endpoint) is loopback


def test_an_ipv6_pod_ip_is_bracketed_for_binding() -> None:
    assert bind_endpoint("fd00::5:4317") == "[fd00::5]:4317"  # "$(POD_IP):4317" on IPv6
    assert bind_endpoint("[fd00::5]:4317") == "[fd00::5]:4317"
    assert bind_endpoint("10.1.2.3:4317") == "10.1.2.3:4317"


def test_a_non_loopback_receiver_needs_a_token_or_an_explicit_allowance() -> None:
    for endpoints in (
        {"grpc_endpoint": "0.0.0.0:4317"},
        {"grpc_endpoint": None, "http_endpoint": "10.1.2.3:4318"},
    ):
        with pytest.raises(ValueError, match=r"not a loopback address.*--allow-unauthenticated"):
            NodeAgentConfig(**endpoints).validate()  # type: ignore[arg-type]
        NodeAgentConfig(**endpoints, auth_token=TOKEN).validate()  # type: ignore[arg-type]
        NodeAgentConfig(**endpoints, allow_unauthenticated=True).validate()  # type: ignore[arg-type]
    NodeAgentConfig().validate()  # loopback: no token needed
    with pytest.raises(ValueError, match="tls_cert_file/tls_key_file"):
        NodeAgentConfig(tls_cert_file="cert.pem").validate()
    with pytest.raises(ValueError, match="auth_token: must be printable ASCII") as raised:
        NodeAgentConfig(auth_token="two words").validate()
    assert "two words" not in str(raised.value)


def _parse(*args: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    NodeAgentCommand().add_arguments(parser)
    return parser.parse_args(list(args))


def test_flags_and_variables_set_token_tls_and_allowance(
    tls_files: tuple[str, str], tmp_path: Path
) -> None:
    cert, key = tls_files
    token_file = tmp_path / "token"
    token_file.write_text(f"{TOKEN}\n")  # a Secret made from a file often ends in a newline
    config = config_from_args(
        _parse("--grpc-endpoint", "10.1.2.3:4317", "--auth-token-file", str(token_file)), {}
    )
    assert config.auth_token == TOKEN
    environ = {
        "TOKENTRACE_NODE_AUTH_TOKEN_FILE": str(token_file),
        "TOKENTRACE_NODE_TLS_CERT_FILE": cert,
        "TOKENTRACE_NODE_TLS_KEY_FILE": key,
        "TOKENTRACE_NODE_GRPC_ENDPOINT": "10.1.2.3:4317",
    }
    config = config_from_args(_parse(), environ)
    assert (config.auth_token, config.tls_cert_file, config.tls_key_file) == (TOKEN, cert, key)
    assert config_from_args(_parse(), {"TOKENTRACE_NODE_AUTH_TOKEN": TOKEN}).auth_token == TOKEN
    open_config = config_from_args(
        _parse("--http-endpoint", "0.0.0.0:4318", "--allow-unauthenticated"), {}
    )
    assert open_config.auth_token is None and open_config.allow_unauthenticated
    assert config_from_args(
        _parse("--http-endpoint", "0.0.0.0:4318"),
        {"TOKENTRACE_NODE_ALLOW_UNAUTHENTICATED": "true"},
    ).allow_unauthenticated
    with pytest.raises(ValueError, match="set one, not both"):
        config_from_args(_parse(), {**environ, "TOKENTRACE_NODE_AUTH_TOKEN": TOKEN})
    with pytest.raises(ValueError, match="TOKENTRACE_NODE_ALLOW_UNAUTHENTICATED"):
        config_from_args(_parse(), {"TOKENTRACE_NODE_ALLOW_UNAUTHENTICATED": "maybe"})


# -- the command: one-line errors, exit 2 --------------------------------------------------------


def _node_agent_command(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TOKENTRACE_"))}
    return subprocess.run(
        [sys.executable, "-m", "tokentrace.agent.cli", "node-agent", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=30,
    )


def _one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("tokentrace node-agent: configuration error: ")
    return lines[0]


def test_command_errors_are_one_line_exit_2_and_never_show_the_token(
    tls_files: tuple[str, str], tmp_path: Path
) -> None:
    cert, key = tls_files
    missing = tmp_path / "missing-token"
    error = _one_line_error(_node_agent_command("--auth-token-file", str(missing), cwd=tmp_path))
    assert f"auth token file {missing}: cannot read it (No such file or directory)" in error

    unreadable = tmp_path / "a-directory"
    unreadable.mkdir()
    error = _one_line_error(_node_agent_command("--auth-token-file", str(unreadable), cwd=tmp_path))
    assert f"auth token file {unreadable}: cannot read it" in error

    bad_token = tmp_path / "bad-token"
    bad_token.write_text("very secret words\n")
    error = _one_line_error(_node_agent_command("--auth-token-file", str(bad_token), cwd=tmp_path))
    assert "printable ASCII without spaces" in error and "secret" not in error

    empty = tmp_path / "empty-token"
    empty.write_text("\n")
    assert "is empty" in _one_line_error(
        _node_agent_command("--auth-token-file", str(empty), cwd=tmp_path)
    )

    error = _one_line_error(_node_agent_command("--tls-cert-file", cert, cwd=tmp_path))
    assert "--tls-cert-file (TOKENTRACE_NODE_TLS_CERT_FILE) needs --tls-key-file" in error

    error = _one_line_error(
        _node_agent_command("--tls-cert-file", cert, "--tls-key-file", str(missing), cwd=tmp_path)
    )
    assert f"TLS key file {missing}: cannot read it" in error

    error = _one_line_error(
        _node_agent_command("--tls-cert-file", key, "--tls-key-file", cert, cwd=tmp_path)
    )
    assert "not a PEM certificate and its unencrypted private key" in error
    assert "PRIVATE KEY" not in error


def test_the_command_refuses_a_non_loopback_receiver_without_a_token(tmp_path: Path) -> None:
    error = _one_line_error(
        _node_agent_command("--grpc-endpoint", "0.0.0.0:0", "--http-endpoint", "off", cwd=tmp_path)
    )
    assert "grpc_endpoint: 0.0.0.0:0 is not a loopback address" in error
    assert "--auth-token-file" in error and "--allow-unauthenticated" in error


def test_the_command_relays_only_with_the_token_from_its_file(
    tmp_path: Path, upstream: UpstreamOtlp
) -> None:
    """The command end to end: token from a file (as a Secret mount), never printed."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TOKENTRACE_"))}
    env.pop("LD_LIBRARY_PATH", None)
    process, port, startup = start_node_agent(
        "--http-endpoint",
        "127.0.0.1:0",
        "--auth-token-file",
        str(token_file),
        "--upstream",
        upstream.grpc_endpoint,
        "--max-hold",
        "0",
        "--stats-interval",
        "0",
        env=env,
        cwd=tmp_path,
    )
    try:
        assert "(plaintext, bearer token required)" in startup
        http_port = listening_ports(startup.splitlines()[-1])["Http"]
        right = {"authorization": f"Bearer {TOKEN}"}
        for headers, expected in (
            ({}, SpanExportResult.FAILURE),
            (right, SpanExportResult.SUCCESS),
        ):
            exporter = GrpcSpanExporter(
                endpoint=f"127.0.0.1:{port}", insecure=True, headers=headers, timeout=5
            )
            try:
                assert exporter.export(_sdk_spans("via-command")) is expected
            finally:
                exporter.shutdown()
        post = urllib.request.Request(
            f"http://127.0.0.1:{http_port}/v1/traces",
            data=b"",
            headers={"Content-Type": "application/x-protobuf"},
            method="POST",
        )
        with pytest.raises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(post, timeout=5)
        assert raised.value.code == 401
        raised.value.close()
        assert upstream.wait_for(lambda: len(relayed(upstream)) == 1)
    finally:
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=10)
    assert process.returncode == 0, startup + output
    assert _relayed_names(upstream) == ["via-command"]
    assert TOKEN not in startup + output
