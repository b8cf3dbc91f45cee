"""Finished requests -> spans -> OTLP bytes, once per request, on one background thread.

The serving path only calls ``submit`` (a length check, a deque append and a flag read). The
emitter's thread (started by the first ``submit``) sleeps until something is queued, then every
``interval_s`` (until an interval brings nothing) takes the batch that gathered, converts the
finished timers to Unix time, builds and encodes their spans in one batch
(``span_encoding.SpanBatchEncoder``) and hands the bytes to ``send``: in the agent the OTLP
sender's ``send_now``, which exports them on this thread, like the OpenTelemetry SDK's
``BatchSpanProcessor`` (a second thread to hand them to would be woken once per batch, which
costs the waker, holding the GIL, a context switch on a busy machine). Bounded: a full queue
drops the new request and counts it, so a stalled exporter (this thread waits in its retries
meanwhile) never grows the host's memory; a sender without room (``has_room``) makes the
emitter drop batches before encoding them.

With the node agent's local socket (``local_relay``; ``TOKENTRACE_NODE_SOCKET``), a batch goes
there as the integers the serving path recorded: the node agent converts, builds and encodes it,
and this thread does none of that. Whenever the socket cannot take a batch, it is exported here.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tokentrace.agent.local_relay import (
    ACK_BUSY,
    LocalRelayClient,
    RelayRefused,
    RelayUnreachable,
)
from tokentrace.agent.otlp_export import RateLimitedWarning
from tokentrace.agent.recorder import MonotonicToUnix, RequestTimer, to_finished_request
from tokentrace.agent.span_encoding import SpanBatchEncoder
from tokentrace.agent.spans import DEFAULT_MAX_TOKEN_OFFSETS, DeferredSpans, SpanJob

_log = logging.getLogger(__name__)

_DEFAULT_MAX_QUEUE = 8192
_DEFAULT_MAX_BATCH = 256
_DEFAULT_INTERVAL_S = 0.2
_DROP_WARNING_INTERVAL_S = 60.0

Send = Callable[[bytes, int], bool]
"""Export (or queue) one encoded export request of N spans; False when it was not taken."""
HasRoom = Callable[[int], bool]
"""Whether the sender would take N more spans now (``OtlpSender.has_room``)."""


class SpanEmitter:
    """Turns finished ``RequestTimer``s into encoded OTLP span batches on its own thread.

    The thread starts on the first ``submit`` (in a forked child too, whose queue starts empty):
    a process that never finishes a request never runs one.
    """

    def __init__(
        self,
        send: Send,
        *,
        resource_attributes: Mapping[str, Any],
        scope_name: str,
        scope_version: str = "",
        max_queue: int = _DEFAULT_MAX_QUEUE,
        max_batch: int = _DEFAULT_MAX_BATCH,
        interval_s: float = _DEFAULT_INTERVAL_S,
        max_token_offsets: int = DEFAULT_MAX_TOKEN_OFFSETS,
        to_unix: MonotonicToUnix | None = None,
        has_room: HasRoom | None = None,
        relay: LocalRelayClient | None = None,
    ) -> None:
        """``has_room``: checked before a batch is encoded (with its request count, a lower
        bound of its spans); when it says no, the batch is dropped unencoded. ``relay``: the
        node agent's local socket; batches go there as plain data while it answers, and are
        encoded and sent here otherwise."""
        self._send = send
        self._relay = relay
        self._has_room = has_room
        self._encoder = SpanBatchEncoder(
            resource_attributes=resource_attributes,
            scope_name=scope_name,
            scope_version=scope_version,
            max_token_offsets=max_token_offsets,
        )
        self._max_queue = max_queue
        self._max_batch = max_batch
        self._interval_s = interval_s
        self._clock = to_unix or MonotonicToUnix()
        # Each counter has one writer: the serving path (dropped_queue_full) or the emitter thread.
        self.handed_to_sender_requests = 0
        """Requests whose spans the sender accepted for export (not necessarily delivered: the
        sender's ``sent_spans`` / ``dropped_spans`` say what became of them)."""
        self.handed_to_sender_spans = 0
        self.handed_to_node_requests = 0
        """Requests the node agent took over the local socket (it builds and sends their spans)."""
        self.dropped_queue_full = 0
        """Finished requests dropped on the serving path: ``max_queue`` were already waiting
        (or the emitter was shut down)."""
        self.dropped_unsent = 0
        """Requests dropped because the sender had no room or refused the batch."""
        self.dropped_unencodable = 0
        """Requests whose spans could not be built or encoded."""
        self.failed_batches = 0
        self._queue_full_warning = RateLimitedWarning(interval_s=_DROP_WARNING_INTERVAL_S, log=_log)
        self._unsent_warning = RateLimitedWarning(interval_s=_DROP_WARNING_INTERVAL_S, log=_log)
        self._unencodable_warning = RateLimitedWarning(
            interval_s=_DROP_WARNING_INTERVAL_S, log=_log
        )
        self._init_worker_state()
        # A forked child (e.g. a server's worker processes) gets a fresh queue and no thread:
        # threads do not survive fork, and the parent's queue is the parent's to send.
        reference = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _reinit_in_child(reference))

    def _init_worker_state(self) -> None:
        self._queue: deque[RequestTimer | SpanJob | DeferredSpans] = deque()
        self._wake = threading.Event()
        """Set when something is queued (and by flush/shutdown): the thread sleeps until then."""
        self._hurry = threading.Event()
        """Set by flush/shutdown: ends the wait that lets a batch gather."""
        self._drained = threading.Event()
        self._start_lock = threading.Lock()
        self._stopped = False
        self._worker: threading.Thread | None = None

    def _ensure_worker(self) -> bool:
        """Start the thread unless running; False when it could not be started."""
        with self._start_lock:
            if self._worker is None:
                worker = threading.Thread(target=self._run, name="tokentrace-emitter", daemon=True)
                try:
                    worker.start()
                except RuntimeError:  # interpreter shutting down, or out of threads
                    return False
                self._worker = worker
        return True

    # --- serving path ------------------------------------------------------------------------
    def submit(self, timer: RequestTimer | SpanJob | DeferredSpans) -> None:
        """Queue a finished request's timer, or other spans (engine steps, cold start) planned
        already or, deferred, planned on the emitter's thread; each counts as one request."""
        if len(self._queue) >= self._max_queue or self._stopped:
            self.dropped_queue_full += 1
            self._queue_full_warning.warn(
                "tokentrace: %d finished requests dropped so far (emitter.dropped_queue_full): "
                "%d were waiting for the emitter (max_queue, TOKENTRACE_MAX_QUEUE)",
                self.dropped_queue_full,
                self._max_queue,
            )
            return
        self._queue.append(timer)
        # Appended before the check, and the thread clears before it drains: a set flag means
        # the thread is yet to drain, so this request is never left behind.
        if not self._wake.is_set():
            self._wake.set()
        if self._worker is None:
            self._ensure_worker()

    # --- emitter thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopped:
            # No timeout: a process with nothing to emit never wakes this thread (a periodic
            # wake-up costs the serving threads a GIL hand-off each time).
            self._wake.wait()
            # Then intervals for batches to gather, each ended by its timer: one wake-up per
            # interval under load. Only a drain that found nothing parks the thread again, so a
            # serving thread wakes it once per idle spell, not once per batch (the wake-up
            # happened on the serving thread, which sampled at 0.2 % of vLLM's API server).
            while True:
                self._hurry.wait(self._interval_s)
                self._hurry.clear()
                self._wake.clear()
                drained = self._drain()
                self._drained.set()
                if not drained or self._stopped:
                    break

    def _drain(self) -> int:
        """Encode and hand over everything queued; how many items it took."""
        taken = 0
        while self._queue:
            batch: list[RequestTimer | SpanJob | DeferredSpans] = []
            while self._queue and len(batch) < self._max_batch:
                batch.append(self._queue.popleft())
            taken += len(batch)
            timers: list[RequestTimer] = []
            jobs: list[SpanJob] = []
            for item in batch:
                if type(item) is RequestTimer:
                    timers.append(item)
                elif type(item) is SpanJob:
                    jobs.append(item)
                else:
                    jobs += self._plan(item)  # type: ignore[arg-type]
            relay = self._relay
            if (
                relay is not None
                and relay.available
                and self._hand_to_node(relay, timers, jobs, len(batch))
            ):
                continue
            self._export(timers, jobs, len(batch))
        return taken

    def _hand_to_node(
        self,
        relay: LocalRelayClient,
        timers: list[RequestTimer],
        jobs: list[SpanJob],
        requests: int,
    ) -> bool:
        """The batch (``requests`` items) as plain data to the node agent, which builds its
        spans; False when it was not delivered (the caller exports it by OTLP)."""
        if not timers and not jobs:
            return True  # deferred jobs that planned no spans: nothing to hand over
        try:
            relay.send(timers, jobs, self._clock.offset_ns())
        except (RelayUnreachable, TypeError, ValueError, OverflowError):
            return False  # not sent (unreachable, or a value a frame cannot carry)
        except RelayRefused as refused:
            if refused.answer == ACK_BUSY:
                self._count_unsent(requests)
            else:
                self._count_unencodable(requests, exc_info=False)
            return True
        except OSError:  # written, then the socket failed: taken or not, unknown; never twice
            self._count_unsent(requests)
            return True
        self.handed_to_node_requests += requests
        return True

    def _export(self, timers: list[RequestTimer], jobs: list[SpanJob], requests: int) -> None:
        """Encode the batch's spans here and hand them to ``send`` (the OTLP sender)."""
        if self._has_room is not None and not self._has_room(requests):
            self._count_unsent(requests)  # endpoint down or slow: do not encode for nothing
            return
        try:
            clock = self._clock
            finished_requests = [to_finished_request(timer, clock) for timer in timers]
            skipped_before = self._encoder.skipped
            payload, spans = self._encoder.encode(finished_requests, jobs)
            skipped = self._encoder.skipped - skipped_before
        except Exception:  # a bad timer must not stop the emitter
            self.failed_batches += 1
            self._count_unencodable(requests, exc_info=True)
            return
        if skipped:  # the encoder left out what it could not encode
            self._count_unencodable(skipped, exc_info=False)
        if not spans:
            return
        if self._send(payload, spans):
            self.handed_to_sender_requests += requests - skipped
            self.handed_to_sender_spans += spans
        else:
            self._count_unsent(requests - skipped)

    def _plan(self, deferred: DeferredSpans) -> Sequence[SpanJob]:
        try:
            return deferred()
        except Exception:  # one bad job must not cost the batch its spans
            self._count_unencodable(1, exc_info=True)
            return ()

    def _count_unsent(self, requests: int) -> None:
        self.dropped_unsent += requests
        self._unsent_warning.warn(
            "tokentrace: %d finished requests dropped so far (emitter.dropped_unsent): the OTLP "
            "sender's queue was full or closed (OTLP exporter queue_size; see sender.stats), or "
            "the node agent's socket was busy or failed after a batch was written",
            self.dropped_unsent,
        )

    def _count_unencodable(self, requests: int, *, exc_info: bool) -> None:
        self.dropped_unencodable += requests
        self._unencodable_warning.warn(
            "tokentrace: %d finished requests dropped so far (emitter.dropped_unencodable): "
            "their spans could not be built or encoded",
            self.dropped_unencodable,
            exc_info=exc_info,
        )

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Emit everything queued now (from any thread); True when it was sent in time."""
        if self._worker is None and not self._queue:
            return True  # never started: nothing queued, nothing in progress
        if not self._ensure_worker():
            return False
        self._drained.clear()
        self._hurry.set()
        self._wake.set()
        return self._drained.wait(timeout_s) and not self._queue

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self.flush(timeout_s)
        self._stopped = True
        self._hurry.set()
        self._wake.set()
        if self._worker is not None:
            self._worker.join(timeout_s)
        if self._relay is not None:
            self._relay.close()

    def stats(self) -> dict[str, int]:
        """``handed_to_sender_*``: accepted by the sender's queue, not delivered (the sender's
        own stats count deliveries); ``dropped_*``: finished requests lost, by cause."""
        stats: dict[str, int] = {
            "handed_to_sender_requests": self.handed_to_sender_requests,
            "handed_to_sender_spans": self.handed_to_sender_spans,
            "handed_to_node_requests": self.handed_to_node_requests,
            "dropped_queue_full": self.dropped_queue_full,
            "dropped_unsent": self.dropped_unsent,
            "dropped_unencodable": self.dropped_unencodable,
            "failed_batches": self.failed_batches,
            "queued_requests": len(self._queue),
        }
        if self._relay is not None:
            stats["node_socket_connects"] = self._relay.connects
            stats["node_socket_failures"] = self._relay.failures
        return stats


def _reinit_in_child(reference: weakref.ref[SpanEmitter]) -> None:
    emitter = reference()
    if emitter is not None:
        emitter._init_worker_state()
