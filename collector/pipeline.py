"""The traces pipeline: receivers -> assembly -> processors -> exporters.

Built from the configuration: the processors are made by their factories (``factories.py``), in
the order they run; the exporters come made, by component id. Receivers call ``consume_traces`` on
their own threads; it only groups span references by trace id and hands them to the assembler
(one short lock). One worker thread pops finished traces, derives one ``RequestRecord`` per request
(normalise -> budget -> the configured processors), writes the derived attributes onto the
request spans and hands the batch to the exporters. The exporters never block that thread for
long: the OTLP ones enqueue pre-serialised bytes, the store writes one transaction per batch.

Every processor is a function ``(record) -> None`` wrapped by ``_guarded``: a processor that raises
for one request is counted under ``processor_errors`` and the request goes on without that
processor's result, so one bad span never stalls the pipeline.

Data flows only downstream. About once a second (and once more when it has drained at shutdown)
the worker hands every exporter a ``PipelineTick``: the percentile slices closed since the last
tick plus the open one, the self-telemetry snapshot, and the OTLP metrics view (made on first ask,
so only when an exporter's own interval is due). What each exporter does with it, and when (store
pruning, upstream metrics), stays its own business.

Tail sampling (``tail_sampling.py``, when configured) decides after every processor ran on the
batch: the exporters get the traces it keeps; the other sinks (the admin extension's request
metrics, which read the records only) still get every trace. Only the kept traces' request spans
are enriched and encoded (``ProcessedTrace.encoded``): a dropped trace costs its derivation and
no more. A dropped trace is done with as an exported one is (its spool segments are released).

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

Collectors that share one store (PostgreSQL, several replicas) see a trace whose spans were
split between them as a late fragment too: before a batch is processed, one look-up
(``stored_traces``) finds the traces whose spans another replica stored already, and each of those
joins them as above (the client span of a request that reached another replica's assembler
first, say). Two replicas assembling parts of one trace at the same moment still both store
theirs: trace-ID routing in front of the replicas keeps that rare.

Without a look-up, or when it finds nothing (pruned, too large, failed), a late fragment is
processed alone and its client-only timelines are dropped (they would pose as a second
request); ``late_traces_rederived`` and ``late_traces_unmatched`` count the two cases.

Acknowledged means durable (with a ``Spool``, ``collector/spool.py``): ``consume_traces``
appends the request to the write-ahead spool and returns (the receiver answers OK) only once an
fsync covered it; then it hands the spans to the assembler with the request's sequence number.
After each exported batch the pipeline tells the spool the lowest sequence number still needed
(the spool's appends not yet handed on, then the assembler's pending traces: read in that
order, nothing slips between them), and segments below it are deleted. ``replay`` (the
collector calls it before the receivers start) feeds what survived a crash back into assembly.
An exporter that cannot take a batch now (the store's database full or locked: it raises
``ExportRetryable``) gets it again later: the batch is held for that exporter alone (the
others took it), retried with backoff, and its requests' spool segments are kept until it
goes through; while too many traces are held no new batch is taken, so the receivers refuse
with retry hints instead of anything being dropped. After ``_HELD_RETRY_MAX_ELAPSED_S`` it is
given up, counted and logged. Batches are sized to take about ``_BATCH_TIME_BUDGET_S`` each,
so the tick is never starved however far behind the worker is.
A replayed trace is first compared with the store through the same look-up as late spans:
spans already stored are left out, a trace stored whole is not processed again
(``spool_replayed_traces_stored``), one stored in part goes on as a late fragment. So a replay
adds no row twice and no request's latencies twice to the percentiles.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from functools import partial
from types import MappingProxyType
from typing import Any, Final, Protocol

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric
from opentelemetry.proto.resource.v1.resource_pb2 import Resource

from tokentrace.agent import semconv
from tokentrace.collector.assembly import TraceAssembler, unique_spans
from tokentrace.collector.component import (
    KIND_EXPORTER,
    KIND_PIPELINE,
    KIND_PROCESSOR,
    ExportRetryable,
    Factories,
    create_component,
)
from tokentrace.collector.config import CollectorConfig
from tokentrace.collector.consumer import Overloaded, Unavailable
from tokentrace.collector.encoding import encode_trace_request
from tokentrace.collector.factories import FACTORIES
from tokentrace.collector.memory_limiter import MemoryLimiter
from tokentrace.collector.receivers import count_spans, wire
from tokentrace.collector.record_processors import RecordProcessor, RequestProcessor
from tokentrace.collector.self_telemetry import Counter, SelfTelemetry
from tokentrace.collector.spool import Spool, SpoolError
from tokentrace.collector.tail_sampling import TailSampler
from tokentrace.processors.budget import request_record
from tokentrace.processors.diagnosis import DiagnosisConfig
from tokentrace.processors.enrich import enrichment_attributes, remove_received_enrichment
from tokentrace.processors.model import (
    AssembledTrace,
    RequestMetrics,
    RequestRecord,
    RequestTimeline,
    SpanRef,
)
from tokentrace.processors.percentiles import ClosedSlice, PercentileStore
from tokentrace.processors.timeline import DIALECT_GENAI_CLIENT, normalize

_log = logging.getLogger(__name__)

_DEFAULT_TICK_S: Final = 0.05
_DEFAULT_HOUSEKEEPING_S: Final = 1.0
_MAX_BATCH_TRACES: Final = 1024
"""Traces one batch takes at most: what a batch holds while it is processed (records, encoded
spans, the store's rows) stays bounded when the pipeline is behind; the worker takes the next
batch at once."""
_MIN_BATCH_TRACES: Final = 16
_BATCH_TIME_BUDGET_S: Final = 0.2
"""What one batch should take at most: the batch size follows the measured cost per trace, so
the once-a-second tick (self-telemetry, percentile slices) is never more than this late, however
far behind the pipeline is (with 1,024 large traces a batch took ~2 s under a flood)."""
_HELD_MAX_TRACES: Final = 4 * _MAX_BATCH_TRACES
"""Traces held for exporters that asked for a retry (``ExportRetryable``); while this many are
held, no new batch is taken: assembly fills and the receivers answer RESOURCE_EXHAUSTED / 429
(back-pressure to the senders, nothing dropped)."""
_HELD_RETRY_INITIAL_S: Final = 0.5
_HELD_RETRY_MAX_INTERVAL_S: Final = 30.0
_HELD_RETRY_MAX_ELAPSED_S: Final = 300.0
"""Give a held batch up (counted under ``exporter_errors``, one log line) once it has been
retried for this long, as the OpenTelemetry Collector's ``retry_on_failure`` does."""
_DEFAULT_SHUTDOWN_TIMEOUT_S: Final = 10.0
_UNKNOWN_SERVICE: Final = "unknown_service"
_PIPELINE_ID: Final = "traces"
"""The pipeline's own id in the self-telemetry (``service.pipelines.traces``)."""
_BATCH_DURATION_BOUNDS_S: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# Stages of the pipeline itself, counted under processor_errors like the processors.
_NORMALIZE: Final = "normalize"
_BUDGET: Final = "budget"
_ENRICH: Final = "enrich"
_NS_PER_S: Final = 1_000_000_000

EarlierSpans = Callable[[bytes], list[SpanRef] | None]
"""The spans already stored for a trace id, each span id once (None: none found)."""
StoredTraces = Callable[[Sequence[bytes]], set[bytes]]
"""Which of these trace ids a store shared with other collectors already holds spans of."""


class PipelineTick:
    """What the pipeline hands every exporter about once a second: values, never the pipeline.

    ``final``: the last one, after the pipeline drained at shutdown. ``otlp_metrics()`` is made
    on its first call and kept, so an exporter whose interval is not due costs nothing."""

    __slots__ = (
        "_make_otlp_metrics",
        "_otlp_metrics",
        "collector_stats",
        "final",
        "percentile_slices",
    )

    def __init__(
        self,
        *,
        final: bool = False,
        percentile_slices: Sequence[ClosedSlice] = (),
        collector_stats: Mapping[str, Any] = MappingProxyType({}),
        otlp_metrics: Callable[[], list[Metric]] = list,
    ) -> None:
        self.final = final
        self.percentile_slices = tuple(percentile_slices)
        """Closed since the last tick (oldest first), then the open slice: live readers see it,
        rewritten until it closes."""
        self.collector_stats = dict(collector_stats)
        """The self-telemetry snapshot (``SelfTelemetry.snapshot``)."""
        self._make_otlp_metrics = otlp_metrics
        self._otlp_metrics: list[Metric] | None = None

    def otlp_metrics(self) -> list[Metric]:
        """The cumulative percentile histograms and the self-telemetry, as OTLP metrics."""
        if self._otlp_metrics is None:
            self._otlp_metrics = self._make_otlp_metrics()
        return self._otlp_metrics


class TraceSink(Protocol):
    """An exporter as the pipeline sees it (the store, an OTLP exporter); called on the pipeline
    thread only."""

    def export_traces(self, batch: Sequence[ProcessedTrace]) -> None: ...

    def tick(self, tick: PipelineTick) -> None:
        """Periodic work (about once a second; ``tick.final`` at shutdown)."""


@dataclass(slots=True)
class _HeldBatch:
    """A batch some exporters asked to get again (``ExportRetryable``)."""

    batch: list[ProcessedTrace]
    sink_ids: list[str]
    """The exporters still to take it, in the pipeline's order."""
    low_seq: int | None
    """No spooled request of the batch is below this (its segments are kept meanwhile)."""
    first_failed: float
    next_attempt: float
    interval_s: float = _HELD_RETRY_INITIAL_S


@dataclass(slots=True)
class ProcessedTrace:
    trace: AssembledTrace
    records: list[RequestRecord]
    otlp: bytes = b""
    """The enriched trace as one serialised ExportTraceServiceRequest, encoded once for every
    exporter (serialised requests concatenate into a valid request)."""
    encoded: bool = True
    """False while the request spans' enrichment and ``otlp`` wait for tail sampling's decision
    (``Pipeline._encode``): only the traces the exporters get are enriched and encoded."""
    replaces_stored: list[bytes] = field(default_factory=list)
    """Request span ids of the stored records that ``records`` replace: set when a late
    fragment (``trace``, all that ``otlp`` holds) was derived with its trace's stored spans."""


def _service_name(resource: Resource) -> str:
    for attribute in resource.attributes:
        if attribute.key == semconv.SERVICE_NAME:
            return attribute.value.string_value or _UNKNOWN_SERVICE
    return _UNKNOWN_SERVICE


def group_by_trace(
    request: ExportTraceServiceRequest, *, encoded: bytes | None = None
) -> tuple[dict[bytes, list[SpanRef]], int]:
    """Span references of one OTLP request grouped by trace id, and the span count.
    ``encoded``: the bytes ``request`` was parsed from, when at hand: each span keeps its own
    (``SpanRef.wire``) for the exporters."""
    groups: dict[bytes, list[SpanRef]] = {}
    count = 0
    entries = None if encoded is None else wire.span_entries(encoded)
    if entries is not None and len(entries) != count_spans(request):
        entries = None  # not the bytes ``request`` was parsed from: its spans are re-serialised
    for resource_spans in request.resource_spans:
        resource = resource_spans.resource
        service = _service_name(resource)
        resource_wire = resource.SerializeToString()
        for scope_spans in resource_spans.scope_spans:
            scope = scope_spans.scope
            scope_wire = scope.SerializeToString()
            for span in scope_spans.spans:
                ref = SpanRef(
                    span,
                    resource,
                    scope,
                    service,
                    entries[count] if entries else None,
                    resource_wire,
                    scope_wire,
                )
                trace_refs = groups.get(span.trace_id)
                if trace_refs is None:
                    groups[span.trace_id] = [ref]
                else:
                    trace_refs.append(ref)
                count += 1
    return groups, count


def _otlp_metrics(
    percentiles: PercentileStore | None, telemetry: SelfTelemetry, start_ns: int, now_ns: int
) -> list[Metric]:
    metrics = []
    if percentiles is not None:
        metrics = percentiles.to_otlp_metrics(start_time_unix_nano=start_ns, time_unix_nano=now_ns)
    return metrics + telemetry.to_otlp_metrics(start_time_unix_nano=start_ns, time_unix_nano=now_ns)


class Pipeline:
    """The one traces pipeline of a collector. Implements ``TraceConsumer``."""

    def __init__(
        self,
        config: CollectorConfig,
        *,
        sinks: Mapping[str, TraceSink] = MappingProxyType({}),
        earlier_spans: EarlierSpans | None = None,
        stored_traces: StoredTraces | None = None,
        telemetry: SelfTelemetry | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        tick_s: float = _DEFAULT_TICK_S,
        factories: Factories = FACTORIES,
        spool: Spool | None = None,
        memory_limiter: MemoryLimiter | None = None,
    ) -> None:
        """``sinks``: the exporters by component id, in the order they get each batch.
        ``earlier_spans`` looks up a trace's stored spans for late fragments (called on the
        pipeline thread, once per late fragment; see the module docstring). ``stored_traces``:
        given when other collectors write the same store, so a trace whose first spans another
        replica stored is a late fragment here too (one look-up per batch). ``telemetry``: the
        collector's registry (default: one of its own). ``spool``: the write-ahead spool every
        accepted request goes to before it is acknowledged (the pipeline closes it at shutdown);
        None: durability ``none``."""
        self.config = config
        self.telemetry = telemetry if telemetry is not None else SelfTelemetry()
        self._sinks = dict(sinks)
        self._earlier_spans = earlier_spans
        self._stored_traces = stored_traces
        self._monotonic = monotonic
        self._wall_clock = wall_clock
        self._tick_s = tick_s
        self._start_ns = int(wall_clock() * _NS_PER_S)
        assembler: TraceAssembler | None = None
        self._sampler: TailSampler | None = None
        """The ``tail_sampling`` processor: which traces the exporters get (None: all)."""
        self._processors: list[tuple[str, RecordProcessor]] = []
        for component in config.processors:
            made = create_component(
                factories,
                component,
                telemetry=self.telemetry,
                collector_config=config,
                clock=monotonic,
                wall_clock=wall_clock,
            )
            if isinstance(made, TraceAssembler):
                assembler = made
            elif isinstance(made, TailSampler):
                self._sampler = made
            else:
                self._processors.append((component.id, made))
        if assembler is None:
            raise ValueError("the pipeline needs an assembly processor")
        self.assembler = assembler
        self.percentiles: PercentileStore | None = next(
            (p.percentile_store for _, p in self._processors if p.percentile_store is not None),
            None,
        )
        self._itl_outlier_ratio = (config.diagnosis or DiagnosisConfig()).itl_outlier_ratio
        own = self.telemetry.component(_PIPELINE_ID, KIND_PIPELINE)
        self._traces = own.counter(semconv.SELF_METRIC_TRACES, description="traces processed")
        self._requests = own.counter(semconv.SELF_METRIC_REQUESTS, description="requests derived")
        self._late_rederived = own.counter(
            semconv.SELF_METRIC_LATE_TRACES_REDERIVED,
            description="late fragments derived again with their trace's stored spans",
        )
        self._late_unmatched = own.counter(
            semconv.SELF_METRIC_LATE_TRACES_UNMATCHED,
            description="late fragments processed alone",
        )
        self._processor_errors = own.keyed_counter(
            semconv.SELF_METRIC_PROCESSOR_ERRORS,
            key_kind=KIND_PROCESSOR,
            description="requests a processor failed on",
        )
        self._exporter_errors = own.keyed_counter(
            semconv.SELF_METRIC_EXPORTER_ERRORS,
            key_kind=KIND_EXPORTER,
            description="batches or ticks an exporter failed on",
        )
        self._batch_duration = own.histogram(
            semconv.SELF_METRIC_BATCH_DURATION,
            _BATCH_DURATION_BOUNDS_S,
            description="processing one batch and handing it to the exporters",
            unit=semconv.METRIC_UNIT_SECONDS,
        )
        self._spool = spool
        self._memory_limiter = memory_limiter
        self._replayed: set[bytes] = set()
        """Trace ids replayed from the spool and not processed yet (compared with the store)."""
        self._replayed_stored = (
            own.counter(
                semconv.SELF_METRIC_SPOOL_REPLAYED_TRACES_STORED,
                description="replayed traces the store already held",
            )
            if spool is not None
            else Counter()
        )
        self._duplicate_spans = own.counter(
            semconv.SELF_METRIC_DUPLICATE_SPANS,
            description="spans received again (a retried export) and left out",
        )
        self._retried_batches = own.counter(
            semconv.SELF_METRIC_RETRIED_BATCHES,
            description="batch exports retried after an exporter asked to get them again",
        )
        # With tail sampling, the exporters get the kept traces; the other sinks (the admin
        # extension's request metrics) every trace, as the sketches see every request.
        extension_ids = {component.id for component in config.extensions}
        self._sampled_sinks = [sink_id for sink_id in self._sinks if sink_id not in extension_ids]
        self._unsampled_sinks = [sink_id for sink_id in self._sinks if sink_id in extension_ids]
        self._held: list[_HeldBatch] = []
        self._held_traces = 0
        self._batch_traces = _MAX_BATCH_TRACES
        """The size of the next batch (``_BATCH_TIME_BUDGET_S``)."""
        self._stop = threading.Event()
        self._accepting = True
        self._worker: threading.Thread | None = None
        # Processors and sinks keep per-pipeline state (seen prefixes, the store's writer): one
        # thread at a time, whether the worker or a caller flushing.
        self._process_lock = threading.Lock()

    # --- TraceConsumer -------------------------------------------------------------------------
    @property
    def never_blocks(self) -> bool:
        """Without a spool, ``consume_traces`` takes only short locks (no fsync to wait for):
        the HTTP receiver may call it on its event loop."""
        return self._spool is None

    def consume_traces(
        self, request: ExportTraceServiceRequest, *, encoded: bytes | None = None
    ) -> None:
        if not self._accepting:
            raise Unavailable("the collector is shutting down")
        if self._memory_limiter is not None:
            # Before grouping: a refused request should cost as little as it can.
            self._memory_limiter.admit(count_spans(request))
        groups, count = group_by_trace(request, encoded=encoded)
        if not count:
            return
        spool = self._spool
        if spool is None:
            self.assembler.add(groups, count)
            return
        # Refuse before spooling what assembly would refuse: nothing refused is ever replayed.
        self.assembler.check_room(count)
        try:
            # The received bytes when validation left them as they were: no re-serialising.
            seq = spool.append(request.SerializeToString() if encoded is None else encoded)
        except SpoolError as error:  # the disk failed: the sender retries, here or elsewhere
            raise Unavailable(str(error)) from None
        try:
            spool.wait_durable(seq)
            self.assembler.add(groups, count, seq=seq)
        except SpoolError as error:
            raise Unavailable(str(error)) from None
        finally:
            spool.done(seq)

    def replay(self) -> int:
        """Feed the requests the spool kept from the last run into assembly (before the
        receivers start); returns how many. Each keeps its sequence number and its place in
        the spool, so it is deleted once processed, like any other."""
        spool = self._spool
        if spool is None:
            return 0
        replayed = 0
        spans = 0
        for seq, payload in spool.replay():
            try:
                request = ExportTraceServiceRequest.FromString(payload)
            except Exception:  # the CRC matched: written by another version, say
                _log.warning("spool: record %d is not an OTLP export request; skipped", seq)
                continue
            groups, count = group_by_trace(request, encoded=payload)
            if not count:
                continue
            self._replayed.update(groups)
            try:
                self.assembler.add(groups, count, seq=seq)
            except Overloaded:  # more spooled than assembly holds: finish what it has now
                self.process_once(flush_all=True)
                try:
                    self.assembler.add(groups, count, seq=seq)
                except Overloaded as error:
                    _log.warning("spool: record %d skipped at replay: %s", seq, error)
                    continue
            replayed += 1
            spans += count
        if replayed:
            _log.info(
                "spool: replayed %d export requests (%d spans) kept from the last run",
                replayed,
                spans,
            )
        self.release_spool()
        return replayed

    def release_spool(self, *, final: bool = False) -> None:
        """Delete the spool segments whose requests were all processed and exported (``final``:
        the segment still written to as well, at shutdown)."""
        spool = self._spool
        if spool is None:
            return
        low = self._lowest_needed_seq(spool)
        for held in self._held:
            if held.low_seq is not None:
                low = min(low, held.low_seq)
        spool.release(low, active_too=final)

    def _lowest_needed_seq(self, spool: Spool) -> int:
        """No request that is still to be handed to the exporters has a lower sequence number."""
        # The spool first: a request it no longer counts as unfinished is in the assembler.
        low = spool.lowest_unfinished()
        pending = self.assembler.lowest_seq()
        return low if pending is None else min(low, pending)

    def _joined_with_other_replicas(self, traces: list[AssembledTrace]) -> list[AssembledTrace]:
        """``traces`` with those another replica already stored spans of marked late, so each
        joins its stored spans like a late fragment (module docstring). On a failed look-up
        they are processed as they came (logged)."""
        assert self._stored_traces is not None
        fresh = [trace.trace_id for trace in traces if not trace.late]
        if not fresh:
            return traces
        try:
            known = self._stored_traces(fresh)
        except Exception:
            _log.warning("looking up which traces the shared store holds failed", exc_info=True)
            return traces
        if not known:
            return traces
        return [
            AssembledTrace(t.trace_id, t.spans, late=True) if t.trace_id in known else t
            for t in traces
        ]

    def _unstored_part(self, trace: AssembledTrace) -> AssembledTrace | None:
        """A replayed trace without the spans the store already holds: None when it holds them
        all (processed before the crash), a late fragment when it holds some."""
        self._replayed.discard(trace.trace_id)
        stored = self._look_up_earlier_spans(trace.trace_id)
        if not stored:
            return trace
        stored_ids = {ref.span.span_id for ref in stored}
        rest = [ref for ref in trace.spans if ref.span.span_id not in stored_ids]
        if not rest:
            self._replayed_stored.add()
            return None
        return AssembledTrace(trace.trace_id, rest, late=True)

    # --- processing ------------------------------------------------------------------------------
    def process_trace(self, trace: AssembledTrace) -> ProcessedTrace | None:
        """Derive the request records of one trace and enrich its request spans; a late
        fragment joins its trace's stored spans when they are found (module docstring). None
        when it holds only spans the store already has."""
        processed = self._derived(trace)
        if processed is not None:
            self._encode(processed)
        return processed

    def _derived(self, trace: AssembledTrace) -> ProcessedTrace | None:
        """``process_trace`` but for the request spans' enrichment and the encoding, which
        ``_encode`` does (``ProcessedTrace.encoded``)."""
        unique = unique_spans(trace.spans)
        if len(unique) < len(trace.spans):  # both copies of a retried export met in assembly
            self._duplicate_spans.add(len(trace.spans) - len(unique))
            trace = AssembledTrace(trace.trace_id, unique, late=trace.late)
        if trace.late:
            earlier_spans = self._look_up_earlier_spans(trace.trace_id)
            if earlier_spans:
                self._late_rederived.add()
                return self._rederive(trace, earlier_spans)
            self._late_unmatched.add()
        records: list[RequestRecord] = []
        try:
            timelines = normalize(trace)
            if trace.late:
                # A client span that came after its server spans were finished would pose as a
                # second, client-only request; its spans still go to the exporters.
                timelines = [t for t in timelines if t.dialect != DIALECT_GENAI_CLIENT]
        except Exception:  # a dialect bug must not lose the trace: pass it through unenriched
            self._processor_errors.add(_NORMALIZE)
            _log.exception("normalising trace %s failed", trace.trace_id.hex())
            return ProcessedTrace(trace, records, encode_trace_request(trace.spans))
        for timeline in timelines:
            record = self._budgeted(trace, timeline)
            if record is None:
                continue
            for name, processor in self._processors:
                self._guarded(name, processor.process, record)
            records.append(record)
        return ProcessedTrace(trace, records, encoded=False)

    def _encode(self, processed: ProcessedTrace) -> None:
        """Enrich the request spans of a trace ``_derived`` left unencoded, and encode it."""
        if processed.encoded:
            return
        spans = processed.trace.spans
        appended = self._enrichment(spans, processed.records)
        processed.otlp = encode_trace_request(spans, appended=appended)
        processed.encoded = True

    def _budgeted(self, trace: AssembledTrace, timeline: RequestTimeline) -> RequestRecord | None:
        try:
            return request_record(timeline, itl_outlier_ratio=self._itl_outlier_ratio)
        except Exception:
            self._processor_errors.add(_BUDGET)
            _log.exception("budget of trace %s failed", trace.trace_id.hex())
            return None

    def _enrichment(
        self, spans: Sequence[SpanRef], records: Sequence[RequestRecord]
    ) -> dict[bytes, bytes]:
        """Each request span's enrichment as attribute bytes for the encoder to append
        (``enrichment_attributes``), the span's earlier enrichment removed first."""
        if not records:
            return {}
        by_span_id = {record.timeline.span_id: record for record in records}
        appended: dict[bytes, bytes] = {}
        for ref in spans:
            span_id = ref.span.span_id
            record_or_none = by_span_id.get(span_id)
            if record_or_none is not None:
                try:
                    appended[span_id] = enrichment_attributes(record_or_none)
                    remove_received_enrichment(ref)
                except Exception:
                    appended.pop(span_id, None)
                    self._processor_errors.add(_ENRICH)
        return appended

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

    def _rederive(
        self, fragment: AssembledTrace, earlier_spans: list[SpanRef]
    ) -> ProcessedTrace | None:
        """The records of a late fragment's whole trace (its stored spans, then the fragment's),
        replacing the stored ones; only the fragment's spans the store does not hold yet are
        enriched and encoded (a sender's retry of an export whose OK it never got brings spans
        the store has: they are not appended twice). None when it brings nothing new."""
        trace_id = fragment.trace_id
        stored_ids = {ref.span.span_id for ref in earlier_spans}
        new_spans = [ref for ref in fragment.spans if ref.span.span_id not in stored_ids]
        if not new_spans:
            self._duplicate_spans.add(len(fragment.spans))
            return None
        if len(new_spans) < len(fragment.spans):
            self._duplicate_spans.add(len(fragment.spans) - len(new_spans))
            fragment = AssembledTrace(trace_id, new_spans, late=True)
        whole = AssembledTrace(trace_id, unique_spans([*earlier_spans, *fragment.spans]))
        try:
            earlier_timelines = normalize(AssembledTrace(trace_id, earlier_spans))
            timelines = normalize(whole)
        except Exception:  # as in process_trace: the stored records stay as they are
            self._processor_errors.add(_NORMALIZE)
            _log.exception("normalising trace %s failed", trace_id.hex())
            return ProcessedTrace(fragment, [], encode_trace_request(fragment.spans))
        # What the earlier derivation measured, by request span id.
        recorded: dict[bytes, RequestMetrics] = {}
        for timeline in earlier_timelines:
            with suppress(Exception):  # counted when the earlier part was processed
                recorded[timeline.span_id] = request_record(timeline).metrics
        records: list[RequestRecord] = []
        for timeline in timelines:
            record = self._budgeted(whole, timeline)
            if record is None:
                continue
            earlier = recorded.get(timeline.span_id)
            for name, processor in self._processors:
                self._guarded(name, partial(processor.reprocess, recorded=earlier), record)
            records.append(record)
        appended = self._enrichment(fragment.spans, records)
        return ProcessedTrace(
            fragment,
            records,
            encode_trace_request(fragment.spans, appended=appended),
            replaces_stored=[timeline.span_id for timeline in earlier_timelines],
        )

    def _guarded(self, name: str, processor: RequestProcessor, record: RequestRecord) -> None:
        try:
            processor(record)
        except Exception:
            self._processor_errors.add(name)
            _log.debug("processor %s failed", name, exc_info=True)

    def process_once(self, *, flush_all: bool = False) -> int:
        """Process every finished trace and export the batch; returns the number of traces."""
        with self._process_lock:
            return self._process_finished(flush_all=flush_all)

    def _process_finished(self, *, flush_all: bool) -> int:
        if self._held:
            self._retry_held(force=flush_all)
            if self._held_traces >= _HELD_MAX_TRACES and not flush_all:
                return 0  # back-pressure: assembly fills, receivers refuse (module docstring)
        # Read before popping: every trace popped below holds no request below it.
        low_seq = self._lowest_needed_seq(self._spool) if self._spool is not None else None
        traces = self.assembler.pop_finished(
            flush_all=flush_all, max_traces=None if flush_all else self._batch_traces
        )
        if not traces:
            return 0
        started = self._monotonic()
        if self._replayed:
            unstored = (
                self._unstored_part(t) if t.trace_id in self._replayed else t for t in traces
            )
            traces = [trace for trace in unstored if trace is not None]
        if self._stored_traces is not None:
            traces = self._joined_with_other_replicas(traces)
        # With tail sampling, only the traces kept are enriched and encoded (below).
        derive = self.process_trace if self._sampler is None else self._derived
        processed = (derive(trace) for trace in traces)
        batch = [item for item in processed if item is not None]
        self._traces.add(len(batch))
        # A re-derived trace's records replace stored ones: only the requests it adds count.
        self._requests.add(
            sum(max(0, len(item.records) - len(item.replaces_stored)) for item in batch)
        )
        if self._sampler is None:
            self._export_or_hold(batch, list(self._sinks), low_seq)
        else:
            # After every processor saw every request (sketches and SLO marks stay exact).
            kept = self._sampler.sample(batch)
            for item in kept:
                self._encode(item)
            self._export_or_hold(kept, self._sampled_sinks, low_seq)
            # These read the records only: the dropped traces are neither enriched nor encoded.
            self._export_or_hold(batch, self._unsampled_sinks, low_seq)
        # Every trace popped above is with the exporters now (the store committed it), held,
        # or dropped by tail sampling: done with, as an exported one.
        self.release_spool()
        elapsed = self._monotonic() - started
        self._batch_duration.record(elapsed)
        if not flush_all:
            self._size_next_batch(len(traces), elapsed)
        return len(batch)

    def _export_or_hold(
        self, batch: list[ProcessedTrace], sink_ids: Sequence[str], low_seq: int | None
    ) -> None:
        """Hand ``batch`` to ``sink_ids``; held for those that asked to get it again."""
        if not batch or not sink_ids:
            return
        refused = self._export(batch, sink_ids)
        if refused:
            now = self._monotonic()
            self._held.append(_HeldBatch(batch, refused, low_seq, now, now + _HELD_RETRY_INITIAL_S))
            self._held_traces += len(batch)

    def _size_next_batch(self, traces: int, elapsed_s: float) -> None:
        """As many traces as fit ``_BATCH_TIME_BUDGET_S`` at the cost just measured (halfway
        there from the current size, so one slow batch does not swing it)."""
        if elapsed_s <= 0:
            fitting = _MAX_BATCH_TRACES
        else:
            fitting = int(traces * _BATCH_TIME_BUDGET_S / elapsed_s)
        target = min(_MAX_BATCH_TRACES, max(_MIN_BATCH_TRACES, fitting))
        self._batch_traces = max(_MIN_BATCH_TRACES, (self._batch_traces + target) // 2)

    def _export(self, batch: list[ProcessedTrace], sink_ids: Sequence[str]) -> list[str]:
        """Hand ``batch`` to each of ``sink_ids``; returns those that asked to get it again."""
        refused: list[str] = []
        for sink_id in sink_ids:
            try:
                self._sinks[sink_id].export_traces(batch)
            except ExportRetryable as error:
                refused.append(sink_id)
                _log.warning(
                    "exporter %s could not take a batch of %d traces now; held for a retry: %s",
                    sink_id,
                    len(batch),
                    error,
                )
            except Exception:
                self._exporter_errors.add(sink_id)
                _log.exception("exporter %s failed on a batch of %d traces", sink_id, len(batch))
        return refused

    def _retry_held(self, *, force: bool = False) -> None:
        """Hand the held batches that are due (all with ``force``, at shutdown) to the
        exporters that refused them; oldest first, and the rest waits while one still fails."""
        now = self._monotonic()
        while self._held:
            held = self._held[0]
            if not force and now < held.next_attempt:
                return
            self._retried_batches.add()
            held.sink_ids = self._export(held.batch, held.sink_ids)
            now = self._monotonic()
            if held.sink_ids and now - held.first_failed < _HELD_RETRY_MAX_ELAPSED_S:
                held.interval_s = min(held.interval_s * 2, _HELD_RETRY_MAX_INTERVAL_S)
                held.next_attempt = now + held.interval_s
                return
            for sink_id in held.sink_ids:  # retried for too long: given up
                self._exporter_errors.add(sink_id)
                _log.error(
                    "exporter %s: gave up a batch of %d traces after %.0f s of retries",
                    sink_id,
                    len(held.batch),
                    now - held.first_failed,
                )
            self._held.pop(0)
            self._held_traces -= len(held.batch)

    def make_tick(self, *, final: bool = False) -> PipelineTick:
        """The tick the exporters get now; drains the percentile slices closed since the last."""
        slices: list[ClosedSlice] = []
        if self.percentiles is not None:
            slices = self.percentiles.drain_closed_slices() + self.percentiles.open_slice()
        now_ns = int(self._wall_clock() * _NS_PER_S)
        return PipelineTick(
            final=final,
            percentile_slices=slices,
            collector_stats=self.telemetry.snapshot(),
            otlp_metrics=partial(
                _otlp_metrics, self.percentiles, self.telemetry, self._start_ns, now_ns
            ),
        )

    def housekeeping(self, *, final: bool = False) -> None:
        """Hand every exporter a tick (``final`` once, when the pipeline has drained)."""
        with self._process_lock:
            self.release_spool()  # the active segment, once old enough and all processed
            tick = self.make_tick(final=final)
            for sink_id, sink in self._sinks.items():
                try:
                    sink.tick(tick)
                except Exception:
                    self._exporter_errors.add(sink_id)
                    _log.exception("the tick of exporter %s failed", sink_id)

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

    def shutdown(self, *, timeout_s: float = _DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
        """Stop the worker, finish every pending trace and hand the exporters the final tick
        (the collector shuts the exporters down after this)."""
        self._accepting = False
        self._stop.set()
        if self._worker is not None:
            self._worker.join(timeout_s)
        self.process_once(flush_all=True)
        self.housekeeping(final=True)
        if self._held:
            kept = "kept in the spool for the next start" if self._spool else "lost"
            _log.error(
                "%d traces an exporter could not take before shutdown (%s): %s",
                self._held_traces,
                kept,
                ", ".join(sorted({sink_id for held in self._held for sink_id in held.sink_ids})),
            )
        if self._spool is not None:
            with self._process_lock:
                self.release_spool(final=True)
            self._spool.close()
