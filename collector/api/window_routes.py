"""``/api/v1/window``, ``/slo``, ``/fleet`` and ``/compare``: percentiles, SLOs and budgets of
time windows (``docs/api.md``).

Each route reads the store (sketch slices of the window, SLO targets, requests for the budget
bands and the slowest lists) and hands the rest to the pure builders in ``fleet`` and
``processors.window.compare``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Final

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, Field

from tokentrace.agent import semconv
from tokentrace.collector.api.app import store_of
from tokentrace.collector.api.fleet import (
    BAND_NAMES,
    DISTRIBUTION_METRICS,
    BandLimits,
    band_document,
    band_limits,
    distributions,
    merged_sketches,
    select_slices,
    window_document,
)
from tokentrace.collector.api.list_route import RequestSummary
from tokentrace.collector.api.params import (
    ApiError,
    Dimensions,
    Window,
    dimensions,
    unix_s_to_ns,
    window_dependency,
)
from tokentrace.collector.store import Store
from tokentrace.collector.store.document import RequestSummaryDoc
from tokentrace.collector.store.query import QueryTimeoutError, RequestFilter, RequestPageQuery
from tokentrace.collector.tail_sampling import sampling_summary
from tokentrace.processors.sketches import LatencySketch
from tokentrace.processors.window.compare import compare_windows

router = APIRouter()

_DEFAULT_WINDOW_S: Final = 3600.0
_LISTED_REQUESTS: Final = 10
"""Requests the fleet view lists as slowest and as breaching."""
_BAND_MAX_REQUESTS: Final = 2_000
"""Requests one budget band averages at most (the slowest of the band): bounds the JSON decoded
per view on a large store."""
_NS_PER_S: Final = 1_000_000_000


# --- response models ----------------------------------------------------------------------------


class MetricSummary(BaseModel):
    p50: float | None
    p95: float | None
    p99: float | None
    count: int


class KeySloMark(BaseModel):
    target: str
    met: bool | None
    value_ms: float | None


class KeyReport(BaseModel):
    service: str
    model: str
    operation: str
    prompt_bucket: str
    requests: int
    metrics: dict[str, MetricSummary] = Field(description="metric -> percentiles (ms)")
    slo: list[KeySloMark]


class SloStatus(BaseModel):
    target: str
    metric: str
    percentile: float
    threshold_ms: float | None
    selector: dict[str, str]
    requests: int
    value_ms: float | None = Field(description="the window's value at the target percentile")
    met: bool | None
    compliance: float | None = Field(description="share of requests inside the threshold")
    burn_rate: float | None = Field(description="error budget spent: 1.0 spends it exactly")


class WindowReport(BaseModel):
    """``tokentrace top --json``: percentiles per key and SLO status of one window."""

    window_s: float
    since_s: float
    until_s: float
    requests: int
    keys: list[KeyReport]
    slo: list[SloStatus]
    slo_errors: list[str]


class SloReport(BaseModel):
    since_s: float
    until_s: float
    targets: list[SloStatus]
    errors: list[str] = Field(description="SLO targets that could not be read or evaluated")


class Histogram(BaseModel):
    bounds_ms: list[float] = Field(description="n + 1 ascending bounds, log-spaced")
    counts: list[int] = Field(description="n counts, bin j = (bounds[j], bounds[j+1]]")
    count: int = Field(description="values in the sketch; the counts sum to it")


class BudgetBand(BaseModel):
    e2e_ms: float | None = Field(description="the window's E2E at the band's percentile")
    e2e_from_ms: float | None
    e2e_to_ms: float | None = Field(description="null: unbounded (the p99 band)")
    requests: int = Field(description="requests averaged")
    segments: dict[str, float] = Field(description="mean budget segments, ms")


RequestSummaryList = Annotated[
    list[RequestSummary],
    Field(description="RequestSummary objects, as GET /api/v1/requests lists them"),
]


class SamplingSummary(BaseModel):
    """What tail sampling kept, since the collector started (its stats snapshot)."""

    traces: int = Field(description="traces decided: kept + dropped")
    kept: int
    dropped: int
    kept_share: float | None = Field(description="kept / traces (null: none decided yet)")
    kept_by_reason: dict[str, int] = Field(description="always, breach, slowest, rare, random")
    dropped_by_reason: dict[str, int] = Field(description="random")


class FleetView(BaseModel):
    window: WindowReport
    distributions: dict[str, Histogram] = Field(description="ttft, tpot, itl, e2e")
    budget: dict[str, BudgetBand] = Field(description="p50, p99")
    slowest: RequestSummaryList
    breaching: RequestSummaryList
    sampling: SamplingSummary | None = Field(
        description="the stored traces are a sample of these (null: tail sampling is off); the "
        "percentiles and SLO figures are not sampled"
    )
    warnings: list[str]


class MetricComparison(BaseModel):
    service: str
    model: str
    operation: str
    prompt_bucket: str
    metric: str
    a: MetricSummary | None
    b: MetricSummary | None
    delta: dict[str, float | None] | None = Field(description="b - a per quantile, ms")
    change: dict[str, float | None] | None = Field(description="b / a - 1 per quantile")


class SloComparison(BaseModel):
    target: str
    a: SloStatus | None
    b: SloStatus | None


class CompareView(BaseModel):
    a: WindowReport
    b: WindowReport
    metrics: list[MetricComparison]
    slo: list[SloComparison]
    budget: dict[str, dict[str, BudgetBand]] = Field(description="a, b -> p50, p99")
    warnings: list[str]


# --- reading one window -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BoundedWindow:
    """A bounded window in unix seconds and ns."""

    since_s: float
    until_s: float

    @property
    def since_ns(self) -> int:
        return int(self.since_s * _NS_PER_S)

    @property
    def until_ns(self) -> int:
        return int(self.until_s * _NS_PER_S)


def bounded_window(window: Window, request: Request) -> BoundedWindow:
    """An open side of the window is bounded by the epoch or by now."""
    clock: Callable[[], float] = request.app.state.clock
    since_s = 0.0 if window.since_s is None else window.since_s
    until_s = clock() if window.until_s is None else window.until_s
    if until_s <= since_s:
        raise ApiError(400, "the window is empty: since must be before until (and before now)")
    return BoundedWindow(since_s, until_s)


@dataclass(slots=True)
class _WindowData:
    report: dict[str, Any]
    sketches: dict[str, LatencySketch]
    warnings: list[str]


def _read_window(
    store: Store,
    span: BoundedWindow,
    dims: Dimensions,
    *,
    sketch_metrics: Sequence[str] = (),
) -> _WindowData:
    """The window report, and the merged sketches of ``sketch_metrics`` over the window."""
    slices = select_slices(store.sketches_between(span.since_s, span.until_s), dims.as_selector())
    targets, problems = store.slo_targets()
    try:
        report = window_document(
            slices,
            since_s=span.since_s,
            until_s=span.until_s,
            slo_targets=targets,
            slo_errors=problems,
        )
    except (ValueError, TypeError) as error:
        raise ApiError(503, f"the store holds a malformed sketch slice ({error})") from None
    warnings: list[str] = []
    sketches: dict[str, LatencySketch] = {}
    if sketch_metrics:
        sketches, malformed = merged_sketches(slices, sketch_metrics)
        if malformed:
            warnings.append(f"{malformed} malformed sketch slice(s) left out of the histograms")
    return _WindowData(report, sketches, warnings)


def _request_filter(span: BoundedWindow, dims: Dimensions, **extra: Any) -> RequestFilter:
    return RequestFilter(
        since_ns=span.since_ns,
        until_ns=span.until_ns,
        service=dims.service,
        model=dims.model,
        operation=dims.operation,
        prompt_bucket=dims.prompt_bucket,
        **extra,
    )


def _budget(
    store: Store,
    span: BoundedWindow,
    dims: Dimensions,
    e2e_sketch: LatencySketch | None,
    warnings: list[str],
) -> dict[str, dict[str, Any]]:
    """The p50 and p99 budget bands of a window (``fleet.band_limits``); a band whose query
    runs too long is left empty, with a warning."""
    limits: dict[str, BandLimits] = {band.name: band for band in band_limits(e2e_sketch)}
    bands: dict[str, dict[str, Any]] = {}
    for name in BAND_NAMES:
        band = limits.get(name)
        if band is None:
            bands[name] = band_document(None, 0, {})
            continue
        band_filter = _request_filter(span, dims, min_e2e_ns=band.low_ns, max_e2e_ns=band.high_ns)
        try:
            count, means = store.segment_means(band_filter, limit=_BAND_MAX_REQUESTS)
        except QueryTimeoutError as error:
            warnings.append(f"budget {name}: {error}")
            count, means = 0, {}
        bands[name] = band_document(band, count, means)
    return bands


def _summaries(
    store: Store, query_filter: RequestFilter, what: str, warnings: list[str]
) -> list[RequestSummaryDoc]:
    """The slowest matching requests by E2E (``_LISTED_REQUESTS``); none, with a warning, when
    the query runs too long."""
    query = RequestPageQuery(
        filter=query_filter, sort=semconv.METRIC_E2E, descending=True, limit=_LISTED_REQUESTS
    )
    try:
        page = store.list_requests(query)
    except QueryTimeoutError as error:
        warnings.append(f"{what}: {error}")
        return []
    return list(page.items)


# --- routes -----------------------------------------------------------------------------------

default_window = window_dependency(_DEFAULT_WINDOW_S)
"""since/until/last, by default the last hour (every window route, and ``/diagnose``)."""


@router.get(
    "/window",
    tags=["windows"],
    summary="Percentiles per key and SLO status of one window (tokentrace top --json)",
    response_model=WindowReport,
)
def get_window(
    request: Request,
    window: Annotated[Window, Depends(default_window)],
    dims: Annotated[Dimensions, Depends(dimensions)],
) -> dict[str, Any]:
    return _read_window(store_of(request), bounded_window(window, request), dims).report


@router.get(
    "/slo",
    tags=["windows"],
    summary="SLO compliance and error-budget burn rate of one window",
    response_model=SloReport,
)
def get_slo(request: Request, window: Annotated[Window, Depends(default_window)]) -> dict[str, Any]:
    span = bounded_window(window, request)
    report = _read_window(store_of(request), span, Dimensions()).report
    return {
        "since_s": report["since_s"],
        "until_s": report["until_s"],
        "targets": report["slo"],
        "errors": report["slo_errors"],
    }


@router.get(
    "/fleet",
    tags=["windows"],
    summary="The fleet view: percentiles, distributions, budget bands, slowest requests",
    response_model=FleetView,
)
def get_fleet(
    request: Request,
    window: Annotated[Window, Depends(default_window)],
    dims: Annotated[Dimensions, Depends(dimensions)],
) -> dict[str, Any]:
    store = store_of(request)
    span = bounded_window(window, request)
    data = _read_window(store, span, dims, sketch_metrics=DISTRIBUTION_METRICS)
    warnings = data.warnings
    e2e = data.sketches.get(semconv.METRIC_E2E)
    return {
        "window": data.report,
        "distributions": distributions(data.sketches),
        "budget": _budget(store, span, dims, e2e, warnings),
        "slowest": _summaries(store, _request_filter(span, dims), "slowest", warnings),
        "breaching": _summaries(
            store, _request_filter(span, dims, slo_breached=True), "breaching", warnings
        ),
        "sampling": _sampling(store),
        "warnings": warnings,
    }


def _sampling(store: Store) -> dict[str, Any] | None:
    """What tail sampling kept, from the collector's stats the store holds (None: off, or no
    collector wrote stats)."""
    return sampling_summary(store.collector_stats())


def _required_unix_s(name: str) -> Any:
    return Query(description=f"{name}, unix seconds (required)")


@router.get(
    "/compare",
    tags=["windows"],
    summary="Two windows side by side: percentile deltas, SLOs, budget bands",
    response_model=CompareView,
)
def get_compare(
    request: Request,
    a_since: Annotated[float, _required_unix_s("window A start")],
    a_until: Annotated[float, _required_unix_s("window A end")],
    b_since: Annotated[float, _required_unix_s("window B start")],
    b_until: Annotated[float, _required_unix_s("window B end")],
    dims: Annotated[Dimensions, Depends(dimensions)],
) -> dict[str, Any]:
    spans: dict[str, BoundedWindow] = {}
    for label, since, until in (("a", a_since, a_until), ("b", b_since, b_until)):
        unix_s_to_ns(since, name=f"{label}_since")  # range checks, 400 on a unit mistake
        unix_s_to_ns(until, name=f"{label}_until")
        if until <= since:
            raise ApiError(400, f"{label}_until must be after {label}_since")
        spans[label] = BoundedWindow(since, until)
    store = store_of(request)
    data = {
        label: _read_window(store, span, dims, sketch_metrics=(semconv.METRIC_E2E,))
        for label, span in spans.items()
    }
    comparison = compare_windows(data["a"].report, data["b"].report)
    warnings: dict[str, list[str]] = {label: data[label].warnings for label in spans}
    budget = {
        label: _budget(
            store, spans[label], dims, data[label].sketches.get(semconv.METRIC_E2E), warnings[label]
        )
        for label in spans
    }
    return {
        "a": data["a"].report,
        "b": data["b"].report,
        "metrics": comparison["metrics"],
        "slo": comparison["slo"],
        "budget": budget,
        "warnings": [f"{label}: {text}" for label in spans for text in warnings[label]],
    }
