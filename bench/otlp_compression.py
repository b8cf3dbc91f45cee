"""What gzip costs an OTLP exporter, per zlib level: the collector's enriched export batches
(simulated ``mixed`` traffic through ``Pipeline.process_trace``) and the agent's batches of a
typical request (``span_building.typical_finished_request``).

gRPC compresses at zlib's default level (6), which nothing in grpcio can change; the OTLP/HTTP
transport (``agent/otlp_transport.py``) compresses at ``_GZIP_LEVEL``. Levels alternate per
round; medians are reported.

    python bench/otlp_compression.py                  # ~5 s
    python bench/otlp_compression.py --requests 1000 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import zlib
from pathlib import Path
from typing import Final

_LEVELS: Final = (1, 6)
_BATCH_TRACES: Final = 256
"""Traces per collector export batch (about what the pipeline's batches hold at this load)."""
_AGENT_BATCH: Final = 64


def collector_batches(requests: int) -> tuple[list[bytes], int]:
    """The collector's upstream export batches of ``requests`` simulated requests, and the
    number of spans in them."""
    from collector_throughput import _collector_config

    from tokentrace.collector.pipeline import Pipeline, group_by_trace
    from tokentrace.loadgen.replay.emit import to_otlp_requests
    from tokentrace.loadgen.replay.simulation import simulate

    pipeline = Pipeline(_collector_config("unused.db", 1))
    spans = 0
    for message in to_otlp_requests(simulate("mixed", requests=requests, seed=1), batch_spans=512):
        received = message.SerializeToString()
        groups, count = group_by_trace(type(message).FromString(received), encoded=received)
        pipeline.assembler.add(groups, count)
        spans += count
    processed = [pipeline.process_trace(t) for t in pipeline.assembler.pop_finished(flush_all=True)]
    batches = [
        b"".join(p.otlp for p in processed[start : start + _BATCH_TRACES] if p is not None)
        for start in range(0, len(processed), _BATCH_TRACES)
    ]
    return batches, spans


def agent_batches() -> tuple[list[bytes], int]:
    """One agent export batch of ``_AGENT_BATCH`` typical requests, and its request count."""
    from span_building import agent_encode, typical_finished_request

    return [agent_encode([typical_finished_request(n) for n in range(_AGENT_BATCH)])], _AGENT_BATCH


def compress_cost(batches: list[bytes], level: int) -> tuple[float, int]:
    """Seconds to gzip every batch at ``level``, and the compressed bytes."""
    started = time.perf_counter()
    size = sum(len(zlib.compress(batch, level, wbits=31)) for batch in batches)
    return time.perf_counter() - started, size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    cases = {
        "collector, per span": collector_batches(args.requests),
        "agent, per request": agent_batches(),
    }
    for name, (batches, units) in cases.items():
        raw = sum(map(len, batches))
        seconds: dict[int, list[float]] = {level: [] for level in _LEVELS}
        sizes: dict[int, int] = {}
        for round_number in range(args.rounds):
            order = _LEVELS if round_number % 2 == 0 else _LEVELS[::-1]
            for level in order:
                elapsed, sizes[level] = compress_cost(batches, level)
                seconds[level].append(elapsed)
        print(f"{name} ({raw / units:,.0f} bytes each):")
        for level in _LEVELS:
            cost = statistics.median(seconds[level]) / units * 1e6
            print(
                f"  zlib level {level}: {cost:6.2f} us, {raw / sizes[level]:5.2f}x smaller, "
                f"{sizes[level] / units:7,.0f} bytes"
            )
    print(
        f"\nreproduce: python bench/otlp_compression.py --requests {args.requests} "
        f"--rounds {args.rounds}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
