"""The SGLang instrumentation without SGLang: its patch table applied to stand-in modules
(``sglang_stand_ins.py``), so the real patches, the trace-context hand-off through pickled time
stats, the hooks' timing logic, the engine-step ring and the guard all run."""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import logging
import pickle
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import wrapt

from tests.agent import sglang_stand_ins as stand_ins
from tests.agent.sglang_stand_ins import (
    CLOCK,
    NS,
    PROCESS_START_NS,
    SUPPORTED,
    WEIGHT_LOAD_NS,
    BatchStrOutput,
    Engine,
    ModelRunner,
    Scheduler,
    Setup,
    TokenizerManager,
    advance,
    advance_startup_clock,
    deliver,
    make_setup,
    monotonic_ns,
    patched_attributes,
    scheduler_clock_s,
    stand_in_modules,
    startup_monotonic_ns,
)
from tests.agent.test_vllm_engine import attributes, encoded_spans, planned_jobs
from tokentrace.agent import semconv
from tokentrace.agent.frameworks import asgi
from tokentrace.agent.frameworks import sglang as instrumentation
from tokentrace.agent.frameworks.sglang import SUPPORTED_VERSIONS, SglangInstrumentor
from tokentrace.agent.frameworks.sglang_requests import HOOK_OUTPUTS, PARENT_STATE_KEY
from tokentrace.agent.frameworks.sglang_scheduler import HOOK_SCHEDULER_STEP
from tokentrace.agent.frameworks.vllm_engine import engine_parent_header, parse_engine_parent
from tokentrace.agent.recorder import PROMPT_TOKEN_IDS, RequestTimer
from tokentrace.agent.spans import SpanJob

TRACE = bytes(range(1, 17))
CALLER_SPAN = bytes(range(21, 29))
UNIX_OFFSET = 10**18  # CLOCK: Unix ns = monotonic ns + 10**18


@pytest.fixture
def sglang_stand_in(monkeypatch: pytest.MonkeyPatch) -> Iterator[Setup]:
    for name, module in stand_in_modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(instrumentation.SglangInstrumentor, "installed", lambda _self: SUPPORTED)
    monkeypatch.setattr(stand_ins, "SCHEDULER_START_UP", [])
    setup = make_setup()
    originals = patched_attributes()
    yield setup
    if setup.instrumentor.is_instrumented_by_opentelemetry:
        setup.instrumentor.uninstrument()
    assert patched_attributes() == originals


def ns(seconds: float) -> int:
    """What the hooks make of a ``perf_counter()`` reading."""
    return int(seconds * NS)


def serve(
    setup: Setup,
    manager: TokenizerManager,
    scheduler: Scheduler,
    rid: str = "req-1",
    *,
    prompt_tokens: int = 5,
    max_new_tokens: int = 4,
    external_trace_header: dict[str, str] | None = None,
) -> tuple[RequestTimer, list[int]]:
    """One request from the frontend through the scheduler and back, one output per step;
    returns its timer and the frontend's clock at each delivery that carried its tokens."""
    tokenized = manager.tokenize(
        rid,
        prompt_tokens,
        max_new_tokens=max_new_tokens,
        external_trace_header=external_trace_header,
    )
    manager.send(tokenized)
    timer = setup.recorder.get(rid)
    assert timer is not None
    advance(0.002)  # the hand-off to the scheduler process
    scheduler.receive(manager.sent.pop())
    deliveries: list[int] = []
    while scheduler.step():
        advance(0.001)  # the detokenizer
        if any(rid in output.rids for output in scheduler.outbox):
            deliveries.append(monotonic_ns())
        deliver(scheduler, manager)
    return timer, deliveries


def spans_by_name(jobs: list[Any]) -> dict[str, list[Any]]:
    spans: dict[str, list[Any]] = {}
    for span in encoded_spans(planned_jobs(jobs)):
        spans.setdefault(span.name, []).append(span)
    return spans


# --- the patch table ------------------------------------------------------------------------------
def test_instrument_uninstrument_instrument_applies_and_restores_every_patch(
    sglang_stand_in: Setup,
) -> None:
    originals = patched_attributes()
    assert len(originals) == len(instrumentation.PATCHES)
    sglang_stand_in.instrument()
    patched = patched_attributes()
    for key, original in originals.items():
        assert isinstance(patched[key], wrapt.FunctionWrapper), key
        assert patched[key].__wrapped__ is original
    sglang_stand_in.instrumentor.uninstrument()
    assert patched_attributes() == originals
    sglang_stand_in.instrument()
    assert all(isinstance(v, wrapt.FunctionWrapper) for v in patched_attributes().values())
    timer, _ = serve(sglang_stand_in, TokenizerManager(), Scheduler())
    assert sglang_stand_in.finished == [timer]


def test_a_module_imported_after_instrument_is_patched_then_not_after_uninstrument(
    monkeypatch: pytest.MonkeyPatch, sglang_stand_in: Setup
) -> None:
    name = "sglang.srt.managers.scheduler"
    monkeypatch.delitem(sys.modules, name)
    sglang_stand_in.instrument()
    assert not isinstance(vars(Scheduler)["run_batch"], wrapt.FunctionWrapper)
    module = stand_in_modules()[name]
    monkeypatch.setitem(sys.modules, name, module)
    wrapt.notify_module_loaded(module)
    for attribute in ("handle_generate_request", "_add_request_to_queue", "run_batch"):
        assert isinstance(vars(Scheduler)[attribute], wrapt.FunctionWrapper), attribute
    sglang_stand_in.instrumentor.uninstrument()
    wrapt.notify_module_loaded(module)  # a stale hook of the earlier instrumentation
    assert not isinstance(vars(Scheduler)["run_batch"], wrapt.FunctionWrapper)


def test_the_stand_ins_do_not_make_sglang_importable(sglang_stand_in: Setup) -> None:
    assert "sglang" not in sys.modules
    assert importlib.util.find_spec("sglang") is None
    with pytest.raises(ModuleNotFoundError):
        __import__("sglang")


@pytest.mark.parametrize("found_version", ["0.5.22", "0.6.0", "0.5.24rc1"])
def test_an_unsupported_sglang_version_warns_once_and_patches_nothing(
    sglang_stand_in: Setup,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    found_version: str,
) -> None:
    monkeypatch.setattr(
        instrumentation.SglangInstrumentor, "installed", lambda _self: ("sglang", found_version)
    )
    monkeypatch.setattr(instrumentation.SglangInstrumentor, "_unsupported_warned", False)
    originals = patched_attributes()
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            sglang_stand_in.instrument()
    assert patched_attributes() == originals
    assert not sglang_stand_in.instrumentor.is_instrumented_by_opentelemetry
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "\n" not in message
    assert found_version in message and SUPPORTED_VERSIONS in message


def test_sglang_not_installed_is_a_conflict_without_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(instrumentation.SglangInstrumentor, "installed", lambda _self: None)
    with caplog.at_level(logging.WARNING):
        assert SglangInstrumentor()._check_dependency_conflicts() is not None
    assert not caplog.records


@pytest.fixture
def register_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``register`` pins the exporter variables in ``os.environ`` and sets the level of the
    ``tokentrace`` logger: both are put back."""
    from tokentrace.agent.bootstrap import PINNED_EXPORTER_ENV

    monkeypatch.setenv(PINNED_EXPORTER_ENV, "{}")
    logger = logging.getLogger("tokentrace")
    level = logger.level
    yield
    logger.setLevel(level)


def test_register_never_raises_even_when_instrumenting_raises(
    sglang_stand_in: Setup,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    register_environment: None,
) -> None:
    def broken(self: SglangInstrumentor, **kwargs: Any) -> None:
        raise RuntimeError("instrumentation bug")

    monkeypatch.setattr(SglangInstrumentor, "instrument", broken)
    with caplog.at_level(logging.WARNING):
        instrumentation.register()
    (warning,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "could not instrument SGLang" in warning.getMessage()
    assert not any(isinstance(v, wrapt.FunctionWrapper) for v in patched_attributes().values())


def test_register_with_an_unsupported_version_warns_once_and_patches_nothing(
    sglang_stand_in: Setup,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    register_environment: None,
) -> None:
    monkeypatch.setattr(
        instrumentation.SglangInstrumentor, "installed", lambda _self: ("sglang", "0.6.0")
    )
    monkeypatch.setattr(instrumentation.SglangInstrumentor, "_unsupported_warned", False)
    originals = patched_attributes()
    with caplog.at_level(logging.WARNING):
        instrumentation.register()
        instrumentation.register()  # SGLang calls it once per process: harmless twice
    assert patched_attributes() == originals
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


# --- one request end to end -----------------------------------------------------------------------
def test_one_request_end_to_end_through_the_frontend_and_the_scheduler(
    sglang_stand_in: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    sglang_stand_in.instrument()
    tracer = sglang_stand_in.tracer
    tracked: list[tuple[str, tuple[bytes, bytes, bytes]]] = []
    track = tracer.track

    def spy(request_id: str, parent: tuple[bytes, bytes, bytes]) -> None:
        tracked.append((request_id, parent))
        track(request_id, parent)

    monkeypatch.setattr(tracer, "track", spy)
    manager, scheduler = TokenizerManager(), Scheduler()
    tokenized = manager.tokenize("req-1", 5, max_new_tokens=4)
    arrival = monotonic_ns()
    manager.send(tokenized)
    timer = sglang_stand_in.recorder.get("req-1")
    assert timer is not None and timer.arrival_ns == arrival
    ids = (timer.trace_id, timer.span_id, timer.prefill_span_id)
    assert len(timer.trace_id) == 16 and timer.parent_span_id == b""
    assert len(set(ids)) == 3 and all(len(i) == 8 for i in ids[1:])
    # The parent header rides on time_stats and crosses in its pickled state.
    assert getattr(tokenized.time_stats, PARENT_STATE_KEY) == engine_parent_header(*ids)
    (message,) = manager.sent
    crossed = pickle.loads(message)
    assert isinstance(crossed.time_stats, stand_ins.PickleWrapper)
    state = pickle.loads(crossed.time_stats.data).__dict__
    assert parse_engine_parent(state[PARENT_STATE_KEY]) == ids
    assert "created_time" not in state  # SGLang's own state is unchanged otherwise
    advance(0.002)
    queued_s = scheduler_clock_s()
    scheduler.receive(manager.sent.pop())
    assert tracked == [("req-1", ids)]
    req = scheduler.requests["req-1"]
    assert req.time_stats.has_timing_data  # set by _add_request_to_queue
    # Prefill (one step, first token), then three decode steps.
    deliveries: list[int] = []
    first_scheduled_s = None
    while True:
        if first_scheduled_s is None and scheduler.waiting_queue:
            first_scheduled_s = scheduler_clock_s()
        if not scheduler.step():
            break
        if len(deliveries) == 0:
            assert not req.time_stats.has_timing_data  # its first token came: cleared
        advance(0.001)
        deliveries.append(monotonic_ns())
        deliver(scheduler, manager)
    assert sglang_stand_in.finished == [timer]
    assert timer.token_ns == deliveries and len(deliveries) == 4
    assert timer.queued_ns == ns(queued_s)
    assert first_scheduled_s is not None and timer.first_scheduled_ns == ns(first_scheduled_s)
    assert timer.end_ns == deliveries[-1]
    assert timer.status_error is None
    assert timer.attributes == {
        "request_id": "req-1",
        "model": "served-model",
        "operation": semconv.OPERATION_TEXT_COMPLETION,
        "input_tokens": 5,
        PROMPT_TOKEN_IDS: [0, 1, 2, 3, 4],
        "max_tokens": 4,
        "temperature": 0.0,
        "top_p": 1.0,
        "finish_reason": "length",
        "output_tokens": 4,
        "cached_tokens": 0,
    }
    assert "req-1" not in manager.rid_to_state  # SGLang's own handler ran
    assert not sglang_stand_in.guard.failures


def test_the_parent_ids_cross_a_data_parallel_controller(sglang_stand_in: Setup) -> None:
    sglang_stand_in.instrument()
    manager, scheduler = TokenizerManager(), Scheduler()
    manager.send(manager.tokenize("r", 5, max_new_tokens=2))
    timer = sglang_stand_in.recorder.get("r")
    assert timer is not None
    scheduler.receive(stand_ins.data_parallel_controller(manager.sent.pop()))
    tracked = sglang_stand_in.tracer._requests["r"]
    assert tracked is not None
    assert (tracked.trace_id, tracked.request_span_id, tracked.prefill_span_id) == (
        timer.trace_id,
        timer.span_id,
        timer.prefill_span_id,
    )
    while scheduler.step():
        deliver(scheduler, manager)
    assert sglang_stand_in.finished == [timer] and len(timer.token_ns) == 2


def test_the_parent_ids_do_not_ride_back_in_the_outputs(sglang_stand_in: Setup) -> None:
    sglang_stand_in.instrument()
    manager, scheduler = TokenizerManager(), Scheduler()
    manager.send(manager.tokenize("r", 5, max_new_tokens=2))
    scheduler.receive(manager.sent.pop())
    scheduler.step()
    (output,) = scheduler.outbox
    (stats,) = pickle.loads(output.time_stats.data)
    assert PARENT_STATE_KEY not in vars(stats)


def test_the_queue_times_are_shipped_with_the_first_output_only(sglang_stand_in: Setup) -> None:
    sglang_stand_in.instrument()
    manager, scheduler = TokenizerManager(), Scheduler()
    manager.send(manager.tokenize("req-1", 5, max_new_tokens=3))
    scheduler.receive(manager.sent.pop())
    shipped: list[dict[str, Any]] = []
    while scheduler.step():
        (output,) = scheduler.outbox
        (stats,) = pickle.loads(output.time_stats.data)
        shipped.append(dict(vars(stats)))
        deliver(scheduler, manager)
    assert [bool(s) for s in shipped] == [True, False, False]
    assert shipped[0]["wait_queue_entry_time"] > 0 and shipped[0]["forward_entry_time"] > 0


def test_tokens_of_one_output_batch_share_one_clock_read(
    sglang_stand_in: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    sglang_stand_in.instrument()
    manager = TokenizerManager()
    manager.send_batch([manager.tokenize("a"), manager.tokenize("b"), manager.tokenize("c")])
    recorder = sglang_stand_in.recorder
    reads: list[int] = []

    def clock() -> int:
        reads.append(monotonic_ns())
        return reads[-1]

    monkeypatch.setattr(recorder, "clock", clock)
    advance(0.5)
    # "a" got one token, "b" three at once (speculative decoding, coalesced outputs), "c" none.
    result = manager.receive(
        BatchStrOutput(["a", "b", "c"], [None, None, None], [5, 5, 5], [1, 3, 0], [0, 0, 0])
    )
    assert result == []
    assert len(reads) == 1
    now = reads[0]
    timers = {rid: recorder.get(rid) for rid in "abc"}
    assert [len(t.token_ns) for t in timers.values() if t is not None] == [1, 3, 0]
    advance(0.1)
    manager.receive(BatchStrOutput(["b"], [None], [5], [5], [0]))
    b = timers["b"]
    assert b is not None and b.token_ns == [now, now, now, reads[1], reads[1]]
    assert len(reads) == 2


def test_outputs_without_a_traced_request_read_no_clock(
    sglang_stand_in: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    sglang_stand_in.instrument()
    manager = TokenizerManager()
    manager.send(manager.tokenize("traced"))
    monkeypatch.setattr(sglang_stand_in.recorder, "clock", lambda: pytest.fail("clock read"))
    manager.tokenize("other")  # an untraced state (e.g. sent before instrumenting)
    assert manager.receive(BatchStrOutput(["other"], [{"type": "stop"}], [5], [1], [0])) == [
        "other"
    ]


def test_the_trace_context_of_an_engine_callers_external_trace_header(
    sglang_stand_in: Setup,
) -> None:
    sglang_stand_in.instrument()
    manager, scheduler = TokenizerManager(), Scheduler()
    traceparent = f"00-{TRACE.hex()}-{CALLER_SPAN.hex()}-01"
    timer, _ = serve(
        sglang_stand_in, manager, scheduler, external_trace_header={"traceparent": traceparent}
    )
    assert (timer.trace_id, timer.parent_span_id) == (TRACE, CALLER_SPAN)
    assert timer.attributes["operation"] == semconv.OPERATION_TEXT_COMPLETION
    # The scheduler's spans join the caller's trace too.
    other, _ = serve(
        sglang_stand_in, manager, scheduler, "req-2", external_trace_header={"traceparent": "00-x"}
    )
    assert len(other.trace_id) == 16 and other.trace_id != TRACE and other.parent_span_id == b""


def test_the_trace_context_of_the_http_server_span(sglang_stand_in: Setup) -> None:
    sglang_stand_in.instrument()
    manager, scheduler = TokenizerManager(), Scheduler()
    span = asgi.HttpServerSpan(TRACE, CALLER_SPAN, b"", "POST", "/v1/chat/completions", 0)
    token = asgi._current.set(span)
    try:
        tokenized = manager.tokenize(
            "req-1", external_trace_header={"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-01"}
        )
        manager.send(tokenized)
    finally:
        asgi._current.reset(token)
    timer = sglang_stand_in.recorder.get("req-1")
    assert timer is not None
    assert (timer.trace_id, timer.parent_span_id) == (TRACE, CALLER_SPAN)  # the HTTP span wins
    assert timer.attributes["operation"] == semconv.OPERATION_CHAT
    scheduler.receive(manager.sent.pop())
    tracked = sglang_stand_in.tracer._requests["req-1"]
    assert tracked is not None and tracked.trace_id == TRACE
    assert tracked.request_span_id == timer.span_id


@pytest.mark.parametrize(
    ("reason", "finish_reason", "status_error"),
    [
        ({"type": "stop", "matched": 2}, "stop", None),
        ({"type": "length", "length": 4}, "length", None),
        ({"type": "abort", "message": "client gone", "status_code": 400}, "abort", "aborted"),
        ({"matched": 2}, "stop", None),  # no type: SGLang's FINISH_MATCHED_* always has one
    ],
)
def test_finish_reasons(
    sglang_stand_in: Setup,
    reason: dict[str, Any],
    finish_reason: str,
    status_error: str | None,
) -> None:
    sglang_stand_in.instrument()
    manager = TokenizerManager()
    manager.send(manager.tokenize("r", 7))
    manager.receive(BatchStrOutput(["r"], [None], [7], [2], [3]))
    assert manager.receive(BatchStrOutput(["r"], [reason], [7], [3], [3])) == ["r"]
    (timer,) = sglang_stand_in.finished
    assert timer.attributes["finish_reason"] == finish_reason
    assert timer.status_error == status_error
    assert timer.attributes["output_tokens"] == 3
    assert timer.attributes["input_tokens"] == 7
    assert timer.attributes["cached_tokens"] == 3


def test_an_abort_in_the_scheduler_ends_the_request_as_aborted(sglang_stand_in: Setup) -> None:
    sglang_stand_in.instrument()
    manager, scheduler = TokenizerManager(), Scheduler()
    manager.send(manager.tokenize("r", 5, max_new_tokens=100))
    scheduler.receive(manager.sent.pop())
    for _ in range(3):
        scheduler.step()
    scheduler.abort("r")
    deliver(scheduler, manager)
    (timer,) = sglang_stand_in.finished
    assert timer.status_error == "aborted" and timer.attributes["finish_reason"] == "abort"
    assert timer.attributes["output_tokens"] == 3
    assert sglang_stand_in.recorder.in_flight == 0


def test_health_check_requests_are_not_traced(sglang_stand_in: Setup) -> None:
    sglang_stand_in.instrument()
    manager, scheduler = TokenizerManager(), Scheduler()
    tokenized = manager.tokenize("HEALTH_CHECK_1234", 1, max_new_tokens=1)
    manager.send(tokenized)
    assert sglang_stand_in.recorder.in_flight == 0
    assert PARENT_STATE_KEY not in vars(tokenized.time_stats)
    scheduler.receive(manager.sent.pop())
    scheduler.run_until_idle()
    deliver(scheduler, manager)
    assert sglang_stand_in.finished == []
    assert sglang_stand_in.tracer.stats()["engine.tracked_requests"] == 0
    assert sglang_stand_in.engine_jobs == []


def test_a_request_that_never_reached_the_scheduler_ends_as_rejected(
    sglang_stand_in: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    sglang_stand_in.instrument()
    manager = TokenizerManager()
    tokenized = [manager.tokenize("a"), manager.tokenize("b")]

    def unreachable(obj: Any) -> None:
        raise ConnectionError("scheduler gone")

    monkeypatch.setattr(manager, "_dispatch_to_scheduler", unreachable)
    with pytest.raises(ConnectionError):
        manager.send_batch(tokenized)
    assert sglang_stand_in.recorder.in_flight == 2  # the timers began before the hand-off
    states = {rid: manager.rid_to_state[rid] for rid in ("a", "b")}
    manager._release_req_states_on_failure(states)
    assert manager.rid_to_state == {}  # SGLang's own release ran
    assert sorted((t.request_id, t.status_error) for t in sglang_stand_in.finished) == [
        ("a", "rejected"),
        ("b", "rejected"),
    ]


def test_a_dispatched_request_released_on_failure_ends_with_its_abort_output(
    sglang_stand_in: Setup,
) -> None:
    sglang_stand_in.instrument()
    manager = TokenizerManager()
    manager.send(manager.tokenize("r"))
    manager._release_req_states_on_failure({"r": manager.rid_to_state["r"]})
    assert manager.aborted == ["r"]
    assert sglang_stand_in.finished == []  # SGLang aborts it in the scheduler
    manager.receive(BatchStrOutput(["r"], [{"type": "abort"}], [5], [0], [0]))
    (timer,) = sglang_stand_in.finished
    assert timer.status_error == "aborted"


def test_requests_passed_by_keyword_are_traced(sglang_stand_in: Setup) -> None:
    sglang_stand_in.instrument()
    manager, scheduler = TokenizerManager(), Scheduler()
    asyncio.run(manager._send_one_request(tokenized_obj=manager.tokenize("one")))
    asyncio.run(manager._send_batch_request(tokenized_objs=[manager.tokenize("two")]))
    for message in manager.sent:
        scheduler.receive(message)
    scheduler.run_until_idle()
    for output in scheduler.outbox:
        asyncio.run(manager._handle_batch_output(recv_obj=output))
    assert sorted(t.request_id for t in sglang_stand_in.finished) == ["one", "two"]


def test_a_batch_of_requests_sent_together(
    sglang_stand_in: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    sglang_stand_in.instrument()
    manager, scheduler = TokenizerManager(), Scheduler()
    rids = ["b0", "b1", "b2"]
    tokenized = [manager.tokenize(rid, 3 + i, max_new_tokens=2) for i, rid in enumerate(rids)]
    manager.send_batch(tokenized)
    timers = [sglang_stand_in.recorder.get(rid) for rid in rids]
    assert all(timer is not None for timer in timers)
    span_ids = {t.span_id for t in timers if t is not None}
    span_ids |= {t.prefill_span_id for t in timers if t is not None}
    assert len(span_ids) == 6
    for tok, timer in zip(tokenized, timers, strict=True):
        assert timer is not None
        assert getattr(tok.time_stats, PARENT_STATE_KEY) == engine_parent_header(
            timer.trace_id, timer.span_id, timer.prefill_span_id
        )
    for message in manager.sent:
        scheduler.receive(message)
    assert sorted(r for r, t in sglang_stand_in.tracer._requests.items() if t) == rids
    while scheduler.step():
        deliver(scheduler, manager)
    assert sorted(t.request_id for t in sglang_stand_in.finished) == rids
    assert [len(t.token_ns) for t in sglang_stand_in.finished] == [2, 2, 2]
    assert [t.attributes["input_tokens"] for t in timers if t is not None] == [3, 4, 5]


# --- the scheduler --------------------------------------------------------------------------------
def test_steps_are_recorded_with_prefill_tokens_from_extend_lens(sglang_stand_in: Setup) -> None:
    sglang_stand_in.instrument()
    manager, scheduler = TokenizerManager(), Scheduler(chunk=2)
    starts: list[int] = []
    tracer = sglang_stand_in.tracer
    serve_steps = 0
    manager.send(manager.tokenize("r", 5, max_new_tokens=3))
    scheduler.receive(manager.sent.pop())
    req = scheduler.requests["r"]
    timing: list[bool] = []
    while scheduler.next_batch() is not None:
        batch = scheduler.next_batch()
        assert batch is not None
        starts.append(monotonic_ns())
        scheduler.process_batch_result(batch, scheduler.run_batch(batch))
        timing.append(req.time_stats.has_timing_data)
        serve_steps += 1
        deliver(scheduler, manager)
    # 2 + 2 + 1 prompt tokens (the last chunk gives the first token), then two decode steps.
    steps = [tracer._step_at(i) for i in range(tracer.steps)]
    assert serve_steps == tracer.steps == 5
    assert [s.prefill_tokens for s in steps if s is not None] == [2, 2, 1, 0, 0]
    assert [s.decode_tokens for s in steps if s is not None] == [0, 0, 0, 1, 1]
    assert [s.request_ids for s in steps if s is not None] == [("r",)] * 5
    # Cleared once the chunk that gave the first token ran, not after a mere chunk.
    assert timing == [True, True, False, False, False]
    first = steps[0]
    assert first is not None
    assert first.start_ns == starts[0] and first.end_ns == starts[0] + ns(0.01)
    assert first.kv_cache_usage == 0.25
    assert (first.waiting, first.running) == (1, 0)
    last = steps[-1]
    assert last is not None and (last.waiting, last.running) == (0, 0)
    assert tracer.stats()["engine.tracked_requests"] == 0


def test_steps_are_recorded_in_the_overlap_loop_where_results_come_with_a_batch_copy(
    sglang_stand_in: Setup,
) -> None:
    sglang_stand_in.instrument()
    manager, scheduler = TokenizerManager(), Scheduler(overlap=True)
    serve(sglang_stand_in, manager, scheduler, max_new_tokens=3)
    assert sglang_stand_in.tracer.steps == 3
    assert sglang_stand_in.instrumentor._open_steps == {}


def test_a_chunked_prefill_becomes_chunk_spans_under_the_prefill_span(
    sglang_stand_in: Setup,
) -> None:
    sglang_stand_in.instrument()
    manager, scheduler = TokenizerManager(), Scheduler(chunk=4)
    timer, _ = serve(sglang_stand_in, manager, scheduler, prompt_tokens=10, max_new_tokens=2)
    spans = spans_by_name(sglang_stand_in.engine_jobs)
    chunks = spans[semconv.SPAN_PREFILL_CHUNK]
    assert [attributes(c)[semconv.PREFILL_CHUNK_TOKENS] for c in chunks] == [4, 4, 2]
    assert {c.parent_span_id for c in chunks} == {timer.prefill_span_id}
    assert {c.trace_id for c in chunks} == {timer.trace_id}
    # In order, the first from the first prefill step's start.
    assert chunks[0].start_time_unix_nano == CLOCK.to_unix_ns(timer.first_scheduled_ns or 0)
    for before, after in itertools.pairwise(chunks):
        assert before.end_time_unix_nano <= after.start_time_unix_nano
    assert semconv.SPAN_PREEMPTED not in spans and semconv.SPAN_ENGINE_STEP not in spans


def test_a_single_step_prefill_has_no_chunk_spans(sglang_stand_in: Setup) -> None:
    sglang_stand_in.instrument()
    serve(sglang_stand_in, TokenizerManager(), Scheduler())
    assert len(sglang_stand_in.engine_jobs) == 1  # planned on the emitter's thread: nothing
    assert planned_jobs(sglang_stand_in.engine_jobs) == []


def test_a_retracted_request_gets_a_preempted_span_until_its_recompute(
    sglang_stand_in: Setup,
) -> None:
    sglang_stand_in.instrument()
    manager, scheduler = TokenizerManager(), Scheduler()
    manager.send(manager.tokenize("r", 5, max_new_tokens=5))
    timer = sglang_stand_in.recorder.get("r")
    assert timer is not None
    scheduler.receive(manager.sent.pop())
    for _ in range(2):  # prefill + one decode
        scheduler.step()
        deliver(scheduler, manager)
    advance(0.005)
    retracted_ns = monotonic_ns()
    scheduler.retract("r")
    req = scheduler.requests["r"]
    assert req.time_stats.has_timing_data  # queued again
    advance(0.03)  # it waits
    resumed_ns = monotonic_ns()
    scheduler.step()  # the recompute: a prefill step of prompt + output
    assert not req.time_stats.has_timing_data
    deliver(scheduler, manager)
    while scheduler.step():
        deliver(scheduler, manager)
    (finished,) = sglang_stand_in.finished
    assert finished.token_ns and len(finished.token_ns) == 5
    jobs = planned_jobs(sglang_stand_in.engine_jobs)
    preempted_jobs = [
        job for job in jobs if job.spans and job.spans[0].name == semconv.SPAN_PREEMPTED
    ]
    (job,) = preempted_jobs
    assert (job.trace_id, job.parent_span_id) == (timer.trace_id, timer.span_id)
    (span,) = job.spans
    assert (span.start_ns, span.end_ns) == (
        CLOCK.to_unix_ns(retracted_ns),
        CLOCK.to_unix_ns(resumed_ns),
    )


def test_the_recompute_after_a_retraction_is_not_a_chunk_of_the_first_prefill(
    sglang_stand_in: Setup,
) -> None:
    sglang_stand_in.instrument()
    manager, scheduler = TokenizerManager(), Scheduler()
    manager.send(manager.tokenize("r", 5, max_new_tokens=5))
    timer = sglang_stand_in.recorder.get("r")
    assert timer is not None
    scheduler.receive(manager.sent.pop())
    for _ in range(2):  # the whole prompt in one step (the first token), then one decode
        scheduler.step()
        deliver(scheduler, manager)
    scheduler.retract("r")
    while scheduler.step():
        deliver(scheduler, manager)
    jobs = planned_jobs(sglang_stand_in.engine_jobs)
    assert [job for job in jobs if job.parent_span_id == timer.prefill_span_id] == []


def test_a_request_that_ends_while_retracted_gets_a_preempted_span_to_its_end(
    sglang_stand_in: Setup,
) -> None:
    sglang_stand_in.instrument()
    tracer = sglang_stand_in.tracer
    parent = (TRACE, CALLER_SPAN, bytes(range(31, 39)))
    tracer.track("r", parent)
    tracer.record_step(0, 10, [("r", 5)], [], [], kv_cache_usage=0.0, waiting=0, running=1)
    tracer.preempt("r", 20)
    tracer.record_step(30, 40, [], [], ["r"], kv_cache_usage=0.0, waiting=1, running=0)
    (job,) = planned_jobs(sglang_stand_in.engine_jobs)
    (span,) = job.spans
    assert span.name == semconv.SPAN_PREEMPTED
    assert span.start_ns == CLOCK.to_unix_ns(20)
    assert span.end_ns == CLOCK.to_unix_ns(monotonic_ns())  # when the emitter planned it


def test_a_decode_gap_far_above_the_median_exports_the_steps_inside_it(
    sglang_stand_in: Setup,
) -> None:
    sglang_stand_in.instrument()
    manager, scheduler = TokenizerManager(), Scheduler(step_s=0.01)
    scheduler.slow_steps[5] = 0.2  # the fifth step (the fourth decode) stalls
    timer, _ = serve(sglang_stand_in, manager, scheduler, max_new_tokens=8)
    spans = spans_by_name(sglang_stand_in.engine_jobs)
    (slow,) = spans[semconv.SPAN_ENGINE_STEP]
    assert (slow.trace_id, slow.parent_span_id) == (timer.trace_id, timer.span_id)
    assert abs(slow.end_time_unix_nano - slow.start_time_unix_nano - 0.2 * NS) < 1_000
    attrs = attributes(slow)
    assert attrs[semconv.ENGINE_STEP_DECODE_REQUESTS] == 1
    assert attrs[semconv.ENGINE_STEP_REQUEST_IDS] == ("req-1",)
    stats = sglang_stand_in.tracer.stats()
    assert stats["engine.requests_with_outliers"] == 1 and stats["engine.outlier_steps"] == 1


def test_a_scheduler_of_another_tensor_parallel_rank_records_nothing(
    sglang_stand_in: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    sglang_stand_in.instrument()
    manager = TokenizerManager()
    manager.send(manager.tokenize("r", 5, max_new_tokens=3))
    message = manager.sent.pop()
    # This scheduler process is tensor-parallel rank 1 (SGLang's rank 0 broadcasts each request
    # to the other ranks, which run the same steps).
    monkeypatch.setattr(stand_ins.PARALLEL, "tp_rank", 1)
    monkeypatch.setattr(stand_ins.PARALLEL, "attn_tp_rank", 1)
    rank1 = Scheduler()
    rank1.receive(message)
    rank1.run_until_idle()
    assert rank1.outbox == []  # the stand-in's own rule: only rank 0 sends outputs
    assert sglang_stand_in.tracer.steps == 0
    assert planned_jobs(sglang_stand_in.engine_jobs) == []


def test_the_scheduler_of_rank_zero_records_its_steps(sglang_stand_in: Setup) -> None:
    sglang_stand_in.instrument()
    manager = TokenizerManager()
    manager.send(manager.tokenize("r", 5, max_new_tokens=3))
    scheduler = Scheduler()
    scheduler.receive(manager.sent.pop())
    scheduler.run_until_idle()
    assert sglang_stand_in.tracer.steps == 3


def test_a_request_without_a_parent_header_is_counted_in_steps_but_not_tracked(
    sglang_stand_in: Setup,
) -> None:
    sglang_stand_in.instrument()
    scheduler = Scheduler(chunk=2)
    # Sent by a frontend tokentrace does not run in: no parent on its time stats.
    request = stand_ins.TokenizedGenerateReqInput(
        "plain", [0, 1, 2, 3, 4], stand_ins.SamplingParams(2), stand_ins.APIServerReqTimeStats()
    )
    request.wrap_pickle_fields()
    scheduler.receive(pickle.dumps(request))
    scheduler.run_until_idle()
    assert sglang_stand_in.tracer.steps == 4
    assert sglang_stand_in.tracer.stats()["engine.tracked_requests"] == 0
    assert sglang_stand_in.engine_jobs == []


# --- zero harm ------------------------------------------------------------------------------------
class OutputWithoutPromptTokens:
    """An output of another shape: the hook needs ``prompt_tokens``, the stand-in does not."""

    def __init__(self, rid: str) -> None:
        self.rids = [rid]
        self.finished_reasons = [{"type": "stop"}]
        self.completion_tokens = [1]
        self.cached_tokens = [0]
        self.time_stats = None


def test_a_raising_output_hook_is_disabled_logged_once_and_sglang_still_runs(
    sglang_stand_in: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    sglang_stand_in.instrument()
    manager = TokenizerManager()
    manager.send(manager.tokenize("r"))
    with caplog.at_level(logging.WARNING, logger="tokentrace"):
        result = manager.receive(OutputWithoutPromptTokens("r"))  # type: ignore[arg-type]
        assert result == ["r"]  # SGLang's own handler ran and its value came back
        manager.send(manager.tokenize("r2"))
        assert manager.receive(OutputWithoutPromptTokens("r2")) == ["r2"]  # type: ignore[arg-type]
    assert sglang_stand_in.guard.failures == {HOOK_OUTPUTS: 1}
    assert HOOK_OUTPUTS in sglang_stand_in.guard.disabled
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and HOOK_OUTPUTS in warnings[0].getMessage()
    # Request tracing stopped as a whole: the second request opened no timer.
    assert sglang_stand_in.recorder.get("r2") is None
    assert sglang_stand_in.finished == []


def test_a_raising_step_hook_is_disabled_and_the_scheduler_keeps_serving(
    sglang_stand_in: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    sglang_stand_in.instrument()

    def broken(*args: Any, **kwargs: Any) -> int:
        raise RuntimeError("boom")

    monkeypatch.setattr(sglang_stand_in.tracer, "record_step", broken)
    manager, scheduler = TokenizerManager(), Scheduler()
    timer, deliveries = serve(sglang_stand_in, manager, scheduler, max_new_tokens=3)
    assert timer.token_ns == deliveries and sglang_stand_in.finished == [timer]
    assert sglang_stand_in.guard.failures == {HOOK_SCHEDULER_STEP: 1}
    assert sglang_stand_in.instrumentor._open_steps == {}  # run_batch stopped opening steps


def test_uninstrumented_hooks_do_nothing_while_a_patch_is_still_in_place(
    sglang_stand_in: Setup,
) -> None:
    sglang_stand_in.instrument()
    manager = TokenizerManager()
    send = vars(TokenizerManager)["_send_one_request"]
    sglang_stand_in.instrumentor._active = False  # as between uninstrument and a revert
    try:
        manager.send(manager.tokenize("r"))
    finally:
        sglang_stand_in.instrumentor._active = True
    assert isinstance(send, wrapt.FunctionWrapper)
    assert sglang_stand_in.recorder.in_flight == 0


# --- the cold start -------------------------------------------------------------------------------
def launch(monkeypatch: pytest.MonkeyPatch, runner: ModelRunner | None = None) -> Any:
    runner = runner or ModelRunner()
    monkeypatch.setattr(stand_ins, "SCHEDULER_START_UP", [runner.load_model])
    advance_startup_clock(stand_ins.IMPORT_NS)
    return Engine._launch_subprocesses(
        "server-args", lambda args: f"tokenizer({args})", print, print
    )


def bounds(span: Any) -> tuple[int, int]:
    return span.start_time_unix_nano - UNIX_OFFSET, span.end_time_unix_nano - UNIX_OFFSET


def test_launch_subprocesses_a_classmethod_ends_the_cold_start_root(
    sglang_stand_in: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    sglang_stand_in.instrument()
    assert isinstance(vars(Engine)["_launch_subprocesses"], wrapt.FunctionWrapper)
    result = launch(monkeypatch)
    assert result == ("tokenizer(server-args)", "Engine")  # bound to the class, as in SGLang
    ready = startup_monotonic_ns()
    spans = spans_by_name(sglang_stand_in.cold_start_jobs)
    (root,) = spans[semconv.SPAN_COLD_START]
    assert bounds(root) == (PROCESS_START_NS, ready)
    (weights,) = spans[semconv.SPAN_COLD_START_WEIGHT_LOAD]
    loaded = PROCESS_START_NS + stand_ins.IMPORT_NS
    assert bounds(weights) == (loaded, loaded + WEIGHT_LOAD_NS)
    assert weights.trace_id == root.trace_id and weights.parent_span_id == root.span_id
    assert attributes(weights) == {semconv.MODEL_WEIGHT_BYTES: stand_ins.MODEL_WEIGHT_BYTES}
    (imported,) = spans[semconv.SPAN_COLD_START_IMPORT]
    assert bounds(imported) == (PROCESS_START_NS, loaded)
    assert sglang_stand_in.cold_start.ready_ns == ready
    assert not sglang_stand_in.guard.failures


def test_a_model_that_fails_to_load_ends_its_phase_and_the_cold_start_with_the_error(
    sglang_stand_in: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    sglang_stand_in.instrument()
    error = OSError("weights missing")
    with pytest.raises(OSError) as raised:
        launch(monkeypatch, ModelRunner(load_error=error))
    assert raised.value is error
    spans = spans_by_name(sglang_stand_in.cold_start_jobs)
    (weights,) = spans[semconv.SPAN_COLD_START_WEIGHT_LOAD]
    (root,) = spans[semconv.SPAN_COLD_START]
    for span in (weights, root):
        assert span.status.code == span.status.STATUS_CODE_ERROR
        assert span.status.message == "OSError"
    assert attributes(weights) == {}
    assert sglang_stand_in.cold_start.ready_ns is None


def test_a_request_that_arrived_during_the_cold_start_gets_its_ready_time(
    sglang_stand_in: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    sglang_stand_in.instrument()
    stand_ins.reset_clock(0.0005)  # the recorder's clock: before the cold start ends
    manager = TokenizerManager()
    manager.send(manager.tokenize("early"))
    launch(monkeypatch)
    timer = sglang_stand_in.recorder.get("early")
    assert timer is not None and timer.ready_ns == sglang_stand_in.cold_start.ready_ns
    cold_start = sglang_stand_in.cold_start
    assert timer.cold_start_link == (cold_start.trace_id, cold_start.root_span_id)


def test_spanjob_types_are_what_the_emitter_expects(sglang_stand_in: Setup) -> None:
    sglang_stand_in.instrument()
    serve(sglang_stand_in, TokenizerManager(), Scheduler(chunk=2))
    assert all(isinstance(job, SpanJob) for job in planned_jobs(sglang_stand_in.engine_jobs))
