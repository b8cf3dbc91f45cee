"""What durable acknowledgement costs: durability ``fsync`` against ``none``, A/B interleaved.

One process runs a collector (gRPC receiver on loopback, store in a temporary directory) and
eight sender threads, each exporting one small request trace (6 spans) per call through the
OTLP gRPC stub as fast as the collector answers. Rounds alternate between a collector with
durability ``fsync`` (the write-ahead spool, group commit) and one with ``none``, each on a fresh
store, so drift on the machine hits both alike. Reported per mode: accepted spans/s and the
per-export latency p50 / p99 over all rounds, then the ratios fsync / none.

    python bench/durability.py                 # 3 rounds of 5 s per mode, ~40 s
    python bench/durability.py --rounds 5 --seconds 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub

from tokentrace.agent import semconv
from tokentrace.collector.config import parse_config
from tokentrace.collector.service import Collector

_SENDERS = 8
_MODES = ("fsync", "none")


def _request(number: int) -> tuple[ExportTraceServiceRequest, int]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.spanbuild import request_spans  # the test suite's span builder

    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    attribute = resource_spans.resource.attributes.add(key=semconv.SERVICE_NAME)
    attribute.value.string_value = "bench"
    spans = request_spans(trace_id=number.to_bytes(16, "big"), start_ns=time.time_ns())
    resource_spans.scope_spans.add().spans.extend(spans)
    return request, len(spans)


def _round(mode: str, seconds: float, directory: Path) -> tuple[int, list[float]]:
    raw: dict[str, Any] = {
        "receivers": {"otlp": {"protocols": {"grpc": {"endpoint": "127.0.0.1:0"}}}},
        "exporters": {"store": {"path": str(directory / "store.db")}},
        "service": {"durability": {"mode": mode}},
    }
    collector = Collector(parse_config(raw, environ={}))
    collector.start()
    latencies: list[float] = []
    spans = 0
    lock = threading.Lock()
    stop = threading.Event()
    counter = iter(range(1, 10**9))

    def sender() -> None:
        nonlocal spans
        mine: list[float] = []
        sent = 0
        with grpc.insecure_channel(f"127.0.0.1:{collector.grpc_port}") as channel:
            stub = TraceServiceStub(channel)
            while not stop.is_set():
                with lock:
                    number = next(counter)
                request, count = _request(number)
                started = time.perf_counter()
                try:
                    stub.Export(request, timeout=10)
                except grpc.RpcError:
                    continue
                mine.append(time.perf_counter() - started)
                sent += count
        with lock:
            latencies.extend(mine)
            spans += sent

    threads = [threading.Thread(target=sender) for _ in range(_SENDERS)]
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    collector.shutdown()
    return spans, latencies


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    results: dict[str, dict[str, Any]] = {m: {"spans": 0, "lat": [], "rates": []} for m in _MODES}
    with tempfile.TemporaryDirectory(prefix="tokentrace-durability-") as tmp:
        for index in range(args.rounds):
            for mode in _MODES if index % 2 == 0 else reversed(_MODES):
                directory = Path(tmp) / f"{mode}-{index}"
                directory.mkdir()
                spans, latencies = _round(mode, args.seconds, directory)
                rate = spans / args.seconds
                results[mode]["spans"] += spans
                results[mode]["lat"].extend(latencies)
                results[mode]["rates"].append(rate)
                print(
                    f"round {index + 1} {mode:>5}: {rate:8.0f} spans/s, "
                    f"p50 {_percentile(latencies, 0.5) * 1e3:6.2f} ms, "
                    f"p99 {_percentile(latencies, 0.99) * 1e3:6.2f} ms",
                    flush=True,
                )
    print(f"\n{_SENDERS} senders, 1 trace (6 spans) per export, {args.rounds} x {args.seconds:g} s")
    summary = {}
    for mode in _MODES:
        lat = results[mode]["lat"]
        rate = statistics.median(results[mode]["rates"])
        p50, p99 = _percentile(lat, 0.5), _percentile(lat, 0.99)
        summary[mode] = (rate, p50, p99)
        print(
            f"{mode:>5}: {rate:8.0f} spans/s (median of rounds), export latency "
            f"p50 {p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms"
        )
    (rate_f, p50_f, p99_f), (rate_n, p50_n, p99_n) = summary["fsync"], summary["none"]
    print(
        f"fsync / none: throughput x{rate_f / rate_n:.2f}, p50 x{p50_f / p50_n:.2f}, "
        f"p99 x{p99_f / p99_n:.2f}"
    )


if __name__ == "__main__":
    main()
