"""Why a request's tokens came slower than its own pace: its inter-token gaps split by cause.

Each gap between two consecutive output tokens is cut into the parts of the TPOT/ITL budgets
(``semconv.DECODE_SEGMENTS`` plus ``preempted``):

- ``preempted``: the gap's overlap with the request's preemption intervals (the request was
  evicted and waited to resume; the E2E budget already counts it apart from ``decode``);
- the request's own pace, ``decode``: the whole gap when it is not an outlier, else the part up
  to the request's median gap. An outlier gap is one above ``outlier_ratio`` x the median gap
  (``finished_request.gap_median``): the rule by which the agent exports the engine steps that ran
  inside slow gaps, so exactly the gaps whose steps the collector receives;
- the rest of an outlier gap (its excess over the median, less any preemption) goes, by what the
  engine steps exported inside that gap say, to ``interference`` when one of them also prefilled
  other requests' prompts (a co-scheduled prefill stretched the step), to ``stall`` when they
  cover less than half of the gap or none was exported though the request has exported steps
  (nothing stepped the request: the engine loop or its frontend stalled), and back to
  ``decode`` otherwise (the request's own steps were slow, e.g. a large batch).

When no engine step was exported for the request at all (an engine without tokentrace's
EngineCore hooks, vLLM's own spans), the excess stays in ``decode``: nothing says what caused it.
Only a count of the outlier gaps that shared a step with a prefill (the decode span's
``DECODE_OUTLIER_STEPS_WITH_PREFILL``, e.g. from ``tokentrace replay``) still says how many were
interference; the largest outlier gaps are taken to be those.

Token times are the agent's µs offsets after the first token, so gap parts are whole µs in ns;
``decode_split`` makes the split of the E2E budget's ``decode`` segment exact by leaving the
rounding in ``decode``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from itertools import islice
from typing import Final

from tokentrace.agent import semconv
from tokentrace.agent.finished_request import DEFAULT_ITL_OUTLIER_RATIO
from tokentrace.processors import native
from tokentrace.processors.model import DecodeFacts, GapParts, RequestRecord, RequestTimeline

_NS_PER_US: Final = 1_000
_MIN_STEP_COVERAGE: Final = 0.5
"""Steps covering less of an outlier gap than this share leave it unexplained: a stall."""


def gap_parts(
    timeline: RequestTimeline,
    *,
    outlier_ratio: float = DEFAULT_ITL_OUTLIER_RATIO,
    outliers_only: bool = False,
    gaps_ns: Sequence[int] | None = None,
) -> list[GapParts]:
    """The request's inter-token gaps in token order (only its outlier gaps with
    ``outliers_only``: the pipeline's case, a few per request), split as the module says. Gaps
    with a negative length (malformed offsets) are skipped, as in
    ``budget.inter_token_gaps_ns``, whose result ``gaps_ns`` may pass to save computing the
    gaps again."""
    offsets = timeline.token_offsets_us
    first_token = timeline.first_token
    if len(offsets) < 2 or first_token is None:
        return []
    # Per-token work stays in C (the median, the outlier positions, and for the pipeline's
    # outlier gaps the whole split, ``native.outlier_gap_parts``): the Python below is that
    # split's twin, and the walk over every gap.
    if gaps_ns is None or len(gaps_ns) != len(offsets) - 1:  # not given, or some negative
        gaps_ns = list(
            map(_NS_PER_US.__mul__, map(operator.sub, islice(offsets, 1, None), offsets))
        )
    median_ns, highest_ns = native.gap_median(gaps_ns)  # negative gaps are no gaps
    if median_ns is None:
        if outliers_only:
            return []
        threshold_ns = math.inf
        median_ns = 0
    else:
        threshold_ns = outlier_ratio * median_ns
    steps = timeline.engine_steps
    preempted = timeline.preempted
    if outliers_only:
        if highest_ns <= threshold_ns:
            return []  # the usual request: no outlier gap
        # Integer gaps: above the threshold is above its floor (an int compares faster).
        threshold_floor = math.floor(threshold_ns)
        found_in_c = native.outlier_gap_parts(
            gaps_ns,
            offsets,
            first_token,
            round(median_ns),
            threshold_floor,
            steps,
            preempted,
            timeline.outlier_steps_with_prefill or 0,
        )
        if found_in_c is not None:
            return [GapParts(*part, True) for part in found_in_c]
        positions: Iterable[int] = native.outlier_positions(gaps_ns, threshold_floor)
    else:
        positions = range(1, len(offsets))
    # (gap, preempted part, excess, outlier, the excess's segment) per gap, then the parts.
    found: list[tuple[int, int, int, bool, str]] = []
    for index in positions:
        gap_ns = gaps_ns[index - 1]
        outlier = gap_ns > threshold_ns
        if gap_ns < 0:
            continue
        begin = first_token + offsets[index - 1] * _NS_PER_US
        end = begin + gap_ns
        preempted_ns = min(_overlap(preempted, begin, end), gap_ns) if preempted else 0
        excess = max(0, gap_ns - round(median_ns) - preempted_ns) if outlier else 0
        # Without step data for the request the excess is unknown: left as its own pace.
        cause = _excess_cause(steps, begin, end) if excess and steps else semconv.SEGMENT_DECODE
        found.append((gap_ns, preempted_ns, excess, outlier, cause))
    with_prefill = timeline.outlier_steps_with_prefill
    if not steps and with_prefill:
        # Without step spans, the agent's count of the outlier gaps whose steps prefilled other
        # requests still says how many were interference: a prefill stretches a step far more
        # than anything else a step does, so those are taken to be the largest ones (equal
        # ones in token order).
        largest = sorted(
            [(-entry[0], position) for position, entry in enumerate(found) if entry[2]]
        )
        for _, position in largest[:with_prefill]:
            found[position] = (*found[position][:4], semconv.SEGMENT_INTERFERENCE)
    parts = []
    for gap_ns, preempted_ns, excess, outlier, cause in found:
        interference = excess if cause == semconv.SEGMENT_INTERFERENCE else 0
        stall = excess if cause == semconv.SEGMENT_STALL else 0
        decode = gap_ns - preempted_ns - interference - stall
        parts.append(GapParts(gap_ns, decode, interference, stall, preempted_ns, outlier))
    return parts


def decode_facts_of(record: RequestRecord) -> DecodeFacts:
    """The request's outlier gaps, its decode split and its engine steps, derived on first use
    and kept on the record (``RequestRecord.decode_facts``)."""
    facts = record.decode_facts
    if facts is None:
        timeline = record.timeline
        decode_ns = record.budget.segments.get(semconv.SEGMENT_DECODE, 0)
        outliers = (
            gap_parts(
                timeline,
                outlier_ratio=record.itl_outlier_ratio,
                outliers_only=True,
                gaps_ns=record.metrics.itl,
            )
            if decode_ns
            else []
        )
        steps = timeline.engine_steps
        facts = record.decode_facts = DecodeFacts(
            outlier_gaps=outliers,
            split=decode_split(outliers, decode_ns) if decode_ns else {},
            engine_steps=len(steps),
            max_step_prefill_tokens=max(map(operator.itemgetter(2), steps), default=0),
        )
    return facts


def decode_split(outlier_gaps: Sequence[GapParts], decode_ns: int) -> dict[str, int]:
    """The E2E budget's ``decode`` (ns) split into ``semconv.DECODE_SEGMENTS`` by the request's
    outlier gaps; sums to it exactly (the µs rounding of the token offsets stays in
    ``decode``)."""
    split = dict.fromkeys(semconv.DECODE_SEGMENTS, 0)
    remaining = max(decode_ns, 0)
    interference = stall = 0
    for part in outlier_gaps:
        interference += part.interference_ns
        stall += part.stall_ns
    split[semconv.SEGMENT_INTERFERENCE] = min(interference, remaining)
    remaining -= split[semconv.SEGMENT_INTERFERENCE]
    split[semconv.SEGMENT_STALL] = min(stall, remaining)
    split[semconv.SEGMENT_DECODE] = remaining - split[semconv.SEGMENT_STALL]
    return split


def _overlap(intervals: Sequence[tuple[int, int]], begin: int, end: int) -> int:
    """ns of [begin, end) covered by ``intervals`` (sorted, possibly overlapping)."""
    covered = 0
    cursor = begin
    for start, stop in intervals:
        if start >= end:
            break
        low = max(start, cursor)
        high = min(stop, end)
        if high > low:
            covered += high - low
            cursor = high
    return covered


def _excess_cause(steps: Sequence[tuple[int, int, int]], begin: int, end: int) -> str:
    """What the engine steps inside the gap (begin, end) say about its excess (``steps``: the
    request's exported steps, at least one)."""
    covered = 0
    with_prefill = False
    # At most a few dozen steps per request are exported (the agent caps them): a scan is fine.
    # The step that produced the previous token ends exactly at ``begin`` and does not count.
    for start, stop, prefill_tokens in steps:
        overlap = min(stop, end) - max(start, begin)
        if overlap > 0:
            covered += overlap
            with_prefill = with_prefill or prefill_tokens > 0
    if with_prefill:
        return semconv.SEGMENT_INTERFERENCE
    if covered < _MIN_STEP_COVERAGE * (end - begin):
        return semconv.SEGMENT_STALL
    return semconv.SEGMENT_DECODE
