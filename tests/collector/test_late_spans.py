"""Late spans join their request: a span that reaches the collector after its trace was assembled
re-derives the stored request (budget, verdict, SLO marks, row) from all the trace's spans."""

from __future__ import annotations

import sqlite3
import time
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as GrpcSpanExporter,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind

from tests.collector.test_store import assembled, make_record
from tests.collector.upstream import UpstreamOtlp
from tests.spanbuild import KIND_CLIENT, request_spans, sid, span, tid
from tokentrace.agent import semconv
from tokentrace.collector.config import CollectorConfig, StoreConfig, parse_config
from tokentrace.collector.encoding import encode_trace_request
from tokentrace.collector.exporters.store_sink import StoreSink
from tokentrace.collector.pipeline import Pipeline
from tokentrace.collector.service import Collector
from tokentrace.collector.store import RequestStore, StoreWriteError
from tokentrace.processors.budget import prompt_bucket
from tokentrace.processors.causes import CAUSE_PREFIX_CACHE_MISS
from tokentrace.processors.sketches import SketchKey

MS = 1_000_000
CLIENT_ID = sid(1)
REQUEST_ID = sid(3)  # request_spans(first_span_id=2): the HTTP span is 2, llm.request 3
NETWORK_NS = 400 * MS
"""Client duration minus server duration in these tests: it dominates the request."""


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def export(spans: Sequence[Span], service: str) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    attribute = resource_spans.resource.attributes.add(key=semconv.SERVICE_NAME)
    attribute.value.string_value = service
    resource_spans.scope_spans.add().spans.extend(spans)
    return request


def server_spans(trace_id: bytes, **request_options: Any) -> list[Span]:
    """A whole tokentrace request whose HTTP server span's parent is the client span."""
    spans = request_spans(trace_id=trace_id, first_span_id=2, **request_options)
    spans[0].parent_span_id = CLIENT_ID
    return spans


def client_span(server: Sequence[Span], *, network_ns: int = NETWORK_NS) -> Span:
    """The ``llm.client.request`` around ``server``'s HTTP span, ``network_ns`` longer."""
    http = server[0]
    return span(
        semconv.SPAN_CLIENT_REQUEST,
        http.start_time_unix_nano - network_ns // 2,
        http.end_time_unix_nano + network_ns - network_ns // 2,
        span_id=CLIENT_ID,
        trace_id=http.trace_id,
        kind=KIND_CLIENT,
        attrs={
            semconv.GEN_AI_OPERATION_NAME: semconv.OPERATION_CHAT,
            semconv.GEN_AI_REQUEST_MODEL: "test-model",
        },
    )


def spans_of(request: ExportTraceServiceRequest) -> list[Span]:
    return [
        s
        for resource_spans in request.resource_spans
        for scope_spans in resource_spans.scope_spans
        for s in scope_spans.spans
    ]


def duration(span_message: Span) -> int:
    return span_message.end_time_unix_nano - span_message.start_time_unix_nano


@dataclass
class Collecting:
    """A pipeline writing into a real store, its stored-span look-up wired as the collector
    wires it, and a clock the test moves past the assembly's quiet period."""

    pipeline: Pipeline
    sink: StoreSink
    clock: FakeClock
    path: Path

    def send(self, spans: Sequence[Span], service: str) -> None:
        self.pipeline.consume_traces(export(spans, service))
        self.clock.now += 60  # the trace (or fragment) goes quiet and is finished
        self.pipeline.process_once()

    def rows(self) -> list[dict[str, Any]]:
        with closing(sqlite3.connect(self.path)) as db:
            db.row_factory = sqlite3.Row
            found = db.execute(
                "SELECT span_id, dialect, e2e_ns, network_ns, segment, cause FROM requests "
                "ORDER BY span_id"
            ).fetchall()
        return [dict(row) for row in found]

    def stored_span_ids(self, trace_id: bytes) -> list[bytes]:
        otlp = self.sink.store.trace_otlp(trace_id)
        assert otlp is not None
        return [s.span_id for s in spans_of(ExportTraceServiceRequest.FromString(otlp))]


def default_config() -> CollectorConfig:
    return parse_config({}, environ={})


@pytest.fixture
def collecting(tmp_path: Path) -> Iterator[Collecting]:
    path = tmp_path / "requests.db"
    sink = StoreSink(StoreConfig(path=str(path)))
    clock = FakeClock()
    pipeline = Pipeline(
        default_config(),
        sinks={"store": sink},
        earlier_spans=sink.stored_spans,
        monotonic=clock,
        wall_clock=lambda: 1_000.0,
    )
    yield Collecting(pipeline, sink, clock, path)
    sink.shutdown(1.0)


# --- the request row ---------------------------------------------------------------------------


def test_a_late_client_span_rederives_the_stored_request(collecting: Collecting) -> None:
    trace_id = tid(1)
    server = server_spans(trace_id)
    collecting.send(server, "vllm")
    (before,) = collecting.rows()
    assert before["network_ns"] is None
    assert before["segment"] != semconv.SEGMENT_NETWORK

    client = client_span(server)
    collecting.send([client], "app")

    (after,) = collecting.rows()  # the same request, no second row
    assert after["span_id"] == REQUEST_ID
    expected_network = duration(client) - duration(server[0])
    assert expected_network == NETWORK_NS
    assert after["network_ns"] == expected_network
    assert after["e2e_ns"] == before["e2e_ns"] + expected_network  # the budget's E2E
    assert (after["segment"], after["cause"]) != (before["segment"], before["cause"])
    assert after["segment"] == semconv.SEGMENT_NETWORK  # the verdict was recomputed
    doc = collecting.sink.store.get(trace_id.hex())
    assert doc is not None
    assert doc["budget"][semconv.SEGMENT_NETWORK] == pytest.approx(expected_network / MS)
    assert doc["other_span_ids"] == []
    # The stored trace holds every span once: the server's, then the late client span.
    assert collecting.stored_span_ids(trace_id) == [s.span_id for s in server] + [CLIENT_ID]
    stats = collecting.pipeline.telemetry.snapshot()
    assert stats["late_spans"] == 1
    assert stats["requests"] == 1
    assert (stats["late_traces_rederived"], stats["late_traces_unmatched"]) == (1, 0)


def test_late_server_spans_replace_the_client_only_record(collecting: Collecting) -> None:
    trace_id = tid(2)
    server = server_spans(trace_id)
    client = client_span(server)
    collecting.send([client], "app")  # the client exported first: a client-only request
    (client_only,) = collecting.rows()
    assert client_only["span_id"] == CLIENT_ID
    assert client_only["dialect"] == "genai_client"
    assert client_only["segment"] == semconv.SEGMENT_UNATTRIBUTED

    collecting.send(server, "vllm")

    (request,) = collecting.rows()  # the client-only row is gone, one request remains
    assert request["span_id"] == REQUEST_ID
    assert request["dialect"] == "tokentrace"
    assert request["network_ns"] == duration(client) - duration(server[0])
    assert request["segment"] == semconv.SEGMENT_NETWORK
    assert collecting.stored_span_ids(trace_id) == [CLIENT_ID] + [s.span_id for s in server]
    stats = collecting.pipeline.telemetry.snapshot()
    assert (stats["late_traces_rederived"], stats["requests"]) == (1, 1)


def test_a_span_sent_again_late_counts_once(collecting: Collecting) -> None:
    trace_id = tid(3)
    server = server_spans(trace_id)
    collecting.send(server, "vllm")
    # A retried export re-delivers the decode span together with the late client span.
    collecting.send([server[4], client_span(server)], "app")
    (request,) = collecting.rows()
    assert request["network_ns"] == NETWORK_NS
    doc = collecting.sink.store.get(trace_id.hex())
    assert doc is not None
    assert doc["tokens"]["output"] == 4
    assert doc["metrics_ms"][semconv.METRIC_ITL]["count"] == 3  # the decode span read once


def test_the_late_fragment_alone_goes_to_the_exporters(tmp_path: Path) -> None:
    sink = StoreSink(StoreConfig(path=str(tmp_path / "requests.db")))
    clock = FakeClock()
    pipeline = Pipeline(
        default_config(), sinks={"store": sink}, earlier_spans=sink.stored_spans, monotonic=clock
    )
    try:
        server = server_spans(tid(4))
        pipeline.consume_traces(export(server, "vllm"))
        clock.now += 60
        first = [pipeline.process_trace(t) for t in pipeline.assembler.pop_finished()]
        sink.export_traces(first)
        pipeline.consume_traces(export([client_span(server)], "app"))
        clock.now += 60
        (late,) = [pipeline.process_trace(t) for t in pipeline.assembler.pop_finished()]
    finally:
        sink.shutdown(1.0)
    assert [record.timeline.span_id for record in late.records] == [REQUEST_ID]
    assert late.replaces_stored == [REQUEST_ID]
    assert [ref.span.span_id for ref in late.trace.spans] == [CLIENT_ID]
    sent = spans_of(ExportTraceServiceRequest.FromString(late.otlp))
    assert [s.span_id for s in sent] == [CLIENT_ID]  # upstream gets the late span alone


# --- percentiles and diagnosis count a request once ---------------------------------------------


def sketch_counts(pipeline: Pipeline, service: str) -> dict[str, int]:
    store = pipeline.percentiles
    assert store is not None
    known: tuple[SketchKey, ...] = store.keys()
    keys = [key for key in known if key.service == service]
    assert len(keys) == 1, keys
    return {
        metric: store.window(keys[0], metric=metric).count
        for metric in (semconv.METRIC_E2E, semconv.METRIC_TTFT, semconv.METRIC_NETWORK)
    }


def test_a_rederived_request_records_only_the_metrics_it_lacked(collecting: Collecting) -> None:
    server = server_spans(tid(5))
    collecting.send(server, "vllm")
    assert sketch_counts(collecting.pipeline, "vllm") == {"e2e": 1, "ttft": 1, "network": 0}
    collecting.send([client_span(server)], "app")
    # The same request span was recorded before: only its new network value is added.
    assert sketch_counts(collecting.pipeline, "vllm") == {"e2e": 1, "ttft": 1, "network": 1}
    store = collecting.pipeline.percentiles
    assert store is not None
    key = SketchKey("vllm", "test-model", semconv.OPERATION_TEXT_COMPLETION, prompt_bucket(100))
    assert store.window(key, metric=semconv.METRIC_NETWORK).quantile(0.5) == pytest.approx(
        NETWORK_NS / 1e9, rel=0.01
    )


def test_server_spans_joining_a_client_only_record_record_all_their_metrics(
    collecting: Collecting,
) -> None:
    server = server_spans(tid(6))
    collecting.send([client_span(server)], "app")
    client_counts = sketch_counts(collecting.pipeline, "app")
    assert client_counts["e2e"] == 1
    collecting.send(server, "vllm")
    # The server request is new to the sketches (the client-only values were the client's,
    # under the client's key, and stay: a sketch cannot take a value back).
    assert sketch_counts(collecting.pipeline, "vllm") == {"e2e": 1, "ttft": 1, "network": 1}
    assert sketch_counts(collecting.pipeline, "app") == client_counts


def long_prompt_request(trace_id: bytes) -> list[Span]:
    """Prefill-dominated, 2,000 prompt tokens, none from the prefix cache, a shared prefix."""
    return server_spans(
        trace_id,
        prefill_ns=900 * MS,
        request_attrs={
            semconv.GEN_AI_USAGE_INPUT_TOKENS: 2_000,
            semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: 0,
            semconv.PROMPT_PREFIX_HASH: "abcdef0123456789",
        },
    )


def test_a_rederived_request_keeps_its_first_prefix_judgement(collecting: Collecting) -> None:
    first = long_prompt_request(tid(7))
    second = long_prompt_request(tid(8))
    collecting.send(first, "vllm")
    collecting.send(second, "vllm")  # the same prefix again, recomputed: a prefix-cache miss
    first_cause, second_cause = (
        collecting.sink.store.get(trace.hex())["verdict"]["cause"] for trace in (tid(7), tid(8))
    )
    assert first_cause != CAUSE_PREFIX_CACHE_MISS
    assert second_cause == CAUSE_PREFIX_CACHE_MISS
    # Small network segments: prefill still dominates both when their client spans come late.
    collecting.send([client_span(first, network_ns=10 * MS)], "app")
    collecting.send([client_span(second, network_ns=10 * MS)], "app")
    after = [collecting.sink.store.get(trace.hex()) for trace in (tid(7), tid(8))]
    assert [doc["metrics_ms"][semconv.METRIC_NETWORK] for doc in after] == [10.0, 10.0]
    # Its own first diagnosis put the first request's prefix among the seen ones; that must
    # not turn it into a miss now, and the second stays one.
    assert [doc["verdict"]["cause"] for doc in after] == [first_cause, second_cause]


# --- when the stored spans are not found --------------------------------------------------------


def test_without_a_store_a_late_client_span_is_dropped_and_counted() -> None:
    clock = FakeClock()
    pipeline = Pipeline(default_config(), monotonic=clock)
    server = server_spans(tid(9))
    pipeline.consume_traces(export(server, "vllm"))
    clock.now += 60
    assert [len(pipeline.process_trace(t).records) for t in pipeline.assembler.pop_finished()] == [
        1
    ]
    pipeline.consume_traces(export([client_span(server)], "app"))
    clock.now += 60
    (late,) = pipeline.assembler.pop_finished()
    processed = pipeline.process_trace(late)
    assert processed.records == []  # no client-only duplicate of the request
    assert processed.replaces_stored == []
    assert processed.otlp  # its spans still go to the exporters
    stats = pipeline.telemetry.snapshot()
    assert (stats["late_traces_rederived"], stats["late_traces_unmatched"]) == (0, 1)


def test_a_failing_look_up_keeps_todays_behaviour() -> None:
    def broken_store(trace_id: bytes) -> None:
        raise sqlite3.OperationalError("disk I/O error")

    clock = FakeClock()
    pipeline = Pipeline(default_config(), earlier_spans=broken_store, monotonic=clock)
    server = server_spans(tid(10))
    pipeline.consume_traces(export(server, "vllm"))
    clock.now += 60
    pipeline.process_once()
    pipeline.consume_traces(export([client_span(server)], "app"))
    clock.now += 60
    (late,) = pipeline.assembler.pop_finished()
    assert pipeline.process_trace(late).records == []
    assert pipeline.telemetry.snapshot()["late_traces_unmatched"] == 1


def test_stored_spans_over_the_size_cap_are_not_read(collecting: Collecting) -> None:
    server = server_spans(tid(11))
    collecting.send(server, "vllm")
    stored = collecting.sink.store.trace_otlp(tid(11))
    assert stored is not None
    assert collecting.sink.stored_spans(tid(11)) is not None
    collecting.sink.store.max_trace_bytes = len(stored) - 1
    assert collecting.sink.stored_spans(tid(11)) is None
    collecting.send([client_span(server)], "app")
    (row,) = collecting.rows()
    assert row["network_ns"] is None  # processed alone, as before the look-up existed
    assert collecting.pipeline.telemetry.snapshot()["late_traces_unmatched"] == 1


# --- the store swaps the rows in one transaction -----------------------------------------------


def request_span_ids(store: RequestStore) -> list[bytes]:
    with closing(sqlite3.connect(store.path)) as db:
        return [row[0] for row in db.execute("SELECT span_id FROM requests ORDER BY span_id")]


def test_replacing_deletes_named_rows_only_and_inserts_in_one_transaction(tmp_path: Path) -> None:
    store = RequestStore(tmp_path / "s.db")
    kept = make_record(1, span=1)
    replaced = make_record(1, span=2)
    store.write([(assembled(kept, replaced), [kept, replaced])])
    replacement = make_record(1, span=3, queue_ms=7)
    fragment = assembled(replacement, services=("late",))
    fragment.late = True
    store.write(
        [(fragment, [replacement], encode_trace_request(fragment.spans))],
        replacing={fragment.trace_id: [replaced.timeline.span_id]},
    )
    assert request_span_ids(store) == [sid(1), sid(3)]

    # A failing insert rolls the delete back with it (the item fails alone too: quarantined).
    with sqlite3.connect(store.path) as db:
        db.execute(
            "CREATE TRIGGER refuse BEFORE INSERT ON requests WHEN NEW.model = 'poison' "
            "BEGIN SELECT RAISE(ABORT, 'poisoned'); END"
        )
    poison = make_record(1, span=4, model="poison")
    before = store.trace_otlp(fragment.trace_id)
    with pytest.raises(StoreWriteError, match="quarantined"):
        store.write(
            [(fragment, [poison])],
            replacing={fragment.trace_id: [sid(1), sid(3)]},
        )
    assert request_span_ids(store) == [sid(1), sid(3)]
    assert store.trace_otlp(fragment.trace_id) == before
    store.close()


def test_a_rejected_record_keeps_the_rows_it_would_have_replaced(tmp_path: Path) -> None:
    store = RequestStore(tmp_path / "s.db")
    stored = make_record(2, span=1)
    store.write([(assembled(stored), [stored])])
    malformed = make_record(2, span=2)
    malformed.budget.e2e_ns = None
    with pytest.raises(StoreWriteError):
        store.write(
            [(assembled(malformed), [malformed])],
            replacing={stored.timeline.trace_id: [stored.timeline.span_id]},
        )
    assert store.count() == 1
    store.close()


# --- a real OpenTelemetry SDK client exporting late ---------------------------------------------

SDK_THREADS = 3
SDK_REQUESTS_PER_THREAD = 6
SDK_SCHEDULE_DELAY_MS = 1_500
"""The client's BatchSpanProcessor exports this long after it started (OpenLLMetry's default,
the SDK's, is 5 s): well after the collector below finished the server spans' traces."""
SDK_NETWORK_NS = 8 * MS


def start_collector(tmp_path: Path, upstream: UpstreamOtlp) -> Collector:
    raw: dict[str, Any] = {
        "receivers": {
            "otlp": {
                "protocols": {
                    "grpc": {"endpoint": "127.0.0.1:0"},
                    "http": {"endpoint": "127.0.0.1:0"},
                }
            }
        },
        "processors": {"assembly": {"quiet_period": "200ms", "root_grace": "50ms"}},
        "exporters": {
            "store": {"path": str(tmp_path / "requests.db")},
            "otlp": {
                "endpoint": f"http://127.0.0.1:{upstream.grpc_port}",
                "tls": {"insecure": True},
                "metrics_interval": "1h",
            },
        },
    }
    collector = Collector(parse_config(raw, environ={}))
    collector.start()
    return collector


def post_spans(port: int, request: ExportTraceServiceRequest) -> None:
    """The inference server's exporter: OTLP/HTTP protobuf, sent before the client's."""
    message = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/traces",
        data=request.SerializeToString(),
        headers={"Content-Type": "application/x-protobuf"},
        method="POST",
    )
    with urllib.request.urlopen(message, timeout=10) as response:
        assert response.status == 200


def test_sdk_client_spans_exported_late_join_their_requests(
    tmp_path: Path, upstream: UpstreamOtlp
) -> None:
    collector = start_collector(tmp_path, upstream)
    http_port, grpc_port = collector.http_port, collector.grpc_port
    assert http_port is not None and grpc_port is not None
    provider = TracerProvider(resource=Resource.create({semconv.SERVICE_NAME: "chat-app"}))
    provider.add_span_processor(
        BatchSpanProcessor(
            GrpcSpanExporter(endpoint=f"127.0.0.1:{grpc_port}", insecure=True),
            schedule_delay_millis=SDK_SCHEDULE_DELAY_MS,
        )
    )
    tracer = provider.get_tracer("chat-app")

    def call_server(thread: int) -> None:
        for _ in range(SDK_REQUESTS_PER_THREAD):
            start = time.time_ns()
            client = tracer.start_span(
                semconv.SPAN_CLIENT_REQUEST,
                kind=SpanKind.CLIENT,
                start_time=start,
                attributes={semconv.GEN_AI_OPERATION_NAME: semconv.OPERATION_CHAT},
            )
            context = client.get_span_context()
            server = request_spans(
                start_ns=start + SDK_NETWORK_NS // 2,
                trace_id=context.trace_id.to_bytes(16, "big"),
                first_span_id=2,
                request_attrs={semconv.REQUEST_ID: f"req-{thread}-{context.span_id:x}"},
            )
            server[0].parent_span_id = context.span_id.to_bytes(8, "big")
            post_spans(http_port, export(server, "vllm"))
            client.end(end_time=server[0].end_time_unix_nano + SDK_NETWORK_NS // 2)

    requests = SDK_THREADS * SDK_REQUESTS_PER_THREAD
    spans_per_request = len(request_spans()) + 1
    try:
        with ThreadPoolExecutor(SDK_THREADS) as pool:
            list(pool.map(call_server, range(SDK_THREADS)))
        deadline = time.monotonic() + 10 * SDK_SCHEDULE_DELAY_MS / 1000
        while collector.stats()["received_spans"] < requests * spans_per_request:
            assert time.monotonic() < deadline, collector.stats()
            time.sleep(0.05)
        provider.shutdown()
        collector.flush()
        stats = collector.stats()
    finally:
        collector.shutdown()

    assert stats["late_spans"] > 0  # the SDK's schedule delay made client spans late
    assert stats["late_traces_rederived"] == stats["late_spans"]  # one client span per fragment
    assert stats["late_traces_unmatched"] == 0
    assert stats["requests"] == requests
    with closing(sqlite3.connect(tmp_path / "requests.db")) as db:
        rows = db.execute("SELECT dialect, network_ns, request_id FROM requests").fetchall()
    assert len(rows) == requests  # one row per request, no client-only record
    assert {dialect for dialect, _, _ in rows} == {"tokentrace"}
    assert all(network == SDK_NETWORK_NS for _, network, _ in rows), rows
    assert len({request_id for _, _, request_id in rows}) == requests
    # Upstream got every span once: a re-derived request re-sent none of its stored spans.
    sent = [
        (s.trace_id, s.span_id) for request in upstream.trace_requests for s in spans_of(request)
    ]
    assert len(sent) == len(set(sent)) == requests * spans_per_request


# --- a retried export: the same spans again ------------------------------------------------------
def test_an_export_received_again_after_its_trace_was_stored_adds_nothing(
    collecting: Collecting,
) -> None:
    """A sender retries an export whose OK it never got (the collector died after spooling it;
    the spool replayed it too): the copy comes after the trace was stored."""
    server = server_spans(tid(21))
    collecting.send(server, "vllm")
    collecting.send(server, "vllm")
    ids = collecting.stored_span_ids(tid(21))
    assert sorted(ids) == sorted(s.span_id for s in server)  # each once
    assert len(collecting.rows()) == 1
    snapshot = collecting.pipeline.telemetry.snapshot()
    assert snapshot["duplicate_spans"] == len(server)
    assert snapshot["requests"] == 1


def test_a_retry_carrying_old_and_new_spans_appends_only_the_new(collecting: Collecting) -> None:
    server = server_spans(tid(22))
    collecting.send(server, "vllm")
    client = client_span(server)
    collecting.send([*server[:2], client], "app")  # a retried batch that also holds a new span
    ids = collecting.stored_span_ids(tid(22))
    assert sorted(ids) == sorted([*(s.span_id for s in server), CLIENT_ID])
    (row,) = collecting.rows()
    assert row["network_ns"] == NETWORK_NS  # the new client span joined its request
    assert collecting.pipeline.telemetry.snapshot()["duplicate_spans"] == 2


def test_both_copies_of_an_export_in_one_assembly_are_processed_once(
    collecting: Collecting,
) -> None:
    server = server_spans(tid(23))
    collecting.pipeline.consume_traces(export(server, "vllm"))
    collecting.send(server, "vllm")  # the copy arrives before the trace is finished
    assert sorted(collecting.stored_span_ids(tid(23))) == sorted(s.span_id for s in server)
    assert collecting.pipeline.telemetry.snapshot()["duplicate_spans"] == len(server)
