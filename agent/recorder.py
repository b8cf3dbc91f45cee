"""The hot path: integer timestamps per request, nothing else.

On the serving thread the agent does one clock read (or reuses the engine's step timestamp) and
one list append per event: no span objects, no locks, no I/O. When a request finishes, its
``RequestTimer`` is handed to the emitter's queue (a deque append, atomic under the GIL) and
everything else - clock-domain conversion, span building, encoding, export - happens once per
request on the emitter's thread.

Clocks: timers hold ``time.monotonic_ns()`` readings (comparable across the processes of one host
on Linux, which is how vLLM's frontend and engine core agree); ``MonotonicToUnix`` maps them to
Unix time once per request with an offset it re-measures periodically, so a wall-clock step
(NTP) never reorders the phases of a request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from tokentrace.agent.finished_request import FinishedRequest, PrefillChunk, prompt_prefix_hash
from tokentrace.agent.otlp_export import RateLimitedWarning

_log = logging.getLogger(__name__)

_DEFAULT_MAX_IN_FLIGHT = 65_536
_DEFAULT_MAX_AGE_S = 600.0
_EXPIRY_SWEEP_EVERY = 256
"""``begin`` looks for expired timers once per this many calls (a power of two)."""
_EXPIRY_MAX_PER_SWEEP = 4 * _EXPIRY_SWEEP_EVERY
"""Faster than timers can leak, yet bounds the work any one ``begin`` does."""
_DROP_WARNING_INTERVAL_S = 60.0
EXPIRED_ERROR = "expired: no end seen"
_NS_PER_S = 1_000_000_000
_OFFSET_REFRESH_NS = 10_000_000_000  # re-measure the wall/monotonic offset every 10 s
_NS_PER_US = 1_000
PROMPT_TOKEN_IDS = "prompt_token_ids"
"""``RequestTimer.attributes`` key of the prompt's token ids (a reference the instrumentation
hands over, not a copy): the emitter's thread hashes their prefix, the serving path does not."""


class MonotonicToUnix:
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
        return monotonic_ns + self.offset_ns()

    def offset_ns(self) -> int:
        """Unix ns minus monotonic ns now: for converting many readings with one clock check."""
        if self._monotonic_ns() - self._measured_at > _OFFSET_REFRESH_NS:
            self.refresh()
        return self._offset_ns


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
    first_scheduled_ns: int | None = None
    """When the engine first scheduled the request (the end of its queue wait)."""
    token_ns: list[int] = field(default_factory=list)
    prefill_chunks: list[tuple[int, int, int]] = field(default_factory=list)
    """(start, end, tokens) per prefill chunk."""
    preempted_ns: list[tuple[int, int]] = field(default_factory=list)
    preempted_since_ns: int | None = None
    end_ns: int | None = None
    status_error: str | None = None
    """Why the request failed (the ``llm.request`` span's ERROR status); None: it did not."""
    trace_id: bytes = b""
    parent_span_id: bytes = b""
    span_id: bytes = b""
    """``llm.request``'s id when chosen in advance (see ``FinishedRequest.span_id``)."""
    prefill_span_id: bytes = b""
    ready_ns: int | None = None
    """When the server became ready, for a request that arrived during its cold start."""
    cold_start_link: tuple[bytes, bytes] | None = None
    """(trace id, span id) of the ``llm.cold_start`` the request waited for."""
    attributes: dict[str, Any] = field(default_factory=dict)
    """FinishedRequest field values known to the instrumentation (model, tokens, ...)."""

    def preempt(self, now_ns: int) -> None:
        if self.preempted_since_ns is None:
            self.preempted_since_ns = now_ns

    def resume(self, now_ns: int) -> None:
        if self.preempted_since_ns is not None:
            self.preempted_ns.append((self.preempted_since_ns, now_ns))
            self.preempted_since_ns = None


class UnixOffset(Protocol):
    """What ``to_finished_request`` converts with: ``MonotonicToUnix``, or a fixed offset that
    another process measured (the node agent's local socket)."""

    def offset_ns(self) -> int: ...


def to_finished_request(timer: RequestTimer, clock: UnixOffset) -> FinishedRequest:
    """The request in Unix time, for the span builder (on the emitter's thread, or on the node
    agent's for timers it received)."""
    offset = clock.offset_ns()  # one clock check per request, not one per timestamp
    end_ns = timer.end_ns if timer.end_ns is not None else timer.arrival_ns
    if timer.preempted_since_ns is not None:  # finished while evicted (aborted)
        timer.preempted_ns.append((timer.preempted_since_ns, end_ns))
    tokens = timer.token_ns
    first = tokens[0] if tokens else None
    finished = FinishedRequest(
        trace_id=timer.trace_id,
        parent_span_id=timer.parent_span_id,
        span_id=timer.span_id,
        prefill_span_id=timer.prefill_span_id,
        request_id=timer.request_id,
        model=str(timer.attributes.get("model", "unknown")),
        operation=str(timer.attributes.get("operation", "unknown")),
        arrival_ns=timer.arrival_ns + offset,
        end_ns=end_ns + offset,
        queued_ns=None if timer.queued_ns is None else timer.queued_ns + offset,
        first_scheduled_ns=None
        if timer.first_scheduled_ns is None
        else timer.first_scheduled_ns + offset,
        first_token_ns=None if first is None else first + offset,
        last_token_ns=None if first is None else tokens[-1] + offset,
        token_offsets_us=[] if first is None else [(t - first) // _NS_PER_US for t in tokens],
        prefill_chunks=[
            PrefillChunk(s + offset, e + offset, n) for s, e, n in timer.prefill_chunks
        ],
        preempted=[(s + offset, e + offset) for s, e in timer.preempted_ns],
        status_error=timer.status_error,
        ready_ns=None if timer.ready_ns is None else timer.ready_ns + offset,
        cold_start_link=timer.cold_start_link,
    )
    for name, value in timer.attributes.items():
        if name not in ("model", "operation") and hasattr(finished, name):
            setattr(finished, name, value)
    prompt_ids = timer.attributes.get(PROMPT_TOKEN_IDS)
    if prompt_ids is not None and finished.prefix_hash is None:
        finished.prefix_hash = prompt_prefix_hash(prompt_ids)
    return finished


def _last_seen_ns(timer: RequestTimer) -> int:
    """The latest event recorded for ``timer``."""
    seen = [timer.arrival_ns]
    if timer.queued_ns is not None:
        seen.append(timer.queued_ns)
    if timer.first_scheduled_ns is not None:
        seen.append(timer.first_scheduled_ns)
    if timer.token_ns:
        seen.append(timer.token_ns[-1])
    if timer.prefill_chunks:
        seen.append(timer.prefill_chunks[-1][1])
    if timer.preempted_ns:
        seen.append(timer.preempted_ns[-1][1])
    if timer.preempted_since_ns is not None:
        seen.append(timer.preempted_since_ns)
    return max(seen)


class Recorder:
    """In-flight requests by id. ``begin`` and ``finish`` run on the serving path: a dict
    operation each, bounded by ``max_in_flight`` (beyond it requests go untraced, counted).

    Timers whose end is never reported (a request dropped outside the instrumented paths, a
    disabled hook) would otherwise hold a slot for good: every 256th ``begin`` (and any ``begin``
    that finds the table full) finishes the oldest timers older than ``max_age_s`` with error
    ``"expired: no end seen"``, counted in ``expired_requests``. Dicts keep insertion order, so
    the oldest are first and a sweep stops at the first younger one. ``max_age_s`` must exceed
    the longest request served: a request still running past it is ended (its later events are
    ignored).
    """

    def __init__(
        self,
        sink: Callable[[RequestTimer], None],
        *,
        max_in_flight: int = _DEFAULT_MAX_IN_FLIGHT,
        max_age_s: float = _DEFAULT_MAX_AGE_S,
        monotonic_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self._sink = sink
        self._max_in_flight = max_in_flight
        self._max_age_ns = int(max_age_s * _NS_PER_S)
        self.clock = monotonic_ns
        self._in_flight: dict[str, RequestTimer] = {}
        self.get: Final[Callable[[str], RequestTimer | None]] = self._in_flight.get
        """The open timer of a request id, or None: the dict's own method, because the hooks
        call it per streamed output (no Python frame of ours around it)."""
        self._begins = 0
        self.untraced_requests = 0
        """Requests not traced because max_in_flight timers were open."""
        self.expired_requests = 0
        """Timers finished by expiry: no end was reported within max_age_s."""
        seconds = self._seconds
        self._untraced_warning = RateLimitedWarning(
            seconds, interval_s=_DROP_WARNING_INTERVAL_S, log=_log
        )
        self._expired_warning = RateLimitedWarning(
            seconds, interval_s=_DROP_WARNING_INTERVAL_S, log=_log
        )

    def _seconds(self) -> float:
        return self.clock() / _NS_PER_S

    def begin(self, request_id: str, *, arrival_ns: int | None = None) -> RequestTimer | None:
        self._begins += 1
        full = len(self._in_flight) >= self._max_in_flight
        if full or not self._begins & (_EXPIRY_SWEEP_EVERY - 1):
            self._expire()
            full = len(self._in_flight) >= self._max_in_flight
        if full:
            self.untraced_requests += 1
            self._untraced_warning.warn(
                "tokentrace: %d requests untraced so far (untraced_requests): %d requests in "
                "flight reached max_in_flight (TOKENTRACE_MAX_IN_FLIGHT)",
                self.untraced_requests,
                self._max_in_flight,
            )
            return None
        timer = RequestTimer(request_id, self.clock() if arrival_ns is None else arrival_ns)
        self._in_flight[request_id] = timer
        return timer

    def _expire(self) -> None:
        now = self.clock()
        deadline = now - self._max_age_ns
        expired: list[RequestTimer] = []
        try:
            for timer in self._in_flight.values():
                if timer.arrival_ns > deadline or len(expired) >= _EXPIRY_MAX_PER_SWEEP:
                    break
                expired.append(timer)
        except RuntimeError:  # another serving thread changed the dict: expire what was seen
            pass
        count = 0
        for timer in expired:
            # Only if still there: it may have finished (or been replaced) meanwhile.
            if self._in_flight.get(timer.request_id) is not timer:
                continue
            self._in_flight.pop(timer.request_id, None)
            timer.end_ns = _last_seen_ns(timer)  # not now: that would add max_age_s of nothing
            timer.status_error = EXPIRED_ERROR
            self._sink(timer)
            count += 1
        if count:
            self.expired_requests += count
            self._expired_warning.warn(
                "tokentrace: %d requests expired so far (expired_requests): no end was seen "
                "within max_age_s=%g s",
                self.expired_requests,
                self._max_age_ns / _NS_PER_S,
            )

    def finish(
        self, request_id: str, *, status_error: str | None = None, end_ns: int | None = None
    ) -> None:
        """End the request now, or at ``end_ns`` (a clock reading taken earlier: an
        instrumentation that does its bookkeeping after the host's call returned)."""
        timer = self._in_flight.pop(request_id, None)
        if timer is None:
            return
        timer.end_ns = self.clock() if end_ns is None else end_ns
        if status_error is not None:
            timer.status_error = status_error
        self._sink(timer)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)
