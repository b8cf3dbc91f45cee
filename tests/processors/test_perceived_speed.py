"""Perceived speed: what users felt beyond the latency metrics (streaming, first byte,
connections), from a window's client spans."""

from __future__ import annotations

from tests.processors.test_diagnosis import MS, make_record
from tokentrace.agent import semconv
from tokentrace.processors.model import RequestRecord
from tokentrace.processors.window.perceived_speed import perceived_speed


def client_record(
    *, stream: bool | None, reused: bool | None, connect_ms: float | None, first_byte_ms: float
) -> RequestRecord:
    record = make_record(
        {semconv.SEGMENT_NETWORK: 5 * MS, semconv.SEGMENT_DECODE: 900 * MS},
        client_stream=stream,
        client_connection_reused=reused,
        client_connect_ns=None if connect_ms is None else int(connect_ms * MS),
    )
    timeline = record.timeline
    assert timeline.client_start is not None
    timeline.client_first_byte = timeline.client_start + int(first_byte_ms * MS)
    return record


def test_perceived_speed_flags_what_hurts() -> None:
    records = [
        client_record(stream=False, reused=False, connect_ms=90, first_byte_ms=240)
        for _ in range(6)
    ]
    records += [
        client_record(stream=True, reused=True, connect_ms=None, first_byte_ms=20) for _ in range(4)
    ]
    perceived = perceived_speed(records)
    kinds = {issue["kind"]: issue for issue in perceived["issues"]}
    assert set(kinds) == {"not_streamed", "first_byte", "new_connections"}
    assert kinds["not_streamed"]["share"] == 0.6
    assert "60% of requests were not streamed" in kinds["not_streamed"]["sentence"]
    assert kinds["first_byte"]["p95_ms"] == 240
    assert kinds["new_connections"]["p95_ms"] == 90
    assert "reuse connections" in kinds["new_connections"]["sentence"]


def test_perceived_speed_is_quiet_when_nothing_hurts() -> None:
    records = [
        client_record(stream=True, reused=True, connect_ms=None, first_byte_ms=5) for _ in range(10)
    ]
    perceived = perceived_speed(records)
    assert perceived["issues"] == []
    assert perceived["requests"] == 10 and perceived["not_streamed"] == 0
    assert perceived_speed([make_record({semconv.SEGMENT_DECODE: MS})]) == {
        "requests": 0,
        "issues": [],
    }
