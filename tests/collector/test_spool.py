"""The write-ahead spool (``collector/spool.py``) and the pipeline's durable acknowledgement."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.spanbuild import export_request, request_spans, tid
from tokentrace.agent import semconv
from tokentrace.collector import spool as spool_module
from tokentrace.collector.config import ConfigError, parse_config
from tokentrace.collector.consumer import Overloaded
from tokentrace.collector.pipeline import Pipeline, ProcessedTrace
from tokentrace.collector.self_telemetry import SelfTelemetry
from tokentrace.collector.service import Collector
from tokentrace.collector.spool import Spool, SpoolError

_MIB = 1024 * 1024


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_spool(directory: Path, **options: Any) -> Spool:
    settings: dict[str, Any] = {
        "max_bytes": 64 * _MIB,
        "segment_bytes": 1 * _MIB,
        "segment_age_s": 3600.0,
    }
    settings.update(options)
    return Spool(directory, **settings)


def segment_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("segment-*.spool"))


def trace_request(number: int) -> ExportTraceServiceRequest:
    return export_request(request_spans(trace_id=tid(number)))


# --- the spool alone ---------------------------------------------------------------------------
def test_appends_are_durable_in_order_and_replayed_after_a_restart(tmp_path: Path) -> None:
    spool = make_spool(tmp_path)
    seqs = []
    for payload in (b"one", b"two", b"three"):
        seq = spool.append(payload)
        spool.wait_durable(seq)
        spool.done(seq)
        seqs.append(seq)
    assert seqs == [0, 1, 2]
    # A crash: nothing closed, nothing released.
    again = make_spool(tmp_path)
    assert list(again.replay()) == [(0, b"one"), (1, b"two"), (2, b"three")]
    assert again.replayed_requests == 3
    # New appends go to a new segment and continue the sequence.
    assert again.append(b"four") == 3
    assert len(segment_files(tmp_path)) == 2


def test_a_directory_another_collector_process_holds_is_refused_until_it_exits(
    tmp_path: Path,
) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from tokentrace.collector.spool import Spool; "
            f"s = Spool({str(tmp_path)!r}, max_bytes=1 << 20, segment_bytes=1 << 16, "
            "segment_age_s=60.0); print('open', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        with pytest.raises(SpoolError, match="in use by another collector"):
            make_spool(tmp_path)
    finally:
        holder.communicate("", timeout=30)  # stdin closed: the holder exits
    make_spool(tmp_path).close()  # the lock went with the process


def test_appending_before_replaying_what_survived_is_refused(tmp_path: Path) -> None:
    spool = make_spool(tmp_path)
    spool.wait_durable(spool.append(b"kept"))
    again = make_spool(tmp_path)
    with pytest.raises(RuntimeError, match="replay"):
        again.append(b"new")


def test_one_fsync_covers_every_append_made_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Group commit: threads appending while an fsync runs share the next one."""
    real_fsync = spool_module.os.fsync
    fsync_started = threading.Event()
    release_fsync = threading.Event()
    calls = []

    def slow_fsync(fd: int) -> None:
        calls.append(fd)
        fsync_started.set()
        release_fsync.wait(5)
        real_fsync(fd)

    monkeypatch.setattr(spool_module.os, "fsync", slow_fsync)
    spool = make_spool(tmp_path)
    first = threading.Thread(target=lambda: spool.wait_durable(spool.append(b"first")))
    first.start()
    assert fsync_started.wait(5)
    # While that fsync runs, appends go on (no lock is held across it) ...
    waiters = []
    for index in range(8):
        seq = spool.append(f"record {index}".encode())
        waiter = threading.Thread(target=spool.wait_durable, args=(seq,))
        waiter.start()
        waiters.append(waiter)
    release_fsync.set()
    first.join(5)
    for waiter in waiters:
        waiter.join(5)
        assert not waiter.is_alive()
    # ... and the eight of them were made durable together by at most two more fsync rounds
    # (the directory's and the segment's in the first; one segment fsync for the group).
    assert spool.fsyncs == 2
    assert len(calls) <= 3


def test_many_threads_get_every_record_replayed_once(tmp_path: Path) -> None:
    spool = make_spool(tmp_path, segment_bytes=64 * 1024)
    payloads: set[bytes] = set()
    lock = threading.Lock()

    def sender(number: int) -> None:
        for index in range(200):
            payload = f"sender {number} record {index}".encode() * 20
            seq = spool.append(payload)
            spool.wait_durable(seq)
            spool.done(seq)
            with lock:
                payloads.add(payload)

    threads = [threading.Thread(target=sender, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert spool.fsyncs < 1600  # grouped: fewer fsyncs than appends
    replayed = list(make_spool(tmp_path).replay())
    assert [seq for seq, _ in replayed] == list(range(1600))
    assert {payload for _, payload in replayed} == payloads


def test_segments_rotate_by_size_and_by_age(tmp_path: Path) -> None:
    clock = FakeClock()
    spool = make_spool(tmp_path, segment_bytes=64 * 1024, segment_age_s=5.0, clock=clock)
    for _ in range(3):
        spool.wait_durable(spool.append(b"x" * 40_000))
    assert len(segment_files(tmp_path)) == 2  # the second record passed 64 KiB
    clock.now += 6
    spool.wait_durable(spool.append(b"y"))
    assert len(segment_files(tmp_path)) == 3
    assert spool.segments == 3


def test_a_segment_is_deleted_once_all_its_records_are_processed(tmp_path: Path) -> None:
    clock = FakeClock()
    spool = make_spool(tmp_path, segment_bytes=64 * 1024, segment_age_s=5.0, clock=clock)
    seqs = []
    for _ in range(4):
        seq = spool.append(b"x" * 40_000)
        spool.wait_durable(seq)
        spool.done(seq)
        seqs.append(seq)
    assert [f.name for f in segment_files(tmp_path)] == [
        "segment-00000000000000000000.spool",
        "segment-00000000000000000002.spool",
    ]
    assert spool.release(1) == 0  # record 1 is still needed: its segment stays
    assert spool.release(2) == 1
    assert [f.name for f in segment_files(tmp_path)] == ["segment-00000000000000000002.spool"]
    assert spool.release(4) == 0  # the active segment stays until it is old enough...
    clock.now += 6
    assert spool.release(4) == 1  # ... and goes then
    assert segment_files(tmp_path) == []
    assert spool.size_bytes == 0


def test_an_append_not_yet_done_holds_the_watermark(tmp_path: Path) -> None:
    spool = make_spool(tmp_path)
    first = spool.append(b"a")
    second = spool.append(b"b")
    assert spool.lowest_unfinished() == first
    spool.done(first)
    assert spool.lowest_unfinished() == second
    spool.done(second)
    assert spool.lowest_unfinished() == spool.next_seq == 2


def test_a_torn_last_record_is_ignored_with_one_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spool = make_spool(tmp_path)
    for payload in (b"whole one", b"whole two", b"cut short by the crash"):
        spool.wait_durable(spool.append(payload))
    (segment,) = segment_files(tmp_path)
    data = segment.read_bytes()
    segment.write_bytes(data[:-5])  # the last write only partly reached the disk
    caplog.set_level(logging.WARNING)
    again = make_spool(tmp_path)
    assert [payload for _, payload in again.replay()] == [b"whole one", b"whole two"]
    assert again.torn_records == 1
    torn_lines = [r for r in caplog.records if "cut short" in r.getMessage()]
    assert len(torn_lines) == 1


def test_a_record_whose_crc_fails_ends_its_segment(tmp_path: Path) -> None:
    spool = make_spool(tmp_path)
    for payload in (b"good", b"flipped", b"after"):
        spool.wait_durable(spool.append(payload))
    (segment,) = segment_files(tmp_path)
    data = bytearray(segment.read_bytes())
    data[data.index(b"flipped")] ^= 0xFF
    segment.write_bytes(bytes(data))
    again = make_spool(tmp_path)
    assert [payload for _, payload in again.replay()] == [b"good"]
    assert again.torn_records == 1


def test_the_size_cap_refuses_with_overloaded(tmp_path: Path) -> None:
    spool = make_spool(tmp_path, max_bytes=256 * 1024, segment_bytes=64 * 1024)
    with pytest.raises(Overloaded) as refused:
        for _ in range(100):
            spool.wait_durable(spool.append(b"z" * 10_000))
    assert refused.value.retry_after_s > 0
    assert spool.refused_requests == 1
    assert spool.size_bytes <= 256 * 1024


def test_spool_telemetry(tmp_path: Path) -> None:
    telemetry = SelfTelemetry()
    spool = Spool(
        tmp_path,
        max_bytes=_MIB,
        segment_bytes=128 * 1024,
        segment_age_s=60.0,
        telemetry=telemetry.component("traces", "pipeline"),
    )
    spool.wait_durable(spool.append(b"abc"))
    snapshot = telemetry.snapshot()
    assert snapshot["spool_bytes"] == spool.size_bytes > 0
    assert snapshot["spool_segments"] == 1
    assert snapshot["spool_replayed_requests"] == snapshot["spool_torn_records"] == 0
    names = {
        metric.name
        for metric in telemetry.to_otlp_metrics(start_time_unix_nano=0, time_unix_nano=1)
    }
    assert semconv.SELF_METRIC_SPOOL_FSYNC_DURATION in names


# --- the pipeline with a spool -----------------------------------------------------------------
class RecordingSink:
    def __init__(self) -> None:
        self.trace_ids: list[bytes] = []

    def export_traces(self, batch: Any) -> None:
        items: list[ProcessedTrace] = list(batch)
        self.trace_ids.extend(item.trace.trace_id for item in items)

    def tick(self, tick: Any) -> None:
        pass


def test_the_pipeline_deletes_segments_once_their_traces_are_exported(tmp_path: Path) -> None:
    clock = FakeClock()
    spool = make_spool(tmp_path, segment_bytes=64 * 1024, segment_age_s=5.0, clock=clock)
    sink = RecordingSink()
    pipeline = Pipeline(
        parse_config({}, environ={}), sinks={"sink": sink}, monotonic=clock, spool=spool
    )
    for number in range(1, 201):
        pipeline.consume_traces(trace_request(number))
    assert spool.segments > 1
    assert pipeline.assembler.lowest_seq() == 0
    clock.now += 60
    assert pipeline.process_once() == 200
    assert len(sink.trace_ids) == 200
    assert segment_files(tmp_path) == []  # the active one too: older than segment_age
    assert spool.size_bytes == 0
    pipeline.consume_traces(trace_request(201))
    pipeline.shutdown()  # flushes, and deletes the active segment whatever its age
    assert segment_files(tmp_path) == []


def test_a_pending_trace_keeps_its_segment(tmp_path: Path) -> None:
    clock = FakeClock()
    spool = make_spool(tmp_path, segment_bytes=64 * 1024, segment_age_s=1.0, clock=clock)
    pipeline = Pipeline(parse_config({}, environ={}), monotonic=clock, spool=spool)
    pipeline.consume_traces(trace_request(1))
    clock.now += 60
    pipeline.process_once()
    pipeline.consume_traces(trace_request(2))  # pending, in a new segment
    clock.now += 2
    pipeline.release_spool()
    assert len(segment_files(tmp_path)) == 1
    assert pipeline.assembler.lowest_seq() == 1


def test_a_crash_replays_what_was_acknowledged_and_not_exported(tmp_path: Path) -> None:
    clock = FakeClock()
    first_sink = RecordingSink()
    config = parse_config({}, environ={})
    pipeline = Pipeline(
        config,
        sinks={"sink": first_sink},
        monotonic=clock,
        spool=make_spool(tmp_path, clock=clock),
    )
    for number in range(1, 6):
        pipeline.consume_traces(trace_request(number))
    # The process dies: nothing exported, no shutdown.
    assert first_sink.trace_ids == []
    sink = RecordingSink()
    restarted = Pipeline(
        config, sinks={"sink": sink}, monotonic=clock, spool=make_spool(tmp_path, clock=clock)
    )
    assert restarted.replay() == 5
    restarted.consume_traces(trace_request(6))
    clock.now += 60
    restarted.process_once()
    assert sorted(sink.trace_ids) == [tid(n) for n in range(1, 7)]
    restarted.shutdown()
    assert segment_files(tmp_path) == []


def test_a_replayed_trace_already_stored_is_not_processed_again(tmp_path: Path) -> None:
    """The store committed a trace, then the process died before its segment was deleted."""
    clock = FakeClock()
    config = parse_config({}, environ={})
    stored: dict[bytes, list[Any]] = {}

    class StoreLike(RecordingSink):
        def export_traces(self, batch: Any) -> None:
            super().export_traces(batch)
            for item in batch:
                stored.setdefault(item.trace.trace_id, []).extend(item.trace.spans)

    first = Pipeline(
        config,
        sinks={"store": StoreLike()},
        monotonic=clock,
        spool=make_spool(tmp_path, clock=clock),
    )
    first.consume_traces(trace_request(1))
    first.consume_traces(export_request(request_spans(trace_id=tid(2))[:3]))
    clock.now += 60
    first.process_once()  # both exported; the active segment is kept (not old enough)
    assert set(stored) == {tid(1), tid(2)}
    # Then the rest of trace 2 came, was acknowledged, and the process died.
    first.consume_traces(export_request(request_spans(trace_id=tid(2))[3:]))

    sink = StoreLike()
    restarted = Pipeline(
        config,
        sinks={"store": sink},
        monotonic=clock,
        earlier_spans=lambda trace_id: stored.get(trace_id),
        spool=make_spool(tmp_path, clock=clock),
    )
    assert restarted.replay() == 3
    clock.now += 60
    restarted.process_once()
    assert sink.trace_ids == [tid(2)]  # trace 1 was stored whole: not again
    assert len(stored[tid(1)]) == len(request_spans())
    # trace 2's stored spans were left out, its new ones went on as a late fragment
    assert sorted(ref.span.span_id for ref in stored[tid(2)]) == sorted(
        s.span_id for s in request_spans()
    )
    assert restarted.telemetry.snapshot()["spool_replayed_traces_stored"] == 1


def test_overloaded_assembly_refuses_before_spooling(tmp_path: Path) -> None:
    spool = make_spool(tmp_path)
    config = parse_config({"processors": {"assembly": {"max_pending_spans": 8}}}, environ={})
    pipeline = Pipeline(config, spool=spool)
    pipeline.consume_traces(trace_request(1))
    with pytest.raises(Overloaded):
        pipeline.consume_traces(trace_request(2))
    assert spool.next_seq == 1


def test_a_full_spool_refuses_the_export(tmp_path: Path) -> None:
    spool = make_spool(tmp_path, max_bytes=128 * 1024, segment_bytes=64 * 1024)
    pipeline = Pipeline(parse_config({}, environ={}), spool=spool)
    with pytest.raises(Overloaded):
        for number in range(1, 1000):
            pipeline.consume_traces(trace_request(number))
    assert spool.refused_requests == 1
    assert spool.lowest_unfinished() == spool.next_seq  # nothing left in flight


def test_the_spool_keeps_the_received_bytes_unless_validation_changed_the_request(
    tmp_path: Path,
) -> None:
    """Through the real receivers: an export that validation left as it was is spooled as the
    bytes that came (not serialised again); one that lost a rejected span is spooled as what
    the pipeline got, serialised."""
    import urllib.request

    import grpc

    from tokentrace.collector.receivers.otlp_grpc import OtlpGrpcReceiver
    from tokentrace.collector.receivers.otlp_http import OtlpHttpReceiver

    def unknown_field_first(request: ExportTraceServiceRequest) -> bytes:
        # Field 15 is unknown to this version: parsing keeps it, re-serialising moves it last,
        # so bytes that were re-serialised cannot pass for the received ones.
        body = b"\x78\x01" + request.SerializeToString()
        assert ExportTraceServiceRequest.FromString(body).SerializeToString() != body
        return body

    pipeline = Pipeline(parse_config({}, environ={}), spool=make_spool(tmp_path))
    http_receiver = OtlpHttpReceiver(pipeline, endpoint="127.0.0.1:0")
    grpc_receiver = OtlpGrpcReceiver(pipeline, endpoint="127.0.0.1:0")
    http_receiver.start()
    grpc_receiver.start()
    unchanged_http = unknown_field_first(trace_request(1))
    unchanged_grpc = unknown_field_first(trace_request(2))
    with_rejected = trace_request(3)
    with_rejected.resource_spans[0].scope_spans[0].spans.add(name="no-ids", start_time_unix_nano=1)
    rejected_body = unknown_field_first(with_rejected)
    try:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        for body in (unchanged_http, rejected_body):
            post = urllib.request.Request(
                f"http://127.0.0.1:{http_receiver.port}/v1/traces",
                data=body,
                headers={"Content-Type": "application/x-protobuf"},
            )
            with opener.open(post, timeout=5) as response:
                assert response.status == 200
        with grpc.insecure_channel(f"127.0.0.1:{grpc_receiver.port}") as channel:
            # Bytes in, bytes out: the body goes as built.
            export = channel.unary_unary(
                "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
                request_serializer=None,
                response_deserializer=None,
            )
            export(unchanged_grpc, timeout=5)
    finally:
        http_receiver.shutdown(0)
        grpc_receiver.shutdown(0)
    # The process dies here: what survives is what the next start replays.
    payloads = [payload for _, payload in make_spool(tmp_path).replay()]
    assert payloads[0] == unchanged_http
    assert payloads[2] == unchanged_grpc
    # What the pipeline got: the received request less the rejected span, serialised.
    valid_part = ExportTraceServiceRequest.FromString(rejected_body)
    del valid_part.resource_spans[0].scope_spans[0].spans[-1]
    assert payloads[1] == valid_part.SerializeToString()
    assert len(payloads) == 3


# --- configuration -----------------------------------------------------------------------------
def store_config(tmp_path: Path, **durability: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {"exporters": {"store": {"path": str(tmp_path / "requests.db")}}}
    if durability:
        raw["service"] = {"durability": durability}
    return raw


def test_durability_defaults_to_fsync_next_to_the_store(tmp_path: Path) -> None:
    config = parse_config(store_config(tmp_path), environ={})
    assert config.durability_mode == "fsync"
    assert config.spool_directory == str(tmp_path / "requests.db") + ".spool"
    moved = config.with_store_path(str(tmp_path / "other.db"))
    assert moved.spool_directory == str(tmp_path / "other.db.spool")


def test_durability_is_off_without_a_store_unless_given_a_directory(tmp_path: Path) -> None:
    raw: dict[str, Any] = {"service": {"pipelines": {"traces": {"exporters": []}}}}
    assert parse_config(raw, environ={}).spool_directory is None
    raw["service"]["durability"] = {"mode": "fsync", "directory": str(tmp_path / "spool")}
    assert parse_config(raw, environ={}).spool_directory == str(tmp_path / "spool")


def test_durability_none_turns_the_spool_off(tmp_path: Path) -> None:
    config = parse_config(store_config(tmp_path, mode="none"), environ={})
    assert config.durability_mode == "none"
    assert config.spool_directory is None


@pytest.mark.parametrize(
    ("durability", "message"),
    [
        ({"mode": "sometimes"}, r"service\.durability\.mode: expected one of fsync, none"),
        ({"max_size_mib": 1, "segment_size_mib": 1}, r"service\.durability\.max_size_mib"),
        ({"segment_size_mib": 0.01}, r"service\.durability\.segment_size_mib: must be >="),
        ({"segment_age": "0s"}, r"service\.durability\.segment_age: must be > 0"),
        ({"max_size_mib": 3}, r"max_size_mib: must be at least the receivers' largest"),
        ({"compression": "zstd"}, r"service\.durability.*compression"),
    ],
)
def test_durability_config_errors_name_the_key(
    tmp_path: Path, durability: dict[str, Any], message: str
) -> None:
    raw = store_config(tmp_path, **durability)
    raw["receivers"] = {"otlp": {"protocols": {"http": {"max_request_body_size_mib": 20}}}}
    if "max_size_mib" in durability and "segment_size_mib" not in durability:
        raw["service"]["durability"]["segment_size_mib"] = 1
    with pytest.raises(ConfigError, match=message):
        parse_config(raw, environ={})


def test_fsync_without_a_store_needs_a_directory() -> None:
    raw = {
        "service": {
            "pipelines": {"traces": {"exporters": []}},
            "durability": {"mode": "fsync"},
        }
    }
    with pytest.raises(ConfigError, match=r"service\.durability\.directory: needed"):
        parse_config(raw, environ={})


def test_the_collector_replays_at_start_before_receivers(tmp_path: Path) -> None:
    raw = store_config(tmp_path)
    raw["receivers"] = {"otlp": {"protocols": {"grpc": {"endpoint": "127.0.0.1:0"}}}}
    config = parse_config(raw, environ={})
    assert config.spool_directory is not None
    directory = Path(config.spool_directory)
    crashed = make_spool(directory)
    for number in range(1, 4):
        crashed.wait_durable(crashed.append(trace_request(number).SerializeToString()))
    collector = Collector(config)
    collector.start()
    try:
        assert collector.stats()["spool_replayed_requests"] == 3
        collector.flush()
        store = collector.exporters["store"].store  # type: ignore[attr-defined]
        for number in range(1, 4):
            assert store.trace_otlp(tid(number), max_bytes=1 << 20) is not None
    finally:
        collector.shutdown()
    assert segment_files(directory) == []
