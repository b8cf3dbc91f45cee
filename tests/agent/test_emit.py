from __future__ import annotations

import os

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
    timer.scheduled_ns = 2_000_000
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
    assert emitter.stats()["emitted_requests"] == 3
    emitter.shutdown(1.0)


def test_a_full_queue_drops_new_requests_and_counts_them() -> None:
    sent = Sent()
    emitter = SpanEmitter(
        sent, resource_attributes=RESOURCE, scope_name="t", interval_s=60, max_queue=2
    )
    for index in range(5):
        emitter.submit(finished_timer(f"r{index}"))
    assert emitter.dropped_requests == 3
    assert emitter.flush(5.0)
    assert len(sent.request_spans()) == 2
    emitter.shutdown(1.0)


def test_an_export_that_cannot_be_queued_is_counted_as_dropped() -> None:
    sent = Sent(accept=False)
    emitter = SpanEmitter(sent, resource_attributes=RESOURCE, scope_name="t", interval_s=60)
    emitter.submit(finished_timer("r"))
    emitter.flush(5.0)
    assert emitter.stats()["dropped_requests"] == 1
    assert emitter.stats()["emitted_requests"] == 0
    emitter.shutdown(1.0)


def test_a_forked_child_gets_its_own_working_emitter() -> None:
    sent = Sent()
    emitter = SpanEmitter(sent, resource_attributes=RESOURCE, scope_name="t", interval_s=60)
    pid = os.fork()
    if pid == 0:  # child: the parent's thread is gone; a new one must serve this process
        code = 1
        try:
            emitter.submit(finished_timer("child"))
            code = 0 if emitter.flush(5.0) and len(sent.request_spans()) == 1 else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    emitter.shutdown(1.0)
