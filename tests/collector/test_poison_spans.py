"""Validation per span, isolation per request (issue 15): a hostile span is rejected at the
receiver with its reason and the rest of its export is kept; a value the store cannot write
costs only its own trace, and the store never stays inside a broken transaction."""

from __future__ import annotations

import logging
import re
import sqlite3
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from tests.collector.test_store import assembled, make_record, trace_id
from tokentrace.collector.config import ConfigError, StoreConfig, parse_config
from tokentrace.collector.exporters.store_sink import StoreSink
from tokentrace.collector.pipeline import ProcessedTrace
from tokentrace.collector.receivers.validate import (
    DEFAULT_SPAN_LIMITS,
    REJECTION_REASONS,
    SpanLimits,
    sanitize,
)
from tokentrace.collector.service import Collector
from tokentrace.collector.store import RequestStore, StoreWriteError
from tokentrace.loadgen.replay.emit import to_otlp_requests
from tokentrace.loadgen.replay.simulation import simulate

T0 = 1_700_000_000_000_000_000
LIMITS = DEFAULT_SPAN_LIMITS


def make_span(name: str = "s", *, start: int = T0, end: int = T0 + 1_000, **fields: Any) -> Span:
    return Span(
        name=name,
        trace_id=fields.pop("trace_id", b"\x11" * 16),
        span_id=fields.pop("span_id", b"\x22" * 8),
        start_time_unix_nano=start,
        end_time_unix_nano=end,
        **fields,
    )


def request_of(*spans: Span) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    request.resource_spans.add().scope_spans.add().spans.extend(spans)
    return request


def kept_names(request: ExportTraceServiceRequest) -> list[str]:
    return [
        span.name
        for resource_spans in request.resource_spans
        for scope_spans in resource_spans.scope_spans
        for span in scope_spans.spans
    ]


def string_value(length: int) -> AnyValue:
    return AnyValue(string_value="x" * length)


def int_array(length: int) -> AnyValue:
    return AnyValue(array_value=ArrayValue(values=[AnyValue(int_value=i) for i in range(length)]))


def attrs(count: int, value: AnyValue | None = None) -> list[KeyValue]:
    return [KeyValue(key=f"k{i}", value=value or AnyValue(int_value=i)) for i in range(count)]


# --- sanitize: every reason, each cap at its boundary ------------------------------------------

MAX_STRING = LIMITS.max_string_length
MAX_ARRAY = LIMITS.max_array_length

# (hostile span, its reason); the same span within the limit is kept (``ACCEPTED`` below).
REJECTED: dict[str, tuple[Callable[[], Span], str]] = {
    "start-at-2**63": (lambda: make_span(start=2**63, end=2**63), "time out of range"),
    "end-at-2**64-1": (lambda: make_span(end=2**64 - 1), "time out of range"),
    "end-in-2200": (lambda: make_span(end=LIMITS.max_time_ns), "time out of range"),
    "event-time-2**63": (
        lambda: make_span(events=[Span.Event(time_unix_nano=2**63, name="e")]),
        "time out of range",
    ),
    "span-attributes": (
        lambda: make_span(attributes=attrs(LIMITS.max_attributes + 1)),
        "too many attributes",
    ),
    "event-attributes": (
        lambda: make_span(
            events=[Span.Event(time_unix_nano=T0, attributes=attrs(LIMITS.max_attributes + 1))]
        ),
        "too many attributes",
    ),
    "link-attributes": (
        lambda: make_span(
            links=[
                Span.Link(
                    trace_id=b"\x33" * 16,
                    span_id=b"\x44" * 8,
                    attributes=attrs(LIMITS.max_attributes + 1),
                )
            ]
        ),
        "too many attributes",
    ),
    "events": (
        lambda: make_span(
            events=[Span.Event(time_unix_nano=T0) for _ in range(LIMITS.max_events + 1)]
        ),
        "too many events",
    ),
    "links": (
        lambda: make_span(
            links=[
                Span.Link(trace_id=b"\x33" * 16, span_id=b"\x44" * 8)
                for _ in range(LIMITS.max_links + 1)
            ]
        ),
        "too many links",
    ),
    "name": (lambda: make_span("n" * (MAX_STRING + 1)), "value too long"),
    "string-value": (
        lambda: make_span(attributes=[KeyValue(key="k", value=string_value(MAX_STRING + 1))]),
        "value too long",
    ),
    "attribute-key": (
        lambda: make_span(attributes=[KeyValue(key="k" * (MAX_STRING + 1))]),
        "value too long",
    ),
    "bytes-value": (
        lambda: make_span(
            attributes=[KeyValue(key="k", value=AnyValue(bytes_value=b"b" * (MAX_STRING + 1)))]
        ),
        "value too long",
    ),
    "nested-kvlist-string": (
        lambda: make_span(
            attributes=[
                KeyValue(
                    key="k",
                    value=AnyValue(
                        kvlist_value=KeyValueList(
                            values=[KeyValue(key="inner", value=string_value(MAX_STRING + 1))]
                        )
                    ),
                )
            ]
        ),
        "value too long",
    ),
    "event-name": (
        lambda: make_span(events=[Span.Event(time_unix_nano=T0, name="e" * (MAX_STRING + 1))]),
        "value too long",
    ),
    "status-message": (
        lambda: make_span(status=Status(message="m" * (MAX_STRING + 1))),
        "value too long",
    ),
    "array": (
        lambda: make_span(attributes=[KeyValue(key="k", value=int_array(MAX_ARRAY + 1))]),
        "array too long",
    ),
    "nested-array": (
        lambda: make_span(
            attributes=[
                KeyValue(
                    key="k",
                    value=AnyValue(
                        array_value=ArrayValue(values=[AnyValue(), int_array(MAX_ARRAY + 1)])
                    ),
                )
            ]
        ),
        "array too long",
    ),
}

ACCEPTED: dict[str, Callable[[], Span]] = {
    "times-at-the-bounds": lambda: make_span(start=1, end=LIMITS.max_time_ns - 1),
    "attributes-at-cap": lambda: make_span(attributes=attrs(LIMITS.max_attributes)),
    "events-at-cap": lambda: make_span(
        events=[Span.Event(time_unix_nano=T0) for _ in range(LIMITS.max_events)]
    ),
    "event-time-unset": lambda: make_span(events=[Span.Event(name="no time")]),
    "links-at-cap": lambda: make_span(
        links=[
            Span.Link(trace_id=b"\x33" * 16, span_id=b"\x44" * 8) for _ in range(LIMITS.max_links)
        ]
    ),
    "string-at-cap": lambda: make_span(
        "n" * MAX_STRING, attributes=[KeyValue(key="k", value=string_value(MAX_STRING))]
    ),
    "array-at-cap": lambda: make_span(attributes=[KeyValue(key="k", value=int_array(MAX_ARRAY))]),
    "token-offsets": lambda: make_span(
        "llm.decode", attributes=[KeyValue(key="offsets", value=int_array(1024))]
    ),
    "huge-ints-and-nan-in-attributes": lambda: make_span(
        attributes=[
            KeyValue(key="i", value=AnyValue(int_value=2**63 - 1)),
            KeyValue(key="d", value=AnyValue(double_value=float("nan"))),
        ],
        kind=99,  # an unknown enum value: harmless, every reader compares with constants
    ),
}


@pytest.mark.parametrize("case", list(REJECTED))
def test_sanitize_rejects_a_span_past_a_bound_and_keeps_the_rest(case: str) -> None:
    build, reason = REJECTED[case]
    hostile = build()
    if case != "name":
        hostile.name = "hostile"
    request = request_of(make_span("before"), hostile, make_span("after"))
    rejected, message = sanitize(request)
    assert (rejected, message) == (1, f"rejected 1 span: 1 {reason}")
    assert kept_names(request) == ["before", "after"]


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_sanitize_keeps_a_span_at_the_bounds(case: str) -> None:
    request = request_of(ACCEPTED[case]())
    before = request.SerializeToString()
    assert sanitize(request) == (0, "")
    assert request.SerializeToString() == before


def test_the_bounds_are_plausible_wall_clock_times_inside_int64() -> None:
    assert LIMITS.max_time_ns < 2**63  # every time and difference of two fits SQLite's INTEGER
    assert LIMITS.max_time_ns // 10**9 == 7_258_118_400  # 2200-01-01T00:00:00Z
    assert LIMITS.min_time_ns == 1  # 0 is "missing start time"
    assert REJECTION_REASONS[:5] == (
        "invalid trace_id",
        "invalid span_id",
        "invalid parent_span_id",
        "missing start time",
        "end before start",
    )  # the reasons senders already saw keep their order and spelling


def test_sanitize_counts_several_new_reasons_in_one_request() -> None:
    request = request_of(
        make_span("ok"),
        make_span("far-future", start=2**63, end=2**63),
        make_span("many-attrs", attributes=attrs(LIMITS.max_attributes + 1)),
        make_span("reversed", start=T0, end=T0 - 1),
    )
    rejected, message = sanitize(request)
    assert rejected == 3
    assert message == (
        "rejected 3 spans: 1 end before start, 1 time out of range, 1 too many attributes"
    )
    assert kept_names(request) == ["ok"]


def test_custom_limits_are_honoured() -> None:
    limits = SpanLimits(min_time_ns=946_684_800 * 10**9, max_attributes=2, max_string_length=8)
    request = request_of(
        make_span("ok", attributes=attrs(2)),
        make_span("too-early", start=10, end=20),
        make_span("three", attributes=attrs(3)),
        make_span("long-name-here"),
    )
    rejected, message = sanitize(request, limits)
    assert rejected == 3
    assert message == (
        "rejected 3 spans: 1 time out of range, 1 too many attributes, 1 value too long"
    )
    assert kept_names(request) == ["ok"]


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_configured_span_limits_are_honoured_by_the_running_receivers(
    transport: str, tmp_path: Path
) -> None:
    raw: dict[str, Any] = {
        "receivers": {
            "otlp": {
                "protocols": {transport: {"endpoint": "127.0.0.1:0"}},
                "span_limits": {"max_attributes": 2, "max_string_length": 8},
            }
        },
        "exporters": {"store": {"path": str(tmp_path / "requests.db")}},
    }
    running = Collector(parse_config(raw, environ={}))
    running.start()
    try:
        request = request_of(
            make_span("ok", attributes=attrs(2)),
            make_span("three", attributes=attrs(3)),
            make_span("long-name-here"),
        )
        if transport == "grpc":
            with grpc.insecure_channel(f"127.0.0.1:{running.grpc_port}") as channel:
                response = TraceServiceStub(channel).Export(request, timeout=10)
        else:
            http_request = urllib.request.Request(
                f"http://127.0.0.1:{running.http_port}/v1/traces",
                data=request.SerializeToString(),
                headers={"Content-Type": "application/x-protobuf"},
            )
            with urllib.request.urlopen(http_request, timeout=10) as reply:
                response = ExportTraceServiceResponse.FromString(reply.read())
    finally:
        running.shutdown()
    assert response.partial_success.rejected_spans == 2
    assert response.partial_success.error_message == (
        "rejected 2 spans: 1 too many attributes, 1 value too long"
    )


@pytest.mark.parametrize(
    ("span_limits", "message"),
    [
        ({"max_events": 0}, "receivers.otlp.span_limits.max_events: must be > 0"),
        ({"max_links": "many"}, "receivers.otlp.span_limits.max_links: expected an integer"),
        ({"max_time": 1}, "receivers.otlp.span_limits.max_time: unknown key"),
    ],
)
def test_span_limit_errors_name_the_key(span_limits: dict[str, Any], message: str) -> None:
    raw = {"receivers": {"otlp": {"span_limits": span_limits}}}
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(raw, environ={})


# --- the case through the real gRPC receiver --------------------------------------------


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[Collector]:
    raw: dict[str, Any] = {
        "receivers": {"otlp": {"protocols": {"grpc": {"endpoint": "127.0.0.1:0"}}}},
        "processors": {"assembly": {"quiet_period": "200ms", "root_grace": "50ms"}},
        "exporters": {"store": {"path": str(tmp_path / "requests.db")}},
    }
    running = Collector(parse_config(raw, environ={}))
    running.start()
    try:
        yield running
    finally:
        running.shutdown()


def stored_count(path: Path) -> int:
    store = RequestStore.open_readonly(path)
    try:
        return store.count()
    finally:
        store.close()


@pytest.mark.parametrize(
    ("start", "end"),
    [(2**63, 2**63), (T0, 2**64 - 1), (2**63 - 1, 2**63 - 1)],
    ids=["both-at-2**63", "end-at-2**64-1", "just-below-2**63"],
)
def test_a_span_past_2_63_is_rejected_and_ten_ordinary_traces_are_stored(
    collector: Collector, tmp_path: Path, start: int, end: int
) -> None:
    ordinary = simulate("mixed", requests=10, seed=15)
    [export] = to_otlp_requests(ordinary, batch_spans=10_000)
    hostile = make_span(
        "llm.request", start=start, end=end, trace_id=b"\xee" * 16, span_id=b"\xef" * 8
    )
    export.resource_spans[0].scope_spans[0].spans.append(hostile)
    assert collector.grpc_port is not None
    with grpc.insecure_channel(f"127.0.0.1:{collector.grpc_port}") as channel:
        stub = TraceServiceStub(channel)
        response: ExportTraceServiceResponse = stub.Export(export, timeout=10)
        assert response.partial_success.rejected_spans == 1
        assert response.partial_success.error_message == "rejected 1 span: 1 time out of range"
        collector.flush()
        assert stored_count(tmp_path / "requests.db") == 10

        # The store took the batch; the next ordinary export is stored too.
        [more] = to_otlp_requests(simulate("mixed", requests=3, seed=16), batch_spans=10_000)
        response = stub.Export(more, timeout=10)
        assert not response.HasField("partial_success")
    collector.flush()
    assert stored_count(tmp_path / "requests.db") == 13
    stats = collector.stats()
    assert stats["OtlpGrpcReceiver.rejected_spans"] == 1
    assert not stats.get("StoreSink.failed_batches")
    assert not stats.get("exporter_errors")


def test_with_validation_bypassed_the_store_alone_keeps_the_ten_traces(
    collector: Collector, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defence in depth: a hostile value that got past the receiver costs only its trace."""
    import tokentrace.collector.receivers as receivers

    monkeypatch.setattr(receivers, "sanitize", lambda request, limits, encoded: (0, ""))
    [export] = to_otlp_requests(simulate("mixed", requests=10, seed=17), batch_spans=10_000)
    export.resource_spans[0].scope_spans[0].spans.append(
        make_span("llm.request", start=2**63, end=2**63, trace_id=b"\xee" * 16, span_id=b"\xef" * 8)
    )
    assert collector.grpc_port is not None
    with grpc.insecure_channel(f"127.0.0.1:{collector.grpc_port}") as channel:
        TraceServiceStub(channel).Export(export, timeout=10)
    collector.flush()
    assert stored_count(tmp_path / "requests.db") == 10
    stats = collector.stats()
    assert stats["StoreSink.failed_batches"] == 0
    assert stats["StoreSink.rejected_records"] == 1  # the quarantined one


# --- the store: a write that raises outside sqlite3 costs only its trace -----------------------


class _Unbindable:
    """A value the store's SQLite adapter refuses with a plain ValueError (registered below)."""


def _refuse(value: _Unbindable) -> bytes:
    raise ValueError("hostile value")


@pytest.fixture
def refusing_adapter() -> Iterator[None]:
    sqlite3.register_adapter(_Unbindable, _refuse)
    yield
    sqlite3.adapters.pop((_Unbindable, sqlite3.PrepareProtocol), None)


def poisoned_item(kind: str, number: int) -> tuple[Any, ...]:
    """A batch item whose write raises ``OverflowError`` (a record's E2E past 2**63) or
    ``ValueError`` (its trace's bytes refused by an adapter)."""
    record = make_record(number)
    if kind == "overflow":
        record.budget.e2e_ns = 2**63
        return (assembled(record), [record])
    return (assembled(record), [record], _Unbindable())


@pytest.mark.parametrize("kind", ["overflow", "adapter-value-error"])
@pytest.mark.usefixtures("refusing_adapter")
def test_a_record_whose_write_raises_is_quarantined_and_the_rest_stored(
    tmp_path: Path, kind: str
) -> None:
    store = RequestStore(tmp_path / "s.db")
    first, last = make_record(1), make_record(3)
    batch: list[Any] = [
        (assembled(first), [first]),
        poisoned_item(kind, 2),
        (assembled(last), [last]),
    ]
    with pytest.raises(StoreWriteError, match="1 trace\\(s\\) quarantined") as caught:
        store.write(batch)
    assert (caught.value.written, caught.value.rejected) == (2, 1)
    assert (store.quarantined_records, store.quarantined_traces) == (1, 1)
    assert store.failed_batches == 0
    assert store.written_requests == 2
    assert store.get(trace_id(1).hex()) is not None
    assert store.get(trace_id(2).hex()) is None
    assert store.get(trace_id(3).hex()) is not None
    assert store.trace_otlp(trace_id(2)) is None  # nothing of the poisoned trace is left
    assert store._writer is not None and not store._writer.in_transaction

    after = make_record(4)
    store.write([(assembled(after), [after])])  # the next ordinary write succeeds
    assert store.count() == 3
    store.close()


@pytest.mark.usefixtures("refusing_adapter")
def test_a_batch_of_only_poison_quarantines_each_and_the_store_keeps_working(
    tmp_path: Path,
) -> None:
    store = RequestStore(tmp_path / "s.db")
    with pytest.raises(StoreWriteError) as caught:
        store.write([poisoned_item("overflow", 1), poisoned_item("adapter-value-error", 2)])
    assert (caught.value.written, caught.value.rejected) == (0, 2)
    assert (store.quarantined_records, store.failed_batches) == (2, 0)
    ordinary = make_record(3)
    store.write([(assembled(ordinary), [ordinary])])
    assert store.count() == 1
    store.close()


def test_a_transaction_left_open_is_rolled_back_before_the_next_write(tmp_path: Path) -> None:
    store = RequestStore(tmp_path / "s.db")
    assert store._writer is not None
    store._writer.execute("BEGIN")  # as a failure outside the store's control would leave it
    store._writer.execute("DELETE FROM meta")
    record = make_record(1)
    store.write([(assembled(record), [record])])
    store.set_meta("k", "v")
    store.write_sketch_slices([])
    assert store.count() == 1
    assert store.meta("k") == "v"
    store.close()


def test_a_sketch_slice_sqlite_cannot_bind_rolls_back(tmp_path: Path) -> None:
    store = RequestStore(tmp_path / "s.db")
    from tokentrace.collector.store import StoreError

    with pytest.raises(StoreError, match="sketch slices not stored"):
        store.write_sketch_slices([(1e300, ("s", "m", "o", "b"), "ttft", {"buckets": []})])
    assert store._writer is not None and not store._writer.in_transaction
    record = make_record(1)
    store.write([(assembled(record), [record])])
    assert store.count() == 1
    store.close()


# --- the sink: counted, one rate-limited log line, nothing raised -------------------------------


def test_store_sink_quarantines_without_raising_and_logs_once_per_interval(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    now = [100.0]
    sink = StoreSink(StoreConfig(path=str(tmp_path / "sink.db")), clock=lambda: now[0])

    def export(number: int) -> None:
        good = make_record(number)
        poison = make_record(number + 1)
        poison.budget.e2e_ns = 2**63
        sink.export_traces(
            [ProcessedTrace(assembled(good), [good]), ProcessedTrace(assembled(poison), [poison])]
        )

    with caplog.at_level(logging.WARNING, logger="tokentrace.collector.exporters.store_sink"):
        export(1)
        export(3)
        export(5)
        assert len(caplog.records) == 1
        assert "quarantined" in caplog.records[0].getMessage()
        now[0] += 10.0
        export(7)
    assert len(caplog.records) == 2
    assert "2 similar messages suppressed" in caplog.records[1].getMessage()
    stats = sink.stats()
    assert stats["written_requests"] == 4
    assert stats["rejected_records"] == 4
    assert stats["failed_batches"] == 0
    assert sink.quarantined_records == 4
    assert sink.store.count() == 4
    sink.shutdown(1.0)
