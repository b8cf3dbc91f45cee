"""The discrete-event model of a vLLM-like continuous-batching engine.

Requests arrive (open-loop Poisson, optionally with bursts, or closed-loop clients), wait in a
FIFO queue while the batch is full, are prefilled in chunks under a per-step token budget, decode
one token per engine step, and are preempted (newest first, recomputed later) when the KV cache
runs out. Every timestamp a real agent would record falls out of the engine steps, so each
scenario's slow requests are slow for the reason the scenario is named after.

``simulate`` draws every request's parameters up front, runs the engine and returns each
request's ``SimulatedRequest``; turning those into spans is ``emit``'s job. Deterministic for a
seed. Standard library and the agent's stdlib-only modules only.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import math
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Final

from tokentrace.agent import semconv
from tokentrace.agent.finished_request import PrefillChunk
from tokentrace.loadgen.replay.request import SimulatedRequest
from tokentrace.loadgen.replay.scenarios import SCENARIOS, Scenario

__all__ = ["simulate"]

_NS_PER_S: Final = 1_000_000_000
_NS_PER_MS: Final = 1_000_000
_NS_PER_US: Final = 1_000

_ROUTE_CHAT: Final = "/v1/chat/completions"
_ROUTE_COMPLETIONS: Final = "/v1/completions"
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
"""Span ids are ``base + k`` with small ``k`` (``request``'s layout); bases below this never wrap
to the invalid 0."""


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
