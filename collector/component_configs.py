"""Each component's typed config: its defaults, ``validate()``, and how it is read from its YAML
section (``from_section``; the factories in ``factories.py`` point at both).

Readers check the YAML's shape (known keys, types, duration and size formats); ``validate()``
checks values, naming the key relative to the component's section.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Final

from tokentrace.collector.component import (
    ConfigError,
    ConfigSection,
    check,
    check_endpoint,
    check_range,
    check_tls_pair,
)
from tokentrace.collector.exporters.otlp import OtlpExporterConfig
from tokentrace.collector.receivers.validate import DEFAULT_SPAN_LIMITS, SpanLimits
from tokentrace.collector.store.contract import DEFAULT_MAX_REQUESTS, DEFAULT_RETENTION_S
from tokentrace.collector.tail_sampling import TailSamplingSettings
from tokentrace.processors.diagnosis import DiagnosisConfig
from tokentrace.processors.percentiles import PercentileConfig
from tokentrace.processors.slo import SloTarget, parse_targets, read_slo_file

_log = logging.getLogger(__name__)

_DEFAULT_GRPC_ENDPOINT: Final = "127.0.0.1:4317"
_DEFAULT_HTTP_ENDPOINT: Final = "127.0.0.1:4318"
_DEFAULT_MAX_MSG_MIB: Final = 4
_DEFAULT_MAX_BODY_MIB: Final = 20
_MIB: Final = 1024 * 1024
# Above the OpenTelemetry SDK's default export delay (5 s): a client and a server export their
# spans of one trace independently, and the later half must still find the trace open.
_DEFAULT_QUIET_PERIOD_S: Final = 6.0
_DEFAULT_ROOT_GRACE_S: Final = 1.0
"""Spans of one request come from several processes (vLLM's EngineCore exports its step and
chunk spans on its own ~0.2 s emitter cycle): wait this long after the root before finishing."""
_DEFAULT_MAX_TRACES: Final = 20_000
_DEFAULT_MAX_SPANS_PER_TRACE: Final = 5_000
_DEFAULT_MAX_PENDING_SPANS: Final = 500_000
_DEFAULT_STORE_PATH: Final = "./tokentrace.db"
_DEFAULT_METRICS_INTERVAL_S: Final = 15.0
_DEFAULT_UI_ENDPOINT: Final = "127.0.0.1:8700"
_DEFAULT_ADMIN_ENDPOINT: Final = "127.0.0.1:13133"
_DEFAULT_MAX_LABEL_SETS: Final = 100
_MAX_LABEL_SETS: Final = 10_000
_MAX_PERCENTILE_SLICES: Final = 3600


# --- receivers ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class ReceiverConfig:
    """One OTLP protocol's receiver (gRPC or HTTP)."""

    endpoint: str
    max_message_size: int
    """gRPC: the largest message received; HTTP: the largest request body (bytes)."""
    auth_token: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None


# (protocol, default endpoint, YAML key of the size limit, its default in MiB)
_SPAN_LIMIT_KEYS: Final = (
    "max_attributes",
    "max_events",
    "max_links",
    "max_string_length",
    "max_array_length",
)
"""The ``SpanLimits`` a configuration may set (the time bounds are sanity bounds, not policy)."""
_PROTOCOLS: Final = (
    ("grpc", _DEFAULT_GRPC_ENDPOINT, "max_recv_msg_size_mib", _DEFAULT_MAX_MSG_MIB),
    ("http", _DEFAULT_HTTP_ENDPOINT, "max_request_body_size_mib", _DEFAULT_MAX_BODY_MIB),
)


def _default_receiver(protocol: str) -> ReceiverConfig:
    for name, endpoint, _, size_mib in _PROTOCOLS:
        if name == protocol:
            return ReceiverConfig(endpoint=endpoint, max_message_size=size_mib * _MIB)
    raise ValueError(f"unknown OTLP protocol {protocol!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class OtlpReceiverConfig:
    """The ``otlp`` receiver: gRPC and/or HTTP (None: that protocol does not run)."""

    grpc: ReceiverConfig | None = field(default_factory=lambda: _default_receiver("grpc"))
    http: ReceiverConfig | None = field(default_factory=lambda: _default_receiver("http"))
    span_limits: SpanLimits = DEFAULT_SPAN_LIMITS
    """What each span may hold (``span_limits``: ``max_attributes``, ``max_events``,
    ``max_links``, ``max_string_length``, ``max_array_length``); a span past one is rejected
    through ``partial_success``, the rest of its request kept."""

    def validate(self) -> None:
        check(self.grpc is not None or self.http is not None, "protocols", "name one at least")
        for key in _SPAN_LIMIT_KEYS:
            check(getattr(self.span_limits, key) > 0, f"span_limits.{key}", "must be > 0")
        for protocol, _, size_key, _ in _PROTOCOLS:
            receiver: ReceiverConfig | None = getattr(self, protocol)
            if receiver is None:
                continue
            key = f"protocols.{protocol}"
            check_endpoint(f"{key}.endpoint", receiver.endpoint)
            check(receiver.max_message_size > 0, f"{key}.{size_key}", "must be > 0")
            check(receiver.auth_token != "", f"{key}.auth_token", "must not be empty")
            check_tls_pair(f"{key}.tls", receiver.tls_cert_file, receiver.tls_key_file)

    @classmethod
    def from_section(cls, section: ConfigSection) -> OtlpReceiverConfig:
        section.allow_keys("protocols", "span_limits")
        limits = section.section("span_limits")
        limits.allow_keys(*_SPAN_LIMIT_KEYS)
        span_limits = replace(
            DEFAULT_SPAN_LIMITS,
            **{
                key: limits.integer(key, getattr(DEFAULT_SPAN_LIMITS, key))
                for key in _SPAN_LIMIT_KEYS
            },
        )
        protocols = section.section("protocols")
        protocols.allow_keys("grpc", "http")
        receivers: dict[str, ReceiverConfig | None] = {}
        for protocol, default_endpoint, size_key, default_size_mib in _PROTOCOLS:
            # No protocol named: both run on their default ports.
            if protocols.raw and protocol not in protocols.raw:
                receivers[protocol] = None
                continue
            options = protocols.section(protocol)
            options.allow_keys("endpoint", size_key, "auth_token", "tls")
            tls = options.section("tls")
            tls.allow_keys("cert_file", "key_file")
            receivers[protocol] = ReceiverConfig(
                endpoint=options.string("endpoint", default_endpoint),
                max_message_size=int(options.number(size_key, default_size_mib) * _MIB),
                auth_token=options.optional_str("auth_token"),
                tls_cert_file=tls.optional_str("cert_file"),
                tls_key_file=tls.optional_str("key_file"),
            )
        return cls(grpc=receivers["grpc"], http=receivers["http"], span_limits=span_limits)


# --- processors -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class AssemblyConfig:
    quiet_period_s: float = _DEFAULT_QUIET_PERIOD_S
    """A trace is finished when no span arrived for this long."""
    root_grace_s: float = _DEFAULT_ROOT_GRACE_S
    """...or this long after its root span arrived (late children of the same batch)."""
    max_traces: int = _DEFAULT_MAX_TRACES
    max_spans_per_trace: int = _DEFAULT_MAX_SPANS_PER_TRACE
    max_pending_spans: int = _DEFAULT_MAX_PENDING_SPANS
    """Above this the receivers answer "retry later" (429 / RESOURCE_EXHAUSTED)."""

    def validate(self) -> None:
        check(self.quiet_period_s > 0, "quiet_period", "must be > 0")
        check(self.root_grace_s >= 0, "root_grace", "must be >= 0")
        check_range("max_traces", self.max_traces, low=1)
        check_range("max_spans_per_trace", self.max_spans_per_trace, low=1)
        check_range("max_pending_spans", self.max_pending_spans, low=1)

    @classmethod
    def from_section(cls, section: ConfigSection) -> AssemblyConfig:
        section.allow_keys(
            "quiet_period", "root_grace", "max_traces", "max_spans_per_trace", "max_pending_spans"
        )
        return cls(
            quiet_period_s=section.duration_s("quiet_period", _DEFAULT_QUIET_PERIOD_S),
            root_grace_s=section.duration_s("root_grace", _DEFAULT_ROOT_GRACE_S),
            max_traces=section.integer("max_traces", _DEFAULT_MAX_TRACES),
            max_spans_per_trace=section.integer(
                "max_spans_per_trace", _DEFAULT_MAX_SPANS_PER_TRACE
            ),
            max_pending_spans=section.integer("max_pending_spans", _DEFAULT_MAX_PENDING_SPANS),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class SloProcessorConfig:
    """The ``slo`` processor: the targets each request is marked against."""

    targets: tuple[SloTarget, ...] = ()

    def validate(self) -> None:
        """Nothing left to check: ``parse_targets`` rejects duplicate names when reading."""

    @classmethod
    def from_section(cls, section: ConfigSection) -> SloProcessorConfig:
        section.allow_keys("targets", "file")
        slo_file = section.raw.get("file")
        if "file" in section.raw:
            if "targets" in section.raw:
                raise ConfigError(
                    f"{section.path('file')}: give targets or a file of targets, not both "
                    "(declare each target once)"
                )
            if not isinstance(slo_file, str) or not slo_file:
                raise ConfigError(f"{section.path('file')}: expected the path of an SLO file")
        try:
            if isinstance(slo_file, str):
                targets = read_slo_file(_relative_to(slo_file, section))
            else:
                targets = parse_targets(section.raw.get("targets"), path=section.path("targets"))
        except ValueError as error:
            raise ConfigError(str(error)) from None
        return cls(targets=tuple(targets))


def _relative_to(path: str, section: ConfigSection) -> Path:
    """A path from a config file, relative to that file's directory (as written there)."""
    candidate = Path(path).expanduser()
    base_dir = section.context.base_dir
    return candidate if candidate.is_absolute() or base_dir is None else base_dir / candidate


_DIAGNOSIS_KEYS: Final = (
    "long_prompt_tokens",
    "bandwidth_bound_ratio",
    "itl_outlier_ratio",
    "itl_tail_spike_ratio",
    "interference_share",
    "tie_ratio",
)
_DEPRECATED_ITL_SPIKE_RATIO: Final = "itl_spike_ratio"
"""The key that set both ``itl_outlier_ratio`` and ``itl_tail_spike_ratio`` before they were
apart; configs that still write it keep their meaning (with a warning)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DiagnosisProcessorConfig:
    """The ``diagnosis`` processor: the settings of each request's verdict."""

    settings: DiagnosisConfig = field(default_factory=DiagnosisConfig)

    def validate(self) -> None:
        """``DiagnosisConfig.validate``'s limits (their one home), as a ``ConfigError``: its
        messages start with the field's name, which is the YAML key."""
        try:
            self.settings.validate()
        except ValueError as error:
            raise ConfigError(str(error)) from None

    @classmethod
    def from_section(cls, section: ConfigSection) -> DiagnosisProcessorConfig:
        section.allow_keys(*_DIAGNOSIS_KEYS, _DEPRECATED_ITL_SPIKE_RATIO)
        defaults = DiagnosisConfig()
        itl_outlier_ratio = defaults.itl_outlier_ratio
        itl_tail_spike_ratio = defaults.itl_tail_spike_ratio
        if _DEPRECATED_ITL_SPIKE_RATIO in section.raw:
            itl_outlier_ratio = itl_tail_spike_ratio = _deprecated_itl_spike_ratio(section)
        # The getters' errors already name the full path; only DiagnosisConfig's own limits
        # (checked when it is built, by the ``validate`` above) need the section's path in front.
        long_prompt_tokens = section.integer("long_prompt_tokens", defaults.long_prompt_tokens)
        bandwidth_bound_ratio = section.number(
            "bandwidth_bound_ratio", defaults.bandwidth_bound_ratio
        )
        itl_outlier_ratio = section.number("itl_outlier_ratio", itl_outlier_ratio)
        itl_tail_spike_ratio = section.number("itl_tail_spike_ratio", itl_tail_spike_ratio)
        interference_share = section.number("interference_share", defaults.interference_share)
        tie_ratio = section.number("tie_ratio", defaults.tie_ratio)
        try:
            settings = DiagnosisConfig(
                long_prompt_tokens=long_prompt_tokens,
                bandwidth_bound_ratio=bandwidth_bound_ratio,
                itl_outlier_ratio=itl_outlier_ratio,
                itl_tail_spike_ratio=itl_tail_spike_ratio,
                interference_share=interference_share,
                tie_ratio=tie_ratio,
            )
        except ValueError as error:  # "tie_ratio: ...": DiagnosisConfig checks its limits
            raise ConfigError(f"{section.where}.{error}") from None
        return cls(settings=settings)


def _deprecated_itl_spike_ratio(section: ConfigSection) -> float:
    """The value of the old key, which now sets both of the settings it meant."""
    old = section.path(_DEPRECATED_ITL_SPIKE_RATIO)
    written = [key for key in ("itl_outlier_ratio", "itl_tail_spike_ratio") if key in section.raw]
    if written:
        raise ConfigError(
            f"{old}: replaced by itl_outlier_ratio and itl_tail_spike_ratio; "
            f"remove it (this section already sets {' and '.join(written)})"
        )
    value = section.number(_DEPRECATED_ITL_SPIKE_RATIO, 0.0)
    _log.warning(
        "%s is deprecated: write itl_outlier_ratio: %g (a gap above this many median gaps is an "
        "outlier) and itl_tail_spike_ratio: %g (a p99 / median gap this large makes a spiky ITL "
        "tail); until then, it sets both to %g",
        old,
        value,
        value,
        value,
    )
    return value


_PERCENTILE_KEYS: Final = {"window_s": "window"}
"""``PercentileConfig`` fields whose YAML key has another name."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PercentilesProcessorConfig:
    """The ``percentiles`` processor: latency sketches over a sliding window."""

    settings: PercentileConfig = field(default_factory=PercentileConfig)

    def validate(self) -> None:
        settings = self.settings
        try:
            settings.validate()
        except ValueError as error:  # "window_s must be ...": name the YAML key as check() does
            field_name, _, problem = str(error).partition(" ")
            raise ConfigError(
                f"{_PERCENTILE_KEYS.get(field_name, field_name)}: {problem}"
            ) from None
        check(
            settings.slices <= _MAX_PERCENTILE_SLICES,
            "slices",
            f"must be <= {_MAX_PERCENTILE_SLICES}, got {settings.slices}",
        )

    @classmethod
    def from_section(cls, section: ConfigSection) -> PercentilesProcessorConfig:
        section.allow_keys("window", "slices", "max_keys")
        defaults = PercentileConfig()
        return cls(
            settings=PercentileConfig(
                window_s=section.duration_s("window", defaults.window_s),
                slices=section.integer("slices", defaults.slices),
                max_keys=section.integer("max_keys", defaults.max_keys),
            )
        )


_MAX_SAMPLING_KEYS: Final = 100_000


@dataclass(frozen=True, slots=True, kw_only=True)
class TailSamplingProcessorConfig:
    """The ``tail_sampling`` processor: which traces the exporters get (``tail_sampling.py``);
    the sketches and SLO marks have seen every request before it decides."""

    settings: TailSamplingSettings = field(default_factory=TailSamplingSettings)

    def validate(self) -> None:
        settings = self.settings
        check(settings.window_s > 0, "window", "must be > 0")
        check_range("slowest_per_window", settings.slowest_per_window, low=0)
        check_range("rare_share", settings.rare_share, low=0.0, high=1.0)
        check_range("rare_min_count", settings.rare_min_count, low=0)
        check_range("random_share", settings.random_share, low=0.0, high=1.0)
        check_range("max_keys", settings.max_keys, low=1, high=_MAX_SAMPLING_KEYS)

    @classmethod
    def from_section(cls, section: ConfigSection) -> TailSamplingProcessorConfig:
        section.allow_keys(
            "window",
            "slowest_per_window",
            "rare_share",
            "rare_min_count",
            "random_share",
            "max_keys",
        )
        defaults = TailSamplingSettings()
        return cls(
            settings=TailSamplingSettings(
                window_s=section.duration_s("window", defaults.window_s),
                slowest_per_window=section.integer(
                    "slowest_per_window", defaults.slowest_per_window
                ),
                rare_share=section.number("rare_share", defaults.rare_share),
                rare_min_count=section.integer("rare_min_count", defaults.rare_min_count),
                random_share=section.number("random_share", defaults.random_share),
                max_keys=section.integer("max_keys", defaults.max_keys),
            )
        )


# --- exporters ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class StoreConfig:
    path: str = _DEFAULT_STORE_PATH
    retention_s: float = DEFAULT_RETENTION_S
    max_requests: int = DEFAULT_MAX_REQUESTS

    def validate(self) -> None:
        check(bool(self.path), "path", "expected a non-empty string")
        check(self.retention_s > 0, "retention", "must be > 0")
        check_range("max_requests", self.max_requests, low=1)

    @classmethod
    def from_section(cls, section: ConfigSection) -> StoreConfig:
        section.allow_keys("path", "retention", "max_requests")
        return cls(
            path=section.string("path", _DEFAULT_STORE_PATH),
            retention_s=section.duration_s("retention", DEFAULT_RETENTION_S),
            max_requests=section.integer("max_requests", DEFAULT_MAX_REQUESTS),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class UpstreamConfig:
    """An ``otlp`` exporter: where enriched spans and the collector's metrics go."""

    exporter: OtlpExporterConfig = field(default_factory=OtlpExporterConfig)
    metrics_interval_s: float = _DEFAULT_METRICS_INTERVAL_S
    """How often the percentile histograms and the self-telemetry are sent."""

    def validate(self) -> None:
        check(self.metrics_interval_s > 0, "metrics_interval", "must be > 0")
        try:
            self.exporter.validate()
        except ValueError as error:  # names the field: "protocol: ..."
            raise ConfigError(str(error)) from None

    @classmethod
    def from_section(cls, section: ConfigSection) -> UpstreamConfig:
        """Keys of ``OtlpExporterConfig.from_settings`` plus ``metrics_interval``; without an
        endpoint the ``OTEL_EXPORTER_OTLP_*`` variables say where."""
        environ = section.context.environ
        settings = dict(section.raw)
        interval = section.duration_s("metrics_interval", _DEFAULT_METRICS_INTERVAL_S)
        settings.pop("metrics_interval", None)
        if not settings and not upstream_in_environment(environ):
            raise ConfigError(
                f"{section.where}: needs an endpoint (or set OTEL_EXPORTER_OTLP_ENDPOINT)"
            )
        try:
            exporter = OtlpExporterConfig.from_settings(settings, environ=environ)
        except ValueError as error:
            raise ConfigError(f"{section.where}.{error}") from None
        return cls(exporter=exporter, metrics_interval_s=interval)


def upstream_in_environment(environ: Mapping[str, str]) -> bool:
    """Whether the ``OTEL_EXPORTER_OTLP_*`` variables name a traces endpoint (an empty variable
    means unset, as the OTLP exporters read it)."""
    return bool(
        environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


# --- service ------------------------------------------------------------------------------------
DURABILITY_FSYNC: Final = "fsync"
DURABILITY_NONE: Final = "none"
_DURABILITY_MODES: Final = (DURABILITY_FSYNC, DURABILITY_NONE)
_DEFAULT_SPOOL_MAX_MIB: Final = 256
_DEFAULT_SPOOL_SEGMENT_MIB: Final = 8
_DEFAULT_SPOOL_SEGMENT_AGE_S: Final = 5.0
_MIN_SPOOL_SEGMENT_BYTES: Final = 64 * 1024
SPOOL_DIRECTORY_SUFFIX: Final = ".spool"
"""The spool's default directory: the store file's path plus this (next to the store)."""
POSTGRESQL_SPOOL_DIRECTORY: Final = "tokentrace-postgresql.spool"
"""The spool's default directory with a PostgreSQL store: in the working directory (each
replica needs its own; the spool refuses a directory another collector holds)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DurabilityConfig:
    """``service.durability``: whether an acknowledged export is on disk first (the write-ahead
    spool, ``collector/spool.py``). ``mode`` None: ``fsync`` when the pipeline has a store,
    else ``none`` (``CollectorConfig.spool_directory`` resolves it)."""

    mode: str | None = None
    directory: str | None = None
    """Where the spool's segment files go; None: next to the store file (``<store>.spool``),
    or ``POSTGRESQL_SPOOL_DIRECTORY`` with a PostgreSQL store."""
    max_bytes: int = _DEFAULT_SPOOL_MAX_MIB * _MIB
    """Past this the receivers answer "retry later" (429 / RESOURCE_EXHAUSTED)."""
    segment_bytes: int = _DEFAULT_SPOOL_SEGMENT_MIB * _MIB
    segment_age_s: float = _DEFAULT_SPOOL_SEGMENT_AGE_S

    def validate(self) -> None:
        check(
            self.mode is None or self.mode in _DURABILITY_MODES,
            "mode",
            f"expected one of {', '.join(_DURABILITY_MODES)}, got {self.mode!r}",
        )
        check(self.directory != "", "directory", "expected a non-empty path")
        check(
            self.segment_bytes >= _MIN_SPOOL_SEGMENT_BYTES,
            "segment_size_mib",
            f"must be >= {_MIN_SPOOL_SEGMENT_BYTES / _MIB:g}",
        )
        check(
            self.max_bytes >= 2 * self.segment_bytes,
            "max_size_mib",
            f"must be at least twice segment_size_mib ({2 * self.segment_bytes / _MIB:g})",
        )
        check(self.segment_age_s > 0, "segment_age", "must be > 0")

    @classmethod
    def from_section(cls, section: ConfigSection) -> DurabilityConfig:
        section.allow_keys("mode", "directory", "max_size_mib", "segment_size_mib", "segment_age")
        mode = section.optional_str("mode")
        return cls(
            mode=None if mode is None else mode.lower(),
            directory=section.optional_str("directory"),
            max_bytes=int(section.number("max_size_mib", _DEFAULT_SPOOL_MAX_MIB) * _MIB),
            segment_bytes=int(
                section.number("segment_size_mib", _DEFAULT_SPOOL_SEGMENT_MIB) * _MIB
            ),
            segment_age_s=section.duration_s("segment_age", _DEFAULT_SPOOL_SEGMENT_AGE_S),
        )


# --- extensions -----------------------------------------------------------------------------------
def validate_trace_link(template: str) -> str:
    """A trace-link template must be an http(s) URL containing ``{trace_id}``."""
    if "{trace_id}" not in template:
        raise ValueError("must contain {trace_id} where the trace id goes")
    scheme = template.split(":", 1)[0].lower()
    if scheme not in ("http", "https"):
        raise ValueError(f"must be an http:// or https:// URL, got {template!r}")
    return template


@dataclass(frozen=True, slots=True, kw_only=True)
class UiConfig:
    """The ``ui`` extension: the drill-down API and web UI over the request store."""

    endpoint: str = _DEFAULT_UI_ENDPOINT
    auth_token: str | None = None
    """Bearer token the API requires (the UI asks for it); None: no auth (loopback default)."""
    trace_link: str | None = None
    """URL of one trace in the tracing backend, with ``{trace_id}`` where the id goes."""
    tls_cert_file: str | None = None
    tls_key_file: str | None = None

    def validate(self) -> None:
        check_endpoint("endpoint", self.endpoint)
        check(self.auth_token != "", "auth_token", "must not be empty")
        check_tls_pair("tls", self.tls_cert_file, self.tls_key_file)
        if self.trace_link is not None:
            try:
                validate_trace_link(self.trace_link)
            except ValueError as error:
                raise ConfigError(f"trace_link: {error}") from None

    @classmethod
    def from_section(cls, section: ConfigSection) -> UiConfig:
        section.allow_keys("endpoint", "auth_token", "trace_link", "tls")
        tls = section.section("tls")
        tls.allow_keys("cert_file", "key_file")
        return cls(
            endpoint=section.string("endpoint", _DEFAULT_UI_ENDPOINT),
            auth_token=section.optional_str("auth_token"),
            trace_link=section.optional_str("trace_link"),
            tls_cert_file=tls.optional_str("cert_file"),
            tls_key_file=tls.optional_str("key_file"),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class AdminConfig:
    """The ``admin`` extension: ``/healthz``, ``/readyz`` and Prometheus ``/metrics`` on one
    listener (``collector/admin.py``). Unauthenticated: bind it where only the scraper and the
    kubelet reach it (loopback by default; ``deploy/`` binds the pod IP behind a NetworkPolicy)."""

    endpoint: str = _DEFAULT_ADMIN_ENDPOINT
    max_label_sets: int = _DEFAULT_MAX_LABEL_SETS
    """Request metrics keep at most this many (service, model, operation) label sets; requests
    of later ones are counted under ``_other``."""

    def validate(self) -> None:
        check_endpoint("endpoint", self.endpoint)
        check_range("max_label_sets", self.max_label_sets, low=1, high=_MAX_LABEL_SETS)

    @classmethod
    def from_section(cls, section: ConfigSection) -> AdminConfig:
        section.allow_keys("endpoint", "max_label_sets")
        return cls(
            endpoint=section.string("endpoint", _DEFAULT_ADMIN_ENDPOINT),
            max_label_sets=section.integer("max_label_sets", _DEFAULT_MAX_LABEL_SETS),
        )
