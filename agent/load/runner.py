"""Runs a load: issues the planned requests at a fixed concurrency or at Poisson arrivals, times
every chunk, and hands each finished request's client span to the exporter.

One asyncio loop on the calling thread. Each request gets a new trace id and a ``traceparent``
naming its client span, so the server's spans join the client's trace and the collector can
compute the ``network`` segment (client-observed minus server-observed time). Warm-up requests
go first, untraced and unmeasured. The window the run record keeps starts with the first
measured request and ends with the last response.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from tokentrace.agent.load.http import HttpClient, HttpError
from tokentrace.agent.load.results import RequestResult
from tokentrace.agent.load.workload import (
    LoadConfig,
    RequestPlan,
    RequestPlanner,
    arrival_offsets_s,
)
from tokentrace.agent.spans import format_traceparent, random_span_id_bytes, random_trace_id

_DONE: Final = "[DONE]"
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
                http_stats=client.stats(),
            )
        finally:
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
        )
        try:
            response = await client.post(plan.path, plan.body, headers=headers)
            async with response:
                result.status = response.status
                if response.status != 200:
                    body = await response.read()
                    result.error = f"http {response.status}: {_excerpt(body)}"
                elif self._config.stream:
                    await _read_stream(response, result)
                else:
                    _read_whole(await response.read(), result)
        except HttpError as error:
            result.error = f"connection: {error}"
        except (ValueError, KeyError, TypeError, AttributeError) as error:  # not the API's JSON
            result.error = f"invalid response: {_excerpt(str(error).encode())}"
        result.end_ns = self._unix_ns()
        if result.error is None and self._config.stream and result.first_token_ns is None:
            result.error = "invalid response: the stream carried no token"
        return result


async def _read_stream(response: Any, result: RequestResult) -> None:
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
