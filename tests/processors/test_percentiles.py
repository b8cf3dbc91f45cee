"""PercentileStore: sliding window, LRU keys, cross-key merges, drains, OTLP metrics, threads."""

from __future__ import annotations

import threading
import time
from typing import Any, cast

import pytest
from opentelemetry.proto.metrics.v1.metrics_pb2 import AGGREGATION_TEMPORALITY_CUMULATIVE

from tokentrace.agent import semconv
from tokentrace.processors.model import RequestMetrics
from tokentrace.processors.percentiles import PercentileConfig, PercentileStore
from tokentrace.processors.sketches import LatencySketch, SketchKey

CHAT = SketchKey("svc-a", "llama", semconv.OPERATION_CHAT, "short")
CHAT_LONG = SketchKey("svc-a", "llama", semconv.OPERATION_CHAT, "long")
OTHER_MODEL = SketchKey("svc-b", "qwen", semconv.OPERATION_TEXT_COMPLETION, "short")
MS = 1_000_000


class FakeClock:
    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def metrics(
    *,
    ttft_ms: float | None = 100.0,
    e2e_ms: float = 500.0,
    itl_ms: list[float] | None = None,
    **others: int | None,
) -> RequestMetrics:
    values: dict[str, Any] = {m: None for m in ("tpot", "queue", "prefill", "decode", "network")}
    values.update(others)
    return RequestMetrics(
        ttft=None if ttft_ms is None else int(ttft_ms * MS),
        e2e=int(e2e_ms * MS),
        itl=[int(gap * MS) for gap in (itl_ms or [])],
        **values,
    )


def make_store(clock: FakeClock, **config: Any) -> PercentileStore:
    return PercentileStore(config=PercentileConfig(**config), clock=clock)


# --- window ----------------------------------------------------------------------------------


def test_window_keeps_the_live_slices_and_expires_older_ones() -> None:
    clock = FakeClock(1_000.0)  # slice_s = 10: slice 100 starts at 1000
    store = make_store(clock, window_s=60.0, slices=6)
    store.record(CHAT, metrics(ttft_ms=100))
    clock.now = 1_031.0
    store.record(CHAT, metrics(ttft_ms=300))
    assert store.window(CHAT, metric=semconv.METRIC_TTFT).count == 2

    clock.now = 1_059.9  # slice 105: slices 100..105 are live
    assert store.window(CHAT, metric=semconv.METRIC_TTFT).count == 2
    clock.now = 1_060.0  # slice 106: the first request's slice has left the window
    window = store.window(CHAT, metric=semconv.METRIC_TTFT)
    assert window.count == 1
    assert window.quantile(0.5) == pytest.approx(0.3, rel=0.01)
    clock.now = 1_090.0
    assert store.window(CHAT, metric=semconv.METRIC_TTFT).count == 0
    # The cumulative sketch keeps everything.
    assert store.cumulative(CHAT, semconv.METRIC_TTFT).count == 2


def test_values_are_recorded_in_seconds_and_none_is_skipped() -> None:
    store = make_store(FakeClock())
    store.record(CHAT, metrics(ttft_ms=250.0, e2e_ms=1_500.0, queue=40 * MS))
    store.record(CHAT, metrics(ttft_ms=None, e2e_ms=20.0))
    ttft = store.window(CHAT, metric=semconv.METRIC_TTFT)
    assert ttft.count == 1
    assert ttft.quantile(0.5) == pytest.approx(0.25, rel=0.01)
    assert store.window(CHAT, metric=semconv.METRIC_E2E).count == 2
    assert store.cumulative(CHAT, semconv.METRIC_QUEUE).max == pytest.approx(0.04)
    assert store.window(CHAT, metric=semconv.METRIC_TPOT).count == 0


def test_every_inter_token_gap_is_recorded() -> None:
    store = make_store(FakeClock())
    store.record(CHAT, metrics(itl_ms=[10.0, 12.0, 80.0]))
    store.record(CHAT, metrics(itl_ms=[11.0]))
    store.record(CHAT, metrics(itl_ms=[]))
    itl = store.window(CHAT, metric=semconv.METRIC_ITL)
    assert itl.count == 4
    assert itl.max == pytest.approx(0.08)
    assert itl.sum == pytest.approx(0.113)


def test_recorded_values_wait_for_a_reader_within_a_bound_and_read_the_same() -> None:
    # The values are keyed in batches when the slice is read; past the bound, without a read.
    store = PercentileStore(config=PercentileConfig(), clock=FakeClock(), max_pending_values=10)
    reference = LatencySketch()
    for number in range(6):
        gaps = [5.0 + number, 7.0, 30.0 + number]
        store.record(CHAT, metrics(e2e_ms=400.0 + number, itl_ms=gaps))
        for gap in gaps:
            reference.add(gap / 1000)
        pending = store._open.pending_values if store._open is not None else 0
        assert pending <= 10  # settled whenever it passed the bound (each request adds 6)
    itl = store.window(CHAT, metric=semconv.METRIC_ITL)
    assert itl.count == reference.count == 18
    for q in (0.5, 0.9, 0.99):
        assert itl.quantile(q) == reference.quantile(q)
    assert store.window(CHAT, metric=semconv.METRIC_E2E).count == 6


def test_the_pending_bound_must_hold_a_value() -> None:
    with pytest.raises(ValueError, match="max_pending_values"):
        PercentileStore(max_pending_values=0)


def test_cumulative_holds_every_slice_open_or_closed_exactly_once() -> None:
    clock = FakeClock(1_000.0)  # slice_s = 10
    store = make_store(clock, window_s=60.0, slices=6)
    reference = {metric: LatencySketch() for metric in (semconv.METRIC_TTFT, semconv.METRIC_ITL)}
    for step in range(12):  # a slice closes every second step: folds and reads interleave
        gaps_ms = [5.0 + step, 6.0, 7.5 * (step + 1)]
        store.record(CHAT, metrics(ttft_ms=100.0 + step, itl_ms=gaps_ms))
        reference[semconv.METRIC_TTFT].add((100.0 + step) * MS / 1e9)
        reference[semconv.METRIC_ITL].add_many([int(gap * MS) / 1e9 for gap in gaps_ms])
        for metric, expected in reference.items():
            got = store.cumulative(CHAT, metric)
            assert got.buckets() == expected.buckets()
            assert (got.count, got.min, got.max) == (expected.count, expected.min, expected.max)
        clock.now += 5.0
    # Long after the window, the cumulative sketches still hold everything (once).
    clock.now += 600.0
    assert store.cumulative(CHAT, semconv.METRIC_TTFT).count == 12
    assert store.merged(semconv.METRIC_ITL, cumulative=True).count == 36
    metric_names = {m.name for m in store.to_otlp_metrics(start_time_unix_nano=1, time_unix_nano=2)}
    assert semconv.OTLP_METRIC_NAMES[semconv.METRIC_ITL] in metric_names


def test_a_key_evicted_and_recorded_again_starts_over_after_its_slice_closes() -> None:
    clock = FakeClock(1_000.0)
    store = make_store(clock, window_s=60.0, slices=6, max_keys=1)
    store.record(CHAT, metrics(e2e_ms=100.0, itl_ms=[10.0, 20.0]))
    store.record(CHAT_LONG, metrics(itl_ms=[5.0]))  # evicts CHAT with its open-slice data
    store.record(CHAT, metrics(e2e_ms=300.0, itl_ms=[30.0]))  # CHAT again, evicting CHAT_LONG
    clock.now = 1_015.0  # the slice closes and folds into the cumulative sketches
    cumulative = store.cumulative(CHAT, semconv.METRIC_E2E)
    assert cumulative.count == 1
    assert cumulative.min == pytest.approx(0.3)
    itl = store.cumulative(CHAT, semconv.METRIC_ITL)  # pending gaps go with their key too
    assert itl.count == 1
    assert itl.min == pytest.approx(0.03, rel=0.01)
    assert store.cumulative(CHAT_LONG, semconv.METRIC_E2E).count == 0
    assert store.cumulative(CHAT_LONG, semconv.METRIC_ITL).count == 0


def test_unknown_metric_is_a_clear_error() -> None:
    store = make_store(FakeClock())
    with pytest.raises(ValueError, match="tokens_per_second"):
        store.window(metric="tokens_per_second")


# --- keys ------------------------------------------------------------------------------------


def test_least_recently_used_key_is_evicted_and_counted() -> None:
    store = make_store(FakeClock(), max_keys=2)
    store.record(CHAT, metrics())
    store.record(CHAT_LONG, metrics())
    store.record(CHAT, metrics())  # CHAT_LONG is now the least recently used
    assert store.keys_evicted == 0
    store.record(OTHER_MODEL, metrics())
    assert store.keys_evicted == 1
    assert set(store.keys()) == {CHAT, OTHER_MODEL}
    assert store.cumulative(CHAT_LONG, semconv.METRIC_E2E).count == 0
    assert store.cumulative(CHAT, semconv.METRIC_E2E).count == 2
    # Its data in the open slice went with it: memory stays bounded by max_keys.
    assert store.window(CHAT_LONG, metric=semconv.METRIC_E2E).count == 0
    store.record(CHAT_LONG, metrics())
    assert store.keys_evicted == 2
    assert store.snapshot().keys_evicted == 2


def test_merging_across_keys() -> None:
    store = make_store(FakeClock())
    e2e_by_key = {CHAT: [100.0, 200.0, 400.0], CHAT_LONG: [800.0, 1600.0], OTHER_MODEL: [50.0]}
    for key, values in e2e_by_key.items():
        for value in values:
            store.record(key, metrics(e2e_ms=value))

    everything = store.window(metric=semconv.METRIC_E2E)
    assert everything.count == 6
    expected = LatencySketch()
    expected.add_many([v / 1e3 for values in e2e_by_key.values() for v in values])
    assert everything.buckets() == expected.buckets()

    llama = store.merged(semconv.METRIC_E2E, lambda key: key.model == "llama")
    assert llama.count == 5
    assert llama.min == pytest.approx(0.1) and llama.max == pytest.approx(1.6)
    cumulative = store.merged(
        semconv.METRIC_E2E, lambda key: key.prompt_bucket == "short", cumulative=True
    )
    assert cumulative.count == 4 and cumulative.min == pytest.approx(0.05)
    assert store.merged(semconv.METRIC_E2E).count == 6


# --- snapshot --------------------------------------------------------------------------------


def test_snapshot_is_unaffected_by_later_writes() -> None:
    clock = FakeClock()
    store = make_store(clock)
    store.record(CHAT, metrics(e2e_ms=100.0))
    snapshot = store.snapshot()
    store.record(CHAT, metrics(e2e_ms=900.0))
    store.record(OTHER_MODEL, metrics())
    clock.now += 3_600
    assert snapshot.keys() == (CHAT,)
    assert snapshot.window(CHAT, metric=semconv.METRIC_E2E).count == 1
    assert snapshot.cumulative(CHAT, semconv.METRIC_E2E).max == pytest.approx(0.1)
    # Results are new sketches: changing one does not change the snapshot.
    snapshot.window(metric=semconv.METRIC_E2E).add(5.0)
    assert snapshot.window(metric=semconv.METRIC_E2E).count == 1
    assert store.cumulative(CHAT, semconv.METRIC_E2E).count == 2


def test_writer_and_snapshot_readers_in_threads() -> None:
    store = make_store(FakeClock(), max_keys=8)
    keys = [SketchKey("svc", f"model-{j}", semconv.OPERATION_CHAT, "short") for j in range(4)]
    requests = 3_000
    problems: list[str] = []
    done = threading.Event()

    def write() -> None:
        for j in range(requests):
            store.record(keys[j % 4], metrics(e2e_ms=1.0 + j % 97, itl_ms=[1.0, 2.0]))
        done.set()

    def read() -> None:
        last = 0
        while not done.is_set():
            snapshot = store.snapshot()
            total = snapshot.merged(semconv.METRIC_E2E, cumulative=True).count
            per_key = sum(snapshot.cumulative(k, semconv.METRIC_E2E).count for k in keys)
            itl = snapshot.merged(semconv.METRIC_ITL, cumulative=True).count
            window = snapshot.window(metric=semconv.METRIC_E2E).count
            if not (last <= total == per_key == window <= requests and itl == 2 * total):
                problems.append(f"{last=} {total=} {per_key=} {window=} {itl=}")
            last = total

    threads = [threading.Thread(target=write)] + [threading.Thread(target=read) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads)
    assert problems == []
    assert store.record_errors == 0
    assert store.window(metric=semconv.METRIC_E2E).count == requests


def test_record_never_raises() -> None:
    store = make_store(FakeClock())
    store.record(CHAT, cast(Any, object()))
    store.record(CHAT, metrics(e2e_ms=-5.0, itl_ms=[-1.0, 2.0]))  # clock skew: recorded as 0
    assert store.record_errors == 1
    assert store.window(CHAT, metric=semconv.METRIC_E2E).zero_count == 1
    assert store.window(CHAT, metric=semconv.METRIC_ITL).count == 2


def test_a_clock_stepping_back_keeps_writing_into_the_open_slice() -> None:
    clock = FakeClock(1_000.0)
    store = make_store(clock)
    store.record(CHAT, metrics())
    clock.now = 995.0
    store.record(CHAT, metrics())
    clock.now = 1_001.0
    assert store.window(CHAT, metric=semconv.METRIC_E2E).count == 2


# --- persistence of closed slices --------------------------------------------------------------


def test_drain_returns_each_closed_slice_once() -> None:
    clock = FakeClock(1_000.0)
    store = make_store(clock, window_s=60.0, slices=6)
    store.record(CHAT, metrics(ttft_ms=None, e2e_ms=100.0))
    store.record(OTHER_MODEL, metrics(ttft_ms=None, e2e_ms=200.0))
    assert store.drain_closed_slices() == []  # the slice is still open
    clock.now = 1_012.0
    store.record(CHAT, metrics(ttft_ms=None, e2e_ms=300.0))
    clock.now = 1_025.0  # closes slice 1010 without a write
    drained = store.drain_closed_slices()
    assert [(s.slice_start_s, s.key, s.metric, s.sketch.count) for s in drained] == [
        (1_000.0, CHAT, semconv.METRIC_E2E, 1),
        (1_000.0, OTHER_MODEL, semconv.METRIC_E2E, 1),
        (1_010.0, CHAT, semconv.METRIC_E2E, 1),
    ]
    assert drained[2].sketch.max == pytest.approx(0.3)
    assert store.drain_closed_slices() == []
    # Drained sketches are copies: changing them leaves the window alone.
    drained[0].sketch.add(9.0)
    assert store.window(CHAT, metric=semconv.METRIC_E2E).count == 2
    # slices_since does not drain.
    since = store.slices_since(1_010.0)
    assert [(s.slice_start_s, s.key) for s in since] == [(1_010.0, CHAT)]
    assert len(store.slices_since(0.0)) == 3


def test_undrained_slices_are_bounded_and_counted() -> None:
    clock = FakeClock(0.0)
    store = make_store(clock, window_s=10.0, slices=2, max_undrained_slices=3)
    for step in range(6):
        clock.now = step * 5.0
        store.record(CHAT, metrics(ttft_ms=None))
    clock.now = 100.0
    drained = store.drain_closed_slices()
    assert [s.slice_start_s for s in drained] == [15.0, 20.0, 25.0]
    assert store.slices_dropped == 3


# --- OTLP metrics --------------------------------------------------------------------------


def test_otlp_metrics_shape() -> None:
    clock = FakeClock(2_000.0)
    store = make_store(clock)
    store.record(CHAT, metrics(ttft_ms=100.0, e2e_ms=400.0, itl_ms=[5.0, 6.0, 7.0]))
    store.record(CHAT, metrics(ttft_ms=120.0, e2e_ms=450.0))
    clock.now = 2_500.0
    store.record(OTHER_MODEL, metrics(ttft_ms=90.0, e2e_ms=300.0, tpot=20 * MS))

    now_ns = 3_000 * 10**9
    otlp = store.to_otlp_metrics(start_time_unix_nano=1_500 * 10**9, time_unix_nano=now_ns)
    by_name = {metric.name: metric for metric in otlp}
    names = semconv.OTLP_METRIC_NAMES
    assert set(by_name) == {
        names[semconv.METRIC_TTFT],
        names[semconv.METRIC_E2E],
        names[semconv.METRIC_ITL],
        names[semconv.METRIC_TPOT],
    }
    expected_counts = {
        semconv.METRIC_TTFT: {CHAT: 2, OTHER_MODEL: 1},
        semconv.METRIC_E2E: {CHAT: 2, OTHER_MODEL: 1},
        semconv.METRIC_ITL: {CHAT: 3},
        semconv.METRIC_TPOT: {OTHER_MODEL: 1},
    }
    for metric, counts in expected_counts.items():
        otlp_metric = by_name[names[metric]]
        assert otlp_metric.unit == semconv.METRIC_UNIT_SECONDS
        histogram = otlp_metric.exponential_histogram
        assert histogram.aggregation_temporality == AGGREGATION_TEMPORALITY_CUMULATIVE
        seen: dict[SketchKey, int] = {}
        for point in histogram.data_points:
            attributes = {a.key: a.value.string_value for a in point.attributes}
            key = SketchKey(
                attributes[semconv.METRIC_ATTR_SERVICE],
                attributes[semconv.METRIC_ATTR_MODEL],
                attributes[semconv.METRIC_ATTR_OPERATION],
                attributes[semconv.METRIC_ATTR_PROMPT_BUCKET],
            )
            assert len(attributes) == 4
            assert point.count == point.zero_count + sum(point.positive.bucket_counts)
            assert point.scale == 6
            assert point.time_unix_nano == now_ns
            # A key's series starts when the key was first seen, never before the given start.
            first_seen_s = 2_000 if key == CHAT else 2_500
            assert point.start_time_unix_nano == first_seen_s * 10**9
            seen[key] = point.count
        assert seen == counts


def test_otlp_start_time_never_follows_the_point_time() -> None:
    store = make_store(FakeClock(5_000.0))
    store.record(CHAT, metrics())
    (point,) = store.to_otlp_metrics(start_time_unix_nano=0, time_unix_nano=10)[
        0
    ].exponential_histogram.data_points
    assert point.start_time_unix_nano == 10


def test_empty_store_exports_no_metrics() -> None:
    store = make_store(FakeClock())
    assert store.to_otlp_metrics(start_time_unix_nano=0, time_unix_nano=1) == []
    assert store.window(metric=semconv.METRIC_TTFT).quantile(0.5) is None


# --- config ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("window_s", 0.0),
        ("window_s", float("inf")),
        ("window_s", "60"),
        ("slices", 0),
        ("slices", 2.5),
        ("max_keys", 0),
        ("max_keys", True),
        ("scale", 42),
        ("max_undrained_slices", -1),
    ],
)
def test_config_validation_names_the_field(field: str, value: Any) -> None:
    config = PercentileConfig(**{field: value})
    with pytest.raises(ValueError, match=field):
        config.validate()
    with pytest.raises(ValueError, match=field):
        PercentileStore(config=config)


def test_default_config_is_valid() -> None:
    config = PercentileConfig()
    config.validate()
    assert config.slice_s == pytest.approx(10.0)


def test_default_clock_is_wall_time() -> None:
    store = PercentileStore()
    before = time.time()
    store.record(CHAT, metrics())
    assert store.slices_since(0.0) == []  # the only slice is still open
    assert store.window(CHAT, metric=semconv.METRIC_E2E).count == 1
    assert store.snapshot().taken_at_s >= before
