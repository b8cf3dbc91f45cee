"""Runs a load: issues the planned requests at a fixed concurrency or at Poisson arrivals, times
every chunk, and hands each finished request's client span to the exporter.

One asyncio loop on the calling thread. Each request gets a new trace id and a ``traceparent``
naming its client span, so the server's spans join the client's trace and the collector can
compute the ``network`` segment (client-observed minus server-observed time). Warm-up requests
go first, untraced and unmeasured. The window the run record keeps starts with the first
measured request and ends with the last response.

Besides the latencies, each request keeps the client's side of the wire (``results.py``): the
HTTP client's facts about its connection and first byte, the wait before its bytes were sent,
and the kernel's TCP_INFO taken twice at most: right after the read that completed the first
token event (the runner asks: only it knows which event is a token) and right after the read
that completed the response (the HTTP client takes it before the connection can be reused).

The client's own lateness in reading its first token takes the larger of two measures: the
kernel's wait at that read (how long ago the last bytes arrived: too short when later tokens
kept arriving while the client was stalled) and the stalls of this process's event loop since
the request was sent (``_LoopStalls``: a probe that wakes every few ms and records how late it
woke: a busy loop, a starved process, a GIL held by another thread). The run's stalls in all
are reported, so a saturated client says so instead of passing its delays off as the server's.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from tokentrace.agent.span_ids import format_traceparent, random_span_id_bytes, random_trace_id
from tokentrace.loadgen.http import HttpClient, HttpError, Response
from tokentrace.loadgen.results import RequestResult
from tokentrace.loadgen.workload import (
    LoadConfig,
    RequestPlan,
    RequestPlanner,
    arrival_offsets_s,
)

_DONE: Final = "[DONE]"
_STALL_PROBE_INTERVAL_S: Final = 0.005
_MIN_STALL_NS: Final = 1_000_000
"""Later wake-ups than this count as stalls (below: ordinary scheduling jitter)."""
_MAX_STALLS: Final = 100_000
"""Stalls remembered at most (oldest forgotten first): bounded memory on long runs."""
_MAX_ERROR_CHARS: Final = 300
_NS_PER_S: Final = 1_000_000_000


class SpanSink(Protocol):
    """Where finished requests go as client spans (``ClientSpanExporter``); never blocks."""

    def add(self, result: RequestResult, *, model: str, path: str) -> None: ...


class ProgressSink(Protocol):
    def update(self, *, done: int, failed: int, in_flight: int, total: int | None) -> None: ...


@dataclass(slots=True)
class RunOutcome:
    model: str
    results: list[RequestResult]
    warmup_failed: int
    window_start_ns: int
    """Unix ns: the first measured request's start."""
    window_end_ns: int
    """Unix ns: the last measured response's end."""
    http_stats: dict[str, int] = field(default_factory=dict)

    @property
    def duration_ns(self) -> int:
        return max(self.window_end_ns - self.window_start_ns, 0)


class _Clock:
    """Monotonic readings mapped to Unix ns with one offset taken at the start, so that a wall
    clock step during the run cannot bend the measured durations."""

    __slots__ = ("_monotonic", "offset_ns")

    def __init__(self, monotonic: Callable[[], int], wall: Callable[[], int]) -> None:
        self._monotonic = monotonic
        self.offset_ns = wall() - monotonic()

    def __call__(self) -> int:
        return self._monotonic() + self.offset_ns


class _LoopStalls:
    """When this process's event loop ran late: a probe sleeps ``_STALL_PROBE_INTERVAL_S`` and
    records each late wake-up as the interval (due, woke) on the runner's clock."""

    __slots__ = ("_clock", "_due", "_stalls", "count", "longest_ns", "total_ns")

    def __init__(self, clock: Callable[[], int]) -> None:
        self._clock = clock
        self._stalls: deque[tuple[int, int]] = deque(maxlen=_MAX_STALLS)
        self._due: int | None = None
        """When the probe is due to wake next (None: not running)."""
        self.count = 0
        self.total_ns = 0
        self.longest_ns = 0

    async def run(self) -> None:
        interval_ns = int(_STALL_PROBE_INTERVAL_S * _NS_PER_S)
        while True:
            due = self._due = self._clock() + interval_ns
            await asyncio.sleep(_STALL_PROBE_INTERVAL_S)
            late = self._clock() - due
            if late > _MIN_STALL_NS:
                self._stalls.append((due, due + late))
                self.count += 1
                self.total_ns += late
                self.longest_ns = max(self.longest_ns, late)

    def within(self, start_ns: int, end_ns: int) -> int:
        """ns of stalls inside [start, end] (recent windows: scanned from the newest), the one
        still in progress included: after a stall the loop may run a reader before the probe,
        which records the stall only when it wakes."""
        total = 0
        due = self._due
        if due is not None and end_ns - due > _MIN_STALL_NS:
            total += max(0, end_ns - max(due, start_ns))
        for due, woke in reversed(self._stalls):
            if woke <= start_ns:
                break
            total += max(0, min(woke, end_ns) - max(due, start_ns))
        return total

    def stats(self) -> dict[str, int]:
        return {
            "client_stalls": self.count,
            "client_stall_ns": self.total_ns,
            "client_longest_stall_ns": self.longest_ns,
        }


class LoadRunner:
    def __init__(
        self,
        config: LoadConfig,
        *,
        model: str,
        planner: RequestPlanner,
        spans: SpanSink | None = None,
        progress: ProgressSink | None = None,
        headers: Mapping[str, str] | None = None,
        monotonic_ns: Callable[[], int] = time.monotonic_ns,
        wall_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self._config = config
        self._model = model
        self._planner = planner
        self._spans = spans
        self._progress = progress
        self._headers = headers
        """Sent with every request (e.g. ``Authorization``); never recorded: they may be secrets."""
        self._monotonic_ns = monotonic_ns
        self._unix_ns = _Clock(monotonic_ns, wall_ns)
        self._results: list[RequestResult] = []
        self._in_flight = 0
        self._failed = 0
        self._stalls = _LoopStalls(self._unix_ns)

    def run(self) -> RunOutcome:
        return asyncio.run(self.run_async())

    async def run_async(self) -> RunOutcome:
        config = self._config
        # The client's clock is the monotonic one mapped to Unix ns (see _Clock).
        client = HttpClient(
            config.server_url,
            reuse_connections=config.reuse_connections,
            timeout_s=config.timeout_s,
            headers=self._headers,
            clock=self._unix_ns,
        )
        probe = asyncio.create_task(self._stalls.run())
        try:
            warmup_failed = await self._warm_up(client)
            started = self._unix_ns()
            if config.rate is not None:
                await self._open_loop(client, config.rate)
            else:
                await self._closed_loop(client, config.effective_concurrency or 1)
            ended = max((result.end_ns for result in self._results), default=started)
            return RunOutcome(
                model=self._model,
                results=sorted(self._results, key=lambda result: result.index),
                warmup_failed=warmup_failed,
                window_start_ns=min((r.start_ns for r in self._results), default=started),
                window_end_ns=ended,
                http_stats=client.stats() | self._stalls.stats(),
            )
        finally:
            probe.cancel()
            await client.aclose()

    # --- scheduling ------------------------------------------------------------------------------
    def _limits(self) -> tuple[int | None, int | None]:
        """(request count, deadline in monotonic ns) for the measured part."""
        config = self._config
        deadline = None
        if config.duration_s is not None:
            deadline = self._monotonic_ns() + int(config.duration_s * _NS_PER_S)
        return config.effective_requests, deadline

    async def _warm_up(self, client: HttpClient) -> int:
        plans = self._planner.warmup()
        if not plans:
            return 0
        limit = asyncio.Semaphore(self._config.effective_concurrency or 1)

        async def one(plan: RequestPlan) -> bool:
            async with limit:
                return (await self._send(client, plan, traced=False)).ok

        outcomes = await asyncio.gather(*(one(plan) for plan in plans))
        return sum(1 for ok in outcomes if not ok)

    async def _closed_loop(self, client: HttpClient, concurrency: int) -> None:
        requests, deadline = self._limits()
        next_index = 0

        def take() -> int | None:
            nonlocal next_index
            if requests is not None and next_index >= requests:
                return None
            if deadline is not None and self._monotonic_ns() >= deadline:
                return None
            index = next_index
            next_index += 1
            return index

        async def worker() -> None:
            while (index := take()) is not None:
                await self._measure(client, self._planner.plan(index), requests)

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    async def _open_loop(self, client: HttpClient, rate: float) -> None:
        requests, deadline = self._limits()
        limit = asyncio.Semaphore(self._config.concurrency) if self._config.concurrency else None
        started = self._monotonic_ns()
        tasks: set[asyncio.Task[None]] = set()

        async def one(index: int) -> None:
            plan = self._planner.plan(index)
            if limit is None:
                await self._measure(client, plan, requests)
                return
            async with limit:
                await self._measure(client, plan, requests)

        for index, offset_s in enumerate(arrival_offsets_s(rate, seed=self._config.seed)):
            if requests is not None and index >= requests:
                break
            due = started + int(offset_s * _NS_PER_S)
            if deadline is not None and due >= deadline:
                break
            delay_ns = due - self._monotonic_ns()
            if delay_ns > 0:
                await asyncio.sleep(delay_ns / _NS_PER_S)
            task = asyncio.create_task(one(index))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)

    async def _measure(self, client: HttpClient, plan: RequestPlan, total: int | None) -> None:
        self._in_flight += 1
        self._report(total)
        try:
            result = await self._send(client, plan, traced=True)
        finally:
            self._in_flight -= 1
        self._results.append(result)
        if not result.ok:
            self._failed += 1
        if self._spans is not None:
            self._spans.add(result, model=self._model, path=plan.path)
        self._report(total)

    def _report(self, total: int | None) -> None:
        if self._progress is not None:
            self._progress.update(
                done=len(self._results),
                failed=self._failed,
                in_flight=self._in_flight,
                total=total,
            )

    # --- one request -----------------------------------------------------------------------------
    async def _send(self, client: HttpClient, plan: RequestPlan, *, traced: bool) -> RequestResult:
        trace_id = random_trace_id()
        span_id = random_span_id_bytes()
        headers = {"traceparent": format_traceparent(trace_id, span_id)} if traced else None
        start = self._unix_ns()
        result = RequestResult(
            index=plan.index,
            trace_id=trace_id.hex(),
            span_id=span_id.hex(),
            operation=plan.operation,
            shared_prefix=plan.shared_prefix,
            max_tokens=plan.max_tokens,
            start_ns=start,
            end_ns=start,
            stream=self._config.stream,
        )
        response: Response | None = None
        try:
            response = await client.post(plan.path, plan.body, headers=headers)
            async with response:
                _record_connection(response, result)
                if response.status != 200:
                    body = await response.read()
                    result.error = f"http {response.status}: {_excerpt(body)}"
                elif self._config.stream:
                    await _read_stream(response, result, self._stalls)
                else:
                    _read_whole(await response.read(), result)
                end = response.end_tcp_facts
                if end is not None:
                    result.read_wait_ns = end.last_data_recv_ns
                    result.rtt_ns = end.rtt_ns
        except HttpError as error:
            result.error = f"connection: {error}"
        except (ValueError, KeyError, TypeError, AttributeError) as error:  # not the API's JSON
            result.error = f"invalid response: {_excerpt(str(error).encode())}"
        # The request ends with the read that completed its body: what the client did after
        # it (its last event's parsing, returning the connection) is not the request's, and a
        # starved event loop there would otherwise read as time outside the server (network).
        body_end_ns = response.body_end_ns if response is not None else None
        result.end_ns = body_end_ns if body_end_ns is not None else self._unix_ns()
        if result.error is None and self._config.stream and result.first_token_ns is None:
            result.error = "invalid response: the stream carried no token"
        return result


def _record_connection(response: Response, result: RequestResult) -> None:
    """What the response's head says about the request's connection and the client's wait to
    send (after a stale-connection retry, the failed attempt counts as the client's own)."""
    result.status = response.status
    result.first_byte_ns = response.first_byte_ns
    result.connection_reused = response.connection_reused
    result.connect_ns = response.connect_ns
    result.send_wait_ns = max(response.sent_ns - result.start_ns - (response.connect_ns or 0), 0)


async def _read_stream(response: Response, result: RequestResult, stalls: _LoopStalls) -> None:
    chunks = 0
    previous: int | None = None
    async for at_ns, data in response.events():
        if data == _DONE:
            continue
        message = json.loads(data)
        if not isinstance(message, dict):
            raise ValueError("an event that is not a JSON object")
        if "error" in message and not message.get("choices"):
            result.error = f"server error: {_excerpt(json.dumps(message['error']).encode())}"
            continue
        if message.get("choices"):
            chunks += 1
            if previous is None:
                result.first_token_ns = at_ns
                # No await since the read that completed this event: the kernel's view is still
                # the one right after it.
                facts = response.tcp_facts()
                stalled = stalls.within(response.sent_ns, at_ns)
                kernel_wait = facts.last_data_recv_ns if facts is not None else 0
                if facts is not None or stalled:
                    result.first_token_read_wait_ns = max(kernel_wait, stalled)
            else:
                result.chunk_gaps_ns.append(at_ns - previous)
            previous = at_ns
            result.last_token_ns = at_ns
        usage = message.get("usage")
        if isinstance(usage, dict):
            _apply_usage(usage, result)
    if result.output_tokens is None and chunks:
        result.output_tokens = chunks


def _read_whole(body: bytes, result: RequestResult) -> None:
    message = json.loads(body)
    if not isinstance(message, dict):
        raise ValueError("a body that is not a JSON object")
    usage = message.get("usage")
    if isinstance(usage, dict):
        _apply_usage(usage, result)


def _apply_usage(usage: dict[str, Any], result: RequestResult) -> None:
    completion = usage.get("completion_tokens")
    prompt = usage.get("prompt_tokens")
    if isinstance(completion, int):
        result.output_tokens = completion
    if isinstance(prompt, int):
        result.prompt_tokens = prompt


def _excerpt(body: bytes) -> str:
    text = " ".join(body.decode("utf-8", "replace").split())
    return text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 3] + "..."
