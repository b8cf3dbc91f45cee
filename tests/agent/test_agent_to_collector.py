"""The agent core end to end: hot-path timers -> emitter (which sends) -> a running collector."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from tests.collector.upstream import UpstreamOtlp
from tokentrace.agent.config import load_agent_config
from tokentrace.agent.runtime import AgentRuntime
from tokentrace.collector.config import parse_config
from tokentrace.collector.service import Collector
from tokentrace.collector.store import RequestStore


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_recorded_requests_reach_the_collector_with_their_timings(
    tmp_path: Path, protocol: str
) -> None:
    collector = Collector(
        parse_config(
            {
                "receivers": {
                    "otlp": {
                        "protocols": {
                            "grpc": {"endpoint": "127.0.0.1:0"},
                            "http": {"endpoint": "127.0.0.1:0"},
                        }
                    }
                },
                "exporters": {"store": {"path": str(tmp_path / "r.db")}},
            },
            environ={},
        )
    )
    collector.start()
    port = collector.grpc_port if protocol == "grpc" else collector.http_port
    runtime = AgentRuntime(
        load_agent_config(
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
                "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
                "OTEL_SERVICE_NAME": "agent-e2e",
            }
        )
    )
    recorder = runtime.recorder
    threads_before = set(threading.enumerate())
    expected_ttft_ns = {}
    try:
        for index in range(5):
            request_id = f"cmpl-{index}"
            timer = recorder.begin(request_id)
            assert timer is not None
            timer.trace_id = os.urandom(16)
            timer.attributes.update(model="tiny", operation="text_completion", output_tokens=3)
            time.sleep(0.002)
            timer.first_scheduled_ns = recorder.clock()
            for _ in range(3):
                time.sleep(0.001)
                timer.token_ns.append(recorder.clock())
            expected_ttft_ns[request_id] = timer.token_ns[0] - timer.arrival_ns
            recorder.finish(request_id)
        # The emitter's thread exports itself: its flush means delivered, and no sender
        # thread was started beside it.
        assert runtime.emitter.flush(10.0)
        assert (
            runtime.stats()["sender.sent_spans"]
            == runtime.stats()["emitter.handed_to_sender_spans"]
            > 0
        )
        threads = {thread.name for thread in set(threading.enumerate()) - threads_before}
        assert "tokentrace-emitter" in threads
        assert not any(name.startswith("tokentrace-otlp-") for name in threads)
        collector.flush()
    finally:
        runtime.shutdown(1.0)
        collector.shutdown()
    store = RequestStore.open_readonly(tmp_path / "r.db")
    try:
        docs = store.slowest(metric="e2e", limit=10)
    finally:
        store.close()
    assert sorted(doc["request_id"] for doc in docs) == sorted(expected_ttft_ns)
    for doc in docs:
        # Monotonic readings -> Unix ns -> spans -> collector: TTFT survives to the microsecond.
        expected_ms = expected_ttft_ns[doc["request_id"]] / 1e6
        assert doc["metrics_ms"]["ttft"] == pytest.approx(expected_ms, abs=0.002)
        assert doc["tokens"]["output"] == 3
        assert doc["service"] == "agent-e2e"


def test_a_hung_endpoint_holds_the_runtimes_flush_and_shutdown_only_for_their_timeout(
    upstream: UpstreamOtlp,
) -> None:
    upstream.hold()  # accepts the export call and never answers it
    runtime = AgentRuntime(
        load_agent_config(
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": upstream.grpc_endpoint,
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                "OTEL_EXPORTER_OTLP_TIMEOUT": "30000",
            }
        )
    )
    timer = runtime.recorder.begin("cmpl-hung")
    assert timer is not None
    timer.trace_id = os.urandom(16)
    runtime.recorder.finish("cmpl-hung")
    started = time.perf_counter()
    assert not runtime.flush(2.0)  # the emitter's thread is in the held call
    flushed_s = time.perf_counter() - started
    assert upstream.started_calls == 1
    started = time.perf_counter()
    runtime.shutdown(0.5)
    shutdown_s = time.perf_counter() - started
    assert 2.0 <= flushed_s < 3.5  # the emitter's flush and the sender's share the 2 s (not 4)
    assert shutdown_s < 2.0  # cancelled the held call instead of waiting out its 30 s timeout
    stats = runtime.stats()
    assert stats["sender.dropped_spans"] >= 1 and stats["sender.sent_spans"] == 0
