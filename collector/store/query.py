"""The request list's query: which requests match (``RequestFilter``), in which order and which
page (``RequestPageQuery``), the page a store gives back (``RequestPage``) and its cursors.

Pages are keyset pages: the cursor holds the last row's (sort value, trace id, span id), and the
next page starts strictly after it in (sort value, trace id, span id) order, so a page costs the
same at any depth and rows inserted meanwhile never shift a page.

This is what the API and the UI ask any store for; how a store answers it fast is the backend's
(SQLite: ``sqlite/list_query.py``; PostgreSQL: ``postgresql/list_query.py``), within the
total's cap and the time budget set here.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from tokentrace.collector.store.document import RequestSummaryDoc, summary_from_row
from tokentrace.collector.store.row import METRIC_COLUMNS, SUMMARY_COLUMNS

SORT_START: Final = "start"
SORT_KEYS: Final = {SORT_START: "start_ns", **METRIC_COLUMNS}
"""Sort keys -> their column: the only column names a sort puts into SQL."""

TOTAL_CAP: int = 10_000
"""Matches a page's ``total`` counts at most: above it ``total`` is this and ``total_exact``
false (backends read it at call time, so tests may lower it)."""
QUERY_BUDGET_S: float = 5.0
"""Time one list query may take before it is abandoned with ``QueryTimeoutError`` (a safety
net: the backends' planning keeps the usual queries far below it; read at call time)."""

MAX_PAGE_LIMIT: Final = 500
"""Rows one page holds at most."""
DEFAULT_PAGE_LIMIT: Final = 50
MIN_TRACE_PREFIX_HEX: Final = 8
"""A text search of at least this many hex digits also matches trace ids starting with it."""
MAX_TEXT_LENGTH: Final = 256
_CURSOR_VERSION: Final = 1
_MIN_INT64: Final = -(2**63)  # what an INTEGER column holds
_MAX_INT64: Final = 2**63 - 1


class QueryTimeoutError(Exception):
    """A query ran past the store's time budget; the message says how to narrow it."""


class UnreadableRowError(Exception):
    """A stored row is not a valid request row (the store reports it as a StoreError)."""


def query_timeout() -> QueryTimeoutError:
    """The error of a list query that ran past ``QUERY_BUDGET_S``."""
    return QueryTimeoutError(
        f"the list query took longer than {QUERY_BUDGET_S:g} s: its filters each match many "
        "requests but together few; narrow it with a time window"
    )


def trace_prefix_range(prefix_hex: str) -> tuple[bytes, bytes | None]:
    """Byte range [low, high) of every id starting with ``prefix_hex`` (None: no upper end)."""
    padded = prefix_hex if len(prefix_hex) % 2 == 0 else prefix_hex + "0"
    low = bytes.fromhex(padded)
    top = prefix_hex if len(prefix_hex) % 2 == 0 else prefix_hex + "f"
    high = bytearray(bytes.fromhex(top))
    while high and high[-1] == 0xFF:  # the smallest string above every one starting with top
        high.pop()
    if not high:
        return low, None
    high[-1] += 1
    return low, bytes(high)


def hex_prefix(text: str) -> str | None:
    """A text search's trace id prefix: at least ``MIN_TRACE_PREFIX_HEX`` hex digits (an
    optional 0x), lower case, at most 32; None when the text is not one."""
    cleaned = text.strip().lower()
    if cleaned.startswith("0x"):
        cleaned = cleaned[2:]
    if len(cleaned) < MIN_TRACE_PREFIX_HEX or any(c not in "0123456789abcdef" for c in cleaned):
        return None
    return cleaned[:32]


# --- the query -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestFilter:
    """Which requests match: every given field must hold (None: no condition).

    ``since_ns <= start < until_ns``; dimension fields, ``cause`` and ``segment`` (the dominant
    segment) are exact matches; ``slo_breached`` true: some SLO target was missed;
    ``min_ttft_ns <= ttft``, ``min_e2e_ns <= e2e <= max_e2e_ns``; ``text``: a substring of the
    request id (case-sensitive), or, when it is at least 8 hex digits, a trace id prefix.
    """

    since_ns: int | None = None
    until_ns: int | None = None
    service: str | None = None
    model: str | None = None
    operation: str | None = None
    prompt_bucket: str | None = None
    slo_breached: bool | None = None
    cause: str | None = None
    segment: str | None = None
    min_ttft_ns: int | None = None
    min_e2e_ns: int | None = None
    max_e2e_ns: int | None = None
    text: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestPageQuery:
    """One page of matching requests in ``sort`` order (``SORT_KEYS``), after ``cursor``."""

    filter: RequestFilter = field(default_factory=RequestFilter)
    sort: str = SORT_START
    descending: bool = True
    limit: int = DEFAULT_PAGE_LIMIT
    cursor: str | None = None

    def __post_init__(self) -> None:
        if self.sort not in SORT_KEYS:
            raise ValueError(f"unknown sort {self.sort!r}; choose one of {', '.join(SORT_KEYS)}")
        if not 1 <= self.limit <= MAX_PAGE_LIMIT:
            raise ValueError(f"limit must be between 1 and {MAX_PAGE_LIMIT}, not {self.limit}")


@dataclass(frozen=True, slots=True)
class RequestPage:
    items: list[RequestSummaryDoc]
    """``RequestSummary`` documents (``document.summary_from_row``)."""
    next_cursor: str | None
    """Give it back for the next page; None on the last page."""
    total: int
    """Matching requests, counted up to ``TOTAL_CAP``."""
    total_exact: bool


def page_of(rows: Sequence[Sequence[Any]], query: RequestPageQuery, *, total: int) -> RequestPage:
    """The page of ``query`` from up to ``limit`` + 1 rows in ``SUMMARY_COLUMNS`` order (the
    extra row says a next page exists) and the matches counted (up to ``TOTAL_CAP`` + 1)."""
    try:
        items = [summary_from_row(row) for row in rows[: query.limit]]
    except (TypeError, ValueError) as error:
        raise UnreadableRowError(f"a stored request is unreadable ({error})") from error
    next_cursor = None
    if len(rows) > query.limit:
        last = rows[query.limit - 1]
        next_cursor = encode_cursor(
            query.sort,
            query.descending,
            int(last[SUMMARY_COLUMNS.index(SORT_KEYS[query.sort])]),
            bytes(last[0]),
            bytes(last[1]),
        )
    return RequestPage(items, next_cursor, min(total, TOTAL_CAP), total <= TOTAL_CAP)


# --- cursors -------------------------------------------------------------------------------------


def _order_name(descending: bool) -> str:
    return "desc" if descending else "asc"


def encode_cursor(sort: str, descending: bool, value: int, trace_id: bytes, span_id: bytes) -> str:
    """The opaque cursor of the row after which the next page starts."""
    payload = [_CURSOR_VERSION, sort, _order_name(descending), value, trace_id.hex(), span_id.hex()]
    raw = json.dumps(payload, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def decode_cursor(cursor: str, *, sort: str, descending: bool) -> tuple[int, bytes, bytes]:
    """(sort value, trace id, span id) of a cursor; ValueError with one sentence when it is not
    a cursor this code gave out, or one of another sort order."""
    not_ours = ValueError("cursor is not one this API gave out; start again without a cursor")
    try:
        text = cursor.strip()
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        payload = json.loads(raw)
    except (ValueError, binascii.Error, UnicodeError):
        raise not_ours from None
    if not isinstance(payload, list) or len(payload) != 6:
        raise not_ours
    version, cursor_sort, cursor_order, value, trace_hex, span_hex = payload
    if (
        version != _CURSOR_VERSION
        or cursor_sort not in SORT_KEYS
        or cursor_order not in ("desc", "asc")
        or type(value) is not int
        or not _MIN_INT64 <= value <= _MAX_INT64
        or not isinstance(trace_hex, str)
        or not isinstance(span_hex, str)
    ):
        raise not_ours
    if cursor_sort != sort or cursor_order != _order_name(descending):
        raise ValueError(
            f"cursor belongs to sort={cursor_sort} order={cursor_order}, not sort={sort} "
            f"order={_order_name(descending)}; start again without a cursor"
        )
    try:
        return value, bytes.fromhex(trace_hex), bytes.fromhex(span_hex)
    except ValueError:
        raise not_ours from None
