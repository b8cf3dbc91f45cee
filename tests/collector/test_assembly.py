from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tokentrace.collector.assembly import TraceAssembler
from tokentrace.collector.consumer import Overloaded
from tokentrace.processors.model import AssembledTrace, SpanRef

RESOURCE = Resource()
SCOPE = InstrumentationScope()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def ref(trace: int, span: int, parent: int | None) -> SpanRef:
    message = Span(
        trace_id=trace.to_bytes(16, "big"),
        span_id=span.to_bytes(8, "big"),
        parent_span_id=b"" if parent is None else parent.to_bytes(8, "big"),
        start_time_unix_nano=1,
        end_time_unix_nano=2,
    )
    return SpanRef(message, RESOURCE, SCOPE, "svc")


def add(assembler: TraceAssembler, *refs: SpanRef) -> None:
    groups: dict[bytes, list[SpanRef]] = {}
    for r in refs:
        groups.setdefault(r.span.trace_id, []).append(r)
    assembler.add(groups, len(refs))


def make(clock: FakeClock, **overrides: int | float) -> TraceAssembler:
    options = dict(
        quiet_period_s=2.0,
        root_grace_s=0.2,
        max_traces=100,
        max_spans_per_trace=100,
        max_pending_spans=1000,
    )
    options.update(overrides)
    return TraceAssembler(clock=clock, **options)  # type: ignore[arg-type]


def test_trace_finishes_after_quiet_period_without_root() -> None:
    clock = FakeClock()
    assembler = make(clock)
    add(assembler, ref(1, 2, parent=1))
    clock.now += 1.0
    add(assembler, ref(1, 3, parent=1))
    clock.now += 1.9  # 1.9 s since the last span: still waiting
    assert assembler.pop_finished() == []
    clock.now += 0.2
    (trace,) = assembler.pop_finished()
    assert trace.trace_id == (1).to_bytes(16, "big")
    assert [r.span.span_id[-1] for r in trace.spans] == [2, 3]
    assert assembler.pending_spans == 0


def test_root_span_finishes_trace_after_grace_not_quiet_period() -> None:
    clock = FakeClock()
    assembler = make(clock)
    add(assembler, ref(1, 2, parent=1), ref(1, 1, parent=None))
    add(assembler, ref(5, 9, parent=4))
    clock.now += 0.1
    assert assembler.pop_finished() == []
    add(assembler, ref(1, 3, parent=1))  # a late child within the grace period is included
    clock.now += 0.15
    finished = assembler.pop_finished()
    assert [t.trace_id[-1] for t in finished] == [1]
    assert len(finished[0].spans) == 3
    assert assembler.pending_traces == 1


def test_max_traces_finishes_oldest_early_and_counts() -> None:
    clock = FakeClock()
    assembler = make(clock, max_traces=2)
    for trace in (1, 2, 3):
        add(assembler, ref(trace, 1, parent=7))
        clock.now += 0.01
    assert assembler.stats.traces_finished_early == 1
    finished = assembler.pop_finished()
    assert [t.trace_id[-1] for t in finished] == [1]
    assert assembler.pending_traces == 2


def test_spans_over_per_trace_cap_are_dropped_and_counted() -> None:
    clock = FakeClock()
    assembler = make(clock, max_spans_per_trace=3)
    add(assembler, *[ref(1, s, parent=99) for s in range(1, 6)])
    add(assembler, ref(1, 6, parent=99))
    assert assembler.stats.spans_dropped == 3
    (trace,) = assembler.pop_finished(flush_all=True)
    assert len(trace.spans) == 3


def test_pending_span_limit_refuses_with_retry_hint_and_recovers() -> None:
    clock = FakeClock()
    assembler = make(clock, max_pending_spans=4)
    add(assembler, *[ref(1, s, parent=99) for s in range(1, 4)])
    with pytest.raises(Overloaded) as refused:
        add(assembler, ref(2, 1, parent=99), ref(2, 2, parent=99))
    assert refused.value.retry_after_s > 0
    assert assembler.stats.refused_batches == 1
    assert assembler.pending_traces == 1  # the refused batch left no trace behind
    clock.now += 5
    assembler.pop_finished()
    add(assembler, ref(2, 1, parent=99), ref(2, 2, parent=99))
    assert assembler.pending_spans == 2


def test_late_spans_are_counted_and_assembled_as_fragment() -> None:
    clock = FakeClock()
    assembler = make(clock)
    add(assembler, ref(1, 1, parent=None))
    clock.now += 1
    assert len(assembler.pop_finished()) == 1
    add(assembler, ref(1, 2, parent=1))
    assert assembler.stats.late_spans == 1
    (fragment,) = assembler.pop_finished(flush_all=True)
    assert len(fragment.spans) == 1


def test_traces_finished_early_still_count_as_pending_until_popped() -> None:
    clock = FakeClock()
    assembler = make(clock, max_traces=1, max_pending_spans=5)
    for trace in range(1, 6):
        add(assembler, ref(trace, 1, parent=9))  # each new trace evicts the previous one early
    assert assembler.pending_traces == 1 and assembler.pending_spans == 5
    with pytest.raises(Overloaded):
        add(assembler, ref(6, 1, parent=9))
    finished = assembler.pop_finished()
    assert len(finished) == 4 and assembler.pending_spans == 1
    assert assembler.stats.traces_finished == 4  # each early trace counted once


def test_received_spans_count_every_accepted_span() -> None:
    assembler = make(FakeClock())
    add(assembler, ref(1, 1, parent=None), ref(1, 2, parent=1), ref(2, 1, parent=9))
    assert assembler.stats.received_spans == 3


def test_a_late_fragment_finished_early_stays_late() -> None:
    clock = FakeClock()
    assembler = make(clock, max_traces=1)
    add(assembler, ref(1, 1, parent=None))
    clock.now += 1
    assert len(assembler.pop_finished()) == 1
    add(assembler, ref(1, 2, parent=1))  # late
    add(assembler, ref(2, 1, parent=None))  # finishes the fragment early
    (fragment,) = assembler.pop_finished()
    assert fragment.late
    assert [r.span.span_id[-1] for r in fragment.spans] == [2]


def test_late_spans_finished_with_their_early_part_join_it() -> None:
    clock = FakeClock()
    assembler = make(clock, max_traces=1)
    add(assembler, ref(1, 2, parent=1))
    add(assembler, ref(2, 1, parent=None))  # finishes trace 1 early; not popped yet
    add(assembler, ref(1, 1, parent=None))  # late for trace 1
    finished = assembler.pop_finished(flush_all=True)
    assert [(t.trace_id[-1], t.late, len(t.spans)) for t in finished] == [
        (1, False, 2),
        (2, False, 1),
    ]
    assert assembler.pending_spans == 0 and assembler.pending_traces == 0
    assert assembler.stats.traces_finished == 2


def test_a_batch_takes_at_most_max_traces_oldest_first_and_the_rest_stay_pending() -> None:
    clock = FakeClock()
    assembler = make(clock)
    for trace in range(1, 6):
        add(assembler, ref(trace, 2, parent=1))
        clock.now += 0.01
    clock.now += 3.0  # all five are quiet now
    batches = []
    while batch := assembler.pop_finished(max_traces=2):
        batches.append([t.trace_id[-1] for t in batch])
    assert batches == [[1, 2], [3, 4], [5]]
    assert assembler.pending_spans == 0


class _WalkingWholeBacklog(TraceAssembler):
    """The assembler as it was: every complete trace listed for every batch, then cut."""

    def _ready(
        self, now: float, max_traces: int | None, early_by_id: dict[bytes, AssembledTrace]
    ) -> list[bytes]:
        quiet_before, root_before = now - self._quiet_period_s, now - self._root_grace_s
        quiet = [t for t, pending in self._pending.items() if pending.last_update <= quiet_before]
        return quiet + [t for t, seen_at in self._root_done.items() if seen_at <= root_before]


_STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 6), st.booleans()),
        st.tuples(st.just("tick"), st.sampled_from([0.0, 0.1, 0.3, 2.5])),
        st.tuples(st.just("pop"), st.integers(1, 2)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(_STEPS)
def test_batches_stop_walking_at_max_traces_and_pop_what_a_whole_walk_popped(
    steps: list[tuple[object, ...]],
) -> None:
    clocks = FakeClock(), FakeClock()
    # Room for three traces: a fourth finishes the oldest early, whose later spans then wait
    # beside it (the early part must take them along however many come before them).
    options = {"max_traces": 3, "max_pending_spans": 10_000}
    assemblers = (
        make(clocks[0], **options),
        _WalkingWholeBacklog(
            clock=clocks[1],
            quiet_period_s=2.0,
            root_grace_s=0.2,
            max_spans_per_trace=100,
            **options,
        ),
    )
    span_ids = itertools.count(100)
    for step in steps:
        if step[0] == "add":
            trace, root = step[1], step[2]
            span = next(span_ids)
            for assembler in assemblers:
                add(assembler, ref(int(trace), span, parent=None if root else 1))
        elif step[0] == "tick":
            for clock in clocks:
                clock.now += float(step[1])
        else:
            popped = [
                [(t.trace_id, t.late, [r.span.span_id for r in t.spans]) for t in batch]
                for batch in (a.pop_finished(max_traces=int(step[1])) for a in assemblers)
            ]
            assert popped[0] == popped[1]
    assert assemblers[0].pending_traces == assemblers[1].pending_traces
    assert assemblers[0].pending_spans == assemblers[1].pending_spans


def test_an_early_finished_part_takes_its_later_spans_along_past_max_traces() -> None:
    clock = FakeClock()
    assembler = make(clock, max_traces=3)
    for trace in (1, 2, 3, 4):  # the fourth finishes trace 1 early
        add(assembler, ref(trace, 10 + trace, parent=1))
    add(assembler, ref(1, 20, parent=1))  # trace 1's later spans, behind 3 and 4
    clock.now += 2.5  # all quiet
    batches = []
    while batch := assembler.pop_finished(max_traces=1):
        batches.append([(t.trace_id[-1], t.late, len(t.spans)) for t in batch])
    # Trace 1 once, whole: its early part and the spans after it (2 finished early as well).
    assert batches == [[(1, False, 2), (2, False, 1), (3, False, 1)], [(4, False, 1)]]
