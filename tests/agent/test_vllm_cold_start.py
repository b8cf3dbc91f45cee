"""vLLM's cold start without vLLM: the real patch table on stand-ins of vLLM's start-up methods
(``vllm_stand_ins.py``), with a fixed start-up clock, so every phase's bounds are checkable."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tests.agent import vllm_stand_ins as stand_ins
from tests.agent.test_vllm_engine import encoded_spans, planned_jobs
from tests.agent.vllm_stand_ins import (
    ALLOCATE_NS,
    CLOCK,
    COMPILE_NS,
    PROCESS_START_NS,
    PROFILE_NS,
    WARMUP_NS,
    WEIGHT_LOAD_NS,
    AsyncLLM,
    CPUWorker,
    EngineCore,
    EngineRequest,
    OutputProcessor,
    Setup,
    Worker,
    advance_startup_clock,
    startup_monotonic_ns,
)
from tokentrace.agent import semconv
from tokentrace.agent.frameworks import vllm as instrumentation
from tokentrace.agent.frameworks.vllm_cold_start import (
    COLD_START_PARENT_ENV,
    HOOK_COLD_START_ENGINE,
    HOOK_COLD_START_WEIGHT_LOAD,
    ColdStartTracer,
    cold_start_parent,
    parse_cold_start_parent,
    process_start_monotonic_ns,
)
from tokentrace.agent.hooks import HookGuard
from tokentrace.agent.recorder import MonotonicToUnix, RequestTimer, to_finished_request

IMPORT_NS = 5_000
UNIX_OFFSET = 10**18  # CLOCK: Unix ns = monotonic ns + 10**18
PHASES = (
    semconv.SPAN_COLD_START_IMPORT,
    semconv.SPAN_COLD_START_WEIGHT_LOAD,
    semconv.SPAN_COLD_START_KV_CACHE,
    semconv.SPAN_COLD_START_WARMUP,
)


def instrument(setup: Setup, tracer: ColdStartTracer | None = None) -> None:
    setup.instrumentor.instrument(
        skip_dep_check=True,
        recorder=setup.recorder,
        guard=setup.guard,
        step_tracer=setup.tracer,
        cold_start_tracer=tracer or setup.cold_start,
        clock=CLOCK,
    )


def start_server(monkeypatch: pytest.MonkeyPatch, worker: Worker | None = None) -> dict[str, int]:
    """Builds the frontend's engine, which starts EngineCore and its worker in-process; returns
    where each step began and ended on the start-up clock."""
    marks: dict[str, int] = {}
    worker = worker or CPUWorker()

    def engine_start_up() -> None:
        marks["engine_init"] = startup_monotonic_ns()
        worker.load_model()
        marks["loaded"] = startup_monotonic_ns()
        EngineCore(worker)._initialize_kv_caches(None)

    advance_startup_clock(IMPORT_NS)
    monkeypatch.setattr(stand_ins, "ENGINE_START_UP", [engine_start_up])
    AsyncLLM()
    marks["ready"] = startup_monotonic_ns()
    return marks


def spans_of(setup: Setup) -> dict[str, list[Span]]:
    spans: dict[str, list[Span]] = {}
    for span in encoded_spans(planned_jobs(setup.cold_start_jobs)):
        spans.setdefault(span.name, []).append(span)
    return spans


def bounds(span: Span) -> tuple[int, int]:
    return span.start_time_unix_nano - UNIX_OFFSET, span.end_time_unix_nano - UNIX_OFFSET


# --- tests ----------------------------------------------------------------------------------------
def test_a_cold_start_is_one_trace_of_phases_under_the_root(
    monkeypatch: pytest.MonkeyPatch, vllm_stand_in: Setup
) -> None:
    instrument(vllm_stand_in)
    marks = start_server(monkeypatch)
    spans = spans_of(vllm_stand_in)
    assert sorted(spans) == sorted([semconv.SPAN_COLD_START, *PHASES])
    assert all(len(group) == 1 for group in spans.values()), spans  # nested warm-up: one span
    (root,) = spans[semconv.SPAN_COLD_START]
    trace_id, root_id = parse_cold_start_parent(
        vllm_stand_in.cold_start_environ[COLD_START_PARENT_ENV]
    ) or (b"", b"")
    assert root.trace_id == trace_id and root.span_id == root_id and not root.parent_span_id
    assert bounds(root) == (PROCESS_START_NS, marks["ready"])
    for name in PHASES:
        (phase,) = spans[name]
        assert phase.trace_id == trace_id and phase.parent_span_id == root_id, name
    engine_init, loaded = marks["engine_init"], marks["loaded"]
    assert bounds(spans[semconv.SPAN_COLD_START_IMPORT][0]) == (PROCESS_START_NS, engine_init)
    assert engine_init == PROCESS_START_NS + IMPORT_NS
    assert bounds(spans[semconv.SPAN_COLD_START_WEIGHT_LOAD][0]) == (engine_init, loaded)
    # Profiling and allocation, until EngineCore asks the workers to warm up.
    kv_cache_end = loaded + PROFILE_NS + ALLOCATE_NS
    assert bounds(spans[semconv.SPAN_COLD_START_KV_CACHE][0]) == (loaded, kv_cache_end)
    # CPUWorker's warm-up calls the runner's compiling warm-up: one span around both.
    warmup = bounds(spans[semconv.SPAN_COLD_START_WARMUP][0])
    assert warmup == (kv_cache_end, kv_cache_end + COMPILE_NS + WARMUP_NS)
    assert warmup[1] < marks["ready"]


def test_compiling_during_memory_profiling_is_a_warmup_inside_the_kv_cache_phase(
    monkeypatch: pytest.MonkeyPatch, vllm_stand_in: Setup
) -> None:
    instrument(vllm_stand_in)
    worker = CPUWorker()
    worker.profiling_compiles = True
    start_server(monkeypatch, worker)
    spans = spans_of(vllm_stand_in)
    (kv_cache,) = spans[semconv.SPAN_COLD_START_KV_CACHE]
    profiling_warmup, warmup = sorted(
        (bounds(span) for span in spans[semconv.SPAN_COLD_START_WARMUP]), key=lambda b: b[0]
    )
    kv_start, kv_end = bounds(kv_cache)
    assert profiling_warmup == (kv_start, kv_start + COMPILE_NS)
    assert kv_end == kv_start + COMPILE_NS + PROFILE_NS + ALLOCATE_NS == warmup[0]


def test_only_the_first_engine_ends_the_cold_start(
    monkeypatch: pytest.MonkeyPatch, vllm_stand_in: Setup
) -> None:
    instrument(vllm_stand_in)
    marks = start_server(monkeypatch)
    AsyncLLM()
    roots = spans_of(vllm_stand_in)[semconv.SPAN_COLD_START]
    assert [bounds(root)[1] for root in roots] == [marks["ready"]]
    assert vllm_stand_in.cold_start.ready_ns == marks["ready"]


def test_processes_that_inherit_the_variable_put_their_phases_under_the_frontends_root() -> None:
    environ: dict[str, str] = {}
    frontend_jobs: list[Any] = []
    frontend = ColdStartTracer(
        frontend_jobs.append,
        to_unix=CLOCK,
        frontend=True,
        environ=environ,
        monotonic_ns=lambda: 50,
        read_process_start=lambda: 10,
    )
    inherited = dict(environ)  # what a spawned process sees
    engine_jobs: list[Any] = []
    now = [2_000]
    engine = ColdStartTracer(
        engine_jobs.append,
        to_unix=CLOCK,
        frontend=False,
        environ=inherited,
        monotonic_ns=lambda: now[0],
        read_process_start=lambda: 1_000,
    )
    assert inherited == environ  # not replaced
    assert frontend.owns_root and not engine.owns_root
    engine.import_done()
    engine.phase_started(semconv.SPAN_COLD_START_KV_CACHE)
    now[0] = 3_000
    engine.phase_ended(semconv.SPAN_COLD_START_KV_CACHE)
    engine.engine_ready()  # an engine process never owns the root
    spans = encoded_spans(planned_jobs(engine_jobs))
    assert [(s.name, bounds(s)) for s in spans] == [
        (semconv.SPAN_COLD_START_IMPORT, (1_000, 2_000)),
        (semconv.SPAN_COLD_START_KV_CACHE, (2_000, 3_000)),
    ]
    assert all(s.trace_id == frontend.trace_id for s in spans)
    assert all(s.parent_span_id == frontend.root_span_id for s in spans)
    # A second frontend (another API server) with the variable: no second root.
    second = ColdStartTracer(
        frontend_jobs.append, to_unix=CLOCK, frontend=True, environ=dict(environ)
    )
    second.engine_ready()
    assert not frontend_jobs and not second.owns_root and second.ready_ns is not None


def test_an_engine_without_a_frontend_gives_its_phases_a_rootless_trace_of_their_own() -> None:
    environ: dict[str, str] = {}
    jobs: list[Any] = []
    engine = ColdStartTracer(
        jobs.append, to_unix=CLOCK, frontend=False, environ=environ, read_process_start=int
    )
    worker = ColdStartTracer(jobs.append, to_unix=CLOCK, frontend=False, environ=dict(environ))
    for tracer in (engine, worker):
        tracer.import_done()
    spans = encoded_spans(planned_jobs(jobs))
    assert len(spans) == 2
    assert {s.trace_id for s in spans} == {engine.trace_id}
    assert all(not s.parent_span_id for s in spans)


def test_a_phase_that_raises_ends_with_its_error_and_vllm_gets_the_exception(
    vllm_stand_in: Setup,
) -> None:
    instrument(vllm_stand_in)
    error = OSError("weights missing")
    with pytest.raises(OSError) as raised:
        Worker(load_error=error).load_model()
    assert raised.value is error
    (span,) = encoded_spans(planned_jobs(vllm_stand_in.cold_start_jobs))
    assert span.name == semconv.SPAN_COLD_START_WEIGHT_LOAD
    assert span.status.code == span.status.STATUS_CODE_ERROR
    assert span.status.message == "OSError"
    assert bounds(span) == (PROCESS_START_NS, PROCESS_START_NS + WEIGHT_LOAD_NS)
    assert not vllm_stand_in.guard.failures


def test_an_engine_that_fails_to_build_ends_the_cold_start_with_its_error(
    monkeypatch: pytest.MonkeyPatch, vllm_stand_in: Setup
) -> None:
    instrument(vllm_stand_in)

    def broken_start_up() -> None:
        advance_startup_clock(100)
        raise RuntimeError("engine core died")

    monkeypatch.setattr(stand_ins, "ENGINE_START_UP", [broken_start_up])
    with pytest.raises(RuntimeError, match="engine core died"):
        AsyncLLM()
    (root,) = spans_of(vllm_stand_in)[semconv.SPAN_COLD_START]
    assert root.status.message == "RuntimeError"
    assert bounds(root) == (PROCESS_START_NS, PROCESS_START_NS + 100)
    assert vllm_stand_in.cold_start.ready_ns is None


def test_a_raising_cold_start_hook_is_disabled_and_vllm_still_runs(vllm_stand_in: Setup) -> None:
    def refuse(_job: object) -> None:
        raise RuntimeError("emitter broken")

    tracer = ColdStartTracer(refuse, to_unix=CLOCK, frontend=True, environ={})
    instrument(vllm_stand_in, tracer)
    worker = Worker()
    worker.load_model()
    worker.load_model()
    assert vllm_stand_in.guard.failures == {HOOK_COLD_START_WEIGHT_LOAD: 1}
    engine = AsyncLLM()  # the root's submit raises too: the engine is built all the same
    assert engine.output_processor is not None
    assert HOOK_COLD_START_ENGINE in vllm_stand_in.guard.disabled


def test_requests_that_arrive_before_ready_carry_the_ready_time(
    monkeypatch: pytest.MonkeyPatch, vllm_stand_in: Setup
) -> None:
    instrument(vllm_stand_in)
    processor = OutputProcessor()  # a request reaches an output processor before ready
    # CLOCK: arrival_time (s) 1e9 is monotonic ns 0, before the start-up clock's ready.
    processor.add_request(EngineRequest("early", "early", arrival_time=1e9))
    marks = start_server(monkeypatch)
    processor.add_request(EngineRequest("late", "late", arrival_time=1e9 + 60.0))
    early, late = vllm_stand_in.recorder.get("early"), vllm_stand_in.recorder.get("late")
    assert early is not None and late is not None
    assert early.ready_ns == marks["ready"] and late.ready_ns is None
    assert to_finished_request(early, CLOCK).ready_ns == marks["ready"] + UNIX_OFFSET
    assert to_finished_request(late, CLOCK).ready_ns is None
    # ...and a link to the cold start's root span (its own trace).
    cold_start = vllm_stand_in.cold_start
    assert early.cold_start_link == (cold_start.trace_id, cold_start.root_span_id)
    assert late.cold_start_link is None
    assert to_finished_request(early, CLOCK).cold_start_link == early.cold_start_link
    monkeypatch.setattr(stand_ins, "ENGINE_START_UP", [])
    asyncio.run(AsyncLLM().add_request("after", "prompt", None, 1e9 + 1e-3))  # given arrival
    after = vllm_stand_in.recorder.get("after-internal")
    assert after is not None and after.ready_ns == marks["ready"]


def test_requests_waiting_for_ready_are_bounded_and_counted() -> None:
    tracer = ColdStartTracer(
        lambda _job: None, to_unix=CLOCK, frontend=True, environ={}, max_waiting_requests=1
    )
    first, second = RequestTimer("a", arrival_ns=0), RequestTimer("b", arrival_ns=0)
    tracer.on_request(first)
    tracer.on_request(second)
    tracer.engine_ready()
    assert first.ready_ns is not None and second.ready_ns is None
    assert tracer.stats()["cold_start.waiting_requests_unstamped"] == 1


@pytest.mark.parametrize(
    ("process_name", "roles"),
    [
        ("MainProcess", {"frontend", "engine", "worker"}),
        ("ApiServer_0", {"frontend"}),
        ("EngineCore_DP0", {"engine", "worker"}),
        ("VllmWorker-0", {"worker"}),
        ("SpawnProcess-3", set()),
    ],
)
def test_each_vllm_process_plays_its_roles(
    monkeypatch: pytest.MonkeyPatch, process_name: str, roles: set[str]
) -> None:
    monkeypatch.setattr(multiprocessing.current_process(), "name", process_name)
    assert instrumentation._process_roles() == roles


def test_process_start_is_read_from_proc_stat_and_mapped_to_the_monotonic_clock(
    tmp_path: Path,
) -> None:
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"
    # A command name with spaces and ')' in it; starttime (field 22) is 5 s after boot.
    fields = ["S", *(["0"] * 18), str(5 * ticks_per_s), "0"]
    stat.write_text("4242 (a) b (c)) " + " ".join(fields) + "\n")
    started = process_start_monotonic_ns(
        stat_path=str(stat), monotonic_ns=lambda: 100 * 10**9, boottime_ns=lambda: 8 * 10**9
    )
    assert started == 97 * 10**9  # booted 8 s ago, started 5 s after boot: 3 s ago
    assert process_start_monotonic_ns(stat_path=str(tmp_path / "missing")) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_a_new_process_start_is_found_within_the_clock_tick_resolution() -> None:
    before = time.monotonic_ns()
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import time; from tokentrace.agent.frameworks.vllm_cold_start import "
            "process_start_monotonic_ns as s; print(s(), time.monotonic_ns())",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    after = time.monotonic_ns()
    started, child_now = map(int, result.stdout.split())
    tick_ns = 10**9 // os.sysconf("SC_CLK_TCK")
    assert before - 2 * tick_ns <= started <= child_now <= after


@pytest.mark.parametrize(
    "value",
    [None, 42, "", "xyz", "0" * 32 + "-" + "1" * 16, "1" * 32 + "-" + "g" * 16, "1" * 32, "1-1"],
)
def test_parse_cold_start_parent_refuses_malformed_values(value: object) -> None:
    assert parse_cold_start_parent(value) is None


def test_cold_start_parent_round_trips_with_and_without_a_root() -> None:
    trace, span = bytes(range(1, 17)), bytes(range(21, 29))
    assert parse_cold_start_parent(cold_start_parent(trace, span)) == (trace, span)
    assert parse_cold_start_parent(cold_start_parent(trace, b"")) == (trace, b"")


def test_a_frontend_alone_emits_its_import_and_the_root() -> None:
    """The offline engine with everything in one process and no phase hooks reached."""
    jobs: list[Any] = []
    tracer = ColdStartTracer(jobs.append, to_unix=CLOCK, frontend=True, environ={})
    guard = HookGuard()
    guard.run("start", tracer.engine_init_started)
    guard.run("ready", tracer.engine_ready)
    assert not guard.failures
    names = [s.name for s in encoded_spans(planned_jobs(jobs))]
    assert names == [semconv.SPAN_COLD_START_IMPORT, semconv.SPAN_COLD_START]


def test_the_process_a_user_started_replaces_an_inherited_variable() -> None:
    """A server launched from another traced server's process tree starts its own cold start."""
    stale = cold_start_parent(bytes(range(1, 17)), bytes(range(21, 29)))
    environ = {COLD_START_PARENT_ENV: stale}
    tracer = ColdStartTracer(
        lambda _job: None, to_unix=CLOCK, frontend=True, inherit=False, environ=environ
    )
    assert tracer.owns_root
    assert environ[COLD_START_PARENT_ENV] != stale
    assert parse_cold_start_parent(environ[COLD_START_PARENT_ENV]) == (
        tracer.trace_id,
        tracer.root_span_id,
    )


class _DriftingClock(MonotonicToUnix):
    """A monotonic-to-Unix mapping whose offset moves by 10 ns at every conversion (as
    re-measuring does)."""

    def __init__(self) -> None:
        super().__init__()
        self.conversions = 0

    def to_unix_ns(self, monotonic_ns: int) -> int:
        self.conversions += 1
        return monotonic_ns + UNIX_OFFSET + 10 * self.conversions


def test_the_root_and_the_import_phase_start_at_the_same_nanosecond() -> None:
    jobs: list[Any] = []
    tracer = ColdStartTracer(
        jobs.append,
        to_unix=_DriftingClock(),
        frontend=True,
        environ={},
        read_process_start=lambda: 7,
    )
    tracer.engine_init_started()
    tracer.engine_ready()
    imported, root = encoded_spans(planned_jobs(jobs))
    assert root.name == semconv.SPAN_COLD_START
    assert imported.start_time_unix_nano == root.start_time_unix_nano


def test_weight_load_reports_the_weight_bytes_and_survives_a_model_it_cannot_read(
    vllm_stand_in: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    instrument(vllm_stand_in)
    Worker().load_model()
    (span,) = encoded_spans(planned_jobs(vllm_stand_in.cold_start_jobs))
    weight_bytes = {kv.key: kv.value.int_value for kv in span.attributes}
    assert weight_bytes == {semconv.MODEL_WEIGHT_BYTES: stand_ins.MODEL_WEIGHT_BYTES}
    # A runner whose model cannot be read: the phase's span still comes, without the bytes.
    vllm_stand_in.cold_start_jobs.clear()
    monkeypatch.delattr(stand_ins.CPUModelRunner, "get_model")
    Worker().load_model()
    (span,) = encoded_spans(planned_jobs(vllm_stand_in.cold_start_jobs))
    assert span.name == semconv.SPAN_COLD_START_WEIGHT_LOAD and not span.attributes
    assert vllm_stand_in.guard.failures == {f"{HOOK_COLD_START_WEIGHT_LOAD}.attributes": 1}
