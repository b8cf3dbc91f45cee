"""vLLM's cold start: one ``llm.cold_start`` trace per server start, across its processes.

A vLLM server is several processes (the API server - the frontend -, EngineCore and, on CPU or
with tensor parallelism, worker processes), each of which imports vLLM and does part of the
start-up. Each process emits its own phases, as children of one root span:

- ``llm.cold_start`` (frontend): the frontend process's start -> the end of its engine
  construction (``AsyncLLM`` / ``LLMEngine``), which returns once EngineCore has loaded the
  model, sized and allocated the KV cache and warmed up: ready to serve. (The HTTP server
  still binds its socket after that, in well under a second.)
- ``llm.cold_start.import``, one per process: its start -> the start of its own work. In the
  frontend that is the start of the engine construction (it includes vLLM's argument parsing
  and model config); in EngineCore and workers it is the moment vLLM loads its plugins, right
  after its imports (the top of ``EngineCore.__init__``, the worker's ``init_worker``).
- ``llm.cold_start.weight_load`` (worker): ``Worker.load_model`` (GPU and CPU workers alike).
- ``llm.cold_start.kv_cache`` (EngineCore): ``EngineCore._initialize_kv_caches`` from its start
  (memory profiling: one forward pass, in which vLLM also compiles the model when compilation
  is on) through the KV-cache allocation, until it asks the workers to warm up.
- ``llm.cold_start.warmup`` (worker): ``compile_or_warm_up_model`` (CUDA graph capture and the
  warm-up of the remaining compile sizes on GPU). On CPU, vLLM runs its compiling warm-up pass
  (``CPUModelRunner.warming_up_model``) during memory profiling: that warm-up span lies inside
  ``kv_cache``. Nested calls of one phase in one process make one span.

Where a phase's process is also another's (vLLM's in-process executor runs the worker inside
EngineCore; ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` runs everything in one process) the same
phases come from fewer processes.

**Across processes**: the frontend chooses the trace id and the root's span id when it is
instrumented and puts them in ``os.environ`` under ``COLD_START_PARENT_ENV``
(``<trace id hex>-<span id hex>``), replacing any value it inherited (the process a user
started is the top of its server); vLLM starts EngineCore and the
workers after that, and they inherit it. A process that finds no such variable (an engine
started on its own) gives its phases a new trace without a root (each phase is a root) and
sets the variable, with an all-zero span id, for the processes it starts. Known gap: with
several API servers (``--api-server-count``) the process that starts them sets the variable
but builds no engine, so no root is emitted and the phases' parent is missing from the trace.

**Clocks**: every time is ``time.monotonic_ns()`` (comparable across the processes of a host
on Linux), converted to Unix time on the emitter's thread with the runtime's ``MonotonicToUnix``.
A process's start comes from ``/proc/self/stat`` (``starttime``, in clock ticks since boot:
10 ms resolution at the usual 100 Hz), mapped to the monotonic clock through
``CLOCK_BOOTTIME``. Where it cannot be read, ``import`` is left out and the root starts when
the frontend was instrumented.

**Requests that wait on the cold start** get ``tokentrace.cold_start.ready_time`` (the root's
end) and a span link to ``llm.cold_start`` on their ``llm.request``. vLLM's HTTP server listens
only after the engine is ready and the offline ``LLM`` adds requests after its constructor
returns, so this is rare: a request given an ``arrival_time`` before the engine was ready, or
one added while a second engine is still being built.

The hooks run on vLLM's start-up path, once each: a clock read and a deque append (the spans
are planned on the emitter's thread). ``VllmInstrumentor`` runs each through its
``HookGuard``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Final

from tokentrace.agent import semconv
from tokentrace.agent.recorder import MonotonicToUnix, RequestTimer
from tokentrace.agent.span_ids import (
    SPAN_ID_BYTES,
    TRACE_ID_BYTES,
    format_ids,
    parse_ids,
    random_span_id_bytes,
    random_trace_id,
)
from tokentrace.agent.spans import KIND_INTERNAL, AttrValue, PlannedSpan, SpanJob

__all__ = [
    "COLD_START_PARENT_ENV",
    "HOOK_COLD_START_ENGINE",
    "HOOK_COLD_START_IMPORT",
    "HOOK_COLD_START_KV_CACHE",
    "HOOK_COLD_START_WARMUP",
    "HOOK_COLD_START_WARMUP_DISPATCH",
    "HOOK_COLD_START_WEIGHT_LOAD",
    "ColdStartTracer",
    "cold_start_parent",
    "parse_cold_start_parent",
    "process_cold_start_tracer",
    "process_start_monotonic_ns",
]

COLD_START_PARENT_ENV: Final = "TOKENTRACE_COLD_START_PARENT"
"""``<trace id>-<llm.cold_start span id>`` in hex, inherited by the processes vLLM starts; an
all-zero span id: the trace has no root (no frontend), its phases are roots."""

# Hook names: what HookGuard counts and disables (and logs).
HOOK_COLD_START_IMPORT: Final = "vllm.cold_start.import"
HOOK_COLD_START_ENGINE: Final = "vllm.cold_start.engine_init"
HOOK_COLD_START_WEIGHT_LOAD: Final = "vllm.cold_start.weight_load"
HOOK_COLD_START_KV_CACHE: Final = "vllm.cold_start.kv_cache"
HOOK_COLD_START_WARMUP_DISPATCH: Final = "vllm.cold_start.warmup_dispatch"
HOOK_COLD_START_WARMUP: Final = "vllm.cold_start.warmup"

_DEFAULT_MAX_WAITING_REQUESTS: Final = 4096
"""Requests remembered until ready (to stamp their ready time); beyond, counted and left."""
_NS_PER_S: Final = 1_000_000_000
_PROC_STAT: Final = "/proc/self/stat"
_STAT_STARTTIME_INDEX: Final = 19
"""``starttime`` (field 22 of ``proc(5)``) among the fields after the command name's ``)``
(which start at field 3)."""
_ROOT_LOCAL_ID: Final = 0


def cold_start_parent(trace_id: bytes, span_id: bytes) -> str:
    """``COLD_START_PARENT_ENV``'s value for the root span ``span_id`` (empty: none) of trace
    ``trace_id``."""
    return format_ids(trace_id, span_id or bytes(SPAN_ID_BYTES))


def parse_cold_start_parent(value: object) -> tuple[bytes, bytes] | None:
    """(trace id, root span id; empty: no root) of a ``COLD_START_PARENT_ENV`` value; None when
    malformed."""
    ids = parse_ids(value, TRACE_ID_BYTES, SPAN_ID_BYTES)
    if ids is None or not any(ids[0]):
        return None
    trace_id, span_id = ids
    return trace_id, span_id if any(span_id) else b""


def process_start_monotonic_ns(
    *,
    stat_path: str = _PROC_STAT,
    monotonic_ns: Callable[[], int] = time.monotonic_ns,
    boottime_ns: Callable[[], int] | None = None,
) -> int | None:
    """When this process started, in ``time.monotonic_ns()``'s domain (10 ms resolution at the
    usual 100 clock ticks per second); None where ``/proc`` or ``CLOCK_BOOTTIME`` is missing."""
    try:
        with open(stat_path, "rb") as stat:
            data = stat.read()
        # The command name (field 2) is in parentheses and may itself contain spaces or ')'.
        fields = data[data.rindex(b")") + 2 :].split()
        start_ticks = int(fields[_STAT_STARTTIME_INDEX])
        ticks_per_s = os.sysconf("SC_CLK_TCK")
        if boottime_ns is None:
            boottime_ns = partial(time.clock_gettime_ns, time.CLOCK_BOOTTIME)
        since_boot_ns, now_ns = boottime_ns(), monotonic_ns()
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    if ticks_per_s <= 0:
        return None
    started_ns = now_ns - (since_boot_ns - start_ticks * _NS_PER_S // ticks_per_s)
    return min(started_ns, now_ns)


@dataclass(slots=True)
class _OpenPhase:
    start_ns: int
    depth: int = 1
    cut_ns: int | None = None
    """Where the phase was declared over before its call returned (``kv_cache``)."""


class ColdStartTracer:
    """This process's part of the cold start (see the module docstring).

    ``submit`` is the emitter's non-blocking ``submit``: it gets deferred jobs that plan the
    spans on the emitter's thread. ``frontend``: this process serves requests (it owns the root
    when it is the one that sets ``COLD_START_PARENT_ENV`` in ``environ``). ``inherit``: False
    for the process the user started, which chooses new ids even when ``environ`` has some (they
    came from some unrelated parent). The methods run on vLLM's start-up path; callers run them
    through a ``HookGuard``.
    """

    def __init__(
        self,
        submit: Callable[[Any], None],
        *,
        to_unix: MonotonicToUnix,
        frontend: bool,
        inherit: bool = True,
        environ: MutableMapping[str, str] | None = None,
        monotonic_ns: Callable[[], int] = time.monotonic_ns,
        read_process_start: Callable[[], int | None] = process_start_monotonic_ns,
        max_waiting_requests: int = _DEFAULT_MAX_WAITING_REQUESTS,
    ) -> None:
        self._submit = submit
        self._monotonic_to_unix = to_unix
        self.clock = monotonic_ns
        self.frontend = frontend
        now = monotonic_ns()
        started = read_process_start()
        self.process_start_ns: int | None = None if started is None else min(started, now)
        self.instrumented_ns = now
        env = os.environ if environ is None else environ
        inherited = parse_cold_start_parent(env.get(COLD_START_PARENT_ENV)) if inherit else None
        self.owns_root = inherited is None and frontend
        """This process emits ``llm.cold_start``: it chose the ids."""
        self.root_span_id: bytes
        """``llm.cold_start``'s id; empty: the trace has no root (no frontend started it)."""
        if inherited is not None:
            self.trace_id, self.root_span_id = inherited
        else:
            self.trace_id = random_trace_id()
            # Without a frontend (an engine started on its own) the phases are the trace's roots.
            self.root_span_id = random_span_id_bytes() if frontend else b""
            env[COLD_START_PARENT_ENV] = cold_start_parent(self.trace_id, self.root_span_id)
        self.ready_ns: int | None = None
        """When this frontend's first engine was built (monotonic ns); None before."""
        self._import_done = False
        self._engine_started = False
        self._open: dict[str, _OpenPhase] = {}
        self._waiting: list[RequestTimer] = []
        self._max_waiting = max_waiting_requests
        self._lock = threading.Lock()  # requests may be added from threads other than init's
        self._process_start_unix_ns: int | None = None
        self.phases_emitted = 0
        self.waiting_requests_unstamped = 0
        """Requests that arrived before ready beyond ``max_waiting_requests``: no ready time."""

    # --- start-up path ---------------------------------------------------------------------
    def import_done(self) -> None:
        """This process has imported vLLM: its ``import`` phase ends now (once)."""
        now = self.clock()
        if self._import_done:
            return
        self._import_done = True
        if self.process_start_ns is not None:
            self._emit_phase(semconv.SPAN_COLD_START_IMPORT, self.process_start_ns, now, None)

    def engine_init_started(self) -> bool:
        """The frontend starts building its engine; True for the first engine (the one that
        makes the process ready): its end is then reported to ``engine_ready``."""
        if self._engine_started:
            return False
        self._engine_started = True
        self.import_done()
        return True

    def engine_ready(self, error: str | None = None) -> None:
        """The first engine is built (``error``: its construction raised): the cold start ends."""
        now = self.clock()
        if self.ready_ns is not None:
            return
        if error is None:
            with self._lock:
                self.ready_ns = now
                waiting, self._waiting = self._waiting, []
            for timer in waiting:
                if timer.arrival_ns < now:
                    self._stamp(timer, now)
        if self.owns_root:
            start = self.instrumented_ns if self.process_start_ns is None else self.process_start_ns
            self._submit(partial(self._plan_root, start, now, error))

    def phase_started(self, name: str) -> int:
        """A phase's call begins; returns its start (a nested call of the same phase only
        deepens the open one)."""
        now = self.clock()
        phase = self._open.get(name)
        if phase is None:
            self._open[name] = _OpenPhase(now)
        else:
            phase.depth += 1
        return now

    def phase_ended(
        self,
        name: str,
        error: str | None = None,
        attributes: Mapping[str, AttrValue] | None = None,
    ) -> None:
        """A phase's call returned (``error``: it raised); the outermost one emits the span,
        with ``attributes`` when given."""
        now = self.clock()
        phase = self._open.get(name)
        if phase is None:
            return
        phase.depth -= 1
        if phase.depth > 0:
            return
        del self._open[name]
        end = now if phase.cut_ns is None else phase.cut_ns
        self._emit_phase(
            name, phase.start_ns, end, error if phase.cut_ns is None else None, attributes
        )

    def cut_phase(self, name: str) -> None:
        """``name`` is over now although its call has not returned (EngineCore's KV-cache
        initialisation goes on to ask the workers to warm up); no-op when it is not open."""
        phase = self._open.get(name)
        if phase is not None and phase.cut_ns is None:
            phase.cut_ns = self.clock()

    # --- serving path ----------------------------------------------------------------------
    def on_request(self, timer: RequestTimer) -> None:
        """A request arrived: one that waited for the cold start gets its ready time."""
        ready = self.ready_ns
        if ready is not None:
            if timer.arrival_ns < ready:
                self._stamp(timer, ready)
            return
        with self._lock:
            if self.ready_ns is None:
                if len(self._waiting) < self._max_waiting:
                    self._waiting.append(timer)
                else:
                    self.waiting_requests_unstamped += 1
                return
        self.on_request(timer)  # ready came meanwhile

    def _stamp(self, timer: RequestTimer, ready_ns: int) -> None:
        """The request waited for this cold start: its ready time, and a link to the root."""
        timer.ready_ns = ready_ns
        if self.root_span_id:
            timer.cold_start_link = (self.trace_id, self.root_span_id)

    def stats(self) -> dict[str, int]:
        return {
            "cold_start.phases_emitted": self.phases_emitted,
            "cold_start.waiting_requests_unstamped": self.waiting_requests_unstamped,
        }

    # --- emitter thread --------------------------------------------------------------------
    def _emit_phase(
        self,
        name: str,
        start_ns: int,
        end_ns: int,
        error: str | None,
        attributes: Mapping[str, AttrValue] | None = None,
    ) -> None:
        self.phases_emitted += 1
        self._submit(partial(self._plan_phase, name, start_ns, end_ns, error, attributes))

    def _to_unix(self, monotonic_ns: int) -> int:
        """Unix ns; the process start is converted once, so that the root and the import phase
        start at the very same nanosecond (the monotonic-to-Unix offset is re-measured)."""
        if monotonic_ns != self.process_start_ns:
            return self._monotonic_to_unix.to_unix_ns(monotonic_ns)
        if self._process_start_unix_ns is None:
            self._process_start_unix_ns = self._monotonic_to_unix.to_unix_ns(monotonic_ns)
        return self._process_start_unix_ns

    def _plan_phase(
        self,
        name: str,
        start_ns: int,
        end_ns: int,
        error: str | None,
        attributes: Mapping[str, AttrValue] | None = None,
    ) -> list[SpanJob]:
        unix = self._to_unix
        start = unix(start_ns)
        span = PlannedSpan(
            0, -1, name, KIND_INTERNAL, start, max(unix(end_ns), start), dict(attributes or {}),
            error,
        )  # fmt: skip
        return [SpanJob(self.trace_id, self.root_span_id, [span])]

    def _plan_root(self, start_ns: int, end_ns: int, error: str | None) -> list[SpanJob]:
        unix = self._to_unix
        start = unix(start_ns)
        span = PlannedSpan(
            _ROOT_LOCAL_ID, -1, semconv.SPAN_COLD_START, KIND_INTERNAL, start,
            max(unix(end_ns), start), {}, error,
        )  # fmt: skip
        return [SpanJob(self.trace_id, b"", [span], {_ROOT_LOCAL_ID: self.root_span_id})]


_process_tracer: ColdStartTracer | None = None
_process_tracer_lock = threading.Lock()


def process_cold_start_tracer(
    submit: Callable[[Any], None], *, to_unix: MonotonicToUnix, frontend: bool, inherit: bool
) -> ColdStartTracer:
    """The process's one tracer (created on the first call, with ``os.environ``): instrumenting
    again must not start a second cold start."""
    global _process_tracer
    with _process_tracer_lock:
        if _process_tracer is None:
            _process_tracer = ColdStartTracer(
                submit, to_unix=to_unix, frontend=frontend, inherit=inherit
            )
        return _process_tracer
