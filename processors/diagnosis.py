"""Name the single dominant cost of a request or a window, with a cause, advice and numbers.

Per request: the dominant segment is the largest segment of the E2E budget (ties go to the
segment earlier in time order); a small rule table turns it into a cause, using the request's
context (prompt length, queue depth, prefix hash, ITL shape, memory bandwidth). Rules, in the
order they are checked:

1. ``error``: the request ended with an error status (the dominant segment is still cited).
2. ``unattributed``: the dominant time is unattributed: only client spans arrived, or the server
   span carries no phase timings (e.g. a vLLM ``llm_request`` span without its TTFT).
3. ``kv_cache_pressure``: preemption dominates, or is at least ``preemption_share`` of E2E.
4. By dominant segment: queue -> ``queueing``; cold_start -> ``cold_start``; prefill ->
   ``prefix_cache_miss`` (a shared prefix recomputed with a reported 0 cached tokens: the more
   specific fix wins over prompt length), else ``long_prompt``, else ``prefill``; decode ->
   ``bandwidth_bound_decode``, else ``batching_interference`` (spiky ITL tail and prefills in
   the outlier steps, or unknown), else ``long_decode``; network / http / postprocess -> the
   cause of that name.

Segments before the first token are phrased against TTFT when the TTFT budget is known
("82% of TTFT was queue wait"), the rest against E2E. Everything here tolerates ``None``
context: a missing number is left out of the sentence, never guessed.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from tokentrace.agent import semconv
from tokentrace.processors.budget import has_server_view
from tokentrace.processors.model import RequestRecord, Verdict
from tokentrace.processors.stats import nearest_rank
from tokentrace.processors.timeline import DIALECT_VLLM

# --- causes -------------------------------------------------------------------------------------
CAUSE_QUEUEING: Final = "queueing"
CAUSE_COLD_START: Final = "cold_start"
CAUSE_LONG_PROMPT: Final = "long_prompt"
CAUSE_PREFIX_CACHE_MISS: Final = "prefix_cache_miss"
CAUSE_PREFILL: Final = "prefill"
CAUSE_BANDWIDTH_BOUND_DECODE: Final = "bandwidth_bound_decode"
CAUSE_BATCHING_INTERFERENCE: Final = "batching_interference"
CAUSE_LONG_DECODE: Final = "long_decode"
CAUSE_KV_CACHE_PRESSURE: Final = "kv_cache_pressure"
CAUSE_NETWORK: Final = "network"
CAUSE_HTTP: Final = "http"
CAUSE_POSTPROCESS: Final = "postprocess"
CAUSE_UNATTRIBUTED: Final = "unattributed"
CAUSE_ERROR: Final = "error"
CAUSES: Final = (
    CAUSE_QUEUEING,
    CAUSE_COLD_START,
    CAUSE_LONG_PROMPT,
    CAUSE_PREFIX_CACHE_MISS,
    CAUSE_PREFILL,
    CAUSE_BANDWIDTH_BOUND_DECODE,
    CAUSE_BATCHING_INTERFERENCE,
    CAUSE_LONG_DECODE,
    CAUSE_KV_CACHE_PRESSURE,
    CAUSE_NETWORK,
    CAUSE_HTTP,
    CAUSE_POSTPROCESS,
    CAUSE_UNATTRIBUTED,
    CAUSE_ERROR,
)
"""Every cause a verdict can name (``Verdict.cause``), stable identifiers."""

ADVICE: Final[Mapping[str, str]] = {
    CAUSE_QUEUEING: (
        "Add replicas, or raise the batch limit (vLLM max_num_seqs) if GPU memory allows; "
        "add admission control so queues stay short under bursts."
    ),
    CAUSE_COLD_START: (
        "Keep a warm replica (minimum replicas above zero), pre-load or locally cache the "
        "weights, and scale up earlier, before demand arrives."
    ),
    CAUSE_LONG_PROMPT: (
        "Enable chunked prefill so long prompts do not block others, trim prompts (history, "
        "retrieved context), and enable prefix caching for their shared parts."
    ),
    CAUSE_PREFIX_CACHE_MISS: (
        "Enable prefix caching (vLLM --enable-prefix-caching) and route requests with the same "
        "prefix to the same replica (prefix-aware routing)."
    ),
    CAUSE_PREFILL: (
        "Prefill is compute-bound or contended: enable chunked prefill, limit the tokens "
        "prefilled per step (max_num_batched_tokens), or use faster compute."
    ),
    CAUSE_BANDWIDTH_BOUND_DECODE: (
        "Decode is memory-bandwidth-bound: quantise the weights or the KV cache, run larger "
        "batches to amortise weight reads, or use hardware with faster memory."
    ),
    CAUSE_BATCHING_INTERFERENCE: (
        "Prefills stall decode steps: use smaller prefill chunks (max_num_batched_tokens), "
        "disaggregate prefill and decode, or schedule streaming requests with priority."
    ),
    CAUSE_LONG_DECODE: (
        "Many output tokens: cap max_tokens or ask for shorter answers, use speculative "
        "decoding, or faster per-token hardware."
    ),
    CAUSE_KV_CACHE_PRESSURE: (
        "Running requests are evicted for lack of KV-cache memory: raise "
        "gpu_memory_utilization, lower max_num_seqs, or shorten max_model_len."
    ),
    CAUSE_NETWORK: (
        "Place clients closer to the servers, reuse connections (keep-alive, HTTP/2), and send "
        "smaller payloads."
    ),
    CAUSE_HTTP: (
        "Reuse connections, keep tokenisation and chat templating on a fast path (fast "
        "tokenizer, cached templates), and send smaller payloads. When the server's frontend "
        "is CPU-bound (many concurrent streams), add API server processes (vLLM "
        "--api-server-count) or cores."
    ),
    CAUSE_POSTPROCESS: (
        "Stream the response, detokenise incrementally, and keep response assembly and "
        "serialisation light. When the server's frontend is CPU-bound (many concurrent "
        "streams), add API server processes (vLLM --api-server-count) or cores."
    ),
    CAUSE_UNATTRIBUTED: (
        "Instrument the inference server (tokentrace run -- CMD, or vLLM "
        "--otlp-traces-endpoint) and propagate W3C traceparent from the client so server spans "
        "join the trace."
    ),
    CAUSE_ERROR: (
        "Look up the error on the request span and in the server logs; a failed request's "
        "latency says little about normal serving."
    ),
}
"""cause -> one line of advice."""

_SERVER_WITHOUT_PHASES_ADVICE: Final = (
    "The server span arrived without phase timings: run the server under tokentrace "
    "(tokentrace run -- CMD) for queue, prefill and decode spans, or use a vLLM version whose "
    f"{semconv.VLLM_SPAN_REQUEST} span records {semconv.VLLM_LATENCY_TTFT} and the phase latencies."
)
"""Advice for unattributed time on a server span (not the client-only case ``ADVICE`` covers)."""

_DEFAULT_LONG_PROMPT_TOKENS: Final = 1024
_DEFAULT_BANDWIDTH_BOUND_RATIO: Final = 0.8
_DEFAULT_ITL_SPIKE_RATIO: Final = 3.0
_DEFAULT_MIN_ITL_GAPS: Final = 8
_DEFAULT_PREEMPTION_SHARE: Final = 0.2
_DEFAULT_P50_BAND: Final = (40.0, 60.0)
_DEFAULT_TAIL_PERCENTILE: Final = 95.0

_MAX_ERROR_CHARS: Final = 160
"""Error descriptions are cut to this length so that the verdict stays one line."""
_PREFIX_HASH_CHARS: Final = 12
"""Characters of a prefix hash quoted in a sentence (the full hash is in the numbers)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DiagnosisConfig:
    long_prompt_tokens: int = _DEFAULT_LONG_PROMPT_TOKENS
    """Prompts at least this long make a prefill-dominated request a long-prompt case."""
    bandwidth_bound_ratio: float = _DEFAULT_BANDWIDTH_BOUND_RATIO
    """Decode is bandwidth-bound when measured memory bandwidth is at least this share of peak."""
    itl_spike_ratio: float = _DEFAULT_ITL_SPIKE_RATIO
    """An ITL tail counts as spiky when p99 gap / median gap reaches this."""
    min_itl_gaps: int = _DEFAULT_MIN_ITL_GAPS
    """Fewer inter-token gaps than this say nothing about the ITL tail (never spiky)."""
    preemption_share: float = _DEFAULT_PREEMPTION_SHARE
    """Preemption this large a share of E2E is KV-cache pressure even when not dominant."""
    p50_band: tuple[float, float] = _DEFAULT_P50_BAND
    """E2E percentiles around the median whose requests make up the window's typical request."""
    tail_percentile: float = _DEFAULT_TAIL_PERCENTILE
    """Requests at or above this E2E percentile make up the window's tail."""

    def __post_init__(self) -> None:
        low, high = self.p50_band
        if not 0 < low <= high <= 100:
            raise ValueError(f"p50_band: expected 0 < low <= high <= 100, got {self.p50_band!r}")
        if not 0 < self.tail_percentile <= 100:
            raise ValueError(f"tail_percentile: expected (0, 100], got {self.tail_percentile!r}")
        if self.preemption_share <= 0 or self.itl_spike_ratio <= 0:
            raise ValueError("preemption_share and itl_spike_ratio must be positive")


_DEFAULT_CONFIG: Final = DiagnosisConfig()


@dataclass(slots=True)
class WindowDiagnosis:
    requests: int
    p50: Verdict | None
    """What dominates a typical request (the budget at the median E2E)."""
    tail: Verdict | None
    """What dominates the slowest requests (at or above p95 E2E)."""


# --- wording ------------------------------------------------------------------------------------
_SEGMENT_ORDER: Final = {segment: index for index, segment in enumerate(semconv.SEGMENTS)}
_PRE_FIRST_TOKEN_SEGMENTS: Final = frozenset(
    {
        semconv.SEGMENT_NETWORK,
        semconv.SEGMENT_HTTP,
        semconv.SEGMENT_COLD_START,
        semconv.SEGMENT_QUEUE,
        semconv.SEGMENT_PREFILL,
    }
)
_SEGMENT_LABELS: Final[Mapping[str, str]] = {
    semconv.SEGMENT_NETWORK: "network",
    semconv.SEGMENT_HTTP: "HTTP handling",
    semconv.SEGMENT_COLD_START: "cold start",
    semconv.SEGMENT_QUEUE: "queue wait",
    semconv.SEGMENT_PREFILL: "prefill",
    semconv.SEGMENT_PREEMPTED: "preemption",
    semconv.SEGMENT_DECODE: "decode",
    semconv.SEGMENT_POSTPROCESS: "post-processing",
    semconv.SEGMENT_UNATTRIBUTED: "unattributed",
}
_CAUSE_LABELS: Final[Mapping[str, str]] = {
    CAUSE_QUEUEING: "queueing",
    CAUSE_COLD_START: "cold start",
    CAUSE_LONG_PROMPT: "long prompt",
    CAUSE_PREFIX_CACHE_MISS: "prefix-cache miss",
    CAUSE_PREFILL: "prefill",
    CAUSE_BANDWIDTH_BOUND_DECODE: "bandwidth-bound decode",
    CAUSE_BATCHING_INTERFERENCE: "batching interference",
    CAUSE_LONG_DECODE: "long decode",
    CAUSE_KV_CACHE_PRESSURE: "KV-cache pressure",
    CAUSE_NETWORK: "network",
    CAUSE_HTTP: "HTTP handling",
    CAUSE_POSTPROCESS: "post-processing",
    CAUSE_UNATTRIBUTED: "unattributed (server spans or their phase timings missing)",
    CAUSE_ERROR: "errors",
}


def format_duration(ns: int | float | None) -> str:
    """``410 ms``, ``41.2 ms``, ``0.412 ms``, ``1.23 s``: three significant digits."""
    if ns is None or not math.isfinite(ns):
        return "unknown"
    ms = ns / 1e6
    if abs(ms) >= 1000:
        return f"{_three_digits(ms / 1000)} s"
    return f"{_three_digits(ms)} ms"


def _three_digits(value: float) -> str:
    magnitude = abs(value)
    if magnitude >= 100 or magnitude == 0:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def _format_share(share: float) -> str:
    percent = share * 100
    if 0 < percent < 1:
        return "<1%"
    if 99 < percent < 100:
        return ">99%"
    return f"{percent:.0f}%"


def _plural(count: int, noun: str) -> str:
    return f"{count:,} {noun}" if count == 1 else f"{count:,} {noun}s"


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _ms(ns: int | float) -> float:
    return round(ns / 1e6, 3)


def _one_line(text: str, limit: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _dominant_segment(values: Mapping[str, float]) -> str:
    """The largest segment, ties to the earlier one in time order; unattributed when all are 0."""
    best_segment = semconv.SEGMENT_UNATTRIBUTED
    best_value = 0.0
    for segment in semconv.SEGMENTS:
        value = values.get(segment, 0)
        if value > best_value:
            best_segment, best_value = segment, value
    # Segments outside the contract (a newer budget) rank after the known ones.
    for segment, value in values.items():
        if segment not in _SEGMENT_ORDER and value > best_value:
            best_segment, best_value = segment, value
    return best_segment


# --- per request --------------------------------------------------------------------------------
@dataclass(slots=True)
class _Finding:
    cause: str
    cited_segment: str
    """The segment the sentence leads with (the dominant one, or preemption for rule 3)."""
    detail: str
    numbers: dict[str, float | int | str]
    advice: str | None = None
    """Overrides ``ADVICE[cause]`` when the usual advice does not fit this request."""


def diagnose_request(
    record: RequestRecord,
    config: DiagnosisConfig = _DEFAULT_CONFIG,
    *,
    seen_prefixes: Container[str] | None = None,
) -> Verdict:
    """The dominant segment of ``record``'s budget, its cause, advice and the numbers used.

    ``seen_prefixes``: prompt prefix hashes that earlier requests of the same window computed;
    a prefill-dominated request whose prefix is among them and that read no cached tokens
    recomputed a shared prefix (``prefix_cache_miss``).
    """
    budget = record.budget
    timeline = record.timeline
    segment = _dominant_segment(budget.segments)
    segment_ns = budget.segments.get(segment, 0)
    finding = _find_cause(record, segment, segment_ns, config, seen_prefixes)

    cited_ns = budget.segments.get(finding.cited_segment, 0)
    basis, basis_part_ns, basis_total_ns = _basis(record, finding.cited_segment, cited_ns)
    share = basis_part_ns / basis_total_ns if basis_total_ns > 0 else 0.0
    label = _SEGMENT_LABELS.get(finding.cited_segment, finding.cited_segment)
    sentence = f"{_format_share(share)} of {basis} was {label} ({format_duration(basis_part_ns)})"
    if finding.detail:
        sentence = f"{sentence}: {finding.detail}"

    numbers: dict[str, float | int | str] = {
        "e2e_ms": _ms(budget.e2e_ns),
        f"{finding.cited_segment}_ms": _ms(basis_part_ns),
        "share": round(share, 4),
        "share_of": basis,
    }
    if budget.ttft_ns is not None:
        numbers["ttft_ms"] = _ms(budget.ttft_ns)
    if segment != finding.cited_segment:
        numbers["dominant_segment"] = segment
        numbers[f"{segment}_ms"] = _ms(segment_ns)
    numbers.update(finding.numbers)
    cause = finding.cause
    advice = finding.advice or ADVICE[cause]

    if timeline.status_error is not None:
        error = _one_line(timeline.status_error, _MAX_ERROR_CHARS) or "error status"
        sentence = f"Request failed ({error}) after {format_duration(budget.e2e_ns)}; {sentence}"
        numbers["error"] = error
        numbers["underlying_cause"] = cause
        cause = CAUSE_ERROR
        advice = ADVICE[CAUSE_ERROR]
    return Verdict(segment=segment, cause=cause, sentence=sentence, advice=advice, numbers=numbers)


def _basis(record: RequestRecord, segment: str, segment_ns: int) -> tuple[str, int, int]:
    """(``TTFT`` | ``E2E``, the segment's ns within it, its total ns)."""
    budget = record.budget
    ttft_ns = budget.ttft_ns
    if segment in _PRE_FIRST_TOKEN_SEGMENTS and ttft_ns is not None and ttft_ns > 0:
        in_ttft = budget.ttft_segments.get(segment, 0)
        if in_ttft > 0:
            return "TTFT", in_ttft, ttft_ns
    return "E2E", segment_ns, budget.e2e_ns


def _find_cause(
    record: RequestRecord,
    segment: str,
    segment_ns: int,
    config: DiagnosisConfig,
    seen_prefixes: Container[str] | None,
) -> _Finding:
    budget = record.budget
    if segment == semconv.SEGMENT_UNATTRIBUTED:
        return _unattributed(record, segment_ns)

    preempted_ns = budget.segments.get(semconv.SEGMENT_PREEMPTED, 0)
    preempted_share = preempted_ns / budget.e2e_ns if budget.e2e_ns > 0 else 0.0
    if segment == semconv.SEGMENT_PREEMPTED or (
        preempted_ns > 0 and preempted_share >= config.preemption_share
    ):
        return _kv_cache_pressure(record, segment, segment_ns)
    if segment == semconv.SEGMENT_QUEUE:
        return _queueing(record)
    if segment == semconv.SEGMENT_COLD_START:
        return _Finding(
            CAUSE_COLD_START, segment, "the request arrived before the server was ready", {}
        )
    if segment == semconv.SEGMENT_PREFILL:
        return _prefill(record, config, seen_prefixes)
    if segment == semconv.SEGMENT_DECODE:
        return _decode(record, config)
    if segment == semconv.SEGMENT_NETWORK:
        return _Finding(
            CAUSE_NETWORK,
            segment,
            "time the client saw and the server did not (transfer, connection setup)",
            {},
        )
    if segment == semconv.SEGMENT_HTTP:
        return _Finding(
            CAUSE_HTTP,
            segment,
            "server time before the engine (parsing, chat templating, tokenisation)",
            {},
        )
    if segment == semconv.SEGMENT_POSTPROCESS:
        return _Finding(
            CAUSE_POSTPROCESS,
            segment,
            "after the last token (detokenisation, response assembly)",
            {},
        )
    # A segment this version does not know: name it without a specific cause.
    return _Finding(CAUSE_UNATTRIBUTED, segment, f"segment {segment!r} has no diagnosis rule", {})


def _unattributed(record: RequestRecord, segment_ns: int) -> _Finding:
    """Unattributed time, worded by what arrived: client spans only, or a server span whose
    phases cannot be placed."""
    segment = semconv.SEGMENT_UNATTRIBUTED
    if segment_ns <= 0:
        return _Finding(CAUSE_UNATTRIBUTED, segment, "no time was attributed to any segment", {})
    timeline = record.timeline
    if not has_server_view(timeline):
        detail = "only client-side spans arrived; server-side spans are missing"
        return _Finding(CAUSE_UNATTRIBUTED, segment, detail, {"server_span": 0})
    if timeline.dialect == DIALECT_VLLM:
        detail = (
            f"the server's {semconv.VLLM_SPAN_REQUEST} span has no "
            f"{semconv.VLLM_LATENCY_TTFT}, so its time cannot be split into phases"
        )
    else:
        detail = "the server span has no phase timings, so its time cannot be split into phases"
    return _Finding(
        CAUSE_UNATTRIBUTED,
        segment,
        detail,
        {"server_span": 1, "dialect": timeline.dialect},
        advice=_SERVER_WITHOUT_PHASES_ADVICE,
    )


def _queueing(record: RequestRecord) -> _Finding:
    timeline = record.timeline
    parts: list[str] = []
    numbers: dict[str, float | int | str] = {}
    ahead = timeline.requests_ahead
    running = timeline.running_at_arrival
    max_running = timeline.max_running
    if ahead is not None:
        parts.append(f"{_plural(ahead, 'request')} ahead")
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
    return _Finding(CAUSE_QUEUEING, semconv.SEGMENT_QUEUE, ", ".join(parts), numbers)


def _prefill(
    record: RequestRecord, config: DiagnosisConfig, seen_prefixes: Container[str] | None
) -> _Finding:
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
        return _Finding(CAUSE_PREFIX_CACHE_MISS, semconv.SEGMENT_PREFILL, detail, numbers)
    cached_note = f", {cached:,} from the prefix cache" if cached else ""
    if input_tokens is not None and input_tokens >= config.long_prompt_tokens:
        detail = (
            f"long prompt, {input_tokens:,} input tokens{cached_note}{chunk_note} "
            f"(long-prompt threshold {config.long_prompt_tokens:,})"
        )
        return _Finding(CAUSE_LONG_PROMPT, semconv.SEGMENT_PREFILL, detail, numbers)
    if input_tokens is not None:
        prompt = (
            f"{input_tokens:,} input tokens{cached_note}{chunk_note}, "
            f"below the long-prompt threshold of {config.long_prompt_tokens:,}"
        )
    else:
        prompt = f"prompt length unknown{chunk_note}"
    detail = f"{prompt}; compute-bound prefill or contention with other requests"
    return _Finding(CAUSE_PREFILL, semconv.SEGMENT_PREFILL, detail, numbers)


def _decode(record: RequestRecord, config: DiagnosisConfig) -> _Finding:
    timeline = record.timeline
    metrics = record.metrics
    numbers: dict[str, float | int | str] = {}
    per_token_parts: list[str] = []
    if timeline.output_tokens is not None:
        numbers["output_tokens"] = timeline.output_tokens
        per_token_parts.append(_plural(timeline.output_tokens, "output token"))
    if metrics.tpot is not None:
        numbers["tpot_ms"] = _ms(metrics.tpot)
        per_token_parts.append(f"{format_duration(metrics.tpot)} TPOT")
    per_token = " at ".join(per_token_parts)

    ratio = _finite(timeline.decode_bandwidth_peak_ratio)
    roofline = _finite(timeline.decode_roofline_ratio)
    threshold = config.bandwidth_bound_ratio
    # Measured bandwidth decides; without it, the roofline (weights read per token) does.
    measured = ratio if ratio is not None else roofline
    if measured is not None and measured >= threshold:
        parts = []
        if ratio is not None:
            numbers["bandwidth_peak_ratio"] = round(ratio, 4)
            parts.append(f"memory bandwidth at {ratio:.0%} of peak")
        if roofline is not None:
            numbers["roofline_ratio"] = round(roofline, 4)
            parts.append(f"tokens at {roofline:.0%} of the weight-read limit")
        detail = f"{', '.join(parts)} (bandwidth-bound)"
        if per_token:
            detail = f"{detail}; {per_token}"
        return _Finding(CAUSE_BANDWIDTH_BOUND_DECODE, semconv.SEGMENT_DECODE, detail, numbers)

    spikes = _itl_spikes(metrics.itl, config)
    outliers = timeline.outlier_steps_with_prefill
    if spikes is not None and (outliers is None or outliers > 0):
        median_ns, p99_ns = spikes
        numbers["itl_median_ms"] = _ms(median_ns)
        numbers["itl_p99_ms"] = _ms(p99_ns)
        spread = (
            f"{p99_ns / median_ns:.1f}x the median {format_duration(median_ns)}"
            if median_ns > 0
            else "the median gap is 0"
        )
        detail = f"spiky inter-token gaps, p99 {format_duration(p99_ns)} is {spread}"
        if median_ns > 0:
            numbers["itl_spike_ratio"] = round(p99_ns / median_ns, 2)
        if outliers is not None:
            numbers["outlier_steps_with_prefill"] = outliers
            detail = (
                f"{detail}; {_plural(outliers, 'outlier step')} shared the batch with a prefill"
            )
        return _Finding(CAUSE_BATCHING_INTERFERENCE, semconv.SEGMENT_DECODE, detail, numbers)

    return _Finding(CAUSE_LONG_DECODE, semconv.SEGMENT_DECODE, per_token, numbers)


def _itl_spikes(gaps: Sequence[int], config: DiagnosisConfig) -> tuple[int, int] | None:
    """(median gap, p99 gap) when the ITL tail is spiky, else None."""
    if len(gaps) < max(config.min_itl_gaps, 2):
        return None
    ordered = sorted(gaps)
    median_ns = nearest_rank(ordered, 50)
    p99_ns = nearest_rank(ordered, 99)
    if p99_ns <= 0 or p99_ns < config.itl_spike_ratio * median_ns:
        return None
    return median_ns, p99_ns


def _kv_cache_pressure(record: RequestRecord, segment: str, segment_ns: int) -> _Finding:
    budget = record.budget
    numbers: dict[str, float | int | str] = {}
    evictions = len(record.timeline.preempted)
    if evictions:
        numbers["preemptions"] = evictions
        detail = f"evicted {_plural(evictions, 'time')} and waited to resume (KV-cache pressure)"
    else:
        detail = "evicted and waited to resume (KV-cache pressure)"
    if segment != semconv.SEGMENT_PREEMPTED and budget.e2e_ns > 0:
        label = _SEGMENT_LABELS.get(segment, segment)
        largest = _format_share(segment_ns / budget.e2e_ns)
        detail = f"{detail}; the largest segment, {label}, was {largest} of E2E"
    return _Finding(CAUSE_KV_CACHE_PRESSURE, semconv.SEGMENT_PREEMPTED, detail, numbers)


# --- per window ---------------------------------------------------------------------------------
def diagnose_window(
    records: Sequence[RequestRecord], config: DiagnosisConfig = _DEFAULT_CONFIG
) -> WindowDiagnosis:
    """The typical request's and the tail's dominant segment and most frequent cause.

    Typical: requests whose E2E lies between the ``p50_band`` percentiles (p40-p60); tail:
    requests at or above the ``tail_percentile`` (p95) E2E; nearest-rank percentiles, so both
    groups hold at least one request. The segment is the largest by mean share of E2E; the
    cause is the most frequent per-request cause (ties in ``CAUSES`` order). A prompt prefix
    counts as seen for every request with that prefix except the first to arrive.
    """
    count = len(records)
    if count == 0:
        return WindowDiagnosis(requests=0, p50=None, tail=None)
    order = sorted(range(count), key=lambda index: records[index].budget.e2e_ns)
    e2e_sorted = [records[index].budget.e2e_ns for index in order]
    band_low = nearest_rank(e2e_sorted, config.p50_band[0])
    band_high = nearest_rank(e2e_sorted, config.p50_band[1])
    tail_from = nearest_rank(e2e_sorted, config.tail_percentile)
    typical = [i for i in order if band_low <= records[i].budget.e2e_ns <= band_high]
    tail = [i for i in order if records[i].budget.e2e_ns >= tail_from]
    seen = _SeenPrefixes(records)

    range_text = (
        format_duration(band_low)
        if band_low == band_high
        else f"{format_duration(band_low)}-{format_duration(band_high)}"
    )
    typical_verdict = _group_verdict(
        records, typical, config, seen, f"typical requests (E2E {range_text}, around the median)"
    )
    typical_verdict.numbers["e2e_from_ms"] = _ms(band_low)
    typical_verdict.numbers["e2e_to_ms"] = _ms(band_high)
    tail_label = f"tail requests (E2E >= p{config.tail_percentile:g}, {format_duration(tail_from)})"
    tail_verdict = _group_verdict(records, tail, config, seen, tail_label)
    tail_verdict.numbers["e2e_from_ms"] = _ms(tail_from)
    return WindowDiagnosis(requests=count, p50=typical_verdict, tail=tail_verdict)


class _SeenPrefixes:
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
            key = (_arrival(record), index)
            if prefix not in first or key < first[prefix]:
                first[prefix] = key
        self._repeated = frozenset(prefix for prefix, seen in counts.items() if seen >= 2)
        self._first = {prefix: first[prefix][1] for prefix in self._repeated}

    def for_request(self, records: Sequence[RequestRecord], index: int) -> Container[str]:
        prefix = records[index].timeline.prefix_hash
        if prefix is None or self._first.get(prefix) == index:
            return frozenset()
        return self._repeated


def _arrival(record: RequestRecord) -> int:
    timeline = record.timeline
    for candidate in (timeline.arrival, timeline.server_start, timeline.client_start):
        if candidate is not None:
            return candidate
    return 0


def _group_verdict(
    records: Sequence[RequestRecord],
    indices: Sequence[int],
    config: DiagnosisConfig,
    seen: _SeenPrefixes,
    group_label: str,
) -> Verdict:
    """``N of M <group_label>: <cause>; on average X% of E2E was <segment> (<mean ms>)``."""
    causes: Counter[str] = Counter()
    share_sums: dict[str, float] = {}
    ns_sums: dict[str, int] = {}
    e2e_sum = 0
    for index in indices:
        record = records[index]
        verdict = diagnose_request(record, config, seen_prefixes=seen.for_request(records, index))
        causes[verdict.cause] += 1
        e2e_ns = record.budget.e2e_ns
        e2e_sum += e2e_ns
        for segment, ns in record.budget.segments.items():
            ns_sums[segment] = ns_sums.get(segment, 0) + ns
            if e2e_ns > 0:
                share_sums[segment] = share_sums.get(segment, 0.0) + ns / e2e_ns
    size = len(indices)
    mean_shares = {segment: total / size for segment, total in share_sums.items()}
    segment = _dominant_segment(mean_shares)
    cause_order = {cause: position for position, cause in enumerate(CAUSES)}
    cause, cause_count = min(
        causes.items(), key=lambda item: (-item[1], cause_order.get(item[0], len(CAUSES)))
    )
    mean_ns = ns_sums.get(segment, 0) / size
    share = mean_shares.get(segment, 0.0)
    label = _SEGMENT_LABELS.get(segment, segment)
    sentence = (
        f"{cause_count} of {size} {group_label}: "
        f"{_CAUSE_LABELS.get(cause, cause)}; on average {_format_share(share)} of E2E was "
        f"{label} ({format_duration(mean_ns)})"
    )
    numbers: dict[str, float | int | str] = {
        "requests": size,
        "cause_requests": cause_count,
        "share": round(share, 4),
        "mean_e2e_ms": _ms(e2e_sum / size),
    }
    for name in semconv.SEGMENTS:
        if ns_sums.get(name, 0) > 0:
            numbers[f"mean_{name}_ms"] = _ms(ns_sums[name] / size)
    for name, seen_count in causes.items():
        numbers[f"{name}_requests"] = seen_count
    return Verdict(
        segment=segment, cause=cause, sentence=sentence, advice=ADVICE[cause], numbers=numbers
    )
