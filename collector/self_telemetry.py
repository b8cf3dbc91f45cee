"""The collector's self-telemetry: one registry of counters, gauges and histograms.

Every component reports what it did here, through a view of the registry that carries its id and
kind (``registry.component("otlp/tempo", KIND_EXPORTER)``):

- ``counter(name)`` -> ``Counter.add(n)``: cheap and thread-safe (an int behind its own lock);
- ``keyed_counter(name, key_kind=...)`` -> ``KeyedCounter.add(key)``: one count per component the
  counting one acts for (the pipeline counts ``processor_errors`` per processor);
- ``gauge(name, callback)``: observed when collected;
- ``histogram(name, bounds)`` -> ``Histogram.record(value)``: explicit buckets;
- ``observe(source, counters=..., gauges=...)``: for a component that already keeps its own
  counters as a ``stats()`` dict (the receivers shared with the node agent, the OTLP senders,
  the store sink): ``source()`` returns them by key, read once per collection;
- ``observe_each(counters={name: (description, read)}, gauges=...)``: for counters a component
  keeps as attributes (the assembler, the percentile store): each metric named once, with the
  callable that reads it.

Every name comes from ``semconv`` (``SELF_METRIC_*``); a source's keys are the names without
``SELF_METRIC_PREFIX``. Two readers:

- ``snapshot()``: the flat dict the store keeps for ``tokentrace top`` and the API's fleet view,
  in the shape those readers have always read: ``received_spans``, ``requests``, ...,
  ``processor_errors: {id: n}``, and ``<prefix><key>`` for a component registered with a
  snapshot prefix (``OtlpGrpcReceiver.accepted_spans``, ``StoreSink.written_requests``). Series
  with the same key are summed (two ``otlp`` exporters). Histograms are left out (OTLP only).
- ``to_otlp_metrics()``: cumulative monotonic Sums for counters, Gauges, explicit-bucket
  Histograms, each data point attributed with the component's id and kind.
- ``readings()``: every series' value with its name, instrument, unit and attributes (one per
  key for keyed counters), for other encodings: the admin extension's Prometheus ``/metrics``
  (``collector/admin.py``) reads it at each scrape, so nothing is counted twice.

The registry's lock guards only its list of series: a collection copies the list under it, then
reads each value (under the instrument's own lock) and encodes after releasing it. Memory is
bounded: at most ``max_series`` series and ``max_keys`` keys per keyed counter; what is beyond is
not reported (logged once; ``dropped_series`` counts the series).
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import (
    AGGREGATION_TEMPORALITY_CUMULATIVE,
    HistogramDataPoint,
    Metric,
    NumberDataPoint,
)

from tokentrace.agent import semconv

_log = logging.getLogger(__name__)

_DEFAULT_MAX_SERIES: Final = 1_000
_DEFAULT_MAX_KEYS: Final = 100
UNIT_COUNT: Final = "1"

_SUM: Final = "sum"
_GAUGE: Final = "gauge"
_HISTOGRAM: Final = "histogram"
_KEYED_SUM: Final = "keyed_sum"
"""A sum read as ``{key: count}``: one data point per key."""


def metric_key(name: str) -> str:
    """A self-telemetry metric's key in the snapshot and in observed sources: the name without
    ``SELF_METRIC_PREFIX``."""
    return name.removeprefix(semconv.SELF_METRIC_PREFIX)


class Counter:
    """A monotonic count; ``add`` may be called from any thread."""

    __slots__ = ("_lock", "_value")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0

    def add(self, amount: int = 1) -> None:
        with self._lock:
            self._value += amount

    @property
    def value(self) -> int:
        with self._lock:
            return self._value


class KeyedCounter:
    """One monotonic count per key, at most ``max_keys`` keys (others are not counted)."""

    __slots__ = ("_lock", "_max_keys", "_refused", "_values")

    def __init__(self, *, max_keys: int) -> None:
        self._lock = threading.Lock()
        self._max_keys = max_keys
        self._values: dict[str, int] = {}
        self._refused = False

    def add(self, key: str, amount: int = 1) -> None:
        with self._lock:
            if key in self._values or len(self._values) < self._max_keys:
                self._values[key] = self._values.get(key, 0) + amount
                return
            refused_before, self._refused = self._refused, True
        if not refused_before:
            _log.warning(
                "self-telemetry: more than %d keys, %r is not counted", self._max_keys, key
            )

    def values(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


@dataclass(frozen=True, slots=True)
class HistogramState:
    """A histogram's values at one instant (``bucket_counts`` has ``len(bounds) + 1`` entries:
    bucket ``i`` counts values in ``(bounds[i-1], bounds[i]]``, the last one those above)."""

    bounds: tuple[float, ...]
    bucket_counts: tuple[int, ...]
    count: int
    sum: float
    min: float
    max: float


class Histogram:
    """Explicit-bucket histogram; ``record`` may be called from any thread."""

    __slots__ = ("_bounds", "_counts", "_lock", "_max", "_min", "_sum")

    def __init__(self, bounds: Iterable[float]) -> None:
        self._bounds = tuple(float(bound) for bound in bounds)
        if list(self._bounds) != sorted(set(self._bounds)):
            raise ValueError(f"histogram bounds must be strictly increasing, got {self._bounds}")
        self._lock = threading.Lock()
        self._counts = [0] * (len(self._bounds) + 1)
        self._sum = 0.0
        self._min = math.inf
        self._max = -math.inf

    def record(self, value: float) -> None:
        index = bisect.bisect_left(self._bounds, value)
        with self._lock:
            self._counts[index] += 1
            self._sum += value
            self._min = min(self._min, value)
            self._max = max(self._max, value)

    def state(self) -> HistogramState:
        with self._lock:
            return HistogramState(
                self._bounds,
                tuple(self._counts),
                sum(self._counts),
                self._sum,
                self._min,
                self._max,
            )


INSTRUMENT_COUNTER: Final = "counter"
INSTRUMENT_GAUGE: Final = "gauge"
INSTRUMENT_HISTOGRAM: Final = "histogram"


@dataclass(frozen=True, slots=True)
class Reading:
    """One series' value at a collection (``SelfTelemetry.readings``)."""

    name: str
    instrument: str
    """``INSTRUMENT_COUNTER`` (keyed counters too), ``INSTRUMENT_GAUGE`` or
    ``INSTRUMENT_HISTOGRAM``."""
    description: str
    unit: str
    attributes: tuple[tuple[str, str], ...]
    """The component's id and kind (for a keyed counter: the key's), then its own attributes."""
    value: float | HistogramState


@dataclass(frozen=True, slots=True)
class _Component:
    id: str
    kind: str
    snapshot_prefix: str
    attributes: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class _Series:
    name: str
    instrument: str
    description: str
    unit: str
    component: _Component
    key_kind: str = ""
    """Keyed sums: the kind of the components the keys name."""

    @property
    def key(self) -> str:
        return metric_key(self.name)


@dataclass(frozen=True, slots=True)
class _Source:
    read: Callable[[], Mapping[str, Any]]
    """Values by series key, read once per collection."""
    series: tuple[_Series, ...]


class SelfTelemetry:
    """The registry (one per collector); see the module docstring."""

    def __init__(
        self, *, max_series: int = _DEFAULT_MAX_SERIES, max_keys: int = _DEFAULT_MAX_KEYS
    ) -> None:
        self._lock = threading.Lock()
        self._sources: list[_Source] = []
        self._series: dict[tuple[str, str, str, tuple[tuple[str, str], ...]], _Series] = {}
        self._instruments: dict[str, tuple[str, str]] = {}
        self._max_series = max_series
        self.max_keys = max_keys
        self.dropped_series = 0
        """Series not registered because ``max_series`` was reached."""

    def component(
        self,
        component_id: str,
        kind: str,
        *,
        snapshot_prefix: str = "",
        attributes: Mapping[str, str] | None = None,
    ) -> ComponentTelemetry:
        """The view a component registers through. ``snapshot_prefix``: what its keys carry in
        the snapshot (``StoreSink.``); ``attributes``: added to each of its data points."""
        return ComponentTelemetry(
            self,
            _Component(
                component_id, kind, snapshot_prefix, tuple(sorted((attributes or {}).items()))
            ),
        )

    def _register(self, source: _Source) -> bool:
        with self._lock:
            for series in source.series:
                _check_series(series, self._instruments, self._series)
            if len(self._series) + len(source.series) > self._max_series:
                if not self.dropped_series:
                    _log.warning(
                        "self-telemetry: %d series registered, further ones are not reported",
                        len(self._series),
                    )
                self.dropped_series += len(source.series)
                return False
            for series in source.series:
                self._instruments[series.name] = (series.instrument, series.unit)
                self._series[_identity(series)] = series
            self._sources.append(source)
        return True

    def _readings(self) -> list[tuple[_Series, Any]]:
        with self._lock:
            sources = list(self._sources)
        readings: list[tuple[_Series, Any]] = []
        for source in sources:
            try:
                values = source.read()
            except Exception:  # one broken source must not hide the others
                _log.warning("self-telemetry: a source failed to report", exc_info=True)
                continue
            for series in source.series:
                value = values.get(series.key)
                if value is not None:
                    readings.append((series, value))
        return readings

    def snapshot(self) -> dict[str, Any]:
        """Counters, keyed counters and gauges as one flat dict (module docstring)."""
        snapshot: dict[str, Any] = {}
        for series, value in self._readings():
            if series.instrument == _HISTOGRAM:
                continue
            if series.instrument == _KEYED_SUM:
                group = snapshot.setdefault(series.key, {})
                for key, count in value.items():
                    group[key] = group.get(key, 0) + count
                continue
            key = series.component.snapshot_prefix + series.key
            snapshot[key] = snapshot.get(key, 0) + value
        return snapshot

    def readings(self) -> list[Reading]:
        """Every series' current value (module docstring), in registration order."""
        instruments = {
            _SUM: INSTRUMENT_COUNTER,
            _KEYED_SUM: INSTRUMENT_COUNTER,
            _GAUGE: INSTRUMENT_GAUGE,
            _HISTOGRAM: INSTRUMENT_HISTOGRAM,
        }
        readings: list[Reading] = []
        for series, value in self._readings():
            instrument = instruments[series.instrument]
            component = series.component
            if series.instrument == _KEYED_SUM:
                for key, count in sorted(value.items()):
                    attributes = (
                        (semconv.SELF_ATTR_COMPONENT_ID, key),
                        (semconv.SELF_ATTR_COMPONENT_KIND, series.key_kind),
                    )
                    readings.append(
                        Reading(
                            series.name,
                            instrument,
                            series.description,
                            series.unit,
                            attributes,
                            count,
                        )
                    )
                continue
            own = (
                (semconv.SELF_ATTR_COMPONENT_ID, component.id),
                (semconv.SELF_ATTR_COMPONENT_KIND, component.kind),
                *component.attributes,
            )
            readings.append(
                Reading(series.name, instrument, series.description, series.unit, own, value)
            )
        return readings

    def to_otlp_metrics(self, *, start_time_unix_nano: int, time_unix_nano: int) -> list[Metric]:
        """Every series as OTLP: one Metric per name, one data point per series (per key for
        keyed counters). Cumulative sums and histograms start at ``start_time_unix_nano``."""
        metrics: dict[str, Metric] = {}
        for series, value in self._readings():
            metric = metrics.get(series.name)
            if metric is None:
                metric = metrics[series.name] = _new_metric(series)
            attributes = _attributes(series.component)
            points: list[Any]
            if series.instrument == _HISTOGRAM:
                points = [_histogram_point(metric.histogram.data_points.add(), value, attributes)]
            elif series.instrument == _KEYED_SUM:
                points = [
                    _number_point(
                        metric.sum.data_points.add(), count, _keyed_attributes(key, series.key_kind)
                    )
                    for key, count in sorted(value.items())
                ]
            else:
                container = metric.gauge if series.instrument == _GAUGE else metric.sum
                points = [_number_point(container.data_points.add(), value, attributes)]
            for point in points:
                if series.instrument != _GAUGE:
                    point.start_time_unix_nano = start_time_unix_nano
                point.time_unix_nano = time_unix_nano
        return list(metrics.values())


class ComponentTelemetry:
    """One component's view of the registry: what it registers carries the component's id and
    kind. Registering a name twice for one component raises ValueError."""

    __slots__ = ("_component", "_registry")

    def __init__(self, registry: SelfTelemetry, component: _Component) -> None:
        self._registry = registry
        self._component = component

    def part(
        self, *, snapshot_prefix: str, attributes: Mapping[str, str] | None = None
    ) -> ComponentTelemetry:
        """A view of one part of the same component (an exporter's signal): its snapshot keys
        add ``snapshot_prefix`` after the component's, its data points add ``attributes``."""
        component = self._component
        merged = {**dict(component.attributes), **(attributes or {})}
        return ComponentTelemetry(
            self._registry,
            _Component(
                component.id,
                component.kind,
                component.snapshot_prefix + snapshot_prefix,
                tuple(sorted(merged.items())),
            ),
        )

    def counter(self, name: str, *, description: str, unit: str = UNIT_COUNT) -> Counter:
        counter = Counter()
        series = self._series(name, _SUM, description, unit)
        self._registry._register(_Source(lambda: {series.key: counter.value}, (series,)))
        return counter

    def keyed_counter(
        self, name: str, *, key_kind: str, description: str, unit: str = UNIT_COUNT
    ) -> KeyedCounter:
        """Counts per key: each key is the id of a component of ``key_kind`` (the data point's
        id and kind are the key's, not this component's)."""
        counter = KeyedCounter(max_keys=self._registry.max_keys)
        series = self._series(name, _KEYED_SUM, description, unit, key_kind=key_kind)
        self._registry._register(_Source(lambda: {series.key: counter.values()}, (series,)))
        return counter

    def gauge(
        self,
        name: str,
        callback: Callable[[], float],
        *,
        description: str,
        unit: str = UNIT_COUNT,
    ) -> None:
        series = self._series(name, _GAUGE, description, unit)
        self._registry._register(_Source(lambda: {series.key: callback()}, (series,)))

    def histogram(
        self, name: str, bounds: Iterable[float], *, description: str, unit: str
    ) -> Histogram:
        histogram = Histogram(bounds)
        series = self._series(name, _HISTOGRAM, description, unit)
        self._registry._register(_Source(lambda: {series.key: histogram.state()}, (series,)))
        return histogram

    def observe(
        self,
        source: Callable[[], Mapping[str, float]],
        *,
        counters: Mapping[str, str],
        gauges: Mapping[str, str] = MappingProxyType({}),
        unit: str = UNIT_COUNT,
    ) -> None:
        """Counters (cumulative) and gauges a component keeps itself: ``counters`` and ``gauges``
        map metric names to descriptions; ``source()`` returns the values by ``metric_key``."""
        series = tuple(
            self._series(name, instrument, description, unit)
            for instrument, described in ((_SUM, counters), (_GAUGE, gauges))
            for name, description in described.items()
        )
        self._registry._register(_Source(source, series))

    def observe_each(
        self,
        *,
        counters: Mapping[str, tuple[str, Callable[[], float]]],
        gauges: Mapping[str, tuple[str, Callable[[], float]]] = MappingProxyType({}),
        unit: str = UNIT_COUNT,
    ) -> None:
        """``observe`` for values read one by one: each metric named once, mapped to its
        description and the callable that reads it (at collection)."""
        readers = {
            metric_key(name): read
            for described in (counters, gauges)
            for name, (_, read) in described.items()
        }
        self.observe(
            lambda: {key: read() for key, read in readers.items()},
            counters={name: description for name, (description, _) in counters.items()},
            gauges={name: description for name, (description, _) in gauges.items()},
            unit=unit,
        )

    def _series(
        self, name: str, instrument: str, description: str, unit: str, *, key_kind: str = ""
    ) -> _Series:
        if not name.startswith(semconv.SELF_METRIC_PREFIX):
            raise ValueError(
                f"self-telemetry metric {name!r} must start with {semconv.SELF_METRIC_PREFIX!r}"
            )
        return _Series(name, instrument, description, unit, self._component, key_kind)


def _identity(series: _Series) -> tuple[str, str, str, tuple[tuple[str, str], ...]]:
    component = series.component
    return (series.name, component.id, component.kind, component.attributes)


def _check_series(
    series: _Series,
    instruments: Mapping[str, tuple[str, str]],
    registered: Mapping[tuple[str, str, str, tuple[tuple[str, str], ...]], _Series],
) -> None:
    known = instruments.get(series.name)
    if known is not None and known != (series.instrument, series.unit):
        raise ValueError(
            f"{series.name} is registered as a {known[0]} in {known[1]!r}, "
            f"not a {series.instrument} in {series.unit!r}"
        )
    if _identity(series) in registered:
        raise ValueError(f"{series.name} is already registered for {series.component.id}")


def _new_metric(series: _Series) -> Metric:
    metric = Metric(name=series.name, description=series.description, unit=series.unit)
    if series.instrument in (_SUM, _KEYED_SUM):
        metric.sum.is_monotonic = True
        metric.sum.aggregation_temporality = AGGREGATION_TEMPORALITY_CUMULATIVE
    elif series.instrument == _GAUGE:
        metric.gauge.SetInParent()
    else:
        metric.histogram.aggregation_temporality = AGGREGATION_TEMPORALITY_CUMULATIVE
    return metric


def _number_point(
    point: NumberDataPoint, value: float, attributes: list[KeyValue]
) -> NumberDataPoint:
    if isinstance(value, int):
        point.as_int = value
    else:
        point.as_double = float(value)
    point.attributes.extend(attributes)
    return point


def _histogram_point(
    point: HistogramDataPoint, state: HistogramState, attributes: list[KeyValue]
) -> HistogramDataPoint:
    point.count = state.count
    point.sum = state.sum
    point.bucket_counts.extend(state.bucket_counts)
    point.explicit_bounds.extend(state.bounds)
    if state.count:
        point.min = state.min
        point.max = state.max
    point.attributes.extend(attributes)
    return point


def _string_attribute(key: str, value: str) -> KeyValue:
    return KeyValue(key=key, value=AnyValue(string_value=value))


def _attributes(component: _Component) -> list[KeyValue]:
    return [
        _string_attribute(semconv.SELF_ATTR_COMPONENT_ID, component.id),
        _string_attribute(semconv.SELF_ATTR_COMPONENT_KIND, component.kind),
        *(_string_attribute(key, value) for key, value in component.attributes),
    ]


def _keyed_attributes(key: str, key_kind: str) -> list[KeyValue]:
    return [
        _string_attribute(semconv.SELF_ATTR_COMPONENT_ID, key),
        _string_attribute(semconv.SELF_ATTR_COMPONENT_KIND, key_kind),
    ]
