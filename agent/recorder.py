"""The hot path: integer timestamps per request, nothing else.

On the serving thread the agent does one clock read (or reuses the engine's step timestamp) and
one list append per event: no span objects, no locks, no I/O. When a request finishes, its
``RequestTimer`` is handed to the emitter's queue (a deque append, atomic under the GIL) and
everything else - clock-domain conversion, span building, encoding, export - happens once per
request on the emitter's thread.

Clock domains: timers hold ``time.monotonic_ns()`` readings (comparable across the processes of
one host on Linux, which is how vLLM's frontend and engine core agree); ``ClockDomain`` maps them
to Unix time once per request with an offset it re-measures periodically, so a wall-clock step
(NTP) never reorders the phases of a request.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokentrace.agent.recording import PrefillChunk, RequestRecording

_DEFAULT_MAX_IN_FLIGHT = 65_536
_OFFSET_REFRESH_NS = 10_000_000_000  # re-measure the wall/monotonic offset every 10 s
_NS_PER_US = 1_000


class ClockDomain:
    """Monotonic nanoseconds -> Unix nanoseconds, with an offset measured at most every 10 s."""

    def __init__(
        self,
        *,
        wall_ns: Callable[[], int] = time.time_ns,
        monotonic_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self._wall_ns = wall_ns
        self._monotonic_ns = monotonic_ns
        self._offset_ns = 0
        self._measured_at = -_OFFSET_REFRESH_NS
        self.refresh()

    def refresh(self) -> None:
        # The tightest of three readings bounds the error by the gap between the two clocks' reads.
        best: tuple[int, int] | None = None
        for _ in range(3):
            before = self._monotonic_ns()
            wall = self._wall_ns()
            after = self._monotonic_ns()
            if best is None or after - before < best[0]:
                best = (after - before, wall - (before + after) // 2)
        assert best is not None
        self._offset_ns = best[1]
        self._measured_at = self._monotonic_ns()

    def to_unix_ns(self, monotonic_ns: int) -> int:
        if self._monotonic_ns() - self._measured_at > _OFFSET_REFRESH_NS:
            self.refresh()
        return monotonic_ns + self._offset_ns


@dataclass(slots=True)
class RequestTimer:
    """One request's life as monotonic-ns integers; filled on the serving path.

    Instrumentations append to the lists directly (``timer.token_ns.append(now)``): that is the
    whole per-token cost.
    """

    request_id: str
    arrival_ns: int
    queued_ns: int | None = None
    """When the engine queued the request (engine arrival); None: not reported."""
    scheduled_ns: int | None = None
    token_ns: list[int] = field(default_factory=list)
    chunks: list[tuple[int, int, int]] = field(default_factory=list)
    """(start, end, tokens) per prefill chunk."""
    preempted_ns: list[tuple[int, int]] = field(default_factory=list)
    preempted_since_ns: int | None = None
    end_ns: int | None = None
    error: str | None = None
    trace_id: bytes = b""
    parent_span_id: bytes = b""
    attributes: dict[str, Any] = field(default_factory=dict)
    """RequestRecording field values known to the instrumentation (model, tokens, ...)."""

    def preempt(self, now_ns: int) -> None:
        if self.preempted_since_ns is None:
            self.preempted_since_ns = now_ns

    def resume(self, now_ns: int) -> None:
        if self.preempted_since_ns is not None:
            self.preempted_ns.append((self.preempted_since_ns, now_ns))
            self.preempted_since_ns = None


def to_recording(timer: RequestTimer, clock: ClockDomain) -> RequestRecording:
    """The request in Unix time, for the span builder (runs on the emitter's thread)."""
    unix = clock.to_unix_ns
    end_ns = timer.end_ns if timer.end_ns is not None else timer.arrival_ns
    if timer.preempted_since_ns is not None:  # finished while evicted (aborted)
        timer.preempted_ns.append((timer.preempted_since_ns, end_ns))
    tokens = timer.token_ns
    first = tokens[0] if tokens else None
    recording = RequestRecording(
        trace_id=timer.trace_id,
        parent_span_id=timer.parent_span_id,
        request_id=timer.request_id,
        model=str(timer.attributes.get("model", "unknown")),
        operation=str(timer.attributes.get("operation", "unknown")),
        arrival_ns=unix(timer.arrival_ns),
        end_ns=unix(end_ns),
        queued_ns=None if timer.queued_ns is None else unix(timer.queued_ns),
        first_scheduled_ns=None if timer.scheduled_ns is None else unix(timer.scheduled_ns),
        first_token_ns=None if first is None else unix(first),
        last_token_ns=None if first is None else unix(tokens[-1]),
        token_offsets_us=[] if first is None else [(t - first) // _NS_PER_US for t in tokens],
        prefill_chunks=[PrefillChunk(unix(s), unix(e), n) for s, e, n in timer.chunks],
        preempted=[(unix(s), unix(e)) for s, e in timer.preempted_ns],
        error=timer.error,
    )
    for name, value in timer.attributes.items():
        if name not in ("model", "operation") and hasattr(recording, name):
            setattr(recording, name, value)
    return recording


class Recorder:
    """In-flight requests by id. ``begin`` and ``finish`` run on the serving path: a dict
    operation each, bounded by ``max_in_flight`` (beyond it requests go untraced, counted)."""

    def __init__(
        self,
        sink: Callable[[RequestTimer], None],
        *,
        max_in_flight: int = _DEFAULT_MAX_IN_FLIGHT,
        monotonic_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self._sink = sink
        self._max_in_flight = max_in_flight
        self.clock = monotonic_ns
        self._in_flight: dict[str, RequestTimer] = {}
        self.untraced_requests = 0
        """Requests not traced because max_in_flight timers were open."""

    def begin(self, request_id: str, *, arrival_ns: int | None = None) -> RequestTimer | None:
        if len(self._in_flight) >= self._max_in_flight:
            self.untraced_requests += 1
            return None
        timer = RequestTimer(request_id, self.clock() if arrival_ns is None else arrival_ns)
        self._in_flight[request_id] = timer
        return timer

    def get(self, request_id: str) -> RequestTimer | None:
        return self._in_flight.get(request_id)

    def finish(
        self, request_id: str, *, end_ns: int | None = None, error: str | None = None
    ) -> None:
        timer = self._in_flight.pop(request_id, None)
        if timer is None:
            return
        timer.end_ns = self.clock() if end_ns is None else end_ns
        if error is not None:
            timer.error = error
        self._sink(timer)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)
