"""The traces pipeline: receivers -> assembly -> processors -> exporters.

Receivers call ``consume_traces`` on their own threads; it only groups span references by trace
id and hands them to the assembler (one short lock). One worker thread pops finished traces,
derives one ``RequestRecord`` per request (normalise -> budget -> the configured processors),
writes the derived attributes onto the request spans and hands the batch to the exporters. The
exporters never block that thread for long: the OTLP ones enqueue pre-serialised bytes, the store
writes one transaction per batch.

Every processor is a function ``(record) -> None`` wrapped by ``_guarded``: a processor that raises
for one request is counted under ``processor_errors`` and the request goes on without that
processor's result, so one bad span never stalls the pipeline.

Late spans join their request. A late fragment (spans that came after assembly finished their
trace) is looked up through the injected ``earlier_spans`` (the collector wires the store's in):
when the trace's stored spans are found, the whole trace (stored spans first, then the
fragment's, each span id once) is derived again exactly as if it had arrived whole, and the
``ProcessedTrace`` names the stored records it replaces (``replaces_stored``), so the store swaps
the rows in one transaction and a client-only record left by a client span that came first is
gone. ``trace`` and ``otlp`` still hold only the fragment: exporters append or send those spans
alone, never the stored ones again. Two rules keep the derived state counted once:

- Percentiles: each request adds at most one value to each metric's sketch. A re-derived
  request whose request span was derived before (same span id) records only the metrics that
  earlier record lacked (in practice ``network``, when a late client span joins server spans);
  one with no earlier record of its own (server spans joining a client-only record, whose
  values were the client's, all ``unattributed``) records all its metrics.
- Diagnosis: the recently seen prompt prefixes remember which request computed each first, so
  a request derived again is not taken for one that recomputed its own prefix.

Without a look-up, or when it finds nothing (pruned, too large, failed), a late fragment is
processed alone and its client-only timelines are dropped (they would pose as a second
request); ``late_traces_rederived`` and ``late_traces_unmatched`` count the two cases.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.resource.v1.resource_pb2 import Resource

from tokentrace.agent import semconv
from tokentrace.collector.assembly import TraceAssembler, unique_spans
from tokentrace.collector.config import CollectorConfig
from tokentrace.collector.consumer import Unavailable
from tokentrace.collector.encoding import encode_trace_request
from tokentrace.processors.budget import request_record
from tokentrace.processors.diagnosis import DiagnosisConfig, default_verdict
from tokentrace.processors.enrich import enrich_span
from tokentrace.processors.model import (
    AssembledTrace,
    RequestMetrics,
    RequestRecord,
    RequestTimeline,
    SpanRef,
)
from tokentrace.processors.percentiles import PercentileStore
from tokentrace.processors.sketches import SketchKey
from tokentrace.processors.slo import SloTarget, mark_request
from tokentrace.processors.timeline import DIALECT_GENAI_CLIENT, normalize

_log = logging.getLogger(__name__)

_DEFAULT_TICK_S = 0.05
_DEFAULT_HOUSEKEEPING_S = 1.0
_DEFAULT_PRUNE_EVERY_S = 60.0
_SEEN_PREFIXES_CAP = 50_000
_UNKNOWN_SERVICE = "unknown_service"

RequestProcessor = Callable[[RequestRecord], None]
EarlierSpans = Callable[[bytes], list[SpanRef] | None]
"""The spans already stored for a trace id, each span id once (None: none found)."""
_PERCENTILES = "percentiles"


class TraceSink(Protocol):
    """What the pipeline hands finished traces to (the store, an OTLP exporter)."""

    def export_traces(self, batch: Sequence[ProcessedTrace]) -> None: ...

    def housekeeping(self, pipeline: Pipeline, *, final: bool = False) -> None:
        """Periodic work on the pipeline thread (about once a second); ``final`` at shutdown."""

    def shutdown(self, timeout_s: float) -> None: ...

    def stats(self) -> dict[str, int]: ...


@dataclass(slots=True)
class ProcessedTrace:
    trace: AssembledTrace
    records: list[RequestRecord]
    otlp: bytes = b""
    """The enriched trace as one serialised ExportTraceServiceRequest, encoded once for every
    exporter (serialised requests concatenate into a valid request)."""
    replaces_stored: list[bytes] = field(default_factory=list)
    """Request span ids of the stored records that ``records`` replace: set when a late
    fragment (``trace``, all that ``otlp`` holds) was derived with its trace's stored spans."""


@dataclass(slots=True)
class PipelineStats:
    traces: int = 0
    requests: int = 0
    """Requests derived, each once (re-deriving a stored one does not count it again)."""
    late_traces_rederived: int = 0
    """Late fragments derived again with their trace's stored spans."""
    late_traces_unmatched: int = 0
    """Late fragments processed alone: no stored spans of their trace were found."""
    processor_errors: dict[str, int] = field(default_factory=dict)
    exporter_errors: dict[str, int] = field(default_factory=dict)


def _service_name(resource: Resource) -> str:
    for attribute in resource.attributes:
        if attribute.key == semconv.SERVICE_NAME:
            return attribute.value.string_value or _UNKNOWN_SERVICE
    return _UNKNOWN_SERVICE


def group_by_trace(request: ExportTraceServiceRequest) -> tuple[dict[bytes, list[SpanRef]], int]:
    """Span references of one OTLP request grouped by trace id, and the span count."""
    groups: dict[bytes, list[SpanRef]] = {}
    count = 0
    for resource_spans in request.resource_spans:
        resource = resource_spans.resource
        service = _service_name(resource)
        for scope_spans in resource_spans.scope_spans:
            scope = scope_spans.scope
            for span in scope_spans.spans:
                ref = SpanRef(span, resource, scope, service)
                trace_refs = groups.get(span.trace_id)
                if trace_refs is None:
                    groups[span.trace_id] = [ref]
                else:
                    trace_refs.append(ref)
                count += 1
    return groups, count


def _diagnosis_processor(config: DiagnosisConfig, targets: Sequence[SloTarget]) -> RequestProcessor:
    # Prefix hashes seen recently, each with the request that computed it first, so that a
    # recomputed shared prefix can be recognised, and a request derived again (a late span
    # joined it) is not taken for one that recomputed its own prefix.
    first_seen_by: OrderedDict[str, tuple[bytes, bytes]] = OrderedDict()
    target_metrics = [(target.name, target.metric) for target in targets]

    def diagnose(record: RequestRecord) -> None:
        # After the SLO processor: the default verdict answers the first breached target.
        slo = record.slo
        breached = [(name, metric) for name, metric in target_metrics if slo.get(name) is False]
        prefix = record.timeline.prefix_hash
        request = (record.timeline.trace_id, record.timeline.span_id)
        seen: frozenset[str] = frozenset()
        if prefix and first_seen_by.get(prefix, request) != request:
            seen = frozenset((prefix,))
        record.verdict = default_verdict(
            record, config, breached_metrics=breached, seen_prefixes=seen
        )
        record.prefix_seen = bool(seen)
        if prefix:
            first_seen_by.setdefault(prefix, request)
            first_seen_by.move_to_end(prefix)
            if len(first_seen_by) > _SEEN_PREFIXES_CAP:
                first_seen_by.popitem(last=False)

    return diagnose


def _slo_processor(targets: list[SloTarget]) -> RequestProcessor:
    def mark(record: RequestRecord) -> None:
        record.slo = mark_request(record, targets)

    return mark


def _sketch_key(record: RequestRecord) -> SketchKey:
    timeline = record.timeline
    return SketchKey(timeline.service, timeline.model, timeline.operation, record.prompt_bucket)


def _percentiles_processor(store: PercentileStore) -> RequestProcessor:
    def record_percentiles(record: RequestRecord) -> None:
        store.record(_sketch_key(record), record.metrics)

    return record_percentiles


def _record_unrecorded(
    store: PercentileStore, recorded: RequestMetrics | None, record: RequestRecord
) -> None:
    """Record a re-derived request's metrics, less those its earlier record put there."""
    skip: frozenset[str] = frozenset()
    if recorded is not None:
        skip = frozenset(m for m in semconv.LATENCY_METRICS if recorded.value(m) is not None)
    store.record(_sketch_key(record), record.metrics, skip=skip)


class Pipeline:
    """The one traces pipeline of a collector. Implements ``TraceConsumer``."""

    def __init__(
        self,
        config: CollectorConfig,
        *,
        sinks: Sequence[TraceSink] = (),
        percentile_store: PercentileStore | None = None,
        earlier_spans: EarlierSpans | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        tick_s: float = _DEFAULT_TICK_S,
    ) -> None:
        """``earlier_spans`` looks up a trace's stored spans for late fragments (called on the
        pipeline thread, once per late fragment; see the module docstring)."""
        self.config = config
        self._sinks = list(sinks)
        self._earlier_spans = earlier_spans
        self._monotonic = monotonic
        self._tick_s = tick_s
        assembly = config.assembly
        self.assembler = TraceAssembler(
            quiet_period_s=assembly.quiet_period_s,
            root_grace_s=assembly.root_grace_s,
            max_traces=assembly.max_traces,
            max_spans_per_trace=assembly.max_spans_per_trace,
            max_pending_spans=assembly.max_pending_spans,
            clock=monotonic,
        )
        self.percentiles = percentile_store
        if self.percentiles is None and config.percentiles is not None:
            self.percentiles = PercentileStore(config=config.percentiles)
        self.slo_targets = list(config.slo_targets)
        self._processors: list[tuple[str, RequestProcessor]] = []
        if self.slo_targets:
            self._processors.append(("slo", _slo_processor(self.slo_targets)))
        if config.diagnosis is not None:
            self._processors.append(
                ("diagnosis", _diagnosis_processor(config.diagnosis, self.slo_targets))
            )
        self._outlier_ratio = (config.diagnosis or DiagnosisConfig()).itl_spike_ratio
        if self.percentiles is not None:
            self._processors.append((_PERCENTILES, _percentiles_processor(self.percentiles)))
        self.stats = PipelineStats()
        self._stop = threading.Event()
        self._accepting = True
        self._worker: threading.Thread | None = None
        # Processors and sinks keep per-pipeline state (seen prefixes, the store's writer): one
        # thread at a time, whether the worker or a caller flushing.
        self._process_lock = threading.Lock()
        self._stats_sources: list[tuple[str, Callable[[], dict[str, int]]]] = []

    # --- TraceConsumer -------------------------------------------------------------------------
    def consume_traces(self, request: ExportTraceServiceRequest) -> None:
        if not self._accepting:
            raise Unavailable("the collector is shutting down")
        groups, count = group_by_trace(request)
        if count:
            self.assembler.add(groups, count)

    # --- processing ------------------------------------------------------------------------------
    def process_trace(self, trace: AssembledTrace) -> ProcessedTrace:
        """Derive the request records of one trace and enrich its request spans; a late
        fragment joins its trace's stored spans when they are found (module docstring)."""
        if trace.late:
            earlier_spans = self._look_up_earlier_spans(trace.trace_id)
            if earlier_spans:
                self.stats.late_traces_rederived += 1
                return self._rederive(trace, earlier_spans)
            self.stats.late_traces_unmatched += 1
        records: list[RequestRecord] = []
        try:
            timelines = normalize(trace)
            if trace.late:
                # A client span that came after its server spans were finished would pose as a
                # second, client-only request; its spans still go to the exporters.
                timelines = [t for t in timelines if t.dialect != DIALECT_GENAI_CLIENT]
        except Exception:  # a dialect bug must not lose the trace: pass it through unenriched
            self._count_error(self.stats.processor_errors, "normalize")
            _log.exception("normalising trace %s failed", trace.trace_id.hex())
            return ProcessedTrace(trace, records, encode_trace_request(trace.spans))
        for timeline in timelines:
            record = self._budgeted(trace, timeline)
            if record is None:
                continue
            for name, processor in self._processors:
                self._guarded(name, processor, record)
            records.append(record)
        self._enrich(trace.spans, records)
        return ProcessedTrace(trace, records, encode_trace_request(trace.spans))

    def _budgeted(self, trace: AssembledTrace, timeline: RequestTimeline) -> RequestRecord | None:
        try:
            return request_record(timeline, outlier_ratio=self._outlier_ratio)
        except Exception:
            self._count_error(self.stats.processor_errors, "budget")
            _log.exception("budget of trace %s failed", trace.trace_id.hex())
            return None

    def _enrich(self, spans: Sequence[SpanRef], records: Sequence[RequestRecord]) -> None:
        if not records:
            return
        by_span_id = {record.timeline.span_id: record for record in records}
        for ref in spans:
            record_or_none = by_span_id.get(ref.span.span_id)
            if record_or_none is not None:
                try:
                    enrich_span(ref.span, record_or_none)
                except Exception:
                    self._count_error(self.stats.processor_errors, "enrich")

    def _look_up_earlier_spans(self, trace_id: bytes) -> list[SpanRef] | None:
        if self._earlier_spans is None:
            return None
        try:
            return self._earlier_spans(trace_id)
        except Exception:  # the fragment is still processed alone
            _log.warning(
                "looking up the stored spans of trace %s failed", trace_id.hex(), exc_info=True
            )
            return None

    def _rederive(self, fragment: AssembledTrace, earlier_spans: list[SpanRef]) -> ProcessedTrace:
        """The records of a late fragment's whole trace (its stored spans, then the fragment's),
        replacing the stored ones; only the fragment's spans are enriched and encoded."""
        trace_id = fragment.trace_id
        whole = AssembledTrace(trace_id, unique_spans([*earlier_spans, *fragment.spans]))
        try:
            earlier_timelines = normalize(AssembledTrace(trace_id, earlier_spans))
            timelines = normalize(whole)
        except Exception:  # as in process_trace: the stored records stay as they are
            self._count_error(self.stats.processor_errors, "normalize")
            _log.exception("normalising trace %s failed", trace_id.hex())
            return ProcessedTrace(fragment, [], encode_trace_request(fragment.spans))
        # What the earlier derivation recorded, by request span id.
        recorded: dict[bytes, RequestMetrics] = {}
        for timeline in earlier_timelines:
            with suppress(Exception):  # counted when the earlier part was processed
                recorded[timeline.span_id] = request_record(timeline).metrics
        processors = [(name, p) for name, p in self._processors if name != _PERCENTILES]
        records: list[RequestRecord] = []
        for timeline in timelines:
            record = self._budgeted(whole, timeline)
            if record is None:
                continue
            for name, processor in processors:
                self._guarded(name, processor, record)
            if self.percentiles is not None:
                record_new = partial(
                    _record_unrecorded, self.percentiles, recorded.get(timeline.span_id)
                )
                self._guarded(_PERCENTILES, record_new, record)
            records.append(record)
        self._enrich(fragment.spans, records)
        return ProcessedTrace(
            fragment,
            records,
            encode_trace_request(fragment.spans),
            replaces_stored=[timeline.span_id for timeline in earlier_timelines],
        )

    def _guarded(self, name: str, processor: RequestProcessor, record: RequestRecord) -> None:
        try:
            processor(record)
        except Exception:
            self._count_error(self.stats.processor_errors, name)
            _log.debug("processor %s failed", name, exc_info=True)

    @staticmethod
    def _count_error(counters: dict[str, int], name: str) -> None:
        counters[name] = counters.get(name, 0) + 1

    def process_once(self, *, flush_all: bool = False) -> int:
        """Process every finished trace and export the batch; returns the number of traces."""
        with self._process_lock:
            return self._process_finished(flush_all=flush_all)

    def _process_finished(self, *, flush_all: bool) -> int:
        traces = self.assembler.pop_finished(flush_all=flush_all)
        if not traces:
            return 0
        batch = [self.process_trace(trace) for trace in traces]
        self.stats.traces += len(batch)
        # A re-derived trace's records replace stored ones: only the requests it adds count.
        self.stats.requests += sum(
            max(0, len(item.records) - len(item.replaces_stored)) for item in batch
        )
        for sink in self._sinks:
            try:
                sink.export_traces(batch)
            except Exception:
                self._count_error(self.stats.exporter_errors, type(sink).__name__)
                _log.exception("exporter %s failed on a batch of %d traces", sink, len(batch))
        return len(batch)

    def housekeeping(self, *, final: bool = False) -> None:
        with self._process_lock:
            self._housekeeping(final=final)

    def _housekeeping(self, *, final: bool) -> None:
        for sink in self._sinks:
            try:
                sink.housekeeping(self, final=final)
            except Exception:
                self._count_error(self.stats.exporter_errors, type(sink).__name__)
                _log.exception("housekeeping of %s failed", sink)

    # --- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self._worker = threading.Thread(target=self._run, name="tokentrace-pipeline", daemon=True)
        self._worker.start()

    def _run(self) -> None:
        next_housekeeping = self._monotonic() + _DEFAULT_HOUSEKEEPING_S
        while not self._stop.is_set():
            try:
                processed = self.process_once()
                if self._monotonic() >= next_housekeeping:
                    self.housekeeping()
                    next_housekeeping = self._monotonic() + _DEFAULT_HOUSEKEEPING_S
            except Exception:  # keep serving; the error is visible in the log
                _log.exception("pipeline iteration failed")
                processed = 0
            if not processed:
                self._stop.wait(self._tick_s)

    def stop_accepting(self) -> None:
        """First step of shutdown: receivers get Unavailable, senders retry elsewhere/later."""
        self._accepting = False

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Finish every pending trace, flush the sinks, stop the worker (upstream first)."""
        self._accepting = False
        self._stop.set()
        if self._worker is not None:
            self._worker.join(timeout_s)
        self.process_once(flush_all=True)
        self.housekeeping(final=True)
        deadline = time.monotonic() + timeout_s
        for sink in self._sinks:
            sink.shutdown(max(0.1, deadline - time.monotonic()))

    def add_stats_source(self, name: str, stats: Callable[[], dict[str, int]]) -> None:
        """Counters of a component outside the pipeline (a receiver) to report with its own."""
        self._stats_sources.append((name, stats))

    def stats_snapshot(self) -> dict[str, Any]:
        """Every counter of the collector: what the store shows in `top`, and the benchmark."""
        assembly = self.assembler.stats
        snapshot: dict[str, Any] = {
            "received_spans": assembly.received_spans,
            "traces": self.stats.traces,
            "requests": self.stats.requests,
            "pending_spans": self.assembler.pending_spans,
            "pending_traces": self.assembler.pending_traces,
            "traces_finished_early": assembly.traces_finished_early,
            "spans_dropped_trace_full": assembly.spans_dropped,
            "late_spans": assembly.late_spans,
            "late_traces_rederived": self.stats.late_traces_rederived,
            "late_traces_unmatched": self.stats.late_traces_unmatched,
            "refused_batches": assembly.refused_batches,
            "processor_errors": dict(self.stats.processor_errors),
            "exporter_errors": dict(self.stats.exporter_errors),
        }
        if self.percentiles is not None:
            snapshot["percentile_keys_evicted"] = self.percentiles.keys_evicted
            snapshot["percentile_slices_dropped"] = self.percentiles.slices_dropped
            snapshot["percentile_record_errors"] = self.percentiles.record_errors
        for name, source in self._stats_sources:
            for key, value in source().items():
                snapshot[f"{name}.{key}"] = value
        for sink in self._sinks:
            for key, value in sink.stats().items():
                snapshot[f"{type(sink).__name__}.{key}"] = value
        return snapshot
