"""``GET /api/v1/diagnose``: what dominates a window's latency, per SLO target and per metric
(``tokentrace diagnose --json`` over a time range; ``docs/api.md``).

The window's most recent ``limit`` traces are re-derived from their stored spans and analysed by
``collector.diagnose.diagnose_range`` with the SLO targets the collector stored. Re-deriving
costs about half a millisecond per request, so the default limit keeps a view near a second and
reading stops once the store's query budget (``query.QUERY_BUDGET_S``) is spent: 503, as a
list query past it answers. Each finding also carries ``lines``, the text ``tokentrace diagnose``
prints for it (``findings.finding_lines``), so the UI shows the CLI's words.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Final

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, Field

from tokentrace.collector.api.app import store_of
from tokentrace.collector.api.params import Window
from tokentrace.collector.api.window_routes import SloStatus, bounded_window, default_window
from tokentrace.collector.diagnose import diagnose_range
from tokentrace.collector.store import query as store_query
from tokentrace.processors.window.findings import finding_lines

router = APIRouter(tags=["windows"])

DEFAULT_LIMIT: Final = 2_000
MAX_LIMIT: Final = 20_000


# --- response models ----------------------------------------------------------------------------


class SegmentShare(BaseModel):
    segment: str
    share: float = Field(description="of the group's metric, 0..1")
    mean_ms: float


class Counterfactual(BaseModel):
    segment: str = Field(description="the dominant segment, removed or halved")
    value_ms: float = Field(description="the population's value at the percentile, as it is")
    without_ms: float = Field(description="... with the segment removed from every unit")
    halved_ms: float = Field(description="... with the segment halved in every unit")
    met_without: bool | None = Field(description="the target met without it (null: no target)")
    met_halved: bool | None


class Finding(BaseModel):
    """What dominated one target's metric (or one metric's typical or tail requests)."""

    target: str | None = Field(description="the SLO target; null for a per-metric finding")
    metric: str = Field(description="ttft | tpot | itl | e2e")
    clock: str = Field(description="client | server: whose clock measured the metric")
    percentile: float
    threshold_ms: float | None
    met: bool | None = Field(description="null: no target, or no matching requests")
    value_ms: float | None = Field(description="the window's value at the percentile")
    population: int = Field(description="units judged: requests, or inter-token gaps for ITL")
    range_ms: list[float] | None = Field(
        None, description="per-metric findings: typical [low, high], tail [from]"
    )
    group: str | None = Field(None, description="beyond_threshold | tail | typical")
    units: int = Field(0, description="units in the group")
    requests: int = Field(0, description="requests in the group")
    segment: str | None = Field(None, description="the dominant segment")
    second_segment: str | None = Field(None, description="a runner-up close to it")
    share: float | None = Field(None, description="the dominant segment's share, 0..1")
    cause: str | None = None
    advice: str | None = None
    facts: dict[str, float] = Field(
        default_factory=dict, description="means of the numbers the cause cites"
    )
    segments: list[SegmentShare] = Field(default_factory=list)
    population_means_ms: dict[str, float] = Field(default_factory=dict)
    counterfactual: Counterfactual | None = None
    sentence: str
    lines: list[str] = Field(description="the finding as tokentrace diagnose prints it")


class PerceivedIssue(BaseModel):
    kind: str = Field(description="not_streamed | first_byte | new_connections")
    sentence: str
    share: float | None = None
    p95_ms: float | None = None


class MedianAndP95(BaseModel):
    p50: float
    p95: float


class Perceived(BaseModel):
    """Streaming, time to first byte and connection reuse, from the client spans."""

    requests: int = Field(description="requests with a client span")
    issues: list[PerceivedIssue]
    stream_known: int | None = None
    not_streamed: int | None = None
    first_byte_ms: MedianAndP95 | None = None
    connection_known: int | None = None
    new_connections: int | None = None
    connect_ms: MedianAndP95 | None = Field(None, description="setup of new connections")


class DiagnosisWindow(BaseModel):
    start_ns: int
    end_ns: int | None
    traces_found: int = Field(description="traces read (a trace may hold several requests)")
    client_only: int = Field(
        0,
        description="requests with only their client span stored while others of the window have "
        "a server view: their server's spans are missing or not yet joined",
    )
    undecodable: int = Field(description="stored traces that could not be re-derived")
    cut_at: int | None = Field(
        description="the window held more traces: only its most recent cut_at were read"
    )


Summary = dict[str, int | float | None]


class WindowDiagnosis(BaseModel):
    since_s: float
    until_s: float
    requests: int
    metrics: dict[str, Summary] = Field(description="metric -> count, mean, p50, p90, p95, p99")
    segments: dict[str, Summary] = Field(description="segment -> the same, plus share of E2E")
    findings: list[Finding] = Field(description="one per SLO target, breached first")
    metric_findings: list[Finding] = Field(description="TTFT, TPOT, E2E: typical and tail")
    perceived: Perceived
    slo: list[SloStatus] = Field(description="per target over the window's exact values")
    slo_errors: list[str] = Field(description="stored SLO targets that could not be read")
    window: DiagnosisWindow


# --- route --------------------------------------------------------------------------------------


@router.get(
    "/diagnose",
    summary="What dominates a window's latency: per SLO target, per metric, perceived speed",
    response_model=WindowDiagnosis,
)
def get_diagnose(
    request: Request,
    window: Annotated[Window, Depends(default_window)],
    limit: Annotated[
        int,
        Query(
            ge=1,
            le=MAX_LIMIT,
            description="re-derive at most this many traces, the most recent of the window",
        ),
    ] = DEFAULT_LIMIT,
) -> dict[str, Any]:
    store = store_of(request)
    span = bounded_window(window, request)
    targets, slo_errors = store.slo_targets()
    analysis = diagnose_range(
        store,
        since_ns=span.since_ns,
        until_ns=span.until_ns,
        targets=targets,
        max_requests=limit,
        deadline=time.monotonic() + store_query.QUERY_BUDGET_S,
    )
    for key in ("findings", "metric_findings"):
        analysis[key] = [{**finding, "lines": finding_lines(finding)} for finding in analysis[key]]
    return {**analysis, "since_s": span.since_s, "until_s": span.until_s, "slo_errors": slo_errors}
