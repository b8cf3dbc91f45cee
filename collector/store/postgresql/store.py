"""The PostgreSQL request store: the SQLite store's contract (``sqlite/store.py``) on a database
that several collector replicas write at once and every replica's API reads.

Each replica has one writer connection, owned by its exporter thread; a batch is one
transaction of three statements whatever its size: the replaced rows deleted, the request rows
upserted and the traces' spans appended, each with every row of the batch bound as arrays
(``unnest``), so a batch costs three round trips. Rows are sorted by key first: two replicas
upserting the same traces lock them in the same order, and a deadlock between them cannot
form; one that is still reported (or a serialisation failure, a broken connection, a full
disk) fails the whole batch as retryable, and the next write reconnects.

Parts of one trace within a batch are joined before the upsert (PostgreSQL updates a row once
per statement): a part that would take the stored spans past ``max_trace_bytes`` replaces them,
as on SQLite. Percentile sketch slices carry the writing replica's id (``writer``): each
replica rewrites only its own open slices, and readers merge every replica's.

PostgreSQL text cannot hold NUL characters: the writer stores each as U+FFFD (``pg_text``).
A value the database still cannot take (an integer past 2**63) fails the batch, which is then
written item by item and the items that fail alone are quarantined, as on SQLite.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from contextlib import suppress
from typing import Any, Final

import psycopg

from tokentrace.collector.store.batch import (
    BatchWriter,
    PreparedItem,
    first_line,
    prepare_batch,
)
from tokentrace.collector.store.contract import (
    DEFAULT_MAX_REQUESTS,
    DEFAULT_MAX_TRACE_BYTES,
    DEFAULT_PRUNE_BATCH,
    DEFAULT_RETENTION_S,
    StoreError,
    StoreNotFoundError,
    WriteItem,
)
from tokentrace.collector.store.location import display_location
from tokentrace.collector.store.postgresql.list_query import pg_text
from tokentrace.collector.store.postgresql.reads import PostgresStoreReader, connect
from tokentrace.collector.store.postgresql.schema import (
    REQUEST_COLUMN_TYPES,
    check_readable,
    migrate,
)
from tokentrace.collector.store.row import REQUEST_COLUMNS, request_row
from tokentrace.collector.store.sqlite.store import slice_start

_NS_PER_S: Final = 1_000_000_000
_COUNT_WHEN_ESTIMATED_OVER: Final = 0.8
"""``prune`` counts the requests exactly only once the planner's estimate passes this share of
``max_requests`` (the estimate lags the table by up to autovacuum's analyze threshold)."""

_TEXT_COLUMNS: Final = tuple(
    index for index, (sql_type, _) in enumerate(REQUEST_COLUMN_TYPES.values()) if sql_type == "text"
)
_UPSERT_REQUESTS: Final = (
    f"INSERT INTO requests ({', '.join(REQUEST_COLUMNS)}) SELECT * FROM unnest("
    + ", ".join(f"%b::{sql_type}[]" for sql_type, _ in REQUEST_COLUMN_TYPES.values())
    + ") ON CONFLICT (trace_id, span_id) DO UPDATE SET "
    + ", ".join(f"{name} = excluded.{name}" for name in REQUEST_COLUMNS[2:])
)
_DELETE_REQUESTS: Final = (
    "DELETE FROM requests WHERE (trace_id, span_id) IN "
    "(SELECT * FROM unnest(%b::bytea[], %b::bytea[]))"
)
# Appended while the joined spans stay under the cap, else replaced (see the module docstring).
# xmax is not 0 on a row this statement updated (an append or a replacement) rather than inserted.
_UPSERT_TRACES: Final = (
    "INSERT INTO traces (trace_id, received_ns, otlp) "
    "SELECT * FROM unnest(%b::bytea[], %b::bigint[], %b::bytea[]) "
    "ON CONFLICT (trace_id) DO UPDATE SET received_ns = excluded.received_ns, "
    "otlp = CASE WHEN length(traces.otlp) + length(excluded.otlp) <= %s "
    "THEN traces.otlp || excluded.otlp ELSE excluded.otlp END "
    "RETURNING trace_id, length(otlp), xmax <> 0"
)
_UPSERT_SLICES: Final = (
    "INSERT INTO sketch_slices (slice_start_s, service, model, operation, prompt_bucket, metric, "
    "writer, sketch) SELECT * FROM unnest(%b::float8[], %b::text[], %b::text[], %b::text[], "
    "%b::text[], %b::text[], %b::text[], %b::text[]) ON CONFLICT (slice_start_s, service, model, "
    "operation, prompt_bucket, metric, writer) DO UPDATE SET sketch = excluded.sketch"
)


class PostgresRequestStore(PostgresStoreReader, BatchWriter):
    """PostgreSQL request store: ``PostgresStoreReader``'s reads plus the writer (module
    docstring). Options, limits and counters as ``sqlite.store.RequestStore``'s; WAL
    checkpoints are the server's business (``checkpoints`` stays 0)."""

    def __init__(
        self,
        url: str,
        *,
        retention_s: float = DEFAULT_RETENTION_S,
        max_requests: int = DEFAULT_MAX_REQUESTS,
        prune_batch: int = DEFAULT_PRUNE_BATCH,
        max_trace_bytes: int = DEFAULT_MAX_TRACE_BYTES,
        clock: Callable[[], float] = time.time,
        writer_id: str | None = None,
        _readonly: bool = False,
    ) -> None:
        super().__init__(url, shown_as=display_location(url), clock=clock)
        self.retention_s = float(retention_s)
        self.max_requests = int(max_requests)
        self.prune_batch = max(1, int(prune_batch))
        self.max_trace_bytes = int(max_trace_bytes)
        self.readonly = _readonly
        self.writer_id = writer_id or uuid.uuid4().hex[:16]
        """This replica's name on the sketch slices it writes (new for each start)."""
        self._init_counters()
        self._lock = threading.Lock()
        self._writer: psycopg.Connection[Any] | None = None
        self._closed = False
        if _readonly:
            try:
                with self._reader() as connection:
                    readable = check_readable(connection, self.path)
                if not readable:
                    raise StoreNotFoundError(
                        f"no tokentrace store in {self.path} - start `tokentrace collector "
                        "--store URL` on it first"
                    )
            except BaseException:
                self.close_readers()  # no pooled connection outlives a store never returned
                raise
        else:
            self._writer = self._open_writer()

    checkpoints: Final = 0
    """The server checkpoints its own WAL (for the collector's self-metrics)."""
    failed_checkpoints: Final = 0

    @classmethod
    def open_readonly(
        cls, url: str, *, clock: Callable[[], float] = time.time
    ) -> PostgresRequestStore:
        """A reader of an existing store; StoreNotFoundError when the database holds none."""
        return cls(url, clock=clock, _readonly=True)

    def _open_writer(self) -> psycopg.Connection[Any]:
        connection = connect(self._url, shown_as=self.path, purpose="writer")
        try:
            migrate(connection, self.path)
        except psycopg.Error as error:
            connection.close()
            raise StoreError(f"cannot initialise store {self.path}: {first_line(error)}") from error
        except StoreError:
            connection.close()
            raise
        return connection

    def _require_writer(self) -> psycopg.Connection[Any]:
        if self.readonly or self._closed:
            raise StoreError(f"store {self.path} is open read-only or closed")
        if self._writer is None or self._writer.closed:
            self._writer = connect(self._url, shown_as=self.path, purpose="writer")
        return self._writer

    # --- writer API --------------------------------------------------------------------------

    def write(
        self,
        batch: Sequence[WriteItem],
        *,
        replacing: Mapping[bytes, Collection[bytes]] | None = None,
    ) -> None:
        """Store the batch in one transaction: ``sqlite.store.RequestStore.write``'s contract."""
        prepared = prepare_batch(
            batch, replacing, row_of=lambda record: _pg_row(request_row(record))
        )
        with self._lock:
            connection = self._writer_for_batch() if prepared.items else None
            self._store_prepared(
                prepared,
                lambda items: self._write_items(connection, items),
                psycopg.OperationalError,
            )

    def _writer_for_batch(self) -> psycopg.Connection[Any]:
        """The writer connection for a batch: StoreError when the store is read-only or
        closed (nothing is counted: the batch was never the store's), and a retryable
        StoreWriteError when the server cannot be reached (the batch waits for a retry)."""
        if self.readonly or self._closed:
            raise StoreError(f"store {self.path} is open read-only or closed")
        try:
            return self._require_writer()
        except StoreError as error:
            self._fail_batch(error, 0, retryable=True)

    def _write_items(
        self, connection: psycopg.Connection[Any] | None, items: Sequence[PreparedItem]
    ) -> int:
        """Write ``items`` in one transaction; returns the traces whose stored spans a part
        replaced. Raises (rolled back) on any failure."""
        assert connection is not None, "a batch with items has a writer"
        replaced_rows = sorted({row for p in items for row in p.replaced_rows})
        requests = {row[:2]: row for p in items for row in p.request_rows}  # the last one wins
        request_rows = [requests[key] for key in sorted(requests)]
        traces, replaced = self._joined_parts(p.spans for p in items)
        with connection.transaction():
            if replaced_rows:
                connection.execute(_DELETE_REQUESTS, _columns(replaced_rows, 2))
            if request_rows:
                connection.execute(_UPSERT_REQUESTS, _columns(request_rows, len(REQUEST_COLUMNS)))
            if traces:
                keys = sorted(traces)
                received_ns = int(self._clock() * _NS_PER_S)
                cursor = connection.execute(
                    _UPSERT_TRACES,
                    (
                        keys,
                        [received_ns] * len(keys),
                        [traces[k] for k in keys],
                        self.max_trace_bytes,
                    ),
                )
                for trace_id, stored_length, updated in cursor.fetchall():
                    if updated and stored_length == len(traces[bytes(trace_id)]):
                        replaced += 1  # the stored spans gave way to this part
        return replaced

    def _joined_parts(
        self, parts: Iterable[tuple[bytes, bytes] | None]
    ) -> tuple[dict[bytes, bytes], int]:
        """The batch's spans per trace, parts in order joined up to the cap (a part that
        would pass it replaces the parts before), and how many such replacements."""
        joined: dict[bytes, bytes] = {}
        replaced = 0
        for part in parts:
            if part is None:
                continue
            trace_id, otlp = part
            before = joined.get(trace_id)
            if before is None:
                joined[trace_id] = otlp
            elif len(before) + len(otlp) <= self.max_trace_bytes:
                joined[trace_id] = before + otlp
            else:
                joined[trace_id] = otlp
                replaced += 1
        return joined, replaced

    def _drop_broken_writer(self) -> None:
        """After a connection-level failure: the next write connects anew."""
        writer, self._writer = self._writer, None
        if writer is not None:
            with suppress(psycopg.Error):
                writer.close()

    def _database_failed(self, error: BaseException) -> None:
        self._drop_broken_writer()

    def write_sketch_slices(self, slices: Iterable[tuple[float, Any, str, Any]]) -> None:
        """Store this replica's sketch slices (``sqlite.store.RequestStore.write_sketch_slices``);
        a slice written again replaces this replica's stored one only."""
        rows: dict[tuple[Any, ...], str] = {}
        try:
            for start_s, key, metric, sketch in slices:
                if hasattr(key, "service"):
                    service, model = key.service, key.model
                    operation, bucket = key.operation, key.prompt_bucket
                else:
                    service, model, operation, bucket = key
                sketch_dict = sketch if isinstance(sketch, dict) else sketch.to_dict()
                dims = (
                    float(slice_start(start_s)),
                    *(pg_text(str(value)) for value in (service, model, operation, bucket, metric)),
                )
                rows[dims] = json.dumps(sketch_dict, separators=(",", ":"), allow_nan=False)
        except Exception as error:
            raise StoreError(f"store {self.path}: malformed sketch slice: {error}") from error
        if not rows:
            return
        keys = sorted(rows)
        columns = _columns(keys, 6)
        params = (*columns, [self.writer_id] * len(keys), [rows[k] for k in keys])
        with self._lock:
            try:
                connection = self._require_writer()
                with connection.transaction():
                    connection.execute(_UPSERT_SLICES, params)
            except psycopg.Error as error:
                if isinstance(error, psycopg.OperationalError):
                    self._drop_broken_writer()
                raise StoreError(
                    f"store {self.path}: sketch slices not stored: {first_line(error)}"
                ) from error
        self.written_slices += len(rows)

    def set_meta(self, key: str, value: str) -> None:
        with self._lock:
            try:
                connection = self._require_writer()
                connection.execute(
                    "INSERT INTO meta (key, value) VALUES (%s, %s) "
                    "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                    (pg_text(key), pg_text(str(value))),
                )
            except psycopg.Error as error:
                if isinstance(error, psycopg.OperationalError):
                    self._drop_broken_writer()
                raise StoreError(
                    f"store {self.path}: meta {key!r} not stored: {first_line(error)}"
                ) from error

    def prune(self) -> int:
        """Delete requests past the retention or beyond ``max_requests`` (oldest first), their
        traces, and old sketch slices; at most ``prune_batch`` requests per call. Any replica
        may prune: they delete the same oldest rows, and a row already gone is skipped."""
        cutoff_ns = int((self._clock() - self.retention_s) * _NS_PER_S)
        with self._lock:
            try:
                connection = self._require_writer()
                with connection.transaction():
                    pruned_requests, pruned_traces = self._prune_requests(connection, cutoff_ns)
                    pruned_traces += connection.execute(
                        "DELETE FROM traces WHERE trace_id IN (SELECT trace_id FROM traces "
                        "WHERE received_ns < %s ORDER BY received_ns LIMIT %s) AND NOT EXISTS "
                        "(SELECT 1 FROM requests WHERE requests.trace_id = traces.trace_id)",
                        (cutoff_ns, self.prune_batch),
                    ).rowcount
                    pruned_slices = connection.execute(
                        "DELETE FROM sketch_slices WHERE ctid IN (SELECT ctid FROM sketch_slices "
                        "WHERE slice_start_s < %s LIMIT %s)",
                        (cutoff_ns // _NS_PER_S, self.prune_batch),
                    ).rowcount
            except psycopg.Error as error:
                if isinstance(error, psycopg.OperationalError):
                    self._drop_broken_writer()
                raise StoreError(f"store {self.path}: prune failed: {first_line(error)}") from error
        self.pruned_requests += pruned_requests
        self.pruned_traces += pruned_traces
        self.pruned_slices += pruned_slices
        return pruned_requests

    def _maybe_over_max_requests(self, connection: psycopg.Connection[Any]) -> bool:
        """False when the planner's row estimate (kept by autovacuum's ANALYZE) is well under
        ``max_requests``: an exact count reads the whole table, which every replica would do
        every 10 s. True when the table was never analysed (the estimate is -1)."""
        found = connection.execute(
            "SELECT reltuples FROM pg_class WHERE oid = 'requests'::regclass"
        ).fetchone()
        estimate = -1.0 if found is None else float(found[0])
        return estimate < 0 or estimate >= _COUNT_WHEN_ESTIMATED_OVER * self.max_requests

    def _prune_requests(
        self, connection: psycopg.Connection[Any], cutoff_ns: int
    ) -> tuple[int, int]:
        """(requests, traces) deleted: past the retention first, then the oldest while over
        ``max_requests``."""
        victims = connection.execute(
            "DELETE FROM requests WHERE (trace_id, span_id) IN (SELECT trace_id, span_id FROM "
            "requests WHERE start_ns < %s ORDER BY start_ns LIMIT %s FOR UPDATE SKIP LOCKED) "
            "RETURNING trace_id",
            (cutoff_ns, self.prune_batch),
        ).fetchall()
        if len(victims) < self.prune_batch and self._maybe_over_max_requests(connection):
            (total,) = connection.execute("SELECT COUNT(*) FROM requests").fetchone() or (0,)
            excess = min(int(total) - self.max_requests, self.prune_batch - len(victims))
            if excess > 0:
                victims += connection.execute(
                    "DELETE FROM requests WHERE (trace_id, span_id) IN (SELECT trace_id, "
                    "span_id FROM requests ORDER BY start_ns LIMIT %s FOR UPDATE SKIP LOCKED) "
                    "RETURNING trace_id",
                    (excess,),
                ).fetchall()
        trace_ids = sorted({bytes(trace_id) for (trace_id,) in victims})
        traces = 0
        if trace_ids:
            traces = connection.execute(
                "DELETE FROM traces WHERE trace_id = ANY(%s) AND NOT EXISTS "
                "(SELECT 1 FROM requests WHERE requests.trace_id = traces.trace_id)",
                (trace_ids,),
            ).rowcount
        return len(victims), traces

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._drop_broken_writer()
        self.close_readers()

    def __enter__(self) -> PostgresRequestStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _pg_row(row: tuple[Any, ...]) -> tuple[Any, ...]:
    """A request row with NUL characters in its text columns made storable (``pg_text``)."""
    if not any(isinstance(row[i], str) and "\x00" in row[i] for i in _TEXT_COLUMNS):
        return row
    values = list(row)
    for index in _TEXT_COLUMNS:
        if isinstance(values[index], str):
            values[index] = pg_text(values[index])
    return tuple(values)


def _columns(rows: Sequence[Sequence[Any]], width: int) -> list[list[Any]]:
    """Rows as one list per column (what ``unnest`` binds)."""
    return [[row[index] for row in rows] for index in range(width)]
