"""One budget per latency metric: the time outside the server split by who spent it, the
client-seen TTFT, decode split by cause (TPOT/ITL), and every budget summing to its value."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.processors.test_budget import MS, US, arbitrary_timelines, typical
from tests.spanbuild import T0
from tokentrace.agent import semconv
from tokentrace.processors.budget import (
    apportion,
    compute_budget,
    metric_budget,
    request_record,
)
from tokentrace.processors.decode_split import decode_facts_of, gap_parts
from tokentrace.processors.model import RequestTimeline

CLIENT_SKEW = -3_600_000 * MS
"""The client's clock is an hour behind the server's: only its durations may be used."""


def with_client(duration_ms: float, **client: object) -> RequestTimeline:
    """``typical()`` (server 0..100 ms, first token at 40 ms) seen by a client for
    ``duration_ms``, with a first token 50 ms after its start unless given."""
    start = T0 + CLIENT_SKEW
    fields: dict[str, object] = {
        "client_start": start,
        "client_end": start + int(duration_ms * MS),
        "client_first_token": start + 50 * MS,
    }
    fields.update(client)
    return typical(**fields)


def test_the_time_outside_the_server_is_split_by_who_measured_it() -> None:
    # 160 ms seen by the client, 100 by the server: 60 ms outside.
    timeline = with_client(
        160,
        client_connect_ns=7 * MS,
        client_send_wait_ns=3 * MS,
        client_read_wait_ns=5 * MS,
        http_receive_wait_ns=20 * MS,
    )
    budget = compute_budget(timeline)
    segments = budget.segments
    assert segments[semconv.SEGMENT_CONNECT] == 7 * MS
    assert segments[semconv.SEGMENT_CLIENT] == 8 * MS  # send + read wait
    assert segments[semconv.SEGMENT_HTTP] == 2 * MS + 20 * MS  # before the engine + kernel wait
    assert segments[semconv.SEGMENT_NETWORK] == 60 * MS - 7 * MS - 8 * MS - 20 * MS
    assert sum(segments.values()) == budget.e2e_ns == 160 * MS
    assert budget.server_e2e_ns == 100 * MS
    record = request_record(timeline)
    assert record.metrics.e2e == 100 * MS  # what SLOs judge: the server's
    assert record.metrics.network == 25 * MS


def test_claims_larger_than_the_gap_are_capped_in_order() -> None:
    # Only 10 ms outside: connection setup takes it all, nothing is negative.
    budget = compute_budget(with_client(110, client_connect_ns=8 * MS, client_send_wait_ns=5 * MS))
    segments = budget.segments
    assert segments[semconv.SEGMENT_CONNECT] == 8 * MS
    assert segments[semconv.SEGMENT_CLIENT] == 2 * MS
    assert segments[semconv.SEGMENT_NETWORK] == 0
    assert min(segments.values()) >= 0 and sum(segments.values()) == 110 * MS


def test_a_client_span_without_facts_leaves_the_gap_to_network() -> None:
    budget = compute_budget(with_client(130))
    assert budget.segments[semconv.SEGMENT_NETWORK] == 30 * MS
    assert budget.segments[semconv.SEGMENT_CLIENT] == 0


def test_client_seen_ttft_adds_delivery_and_the_outside_time() -> None:
    # Server TTFT 40 ms; its first body bytes left at 46 ms; the client saw TTFT 70 ms.
    timeline = with_client(
        160,
        client_first_token=T0 + CLIENT_SKEW + 70 * MS,
        server_first_body=T0 + 46 * MS,
        client_connect_ns=4 * MS,
        client_first_token_read_wait_ns=2 * MS,
        http_receive_wait_ns=5 * MS,
    )
    budget = compute_budget(timeline)
    assert budget.ttft_ns == 40 * MS
    assert budget.client_ttft_ns == 70 * MS
    client = budget.client_ttft_segments
    assert sum(client.values()) == 70 * MS
    assert client[semconv.SEGMENT_QUEUE] == budget.ttft_segments[semconv.SEGMENT_QUEUE]
    # http: 2 ms before the engine + 6 ms delivering the first token + 5 ms in the kernel
    assert client[semconv.SEGMENT_HTTP] == 2 * MS + 6 * MS + 5 * MS
    assert client[semconv.SEGMENT_CONNECT] == 4 * MS
    assert client[semconv.SEGMENT_CLIENT] == 2 * MS
    assert client[semconv.SEGMENT_NETWORK] == 70 * MS - 46 * MS - 4 * MS - 2 * MS - 5 * MS


def test_server_seen_views_exclude_the_client_side() -> None:
    record = request_record(with_client(160, http_receive_wait_ns=20 * MS))
    server = metric_budget(record, semconv.METRIC_E2E, clock=semconv.CLOCK_SERVER)
    client = metric_budget(record, semconv.METRIC_E2E)
    assert server is not None and client is not None
    assert client.clock == semconv.CLOCK_CLIENT and client.value_ns == 160 * MS
    assert server.value_ns == 100 * MS == record.metrics.e2e
    assert server.segments[semconv.SEGMENT_HTTP] == 2 * MS  # the kernel wait is outside
    assert all(server.segments[name] == 0 for name in semconv.CLIENT_SIDE_SEGMENTS)
    assert sum(server.segments.values()) == server.value_ns
    ttft = metric_budget(record, semconv.METRIC_TTFT, clock=semconv.CLOCK_SERVER)
    assert ttft is not None and ttft.value_ns == record.metrics.ttft


def test_without_a_client_span_only_server_views_exist() -> None:
    record = request_record(typical())
    assert metric_budget(record, semconv.METRIC_TTFT, clock=semconv.CLOCK_CLIENT) is None
    default = metric_budget(record, semconv.METRIC_E2E)
    assert default is not None and default.clock == semconv.CLOCK_SERVER


def decoding(offsets_ms: list[float], **fields: object) -> RequestTimeline:
    """First token at 40 ms, tokens at the given offsets after it; server end after the last."""
    offsets_us = [int(offset * 1000) for offset in offsets_ms]
    last = T0 + 40 * MS + offsets_us[-1] * US
    return typical(
        token_offsets_us=offsets_us,
        last_token=last,
        end=last,
        server_end=last + 1 * MS,
        output_tokens=len(offsets_us),
        **fields,
    )


STEADY = [0, 10, 20, 30, 40, 50, 60, 70, 80]
"""Nine tokens 10 ms apart."""


def slow_gap(extra_ms: float) -> list[float]:
    """``STEADY`` with the gap before the sixth token stretched by ``extra_ms``."""
    return [offset + (extra_ms if index >= 5 else 0) for index, offset in enumerate(STEADY)]


def at(offset_ms: float) -> int:
    return T0 + 40 * MS + int(offset_ms * MS)


def test_steady_gaps_are_the_requests_own_pace() -> None:
    record = request_record(decoding(STEADY))
    split = decode_facts_of(record).split
    assert split[semconv.SEGMENT_DECODE] == record.budget.segments[semconv.SEGMENT_DECODE]
    assert split[semconv.SEGMENT_INTERFERENCE] == split[semconv.SEGMENT_STALL] == 0
    itl = metric_budget(record, semconv.METRIC_ITL)
    assert itl is not None and itl.segments == {semconv.SEGMENT_DECODE: 80 * MS}


def test_a_slow_gap_with_a_co_scheduled_prefill_is_interference() -> None:
    # The gap 40 -> 90 ms (50 ms, median 10): one step 40..90 that prefilled 512 tokens.
    timeline = decoding(slow_gap(40), engine_steps=[(at(40), at(90), 512)])
    record = request_record(timeline)
    (part,) = decode_facts_of(record).outlier_gaps
    assert part.gap_ns == 50 * MS
    assert part.interference_ns == 40 * MS  # the excess over the median gap
    assert part.decode_ns == 10 * MS
    assert decode_facts_of(record).split[semconv.SEGMENT_INTERFERENCE] == 40 * MS
    itl = metric_budget(record, semconv.METRIC_ITL)
    assert itl is not None
    assert itl.value_ns == 50 * MS
    assert itl.segments[semconv.SEGMENT_INTERFERENCE] == 40 * MS


def test_a_slow_gap_without_a_step_of_the_request_is_a_stall() -> None:
    # Steps were exported for the request, but none covers most of the slow gap.
    steps = [(at(40), at(45), 0), (at(85), at(90), 0)]
    record = request_record(decoding(slow_gap(40), engine_steps=steps))
    assert decode_facts_of(record).split[semconv.SEGMENT_STALL] == 40 * MS
    assert decode_facts_of(record).split[semconv.SEGMENT_INTERFERENCE] == 0


def test_a_slow_step_of_the_request_alone_stays_decode() -> None:
    record = request_record(decoding(slow_gap(40), engine_steps=[(at(40), at(90), 0)]))
    assert decode_facts_of(record).split[semconv.SEGMENT_STALL] == 0
    assert decode_facts_of(record).split[semconv.SEGMENT_INTERFERENCE] == 0


def test_without_step_data_the_excess_stays_decode() -> None:
    record = request_record(decoding(slow_gap(40)))
    assert decode_facts_of(record).split[semconv.SEGMENT_INTERFERENCE] == 0
    assert decode_facts_of(record).split[semconv.SEGMENT_STALL] == 0


def test_a_count_of_prefill_outliers_marks_the_largest_gaps() -> None:
    # Two slow gaps (30 and 60 ms over), no step spans, the agent counted one with a prefill.
    offsets = [0, 10, 20, 60, 70, 80, 150, 160, 170]
    record = request_record(decoding(offsets, outlier_steps_with_prefill=1))
    parts = decode_facts_of(record).outlier_gaps
    assert [part.gap_ns for part in parts] == [40 * MS, 70 * MS]
    assert parts[1].interference_ns == 60 * MS and parts[0].interference_ns == 0


def test_a_count_of_prefill_outliers_marks_equal_gaps_in_token_order() -> None:
    # Two slow gaps of 60 ms (50 over the median), no step spans, one counted with a prefill.
    offsets = [0, 10, 20, 80, 90, 100, 160, 170]
    record = request_record(decoding(offsets, outlier_steps_with_prefill=1))
    parts = decode_facts_of(record).outlier_gaps
    assert [part.gap_ns for part in parts] == [60 * MS, 60 * MS]
    assert [part.interference_ns for part in parts] == [50 * MS, 0]


def test_preemption_inside_a_gap_is_preempted_not_interference() -> None:
    timeline = decoding(
        slow_gap(40),
        engine_steps=[(at(40), at(90), 512)],
        preempted=[(at(45), at(75))],
    )
    record = request_record(timeline)
    (part,) = decode_facts_of(record).outlier_gaps
    assert part.preempted_ns == 30 * MS
    assert part.interference_ns == 10 * MS  # 40 ms over the median, less the preemption
    assert part.decode_ns + part.interference_ns + part.preempted_ns == part.gap_ns


def test_tpot_budget_is_the_time_after_the_first_token_per_token() -> None:
    record = request_record(decoding(slow_gap(40), engine_steps=[(at(40), at(90), 512)]))
    tpot = metric_budget(record, semconv.METRIC_TPOT)
    assert tpot is not None
    assert tpot.value_ns == record.metrics.tpot
    assert sum(tpot.segments.values()) == tpot.value_ns
    # 121 ms after the first token over 8 tokens: 40 ms of it interference.
    assert tpot.segments[semconv.SEGMENT_INTERFERENCE] == pytest.approx(40 * MS / 8, abs=1)


@pytest.mark.parametrize(
    ("parts", "total"),
    [({"a": 1, "b": 1, "c": 1}, 10), ({"a": 0, "b": 0}, 5), ({"a": 7}, 0), ({"a": 3, "b": 9}, 1)],
)
def test_apportion_sums_exactly(parts: dict[str, int], total: int) -> None:
    scaled = apportion(parts, total)
    assert sum(scaled.values()) == total
    assert all(value >= 0 for value in scaled.values())


def test_gap_parts_of_all_gaps_cover_every_gap() -> None:
    timeline = decoding(slow_gap(40), engine_steps=[(at(40), at(90), 512)])
    parts = gap_parts(timeline)
    assert len(parts) == len(STEADY) - 1
    assert [part.outlier for part in parts].count(True) == 1
    assert all(sum(part.segments().values()) == part.gap_ns for part in parts)


client_facts = st.one_of(st.none(), st.integers(0, 500 * MS))


@given(
    arbitrary_timelines(),
    client_facts,
    client_facts,
    client_facts,
    client_facts,
    st.one_of(st.none(), st.integers(T0 - 10**9, T0 + 10**9)),
    st.lists(
        st.tuples(st.integers(T0 - 10**9, T0 + 10**9), st.integers(0, 10**8), st.integers(0, 9)),
        max_size=4,
    ),
    st.one_of(st.none(), st.integers(0, 5)),
)
@settings(max_examples=300)
def test_every_metric_budget_sums_to_its_value(
    timeline: RequestTimeline,
    connect: int | None,
    send_wait: int | None,
    read_wait: int | None,
    receive_wait: int | None,
    first_body: int | None,
    steps: list[tuple[int, int, int]],
    with_prefill: int | None,
) -> None:
    timeline.client_connect_ns = connect
    timeline.client_send_wait_ns = send_wait
    timeline.client_read_wait_ns = read_wait
    timeline.client_first_token_read_wait_ns = read_wait
    timeline.http_receive_wait_ns = receive_wait
    timeline.server_first_body = first_body
    timeline.engine_steps = sorted((start, start + span, tokens) for start, span, tokens in steps)
    timeline.outlier_steps_with_prefill = with_prefill
    record = request_record(timeline)
    budget = record.budget
    assert sum(budget.segments.values()) == budget.e2e_ns
    split = decode_facts_of(record).split
    if split:
        assert sum(split.values()) == budget.segments[semconv.SEGMENT_DECODE]
    for metric in (*semconv.LATENCY_METRICS[:4],):
        for clock in (semconv.CLOCK_SERVER, semconv.CLOCK_CLIENT):
            view = metric_budget(record, metric, clock=clock)
            if view is None:
                continue
            assert all(ns >= 0 for ns in view.segments.values()), (metric, clock, view)
            assert sum(view.segments.values()) == view.value_ns, (metric, clock, view)
