"""The ``admin`` extension: /healthz, /readyz and Prometheus /metrics of a real collector on
127.0.0.1, after real OTLP traffic through its receivers; /metrics is read with
prometheus-client's own text parser."""

from __future__ import annotations

import json
import re
import socket
import sqlite3
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.spanbuild import export_request, request_spans, tid
from tokentrace.agent import semconv
from tokentrace.collector.config import ConfigError, parse_config
from tokentrace.collector.service import Collector, describe_config
from tokentrace.collector.store import RequestStore

_WAIT_S = 30.0
_MODELS = ("llama-8b", "qwen-7b")
_OPERATIONS = (semconv.OPERATION_CHAT, semconv.OPERATION_TEXT_COMPLETION)
_TTFT_TARGET = "ttft-40ms"
_E2E_TARGET = "chat-e2e-100ms"
_PROMETHEUS_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")


def _config(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "receivers": {
            "otlp": {
                "protocols": {
                    "grpc": {"endpoint": "127.0.0.1:0"},
                    "http": {"endpoint": "127.0.0.1:0"},
                }
            }
        },
        "processors": {
            "assembly": {"quiet_period": "300ms", "root_grace": "50ms"},
            "slo": {
                "targets": [
                    {"name": _TTFT_TARGET, "metric": "ttft", "percentile": 90, "threshold": "40ms"},
                    {
                        "name": _E2E_TARGET,
                        "metric": "e2e",
                        "percentile": 99,
                        "threshold": "100ms",
                        "selector": {"operation": semconv.OPERATION_CHAT},
                    },
                ]
            },
        },
        "exporters": {"store": {"path": str(tmp_path / "requests.db")}},
        "extensions": {"admin": {"endpoint": "127.0.0.1:0"}},
    }
    raw.update(extra)
    return raw


@contextmanager
def _started(raw: dict[str, Any], *, shutdown_s: float = 10.0) -> Iterator[Collector]:
    collector = Collector(parse_config(raw, environ={}))
    collector.start()
    try:
        yield collector
    finally:
        collector.shutdown(shutdown_s)


@pytest.fixture
def running(tmp_path: Path) -> Iterator[Collector]:
    """A started collector with the admin extension (``_config``)."""
    with _started(_config(tmp_path)) as collector:
        yield collector


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _admin_url(collector: Collector) -> str:
    admin = collector.admin
    assert admin is not None
    return admin.url


def _send(collector: Collector, count: int, *, first: int = 1) -> list[dict[str, Any]]:
    """``count`` tokentrace requests over OTLP/HTTP, each its own trace, models and operations
    alternating, queue wait and token count growing; returns what was sent per request."""
    sent = []
    for number in range(first, first + count):
        model = _MODELS[number % len(_MODELS)]
        operation = _OPERATIONS[(number // 2) % len(_OPERATIONS)]
        tokens = 2 + number % 5
        spans = request_spans(
            trace_id=tid(number),
            queue_ns=number * 3_000_000,
            token_offsets_us=[i * 12_000 for i in range(tokens)],
            request_attrs={
                semconv.GEN_AI_REQUEST_MODEL: model,
                semconv.GEN_AI_OPERATION_NAME: operation,
            },
        )
        body = export_request(spans, service="vllm").SerializeToString()
        request = urllib.request.Request(
            f"http://127.0.0.1:{collector.http_port}/v1/traces",
            data=body,
            headers={"Content-Type": "application/x-protobuf"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200
        sent.append({"model": model, "operation": operation, "gaps": tokens - 1})
    return sent


def _scrape(collector: Collector) -> dict[str, Any]:
    status, text = _get(f"{_admin_url(collector)}/metrics")
    assert status == 200
    return {family.name: family for family in text_string_to_metric_families(text)}


def _samples(families: dict[str, Any], sample_name: str) -> list[Sample]:
    return [
        sample
        for family in families.values()
        for sample in family.samples
        if sample.name == sample_name
    ]


def _total(families: dict[str, Any], sample_name: str, **labels: str) -> float:
    return sum(
        sample.value
        for sample in _samples(families, sample_name)
        if all(sample.labels.get(key) == value for key, value in labels.items())
    )


def _snapshot_total(snapshot: dict[str, Any], key: str) -> float:
    """A counter's value in the snapshot: its key with or without a component's prefix, keyed
    counters summed over their keys."""
    total = 0.0
    for name, value in snapshot.items():
        if name == key or name.endswith(f".{key}"):
            total += sum(value.values()) if isinstance(value, dict) else value
    return total


def _wait_until(condition: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + _WAIT_S
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.mark.slow
def test_metrics_after_real_traffic_match_the_store_and_the_self_telemetry(
    running: Collector, tmp_path: Path
) -> None:
    collector = running
    sent = _send(collector, 24)
    collector.flush()
    families = _scrape(collector)

    # Latency histograms: one TTFT and E2E observation per request, per model and operation.
    ttft_count = semconv.PROM_METRIC_TTFT + "_count"
    e2e_count = semconv.PROM_METRIC_E2E + "_count"
    assert _total(families, ttft_count) == len(sent)
    assert _total(families, e2e_count) == len(sent)
    expected_per_key = Counter((r["model"], r["operation"]) for r in sent)
    for (model, operation), requests in expected_per_key.items():
        labels = {"service": "vllm", "model": model, "operation": operation}
        assert _total(families, ttft_count, **labels) == requests
        assert _total(families, semconv.PROM_METRIC_TPOT + "_count", **labels) == requests
    # ITL: one observation per inter-token gap.
    assert _total(families, semconv.PROM_METRIC_ITL + "_count") == sum(r["gaps"] for r in sent)
    ttft_buckets = _samples(families, semconv.PROM_METRIC_TTFT + "_bucket")
    assert {s.labels["le"] for s in ttft_buckets} >= {"0.005", "60.0", "+Inf"}

    # SLO counters: the verdicts the store kept, per target and outcome.
    store = RequestStore.open_readonly(tmp_path / "requests.db")
    try:
        documents = store.slowest(metric="e2e", limit=100)
    finally:
        store.close()
    assert len(documents) == len(sent)
    stored = Counter(
        (target, "good" if met else "bad")
        for doc in documents
        for target, met in doc["slo"].items()
    )
    assert stored[(_TTFT_TARGET, "good")] and stored[(_TTFT_TARGET, "bad")]  # both outcomes seen
    assert sum(n for (target, _), n in stored.items() if target == _E2E_TARGET) < len(sent)
    for target, outcome in [(t, o) for t in (_TTFT_TARGET, _E2E_TARGET) for o in ("good", "bad")]:
        exposed = _total(families, semconv.PROM_METRIC_SLO_REQUESTS, target=target, outcome=outcome)
        assert exposed == stored[(target, outcome)], (target, outcome)
    objectives = {
        s.labels["target"]: s.value for s in _samples(families, semconv.PROM_METRIC_SLO_OBJECTIVE)
    }
    assert objectives == {_TTFT_TARGET: 0.9, _E2E_TARGET: 0.99}
    thresholds = {
        s.labels["target"]: s.value for s in _samples(families, semconv.PROM_METRIC_SLO_THRESHOLD)
    }
    assert thresholds == {_TTFT_TARGET: pytest.approx(0.04), _E2E_TARGET: pytest.approx(0.1)}

    # Dominant segments: every request's verdict once, as stored.
    stored_segments = Counter(doc["verdict"]["segment"] for doc in documents)
    exposed_segments: Counter[str] = Counter()
    for sample in _samples(families, semconv.PROM_METRIC_DOMINANT_SEGMENT):
        exposed_segments[sample.labels["segment"]] += int(sample.value)
    assert exposed_segments == stored_segments
    # Budget segments: each request's partition of its E2E, so they add up to the E2E sum.
    segment_seconds = _samples(families, semconv.PROM_METRIC_SEGMENT_SECONDS)
    assert {s.labels["segment"] for s in segment_seconds} >= {"queue", "prefill", "decode"}
    assert sum(s.value for s in segment_seconds) == pytest.approx(
        _total(families, semconv.PROM_METRIC_E2E + "_sum"), rel=1e-9
    )

    # Self-telemetry: each counter equals the snapshot's (read before and after the scrape, so
    # a counter that moved in between, e.g. a background checkpoint, is left out).
    before = collector.stats()
    families = _scrape(collector)
    after = collector.stats()
    compared = 0
    for family in families.values():
        if family.type != "counter" or not family.name.startswith("tokentrace_collector_"):
            continue
        key = family.name.removeprefix("tokentrace_collector_")
        if _snapshot_total(before, key) != _snapshot_total(after, key):
            continue
        exposed_total = sum(s.value for s in family.samples if s.name.endswith("_total"))
        assert exposed_total == _snapshot_total(after, key), family.name
        compared += 1
    assert compared >= 20
    assert _total(families, "tokentrace_collector_received_spans_total") == len(sent) * 6
    assert after["received_spans"] == len(sent) * 6
    http_accepted = _total(families, "tokentrace_collector_accepted_spans_total", transport="http")
    assert http_accepted == after["OtlpHttpReceiver.accepted_spans"] == len(sent) * 6
    # The store's write latency: one observation per batch it was handed.
    store_batches = _total(
        families,
        semconv.prometheus_name(
            semconv.SELF_METRIC_EXPORT_DURATION, unit=semconv.METRIC_UNIT_SECONDS, counter=False
        )
        + "_count",
        component_id="store",
    )
    assert 1 <= store_batches <= len(sent)


@pytest.mark.slow
def test_every_exposed_family_follows_the_conventions_and_is_documented(
    running: Collector,
) -> None:
    _send(running, 3)
    running.flush()
    families = _scrape(running)
    documented = {name: kind for name, kind, _, _ in semconv.prometheus_metrics()}
    for family in families.values():
        assert _PROMETHEUS_NAME.match(family.name), family.name
        assert family.name.startswith("tokentrace_"), family.name
        for sample in family.samples:
            assert "." not in sample.name
            for label in sample.labels:
                assert _PROMETHEUS_NAME.match(label), (family.name, label)
        if family.type == "counter":
            assert all(s.name == f"{family.name}_total" for s in family.samples), family.name
            assert documented.get(f"{family.name}_total") == "counter", family.name
        else:
            assert documented.get(family.name) == family.type, family.name
        if family.type == "histogram":
            assert family.name.endswith("_seconds"), family.name
    # Units in names where there is one: the spool's and the memory's bytes, durations.
    assert "tokentrace_collector_spool_bytes" in families
    assert "tokentrace_collector_memory_resident_bytes" in families
    assert "tokentrace_collector_batch_duration_seconds" in families


@pytest.mark.slow
def test_health_and_readiness_of_a_running_collector(running: Collector) -> None:
    url = _admin_url(running)
    assert _get(f"{url}/healthz") == (200, "ok\n")
    status, body = _get(f"{url}/readyz")
    assert status == 200
    answer = json.loads(body)
    assert answer["ready"] is True
    assert set(answer["checks"]) == {"receivers", "exporter store", "memory_limiter"}
    assert f":{running.http_port}" in answer["checks"]["receivers"]["detail"]
    assert _get(f"{url}/nothing-here")[0] == 404


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _unreachable_upstream(tmp_path: Path) -> dict[str, Any]:
    raw = _config(tmp_path)
    raw["exporters"]["otlp"] = {
        # Nothing listens there: every send fails and is retried while the queue fills up.
        "endpoint": f"http://127.0.0.1:{_free_port()}",
        "protocol": "http/protobuf",
        "max_batch_spans": 6,
        "sending_queue": {"queue_size": 24},
        # The batch in flight waits out its backoff for the whole test: the queue stays full.
        "retry_on_failure": {
            "initial_interval": "60s",
            "max_interval": "60s",
            "max_elapsed_time": "600s",
        },
        "metrics_interval": "1h",
    }
    return raw


@pytest.mark.slow
def test_readyz_fails_while_an_unreachable_upstream_fills_its_queue(tmp_path: Path) -> None:
    # A short shutdown: the sender gives up its queue at once instead of waiting out the backoff.
    with _started(_unreachable_upstream(tmp_path), shutdown_s=1.0) as collector:
        url = _admin_url(collector)
        status, body = _get(f"{url}/readyz")
        assert status == 200, body  # nothing queued yet: buffering is fine

        # Traffic while the upstream is down: one batch in flight (waiting out its backoff), the
        # queue fills, the rest is dropped. In waves, because how soon the sender gives up a
        # batch it could not send at all is the transport's business.
        statuses = []
        for wave in range(10):
            _send(collector, 5, first=1 + 5 * wave)
            collector.flush()
            statuses.append(_get(f"{url}/readyz")[0])
            if statuses[-1] == 503:
                break
        assert statuses[-1] == 503, statuses
        answer = json.loads(_get(f"{url}/readyz")[1])
        assert _get(f"{url}/healthz")[0] == 200  # alive all the same
    upstream = answer["checks"]["exporter otlp"]
    assert upstream["ok"] is False
    assert "send queue full (24 of 24 spans queued" in upstream["detail"]
    assert answer["checks"]["exporter store"]["ok"] is True


@pytest.mark.slow
def test_readyz_fails_while_the_store_cannot_write_and_recovers(
    running: Collector, tmp_path: Path
) -> None:
    url = _admin_url(running)
    # Another connection holds the database's write lock: the store's next write waits its
    # busy timeout, then fails as a locked database does.
    blocker = sqlite3.connect(tmp_path / "requests.db", timeout=0, isolation_level=None)
    try:
        blocker.execute("BEGIN EXCLUSIVE")
        _send(running, 1)

        def store_check() -> dict[str, Any]:
            checks: dict[str, Any] = json.loads(_get(f"{url}/readyz")[1])["checks"]
            return checks["exporter store"]

        assert _wait_until(lambda: not store_check()["ok"])
        assert "the last batch was not stored" in store_check()["detail"]
        assert "locked" in store_check()["detail"]
    finally:
        blocker.rollback()
        blocker.close()
    _send(running, 1, first=2)
    assert _wait_until(lambda: _get(f"{url}/readyz")[0] == 200)


@pytest.mark.slow
def test_readyz_fails_once_shutdown_begins(tmp_path: Path) -> None:
    collector = Collector(parse_config(_config(tmp_path), environ={}))
    collector.start()
    try:
        assert [check.ok for check in collector.readiness()] == [True, True, True]
    finally:
        collector.shutdown()
    (check,) = collector.readiness()
    assert (check.ok, check.detail) == (False, "shutting down")


def test_admin_config_defaults_validation_and_description(tmp_path: Path) -> None:
    raw = {"extensions": {"admin": None}, "exporters": {"store": {"path": "x.db"}}}
    config = parse_config(raw, environ={})
    assert config.admin is not None
    assert config.admin.endpoint == "127.0.0.1:13133"
    assert config.admin.max_label_sets == 100
    assert any(
        "http://127.0.0.1:13133/healthz, /readyz, /metrics" in line
        for line in describe_config(config)
    )
    # Off by default: no admin extension without configuration.
    assert parse_config({}, environ={}).admin is None
    # Listed in service.extensions without a section: the defaults.
    listed = parse_config({"service": {"extensions": ["admin"]}}, environ={})
    assert listed.admin is not None
    with pytest.raises(ConfigError, match=r"^extensions\.admin\.endpoint: expected HOST:PORT"):
        parse_config({"extensions": {"admin": {"endpoint": "13133"}}}, environ={})
    with pytest.raises(ConfigError, match=r"^extensions\.admin\.max_label_sets: 0 is outside"):
        parse_config({"extensions": {"admin": {"max_label_sets": 0}}}, environ={})
    with pytest.raises(ConfigError, match=r"^extensions\.admin\.auth_token: unknown key"):
        parse_config({"extensions": {"admin": {"auth_token": "x"}}}, environ={})


def test_label_sets_past_the_cap_are_counted_as_other() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from tests.spanbuild import trace
    from tokentrace.collector.exporters.prometheus_sink import PrometheusSink
    from tokentrace.collector.pipeline import ProcessedTrace
    from tokentrace.processors.budget import request_record
    from tokentrace.processors.timeline import normalize

    registry = CollectorRegistry()
    sink = PrometheusSink(registry, max_label_sets=2)
    batch = []
    for number, model in enumerate(("a", "b", "c", "d"), start=1):
        spans = request_spans(
            trace_id=tid(number), request_attrs={semconv.GEN_AI_REQUEST_MODEL: model}
        )
        assembled = trace(*spans, trace_id=tid(number))
        records = [request_record(timeline) for timeline in normalize(assembled)]
        batch.append(ProcessedTrace(assembled, records))
    sink.export_traces(batch)
    families = {
        f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())
    }
    models = Counter(
        s.labels["model"]
        for s in _samples(families, semconv.PROM_METRIC_E2E + "_count")
        for _ in range(int(s.value))
    )
    assert models == {"a": 1, "b": 1, semconv.PROM_OVERFLOW_LABEL_VALUE: 2}
    assert _total(families, semconv.PROM_METRIC_LABEL_SETS_OVERFLOWED) == 2
