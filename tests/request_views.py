"""What every engine's stored request must show the way a vLLM request does: ``tokentrace
explain`` (text and JSON) and the API the UI's request page reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tokentrace.agent import semconv
from tokentrace.agent.cli import main as tokentrace_main
from tokentrace.collector.api.app import API_PREFIX, ApiSettings, create_app

_EXPLAINED_SEGMENTS = ("http", "queue", "prefill", "decode", "postprocess")


def shown_like_vllm(
    store_path: Path, trace_id: str, capsys: pytest.CaptureFixture[str]
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(explain's text, explain's JSON, the API's request detail) of a stored request, once each
    shows the vLLM span tree: every segment on explain, a verdict about a known segment, the
    waterfall's engine segments and the request's phase spans."""
    capsys.readouterr()
    assert tokentrace_main(["explain", trace_id, "--store", str(store_path)]) == 0
    text = capsys.readouterr().out
    for segment in _EXPLAINED_SEGMENTS:
        assert f"\n{segment} " in text, text
    assert tokentrace_main(["explain", trace_id, "--store", str(store_path), "--json"]) == 0
    explained: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert explained["trace_id"] == trace_id
    assert explained["verdict"]["segment"] in semconv.SEGMENTS
    client = TestClient(create_app(ApiSettings(store_path=str(store_path))))
    response = client.get(f"{API_PREFIX}/requests/{trace_id}")
    assert response.status_code == 200, response.text
    detail: dict[str, Any] = response.json()
    assert detail["request"]["trace_id"] == trace_id
    assert {row["segment"] for row in detail["waterfall"]} >= {
        semconv.SEGMENT_HTTP,
        semconv.SEGMENT_QUEUE,
        semconv.SEGMENT_PREFILL,
        semconv.SEGMENT_DECODE,
    }
    names = {span["name"] for span in detail["spans"]}
    assert {semconv.SPAN_REQUEST, semconv.SPAN_QUEUE, semconv.SPAN_DECODE} <= names
    return text, explained, detail
