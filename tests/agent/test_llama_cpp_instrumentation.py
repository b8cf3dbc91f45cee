"""The llama-cpp-python instrumentation without llama-cpp-python: its patch table applied to
stand-in modules (``llama_cpp_stand_ins.py``), so the real patches, the queue on the model lock,
the prefill chunks and cached tokens, the token times, the finish, interruption and aborts, the
cold start and the guard all run in-process. The real server is tests/llama_cpp/."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.agent import llama_cpp_stand_ins as stand_ins
from tokentrace.agent.frameworks import llama_cpp as instrumentation
from tokentrace.agent.frameworks.llama_cpp import PATCHES, LlamaCppInstrumentor
from tokentrace.agent.frameworks.llama_cpp_requests import (
    ERROR_ABORTED,
    ERROR_INTERRUPTED,
    FINISH_ABORT,
    NOT_REPORTED,
    NOT_REPORTED_BY,
)
from tokentrace.agent.frameworks.vllm_cold_start import ColdStartTracer
from tokentrace.agent.hooks import HookGuard
from tokentrace.agent.recorder import MonotonicToUnix, Recorder, RequestTimer


@dataclass
class Setup:
    instrumentor: LlamaCppInstrumentor
    finished: list[RequestTimer]
    guard: HookGuard
    cold_start: ColdStartTracer
    cold_start_jobs: list[Any]
    app: Any
    """The stand-in ``llama_cpp.server.app``."""

    def start_server(self, *, interrupt_requests: bool = False, n_batch: int = 4) -> None:
        """What ``create_app`` does: the settings, then the proxy (the model's load)."""
        self.app._server_settings = stand_ins.ServerSettings(interrupt_requests)
        proxy = sys.modules["llama_cpp.server.model"].LlamaProxy([stand_ins.MODEL_ALIAS])
        proxy._current_model.n_batch = n_batch
        self.app._llama_proxy = proxy


def patched_attributes(modules: dict[str, Any]) -> dict[tuple[Any, str], Any]:
    result = {}
    for patch in PATCHES:
        if patch.module == "fastapi.applications":
            continue
        owner: Any = modules[patch.module]
        path, _, attribute = patch.qualname.rpartition(".")
        for name in path.split(".") if path else ():
            owner = getattr(owner, name)
        result[(owner, attribute)] = vars(owner)[attribute]
    return result


@pytest.fixture
def setup(monkeypatch: pytest.MonkeyPatch) -> Iterator[Setup]:
    modules = stand_ins.stand_in_modules()
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(
        instrumentation.LlamaCppInstrumentor, "installed", lambda _self: stand_ins.SUPPORTED
    )
    originals = patched_attributes(modules)
    finished: list[RequestTimer] = []
    guard = HookGuard()
    jobs: list[Any] = []
    cold_start = ColdStartTracer(
        jobs.append, to_unix=MonotonicToUnix(), frontend=True, inherit=False, environ={}
    )
    instrumentor = LlamaCppInstrumentor()
    instrumentor.instrument(
        recorder=Recorder(finished.append), guard=guard, cold_start_tracer=cold_start
    )
    yield Setup(instrumentor, finished, guard, cold_start, jobs, modules["llama_cpp.server.app"])
    if instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.uninstrument()
    assert patched_attributes(modules) == originals


PROMPT = list(range(1, 11))  # 10 tokens: chunks of 4, 4 and 2 at n_batch 4


def serve(setup: Setup, **kwargs: Any) -> stand_ins.Served:
    return asyncio.run(stand_ins.serve(setup.app, **{"prompt": PROMPT, **kwargs}))


def texts(served: stand_ins.Served) -> list[str]:
    return [chunk["choices"][0]["text"] for chunk in served.chunks if isinstance(chunk, dict)]


# --- the patch table ------------------------------------------------------------------------------
def test_every_patch_is_applied_and_uninstrument_restores_them(setup: Setup) -> None:
    modules = {name: sys.modules[name] for name in stand_ins.stand_in_modules()}
    wrapped = patched_attributes(modules)
    assert all(type(value).__name__ == "FunctionWrapper" for value in wrapped.values()), wrapped
    setup.instrumentor.uninstrument()
    assert all(
        type(value).__name__ != "FunctionWrapper" for value in patched_attributes(modules).values()
    )


def test_an_unsupported_version_is_refused_with_one_warning_and_patches_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    modules = stand_ins.stand_in_modules()
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(
        instrumentation.LlamaCppInstrumentor,
        "installed",
        lambda _self: ("llama_cpp_python", "0.3.35"),
    )
    monkeypatch.setattr(LlamaCppInstrumentor, "_unsupported_warned", False)
    originals = patched_attributes(modules)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            LlamaCppInstrumentor().instrument(
                recorder=Recorder(lambda timer: None), guard=HookGuard()
            )
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "0.3.35 is not a supported llama-cpp-python" in warnings[0]
    assert patched_attributes(modules) == originals


# --- one request ----------------------------------------------------------------------------------
def test_a_streamed_request_has_its_queue_prefill_chunks_tokens_and_finish(setup: Setup) -> None:
    setup.start_server()
    served = serve(setup, max_tokens=5, temperature=0.5, top_p=0.9)
    assert texts(served) == ["100", "101", "102", "103", "104", ""]
    (timer,) = setup.finished
    assert timer.queued_ns == timer.arrival_ns
    assert timer.first_scheduled_ns is not None and timer.first_scheduled_ns >= timer.arrival_ns
    assert [tokens for _, _, tokens in timer.prefill_chunks] == [4, 4, 2]
    assert timer.prefill_chunks[0][0] >= timer.first_scheduled_ns
    assert timer.prefill_chunks[-1][1] <= timer.token_ns[0]
    assert len(timer.token_ns) == 5 and timer.token_ns == sorted(timer.token_ns)
    assert timer.end_ns is not None and timer.end_ns >= timer.token_ns[-1]
    assert timer.status_error is None
    attributes = timer.attributes
    assert attributes["finish_reason"] == "length"
    assert attributes["input_tokens"] == 10 and attributes["cached_tokens"] == 0
    assert attributes["output_tokens"] == 5
    assert attributes["model"] == stand_ins.MODEL_ALIAS
    assert attributes["request_id"] == stand_ins.COMPLETION_ID
    assert (attributes["max_tokens"], attributes["temperature"], attributes["top_p"]) == (
        5,
        0.5,
        0.9,
    )
    assert attributes["not_reported"] == NOT_REPORTED
    assert attributes["not_reported_by"] == NOT_REPORTED_BY
    assert (attributes["requests_ahead"], attributes["running_at_arrival"]) == (0, 0)


def test_a_repeated_prompt_reports_the_context_it_reused_as_cached_tokens(setup: Setup) -> None:
    setup.start_server()
    serve(setup, max_tokens=2)
    serve(setup, max_tokens=2)
    first, second = setup.finished
    assert first.attributes["cached_tokens"] == 0
    # The whole prompt but its last token came from the previous request's context.
    assert second.attributes["cached_tokens"] == 9
    assert [tokens for _, _, tokens in second.prefill_chunks] == [1]


def test_end_of_generation_tokens_are_not_counted_and_the_finish_is_stop(setup: Setup) -> None:
    setup.start_server()
    served = serve(setup, max_tokens=10, eos_after=3)
    assert texts(served) == ["100", "101", "102", ""]
    (timer,) = setup.finished
    assert len(timer.token_ns) == 3
    assert timer.attributes["finish_reason"] == "stop" and timer.attributes["output_tokens"] == 3


def test_an_unstreamed_request_takes_its_counts_from_the_usage(setup: Setup) -> None:
    setup.start_server()
    asyncio.run(setup.app.publish([], {"prompt": PROMPT, "max_tokens": 4, "stream": False}))
    (timer,) = setup.finished
    assert timer.attributes["output_tokens"] == 4 and timer.attributes["input_tokens"] == 10
    assert timer.attributes["finish_reason"] == "length" and len(timer.token_ns) == 4


def test_a_llama_used_outside_a_server_request_records_nothing(setup: Setup) -> None:
    setup.start_server()
    llama = setup.app._llama_proxy()
    chunks = list(llama._create_completion(PROMPT, max_tokens=3, stream=True))
    assert len(chunks) == 4 and setup.finished == []


# --- concurrency: the model lock ------------------------------------------------------------------
async def _concurrent(setup: Setup, count: int, **kwargs: Any) -> list[stand_ins.Served]:
    tasks = []
    for _ in range(count):
        tasks.append(
            asyncio.create_task(stand_ins.serve(setup.app, **{"prompt": PROMPT, **kwargs}))
        )
        for _ in range(3):  # each arrives once the one before has taken or queued for the lock
            await asyncio.sleep(0)
    return list(await asyncio.gather(*tasks))


def test_requests_wait_for_the_model_lock_one_at_a_time(setup: Setup) -> None:
    setup.start_server()
    asyncio.run(_concurrent(setup, 3, max_tokens=20))
    first, second, third = sorted(setup.finished, key=lambda timer: timer.arrival_ns)
    for earlier, later in ((first, second), (second, third)):
        assert earlier.end_ns is not None and later.first_scheduled_ns is not None
        assert later.first_scheduled_ns >= earlier.end_ns  # served one at a time
    assert [t.attributes["requests_ahead"] for t in (first, second, third)] == [0, 0, 1]
    assert [t.attributes["running_at_arrival"] for t in (first, second, third)] == [0, 1, 1]
    assert all(
        t.attributes["output_tokens"] == 20 and t.status_error is None for t in setup.finished
    )


def test_with_interrupt_requests_a_waiting_request_cuts_the_running_stream(setup: Setup) -> None:
    setup.start_server(interrupt_requests=True)
    cut, newer = asyncio.run(_concurrent(setup, 2, max_tokens=50))
    assert cut.chunks[-1] == "[DONE]" and len(texts(cut)) < 50
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in cut.chunks[:-1])
    assert newer.chunks[-1] == "[DONE]" and len(texts(newer)) == 51
    cut_timer, newer_timer = sorted(setup.finished, key=lambda timer: timer.arrival_ns)
    assert cut_timer.attributes["finish_reason"] == FINISH_ABORT
    assert cut_timer.status_error == ERROR_INTERRUPTED
    assert cut_timer.attributes["output_tokens"] == len(texts(cut)) > 0
    assert newer_timer.status_error is None and newer_timer.attributes["finish_reason"] == "length"


def test_a_client_that_goes_away_leaves_an_aborted_request_served_or_queued(setup: Setup) -> None:
    setup.start_server()

    async def cancel_both() -> None:
        tasks = [
            asyncio.create_task(stand_ins.serve(setup.app, prompt=PROMPT, max_tokens=10_000))
            for _ in range(2)
        ]
        for _ in range(20):
            await asyncio.sleep(0)
        for task in reversed(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(cancel_both())
    served, queued = sorted(setup.finished, key=lambda timer: timer.arrival_ns)
    assert (
        served.status_error == ERROR_ABORTED and served.attributes["finish_reason"] == FINISH_ABORT
    )
    assert 0 < len(served.token_ns) < 10_000
    assert queued.status_error == ERROR_ABORTED and queued.first_scheduled_ns is None
    assert not setup.app.llama_inner_lock.locked() and not setup.app.llama_outer_lock.locked()


# --- the guard --------------------------------------------------------------------------------
def test_a_failing_hook_is_disabled_and_the_server_serves_on(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    setup.start_server()
    setup.app._llama_proxy()._model = None  # the generate hook reads the vocabulary from it
    with caplog.at_level(logging.WARNING):
        served = serve(setup, max_tokens=3)
        again = serve(setup, max_tokens=3)
    assert texts(served) == texts(again) == ["100", "101", "102", ""]
    assert setup.guard.disabled
    assert any("disabled" in record.getMessage() for record in caplog.records)


# --- the cold start -----------------------------------------------------------------------------
def test_the_default_models_load_is_the_cold_starts_weight_load_and_ends_it(setup: Setup) -> None:
    assert setup.cold_start.ready_ns is None
    setup.start_server()
    assert setup.cold_start.ready_ns is not None
    assert setup.cold_start_jobs  # the phases and the root, planned on the emitter's thread
    jobs = len(setup.cold_start_jobs)
    # A later load (a request switching models) is no cold start.
    sys.modules["llama_cpp.server.model"].LlamaProxy.load_llama_from_model_settings("other")
    assert len(setup.cold_start_jobs) == jobs
