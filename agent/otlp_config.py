"""Where and how OTLP is sent: ``OtlpExporterConfig``, its ``OTEL_EXPORTER_OTLP_*`` reading and
the OTLP signals' endpoints.

Separate from the sender (``otlp_export``) and its transports (``otlp_transport``) because every
side that sends OTLP upstream (the in-process agent, the node agent, the collector's exporters,
the load generator's export) configures it from here, and most of them only configure it.

TLS material (the CA that signs the server's certificate, an mTLS client certificate and key) is
given as PEM file paths, as the ``OTEL_EXPORTER_OTLP_*CERTIFICATE`` / ``*CLIENT_KEY`` variables
give it. Both reading the variables and ``validate()`` open and parse the files, so that a wrong
path or a file that is not PEM is one ``ValueError`` naming the setting at start-up, not a
failed export later; the transports read them once more when they build their connection.
"""

from __future__ import annotations

import importlib.metadata
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeVar
from urllib.parse import unquote, urlsplit

from google.protobuf.message import Message
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

PROTOCOL_GRPC: Final = "grpc"
PROTOCOL_HTTP_PROTOBUF: Final = "http/protobuf"
PROTOCOLS: Final = (PROTOCOL_GRPC, PROTOCOL_HTTP_PROTOBUF)
COMPRESSION_GZIP: Final = "gzip"
COMPRESSION_NONE: Final = "none"
COMPRESSIONS: Final = (COMPRESSION_GZIP, COMPRESSION_NONE)
SIGNAL_TRACES: Final = "traces"
SIGNAL_METRICS: Final = "metrics"
Signal = Literal["traces", "metrics"]
"""What one sender carries: ``ExportTraceServiceRequest`` or ``ExportMetricsServiceRequest``."""


def _installed_version() -> str:
    try:
        return importlib.metadata.version("tokentrace")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a bare source tree
        return ""


TOKENTRACE_VERSION: Final = _installed_version()
"""The installed tokentrace version; empty when running from a bare source tree."""

_DEFAULT_PROTOCOL: Final = PROTOCOL_HTTP_PROTOBUF
"""The OpenTelemetry exporter specification's default transport."""
_DEFAULT_TIMEOUT_S: Final = 10.0
_DEFAULT_COMPRESSION: Final = COMPRESSION_GZIP
"""Upstream links may leave the node: compress by default, as the OpenTelemetry Collector does."""
_DEFAULT_QUEUE_SIZE: Final = 10_000
_DEFAULT_MAX_BATCH_SPANS: Final = 512
_DEFAULT_RETRY_INITIAL_INTERVAL_S: Final = 0.5
_DEFAULT_RETRY_MAX_INTERVAL_S: Final = 5.0
_DEFAULT_RETRY_MAX_ELAPSED_S: Final = 60.0

_ENV_PREFIX: Final = "OTEL_EXPORTER_OTLP_"
_TLS_FILE_VARIABLES: Final = (
    ("certificate_file", "CERTIFICATE"),
    ("client_key_file", "CLIENT_KEY"),
    ("client_certificate_file", "CLIENT_CERTIFICATE"),
)
"""``OtlpExporterConfig`` field and the ``OTEL_EXPORTER_OTLP_[SIGNAL_]*`` variable naming it."""
_PEM_LABEL: Final = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----")
_CERTIFICATE_LABEL: Final = b"CERTIFICATE"
_PRIVATE_KEY_LABELS: Final = frozenset({b"PRIVATE KEY", b"RSA PRIVATE KEY", b"EC PRIVATE KEY"})
_ENCRYPTED_KEY_LABEL: Final = b"ENCRYPTED PRIVATE KEY"

_ConfigT = TypeVar("_ConfigT", bound="OtlpExporterConfig")


# --- configuration --------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class RetryConfig:
    """Exponential backoff for retryable failures (the Collector's ``retry_on_failure``)."""

    initial_interval_s: float = _DEFAULT_RETRY_INITIAL_INTERVAL_S
    max_interval_s: float = _DEFAULT_RETRY_MAX_INTERVAL_S
    max_elapsed_s: float = _DEFAULT_RETRY_MAX_ELAPSED_S
    """Give a batch up (drop and count it) once retrying would pass this; 0 never retries."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OtlpExporterConfig:
    """Where and how traces and metrics are sent as OTLP. ``validate()`` before use (an
    ``OtlpSender`` validates the one it is given).

    One configuration serves both signals, like the ``OTEL_EXPORTER_OTLP_*`` variables: a base
    ``endpoint`` plus optional per-signal endpoints that override it.
    """

    endpoint: str = ""
    """Base endpoint. gRPC: ``http://host:4317`` (plaintext), ``https://host:4317`` or
    ``host:4317`` (TLS). OTLP/HTTP: a base URL such as ``http://host:4318``; the signal path
    (``/v1/traces``, ``/v1/metrics``) is appended to it."""
    traces_endpoint: str = ""
    """Overrides ``endpoint`` for traces; for OTLP/HTTP the full URL, used as it is."""
    metrics_endpoint: str = ""
    """Overrides ``endpoint`` for metrics; for OTLP/HTTP the full URL, used as it is."""
    protocol: str = _DEFAULT_PROTOCOL
    """``grpc`` | ``http/protobuf``."""
    headers: Mapping[str, str] = field(default_factory=dict)
    """Sent with every request (gRPC metadata keys are lower-cased)."""
    timeout_s: float = _DEFAULT_TIMEOUT_S
    """Per attempt."""
    compression: str = _DEFAULT_COMPRESSION
    """``gzip`` | ``none``."""
    queue_size: int = _DEFAULT_QUEUE_SIZE
    """Items (spans, metric data points) waiting to be sent, at most; new batches beyond it are
    dropped and counted."""
    max_batch_spans: int = _DEFAULT_MAX_BATCH_SPANS
    """Items per request at most (spans for traces, data points for metrics); whoever forms the
    requests honours it (the sender sends each submitted payload as one request)."""
    retry: RetryConfig = field(default_factory=RetryConfig)
    insecure: bool | None = None
    """gRPC only: plaintext instead of TLS. None: from the endpoint scheme (``http://`` is
    plaintext; ``https://`` and scheme-less are TLS). OTLP/HTTP follows the URL scheme."""
    certificate_file: str = ""
    """PEM file of the CA certificates trusted to sign the server's certificate, instead of the
    system's trust store; empty: the system's. Used only over TLS."""
    client_key_file: str = ""
    """PEM file of the unencrypted private key of ``client_certificate_file`` (mTLS); the two go
    together. Empty: no client certificate."""
    client_certificate_file: str = ""
    """PEM file of the certificate (chain) presented to a server that asks for one (mTLS)."""

    def endpoint_for(self, signal: str) -> str | None:
        """The endpoint ``signal`` (``traces`` | ``metrics``) is sent to; None when unset."""
        spec = SIGNAL_SPECS[signal]
        specific = self.traces_endpoint if signal == SIGNAL_TRACES else self.metrics_endpoint
        if specific:
            return specific
        if not self.endpoint:
            return None
        if self.protocol == PROTOCOL_HTTP_PROTOBUF:
            return self.endpoint.rstrip("/") + spec.http_path
        return self.endpoint

    def uses_tls(self, endpoint: str) -> bool:
        """Whether sending to ``endpoint`` (one of this config's) uses TLS."""
        if self.protocol == PROTOCOL_GRPC and self.insecure is not None:
            return not self.insecure
        return _scheme(endpoint) != "http"

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol: {self.protocol!r} is not one of {PROTOCOLS}")
        endpoints = {
            "endpoint": self.endpoint,
            "traces_endpoint": self.traces_endpoint,
            "metrics_endpoint": self.metrics_endpoint,
        }
        if not any(endpoints.values()):
            raise ValueError("endpoint: no endpoint configured")
        for name, endpoint in endpoints.items():
            if endpoint:
                _validate_endpoint(name, endpoint, self.protocol)
                if (
                    self.protocol == PROTOCOL_HTTP_PROTOBUF
                    and self.insecure is not None
                    and self.insecure != (_scheme(endpoint) == "http")
                ):
                    raise ValueError(
                        f"insecure: OTLP/HTTP takes TLS from the URL scheme; "
                        f"insecure={self.insecure} contradicts {name} {endpoint!r}"
                    )
        for key, value in self.headers.items():
            if not isinstance(key, str) or not key or not isinstance(value, str):
                raise ValueError(f"headers: {key!r}={value!r} must be non-empty str = str")
            if any(char in key + value for char in "\r\n\0"):
                raise ValueError(f"headers: {key!r} contains a control character")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"timeout_s: must be > 0, got {self.timeout_s}")
        check_tls_files(
            certificate=("certificate_file", self.certificate_file),
            client_key=("client_key_file", self.client_key_file),
            client_certificate=("client_certificate_file", self.client_certificate_file),
        )
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression: {self.compression!r} is not one of {COMPRESSIONS}")
        if self.max_batch_spans < 1:
            raise ValueError(f"max_batch_spans: must be >= 1, got {self.max_batch_spans}")
        if self.queue_size < self.max_batch_spans:
            raise ValueError(
                f"queue_size: must be >= max_batch_spans ({self.max_batch_spans}), "
                f"got {self.queue_size}"
            )
        retry = self.retry
        if not (math.isfinite(retry.initial_interval_s) and retry.initial_interval_s > 0):
            raise ValueError(
                f"retry.initial_interval_s: must be > 0, got {retry.initial_interval_s}"
            )
        if not (retry.max_interval_s >= retry.initial_interval_s):
            raise ValueError(
                f"retry.max_interval_s: must be >= initial_interval_s, got {retry.max_interval_s}"
            )
        if not (math.isfinite(retry.max_elapsed_s) and retry.max_elapsed_s >= 0):
            raise ValueError(f"retry.max_elapsed_s: must be >= 0, got {retry.max_elapsed_s}")

    @classmethod
    def from_env(
        cls: type[_ConfigT], environ: Mapping[str, str], *, signal: Signal | None = None
    ) -> _ConfigT | None:
        """The configuration the standard ``OTEL_EXPORTER_OTLP_*`` variables describe, or None
        when none of ``..._ENDPOINT``, ``..._TRACES_ENDPOINT``, ``..._METRICS_ENDPOINT`` is set.

        Read: ``ENDPOINT`` (for OTLP/HTTP the signal paths are appended), ``TRACES_ENDPOINT`` /
        ``METRICS_ENDPOINT`` (used as they are), ``PROTOCOL``, ``HEADERS`` (``k=v,k2=v2``,
        URL-encoded), ``TIMEOUT`` (milliseconds), ``COMPRESSION``, ``INSECURE`` (gRPC),
        ``CERTIFICATE``, ``CLIENT_KEY`` and ``CLIENT_CERTIFICATE`` (PEM file paths). With
        ``signal``, that signal's own variables (``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` ...)
        override the general ones, and the result is meant for that signal's sender only. Empty
        values count as unset. Invalid values raise ValueError naming the variable: better no
        export than export somewhere unintended.
        """
        options = options_from_env(environ, signal=signal)
        if options is None:
            return None
        config = cls(**options)
        config.validate()
        return config


def options_from_env(
    environ: Mapping[str, str], *, signal: Signal | None = None
) -> dict[str, Any] | None:
    """``OtlpExporterConfig`` keyword arguments from ``OTEL_EXPORTER_OTLP_*`` (see
    ``OtlpExporterConfig.from_env``), not yet validated: for callers that lay settings of their
    own over the environment. None when no endpoint variable is set."""
    if signal is not None and signal not in SIGNAL_SPECS:
        raise ValueError(f"signal: {signal!r} is not one of {tuple(SIGNAL_SPECS)}")
    specific_prefix = f"{_ENV_PREFIX}{signal.upper()}_" if signal is not None else None

    def read(name: str) -> tuple[str, str]:
        """The value of ``name`` and the variable it came from (the signal's own first)."""
        if specific_prefix is not None:
            variable = f"{specific_prefix}{name}"
            if value := environ.get(variable, "").strip():
                return value, variable
        variable = f"{_ENV_PREFIX}{name}"
        return environ.get(variable, "").strip(), variable

    options: dict[str, Any] = {
        "endpoint": environ.get(f"{_ENV_PREFIX}ENDPOINT", "").strip(),
        "traces_endpoint": environ.get(f"{_ENV_PREFIX}TRACES_ENDPOINT", "").strip(),
        "metrics_endpoint": environ.get(f"{_ENV_PREFIX}METRICS_ENDPOINT", "").strip(),
    }
    if not any(options.values()):
        return None
    # ``grpc://host:port`` (vLLM's --otlp-traces-endpoint convention, which vLLM also writes to
    # OTEL_EXPORTER_OTLP_TRACES_ENDPOINT in its processes): plaintext OTLP/gRPC.
    grpc_scheme = [key for key, value in options.items() if _scheme(value) == _GRPC_SCHEME]
    for key in grpc_scheme:
        options[key] = "http://" + options[key].split("://", 1)[1]
    protocol, variable = read("PROTOCOL")
    if protocol:
        if protocol not in PROTOCOLS:
            raise ValueError(f"{variable}: {protocol!r} is not one of {PROTOCOLS}")
        if grpc_scheme and protocol != PROTOCOL_GRPC:
            raise ValueError(
                f"{variable}: {protocol!r} contradicts the grpc:// endpoint in "
                f"{_ENV_PREFIX}{grpc_scheme[0].upper()}"
            )
        options["protocol"] = protocol
    elif grpc_scheme:
        options["protocol"] = PROTOCOL_GRPC
    headers, variable = read("HEADERS")
    if headers:
        options["headers"] = _parse_headers(variable, headers)
    timeout, variable = read("TIMEOUT")
    if timeout:
        try:
            timeout_ms = float(timeout)
        except ValueError:
            raise ValueError(f"{variable}: {timeout!r} is not a number of ms") from None
        if not (math.isfinite(timeout_ms) and timeout_ms > 0):
            raise ValueError(f"{variable}: must be > 0 ms, got {timeout!r}")
        options["timeout_s"] = timeout_ms / 1000.0
    compression, variable = read("COMPRESSION")
    compression = compression.lower()
    if compression:
        if compression not in COMPRESSIONS:
            raise ValueError(f"{variable}: {compression!r} is not one of {COMPRESSIONS}")
        options["compression"] = compression
    insecure, variable = read("INSECURE")
    insecure = insecure.lower()
    if insecure and options.get("protocol", _DEFAULT_PROTOCOL) == PROTOCOL_GRPC:
        if insecure not in ("true", "false"):
            raise ValueError(f"{variable}: {insecure!r} is not true or false")
        options["insecure"] = insecure == "true"
    tls_variables: dict[str, tuple[str, str]] = {}
    for option, name in _TLS_FILE_VARIABLES:
        path, variable = read(name)
        tls_variables[option] = (variable, path)
        if path:
            options[option] = path
    check_tls_files(
        certificate=tls_variables["certificate_file"],
        client_key=tls_variables["client_key_file"],
        client_certificate=tls_variables["client_certificate_file"],
    )
    return options


def check_tls_files(
    *,
    certificate: tuple[str, str],
    client_key: tuple[str, str],
    client_certificate: tuple[str, str],
) -> None:
    """Raise ValueError, naming the setting, unless each given file (``(setting, path)``, an
    empty path is unset) is readable PEM of its kind: certificates in ``certificate`` and
    ``client_certificate``, the latter's unencrypted private key in ``client_key``, the two
    given together. Reads the files; imports ``ssl`` only when a file is given."""
    (key_setting, key_path), (chain_setting, chain_path) = client_key, client_certificate
    if bool(key_path) != bool(chain_path):
        given, missing = (key_setting, chain_setting) if key_path else (chain_setting, key_setting)
        raise ValueError(f"{given}: given without {missing} (mTLS takes a certificate and its key)")
    ca_setting, ca_path = certificate
    if ca_path:
        _check_certificates(ca_setting, ca_path)
    if not chain_path:
        return
    _check_certificates(chain_setting, chain_path)
    labels = _pem_labels(key_setting, key_path)
    if _ENCRYPTED_KEY_LABEL in labels:
        raise ValueError(
            f"{key_setting}: {key_path!r} holds an encrypted private key; give an unencrypted one"
        )
    if not _PRIVATE_KEY_LABELS & set(labels):
        raise ValueError(f"{key_setting}: {key_path!r} holds no PEM private key")
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        # A password callback, so that an encrypted key fails here instead of prompting.
        context.load_cert_chain(chain_path, key_path, password=lambda: b"")
    except (OSError, ValueError) as error:  # ssl.SSLError is an OSError
        reason = getattr(error, "reason", None) or type(error).__name__
        raise ValueError(
            f"{key_setting}: {key_path!r} is not a readable unencrypted private key of the "
            f"certificate in {chain_setting} ({reason})"
        ) from None


def _check_certificates(setting: str, path: str) -> None:
    """``path`` holds PEM certificates, every one of which parses."""
    labels = _pem_labels(setting, path)
    if _CERTIFICATE_LABEL not in labels:
        raise ValueError(f"{setting}: {path!r} holds no PEM certificate")
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(cafile=path)
    except (OSError, ValueError) as error:
        reason = getattr(error, "reason", None) or type(error).__name__
        raise ValueError(f"{setting}: {path!r} is not valid PEM certificates ({reason})") from None


def _pem_labels(setting: str, path: str) -> list[bytes]:
    """The labels of the PEM blocks in ``path`` (``CERTIFICATE``, ``PRIVATE KEY`` ...)."""
    try:
        with open(path, "rb") as file:
            data = file.read()
    except OSError as error:
        raise ValueError(f"{setting}: cannot read {path!r} ({error.strerror or error})") from None
    return _PEM_LABEL.findall(data)


def _parse_headers(variable: str, value: str) -> dict[str, str]:
    """``k=v,k2=v2`` with URL-encoded keys and values (the W3C baggage format the spec uses)."""
    headers: dict[str, str] = {}
    for item in value.split(","):
        if not item.strip():
            continue
        key, separator, header_value = item.partition("=")
        key = unquote(key.strip())
        if not separator or not key:
            raise ValueError(f"{variable}: {item.strip()!r} is not key=value")
        headers[key] = unquote(header_value.strip())
    return headers


_GRPC_SCHEME: Final = "grpc"


def _scheme(endpoint: str) -> str:
    return endpoint.split("://", 1)[0].lower() if "://" in endpoint else ""


def _validate_endpoint(name: str, endpoint: str, protocol: str) -> None:
    if any(char.isspace() for char in endpoint):
        raise ValueError(f"{name}: {endpoint!r} contains whitespace")
    checked = endpoint
    if "://" not in endpoint and protocol == PROTOCOL_GRPC:
        checked = f"https://{endpoint}"  # a bare gRPC target: check it as host:port
    parts = urlsplit(checked)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{name}: {endpoint!r} needs an http:// or https:// scheme")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{name}: {endpoint!r} has an invalid port") from None
    if not parts.hostname:
        raise ValueError(f"{name}: {endpoint!r} has no host")
    if protocol == PROTOCOL_GRPC and port is None:
        raise ValueError(f"{name}: gRPC endpoint {endpoint!r} needs a port")


# --- one signal's wire details ---------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SignalSpec:
    """One OTLP signal's wire details: where its requests go and what the server answers."""

    name: str
    item: str
    """What the counters count: ``spans`` | ``data_points``."""
    grpc_method: str
    http_path: str
    response_type: type[Message]
    rejected_field: str
    """The partial-success field counting rejected items."""


SIGNAL_SPECS: Final = {
    SIGNAL_TRACES: SignalSpec(
        name=SIGNAL_TRACES,
        item="spans",
        grpc_method="/opentelemetry.proto.collector.trace.v1.TraceService/Export",
        http_path="/v1/traces",
        response_type=ExportTraceServiceResponse,
        rejected_field="rejected_spans",
    ),
    SIGNAL_METRICS: SignalSpec(
        name=SIGNAL_METRICS,
        item="data_points",
        grpc_method="/opentelemetry.proto.collector.metrics.v1.MetricsService/Export",
        http_path="/v1/metrics",
        response_type=ExportMetricsServiceResponse,
        rejected_field="rejected_data_points",
    ),
}
