"""The ``store`` exporter: request rows and trace spans per batch; on each pipeline tick the
percentile slices (the open one too, so ``tokentrace top`` is live) and the collector's
self-telemetry snapshot (``collector_stats``); retention on its own interval.

``stored_spans`` is the pipeline's look-up of a trace's stored spans, for late spans that join
their request (the collector wires it in; the pipeline knows nothing of the store).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final

from tokentrace.agent import semconv
from tokentrace.collector.component import ExportRetryable
from tokentrace.collector.component_configs import StoreConfig
from tokentrace.collector.self_telemetry import ComponentTelemetry, metric_key
from tokentrace.collector.store import (
    META_COLLECTOR_STARTED_NS,
    META_SLO_TARGETS,
    Store,
    StoreWriteError,
    open_store,
)
from tokentrace.collector.store.contract import (
    META_DIAGNOSIS,
    STATS_WRITTEN_AT,
    collector_stats_key,
    diagnosis_to_json,
)
from tokentrace.collector.window import stored_spans_by_trace
from tokentrace.processors.diagnosis import DiagnosisConfig
from tokentrace.processors.model import SpanRef
from tokentrace.processors.slo import SloTarget, targets_to_json

if TYPE_CHECKING:
    from tokentrace.collector.pipeline import PipelineTick, ProcessedTrace

_log = logging.getLogger(__name__)

_DEFAULT_PRUNE_INTERVAL_S = 10.0
_PRUNE_BUDGET_S = 0.5
_DEFAULT_REJECT_LOG_INTERVAL_S = 10.0
"""Left-out (malformed or quarantined) records are logged in one line at most this often; the
line says how many such lines were suppressed since the last, and the counters say how many
records."""
SNAPSHOT_PREFIX: Final = "StoreSink."
"""What the view given to ``StoreSink`` prefixes its snapshot keys with."""
_COUNTERS: Final = {
    semconv.SELF_METRIC_WRITTEN_REQUESTS: "requests written",
    semconv.SELF_METRIC_REJECTED_RECORDS: "requests the store left out",
    semconv.SELF_METRIC_QUARANTINED_RECORDS: "requests dropped: their trace could not be stored",
    semconv.SELF_METRIC_FAILED_BATCHES: "batch writes that stored nothing (each attempt)",
    semconv.SELF_METRIC_CHECKPOINTS: "WAL checkpoints run",
    semconv.SELF_METRIC_FAILED_CHECKPOINTS: "WAL checkpoints failed",
    semconv.SELF_METRIC_REPLACED_TRACES: "trace writes that replaced the stored spans",
    semconv.SELF_METRIC_PRUNED_REQUESTS: "requests pruned",
}


class StoreSink:
    def __init__(
        self,
        config: StoreConfig,
        *,
        slo_targets: Sequence[SloTarget] = (),
        diagnosis: DiagnosisConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        telemetry: ComponentTelemetry | None = None,
    ) -> None:
        """Opens the store (the pipeline's look-up of stored spans works from here on).
        ``telemetry``: this exporter's view of the collector's registry (snapshot prefix
        ``SNAPSHOT_PREFIX``), which the counters (``stats()``) are reported to."""
        self._store = open_store(
            config.path, retention_s=config.retention_s, max_requests=config.max_requests
        )
        self._clock = clock
        self._next_prune = clock() + _DEFAULT_PRUNE_INTERVAL_S
        self._written_requests = 0
        self._rejected_records = 0
        self._failed_batches = 0
        self._quarantined_records = 0
        self._next_reject_log = clock()
        self._suppressed_reject_logs = 0
        self._store.set_meta(META_SLO_TARGETS, targets_to_json(slo_targets))
        self._store.set_meta(META_DIAGNOSIS, diagnosis_to_json(diagnosis or DiagnosisConfig()))
        self._store.set_meta(META_COLLECTOR_STARTED_NS, str(time.time_ns()))
        # Each replica of a shared store its own stats, which readers merge.
        self._stats_key = collector_stats_key(self._store.writer_id)
        if telemetry is not None:
            telemetry.observe(self.stats, counters=_COUNTERS)

    @property
    def store(self) -> Store:
        return self._store

    def export_traces(self, batch: Sequence[ProcessedTrace]) -> None:
        """Store the batch (with each trace's OTLP encoding made once by the pipeline).

        Isolation per trace: a trace the store could not write even alone is quarantined by the
        store (dropped), the rest of the batch is stored, and nothing is raised; it is counted
        (``quarantined_records``, and in ``rejected_records`` with malformed records) and logged
        in one line at most every ``_DEFAULT_REJECT_LOG_INTERVAL_S``. A batch the database
        refused whole (full, locked, an I/O error) raises ``ExportRetryable``: the pipeline
        holds it and hands it over again. One with nothing storable in it, or refused part-way,
        is counted as failed and re-raised for the pipeline's error counters.
        """
        store = self._store
        failed_before = store.failed_batches
        quarantined_before = store.quarantined_records
        quarantined_traces_before = store.quarantined_traces
        try:
            store.write(
                [(item.trace, item.records, item.otlp) for item in batch],
                replacing={
                    item.trace.trace_id: item.replaces_stored
                    for item in batch
                    if item.replaces_stored
                },
            )
        except StoreWriteError as error:
            if error.retryable:
                self._failed_batches += 1
                raise ExportRetryable(str(error)) from error
            self._written_requests += error.written
            self._rejected_records += error.rejected
            self._quarantined_records += store.quarantined_records - quarantined_before
            quarantined = store.quarantined_traces > quarantined_traces_before
            if store.failed_batches > failed_before or (error.written == 0 and not quarantined):
                # rolled back, or nothing in it was storable
                self._failed_batches += 1
                raise
            self._log_left_out(error)
            return
        except Exception:
            self._failed_batches += 1
            raise
        self._written_requests += sum(len(item.records) for item in batch)

    @property
    def quarantined_records(self) -> int:
        """Request records dropped because their trace could not be stored even alone (also
        in the ``rejected_records`` counter)."""
        return self._quarantined_records

    def _log_left_out(self, error: StoreWriteError) -> None:
        """One warning per ``_DEFAULT_REJECT_LOG_INTERVAL_S`` at most, counting the rest."""
        now = self._clock()
        if now < self._next_reject_log:
            self._suppressed_reject_logs += 1
            return
        self._next_reject_log = now + _DEFAULT_REJECT_LOG_INTERVAL_S
        suppressed, self._suppressed_reject_logs = self._suppressed_reject_logs, 0
        _log.warning(
            "%s (%d left out so far, %d quarantined; %d similar messages suppressed)",
            error,
            self._rejected_records,
            self._quarantined_records,
            suppressed,
        )

    def stored_spans(self, trace_id: bytes) -> list[SpanRef] | None:
        """The spans stored for ``trace_id`` (each span id once), or None when the store holds
        none or more than its ``max_trace_bytes`` (not read: the cost stays bounded).

        Runs on the pipeline thread, which is also this sink's writer: the read goes through a
        read-only connection of its own, which sees every batch written so far (committed
        before ``export_traces`` returned). Raises when the store or the spans cannot be read.
        """
        otlp = self._store.trace_otlp(trace_id, max_bytes=self._store.max_trace_bytes)
        if otlp is None:
            return None
        return stored_spans_by_trace(otlp).get(trace_id)

    @property
    def shared(self) -> bool:
        """Whether other collectors write the same store (the pipeline then asks
        ``stored_trace_ids`` which traces they already stored)."""
        return self._store.shared

    def stored_trace_ids(self, trace_ids: Sequence[bytes]) -> set[bytes]:
        """Which of ``trace_ids`` the store holds spans of (one query per 500 ids)."""
        return self._store.stored_trace_ids(trace_ids)

    def tick(self, tick: PipelineTick) -> None:
        if tick.percentile_slices:
            self._store.write_sketch_slices(tick.percentile_slices)
        stats = {**tick.collector_stats, STATS_WRITTEN_AT: time.time()}
        self._store.set_meta(self._stats_key, json.dumps(stats))
        if tick.final or self._clock() >= self._next_prune:
            self._prune()
            self._next_prune = self._clock() + _DEFAULT_PRUNE_INTERVAL_S

    def _prune(self) -> None:
        """Enforce retention and max_requests: batches until caught up or the time budget is
        spent (the rest waits for the next interval, so writes are never starved)."""
        deadline = self._clock() + _PRUNE_BUDGET_S
        while self._store.prune() >= self._store.prune_batch and self._clock() < deadline:
            pass

    def start(self) -> None:
        """Nothing left to do: the store was opened when the sink was made."""

    def shutdown(self, timeout_s: float) -> None:
        self._store.close()

    def stats(self) -> dict[str, int]:
        """The counters, by ``metric_key`` (read by the self-telemetry on collection)."""
        store = self._store
        values = (
            self._written_requests,
            self._rejected_records,
            self._quarantined_records,
            self._failed_batches,
            store.checkpoints,
            store.failed_checkpoints,
            store.replaced_traces,
            store.pruned_requests,
        )
        return {metric_key(name): value for name, value in zip(_COUNTERS, values, strict=True)}
