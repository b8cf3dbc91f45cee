"""A window of stored requests, re-derived from their stored spans for ``diagnose`` and ``compare``.

The store keeps every request's spans (client span included, however late it arrived), so the
records are rebuilt exactly as the pipeline built them (``timeline.normalize`` then
``budget.request_record``) rather than read back from summary columns: window diagnosis needs
the whole record (ITL gaps, prefix hashes, preemptions), and a client span that reached the
collector after its trace was assembled still counts here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tokentrace.collector.pipeline import group_by_trace
from tokentrace.collector.store.sqlite import RequestStore
from tokentrace.processors.budget import request_record
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


def records_of_traces(store: RequestStore, trace_ids: Iterable[bytes]) -> StoredWindow:
    """The request records of the given traces, from their stored spans."""
    asked = list(dict.fromkeys(trace_ids))
    window = StoredWindow(records=[], traces_found=0, traces_asked=len(asked))
    for trace_id, otlp in store.traces_otlp(asked):
        window.traces_found += 1
        try:
            request = ExportTraceServiceRequest.FromString(otlp)
            groups, _ = group_by_trace(request)
            for grouped_id, spans in groups.items():
                # A retried export can deliver a span twice; the stored parts then hold it twice.
                for timeline in normalize(AssembledTrace(grouped_id, _first_of_each(spans))):
                    window.records.append(request_record(timeline))
        except Exception:  # one bad trace must not hide the window
            window.undecodable += 1
            _log.warning("stored trace %s could not be re-derived", trace_id.hex(), exc_info=True)
    return window


def _first_of_each(spans: list[SpanRef]) -> list[SpanRef]:
    """The spans in order, each span id once (its first copy)."""
    seen: set[bytes] = set()
    unique: list[SpanRef] = []
    for ref in spans:
        if ref.span.span_id not in seen:
            seen.add(ref.span.span_id)
            unique.append(ref)
    return unique
