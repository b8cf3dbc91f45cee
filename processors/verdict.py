"""A request's verdict about one latency metric: the dominant segment, its cause, one sentence.

The method this serves: a target is a metric at a percentile, so a verdict answers about one
metric (``semconv.VERDICT_METRICS``: TTFT, TPOT, ITL, E2E), from that metric's own budget
(``budget.metric_budget``): decode time cannot delay a first token, so a TTFT verdict never names
it. The budget is the client-seen one when a client span came (what the user saw, network
included), else the server-seen one, and the sentence says which.

Per request and metric: the dominant segment is the largest of the metric's budget (ties go to
the segment earlier in time); a second segment within ``tie_ratio`` of it is named too, larger
first. Its cause, evidence and advice come from the rule table (``diagnosis.cause_of_segment``);
a request that ended with an error status is an ``error`` whatever that cause was. A server-seen
TTFT or E2E says that the network was not measured (no client span), rather than folding it into
another segment; an ITL verdict speaks of the request's slow gaps.

Separate from the rules because this is the per-request entry point the pipeline and the store
call: it picks the metric a request is judged by and writes the sentence every view leads with.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Final

from tokentrace.agent import semconv
from tokentrace.agent.finished_request import gap_median
from tokentrace.processors.budget import MetricBudget, metric_budget
from tokentrace.processors.causes import ADVICE, CAUSE_ERROR
from tokentrace.processors.decode_split import decode_facts_of
from tokentrace.processors.diagnosis import (
    DiagnosisConfig,
    cause_of_segment,
    ranked_segments,
    second_segment,
)
from tokentrace.processors.durations import ms_of
from tokentrace.processors.model import RequestRecord, Verdict
from tokentrace.processors.wording import format_duration, format_share, plural, segment_label

_MAX_ERROR_CHARS: Final = 160
"""Error descriptions are cut to this length so that the verdict stays one line."""
_NETWORK_METRICS: Final = frozenset({semconv.METRIC_TTFT, semconv.METRIC_E2E})
"""Metrics whose client-seen value holds the network: a server-seen one says it lacks it."""

_DEFAULT_CONFIG: Final = DiagnosisConfig()


def diagnose_request(
    record: RequestRecord,
    config: DiagnosisConfig = _DEFAULT_CONFIG,
    *,
    metric: str = semconv.METRIC_E2E,
    clock: str | None = None,
    seen_prefixes: Container[str] | None = None,
) -> Verdict | None:
    """The dominant segment of ``metric``'s budget for ``record`` (on ``clock``; None: the
    client's when a client span came), its cause, advice and the numbers used; None when the
    request has no value for the metric (no token for TTFT, fewer than two for TPOT...). E2E
    always has one.

    ``seen_prefixes``: prompt prefix hashes that earlier requests of the same window computed;
    a prefill-dominated request whose prefix is among them and that read no cached tokens
    recomputed a shared prefix (``prefix_cache_miss``).
    """
    view = metric_budget(record, metric, clock=clock)
    if view is None:
        return None
    return _verdict(record, view, config, seen_prefixes)


def default_verdict(
    record: RequestRecord,
    config: DiagnosisConfig = _DEFAULT_CONFIG,
    *,
    breached_metrics: Sequence[tuple[str, str]] = (),
    seen_prefixes: Container[str] | None = None,
) -> Verdict:
    """The verdict a request is judged by: about the metric of the first SLO target it
    breached (``breached_metrics``: (target name, metric) in configuration order) that it has a
    value for, else about E2E; ``why`` says which and why. The verdicts about its other metrics
    are for drill-down, asked for one at a time (``diagnose_request``)."""
    for target, metric in breached_metrics:
        chosen = diagnose_request(record, config, metric=metric, seen_prefixes=seen_prefixes)
        if chosen is not None:
            chosen.why = (
                f"{semconv.METRIC_LABELS[metric]} is the metric of SLO target {target}, "
                "which this request breached"
            )
            return chosen
    e2e = diagnose_request(record, config, seen_prefixes=seen_prefixes)
    assert e2e is not None  # every request has an E2E
    e2e.why = "no SLO target breached: end-to-end latency"
    return e2e


def _verdict(
    record: RequestRecord,
    view: MetricBudget,
    config: DiagnosisConfig,
    seen_prefixes: Container[str] | None,
) -> Verdict:
    timeline = record.timeline
    ranked = ranked_segments(view.segments)
    segment, segment_ns = ranked[0] if ranked else (semconv.SEGMENT_UNATTRIBUTED, 0)
    finding = cause_of_segment(record, view, segment, config, seen_prefixes=seen_prefixes)
    cited = finding.cited_segment
    cited_ns = view.segments.get(cited, 0)
    value = view.value_ns
    share = cited_ns / value if value > 0 else 0.0
    unmeasured = view.clock == semconv.CLOCK_SERVER and view.metric in _NETWORK_METRICS
    if view.metric == semconv.METRIC_ITL:
        sentence = _itl_head(record, config, share, cited, cited_ns)
    else:
        label = semconv.METRIC_LABELS.get(view.metric, view.metric)
        note = ", network not measured" if unmeasured else ""
        sentence = (
            f"{format_share(share)} of the {view.clock}-seen {label} "
            f"({format_duration(value)}{note}) was {segment_label(cited)} "
            f"({format_duration(cited_ns)})"
        )
    numbers: dict[str, float | int | str] = {
        "metric": view.metric,
        "clock": view.clock,
        "value_ms": ms_of(value),
        f"{cited}_ms": ms_of(cited_ns),
        "share": round(share, 4),
        f"without_{cited}_ms": ms_of(value - cited_ns),
    }
    runner_up = second_segment(ranked, config) if cited == segment else None
    if runner_up is not None:
        other, other_ns = runner_up
        sentence += (
            f" and {format_share(other_ns / value)} {segment_label(other)} "
            f"({format_duration(other_ns)})"
        )
        numbers["second_segment"] = other
        numbers[f"{other}_ms"] = ms_of(other_ns)
    if finding.detail:
        sentence = f"{sentence}: {finding.detail}"
    if unmeasured:
        numbers["network_measured"] = 0
    if segment != cited:
        numbers["dominant_segment"] = segment
        numbers[f"{segment}_ms"] = ms_of(segment_ns)
    numbers.update(finding.numbers)
    cause = finding.cause
    advice = finding.advice or ADVICE[cause]

    if timeline.status_error is not None:
        error = _one_line(timeline.status_error, _MAX_ERROR_CHARS) or "error status"
        sentence = f"Request failed ({error}) after {format_duration(value)}; {sentence}"
        numbers["error"] = error
        numbers["underlying_cause"] = cause
        cause = CAUSE_ERROR
        advice = ADVICE[CAUSE_ERROR]
    return Verdict(
        segment=segment,
        cause=cause,
        sentence=sentence,
        advice=advice,
        numbers=numbers,
        metric=view.metric,
        clock=view.clock,
    )


def _itl_head(
    record: RequestRecord, config: DiagnosisConfig, share: float, cited: str, cited_ns: int
) -> str:
    """An ITL verdict speaks of the request's slow gaps (or says there were none)."""
    gaps = record.metrics.itl
    median = gap_median(gaps)
    outliers = decode_facts_of(record).outlier_gaps
    over = (
        f"over {config.itl_outlier_ratio:g}x its median gap {format_duration(median)}"
        if median is not None
        else "outliers"
    )
    if not outliers:
        return (
            f"its {plural(len(gaps), 'inter-token gap')} were steady (largest "
            f"{format_duration(max(gaps, default=0))}, none {over})"
        )
    total = sum(part.gap_ns for part in outliers)
    return (
        f"{format_share(share)} of its {plural(len(outliers), 'slow inter-token gap')} "
        f"({format_duration(total)} in all, each {over}) was {segment_label(cited)} "
        f"({format_duration(cited_ns)})"
    )


def _one_line(text: str, limit: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."
