"""The latency budget: segments that partition a request's E2E exactly, and its metric values.

Server boundaries, in time order (all on the server's clock)::

  server_start -> engine_arrival -> cold_end -> first_scheduled -> first_token -> last_token -> end
               http           cold_start    queue             prefill         decode    postprocess

(``end`` here is ``server_end``.)

``cold_end`` is ``min(ready, first_scheduled)`` when the timeline has a ``ready`` time later than
engine arrival, else engine arrival (a zero-length cold start). Preempted intervals are clipped into
``[first_scheduled, last_token]`` and merged; their time moves out of ``prefill``/``decode`` into
``preempted``. All arithmetic is in integer ns, so the segments sum to E2E exactly.

Missing boundaries: a phase lasts until the next boundary that is known, so a missing boundary
takes the value of the next known one and the following segment has zero length (a request
aborted while queued puts its whole wait in ``queue``). When no engine boundary is known at all
(engine_arrival, first_scheduled, first_token and last_token all missing), the server time goes to
``unattributed`` rather than to a guessed phase.

Clock-skew policy: timestamps from different processes or hosts may disagree. Every boundary is
clamped into ``[previous boundary, server_end]`` so that the sequence is monotone and no segment is
negative; ``skew_clamped`` is set when a clamp changed a value (also when ``server_end`` precedes
``server_start``, which makes E2E zero, or when the client span ends before it starts). Client
and server clocks are never compared in absolute terms: only durations are. With a client span,
``network = max(0, client duration - server duration)`` and E2E = server E2E + network.

The time outside the server span (client duration - server duration) is not all network. It
is split by what each side measured on its own clock (``_split_outside``), in this order, each
part capped by what is left: ``connect`` (the client's setup of a new connection), ``client``
(the client's own delays: before its request's bytes were written, and the response's bytes
waiting in its kernel before it read them), ``http`` (the request's bytes waiting in the
server's kernel before the app started: the accept queue and a busy event loop, which happen
before the HTTP server span starts) and ``network``: the rest, the wire and whatever sits on it
(a proxy, a load balancer). A client span without these facts (an application's own client
instrumentation) leaves the whole gap in ``network``, as before.

TTFT: ``ttft_ns = first_token - server_start`` (after clamping), None without a token.
``ttft_segments`` is the same partition truncated at the first token and covers the SERVER-side
TTFT only: it sums to ``ttft_ns``, with no client-side segment. The client-seen TTFT
(``client_ttft_ns``: client first token - client start, one clock) has its own partition,
``client_ttft_segments``: the server-seen TTFT's segments, plus in ``http`` the first token's
delivery by the server (first token -> first response body bytes, when the HTTP span marks it),
plus the time outside the server, split as above (with the wait before the first token's read).

``decode_split.py`` splits ``decode`` into the request's own pace, co-scheduled prefill
interference and stalls, when a TPOT or ITL budget asks (most requests' verdicts never do).

Client-only timelines (no server span): all of E2E (the client duration) is ``unattributed``;
``ttft_ns`` is the client-observed TTFT (``client_first_token - client_start``) when known, with
``ttft_segments`` likewise all ``unattributed``.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from tokentrace.agent import semconv
from tokentrace.agent.finished_request import DEFAULT_ITL_OUTLIER_RATIO
from tokentrace.processors import native
from tokentrace.processors.decode_split import decode_facts_of
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
    start = timeline.server_start if timeline.server_start is not None else timeline.engine_arrival
    end = timeline.server_end if timeline.server_end is not None else timeline.end
    if start is None or end is None:
        return None
    return start, end


def has_server_view(timeline: RequestTimeline) -> bool:
    """Whether ``timeline`` has a server-side start and end (else its budget is client-only)."""
    return _server_bounds(timeline) is not None


def _has_engine_boundary(timeline: RequestTimeline) -> bool:
    return not (
        timeline.engine_arrival is None
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
        engine_arrival, first_scheduled, first_token, last_token = _fill_from_next(
            [
                timeline.engine_arrival,
                timeline.first_scheduled,
                timeline.first_token,
                timeline.last_token,
            ],
            server_end,
        )
        # Clamp into [previous boundary, server_end], in time order.
        (engine_arrival,), engine_arrival_skewed = _monotone(
            [engine_arrival], server_start, server_end
        )
        ready = timeline.ready
        cold_end = (
            min(ready, first_scheduled)
            if ready is not None and ready > engine_arrival
            else engine_arrival
        )
        (cold_end, first_scheduled, first_token, last_token), rest_skewed = _monotone(
            [cold_end, first_scheduled, first_token, last_token], engine_arrival, server_end
        )
        skew = skew or engine_arrival_skewed or rest_skewed

        preempted_in_prefill, preempted_in_decode = _preempted_overlaps(
            timeline.preempted, first_scheduled, first_token, last_token
        )
        segments[semconv.SEGMENT_HTTP] = engine_arrival - server_start
        segments[semconv.SEGMENT_COLD_START] = cold_end - engine_arrival
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

    outside = 0
    if client_duration is not None:
        outside = max(0, client_duration - server_e2e)
        _add_outside(segments, outside, timeline, read_wait=timeline.client_read_wait_ns)
    budget = Budget(
        e2e_ns=server_e2e + outside,
        segments=segments,
        ttft_ns=ttft_ns,
        ttft_segments=ttft_segments,
        skew_clamped=skew,
        server_e2e_ns=server_e2e,
    )
    if ttft_ns is not None:
        budget.client_ttft_ns, budget.client_ttft_segments = _client_ttft(
            timeline, ttft_ns, ttft_segments, server_start
        )
    return budget


def _total(*values: int | None) -> int | None:
    """The sum of the known values; None when none is known."""
    known = [value for value in values if value is not None]
    return sum(known) if known else None


def _add_outside(
    segments: dict[str, int], outside_ns: int, timeline: RequestTimeline, *, read_wait: int | None
) -> None:
    """Add the time outside the server span to ``segments`` by who spent it (see the module
    docstring): ``connect``, ``client`` (its wait to send and ``read_wait``), ``http`` (before
    the app) and ``network``, each claim capped by what is left."""
    remaining = outside_ns
    client_wait = _total(timeline.client_send_wait_ns, read_wait)
    for segment, claimed in (
        (semconv.SEGMENT_CONNECT, timeline.client_connect_ns),
        (semconv.SEGMENT_CLIENT, client_wait),
        (semconv.SEGMENT_HTTP, timeline.http_receive_wait_ns),
    ):
        if claimed:
            taken = min(claimed, remaining)
            segments[segment] += taken
            remaining -= taken
    segments[semconv.SEGMENT_NETWORK] += remaining


def _client_ttft(
    timeline: RequestTimeline, ttft_ns: int, ttft_segments: dict[str, int], server_start: int
) -> tuple[int | None, dict[str, int]]:
    """The client-seen TTFT and its partition (see the module docstring); (None, {}) without a
    client span that marks its first token."""
    start, first_token = timeline.client_start, timeline.client_first_token
    if start is None or first_token is None or timeline.client_end is None:
        return None, {}
    client_ttft = max(first_token - start, 0)
    segments = dict(ttft_segments)
    server_part = ttft_ns
    if timeline.server_first_body is not None and timeline.first_token is not None:
        # The server's delivery of the first token (its API server's work after the engine),
        # on the server's clock, capped by what the client saw.
        delivery = max(0, timeline.server_first_body - server_start - ttft_ns)
        delivery = min(delivery, max(client_ttft - ttft_ns, 0))
        segments[semconv.SEGMENT_HTTP] += delivery
        server_part += delivery
    outside = max(0, client_ttft - server_part)
    _add_outside(segments, outside, timeline, read_wait=timeline.client_first_token_read_wait_ns)
    # A client TTFT shorter than the server's (skewed durations) keeps the server's partition.
    return server_part + outside, segments


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
    """TTFT, TPOT, E2E, ITL gaps and segment values per the README's timing definitions.

    ``e2e`` is the server-side E2E (the time outside the server excluded; the client duration
    for a client-only timeline). ``queue``/``prefill``/``decode`` are the budget segments, None
    for client-only timelines and for server timelines without any engine boundary. ``network``
    is the budget's ``network`` segment (the wire, once the client's and the server's own waits
    are taken out), None without a client span. ITL gaps come only from recorded token offsets;
    none are invented.
    """
    segments = budget.segments
    client_present = timeline.client_start is not None and timeline.client_end is not None
    queue: int | None = None
    prefill: int | None = None
    decode: int | None = None
    network: int | None = None
    if budget.server_e2e_ns is None:
        e2e = budget.e2e_ns
    else:
        e2e = budget.server_e2e_ns
        if client_present:
            network = segments.get(semconv.SEGMENT_NETWORK, 0)
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


def inter_token_gaps_ns(offsets_us: Sequence[int]) -> array[int]:
    """Gaps between consecutive token offsets (µs), in ns, in token order; negative
    (malformed) gaps are skipped; an ``array('q')``. ``RequestMetrics.itl`` and the store's
    documents use this."""
    return native.gaps_ns(offsets_us)  # per token, for every request the collector sees


def prompt_bucket(input_tokens: int | None) -> str:
    """The prompt-length bucket label used as a percentile dimension (e.g. ``"128-511"``)."""
    if input_tokens is None or input_tokens < 0:
        return PROMPT_BUCKET_UNKNOWN
    return PROMPT_BUCKETS[bisect_right(PROMPT_BUCKET_BOUNDS, input_tokens)]


def request_record(
    timeline: RequestTimeline, *, itl_outlier_ratio: float = DEFAULT_ITL_OUTLIER_RATIO
) -> RequestRecord:
    """The record of one normalised request: its budget, metrics and prompt bucket (verdict and
    SLO marks are the diagnosis and SLO processors' to add)."""
    budget = compute_budget(timeline)
    return RequestRecord(
        timeline=timeline,
        budget=budget,
        metrics=compute_metrics(timeline, budget),
        prompt_bucket=prompt_bucket(timeline.input_tokens),
        itl_outlier_ratio=itl_outlier_ratio,
    )


# --- one budget per latency metric ----------------------------------------------------------------
@dataclass(slots=True)
class MetricBudget:
    """One latency metric of one request, split into the segments that make it up.

    ``segments`` are >= 0 and sum exactly to ``value_ns``. TTFT and E2E exist on both clocks
    when a client span came (the client-seen ones add the client-side segments); TPOT and ITL
    only on the server's:

    - TPOT: the time after the first token (decode split by cause, preemption, post-processing)
      apportioned per output token after the first, so it sums to the TPOT value;
    - ITL: the request's outlier inter-token gaps together (``decode_split.decode_facts_of``),
      or all its gaps, its own pace, when none is an outlier.
    """

    metric: str
    clock: str
    value_ns: int
    segments: Mapping[str, int]


def metric_budget(
    record: RequestRecord, metric: str, *, clock: str | None = None
) -> MetricBudget | None:
    """``metric``'s budget on ``clock`` (None: the client's when the request has it, else the
    server's); None when the request has no value for it on that clock."""
    budget = record.budget
    timeline = record.timeline
    client_only = budget.server_e2e_ns is None
    if metric in (semconv.METRIC_TTFT, semconv.METRIC_E2E):
        client_view: tuple[int, Mapping[str, int]] | None = None
        server_view: tuple[int, Mapping[str, int]] | None = None
        if metric == semconv.METRIC_TTFT:
            if budget.client_ttft_ns is not None:
                client_view = (budget.client_ttft_ns, budget.client_ttft_segments)
            elif client_only and budget.ttft_ns is not None:
                client_view = (budget.ttft_ns, budget.ttft_segments)
            if not client_only and budget.ttft_ns is not None:
                server_view = (budget.ttft_ns, budget.ttft_segments)
        else:
            if timeline.client_start is not None and timeline.client_end is not None:
                client_view = (budget.e2e_ns, budget.segments)
            if budget.server_e2e_ns is not None:
                server_view = (budget.server_e2e_ns, server_e2e_segments(budget))
        if clock == semconv.CLOCK_CLIENT or (clock is None and client_view is not None):
            view, chosen = client_view, semconv.CLOCK_CLIENT
        else:
            view, chosen = server_view, semconv.CLOCK_SERVER
        return None if view is None else MetricBudget(metric, chosen, view[0], view[1])
    if clock == semconv.CLOCK_CLIENT or client_only:
        return None
    if metric == semconv.METRIC_TPOT:
        tpot = record.metrics.tpot
        if tpot is None or budget.ttft_ns is None or not timeline.output_tokens:
            return None
        after = after_first_token_segments(budget, decode_facts_of(record).split)
        return MetricBudget(metric, semconv.CLOCK_SERVER, tpot, apportion(after, tpot))
    if metric == semconv.METRIC_ITL:
        gaps = record.metrics.itl
        if not gaps:
            return None
        outliers = decode_facts_of(record).outlier_gaps
        if not outliers:  # steady gaps: all of it is the request's own pace
            total = sum(gaps)
            return MetricBudget(
                metric, semconv.CLOCK_SERVER, total, {semconv.SEGMENT_DECODE: total}
            )
        segments = dict.fromkeys((*semconv.DECODE_SEGMENTS, semconv.SEGMENT_PREEMPTED), 0)
        for part in outliers:
            for segment, ns in part.segments().items():
                segments[segment] += ns
        return MetricBudget(metric, semconv.CLOCK_SERVER, sum(segments.values()), segments)
    return None


def server_e2e_segments(budget: Budget) -> dict[str, int]:
    """The server-seen E2E's partition: the budget without the time outside the server span
    (client-side segments, and the kernel wait before the app that ``http`` also holds)."""
    segments = dict(budget.segments)
    outside = budget.e2e_ns - (budget.server_e2e_ns or 0)
    for segment in semconv.CLIENT_SIDE_SEGMENTS:
        outside -= segments.get(segment, 0)
        segments[segment] = 0
    segments[semconv.SEGMENT_HTTP] = max(0, segments.get(semconv.SEGMENT_HTTP, 0) - outside)
    return segments


def after_first_token_segments(budget: Budget, decode_split: Mapping[str, int]) -> dict[str, int]:
    """The server-seen time after the first token (E2E - TTFT): decode split by cause
    (``decode_split``), preemption during decode and post-processing."""
    after: dict[str, int] = dict(decode_split) or {
        semconv.SEGMENT_DECODE: budget.segments.get(semconv.SEGMENT_DECODE, 0)
    }
    after[semconv.SEGMENT_PREEMPTED] = budget.segments.get(
        semconv.SEGMENT_PREEMPTED, 0
    ) - budget.ttft_segments.get(semconv.SEGMENT_PREEMPTED, 0)
    after[semconv.SEGMENT_POSTPROCESS] = budget.segments.get(semconv.SEGMENT_POSTPROCESS, 0)
    return after


def apportion(parts: Mapping[str, int], total: int) -> dict[str, int]:
    """``parts`` scaled to sum exactly to ``total`` (largest remainders get the leftover ns)."""
    whole = sum(parts.values())
    if whole <= 0:
        return {name: 0 for name in parts} | ({next(iter(parts)): total} if parts else {})
    shares = {name: divmod(ns * total, whole) for name, ns in parts.items()}
    scaled = {name: quotient for name, (quotient, _) in shares.items()}
    leftover = total - sum(scaled.values())
    for name in sorted(shares, key=lambda n: shares[n][1], reverse=True)[:leftover]:
        scaled[name] += 1
    return scaled
