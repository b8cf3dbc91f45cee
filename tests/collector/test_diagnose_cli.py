"""``tokentrace diagnose`` / ``tokentrace compare`` and what they read: the store's window
queries, run records and SLO files.

One store per module, filled by the real collector from replayed traces (client spans
included); run records are written here from that store's own requests, so every expected
number is derived in the test from what the store holds.
"""

from __future__ import annotations

import itertools
import json
import sqlite3
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tests.api.replayed import SLO_TARGETS, collector_config, post_messages, replayed_store
from tests.collector.test_cli_read import run_cli
from tests.collector.upstream import iter_spans
from tokentrace.agent import semconv
from tokentrace.collector.config import ConfigError, load_config, parse_config
from tokentrace.collector.diagnose import client_only_requests, diagnose_run
from tokentrace.collector.service import Collector
from tokentrace.collector.store import RequestStore
from tokentrace.collector.store.contract import META_DIAGNOSIS, diagnosis_to_json
from tokentrace.collector.store.row import request_start_ns
from tokentrace.collector.window import records_of_traces
from tokentrace.loadgen import record as run_record
from tokentrace.loadgen.replay.emit import to_otlp_requests
from tokentrace.loadgen.replay.simulation import simulate
from tokentrace.loadgen.results import CLIENT_METRICS, RequestResult, summarize
from tokentrace.loadgen.workload import LoadConfig
from tokentrace.processors.diagnosis import DiagnosisConfig
from tokentrace.processors.model import RequestRecord
from tokentrace.processors.slo import read_slo_file

REQUESTS = 120
NS_PER_US = 1_000
STORE_TARGET_NAMES = [str(target["name"]) for target in SLO_TARGETS]
UNKNOWN_TRACE_IDS = ("ab" * 16, "cd" * 16)
DIRECTIONS = {"shrank", "grew", "same"}


@dataclass(frozen=True)
class Replayed:
    path: Path
    records: list[RequestRecord]
    """Every stored request, oldest first."""

    @property
    def trace_ids(self) -> list[bytes]:
        return [record.timeline.trace_id for record in self.records]


@pytest.fixture(scope="module")
def replayed(tmp_path_factory: pytest.TempPathFactory) -> Replayed:
    path = replayed_store(
        tmp_path_factory.mktemp("diagnose") / "tokentrace.db",
        scenario="mixed",
        requests=REQUESTS,
        seed=5,
    )
    store = RequestStore.open_readonly(path)
    try:
        trace_ids, cut = store.trace_ids_between(0, None, limit=10 * REQUESTS)
        window = records_of_traces(store, trace_ids)
    finally:
        store.close()
    assert not cut and window.undecodable == 0
    records = sorted(window.records, key=lambda record: request_start_ns(record.timeline))
    assert len(records) == REQUESTS
    return Replayed(path, records)


# --- run records ----------------------------------------------------------------------------------
def result_of(record: RequestRecord, index: int) -> RequestResult:
    """What the load generator measured for a stored request (its client span's times)."""
    timeline = record.timeline
    assert timeline.client_start is not None and timeline.client_end is not None
    offsets = timeline.token_offsets_us
    first = timeline.client_first_token
    return RequestResult(
        index=index,
        trace_id=timeline.trace_id.hex(),
        span_id=timeline.span_id.hex(),
        operation=timeline.operation,
        shared_prefix=timeline.prefix_hash is not None,
        max_tokens=1024,
        start_ns=timeline.client_start,
        end_ns=timeline.client_end,
        first_token_ns=first,
        last_token_ns=None if first is None or not offsets else first + offsets[-1] * NS_PER_US,
        chunk_gaps_ns=[(b - a) * NS_PER_US for a, b in itertools.pairwise(offsets)],
        status=200,
        prompt_tokens=timeline.input_tokens,
        output_tokens=timeline.output_tokens,
    )


def write_run(
    path: Path,
    records: list[RequestRecord],
    *,
    seed: int = 1,
    extra: tuple[RequestResult, ...] = (),
) -> Path:
    """A run record of ``records`` (plus ``extra`` results) as ``tokentrace load`` saves one."""
    model = records[0].timeline.model
    config = LoadConfig(
        base_url="http://127.0.0.1:8000",
        model=model,
        concurrency=8,
        requests=len(records) + len(extra),
        seed=seed,
    )
    results = [result_of(record, index) for index, record in enumerate(records)] + list(extra)
    start = min(result.start_ns for result in results)
    end = max(result.end_ns for result in results)
    run = run_record.RunRecord(
        config=config.to_dict(),
        identity=config.load_identity(),
        model=model,
        window_start_ns=start,
        window_end_ns=end,
        summary=summarize(results, duration_ns=end - start),
        results=results,
    )
    return run_record.save(run, path)


def unknown_result(trace_id: str, index: int, *, error: str | None = None) -> RequestResult:
    return RequestResult(
        index=index,
        trace_id=trace_id,
        span_id="11" * 8,
        operation=semconv.OPERATION_CHAT,
        shared_prefix=False,
        max_tokens=16,
        start_ns=1,
        end_ns=2,
        error=error,
    )


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    code, out, err = run_cli(capsys, *argv, "--json")
    assert code == 0, err
    document: dict[str, Any] = json.loads(out)
    return document


def test_run_record_round_trip(tmp_path: Path, replayed: Replayed) -> None:
    path = write_run(tmp_path / "nested" / "run.json", replayed.records[:5], seed=9)
    loaded = run_record.load(path)
    assert loaded.trace_ids == [r.timeline.trace_id.hex() for r in replayed.records[:5]]
    assert loaded.results == [result_of(r, i) for i, r in enumerate(replayed.records[:5])]
    assert loaded.identity["seed"] == 9
    assert loaded.model == replayed.records[0].timeline.model
    assert not list(path.parent.glob(".*.tmp"))  # the temporary file was renamed away


# --- store queries --------------------------------------------------------------------------------
def test_trace_ids_between_honours_since_and_until(replayed: Replayed) -> None:
    starts = {r.timeline.trace_id: request_start_ns(r.timeline) for r in replayed.records}
    middle = request_start_ns(replayed.records[REQUESTS // 2].timeline)
    store = RequestStore.open_readonly(replayed.path)
    try:
        later, later_cut = store.trace_ids_between(middle, None, limit=REQUESTS)
        earlier, earlier_cut = store.trace_ids_between(0, middle, limit=REQUESTS)
        nothing, _ = store.trace_ids_between(middle, middle, limit=REQUESTS)
    finally:
        store.close()
    assert not later_cut and not earlier_cut
    assert set(later) == {trace_id for trace_id, start in starts.items() if start >= middle}
    assert set(earlier) == {trace_id for trace_id, start in starts.items() if start < middle}
    assert len(later) + len(earlier) == REQUESTS and not set(later) & set(earlier)
    assert nothing == []  # [since, until) with since == until is empty
    # Most recent first.
    later_starts = [starts[trace_id] for trace_id in later]
    assert later_starts == sorted(later_starts, reverse=True)


@pytest.mark.parametrize(("limit", "cut"), [(10, True), (REQUESTS - 1, True), (REQUESTS, False)])
def test_trace_ids_between_keeps_the_most_recent_and_reports_the_cut(
    replayed: Replayed, limit: int, cut: bool
) -> None:
    store = RequestStore.open_readonly(replayed.path)
    try:
        found, was_cut = store.trace_ids_between(0, None, limit=limit)
    finally:
        store.close()
    assert was_cut is cut
    assert found == replayed.trace_ids[::-1][:limit]


def test_traces_otlp_returns_only_stored_traces_across_batches(replayed: Replayed) -> None:
    known = replayed.trace_ids
    unknown = [index.to_bytes(16, "big") for index in range(1, 701)]
    # Known ids on both sides of the 500-id batch boundary, one of them twice.
    asked = unknown[:450] + known + unknown[450:] + [known[0]]
    store = RequestStore.open_readonly(replayed.path)
    try:
        found = list(store.traces_otlp(asked))
        none = list(store.traces_otlp([]))
    finally:
        store.close()
    assert none == []
    assert sorted(trace_id for trace_id, _ in found) == sorted(known)
    for trace_id, otlp in found:
        message = ExportTraceServiceRequest.FromString(otlp)
        spans = [
            span
            for resource_spans in message.resource_spans
            for scope_spans in resource_spans.scope_spans
            for span in scope_spans.spans
        ]
        assert {span.trace_id for span in spans} == {trace_id}
        assert semconv.SPAN_CLIENT_REQUEST in {span.name for span in spans}


# --- tokentrace diagnose --------------------------------------------------------------------------
def test_diagnose_time_window_json(capsys: pytest.CaptureFixture[str], replayed: Replayed) -> None:
    document = run_json(capsys, "diagnose", "--since", "1h", "--store", str(replayed.path))
    assert document["requests"] == REQUESTS
    assert document["window"]["traces_found"] == REQUESTS
    assert document["window"]["cut_at"] is None
    assert document["metrics"][semconv.METRIC_E2E]["count"] == REQUESTS
    assert semconv.SEGMENT_NETWORK in document["segments"]
    assert [entry["target"] for entry in document["slo"]] == STORE_TARGET_NAMES
    # One finding per target, breached ones first, each naming a segment of its own metric.
    findings = document["findings"]
    assert sorted(f["target"] for f in findings) == sorted(STORE_TARGET_NAMES)
    met = [f["met"] for f in findings]
    assert met == sorted(met, key=lambda value: {False: 0, True: 1, None: 2}[value])
    ttft = next(f for f in findings if f["metric"] == semconv.METRIC_TTFT)
    assert ttft["segment"] in {
        semconv.SEGMENT_HTTP,
        semconv.SEGMENT_COLD_START,
        semconv.SEGMENT_QUEUE,
        semconv.SEGMENT_PREFILL,
        semconv.SEGMENT_PREEMPTED,
    }
    assert ttft["counterfactual"]["without_ms"] <= ttft["counterfactual"]["value_ms"]
    # The metrics without a target get their typical and tail findings.
    assert {(f["metric"], f["group"]) for f in document["metric_findings"]} >= {
        (semconv.METRIC_E2E, "typical"),
        (semconv.METRIC_E2E, "tail"),
    }
    assert document["perceived"]["requests"] == REQUESTS


def test_diagnose_time_window_text(capsys: pytest.CaptureFixture[str], replayed: Replayed) -> None:
    code, out, err = run_cli(capsys, "diagnose", "--since", "1h", "--store", str(replayed.path))
    assert code == 0, err
    lines = out.splitlines()
    assert f"{REQUESTS:,} requests" in lines[0]
    assert "Targets (breached first): what dominates each target's metric" in lines
    assert any(line.startswith("budget segment (ms)") for line in lines)
    for segment in (semconv.SEGMENT_NETWORK, semconv.SEGMENT_QUEUE, semconv.SEGMENT_DECODE):
        assert any(line.split()[:2] == [segment, f"{REQUESTS:,}"] for line in lines), segment
    assert any(line.startswith("  typical E2E:") for line in lines)
    assert any("without" in line and "fix" in line for line in lines)  # the counterfactual
    assert all(name in out for name in STORE_TARGET_NAMES)
    assert "no client spans" not in out


def test_diagnose_judges_the_window_by_the_collectors_diagnosis_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], replayed: Replayed
) -> None:
    # The same requests in a store whose collector diagnoses tails from p80 on.
    copy = tmp_path / "copy.db"
    with closing(sqlite3.connect(replayed.path)) as source, closing(sqlite3.connect(copy)) as to:
        source.backup(to)
    store = RequestStore(copy)
    try:
        store.set_meta(META_DIAGNOSIS, diagnosis_to_json(DiagnosisConfig(tail_percentile=80.0)))
    finally:
        store.close()

    def tail_percentiles(document: dict[str, Any]) -> set[float]:
        return {f["percentile"] for f in document["metric_findings"] if f["group"] == "tail"}

    default = run_json(capsys, "diagnose", "--since", "1h", "--store", str(replayed.path))
    tuned = run_json(capsys, "diagnose", "--since", "1h", "--store", str(copy))
    assert tail_percentiles(default) == {DiagnosisConfig().tail_percentile}
    assert tail_percentiles(tuned) == {80.0}
    assert tuned["requests"] == default["requests"] == REQUESTS


def test_diagnose_until_ends_the_window_earlier(
    capsys: pytest.CaptureFixture[str], replayed: Replayed
) -> None:
    # The replayed requests are all from the last minutes: none started over 30 minutes ago.
    store = str(replayed.path)
    document = run_json(capsys, "diagnose", "--since", "1h", "--until", "30m", "--store", store)
    assert document["requests"] == 0
    assert document["metric_findings"] == []
    assert all(finding["met"] is None for finding in document["findings"])
    code, out, _ = run_cli(capsys, "diagnose", "--since", "1h", "--until", "30m", "--store", store)
    assert code == 0 and "0 requests" in out and "Targets" not in out


def test_diagnose_run_selects_its_requests_and_says_what_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], replayed: Replayed
) -> None:
    chosen = replayed.records[:40]
    extra = (
        unknown_result(UNKNOWN_TRACE_IDS[0], 40),
        unknown_result(UNKNOWN_TRACE_IDS[1], 41),
        # A failed request is not looked for, even when its trace is stored.
        unknown_result(replayed.records[-1].timeline.trace_id.hex(), 42, error="timeout: 30 s"),
    )
    run = write_run(tmp_path / "run.json", chosen, extra=extra)
    store = str(replayed.path)
    document = run_json(capsys, "diagnose", "--run", str(run), "--store", store, "--wait", "0")
    window = document["window"]
    assert window["run_requests"] == 43
    assert window["traces_asked"] == 42
    assert window["traces_found"] == 40 < window["traces_asked"]
    assert document["requests"] == 40
    assert document["metrics"][semconv.METRIC_E2E]["count"] == 40
    assert document["run"]["model"] == chosen[0].timeline.model
    # The client measured every successful request, stored or not.
    assert document["run"]["client"][semconv.METRIC_E2E]["count"] == 42

    code, out, err = run_cli(capsys, "diagnose", "--run", str(run), "--store", store, "--wait", "0")
    assert code == 0, err
    assert "note: 40 of the run's 42 completed requests are in the store" in out


def test_diagnose_missing_store_fails_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nowhere.db"
    code, out, err = run_cli(capsys, "diagnose", "--since", "1h", "--store", str(missing))
    assert code == 2
    assert err.startswith("tokentrace diagnose:") and str(missing) in err
    assert "Traceback" not in err and out == ""
    assert not missing.exists()  # a reader never creates a store


@pytest.mark.parametrize(
    "content",
    [
        "this is not JSON",
        '{"kind": "something else", "version": 1}',
        '{"kind": "tokentrace.load.run", "version": 1}',  # the right kind, but no fields
        '{"kind": "tokentrace.load.run", "version": 99}',
    ],
)
def test_diagnose_rejects_a_file_that_is_not_a_run_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], replayed: Replayed, content: str
) -> None:
    path = tmp_path / "bogus.json"
    path.write_text(content, encoding="utf-8")
    code, _, err = run_cli(capsys, "diagnose", "--run", str(path), "--store", str(replayed.path))
    assert code == 2
    assert str(path) in err and "Traceback" not in err


def test_diagnose_until_needs_since(capsys: pytest.CaptureFixture[str], replayed: Replayed) -> None:
    code, _, err = run_cli(capsys, "diagnose", "--until", "5m", "--store", str(replayed.path))
    assert code == 2
    assert "--until needs --since" in err


def test_diagnose_slo_file_replaces_the_stores_targets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], replayed: Replayed
) -> None:
    slo_file = tmp_path / "slo.yaml"
    slo_file.write_text(
        "targets:\n"
        "  - {name: e2e-within-an-hour, metric: e2e, percentile: 50, threshold: 1h}\n"
        "  - {name: network-p90, metric: network, percentile: 90, threshold: 1ns}\n",
        encoding="utf-8",
    )
    args = ("diagnose", "--since", "1h", "--store", str(replayed.path), "--slo", str(slo_file))
    document = run_json(capsys, *args)
    slo = {entry["target"]: entry for entry in document["slo"]}
    assert list(slo) == ["e2e-within-an-hour", "network-p90"]
    assert slo["e2e-within-an-hour"]["met"] is True
    assert slo["e2e-within-an-hour"]["requests"] == REQUESTS
    assert slo["network-p90"]["met"] is False and slo["network-p90"]["compliance"] == 0.0

    code, out, _ = run_cli(capsys, *args)
    assert code == 0
    assert "e2e-within-an-hour" in out and "MISSED" in out
    assert not any(name in out for name in STORE_TARGET_NAMES)


def test_diagnose_bad_slo_file_fails_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], replayed: Replayed
) -> None:
    slo_file = tmp_path / "slo.yaml"
    slo_file.write_text(
        "targets:\n  - {name: x, metric: speed, percentile: 50, threshold: 1s}\n", encoding="utf-8"
    )
    code, _, err = run_cli(
        capsys, "diagnose", "--store", str(replayed.path), "--slo", str(slo_file)
    )
    assert code == 2
    assert "--slo:" in err and str(slo_file) in err and "Traceback" not in err


# --- tokentrace compare ---------------------------------------------------------------------------
def halves(tmp_path: Path, replayed: Replayed, *, seeds: tuple[int, int]) -> tuple[Path, Path]:
    half = REQUESTS // 2
    return (
        write_run(tmp_path / "a.json", replayed.records[:half], seed=seeds[0]),
        write_run(tmp_path / "b.json", replayed.records[half:], seed=seeds[1]),
    )


def test_compare_two_runs_of_the_same_load_with_the_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], replayed: Replayed
) -> None:
    run_a, run_b = halves(tmp_path, replayed, seeds=(1, 1))
    store = str(replayed.path)
    comparison = run_json(capsys, "compare", str(run_a), str(run_b), "--store", store)
    assert comparison["load_differences"] == []
    assert comparison["requests"] == {"a": REQUESTS // 2, "b": REQUESTS // 2}
    assert [row["metric"] for row in comparison["client"]] == list(CLIENT_METRICS)
    server = {row["metric"]: row for row in comparison["server"]}
    assert {semconv.METRIC_QUEUE, semconv.METRIC_PREFILL, semconv.METRIC_NETWORK} <= set(server)

    # The server side of A is exactly what ``diagnose --run A`` reports.
    diagnosis_a = run_json(capsys, "diagnose", "--run", str(run_a), "--store", store)
    assert server[semconv.METRIC_E2E]["a"] == diagnosis_a["metrics"][semconv.METRIC_E2E]

    segments = comparison["segments"]
    assert {row["segment"] for row in segments} == set(diagnosis_a["segments"])
    for row in segments:
        assert row["direction"] in DIRECTIONS
        assert row["delta_mean_ms"] == pytest.approx(row["b_mean_ms"] - row["a_mean_ms"], abs=1e-3)
        if abs(row["delta_mean_ms"]) < 0.5:
            assert row["direction"] == "same"
        else:
            assert row["direction"] == ("grew" if row["delta_mean_ms"] > 0 else "shrank")
    deltas = [abs(row["delta_mean_ms"]) for row in segments]
    assert deltas == sorted(deltas, reverse=True)
    assert [pair["target"] for pair in comparison["slo"]] == STORE_TARGET_NAMES

    code, out, err = run_cli(capsys, "compare", str(run_a), str(run_b), "--store", store)
    assert code == 0, err
    assert "Same load" in out and "WARNING" not in out
    assert "client side" in out and "server side (collector)" in out
    assert "Budget segments (mean per request):" in out
    assert "Dominant segment before (A) and after (B):" in out
    rows = comparison["findings"]
    assert sorted(row["target"] for row in rows) == sorted(STORE_TARGET_NAMES)
    for row in rows:
        assert row["direction"] in DIRECTIONS
        assert row["a_segment"] and row["sentence"].startswith(row["target"])


def test_compare_warns_when_the_loads_differ(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], replayed: Replayed
) -> None:
    run_a, run_b = halves(tmp_path, replayed, seeds=(1, 2))
    store = str(replayed.path)
    comparison = run_json(capsys, "compare", str(run_a), str(run_b), "--store", store)
    assert comparison["load_differences"] == [{"field": "seed", "a": 1, "b": 2}]
    code, out, _ = run_cli(capsys, "compare", str(run_a), str(run_b), "--store", store)
    assert code == 0
    warning = out.index("WARNING")
    assert "seed: A 1, B 2" in out[warning:]


def test_compare_without_a_store_compares_the_client_side_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], replayed: Replayed
) -> None:
    run_a, run_b = halves(tmp_path, replayed, seeds=(1, 1))
    comparison = run_json(capsys, "compare", str(run_a), str(run_b))
    assert "server" not in comparison and "segments" not in comparison
    assert [row["metric"] for row in comparison["client"]] == list(CLIENT_METRICS)
    assert comparison["slo"] == []

    # With an SLO file the client judges the targets it can (E2E), not the server-only ones.
    slo_file = tmp_path / "slo.yaml"
    slo_file.write_text(
        "targets:\n"
        "  - {name: e2e-p50, metric: e2e, percentile: 50, threshold: 1h}\n"
        "  - {name: queue-p50, metric: queue, percentile: 50, threshold: 1s}\n",
        encoding="utf-8",
    )
    comparison = run_json(capsys, "compare", str(run_a), str(run_b), "--slo", str(slo_file))
    pairs = {pair["target"]: pair for pair in comparison["slo"]}
    assert list(pairs) == ["e2e-p50", "queue-p50"]
    assert pairs["e2e-p50"]["a"]["met"] is True and pairs["e2e-p50"]["b"]["met"] is True
    assert "note" in pairs["queue-p50"]["a"]

    code, out, _ = run_cli(capsys, "compare", str(run_a), str(run_b))
    assert code == 0
    assert "client side" in out and "server side" not in out


def test_compare_missing_run_record_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], replayed: Replayed
) -> None:
    run_a, _ = halves(tmp_path, replayed, seeds=(1, 1))
    missing = tmp_path / "missing.json"
    code, _, err = run_cli(capsys, "compare", str(run_a), str(missing))
    assert code == 2
    assert str(missing) in err and "Traceback" not in err


# --- SLO files in the collector configuration -----------------------------------------------------
SLO_FILE = "targets:\n  - {name: chat-ttft, metric: ttft, percentile: 95, threshold: 500ms}\n"


def test_slo_file_relative_to_the_config_files_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config_dir = tmp_path / "conf"
    (config_dir / "slo").mkdir(parents=True)
    (config_dir / "slo" / "targets.yaml").write_text(SLO_FILE, encoding="utf-8")
    config_path = config_dir / "collector.yaml"
    config_path.write_text("processors:\n  slo: {file: slo/targets.yaml}\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)  # the path would not resolve against the working directory
    config = load_config(config_path, environ={})
    (target,) = config.slo_targets
    assert (target.name, target.metric, target.percentile) == ("chat-ttft", "ttft", 95)
    assert target.threshold_ns == 500_000_000
    assert read_slo_file(config_dir / "slo" / "targets.yaml") == [target]


def test_slo_targets_and_file_together_are_rejected(tmp_path: Path) -> None:
    (tmp_path / "slo.yaml").write_text(SLO_FILE, encoding="utf-8")
    config_path = tmp_path / "collector.yaml"
    config_path.write_text(
        "processors:\n"
        "  slo:\n"
        "    file: slo.yaml\n"
        "    targets: [{name: x, metric: e2e, percentile: 50, threshold: 1s}]\n",
        encoding="utf-8",
    )
    with pytest.raises(ConfigError, match="not both"):
        load_config(config_path, environ={})


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("targets:\n  - {name: x, metric: speed, percentile: 50, threshold: 1s}\n", "metric"),
        ("targets:\n  - {name: x, metric: e2e, percentile: 50, threshold: fast}\n", "threshold"),
        ("- {name: x, metric: e2e, percentile: 50, threshold: 1s}\n", "targets"),
        ("targets: []\nextra: 1\n", "targets"),
        (None, "cannot read"),
    ],
)
def test_bad_slo_file_is_a_config_error_naming_the_file(
    tmp_path: Path, content: str | None, problem: str
) -> None:
    slo_path = tmp_path / "slo.yaml"
    if content is not None:
        slo_path.write_text(content, encoding="utf-8")
    config_path = tmp_path / "collector.yaml"
    config_path.write_text("processors:\n  slo: {file: slo.yaml}\n", encoding="utf-8")
    with pytest.raises(ConfigError) as raised:
        load_config(config_path, environ={})
    assert str(slo_path) in str(raised.value)
    assert problem in str(raised.value)


def test_a_span_stored_twice_is_one_request_when_the_window_is_re_derived(
    replayed: Replayed, tmp_path: Path
) -> None:
    from tokentrace.collector.pipeline import group_by_trace
    from tokentrace.processors.model import AssembledTrace

    trace_id = replayed.trace_ids[0]
    store = RequestStore.open_readonly(replayed.path)
    try:
        otlp = store.trace_otlp(trace_id)
    finally:
        store.close()
    assert otlp is not None
    groups, _ = group_by_trace(ExportTraceServiceRequest.FromString(otlp))
    # A retried export delivered the trace's spans again after it was assembled.
    again = AssembledTrace(trace_id, groups[trace_id], late=True)
    copy = RequestStore(tmp_path / "copy.db")
    try:
        copy.write([(again, [], otlp)])
        copy.write([(again, [], otlp)])
        stored = copy.trace_otlp(trace_id)
        assert stored is not None and len(stored) == 2 * len(otlp)
        window = records_of_traces(copy, [trace_id])
    finally:
        copy.close()
    original = [r for r in replayed.records if r.timeline.trace_id == trace_id]
    assert len(window.records) == len(original) >= 1
    assert window.records[0].budget.e2e_ns == original[0].budget.e2e_ns


def _split_server_spans(
    messages: list[ExportTraceServiceRequest], late: set[bytes]
) -> tuple[list[ExportTraceServiceRequest], list[ExportTraceServiceRequest]]:
    """``messages`` without the server spans of the ``late`` traces, and those spans alone."""
    first, rest = [], []
    for message in messages:
        early, later = ExportTraceServiceRequest(), ExportTraceServiceRequest()
        early.CopyFrom(message)
        later.CopyFrom(message)
        for kept, keep_late in ((early, False), (later, True)):
            for resource_spans in kept.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    spans = [
                        span
                        for span in scope_spans.spans
                        if (span.trace_id in late and span.kind != Span.SPAN_KIND_CLIENT)
                        is keep_late
                    ]
                    del scope_spans.spans[:]
                    scope_spans.spans.extend(spans)
        first.append(early)
        rest.append(later)
    return first, rest


def test_diagnose_run_waits_for_client_only_requests_to_join_their_server_spans(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The collector stores a trace once its first spans are quiet: a request whose client span
    came first is client-only until its server's spans join it. ``diagnose --run`` says so, and
    waits for them."""
    messages = to_otlp_requests(simulate("mixed", requests=30, seed=7))
    trace_ids = list(dict.fromkeys(span.trace_id for _, _, span in iter_spans(messages)))
    late = set(trace_ids[:10])
    first, rest = _split_server_spans(messages, late)
    path = tmp_path / "tokentrace.db"
    collector = Collector(parse_config(collector_config(path), environ={}))
    collector.start()
    try:
        post_messages(collector, first)
        collector.flush()
        store = RequestStore.open_readonly(path)
        try:
            window = records_of_traces(store, trace_ids)
            assert client_only_requests(window.records) == 10
            run = run_record.load(write_run(tmp_path / "run.json", window.records))

            code, out, err = run_cli(
                capsys, "diagnose", "--run", str(tmp_path / "run.json"), "--store", str(path),
                "--wait", "0",
            )  # fmt: skip
            assert code == 0, err
            assert "note: 10 of them have only their client span in the store" in out

            waits: list[float] = []

            def sleep(seconds: float) -> None:  # the server spans arrive while diagnose waits
                if not waits:
                    post_messages(collector, rest)
                    collector.flush()
                waits.append(seconds)

            analysis = diagnose_run(store, run, targets=[], wait_s=30.0, sleep=sleep)
        finally:
            store.close()
    finally:
        collector.shutdown()
    assert len(waits) == 1
    assert analysis["window"]["traces_found"] == 30
    assert analysis["window"]["client_only"] == 0
    assert analysis["requests"] == 30
    assert analysis["segments"][semconv.SEGMENT_QUEUE]["count"] == 30  # server segments for all
