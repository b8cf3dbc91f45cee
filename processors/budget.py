"""The latency budget: segments that partition a request's E2E exactly, and its metric values.

Server boundaries, in time order (all on the server's clock)::

    server_start -> arrival -> cold_end -> first_scheduled -> first_token -> last_token -> end
                 http    cold_start    queue             prefill         decode    postprocess

(``end`` here is ``server_end``.)

``cold_end`` is ``min(ready, first_scheduled)`` when the timeline has a ``ready`` time later than
arrival, else arrival (a zero-length cold start). Preempted intervals are clipped into
``[first_scheduled, last_token]`` and merged; their time moves out of ``prefill``/``decode`` into
``preempted``. All arithmetic is in integer ns, so the segments sum to E2E exactly.

Missing boundaries: a phase lasts until the next boundary that is known, so a missing boundary
takes the value of the next known one and the following segment has zero length (a request
aborted while queued puts its whole wait in ``queue``). When no engine boundary is known at all
(arrival, first_scheduled, first_token and last_token all missing), the server time goes to
``unattributed`` rather than to a guessed phase.

Clock-skew policy: timestamps from different processes or hosts may disagree. Every boundary is
clamped into ``[previous boundary, server_end]`` so that the sequence is monotone and no segment is
negative; ``skew_clamped`` is set when a clamp changed a value (also when ``server_end`` precedes
``server_start``, which makes E2E zero, or when the client span ends before it starts). Client
and server clocks are never compared in absolute terms: only durations are. With a client span,
``network = max(0, client duration - server duration)`` and E2E = server E2E + network.

TTFT: ``ttft_ns = first_token - server_start`` (after clamping), None without a token.
``ttft_segments`` is the same partition truncated at the first token and covers the SERVER-side
TTFT only: it sums to ``ttft_ns`` and its ``network`` entry is always 0 (client TTFT minus server
TTFT is not added, because the two clocks are not comparable in absolute terms).

Client-only timelines (no server span): all of E2E (the client duration) is ``unattributed``;
``ttft_ns`` is the client-observed TTFT (``client_first_token - client_start``) when known, with
``ttft_segments`` likewise all ``unattributed``.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from itertools import pairwise
from typing import Final

from tokentrace.agent import semconv
from tokentrace.processors.model import Budget, RequestMetrics, RequestRecord, RequestTimeline

PROMPT_BUCKET_BOUNDS: Final = (128, 512, 2048, 8192)
"""Lower bounds (input tokens) of every prompt-length bucket after the first, ascending."""
PROMPT_BUCKET_UNKNOWN: Final = "unknown"


def _bucket_labels(bounds: tuple[int, ...]) -> tuple[str, ...]:
    labels: list[str] = []
    low = 0
    for bound in bounds:
        labels.append(f"{low}-{bound - 1}")
        low = bound
    labels.append(f"{low}+")
    return tuple(labels)


PROMPT_BUCKETS: Final = _bucket_labels(PROMPT_BUCKET_BOUNDS)
"""Every bucket label in ascending order (``"0-127"`` ... ``"8192+"``), without ``unknown``."""

_NS_PER_US: Final = 1000


def _zero_segments() -> dict[str, int]:
    return dict.fromkeys(semconv.SEGMENTS, 0)


def _client_duration(timeline: RequestTimeline) -> tuple[int | None, bool]:
    """(client duration or None without a client span, whether it had to be clamped)."""
    start, end = timeline.client_start, timeline.client_end
    if start is None or end is None:
        return None, False
    if end < start:
        return 0, True
    return end - start, False


def _server_bounds(timeline: RequestTimeline) -> tuple[int, int] | None:
    start = timeline.server_start if timeline.server_start is not None else timeline.arrival
    end = timeline.server_end if timeline.server_end is not None else timeline.end
    if start is None or end is None:
        return None
    return start, end


def has_server_view(timeline: RequestTimeline) -> bool:
    """Whether ``timeline`` has a server-side start and end (else its budget is client-only)."""
    return _server_bounds(timeline) is not None


def _has_engine_boundary(timeline: RequestTimeline) -> bool:
    return not (
        timeline.arrival is None
        and timeline.first_scheduled is None
        and timeline.first_token is None
        and timeline.last_token is None
    )


def compute_budget(timeline: RequestTimeline) -> Budget:
    """Partition the request's E2E into ``semconv.SEGMENTS`` (ns, non-negative, exact sum)."""
    client_duration, skew = _client_duration(timeline)
    server = _server_bounds(timeline)
    if server is None:
        return _client_only_budget(timeline, client_duration or 0, skew)

    server_start, server_end = server
    if server_end < server_start:
        skew = True
        server_end = server_start
    server_e2e = server_end - server_start
    segments = _zero_segments()
    ttft_ns: int | None = None
    ttft_segments: dict[str, int] = {}

    if not _has_engine_boundary(timeline):
        segments[semconv.SEGMENT_UNATTRIBUTED] = server_e2e
    else:
        # Fill each missing boundary from the next known one (the phase in progress continues).
        arrival, first_scheduled, first_token, last_token = _fill_from_next(
            [timeline.arrival, timeline.first_scheduled, timeline.first_token, timeline.last_token],
            server_end,
        )
        # Clamp into [previous boundary, server_end], in time order.
        (arrival,), arrival_skewed = _monotone([arrival], server_start, server_end)
        ready = timeline.ready
        cold_end = min(ready, first_scheduled) if ready is not None and ready > arrival else arrival
        (cold_end, first_scheduled, first_token, last_token), rest_skewed = _monotone(
            [cold_end, first_scheduled, first_token, last_token], arrival, server_end
        )
        skew = skew or arrival_skewed or rest_skewed

        preempted_in_prefill, preempted_in_decode = _preempted_overlaps(
            timeline.preempted, first_scheduled, first_token, last_token
        )
        segments[semconv.SEGMENT_HTTP] = arrival - server_start
        segments[semconv.SEGMENT_COLD_START] = cold_end - arrival
        segments[semconv.SEGMENT_QUEUE] = first_scheduled - cold_end
        segments[semconv.SEGMENT_PREFILL] = first_token - first_scheduled - preempted_in_prefill
        segments[semconv.SEGMENT_PREEMPTED] = preempted_in_prefill + preempted_in_decode
        segments[semconv.SEGMENT_DECODE] = last_token - first_token - preempted_in_decode
        segments[semconv.SEGMENT_POSTPROCESS] = server_end - last_token

        if timeline.first_token is not None:
            ttft_ns = first_token - server_start
            ttft_segments = _zero_segments()
            for segment in (
                semconv.SEGMENT_HTTP,
                semconv.SEGMENT_COLD_START,
                semconv.SEGMENT_QUEUE,
                semconv.SEGMENT_PREFILL,
            ):
                ttft_segments[segment] = segments[segment]
            ttft_segments[semconv.SEGMENT_PREEMPTED] = preempted_in_prefill

    network = 0 if client_duration is None else max(0, client_duration - server_e2e)
    segments[semconv.SEGMENT_NETWORK] = network
    return Budget(
        e2e_ns=server_e2e + network,
        segments=segments,
        ttft_ns=ttft_ns,
        ttft_segments=ttft_segments,
        skew_clamped=skew,
    )


def _monotone(values: list[int], low: int, high: int) -> tuple[list[int], bool]:
    """Clamp each value into [previous clamped value (first: low), high]; whether any changed."""
    bounded: list[int] = []
    changed = False
    previous = low
    for value in values:
        clamped = high if value > high else max(value, previous)
        changed = changed or clamped != value
        bounded.append(clamped)
        previous = clamped
    return bounded, changed


def _fill_from_next(values: list[int | None], last: int) -> list[int]:
    filled: list[int] = [last] * len(values)
    following = last
    for position in range(len(values) - 1, -1, -1):
        value = values[position]
        if value is not None:
            following = value
        filled[position] = following
    return filled


def _preempted_overlaps(
    intervals: list[tuple[int, int]], first_scheduled: int, first_token: int, last_token: int
) -> tuple[int, int]:
    """Preempted ns inside [first_scheduled, first_token] and [first_token, last_token]."""
    if not intervals:
        return 0, 0
    clipped = sorted(
        (max(start, first_scheduled), min(end, last_token))
        for start, end in intervals
        if min(end, last_token) > max(start, first_scheduled)
    )
    in_prefill = in_decode = 0
    merged_start: int | None = None
    merged_end = 0
    for start, end in [*clipped, (last_token + 1, last_token + 1)]:  # sentinel flushes the last
        if merged_start is not None and start <= merged_end:
            merged_end = max(merged_end, end)
            continue
        if merged_start is not None:
            in_prefill += max(0, min(merged_end, first_token) - merged_start)
            in_decode += max(0, merged_end - max(merged_start, first_token))
        merged_start, merged_end = start, end
    return in_prefill, in_decode


def _client_only_budget(timeline: RequestTimeline, client_duration: int, skew: bool) -> Budget:
    segments = _zero_segments()
    segments[semconv.SEGMENT_UNATTRIBUTED] = client_duration
    ttft_ns: int | None = None
    ttft_segments: dict[str, int] = {}
    first_token, start = timeline.client_first_token, timeline.client_start
    if first_token is not None and start is not None and timeline.client_end is not None:
        ttft_ns = min(max(first_token - start, 0), client_duration)
        if ttft_ns != first_token - start:
            skew = True
        ttft_segments = _zero_segments()
        ttft_segments[semconv.SEGMENT_UNATTRIBUTED] = ttft_ns
    return Budget(
        e2e_ns=client_duration,
        segments=segments,
        ttft_ns=ttft_ns,
        ttft_segments=ttft_segments,
        skew_clamped=skew,
    )


def compute_metrics(timeline: RequestTimeline, budget: Budget) -> RequestMetrics:
    """TTFT, TPOT, E2E, ITL gaps and segment values per DESIGN.md's timing definitions.

    ``e2e`` is the server-side E2E (network excluded; the client duration for a client-only
    timeline). ``queue``/``prefill``/``decode`` are the budget segments, None for client-only
    timelines and for server timelines without any engine boundary. ``network`` is None without a
    client span. ITL gaps come only from recorded token offsets; none are invented.
    """
    segments = budget.segments
    client_present = timeline.client_start is not None and timeline.client_end is not None
    queue: int | None = None
    prefill: int | None = None
    decode: int | None = None
    network: int | None = None
    if _server_bounds(timeline) is None:
        e2e = budget.e2e_ns
    else:
        network_ns = segments.get(semconv.SEGMENT_NETWORK, 0)
        e2e = budget.e2e_ns - network_ns
        if client_present:
            network = network_ns
        if _has_engine_boundary(timeline):
            queue = segments.get(semconv.SEGMENT_QUEUE, 0)
            prefill = segments.get(semconv.SEGMENT_PREFILL, 0)
            decode = segments.get(semconv.SEGMENT_DECODE, 0)

    ttft = budget.ttft_ns
    output_tokens = timeline.output_tokens
    tpot: int | None = None
    if ttft is not None and output_tokens is not None and output_tokens >= 2:
        tpot = max(0, e2e - ttft) // (output_tokens - 1)

    return RequestMetrics(
        ttft=ttft,
        tpot=tpot,
        e2e=e2e,
        queue=queue,
        prefill=prefill,
        decode=decode,
        network=network,
        itl=inter_token_gaps_ns(timeline.token_offsets_us),
    )


def inter_token_gaps_ns(offsets_us: Sequence[int]) -> list[int]:
    """Gaps between consecutive token offsets (µs), in ns, in token order; negative
    (malformed) gaps are skipped. ``RequestMetrics.itl`` and the store's documents use this."""
    gaps: list[int] = []
    for previous, current in pairwise(offsets_us):
        gap = current - previous
        if gap >= 0:
            gaps.append(gap * _NS_PER_US)
    return gaps


def prompt_bucket(input_tokens: int | None) -> str:
    """The prompt-length bucket label used as a percentile dimension (e.g. ``"128-511"``)."""
    if input_tokens is None or input_tokens < 0:
        return PROMPT_BUCKET_UNKNOWN
    return PROMPT_BUCKETS[bisect_right(PROMPT_BUCKET_BOUNDS, input_tokens)]


def request_record(timeline: RequestTimeline) -> RequestRecord:
    """The record of one normalised request: its budget, metrics and prompt bucket (verdict and
    SLO marks are the diagnosis and SLO processors' to add)."""
    budget = compute_budget(timeline)
    return RequestRecord(
        timeline=timeline,
        budget=budget,
        metrics=compute_metrics(timeline, budget),
        prompt_bucket=prompt_bucket(timeline.input_tokens),
    )
