"""The request store as a pipeline sink: request rows, trace spans, live percentile slices.

``stored_spans`` is the pipeline's look-up of a trace's stored spans, for late spans that join
their request (the collector wires it in; the pipeline knows nothing of the store).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from tokentrace.collector.config import StoreConfig
from tokentrace.collector.store.codec import diagnosis_to_json
from tokentrace.collector.store.sqlite import (
    META_COLLECTOR_STARTED_NS,
    META_COLLECTOR_STATS,
    META_DIAGNOSIS,
    META_SLO_TARGETS,
    RequestStore,
    StoreWriteError,
)
from tokentrace.collector.window import stored_spans_by_trace
from tokentrace.processors.diagnosis import DiagnosisConfig
from tokentrace.processors.model import SpanRef
from tokentrace.processors.slo import SloTarget

if TYPE_CHECKING:
    from tokentrace.collector.pipeline import Pipeline, ProcessedTrace

_log = logging.getLogger(__name__)

_DEFAULT_PRUNE_INTERVAL_S = 10.0
_PRUNE_BUDGET_S = 0.5
_DEFAULT_REJECT_LOG_INTERVAL_S = 60.0
"""Left-out records are logged at most this often (the counters say how many)."""


def targets_to_json(targets: Sequence[SloTarget]) -> str:
    return json.dumps(
        [
            {
                "name": target.name,
                "metric": target.metric,
                "percentile": target.percentile,
                "threshold": f"{target.threshold_ns}ns",
                "selector": dict(target.selector),
            }
            for target in targets
        ]
    )


class StoreSink:
    def __init__(
        self,
        config: StoreConfig,
        *,
        slo_targets: Sequence[SloTarget] = (),
        diagnosis: DiagnosisConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = RequestStore(
            config.path, retention_s=config.retention_s, max_requests=config.max_requests
        )
        self._clock = clock
        self._next_prune = clock() + _DEFAULT_PRUNE_INTERVAL_S
        self._written_requests = 0
        self._rejected_records = 0
        self._failed_batches = 0
        self._next_reject_log = clock()
        self._store.set_meta(META_SLO_TARGETS, targets_to_json(slo_targets))
        self._store.set_meta(META_DIAGNOSIS, diagnosis_to_json(diagnosis or DiagnosisConfig()))
        self._store.set_meta(META_COLLECTOR_STARTED_NS, str(time.time_ns()))

    @property
    def store(self) -> RequestStore:
        return self._store

    def export_traces(self, batch: Sequence[ProcessedTrace]) -> None:
        """Store the batch (with each trace's OTLP encoding made once by the pipeline).

        Records the store left out are counted and logged (rate-limited) here; a batch that was
        not stored at all is counted as failed and re-raised for the pipeline's error counters.
        """
        try:
            self._store.write(
                [(item.trace, item.records, item.otlp) for item in batch],
                replacing={
                    item.trace.trace_id: item.replaces_stored
                    for item in batch
                    if item.replaces_stored
                },
            )
        except StoreWriteError as error:
            self._written_requests += error.written
            self._rejected_records += error.rejected
            if error.written == 0:  # rolled back, or nothing in it was storable
                self._failed_batches += 1
                raise
            now = self._clock()
            if now >= self._next_reject_log:
                self._next_reject_log = now + _DEFAULT_REJECT_LOG_INTERVAL_S
                _log.warning("%s (%d left out so far)", error, self._rejected_records)
            return
        except Exception:
            self._failed_batches += 1
            raise
        self._written_requests += sum(len(item.records) for item in batch)

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

    def housekeeping(self, pipeline: Pipeline, *, final: bool = False) -> None:
        if pipeline.percentiles is not None:
            # The open slice too, so `tokentrace top` is live: it is rewritten until it closes.
            percentiles = pipeline.percentiles
            slices = percentiles.drain_closed_slices() + percentiles.open_slice()
            if slices:
                self._store.write_sketch_slices(slices)
        self._store.set_meta(META_COLLECTOR_STATS, json.dumps(pipeline.stats_snapshot()))
        if final or self._clock() >= self._next_prune:
            self._prune()
            self._next_prune = self._clock() + _DEFAULT_PRUNE_INTERVAL_S

    def _prune(self) -> None:
        """Enforce retention and max_requests: batches until caught up or the time budget is
        spent (the rest waits for the next interval, so writes are never starved)."""
        deadline = self._clock() + _PRUNE_BUDGET_S
        while self._store.prune() >= self._store.prune_batch and self._clock() < deadline:
            pass

    def shutdown(self, timeout_s: float) -> None:
        self._store.close()

    def stats(self) -> dict[str, int]:
        return {
            "written_requests": self._written_requests,
            "rejected_records": self._rejected_records,
            "failed_batches": self._failed_batches,
            "checkpoints": self._store.checkpoints,
            "failed_checkpoints": self._store.failed_checkpoints,
            "replaced_traces": self._store.replaced_traces,
            "pruned_requests": self._store.pruned_requests,
        }
