"""The node agent's own cost: sampling 8 GPUs at 10 Hz, and enriching spans with their samples.

Runs the real sampler (real ``pynvml``) against the stand-in NVML library the tests build
(``tests/node/fake_nvml.c``, compiled here with ``cc``): the NVML calls themselves are cheap
in the stand-in, so this measures the sampler's Python side (about 10 NVML calls per GPU per
tick, one tuple per sample; PCIe throughput and the process list once a second on the slow
thread). On a real GPU each NVML call adds its driver time: microseconds for the fast fields,
~21 ms per PCIe throughput call on an H100 (``--pcie-delay-us 21000`` makes the stand-in's PCIe
calls that slow, to show that they stay off the fast tick).

1. Sampling: the sampler's threads run for ``--seconds`` at ``--interval``; their CPU time over
   wall time is the share of one core they used (goal: <= 1%). Prints per fast tick its CPU and
   wall time, and the slow thread's CPU.
2. Enrichment: ``--requests`` requests of 4 phase spans each (request, prefill, decode, one
   engine step), each window spanning 2-20 samples of 2 of the 8 GPUs, enriched in one
   ``ExportTraceServiceRequest``, rounds interleaved; prints spans per second.

    python bench/nvml_sampler.py [--gpus 8] [--interval 0.1] [--seconds 10] [--requests 2000]
        [--pcie-delay-us 0]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)

from tests.node.nvml_stand_in import build_stand_in, load_for_pynvml
from tokentrace.agent import semconv
from tokentrace.agent.node.enrich import SpanEnricher
from tokentrace.agent.node.sampler import NvmlSampler


def measure_sampling(gpus: int, interval_s: float, seconds: float) -> float:
    sampler = NvmlSampler(interval_s=interval_s)
    assert sampler.start(), sampler.unavailable_reason
    started = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - started
    stats = sampler.stats()
    sampler.stop()
    ticks = max(1, stats["ticks"])
    share = (stats["tick_cpu_ns"] + stats["slow_cpu_ns"]) / 1e9 / wall
    print(
        f"sampling {gpus} GPUs every {interval_s * 1000:.0f} ms for {wall:.1f} s: "
        f"{stats['ticks']} ticks (expected {wall / interval_s:.0f}); fast tick "
        f"{stats['tick_cpu_ns'] / ticks / 1000:.0f} µs CPU, "
        f"{stats['tick_wall_ns'] / ticks / 1000:.0f} µs wall (max "
        f"{stats['max_tick_wall_ns'] / 1000:.0f}); slow thread {stats['slow_passes']} passes, "
        f"{stats['slow_cpu_ns'] / ticks / 1000:.0f} µs CPU per tick; both threads "
        f"{share * 100:.3f}% of one core (goal <= 1%)"
    )
    return share


def build_request(
    uuids: list[str], requests: int, start_ns: int, step_ns: int, rng: random.Random
) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    for index in range(requests):
        resource_spans = request.resource_spans.add()
        entry = resource_spans.resource.attributes.add(key=semconv.GPU_UUIDS)
        first = (index * 2) % len(uuids)
        for uuid in uuids[first : first + 2]:
            entry.value.array_value.values.add(string_value=uuid)
        spans = resource_spans.scope_spans.add().spans
        begin = start_ns + rng.randrange(0, 100) * step_ns
        prefill_end = begin + rng.randrange(2, 6) * step_ns
        end = prefill_end + rng.randrange(2, 15) * step_ns
        for name, low, high in (
            (semconv.SPAN_REQUEST, begin, end),
            (semconv.SPAN_PREFILL, begin, prefill_end),
            (semconv.SPAN_DECODE, prefill_end, end),
            (semconv.SPAN_ENGINE_STEP, prefill_end, prefill_end + step_ns // 20),
        ):
            span = spans.add(name=name, start_time_unix_nano=low, end_time_unix_nano=high)
            span.trace_id = index.to_bytes(16, "big")
            span.span_id = b"\x01" * 8
    return request


def measure_enrichment(requests: int, rounds: int) -> float:
    now = [0]

    def clock() -> int:
        now[0] += 100_000_000
        return now[0]

    sampler = NvmlSampler(clock=clock)
    assert sampler.open()
    for _ in range(200):
        sampler.sample_once()
    enricher = SpanEnricher(sampler)
    uuids = [device.uuid for device in sampler.devices]
    rng = random.Random(7)
    template = build_request(uuids, requests, 100_000_000 * 20, 100_000_000, rng)
    payload = template.SerializeToString()
    rates = []
    for _ in range(rounds):
        request = ExportTraceServiceRequest.FromString(payload)
        started = time.perf_counter()
        enricher.enrich(request)
        elapsed = time.perf_counter() - started
        rates.append(requests * 4 / elapsed)
    sampler.stop()
    rate = statistics.median(rates)
    print(
        f"enrichment: {requests * 4} spans (4 per request, 2 GPUs each) per round, median of "
        f"{rounds}: {rate:,.0f} spans/s (range {min(rates):,.0f}-{max(rates):,.0f})"
    )
    return rate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--interval", type=float, default=0.1)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--pcie-delay-us", type=int, default=0, help="an H100: ~21000")
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="tokentrace-nvml-"))
    stand_in = load_for_pynvml(build_stand_in(directory))
    stand_in.reset(args.gpus)
    for device in range(args.gpus):
        stand_in.set_ramp(device, "gpu_util", 10, 1)
        stand_in.add_process(device, pid=1000 + device, used_memory_bytes=8 << 30)
    stand_in.set_call_delay_us("nvmlDeviceGetPcieThroughput", args.pcie_delay_us)
    measure_sampling(args.gpus, args.interval, args.seconds)
    stand_in.reset(args.gpus)
    measure_enrichment(args.requests, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
