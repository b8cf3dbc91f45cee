"""The SGLang instrumentation's cost on SGLang's serving paths: per token and per engine step.

- **per token** (frontend, ``TokenizerManager._handle_batch_output``): the hook body for one
  output batch of ``--batch`` running requests, each getting one token (a decode step's output),
  divided by the batch: one dict lookup, a clock read per batch and an append per request.
- **per step** (scheduler, ``Scheduler.process_batch_result``): the hook body for one decode
  step of ``--batch`` requests (the engine-step record, an append per request), and per request.

The hook bodies are the instrumentor's own methods, run on objects shaped like SGLang 0.5.23's
(``BatchStrOutput``, ``ScheduleBatch``, ``Req``, ``Scheduler``), so SGLang itself need not be
installed. Each figure is the median of ``--rounds`` rounds, less an empty loop of the same
shape (A/B interleaved).

    python bench/sglang_hooks.py [--batch 32] [--steps 20000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace
from typing import Any

from tokentrace.agent.frameworks.sglang import SglangInstrumentor
from tokentrace.agent.frameworks.vllm_engine import EngineStepTracer
from tokentrace.agent.hooks import HookGuard
from tokentrace.agent.recorder import MonotonicToUnix, Recorder


def _instrumentor(batch: int) -> tuple[SglangInstrumentor, list[str]]:
    instrumentor = SglangInstrumentor()
    instrumentor._recorder = Recorder(lambda timer: None, max_in_flight=1_000_000)
    instrumentor._guard = HookGuard()
    instrumentor._step_tracer = EngineStepTracer(
        lambda job: None, guard=instrumentor._guard, to_unix=MonotonicToUnix(), sample_rate=0.0
    )
    instrumentor._cold_start_tracer = None
    instrumentor._active = True
    instrumentor._open_steps = {}
    rids = [f"req-{i}" for i in range(batch)]
    for rid in rids:
        timer = instrumentor._recorder.begin(rid)
        assert timer is not None
        timer.first_scheduled_ns = 1  # past the first output: no time stats read
        instrumentor._step_tracer.track(rid, (b"\1" * 16, b"\2" * 8, b"\3" * 8))
    return instrumentor, rids


def _output(rids: list[str], step: int) -> Any:
    return SimpleNamespace(
        rids=rids,
        finished_reasons=[None] * len(rids),
        completion_tokens=[step] * len(rids),
        prompt_tokens=[32] * len(rids),
        cached_tokens=[0] * len(rids),
        time_stats=None,
    )


def _per_token(batch: int, steps: int) -> float:
    instrumentor, rids = _instrumentor(batch)
    outputs = [_output(rids, step + 1) for step in range(steps)]
    on_outputs = instrumentor._on_outputs
    start = time.perf_counter_ns()
    for output in outputs:
        on_outputs(output)
    return (time.perf_counter_ns() - start) / (steps * batch)


def _per_step(batch: int, steps: int) -> float:
    instrumentor, rids = _instrumentor(batch)
    requests = [
        SimpleNamespace(rid=rid, finished=lambda: False, output_ids=[1], time_stats=None)
        for rid in rids
    ]
    decode = SimpleNamespace(is_extend=lambda: False, is_decode=lambda: True)
    batch_object = SimpleNamespace(reqs=requests, forward_mode=decode, extend_lens=[])
    scheduler = SimpleNamespace(
        tp_rank=0,
        waiting_queue=[],
        running_batch=batch_object,
        max_total_num_tokens=32768,
        token_to_kv_pool_allocator=SimpleNamespace(available_size=lambda: 16384),
    )
    instrumentor._rank_zero = {id(scheduler): True}  # SGLang's rank, read once per scheduler
    on_step = instrumentor._on_step
    start = time.perf_counter_ns()
    for step in range(steps):
        on_step(scheduler, batch_object, step)
    return (time.perf_counter_ns() - start) / steps


def _empty(batch: int, steps: int) -> float:
    items = list(range(batch))
    start = time.perf_counter_ns()
    for _ in range(steps):
        for _item in items:
            pass
    return (time.perf_counter_ns() - start) / (steps * batch)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    token, step, empty = [], [], []
    for _ in range(args.rounds):
        empty.append(_empty(args.batch, args.steps))
        token.append(_per_token(args.batch, args.steps))
        step.append(_per_step(args.batch, args.steps))
    baseline = statistics.median(empty)
    per_token = statistics.median(token) - baseline
    per_step = statistics.median(step)
    print(f"batch {args.batch}, {args.steps} steps x {args.rounds} rounds (medians)")
    print(f"frontend, per token (output batch hook / batch):  {per_token:8.0f} ns")
    print(f"scheduler, per engine step:                        {per_step / 1000:8.2f} µs")
    print(f"scheduler, per request in the step:                {per_step / args.batch:8.0f} ns")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
