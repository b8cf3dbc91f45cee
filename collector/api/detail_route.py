"""``GET /api/v1/requests/{trace_id}``: one request, drilled down (``docs/api.md``).

The route reads the explain document and the trace's stored spans from the store; everything
else is ``request_view`` (pure). ``metric`` picks the verdict (``tokentrace explain --metric``).
Unknown ids answer 404, bad or ambiguous ids and unknown metrics 400, and spans that cannot be
decoded only empty the parts that need them (``warnings`` says so).
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

from fastapi import APIRouter, Path, Query, Request
from pydantic import BaseModel, Field

from tokentrace.collector.api.app import ApiSettings, ErrorBody, store_of
from tokentrace.collector.api.params import ApiError
from tokentrace.collector.api.request_view import request_view
from tokentrace.collector.store.document import RequestDocument, VerdictDoc

router = APIRouter(tags=["requests"])

_ID_MAX_LENGTH: Final = 64


class GpuAggregate(BaseModel):
    """The node agent's GPU aggregates over one span's window (any may be null)."""

    utilization_mean: float | None = Field(None, description="fraction 0..1")
    utilization_max: float | None = Field(None, description="fraction 0..1")
    memory_controller_utilization_mean: float | None = Field(None, description="fraction 0..1")
    bandwidth_gbps: float | None = Field(None, description="mean DRAM bandwidth, GB/s")
    bandwidth_peak_gbps: float | None = None
    bandwidth_peak_ratio: float | None = Field(None, description="fraction of peak, 0..1")
    bandwidth_source: str | None = Field(None, description="gpm | memory_controller")
    memory_used_bytes: float | None = None
    power_w: float | None = None
    sm_clock_mhz: float | None = None
    memory_clock_mhz: float | None = None
    samples: int | None = Field(None, description="GPU samples inside the window")


class GpuPhase(GpuAggregate):
    phase: str = Field(description="request | prefill | decode")
    start_ms: float
    end_ms: float


VerdictMetric = Literal["ttft", "tpot", "itl", "e2e"]
"""``semconv.VERDICT_METRICS`` (spelled out: the API schema lists them)."""


class WaterfallRow(BaseModel):
    label: str
    segment: str = Field(description="the budget segment the phase counts towards")
    intervals_ms: list[tuple[float, float]]
    duration_ms: float
    dominant: bool = Field(
        description="the phase holds the verdict's dominant segment (interference and stalls "
        "are parts of decode)"
    )


class TokenGap(BaseModel):
    index: int = Field(description="gap i is tick i - tick i-1")
    at_ms: float = Field(description="tick i")
    gap_ms: float
    outlier: bool = Field(
        description="gap > the collector's itl_outlier_ratio (diagnosis settings) x median gap"
    )


class Tokens(BaseModel):
    ticks_ms: list[float]
    gaps: list[TokenGap]
    median_gap_ms: float | None
    outlier_threshold_ms: float | None
    dropped: int = Field(description="token times the document lacks (cap, evicted spans)")


class EngineStep(BaseModel):
    span_id: str
    parent_span_id: str | None
    start_ms: float
    end_ms: float
    batch_size: int | None
    prefill_requests: int | None
    decode_requests: int | None
    prefill_tokens: int | None
    decode_tokens: int | None
    kv_cache_usage: float | None
    waiting: int | None
    running: int | None
    request_ids: list[str]
    outlier: bool = Field(description="the step overlaps an outlier token gap")
    gpu: GpuAggregate | None


class SpanView(BaseModel):
    name: str
    span_id: str
    parent_span_id: str | None
    start_ms: float
    end_ms: float
    status: str = Field(description="unset | ok | error")
    attributes: dict[str, Any] = Field(description="attribute values as stored")


class Links(BaseModel):
    trace: str | None = Field(description="the trace in the configured tracing backend")


class RequestDetail(BaseModel):
    request: RequestDocument = Field(
        description="the document `tokentrace explain --json` prints (store.document)"
    )
    verdict: VerdictDoc | None = Field(
        description="the verdict answered: request.verdict, or request.verdicts[metric]"
    )
    verdict_metric: str | None = Field(
        description="the metric the verdict answers about: ttft | tpot | itl | e2e (null: no "
        "metric asked and no verdict)"
    )
    verdict_text: str = Field(description="its sentence (render.verdict_text)")
    verdict_heading: str = Field(
        description="which metric, whose clock, and why (render.verdict_heading)"
    )
    waterfall: list[WaterfallRow]
    tokens: Tokens
    engine_steps: list[EngineStep]
    gpu: list[GpuPhase]
    spans: list[SpanView]
    spans_dropped: int = Field(description="descendant spans past the cap, not listed")
    links: Links
    other_span_ids: list[str] = Field(description="other requests in the same trace")
    warnings: list[str] = Field(description="why parts of the view are missing")


@router.get(
    "/requests/{trace_id}",
    summary="One request: timeline, budget, diagnosis, engine steps, GPU, token gaps",
    response_model=RequestDetail,
    responses={404: {"description": "no such request", "model": ErrorBody}},
)
def get_request(
    request: Request,
    trace_id: Annotated[
        str,
        Path(description="trace id in hex; a prefix of >= 8 digits", max_length=_ID_MAX_LENGTH),
    ],
    span_id: Annotated[
        str | None,
        Query(description="pick one request of the trace (hex prefix)", max_length=32),
    ] = None,
    metric: Annotated[
        VerdictMetric | None,
        Query(description="the verdict about this metric (default: the request's default)"),
    ] = None,
) -> dict[str, Any]:
    store = store_of(request)
    try:
        doc = store.get(trace_id, span_id=span_id)
    except ValueError as error:  # not hex, too short, ambiguous prefix
        raise ApiError(400, str(error)) from None
    if doc is None:
        wanted = trace_id if span_id is None else f"{trace_id} / span {span_id}"
        raise ApiError(404, f"no stored request with trace id {wanted}")
    settings: ApiSettings = request.app.state.settings
    return request_view(
        doc,
        store.trace_otlp(doc["trace_id"]),
        metric=metric,
        trace_link_template=settings.trace_link,
        itl_outlier_ratio=store.diagnosis_settings().itl_outlier_ratio,
    )
