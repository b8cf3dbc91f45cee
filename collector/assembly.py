"""Trace assembly: group spans by trace id until the trace is complete, in bounded memory.

A trace is finished when its root span (no parent) arrived ``root_grace_s`` ago, or when no span
of it arrived for ``quiet_period_s``. Limits, each with a counter:

- ``max_traces``: the oldest pending trace is finished early (processed with what it has) rather
  than dropped: a partial trace still yields a request when its request span arrived.
- ``max_spans_per_trace``: further spans of that trace are dropped.
- ``max_pending_spans``: ``add`` raises ``Overloaded`` so receivers ask senders to retry later,
  which turns a burst into back-pressure instead of data loss.

Spans that arrive for a trace finished recently are assembled as a new fragment (``late``) and
counted as ``late_spans``; the pipeline re-derives the trace's requests from the stored spans plus
the fragment's (see ``pipeline``). A fragment that finishes in the same ``pop_finished`` as its
trace's early-finished part joins that part, so one batch never holds two parts of one trace.
The receivers call ``add`` from their threads; the pipeline thread calls ``pop_finished``; both
take one short lock, and no processing happens under it.

With the durability spool (``collector/spool.py``), each batch comes with the sequence number of
the spooled request that holds it; every pending trace remembers the lowest one among its spans
(``first_seq``), and ``lowest_seq`` is the lowest of all traces not yet popped, which the
pipeline reads after exporting a batch to know which spool segments are no longer needed.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tokentrace.agent import semconv
from tokentrace.collector.consumer import Overloaded
from tokentrace.collector.self_telemetry import ComponentTelemetry
from tokentrace.processors.model import AssembledTrace, SpanRef

_RECENTLY_FINISHED_CAP = 100_000


@dataclass(slots=True)
class _PendingTrace:
    spans: list[SpanRef]
    last_update: float
    late: bool = False
    root_seen_at: float | None = None
    first_seq: int | None = None
    """The lowest spool sequence number among its spans (None: not spooled)."""


@dataclass(slots=True)
class AssemblyStats:
    received_spans: int = 0
    """Spans accepted for assembly (counted under the lock: several receiver threads add)."""
    traces_finished: int = 0
    """Every finished trace, early ones included."""
    traces_finished_early: int = 0
    """Finished before complete because max_traces was reached."""
    spans_dropped: int = 0
    """Dropped because their trace already held max_spans_per_trace spans."""
    late_spans: int = 0
    """Arrived after their trace was finished (assembled as a new fragment)."""
    refused_batches: int = 0
    """Batches refused with Overloaded because max_pending_spans was reached."""


class TraceAssembler:
    def __init__(
        self,
        *,
        quiet_period_s: float,
        root_grace_s: float,
        max_traces: int,
        max_spans_per_trace: int,
        max_pending_spans: int,
        clock: Callable[[], float] = time.monotonic,
        telemetry: ComponentTelemetry | None = None,
    ) -> None:
        """``telemetry``: where the counters and pending sizes are reported (observed, so adding
        a batch costs no more than it did)."""
        self._quiet_period_s = quiet_period_s
        self._root_grace_s = root_grace_s
        self._max_traces = max_traces
        self._max_spans_per_trace = max_spans_per_trace
        self._max_pending_spans = max_pending_spans
        self._clock = clock
        self._lock = threading.Lock()
        # Ordered by last update: the front holds the traces quiet the longest.
        self._pending: OrderedDict[bytes, _PendingTrace] = OrderedDict()
        self._root_done: OrderedDict[bytes, float] = OrderedDict()
        self._early: list[tuple[AssembledTrace, int | None]] = []
        # Spool sequence numbers still needed: pending traces per first_seq, and a lazy min-heap.
        self._seq_refs: dict[int, int] = {}
        self._seq_heap: list[int] = []
        self._recently_finished: OrderedDict[bytes, None] = OrderedDict()
        self._pending_spans = 0
        self.stats = AssemblyStats()
        if telemetry is not None:
            telemetry.observe_each(
                counters={
                    semconv.SELF_METRIC_RECEIVED_SPANS: (
                        "spans accepted for assembly",
                        lambda: self.stats.received_spans,
                    ),
                    semconv.SELF_METRIC_TRACES_FINISHED_EARLY: (
                        "traces finished at max_traces",
                        lambda: self.stats.traces_finished_early,
                    ),
                    semconv.SELF_METRIC_SPANS_DROPPED_TRACE_FULL: (
                        "spans dropped: trace full",
                        lambda: self.stats.spans_dropped,
                    ),
                    semconv.SELF_METRIC_LATE_SPANS: (
                        "spans after their trace was finished",
                        lambda: self.stats.late_spans,
                    ),
                    semconv.SELF_METRIC_REFUSED_BATCHES: (
                        "batches refused: too many pending",
                        lambda: self.stats.refused_batches,
                    ),
                },
                gauges={
                    semconv.SELF_METRIC_PENDING_SPANS: (
                        "spans waiting for their trace",
                        lambda: self._pending_spans,
                    ),
                    semconv.SELF_METRIC_PENDING_TRACES: (
                        "traces being assembled",
                        lambda: len(self._pending),
                    ),
                },
            )

    @property
    def pending_spans(self) -> int:
        return self._pending_spans

    @property
    def pending_traces(self) -> int:
        return len(self._pending)

    def check_room(self, span_count: int) -> None:
        """Raise ``Overloaded`` as ``add`` would now (before the batch is spooled)."""
        with self._lock:
            self._refuse_if_full(span_count)

    def _refuse_if_full(self, span_count: int) -> None:
        if self._pending_spans + span_count > self._max_pending_spans:
            self.stats.refused_batches += 1
            raise Overloaded(
                f"{self._pending_spans} spans are waiting for assembly "
                f"(max_pending_spans={self._max_pending_spans})",
                retry_after_s=max(1.0, self._root_grace_s),
            )

    def lowest_seq(self) -> int | None:
        """The lowest spool sequence number a trace not yet popped holds spans of."""
        with self._lock:
            heap = self._seq_heap
            while heap and heap[0] not in self._seq_refs:
                heapq.heappop(heap)
            return heap[0] if heap else None

    def _ref_seq(self, seq: int) -> None:
        count = self._seq_refs.get(seq, 0)
        self._seq_refs[seq] = count + 1
        if not count:
            heapq.heappush(self._seq_heap, seq)

    def _unref_seq(self, seq: int | None) -> None:
        if seq is None:
            return
        count = self._seq_refs[seq] - 1
        if count:
            self._seq_refs[seq] = count
        else:
            del self._seq_refs[seq]

    def add(
        self, spans_by_trace: dict[bytes, list[SpanRef]], span_count: int, *, seq: int | None = None
    ) -> None:
        """Add one received batch, already grouped by trace id. Raises ``Overloaded``.
        ``seq``: the spool sequence number of the request that holds it."""
        now = self._clock()
        with self._lock:
            self._refuse_if_full(span_count)
            self.stats.received_spans += span_count
            for trace_id, refs in spans_by_trace.items():
                pending = self._pending.get(trace_id)
                if pending is None:
                    late = trace_id in self._recently_finished
                    if late:
                        self.stats.late_spans += len(refs)
                    if len(self._pending) >= self._max_traces:
                        self._finish_oldest_early()
                    pending = _PendingTrace(spans=[], last_update=now, late=late)
                    self._pending[trace_id] = pending
                else:
                    pending.last_update = now
                    self._pending.move_to_end(trace_id)
                if seq is not None and (pending.first_seq is None or seq < pending.first_seq):
                    self._unref_seq(pending.first_seq)
                    pending.first_seq = seq
                    self._ref_seq(seq)
                room = self._max_spans_per_trace - len(pending.spans)
                if room < len(refs):
                    self.stats.spans_dropped += len(refs) - max(room, 0)
                    refs = refs[: max(room, 0)]
                pending.spans.extend(refs)
                self._pending_spans += len(refs)
                if pending.root_seen_at is None:
                    for ref in refs:
                        if not ref.span.parent_span_id:
                            pending.root_seen_at = now
                            self._root_done[trace_id] = now
                            break

    def _finish_oldest_early(self) -> None:
        trace_id, pending = self._pending.popitem(last=False)
        self._root_done.pop(trace_id, None)
        self.stats.traces_finished += 1
        # Its spans still count as pending until the pipeline pops them: back-pressure must see
        # them, or a flood of new trace ids would grow _early without bound.
        self._early.append(
            (
                AssembledTrace(trace_id=trace_id, spans=pending.spans, late=pending.late),
                pending.first_seq,
            )
        )
        self._remember_finished(trace_id)
        self.stats.traces_finished_early += 1

    def _remember_finished(self, trace_id: bytes) -> None:
        self._recently_finished[trace_id] = None
        if len(self._recently_finished) > _RECENTLY_FINISHED_CAP:
            self._recently_finished.popitem(last=False)

    def _ready(
        self, now: float, max_traces: int | None, early_by_id: dict[bytes, AssembledTrace]
    ) -> list[bytes]:
        """The ids of the pending traces that are complete now (quiet for the quiet period, or
        their root finished ``root_grace`` ago; an id may come twice): the oldest
        ``max_traces`` of them, then any other with an early-finished part in ``early_by_id``.
        Both walks are in time order (an update moves a trace to the end), so they stop at the
        first trace not complete or at ``max_traces``: a backlog is not walked whole for every
        batch."""
        limit = len(self._pending) + len(self._root_done) if max_traces is None else max_traces
        ready: list[bytes] = []
        quiet_before = now - self._quiet_period_s
        for trace_id, pending in self._pending.items():
            if pending.last_update > quiet_before or len(ready) >= limit:
                break
            ready.append(trace_id)
        root_before = now - self._root_grace_s
        for trace_id, seen_at in self._root_done.items():
            if seen_at > root_before or len(ready) >= limit:
                break
            ready.append(trace_id)
        if early_by_id and len(ready) >= limit:
            chosen = set(ready)
            for trace_id in early_by_id:
                pending_or_none = self._pending.get(trace_id)
                if trace_id in chosen or pending_or_none is None:
                    continue
                root_done_at = self._root_done.get(trace_id)
                if pending_or_none.last_update <= quiet_before or (
                    root_done_at is not None and root_done_at <= root_before
                ):
                    ready.append(trace_id)
        return ready

    def pop_finished(
        self, *, flush_all: bool = False, max_traces: int | None = None
    ) -> list[AssembledTrace]:
        """Traces that are complete now (all pending ones with ``flush_all``, at shutdown); at
        most about ``max_traces`` of them, oldest first (a trace whose early-finished part is
        popped comes with it), so what one batch holds in memory while it is processed is
        bounded however far behind the pipeline is."""
        now = self._clock()
        finished: list[AssembledTrace] = []
        with self._lock:
            early_by_id: dict[bytes, AssembledTrace] = {}
            for early, first_seq in self._early:
                self._pending_spans -= len(early.spans)
                self._unref_seq(first_seq)
                early_by_id[early.trace_id] = early
                finished.append(early)
            self._early.clear()
            ready = list(self._pending) if flush_all else self._ready(now, max_traces, early_by_id)
            if max_traces is not None and len(ready) > max_traces:
                ready = ready[:max_traces] + [
                    trace_id for trace_id in ready[max_traces:] if trace_id in early_by_id
                ]
            completed = 0
            for trace_id in ready:
                pending_or_none = self._pending.pop(trace_id, None)
                self._root_done.pop(trace_id, None)
                if pending_or_none is None:
                    continue  # listed twice: quiet and root-finished
                self._pending_spans -= len(pending_or_none.spans)
                self._unref_seq(pending_or_none.first_seq)
                self._remember_finished(trace_id)
                early_part = early_by_id.get(trace_id)
                if early_part is not None:
                    # Its early-finished part is not stored yet, so the fragment could not be
                    # matched with it later: one trace, processed once.
                    early_part.spans.extend(pending_or_none.spans)
                    continue
                finished.append(
                    AssembledTrace(
                        trace_id=trace_id, spans=pending_or_none.spans, late=pending_or_none.late
                    )
                )
                completed += 1
            self.stats.traces_finished += completed
        return finished


def unique_spans(spans: Iterable[SpanRef]) -> list[SpanRef]:
    """The spans in order, each span id once (its first copy): a retried export can deliver a
    span twice, and a trace stored in parts then holds it twice."""
    seen: set[bytes] = set()
    unique: list[SpanRef] = []
    for ref in spans:
        span_id = ref.span.span_id
        if span_id not in seen:
            seen.add(span_id)
            unique.append(ref)
    return unique
