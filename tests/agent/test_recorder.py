from __future__ import annotations

import logging

import pytest

from tokentrace.agent.finished_request import PREFIX_HASH_TOKENS
from tokentrace.agent.hooks import HookGuard
from tokentrace.agent.recorder import (
    PROMPT_TOKEN_IDS,
    MonotonicToUnix,
    Recorder,
    RequestTimer,
    to_finished_request,
)


class Ticks:
    """A monotonic clock under the test's control."""

    def __init__(self, start: int = 1_000_000_000) -> None:
        self.now = start

    def __call__(self) -> int:
        return self.now


WALL_OFFSET = 1_700_000_000_000_000_000


def fixed_domain(ticks: Ticks) -> MonotonicToUnix:
    return MonotonicToUnix(wall_ns=lambda: ticks.now + WALL_OFFSET, monotonic_ns=ticks)


def test_a_request_life_becomes_a_finished_request_in_unix_time() -> None:
    ticks = Ticks()
    finished: list[RequestTimer] = []
    recorder = Recorder(finished.append, monotonic_ns=ticks)
    timer = recorder.begin("req-1")
    assert timer is not None
    timer.attributes.update(model="m", operation="chat", input_tokens=12, output_tokens=3)
    timer.queued_ns = ticks.now + 2_000_000
    ticks.now += 5_000_000
    timer.first_scheduled_ns = ticks.now
    for _ in range(3):
        ticks.now += 10_000_000
        timer.token_ns.append(ticks.now)
    ticks.now += 1_000_000
    recorder.finish("req-1")
    (done,) = finished
    assert recorder.in_flight == 0

    request = to_finished_request(done, fixed_domain(ticks))
    assert request.arrival_ns == 1_000_000_000 + WALL_OFFSET
    assert request.queued_ns == request.arrival_ns + 2_000_000
    assert request.first_scheduled_ns == request.arrival_ns + 5_000_000
    assert request.first_token_ns == request.first_scheduled_ns + 10_000_000
    assert request.last_token_ns == request.first_token_ns + 20_000_000
    assert request.end_ns == request.last_token_ns + 1_000_000
    assert request.token_offsets_us == [0, 10_000, 20_000]
    assert (request.model, request.operation, request.input_tokens) == ("m", "chat", 12)


def test_prompts_sharing_their_first_tokens_share_a_prefix_hash_computed_off_the_serving_path() -> (
    None
):
    ticks = Ticks()
    finished: list[RequestTimer] = []
    recorder = Recorder(finished.append, monotonic_ns=ticks)
    system = list(range(1000, 1000 + PREFIX_HASH_TOKENS))
    prompts = {
        "shared-a": [*system, 1, 2, 3],
        "shared-b": system + [9] * 40,
        "other": [7, *system],
        "short": system[:-1],
        "unknown": None,
    }
    for request_id, token_ids in prompts.items():
        timer = recorder.begin(request_id)
        assert timer is not None
        timer.attributes[PROMPT_TOKEN_IDS] = token_ids
        recorder.finish(request_id)
    hashes = {
        timer.request_id: to_finished_request(timer, fixed_domain(ticks)).prefix_hash
        for timer in finished
    }
    assert hashes["shared-a"] is not None and hashes["shared-a"] == hashes["shared-b"]
    assert hashes["other"] is not None and hashes["other"] != hashes["shared-a"]
    assert hashes["short"] is None and hashes["unknown"] is None


def test_preemption_intervals_and_an_abort_while_evicted() -> None:
    ticks = Ticks()
    finished: list[RequestTimer] = []
    recorder = Recorder(finished.append, monotonic_ns=ticks)
    timer = recorder.begin("r")
    assert timer is not None
    timer.preempt(ticks.now + 1)
    timer.preempt(ticks.now + 2)  # a second eviction notice while evicted changes nothing
    timer.resume(ticks.now + 5)
    timer.preempt(ticks.now + 8)
    ticks.now += 10
    recorder.finish("r", status_error="client disconnected")
    request = to_finished_request(finished[0], fixed_domain(ticks))
    start = 1_000_000_000 + WALL_OFFSET
    assert request.preempted == [(start + 1, start + 5), (start + 8, start + 10)]
    assert request.status_error == "client disconnected"
    assert request.first_token_ns is None and request.token_offsets_us == []
    assert request.queued_ns is None  # never reported: llm.queue starts at arrival


def test_an_end_read_before_the_bookkeeping_is_the_requests_end() -> None:
    """``finish(end_ns=...)``: an instrumentation that reads the clock when the host's call
    returned, then does its own work, ends the request at that reading, not later."""
    ticks = Ticks()
    finished: list[RequestTimer] = []
    recorder = Recorder(finished.append, monotonic_ns=ticks)
    recorder.begin("r")
    returned_at = ticks.now + 7
    ticks.now += 50  # the instrumentation's own work after the call
    recorder.finish("r", end_ns=returned_at)
    assert finished[0].end_ns == returned_at
    recorder.begin("s")
    recorder.finish("s")
    assert finished[1].end_ns == ticks.now


def test_in_flight_limit_leaves_requests_untraced_and_counts_them() -> None:
    recorder = Recorder(lambda timer: None, max_in_flight=2)
    assert recorder.begin("a") and recorder.begin("b")
    assert recorder.begin("c") is None
    assert recorder.untraced_requests == 1
    recorder.finish("c")  # unknown ids are ignored
    recorder.finish("a")
    assert recorder.begin("c") is not None


def test_monotonic_to_unix_follows_a_wall_clock_step_only_after_refresh() -> None:
    ticks = Ticks()
    wall = {"offset": WALL_OFFSET}
    domain = MonotonicToUnix(wall_ns=lambda: ticks.now + wall["offset"], monotonic_ns=ticks)
    wall["offset"] += 3_000_000_000  # NTP steps the wall clock by 3 s
    assert domain.to_unix_ns(ticks.now) == ticks.now + WALL_OFFSET  # phases stay consistent
    ticks.now += 11_000_000_000  # past the refresh interval
    assert domain.to_unix_ns(ticks.now) == ticks.now + WALL_OFFSET + 3_000_000_000


def test_hook_guard_disables_a_failing_hook_and_counts(caplog: pytest.LogCaptureFixture) -> None:
    guard = HookGuard()
    calls: list[int] = []

    def flaky(value: int) -> int:
        calls.append(value)
        if value == 2:
            raise RuntimeError("bug in tracing")
        return value * 10

    with caplog.at_level(logging.WARNING):
        assert guard.run("flaky", flaky, 1) == 10
        assert guard.run("flaky", flaky, 2) is None
        assert guard.run("flaky", flaky, 3) is None  # disabled: not called again
    assert calls == [1, 2]
    assert guard.stats() == {"hook_failures.flaky": 1}
    assert sum("disabled" in record.message for record in caplog.records) == 1


S = 1_000_000_000


def test_timers_without_an_end_expire_after_max_age_on_a_later_begin() -> None:
    ticks = Ticks()
    finished: list[RequestTimer] = []
    recorder = Recorder(finished.append, max_age_s=600, monotonic_ns=ticks)
    leaked = recorder.begin("leaked")
    assert leaked is not None
    leaked.token_ns.append(ticks.now + 7 * S)  # the last thing ever seen of it
    ticks.now += 300 * S
    young = recorder.begin("young")
    ticks.now += 301 * S  # "leaked" is 601 s old, "young" 301 s
    for index in range(254):  # begins 3..256: the 256th looks for expired timers
        assert recorder.get("leaked") is leaked
        recorder.begin(f"r{index}")
    assert finished == [leaked]
    assert leaked.status_error == "expired: no end seen"
    assert leaked.end_ns == leaked.token_ns[-1]  # not the expiry time: no phantom 600 s tail
    assert recorder.expired_requests == 1
    assert recorder.get("leaked") is None and recorder.get("young") is young
    recorder.finish("leaked")  # a late end for an expired timer is ignored
    assert finished == [leaked]


def test_a_full_table_expires_old_timers_before_refusing() -> None:
    ticks = Ticks()
    finished: list[RequestTimer] = []
    recorder = Recorder(finished.append, max_in_flight=2, max_age_s=10, monotonic_ns=ticks)
    recorder.begin("a")
    recorder.begin("b")
    assert recorder.begin("c") is None  # full, and nothing is old enough to expire
    ticks.now += 11 * S
    assert recorder.begin("d") is not None
    assert [timer.request_id for timer in finished] == ["a", "b"]
    assert (recorder.expired_requests, recorder.untraced_requests) == (2, 1)


def test_untraced_and_expired_requests_are_warned_at_most_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ticks = Ticks()
    recorder = Recorder(lambda timer: None, max_in_flight=1, max_age_s=3600, monotonic_ns=ticks)
    recorder.begin("open")
    with caplog.at_level(logging.WARNING, logger="tokentrace.agent.recorder"):
        for _ in range(100):
            recorder.begin("refused")
        ticks.now += 61 * S
        recorder.begin("refused")
        ticks.now += 3600 * S
        recorder.begin("expires the open one")
    messages = [record.getMessage() for record in caplog.records]
    untraced = [m for m in messages if "untraced_requests" in m]
    assert len(untraced) == 2
    assert "TOKENTRACE_MAX_IN_FLIGHT" in untraced[0]
    assert "99 similar warnings suppressed" in untraced[1]
    (expired,) = [m for m in messages if "expired_requests" in m]
    assert "max_age_s" in expired
