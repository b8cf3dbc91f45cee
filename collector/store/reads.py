"""Reading a request store, whichever database holds it: documents, traces' stored spans, the
request list, budget means, sketch slices and metadata.

Reads are rare, so the work is done here: a request's document is built from its row when it is
read (``document.document_from_row``), with token times read back from the stored spans. A
backend (``sqlite/reads.py``, ``postgresql/reads.py``) gives the connections, its spelling of
the SQL below (written once, with ``?`` placeholders) and its request-list planner.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Final

from tokentrace.agent import semconv
from tokentrace.collector.store.contract import (
    META_COLLECTOR_STATS,
    META_DIAGNOSIS,
    META_SLO_TARGETS,
    StoreError,
    diagnosis_from_json,
    merge_collector_stats,
)
from tokentrace.collector.store.document import (
    RequestDocument,
    budget_segments_ms,
    document_from_row,
)
from tokentrace.collector.store.query import (
    RequestFilter,
    RequestPage,
    RequestPageQuery,
    UnreadableRowError,
    trace_prefix_range,
)
from tokentrace.collector.store.row import (
    METRIC_COLUMNS,
    REQUEST_COLUMNS,
    DecodeSpans,
    budget_segments_ns,
    decode_from_otlp,
)
from tokentrace.collector.store.sketch_report import SketchSlice
from tokentrace.processors.diagnosis import DiagnosisConfig
from tokentrace.processors.slo import SloTarget, targets_from_json

_DEFAULT_SEGMENT_MEANS_ROWS: Final = 500
_MAX_SEGMENT_MEANS_ROWS: Final = 10_000
_MIN_PREFIX_HEX: Final = 8
_AMBIGUOUS_CANDIDATES_SHOWN: Final = 5
_IN_BATCH: Final = 500
"""Ids per ``IN (...)`` query: well under every backend's bound-parameter limit."""

_SELECT_REQUEST: Final = f"SELECT {', '.join(REQUEST_COLUMNS)} FROM requests"


def _parse_id(text: str, *, what: str) -> str:
    cleaned = text.strip().lower()
    if cleaned.startswith("0x"):
        cleaned = cleaned[2:]
    if not cleaned or any(c not in "0123456789abcdef" for c in cleaned):
        raise ValueError(f"{what} {text!r} is not hexadecimal")
    return cleaned


class StoreReader:
    """The reads of a store, whichever database: a backend gives ``_reader`` (a connection
    whose ``execute(sql, params)`` returns rows, its errors turned into StoreError), ``_sql``
    (its spelling of this module's SQL) and its list planner: ``_run_page`` and ``_run_rows``,
    the functions of its ``list_query`` module."""

    _run_page: Callable[[Any, RequestPageQuery], RequestPage]
    """``list_query.run_page`` of the backend: one page of a query on a connection."""
    _run_rows: Callable[..., list[tuple[Any, ...]]]
    """``list_query.run_rows`` of the backend: matching rows in a sort order."""

    def __init__(self, path: str, *, clock: Callable[[], float]) -> None:
        self.path = path
        """Where the store is, as messages show it."""
        self.shared = False
        """Whether other collectors may write the same store (a backend sets it)."""
        self.writer_id: str | None = None
        """This collector's name among those writing a shared store (None: not shared)."""
        self._clock = clock

    @contextmanager
    def _reader(self) -> Iterator[Any]:
        """A connection for one read; the backend's errors leave it as StoreError."""
        raise NotImplementedError
        yield

    def _sql(self, text: str) -> str:
        """``text`` (``?`` placeholders, unqualified table names) as the backend spells it."""
        return text

    def _execute(self, connection: Any, sql: str, params: Sequence[Any] = ()) -> Any:
        return connection.execute(self._sql(sql), params)

    def get(self, trace_id: str, *, span_id: str | None = None) -> RequestDocument | None:
        """The document of the request in the trace whose id is ``trace_id`` or starts with it.

        A prefix needs at least 8 hex digits; one matching several traces raises ValueError
        naming some of them. A trace with several requests gives the slowest (by E2E) unless
        ``span_id`` picks one; the others' span ids are listed under ``other_span_ids``.
        """
        prefix = _parse_id(trace_id, what="trace id")
        if len(prefix) < _MIN_PREFIX_HEX:
            raise ValueError(
                f"trace id {trace_id!r} is too short: give at least {_MIN_PREFIX_HEX} hex digits"
            )
        low, high = trace_prefix_range(prefix)
        query = "SELECT DISTINCT trace_id FROM requests WHERE trace_id >= ?"
        params: list[Any] = [low]
        if high is not None:
            query += " AND trace_id < ?"
            params.append(high)
        query += " LIMIT ?"
        params.append(_AMBIGUOUS_CANDIDATES_SHOWN + 1)
        with self._reader() as connection:
            matches = [row[0] for row in self._execute(connection, query, params)]
            if not matches:
                return None
            if len(matches) > 1:
                shown = ", ".join(bytes(m).hex() for m in matches[:_AMBIGUOUS_CANDIDATES_SHOWN])
                more = " ..." if len(matches) > _AMBIGUOUS_CANDIDATES_SHOWN else ""
                raise ValueError(
                    f"trace id prefix {prefix!r} matches several traces: {shown}{more}; "
                    "give more digits"
                )
            rows = self._execute(
                connection,
                f"{_SELECT_REQUEST} WHERE trace_id = ? ORDER BY e2e_ns DESC",
                (matches[0],),
            ).fetchall()
            chosen = rows[0]
            if span_id is not None:
                wanted = _parse_id(span_id, what="span id")
                picked = [row for row in rows if bytes(row[1]).hex().startswith(wanted)]
                if not picked:
                    return None
                chosen = picked[0]
            doc = self._document(connection, chosen, {}, self._diagnosis(connection))
        doc["other_span_ids"] = [bytes(row[1]).hex() for row in rows if row is not chosen]
        return doc

    def trace_otlp(self, trace_id: str | bytes, *, max_bytes: int | None = None) -> bytes | None:
        """The stored spans of a trace as a serialised ``ExportTraceServiceRequest``; None when
        the store has none, or more than ``max_bytes`` (then they are not read)."""
        key = (
            bytes.fromhex(_parse_id(trace_id, what="trace id"))
            if isinstance(trace_id, str)
            else bytes(trace_id)
        )
        with self._reader() as connection:
            if max_bytes is None:
                row = self._execute(
                    connection, "SELECT otlp FROM traces WHERE trace_id = ?", (key,)
                ).fetchone()
            else:
                # length() of a BLOB reads its size from the record header, not the value.
                row = self._execute(
                    connection,
                    "SELECT otlp FROM traces WHERE trace_id = ? AND length(otlp) <= ?",
                    (key, int(max_bytes)),
                ).fetchone()
        return None if row is None else bytes(row[0])

    def traces_otlp(self, trace_ids: Iterable[bytes]) -> Iterator[tuple[bytes, bytes]]:
        """(trace id, stored spans as a serialised ``ExportTraceServiceRequest``) of each
        given trace that the store holds, read in batches of ``_IN_BATCH`` ids."""
        ids = list(dict.fromkeys(bytes(trace_id) for trace_id in trace_ids))
        for offset in range(0, len(ids), _IN_BATCH):
            batch = ids[offset : offset + _IN_BATCH]
            marks = ", ".join("?" * len(batch))
            with self._reader() as connection:
                rows = self._execute(
                    connection,
                    f"SELECT trace_id, otlp FROM traces WHERE trace_id IN ({marks})",
                    batch,
                ).fetchall()
            for trace_id, otlp in rows:
                yield bytes(trace_id), bytes(otlp)

    def stored_trace_ids(self, trace_ids: Iterable[bytes]) -> set[bytes]:
        """Which of ``trace_ids`` the store holds spans of, read in batches of ``_IN_BATCH``."""
        ids = list(dict.fromkeys(bytes(trace_id) for trace_id in trace_ids))
        found: set[bytes] = set()
        for offset in range(0, len(ids), _IN_BATCH):
            batch = ids[offset : offset + _IN_BATCH]
            marks = ", ".join("?" * len(batch))
            with self._reader() as connection:
                rows = self._execute(
                    connection, f"SELECT trace_id FROM traces WHERE trace_id IN ({marks})", batch
                ).fetchall()
            found.update(bytes(trace_id) for (trace_id,) in rows)
        return found

    def trace_ids_between(
        self, since_ns: int, until_ns: int | None, *, limit: int
    ) -> tuple[list[bytes], bool]:
        """Ids of the traces whose requests started in [``since_ns``, ``until_ns``), the most
        recent ``limit`` of them, and whether more were left out."""
        query = "SELECT trace_id, MAX(start_ns) AS latest FROM requests WHERE start_ns >= ?"
        params: list[Any] = [int(since_ns)]
        if until_ns is not None:
            query += " AND start_ns < ?"
            params.append(int(until_ns))
        query += " GROUP BY trace_id ORDER BY latest DESC LIMIT ?"
        params.append(int(limit) + 1)
        with self._reader() as connection:
            found = [bytes(row[0]) for row in self._execute(connection, query, params)]
        return found[:limit], len(found) > limit

    def slowest(
        self, *, metric: str = semconv.METRIC_E2E, since_ns: int | None = None, limit: int = 10
    ) -> list[RequestDocument]:
        """Documents of the slowest requests by ``metric`` (one of METRIC_COLUMNS)."""
        column = METRIC_COLUMNS.get(metric)
        if column is None:
            raise ValueError(
                f"unknown metric {metric!r}; choose one of {', '.join(METRIC_COLUMNS)}"
            )
        query = f"{_SELECT_REQUEST} WHERE {column} IS NOT NULL"
        params: list[Any] = []
        if since_ns is not None:
            query += " AND start_ns >= ?"
            params.append(int(since_ns))
        query += f" ORDER BY {column} DESC LIMIT ?"
        params.append(max(0, int(limit)))
        with self._reader() as connection:
            rows = self._execute(connection, query, params).fetchall()
            spans_of: dict[bytes, bytes | None] = {}
            diagnosis = self._diagnosis(connection)
            return [self._document(connection, row, spans_of, diagnosis) for row in rows]

    def diagnosis_settings(self) -> DiagnosisConfig:
        """The collector's diagnosis settings, by which documents and windows of this store
        are derived (``_diagnosis``)."""
        with self._reader() as connection:
            return self._diagnosis(connection)

    def _diagnosis(self, connection: Any) -> DiagnosisConfig:
        """The collector's diagnosis settings (``META_DIAGNOSIS``); the defaults when none or
        unreadable ones were stored (a newer collector's, a hand-edited store)."""
        found = self._execute(
            connection, "SELECT value FROM meta WHERE key = ?", (META_DIAGNOSIS,)
        ).fetchone()
        return diagnosis_from_json(None if found is None else str(found[0]))

    def _document(
        self,
        connection: Any,
        row: Sequence[Any],
        spans_of: dict[bytes, bytes | None],
        diagnosis: DiagnosisConfig,
    ) -> RequestDocument:
        """The document of one stored row; its token times come from the trace's stored spans
        (read once per trace and call through ``spans_of``)."""
        trace_id = bytes(row[0])
        span_id = bytes(row[1])

        def load_decode() -> DecodeSpans:
            if trace_id not in spans_of:
                found = self._execute(
                    connection, "SELECT otlp FROM traces WHERE trace_id = ?", (trace_id,)
                ).fetchone()
                spans_of[trace_id] = None if found is None else bytes(found[0])
            otlp = spans_of[trace_id]
            if otlp is None:
                return DecodeSpans(None, [])
            try:
                return decode_from_otlp(otlp, span_id)
            except Exception:  # undecodable spans: the document says the times are missing
                return DecodeSpans(None, [])

        try:
            return document_from_row(row, load_decode=load_decode, diagnosis=diagnosis)
        except (TypeError, ValueError, KeyError, AttributeError) as error:
            raise StoreError(
                f"store {self.path}: request {trace_id.hex()}/{span_id.hex()} is unreadable "
                f"({type(error).__name__}: {error})"
            ) from error

    def list_requests(self, query: RequestPageQuery) -> RequestPage:
        """One page of the request list (``list_query.py``): summaries, the next page's cursor and
        the number of matches (capped).

        Raises ValueError for a cursor that is not one of this order's, ``QueryTimeoutError``
        for a query that runs too long, StoreError when the store cannot be read.
        """
        with self._reader() as connection:
            try:
                return self._run_page(connection, query)
            except UnreadableRowError as error:
                raise StoreError(f"store {self.path}: {error}") from error

    def segment_means(
        self, filter: RequestFilter, *, limit: int = _DEFAULT_SEGMENT_MEANS_ROWS
    ) -> tuple[int, dict[str, float]]:
        """Mean budget segments (ms) over up to ``limit`` matching requests, slowest E2E first:
        (requests averaged, {segment: mean ms}).

        Each request's segments are the ones its document's ``budget`` shows (exact µs, every
        known segment in ``semconv.SEGMENTS`` order, zeros included); the means are rounded to
        the µs. ``(0, {})`` when nothing matches. Rows that cannot be read are left out.
        """
        if not 1 <= limit <= _MAX_SEGMENT_MEANS_ROWS:
            raise ValueError(f"limit must be between 1 and {_MAX_SEGMENT_MEANS_ROWS}, not {limit}")
        with self._reader() as connection:
            rows = self._run_rows(
                connection,
                filter,
                columns=("detail",),
                sort=semconv.METRIC_E2E,
                descending=True,
                limit=limit,
            )
        sums: dict[str, float] = {}
        averaged = 0
        for (detail,) in rows:
            try:
                segments_ms = budget_segments_ms(budget_segments_ns(detail))
            except (TypeError, ValueError, KeyError, AttributeError):
                continue  # one unreadable row must not hide the others' budget
            averaged += 1
            for name, value_ms in segments_ms.items():
                sums[name] = sums.get(name, 0.0) + value_ms
        if not averaged:
            return 0, {}
        return averaged, {name: round(total / averaged, 3) for name, total in sums.items()}

    def sketches_since(self, since_s: float) -> list[SketchSlice]:
        """Stored sketch slices starting at or after ``since_s`` (unix seconds)."""
        return self.sketches_between(since_s, None)

    def sketches_between(self, since_s: float, until_s: float | None) -> list[SketchSlice]:
        """Stored sketch slices starting in [``since_s``, ``until_s``) (unix seconds; None:
        no upper end), oldest first."""
        query = (
            "SELECT slice_start_s, service, model, operation, prompt_bucket, metric, sketch "
            "FROM sketch_slices WHERE slice_start_s >= ?"
        )
        params: list[float] = [float(since_s)]
        if until_s is not None:
            query += " AND slice_start_s < ?"
            params.append(float(until_s))
        with self._reader() as connection:
            rows = self._execute(connection, query + " ORDER BY slice_start_s", params).fetchall()
        return [
            (start, (service, model, operation, bucket), metric, json.loads(sketch))
            for start, service, model, operation, bucket, metric, sketch in rows
        ]

    def slo_targets(self) -> tuple[list[SloTarget], list[str]]:
        """The collector's SLO targets (``META_SLO_TARGETS``), and why any could not be read
        (``processors.slo.targets_from_json``)."""
        return targets_from_json(self.meta(META_SLO_TARGETS))

    def collector_stats(self) -> dict[str, Any] | None:
        """The collector's stats (``META_COLLECTOR_STATS``): one collector's, or every live
        replica's of a shared store merged (``merge_collector_stats``); None when none or
        unreadable ones were written."""
        with self._reader() as connection:
            rows = self._execute(
                connection,
                "SELECT value FROM meta WHERE key = ? OR substr(key, 1, ?) = ?",
                (META_COLLECTOR_STATS, len(META_COLLECTOR_STATS) + 1, f"{META_COLLECTOR_STATS}/"),
            ).fetchall()
        snapshots = []
        for (raw,) in rows:
            try:
                snapshot = json.loads(raw)
            except ValueError:
                continue  # one replica's unreadable stats must not hide the others'
            if isinstance(snapshot, dict):
                snapshots.append(snapshot)
        if len(snapshots) == 1 and not self.shared:
            return snapshots[0]
        return merge_collector_stats(snapshots)

    def meta(self, key: str) -> str | None:
        with self._reader() as connection:
            row = self._execute(
                connection, "SELECT value FROM meta WHERE key = ?", (key,)
            ).fetchone()
        return None if row is None else str(row[0])

    def count(self) -> int:
        with self._reader() as connection:
            (total,) = self._execute(connection, "SELECT COUNT(*) FROM requests").fetchone()
        return int(total)

    def now(self) -> float:
        """The store's clock (unix seconds), for readers computing windows."""
        return self._clock()
