"""What dominates a window: one finding per SLO target, per metric, and the perceived speed.

Pure and I/O-free; ``analysis.analyze_window`` (what ``tokentrace diagnose``, its API and the fleet
view print) calls it with a window's request records.

**Per target** (``target_findings``), the method's step "find the segment that dominates that
target's metric": the target's population is the requests its selector matches (for ITL, their
inter-token gaps, pooled, as the target judges them), each with its budget of the target's metric
on the server's clock (what the target judges; ``budget.metric_budget``). Among the units beyond
the threshold (when none is, the tail at the target's percentile), the segment with the most time
dominates; a runner-up within ``tie_ratio`` of it is named too. Its cause is the commonest one
the rule table gives for that segment over those requests (``diagnosis.cause_of_segment``), so a
finding's cause always matches its segment. The counterfactual recomputes the target's percentile
over the whole population with the dominant segment removed from every unit, and halved: the
gain a fix of that segment can buy at most, and what a partial fix buys. Breached targets come
first, then met ones, then those without data, each group in configuration order.

**Per metric** (``metric_findings``; what a window without targets gets, and what the metrics
without a target get): TTFT, TPOT and E2E, each for the typical request (the ``p50_band``
percentiles of the metric) and the tail (at or above ``tail_percentile``), on the client's clock
when every request of the window has it (the network is then part of the answer), else the
server's.

The per-request cause rules behind a finding are ``processors/diagnosis.py``'s; what users
felt beyond the latency metrics (streaming, first byte, connections) is ``perceived_speed.py``.

Durations in the documents are ms rounded to the microsecond.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

from tokentrace.agent import semconv
from tokentrace.processors.budget import metric_budget
from tokentrace.processors.causes import ADVICE, CAUSE_LABELS, CAUSES
from tokentrace.processors.decode_split import gap_parts
from tokentrace.processors.diagnosis import (
    DiagnosisConfig,
    cause_of_segment,
    ranked_segments,
    second_segment,
)
from tokentrace.processors.durations import ms_of
from tokentrace.processors.model import RequestRecord
from tokentrace.processors.slo import SloTarget
from tokentrace.processors.stats import nearest_rank
from tokentrace.processors.wording import SEGMENT_LABELS, format_ms, format_share, plural

WINDOW_METRICS: Final = (semconv.METRIC_TTFT, semconv.METRIC_TPOT, semconv.METRIC_E2E)
"""The metrics a window is diagnosed by when no target names them."""
GROUP_BEYOND: Final = "beyond_threshold"
GROUP_TAIL: Final = "tail"
GROUP_TYPICAL: Final = "typical"

WindowFinding: TypeAlias = dict[str, Any]
"""One finding of a window, as a JSON-ready dict: per target (``target_findings``) or per
metric and group (``metric_findings``); what ``tokentrace diagnose --json`` and the API's
``Finding`` model carry (read back as any ``Mapping``). Not the per-request
``diagnosis.RequestFinding``."""

_DEFAULT_CONFIG: Final = DiagnosisConfig()
_GROUP_FACTS: Final = (
    ("requests_ahead", "requests ahead"),
    ("running_at_arrival", "running at arrival"),
    ("batch_full", "share arriving to a full batch"),
    ("input_tokens", "prompt tokens"),
    ("cached_tokens", "cached tokens"),
    ("output_tokens", "output tokens"),
    ("tpot_ms", "TPOT"),
    ("itl_median_ms", "median gap"),
    ("itl_spike_ratio", "p99/median gap"),
    ("interfered_gaps", "interfered gaps"),
    ("stalled_gaps", "stalled gaps"),
    ("max_step_prefill_tokens", "prompt tokens in a step"),
    ("bandwidth_peak_ratio", "bandwidth share of peak"),
    ("rtt_ms", "first-hop RTT"),
    ("connect_ms", "connection setup"),
    ("send_wait_ms", "client send wait"),
    ("read_wait_ms", "client read wait"),
    ("http_before_engine_ms", "API server before the engine"),
    ("http_receive_wait_ms", "kernel wait before the app"),
    ("http_first_token_delivery_ms", "first-token delivery"),
)
"""Numbers of the per-request findings a group finding averages, with how it names them."""


@dataclass(slots=True, frozen=True)
class _Unit:
    """One value of the population: a request, or one inter-token gap (ITL)."""

    value_ns: int
    segments: Mapping[str, int]
    record: int
    """Index of its request in the window."""


def _units(
    records: Sequence[RequestRecord],
    indices: Iterable[int],
    metric: str,
    clock: str,
    config: DiagnosisConfig,
) -> list[_Unit]:
    units: list[_Unit] = []
    for index in indices:
        record = records[index]
        if metric == semconv.METRIC_ITL:
            units += [
                _Unit(part.gap_ns, part.segments(), index)
                for part in gap_parts(record.timeline, outlier_ratio=config.itl_outlier_ratio)
            ]
            continue
        view = metric_budget(record, metric, clock=clock)
        if view is not None:
            units.append(_Unit(view.value_ns, view.segments, index))
    return units


class SeenPrefixes:
    """Per request of a window: the prefixes an earlier request of the window computed."""

    __slots__ = ("_first", "_repeated")

    def __init__(self, records: Sequence[RequestRecord]) -> None:
        counts: Counter[str] = Counter()
        first: dict[str, tuple[int, int]] = {}
        for index, record in enumerate(records):
            prefix = record.timeline.prefix_hash
            if not prefix:
                continue
            counts[prefix] += 1
            key = (_engine_arrival_else_start(record), index)
            if prefix not in first or key < first[prefix]:
                first[prefix] = key
        self._repeated = frozenset(prefix for prefix, seen in counts.items() if seen >= 2)
        self._first = {prefix: first[prefix][1] for prefix in self._repeated}

    def for_request(self, records: Sequence[RequestRecord], index: int) -> Container[str]:
        prefix = records[index].timeline.prefix_hash
        if prefix is None or self._first.get(prefix) == index:
            return frozenset()
        return self._repeated


def _engine_arrival_else_start(record: RequestRecord) -> int:
    """Engine arrival, else server start, else client start (0: none known): the order in which
    requests reached the server."""
    timeline = record.timeline
    for candidate in (timeline.engine_arrival, timeline.server_start, timeline.client_start):
        if candidate is not None:
            return candidate
    return 0


# --- per target -----------------------------------------------------------------------------------
def target_findings(
    records: Sequence[RequestRecord],
    targets: Sequence[SloTarget],
    config: DiagnosisConfig = _DEFAULT_CONFIG,
) -> list[WindowFinding]:
    """One finding per target (see the module docstring), breached ones first."""
    seen = SeenPrefixes(records)
    findings = []
    for target in targets:
        indices = [index for index, record in enumerate(records) if target.matches(record)]
        units = _units(records, indices, target.metric, semconv.CLOCK_SERVER, config)
        finding: WindowFinding = {
            "target": target.name,
            "metric": target.metric,
            "clock": semconv.CLOCK_SERVER,
            "percentile": target.percentile,
            "threshold_ms": ms_of(target.threshold_ns),
            "met": None,
            "value_ms": None,
            "population": len(units),
        }
        if units:
            ordered = sorted(unit.value_ns for unit in units)
            value = nearest_rank(ordered, target.percentile)
            beyond = [unit for unit in units if unit.value_ns > target.threshold_ns]
            group = GROUP_BEYOND
            if not beyond:
                group = GROUP_TAIL
                beyond = [unit for unit in units if unit.value_ns >= value]
            finding.update(
                met=value <= target.threshold_ns,
                value_ms=ms_of(value),
                **_group_finding(
                    records,
                    units,
                    beyond,
                    metric=target.metric,
                    clock=semconv.CLOCK_SERVER,
                    group=group,
                    percentile=target.percentile,
                    threshold_ns=target.threshold_ns,
                    config=config,
                    seen=seen,
                ),
            )
        finding["sentence"] = _sentence(finding)
        findings.append(finding)
    order = {False: 0, True: 1, None: 2}
    return sorted(findings, key=lambda finding: order[finding["met"]])


# --- per metric -----------------------------------------------------------------------------------
def metric_findings(
    records: Sequence[RequestRecord],
    metrics: Sequence[str] = WINDOW_METRICS,
    config: DiagnosisConfig = _DEFAULT_CONFIG,
) -> list[WindowFinding]:
    """Per metric, the typical request's and the tail's finding (see the module docstring)."""
    seen = SeenPrefixes(records)
    findings = []
    everyone = range(len(records))
    for metric in metrics:
        client_units = _units(records, everyone, metric, semconv.CLOCK_CLIENT, config)
        units = _units(records, everyone, metric, semconv.CLOCK_SERVER, config)
        clock = semconv.CLOCK_SERVER
        if client_units and len({unit.record for unit in client_units}) >= len(
            {unit.record for unit in units}
        ):
            units, clock = client_units, semconv.CLOCK_CLIENT
        if not units:
            continue
        ordered = sorted(unit.value_ns for unit in units)
        low = nearest_rank(ordered, config.p50_band[0])
        high = nearest_rank(ordered, config.p50_band[1])
        tail_from = nearest_rank(ordered, config.tail_percentile)
        for group, members, percentile in (
            (GROUP_TYPICAL, [u for u in units if low <= u.value_ns <= high], 50.0),
            (GROUP_TAIL, [u for u in units if u.value_ns >= tail_from], config.tail_percentile),
        ):
            finding: WindowFinding = {
                "target": None,
                "metric": metric,
                "clock": clock,
                "percentile": percentile,
                "threshold_ms": None,
                "met": None,
                "value_ms": ms_of(nearest_rank(ordered, percentile)),
                "population": len(units),
                "range_ms": [ms_of(low), ms_of(high)]
                if group == GROUP_TYPICAL
                else [ms_of(tail_from)],
                **_group_finding(
                    records,
                    units,
                    members,
                    metric=metric,
                    clock=clock,
                    group=group,
                    percentile=percentile,
                    threshold_ns=None,
                    config=config,
                    seen=seen,
                ),
            }
            finding["sentence"] = _sentence(finding)
            findings.append(finding)
    return findings


# --- one group ------------------------------------------------------------------------------------
def _group_finding(
    records: Sequence[RequestRecord],
    population: Sequence[_Unit],
    members: Sequence[_Unit],
    *,
    metric: str,
    clock: str,
    group: str,
    percentile: float,
    threshold_ns: int | None,
    config: DiagnosisConfig,
    seen: SeenPrefixes,
) -> dict[str, Any]:
    """The dominant segment of ``members``, its cause and facts, and the counterfactual over
    ``population`` (the fields a finding adds to its target or metric)."""
    totals: dict[str, int] = {}
    for unit in members:
        for segment, ns in unit.segments.items():
            if ns:
                totals[segment] = totals.get(segment, 0) + ns
    value_total = sum(unit.value_ns for unit in members)
    ranked = ranked_segments(totals)
    finding: dict[str, Any] = {
        "group": group,
        "units": len(members),
        "requests": len({unit.record for unit in members}),
        "segment": None,
        "second_segment": None,
        "share": None,
        "cause": None,
        "advice": None,
        "facts": {},
        "segments": [
            {
                "segment": segment,
                "share": round(ns / value_total, 4) if value_total else 0.0,
                "mean_ms": ms_of(ns / len(members)),
            }
            for segment, ns in ranked
        ],
        "population_means_ms": _means(population),
        "counterfactual": None,
    }
    if not ranked:
        return finding
    dominant = ranked[0][0]
    runner_up = second_segment(ranked, config)
    cause, facts = _group_cause(records, members, metric, clock, dominant, config, seen)
    finding.update(
        segment=dominant,
        second_segment=None if runner_up is None else runner_up[0],
        share=round(totals[dominant] / value_total, 4) if value_total else 0.0,
        cause=cause,
        advice=ADVICE.get(cause, ""),
        facts=facts,
        counterfactual=_counterfactual(population, dominant, percentile, threshold_ns),
    )
    return finding


def _group_cause(
    records: Sequence[RequestRecord],
    members: Sequence[_Unit],
    metric: str,
    clock: str,
    segment: str,
    config: DiagnosisConfig,
    seen: SeenPrefixes,
) -> tuple[str, dict[str, float]]:
    """The commonest cause of ``segment`` over the group's requests (ties in ``CAUSES`` order)
    and the means of the facts those requests' findings cite."""
    causes: Counter[str] = Counter()
    sums: dict[str, dict[str, float]] = {}
    counts: dict[str, dict[str, int]] = {}
    for index in sorted({unit.record for unit in members}):
        record = records[index]
        view = metric_budget(record, metric, clock=clock)
        if view is None:
            continue
        found = cause_of_segment(
            record,
            view,
            segment,
            config,
            seen_prefixes=seen.for_request(records, index),
            preemption_rule=False,
        )
        causes[found.cause] += 1
        cause_sums = sums.setdefault(found.cause, {})
        cause_counts = counts.setdefault(found.cause, {})
        for key, value in found.numbers.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                cause_sums[key] = cause_sums.get(key, 0.0) + value
                cause_counts[key] = cause_counts.get(key, 0) + 1
    if not causes:
        return semconv.SEGMENT_UNATTRIBUTED, {}
    order = {cause: position for position, cause in enumerate(CAUSES)}
    cause = min(causes, key=lambda name: (-causes[name], order.get(name, len(order))))
    facts = {"requests_with_cause": float(causes[cause])}
    for key, total in sums[cause].items():
        facts[key] = round(total / counts[cause][key], 3)
    return cause, facts


def _counterfactual(
    population: Sequence[_Unit], segment: str, percentile: float, threshold_ns: int | None
) -> dict[str, Any]:
    """The population's percentile as it is, without ``segment`` and with it halved."""
    values = sorted(unit.value_ns for unit in population)
    without = sorted(unit.value_ns - unit.segments.get(segment, 0) for unit in population)
    halved = sorted(unit.value_ns - unit.segments.get(segment, 0) // 2 for unit in population)
    result: dict[str, Any] = {
        "segment": segment,
        "value_ms": ms_of(nearest_rank(values, percentile)),
        "without_ms": ms_of(nearest_rank(without, percentile)),
        "halved_ms": ms_of(nearest_rank(halved, percentile)),
        "met_without": None,
        "met_halved": None,
    }
    if threshold_ns is not None:
        result["met_without"] = nearest_rank(without, percentile) <= threshold_ns
        result["met_halved"] = nearest_rank(halved, percentile) <= threshold_ns
    return result


def _means(units: Sequence[_Unit]) -> dict[str, float]:
    sums: dict[str, int] = {}
    for unit in units:
        for segment, ns in unit.segments.items():
            sums[segment] = sums.get(segment, 0) + ns
    return {segment: ms_of(ns / len(units)) for segment, ns in sums.items() if ns} if units else {}


# --- wording --------------------------------------------------------------------------------------
def _unit_noun(metric: str, count: int) -> str:
    return plural(count, "gap" if metric == semconv.METRIC_ITL else "request")


def _facts_text(facts: Mapping[str, float]) -> str:
    parts = []
    for key, label in _GROUP_FACTS:
        value = facts.get(key)
        if value is None:
            continue
        if key.endswith("_ms"):
            parts.append(f"{label} {format_ms(value)}")
        elif key.endswith("_ratio"):
            parts.append(f"{label} {value:.2f}")
        elif key == "batch_full":
            parts.append(f"{format_share(value)} arrived to a full batch")
        else:
            parts.append(f"{value:,.1f} {label}" if value % 1 else f"{value:,.0f} {label}")
    return ", ".join(parts)


def _dominance_text(finding: Mapping[str, Any]) -> str:
    """``78% of their TTFT was queue wait (mean 420 ms) and ...: queueing (12 requests ahead)``."""
    segment = finding["segment"]
    label = semconv.METRIC_LABELS.get(finding["metric"], finding["metric"])
    means = {entry["segment"]: entry for entry in finding["segments"]}
    text = (
        f"{format_share(finding['share'])} of their {finding['clock']}-seen {label} was "
        f"{SEGMENT_LABELS.get(segment, segment)} (mean {format_ms(means[segment]['mean_ms'])})"
    )
    second = finding.get("second_segment")
    if second:
        entry = means[second]
        text += (
            f" and {format_share(entry['share'])} {SEGMENT_LABELS.get(second, second)} "
            f"(mean {format_ms(entry['mean_ms'])})"
        )
    cause = finding["cause"]
    facts = _facts_text(finding["facts"])
    text += f": {CAUSE_LABELS.get(cause, cause)}"
    return f"{text} ({facts})" if facts else text


def _counterfactual_text(finding: Mapping[str, Any]) -> str:
    counterfactual = finding["counterfactual"]
    segment = counterfactual["segment"]
    label = semconv.METRIC_LABELS.get(finding["metric"], finding["metric"])
    named = SEGMENT_LABELS.get(segment, segment)
    head = f"p{finding['percentile']:g} {label} {format_ms(counterfactual['value_ms'])} -> "
    if segment == semconv.SEGMENT_DECODE:
        # Tokens cannot be free: removing decode is no fix, making it twice as fast is one.
        text = f"{head}{format_ms(counterfactual['halved_ms'])} with {named} twice as fast"
    else:
        text = (
            f"{head}{format_ms(counterfactual['without_ms'])} without {named} "
            f"({format_ms(counterfactual['halved_ms'])} with it halved)"
        )
    if finding.get("met") is False:
        if counterfactual["met_halved"]:
            text += "; halving it meets the target"
        elif counterfactual["met_without"] is False or segment == semconv.SEGMENT_DECODE:
            text += "; not enough alone to meet the target"
    cause = finding["cause"]
    return f"{text}: fix {CAUSE_LABELS.get(cause, cause)} first"


def finding_lines(finding: Mapping[str, Any]) -> list[str]:
    """A finding as lines for people: what was judged and its status, what dominated it and
    why, what removing (or halving) that would give, and the fix. ``sentence`` joins them."""
    label = semconv.METRIC_LABELS.get(finding["metric"], finding["metric"])
    if finding.get("target"):
        head = (
            f"{finding['target']} (p{finding['percentile']:g} {label} <= "
            f"{format_ms(finding['threshold_ms'])}, server-seen): "
        )
        if finding["met"] is None:
            return [head + "no matching requests"]
        head += f"{'met' if finding['met'] else 'MISSED'} at {format_ms(finding['value_ms'])}"
        where = (
            f"beyond {format_ms(finding['threshold_ms'])}"
            if finding["group"] == GROUP_BEYOND
            else f"in its tail (>= p{finding['percentile']:g})"
        )
    elif finding["group"] == GROUP_TYPICAL:
        low, high = finding["range_ms"]
        head = f"typical {label}: {format_ms(low)}-{format_ms(high)}, around the median"
        where = "around the median"
    else:
        head = f"tail {label}: >= p{finding['percentile']:g}, {format_ms(finding['range_ms'][0])}"
        where = "in the tail"
    if finding.get("segment") is None:
        return [head, "no time recorded in any segment"]
    return [
        head,
        f"{_unit_noun(finding['metric'], finding['units'])} {where}: {_dominance_text(finding)}",
        _counterfactual_text(finding),
        f"fix: {finding['advice']}",
    ]


def _sentence(finding: Mapping[str, Any]) -> str:
    lines = finding_lines(finding)
    return ". ".join(line.rstrip(".") for line in lines[:3]) + "."


# --- before and after -----------------------------------------------------------------------------
_SEGMENT_CHANGE_MIN_MS: Final = 0.5
"""Mean segment changes below this are noise on any machine: ``same``."""


def compare_findings(
    a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Per finding of either window (by target, else by metric and group): the dominant segment
    before and after, and whether the one that dominated before shrank (its mean over the
    population), so that "fix one thing, verify" reads straight from it."""
    by_key_b = {_finding_key(finding): finding for finding in b}
    keys = [_finding_key(finding) for finding in a]
    keys += [key for key in by_key_b if key not in keys]
    by_key_a = {_finding_key(finding): finding for finding in a}
    rows = []
    for key in keys:
        before, after = by_key_a.get(key), by_key_b.get(key)
        segment = (before or {}).get("segment")
        row: dict[str, Any] = {
            "target": (before or after or {}).get("target"),
            "metric": (before or after or {}).get("metric"),
            "group": (before or after or {}).get("group"),
            "a_segment": segment,
            "b_segment": (after or {}).get("segment"),
            "a_value_ms": (before or {}).get("value_ms"),
            "b_value_ms": (after or {}).get("value_ms"),
            "a_met": (before or {}).get("met"),
            "b_met": (after or {}).get("met"),
            "a_mean_ms": None,
            "b_mean_ms": None,
            "direction": None,
        }
        if before is not None and segment is not None and after is not None:
            mean_a = float(before.get("population_means_ms", {}).get(segment, 0.0))
            mean_b = float(after.get("population_means_ms", {}).get(segment, 0.0))
            delta = round(mean_b - mean_a, 3)
            direction = "same"
            if abs(delta) >= _SEGMENT_CHANGE_MIN_MS:
                direction = "grew" if delta > 0 else "shrank"
            row.update(a_mean_ms=mean_a, b_mean_ms=mean_b, direction=direction)
        row["sentence"] = _comparison_sentence(row)
        rows.append(row)
    return rows


def _finding_key(finding: Mapping[str, Any]) -> tuple[Any, ...]:
    if finding.get("target"):
        return ("target", finding["target"])
    return ("metric", finding.get("metric"), finding.get("group"))


def _comparison_sentence(row: Mapping[str, Any]) -> str:
    label = semconv.METRIC_LABELS.get(row["metric"], row["metric"])
    name = row["target"] or f"{label} ({row['group']})"
    if row["a_segment"] is None:
        return f"{name}: no dominant segment before"
    segment = row["a_segment"]
    text = f"{name}: {SEGMENT_LABELS.get(segment, segment)} dominated before"
    if row["direction"] is None:
        return f"{text}; not in the second window"
    means = f"{format_ms(row['a_mean_ms'])} -> {format_ms(row['b_mean_ms'])}"
    text += f", mean {means} ({row['direction']})"
    if row["a_value_ms"] is not None and row["b_value_ms"] is not None:
        text += f"; {label} {format_ms(row['a_value_ms'])} -> {format_ms(row['b_value_ms'])}"
    if row["b_met"] is not None:
        text += " (target met)" if row["b_met"] else " (target still missed)"
    after = row["b_segment"]
    if after is not None and after != segment:
        text += f"; now {SEGMENT_LABELS.get(after, after)} dominates"
    return text
