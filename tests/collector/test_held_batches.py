"""A batch an exporter cannot take now (the store's disk full) is held, retried, kept in the spool
meanwhile, and never dropped silently; batches are sized so the tick is never starved."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from tests.collector.full_disk import fill_the_disk, free_the_disk
from tests.collector.test_spool import FakeClock, segment_files
from tests.collector.test_spool import make_spool as spool_of
from tests.spanbuild import export_request, request_spans, tid
from tokentrace.collector import pipeline as pipeline_module
from tokentrace.collector.component import ExportRetryable
from tokentrace.collector.component_configs import StoreConfig
from tokentrace.collector.config import parse_config
from tokentrace.collector.exporters.store_sink import StoreSink
from tokentrace.collector.pipeline import Pipeline, ProcessedTrace
from tokentrace.collector.spool import Spool
from tokentrace.collector.store import RequestStore

_MIB = 1024 * 1024


class RecordingSink:
    """Takes every batch; ``refuse`` makes it ask for a retry instead."""

    def __init__(self, *, clock: FakeClock | None = None, cost_per_trace_s: float = 0.0) -> None:
        self.trace_ids: list[bytes] = []
        self.batch_sizes: list[int] = []
        self.refuse = False
        self._clock = clock
        self._cost_per_trace_s = cost_per_trace_s

    def export_traces(self, batch: Any) -> None:
        items: list[ProcessedTrace] = list(batch)
        if self._clock is not None:  # the batch "takes" this long
            self._clock.now += self._cost_per_trace_s * len(items)
        if self.refuse:
            raise ExportRetryable("not now")
        self.batch_sizes.append(len(items))
        self.trace_ids.extend(item.trace.trace_id for item in items)

    def tick(self, tick: Any) -> None:
        pass


def make_spool(directory: Path, clock: FakeClock) -> Spool:
    return spool_of(directory, segment_bytes=64 * 1024, segment_age_s=1.0, clock=clock)


def stored_trace_ids(store: RequestStore, count: int) -> list[bytes]:
    return [tid(n) for n in range(1, count + 1) if store.trace_otlp(tid(n)) is not None]


def consume(pipeline: Pipeline, numbers: range) -> None:
    for number in numbers:
        pipeline.consume_traces(export_request(request_spans(trace_id=tid(number))))


@pytest.fixture
def store_sink(tmp_path: Path) -> Any:
    sink = StoreSink(StoreConfig(path=str(tmp_path / "store.db")))
    yield sink
    sink.shutdown(1.0)


def test_a_batch_refused_by_a_full_disk_is_held_with_its_spool_and_stored_later(
    tmp_path: Path, store_sink: StoreSink, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    spool_dir = tmp_path / "spool"
    other = RecordingSink()
    pipeline = Pipeline(
        parse_config({}, environ={}),
        sinks={"store": store_sink, "otlp": other},
        monotonic=clock,
        spool=make_spool(spool_dir, clock),
    )
    store = store_sink.store
    fill_the_disk(store)
    consume(pipeline, range(1, 41))
    clock.now += 60
    with caplog.at_level(logging.WARNING, logger="tokentrace.collector.pipeline"):
        assert pipeline.process_once() == 40
    assert stored_trace_ids(store, 40) == []
    assert len(other.trace_ids) == 40  # the exporter that took it is not asked again
    assert "held for a retry" in caplog.text
    assert store_sink.stats()["failed_batches"] == 1
    assert store_sink.stats()["rejected_records"] == 0  # held, not given up
    # Old enough to go, but a held batch keeps its requests' segments.
    clock.now += 60
    pipeline.housekeeping()
    assert segment_files(spool_dir)

    clock.now += 1.0  # the first retry is due: the disk is still full
    pipeline.process_once()
    assert stored_trace_ids(store, 40) == []
    assert pipeline.telemetry.snapshot()["retried_batches"] == 1

    free_the_disk(store)
    clock.now += 0.5  # backoff doubled: not due yet
    pipeline.process_once()
    assert stored_trace_ids(store, 40) == []
    clock.now += 1.0
    pipeline.process_once()
    assert stored_trace_ids(store, 40) == [tid(n) for n in range(1, 41)]
    assert len(other.trace_ids) == 40
    assert store_sink.stats()["written_requests"] == 40
    clock.now += 60
    pipeline.housekeeping()
    assert segment_files(spool_dir) == []
    pipeline.shutdown()


def test_a_crash_while_a_batch_is_held_replays_it_into_the_store(
    tmp_path: Path, store_sink: StoreSink
) -> None:
    clock = FakeClock()
    spool_dir = tmp_path / "spool"
    config = parse_config({}, environ={})
    first = Pipeline(
        config, sinks={"store": store_sink}, monotonic=clock, spool=make_spool(spool_dir, clock)
    )
    fill_the_disk(store_sink.store)
    consume(first, range(1, 11))
    clock.now += 60
    first.process_once()
    first.housekeeping()
    assert stored_trace_ids(store_sink.store, 10) == []
    # The process dies with the batch held; the disk has room again after the restart.
    free_the_disk(store_sink.store)
    restarted = Pipeline(
        config,
        sinks={"store": store_sink},
        monotonic=clock,
        earlier_spans=store_sink.stored_spans,
        spool=make_spool(spool_dir, clock),
    )
    assert restarted.replay() == 10
    clock.now += 60
    restarted.process_once()
    assert stored_trace_ids(store_sink.store, 10) == [tid(n) for n in range(1, 11)]
    restarted.shutdown()
    assert segment_files(spool_dir) == []


def test_while_too_much_is_held_no_new_batch_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pipeline_module, "_HELD_MAX_TRACES", 5)
    clock = FakeClock()
    sink = RecordingSink()
    sink.refuse = True
    pipeline = Pipeline(parse_config({}, environ={}), sinks={"store": sink}, monotonic=clock)
    consume(pipeline, range(1, 6))
    clock.now += 60
    assert pipeline.process_once() == 5  # taken, then held
    consume(pipeline, range(6, 9))
    clock.now += 60
    assert pipeline.process_once() == 0  # the held batch still fails: nothing new taken
    assert pipeline.assembler.pending_traces == 3
    sink.refuse = False
    clock.now += 60
    assert pipeline.process_once() == 3  # the held batch went through, then the new ones
    assert sorted(sink.trace_ids) == [tid(n) for n in range(1, 9)]


def test_a_held_batch_is_given_up_after_five_minutes_counted_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    sink = RecordingSink()
    sink.refuse = True
    pipeline = Pipeline(parse_config({}, environ={}), sinks={"store": sink}, monotonic=clock)
    consume(pipeline, range(1, 4))
    clock.now += 60
    pipeline.process_once()
    with caplog.at_level(logging.ERROR, logger="tokentrace.collector.pipeline"):
        for _ in range(40):
            clock.now += 30
            pipeline.process_once()
    assert "gave up a batch of 3 traces" in caplog.text
    snapshot = pipeline.telemetry.snapshot()
    assert snapshot["exporter_errors"] == {"store": 1}
    assert 8 <= snapshot["retried_batches"] <= 12  # backoff 0.5 s doubling to 30 s, for 300 s
    consume(pipeline, range(4, 5))
    sink.refuse = False
    clock.now += 60
    assert pipeline.process_once() == 1
    assert sink.trace_ids == [tid(4)]


def test_batches_are_sized_to_the_time_budget_so_the_tick_keeps_its_pace() -> None:
    clock = FakeClock()
    sink = RecordingSink(clock=clock, cost_per_trace_s=0.01)  # 100 traces/s
    pipeline = Pipeline(parse_config({}, environ={}), sinks={"store": sink}, monotonic=clock)
    consume(pipeline, range(1, 3001))
    clock.now += 60
    while pipeline.process_once():
        pass
    sizes = sink.batch_sizes
    assert sizes[0] == 1024  # nothing measured yet
    fitting = int(pipeline_module._BATCH_TIME_BUDGET_S / 0.01)
    # Halfway towards what fits the budget each time, then there.
    assert abs(sizes[1] - (1024 + fitting) // 2) <= 1  # (floating point, either way)
    assert abs(sizes[2] - (sizes[1] + fitting) // 2) <= 1
    assert fitting - 1 <= sizes[-2] <= fitting + 2
    assert sum(sizes) == 3000
