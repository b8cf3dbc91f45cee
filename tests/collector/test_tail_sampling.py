"""Tail sampling: each keep rule, the trace-id hash share, windows and the key bound (unit), the
pipeline's sinks and spool with sampling on, and a real collector whose store holds every
breaching or failed request and far fewer others while its percentiles and SLO figures equal
those of a run without sampling."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from fastapi.testclient import TestClient
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub

from tests.collector.test_held_batches import RecordingSink, consume, make_spool
from tests.collector.test_spool import FakeClock, segment_files
from tests.stored_requests import all_time_report
from tokentrace.agent import semconv
from tokentrace.agent.cli import main
from tokentrace.collector.api.app import ApiSettings, create_app
from tokentrace.collector.component import ConfigError
from tokentrace.collector.config import parse_config
from tokentrace.collector.pipeline import Pipeline, ProcessedTrace
from tokentrace.collector.render_top import render_top
from tokentrace.collector.self_telemetry import SelfTelemetry, metric_key
from tokentrace.collector.service import Collector
from tokentrace.collector.store import (
    RequestFilter,
    RequestPageQuery,
    open_store_readonly,
)
from tokentrace.collector.tail_sampling import (
    DROP_REASONS,
    DROPPED_METRICS,
    KEEP_ALWAYS,
    KEEP_BREACH,
    KEEP_RANDOM,
    KEEP_RARE,
    KEEP_REASONS,
    KEEP_SLOWEST,
    KEPT_METRICS,
    TailSampler,
    TailSamplingSettings,
    in_random_share,
    render_sampling_line,
    sampling_summary,
)
from tokentrace.loadgen.replay.emit import to_otlp_requests
from tokentrace.loadgen.replay.simulation import simulate
from tokentrace.processors.model import (
    AssembledTrace,
    Budget,
    RequestMetrics,
    RequestRecord,
    RequestTimeline,
    Verdict,
)

_MS = 1_000_000
# Rules off unless a test turns one on: each test sees the rule it is about.
_OFF = TailSamplingSettings(
    slowest_per_window=0, rare_share=0.0, rare_min_count=0, random_share=0.0
)


def trace_id(number: int) -> bytes:
    return hashlib.blake2b(number.to_bytes(8, "big"), digest_size=16).digest()


def record(
    number: int,
    *,
    e2e_ms: int = 100,
    model: str = "llama",
    operation: str = "chat",
    cause: str | None = "decode",
    slo: dict[str, bool] | None = None,
    status_error: str | None = None,
    finish_reason: str | None = "stop",
) -> RequestRecord:
    timeline = RequestTimeline(
        trace_id=trace_id(number),
        span_id=number.to_bytes(8, "big"),
        dialect="tokentrace",
        service="svc",
        model=model,
        operation=operation,
        status_error=status_error,
        finish_reason=finish_reason,
    )
    e2e = e2e_ms * _MS
    verdict = None
    if cause is not None:
        verdict = Verdict(segment="decode", cause=cause, sentence="", advice="", numbers={})
    return RequestRecord(
        timeline=timeline,
        budget=Budget(e2e_ns=e2e, segments={}, ttft_ns=None, ttft_segments={}),
        metrics=RequestMetrics(
            ttft=None,
            tpot=None,
            e2e=e2e,
            queue=None,
            prefill=None,
            decode=None,
            network=None,
            itl=[],
        ),
        prompt_bucket="short",
        verdict=verdict,
        slo=slo or {},
    )


def processed(
    number: int, records: Sequence[RequestRecord], *, late: bool = False, replaces: int = 0
) -> ProcessedTrace:
    return ProcessedTrace(
        AssembledTrace(trace_id(number), [], late=late),
        list(records),
        replaces_stored=[bytes([n]) for n in range(replaces)],
    )


def sampler(clock: FakeClock | None = None, **settings: Any) -> TailSampler:
    fields = {
        "window_s": _OFF.window_s,
        "slowest_per_window": _OFF.slowest_per_window,
        "rare_share": _OFF.rare_share,
        "rare_min_count": _OFF.rare_min_count,
        "random_share": _OFF.random_share,
        "max_keys": _OFF.max_keys,
        **settings,
    }
    return TailSampler(TailSamplingSettings(**fields), clock=clock or FakeClock())


def kept_numbers(tail: TailSampler, batch: Sequence[ProcessedTrace]) -> list[int]:
    by_id = {item.trace.trace_id: n for n, item in enumerate(batch)}
    return [by_id[item.trace.trace_id] for item in tail.sample(batch)]


# --- each keep rule ---------------------------------------------------------------------------
def test_with_every_rule_off_only_what_must_be_kept_is_kept() -> None:
    tail = sampler()
    batch = [
        processed(0, [record(0)]),  # an ordinary request: dropped
        processed(1, []),  # no request in it (a cold start's spans): kept
        processed(2, [record(2)], late=True, replaces=1),  # joins stored rows: kept
        processed(3, [], late=True),  # a late fragment of a dropped trace: the hash decides
    ]
    assert kept_numbers(tail, batch) == [1, 2]
    assert tail.kept[KEEP_ALWAYS] == 2
    assert tail.dropped == {"random": 2}


@pytest.mark.parametrize(
    "failing",
    [
        {"slo": {"ttft-p95": True, "e2e-p90": False}},
        {"status_error": "upstream reset"},
        {"finish_reason": "error"},
    ],
    ids=["slo-breach", "error-status", "error-finish"],
)
def test_a_trace_with_a_breaching_or_failed_request_is_kept(failing: dict[str, Any]) -> None:
    tail = sampler()
    batch = [
        processed(0, [record(0, slo={"ttft-p95": True})]),
        processed(1, [record(1), record(101, **failing)]),
    ]
    assert kept_numbers(tail, batch) == [1]
    assert tail.kept[KEEP_BREACH] == 1


def test_the_slowest_n_so_far_per_window_and_key_are_kept() -> None:
    tail = sampler(slowest_per_window=2)
    e2e_ms = [100, 50, 80, 40, 120, 90]
    batch = [processed(n, [record(n, e2e_ms=e2e)]) for n, e2e in enumerate(e2e_ms)]
    # Online: the first two fill the top 2 (100, 50); 80 beats 50; 40 does not; 120 beats 80;
    # 90 does not beat the top 2 so far (100, 120).
    assert kept_numbers(tail, batch) == [0, 1, 2, 4]
    assert tail.kept[KEEP_SLOWEST] == 4
    # Another key has its own top N.
    other = [processed(10, [record(10, e2e_ms=1, model="qwen")])]
    assert kept_numbers(tail, other) == [0]


def test_a_rare_verdict_cause_in_the_window_is_kept() -> None:
    tail = sampler(rare_share=0.1, rare_min_count=2)
    causes = ["decode"] * 30 + ["queueing"] + ["decode"] * 10 + ["queueing"] * 3
    batch = [processed(n, [record(n, cause=cause)]) for n, cause in enumerate(causes)]
    kept = kept_numbers(tail, batch)
    # The first two decode requests (fewer than a few seen), then every queueing one while its
    # share stays under 10 % (1/31, 2/42, 3/43, 4/44), and no more.
    assert kept == [0, 1, 30, 41, 42, 43]
    assert tail.kept[KEEP_RARE] == len(kept)
    # Requests without a verdict count under a cause of their own.
    assert kept_numbers(tail, [processed(99, [record(99, cause=None)])]) == [0]


def test_the_rules_decide_in_order_and_every_request_updates_the_window() -> None:
    tail = sampler(slowest_per_window=1)
    # A breaching request that is also the slowest counts as a breach, and still takes the
    # window's top slot: the next, faster one is not among the slowest.
    batch = [
        processed(0, [record(0, e2e_ms=500, slo={"e2e": False})]),
        processed(1, [record(1, e2e_ms=400)]),
    ]
    assert kept_numbers(tail, batch) == [0]
    assert tail.kept[KEEP_BREACH] == 1 and tail.kept[KEEP_SLOWEST] == 0


# --- the random share -------------------------------------------------------------------------
def test_the_hash_keeps_about_the_configured_share_the_same_on_every_replica() -> None:
    ids = [trace_id(n) for n in range(20_000)]
    for share in (0.01, 0.1, 0.5):
        picked = [in_random_share(t, share) for t in ids]
        five_sigma = 5 * math.sqrt(share * (1 - share) / len(ids))
        assert sum(picked) / len(ids) == pytest.approx(share, abs=five_sigma)
    assert all(in_random_share(t, 1.0) for t in ids[:100])
    assert not any(in_random_share(t, 0.0) for t in ids[:100])
    # Two samplers (two replicas) choose the same traces, whatever else each has seen.
    batch = [processed(n, [record(n)]) for n in range(2_000)]
    first, second = sampler(random_share=0.1), sampler(random_share=0.1)
    second.sample([processed(n, [record(n)]) for n in range(5_000, 5_100)])
    assert kept_numbers(first, batch) == kept_numbers(second, batch)
    assert first.kept[KEEP_RANDOM] > 0


# --- windows and the key bound --------------------------------------------------------------
def test_windows_roll_with_the_injected_clock() -> None:
    clock = FakeClock()
    clock.now = 1_000.0
    tail = sampler(clock, window_s=10.0, slowest_per_window=1)
    assert kept_numbers(tail, [processed(0, [record(0, e2e_ms=500)])]) == [0]
    clock.now += 5  # same window: a faster request is not among the slowest
    assert kept_numbers(tail, [processed(1, [record(1, e2e_ms=100)])]) == []
    clock.now += 5  # a new window starts empty
    assert kept_numbers(tail, [processed(2, [record(2, e2e_ms=100)])]) == [0]


def test_at_most_max_keys_keys_are_held_the_least_recent_evicted() -> None:
    tail = sampler(slowest_per_window=1, max_keys=3)
    for n, model in enumerate(["a", "b", "c", "a", "d"]):
        tail.sample([processed(n, [record(n, e2e_ms=100, model=model)])])
    assert tail.keys_held == 3
    assert tail.keys_evicted == 1  # "b", the least recently seen
    # "a" kept its window (a faster request is not among its slowest); "b" starts again.
    assert kept_numbers(tail, [processed(10, [record(10, e2e_ms=50, model="a")])]) == []
    assert kept_numbers(tail, [processed(11, [record(11, e2e_ms=50, model="b")])]) == [0]


# --- configuration ----------------------------------------------------------------------------
def test_tail_sampling_is_off_unless_configured() -> None:
    assert parse_config({}, environ={}).tail_sampling is None
    config = parse_config({"processors": {"tail_sampling": {"random_share": 0.25}}}, environ={})
    assert config.processor_ids[-1] == "tail_sampling"
    assert config.tail_sampling is not None and config.tail_sampling.random_share == 0.25
    listed = parse_config(
        {"service": {"pipelines": {"traces": {"processors": ["assembly", "tail_sampling"]}}}},
        environ={},
    )
    assert listed.tail_sampling == TailSamplingSettings()


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"random_share": 1.5}, r"^processors\.tail_sampling\.random_share: 1\.5 is outside"),
        ({"rare_share": -0.1}, r"^processors\.tail_sampling\.rare_share: "),
        ({"slowest_per_window": -1}, r"^processors\.tail_sampling\.slowest_per_window: "),
        ({"window": "0s"}, r"^processors\.tail_sampling\.window: must be > 0"),
        ({"max_keys": 0}, r"^processors\.tail_sampling\.max_keys: "),
        ({"rate": 0.1}, r"^processors\.tail_sampling\.rate: unknown key"),
        ({"random_share": "ten"}, r"^processors\.tail_sampling\.random_share: expected a number"),
    ],
)
def test_config_errors_name_the_key(section: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as raised:
        parse_config({"processors": {"tail_sampling": section}}, environ={})
    assert "\n" not in str(raised.value)


# --- the pipeline -----------------------------------------------------------------------------
_DROP_ALL = {
    "slowest_per_window": 0,
    "rare_share": 0.0,
    "rare_min_count": 0,
    "random_share": 0.0,
}


def test_dropped_traces_release_their_spool_and_extensions_still_see_every_trace(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    spool_dir = tmp_path / "spool"
    store, admin = RecordingSink(), RecordingSink()
    config = parse_config(
        {
            "processors": {"tail_sampling": _DROP_ALL},
            "extensions": {"admin": {"endpoint": "127.0.0.1:0"}},
        },
        environ={},
    )
    pipeline = Pipeline(
        config,
        sinks={"store": store, "admin": admin},
        monotonic=clock,
        spool=make_spool(spool_dir, clock),
    )
    consume(pipeline, range(1, 31))
    clock.now += 60
    assert pipeline.process_once() == 30
    assert store.trace_ids == []  # every trace dropped: nothing exported
    assert len(admin.trace_ids) == 30  # the request metrics count every request
    stats = pipeline.telemetry.snapshot()
    dropped_random = metric_key(semconv.SELF_METRIC_SAMPLING_DROPPED_RANDOM)
    assert stats[dropped_random] == stats["traces"] == 30
    clock.now += 60
    pipeline.housekeeping()
    assert segment_files(spool_dir) == []  # a dropped trace is done with, like an exported one
    pipeline.shutdown()


class _ItemSink(RecordingSink):
    """Keeps the items it got."""

    def __init__(self) -> None:
        super().__init__()
        self.items: list[ProcessedTrace] = []

    def export_traces(self, batch: Any) -> None:
        super().export_traces(batch)
        self.items.extend(batch)


def test_only_kept_traces_are_enriched_and_encoded(monkeypatch: pytest.MonkeyPatch) -> None:
    from tokentrace.collector import pipeline as pipeline_module

    enriched: list[bytes] = []
    enrichment = pipeline_module.enrichment_attributes

    def counted(record: RequestRecord) -> bytes:
        enriched.append(record.timeline.trace_id)
        return enrichment(record)

    monkeypatch.setattr(pipeline_module, "enrichment_attributes", counted)
    clock = FakeClock()
    store, admin = _ItemSink(), _ItemSink()
    config = parse_config(
        {
            "processors": {"tail_sampling": {**_DROP_ALL, "random_share": 0.5}},
            "extensions": {"admin": {"endpoint": "127.0.0.1:0"}},
        },
        environ={},
    )
    pipeline = Pipeline(config, sinks={"store": store, "admin": admin}, monotonic=clock)
    consume(pipeline, range(1, 41))
    clock.now += 60
    assert pipeline.process_once() == 40
    kept = {item.trace.trace_id for item in store.items}
    assert 0 < len(kept) < 40 and len(admin.items) == 40
    assert sorted(enriched) == sorted(kept)  # the dropped traces' spans were never enriched
    unsampled = Pipeline(parse_config({}, environ={}))
    for item in admin.items:
        if item.trace.trace_id in kept:
            assert item.encoded
            processed = unsampled.process_trace(item.trace)
            assert processed is not None and item.otlp == processed.otlp  # as without sampling
        else:
            assert not item.encoded and item.otlp == b""
    pipeline.shutdown()


def test_the_snapshot_keys_are_what_the_summary_reads() -> None:
    telemetry = SelfTelemetry()
    Pipeline(parse_config({"processors": {"tail_sampling": {}}}, environ={}), telemetry=telemetry)
    snapshot = telemetry.snapshot()
    expected = {metric_key(name) for name in KEPT_METRICS.values()}
    expected |= {metric_key(name) for name in DROPPED_METRICS.values()}
    assert set(KEPT_METRICS) == set(KEEP_REASONS) and set(DROPPED_METRICS) == set(DROP_REASONS)
    assert expected <= set(snapshot)
    assert metric_key(semconv.SELF_METRIC_SAMPLING_KEYS_EVICTED) in snapshot
    summary = sampling_summary(snapshot)
    assert summary is not None and summary["traces"] == 0 and summary["kept_share"] is None
    assert sampling_summary({"received_spans": 1, "traces": 1}) is None  # sampling off


def test_the_sampling_line_names_the_share_and_the_reasons() -> None:
    stats = {
        "received_spans": 10,
        "sampling_kept_breach": 40,
        "sampling_kept_slowest": 120,
        "sampling_kept_rare": 15,
        "sampling_kept_random": 325,
        "sampling_dropped_random": 3500,
    }
    summary = sampling_summary(stats)
    assert summary is not None
    assert summary["kept"] == 500 and summary["traces"] == 4000
    assert summary["kept_share"] == pytest.approx(0.125)
    assert render_sampling_line(summary) == (
        "sampling: kept 12.5% of traces (breach 40, slowest 120, rare 15, random 325; dropped 3500)"
    )
    text = render_top({"window_s": 60, "keys": [], "collector": stats})
    assert "sampling: kept 12.5% of traces" in text
    assert "sampling" not in render_top({"window_s": 60, "keys": [], "collector": {}})


# --- a real collector -------------------------------------------------------------------------
REQUESTS = 400
TARGETS = [
    {"name": "ttft-p95", "metric": "ttft", "percentile": 95, "threshold": "400ms"},
    {"name": "e2e-p90", "metric": "e2e", "percentile": 90, "threshold": "3s"},
]
SAMPLING = {"random_share": 0.1, "slowest_per_window": 1, "rare_min_count": 1, "rare_share": 0.01}


def _failing(trace: bytes) -> bool:
    return trace[-1] % 20 == 0


def _traffic() -> list[ExportTraceServiceRequest]:
    """The replayed requests, one in about twenty failing (an error status on its request
    span)."""
    messages = to_otlp_requests(simulate("mixed", requests=REQUESTS, seed=7), batch_spans=64)
    for message in messages:
        for resource in message.resource_spans:
            for scope in resource.scope_spans:
                for span in scope.spans:
                    if span.name == semconv.SPAN_REQUEST and _failing(bytes(span.trace_id)):
                        span.status.code = span.status.STATUS_CODE_ERROR
                        span.status.message = "engine died"
    return messages


def _run(
    store: Path | str, messages: list[ExportTraceServiceRequest], sampling: Any
) -> dict[str, Any]:
    processors: dict[str, Any] = {
        "assembly": {"quiet_period": "200ms", "root_grace": "50ms"},
        "slo": {"targets": TARGETS},
    }
    if sampling is not None:
        processors["tail_sampling"] = sampling
    raw = {
        "receivers": {"otlp": {"protocols": {"grpc": {"endpoint": "127.0.0.1:0"}}}},
        "processors": processors,
        "exporters": {"store": {"path": str(store)}},
        "service": {"durability": {"mode": "none"}},
    }
    collector = Collector(parse_config(raw, environ={}))
    collector.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{collector.grpc_port}") as channel:
            stub = TraceServiceStub(channel)
            for message in messages:
                stub.Export(message, timeout=30)
        collector.flush()
    finally:
        collector.shutdown()
    return collector.stats()


def _read(store_path: Path | str) -> dict[str, Any]:
    store = open_store_readonly(str(store_path))
    try:

        def trace_ids(query_filter: RequestFilter | None = None) -> set[str]:
            found: set[str] = set()
            cursor = None
            while True:
                query = RequestPageQuery(limit=500, cursor=cursor)
                if query_filter is not None:
                    query = RequestPageQuery(filter=query_filter, limit=500, cursor=cursor)
                page = store.list_requests(query)
                found.update(str(item["trace_id"]) for item in page.items)
                cursor = page.next_cursor
                if cursor is None:
                    return found

        report = all_time_report(store)
        return {
            "all": trace_ids(),
            "breaching": trace_ids(RequestFilter(slo_breached=True)),
            "report": report,
        }
    finally:
        store.close()


@pytest.mark.slow
def test_a_sampled_store_keeps_what_matters_and_the_percentiles_stay_exact(
    tmp_path: Path, store_location: str, capsys: pytest.CaptureFixture[str]
) -> None:
    messages = _traffic()
    full_path, sampled_path = tmp_path / "full.db", store_location  # SQLite or PostgreSQL
    full_stats = _run(full_path, messages, None)
    stats = _run(sampled_path, messages, SAMPLING)
    full, sampled = _read(full_path), _read(sampled_path)

    assert len(full["all"]) == REQUESTS
    failing = {t for t in full["all"] if _failing(bytes.fromhex(t))}
    assert failing and full["breaching"]
    # Every breaching or failed request is stored; of the rest, far fewer.
    assert full["breaching"] | failing <= sampled["all"]
    assert sampled["breaching"] == full["breaching"]
    ordinary = full["all"] - full["breaching"] - failing
    kept_ordinary = sampled["all"] - full["breaching"] - failing
    assert len(kept_ordinary) < len(ordinary) / 2
    # The sketches saw every request: percentiles and SLO figures equal the unsampled run's.
    assert sampled["report"]["requests"] == full["report"]["requests"] == REQUESTS
    assert sampled["report"]["keys"] == full["report"]["keys"]
    assert sampled["report"]["slo"] == full["report"]["slo"]

    summary = sampling_summary(stats)
    assert summary is not None and sampling_summary(full_stats) is None
    assert summary["kept"] + summary["dropped"] == stats["traces"] == full_stats["traces"]
    assert summary["kept"] == len(sampled["all"])  # one request per trace in this traffic
    assert summary["kept_by_reason"][KEEP_BREACH] >= len(full["breaching"] | failing)
    assert summary["dropped"] > 0

    # The fleet view and ``tokentrace top`` say what share was kept.
    app = create_app(ApiSettings(store_path=str(sampled_path)))
    with TestClient(app) as client:
        fleet = client.get("/api/v1/fleet", params={"last": "24h"})
    assert fleet.status_code == 200, fleet.text
    assert fleet.json()["sampling"] == json.loads(json.dumps(summary))
    assert main(["top", "--once", "--window", "24h", "--store", str(sampled_path)]) == 0
    out = capsys.readouterr().out
    assert f"sampling: kept {summary['kept_share'] * 100:.3g}% of traces" in out
    assert main(["top", "--json", "--window", "24h", "--store", str(full_path)]) == 0
    assert json.loads(capsys.readouterr().out)["sampling"] is None
    # A dropped trace is not in the store: explain says so.
    dropped = sorted(ordinary - kept_ordinary)[0]
    assert main(["explain", dropped, "--store", str(sampled_path)]) != 0
    assert f"no request with trace id {dropped}" in capsys.readouterr().err
