"""The Grafana dashboard (deploy/grafana/tokentrace.json) against a real Prometheus scraping a real
collector and a real node agent: requests go through the node agent (GPU samples read through the
real pynvml from the NVML stand-in) into the collector, Prometheus scrapes both admin endpoints,
and every query of every panel returns data."""

from __future__ import annotations

import json
import math
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.collector.upstream import UpstreamOtlp
from tests.node.nvml_stand_in import NvmlStandIn
from tests.prometheus_server import running_prometheus
from tests.spanbuild import export_request, request_spans, tid
from tokentrace.agent import semconv
from tokentrace.agent.node.sampler import NvmlSampler
from tokentrace.agent.node.service import NodeAgent, NodeAgentConfig
from tokentrace.agent.otlp_config import OtlpExporterConfig
from tokentrace.collector.config import parse_config
from tokentrace.collector.service import Collector

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "tokentrace.json"
_VARIABLES = ("service", "model", "operation")
_WINDOW = "5m"
"""What ``$__rate_interval`` and ``$__range`` stand for here: longer than the test, so every
rate covers all its samples."""
_MODELS = ("llama-8b", "qwen-7b")
_OPERATIONS = (semconv.OPERATION_CHAT, semconv.OPERATION_TEXT_COMPLETION)
_SPANS_PER_REQUEST = 6
_REQUESTS_PER_WAVE = 12
_WAIT_S = 60.0


def load_dashboard() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return dashboard


def panel_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel."""
    return [
        (panel["title"], target["expr"])
        for panel in dashboard["panels"]
        if panel["type"] != "row"
        for target in panel["targets"]
    ]


def concrete(expr: str) -> str:
    """A panel's query as Grafana sends it with every variable at "All"."""
    expr = expr.replace("$__rate_interval", _WINDOW).replace("$__range", _WINDOW)
    for name in _VARIABLES:
        expr = expr.replace(f"${name}", ".*")
    assert "$" not in expr, expr
    return expr


# --- the JSON alone ---------------------------------------------------------------------------
def test_the_dashboard_is_importable_and_every_panel_uses_the_datasource_variable() -> None:
    dashboard = load_dashboard()
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in _VARIABLES:
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    occupied: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        cells = {
            (grid["x"] + dx, grid["y"] + dy) for dx in range(grid["w"]) for dy in range(grid["h"])
        }
        assert not cells & occupied, f"{panel['title']} overlaps another panel"
        occupied |= cells
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


def test_the_dashboard_reads_the_request_and_gpu_metrics_the_issue_names() -> None:
    queries = " ".join(expr for _, expr in panel_queries(load_dashboard()))
    used = set(re.findall(r"\btokentrace_[a-z0-9_]+", queries))
    for name in (
        semconv.PROM_METRIC_TTFT,
        semconv.PROM_METRIC_TPOT,
        semconv.PROM_METRIC_ITL,
        semconv.PROM_METRIC_E2E,
        semconv.PROM_METRIC_SLO_REQUESTS,
        semconv.PROM_METRIC_SLO_OBJECTIVE,
        semconv.PROM_METRIC_SLO_THRESHOLD,
        semconv.PROM_METRIC_SEGMENT_SECONDS,
        semconv.PROM_METRIC_DOMINANT_SEGMENT,
        semconv.PROM_METRIC_GPU_UTILIZATION,
        semconv.PROM_METRIC_GPU_MEMORY_BANDWIDTH_UTILIZATION,
    ):
        assert any(u == name or u.startswith(f"{name}_") for u in used), name


# --- against a real Prometheus ------------------------------------------------------------------
def _collector_config(tmp_path: Path, upstream: UpstreamOtlp) -> dict[str, Any]:
    return {
        "receivers": {"otlp": {"protocols": {"grpc": {"endpoint": "127.0.0.1:0"}}}},
        "processors": {
            "assembly": {"quiet_period": "300ms", "root_grace": "50ms"},
            "slo": {
                "targets": [
                    {"name": "ttft-40ms", "metric": "ttft", "percentile": 90, "threshold": "40ms"},
                    {"name": "tpot-15ms", "metric": "tpot", "percentile": 95, "threshold": "15ms"},
                    {"name": "itl-20ms", "metric": "itl", "percentile": 99, "threshold": "20ms"},
                    {"name": "e2e-150ms", "metric": "e2e", "percentile": 99, "threshold": "150ms"},
                ]
            },
        },
        "exporters": {
            "store": {"path": str(tmp_path / "requests.db")},
            "otlp": {"endpoint": upstream.grpc_endpoint, "tls": {"insecure": True}},
        },
        "extensions": {"admin": {"endpoint": "127.0.0.1:0"}},
    }


def _post(agent: NodeAgent, number: int, *, start_ns: int) -> None:
    """One request's spans through the node agent's OTLP/HTTP receiver, queue and token count
    growing with ``number`` (so some requests breach each target and some do not)."""
    http = next(r for r in agent.receivers if type(r).__name__ == "OtlpHttpReceiver")
    tokens = 2 + number % 5
    spans = request_spans(
        trace_id=tid(number),
        start_ns=start_ns,
        queue_ns=number * 3_000_000,
        token_offsets_us=[i * (8_000 + 1_000 * (number % 10)) for i in range(tokens)],
        request_attrs={
            semconv.GEN_AI_REQUEST_MODEL: _MODELS[number % len(_MODELS)],
            semconv.GEN_AI_OPERATION_NAME: _OPERATIONS[(number // 2) % len(_OPERATIONS)],
        },
    )
    assert len(spans) == _SPANS_PER_REQUEST
    request = urllib.request.Request(
        f"http://127.0.0.1:{http.port}/v1/traces",
        data=export_request(spans, service="vllm").SerializeToString(),
        headers={"Content-Type": "application/x-protobuf"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


@pytest.fixture
def collector(tmp_path: Path, upstream: UpstreamOtlp) -> Iterator[Collector]:
    collector = Collector(parse_config(_collector_config(tmp_path, upstream), environ={}))
    collector.start()
    try:
        yield collector
    finally:
        collector.shutdown(10.0)


@pytest.fixture
def node_agent(collector: Collector, nvml: NvmlStandIn) -> Iterator[NodeAgent]:
    nvml.set(0, "gpu_util", 70)
    nvml.set(1, "gpu_util", 20)
    sampler = NvmlSampler(interval_s=0.1)  # not opened here: the node agent starts it
    config = NodeAgentConfig(
        grpc_endpoint="127.0.0.1:0",
        http_endpoint="127.0.0.1:0",
        exporter=OtlpExporterConfig(
            endpoint=f"http://127.0.0.1:{collector.grpc_port}", protocol="grpc"
        ),
        admin_endpoint="127.0.0.1:0",
    )
    agent = NodeAgent(config, sampler=sampler, environ={"K8S_NODE_NAME": "gpu-node-1"})
    agent.start()
    try:
        yield agent
    finally:
        agent.shutdown(2.0)


@pytest.mark.slow
def test_every_panel_query_returns_data_from_a_real_prometheus(
    tmp_path: Path, collector: Collector, node_agent: NodeAgent
) -> None:
    admin = collector.admin
    assert admin is not None and node_agent.admin_port is not None
    jobs = {
        "tokentrace-collector": [f"127.0.0.1:{admin.port}"],
        "tokentrace-node-agent": [f"127.0.0.1:{node_agent.admin_port}"],
    }
    with running_prometheus(tmp_path / "prometheus", jobs) as prometheus:
        # Two waves a few scrapes apart: every counter has moved between two samples.
        for wave in range(2):
            start_ns = time.time_ns() - 10**9
            for number in range(1, _REQUESTS_PER_WAVE + 1):
                _post(node_agent, wave * _REQUESTS_PER_WAVE + number, start_ns=start_ns)
            requests = (wave + 1) * _REQUESTS_PER_WAVE
            stored = prometheus.wait_for(
                f"sum({semconv.PROM_METRIC_E2E}_count) >= {requests}", timeout_s=_WAIT_S
            )
            assert stored, f"Prometheus never saw {requests} requests: {prometheus.targets()}"
        time.sleep(2.5)  # two more scrapes after the last change
        assert {t["health"] for t in prometheus.targets()} == {"up"}, prometheus.targets()

        empty = []
        for title, expr in panel_queries(load_dashboard()):
            result = prometheus.query(concrete(expr))
            if not result:
                empty.append(f"{title}: {expr}")
                continue
            if "histogram_quantile" in expr and "tokentrace_request_" in expr:
                values = [float(sample["value"][1]) for sample in result]
                assert all(math.isfinite(v) and v > 0 for v in values), (title, result)
        assert not empty, "panels whose query returned nothing:\n" + "\n".join(empty)

        # The panels show what was sent: every request counted, the GPUs as the stand-in set them.
        total = prometheus.query(f"sum({semconv.PROM_METRIC_E2E}_count)")
        assert float(total[0]["value"][1]) == 2 * _REQUESTS_PER_WAVE
        utilisation = {
            sample["metric"]["gpu_uuid"]: float(sample["value"][1])
            for sample in prometheus.query(semconv.PROM_METRIC_GPU_UTILIZATION)
        }
        assert sorted(utilisation.values()) == [0.2, 0.7]
