"""Property-based requests generated from the API's own OpenAPI document (schemathesis):
whatever the parameters, the API answers 2xx/4xx in the documented shapes, never a 5xx."""

from __future__ import annotations

from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.api.replayed import replayed_store
from tokentrace.collector.api import ApiSettings, create_app

pytestmark = pytest.mark.slow

_TOKEN = "fuzz-token"
_MAX_EXAMPLES = 40


def _store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return replayed_store(tmp_path_factory.mktemp("fuzz") / "store.db", requests=80, seed=11)


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> object:
    settings_ = ApiSettings(
        store_path=str(_store(tmp_path_factory)),
        auth_token=_TOKEN,
        trace_link="https://tempo.example/trace/{trace_id}",
    )
    return create_app(settings_)


schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.fixture(scope="module")
def api_schema(app: object) -> object:
    loaded = schemathesis.openapi.from_asgi("/openapi.json", app)
    # Valid and invalid parameters alike (wrong types, out-of-range limits, unknown enums).
    loaded.config.generation.update(
        modes=[schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]
    )
    return loaded


@schema.parametrize()
@settings(
    max_examples=_MAX_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
def test_no_server_errors_and_documented_responses(case: schemathesis.Case) -> None:
    case.call_and_validate(
        headers={"Authorization": f"Bearer {_TOKEN}"},
        checks=[
            not_a_server_error,
            status_code_conformance,
            content_type_conformance,
            response_schema_conformance,
        ],
    )
