"""The agent's OTLP sender against a real OTLP receiver on loopback (tests/collector/upstream.py):
delivery over both transports, the bounded queue, retry, shutdown, fork and drop warnings (the
configuration is tests/agent/test_otlp_config.py's)."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import Gauge, Metric, NumberDataPoint

from tests.collector.upstream import (
    FLUSH_S,
    PROTOCOLS,
    UpstreamOtlp,
    endpoint_of,
    iter_spans,
    make_config,
)
from tokentrace.agent import semconv
from tokentrace.agent.otlp_config import (
    PROTOCOL_GRPC,
    PROTOCOL_HTTP_PROTOBUF,
    OtlpExporterConfig,
    RetryConfig,
    Signal,
)
from tokentrace.agent.otlp_export import OtlpSender, RateLimitedWarning, shut_down_together

# --- helpers -----------------------------------------------------------------------------------


def make_sender(
    upstream: UpstreamOtlp,
    protocol: str,
    *,
    signal: Signal = "traces",
    fake: FakeTime | None = None,
    **overrides: Any,
) -> OtlpSender:
    timing: dict[str, Any] = {}
    if fake is not None:
        timing = {"clock": fake.clock, "sleep": fake.sleep, "random_fraction": lambda: 0.5}
    return OtlpSender(
        make_config(endpoint_of(upstream, protocol), protocol, **overrides),
        signal=signal,
        **timing,
    )


class FakeTime:
    """An injected clock that only moves when the sender sleeps; records every sleep."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


_next_span_number = iter(range(1, 1 << 30))


def trace_request(spans: int) -> ExportTraceServiceRequest:
    """One request of ``spans`` spans with ids unique within the test session."""
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    resource_spans.resource.attributes.add(
        key=semconv.SERVICE_NAME, value=AnyValue(string_value="svc")
    )
    scope_spans = resource_spans.scope_spans.add()
    scope_spans.scope.name = "scope"
    for _ in range(spans):
        number = next(_next_span_number)
        span = scope_spans.spans.add(
            trace_id=number.to_bytes(16, "big"),
            span_id=number.to_bytes(8, "big"),
            name=semconv.SPAN_REQUEST,
            start_time_unix_nano=1_000 + number,
            end_time_unix_nano=2_000 + number,
        )
        span.attributes.add(
            key=semconv.GEN_AI_USAGE_OUTPUT_TOKENS, value=AnyValue(int_value=number)
        )
    return request


def encoded(spans: int) -> bytes:
    return trace_request(spans).SerializeToString()


def metric_request(points: int) -> ExportMetricsServiceRequest:
    request = ExportMetricsServiceRequest()
    scope_metrics = request.resource_metrics.add().scope_metrics.add()
    scope_metrics.metrics.append(
        Metric(
            name="g",
            gauge=Gauge(
                data_points=[
                    NumberDataPoint(as_double=float(i), time_unix_nano=i) for i in range(points)
                ]
            ),
        )
    )
    return request


def unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- delivery ------------------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("compression", ["gzip", "none"])
def test_submitted_bytes_arrive_as_the_request_they_encode(
    upstream: UpstreamOtlp, protocol: str, compression: str
) -> None:
    sizes = [3, 5]
    requests = [trace_request(size) for size in sizes]
    sender = OtlpSender(
        make_config(
            endpoint_of(upstream, protocol),
            protocol,
            compression=compression,
            headers={"Authorization": "Bearer t0ken"},
        ),
        signal="traces",
        user_agent="test-agent/1",
    )
    for request, size in zip(requests, sizes, strict=True):
        assert sender.submit(request.SerializeToString(), size)
    assert sender.force_flush(FLUSH_S)
    sender.shutdown(FLUSH_S)

    assert upstream.trace_requests == requests  # one request per submission, in order, intact
    for call in upstream.calls:
        assert call.signal == "traces"
        assert call.headers["authorization"] == "Bearer t0ken"
        assert call.headers["user-agent"].startswith("test-agent/1")
        if protocol == PROTOCOL_HTTP_PROTOBUF:
            assert call.headers["content-type"] == "application/x-protobuf"
            assert call.headers.get("content-encoding") == (
                "gzip" if compression == "gzip" else None
            )
    assert sender.stats() == {
        "sent_spans": 8,
        "dropped_spans": 0,
        "rejected_spans": 0,
        "retries": 0,
        "queue_len": 0,
    }


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_metrics_go_to_the_metrics_service_and_count_rejected_data_points(
    upstream: UpstreamOtlp, protocol: str
) -> None:
    upstream.reject_next(2, "2 points out of order")
    sender = make_sender(upstream, protocol, signal="metrics")
    request = metric_request(5)
    assert sender.submit(request.SerializeToString(), 5)
    sender.shutdown(FLUSH_S)
    assert upstream.metric_requests == [request]
    assert upstream.trace_requests == []
    stats = sender.stats()
    assert (stats["sent_data_points"], stats["rejected_data_points"]) == (3, 2)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_partial_success_counts_rejected_spans(upstream: UpstreamOtlp, protocol: str) -> None:
    upstream.reject_next(3, "3 spans too old")
    sender = make_sender(upstream, protocol)
    sender.submit(encoded(10), 10)
    sender.shutdown(FLUSH_S)
    stats = sender.stats()
    assert (stats["sent_spans"], stats["rejected_spans"], stats["dropped_spans"]) == (7, 3, 0)


# --- retry -------------------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_unavailable_upstream_is_retried_with_backoff(
    upstream: UpstreamOtlp, protocol: str
) -> None:
    fake = FakeTime()
    upstream.fail_next(2)  # gRPC UNAVAILABLE / HTTP 503
    retry = RetryConfig(initial_interval_s=0.1, max_interval_s=1.0, max_elapsed_s=10.0)
    sender = make_sender(upstream, protocol, fake=fake, retry=retry)
    request = trace_request(7)
    sender.submit(request.SerializeToString(), 7)
    sender.shutdown(FLUSH_S)

    assert [call.accepted for call in upstream.calls] == [False, False, True]
    assert upstream.trace_requests == [request]  # the same request, re-sent whole
    stats = sender.stats()
    assert (stats["retries"], stats["sent_spans"], stats["dropped_spans"]) == (2, 7, 0)
    # Exponential: the second wait is longer than the first, the first the initial interval.
    assert len(fake.sleeps) == 2
    assert fake.sleeps[0] == pytest.approx(0.1)
    assert fake.sleeps[1] > fake.sleeps[0]


def test_jitter_spreads_retry_delays_around_the_interval(upstream: UpstreamOtlp) -> None:
    fake = FakeTime()
    upstream.fail_next(2)
    retry = RetryConfig(initial_interval_s=1.0, max_interval_s=1.0, max_elapsed_s=10.0)
    fractions = iter([0.0, 0.999])
    sender = OtlpSender(
        make_config(upstream.http_endpoint, PROTOCOL_HTTP_PROTOBUF, retry=retry),
        signal="traces",
        clock=fake.clock,
        sleep=fake.sleep,
        random_fraction=lambda: next(fractions),
    )
    sender.submit(encoded(1), 1)
    sender.shutdown(FLUSH_S)
    low, high = fake.sleeps
    assert 0.4 < low < 0.6 < 1.4 < high < 1.6
    assert sender.stats()["sent_spans"] == 1


@pytest.mark.parametrize(
    ("protocol", "failure", "expected_sleep"),
    [
        (
            PROTOCOL_GRPC,
            {"grpc_code": grpc.StatusCode.RESOURCE_EXHAUSTED, "retry_after_s": 0.25},
            0.25,
        ),
        (PROTOCOL_HTTP_PROTOBUF, {"http_status": 429, "retry_after_s": 3}, 3.0),
        (PROTOCOL_HTTP_PROTOBUF, {"http_status": 502}, 0.1),
    ],
)
def test_server_requested_retry_delay_is_honoured(
    upstream: UpstreamOtlp, protocol: str, failure: dict[str, Any], expected_sleep: float
) -> None:
    fake = FakeTime()
    upstream.fail_next(1, **failure)
    retry = RetryConfig(initial_interval_s=0.1, max_interval_s=1.0, max_elapsed_s=10.0)
    sender = make_sender(upstream, protocol, fake=fake, retry=retry)
    sender.submit(encoded(3), 3)
    sender.shutdown(FLUSH_S)
    assert fake.sleeps == [pytest.approx(expected_sleep)]
    assert sender.stats()["sent_spans"] == 3


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_upstream_down_for_good_drops_the_request_after_max_elapsed(protocol: str) -> None:
    fake = FakeTime()
    retry = RetryConfig(initial_interval_s=0.1, max_interval_s=0.3, max_elapsed_s=2.0)
    sender = OtlpSender(
        make_config(f"http://127.0.0.1:{unused_port()}", protocol, retry=retry),
        signal="traces",
        clock=fake.clock,
        sleep=fake.sleep,
        random_fraction=lambda: 0.5,
    )
    started = time.perf_counter()
    assert sender.submit(encoded(50), 50)
    submit_s = time.perf_counter() - started
    assert sender.force_flush(FLUSH_S)  # the worker gave the request up
    sender.shutdown(FLUSH_S)

    stats = sender.stats()
    assert (stats["sent_spans"], stats["dropped_spans"]) == (0, 50)
    assert stats["retries"] == len(fake.sleeps) >= 5
    assert sum(fake.sleeps) <= retry.max_elapsed_s
    assert max(fake.sleeps) == pytest.approx(retry.max_interval_s)  # the cap was reached
    assert sorted(fake.sleeps) == fake.sleeps
    assert submit_s < 0.5, "submit() must not wait for the network"


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_non_retryable_error_drops_without_retrying(upstream: UpstreamOtlp, protocol: str) -> None:
    upstream.fail_next(1, grpc_code=grpc.StatusCode.INVALID_ARGUMENT, http_status=400)
    sender = make_sender(upstream, protocol)
    sender.submit(encoded(4), 4)
    sender.submit(encoded(6), 6)  # the next request is unaffected
    sender.shutdown(FLUSH_S)
    stats = sender.stats()
    assert (stats["dropped_spans"], stats["sent_spans"], stats["retries"]) == (4, 6, 0)
    assert len(upstream.calls) == 2


# --- never blocking, bounded -------------------------------------------------------------------
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_submit_returns_at_once_while_upstream_is_stuck(
    upstream: UpstreamOtlp, protocol: str
) -> None:
    upstream.hold()
    sender = make_sender(upstream, protocol)
    payload = encoded(512)
    durations = []
    for _ in range(3):
        started = time.perf_counter()
        assert sender.submit(payload, 512)
        durations.append(time.perf_counter() - started)
        upstream.wait_for_started_calls(1)
    assert upstream.span_count() == 0  # nothing completed: the call is still held upstream
    assert max(durations) < 0.25
    upstream.release()
    assert sender.force_flush(FLUSH_S)
    assert upstream.span_count() == 3 * 512
    sender.shutdown(FLUSH_S)


def test_full_queue_refuses_and_counts_new_requests_exactly(upstream: UpstreamOtlp) -> None:
    upstream.hold()
    sender = make_sender(upstream, PROTOCOL_GRPC, queue_size=10, max_batch_spans=5)
    assert sender.submit(encoded(5), 5)  # taken by the worker, held upstream
    assert upstream.wait_for_started_calls(1)
    assert sender.submit(encoded(6), 6)  # queued: 6 of 10
    assert sender.has_room(4) and not sender.has_room(5)
    assert not sender.submit(encoded(5), 5)  # 11 > 10: refused whole
    assert sender.submit(encoded(4), 4)  # exactly full
    assert not sender.submit(encoded(1), 1)
    sender.count_dropped(3)  # what a caller does when has_room says no before encoding
    stats = sender.stats()
    assert (stats["dropped_spans"], stats["queue_len"]) == (5 + 1 + 3, 10)

    upstream.release()
    assert sender.force_flush(FLUSH_S)
    sender.shutdown(FLUSH_S)
    stats = sender.stats()
    assert (stats["sent_spans"], stats["dropped_spans"], stats["queue_len"]) == (15, 9, 0)
    assert upstream.span_count() == 15


def test_sender_without_an_endpoint_for_its_signal_takes_nothing(upstream: UpstreamOtlp) -> None:
    config = OtlpExporterConfig(
        traces_endpoint=f"{upstream.http_endpoint}/v1/traces", protocol=PROTOCOL_HTTP_PROTOBUF
    )
    metrics = OtlpSender(config, signal="metrics")
    assert (metrics.enabled, metrics.endpoint) == (False, None)
    assert not metrics.has_room(1)
    assert not metrics.submit(metric_request(2).SerializeToString(), 2)
    assert metrics.force_flush(0.1)
    metrics.shutdown(FLUSH_S)
    assert metrics.stats()["dropped_data_points"] == metrics.stats()["sent_data_points"] == 0
    assert upstream.calls == []


# --- flush and shutdown ------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_shutdown_sends_everything_queued_then_refuses(
    upstream: UpstreamOtlp, protocol: str
) -> None:
    upstream.set_delay(0.02)
    sender = make_sender(upstream, protocol)
    for _ in range(5):
        assert sender.submit(encoded(10), 10)
    sender.shutdown(FLUSH_S)
    assert upstream.span_count() == 50
    assert sender.stats()["sent_spans"] == 50

    assert not sender.has_room(4)
    assert not sender.submit(encoded(4), 4)  # after shutdown: counted, never sent
    assert sender.stats()["dropped_spans"] == 4
    assert upstream.span_count() == 50
    sender.shutdown(FLUSH_S)  # idempotent


@pytest.mark.parametrize("caller", ["submit", "send_now"])
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_shutdown_timeout_cancels_the_call_and_counts_the_rest(
    upstream: UpstreamOtlp, protocol: str, caller: str
) -> None:
    upstream.hold()
    sender = make_sender(upstream, protocol, timeout_s=30)
    if caller == "submit":  # the worker thread's call, two more queued
        for _ in range(3):
            sender.submit(encoded(10), 10)
        sending = None
    else:  # a call on the caller's own thread (the agent's emitter)
        sending = threading.Thread(target=sender.send_now, args=(encoded(10), 10))
        sending.start()
    assert upstream.wait_for_started_calls(1)
    assert not sender.force_flush(0.1)  # a request is in flight
    started = time.perf_counter()
    sender.shutdown(0.2)
    elapsed = time.perf_counter() - started
    if sending is not None:
        sending.join(FLUSH_S)
        assert not sending.is_alive()
    stats = sender.stats()
    dropped = 30 if caller == "submit" else 10
    assert (stats["sent_spans"], stats["dropped_spans"], stats["queue_len"]) == (0, dropped, 0)
    assert 0.2 <= elapsed < 0.8  # cancelled the held call instead of waiting out its timeout


def test_force_flush_reports_timeout_and_success(upstream: UpstreamOtlp) -> None:
    sender = make_sender(upstream, PROTOCOL_HTTP_PROTOBUF)
    assert sender.force_flush(0.1)  # nothing queued
    upstream.hold()
    sender.submit(encoded(2), 2)
    assert not sender.force_flush(0.1)
    upstream.release()
    assert sender.force_flush(FLUSH_S)
    assert sender.stats()["sent_spans"] == 2
    sender.shutdown(FLUSH_S)


# --- send_now: on the caller's thread (the agent's emitter) ------------------------------------
def _sender_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("tokentrace-otlp-")]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_send_now_delivers_on_the_calling_thread_without_a_worker(
    upstream: UpstreamOtlp, protocol: str
) -> None:
    upstream.reject_next(2, "bad spans")
    sender = make_sender(upstream, protocol)
    assert sender.send_now(encoded(5), 5)
    assert upstream.span_count() == 5  # delivered when it returns: no flush needed
    assert sender.force_flush(0.1)
    assert _sender_threads() == []
    stats = sender.stats()
    assert (stats["sent_spans"], stats["rejected_spans"], stats["dropped_spans"]) == (3, 2, 0)
    sender.shutdown(FLUSH_S)
    assert not sender.send_now(encoded(4), 4)  # after shutdown: counted, never sent
    assert sender.stats()["dropped_spans"] == 4
    assert upstream.span_count() == 5


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_gets_a_fresh_queue_and_worker(upstream: UpstreamOtlp) -> None:
    sender = make_sender(upstream, PROTOCOL_HTTP_PROTOBUF)
    upstream.hold()
    sender.submit(encoded(5), 5)  # in flight in the parent
    assert upstream.wait_for_started_calls(1)
    sender.submit(encoded(5), 5)  # queued in the parent
    pid = os.fork()
    if pid == 0:  # child: the parent's queue is not ours to send
        code = 1
        try:
            if (
                sender.stats()["queue_len"] == 0
                and sender.submit(encoded(3), 3)
                and sender.force_flush(FLUSH_S)
                and sender.stats()["sent_spans"] == 3
            ):
                code = 0
        finally:
            os._exit(code)
    threading.Timer(0.1, upstream.release).start()
    deadline = time.monotonic() + 10
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            pytest.fail("forked child did not finish")
        time.sleep(0.02)
    assert os.waitstatus_to_exitcode(status) == 0
    assert sender.force_flush(FLUSH_S)
    sender.shutdown(FLUSH_S)
    assert upstream.span_count() == 5 + 5 + 3  # nothing sent twice
    assert sum(1 for _ in iter_spans(upstream.trace_requests)) == 13


def test_an_http_sender_never_loads_grpc() -> None:
    code = (
        "import sys\n"
        "from tokentrace.agent.otlp_config import OtlpExporterConfig, RetryConfig\n"
        "from tokentrace.agent.otlp_export import OtlpSender\n"
        f"config = OtlpExporterConfig(endpoint='http://127.0.0.1:{unused_port()}',\n"
        "    retry=RetryConfig(max_elapsed_s=0))\n"
        "sender = OtlpSender(config, signal='traces')\n"
        "sender.submit(b'', 1)\n"
        "assert sender.force_flush(5)\n"
        "sender.shutdown(5)\n"
        "print('DROPPED', sender.stats()['dropped_spans'], 'GRPC', 'grpc' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=30
    )
    assert "DROPPED 1 GRPC False" in result.stdout


def test_rate_limited_warning_logs_first_then_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = {"s": 100.0}
    log = logging.getLogger("tests.rate_limited")
    warning = RateLimitedWarning(lambda: now["s"], interval_s=60.0, log=log)
    with caplog.at_level(logging.WARNING, logger=log.name):
        for count in range(1, 6):
            warning.warn("dropped %d", count)
        now["s"] += 59.0
        warning.warn("dropped %d", 6)
        now["s"] += 1.0
        warning.warn("dropped %d", 7)
    assert [r.getMessage() for r in caplog.records] == [
        "dropped 1",
        "dropped 7 (5 similar warnings suppressed)",
    ]


def test_rate_limited_warning_works_in_a_child_forked_while_its_lock_was_held() -> None:
    warning = RateLimitedWarning(interval_s=60.0, log=logging.getLogger("tests.rate_limited"))
    warning._lock.acquire()  # as if another thread was warning at fork time
    try:
        pid = os.fork()
        if pid == 0:  # child: the inherited lock would never be released here
            code = 1
            try:
                done = threading.Event()

                def warn() -> None:
                    warning.warn("x")
                    done.set()

                threading.Thread(target=warn).start()
                code = 0 if done.wait(5.0) else 2
            finally:
                os._exit(code)
    finally:
        warning._lock.release()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_senders_shut_down_together_each_with_the_same_time() -> None:
    # Each shutdown waits for the other to have started: in turn, the first would wait alone.
    both = threading.Barrier(2, timeout=5.0)
    given: list[float] = []

    def shutdown(timeout_s: float) -> None:
        given.append(timeout_s)
        both.wait()

    shut_down_together([shutdown, shutdown], 3.0)
    assert given == [3.0, 3.0]
    assert not both.broken
