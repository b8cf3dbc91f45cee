"""The OTLP/HTTP receiver: the standard library's http.server (old) against uvicorn (new).

Both receivers run in one server process on loopback behind a consumer that takes everything;
the old one is the module at ``--old-ref`` (``git show REF:collector/receivers/otlp_http.py``,
loaded as a temporary module). Interleaved A/B, so both see the same machine state:

- latency: one kept-alive connection per receiver; each round sends one request of each kind
  to each receiver (which receiver goes first alternates): a 200 with an empty reply, a 200
  with a ``partial_success`` reply, a 400 (undecodable protobuf). Median and p99 per kind.
- throughput: ``--clients`` client processes, each with its own kept-alive connection, post
  one-span exports for ``--seconds``; rounds alternate between the receivers.

    python bench/otlp_http_receiver.py
    python bench/otlp_http_receiver.py --requests 500 --clients 8 --seconds 3 --rounds 3
    python bench/otlp_http_receiver.py --old-ref <commit before the uvicorn receiver>
"""

from __future__ import annotations

import argparse
import http.client
import importlib.util
import multiprocessing as mp
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Final

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

ROOT: Final = Path(__file__).resolve().parent.parent
RECEIVER_PATH: Final = "collector/receivers/otlp_http.py"
PROTOBUF: Final = "application/x-protobuf"


class _TakeAll:
    def consume_traces(self, request: ExportTraceServiceRequest) -> None:
        pass


def _old_receiver_class(ref: str) -> Any:
    source = subprocess.run(
        ["git", "show", f"{ref}:{RECEIVER_PATH}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    if "http.server" not in source:
        raise SystemExit(f"{ref}:{RECEIVER_PATH} is not the http.server receiver: pass --old-ref")
    path = Path(tempfile.mkdtemp(prefix="otlp-http-old-")) / "otlp_http_old.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("tokentrace_bench_otlp_http_old", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.OtlpHttpReceiver


def _serve(old_ref: str, ports: Connection, stop: Any) -> None:
    """Server process: both receivers, until ``stop`` is set."""
    from tokentrace.collector.receivers.otlp_http import OtlpHttpReceiver

    receivers = {
        "old": _old_receiver_class(old_ref)(_TakeAll(), endpoint="127.0.0.1:0"),
        "new": OtlpHttpReceiver(_TakeAll(), endpoint="127.0.0.1:0"),
    }
    for receiver in receivers.values():
        receiver.start()
    ports.send({name: receiver.port for name, receiver in receivers.items()})
    stop.wait()
    for receiver in receivers.values():
        receiver.shutdown(0)


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


def _client(port: int, seconds: float, start_at: float, results: Any) -> None:
    body = CASES["200 empty"][0]
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    _post(connection, body)
    while time.monotonic() < start_at:
        time.sleep(0.001)
    done = 0
    deadline = start_at + seconds
    while time.monotonic() < deadline:
        if _post(connection, body) == 200:
            done += 1
    connection.close()
    results.put(done)


def _throughput(port: int, clients: int, seconds: float) -> float:
    context = mp.get_context("spawn")
    results = context.Queue()
    start_at = time.monotonic() + 1.5  # spawned interpreters need a moment to start
    processes = [
        context.Process(target=_client, args=(port, seconds, start_at, results))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old-ref", default="HEAD", help="git ref of the http.server receiver")
    parser.add_argument("--requests", type=int, default=200, help="latency samples per kind")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=2.0, help="per throughput round")
    parser.add_argument("--rounds", type=int, default=2, help="throughput rounds per receiver")
    args = parser.parse_args()

    context = mp.get_context("spawn")
    receive_ports, send_ports = context.Pipe(duplex=False)
    stop = context.Event()
    server = context.Process(target=_serve, args=(args.old_ref, send_ports, stop), daemon=True)
    server.start()
    try:
        if not receive_ports.poll(30):
            raise SystemExit("the receivers did not start")
        ports: dict[str, int] = receive_ports.recv()
        print(f"old: {RECEIVER_PATH} at {args.old_ref} (http.server); new: working tree (uvicorn)")
        print(f"latency, one kept-alive connection each, {args.requests} requests per kind")
        samples = _latency(ports, args.requests)
        print(f"  {'kind':<22}{'old p50':>10}{'new p50':>10}{'old p99':>10}{'new p99':>10}"
              f"{'p50 old/new':>13}")  # fmt: skip
        for case in CASES:
            old, new = samples["old"][case], samples["new"][case]
            print(
                f"  {case:<22}{_ms(old, 0.5):>8.2f}ms{_ms(new, 0.5):>8.2f}ms"
                f"{_ms(old, 0.99):>8.2f}ms{_ms(new, 0.99):>8.2f}ms"
                f"{statistics.median(old) / statistics.median(new):>12.1f}x"
            )
        print(f"throughput, {args.clients} client processes, kept-alive, 200 empty replies")
        rates: dict[str, list[float]] = {"old": [], "new": []}
        for index in range(args.rounds):
            for name in ("old", "new") if index % 2 == 0 else ("new", "old"):
                rates[name].append(_throughput(ports[name], args.clients, args.seconds))
        old_rate, new_rate = statistics.median(rates["old"]), statistics.median(rates["new"])
        print(
            f"  old {old_rate:,.0f} req/s  new {new_rate:,.0f} req/s  "
            f"new/old {new_rate / old_rate:.2f}x  (rounds: old {[round(r) for r in rates['old']]}, "
            f"new {[round(r) for r in rates['new']]})"
        )
    finally:
        stop.set()
        server.join(10)


if __name__ == "__main__":
    main()
