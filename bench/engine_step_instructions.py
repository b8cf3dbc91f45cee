"""Instructions the engine-step tracing adds per EngineCore step, counted by cachegrind.

On this shared two-core machine the wall time of one engine step's hooks moves by 2x between
runs (``bench/engine_steps.py`` gives medians that disagree by more than the changes being
measured); an instruction count does not move. This runs a child under ``valgrind
--tool=cachegrind`` that drives vLLM's ``Scheduler.schedule`` / ``update_from_output`` as
patched by the real ``VllmInstrumentor`` (the stand-in vLLM modules of the tests, a scheduler
whose two methods return the same decode-only batch), for two step counts with and without the
instrumentation, and prints the instructions added per step (the difference of differences
cancels start-up). ``--calls`` also prints what one call through each kind of patch costs
(``patching.Patch.direct``: the patch's own function, here one that only calls the original).

    python bench/engine_step_instructions.py [--batches 2,16] [--calls]

Needs valgrind. Instruction counts are a proxy for CPU time, not a measure of it (a cache miss
costs more than an add), good for before/after on the same code path.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
_STEPS = (1_000, 3_000)
_CALLS = (10_000, 30_000)
_CACHEGRIND = ("valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null")


def _child_steps(batch: int, steps: int, traced: bool) -> None:
    sys.path.insert(0, str(_ROOT))
    from bench.engine_steps import _Scheduler
    from tests.agent.vllm_stand_ins import Recorder, stand_in_modules
    from tokentrace.agent.frameworks.vllm import VllmInstrumentor
    from tokentrace.agent.frameworks.vllm_engine import EngineStepTracer
    from tokentrace.agent.hooks import HookGuard
    from tokentrace.agent.recorder import MonotonicToUnix

    sys.modules.update(stand_in_modules())

    class Scheduler(_Scheduler):
        def schedule(self) -> Any:
            return self.output

        def update_from_output(self, output: Any, runner_output: Any) -> Any:
            return self.outputs

    sys.modules["vllm.v1.core.sched.scheduler"].Scheduler = Scheduler  # type: ignore[attr-defined]
    guard = HookGuard()
    tracer = EngineStepTracer(
        [].append, guard=guard, to_unix=MonotonicToUnix(), sample_rate=0.01, seed=1
    )
    if traced:
        recorder = Recorder(lambda timer: None)
        VllmInstrumentor().instrument(
            skip_dep_check=True, recorder=recorder, guard=guard, step_tracer=tracer
        )
    scheduler = Scheduler(batch)
    for _ in range(steps):
        scheduler.update_from_output(scheduler.schedule(), None)
    if tracer.steps != (steps if traced else 0):  # what is counted must be what is meant
        raise SystemExit(f"the tracer recorded {tracer.steps} of {steps} steps")


def _child_calls(kind: str, calls: int) -> None:
    from tokentrace.agent.frameworks.patching import AppliedPatch, Patch, apply_patch

    class Engine:
        def step(self, batch: Any = None) -> int:
            return 1

    class Instrumentor:
        def _wrap(self, wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
            return wrapped(*args, **kwargs)

        def _direct(self, original: Any) -> Any:
            def patched(engine: Any, *args: Any, **kwargs: Any) -> Any:
                return original(engine, *args, **kwargs)

            return patched

    module: Any = type(sys)("engine_stand_in")
    module.Engine = Engine
    applied: list[AppliedPatch] = []
    if kind != "none":
        direct = "_direct" if kind == "direct" else None
        patch = Patch("engine_stand_in", "Engine.step", "_wrap", direct=direct)
        apply_patch(Instrumentor(), patch, module, applied)
    engine = Engine()
    for _ in range(calls):
        engine.step(1)


def _instructions(*arguments: str) -> int:
    done = subprocess.run(
        [*_CACHEGRIND, sys.executable, __file__, "--child", *arguments],
        capture_output=True,
        text=True,
        check=True,
    )
    found = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
    if found is None:
        raise SystemExit(f"cachegrind printed no instruction count:\n{done.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def _per_unit(counts: tuple[int, int], arguments: list[str]) -> float:
    few, many = (_instructions(*arguments, str(count)) for count in counts)
    return (many - few) / (counts[1] - counts[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="2,16", help="decode batch sizes (comma-separated)")
    parser.add_argument("--calls", action="store_true", help="also the cost of one patched call")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.child[0] == "calls":
            _child_calls(args.child[1], int(args.child[2]))
        else:
            _child_steps(int(args.child[1]), int(args.child[3]), args.child[2] == "traced")
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed here (apt-get install valgrind)")
    for batch in (int(b) for b in args.batches.split(",")):
        traced = _per_unit(_STEPS, ["steps", str(batch), "traced"])
        bare = _per_unit(_STEPS, ["steps", str(batch), "bare"])
        print(
            f"batch {batch:3d}: {traced - bare:9,.0f} instructions per step added by the "
            f"tracing ({traced:,.0f} traced, {bare:,.0f} bare)",
            flush=True,
        )
    if args.calls:
        none = _per_unit(_CALLS, ["calls", "none"])
        for kind in ("wrapt", "direct"):
            added = _per_unit(_CALLS, ["calls", kind]) - none
            print(f"one call through a {kind} patch: {added:7,.0f} instructions added", flush=True)


if __name__ == "__main__":
    main()
