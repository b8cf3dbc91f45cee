"""Stand-ins with the shape of vLLM 0.32's frontend classes (``AsyncLLM``, ``LLMEngine``,
``OutputProcessor``), of its EngineCore ``Scheduler`` and of the start-up methods that the cold
start times (``EngineCore``, ``Executor``, ``Worker``, ``CPUWorker``, ``CPUModelRunner``),
installed in ``sys.modules`` under vLLM's module names for one test at a time (the
``vllm_stand_in`` fixture in ``conftest.py``), so the real patch table, the hooks' timing logic
and the guard are all exercised without vLLM.
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from starlette.applications import Starlette

from tokentrace.agent.frameworks.asgi import HttpServerTracer
from tokentrace.agent.frameworks.vllm import (
    PATCHES,
    VllmInstrumentor,
)
from tokentrace.agent.frameworks.vllm_cold_start import ColdStartTracer
from tokentrace.agent.frameworks.vllm_engine import EngineStepTracer
from tokentrace.agent.hooks import HookGuard
from tokentrace.agent.recorder import MonotonicToUnix, Recorder, RequestTimer

QUEUED, SCHEDULED, PREEMPTED = 1, 2, 3
CLOCK = MonotonicToUnix(wall_ns=lambda: 10**18, monotonic_ns=lambda: 0)
"""Unix ns = monotonic ns + 10**18: a fixed offset keeps span times checkable."""
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
    prompt_token_ids: list[int] | None = None


class OutputProcessor:
    def __init__(self) -> None:
        self.request_states: dict[str, State] = {}
        self.external_req_ids: dict[str, list[str]] = {}
        self.parent_requests: dict[str, Any] = {}

    def add_request(
        self, request: EngineRequest, prompt: str | None = None, parent_req: Any = None
    ) -> None:
        params = request.sampling_params
        self.request_states[request.request_id] = State(
            request.request_id,
            request.external_req_id,
            request.prompt_len,
            params.max_tokens,
            params.temperature,
            params.top_p,
            prompt_token_ids=list(range(request.prompt_len)),
        )
        self.external_req_ids.setdefault(request.external_req_id, []).append(request.request_id)

    def process_outputs(
        self,
        engine_core_outputs: list[Output],
        engine_core_timestamp: float | None = None,
        iteration_stats: Any = None,
        *,
        weight_version: int | None = None,
    ) -> str:
        for output in engine_core_outputs:
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


ENGINE_START_UP: list[Callable[[], None]] = []
"""Run inside ``AsyncLLM``'s constructor, like vLLM's engine start-up (EngineCore, workers)."""


class AsyncLLM:
    def __init__(self) -> None:
        self.model_config = ModelConfig()
        self.output_processor = OutputProcessor()
        for start_up in ENGINE_START_UP:
            start_up()

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


# --- stand-ins for vLLM's EngineCore scheduler ----------------------------------------------------
@dataclass
class CoreRequest:
    """vLLM's ``Request`` as the scheduler holds it (only what the engine tracer reads)."""

    request_id: str
    prompt_tokens: int
    trace_headers: dict[str, str] | None = None
    events: list[Event] = field(default_factory=list)
    output_tokens: int = 0
    computed_tokens: int = 0


@dataclass
class NewRequestData:
    req_id: str


@dataclass
class CachedRequestData:
    """vLLM's: the ids of the scheduled requests it has seen before and their output counts."""

    req_ids: list[str]
    num_output_tokens: list[int]

    def is_context_phase(self, req_id: str) -> bool:
        return dict(zip(self.req_ids, self.num_output_tokens, strict=True)).get(req_id) == 0


@dataclass
class SchedulerOutput:
    num_scheduled_tokens: dict[str, int]
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData


@dataclass
class CoreOutput:
    request_id: str
    finish_reason: int | None = None
    events: list[Event] | None = None


@dataclass
class CoreOutputs:
    outputs: list[CoreOutput]
    timestamp: float


class KvCacheManager:
    usage = 0.25


SCHEDULED_EVENT_DELAY_S = 0.002
"""How long after the step's start (the busy loop's clock) the stand-in stamps SCHEDULED."""
_engine_clock_s = [1000.0]
"""The stand-in EngineCore's ``time.monotonic()``: schedulers advance it, tracers read it."""


def engine_monotonic_ns() -> int:
    return int(_engine_clock_s[0] * 1_000_000_000)


class Scheduler:
    """Chunked prefill with a token budget per step; ``max_tokens`` output tokens each.

    ``clock`` (seconds) advances by ``step_s`` per step, or by ``slow_steps[index]`` for the
    steps named there: the engine tracer sees EngineCore-like timestamps.
    """

    def __init__(self, *, token_budget: int = 8, step_s: float = 0.01, max_tokens: int = 6) -> None:
        self.requests: dict[str, CoreRequest] = {}
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.kv_cache_manager = KvCacheManager()
        self.token_budget = token_budget
        self.step_s = step_s
        self.slow_steps: dict[int, float] = {}
        self.max_tokens = max_tokens
        _engine_clock_s[0] = 1000.0
        self.step_index = 0

    def add(self, request: CoreRequest) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request.request_id)

    def get_request_counts(self) -> tuple[int, int]:
        return len(self.running), len(self.waiting)

    @property
    def clock(self) -> float:
        return _engine_clock_s[0]

    def schedule(self) -> SchedulerOutput:
        budget = self.token_budget
        scheduled: dict[str, int] = {}
        new: list[NewRequestData] = []
        for request_id in list(self.running):  # decodes first, one token each
            scheduled[request_id] = 1
            budget -= 1
        for request_id in list(self.waiting):
            if budget <= 0:
                break
            request = self.requests[request_id]
            tokens = min(budget, request.prompt_tokens - request.computed_tokens)
            if not request.computed_tokens:
                new.append(NewRequestData(request_id))
                # vLLM stamps it inside schedule(), after the busy loop read the step's start.
                request.events.append(Event(SCHEDULED, self.clock + SCHEDULED_EVENT_DELAY_S))
            scheduled[request_id] = tokens
            budget -= tokens
        cached = {
            rid: self.requests[rid].output_tokens
            for rid in scheduled
            if rid not in {n.req_id for n in new}
        }
        return SchedulerOutput(
            scheduled, new, CachedRequestData(list(cached), list(cached.values()))
        )

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: Any
    ) -> dict[int, Any]:
        _engine_clock_s[0] += self.slow_steps.get(self.step_index, self.step_s)
        self.step_index += 1
        outputs = []
        for request_id, tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests[request_id]
            if request.computed_tokens < request.prompt_tokens:
                request.computed_tokens += tokens
                if request.computed_tokens < request.prompt_tokens:
                    continue  # a chunk: no token yet
                self.waiting.remove(request_id)
                self.running.append(request_id)
            request.output_tokens += 1
            finished = request.output_tokens >= self.max_tokens
            # As vLLM's: an output takes the request's events (its SCHEDULED event with them).
            events, request.events = request.events or None, []
            outputs.append(CoreOutput(request_id, LENGTH if finished else None, events))
            if finished:
                self.running.remove(request_id)
                del self.requests[request_id]
        return {0: CoreOutputs(outputs, self.clock)}

    def step(self) -> None:
        self.update_from_output(self.schedule(), None)


# --- stand-ins for vLLM's start-up (the cold start) ----------------------------------------------
_startup_clock_ns = [0]
"""The stand-in processes' ``time.monotonic_ns()`` during start-up: each method advances it."""
PROCESS_START_NS = 1_000_000
"""The stand-in process's start (monotonic ns), as ``/proc/self/stat`` would give it."""
WEIGHT_LOAD_NS, PROFILE_NS, ALLOCATE_NS, COMPILE_NS, WARMUP_NS, SCHEDULER_NS = (
    700,
    500,
    300,
    900,
    200,
    100,
)


def startup_monotonic_ns() -> int:
    return _startup_clock_ns[0]


def advance_startup_clock(ns: int) -> None:
    _startup_clock_ns[0] += ns


class _Parameter:
    def __init__(self, elements: int, element_size: int) -> None:
        self._elements = elements
        self._element_size = element_size

    def numel(self) -> int:
        return self._elements

    def element_size(self) -> int:
        return self._element_size


class _Model:
    """Two bf16 parameters: the weight bytes the worker reports."""

    def parameters(self) -> list[_Parameter]:
        return [_Parameter(1000, 2), _Parameter(24, 2)]


MODEL_WEIGHT_BYTES = 2048


class CPUModelRunner:
    def warming_up_model(self) -> None:
        advance_startup_clock(COMPILE_NS)

    def get_model(self) -> _Model:
        return _Model()


class Worker:
    """The GPU worker (its ``load_model`` serves CPU workers too)."""

    def __init__(self, *, load_error: Exception | None = None) -> None:
        self.model_runner = CPUModelRunner()
        self.load_error = load_error

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        advance_startup_clock(WEIGHT_LOAD_NS)
        if self.load_error is not None:
            raise self.load_error

    def compile_or_warm_up_model(self) -> str:
        advance_startup_clock(WARMUP_NS)
        return "compilation-times"


class CPUWorker(Worker):
    """Like vLLM's: compiles during memory profiling; its own warm-up calls the runner's."""

    profiling_compiles = False

    def determine_available_memory(self) -> int:
        if self.profiling_compiles:
            self.model_runner.warming_up_model()
        advance_startup_clock(PROFILE_NS)
        return 1 << 30

    def compile_or_warm_up_model(self) -> str:
        self.model_runner.warming_up_model()
        advance_startup_clock(WARMUP_NS)
        return "cpu-compilation-times"


class Executor:
    """vLLM's in-process executor: calls its worker directly."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def determine_available_memory(self) -> list[int]:
        if isinstance(self.worker, CPUWorker):
            return [self.worker.determine_available_memory()]
        advance_startup_clock(PROFILE_NS)
        return [1 << 30]

    def initialize_from_config(self, kv_cache_configs: list[Any]) -> None:
        advance_startup_clock(ALLOCATE_NS)

    def compile_or_warm_up_model(self) -> None:
        self.worker.compile_or_warm_up_model()


class EngineCore:
    def __init__(self, worker: Worker) -> None:
        self.model_executor = Executor(worker)

    def _initialize_kv_caches(self, vllm_config: Any) -> str:
        self.model_executor.determine_available_memory()
        self.model_executor.initialize_from_config([])
        self.model_executor.compile_or_warm_up_model()
        advance_startup_clock(SCHEDULER_NS)  # after the warm-up: not the KV cache's time
        return "kv-cache-config"


def stand_in_modules() -> dict[str, types.ModuleType]:
    modules = {}
    for name, classes in (
        ("vllm.v1.engine.async_llm", {"AsyncLLM": AsyncLLM}),
        ("vllm.v1.engine.llm_engine", {"LLMEngine": LLMEngine}),
        ("vllm.v1.engine.output_processor", {"OutputProcessor": OutputProcessor}),
        ("vllm.v1.core.sched.scheduler", {"Scheduler": Scheduler}),
        ("vllm.v1.engine.core", {"EngineCore": EngineCore}),
        ("vllm.v1.executor.abstract", {"Executor": Executor}),
        ("vllm.v1.worker.gpu_worker", {"Worker": Worker}),
        ("vllm.v1.worker.cpu_worker", {"CPUWorker": CPUWorker}),
        ("vllm.v1.worker.cpu_model_runner", {"CPUModelRunner": CPUModelRunner}),
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
        "Scheduler": Scheduler,
        "EngineCore": EngineCore,
        "Executor": Executor,
        "Worker": Worker,
        "CPUWorker": CPUWorker,
        "CPUModelRunner": CPUModelRunner,
        # The real ones: the HTTP span wraps real ASGI apps.
        "FastAPI": FastAPI,
        "Starlette": Starlette,
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
    engine_jobs: list[Any]
    tracer: EngineStepTracer
    cold_start_jobs: list[Any] = field(default_factory=list)
    cold_start_environ: dict[str, str] = field(default_factory=dict)
    """The stand-in frontend's ``os.environ`` (the real one must not leak into other tests)."""
    cold_start: ColdStartTracer = field(init=False)
    http_jobs: list[Any] = field(default_factory=list)
    """What the HTTP server tracer submitted (``DeferredSpans``: the emitter would call them)."""
    http_clock: MonotonicToUnix = field(default_factory=MonotonicToUnix)
    """The HTTP tracer's: the real clocks, which the stand-in ``AsyncLLM``'s arrival also reads."""
    http_tracer: HttpServerTracer = field(init=False)

    def __post_init__(self) -> None:
        _startup_clock_ns[0] = PROCESS_START_NS
        self.cold_start = ColdStartTracer(
            self.cold_start_jobs.append,
            to_unix=CLOCK,
            frontend=True,
            environ=self.cold_start_environ,
            monotonic_ns=startup_monotonic_ns,
            read_process_start=lambda: PROCESS_START_NS,
        )
        self.http_tracer = HttpServerTracer(
            self.http_jobs.append, guard=self.guard, to_unix=self.http_clock
        )

    def instrument(self) -> None:
        self.instrumentor.instrument(
            skip_dep_check=True,
            recorder=self.recorder,
            guard=self.guard,
            step_tracer=self.tracer,
            cold_start_tracer=self.cold_start,
            http_tracer=self.http_tracer,
        )
