"""The engine-step tracer's cost inside vLLM's EngineCore busy loop, per step and per request.

Per step the tracer reads one clock, records the step's prefill requests, reads the outputs'
finish reasons and stores one tuple in its ring buffer; finished requests are handed to the
emitter as deferred jobs (planned off the busy loop). This measures ``on_scheduled`` +
``on_step_done`` on objects shaped like vLLM 0.32's ``SchedulerOutput`` / ``EngineCoreOutputs``
for a batch of N decoding requests, interleaved against the same loop without the tracer, with
the per-step work in C (``agent/_steps.c``) and with its Python twins, and prints ns per step
and per scheduled request for each. For scale: a decode step of a real model takes milliseconds.
Where ``_steps`` is built, vLLM's scheduler runs the step hooks in C instead of these methods
(``EngineStepTracer.native_hook``): ``bench/engine_step_instructions.py`` counts those.

Then, per finished request, the emitter thread's walk of the step ring for its token steps
(``token_step_ends``: C against its twin), alone and with the search of its slow gaps after it
(``outlier_gap_ends``), over a 4,096-step ring of batches of ``--batch``.

    python bench/engine_steps.py [--batch 16] [--steps 20000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from tokentrace.agent.finished_request import MIN_GAPS_FOR_OUTLIERS
from tokentrace.agent.frameworks import vllm_engine
from tokentrace.agent.frameworks.vllm_engine import (
    ENGINE_PARENT_HEADER,
    EngineStepTracer,
    StepRecord,
    engine_parent_header,
    outlier_gap_ends_python,
    token_step_ends_python,
)
from tokentrace.agent.hooks import HookGuard
from tokentrace.agent.recorder import MonotonicToUnix


@dataclass
class _Request:
    trace_headers: dict[str, str]
    events: list[Any] = field(default_factory=list)


@dataclass
class _Cached:
    """vLLM 0.32's ``CachedRequestData``: the ids and output counts, and its lookup by id."""

    req_ids: list[str]
    num_output_tokens: list[int]

    @cached_property
    def _req_id_to_num_output_tokens(self) -> dict[str, int]:
        return dict(zip(self.req_ids, self.num_output_tokens, strict=True))

    def is_context_phase(self, request_id: str) -> bool:
        num_output_tokens = self._req_id_to_num_output_tokens.get(request_id)
        return num_output_tokens is not None and num_output_tokens == 0


@dataclass
class _SchedulerOutput:
    num_scheduled_tokens: dict[str, int]
    scheduled_new_reqs: list[Any]
    scheduled_cached_reqs: _Cached


@dataclass
class _Output:
    request_id: str
    finish_reason: Any = None


@dataclass
class _Outputs:
    outputs: list[_Output]
    timestamp: float


class _KvCache:
    usage = 0.5


class _Scheduler:
    def __init__(self, batch: int) -> None:
        ids = [f"cmpl-{i}-0-abcd" for i in range(batch)]
        header = engine_parent_header(b"\x01" * 16, b"\x02" * 8, b"\x03" * 8)
        self.requests = {i: _Request({ENGINE_PARENT_HEADER: header}) for i in ids}
        self.kv_cache_manager = _KvCache()
        self.output = _SchedulerOutput({i: 1 for i in ids}, [], _Cached(ids, [5] * len(ids)))
        self.outputs = {0: _Outputs([_Output(i) for i in ids], time.monotonic())}

    def get_request_counts(self) -> tuple[int, int]:
        return len(self.requests), 0


def _run(scheduler: _Scheduler, tracer: EngineStepTracer | None, steps: int) -> float:
    output, outputs = scheduler.output, scheduler.outputs
    start = time.perf_counter_ns()
    if tracer is None:
        for _ in range(steps):
            time.monotonic_ns()  # the busy loop's own work is not measured: only the shape
    else:
        on_scheduled, on_step_done, clock = tracer.on_scheduled, tracer.on_step_done, tracer.clock
        for _ in range(steps):
            on_scheduled(output, clock())
            on_step_done(scheduler, output, outputs)
    return (time.perf_counter_ns() - start) / steps


def _ring_walk_ns(batch: int, rounds: int) -> dict[str, float]:
    """ns per finished request of ``token_step_ends`` (C, where built) and its twin, alone and
    with ``outlier_gap_ends`` after it (the emitter's work per finished request): a request
    that ran through 41 steps of a full 4,096-step ring, in the batch of every other step."""
    ring_steps, requests = 4096, 4 * batch
    ids = [f"cmpl-{number}-0" for number in range(requests)]
    ring: list[StepRecord | None] = [None] * ring_steps
    for number in range(ring_steps + 1000):
        scheduled = {ids[(number // 2 + k) % requests]: 1 for k in range(batch)}
        ring[number % ring_steps] = StepRecord(
            number, number * 1000, number * 1000 + 900, 0, batch, 0, batch, 0.5, 0, batch,
            scheduled, frozenset(),
        )  # fmt: skip
    last = ring_steps + 900
    arguments = (ring, last - 40, last, ids[((last - 30) // 2) % requests], last - 41)
    walks: dict[str, Callable[..., object]] = {
        "Python": token_step_ends_python,
        "Python, and its slow gaps": lambda *walked: outlier_gap_ends_python(
            token_step_ends_python(*walked), 3.0
        ),
    }
    c_walk, c_gaps = vllm_engine._TOKEN_STEP_ENDS, vllm_engine._OUTLIER_GAP_ENDS
    if c_walk is not None and c_gaps is not None:
        walks["C"] = c_walk
        walks["C, and its slow gaps"] = lambda *walked: c_gaps(
            c_walk(*walked), 3.0, MIN_GAPS_FOR_OUTLIERS
        )
    calls = 20_000
    timed: dict[str, list[float]] = {name: [] for name in walks}
    for _ in range(rounds):
        for name, walk in walks.items():
            start = time.perf_counter_ns()
            for _ in range(calls):
                walk(*arguments)
            timed[name].append((time.perf_counter_ns() - start) / calls)
    return {name: statistics.median(times) for name, times in timed.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    scheduler = _Scheduler(args.batch)
    jobs: list[Any] = []
    tracer = EngineStepTracer(
        jobs.append, guard=HookGuard(), to_unix=MonotonicToUnix(), sample_rate=0.0
    )
    loops = {"C": vllm_engine._STEP_FACTS, "Python": None}
    if not vllm_engine.BUILT:
        del loops["C"]
    bare: list[float] = []
    traced: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(args.rounds):
        bare.append(_run(scheduler, None, args.steps))
        for name, step_facts in loops.items():
            vllm_engine._STEP_FACTS = step_facts
            traced[name].append(_run(scheduler, tracer, args.steps))
    for name, times in traced.items():
        added = statistics.median(times) - statistics.median(bare)
        print(
            f"engine-step tracer, batch {args.batch}, per-step work in {name}: "
            f"{added:,.0f} ns per step "
            f"({added / args.batch:,.0f} ns per scheduled request); "
            f"median of {args.rounds} interleaved rounds of {args.steps:,} steps"
        )
    for name, ns in _ring_walk_ns(args.batch, args.rounds).items():
        print(f"a finished request's walk of the step ring (41 steps) in {name}: {ns:,.0f} ns")


if __name__ == "__main__":
    main()
