"""Realistic LLM-serving request traces from a simulated continuous-batching engine.

Until the real framework instrumentation runs in front of it, the demo, the integration tests
and the collector benchmark drive the collector with these traces. The simulation is a
discrete-event model of a vLLM-like engine: requests arrive (open-loop Poisson, optionally with
bursts, or closed-loop clients), wait in a FIFO queue while the batch is full, are prefilled in
chunks under a per-step token budget, decode one token per engine step, and are preempted
(newest first, recomputed later) when the KV cache runs out. Every timestamp a real agent would
record falls out of the engine steps, so each scenario's slow requests are slow for the reason
the scenario is named after.

Each simulated request yields the ``RequestRecording`` the real agent would record for it
(``SimulatedRequest.recording``), and its server-side spans are the agent's own: the layout and
the encoder of ``tokentrace.agent.spans``. Replay adds what surrounds the request in a
deployment: the HTTP server span (the recording's parent) and the load generator's client span.
Emission, one span layout (the tokentrace dialect: the span contract of docs/architecture.md) three ways:

- ``emit_sdk``: through the OpenTelemetry SDK (the caller configures the exporter), so the
  collector sees a real OTLP client;
- ``to_otlp_requests``: ``ExportTraceServiceRequest`` messages from the agent's wire encoder
  (benchmarks);
- ``tokentrace replay`` (``replay_cli.ReplayCommand``): the SDK path with an OTLP exporter.

``dialect="vllm"`` emits vLLM's built-in per-request span instead (one span, no children): an
imitation of vLLM's own tracing, so it lives here and not in the agent.

This module imports only the standard library and the agent's stdlib-only modules (contract,
recording, spans) at import time; the OpenTelemetry packages are imported by the functions that
need them.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import math
import os
import random
import socket
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Literal, TypeAlias

from tokentrace.agent import semconv, spans
from tokentrace.agent.recording import PrefillChunk, RequestRecording
from tokentrace.agent.spans import AttrValue, PlannedSpan, ResourceScope

if TYPE_CHECKING:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )
    from opentelemetry.sdk.trace import TracerProvider

__all__ = [
    "DIALECTS",
    "DIALECT_TOKENTRACE",
    "DIALECT_VLLM",
    "SCENARIOS",
    "Dialect",
    "PrefillChunk",
    "Scenario",
    "SimulatedRequest",
    "emit_sdk",
    "simulate",
    "span_count",
    "to_otlp_requests",
]

Dialect: TypeAlias = Literal["tokentrace", "vllm"]
DIALECT_TOKENTRACE: Final = "tokentrace"
"""tokentrace's own span tree: ``llm.request`` with one child per phase."""
DIALECT_VLLM: Final = "vllm"
"""vLLM's built-in tracing: one ``llm_request`` span per request, latencies in seconds."""
DIALECTS: Final = (DIALECT_TOKENTRACE, DIALECT_VLLM)


_DEFAULT_SERVICE_NAME: Final = "vllm-demo"
_DEFAULT_CLIENT_SERVICE_NAME: Final = "tokentrace-replay-client"
_DEFAULT_BATCH_SPANS: Final = 512
_DEFAULT_MAX_TOKEN_OFFSETS: Final = spans.DEFAULT_MAX_TOKEN_OFFSETS

_NS_PER_S: Final = 1_000_000_000
_NS_PER_MS: Final = 1_000_000
_NS_PER_US: Final = 1_000

_ROUTE_CHAT: Final = "/v1/chat/completions"
_ROUTE_COMPLETIONS: Final = "/v1/completions"
_HTTP_METHOD: Final = "POST"
_HTTP_OK: Final = 200
_FINISH_STOP: Final = "stop"
_FINISH_LENGTH: Final = "length"

_IDLE_WAKEUP_NS: Final = 150 * _NS_PER_US
"""An idle engine notices a new request after about one busy-loop poll."""
_STREAM_FIRST_CHUNK_NS: Final = 250 * _NS_PER_US
"""Detokenise + write the first streamed chunk after the first token."""
_CLOSED_LOOP_STAGGER_NS: Final = 50 * _NS_PER_MS
"""Closed-loop clients start within this window instead of in lock step."""
_OUTLIER_GAP_FACTOR: Final = 3.0
"""An inter-token gap above this multiple of the request's median gap is an outlier."""
_SPAN_ID_SPACE: Final = (1 << 64) - (1 << 16)
"""Span ids are ``base + k`` with small ``k``; bases below this never wrap to the invalid 0."""


# --- scenarios --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    """The workload and the engine of one simulation. Times in the unit the name says."""

    name: str
    description: str
    # Load: open-loop Poisson at ``rate_per_s`` or ``concurrency`` closed-loop clients.
    rate_per_s: float | None = 4.0
    concurrency: int | None = None
    think_time_s: float = 0.0
    burst_period_s: float = 0.0
    """Every this many seconds the arrival rate is multiplied for ``burst_duration_s``; 0: no
    bursts."""
    burst_duration_s: float = 0.0
    burst_rate_factor: float = 1.0
    # Prompts (lognormal around the median, clipped).
    prompt_tokens_median: int = 384
    prompt_tokens_sigma: float = 0.6
    prompt_tokens_min: int = 16
    prompt_tokens_max: int = 4096
    long_prompt_fraction: float = 0.0
    long_prompt_tokens_median: int = 8000
    long_prompt_tokens_max: int = 16000
    shared_prefix_fraction: float = 0.3
    """Fraction of requests that start with one of ``shared_prefixes`` system prompts."""
    shared_prefix_tokens: int = 256
    shared_prefixes: int = 4
    # Outputs.
    output_tokens_median: int = 128
    output_tokens_sigma: float = 0.7
    output_tokens_min: int = 1
    max_tokens: int = 1024
    """The request's ``max_tokens``: longer outputs stop here with finish reason ``length``."""
    text_completion_fraction: float = 0.0
    # Engine.
    max_running: int = 64
    max_batched_tokens: int = 2048
    """Token budget of one engine step (chunked prefill splits prompts above it)."""
    kv_cache_tokens: int = 200_000
    step_base_ms: float = 6.0
    prefill_us_per_token: float = 30.0
    decode_us_per_running: float = 90.0
    step_jitter: float = 0.05
    """Relative standard deviation of step durations."""
    cold_start_s: float = 0.0
    """The server is ready this long after the simulation starts; earlier requests wait."""
    # HTTP layer.
    tokenize_base_ms: float = 1.0
    tokenize_us_per_token: float = 0.5
    postprocess_base_ms: float = 0.3
    postprocess_us_per_token: float = 1.0
    response_ms: float = 0.3
    # Client and network.
    client_spans: bool = True
    network_one_way_ms: float = 1.0
    network_jitter: float = 0.05
    # Request parameters.
    model: str = "meta-llama/Llama-3.1-8B-Instruct"
    temperature: float = 0.7
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if (self.rate_per_s is None) == (self.concurrency is None):
            raise ValueError(f"scenario {self.name!r}: set exactly one of rate_per_s, concurrency")
        if self.rate_per_s is not None and self.rate_per_s <= 0:
            raise ValueError(f"scenario {self.name!r}: rate_per_s must be > 0")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"scenario {self.name!r}: concurrency must be >= 1")
        if self.max_running < 1 or self.max_batched_tokens < 1:
            raise ValueError(f"scenario {self.name!r}: max_running and max_batched_tokens >= 1")
        if self.shared_prefix_fraction > 0 and self.shared_prefix_tokens >= self.prompt_tokens_max:
            raise ValueError(f"scenario {self.name!r}: shared prefix must be shorter than prompts")
        # A request that alone exceeds the KV cache could never finish (vLLM refuses it too).
        if self.kv_cache_tokens < self.longest_prompt_tokens + self.max_tokens:
            raise ValueError(
                f"scenario {self.name!r}: kv_cache_tokens must hold the longest prompt plus "
                f"max_tokens ({self.longest_prompt_tokens + self.max_tokens})"
            )

    @property
    def longest_prompt_tokens(self) -> int:
        """The largest prompt the scenario can draw."""
        if self.long_prompt_fraction > 0:
            return max(self.prompt_tokens_max, self.long_prompt_tokens_max)
        return self.prompt_tokens_max


SCENARIOS: Final[dict[str, Scenario]] = {
    scenario.name: scenario
    for scenario in (
        Scenario(
            name="steady",
            description="well within capacity: decode dominates E2E, prefill dominates TTFT",
            rate_per_s=4.0,
        ),
        Scenario(
            name="queue_saturation",
            description="arrivals far above capacity: TTFT is mostly queue wait",
            rate_per_s=60.0,
            max_running=16,
            shared_prefix_fraction=0.0,
        ),
        Scenario(
            name="long_prompts",
            description="prompts of ~12k tokens at a low rate: TTFT is mostly (chunked) prefill",
            rate_per_s=0.5,
            prompt_tokens_median=12_000,
            prompt_tokens_sigma=0.3,
            prompt_tokens_min=4_000,
            prompt_tokens_max=32_000,
            output_tokens_median=64,
            output_tokens_sigma=0.4,
            max_tokens=512,
            max_batched_tokens=4096,
            shared_prefix_fraction=0.0,
        ),
        Scenario(
            name="cold_start",
            description="traffic arrives while the server is still starting: waits on cold start",
            rate_per_s=8.0,
            cold_start_s=30.0,
        ),
        Scenario(
            name="kv_pressure",
            description="a tiny KV cache under steady load: requests are preempted and recomputed",
            rate_per_s=1.5,
            prompt_tokens_median=256,
            prompt_tokens_sigma=0.3,
            prompt_tokens_max=1024,
            output_tokens_median=768,
            output_tokens_sigma=0.3,
            max_tokens=2048,
            kv_cache_tokens=8_000,
            shared_prefix_fraction=0.0,
        ),
        Scenario(
            name="interference",
            description="long prompts mixed into a decode-heavy load: spiky inter-token latency",
            rate_per_s=3.0,
            prompt_tokens_median=128,
            prompt_tokens_sigma=0.4,
            prompt_tokens_max=512,
            long_prompt_fraction=0.2,
            long_prompt_tokens_median=12_000,
            long_prompt_tokens_max=24_000,
            output_tokens_median=512,
            output_tokens_sigma=0.3,
            max_tokens=2048,
            shared_prefix_fraction=0.0,
        ),
        Scenario(
            name="network",
            description="short requests from a distant client: the network dominates",
            rate_per_s=4.0,
            prompt_tokens_median=128,
            prompt_tokens_sigma=0.4,
            prompt_tokens_max=1024,
            output_tokens_median=24,
            output_tokens_sigma=0.4,
            max_tokens=256,
            shared_prefix_fraction=0.0,
            network_one_way_ms=120.0,
        ),
        Scenario(
            name="mixed",
            description="steady traffic with periodic bursts and a few long prompts: the median "
            "request is decode-bound while the slow tail waited in the queue",
            rate_per_s=3.0,
            burst_period_s=30.0,
            burst_duration_s=2.0,
            burst_rate_factor=8.0,
            max_running=16,
            long_prompt_fraction=0.03,
            long_prompt_tokens_median=6000,
            long_prompt_tokens_max=12000,
            shared_prefix_fraction=0.4,
            text_completion_fraction=0.2,
            network_one_way_ms=2.0,
        ),
    )
}
"""Named presets; ``mixed`` is the demo default."""


# --- simulated requests -----------------------------------------------------------------------


@dataclass(slots=True)
class SimulatedRequest:
    """One request's recorded life, every timestamp in absolute Unix nanoseconds.

    Server-side order: ``server_start_ns <= arrival_ns <= first_scheduled_ns <= first_token_ns
    <= last_token_ns <= end_ns <= server_end_ns``; preempted intervals lie inside
    ``[first_scheduled_ns, last_token_ns]``. Client times are ``None`` without a client span.
    """

    index: int
    request_id: str
    trace_id: bytes
    span_id_base: int
    """Span ids of this request are ``span_id_base + k`` (unique within the trace)."""
    model: str
    operation: str
    url_path: str
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    max_tokens: int
    temperature: float
    top_p: float
    finish_reason: str
    prefix_hash: str | None
    server_start_ns: int
    arrival_ns: int
    first_scheduled_ns: int
    first_token_ns: int
    last_token_ns: int
    end_ns: int
    server_end_ns: int
    token_offsets_us: list[int]
    """Every output token's emission time in µs after the first (first entry 0; not capped)."""
    prefill_chunks: list[PrefillChunk]
    preempted: list[tuple[int, int]]
    requests_ahead: int
    running_at_arrival: int
    max_running: int
    outlier_steps_with_prefill: int
    ready_ns: int | None = None
    """When the server became ready, for requests that arrived during its cold start."""
    client_start_ns: int | None = None
    client_first_token_ns: int | None = None
    client_end_ns: int | None = None

    @property
    def ttft_ns(self) -> int:
        """Server-side time to first token: first token - engine arrival."""
        return self.first_token_ns - self.arrival_ns

    @property
    def queue_ns(self) -> int:
        """Engine arrival to first scheduled (includes any cold-start wait)."""
        return self.first_scheduled_ns - self.arrival_ns

    @property
    def e2e_ns(self) -> int:
        """Engine arrival to response complete."""
        return self.end_ns - self.arrival_ns

    @property
    def preempted_ns(self) -> int:
        """Total time spent evicted."""
        return sum(end - start for start, end in self.preempted)

    def recording(self) -> RequestRecording:
        """What the agent records for this request; its parent is the simulated HTTP server
        span (span id ``span_id_base + 1``)."""
        return RequestRecording(
            trace_id=self.trace_id,
            parent_span_id=_span_id(self.span_id_base + _ID_HTTP),
            request_id=self.request_id,
            model=self.model,
            operation=self.operation,
            arrival_ns=self.arrival_ns,
            end_ns=self.end_ns,
            first_scheduled_ns=self.first_scheduled_ns,
            first_token_ns=self.first_token_ns,
            last_token_ns=self.last_token_ns,
            token_offsets_us=self.token_offsets_us,
            prefill_chunks=self.prefill_chunks,
            preempted=self.preempted,
            ready_ns=self.ready_ns,
            input_tokens=self.input_tokens,
            output_tokens=self.output_tokens,
            cached_tokens=self.cached_tokens,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            finish_reason=self.finish_reason,
            requests_ahead=self.requests_ahead,
            running_at_arrival=self.running_at_arrival,
            max_running=self.max_running,
            prefix_hash=self.prefix_hash,
            outlier_steps_with_prefill=self.outlier_steps_with_prefill,
        )


@dataclass(slots=True)
class _Job:
    """Mutable engine-side state of one request during the simulation (relative ns)."""

    index: int
    prompt_tokens: int
    output_tokens: int
    prefix_hash: str | None
    prefix_tokens: int
    operation: str
    up_ns: int
    down_ns: int
    tokenize_ns: int
    postprocess_ns: int
    request_id: str
    trace_id: bytes
    span_id_base: int
    client: int = -1
    issue_ns: int = 0
    server_start_ns: int = 0
    arrival_ns: int = 0
    cached_tokens: int = 0
    remaining_prefill: int = 0
    kv_tokens: int = 0
    generated: int = 0
    requests_ahead: int = 0
    running_at_arrival: int = 0
    first_scheduled_ns: int = -1
    preempt_started_ns: int = -1
    end_ns: int = 0
    preempted: list[tuple[int, int]] = field(default_factory=list)
    chunks: list[PrefillChunk] = field(default_factory=list)
    token_times: list[int] = field(default_factory=list)
    token_with_prefill: list[bool] = field(default_factory=list)
    """Per token: a step since the previous token prefilled another request (while this one
    was running, scheduled or starved of token budget)."""
    step_prefill: int = 0
    interfered: bool = False

    def issue(self, issue_ns: int) -> None:
        """The client sends the request at ``issue_ns``; derive server and engine arrival."""
        self.issue_ns = issue_ns
        self.server_start_ns = issue_ns + self.up_ns
        self.arrival_ns = self.server_start_ns + self.tokenize_ns


def _lognormal_int(rng: random.Random, median: int, sigma: float, low: int, high: int) -> int:
    value = round(median * math.exp(rng.gauss(0.0, sigma))) if sigma > 0 else median
    return min(max(value, low), high)


def _draw_jobs(rng: random.Random, scenario: Scenario, count: int, seed: int) -> list[_Job]:
    """Every request's parameters, drawn up front so they do not depend on engine timing."""
    prefix_hashes = [
        hashlib.sha256(f"tokentrace-replay:{seed}:{index}".encode()).hexdigest()[:16]
        for index in range(scenario.shared_prefixes)
    ]
    jobs = []
    for index in range(count):
        if rng.random() < scenario.long_prompt_fraction:
            prompt = _lognormal_int(
                rng,
                scenario.long_prompt_tokens_median,
                scenario.prompt_tokens_sigma,
                scenario.prompt_tokens_min,
                scenario.long_prompt_tokens_max,
            )
        else:
            prompt = _lognormal_int(
                rng,
                scenario.prompt_tokens_median,
                scenario.prompt_tokens_sigma,
                scenario.prompt_tokens_min,
                scenario.prompt_tokens_max,
            )
        output = _lognormal_int(
            rng,
            scenario.output_tokens_median,
            scenario.output_tokens_sigma,
            scenario.output_tokens_min,
            scenario.max_tokens,
        )
        prefix_hash = None
        prefix_tokens = 0
        if prefix_hashes and rng.random() < scenario.shared_prefix_fraction:
            prefix_hash = prefix_hashes[rng.randrange(len(prefix_hashes))]
            prefix_tokens = scenario.shared_prefix_tokens
            # The shared system prompt comes on top of the user's part.
            prompt = min(prompt + prefix_tokens, scenario.longest_prompt_tokens)
        completion = rng.random() < scenario.text_completion_fraction
        operation = semconv.OPERATION_TEXT_COMPLETION if completion else semconv.OPERATION_CHAT
        one_way = scenario.network_one_way_ms * _NS_PER_MS
        jitter = scenario.network_jitter
        request_id = ("cmpl-" if completion else "chatcmpl-") + f"{rng.getrandbits(128):032x}"
        jobs.append(
            _Job(
                index=index,
                prompt_tokens=prompt,
                output_tokens=output,
                prefix_hash=prefix_hash,
                prefix_tokens=prefix_tokens,
                operation=operation,
                up_ns=round(one_way * math.exp(rng.gauss(0.0, jitter))),
                down_ns=round(one_way * math.exp(rng.gauss(0.0, jitter))),
                tokenize_ns=round(
                    scenario.tokenize_base_ms * _NS_PER_MS
                    + scenario.tokenize_us_per_token * _NS_PER_US * prompt
                ),
                postprocess_ns=round(
                    scenario.postprocess_base_ms * _NS_PER_MS
                    + scenario.postprocess_us_per_token * _NS_PER_US * output
                ),
                request_id=request_id,
                trace_id=(rng.getrandbits(127) + 1).to_bytes(16, "big"),
                span_id_base=rng.randrange(1, _SPAN_ID_SPACE),
            )
        )
    return jobs


def _open_loop_issue_times(rng: random.Random, scenario: Scenario, count: int) -> list[int]:
    """Poisson arrival times (ns), the rate multiplied inside periodic bursts.

    Bursts occupy the last ``burst_duration_s`` of every ``burst_period_s``.
    """
    assert scenario.rate_per_s is not None
    base_rate = scenario.rate_per_s
    period = scenario.burst_period_s
    burst = scenario.burst_duration_s
    bursts = period > 0 and 0 < burst < period and scenario.burst_rate_factor != 1.0
    times: list[int] = []
    now_s = 0.0
    cycle = 0
    while len(times) < count:
        if not bursts:
            now_s += rng.expovariate(base_rate)
            times.append(round(now_s * _NS_PER_S))
            continue
        burst_start = cycle * period + period - burst
        cycle_end = (cycle + 1) * period
        in_burst = now_s >= burst_start
        edge = cycle_end if in_burst else burst_start
        rate = base_rate * scenario.burst_rate_factor if in_burst else base_rate
        candidate = now_s + rng.expovariate(rate)
        if candidate >= edge:
            # The rate changes at the edge: restart the (memoryless) draw there.
            now_s = edge
            if in_burst:
                cycle += 1
            continue
        now_s = candidate
        times.append(round(now_s * _NS_PER_S))
    return times


class _Engine:
    """The discrete-event continuous-batching engine (one step per loop iteration)."""

    def __init__(self, scenario: Scenario, rng: random.Random) -> None:
        self.scenario = scenario
        self.rng = rng
        self.waiting: deque[_Job] = deque()
        self.running: list[_Job] = []
        self.kv_used = 0
        self.cached_prefixes: set[str] = set()
        self.ready_ns = round(scenario.cold_start_s * _NS_PER_S)
        self.base_ns = scenario.step_base_ms * _NS_PER_MS
        self.prefill_ns_per_token = scenario.prefill_us_per_token * _NS_PER_US
        self.decode_ns_per_running = scenario.decode_us_per_running * _NS_PER_US

    def arrive(self, job: _Job) -> None:
        job.requests_ahead = len(self.waiting)
        job.running_at_arrival = len(self.running)
        self.waiting.append(job)

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    def _preempt(self, job: _Job, now: int) -> None:
        self.kv_used -= job.kv_tokens
        job.kv_tokens = 0
        # Recompute the prompt and everything generated so far (the prefix cache still hits).
        job.remaining_prefill = job.prompt_tokens + job.generated - job.cached_tokens
        job.preempt_started_ns = now
        self.waiting.appendleft(job)

    def step(self, now: int) -> tuple[int, list[_Job]]:
        """Run one engine step starting at ``now``; returns its end and the finished jobs."""
        scenario = self.scenario
        budget = scenario.max_batched_tokens
        batch: list[tuple[_Job, int]] = []
        preempted_now = False
        running = self.running
        index = 0
        # 1. Running requests first, in admission order (vLLM V1's scheduler).
        while index < len(running) and budget > 0:
            job = running[index]
            tokens = min(job.remaining_prefill, budget) if job.remaining_prefill > 0 else 1
            self_preempted = False
            while self.kv_used + tokens > scenario.kv_cache_tokens:
                victim = running.pop()
                self._preempt(victim, now)
                preempted_now = True
                if victim is job:
                    self_preempted = True
                    break
            if self_preempted:
                break
            batch.append((job, tokens))
            self.kv_used += tokens
            job.kv_tokens += tokens
            budget -= tokens
            index += 1
        # 2. Admit waiting requests while there is room (not in a step that had to preempt).
        while (
            not preempted_now
            and self.waiting
            and len(running) < scenario.max_running
            and budget > 0
        ):
            job = self.waiting[0]
            if job.first_scheduled_ns < 0:
                # Prefix-cache lookup at first scheduling: a hit once the prefix was computed.
                job.cached_tokens = (
                    job.prefix_tokens if job.prefix_hash in self.cached_prefixes else 0
                )
                job.remaining_prefill = job.prompt_tokens - job.cached_tokens
            hold = job.cached_tokens
            tokens = min(job.remaining_prefill, budget)
            if self.kv_used + hold + tokens > scenario.kv_cache_tokens:
                break
            self.waiting.popleft()
            running.append(job)
            if job.first_scheduled_ns < 0:
                job.first_scheduled_ns = now
            if job.preempt_started_ns >= 0:
                job.preempted.append((job.preempt_started_ns, now))
                job.preempt_started_ns = -1
            batch.append((job, tokens))
            self.kv_used += hold + tokens
            job.kv_tokens += hold + tokens
            budget -= tokens
        if not batch:
            raise RuntimeError("replay engine made no progress (scenario validation missed a case)")

        prefill_tokens = 0
        decodes = 0
        for job, tokens in batch:
            if job.remaining_prefill > 0:
                prefill_tokens += tokens
                job.step_prefill = tokens
            else:
                decodes += 1
        if prefill_tokens:
            for job in running:
                if prefill_tokens > job.step_prefill:
                    job.interfered = True
                job.step_prefill = 0
        duration = (
            self.base_ns
            + prefill_tokens * self.prefill_ns_per_token
            + decodes * self.decode_ns_per_running
        )
        if scenario.step_jitter > 0:
            duration *= max(0.5, 1.0 + self.rng.gauss(0.0, scenario.step_jitter))
        end = now + max(1, round(duration))

        finished: list[_Job] = []
        for job, tokens in batch:
            if job.remaining_prefill > 0:
                job.remaining_prefill -= tokens
                if job.generated == 0:
                    job.chunks.append(PrefillChunk(now, end, tokens))
                if job.remaining_prefill > 0:
                    continue  # more chunks to go: no token from this step
                if job.prefix_hash is not None:
                    self.cached_prefixes.add(job.prefix_hash)
            job.generated += 1
            job.token_times.append(end)
            job.token_with_prefill.append(job.interfered)
            job.interfered = False
            if job.generated >= job.output_tokens:
                finished.append(job)
        if finished:
            done = {id(job) for job in finished}
            self.running = [job for job in running if id(job) not in done]
            for job in finished:
                self.kv_used -= job.kv_tokens
                job.kv_tokens = 0
                job.end_ns = end + job.postprocess_ns
        return end, finished


def _outlier_steps_with_prefill(job: _Job) -> int:
    """Inter-token gaps above ``_OUTLIER_GAP_FACTOR`` x the median gap during which an engine
    step prefilled another request."""
    times = job.token_times
    if len(times) < 3:
        return 0
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    median = sorted(gaps)[len(gaps) // 2]
    threshold = _OUTLIER_GAP_FACTOR * median
    with_prefill = job.token_with_prefill
    return sum(1 for i, gap in enumerate(gaps) if gap > threshold and with_prefill[i + 1])


def simulate(
    scenario: Scenario | str = "mixed",
    *,
    requests: int = 300,
    seed: int = 0,
    start_unix_ns: int | None = None,
) -> list[SimulatedRequest]:
    """Simulate ``requests`` requests of ``scenario`` (a ``Scenario`` or a ``SCENARIOS`` name).

    Deterministic for a given scenario, count, seed and ``start_unix_ns``. Simulated time 0 (the
    server process start) maps to ``start_unix_ns``; by default the last response completes about
    now, so the traces look recent. Returns the requests in arrival order.
    """
    if isinstance(scenario, str):
        try:
            scenario = SCENARIOS[scenario]
        except KeyError:
            known = ", ".join(sorted(SCENARIOS))
            raise ValueError(f"unknown scenario {scenario!r} (known: {known})") from None
    if requests < 0:
        raise ValueError("requests must be >= 0")
    rng = random.Random(seed)
    jobs = _draw_jobs(rng, scenario, requests, seed)
    engine = _Engine(scenario, rng)

    pending: list[tuple[int, int, _Job]] = []  # (engine arrival, index, job): a min-heap
    next_job = 0
    if scenario.concurrency is None:
        for job, issue_ns in zip(
            jobs, _open_loop_issue_times(rng, scenario, requests), strict=True
        ):
            job.issue(issue_ns)
            pending.append((job.arrival_ns, job.index, job))
        heapq.heapify(pending)
        next_job = requests
    else:
        for client in range(min(scenario.concurrency, requests)):
            job = jobs[client]
            job.client = client
            job.issue(rng.randrange(_CLOSED_LOOP_STAGGER_NS))
            heapq.heappush(pending, (job.arrival_ns, job.index, job))
        next_job = min(scenario.concurrency, requests)

    think_ns = round(scenario.think_time_s * _NS_PER_S)
    response_ns = round(scenario.response_ms * _NS_PER_MS)
    now = 0
    remaining = requests
    while remaining:
        while pending and pending[0][0] <= now:
            engine.arrive(heapq.heappop(pending)[2])
        if engine.idle:
            now = max(now, pending[0][0]) + _IDLE_WAKEUP_NS
            continue
        if now < engine.ready_ns:
            now = engine.ready_ns
            continue
        now, finished = engine.step(now)
        remaining -= len(finished)
        for job in finished:
            if job.client >= 0 and next_job < requests:
                # Closed loop: the client sends its next request once this response arrived.
                follower = jobs[next_job]
                next_job += 1
                follower.client = job.client
                follower.issue(job.end_ns + response_ns + job.down_ns + think_ns)
                heapq.heappush(pending, (follower.arrival_ns, follower.index, follower))

    if start_unix_ns is None:
        last = max((job.end_ns + response_ns + job.down_ns for job in jobs), default=0)
        start_unix_ns = time.time_ns() - last
    return [_finish(job, scenario, engine.ready_ns, response_ns, start_unix_ns) for job in jobs]


def _finish(
    job: _Job, scenario: Scenario, ready_ns: int, response_ns: int, offset: int
) -> SimulatedRequest:
    """The simulated request of a finished job, shifted to absolute Unix ns."""
    server_end = job.end_ns + response_ns
    request = SimulatedRequest(
        index=job.index,
        request_id=job.request_id,
        trace_id=job.trace_id,
        span_id_base=job.span_id_base,
        model=scenario.model,
        operation=job.operation,
        url_path=_ROUTE_COMPLETIONS
        if job.operation == semconv.OPERATION_TEXT_COMPLETION
        else _ROUTE_CHAT,
        input_tokens=job.prompt_tokens,
        output_tokens=job.output_tokens,
        cached_tokens=job.cached_tokens,
        max_tokens=scenario.max_tokens,
        temperature=scenario.temperature,
        top_p=scenario.top_p,
        finish_reason=_FINISH_LENGTH if job.output_tokens >= scenario.max_tokens else _FINISH_STOP,
        prefix_hash=job.prefix_hash,
        server_start_ns=job.server_start_ns + offset,
        arrival_ns=job.arrival_ns + offset,
        first_scheduled_ns=job.first_scheduled_ns + offset,
        first_token_ns=job.token_times[0] + offset,
        last_token_ns=job.token_times[-1] + offset,
        end_ns=job.end_ns + offset,
        server_end_ns=server_end + offset,
        token_offsets_us=[(t - job.token_times[0]) // _NS_PER_US for t in job.token_times],
        prefill_chunks=[
            PrefillChunk(chunk.start_ns + offset, chunk.end_ns + offset, chunk.tokens)
            for chunk in job.chunks
        ],
        preempted=[(start + offset, end + offset) for start, end in job.preempted],
        requests_ahead=job.requests_ahead,
        running_at_arrival=job.running_at_arrival,
        max_running=scenario.max_running,
        outlier_steps_with_prefill=_outlier_steps_with_prefill(job),
        ready_ns=ready_ns + offset if job.arrival_ns < ready_ns else None,
    )
    if scenario.client_spans:
        request.client_start_ns = job.issue_ns + offset
        request.client_first_token_ns = (
            job.token_times[0] + _STREAM_FIRST_CHUNK_NS + job.down_ns + offset
        )
        request.client_end_ns = server_end + job.down_ns + offset
    return request


# --- the span layout ------------------------------------------------------------------------------
# The server's request subtree is the agent's own (``spans.plan_spans`` over the request's
# recording); replay adds what surrounds it in a real deployment: the HTTP server span and the
# load generator's client span. Simulated span ids are ``span_id_base + k``: the client span,
# the HTTP span, then the subtree in plan order.
_ID_CLIENT: Final = 0
_ID_HTTP: Final = 1
_ID_FIRST_SUBTREE: Final = 2


def _span_id(number: int) -> bytes:
    return number.to_bytes(8, "big")


def span_count(request: SimulatedRequest, dialect: Dialect = DIALECT_TOKENTRACE) -> int:
    """How many spans ``request`` becomes in ``dialect``."""
    if dialect == DIALECT_VLLM:
        return 1
    client = 1 if request.client_start_ns is not None else 0
    return client + 1 + spans.count_spans(request.recording())


def _client_span(request: SimulatedRequest) -> PlannedSpan | None:
    """The load generator's span around the request (``local_id`` 0), if it has one."""
    if request.client_start_ns is None:
        return None
    assert request.client_end_ns is not None and request.client_first_token_ns is not None
    attributes: dict[str, AttrValue] = {
        semconv.GEN_AI_OPERATION_NAME: request.operation,
        semconv.GEN_AI_REQUEST_MODEL: request.model,
        semconv.HTTP_REQUEST_METHOD: _HTTP_METHOD,
        semconv.URL_PATH: request.url_path,
        semconv.HTTP_RESPONSE_STATUS_CODE: _HTTP_OK,
        semconv.CLIENT_FIRST_TOKEN_TIME: request.client_first_token_ns,
    }
    return PlannedSpan(
        _ID_CLIENT, -1, semconv.SPAN_CLIENT_REQUEST, spans.KIND_CLIENT,
        request.client_start_ns, request.client_end_ns, attributes,
    )  # fmt: skip


def _http_span(request: SimulatedRequest, *, has_client: bool) -> PlannedSpan:
    """The inference server's HTTP server span: the parent of ``llm.request``."""
    attributes: dict[str, AttrValue] = {
        semconv.HTTP_REQUEST_METHOD: _HTTP_METHOD,
        semconv.URL_PATH: request.url_path,
        semconv.HTTP_RESPONSE_STATUS_CODE: _HTTP_OK,
    }
    return PlannedSpan(
        _ID_HTTP, _ID_CLIENT if has_client else -1, f"{_HTTP_METHOD} {request.url_path}",
        spans.KIND_SERVER, request.server_start_ns, request.server_end_ns, attributes,
    )  # fmt: skip


def _vllm_span(request: SimulatedRequest) -> PlannedSpan:
    """vLLM's built-in span: start at arrival, end at completion, latencies in seconds."""
    seconds = 1.0 / _NS_PER_S
    arrival = request.arrival_ns
    scheduled = request.first_scheduled_ns
    first_token = request.first_token_ns
    last_token = request.last_token_ns
    end = request.end_ns
    attributes: dict[str, AttrValue] = {
        semconv.VLLM_LATENCY_TTFT: (first_token - arrival) * seconds,
        semconv.VLLM_LATENCY_E2E: (end - arrival) * seconds,
        semconv.VLLM_LATENCY_QUEUE: (scheduled - arrival) * seconds,
        semconv.VLLM_LATENCY_PREFILL: (first_token - scheduled) * seconds,
        semconv.VLLM_LATENCY_DECODE: (last_token - first_token) * seconds,
        semconv.VLLM_LATENCY_INFERENCE: (last_token - scheduled) * seconds,
        semconv.VLLM_USAGE_PROMPT_TOKENS: request.input_tokens,
        semconv.VLLM_USAGE_COMPLETION_TOKENS: request.output_tokens,
        semconv.VLLM_REQUEST_ID: request.request_id,
        semconv.GEN_AI_REQUEST_TOP_P: request.top_p,
        semconv.GEN_AI_REQUEST_MAX_TOKENS: request.max_tokens,
        semconv.GEN_AI_REQUEST_TEMPERATURE: request.temperature,
        semconv.VLLM_REQUEST_N: 1,
    }
    return PlannedSpan(
        0, -1, semconv.VLLM_SPAN_REQUEST, spans.KIND_SERVER, arrival, end, attributes
    )


def _check_dialect(dialect: str) -> None:
    if dialect not in DIALECTS:
        raise ValueError(f"unknown dialect {dialect!r} (known: {', '.join(DIALECTS)})")


def _check_max_token_offsets(max_token_offsets: int) -> None:
    if max_token_offsets < 0:
        raise ValueError("max_token_offsets must be >= 0")


def _scope_name(dialect: Dialect) -> str:
    return semconv.VLLM_TRACING_SCOPE if dialect == DIALECT_VLLM else semconv.REPLAY_SCOPE


# --- emission: OpenTelemetry SDK ----------------------------------------------------------------


def emit_sdk(
    requests: Iterable[SimulatedRequest],
    tracer_provider: TracerProvider,
    *,
    dialect: Dialect = DIALECT_TOKENTRACE,
    client_tracer_provider: TracerProvider | None = None,
    max_token_offsets: int = _DEFAULT_MAX_TOKEN_OFFSETS,
) -> int:
    """Create every request's spans through the OpenTelemetry SDK; returns the span count.

    Spans carry the simulated timestamps (explicit ``start_time``/``end_time``), explicit
    parent contexts and span kinds. Client spans go to ``client_tracer_provider`` (the load
    generator's resource) when given, else to ``tracer_provider``. Trace and span ids are the
    SDK's own (its id generator), not the simulated ones ``to_otlp_requests`` uses. The caller
    owns the providers' span processors and exporters (and flushing them).
    """
    from opentelemetry import trace
    from opentelemetry.context import Context
    from opentelemetry.trace import Status, StatusCode

    _check_dialect(dialect)
    _check_max_token_offsets(max_token_offsets)
    kinds = {
        spans.KIND_INTERNAL: trace.SpanKind.INTERNAL,
        spans.KIND_SERVER: trace.SpanKind.SERVER,
        spans.KIND_CLIENT: trace.SpanKind.CLIENT,
    }
    scope = _scope_name(dialect)
    server_tracer = tracer_provider.get_tracer(scope)
    client_tracer = (client_tracer_provider or tracer_provider).get_tracer(scope)
    root_context = Context()  # never inherit whatever span is current in the caller
    ends: list[tuple[trace.Span, int]] = []

    def start(tracer: trace.Tracer, planned: PlannedSpan, context: Context) -> trace.Span:
        span = tracer.start_span(
            planned.name,
            context=context,
            kind=kinds[planned.kind],
            attributes=planned.attributes,
            start_time=planned.start_ns,
        )
        if planned.error is not None:
            span.set_status(Status(StatusCode.ERROR, planned.error))
        ends.append((span, planned.end_ns))
        return span

    emitted = 0
    for request in requests:
        if dialect == DIALECT_VLLM:
            start(server_tracer, _vllm_span(request), root_context)
        else:
            client = _client_span(request)
            context = root_context
            if client is not None:
                context = trace.set_span_in_context(start(client_tracer, client, root_context))
            http = start(server_tracer, _http_span(request, has_client=client is not None), context)
            subtree_parent = trace.set_span_in_context(http)
            started: list[trace.Span] = []
            for planned in spans.plan_spans(
                request.recording(), max_token_offsets=max_token_offsets
            ):
                parent = planned.parent_local_id
                context = (
                    subtree_parent if parent < 0 else trace.set_span_in_context(started[parent])
                )
                started.append(start(server_tracer, planned, context))
        # Children end before their parents, as they do in a live server.
        for span, end_ns in reversed(ends):
            span.end(end_time=end_ns)
        emitted += len(ends)
        ends.clear()
    return emitted


# --- emission: OTLP protobuf messages -----------------------------------------------------------


def to_otlp_requests(
    requests: Iterable[SimulatedRequest],
    *,
    dialect: Dialect = DIALECT_TOKENTRACE,
    batch_spans: int = _DEFAULT_BATCH_SPANS,
    service_name: str = _DEFAULT_SERVICE_NAME,
    client_service_name: str = _DEFAULT_CLIENT_SERVICE_NAME,
    host_name: str | None = None,
    pid: int | None = None,
    max_token_offsets: int = _DEFAULT_MAX_TOKEN_OFFSETS,
) -> list[ExportTraceServiceRequest]:
    """The requests' spans as OTLP export requests of about ``batch_spans`` spans each.

    A request's spans never straddle two export requests. Server spans sit under a resource
    with ``service.name``/``host.name``/``process.pid``; client spans under their own resource
    (``client_service_name``), as a separate load generator would send them. Ids are the
    simulated ones (deterministic for a seed).

    Spans are written in protobuf wire format by the agent's encoder (``spans``) and parsed
    once per batch.
    """
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    if batch_spans < 1:
        raise ValueError("batch_spans must be >= 1")
    _check_dialect(dialect)
    _check_max_token_offsets(max_token_offsets)
    host = socket.gethostname() if host_name is None else host_name
    process_id = os.getpid() if pid is None else pid
    scope = _scope_name(dialect)

    def head(service: str) -> ResourceScope:
        resource: dict[str, AttrValue] = {
            semconv.SERVICE_NAME: service,
            semconv.HOST_NAME: host,
            semconv.PROCESS_PID: process_id,
        }
        return ResourceScope(resource_attributes=resource, scope_name=scope)

    server_head = head(service_name)
    client_head = head(client_service_name)
    batches: list[ExportTraceServiceRequest] = []
    server_parts: list[bytes] = []
    client_parts: list[bytes] = []
    in_batch = 0
    for request in requests:
        if in_batch >= batch_spans:
            encoded = spans.export_request(
                ((server_head, server_parts), (client_head, client_parts))
            )
            batches.append(ExportTraceServiceRequest.FromString(encoded))
            server_parts, client_parts = [], []
            in_batch = 0
        trace_id = request.trace_id
        base = request.span_id_base
        if dialect == DIALECT_VLLM:
            vllm = _vllm_span(request)
            server_parts.append(spans.encode_span(vllm, trace_id=trace_id, span_id=_span_id(base)))
            in_batch += 1
            continue
        client = _client_span(request)
        client_id = b""
        if client is not None:
            client_id = _span_id(base + _ID_CLIENT)
            client_parts.append(spans.encode_span(client, trace_id=trace_id, span_id=client_id))
            in_batch += 1
        http = _http_span(request, has_client=client is not None)
        recording = request.recording()
        server_parts.append(
            spans.encode_span(
                http,
                trace_id=trace_id,
                span_id=recording.parent_span_id,
                parent_span_id=client_id,
            )
        )
        subtree = spans.encode_span_tree(
            spans.plan_spans(recording, max_token_offsets=max_token_offsets),
            trace_id=trace_id,
            parent_span_id=recording.parent_span_id,
            span_ids=itertools.count(base + _ID_FIRST_SUBTREE).__next__,
        )
        server_parts += subtree
        in_batch += 1 + len(subtree)
    if in_batch:
        encoded = spans.export_request(((server_head, server_parts), (client_head, client_parts)))
        batches.append(ExportTraceServiceRequest.FromString(encoded))
    return batches
