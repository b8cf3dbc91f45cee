"""How the request list (``store/query.py``) runs on SQLite: a plan per query that picks the
index to read, keyset page SQL over the ``requests`` table, and a deadline on every statement.

``page_sql``/``match_sql`` build SQL text only from this module's fixed fragments and the
column/index names of ``SORT_KEYS``, ``row`` and ``schema.REQUEST_INDEXES``; every value a
caller gives is a bound parameter. ``run_page`` runs a page query on a read-only connection.

How a query stays fast on a million rows (``schema.REQUEST_INDEXES`` describes the indexes):

1. Each filter with a seek index (a model, a cause, breached, an E2E range, the window, ...) is
   counted in that index alone, up to ``query.TOTAL_CAP`` + 1: index entries only, well under a
   ms.
   One matching nothing ends the query. The filter with the fewest matches, when that is at
   most ``query.TOTAL_CAP``, drives the query: read those rows, check the rest, sort.
2. Otherwise the whole combination is checked while scanning ``requests_start``, which carries
   every filter column (a request id search scans ``requests_request_id``, which carries the
   request ids): no table reads, so even a full scan stays near 100 ms at 1M rows. Up to
   ``query.TOTAL_CAP`` matches are read by rowid and sorted.
3. More matches than that are common enough for the page to walk the index of its sort order
   until it has a page: in start order checking the filters inside ``requests_start``; in E2E
   or TTFT order reading each row to check them. When the matches lie at the far end of that
   order (the slowest requests of a fast model), that walk gets ``WALK_BUDGET_S`` and then the
   page reads every match in start order instead and sorts them.

SQLite's own planner guesses without statistics (and a rare value looks like a common one to
it), so the chosen index is named with ``INDEXED BY``. Sort orders without an index (tpot,
queue, prefill, decode, network) read every match when the matches are common.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Final

from tokentrace.collector.store import query as store_query
from tokentrace.collector.store.query import (
    MAX_TEXT_LENGTH,
    SORT_KEYS,
    RequestFilter,
    RequestPage,
    RequestPageQuery,
    decode_cursor,
    hex_prefix,
    page_of,
    trace_prefix_range,
)
from tokentrace.collector.store.row import SUMMARY_COLUMNS

WALK_BUDGET_S: float = 0.05
"""Time a page may walk the E2E/TTFT index (reading rows to check filters) before it reads the
matches in start order instead."""

_NULLABLE_SORT_COLUMNS: Final = frozenset(SORT_KEYS.values()) - {"start_ns", "e2e_ns"}
_WALK_INDEXES: Final = {
    "start_ns": "requests_start",
    "e2e_ns": "requests_e2e",
    "ttft_ns": "requests_ttft",
}
"""Sort columns whose index a page can walk in order."""
_START_WALK: Final = "requests_start"
START_INDEX_COLUMNS: Final = (
    "start_ns",
    "service",
    "model",
    "operation",
    "prompt_bucket",
    "cause",
    "segment",
    "slo_breached",
    "e2e_ns",
    "ttft_ns",
)
"""The columns of ``requests_start`` (``schema.REQUEST_INDEXES`` builds it from these): start
order, then every column a filter but the text search reads, so filters are checked inside the
index."""
TEXT_INDEX_COLUMNS: Final = ("start_ns", "request_id")
"""The columns of ``requests_request_id``, scanned for request id substrings (a third of
``requests_start``'s size, so the scan takes a third less time)."""
_TEXT_INDEX: Final = "requests_request_id"
_START_WALK_COLUMNS: Final = frozenset(START_INDEX_COLUMNS)
_FALLBACK_COUNT_CAP: Final = 200_000
"""Matches counted per seek to choose the one a fallback reads (index entries only: ms)."""
_PRIMARY_KEY_INDEX: Final = "sqlite_autoindex_requests_1"
_ROWID_LOOKUP: Final = "NOT INDEXED"
"""``Plan.index`` of a plan driven by a list of rowids: rowid lookups, no index."""
_PROGRESS_STEPS: int = 2_000
"""SQLite VM steps between two deadline checks (tens of µs)."""


# --- terms: one per filter, with the index that finds its matches ----------------------------


@dataclass(frozen=True, slots=True)
class Term:
    """One condition: SQL text with ``?`` placeholders and its values; ``index``: a seek index
    whose entries are exactly this term's candidates; ``columns``: the columns it reads."""

    sql: str
    params: tuple[Any, ...] = ()
    index: str | None = None
    columns: frozenset[str] = frozenset()
    holds_start: bool = False
    """``index`` also holds ``start_ns`` right after the term's own key, so the window narrows
    the same seek."""


_DIMENSION_TERMS: Final = (
    # (RequestFilter field = column, its (column, start_ns) seek index)
    ("service", "requests_service"),
    ("model", "requests_model"),
    ("operation", "requests_operation"),
    ("prompt_bucket", "requests_bucket"),
    ("cause", "requests_cause"),
    ("segment", "requests_segment"),
)
_REQUEST_ID_MATCH: Final = "instr(request_id, ?) > 0"
"""Literal substring (no wildcards); NULL request ids give NULL, i.e. no match."""


def _trace_range_term(prefix_hex: str) -> Term:
    low, high = trace_prefix_range(prefix_hex)
    if high is None:
        return Term("trace_id >= ?", (low,), columns=frozenset({"trace_id"}))
    return Term("trace_id >= ? AND trace_id < ?", (low, high), columns=frozenset({"trace_id"}))


def text_terms(text: str) -> tuple[Term, Term | None]:
    """A text search: (its request id substring term, the trace id prefix term when the text
    is a long enough hex number). A row matches when either does."""
    request_id = Term(_REQUEST_ID_MATCH, (text,), columns=frozenset({"request_id"}))
    prefix = hex_prefix(text)
    return request_id, None if prefix is None else _trace_range_term(prefix)


def text_term(text: str) -> Term:
    """A text search as one condition (checked row by row)."""
    request_id, trace = text_terms(text)
    if trace is None:
        return request_id
    return Term(
        f"({request_id.sql}) OR ({trace.sql})",
        (*request_id.params, *trace.params),
        columns=request_id.columns | trace.columns,
    )


def window_terms(flt: RequestFilter) -> list[Term]:
    """The time window: conditions on ``start_ns``."""
    start = frozenset({"start_ns"})
    terms = []
    if flt.since_ns is not None:
        terms.append(Term("start_ns >= ?", (int(flt.since_ns),), columns=start))
    if flt.until_ns is not None:
        terms.append(Term("start_ns < ?", (int(flt.until_ns),), columns=start))
    return terms


def filter_terms(flt: RequestFilter, *, sort_column: str) -> list[Term]:
    """Every condition of ``flt`` but the window and the text, plus ``IS NOT NULL`` on a
    nullable sort column (requests without that value are left out of its order)."""
    terms: list[Term] = []
    for name, seek_index in _DIMENSION_TERMS:
        value = getattr(flt, name)
        if value is not None:
            terms.append(Term(f"{name} = ?", (str(value),), seek_index, frozenset({name}), True))
    breached = frozenset({"slo_breached"})
    if flt.slo_breached is True:
        terms.append(Term("slo_breached > 0", (), "requests_breached", breached, True))
    elif flt.slo_breached is False:
        terms.append(Term("slo_breached = 0", columns=breached))
    if flt.min_e2e_ns is not None or flt.max_e2e_ns is not None:
        parts, params = [], []
        if flt.min_e2e_ns is not None:
            parts.append("e2e_ns >= ?")
            params.append(int(flt.min_e2e_ns))
        if flt.max_e2e_ns is not None:
            parts.append("e2e_ns <= ?")
            params.append(int(flt.max_e2e_ns))
        terms.append(
            Term(" AND ".join(parts), tuple(params), "requests_e2e", frozenset({"e2e_ns"}))
        )
    if flt.min_ttft_ns is not None:
        terms.append(
            Term("ttft_ns >= ?", (int(flt.min_ttft_ns),), "requests_ttft", frozenset({"ttft_ns"}))
        )
    if sort_column in _NULLABLE_SORT_COLUMNS:
        null_index = "requests_ttft" if sort_column == "ttft_ns" else None
        terms.append(Term(f"{sort_column} IS NOT NULL", (), null_index, frozenset({sort_column})))
    return terms


def rowids_term(rowids: Sequence[int]) -> Term:
    """Rows already found, as one bound JSON list."""
    return Term("rowid IN (SELECT value FROM json_each(?))", (json.dumps(list(rowids)),))


# --- SQL -----------------------------------------------------------------------------------------


def _where(terms: Sequence[Term]) -> tuple[str, list[Any]]:
    if not terms:
        return "", []
    params: list[Any] = []
    for term in terms:
        params.extend(term.params)
    return " WHERE " + " AND ".join(f"({term.sql})" for term in terms), params


def _indexed_by(index: str | None) -> str:
    if index is None:
        return ""
    if index == _ROWID_LOOKUP:
        return f" {_ROWID_LOOKUP}"
    return f" INDEXED BY {index}"


def match_sql(
    terms: Sequence[Term], *, index: str | None, cap: int, rowids: bool = False
) -> tuple[str, list[Any]]:
    """Rows matching every term (walking ``index``), at most ``cap`` + 1 of them: their rowids,
    or a ``1`` each for counting."""
    where, params = _where(terms)
    what = "rowid" if rowids else "1"
    return f"SELECT {what} FROM requests{_indexed_by(index)}{where} LIMIT ?", [*params, cap + 1]


def page_sql(
    terms: Sequence[Term],
    *,
    sort_column: str,
    descending: bool,
    after: tuple[int, bytes, bytes] | None,
    limit: int,
    columns: Sequence[str] = SUMMARY_COLUMNS,
    index: str | None = None,
) -> tuple[str, list[Any]]:
    """Up to ``limit`` rows matching every term, in (sort, trace id, span id) order, strictly
    after ``after`` (a decoded cursor). ``sort_column`` is one of ``SORT_KEYS``' columns and
    ``columns`` come from ``row``'s column tables: fixed names, never caller text."""
    all_terms = list(terms)
    if after is not None:
        value, trace_id, span_id = after
        # The first comparison alone is what an index on the sort column can seek to.
        if descending:
            keyset = f"{sort_column} <= ? AND ({sort_column} < ? OR (trace_id, span_id) < (?, ?))"
        else:
            keyset = f"{sort_column} >= ? AND ({sort_column} > ? OR (trace_id, span_id) > (?, ?))"
        all_terms.append(Term(keyset, (value, value, trace_id, span_id)))
    where, params = _where(all_terms)
    direction = "DESC" if descending else "ASC"
    order = f"{sort_column} {direction}, trace_id {direction}, span_id {direction}"
    sql = (
        f"SELECT {', '.join(columns)} FROM requests{_indexed_by(index)}{where} "
        f"ORDER BY {order} LIMIT ?"
    )
    return sql, [*params, limit]


# --- planning ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Plan:
    """How a query runs: its conditions and the index that drives it (None: SQLite picks)."""

    terms: list[Term]
    index: str | None
    total: int | None = None
    """Matches found while planning, when that count covered every condition (at most
    ``query.TOTAL_CAP`` + 1); None: the total needs a count of its own."""
    fallback: bool = False
    """Walking ``index`` reads rows to check conditions: past ``WALK_BUDGET_S`` the page reads
    the matches in start order instead, from the seek in ``seeks`` with the fewest matches (or
    from ``requests_start`` when there is none)."""
    seeks: list[tuple[list[Term], str]] = field(default_factory=list)
    """(terms, index) of each start-ordered seek of the query."""

    @property
    def empty(self) -> bool:
        return self.total == 0


def _count(
    connection: sqlite3.Connection, terms: Sequence[Term], *, index: str | None, cap: int
) -> int:
    sql, params = match_sql(terms, index=index, cap=cap)
    ((count,),) = connection.execute(f"SELECT COUNT(*) FROM ({sql})", params).fetchall()
    return int(count)


def _rowids(
    connection: sqlite3.Connection, terms: Sequence[Term], *, index: str | None, cap: int
) -> list[int]:
    sql, params = match_sql(terms, index=index, cap=cap, rowids=True)
    return [rowid for (rowid,) in connection.execute(sql, params)]


def plan_query(connection: sqlite3.Connection, flt: RequestFilter, *, sort_column: str) -> Plan:
    """Choose how to run a query (see the module docstring); ``sort_column`` is one of
    ``SORT_KEYS``' columns."""
    cap = store_query.TOTAL_CAP
    window = window_terms(flt)
    terms = filter_terms(flt, sort_column=sort_column)
    text = flt.text[:MAX_TEXT_LENGTH] if flt.text else None
    conditions = [*window, *terms, *([text_term(text)] if text is not None else [])]

    # 1. Each condition with a seek index, counted alone (with the window where that index
    # holds start_ns): the rarest drives the query when it matches at most `cap` rows.
    candidates: list[tuple[list[Term], str]] = [
        ([*window, term] if term.holds_start else [term], term.index)
        for term in terms
        if term.index is not None
    ]
    if window:
        candidates.append((window, _START_WALK))
    best: tuple[int, str] | None = None
    total: int | None = None
    for counted_terms, index in candidates:
        counted = _count(connection, counted_terms, index=index, cap=cap)
        if counted == 0:
            return Plan([], None, 0)
        if len(counted_terms) == len(conditions):  # this count saw every condition
            total = counted
        if best is None or counted < best[0]:
            best = (counted, index)
    if best is not None and best[0] <= cap:
        return Plan(conditions, best[1], total)
    walk = _WALK_INDEXES.get(sort_column)
    # Walking e2e/ttft reads a row per candidate to check conditions on other columns.
    fallback = walk not in (None, _START_WALK) and any(
        not t.columns <= {sort_column} for t in conditions
    )
    seeks = [
        ([*window, term], term.index)
        for term in terms
        if term.holds_start and term.index is not None
    ]
    if total is not None:  # one common condition and nothing else
        return Plan(conditions, walk, total, fallback, seeks)

    # 2. No condition is rare alone. A text search scans its own narrow index; the others
    # are checked together inside requests_start (no table reads either way). Up to `cap`
    # matches are read by rowid, else the page walks the sort order.
    inside = [t for t in [*window, *terms] if t.columns <= _START_WALK_COLUMNS]
    outside = [t for t in terms if not t.columns <= _START_WALK_COLUMNS]
    if text is not None:
        found = _text_rowids(connection, text, window, cap=cap)
        if not found:
            return Plan([], None, 0)
        if len(found) <= cap:
            return Plan([rowids_term(found), *terms], _ROWID_LOOKUP, None if terms else len(found))
        outside.append(text_term(text))
    found = _rowids(connection, inside, index=_START_WALK, cap=cap)
    if not found:
        return Plan([], None, 0)
    if len(found) <= cap:
        return Plan([rowids_term(found), *outside], _ROWID_LOOKUP, None if outside else len(found))
    return Plan(conditions, walk, None if outside else len(found), fallback, seeks)


def _text_rowids(
    connection: sqlite3.Connection, text: str, window: Sequence[Term], *, cap: int
) -> list[int]:
    """Rowids of up to ``cap`` + 1 requests in the window whose request id contains ``text``
    or whose trace id starts with it: a scan of ``requests_request_id`` and a seek of the
    primary key, both without table reads."""
    request_id, trace = text_terms(text)
    found = _rowids(connection, [*window, request_id], index=_TEXT_INDEX, cap=cap)
    if trace is not None and len(found) <= cap:  # few traces: seek them in the key
        seen = set(found)
        for rowid in _rowids(connection, [*window, trace], index=_PRIMARY_KEY_INDEX, cap=cap):
            if rowid not in seen:
                seen.add(rowid)
                found.append(rowid)
        del found[cap + 1 :]
    return found


# --- running -------------------------------------------------------------------------------------


class _Deadline:
    """Interrupts the connection's statements past ``budget_s`` from now (progress handler);
    ``within`` narrows it for one step."""

    def __init__(self, connection: sqlite3.Connection, budget_s: float) -> None:
        self._connection = connection
        self._overall = time.monotonic() + budget_s
        self._until = self._overall
        self.hit = False

    def __enter__(self) -> _Deadline:
        self._connection.set_progress_handler(self._check, _PROGRESS_STEPS)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._connection.set_progress_handler(None, 0)

    @contextmanager
    def within(self, budget_s: float) -> Iterator[None]:
        self._until = min(self._overall, time.monotonic() + budget_s)
        try:
            yield
        finally:
            self._until = self._overall

    @property
    def overall_hit(self) -> bool:
        return self.hit and time.monotonic() > self._overall

    def _check(self) -> int:
        if time.monotonic() > self._until:
            self.hit = True
            return 1
        return 0


def _fetch_page(
    connection: sqlite3.Connection,
    deadline: _Deadline,
    plan: Plan,
    *,
    sort_column: str,
    descending: bool,
    after: tuple[int, bytes, bytes] | None,
    limit: int,
    columns: Sequence[str],
) -> list[Any]:
    """The page's rows: walking ``plan.index``, or its fallback when that walk runs long."""

    def fetch(index: str | None) -> list[Any]:
        sql, params = page_sql(
            plan.terms,
            sort_column=sort_column,
            descending=descending,
            after=after,
            limit=limit,
            columns=columns,
            index=index,
        )
        return connection.execute(sql, params).fetchall()

    if not plan.fallback:
        return fetch(plan.index)
    try:
        with deadline.within(WALK_BUDGET_S):
            return fetch(plan.index)
    except sqlite3.OperationalError:
        if not deadline.hit or deadline.overall_hit:
            raise
        deadline.hit = False
    fewest: tuple[int, str] | None = None
    for terms, index in plan.seeks:
        counted = _count(connection, terms, index=index, cap=_FALLBACK_COUNT_CAP)
        if fewest is None or counted < fewest[0]:
            fewest = (counted, index)
    return fetch(_START_WALK if fewest is None else fewest[1])


def run_page(connection: sqlite3.Connection, query: RequestPageQuery) -> RequestPage:
    """One page of ``query``. Raises ValueError for a bad cursor, QueryTimeoutError past
    ``query.QUERY_BUDGET_S``, sqlite3.Error when the store cannot be read."""
    sort_column = SORT_KEYS[query.sort]
    after = (
        None
        if query.cursor is None
        else decode_cursor(query.cursor, sort=query.sort, descending=query.descending)
    )
    with _Deadline(connection, store_query.QUERY_BUDGET_S) as deadline:
        try:
            plan = plan_query(connection, query.filter, sort_column=sort_column)
            if plan.empty:
                return RequestPage([], None, 0, True)
            rows = _fetch_page(
                connection,
                deadline,
                plan,
                sort_column=sort_column,
                descending=query.descending,
                after=after,
                limit=query.limit + 1,
                columns=SUMMARY_COLUMNS,
            )
            total = plan.total
            if total is None:
                total = _count(connection, plan.terms, index=plan.index, cap=store_query.TOTAL_CAP)
        except sqlite3.OperationalError:
            if deadline.overall_hit:
                raise store_query.query_timeout() from None
            raise
    return page_of(rows, query, total=total)


def run_rows(
    connection: sqlite3.Connection,
    flt: RequestFilter,
    *,
    columns: Sequence[str],
    sort: str,
    descending: bool,
    limit: int,
) -> list[tuple[Any, ...]]:
    """Up to ``limit`` matching rows (``columns``, from ``row``'s tables) in ``sort`` order,
    planned like a page; raises like ``run_page``."""
    sort_column = SORT_KEYS[sort]
    with _Deadline(connection, store_query.QUERY_BUDGET_S) as deadline:
        try:
            plan = plan_query(connection, flt, sort_column=sort_column)
            if plan.empty:
                return []
            return _fetch_page(
                connection,
                deadline,
                plan,
                sort_column=sort_column,
                descending=descending,
                after=None,
                limit=limit,
                columns=columns,
            )
        except sqlite3.OperationalError:
            if deadline.overall_hit:
                raise store_query.query_timeout() from None
            raise
