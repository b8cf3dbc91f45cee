"""Whether the sampler's fast tick costs more while the slow thread reads NVML beside it.

On an H100 and an H200 the fast tick's mean CPU in the running sampler was ~6x one ``tick()``
timed alone (docs/node-agent.md, "On a real GPU"). This times ``tick()`` (CPU and wall, 150
ticks 20 ms apart) alone, then with a thread calling ``read_slow`` back to back (every cadence
due: PCIe TX/RX and the process list each pass, as the slow thread does once a second), then
alone again. Needs a GPU; on the GPU machine, after ``bench/gpu_machine/checks.sh``'s set-up
lines (the wheels in ``/tmp/site``, tokentrace importable):

    python3 bench/gpu_machine/tick_beside_slow.py
"""

from __future__ import annotations

import threading
import time

from tokentrace.agent.node.sampler import NvmlSampler

_TICKS = 150


def _ticks(sampler: NvmlSampler, count: int) -> tuple[list[int], list[int]]:
    cpu, wall = [], []
    for _ in range(count):
        started_cpu, started_wall = time.thread_time_ns(), time.perf_counter_ns()
        sampler.tick()
        cpu.append(time.thread_time_ns() - started_cpu)
        wall.append(time.perf_counter_ns() - started_wall)
        time.sleep(0.02)
    return cpu, wall


def _show(name: str, timings: tuple[list[int], list[int]]) -> None:
    for label, values in zip(("CPU", "wall"), timings, strict=True):
        ordered = sorted(values)
        print(
            f"{name:>18} {label:>4}: median {ordered[len(ordered) // 2] / 1e3:8.1f}  "
            f"mean {sum(ordered) / len(ordered) / 1e3:8.1f}  "
            f"p90 {ordered[int(len(ordered) * 0.9)] / 1e3:8.1f}  max {ordered[-1] / 1e3:8.1f} us"
        )


def main() -> None:
    sampler = NvmlSampler(interval_s=0.1)
    if not sampler.open():
        raise SystemExit(f"no GPU to sample: {sampler.unavailable_reason}")
    stop = threading.Event()
    slow_cpu: list[int] = []

    def read_slow_back_to_back() -> None:
        now = time.time_ns()
        while not stop.is_set():
            now += 10**10  # every cadence due
            started = time.thread_time_ns()
            sampler.read_slow(now)
            slow_cpu.append(time.thread_time_ns() - started)

    _ticks(sampler, 10)  # first-call costs
    _show("alone", _ticks(sampler, _TICKS))
    beside = threading.Thread(target=read_slow_back_to_back)
    beside.start()
    _show("beside read_slow", _ticks(sampler, _TICKS))
    stop.set()
    beside.join()
    _show("alone again", _ticks(sampler, _TICKS))
    mean_us = sum(slow_cpu) / max(1, len(slow_cpu)) / 1e3
    print(f"slow passes beside: {len(slow_cpu)}, {mean_us:.0f} us CPU each")
    sampler.stop()


if __name__ == "__main__":
    main()
