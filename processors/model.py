"""The data the processors exchange: received spans in, one record per request out.

Spans stay OTLP protobuf messages end to end (parsed once by a receiver, re-serialised once by
an exporter): building Python objects per span is the collector's dominant cost, so processors
read only the attributes they need, straight from the protobuf.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tokentrace.agent import semconv
from tokentrace.agent.finished_request import DEFAULT_ITL_OUTLIER_RATIO


@dataclass(slots=True)
class SpanRef:
    """One received span with the resource and scope it arrived under (shared references)."""

    span: Span
    resource: Resource
    scope: InstrumentationScope
    service: str
    """``service.name`` of the resource, read once per resource by the receiver."""
    wire: bytes | None = None
    """The span's ``ScopeSpans.spans`` entry as received (tag and length included), when the
    receiver kept it: exporters send it as it came instead of re-serialising ``span``, so
    whoever changes ``span`` must drop it (the enrichment does where it removes an earlier
    enrichment: those spans are re-serialised)."""
    resource_wire: bytes | None = None
    """``resource`` serialised, once per received ``ResourceSpans`` and shared by its spans (the
    encoder's, instead of once per trace); None: the encoder serialises it."""
    scope_wire: bytes | None = None
    """The same for ``scope``, once per received ``ScopeSpans``."""


@dataclass(slots=True)
class AssembledTrace:
    """All spans of one trace that arrived before assembly finished it."""

    trace_id: bytes
    spans: list[SpanRef]
    late: bool = False
    """A fragment of a trace that was already finished (its spans came after assembly's wait)."""


@dataclass(slots=True)
class RequestTimeline:
    """One request on one time axis, whatever dialect its spans came in.

    All times are absolute Unix nanoseconds. ``None`` means the dialect did not say. Server-side
    times (``server_*`` through ``end``) share one clock domain (one host); client times may come
    from another host's clock and are only compared with each other.
    """

    trace_id: bytes
    span_id: bytes
    """The span that represents the request (``llm.request``, vLLM's ``llm_request``, or a
    GenAI client span for a client-only trace); enrichment attributes go on it."""
    dialect: str
    """``tokentrace`` | ``vllm`` | ``genai_client``."""
    service: str
    model: str
    operation: str

    # Client view (optional): the client span around the request.
    client_start: int | None = None
    client_end: int | None = None
    client_first_token: int | None = None
    client_first_byte: int | None = None
    client_stream: bool | None = None
    client_connection_reused: bool | None = None
    client_connect_ns: int | None = None
    """Setup of the new connection the request opened (TCP, TLS), as the client measured it."""
    client_send_wait_ns: int | None = None
    client_first_token_read_wait_ns: int | None = None
    client_read_wait_ns: int | None = None
    client_rtt_ns: int | None = None
    """The first hop's kernel round-trip time (not a proxy or load balancer behind it)."""

    # Server view. server_start/server_end come from the incoming HTTP server span when there is
    # one, else from the request span (llm.request / llm_request) itself.
    server_start: int | None = None
    server_end: int | None = None
    http_receive_wait_ns: int | None = None
    """How long the request's bytes waited in the server's kernel before the app started (the
    accept queue, a busy event loop): time before ``server_start`` that only the server knows."""
    server_first_body: int | None = None
    """When the server handed the response's first body bytes over (a stream's first token)."""
    not_reported: tuple[str, ...] = ()
    """What the request's source cannot tell (a dialect's own spans, an engine's timing report
    read by ``tokentrace proxy``), so its budgets lack it; ``not_reported_by`` names the source."""
    not_reported_by: str | None = None
    engine_arrival: int | None = None
    """Engine arrival: when the engine queued the request - the start of ``llm.queue`` (else of
    ``llm.request``); for vLLM's span, first scheduled minus its queue time. Not the agent's
    ``arrival_ns`` (the start of ``llm.request``). A document's ``boundaries_ms`` calls it
    ``arrival`` (``collector/store/row.py``)."""
    ready: int | None = None
    """When the server became ready, for requests that arrived during its cold start."""
    first_scheduled: int | None = None
    first_token: int | None = None
    last_token: int | None = None
    end: int | None = None
    """Response complete: end of ``llm.request``."""

    preempted: list[tuple[int, int]] = field(default_factory=list)
    prefill_chunks: list[tuple[int, int, int]] = field(default_factory=list)
    """(start, end, tokens) per prefill chunk; one entry for an unchunked prefill."""
    token_offsets_us: Sequence[int] = field(default_factory=list)
    """Each output token's time in µs after the first output token (first entry 0); as read
    from spans an ``array('q')`` (``native``)."""
    token_offsets_dropped: int = 0

    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    request_id: str | None = None
    status_error: str | None = None
    """Error description when the request span ended with an error status."""

    # Context for the diagnosis, when the agent recorded it.
    requests_ahead: int | None = None
    running_at_arrival: int | None = None
    max_running: int | None = None
    prefix_hash: str | None = None
    outlier_steps_with_prefill: int | None = None
    engine_steps: list[tuple[int, int, int]] = field(default_factory=list)
    """(start, end, prefill tokens) of the engine steps exported under the request (those
    inside its outlier inter-token gaps), in start order."""
    decode_bandwidth_peak_ratio: float | None = None
    """Mean GPU memory bandwidth during decode as a fraction of peak (node agent)."""
    decode_roofline_ratio: float | None = None
    """Weight bytes / peak bandwidth over the measured time per token (node agent): 1 is the
    memory-bandwidth limit of decode."""


@dataclass(slots=True)
class GapParts:
    """One inter-token gap of a request (ns) and its parts; the parts sum to ``gap_ns``.

    Not frozen, like ``DecodeFacts`` and ``budget.MetricBudget``: made for every request, and a
    frozen dataclass's ``__init__`` (``object.__setattr__`` per field) takes about four times
    as long. Nothing changes them once made."""

    gap_ns: int
    decode_ns: int
    interference_ns: int
    stall_ns: int
    preempted_ns: int
    outlier: bool

    def segments(self) -> dict[str, int]:
        return {
            semconv.SEGMENT_DECODE: self.decode_ns,
            semconv.SEGMENT_INTERFERENCE: self.interference_ns,
            semconv.SEGMENT_STALL: self.stall_ns,
            semconv.SEGMENT_PREEMPTED: self.preempted_ns,
        }


@dataclass(slots=True)
class Budget:
    """Segments that partition a request's E2E exactly (integer ns, in time order)."""

    e2e_ns: int
    segments: dict[str, int]
    """segment name (``semconv.SEGMENTS``) -> ns; values are >= 0 and sum to ``e2e_ns``."""
    ttft_ns: int | None
    """Server-side TTFT, None when the request produced no token."""
    ttft_segments: dict[str, int]
    """The same partition over the time before the first token; sums to ``ttft_ns`` (or is
    empty when ``ttft_ns`` is None)."""
    skew_clamped: bool = False
    """True when out-of-order timestamps (clock skew between processes or hosts) were clamped."""
    server_e2e_ns: int | None = None
    """E2E as the server saw it (its HTTP span, else its request span); None for a client-only
    budget. ``e2e_ns`` minus this is the time outside the server (client-side segments and the
    kernel wait before the app, in ``http``)."""
    client_ttft_ns: int | None = None
    """TTFT as the client saw it (client first token - client start); None without a client
    span that marks its first token."""
    client_ttft_segments: dict[str, int] = field(default_factory=dict)
    """The client-seen TTFT's partition: the server-seen TTFT's segments plus the client-side
    ones (``semconv.CLIENT_SIDE_SEGMENTS``); ``http`` also holds the kernel wait before the app
    and the first token's delivery by the server. Sums to ``client_ttft_ns``."""


@dataclass(slots=True)
class DecodeFacts:
    """What the engine steps say about a request's decode (``decode_split.decode_facts_of``)."""

    outlier_gaps: list[GapParts]
    """The request's outlier inter-token gaps, each split by cause."""
    split: dict[str, int]
    """The budget's ``decode`` split into ``semconv.DECODE_SEGMENTS`` (sums to it)."""
    engine_steps: int
    """Engine steps exported for the request (those inside its outlier gaps)."""
    max_step_prefill_tokens: int
    """The most prompt tokens one of those steps prefilled (other requests')."""


@dataclass(slots=True)
class RequestMetrics:
    """The latency values of one request, in ns, as the sketches and SLOs see them."""

    ttft: int | None
    tpot: int | None
    e2e: int
    queue: int | None
    prefill: int | None
    decode: int | None
    network: int | None
    itl: Sequence[int]
    """Every gap between consecutive output tokens, in ns (``budget.inter_token_gaps_ns``: an
    ``array('q')``)."""

    def value(self, metric: str) -> int | None:
        """The single value of ``metric`` (ITL: the largest gap) or None when undefined."""
        if metric == semconv.METRIC_ITL:
            return max(self.itl) if self.itl else None
        value: int | None = getattr(self, metric)
        return value


@dataclass(slots=True)
class Verdict:
    """The dominant cost of a request or a window, with a cause and advice."""

    segment: str
    """The dominant budget segment."""
    cause: str
    """A stable identifier, e.g. ``queueing`` (see ``causes.CAUSES``)."""
    sentence: str
    """One line for people, citing the numbers, e.g.
    ``82% of TTFT was queue wait (410 ms): 37 requests ahead, batch full (256/256)``."""
    advice: str
    numbers: dict[str, float | int | str]
    """The values the verdict used, for scripts and the UI."""
    metric: str = semconv.METRIC_E2E
    """The latency metric the verdict answers (one of ``semconv.VERDICT_METRICS``)."""
    clock: str = semconv.CLOCK_SERVER
    """Whose clock measured the metric: ``semconv.CLOCK_CLIENT`` (what the user saw, network
    included) or ``semconv.CLOCK_SERVER``."""
    why: str = ""
    """Why this metric (for a request's default verdict: the SLO target it breached)."""


@dataclass(slots=True)
class RequestRecord:
    """Everything the collector derived for one request."""

    timeline: RequestTimeline
    budget: Budget
    metrics: RequestMetrics
    prompt_bucket: str
    verdict: Verdict | None = None
    """The verdict about the metric of the first SLO target the request breached, else E2E
    (the others are derived when asked for: ``verdict.diagnose_request``)."""
    prefix_seen: bool = False
    """The diagnosis found the request's prompt prefix computed earlier in its window: a
    recomputed shared prefix, for the verdicts derived later about other metrics."""
    itl_outlier_ratio: float = DEFAULT_ITL_OUTLIER_RATIO
    """An inter-token gap above this many median gaps is an outlier (``decode_split``)."""
    decode_facts: DecodeFacts | None = None
    """Derived on first use (``decode_split.decode_facts_of``): most requests' verdicts never
    need it, and the pipeline must not pay for it per request."""
    slo: dict[str, bool] = field(default_factory=dict)
    """target name -> met."""
