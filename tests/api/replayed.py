"""A request store filled the way production fills it: simulated requests' OTLP spans posted to
a running collector's OTLP/HTTP receiver, assembled, processed and stored by its pipeline."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tokentrace.collector.config import parse_config
from tokentrace.collector.service import Collector
from tokentrace.loadgen.replay.emit import to_otlp_requests
from tokentrace.loadgen.replay.simulation import simulate

SLO_TARGETS = [
    {"name": "ttft-p95", "metric": "ttft", "percentile": 95, "threshold": "500ms"},
    {"name": "tpot-p99", "metric": "tpot", "percentile": 99, "threshold": "40ms"},
]


def collector_config(store_path: Path, *, ui: dict[str, Any] | None = None) -> dict[str, Any]:
    """A collector on free loopback ports writing ``store_path`` (plus the ui extension)."""
    raw: dict[str, Any] = {
        "receivers": {"otlp": {"protocols": {"http": {"endpoint": "127.0.0.1:0"}}}},
        "processors": {
            "assembly": {"quiet_period": "200ms", "root_grace": "50ms"},
            "slo": {"targets": SLO_TARGETS},
        },
        "exporters": {"store": {"path": str(store_path)}},
    }
    if ui is not None:
        raw["extensions"] = {"ui": ui}
    return raw


def post_scenario(collector: Collector, *, scenario: str, requests: int, seed: int) -> int:
    """Post a simulated scenario's spans to the collector's OTLP/HTTP receiver; the span count."""
    return post_messages(
        collector, to_otlp_requests(simulate(scenario, requests=requests, seed=seed))
    )


def post_messages(collector: Collector, messages: Iterable[ExportTraceServiceRequest]) -> int:
    """Post export requests to the collector's OTLP/HTTP receiver; the span count."""
    port = collector.http_port
    assert port is not None
    sent = 0
    with httpx.Client(timeout=30.0) as client:
        for message in messages:
            response = client.post(
                f"http://127.0.0.1:{port}/v1/traces",
                content=message.SerializeToString(),
                headers={"Content-Type": "application/x-protobuf"},
            )
            assert response.status_code == 200, response.text
            sent += sum(len(s.spans) for r in message.resource_spans for s in r.scope_spans)
    return sent


def replayed_store(
    store_path: Path, *, scenario: str = "mixed", requests: int = 120, seed: int = 5
) -> Path:
    """``store_path`` filled with ``requests`` requests of ``scenario``; the collector stopped."""
    collector = Collector(parse_config(collector_config(store_path), environ={}))
    collector.start()
    try:
        post_scenario(collector, scenario=scenario, requests=requests, seed=seed)
        collector.flush()
    finally:
        collector.shutdown()
    return store_path
