"""llama-cpp-python's OpenAI-compatible server (0.3.36): the instrumentor and its patch table.

The server (``python -m llama_cpp.server``, or ``llama_cpp.server.app.create_app`` under
uvicorn) is one process: FastAPI on an asyncio loop, the model in worker threads, one request at
a time behind its model lock. ``llama_cpp_requests.py`` times each request (queue wait on the
lock, prefill and its chunks, tokens, cached prompt tokens, finish, interruption); ``asgi.py``
gives the HTTP server span the request's spans join. The cold start (``vllm_cold_start.py``,
engine-agnostic) runs from the process's start to the end of ``LlamaProxy.__init__`` (the
default model loaded), with a ``weight_load`` phase per ``load_llama_from_model_settings``
carrying the model's weight bytes (``llama_model_size``). The server loads the model before it
listens, so no request waits for it; a later request that switches models (a config file with
several) pays the load inside its prefill.

Activation: ``tokentrace run -- python -m llama_cpp.server --model ...`` (the post-import hook of
``llama_cpp.server``). An application that uses ``llama_cpp.Llama`` in-process, without the
server, is not touched: the hooks time the server's requests, and a ``Llama`` call outside one
records nothing. ``PATCHES`` lists every patch.

Prompt and completion text are never read. Each hook body runs through the runtime's
``HookGuard``; llama-cpp-python's own call always runs outside it. A version the table was not
verified against is refused with one log line and runs untraced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from tokentrace.agent import semconv
from tokentrace.agent.frameworks.llama_cpp_requests import LlamaCppRequestHooks
from tokentrace.agent.frameworks.patching import (
    FASTAPI_HTTP_SERVER_PATCH,
    USES_COLD_START,
    EngineInstrumentor,
    Patch,
)
from tokentrace.agent.frameworks.vllm_cold_start import (
    HOOK_COLD_START_WEIGHT_LOAD,
)

if TYPE_CHECKING:
    from tokentrace.agent.runtime import AgentRuntime

__all__ = ["PATCHES", "SUPPORTED_VERSIONS", "LlamaCppInstrumentor"]

SUPPORTED_VERSIONS: Final = ">= 0.3.36, < 0.3.37"
"""llama-cpp-python releases whose server internals the patch table was verified against."""
_DISTRIBUTIONS: Final = ("llama_cpp_python",)

_APP: Final = "llama_cpp.server.app"
_MODEL: Final = "llama_cpp.server.model"
_LLAMA: Final = "llama_cpp.llama"
_INTERNALS: Final = "llama_cpp._internals"
PATCHES: Final = (
    # The HTTP server span (asgi.py) of the server's FastAPI app.
    FASTAPI_HTTP_SERVER_PATCH,
    # Arrival, queue wait and finish: the model lock (llama_cpp_requests.py). The completion
    # and chat routes call it at request time (``asynccontextmanager(get_llama_proxy)``).
    Patch(_APP, "get_llama_proxy", "_wrap_get_llama_proxy"),
    # Compute, while the request holds the lock.
    Patch(_LLAMA, "Llama._create_completion", "_wrap_create_completion"),
    Patch(_LLAMA, "Llama.generate", "_wrap_generate"),
    Patch(_LLAMA, "Llama.eval", "_wrap_eval"),
    Patch(_INTERNALS, "LlamaContext.decode", "_wrap_decode"),
    # The cold start.
    Patch(_MODEL, "LlamaProxy.__init__", "_wrap_proxy_init", uses=USES_COLD_START),
    Patch(
        _MODEL,
        "LlamaProxy.load_llama_from_model_settings",
        "_wrap_load_llama",
        uses=USES_COLD_START,
    ),
)
"""Every patch this instrumentation makes, in one place."""


class LlamaCppInstrumentor(LlamaCppRequestHooks, EngineInstrumentor):
    """Traces llama-cpp-python server requests; ``instrument()`` is idempotent and
    ``uninstrument()`` reverses it.

    ``instrument(recorder=..., guard=...)`` uses the given recorder and guard (tests; also
    ``cold_start_tracer=``, ``http_tracer=``); without them it uses the process's agent runtime,
    and does nothing when the agent is disabled or for an unsupported version (one warning).
    """

    target_module: Final = "llama_cpp.server"
    """The module whose import ``tokentrace run`` waits for: the server, not ``llama_cpp``."""
    engine = "llama-cpp-python"
    distributions = _DISTRIBUTIONS
    supported_versions = SUPPORTED_VERSIONS
    patches = PATCHES

    def _tracers_from_runtime(self, runtime: AgentRuntime) -> None:
        self._http_tracer = self._runtime_http_tracer(runtime)
        # One process: it starts its own cold start (any inherited ids are a parent's).
        self._cold_start_tracer = self._runtime_cold_start(runtime, frontend=True, inherit=False)

    def _reset_state(self) -> None:
        self._serving = None
        self._waiting = 0
        self._request_count = 0

    # --- cold start ------------------------------------------------------------------------------
    def _wrap_proxy_init(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        # The server is ready once its default model is loaded.
        return self._build_engine(wrapped, args, kwargs)

    def _wrap_load_llama(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        cold_start = self._cold_start_tracer
        if cold_start is None or cold_start.ready_ns is not None:
            return wrapped(*args, **kwargs)  # a model switch at request time: not a cold start
        loaded: list[Any] = []

        def load(*load_args: Any, **load_kwargs: Any) -> Any:
            llama = wrapped(*load_args, **load_kwargs)
            loaded.append(llama)
            return llama

        return self._cold_start_phase(
            HOOK_COLD_START_WEIGHT_LOAD,
            semconv.SPAN_COLD_START_WEIGHT_LOAD,
            load,
            args,
            kwargs,
            attributes=lambda: _weight_attributes(loaded[0]),
        )


def _weight_attributes(llama: Any) -> dict[str, int]:
    """The loaded model's weight bytes (``llama_model_size``): what each decode reads at least
    once, for the node agent's decode roofline."""
    total = int(llama._model.size())
    return {semconv.MODEL_WEIGHT_BYTES: total} if total > 0 else {}
