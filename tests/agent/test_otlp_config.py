"""The OTLP export configuration (``otlp_config``): ``OTEL_EXPORTER_OTLP_*`` and validation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.agent.tls_material import make_certificate, make_encrypted_key
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


# --- TLS material: OTEL_EXPORTER_OTLP_[SIGNAL_]CERTIFICATE, CLIENT_KEY, CLIENT_CERTIFICATE --------
@pytest.fixture(scope="module")
def pem_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Named PEM (and not-PEM) files: a CA, a client certificate and key, a key of another
    certificate, an encrypted key, a corrupt certificate, plain text."""
    directory = tmp_path_factory.mktemp("pem")
    ca, _ = make_certificate(directory, "ca")
    client_cert, client_key = make_certificate(directory, "client")
    _, other_key = make_certificate(directory, "other")
    corrupt = directory / "corrupt.pem"
    corrupt.write_text("-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydA==\n-----END CERTIFICATE-----\n")
    text = directory / "notes.txt"
    text.write_text("not PEM at all\n")
    return {
        "ca": ca,
        "client_cert": client_cert,
        "client_key": client_key,
        "other_key": other_key,
        "encrypted_key": make_encrypted_key(directory),
        "corrupt": str(corrupt),
        "text": str(text),
        "missing": str(directory / "missing.pem"),
        "directory": str(directory),
    }


def test_from_env_reads_the_tls_files_signal_variables_first(pem_files: dict[str, str]) -> None:
    environ = {
        f"{ENV}ENDPOINT": "https://h:4318",
        f"{ENV}CERTIFICATE": pem_files["client_cert"],
        f"{ENV}TRACES_CERTIFICATE": pem_files["ca"],
        f"{ENV}CLIENT_KEY": pem_files["client_key"],
        f"{ENV}METRICS_CLIENT_CERTIFICATE": pem_files["client_cert"],
    }
    traces = OtlpExporterConfig.from_env(
        {**environ, f"{ENV}TRACES_CLIENT_CERTIFICATE": pem_files["client_cert"]}, signal="traces"
    )
    metrics = OtlpExporterConfig.from_env(environ, signal="metrics")
    assert traces is not None and metrics is not None
    assert (traces.certificate_file, traces.client_key_file, traces.client_certificate_file) == (
        pem_files["ca"],
        pem_files["client_key"],
        pem_files["client_cert"],
    )
    assert (metrics.certificate_file, metrics.client_certificate_file) == (
        pem_files["client_cert"],
        pem_files["client_cert"],
    )
    # Without a signal the per-signal variables do not count (and unset stays empty).
    general = OtlpExporterConfig.from_env(
        {f"{ENV}ENDPOINT": "https://h:4318", f"{ENV}TRACES_CERTIFICATE": pem_files["ca"]}
    )
    assert general is not None
    assert (general.certificate_file, general.client_key_file) == ("", "")


@pytest.mark.parametrize(
    ("variables", "variable", "phrase"),
    [
        ({"CERTIFICATE": "missing"}, "CERTIFICATE", "No such file"),
        ({"CERTIFICATE": "directory"}, "CERTIFICATE", "cannot read"),
        ({"CERTIFICATE": "text"}, "CERTIFICATE", "holds no PEM certificate"),
        ({"TRACES_CERTIFICATE": "client_key"}, "TRACES_CERTIFICATE", "holds no PEM certificate"),
        ({"CERTIFICATE": "corrupt"}, "CERTIFICATE", "not valid PEM certificates"),
        ({"CLIENT_KEY": "client_key"}, "CLIENT_KEY", "without OTEL_EXPORTER_OTLP_CLIENT_CERT"),
        (
            {"TRACES_CLIENT_CERTIFICATE": "client_cert"},
            "TRACES_CLIENT_CERTIFICATE",
            "without OTEL_EXPORTER_OTLP_CLIENT_KEY",
        ),
        (
            {"CLIENT_CERTIFICATE": "client_cert", "CLIENT_KEY": "other_key"},
            "CLIENT_KEY",
            "not a readable unencrypted private key of the certificate",
        ),
        (
            {"CLIENT_CERTIFICATE": "client_cert", "CLIENT_KEY": "encrypted_key"},
            "CLIENT_KEY",
            "encrypted private key",
        ),
        (
            {"CLIENT_CERTIFICATE": "client_cert", "CLIENT_KEY": "ca"},
            "CLIENT_KEY",
            "holds no PEM private key",
        ),
        (
            {"CLIENT_CERTIFICATE": "client_key", "CLIENT_KEY": "client_key"},
            "CLIENT_CERTIFICATE",
            "holds no PEM certificate",
        ),
    ],
)
def test_from_env_rejects_bad_tls_files_naming_the_variable(
    pem_files: dict[str, str], variables: dict[str, str], variable: str, phrase: str
) -> None:
    environ = {f"{ENV}ENDPOINT": "https://h:4318"}
    environ.update({f"{ENV}{name}": pem_files[file] for name, file in variables.items()})
    with pytest.raises(ValueError, match=f"^{ENV}{variable}: ") as raised:
        OtlpExporterConfig.from_env(environ, signal="traces")
    assert phrase in str(raised.value)
    assert "\n" not in str(raised.value)


def test_validate_checks_the_tls_files_naming_the_field(pem_files: dict[str, str]) -> None:
    base = OtlpExporterConfig(endpoint="https://h:4318")
    good = OtlpExporterConfig(
        endpoint="https://h:4318",
        certificate_file=pem_files["ca"],
        client_key_file=pem_files["client_key"],
        client_certificate_file=pem_files["client_cert"],
    )
    good.validate()
    base.validate()
    for options, field in [
        ({"certificate_file": pem_files["missing"]}, "certificate_file"),
        ({"client_key_file": pem_files["client_key"]}, "client_key_file"),
        ({"client_certificate_file": pem_files["client_cert"]}, "client_certificate_file"),
        (
            {
                "client_certificate_file": pem_files["client_cert"],
                "client_key_file": "/nonexistent",
            },
            "client_key_file",
        ),
    ]:
        config = OtlpExporterConfig(endpoint="https://h:4318", **options)
        with pytest.raises(ValueError, match=f"^{field}: "):
            config.validate()
        with pytest.raises(ValueError, match=f"^{field}: "):
            OtlpSender(config, signal="traces")


def test_a_bad_tls_file_is_named_even_for_a_plain_text_endpoint(tmp_path: Path) -> None:
    # The variable is set, so it was meant: a typo surfaces now, not once TLS is switched on.
    with pytest.raises(ValueError, match=f"^{ENV}CERTIFICATE: "):
        OtlpExporterConfig.from_env(
            {f"{ENV}ENDPOINT": "http://h:4318", f"{ENV}CERTIFICATE": str(tmp_path / "ca.pem")}
        )
