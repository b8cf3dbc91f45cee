"""``tokentrace explain`` / ``tokentrace top`` against a filled store, and their rendering."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.collector.test_store import (
    BASE_NS,
    MS,
    assembled,
    make_record,
    make_rich_record,
    sketch_of,
    trace_id,
)
from tokentrace.agent import semconv
from tokentrace.agent.cli import main
from tokentrace.collector import cli as collector_cli
from tokentrace.collector.render import (
    ASCII_GLYPHS,
    UNICODE_GLYPHS,
    draw_bar,
    glyphs_for,
    render_budget_table,
    render_explain,
    render_waterfall,
    waterfall_rows,
)
from tokentrace.collector.render_top import render_top
from tokentrace.collector.store import RequestStore, record_to_dict
from tokentrace.processors.durations import parse_duration_ns
from tokentrace.processors.sketches import SketchKey

SLO_TARGETS = [
    {"name": "chat-ttft-p95", "metric": "ttft", "percentile": 95, "threshold": "500ms"},
    {
        "name": "qwen-e2e",
        "metric": "e2e",
        "percentile": 50,
        "threshold": "10s",
        "selector": {"model": "qwen"},
    },
]


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    """Three requests (1: slow queue, 2: slow decode, 3: small) and a minute of sketches."""
    path = tmp_path / "tokentrace.db"
    store = RequestStore(path)
    records = [
        make_record(1, queue_ms=800, decode_ms=50),
        make_record(2, queue_ms=20, decode_ms=2000),
        make_record(3, queue_ms=5, decode_ms=5),
    ]
    store.write([(assembled(r), [r]) for r in records])
    now = int(time.time())
    llama = SketchKey("svc", "llama", semconv.OPERATION_CHAT, "128-511")
    qwen = SketchKey("svc", "qwen", semconv.OPERATION_CHAT, "0-127")
    store.write_sketch_slices(
        [
            (now - 20, llama, "ttft", sketch_of([100.0] * 60 + [300.0] * 40)),
            (now - 10, llama, "ttft", sketch_of([300.0] * 100)),
            (now - 10, llama, "e2e", sketch_of([1000.0] * 200)),
            (now - 10, qwen, "ttft", sketch_of([2000.0] * 10)),
            (now - 10, qwen, "e2e", sketch_of([4000.0] * 10)),
            # Outside a 60 s window: must not count.
            (now - 600, llama, "ttft", sketch_of([99999.0] * 1000)),
        ]
    )
    store.set_meta("slo_targets", json.dumps(SLO_TARGETS))
    store.close()
    return path


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --- explain ----------------------------------------------------------------------------------


def test_explain_prints_verdict_waterfall_and_budget(
    store_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "explain", trace_id(1).hex()[:10], "--store", str(store_path))
    assert code == 0, err
    assert "queue wait was 800 ms: 7 requests ahead" in out
    assert "add capacity" in out
    assert trace_id(1).hex() in out
    lines = out.splitlines()
    assert any(line.startswith("queue") and "800.0 ms" in line for line in lines)
    budget_queue = next(line for line in lines if re.match(r"queue\s+800\.0\s+\d", line))
    # queue: 800 of E2E 2+800+50+50+1 = 903 ms; of TTFT 852 ms.
    assert "88.6%" in budget_queue and "93.9%" in budget_queue
    assert "\x1b[" not in out  # not a tty: no colour


def test_explain_json_prints_the_stored_document(
    store_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_cli(
        capsys, "explain", trace_id(2).hex(), "--json", "--store", str(store_path)
    )
    assert code == 0
    doc = json.loads(out)
    # Built at read time from the stored row and spans: the same document as the record's.
    expected = record_to_dict(make_record(2, queue_ms=20, decode_ms=2000))
    assert doc == {**expected, "other_span_ids": []}
    assert doc["token_offsets_us"] == make_record(2, decode_ms=2000).timeline.token_offsets_us


def test_explain_slowest_by_metric(store_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = str(store_path)
    code, out, _ = run_cli(capsys, "explain", "--slowest", "--json", "--store", store)
    assert code == 0 and json.loads(out)["trace_id"] == trace_id(2).hex()  # largest E2E
    code, out, _ = run_cli(
        capsys, "explain", "--slowest", "--metric", "ttft", "--json", "--store", store
    )
    assert code == 0 and json.loads(out)["trace_id"] == trace_id(1).hex()  # largest TTFT
    code, out, _ = run_cli(capsys, "explain", "--slowest", "--limit", "3", "--store", store)
    assert code == 0
    order = [trace_id(n).hex() for n in (2, 1, 3)]
    positions = [out.index(tid) for tid in order]
    assert positions == sorted(positions)


def test_explain_slowest_since_excludes_old_requests(
    store_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The fixture's requests started in 2023: none is within the last hour.
    code, _, err = run_cli(
        capsys, "explain", "--slowest", "--since", "1h", "--store", str(store_path)
    )
    assert code == 2
    assert "no requests" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["explain", "ffffffffff"], "no request with trace id ffffffffff"),
        (["explain", "abc"], "at least 8"),
        (["explain", "zzzzzzzzzz"], "not hexadecimal"),
        (["explain"], "give a TRACE_ID or --slowest"),
        (["explain", "ffffffffff", "--slowest"], "give a TRACE_ID or --slowest"),
    ],
)
def test_explain_errors_exit_2_with_a_message(
    store_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, out, err = run_cli(capsys, *argv, "--store", str(store_path))
    assert code == 2
    assert message in err
    assert out == ""
    assert "Traceback" not in err


def test_read_commands_without_a_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nothing.db"
    for argv in (["explain", "--slowest"], ["top", "--once"], ["top", "--json"]):
        code, _, err = run_cli(capsys, *argv, "--store", str(missing))
        assert code == 2
        assert f"no store at {missing}" in err
    assert not missing.exists()


# --- top ----------------------------------------------------------------------------------------


def test_top_json_reports_window_percentiles_and_slos(
    store_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "top", "--json", "--store", str(store_path))
    assert code == 0, err
    report = json.loads(out)
    assert report["window_s"] == 60
    keys = {k["model"]: k for k in report["keys"]}
    assert set(keys) == {"llama", "qwen"}
    llama_ttft = keys["llama"]["metrics"]["ttft"]
    assert llama_ttft["count"] == 200  # the slice from 10 minutes ago is outside the window
    # 60 of 200 values are 100 ms, 140 are 300 ms.
    assert llama_ttft["p50"] == pytest.approx(300, rel=0.02)
    assert llama_ttft["p99"] == pytest.approx(300, rel=0.02)
    assert keys["llama"]["requests"] == 200
    slo = {entry["target"]: entry for entry in report["slo"]}
    # 10 of 210 chat TTFTs are 2 s: 95.2% compliance meets a p95 < 500 ms target.
    assert slo["chat-ttft-p95"]["met"] is True
    assert slo["chat-ttft-p95"]["requests"] == 210
    assert slo["chat-ttft-p95"]["compliance"] == pytest.approx(200 / 210, abs=0.005)
    assert slo["qwen-e2e"]["met"] is True and slo["qwen-e2e"]["requests"] == 10


def test_top_once_prints_a_table_with_slo_marks(
    store_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "160")
    code, out, _ = run_cli(capsys, "top", "--once", "--store", str(store_path))
    assert code == 0
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("model"))
    for column in ("count", "TTFT p50", "TPOT p50", "ITL p99", "E2E p50", "SLO"):
        assert column in header
    llama = next(line for line in lines if line.startswith("llama"))
    qwen = next(line for line in lines if line.startswith("qwen"))
    assert " 200 " in llama
    # qwen's own TTFT p95 is 2 s: the chat target is breached for that key.
    assert "chat-ttft-p95" in qwen
    assert "chat-ttft-p95" in out.split("\n\n", 1)[1]  # the per-target summary


def test_top_window_can_be_empty(store_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Only slices from the last ~20 s exist; a 1 s window starting now holds none of them.
    code, out, err = run_cli(capsys, "top", "--once", "--window", "1s", "--store", str(store_path))
    assert code == 0, err
    assert "no requests in the last 1 s" in out
    code, out, _ = run_cli(capsys, "top", "--json", "--window", "1s", "--store", str(store_path))
    assert json.loads(out)["keys"] == []


def test_top_live_refreshes_until_interrupted(
    store_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sleeps: list[float] = []

    def fake_sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(collector_cli.time, "sleep", fake_sleep)
    code, out, _ = run_cli(capsys, "top", "--interval", "500ms", "--store", str(store_path))
    assert code == 0
    assert sleeps == [0.5, 0.5]
    assert out.count("tokentrace top") == 2
    assert "\x1b[2J" not in out  # not a tty: no screen clearing


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("60s", 60.0), ("500ms", 0.5), ("5m", 300.0), ("2min", 120.0), ("1h", 3600.0), ("3", 3.0)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert collector_cli.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "fast", "-1s", "0", "infs"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(Exception, match="duration"):
        collector_cli.parse_duration(text)


def test_cli_module_imports_the_contract_and_the_duration_parser_only() -> None:
    # ``--help`` stays fast: the standard library, the contract (plain constants) and the
    # duration parser; no protobuf, no other processors.
    code = (
        "import json, sys\n"
        "before = set(sys.modules)\n"
        "import tokentrace.collector.cli\n"
        "print(json.dumps(sorted(m for m in set(sys.modules) - before\n"
        "                        if m.split('.')[0] not in sys.stdlib_module_names)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert json.loads(out) == [
        "tokentrace",
        "tokentrace.agent",
        "tokentrace.agent.semconv",
        "tokentrace.collector",
        "tokentrace.collector.cli",
        "tokentrace.processors",
        "tokentrace.processors.durations",
    ]


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90.0), ("1.5min", 90.0), ("1500MS", 1.5), ("250us", 0.00025), ("7d", 604800.0)],
)
def test_cli_durations_use_the_configuration_units(text: str, seconds: float) -> None:
    # One parser for both: a duration valid in the config file is valid on the command line.
    assert collector_cli.parse_duration(text) == seconds
    assert parse_duration_ns(text) == round(seconds * 1e9)


# --- rendering ----------------------------------------------------------------------------------


def rich_doc() -> dict[str, object]:
    """A request with every phase: client, http, cold start, chunked prefill, preemption."""
    return record_to_dict(make_rich_record())


def test_waterfall_has_one_row_per_phase_in_time_order() -> None:
    rows = waterfall_rows(rich_doc())
    assert [row.label for row in rows] == [
        "outside server",
        "http",
        "cold start",
        "queue",
        "prefill 1/2",
        "prefill 2/2",
        "preempted",
        "decode",
        "postprocess",
    ]
    durations = {row.label: row.duration_ms for row in rows}
    assert durations["outside server"] == 20.0  # both legs
    assert durations["cold start"] == 40.0
    assert durations["queue"] == 60.0  # the 100 ms wait minus the 40 ms before ready
    assert durations["prefill 1/2"] == 20.0 and durations["prefill 2/2"] == 40.0
    assert durations["decode"] == 300.0
    decode = next(row for row in rows if row.label == "decode")
    assert len(decode.ticks_ms) == 11


def test_waterfall_bars_are_proportional_on_a_shared_axis() -> None:
    doc = rich_doc()
    rows = {row.label: row for row in waterfall_rows(doc)}
    axis_end = max(doc["timeline"]["boundaries_ms"].values())  # type: ignore[index]
    width = 200
    queue = draw_bar(rows["queue"], axis_end_ms=axis_end, bar_width=width, glyphs=ASCII_GLYPHS)
    prefill = draw_bar(
        rows["prefill 2/2"], axis_end_ms=axis_end, bar_width=width, glyphs=ASCII_GLYPHS
    )
    expected_queue = 60.0 / axis_end * width
    assert abs(queue.count("#") - expected_queue) <= 2
    assert abs(prefill.count("#") - 40.0 / axis_end * width) <= 2
    # Phases follow each other on the shared axis: queue, then the two prefill chunks.
    first_chunk = draw_bar(
        rows["prefill 1/2"], axis_end_ms=axis_end, bar_width=width, glyphs=ASCII_GLYPHS
    )
    assert abs(first_chunk.index("#") - (queue.rindex("#") + 1)) <= 1
    assert abs(prefill.index("#") - (first_chunk.rindex("#") + 1)) <= 1
    decode = draw_bar(rows["decode"], axis_end_ms=axis_end, bar_width=width, glyphs=ASCII_GLYPHS)
    assert decode.count("|") >= 9  # token ticks (a few may share a cell)
    assert "-" in decode  # the preemption gap has no token


def test_waterfall_lines_fit_the_width_and_highlight_only_with_colour() -> None:
    doc = rich_doc()
    plain = render_waterfall(doc, width=90, color=False, glyphs=UNICODE_GLYPHS)
    assert all(len(line) <= 90 for line in plain)
    assert len(plain) == len(waterfall_rows(doc)) + 1  # plus the axis line
    coloured = render_waterfall(doc, width=90, color=True, glyphs=UNICODE_GLYPHS)
    queue_line = next(line for line in coloured if line.startswith("\x1b[1mqueue"))
    assert "\x1b[33m" in queue_line  # the verdict's segment stands out
    assert not any("\x1b[" in line for line in plain)


def test_budget_table_shares() -> None:
    lines = render_budget_table(rich_doc())
    queue = next(line for line in lines if line.startswith("queue"))
    # queue 100 ms of E2E 2+100+60+300+1 = 463 ms, of TTFT 162 ms.
    assert "21.6%" in queue and "61.7%" in queue
    decode = next(line for line in lines if line.startswith("decode"))
    assert decode.split()[-1] == "-"  # decode is not part of TTFT
    assert lines[-2].startswith("E2E") and "100.0%" in lines[-2]


def test_explain_rendering_leads_with_the_verdict_and_uses_ascii_when_needed() -> None:
    doc = rich_doc()
    text = render_explain(doc, width=80, glyphs=ASCII_GLYPHS)
    first_lines = text.splitlines()[:4]
    assert any("queue wait was 100 ms" in line for line in first_lines)
    assert "ok ttft-p95" in text
    text.encode("ascii")  # nothing outside ASCII
    assert glyphs_for("ascii") is ASCII_GLYPHS
    assert glyphs_for("utf-8") is UNICODE_GLYPHS


def test_top_rendering_shows_service_column_only_when_services_differ() -> None:
    key = {
        "service": "a",
        "model": "m",
        "operation": "chat",
        "prompt_bucket": "0-127",
        "requests": 3,
        "metrics": {"ttft": {"p50": 12.5, "p95": 20.0, "p99": 30.0, "count": 3}},
        "slo": [],
    }
    one = render_top({"window_s": 60, "requests": 3, "keys": [key], "slo": []})
    assert "service" not in one
    assert "12.50" in one
    two = render_top(
        {"window_s": 60, "requests": 6, "keys": [key, {**key, "service": "b"}], "slo": []}
    )
    assert "service" in two.splitlines()[1]


def test_explain_document_without_timestamps_still_renders() -> None:
    doc = record_to_dict(make_record(1))
    doc["timeline"] = {"boundaries_ms": {}, "preemptions_ms": [], "prefill_chunks": []}
    doc["verdict"] = None
    text = render_explain(doc)
    assert "no diagnosis" in text
    assert "no phase timestamps" in text


def test_start_time_is_shown_in_utc() -> None:
    text = render_explain(record_to_dict(make_record(1, start_ns=BASE_NS)))
    assert "2023-11-14T22:13:20.000000Z" in text


def test_waterfall_rows_agree_with_the_budget_segments() -> None:
    """The waterfall draws the budget's one definition of each segment, e.g. the time between
    the engine's response and the HTTP span's end counts as postprocess, not http."""
    from tokentrace.processors.budget import compute_budget, compute_metrics, prompt_bucket
    from tokentrace.processors.model import RequestRecord

    timeline = make_record(1).timeline
    assert timeline.end is not None
    timeline.server_end = timeline.end + 3 * MS  # the HTTP layer writes the response after
    budget = compute_budget(timeline)
    record = RequestRecord(
        timeline=timeline,
        budget=budget,
        metrics=compute_metrics(timeline, budget),
        prompt_bucket=prompt_bucket(timeline.input_tokens),
    )
    rows = {row.segment: row.duration_ms for row in waterfall_rows(record_to_dict(record))}
    for segment in ("http", "queue", "prefill", "decode", "postprocess"):
        assert rows[segment] == pytest.approx(budget.segments[segment] / 1e6), segment


def test_top_shows_the_collectors_counters_and_names_any_loss(
    store_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokentrace.collector.store import META_COLLECTOR_STATS

    stats = {"received_spans": 700, "requests": 100, "pending_traces": 0, "late_spans": 0}
    with RequestStore(store_path) as store:
        store.set_meta(META_COLLECTOR_STATS, json.dumps(stats))
    code, out, _ = run_cli(capsys, "top", "--once", "--store", str(store_path))
    assert code == 0
    assert "700 spans received" in out and "nothing dropped" in out

    stats.update({"refused_batches": 3, "UpstreamSink.traces.dropped_spans": 12})
    with RequestStore(store_path) as store:
        store.set_meta(META_COLLECTOR_STATS, json.dumps(stats))
    code, out, _ = run_cli(capsys, "top", "--once", "--store", str(store_path))
    assert "refused_batches 3" in out and "UpstreamSink.traces.dropped_spans 12" in out
    assert "nothing dropped" not in out
