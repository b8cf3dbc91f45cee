"""SLO targets: validation, per-request marks, window status, configuration parsing and the
store's copy."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokentrace.agent import semconv
from tokentrace.processors import slo as slo_module
from tokentrace.processors.durations import parse_duration_ns
from tokentrace.processors.model import Budget, RequestMetrics, RequestRecord, RequestTimeline
from tokentrace.processors.sketches import LatencySketch
from tokentrace.processors.slo import (
    SELECTOR_KEYS,
    SloTarget,
    evaluate_window,
    mark_request,
    parse_targets,
    request_value,
    targets_from_json,
    targets_to_json,
)

MS = 1_000_000
S = 1_000_000_000


def make_record(
    *,
    ttft: int | None = 400 * MS,
    tpot: int | None = 20 * MS,
    e2e: int = 2 * S,
    itl: list[int] | None = None,
    service: str = "vllm-chat",
    model: str = "llama-3-8b-instruct",
    operation: str = semconv.OPERATION_CHAT,
    prompt_bucket: str = "128-511",
) -> RequestRecord:
    timeline = RequestTimeline(
        trace_id=b"\x01" * 16,
        span_id=b"\x02" * 8,
        dialect="tokentrace",
        service=service,
        model=model,
        operation=operation,
    )
    budget = Budget(e2e_ns=e2e, segments={"decode": e2e}, ttft_ns=ttft, ttft_segments={})
    metrics = RequestMetrics(
        ttft=ttft,
        tpot=tpot,
        e2e=e2e,
        queue=None,
        prefill=None,
        decode=None,
        network=None,
        itl=list(itl or []),
    )
    return RequestRecord(
        timeline=timeline, budget=budget, metrics=metrics, prompt_bucket=prompt_bucket
    )


def target(**overrides: Any) -> SloTarget:
    fields: dict[str, Any] = {
        "name": "chat-ttft-p95",
        "metric": semconv.METRIC_TTFT,
        "percentile": 95.0,
        "threshold_ns": 500 * MS,
    }
    fields.update(overrides)
    return SloTarget(**fields)


# --- target validation ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"selector": {"region": "eu"}}, "selector: unknown key 'region'"),
        ({"metric": "latency"}, "metric: unknown metric 'latency'"),
        ({"percentile": 0}, "percentile"),
        ({"percentile": 100}, "percentile"),
        ({"percentile": -5}, "percentile"),
        ({"percentile": math.nan}, "percentile"),
        ({"threshold_ns": 0}, "threshold"),
        ({"threshold_ns": -1}, "threshold"),
        ({"threshold_ns": 0.5}, "threshold"),
        ({"name": ""}, "name"),
        ({"selector": {"model": 3}}, "selector.model"),
    ],
)
def test_invalid_targets_are_rejected(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        target(**overrides)


def test_unknown_selector_key_message_lists_allowed_keys() -> None:
    with pytest.raises(ValueError) as raised:
        target(selector={"service": "a", "gpu": "h100"})
    for key in SELECTOR_KEYS:
        assert key in str(raised.value)


def test_target_keeps_its_own_copy_of_the_selector() -> None:
    selector = {"model": "llama-*"}
    slo = target(selector=selector)
    selector["model"] = "mistral-*"
    assert slo.selector["model"] == "llama-*"
    assert mark_request(make_record(model="llama-3"), [slo]) == {slo.name: True}


def test_targets_are_hashable_and_comparable() -> None:
    assert target(selector={"model": "a"}) == target(selector={"model": "a"})
    assert target(selector={"model": "a"}) != target(selector={"model": "b"})
    assert len({target(), target()}) == 1


# --- per request ----------------------------------------------------------------------------------
def test_met_is_value_at_or_below_threshold() -> None:
    at = make_record(ttft=500 * MS)
    above = make_record(ttft=500 * MS + 1)
    slo = target()
    assert mark_request(at, [slo]) == {slo.name: True}
    assert mark_request(above, [slo]) == {slo.name: False}


@pytest.mark.parametrize(
    ("selector", "applies"),
    [
        ({}, True),
        ({"service": "vllm-chat"}, True),
        ({"service": "vllm-*"}, True),
        ({"service": "vllm"}, False),
        ({"model": "llama-3-*", "operation": "chat"}, True),
        ({"model": "llama-3-*", "operation": "text_completion"}, False),
        ({"prompt_bucket": "128-511"}, True),
        ({"prompt_bucket": "512-*"}, False),
        ({"model": "LLAMA-*"}, False),  # case-sensitive, whatever the platform
    ],
)
def test_selector_decides_whether_a_target_applies(selector: dict[str, str], applies: bool) -> None:
    slo = target(selector=selector)
    record = make_record()
    marks = mark_request(record, [slo])
    assert (slo.name in marks) is applies
    # The stored percentile keys (``top``) are selected by the same rule.
    key = {
        "service": record.timeline.service,
        "model": record.timeline.model,
        "operation": record.timeline.operation,
        "prompt_bucket": record.prompt_bucket,
    }
    assert slo.matches_key(key) is applies


def test_a_key_without_the_selected_field_is_not_selected() -> None:
    slo = target(selector={"model": "*"})
    assert slo.matches_key({"model": "any"})
    assert not slo.matches_key({"service": "vllm-chat"})
    assert target(selector={}).matches_key({})


def test_targets_without_a_value_are_left_out() -> None:
    record = make_record(tpot=None, itl=[])
    tpot = target(name="tpot", metric=semconv.METRIC_TPOT, threshold_ns=50 * MS)
    itl = target(name="itl", metric=semconv.METRIC_ITL, threshold_ns=50 * MS)
    e2e = target(name="e2e", metric=semconv.METRIC_E2E, threshold_ns=1 * S)
    assert mark_request(record, [tpot, itl, e2e]) == {"e2e": False}


def test_itl_uses_the_requests_own_gap_at_the_percentile() -> None:
    # 100 gaps: 98 of 10 ms, then 50 ms and 500 ms. Nearest-rank p99 is the 99th: 50 ms.
    gaps = [10 * MS] * 98 + [500 * MS, 50 * MS]
    record = make_record(itl=gaps)
    p99 = target(name="p99", metric=semconv.METRIC_ITL, percentile=99, threshold_ns=100 * MS)
    p99_9 = target(name="p99.9", metric=semconv.METRIC_ITL, percentile=99.9, threshold_ns=100 * MS)
    p50 = target(name="p50", metric=semconv.METRIC_ITL, percentile=50, threshold_ns=9 * MS)
    # The max gap (500 ms) would breach p99; the request's own p99 gap does not.
    assert mark_request(record, [p99, p99_9, p50]) == {"p99": True, "p99.9": False, "p50": False}
    assert request_value(record.metrics, semconv.METRIC_ITL, 99) == 50 * MS
    assert request_value(record.metrics, semconv.METRIC_ITL, 99.9) == 500 * MS
    assert request_value(record.metrics, semconv.METRIC_TTFT, 99) == record.metrics.ttft
    assert request_value(make_record(itl=[]).metrics, semconv.METRIC_ITL, 99) is None


def test_many_targets_mark_independently() -> None:
    record = make_record(ttft=300 * MS, tpot=60 * MS)
    targets = [
        target(name="ttft", threshold_ns=500 * MS),
        target(name="tpot", metric=semconv.METRIC_TPOT, threshold_ns=50 * MS),
        target(name="other-model", selector={"model": "mistral*"}),
    ]
    assert mark_request(record, targets) == {"ttft": True, "tpot": False}


# --- windows --------------------------------------------------------------------------------------
def _window(values_s: list[float]) -> LatencySketch:
    sketch = LatencySketch()
    sketch.add_many(values_s)
    return sketch


def test_window_breaching_its_target() -> None:
    # 90 requests at 100 ms and 10 at 1 s: p95 is ~1 s, 90% inside 500 ms.
    sketch = _window([0.1] * 90 + [1.0] * 10)
    status = evaluate_window(target(percentile=95, threshold_ns=500 * MS), sketch)
    assert status.target == "chat-ttft-p95"
    assert status.requests == 100
    assert status.value_ns == pytest.approx(1 * S, rel=0.01)
    assert status.met is False
    assert status.compliance == pytest.approx(0.9)
    assert status.burn_rate == pytest.approx(0.1 / 0.05)


def test_window_inside_its_target() -> None:
    sketch = _window([0.1] * 90 + [1.0] * 10)
    status = evaluate_window(target(percentile=50, threshold_ns=500 * MS), sketch)
    assert status.value_ns == pytest.approx(100 * MS, rel=0.01)
    assert status.met is True
    assert status.compliance == pytest.approx(0.9)
    assert status.burn_rate == pytest.approx(0.1 / 0.5)


def test_window_fully_compliant_burns_nothing() -> None:
    status = evaluate_window(target(), _window([0.05, 0.06, 0.07]))
    assert status.compliance == pytest.approx(1.0)
    assert status.burn_rate == pytest.approx(0.0)
    assert status.met is True


def test_empty_window_has_no_verdict() -> None:
    status = evaluate_window(target(), LatencySketch())
    assert status.requests == 0
    assert status.value_ns is None
    assert status.met is None
    assert status.compliance is None
    assert status.burn_rate is None


# --- configuration --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("raw", "ns"),
    [
        ("500ms", 500 * MS),
        ("2s", 2 * S),
        ("1.5m", 90 * S),
        ("2min", 120 * S),
        ("1.5MIN", 90 * S),
        ("7d", 7 * 86400 * S),
        ("750us", 750_000),
        ("750µs", 750_000),
        ("100ns", 100),
        ("1h", 3600 * S),
        (" 250 ms ", 250 * MS),
        ("0.1", 100 * MS),
        ("3", 3 * S),
        (0.5, 500 * MS),
        (0.1, 100 * MS),
        (2, 2 * S),
        ("1e-3s", 1 * MS),
        ("0", 0),
    ],
)
def test_parse_duration(raw: object, ns: int) -> None:
    assert parse_duration_ns(raw) == ns


@pytest.mark.parametrize(
    "raw", ["fast", "-1s", "", "5 parsecs", "1.2.3s", "ms", None, True, math.nan, math.inf, -0.5]
)
def test_parse_duration_rejects(raw: object) -> None:
    with pytest.raises(ValueError):
        parse_duration_ns(raw)


def test_slo_module_reexports_the_one_duration_parser() -> None:
    assert slo_module.parse_duration_ns is parse_duration_ns


def test_parse_targets_from_config() -> None:
    targets = parse_targets(
        [
            {
                "name": "chat-ttft",
                "metric": "ttft",
                "percentile": 95,
                "threshold": "500ms",
                "selector": {"operation": "chat", "model": "llama-*"},
            },
            {"name": "tpot", "metric": "tpot", "percentile": "p99", "threshold": 0.05},
        ]
    )
    assert [t.name for t in targets] == ["chat-ttft", "tpot"]
    assert targets[0].threshold_ns == 500 * MS
    assert targets[0].percentile == 95
    assert dict(targets[0].selector) == {"operation": "chat", "model": "llama-*"}
    assert targets[1].threshold_ns == 50 * MS
    assert targets[1].percentile == 99
    assert dict(targets[1].selector) == {}


_GOOD = {"name": "a", "metric": "ttft", "percentile": 95, "threshold": "1s"}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([_GOOD, {**_GOOD, "name": "b", "threshold": "soon"}], r"slo\.targets\[1\]\.threshold: "),
        ([{**_GOOD, "threshold": "0ms"}], r"slo\.targets\[0\]\.threshold: "),
        ([{**_GOOD, "percentile": "high"}], r"slo\.targets\[0\]\.percentile: "),
        ([{**_GOOD, "percentile": 100}], r"slo\.targets\[0\]\.percentile: "),
        ([{**_GOOD, "metric": "tps"}], r"slo\.targets\[0\]\.metric: "),
        ([{**_GOOD, "selector": {"zone": "a"}}], r"slo\.targets\[0\]\.selector: unknown key"),
        ([{**_GOOD, "selector": ["model"]}], r"slo\.targets\[0\]\.selector: "),
        ([{**_GOOD, "threshhold": "1s"}], r"slo\.targets\[0\]\.threshhold: unknown field"),
        (
            [{k: v for k, v in _GOOD.items() if k != "metric"}],
            r"slo\.targets\[0\]\.metric: missing",
        ),
        ([_GOOD, _GOOD], r"slo\.targets\[1\]\.name: duplicate .*slo\.targets\[0\]"),
        (["ttft<500ms"], r"slo\.targets\[0\]: expected a mapping"),
        ({"a": _GOOD}, r"slo\.targets: expected a list"),
    ],
)
def test_parse_targets_errors_name_index_and_field(raw: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_targets(raw)


def test_parse_targets_accepts_nothing() -> None:
    assert parse_targets(None) == []
    assert parse_targets([]) == []


# --- the store's copy ----------------------------------------------------------------------------
# Exactly what the collector's store sink wrote before targets_to_json moved here: stores written
# by that collector must keep loading.
_STORED_BY_AN_EARLIER_COLLECTOR = (
    '[{"name": "chat-ttft", "metric": "ttft", "percentile": 95.0, "threshold": "500000000ns", '
    '"selector": {"operation": "chat", "model": "llama-*"}}, '
    '{"name": "itl-p99", "metric": "itl", "percentile": 99.9, "threshold": "25000000ns", '
    '"selector": {}}]'
)


def test_targets_stored_by_an_earlier_collector_still_load() -> None:
    targets, problems = targets_from_json(_STORED_BY_AN_EARLIER_COLLECTOR)
    assert problems == []
    assert targets == [
        target(name="chat-ttft", selector={"operation": "chat", "model": "llama-*"}),
        target(name="itl-p99", metric=semconv.METRIC_ITL, percentile=99.9, threshold_ns=25 * MS),
    ]
    assert targets_to_json(targets) == _STORED_BY_AN_EARLIER_COLLECTOR


_NAMES = st.text(min_size=1, max_size=12).filter(str.strip)
_TARGETS = st.builds(
    SloTarget,
    name=_NAMES,
    metric=st.sampled_from(semconv.LATENCY_METRICS),
    percentile=st.one_of(
        st.integers(min_value=1, max_value=99),
        st.floats(min_value=0.001, max_value=99.999, allow_nan=False),
    ),
    threshold_ns=st.integers(min_value=1, max_value=10**15),
    selector=st.dictionaries(
        st.sampled_from(SELECTOR_KEYS), st.text(max_size=8) | st.just("llama-*"), max_size=4
    ),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_TARGETS, max_size=5))
def test_stored_targets_read_back_as_written(targets: list[SloTarget]) -> None:
    assert targets_from_json(targets_to_json(targets)) == (targets, [])


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("{not json", r"^the store's SLO targets are not JSON .*none are evaluated$"),
        ('{"name": "x"}', r"^the store's SLO targets are a dict, not a list$"),
    ],
)
def test_unreadable_stored_targets_give_one_problem(text: str, problem: str) -> None:
    targets, problems = targets_from_json(text)
    assert targets == []
    assert len(problems) == 1 and re.match(problem, problems[0])


def test_a_bad_stored_target_is_named_and_the_others_kept() -> None:
    good = {"name": "a", "metric": "ttft", "percentile": 95, "threshold": "1s"}
    targets, problems = targets_from_json(
        json.dumps([7, {**good, "metric": "nope"}, good, {"name": "b"}])
    )
    assert [t.name for t in targets] == ["a"]
    assert problems == [
        "the store's SLO targets[0]: expected a mapping, got int",
        "the store's SLO targets[1].metric: unknown metric 'nope' "
        f"(one of {', '.join(semconv.LATENCY_METRICS)})",
        "the store's SLO targets[3].metric: missing",
    ]
    assert targets_from_json(None) == ([], [])
    assert targets_from_json("") == ([], [])
