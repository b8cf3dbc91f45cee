"""What ``tokentrace proxy`` adds to each request and each streamed chunk on loopback.

Goal (issue 18): < 1 ms p99 added latency per request (TTFT) and per chunk. A stand-in engine
(its own process, started from this file) streams ``--chunks`` SSE chunks in the llama-server
shape, ``--gap-ms`` apart, each stamped with ``time.monotonic_ns()`` just before it is written
(one clock for all processes of a Linux host). The client (this process, raw sockets, one
keep-alive connection per path) reads each chunk and takes its own reading: per-chunk latency is
receive - stamp; TTFT is the first chunk's receive - the request's send. Requests alternate
between the engine directly (A) and through the proxy (B), A/B order swapped every round, and
the proxy runs as users run it (``python -m tokentrace.agent.cli proxy``, a subprocess), tracing
on, exporting its spans to a real OTLP receiver (``tests.collector.upstream``). Printed: p50 and
p99 of each path, the difference (the proxy's added latency) and the ratio.

    python bench/proxy_overhead.py                 # 300 requests x 64 chunks per path
    python bench/proxy_overhead.py --requests 1000 --chunks 32 --gap-ms 1
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

_STAMP = re.compile(rb'"t":(\d+)')
_LISTENING = re.compile(r"listening on http://127\.0\.0\.1:(\d+) ")


# --- the stand-in engine (its own process) ------------------------------------------------------
def _serve_engine(chunks: int, gap_s: float) -> None:
    import socketserver

    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            sock = self.request
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            buf = b""
            while True:
                while b"\r\n\r\n" not in buf:
                    data = sock.recv(65536)
                    if not data:
                        return
                    buf += data
                head, buf = buf.split(b"\r\n\r\n", 1)
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(buf) < length:
                    buf += sock.recv(65536)
                buf = buf[length:]
                sock.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n"
                )
                for _ in range(chunks):
                    time.sleep(gap_s)
                    event = b'data: {"choices":[{"index":0,"delta":{"content":" x"}}],"t":%d}\n\n'
                    data = event % time.monotonic_ns()
                    sock.sendall(b"%x\r\n%s\r\n" % (len(data), data))
                final = {
                    "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
                    "timings": {"prompt_n": 8, "prompt_ms": 0.5, "predicted_n": chunks,
                                "predicted_ms": gap_s * 1e3 * (chunks - 1)},
                }  # fmt: skip
                data = b"data: " + json.dumps(final).encode() + b"\n\ndata: [DONE]\n\n"
                sock.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))

    class Server(socketserver.ThreadingTCPServer):
        daemon_threads = True

    with Server(("127.0.0.1", 0), Handler) as server:
        print(server.server_address[1], flush=True)
        server.serve_forever()


# --- the client -----------------------------------------------------------------------------------
class _Client:
    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        body = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}'
        self.request = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: "
            b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        )

    def run(self) -> tuple[int, list[int]]:
        """(TTFT, per-chunk latencies) of one streamed request, ns."""
        sock = self.sock
        sent = time.monotonic_ns()
        sock.sendall(self.request)
        first = 0
        latencies: list[int] = []
        buf = b""
        while not buf.endswith(b"0\r\n\r\n"):
            data = sock.recv(65536)
            now = time.monotonic_ns()
            if not data:
                raise RuntimeError("connection closed")
            for stamp in _STAMP.findall(data):
                latencies.append(now - int(stamp))
                if not first:
                    first = now
            buf = buf[-8:] + data
        return first - sent, latencies


def _percentile(values: Sequence[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] / 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--gap-ms", type=float, default=2.0)
    parser.add_argument(
        "--no-tracing", action="store_true", help="the proxy with TOKENTRACE_ENABLED=false"
    )
    parser.add_argument("--serve-engine", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_engine:
        _serve_engine(args.chunks, args.gap_ms / 1e3)
        return 0

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from tests.collector.upstream import UpstreamOtlp

    engine = subprocess.Popen(
        [sys.executable, __file__, "--serve-engine", "--chunks", str(args.chunks),
         "--gap-ms", str(args.gap_ms)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert engine.stdout is not None
    engine_port = int(engine.stdout.readline())
    with UpstreamOtlp() as otlp:
        environment = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        environment["OTEL_EXPORTER_OTLP_ENDPOINT"] = otlp.grpc_endpoint
        environment["OTEL_EXPORTER_OTLP_PROTOCOL"] = "grpc"
        if args.no_tracing:
            environment["TOKENTRACE_ENABLED"] = "false"
        log = tempfile.NamedTemporaryFile("w+", prefix="proxy-bench-", suffix=".log")  # noqa: SIM115
        proxy = subprocess.Popen(
            [sys.executable, "-m", "tokentrace.agent.cli", "proxy", "--upstream",
             f"http://127.0.0.1:{engine_port}", "--listen", "127.0.0.1:0"],
            stderr=log, text=True, env=environment,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 30
            while not (match := _LISTENING.search(Path(log.name).read_text())):
                assert time.monotonic() < deadline and proxy.poll() is None, "no proxy"
                time.sleep(0.05)
            clients = {"direct": _Client(engine_port), "proxy": _Client(int(match.group(1)))}
            ttft: dict[str, list[int]] = {"direct": [], "proxy": []}
            chunk: dict[str, list[int]] = {"direct": [], "proxy": []}
            for _ in range(10):  # warm-up: connections, the proxy's first requests
                for client in clients.values():
                    client.run()
            for index in range(args.requests):
                order = ("direct", "proxy") if index % 2 else ("proxy", "direct")
                for name in order:
                    first, latencies = clients[name].run()
                    ttft[name].append(first)
                    chunk[name].extend(latencies)
            spans = otlp.span_count()
        finally:
            proxy.send_signal(signal.SIGTERM)
            proxy.wait(10)
            output = Path(log.name).read_text().splitlines()[1:]
            if output:
                print("proxy's log:", *output[-5:], sep="\n  ")
            engine.kill()
            engine.wait()
    print(
        f"{args.requests} requests per path, {args.chunks} chunks each, {args.gap_ms} ms apart; "
        f"proxy {'untraced' if args.no_tracing else 'traced'}, {spans} spans received"
    )
    print(f"{'(ms)':<16}{'direct':>9}{'proxy':>9}{'added':>9}{'ratio':>8}")
    for label, values in (("TTFT", ttft), ("per chunk", chunk)):
        for q, name in ((0.5, "p50"), (0.99, "p99")):
            direct = _percentile(values["direct"], q)
            proxied = _percentile(values["proxy"], q)
            print(
                f"{label + ' ' + name:<16}{direct:>9.3f}{proxied:>9.3f}{proxied - direct:>9.3f}"
                f"{proxied / direct:>8.2f}"
            )
    added = statistics.fmean(ttft["proxy"]) - statistics.fmean(ttft["direct"])
    print(f"mean TTFT added {added / 1e6:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
