"""``GET /api/v1/requests`` through the real app (TestClient) on a real store of each backend
(SQLite, PostgreSQL: the ``filled`` store and ``store_location``).

Expected lists are computed by brute force over the rows the test wrote
(``test_store_queries``), so each test says what the HTTP parameters mean, not how the store
answers them.
"""

from __future__ import annotations

import typing
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.api.test_store_queries import (
    BUCKETS,
    CAUSES,
    INJECTIONS,
    MODELS,
    ROWS,
    SERVICES,
    START_STEP_NS,
    Filled,
    expected_order,
    filled,  # noqa: F401 - the module-scoped store fixture
    sqlite_only,
    varied_record,
    write,
)
from tests.collector.test_store import BASE_NS
from tokentrace.collector.api import list_route
from tokentrace.collector.api.app import ApiSettings, create_app
from tokentrace.collector.store import RequestFilter, open_store
from tokentrace.collector.store import query as store_query
from tokentrace.collector.store.document import RequestSummaryDoc
from tokentrace.collector.store.sqlite import list_query as sqlite_list_query

NS_PER_S = 1_000_000_000
NOW_NS = BASE_NS + ROWS * START_STEP_NS
NOW_S = NOW_NS / NS_PER_S
"""The app's clock: after the last stored request (a whole second, exact as a float)."""
SUMMARY_FIELDS = set(list_route.RequestSummary.model_fields)


@contextmanager
def serving(location: str, **settings: Any) -> Iterator[TestClient]:
    """The app on the store at ``location``; its store is closed afterwards (the app never
    closes it, and a PostgreSQL reader keeps its pooled connections open until then)."""
    app = create_app(ApiSettings(store_path=location, **settings))
    try:
        with TestClient(app) as test_client:
            yield test_client
    finally:
        if app.state.store is not None:
            app.state.store.close()


@pytest.fixture(scope="module")
def client(filled: Filled) -> Iterator[TestClient]:  # noqa: F811
    """The app on the ``filled`` store, once per module and backend (tests only read)."""
    with serving(filled.location, clock=lambda: NOW_S) as test_client:
        yield test_client


def get(client: TestClient, **params: Any) -> dict[str, Any]:
    response = client.get("/api/v1/requests", params=params)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def keys_of(body: dict[str, Any]) -> list[tuple[str, str]]:
    return [(item["trace_id"], item["span_id"]) for item in body["items"]]


def all_pages(client: TestClient, **params: Any) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """Every page through ``next_cursor``: the keys in order, and the first page."""
    first = body = get(client, **params)
    keys = keys_of(body)
    for _ in range(ROWS + 1):
        if body["next_cursor"] is None:
            return keys, first
        body = get(client, **params, cursor=body["next_cursor"])
        keys.extend(keys_of(body))
    raise AssertionError("the pages never ended")


def ms(value_ns: int) -> float:
    return value_ns / 1e6


# --- every parameter means what docs/api.md says -------------------------------------------


def _parameter_cases(rows: Any) -> list[tuple[dict[str, Any], RequestFilter]]:
    start_20 = BASE_NS + 20 * START_STEP_NS
    start_40 = BASE_NS + 40 * START_STEP_NS
    e2e_values = sorted(r.e2e_ns for r in rows)
    ttft_values = sorted(r.ttft_ns for r in rows if r.ttft_ns is not None)
    return [
        ({}, RequestFilter()),
        ({"service": SERVICES[1]}, RequestFilter(service=SERVICES[1])),
        ({"model": MODELS[1]}, RequestFilter(model=MODELS[1])),
        ({"operation": "text_completion"}, RequestFilter(operation="text_completion")),
        ({"prompt_bucket": BUCKETS[2]}, RequestFilter(prompt_bucket=BUCKETS[2])),
        ({"slo_breached": "true"}, RequestFilter(slo_breached=True)),
        ({"slo_breached": "false"}, RequestFilter(slo_breached=False)),
        ({"cause": CAUSES[0][0]}, RequestFilter(cause=CAUSES[0][0])),
        ({"segment": CAUSES[1][1]}, RequestFilter(segment=CAUSES[1][1])),
        (
            {"min_ttft_ms": ms(ttft_values[len(ttft_values) // 2])},
            RequestFilter(min_ttft_ns=ttft_values[len(ttft_values) // 2]),
        ),
        (
            {"min_e2e_ms": ms(e2e_values[len(e2e_values) // 3])},
            RequestFilter(min_e2e_ns=e2e_values[len(e2e_values) // 3]),
        ),
        ({"q": "cmpl-001"}, RequestFilter(text="cmpl-001")),
        ({"q": rows[33].trace_id.hex()[:10]}, RequestFilter(text=rows[33].trace_id.hex()[:10])),
        ({"since": start_20 / NS_PER_S}, RequestFilter(since_ns=start_20)),
        ({"until": start_20 / NS_PER_S}, RequestFilter(until_ns=start_20)),
        (
            {"since": start_20 / NS_PER_S, "until": start_40 / NS_PER_S, "model": MODELS[0]},
            RequestFilter(since_ns=start_20, until_ns=start_40, model=MODELS[0]),
        ),
        ({"last": f"{(NOW_NS - start_40) // NS_PER_S}s"}, RequestFilter(since_ns=start_40)),
        (
            {"service": SERVICES[0], "slo_breached": "true", "cause": CAUSES[1][0]},
            RequestFilter(service=SERVICES[0], slo_breached=True, cause=CAUSES[1][0]),
        ),
    ]


@pytest.mark.parametrize("case", range(18))
def test_every_filter_parameter_selects_what_the_contract_says(
    client: TestClient,
    filled: Filled,  # noqa: F811
    case: int,
) -> None:
    cases = _parameter_cases(filled.rows)
    assert len(cases) == 18
    params, meaning = cases[case]
    keys, first = all_pages(client, **params, limit=9)
    expected = expected_order(filled.rows, meaning, "start", True)
    assert keys == expected
    assert first["total"] == len(expected) and first["total_exact"] is True
    if params:  # each case selects something, and not everything
        assert 0 < len(expected) < ROWS, params


@pytest.mark.parametrize("sort", typing.get_args(list_route.SortKey))
@pytest.mark.parametrize("order", ["desc", "asc"])
def test_every_sort_both_ways_pages_through_every_match_once(
    client: TestClient,
    filled: Filled,  # noqa: F811
    sort: str,
    order: str,
) -> None:
    keys, first = all_pages(client, sort=sort, order=order, limit=11)
    assert keys == expected_order(filled.rows, RequestFilter(), sort, order == "desc")
    assert len(first["items"]) == 11


def test_default_order_is_newest_first_and_default_limit_is_50(
    client: TestClient,
    filled: Filled,  # noqa: F811
) -> None:
    body = get(client)
    assert keys_of(body) == expected_order(filled.rows, RequestFilter(), "start", True)[:50]
    assert body["next_cursor"] is not None


def test_items_have_the_request_summary_shape(client: TestClient) -> None:
    body = get(client, limit=500)
    assert set(body) == {"items", "next_cursor", "total", "total_exact"}
    assert len(body["items"]) == ROWS and body["next_cursor"] is None
    for item in body["items"]:
        assert set(item) == SUMMARY_FIELDS
        assert len(item["trace_id"]) == 32 and len(item["span_id"]) == 16
        list_route.RequestSummary.model_validate(item)


def test_pages_stay_exact_while_requests_arrive(store_location: str) -> None:
    seen: list[tuple[str, str]] = []
    with open_store(store_location) as writer, serving(store_location) as test_client:
        write(writer, [varied_record(n) for n in range(30)])
        body = get(test_client, limit=4, sort="e2e")
        newcomer = 500
        while True:
            seen.extend(keys_of(body))
            if body["next_cursor"] is None:
                break
            write(writer, [varied_record(newcomer), varied_record(newcomer + 1)])
            newcomer += 2
            body = get(test_client, limit=4, sort="e2e", cursor=body["next_cursor"])
    assert len(seen) == len(set(seen))
    original = [varied_record(n).timeline for n in range(30)]
    assert {(t.trace_id.hex(), t.span_id.hex()) for t in original} <= set(seen)


# --- bad input: 400 with one sentence -------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        {"limit": 0},
        {"limit": 501},
        {"limit": -3},
        {"limit": "ten"},
        {"sort": "itl"},
        {"order": "up"},
        {"slo_breached": "maybe"},
        {"min_e2e_ms": -1},
        {"min_e2e_ms": "nan"},
        {"min_ttft_ms": "inf"},
        {"min_ttft_ms": 1e12},
        {"q": "x" * 300},
        {"model": "m" * 300},
        {"since": -5},
        {"since": 20, "until": 10},
        {"last": "forever"},
        {"last": "1h", "since": 5},
    ],
)
def test_bad_parameters_are_400_with_one_error(client: TestClient, params: dict[str, Any]) -> None:
    response = client.get("/api/v1/requests", params=params)
    assert response.status_code == 400, (params, response.text)
    body = response.json()
    assert set(body) == {"error"} and body["error"]


def test_a_cursor_from_another_sort_or_order_is_400(client: TestClient) -> None:
    cursor = get(client, sort="ttft", limit=3)["next_cursor"]
    assert cursor is not None
    for params in ({"sort": "e2e"}, {"sort": "ttft", "order": "asc"}, {}):
        response = client.get("/api/v1/requests", params={**params, "cursor": cursor})
        assert response.status_code == 400
        assert "sort=ttft order=desc" in response.json()["error"]
    for garbage in ("abc", "eyJ4IjoxfQ", "%%%", "W10", "x" * 600):
        response = client.get("/api/v1/requests", params={"cursor": garbage})
        assert response.status_code == 400, garbage
        assert set(response.json()) == {"error"}


# --- strings are values, never SQL ------------------------------------------------------------


@pytest.mark.parametrize("value", INJECTIONS)
@pytest.mark.parametrize(
    "param", ["service", "model", "operation", "prompt_bucket", "cause", "segment", "q"]
)
def test_sql_in_string_parameters_is_inert(
    client: TestClient,
    filled: Filled,  # noqa: F811
    param: str,
    value: str,
) -> None:
    field_name = "text" if param == "q" else param
    body = get(client, **{param: value}, limit=500)
    expected = expected_order(filled.rows, RequestFilter(**{field_name: value}), "start", True)
    assert keys_of(body) == expected
    assert get(client, limit=1)["total"] == ROWS  # the table is still there, whole


def test_like_wildcards_in_q_are_literal(client: TestClient, filled: Filled) -> None:  # noqa: F811
    ids = {row.key: row.request_id for row in filled.rows}
    cases = (("a%b", {"cmpl-a%b"}), ("a_b", {"cmpl-a_b"}), ("%", {"cmpl-a%b", "cmpl-A%B"}))
    for text, wanted in cases:
        found = {ids[key] for key in keys_of(get(client, q=text, limit=500))}
        assert found == wanted, text
    assert {ids[k] for k in keys_of(get(client, q="A%B"))} == {"cmpl-A%B"}  # case-sensitive


# --- totals, limits, timeouts -------------------------------------------------------------------


def test_total_is_capped_and_says_when(
    client: TestClient,
    filled: Filled,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    llama = len(expected_order(filled.rows, RequestFilter(model=MODELS[0]), "start", True))
    for cap, exact in ((llama - 1, False), (llama, True), (llama + 5, True)):
        monkeypatch.setattr(store_query, "TOTAL_CAP", cap)
        body = get(client, model=MODELS[0], limit=5)
        assert (body["total"], body["total_exact"]) == (min(llama, cap), exact)
        unfiltered = get(client, limit=5)
        assert (unfiltered["total"], unfiltered["total_exact"]) == (cap, False)


def test_limit_bounds_are_inclusive(client: TestClient) -> None:
    assert len(get(client, limit=1)["items"]) == 1
    assert len(get(client, limit=500)["items"]) == ROWS


def test_a_query_past_its_budget_is_503(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_query, "QUERY_BUDGET_S", -1.0)
    monkeypatch.setattr(sqlite_list_query, "_PROGRESS_STEPS", 1)  # SQLite checks time this often
    response = client.get("/api/v1/requests", params={"q": "cmpl"})
    assert response.status_code == 503
    assert "took longer than" in response.json()["error"]


def test_missing_store_is_503(store_location: str) -> None:
    """No SQLite file there yet, or a PostgreSQL database without the store's tables."""
    with serving(store_location) as test_client:
        response = test_client.get("/api/v1/requests")
    assert response.status_code == 503 and set(response.json()) == {"error"}


def test_an_empty_store_lists_nothing(store_location: str) -> None:
    open_store(store_location).close()
    with serving(store_location) as test_client:
        body = get(test_client, sort="tpot", q="cmpl", model="llama")
    assert body == {"items": [], "next_cursor": None, "total": 0, "total_exact": True}


# --- the OpenAPI document -----------------------------------------------------------------------


@sqlite_only  # the document does not depend on the store
def test_openapi_describes_the_list_parameters_and_response(client: TestClient) -> None:
    document = client.get("/openapi.json").json()
    operation = document["paths"]["/api/v1/requests"]["get"]
    parameters = {p["name"]: p for p in operation["parameters"]}
    assert set(parameters) >= {
        "since", "until", "last", "service", "model", "operation", "prompt_bucket",
        "slo_breached", "cause", "segment", "min_ttft_ms", "min_e2e_ms", "q", "sort",
        "order", "limit", "cursor",
    }  # fmt: skip
    limit = parameters["limit"]["schema"]
    assert (limit["minimum"], limit["maximum"], limit["default"]) == (1, 500, 50)
    assert parameters["sort"]["schema"]["enum"] == list(store_query.SORT_KEYS)
    assert parameters["order"]["schema"]["enum"] == ["desc", "asc"]
    response = operation["responses"]["200"]["content"]["application/json"]["schema"]
    assert response == {"$ref": "#/components/schemas/RequestList"}
    summary = document["components"]["schemas"]["RequestSummary"]
    assert set(summary["properties"]) == SUMMARY_FIELDS


def test_sort_keys_of_the_route_and_the_store_agree() -> None:
    assert list(typing.get_args(list_route.SortKey)) == list(store_query.SORT_KEYS)


def test_the_summary_model_documents_the_stores_summary_fields_in_order() -> None:
    # The store's summaries (``RequestSummaryDoc``) go out as they are; the pydantic model only
    # describes them (and validates the fleet view's lists), so it must list the same fields.
    assert list(list_route.RequestSummary.model_fields) == list(RequestSummaryDoc.__annotations__)


def test_thresholds_in_ms_become_whole_ns_without_float_drift(
    client: TestClient,
    filled: Filled,  # noqa: F811
) -> None:
    e2e_ns = sorted(row.e2e_ns for row in filled.rows)[ROWS // 2]
    # 0.1 + 0.2 style drift would drop the row whose E2E equals the threshold.
    keys = keys_of(get(client, min_e2e_ms=e2e_ns / 1e6, limit=500))
    assert len(keys) == sum(row.e2e_ns >= e2e_ns for row in filled.rows)
