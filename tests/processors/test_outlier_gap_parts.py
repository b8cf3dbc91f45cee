"""``processors/_native.c``'s ``outlier_gap_parts`` against the Python it stands for:
``decode_split.gap_parts`` over a request's outlier gaps gives the same parts with the C function
and without it (``native.outlier_gap_parts`` answering None), over generated requests: token
offsets in any order, engine steps with and without prefills inside and around the gaps,
preemptions, the agent's count of interfered gaps, and times far past 2**53."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.processors.test_budget import make_timeline
from tests.spanbuild import T0
from tokentrace.processors import decode_split, native
from tokentrace.processors.budget import inter_token_gaps_ns
from tokentrace.processors.model import GapParts, RequestTimeline

pytestmark = pytest.mark.skipif(
    native.outlier_gap_parts(array("q"), array("q", [0]), 0, 0, 0, [], [], 0) is None,
    reason="processors/_native.c is not built here",
)

_INT64 = 2**63 - 1


@st.composite
def _requests(draw: st.DrawFn) -> RequestTimeline:
    first_token = draw(
        st.sampled_from([T0, 0, 2**53 + 1, _INT64 - 10**12]) | st.integers(0, _INT64)
    )
    steady = draw(st.integers(1, 20_000))
    offsets = [0]
    for _ in range(draw(st.integers(1, 60))):
        step = draw(
            st.one_of(
                st.integers(steady - 5, steady + 5),
                st.integers(0, 40 * steady),  # slow gaps
                st.sampled_from([30 * steady, 40 * steady]),  # equally slow ones
                st.integers(-steady, 0),  # offsets out of order
            )
        )
        offsets.append(offsets[-1] + step)
    if draw(st.integers(0, 20)) == 0:
        offsets.append(draw(st.integers(-(2**62), 2**62)))  # past 64 bits in ns
    ns = [first_token + offset * 1000 for offset in offsets]
    span = (min(ns), max(ns) + 1)

    def moment() -> int:
        return draw(st.integers(span[0] - 10**6, span[1] + 10**6))

    steps = sorted(
        (start, start + draw(st.integers(0, 100 * steady * 1000)), draw(st.sampled_from([0, 0, 7])))
        for start in (moment() for _ in range(draw(st.just(0) | st.integers(1, 8))))
    )
    edges = sorted(moment() for _ in range(2 * draw(st.integers(0, 3))))
    preempted = [(edges[i], edges[i + 1]) for i in range(0, len(edges), 2)]
    return make_timeline(
        first_token=first_token,
        token_offsets_us=array("q", offsets) if max(map(abs, offsets)) < 2**62 else offsets,
        engine_steps=steps,
        preempted=preempted,
        outlier_steps_with_prefill=draw(st.one_of(st.none(), st.integers(-2, 6))),
    )


def _parts(timeline: RequestTimeline, ratio: float, given_gaps: bool) -> list[GapParts]:
    gaps = inter_token_gaps_ns(timeline.token_offsets_us) if given_gaps else None
    return decode_split.gap_parts(timeline, outlier_ratio=ratio, outliers_only=True, gaps_ns=gaps)


@settings(max_examples=400, deadline=None)
@given(_requests(), st.sampled_from([1.0, 1.5, 3.0, 10.0]), st.booleans())
def test_the_c_parts_are_the_pythons(
    timeline: RequestTimeline, ratio: float, given_gaps: bool
) -> None:
    in_c = _parts(timeline, ratio, given_gaps)
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(native, "outlier_gap_parts", lambda *args: None)
        in_python = _parts(timeline, ratio, given_gaps)
    assert in_c == in_python


def test_the_usual_request_is_split_in_c(monkeypatch: pytest.MonkeyPatch) -> None:
    offsets = [0, 6_000, 12_000, 40_000, 46_000, 52_000]  # one slow gap, 28 ms
    slow_begin = T0 + 12_000_000
    timeline = make_timeline(
        first_token=T0,
        token_offsets_us=array("q", offsets),
        engine_steps=[(slow_begin + 1_000_000, slow_begin + 20_000_000, 512)],
        preempted=[],
    )
    called: list[int] = []
    real = native.outlier_gap_parts
    monkeypatch.setattr(native, "outlier_gap_parts", lambda *a: called.append(1) or real(*a))
    (part,) = _parts(timeline, 3.0, True)
    assert called and part.outlier
    assert (part.gap_ns, part.interference_ns) == (28_000_000, 22_000_000)  # past the 6 ms median
    assert part.decode_ns == 6_000_000 and part.stall_ns == part.preempted_ns == 0


@pytest.mark.parametrize(
    ("covered_ms", "expected"),
    [(14, "stall"), (15, "decode"), (16, "decode")],  # steps over half the 30 ms gap: decode
)
def test_a_gap_half_covered_by_steps_is_not_a_stall(covered_ms: int, expected: str) -> None:
    offsets = [0, 6_000, 12_000, 42_000, 48_000, 54_000]  # one slow gap, 30 ms
    slow_begin = T0 + 12_000_000
    timeline = make_timeline(
        first_token=T0,
        token_offsets_us=array("q", offsets),
        engine_steps=[(slow_begin, slow_begin + covered_ms * 1_000_000, 0)],
        preempted=[],
    )
    (part,) = _parts(timeline, 3.0, True)
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(native, "outlier_gap_parts", lambda *args: None)
        assert [part] == _parts(timeline, 3.0, True)
    assert (part.stall_ns > 0) == (expected == "stall")


def test_without_steps_the_agents_count_marks_the_largest_gaps_first_in_token_order() -> None:
    offsets = [0, 6_000, 12_000, 42_000, 48_000, 78_000, 84_000, 104_000]  # 30, 30, 20 ms
    timeline = make_timeline(
        first_token=T0,
        token_offsets_us=array("q", offsets),
        engine_steps=[],
        preempted=[],
        outlier_steps_with_prefill=1,
    )
    parts = _parts(timeline, 3.0, True)
    assert [part.interference_ns > 0 for part in parts] == [True, False, False]
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(native, "outlier_gap_parts", lambda *args: None)
        assert parts == _parts(timeline, 3.0, True)
