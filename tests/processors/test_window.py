"""``processors.window.analysis``: a window of request records analysed exactly.

Records come from the replay simulator's OTLP spans, normalised and budgeted the way the
collector re-derives a stored window; every expected number is computed here from the records'
own values with an independent nearest-rank (smallest value with at least p% of the values at
or below it, in integer arithmetic).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest

from tokentrace.agent import semconv
from tokentrace.loadgen.replay.emit import to_otlp_requests
from tokentrace.loadgen.replay.simulation import simulate
from tokentrace.processors.budget import request_record
from tokentrace.processors.causes import CAUSE_QUEUEING, CAUSES
from tokentrace.processors.model import AssembledTrace, RequestRecord, SpanRef
from tokentrace.processors.slo import SloTarget
from tokentrace.processors.timeline import normalize
from tokentrace.processors.window.analysis import (
    DEFAULT_PERCENTILES,
    analyze_window,
    slo_status,
    summarize_ns,
)

NS_PER_MS = 1_000_000
SHARE_DECIMALS = 4
"""``share`` is rounded to this many decimals: the tolerance of sums of shares."""


def replayed_records(scenario: str, *, requests: int, seed: int) -> list[RequestRecord]:
    """The request records of a simulated scenario's spans (timeline.normalize, then
    budget.request_record), grouped by trace as assembly would group them."""
    groups: dict[bytes, list[SpanRef]] = {}
    for message in to_otlp_requests(simulate(scenario, requests=requests, seed=seed)):
        for resource_spans in message.resource_spans:
            resource = resource_spans.resource
            service = next(
                attribute.value.string_value
                for attribute in resource.attributes
                if attribute.key == semconv.SERVICE_NAME
            )
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    ref = SpanRef(span, resource, scope_spans.scope, service)
                    groups.setdefault(span.trace_id, []).append(ref)
    return [
        request_record(timeline)
        for trace_id, refs in groups.items()
        for timeline in normalize(AssembledTrace(trace_id, refs))
    ]


@pytest.fixture(scope="module")
def mixed() -> list[RequestRecord]:
    return replayed_records("mixed", requests=120, seed=5)


@pytest.fixture(scope="module")
def saturated() -> list[RequestRecord]:
    return replayed_records("queue_saturation", requests=80, seed=3)


def exact_nearest_rank(values: Sequence[int], percent: float) -> int:
    """Smallest value with at least ``percent``% of the values at or below it."""
    ordered = sorted(values)
    # percent has at most one decimal here: compare count * 1000 >= percent * 10 * n exactly.
    tenths = round(percent * 10)
    for index, value in enumerate(ordered):
        if (index + 1) * 1000 >= tenths * len(ordered):
            return value
    return ordered[-1]


def ms(value_ns: int) -> float:
    """Whole µs, halves up, in ms: how every ``*_ms`` figure is rounded."""
    return (value_ns + 500) // 1000 / 1000


def metric_values(records: Sequence[RequestRecord], metric: str) -> list[int]:
    values: list[int] = []
    for record in records:
        metrics = record.metrics
        if metric == semconv.METRIC_ITL:
            values.extend(metrics.itl)
            continue
        value = getattr(metrics, metric)
        if value is not None:
            values.append(value)
    return values


def test_replayed_window_has_client_spans_and_every_metric(mixed: list[RequestRecord]) -> None:
    # Guards the fixture: the rest of the module relies on these.
    assert len(mixed) == 120
    assert all(record.timeline.client_start is not None for record in mixed)
    assert all(semconv.SEGMENT_NETWORK in record.budget.segments for record in mixed)


def test_count_and_metric_percentiles_are_nearest_rank_over_the_values(
    mixed: list[RequestRecord],
) -> None:
    window = analyze_window(mixed)
    assert window["requests"] == len(mixed)
    expected_metrics = [m for m in semconv.LATENCY_METRICS if metric_values(mixed, m)]
    assert list(window["metrics"]) == expected_metrics
    assert semconv.METRIC_ITL in expected_metrics and semconv.METRIC_NETWORK in expected_metrics
    for metric in expected_metrics:
        values = metric_values(mixed, metric)
        summary = window["metrics"][metric]
        assert summary["count"] == len(values), metric
        assert summary["mean"] == pytest.approx(ms(math.fsum(values) / len(values)), abs=1e-3)
        for percent in DEFAULT_PERCENTILES:
            assert summary[f"p{percent:g}"] == ms(exact_nearest_rank(values, percent)), (
                metric,
                percent,
            )
    # ITL is pooled over every gap, so it has many more values than there are requests.
    assert window["metrics"][semconv.METRIC_ITL]["count"] > len(mixed)


def test_custom_percentiles_are_reported_and_exact(mixed: list[RequestRecord]) -> None:
    window = analyze_window(mixed, percents=(10.0, 75.0))
    ttft = metric_values(mixed, semconv.METRIC_TTFT)
    summary = window["metrics"][semconv.METRIC_TTFT]
    assert {key for key in summary if key.startswith("p")} == {"p10", "p75"}
    assert summary["p10"] == ms(exact_nearest_rank(ttft, 10))
    assert summary["p75"] == ms(exact_nearest_rank(ttft, 75))


def test_segments_follow_budget_order_and_their_shares_sum_to_one(
    mixed: list[RequestRecord],
) -> None:
    window = analyze_window(mixed)
    segments = window["segments"]
    found = {name for record in mixed for name in record.budget.segments}
    assert list(segments) == [name for name in semconv.SEGMENTS if name in found]
    for name, summary in segments.items():
        values = [record.budget.segments[name] for record in mixed]
        assert summary["count"] == len(values)
        assert summary["p95"] == ms(exact_nearest_rank(values, 95))
        expected_share = math.fsum(
            record.budget.segments[name] / record.budget.e2e_ns for record in mixed
        ) / len(mixed)
        assert summary["share"] == pytest.approx(expected_share, abs=10**-SHARE_DECIMALS)
    total = math.fsum(summary["share"] for summary in segments.values())
    assert total == pytest.approx(1.0, abs=len(segments) * 0.5 * 10**-SHARE_DECIMALS + 1e-9)
    # The mixed scenario's median request is decode-bound: the biggest mean share is decode.
    assert max(segments, key=lambda name: segments[name]["share"]) == semconv.SEGMENT_DECODE


def test_metric_findings_name_a_known_cause_for_the_median_and_the_tail(
    mixed: list[RequestRecord],
) -> None:
    findings = analyze_window(mixed)["metric_findings"]
    assert [(f["metric"], f["group"]) for f in findings] == [
        (metric, group)
        for metric in (semconv.METRIC_TTFT, semconv.METRIC_TPOT, semconv.METRIC_E2E)
        for group in ("typical", "tail")
    ]
    for finding in findings:
        assert finding["cause"] in CAUSES
        assert finding["segment"] in {entry["segment"] for entry in finding["segments"]}
        assert finding["sentence"] and finding["advice"]
        assert finding["units"] >= 1
    # The replay's client spans cover every request: the findings are client-seen.
    assert {f["clock"] for f in findings if f["metric"] != semconv.METRIC_TPOT} == {"client"}
    tail = next(f for f in findings if f["metric"] == semconv.METRIC_E2E and f["group"] == "tail")
    # The tail group is the requests at or above the p95 E2E: at least 5% of the window.
    assert tail["units"] >= math.ceil(0.05 * len(mixed))


def test_saturated_batch_is_diagnosed_as_queueing(saturated: list[RequestRecord]) -> None:
    window = analyze_window(saturated)
    typical = next(
        f
        for f in window["metric_findings"]
        if f["metric"] == semconv.METRIC_TTFT and f["group"] == "typical"
    )
    assert typical["cause"] == CAUSE_QUEUEING
    assert typical["segment"] == semconv.SEGMENT_QUEUE
    # The verdict's segment is where the typical request's time went: queue beats prefill.
    segments = window["segments"]
    assert segments[semconv.SEGMENT_QUEUE]["p50"] > segments[semconv.SEGMENT_PREFILL]["p50"]


def test_a_healthy_window_is_not_called_queueing() -> None:
    steady = replayed_records("steady", requests=60, seed=3)
    causes = {finding["cause"] for finding in analyze_window(steady)["metric_findings"]}
    assert CAUSE_QUEUEING not in causes


def test_empty_window() -> None:
    target = SloTarget(name="t", metric=semconv.METRIC_TTFT, percentile=95, threshold_ns=1)
    window = analyze_window([], targets=[target])
    assert window["requests"] == 0
    assert window["metrics"] == {} and window["segments"] == {}
    assert window["metric_findings"] == []
    assert window["perceived"] == {"requests": 0, "issues": []}
    (finding,) = window["findings"]
    assert finding["met"] is None and finding["population"] == 0
    assert "no matching requests" in finding["sentence"]
    (entry,) = window["slo"]
    assert entry["requests"] == 0 and entry["met"] is None and entry["compliance"] is None


def test_summarize_ns_in_milliseconds_rounded_to_the_microsecond() -> None:
    assert summarize_ns([], DEFAULT_PERCENTILES) == {"count": 0}
    summary = summarize_ns([3_000_000, 1_234_567, 2_000_000], (50.0, 100.0))
    # Sorted: 1.234567, 2, 3 ms; p50 is rank ceil(1.5) = 2; mean 6.234567 / 3.
    assert summary == {"count": 3, "mean": 2.078, "p50": 2.0, "p100": 3.0}
    assert summarize_ns(iter([7]), (50.0,)) == {"count": 1, "mean": 0.0, "p50": 0.0}


# --- SLO status -----------------------------------------------------------------------------------
def test_slo_compliance_value_and_burn_rate(mixed: list[RequestRecord]) -> None:
    ttft = sorted(metric_values(mixed, semconv.METRIC_TTFT))
    threshold = ttft[len(ttft) // 2]  # about half the requests inside
    target = SloTarget(
        name="ttft-p90", metric=semconv.METRIC_TTFT, percentile=90, threshold_ns=threshold
    )
    (entry,) = slo_status(mixed, [target])
    inside = sum(1 for value in ttft if value <= threshold)
    compliance = inside / len(ttft)
    assert 0.3 < compliance < 0.7
    assert entry["target"] == "ttft-p90" and entry["metric"] == semconv.METRIC_TTFT
    assert entry["requests"] == len(ttft)
    assert entry["compliance"] == pytest.approx(compliance, abs=1e-4)
    value_ns = exact_nearest_rank(ttft, 90)
    assert entry["value_ms"] == ms(value_ns)
    assert value_ns > threshold  # p90 above the median threshold
    assert entry["met"] is False
    assert entry["burn_rate"] == pytest.approx((1 - compliance) / (1 - 0.90), abs=1e-3)
    assert entry["threshold_ms"] == ms(threshold)


def test_slo_compliance_is_the_share_of_requests_marked_inside(
    mixed: list[RequestRecord],
) -> None:
    # Selector on operation: the mixed scenario sends some text completions; only chat counts.
    chat = [r for r in mixed if r.timeline.operation == semconv.OPERATION_CHAT]
    assert 0 < len(chat) < len(mixed)
    e2e_chat = sorted(r.metrics.e2e for r in chat)
    threshold = e2e_chat[len(e2e_chat) * 3 // 4]
    target = SloTarget(
        name="chat-e2e",
        metric=semconv.METRIC_E2E,
        percentile=95,
        threshold_ns=threshold,
        selector={"operation": semconv.OPERATION_CHAT},
    )
    (entry,) = slo_status(mixed, [target])
    inside = sum(1 for value in e2e_chat if value <= threshold)
    assert entry["requests"] == len(chat)
    assert entry["compliance"] == pytest.approx(inside / len(chat), abs=1e-4)
    assert entry["value_ms"] == ms(exact_nearest_rank(e2e_chat, 95))
    assert entry["selector"] == {"operation": semconv.OPERATION_CHAT}


def test_itl_target_pools_gaps_for_the_value_and_judges_each_request_by_its_own_gap(
    mixed: list[RequestRecord],
) -> None:
    with_gaps = [r for r in mixed if r.metrics.itl]
    own_p99 = [exact_nearest_rank(r.metrics.itl, 99) for r in with_gaps]
    threshold = sorted(own_p99)[len(own_p99) // 2]
    target = SloTarget(
        name="itl-p99", metric=semconv.METRIC_ITL, percentile=99, threshold_ns=threshold
    )
    (entry,) = slo_status(mixed, [target])
    assert entry["requests"] == len(with_gaps)
    inside = sum(1 for value in own_p99 if value <= threshold)
    assert entry["compliance"] == pytest.approx(inside / len(with_gaps), abs=1e-4)
    pooled = metric_values(mixed, semconv.METRIC_ITL)
    assert entry["value_ms"] == ms(exact_nearest_rank(pooled, 99))


@pytest.mark.parametrize(
    ("threshold_ns", "met", "compliance", "burn_rate"),
    [
        (3_600 * 10**9, True, 1.0, 0.0),  # an hour: everything inside, no budget burnt
        (1, False, 0.0, 20.0),  # 1 ns: nothing inside, 100% bad / 5% allowed
    ],
)
def test_slo_extremes(
    mixed: list[RequestRecord], threshold_ns: int, met: bool, compliance: float, burn_rate: float
) -> None:
    target = SloTarget(
        name="e2e-p95", metric=semconv.METRIC_E2E, percentile=95, threshold_ns=threshold_ns
    )
    (entry,) = slo_status(mixed, [target])
    assert entry["met"] is met
    assert entry["compliance"] == compliance
    assert entry["burn_rate"] == pytest.approx(burn_rate)


def test_target_whose_selector_matches_nothing_is_not_judged(mixed: list[RequestRecord]) -> None:
    nothing = SloTarget(
        name="other-model",
        metric=semconv.METRIC_TTFT,
        percentile=95,
        threshold_ns=500 * NS_PER_MS,
        selector={"model": "no-such-model"},
    )
    everything = SloTarget(
        name="all", metric=semconv.METRIC_TTFT, percentile=95, threshold_ns=500 * NS_PER_MS
    )
    entries = slo_status(mixed, [nothing, everything])
    assert [entry["target"] for entry in entries] == ["other-model", "all"]
    assert entries[0]["requests"] == 0
    for key in ("met", "value_ms", "compliance", "burn_rate"):
        assert entries[0][key] is None, key
    assert entries[1]["requests"] == len(mixed) and entries[1]["met"] is not None


def test_analyze_window_carries_the_slo_status(mixed: list[RequestRecord]) -> None:
    target = SloTarget(
        name="tpot-p99", metric=semconv.METRIC_TPOT, percentile=99, threshold_ns=40 * NS_PER_MS
    )
    window = analyze_window(mixed, targets=[target])
    assert window["slo"] == slo_status(mixed, [target])
