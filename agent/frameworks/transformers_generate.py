"""Hugging Face transformers ``generate()`` / ``pipeline()`` inside an application: opt-in.

An application that calls ``model.generate(...)`` (or a ``pipeline("text-generation")``, which
calls it) is its own inference server: there is no HTTP request, no queue and no engine loop to
hook. This instrumentation wraps ``GenerationMixin.generate`` and gives each call the spans of a
vLLM request (``llm.request`` with ``llm.queue``, ``llm.prefill``, ``llm.decode``,
``llm.postprocess``), as children of the application's current OpenTelemetry span, so that the
collector computes the same budget, percentiles and verdicts.

Activation is opt-in (``auto_instrument = False``: ``tokentrace run`` leaves it alone, because it
wraps the application's own calls): ``instrument_generate()`` in the application, or
``opentelemetry-instrument`` (the ``transformers_generate`` entry point).

One ``llm.request`` per row: a call with a batch of prompts (or ``num_return_sequences`` > 1)
yields one request per output sequence, as a server would report a batch of requests: each row
has its own prompt length, output length, finish reason and token times, so its TTFT, TPOT and
percentiles mean what they mean for a vLLM user. The rows of one call share everything the call
shares: its arrival, its prefill (one forward pass for the batch) and its end, since ``generate``
returns every row at once - a row that reached its EOS early waits for the rest of the batch in
``llm.postprocess``, which is what the application waited (and the cost of padded batching).

Times, on the calling thread, as integers (``recorder.py``):

- **arrival**: the call's start. **queue**: generate() starts at once, so the request's
  ``queued`` and ``first_scheduled`` are its arrival (a zero ``queue`` segment, and the budget
  stays an exact partition); whatever the application waited before the call (a lock, its own
  queue) is outside the request, in its parent span. ``tokentrace.not_reported`` says so.
- **prefill**: arrival -> the first new token. It includes generate()'s own set-up (generation
  config, logits processors, cache allocation) before the prompt's forward pass.
- **tokens**: a tiny streamer (``TokenClock``) passed to generate(): its ``put`` reads the clock
  once and appends the reading, per decoding step (the first ``put``, the prompt, is kept as a
  reference for the prompt's prefix hash). A caller's own streamer is wrapped: every ``put`` and
  ``end`` reaches it unchanged. generate() hands the streamer each step's tokens on the host,
  after its own per-step stop check has synchronised with the device, so the timing adds one
  small device-to-host copy per step and no extra synchronisation. (On Apple ``mps`` transformers
  defers its stop check and streams each token one step late: the times are a step late there.)
  Assisted generation puts several tokens at once: they share that time.
- **finish**: after generate() returns (or raises), once per call: each row's output length is
  its new tokens up to and including its first EOS (later ones are padding), so its token times
  are the first that many step times; finish reason ``stop`` (an EOS) or ``length``
  (``max_new_tokens`` reached), else not reported (a stop string or custom stopping criterion).
  A call that raises ends every row with an error status; the exception propagates unchanged.
- **model**: the model config's ``_name_or_path``; **operation**: ``text_completion``
  (generate() takes token ids: whether a chat template built them is not known here).

Beam search gets no per-token times (transformers refuses a streamer with ``num_beams`` > 1),
said in ``tokentrace.not_reported``. Not traced: continuous batching
(``cache_implementation="paged"``) and Hub ``custom_generate`` recipes (both untouched, no
spans), a generate() nested in a traced one (an assistant model's drafts belong to the outer
call), and the calls of ``transformers serve`` (its own instrumentation traces those, with
their HTTP server span: a call with one of its streamers, and every call on its inference thread,
since its unstreamed calls pass no streamer). A model
class whose ``generate`` does not reach ``GenerationMixin.generate`` is not traced.

The per-step hot path is one clock read and one list append; the per-call work (row lengths
from one host copy of the new token ids; the request timers) runs once after generate()
returns; spans are built on the agent's emitter thread. Each hook body runs through the
runtime's ``HookGuard``; transformers' own call always runs outside it.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from opentelemetry import trace as otel_trace

from tokentrace.agent import semconv
from tokentrace.agent.frameworks.patching import (
    EngineInstrumentor,
    Patch,
)
from tokentrace.agent.recorder import PROMPT_TOKEN_IDS, Recorder
from tokentrace.agent.span_ids import random_span_id, random_trace_id

__all__ = [
    "HOOK_GENERATE",
    "HOOK_GENERATE_END",
    "HOOK_TOKENS",
    "NOT_REPORTED",
    "NOT_REPORTED_BEAM_SEARCH",
    "NOT_REPORTED_BY",
    "PATCHES",
    "SUPPORTED_VERSIONS",
    "TokenClock",
    "TransformersGenerateInstrumentor",
    "instrument_generate",
]

_log = logging.getLogger(__name__)

SUPPORTED_VERSIONS: Final = ">= 5.19, < 5.25"
"""transformers releases whose ``generate()`` (its arguments, its streamer protocol) this
instrumentation was verified against."""
_DISTRIBUTIONS: Final = ("transformers",)

HOOK_GENERATE: Final = "transformers.generate"
HOOK_GENERATE_END: Final = "transformers.generate.end"
HOOK_TOKENS: Final = "transformers.generate.tokens"
_REQUEST_HOOKS: Final = frozenset({HOOK_GENERATE, HOOK_GENERATE_END, HOOK_TOKENS})
"""A failure in any of them stops tracing generate() (a request without its token times would
mislead)."""

NOT_REPORTED_BY: Final = "transformers generate() (in-process)"
NOT_REPORTED: Final = (
    "queue wait (none in-process: the application's own wait is before the call)",
    "engine steps",
    "preemption",
    "cold start",
)
"""What an in-process generate() cannot tell (``semconv.NOT_REPORTED`` on every request)."""
NOT_REPORTED_BEAM_SEARCH: Final = "per-token times (beam search streams no tokens)"

_PATCHED_MODULE: Final = "transformers.generation.utils"
PATCHES: Final = (Patch(_PATCHED_MODULE, "GenerationMixin.generate", "_wrap_generate"),)
"""Every patch this instrumentation makes."""

_SERVE_PACKAGE: Final = "transformers.cli.serving"
"""``transformers serve``'s code (its streamers among it): only ``transformers serve`` imports it,
and its own instrumentation traces its generate() calls, streamed (a ``DirectStreamer``) or not
(no streamer), with their HTTP server span. A process that imported it is left to that one."""
_PAGED_CACHE: Final = "paged"
_STREAMER_POSITION: Final = 7
"""``streamer``'s position among generate()'s parameters (after ``inputs``, ``generation_config``,
``logits_processor``, ``stopping_criteria``, ``prefix_allowed_tokens_fn``, ``synced_gpus``,
``assistant_model``)."""
_GENERATION_CONFIG_POSITION: Final = 1
_ASSISTANT_MODEL_POSITION: Final = 6
_ASSISTED_SETTINGS: Final = ("prompt_lookup_num_tokens", "assistant_early_exit")
"""Generation settings that make generate() draft tokens, so that a step yields several."""
_UNKNOWN_MODEL: Final = "unknown"
_FINISH_STOP: Final = "stop"
_FINISH_LENGTH: Final = "length"
_REQUEST_ID_PREFIX: Final = "generate"

_inside_generate: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "tokentrace_inside_generate", default=False
)
"""Set while a traced generate() runs: a generate() it calls (an assistant model's) is not a
request of its own."""


def _on_serve_inference_thread() -> bool:
    """Whether this thread is transformers serve's ``InferenceThread``, which runs every
    generate() of the server, streamed or not (the thread's target is its bound ``_run``)."""
    owner = getattr(getattr(threading.current_thread(), "_target", None), "__self__", None)
    return owner is not None and type(owner).__module__.startswith(_SERVE_PACKAGE)


class TokenClock:
    """The streamer generate() is given: one clock read and one append per ``put`` after the
    first (the prompt), then the caller's own streamer, if any, gets the same call unchanged.

    Only assisted generation hands over several tokens in one ``put`` (``several_per_put``):
    only then is the tensor's shape read. Our part never raises into generate(): a failure is
    kept in ``failure`` (reported through the guard after the call) and the times are dropped.
    Attributes it does not have are the caller's streamer's.
    """

    __slots__ = ("_clock", "_several_per_put", "failure", "prompt_ids", "step_ns", "user_streamer")

    def __init__(
        self, clock: Callable[[], int], user_streamer: Any = None, *, several_per_put: bool = False
    ) -> None:
        self._clock = clock
        self._several_per_put = several_per_put
        self.user_streamer = user_streamer
        self.prompt_ids: Any = None
        """The first ``put``'s tensor (the prompt, on the host): read after the call."""
        self.step_ns: list[int] = []
        """One clock reading per new token, in order (tokens of one ``put`` share one)."""
        self.failure: Exception | None = None

    def put(self, value: Any) -> None:
        now = self._clock()
        if self.prompt_ids is None:
            self.prompt_ids = value
        elif not self._several_per_put:
            self.step_ns.append(now)
        else:
            try:
                tokens = int(value.shape[-1]) if value.ndim > 1 else 1
                self.step_ns.extend([now] * tokens)
            except Exception as exc:  # kept: reported through the guard after the call
                self.failure = exc
        if self.user_streamer is not None:
            self.user_streamer.put(value)

    def end(self) -> None:
        if self.user_streamer is not None:
            self.user_streamer.end()

    def __getattr__(self, name: str) -> Any:
        user_streamer = object.__getattribute__(self, "user_streamer")
        if user_streamer is None:
            raise AttributeError(name)
        return getattr(user_streamer, name)


@dataclass(slots=True)
class _Call:
    """One traced generate() call, from its start to its end."""

    arrival_ns: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    clock: TokenClock | None
    trace_id: bytes
    parent_span_id: bytes
    model: str
    generation_config: Any
    not_reported: tuple[str, ...]


class TransformersGenerateInstrumentor(EngineInstrumentor):
    """Traces transformers ``generate()`` calls (and ``pipeline()``'s); ``instrument()`` is
    idempotent and ``uninstrument()`` reverses it.

    ``instrument(recorder=..., guard=...)`` uses the given recorder and guard (tests); without
    them it uses the process's agent runtime, and does nothing when the agent is disabled or
    for an unsupported transformers version (one warning).
    """

    target_module: Final = "transformers"
    """The module whose import ``tokentrace run`` would wait for (it does not: opt-in)."""
    auto_instrument: Final = False
    """``tokentrace run`` skips this instrumentor: it wraps the application's own calls, so the
    application opts in (``instrument_generate()`` or ``opentelemetry-instrument``)."""
    engine = "transformers generate()"
    distributions = _DISTRIBUTIONS
    supported_versions = SUPPORTED_VERSIONS
    patches = PATCHES

    _recorder: Recorder

    def _requests_disabled(self) -> bool:
        disabled = self._guard.disabled
        return bool(disabled) and not disabled.isdisjoint(_REQUEST_HOOKS)

    # --- the wrapper (the application's thread) --------------------------------------------------
    def _wrap_generate(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        if not self._active or _inside_generate.get() or self._requests_disabled():
            return wrapped(*args, **kwargs)
        call: _Call | None = self._guard.run(HOOK_GENERATE, self._begin, instance, args, kwargs)
        if call is None:
            return wrapped(*args, **kwargs)
        inside = _inside_generate.set(True)
        clock = self._recorder.clock
        try:
            result = wrapped(*call.args, **call.kwargs)
        except BaseException as exc:
            end_ns = clock()
            _inside_generate.reset(inside)
            self._guard.run(HOOK_GENERATE_END, self._end, instance, call, None, exc, end_ns)
            raise
        end_ns = clock()  # the application has its rows now; the bookkeeping below is ours
        _inside_generate.reset(inside)
        self._guard.run(HOOK_GENERATE_END, self._end, instance, call, result, None, end_ns)
        return result

    # --- hook bodies -------------------------------------------------------------------------
    def _begin(self, model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Call | None:
        """The call's start and its streamer; None: this call is not traced."""
        arrival_ns = self._recorder.clock()
        user_streamer = (
            args[_STREAMER_POSITION] if len(args) > _STREAMER_POSITION else kwargs.get("streamer")
        )
        if _on_serve_inference_thread() or (
            user_streamer is not None and type(user_streamer).__module__.startswith(_SERVE_PACKAGE)
        ):
            return None  # transformers serve's own call (streamed or not)
        if kwargs.get("cache_implementation") == _PAGED_CACHE or isinstance(
            kwargs.get("custom_generate"), str
        ):
            return None  # continuous batching / a Hub recipe: not generate()'s own loop
        generation_config = (
            args[_GENERATION_CONFIG_POSITION]
            if len(args) > _GENERATION_CONFIG_POSITION
            else kwargs.get("generation_config")
        )
        not_reported: tuple[str, ...] = NOT_REPORTED
        clock: TokenClock | None = None
        if _setting(model, kwargs, generation_config, "num_beams", 1) > 1:
            not_reported = (*NOT_REPORTED, NOT_REPORTED_BEAM_SEARCH)
        else:
            assisted = (
                kwargs.get("assistant_model") is not None
                or (
                    len(args) > _ASSISTANT_MODEL_POSITION
                    and args[_ASSISTANT_MODEL_POSITION] is not None
                )
                or any(
                    _setting(model, kwargs, generation_config, name, None)
                    for name in _ASSISTED_SETTINGS
                )
            )
            clock = TokenClock(self._recorder.clock, user_streamer, several_per_put=bool(assisted))
            if len(args) > _STREAMER_POSITION:
                args = (*args[:_STREAMER_POSITION], clock, *args[_STREAMER_POSITION + 1 :])
            else:
                kwargs = {**kwargs, "streamer": clock}
        span_context = otel_trace.get_current_span().get_span_context()
        if span_context.is_valid:
            trace_id = span_context.trace_id.to_bytes(16, "big")
            parent_span_id = span_context.span_id.to_bytes(8, "big")
        else:
            trace_id, parent_span_id = random_trace_id(), b""
        return _Call(
            arrival_ns=arrival_ns,
            args=args,
            kwargs=kwargs,
            clock=clock,
            trace_id=trace_id,
            parent_span_id=parent_span_id,
            model=_model_name(model),
            generation_config=generation_config,
            not_reported=not_reported,
        )

    def _end(
        self,
        model: Any,
        call: _Call,
        result: Any,
        error: BaseException | None,
        end_ns: int,
    ) -> None:
        """One request per output row, ended at ``end_ns`` (runs once per call, after
        generate())."""
        clock = call.clock
        step_ns: Sequence[int] = ()
        prompt_ids: Any = None
        if clock is not None:
            if clock.failure is not None:
                failure = clock.failure
                self._guard.run(HOOK_TOKENS, _reraise, failure)  # logged, counted, disabled
            else:
                step_ns, prompt_ids = clock.step_ns, clock.prompt_ids
        inputs = _input_ids(call.args, call.kwargs)
        sequences = None if error is not None else _sequences(result)
        rows = _row_count(sequences, prompt_ids, inputs)
        input_tokens = _input_tokens(call.kwargs, inputs, rows)
        lengths, stopped = _output_lengths(model, call, sequences, step_ns, inputs)
        max_new_tokens = _max_new_tokens(model, call, inputs)
        status_error = None if error is None else f"generate() raised {type(error).__name__}"
        hash_prompts = (
            prompt_ids is not None
            and getattr(prompt_ids, "ndim", 0) == 2
            and int(prompt_ids.shape[0]) == rows
            and not _encoder_decoder(model)
        )
        recorder = self._recorder
        call_id = f"{_REQUEST_ID_PREFIX}-{random_span_id():016x}"
        for row in range(rows):
            request_id = f"{call_id}-{row}"
            timer = recorder.begin(request_id, arrival_ns=call.arrival_ns)
            if timer is None:
                return
            timer.queued_ns = timer.first_scheduled_ns = call.arrival_ns
            timer.trace_id, timer.parent_span_id = call.trace_id, call.parent_span_id
            output_tokens = lengths[row] if lengths is not None else None
            if step_ns:
                timer.token_ns = list(step_ns if output_tokens is None else step_ns[:output_tokens])
            attributes = timer.attributes
            attributes["model"] = call.model
            attributes["operation"] = semconv.OPERATION_TEXT_COMPLETION
            attributes["not_reported"] = call.not_reported
            attributes["not_reported_by"] = NOT_REPORTED_BY
            if max_new_tokens is not None:
                attributes["max_tokens"] = max_new_tokens
            prompt_tokens = None if input_tokens is None else input_tokens[row]
            if prompt_tokens is not None:
                attributes["input_tokens"] = prompt_tokens
                if hash_prompts and prompt_tokens > 0:
                    # A reference: the emitter's thread hashes its prefix (left padding cut).
                    attributes[PROMPT_TOKEN_IDS] = prompt_ids[row, -prompt_tokens:]
            if output_tokens is not None:
                attributes["output_tokens"] = output_tokens
                if stopped is not None and stopped[row]:
                    attributes["finish_reason"] = _FINISH_STOP
                elif max_new_tokens is not None and output_tokens >= max_new_tokens:
                    attributes["finish_reason"] = _FINISH_LENGTH
            recorder.finish(request_id, status_error=status_error, end_ns=end_ns)


def _reraise(failure: Exception) -> None:
    raise failure


def _setting(
    model: Any, kwargs: dict[str, Any], generation_config: Any, name: str, default: Any
) -> Any:
    """A generation setting as generate() resolves it: its keyword, else the call's generation
    config, else the model's."""
    value = kwargs.get(name)
    if value is None and generation_config is not None:
        value = getattr(generation_config, name, None)
    if value is None:
        value = getattr(getattr(model, "generation_config", None), name, None)
    return default if value is None else value


def _model_name(model: Any) -> str:
    config = getattr(model, "config", None)
    name = getattr(config, "_name_or_path", None) or getattr(model, "name_or_path", None)
    return str(name) if name else _UNKNOWN_MODEL


def _encoder_decoder(model: Any) -> bool:
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def _input_ids(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The prompt tensor the call was given (``inputs`` or ``input_ids``), or None."""
    inputs = args[0] if args else kwargs.get("inputs")
    if inputs is None:
        inputs = kwargs.get("input_ids")
    return inputs if hasattr(inputs, "shape") and getattr(inputs, "ndim", 0) == 2 else None


def _sequences(result: Any) -> Any:
    """generate()'s output ids: the tensor, or a ``GenerateOutput``'s ``sequences``."""
    sequences = result if hasattr(result, "shape") else getattr(result, "sequences", None)
    return sequences if getattr(sequences, "ndim", 0) == 2 else None


def _row_count(sequences: Any, prompt_ids: Any, inputs: Any) -> int:
    for tensor in (sequences, prompt_ids, inputs):
        if tensor is not None and getattr(tensor, "ndim", 0) == 2:
            return max(int(tensor.shape[0]), 1)
    return 1


def _input_tokens(kwargs: dict[str, Any], inputs: Any, rows: int) -> list[int] | None:
    """Each output row's prompt tokens, padding excluded (the attention mask's ones); rows
    beyond the prompts' (``num_return_sequences``) repeat their prompt's count."""
    mask = kwargs.get("attention_mask")
    if mask is not None and getattr(mask, "ndim", 0) == 2:
        counts = [int(count) for count in mask.sum(-1).tolist()]
    elif inputs is not None:
        counts = [int(inputs.shape[-1])] * int(inputs.shape[0])
    else:
        return None
    if not counts or rows % len(counts):
        return None
    repeat = rows // len(counts)
    return [count for count in counts for _ in range(repeat)]


def _eos_ids(model: Any, call: _Call) -> list[int]:
    eos = _setting(model, call.kwargs, call.generation_config, "eos_token_id", None)
    if eos is None:
        return []
    if hasattr(eos, "tolist"):
        eos = eos.tolist()
    return [int(eos)] if isinstance(eos, int) else [int(token) for token in eos]


def _output_lengths(
    model: Any, call: _Call, sequences: Any, step_ns: Sequence[int], inputs: Any
) -> tuple[list[int] | None, list[bool] | None]:
    """(each row's output tokens, whether it ended with an EOS), or (None, None) unknown.

    A row's output ends at its first EOS: generate() pads the rows that finished while the
    others go on. The new tokens are the last ``len(step_ns)`` columns when they were streamed
    (decoder-only or not), else what follows the prompt (decoder-only models)."""
    if sequences is None:
        return None, None
    if step_ns:
        new_columns = len(step_ns)
    elif inputs is not None and not _encoder_decoder(model):
        new_columns = int(sequences.shape[-1]) - int(inputs.shape[-1])
    else:
        return None, None
    rows = int(sequences.shape[0])
    if new_columns <= 0:
        return [0] * rows, [False] * rows
    new_columns = min(new_columns, int(sequences.shape[-1]))
    eos = _eos_ids(model, call)
    if not eos:
        return [new_columns] * rows, [False] * rows
    # Host lists and list.index (C speed): cheaper than a handful of tensor operations, each
    # of which costs a dispatch, at every size a generate() call takes a noticeable time for.
    lengths: list[int] = []
    stopped: list[bool] = []
    for row in sequences[:, -new_columns:].tolist():
        first_eos = min((_index(row, token) for token in eos), default=new_columns)
        lengths.append(min(first_eos + 1, new_columns))
        stopped.append(first_eos < new_columns)
    return lengths, stopped


def _index(row: list[int], token: int) -> int:
    """Where ``token`` first is in ``row``; ``len(row)`` when it is not."""
    try:
        return row.index(token)
    except ValueError:
        return len(row)


def _max_new_tokens(model: Any, call: _Call, inputs: Any) -> int | None:
    value = _setting(model, call.kwargs, call.generation_config, "max_new_tokens", None)
    if value is not None:
        return int(value)
    max_length = _setting(model, call.kwargs, call.generation_config, "max_length", None)
    if max_length is not None and inputs is not None:
        return max(int(max_length) - int(inputs.shape[-1]), 0)
    return None


def instrument_generate(**options: Any) -> TransformersGenerateInstrumentor:
    """Trace this process's transformers ``generate()`` and ``pipeline()`` calls (idempotent):
    the one line an application adds. ``options`` go to ``instrument()``."""
    instrumentor = TransformersGenerateInstrumentor()
    if not instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.instrument(**options)
    return instrumentor
