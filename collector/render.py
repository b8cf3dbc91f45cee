"""Terminal rendering of request documents, and what every terminal view shares: pure functions.

Documents in, text out. The inputs are the store's request documents (``RequestDocument``,
``store.document``: what ``RequestStore.get`` and ``record_to_dict`` give), so the CLI, an API
and a web UI show the same verdict text and the same phases; the glyphs, colours and ms
formatting here are also what the ``top`` view (``render_top.py``) draws with. Nothing here does
I/O or imports the store (its document types only for the type checker).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from tokentrace.agent import semconv
from tokentrace.processors.causes import NETWORK_NOT_MEASURED

if TYPE_CHECKING:
    from tokentrace.collector.store.document import (
        MetricBudgetDoc,
        MetricsDoc,
        NotReportedDoc,
        RequestDocument,
        VerdictDoc,
    )

_LABEL_WIDTH: Final = 16
_DURATION_WIDTH: Final = 12
_MIN_BAR_WIDTH: Final = 10
_DEFAULT_WIDTH: Final = 100

_ANSI_RESET: Final = "\x1b[0m"
ANSI_BOLD: Final = "\x1b[1m"
ANSI_RED: Final = "\x1b[31m"
ANSI_GREEN: Final = "\x1b[32m"
ANSI_YELLOW: Final = "\x1b[33m"
ANSI_DIM: Final = "\x1b[2m"


@dataclass(frozen=True, slots=True)
class Glyphs:
    bar: str
    tick: str
    line: str
    met: str
    breached: str
    ellipsis: str
    separator: str


UNICODE_GLYPHS: Final = Glyphs(
    bar="█", tick="│", line="─", met="✓", breached="✗", ellipsis="…", separator=" · "
)
ASCII_GLYPHS: Final = Glyphs(
    bar="#", tick="|", line="-", met="ok", breached="X", ellipsis="~", separator=" | "
)


def not_reported_text(not_reported: NotReportedDoc) -> str:
    """One line: which source cannot tell what (the ``missing`` line; the API's warning)."""
    source = not_reported["source"] or "this request's source"
    return f"not reported by {source}: " + ", ".join(not_reported["items"])


def glyphs_for(encoding: str | None) -> Glyphs:
    """Unicode glyphs when ``encoding`` can write them, else plain ASCII."""
    if not encoding:
        return ASCII_GLYPHS
    try:
        "".join(_all_glyphs(UNICODE_GLYPHS)).encode(encoding)
    except (UnicodeEncodeError, LookupError):
        return ASCII_GLYPHS
    return UNICODE_GLYPHS


def _all_glyphs(glyphs: Glyphs) -> list[str]:
    return [
        glyphs.bar,
        glyphs.tick,
        glyphs.line,
        glyphs.met,
        glyphs.breached,
        glyphs.ellipsis,
        glyphs.separator,
    ]


def paint(text: str, code: str, color: bool) -> str:
    return f"{code}{text}{_ANSI_RESET}" if color and text else text


def format_ms(value_ms: float | None, *, unit: bool = True) -> str:
    """A duration in ms with as many decimals as are useful (µs below 10 ms); ``-`` for None."""
    if value_ms is None or not math.isfinite(value_ms):
        return "-"
    magnitude = abs(value_ms)
    if magnitude < 10:
        text = f"{value_ms:.3f}"
    elif magnitude < 100:
        text = f"{value_ms:.2f}"
    elif magnitude < 1000:
        text = f"{value_ms:.1f}"
    else:
        text = f"{value_ms:.0f}"
    return f"{text} ms" if unit else text


def format_percent(fraction: float | None) -> str:
    if fraction is None or not math.isfinite(fraction):
        return "-"
    return f"{fraction * 100:.1f}%"


# --- one request ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WaterfallRow:
    """One phase of a request on the document's time axis (ms after the timeline origin)."""

    label: str
    segment: str
    """The budget segment this phase counts towards (for highlighting the verdict's)."""
    intervals_ms: tuple[tuple[float, float], ...]
    ticks_ms: tuple[float, ...] = ()
    """Token emission times (decode) drawn as ticks on the row."""

    @property
    def duration_ms(self) -> float:
        return sum(end - start for start, end in self.intervals_ms)


def waterfall_rows(doc: RequestDocument) -> list[WaterfallRow]:
    """The phases of one request document, in time order, leaving out phases it did not have."""
    timeline = doc["timeline"]
    at = timeline["boundaries_ms"]
    rows: list[WaterfallRow] = []

    def add(
        label: str,
        segment: str,
        intervals: Sequence[tuple[float | None, float | None]],
        ticks: Sequence[float] = (),
    ) -> None:
        kept = tuple(
            (float(start), float(end))
            for start, end in intervals
            if start is not None and end is not None and end > start
        )
        if kept:
            rows.append(WaterfallRow(label, segment, kept, tuple(ticks)))

    # The document keeps the API name "arrival" for engine arrival (``BOUNDARY_KEYS``).
    engine_arrival = at.get("arrival")
    server_start = at.get("server_start", engine_arrival)
    end = at.get("end")
    server_end = at.get("server_end", end)
    client_start = at.get("client_start")
    client_end = at.get("client_end")

    if engine_arrival is None and client_start is not None:
        # A client-only trace: the client saw the whole request, no server span explains it.
        add("client", semconv.SEGMENT_UNATTRIBUTED, [(client_start, client_end)])
        return rows

    # The client's view outside the server span: its own waits, connection setup, the wire and
    # the request's wait in the server's kernel (the budget splits them; one row draws them).
    add(
        "outside server",
        semconv.SEGMENT_NETWORK,
        [(client_start, server_start), (server_end, client_end)],
    )
    add("http", semconv.SEGMENT_HTTP, [(server_start, engine_arrival)])
    ready = at.get("ready")
    add("cold start", semconv.SEGMENT_COLD_START, [(engine_arrival, ready)])
    queue_start = (
        max(engine_arrival, ready)
        if engine_arrival is not None and ready is not None
        else engine_arrival
    )
    first_scheduled = at.get("first_scheduled")
    first_token = at.get("first_token")
    add("queue", semconv.SEGMENT_QUEUE, [(queue_start, first_scheduled)])

    chunks = timeline["prefill_chunks"]
    if len(chunks) > 1:
        for index, chunk in enumerate(chunks, start=1):
            label = f"prefill {index}/{len(chunks)}"
            add(label, semconv.SEGMENT_PREFILL, [(chunk["start_ms"], chunk["end_ms"])])
    elif chunks:
        add("prefill", semconv.SEGMENT_PREFILL, [(chunks[0]["start_ms"], chunks[0]["end_ms"])])
    else:
        add("prefill", semconv.SEGMENT_PREFILL, [(first_scheduled, first_token)])

    preemptions = timeline["preemptions_ms"]
    add("preempted", semconv.SEGMENT_PREEMPTED, [(start, stop) for start, stop in preemptions])

    last_token = at.get("last_token")
    ticks: list[float] = []
    if first_token is not None:
        ticks = [first_token + offset_us / 1000 for offset_us in doc["token_offsets_us"]]
    add("decode", semconv.SEGMENT_DECODE, [(first_token, last_token)], ticks)
    # As in the budget: everything from the last token until the server sent the response.
    add("postprocess", semconv.SEGMENT_POSTPROCESS, [(last_token, server_end)])
    return rows


def _axis_end_ms(doc: RequestDocument, rows: Sequence[WaterfallRow]) -> float:
    boundaries = doc["timeline"]["boundaries_ms"]
    ends = [float(v) for v in boundaries.values() if isinstance(v, int | float)]
    ends += [end for row in rows for _, end in row.intervals_ms]
    return max(ends, default=0.0)


def _cell(time_ms: float, axis_end_ms: float, bar_width: int) -> float:
    return time_ms / axis_end_ms * bar_width if axis_end_ms > 0 else 0.0


def draw_bar(
    row: WaterfallRow, *, axis_end_ms: float, bar_width: int, glyphs: Glyphs = UNICODE_GLYPHS
) -> str:
    """The row's bar on a ``bar_width``-cell axis from 0 to ``axis_end_ms``; every phase gets at
    least one cell so short ones stay visible. Decode draws a tick per cell with a token."""
    cells = [" "] * bar_width
    fill = glyphs.line if row.ticks_ms else glyphs.bar
    for start, end in row.intervals_ms:
        first = min(bar_width - 1, max(0, math.floor(_cell(start, axis_end_ms, bar_width))))
        last = min(bar_width, max(first + 1, math.ceil(_cell(end, axis_end_ms, bar_width))))
        for index in range(first, last):
            cells[index] = fill
    for tick in row.ticks_ms:
        index = min(bar_width - 1, max(0, math.floor(_cell(tick, axis_end_ms, bar_width))))
        cells[index] = glyphs.tick
    return "".join(cells)


def render_waterfall(
    doc: RequestDocument,
    *,
    width: int = _DEFAULT_WIDTH,
    color: bool = False,
    glyphs: Glyphs = UNICODE_GLYPHS,
    metric: str | None = None,
) -> list[str]:
    """One line per phase (label, duration, bar on a shared axis) plus the axis line; the
    phase of the verdict's dominant segment (about ``metric``, else the default) highlighted."""
    rows = waterfall_rows(doc)
    if not rows:
        return ["(no phase timestamps recorded)"]
    axis_end = _axis_end_ms(doc, rows)
    bar_width = max(_MIN_BAR_WIDTH, width - _LABEL_WIDTH - _DURATION_WIDTH - 2)
    verdict = chosen_verdict(doc, metric)
    highlight = None if verdict is None else waterfall_segment(verdict["segment"])
    lines: list[str] = []
    for row in rows:
        bar = draw_bar(row, axis_end_ms=axis_end, bar_width=bar_width, glyphs=glyphs)
        text = f"{row.label:<{_LABEL_WIDTH}}{format_ms(row.duration_ms):>{_DURATION_WIDTH}} "
        if row.segment == highlight:
            lines.append(paint(text, ANSI_BOLD, color) + paint(bar, ANSI_YELLOW, color))
        else:
            lines.append(text + bar)
    left = "0"
    right = format_ms(axis_end)
    gap = max(1, bar_width - len(left) - len(right))
    lines.append(" " * (_LABEL_WIDTH + _DURATION_WIDTH + 1) + left + " " * gap + right)
    return lines


def metric_budget_doc(
    doc: RequestDocument, metric: str, clock: str | None = None
) -> tuple[str, MetricBudgetDoc] | None:
    """(clock, ``{value_ms, segments}``) of one metric's budget in a request document: on
    ``clock``, else the client's when the document has it, else the server's."""
    clocks: Mapping[str, MetricBudgetDoc] = doc["budgets"].get(metric) or {}
    for candidate in (clock,) if clock else (semconv.CLOCK_CLIENT, semconv.CLOCK_SERVER):
        found = clocks.get(candidate)
        if found:
            return candidate, found
    return None


def render_budget_table(doc: RequestDocument, *, metric: str | None = None) -> list[str]:
    """Segment, ms, % of E2E and % of TTFT (both on the E2E budget's clock) for every segment
    the request spent time in; for a TPOT or ITL ``metric``, that metric's budget after it."""
    e2e = metric_budget_doc(doc, semconv.METRIC_E2E)
    if e2e is None:
        return ["(no budget recorded)"]
    clock, e2e_budget = e2e
    # The TTFT on the E2E budget's clock when the request has it there.
    ttft = metric_budget_doc(doc, semconv.METRIC_TTFT, clock) or metric_budget_doc(
        doc, semconv.METRIC_TTFT
    )
    e2e_ms = e2e_budget["value_ms"]
    ttft_ms = ttft[1]["value_ms"] if ttft else None
    ttft_segments: Mapping[str, float] = ttft[1]["segments"] if ttft else {}
    heading = f"{clock}-seen E2E {format_ms(e2e_ms)}"
    if ttft is not None:
        heading += f", {ttft[0]}-seen TTFT {format_ms(ttft_ms)}"
    lines = [heading, f"{'segment':<14}{'ms':>12}{'% E2E':>9}{'% TTFT':>9}"]
    for segment, value in e2e_budget["segments"].items():
        if not value:
            continue
        lines.append(
            f"{segment:<14}{format_ms(value, unit=False):>12}"
            f"{_share(value, e2e_ms):>9}{_share(ttft_segments.get(segment), ttft_ms):>9}"
        )
    lines.append(f"{'E2E':<14}{format_ms(e2e_ms, unit=False):>12}{_share(e2e_ms, e2e_ms):>9}")
    if ttft_ms is not None:
        lines.append(f"{'TTFT':<14}{format_ms(ttft_ms, unit=False):>12}{'':>9}{'100.0%':>9}")
    if metric in (semconv.METRIC_TPOT, semconv.METRIC_ITL):
        found = metric_budget_doc(doc, metric)
        if found is not None:
            metric_clock, budget = found
            value_ms = budget["value_ms"]
            what = "per output token" if metric == semconv.METRIC_TPOT else "slow gaps together"
            lines.append("")
            lines.append(f"{metric_clock}-seen {metric.upper()} {format_ms(value_ms)} ({what})")
            lines.append(f"{'segment':<14}{'ms':>12}{'share':>9}")
            for segment, value in budget["segments"].items():
                if value:
                    lines.append(
                        f"{segment:<14}{format_ms(value, unit=False):>12}"
                        f"{_share(value, value_ms):>9}"
                    )
    return lines


def _share(part: float | None, whole: float | None) -> str:
    if not part or not whole:
        return "-"
    return format_percent(part / whole)


def chosen_verdict(doc: RequestDocument, metric: str | None = None) -> VerdictDoc | None:
    """The verdict about ``metric`` (None: the document's default verdict), or None."""
    if metric is None:
        return doc["verdict"]
    return doc["verdicts"].get(metric)


def verdict_text(doc: RequestDocument, metric: str | None = None) -> str:
    """The verdict sentence of a request document (the line every view leads with), about
    ``metric`` when given, else the default one."""
    verdict = chosen_verdict(doc, metric)
    if not verdict:
        if metric is not None and doc["verdict"]:
            return f"no {metric.upper()} for this request"
        return "no diagnosis for this request"
    return verdict["sentence"] or verdict["cause"] or "no diagnosis"


def verdict_heading(doc: RequestDocument, metric: str | None = None) -> str:
    """Which metric the verdict answers about and why (the first line of ``explain``)."""
    verdict = chosen_verdict(doc, metric)
    if not verdict:
        return ""
    metric_name = verdict["metric"]
    name = semconv.METRIC_LABELS.get(metric_name, metric_name.upper())
    clock = verdict["clock"]
    why = verdict.get("why")  # only the default verdict has one, asked for or not
    if not why and metric is not None:
        why = "as asked"
    return f"{name} ({clock}-seen): {why}" if why else f"{name} ({clock}-seen)"


def waterfall_segment(segment: object) -> str | None:
    """The waterfall phase that shows a verdict's segment: the parts of decode (interference,
    stalls) are drawn as decode, the client-side segments outside the server as network."""
    if not isinstance(segment, str):
        return None
    if segment in semconv.DECODE_SEGMENTS:
        return semconv.SEGMENT_DECODE
    if segment in semconv.CLIENT_SIDE_SEGMENTS:
        return semconv.SEGMENT_NETWORK
    return segment


def _slo_marks(slo: Mapping[str, bool], *, color: bool, glyphs: Glyphs) -> str:
    marks = []
    for name in sorted(slo):
        if slo[name]:
            marks.append(paint(f"{glyphs.met} {name}", ANSI_GREEN, color))
        else:
            marks.append(paint(f"{glyphs.breached} {name}", ANSI_RED, color))
    return "   ".join(marks)


def _tokens_line(doc: RequestDocument, glyphs: Glyphs) -> str:
    tokens = doc["tokens"]
    parts = []
    if tokens["input"] is not None:
        cached = tokens["cached"]
        suffix = f" (cached {cached})" if cached else ""
        parts.append(f"input {tokens['input']}{suffix}")
    if tokens["output"] is not None:
        parts.append(f"output {tokens['output']}")
    if doc["finish_reason"]:
        parts.append(f"finish {doc['finish_reason']}")
    return glyphs.separator.join(parts) if parts else "-"


def metric_ms(metrics: MetricsDoc, metric: str) -> float | None:
    """A document's ``metrics_ms`` value of ``metric`` by name (None for ``itl``, which is a
    summary, and for names it does not have)."""
    value = metrics.get(metric)
    return float(value) if isinstance(value, int | float) else None


def _metrics_line(doc: RequestDocument, glyphs: Glyphs) -> str:
    """Every latency with its clock: server-seen (what the SLOs judge), client-seen beside it."""
    metrics = doc["metrics_ms"]
    parts = []
    for metric in (semconv.METRIC_E2E, semconv.METRIC_TTFT):
        text = f"{semconv.METRIC_LABELS[metric]} server {format_ms(metric_ms(metrics, metric))}"
        client = metric_budget_doc(doc, metric, semconv.CLOCK_CLIENT)
        if client is not None:
            text += f" client {format_ms(client[1]['value_ms'])}"
        parts.append(text)
    parts.append(f"TPOT {format_ms(metrics[semconv.METRIC_TPOT])}")
    itl = metrics[semconv.METRIC_ITL]
    if itl["count"]:
        parts.append(
            f"ITL p50 {format_ms(itl['p50'])} p99 {format_ms(itl['p99'])} "
            f"max {format_ms(itl['max'])}"
        )
    return glyphs.separator.join(parts)


def render_explain(
    doc: RequestDocument,
    *,
    metric: str | None = None,
    width: int = _DEFAULT_WIDTH,
    color: bool = False,
    glyphs: Glyphs = UNICODE_GLYPHS,
) -> str:
    """The full ``tokentrace explain`` view of one request document; the verdict about
    ``metric`` when given, else the default one."""
    title = (
        f"trace {doc['trace_id']}  span {doc['span_id']}  "
        f"{doc['service']} / {doc['model']} / {doc['operation']}  {doc['start']['iso']}"
    )
    lines = [paint(title, ANSI_BOLD, color), ""]
    verdict = chosen_verdict(doc, metric)
    heading = verdict_heading(doc, metric)
    if heading:
        lines.append(f"{'about':<10}{heading}")
    lines.append(f"{'verdict':<10}" + paint(verdict_text(doc, metric), ANSI_BOLD, color))
    if verdict is not None:
        if verdict["advice"]:
            lines.append(f"{'advice':<10}{verdict['advice']}")
        if verdict["segment"]:
            lines.append(f"{'dominant':<10}{verdict['segment']} ({verdict['cause']})")
    others = [
        f"{name.upper()} {other['segment']} ({other['cause']})"
        for name, other in doc["verdicts"].items()
        if other is not verdict and (verdict is None or other["metric"] != verdict["metric"])
    ]
    if others:
        lines.append(f"{'others':<10}" + glyphs.separator.join(others) + "  (explain --metric)")
    if verdict is not None and verdict["numbers"].get("network_measured") == 0:
        lines.append(f"{'note':<10}{NETWORK_NOT_MEASURED}")
    if doc["not_reported"]:
        lines.append(f"{'missing':<10}{not_reported_text(doc['not_reported'])}")
    lines.append(f"{'latency':<10}{_metrics_line(doc, glyphs)}")
    lines.append(f"{'tokens':<10}{_tokens_line(doc, glyphs)}")
    if doc["slo"]:
        lines.append(f"{'SLO':<10}{_slo_marks(doc['slo'], color=color, glyphs=glyphs)}")
    if doc["status_error"]:
        lines.append(f"{'error':<10}" + paint(doc["status_error"], ANSI_RED, color))
    if doc["skew_clamped"]:
        lines.append(f"{'note':<10}out-of-order timestamps (clock skew) were clamped")
    if doc["token_offsets_dropped"]:
        lines.append(f"{'note':<10}{doc['token_offsets_dropped']} token times not recorded (cap)")
    other_spans = doc.get("other_span_ids") or []
    if other_spans:
        lines.append(
            f"{'note':<10}{len(other_spans)} more request(s) in this trace: "
            f"{', '.join(other_spans)}"
        )
    lines.append("")
    lines.append(paint("waterfall", ANSI_DIM, color))
    lines.extend(render_waterfall(doc, width=width, color=color, glyphs=glyphs, metric=metric))
    lines.append("")
    lines.append(paint("budget", ANSI_DIM, color))
    lines.extend(render_budget_table(doc, metric=None if verdict is None else verdict["metric"]))
    return "\n".join(lines) + "\n"


def render_slowest_list(docs: Sequence[RequestDocument], *, metric: str) -> str:
    """One line per request: trace id, the metric, model, and the verdict about that metric."""
    lines = [f"{'trace id':<34}{metric.upper():>12}  {'model':<20}verdict"]
    for doc in docs:
        value = metric_ms(doc["metrics_ms"], metric)
        lines.append(
            f"{doc['trace_id']:<34}{format_ms(value):>12}  "
            f"{doc['model'][:19]:<20}{verdict_text(doc, metric)}"
        )
    return "\n".join(lines) + "\n"
