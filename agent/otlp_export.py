"""OTLP export of pre-encoded requests: a bounded queue, one worker thread, retry with backoff.

The one implementation of sending OTLP upstream, used by the in-process agent and by the
collector (which imports it; this module never imports the collector). Modelled on the
OpenTelemetry Python SDK's ``BatchSpanProcessor`` (bounded queue drained by a daemon worker
thread, re-initialised after ``fork``) and the OpenTelemetry Collector's ``exporterhelper`` (a
sending queue bounded in items, ``retry_on_failure`` with exponential backoff and jitter,
``max_elapsed_time``).

``OtlpSender.submit()`` never blocks the calling (serving) thread on the network and never raises:
the bytes of one serialised ``Export*ServiceRequest`` go to a bounded queue; when it is full they
are dropped and counted. The worker thread sends one request at a time over gRPC (the
pre-serialised bytes through a raw unary call; ``grpc`` is imported only then) or OTLP/HTTP
(``application/x-protobuf``, gzip), retries retryable failures and counts everything it could not
deliver. A caller with a thread of its own (the agent's span emitter) sends on it instead
(``send_now``: the same retry and counting, no second thread to wake). Configuration
(``OtlpExporterConfig``, ``OTEL_EXPORTER_OTLP_*``) is ``otlp_config``'s; the gRPC and HTTP
transports, one attempt each, are ``otlp_transport``'s.

A misconfigured endpoint (OTLP/HTTP sent to a gRPC port, TLS against plain text or the reverse,
a path with no OTLP receiver: see ``otlp_transport``) is not retried: the first answer that shows
it is logged once, in one line naming the setting to change, and for
``_MISCONFIGURATION_RECHECK_S`` after it every batch is dropped (counted in ``dropped_<items>``)
without touching the network; then one batch tries again.
"""

from __future__ import annotations

import logging
import math
import os
import random
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from typing import Final

from tokentrace.agent.otlp_config import (
    SIGNAL_SPECS,
    TOKENTRACE_VERSION,
    OtlpExporterConfig,
    Signal,
)
from tokentrace.agent.otlp_transport import SendResult, Transport, make_transport

logger = logging.getLogger(__name__)

_DEFAULT_FLUSH_TIMEOUT_S: Final = 10.0
_DEFAULT_SHUTDOWN_TIMEOUT_S: Final = 10.0
_DEFAULT_USER_AGENT: Final = f"tokentrace-agent/{TOKENTRACE_VERSION or 'dev'}"

_RETRY_MULTIPLIER: Final = 1.5
"""Backoff growth per retry (the Collector's exporterhelper value)."""
_RETRY_JITTER: Final = 0.5
"""Each delay is drawn uniformly from ``interval * [1 - jitter, 1 + jitter]``."""
_DROP_WARNING_INTERVAL_S: Final = 10.0
"""At most one drop warning per sender in this many seconds; the counters carry the rest."""
SHUTDOWN_ABORT_GRACE_S: Final = 1.0
"""After its shutdown timeout, how long a sender waits for its cancelled call in flight to
unwind: whoever waits for a sender's shutdown waits this much beyond the timeout."""
_MISCONFIGURATION_RECHECK_S: Final = 30.0
"""After a misconfigured endpoint answered, batches are dropped unsent for this long; then the
next one is tried (the endpoint may have been fixed, e.g. the right server started on it)."""


# --- the queue + worker + retry -------------------------------------------------------------------
class RateLimitedWarning:
    """Logs a warning the first time, then at most once per ``interval_s``, and says how many
    were suppressed: for drop counters, whose totals travel in ``stats()``. Safe to call from
    any thread; a forked child gets a fresh lock (the parent's may have been held at fork)."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        *,
        interval_s: float = _DROP_WARNING_INTERVAL_S,
        log: logging.Logger | None = None,
    ) -> None:
        """``clock``: seconds, monotonic; ``log``: this module's logger when None."""
        self._clock = clock
        self._interval_s = interval_s
        self._log = log or logger
        self._lock = threading.Lock()
        self._last = -math.inf
        self._suppressed = 0
        if hasattr(os, "register_at_fork"):
            reference = weakref.ref(self)

            def after_in_child() -> None:
                warning = reference()
                if warning is not None:
                    warning.reinit_after_fork()

            os.register_at_fork(after_in_child=after_in_child)

    def reinit_after_fork(self) -> None:
        self._lock = threading.Lock()

    def warn(self, message: str, *args: object, exc_info: bool = False) -> None:
        """``exc_info``: attach the exception being handled, when this one is logged."""
        with self._lock:
            now = self._clock()
            if now - self._last < self._interval_s:
                self._suppressed += 1
                return
            self._last = now
            suppressed, self._suppressed = self._suppressed, 0
        if suppressed:
            message += " (%d similar warnings suppressed)"
            args += (suppressed,)
        self._log.warning(message, *args, exc_info=exc_info)


class OtlpSender:
    """Sends serialised OTLP export requests of one signal from a bounded queue on one worker
    thread, with retry; the caller's side never blocks on the network and never raises.

    The queue is bounded in items (spans or data points), not requests. Each submitted payload
    is one complete ``ExportTraceServiceRequest`` / ``ExportMetricsServiceRequest`` and travels as
    one request; batching is the caller's. The worker thread starts on the first submission and
    is re-created after ``fork`` in the child, whose queue starts empty (the parent sends what it
    had queued). A sender without an endpoint for its signal is disabled: it takes nothing.
    """

    def __init__(
        self,
        config: OtlpExporterConfig,
        *,
        signal: Signal,
        user_agent: str = _DEFAULT_USER_AGENT,
        clock: Callable[[], float] | None = None,
        sleep: Callable[[float], None] | None = None,
        random_fraction: Callable[[], float] | None = None,
    ) -> None:
        """Raises ValueError for an invalid ``config`` or ``signal``. ``clock``/``sleep``/
        ``random_fraction`` (in [0, 1), for jitter) are for tests."""
        if signal not in SIGNAL_SPECS:
            raise ValueError(f"signal: {signal!r} is not one of {tuple(SIGNAL_SPECS)}")
        config.validate()
        self._config = config
        self._signal = SIGNAL_SPECS[signal]
        self._endpoint = config.endpoint_for(signal)
        self._user_agent = user_agent
        self._clock = clock or time.monotonic
        self._sleep = sleep or self._interruptible_sleep
        self._random_fraction = random_fraction or random.random
        self._warning = RateLimitedWarning(self._clock)
        self._sent = 0
        self._dropped = 0
        self._rejected = 0
        self._retries = 0
        self._closed = False
        self._misconfiguration: str | None = None
        self._misconfiguration_logged: str | None = None
        self._recheck_at = -math.inf
        self._init_runtime_state()
        if hasattr(os, "register_at_fork"):
            reinit = weakref.WeakMethod(self._after_fork_in_child)

            def after_in_child() -> None:
                method = reinit()
                if method is not None:
                    method()

            os.register_at_fork(after_in_child=after_in_child)

    def _init_runtime_state(self) -> None:
        """Locks, queue, worker and connection: everything a forked child must not inherit."""
        self._lock = threading.Lock()
        self._work_ready = threading.Condition(self._lock)
        self._idle = threading.Condition(self._lock)
        self._queue: deque[tuple[bytes, int]] = deque()
        self._queued_items = 0
        self._in_flight_items = 0
        self._in_flight_abandoned = False
        self._aborted = False
        self._abort_event = threading.Event()
        self._worker: threading.Thread | None = None
        self._transport: Transport | None = None

    def _after_fork_in_child(self) -> None:
        # The parent's connection and thread do not exist here; never close the inherited channel.
        self._init_runtime_state()
        # (self._warning re-creates its own lock in the child: see RateLimitedWarning.)

    @property
    def endpoint(self) -> str | None:
        """Where requests go; None when the configuration has none for this signal."""
        return self._endpoint

    @property
    def misconfiguration(self) -> str | None:
        """What is wrong with the endpoint, when its last answer showed a misconfiguration
        (batches are then dropped without sending, see the module docstring); else None."""
        return self._misconfiguration

    @property
    def enabled(self) -> bool:
        """False without an endpoint for this signal: ``submit`` takes nothing, counts nothing."""
        return self._endpoint is not None

    # --- caller side (serving/pipeline thread): never blocks on the network, never raises -----
    def has_room(self, items: int) -> bool:
        """Whether ``items`` more would fit now: a cheap pre-check before serialising (then
        ``count_dropped`` what did not fit); ``submit`` decides for good."""
        return (
            self._endpoint is not None
            and not self._closed
            and self._queued_items + items <= self._config.queue_size
        )

    def submit(self, payload: bytes, items: int) -> bool:
        """Queue one serialised export request carrying ``items`` spans or data points. False
        when it was not taken: counted as dropped (queue full, sender shut down), or the sender
        is disabled (not counted)."""
        if self._endpoint is None:
            return False
        with self._lock:
            if self._closed:
                reason = "sender shut down"
            elif self._queued_items + items > self._config.queue_size:
                reason = "queue full"
            elif self._worker is None and not self._start_worker():
                reason = "no worker thread"
            else:
                self._queue.append((payload, items))
                self._queued_items += items
                self._work_ready.notify()
                return True
            self._dropped += items
        self._warn_dropped(items, reason)
        return False

    def send_now(self, payload: bytes, items: int) -> bool:
        """Deliver one serialised export request on the calling thread, with the retry and the
        counting of a submitted one: for a caller with a worker thread of its own (the agent's
        span emitter), which then wakes no second thread. Waking one costs the waker, holding
        the GIL, a context switch on a busy machine (~0.5 % of vLLM's API server's samples,
        docs/performance.md). Blocks for up to the retry budget (``retry.max_elapsed_s`` and one
        ``timeout_s``); ``shutdown`` cancels it. False when not sent: the sender was shut down
        (counted as dropped) or is disabled (not counted)."""
        if self._endpoint is None:
            return False
        with self._lock:
            closed = self._closed
            if not closed:
                self._in_flight_items += items
        if closed:
            self.count_dropped(items, "sender shut down")
            return False
        self._deliver(payload, items)
        return True

    def count_dropped(self, items: int, reason: str | None = None) -> None:
        """Count ``items`` the caller gave up before submitting them (``has_room`` said no, or
        encoding failed); ``reason`` None: why ``has_room`` said no."""
        if reason is None:
            reason = "sender shut down" if self._closed else "queue full"
        with self._lock:
            self._dropped += items
        self._warn_dropped(items, reason)

    def take_queued(self) -> list[tuple[bytes, int]]:
        """Remove and return the payloads waiting to be sent, oldest first, as ``(payload,
        items)``, without counting them dropped: for a caller that sends them elsewhere. The
        request in flight is not among them; it finishes or fails as it would."""
        with self._lock:
            taken = list(self._queue)
            self._queue.clear()
            self._queued_items = 0
            self._idle.notify_all()  # force_flush waits for an empty queue
        return taken

    def _warn_dropped(self, items: int, reason: str) -> None:
        self._warning.warn(
            "OTLP %s export to %s dropped %d %s: %s",
            self._signal.name,
            self._endpoint,
            items,
            self._signal.item,
            reason,
        )

    def stats(self) -> dict[str, int]:
        """``sent_<items>``, ``dropped_<items>``, ``rejected_<items>`` (items: ``spans`` or
        ``data_points``; rejected: refused by the server in a partial success), ``retries`` and
        ``queue_len`` (items waiting, not counting the request in flight)."""
        item = self._signal.item
        with self._lock:
            return {
                f"sent_{item}": self._sent,
                f"dropped_{item}": self._dropped,
                f"rejected_{item}": self._rejected,
                "retries": self._retries,
                "queue_len": self._queued_items,
            }

    def force_flush(self, timeout_s: float = _DEFAULT_FLUSH_TIMEOUT_S) -> bool:
        """Wait until everything queued so far was sent or given up; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._queue or self._in_flight_items:
                # (A request in flight without a worker is a ``send_now`` caller's.)
                if self._queue and (self._worker is None or not self._worker.is_alive()):
                    return False
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._idle.wait(remaining)
        return True

    def shutdown(self, timeout_s: float = _DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
        """Send what can be sent within ``timeout_s``, then drop and count the rest. Later
        submissions are dropped and counted. Idempotent."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if self._closed:
                return
            self._closed = True
            worker = self._worker
            self._work_ready.notify_all()
        if worker is not None:
            worker.join(max(0.0, deadline - time.monotonic()))
        if (worker is not None and worker.is_alive()) or not self._idle_by(deadline):
            # Out of time: stop retrying, cancel the call in flight, count what is left.
            with self._lock:
                self._aborted = True
                left = self._queued_items
                self._dropped += left
                self._queue.clear()
                self._queued_items = 0
                transport = self._transport
            self._abort_event.set()
            if transport is not None:
                transport.close()
            if worker is not None:
                worker.join(SHUTDOWN_ABORT_GRACE_S)
            self._idle_by(time.monotonic() + SHUTDOWN_ABORT_GRACE_S)
            with self._lock:
                if self._in_flight_items:  # the sending thread is stuck; it will not count these
                    left += self._in_flight_items
                    self._dropped += self._in_flight_items
                    self._in_flight_items = 0
                    self._in_flight_abandoned = True
            if left:
                self._warn_dropped(left, f"shutdown timeout ({timeout_s} s)")
        with self._lock:
            transport, self._transport = self._transport, None
        if transport is not None:
            transport.close()

    def _idle_by(self, deadline: float) -> bool:
        """Wait until no request is in flight (the worker's or a ``send_now`` caller's) or the
        ``time.monotonic()`` deadline passes; whether none is."""
        with self._lock:
            while self._in_flight_items:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._idle.wait(remaining)
        return True

    # --- worker thread ----------------------------------------------------------------------
    def _start_worker(self) -> bool:
        """Start the worker (the lock is held); False, logged, when no thread can be started."""
        worker = threading.Thread(
            target=self._run,
            name=f"tokentrace-otlp-{self._signal.name}-sender",
            daemon=True,  # like the SDK: never keeps the process alive; shutdown() flushes
        )
        try:
            worker.start()
        except RuntimeError:  # e.g. "can't start new thread": drop, and try again next time
            logger.exception("OTLP %s export: could not start the sender thread", self._signal.name)
            return False
        self._worker = worker
        return True

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._work_ready.wait()
                if not self._queue:
                    return  # closed and drained
                payload, items = self._queue.popleft()
                self._queued_items -= items
                self._in_flight_items += items
            self._deliver(payload, items)

    def _deliver(self, payload: bytes, items: int) -> None:
        """Send one request counted in ``_in_flight_items``; count how it ended."""
        rejected: int | None = None
        try:
            rejected = self._send_with_retry(payload, items)
        except Exception:  # the worker (or the caller's thread) must survive anything one does
            logger.exception("OTLP %s export: unexpected error", self._signal.name)
        with self._lock:
            if not self._in_flight_abandoned:  # else shutdown counted it as dropped already
                if rejected is None:
                    self._dropped += items
                else:
                    self._rejected += rejected
                    self._sent += items - rejected
                self._in_flight_items -= items
            self._idle.notify_all()

    def _get_transport(self) -> Transport:
        with self._lock:
            transport = self._transport
        if transport is None:
            assert self._endpoint is not None  # nothing is queued without one
            transport = make_transport(self._config, self._signal, self._endpoint, self._user_agent)
            with self._lock:
                self._transport = transport
        return transport

    def _send_with_retry(self, payload: bytes, items: int) -> int | None:
        """Deliver one request; the number of items the server rejected, or None if dropped."""
        if self._misconfiguration is not None and self._clock() < self._recheck_at:
            return None  # named once already; counted as dropped, nothing sent
        try:
            transport = self._get_transport()
        except Exception as error:  # e.g. grpc not installed: rate-limited, unlike the worker's
            self._warn_dropped(items, f"no connection: {error!r}")
            return None
        body = transport.prepare(payload)
        retry = self._config.retry
        started = self._clock()
        interval = retry.initial_interval_s
        attempts = 0
        while True:
            if self._aborted:
                return None
            attempts += 1
            outcome = transport.send(body, self._config.timeout_s)
            if outcome.misconfiguration:
                self._misconfigured(outcome.misconfiguration)
                return None
            if outcome.result is SendResult.SENT:
                if self._misconfiguration is not None:
                    self._misconfiguration = self._misconfiguration_logged = None
                    logger.info("OTLP %s export to %s works now", self._signal.name, self._endpoint)
                rejected = min(max(outcome.rejected, 0), items)
                if rejected:
                    self._warning.warn(
                        "OTLP %s export to %s: upstream rejected %d of %d %s: %s",
                        self._signal.name,
                        self._endpoint,
                        rejected,
                        items,
                        self._signal.item,
                        outcome.detail,
                    )
                return rejected
            if outcome.result is SendResult.PERMANENT or self._aborted:
                self._warn_dropped(items, outcome.detail)
                return None
            if outcome.retry_after_s is not None:
                delay = outcome.retry_after_s
            else:
                jitter = 1.0 + _RETRY_JITTER * (2.0 * self._random_fraction() - 1.0)
                delay = interval * jitter
            interval = min(interval * _RETRY_MULTIPLIER, retry.max_interval_s)
            if self._clock() - started + delay > retry.max_elapsed_s:
                self._warn_dropped(items, f"gave up after {attempts} attempts ({outcome.detail})")
                return None
            with self._lock:
                self._retries += 1
            self._sleep(delay)

    def _misconfigured(self, message: str) -> None:
        """The endpoint is misconfigured: say so once, drop without sending for a while."""
        self._misconfiguration = message
        self._recheck_at = self._clock() + _MISCONFIGURATION_RECHECK_S
        if message == self._misconfiguration_logged:
            return
        self._misconfiguration_logged = message
        logger.error(
            "OTLP %s export to %s is misconfigured: %s. Dropping %s without retrying (counted in "
            "dropped_%s); trying again every %d s",
            self._signal.name,
            self._endpoint,
            message,
            self._signal.item,
            self._signal.item,
            _MISCONFIGURATION_RECHECK_S,
        )

    def _interruptible_sleep(self, delay_s: float) -> None:
        self._abort_event.wait(delay_s)


def shut_down_together(shutdowns: Iterable[Callable[[float], object]], timeout_s: float) -> None:
    """Each sender's ``shutdown(timeout_s)`` on a thread of its own, all at once: they flush side
    by side, each within the same time. Returns once all have returned, or ``timeout_s`` and the
    senders' abort grace have passed."""
    deadline = time.monotonic() + timeout_s
    closers = [
        threading.Thread(
            target=shutdown, args=(timeout_s,), name="tokentrace-sender-shutdown", daemon=True
        )
        for shutdown in shutdowns
    ]
    for closer in closers:
        closer.start()
    for closer in closers:
        closer.join(max(0.0, deadline - time.monotonic()) + SHUTDOWN_ABORT_GRACE_S)
