"""``transformers serve``'s requests: arrival, queue, tokens, finish, and the continuous-batching
engine's steps.

``transformers serve`` is one process: a FastAPI app whose handlers tokenise the request and hand
it to a generation manager, and one inference thread that runs the model. Two managers:

- **plain** (``GenerateManager``): each request is a ``model.generate()`` call that the handler
  submits to the ``InferenceThread``, which runs one call at a time, so requests queue behind
  each other.

  - arrival: ``GenerateManager.generate_streaming`` / ``generate_non_streaming`` (after
    tokenisation: as for vLLM, the tokenisation is part of the ``http`` segment);
  - queue: from the submit (``InferenceThread.submit`` / ``async_submit``, called inside the
    manager's method) to the moment the inference thread starts the call;
  - tokens: ``DirectStreamer.put`` (``generate()`` calls it on the inference thread after each
    decode step; its first call carries the prompt and is not a token): one clock read per call;
  - finish: ``DirectStreamer.end`` (``length`` when ``max_new_tokens`` were generated, else
    ``stop``), ``DirectStreamer.cancel`` (the client went away: ``abort``, error ``aborted``),
    or the call's end without either (``generate()`` raised: error ``failed``);
  - a response that is not streamed has no streamer: its tokens have no times
    (``not_reported``), its output tokens are counted from the returned sequence.

- **continuous batching** (``CBGenerateManager``, ``--continuous-batching``): the manager adds
  the request to the ``ContinuousBatchingManager``, whose background thread runs the engine
  steps: ``Scheduler.schedule_batch`` chooses a step's requests (the end of a request's queue
  wait the first time it is chosen), ``ContinuousBatchProcessor.update_batch`` takes the step's
  new tokens. One step is that pair (in the asynchronous mode the update of a step follows the
  next step's scheduling: the open steps are a FIFO). Each step is recorded in the engine-step
  ring shared with vLLM (``vllm_engine.EngineStepTracer.record_step``): a request in prefill
  (no token yet) brings its ``query_length`` prompt tokens (a long prompt is split over several
  steps: prefill chunks), a decoding one a token. A request's tokens get the end of their step
  (one clock read per step, one append per request). Finish: the update that finished it,
  ``CBStreamer.cancel`` (abort), ``OutputRouter.fail_and_deliver`` (error ``failed``).

Trace context: the HTTP server span's (``asgi.py``: the caller's ``traceparent``), else a new
trace. Model: the loaded model's ``name_or_path``; operation ``chat`` for ``/chat/`` and
``/responses`` paths, otherwise ``text_completion``.

Requests that wait for the cold start: without a preloaded model (``transformers serve`` without
its model argument) the first request loads the model inside its handler; the load wrapper
(``transformers_serve.py``) stamps the load's start in the request's context, and the request's
timer starts there, so that its wait is its ``cold_start`` segment and its ``llm.request`` links
to ``llm.cold_start``.

Each hook body runs through the instrumentor's ``HookGuard``; transformers' own call always runs
outside it.
"""

from __future__ import annotations

import contextvars
from collections import deque
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, Final

from tokentrace.agent import semconv
from tokentrace.agent.frameworks.asgi import current_http_span
from tokentrace.agent.frameworks.vllm_cold_start import ColdStartTracer
from tokentrace.agent.frameworks.vllm_engine import EngineStepTracer
from tokentrace.agent.hooks import HookGuard
from tokentrace.agent.recorder import PROMPT_TOKEN_IDS, Recorder, RequestTimer
from tokentrace.agent.span_ids import random_span_id_bytes, random_trace_id

__all__ = [
    "COLD_START_ARRIVAL",
    "HOOK_ARRIVAL",
    "HOOK_CB_STEP",
    "HOOK_FINISH",
    "NOT_REPORTED_CONTINUOUS",
    "NOT_REPORTED_PLAIN",
    "NOT_REPORTED_UNSTREAMED",
    "TransformersServeRequestHooks",
]

HOOK_ARRIVAL: Final = "transformers_serve.arrival"
HOOK_FINISH: Final = "transformers_serve.finish"
HOOK_CB_SCHEDULE: Final = "transformers_serve.cb.schedule"
HOOK_CB_STEP: Final = "transformers_serve.cb.step"
_REQUEST_HOOKS: Final = frozenset({HOOK_ARRIVAL, HOOK_FINISH, HOOK_CB_SCHEDULE, HOOK_CB_STEP})
NOT_REPORTED_BY: Final = "transformers serve"
NOT_REPORTED_PLAIN: Final = ("engine steps", "preemption")
"""Plain ``transformers serve``: one ``generate()`` call per request, no steps to show."""
NOT_REPORTED_CONTINUOUS: Final = ("preemption (continuous batching's offloading)",)
NOT_REPORTED_UNSTREAMED: Final = "per-token times (a response that is not streamed)"
COLD_START_ARRIVAL: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "tokentrace_transformers_cold_start_arrival", default=None
)
"""Set in a request's context when its handler starts the server's first model load."""
_PENDING: contextvars.ContextVar[RequestTimer | None] = contextvars.ContextVar(
    "tokentrace_transformers_pending_timer", default=None
)
"""The timer of the request whose generation manager call is running (plain: its streamer and
its submit are made inside that call)."""
_TIMER_KEY: Final = "_tokentrace_timer"
"""Attribute of a ``DirectStreamer`` holding its request's timer."""
_CHAT_PATH_PARTS: Final = ("/chat/", "/responses")
_UNKNOWN_MODEL: Final = "unknown"
_FINISH_STOP: Final = "stop"
_FINISH_LENGTH: Final = "length"
_FINISH_ABORT: Final = "abort"
_ERROR_ABORTED: Final = "aborted"
_ERROR_FAILED: Final = "failed"
_MAX_OPEN_STEPS: Final = 8
"""Scheduled steps awaiting their update: one (two in the asynchronous mode)."""


def _argument(args: tuple[Any, ...], kwargs: Mapping[str, Any], index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs.get(name)


def _finish_reason(output_tokens: int, max_tokens: Any) -> str:
    return (
        _FINISH_LENGTH
        if isinstance(max_tokens, int) and output_tokens >= max_tokens
        else _FINISH_STOP
    )


class TransformersServeRequestHooks:
    """``TransformersServeInstrumentor``'s request and engine-step patches and their bodies."""

    _active: bool
    _guard: HookGuard
    _recorder: Recorder
    _cold_start_tracer: ColdStartTracer | None
    _step_tracer: EngineStepTracer | None
    _open_cb_steps: deque[tuple[int, list[tuple[str, bool, int, bool]], Any]]

    def _requests_disabled(self) -> bool:
        disabled = self._guard.disabled
        return bool(disabled) and not disabled.isdisjoint(_REQUEST_HOOKS)

    # --- arrival (both managers) ---------------------------------------------------------------
    def _wrap_generate_streaming(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        timer = self._arrive(instance, args, kwargs, streamed=True)
        if timer is None:
            return wrapped(*args, **kwargs)
        token = _PENDING.set(timer)
        try:
            return wrapped(*args, **kwargs)
        except BaseException:
            self._guard.run(HOOK_FINISH, self._end_unfinished, timer)
            raise
        finally:
            _PENDING.reset(token)

    def _wrap_generate_non_streaming(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        timer = self._arrive(instance, args, kwargs, streamed=False)
        if timer is None:
            return wrapped(*args, **kwargs)
        token = _PENDING.set(timer)
        try:  # the coroutine is made here; its first step (the submit) runs when awaited
            coroutine = wrapped(*args, **kwargs)
        finally:
            _PENDING.reset(token)
        return self._awaited_unstreamed(coroutine, timer)

    async def _awaited_unstreamed(self, coroutine: Any, timer: RequestTimer) -> Any:
        token = _PENDING.set(timer)
        try:
            result = await coroutine
        except BaseException as exc:
            self._guard.run(HOOK_FINISH, self._end_unfinished, timer, exc)
            raise
        finally:
            _PENDING.reset(token)
        self._guard.run(HOOK_FINISH, self._on_unstreamed_result, timer, result)
        return result

    def _arrive(
        self, manager: Any, args: tuple[Any, ...], kwargs: Any, *, streamed: bool
    ) -> RequestTimer | None:
        if not self._active or self._requests_disabled():
            return None
        result: RequestTimer | None = self._guard.run(
            HOOK_ARRIVAL, self._on_arrival, manager, args, kwargs, streamed
        )
        return result

    def _on_arrival(
        self, manager: Any, args: tuple[Any, ...], kwargs: Any, streamed: bool
    ) -> RequestTimer | None:
        request_id = _argument(args, kwargs, 4, "request_id")
        recorder = self._recorder
        if not isinstance(request_id, str) or recorder.get(request_id) is not None:
            return None  # a request id a client reused while its first request runs
        continuous = hasattr(manager, "_cb")  # CBGenerateManager
        loading_since = COLD_START_ARRIVAL.get()
        timer = recorder.begin(request_id, arrival_ns=loading_since)
        if timer is None:
            return None
        if loading_since is not None:
            COLD_START_ARRIVAL.set(None)
        # The engine's queue starts with the request (after a cold-start wait, the budget's
        # ``queue`` starts where the wait ends: at the ready time).
        timer.queued_ns = timer.arrival_ns
        if self._cold_start_tracer is not None:
            self._cold_start_tracer.on_request(timer)
        http = current_http_span()
        if http is not None:
            timer.trace_id, timer.parent_span_id = http.trace_id, http.span_id
        else:
            timer.trace_id = random_trace_id()
        timer.span_id = random_span_id_bytes()
        timer.prefill_span_id = random_span_id_bytes()
        model = _argument(args, kwargs, 0, "model")
        inputs = _argument(args, kwargs, 2, "inputs")
        gen_config = _argument(args, kwargs, 3, "gen_config")
        attributes = timer.attributes
        attributes["request_id"] = request_id
        attributes["model"] = str(getattr(model, "name_or_path", "") or _UNKNOWN_MODEL)
        attributes["operation"] = (
            semconv.OPERATION_CHAT
            if http is not None and any(part in http.path for part in _CHAT_PATH_PARTS)
            else semconv.OPERATION_TEXT_COMPLETION
        )
        input_ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else None
        if isinstance(input_ids, list):  # continuous batching: a list of ints
            attributes["input_tokens"] = len(input_ids)
            attributes[PROMPT_TOKEN_IDS] = input_ids  # hashed off the serving path
        elif input_ids is not None:  # a (1, n) tensor
            attributes["input_tokens"] = int(input_ids.shape[-1])
        max_tokens = getattr(gen_config, "max_new_tokens", None)
        if max_tokens is not None:
            attributes["max_tokens"] = max_tokens
        if getattr(gen_config, "do_sample", False):
            for name in ("temperature", "top_p"):
                value = getattr(gen_config, name, None)
                if value is not None:
                    attributes[name] = value
        not_reported = NOT_REPORTED_CONTINUOUS if continuous else NOT_REPORTED_PLAIN
        if not streamed and not continuous:
            not_reported = (*not_reported, NOT_REPORTED_UNSTREAMED)
        attributes["not_reported"] = not_reported
        attributes["not_reported_by"] = NOT_REPORTED_BY
        if continuous and self._step_tracer is not None:
            self._step_tracer.track(
                request_id, (timer.trace_id, timer.span_id, timer.prefill_span_id)
            )
        return timer

    def _finish(self, timer: RequestTimer, reason: str | None, *, error: str | None = None) -> None:
        """End ``timer`` unless it has ended (``reason``: its finish reason)."""
        recorder = self._recorder
        if recorder.get(timer.request_id) is not timer:
            return
        attributes = timer.attributes
        if reason is not None:
            attributes["finish_reason"] = reason
        attributes.setdefault("output_tokens", len(timer.token_ns))
        recorder.finish(timer.request_id, status_error=error)

    def _end_unfinished(self, timer: RequestTimer, exc: BaseException | None = None) -> None:
        cancelled = exc is not None and not isinstance(exc, Exception)  # CancelledError et al.
        if cancelled:
            self._finish(timer, _FINISH_ABORT, error=_ERROR_ABORTED)
        else:
            self._finish(timer, None, error=_ERROR_FAILED)

    def _on_unstreamed_result(self, timer: RequestTimer, result: Any) -> None:
        # (text, input length, generated ids): the generated ids are a tensor or a list.
        generated = result[2] if isinstance(result, tuple) and len(result) > 2 else None
        if generated is not None:
            count = len(generated)
            timer.attributes["output_tokens"] = count
            reason = _finish_reason(count, timer.attributes.get("max_tokens"))
        else:
            reason = _FINISH_STOP
        self._finish(timer, reason)

    # --- plain: the inference thread and the streamer --------------------------------------------
    def _wrap_submit(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        timer = _PENDING.get()
        if timer is None or not args or not self._active:
            return wrapped(*args, **kwargs)
        traced = partial(self._run_on_inference_thread, timer, args[0])
        return wrapped(traced, *args[1:], **kwargs)

    def _run_on_inference_thread(
        self, timer: RequestTimer, fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        """The request's generation, on the inference thread: its queue wait ends now."""
        if timer.first_scheduled_ns is None:
            timer.first_scheduled_ns = self._recorder.clock()
        try:
            return fn(*args, **kwargs)
        finally:
            # A streamed request that its streamer neither ended nor cancelled: generate()
            # raised. (An unstreamed one is ended by its coroutine, which gets the result.)
            if _TIMER_KEY in timer.attributes:
                self._guard.run(HOOK_FINISH, self._end_streamed_run, timer)

    def _end_streamed_run(self, timer: RequestTimer) -> None:
        self._finish(timer, None, error=_ERROR_FAILED)

    def _wrap_streamer_init(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        result = wrapped(*args, **kwargs)
        timer = _PENDING.get()
        if timer is not None:
            self._guard.run(HOOK_ARRIVAL, _attach_timer, instance, timer)
        return result

    def _wrap_streamer_put(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        timer = instance.__dict__.get(_TIMER_KEY)
        if timer is None:
            return wrapped(*args, **kwargs)
        # Per token, outside the guard: reads that cannot raise (defaults), an append.
        prompt = getattr(instance, "_first", True)
        before = getattr(instance, "total_tokens", 0)
        result = wrapped(*args, **kwargs)
        if not prompt:
            new_tokens = getattr(instance, "total_tokens", 0) - before
            now_ns = self._recorder.clock()
            if new_tokens == 1:
                timer.token_ns.append(now_ns)
            elif new_tokens > 0:
                timer.token_ns.extend([now_ns] * new_tokens)
        return result

    def _wrap_streamer_end(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        result = wrapped(*args, **kwargs)
        timer = instance.__dict__.get(_TIMER_KEY)
        if timer is not None:
            self._guard.run(HOOK_FINISH, self._on_streamer_end, timer, instance)
        return result

    def _on_streamer_end(self, timer: RequestTimer, streamer: Any) -> None:
        produced = int(streamer.total_tokens)
        timer.attributes["output_tokens"] = produced
        self._finish(timer, _finish_reason(produced, timer.attributes.get("max_tokens")))

    def _wrap_streamer_cancel(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        if self._active:
            self._guard.run(HOOK_FINISH, self._on_cancel, instance)
        return wrapped(*args, **kwargs)

    def _on_cancel(self, streamer: Any) -> None:
        timer = streamer.__dict__.get(_TIMER_KEY)
        if timer is not None:
            # What the client was sent: the inference thread may not have timed the last one.
            timer.attributes["output_tokens"] = int(streamer.total_tokens)
        else:  # a continuous-batching streamer: its request id
            request_id = streamer.__dict__.get("_request_id")
            timer = self._recorder.get(request_id) if isinstance(request_id, str) else None
        if timer is not None:
            self._finish(timer, _FINISH_ABORT, error=_ERROR_ABORTED)

    # --- continuous batching: the engine's steps ------------------------------------------------
    def _wrap_schedule_batch(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        if not self._active or HOOK_CB_SCHEDULE in self._guard.disabled:
            return wrapped(*args, **kwargs)
        start_ns = self._recorder.clock()
        result = wrapped(*args, **kwargs)
        self._guard.run(HOOK_CB_SCHEDULE, self._on_scheduled, instance, result, start_ns)
        return result

    def _on_scheduled(self, scheduler: Any, result: Any, start_ns: int) -> None:
        scheduled = result[0] if isinstance(result, tuple) else None
        if not scheduled:  # None: the cache is full and transformers offloads, then asks again
            return
        get_timer = self._recorder.get
        requests: list[tuple[str, bool, int, bool]] = []
        for future in scheduled:
            state = future.state
            request_id = state.request_id
            # transformers marks a request DECODING when it schedules its last prompt chunk:
            # it is in prefill until it has a token.
            decoding = state.generated_len() > 0
            requests.append((request_id, decoding, int(future.query_length), future.has_new_token))
            timer = get_timer(request_id)
            if timer is not None and timer.first_scheduled_ns is None:
                timer.first_scheduled_ns = start_ns
        opened = self._open_cb_steps
        if len(opened) >= _MAX_OPEN_STEPS:  # updates that never came (an engine error)
            opened.clear()
        opened.append((start_ns, requests, scheduler))

    def _wrap_update_batch(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        result = wrapped(*args, **kwargs)
        if self._active and self._open_cb_steps:
            self._guard.run(HOOK_CB_STEP, self._on_step_done, instance)
        return result

    def _on_step_done(self, processor: Any) -> None:
        start_ns, requests, scheduler = self._open_cb_steps.popleft()
        recorder = self._recorder
        end_ns = recorder.clock()
        get_timer = recorder.get
        active = scheduler.active_requests
        prefill: list[tuple[str, int]] = []
        decode: list[str] = []
        finished: list[tuple[str, RequestTimer | None, Any]] = []
        for request_id, decoding, tokens, has_new_token in requests:
            if decoding:
                decode.append(request_id)
            else:
                prefill.append((request_id, tokens))
            timer = get_timer(request_id)
            if timer is not None and has_new_token:
                timer.token_ns.append(end_ns)
            if request_id not in active:  # the update finished it (or it was cancelled)
                finished.append((request_id, timer, None))
        tracer = self._step_tracer
        if tracer is not None:
            index = tracer.record_step(
                start_ns,
                end_ns,
                prefill,
                decode,
                [request_id for request_id, _, _ in finished],
                kv_cache_usage=_kv_cache_usage(processor),
                waiting=len(scheduler.waiting_requests),
                running=len(active),
            )
            tracer.sweep_unless_held(index, lambda: _held_requests(scheduler))
        for _, timer, _ in finished:
            if timer is not None:
                self._finish(
                    timer, _finish_reason(len(timer.token_ns), timer.attributes.get("max_tokens"))
                )

    def _wrap_fail_and_deliver(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        if self._active and self._recorder.in_flight:
            state = _argument(args, kwargs, 0, "state")
            self._guard.run(HOOK_FINISH, self._on_failed, state)
        return wrapped(*args, **kwargs)

    def _on_failed(self, state: Any) -> None:
        request_id = getattr(state, "request_id", None)
        timer = self._recorder.get(request_id) if isinstance(request_id, str) else None
        if timer is not None:
            self._finish(timer, None, error=_ERROR_FAILED)


def _attach_timer(streamer: Any, timer: RequestTimer) -> None:
    streamer.__dict__[_TIMER_KEY] = timer
    timer.attributes[_TIMER_KEY] = True  # streamed: its streamer ends it


def _kv_cache_usage(processor: Any) -> float:
    free = processor.cache.compute_free_capacity(relative=True)
    return max(0.0, min(1.0, 1.0 - float(free)))


def _held_requests(scheduler: Any) -> set[str]:
    return {*scheduler.active_requests, *scheduler.waiting_requests}
