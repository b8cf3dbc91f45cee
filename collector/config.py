"""Collector configuration: YAML in the shape OpenTelemetry Collector users know.

```yaml
receivers:
  otlp:
    protocols:
      grpc: {endpoint: 127.0.0.1:4317}
      http: {endpoint: 127.0.0.1:4318}
processors:
  assembly: {quiet_period: 2s, max_traces: 20000}
  slo:
    targets:
      - {name: chat-ttft, metric: ttft, percentile: 95, threshold: 500ms,
         selector: {operation: chat}}
exporters:
  store: {path: ./tokentrace.db, retention: 7d}
  otlp: {endpoint: http://tempo:4317}
extensions:
  ui: {endpoint: 127.0.0.1:8700, trace_link: "http://tempo:3200/trace/{trace_id}"}
service:
  pipelines:
    traces: {receivers: [otlp], processors: [assembly, slo, diagnosis, percentiles],
             exporters: [store, otlp]}
```

Every section is optional: with no file at all the collector listens on the standard OTLP ports on
loopback, keeps its store in ``./tokentrace.db`` and exports upstream only when
``OTEL_EXPORTER_OTLP_ENDPOINT`` (or an ``otlp`` exporter) says where. Validation happens once, at
start, and every error names the offending key (``processors.slo.targets[1].threshold: ...``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokentrace.collector.exporters.otlp import OtlpExporterConfig
from tokentrace.processors.diagnosis import DiagnosisConfig
from tokentrace.processors.durations import parse_duration_ns
from tokentrace.processors.percentiles import PercentileConfig
from tokentrace.processors.slo import SloTarget, parse_targets, read_slo_file

_DEFAULT_GRPC_ENDPOINT = "127.0.0.1:4317"
_DEFAULT_HTTP_ENDPOINT = "127.0.0.1:4318"
_DEFAULT_STORE_PATH = "./tokentrace.db"
_DEFAULT_MAX_MSG_MIB = 4
_DEFAULT_MAX_BODY_MIB = 20
# Above the OpenTelemetry SDK's default export delay (5 s): a client and a server export their
# spans of one trace independently, and the later half must still find the trace open.
_DEFAULT_QUIET_PERIOD_S = 6.0
_DEFAULT_ROOT_GRACE_S = 1.0
"""Spans of one request come from several processes (vLLM's EngineCore exports its step and
chunk spans on its own ~0.2 s emitter cycle): wait this long after the root before finishing."""
_DEFAULT_MAX_TRACES = 20_000
_DEFAULT_MAX_SPANS_PER_TRACE = 5_000
_DEFAULT_MAX_PENDING_SPANS = 500_000
_DEFAULT_RETENTION_S = 7 * 24 * 3600.0
_DEFAULT_MAX_REQUESTS = 1_000_000
_DEFAULT_METRICS_INTERVAL_S = 15.0
_DEFAULT_UI_ENDPOINT = "127.0.0.1:8700"

PROCESSOR_TYPES = ("assembly", "slo", "diagnosis", "percentiles")
"""Processor types in the order they run: each needs what the earlier ones derived (the default
verdict answers the first SLO target the request breached)."""
_SAME_RANK = {"diagnosis": "slo"}
"""Configurations written before the verdict followed the SLO marks list diagnosis first: still
valid, as the pipeline runs them in ``PROCESSOR_TYPES`` order whatever the list says."""
EXPORTER_TYPES = ("store", "otlp")
RECEIVER_TYPES = ("otlp",)
EXTENSION_TYPES = ("ui",)
_DEFAULT_PROCESSORS = PROCESSOR_TYPES
_DEFAULT_EXPORTERS = ("store",)


class ConfigError(ValueError):
    """A configuration problem, with the path of the offending key in the message."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReceiverConfig:
    """One OTLP protocol's receiver (gRPC or HTTP)."""

    endpoint: str
    max_message_size: int
    """gRPC: the largest message received; HTTP: the largest request body."""
    auth_token: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None


# (protocol, default endpoint, YAML key of the size limit, its default in MiB)
_PROTOCOLS = (
    ("grpc", _DEFAULT_GRPC_ENDPOINT, "max_recv_msg_size_mib", _DEFAULT_MAX_MSG_MIB),
    (
        "http",
        _DEFAULT_HTTP_ENDPOINT,
        "max_request_body_size_mib",
        _DEFAULT_MAX_BODY_MIB,
    ),
)


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


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreConfig:
    path: str = _DEFAULT_STORE_PATH
    retention_s: float = _DEFAULT_RETENTION_S
    max_requests: int = _DEFAULT_MAX_REQUESTS


@dataclass(frozen=True, slots=True, kw_only=True)
class UpstreamConfig:
    """An ``otlp`` exporter: where enriched spans and the percentile metrics go."""

    name: str
    exporter: OtlpExporterConfig
    metrics_interval_s: float = _DEFAULT_METRICS_INTERVAL_S


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


def validate_trace_link(template: str) -> str:
    """A trace-link template must be an http(s) URL containing ``{trace_id}``."""
    if "{trace_id}" not in template:
        raise ValueError("must contain {trace_id} where the trace id goes")
    scheme = template.split(":", 1)[0].lower()
    if scheme not in ("http", "https"):
        raise ValueError(f"must be an http:// or https:// URL, got {template!r}")
    return template


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectorConfig:
    grpc: ReceiverConfig | None = field(
        default_factory=lambda: ReceiverConfig(
            endpoint=_DEFAULT_GRPC_ENDPOINT,
            max_message_size=_DEFAULT_MAX_MSG_MIB * 1024 * 1024,
        )
    )
    http: ReceiverConfig | None = field(
        default_factory=lambda: ReceiverConfig(
            endpoint=_DEFAULT_HTTP_ENDPOINT,
            max_message_size=_DEFAULT_MAX_BODY_MIB * 1024 * 1024,
        )
    )
    assembly: AssemblyConfig = field(default_factory=AssemblyConfig)
    diagnosis: DiagnosisConfig | None = field(default_factory=DiagnosisConfig)
    slo_targets: tuple[SloTarget, ...] = ()
    percentiles: PercentileConfig | None = field(default_factory=PercentileConfig)
    store: StoreConfig | None = field(default_factory=StoreConfig)
    upstream: tuple[UpstreamConfig, ...] = ()
    processors: tuple[str, ...] = _DEFAULT_PROCESSORS
    ui: UiConfig | None = None


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    store_path: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> CollectorConfig:
    """Read, validate and default the configuration (``path`` None: no file, all defaults)."""
    environ = os.environ if environ is None else environ
    raw: Any = {}
    base_dir = None
    if path is not None:
        raw = _read_yaml(Path(path), environ)
        base_dir = Path(path).parent
    config = parse_config(raw, environ=environ, base_dir=base_dir)
    if store_path is not None:
        if config.store is None:
            raise ConfigError("--store given, but the configuration has no store exporter")
        config = _replace(config, store=_replace(config.store, path=store_path))
    return config


_ENV_REFERENCE = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)\}")


def _read_yaml(path: Path, environ: Mapping[str, str]) -> Any:
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror or error}") from None
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    return _expand_env(raw, environ, "")


def _expand_env(value: Any, environ: Mapping[str, str], path: str) -> Any:
    """``${env:NAME}`` in string values, as the OTel Collector does, so secrets stay out of files.
    Substituted after parsing, so a value can never change the YAML's structure."""
    if isinstance(value, dict):
        return {
            key: _expand_env(item, environ, f"{path}.{key}" if path else str(key))
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [_expand_env(item, environ, f"{path}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, str):

        def lookup(match: re.Match[str]) -> str:
            name = match.group(1)
            if name not in environ:
                raise ConfigError(f"{path}: environment variable {name} is not set")
            return environ[name]

        return _ENV_REFERENCE.sub(lookup, value)
    return value


def load_slo_file(path: str | os.PathLike[str]) -> list[SloTarget]:
    """The SLO targets of an SLO file (``processors.slo.read_slo_file``), errors as
    ``ConfigError``."""
    try:
        return read_slo_file(path)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _relative_to(path: str, base_dir: Path | None) -> Path:
    """A path from a config file, relative to that file's directory (as written there)."""
    candidate = Path(path).expanduser()
    return candidate if candidate.is_absolute() or base_dir is None else base_dir / candidate


def parse_config(
    raw: Any, *, environ: Mapping[str, str], base_dir: Path | None = None
) -> CollectorConfig:
    """``base_dir``: the config file's directory, against which relative file paths resolve."""
    root = _Section(raw, "")
    root.allow_keys("receivers", "processors", "exporters", "service", "extensions")

    receivers_raw = root.section("receivers")
    processors_raw = root.section("processors")
    exporters_raw = root.section("exporters")
    service = root.section("service")
    service.allow_keys("pipelines", "telemetry", "extensions")
    pipelines = service.section("pipelines")
    pipelines.allow_keys("traces")
    traces = pipelines.section("traces")
    traces.allow_keys("receivers", "processors", "exporters")

    receiver_names = _component_names(receivers_raw, RECEIVER_TYPES)
    processor_names = _component_names(processors_raw, PROCESSOR_TYPES)
    exporter_names = _component_names(exporters_raw, EXPORTER_TYPES)

    # Pipeline membership: an explicit list wins, else everything configured plus the defaults.
    wanted_receivers = traces.name_list(
        "receivers", receiver_names, RECEIVER_TYPES, default=("otlp",)
    )
    wanted_processors = traces.name_list(
        "processors", processor_names, PROCESSOR_TYPES, default=_DEFAULT_PROCESSORS
    )
    # An empty variable means unset, as the OTLP exporters read it.
    upstream_from_env = bool(
        environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )
    default_exporters = list(_DEFAULT_EXPORTERS) + [
        n for n in exporter_names if _kind(n) != "store"
    ]
    if upstream_from_env and "otlp" not in default_exporters:
        default_exporters.append("otlp")
    wanted_exporters = traces.name_list(
        "exporters", exporter_names, EXPORTER_TYPES, default=default_exporters
    )
    _check_processor_order(wanted_processors, traces.path("processors"))
    if not wanted_receivers:
        raise ConfigError("service.pipelines.traces.receivers: the pipeline needs a receiver")
    # Components are identified by kind: `diagnosis/strict` is the diagnosis processor.
    receiver_by_kind = _one_per_kind(wanted_receivers, traces.path("receivers"))
    processor_by_kind = _one_per_kind(wanted_processors, traces.path("processors"))
    stores = [n for n in wanted_exporters if _kind(n) == "store"]
    if len(stores) > 1:
        raise ConfigError(f"{traces.path('exporters')}: one store exporter at most, got {stores}")

    receivers: dict[str, ReceiverConfig | None] = {"grpc": None, "http": None}
    if "otlp" in receiver_by_kind:
        otlp = receivers_raw.section(receiver_by_kind["otlp"])
        otlp.allow_keys("protocols")
        protocols = otlp.section("protocols")
        protocols.allow_keys("grpc", "http")
        for protocol, default_endpoint, size_key, default_size_mib in _PROTOCOLS:
            # No protocol named: both run on their default ports.
            if protocols.raw and protocol not in protocols.raw:
                continue
            section = protocols.section(protocol)
            section.allow_keys("endpoint", size_key, "auth_token", "tls")
            tls = section.section("tls")
            tls.allow_keys("cert_file", "key_file")
            tls.require_pair("cert_file", "key_file")
            size_mib = section.number(size_key, default_size_mib, low=0.001)
            receivers[protocol] = ReceiverConfig(
                endpoint=section.endpoint("endpoint", default_endpoint),
                max_message_size=int(size_mib * 1024 * 1024),
                auth_token=section.optional_str("auth_token"),
                tls_cert_file=tls.optional_str("cert_file"),
                tls_key_file=tls.optional_str("key_file"),
            )

    assembly = processors_raw.section(processor_by_kind.get("assembly", "assembly"))
    assembly.allow_keys(
        "quiet_period", "root_grace", "max_traces", "max_spans_per_trace", "max_pending_spans"
    )
    assembly_config = AssemblyConfig(
        quiet_period_s=assembly.duration_s("quiet_period", _DEFAULT_QUIET_PERIOD_S),
        root_grace_s=assembly.duration_s("root_grace", _DEFAULT_ROOT_GRACE_S, allow_zero=True),
        max_traces=assembly.integer("max_traces", _DEFAULT_MAX_TRACES, low=1),
        max_spans_per_trace=assembly.integer(
            "max_spans_per_trace", _DEFAULT_MAX_SPANS_PER_TRACE, low=1
        ),
        max_pending_spans=assembly.integer("max_pending_spans", _DEFAULT_MAX_PENDING_SPANS, low=1),
    )

    diagnosis_config: DiagnosisConfig | None = None
    if "diagnosis" in processor_by_kind:
        diagnosis = processors_raw.section(processor_by_kind["diagnosis"])
        diagnosis.allow_keys(
            "long_prompt_tokens",
            "bandwidth_bound_ratio",
            "itl_spike_ratio",
            "interference_share",
            "tie_ratio",
        )
        defaults = DiagnosisConfig()
        diagnosis_config = DiagnosisConfig(
            long_prompt_tokens=diagnosis.integer(
                "long_prompt_tokens", defaults.long_prompt_tokens, low=1
            ),
            bandwidth_bound_ratio=diagnosis.number(
                "bandwidth_bound_ratio", defaults.bandwidth_bound_ratio, low=0.0, high=1.0
            ),
            itl_spike_ratio=diagnosis.number("itl_spike_ratio", defaults.itl_spike_ratio, low=1.0),
            interference_share=diagnosis.number(
                "interference_share", defaults.interference_share, low=0.0, high=1.0
            ),
            tie_ratio=diagnosis.number("tie_ratio", defaults.tie_ratio, low=0.01, high=1.0),
        )

    targets: tuple[SloTarget, ...] = ()
    if "slo" in processor_by_kind:
        slo = processors_raw.section(processor_by_kind["slo"])
        slo.allow_keys("targets", "file")
        if "file" in slo.raw:
            if "targets" in slo.raw:
                raise ConfigError(
                    f"{slo.path('file')}: give targets or a file of targets, not both "
                    "(declare each target once)"
                )
            slo_file = slo.raw["file"]
            if not isinstance(slo_file, str) or not slo_file:
                raise ConfigError(f"{slo.path('file')}: expected the path of an SLO file")
            targets = tuple(load_slo_file(_relative_to(slo_file, base_dir)))
        else:
            raw_targets = slo.raw.get("targets", [])
            if not isinstance(raw_targets, list):
                raise ConfigError(f"{slo.path('targets')}: expected a list of targets")
            try:
                targets = tuple(parse_targets(raw_targets))
            except ValueError as error:
                raise ConfigError(f"processors.{error}") from None

    percentile_config: PercentileConfig | None = None
    if "percentiles" in processor_by_kind:
        percentiles = processors_raw.section(processor_by_kind["percentiles"])
        percentiles.allow_keys("window", "slices", "max_keys")
        defaults_p = PercentileConfig()
        percentile_config = PercentileConfig(
            window_s=percentiles.duration_s("window", defaults_p.window_s),
            slices=percentiles.integer("slices", defaults_p.slices, low=1, high=3600),
            max_keys=percentiles.integer("max_keys", defaults_p.max_keys, low=1),
        )
        try:
            percentile_config.validate()
        except ValueError as error:
            raise ConfigError(f"processors.percentiles: {error}") from None

    store_config: StoreConfig | None = None
    if stores:
        store = exporters_raw.section(stores[0])
        store.allow_keys("path", "retention", "max_requests")
        store_config = StoreConfig(
            path=store.string("path", _DEFAULT_STORE_PATH),
            retention_s=store.duration_s("retention", _DEFAULT_RETENTION_S),
            max_requests=store.integer("max_requests", _DEFAULT_MAX_REQUESTS, low=1),
        )

    upstream: list[UpstreamConfig] = []
    for name in wanted_exporters:
        if _kind(name) == "store":
            continue
        section = exporters_raw.section(name)
        settings = dict(section.raw)
        interval = section.duration_s("metrics_interval", _DEFAULT_METRICS_INTERVAL_S)
        settings.pop("metrics_interval", None)
        if not settings and not upstream_from_env:
            raise ConfigError(
                f"exporters.{name}: needs an endpoint (or set OTEL_EXPORTER_OTLP_ENDPOINT)"
            )
        try:
            exporter = OtlpExporterConfig.from_settings(settings, environ=environ)
            exporter.validate()
        except ValueError as error:
            raise ConfigError(f"exporters.{name}.{error}") from None
        upstream.append(UpstreamConfig(name=name, exporter=exporter, metrics_interval_s=interval))

    ui_config = _parse_ui(root.section("extensions"), service, store_config)

    return CollectorConfig(
        grpc=receivers["grpc"],
        http=receivers["http"],
        assembly=assembly_config,
        diagnosis=diagnosis_config,
        slo_targets=targets,
        percentiles=percentile_config,
        store=store_config,
        upstream=tuple(upstream),
        processors=tuple(wanted_processors),
        ui=ui_config,
    )


def _parse_ui(
    extensions: _Section, service: _Section, store: StoreConfig | None
) -> UiConfig | None:
    """Extensions defined under ``extensions`` run, or only those ``service.extensions`` names
    (as in the OpenTelemetry Collector)."""
    defined = _component_names(extensions, EXTENSION_TYPES)
    enabled = service.name_list("extensions", defined, EXTENSION_TYPES, default=defined)
    by_kind = _one_per_kind(enabled, service.path("extensions"))
    if "ui" not in by_kind:
        return None
    ui = extensions.section(by_kind["ui"])
    ui.allow_keys("endpoint", "auth_token", "trace_link", "tls")
    tls = ui.section("tls")
    tls.allow_keys("cert_file", "key_file")
    tls.require_pair("cert_file", "key_file")
    if store is None:
        raise ConfigError(
            f"{ui.path('endpoint')}: the ui extension serves the request store; "
            "add a store exporter to the pipeline"
        )
    trace_link = ui.optional_str("trace_link")
    if trace_link is not None:
        try:
            validate_trace_link(trace_link)
        except ValueError as error:
            raise ConfigError(f"{ui.path('trace_link')}: {error}") from None
    return UiConfig(
        endpoint=ui.endpoint("endpoint", _DEFAULT_UI_ENDPOINT),
        auth_token=ui.optional_str("auth_token"),
        trace_link=trace_link,
        tls_cert_file=tls.optional_str("cert_file"),
        tls_key_file=tls.optional_str("key_file"),
    )


def _component_names(section: _Section, types: tuple[str, ...]) -> list[str]:
    """Component ids are ``type`` or ``type/name`` as in the OTel Collector."""
    for key in section.raw:
        kind = str(key).split("/", 1)[0]
        if kind not in types:
            raise ConfigError(
                f"{section.path(str(key))}: unknown component type {kind!r} "
                f"(known: {', '.join(types)})"
            )
    return [str(key) for key in section.raw]


def _kind(name: str) -> str:
    return name.split("/", 1)[0]


def _one_per_kind(names: list[str], path: str) -> dict[str, str]:
    by_kind: dict[str, str] = {}
    for name in names:
        if _kind(name) in by_kind:
            raise ConfigError(
                f"{path}: {by_kind[_kind(name)]!r} and {name!r} are both {_kind(name)!r}; "
                "a pipeline takes one of each"
            )
        by_kind[_kind(name)] = name
    return by_kind


def _check_processor_order(names: list[str], path: str) -> None:
    kinds = [_kind(name) for name in names]
    order = [PROCESSOR_TYPES.index(_SAME_RANK.get(kind, kind)) for kind in kinds]
    if order != sorted(order):
        raise ConfigError(
            f"{path}: processors must run in the order {', '.join(PROCESSOR_TYPES)} "
            f"(each uses what the earlier ones derived); got {', '.join(names)}"
        )
    if names and "assembly" not in kinds:
        raise ConfigError(f"{path}: 'assembly' is required (it turns spans into requests)")


def _replace(obj: Any, **changes: Any) -> Any:
    import dataclasses

    return dataclasses.replace(obj, **changes)


class _Section:
    """A mapping at a known key path, with typed getters whose errors name the key."""

    def __init__(self, raw: Any, path: str) -> None:
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            where = path or "the configuration"
            raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
        self.raw: dict[str, Any] = raw
        self._path = path

    def path(self, key: str) -> str:
        return f"{self._path}.{key}" if self._path else key

    def allow_keys(self, *keys: str) -> None:
        for key in self.raw:
            if key not in keys:
                raise ConfigError(
                    f"{self.path(str(key))}: unknown key (expected one of: {', '.join(keys)})"
                )

    def section(self, key: str) -> _Section:
        return _Section(self.raw.get(key), self.path(key))

    def string(self, key: str, default: str) -> str:
        value = self.raw.get(key, default)
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{self.path(key)}: expected a non-empty string")
        return value

    def optional_str(self, key: str) -> str | None:
        if self.raw.get(key) is None:
            return None
        return self.string(key, "")

    def require_pair(self, first: str, second: str) -> None:
        if (self.raw.get(first) is None) != (self.raw.get(second) is None):
            raise ConfigError(f"{self._path}: {first} and {second} must be given together")

    def endpoint(self, key: str, default: str) -> str:
        value = self.string(key, default)
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ConfigError(f"{self.path(key)}: expected HOST:PORT, got {value!r}")
        return value

    def number(
        self, key: str, default: float, *, low: float | None = None, high: float | None = None
    ) -> float:
        value = self.raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{self.path(key)}: expected a number, got {value!r}")
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = (
                f"[{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
            )
            raise ConfigError(f"{self.path(key)}: {value} is outside {bounds}")
        return float(value)

    def integer(
        self, key: str, default: int, *, low: int | None = None, high: int | None = None
    ) -> int:
        value = self.raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{self.path(key)}: expected an integer, got {value!r}")
        self.number(key, default, low=low, high=high)
        return value

    def duration_s(self, key: str, default: float, *, allow_zero: bool = False) -> float:
        value = self.raw.get(key)
        if value is None:
            return default
        try:
            ns = parse_duration_ns(value)
        except ValueError as error:
            raise ConfigError(f"{self.path(key)}: {error}") from None
        if ns < 0 or (ns == 0 and not allow_zero):
            raise ConfigError(f"{self.path(key)}: must be {'>= 0' if allow_zero else '> 0'}")
        return ns / 1e9

    def name_list(
        self, key: str, known: list[str], types: tuple[str, ...], *, default: Any
    ) -> list[str]:
        value = self.raw.get(key)
        if value is None:
            return list(default)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{self.path(key)}: expected a list of component names")
        for name in value:
            kind = name.split("/", 1)[0]
            if kind not in types:
                raise ConfigError(
                    f"{self.path(key)}: unknown component {name!r} (known: {', '.join(types)})"
                )
            # A bare type with no section of its own runs on defaults.
            if name not in known and name != kind:
                raise ConfigError(f"{self.path(key)}: {name!r} is not defined in its section")
        return list(value)
