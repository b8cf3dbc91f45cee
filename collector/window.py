"""A window of stored requests, re-derived from their stored spans for ``diagnose`` and ``compare``.

The store keeps every request's spans (client span included, however late it arrived), so the
records are rebuilt exactly as the pipeline built them (``timeline.normalize`` then
``budget.request_record``) rather than read back from summary columns: window diagnosis needs
the whole record (ITL gaps, prefix hashes, preemptions). ``stored_spans_by_trace`` is also how
the collector reads a trace's stored spans back when late spans join it (``pipeline``).

This module only reads: the analysis of the records is ``processors.window`` (pure), and
``collector.diagnose`` puts the two together for ``diagnose`` / ``compare`` and renders them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tokentrace.collector.assembly import unique_spans
from tokentrace.collector.pipeline import group_by_trace
from tokentrace.collector.store import Store
from tokentrace.collector.store.query import QueryTimeoutError
from tokentrace.processors.budget import request_record
from tokentrace.processors.diagnosis import DiagnosisConfig
from tokentrace.processors.model import AssembledTrace, RequestRecord, SpanRef
from tokentrace.processors.timeline import normalize

_log = logging.getLogger(__name__)


@dataclass(slots=True)
class StoredWindow:
    records: list[RequestRecord]
    traces_found: int
    traces_asked: int
    undecodable: int = 0
    """Stored traces whose spans could not be parsed or normalised (logged, skipped)."""
    diagnosis: DiagnosisConfig = field(default_factory=DiagnosisConfig)
    """The collector's diagnosis settings (the store's), by which the records were derived and
    by which the window is to be diagnosed, as the store's request documents are."""


def records_of_traces(
    store: Store,
    trace_ids: Iterable[bytes],
    *,
    deadline: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> StoredWindow:
    """The request records of the given traces, from their stored spans.

    ``deadline`` (on ``clock``): past it, QueryTimeoutError instead of reading on (re-deriving
    costs about half a millisecond per request: an API must not hold a worker for a minute)."""
    asked = list(dict.fromkeys(trace_ids))
    diagnosis = store.diagnosis_settings()
    window = StoredWindow(records=[], traces_found=0, traces_asked=len(asked), diagnosis=diagnosis)
    for trace_id, otlp in store.traces_otlp(asked):
        if deadline is not None and clock() > deadline:
            raise QueryTimeoutError(
                f"re-derived {window.traces_found:,} of the window's {len(asked):,} traces "
                "before the time budget ran out: narrow the window or lower the request limit"
            )
        window.traces_found += 1
        try:
            for grouped_id, spans in stored_spans_by_trace(otlp).items():
                for timeline in normalize(AssembledTrace(grouped_id, spans)):
                    window.records.append(
                        request_record(timeline, itl_outlier_ratio=diagnosis.itl_outlier_ratio)
                    )
        except Exception:  # one bad trace must not hide the window
            window.undecodable += 1
            _log.warning("stored trace %s could not be re-derived", trace_id.hex(), exc_info=True)
    return window


def stored_spans_by_trace(otlp: bytes) -> dict[bytes, list[SpanRef]]:
    """The spans of a stored trace (a serialised ``ExportTraceServiceRequest``, possibly
    written in several parts) grouped by trace id, each span id once."""
    groups, _ = group_by_trace(ExportTraceServiceRequest.FromString(otlp))
    return {trace_id: unique_spans(spans) for trace_id, spans in groups.items()}
