from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tokentrace.agent import semconv
from tokentrace.agent.emit import SpanEmitter
from tokentrace.agent.recorder import Recorder, RequestTimer

RESOURCE = {semconv.SERVICE_NAME: "vllm-test"}


class Sent:
    def __init__(self, accept: bool = True) -> None:
        self.accept = accept
        self.payloads: list[tuple[bytes, int]] = []

    def __call__(self, payload: bytes, spans: int) -> bool:
        self.payloads.append((payload, spans))
        return self.accept

    def request_spans(self) -> list[str]:
        names = []
        for payload, _ in self.payloads:
            message = ExportTraceServiceRequest.FromString(payload)
            for resource_spans in message.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    names += [s.name for s in scope_spans.spans if s.name == semconv.SPAN_REQUEST]
        return names


def finished_timer(request_id: str, *, tokens: int = 4) -> RequestTimer:
    timer = RequestTimer(request_id, arrival_ns=1_000_000)
    timer.trace_id = os.urandom(16)
    timer.first_scheduled_ns = 2_000_000
    timer.token_ns.extend(3_000_000 + i * 1_000_000 for i in range(tokens))
    timer.end_ns = 3_000_000 + tokens * 1_000_000
    timer.attributes.update(model="m", operation="chat", output_tokens=tokens)
    return timer


def test_finished_requests_are_encoded_in_batches_off_the_serving_path() -> None:
    sent = Sent()
    emitter = SpanEmitter(sent, resource_attributes=RESOURCE, scope_name="t", interval_s=60)
    recorder = Recorder(emitter.submit)
    for index in range(3):
        timer = recorder.begin(f"r{index}")
        assert timer is not None
        timer.trace_id = os.urandom(16)
        timer.attributes.update(model="m", operation="chat")
        timer.token_ns.append(recorder.clock())
        recorder.finish(f"r{index}")
    assert sent.payloads == []  # nothing built on the serving path
    assert emitter.flush(5.0)
    assert sent.request_spans() == [semconv.SPAN_REQUEST] * 3
    assert emitter.stats()["handed_to_sender_requests"] == 3
    emitter.shutdown(1.0)


def test_a_full_queue_drops_new_requests_and_counts_them() -> None:
    sent = Sent()
    emitter = SpanEmitter(
        sent, resource_attributes=RESOURCE, scope_name="t", interval_s=60, max_queue=2
    )
    for index in range(5):
        emitter.submit(finished_timer(f"r{index}"))
    assert emitter.stats()["dropped_queue_full"] == 3
    assert emitter.flush(5.0)
    assert len(sent.request_spans()) == 2
    emitter.shutdown(1.0)


def test_an_export_that_cannot_be_queued_is_counted_as_dropped() -> None:
    sent = Sent(accept=False)
    emitter = SpanEmitter(sent, resource_attributes=RESOURCE, scope_name="t", interval_s=60)
    emitter.submit(finished_timer("r"))
    emitter.flush(5.0)
    stats = emitter.stats()
    assert stats["dropped_unsent"] == 1
    assert stats["handed_to_sender_requests"] == 0
    assert stats["dropped_queue_full"] == stats["dropped_unencodable"] == 0
    emitter.shutdown(1.0)


def test_a_forked_child_gets_its_own_working_emitter() -> None:
    sent = Sent()
    emitter = SpanEmitter(sent, resource_attributes=RESOURCE, scope_name="t", interval_s=60)
    emitter.submit(finished_timer("parent"))  # the parent's thread is running at fork
    assert emitter.flush(5.0)
    pid = os.fork()
    if pid == 0:  # child: the parent's thread is gone; a new one must serve this process
        code = 1
        try:
            if emitter_threads():
                os._exit(2)  # nothing to emit yet: no thread either
            emitter.submit(finished_timer("child"))
            code = 0 if emitter.flush(5.0) and len(sent.request_spans()) == 2 else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    emitter.shutdown(1.0)


def emitter_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "tokentrace-emitter"]


def test_the_thread_starts_on_the_first_submit() -> None:
    before = len(emitter_threads())
    emitter = SpanEmitter(Sent(), resource_attributes=RESOURCE, scope_name="t", interval_s=60)
    assert len(emitter_threads()) == before
    assert emitter.flush(1.0)  # nothing queued: nothing to start for
    assert len(emitter_threads()) == before
    emitter.submit(finished_timer("r"))
    assert len(emitter_threads()) == before + 1
    emitter.submit(finished_timer("s"))
    assert len(emitter_threads()) == before + 1
    emitter.shutdown(1.0)


def test_no_room_in_the_sender_drops_batches_without_encoding_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent = Sent()
    room = {"free": False}
    asked: list[int] = []

    def has_room(items: int) -> bool:
        asked.append(items)
        return room["free"]

    emitter = SpanEmitter(
        sent,
        resource_attributes=RESOURCE,
        scope_name="t",
        interval_s=60,
        max_batch=2,
        has_room=has_room,
    )
    encoded: list[int] = []
    encode = emitter._encoder.encode

    def counting_encode(finished_requests: list[Any], jobs: list[Any]) -> tuple[bytes, int]:
        encoded.append(1)
        return encode(finished_requests, jobs)

    monkeypatch.setattr(emitter._encoder, "encode", counting_encode)
    for index in range(3):
        emitter.submit(finished_timer(f"r{index}"))
    assert emitter.flush(5.0)
    assert asked == [2, 1]  # asked per batch, with its request count
    assert encoded == [] and sent.payloads == []
    assert emitter.stats()["dropped_unsent"] == 3
    room["free"] = True
    emitter.submit(finished_timer("later"))
    assert emitter.flush(5.0)
    assert encoded == [1] and len(sent.request_spans()) == 1
    assert emitter.stats()["handed_to_sender_requests"] == 1
    emitter.shutdown(1.0)


def test_an_unencodable_batch_is_counted_and_warned_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    emitter = SpanEmitter(
        Sent(), resource_attributes=RESOURCE, scope_name="t", interval_s=60, max_batch=1
    )
    for index in range(3):
        broken = finished_timer(f"r{index}")
        broken.prefill_chunks = [(1,)]  # not (start, end, tokens)
        emitter.submit(broken)
    with caplog.at_level(logging.WARNING, logger="tokentrace.agent.emit"):
        assert emitter.flush(5.0)
    stats = emitter.stats()
    assert stats["dropped_unencodable"] == 3 and stats["failed_batches"] == 3
    warnings = [r for r in caplog.records if "dropped_unencodable" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].exc_info is not None
    emitter.shutdown(1.0)


def test_queue_drops_are_warned_once_naming_the_counter_and_setting(
    caplog: pytest.LogCaptureFixture,
) -> None:
    emitter = SpanEmitter(
        Sent(), resource_attributes=RESOURCE, scope_name="t", interval_s=60, max_queue=1
    )
    with caplog.at_level(logging.WARNING, logger="tokentrace.agent.emit"):
        for index in range(50):
            emitter.submit(finished_timer(f"r{index}"))
    (warning,) = [r for r in caplog.records if r.name == "tokentrace.agent.emit"]
    assert "dropped_queue_full" in warning.getMessage()
    assert "TOKENTRACE_MAX_QUEUE" in warning.getMessage()
    assert emitter.stats()["dropped_queue_full"] == 49
    emitter.shutdown(1.0)


def test_an_idle_emitter_thread_sleeps_until_something_is_queued(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A periodic wake-up would cost a GIL hand-off in every idle server process: none happen.
    sent = Sent()
    emitter = SpanEmitter(sent, resource_attributes=RESOURCE, scope_name="t", interval_s=0.001)
    drains: list[float] = []
    original = emitter._drain

    def counted_drain() -> int:
        drains.append(1.0)
        return original()

    monkeypatch.setattr(emitter, "_drain", counted_drain)
    emitter.submit(finished_timer("r0"))
    deadline = time.monotonic() + 5
    while not sent.payloads and time.monotonic() < deadline:
        time.sleep(0.005)
    assert sent.request_spans() == [semconv.SPAN_REQUEST]
    time.sleep(0.05)  # the interval after the last batch brings nothing: the thread parks
    settled = len(drains)
    time.sleep(0.3)  # 300 intervals
    assert len(drains) == settled
    emitter.submit(finished_timer("r1"))  # and it wakes for the next request by itself
    deadline = time.monotonic() + 5
    while len(sent.payloads) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert sent.request_spans() == [semconv.SPAN_REQUEST] * 2
    emitter.shutdown(1.0)


class _CountingEvent(threading.Event):
    """An Event that counts the waits that had to sleep (the flag was not set)."""

    def __init__(self) -> None:
        super().__init__()
        self.slept = 0

    def wait(self, timeout: float | None = None) -> bool:
        if not self.is_set():
            self.slept += 1
        return super().wait(timeout)


def test_under_steady_load_the_serving_threads_never_wake_the_emitter() -> None:
    # Each batch's interval ends by its timer; the thread parks (and a submit must wake it) only
    # after an interval that brought nothing. (Parking after every batch: ~15 times here.)
    sent = Sent()
    emitter = SpanEmitter(sent, resource_attributes=RESOURCE, scope_name="t", interval_s=0.02)
    wake = _CountingEvent()
    emitter._wake = wake
    for index in range(150):  # a request every ~2 ms: about 15 intervals
        emitter.submit(finished_timer(f"r{index}"))
        time.sleep(0.002)
    assert emitter.flush(5.0)
    assert len(sent.request_spans()) == 150
    assert len(sent.payloads) >= 5  # batches per interval, not one at the end
    # A 20 ms pause of this thread on a busy machine may park it once or twice.
    assert wake.slept <= 2, wake.slept
    emitter.shutdown(1.0)


def test_no_request_is_left_behind_by_submits_racing_the_drain() -> None:
    # Four threads submit while the thread drains every millisecond; without a flush, every
    # request must still be emitted (a missed wake-up would strand the last ones).
    sent = Sent()
    emitter = SpanEmitter(sent, resource_attributes=RESOURCE, scope_name="t", interval_s=0.001)
    per_thread = 300

    def submit_many(thread: int) -> None:
        for index in range(per_thread):
            emitter.submit(finished_timer(f"t{thread}-{index}", tokens=1))
            if index % 50 == 0:
                time.sleep(0.002)  # let the queue run empty now and then

    threads = [threading.Thread(target=submit_many, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    deadline = time.monotonic() + 10
    while emitter.stats()["handed_to_sender_requests"] < 4 * per_thread:
        assert time.monotonic() < deadline, emitter.stats()
        time.sleep(0.01)
    assert len(sent.request_spans()) == 4 * per_thread
    emitter.shutdown(1.0)
