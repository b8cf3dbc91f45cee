"""The collector's per-trace processing (``Pipeline.process_trace``) with and without the C
functions (``processors/native.py``, ``agent/_wire.c``), A/B interleaved in fresh processes on
one pinned CPU.

    python bench/process_trace.py                 # ~1 minute
    python bench/process_trace.py --rounds 6 --requests 4000

Each round runs both variants (order alternating) over the same simulated ``mixed`` traces: a
process assembles them, then times ``process_trace`` over all of them ``--passes`` times and
reports the best pass in µs per trace. The ratio is C / pure Python per round.

    python bench/process_trace.py --instructions   # ~2 minutes; needs valgrind

counts instead the instructions ``process_trace`` executes per trace (cachegrind: a child that
assembles the same simulated traces processes the first 200 or the first 600 of them, with
fixed times (the simulation's, the clocks) and the open percentile slice read every 100
traces; the difference over the 400 cancels start-up). On this shared machine wall times move
by more than a small change; an instruction count does not (a proxy for CPU time, not a
measure of it: a cache miss costs more than an add), so it tells two commits apart where
timings cannot.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Final

_CHILD = """
import json, os, sys, time
if hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, {0})
sys.path.insert(0, sys.argv[1])
from collector_throughput import _collector_config
from tokentrace.collector.pipeline import Pipeline, group_by_trace
from tokentrace.loadgen.replay.emit import to_otlp_requests
from tokentrace.loadgen.replay.simulation import simulate
from tokentrace.processors import native
requests, passes = int(sys.argv[2]), int(sys.argv[3])
messages = to_otlp_requests(simulate("mixed", requests=requests, seed=1), batch_spans=512)
best = float("inf")
for _ in range(passes):
    pipeline = Pipeline(_collector_config("unused.db", 1))
    for message in messages:  # parsed from their bytes, which C keeps per span
        received = message.SerializeToString()
        groups, count = group_by_trace(type(message).FromString(received), encoded=received)
        pipeline.assembler.add(groups, count)
    traces = pipeline.assembler.pop_finished(flush_all=True)
    started = time.perf_counter()
    for trace in traces:
        pipeline.process_trace(trace)
    best = min(best, (time.perf_counter() - started) / len(traces))
print(json.dumps({"built": native.BUILT, "us_per_trace": best * 1e6}))
"""

_INSTRUCTIONS_CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
from collector_throughput import _collector_config
from tokentrace.collector.pipeline import Pipeline, group_by_trace
from tokentrace.loadgen.replay.emit import to_otlp_requests
from tokentrace.loadgen.replay.simulation import simulate
requests, processed = int(sys.argv[2]), int(sys.argv[3])
simulated = simulate("mixed", requests=requests, seed=1, start_unix_ns=1_700_000_000 * 10**9)
messages = to_otlp_requests(simulated, batch_spans=512, host_name="bench", pid=1)
# Fixed clocks: the same percentile slice for every trace, whenever the child runs.
pipeline = Pipeline(
    _collector_config("unused.db", 1), monotonic=lambda: 1000.0, wall_clock=lambda: 1.8e9
)
for message in messages:
    received = message.SerializeToString()
    groups, count = group_by_trace(type(message).FromString(received), encoded=received)
    pipeline.assembler.add(groups, count)
traces = pipeline.assembler.pop_finished(flush_all=True)
if len(traces) < processed:
    raise SystemExit(f"{len(traces)} traces, fewer than {processed}")
for number, trace in enumerate(traces[:processed], 1):
    pipeline.process_trace(trace)
    if number % 100 == 0:  # the open slice read, as the pipeline's housekeeping reads it
        pipeline.make_tick()
"""
_INSTRUCTION_TRACES: Final = (200, 600)
_CACHEGRIND: Final = (
    "valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null"
)  # fmt: skip


def _instructions(processed: int) -> int:
    bench = str(Path(__file__).resolve().parent)
    done = subprocess.run(
        [*_CACHEGRIND, sys.executable, "-c", _INSTRUCTIONS_CHILD, bench,
         str(_INSTRUCTION_TRACES[1]), str(processed)],
        capture_output=True,
        text=True,
        # The same string hashes run to run, and no BLAS threads spinning beside the child.
        env={**os.environ, "PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1"},
        check=False,
    )  # fmt: skip
    found = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"bench: the child under cachegrind failed:\n{done.stderr[-3000:]}")
    return int(found.group(1).replace(",", ""))


def instructions_per_trace() -> float:
    """Instructions ``process_trace`` executes per trace (module docstring)."""
    if shutil.which("valgrind") is None:
        raise SystemExit("bench: valgrind is not installed here (apt-get install valgrind)")
    few, many = (_instructions(count) for count in _INSTRUCTION_TRACES)
    return (many - few) / (_INSTRUCTION_TRACES[1] - _INSTRUCTION_TRACES[0])


def _run(pure: bool, requests: int, passes: int) -> float:
    bench = str(Path(__file__).resolve().parent)
    environment = {**os.environ, "TOKENTRACE_PURE_PYTHON": "1" if pure else ""}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, bench, str(requests), str(passes)],
        capture_output=True,
        text=True,
        env=environment,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"bench: the child failed:\n{done.stderr[-3000:]}")
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    if answer["built"] == pure:
        raise SystemExit("bench: the C functions are not built (make install builds them)")
    return float(answer["us_per_trace"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="count the instructions per trace with cachegrind instead of timing",
    )
    args = parser.parse_args()
    if args.instructions:
        count = instructions_per_trace()
        pure = " (TOKENTRACE_PURE_PYTHON=1)" if os.environ.get("TOKENTRACE_PURE_PYTHON") else ""
        print(f"process_trace: {count:,.0f} instructions per trace{pure}")
        print("reproduce: python bench/process_trace.py --instructions")
        return 0
    ratios = []
    for round_number in range(args.rounds):
        order = (False, True) if round_number % 2 == 0 else (True, False)
        timings = {pure: _run(pure, args.requests, args.passes) for pure in order}
        ratios.append(timings[False] / timings[True])
        print(
            f"round {round_number + 1}: C {timings[False]:6.1f} us/trace, "
            f"pure Python {timings[True]:6.1f} us/trace, ratio {ratios[-1]:.3f}",
            flush=True,
        )
    print(
        f"median ratio C / pure Python: {statistics.median(ratios):.3f} "
        f"(range {min(ratios):.3f}-{max(ratios):.3f})"
    )
    print(
        f"reproduce: python bench/process_trace.py --rounds {args.rounds} "
        f"--requests {args.requests} --passes {args.passes}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
