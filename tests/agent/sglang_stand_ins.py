"""Stand-ins with the shape of SGLang 0.5.23's classes that the patch table targets
(``TokenizerManager``, ``Scheduler``, ``ReqTimeStatsBase``, ``Engine``, ``ModelRunner``) and
of what flows between them (tokenised requests with pickled time stats, ``BatchStrOutput``-like
outputs), installed in ``sys.modules`` under SGLang's module names for one test at a time (the
``sglang_stand_in`` fixture of ``test_sglang_instrumentation.py``), so the real patch table, the
hooks' timing logic and the guard all run without SGLang.

The frontend and the scheduler talk through pickled bytes, as SGLang's processes do: a
tokenised request's ``time_stats`` crosses as a ``PickleWrapper`` (its ``__getstate__``, which
calls ``ReqTimeStatsBase.__getstate__``, decides what crosses), and a batch of outputs carries
its scheduler time stats pickled the same way. Clocks are injected: the scheduler's
``time.perf_counter()`` is ``scheduler_clock_s`` (seconds), the same clock in ns as the engine
tracer's and the frontend recorder's ``monotonic_ns``, as on Linux where both read
CLOCK_MONOTONIC.
"""

from __future__ import annotations

import asyncio
import enum
import pickle
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI

from tokentrace.agent.frameworks.asgi import HttpServerTracer
from tokentrace.agent.frameworks.sglang import PATCHES, SglangInstrumentor
from tokentrace.agent.frameworks.vllm_cold_start import ColdStartTracer
from tokentrace.agent.frameworks.vllm_engine import EngineStepTracer
from tokentrace.agent.hooks import HookGuard
from tokentrace.agent.recorder import MonotonicToUnix, Recorder, RequestTimer

NS = 1_000_000_000
CLOCK = MonotonicToUnix(wall_ns=lambda: 10**18, monotonic_ns=lambda: 0)
"""Unix ns = monotonic ns + 10**18: a fixed offset keeps span times checkable."""
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"
SUPPORTED = ("sglang", "0.5.23")

# --- clocks ---------------------------------------------------------------------------------------
_scheduler_clock_s = [1000.0]


def scheduler_clock_s() -> float:
    """The stand-in processes' ``time.perf_counter()``."""
    return _scheduler_clock_s[0]


def monotonic_ns() -> int:
    return round(_scheduler_clock_s[0] * NS)


def advance(seconds: float) -> None:
    _scheduler_clock_s[0] += seconds


def reset_clock(seconds: float = 1000.0) -> None:
    _scheduler_clock_s[0] = seconds


# --- sglang.srt.managers.io_struct ----------------------------------------------------------------
@dataclass
class PickleWrapper:
    """Like SGLang's msgspec ``PickleWrapper``: an object as pickled bytes."""

    data: bytes


def wrap_as_pickle(obj: object) -> object:
    return None if obj is None else PickleWrapper(pickle.dumps(obj))


def unwrap_from_pickle(obj: object) -> object:
    if obj is None or not isinstance(obj, PickleWrapper):
        return obj
    return pickle.loads(obj.data)


@dataclass
class SamplingParams:
    max_new_tokens: int = 4
    temperature: float = 0.0
    top_p: float = 1.0


@dataclass
class GenerateReqInput:
    """What a caller hands ``TokenizerManager.generate_request`` (the state keeps it)."""

    rid: str
    external_trace_header: dict[str, str] | None = None


@dataclass
class TokenizedGenerateReqInput:
    """SGLang's: no ``external_trace_header`` field (the caller's request object has it)."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    time_stats: Any = None

    def wrap_pickle_fields(self) -> None:
        self.time_stats = wrap_as_pickle(self.time_stats)

    def unwrap_pickle_fields(self) -> None:
        self.time_stats = unwrap_from_pickle(self.time_stats)


@dataclass
class BatchStrOutput:
    rids: list[str]
    finished_reasons: list[dict[str, Any] | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    time_stats: Any = None
    """Pickled ``Optional[List[SchedulerReqTimeStats]]`` (a ``PickleWrapper``)."""


# --- sglang.srt.observability.req_time_stats ------------------------------------------------------
@dataclass
class ReqTimeStatsBase:
    enable_metrics: bool = False
    disagg_mode: str | None = None
    diff_realtime_monotonic: float = 0.0

    @classmethod
    def new_from_obj(cls, obj: ReqTimeStatsBase | None, *args: Any, **kwargs: Any) -> Any:
        new_obj = cls(*args, **kwargs)
        if obj is None:
            return new_obj
        for key, value in obj.__dict__.items():
            if hasattr(new_obj, key):
                setattr(new_obj, key, value)
        return new_obj

    def __getstate__(self) -> dict[str, Any]:
        return {
            "disagg_mode": self.disagg_mode,
            "enable_metrics": False,
            "trace_ctx": {"tracing_enable": False},
            "diff_realtime_monotonic": 0.0,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        for key in state:  # SGLang moves "...time" keys to this process's clock: the same here
            if key.endswith("time") and state[key]:
                state[key] = float(state[key])
        self.__dict__.update(state)


@dataclass
class APIServerReqTimeStats(ReqTimeStatsBase):
    created_time: float = 0.0
    api_server_dispatch_time: float = 0.0

    def __getstate__(self) -> dict[str, Any]:
        state: dict[str, Any] = {}  # like SGLang's: its own times stay in the frontend
        state.update(super().__getstate__())
        return state

    def set_api_server_dispatch_time(self) -> None:
        self.api_server_dispatch_time = scheduler_clock_s()


@dataclass
class DPControllerReqTimeStats(ReqTimeStatsBase):
    """The data-parallel controller's copy (``new_from_obj``), pickled again to a scheduler."""

    dpc_dispatch_time: float = 0.0

    def __getstate__(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        state.update(super().__getstate__())
        return state


@dataclass
class SchedulerReqTimeStats(ReqTimeStatsBase):
    wait_queue_entry_time: float = 0.0
    forward_entry_time: float = 0.0
    prefill_finished_time: float = 0.0
    has_timing_data: bool = False

    def __getstate__(self) -> dict[str, Any]:
        if not (self.enable_metrics or self.has_timing_data):
            return {}
        return {
            "has_timing_data": True,
            "wait_queue_entry_time": self.wait_queue_entry_time,
            "forward_entry_time": self.forward_entry_time,
            "prefill_finished_time": self.prefill_finished_time,
        }

    def set_wait_queue_entry_time(self) -> None:
        if self.wait_queue_entry_time == 0.0:
            self.wait_queue_entry_time = scheduler_clock_s()

    def set_forward_entry_time(self) -> None:
        if self.forward_entry_time == 0.0:
            self.forward_entry_time = scheduler_clock_s()


# --- sglang.srt.managers.tokenizer_manager --------------------------------------------------------
@dataclass
class ReqState:
    obj: GenerateReqInput
    time_stats: APIServerReqTimeStats
    out_list: list[int] = field(default_factory=list)
    finished: bool = False
    dispatched: bool = False


class TokenizerManager:
    """The frontend: request states by rid, the hand-off to the scheduler (pickled bytes in
    ``sent``) and the output handler."""

    def __init__(self, served_model_name: str = "served-model") -> None:
        self.served_model_name = served_model_name
        self.rid_to_state: dict[str, ReqState] = {}
        self.sent: list[bytes] = []
        self.aborted: list[str] = []

    # helpers of the stand-in (SGLang's generate_request does this) ---------------------------
    def tokenize(
        self,
        rid: str,
        prompt_tokens: int = 5,
        *,
        max_new_tokens: int = 4,
        external_trace_header: dict[str, str] | None = None,
    ) -> TokenizedGenerateReqInput:
        obj = GenerateReqInput(rid, external_trace_header)
        state = ReqState(obj, APIServerReqTimeStats(created_time=scheduler_clock_s()))
        self.rid_to_state[rid] = state
        return TokenizedGenerateReqInput(
            rid, list(range(prompt_tokens)), SamplingParams(max_new_tokens), state.time_stats
        )

    def send(self, tokenized: TokenizedGenerateReqInput) -> None:
        asyncio.run(self._send_one_request(tokenized))

    def send_batch(self, tokenized: list[TokenizedGenerateReqInput]) -> None:
        asyncio.run(self._send_batch_request(tokenized))

    def receive(self, output: BatchStrOutput) -> Any:
        return asyncio.run(self._handle_batch_output(output))

    # SGLang's methods ----------------------------------------------------------------------------
    async def _send_one_request(self, tokenized_obj: TokenizedGenerateReqInput) -> None:
        tokenized_obj.time_stats.set_api_server_dispatch_time()
        time_stats = tokenized_obj.time_stats
        tokenized_obj.wrap_pickle_fields()
        self._dispatch_to_scheduler(tokenized_obj)
        self._mark_state_dispatched(tokenized_obj.rid)
        tokenized_obj.time_stats = time_stats

    async def _send_batch_request(self, tokenized_objs: list[TokenizedGenerateReqInput]) -> None:
        time_stats = [tokenized_obj.time_stats for tokenized_obj in tokenized_objs]
        for tokenized_obj in tokenized_objs:
            tokenized_obj.time_stats.set_api_server_dispatch_time()
            tokenized_obj.wrap_pickle_fields()
        for tokenized_obj in tokenized_objs:  # one batch message in SGLang: one each here
            self._dispatch_to_scheduler(tokenized_obj)
            self._mark_state_dispatched(tokenized_obj.rid)
        for tokenized_obj, time_stat in zip(tokenized_objs, time_stats, strict=True):
            tokenized_obj.time_stats = time_stat

    def _dispatch_to_scheduler(self, obj: TokenizedGenerateReqInput) -> None:
        self.sent.append(pickle.dumps(obj))

    def _mark_state_dispatched(self, rid: str) -> None:
        state = self.rid_to_state.get(rid)
        if state is not None:
            state.dispatched = True

    async def _handle_batch_output(self, recv_obj: BatchStrOutput) -> list[str]:
        recv_obj.time_stats = unwrap_from_pickle(recv_obj.time_stats)
        assert recv_obj.time_stats is None or isinstance(recv_obj.time_stats, list)
        finished: list[str] = []
        for i, rid in enumerate(recv_obj.rids):
            state = self.rid_to_state.get(rid)
            if state is None:
                continue
            state.out_list.append(recv_obj.completion_tokens[i])
            if recv_obj.finished_reasons[i] is not None:
                state.finished = True
                del self.rid_to_state[rid]
                finished.append(rid)
        return finished  # SGLang's returns None; the stand-in's value shows it ran

    def _release_req_states_on_failure(self, request_states: dict[str, ReqState]) -> None:
        for rid, state in request_states.items():
            if self.rid_to_state.get(rid) is not state:
                continue
            if state.dispatched:
                self.abort_request(rid)
            else:
                del self.rid_to_state[rid]

    def abort_request(self, rid: str) -> None:
        self.aborted.append(rid)


# --- sglang.srt.runtime_context: the process's ranks (SGLang's Scheduler has no rank attribute) ---
@dataclass
class ParallelContext:
    tp_rank: int = 0
    attn_tp_rank: int = 0


PARALLEL = ParallelContext()


def get_parallel() -> ParallelContext:
    return PARALLEL


# --- sglang.srt.managers.scheduler ----------------------------------------------------------------
class ForwardMode(enum.Enum):
    EXTEND = 1
    DECODE = 2
    IDLE = 3

    def is_extend(self) -> bool:
        return self is ForwardMode.EXTEND

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


class Req:
    def __init__(
        self, rid: str, prompt_tokens: int, max_new_tokens: int, time_stats: Any = None
    ) -> None:
        self.rid = rid
        self.prompt_tokens = prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.time_stats = SchedulerReqTimeStats.new_from_obj(time_stats)
        self.output_ids: list[int] = []
        self.computed = 0
        """Tokens of the prompt (and, after a retraction, of its output) in the KV cache."""
        self.finished_reason: dict[str, Any] | None = None
        self.cached_tokens = 0

    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def to_prefill(self) -> int:
        return self.prompt_tokens + len(self.output_ids)


@dataclass
class ScheduleBatch:
    reqs: list[Req]
    forward_mode: ForwardMode
    extend_lens: list[int] | None = None
    forward_iter: int | None = None

    def copy(self) -> ScheduleBatch:
        """Like SGLang's: what ``process_batch_result`` needs, ``forward_iter`` included."""
        return ScheduleBatch(self.reqs[:], self.forward_mode, self.extend_lens, self.forward_iter)


class TokenToKVPoolAllocator:
    def __init__(self, available: int) -> None:
        self.available = available

    def available_size(self) -> int:
        return self.available


class Scheduler:
    """Prefill first (``chunk`` prompt tokens per step at most, one request per prefill step),
    else one decode step for every running request; each step takes ``step_s`` seconds, or
    ``slow_steps[forward_ct]`` for the steps named there. Outputs go to ``outbox`` (what the
    detokenizer would hand the frontend), their time stats pickled."""

    def __init__(self, *, chunk: int = 64, step_s: float = 0.01, overlap: bool = False) -> None:
        self.chunk = chunk
        self.step_s = step_s
        self.overlap = overlap
        self.slow_steps: dict[int, float] = {}
        self.waiting_queue: list[Req] = []
        self.running_batch = ScheduleBatch([], ForwardMode.DECODE)
        self.max_total_num_tokens = 1000
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(750)
        self.forward_ct = 0
        self.outbox: list[BatchStrOutput] = []
        self.requests: dict[str, Req] = {}

    # helpers of the stand-in -----------------------------------------------------------------
    def receive(self, message: bytes) -> None:
        """The scheduler's receive loop: unpickle, unwrap, handle."""
        recv_req = pickle.loads(message)
        recv_req.unwrap_pickle_fields()
        self.handle_generate_request(recv_req)

    def next_batch(self) -> ScheduleBatch | None:
        if self.waiting_queue:
            req = self.waiting_queue[0]
            req.time_stats.set_forward_entry_time()
            tokens = min(self.chunk, req.to_prefill - req.computed)
            return ScheduleBatch([req], ForwardMode.EXTEND, [tokens])
        if self.running_batch.reqs:
            return ScheduleBatch(list(self.running_batch.reqs), ForwardMode.DECODE)
        return None

    def step(self) -> bool:
        """One turn of the event loop; False when there was nothing to run."""
        batch = self.next_batch()
        if batch is None:
            return False
        result = self.run_batch(batch)
        self.process_batch_result(batch.copy() if self.overlap else batch, result)
        return True

    def run_until_idle(self, limit: int = 200) -> None:
        for _ in range(limit):
            if not self.step():
                return
        raise AssertionError("the stand-in scheduler did not finish its requests")

    def retract(self, rid: str) -> None:
        """Like SGLang when the KV cache runs out: evict a running request and queue it again."""
        req = self.requests[rid]
        self.running_batch.reqs.remove(req)
        req.computed = 0
        self._add_request_to_queue(req, is_retracted=True)

    def abort(self, rid: str) -> None:
        req = self.requests[rid]
        req.finished_reason = {"type": "abort", "message": "aborted by the client"}
        if req in self.running_batch.reqs:
            self.running_batch.reqs.remove(req)
        if req in self.waiting_queue:
            self.waiting_queue.remove(req)
        del self.requests[rid]
        self._stream([req])

    # SGLang's methods ----------------------------------------------------------------------------
    def handle_generate_request(self, recv_req: TokenizedGenerateReqInput) -> None:
        req = Req(
            recv_req.rid,
            len(recv_req.input_ids),
            recv_req.sampling_params.max_new_tokens,
            recv_req.time_stats,
        )
        self.requests[req.rid] = req
        self._add_request_to_queue(req)

    def _add_request_to_queue(self, req: Req, is_retracted: bool = False) -> None:
        self.waiting_queue.append(req)
        req.time_stats.set_wait_queue_entry_time()

    def run_batch(self, batch: ScheduleBatch, pp_proxy_tensors: Any = None) -> str:
        self.forward_ct += 1
        batch.forward_iter = self.forward_ct
        advance(self.slow_steps.get(self.forward_ct, self.step_s))
        return f"result-{self.forward_ct}"

    def process_batch_result(self, batch: ScheduleBatch, result: Any) -> None:
        streamed: list[Req] = []
        if batch.forward_mode.is_extend():
            assert batch.extend_lens is not None
            for req, tokens in zip(batch.reqs, batch.extend_lens, strict=True):
                req.computed += tokens
                if req.computed < req.to_prefill:
                    continue  # a chunk: no token yet
                self.waiting_queue.remove(req)
                self.running_batch.reqs.append(req)
                if req.time_stats.prefill_finished_time == 0.0:
                    req.time_stats.prefill_finished_time = scheduler_clock_s()
                self._add_token(req)
                streamed.append(req)
        elif batch.forward_mode.is_decode():
            for req in batch.reqs:
                req.computed += 1
                self._add_token(req)
                streamed.append(req)
        if streamed:
            self._stream(streamed)

    def _add_token(self, req: Req) -> None:
        req.output_ids.append(len(req.output_ids))
        if len(req.output_ids) >= req.max_new_tokens:
            req.finished_reason = {"type": "length", "length": req.max_new_tokens}
            self.running_batch.reqs.remove(req)
            del self.requests[req.rid]

    def _stream(self, reqs: list[Req]) -> None:
        if get_parallel().attn_tp_rank:
            return  # only the first rank (of its attention group) sends outputs
        self.outbox.append(
            BatchStrOutput(
                rids=[req.rid for req in reqs],
                finished_reasons=[req.finished_reason for req in reqs],
                prompt_tokens=[req.prompt_tokens for req in reqs],
                completion_tokens=[len(req.output_ids) for req in reqs],
                cached_tokens=[req.cached_tokens for req in reqs],
                time_stats=wrap_as_pickle([req.time_stats for req in reqs]),
            )
        )


def data_parallel_controller(message: bytes) -> bytes:
    """SGLang's data-parallel controller between the frontend and a scheduler: it unpickles the
    request, copies its time stats into its own class (``new_from_obj``) and pickles it again."""
    recv_req = pickle.loads(message)
    recv_req.unwrap_pickle_fields()
    recv_req.time_stats = DPControllerReqTimeStats.new_from_obj(recv_req.time_stats)
    recv_req.time_stats.dpc_dispatch_time = scheduler_clock_s()
    recv_req.wrap_pickle_fields()
    return pickle.dumps(recv_req)


def deliver(scheduler: Scheduler, manager: TokenizerManager) -> list[Any]:
    """The detokenizer: hands the scheduler's outputs to the frontend, in order."""
    results = [manager.receive(output) for output in scheduler.outbox]
    scheduler.outbox.clear()
    return results


# --- the cold start: sglang.srt.entrypoints.engine, sglang.srt.model_executor.model_runner --------
_startup_clock_ns = [0]
PROCESS_START_NS = 1_000_000
IMPORT_NS, WEIGHT_LOAD_NS, LAUNCH_REST_NS = 5_000, 700, 300
MODEL_WEIGHT_BYTES = 2048


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
    def parameters(self) -> list[_Parameter]:
        return [_Parameter(1000, 2), _Parameter(24, 2)]


class ModelRunner:
    def __init__(self, *, load_error: Exception | None = None) -> None:
        self.model: _Model | None = None
        self.load_error = load_error

    def load_model(self) -> None:
        advance_startup_clock(WEIGHT_LOAD_NS)
        if self.load_error is not None:
            raise self.load_error
        self.model = _Model()


SCHEDULER_START_UP: list[Callable[[], None]] = []
"""Run inside ``Engine._launch_subprocesses``, like SGLang's schedulers loading their models."""


class Engine:
    @classmethod
    def _launch_subprocesses(
        cls,
        server_args: Any,
        init_tokenizer_manager_func: Callable[..., Any],
        run_scheduler_process_func: Callable[..., Any],
        run_detokenizer_process_func: Callable[..., Any],
        port_args: Any = None,
        placement_group: Any = None,
    ) -> tuple[Any, ...]:
        for start_up in SCHEDULER_START_UP:
            start_up()
        advance_startup_clock(LAUNCH_REST_NS)
        return (init_tokenizer_manager_func(server_args), cls.__name__)


# --- the modules and the fixture's parts ----------------------------------------------------------
def stand_in_modules() -> dict[str, types.ModuleType]:
    modules = {}
    for name, members in (
        ("sglang.srt.managers.tokenizer_manager", {"TokenizerManager": TokenizerManager}),
        ("sglang.srt.managers.scheduler", {"Scheduler": Scheduler}),
        (
            "sglang.srt.managers.io_struct",
            {
                "PickleWrapper": PickleWrapper,
                "unwrap_from_pickle": unwrap_from_pickle,
                "wrap_as_pickle": wrap_as_pickle,
                "BatchStrOutput": BatchStrOutput,
                "TokenizedGenerateReqInput": TokenizedGenerateReqInput,
            },
        ),
        (
            "sglang.srt.observability.req_time_stats",
            {
                "ReqTimeStatsBase": ReqTimeStatsBase,
                "APIServerReqTimeStats": APIServerReqTimeStats,
                "DPControllerReqTimeStats": DPControllerReqTimeStats,
                "SchedulerReqTimeStats": SchedulerReqTimeStats,
            },
        ),
        (
            "sglang.srt.runtime_context",
            {"ParallelContext": ParallelContext, "get_parallel": get_parallel},
        ),
        ("sglang.srt.entrypoints.engine", {"Engine": Engine}),
        ("sglang.srt.model_executor.model_runner", {"ModelRunner": ModelRunner}),
    ):
        module = types.ModuleType(name)
        for member_name, member in members.items():
            setattr(module, member_name, member)
        modules[name] = module
    return modules


def patched_attributes() -> dict[tuple[type, str], Any]:
    owners: dict[str, type] = {
        "TokenizerManager": TokenizerManager,
        "Scheduler": Scheduler,
        "ReqTimeStatsBase": ReqTimeStatsBase,
        "APIServerReqTimeStats": APIServerReqTimeStats,
        "Engine": Engine,
        "ModelRunner": ModelRunner,
        "FastAPI": FastAPI,  # the real one: the HTTP span wraps real ASGI apps
    }
    result: dict[tuple[type, str], Any] = {}
    for patch in PATCHES:
        owner_name, _, attribute = patch.qualname.rpartition(".")
        owner = owners[owner_name]
        result[(owner, attribute)] = vars(owner)[attribute]
    return result


@dataclass
class Setup:
    instrumentor: SglangInstrumentor
    finished: list[RequestTimer]
    recorder: Recorder
    guard: HookGuard
    engine_jobs: list[Any]
    tracer: EngineStepTracer
    cold_start_jobs: list[Any] = field(default_factory=list)
    cold_start_environ: dict[str, str] = field(default_factory=dict)
    cold_start: ColdStartTracer = field(init=False)
    http_jobs: list[Any] = field(default_factory=list)
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
            self.http_jobs.append, guard=self.guard, to_unix=MonotonicToUnix()
        )

    def instrument(self) -> None:
        self.instrumentor.instrument(
            recorder=self.recorder,
            guard=self.guard,
            step_tracer=self.tracer,
            cold_start_tracer=self.cold_start,
            http_tracer=self.http_tracer,
        )


def make_setup() -> Setup:
    reset_clock()
    finished: list[RequestTimer] = []
    guard = HookGuard()
    engine_jobs: list[Any] = []
    tracer = EngineStepTracer(
        engine_jobs.append, guard=guard, to_unix=CLOCK, sample_rate=0.0, monotonic_ns=monotonic_ns
    )
    recorder = Recorder(finished.append, monotonic_ns=monotonic_ns)
    return Setup(SglangInstrumentor(), finished, recorder, guard, engine_jobs, tracer)
