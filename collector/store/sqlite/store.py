"""The SQLite request store: one SQLite file (WAL) with one row per request, its trace's spans,
closed percentile-sketch slices and a little metadata; this module opens it and writes it.

One writer connection, owned by the collector's exporter thread, writes in batches (one
transaction each). Readers (CLI, API) use short-lived read-only connections (``reads.py``), so
WAL lets them read while the writer writes. Every SQL value is a bound parameter; the only
identifiers put into SQL text come from fixed tables (``schema.py``, ``row.py``).

A late fragment (spans that reached the collector after their trace was assembled) re-derives
its trace's requests from the stored spans plus its own: its batch item says which stored request
rows its records replace (``write``'s ``replacing``), and those rows are deleted in the same
transaction that inserts the new ones, while only the fragment's spans are appended to the
stored trace. The collector reads the stored spans back on the writer's thread through a
read-only connection (``trace_otlp``, size-capped), which sees every committed batch.

A write never leaves the writer inside a transaction: every write runs in ``_transaction``, which
rolls back on any exception (not only ``sqlite3.Error``: binding a hostile value raises
``OverflowError``, ``ValueError`` or ``TypeError``) and first rolls back a transaction left open
by anything else. A batch whose transaction fails on a value (any exception that is not a
``sqlite3.Error``) is retried item by item, once: every trace that can be stored is, and the one
that cannot is quarantined (dropped and counted: ``quarantined_records``,
``quarantined_traces``). A ``sqlite3.Error`` is the database's (locked, full, failing disk, a
trigger): the whole batch rolls back, as retrying its items one by one would fail the same way.

Writes are hot, reads are rare: a request row holds the columns the queries use and a compact
``detail`` (``row.request_row``); the document ``explain`` prints is built when it is read. WAL
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
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import closing, contextmanager, suppress
from typing import Any, Final

from tokentrace.collector.store.batch import BatchWriter, PreparedItem, prepare_batch
from tokentrace.collector.store.contract import (
    DEFAULT_MAX_REQUESTS,
    DEFAULT_MAX_TRACE_BYTES,
    DEFAULT_PRUNE_BATCH,
    DEFAULT_RETENTION_S,
    StoreError,
    WriteItem,
)
from tokentrace.collector.store.row import REQUEST_COLUMNS
from tokentrace.collector.store.sqlite.reads import RequestStoreReader
from tokentrace.collector.store.sqlite.schema import (
    SCHEMA,
    SCHEMA_VERSION,
    check_schema_version,
)

_DEFAULT_BUSY_TIMEOUT_S: Final = 5.0
_DEFAULT_CHECKPOINT_BYTES: Final = 4 * 1024 * 1024
"""Bytes written after which the background thread checkpoints the WAL (SQLite's default
automatic checkpoint is at 1000 pages, about the same)."""
_DEFAULT_CHECKPOINT_IDLE_S: Final = 1.0
"""A quiet writer's last writes are checkpointed after this long."""
_BACKSTOP_AUTOCHECKPOINT_PAGES: Final = 16_384
"""The writer checkpoints itself past this many WAL pages (64 MiB of 4 KiB pages): only when
the background checkpoints fall behind, which bounds the log either way."""
_NS_PER_S: Final = 1_000_000_000

_INSERT_REQUEST: Final = (
    f"INSERT OR REPLACE INTO requests ({', '.join(REQUEST_COLUMNS)}) "
    f"VALUES ({', '.join('?' * len(REQUEST_COLUMNS))})"
)
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


class RequestStore(RequestStoreReader, BatchWriter):
    """SQLite request store: ``RequestStoreReader``'s reads plus the writer. See the module
    docstring for the threading model.

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
        retention_s: float = DEFAULT_RETENTION_S,
        max_requests: int = DEFAULT_MAX_REQUESTS,
        prune_batch: int = DEFAULT_PRUNE_BATCH,
        max_trace_bytes: int = DEFAULT_MAX_TRACE_BYTES,
        busy_timeout_s: float = _DEFAULT_BUSY_TIMEOUT_S,
        checkpoint_bytes: int = _DEFAULT_CHECKPOINT_BYTES,
        clock: Callable[[], float] = time.time,
        _readonly: bool = False,
    ) -> None:
        super().__init__(path, busy_timeout_s=busy_timeout_s, clock=clock)
        self.retention_s = float(retention_s)
        self.max_requests = int(max_requests)
        self.prune_batch = max(1, int(prune_batch))
        self.max_trace_bytes = int(max_trace_bytes)
        self.checkpoint_bytes = max(1, int(checkpoint_bytes))
        self._bytes_since_checkpoint = 0
        self.readonly = _readonly
        self._init_counters()
        self._replaced_in_batch = 0
        # The writer connection may be created on one thread and used on the exporter thread;
        # the lock keeps accidental concurrent use safe instead of corrupting a transaction.
        self._lock = threading.Lock()
        self._writer: sqlite3.Connection | None = None
        self._checkpointer: _Checkpointer | None = None
        if _readonly:
            with closing(self._connect_readonly()) as connection:
                check_schema_version(connection, self.path)
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
            check_schema_version(connection, self.path, creating=True)
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("PRAGMA synchronous=NORMAL")
            connection.execute("PRAGMA foreign_keys=OFF")
            connection.execute(f"PRAGMA wal_autocheckpoint={_BACKSTOP_AUTOCHECKPOINT_PAGES:d}")
            connection.execute("BEGIN IMMEDIATE")
            for statement in SCHEMA:
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
        then StoreWriteError reports it. A value the database cannot take (any exception other
        than ``sqlite3.Error``, e.g. ``OverflowError`` for an integer past 2**63) rolls the
        batch back, and each item is written again alone, once: the items that fail alone are
        quarantined (``quarantined_records``, ``quarantined_traces``; their records also count
        in ``rejected_records``), the rest is stored, and StoreWriteError reports it. So does a
        constraint an item breaks (``sqlite3.IntegrityError``): the item, not the database.

        The database refusing the write (``sqlite3.OperationalError``: full, locked, an I/O
        error) rolls the whole batch back and raises StoreWriteError with ``retryable`` set:
        nothing of it was written and the same batch may go through later, so its records are
        not counted as rejected (whoever retries it owns them; ``failed_batches`` counts the
        attempt). If that happens part-way through writing items alone, what was written stays
        and the rest is counted as rejected (not retryable: the batch would be written twice).
        """
        prepared = prepare_batch(batch, replacing)
        with self._lock:
            connection = self._require_writer() if prepared.items else None
            self._store_prepared(
                prepared,
                lambda items: self._write_items(connection, items),
                sqlite3.OperationalError,
            )

    def _write_items(
        self, connection: sqlite3.Connection | None, items: Sequence[PreparedItem]
    ) -> int:
        """Write ``items`` in one transaction; returns the traces whose stored spans a part
        replaced (counted by SQLite through ``_trace_replaced``). Raises, rolled back."""
        assert connection is not None, "a batch with items has a writer"
        received_ns = int(self._clock() * _NS_PER_S)
        cap = self.max_trace_bytes
        self._replaced_in_batch = 0
        with _transaction(connection):
            connection.executemany(_DELETE_REQUEST, [r for p in items for r in p.replaced_rows])
            connection.executemany(_INSERT_REQUEST, [r for p in items for r in p.request_rows])
            connection.executemany(
                _UPSERT_TRACE,
                [(p.spans[0], received_ns, p.spans[1], cap) for p in items if p.spans],
            )
        return self._replaced_in_batch

    def _count_written(self, written: Sequence[PreparedItem]) -> None:
        super()._count_written(written)
        if written:
            payload = sum(len(p.spans[1]) for p in written if p.spans)
            payload += sum(len(row[-1]) for p in written for row in p.request_rows)
            self._wrote(payload)

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
                        slice_start(slice_start_s),
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
                with _transaction(connection):
                    connection.executemany(
                        "INSERT OR REPLACE INTO sketch_slices (slice_start_s, service, model, "
                        "operation, prompt_bucket, metric, sketch) VALUES (?, ?, ?, ?, ?, ?, ?)",
                        rows,
                    )
            except Exception as error:  # rolled back; a value SQLite cannot bind included
                raise StoreError(f"store {self.path}: sketch slices not stored: {error}") from error
        self.written_slices += len(rows)

    def set_meta(self, key: str, value: str) -> None:
        with self._lock:
            connection = self._require_writer()
            try:
                with _transaction(connection):
                    connection.execute(
                        "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, str(value))
                    )
            except Exception as error:  # rolled back
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
                with _transaction(connection):
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
            except Exception as error:  # rolled back
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


def slice_start(value: float) -> float:
    """Slice starts are multiples of the slice length: keep fractions (e.g. 2.5 s slices)
    so that neighbouring slices never collide on one key."""
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"slice start {value!r} is not a finite number")
    return int(number) if number.is_integer() else number


@contextmanager
def _transaction(connection: sqlite3.Connection) -> Iterator[None]:
    """BEGIN IMMEDIATE ... COMMIT; any exception (of any type, the COMMIT's too) rolls back and
    propagates. A transaction some earlier failure left open is rolled back first, so the writer
    can never stay stuck in one ("cannot start a transaction within a transaction")."""
    if connection.in_transaction:
        _rollback(connection)
    connection.execute("BEGIN IMMEDIATE")
    try:
        yield
        connection.execute("COMMIT")
    except BaseException:
        _rollback(connection)
        raise


def _rollback(connection: sqlite3.Connection) -> None:
    try:
        if connection.in_transaction:
            connection.execute("ROLLBACK")
    except sqlite3.Error:
        pass  # the connection is broken: the next BEGIN reports it
