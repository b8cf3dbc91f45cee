"""``transformers serve`` (transformers 5.19): the instrumentor and its patch table.

``transformers serve [MODEL] [--continuous-batching]`` is one process: a FastAPI app (the HTTP
server span: ``asgi.py``), the handlers' generation managers and an inference thread (plain
``generate()`` calls, or the continuous-batching engine's loop). ``transformers_serve_requests.py``
has every request's arrival, queue, tokens and finish, and the continuous-batching engine steps.

The cold start (``vllm_cold_start.py``, engine-agnostic): ``llm.cold_start`` from the process's
start to the end of the server's first model load (``ModelManager.load_model_and_processor``), its
``llm.cold_start.import`` phase until that load starts (or until the app is built, when no model
is preloaded) and ``llm.cold_start.weight_load`` (``ModelManager._load_model``: the model's
``from_pretrained``). With the model given on the command line the load happens before the server
listens; without it the first request loads the model in its handler, and that request is linked
to the cold start it waited for. The root then also covers the idle time before that request.

Activation: ``tokentrace run -- transformers serve ...``: the post-import hook of
``transformers.cli.serving``, which only ``transformers serve`` imports (so a process that merely
imports transformers, such as vLLM, is left alone). ``PATCHES`` lists every patch; a version of
transformers the table was not verified against is refused with one log line and runs untraced.
Prompt and completion text are never read.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from tokentrace.agent import semconv
from tokentrace.agent.frameworks.asgi import current_http_span
from tokentrace.agent.frameworks.patching import (
    FASTAPI_HTTP_SERVER_PATCH,
    USES_COLD_START,
    EngineInstrumentor,
    Patch,
)
from tokentrace.agent.frameworks.transformers_serve_requests import (
    COLD_START_ARRIVAL,
    TransformersServeRequestHooks,
)
from tokentrace.agent.frameworks.vllm_cold_start import (
    HOOK_COLD_START_IMPORT,
    HOOK_COLD_START_WEIGHT_LOAD,
)

if TYPE_CHECKING:
    from tokentrace.agent.runtime import AgentRuntime

__all__ = [
    "PATCHES",
    "SUPPORTED_VERSIONS",
    "TransformersServeInstrumentor",
]

SUPPORTED_VERSIONS: Final = ">= 5.19, < 5.25"
"""transformers releases whose ``transformers serve`` internals the patch table targets (verified
on 5.19.0)."""
_DISTRIBUTIONS: Final = ("transformers",)
_HOOK_COLD_START_LOAD: Final = "transformers_serve.cold_start.load"

_SERVING: Final = "transformers.cli.serving.utils"
_MODEL_MANAGER: Final = "transformers.cli.serving.model_manager"
_CB_API: Final = "transformers.generation.continuous_batching.continuous_api"
_CB_SCHEDULER: Final = "transformers.generation.continuous_batching.scheduler"
PATCHES: Final = (
    # The HTTP server span (asgi.py) of the serve app.
    FASTAPI_HTTP_SERVER_PATCH,
    # Arrival, in both generation managers.
    Patch(_SERVING, "GenerateManager.generate_streaming", "_wrap_generate_streaming"),
    Patch(_SERVING, "GenerateManager.generate_non_streaming", "_wrap_generate_non_streaming"),
    Patch(_SERVING, "CBGenerateManager.generate_streaming", "_wrap_generate_streaming"),
    Patch(_SERVING, "CBGenerateManager.generate_non_streaming", "_wrap_generate_non_streaming"),
    # Plain: the inference thread's queue, the streamer's tokens and finish.
    Patch(_SERVING, "InferenceThread.submit", "_wrap_submit"),
    Patch(_SERVING, "InferenceThread.async_submit", "_wrap_submit"),
    Patch(_SERVING, "DirectStreamer.__init__", "_wrap_streamer_init"),
    Patch(_SERVING, "DirectStreamer.put", "_wrap_streamer_put"),
    Patch(_SERVING, "DirectStreamer.end", "_wrap_streamer_end"),
    Patch(_SERVING, "DirectStreamer.cancel", "_wrap_streamer_cancel"),
    Patch(_SERVING, "CBStreamer.cancel", "_wrap_streamer_cancel"),
    # Continuous batching: the engine's steps (queue end, tokens, finish) and failures.
    Patch(_CB_SCHEDULER, "FIFOScheduler.schedule_batch", "_wrap_schedule_batch"),
    Patch(_CB_SCHEDULER, "PrefillFirstScheduler.schedule_batch", "_wrap_schedule_batch"),
    Patch(_CB_API, "ContinuousBatchProcessor.update_batch", "_wrap_update_batch"),
    Patch(_CB_API, "OutputRouter.fail_and_deliver", "_wrap_fail_and_deliver"),
    # The cold start.
    Patch(
        _MODEL_MANAGER,
        "ModelManager.load_model_and_processor",
        "_wrap_load_model_and_processor",
        uses=USES_COLD_START,
    ),
    Patch(_MODEL_MANAGER, "ModelManager._load_model", "_wrap_load_model", uses=USES_COLD_START),
)
"""Every patch this instrumentation makes, in one place."""


class TransformersServeInstrumentor(TransformersServeRequestHooks, EngineInstrumentor):
    """Traces ``transformers serve``'s requests; ``instrument()`` is idempotent and
    ``uninstrument()`` reverses it.

    ``instrument(recorder=..., guard=...)`` uses the given recorder and guard (tests; also
    ``step_tracer=``, ``cold_start_tracer=``, ``http_tracer=``); without them it uses the
    process's agent runtime, and does nothing when the agent is disabled or for an unsupported
    transformers version (one warning).
    """

    target_module: Final = "transformers.cli.serving"
    """The module whose import ``tokentrace run`` waits for before instrumenting."""
    engine = "transformers serve"
    distributions = _DISTRIBUTIONS
    supported_versions = SUPPORTED_VERSIONS
    patches = PATCHES

    def _tracers_from_runtime(self, runtime: AgentRuntime) -> None:
        self._step_tracer = runtime.engine_step_tracer()
        self._http_tracer = self._runtime_http_tracer(runtime)
        self._cold_start_tracer = self._runtime_cold_start(runtime, frontend=True, inherit=False)

    def _reset_state(self) -> None:
        self._open_cb_steps = deque()

    # --- the HTTP server span ------------------------------------------------------------------
    def _wrap_middleware_stack(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        cold_start = self._cold_start_tracer
        if self._active and cold_start is not None:
            # Without a preloaded model the process's own start-up ends when its app is built.
            self._guard.run(HOOK_COLD_START_IMPORT, cold_start.import_done)
        return super()._wrap_middleware_stack(wrapped, instance, args, kwargs)

    # --- the cold start ------------------------------------------------------------------------
    def _wrap_load_model_and_processor(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        # Called by every request's handler (a cache lookup once the model is loaded); only the
        # server's first load is its cold start.
        cold_start = self._cold_start_tracer
        if not self._active or cold_start is None or cold_start.ready_ns is not None:
            return wrapped(*args, **kwargs)
        self._guard.run(_HOOK_COLD_START_LOAD, self._on_load_in_request)
        return self._build_engine(wrapped, args, kwargs)

    def _on_load_in_request(self) -> None:
        """A request's handler loads the server's first model: its timer starts now, so that
        the load is its cold start wait."""
        if current_http_span() is not None:
            COLD_START_ARRIVAL.set(self._recorder.clock())

    def _wrap_load_model(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        return self._cold_start_phase(
            HOOK_COLD_START_WEIGHT_LOAD,
            semconv.SPAN_COLD_START_WEIGHT_LOAD,
            wrapped,
            args,
            kwargs,
        )
