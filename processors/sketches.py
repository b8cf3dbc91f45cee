"""Mergeable relative-error quantile sketches, laid out as OTLP exponential histograms.

``LatencySketch`` is a DDSketch (the maintained ``ddsketch`` library: its store, merge and
quantile code) whose logarithmic buckets are exactly the buckets of an OTLP exponential histogram:

- OTLP scale ``s`` has base ``b = 2 ** (2 ** -s)``; bucket index ``i`` covers ``(b**i, b**(i+1)]``.
- A DDSketch ``LogarithmicMapping`` with relative accuracy ``a`` has ``gamma = (1 + a) / (1 - a)``
  and maps ``v`` to key ``k = ceil(log_gamma(v))``, i.e. key ``k`` covers
  ``(gamma**(k-1), gamma**k]``. With ``a = (b - 1) / (b + 1)``, ``gamma == b`` (bit-exact for
  every supported scale) and DDSketch key ``k`` is OTLP index ``k - 1``.
- ddsketch computes ``log_gamma(v)`` as ``log(v, 2) * ln(2) / log1p(gamma - 1)``; that multiplier
  rounds to ``63.9999999999999`` instead of 64 at scale 6, which puts values just above a bucket
  boundary into the bucket below. The mapping here keeps ddsketch's class but computes
  ``log2(v) * 2**s`` (multiplying by a power of two is exact): the key is then the OTLP spec's
  logarithm method (index ``ceil(log2(v) * 2**s) - 1``), exact at powers of two and, like the
  spec's reference code, possibly one bucket low within float rounding of other boundaries.
  ``add`` and ``add_many`` use the same formula, so they always agree.

Batches: ``KeyedValues.of``/``of_ns`` compute a batch's keys once (vectorised with numpy for
large batches and corrected to the scalar formula near bucket boundaries, so both paths give the
same keys) and ``add_keyed`` adds the result to any number of sketches of the same scale; the
percentile store keys each request's inter-token gaps that way, outside its lock.

Merging sketches of the same scale adds bucket counts, so it is exact and associative: merging
shards gives the same buckets as sketching the union, and a metrics backend merging the exported
histograms of several collector replicas gets the same answer as one replica would.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Sequence
from functools import cache
from typing import Any, Final, NamedTuple

import numpy as np
import numpy.typing as npt
from ddsketch.ddsketch import BaseDDSketch
from ddsketch.mapping import LogarithmicMapping
from ddsketch.store import CollapsingLowestDenseStore, DenseStore
from opentelemetry.proto.metrics.v1.metrics_pb2 import ExponentialHistogramDataPoint

from tokentrace.processors import native

MIN_SCALE: Final = 0
"""Coarsest supported scale: base 2, relative error 1/3."""
MAX_SCALE: Final = 12
"""Finest supported scale: relative error ~0.0085%; finer scales need too many buckets."""
_DEFAULT_SCALE: Final = 6
"""Base 2**(1/64): relative error ~0.54%, 64 buckets per doubling."""
_DEFAULT_MAX_BUCKETS: Final = 4096
"""At scale 6 this spans 64 doublings (1 ns to ~585 years), so durations measured in ns never
reach it; beyond it the lowest buckets are collapsed (low quantiles lose accuracy first, the
tail that latency targets care about keeps it). ``collapsed`` says when that happened."""

_INF: Final = math.inf
_SMALL_BATCH: Final = 8
"""Below this many values ``add_many``'s per-call setup costs more than it saves."""
_NUMPY_MIN_BATCH: Final = 192
"""From about this many values numpy's fixed cost (~10 µs a batch) pays off against one
``math.log2`` per value, keying and adding to a sketch included (fewer, counted keys)."""
_BOUNDARY_TOLERANCE: Final = 1e-6
"""``np.log2`` and ``math.log2`` may differ in the last ulp or two; an ulp of
``log2(v) * 2**scale`` is at most ~1e-9 (``|log2 v| < 1075``, scale <= 12). A numpy-computed
value closer than this to an integer could round to another key, so such values take the scalar
formula; all others get the same key either way."""
_EXACT_FLOAT_INTS: Final = 2**53
"""Integers below this convert to float exactly, whichever way they are converted."""
_NS_PER_S: Final = 1e9
_MAX_COUNTING_WIDTH: Final = 1 << 16
"""Key ranges up to this wide are counted with ``np.bincount``; wider ones with ``np.unique``."""


@cache
def _mapping_for(scale: int) -> _OtlpLogarithmicMapping:
    # Mappings are immutable after construction: one per scale, shared by every sketch.
    return _OtlpLogarithmicMapping(scale)


class _OtlpLogarithmicMapping(LogarithmicMapping):
    """ddsketch's logarithmic mapping with ``gamma`` equal to the OTLP base of ``scale``."""

    def __init__(self, scale: int) -> None:
        base = 2.0 ** (2.0**-scale)
        super().__init__((base - 1.0) / (base + 1.0))
        self.scale = scale
        self.gamma = base  # already equal (checked by the tests); stated so it cannot drift
        self.index_multiplier = float(2**scale)
        """``log_base(v) == log2(v) * 2**scale``; a power of two, so the product is exact."""

    def _log_gamma(self, value: float) -> float:
        return math.log2(value) * self.index_multiplier

    def _pow_gamma(self, value: float) -> float:
        return math.pow(2.0, value / self.index_multiplier)


def _check_scale(scale: object) -> int:
    if isinstance(scale, bool) or not isinstance(scale, int):
        raise ValueError(f"scale must be an int, got {scale!r}")
    if not MIN_SCALE <= scale <= MAX_SCALE:
        raise ValueError(f"scale must be in [{MIN_SCALE}, {MAX_SCALE}], got {scale}")
    return scale


def _as_list(values_s: Iterable[float]) -> list[float]:
    tolist = getattr(values_s, "tolist", None)  # numpy arrays: plain floats are faster
    values: list[float] = tolist() if callable(tolist) else list(values_s)
    return values


class KeyedValues:
    """A batch of values reduced once to what a sketch records, for adding to several sketches.

    ``KeyedValues.of(values, scale=...)`` computes every key once; ``LatencySketch.add_keyed``
    adds the batch to a sketch of that scale with the buckets, count, min, max and ``dropped``
    that ``add`` per value would give (the sum is added as one total, so its last bits may
    differ). ``keys`` are the keys of the positive values, each once, or distinct and ascending
    with ``counts``. Immutable after construction.
    """

    __slots__ = (
        "counts",
        "dropped",
        "highest",
        "keys",
        "lowest",
        "positives",
        "scale",
        "total",
        "zeros",
    )

    def __init__(
        self,
        *,
        scale: int,
        keys: list[int],
        counts: list[int] | None,
        zeros: int,
        dropped: int,
        total: float,
        lowest: float,
        highest: float,
    ) -> None:
        self.scale = scale
        self.keys = keys
        self.counts = counts
        self.positives = len(keys) if counts is None else sum(counts)
        self.zeros = zeros
        """Values recorded in the zero bucket (zero, negative, or below the smallest normal)."""
        self.dropped = dropped
        """NaN and infinite values, not recorded."""
        self.total = total
        self.lowest = lowest
        """Minimum recorded value (inf when none)."""
        self.highest = highest
        """Maximum recorded value (-inf when none)."""

    @property
    def count(self) -> int:
        """Values the batch records (``dropped`` ones excluded)."""
        return self.positives + self.zeros

    @classmethod
    def of(cls, values_s: Iterable[float], *, scale: int = _DEFAULT_SCALE) -> KeyedValues:
        """Key a batch of values in seconds (list, iterable or numpy array) at ``scale``."""
        mapping = _mapping_for(_check_scale(scale))
        values = _as_list(values_s)
        if not values:
            return cls(
                scale=scale,
                keys=[],
                counts=None,
                zeros=0,
                dropped=0,
                total=0.0,
                lowest=_INF,
                highest=-_INF,
            )
        total = sum(values)  # NaN or an infinity makes it non-finite: checked path
        lowest = min(values)
        if not (math.isfinite(total) and lowest > mapping.min_possible):
            return cls._of_checked(values, scale, mapping)
        multiplier = mapping.index_multiplier
        counts: list[int] | None = None
        if len(values) >= _NUMPY_MIN_BATCH:
            seconds = np.asarray(values, dtype=np.float64)
            keys, counts = _count_keys_vectorised(seconds, multiplier)
        else:
            log2, ceil = math.log2, math.ceil
            keys = [ceil(log2(value) * multiplier) for value in values]
        return cls(
            scale=scale,
            keys=keys,
            counts=counts,
            zeros=0,
            dropped=0,
            total=total,
            lowest=lowest,
            highest=max(values),
        )

    @classmethod
    def of_ns(cls, durations_ns: Sequence[int], *, scale: int = _DEFAULT_SCALE) -> KeyedValues:
        """Key integer ns durations as seconds: the keys, count, min and max of
        ``of([ns / 1e9 for ns in durations_ns])`` (the sum is the exact total over 1e9),
        without building the list of seconds first."""
        mapping = _mapping_for(_check_scale(scale))
        multiplier = mapping.index_multiplier
        counts: list[int] | None
        counted = native.count_keys_ns(durations_ns, multiplier)  # in C, one pass, when built
        if counted is not None:
            keys, counts, lowest, highest, total = counted
        else:
            lowest = min(durations_ns, default=0)
            if lowest <= 0:  # empty, or values for the zero bucket: the general path
                return cls.of([ns / _NS_PER_S for ns in durations_ns], scale=scale)
            highest = max(durations_ns)
            total = sum(durations_ns)
            counts = None
            if len(durations_ns) >= _NUMPY_MIN_BATCH and highest < _EXACT_FLOAT_INTS:
                seconds = np.asarray(durations_ns, dtype=np.float64)
                seconds /= _NS_PER_S  # the same IEEE division as ns / 1e9 in Python
                keys, counts = _count_keys_vectorised(seconds, multiplier)
            else:
                log2, ceil = math.log2, math.ceil
                keys = [ceil(log2(ns / _NS_PER_S) * multiplier) for ns in durations_ns]
        return cls(
            scale=scale,
            keys=keys,
            counts=counts,
            zeros=0,
            dropped=0,
            total=total / _NS_PER_S,
            lowest=lowest / _NS_PER_S,  # dividing by 1e9 keeps the order
            highest=highest / _NS_PER_S,
        )

    @classmethod
    def _of_checked(
        cls, values: list[float], scale: int, mapping: _OtlpLogarithmicMapping
    ) -> KeyedValues:
        # Slow path for batches holding zeros, negatives, NaN, infinities or huge sums; the
        # same decisions as LatencySketch.add, value by value.
        min_positive, multiplier = mapping.min_possible, mapping.index_multiplier
        keys: list[int] = []
        zeros = dropped = 0
        total, lowest, highest = 0.0, _INF, -_INF
        for value in values:
            if value > min_positive:
                if value == _INF:
                    dropped += 1
                    continue
                keys.append(math.ceil(math.log2(value) * multiplier))
                total += value
            elif value <= min_positive:
                zeros += 1
                value = 0.0
            else:  # NaN compares false both ways
                dropped += 1
                continue
            lowest = min(lowest, value)
            highest = max(highest, value)
        return cls(
            scale=scale,
            keys=keys,
            counts=None,
            zeros=zeros,
            dropped=dropped,
            total=total,
            lowest=lowest,
            highest=highest,
        )


def _count_keys_vectorised(
    seconds: npt.NDArray[np.float64], multiplier: float
) -> tuple[list[int], list[int]]:
    """Distinct keys (ascending) of positive finite values and their counts, the same keys as
    ``ceil(math.log2(v) * multiplier)`` per value."""
    scaled = np.log2(seconds)
    scaled *= multiplier
    ceiled = np.ceil(scaled)
    keys = ceiled.astype(np.int64)
    # ceiled - scaled is in [0, 1): near 0 or 1 means near an integer, where the last-ulp
    # difference between np.log2 and math.log2 could change the key.
    distance_from_middle = np.abs(ceiled - scaled - 0.5)
    for index in np.flatnonzero(distance_from_middle > 0.5 - _BOUNDARY_TOLERANCE).tolist():
        keys[index] = math.ceil(math.log2(float(seconds[index])) * multiplier)
    low, high = int(keys.min()), int(keys.max())
    if high - low < _MAX_COUNTING_WIDTH:
        counts = np.bincount(keys - low)
        present = np.flatnonzero(counts)
        return (present + low).tolist(), counts[present].tolist()
    distinct, distinct_counts = np.unique(keys, return_counts=True)
    return distinct.tolist(), distinct_counts.tolist()


class _BucketedDDSketch(BaseDDSketch):
    """A DDSketch for non-negative values with bulk updates by precomputed key."""

    def __init__(self, mapping: _OtlpLogarithmicMapping, max_buckets: int) -> None:
        super().__init__(
            mapping=mapping,
            store=CollapsingLowestDenseStore(max_buckets),
            negative_store=DenseStore(),  # stays empty: negative durations are recorded as 0
            zero_count=0.0,
        )

    def add_keyed(self, key: int | None, value: float) -> None:
        """Add one value whose key is already known (None: the zero bucket)."""
        if key is None:
            self._zero_count += 1.0
        else:
            self._store.add(key, 1.0)
        self._count += 1.0
        self._sum += value
        if value < self._min:
            self._min = value
        if value > self._max:
            self._max = value

    def add_batch(self, batch: KeyedValues) -> None:
        """Add a batch whose keys were computed once by ``KeyedValues.of``."""
        if batch.keys:
            self._add_to_store(batch.keys, batch.counts, batch.positives)
        recorded = batch.positives + batch.zeros
        if not recorded:
            return
        self._zero_count += batch.zeros
        self._count += recorded
        self._sum += batch.total
        if batch.lowest < self._min:
            self._min = batch.lowest
        if batch.highest > self._max:
            self._max = batch.highest

    def _add_to_store(self, keys: list[int], counts: list[int] | None, positives: int) -> None:
        store = self._store
        # Grow the store once to cover the batch, then count straight into its bins: cheaper
        # than a store.add per value or per distinct key (bench/sketches.py).
        store.add(min(keys), 0.0)
        store.add(max(keys), 0.0)
        if store.is_collapsed:
            # Keys below the collapsed range must go through the store.
            if counts is None:
                for key in keys:
                    store.add(key, 1.0)
            else:
                for key, count in zip(keys, counts, strict=True):
                    store.add(key, float(count))
            return
        bins, offset = store.bins, store.offset
        if counts is None:
            for key in keys:
                bins[key - offset] += 1.0
        else:
            for key, count in zip(keys, counts, strict=True):
                bins[key - offset] += count
        store.count += positives

    def set_totals(self, *, zeros: int, total: float, lowest: float, highest: float) -> None:
        """After loading buckets directly (deserialisation): set the exact aggregates."""
        self._zero_count = float(zeros)
        self._count = self._store.count + self._zero_count
        self._sum = total
        self._min = lowest
        self._max = highest

    @property
    def positive_store(self) -> CollapsingLowestDenseStore:
        store: CollapsingLowestDenseStore = self._store
        return store

    @property
    def zero_count(self) -> float:
        return float(self._zero_count)

    @property
    def lowest(self) -> float:
        return float(self._min)

    @property
    def highest(self) -> float:
        return float(self._max)


class LatencySketch:
    """``add / merge / quantile`` over positive durations in seconds, relative error <= 1%.

    Values that are zero, negative (clock skew) or below the smallest normal float are recorded
    as 0 in the zero bucket; NaN and infinities are dropped and counted in ``dropped``.
    Quantiles are DDSketch's lower quantile (the value of rank ``floor(q * (count - 1))``),
    estimated at the bucket's relative midpoint and clamped to the exact ``[min, max]`` (``q`` 0
    and 1 answer the exact min and max).
    """

    __slots__ = ("_mapping", "_max_buckets", "_min_positive", "_multiplier", "_sketch", "dropped")

    def __init__(
        self, *, scale: int = _DEFAULT_SCALE, max_buckets: int = _DEFAULT_MAX_BUCKETS
    ) -> None:
        _check_scale(scale)
        if isinstance(max_buckets, bool) or not isinstance(max_buckets, int) or max_buckets < 1:
            raise ValueError(f"max_buckets must be a positive int, got {max_buckets!r}")
        self._mapping = _mapping_for(scale)
        self._multiplier = self._mapping.index_multiplier
        self._min_positive = self._mapping.min_possible
        self._max_buckets = max_buckets
        self._sketch = _BucketedDDSketch(self._mapping, max_buckets)
        self.dropped = 0
        """Values not recorded because they were NaN or infinite."""

    # --- configuration ---------------------------------------------------------------------
    @property
    def scale(self) -> int:
        return int(self._mapping.scale)

    @property
    def max_buckets(self) -> int:
        return self._max_buckets

    @property
    def relative_accuracy(self) -> float:
        """The guaranteed relative error of quantile estimates, ``(b - 1) / (b + 1)``."""
        return float(self._mapping.relative_accuracy)

    @property
    def collapsed(self) -> bool:
        """True when ``max_buckets`` was reached and the lowest buckets were merged."""
        return bool(self._sketch.positive_store.is_collapsed)

    # --- recording -------------------------------------------------------------------------
    def key(self, value_s: float) -> int | None:
        """The DDSketch key of a value (OTLP index + 1); None for the zero bucket."""
        if value_s > self._min_positive:
            return math.ceil(math.log2(value_s) * self._multiplier)
        return None

    def add(self, value_s: float) -> None:
        if value_s > self._min_positive:
            if value_s == _INF:
                self.dropped += 1
                return
            self._sketch.add_keyed(math.ceil(math.log2(value_s) * self._multiplier), value_s)
        elif value_s <= self._min_positive:
            self._sketch.add_keyed(None, 0.0)
        else:  # NaN compares false both ways
            self.dropped += 1

    def add_many(self, values_s: Iterable[float]) -> None:
        """Add a batch: keys computed in one pass, the store grown once, bins counted directly.

        Produces exactly the buckets that ``add`` would (same key formula). Per value, as fast as
        ``add`` for 8 values, ~1.8x faster for 32 and ~2.5x from a few hundred
        (``bench/sketches.py``); smaller batches simply loop over ``add``. To add one batch to
        several sketches, key it once with ``KeyedValues.of`` and use ``add_keyed``.
        """
        values = _as_list(values_s)
        if len(values) < _SMALL_BATCH:
            for value in values:
                self.add(value)
            return
        self.add_keyed(KeyedValues.of(values, scale=self.scale))

    def add_keyed(self, batch: KeyedValues) -> None:
        """Add a batch keyed by ``KeyedValues.of`` at this sketch's scale (ValueError if not)."""
        if batch.scale != self._mapping.scale:
            raise ValueError(
                f"cannot add values keyed at scale {batch.scale} to a sketch of scale {self.scale}"
            )
        self._sketch.add_batch(batch)
        self.dropped += batch.dropped

    def merge(self, other: LatencySketch) -> None:
        """Add ``other``'s counts into this sketch (exact; ``other`` is unchanged)."""
        if not isinstance(other, LatencySketch):
            raise TypeError(f"can only merge a LatencySketch, got {type(other).__name__}")
        if other.scale != self.scale:
            raise ValueError(
                f"cannot merge sketches of different scales ({self.scale} and {other.scale}): "
                "their buckets do not line up"
            )
        if other._max_buckets != self._max_buckets:
            raise ValueError(
                f"cannot merge sketches with different max_buckets "
                f"({self._max_buckets} and {other._max_buckets})"
            )
        self._sketch.merge(other._sketch)
        self.dropped += other.dropped

    def copy(self) -> LatencySketch:
        duplicate = LatencySketch(scale=self.scale, max_buckets=self._max_buckets)
        duplicate.merge(self)
        return duplicate

    # --- reading ---------------------------------------------------------------------------
    @property
    def count(self) -> int:
        return int(self._sketch.count)

    @property
    def sum(self) -> float:
        return float(self._sketch.sum)

    @property
    def min(self) -> float | None:
        return self._sketch.lowest if self._sketch.count else None

    @property
    def max(self) -> float | None:
        return self._sketch.highest if self._sketch.count else None

    def quantile(self, q: float) -> float | None:
        """q in [0, 1]; None when empty."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile must be in [0, 1], got {q!r}")
        if not self._sketch.count:
            return None
        # The extremes are known exactly; in between, the bucket estimate is clamped to them.
        if q == 0.0:
            return self._sketch.lowest
        if q == 1.0:
            return self._sketch.highest
        estimate = self._sketch.get_quantile_value(q)
        if estimate is None:
            return None
        return min(max(float(estimate), self._sketch.lowest), self._sketch.highest)

    def fraction_at_or_below(self, value_s: float) -> float | None:
        """Approximate CDF: the fraction of values <= ``value_s``; None when empty.

        Exact below the minimum and at or above the maximum. In between, the bucket holding
        ``value_s`` counts as wholly at or below it: the threshold is rounded up to its bucket's
        upper edge, at most a factor ``b`` (1.1% at scale 6) above it.
        """
        count = self._sketch.count
        if not count:
            return None
        if value_s < self._sketch.lowest:
            return 0.0
        if value_s >= self._sketch.highest:
            return 1.0
        at_or_below = self._sketch.zero_count
        store = self._sketch.positive_store
        key = self.key(value_s)
        if key is not None and store.count:
            last = min(key, store.max_key)
            if last >= store.min_key:
                at_or_below += math.fsum(
                    store.bins[store.min_key - store.offset : last - store.offset + 1]
                )
        return float(at_or_below / count)

    def buckets(self) -> tuple[int, list[int]]:
        """``(offset, counts)`` of the positive buckets in OTLP layout: ``counts[j]`` counts the
        values in OTLP bucket ``offset + j``; trimmed to the first and last non-empty bucket."""
        store = self._sketch.positive_store
        if not store.count:
            return 0, []
        start, end = store.min_key - store.offset, store.max_key - store.offset + 1
        counts = [int(weight) for weight in store.bins[start:end]]
        first = next(j for j, weight in enumerate(counts) if weight)
        last = len(counts) - next(j for j, weight in enumerate(reversed(counts)) if weight)
        return store.min_key + first - 1, counts[first:last]

    @property
    def zero_count(self) -> int:
        return int(self._sketch.zero_count)

    def histogram(self, bounds_s: Sequence[float]) -> list[int]:
        """Counts of the recorded values in the bins of ``bounds_s`` (ascending, >= 2 bounds):
        bin ``j`` is ``(bounds_s[j], bounds_s[j + 1]]``, the first bin also takes everything
        at or below ``bounds_s[0]`` and the last everything above ``bounds_s[-1]``, so the
        counts always sum to ``count``.

        Each sketch bucket counts wholly at the value ``quantile`` estimates for it (its
        relative midpoint, clamped to the exact ``[min, max]``); zero-bucket values count at 0.
        A bin narrower than the sketch's buckets can therefore stay empty beside a full one.
        """
        bounds = [float(bound) for bound in bounds_s]
        if len(bounds) < 2 or any(low > high for low, high in itertools.pairwise(bounds)):
            raise ValueError("histogram bounds must be at least 2 ascending values")
        counts = [0] * (len(bounds) - 1)
        if not self._sketch.count:
            return counts
        inner = bounds[1:-1]
        lowest, highest = self._sketch.lowest, self._sketch.highest
        zeros = int(self._sketch.zero_count)
        if zeros:
            counts[bisect.bisect_left(inner, 0.0)] += zeros
        store = self._sketch.positive_store
        if store.count:
            value_of, offset, bins = self._mapping.value, store.offset, store.bins
            for key in range(store.min_key, store.max_key + 1):
                weight = int(bins[key - offset])
                if weight:
                    value = min(max(value_of(key), lowest), highest)
                    counts[bisect.bisect_left(inner, value)] += weight
        return counts

    def __repr__(self) -> str:
        return (
            f"LatencySketch(scale={self.scale}, count={self.count}, "
            f"min={self.min}, p50={self.quantile(0.5)}, max={self.max})"
        )

    # --- exchange --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-safe and compact: the non-empty range of buckets in OTLP layout."""
        offset, counts = self.buckets()
        return {
            "scale": self.scale,
            "max_buckets": self._max_buckets,
            "zero": self.zero_count,
            "offset": offset,
            "counts": counts,
            "sum": self.sum,
            "min": self.min,
            "max": self.max,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LatencySketch:
        """Rebuild a sketch from ``to_dict``; ValueError on anything malformed."""
        if not isinstance(data, dict):
            raise ValueError(f"sketch must be a dict, got {type(data).__name__}")
        scale = _int_field(data, "scale")
        max_buckets = _int_field(data, "max_buckets", default=_DEFAULT_MAX_BUCKETS)
        zeros = _int_field(data, "zero")
        offset = _int_field(data, "offset")
        counts = data.get("counts")
        if not isinstance(counts, list) or not all(_is_int(c) and c >= 0 for c in counts):
            raise ValueError("sketch 'counts' must be a list of non-negative ints")
        if zeros < 0:
            raise ValueError("sketch 'zero' must be >= 0")
        sketch = cls(scale=scale, max_buckets=max_buckets)  # validates scale and max_buckets
        if len(counts) > max_buckets:
            raise ValueError(f"sketch has {len(counts)} buckets, more than max_buckets")
        total = _number_field(data, "sum")
        lowest, highest = _number_field(data, "min"), _number_field(data, "max")
        if total is None or total < 0:
            raise ValueError("sketch 'sum' must be a finite non-negative number")
        if zeros + sum(counts) == 0:
            if lowest is not None or highest is not None or total != 0:
                raise ValueError("an empty sketch has no min, max or sum")
            return sketch
        if lowest is None or highest is None or not 0 <= lowest <= highest:
            raise ValueError("a non-empty sketch needs finite 'min' and 'max', 0 <= min <= max")
        lowest_index, highest_index = _index_range(scale)
        if counts and not lowest_index <= offset <= offset + len(counts) - 1 <= highest_index:
            raise ValueError(f"sketch buckets at offset {offset} lie outside the float range")
        store = sketch._sketch.positive_store
        for j, weight in enumerate(counts):
            if weight:
                store.add(offset + j + 1, float(weight))
        sketch._sketch.set_totals(zeros=zeros, total=total, lowest=lowest, highest=highest)
        return sketch

    def to_otlp(self, data_point: ExponentialHistogramDataPoint) -> None:
        """Fill ``data_point``'s histogram fields (timestamps and attributes are the caller's)."""
        offset, counts = self.buckets()
        data_point.scale = self.scale
        data_point.zero_count = self.zero_count
        data_point.zero_threshold = 0.0
        data_point.count = self.count
        data_point.sum = self.sum
        data_point.ClearField("positive")
        data_point.ClearField("negative")
        if counts:
            data_point.positive.offset = offset
            data_point.positive.bucket_counts.extend(counts)
        if self.count:
            data_point.min = self._sketch.lowest
            data_point.max = self._sketch.highest
        else:
            data_point.ClearField("min")
            data_point.ClearField("max")


def _index_range(scale: int) -> tuple[int, int]:
    """OTLP bucket indices whose bounds are finite positive floats at ``scale``."""
    per_doubling = 2**scale
    return -1074 * per_doubling, 1024 * per_doubling - 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int_field(data: dict[str, Any], name: str, *, default: int | None = None) -> int:
    value = data.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"sketch {name!r} must be an int, got {value!r}")
    return value


def _number_field(data: dict[str, Any], name: str) -> float | None:
    """A finite number, or None when the field is null or absent."""
    value = data.get(name)
    if value is None:
        return None
    if not _is_number(value) or not math.isfinite(value):
        raise ValueError(f"sketch {name!r} must be a finite number, got {value!r}")
    return float(value)


class SketchKey(NamedTuple):
    """What one set of latency sketches is kept per. A named tuple, not a frozen dataclass:
    every request looks its key up several times (hashed and compared in C, not by the
    dataclass's generated Python ``__hash__`` and ``__eq__``), and makes one."""

    service: str
    model: str
    operation: str
    prompt_bucket: str
