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
  admin: {endpoint: 127.0.0.1:13133}    # /healthz, /readyz, Prometheus /metrics
service:
  pipelines:
    traces: {receivers: [otlp], processors: [assembly, slo, diagnosis, percentiles],
             exporters: [store, otlp]}
  durability: {mode: fsync, directory: ./tokentrace.db.spool, max_size_mib: 256}
  memory_limiter: {limit_mib: 1024, spike_limit_mib: 200, check_interval: 100ms}
```

``service.durability`` (``DurabilityConfig``) is the collector's, not a component's: the
write-ahead spool in front of assembly that makes an acknowledged export durable (see
``collector/spool.py`` and docs/reliability.md). By default it is on (``fsync``) whenever the
pipeline has a store, with the spool in a directory next to the store file.
``service.memory_limiter`` (``MemoryLimiterConfig``) is the collector's memory ceiling: receivers
answer "retry later" while the process is near it (``collector/memory_limiter.py``); by default
80 % of the container's memory limit, or 1 GiB.

Processors not listed in the pipeline all run, except ``tail_sampling`` (which traces the
exporters get, ``collector/tail_sampling.py``): it runs only when its section is there or the
pipeline lists it, so without it every trace is stored and exported.

Every section is optional: with no file at all the collector listens on the standard OTLP ports on
loopback, keeps its store in ``./tokentrace.db`` and exports upstream only when
``OTEL_EXPORTER_OTLP_ENDPOINT`` (or an ``otlp`` exporter) says where. The ``admin`` extension
(health, readiness, Prometheus metrics) runs only when configured: a fixed default port would
make two collectors on one host (tests, the demo beside a deployed one) refuse to start.

Components are named by id, ``type`` or ``type/name``; the factories' table (``factories.py``)
says which types exist and how each reads its section (``component.py``). ``parse_config`` reads
the YAML's shape, calls each component config's ``validate()``, and checks the pipeline as a
whole (one receiver and processor of each type, processors in the order they run, the ``ui``
extension needs a store). Validation happens once, at start, and every error names the offending
key (``processors.slo.targets[1].threshold: ...``).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from tokentrace.collector.component import (
    KIND_EXPORTER,
    KIND_EXTENSION,
    KIND_PROCESSOR,
    KIND_RECEIVER,
    ComponentConfig,
    ConfigContext,
    ConfigError,
    ConfigSection,
    Factories,
    component_type,
    factory_types,
    find_factory,
    validated,
)
from tokentrace.collector.component_configs import (
    DURABILITY_FSYNC,
    DURABILITY_NONE,
    POSTGRESQL_SPOOL_DIRECTORY,
    SPOOL_DIRECTORY_SUFFIX,
    AdminConfig,
    AssemblyConfig,
    DiagnosisProcessorConfig,
    DurabilityConfig,
    OtlpReceiverConfig,
    PercentilesProcessorConfig,
    ReceiverConfig,
    SloProcessorConfig,
    StoreConfig,
    TailSamplingProcessorConfig,
    UiConfig,
    UpstreamConfig,
    upstream_in_environment,
    validate_trace_link,
)
from tokentrace.collector.memory_limiter import MemoryLimiterConfig
from tokentrace.collector.store.location import is_postgresql
from tokentrace.collector.tail_sampling import TailSamplingSettings
from tokentrace.processors.diagnosis import DiagnosisConfig
from tokentrace.processors.percentiles import PercentileConfig
from tokentrace.processors.slo import SloTarget

__all__ = [
    "AdminConfig",
    "AssemblyConfig",
    "CollectorConfig",
    "ConfigError",
    "DurabilityConfig",
    "ReceiverConfig",
    "StoreConfig",
    "UiConfig",
    "UpstreamConfig",
    "load_config",
    "parse_config",
    "validate_trace_link",
]

_SECTIONS: Final = (
    ("receivers", KIND_RECEIVER),
    ("processors", KIND_PROCESSOR),
    ("exporters", KIND_EXPORTER),
)
_DEFAULT_RECEIVERS: Final = ("otlp",)
_DEFAULT_EXPORTERS: Final = ("store",)
_ASSEMBLY: Final = "assembly"
_STORE: Final = "store"
_OTLP: Final = "otlp"
_UI: Final = "ui"
_ADMIN: Final = "admin"
_TAIL_SAMPLING: Final = "tail_sampling"
_OPT_IN_PROCESSORS: Final = (_TAIL_SAMPLING,)
"""Processor types that run only when configured (defined under ``processors`` or listed in
the pipeline), not by default."""
_SAME_RANK: Final = {"diagnosis": "slo"}
"""Configurations written before the verdict followed the SLO marks list diagnosis first: still
valid, and run in the table's order whatever the list says."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectorConfig:
    """Every component of one collector's traces pipeline, by kind (see ``parse_config``)."""

    receivers: tuple[ComponentConfig, ...]
    processors: tuple[ComponentConfig, ...]
    """In the order they run (the factories' table order; ``assembly`` first)."""
    exporters: tuple[ComponentConfig, ...]
    """In the order each batch is handed to them."""
    extensions: tuple[ComponentConfig, ...] = ()
    durability: DurabilityConfig = dataclasses.field(default_factory=DurabilityConfig)
    """``service.durability``; ``durability_mode`` and ``spool_directory`` resolve its defaults."""
    memory_limiter: MemoryLimiterConfig = dataclasses.field(default_factory=MemoryLimiterConfig)
    """``service.memory_limiter``: the memory ceiling (``collector/memory_limiter.py``)."""

    @property
    def durability_mode(self) -> str:
        """``fsync`` or ``none``: as configured, else ``fsync`` when there is a store."""
        if self.durability.mode is not None:
            return self.durability.mode
        return DURABILITY_FSYNC if self.store is not None else DURABILITY_NONE

    @property
    def spool_directory(self) -> str | None:
        """Where the write-ahead spool lives; None when durability is ``none``."""
        if self.durability_mode == DURABILITY_NONE:
            return None
        if self.durability.directory is not None:
            return self.durability.directory
        store = self.store
        assert store is not None, "parse_config requires a directory without a store"
        if is_postgresql(store.path):
            return POSTGRESQL_SPOOL_DIRECTORY
        return store.path + SPOOL_DIRECTORY_SUFFIX

    @property
    def processor_ids(self) -> tuple[str, ...]:
        return tuple(component.id for component in self.processors)

    @property
    def grpc(self) -> ReceiverConfig | None:
        otlp: OtlpReceiverConfig | None = _config_of(self.receivers, _OTLP)
        return None if otlp is None else otlp.grpc

    @property
    def http(self) -> ReceiverConfig | None:
        otlp: OtlpReceiverConfig | None = _config_of(self.receivers, _OTLP)
        return None if otlp is None else otlp.http

    @property
    def assembly(self) -> AssemblyConfig:
        assembly: AssemblyConfig | None = _config_of(self.processors, _ASSEMBLY)
        return assembly if assembly is not None else AssemblyConfig()

    @property
    def slo_targets(self) -> tuple[SloTarget, ...]:
        slo: SloProcessorConfig | None = _config_of(self.processors, "slo")
        return () if slo is None else slo.targets

    @property
    def diagnosis(self) -> DiagnosisConfig | None:
        diagnosis: DiagnosisProcessorConfig | None = _config_of(self.processors, "diagnosis")
        return None if diagnosis is None else diagnosis.settings

    @property
    def percentiles(self) -> PercentileConfig | None:
        percentiles: PercentilesProcessorConfig | None = _config_of(self.processors, "percentiles")
        return None if percentiles is None else percentiles.settings

    @property
    def tail_sampling(self) -> TailSamplingSettings | None:
        """None: every trace is exported (tail sampling is off unless configured)."""
        sampling: TailSamplingProcessorConfig | None = _config_of(self.processors, _TAIL_SAMPLING)
        return None if sampling is None else sampling.settings

    @property
    def store(self) -> StoreConfig | None:
        return _config_of(self.exporters, _STORE)

    @property
    def upstream(self) -> tuple[ComponentConfig, ...]:
        """The ``otlp`` exporters (each config an ``UpstreamConfig``)."""
        return tuple(component for component in self.exporters if component.type == _OTLP)

    @property
    def ui(self) -> UiConfig | None:
        return _config_of(self.extensions, _UI)

    @property
    def admin(self) -> AdminConfig | None:
        return _config_of(self.extensions, _ADMIN)

    def with_store_path(self, path: str) -> CollectorConfig:
        store = self.store
        if store is None:
            raise ConfigError("--store given, but the configuration has no store exporter")
        exporters = tuple(
            dataclasses.replace(c, config=dataclasses.replace(store, path=path))
            if c.type == _STORE
            else c
            for c in self.exporters
        )
        return dataclasses.replace(self, exporters=exporters)


def _config_of(components: Sequence[ComponentConfig], type_name: str) -> Any:
    for component in components:
        if component.type == type_name:
            return component.config
    return None


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
    return config if store_path is None else config.with_store_path(store_path)


_REFERENCE = re.compile(r"\$\{(env|file):([^}]+)\}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MAX_FILE_REFERENCE_BYTES = 64 * 1024


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
    return _expand_references(raw, environ, path.parent, "")


def _expand_references(value: Any, environ: Mapping[str, str], base_dir: Path, path: str) -> Any:
    """``${env:NAME}`` and ``${file:PATH}`` in string values, as the OTel Collector's providers
    do, so secrets stay out of the file: a variable's value, or a file's content without its
    trailing newline (a token mounted from a Kubernetes Secret; a relative path is read from the
    config file's folder). Substituted after parsing, so a value can never change the YAML's
    structure."""
    if isinstance(value, dict):
        return {
            key: _expand_references(item, environ, base_dir, f"{path}.{key}" if path else str(key))
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [
            _expand_references(item, environ, base_dir, f"{path}[{i}]")
            for i, item in enumerate(value)
        ]
    if isinstance(value, str):

        def lookup(match: re.Match[str]) -> str:
            provider, reference = match.group(1), match.group(2)
            if provider == "file":
                return _file_reference(base_dir / reference, path)
            if not _ENV_NAME.fullmatch(reference):
                raise ConfigError(f"{path}: ${{env:{reference}}} is not a variable name")
            if reference not in environ:
                raise ConfigError(f"{path}: environment variable {reference} is not set")
            return environ[reference]

        return _REFERENCE.sub(lookup, value)
    return value


def _file_reference(file: Path, path: str) -> str:
    try:
        with file.open("rb") as opened:
            content = opened.read(_MAX_FILE_REFERENCE_BYTES + 1)
    except OSError as error:
        raise ConfigError(f"{path}: cannot read {file}: {error.strerror or error}") from None
    if len(content) > _MAX_FILE_REFERENCE_BYTES:
        raise ConfigError(f"{path}: {file} is larger than {_MAX_FILE_REFERENCE_BYTES} bytes")
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: {file} is not UTF-8 text") from None
    return text.removesuffix("\n").removesuffix("\r")


def parse_config(
    raw: Any,
    *,
    environ: Mapping[str, str],
    base_dir: Path | None = None,
    factories: Factories | None = None,
) -> CollectorConfig:
    """``base_dir``: the config file's directory, against which relative file paths resolve;
    ``factories``: the components that exist (default: ``factories.FACTORIES``)."""
    if factories is None:
        from tokentrace.collector.factories import FACTORIES  # the table imports this module's

        factories = FACTORIES
    root = ConfigSection(raw, "", ConfigContext(environ, base_dir))
    root.allow_keys("receivers", "processors", "exporters", "service", "extensions")
    service = root.section("service")
    service.allow_keys("pipelines", "telemetry", "extensions", "durability", "memory_limiter")
    pipelines = service.section("pipelines")
    pipelines.allow_keys("traces")
    traces = pipelines.section("traces")
    traces.allow_keys("receivers", "processors", "exporters")

    sections = {kind: root.section(name) for name, kind in _SECTIONS}
    types = {kind: factory_types(factories, kind) for _, kind in _SECTIONS}
    defined = {kind: _component_names(sections[kind], types[kind]) for _, kind in _SECTIONS}

    # Pipeline membership: an explicit list wins, else everything configured plus the defaults.
    receiver_ids = traces.name_list(
        "receivers", defined[KIND_RECEIVER], types[KIND_RECEIVER], default=_DEFAULT_RECEIVERS
    )
    # No list: every processor type runs, but those that change what is kept only when
    # configured (tail sampling is off unless its section is there).
    default_processors = [t for t in types[KIND_PROCESSOR] if t not in _OPT_IN_PROCESSORS]
    default_processors += [
        n for n in defined[KIND_PROCESSOR] if component_type(n) in _OPT_IN_PROCESSORS
    ]
    processor_ids = traces.name_list(
        "processors", defined[KIND_PROCESSOR], types[KIND_PROCESSOR], default=default_processors
    )
    default_exporters = [*_DEFAULT_EXPORTERS]
    default_exporters += [n for n in defined[KIND_EXPORTER] if component_type(n) != _STORE]
    if upstream_in_environment(environ) and _OTLP not in default_exporters:
        default_exporters.append(_OTLP)
    exporter_ids = traces.name_list(
        "exporters", defined[KIND_EXPORTER], types[KIND_EXPORTER], default=default_exporters
    )
    if not receiver_ids:
        raise ConfigError(f"{traces.path('receivers')}: the pipeline needs a receiver")
    processor_ids = _run_order(processor_ids, types[KIND_PROCESSOR], traces.path("processors"))
    _one_per_type(receiver_ids, traces.path("receivers"))
    _one_per_type(processor_ids, traces.path("processors"))
    stores = [n for n in exporter_ids if component_type(n) == _STORE]
    if len(stores) > 1:
        raise ConfigError(f"{traces.path('exporters')}: one store exporter at most, got {stores}")

    def read(kind: str, ids: Sequence[str], section: ConfigSection) -> tuple[ComponentConfig, ...]:
        return tuple(
            ComponentConfig(id_, kind, _read(factories, kind, id_, section)) for id_ in ids
        )

    receivers = read(KIND_RECEIVER, receiver_ids, sections[KIND_RECEIVER])
    processors = read(KIND_PROCESSOR, processor_ids, sections[KIND_PROCESSOR])
    exporters = read(KIND_EXPORTER, exporter_ids, sections[KIND_EXPORTER])

    # Extensions defined under ``extensions`` run, or only those ``service.extensions`` names
    # (as in the OpenTelemetry Collector).
    extension_types = factory_types(factories, KIND_EXTENSION)
    extensions_section = root.section("extensions")
    defined_extensions = _component_names(extensions_section, extension_types)
    extension_ids = service.name_list(
        "extensions", defined_extensions, extension_types, default=defined_extensions
    )
    _one_per_type(extension_ids, service.path("extensions"))
    extensions = read(KIND_EXTENSION, extension_ids, extensions_section)
    ui = _config_of(extensions, _UI)
    if ui is not None and not stores:
        ui_id = next(e.id for e in extensions if e.type == _UI)
        raise ConfigError(
            f"{extensions_section.path(ui_id)}.endpoint: the ui extension serves the request "
            "store; add a store exporter to the pipeline"
        )
    durability_section = service.section("durability")
    durability = validated(
        DurabilityConfig.from_section(durability_section), durability_section.where
    )
    _check_durability(durability, durability_section, receivers, stores)
    limiter_section = service.section("memory_limiter")
    memory_limiter = validated(
        MemoryLimiterConfig.from_section(limiter_section), limiter_section.where
    )
    return CollectorConfig(
        receivers=receivers,
        processors=processors,
        exporters=exporters,
        extensions=extensions,
        durability=durability,
        memory_limiter=memory_limiter,
    )


def _check_durability(
    durability: DurabilityConfig,
    section: ConfigSection,
    receivers: Sequence[ComponentConfig],
    stores: Sequence[str],
) -> None:
    """What ``DurabilityConfig.validate`` cannot see: the store it sits next to, and the largest
    request a receiver takes (one that the spool could never hold would be refused forever)."""
    if durability.mode == DURABILITY_NONE:
        return
    if durability.mode == DURABILITY_FSYNC and durability.directory is None and not stores:
        raise ConfigError(
            f"{section.path('directory')}: needed with mode fsync when the pipeline has no "
            "store exporter (by default the spool goes next to the store file)"
        )
    if durability.mode is None and not stores:
        return
    otlp: OtlpReceiverConfig | None = _config_of(receivers, _OTLP)
    if otlp is None:
        return
    for receiver in (otlp.grpc, otlp.http):
        if receiver is not None and receiver.max_message_size > durability.max_bytes:
            raise ConfigError(
                f"{section.path('max_size_mib')}: must be at least the receivers' largest "
                f"message ({receiver.max_message_size / 1048576:g} MiB)"
            )


def _read(factories: Factories, kind: str, component_id: str, parent: ConfigSection) -> Any:
    """A component's validated config from its section (none when the pipeline names a bare
    type: the defaults)."""
    section = parent.section(component_id)
    factory = find_factory(factories, kind, component_type(component_id))
    return validated(factory.read_config(section), section.where)


def _component_names(section: ConfigSection, types: Sequence[str]) -> list[str]:
    """Component ids are ``type`` or ``type/name`` as in the OTel Collector."""
    for key in section.raw:
        kind = component_type(str(key))
        if kind not in types:
            raise ConfigError(
                f"{section.path(str(key))}: unknown component type {kind!r} "
                f"(known: {', '.join(types)})"
            )
    return [str(key) for key in section.raw]


def _one_per_type(names: Sequence[str], path: str) -> None:
    by_type: dict[str, str] = {}
    for name in names:
        type_name = component_type(name)
        if type_name in by_type:
            raise ConfigError(
                f"{path}: {by_type[type_name]!r} and {name!r} are both {type_name!r}; "
                "a pipeline takes one of each"
            )
        by_type[type_name] = name


def _run_order(names: Sequence[str], rank: Sequence[str], path: str) -> list[str]:
    """The listed processors in the order they run: the factories' table order (``rank``).

    A list must already name them in that order, but for the types ``_SAME_RANK`` lets swap
    (diagnosis before slo), which are put in the table's order here; anything else out of
    order is refused. No processor listed: assembly alone (the pipeline always assembles)."""
    if not names:
        return [_ASSEMBLY]
    types = [component_type(name) for name in names]
    listed = [rank.index(_SAME_RANK.get(t, t)) for t in types]
    if listed != sorted(listed):
        raise ConfigError(
            f"{path}: processors must run in the order {', '.join(rank)} "
            f"(each uses what the earlier ones derived); got {', '.join(names)}"
        )
    if _ASSEMBLY not in types:
        raise ConfigError(f"{path}: 'assembly' is required (it turns spans into requests)")
    return sorted(names, key=lambda name: rank.index(component_type(name)))
