"""``processors.window.compare``: two window reports side by side."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokentrace.agent import semconv
from tokentrace.processors.slo import SELECTOR_KEYS
from tokentrace.processors.window.compare import (
    compare_metrics,
    compare_slo,
    compare_windows,
)


def key_entry(model: str, metrics: dict[str, dict[str, Any]], **fields: str) -> dict[str, Any]:
    return {
        "service": fields.get("service", "svc"),
        "model": model,
        "operation": fields.get("operation", "chat"),
        "prompt_bucket": fields.get("prompt_bucket", "0-127"),
        "requests": 0,
        "metrics": metrics,
        "slo": [],
    }


def summary(p50: float | None, p95: float | None, p99: float | None, count: int) -> dict[str, Any]:
    return {"p50": p50, "p95": p95, "p99": p99, "count": count}


def slo_entry(name: str, value_ms: float | None, met: bool | None) -> dict[str, Any]:
    return {
        "target": name,
        "metric": "ttft",
        "percentile": 95.0,
        "threshold_ms": 500.0,
        "selector": {},
        "requests": 10,
        "value_ms": value_ms,
        "met": met,
        "compliance": 0.9,
        "burn_rate": 2.0,
    }


def test_deltas_and_changes_of_a_key_in_both_windows() -> None:
    a = {"keys": [key_entry("llama", {"ttft": summary(100.0, 200.0, 400.0, 50)})], "slo": []}
    b = {"keys": [key_entry("llama", {"ttft": summary(150.0, 180.0, 400.0, 70)})], "slo": []}
    [row] = compare_metrics(a, b)
    assert {field: row[field] for field in SELECTOR_KEYS} == {
        "service": "svc",
        "model": "llama",
        "operation": "chat",
        "prompt_bucket": "0-127",
    }
    assert row["metric"] == "ttft"
    assert row["a"]["count"] == 50 and row["b"]["count"] == 70
    assert row["delta"] == {"p50": 50.0, "p95": -20.0, "p99": 0.0}
    assert row["change"] == {"p50": 0.5, "p95": -0.1, "p99": 0.0}


def test_a_key_or_metric_in_one_window_only_has_no_delta() -> None:
    a = {
        "keys": [
            key_entry("llama", {"ttft": summary(1.0, 2.0, 3.0, 5), "e2e": summary(9, 9, 9, 5)})
        ]
    }
    b = {
        "keys": [
            key_entry("qwen", {"ttft": summary(1.0, 2.0, 3.0, 5)}),
            key_entry("llama", {"ttft": summary(2.0, 2.0, 3.0, 5)}),
        ]
    }
    rows = compare_metrics(a, b)
    assert [(row["model"], row["metric"]) for row in rows] == [
        ("llama", "ttft"),
        ("llama", "e2e"),
        ("qwen", "ttft"),
    ]
    e2e, qwen = rows[1], rows[2]
    assert e2e["b"] is None and e2e["delta"] is None and e2e["change"] is None
    assert qwen["a"] is None and qwen["delta"] is None


def test_missing_quantiles_and_a_zero_baseline_give_none_not_errors() -> None:
    a = {"keys": [key_entry("m", {"queue": summary(0.0, None, 5.0, 3)})]}
    b = {"keys": [key_entry("m", {"queue": summary(2.0, 4.0, 5.0, 3)})]}
    [row] = compare_metrics(a, b)
    assert row["delta"] == {"p50": 2.0, "p95": None, "p99": 0.0}
    assert row["change"] == {"p50": None, "p95": None, "p99": 0.0}


def test_malformed_reports_compare_as_empty() -> None:
    assert compare_windows({}, {"keys": "nonsense", "slo": [3, None]}) == {
        "metrics": [],
        "slo": [],
    }


def test_slo_targets_side_by_side_by_name() -> None:
    a = {"slo": [slo_entry("ttft-p95", 450.0, True), slo_entry("gone", 1.0, True)]}
    b = {"slo": [slo_entry("new", 3.0, False), slo_entry("ttft-p95", 650.0, False)]}
    rows = compare_slo(a, b)
    assert [row["target"] for row in rows] == ["ttft-p95", "gone", "new"]
    assert rows[0]["a"]["met"] is True and rows[0]["b"]["met"] is False
    assert rows[0]["b"]["value_ms"] == 650.0
    assert rows[1]["b"] is None and rows[2]["a"] is None


# --- properties ---------------------------------------------------------------------------------

_MS = st.floats(min_value=0.001, max_value=1e6, allow_nan=False).map(lambda v: round(v, 3))
_SUMMARY = st.builds(summary, _MS, _MS, _MS, st.integers(min_value=1, max_value=10**6))
_METRICS = st.dictionaries(st.sampled_from(semconv.LATENCY_METRICS), _SUMMARY, max_size=4)
_REPORT = st.lists(
    st.tuples(st.sampled_from(["llama", "qwen", "mistral"]), _METRICS),
    max_size=3,
    unique_by=lambda item: item[0],
).map(lambda keys: {"keys": [key_entry(model, metrics) for model, metrics in keys], "slo": []})


def _by_key(rows: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(row["model"], row["metric"]): row for row in rows}


@settings(max_examples=80, deadline=None)
@given(_REPORT, _REPORT)
def test_every_key_and_metric_once_and_swapping_negates_the_deltas(
    a: dict[str, Any], b: dict[str, Any]
) -> None:
    forward = compare_metrics(a, b)
    backward = _by_key(compare_metrics(b, a))
    expected = {
        (entry["model"], metric)
        for report in (a, b)
        for entry in report["keys"]
        for metric in entry["metrics"]
    }
    assert len(forward) == len(expected)
    assert set(_by_key(forward)) == expected
    for row in forward:
        other = backward[(row["model"], row["metric"])]
        assert row["a"] == other["b"] and row["b"] == other["a"]
        if row["delta"] is None:
            assert other["delta"] is None
            continue
        for label, delta in row["delta"].items():
            assert delta == -other["delta"][label]
            assert delta == pytest.approx(row["b"][label] - row["a"][label], abs=1e-3)
            assert row["change"][label] == pytest.approx(
                row["b"][label] / row["a"][label] - 1, rel=1e-5, abs=1e-6
            )


@settings(max_examples=40, deadline=None)
@given(_REPORT)
def test_a_window_compared_with_itself_has_no_change(report: dict[str, Any]) -> None:
    for row in compare_metrics(report, report):
        assert row["delta"] is not None and row["change"] is not None
        assert set(row["delta"].values()) <= {0.0}
        assert set(row["change"].values()) <= {0.0}
