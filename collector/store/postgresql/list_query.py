"""How the request list (``store/query.py``) runs on PostgreSQL: one WHERE clause per filter,
keyset page SQL over the ``requests`` table, a capped count, and a statement timeout.

PostgreSQL's planner has statistics (autovacuum's ANALYZE), so unlike SQLite's list planner
nothing here chooses an index: the (column, start_ns) indexes, the partial index of breached
requests and the E2E, TTFT and start orders (``schema.MIGRATIONS``) are there for it to pick.
SQL text comes only from this module's fixed fragments and the column names of ``SORT_KEYS``
and ``row``; every value a caller gives is a bound parameter.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Final

import psycopg

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

_NULLABLE_SORT_COLUMNS: Final = frozenset(SORT_KEYS.values()) - {"start_ns", "e2e_ns"}
_DIMENSIONS: Final = ("service", "model", "operation", "prompt_bucket", "cause", "segment")
Condition = tuple[str, tuple[Any, ...]]
"""SQL text with ``%s`` placeholders, and its values."""


def pg_text(value: str) -> str:
    """``value`` as a PostgreSQL text value: text cannot hold NUL characters, so each becomes
    U+FFFD (the writer stores them so, and a search for them must match that)."""
    return value.replace("\x00", "\ufffd") if "\x00" in value else value


def conditions(flt: RequestFilter, *, sort_column: str) -> list[Condition]:
    """Every condition of ``flt``, plus ``IS NOT NULL`` on a nullable sort column (requests
    without that value are left out of its order)."""
    found: list[Condition] = []
    if flt.since_ns is not None:
        found.append(("start_ns >= %s", (int(flt.since_ns),)))
    if flt.until_ns is not None:
        found.append(("start_ns < %s", (int(flt.until_ns),)))
    for name in _DIMENSIONS:
        value = getattr(flt, name)
        if value is not None:
            found.append((f"{name} = %s", (pg_text(str(value)),)))
    if flt.slo_breached is True:
        found.append(("slo_breached > 0", ()))
    elif flt.slo_breached is False:
        found.append(("slo_breached = 0", ()))
    if flt.min_e2e_ns is not None:
        found.append(("e2e_ns >= %s", (int(flt.min_e2e_ns),)))
    if flt.max_e2e_ns is not None:
        found.append(("e2e_ns <= %s", (int(flt.max_e2e_ns),)))
    if flt.min_ttft_ns is not None:
        found.append(("ttft_ns >= %s", (int(flt.min_ttft_ns),)))
    if flt.text:
        text = pg_text(flt.text[:MAX_TEXT_LENGTH])
        # strpos: a literal substring (no wildcards); NULL request ids never match.
        match = "strpos(request_id, %s) > 0"
        params: tuple[Any, ...] = (text,)
        prefix = hex_prefix(text)
        if prefix is not None:
            low, high = trace_prefix_range(prefix)
            if high is None:
                match += " OR trace_id >= %s"
                params += (low,)
            else:
                match += " OR (trace_id >= %s AND trace_id < %s)"
                params += (low, high)
        found.append((match, params))
    if sort_column in _NULLABLE_SORT_COLUMNS:
        found.append((f"{sort_column} IS NOT NULL", ()))
    return found


def _where(found: Sequence[Condition]) -> tuple[str, list[Any]]:
    if not found:
        return "", []
    params: list[Any] = []
    for _, values in found:
        params.extend(values)
    return " WHERE " + " AND ".join(f"({sql})" for sql, _ in found), params


def page_sql(
    found: Sequence[Condition],
    *,
    sort_column: str,
    descending: bool,
    after: tuple[int, bytes, bytes] | None,
    limit: int,
    columns: Sequence[str] = SUMMARY_COLUMNS,
) -> tuple[str, list[Any]]:
    """Up to ``limit`` rows matching every condition, in (sort, trace id, span id) order,
    strictly after ``after`` (a decoded cursor)."""
    terms = list(found)
    if after is not None:
        value, trace_id, span_id = after
        # The first comparison alone is what the sort column's index seeks to.
        sign = "<" if descending else ">"
        terms.append(
            (
                f"{sort_column} {sign}= %s AND "
                f"({sort_column}, trace_id, span_id) {sign} (%s, %s, %s)",
                (value, value, trace_id, span_id),
            )
        )
    where, params = _where(terms)
    direction = "DESC" if descending else "ASC"
    order = f"{sort_column} {direction}, trace_id {direction}, span_id {direction}"
    sql = f"SELECT {', '.join(columns)} FROM requests{where} ORDER BY {order} LIMIT %s"
    return sql, [*params, limit]


def _count(connection: psycopg.Connection[Any], found: Sequence[Condition], cap: int) -> int:
    where, params = _where(found)
    sql = f"SELECT COUNT(*) FROM (SELECT 1 FROM requests{where} LIMIT %s) AS matched"
    (count,) = connection.execute(sql, [*params, cap + 1]).fetchone() or (0,)
    return int(count)


def _with_budget(connection: psycopg.Connection[Any]) -> float:
    """Set the statement timeout to what is left of ``QUERY_BUDGET_S``; returns the deadline.
    Raises QueryTimeoutError when no budget is left."""
    deadline = time.monotonic() + store_query.QUERY_BUDGET_S
    _limit_statements(connection, deadline)
    return deadline


def _limit_statements(connection: psycopg.Connection[Any], deadline: float) -> None:
    left_ms = int((deadline - time.monotonic()) * 1000)
    if left_ms <= 0:
        raise store_query.query_timeout()
    connection.execute("SELECT set_config('statement_timeout', %s, false)", (str(left_ms),))


def run_page(connection: psycopg.Connection[Any], query: RequestPageQuery) -> RequestPage:
    """One page of ``query``. Raises ValueError for a bad cursor, QueryTimeoutError past
    ``query.QUERY_BUDGET_S``, psycopg.Error when the store cannot be read."""
    sort_column = SORT_KEYS[query.sort]
    after = (
        None
        if query.cursor is None
        else decode_cursor(query.cursor, sort=query.sort, descending=query.descending)
    )
    found = conditions(query.filter, sort_column=sort_column)
    cap = store_query.TOTAL_CAP
    deadline = _with_budget(connection)
    try:
        sql, params = page_sql(
            found,
            sort_column=sort_column,
            descending=query.descending,
            after=after,
            limit=query.limit + 1,
        )
        rows = connection.execute(sql, params).fetchall()
        _limit_statements(connection, deadline)
        total = _count(connection, found, cap)
    except psycopg.errors.QueryCanceled:
        raise store_query.query_timeout() from None
    finally:
        _reset_timeout(connection)
    return page_of(rows, query, total=total)


def run_rows(
    connection: psycopg.Connection[Any],
    flt: RequestFilter,
    *,
    columns: Sequence[str],
    sort: str,
    descending: bool,
    limit: int,
) -> list[tuple[Any, ...]]:
    """Up to ``limit`` matching rows (``columns``, from ``row``'s tables) in ``sort`` order;
    raises like ``run_page``."""
    sort_column = SORT_KEYS[sort]
    found = conditions(flt, sort_column=sort_column)
    sql, params = page_sql(
        found,
        sort_column=sort_column,
        descending=descending,
        after=None,
        limit=limit,
        columns=columns,
    )
    _with_budget(connection)
    try:
        return connection.execute(sql, params).fetchall()
    except psycopg.errors.QueryCanceled:
        raise store_query.query_timeout() from None
    finally:
        _reset_timeout(connection)


def _reset_timeout(connection: psycopg.Connection[Any]) -> None:
    """The pooled connection's other reads run without the list's timeout: under the session's
    default again (the server's, database's or role's setting, which an operator may have set;
    not 0)."""
    if not connection.broken:
        connection.execute("RESET statement_timeout")
