"""Upstream OTLP exporters of the collector (traces and metrics) and their YAML configuration.

Sending is the agent's ``OtlpSender`` (bounded queue, one worker thread, retry with backoff and
jitter, drop counters, fork safety); the configuration is the agent's ``OtlpExporterConfig``,
which this module extends with the OpenTelemetry-Collector-shaped ``from_settings``. What stays
here is how the collector forms requests.

``export_encoded()`` (traces) and ``export()`` (metrics) never block the pipeline thread and
never raise. Traces arrive already serialised (the pipeline encodes each trace once for every
exporter) and are joined into requests; metrics are serialised once on the caller thread.
``stats()`` reports the sender's counters.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric
from opentelemetry.proto.resource.v1.resource_pb2 import Resource

from tokentrace.agent import otlp_config, semconv
from tokentrace.agent.otlp_config import (
    COMPRESSION_GZIP,
    COMPRESSION_NONE,
    COMPRESSIONS,
    PROTOCOL_GRPC,
    PROTOCOL_HTTP_PROTOBUF,
    PROTOCOLS,
    SIGNAL_METRICS,
    SIGNAL_TRACES,
    TOKENTRACE_VERSION,
    RetryConfig,
    Signal,
    check_tls_files,
    options_from_env,
)
from tokentrace.agent.otlp_export import OtlpSender
from tokentrace.processors.durations import parse_duration_ns

__all__ = [
    "COMPRESSIONS",
    "COMPRESSION_GZIP",
    "COMPRESSION_NONE",
    "PROTOCOLS",
    "PROTOCOL_GRPC",
    "PROTOCOL_HTTP_PROTOBUF",
    "SIGNAL_METRICS",
    "SIGNAL_TRACES",
    "OtlpExporterConfig",
    "OtlpMetricExporter",
    "OtlpTraceExporter",
    "RetryConfig",
    "data_point_count",
]

logger = logging.getLogger(__name__)

_DEFAULT_FLUSH_TIMEOUT_S: Final = 10.0
_DEFAULT_SHUTDOWN_TIMEOUT_S: Final = 10.0
_USER_AGENT: Final = f"tokentrace-collector/{TOKENTRACE_VERSION or 'dev'}"


# --- configuration --------------------------------------------------------------------------------
class OtlpExporterConfig(otlp_config.OtlpExporterConfig):
    """The agent's ``OtlpExporterConfig`` (same fields, ``validate``, ``from_env``) plus the
    collector's YAML form, ``from_settings``."""

    __slots__ = ()

    @classmethod
    def from_settings(
        cls, settings: Mapping[str, Any], *, environ: Mapping[str, str]
    ) -> OtlpExporterConfig:
        """The configuration of one YAML ``otlp`` exporter section (OpenTelemetry Collector
        shape), over the ``OTEL_EXPORTER_OTLP_*`` variables.

        Keys: ``endpoint``, ``traces_endpoint``, ``metrics_endpoint``, ``protocol``, ``headers``
        (mapping), ``timeout`` (duration such as ``"5s"`` or seconds), ``compression``,
        ``tls: {insecure, ca_file, cert_file, key_file}`` (the CA to trust instead of the
        system's, and a client certificate and key for mTLS: PEM files, read and checked here),
        ``sending_queue: {queue_size}``, ``max_batch_spans``,
        ``retry_on_failure: {initial_interval, max_interval, max_elapsed_time}``.
        A section that names an endpoint ignores the environment entirely (its headers may be
        credentials for another backend) and defaults to gRPC, as the Collector's ``otlp``
        exporter does; one without an endpoint starts from the environment. Raises ValueError
        naming the key.
        """
        unknown = sorted(set(settings) - _SETTINGS_KEYS)
        if unknown:
            raise ValueError(
                f"{unknown[0]}: unknown key (known: {', '.join(sorted(_SETTINGS_KEYS))})"
            )
        names_endpoint = any(settings.get(key) for key in _ENDPOINT_KEYS)
        options: dict[str, Any] = {}
        if names_endpoint:
            options["protocol"] = PROTOCOL_GRPC
        else:
            env_options = options_from_env(environ)
            if env_options is None:
                raise ValueError("endpoint: not set here nor in OTEL_EXPORTER_OTLP_*ENDPOINT")
            options.update(env_options)
        for key in (*_ENDPOINT_KEYS, "protocol", "compression"):
            if key in settings:
                options[key] = _setting_str(settings, key)
        if "headers" in settings:
            headers = settings["headers"]
            if not isinstance(headers, Mapping) or not all(
                isinstance(value, str | int | float) and not isinstance(value, bool)
                for value in headers.values()
            ):
                raise ValueError("headers: must be a mapping of names to strings")
            options["headers"] = {str(key): str(value) for key, value in headers.items()}
        if "timeout" in settings:
            options["timeout_s"] = _setting_duration_s(settings["timeout"], "timeout")
        if "max_batch_spans" in settings:
            options["max_batch_spans"] = _setting_int(
                settings["max_batch_spans"], "max_batch_spans"
            )
        if "tls" in settings:
            tls = _setting_section(settings, "tls", ("insecure", *_TLS_FILE_KEYS))
            if "insecure" in tls:
                if not isinstance(tls["insecure"], bool):
                    raise ValueError("tls.insecure: must be true or false")
                options["insecure"] = tls["insecure"]
            files = {
                key: _setting_str(tls, key, prefix="tls.") for key in _TLS_FILE_KEYS if key in tls
            }
            check_tls_files(
                **{
                    argument: (f"tls.{key}", files.get(key, ""))
                    for key, (argument, _field) in _TLS_FILE_KEYS.items()
                }
            )
            for key, (_argument, field_name) in _TLS_FILE_KEYS.items():
                if key in files:
                    options[field_name] = files[key]
        if "sending_queue" in settings:
            queue = _setting_section(settings, "sending_queue", ("queue_size",))
            if "queue_size" in queue:
                options["queue_size"] = _setting_int(
                    queue["queue_size"], "sending_queue.queue_size"
                )
        if "retry_on_failure" in settings:
            retry = _setting_section(
                settings,
                "retry_on_failure",
                ("initial_interval", "max_interval", "max_elapsed_time"),
            )
            retry_options: dict[str, float] = {}
            for key, field_name in (
                ("initial_interval", "initial_interval_s"),
                ("max_interval", "max_interval_s"),
                ("max_elapsed_time", "max_elapsed_s"),
            ):
                if key in retry:
                    retry_options[field_name] = _setting_duration_s(
                        retry[key], f"retry_on_failure.{key}"
                    )
            options["retry"] = RetryConfig(**retry_options)
        config = cls(**options)
        config.validate()
        return config


_ENDPOINT_KEYS: Final = ("endpoint", "traces_endpoint", "metrics_endpoint")
_TLS_FILE_KEYS: Final = {
    # the OpenTelemetry Collector's key: (check_tls_files's argument, OtlpExporterConfig field)
    "ca_file": ("certificate", "certificate_file"),
    "key_file": ("client_key", "client_key_file"),
    "cert_file": ("client_certificate", "client_certificate_file"),
}
_SETTINGS_KEYS: Final = frozenset(
    {
        *_ENDPOINT_KEYS,
        "protocol",
        "headers",
        "timeout",
        "compression",
        "tls",
        "sending_queue",
        "max_batch_spans",
        "retry_on_failure",
    }
)


def _setting_str(settings: Mapping[str, Any], key: str, *, prefix: str = "") -> str:
    value = settings[key]
    if not isinstance(value, str):
        raise ValueError(f"{prefix}{key}: must be a string, got {value!r}")
    return value


def _setting_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key}: must be an integer, got {value!r}")
    return value


def _setting_duration_s(value: Any, key: str) -> float:
    try:
        return parse_duration_ns(value) / 1e9
    except ValueError as error:
        raise ValueError(f"{key}: {error}") from None


def _setting_section(
    settings: Mapping[str, Any], key: str, allowed: tuple[str, ...]
) -> Mapping[str, Any]:
    section = settings[key]
    if not isinstance(section, Mapping):
        raise ValueError(f"{key}: must be a mapping")
    unknown = sorted(set(section) - set(allowed))
    if unknown:
        raise ValueError(f"{key}.{unknown[0]}: unknown key (known: {', '.join(allowed)})")
    return section


# --- the exporters ------------------------------------------------------------------------------
class _OtlpExporter:
    """What both exporters share: the agent's sender and its lifecycle."""

    _SIGNAL: Signal

    def __init__(
        self,
        config: otlp_config.OtlpExporterConfig,
        *,
        clock: Callable[[], float] | None = None,
        sleep: Callable[[float], None] | None = None,
        random_fraction: Callable[[], float] | None = None,
    ) -> None:
        """Raises ValueError for an invalid ``config``. ``clock``/``sleep``/``random_fraction``
        (in [0, 1), for jitter) are for tests."""
        self._max_batch = config.max_batch_spans
        self._sender = OtlpSender(
            config,
            signal=self._SIGNAL,
            user_agent=_USER_AGENT,
            clock=clock,
            sleep=sleep,
            random_fraction=random_fraction,
        )

    @property
    def enabled(self) -> bool:
        """False when the configuration has no endpoint for this signal: exporting ignores
        what it is given."""
        return self._sender.enabled

    def stats(self) -> dict[str, int]:
        """``sent_<items>``, ``dropped_<items>``, ``rejected_<items>`` (items: ``spans`` or
        ``data_points``), ``retries`` and ``queue_len`` (items waiting)."""
        return self._sender.stats()

    def force_flush(self, timeout_s: float = _DEFAULT_FLUSH_TIMEOUT_S) -> bool:
        """Wait until everything exported so far was sent or given up; False on timeout."""
        return self._sender.force_flush(timeout_s)

    def shutdown(self, timeout_s: float = _DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
        """Send what can be sent within ``timeout_s``, then drop and count the rest. Items
        exported later are counted as dropped."""
        self._sender.shutdown(timeout_s)


class OtlpTraceExporter(_OtlpExporter):
    """Sends traces upstream as OTLP; ``export_encoded`` is non-blocking and never raises."""

    _SIGNAL = SIGNAL_TRACES

    def export_encoded(self, traces: Sequence[tuple[bytes, int]]) -> None:
        """Queue traces already encoded as ``ExportTraceServiceRequest`` bytes, with their span
        counts, in requests of at most ``max_batch_spans`` spans; a trace is never split (one
        larger than that travels alone). Serialised requests concatenate into one valid request
        (repeated fields merge), so batching costs a join, not a re-encoding."""
        if not self._sender.enabled:
            return
        payload: list[bytes] = []
        spans = 0
        handled = 0  # spans submitted or counted as dropped
        try:
            for encoded, count in traces:
                if payload and spans + count > self._max_batch:
                    self._submit_encoded(payload, spans)
                    handled += spans
                    payload, spans = [], 0
                payload.append(encoded)
                spans += count
            if payload:
                self._submit_encoded(payload, spans)
                handled += spans
        except Exception:
            logger.exception("OTLP traces exporter: could not queue traces")
            unhandled = _span_total(traces) - handled
            if unhandled > 0:
                self._sender.count_dropped(unhandled, "queueing error")

    def _submit_encoded(self, payload: list[bytes], spans: int) -> None:
        if self._sender.has_room(spans):
            self._sender.submit(b"".join(payload), spans)
        else:
            self._sender.count_dropped(spans)


def _span_total(traces: Sequence[tuple[bytes, int]]) -> int:
    """The span counts of ``traces`` summed, skipping malformed entries (for drop counting)."""
    total = 0
    for entry in traces:
        with contextlib.suppress(Exception):
            total += int(entry[1])
    return total


class OtlpMetricExporter(_OtlpExporter):
    """Sends OTLP metrics upstream under the collector's scope; same queue/retry as traces.

    Whoever calls ``export`` periodically (the pipeline) owns the interval.
    """

    _SIGNAL = SIGNAL_METRICS
    _SCOPE: Final = InstrumentationScope(name=semconv.COLLECTOR_SCOPE, version=TOKENTRACE_VERSION)

    def export(self, metrics: Sequence[Metric], *, resource_attributes: Mapping[str, str]) -> None:
        """Queue ``metrics`` (metrics without data points are skipped) in requests of at most
        ``max_batch_spans`` data points (a larger single metric travels alone)."""
        if not self._sender.enabled:
            return
        total_points = 0
        queued_points = 0
        try:
            resource = Resource(
                attributes=[
                    KeyValue(key=key, value=AnyValue(string_value=value))
                    for key, value in resource_attributes.items()
                ]
            )
            chunk: list[Metric] = []
            chunk_points = 0
            for metric in metrics:
                points = data_point_count(metric)
                if points == 0:
                    continue
                total_points += points
                if chunk and chunk_points + points > self._max_batch:
                    self._submit(chunk, chunk_points, resource)
                    queued_points += chunk_points
                    chunk, chunk_points = [], 0
                chunk.append(metric)
                chunk_points += points
            if chunk:
                self._submit(chunk, chunk_points, resource)
                queued_points += chunk_points
        except Exception:
            logger.exception("OTLP metrics exporter: could not queue metrics")
            self._sender.count_dropped(total_points - queued_points, "encoding error")

    def _submit(self, chunk: list[Metric], points: int, resource: Resource) -> None:
        if not self._sender.has_room(points):  # full: count the drop without encoding
            self._sender.count_dropped(points)
            return
        request = ExportMetricsServiceRequest()
        resource_metrics = request.resource_metrics.add()
        resource_metrics.resource.CopyFrom(resource)
        scope_metrics = resource_metrics.scope_metrics.add()
        scope_metrics.scope.CopyFrom(self._SCOPE)
        scope_metrics.metrics.extend(chunk)
        self._sender.submit(request.SerializeToString(), points)


def data_point_count(metric: Metric) -> int:
    """How many data points ``metric`` carries (0 when it has no data)."""
    kind = metric.WhichOneof("data")
    if kind is None:
        return 0
    return len(getattr(metric, kind).data_points)
