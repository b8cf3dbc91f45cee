"""The request store: one SQLite file (WAL) with every request's document, its trace's spans,
closed percentile-sketch slices and a little metadata.

One writer connection, owned by the collector's exporter thread, writes in batches (one
transaction each). Readers (CLI, API) use short-lived read-only connections, so WAL lets them
read while the writer writes. Every SQL value is a bound parameter; the only identifiers put
into SQL text come from fixed tables in this module.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import closing, contextmanager, suppress
from typing import Any, Final

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans
from tokentrace.agent import semconv
from tokentrace.collector.store.codec import SketchSlice, record_to_dict, request_start_ns
from tokentrace.processors.model import AssembledTrace, RequestRecord

SCHEMA_VERSION: Final = 1
"""``PRAGMA user_version`` of the schema below; a store with a newer one is refused."""

_DEFAULT_RETENTION_S: Final = 7 * 24 * 3600.0
_DEFAULT_MAX_REQUESTS: Final = 1_000_000
_DEFAULT_PRUNE_BATCH: Final = 10_000
"""Rows one ``prune()`` call deletes at most, so the writer never stalls for long."""
_DEFAULT_BUSY_TIMEOUT_S: Final = 5.0
_DEFAULT_MAX_TRACE_BYTES: Final = 4 * 1024 * 1024
"""Stored spans of one trace at most (a client may reuse one trace id for a whole session)."""
_MIN_PREFIX_HEX: Final = 8
_AMBIGUOUS_CANDIDATES_SHOWN: Final = 5
_NS_PER_S: Final = 1_000_000_000

META_SLO_TARGETS: Final = "slo_targets"
"""Meta key: the collector's SLO targets as a JSON list of target dicts."""
META_COLLECTOR_STARTED_NS: Final = "collector_started_ns"
"""Meta key: unix ns at which the collector writing this store started."""

_SCHEMA: Final = (
    """CREATE TABLE IF NOT EXISTS requests (
        trace_id BLOB NOT NULL,
        span_id BLOB NOT NULL,
        start_ns INTEGER NOT NULL,
        service TEXT NOT NULL,
        model TEXT NOT NULL,
        operation TEXT NOT NULL,
        prompt_bucket TEXT NOT NULL,
        dialect TEXT NOT NULL,
        e2e_ns INTEGER NOT NULL,
        ttft_ns INTEGER,
        tpot_ns INTEGER,
        queue_ns INTEGER,
        prefill_ns INTEGER,
        decode_ns INTEGER,
        network_ns INTEGER,
        input_tokens INTEGER,
        output_tokens INTEGER,
        segment TEXT,
        cause TEXT,
        verdict TEXT,
        slo_breached INTEGER NOT NULL,
        doc TEXT NOT NULL,
        PRIMARY KEY (trace_id, span_id)
    )""",
    "CREATE INDEX IF NOT EXISTS requests_start ON requests (start_ns)",
    "CREATE INDEX IF NOT EXISTS requests_model_start ON requests (model, start_ns)",
    "CREATE INDEX IF NOT EXISTS requests_e2e ON requests (e2e_ns)",
    "CREATE INDEX IF NOT EXISTS requests_ttft ON requests (ttft_ns)",
    "CREATE INDEX IF NOT EXISTS requests_cause ON requests (cause)",
    """CREATE TABLE IF NOT EXISTS traces (
        trace_id BLOB PRIMARY KEY,
        received_ns INTEGER NOT NULL,
        otlp BLOB NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS traces_received ON traces (received_ns)",
    """CREATE TABLE IF NOT EXISTS sketch_slices (
        slice_start_s INTEGER NOT NULL,  -- whole seconds stay integers, fractions stay REAL
        service TEXT NOT NULL,
        model TEXT NOT NULL,
        operation TEXT NOT NULL,
        prompt_bucket TEXT NOT NULL,
        metric TEXT NOT NULL,
        sketch TEXT NOT NULL,
        PRIMARY KEY (slice_start_s, service, model, operation, prompt_bucket, metric)
    )""",
    """CREATE TABLE IF NOT EXISTS meta (
        key TEXT PRIMARY KEY,
        value TEXT NOT NULL
    )""",
)

_INSERT_REQUEST: Final = (
    "INSERT OR REPLACE INTO requests (trace_id, span_id, start_ns, service, model, operation, "
    "prompt_bucket, dialect, e2e_ns, ttft_ns, tpot_ns, queue_ns, prefill_ns, decode_ns, "
    "network_ns, input_tokens, output_tokens, segment, cause, verdict, slo_breached, doc) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
# Spans of a trace that arrive in several assembled parts (late spans, several requests in one
# trace) are appended: concatenated serialised ExportTraceServiceRequests parse as one message
# holding all their resource_spans. Past the size cap the newest part replaces the stored ones.
_UPSERT_TRACE: Final = (
    "INSERT INTO traces (trace_id, received_ns, otlp) VALUES (?, ?, ?) "
    "ON CONFLICT (trace_id) DO UPDATE SET received_ns = excluded.received_ns, "
    "otlp = CASE WHEN length(otlp) + length(excluded.otlp) <= ? "
    "THEN CAST(otlp || excluded.otlp AS BLOB) ELSE excluded.otlp END"
)

SLOWEST_METRIC_COLUMNS: Final = {
    semconv.METRIC_E2E: "e2e_ns",
    semconv.METRIC_TTFT: "ttft_ns",
    semconv.METRIC_TPOT: "tpot_ns",
    semconv.METRIC_QUEUE: "queue_ns",
    semconv.METRIC_PREFILL: "prefill_ns",
    semconv.METRIC_DECODE: "decode_ns",
    semconv.METRIC_NETWORK: "network_ns",
}
"""Metrics ``slowest`` can order by -> their column (the only column names put into SQL)."""


class StoreError(Exception):
    """A request store cannot be opened or used; the message says what to do."""


class StoreNotFoundError(StoreError):
    """No store file at the given path."""


class StoreWriteError(StoreError):
    """Part or all of a ``write`` batch was not stored.

    ``rejected``: request records not stored (malformed records, or every record of the batch
    when the transaction failed and rolled back). ``written``: records stored despite the error.
    """

    def __init__(self, message: str, *, rejected: int, written: int) -> None:
        super().__init__(message)
        self.rejected = rejected
        self.written = written


def _readonly_uri(path: str) -> str:
    return "file:" + urllib.parse.quote(os.path.abspath(path)) + "?mode=ro"


def _optional_int(value: int | None) -> int | None:
    return None if value is None else int(value)


def _request_row(record: RequestRecord) -> tuple[Any, ...]:
    """The ``requests`` row of one record; raises on a malformed record."""
    timeline = record.timeline
    metrics = record.metrics
    verdict = record.verdict
    doc = record_to_dict(record)
    trace_id = bytes(timeline.trace_id)
    span_id = bytes(timeline.span_id)
    if not trace_id or not span_id:
        raise ValueError("request record without trace or span id")
    return (
        trace_id,
        span_id,
        request_start_ns(timeline),
        str(timeline.service),
        str(timeline.model),
        str(timeline.operation),
        str(record.prompt_bucket),
        str(timeline.dialect),
        int(record.budget.e2e_ns),
        _optional_int(metrics.ttft),
        _optional_int(metrics.tpot),
        _optional_int(metrics.queue),
        _optional_int(metrics.prefill),
        _optional_int(metrics.decode),
        _optional_int(metrics.network),
        _optional_int(timeline.input_tokens),
        _optional_int(timeline.output_tokens),
        verdict.segment if verdict is not None else None,
        verdict.cause if verdict is not None else None,
        verdict.sentence if verdict is not None else None,
        sum(1 for met in record.slo.values() if not met),
        json.dumps(doc, separators=(",", ":"), allow_nan=False),
    )


def trace_to_otlp(trace: AssembledTrace) -> bytes:
    """The trace's spans as one serialised ``ExportTraceServiceRequest``.

    Spans are grouped under their resource and scope by identity (a receiver shares one
    Resource/InstrumentationScope object among the spans that arrived under it).
    """
    request = ExportTraceServiceRequest()
    groups: dict[tuple[int, int], ScopeSpans] = {}
    resources: dict[int, ResourceSpans] = {}
    for ref in trace.spans:
        resource_key = id(ref.resource)
        resource_spans = resources.get(resource_key)
        if resource_spans is None:
            resource_spans = request.resource_spans.add()
            resource_spans.resource.CopyFrom(ref.resource)
            resources[resource_key] = resource_spans
        group_key = (resource_key, id(ref.scope))
        scope_spans = groups.get(group_key)
        if scope_spans is None:
            scope_spans = resource_spans.scope_spans.add()
            scope_spans.scope.CopyFrom(ref.scope)
            groups[group_key] = scope_spans
        scope_spans.spans.append(ref.span)
    return request.SerializeToString()


def _prefix_range(prefix_hex: str) -> tuple[bytes, bytes | None]:
    """Byte range [low, high) of every id that starts with ``prefix_hex`` (any id length)."""
    padded = prefix_hex if len(prefix_hex) % 2 == 0 else prefix_hex + "0"
    low = bytes.fromhex(padded)
    top = prefix_hex if len(prefix_hex) % 2 == 0 else prefix_hex + "f"
    high = bytearray(bytes.fromhex(top))
    # The smallest byte string greater than every string starting with `top`.
    while high and high[-1] == 0xFF:
        high.pop()
    if not high:
        return low, None
    high[-1] += 1
    return low, bytes(high)


def _parse_id(text: str, *, what: str) -> str:
    cleaned = text.strip().lower()
    if cleaned.startswith("0x"):
        cleaned = cleaned[2:]
    if not cleaned or any(c not in "0123456789abcdef" for c in cleaned):
        raise ValueError(f"{what} {text!r} is not hexadecimal")
    return cleaned


class RequestStore:
    """SQLite request store. See the module docstring for the threading model."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        retention_s: float = _DEFAULT_RETENTION_S,
        max_requests: int = _DEFAULT_MAX_REQUESTS,
        prune_batch: int = _DEFAULT_PRUNE_BATCH,
        max_trace_bytes: int = _DEFAULT_MAX_TRACE_BYTES,
        busy_timeout_s: float = _DEFAULT_BUSY_TIMEOUT_S,
        clock: Callable[[], float] = time.time,
        _readonly: bool = False,
    ) -> None:
        self.path = os.fspath(path)
        self.retention_s = float(retention_s)
        self.max_requests = int(max_requests)
        self.prune_batch = max(1, int(prune_batch))
        self.max_trace_bytes = int(max_trace_bytes)
        self._busy_timeout_s = float(busy_timeout_s)
        self._clock = clock
        self.readonly = _readonly
        # Counters, read by the collector's self-metrics.
        self.written_requests = 0
        self.written_traces = 0
        self.rejected_records = 0
        self.failed_traces = 0
        self.written_slices = 0
        self.failed_batches = 0
        self.pruned_requests = 0
        self.pruned_traces = 0
        self.pruned_slices = 0
        # The writer connection may be created on one thread and used on the exporter thread;
        # the lock keeps accidental concurrent use safe instead of corrupting a transaction.
        self._lock = threading.Lock()
        self._writer: sqlite3.Connection | None = None
        if _readonly:
            with closing(self._connect_readonly()) as connection:
                self._check_version(connection)
        else:
            self._writer = self._open_writer()

    # --- opening -----------------------------------------------------------------------------

    @classmethod
    def open_readonly(
        cls, path: str | os.PathLike[str], *, clock: Callable[[], float] = time.time
    ) -> RequestStore:
        """A reader for an existing store; raises StoreNotFoundError when there is none."""
        return cls(path, clock=clock, _readonly=True)

    def _open_writer(self) -> sqlite3.Connection:
        directory = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(directory):
            raise StoreError(f"cannot create store {self.path}: directory {directory} missing")
        try:
            connection = sqlite3.connect(
                self.path,
                timeout=self._busy_timeout_s,
                isolation_level=None,  # explicit BEGIN/COMMIT below
                check_same_thread=False,  # guarded by self._lock
            )
        except sqlite3.Error as error:
            raise StoreError(f"cannot open store {self.path}: {error}") from error
        try:
            self._check_version(connection, creating=True)
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("PRAGMA synchronous=NORMAL")
            connection.execute("PRAGMA foreign_keys=OFF")
            connection.execute("BEGIN IMMEDIATE")
            for statement in _SCHEMA:
                connection.execute(statement)
            connection.execute(f"PRAGMA user_version={SCHEMA_VERSION:d}")
            connection.execute("COMMIT")
        except sqlite3.Error as error:
            connection.close()
            raise StoreError(f"cannot initialise store {self.path}: {error}") from error
        except StoreError:
            connection.close()
            raise
        return connection

    def _connect_readonly(self) -> sqlite3.Connection:
        if not os.path.exists(self.path):
            raise StoreNotFoundError(
                f"no store at {self.path} - start `tokentrace collector` first or pass --store"
            )
        try:
            connection = sqlite3.connect(
                _readonly_uri(self.path), uri=True, timeout=self._busy_timeout_s
            )
        except sqlite3.Error as error:
            raise StoreError(f"cannot open store {self.path}: {error}") from error
        return connection

    def _check_version(self, connection: sqlite3.Connection, *, creating: bool = False) -> None:
        """Refuse newer schemas, and databases that are not tokentrace stores."""
        try:
            (version,) = connection.execute("PRAGMA user_version").fetchone()
            tables = connection.execute(
                "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table'"
            ).fetchone()[0]
        except sqlite3.DatabaseError as error:
            raise StoreError(f"{self.path} is not a tokentrace store: {error}") from error
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"store {self.path} has schema version {version}, newer than this tokentrace "
                f"supports ({SCHEMA_VERSION}); upgrade tokentrace or use another --store"
            )
        # Version 0: a new file (fine when creating it) or some other program's database.
        if version == 0 and (tables or not creating):
            raise StoreError(f"{self.path} is not a tokentrace store (no tokentrace schema)")

    @contextmanager
    def _reader(self) -> Iterator[sqlite3.Connection]:
        connection = self._connect_readonly()
        try:
            yield connection
        except sqlite3.Error as error:
            raise StoreError(f"cannot read store {self.path}: {error}") from error
        finally:
            connection.close()

    def _require_writer(self) -> sqlite3.Connection:
        if self._writer is None:
            raise StoreError(f"store {self.path} is open read-only or closed")
        return self._writer

    # --- writer API --------------------------------------------------------------------------

    def write(self, batch: Sequence[tuple[AssembledTrace, Sequence[RequestRecord]]]) -> None:
        """Store every request record of the batch and each trace's spans, in one transaction.

        A malformed record is left out (counted in ``rejected_records``) and the rest is stored;
        then StoreWriteError reports it. A database error rolls the whole batch back and raises
        StoreWriteError with every record counted as rejected.
        """
        request_rows: list[tuple[Any, ...]] = []
        trace_rows: list[tuple[bytes, int, bytes, int]] = []
        rejected = 0
        traces_failed = 0
        first_problem: str | None = None
        received_ns = int(self._clock() * _NS_PER_S)
        for item in batch:
            try:
                trace, records = item
                rows = [_request_row(record) for record in records]
            except Exception as error:  # a garbage item must not stop the batch
                rejected += _records_in(item)
                first_problem = first_problem or f"{type(error).__name__}: {error}"
                continue
            if not rows:
                continue
            request_rows.extend(rows)
            try:
                trace_rows.append(
                    (bytes(trace.trace_id), received_ns, trace_to_otlp(trace), self.max_trace_bytes)
                )
            except Exception as error:  # the requests are still worth keeping without spans
                traces_failed += 1
                first_problem = first_problem or f"{type(error).__name__}: {error}"

        if request_rows:
            with self._lock:
                connection = self._require_writer()
                try:
                    connection.execute("BEGIN IMMEDIATE")
                    connection.executemany(_INSERT_REQUEST, request_rows)
                    connection.executemany(_UPSERT_TRACE, trace_rows)
                    connection.execute("COMMIT")
                except sqlite3.Error as error:
                    _rollback(connection)
                    self.failed_batches += 1
                    self.rejected_records += rejected + len(request_rows)
                    raise StoreWriteError(
                        f"store {self.path}: batch rolled back: {error}",
                        rejected=rejected + len(request_rows),
                        written=0,
                    ) from error
            self.written_requests += len(request_rows)
            self.written_traces += len(trace_rows)
        if first_problem is not None:
            self.rejected_records += rejected
            self.failed_traces += traces_failed
            raise StoreWriteError(
                f"store {self.path}: {rejected} malformed request record(s) left out, "
                f"{traces_failed} trace(s) stored without spans ({first_problem})",
                rejected=rejected,
                written=len(request_rows),
            )

    def write_sketch_slices(self, slices: Iterable[tuple[float, Any, str, Any]]) -> None:
        """Store sketch slices ``(slice_start_s, SketchKey, metric, LatencySketch)``.

        The key may also be a (service, model, operation, prompt_bucket) tuple and the sketch a
        ``to_dict()`` dict. A slice written again replaces the stored one: the collector rewrites
        its open slices with their cumulative content until they close, so ``top`` stays live.
        """
        rows: list[tuple[float, str, str, str, str, str, str]] = []
        try:
            for slice_start_s, key, metric, sketch in slices:
                if hasattr(key, "service"):
                    service, model = key.service, key.model
                    operation, bucket = key.operation, key.prompt_bucket
                else:
                    service, model, operation, bucket = key
                sketch_dict = sketch if isinstance(sketch, dict) else sketch.to_dict()
                rows.append(
                    (
                        _slice_start(slice_start_s),
                        str(service),
                        str(model),
                        str(operation),
                        str(bucket),
                        str(metric),
                        json.dumps(sketch_dict, separators=(",", ":"), allow_nan=False),
                    )
                )
        except Exception as error:
            raise StoreError(f"store {self.path}: malformed sketch slice: {error}") from error
        if not rows:
            return
        with self._lock:
            connection = self._require_writer()
            try:
                connection.execute("BEGIN IMMEDIATE")
                connection.executemany(
                    "INSERT OR REPLACE INTO sketch_slices (slice_start_s, service, model, "
                    "operation, prompt_bucket, metric, sketch) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    rows,
                )
                connection.execute("COMMIT")
            except sqlite3.Error as error:
                _rollback(connection)
                raise StoreError(f"store {self.path}: sketch slices not stored: {error}") from error
        self.written_slices += len(rows)

    def set_meta(self, key: str, value: str) -> None:
        with self._lock:
            connection = self._require_writer()
            try:
                connection.execute(
                    "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, str(value))
                )
            except sqlite3.Error as error:
                raise StoreError(f"store {self.path}: meta {key!r} not stored: {error}") from error

    def prune(self) -> int:
        """Delete requests older than the retention or beyond ``max_requests`` (oldest first),
        their traces, and old sketch slices; at most ``prune_batch`` requests per call.

        Returns the number of requests deleted; call again while it returns ``prune_batch``.
        """
        cutoff_ns = int((self._clock() - self.retention_s) * _NS_PER_S)
        with self._lock:
            connection = self._require_writer()
            try:
                connection.execute("BEGIN IMMEDIATE")
                (total,) = connection.execute("SELECT COUNT(*) FROM requests").fetchone()
                excess = max(0, total - self.max_requests)
                # Oldest first: everything past retention, then more while over max_requests.
                # Two index-ordered queries; an OR of both conditions would scan the table.
                victims = connection.execute(
                    "SELECT rowid, trace_id FROM requests WHERE start_ns < ? "
                    "ORDER BY start_ns LIMIT ?",
                    (cutoff_ns, self.prune_batch),
                ).fetchall()
                if excess > len(victims) and len(victims) < self.prune_batch:
                    victims = connection.execute(
                        "SELECT rowid, trace_id FROM requests ORDER BY start_ns LIMIT ?",
                        (min(excess, self.prune_batch),),
                    ).fetchall()
                connection.executemany(
                    "DELETE FROM requests WHERE rowid = ?", [(rowid,) for rowid, _ in victims]
                )
                trace_ids = {(trace_id,) for _, trace_id in victims}
                before = connection.total_changes
                connection.executemany(
                    "DELETE FROM traces WHERE trace_id = ? AND NOT EXISTS "
                    "(SELECT 1 FROM requests WHERE requests.trace_id = traces.trace_id)",
                    list(trace_ids),
                )
                pruned_traces = connection.total_changes - before
                before = connection.total_changes
                connection.execute(
                    "DELETE FROM traces WHERE rowid IN (SELECT rowid FROM traces "
                    "WHERE received_ns < ? LIMIT ?)",
                    (cutoff_ns, self.prune_batch),
                )
                pruned_traces += connection.total_changes - before
                before = connection.total_changes
                connection.execute(
                    "DELETE FROM sketch_slices WHERE rowid IN (SELECT rowid FROM sketch_slices "
                    "WHERE slice_start_s < ? LIMIT ?)",
                    (cutoff_ns // _NS_PER_S, self.prune_batch),
                )
                pruned_slices = connection.total_changes - before
                connection.execute("COMMIT")
            except sqlite3.Error as error:
                _rollback(connection)
                raise StoreError(f"store {self.path}: prune failed: {error}") from error
        self.pruned_requests += len(victims)
        self.pruned_traces += pruned_traces
        self.pruned_slices += pruned_slices
        return len(victims)

    def close(self) -> None:
        with self._lock:
            if self._writer is not None:
                with suppress(sqlite3.Error):  # only a query-planner hint
                    self._writer.execute("PRAGMA optimize")
                self._writer.close()
                self._writer = None

    def __enter__(self) -> RequestStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- reader API --------------------------------------------------------------------------

    def get(self, trace_id: str, *, span_id: str | None = None) -> dict[str, Any] | None:
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
        low, high = _prefix_range(prefix)
        query = "SELECT DISTINCT trace_id FROM requests WHERE trace_id >= ?"
        params: list[Any] = [low]
        if high is not None:
            query += " AND trace_id < ?"
            params.append(high)
        query += " LIMIT ?"
        params.append(_AMBIGUOUS_CANDIDATES_SHOWN + 1)
        with self._reader() as connection:
            matches = [row[0] for row in connection.execute(query, params)]
            if not matches:
                return None
            if len(matches) > 1:
                shown = ", ".join(bytes(m).hex() for m in matches[:_AMBIGUOUS_CANDIDATES_SHOWN])
                more = " ..." if len(matches) > _AMBIGUOUS_CANDIDATES_SHOWN else ""
                raise ValueError(
                    f"trace id prefix {prefix!r} matches several traces: {shown}{more}; "
                    "give more digits"
                )
            rows = connection.execute(
                "SELECT span_id, doc FROM requests WHERE trace_id = ? ORDER BY e2e_ns DESC",
                (matches[0],),
            ).fetchall()
        chosen = rows[0]
        if span_id is not None:
            wanted = _parse_id(span_id, what="span id")
            picked = [row for row in rows if bytes(row[0]).hex().startswith(wanted)]
            if not picked:
                return None
            chosen = picked[0]
        doc: dict[str, Any] = json.loads(chosen[1])
        doc["other_span_ids"] = [bytes(row[0]).hex() for row in rows if row is not chosen]
        return doc

    def trace_otlp(self, trace_id: str | bytes) -> bytes | None:
        """The stored spans of a trace as a serialised ``ExportTraceServiceRequest``."""
        key = (
            bytes.fromhex(_parse_id(trace_id, what="trace id"))
            if isinstance(trace_id, str)
            else bytes(trace_id)
        )
        with self._reader() as connection:
            row = connection.execute(
                "SELECT otlp FROM traces WHERE trace_id = ?", (key,)
            ).fetchone()
        return None if row is None else bytes(row[0])

    def slowest(
        self, *, metric: str = semconv.METRIC_E2E, since_ns: int | None = None, limit: int = 10
    ) -> list[dict[str, Any]]:
        """Documents of the slowest requests by ``metric`` (one of SLOWEST_METRIC_COLUMNS)."""
        column = SLOWEST_METRIC_COLUMNS.get(metric)
        if column is None:
            raise ValueError(
                f"unknown metric {metric!r}; choose one of {', '.join(SLOWEST_METRIC_COLUMNS)}"
            )
        query = f"SELECT doc FROM requests WHERE {column} IS NOT NULL"
        params: list[Any] = []
        if since_ns is not None:
            query += " AND start_ns >= ?"
            params.append(int(since_ns))
        query += f" ORDER BY {column} DESC LIMIT ?"
        params.append(max(0, int(limit)))
        with self._reader() as connection:
            return [json.loads(row[0]) for row in connection.execute(query, params)]

    def sketches_since(self, since_s: float) -> list[SketchSlice]:
        """Stored sketch slices starting at or after ``since_s`` (unix seconds)."""
        with self._reader() as connection:
            rows = connection.execute(
                "SELECT slice_start_s, service, model, operation, prompt_bucket, metric, sketch "
                "FROM sketch_slices WHERE slice_start_s >= ? ORDER BY slice_start_s",
                (float(since_s),),
            ).fetchall()
        return [
            (start, (service, model, operation, bucket), metric, json.loads(sketch))
            for start, service, model, operation, bucket, metric, sketch in rows
        ]

    def meta(self, key: str) -> str | None:
        with self._reader() as connection:
            row = connection.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def count(self) -> int:
        with self._reader() as connection:
            (total,) = connection.execute("SELECT COUNT(*) FROM requests").fetchone()
        return int(total)

    def now(self) -> float:
        """The store's clock (unix seconds), for readers computing windows."""
        return self._clock()


def _slice_start(value: float) -> float:
    """Slice starts are multiples of the slice length: keep fractions (e.g. 2.5 s slices)
    so that neighbouring slices never collide on one key."""
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"slice start {value!r} is not a finite number")
    return int(number) if number.is_integer() else number


def _records_in(item: Any) -> int:
    try:
        return max(1, len(item[1]))
    except Exception:
        return 1


def _rollback(connection: sqlite3.Connection) -> None:
    try:
        if connection.in_transaction:
            connection.execute("ROLLBACK")
    except sqlite3.Error:
        pass  # the connection is broken: the next BEGIN reports it
