"""The percentile store: latency sketches per key and metric, cumulative and over a sliding window.

One pipeline thread writes (``record``); exporter, API and CLI threads read. Readers take the
lock only long enough to copy what they need (the sketches the writer may still change; closed
time slices are never written again and are shared by reference) and do the merging outside it.

The sliding window is made of time slices aligned to multiples of ``slice_s`` since the epoch, so
the slices of several collector replicas line up. A window read at time ``t`` covers the slice
holding ``t`` and the ``slices - 1`` before it: between ``window_s - slice_s`` and ``window_s`` of
data. Closed slices also queue for ``drain_closed_slices`` so the collector can persist them.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final, NamedTuple

from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import (
    AGGREGATION_TEMPORALITY_CUMULATIVE,
    Metric,
)

from tokentrace.agent import semconv
from tokentrace.processors.model import RequestMetrics
from tokentrace.processors.sketches import (
    MAX_SCALE,
    MIN_SCALE,
    KeyedValues,
    LatencySketch,
    SketchKey,
)

_LOG = logging.getLogger(__name__)

_DEFAULT_WINDOW_S: Final = 60.0
_DEFAULT_SLICES: Final = 6
_DEFAULT_MAX_KEYS: Final = 1000
_DEFAULT_SCALE: Final = 6
"""Relative error ~0.54% (LatencySketch's default)."""
_DEFAULT_MAX_UNDRAINED_SLICES: Final = 30
"""Five minutes of 10 s slices waiting for ``drain_closed_slices``."""
_NS_PER_S: Final = 1e9

_DEFAULT_MAX_PENDING_VALUES: Final = 500_000
"""Values the open slice holds before its sketches take them in even without a reader (the
pipeline's tick reads it about once a second; this bounds the memory, ~20 MB, if it does not)."""
_SINGLE_VALUE_METRICS: Final = tuple(m for m in semconv.LATENCY_METRICS if m != semconv.METRIC_ITL)

SketchMatch = Callable[[SketchKey], bool]
_KeySketches = Mapping[SketchKey, Mapping[str, LatencySketch]]


@dataclass(frozen=True, slots=True, kw_only=True)
class PercentileConfig:
    window_s: float = _DEFAULT_WINDOW_S
    """Length of the sliding window."""
    slices: int = _DEFAULT_SLICES
    """Time slices the window is made of (the window advances by ``window_s / slices``)."""
    max_keys: int = _DEFAULT_MAX_KEYS
    """(service, model, operation, prompt bucket) keys kept; least recently used are evicted."""
    scale: int = _DEFAULT_SCALE
    """OTLP exponential-histogram scale of every sketch."""
    max_undrained_slices: int = _DEFAULT_MAX_UNDRAINED_SLICES
    """Closed slices held for ``drain_closed_slices``; the oldest are dropped beyond it (0: none
    are held)."""

    @property
    def slice_s(self) -> float:
        return self.window_s / self.slices

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""
        if not _is_real(self.window_s) or not math.isfinite(self.window_s) or self.window_s <= 0:
            raise ValueError(f"window_s must be a finite number > 0, got {self.window_s!r}")
        if not _is_int(self.slices) or self.slices < 1:
            raise ValueError(f"slices must be an int >= 1, got {self.slices!r}")
        if not _is_int(self.max_keys) or self.max_keys < 1:
            raise ValueError(f"max_keys must be an int >= 1, got {self.max_keys!r}")
        if not _is_int(self.scale) or not MIN_SCALE <= self.scale <= MAX_SCALE:
            raise ValueError(
                f"scale must be an int in [{MIN_SCALE}, {MAX_SCALE}], got {self.scale!r}"
            )
        if not _is_int(self.max_undrained_slices) or self.max_undrained_slices < 0:
            raise ValueError(
                f"max_undrained_slices must be an int >= 0, got {self.max_undrained_slices!r}"
            )


class ClosedSlice(NamedTuple):
    """One key's one metric over one closed time slice ``[slice_start_s, + slice_s)``."""

    slice_start_s: float
    key: SketchKey
    metric: str
    sketch: LatencySketch


@dataclass(slots=True)
class _Slice:
    index: int
    """Start time is ``index * slice_s``."""
    sketches: dict[SketchKey, dict[str, LatencySketch]] = field(default_factory=dict)
    pending: dict[SketchKey, dict[str, list[float]]] = field(default_factory=dict)
    """Values recorded since the sketches last took them in (``PercentileStore._settle``): each
    metric's seconds. Keyed in one batch per metric and key, not once per request."""
    pending_itl: dict[SketchKey, array[int]] = field(default_factory=dict)
    """The same for ITL: the inter-token gaps in ns, each request's array (``array('q')``,
    ``RequestMetrics.itl``) copied in whole."""
    pending_values: int = 0


@dataclass(slots=True)
class _KeyState:
    created_s: float
    """When this key's cumulative sketches started (the OTLP start time of its series)."""
    cumulative: dict[str, LatencySketch] = field(default_factory=dict)
    """The key's closed slices merged (``record`` writes only the open slice, which readers add)."""


class PercentileSnapshot:
    """An immutable view of the store at one instant; every query returns a new sketch."""

    __slots__ = (
        "_created_s",
        "_cumulative",
        "_keys",
        "_scale",
        "_slices",
        "keys_evicted",
        "taken_at_s",
    )

    def __init__(
        self,
        *,
        taken_at_s: float,
        scale: int,
        keys: tuple[SketchKey, ...],
        created_s: Mapping[SketchKey, float],
        cumulative: _KeySketches,
        slices: tuple[_KeySketches, ...],
        keys_evicted: int,
    ) -> None:
        self.taken_at_s = taken_at_s
        self.keys_evicted = keys_evicted
        self._scale = scale
        self._keys = keys
        self._created_s = MappingProxyType(dict(created_s))
        self._cumulative = MappingProxyType(dict(cumulative))
        self._slices = slices

    def keys(self) -> tuple[SketchKey, ...]:
        """Keys with cumulative data, least recently recorded first."""
        return self._keys

    def window(self, key: SketchKey | None = None, *, metric: str) -> LatencySketch:
        """``metric`` over the live window for ``key`` (None: all keys merged)."""
        _check_metric(metric)
        if key is None:
            return self.merged(metric)
        result = LatencySketch(scale=self._scale)
        for by_key in self._slices:
            sketch = by_key.get(key, {}).get(metric)
            if sketch is not None:
                result.merge(sketch)
        return result

    def cumulative(self, key: SketchKey, metric: str) -> LatencySketch:
        """``metric`` for ``key`` since the key was first recorded (empty if unknown)."""
        _check_metric(metric)
        result = LatencySketch(scale=self._scale)
        sketch = self._cumulative.get(key, {}).get(metric)
        if sketch is not None:
            result.merge(sketch)
        return result

    def merged(
        self, metric: str, match: SketchMatch | None = None, *, cumulative: bool = False
    ) -> LatencySketch:
        """``metric`` merged over every key ``match`` accepts (None: all keys), over the window
        or (``cumulative=True``) since each key was first recorded."""
        _check_metric(metric)
        result = LatencySketch(scale=self._scale)
        sources = (self._cumulative,) if cumulative else self._slices
        for by_key in sources:
            for key, by_metric in by_key.items():
                sketch = by_metric.get(metric)
                if sketch is not None and (match is None or match(key)):
                    result.merge(sketch)
        return result

    def to_otlp_metrics(self, *, start_time_unix_nano: int, time_unix_nano: int) -> list[Metric]:
        """One cumulative exponential-histogram Metric per latency metric that has data, with one
        data point per key. A key's start time is the later of ``start_time_unix_nano`` and
        the key's creation (a key evicted and seen again starts a new series)."""
        metrics: list[Metric] = []
        for metric in semconv.LATENCY_METRICS:
            otlp_metric: Metric | None = None
            for key in self._keys:
                sketch = self._cumulative.get(key, {}).get(metric)
                if sketch is None or not sketch.count:
                    continue
                if otlp_metric is None:
                    otlp_metric = Metric(
                        name=semconv.OTLP_METRIC_NAMES[metric], unit=semconv.METRIC_UNIT_SECONDS
                    )
                    otlp_metric.exponential_histogram.aggregation_temporality = (
                        AGGREGATION_TEMPORALITY_CUMULATIVE
                    )
                point = otlp_metric.exponential_histogram.data_points.add()
                created_ns = int(self._created_s.get(key, 0.0) * _NS_PER_S)
                # Never after the point's own time (OTLP requires start <= time).
                point.start_time_unix_nano = min(
                    max(start_time_unix_nano, created_ns), time_unix_nano
                )
                point.time_unix_nano = time_unix_nano
                point.attributes.extend(_key_attributes(key))
                sketch.to_otlp(point)
            if otlp_metric is not None:
                metrics.append(otlp_metric)
        return metrics


class PercentileStore:
    """Sketches per ``SketchKey`` and latency metric: cumulative, and per time slice.

    Bounded: at most ``max_keys`` keys (least recently recorded evicted, counted in
    ``keys_evicted``; an evicted key loses its cumulative sketches and its data in the open
    slice, closed slices age out), ``slices`` live slices, ``max_undrained_slices`` slices
    waiting to be drained (``slices_dropped``) and ``max_pending_values`` recorded values waiting
    for the open slice's sketches (taken in past it, without a reader). ``record`` never raises
    (``record_errors``).
    """

    def __init__(
        self,
        *,
        config: PercentileConfig | None = None,
        clock: Callable[[], float] = time.time,
        max_pending_values: int = _DEFAULT_MAX_PENDING_VALUES,
    ) -> None:
        if max_pending_values < 1:
            raise ValueError(f"max_pending_values must be >= 1, got {max_pending_values}")
        self.config = config if config is not None else PercentileConfig()
        self.config.validate()
        self._clock = clock
        self._slice_s = self.config.slice_s
        self._max_pending_values = max_pending_values
        self._lock = threading.Lock()
        self._keys: OrderedDict[SketchKey, _KeyState] = OrderedDict()
        self._open: _Slice | None = None
        self._closed: deque[_Slice] = deque()
        """Closed slices that may still be inside the window, oldest first."""
        self._undrained: deque[_Slice] = deque()
        self.keys_evicted = 0
        self.slices_dropped = 0
        """Closed slices discarded before ``drain_closed_slices`` took them."""
        self.record_errors = 0

    # --- writing (pipeline thread) ---------------------------------------------------------
    def record(self, key: SketchKey, metrics: RequestMetrics, *, skip: Container[str] = ()) -> None:
        """Add one request's latencies (ns) as seconds; None values are skipped, ITL adds
        every gap. ``skip``: metrics not to add (a re-derived request's, added before)."""
        try:
            singles = [
                (metric, value / _NS_PER_S)
                for metric in _SINGLE_VALUE_METRICS
                if metric not in skip and (value := getattr(metrics, metric)) is not None
            ]
            gaps = metrics.itl if semconv.METRIC_ITL not in skip else None
            if not singles and not gaps:
                return
            now = self._clock()
            with self._lock:
                self._advance(now)
                self._touch_key(key, now)
                current = self._open
                if current is None:
                    current = self._open = _Slice(self._slice_index(now))
                # Only the open slice is written, and only its pending lists: its sketches take
                # them in when it is read or closes (``_settle``), and the cumulative sketches
                # take in a whole slice when it closes (one merge per slice).
                pending = current.pending.get(key)
                if pending is None:
                    pending = current.pending[key] = {}
                for metric, value_s in singles:
                    values = pending.get(metric)
                    if values is None:
                        pending[metric] = [value_s]
                    else:
                        values.append(value_s)
                if gaps:
                    itl = current.pending_itl.get(key)
                    if itl is None:
                        current.pending_itl[key] = array("q", gaps)
                    else:
                        itl.extend(gaps)  # a memcpy from another array('q')
                current.pending_values += len(singles) + len(gaps or ())
                if current.pending_values > self._max_pending_values:  # no reader for a while
                    self._settle(current)
        except Exception:
            # The pipeline serves traffic: count, log the first, carry on.
            self.record_errors += 1
            if self.record_errors == 1:
                _LOG.exception("percentile store: recording a request failed")

    def _settle(self, slice_: _Slice | None) -> None:
        """Add ``slice_``'s pending values to its sketches (caller holds the lock): before the
        slice is read or closes. Keying a metric's values of a key in one batch costs about
        half of keying each request's inter-token gaps apart. Never raises (``record_errors``)."""
        if slice_ is None or not (slice_.pending or slice_.pending_itl):
            return
        scale = self.config.scale
        for key, by_metric in slice_.pending.items():
            in_slice = self._slice_sketches(slice_, key)
            for metric, values in by_metric.items():
                try:
                    self._sketch(in_slice, metric).add_many(values)
                except Exception:
                    self._count_record_error()
        for key, gaps_ns in slice_.pending_itl.items():
            try:
                sketch = self._sketch(self._slice_sketches(slice_, key), semconv.METRIC_ITL)
                sketch.add_keyed(KeyedValues.of_ns(gaps_ns, scale=scale))
            except Exception:
                self._count_record_error()
        slice_.pending.clear()
        slice_.pending_itl.clear()
        slice_.pending_values = 0

    def _count_record_error(self) -> None:
        self.record_errors += 1
        if self.record_errors == 1:
            _LOG.exception("percentile store: adding recorded values failed")

    @staticmethod
    def _slice_sketches(slice_: _Slice, key: SketchKey) -> dict[str, LatencySketch]:
        in_slice = slice_.sketches.get(key)
        if in_slice is None:
            in_slice = slice_.sketches[key] = {}
        return in_slice

    def _sketch(self, by_metric: dict[str, LatencySketch], metric: str) -> LatencySketch:
        sketch = by_metric.get(metric)
        if sketch is None:
            sketch = by_metric[metric] = LatencySketch(scale=self.config.scale)
        return sketch

    def _slice_index(self, now: float) -> int:
        return math.floor(now / self._slice_s)

    def _advance(self, now: float) -> None:
        """Close the open slice once ``now`` is past it; forget slices older than the window.
        Caller holds the lock. A clock that steps back keeps writing into the open slice."""
        index = self._slice_index(now)
        current = self._open
        if current is not None and index > current.index:
            self._open = None
            self._settle(current)
            if current.sketches:
                self._fold_into_cumulative(current)
                self._closed.append(current)
                if self.config.max_undrained_slices:
                    if len(self._undrained) >= self.config.max_undrained_slices:
                        self._undrained.popleft()
                        self.slices_dropped += 1
                    self._undrained.append(current)
        oldest_live = index - self.config.slices + 1
        while self._closed and self._closed[0].index < oldest_live:
            self._closed.popleft()

    def _fold_into_cumulative(self, closing: _Slice) -> None:
        """Merge a closing slice into the cumulative sketches of its keys. Caller holds the lock.

        Every key in the open slice is held: evicting a key drops its open-slice data too."""
        for key, by_metric in closing.sketches.items():
            state = self._keys.get(key)
            if state is not None:
                for metric, sketch in by_metric.items():
                    self._sketch(state.cumulative, metric).merge(sketch)

    def _touch_key(self, key: SketchKey, now: float) -> _KeyState:
        state = self._keys.get(key)
        if state is not None:
            self._keys.move_to_end(key)
            return state
        if len(self._keys) >= self.config.max_keys:
            evicted, _ = self._keys.popitem(last=False)
            self.keys_evicted += 1
            if self._open is not None:
                self._open.sketches.pop(evicted, None)
                self._open.pending.pop(evicted, None)
                self._open.pending_itl.pop(evicted, None)
        state = self._keys[key] = _KeyState(created_s=now)
        return state

    # --- reading (any thread) --------------------------------------------------------------
    def snapshot(self) -> PercentileSnapshot:
        """An immutable copy of everything (cumulative and live window)."""
        return self._capture(None)

    def keys(self) -> tuple[SketchKey, ...]:
        with self._lock:
            return tuple(self._keys)

    def window(self, key: SketchKey | None = None, *, metric: str) -> LatencySketch:
        """``metric`` merged over the live slices for ``key`` (None: all keys)."""
        _check_metric(metric)
        match = None if key is None else _equals(key)
        return self._capture(match, metric=metric, cumulative=False).window(key, metric=metric)

    def cumulative(self, key: SketchKey, metric: str) -> LatencySketch:
        _check_metric(metric)
        snapshot = self._capture(_equals(key), metric=metric, window=False)
        return snapshot.cumulative(key, metric)

    def merged(
        self, metric: str, match: SketchMatch | None = None, *, cumulative: bool = False
    ) -> LatencySketch:
        """``metric`` merged over the keys ``match`` accepts (window, or cumulative)."""
        _check_metric(metric)
        snapshot = self._capture(match, metric=metric, cumulative=cumulative, window=not cumulative)
        return snapshot.merged(metric, match, cumulative=cumulative)

    def to_otlp_metrics(self, *, start_time_unix_nano: int, time_unix_nano: int) -> list[Metric]:
        """The cumulative sketches as OTLP exponential-histogram metrics (see the snapshot's)."""
        return self._capture(None, window=False).to_otlp_metrics(
            start_time_unix_nano=start_time_unix_nano, time_unix_nano=time_unix_nano
        )

    def _capture(
        self,
        match: SketchMatch | None,
        *,
        metric: str | None = None,
        cumulative: bool = True,
        window: bool = True,
    ) -> PercentileSnapshot:
        """Copy, under the lock, what the writer may still change and what the query needs."""
        now = self._clock()
        with self._lock:
            self._advance(now)
            self._settle(self._open)
            keys = tuple(self._keys)
            wanted = keys if match is None else tuple(k for k in keys if match(k))
            created = {key: self._keys[key].created_s for key in wanted}
            cumulative_copies: dict[SketchKey, Mapping[str, LatencySketch]] = {}
            if cumulative:
                # A key's cumulative sketches hold its closed slices; its open slice adds the rest.
                open_sketches = self._open.sketches if self._open is not None else {}
                for key in wanted:
                    cumulative_copies[key] = _merged_copies(
                        self._keys[key].cumulative, open_sketches.get(key, {}), metric
                    )
            live: list[_KeySketches] = []
            if window:
                oldest_live = self._slice_index(now) - self.config.slices + 1
                # Closed slices are never written again: shared, not copied.
                live.extend(s.sketches for s in self._closed if s.index >= oldest_live)
                current = self._open
                if current is not None and current.index >= oldest_live:
                    live.append(
                        {
                            key: _copy_metrics(by_metric, metric)
                            for key, by_metric in current.sketches.items()
                            if match is None or match(key)
                        }
                    )
            keys_evicted = self.keys_evicted
        return PercentileSnapshot(
            taken_at_s=now,
            scale=self.config.scale,
            keys=wanted,
            created_s=created,
            cumulative=cumulative_copies,
            slices=tuple(live),
            keys_evicted=keys_evicted,
        )

    # --- persistence -----------------------------------------------------------------------
    def drain_closed_slices(self) -> list[ClosedSlice]:
        """Closed slices not drained before, oldest first (each sketch a copy)."""
        now = self._clock()
        with self._lock:
            self._advance(now)
            drained = list(self._undrained)
            self._undrained.clear()
        return self._flatten(drained)

    def open_slice(self) -> list[ClosedSlice]:
        """The slice being written now (copies), for live readers; it changes until it closes."""
        now = self._clock()
        with self._lock:
            self._advance(now)
            current = self._open
            if current is None:
                return []
            self._settle(current)
            start_s = current.index * self._slice_s
            return [
                ClosedSlice(start_s, key, metric, sketch.copy())
                for key, by_metric in current.sketches.items()
                for metric, sketch in by_metric.items()
            ]

    def slices_since(self, t_s: float) -> list[ClosedSlice]:
        """Closed slices still held (in the window or waiting to be drained) that start at or
        after ``t_s``, oldest first; drains nothing."""
        now = self._clock()
        with self._lock:
            self._advance(now)
            held = {id(s): s for s in (*self._undrained, *self._closed)}
        chosen = sorted(
            (s for s in held.values() if s.index * self._slice_s >= t_s), key=lambda s: s.index
        )
        return self._flatten(chosen)

    def _flatten(self, slices: Iterable[_Slice]) -> list[ClosedSlice]:
        # Outside the lock: closed slices are immutable; copies keep them so for callers.
        return [
            ClosedSlice(s.index * self._slice_s, key, metric, sketch.copy())
            for s in slices
            for key, by_metric in s.sketches.items()
            for metric, sketch in by_metric.items()
        ]


def _copy_metrics(
    by_metric: Mapping[str, LatencySketch], metric: str | None
) -> Mapping[str, LatencySketch]:
    if metric is None:
        return MappingProxyType({m: sketch.copy() for m, sketch in by_metric.items()})
    sketch = by_metric.get(metric)
    return MappingProxyType({} if sketch is None else {metric: sketch.copy()})


def _merged_copies(
    first: Mapping[str, LatencySketch], second: Mapping[str, LatencySketch], metric: str | None
) -> Mapping[str, LatencySketch]:
    """Per metric (all, or just ``metric``), a new sketch holding both mappings' sketches."""
    merged: dict[str, LatencySketch] = {}
    for name in (metric,) if metric is not None else (*first, *second):
        if name in merged:
            continue
        sketches = [s for s in (first.get(name), second.get(name)) if s is not None]
        if sketches:
            result = merged[name] = sketches[0].copy()
            for sketch in sketches[1:]:
                result.merge(sketch)
    return MappingProxyType(merged)


def _equals(wanted: SketchKey) -> SketchMatch:
    return lambda key: key == wanted


def _check_metric(metric: str) -> None:
    if metric not in semconv.LATENCY_METRICS:
        raise ValueError(f"unknown latency metric {metric!r}; one of {semconv.LATENCY_METRICS}")


def _key_attributes(key: SketchKey) -> list[KeyValue]:
    return [
        KeyValue(key=semconv.METRIC_ATTR_SERVICE, value=AnyValue(string_value=key.service)),
        KeyValue(key=semconv.METRIC_ATTR_MODEL, value=AnyValue(string_value=key.model)),
        KeyValue(key=semconv.METRIC_ATTR_OPERATION, value=AnyValue(string_value=key.operation)),
        KeyValue(
            key=semconv.METRIC_ATTR_PROMPT_BUCKET, value=AnyValue(string_value=key.prompt_bucket)
        ),
    ]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
