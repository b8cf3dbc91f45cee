"""``/api/v1/window``, ``/slo``, ``/fleet`` and ``/compare`` against a real SQLite store.

Requests are made by the real pipeline (with an SLO target, so some breach it); the sketch
slices are built here from those requests' metrics, so every expected number is computed in
the test from what it wrote: ``window_report`` over the slices it selects itself, budget means
over the stored documents, histogram counts over the raw values.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.spanbuild import T0, request_spans, trace
from tokentrace.agent import semconv
from tokentrace.collector.api.app import ApiSettings, create_app
from tokentrace.collector.api.fleet import histogram_document
from tokentrace.collector.config import parse_config
from tokentrace.collector.pipeline import Pipeline
from tokentrace.collector.store import META_SLO_TARGETS, RequestStore, window_report
from tokentrace.collector.store.document import budget_segments
from tokentrace.collector.store.query import QueryTimeoutError
from tokentrace.collector.store.sketch_report import SketchSlice
from tokentrace.processors.sketches import LatencySketch
from tokentrace.processors.slo import SELECTOR_KEYS, parse_targets

NS_PER_S = 1_000_000_000
T0_S = T0 // NS_PER_S
NOW_S = T0_S + 1800.0
"""The app's clock: the default window (last hour) holds every request and current slice."""
REQUESTS = 40
SLICE_S = 10
E2E_TARGET = {"name": "e2e-p90", "metric": "e2e", "percentile": 90, "threshold": "180ms"}
MODELS = ("llama", "qwen")
A_WINDOW = (T0_S - 5.0, T0_S + 19.5)  # slices 0 and 10 s, requests 0..19
B_WINDOW = (T0_S + 19.5, T0_S + 45.0)  # slices 20 and 30 s, requests 20..39
METRICS = (semconv.METRIC_TTFT, semconv.METRIC_TPOT, semconv.METRIC_ITL, semconv.METRIC_E2E)


def _trace_id(number: int) -> bytes:
    return bytes.fromhex(f"{number + 1:08x}") + b"\x77" * 12


def _request_trace(number: int) -> Any:
    """Request ``number`` starts ``number`` s after T0; its queue grows with it, so E2E does."""
    spans = request_spans(
        start_ns=T0 + number * NS_PER_S,
        queue_ns=(number + 1) * 4_000_000,
        prefill_ns=20_000_000 + (number % 3) * 1_000_000,
        token_offsets_us=tuple(range(0, 30_001 + number * 100, 5_000 + number * 10)),
        trace_id=_trace_id(number),
        request_attrs={semconv.GEN_AI_REQUEST_MODEL: MODELS[number % 2]},
    )
    return trace(*spans)


def _key_of(record: Any) -> tuple[str, str, str, str]:
    timeline = record.timeline
    return (timeline.service, timeline.model, timeline.operation, record.prompt_bucket)


def _slices_of(records: list[Any]) -> list[SketchSlice]:
    """One sketch per (10 s slice, key, metric) of the records' own metrics."""
    sketches: dict[tuple[int, tuple[str, str, str, str], str], LatencySketch] = {}
    for record in records:
        start_s = record.timeline.server_start // NS_PER_S
        slice_start = start_s - (start_s - T0_S) % SLICE_S
        metrics = record.metrics
        values = {
            semconv.METRIC_TTFT: [metrics.ttft],
            semconv.METRIC_TPOT: [metrics.tpot],
            semconv.METRIC_E2E: [metrics.e2e],
            semconv.METRIC_QUEUE: [metrics.queue],
            semconv.METRIC_ITL: list(metrics.itl),
        }
        for metric, ns_values in values.items():
            sketch = sketches.setdefault((slice_start, _key_of(record), metric), LatencySketch())
            for value in ns_values:
                if value is not None:
                    sketch.add(value / NS_PER_S)
    return [(start, key, metric, s.to_dict()) for (start, key, metric), s in sketches.items()]


@pytest.fixture(scope="module")
def filled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("window") / "tokentrace.db"
    pipeline = Pipeline(
        parse_config({"processors": {"slo": {"targets": [E2E_TARGET]}}}, environ={})
    )
    store = RequestStore(path)
    records = []
    for number in range(REQUESTS):
        processed = pipeline.process_trace(_request_trace(number))
        records += processed.records
        store.write([(processed.trace, processed.records, processed.otlp)])
    slices = _slices_of(records)
    old = LatencySketch()
    old.add_many([99.0] * 50)  # an hour before the window: never counted
    old_slice: SketchSlice = (T0_S - 7200, slices[0][1], semconv.METRIC_E2E, old.to_dict())
    store.write_sketch_slices([(s[0], s[1], s[2], s[3]) for s in [*slices, old_slice]])
    store.set_meta(META_SLO_TARGETS, json.dumps([E2E_TARGET]))
    store.close()
    reader = RequestStore.open_readonly(path)
    docs = [reader.get(_trace_id(n).hex()) for n in range(REQUESTS)]
    return {"path": path, "slices": slices, "records": records, "docs": docs}


@pytest.fixture(scope="module")
def client(filled: dict[str, Any]) -> Iterator[TestClient]:
    app = create_app(ApiSettings(store_path=str(filled["path"]), clock=lambda: NOW_S))
    with TestClient(app) as test_client:
        yield test_client


def _get(client: TestClient, path: str, **params: Any) -> dict[str, Any]:
    response = client.get(path, params=params)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def _expected_report(
    slices: list[SketchSlice], since_s: float, until_s: float, **dims: str
) -> dict[str, Any]:
    chosen = [
        s
        for s in slices
        if since_s <= s[0] < until_s
        and all(dict(zip(SELECTOR_KEYS, s[1], strict=True))[k] == v for k, v in dims.items())
    ]
    return window_report(
        chosen, window_s=until_s - since_s, now_s=until_s, slo_targets=parse_targets([E2E_TARGET])
    )


def _merged(
    slices: list[SketchSlice], metric: str, since_s: float, until_s: float
) -> LatencySketch:
    merged = LatencySketch()
    for start, _key, name, sketch in slices:
        if name == metric and since_s <= start < until_s:
            merged.merge(LatencySketch.from_dict(sketch))
    return merged


# --- /window and /slo --------------------------------------------------------------------------


def test_window_is_the_window_report_of_the_slices_inside_it(
    client: TestClient, filled: dict[str, Any]
) -> None:
    body = _get(client, "/api/v1/window")
    assert body == _expected_report(filled["slices"], NOW_S - 3600, NOW_S)
    assert body["requests"] == REQUESTS
    explicit = _get(client, "/api/v1/window", since=A_WINDOW[0], until=A_WINDOW[1])
    assert explicit == _expected_report(filled["slices"], *A_WINDOW)
    assert explicit["requests"] == 20


def test_window_dimension_filters_select_keys(client: TestClient, filled: dict[str, Any]) -> None:
    body = _get(client, "/api/v1/window", model="qwen", last="1h")
    assert {key["model"] for key in body["keys"]} == {"qwen"}
    assert body == _expected_report(filled["slices"], NOW_S - 3600, NOW_S, model="qwen")
    assert _get(client, "/api/v1/window", model="absent")["keys"] == []


def test_slo_compliance_and_burn_rate_are_the_window_reports(
    client: TestClient, filled: dict[str, Any]
) -> None:
    body = _get(client, "/api/v1/slo")
    expected = _expected_report(filled["slices"], NOW_S - 3600, NOW_S)["slo"]
    assert body["targets"] == expected
    [target] = body["targets"]
    assert target["target"] == "e2e-p90"
    assert target["met"] is False  # over 10% of the requests exceed 180 ms
    assert 0 < target["compliance"] < 1
    assert target["burn_rate"] == pytest.approx((1 - target["compliance"]) / 0.1)
    assert body["since_s"] == NOW_S - 3600 and body["until_s"] == NOW_S
    assert body["errors"] == []


# --- /fleet -------------------------------------------------------------------------------------


def test_fleet_histograms_count_every_value(client: TestClient, filled: dict[str, Any]) -> None:
    body = _get(client, "/api/v1/fleet")
    for metric in METRICS:
        histogram = body["distributions"][metric]
        merged = _merged(filled["slices"], metric, NOW_S - 3600, NOW_S)
        assert histogram["count"] == merged.count > 0
        assert sum(histogram["counts"]) == merged.count
        bounds = histogram["bounds_ms"]
        assert len(bounds) == len(histogram["counts"]) + 1
        assert all(low < high for low, high in itertools.pairwise(bounds))
        assert 1 <= len(histogram["counts"]) <= 30
        assert bounds[0] <= merged.min * 1000 * 1.0001
        assert bounds[-1] >= merged.max * 1000 * 0.9999


def test_fleet_budget_bands_are_the_means_of_the_requests_in_them(
    client: TestClient, filled: dict[str, Any]
) -> None:
    body = _get(client, "/api/v1/fleet")
    e2e = _merged(filled["slices"], semconv.METRIC_E2E, NOW_S - 3600, NOW_S)
    docs = filled["docs"]

    def band(low_q: float, high_q: float | None) -> list[dict[str, Any]]:
        low_ns = round(e2e.quantile(low_q) * NS_PER_S)
        high_ns = None if high_q is None else round(e2e.quantile(high_q) * NS_PER_S)
        chosen = []
        for doc in docs:
            e2e_ns = round(doc["budget"]["e2e_ms"] * 1_000_000)
            if e2e_ns >= low_ns and (high_ns is None or e2e_ns <= high_ns):
                chosen.append(doc)
        return chosen

    for name, (low_q, high_q) in {"p50": (0.45, 0.55), "p99": (0.985, None)}.items():
        chosen = band(low_q, high_q)
        result = body["budget"][name]
        assert result["requests"] == len(chosen) > 0, name
        expected: dict[str, float] = {}
        for doc in chosen:
            for segment, value in budget_segments(doc["budget"]).items():
                expected[segment] = expected.get(segment, 0.0) + value / len(chosen)
        assert set(result["segments"]) <= set(expected)
        for segment, mean in expected.items():
            assert result["segments"].get(segment, 0.0) == pytest.approx(mean, abs=1e-3), segment
    assert body["budget"]["p50"]["e2e_ms"] == pytest.approx(e2e.quantile(0.5) * 1000, abs=1e-3)
    assert body["budget"]["p99"]["e2e_to_ms"] is None


def test_fleet_lists_the_slowest_and_the_breaching_requests(
    client: TestClient, filled: dict[str, Any]
) -> None:
    body = _get(client, "/api/v1/fleet")
    docs = sorted(filled["docs"], key=lambda d: d["budget"]["e2e_ms"], reverse=True)
    assert [item["trace_id"] for item in body["slowest"]] == [d["trace_id"] for d in docs[:10]]
    breaching = [d for d in docs if not all(d["slo"].values())]
    assert 0 < len(breaching) < 10  # all of them fit the list
    assert [item["trace_id"] for item in body["breaching"]] == [d["trace_id"] for d in breaching]
    assert all(item["slo_breached"] for item in body["breaching"])
    assert body["window"] == _expected_report(filled["slices"], NOW_S - 3600, NOW_S)
    assert body["warnings"] == []


def test_fleet_of_an_empty_window_is_empty_not_an_error(client: TestClient) -> None:
    body = _get(client, "/api/v1/fleet", since=T0_S + 500, until=T0_S + 600)
    assert body["window"]["keys"] == []
    assert all(
        h == {"bounds_ms": [], "counts": [], "count": 0} for h in body["distributions"].values()
    )
    assert body["budget"]["p50"]["requests"] == 0 and body["budget"]["p50"]["e2e_ms"] is None
    assert body["slowest"] == [] and body["breaching"] == []


# --- /compare -----------------------------------------------------------------------------------


def test_compare_puts_two_windows_side_by_side(client: TestClient, filled: dict[str, Any]) -> None:
    body = _get(
        client,
        "/api/v1/compare",
        a_since=A_WINDOW[0],
        a_until=A_WINDOW[1],
        b_since=B_WINDOW[0],
        b_until=B_WINDOW[1],
    )
    report_a = _expected_report(filled["slices"], *A_WINDOW)
    report_b = _expected_report(filled["slices"], *B_WINDOW)
    assert body["a"] == report_a and body["b"] == report_b
    rows = {(r["model"], r["metric"]): r for r in body["metrics"]}
    for key in report_b["keys"]:
        for metric, summary_b in key["metrics"].items():
            row = rows[(key["model"], metric)]
            summary_a = next(k for k in report_a["keys"] if k["model"] == key["model"])["metrics"][
                metric
            ]
            for label in ("p50", "p95", "p99"):
                assert row["delta"][label] == pytest.approx(
                    summary_b[label] - summary_a[label], abs=1e-3
                )
    # Later requests queue longer: B is slower at the median.
    assert rows[("llama", semconv.METRIC_E2E)]["delta"]["p50"] > 0
    [slo] = body["slo"]
    assert slo["a"] == report_a["slo"][0] and slo["b"] == report_b["slo"][0]
    assert slo["a"]["met"] is True and slo["b"]["met"] is False
    assert body["budget"]["a"]["p50"]["requests"] > 0
    assert body["budget"]["b"]["p50"]["e2e_ms"] > body["budget"]["a"]["p50"]["e2e_ms"]


# --- errors -------------------------------------------------------------------------------------

_COMPARE_OK = {"a_since": 1.0, "a_until": 2.0, "b_since": 3.0, "b_until": 4.0}


@pytest.mark.parametrize(
    ("path", "params", "says"),
    [
        ("/api/v1/window", {"last": "soon"}, "last"),
        ("/api/v1/window", {"last": "1h", "since": 5}, "either"),
        ("/api/v1/window", {"since": 10, "until": 5}, "after"),
        ("/api/v1/window", {"since": NOW_S + 100}, "empty"),
        ("/api/v1/window", {"since": 1e12}, "since"),
        ("/api/v1/window", {"since": "yesterday"}, "since"),
        ("/api/v1/slo", {"until": -1}, "until"),
        ("/api/v1/fleet", {"model": "x" * 300}, "model"),
        ("/api/v1/compare", {k: v for k, v in _COMPARE_OK.items() if k != "b_until"}, "b_until"),
        ("/api/v1/compare", {**_COMPARE_OK, "a_until": 0.5}, "a_until must be after"),
        ("/api/v1/compare", {**_COMPARE_OK, "b_until": 3.0}, "b_until must be after"),
        ("/api/v1/compare", {**_COMPARE_OK, "a_since": -3}, "a_since"),
        ("/api/v1/compare", {**_COMPARE_OK, "b_since": "nan"}, "b_since"),
    ],
)
def test_bad_parameters_are_400_with_one_sentence(
    client: TestClient, path: str, params: dict[str, Any], says: str
) -> None:
    response = client.get(path, params=params)
    assert response.status_code == 400, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert says in body["error"]


def test_unreadable_slo_targets_are_reported_not_fatal(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    store = RequestStore(path)
    store.set_meta(META_SLO_TARGETS, "{not json")
    store.close()
    app = create_app(ApiSettings(store_path=str(path), clock=lambda: NOW_S))
    with TestClient(app) as test_client:
        body = _get(test_client, "/api/v1/window")
        slo = _get(test_client, "/api/v1/slo")
    assert body["slo"] == [] and len(body["slo_errors"]) == 1
    assert "not JSON" in body["slo_errors"][0]
    assert slo["errors"] == body["slo_errors"]


def test_missing_store_is_503(tmp_path: Path) -> None:
    app = create_app(ApiSettings(store_path=str(tmp_path / "absent.db")))
    with TestClient(app) as test_client:
        for path in ("/api/v1/window", "/api/v1/fleet", "/api/v1/slo"):
            response = test_client.get(path)
            assert response.status_code == 503, path
            assert set(response.json()) == {"error"}


def test_slow_request_queries_degrade_the_fleet_view_to_warnings(
    filled: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    def too_slow(*_args: Any, **_kwargs: Any) -> Any:
        raise QueryTimeoutError("the list query took longer than 5 s")

    monkeypatch.setattr(RequestStore, "list_requests", too_slow)
    monkeypatch.setattr(RequestStore, "segment_means", too_slow)
    app = create_app(ApiSettings(store_path=str(filled["path"]), clock=lambda: NOW_S))
    with TestClient(app) as test_client:
        body = _get(test_client, "/api/v1/fleet")
    assert body["slowest"] == [] and body["breaching"] == []
    assert body["budget"]["p50"]["requests"] == 0
    assert body["budget"]["p50"]["e2e_ms"] is not None  # from the sketches, still known
    assert len(body["warnings"]) == 4
    assert body["distributions"]["e2e"]["count"] == REQUESTS


def test_openapi_documents_the_window_routes(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    for path, model in (
        ("/api/v1/window", "WindowReport"),
        ("/api/v1/slo", "SloReport"),
        ("/api/v1/fleet", "FleetView"),
        ("/api/v1/compare", "CompareView"),
    ):
        operation = schema["paths"][path]["get"]
        assert operation["tags"] == ["windows"]
        ok = operation["responses"]["200"]["content"]["application/json"]["schema"]
        assert ok["$ref"].endswith(f"/{model}")
    compare_params = {p["name"]: p for p in schema["paths"]["/api/v1/compare"]["get"]["parameters"]}
    assert all(compare_params[name]["required"] for name in _COMPARE_OK)


# --- pure builders ------------------------------------------------------------------------------


_DURATIONS_S = st.lists(
    st.one_of(st.just(0.0), st.floats(min_value=1e-6, max_value=100.0)), min_size=1, max_size=300
)


@settings(max_examples=80, deadline=None)
@given(_DURATIONS_S)
def test_histogram_counts_sum_to_the_sketch_and_match_the_values(values: list[float]) -> None:
    sketch = LatencySketch()
    sketch.add_many(values)
    histogram = histogram_document(sketch)
    counts, bounds = histogram["counts"], histogram["bounds_ms"]
    assert histogram["count"] == sketch.count == len(values)
    assert sum(counts) == len(values)
    assert len(bounds) == len(counts) + 1 and 1 <= len(counts) <= 30
    assert all(low < high for low, high in itertools.pairwise(bounds))
    # Each value lands in its own bin unless it lies within the sketch's error of a bound.
    exact = [0] * len(counts)
    near_a_bound = 0
    tolerance = 2 * sketch.relative_accuracy + 1e-5
    for value in values:
        value_ms = value * 1000
        exact[bisect.bisect_left(bounds[1:-1], value_ms)] += 1
        if any(math.isclose(value_ms, bound, rel_tol=tolerance) for bound in bounds):
            near_a_bound += 1
    assert sum(abs(e - c) for e, c in zip(exact, counts, strict=True)) <= 2 * near_a_bound


def test_histogram_of_nothing_and_of_one_value() -> None:
    assert histogram_document(None) == {"bounds_ms": [], "counts": [], "count": 0}
    single = LatencySketch()
    single.add_many([0.25] * 7)
    histogram = histogram_document(single)
    assert histogram["counts"] == [7]
    low, high = histogram["bounds_ms"]
    assert low < 250.0 < high
