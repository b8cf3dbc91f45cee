"""SGLang (0.5.23): the plugin entry point, the instrumentor and its patch table.

Processes: the one the user starts (``python -m sglang.launch_server``, or an application that
builds ``sglang.Engine``) holds the HTTP server and the ``TokenizerManager``: every request's
arrival, queue times, tokens and finish (``sglang_requests.py``) and the HTTP server span
(``asgi.py``). Each scheduler process (tensor- and data-parallel ranks) runs the engine steps
(``sglang_scheduler.py``). The detokenizer process holds no timings. The cold start
(``vllm_cold_start.py``, engine-agnostic) has its root in the first process (its start -> the end
of ``Engine._launch_subprocesses``, when every scheduler has loaded its model and sized its KV
cache) and a ``weight_load`` phase per scheduler (``ModelRunner.load_model``).

Activation: ``tokentrace run -- python -m sglang.launch_server ...`` (the post-import hook of
``sglang``, in every Python process of the server), or SGLang's own plugin group
(``sglang.srt.plugins``: ``register``, which SGLang calls in each of its processes). Every patch
applies where its module is imported; a hook fires only in the process whose code calls it, so
no process needs telling what it is. ``PATCHES`` lists every patch.

Prompt and completion text are never read. Each hook body runs through the runtime's
``HookGuard``; SGLang's own call always runs outside it. A version of SGLang the table was not
verified against is refused with one log line and runs untraced.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, Final

from tokentrace.agent import semconv
from tokentrace.agent.bootstrap import pin_exporter_environment
from tokentrace.agent.frameworks.patching import (
    FASTAPI_HTTP_SERVER_PATCH,
    USES_COLD_START,
    USES_STEP_TRACER,
    EngineInstrumentor,
    Patch,
)
from tokentrace.agent.frameworks.sglang_requests import SglangFrontendHooks
from tokentrace.agent.frameworks.sglang_scheduler import SglangSchedulerHooks
from tokentrace.agent.frameworks.vllm_cold_start import (
    HOOK_COLD_START_IMPORT,
    HOOK_COLD_START_WEIGHT_LOAD,
)

if TYPE_CHECKING:
    from tokentrace.agent.runtime import AgentRuntime

__all__ = ["PATCHES", "SUPPORTED_VERSIONS", "SglangInstrumentor", "register"]

_log = logging.getLogger(__name__)

SUPPORTED_VERSIONS: Final = ">= 0.5.23, < 0.5.24"
"""SGLang releases whose internals the patch table was verified against (SGLang's internals
change between patch releases)."""
_DISTRIBUTIONS: Final = ("sglang",)
_MAIN_PROCESS_NAME: Final = "MainProcess"
_LOGGER_ROOT: Final = "tokentrace"


_TOKENIZER_MANAGER: Final = "sglang.srt.managers.tokenizer_manager"
_SCHEDULER: Final = "sglang.srt.managers.scheduler"
_TIME_STATS: Final = "sglang.srt.observability.req_time_stats"
PATCHES: Final = (
    # The HTTP server span (asgi.py) of SGLang's FastAPI app.
    FASTAPI_HTTP_SERVER_PATCH,
    # Requests (sglang_requests.py).
    Patch(_TOKENIZER_MANAGER, "TokenizerManager._send_one_request", "_wrap_send_one_request"),
    Patch(_TOKENIZER_MANAGER, "TokenizerManager._send_batch_request", "_wrap_send_batch_request"),
    Patch(_TOKENIZER_MANAGER, "TokenizerManager._handle_batch_output", "_wrap_handle_batch_output"),
    Patch(
        _TOKENIZER_MANAGER,
        "TokenizerManager._release_req_states_on_failure",
        "_wrap_release_req_states",
    ),
    # The parent ids ride in the pickled time stats: the frontend's, and the data-parallel
    # controller's copy of them (``new_from_obj``) on the way to a data-parallel scheduler.
    Patch(_TIME_STATS, "ReqTimeStatsBase.__getstate__", "_wrap_time_stats_getstate"),
    Patch(_TIME_STATS, "ReqTimeStatsBase.new_from_obj", "_wrap_time_stats_new_from_obj"),
    # Engine steps (sglang_scheduler.py).
    Patch(
        _SCHEDULER,
        "Scheduler.handle_generate_request",
        "_wrap_handle_generate_request",
        uses=USES_STEP_TRACER,
    ),
    Patch(_SCHEDULER, "Scheduler._add_request_to_queue", "_wrap_add_request_to_queue"),
    Patch(_SCHEDULER, "Scheduler.run_batch", "_wrap_run_batch", uses=USES_STEP_TRACER),
    Patch(
        _SCHEDULER,
        "Scheduler.process_batch_result",
        "_wrap_process_batch_result",
        uses=USES_STEP_TRACER,
    ),
    # The cold start.
    Patch(
        "sglang.srt.entrypoints.engine",
        "Engine._launch_subprocesses",
        "_wrap_launch_subprocesses",
        uses=USES_COLD_START,
    ),
    Patch(
        "sglang.srt.model_executor.model_runner",
        "ModelRunner.load_model",
        "_wrap_load_model",
        uses=USES_COLD_START,
    ),
)
"""Every patch this instrumentation makes, in one place."""


class SglangInstrumentor(SglangFrontendHooks, SglangSchedulerHooks, EngineInstrumentor):
    """Traces SGLang requests; ``instrument()`` is idempotent and ``uninstrument()`` reverses it.

    ``instrument(recorder=..., guard=...)`` uses the given recorder and guard (tests; also
    ``step_tracer=``, ``cold_start_tracer=``, ``http_tracer=``); without them it uses the
    process's agent runtime, and does nothing when the agent is disabled or for an unsupported
    SGLang version (one warning).
    """

    target_module: Final = "sglang"
    """The module whose import ``tokentrace run`` waits for before instrumenting."""
    engine = "SGLang"
    distributions = _DISTRIBUTIONS
    supported_versions = SUPPORTED_VERSIONS
    patches = PATCHES

    def _tracers_from_runtime(self, runtime: AgentRuntime) -> None:
        self._step_tracer = runtime.engine_step_tracer()
        self._http_tracer = self._runtime_http_tracer(runtime)
        # The process the user started begins a new cold start; SGLang's children join it.
        top_level = multiprocessing.current_process().name == _MAIN_PROCESS_NAME
        cold_start = self._runtime_cold_start(runtime, frontend=top_level, inherit=not top_level)
        if cold_start is not None and not top_level:  # SGLang loads plugins after its imports
            runtime.guard.run(HOOK_COLD_START_IMPORT, cold_start.import_done)
        self._cold_start_tracer = cold_start

    def _reset_state(self) -> None:
        self._open_steps = {}
        self._rank_zero = {}

    # --- cold start ------------------------------------------------------------------------------
    def _wrap_launch_subprocesses(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        # The server is ready to serve once every scheduler has loaded its model.
        return self._build_engine(wrapped, args, kwargs)

    def _wrap_load_model(
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


def _weight_attributes(runner: Any) -> dict[str, int]:
    """The loaded model's weight bytes in this rank: what each decode step reads at least once,
    for the node agent's decode roofline."""
    total = sum(
        parameter.numel() * parameter.element_size() for parameter in runner.model.parameters()
    )
    return {semconv.MODEL_WEIGHT_BYTES: int(total)} if total > 0 else {}


def _warnings_only_in_sglangs_log() -> None:
    """SGLang's logging setup gives the root logger its handler at INFO: tokentrace's warnings
    (a disabled hook, drops) reach SGLang's log through it, its info lines stay out."""
    ours = logging.getLogger(_LOGGER_ROOT)
    if ours.level == logging.NOTSET:
        ours.setLevel(logging.WARNING)


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: SGLang calls it once in each of its processes."""
    try:
        pin_exporter_environment(os.environ)
        _warnings_only_in_sglangs_log()
        instrumentor = SglangInstrumentor()
        if not instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.instrument()
    except Exception:  # a plugin that raises would stop SGLang's start-up
        _log.warning("tokentrace: could not instrument SGLang; it runs untraced", exc_info=True)
