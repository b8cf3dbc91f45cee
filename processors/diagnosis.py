"""Why a segment of a request's metric budget took its time: the rule table that names a cause.

Given a request and one segment of one metric's budget (``budget.metric_budget``), a small rule
table turns the segment into a cause, with the words and numbers that say why, using the
request's context (prompt length, queue depth, prefix hash, ITL shape, memory bandwidth, the
client's connection). Rules, in the order they are checked:

1. ``error``: the request ended with an error status (the dominant segment is still cited;
   ``verdict.py`` puts it over the cause found here).
2. ``unattributed``: only client spans arrived, or the server span has no phase timings.
3. ``kv_cache_pressure``: preemption dominates, or is at least ``preemption_share`` of the value.
4. By dominant segment: queue -> ``queueing``; cold_start -> ``cold_start``; prefill ->
   ``prefix_cache_miss`` (a shared prefix recomputed with a reported 0 cached tokens), else
   ``long_prompt`` (at least ``long_prompt_tokens`` computed, cached ones left out), else
   ``prefill``; decode -> ``bandwidth_bound_decode`` when GPU samples say
   so, else for E2E ``batching_interference`` (interference from co-scheduled prefills at least
   ``interference_share`` of decode; without step data, a spiky ITL tail) or ``long_decode``
   (many tokens), and for TPOT/ITL ``slow_decode`` (the per-token pace);
   interference -> ``batching_interference``; stall -> ``decode_stall``; network / http /
   postprocess -> the cause of that name; client -> ``client_saturated``; connect ->
   ``connection_setup``.

Which segment dominates a budget is decided here too (``ranked_segments``: largest first, ties
to the segment earlier in ``_SEGMENT_ORDER``; ``second_segment``: a runner-up within
``tie_ratio``): the per-request verdicts (``verdict.py``) and the window findings
(``window/findings.py``) both ask it and then ask ``cause_of_segment``, so that a window names
the same causes as its requests. Everything here tolerates ``None`` context: a missing number
is left out of the sentence, never guessed. The causes and their advice are in ``causes.py``;
``DiagnosisConfig`` holds every threshold the rules, the verdicts and the findings use.
"""

from __future__ import annotations

import math
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from tokentrace.agent import semconv
from tokentrace.agent.finished_request import DEFAULT_ITL_OUTLIER_RATIO, gap_median
from tokentrace.processors.budget import MetricBudget, has_server_view, server_e2e_segments
from tokentrace.processors.causes import (
    CAUSE_BANDWIDTH_BOUND_DECODE,
    CAUSE_BATCHING_INTERFERENCE,
    CAUSE_CLIENT_SATURATED,
    CAUSE_COLD_START,
    CAUSE_CONNECTION_SETUP,
    CAUSE_DECODE_STALL,
    CAUSE_HTTP,
    CAUSE_KV_CACHE_PRESSURE,
    CAUSE_LONG_DECODE,
    CAUSE_LONG_PROMPT,
    CAUSE_NETWORK,
    CAUSE_POSTPROCESS,
    CAUSE_PREFILL,
    CAUSE_PREFIX_CACHE_MISS,
    CAUSE_QUEUEING,
    CAUSE_SLOW_DECODE,
    CAUSE_UNATTRIBUTED,
    SERVER_WITHOUT_PHASES_ADVICE,
)
from tokentrace.processors.decode_split import decode_facts_of
from tokentrace.processors.durations import ms_of
from tokentrace.processors.model import RequestRecord
from tokentrace.processors.stats import nearest_rank
from tokentrace.processors.timeline import DIALECT_VLLM
from tokentrace.processors.wording import format_duration, format_share, plural, segment_label

_DEFAULT_LONG_PROMPT_TOKENS: Final = 1024
_DEFAULT_BANDWIDTH_BOUND_RATIO: Final = 0.8
_DEFAULT_MIN_ITL_GAPS: Final = 8
_DEFAULT_PREEMPTION_SHARE: Final = 0.2
_DEFAULT_TIE_RATIO: Final = 0.9
_DEFAULT_INTERFERENCE_SHARE: Final = 0.25
_DEFAULT_P50_BAND: Final = (40.0, 60.0)
_DEFAULT_TAIL_PERCENTILE: Final = 95.0
_DEFAULT_ITL_TAIL_SPIKE_RATIO: Final = 3.0

_PREFIX_HASH_CHARS: Final = 12
"""Characters of a prefix hash quoted in a sentence (the full hash is in the numbers)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DiagnosisConfig:
    long_prompt_tokens: int = _DEFAULT_LONG_PROMPT_TOKENS
    """Prompts at least this long make a prefill-dominated request a long-prompt case."""
    bandwidth_bound_ratio: float = _DEFAULT_BANDWIDTH_BOUND_RATIO
    """Decode is bandwidth-bound when measured memory bandwidth is at least this share of peak."""
    itl_outlier_ratio: float = DEFAULT_ITL_OUTLIER_RATIO
    """An inter-token gap above this many of the request's median gaps is an outlier: the
    TPOT/ITL budgets split its excess by cause, and the API and UI mark it. The agent's
    ``TOKENTRACE_ITL_OUTLIER_RATIO`` (same default) decides which gaps get engine-step spans."""
    itl_tail_spike_ratio: float = _DEFAULT_ITL_TAIL_SPIKE_RATIO
    """A request's ITL tail is spiky when its p99 gap / median gap reaches this."""
    min_itl_gaps: int = _DEFAULT_MIN_ITL_GAPS
    """Fewer inter-token gaps than this say nothing about the ITL tail (never spiky)."""
    preemption_share: float = _DEFAULT_PREEMPTION_SHARE
    """Preemption this large a share of a metric is KV-cache pressure even when not dominant."""
    interference_share: float = _DEFAULT_INTERFERENCE_SHARE
    """Interference from co-scheduled prefills this large a share of decode makes a
    decode-dominated E2E a batching-interference case (else many tokens: long decode)."""
    tie_ratio: float = _DEFAULT_TIE_RATIO
    """A second segment at least this fraction of the dominant one is named beside it."""
    p50_band: tuple[float, float] = _DEFAULT_P50_BAND
    """Percentiles around the median whose requests make up a window's typical request."""
    tail_percentile: float = _DEFAULT_TAIL_PERCENTILE
    """Requests at or above this percentile make up a window's tail."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field outside its bounds (``"tie_ratio: ..."``).

        The one home of these limits: the collector's ``diagnosis`` processor config reuses it
        (the field names are its YAML keys)."""
        for name, (low, high) in _LIMITS.items():
            value = getattr(self, name)
            if not low <= value <= high:  # NaN is outside every range
                raise ValueError(f"{name}: {value!r} is outside [{low}, {high}]")
        low, high = self.p50_band
        if not 0 < low <= high <= 100:
            raise ValueError(f"p50_band: expected 0 < low <= high <= 100, got {self.p50_band!r}")
        if not 0 < self.tail_percentile <= 100:
            raise ValueError(f"tail_percentile: expected (0, 100], got {self.tail_percentile!r}")
        if self.preemption_share <= 0:
            raise ValueError(f"preemption_share: must be > 0, got {self.preemption_share!r}")


_LIMITS: Final = {
    "long_prompt_tokens": (1, math.inf),
    "bandwidth_bound_ratio": (0.0, 1.0),
    "itl_outlier_ratio": (1.0, math.inf),
    "itl_tail_spike_ratio": (1.0, math.inf),
    "interference_share": (0.0, 1.0),
    "tie_ratio": (0.01, 1.0),
}
"""``DiagnosisConfig`` fields and their inclusive bounds (checked by ``validate``)."""

_DEFAULT_CONFIG: Final = DiagnosisConfig()

# --- the dominant segment ---------------------------------------------------------------------
_SEGMENT_ORDER: Final = {
    segment: index for index, segment in enumerate(semconv.METRIC_BUDGET_SEGMENTS)
}
"""Ties between segments go to the earlier one in time."""


def ranked_segments(values: Mapping[str, float]) -> list[tuple[str, float]]:
    """The segments that hold time, largest first; equal ones in time order (unknown names,
    from a newer budget, after the known ones)."""
    present = [(segment, value) for segment, value in values.items() if value > 0]
    present.sort(key=lambda item: (-item[1], _SEGMENT_ORDER.get(item[0], len(_SEGMENT_ORDER))))
    return present


def second_segment(
    ranked: Sequence[tuple[str, float]], config: DiagnosisConfig
) -> tuple[str, float] | None:
    """The runner-up when it is within ``config.tie_ratio`` of the dominant segment."""
    if len(ranked) < 2 or ranked[1][1] < config.tie_ratio * ranked[0][1]:
        return None
    return ranked[1]


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


# --- the rules --------------------------------------------------------------------------------
@dataclass(slots=True)
class RequestFinding:
    """A segment of one request explained: its cause, the words and numbers that say why, and
    the advice (a window's findings are ``window.findings.WindowFinding``)."""

    cause: str
    cited_segment: str
    """The segment the sentence leads with (the dominant one, or preemption for rule 3)."""
    detail: str
    numbers: dict[str, float | int | str]
    advice: str | None = None
    """Overrides ``ADVICE[cause]`` when the usual advice does not fit this request."""


def cause_of_segment(
    record: RequestRecord,
    view: MetricBudget,
    segment: str,
    config: DiagnosisConfig = _DEFAULT_CONFIG,
    *,
    seen_prefixes: Container[str] | None = None,
    preemption_rule: bool = True,
) -> RequestFinding:
    """Why ``segment`` of ``record``'s ``view`` took its time: the rule table of the module
    docstring. ``preemption_rule=False`` skips rule 3 (a window asking about one segment)."""
    segments = view.segments
    if segment == semconv.SEGMENT_UNATTRIBUTED:
        return _unattributed(record, segments.get(segment, 0))
    preempted_ns = segments.get(semconv.SEGMENT_PREEMPTED, 0)
    value = view.value_ns
    if segment == semconv.SEGMENT_PREEMPTED or (
        preemption_rule
        and preempted_ns > 0
        and value > 0
        and preempted_ns / value >= config.preemption_share
    ):
        return _kv_cache_pressure(record, view, segment)
    if segment == semconv.SEGMENT_QUEUE:
        return _queueing(record)
    if segment == semconv.SEGMENT_COLD_START:
        return RequestFinding(
            CAUSE_COLD_START, segment, "the request arrived before the server was ready", {}
        )
    if segment == semconv.SEGMENT_PREFILL:
        return _prefill(record, config, seen_prefixes)
    if segment == semconv.SEGMENT_DECODE:
        if view.metric == semconv.METRIC_E2E:
            return _decode(record, config)
        return _decode_pace(record, config)
    if segment == semconv.SEGMENT_INTERFERENCE:
        return _interference(record, config)
    if segment == semconv.SEGMENT_STALL:
        return _stall(record)
    if segment == semconv.SEGMENT_NETWORK:
        return _network(record)
    if segment == semconv.SEGMENT_CONNECT:
        return _connect(record)
    if segment == semconv.SEGMENT_CLIENT:
        return _client(record)
    if segment == semconv.SEGMENT_HTTP:
        return _http(record, view)
    if segment == semconv.SEGMENT_POSTPROCESS:
        return RequestFinding(
            CAUSE_POSTPROCESS,
            segment,
            "after the last token (detokenisation, response assembly)",
            {},
        )
    # A segment this version does not know: name it without a specific cause.
    return RequestFinding(
        CAUSE_UNATTRIBUTED, segment, f"segment {segment!r} has no diagnosis rule", {}
    )


def _unattributed(record: RequestRecord, segment_ns: int) -> RequestFinding:
    """Unattributed time, worded by what arrived: client spans only, or a server span whose
    phases cannot be placed."""
    segment = semconv.SEGMENT_UNATTRIBUTED
    if segment_ns <= 0:
        return RequestFinding(
            CAUSE_UNATTRIBUTED, segment, "no time was attributed to any segment", {}
        )
    timeline = record.timeline
    if not has_server_view(timeline):
        detail = "only client-side spans arrived; server-side spans are missing"
        return RequestFinding(CAUSE_UNATTRIBUTED, segment, detail, {"server_span": 0})
    if timeline.dialect == DIALECT_VLLM:
        detail = (
            f"the server's {semconv.VLLM_SPAN_REQUEST} span has no "
            f"{semconv.VLLM_LATENCY_TTFT}, so its time cannot be split into phases"
        )
    else:
        detail = "the server span has no phase timings, so its time cannot be split into phases"
    return RequestFinding(
        CAUSE_UNATTRIBUTED,
        segment,
        detail,
        {"server_span": 1, "dialect": timeline.dialect},
        advice=SERVER_WITHOUT_PHASES_ADVICE,
    )


def _queueing(record: RequestRecord) -> RequestFinding:
    timeline = record.timeline
    parts: list[str] = []
    numbers: dict[str, float | int | str] = {}
    ahead = timeline.requests_ahead
    running = timeline.running_at_arrival
    max_running = timeline.max_running
    if ahead is not None:
        parts.append(f"{plural(ahead, 'request')} ahead")
        numbers["requests_ahead"] = ahead
    if running is not None:
        numbers["running_at_arrival"] = running
    if max_running is not None:
        numbers["max_running"] = max_running
    if running is not None and max_running is not None and max_running > 0:
        batch_full = running >= max_running
        numbers["batch_full"] = int(batch_full)
        if batch_full:
            parts.append(f"batch full ({running:,}/{max_running:,} running)")
        else:
            parts.append(f"{running:,}/{max_running:,} running at arrival")
    elif running is not None:
        parts.append(f"{running:,} running at arrival")
    return RequestFinding(CAUSE_QUEUEING, semconv.SEGMENT_QUEUE, ", ".join(parts), numbers)


def _prefill(
    record: RequestRecord, config: DiagnosisConfig, seen_prefixes: Container[str] | None
) -> RequestFinding:
    timeline = record.timeline
    input_tokens = timeline.input_tokens
    cached = timeline.cached_tokens
    numbers: dict[str, float | int | str] = {"long_prompt_tokens": config.long_prompt_tokens}
    if input_tokens is not None:
        numbers["input_tokens"] = input_tokens
    if cached is not None:
        numbers["cached_tokens"] = cached
    chunks = len(timeline.prefill_chunks)
    chunk_note = f" in {chunks} chunks" if chunks > 1 else ""
    if chunks > 1:
        numbers["prefill_chunks"] = chunks

    prefix = timeline.prefix_hash
    # Only a reported 0 is a miss: an unknown cached count says nothing about the prefix cache.
    if prefix and cached == 0 and seen_prefixes is not None and prefix in seen_prefixes:
        numbers["prefix_hash"] = prefix
        recomputed = f"{input_tokens:,} prompt tokens" if input_tokens is not None else "prompt"
        detail = (
            f"shared prompt prefix {prefix[:_PREFIX_HASH_CHARS]} seen earlier in the window was "
            f"recomputed (0 cached tokens, {recomputed} prefilled{chunk_note})"
        )
        return RequestFinding(CAUSE_PREFIX_CACHE_MISS, semconv.SEGMENT_PREFILL, detail, numbers)
    cached_note = f", {cached:,} from the prefix cache" if cached else ""
    # A prompt is long by what the prefill computed: cached tokens cost it nothing.
    computed = None if input_tokens is None else input_tokens - (cached or 0)
    if computed is not None and computed >= config.long_prompt_tokens:
        detail = (
            f"long prompt, {input_tokens:,} input tokens{cached_note}{chunk_note} "
            f"(long-prompt threshold {config.long_prompt_tokens:,})"
        )
        return RequestFinding(CAUSE_LONG_PROMPT, semconv.SEGMENT_PREFILL, detail, numbers)
    if input_tokens is not None:
        prompt = (
            f"{input_tokens:,} input tokens{cached_note}{chunk_note}, "
            f"below the long-prompt threshold of {config.long_prompt_tokens:,}"
        )
    else:
        prompt = f"prompt length unknown{chunk_note}"
    detail = f"{prompt}; compute-bound prefill or contention with other requests"
    return RequestFinding(CAUSE_PREFILL, semconv.SEGMENT_PREFILL, detail, numbers)


def _per_token(record: RequestRecord, numbers: dict[str, float | int | str]) -> str:
    """``N output tokens at X TPOT`` (the parts known), recording the numbers."""
    timeline = record.timeline
    tpot = record.metrics.tpot
    parts: list[str] = []
    if timeline.output_tokens is not None:
        numbers["output_tokens"] = timeline.output_tokens
        parts.append(plural(timeline.output_tokens, "output token"))
    if tpot is not None:
        numbers["tpot_ms"] = ms_of(tpot)
        parts.append(f"{format_duration(tpot)} TPOT")
    return " at ".join(parts)


def _bandwidth_bound(
    record: RequestRecord, config: DiagnosisConfig, numbers: dict[str, float | int | str]
) -> str | None:
    """The bandwidth-bound wording when the GPU samples (or the roofline) say so, else None."""
    timeline = record.timeline
    ratio = _finite(timeline.decode_bandwidth_peak_ratio)
    roofline = _finite(timeline.decode_roofline_ratio)
    # Measured bandwidth decides; without it, the roofline (weights read per token) does.
    measured = ratio if ratio is not None else roofline
    if measured is None or measured < config.bandwidth_bound_ratio:
        return None
    parts = []
    if ratio is not None:
        numbers["bandwidth_peak_ratio"] = round(ratio, 4)
        parts.append(f"memory bandwidth at {ratio:.0%} of peak")
    if roofline is not None:
        numbers["roofline_ratio"] = round(roofline, 4)
        parts.append(f"tokens at {roofline:.0%} of the weight-read limit")
    return f"{', '.join(parts)} (bandwidth-bound)"


def _bandwidth_finding(
    record: RequestRecord, config: DiagnosisConfig, numbers: dict[str, float | int | str]
) -> tuple[RequestFinding | None, str]:
    """(the bandwidth-bound finding when the GPU says so, else None; the per-token text)."""
    per_token = _per_token(record, numbers)
    bound = _bandwidth_bound(record, config, numbers)
    if bound is None:
        return None, per_token
    detail = f"{bound}; {per_token}" if per_token else bound
    return RequestFinding(
        CAUSE_BANDWIDTH_BOUND_DECODE, semconv.SEGMENT_DECODE, detail, numbers
    ), per_token


def _decode(record: RequestRecord, config: DiagnosisConfig) -> RequestFinding:
    """Decode dominating E2E: bandwidth, spikes from co-scheduled prefills, or many tokens."""
    timeline = record.timeline
    metrics = record.metrics
    numbers: dict[str, float | int | str] = {}
    bound, per_token = _bandwidth_finding(record, config, numbers)
    if bound is not None:
        return bound

    facts = decode_facts_of(record)
    split = facts.split
    if facts.engine_steps or timeline.outlier_steps_with_prefill is not None:
        # The engine said which slow gaps shared their steps with prefills: interference is a
        # cause of E2E when it is a large part of decode, not merely present.
        interference = split.get(semconv.SEGMENT_INTERFERENCE, 0)
        decode_ns = sum(split.values())
        if decode_ns and interference >= config.interference_share * decode_ns:
            return _interference(record, config, cited=semconv.SEGMENT_DECODE)
        return RequestFinding(CAUSE_LONG_DECODE, semconv.SEGMENT_DECODE, per_token, numbers)
    spikes = _itl_spikes(metrics.itl, config)
    outliers = timeline.outlier_steps_with_prefill
    if spikes is not None and (outliers is None or outliers > 0):
        detail = _spike_text(spikes, numbers)
        if outliers is not None:
            numbers["outlier_steps_with_prefill"] = outliers
            detail = f"{detail}; {plural(outliers, 'outlier step')} shared the batch with a prefill"
        return RequestFinding(CAUSE_BATCHING_INTERFERENCE, semconv.SEGMENT_DECODE, detail, numbers)
    return RequestFinding(CAUSE_LONG_DECODE, semconv.SEGMENT_DECODE, per_token, numbers)


def _spike_text(spikes: tuple[int, int], numbers: dict[str, float | int | str]) -> str:
    median_ns, p99_ns = spikes
    numbers["itl_median_ms"] = ms_of(median_ns)
    numbers["itl_p99_ms"] = ms_of(p99_ns)
    if median_ns > 0:
        numbers["itl_spike_ratio"] = round(p99_ns / median_ns, 2)
        spread = f"{p99_ns / median_ns:.1f}x the median {format_duration(median_ns)}"
    else:
        spread = "the median gap is 0"
    return f"spiky inter-token gaps, p99 {format_duration(p99_ns)} is {spread}"


def _decode_pace(record: RequestRecord, config: DiagnosisConfig) -> RequestFinding:
    """The request's own per-token pace dominating TPOT/ITL: bandwidth, else the model's pace."""
    numbers: dict[str, float | int | str] = {}
    bound, per_token = _bandwidth_finding(record, config, numbers)
    if bound is not None:
        return bound
    # The median the outlier rule and the ITL verdict use, so that the sentences agree.
    median = gap_median(record.metrics.itl)
    if median is not None:
        numbers["itl_median_ms"] = ms_of(median)
        pace = f"every step of the request is slow: median gap {format_duration(median)}"
    else:
        pace = "every step of the request is slow"
    running = record.timeline.max_running
    if running is not None:
        numbers["max_running"] = running
        pace = f"{pace}, batch limit {running:,}"
    detail = f"{pace} ({per_token})" if per_token else pace
    return RequestFinding(CAUSE_SLOW_DECODE, semconv.SEGMENT_DECODE, detail, numbers)


def _outlier_gaps(record: RequestRecord, segment: str) -> int:
    """How many of the request's outlier gaps had their excess put into ``segment``."""
    return sum(1 for part in decode_facts_of(record).outlier_gaps if part.segments()[segment])


def _interference(
    record: RequestRecord,
    config: DiagnosisConfig,
    *,
    cited: str = semconv.SEGMENT_INTERFERENCE,
) -> RequestFinding:
    numbers: dict[str, float | int | str] = {}
    facts = decode_facts_of(record)
    interference = facts.split.get(semconv.SEGMENT_INTERFERENCE, 0)
    if interference:
        numbers["interference_ms"] = ms_of(interference)
    gaps = _outlier_gaps(record, semconv.SEGMENT_INTERFERENCE)
    numbers["interfered_gaps"] = gaps
    prefill_tokens = facts.max_step_prefill_tokens
    parts = [
        f"{plural(gaps, 'slow inter-token gap')} ran engine steps that also prefilled other "
        "requests' prompts"
    ]
    if prefill_tokens:
        numbers["max_step_prefill_tokens"] = prefill_tokens
        parts.append(f"up to {prefill_tokens:,} prompt tokens in one step")
    spikes = _itl_spikes(record.metrics.itl, config)
    if spikes is not None:
        parts.append(_spike_text(spikes, numbers))
    return RequestFinding(CAUSE_BATCHING_INTERFERENCE, cited, "; ".join(parts), numbers)


def _stall(record: RequestRecord) -> RequestFinding:
    gaps = _outlier_gaps(record, semconv.SEGMENT_STALL)
    detail = (
        f"{plural(gaps, 'slow inter-token gap')} had no engine step of the request for most "
        "of its length: the engine or its frontend did not step it"
    )
    return RequestFinding(CAUSE_DECODE_STALL, semconv.SEGMENT_STALL, detail, {"stalled_gaps": gaps})


def _network(record: RequestRecord) -> RequestFinding:
    timeline = record.timeline
    numbers: dict[str, float | int | str] = {}
    detail = "time between the client and the server that neither of them spent"
    rtt = timeline.client_rtt_ns
    if rtt is not None:
        numbers["rtt_ms"] = ms_of(rtt)
        network = record.budget.segments.get(semconv.SEGMENT_NETWORK, 0)
        if network > 4 * rtt:
            detail = (
                f"{detail}; the first hop's round trip is only {format_duration(rtt)}, so the "
                "delay lies beyond it (a proxy, a load balancer or a long path)"
            )
        else:
            detail = f"{detail}; the first hop's round trip is {format_duration(rtt)}"
    return RequestFinding(CAUSE_NETWORK, semconv.SEGMENT_NETWORK, detail, numbers)


def _connect(record: RequestRecord) -> RequestFinding:
    timeline = record.timeline
    numbers: dict[str, float | int | str] = {}
    detail = "the request opened a new connection (TCP handshake, TLS)"
    if timeline.client_connect_ns is not None:
        numbers["connect_ms"] = ms_of(timeline.client_connect_ns)
        detail = f"{detail} that took {format_duration(timeline.client_connect_ns)}"
    return RequestFinding(CAUSE_CONNECTION_SETUP, semconv.SEGMENT_CONNECT, detail, numbers)


def _client(record: RequestRecord) -> RequestFinding:
    timeline = record.timeline
    numbers: dict[str, float | int | str] = {}
    parts = []
    for key, ns, text in (
        ("send_wait_ms", timeline.client_send_wait_ns, "before sending"),
        ("first_token_read_wait_ms", timeline.client_first_token_read_wait_ns, "to read its "
         "first token after it arrived"),
        ("read_wait_ms", timeline.client_read_wait_ns, "to read the response's end after it "
         "arrived"),
    ):  # fmt: skip
        if ns:
            numbers[key] = ms_of(ns)
            parts.append(f"{format_duration(ns)} {text}")
    detail = "the client was late"
    if parts:
        detail = f"{detail}: {', '.join(parts)} (its event loop or CPU was busy)"
    return RequestFinding(CAUSE_CLIENT_SATURATED, semconv.SEGMENT_CLIENT, detail, numbers)


def _http(record: RequestRecord, view: MetricBudget) -> RequestFinding:
    """The API server's own time: before the engine, waiting in the kernel, delivering."""
    timeline = record.timeline
    numbers: dict[str, float | int | str] = {}
    parts = []
    before_engine = record.budget.ttft_segments.get(semconv.SEGMENT_HTTP)
    if before_engine is None:
        before_engine = server_e2e_segments(record.budget).get(semconv.SEGMENT_HTTP, 0)
    if before_engine:
        numbers["http_before_engine_ms"] = ms_of(before_engine)
        parts.append(
            f"{format_duration(before_engine)} in the API server before the engine (parsing, "
            "chat templating, tokenisation)"
        )
    receive = timeline.http_receive_wait_ns
    if view.clock == semconv.CLOCK_CLIENT and receive:
        numbers["http_receive_wait_ms"] = ms_of(receive)
        parts.append(
            f"{format_duration(receive)} with the request's bytes waiting in the server's "
            "kernel before the app took them (accept queue, busy event loop)"
        )
    first_body, first_token = timeline.server_first_body, timeline.first_token
    if (
        view.metric == semconv.METRIC_TTFT
        and view.clock == semconv.CLOCK_CLIENT
        and first_body is not None
        and first_token is not None
        and first_body > first_token
    ):
        numbers["http_first_token_delivery_ms"] = ms_of(first_body - first_token)
        parts.append(
            f"{format_duration(first_body - first_token)} delivering the first token after the "
            "engine made it"
        )
    detail = "; ".join(parts) or "server time outside the engine"
    return RequestFinding(CAUSE_HTTP, semconv.SEGMENT_HTTP, detail, numbers)


def _kv_cache_pressure(record: RequestRecord, view: MetricBudget, segment: str) -> RequestFinding:
    numbers: dict[str, float | int | str] = {}
    evictions = len(record.timeline.preempted)
    if evictions:
        numbers["preemptions"] = evictions
        detail = f"evicted {plural(evictions, 'time')} and waited to resume (KV-cache pressure)"
    else:
        detail = "evicted and waited to resume (KV-cache pressure)"
    value = view.value_ns
    if segment != semconv.SEGMENT_PREEMPTED and value > 0:
        largest = format_share(view.segments.get(segment, 0) / value)
        label = semconv.METRIC_LABELS.get(view.metric, view.metric)
        detail = (
            f"{detail}; the largest segment, {segment_label(segment)}, was {largest} of {label}"
        )
    return RequestFinding(CAUSE_KV_CACHE_PRESSURE, semconv.SEGMENT_PREEMPTED, detail, numbers)


def _itl_spikes(gaps: Sequence[int], config: DiagnosisConfig) -> tuple[int, int] | None:
    """(median gap, p99 gap) when the ITL tail is spiky, else None."""
    if len(gaps) < max(config.min_itl_gaps, 2):
        return None
    ordered = sorted(gaps)
    median_ns = nearest_rank(ordered, 50)
    p99_ns = nearest_rank(ordered, 99)
    if p99_ns <= 0 or p99_ns < config.itl_tail_spike_ratio * median_ns:
        return None
    return median_ns, p99_ns
