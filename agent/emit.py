"""Finished requests -> spans -> OTLP bytes, once per request, on one background thread.

The serving path only calls ``submit`` (a length check and a deque append). The emitter's thread
wakes every ``interval_s``, converts the finished timers to Unix time, builds and encodes their
spans in one batch (``spans.encode_recordings``) and hands the bytes to ``send`` (the OTLP
sender's non-blocking ``submit``). Bounded: a full queue drops the new request and counts it, so
a stalled exporter never grows the host's memory.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from tokentrace.agent.recorder import ClockDomain, RequestTimer, to_recording
from tokentrace.agent.spans import DEFAULT_MAX_TOKEN_OFFSETS, RecordingEncoder

_log = logging.getLogger(__name__)

_DEFAULT_MAX_QUEUE = 8192
_DEFAULT_MAX_BATCH = 256
_DEFAULT_INTERVAL_S = 0.2

Send = Callable[[bytes, int], bool]
"""Queue one encoded export request of N spans; False when it could not be queued."""


class SpanEmitter:
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
        clock_domain: ClockDomain | None = None,
    ) -> None:
        self._send = send
        self._encoder = RecordingEncoder(
            resource_attributes=resource_attributes,
            scope_name=scope_name,
            scope_version=scope_version,
            max_token_offsets=max_token_offsets,
        )
        self._max_queue = max_queue
        self._max_batch = max_batch
        self._interval_s = interval_s
        self._clock = clock_domain or ClockDomain()
        self.emitted_requests = 0
        self.emitted_spans = 0
        self.dropped_requests = 0
        """Finished requests lost: the queue was full, or their export could not be queued."""
        self.failed_batches = 0
        self._start_worker()
        # A forked child (e.g. a server's worker processes) gets a fresh queue and thread:
        # threads do not survive fork, and the parent's queue is the parent's to send.
        reference = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _restart_in_child(reference))

    def _start_worker(self) -> None:
        self._queue: deque[RequestTimer] = deque()
        self._wake = threading.Event()
        self._drained = threading.Event()
        self._stopped = False
        self._worker = threading.Thread(target=self._run, name="tokentrace-emitter", daemon=True)
        self._worker.start()

    # --- serving path ------------------------------------------------------------------------
    def submit(self, timer: RequestTimer) -> None:
        if len(self._queue) >= self._max_queue or self._stopped:
            self.dropped_requests += 1
            return
        self._queue.append(timer)

    # --- emitter thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait(self._interval_s)
            self._wake.clear()
            self._drain()
            self._drained.set()

    def _drain(self) -> None:
        while self._queue:
            batch: list[RequestTimer] = []
            while self._queue and len(batch) < self._max_batch:
                batch.append(self._queue.popleft())
            try:
                recordings = [to_recording(timer, self._clock) for timer in batch]
                skipped_before = self._encoder.recordings_skipped
                payload, spans = self._encoder.encode(recordings)
                skipped = self._encoder.recordings_skipped - skipped_before
            except Exception:  # a bad timer must not stop the emitter
                self.failed_batches += 1
                self.dropped_requests += len(batch)
                _log.warning("tokentrace: could not build spans for %d requests", len(batch))
                continue
            self.dropped_requests += skipped  # the encoder left out what it could not encode
            if not spans:
                continue
            if self._send(payload, spans):
                self.emitted_requests += len(batch) - skipped
                self.emitted_spans += spans
            else:
                self.dropped_requests += len(batch) - skipped

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Emit everything queued now (from any thread); True when it was sent in time."""
        self._drained.clear()
        self._wake.set()
        return self._drained.wait(timeout_s) and not self._queue

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self.flush(timeout_s)
        self._stopped = True
        self._wake.set()
        self._worker.join(timeout_s)

    def stats(self) -> dict[str, int]:
        return {
            "emitted_requests": self.emitted_requests,
            "emitted_spans": self.emitted_spans,
            "dropped_requests": self.dropped_requests,
            "failed_batches": self.failed_batches,
            "queued_requests": len(self._queue),
        }


def _restart_in_child(reference: weakref.ref[SpanEmitter]) -> None:
    emitter = reference()
    if emitter is not None:
        emitter._start_worker()
