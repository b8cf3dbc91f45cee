"""The collector's per-trace processing (``Pipeline.process_trace``) with and without the C
functions (``processors/native.py``, ``agent/_wire.c``), A/B interleaved in fresh processes on
one pinned CPU.

    python bench/process_trace.py                 # ~1 minute
    python bench/process_trace.py --rounds 6 --requests 4000

Each round runs both variants (order alternating) over the same simulated ``mixed`` traces: a
process assembles them, then times ``process_trace`` over all of them ``--passes`` times and
reports the best pass in µs per trace. The ratio is C / pure Python per round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

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
    args = parser.parse_args()
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
