"""``tokentrace diagnose`` and ``tokentrace compare``: one window's percentile tables and dominant
cost, and two runs of the same load side by side.

A window is either a load run (its requests, by the trace ids in the run record) or a time
range of the store. Its records are re-derived from the stored spans (``collector.window``) and
analysed exactly (``processors.window.analysis.analyze_window``). Comparison reuses
``processors.window.compare.compare_metrics`` on both the client's and the server's numbers.

This module neither reads spans nor analyses records itself: it asks ``collector.window`` for a
window's records and ``processors.window`` for their analysis, adds what the store knows (traces
asked and found, the run), and renders the CLI's text.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from tokentrace.agent import semconv
from tokentrace.collector.store import Store
from tokentrace.collector.window import records_of_traces
from tokentrace.loadgen.record import RunRecord
from tokentrace.loadgen.report import target_text
from tokentrace.processors.budget import has_server_view
from tokentrace.processors.model import RequestRecord
from tokentrace.processors.slo import SloTarget
from tokentrace.processors.window.analysis import DEFAULT_PERCENTILES, analyze_window
from tokentrace.processors.window.compare import compare_metrics
from tokentrace.processors.window.findings import compare_findings, finding_lines
from tokentrace.processors.wording import format_duration

DEFAULT_MAX_REQUESTS: Final = 50_000
"""Requests a time-range window reads at most (the most recent ones); a bigger window is cut
and says so. Records take about 3 KB each."""
RECENT_RUN_S: Final = 120.0
"""Runs that ended longer ago than this are not waited for: what is missing stays missing."""
_POLL_INTERVAL_S: Final = 0.5
_SEGMENT_CHANGE_MIN_MS: Final = 0.5
"""Mean segment changes below this are noise on any machine: not reported as shrank/grew."""


def diagnose_run(
    store: Store,
    record: RunRecord,
    *,
    targets: Sequence[SloTarget],
    wait_s: float = 0.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """The analysis of a load run's requests (those the store holds), with what was missing.

    ``wait_s``: for a run that ended less than ``RECENT_RUN_S`` ago, poll up to this long for
    requests that have not reached the store yet (the collector writes a trace once it has
    been quiet for its assembly period, so a diagnosis right after the load would miss the
    last requests), or reached it with their client span alone (``client_only_requests``)."""
    trace_ids = [bytes.fromhex(result.trace_id) for result in record.results if result.ok]
    window = records_of_traces(store, trace_ids)
    ended_s_ago = time.time() - record.window_end_ns / 1e9
    if wait_s > 0 and ended_s_ago < RECENT_RUN_S:
        deadline = clock() + wait_s
        while (
            window.traces_found < window.traces_asked or client_only_requests(window.records)
        ) and clock() < deadline:
            sleep(_POLL_INTERVAL_S)
            window = records_of_traces(store, trace_ids)
    analysis = analyze_window(window.records, targets=targets, diagnosis=window.diagnosis)
    analysis["window"] = {
        "start_ns": record.window_start_ns,
        "end_ns": record.window_end_ns,
        "run_requests": len(record.results),
        "traces_asked": window.traces_asked,
        "traces_found": window.traces_found,
        "client_only": client_only_requests(window.records),
        "undecodable": window.undecodable,
    }
    analysis["run"] = {"model": record.model, "client": record.summary.get("metrics", {})}
    return analysis


def client_only_requests(records: Sequence[RequestRecord]) -> int:
    """Requests with only their client span stored, among others that have a server view.

    The collector stores a trace as soon as its first spans are quiet; a request's client span
    and its server's spans come from different processes, and the later ones join the stored
    trace when they arrive. Until then the request is client-only: its time is not split into
    server segments, and a diagnosis would blame the wrong one. When no request of the window
    has a server view, the server is not traced at all (nothing is missing): 0."""
    with_server = sum(1 for record in records if has_server_view(record.timeline))
    if not with_server:
        return 0
    return sum(
        1
        for record in records
        if record.timeline.client_start is not None and not has_server_view(record.timeline)
    )


def diagnose_range(
    store: Store,
    *,
    since_ns: int,
    until_ns: int | None,
    targets: Sequence[SloTarget],
    max_requests: int = DEFAULT_MAX_REQUESTS,
    deadline: float | None = None,
) -> dict[str, Any]:
    """The analysis of the most recent ``max_requests`` requests of a time range;
    ``deadline`` (``time.monotonic``): QueryTimeoutError once re-deriving them runs past it."""
    trace_ids, cut = store.trace_ids_between(since_ns, until_ns, limit=max_requests)
    window = records_of_traces(store, trace_ids, deadline=deadline)
    analysis = analyze_window(window.records, targets=targets, diagnosis=window.diagnosis)
    analysis["window"] = {
        "start_ns": since_ns,
        "end_ns": until_ns,
        "traces_found": window.traces_found,
        "client_only": client_only_requests(window.records),
        "undecodable": window.undecodable,
        "cut_at": max_requests if cut else None,
    }
    return analysis


# --- rendering ------------------------------------------------------------------------------------
def render_diagnosis(analysis: Mapping[str, Any], *, title: str) -> str:
    lines = [f"==> {title}: {analysis['requests']:,} requests"]
    lines += _window_notes(analysis)
    if not analysis["requests"]:
        return "\n".join(lines)
    lines.append("")
    lines += _table(
        "latency (ms)", analysis["metrics"], list(semconv.LATENCY_METRICS), semconv.METRIC_LABELS
    )
    lines.append("")
    segments = analysis["segments"]
    lines += _table("budget segment (ms)", segments, list(segments), {}, share=True)
    findings = analysis.get("findings") or []
    if findings:
        lines.append("")
        lines.append("Targets (breached first): what dominates each target's metric")
        for finding in findings:
            lines += _finding_block(finding)
    covered = {finding["metric"] for finding in findings}
    per_metric = [f for f in analysis.get("metric_findings") or [] if f["metric"] not in covered]
    if per_metric:
        lines.append("")
        lines.append("Where the time goes" + (" (metrics without a target)" if findings else ""))
        for finding in per_metric:
            lines += _finding_block(finding)
    issues = (analysis.get("perceived") or {}).get("issues") or []
    if issues:
        lines.append("")
        lines.append("Perceived speed")
        lines += [f"  - {issue['sentence']}" for issue in issues]
    if analysis["slo"]:
        lines.append("")
        lines.append("SLO compliance (server side)")
        lines += [f"  {_slo_line(entry)}" for entry in analysis["slo"]]
    return "\n".join(lines)


def _finding_block(finding: Mapping[str, Any]) -> list[str]:
    head, *rest = finding_lines(finding)
    return [f"  {head}", *(f"    {line}" for line in rest)]


def _window_notes(analysis: Mapping[str, Any]) -> list[str]:
    window = analysis.get("window", {})
    notes: list[str] = []
    asked = window.get("traces_asked")
    found = window.get("traces_found", 0)
    if asked is not None and found < asked:
        notes.append(
            f"  note: {found:,} of the run's {asked:,} completed requests are in the store; the "
            "rest never reached the collector (no agent on the server? dropped spans?) or are "
            "still being assembled: wait a few seconds and run again"
        )
    client_only = window.get("client_only")
    if client_only:
        notes.append(
            f"  note: {client_only:,} of them have only their client span in the store: their "
            "server's spans are missing or still being assembled, so their time is not split "
            "into server segments; wait a few seconds and run again"
        )
    if window.get("cut_at"):
        notes.append(f"  note: the window was cut to its most recent {window['cut_at']:,} requests")
    if window.get("undecodable"):
        notes.append(f"  note: {window['undecodable']:,} stored traces could not be re-derived")
    network = analysis.get("segments", {}).get(semconv.SEGMENT_NETWORK)
    if analysis.get("requests") and network is None:
        notes.append(
            "  note: no client spans in this window, so no network segment (send the load with "
            "tokentrace load --otlp-endpoint ... to measure it)"
        )
    return notes


def _table(
    title: str,
    rows: Mapping[str, Mapping[str, Any]],
    order: Sequence[str],
    labels: Mapping[str, str],
    *,
    share: bool = False,
) -> list[str]:
    quantiles = [f"p{percent:g}" for percent in DEFAULT_PERCENTILES]
    header = f"{title:<22}{'count':>8}{'mean':>10}" + "".join(f"{q:>10}" for q in quantiles)
    if share:
        header += f"{'of E2E':>9}"
    lines = [header]
    for name in order:
        summary = rows.get(name)
        if not summary or not summary.get("count") or not any(summary.get(q) for q in quantiles):
            continue  # a segment this window never spent time in (cold start, preemption...)
        cells = "".join(_cell(summary.get(q)) for q in ["mean", *quantiles])
        line = f"{labels.get(name, name):<22}{summary['count']:>8,}{cells}"
        if share and summary.get("share") is not None:
            line += f"{summary['share']:>9.1%}"
        lines.append(line)
    return lines


def _cell(value: object) -> str:
    return f"{value:>10.2f}" if isinstance(value, int | float) else f"{'-':>10}"


def _slo_line(entry: Mapping[str, Any]) -> str:
    head = target_text(entry)
    if entry.get("met") is None:
        return f"{head}  no matching requests"
    verdict = "met" if entry["met"] else "MISSED"
    return (
        f"{head}  {verdict}: {entry['value_ms']:.2f} ms; {entry['compliance']:.1%} of "
        f"{entry['requests']:,} inside, burn rate {entry['burn_rate']:.2f}"
    )


# --- compare --------------------------------------------------------------------------------------
def compare_runs(
    a: RunRecord,
    b: RunRecord,
    *,
    analysis_a: Mapping[str, Any] | None,
    analysis_b: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """Client metrics side by side; with the store's analyses also the server's metrics, the
    segments, the SLO targets and the dominant costs; and how the loads differ, if they do."""
    comparison: dict[str, Any] = {
        "load_differences": load_differences(a, b),
        "client": compare_metrics(
            _as_report(a.summary.get("metrics", {})), _as_report(b.summary.get("metrics", {}))
        ),
    }
    if analysis_a is not None and analysis_b is not None:
        comparison["server"] = compare_metrics(
            _as_report(analysis_a["metrics"]), _as_report(analysis_b["metrics"])
        )
        comparison["segments"] = segment_changes(analysis_a["segments"], analysis_b["segments"])
        comparison["slo"] = _slo_pairs(analysis_a["slo"], analysis_b["slo"])
        comparison["findings"] = compare_findings(
            analysis_a["findings"] or analysis_a["metric_findings"],
            analysis_b["findings"] or analysis_b["metric_findings"],
        )
        comparison["requests"] = {"a": analysis_a["requests"], "b": analysis_b["requests"]}
    else:
        comparison["slo"] = _slo_pairs(a.slo, b.slo)
    return comparison


def load_differences(a: RunRecord, b: RunRecord) -> list[dict[str, Any]]:
    """The load-defining fields whose values differ (``LoadConfig.load_identity``), and the
    model; empty when both runs sent the same load."""
    differences = []
    identity_a = {**a.identity, "model": a.model}
    identity_b = {**b.identity, "model": b.model}
    for name in list(identity_a) + [key for key in identity_b if key not in identity_a]:
        if identity_a.get(name) != identity_b.get(name):
            differences.append(
                {"field": name, "a": identity_a.get(name), "b": identity_b.get(name)}
            )
    return differences


def segment_changes(
    a: Mapping[str, Mapping[str, Any]], b: Mapping[str, Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Per segment: mean and p95 in both windows, the mean's delta, and ``shrank`` / ``grew`` /
    ``same`` (changes under 0.5 ms are ``same``); biggest absolute change first."""
    rows = []
    for segment in list(a) + [name for name in b if name not in a]:
        mean_a = (a.get(segment) or {}).get("mean", 0.0)
        mean_b = (b.get(segment) or {}).get("mean", 0.0)
        delta = round(mean_b - mean_a, 3)
        direction = "same"
        if abs(delta) >= _SEGMENT_CHANGE_MIN_MS:
            direction = "grew" if delta > 0 else "shrank"
        rows.append(
            {
                "segment": segment,
                "a_mean_ms": mean_a,
                "b_mean_ms": mean_b,
                "a_p95_ms": (a.get(segment) or {}).get("p95"),
                "b_p95_ms": (b.get(segment) or {}).get("p95"),
                "delta_mean_ms": delta,
                "change": round(mean_b / mean_a - 1, 4) if mean_a else None,
                "direction": direction,
            }
        )
    rows.sort(key=lambda row: -abs(row["delta_mean_ms"]))
    return rows


def _as_report(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """One window-report key holding ``metrics``: the shape ``compare_metrics`` reads."""
    return {"keys": [{"metrics": dict(metrics)}]}


def _slo_pairs(
    a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    by_name_a = {entry["target"]: entry for entry in a}
    by_name_b = {entry["target"]: entry for entry in b}
    names = list(by_name_a) + [name for name in by_name_b if name not in by_name_a]
    return [{"target": name, "a": by_name_a.get(name), "b": by_name_b.get(name)} for name in names]


def render_comparison(comparison: Mapping[str, Any], *, name_a: str, name_b: str) -> str:
    lines = [f"==> A: {name_a}", f"==> B: {name_b}"]
    differences = comparison["load_differences"]
    if differences:
        lines.append(
            "WARNING: the two runs did not send the same load; deltas mix the fix with the load:"
        )
        lines += [f"  {d['field']}: A {d['a']!r}, B {d['b']!r}" for d in differences]
    else:
        lines.append("Same load (configuration, seed and model match).")
    for title, key in (("client side", "client"), ("server side (collector)", "server")):
        rows = comparison.get(key)
        if not rows:
            continue
        lines.append("")
        lines.append(
            f"{title:<22}{'A p50':>10}{'B p50':>10}{'A p95':>10}{'B p95':>10}{'p95 change':>12}"
        )
        for row in rows:
            a, b = row["a"] or {}, row["b"] or {}
            change = (row.get("change") or {}).get("p95")
            lines.append(
                f"{semconv.METRIC_LABELS.get(row['metric'], row['metric']):<22}"
                f"{_cell(a.get('p50'))}{_cell(b.get('p50'))}{_cell(a.get('p95'))}{_cell(b.get('p95'))}"
                + (f"{change:>+12.1%}" if change is not None else f"{'-':>12}")
            )
    segments = comparison.get("segments")
    if segments:
        lines.append("")
        lines.append("Budget segments (mean per request):")
        for row in segments:
            if row["direction"] == "same":
                continue
            change = f" ({row['change']:+.0%})" if row["change"] is not None else ""
            lines.append(
                f"  {row['segment']} {row['direction']} by "
                f"{format_duration(abs(row['delta_mean_ms']) * 1e6)}{change}: "
                f"{row['a_mean_ms']:.2f} -> {row['b_mean_ms']:.2f} ms"
            )
        if all(row["direction"] == "same" for row in segments):
            lines.append("  no segment changed by 0.5 ms or more")
    if comparison.get("slo"):
        lines.append("")
        lines.append("SLO targets:")
        for pair in comparison["slo"]:
            lines.append(f"  {pair['target']}: A {_met(pair['a'])}, B {_met(pair['b'])}")
    findings = comparison.get("findings")
    if findings:
        lines.append("")
        lines.append("Dominant segment before (A) and after (B):")
        lines += [f"  {row['sentence']}" for row in findings]
    return "\n".join(lines)


def _met(entry: Mapping[str, Any] | None) -> str:
    if not entry or entry.get("met") is None:
        return "not judged"
    verdict = "met" if entry["met"] else "MISSED"
    return f"{verdict} ({entry['value_ms']:.2f} ms)"
