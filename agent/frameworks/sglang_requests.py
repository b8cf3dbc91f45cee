"""SGLang's frontend: every request's arrival, queue, tokens and finish, in its TokenizerManager.

SGLang's HTTP server, its ``TokenizerManager`` and the ``handle_loop`` that receives the
detokenizer's outputs share one process (the one the user started). Everything here runs there,
on the asyncio loop, per request and per output batch:

- **arrival** (``TokenizerManager._send_one_request`` / ``_send_batch_request``): the timer
  begins when the tokenised request is handed to the scheduler (tokenisation is part of the
  ``http`` segment, as for vLLM). The trace context is the HTTP server span's (``asgi.py``), or
  the ``traceparent`` of an Engine caller's ``external_trace_header``, or a new trace. The ids of
  ``llm.request`` and ``llm.prefill`` are chosen here and travel to the scheduler inside the
  request's pickled ``time_stats`` (``sglang_scheduler.PARENT_STATE_KEY``), so that the
  scheduler's engine-step, prefill-chunk and retraction spans join the request's tree.
- **tokens** (``TokenizerManager._handle_batch_output``, once per output batch): one clock read
  per batch; each traced request's new tokens (its cumulative ``completion_tokens`` minus the
  tokens timed so far) get that time: when the frontend had them, which is what a client sees,
  less the HTTP write.
- **queue**: the scheduler's own ``wait_queue_entry_time`` (engine arrival) and
  ``forward_entry_time`` (first scheduled), ``time.perf_counter()`` readings (the monotonic clock
  on Linux, shared by the processes of a host). SGLang ships them to the frontend only with
  ``--enable-metrics``; the scheduler hook asks it to ship them with the first output of each
  request (``sglang_scheduler``), so ``llm.queue`` is the scheduler's queue wait either way.
- **finish** (the batch's ``finished_reasons``): ``stop``, ``length`` or ``abort`` (error
  ``aborted``: a client that went away - SGLang's handler then asks the scheduler to abort, and
  the scheduler's abort output ends the request -, an abort request, a request the scheduler
  refused); prompt, completion and cached (radix-cache) tokens from the same batch. A request
  whose handler failed before it reached the scheduler (``_release_req_states_on_failure`` on an
  undispatched state) ends with error ``rejected``. Health-check generations (``HEALTH_CHECK``
  request ids) are not traced.
- **model**: ``TokenizerManager.served_model_name``; **operation**: ``chat`` for requests
  served under a ``/chat/`` path, otherwise ``text_completion``.

``SglangInstrumentor`` mixes ``SglangFrontendHooks`` in; each hook body runs through the
instrumentor's ``HookGuard``, SGLang's own call always outside it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

from tokentrace.agent import semconv
from tokentrace.agent.frameworks.asgi import current_http_span
from tokentrace.agent.frameworks.vllm_cold_start import ColdStartTracer
from tokentrace.agent.frameworks.vllm_engine import engine_parent_header
from tokentrace.agent.hooks import HookGuard
from tokentrace.agent.recorder import PROMPT_TOKEN_IDS, Recorder
from tokentrace.agent.span_ids import parse_traceparent, random_span_id_bytes, random_trace_id

__all__ = [
    "HOOK_ARRIVAL",
    "HOOK_OUTPUTS",
    "HOOK_RELEASE",
    "PARENT_STATE_KEY",
    "SglangFrontendHooks",
]

HOOK_ARRIVAL: Final = "sglang.send_request"
HOOK_OUTPUTS: Final = "sglang.handle_batch_output"
HOOK_RELEASE: Final = "sglang.release_req_states"
_REQUEST_HOOKS: Final = frozenset({HOOK_ARRIVAL, HOOK_OUTPUTS, HOOK_RELEASE})
PARENT_STATE_KEY: Final = "tokentrace_parent"
"""Attribute of a request's ``time_stats`` that carries ``engine_parent_header`` to the scheduler
(the patched ``ReqTimeStatsBase.__getstate__`` adds it to what SGLang pickles)."""
_HEALTH_CHECK_PREFIX: Final = "HEALTH_CHECK"
_CHAT_PATH_PART: Final = "/chat/"
_UNKNOWN_MODEL: Final = "unknown"
_FINISH_ABORT: Final = "abort"
_ERROR_ABORTED: Final = "aborted"
_ERROR_REJECTED: Final = "rejected"
_NS_PER_S: Final = 1_000_000_000


def _seconds_to_ns(value: Any) -> int | None:
    """A scheduler ``perf_counter()`` reading (0.0: never set) in monotonic ns."""
    return int(value * _NS_PER_S) if isinstance(value, float) and value > 0.0 else None


def _finish_reason(reason: Any) -> str | None:
    """SGLang's finish reason (``{"type": "stop" | "length" | "abort", ...}``), or None."""
    if reason is None:
        return None
    if isinstance(reason, Mapping):
        kind = reason.get("type")
        return str(kind) if kind else "stop"
    return str(reason)


class SglangFrontendHooks:
    """``SglangInstrumentor``'s TokenizerManager patches and their hook bodies."""

    _active: bool
    _guard: HookGuard
    _recorder: Recorder
    _cold_start_tracer: ColdStartTracer | None

    def _requests_disabled(self) -> bool:
        disabled = self._guard.disabled
        return bool(disabled) and not disabled.isdisjoint(_REQUEST_HOOKS)

    # --- wrappers (serving path) ---------------------------------------------------------------
    def _wrap_send_one_request(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        if self._active and not self._requests_disabled():
            tokenized = args[0] if args else kwargs["tokenized_obj"]
            self._guard.run(HOOK_ARRIVAL, self._on_arrivals, instance, (tokenized,))
        return wrapped(*args, **kwargs)

    def _wrap_send_batch_request(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        if self._active and not self._requests_disabled():
            tokenized = args[0] if args else kwargs["tokenized_objs"]
            self._guard.run(HOOK_ARRIVAL, self._on_arrivals, instance, tokenized)
        return wrapped(*args, **kwargs)

    def _wrap_handle_batch_output(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        # A coroutine function: SGLang deletes a finished request's state inside it, so the
        # traced requests are read before it runs (it has not unpickled anything yet).
        if self._active and self._recorder.in_flight and not self._requests_disabled():
            output = args[0] if args else kwargs["recv_obj"]
            self._guard.run(HOOK_OUTPUTS, self._on_outputs, output)
        return wrapped(*args, **kwargs)

    def _wrap_release_req_states(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        if self._active and self._recorder.in_flight and not self._requests_disabled():
            states = args[0] if args else kwargs["request_states"]
            self._guard.run(HOOK_RELEASE, self._on_release, states)
        return wrapped(*args, **kwargs)

    # --- hook bodies ----------------------------------------------------------------------------
    def _on_arrivals(self, manager: Any, tokenized_objs: Iterable[Any]) -> None:
        recorder = self._recorder
        http = current_http_span()
        for tokenized in tokenized_objs:
            rid = tokenized.rid
            if not isinstance(rid, str) or rid.startswith(_HEALTH_CHECK_PREFIX):
                continue
            if recorder.get(rid) is not None:
                continue
            timer = recorder.begin(rid)
            if timer is None:
                return
            if self._cold_start_tracer is not None:
                self._cold_start_tracer.on_request(timer)
            context = None
            if http is not None:
                context = http.trace_id, http.span_id
            else:
                headers = _external_trace_header(manager, tokenized)
                if isinstance(headers, Mapping) and (parent := headers.get("traceparent")):
                    context = parse_traceparent(parent)
            if context is None:
                timer.trace_id = random_trace_id()
            else:
                timer.trace_id, timer.parent_span_id = context
            timer.span_id = random_span_id_bytes()
            timer.prefill_span_id = random_span_id_bytes()
            time_stats = getattr(tokenized, "time_stats", None)
            if time_stats is not None:
                setattr(
                    time_stats,
                    PARENT_STATE_KEY,
                    engine_parent_header(timer.trace_id, timer.span_id, timer.prefill_span_id),
                )
            attributes = timer.attributes
            attributes["request_id"] = rid
            attributes["model"] = str(getattr(manager, "served_model_name", "") or _UNKNOWN_MODEL)
            attributes["operation"] = (
                semconv.OPERATION_CHAT
                if http is not None and _CHAT_PATH_PART in http.path
                else semconv.OPERATION_TEXT_COMPLETION
            )
            input_ids = getattr(tokenized, "input_ids", None)
            if input_ids is not None:
                attributes["input_tokens"] = len(input_ids)
                attributes[PROMPT_TOKEN_IDS] = input_ids  # hashed off the serving path
            sampling = getattr(tokenized, "sampling_params", None)
            for name, field in (
                ("max_tokens", "max_new_tokens"),
                ("temperature", "temperature"),
                ("top_p", "top_p"),
            ):
                value = getattr(sampling, field, None)
                if value is not None:
                    attributes[name] = value

    def _on_outputs(self, output: Any) -> None:
        recorder = self._recorder
        get_timer = recorder.get
        rids = output.rids
        traced = [(i, timer) for i, rid in enumerate(rids) if (timer := get_timer(rid)) is not None]
        if not traced:
            return
        now_ns = recorder.clock()
        completion = getattr(output, "completion_tokens", None)
        reasons = output.finished_reasons
        time_stats = None
        for i, timer in traced:
            if timer.first_scheduled_ns is None:
                if time_stats is None:
                    time_stats = _unpickled_time_stats(output)
                if time_stats:
                    stats = time_stats[i]
                    timer.queued_ns = _seconds_to_ns(getattr(stats, "wait_queue_entry_time", 0.0))
                    timer.first_scheduled_ns = _seconds_to_ns(
                        getattr(stats, "forward_entry_time", 0.0)
                    )
            if completion is not None:
                new_tokens = completion[i] - len(timer.token_ns)
                if new_tokens == 1:
                    timer.token_ns.append(now_ns)
                elif new_tokens > 0:
                    timer.token_ns.extend([now_ns] * new_tokens)
            reason = _finish_reason(reasons[i])
            if reason is not None:
                attributes = timer.attributes
                attributes["finish_reason"] = reason
                attributes["output_tokens"] = len(timer.token_ns)
                attributes["input_tokens"] = output.prompt_tokens[i]
                cached = getattr(output, "cached_tokens", None)
                if cached is not None:
                    attributes["cached_tokens"] = cached[i]
                recorder.finish(
                    timer.request_id,
                    status_error=_ERROR_ABORTED if reason == _FINISH_ABORT else None,
                )

    def _on_release(self, states: Mapping[str, Any]) -> None:
        # A dispatched request is aborted in the scheduler, whose abort output ends it (with
        # ``finish_reason`` abort); one that never reached the scheduler ends here.
        for rid, state in list(states.items()):
            if not getattr(state, "dispatched", False) and self._recorder.get(rid) is not None:
                self._recorder.finish(rid, status_error=_ERROR_REJECTED)


def _external_trace_header(manager: Any, tokenized: Any) -> Any:
    """An Engine caller's ``external_trace_header``: SGLang's tokenised request has no such
    field; the request object the TokenizerManager keeps per rid (``ReqState.obj``) has it."""
    headers = getattr(tokenized, "external_trace_header", None)
    if headers is None:
        states = getattr(manager, "rid_to_state", None)
        state = states.get(tokenized.rid) if isinstance(states, Mapping) else None
        headers = getattr(getattr(state, "obj", None), "external_trace_header", None)
    return headers


def _unpickled_time_stats(output: Any) -> list[Any] | None:
    """The batch's scheduler time stats, unpickled once (SGLang unpickles them itself right
    after; the wrapper of ``PickleWrapper`` then finds a list and leaves it)."""
    from sglang.srt.managers.io_struct import unwrap_from_pickle  # SGLang's own, present here

    stats = unwrap_from_pickle(output.time_stats)
    output.time_stats = stats
    return stats if isinstance(stats, list) else None
