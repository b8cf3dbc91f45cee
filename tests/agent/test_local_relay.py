"""The agent's local socket to the node agent (``agent/local_relay.py``, and its receiving end
``agent/node/local_relay.py``) over a real Unix socket: the spans the node agent builds from a
batch are the spans the emitter would have exported itself; whatever the socket cannot take goes
by OTLP or is counted."""

from __future__ import annotations

import os
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tests.agent.test_emit import Sent
from tokentrace.agent import plain_marshal, semconv
from tokentrace.agent.config import load_agent_config
from tokentrace.agent.emit import SpanEmitter
from tokentrace.agent.local_relay import (
    ACK_REJECTED,
    ACK_TAKEN,
    LocalRelayClient,
    RelayUnreachable,
    batch,
    frame,
    hello,
    read_batch,
    read_hello,
    timer_of,
    timer_row,
)
from tokentrace.agent.node.local_relay import LocalSocketReceiver, validate_socket_path
from tokentrace.agent.recorder import (
    PROMPT_TOKEN_IDS,
    MonotonicToUnix,
    RequestTimer,
    to_finished_request,
)
from tokentrace.agent.span_encoding import SpanBatchEncoder
from tokentrace.agent.spans import KIND_INTERNAL, PlannedSpan, SpanJob
from tokentrace.collector.consumer import Overloaded

RESOURCE = {semconv.SERVICE_NAME: "vllm-test", semconv.PROCESS_PID: 4242}
SCOPE = ("tokentrace.agent", "9.9")
OFFSET_NS = 1_700_000_000_000_000_000
MS = 1_000_000


def full_timer(number: int) -> RequestTimer:
    """A timer with every field set: chunks, a preemption still open, a cold-start link, the
    prompt's token ids (hashed on the way), attributes that are and are not request fields."""
    base = number * 100 * MS
    timer = RequestTimer(f"cmpl-{number}", arrival_ns=base)
    timer.queued_ns = base + MS
    timer.first_scheduled_ns = base + 2 * MS
    timer.prefill_chunks += [
        (base + 2 * MS, base + 5 * MS, 512),
        (base + 5 * MS, base + 9 * MS, 77),
    ]
    timer.token_ns += [base + 10 * MS + k * 3 * MS + (k % 3) for k in range(40)]
    timer.preempted_ns.append((base + 20 * MS, base + 21 * MS))
    timer.preempted_since_ns = base + 130 * MS
    timer.end_ns = base + 140 * MS
    timer.status_error = "client disconnected"
    timer.trace_id = number.to_bytes(16, "big")
    timer.parent_span_id = b"\x01" * 8
    timer.span_id = b"\x02" * 8
    timer.prefill_span_id = b"\x03" * 8
    timer.ready_ns = base + MS // 2
    timer.cold_start_link = (b"\x04" * 16, b"\x05" * 8)
    timer.attributes.update(
        model="llama-test",
        operation=semconv.OPERATION_CHAT,
        input_tokens=589,
        output_tokens=40,
        temperature=0.7,
        finish_reason="abort",
        not_reported=("queue",),
        not_a_request_field=object(),  # the instrumentation's own: not sent
    )
    timer.attributes[PROMPT_TOKEN_IDS] = list(range(300))
    return timer


def plain_timer(number: int) -> RequestTimer:
    timer = RequestTimer(f"r{number}", arrival_ns=number * MS)
    timer.trace_id = (1000 + number).to_bytes(16, "big")
    timer.token_ns += [number * MS + 5 * MS, number * MS + 7 * MS]
    timer.end_ns = number * MS + 8 * MS
    timer.attributes.update(model="m", operation="chat")
    return timer


def step_job(number: int) -> SpanJob:
    return SpanJob(
        trace_id=number.to_bytes(16, "big"),
        parent_span_id=b"\x09" * 8,
        spans=[
            PlannedSpan(
                0,
                -1,
                semconv.SPAN_ENGINE_STEP,
                KIND_INTERNAL,
                MS,
                3 * MS,
                {
                    semconv.ENGINE_STEP_REQUEST_IDS: ("a", "b"),
                    "tokentrace.test.ints": [1, 2, 3],
                    "tokentrace.test.float": 0.5,
                    "tokentrace.test.flag": True,
                },
                links=((b"\x07" * 16, b"\x08" * 8),),
            ),
            PlannedSpan(1, 0, "child", KIND_INTERNAL, 2 * MS, 3 * MS, {}, status_error="boom"),
        ],
        fixed_ids={0: b"\x0a" * 8},
    )


class _Offset:
    def offset_ns(self) -> int:
        return OFFSET_NS


def _counting_ids() -> Any:
    count = iter(range(1, 1 << 30))
    return lambda: next(count)


def _encoded(timers: list[RequestTimer], jobs: list[SpanJob]) -> bytes:
    encoder = SpanBatchEncoder(
        resource_attributes=RESOURCE, scope_name="t", span_ids=_counting_ids()
    )
    finished = [to_finished_request(timer, _Offset()) for timer in timers]
    payload, _ = encoder.encode(finished, jobs)
    return payload


def test_timers_and_span_jobs_read_back_encode_to_the_same_bytes() -> None:
    timers = [full_timer(1), plain_timer(2)]
    jobs = [step_job(3)]
    body = plain_marshal.dumps(batch(timers, jobs, 0))
    _, read_timers, read_jobs = read_batch(plain_marshal.loads(body))
    # to_finished_request closes the open preemption on the timer: compare against fresh ones.
    assert _encoded(read_timers, read_jobs) == _encoded([full_timer(1), timers[1]], [step_job(3)])
    finished = to_finished_request(read_timers[0], _Offset())
    assert finished.prefix_hash is not None  # hashed by the sender, the ids never sent
    assert "not_a_request_field" not in read_timers[0].attributes
    assert PROMPT_TOKEN_IDS.encode() not in body


def test_a_timer_row_carries_the_request_fields_and_the_prompts_hash_only() -> None:
    timer = plain_timer(1)
    timer.attributes.update(input_tokens=300, finish_reason="length")
    timer.attributes[PROMPT_TOKEN_IDS] = list(range(300))
    attributes = timer_row(timer)[-1]
    assert set(attributes) == {"model", "operation", "input_tokens", "finish_reason", "prefix_hash"}
    assert attributes["prefix_hash"] == to_finished_request(timer, _Offset()).prefix_hash
    assert PROMPT_TOKEN_IDS in timer.attributes  # the timer itself is left as it was
    timer.attributes["the_hooks_own"] = object()
    assert set(timer_row(timer)[-1]) == set(attributes)


@pytest.mark.parametrize(
    "row",
    [
        "not a tuple",
        (1, 2, 3),
        list(timer_row(plain_timer(1))),  # a list, not the tuple written
        (*timer_row(plain_timer(1))[:1], "1", *timer_row(plain_timer(1))[2:]),  # arrival a str
        (*timer_row(plain_timer(1))[:4], [1, 2], *timer_row(plain_timer(1))[5:]),  # not int64s
        (*timer_row(plain_timer(1))[:4], b"\0" * 7, *timer_row(plain_timer(1))[5:]),  # 7 bytes
        (*timer_row(plain_timer(1))[:10], "00" * 16, *timer_row(plain_timer(1))[11:]),  # not bytes
        (*timer_row(plain_timer(1))[:16], ["model"]),  # attributes not a dict
        (*timer_row(plain_timer(1))[:5], [(1, 2)], *timer_row(plain_timer(1))[6:]),  # chunk of 2
    ],
)
def test_a_malformed_timer_row_is_refused(row: Any) -> None:
    with pytest.raises((TypeError, ValueError)):
        timer_of(plain_marshal.loads(plain_marshal.dumps(row)))


@pytest.mark.parametrize(
    "message",
    [
        [],
        {"timers": [], "jobs": []},
        {"offset_ns": "0", "timers": [], "jobs": []},
        {"offset_ns": 0, "timers": {}, "jobs": []},
        {
            "offset_ns": 0,
            "timers": [],
            "jobs": [(b"\0" * 16, b"", [(0, -1, "s", 1, 0, 1, {}, None)], None)],  # 8 fields
        },
    ],
)
def test_a_malformed_batch_is_refused(message: Any) -> None:
    with pytest.raises((TypeError, ValueError)):
        read_batch(message)


def test_a_hello_reads_back_and_a_stranger_is_refused() -> None:
    message = hello(
        resource={"service.name": "s", "tokentrace.gpu.uuids": ("GPU-1",), "process.pid": 7},
        scope_name="n",
        scope_version="v",
        max_token_offsets=3,
    )
    read = read_hello(plain_marshal.loads(plain_marshal.dumps(message)))
    assert read.resource == {
        "service.name": "s",
        "tokentrace.gpu.uuids": ("GPU-1",),
        "process.pid": 7,
    }
    assert (read.scope_name, read.scope_version, read.max_token_offsets) == ("n", "v", 3)
    for stranger in ({**message, "hello": 2}, {**message, "resource": []}, {"hello": 1}):
        with pytest.raises(ValueError, match="hello refused"):
            read_hello(stranger)


@pytest.fixture
def socket_path(tmp_path: Path) -> Path:
    return tmp_path / "run" / "node.sock"


class Consumed:
    """``NodeAgent.consume_traces`` as a list; ``refuse`` makes it answer Overloaded."""

    def __init__(self) -> None:
        self.requests: list[tuple[ExportTraceServiceRequest, bytes]] = []
        self.refuse = False
        self.lock = threading.Lock()

    def __call__(self, request: ExportTraceServiceRequest, *, encoded: bytes) -> None:
        if self.refuse:
            raise Overloaded("full", retry_after_s=1.0)
        with self.lock:
            self.requests.append((request, encoded))

    def spans(self) -> list[tuple[dict[str, Any], Span]]:
        return [
            ({kv.key: kv.value for kv in rs.resource.attributes}, span)
            for request, _ in self.requests
            for rs in request.resource_spans
            for ss in rs.scope_spans
            for span in ss.spans
        ]


@pytest.fixture
def receiver(socket_path: Path) -> Iterator[tuple[LocalSocketReceiver, Consumed]]:
    consumed = Consumed()
    server = LocalSocketReceiver(str(socket_path), consumed)
    server.start()
    yield server, consumed
    server.shutdown(2.0)


def _client(path: Path) -> LocalRelayClient:
    return LocalRelayClient(
        str(path),
        hello_message=hello(
            resource=RESOURCE, scope_name=SCOPE[0], scope_version=SCOPE[1], max_token_offsets=1024
        ),
    )


def _relaying_emitter(sent: Sent, relay: LocalRelayClient) -> SpanEmitter:
    """An emitter whose batches go to ``relay`` (else to ``sent``), on ``flush`` only."""
    return SpanEmitter(
        sent, resource_attributes=RESOURCE, scope_name="t", interval_s=60, relay=relay
    )


def _without_ids(span: Span) -> tuple[Any, ...]:
    copy = Span()
    copy.CopyFrom(span)
    copy.ClearField("span_id")
    copy.ClearField("parent_span_id")
    return (copy.name, copy.start_time_unix_nano, copy.SerializeToString(deterministic=True))


def test_the_node_agent_builds_the_spans_the_emitter_would_have_exported(
    receiver: tuple[LocalSocketReceiver, Consumed], socket_path: Path
) -> None:
    server, consumed = receiver
    sent = Sent()
    relay = _client(socket_path)
    clock = MonotonicToUnix(wall_ns=lambda: OFFSET_NS, monotonic_ns=lambda: 0)
    emitter = SpanEmitter(
        sent,
        resource_attributes=RESOURCE,
        scope_name=SCOPE[0],
        scope_version=SCOPE[1],
        interval_s=60,
        relay=relay,
        to_unix=clock,
    )
    local = Sent()
    alone = SpanEmitter(
        local,
        resource_attributes=RESOURCE,
        scope_name=SCOPE[0],
        scope_version=SCOPE[1],
        interval_s=60,
        to_unix=clock,
    )
    deferred_calls: list[int] = []

    def deferred() -> list[SpanJob]:
        deferred_calls.append(1)
        return [step_job(9)]

    for target in (emitter, alone):
        target.submit(full_timer(1))
        target.submit(plain_timer(2))
        target.submit(step_job(3))
        target.submit(deferred)
        assert target.flush(5.0)
    assert deferred_calls == [1, 1]  # planned once per emitter, by its own thread
    assert sent.payloads == []  # nothing went by OTLP
    stats = emitter.stats()
    assert stats["handed_to_node_requests"] == 4
    assert stats["node_socket_connects"] == 1
    [(request, encoded)] = consumed.requests
    assert request.SerializeToString() == encoded
    [(expected_payload, expected_spans)] = local.payloads
    expected = ExportTraceServiceRequest.FromString(expected_payload)
    assert len(consumed.spans()) == expected_spans
    assert request.resource_spans[0].resource == expected.resource_spans[0].resource
    assert (
        request.resource_spans[0].scope_spans[0].scope
        == expected.resource_spans[0].scope_spans[0].scope
    )
    assert sorted(_without_ids(s) for _, s in consumed.spans()) == sorted(
        _without_ids(s) for s in expected.resource_spans[0].scope_spans[0].spans
    )
    # Ids chosen in advance (the request's, the job's fixed one) survive the trip.
    ids = {span.span_id for _, span in consumed.spans()}
    assert {b"\x02" * 8, b"\x03" * 8, b"\x0a" * 8} <= ids
    assert server.stats()["taken_requests"] == 4
    assert server.stats()["accepted_spans"] == expected_spans
    emitter.shutdown(1.0)
    alone.shutdown(1.0)


def test_without_the_socket_batches_go_by_otlp_and_the_socket_is_retried_later(
    socket_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sent = Sent()
    clock = [100.0]
    relay = LocalRelayClient(
        str(socket_path),
        hello_message=hello(
            resource=RESOURCE, scope_name="t", scope_version="", max_token_offsets=8
        ),
        monotonic=lambda: clock[0],
    )
    emitter = _relaying_emitter(sent, relay)
    emitter.submit(plain_timer(1))
    assert emitter.flush(5.0)
    emitter.submit(plain_timer(2))
    assert emitter.flush(5.0)
    assert sent.request_spans() == [semconv.SPAN_REQUEST] * 2
    stats = emitter.stats()
    assert stats["node_socket_failures"] == 1  # the second batch did not try again
    assert stats["handed_to_sender_requests"] == 2
    assert not relay.available
    clock[0] += 6.0  # past the retry wait: the socket (still absent) is tried once more
    assert relay.available
    with pytest.raises(RelayUnreachable):
        relay.send([plain_timer(3)], [], 0)
    assert relay.failures == 2
    # Said once (then at most every few minutes), naming the socket and the counter.
    (warning,) = [r.getMessage() for r in caplog.records if "node agent's socket" in r.getMessage()]
    assert str(socket_path) in warning
    assert "emitter.node_socket_failures" in warning
    emitter.shutdown(1.0)


def test_a_busy_node_agent_drops_the_batch_and_both_sides_count_it(
    receiver: tuple[LocalSocketReceiver, Consumed], socket_path: Path
) -> None:
    server, consumed = receiver
    consumed.refuse = True
    sent = Sent()
    emitter = _relaying_emitter(sent, _client(socket_path))
    emitter.submit(plain_timer(1))
    emitter.submit(plain_timer(2))
    assert emitter.flush(5.0)
    assert sent.payloads == []  # not sent twice: the node agent's queue is the same queue
    assert emitter.stats()["dropped_unsent"] == 2
    assert server.stats()["busy_requests"] == 2
    consumed.refuse = False
    emitter.submit(plain_timer(3))
    assert emitter.flush(5.0)
    assert emitter.stats()["handed_to_node_requests"] == 1
    emitter.shutdown(1.0)


def _raw_connection(path: Path) -> socket.socket:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.settimeout(5.0)
    connection.connect(str(path))
    return connection


def test_a_malformed_batch_is_answered_rejected_and_the_connection_goes_on(
    receiver: tuple[LocalSocketReceiver, Consumed], socket_path: Path
) -> None:
    server, consumed = receiver
    with _raw_connection(socket_path) as connection:
        connection.sendall(
            frame(hello(resource={}, scope_name="t", scope_version="", max_token_offsets=4))
        )
        connection.sendall(frame({"offset_ns": 0, "timers": [["bad"]], "jobs": []}))
        assert connection.recv(1) == ACK_REJECTED
        connection.sendall(frame(batch([plain_timer(1)], [], 0)))
        assert connection.recv(1) == ACK_TAKEN
    assert server.stats()["rejected_frames"] == 1
    assert [span.name for _, span in consumed.spans()].count(semconv.SPAN_REQUEST) == 1


_NESTED: Final = b"[\x01\x00\x00\x00" * 1000 + b"N"
"""A list in a list ... 1,000 deep: past the reader's depth."""


@pytest.mark.parametrize(
    "first_bytes",
    [
        struct.pack(">I", 64 * 1024 * 1024),
        frame({"hello": 99}),
        frame({"offset_ns": 0, "timers": [], "jobs": []}),
        struct.pack(">I", 5) + b"cnope",
        struct.pack(">I", len(_NESTED)) + _NESTED,
    ],
    ids=[
        "a frame over the limit",
        "another protocol",
        "a batch before the hello",
        "a code object's type code",
        "nested past the reader's depth",
    ],
)
def test_a_connection_that_does_not_speak_the_protocol_is_closed(
    receiver: tuple[LocalSocketReceiver, Consumed], socket_path: Path, first_bytes: bytes
) -> None:
    server, consumed = receiver
    with _raw_connection(socket_path) as connection:
        connection.sendall(first_bytes)
        assert connection.recv(1) == b""  # closed, no answer
    assert server.stats()["rejected_frames"] == 1
    assert consumed.requests == []
    with _raw_connection(socket_path) as connection:  # the next one is served
        connection.sendall(
            frame(hello(resource={}, scope_name="t", scope_version="", max_token_offsets=4))
        )
        connection.sendall(frame(batch([], [], 0)))
        assert connection.recv(1) == ACK_TAKEN


def test_a_stale_socket_file_is_replaced_and_a_live_one_is_not_taken(socket_path: Path) -> None:
    socket_path.parent.mkdir(parents=True)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(socket_path))
    stale.close()  # the file stays, nobody listens
    first = LocalSocketReceiver(str(socket_path), Consumed())
    first.start()
    try:
        assert oct(socket_path.stat().st_mode & 0o777) == oct(0o666)
        with pytest.raises(OSError, match="another process listens"):
            LocalSocketReceiver(str(socket_path), Consumed()).start()
    finally:
        first.shutdown(2.0)
    assert not socket_path.exists()
    socket_path.write_text("not a socket")
    with pytest.raises(OSError, match="not a socket"):
        LocalSocketReceiver(str(socket_path), Consumed()).start()


def test_connections_beyond_the_cap_are_closed_at_once(socket_path: Path) -> None:
    server = LocalSocketReceiver(str(socket_path), Consumed(), max_connections=1)
    server.start()
    try:
        with _raw_connection(socket_path) as kept:
            kept.sendall(
                frame(hello(resource={}, scope_name="t", scope_version="", max_token_offsets=4))
            )
            with _raw_connection(socket_path) as refused:
                assert refused.recv(1) == b""
            kept.sendall(frame(batch([], [], 0)))
            assert kept.recv(1) == ACK_TAKEN
        assert server.stats()["refused_connections"] == 1
    finally:
        server.shutdown(2.0)


def test_shutdown_closes_open_connections_and_the_agent_falls_back_to_otlp(
    socket_path: Path,
) -> None:
    server = LocalSocketReceiver(str(socket_path), Consumed())
    server.start()
    sent = Sent()
    emitter = _relaying_emitter(sent, _client(socket_path))
    emitter.submit(plain_timer(1))
    assert emitter.flush(5.0)
    assert emitter.stats()["handed_to_node_requests"] == 1
    server.shutdown(2.0)
    assert server.stats()["connections"] == 0
    emitter.submit(plain_timer(2))
    assert emitter.flush(5.0)
    assert sent.request_spans() == [semconv.SPAN_REQUEST]  # by OTLP, not lost
    emitter.shutdown(1.0)


def test_a_forked_child_does_not_use_the_parents_connection(
    receiver: tuple[LocalSocketReceiver, Consumed], socket_path: Path
) -> None:
    _, consumed = receiver
    relay = _client(socket_path)
    relay.send([plain_timer(1)], [], 0)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            relay.send([plain_timer(2)], [], 0)  # a connection of its own
            code = 0 if relay.connects == 2 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    relay.send([plain_timer(3)], [], 0)  # the parent's connection still works
    assert relay.connects == 1
    relay.close()
    names = [span.name for _, span in consumed.spans()]
    assert names.count(semconv.SPAN_REQUEST) == 3


def test_the_socket_is_configured_from_the_environment() -> None:
    config = load_agent_config({"TOKENTRACE_NODE_SOCKET": " /var/run/tokentrace/node.sock "})
    assert config.node_socket == "/var/run/tokentrace/node.sock"
    assert load_agent_config({}).node_socket is None


@pytest.mark.parametrize("path", ["relative/node.sock", "/" + "x" * 120])
def test_a_socket_path_that_cannot_be_bound_is_a_configuration_error(path: str) -> None:
    with pytest.raises(ValueError, match="local_socket"):
        validate_socket_path(path)


def test_a_batch_that_plans_no_spans_sends_nothing(
    receiver: tuple[LocalSocketReceiver, Consumed], socket_path: Path
) -> None:
    """EngineCore's deferred jobs mostly plan nothing (no chunks, no preemption, no outlier):
    no frame, no round trip to the node agent."""
    relay = _client(socket_path)
    emitter = _relaying_emitter(Sent(), relay)
    emitter.submit(list)  # a deferred job that plans no spans
    assert emitter.flush(5.0)
    assert relay.connects == 0
    assert receiver[0].stats()["accepted_connections"] == 0
    emitter.shutdown(1.0)
