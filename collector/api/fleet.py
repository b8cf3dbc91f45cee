"""Pure builders of the window, fleet and compare views (``docs/api.md``).

Store reads stay in the routes (``window_routes``); everything here takes what they read
(sketch slices, SLO targets, segment means) and returns JSON-ready documents:

- ``window_document``: ``store.window_report`` over the slices of one window whose key matches
  the dimension filters.
- ``distributions``: one log-spaced histogram per metric from the window's merged sketches.
- ``band_limits`` / ``band_document``: the E2E bands whose requests' mean budget the fleet view
  shows (p50: the 45th to 55th percentile, p99: from the 98.5th).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from tokentrace.agent import semconv
from tokentrace.collector.store.sketch_report import SketchSlice, window_report
from tokentrace.processors.durations import ms_of
from tokentrace.processors.sketches import LatencySketch
from tokentrace.processors.slo import SELECTOR_KEYS, SloTarget

DISTRIBUTION_METRICS: Final = (
    semconv.METRIC_TTFT,
    semconv.METRIC_TPOT,
    semconv.METRIC_ITL,
    semconv.METRIC_E2E,
)
"""The metrics the fleet view draws a histogram of."""
_DEFAULT_HISTOGRAM_BUCKETS: Final = 30
_BOUND_SIGNIFICANT_DIGITS: Final = 6
"""Histogram bounds are rounded to this many significant digits (readable JSON)."""
_ALL_ZERO_TOP_MS: Final = 0.001
"""Upper bound of the one bin of a histogram whose values are all 0 (1 µs)."""
_MS_PER_S: Final = 1_000.0
_NS_PER_S: Final = 1_000_000_000

P50_BAND: Final = (45.0, 55.0)
"""E2E percentiles bounding the requests of the fleet view's typical (p50) budget."""
P99_FROM: Final = 98.5
"""E2E percentile from which requests make up the fleet view's tail (p99) budget."""
BAND_NAMES: Final = ("p50", "p99")


# --- SLO targets ------------------------------------------------------------------------------


# --- one window -------------------------------------------------------------------------------


def select_slices(slices: Iterable[SketchSlice], selector: Mapping[str, str]) -> list[SketchSlice]:
    """The slices whose key matches every entry of ``selector`` (``SELECTOR_KEYS`` name -> exact
    value, e.g. ``Dimensions.as_selector()``); an empty selector keeps them all."""
    if not selector:
        return list(slices)
    positions = [(SELECTOR_KEYS.index(name), value) for name, value in selector.items()]
    return [
        piece
        for piece in slices
        if all(piece[1][position] == value for position, value in positions)
    ]


def window_document(
    slices: Iterable[SketchSlice],
    *,
    since_s: float,
    until_s: float,
    slo_targets: Sequence[SloTarget] = (),
    slo_errors: Sequence[str] = (),
) -> dict[str, Any]:
    """``window_report`` of [since_s, until_s] (already selected slices). Raises ValueError on
    a malformed sketch."""
    return window_report(
        slices,
        window_s=until_s - since_s,
        now_s=until_s,
        slo_targets=slo_targets,
        slo_errors=slo_errors,
    )


def merged_sketches(
    slices: Iterable[SketchSlice], metrics: Sequence[str] = DISTRIBUTION_METRICS
) -> tuple[dict[str, LatencySketch], int]:
    """Per metric, the merge of every slice's sketch (all keys); and how many slices were left
    out because their sketch was malformed."""
    merged: dict[str, LatencySketch] = {}
    malformed = 0
    for _start, _key, metric, sketch_dict in slices:
        if metric not in metrics:
            continue
        try:
            sketch = LatencySketch.from_dict(sketch_dict)
            if metric in merged:
                merged[metric].merge(sketch)
            else:
                merged[metric] = sketch
        except (ValueError, TypeError):
            malformed += 1
    return merged, malformed


# --- histograms -------------------------------------------------------------------------------


def _significant(value: float) -> float:
    return float(f"{value:.{_BOUND_SIGNIFICANT_DIGITS}g}")


def log_bounds_ms(low_ms: float, high_ms: float, *, buckets: int) -> list[float]:
    """``buckets`` log-spaced bins from ``low_ms`` to ``high_ms`` (0 < low < high), rounded to
    6 significant digits; bins that rounding merged are dropped, so the bounds ascend strictly.
    """
    if not 0 < low_ms < high_ms or buckets < 1:
        raise ValueError(f"need 0 < low < high and buckets >= 1, got {low_ms}, {high_ms}")
    ratio = high_ms / low_ms
    bounds = [_significant(low_ms)]
    for index in range(1, buckets):
        bound = _significant(low_ms * ratio ** (index / buckets))
        if bound > bounds[-1]:
            bounds.append(bound)
    top = _significant(high_ms)
    if top > bounds[-1]:
        bounds.append(top)
    else:  # rounding met the top: the last bound is the top
        bounds[-1] = top
    if len(bounds) == 1:
        bounds.append(high_ms)
    return bounds


def histogram_document(
    sketch: LatencySketch | None, *, buckets: int = _DEFAULT_HISTOGRAM_BUCKETS
) -> dict[str, Any]:
    """``{bounds_ms, counts, count}`` of a sketch: log-spaced bins from its smallest to its
    largest value, at most ``buckets`` and no finer than the sketch's own buckets (finer bins
    would alternate between empty and full). ``counts`` sums to ``count``; values of 0 count in
    the first bin. An empty or missing sketch has no bins.
    """
    if sketch is None or sketch.count == 0:
        return {"bounds_ms": [], "counts": [], "count": 0}
    lowest_s, highest_s = sketch.min or 0.0, sketch.max or 0.0
    if lowest_s <= 0:
        offset, counts = sketch.buckets()
        if not counts:  # every value is 0
            bounds = [0.0, _ALL_ZERO_TOP_MS]
            return {"bounds_ms": bounds, "counts": [sketch.count], "count": sketch.count}
        # The lower edge of the lowest non-empty bucket: where the positive values begin.
        lowest_s = 2.0 ** (offset / 2**sketch.scale)
    accuracy = sketch.relative_accuracy
    if highest_s <= lowest_s * (1 + accuracy):
        # One value (or one sketch bucket): one bin around it, as wide as the sketch's error.
        lowest_s, highest_s = lowest_s * (1 - accuracy), max(highest_s, lowest_s) * (1 + accuracy)
        wanted = 1
    else:
        base = (1 + accuracy) / (1 - accuracy)
        resolution = math.ceil(math.log(highest_s / lowest_s) / math.log(base))
        wanted = max(1, min(buckets, resolution))
    bounds = log_bounds_ms(lowest_s * _MS_PER_S, highest_s * _MS_PER_S, buckets=wanted)
    counts = sketch.histogram([bound / _MS_PER_S for bound in bounds])
    return {"bounds_ms": bounds, "counts": counts, "count": sketch.count}


def distributions(
    sketches: Mapping[str, LatencySketch], *, buckets: int = _DEFAULT_HISTOGRAM_BUCKETS
) -> dict[str, dict[str, Any]]:
    """One histogram per ``DISTRIBUTION_METRICS`` metric (empty when the window has none)."""
    return {
        metric: histogram_document(sketches.get(metric), buckets=buckets)
        for metric in DISTRIBUTION_METRICS
    }


# --- budget bands -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BandLimits:
    """The E2E range of one budget band, in ns (``high_ns`` None: unbounded)."""

    name: str
    percentile: float
    """The percentile the band stands for (50, 99): its ``e2e_ms``."""
    e2e_ns: int
    low_ns: int
    high_ns: int | None


def _quantile_ns(sketch: LatencySketch, percentile: float) -> int:
    value = sketch.quantile(percentile / 100)
    return 0 if value is None else round(value * _NS_PER_S)


def band_limits(e2e: LatencySketch | None) -> list[BandLimits]:
    """The p50 band (E2E from the 45th to the 55th percentile) and the p99 band (from the
    98.5th) of a window's merged E2E sketch; none for an empty window. The percentiles are the
    sketch's estimates (within its relative error, <= 1%)."""
    if e2e is None or e2e.count == 0:
        return []
    low, high = P50_BAND
    return [
        BandLimits(
            "p50",
            50.0,
            _quantile_ns(e2e, 50.0),
            _quantile_ns(e2e, low),
            _quantile_ns(e2e, high),
        ),
        BandLimits("p99", 99.0, _quantile_ns(e2e, 99.0), _quantile_ns(e2e, P99_FROM), None),
    ]


def _ms(value_ns: int | None) -> float | None:
    return None if value_ns is None else ms_of(value_ns)


def band_document(
    limits: BandLimits | None, requests: int, segment_means_ms: Mapping[str, float]
) -> dict[str, Any]:
    """``{e2e_ms, e2e_from_ms, e2e_to_ms, requests, segments}`` of one band (an empty window
    gives nulls and no segments)."""
    if limits is None:
        return {
            "e2e_ms": None,
            "e2e_from_ms": None,
            "e2e_to_ms": None,
            "requests": 0,
            "segments": {},
        }
    return {
        "e2e_ms": _ms(limits.e2e_ns),
        "e2e_from_ms": _ms(limits.low_ns),
        "e2e_to_ms": _ms(limits.high_ns),
        "requests": int(requests),
        "segments": {str(name): float(value) for name, value in segment_means_ms.items()},
    }
