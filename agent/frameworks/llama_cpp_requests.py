"""llama-cpp-python's server: every request's arrival, queue wait, prefill, tokens and finish.

The server (``llama_cpp/server/app.py``) serves one request at a time: a completion or chat
request takes two ``anyio`` locks (``get_llama_proxy``: ``llama_outer_lock``, then
``llama_inner_lock``) before it touches the model and holds the inner one until its response is
complete, so its queue is real and, under concurrency, long. Everything the model computes for a
request then runs in a worker thread while that request holds the lock, so the request being
served is simply the one that holds it (``_serving``): the compute hooks need no request ids.

- **arrival** and **queue** (``get_llama_proxy``, on the asyncio loop): the timer begins when the
  request asks for the model lock (after FastAPI parsed and validated the body: that is the
  ``http`` segment); ``llm.queue`` is that instant -> the lock acquired. ``requests_ahead``: the
  requests that were already waiting for the lock; ``running_at_arrival``: 1 when one held it
  (``max_running`` is 1). The trace context is the HTTP server span's (``asgi.py``).
- **prefill** (the lock acquired -> the first token): the chat template, tokenisation and the
  prompt's evaluation. ``Llama.generate`` gives the prompt tokens; its first ``Llama.eval`` call
  evaluates what neither the previous request's context (``generate``'s longest-prefix reuse) nor
  the prompt cache (``--cache``, ``LlamaRAMCache``) held, so ``cached_tokens`` = prompt tokens -
  the tokens that eval computed. Each ``LlamaContext.decode`` inside that eval (``n_batch``
  tokens at most) is one ``llm.prefill.chunk``.
- **tokens** (``Llama.generate``'s generator): one clock read and one list append per token, as
  the model yields it (end-of-generation tokens, which no client sees, are not counted).
- **finish** (``Llama._create_completion``'s chunks, and the lock's release): the finish reason of
  the last chunk (``stop`` or ``length``) and, unstreamed, the usage counts; the request ends when
  it releases the lock. A request cancelled while it held the lock ends with finish reason
  ``abort``: error ``interrupted by a newer request (interrupt_requests)`` when the server's
  ``interrupt_requests`` setting cut its stream because another request was waiting (the client
  then sees ``[DONE]`` after fewer tokens than it asked for, and no finish reason), else error
  ``aborted`` (the client went away). One cancelled while it waited for the lock ends with error
  ``aborted`` in ``queue``. Any other exception (the server answers with an error) ends it with
  the exception's type as its error and no finish reason.
- **model**: the served model's alias (``LlamaProxy``); **operation**: ``chat`` for requests
  served under a ``/chat/`` path, otherwise ``text_completion``; **request id**: the response's
  ``id`` (``cmpl-...``).

Requests that take the lock through FastAPI's ``Depends`` (embeddings, tokenize, models) bind
the original ``get_llama_proxy`` when the routes are defined and are not traced as LLM requests;
compute outside a traced request is not recorded. ``LlamaCppInstrumentor`` mixes
``LlamaCppRequestHooks`` in; each hook body runs through its ``HookGuard``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any, Final

from tokentrace.agent import semconv
from tokentrace.agent.frameworks.asgi import current_http_span
from tokentrace.agent.frameworks.vllm_cold_start import ColdStartTracer
from tokentrace.agent.hooks import HookGuard
from tokentrace.agent.recorder import PROMPT_TOKEN_IDS, Recorder, RequestTimer
from tokentrace.agent.span_ids import random_span_id_bytes, random_trace_id

__all__ = [
    "ERROR_ABORTED",
    "ERROR_INTERRUPTED",
    "FINISH_ABORT",
    "HOOK_COMPLETION",
    "HOOK_DECODE",
    "HOOK_EVAL",
    "HOOK_GENERATE",
    "HOOK_LOCK",
    "MAX_RUNNING",
    "NOT_REPORTED",
    "NOT_REPORTED_BY",
    "LlamaCppRequestHooks",
]

HOOK_LOCK: Final = "llama_cpp.get_llama_proxy"
HOOK_COMPLETION: Final = "llama_cpp.create_completion"
HOOK_GENERATE: Final = "llama_cpp.generate"
HOOK_EVAL: Final = "llama_cpp.eval"
HOOK_DECODE: Final = "llama_cpp.decode"
_REQUEST_HOOKS: Final = frozenset(
    {HOOK_LOCK, HOOK_COMPLETION, HOOK_GENERATE, HOOK_EVAL, HOOK_DECODE}
)
MAX_RUNNING: Final = 1
"""The server computes one request at a time (its model lock)."""
FINISH_ABORT: Final = "abort"
ERROR_ABORTED: Final = "aborted"
ERROR_INTERRUPTED: Final = "interrupted by a newer request (interrupt_requests)"
NOT_REPORTED: Final = ("engine steps",)
"""What this instrumentation cannot tell (``semconv.NOT_REPORTED``): llama.cpp runs one request
at a time, each token in its own ``llama_decode`` call; no engine-step spans are exported."""
NOT_REPORTED_BY: Final = "llama-cpp-python's server"
_CHAT_PATH_PART: Final = "/chat/"
_UNKNOWN_MODEL: Final = "unknown"
_SAMPLING_FIELDS: Final = (
    ("max_tokens", "max_tokens"),
    ("temperature", "temperature"),
    ("top_p", "top_p"),
)


class _Served:
    """What the compute hooks know of the request that holds the model lock."""

    __slots__ = ("in_prefill", "prefill_pending", "timer")

    def __init__(self, timer: RequestTimer) -> None:
        self.timer = timer
        self.prefill_pending = False
        """``generate`` started: its next ``eval`` is the prompt's."""
        self.in_prefill = False
        """That eval is running: each ``decode`` is one prefill chunk."""


class LlamaCppRequestHooks:
    """``LlamaCppInstrumentor``'s request patches and their hook bodies."""

    _active: bool
    _guard: HookGuard
    _recorder: Recorder
    _cold_start_tracer: ColdStartTracer | None
    _serving: _Served | None
    _waiting: int
    _request_count: int

    def _requests_disabled(self) -> bool:
        disabled = self._guard.disabled
        return bool(disabled) and not disabled.isdisjoint(_REQUEST_HOOKS)

    # --- the model lock (asyncio loop) ----------------------------------------------------------
    def _wrap_get_llama_proxy(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        if not self._active or self._requests_disabled():
            return wrapped(*args, **kwargs)
        timer = self._guard.run(HOOK_LOCK, self._on_arrival)
        if timer is None:
            return wrapped(*args, **kwargs)
        return self._traced_lock(
            wrapped(*args, **kwargs), timer, getattr(wrapped, "__globals__", {})
        )

    async def _traced_lock(
        self, locking: Any, timer: RequestTimer, app_globals: Mapping[str, Any]
    ) -> AsyncIterator[Any]:
        """``get_llama_proxy``'s async generator, timed: its first step waits for the locks, its
        second releases them."""
        guard = self._guard
        try:
            proxy = await locking.__anext__()
        except BaseException as exc:  # cancelled while queued (the client went away)
            guard.run(HOOK_LOCK, self._on_not_served, timer, exc)
            raise
        guard.run(HOOK_LOCK, self._on_lock_acquired, timer)
        try:
            yield proxy
        except BaseException as exc:
            guard.run(HOOK_LOCK, self._on_end, timer, proxy, exc, app_globals)
            with contextlib.suppress(StopAsyncIteration):
                await locking.athrow(exc)  # releases the locks and re-raises ``exc``
            raise
        guard.run(HOOK_LOCK, self._on_end, timer, proxy, None, app_globals)
        with contextlib.suppress(StopAsyncIteration):
            await locking.__anext__()  # releases the locks

    def _on_arrival(self) -> RequestTimer | None:
        recorder = self._recorder
        self._request_count += 1
        timer = recorder.begin(f"llamacpp-{self._request_count}")
        if timer is None:
            return None
        timer.queued_ns = timer.arrival_ns
        if self._cold_start_tracer is not None:
            self._cold_start_tracer.on_request(timer)
        http = current_http_span()
        if http is None:
            timer.trace_id = random_trace_id()
        else:
            timer.trace_id, timer.parent_span_id = http.trace_id, http.span_id
        timer.span_id = random_span_id_bytes()
        attributes = timer.attributes
        attributes["request_id"] = timer.request_id
        attributes["operation"] = (
            semconv.OPERATION_CHAT
            if http is not None and _CHAT_PATH_PART in http.path
            else semconv.OPERATION_TEXT_COMPLETION
        )
        attributes["requests_ahead"] = self._waiting
        attributes["running_at_arrival"] = 0 if self._serving is None else 1
        attributes["max_running"] = MAX_RUNNING
        attributes["not_reported"] = NOT_REPORTED
        attributes["not_reported_by"] = NOT_REPORTED_BY
        self._waiting += 1
        return timer

    def _on_lock_acquired(self, timer: RequestTimer) -> None:
        timer.first_scheduled_ns = self._recorder.clock()
        self._waiting = max(self._waiting - 1, 0)
        self._serving = _Served(timer)

    def _on_not_served(self, timer: RequestTimer, exc: BaseException) -> None:
        self._waiting = max(self._waiting - 1, 0)
        timer.attributes["finish_reason"] = FINISH_ABORT
        self._recorder.finish(timer.request_id, status_error=_error_of(exc))

    def _on_end(
        self,
        timer: RequestTimer,
        proxy: Any,
        exc: BaseException | None,
        app_globals: Mapping[str, Any],
    ) -> None:
        served = self._serving
        if served is not None and served.timer is timer:
            self._serving = None
        attributes = timer.attributes
        attributes["model"] = str(getattr(proxy, "_current_model_alias", None) or _UNKNOWN_MODEL)
        attributes.setdefault("output_tokens", len(timer.token_ns))
        status_error = None
        if exc is not None and _is_cancellation(exc):
            attributes["finish_reason"] = FINISH_ABORT
            status_error = ERROR_INTERRUPTED if _interrupted(app_globals) else ERROR_ABORTED
        elif exc is not None:  # the server answers with an error (e.g. a prompt over n_ctx)
            status_error = type(exc).__name__
        self._recorder.finish(timer.request_id, status_error=status_error)

    # --- compute (worker threads, while the request holds the lock) ------------------------------
    def _wrap_create_completion(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        served = self._serving
        if served is None or not self._active or self._requests_disabled():
            return wrapped(*args, **kwargs)
        self._guard.run(HOOK_COMPLETION, _on_completion_args, served.timer, kwargs)
        return self._completion_chunks(wrapped(*args, **kwargs), served.timer)

    def _completion_chunks(self, chunks: Iterator[Any], timer: RequestTimer) -> Iterator[Any]:
        """``_create_completion``'s generator, reading the finish reason (and, unstreamed, the
        usage) off its chunks."""
        guard = self._guard
        first = True
        try:
            for chunk in chunks:
                if first:
                    first = False
                    guard.run(HOOK_COMPLETION, _on_first_chunk, timer, chunk)
                try:
                    choice = chunk["choices"][0]
                    reason = choice.get("finish_reason")
                except Exception:  # not a completion chunk: nothing to read
                    reason = None
                if reason is not None:
                    guard.run(HOOK_COMPLETION, _on_finish_chunk, timer, reason, chunk)
                yield chunk
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()

    def _wrap_generate(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        served = self._serving
        if served is None or not self._active or self._requests_disabled():
            return wrapped(*args, **kwargs)
        tokens = args[0] if args else kwargs.get("tokens")
        is_eog = self._guard.run(HOOK_GENERATE, _on_generate, served, instance, tokens)
        if is_eog is None:
            return wrapped(*args, **kwargs)
        return _timed_tokens(wrapped(*args, **kwargs), served.timer, self._recorder.clock, is_eog)

    def _wrap_eval(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        served = self._serving
        if served is None or not served.prefill_pending:
            return wrapped(*args, **kwargs)
        served.prefill_pending = False
        tokens = args[0] if args else kwargs.get("tokens")
        self._guard.run(HOOK_EVAL, _on_prompt_eval, served.timer, tokens)
        served.in_prefill = True
        try:
            return wrapped(*args, **kwargs)
        finally:
            served.in_prefill = False

    def _wrap_decode(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        served = self._serving
        if served is None or not served.in_prefill:
            return wrapped(*args, **kwargs)
        clock = self._recorder.clock
        start = clock()
        result = wrapped(*args, **kwargs)
        end = clock()
        batch = args[0] if args else kwargs.get("batch")
        self._guard.run(HOOK_DECODE, _on_prefill_chunk, served.timer, batch, start, end)
        return result


def _timed_tokens(
    tokens: Any, timer: RequestTimer, clock: Callable[[], int], is_eog: Callable[[int], bool]
) -> Iterator[int]:
    """``Llama.generate``'s generator (values sent in are passed on): one clock read and one
    append per token the client will see."""
    append = timer.token_ns.append
    sent = None
    try:
        while True:
            try:
                token = tokens.send(sent)
            except StopIteration:
                return
            if not is_eog(token):
                append(clock())
            sent = yield token
    finally:
        tokens.close()


def _on_generate(served: _Served, llama: Any, tokens: Any) -> Callable[[int], bool]:
    """``generate`` begins: the prompt's size and ids; its next eval is the prompt's. Returns the
    end-of-generation test for its tokens."""
    served.prefill_pending = True
    attributes = served.timer.attributes
    if tokens is not None:
        attributes["input_tokens"] = len(tokens)
        attributes[PROMPT_TOKEN_IDS] = tokens  # hashed off the serving path
    import llama_cpp  # present: this hook runs inside its generate

    vocab = llama._model.vocab
    vocab_is_eog = llama_cpp.llama_vocab_is_eog

    def is_eog(token: int) -> bool:
        return bool(vocab_is_eog(vocab, token))

    return is_eog


def _on_prompt_eval(timer: RequestTimer, tokens: Any) -> None:
    input_tokens = timer.attributes.get("input_tokens")
    if isinstance(input_tokens, int) and tokens is not None:
        timer.attributes["cached_tokens"] = max(input_tokens - len(tokens), 0)


def _on_prefill_chunk(timer: RequestTimer, batch: Any, start: int, end: int) -> None:
    count = batch.n_tokens() if batch is not None else 0
    if count > 0:
        timer.prefill_chunks.append((start, end, int(count)))


def _on_completion_args(timer: RequestTimer, kwargs: Mapping[str, Any]) -> None:
    attributes = timer.attributes
    for name, field in _SAMPLING_FIELDS:
        value = kwargs.get(field)
        if value is not None:
            attributes[name] = value


def _on_first_chunk(timer: RequestTimer, chunk: Mapping[str, Any]) -> None:
    """The response's id (``cmpl-...``; a chat response's is ``chat`` + it), for the request id."""
    response_id = chunk.get("id")
    if isinstance(response_id, str) and response_id:
        timer.attributes["request_id"] = response_id


def _on_finish_chunk(timer: RequestTimer, reason: Any, chunk: Mapping[str, Any]) -> None:
    attributes = timer.attributes
    attributes["finish_reason"] = str(reason)
    usage = chunk.get("usage")
    if isinstance(usage, Mapping):  # unstreamed: the server's own counts
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(prompt, int):
            attributes["input_tokens"] = prompt
        if isinstance(completion, int):
            attributes["output_tokens"] = completion


def _is_cancellation(exc: BaseException) -> bool:
    import anyio  # the server's own dependency, present here

    return isinstance(exc, anyio.get_cancelled_exc_class())


def _interrupted(app_globals: Mapping[str, Any]) -> bool:
    """The server's ``interrupt_requests`` cut the stream: it does that exactly when another
    request waits for the model (``llama_outer_lock`` held)."""
    settings = app_globals.get("_server_settings")
    outer = app_globals.get("llama_outer_lock")
    return bool(getattr(settings, "interrupt_requests", False)) and bool(
        outer is not None and outer.locked()
    )


def _error_of(exc: BaseException) -> str:
    return ERROR_ABORTED if _is_cancellation(exc) else type(exc).__name__
