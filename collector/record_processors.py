"""What the ``slo``, ``diagnosis`` and ``percentiles`` processors do to each derived request:
functions ``(record) -> None`` that the pipeline runs in the configured order, each wrapped by
its one ``_guarded`` helper (a processor failing on one request is counted, the request goes on).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from tokentrace.agent import semconv
from tokentrace.processors.diagnosis import DiagnosisConfig
from tokentrace.processors.model import RequestMetrics, RequestRecord
from tokentrace.processors.percentiles import PercentileStore
from tokentrace.processors.sketches import SketchKey
from tokentrace.processors.slo import SloTarget, mark_request
from tokentrace.processors.verdict import default_verdict

_SEEN_PREFIXES_CAP: Final = 50_000

RequestProcessor = Callable[[RequestRecord], None]
RederivedRequestProcessor = Callable[[RequestRecord, RequestMetrics | None], None]
"""A request derived again (a late span joined it), with what its earlier derivation measured
(None: it had no record of its own)."""


@dataclass(frozen=True, slots=True)
class RecordProcessor:
    """What a processor factory makes (all but ``assembly``, which makes the assembler)."""

    process: RequestProcessor
    rederive: RederivedRequestProcessor | None = None
    """For a re-derived request, where ``process`` again would not do (see ``reprocess``)."""
    percentile_store: PercentileStore | None = None
    """The ``percentiles`` processor's sketches: the pipeline hands their slices and histograms
    to the exporters on each tick."""

    def reprocess(self, record: RequestRecord, recorded: RequestMetrics | None) -> None:
        """A request derived again (a late span joined it), with what its earlier derivation
        measured: ``rederive`` it, or (without one) ``process`` it again."""
        if self.rederive is None:
            self.process(record)
        else:
            self.rederive(record, recorded)


def slo_processor(targets: Sequence[SloTarget]) -> RequestProcessor:
    marked = list(targets)

    def mark(record: RequestRecord) -> None:
        record.slo = mark_request(record, marked)

    return mark


def diagnosis_processor(config: DiagnosisConfig, targets: Sequence[SloTarget]) -> RequestProcessor:
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


def _sketch_key(record: RequestRecord) -> SketchKey:
    timeline = record.timeline
    return SketchKey(timeline.service, timeline.model, timeline.operation, record.prompt_bucket)


def percentiles_processor(store: PercentileStore) -> RecordProcessor:
    """Each request adds at most one value to each metric's sketch: a re-derived request whose
    earlier record measured a metric does not add it again (in practice it adds ``network``,
    when a late client span joined its server spans)."""

    def record_percentiles(record: RequestRecord) -> None:
        store.record(_sketch_key(record), record.metrics)

    def record_unrecorded(record: RequestRecord, recorded: RequestMetrics | None) -> None:
        skip: frozenset[str] = frozenset()
        if recorded is not None:
            skip = frozenset(m for m in semconv.LATENCY_METRICS if recorded.value(m) is not None)
        store.record(_sketch_key(record), record.metrics, skip=skip)

    return RecordProcessor(record_percentiles, record_unrecorded, store)
