"""The EngineCore half of the vLLM instrumentation, on a stand-in scheduler with vLLM's shape.

The stand-in (``test_vllm_instrumentation.Scheduler``) runs chunked prefill and decode with
EngineCore-like timestamps; the real patch table wraps it, so these tests exercise the wrappers,
the ring buffer, the outlier rule, the deferred planning and the encoding end to end.
"""

from __future__ import annotations

import collections
import itertools
import logging
import random
import statistics
import time
import types
from typing import Any

import pytest
import wrapt
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tests.agent.vllm_stand_ins import (
    CLOCK,
    SCHEDULED,
    SCHEDULED_EVENT_DELAY_S,
    AsyncLLM,
    CachedRequestData,
    CoreRequest,
    EngineRequest,
    Event,
    NewRequestData,
    Scheduler,
    SchedulerOutput,
    Setup,
    engine_monotonic_ns,
)
from tokentrace.agent import semconv
from tokentrace.agent.frameworks import vllm_engine
from tokentrace.agent.frameworks.patching import is_patch
from tokentrace.agent.frameworks.vllm_engine import (
    _SWEEP_EVERY_STEPS,
    ENGINE_PARENT_HEADER,
    HOOK_STEP_DONE,
    HOOK_STEP_SCHEDULED,
    EngineStepTracer,
    StepRecord,
    _prefill_ids,
    _TrackedRequest,
    engine_parent_header,
    outlier_gap_ends,
    parse_engine_parent,
)
from tokentrace.agent.hooks import HookGuard
from tokentrace.agent.span_encoding import SpanBatchEncoder
from tokentrace.agent.spans import SpanJob

NS = 1_000_000_000
TRACE = bytes(range(1, 17))
REQUEST_SPAN = bytes(range(21, 29))
PREFILL_SPAN = bytes(range(31, 39))


@pytest.fixture(autouse=True, params=["C", "Python"])
def step_loops(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs with the per-step work in C (``_steps.c``: the step hooks and the
    tracer's ``step_facts``) and with their twins (the Python patches and methods)."""
    if request.param == "C" and not vllm_engine.BUILT:
        pytest.skip("the C extension is not built here (or TOKENTRACE_PURE_PYTHON is set)")
    if request.param == "Python":
        monkeypatch.setattr(vllm_engine, "_STEP_FACTS", None)
        monkeypatch.setattr(vllm_engine, "_STEP_HOOK", None)
        monkeypatch.setattr(vllm_engine, "_TOKEN_STEP_ENDS", None)
        monkeypatch.setattr(vllm_engine, "_OUTLIER_GAP_ENDS", None)
    return str(request.param)


def traced(request_id: str, prompt_tokens: int, number: int = 0) -> CoreRequest:
    trace = bytes([number + 1]) * 16
    header = engine_parent_header(trace, bytes([number + 2]) * 8, bytes([number + 3]) * 8)
    return CoreRequest(request_id, prompt_tokens, trace_headers={ENGINE_PARENT_HEADER: header})


def run_until_idle(scheduler: Scheduler, limit: int = 100) -> None:
    for _ in range(limit):
        if not scheduler.requests:
            return
        scheduler.step()
    raise AssertionError("the stand-in scheduler did not finish its requests")


def direct_tracer(jobs: list[Any], **options: Any) -> EngineStepTracer:
    """A tracer called directly (no patches), on the stand-in engine's clock."""
    return EngineStepTracer(
        jobs.append,
        guard=HookGuard(),
        to_unix=CLOCK,
        monotonic_ns=engine_monotonic_ns,
        **options,
    )


def drive(tracer: EngineStepTracer, scheduler: Scheduler) -> None:
    """EngineCore's busy loop around the two hooks, until every request finished."""
    while scheduler.requests:
        start = tracer.clock()
        output = scheduler.schedule()
        tracer.on_scheduled(output, start)
        tracer.on_step_done(scheduler, output, scheduler.update_from_output(output, None))


def planned_jobs(jobs: list[Any]) -> list[SpanJob]:
    """What the emitter's thread does with the deferred jobs."""
    planned: list[SpanJob] = []
    for job in jobs:
        planned += job() if callable(job) else [job]
    return planned


def encoded_spans(jobs: list[SpanJob]) -> list[Span]:
    encoder = SpanBatchEncoder(resource_attributes={"service.name": "t"}, scope_name="t")
    payload, count = encoder.encode([], jobs)
    message = ExportTraceServiceRequest.FromString(payload)
    spans = [span for rs in message.resource_spans for ss in rs.scope_spans for span in ss.spans]
    assert len(spans) == count
    return spans


def attributes(span: Span) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for kv in span.attributes:
        value = kv.value
        kind = value.WhichOneof("value")
        if kind == "array_value":
            result[kv.key] = tuple(v.string_value for v in value.array_value.values)
        else:
            result[kv.key] = getattr(value, kind)
    return result


def test_steps_are_recorded_with_vllms_prefill_decode_split(vllm_stand_in: Setup) -> None:
    vllm_stand_in.instrument()
    scheduler = Scheduler(token_budget=8, max_tokens=3)
    scheduler.add(traced("a", 5))
    scheduler.add(traced("b", 6, number=4))
    run_until_idle(scheduler)
    tracer = vllm_stand_in.tracer
    steps = [tracer._step_at(i) for i in range(tracer.steps)]
    assert all(step is not None for step in steps)
    first = steps[0]
    assert first is not None
    # Step 0: a's whole prompt (5) and 3 of b's 6; step 1: a decodes, b's last 3 prompt tokens.
    assert (first.prefill_requests, first.prefill_tokens, first.decode_requests) == (2, 8, 0)
    second = steps[1]
    assert second is not None
    assert (second.prefill_requests, second.prefill_tokens) == (1, 3)
    assert (second.decode_requests, second.decode_tokens) == (1, 1)
    assert tuple(second.request_ids) == ("a", "b") and set(second.prefill_ids) == {"b"}
    assert second.kv_cache_usage == 0.25
    # EngineCore's output timestamp ends each step; the next step starts after it.
    assert second.end_ns == int(scheduler.clock * NS) - (len(steps) - 2) * int(0.01 * NS)
    assert tracer.stats()["engine.tracked_requests"] == 0  # both finished


def test_a_chunked_prefill_becomes_chunk_spans_under_the_prefill_span(
    vllm_stand_in: Setup,
) -> None:
    vllm_stand_in.instrument()
    scheduler = Scheduler(token_budget=4, max_tokens=2)
    scheduler.add(traced("long", 10))  # 4 + 4 + 2 prompt tokens
    run_until_idle(scheduler)
    spans = encoded_spans(planned_jobs(vllm_stand_in.engine_jobs))
    chunks = [span for span in spans if span.name == semconv.SPAN_PREFILL_CHUNK]
    assert [attributes(c)[semconv.PREFILL_CHUNK_TOKENS] for c in chunks] == [4, 4, 2]
    assert {c.parent_span_id for c in chunks} == {bytes([3]) * 8}
    assert {c.trace_id for c in chunks} == {bytes([1]) * 16}
    # Back to back, the first from vLLM's SCHEDULED event (the start of llm.prefill).
    first_scheduled_ns = CLOCK.to_unix_ns(int((1000.0 + SCHEDULED_EVENT_DELAY_S) * NS))
    assert chunks[0].start_time_unix_nano == first_scheduled_ns
    for before, after in itertools.pairwise(chunks):
        assert before.end_time_unix_nano <= after.start_time_unix_nano
    assert not [span for span in spans if span.name == semconv.SPAN_ENGINE_STEP]


def test_the_steps_inside_an_outlier_gap_are_exported_under_the_request(
    vllm_stand_in: Setup,
) -> None:
    vllm_stand_in.instrument()
    scheduler = Scheduler(token_budget=8, max_tokens=8, step_s=0.01)
    scheduler.add(traced("steady", 2))
    # A long prompt arrives later; the step that prefills it takes 10x longer.
    scheduler.step()
    scheduler.step()
    scheduler.step()
    scheduler.add(traced("intruder", 7, number=4))
    scheduler.slow_steps[3] = 0.1
    run_until_idle(scheduler)
    jobs = planned_jobs(vllm_stand_in.engine_jobs)
    steady = [job for job in jobs if job.trace_id == bytes([1]) * 16]
    (step_job,) = steady
    assert step_job.parent_span_id == bytes([2]) * 8
    spans = encoded_spans(steady)
    (slow,) = spans
    assert slow.name == semconv.SPAN_ENGINE_STEP
    assert slow.parent_span_id == bytes([2]) * 8
    attrs = attributes(slow)
    assert attrs[semconv.ENGINE_STEP_PREFILL_TOKENS] == 7
    assert attrs[semconv.ENGINE_STEP_PREFILL_REQUESTS] == 1
    assert attrs[semconv.ENGINE_STEP_REQUEST_IDS] == ("steady", "intruder")
    assert slow.end_time_unix_nano - slow.start_time_unix_nano >= 0.1 * NS - 1
    stats = vllm_stand_in.tracer.stats()
    assert stats["engine.requests_with_outliers"] == 1 and stats["engine.outlier_steps"] == 1


def test_a_requests_token_steps_are_found_in_the_ring_up_to_the_step_that_finished_it() -> None:
    # Nothing is appended per decoding request per step: its token steps are the ring's steps
    # from its first to its last that scheduled it outside their prefill set.
    jobs: list[Any] = []
    tracer = direct_tracer(jobs, sample_rate=0.0)
    scheduler = Scheduler(token_budget=3, max_tokens=6, step_s=0.01)
    scheduler.add(traced("a", 5))  # prefilled in two steps (3 + 2 tokens), then 5 decode steps
    scheduler.slow_steps[6] = 0.1  # the step that gives its last token
    drive(tracer, scheduler)
    assert tracer.steps == 7
    tracked = _TrackedRequest(TRACE, REQUEST_SPAN, PREFILL_SPAN, None, [(0, 3), (1, 2)])
    tracked.request_id, tracked.first_step, tracked.last_step = "a", 0, 6
    ends = tracer._token_step_ends(tracked)  # its last prefill step gives the first token
    assert [index for index, _ in ends] == [1, 2, 3, 4, 5, 6]
    assert [end for _, end in ends] == [tracer._step_at(index).end_ns for index in range(1, 7)]  # type: ignore[union-attr]
    tracked.request_id = "b"  # in none of them
    assert tracer._token_step_ends(tracked) == [ends[0]]
    tracked.prefill_steps = []
    assert tracer._token_step_ends(tracked) == []
    chunks, outliers = planned_jobs(jobs)
    assert [span.name for span in chunks.spans] == [semconv.SPAN_PREFILL_CHUNK] * 2
    (slow,) = outliers.spans
    last = tracer._step_at(6)
    assert last is not None and slow.end_ns == CLOCK.to_unix_ns(last.end_ns)


def test_step_methods_already_wrapped_by_another_tool_are_patched_through_wrapt(
    vllm_stand_in: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Not a plain function in the class: the direct patches fall back to their wrapt wrappers,
    # so the other tool's wrapper still gets its instance.
    calls: list[tuple[str, Any]] = []

    def other_tool(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        calls.append((wrapped.__name__, instance))
        return wrapped(*args, **kwargs)

    for name in ("schedule", "update_from_output"):
        monkeypatch.setattr(
            Scheduler, name, wrapt.FunctionWrapper(vars(Scheduler)[name], other_tool)
        )
    vllm_stand_in.instrument()
    assert all(
        isinstance(vars(Scheduler)[name], wrapt.FunctionWrapper) and is_patch(vars(Scheduler)[name])
        for name in ("schedule", "update_from_output")
    )
    scheduler = Scheduler(token_budget=3, max_tokens=3)
    scheduler.add(traced("a", 5))  # two chunks
    run_until_idle(scheduler)
    tracer = vllm_stand_in.tracer
    assert tracer.steps == 4 and len(calls) == 8
    assert {name for name, _ in calls} == {"schedule", "update_from_output"}
    assert {instance for _, instance in calls} == {scheduler}
    (chunks,) = planned_jobs(vllm_stand_in.engine_jobs)
    assert [span.name for span in chunks.spans] == [semconv.SPAN_PREFILL_CHUNK] * 2


def test_the_step_patches_are_called_as_vllms_methods_are(
    vllm_stand_in: Setup, step_loops: str
) -> None:
    originals = {name: vars(Scheduler)[name] for name in ("schedule", "update_from_output")}
    vllm_stand_in.instrument()
    for name, original in originals.items():
        patched = vars(Scheduler)[name]
        assert is_patch(patched) and patched.__wrapped__ is original
        assert patched.__name__ == name and patched.__qualname__ == original.__qualname__
        # In C where built: no Python frame of ours in the busy loop.
        assert (type(patched).__name__ == "StepHook") == (step_loops == "C")
    scheduler = Scheduler(token_budget=3, max_tokens=4)
    scheduler.add(traced("a", 5))  # two chunks, then three more tokens
    calls = 0
    while scheduler.requests:  # every way Python calls a method, vLLM's argument names
        output = [
            scheduler.schedule,
            lambda: Scheduler.schedule(scheduler),
            lambda: getattr(scheduler, "schedule")(),  # noqa: B009 - the bound method
            scheduler.schedule,
        ][calls % 4]()
        if calls % 2:
            scheduler.update_from_output(scheduler_output=output, model_runner_output=None)
        else:
            Scheduler.update_from_output(scheduler, output, None)
        calls += 1
    tracer = vllm_stand_in.tracer
    assert vllm_stand_in.guard.failures == {}
    assert calls == tracer.steps == 5 and not tracer._open
    (chunks,) = planned_jobs(vllm_stand_in.engine_jobs)
    assert [span.name for span in chunks.spans] == [semconv.SPAN_PREFILL_CHUNK] * 2


def test_a_step_the_c_walk_declines_is_recorded_by_the_twin(vllm_stand_in: Setup) -> None:
    # vLLM's outputs in a mapping that is not a dict: ``step_facts`` declines, and the tracer's
    # Python methods record the step (the same steps and spans as from a dict).
    recorded: list[tuple[int, int, int]] = []
    for wrap in (dict, types.MappingProxyType):

        class Wrapping(Scheduler):
            wraps = wrap

            def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
                outputs = super().update_from_output(scheduler_output, model_runner_output)
                return type(self).wraps(outputs)

        vllm_stand_in.instrument()
        scheduler = Wrapping(token_budget=3, max_tokens=4)
        scheduler.add(traced("a", 5))
        run_until_idle(scheduler)
        tracer = vllm_stand_in.tracer
        recorded.append(
            (tracer.steps, len(planned_jobs(vllm_stand_in.engine_jobs)), len(tracer._open))
        )
        vllm_stand_in.instrumentor.uninstrument()
    assert recorded[0] == (5 * 1, 1, 0)
    assert recorded[1] == (5 * 2, 2, 0)  # the same tracer: counts add up
    assert vllm_stand_in.guard.failures == {}


def test_an_interrupt_inside_an_engine_hook_reaches_the_engine(
    vllm_stand_in: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only Exception is caught (as ``except Exception``): Ctrl-C and exits go to the engine.
    def interrupted(*_args: object) -> None:
        raise KeyboardInterrupt

    # A request first seen: the Python method, or (the C hook) the record's type.
    monkeypatch.setattr(vllm_stand_in.tracer, "_track_first_seen", interrupted)
    parts = (*vllm_engine._TRACK_PARTS[:2], interrupted, interrupted)
    monkeypatch.setattr(vllm_stand_in.tracer, "_track_parts", parts)
    vllm_stand_in.instrument()
    scheduler = Scheduler(max_tokens=3)
    scheduler.add(traced("a", 2))
    with pytest.raises(KeyboardInterrupt):
        scheduler.step()
    assert vllm_stand_in.guard.failures == {}


class _HeldRequests(dict[str, CoreRequest]):
    pass


@pytest.mark.parametrize("held", [dict, _HeldRequests])
def test_a_request_first_seen_is_tracked_in_c_or_else_by_the_method(
    vllm_stand_in: Setup, monkeypatch: pytest.MonkeyPatch, step_loops: str, held: type
) -> None:
    # The C hook reads vLLM's dict of requests itself; anything else goes to the Python method.
    tracer = vllm_stand_in.tracer
    calls: list[int] = []
    method = tracer._track_first_seen

    def counted(scheduler: Any, index: int, first_seen: Any) -> None:
        calls.append(index)
        method(scheduler, index, first_seen)

    monkeypatch.setattr(tracer, "_track_first_seen", counted)
    vllm_stand_in.instrument()
    scheduler = Scheduler(max_tokens=3)
    scheduler.requests = held()
    scheduler.add(traced("a", 2, number=4))
    scheduler.step()
    tracked = tracer._requests["a"]
    assert (tracked.request_id, tracked.first_step, tracked.prefill_steps) == ("a", 0, [(0, 2)])
    assert tracked.trace_id == bytes([5]) * 16
    assert calls == ([] if step_loops == "C" and held is dict else [0])


def test_untraced_requests_are_counted_in_steps_but_never_tracked(vllm_stand_in: Setup) -> None:
    vllm_stand_in.instrument()
    scheduler = Scheduler(token_budget=4, max_tokens=3)
    scheduler.add(CoreRequest("plain", 9))
    scheduler.add(CoreRequest("bad-header", 3, trace_headers={ENGINE_PARENT_HEADER: "nonsense"}))
    run_until_idle(scheduler)
    assert vllm_stand_in.tracer.steps > 3
    assert vllm_stand_in.engine_jobs == []


def test_requests_that_vanish_without_a_finish_reason_are_swept(vllm_stand_in: Setup) -> None:
    vllm_stand_in.instrument()
    scheduler = Scheduler(token_budget=4, max_tokens=10_000)
    scheduler.add(traced("aborted", 2))
    scheduler.step()
    tracer = vllm_stand_in.tracer
    assert tracer.stats()["engine.tracked_requests"] == 1
    scheduler.running.remove("aborted")
    del scheduler.requests["aborted"]  # vLLM freed it (an abort): no output says so
    scheduler.add(CoreRequest("filler", 1))
    scheduler.max_tokens = 1
    for _ in range(1100):
        if not scheduler.requests:
            scheduler.add(CoreRequest(f"filler{scheduler.step_index}", 1))
        scheduler.step()
    assert tracer.stats()["engine.tracked_requests"] == 0
    assert tracer.swept_requests >= 1
    assert len(tracer._requests) < 3


def test_a_sampled_step_is_the_root_of_its_own_trace() -> None:
    jobs: list[Any] = []
    tracer = direct_tracer(jobs, sample_rate=1.0)
    scheduler = Scheduler(max_tokens=2)
    scheduler.add(CoreRequest("x", 3))
    drive(tracer, scheduler)
    spans = encoded_spans(planned_jobs(jobs))
    assert len(spans) == tracer.steps == tracer.sampled_steps == 2
    assert all(span.parent_span_id == b"" for span in spans)
    assert len({span.trace_id for span in spans}) == 2


def test_each_step_is_sampled_at_the_sample_rate_and_independently(vllm_stand_in: Setup) -> None:
    # The C hook draws the gap to the next sampled step (geometric) instead of one draw a step:
    # the same law. 4,000 steps at 1/4: the count within 5 standard deviations (one is 27
    # steps) of 1,000, and gaps of every length, next steps included (not every fourth step).
    tracer = vllm_stand_in.tracer
    tracer._sample_rate, tracer._random = 0.25, random.Random(7).random
    vllm_stand_in.instrument()
    scheduler = Scheduler(max_tokens=4_000)
    scheduler.add(CoreRequest("x", 1))
    run_until_idle(scheduler, limit=4_100)
    jobs = vllm_stand_in.engine_jobs
    sampled = [job.args[0].number for job in jobs if job.func == tracer.plan_sampled_step]
    steps = tracer.steps
    assert steps >= 4_000 and len(sampled) == tracer.sampled_steps
    assert abs(len(sampled) - steps / 4) < 5 * (steps * 0.25 * 0.75) ** 0.5
    gaps = collections.Counter(later - earlier for earlier, later in itertools.pairwise(sampled))
    assert {1, 2, 3, 4, 5, 6, 8, 10} <= set(gaps)
    assert 3.5 < statistics.mean(gaps.elements()) < 4.5


def test_the_ring_keeps_only_the_latest_steps_and_gaps_across_evicted_steps_are_not_judged() -> (
    None
):
    jobs: list[Any] = []
    tracer = direct_tracer(jobs, ring_steps=4, sample_rate=0.0)
    scheduler = Scheduler(max_tokens=20)
    scheduler.slow_steps[2] = 1.0  # an outlier early on, long evicted when the request ends
    scheduler.add(traced("r", 1))
    drive(tracer, scheduler)
    assert tracer._step_at(0) is None and tracer._step_at(tracer.steps - 1) is not None
    assert planned_jobs(jobs) == []


@pytest.mark.parametrize(
    ("parts", "hook"),
    [(("_track_first_seen", "_track_parts"), HOOK_STEP_DONE), (("clock",), HOOK_STEP_SCHEDULED)],
)
def test_a_raising_engine_hook_is_disabled_and_the_scheduler_keeps_working(
    vllm_stand_in: Setup,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    parts: tuple[str, ...],
    hook: str,
) -> None:
    # A part of the tracer that each hook calls (the hooks take them when they are made): a
    # request first seen goes to the Python method, or in C to the record's type.
    def broken(*_args: object) -> None:
        raise RuntimeError("boom")

    breaking = {"_track_parts": (*vllm_engine._TRACK_PARTS[:2], broken, broken)}
    for part in parts:
        monkeypatch.setattr(vllm_stand_in.tracer, part, breaking.get(part, broken))
    vllm_stand_in.instrument()
    scheduler = Scheduler(max_tokens=3)
    scheduler.add(traced("a", 2))
    with caplog.at_level(logging.WARNING, logger="tokentrace"):
        run_until_idle(scheduler)
    assert not scheduler.requests  # served in full
    assert vllm_stand_in.guard.failures == {hook: 1}
    assert hook in vllm_stand_in.guard.disabled
    # Logged with the exception that disabled it (from C too: handed over as being handled).
    (logged,) = [record for record in caplog.records if hook in record.getMessage()]
    assert logged.exc_info is not None and str(logged.exc_info[1]) == "boom"
    # The schedule hook stops too: nothing accumulates that the disabled hook would release.
    tracer = vllm_stand_in.tracer
    scheduler.add(traced("b", 2))
    run_until_idle(scheduler)
    assert len(tracer._open) <= 1 and tracer.stats()["engine.tracked_requests"] <= 1


def test_the_frontend_hands_its_ids_to_the_engine_in_trace_headers(vllm_stand_in: Setup) -> None:
    vllm_stand_in.instrument()
    traceparent = f"00-{TRACE.hex()}-{REQUEST_SPAN.hex()}-01"
    # As with vLLM's own tracing on: the caller's headers reach the output processor.
    request = EngineRequest(
        "r-internal", "r", time.time(), trace_headers={"traceparent": traceparent}
    )
    AsyncLLM().output_processor.add_request(request)
    timer = vllm_stand_in.recorder.get("r-internal")
    assert timer is not None
    headers = request.trace_headers
    assert headers is not None
    assert headers["traceparent"] == traceparent  # vLLM's own tracing still sees the caller's
    parent = parse_engine_parent(headers[ENGINE_PARENT_HEADER])
    assert parent == (timer.trace_id, timer.span_id, timer.prefill_span_id)
    assert timer.trace_id == TRACE and len(set(parent)) == 3


def test_the_sequences_of_a_parallel_sampling_request_share_one_trace(
    vllm_stand_in: Setup,
) -> None:
    vllm_stand_in.instrument()
    processor = AsyncLLM().output_processor
    first_parent, second_parent = object(), object()
    for index, parent in enumerate([first_parent, first_parent, first_parent, second_parent, None]):
        processor.add_request(EngineRequest(f"seq{index}", "api", time.time()), None, parent)
    timers = [vllm_stand_in.recorder.get(f"seq{index}") for index in range(5)]
    trace_ids = [timer.trace_id for timer in timers if timer is not None]
    assert len(trace_ids) == 5
    assert trace_ids[0] == trace_ids[1] == trace_ids[2]
    assert len({trace_ids[0], trace_ids[3], trace_ids[4]}) == 3
    assert len({timer.span_id for timer in timers if timer is not None}) == 5


@pytest.mark.parametrize(
    ("gaps_ms", "expected"),
    [
        ([10, 10, 10, 50, 10], [4]),  # 50 > 3 x median 10
        ([10, 10, 30, 10], []),  # exactly 3x is not above it
        ([10, 100], []),  # the median of two gaps is their mean: 100 < 3 x 55
        ([10, 10, 100, 200], [4]),  # median 55: only 200 is above 165
        ([10], []),  # one gap: no median to compare with
    ],
)
def test_outlier_gap_ends(gaps_ms: list[int], expected: list[int]) -> None:
    ends = [(0, 0)]
    for index, gap in enumerate(gaps_ms, start=1):
        ends.append((index, ends[-1][1] + gap))
    assert outlier_gap_ends(ends, 3.0) == expected


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        f"{'0' * 32}-{'1' * 16}-{'2' * 16}",  # zero trace id
        f"{'a' * 32}-{'0' * 16}-{'2' * 16}",  # zero request span id
        f"{'a' * 32}-{'1' * 16}-{'0' * 16}",  # zero prefill span id
        f"{'a' * 32}-{'1' * 16}",
        f"{'a' * 32}-{'1' * 16}-{'2' * 15}",
        f"{'g' * 32}-{'1' * 16}-{'2' * 16}",
        42,
    ],
)
def test_parse_engine_parent_refuses_malformed_values(value: object) -> None:
    assert parse_engine_parent(value) is None


def test_engine_parent_header_round_trips() -> None:
    value = engine_parent_header(TRACE, REQUEST_SPAN, PREFILL_SPAN)
    assert parse_engine_parent(value) == (TRACE, REQUEST_SPAN, PREFILL_SPAN)


def test_scheduled_event_is_read_from_the_request() -> None:
    jobs: list[Any] = []
    tracer = direct_tracer(jobs, sample_rate=0.0)
    scheduler = Scheduler(token_budget=2, max_tokens=1)
    request = traced("r", 5)
    request.events.append(Event(SCHEDULED, 990.0))  # an earlier schedule (preempted since)
    scheduler.add(request)
    drive(tracer, scheduler)
    (chunk_job,) = planned_jobs(jobs)
    # The latest SCHEDULED event (the stand-in's, just after the step began) starts the first
    # chunk, although the engine took the request's events with its first output.
    assert request.events == []
    assert chunk_job.spans[0].start_ns == CLOCK.to_unix_ns(
        int((1000.0 + SCHEDULED_EVENT_DELAY_S) * NS)
    )


# --- the entry points for engines whose steps are one call (SGLang's scheduler) -----------------
PARENT = (TRACE, REQUEST_SPAN, PREFILL_SPAN)


def record(
    tracer: EngineStepTracer,
    start_ns: int,
    end_ns: int,
    prefill: list[tuple[str, int]] | None = None,
    decode: list[str] | None = None,
    finished: list[str] | None = None,
) -> int:
    return tracer.record_step(
        start_ns,
        end_ns,
        prefill or [],
        decode or [],
        finished or [],
        kv_cache_usage=0.5,
        waiting=2,
        running=3,
    )


def test_record_step_stores_one_step_per_call_with_its_prefill_and_decode_split() -> None:
    jobs: list[Any] = []
    tracer = direct_tracer(jobs, sample_rate=0.0)
    tracer.track("a", PARENT)
    assert record(tracer, 100, 200, prefill=[("a", 7), ("untraced", 3)]) == 0
    assert record(tracer, 200, 150, prefill=[("b", 2)], decode=["a", "untraced"]) == 1
    first, second = tracer._step_at(0), tracer._step_at(1)
    assert first == StepRecord(
        0, 100, 200, 2, 0, 10, 0, 0.5, 2, 3, ("a", "untraced"), frozenset({"a", "untraced"})
    )
    assert second is not None
    assert (second.start_ns, second.end_ns) == (200, 200)  # never ends before it starts
    assert (second.prefill_requests, second.decode_requests, second.decode_tokens) == (1, 2, 2)
    assert second.request_ids == ("b", "a", "untraced")
    tracked = tracer._requests["a"]
    assert tracked is not None
    assert tracked.prefill_steps == [(0, 7)] and tracked.decode_steps == [1]
    assert tracked.first_scheduled_ns == 100  # the start of its first prefill step
    assert "untraced" not in tracer._requests and "b" not in tracer._requests
    assert tracer.steps == 2 and jobs == []


def test_record_step_hands_finished_tracked_requests_to_the_emitter() -> None:
    jobs: list[Any] = []
    tracer = direct_tracer(jobs, sample_rate=0.0)
    tracer.track("a", PARENT)
    record(tracer, 0, 10, prefill=[("a", 4)], finished=["a", "untraced"])
    assert len(jobs) == 1 and tracer.stats()["engine.tracked_requests"] == 0
    assert planned_jobs(jobs) == []  # one prefill step, no gaps, no eviction: no spans


def test_track_starts_over_for_a_request_id_seen_again() -> None:
    tracer = direct_tracer([], sample_rate=0.0)
    tracer.track("a", PARENT)
    record(tracer, 0, 10, prefill=[("a", 4)])
    other = (bytes([9]) * 16, bytes([8]) * 8, bytes([7]) * 8)
    tracer.track("a", other)
    tracked = tracer._requests["a"]
    assert tracked is not None and tracked.trace_id == other[0] and tracked.prefill_steps == []


def test_preempt_opens_an_interval_that_the_next_prefill_step_closes() -> None:
    jobs: list[Any] = []
    tracer = direct_tracer(jobs, sample_rate=0.0)
    tracer.track("a", PARENT)
    record(tracer, 0, 10, prefill=[("a", 4)])
    tracer.preempt("a", 15)
    tracer.preempt("a", 18)  # already evicted: the first time stands
    tracer.preempt("untracked", 15)  # ignored
    record(tracer, 20, 30, decode=["b"])  # a step without it: still evicted
    tracked = tracer._requests["a"]
    assert tracked is not None and tracked.preempted_since_ns == 15
    record(tracer, 40, 50, prefill=[("a", 5)])  # the recompute
    assert tracked.preempted == [(15, 40)] and tracked.preempted_since_ns is None
    assert tracked.first_scheduled_ns == 0
    tracer.preempt("a", 60)
    record(tracer, 70, 80, prefill=[("a", 6)])
    # The recomputes give the request its next tokens: decode steps, not chunks of its prefill.
    assert tracked.prefill_steps == [(0, 4)] and tracked.decode_steps == [2, 3]
    record(tracer, 80, 90, decode=["a"], finished=["a"])
    (preempted,) = planned_jobs(jobs)  # one prefill step: no chunk spans
    assert (preempted.trace_id, preempted.parent_span_id) == (TRACE, REQUEST_SPAN)
    assert [s.name for s in preempted.spans] == [semconv.SPAN_PREEMPTED] * 2
    assert [s.local_id for s in preempted.spans] == [0, 1]
    assert {s.parent_local_id for s in preempted.spans} == {-1}
    assert [(s.start_ns, s.end_ns) for s in preempted.spans] == [
        (CLOCK.to_unix_ns(15), CLOCK.to_unix_ns(40)),
        (CLOCK.to_unix_ns(60), CLOCK.to_unix_ns(70)),
    ]


def test_a_request_finished_while_evicted_is_preempted_until_planned() -> None:
    jobs: list[Any] = []
    tracer = direct_tracer(jobs, sample_rate=0.0)
    tracer.track("a", PARENT)
    record(tracer, 0, 10, prefill=[("a", 4)])
    tracer.preempt("a", 15)
    record(tracer, 20, 30, finished=["a"])  # aborted while waiting to be recomputed
    (job,) = planned_jobs(jobs)
    (span,) = job.spans
    assert span.name == semconv.SPAN_PREEMPTED
    assert (span.start_ns, span.end_ns) == (
        CLOCK.to_unix_ns(15),
        CLOCK.to_unix_ns(engine_monotonic_ns()),
    )


def test_record_step_finds_outlier_gaps_like_the_vllm_path() -> None:
    jobs: list[Any] = []
    tracer = direct_tracer(jobs, sample_rate=0.0)
    tracer.track("a", PARENT)
    ms = 1_000_000
    record(tracer, 0, 10 * ms, prefill=[("a", 4)])
    end = 10 * ms
    for duration in (10, 10, 100, 10, 10):
        start, end = end, end + duration * ms
        record(tracer, start, end, decode=["a"])
    record(tracer, end, end + 10 * ms, decode=["a"], finished=["a"])
    (job,) = planned_jobs(jobs)
    assert job.parent_span_id == REQUEST_SPAN
    (step,) = job.spans
    assert step.name == semconv.SPAN_ENGINE_STEP
    assert step.end_ns - step.start_ns == 100 * ms
    assert step.attributes[semconv.ENGINE_STEP_REQUEST_IDS] == ("a",)
    assert tracer.stats()["engine.outlier_steps"] == 1


def test_sampled_steps_from_record_step_are_roots_of_their_own_traces() -> None:
    jobs: list[Any] = []
    tracer = direct_tracer(jobs, sample_rate=1.0)
    record(tracer, 0, 10, prefill=[("x", 3)])
    record(tracer, 10, 20, decode=["x"], finished=["x"])
    spans = encoded_spans(planned_jobs(jobs))
    assert len(spans) == tracer.sampled_steps == 2
    assert all(span.parent_span_id == b"" for span in spans)


def test_sweep_unless_held_forgets_requests_the_engine_dropped_every_so_many_steps() -> None:
    tracer = direct_tracer([], sample_rate=0.0)
    tracer.track("held", PARENT)
    tracer.track("dropped", PARENT)
    asked: list[int] = []

    def held() -> set[str]:
        asked.append(tracer.steps)
        return {"held"}

    for _ in range(_SWEEP_EVERY_STEPS - 1):
        tracer.sweep_unless_held(record(tracer, 0, 1), held)
    assert asked == [] and set(tracer._requests) == {"held", "dropped"}
    tracer.sweep_unless_held(record(tracer, 0, 1), held)
    assert asked == [_SWEEP_EVERY_STEPS]
    assert set(tracer._requests) == {"held"} and tracer.swept_requests == 1
    tracer.sweep_unless_held(record(tracer, 0, 1), held)  # the next step: not asked again
    assert asked == [_SWEEP_EVERY_STEPS]


def test_the_token_steps_of_a_retracted_request_stay_in_order_for_the_outlier_rule() -> None:
    """Prefill (first token), one decode, a retraction (a long wait), the recompute (a prefill
    step that gives a token), then decodes: only the gap that spans the wait is an outlier, and
    only the recompute step lies inside it."""
    jobs: list[Any] = []
    tracer = direct_tracer(jobs, sample_rate=0.0)
    tracer.track("a", PARENT)
    ms = 1_000_000
    record(tracer, 0, 10 * ms, prefill=[("a", 4)])  # step 0
    record(tracer, 10 * ms, 20 * ms, decode=["a"])  # step 1
    tracer.preempt("a", 20 * ms)
    record(tracer, 120 * ms, 130 * ms, prefill=[("a", 5)])  # step 2: the recompute
    record(tracer, 130 * ms, 140 * ms, decode=["a"])  # step 3
    record(tracer, 140 * ms, 150 * ms, decode=["a"])  # step 4
    record(tracer, 150 * ms, 160 * ms, decode=["a"], finished=["a"])  # step 5
    steps = [
        job
        for job in planned_jobs(jobs)
        if job.spans and job.spans[0].name == semconv.SPAN_ENGINE_STEP
    ]
    (job,) = steps
    assert [(s.start_ns, s.end_ns) for s in job.spans] == [
        (CLOCK.to_unix_ns(120 * ms), CLOCK.to_unix_ns(130 * ms))
    ]


def test_the_prefill_split_reads_vllms_columns_or_asks_request_by_request() -> None:
    class AskOnly:  # a CachedRequestData without the columns: is_context_phase alone
        def __init__(self, outputs: dict[str, int]) -> None:
            self._outputs = outputs

        def is_context_phase(self, req_id: str) -> bool:
            return self._outputs.get(req_id) == 0

    scheduled = {"new": 4, "prompt-left": 2, "decoding": 1}
    outputs = {"prompt-left": 0, "decoding": 3}
    columns = CachedRequestData(list(outputs), list(outputs.values()))
    for cached in (columns, AskOnly(outputs)):
        output = SchedulerOutput(scheduled, [NewRequestData("new")], cached)  # type: ignore[arg-type]
        assert _prefill_ids(output) == {"new", "prompt-left"}
        # Without the new request: the one still in its prompt, then none (decode only).
        output = SchedulerOutput(scheduled, [], cached)  # type: ignore[arg-type]
        assert _prefill_ids(output) == {"prompt-left"}
    decoding = CachedRequestData(["decoding", "also"], [3, 1])
    output = SchedulerOutput({"decoding": 1, "also": 1}, [], decoding)  # type: ignore[arg-type]
    assert _prefill_ids(output) == set()
