"""Acknowledged means durable: SIGKILL the collector in the middle of a stream of exports,
restart it on the same configuration, and find every acknowledged trace in the store, once.

A real ``tokentrace collector`` process (gRPC receiver on a free port, store and spool in
tmp_path); eight sender threads export one small trace per request through the OTLP gRPC stub
and record each trace id whose export returned OK. docs/reliability.md cites this test."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub

from tests.collector_process import start_collector_process
from tests.spanbuild import request_spans
from tokentrace.agent import semconv

pytestmark = pytest.mark.slow

_INFO_LOGS = {"TOKENTRACE_LOG_LEVEL": "INFO"}
"""The collector process logs its spool replay at INFO: the test prints those lines."""
_SENDERS = 8
_SEND_BEFORE_KILL_S = 2.5
_STORED_TIMEOUT_S = 15.0


def _export(number: int) -> tuple[bytes, ExportTraceServiceRequest]:
    trace_id = number.to_bytes(16, "big")
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    attribute = resource_spans.resource.attributes.add(key=semconv.SERVICE_NAME)
    attribute.value.string_value = "durability-test"
    resource_spans.scope_spans.add().spans.extend(
        request_spans(trace_id=trace_id, start_ns=time.time_ns())
    )
    return trace_id, request


@pytest.fixture
def config(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "collector.yaml"
    path.write_text(
        "receivers:\n"
        "  otlp:\n"
        "    protocols:\n"
        "      grpc: {endpoint: 127.0.0.1:0}\n"
        "exporters:\n"
        f"  store: {{path: {tmp_path / 'store.db'}}}\n"
        "service:\n"
        "  durability: {mode: fsync}\n",
        encoding="utf-8",
    )
    yield path


def _stored(store: Path) -> tuple[set[bytes], list[bytes], list[bytes]]:
    """Trace ids in the store, those with more than one request row, and those whose stored
    spans hold a span id twice."""
    connection = sqlite3.connect(f"file:{store}?mode=ro", uri=True)
    try:
        trace_ids = {bytes(row[0]) for row in connection.execute("SELECT trace_id FROM traces")}
        doubled = [
            bytes(row[0])
            for row in connection.execute(
                "SELECT trace_id FROM requests GROUP BY trace_id HAVING count(*) > 1"
            )
        ]
        spans_twice = []
        for trace_id, otlp in connection.execute("SELECT trace_id, otlp FROM traces"):
            request = ExportTraceServiceRequest.FromString(otlp)
            span_ids = [
                span.span_id
                for resource_spans in request.resource_spans
                for scope_spans in resource_spans.scope_spans
                for span in scope_spans.spans
            ]
            if len(span_ids) != len(set(span_ids)):
                spans_twice.append(bytes(trace_id))
    finally:
        connection.close()
    return trace_ids, doubled, spans_twice


def test_sigkill_loses_no_acknowledged_trace(config: Path, tmp_path: Path) -> None:
    log_path = tmp_path / "collector.log"
    collector = start_collector_process(config, log_path, env=_INFO_LOGS)
    port = collector.grpc_port
    acknowledged: set[bytes] = set()
    lock = threading.Lock()
    stop = threading.Event()
    counter = iter(range(1, 10**9))

    def sender() -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = TraceServiceStub(channel)
            while not stop.is_set():
                with lock:
                    number = next(counter)
                trace_id, request = _export(number)
                try:
                    stub.Export(request, timeout=5)
                except grpc.RpcError:
                    if stop.is_set():
                        return
                    continue  # refused (overloaded) or killed: not acknowledged
                with lock:
                    acknowledged.add(trace_id)

    threads = [threading.Thread(target=sender, daemon=True) for _ in range(_SENDERS)]
    for thread in threads:
        thread.start()
    time.sleep(_SEND_BEFORE_KILL_S)
    collector.kill()
    stop.set()
    for thread in threads:
        thread.join(10)
    with lock:
        before_kill = set(acknowledged)
    store = tmp_path / "store.db"
    stored_at_kill = _stored(store)[0] if store.exists() else set()
    assert len(before_kill) > 50, "the senders barely ran"

    restarted = start_collector_process(config, log_path, env=_INFO_LOGS)
    try:
        deadline = time.monotonic() + _STORED_TIMEOUT_S
        present: set[bytes] = set()
        while time.monotonic() < deadline:
            present = _stored(store)[0]
            if before_kill <= present:
                break
            time.sleep(0.25)
        _, doubled, spans_twice = _stored(store)
    finally:
        exit_status = restarted.stop()
    replayed = [line for line in restarted.output.splitlines() if "spool:" in line]
    print("\n" + "\n".join(f"  collector | {line}" for line in replayed))
    missing = before_kill - present
    print(
        f"\nacknowledged before the kill: {len(before_kill)}; stored at the kill: "
        f"{len(stored_at_kill & before_kill)}; present after restart: "
        f"{len(before_kill & present)}; lost: {len(missing)}; "
        f"traces with a request row twice: {len(doubled)}; with a span twice: {len(spans_twice)}"
    )
    assert not missing, f"{len(missing)} acknowledged traces lost"
    assert not doubled
    assert not spans_twice
    assert exit_status == 0
    assert not list((tmp_path / "store.db.spool").glob("segment-*")), "clean stop: spool empty"
