"""``GET /api/v1/requests/{trace_id}`` against a real SQLite store filled by the real pipeline."""

from __future__ import annotations

import json
import sqlite3
import typing
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.api.replayed import replayed_store
from tests.collector.test_store import make_record
from tests.spanbuild import T0, key_value, request_spans, span, trace
from tokentrace.agent import semconv
from tokentrace.agent.finished_request import DEFAULT_ITL_OUTLIER_RATIO
from tokentrace.agent.frameworks.vllm_engine import outlier_gap_ends
from tokentrace.collector.api.app import ApiSettings, create_app
from tokentrace.collector.api.request_view import request_view, token_gaps
from tokentrace.collector.config import parse_config
from tokentrace.collector.exporters.store_sink import StoreSink
from tokentrace.collector.pipeline import Pipeline
from tokentrace.collector.render import (
    verdict_heading,
    verdict_text,
    waterfall_rows,
    waterfall_segment,
)
from tokentrace.collector.store import RequestStore, record_to_dict
from tokentrace.collector.store.document import RequestDocument

MS = 1_000_000
TRACE = bytes.fromhex("a1b2c3d4" + "5a" * 12)
ONE_TOKEN_TRACE = bytes.fromhex("0e0e0e0e" + "01" * 12)
"""A request with one output token: it has a TTFT and an E2E, no TPOT and no ITL."""
REQUEST_ID = "req-7"
OFFSETS_US = (0, 10_000, 20_000, 70_000, 80_000, 90_000)
"""Gaps 10, 10, 50, 10, 10 ms: median 10 ms, so only gap 3 (50 ms) exceeds 3 x the median."""
# request_spans: http 1 ms, queue 5 ms, prefill 20 ms -> first token 26 ms after the origin
# (the http span's start); gap 3 runs from tick 2 (46 ms) to tick 3 (96 ms).
FIRST_TOKEN_MS = 26.0
OUTLIER_GAP_MS = (46.0, 96.0)
REQUEST_SPAN = 2
STEP_IDS = {"child_in_gap": 20, "child_touching_gap": 21, "by_id_in_gap": 22, "other": 23}
STEP_IDS["by_id_touching_end"] = 24
TRACE_LINK = 'https://grafana.example/explore?left={"queries":[{"query":"{trace_id}"}]}'


def sid(number: int) -> bytes:
    return number.to_bytes(8, "big")


def _step(
    number: int,
    start_ms: float,
    end_ms: float,
    *,
    parent: int | None,
    request_ids: list[str],
    extra: dict[str, Any] | None = None,
) -> Any:
    attrs: dict[str, Any] = {
        semconv.ENGINE_STEP_BATCH_SIZE: len(request_ids),
        semconv.ENGINE_STEP_PREFILL_REQUESTS: 1,
        semconv.ENGINE_STEP_DECODE_REQUESTS: len(request_ids) - 1,
        semconv.ENGINE_STEP_PREFILL_TOKENS: 512,
        semconv.ENGINE_STEP_DECODE_TOKENS: len(request_ids) - 1,
        semconv.ENGINE_STEP_KV_CACHE_USAGE: 0.4,
        semconv.ENGINE_STEP_WAITING: 3,
        semconv.ENGINE_STEP_RUNNING: len(request_ids),
        semconv.ENGINE_STEP_REQUEST_IDS: request_ids,
        **(extra or {}),
    }
    return span(
        semconv.SPAN_ENGINE_STEP,
        T0 + int(start_ms * MS),
        T0 + int(end_ms * MS),
        span_id=sid(number),
        trace_id=TRACE,
        parent_span_id=b"" if parent is None else sid(parent),
        attrs=attrs,
    )


def _request_trace(trace_id: bytes = TRACE) -> Any:
    spans = request_spans(
        start_ns=T0,
        token_offsets_us=OFFSETS_US,
        trace_id=trace_id,
        request_attrs={
            semconv.REQUEST_ID: REQUEST_ID,
            semconv.GPU_UTILIZATION_MEAN: 0.5,
            semconv.GPU_SAMPLES: 10,
        },
        decode_attrs={
            semconv.GPU_MEMORY_BANDWIDTH_PEAK_RATIO: 0.62,
            semconv.GPU_POWER_WATTS: 350.0,
        },
    )
    prefill = next(s for s in spans if s.name == semconv.SPAN_PREFILL)
    prefill.attributes.extend(
        [
            key_value(semconv.GPU_UTILIZATION_MEAN, 0.9),
            key_value(semconv.GPU_MEMORY_BANDWIDTH_GBPS, 1200.5),
            key_value(semconv.GPU_MEMORY_BANDWIDTH_SOURCE, semconv.MEMORY_BANDWIDTH_SOURCE_GPM),
            key_value(semconv.GPU_SAMPLES, 3.0),  # a sender that wrote the count as a double
        ]
    )
    if trace_id != TRACE:
        return trace(*spans)
    steps = [
        # Under the request span, inside the outlier gap.
        _step(
            STEP_IDS["child_in_gap"],
            90,
            97,
            parent=REQUEST_SPAN,
            request_ids=[REQUEST_ID, "req-9"],
            extra={semconv.GPU_UTILIZATION_MAX: 1.0, semconv.GPU_SAMPLES: 2},
        ),
        # Under the request span, ending exactly where the outlier gap begins: not in it.
        _step(
            STEP_IDS["child_touching_gap"],
            40,
            OUTLIER_GAP_MS[0],
            parent=REQUEST_SPAN,
            request_ids=[REQUEST_ID],
        ),
        # Elsewhere in the trace, naming the request: found by its id.
        _step(STEP_IDS["by_id_in_gap"], 60, 62, parent=None, request_ids=["req-9", REQUEST_ID]),
        _step(
            STEP_IDS["by_id_touching_end"],
            OUTLIER_GAP_MS[1],
            100,
            parent=None,
            request_ids=[REQUEST_ID],
        ),
        # Another request's step: not this request's.
        _step(STEP_IDS["other"], 60, 62, parent=None, request_ids=["req-9"]),
    ]
    return trace(*spans, *steps)


def _write(store: RequestStore, assembled: Any) -> None:
    processed = Pipeline(parse_config({}, environ={})).process_trace(assembled)
    assert processed.records, "the pipeline made no request of the test trace"
    store.write([(processed.trace, processed.records, processed.otlp)])


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    path = tmp_path / "tokentrace.db"
    store = RequestStore(path)
    _write(store, _request_trace())
    # Two traces sharing their first 8 hex digits: that prefix is ambiguous.
    for suffix in ("01", "02"):
        _write(store, _request_trace(bytes.fromhex("deadbeef" + suffix + "00" * 11)))
    _write(store, trace(*request_spans(token_offsets_us=(0,), trace_id=ONE_TOKEN_TRACE)))
    store.close()
    return path


@pytest.fixture
def client(store_path: Path) -> Iterator[TestClient]:
    app = create_app(ApiSettings(store_path=str(store_path), trace_link=TRACE_LINK))
    with TestClient(app) as test_client:
        yield test_client


@pytest.fixture
def doc(store_path: Path) -> dict[str, Any]:
    store = RequestStore.open_readonly(store_path)
    found = store.get(TRACE.hex())
    assert found is not None
    return found


@pytest.fixture
def detail(client: TestClient) -> dict[str, Any]:
    response = client.get(f"/api/v1/requests/{TRACE.hex()}")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def test_document_verdict_and_waterfall_are_those_of_explain(
    detail: dict[str, Any], doc: dict[str, Any]
) -> None:
    assert detail["request"] == json.loads(json.dumps(doc))
    assert detail["verdict_text"] == verdict_text(doc)
    rows = waterfall_rows(doc)
    assert [(r["label"], r["segment"]) for r in detail["waterfall"]] == [
        (row.label, row.segment) for row in rows
    ]
    assert [r["intervals_ms"] for r in detail["waterfall"]] == [
        [list(interval) for interval in row.intervals_ms] for row in rows
    ]
    assert {r["label"] for r in detail["waterfall"]} >= {"http", "queue", "prefill", "decode"}


def test_the_default_verdict_its_metric_heading_and_dominant_phase(
    detail: dict[str, Any], doc: dict[str, Any]
) -> None:
    verdict = doc["verdict"]
    assert detail["verdict"] == verdict
    assert detail["verdict_metric"] == verdict["metric"]
    assert detail["verdict_heading"] == verdict_heading(doc)
    assert verdict["why"] and verdict["why"] in detail["verdict_heading"]
    dominant = [row["segment"] for row in detail["waterfall"] if row["dominant"]]
    assert dominant == [waterfall_segment(verdict["segment"])]


def test_a_metric_without_a_value_answers_that_it_has_none(client: TestClient) -> None:
    for metric in ("tpot", "itl"):
        response = client.get(
            f"/api/v1/requests/{ONE_TOKEN_TRACE.hex()}", params={"metric": metric}
        )
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["verdict_text"] == f"no {metric.upper()} for this request"
        assert body["verdict_metric"] == metric
        assert body["verdict"] is None and body["verdict_heading"] == ""
        assert not any(row["dominant"] for row in body["waterfall"])
        assert metric not in body["request"]["verdicts"]
    ttft = client.get(f"/api/v1/requests/{ONE_TOKEN_TRACE.hex()}", params={"metric": "ttft"})
    assert ttft.json()["verdict"]["metric"] == "ttft"


@pytest.mark.parametrize("metric", ["TTFT", "p95", "queue", ""])
def test_an_unknown_metric_is_400(client: TestClient, metric: str) -> None:
    response = client.get(f"/api/v1/requests/{TRACE.hex()}", params={"metric": metric})
    assert response.status_code == 400
    assert response.json()["error"].startswith("metric: ")


def test_the_metric_parameter_takes_every_verdict_metric() -> None:
    schema = create_app(ApiSettings(store_path="unused.db")).openapi()
    parameters = schema["paths"]["/api/v1/requests/{trace_id}"]["get"]["parameters"]
    metric = next(p for p in parameters if p["name"] == "metric")
    assert tuple(metric["schema"]["anyOf"][0]["enum"]) == semconv.VERDICT_METRICS


@pytest.fixture(scope="module")
def replayed_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    path = replayed_store(tmp_path_factory.mktemp("replayed") / "store.db", scenario="mixed")
    with TestClient(create_app(ApiSettings(store_path=str(path)))) as test_client:
        yield test_client


def test_the_metric_parameter_switches_the_verdict_and_the_dominant_phase(
    replayed_client: TestClient,
) -> None:
    """On replayed traffic: the slowest TTFT's default verdict is about the breached TTFT target
    (queue wait, client-seen); asked about TPOT it is about decode, server-seen."""
    slowest = replayed_client.get("/api/v1/requests", params={"sort": "ttft", "limit": 1}).json()[
        "items"
    ][0]
    path = f"/api/v1/requests/{slowest['trace_id']}"
    default = replayed_client.get(path).json()
    doc = default["request"]
    assert default["verdict_metric"] == "ttft"
    assert (default["verdict"]["segment"], default["verdict"]["clock"]) == ("queue", "client")
    assert "ttft-p95" in default["verdict_heading"]
    sentences = set()
    for metric in doc["verdicts"]:
        body = replayed_client.get(path, params={"metric": metric}).json()
        verdict = doc["verdicts"][metric]
        assert body["verdict_metric"] == metric
        assert body["verdict"] == verdict
        assert body["verdict_text"] == verdict_text(doc, metric) == verdict["sentence"]
        assert body["verdict_heading"] == verdict_heading(doc, metric)
        dominant = [row["segment"] for row in body["waterfall"] if row["dominant"]]
        assert dominant == [waterfall_segment(verdict["segment"])]
        sentences.add(body["verdict_text"])
    assert len(sentences) == len(doc["verdicts"]) == 4
    tpot = replayed_client.get(path, params={"metric": "tpot"}).json()
    assert tpot["verdict"]["clock"] == "server"
    assert [row["segment"] for row in tpot["waterfall"] if row["dominant"]] == ["decode"]
    assert "server-seen TPOT" in tpot["verdict_text"]


def test_token_ticks_and_gaps_follow_the_offsets(
    detail: dict[str, Any], doc: dict[str, Any]
) -> None:
    tokens = detail["tokens"]
    decode_row = next(row for row in waterfall_rows(doc) if row.label == "decode")
    assert tokens["ticks_ms"] == list(decode_row.ticks_ms)
    assert tokens["ticks_ms"] == pytest.approx([FIRST_TOKEN_MS + o / 1000 for o in OFFSETS_US])
    expected_gaps = [(OFFSETS_US[i] - OFFSETS_US[i - 1]) / 1000 for i in range(1, len(OFFSETS_US))]
    assert [g["gap_ms"] for g in tokens["gaps"]] == pytest.approx(expected_gaps)
    assert [g["index"] for g in tokens["gaps"]] == list(range(1, len(OFFSETS_US)))
    assert [g["at_ms"] for g in tokens["gaps"]] == tokens["ticks_ms"][1:]
    ratio = DEFAULT_ITL_OUTLIER_RATIO
    assert tokens["median_gap_ms"] == pytest.approx(10.0)
    assert tokens["outlier_threshold_ms"] == pytest.approx(10.0 * ratio)
    assert [g["outlier"] for g in tokens["gaps"]] == [g > 10.0 * ratio for g in expected_gaps]
    assert [g["index"] for g in tokens["gaps"] if g["outlier"]] == [3]
    assert tokens["dropped"] == 0


def test_engine_steps_are_the_requests_and_flagged_when_inside_an_outlier_gap(
    detail: dict[str, Any],
) -> None:
    steps = {int(step["span_id"], 16): step for step in detail["engine_steps"]}
    assert set(steps) == {
        STEP_IDS["child_in_gap"],
        STEP_IDS["child_touching_gap"],
        STEP_IDS["by_id_in_gap"],
        STEP_IDS["by_id_touching_end"],
    }
    starts = [step["start_ms"] for step in detail["engine_steps"]]
    assert starts == sorted(starts)
    gap_start, gap_end = OUTLIER_GAP_MS
    for number, step in steps.items():
        overlaps = step["start_ms"] < gap_end and step["end_ms"] > gap_start
        assert step["outlier"] is overlaps, number
    assert steps[STEP_IDS["child_in_gap"]]["outlier"] is True
    assert steps[STEP_IDS["by_id_in_gap"]]["outlier"] is True
    assert steps[STEP_IDS["child_touching_gap"]]["outlier"] is False
    assert steps[STEP_IDS["by_id_touching_end"]]["outlier"] is False

    inside = steps[STEP_IDS["child_in_gap"]]
    assert (inside["start_ms"], inside["end_ms"]) == (90.0, 97.0)
    assert inside["batch_size"] == 2
    assert inside["prefill_tokens"] == 512
    assert inside["kv_cache_usage"] == pytest.approx(0.4)
    assert inside["waiting"] == 3
    assert inside["request_ids"] == [REQUEST_ID, "req-9"]
    assert inside["parent_span_id"] == sid(REQUEST_SPAN).hex()
    assert inside["gpu"]["utilization_max"] == 1.0
    assert inside["gpu"]["samples"] == 2
    assert inside["gpu"]["utilization_mean"] is None
    assert steps[STEP_IDS["child_touching_gap"]]["gpu"] is None


def test_gpu_aggregates_per_phase_come_from_the_span_attributes(detail: dict[str, Any]) -> None:
    phases = {entry["phase"]: entry for entry in detail["gpu"]}
    assert set(phases) == {"request", "prefill", "decode"}
    assert phases["request"]["utilization_mean"] == 0.5
    assert phases["request"]["samples"] == 10
    prefill = phases["prefill"]
    assert prefill["utilization_mean"] == 0.9
    assert prefill["bandwidth_gbps"] == 1200.5
    assert prefill["bandwidth_source"] == "gpm"
    assert prefill["samples"] == 3
    assert (prefill["start_ms"], prefill["end_ms"]) == (6.0, FIRST_TOKEN_MS)
    decode = phases["decode"]
    assert decode["bandwidth_peak_ratio"] == 0.62
    assert decode["power_w"] == 350.0
    assert decode["utilization_mean"] is None


def test_spans_are_the_request_span_and_its_descendants(detail: dict[str, Any]) -> None:
    spans = detail["spans"]
    assert spans[0]["span_id"] == sid(REQUEST_SPAN).hex()
    names = [s["name"] for s in spans]
    assert names.count(semconv.SPAN_ENGINE_STEP) == 2  # only the two under the request span
    assert set(names) == {
        semconv.SPAN_REQUEST,
        semconv.SPAN_QUEUE,
        semconv.SPAN_PREFILL,
        semconv.SPAN_DECODE,
        semconv.SPAN_POSTPROCESS,
        semconv.SPAN_ENGINE_STEP,
    }
    decode = next(s for s in spans if s["name"] == semconv.SPAN_DECODE)
    assert decode["attributes"][semconv.DECODE_TOKEN_OFFSETS] == list(OFFSETS_US)
    assert decode["parent_span_id"] == sid(REQUEST_SPAN).hex()
    assert decode["start_ms"] == FIRST_TOKEN_MS
    assert all(s["status"] == "unset" for s in spans)
    assert detail["spans_dropped"] == 0
    assert detail["warnings"] == []


def test_trace_link_fills_the_full_trace_id_and_keeps_other_braces(
    detail: dict[str, Any],
) -> None:
    assert detail["links"]["trace"] == TRACE_LINK.replace("{trace_id}", TRACE.hex())


def test_trace_id_prefix_and_span_id_select_the_request(client: TestClient) -> None:
    by_prefix = client.get(f"/api/v1/requests/{TRACE.hex()[:8]}")
    assert by_prefix.status_code == 200
    assert by_prefix.json()["request"]["trace_id"] == TRACE.hex()
    by_span = client.get(
        f"/api/v1/requests/{TRACE.hex()}", params={"span_id": sid(REQUEST_SPAN).hex()}
    )
    assert by_span.status_code == 200
    assert by_span.json()["request"]["span_id"] == sid(REQUEST_SPAN).hex()


@pytest.mark.parametrize(
    ("path", "params", "status", "says"),
    [
        ("ffffffff" + "00" * 12, {}, 404, "no stored request"),
        (TRACE.hex(), {"span_id": "ffffffffffffffff"}, 404, "no stored request"),
        ("deadbeef", {}, 400, "several traces"),
        ("a1b2c3", {}, 400, "too short"),
        ("not-hex-at-all", {}, 400, "hexadecimal"),
        (TRACE.hex(), {"span_id": "zz"}, 400, "hexadecimal"),
        ("a" * 65, {}, 400, "trace_id"),
    ],
)
def test_bad_and_unknown_ids(
    client: TestClient, path: str, params: dict[str, str], status: int, says: str
) -> None:
    response = client.get(f"/api/v1/requests/{path}", params=params)
    assert response.status_code == status
    body = response.json()
    assert set(body) == {"error"}
    assert says in body["error"]


def test_spans_missing_from_the_store_degrade_to_warnings(store_path: Path) -> None:
    with sqlite3.connect(store_path) as raw:
        raw.execute("DELETE FROM traces WHERE trace_id = ?", (TRACE,))
    app = create_app(ApiSettings(store_path=str(store_path)))
    with TestClient(app) as test_client:
        response = test_client.get(f"/api/v1/requests/{TRACE.hex()}")
    assert response.status_code == 200
    body = response.json()
    assert body["spans"] == body["engine_steps"] == body["gpu"] == []
    assert any("no longer stored" in warning for warning in body["warnings"])
    assert body["links"]["trace"] is None
    assert body["waterfall"]  # the document's own timeline still draws


def test_undecodable_spans_degrade_to_warnings(doc: dict[str, Any]) -> None:
    view = request_view(doc, b"\xff\xff\xff\xff not a protobuf", itl_outlier_ratio=3.0)
    assert view["spans"] == view["engine_steps"] == view["gpu"] == []
    assert any("cannot be decoded" in warning for warning in view["warnings"])
    assert view["tokens"] == token_gaps(doc, itl_outlier_ratio=3.0)


def test_span_cap_counts_what_it_leaves_out(doc: dict[str, Any], store_path: Path) -> None:
    store = RequestStore.open_readonly(store_path)
    view = request_view(
        doc, store.trace_otlp(TRACE.hex()), itl_outlier_ratio=3.0, max_spans=3, max_engine_steps=1
    )
    assert len(view["spans"]) == 3
    assert view["spans_dropped"] == 7 - 3  # request, 4 phases, 2 engine steps
    assert len(view["engine_steps"]) == 1
    assert any("not listed" in warning for warning in view["warnings"])


def tokens_doc(first_token_ms: float | None, offsets_us: list[int]) -> RequestDocument:
    """A whole request document whose first token and token offsets are the given ones."""
    doc = record_to_dict(make_record(1))
    boundaries = doc["timeline"]["boundaries_ms"]
    boundaries.pop("first_token")
    if first_token_ms is not None:
        boundaries["first_token"] = first_token_ms
    doc["token_offsets_us"] = offsets_us
    return doc


def test_gaps_without_a_first_token_or_with_one_gap_have_no_outliers() -> None:
    no_first_token = tokens_doc(None, [0, 5, 900])
    assert token_gaps(no_first_token, itl_outlier_ratio=3.0)["gaps"] == []
    one_gap = tokens_doc(1.0, [0, 900])
    tokens = token_gaps(one_gap, itl_outlier_ratio=3.0)
    assert [g["outlier"] for g in tokens["gaps"]] == [False]
    assert tokens["median_gap_ms"] is None
    malformed = tokens_doc(0.0, [0, 1000, 500, 1500, 2500])
    gaps = token_gaps(malformed, itl_outlier_ratio=3.0)["gaps"]
    assert gaps[1]["gap_ms"] == -0.5
    assert not any(g["outlier"] for g in gaps)


def test_openapi_describes_the_detail_response(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    operation = schema["paths"]["/api/v1/requests/{trace_id}"]["get"]
    assert operation["tags"] == ["requests"]
    assert "404" in operation["responses"]
    detail_schema = schema["components"]["schemas"]["RequestDetail"]
    assert {"waterfall", "tokens", "engine_steps", "gpu", "spans", "links"} <= set(
        detail_schema["properties"]
    )


@pytest.mark.parametrize(
    "gaps_ms",
    [[10, 100], [10, 10, 100, 200], [10, 10, 10, 50, 10], [10, 10, 30, 10], [5, 9, 40, 41]],
)
def test_marked_gaps_are_the_ones_the_agent_exports_steps_for(gaps_ms: list[int]) -> None:
    """One outlier rule: the UI marks exactly the gaps whose engine steps the agent exported
    (an even count of gaps is where a nearest-rank median would differ)."""
    offsets_us = [0]
    for gap in gaps_ms:
        offsets_us.append(offsets_us[-1] + gap * 1000)
    doc = tokens_doc(0.0, offsets_us)
    marked = [g["index"] for g in token_gaps(doc, itl_outlier_ratio=3.0)["gaps"] if g["outlier"]]
    step_ends = [(index, offset * 1000) for index, offset in enumerate(offsets_us)]
    assert marked == outlier_gap_ends(step_ends, 3.0)


def test_outlier_marks_follow_the_collectors_configured_ratio(tmp_path: Path) -> None:
    """The API marks the gaps the collector's diagnosis calls outliers, by its configured
    ratio: 6 median gaps puts the 50 ms gap (5 medians) inside, and its steps with it."""
    config = parse_config(
        {"processors": {"diagnosis": {"itl_outlier_ratio": 6}}, "exporters": {"store": {}}},
        environ={},
    )
    store_config = config.store
    assert store_config is not None
    sink = StoreSink(
        replace(store_config, path=str(tmp_path / "store.db")), diagnosis=config.diagnosis
    )
    sink.export_traces([Pipeline(config).process_trace(_request_trace())])
    sink.store.close()
    app = create_app(ApiSettings(store_path=str(tmp_path / "store.db")))
    with TestClient(app) as test_client:
        response = test_client.get(f"/api/v1/requests/{TRACE.hex()}")
    assert response.status_code == 200, response.text
    body = response.json()
    tokens = body["tokens"]
    assert tokens["median_gap_ms"] == pytest.approx(10.0)
    assert tokens["outlier_threshold_ms"] == pytest.approx(60.0)
    assert not any(gap["outlier"] for gap in tokens["gaps"])
    assert body["engine_steps"] and not any(step["outlier"] for step in body["engine_steps"])
    # The collector's own verdict judged the gaps by the same ratio.
    assert "none over 6x its median gap" in body["request"]["verdicts"]["itl"]["sentence"]


def test_the_metric_parameter_offers_exactly_the_verdict_metrics() -> None:
    # The Literal the OpenAPI document shows restates the contract's tuple: keep them one.
    from tokentrace.collector.api import detail_route

    assert typing.get_args(detail_route.VerdictMetric) == semconv.VERDICT_METRICS
