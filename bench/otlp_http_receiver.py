"""The OTLP/HTTP receiver: the versions at git refs (default HEAD) against the working tree.

All receivers run in one server process on loopback. The one at each of ``--refs`` is that ref's
``collector/receivers/`` package, loaded under another name (its own modules, the working
tree's everything else), so any ref works: the http.server receiver before the move to uvicorn
(``9b42693~1``), or HEAD. Each runs behind one of two consumers:

- ``take-all``: takes everything and declares ``never_blocks`` (the working tree calls it on the
  event loop; a ref that does not know the declaration calls it on its thread pool);
- ``spool``: what the collector's pipeline does with durability on: append the export to a
  write-ahead spool (``collector/spool.py``, in a temporary directory) and wait for its fsync.
  It may block, so it always runs on a pool thread.

The working tree runs with its default HTTP parser (httptools when installed) and with h11.
Interleaved A/B, so all see the same machine state:

- latency: one kept-alive connection per receiver; each round sends one request of each kind
  to each receiver (the order reverses every round): a 200 with an empty reply, a 200 with a
  ``partial_success`` reply, a 400 (undecodable protobuf). Median and p99 per kind.
- throughput: for each ``--clients`` count, that many client processes, each with its own
  kept-alive connection, post one-span exports for ``--seconds``; rounds alternate the order.
- spool bytes: what serialising a typical 500-span export again would cost per request (the
  receivers now hand the spool the received bytes when validation changed nothing).

    python bench/otlp_http_receiver.py
    python bench/otlp_http_receiver.py --requests 500 --clients 1,8 --seconds 3 --rounds 3
    python bench/otlp_http_receiver.py --refs 9b42693~1,HEAD   # http.server, uvicorn/h11, tree
"""

from __future__ import annotations

import argparse
import http.client
import importlib
import multiprocessing as mp
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Final

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

ROOT: Final = Path(__file__).resolve().parent.parent
RECEIVERS_DIR: Final = "collector/receivers"
RECEIVERS_PACKAGE: Final = "tokentrace.collector.receivers"
PROTOBUF: Final = "application/x-protobuf"
RELEASE_EVERY: Final = 256
"""Spool appends between releases of what was appended (keeps the segment files few)."""


class _TakeAll:
    never_blocks = True

    def consume_traces(
        self, request: ExportTraceServiceRequest, *, encoded: bytes | None = None
    ) -> None:
        pass


class _Spooling:
    """Acknowledges once the export is durable, as ``Pipeline.consume_traces`` with a spool."""

    def __init__(self, directory: str) -> None:
        from tokentrace.collector.spool import Spool

        self._spool = Spool(directory, max_bytes=1 << 30, segment_bytes=8 << 20, segment_age_s=1.0)
        self._appends = 0

    def consume_traces(
        self, request: ExportTraceServiceRequest, *, encoded: bytes | None = None
    ) -> None:
        spool = self._spool
        seq = spool.append(request.SerializeToString() if encoded is None else encoded)
        try:
            spool.wait_durable(seq)
        finally:
            spool.done(seq)
        self._appends += 1
        if self._appends % RELEASE_EVERY == 0:
            spool.release(spool.lowest_unfinished())


@dataclass(frozen=True)
class Setup:
    name: str
    code: str
    """A git ref, or ``tree`` for the working tree."""
    consumer: str
    """``take-all`` or ``spool``."""
    http_parser: str | None = None
    """Working tree only; None: its default."""


def _setups(refs: list[str], default_parser: str) -> list[Setup]:
    setups = [Setup(ref, ref, "take-all") for ref in refs]
    setups.append(Setup(f"tree/{default_parser}", "tree", "take-all"))
    if default_parser != "h11":
        setups.append(Setup("tree/h11", "tree", "take-all", "h11"))
    setups += [Setup(f"{ref}+spool", ref, "spool") for ref in refs]
    setups.append(Setup(f"tree/{default_parser}+spool", "tree", "spool"))
    return setups


def _receiver_class_at(ref: str, index: int) -> Any:
    """``OtlpHttpReceiver`` from ``ref``'s receivers package, imported as its own package."""
    listing = subprocess.run(
        ["git", "ls-tree", "--name-only", f"{ref}:{RECEIVERS_DIR}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    package = f"tokentrace_bench_receivers_at_ref{index}"
    directory = Path(tempfile.mkdtemp(prefix="otlp-http-ref-")) / package
    directory.mkdir()
    for name in listing:
        if not name.endswith(".py"):
            continue
        source = subprocess.run(
            ["git", "show", f"{ref}:{RECEIVERS_DIR}/{name}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        (directory / name).write_text(source.replace(RECEIVERS_PACKAGE, package))
    sys.path.insert(0, str(directory.parent))
    return importlib.import_module(f"{package}.otlp_http").OtlpHttpReceiver


def _serve(setups: list[Setup], refs: list[str], ports: Connection, stop: Any) -> None:
    """Server process: every receiver, until ``stop`` is set."""
    from tokentrace.collector.receivers.otlp_http import OtlpHttpReceiver

    classes = {ref: _receiver_class_at(ref, index) for index, ref in enumerate(refs)}
    spool_directories: list[tempfile.TemporaryDirectory[str]] = []
    receivers = {}
    for setup in setups:
        consumer: Any = _TakeAll()
        if setup.consumer == "spool":
            spool_directories.append(tempfile.TemporaryDirectory(prefix="otlp-http-spool-"))
            consumer = _Spooling(spool_directories[-1].name)
        if setup.code != "tree":
            receivers[setup.name] = classes[setup.code](consumer, endpoint="127.0.0.1:0")
        else:
            receivers[setup.name] = OtlpHttpReceiver(
                consumer, endpoint="127.0.0.1:0", http_parser=setup.http_parser
            )
    for receiver in receivers.values():
        receiver.start()
    ports.send({name: receiver.port for name, receiver in receivers.items()})
    stop.wait()
    for receiver in receivers.values():
        receiver.shutdown(0)
    for directory in spool_directories:
        directory.cleanup()


def _request(name: str, *, invalid_spans: int = 0) -> bytes:
    request = ExportTraceServiceRequest()
    spans = request.resource_spans.add().scope_spans.add().spans
    span = spans.add(name=name, trace_id=bytes(range(1, 17)), span_id=bytes(range(1, 9)))
    span.start_time_unix_nano = 1_700_000_000_000_000_000
    span.end_time_unix_nano = 1_700_000_000_500_000_000
    for _ in range(invalid_spans):
        spans.add(name="no-ids", start_time_unix_nano=1)
    return request.SerializeToString()


CASES: Final = {
    "200 empty": (_request("ok"), 200),
    "200 partial_success": (_request("partial", invalid_spans=1), 200),
    "400 undecodable": (b"\xff\xff\xff\xff garbage", 400),
}


def _post(connection: http.client.HTTPConnection, body: bytes) -> int:
    connection.request("POST", "/v1/traces", body=body, headers={"Content-Type": PROTOBUF})
    response = connection.getresponse()
    response.read()
    return response.status


def _latency(ports: dict[str, int], requests: int) -> dict[str, dict[str, list[float]]]:
    connections = {
        name: http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        for name, port in ports.items()
    }
    samples: dict[str, dict[str, list[float]]] = {name: {c: [] for c in CASES} for name in ports}
    order = list(ports)
    for _ in range(10):  # warm-up: connections open, code paths loaded
        for name in order:
            for body, _status in CASES.values():
                _post(connections[name], body)
    for index in range(requests):
        names = order if index % 2 == 0 else order[::-1]
        for case, (body, expected) in CASES.items():
            for name in names:
                start = time.perf_counter()
                status = _post(connections[name], body)
                samples[name][case].append(time.perf_counter() - start)
                if status != expected:
                    raise SystemExit(f"{name} answered {status} to {case!r}")
    for connection in connections.values():
        connection.close()
    return samples


def _client(port: int, seconds: float, ready: Any, results: Any) -> None:
    body = CASES["200 empty"][0]
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    _post(connection, body)
    ready.wait()  # every client connected: on a loaded machine, starting one can take seconds
    done = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if _post(connection, body) == 200:
            done += 1
    connection.close()
    results.put(done)


def _throughput(port: int, clients: int, seconds: float) -> float:
    context = mp.get_context("spawn")
    results = context.Queue()
    ready = context.Barrier(clients)
    processes = [
        context.Process(target=_client, args=(port, seconds, ready, results))
        for _ in range(clients)
    ]
    for process in processes:
        process.start()
    total = sum(results.get(timeout=60) for _ in processes)
    for process in processes:
        process.join()
    return total / seconds


def _ms(values: list[float], quantile: float) -> float:
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(quantile * len(ordered)))]


def _reserialise_cost(repeats: int) -> None:
    """What handing the spool the received bytes saves: serialising the request again."""
    from tokentrace.collector.receivers.validate import sanitize
    from tokentrace.loadgen.replay.emit import to_otlp_requests
    from tokentrace.loadgen.replay.simulation import simulate

    messages = [
        message
        for message in to_otlp_requests(simulate("mixed", requests=400, seed=1), batch_spans=512)
        if sum(len(s.spans) for r in message.resource_spans for s in r.scope_spans) >= 480
    ]
    spans = [sum(len(s.spans) for r in m.resource_spans for s in r.scope_spans) for m in messages]
    sizes = [m.ByteSize() for m in messages]
    per_request = []
    for _ in range(repeats):
        for message in messages:
            parsed = ExportTraceServiceRequest.FromString(message.SerializeToString())
            sanitize(parsed)  # as in the receiver: decoded, validated, then (was) serialised
            start = time.perf_counter()
            parsed.SerializeToString()
            per_request.append(time.perf_counter() - start)
    print(
        f"spool bytes: serialising a {min(spans)}-{max(spans)}-span export again "
        f"({min(sizes) // 1000}-{max(sizes) // 1000} kB, simulated 'mixed' traffic) costs "
        f"median {statistics.median(per_request) * 1e6:,.0f} us, "
        f"p10 {_ms(per_request, 0.1) * 1000:,.0f} us, p90 {_ms(per_request, 0.9) * 1000:,.0f} us "
        f"({len(per_request)} samples); the receivers no longer pay it when nothing was rejected"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--refs", default="HEAD", help="git refs to compare, comma-separated")
    parser.add_argument("--requests", type=int, default=200, help="latency samples per kind")
    parser.add_argument("--clients", default="1,8", help="client counts, comma-separated")
    parser.add_argument("--seconds", type=float, default=2.0, help="per throughput round")
    parser.add_argument("--rounds", type=int, default=2, help="throughput rounds per receiver")
    parser.add_argument("--serialise-repeats", type=int, default=20)
    args = parser.parse_args()

    from tokentrace.collector.receivers.otlp_http import default_http_parser

    refs = args.refs.split(",")
    setups = _setups(refs, default_http_parser())
    context = mp.get_context("spawn")
    receive_ports, send_ports = context.Pipe(duplex=False)
    stop = context.Event()
    server = context.Process(target=_serve, args=(setups, refs, send_ports, stop), daemon=True)
    server.start()
    try:
        if not receive_ports.poll(60):
            raise SystemExit("the receivers did not start")
        ports: dict[str, int] = receive_ports.recv()
        names = list(ports)
        print(f"receivers: {RECEIVERS_DIR} at {', '.join(refs)}, and the working tree")
        print(f"latency, one kept-alive connection each, {args.requests} requests per kind, ms")
        samples = _latency(ports, args.requests)
        width = max(len(name) for name in names) + 2
        print(f"  {'kind':<22}{'receiver':<{width}}{'p50':>8}{'p99':>8}")
        for case in CASES:
            for name in names:
                values = samples[name][case]
                print(
                    f"  {case:<22}{name:<{width}}{_ms(values, 0.5):>8.2f}{_ms(values, 0.99):>8.2f}"
                )
        for clients in (int(count) for count in args.clients.split(",")):
            print(f"throughput, {clients} client process(es), kept-alive, 200 empty replies")
            rates: dict[str, list[float]] = {name: [] for name in names}
            for index in range(args.rounds):
                for name in names if index % 2 == 0 else names[::-1]:
                    rates[name].append(_throughput(ports[name], clients, args.seconds))
            for name in names:
                print(
                    f"  {name:<{width}}{statistics.median(rates[name]):>8,.0f} req/s  "
                    f"(rounds: {[round(rate) for rate in rates[name]]})"
                )
    finally:
        stop.set()
        server.join(10)
    _reserialise_cost(args.serialise_repeats)


if __name__ == "__main__":
    main()
