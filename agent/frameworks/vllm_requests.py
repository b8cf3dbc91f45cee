"""vLLM's frontend: every request's queue, prefill, tokens and finish, from its request hooks.

Everything here runs in vLLM's API server process (the frontend: ``AsyncLLM`` or offline
``LLMEngine``), where vLLM's output processor already sees every request's whole life. No clock
is read per token: each token gets the timestamp of the engine step that produced it.

- **arrival** (``OutputProcessor.add_request``): the timer begins. Its arrival is vLLM's own
  ``arrival_time`` (wall clock, taken by the input processor) converted once to monotonic ns with
  a ``MonotonicToUnix`` offset, so ``llm.request`` starts where vLLM's built-in ``llm_request`` span
  starts and TTFT has vLLM's meaning (arrival at the engine client, after tokenisation).
- **tokens** (``OutputProcessor.process_outputs``, once per output chunk of an engine step): each
  new token appends the step's EngineCore timestamp (``time.monotonic()`` in EngineCore; on Linux
  comparable across the processes of a host), i.e. exactly vLLM's ``first_token_ts`` /
  ``last_token_ts`` and inter-token latencies.
- **queue and preemption**: the scheduler events vLLM attaches to outputs (stats logging on, the
  server default): the first QUEUED (EngineCore's ``add_request``, vLLM's
  ``RequestStateStats.queued_ts``) starts ``llm.queue`` - the engine arrival, so the hand-off
  from the API server is not counted as queue wait - and the first SCHEDULED ends it; each
  PREEMPTED until the next SCHEDULED is one ``llm.preempted`` interval, with EngineCore's own
  timestamps. Without events (offline ``LLM`` with stats logging off) the queue span lasts from
  arrival until the first token.
- **finish**: after ``process_outputs``, a traced request whose state vLLM dropped is finished:
  one clock read marks the response complete; output tokens (as many as were timed: vLLM's usage
  count), prompt and cached tokens and the finish reason come from vLLM's ``RequestState``.
- **abort** (``OutputProcessor.abort_requests``: a client that disconnects cancels
  ``AsyncLLM.generate``, which aborts): the request ends with error ``aborted``.
- **model**: the served model name (``--served-model-name``) is read once per engine, when
  ``AsyncLLM`` / ``LLMEngine`` is built. **operation**: ``chat`` for vLLM's ``chatcmpl-`` request
  ids, otherwise ``text_completion``.
- **HTTP server span** (``asgi.py``; ``build_middleware_stack`` of FastAPI and Starlette): each
  POST that the API server serves is a SERVER span from the moment uvicorn hands it to the app
  until just before the response's last bytes are sent, and ``llm.request`` is its child (the
  request's task carries it in a context variable). It honours the caller's ``traceparent``;
  it is what lets the budget tell a busy API server (``http``, ``postprocess``) from the
  network.
- **traceparent** without the HTTP span (another frontend, or the ASGI hook disabled): vLLM
  forwards the caller's trace headers to ``AsyncLLM.add_request`` but drops them there when its
  own tracing is off; the wrapper of that coroutine hands them to the output processor's
  ``add_request`` (same task) through a context variable. ``llm.request`` is then a child of the
  caller's span; without one it starts a new random trace. The ids of
  ``llm.request`` and ``llm.prefill`` are chosen here and travel to EngineCore in the request's
  ``trace_headers`` (``vllm_engine.ENGINE_PARENT_HEADER``), so that the engine's step and chunk
  spans join the request's tree.

Separate from ``vllm`` (the plugin entry point, the instrumentor and its patch table, and the
thin wrappers of the engine, cold-start and HTTP patches): this is the per-request serving path.
``VllmInstrumentor`` mixes ``FrontendRequestHooks`` in, so its wrappers and hook bodies share the
instrumentor's recorder, guard and clock and remain its methods.
"""

from __future__ import annotations

import contextvars
import weakref
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Final, TypeVar

from tokentrace.agent import compiled, semconv
from tokentrace.agent.frameworks.asgi import current_http_span
from tokentrace.agent.frameworks.patching import unbound
from tokentrace.agent.frameworks.vllm_cold_start import ColdStartTracer
from tokentrace.agent.frameworks.vllm_engine import (
    ENGINE_PARENT_HEADER,
    EVENT_PREEMPTED,
    EVENT_QUEUED,
    EVENT_SCHEDULED,
    engine_parent_header,
)
from tokentrace.agent.hooks import HookGuard
from tokentrace.agent.recorder import PROMPT_TOKEN_IDS, MonotonicToUnix, Recorder, RequestTimer
from tokentrace.agent.span_ids import parse_traceparent, random_span_id_bytes, random_trace_id

__all__ = [
    "HOOK_ABORT",
    "HOOK_ADD_REQUEST",
    "HOOK_OUTPUTS",
    "HOOK_TRACE_CONTEXT",
    "FrontendRequestHooks",
]

# Hook names: what HookGuard counts and disables (and logs).
HOOK_TRACE_CONTEXT: Final = "vllm.trace_context"
HOOK_ADD_REQUEST: Final = "vllm.add_request"
HOOK_OUTPUTS: Final = "vllm.process_outputs"
HOOK_ABORT: Final = "vllm.abort"
_REQUEST_HOOKS: Final = frozenset({HOOK_ADD_REQUEST, HOOK_OUTPUTS, HOOK_ABORT})
"""One request's life spans these hooks: when one is disabled, requests are no longer traced."""
_OUTPUTS_HOOK: Callable[..., Any] | None = getattr(
    compiled.load("tokentrace.agent._steps"), "outputs_hook", None
)
"""``_steps.c``'s maker of the per-step output patch in C, if built (the Python patch of
``_process_outputs_patch`` is its twin)."""
_TRACE_HEADERS_ARGUMENT: Final = 6
"""Position of ``trace_headers`` in ``AsyncLLM.add_request``'s arguments (after ``self``)."""
_CHAT_REQUEST_PREFIX: Final = "chatcmpl-"
_UNKNOWN_MODEL: Final = "unknown"
_ERROR_ABORTED: Final = "aborted"
_ERROR_ENGINE: Final = "engine error"
# vLLM's FinishReason values (an IntEnum; a real-vLLM test checks them).
_FINISH_REASONS: Final = ("stop", "length", "abort", "error", "repetition")
_FINISH_STOP: Final = "stop"
_FINISH_ABORT: Final = 2
_NS_PER_S: Final = 1_000_000_000
_NO_FAN_OUT: Final[tuple[Any, bytes]] = (None, b"")

_T = TypeVar("_T")


# --- trace context --------------------------------------------------------------------------------
_incoming_trace_headers: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar(
    "tokentrace_vllm_trace_headers", default=None
)


async def _with_trace_headers(call: Coroutine[Any, Any, _T], headers: Mapping[str, str]) -> _T:
    token = _incoming_trace_headers.set(headers)
    try:
        return await call
    finally:
        _incoming_trace_headers.reset(token)


def _trace_headers_argument(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if len(args) > _TRACE_HEADERS_ARGUMENT:
        return args[_TRACE_HEADERS_ARGUMENT]
    return kwargs.get("trace_headers")


def _finish_reason(reason: Any) -> str:
    """vLLM's FinishReason (an IntEnum; None: the detokenizer matched a stop string)."""
    if reason is None:
        return _FINISH_STOP
    index = int(reason)
    return _FINISH_REASONS[index] if 0 <= index < len(_FINISH_REASONS) else str(reason)


class FrontendRequestHooks:
    """``VllmInstrumentor``'s request patches: the wrappers of ``AsyncLLM.add_request`` and of
    ``OutputProcessor``'s ``add_request``, ``process_outputs`` and ``abort_requests``, and their
    hook bodies. The instrumentor sets the state they share when it instruments."""

    _active: bool
    _guard: HookGuard
    _recorder: Recorder
    _clock: MonotonicToUnix
    _cold_start_tracer: ColdStartTracer | None
    _model_names: weakref.WeakKeyDictionary[Any, str]
    _last_fan_out: tuple[Any, bytes]

    def _reset_request_state(self) -> None:
        """Forget the engines' model names and the last parallel-sampling parent."""
        self._model_names = weakref.WeakKeyDictionary()
        self._last_fan_out = _NO_FAN_OUT

    def _requests_disabled(self) -> bool:
        disabled = self._guard.disabled
        return bool(disabled) and not disabled.isdisjoint(_REQUEST_HOOKS)

    # --- wrappers (serving path): guard first, vLLM's call outside every guard --------------------
    def _wrap_async_add_request(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        if not self._active or self._requests_disabled():
            return wrapped(*args, **kwargs)
        headers = self._guard.run(HOOK_TRACE_CONTEXT, _trace_headers_argument, args, kwargs)
        if not headers:
            return wrapped(*args, **kwargs)
        return _with_trace_headers(wrapped(*args, **kwargs), headers)

    def _wrap_add_request(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        result = wrapped(*args, **kwargs)
        if self._active and not self._requests_disabled():
            self._guard.run(HOOK_ADD_REQUEST, self._on_add_request, instance, args, kwargs)
        return result

    def _process_outputs_patch(self, process_outputs: Callable[..., Any]) -> Callable[..., Any]:
        """``OutputProcessor.process_outputs`` patched (once per engine step): each traced
        request's new tokens, events and finish, read around vLLM's call. In C where built
        (``_steps.outputs_hook``: no Python frame per step but where a request has events or
        finishes; a call of another shape goes to the Python patch, its twin)."""
        patched = self._process_outputs_python(process_outputs)
        if _OUTPUTS_HOOK is None:
            return patched
        return _OUTPUTS_HOOK(
            process_outputs, patched, self, self._recorder, self._guard, HOOK_OUTPUTS,
            tuple(sorted(_REQUEST_HOOKS)), _apply_events,
        )  # fmt: skip

    def _process_outputs_python(self, process_outputs: Callable[..., Any]) -> Callable[..., Any]:
        def patched(processor: Any, *args: Any, **kwargs: Any) -> Any:
            if not self._active or not self._recorder.in_flight or self._requests_disabled():
                return process_outputs(processor, *args, **kwargs)
            guard = self._guard
            pending = guard.run(HOOK_OUTPUTS, self._before_outputs, processor, args, kwargs)
            result = process_outputs(processor, *args, **kwargs)
            if pending is not None:
                guard.run(HOOK_OUTPUTS, self._after_outputs, processor, pending)
            return result

        return patched

    def _wrap_outputs(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        return self._process_outputs_python(unbound(wrapped))(instance, *args, **kwargs)

    def _wrap_abort(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        if not self._active or not self._recorder.in_flight or self._requests_disabled():
            return wrapped(*args, **kwargs)
        pending = self._guard.run(HOOK_ABORT, self._before_abort, instance, args, kwargs)
        result = wrapped(*args, **kwargs)
        if pending:
            self._guard.run(HOOK_ABORT, self._after_abort, instance, pending)
        return result

    # --- hook bodies (each runs inside HookGuard.run) ---------------------------------------------
    def _on_engine_init(self, engine: Any) -> None:
        name = engine.model_config.served_model_name
        if isinstance(name, list | tuple):
            name = name[0] if name else None
        if name:
            self._model_names[engine.output_processor] = str(name)

    def _on_add_request(
        self, processor: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        request = args[0] if args else kwargs["request"]
        request_id = request.request_id
        recorder = self._recorder
        if recorder.get(request_id) is not None:  # a streaming-input update of a traced request
            return
        # vLLM's wall-clock arrival, moved to the monotonic domain of every other timestamp.
        arrival_ns = int(request.arrival_time * _NS_PER_S) - self._clock.offset_ns()
        timer = recorder.begin(request_id, arrival_ns=arrival_ns)
        if timer is None:
            return
        cold_start = self._cold_start_tracer
        if cold_start is not None:
            cold_start.on_request(timer)
        http = current_http_span()
        context = None
        if http is not None:  # the HTTP server span already honoured the caller's traceparent
            context = http.trace_id, http.span_id
        elif headers := request.trace_headers or _incoming_trace_headers.get():
            traceparent = headers.get("traceparent")
            if traceparent:
                context = parse_traceparent(traceparent)
        if context is None:
            # The n sequences of one parallel-sampling request (n > 1) are one API request: one
            # trace. vLLM adds them one after another, so the last parent suffices.
            parent = args[2] if len(args) > 2 else kwargs.get("parent_req")
            last_parent, last_trace_id = self._last_fan_out
            if parent is not None and parent is last_parent:
                timer.trace_id = last_trace_id
            else:
                timer.trace_id = random_trace_id()
                self._last_fan_out = (parent, timer.trace_id) if parent is not None else _NO_FAN_OUT
        else:
            timer.trace_id, timer.parent_span_id = context
        # Ids chosen now so that EngineCore can parent its spans (engine steps, prefill chunks)
        # under this request's; vLLM ships trace_headers to EngineCore with the request.
        timer.span_id = random_span_id_bytes()
        timer.prefill_span_id = random_span_id_bytes()
        request.trace_headers = {
            **(request.trace_headers or {}),
            ENGINE_PARENT_HEADER: engine_parent_header(
                timer.trace_id, timer.span_id, timer.prefill_span_id
            ),
        }
        external_id = request.external_req_id or request_id
        attributes = timer.attributes
        attributes["request_id"] = external_id
        attributes["model"] = self._model_names.get(processor, _UNKNOWN_MODEL)
        attributes["operation"] = (
            semconv.OPERATION_CHAT
            if external_id.startswith(_CHAT_REQUEST_PREFIX)
            else semconv.OPERATION_TEXT_COMPLETION
        )

    def _before_outputs(
        self, processor: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[list[tuple[Any, RequestTimer, Any]], Any] | None:
        """The traced requests among this chunk's outputs, with vLLM's state for each (vLLM drops
        the state of a request that finishes during the call)."""
        outputs = args[0] if args else kwargs["engine_core_outputs"]
        timestamp = args[1] if len(args) > 1 else kwargs.get("engine_core_timestamp")
        get_timer = self._recorder.get
        states = processor.request_states
        traced = []
        for output in outputs:
            request_id = output.request_id
            timer = get_timer(request_id)
            if timer is not None:
                traced.append((output, timer, states.get(request_id)))
        return (traced, timestamp) if traced else None

    def _after_outputs(
        self, processor: Any, pending: tuple[list[tuple[Any, RequestTimer, Any]], Any]
    ) -> None:
        traced, timestamp = pending
        # One timestamp for the whole step: EngineCore's, taken after the model ran.
        step_ns = self._recorder.clock() if timestamp is None else int(timestamp * _NS_PER_S)
        states = processor.request_states
        for output, timer, state in traced:
            # Read after vLLM's call: a matched stop string trims the surplus tokens in place.
            new_tokens = len(output.new_token_ids)
            if new_tokens == 1:
                timer.token_ns.append(step_ns)
            elif new_tokens:
                timer.token_ns.extend([step_ns] * new_tokens)
            events = output.events
            if events:
                _apply_events(timer, events)
            if output.request_id not in states:
                self._finish(timer, state, output.finish_reason)

    def _before_abort(
        self, processor: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> list[tuple[RequestTimer, Any]]:
        request_ids = args[0] if args else kwargs["request_ids"]
        internal = args[1] if len(args) > 1 else kwargs.get("internal", False)
        if not isinstance(request_ids, list | tuple | set | frozenset):
            return []  # a one-shot iterable is vLLM's to consume
        states = processor.request_states
        internal_ids: list[str] = []
        for request_id in request_ids:
            if not internal:
                internal_ids.extend(processor.external_req_ids.get(request_id, ()))
            elif request_id in states:
                internal_ids.append(request_id)
            elif (parent := processor.parent_requests.get(request_id)) is not None:
                internal_ids.extend(parent.child_requests)
        get_timer = self._recorder.get
        return [
            (timer, states.get(request_id))
            for request_id in internal_ids
            if (timer := get_timer(request_id)) is not None
        ]

    def _after_abort(self, processor: Any, pending: list[tuple[RequestTimer, Any]]) -> None:
        states = processor.request_states
        for timer, state in pending:
            if timer.request_id not in states:
                self._finish(timer, state, _FINISH_ABORT)

    def _finish(self, timer: RequestTimer, state: Any, reason: Any) -> None:
        attributes = timer.attributes
        attributes["output_tokens"] = len(timer.token_ns)
        if state is not None:
            attributes["input_tokens"] = state.prompt_len
            attributes["cached_tokens"] = state.num_cached_tokens
            # A reference, hashed off the serving path (``recorder.to_finished_request``).
            attributes[PROMPT_TOKEN_IDS] = getattr(state, "prompt_token_ids", None)
            for name, value in (
                ("max_tokens", state.max_tokens_param),
                ("temperature", state.temperature),
                ("top_p", state.top_p),
            ):
                if value is not None:
                    attributes[name] = value
        finish_reason = _finish_reason(reason)
        attributes["finish_reason"] = finish_reason
        status_error = None
        if finish_reason == _FINISH_REASONS[_FINISH_ABORT]:
            status_error = _ERROR_ABORTED
        elif finish_reason == "error":
            status_error = _ERROR_ENGINE
        self._recorder.finish(timer.request_id, status_error=status_error)


def _apply_events(timer: RequestTimer, events: Any) -> None:
    for event in events:
        kind = event.type
        if kind == EVENT_SCHEDULED:
            event_ns = int(event.timestamp * _NS_PER_S)
            if timer.first_scheduled_ns is None:
                timer.first_scheduled_ns = event_ns
            else:  # scheduled again: resumed after a preemption
                timer.resume(event_ns)
        elif kind == EVENT_PREEMPTED:
            timer.preempt(int(event.timestamp * _NS_PER_S))
        elif kind == EVENT_QUEUED and timer.queued_ns is None:
            timer.queued_ns = int(event.timestamp * _NS_PER_S)
