"""The ``tokentrace top`` view: a window report as a table, its SLO lines and collector counters.

Pure, dicts in, text out: the input is a ``top`` report (``store.codec.window_report``), with
the collector's stats snapshot under ``collector`` (its counters, what tail sampling kept).
Separate from ``render.py`` (one request's views) because it reads a different document, a
window of keys and targets, and draws it with the same glyphs, colours and ms formatting.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from tokentrace.agent import semconv
from tokentrace.collector.render import (
    ANSI_BOLD,
    ANSI_DIM,
    ANSI_GREEN,
    ANSI_RED,
    UNICODE_GLYPHS,
    Glyphs,
    format_ms,
    format_percent,
    paint,
)
from tokentrace.collector.tail_sampling import render_sampling_line, sampling_summary

_MAX_NAME_WIDTH: Final = 28
_SECONDS_PER_MINUTE: Final = 60
TOP_COLUMNS: Final = (
    ("TTFT p50", semconv.METRIC_TTFT, "p50"),
    ("p95", semconv.METRIC_TTFT, "p95"),
    ("p99", semconv.METRIC_TTFT, "p99"),
    ("TPOT p50", semconv.METRIC_TPOT, "p50"),
    ("p99", semconv.METRIC_TPOT, "p99"),
    ("ITL p99", semconv.METRIC_ITL, "p99"),
    ("E2E p50", semconv.METRIC_E2E, "p50"),
    ("p99", semconv.METRIC_E2E, "p99"),
)
"""(header, metric, quantile) of the percentile columns of the ``top`` table (values in ms)."""


def format_window(window_s: float) -> str:
    if window_s >= _SECONDS_PER_MINUTE and window_s % _SECONDS_PER_MINUTE == 0:
        return f"{window_s / _SECONDS_PER_MINUTE:g} min"
    return f"{window_s:g} s"


def render_top(
    report: Mapping[str, Any],
    *,
    color: bool = False,
    glyphs: Glyphs = UNICODE_GLYPHS,
    title: str = "",
) -> str:
    """The ``tokentrace top`` table of a ``window_report`` plus one line per SLO target."""
    window = format_window(float(report.get("window_s", 0)))
    keys: Sequence[Mapping[str, Any]] = report.get("keys") or []
    sep = glyphs.separator
    head = f"tokentrace top{sep}last {window}{sep}{report.get('requests', 0)} requests"
    if title:
        head += f"{sep}{title}"
    lines = [paint(head, ANSI_BOLD, color)]
    if not keys:
        lines.append(f"no requests in the last {window}")
        lines.extend(_collector_lines(report, color=color, glyphs=glyphs))
        return "\n".join(lines) + "\n"

    services = {str(key.get("service", "")) for key in keys}
    name_columns: list[tuple[str, str]] = [
        ("model", "model"),
        ("operation", "operation"),
        ("prompt", "prompt_bucket"),
    ]
    if len(services) > 1:
        name_columns.insert(0, ("service", "service"))

    table: list[list[str]] = []
    slo_cells: list[tuple[str, bool | None]] = []
    for key in keys:
        metrics = key.get("metrics") or {}
        row = [
            _shorten(str(key.get(field, "")), _MAX_NAME_WIDTH, glyphs) for _, field in name_columns
        ]
        row.append(str(key.get("requests", 0)))
        for _, metric, quantile in TOP_COLUMNS:
            row.append(format_ms((metrics.get(metric) or {}).get(quantile), unit=False))
        table.append(row)
        slo_cells.append(_key_slo_cell(key.get("slo") or [], glyphs))

    headers = [header for header, _ in name_columns] + ["count"]
    headers += [header for header, _, _ in TOP_COLUMNS]
    name_count = len(name_columns)
    widths = [max(len(headers[i]), *(len(row[i]) for row in table)) for i in range(len(headers))]

    def join(cells: Sequence[str]) -> str:
        parts = []
        for index, cell in enumerate(cells):
            if index < name_count:
                parts.append(f"{cell:<{widths[index]}}")
            else:
                parts.append(f"{cell:>{widths[index]}}")
        return "  ".join(parts)

    lines.append(join(headers) + "  " + "SLO")
    for row, (slo_text, slo_met) in zip(table, slo_cells, strict=True):
        code = ANSI_GREEN if slo_met else ANSI_RED if slo_met is False else ""
        lines.append(join(row) + "  " + (paint(slo_text, code, color) if code else slo_text))
    lines.append(paint("(ms; ITL pooled over all token gaps)", ANSI_DIM, color))

    slo_entries: Sequence[Mapping[str, Any]] = report.get("slo") or []
    if slo_entries:
        lines.append("")
        lines.extend(render_slo_lines(slo_entries, color=color, glyphs=glyphs))
    lines.extend(_collector_lines(report, color=color, glyphs=glyphs))
    return "\n".join(lines) + "\n"


def _collector_lines(report: Mapping[str, Any], *, color: bool, glyphs: Glyphs) -> list[str]:
    stats = report.get("collector")
    if not isinstance(stats, Mapping):
        return []
    lines = ["", render_collector_line(stats, color=color, glyphs=glyphs)]
    sampling = sampling_summary(stats)
    if sampling is not None:  # the stored and exported traces are a sample; the table is not
        lines.append(paint(render_sampling_line(sampling), ANSI_DIM, color))
    return lines


# Counters that mean data was lost or refused somewhere: shown whenever non-zero.
_LOSS_COUNTER_SUFFIXES = (
    "refused_batches",
    "spans_dropped_trace_full",
    "traces_finished_early",
    "late_traces_unmatched",
    "percentile_keys_evicted",
    "dropped_spans",
    "dropped_data_points",
    "rejected_records",
    "failed_batches",
    "replaced_traces",
    "failed_checkpoints",
)


def render_collector_line(
    stats: Mapping[str, Any], *, color: bool = False, glyphs: Glyphs = UNICODE_GLYPHS
) -> str:
    """One line of the collector's own counters: what it received, and any loss, named."""
    sep = glyphs.separator
    head = (
        f"collector: {stats.get('received_spans', 0)} spans received"
        f"{sep}{stats.get('requests', 0)} requests"
        f"{sep}{stats.get('pending_traces', 0)} traces assembling"
    )
    losses = [
        f"{name} {value}"
        for name, value in sorted(stats.items())
        if name.endswith(_LOSS_COUNTER_SUFFIXES) and isinstance(value, int) and value > 0
    ]
    for group in ("processor_errors", "exporter_errors"):
        errors = stats.get(group)
        if isinstance(errors, Mapping):
            losses += [f"{group}.{name} {count}" for name, count in sorted(errors.items()) if count]
    if not losses:
        return paint(f"{head}{sep}nothing dropped", ANSI_DIM, color)
    return paint(f"{head}{sep}dropped or refused: {', '.join(losses)}", ANSI_RED, color)


def _key_slo_cell(entries: Sequence[Mapping[str, Any]], glyphs: Glyphs) -> tuple[str, bool | None]:
    if not entries:
        return "-", None
    breached = [str(e.get("target")) for e in entries if e.get("met") is False]
    if breached:
        return f"{glyphs.breached} " + ",".join(breached), False
    if all(e.get("met") for e in entries):
        return glyphs.met, True
    return "?", None


def render_slo_lines(
    entries: Sequence[Mapping[str, Any]], *, color: bool = False, glyphs: Glyphs = UNICODE_GLYPHS
) -> list[str]:
    """One line per SLO target: value vs threshold, compliance and error-budget burn rate."""
    lines = []
    for entry in entries:
        met = entry.get("met")
        if met is None:
            mark, code = "-", ""
        elif met:
            mark, code = glyphs.met, ANSI_GREEN
        else:
            mark, code = glyphs.breached, ANSI_RED
        percentile = float(entry.get("percentile", 0))
        burn = entry.get("burn_rate")
        text = (
            f"{mark} {entry.get('target')}: {entry.get('metric', '?')} p{percentile:g} "
            f"{format_ms(entry.get('value_ms'))} (target < {format_ms(entry.get('threshold_ms'))})"
            f"{glyphs.separator}compliance {format_percent(entry.get('compliance'))}"
            f"{glyphs.separator}burn rate {'-' if burn is None else f'{burn:.2f}'}"
            f"{glyphs.separator}{entry.get('requests', 0)} requests"
        )
        lines.append(paint(text, code, color) if code else text)
    return lines


def _shorten(text: str, width: int, glyphs: Glyphs) -> str:
    return (
        text
        if len(text) <= width
        else text[: max(0, width - len(glyphs.ellipsis))] + (glyphs.ellipsis)
    )
