"""vLLM's EngineCore process: every scheduler iteration in a ring buffer, exported when it matters.

The frontend (``vllm.py``) sees tokens, not batches. This half runs in the EngineCore process,
where the scheduler decides each step's batch, and answers what the frontend cannot: which other
requests shared the step that made a token late, and how much prefill they brought.

- **a step** is one ``Scheduler.schedule`` -> ``Scheduler.update_from_output`` pair (both the
  plain and the batch-queue busy loops call them once per step). The schedule patch only
  reads one clock before scheduling; the update patch reads the rest from the same
  ``SchedulerOutput``. Where ``_steps.c`` is built both patches are C functions that do the
  tracer's per-step work themselves (``native_hook``), else Python ones calling
  ``on_scheduled`` / ``on_step_done``. The update records the step in each request it
  prefilled (a request is first seen, and tracked, in its first prefill step), finds the
  requests it finished in their outputs, closes the step at the timestamp vLLM stamps on the
  step's outputs (the very timestamp the frontend gives the step's tokens) and stores one tuple
  in a fixed-size ring buffer (``TOKENTRACE_ENGINE_STEPS``): start, end, prefill/decode requests
  and tokens (vLLM's own split: a request without output tokens yet is in prefill), KV-cache
  usage, waiting and running requests, the batch (vLLM's own dict of the step's scheduled
  tokens, held, not copied) and its prefill set. A decoding request costs the step nothing but
  the read of its output's finish reason.
- **a finished request** (its output carries a finish reason) is handed to the emitter's thread
  as a deferred job: there its token steps (the ring's steps from its first to its last that
  scheduled it outside their prefill set) give its inter-token gaps, every gap above
  ``TOKENTRACE_ITL_OUTLIER_RATIO`` x its median gap is an outlier, and the steps inside each
  outlier gap still in the ring become ``llm.engine.step`` spans under the request's
  ``llm.request`` (at most ``_MAX_OUTLIER_STEPS`` per request, from the largest gaps first).
  A request prefilled in more than one step also gets one ``llm.prefill.chunk`` span per step
  under its ``llm.prefill``. The collector counts the outlier steps that carried prefill.
- **sampled steps**: ``TOKENTRACE_STEP_SAMPLE_RATE`` of all steps are also exported on their
  own (each the root of its own trace), for a view of the engine that does not depend on slow
  requests.
- **trace context**: the frontend chooses the ``llm.request`` and ``llm.prefill`` span ids in
  advance and passes them with the trace id in the request's ``trace_headers`` (which vLLM
  ships to EngineCore) under ``ENGINE_PARENT_HEADER``. A request without it (traced by no
  frontend) is counted in steps but never tracked.

Clock: EngineCore's ``time.monotonic()``, the domain of the frontend's token times too; the
emitter converts to Unix time with the runtime's ``MonotonicToUnix``. Requests aborted inside the
engine never show a finish reason here: their step lists are dropped by a sweep every
``_SWEEP_EVERY_STEPS`` steps, so the table stays bounded by the requests the scheduler holds.
"""

from __future__ import annotations

import logging
import operator
import os
import random
import time
from collections.abc import Callable, Collection, Sequence, Set
from dataclasses import dataclass, field
from functools import partial
from itertools import compress
from typing import Any, Final, NamedTuple, TypeAlias

from tokentrace.agent import compiled, semconv
from tokentrace.agent.finished_request import (
    DEFAULT_ITL_OUTLIER_RATIO,
    MIN_GAPS_FOR_OUTLIERS,
    gap_median,
)
from tokentrace.agent.hooks import HookGuard
from tokentrace.agent.recorder import MonotonicToUnix
from tokentrace.agent.span_ids import (
    SPAN_ID_BYTES,
    TRACE_ID_BYTES,
    format_ids,
    parse_ids,
    random_trace_id,
)
from tokentrace.agent.spans import KIND_INTERNAL, AttrValue, PlannedSpan, SpanJob

__all__ = [
    "ENGINE_PARENT_HEADER",
    "EVENT_PREEMPTED",
    "EVENT_QUEUED",
    "EVENT_SCHEDULED",
    "HOOK_STEP_DONE",
    "HOOK_STEP_SCHEDULED",
    "EngineStepTracer",
    "StepRecord",
    "engine_parent_header",
    "outlier_gap_ends",
    "outlier_gap_ends_python",
    "parse_engine_parent",
]

_log = logging.getLogger(__name__)

ENGINE_PARENT_HEADER: Final = "x-tokentrace-parent"
"""``trace_headers`` key: ``<trace id>-<llm.request span id>-<llm.prefill span id>`` in hex."""
HOOK_STEP_SCHEDULED: Final = "vllm.engine.schedule"
HOOK_STEP_DONE: Final = "vllm.engine.update_from_output"

_DEFAULT_RING_STEPS: Final = 4096
_DEFAULT_SAMPLE_RATE: Final = 0.01
_DEFAULT_OUTLIER_RATIO: Final = DEFAULT_ITL_OUTLIER_RATIO
_MAX_OUTLIER_STEPS: Final = 32
"""Engine step spans per request at most: a pathological request cannot flood the exporter."""
_SWEEP_EVERY_STEPS: Final = 1024
_MAX_OPEN_STEPS: Final = 64
"""Scheduled steps awaiting their update; vLLM has at most its batch queue's size (1-2)."""
_NS_PER_S: Final = 1_000_000_000
# vLLM's EngineCoreEventType values: EngineCore's scheduler events, which the frontend reads
# too (a real-vLLM test checks them).
EVENT_QUEUED: Final = 1
EVENT_SCHEDULED: Final = 2
EVENT_PREEMPTED: Final = 3


class StepRecord(NamedTuple):
    """One engine step (monotonic ns)."""

    number: int
    """The step's position in the engine's sequence of steps (0, 1, ...)."""
    start_ns: int
    end_ns: int
    prefill_requests: int
    decode_requests: int
    prefill_tokens: int
    decode_tokens: int
    kv_cache_usage: float
    waiting: int
    running: int
    request_ids: Collection[str]
    """The batch's requests in the engine's order. From vLLM, its step's own
    ``num_scheduled_tokens`` (request id -> tokens), held as it is: not copied per step, and a
    request's membership is one lookup when its token steps are found
    (``token_step_ends_python``)."""
    prefill_ids: Collection[str]
    """Those of ``request_ids`` that the step prefilled (vLLM's own split)."""


@dataclass(slots=True)
class _TrackedRequest:
    trace_id: bytes
    request_span_id: bytes
    prefill_span_id: bytes
    first_scheduled_ns: int | None
    """vLLM's SCHEDULED event time (the start of the frontend's ``llm.prefill``), when known."""
    prefill_steps: list[tuple[int, int]] = field(default_factory=list)
    """(step index, prompt tokens) per step that computed part of the prompt."""
    decode_steps: list[int] = field(default_factory=list)
    """The steps that gave it a token, from engines that name them per step (``record_step``);
    vLLM's are found in the ring when it finishes (``first_step``)."""
    request_id: str = ""
    first_step: int | None = None
    """vLLM: the step it was first seen in. Its token steps are the ring's steps from there to
    its last that scheduled it outside their prefill set: no per-request work per step."""
    last_step: int | None = None
    """The step that finished it."""
    preempted: list[tuple[int, int]] = field(default_factory=list)
    """Intervals the engine had evicted the request, from engines whose frontend cannot see them
    (SGLang's retractions); vLLM's frontend reads its preemptions from the scheduler events."""
    preempted_since_ns: int | None = None


def engine_parent_header(trace_id: bytes, request_span_id: bytes, prefill_span_id: bytes) -> str:
    return format_ids(trace_id, request_span_id, prefill_span_id)


def parse_engine_parent(value: object) -> tuple[bytes, bytes, bytes] | None:
    """(trace id, request span id, prefill span id) of an ``ENGINE_PARENT_HEADER`` value."""
    ids = parse_ids(value, TRACE_ID_BYTES, SPAN_ID_BYTES, SPAN_ID_BYTES)
    if ids is None:
        return None
    trace_id, request_span_id, prefill_span_id = ids
    if not (any(trace_id) and any(request_span_id) and any(prefill_span_id)):  # all-zero ids
        return None  # are invalid (no generator: once per request in EngineCore's busy loop)
    return trace_id, request_span_id, prefill_span_id


def outlier_gap_ends(token_step_ends: Sequence[tuple[int, int]], ratio: float) -> list[int]:
    """Positions ``i`` (>= 1) in ``token_step_ends`` ((step index, end ns) of each step that gave
    the request a token, in order) whose gap from ``i - 1`` exceeds ``ratio`` x the median gap:
    ``outlier_gap_ends_python``'s answer, in C where built (``_steps.outlier_gap_ends``: per
    token, on the emitter's thread, for every finished request)."""
    if _OUTLIER_GAP_ENDS is not None:
        positions = _OUTLIER_GAP_ENDS(token_step_ends, ratio, MIN_GAPS_FOR_OUTLIERS)
        if positions is not None:
            return positions
    return outlier_gap_ends_python(token_step_ends, ratio)


def outlier_gap_ends_python(token_step_ends: Sequence[tuple[int, int]], ratio: float) -> list[int]:
    """``outlier_gap_ends``' twin."""
    gaps = [
        token_step_ends[i][1] - token_step_ends[i - 1][1] for i in range(1, len(token_step_ends))
    ]
    median = gap_median(gaps)
    if median is None:
        return []
    threshold = ratio * median
    return [i + 1 for i, gap in enumerate(gaps) if gap > threshold]


def token_step_ends_python(
    ring: Sequence[StepRecord | None],
    first: int,
    last: int,
    request_id: str,
    prefill_step: int | None,
) -> list[tuple[int, int]]:
    """(step index, end ns) of the steps that gave a vLLM request a token: the ring's steps from
    ``first`` to ``last`` that scheduled it outside their prefill set, with ``prefill_step`` (its
    last prefill step) among them, in step order. Steps already overwritten in the ring are left
    out of the walk (the oldest: those found still follow one another); a prefill step gone from
    the ring clears the ends before it (gaps across it would be wrong)."""
    size = len(ring)
    token_steps = []
    for index in range(max(first, last - size + 1), last + 1):
        step = ring[index % size]
        if (
            step is not None
            and step.number == index
            and request_id in step.request_ids
            and request_id not in step.prefill_ids
        ):
            token_steps.append(index)
    return _step_ends(ring, token_steps, prefill_step)


def _step_ends(
    ring: Sequence[StepRecord | None], token_steps: list[int], prefill_step: int | None
) -> list[tuple[int, int]]:
    if prefill_step is not None:  # after a retraction, the recompute's last prefill step,
        # which follows earlier decode steps: keep step order
        token_steps = sorted([prefill_step, *token_steps])
    size = len(ring)
    ends: list[tuple[int, int]] = []
    for index in token_steps:
        # ``EngineStepTracer._step_at`` inline: per token (SGLang's path, and the C walk's twin)
        step = ring[index % size]
        if step is None or step.number != index:  # evicted: gaps across it would be wrong
            ends.clear()
            continue
        ends.append((index, step.end_ns))
    return ends


_UNSEEN: Final[Any] = object()
"""``EngineStepTracer._requests``' answer for a request not seen before (None: not tracked)."""

_STEPS: Final[Any] = compiled.load("tokentrace.agent._steps")
"""``step_facts_python``'s C twin (``_steps.c``), if built."""
BUILT: Final = _STEPS is not None
"""Whether the per-step work runs in C (built, not turned off by ``TOKENTRACE_PURE_PYTHON``)."""
_STEP_FACTS: Callable[..., StepFacts | None] | None = getattr(_STEPS, "step_facts", None)
_STEP_HOOK: Callable[..., Any] | None = getattr(_STEPS, "step_hook", None)
"""``native_hook``'s maker, if built: the two step patches and the tracer's work, in C."""
_TOKEN_STEP_ENDS: Callable[..., list[tuple[int, int]] | None] | None = getattr(
    _STEPS, "token_step_ends", None
)
"""``token_step_ends_python``'s C twin, if built (the emitter's walk of the ring per request)."""
_OUTLIER_GAP_ENDS: Callable[..., list[int] | None] | None = getattr(
    _STEPS, "outlier_gap_ends", None
)
"""``outlier_gap_ends_python``'s C twin, if built."""
_new_step: Final = tuple.__new__
"""``StepRecord``'s own constructor is a Python function; the tuple's is not."""


StepFacts: TypeAlias = "tuple[StepRecord, list[str], list[tuple[str, int]]] | tuple[()]"
"""``step_facts_python``'s answer: the step, its finished requests and the requests it saw
first, or () for a step that scheduled nothing."""


def step_facts_python(
    step_type: type[StepRecord],
    requests: dict[str, Any],
    scheduler: Any,
    output: Any,
    outputs_by_client: Any,
    index: int,
    start_ns: int,
    clock: Callable[[], int],
) -> StepFacts:
    """The step ``index`` that vLLM scheduled at ``start_ns`` (its ``SchedulerOutput``) and
    has just updated from (``outputs_by_client``), with its prefill steps recorded in
    ``requests``: (index, prompt tokens) appended to each tracked request's ``prefill_steps``.
    Returns (the step, the ids of the requests it finished, (id, prompt tokens) of each request
    it prefilled that ``requests`` does not hold yet, for the caller to track), or () when the
    step scheduled nothing. Nothing is done per decoding request but reading its output: its
    token steps are found when it finishes (``EngineStepTracer._token_step_ends``)."""
    scheduled = output.num_scheduled_tokens
    if not scheduled:
        return ()
    prefill_ids = _prefill_ids(output)
    first_seen: list[tuple[str, int]] = []
    prefill_requests = prefill_tokens = 0
    for request_id in prefill_ids:  # a request is first seen in its first prefill step
        tokens = scheduled.get(request_id)
        if tokens is None:
            continue
        prefill_requests += 1
        prefill_tokens += tokens
        tracked = requests.get(request_id, _UNSEEN)
        if tracked is _UNSEEN:
            first_seen.append((request_id, tokens))
        elif tracked is not None:
            tracked.prefill_steps.append((index, tokens))
    end_ns = 0
    finished: list[str] = []
    for client_outputs in outputs_by_client.values():
        if not end_ns and client_outputs.timestamp:
            end_ns = int(client_outputs.timestamp * _NS_PER_S)
        finished += [o.request_id for o in client_outputs.outputs if o.finish_reason is not None]
    if not end_ns:
        end_ns = clock()
    running, waiting = scheduler.get_request_counts()
    total = getattr(output, "total_num_scheduled_tokens", None)
    if type(total) is not int:  # vLLM's sum, when it gives it
        total = sum(scheduled.values())
    step = _new_step(
        step_type,
        (
            index,
            start_ns,
            max(end_ns, start_ns),
            prefill_requests,
            len(scheduled) - prefill_requests,
            prefill_tokens,
            total - prefill_tokens,
            float(scheduler.kv_cache_manager.usage),
            waiting,
            running,
            scheduled,
            prefill_ids,
        ),
    )
    return step, finished, first_seen


_NO_PREFILL: Final[frozenset[str]] = frozenset()


def _prefill_ids(output: Any) -> Set[str]:
    """The ids of the step's requests still in prefill, vLLM's own split: the new ones, and the
    cached ones without an output token yet (``CachedRequestData.is_context_phase``, here for
    the whole batch in one pass over its columns)."""
    new_requests = output.scheduled_new_reqs
    cached = output.scheduled_cached_reqs
    ids = getattr(cached, "req_ids", None)
    output_tokens = getattr(cached, "num_output_tokens", None)
    if ids is not None and output_tokens is not None:
        if not new_requests and 0 not in output_tokens:  # decode only: one scan in C
            return _NO_PREFILL
        prefill = set(compress(ids, map(operator.not_, output_tokens)))
    else:  # another layout: ask it request by request
        in_context = cached.is_context_phase
        prefill = {
            request_id for request_id in output.num_scheduled_tokens if in_context(request_id)
        }
    if new_requests:
        prefill.update([new.req_id for new in new_requests])
    return prefill


class EngineStepTracer:
    """Records engine steps (serving path: the EngineCore busy loop) and plans their spans
    (emitter thread). ``submit`` is the emitter's non-blocking ``submit``: it gets deferred jobs
    (callables returning ``SpanJob``s) that the emitter runs on its thread."""

    def __init__(
        self,
        submit: Callable[[Any], None],
        *,
        guard: HookGuard,
        to_unix: MonotonicToUnix,
        ring_steps: int = _DEFAULT_RING_STEPS,
        sample_rate: float = _DEFAULT_SAMPLE_RATE,
        outlier_ratio: float = _DEFAULT_OUTLIER_RATIO,
        monotonic_ns: Callable[[], int] = time.monotonic_ns,
        seed: int | None = None,
    ) -> None:
        if ring_steps < 1:
            raise ValueError("ring_steps must be >= 1")
        if not 0.0 <= sample_rate <= 1.0:
            raise ValueError("sample_rate must be between 0 and 1")
        self._submit = submit
        self.guard = guard
        self._to_unix = to_unix
        self._ring: list[StepRecord | None] = [None] * ring_steps
        self._ring_steps = ring_steps
        self._sample_rate = sample_rate
        self._outlier_ratio = outlier_ratio
        self.clock = monotonic_ns
        self._random = random.Random(os.urandom(16) if seed is None else seed).random
        self._track_parts = _TRACK_PARTS  # what the C step hook reads a request first seen with
        self._next_index = 0
        self._open: dict[int, int] = {}
        """id(scheduler output) -> the step's start (monotonic ns), until its update."""
        self._requests: dict[str, _TrackedRequest | None] = {}
        """Requests the scheduler holds: None for those with no trace context (not tracked)."""
        self.sampled_steps = 0
        self.requests_with_outliers = 0
        self.outlier_steps = 0
        self.outlier_steps_evicted = 0
        """Outlier steps already overwritten in the ring when their request finished."""
        self.swept_requests = 0
        """Request step lists dropped without a finish reason (aborted inside the engine)."""

    @property
    def steps(self) -> int:
        """Steps recorded: each is numbered in turn (0, 1, ...)."""
        return self._next_index

    # --- serving path (EngineCore busy loop) ---------------------------------------------------
    def on_scheduled(self, output: Any, start_ns: int) -> None:
        """A step was scheduled at ``start_ns``; all else is read at its update, from the same
        ``SchedulerOutput`` (one hook's work per step, not two)."""
        opened = self._open
        if len(opened) >= _MAX_OPEN_STEPS:  # updates that never came (cannot happen in vLLM
            opened.clear()  # 0.32: at most the batch queue's size are in flight)
        opened[id(output)] = start_ns

    def on_step_done(self, scheduler: Any, output: Any, outputs_by_client: Any) -> None:
        start_ns = self._open.pop(id(output), None)
        if start_ns is None:
            return
        # Steps are numbered in update order: the order vLLM schedules them (its batch queue is
        # first in, first out).
        index = self._next_index
        requests = self._requests
        facts = None
        if _STEP_FACTS is not None:
            facts = _STEP_FACTS(
                StepRecord, requests, scheduler, output, outputs_by_client, index, start_ns,
                self.clock,
            )  # fmt: skip
        if facts is None:
            facts = step_facts_python(
                StepRecord, requests, scheduler, output, outputs_by_client, index, start_ns,
                self.clock,
            )  # fmt: skip
        if not facts:
            return
        self._next_index = index + 1
        step, finished, first_seen = facts
        if first_seen:
            self._track_first_seen(scheduler, index, first_seen)
        self._store(step, finished)
        if not (index + 1) % _SWEEP_EVERY_STEPS:
            self._sweep(scheduler.requests)

    def _track_first_seen(
        self, scheduler: Any, index: int, first_seen: list[tuple[str, int]]
    ) -> None:
        """Track the requests the step ``index`` prefilled first ((id, prompt tokens) each):
        once per request, also from the C hook."""
        requests = self._requests
        held = scheduler.requests  # a request that finished in this step is gone from it
        for request_id, tokens in first_seen:  # (and has no gaps)
            tracked = requests[request_id] = _track(held.get(request_id))
            if tracked is not None:
                tracked.request_id, tracked.first_step = request_id, index
                tracked.prefill_steps.append((index, tokens))

    def native_hook(
        self, original: Callable[..., Any], *, updates: bool, gate: object, guard: HookGuard
    ) -> Callable[..., Any] | None:
        """vLLM's ``Scheduler.schedule`` (``updates`` false) or ``update_from_output`` with
        this tracer's work in C (``_steps.c``'s ``step_hook``): what the instrumentor's Python
        patch calling ``on_scheduled`` / ``on_step_done`` does, with no Python frame between.
        Recording while ``gate._active``; failures go to ``guard``. None where not built."""
        if _STEP_HOOK is None:
            return None
        name, other = (
            (HOOK_STEP_DONE, HOOK_STEP_SCHEDULED)
            if updates
            else (HOOK_STEP_SCHEDULED, HOOK_STEP_DONE)
        )
        native_clock = self.clock is time.monotonic_ns  # the same CLOCK_MONOTONIC, read in C
        return _STEP_HOOK(
            updates, original, self, StepRecord, gate, guard, name, other, native_clock,
            _MAX_OPEN_STEPS, _SWEEP_EVERY_STEPS,
        )  # fmt: skip

    # --- the same for engines whose steps are one call (SGLang's scheduler) -----------------------
    def track(self, request_id: str, parent: tuple[bytes, bytes, bytes]) -> None:
        """Follow ``request_id``'s steps under (trace id, request span id, prefill span id)."""
        self._requests[request_id] = _TrackedRequest(*parent, None)

    def preempt(self, request_id: str, now_ns: int) -> None:
        """The engine evicted the request; its next prefill step resumes it."""
        tracked = self._requests.get(request_id)
        if tracked is not None and tracked.preempted_since_ns is None:
            tracked.preempted_since_ns = now_ns

    def record_step(
        self,
        start_ns: int,
        end_ns: int,
        prefill: Sequence[tuple[str, int]],
        decode: Sequence[str],
        finished: Sequence[str],
        *,
        kv_cache_usage: float,
        waiting: int,
        running: int,
    ) -> int:
        """One engine step that ran ``prefill`` ((request id, prompt tokens) each) and
        ``decode`` (one token each); ``finished``: the requests it finished. Returns its index."""
        index = self._next_index
        self._next_index = index + 1
        requests = self._requests
        prefill_tokens = 0
        for request_id, tokens in prefill:
            prefill_tokens += tokens
            tracked = requests.get(request_id)
            if tracked is not None:
                if tracked.first_scheduled_ns is None:
                    tracked.first_scheduled_ns = start_ns
                if tracked.preempted_since_ns is not None:  # recomputed after an eviction
                    tracked.preempted.append((tracked.preempted_since_ns, start_ns))
                    tracked.preempted_since_ns = None
                if tracked.preempted or tracked.decode_steps:
                    # The recompute of a request that had tokens: not a chunk of its first
                    # prefill (``llm.prefill`` ended at its first token) but a step that gives
                    # it its next token, for its inter-token gaps.
                    tracked.decode_steps.append(index)
                else:
                    tracked.prefill_steps.append((index, tokens))
        for request_id in decode:
            tracked = requests.get(request_id)
            if tracked is not None:
                tracked.decode_steps.append(index)
        prefill_ids = tuple(request_id for request_id, _ in prefill)
        step = StepRecord(
            index, start_ns, max(end_ns, start_ns), len(prefill), len(decode),
            prefill_tokens, len(decode), kv_cache_usage, waiting, running,
            prefill_ids + tuple(decode), frozenset(prefill_ids),
        )  # fmt: skip
        self._store(step, finished)
        return index

    def sweep_unless_held(self, index: int, held: Callable[[], Collection[str]]) -> None:
        """Every ``_SWEEP_EVERY_STEPS`` steps, forget the requests the engine no longer holds."""
        if not (index + 1) % _SWEEP_EVERY_STEPS:
            self._sweep(held())

    def _store(self, step: StepRecord, finished: Sequence[str]) -> None:
        self._ring[step.number % self._ring_steps] = step
        if self._sample_rate and self._random() < self._sample_rate:
            self.sampled_steps += 1
            self._submit(partial(self.plan_sampled_step, step))
        requests = self._requests
        for request_id in finished:
            tracked = requests.pop(request_id, None)
            if tracked is not None:
                tracked.last_step = step.number
                self._submit(partial(self.plan_request, tracked))

    def _sweep(self, held: Any) -> None:
        gone = [request_id for request_id in self._requests if request_id not in held]
        for request_id in gone:
            del self._requests[request_id]
        self.swept_requests += len(gone)

    # --- emitter thread ------------------------------------------------------------------------
    def _step_at(self, index: int) -> StepRecord | None:
        step = self._ring[index % self._ring_steps]
        return step if step is not None and step.number == index else None

    def plan_sampled_step(self, step: StepRecord) -> list[SpanJob]:
        """A sampled step: the root of a trace of its own (emitter thread)."""
        return [SpanJob(random_trace_id(), b"", [self._step_span(0, -1, step)])]

    def plan_request(self, tracked: _TrackedRequest) -> list[SpanJob]:
        """The chunk and outlier-step spans of one finished request (emitter thread)."""
        jobs: list[SpanJob] = []
        unix = self._to_unix.to_unix_ns
        chunks = tracked.prefill_steps
        if len(chunks) > 1:
            planned: list[PlannedSpan] = []
            previous_end = tracked.first_scheduled_ns
            for index, tokens in chunks:
                step = self._step_at(index)
                if step is None:
                    continue
                start = step.start_ns if previous_end is None else max(step.start_ns, previous_end)
                chunk = PlannedSpan(
                    len(planned), -1, semconv.SPAN_PREFILL_CHUNK, KIND_INTERNAL,
                    unix(start), unix(max(step.end_ns, start)),
                    {semconv.PREFILL_CHUNK_TOKENS: tokens},
                )  # fmt: skip
                planned.append(chunk)
                previous_end = step.end_ns
            if planned:
                jobs.append(SpanJob(tracked.trace_id, tracked.prefill_span_id, planned))
        if tracked.preempted_since_ns is not None:  # finished while evicted (aborted)
            tracked.preempted.append((tracked.preempted_since_ns, self.clock()))
        if tracked.preempted:
            jobs.append(
                SpanJob(
                    tracked.trace_id,
                    tracked.request_span_id,
                    [
                        PlannedSpan(
                            i,
                            -1,
                            semconv.SPAN_PREEMPTED,
                            KIND_INTERNAL,
                            unix(start),
                            unix(max(end, start)),
                            {},
                        )
                        for i, (start, end) in enumerate(tracked.preempted)
                    ],
                )
            )
        steps = self._outlier_steps(tracked)
        if steps:
            self.requests_with_outliers += 1
            self.outlier_steps += len(steps)
            jobs.append(
                SpanJob(
                    tracked.trace_id,
                    tracked.request_span_id,
                    [self._step_span(i, -1, step) for i, step in enumerate(steps)],
                )
            )
        return jobs

    def _token_step_ends(self, tracked: _TrackedRequest) -> list[tuple[int, int]]:
        """(step index, end ns) of each step that gave the request a token, in step order: its
        last prefill step (which gives the first token) and the steps after it, named one by one
        (``decode_steps``) or, from vLLM, found in the ring (``token_step_ends_python``; in C
        where built: per token, on the emitter's thread, for every request)."""
        prefill_step = tracked.prefill_steps[-1][0] if tracked.prefill_steps else None
        first, last = tracked.first_step, tracked.last_step
        if first is None or last is None:
            return _step_ends(self._ring, tracked.decode_steps, prefill_step)
        if _TOKEN_STEP_ENDS is not None:
            ends = _TOKEN_STEP_ENDS(self._ring, first, last, tracked.request_id, prefill_step)
            if ends is not None:
                return ends
        return token_step_ends_python(self._ring, first, last, tracked.request_id, prefill_step)

    def _outlier_steps(self, tracked: _TrackedRequest) -> list[StepRecord]:
        ends = self._token_step_ends(tracked)
        positions = outlier_gap_ends(ends, self._outlier_ratio)
        if not positions:
            return []
        # The largest gaps first, then as many of their steps as the cap allows.
        positions.sort(key=lambda i: ends[i][1] - ends[i - 1][1], reverse=True)
        chosen: dict[int, StepRecord] = {}
        for position in positions:
            for index in range(ends[position - 1][0] + 1, ends[position][0] + 1):
                if len(chosen) >= _MAX_OUTLIER_STEPS:
                    break
                step = self._step_at(index)
                if step is None:
                    self.outlier_steps_evicted += 1
                    continue
                chosen[index] = step
        return [chosen[index] for index in sorted(chosen)]

    def _step_span(self, local_id: int, parent: int, step: StepRecord) -> PlannedSpan:
        unix = self._to_unix.to_unix_ns
        attributes: dict[str, AttrValue] = {
            semconv.ENGINE_STEP_BATCH_SIZE: len(step.request_ids),
            semconv.ENGINE_STEP_PREFILL_REQUESTS: step.prefill_requests,
            semconv.ENGINE_STEP_DECODE_REQUESTS: step.decode_requests,
            semconv.ENGINE_STEP_PREFILL_TOKENS: step.prefill_tokens,
            semconv.ENGINE_STEP_DECODE_TOKENS: step.decode_tokens,
            semconv.ENGINE_STEP_KV_CACHE_USAGE: step.kv_cache_usage,
            semconv.ENGINE_STEP_WAITING: step.waiting,
            semconv.ENGINE_STEP_RUNNING: step.running,
            semconv.ENGINE_STEP_REQUEST_IDS: tuple(step.request_ids),
        }
        return PlannedSpan(
            local_id, parent, semconv.SPAN_ENGINE_STEP, KIND_INTERNAL,
            unix(step.start_ns), unix(step.end_ns), attributes,
        )  # fmt: skip

    def stats(self) -> dict[str, int]:
        return {
            "engine.steps": self.steps,
            "engine.sampled_steps": self.sampled_steps,
            "engine.tracked_requests": sum(1 for r in self._requests.values() if r is not None),
            "engine.requests_with_outliers": self.requests_with_outliers,
            "engine.outlier_steps": self.outlier_steps,
            "engine.outlier_steps_evicted": self.outlier_steps_evicted,
            "engine.swept_requests": self.swept_requests,
        }


def _track(request: Any) -> _TrackedRequest | None:
    headers = getattr(request, "trace_headers", None)
    if not headers:
        return None
    parent = parse_engine_parent(headers.get(ENGINE_PARENT_HEADER))
    if parent is None:
        return None
    first_scheduled_ns = None
    for event in reversed(getattr(request, "events", None) or ()):
        if event.type == EVENT_SCHEDULED:
            first_scheduled_ns = int(event.timestamp * _NS_PER_S)
            break
    return _TrackedRequest(*parent, first_scheduled_ns)


_TRACK_PARTS: Final = (ENGINE_PARENT_HEADER, EVENT_SCHEDULED, _TrackedRequest, _track)
"""What ``_steps.c`` reads a request first seen with (its ``track_request``): the header, the
SCHEDULED event's type, the record's type, and ``_track``, which answers for other shapes."""
