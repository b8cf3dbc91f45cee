"""SGLang's scheduler processes: engine steps, prefill chunks and retractions, per request.

Each scheduler process (one per tensor-parallel rank and data-parallel replica) runs a busy
loop: ``Scheduler.run_batch(batch)`` runs one forward pass, ``Scheduler.process_batch_result``
turns its result into tokens and streams them to the frontend. One step is that pair. The hooks
feed the engine-step ring shared with vLLM (``vllm_engine.EngineStepTracer``): a clock read
before ``run_batch`` and after ``process_batch_result``, and per request in the batch one append
(its step index), like a token. A finished request's chunk, retraction and outlier-step spans are
planned on the emitter's thread.

- **trace context**: the frontend puts ``<trace id>-<llm.request id>-<llm.prefill id>`` on the
  request's ``time_stats`` (``sglang_requests.PARENT_STATE_KEY``); the patched
  ``ReqTimeStatsBase.__getstate__`` adds it to what SGLang pickles to the scheduler (and
  ``ReqTimeStatsBase.new_from_obj`` keeps it in the data-parallel controller's copy), where
  ``Scheduler.handle_generate_request`` reads it. A request without it (sent by a frontend
  tokentrace does not run in) is counted in steps but not followed.
- **steps**: an extend batch (``forward_mode.is_extend()``) is prefill for each of its requests,
  with its ``extend_lens`` entry of prompt tokens (one chunk of a chunked prefill); a decode batch
  gives each request one token. A request's first prefill step starts its
  ``first_scheduled`` time for the chunk spans; only each replica's rank zero records (every
  tensor-, pipeline- and context-parallel rank runs the same steps).
- **retraction** (``Scheduler._add_request_to_queue(req, is_retracted=True)``: SGLang evicts a
  running request when the KV cache runs out and queues it again): an ``llm.preempted`` interval
  from then to the start of its next prefill step, which recomputes it.
- **queue times for the frontend**: SGLang pickles a request's scheduler times into its outputs
  only with ``--enable-metrics``; ``_add_request_to_queue`` sets the request's
  ``has_timing_data`` so that its outputs carry them, and the step after its first token clears
  it again, so the per-output cost (a small dict pickled per request) is paid once per request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import Any, Final

from tokentrace.agent.frameworks.sglang_requests import PARENT_STATE_KEY
from tokentrace.agent.frameworks.vllm_engine import EngineStepTracer, parse_engine_parent
from tokentrace.agent.hooks import HookGuard

__all__ = [
    "HOOK_SCHEDULER_ARRIVAL",
    "HOOK_SCHEDULER_QUEUE",
    "HOOK_SCHEDULER_STEP",
    "HOOK_TIME_STATS",
    "SglangSchedulerHooks",
]

_log = logging.getLogger(__name__)

HOOK_SCHEDULER_ARRIVAL: Final = "sglang.scheduler.handle_generate_request"
HOOK_SCHEDULER_QUEUE: Final = "sglang.scheduler.add_request_to_queue"
HOOK_SCHEDULER_STEP: Final = "sglang.scheduler.step"
HOOK_TIME_STATS: Final = "sglang.time_stats"
_MAX_OPEN_STEPS: Final = 16
"""Batches run but not yet processed: one in SGLang's normal loop, two with overlap."""


class SglangSchedulerHooks:
    """``SglangInstrumentor``'s scheduler patches and their hook bodies."""

    _active: bool
    _guard: HookGuard
    _step_tracer: EngineStepTracer | None
    _open_steps: dict[Any, int]
    _rank_zero: dict[int, bool]

    # --- on the way to the scheduler: the parent ids ride in the pickled time stats -------------
    def _wrap_time_stats_getstate(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        state = wrapped(*args, **kwargs)
        parent = instance.__dict__.get(PARENT_STATE_KEY)
        if parent is not None and isinstance(state, dict):
            state[PARENT_STATE_KEY] = parent
        return state

    def _wrap_time_stats_new_from_obj(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        """SGLang's copy keeps only its own fields: the parent ids are carried over."""
        copy = wrapped(*args, **kwargs)
        source = args[0] if args else kwargs.get("obj")
        parent = getattr(source, "__dict__", {}).get(PARENT_STATE_KEY)
        if parent is not None:
            copy.__dict__[PARENT_STATE_KEY] = parent
        return copy

    # --- scheduler process -----------------------------------------------------------------------
    def _wrap_handle_generate_request(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        result = wrapped(*args, **kwargs)
        if self._active and self._step_tracer is not None:
            request = args[0] if args else kwargs["recv_req"]
            self._guard.run(HOOK_SCHEDULER_ARRIVAL, self._on_scheduler_arrival, request)
        return result

    def _wrap_add_request_to_queue(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        if self._active:
            request = args[0] if args else kwargs["req"]
            retracted = args[1] if len(args) > 1 else kwargs.get("is_retracted", False)
            self._guard.run(HOOK_SCHEDULER_QUEUE, self._on_queued, request, retracted)
        return wrapped(*args, **kwargs)

    def _wrap_run_batch(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        tracer = self._step_tracer
        if not self._active or tracer is None or HOOK_SCHEDULER_STEP in self._guard.disabled:
            return wrapped(*args, **kwargs)
        start_ns = tracer.clock()
        result = wrapped(*args, **kwargs)
        batch = args[0] if args else kwargs["batch"]
        opened = self._open_steps
        if len(opened) >= _MAX_OPEN_STEPS:  # results never processed (an engine error)
            opened.clear()
        opened[_step_key(batch)] = start_ns
        return result

    def _wrap_process_batch_result(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        result = wrapped(*args, **kwargs)
        tracer = self._step_tracer
        if self._active and tracer is not None:
            batch = args[0] if args else kwargs["batch"]
            start_ns = self._open_steps.pop(_step_key(batch), None)
            if start_ns is not None:
                self._guard.run(HOOK_SCHEDULER_STEP, self._on_step, instance, batch, start_ns)
        return result

    # --- hook bodies ----------------------------------------------------------------------------
    def _records_steps(self, scheduler: Any) -> bool:
        """Whether this scheduler is its replica's rank zero, by SGLang's own rule (the rank that
        sends the outputs on: pipeline, attention tensor- and context-parallel rank 0); read
        once per scheduler."""
        known = self._rank_zero.get(id(scheduler))
        if known is None:
            from sglang.srt.runtime_context import get_parallel  # SGLang's own, present here

            parallel = get_parallel()
            known = not (
                getattr(parallel, "pp_rank", 0)
                or getattr(parallel, "attn_tp_rank", 0)
                or getattr(parallel, "attn_cp_rank", 0)
            )
            self._rank_zero[id(scheduler)] = known
        return known

    def _on_scheduler_arrival(self, request: Any) -> None:
        parent = parse_engine_parent(
            getattr(getattr(request, "time_stats", None), PARENT_STATE_KEY, None)
        )
        if parent is not None and self._step_tracer is not None:
            self._step_tracer.track(request.rid, parent)

    def _on_queued(self, request: Any, retracted: bool) -> None:
        time_stats = request.time_stats
        time_stats.has_timing_data = True  # its first output carries the queue times
        if retracted and self._step_tracer is not None:
            self._step_tracer.preempt(request.rid, self._step_tracer.clock())

    def _on_step(self, scheduler: Any, batch: Any, start_ns: int) -> None:
        tracer = self._step_tracer
        assert tracer is not None
        if not self._records_steps(scheduler):  # every rank runs the same steps: rank 0 records
            return
        end_ns = tracer.clock()
        requests = batch.reqs
        mode = batch.forward_mode
        prefill: list[tuple[str, int]] = []
        decode: list[str] = []
        finished: list[str] = []
        if mode.is_extend():
            for request, tokens in zip(requests, batch.extend_lens, strict=False):
                prefill.append((request.rid, int(tokens)))
                if request.finished():
                    finished.append(request.rid)
                elif request.output_ids:  # its first token came (not a chunk): stop shipping
                    request.time_stats.has_timing_data = False
        elif mode.is_decode():
            for request in requests:
                decode.append(request.rid)
                if request.finished():
                    finished.append(request.rid)
        else:
            return
        waiting = len(scheduler.waiting_queue)
        running_batch = getattr(scheduler, "running_batch", None)
        running = len(running_batch.reqs) if running_batch is not None else len(requests)
        index = tracer.record_step(
            start_ns,
            end_ns,
            prefill,
            decode,
            finished,
            kv_cache_usage=_kv_cache_usage(scheduler),
            waiting=waiting,
            running=running,
        )
        tracer.sweep_unless_held(index, lambda: _held_requests(scheduler))


def _step_key(batch: Any) -> int:
    """The step a batch belongs to: ``run_batch`` numbers it (``forward_iter``), and the overlap
    loop hands ``process_batch_result`` a copy of the batch (``batch.copy()``) that keeps it."""
    forward_iter = getattr(batch, "forward_iter", None)
    return forward_iter if isinstance(forward_iter, int) else id(batch)


def _kv_cache_usage(scheduler: Any) -> float:
    total = getattr(scheduler, "max_total_num_tokens", 0)
    allocator = getattr(scheduler, "token_to_kv_pool_allocator", None)
    if not total or allocator is None:
        return 0.0
    return max(0.0, min(1.0, 1.0 - allocator.available_size() / total))


def _held_requests(scheduler: Any) -> Collection[str]:
    held = {request.rid for request in scheduler.waiting_queue}
    running_batch = getattr(scheduler, "running_batch", None)
    if running_batch is not None:
        held.update(request.rid for request in running_batch.reqs)
    return held
