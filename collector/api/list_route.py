"""``GET /api/v1/requests``: the request list with filters, sorting and keyset pages
(``docs/api.md``).

The store plans and runs the query (contract: ``collector/store/query.py``; SQLite planner:
``collector/store/sqlite/list_query.py``); this route only turns query parameters into a
``RequestPageQuery`` and the page into JSON. Every filter reaches SQL as a
bound parameter. A page is serialised straight to JSON (the summaries are already plain,
JSON-ready dicts); the pydantic models below describe it in the OpenAPI document.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from tokentrace.collector.api.app import store_of
from tokentrace.collector.api.params import (
    ApiError,
    Dimensions,
    Window,
    dimensions,
    window_dependency,
)
from tokentrace.collector.store import (
    QueryTimeoutError,
    RequestFilter,
    RequestPageQuery,
)
from tokentrace.collector.store.query import (
    DEFAULT_PAGE_LIMIT,
    MAX_PAGE_LIMIT,
    MAX_TEXT_LENGTH,
    MIN_TRACE_PREFIX_HEX,
    TOTAL_CAP,
    decode_cursor,
)

router = APIRouter(tags=["requests"])

_NS_PER_MS: Final = 1_000_000
_MAX_THRESHOLD_MS: Final = 1e9
"""About 11.6 days: a larger latency threshold is a unit mistake."""
_MAX_CURSOR_LENGTH: Final = 512
_LABEL_MAX_LENGTH: Final = 64

SortKey = Literal["start", "e2e", "ttft", "tpot", "queue", "prefill", "decode", "network"]
"""``query.SORT_KEYS`` (a test checks that they agree)."""
SortOrder = Literal["desc", "asc"]


class RequestSummary(BaseModel):
    """One stored request in the list (``store.document.summary_from_row``). Durations in ms (exact
    µs); null where the request has no such value."""

    trace_id: str = Field(description="32 hex digits")
    span_id: str = Field(description="16 hex digits: the request span")
    request_id: str | None = Field(description="the server's request id, e.g. cmpl-...")
    start_unix_ns: int
    start_iso: str = Field(description="UTC, microseconds, e.g. 2026-11-21T10:00:00.123456Z")
    service: str
    model: str
    operation: str = Field(description="chat | text_completion | ...")
    prompt_bucket: str = Field(description="prompt-length bucket, e.g. 128-511")
    e2e_ms: float
    ttft_ms: float | None
    tpot_ms: float | None
    queue_ms: float | None
    prefill_ms: float | None
    decode_ms: float | None
    network_ms: float | None
    input_tokens: int | None
    output_tokens: int | None
    segment: str | None = Field(description="the dominant budget segment")
    cause: str | None = Field(description="the diagnosed cause")
    verdict: str | None = Field(description="the diagnosis in one sentence")
    slo_breached: bool = Field(description="some SLO target this request was judged by missed")


class RequestList(BaseModel):
    items: list[RequestSummary]
    next_cursor: str | None = Field(
        description="give it as `cursor` for the next page; null on the last page"
    )
    total: int = Field(description=f"matching requests, counted up to {TOTAL_CAP}")
    total_exact: bool = Field(description=f"false when more than {TOTAL_CAP} match")


def _ms_to_ns(value_ms: float | None) -> int | None:
    return None if value_ms is None else round(value_ms * _NS_PER_MS)


_everything = window_dependency(None)


@router.get(
    "/requests",
    summary="Stored requests: filter, sort, page",
    response_model=RequestList,
    description=(
        "Requests in the store that match every given filter, `limit` per page in `sort` "
        "order; requests without a value for the sort metric are left out. Pages are keyset "
        "pages: pass `next_cursor` back as `cursor` (stable while requests are being added). "
        "Without since/until/last the list covers the whole store."
    ),
)
def list_requests(
    request: Request,
    window: Annotated[Window, Depends(_everything)],
    dims: Annotated[Dimensions, Depends(dimensions)],
    slo_breached: Annotated[
        bool | None, Query(description="true: some SLO target missed; false: none")
    ] = None,
    cause: Annotated[
        str | None,
        Query(description="diagnosed cause, e.g. queueing", max_length=_LABEL_MAX_LENGTH),
    ] = None,
    segment: Annotated[
        str | None,
        Query(description="dominant budget segment, e.g. queue", max_length=_LABEL_MAX_LENGTH),
    ] = None,
    min_ttft_ms: Annotated[
        float | None,
        Query(description="TTFT at least this (ms)", ge=0, le=_MAX_THRESHOLD_MS),
    ] = None,
    min_e2e_ms: Annotated[
        float | None,
        Query(description="E2E at least this (ms)", ge=0, le=_MAX_THRESHOLD_MS),
    ] = None,
    q: Annotated[
        str | None,
        Query(
            description=(
                "a substring of the request id (case-sensitive), or a trace id prefix of at "
                f"least {MIN_TRACE_PREFIX_HEX} hex digits"
            ),
            max_length=MAX_TEXT_LENGTH,
        ),
    ] = None,
    sort: Annotated[SortKey, Query(description="the order of the list")] = "start",
    order: Annotated[SortOrder, Query(description="desc: largest/newest first")] = "desc",
    limit: Annotated[
        int, Query(description="requests per page", ge=1, le=MAX_PAGE_LIMIT)
    ] = DEFAULT_PAGE_LIMIT,
    cursor: Annotated[
        str | None,
        Query(description="next_cursor of the previous page", max_length=_MAX_CURSOR_LENGTH),
    ] = None,
) -> JSONResponse:
    text = None if q is None else q.strip() or None
    descending = order == "desc"
    cursor = cursor or None
    if cursor is not None:
        try:
            decode_cursor(cursor, sort=sort, descending=descending)
        except ValueError as error:
            raise ApiError(400, f"cursor: {error}") from None
    query = RequestPageQuery(
        filter=RequestFilter(
            since_ns=window.since_ns,
            until_ns=window.until_ns,
            service=dims.service,
            model=dims.model,
            operation=dims.operation,
            prompt_bucket=dims.prompt_bucket,
            slo_breached=slo_breached,
            cause=cause,
            segment=segment,
            min_ttft_ns=_ms_to_ns(min_ttft_ms),
            min_e2e_ns=_ms_to_ns(min_e2e_ms),
            text=text,
        ),
        sort=sort,
        descending=descending,
        limit=limit,
        cursor=cursor,
    )
    try:
        page = store_of(request).list_requests(query)
    except QueryTimeoutError as error:
        raise ApiError(503, str(error)) from None
    return JSONResponse(
        {
            "items": page.items,
            "next_cursor": page.next_cursor,
            "total": page.total,
            "total_exact": page.total_exact,
        }
    )
