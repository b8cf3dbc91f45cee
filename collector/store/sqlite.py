"""The request store: one SQLite file (WAL) with one row per request, its trace's spans,
closed percentile-sketch slices and a little metadata.

One writer connection, owned by the collector's exporter thread, writes in batches (one
transaction each). Readers (CLI, API) use short-lived read-only connections, so WAL lets them
read while the writer writes. Every SQL value is a bound parameter; the only identifiers put
into SQL text come from fixed tables in this module.

A late fragment (spans that reached the collector after their trace was assembled) re-derives
its trace's requests from the stored spans plus its own: its batch item says which stored request
rows its records replace (``write``'s ``replacing``), and those rows are deleted in the same
transaction that inserts the new ones, while only the fragment's spans are appended to the
stored trace. The collector reads the stored spans back on the writer's thread through a
read-only connection (``trace_otlp``, size-capped), which sees every committed batch.

Writes are hot, reads are rare: a request row holds the columns the queries use and a compact
``detail`` (``codec.request_row``); the document ``explain`` prints is built when it is read
(``codec.document_from_row``), with token times read back from the stored spans. WAL
checkpoints (copying the log into the database file, with its fsync) run on a background
thread with its own connection, so they never stall the writer; the writer's own automatic
checkpoint stays on as a backstop at a larger log size, in case that thread falls behind.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import closing, contextmanager, suppress
from typing import Any, Final, TypeAlias

from tokentrace.agent import semconv
from tokentrace.collector.encoding import encode_trace_request
from tokentrace.collector.store.codec import (
    METRIC_COLUMNS,
    REQUEST_COLUMNS,
    DecodeSpans,
    SketchSlice,
    budget_segments_ms,
    budget_segments_ns,
    decode_from_otlp,
    diagnosis_from_json,
    document_from_row,
    request_row,
)
from tokentrace.collector.store.query import (
    START_INDEX_COLUMNS,
    TEXT_INDEX_COLUMNS,
    RequestFilter,
    RequestPage,
    RequestPageQuery,
    UnreadableRowError,
    run_page,
    run_rows,
    trace_prefix_range,
)
from tokentrace.processors.diagnosis import DiagnosisConfig
from tokentrace.processors.model import AssembledTrace, RequestRecord

SCHEMA_VERSION: Final = 3
"""``PRAGMA user_version`` of the schema below; a store with another one is refused.

1: one JSON document per request, built at write time. 2: columns + compact ``detail``.
3: a ``request_id`` column and the list API's indexes."""

_DEFAULT_RETENTION_S: Final = 7 * 24 * 3600.0
_DEFAULT_MAX_REQUESTS: Final = 1_000_000
_DEFAULT_PRUNE_BATCH: Final = 10_000
"""Rows one ``prune()`` call deletes at most, so the writer never stalls for long."""
_DEFAULT_BUSY_TIMEOUT_S: Final = 5.0
_DEFAULT_MAX_TRACE_BYTES: Final = 4 * 1024 * 1024
"""Stored spans of one trace at most (a client may reuse one trace id for a whole session)."""
_DEFAULT_CHECKPOINT_BYTES: Final = 4 * 1024 * 1024
"""Bytes written after which the background thread checkpoints the WAL (SQLite's default
automatic checkpoint is at 1000 pages, about the same)."""
_DEFAULT_CHECKPOINT_IDLE_S: Final = 1.0
"""A quiet writer's last writes are checkpointed after this long."""
_BACKSTOP_AUTOCHECKPOINT_PAGES: Final = 16_384
"""The writer checkpoints itself past this many WAL pages (64 MiB of 4 KiB pages): only when
the background checkpoints fall behind, which bounds the log either way."""
_DEFAULT_SEGMENT_MEANS_ROWS: Final = 500
_MAX_SEGMENT_MEANS_ROWS: Final = 10_000
_MIN_PREFIX_HEX: Final = 8
_AMBIGUOUS_CANDIDATES_SHOWN: Final = 5
_NS_PER_S: Final = 1_000_000_000

_IN_BATCH: Final = 500
"""Ids per ``IN (...)`` query: well under SQLite's bound-parameter limit."""
META_SLO_TARGETS: Final = "slo_targets"
"""Meta key: the collector's SLO targets as a JSON list of target dicts."""
META_COLLECTOR_STARTED_NS: Final = "collector_started_ns"
"""Meta key: unix ns at which the collector writing this store started."""
META_COLLECTOR_STATS: Final = "collector_stats"
"""Meta key: the collector's counters as JSON, rewritten about once a second."""
META_DIAGNOSIS: Final = "diagnosis"
"""Meta key: the collector's diagnosis settings as JSON (``DiagnosisConfig`` fields), by which
a document's verdicts about its other metrics are derived when it is read."""

WriteItem: TypeAlias = (
    "tuple[AssembledTrace, Sequence[RequestRecord]]"
    " | tuple[AssembledTrace, Sequence[RequestRecord], bytes]"
)
"""One trace to store: its spans, its request records and, when the caller has it, the trace
already serialised as an ``ExportTraceServiceRequest`` (else the store encodes it)."""

REQUEST_INDEXES: Final = {
    # Orders. requests_start carries every filter column, so a walk in start order checks any
    # mix of filters inside the index (a table read per checked row costs ~10x more); it is
    # written in start order, so the width costs bytes, not extra pages per batch. The request
    # ids, for substring search, are in a narrow index of their own in start order too.
    "requests_start": "CREATE INDEX IF NOT EXISTS requests_start ON requests "
    f"({', '.join(START_INDEX_COLUMNS)})",
    "requests_request_id": "CREATE INDEX IF NOT EXISTS requests_request_id ON requests "
    f"({', '.join(TEXT_INDEX_COLUMNS)})",
    "requests_e2e": "CREATE INDEX IF NOT EXISTS requests_e2e ON requests (e2e_ns)",
    "requests_ttft": "CREATE INDEX IF NOT EXISTS requests_ttft ON requests (ttft_ns)",
    # Seeks: the matches of one filter value, in start order.
    "requests_service": "CREATE INDEX IF NOT EXISTS requests_service ON requests "
    "(service, start_ns)",
    "requests_model": "CREATE INDEX IF NOT EXISTS requests_model ON requests (model, start_ns)",
    "requests_operation": "CREATE INDEX IF NOT EXISTS requests_operation ON requests "
    "(operation, start_ns)",
    "requests_bucket": "CREATE INDEX IF NOT EXISTS requests_bucket ON requests "
    "(prompt_bucket, start_ns)",
    "requests_cause": "CREATE INDEX IF NOT EXISTS requests_cause ON requests (cause, start_ns)",
    "requests_segment": "CREATE INDEX IF NOT EXISTS requests_segment ON requests "
    "(segment, start_ns)",
    "requests_breached": "CREATE INDEX IF NOT EXISTS requests_breached ON requests (start_ns) "
    "WHERE slo_breached > 0",
}
"""The ``requests`` indexes by name; ``query.py`` says which query uses which.

The primary key serves ``get`` (trace id prefix ranges). ``requests_start`` serves ``prune``,
``--since`` and the list in start order, and the list's mixed filters (a scan of it reads a
tenth of the table); ``requests_request_id`` its request id search (a scan of it, a twentieth;
an index on the request id alone would be written at random places). ``requests_e2e`` and
``requests_ttft`` serve ``slowest`` and the list in those orders; they are written at random
places, so they stay narrow (carrying the filter columns too measured +20 us per stored
request). Other ``slowest`` metrics scan: an index costs every write. The (filter column,
start_ns) indexes and the partial ``requests_breached`` (only the few breaching requests) find
and count the matches of one rare value directly; they are written at a few places per batch
(one per value)."""

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
        slo_breached INTEGER NOT NULL,  -- SLO targets missed (0: none)
        request_id TEXT,
        detail TEXT NOT NULL,  -- codec.request_row: the rest of the record, compact JSON
        PRIMARY KEY (trace_id, span_id)
    )""",
    *REQUEST_INDEXES.values(),
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

_COLUMN_LIST: Final = ", ".join(REQUEST_COLUMNS)
_INSERT_REQUEST: Final = (
    f"INSERT OR REPLACE INTO requests ({_COLUMN_LIST}) "
    f"VALUES ({', '.join('?' * len(REQUEST_COLUMNS))})"
)
_SELECT_REQUEST: Final = f"SELECT {_COLUMN_LIST} FROM requests"
_DELETE_REQUEST: Final = "DELETE FROM requests WHERE trace_id = ? AND span_id = ?"
# Spans of a trace that arrive in several assembled parts (late spans, several requests in one
# trace) are appended: concatenated serialised ExportTraceServiceRequests parse as one message
# holding all their resource_spans. Past the size cap the newest part replaces the stored ones;
# the CASE only reaches its second WHEN then, so that function call counts each replacement.
_TRACE_REPLACED_FUNCTION: Final = "tokentrace_trace_replaced"
_UPSERT_TRACE: Final = (
    "INSERT INTO traces (trace_id, received_ns, otlp) VALUES (?, ?, ?) "
    "ON CONFLICT (trace_id) DO UPDATE SET received_ns = excluded.received_ns, "
    "otlp = CASE WHEN length(otlp) + length(excluded.otlp) <= ? "
    "THEN CAST(otlp || excluded.otlp AS BLOB) "
    f"WHEN {_TRACE_REPLACED_FUNCTION}() THEN excluded.otlp ELSE excluded.otlp END"
)

SLOWEST_METRIC_COLUMNS: Final = METRIC_COLUMNS
"""Metrics ``slowest`` can order by -> their column."""


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


def _parse_id(text: str, *, what: str) -> str:
    cleaned = text.strip().lower()
    if cleaned.startswith("0x"):
        cleaned = cleaned[2:]
    if not cleaned or any(c not in "0123456789abcdef" for c in cleaned):
        raise ValueError(f"{what} {text!r} is not hexadecimal")
    return cleaned


class _Checkpointer:
    """Checkpoints the WAL on its own thread and connection.

    A checkpoint copies the log into the database file and fsyncs it: milliseconds that would
    otherwise land inside the writer's COMMIT every few MiB. SQLite runs the statement without
    the GIL, and a PASSIVE checkpoint never waits for (or blocks) the writer or readers. Never
    raises: a failure is counted, and the writer's backstop checkpoint still bounds the log.
    """

    def __init__(self, path: str, *, busy_timeout_s: float, idle_s: float) -> None:
        self._path = path
        self._busy_timeout_s = busy_timeout_s
        self._idle_s = idle_s
        self._wanted = threading.Event()
        self._stopping = False
        self._dirty = False
        self.checkpoints = 0
        self.failures = 0
        self._thread = threading.Thread(
            target=self._run, name="tokentrace-store-checkpoint", daemon=True
        )
        self._thread.start()

    def wrote(self, *, checkpoint_now: bool) -> None:
        """Called by the writer after each commit (cheap: no lock, no I/O)."""
        self._dirty = True
        if checkpoint_now:
            self._wanted.set()

    def close(self, timeout_s: float) -> None:
        self._stopping = True
        self._wanted.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            connection = sqlite3.connect(
                self._path, timeout=self._busy_timeout_s, isolation_level=None
            )
        except sqlite3.Error:
            self.failures += 1
            return
        try:
            while not self._stopping:
                self._wanted.wait(self._idle_s)
                self._wanted.clear()
                if self._stopping or not self._dirty:
                    continue
                self._dirty = False
                try:
                    connection.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                except sqlite3.Error:
                    self.failures += 1
                else:
                    self.checkpoints += 1
        finally:
            connection.close()


class RequestStore:
    """SQLite request store. See the module docstring for the threading model.

    Limits, each with a counter: ``retention_s`` and ``max_requests`` (``prune`` deletes the
    oldest requests and their traces: ``pruned_requests``, ``pruned_traces``), and
    ``max_trace_bytes``: the serialised spans stored for one trace at most. A trace written in
    several parts (late spans, several requests) is appended to while it stays under the cap;
    a part that would take it past the cap replaces the spans stored so far instead
    (``replaced_traces`` counts those replacements; the replaced spans are gone, so an older
    request of that trace may lose its token times). A single part larger than the cap is
    still stored whole.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        retention_s: float = _DEFAULT_RETENTION_S,
        max_requests: int = _DEFAULT_MAX_REQUESTS,
        prune_batch: int = _DEFAULT_PRUNE_BATCH,
        max_trace_bytes: int = _DEFAULT_MAX_TRACE_BYTES,
        busy_timeout_s: float = _DEFAULT_BUSY_TIMEOUT_S,
        checkpoint_bytes: int = _DEFAULT_CHECKPOINT_BYTES,
        clock: Callable[[], float] = time.time,
        _readonly: bool = False,
    ) -> None:
        self.path = os.fspath(path)
        self.retention_s = float(retention_s)
        self.max_requests = int(max_requests)
        self.prune_batch = max(1, int(prune_batch))
        self.max_trace_bytes = int(max_trace_bytes)
        self._busy_timeout_s = float(busy_timeout_s)
        self.checkpoint_bytes = max(1, int(checkpoint_bytes))
        self._bytes_since_checkpoint = 0
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
        self.replaced_traces = 0
        """Trace writes whose spans replaced the stored ones because of ``max_trace_bytes``."""
        self._replaced_in_batch = 0
        # The writer connection may be created on one thread and used on the exporter thread;
        # the lock keeps accidental concurrent use safe instead of corrupting a transaction.
        self._lock = threading.Lock()
        self._writer: sqlite3.Connection | None = None
        self._checkpointer: _Checkpointer | None = None
        if _readonly:
            with closing(self._connect_readonly()) as connection:
                self._check_version(connection)
        else:
            self._writer = self._open_writer()
            self._checkpointer = _Checkpointer(
                self.path, busy_timeout_s=self._busy_timeout_s, idle_s=_DEFAULT_CHECKPOINT_IDLE_S
            )

    @property
    def checkpoints(self) -> int:
        """Background WAL checkpoints run so far (for the collector's self-metrics)."""
        return 0 if self._checkpointer is None else self._checkpointer.checkpoints

    @property
    def failed_checkpoints(self) -> int:
        return 0 if self._checkpointer is None else self._checkpointer.failures

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
            connection.create_function(_TRACE_REPLACED_FUNCTION, 0, self._trace_replaced)
            self._check_version(connection, creating=True)
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("PRAGMA synchronous=NORMAL")
            connection.execute("PRAGMA foreign_keys=OFF")
            connection.execute(f"PRAGMA wal_autocheckpoint={_BACKSTOP_AUTOCHECKPOINT_PAGES:d}")
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

    def _trace_replaced(self) -> int:
        """Called by SQLite inside ``_UPSERT_TRACE`` once per replaced trace (writer thread)."""
        self._replaced_in_batch += 1
        return 1

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
        """Refuse other schema versions, and databases that are not tokentrace stores."""
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
        if 0 < version < SCHEMA_VERSION:
            raise StoreError(
                f"store {self.path} has schema version {version}, older than this tokentrace "
                f"uses ({SCHEMA_VERSION}); it cannot be read or extended - move it aside (or "
                "delete it) and start the collector again, or use another --store"
            )

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

    def write(
        self,
        batch: Sequence[WriteItem],
        *,
        replacing: Mapping[bytes, Collection[bytes]] | None = None,
    ) -> None:
        """Store every request record of the batch and each trace's spans, in one transaction.

        Items are ``(trace, records)`` or ``(trace, records, otlp)`` where ``otlp`` is the trace
        already serialised as an ``ExportTraceServiceRequest`` (the pipeline encodes each trace
        once for every exporter); without it (or when empty) the store encodes the spans.

        ``replacing``: trace id -> span ids of that trace's stored request rows that the
        batch's records of the trace replace (a late fragment re-derived with its stored
        spans). They are deleted in the same transaction, before the batch's rows are inserted,
        and only when the trace's item is stored; rows of the trace not named stay.

        A malformed record is left out (counted in ``rejected_records``) and the rest is stored;
        then StoreWriteError reports it. A database error rolls the whole batch back and raises
        StoreWriteError with every record counted as rejected.
        """
        request_rows: list[tuple[Any, ...]] = []
        trace_rows: list[tuple[bytes, int, bytes, int]] = []
        replaced_rows: list[tuple[bytes, bytes]] = []
        rejected = 0
        traces_failed = 0
        written_bytes = 0
        first_problem: str | None = None
        received_ns = int(self._clock() * _NS_PER_S)
        max_trace_bytes = self.max_trace_bytes
        for item in batch:
            try:
                trace = item[0]
                records = item[1]
                rows = [request_row(record) for record in records]
            except Exception as error:  # a garbage item must not stop the batch
                rejected += _records_in(item)
                first_problem = first_problem or f"{type(error).__name__}: {error}"
                continue
            if not rows and not trace.late:
                continue
            # A late fragment's spans are appended to the stored trace, records or not: the
            # stored spans are what the next re-derivation (and diagnose, compare) reads.
            trace_key = bytes(trace.trace_id)
            if replacing:
                replaced_rows.extend(
                    (trace_key, bytes(span_id)) for span_id in replacing.get(trace_key, ())
                )
            request_rows.extend(rows)
            try:
                otlp = item[2] if len(item) > 2 else None
                if not otlp:
                    otlp = encode_trace_request(trace.spans)
                trace_rows.append((trace_key, received_ns, otlp, max_trace_bytes))
                written_bytes += len(otlp)
            except Exception as error:  # the requests are still worth keeping without spans
                traces_failed += 1
                first_problem = first_problem or f"{type(error).__name__}: {error}"

        if request_rows or trace_rows or replaced_rows:
            with self._lock:
                connection = self._require_writer()
                self._replaced_in_batch = 0
                try:
                    connection.execute("BEGIN IMMEDIATE")
                    connection.executemany(_DELETE_REQUEST, replaced_rows)
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
            self.replaced_traces += self._replaced_in_batch  # only once committed
            self._wrote(written_bytes + sum(len(row[-1]) for row in request_rows))
        if first_problem is not None:
            self.rejected_records += rejected
            self.failed_traces += traces_failed
            raise StoreWriteError(
                f"store {self.path}: {rejected} malformed request record(s) left out, "
                f"{traces_failed} trace(s) stored without spans ({first_problem})",
                rejected=rejected,
                written=len(request_rows),
            )

    def _wrote(self, payload_bytes: int) -> None:
        """Ask for a background checkpoint every ``checkpoint_bytes`` of payload written."""
        if self._checkpointer is None:
            return
        self._bytes_since_checkpoint += payload_bytes
        due = self._bytes_since_checkpoint >= self.checkpoint_bytes
        if due:
            self._bytes_since_checkpoint = 0
        self._checkpointer.wrote(checkpoint_now=due)

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
        if self._checkpointer is not None:
            # Before the writer closes: closing the last connection checkpoints the WAL itself.
            self._checkpointer.close(self._busy_timeout_s)
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
        low, high = trace_prefix_range(prefix)
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
                f"{_SELECT_REQUEST} WHERE trace_id = ? ORDER BY e2e_ns DESC", (matches[0],)
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
                row = connection.execute(
                    "SELECT otlp FROM traces WHERE trace_id = ?", (key,)
                ).fetchone()
            else:
                # length() of a BLOB reads its size from the record header, not the value.
                row = connection.execute(
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
                rows = connection.execute(
                    f"SELECT trace_id, otlp FROM traces WHERE trace_id IN ({marks})", batch
                ).fetchall()
            for trace_id, otlp in rows:
                yield bytes(trace_id), bytes(otlp)

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
            found = [bytes(row[0]) for row in connection.execute(query, params)]
        return found[:limit], len(found) > limit

    def slowest(
        self, *, metric: str = semconv.METRIC_E2E, since_ns: int | None = None, limit: int = 10
    ) -> list[dict[str, Any]]:
        """Documents of the slowest requests by ``metric`` (one of SLOWEST_METRIC_COLUMNS)."""
        column = SLOWEST_METRIC_COLUMNS.get(metric)
        if column is None:
            raise ValueError(
                f"unknown metric {metric!r}; choose one of {', '.join(SLOWEST_METRIC_COLUMNS)}"
            )
        query = f"{_SELECT_REQUEST} WHERE {column} IS NOT NULL"
        params: list[Any] = []
        if since_ns is not None:
            query += " AND start_ns >= ?"
            params.append(int(since_ns))
        query += f" ORDER BY {column} DESC LIMIT ?"
        params.append(max(0, int(limit)))
        with self._reader() as connection:
            rows = connection.execute(query, params).fetchall()
            spans_of: dict[bytes, bytes | None] = {}
            diagnosis = self._diagnosis(connection)
            return [self._document(connection, row, spans_of, diagnosis) for row in rows]

    def diagnosis_settings(self) -> DiagnosisConfig:
        """The collector's diagnosis settings, by which documents and windows of this store
        are derived (``_diagnosis``)."""
        with self._reader() as connection:
            return self._diagnosis(connection)

    @staticmethod
    def _diagnosis(connection: sqlite3.Connection) -> DiagnosisConfig:
        """The collector's diagnosis settings (``META_DIAGNOSIS``); the defaults when none or
        unreadable ones were stored (a newer collector's, a hand-edited store)."""
        found = connection.execute(
            "SELECT value FROM meta WHERE key = ?", (META_DIAGNOSIS,)
        ).fetchone()
        return diagnosis_from_json(None if found is None else str(found[0]))

    def _document(
        self,
        connection: sqlite3.Connection,
        row: Sequence[Any],
        spans_of: dict[bytes, bytes | None],
        diagnosis: DiagnosisConfig,
    ) -> dict[str, Any]:
        """The document of one stored row; its token times come from the trace's stored spans
        (read once per trace and call through ``spans_of``)."""
        trace_id = bytes(row[0])
        span_id = bytes(row[1])

        def load_decode() -> DecodeSpans:
            if trace_id not in spans_of:
                found = connection.execute(
                    "SELECT otlp FROM traces WHERE trace_id = ?", (trace_id,)
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
        """One page of the request list (``query.py``): summaries, the next page's cursor and
        the number of matches (capped).

        Raises ValueError for a cursor that is not one of this order's, ``QueryTimeoutError``
        for a query that runs too long, StoreError when the store cannot be read.
        """
        with self._reader() as connection:
            try:
                return run_page(connection, query)
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
            rows = run_rows(
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
            rows = connection.execute(query + " ORDER BY slice_start_s", params).fetchall()
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
