"""The OTLP export configuration (``otlp_config``): ``OTEL_EXPORTER_OTLP_*`` and validation."""

from __future__ import annotations

from typing import Any

import pytest

from tokentrace.agent.otlp_config import OtlpExporterConfig, RetryConfig, options_from_env
from tokentrace.agent.otlp_export import OtlpSender

ENV = "OTEL_EXPORTER_OTLP_"


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),
        ({f"{ENV}ENDPOINT": "  "}, None),
        (
            {f"{ENV}ENDPOINT": "http://h:4318"},
            {"traces": "http://h:4318/v1/traces", "metrics": "http://h:4318/v1/metrics"},
        ),
        (
            {f"{ENV}ENDPOINT": "https://h:4318/otlp/"},
            {
                "traces": "https://h:4318/otlp/v1/traces",
                "metrics": "https://h:4318/otlp/v1/metrics",
            },
        ),
        (
            {f"{ENV}TRACES_ENDPOINT": "http://t:4318/custom"},
            {"traces": "http://t:4318/custom", "metrics": None},
        ),
        (
            {f"{ENV}ENDPOINT": "http://h:4318", f"{ENV}METRICS_ENDPOINT": "http://m:9/x"},
            {"traces": "http://h:4318/v1/traces", "metrics": "http://m:9/x"},
        ),
        (
            {f"{ENV}ENDPOINT": "http://h:4317", f"{ENV}PROTOCOL": "grpc"},
            {"traces": "http://h:4317", "metrics": "http://h:4317", "tls": False},
        ),
        (
            {f"{ENV}ENDPOINT": "h:4317", f"{ENV}PROTOCOL": "grpc"},
            {"traces": "h:4317", "tls": True},
        ),
        (
            {f"{ENV}ENDPOINT": "h:4317", f"{ENV}PROTOCOL": "grpc", f"{ENV}INSECURE": "TRUE"},
            {"traces": "h:4317", "tls": False},
        ),
        (  # vLLM's --otlp-traces-endpoint convention: plaintext gRPC, protocol implied
            {f"{ENV}TRACES_ENDPOINT": "grpc://h:4317"},
            {"traces": "http://h:4317", "protocol": "grpc", "tls": False},
        ),
        (
            {f"{ENV}ENDPOINT": "https://h", f"{ENV}HEADERS": "api-key=a%20b%2Cc , tenant=t1,"},
            {"headers": {"api-key": "a b,c", "tenant": "t1"}, "tls": True},
        ),
        (
            {f"{ENV}ENDPOINT": "http://h", f"{ENV}TIMEOUT": "2500", f"{ENV}COMPRESSION": "none"},
            {"timeout_s": 2.5, "compression": "none"},
        ),
        (
            {f"{ENV}ENDPOINT": "http://h", f"{ENV}COMPRESSION": "GZIP"},
            {"compression": "gzip"},
        ),
    ],
)
def test_from_env(environ: dict[str, str], expected: dict[str, Any] | None) -> None:
    config = OtlpExporterConfig.from_env(environ)
    if expected is None:
        assert config is None
        return
    assert config is not None
    for key, value in expected.items():
        if key in ("traces", "metrics"):
            assert config.endpoint_for(key) == value
        elif key == "tls":
            endpoint = config.endpoint_for("traces")
            assert endpoint is not None
            assert config.uses_tls(endpoint) is value
        else:
            assert getattr(config, key) == value


def test_from_env_for_a_signal_prefers_its_own_variables() -> None:
    environ = {
        f"{ENV}ENDPOINT": "http://h:4317",
        f"{ENV}PROTOCOL": "http/protobuf",
        f"{ENV}TRACES_PROTOCOL": "grpc",
        f"{ENV}HEADERS": "k=general",
        f"{ENV}TRACES_HEADERS": "k=traces",
        f"{ENV}TIMEOUT": "1000",
        f"{ENV}METRICS_TIMEOUT": "3000",
        f"{ENV}TRACES_INSECURE": "true",
    }
    traces = OtlpExporterConfig.from_env(environ, signal="traces")
    metrics = OtlpExporterConfig.from_env(environ, signal="metrics")
    general = OtlpExporterConfig.from_env(environ)
    assert traces is not None and metrics is not None and general is not None
    assert (traces.protocol, dict(traces.headers), traces.timeout_s) == ("grpc", {"k": "traces"}, 1)
    assert traces.endpoint_for("traces") == "http://h:4317"
    assert traces.insecure is True
    assert (metrics.protocol, dict(metrics.headers), metrics.timeout_s) == (
        "http/protobuf",
        {"k": "general"},
        3,
    )
    assert metrics.endpoint_for("metrics") == "http://h:4317/v1/metrics"
    assert (general.protocol, general.timeout_s) == ("http/protobuf", 1)
    # A bad signal-specific value is named as the variable it came from.
    with pytest.raises(ValueError, match=f"^{ENV}TRACES_TIMEOUT:"):
        options_from_env({**environ, f"{ENV}TRACES_TIMEOUT": "soon"}, signal="traces")


@pytest.mark.parametrize(
    ("environ", "variable"),
    [
        ({f"{ENV}ENDPOINT": "http://h", f"{ENV}PROTOCOL": "http/json"}, f"{ENV}PROTOCOL"),
        ({f"{ENV}ENDPOINT": "http://h", f"{ENV}TIMEOUT": "ten"}, f"{ENV}TIMEOUT"),
        ({f"{ENV}ENDPOINT": "http://h", f"{ENV}TIMEOUT": "-5"}, f"{ENV}TIMEOUT"),
        ({f"{ENV}ENDPOINT": "http://h", f"{ENV}HEADERS": "novalue"}, f"{ENV}HEADERS"),
        ({f"{ENV}ENDPOINT": "http://h", f"{ENV}COMPRESSION": "br"}, f"{ENV}COMPRESSION"),
        (
            {f"{ENV}ENDPOINT": "h:1", f"{ENV}PROTOCOL": "grpc", f"{ENV}INSECURE": "yes"},
            f"{ENV}INSECURE",
        ),
        ({f"{ENV}ENDPOINT": "ftp://h"}, "endpoint"),
        (
            {f"{ENV}ENDPOINT": "grpc://h:4317", f"{ENV}PROTOCOL": "http/protobuf"},
            f"{ENV}PROTOCOL",
        ),
        ({f"{ENV}TRACES_ENDPOINT": "http://h:port"}, "traces_endpoint"),
    ],
)
def test_from_env_rejects_invalid_values_naming_them(
    environ: dict[str, str], variable: str
) -> None:
    with pytest.raises(ValueError, match=f"^{variable}:"):
        OtlpExporterConfig.from_env(environ)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"endpoint": ""}, "endpoint"),
        ({"endpoint": "localhost:4317", "protocol": "http/protobuf"}, "endpoint"),
        (
            {"endpoint": "http://h:4317", "protocol": "grpc", "traces_endpoint": "http://h"},
            "traces_endpoint",
        ),
        ({"protocol": "thrift"}, "protocol"),
        ({"compression": "zstd"}, "compression"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"queue_size": 10, "max_batch_spans": 20}, "queue_size"),
        ({"max_batch_spans": 0}, "max_batch_spans"),
        ({"headers": {"k": "a\r\nb"}}, "headers"),
        ({"insecure": True, "endpoint": "https://h:4318"}, "insecure"),
        ({"retry": RetryConfig(initial_interval_s=0)}, "retry.initial_interval_s"),
        ({"retry": RetryConfig(initial_interval_s=2, max_interval_s=1)}, "retry.max_interval_s"),
        ({"retry": RetryConfig(max_elapsed_s=-1)}, "retry.max_elapsed_s"),
    ],
)
def test_validate_names_the_invalid_field(overrides: dict[str, Any], field: str) -> None:
    options: dict[str, Any] = {"endpoint": "http://h:4318", "protocol": "http/protobuf"}
    options.update(overrides)
    with pytest.raises(ValueError, match=f"^{field}:"):
        OtlpExporterConfig(**options).validate()
    with pytest.raises(ValueError, match=f"^{field}:"):
        OtlpSender(OtlpExporterConfig(**options), signal="traces")


def test_unknown_signal_is_refused() -> None:
    config = OtlpExporterConfig(endpoint="http://h:4318")
    logs: Any = "logs"
    with pytest.raises(ValueError, match=r"^signal:"):
        OtlpSender(config, signal=logs)
