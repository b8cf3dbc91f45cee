"""The agent's cost on the serving thread: ns per token event and per request begin/finish.

Goal (issue 3): <= 500 ns per token event. The per-token work is one clock read and one list
append (or only the append, when the engine's step timestamp is reused); begin/finish are a dict
insert/pop and a deque append per request. A/B interleaved against an empty loop of the same
shape, so the printed numbers are the agent's share. Also what the hook guard adds to each
guarded hook call (``HookGuard.run``, in C where built, and its Python twin).

    python bench/agent_hot_path.py
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from tokentrace.agent.hooks import HookGuard
from tokentrace.agent.recorder import Recorder

_TOKENS = 200_000
_REQUESTS = 50_000
_ROUNDS = 7


def _per_token_clock_and_append(recorder: Recorder) -> float:
    timer = recorder.begin("bench")
    assert timer is not None
    append, clock = timer.token_ns.append, recorder.clock
    start = time.perf_counter_ns()
    for _ in range(_TOKENS):
        append(clock())
    elapsed = time.perf_counter_ns() - start
    recorder.finish("bench")
    return elapsed / _TOKENS


def _per_token_append_step_time(recorder: Recorder) -> float:
    timer = recorder.begin("bench")
    assert timer is not None
    append = timer.token_ns.append
    step_ns = recorder.clock()
    start = time.perf_counter_ns()
    for _ in range(_TOKENS):
        append(step_ns)
    elapsed = time.perf_counter_ns() - start
    recorder.finish("bench")
    return elapsed / _TOKENS


def _empty_token_loop(_: Recorder) -> float:
    start = time.perf_counter_ns()
    for _ in range(_TOKENS):
        pass
    return (time.perf_counter_ns() - start) / _TOKENS


def _per_request(recorder: Recorder) -> float:
    ids = [f"cmpl-{i}" for i in range(_REQUESTS)]
    begin, finish = recorder.begin, recorder.finish
    start = time.perf_counter_ns()
    for request_id in ids:
        begin(request_id)
        finish(request_id)
    return (time.perf_counter_ns() - start) / _REQUESTS


def _empty_request_loop(_: Recorder) -> float:
    ids = [f"cmpl-{i}" for i in range(_REQUESTS)]
    start = time.perf_counter_ns()
    for _request_id in ids:
        pass
    return (time.perf_counter_ns() - start) / _REQUESTS


def _hook(request_id: str, index: int) -> str:
    return request_id


def _guarded_calls(run: Callable[..., Any]) -> Callable[[Recorder], float]:
    """``run`` (a ``HookGuard.run``) called per request with a two-argument hook."""

    def case(_: Recorder) -> float:
        guard = HookGuard()
        ids = [f"cmpl-{i}" for i in range(_REQUESTS)]
        start = time.perf_counter_ns()
        for request_id in ids:
            run(guard, "bench", _hook, request_id, 1)
        return (time.perf_counter_ns() - start) / _REQUESTS

    return case


def _direct_calls(_: Recorder) -> float:
    ids = [f"cmpl-{i}" for i in range(_REQUESTS)]
    start = time.perf_counter_ns()
    for request_id in ids:
        _hook(request_id, 1)
    return (time.perf_counter_ns() - start) / _REQUESTS


def main() -> int:
    finished: deque[object] = deque(maxlen=1)  # the emitter's queue, without the emitter
    recorder = Recorder(finished.append)
    cases = {
        "token: clock read + append": _per_token_clock_and_append,
        "token: append of the engine's step time": _per_token_append_step_time,
        "token: empty loop (baseline)": _empty_token_loop,
        "request: begin + finish": _per_request,
        "request: empty loop (baseline)": _empty_request_loop,
        "guarded call: HookGuard.run": _guarded_calls(HookGuard.run),
        "guarded call: HookGuard.run_python (twin)": _guarded_calls(HookGuard.run_python),
        "guarded call: the hook alone (baseline)": _direct_calls,
    }
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(_ROUNDS):  # interleaved: every case once per round
        for name, case in cases.items():
            samples[name].append(case(recorder))
    medians = {name: statistics.median(values) for name, values in samples.items()}
    for name, value in medians.items():
        print(f"  {name:<42} {value:8.1f} ns")
    token = medians["token: clock read + append"] - medians["token: empty loop (baseline)"]
    request = medians["request: begin + finish"] - medians["request: empty loop (baseline)"]
    verdict = "met" if token <= 500 else "NOT met"
    print(f"\nper token event: {token:.0f} ns (goal <= 500 ns: {verdict})")
    print(f"per request (begin + finish): {request:.0f} ns")
    alone = medians["guarded call: the hook alone (baseline)"]
    in_c = "C" if HookGuard.run is not HookGuard.run_python else "Python: C not built"
    print(
        f"per guarded hook call: {medians['guarded call: HookGuard.run'] - alone:.0f} ns "
        f"({in_c}), twin {medians['guarded call: HookGuard.run_python (twin)'] - alone:.0f} ns"
    )
    print("reproduce: python bench/agent_hot_path.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
