"""Window findings: per SLO target (beyond the threshold, ties, causes that match the segment,
the counterfactual), per metric, and before/after comparison."""

from __future__ import annotations

from typing import Any

import pytest

from tests.processors.test_diagnosis import MS, S, make_record
from tests.processors.test_metric_budget import at, decoding
from tests.processors.test_window import exact_nearest_rank, replayed_records
from tokentrace.agent import semconv
from tokentrace.processors.budget import request_record
from tokentrace.processors.causes import (
    ADVICE,
    CAUSE_BATCHING_INTERFERENCE,
    CAUSE_LONG_DECODE,
    CAUSE_NETWORK,
    CAUSE_PREFILL,
    CAUSE_QUEUEING,
)
from tokentrace.processors.model import RequestRecord
from tokentrace.processors.slo import SloTarget
from tokentrace.processors.window.findings import (
    GROUP_BEYOND,
    GROUP_TAIL,
    compare_findings,
    finding_lines,
    metric_findings,
    target_findings,
)

TTFT = semconv.METRIC_TTFT
ITL = semconv.METRIC_ITL
E2E = semconv.METRIC_E2E


def target(
    metric: str, threshold_ms: float, *, name: str = "t", percentile: float = 95
) -> SloTarget:
    return SloTarget(
        name=name, metric=metric, percentile=percentile, threshold_ns=int(threshold_ms * MS)
    )


def queued(queue_ms: float, prefill_ms: float = 20, decode_ms: float = 2000) -> RequestRecord:
    """A request whose TTFT is queue + prefill and whose E2E is decode-bound."""
    return make_record(
        {
            semconv.SEGMENT_QUEUE: int(queue_ms * MS),
            semconv.SEGMENT_PREFILL: int(prefill_ms * MS),
            semconv.SEGMENT_DECODE: int(decode_ms * MS),
        },
        output_tokens=200,
        tpot=10 * MS,
        requests_ahead=int(queue_ms // 50),
        running_at_arrival=2,
        max_running=2,
    )


def window_with_queueing() -> list[RequestRecord]:
    """80 quick requests and 20 that queued 400-590 ms; E2E is decode for every one."""
    records = [queued(5 + i % 10) for i in range(80)]
    records += [queued(400 + 10 * i) for i in range(20)]
    return records


def test_a_breached_ttft_target_names_the_queue_not_decode() -> None:
    records = window_with_queueing()
    (finding,) = target_findings(records, [target(TTFT, 300)])
    assert finding["met"] is False
    assert finding["group"] == GROUP_BEYOND
    assert finding["units"] == 20  # only the requests beyond 300 ms
    assert finding["segment"] == semconv.SEGMENT_QUEUE
    assert finding["cause"] == CAUSE_QUEUEING
    assert finding["advice"] == ADVICE[CAUSE_QUEUEING]
    assert finding["clock"] == "server"
    # The facts are means over the breaching requests.
    assert finding["facts"]["requests_ahead"] == pytest.approx(
        sum(int((400 + 10 * i) // 50) for i in range(20)) / 20
    )


def test_the_counterfactual_recomputes_the_percentile_without_and_with_half() -> None:
    records = window_with_queueing()
    (finding,) = target_findings(records, [target(TTFT, 300)])
    ttft = [r.budget.ttft_ns or 0 for r in records]
    queue = [r.budget.ttft_segments[semconv.SEGMENT_QUEUE] for r in records]
    counterfactual = finding["counterfactual"]
    assert counterfactual["value_ms"] == exact_nearest_rank(ttft, 95) / MS
    assert (
        counterfactual["without_ms"]
        == exact_nearest_rank([t - q for t, q in zip(ttft, queue, strict=True)], 95) / MS
    )
    assert (
        counterfactual["halved_ms"]
        == exact_nearest_rank([t - q // 2 for t, q in zip(ttft, queue, strict=True)], 95) / MS
    )
    # p95 is 560 ms (queue 540 + prefill 20); without queue 20 ms; halved 290 ms.
    assert (counterfactual["value_ms"], counterfactual["without_ms"]) == (560, 20)
    assert counterfactual["halved_ms"] == 290
    assert counterfactual["met_without"] is True
    assert counterfactual["met_halved"] is True
    text = " ".join(finding_lines(finding))
    assert "p95 TTFT 560 ms -> 20.0 ms without queue wait (290 ms with it halved)" in text
    assert "halving it meets the target: fix queueing first" in text


def test_the_e2e_finding_of_the_same_window_may_say_decode() -> None:
    (finding,) = target_findings(window_with_queueing(), [target(E2E, 1000)])
    assert finding["segment"] == semconv.SEGMENT_DECODE
    assert finding["cause"] == CAUSE_LONG_DECODE


def test_breached_targets_come_first_then_met_then_undecided() -> None:
    records = window_with_queueing()
    targets = [
        target(E2E, 10_000, name="e2e-ok"),
        SloTarget(
            name="nobody",
            metric=TTFT,
            percentile=95,
            threshold_ns=MS,
            selector={"model": "no-such-model"},
        ),
        target(TTFT, 300, name="ttft-missed"),
    ]
    names = [finding["target"] for finding in target_findings(records, targets)]
    assert names == ["ttft-missed", "e2e-ok", "nobody"]


def test_a_met_target_is_explained_by_its_tail() -> None:
    records = window_with_queueing()
    (finding,) = target_findings(records, [target(TTFT, 5000)])
    assert finding["met"] is True
    assert finding["group"] == GROUP_TAIL
    value = exact_nearest_rank([r.budget.ttft_ns or 0 for r in records], 95)
    assert finding["units"] == sum(1 for r in records if (r.budget.ttft_ns or 0) >= value)
    assert "in its tail (>= p95)" in finding["sentence"]


def test_two_segments_within_ten_percent_are_both_named_larger_first() -> None:
    records = [queued(300, prefill_ms=290) for _ in range(10)]
    (finding,) = target_findings(records, [target(TTFT, 100)])
    assert finding["segment"] == semconv.SEGMENT_QUEUE
    assert finding["second_segment"] == semconv.SEGMENT_PREFILL
    assert "was queue wait (mean 300 ms) and 49% prefill (mean 290 ms)" in finding["sentence"]
    far = target_findings([queued(300, prefill_ms=250) for _ in range(10)], [target(TTFT, 100)])
    assert far[0]["second_segment"] is None


def test_the_cause_always_matches_the_segment() -> None:
    # Most requests are network-bound overall, but the E2E target's breaching ones are
    # decode-bound: the finding must not say "network (decode)".
    network = [
        make_record({semconv.SEGMENT_NETWORK: 900 * MS, semconv.SEGMENT_DECODE: 50 * MS})
        for _ in range(30)
    ]
    slow = [
        make_record({semconv.SEGMENT_NETWORK: 100 * MS, semconv.SEGMENT_DECODE: 3 * S})
        for _ in range(5)
    ]
    (finding,) = target_findings(network + slow, [target(E2E, 1000)])
    assert finding["segment"] == semconv.SEGMENT_DECODE
    assert finding["cause"] == CAUSE_LONG_DECODE


def test_a_segment_missing_everywhere_is_not_named_and_an_empty_window_has_none() -> None:
    records = [make_record({semconv.SEGMENT_PREFILL: 80 * MS}) for _ in range(5)]
    (finding,) = target_findings(records, [target(TTFT, 50)])
    assert finding["segment"] == semconv.SEGMENT_PREFILL
    assert finding["cause"] == CAUSE_PREFILL
    assert [entry["segment"] for entry in finding["segments"]] == [semconv.SEGMENT_PREFILL]
    (empty,) = target_findings([], [target(TTFT, 50)])
    assert empty["met"] is None and empty["population"] == 0
    assert metric_findings([]) == []


def itl_record(slow_gaps: int) -> RequestRecord:
    """100 gaps of 10 ms, then ``slow_gaps`` of 120 ms, each inside an engine step that also
    prefilled another request's prompt."""
    offsets = [10.0 * index for index in range(101)]
    steps = []
    for _ in range(slow_gaps):
        steps.append((at(offsets[-1]), at(offsets[-1] + 120), 512))
        offsets.append(offsets[-1] + 120)
    return request_record(decoding(offsets, engine_steps=steps))


def test_an_itl_target_judges_pooled_gaps_and_names_interference() -> None:
    records = [itl_record(3) for _ in range(5)] + [itl_record(0) for _ in range(5)]
    (finding,) = target_findings(records, [target(ITL, 50, percentile=99)])
    assert finding["units"] == 15  # the 120 ms gaps; units are gaps, not requests
    assert finding["requests"] == 5
    assert finding["segment"] == semconv.SEGMENT_INTERFERENCE
    assert finding["cause"] == CAUSE_BATCHING_INTERFERENCE
    assert finding["met"] is False
    counterfactual = finding["counterfactual"]
    assert counterfactual["value_ms"] == 120
    assert counterfactual["without_ms"] == 10
    assert counterfactual["met_without"] is True
    assert "15 gaps beyond 50.0 ms" in finding["sentence"]


def test_replayed_saturation_breaches_ttft_by_queueing() -> None:
    records = replayed_records("queue_saturation", requests=80, seed=3)
    (finding,) = target_findings(records, [target(TTFT, 200)])
    assert finding["met"] is False
    assert finding["segment"] == semconv.SEGMENT_QUEUE
    assert finding["cause"] == CAUSE_QUEUEING
    assert finding["counterfactual"]["without_ms"] < finding["counterfactual"]["value_ms"] / 2


def test_metric_findings_use_the_client_clock_when_every_request_has_it() -> None:
    records = [
        make_record({semconv.SEGMENT_NETWORK: 120 * MS, semconv.SEGMENT_DECODE: 50 * MS})
        for _ in range(10)
    ]
    e2e = [f for f in metric_findings(records) if f["metric"] == E2E]
    assert {f["clock"] for f in e2e} == {"client"}
    assert {f["cause"] for f in e2e} == {CAUSE_NETWORK}
    mixed = [*records, make_record({semconv.SEGMENT_DECODE: 50 * MS})]
    assert {f["clock"] for f in metric_findings(mixed) if f["metric"] == E2E} == {"server"}


def findings_of(records: list[RequestRecord]) -> list[dict[str, Any]]:
    return target_findings(records, [target(TTFT, 300, name="ttft")])


def test_compare_says_whether_the_dominant_segment_shrank() -> None:
    before = findings_of(window_with_queueing())
    after = findings_of([queued(5 + i % 10, prefill_ms=20) for i in range(100)])
    (row,) = compare_findings(before, after)
    assert row["target"] == "ttft"
    assert row["a_segment"] == semconv.SEGMENT_QUEUE
    assert row["direction"] == "shrank"
    assert row["a_mean_ms"] > row["b_mean_ms"]
    assert row["b_met"] is True
    assert "queue wait dominated before" in row["sentence"]
    assert "(shrank)" in row["sentence"]
    same = compare_findings(before, before)
    assert same[0]["direction"] == "same"
    only_before = compare_findings(before, [])
    assert only_before[0]["direction"] is None
    assert "not in the second window" in only_before[0]["sentence"]
