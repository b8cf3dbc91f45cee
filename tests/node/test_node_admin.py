"""The node agent's admin listener (``--admin-endpoint``): /healthz, /readyz and Prometheus
/metrics of a real node agent on 127.0.0.1, after real OTLP traffic through its receivers and
GPU samples read through the real pynvml from the NVML stand-in."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.collector.upstream import UpstreamOtlp
from tests.node.nvml_stand_in import NvmlStandIn
from tests.spanbuild import export_request, request_spans, tid
from tokentrace.agent import semconv
from tokentrace.agent.node.sampler import NvmlSampler
from tokentrace.agent.node.service import NodeAgent, NodeAgentConfig
from tokentrace.agent.otlp_config import OtlpExporterConfig

_PROMETHEUS_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_SPANS_PER_REQUEST = 6


@contextmanager
def _running(upstream: UpstreamOtlp, sampler: NvmlSampler, **options: Any) -> Iterator[NodeAgent]:
    config = NodeAgentConfig(
        grpc_endpoint="127.0.0.1:0",
        http_endpoint="127.0.0.1:0",
        exporter=OtlpExporterConfig(endpoint=upstream.grpc_endpoint, protocol="grpc"),
        admin_endpoint="127.0.0.1:0",
        **options,
    )
    agent = NodeAgent(config, sampler=sampler, environ={"K8S_NODE_NAME": "gpu-node-3"})
    agent.start()
    try:
        yield agent
    finally:
        agent.shutdown(2.0)


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _url(agent: NodeAgent, path: str) -> str:
    return f"http://127.0.0.1:{agent.admin_port}{path}"


def _post(agent: NodeAgent, number: int, *, start_ns: int) -> None:
    http = next(r for r in agent.receivers if type(r).__name__ == "OtlpHttpReceiver")
    spans = request_spans(trace_id=tid(number), start_ns=start_ns)
    assert len(spans) == _SPANS_PER_REQUEST
    request = urllib.request.Request(
        f"http://127.0.0.1:{http.port}/v1/traces",
        data=export_request(spans).SerializeToString(),
        headers={"Content-Type": "application/x-protobuf"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


def _scrape(agent: NodeAgent) -> dict[str, Any]:
    status, text = _get(_url(agent, "/metrics"))
    assert status == 200
    return {family.name: family for family in text_string_to_metric_families(text)}


def _value(families: dict[str, Any], sample_name: str, **labels: str) -> float:
    (value,) = [
        sample.value
        for family in families.values()
        for sample in family.samples
        if sample.name == sample_name and all(sample.labels.get(k) == v for k, v in labels.items())
    ]
    return float(value)


@pytest.mark.slow
def test_metrics_after_real_traffic_count_the_relay_and_show_each_gpu(
    nvml: NvmlStandIn, upstream: UpstreamOtlp
) -> None:
    nvml.set(0, "gpu_util", 70)
    nvml.set(1, "gpu_util", 20)
    nvml.set(1, "power_mw", 250_000)
    sampler = NvmlSampler()
    assert sampler.open()
    requests = 4
    with _running(upstream, sampler) as agent:
        window_start = time.time_ns() - 10**9
        sampler.sample_once()  # covers the windows: nothing is held back
        for number in range(1, requests + 1):
            _post(agent, number, start_ns=window_start)
        spans = requests * _SPANS_PER_REQUEST
        assert upstream.wait_for_spans(spans)
        assert upstream.wait_for(lambda: agent.stats()["sender.sent_spans"] == spans)
        families = _scrape(agent)
        stats = agent.stats()

    assert _value(families, semconv.PROM_METRIC_NODE_RECEIVED_SPANS) == spans
    assert _value(families, semconv.PROM_METRIC_NODE_RELAYED_SPANS) == spans
    assert _value(families, semconv.PROM_METRIC_NODE_SENT_SPANS) == spans
    for reason in ("invalid", "hold_queue_full", "upstream", "upstream_rejected"):
        assert _value(families, semconv.PROM_METRIC_NODE_DROPPED_SPANS, reason=reason) == 0
    assert _value(families, semconv.PROM_METRIC_NODE_HELD_SPANS) == 0
    assert _value(families, semconv.PROM_METRIC_NODE_HOLD_CAPACITY) == 100_000
    assert _value(families, semconv.PROM_METRIC_NODE_SAMPLES) == stats["sampler.ticks"] >= 1
    # Each GPU's latest sample, in base units.
    for device, utilization, watts in ((0, 0.7, 300.0), (1, 0.2, 250.0)):
        gpu = sampler.devices[device]
        latest = sampler.ring(gpu.uuid).latest()
        assert latest is not None
        labels = {"gpu_uuid": gpu.uuid, "gpu_name": gpu.name}
        assert _value(families, semconv.PROM_METRIC_GPU_UTILIZATION, **labels) == utilization
        assert _value(families, semconv.PROM_METRIC_GPU_POWER, **labels) == watts
        assert _value(families, semconv.PROM_METRIC_GPU_MEMORY_USED, **labels) == (
            latest.memory_used_bytes
        )
        assert _value(families, semconv.PROM_METRIC_GPU_MEMORY_TOTAL, **labels) == (
            gpu.memory_total_bytes
        )
        assert _value(families, semconv.PROM_METRIC_GPU_SM_CLOCK, **labels) == 1755e6
        ratio = _value(families, semconv.PROM_METRIC_GPU_MEMORY_BANDWIDTH_UTILIZATION, **labels)
        assert 0 < ratio <= 1
        assert ratio == pytest.approx(latest.memory_bandwidth_bps / gpu.peak_bandwidth_bps)

    # Names: Prometheus conventions, each documented in the telemetry contract.
    documented = {name: kind for name, kind, _, _ in semconv.prometheus_metrics()}
    assert families
    for family in families.values():
        assert _PROMETHEUS_NAME.match(family.name) and family.name.startswith("tokentrace_node_")
        if family.type == "counter":
            assert all(s.name == f"{family.name}_total" for s in family.samples)
            assert documented[f"{family.name}_total"] == "counter"
        else:
            assert documented[family.name] == family.type


@pytest.mark.slow
def test_readyz_follows_the_hold_queue_and_healthz_stays_up(
    nvml: NvmlStandIn, upstream: UpstreamOtlp
) -> None:
    sampler = NvmlSampler()
    assert sampler.open()
    sampler.sample_once()
    # Spans ending a minute from now wait for samples that will not come in time.
    with _running(upstream, sampler, max_hold_s=60.0, max_held_spans=_SPANS_PER_REQUEST) as agent:
        status, body = _get(_url(agent, "/readyz"))
        assert status == 200, body
        checks = json.loads(body)["checks"]
        assert set(checks) == {"receivers", "upstream", "hold_queue"}
        assert all(check["ok"] for check in checks.values())
        _post(agent, 1, start_ns=time.time_ns() + 60 * 10**9)
        status, body = _get(_url(agent, "/readyz"))
        assert status == 503
        hold = json.loads(body)["checks"]["hold_queue"]
        assert hold == {"ok": False, "detail": "hold queue full (6 of 6 spans held)"}
        assert _get(_url(agent, "/healthz")) == (200, "ok\n")
        assert _value(_scrape(agent), semconv.PROM_METRIC_NODE_HELD_SPANS) == 6
        agent_ref = agent
    # Shut down: the listener is gone with the agent.
    assert agent_ref.admin_port is None
    assert agent_ref.shutting_down


def test_the_admin_endpoint_comes_from_the_flag_or_the_variable() -> None:
    from tokentrace.agent.node_cli import NodeAgentCommand, config_from_args

    parser = argparse.ArgumentParser()
    NodeAgentCommand().add_arguments(parser)
    assert config_from_args(parser.parse_args([]), {}).admin_endpoint is None
    variable = {"TOKENTRACE_NODE_ADMIN_ENDPOINT": "10.0.0.7:13133"}
    assert config_from_args(parser.parse_args([]), variable).admin_endpoint == "10.0.0.7:13133"
    flagged = parser.parse_args(["--admin-endpoint", "127.0.0.1:9100"])
    assert config_from_args(flagged, variable).admin_endpoint == "127.0.0.1:9100"
    off = parser.parse_args(["--admin-endpoint", "off"])
    assert config_from_args(off, variable).admin_endpoint is None
    with pytest.raises(ValueError, match=r"^admin_endpoint: expected HOST:PORT"):
        config_from_args(parser.parse_args(["--admin-endpoint", "13133"]), {})


def test_the_node_agent_loads_prometheus_client_only_for_the_admin_endpoint() -> None:
    code = (
        "import sys\n"
        "import tokentrace.agent.node.service, tokentrace.agent.node_cli\n"
        "print('prometheus_client' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"
