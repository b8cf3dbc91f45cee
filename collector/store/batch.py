"""The write contract both request stores keep, in one place: a batch taken apart into each
item's rows (``prepare_batch``), written whole or, when one item's value breaks it, item by item
with the items that fail alone quarantined (``BatchWriter._store_prepared``), and the counters
and the one ``StoreWriteError`` that say what a batch lost.

A backend gives the transaction that writes some items (``write_items``: raises, rolled back,
on any failure) and names its errors that are the database's rather than an item's (full,
locked, a broken connection): those fail the whole batch as retryable.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from tokentrace.collector.encoding import encode_trace_request
from tokentrace.collector.store.contract import StoreWriteError, WriteItem
from tokentrace.collector.store.row import request_row

RowOf = Callable[[Any], tuple[Any, ...]]
"""A request record's ``requests`` row (``row.request_row``, or a backend's variant of it)."""


@dataclass(slots=True)
class PreparedItem:
    """One batch item's rows: what a write commits (or quarantines) as one."""

    request_rows: list[tuple[Any, ...]]
    replaced_rows: list[tuple[bytes, bytes]] = field(default_factory=list)
    """(trace id, span id) of the stored request rows this item's records replace."""
    spans: tuple[bytes, bytes] | None = None
    """(trace id, the trace's spans as a serialised ``ExportTraceServiceRequest``)."""


@dataclass(slots=True)
class PreparedBatch:
    items: list[PreparedItem] = field(default_factory=list)
    rejected: int = 0
    """Malformed records left out."""
    traces_failed: int = 0
    """Traces whose spans could not be encoded (their requests are stored without them)."""
    first_problem: str | None = None

    def note(self, error: BaseException) -> None:
        if self.first_problem is None:
            self.first_problem = f"{type(error).__name__}: {first_line(error)}"


def first_line(error: BaseException) -> str:
    """An error's first line for a message (PostgreSQL's go on with DETAIL, HINT and CONTEXT
    lines, a refused row's every value among them)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def prepare_batch(
    batch: Sequence[WriteItem],
    replacing: Mapping[bytes, Collection[bytes]] | None,
    *,
    row_of: RowOf = request_row,
) -> PreparedBatch:
    """Each item's rows; a malformed item is left out and counted, not raised."""
    prepared = PreparedBatch()
    for item in batch:
        try:
            trace = item[0]
            rows = [row_of(record) for record in item[1]]
        except Exception as error:  # a garbage item must not stop the batch
            prepared.rejected += records_in(item)
            prepared.note(error)
            continue
        if not rows and not trace.late:
            continue
        # A late fragment's spans are appended to the stored trace, records or not: the stored
        # spans are what the next re-derivation (and diagnose, compare) reads.
        trace_key = bytes(trace.trace_id)
        ready = PreparedItem(request_rows=rows)
        if replacing:
            ready.replaced_rows = [
                (trace_key, bytes(span_id)) for span_id in replacing.get(trace_key, ())
            ]
        try:
            otlp = item[2] if len(item) > 2 else None
            if not otlp:
                otlp = encode_trace_request(trace.spans)
            ready.spans = (trace_key, otlp)  # as given: a value the database refuses fails the item
        except Exception as error:  # the requests are still worth keeping without spans
            prepared.traces_failed += 1
            prepared.note(error)
        prepared.items.append(ready)
    return prepared


def records_in(item: Any) -> int:
    """Request records a batch item holds (1 for one too broken to say)."""
    try:
        return max(1, len(item[1]))
    except Exception:
        return 1


def request_rows_in(items: Sequence[PreparedItem]) -> int:
    return sum(len(p.request_rows) for p in items)


class BatchWriter:
    """The writer half both stores share: counters and the whole-then-item-by-item write."""

    path: str

    def _init_counters(self) -> None:
        # Read by the collector's self-metrics.
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
        self.quarantined_records = 0
        """Request records dropped because their trace could not be written even alone (also
        counted in ``rejected_records``)."""
        self.quarantined_traces = 0
        """Batch items (a trace's records and spans) dropped that way."""

    def _store_prepared(
        self,
        prepared: PreparedBatch,
        write_items: Callable[[Sequence[PreparedItem]], int],
        database_errors: type[BaseException] | tuple[type[BaseException], ...],
    ) -> None:
        """Write ``prepared``'s items in one transaction (``write_items`` returns the traces
        whose stored spans a part replaced); when an item breaks it, each item alone, once, and
        the ones that fail alone are quarantined. Raises StoreWriteError when anything was left
        out (``retryable`` when the database refused the whole batch). The caller holds the
        writer's lock."""
        items = prepared.items
        written: list[PreparedItem] = []
        quarantined: list[PreparedItem] = []
        if items:
            try:
                self.replaced_traces += write_items(items)
                written = items
            except database_errors as error:  # the database, not an item
                self._database_failed(error)
                self._fail_batch(error, 0, retryable=True)
            except Exception as error:
                # A value of one item (most likely) the database cannot take, or a constraint
                # it breaks: each item alone, so that it costs only its trace.
                prepared.note(error)
                for index, item in enumerate(items):
                    try:
                        self.replaced_traces += write_items([item])
                    except database_errors as item_error:  # not the item
                        self._database_failed(item_error)
                        self._count_written(written)
                        lost = request_rows_in(items[index:]) + request_rows_in(quarantined)
                        self._count_quarantined(quarantined)
                        self._fail_batch(
                            item_error,
                            prepared.rejected + lost,
                            written=request_rows_in(written),
                        )
                    except Exception:
                        quarantined.append(item)
                    else:
                        written.append(item)
            self._count_written(written)
        rejected = prepared.rejected
        if quarantined:
            self._count_quarantined(quarantined)
            rejected += request_rows_in(quarantined)
        if prepared.first_problem is not None:
            self.rejected_records += rejected
            self.failed_traces += prepared.traces_failed
            quarantine = (
                f", {len(quarantined)} trace(s) quarantined (not storable even alone)"
                if quarantined
                else ""
            )
            raise StoreWriteError(
                f"store {self.path}: {rejected} request record(s) left out, "
                f"{prepared.traces_failed} trace(s) stored without spans{quarantine} "
                f"({prepared.first_problem})",
                rejected=rejected,
                written=request_rows_in(written),
            )

    def _database_failed(self, error: BaseException) -> None:
        """Called when the database (not an item) failed a write; a backend may reconnect."""

    def _count_written(self, written: Sequence[PreparedItem]) -> None:
        self.written_requests += request_rows_in(written)
        self.written_traces += sum(1 for p in written if p.spans)

    def _count_quarantined(self, quarantined: Sequence[PreparedItem]) -> None:
        self.quarantined_records += request_rows_in(quarantined)
        self.quarantined_traces += len(quarantined)

    def _fail_batch(
        self, error: BaseException, lost: int, *, written: int = 0, retryable: bool = False
    ) -> NoReturn:
        """Count a batch the database refused (rolled back) and raise StoreWriteError."""
        self.failed_batches += 1
        self.rejected_records += lost
        raise StoreWriteError(
            f"store {self.path}: batch rolled back: {first_line(error)}",
            rejected=lost,
            written=written,
            retryable=retryable,
        ) from error
