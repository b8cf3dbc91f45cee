"""vLLM's per-step output patch in C (``_steps.outputs_hook``) against its twin, the Python
patch of ``FrontendRequestHooks._process_outputs_python``: the same steps through each give the
same timers, finishes and guard counts."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.agent.vllm_stand_ins import (
    LENGTH,
    PREEMPTED,
    QUEUED,
    SCHEDULED,
    Event,
    Output,
    OutputProcessor,
    State,
)
from tokentrace.agent.frameworks import vllm_engine, vllm_requests
from tokentrace.agent.frameworks.vllm_requests import HOOK_OUTPUTS, FrontendRequestHooks
from tokentrace.agent.hooks import HookGuard
from tokentrace.agent.recorder import MonotonicToUnix, Recorder, RequestTimer

pytestmark = pytest.mark.skipif(
    not vllm_engine.BUILT, reason="the C extension is not built here (or TOKENTRACE_PURE_PYTHON)"
)

_REQUESTS = 4
"""Request ids 0-3 are traced; 4 and 5 are not (vLLM serves them, the recorder has no timer)."""


@dataclass
class _World:
    hooks: FrontendRequestHooks
    processor: OutputProcessor
    patch: Callable[..., Any]
    finished: list[RequestTimer]
    guard: HookGuard


def _world(native: bool) -> _World:
    ticks = itertools.count(1_000)
    finished: list[RequestTimer] = []
    recorder = Recorder(finished.append, monotonic_ns=lambda: next(ticks))
    hooks = FrontendRequestHooks()
    hooks._active = True
    hooks._guard = HookGuard()
    hooks._recorder = recorder
    hooks._clock = MonotonicToUnix()
    hooks._cold_start_tracer = None
    hooks._reset_request_state()
    processor = OutputProcessor()
    for number in range(_REQUESTS + 2):
        request_id = f"r{number}"
        processor.request_states[request_id] = State(request_id, f"x{number}", 3, 8, 0.5, 1.0)
        processor.external_req_ids[f"x{number}"] = [request_id]
        if number < _REQUESTS:
            recorder.begin(request_id, arrival_ns=number)
    original = OutputProcessor.process_outputs
    if native:
        patch = hooks._process_outputs_patch(original)
        assert type(patch).__name__ == "OutputsHook"
    else:
        patch = hooks._process_outputs_python(original)
    return _World(hooks, processor, patch, finished, hooks._guard)


def _timer_facts(timer: RequestTimer) -> tuple[Any, ...]:
    return (
        timer.request_id, timer.token_ns, timer.queued_ns, timer.first_scheduled_ns,
        timer.preempted_ns, timer.preempted_since_ns, timer.end_ns, timer.status_error,
        timer.attributes,
    )  # fmt: skip


_EVENTS = st.lists(
    st.builds(Event, st.sampled_from([QUEUED, SCHEDULED, PREEMPTED]), st.floats(90, 110)),
    max_size=3,
).map(lambda events: events or None)
_OUTPUT = st.builds(
    Output,
    st.integers(0, _REQUESTS + 1).map(lambda number: f"r{number}"),
    st.lists(st.integers(0, 50), max_size=4),
    st.sampled_from([None, None, None, LENGTH]),
    _EVENTS,
)
_STEP = st.tuples(  # vLLM sends at most one output per request per step
    st.lists(_OUTPUT, max_size=5, unique_by=lambda output: output.request_id),
    st.one_of(st.none(), st.floats(100, 200, allow_nan=False)),
)


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(_STEP, max_size=6))
def test_the_c_patch_records_what_its_twin_records(
    steps: list[tuple[list[Output], float | None]],
) -> None:
    worlds = [_world(native=True), _world(native=False)]
    for world in worlds:
        for outputs, timestamp in steps:
            # Each world gets fresh outputs, of the requests vLLM still holds (a finished
            # request sends no more).
            held = world.processor.request_states
            copies = [
                Output(output.request_id, list(output.new_token_ids), output.finish_reason,
                       output.events)
                for output in outputs
                if output.request_id in held
            ]  # fmt: skip
            # vLLM's own call: the stats positional, its weight version by keyword.
            result = world.patch(world.processor, copies, timestamp, None, weight_version=1)
            assert result == "vllm-result"
    native, twin = worlds
    assert [_timer_facts(t) for t in native.finished] == [_timer_facts(t) for t in twin.finished]
    open_native = native.hooks._recorder._in_flight
    open_twin = twin.hooks._recorder._in_flight
    assert open_native.keys() == open_twin.keys()
    assert [_timer_facts(t) for t in open_native.values()] == [
        _timer_facts(t) for t in open_twin.values()
    ]
    assert native.guard.failures == twin.guard.failures == {}


def test_a_traced_step_appends_the_step_timestamp_per_new_token_and_finishes() -> None:
    world = _world(native=True)
    world.patch(world.processor, [Output("r0", [1, 2]), Output("r4", [3])], 100.25)
    world.patch(world.processor, [Output("r0", [4], LENGTH)], 100.5)
    (timer,) = world.finished
    assert timer.token_ns == [100_250_000_000, 100_250_000_000, 100_500_000_000]
    assert timer.attributes["finish_reason"] == "length"
    assert timer.attributes["output_tokens"] == 3
    assert "r4" in world.processor.request_states  # untraced: served, not recorded


@pytest.mark.parametrize(
    ("shape", "twin_calls"),
    [
        ("vLLM's: positional, other keywords", 0),
        ("the outputs by keyword", 1),
        ("the timestamp by keyword", 1),
        ("a tuple of outputs", 1),
    ],
)
def test_calls_of_another_shape_go_to_the_twin(
    shape: str, twin_calls: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[Any, ...]] = []
    python_patch = FrontendRequestHooks._process_outputs_python

    def counted(hooks: FrontendRequestHooks, original: Callable[..., Any]) -> Callable[..., Any]:
        twin = python_patch(hooks, original)

        def counting(*args: Any, **kwargs: Any) -> Any:
            calls.append(args)
            return twin(*args, **kwargs)

        return counting

    monkeypatch.setattr(FrontendRequestHooks, "_process_outputs_python", counted)
    world = _world(native=True)
    outputs = [Output("r1", [5], LENGTH)]
    if shape == "vLLM's: positional, other keywords":
        world.patch(world.processor, outputs, 7.0, None, weight_version=3)
    elif shape == "the outputs by keyword":
        world.patch(world.processor, engine_core_outputs=outputs, engine_core_timestamp=7.0)
    elif shape == "the timestamp by keyword":
        world.patch(world.processor, outputs, engine_core_timestamp=7.0)
    else:
        world.patch(world.processor, tuple(outputs), 7.0)
    assert len(calls) == twin_calls
    (timer,) = world.finished
    assert timer.token_ns == [7_000_000_000]


def test_nothing_in_flight_or_tracing_off_calls_only_vllm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    world = _world(native=True)
    world.hooks._active = False
    world.patch(world.processor, [Output("r0", [1])], 1.0)
    assert world.hooks._recorder.get("r0").token_ns == []
    world.hooks._active = True
    world.guard.disabled.add(vllm_requests.HOOK_ABORT)  # any request hook disabled stops it
    world.patch(world.processor, [Output("r0", [1])], 1.0)
    assert world.hooks._recorder.get("r0").token_ns == []
    world.guard.disabled.clear()
    world.patch(world.processor, [Output("r0", [1])], 1.0)
    assert world.hooks._recorder.get("r0").token_ns == [1_000_000_000]


def test_vllms_own_exception_reaches_its_caller_and_no_hook_is_blamed() -> None:
    world = _world(native=True)

    class Broken(OutputProcessor):
        def process_outputs(self, *args: Any, **kwargs: Any) -> str:
            raise ValueError("vLLM's own")

    patch = world.hooks._process_outputs_patch(Broken.process_outputs)
    with pytest.raises(ValueError, match="vLLM's own"):
        patch(world.processor, [Output("r0", [1])], 1.0)
    assert world.guard.failures == {}
    assert world.hooks._recorder.get("r0").token_ns == []


def test_a_failure_after_vllms_call_is_the_guards_and_vllms_result_comes_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    world = _world(native=True)

    class NoTokens(Output):
        @property
        def new_token_ids(self) -> list[int]:
            raise RuntimeError("read fails")

        @new_token_ids.setter
        def new_token_ids(self, value: list[int]) -> None:
            pass

    assert world.patch(world.processor, [NoTokens("r0", [1])], 1.0) == "vllm-result"
    assert world.guard.failures == {HOOK_OUTPUTS: 1}
    assert HOOK_OUTPUTS in world.guard.disabled
