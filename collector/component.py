"""The collector's component model, after the OpenTelemetry Collector's.

Every receiver, processor, exporter and extension is made by a ``Factory`` (``factories.py`` holds
the table of them all): the ``type`` its YAML section is named by, its ``kind``,
``default_config()``, ``read_config(section)`` (the YAML shape, over the defaults) and
``create(config, settings)``. A typed config is a frozen dataclass with defaults whose
``validate()`` raises ``ConfigError`` naming the offending key relative to the component's section
(the loader prefixes the section's path: ``processors.assembly.max_traces: ...``).

``CreateSettings`` hands a component what it gets from the collector: its id as configured
(``otlp``, ``otlp/tempo``), the self-telemetry registry, injected clocks, the whole configuration
(for what components share: the SLO targets the store records and the diagnosis answers, the
store the ``ui`` extension serves) and, for a receiver, the consumer it hands data to.

Lifecycle (``Component``): the service starts downstream first (exporters, the pipeline's worker,
extensions, receivers) and shuts down upstream first (receivers, extensions, the pipeline's drain,
exporters), so nothing accepted is lost on a clean stop; a failing start shuts down what started.
Data flows only downstream: exporters get batches and periodic ticks, never the pipeline itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Generic, Protocol, TypeVar

from tokentrace.collector.receivers import split_endpoint
from tokentrace.processors.durations import parse_duration_ns

if TYPE_CHECKING:
    from tokentrace.collector.config import CollectorConfig
    from tokentrace.collector.consumer import TraceConsumer
    from tokentrace.collector.self_telemetry import ComponentTelemetry, SelfTelemetry

KIND_RECEIVER: Final = "receiver"
KIND_PROCESSOR: Final = "processor"
KIND_EXPORTER: Final = "exporter"
KIND_EXTENSION: Final = "extension"
KIND_PIPELINE: Final = "pipeline"
"""Not a factory kind: the self-telemetry kind of the pipeline itself (id ``traces``)."""


class ConfigError(ValueError):
    """A configuration problem, with the path of the offending key in the message."""


class ExportRetryable(Exception):
    """An exporter could not take a batch now but may later (the store's database refused it:
    full, locked, an I/O error): the pipeline holds the batch for that exporter, keeps its
    spooled requests, and hands it over again (``pipeline``). Any other exception from
    ``export_traces`` is counted and the batch goes on without that exporter."""


# --- configs ------------------------------------------------------------------------------------
class ValidatedConfig(Protocol):
    def validate(self) -> None:
        """Raise ConfigError naming the first invalid key (relative to the component's section)."""


ConfigT = TypeVar("ConfigT", bound=ValidatedConfig)


def validated(config: ConfigT, path: str) -> ConfigT:
    """``config`` once its ``validate()`` passed; errors get the section's ``path`` in front."""
    try:
        config.validate()
    except ConfigError as error:
        raise ConfigError(f"{path}.{error}" if path else str(error)) from None
    return config


def check(condition: bool, key: str, problem: str) -> None:
    """For ``validate()``: raise ``ConfigError("key: problem")`` unless ``condition``."""
    if not condition:
        raise ConfigError(f"{key}: {problem}")


def check_range(
    key: str, value: float, *, low: float | None = None, high: float | None = None
) -> None:
    inside = (low is None or value >= low) and (high is None or value <= high)
    bounds = f"[{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
    check(inside, key, f"{value} is outside {bounds}")


def check_endpoint(key: str, endpoint: str) -> None:
    """A listening endpoint, as the receivers parse it (``receivers.split_endpoint``)."""
    try:
        split_endpoint(endpoint)
    except ValueError as error:
        raise ConfigError(f"{key}: {error}") from None


def check_tls_pair(key: str, cert_file: str | None, key_file: str | None) -> None:
    check(
        (cert_file is None) == (key_file is None),
        key,
        "cert_file and key_file must be given together",
    )


@dataclass(frozen=True, slots=True)
class ComponentConfig:
    """One configured component: its id (``type`` or ``type/name``), kind and typed config."""

    id: str
    kind: str
    config: Any

    @property
    def type(self) -> str:
        return component_type(self.id)


def component_type(component_id: str) -> str:
    return component_id.split("/", 1)[0]


# --- reading YAML ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ConfigContext:
    """What reading a section may need beyond the section itself."""

    environ: Mapping[str, str]
    base_dir: Path | None = None
    """The config file's directory: relative file paths resolve against it."""


class ConfigSection:
    """A mapping at a known key path, with typed getters whose errors name the key. Getters
    check types and formats; value ranges are the configs' ``validate()``."""

    def __init__(self, raw: Any, path: str, context: ConfigContext) -> None:
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            where = path or "the configuration"
            raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
        self.raw: dict[str, Any] = raw
        self.context = context
        self._path = path

    @property
    def where(self) -> str:
        return self._path

    def path(self, key: str) -> str:
        return f"{self._path}.{key}" if self._path else key

    def allow_keys(self, *keys: str) -> None:
        for key in self.raw:
            if key not in keys:
                raise ConfigError(
                    f"{self.path(str(key))}: unknown key (expected one of: {', '.join(keys)})"
                )

    def section(self, key: str) -> ConfigSection:
        return ConfigSection(self.raw.get(key), self.path(key), self.context)

    def string(self, key: str, default: str) -> str:
        value = self.raw.get(key, default)
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{self.path(key)}: expected a non-empty string")
        return value

    def optional_str(self, key: str) -> str | None:
        if self.raw.get(key) is None:
            return None
        return self.string(key, "")

    def number(self, key: str, default: float) -> float:
        value = self.raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{self.path(key)}: expected a number, got {value!r}")
        return float(value)

    def integer(self, key: str, default: int) -> int:
        value = self.raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{self.path(key)}: expected an integer, got {value!r}")
        return value

    def duration_s(self, key: str, default: float) -> float:
        value = self.raw.get(key)
        if value is None:
            return default
        try:
            return parse_duration_ns(value) / 1e9
        except ValueError as error:
            raise ConfigError(f"{self.path(key)}: {error}") from None

    def name_list(
        self, key: str, known: Sequence[str], types: Sequence[str], *, default: Sequence[str]
    ) -> list[str]:
        """Component ids listed under ``key`` (each of a known type, and defined under its kind's
        section unless it is a bare type, which runs on defaults)."""
        value = self.raw.get(key)
        if value is None:
            return list(default)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{self.path(key)}: expected a list of component names")
        for name in value:
            kind = component_type(name)
            if kind not in types:
                raise ConfigError(
                    f"{self.path(key)}: unknown component {name!r} (known: {', '.join(types)})"
                )
            if name not in known and name != kind:
                raise ConfigError(f"{self.path(key)}: {name!r} is not defined in its section")
        return list(value)


# --- components -----------------------------------------------------------------------------------
class Component(Protocol):
    """What the service starts and shuts down (receivers, exporters, extensions)."""

    def start(self) -> None: ...

    def shutdown(self, *, timeout_s: float) -> None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class CreateSettings:
    id: str
    """The component's id as configured (``otlp``, ``store``, ``otlp/tempo``)."""
    kind: str
    telemetry: SelfTelemetry
    """The collector's one self-telemetry registry."""
    collector_config: CollectorConfig
    clock: Callable[[], float] = time.monotonic
    """Seconds, for intervals and timeouts."""
    wall_clock: Callable[[], float] = time.time
    """Unix seconds, for what is stamped or aligned to real time (percentile slices, OTLP)."""
    consumer: TraceConsumer | None = field(default=None)
    """Receivers: where they hand what they receive (the pipeline)."""

    def component_telemetry(
        self, *, snapshot_prefix: str = "", attributes: Mapping[str, str] | None = None
    ) -> ComponentTelemetry:
        """This component's view of the registry (``SelfTelemetry.component``)."""
        return self.telemetry.component(
            self.id, self.kind, snapshot_prefix=snapshot_prefix, attributes=attributes
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Factory(Generic[ConfigT]):
    type: str
    """The component type as the YAML names it (the part of an id before ``/``)."""
    kind: str
    default_config: Callable[[], ConfigT]
    read_config: Callable[[ConfigSection], ConfigT]
    """The typed config from the component's YAML section (missing keys keep their defaults)."""
    create: Callable[[ConfigT, CreateSettings], Any]
    """A receiver, exporter or extension (a ``Component``), or a processor (see
    ``pipeline.Pipeline``)."""


Factories = Sequence[Factory[Any]]


def find_factory(factories: Factories, kind: str, type_name: str) -> Factory[Any]:
    for factory in factories:
        if factory.kind == kind and factory.type == type_name:
            return factory
    raise ConfigError(f"no {kind} of type {type_name!r}")


def create_component(
    factories: Factories,
    component: ComponentConfig,
    *,
    telemetry: SelfTelemetry,
    collector_config: CollectorConfig,
    clock: Callable[[], float],
    wall_clock: Callable[[], float],
    consumer: TraceConsumer | None = None,
) -> Any:
    """What ``component``'s factory makes of its config (the service and the pipeline)."""
    settings = CreateSettings(
        id=component.id,
        kind=component.kind,
        telemetry=telemetry,
        collector_config=collector_config,
        clock=clock,
        wall_clock=wall_clock,
        consumer=consumer,
    )
    return find_factory(factories, component.kind, component.type).create(
        component.config, settings
    )


def factory_types(factories: Factories, kind: str) -> tuple[str, ...]:
    """The types of ``kind``, in the table's order (for processors: the order they run in)."""
    return tuple(factory.type for factory in factories if factory.kind == kind)
