"""The detail response's ``request`` and ``verdict`` are typed by the request document's model
(``store.document``): the OpenAPI schema lists the document's fields, every stored shape passes
the response validation, and the JSON is byte for byte what it was untyped."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.collector.test_document_types import shaped_records
from tests.collector.test_store import BASE_NS, write_records
from tokentrace.agent import semconv
from tokentrace.collector.api.app import ApiSettings, create_app
from tokentrace.collector.api.detail_route import RequestDetail
from tokentrace.collector.api.request_view import request_view
from tokentrace.collector.store import RequestStore, record_to_dict
from tokentrace.collector.store.document import RequestDocument, VerdictDoc

jsonschema = pytest.importorskip("jsonschema")

METRICS = (None, *semconv.VERDICT_METRICS)


class UntypedDetail(RequestDetail):
    """The detail model as it was before the document had a type."""

    request: dict[str, Any]  # type: ignore[assignment]
    verdict: dict[str, Any] | None  # type: ignore[assignment]


def _untyped_json(view: dict[str, Any]) -> bytes:
    return UntypedDetail.model_validate(view).model_dump_json().encode()


@pytest.mark.parametrize("name", list(shaped_records()))
@pytest.mark.parametrize("metric", METRICS)
def test_the_typed_model_serialises_every_document_unchanged(name: str, metric: str | None) -> None:
    doc = record_to_dict(shaped_records()[name])
    view = request_view(doc, None, metric=metric, itl_outlier_ratio=3.0)
    typed = RequestDetail.model_validate(view).model_dump_json().encode()
    assert typed == _untyped_json(view)
    assert json.loads(typed)["request"] == json.loads(json.dumps(doc))


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    path = tmp_path / "store.db"
    store = RequestStore(path, clock=lambda: BASE_NS / 1e9)
    write_records(store, *shaped_records().values())
    store.close()
    return path


@pytest.fixture
def client(store_path: Path) -> Iterator[TestClient]:
    with TestClient(create_app(ApiSettings(store_path=str(store_path)))) as test_client:
        yield test_client


def test_stored_shapes_answer_the_untyped_bytes_and_conform_to_the_schema(
    client: TestClient, store_path: Path
) -> None:
    openapi = client.get("/openapi.json").json()
    validator = jsonschema.Draft202012Validator(
        {"$ref": "#/components/schemas/RequestDetail", "components": openapi["components"]}
    )
    store = RequestStore.open_readonly(store_path)
    diagnosis = store.diagnosis_settings()
    for record in shaped_records().values():
        trace_id = record.timeline.trace_id.hex()
        doc = store.get(trace_id)
        assert doc is not None
        for metric in METRICS:
            params = {} if metric is None else {"metric": metric}
            response = client.get(f"/api/v1/requests/{trace_id}", params=params)
            assert response.status_code == 200, response.text
            view = request_view(
                doc,
                store.trace_otlp(trace_id),
                metric=metric,
                itl_outlier_ratio=diagnosis.itl_outlier_ratio,
            )
            assert response.content == _untyped_json(view)
            validator.validate(response.json())


def test_openapi_lists_the_documents_fields(client: TestClient) -> None:
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    detail = schemas["RequestDetail"]["properties"]
    assert detail["request"]["$ref"] == "#/components/schemas/RequestDocument"
    assert {"$ref": "#/components/schemas/VerdictDoc"} in detail["verdict"]["anyOf"]
    document = schemas["RequestDocument"]
    assert list(document["properties"]) == list(RequestDocument.__annotations__)
    assert set(document["required"]) == RequestDocument.__required_keys__
    verdict = schemas["VerdictDoc"]
    assert list(verdict["properties"]) == list(VerdictDoc.__annotations__)
    assert "why" not in verdict["required"]
    assert schemas["TimelineDoc"]["properties"]["boundaries_ms"] == {
        "$ref": "#/components/schemas/BoundariesDoc"
    }
    assert "required" not in schemas["BoundariesDoc"]  # only the instants a request has
