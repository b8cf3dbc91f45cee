"""The engine-step tracer's per-step work in C (agent/_steps.c) against its Python twins in
vllm_engine: the same appends, the same answers, and the same errors."""

from __future__ import annotations

import enum
import gc
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokentrace.agent.frameworks import vllm_engine
from tokentrace.agent.frameworks.vllm_engine import (
    ENGINE_PARENT_HEADER,
    StepRecord,
    engine_parent_header,
    outlier_gap_ends_python,
    step_facts_python,
    token_step_ends_python,
)

_steps = pytest.importorskip("tokentrace.agent._steps") if vllm_engine.BUILT else None
pytestmark = pytest.mark.skipif(_steps is None, reason="the C functions are not built here")


@dataclass(slots=True)
class _Tracked:
    prefill_steps: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class _Output:
    request_id: str
    finish_reason: str | None


_IDS = st.text(alphabet="abcdef", min_size=1, max_size=3)


def _tables(held: dict[str, str | None]) -> dict[str, Any]:
    return {key: (_Tracked([(7, 1)]) if kind == "t" else None) for key, kind in held.items()}


class _Mapping(dict[str, int]):
    pass


# --- step_facts: a whole step --------------------------------------------------------------------
@dataclass
class _NewRequest:
    req_id: str


@dataclass
class _Cached:
    req_ids: list[str]
    num_output_tokens: list[int]


@dataclass
class _SchedulerOutput:
    num_scheduled_tokens: Any
    scheduled_new_reqs: list[_NewRequest]
    scheduled_cached_reqs: Any


@dataclass
class _ClientOutputs:
    timestamp: float
    outputs: Any


@dataclass
class _KvCacheManager:
    usage: Any


class _Scheduler:
    def __init__(self, counts: Any = (3, 1), usage: Any = 0.25) -> None:
        self.counts = counts
        self.kv_cache_manager = _KvCacheManager(usage)

    def get_request_counts(self) -> Any:
        return self.counts


def _clock() -> int:
    return 5_000


@st.composite
def _steps_of_vllm(draw: st.DrawFn) -> tuple[_SchedulerOutput, dict[int, _ClientOutputs], dict]:
    """A step as vLLM's scheduler gives it: cached requests with their output-token counts
    (0: still in prefill), new ones, what each was scheduled, the clients' outputs (finished or
    not) with their timestamps (0.0: none), and what the tracer holds of them."""
    ids = draw(st.lists(_IDS, unique=True, max_size=10))
    cut = draw(st.integers(0, len(ids)))
    cached, new = ids[:cut], ids[cut:]
    # Counts as vLLM gives them, and numbers that are not exact ints (C reads those as C longs).
    counts = st.sampled_from([0, 0, 1, 7]) | st.sampled_from([0.0, False, True, 2**70, -(2**70)])
    output_tokens = [draw(counts) for _ in cached]
    scheduled = {request_id: draw(st.integers(1, 512)) for request_id in ids}
    output = _SchedulerOutput(
        scheduled, [_NewRequest(request_id) for request_id in new], _Cached(cached, output_tokens)
    )
    if draw(st.booleans()):  # vLLM's sum of the scheduled tokens (else the tracer sums them)
        output.total_num_scheduled_tokens = sum(scheduled.values())  # type: ignore[attr-defined]
    clients = {
        client: _ClientOutputs(
            draw(st.sampled_from([0.0, 1.5, 1_795_894_968.516732])),
            draw(st.sampled_from([list, tuple]))(
                _Output(request_id, draw(st.sampled_from([None, "stop"])))
                for request_id in (draw(st.lists(st.sampled_from(ids), max_size=4)) if ids else [])
            ),
        )
        for client in range(draw(st.integers(0, 2)))
    }
    held = draw(
        st.dictionaries(st.sampled_from(ids) | _IDS, st.sampled_from(["t", None]), max_size=10)
        if ids
        else st.just({})
    )
    return output, clients, held


def _step_lists(tracked: dict[str, Any]) -> dict[str, Any]:
    return {key: None if entry is None else entry.prefill_steps for key, entry in tracked.items()}


@given(_steps_of_vllm(), st.integers(0, 10**12))
def test_step_facts_records_and_answers_like_its_twin(
    step: tuple[_SchedulerOutput, dict[int, _ClientOutputs], dict[str, str | None]], start_ns: int
) -> None:
    output, clients, held = step
    in_c, in_python = _tables(held), _tables(held)
    scheduler = _Scheduler()
    facts = _steps.step_facts(StepRecord, in_c, scheduler, output, clients, 9, start_ns, _clock)
    expected = step_facts_python(
        StepRecord, in_python, scheduler, output, clients, 9, start_ns, _clock
    )
    assert facts == expected
    assert _step_lists(in_c) == _step_lists(in_python)
    if not output.num_scheduled_tokens:
        assert facts == ()
        return
    record, finished, first_seen = facts
    assert type(record) is StepRecord and record.number == 9
    assert not gc.is_tracked(record)  # out of the cycle collector's sight: it holds no cycle
    assert record.request_ids is output.num_scheduled_tokens  # held, not copied
    # vLLM's split: the new requests and the cached ones without an output token yet.
    cached = output.scheduled_cached_reqs
    prefill = {new.req_id for new in output.scheduled_new_reqs} | {
        request_id
        for request_id, tokens in zip(cached.req_ids, cached.num_output_tokens, strict=True)
        if not tokens
    }
    assert set(record.prefill_ids) == prefill
    assert record.prefill_requests + record.decode_requests == len(output.num_scheduled_tokens)
    assert record.prefill_tokens + record.decode_tokens == sum(output.num_scheduled_tokens.values())
    assert (record.waiting, record.running, record.kv_cache_usage) == (1, 3, 0.25)
    assert finished == [
        o.request_id for c in clients.values() for o in c.outputs if o.finish_reason
    ]
    assert dict(first_seen) == {
        request_id: output.num_scheduled_tokens[request_id]
        for request_id in prefill
        if request_id not in held
    }
    for request_id, entry in in_c.items():  # a prefill step is recorded, a decode step is not
        if entry is not None:
            got_step = request_id in prefill
            expected_steps = [(7, 1), (9, output.num_scheduled_tokens.get(request_id))]
            assert entry.prefill_steps == (expected_steps if got_step else [(7, 1)])


def _output(**changes: Any) -> _SchedulerOutput:
    """A step that prefills request "a" (which a decline must not record)."""
    output = _SchedulerOutput({"a": 1}, [], _Cached(["a"], [0]))
    for name, value in changes.items():
        setattr(output, name, value)
    return output


@pytest.mark.parametrize(
    ("step_type", "output", "clients"),
    [
        (tuple, _output(num_scheduled_tokens=_Mapping(a=1)), {}),  # a dict subclass
        (tuple, _output(scheduled_cached_reqs=object()), {}),  # another layout: no columns
        (tuple, _output(scheduled_new_reqs=()), {}),  # not a list
        (tuple, _output(), {0: _ClientOutputs(1.0, iter([]))}),  # outputs not a list
        (tuple, _output(), _Mapping()),  # outputs by client not a dict
        (dict, _output(), {}),  # the record not a tuple
    ],
)
def test_step_facts_declines_what_it_does_not_walk_and_changes_nothing(
    step_type: Any, output: _SchedulerOutput, clients: Any
) -> None:
    tracked = {"a": _Tracked([(7, 1)])}
    assert (
        _steps.step_facts(step_type, tracked, _Scheduler(), output, clients, 1, 0, _clock) is None
    )
    assert tracked["a"].prefill_steps == [(7, 1)]


@pytest.mark.parametrize("loop", ["C", "Python"])
@pytest.mark.parametrize(
    ("scheduler", "error"),
    [
        (_Scheduler(counts=(1, 2, 3)), ValueError),
        (_Scheduler(usage="full"), ValueError),
        (_Scheduler(usage=None), TypeError),
    ],
)
def test_step_facts_errors_reach_the_caller_as_they_would_from_the_twin(
    loop: str, scheduler: _Scheduler, error: type[Exception]
) -> None:
    # The hook guard catches them; the C function must neither swallow them nor crash.
    facts = _steps.step_facts if loop == "C" else step_facts_python
    with pytest.raises(error):
        facts(StepRecord, {}, scheduler, _output(), {}, 1, 0, _clock)
    odd = type("Odd", (), {"finish_reason": "stop"})()  # finished, without a request id
    for outputs in ([object()], [_Output("a", None), odd]):
        with pytest.raises(AttributeError):
            facts(
                StepRecord,
                {},
                _Scheduler(),
                _output(),
                {0: _ClientOutputs(1.0, outputs)},
                1,
                0,
                _clock,
            )
    with pytest.raises(TypeError):
        _steps.step_facts(StepRecord, {}, scheduler, _output())


# --- track_request: a request first seen ---------------------------------------------------------
class _Request:
    """vLLM's ``Request`` as the tracer reads it; an attribute left out is missing."""

    def __init__(self, **attributes: Any) -> None:
        vars(self).update(attributes)


@dataclass
class _Event:
    type: Any
    timestamp: Any


class _Headers(dict[str, Any]):
    pass


class _Text(str):
    pass


class _Type(enum.IntEnum):
    QUEUED = 1
    SCHEDULED = 2


_ID_BYTES = st.sampled_from([b"\0", b"\1", b"\xab"]).flatmap(
    lambda first: st.binary(min_size=0, max_size=15).map(lambda rest: first + rest)
)


@st.composite
def _header_values(draw: st.DrawFn) -> object:
    """What a request's header holds: its ids as the frontend writes them (all-zero ones
    too), in upper case, padded, cut, bent out of shape, or not text at all."""
    trace = draw(st.sampled_from([bytes(16), b"\1" * 16]) | st.binary(min_size=16, max_size=16))
    spans = [draw(st.sampled_from([bytes(8)]) | st.binary(min_size=8, max_size=8)) for _ in "ab"]
    value = engine_parent_header(trace, *spans)
    shape = draw(st.sampled_from(["as is", "upper", "padded", "cut", "bent", "subclass", "other"]))
    if shape == "upper":
        return value.upper()
    if shape == "padded":
        return draw(st.sampled_from([" ", "\t", "\u3000"])) + value + " "
    if shape == "cut":
        return value[: draw(st.integers(0, len(value) - 1))]
    if shape == "bent":
        at = draw(st.integers(0, len(value) - 1))
        return value[:at] + draw(st.sampled_from(["g", "-", " ", "é", "0"])) + value[at + 1 :]
    if shape == "subclass":
        return _Text(value)
    if shape == "other":
        return draw(st.sampled_from([None, 7, value.encode()]))
    return value


@st.composite
def _requests(draw: st.DrawFn) -> _Request:
    attributes: dict[str, Any] = {}
    headers = draw(st.sampled_from(["dict", "dict", "dict", "none", "empty", "other", "missing"]))
    if headers != "missing":
        entries = {"traceparent": "00-x"}
        if draw(st.booleans()) or headers == "dict":
            entries[ENGINE_PARENT_HEADER] = draw(_header_values())
        attributes["trace_headers"] = {
            "dict": entries, "none": None, "empty": {}, "other": _Headers(entries),
        }[headers]  # fmt: skip
    events = draw(st.sampled_from(["list", "list", "none", "tuple", "missing"]))
    if events != "missing":
        drawn = [
            _Event(draw(st.sampled_from([1, 2, 3, _Type.SCHEDULED, _Type.QUEUED])), stamp)
            for stamp in draw(
                st.lists(st.sampled_from([0.0, 1.5, 1_795_894_968.516732]), max_size=4)
            )
        ]
        attributes["events"] = {"list": drawn, "none": None, "tuple": tuple(drawn)}[events]
    return _Request(**attributes)


@given(_requests())
def test_track_request_answers_like_its_twin(request: _Request) -> None:
    assert _steps.track_request(vllm_engine._TRACK_PARTS, request) == vllm_engine._track(request)


def test_track_request_reads_the_common_shapes_itself() -> None:
    # The twin answers only for other shapes: a request as vLLM holds it never reaches it.
    def twin(request: object) -> None:
        raise AssertionError("the twin was asked")

    parts = (*vllm_engine._TRACK_PARTS[:3], twin)
    ids = (b"\x01" * 16, b"\x02" * 8, b"\xfe" * 8)
    events = [_Event(_Type.SCHEDULED, 1.5), _Event(_Type.SCHEDULED, 2.25), _Event(1, 3.0)]
    request = _Request(
        trace_headers={ENGINE_PARENT_HEADER: engine_parent_header(*ids)}, events=events
    )
    tracked = _steps.track_request(parts, request)
    assert (tracked.trace_id, tracked.request_span_id, tracked.prefill_span_id) == ids
    assert tracked.first_scheduled_ns == 2_250_000_000  # the last SCHEDULED event
    zero = _Request(trace_headers={ENGINE_PARENT_HEADER: engine_parent_header(bytes(16), *ids[1:])})
    assert _steps.track_request(parts, zero) is None
    assert _steps.track_request(parts, _Request(trace_headers={"traceparent": "00-x"})) is None
    with pytest.raises(AssertionError, match="twin was asked"):
        _steps.track_request(parts, _Request(trace_headers=_Headers(request.trace_headers)))


def test_track_request_errors_reach_the_caller() -> None:
    class Stamp:
        def __mul__(self, other: object) -> float:
            raise ZeroDivisionError("stamp")

    ids = (b"\x01" * 16, b"\x02" * 8, b"\x03" * 8)
    request = _Request(
        trace_headers={ENGINE_PARENT_HEADER: engine_parent_header(*ids)},
        events=[_Event(2, Stamp())],
    )
    for track in (vllm_engine._track, lambda r: _steps.track_request(vllm_engine._TRACK_PARTS, r)):
        with pytest.raises(ZeroDivisionError, match="stamp"):
            track(request)


# --- token_step_ends: a finished request's steps, found in the ring (emitter thread) ------------
def _record(number: int, request_ids: Any, prefill_ids: frozenset[str]) -> StepRecord:
    return StepRecord(
        number, 10 * number, 10 * number + 7, 0, 0, 0, 0, 0.0, 0, 0, request_ids, prefill_ids
    )


@given(
    size=st.integers(min_value=1, max_value=6),
    written=st.lists(
        st.tuples(st.sampled_from(["a", "b", "ab", ""]), st.booleans(), st.booleans()),
        max_size=20,
    ),
    first=st.integers(min_value=0, max_value=24),
    last=st.integers(min_value=0, max_value=24),
    prefill_step=st.none() | st.integers(min_value=0, max_value=24),
)
def test_token_step_ends_match_the_twin(
    size: int,
    written: list[tuple[str, bool, bool]],
    first: int,
    last: int,
    prefill_step: int | None,
) -> None:
    # Steps 0, 1, ... written in turn into a ring of `size` (older ones overwritten), each
    # scheduling some of "a" and "b" (as vLLM's dict or as a list), "a" prefilled in some.
    ring: list[StepRecord | None] = [None] * size
    for number, (ids, as_dict, prefilled) in enumerate(written):
        batch: Any = dict.fromkeys(ids, 1) if as_dict else list(ids)
        ring[number % size] = _record(number, batch, frozenset("a" if prefilled else ""))
    expected = token_step_ends_python(ring, first, last, "a", prefill_step)
    assert _steps.token_step_ends(ring, first, last, "a", prefill_step) == expected


@pytest.mark.parametrize(
    "arguments",
    [
        ((), 0, 1, "a", None),  # an empty ring
        ([None], -1, 0, "a", None),  # a negative step: Python's modulo
        ([None], 0, 1, "a", -2),
        ([None], True, 1, "a", None),  # not exactly an int
        ([("not", "a", "record")], 0, 0, "a", None),
    ],
)
def test_token_step_ends_leave_odd_input_to_the_twin(arguments: tuple[Any, ...]) -> None:
    assert _steps.token_step_ends(*arguments) is None


# --- outlier_gap_ends: which of those steps' gaps are slow (emitter thread) ----------------------
@given(
    ends=st.lists(st.integers(min_value=-(2**52) + 1, max_value=2**52 - 1), max_size=40).map(
        lambda values: [(index, value) for index, value in enumerate(values)]
    )
    | st.lists(st.integers(min_value=0, max_value=60), max_size=40).map(
        lambda gaps: [(index, 10**18 + sum(gaps[:index]) * 10**6) for index in range(len(gaps))]
    ),
    ratio=st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([3.0, 1.0, 0.0, 2.5]),
)
def test_outlier_gap_ends_match_the_twin(ends: list[tuple[int, int]], ratio: float) -> None:
    # Arbitrary ends (negative gaps, ties, huge ones) and realistic ones (ns, ms gaps).
    answer = _steps.outlier_gap_ends(ends, ratio, vllm_engine.MIN_GAPS_FOR_OUTLIERS)
    assert answer is not None
    assert answer == outlier_gap_ends_python(ends, ratio)


def test_outlier_gap_ends_reads_the_tracers_ends_itself() -> None:
    ends = [(index, 10**18 + 20_000_000 * index) for index in range(33)]
    ends[20:] = [(index, end + 90_000_000) for index, end in ends[20:]]  # one slow gap
    assert _steps.outlier_gap_ends(ends, 3.0, vllm_engine.MIN_GAPS_FOR_OUTLIERS) == [20]
    assert vllm_engine.outlier_gap_ends(ends, 3.0) == [20]


@pytest.mark.parametrize(
    "arguments",
    [
        ([(0, 0), (1, 2**63 - 1), (2, -(2**63))], 3.0, 2),  # a gap past int64
        ([(0, 0), (1, 2**53), (2, 2**53 + 1)], 3.0, 2),  # a gap a float holds inexactly
        ([(0, 0), (1, 2**64), (2, 2**64 + 1)], 3.0, 2),  # an end past int64
        ([(0, 0), (1, 1.5), (2, 3)], 3.0, 2),  # not an int
        ([(0, 0), [1, 1], (2, 3)], 3.0, 2),  # not a tuple
        ([(0, 0), (1, 1, 9), (2, 3)], 3.0, 2),  # not a pair
        (((0, 0), (1, 1), (2, 3)), 3.0, 2),  # not a list
        ([(0, 0), (1, 1), (2, 3)], 3, 2),  # the ratio not a float
    ],
)
def test_outlier_gap_ends_leave_odd_input_to_the_twin(arguments: tuple[Any, ...]) -> None:
    assert _steps.outlier_gap_ends(*arguments) is None
    ends, ratio, _ = arguments
    if isinstance(ends[1], tuple) and len(ends[1]) == 3:
        return  # the twin reads index 1 of a longer tuple too
    assert vllm_engine.outlier_gap_ends(ends, ratio) == outlier_gap_ends_python(ends, ratio)
