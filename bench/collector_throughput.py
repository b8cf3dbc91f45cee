"""Collector throughput on one core: receive -> assemble -> processors -> store + OTLP out.

The collector runs in this process pinned to one CPU. A helper process pinned to the other CPU
plays both neighbours: the senders (pre-serialised OTLP/gRPC export requests built from simulated
request traces) and the upstream OTLP receiver that the collector exports enriched spans to. The
clock runs from the first request sent until every request is in the store and every span has
been exported upstream. Then a single-threaded pass over the same data times each stage, to say
where the time goes.

    python bench/collector_throughput.py            # ~1-2 minutes
    python bench/collector_throughput.py --requests 2000   # quick look

``--compression none`` exports upstream uncompressed (default: gzip, the exporter's default,
which gRPC applies at zlib's level 6; docs/performance.md says what it costs).

``--tail-sampling SHARE`` runs the collector with tail sampling (its default rules, and SHARE as
``random_share``): only the traces kept are enriched, encoded, stored and exported. The clock
then stops when every request was derived, the kept ones stored and every queued span exported.

``--replicas N`` measures N collector processes behind trace-ID routing (the senders split every
export request by trace id with the node agent's rendezvous hashing) writing one store
(``--store postgresql``, the default then: a PostgreSQL server this benchmark starts with
``tests/postgres_server.py``), against one collector process on the same store, in alternating
runs: the ratio is the scaling. Each collector process is pinned to one CPU (replica i to CPU
i mod the CPU count); the senders, the upstream receiver and the PostgreSQL server float.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

_EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
_SENDER_THREADS = 4


def _pin(cpu: int) -> None:
    if hasattr(os, "sched_setaffinity") and cpu < (os.cpu_count() or 1):
        os.sched_setaffinity(0, {cpu})


def _neighbour(
    batches: list[bytes], collector_port_queue: Any, ready: Any, results: Any, cpu: int
) -> None:
    """Upstream receiver + sender, in one process on the other CPU."""
    import grpc

    _pin(cpu)
    received = {"bytes": 0, "calls": 0}

    def export(request: bytes, context: Any) -> bytes:
        received["bytes"] += len(request)
        received["calls"] += 1
        return b""  # an empty ExportTraceServiceResponse / ExportMetricsServiceResponse

    handler = grpc.method_handlers_generic_handler(
        "opentelemetry.proto.collector.trace.v1.TraceService",
        {"Export": grpc.unary_unary_rpc_method_handler(export)},
    )
    metrics_handler = grpc.method_handlers_generic_handler(
        "opentelemetry.proto.collector.metrics.v1.MetricsService",
        {"Export": grpc.unary_unary_rpc_method_handler(export)},
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((handler, metrics_handler))
    upstream_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    ready.put(upstream_port)

    collector_port = collector_port_queue.get()
    channel = grpc.insecure_channel(
        f"127.0.0.1:{collector_port}",
        options=[("grpc.max_send_message_length", 64 * 1024 * 1024)],
    )
    send = channel.unary_unary(_EXPORT_METHOD)  # bytes in, bytes out: no re-serialisation
    refused = 0

    def send_one(batch: bytes) -> int:
        retries = 0
        while True:
            try:
                send(batch, timeout=30)
                return retries
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                retries += 1
                time.sleep(0.05)

    started = time.perf_counter()
    with futures.ThreadPoolExecutor(max_workers=_SENDER_THREADS) as pool:
        refused = sum(pool.map(send_one, batches))
    results.put({"sent_s": time.perf_counter() - started, "refused": refused, "t0": started})
    time.sleep(3600)  # keep the upstream receiver up until the parent kills this process


def _build_batches(requests: int, seed: int) -> tuple[list[bytes], int, int]:
    from tokentrace.loadgen.replay.emit import to_otlp_requests
    from tokentrace.loadgen.replay.simulation import simulate

    simulated = simulate("mixed", requests=requests, seed=seed)
    messages = to_otlp_requests(simulated, batch_spans=512)
    spans = sum(
        len(scope.spans)
        for message in messages
        for resource in message.resource_spans
        for scope in resource.scope_spans
    )
    return [m.SerializeToString() for m in messages], spans, len(simulated)


def _collector_config(
    store_path: Path | str,
    upstream_port: int,
    spool_directory: Path | None = None,
    *,
    compression: str = "gzip",
    tail_sampling: float | None = None,
) -> Any:
    from tokentrace.collector.config import parse_config

    durability = {} if spool_directory is None else {"directory": str(spool_directory)}
    sampling = {} if tail_sampling is None else {"tail_sampling": {"random_share": tail_sampling}}
    return parse_config(
        {
            "service": {"durability": durability},
            "receivers": {"otlp": {"protocols": {"grpc": {"endpoint": "127.0.0.1:0"}}}},
            "processors": {
                "assembly": {"quiet_period": "1s", "root_grace": "20ms"},
                "slo": {
                    "targets": [
                        {"name": "ttft", "metric": "ttft", "percentile": 95, "threshold": "500ms"},
                        {"name": "tpot", "metric": "tpot", "percentile": 99, "threshold": "50ms"},
                    ]
                },
                **sampling,
            },
            "exporters": {
                "store": {"path": str(store_path)},
                "otlp": {
                    "endpoint": f"http://127.0.0.1:{upstream_port}",
                    "tls": {"insecure": True},
                    "compression": compression,
                    "sending_queue": {"queue_size": 10_000_000},
                },
            },
        },
        environ={},
    )


def _done(stats: dict[str, Any], spans: int, requests: int, sampled: bool) -> bool:
    """Whether the collector is through: every request derived and stored, every span exported.
    With tail sampling, every request derived, the kept traces' requests stored (the mixed
    traffic has one request per trace) and the upstream queue empty."""
    if stats.get("requests", 0) < requests:
        return False
    if not sampled:
        return stats.get("UpstreamSink.traces.sent_spans", 0) >= spans
    return (
        stats.get("pending_traces", 0) == 0
        and stats.get("StoreSink.written_requests", 0) >= _kept_traces(stats)
        and stats.get("UpstreamSink.traces.queue_len") == 0
    )


def _kept_traces(stats: dict[str, Any]) -> int:
    """The traces tail sampling kept, whatever the reason."""
    from tokentrace.agent import semconv
    from tokentrace.collector.self_telemetry import metric_key

    return sum(
        stats.get(metric_key(name), 0)
        for name in (
            semconv.SELF_METRIC_SAMPLING_KEPT_ALWAYS,
            semconv.SELF_METRIC_SAMPLING_KEPT_BREACH,
            semconv.SELF_METRIC_SAMPLING_KEPT_SLOWEST,
            semconv.SELF_METRIC_SAMPLING_KEPT_RARE,
            semconv.SELF_METRIC_SAMPLING_KEPT_RANDOM,
        )
    )


def end_to_end(
    batches: list[bytes],
    spans: int,
    requests: int,
    *,
    compression: str,
    tail_sampling: float | None = None,
) -> dict[str, float]:
    from tokentrace.collector.service import Collector, tune_gc_for_throughput

    _pin(0)
    context = multiprocessing.get_context("spawn")
    port_queue, ready, results = context.Queue(), context.Queue(), context.Queue()
    neighbour = context.Process(
        target=_neighbour, args=(batches, port_queue, ready, results, 1), daemon=True
    )
    neighbour.start()
    upstream_port = ready.get(timeout=60)
    with tempfile.TemporaryDirectory(prefix="tokentrace-bench-") as tmp:
        collector = Collector(
            _collector_config(
                Path(tmp) / "bench.db",
                upstream_port,
                compression=compression,
                tail_sampling=tail_sampling,
            )
        )
        collector.start()
        tune_gc_for_throughput()  # as `tokentrace collector` does
        cpu_before = time.process_time()
        wall_before = time.perf_counter()
        port_queue.put(collector.grpc_port)
        try:
            done_at = None
            last_print = 0.0
            sampled = tail_sampling is not None
            while done_at is None:
                time.sleep(0.05)
                stats = collector.stats()
                exported = stats.get("UpstreamSink.traces.sent_spans", 0)
                if _done(stats, spans, requests, sampled):
                    done_at = time.perf_counter()
                elif time.perf_counter() - last_print > 5:
                    last_print = time.perf_counter()
                    print(
                        f"  ... {stats.get('received_spans', 0)}/{spans} spans received, "
                        f"{stats.get('requests', 0)}/{requests} requests stored, "
                        f"{exported} spans exported",
                        flush=True,
                    )
                if time.perf_counter() - wall_before > 600:
                    raise SystemExit(f"bench: not done after 600 s: {stats}")
            cpu_used = time.process_time() - cpu_before
            sender = results.get(timeout=10)
            stats = collector.stats()
        finally:
            collector.shutdown(timeout_s=5)
            neighbour.kill()
    wall = done_at - wall_before
    return {
        "wall_s": wall,
        "cpu_s": cpu_used,
        "spans_per_s": spans / wall,
        "spans_per_cpu_s": spans / cpu_used,
        "send_s": sender["sent_s"],
        "refused": sender["refused"],
        "dropped": stats.get("UpstreamSink.traces.dropped_spans", 0),
        "kept_share": _kept_traces(stats) / max(1, stats.get("traces", 0)),
    }


def _route(batches: list[bytes], replicas: int) -> list[list[bytes]]:
    """Each export request split by trace id over ``replicas`` (as the node agent routes)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from tokentrace.agent.node.routing import EndpointHashes, split_by_owner

    endpoints = [f"replica-{number}" for number in range(replicas)]
    hashes = EndpointHashes(endpoints)
    routed: list[list[bytes]] = [[] for _ in range(replicas)]
    for batch in batches:
        parts = split_by_owner(ExportTraceServiceRequest.FromString(batch), hashes.owner)
        for endpoint, (part, _spans) in parts.items():
            routed[endpoints.index(endpoint)].append(
                batch if part is None else part.SerializeToString()
            )
    return routed


def _replica(
    number: int,
    store: str,
    spool: Path,
    upstream_port: int,
    compression: str,
    ports: Any,
    stop: Any,
    results: Any,
) -> None:
    """One collector process: reports its port, runs until ``stop``, reports its CPU time."""
    from tokentrace.collector.service import Collector, tune_gc_for_throughput

    _pin(number % (os.cpu_count() or 1))
    collector = Collector(_collector_config(store, upstream_port, spool, compression=compression))
    collector.start()
    tune_gc_for_throughput()
    cpu_before = time.process_time()
    ports.put((number, collector.grpc_port))
    stop.wait()
    cpu = time.process_time() - cpu_before
    stats = collector.stats()
    collector.shutdown(timeout_s=5)
    results.put((number, cpu, stats.get("requests", 0)))


def _routed_sender(routed: list[list[bytes]], ready: Any, results: Any, go: Any) -> None:
    """Upstream receiver + one sender per replica (each replica's share of the batches)."""
    import grpc

    received = {"calls": 0}

    def export(request: bytes, context: Any) -> bytes:
        received["calls"] += 1
        return b""

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers(
        tuple(
            grpc.method_handlers_generic_handler(
                service, {"Export": grpc.unary_unary_rpc_method_handler(export)}
            )
            for service in (
                "opentelemetry.proto.collector.trace.v1.TraceService",
                "opentelemetry.proto.collector.metrics.v1.MetricsService",
            )
        )
    )
    ready.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    collector_ports = go.get()
    sends = [
        grpc.insecure_channel(f"127.0.0.1:{port}").unary_unary(_EXPORT_METHOD)
        for port in collector_ports
    ]

    def send_all(replica: int) -> int:
        retries = 0
        for batch in routed[replica]:
            while True:
                try:
                    sends[replica](batch, timeout=30)
                    break
                except grpc.RpcError as error:
                    if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                        raise
                    retries += 1
                    time.sleep(0.05)
        return retries

    started = time.perf_counter()
    with futures.ThreadPoolExecutor(max_workers=len(routed) * 2) as pool:
        refused = sum(pool.map(send_all, range(len(routed))))
    results.put({"sent_s": time.perf_counter() - started, "refused": refused})
    time.sleep(3600)


def _machine_busy_s() -> float:
    """CPU seconds all CPUs have been busy since boot (``/proc/stat``; 0 where there is none)."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()[1:]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (``/proc``; 0 where there is none)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def replicas_end_to_end(
    batches: list[bytes],
    spans: int,
    requests: int,
    *,
    replicas: int,
    store: str,
    compression: str,
) -> dict[str, float]:
    """``replicas`` collector processes behind trace-ID routing into one store: wall clock from
    the first send until every request is stored."""
    from tokentrace.collector.store import open_store_readonly

    context = multiprocessing.get_context("spawn")
    routed = _route(batches, replicas)
    ready, sender_results, go = context.Queue(), context.Queue(), context.Queue()
    sender = context.Process(
        target=_routed_sender, args=(routed, ready, sender_results, go), daemon=True
    )
    sender.start()
    upstream_port = ready.get(timeout=60)
    ports, stop, results = context.Queue(), context.Event(), context.Queue()
    with tempfile.TemporaryDirectory(prefix="tokentrace-bench-") as tmp:
        locations = [
            store if store.startswith("postgresql") else str(Path(tmp) / f"replica{n}.db")
            for n in range(replicas)
        ]
        processes = [
            context.Process(
                target=_replica,
                args=(
                    n,
                    locations[n],
                    Path(tmp) / f"spool{n}",
                    upstream_port,
                    compression,
                    ports,
                    stop,
                    results,
                ),
                daemon=True,
            )
            for n in range(replicas)
        ]
        for process in processes:
            process.start()
        by_number = dict(ports.get(timeout=120) for _ in processes)
        started = time.perf_counter()
        busy_before = _machine_busy_s()
        assert sender.pid is not None
        sender_before = _process_cpu_s(sender.pid)
        go.put([by_number[n] for n in range(replicas)])
        readers = [open_store_readonly(location) for location in dict.fromkeys(locations)]
        try:
            while sum(reader.count() for reader in readers) < requests:
                time.sleep(0.05)
                if time.perf_counter() - started > 600:
                    raise SystemExit("bench: replicas not done after 600 s")
            wall = time.perf_counter() - started
            busy = _machine_busy_s() - busy_before
            sender_cpu = _process_cpu_s(sender.pid) - sender_before
        finally:
            for reader in readers:
                reader.close()
            stop.set()
            finished = [results.get(timeout=60) for _ in processes]
            for process in processes:
                process.join(30)
            sender.kill()
    cpu = sum(cpu_s for _, cpu_s, _ in finished)
    # The machine's other busy time in the run: senders, upstream receiver, PostgreSQL server,
    # this process's polling (the collectors' CPU is read at their stop, a little later).
    return {
        "wall_s": wall,
        "spans_per_s": spans / wall,
        "collector_cpu_s": cpu,
        "other_cpu_s": max(0.0, busy - cpu),
        "sender_cpu_s": sender_cpu,
    }


def stage_profile(batches: list[bytes], spans: int, *, compression: str) -> list[tuple[str, float]]:
    """Each stage alone over the same data, single-threaded: seconds per stage."""
    import zlib

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from tokentrace.collector.pipeline import Pipeline, group_by_trace
    from tokentrace.collector.receivers.validate import sanitize
    from tokentrace.collector.store import RequestStore

    timings: dict[str, float] = {}

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        result = fn()
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start
        return result

    config = _collector_config(Path("unused.db"), 1)
    pipeline = Pipeline(config)
    messages = timed(
        "parse protobuf", lambda: [ExportTraceServiceRequest.FromString(b) for b in batches]
    )
    # As the receiver does: the checks and the grouping over the received bytes too.
    timed(
        "validate",
        lambda: [sanitize(m, encoded=b) for m, b in zip(messages, batches, strict=True)],
    )
    for message, batch in zip(messages, batches, strict=True):
        groups, count = timed(
            "group by trace", lambda m=message, b=batch: group_by_trace(m, encoded=b)
        )
        timed("assembly add", lambda g=groups, c=count: pipeline.assembler.add(g, c))
    traces = timed("assembly pop", lambda: pipeline.assembler.pop_finished(flush_all=True))
    processed = timed(
        "processors (normalise, budget, diagnosis, SLO, percentiles, enrich, encode)",
        lambda: [pipeline.process_trace(t) for t in traces],
    )
    with tempfile.TemporaryDirectory(prefix="tokentrace-bench-") as tmp:
        store = RequestStore(Path(tmp) / "profile.db")
        for start in range(0, len(processed), 256):
            chunk = processed[start : start + 256]
            timed(
                "store write (SQLite)",
                lambda c=chunk: store.write([(p.trace, p.records, p.otlp) for p in c]),
            )
        store.close()
    for start in range(0, len(processed), 64):
        chunk = processed[start : start + 64]
        joined = timed(
            "OTLP out: join pre-encoded traces", lambda c=chunk: b"".join(p.otlp for p in c)
        )
        if compression == "gzip":  # what gRPC's C core does to each export, at its level
            timed(
                "OTLP out: gzip (gRPC's fixed zlib level 6)", lambda j=joined: zlib.compress(j, 6)
            )
    return [(name, seconds) for name, seconds in timings.items()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="N > 1: N collectors behind trace-ID routing against one (alternating runs)",
    )
    parser.add_argument(
        "--store",
        choices=("sqlite", "postgresql"),
        help="with --replicas: the store the replicas share (default postgresql; sqlite: one "
        "file per replica)",
    )
    parser.add_argument(
        "--compression",
        choices=("gzip", "none"),
        default="gzip",
        help="of the collector's OTLP/gRPC export upstream (default gzip, the exporter's default)",
    )
    parser.add_argument(
        "--tail-sampling",
        type=float,
        metavar="SHARE",
        help="tail sampling on, SHARE its random_share (one collector only)",
    )
    args = parser.parse_args()
    if args.tail_sampling is not None and not 0 <= args.tail_sampling <= 1:
        parser.error("--tail-sampling: a share between 0 and 1")
    if args.tail_sampling is not None and args.replicas > 1:
        parser.error("--tail-sampling measures one collector: not with --replicas")
    if args.replicas > 1:
        return _main_replicas(args)

    print(f"building {args.requests} simulated request traces ...", flush=True)
    batches, spans, requests = _build_batches(args.requests, args.seed)
    print(
        f"{requests} requests, {spans} spans in {len(batches)} OTLP export requests "
        f"({sum(map(len, batches)) / spans:.0f} B/span)\n",
        flush=True,
    )

    results = [
        end_to_end(
            batches, spans, requests, compression=args.compression, tail_sampling=args.tail_sampling
        )
        for _ in range(args.runs)
    ]
    rate = statistics.median(r["spans_per_s"] for r in results)
    sampling = "" if args.tail_sampling is None else f", tail sampling {args.tail_sampling:g}"
    print(
        f"\nend to end, collector pinned to one CPU, upstream export {args.compression}{sampling}:"
    )
    for r in results:
        print(
            f"  {r['spans_per_s']:>9,.0f} spans/s wall ({r['wall_s']:.2f} s), "
            f"{r['spans_per_cpu_s']:>9,.0f} spans per collector CPU-second, "
            f"refused batches retried: {r['refused']}, upstream drops: {r['dropped']}"
            + ("" if args.tail_sampling is None else f", traces kept: {r['kept_share']:.1%}")
        )
    print(
        f"  median: {rate:,.0f} spans/s ({rate * requests / spans:,.0f} requests/s); "
        f"goal >= 50,000 spans/s: {'met' if rate >= 50_000 else 'NOT met'}"
    )

    print("\nwhere the time goes (each stage alone, one thread, same data):")
    profile = stage_profile(batches, spans, compression=args.compression)
    total = sum(seconds for _, seconds in profile)
    for name, seconds in sorted(profile, key=lambda item: -item[1]):
        print(f"  {name:<70} {seconds / spans * 1e6:6.2f} us/span  {seconds / total:6.1%}")
    print(
        f"  {'total':<70} {total / spans * 1e6:6.2f} us/span "
        f"(= {spans / total:,.0f} spans/s without threads, gRPC and queues)"
    )
    print(
        f"\nreproduce: python bench/collector_throughput.py --requests {args.requests} "
        f"--seed {args.seed} --runs {args.runs} --compression {args.compression}"
        + ("" if args.tail_sampling is None else f" --tail-sampling {args.tail_sampling:g}")
    )
    return 0


def _postgres_server() -> Any:
    """The tests' PostgreSQL server (started only for ``--store postgresql``: a machine without
    PostgreSQL's binaries can still measure replicas on SQLite)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.postgres_server
    from tests.postgres_server import running_postgres

    return running_postgres()


def _main_replicas(args: argparse.Namespace) -> int:
    store_kind = args.store or "postgresql"
    print(f"building {args.requests} simulated request traces ...", flush=True)
    batches, spans, requests = _build_batches(args.requests, args.seed)
    print(f"{requests} requests, {spans} spans; {args.replicas} replicas vs 1, {store_kind}\n")
    rows: dict[int, list[dict[str, float]]] = {1: [], args.replicas: []}
    with _postgres_server() if store_kind == "postgresql" else contextlib.nullcontext() as server:
        for run in range(args.runs):
            order = (1, args.replicas) if run % 2 == 0 else (args.replicas, 1)
            for replicas in order:
                location = server.create_database() if server is not None else "sqlite"
                result = replicas_end_to_end(
                    batches,
                    spans,
                    requests,
                    replicas=replicas,
                    store=location,
                    compression=args.compression,
                )
                rows[replicas].append(result)
                print(
                    f"  run {run + 1}: {replicas} replica(s): {result['spans_per_s']:>9,.0f} "
                    f"spans/s ({result['wall_s']:.2f} s, collectors' CPU "
                    f"{result['collector_cpu_s']:.1f} s, the rest of the machine "
                    f"{result['other_cpu_s']:.1f} s of which senders and upstream "
                    f"{result['sender_cpu_s']:.1f} s)",
                    flush=True,
                )
    one = statistics.median(r["spans_per_s"] for r in rows[1])
    many = statistics.median(r["spans_per_s"] for r in rows[args.replicas])
    print(
        f"\nmedian: 1 replica {one:,.0f} spans/s, {args.replicas} replicas {many:,.0f} spans/s: "
        f"{many / one:.2f}x (goal >= 1.8x for 2 replicas on 2 cores)"
    )
    print(
        f"\nreproduce: python bench/collector_throughput.py --requests {args.requests} "
        f"--seed {args.seed} --runs {args.runs} --replicas {args.replicas} --store {store_kind} "
        f"--compression {args.compression}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
