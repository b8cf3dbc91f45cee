"""``GET /api/v1/diagnose`` against stores a real collector filled from ``tokentrace replay``
traffic: every finding is the one ``diagnose_range`` makes of the same window, with the lines
``tokentrace diagnose`` prints for it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.api.replayed import SLO_TARGETS, replayed_store
from tokentrace.collector.api.app import ApiSettings, create_app
from tokentrace.collector.diagnose import diagnose_range
from tokentrace.collector.store import META_SLO_TARGETS, RequestStore
from tokentrace.collector.store import query as store_query
from tokentrace.processors.slo import parse_targets
from tokentrace.processors.window.findings import finding_lines

REQUESTS = 120
EVERYTHING = {"since": 0}
"""A window from the epoch to now: every replayed request (they end about now)."""


@pytest.fixture(scope="module")
def queue_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("diagnose") / "queue.db"
    return replayed_store(path, scenario="queue_saturation", requests=REQUESTS, seed=5)


@pytest.fixture(scope="module")
def client(queue_store: Path) -> Iterator[TestClient]:
    with TestClient(create_app(ApiSettings(store_path=str(queue_store)))) as test_client:
        yield test_client


def _diagnose(client: TestClient, **params: Any) -> dict[str, Any]:
    response = client.get("/api/v1/diagnose", params=params)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def _fields(shown: dict[str, Any], wanted: dict[str, Any]) -> dict[str, Any]:
    return {name: shown[name] for name in wanted}


def test_findings_are_diagnose_range_of_the_window_with_the_cli_lines(
    client: TestClient, queue_store: Path
) -> None:
    body = _diagnose(client, **EVERYTHING)
    store = RequestStore.open_readonly(queue_store)
    expected = diagnose_range(
        store, since_ns=0, until_ns=None, targets=parse_targets(SLO_TARGETS), max_requests=2000
    )
    expected = json.loads(json.dumps(expected))
    # The response has every field its model names (null where the analysis left one out).
    for key in ("findings", "metric_findings"):
        assert len(body[key]) == len(expected[key])
        for shown, wanted in zip(body[key], expected[key], strict=True):
            assert _fields(shown, wanted) == wanted
            assert shown["lines"] == finding_lines(wanted)
    assert _fields(body["perceived"], expected["perceived"]) == expected["perceived"]
    for key in ("requests", "metrics", "segments", "slo"):
        assert body[key] == expected[key], key
    assert body["requests"] == REQUESTS
    assert body["slo_errors"] == []
    assert body["window"]["cut_at"] is None
    assert body["window"]["traces_found"] == REQUESTS
    assert body["window"]["client_only"] == 0  # every replayed request has both sides


def test_the_breached_ttft_target_comes_first_and_names_the_queue(client: TestClient) -> None:
    findings = _diagnose(client, **EVERYTHING)["findings"]
    assert [f["target"] for f in findings] == ["ttft-p95", "tpot-p99"]  # breached first
    ttft = findings[0]
    assert ttft["met"] is False and ttft["metric"] == "ttft" and ttft["clock"] == "server"
    assert ttft["value_ms"] > ttft["threshold_ms"] == 500.0
    assert (ttft["segment"], ttft["cause"]) == ("queue", "queueing")
    counterfactual = ttft["counterfactual"]
    assert counterfactual["segment"] == "queue"
    assert counterfactual["without_ms"] < ttft["threshold_ms"] < counterfactual["value_ms"]
    assert counterfactual["met_without"] is True
    head, dominance, what_if, fix = ttft["lines"]
    assert "MISSED" in head and "queue wait" in dominance and "without queue wait" in what_if
    assert fix == f"fix: {ttft['advice']}"


def test_metric_findings_give_the_typical_and_the_tail_request_of_each_metric(
    client: TestClient,
) -> None:
    findings = _diagnose(client, **EVERYTHING)["metric_findings"]
    assert [(f["metric"], f["group"]) for f in findings] == [
        (metric, group) for metric in ("ttft", "tpot", "e2e") for group in ("typical", "tail")
    ]
    assert all(f["target"] is None and f["met"] is None for f in findings)
    tail_ttft = findings[1]
    assert tail_ttft["clock"] == "client"  # every replayed request has a client span
    assert tail_ttft["segment"] == "queue"


def test_the_default_window_is_the_last_hour(client: TestClient) -> None:
    body = _diagnose(client)
    assert body["until_s"] - body["since_s"] == pytest.approx(3600.0)
    assert body["requests"] == REQUESTS


def test_a_window_past_the_limit_is_cut_to_its_most_recent_traces(client: TestClient) -> None:
    body = _diagnose(client, limit=50, **EVERYTHING)
    assert body["window"]["cut_at"] == 50
    assert body["window"]["traces_found"] == body["requests"] == 50


def test_an_empty_window_has_no_findings_but_its_targets(client: TestClient) -> None:
    body = _diagnose(client, since=1, until=2)
    assert body["requests"] == 0
    assert body["metric_findings"] == []
    assert [(f["target"], f["met"]) for f in body["findings"]] == [
        ("ttft-p95", None),
        ("tpot-p99", None),
    ]
    assert all(f["lines"][0].endswith("no matching requests") for f in body["findings"])


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ({"limit": 0}, "limit"),
        ({"limit": 20_001}, "limit"),
        ({"limit": "many"}, "limit"),
        ({"last": "soon"}, "last"),
        ({"since": 10, "until": 5}, "after"),
        ({"since": 4_000_000_000}, "empty"),
        ({"last": "1h", "since": 5}, "either"),
    ],
)
def test_bad_parameters_are_400_with_one_sentence(
    client: TestClient, params: dict[str, Any], says: str
) -> None:
    response = client.get("/api/v1/diagnose", params=params)
    assert response.status_code == 400, response.text
    body = response.json()
    assert set(body) == {"error"} and says in body["error"]


def test_a_diagnosis_past_the_query_budget_is_503(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_query, "QUERY_BUDGET_S", 0.0)
    response = client.get("/api/v1/diagnose", params=EVERYTHING)
    assert response.status_code == 503
    assert "narrow the window or lower the request limit" in response.json()["error"]


def test_unreadable_stored_targets_are_reported_and_the_others_judged(
    tmp_path: Path,
) -> None:
    path = replayed_store(tmp_path / "store.db", scenario="queue_saturation", requests=20, seed=2)
    store = RequestStore(path)
    store.set_meta(META_SLO_TARGETS, json.dumps([{"name": "broken"}, SLO_TARGETS[0]]))
    store.close()
    with TestClient(create_app(ApiSettings(store_path=str(path)))) as test_client:
        body = _diagnose(test_client, **EVERYTHING)
    assert [f["target"] for f in body["findings"]] == [SLO_TARGETS[0]["name"]]
    [problem] = body["slo_errors"]
    assert "metric: missing" in problem


def test_missing_store_is_503(tmp_path: Path) -> None:
    app = create_app(ApiSettings(store_path=str(tmp_path / "absent.db")))
    with TestClient(app) as test_client:
        response = test_client.get("/api/v1/diagnose")
    assert response.status_code == 503 and set(response.json()) == {"error"}


def test_openapi_documents_the_diagnose_route(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    operation = schema["paths"]["/api/v1/diagnose"]["get"]
    ok = operation["responses"]["200"]["content"]["application/json"]["schema"]
    assert ok["$ref"].endswith("/WindowDiagnosis")
    limit = next(p for p in operation["parameters"] if p["name"] == "limit")
    assert (limit["schema"]["minimum"], limit["schema"]["maximum"]) == (1, 20_000)
    assert {"since", "until", "last"} <= {p["name"] for p in operation["parameters"]}
