"""Two collector replicas on one real PostgreSQL store, fed by trace id, answer like one
collector on SQLite fed the same traffic: the same request rows (budgets, verdicts, metrics),
percentiles and SLO figures, including for traces whose late client span reached the other
replica (the shared store joins it to the spans the first one stored).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import grpc
from fastapi.testclient import TestClient
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub

from tests.stored_requests import all_time_report
from tokentrace.agent import semconv
from tokentrace.agent.node.routing import EndpointHashes, split_by_owner
from tokentrace.collector.api import ApiSettings, create_app
from tokentrace.collector.config import parse_config
from tokentrace.collector.service import Collector
from tokentrace.collector.store import RequestPageQuery, open_store_readonly
from tokentrace.collector.store.contract import STATS_WRITTEN_AT, merge_collector_stats
from tokentrace.loadgen.replay.emit import to_otlp_requests
from tokentrace.loadgen.replay.simulation import simulate

REQUESTS = 240
SPLIT_EVERY = 5
"""Every fifth trace's client span goes to the replica that does not own the trace, late."""
CLIENT_SERVICE = "tokentrace-replay-client"
TARGETS = [
    {"name": "ttft-p95", "metric": "ttft", "percentile": 95, "threshold": "400ms"},
    {"name": "e2e-p90", "metric": "e2e", "percentile": 90, "threshold": "3s"},
]


def _collector(store: str) -> Collector:
    raw = {
        "receivers": {"otlp": {"protocols": {"grpc": {"endpoint": "127.0.0.1:0"}}}},
        "processors": {
            "assembly": {"quiet_period": "200ms", "root_grace": "50ms"},
            "slo": {"targets": TARGETS},
        },
        "exporters": {"store": {"path": store}},
        "service": {"durability": {"mode": "none"}},
    }
    return Collector(parse_config(raw, environ={}))


@contextmanager
def _running(stores: Sequence[str]) -> Iterator[list[Collector]]:
    with ExitStack() as stack:
        collectors = []
        for store in stores:
            collector = _collector(store)
            collector.start()
            stack.callback(collector.shutdown)
            collectors.append(collector)
        yield collectors


def _send(collector: Collector, request: ExportTraceServiceRequest) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{collector.grpc_port}") as channel:
        TraceServiceStub(channel).Export(request, timeout=30)


def _split(
    request: ExportTraceServiceRequest, owner: Callable[[bytes, bool], int], parts: int
) -> list[ExportTraceServiceRequest]:
    """``request`` as one request per destination: ``owner(trace_id, is_client_span)``; the
    node agent's relay splits the same way (``split_by_owner``), a client span's resource
    apart so that it can be held back."""
    out = [ExportTraceServiceRequest() for _ in range(parts)]
    for resource_spans in request.resource_spans:
        client = any(
            kv.key == semconv.SERVICE_NAME and kv.value.string_value == CLIENT_SERVICE
            for kv in resource_spans.resource.attributes
        )
        alone = ExportTraceServiceRequest(resource_spans=[resource_spans])
        split = split_by_owner(alone, lambda trace_id, c=client: str(owner(trace_id, c)))
        for destination, (part, _spans) in split.items():
            out[int(destination)].resource_spans.extend((part or alone).resource_spans)
    return out


_ROUTER = EndpointHashes(["replica-0", "replica-1"])


def _replica_of(trace_id: bytes) -> int:
    """The replica the node agent's trace-ID routing picks (rendezvous hashing)."""
    return int(_ROUTER.owner(trace_id).rsplit("-", 1)[1])


def _is_split(trace_id: bytes) -> bool:
    return int.from_bytes(hashlib.blake2b(trace_id, digest_size=2).digest()) % SPLIT_EVERY == 0


def _feed(collectors: list[Collector], messages: list[ExportTraceServiceRequest]) -> int:
    """Every span to its trace's replica, except the split traces' client spans, which go
    to the other replica once everything else is stored; returns the split traces."""
    replicas = len(collectors)

    def owner(trace_id: bytes, client: bool) -> int:
        return _replica_of(trace_id) % replicas

    def late(trace_id: bytes, client: bool) -> int:
        if client and _is_split(trace_id):
            return (owner(trace_id, client) + 1) % replicas  # the other replica (or the one)
        return replicas  # not late: left out of the later parts

    def now(trace_id: bytes, client: bool) -> int:
        return replicas if late(trace_id, client) < replicas else owner(trace_id, client)

    held = []
    split_traces = set()
    for message in messages:
        for collector, part in zip(collectors, _split(message, now, replicas + 1), strict=False):
            if part.resource_spans:
                _send(collector, part)
        later = _split(message, late, replicas + 1)[:replicas]
        held.append(later)
        for part in later:
            for resource in part.resource_spans:
                for scope in resource.scope_spans:
                    split_traces.update(bytes(span.trace_id) for span in scope.spans)
    for collector in collectors:
        collector.flush()
    for later in held:
        for collector, part in zip(collectors, later, strict=True):
            if part.resource_spans:
                _send(collector, part)
    for collector in collectors:
        collector.flush()
    return len(split_traces)


def _answers(store_location: str) -> dict[str, Any]:
    store = open_store_readonly(store_location)
    try:
        rows: dict[tuple[str, str], dict[str, Any]] = {}
        cursor = None
        while True:
            page = store.list_requests(RequestPageQuery(limit=500, cursor=cursor))
            for item in page.items:
                rows[(item["trace_id"], item["span_id"])] = dict(item)
            cursor = page.next_cursor
            if cursor is None:
                break
        documents = {
            trace_id: store.get(trace_id)
            for trace_id in sorted({trace_id for trace_id, _ in rows})[::7]
        }
        stats = store.collector_stats()
        report = all_time_report(store)
    finally:
        store.close()
    for document in documents.values():
        assert document is not None
        document.pop("other_span_ids", None)
    return {"rows": rows, "documents": documents, "report": report, "stats": stats}


def test_two_replicas_on_postgresql_answer_like_one_collector_on_sqlite(
    tmp_path: Path, postgres_url: str
) -> None:
    messages = to_otlp_requests(simulate("mixed", requests=REQUESTS, seed=11), batch_spans=64)
    sqlite_store = str(tmp_path / "one.db")
    with _running([sqlite_store]) as (one,):
        split_alone = _feed([one], messages)
        one_stats = one.stats()
    with _running([postgres_url, postgres_url]) as replicas:
        split = _feed(replicas, messages)
        replica_stats = [replica.stats() for replica in replicas]

    assert split == split_alone > REQUESTS // (2 * SPLIT_EVERY)
    # Each replica assembled some traces; the late client spans joined the other's.
    assert all(stats["requests"] > REQUESTS // 4 for stats in replica_stats)
    assert sum(s["late_traces_rederived"] for s in replica_stats) == split
    assert one_stats["late_traces_rederived"] == split
    assert not any(s["processor_errors"] for s in [one_stats, *replica_stats])

    expected, shared = _answers(sqlite_store), _answers(postgres_url)
    assert len(expected["rows"]) == REQUESTS
    assert shared["rows"] == expected["rows"]
    assert shared["documents"] == expected["documents"]
    assert shared["report"]["requests"] == expected["report"]["requests"] == REQUESTS
    assert shared["report"]["keys"] == expected["report"]["keys"]
    assert shared["report"]["slo"] == expected["report"]["slo"]
    # The collectors' counters: one collector's, or both replicas' merged.
    assert expected["stats"]["requests"] == shared["stats"]["requests"] == REQUESTS
    assert "replicas" not in expected["stats"] and shared["stats"]["replicas"] == 2
    # The late client spans' network segments are in: the joined requests have one.
    with_network = [row for row in shared["rows"].values() if row.get("network_ms")]
    assert len(with_network) >= split

    # The API and the CLI read the shared store as they read a file.
    slowest = max(expected["rows"].values(), key=lambda row: row["e2e_ms"])
    details = []
    for location in (sqlite_store, postgres_url):
        with TestClient(create_app(ApiSettings(store_path=location))) as client:
            listed = client.get("/api/v1/requests", params={"limit": 1, "sort": "e2e"}).json()
            assert listed["total"] == REQUESTS
            assert listed["items"][0]["trace_id"] == slowest["trace_id"]
            details.append(client.get(f"/api/v1/requests/{slowest['trace_id']}").json())
    assert details[0] == details[1]
    assert details[1]["request"]["trace_id"] == slowest["trace_id"]
    assert details[1]["waterfall"] and details[1]["verdict_text"]
    explained = subprocess.run(
        [sys.executable, "-m", "tokentrace.agent.cli", "explain", "--slowest", "--store",
         postgres_url],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert explained.returncode == 0, explained.stderr
    assert slowest["trace_id"] in explained.stdout
    top = subprocess.run(
        [sys.executable, "-m", "tokentrace.agent.cli", "top", "--once", "--window", "100000d",
         "--store", postgres_url],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert top.returncode == 0, top.stderr
    assert "ttft-p95" in top.stdout


def test_replicas_stats_merge_sums_counters_and_leaves_stopped_replicas_out() -> None:
    at = STATS_WRITTEN_AT
    merged = merge_collector_stats(
        [
            {at: 1000.0, "requests": 5, "processor_errors": {"slo": 1}, "version": "a"},
            {at: 1010.0, "requests": 7, "processor_errors": {"slo": 2, "budget": 1}, "x": 1},
            {at: 900.0, "requests": 100},  # stopped over 60 s before the newest wrote
        ]
    )
    assert merged == {
        at: 1010.0,
        "requests": 12,
        "processor_errors": {"slo": 3, "budget": 1},
        "version": "a",
        "x": 1,
        "replicas": 2,
    }
    assert merge_collector_stats([]) is None
