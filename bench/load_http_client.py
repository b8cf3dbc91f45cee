"""What the load generator's HTTP client costs in timing accuracy: the hand-written client
(``loadgen/http.py``) against httpx and aiohttp doing the same job.

A server in a second process (raw asyncio, uvloop when installed) streams ``--events``
server-sent events per request, one every ``--interval-ms`` on a grid shared by all streams (as
a batched decode step gives every running request its token at once), each in its own chunk of
the chunked transfer coding like vLLM's. It stamps each event and the response head with its
own ``time.monotonic_ns()`` just before writing them, and the moment it had the whole request
(same machine, same clock). Each client runs ``--concurrency`` streams, each sending
``--requests`` requests in turn over its keep-alive connection, and records the timing contract
``tokentrace load`` needs: when the request was handed to the socket, the clock reading of the
socket read that delivered the response's first byte and each event, whether the connection was
reused and how long opening it took, TCP_INFO at the first token and at the body's end; the
consumer decodes each event's JSON as the load runner does.

- hand-written: ``HttpClient.post`` + ``Response.events``.
- httpx: ``AsyncClient.send(stream=True)``; send time and first byte from httpcore's ``trace``
  extension, each chunk of ``aiter_raw`` stamped as it comes (nothing suspends between
  httpcore's socket read and that yield), the socket from the ``network_stream`` extension.
- aiohttp: ``ClientSession.post`` with a ``TraceConfig`` for the send time, reuse and connect
  timing; first byte when the head is parsed, each ``content.iter_any()`` chunk stamped.

Both split events with the hand-written client's algorithm. Per client and concurrency,
interleaved in every round (clients in rotating order) so that the machine's noise falls on all
alike (µs):

- event / 1st byte: read time minus the server's send stamp (median, p99): a client that needs
  more CPU per event is late to read at high concurrency, and that lateness is measurement error;
- send: the server had the request minus the caller asked for it (kept-alive connections only);
- sent-stamp: the server had the request minus the send time the client recorded (the load
  runner's wait-to-send and the collector's network segment rest on it);
- cpu/request, cpu/event: the client process's CPU time.

Printed: absolutes, then each maintained client's ratio to the hand-written one.

    python bench/load_http_client.py                  # ~1 min on an idle machine
    python bench/load_http_client.py --rounds 10 --concurrency 1,16,64,128   # ~5 min
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

try:
    import aiohttp
except ImportError:  # vLLM brings it into the project's venv; no extra of ours does
    aiohttp = None

from tokentrace.agent.tcp_info import read_tcp_info
from tokentrace.loadgen.http import HttpClient

_PATH = "/v1/completions"
_NS_PER_US = 1_000
_CLOCK = time.monotonic_ns


# --- the server (its own process) ----------------------------------------------------------------
def _event(index: int) -> bytes:
    # About the size of a vLLM completions chunk; the stamp is taken right before the write.
    return (
        b'data: {"id":"cmpl-4f1e9c0b2a7d4e6f8a1b2c3d4e5f6a7b","object":"text_completion",'
        b'"created":1767225600,"model":"bench-model","choices":[{"index":0,"text":" token%d",'
        b'"logprobs":null,"finish_reason":null,"stop_reason":null}],"usage":null,'
        b'"sent_ns":%d}\n\n' % (index, _CLOCK())
    )


async def _serve_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            params = json.loads(await reader.readexactly(length))
            start = _CLOCK()  # the whole request is in
            events, interval_ns = params["events"], params["interval_ns"]
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\nX-Received-Ns: %d\r\nX-Sent-Ns: %d\r\n\r\n"
                % (start, _CLOCK())
            )
            # On a grid shared by every stream, as an engine step gives each running request its
            # next token at once: every client meets the same bursts, whenever it sent.
            first_due_ns = (start // interval_ns + 1) * interval_ns
            for index in range(events):
                delay_ns = first_due_ns + index * interval_ns - _CLOCK()
                if delay_ns > 0:
                    await asyncio.sleep(delay_ns / 1e9)
                event = _event(index)
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            writer.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def _serve() -> None:
    server = await asyncio.start_server(_serve_connection, "127.0.0.1", 0, backlog=1024)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()


def _run_server() -> None:
    try:
        import uvloop  # the server's own CPU is not what is measured: keep it small
    except ImportError:
        asyncio.run(_serve())
    else:
        uvloop.run(_serve())


# --- SSE decoding shared by the httpx and aiohttp clients ----------------------------------------
class _SseDecoder:
    """The hand-written client's event splitting (``Response.events``), for the clients that
    hand over raw body chunks."""

    __slots__ = ("_carry_cr", "_pending", "_scan_from")

    def __init__(self) -> None:
        self._pending = bytearray()
        self._scan_from = 0
        self._carry_cr = False

    def feed(self, piece: bytes) -> list[str]:
        if self._carry_cr:
            piece = b"\r" + piece
            self._carry_cr = False
        if piece.endswith(b"\r"):
            piece = piece[:-1]
            self._carry_cr = True
        if b"\r" in piece:
            piece = piece.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        pending = self._pending
        pending += piece
        out = []
        scan_from = self._scan_from
        while (end := pending.find(b"\n\n", scan_from)) >= 0:
            block = pending[:end]
            del pending[: end + 2]
            scan_from = 0
            if block.startswith(b"data:"):
                value = block[5:]
                out.append((value[1:] if value.startswith(b" ") else value).decode())
        self._scan_from = max(0, len(pending) - 1)
        return out


# --- the clients ---------------------------------------------------------------------------------
@dataclass(slots=True)
class _Timing:
    issued_ns: int
    """When the caller asked for the request."""
    sent_ns: int
    """When the client says it handed the request to the socket."""
    received_ns: int
    """When the server had read the whole request."""
    first_byte_error_ns: int
    event_errors_ns: list[int]


def _timing(issued_ns: int, sent_ns: int, first_byte_ns: int, headers: Any) -> _Timing:
    received_ns = int(headers["x-received-ns"])
    first_byte_error = first_byte_ns - int(headers["x-sent-ns"])
    return _Timing(issued_ns, sent_ns, received_ns, first_byte_error, [])


class _Client(Protocol):
    name: str

    async def request(self, body: bytes) -> _Timing: ...

    async def aclose(self) -> None: ...


def _consume(data: str, read_ns: int, errors: list[int]) -> None:
    """What the load runner does with each event: decode it (here: and score its read time)."""
    if data != "[DONE]":
        errors.append(read_ns - json.loads(data)["sent_ns"])


class _HandWritten:
    name = "hand-written"

    def __init__(self, url: str) -> None:
        self._client = HttpClient(url)

    async def request(self, body: bytes) -> _Timing:
        issued = _CLOCK()
        async with await self._client.post(_PATH, body) as response:
            timing = _timing(issued, response.sent_ns, response.first_byte_ns, response.headers)
            errors = timing.event_errors_ns
            async for read_ns, data in response.events():
                if not errors:
                    response.tcp_facts()
                _consume(data, read_ns, errors)
        return timing

    async def aclose(self) -> None:
        await self._client.aclose()


_HTTPX_STAMPS = (
    "http11.send_request_headers.started",
    "http11.receive_response_headers.complete",
)


class _Httpx:
    name = "httpx"

    def __init__(self, url: str) -> None:
        self._client = httpx.AsyncClient(
            base_url=url,
            timeout=600.0,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=1024),
            headers={"User-Agent": "tokentrace-load", "Content-Type": "application/json"},
        )

    async def request(self, body: bytes) -> _Timing:
        issued = _CLOCK()
        stamps: dict[str, int] = {}

        async def trace(name: str, info: dict[str, Any]) -> None:
            if name in _HTTPX_STAMPS:
                stamps[name] = _CLOCK()

        request = self._client.build_request(
            "POST", _PATH, content=body, extensions={"trace": trace}
        )
        response = await self._client.send(request, stream=True)
        try:
            sent, first_byte = (stamps[name] for name in _HTTPX_STAMPS)
            timing = _timing(issued, sent, first_byte, response.headers)
            errors = timing.event_errors_ns
            sock = response.extensions["network_stream"].get_extra_info("socket")
            decoder = _SseDecoder()
            async for piece in response.aiter_raw():
                read_ns = _CLOCK()
                for data in decoder.feed(piece):
                    if not errors:
                        read_tcp_info(sock)
                    _consume(data, read_ns, errors)
            read_tcp_info(sock)
        finally:
            await response.aclose()
        return timing

    async def aclose(self) -> None:
        await self._client.aclose()


async def _stamp(name: str, context: Any) -> None:
    context.trace_request_ctx[name] = _CLOCK()


def _aiohttp_trace() -> aiohttp.TraceConfig:
    """The hooks that give aiohttp's requests the facts besides the body's timing: when the
    request was sent, whether its connection was reused, how long opening one took."""
    config = aiohttp.TraceConfig()
    for name in ("request_headers_sent", "connection_create_start", "connection_create_end"):
        getattr(config, f"on_{name}").append(
            lambda _session, context, _params, name=name: _stamp(name, context)
        )
    config.on_connection_reuseconn.append(
        lambda _session, context, _params: _stamp("reused", context)
    )
    return config


class _Aiohttp:
    name = "aiohttp"

    def __init__(self, url: str) -> None:
        self._url = url + _PATH
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=600.0),
            headers={"User-Agent": "tokentrace-load", "Content-Type": "application/json"},
            trace_configs=[_aiohttp_trace()],
            auto_decompress=False,
        )

    async def request(self, body: bytes) -> _Timing:
        issued = _CLOCK()
        stamps: dict[str, int] = {}
        async with self._session.post(self._url, data=body, trace_request_ctx=stamps) as response:
            timing = _timing(issued, stamps["request_headers_sent"], _CLOCK(), response.headers)
            errors = timing.event_errors_ns
            transport = response.connection.transport if response.connection else None
            sock = transport.get_extra_info("socket") if transport else None
            decoder = _SseDecoder()
            async for piece in response.content.iter_any():
                read_ns = _CLOCK()
                for data in decoder.feed(piece):
                    if not errors:
                        read_tcp_info(sock)
                    _consume(data, read_ns, errors)
            read_tcp_info(sock)
        return timing

    async def aclose(self) -> None:
        await self._session.close()


_CLIENTS: dict[str, Callable[[str], _Client]] = {"hand-written": _HandWritten, "httpx": _Httpx}
if aiohttp is not None:
    _CLIENTS["aiohttp"] = _Aiohttp


# --- measuring -----------------------------------------------------------------------------------
@dataclass
class _Cell:
    """Everything measured for one client at one concurrency, pooled over rounds."""

    event_errors_ns: list[int] = field(default_factory=list)
    first_byte_errors_ns: list[int] = field(default_factory=list)
    send_delays_ns: list[int] = field(default_factory=list)
    sent_stamp_errors_ns: list[int] = field(default_factory=list)
    cpu_per_request_ns: list[float] = field(default_factory=list)
    cpu_per_event_ns: list[float] = field(default_factory=list)

    def add(self, timings: list[_Timing], reused: list[_Timing], cpu_ns: float) -> None:
        events = 0
        for timing in timings:
            self.event_errors_ns.extend(timing.event_errors_ns)
            self.first_byte_errors_ns.append(timing.first_byte_error_ns)
            self.sent_stamp_errors_ns.append(timing.received_ns - timing.sent_ns)
            events += len(timing.event_errors_ns)
        # Only over kept-alive connections: a fresh one's delay is mostly the handshake.
        self.send_delays_ns.extend(timing.received_ns - timing.issued_ns for timing in reused)
        self.cpu_per_request_ns.append(cpu_ns / len(timings))
        self.cpu_per_event_ns.append(cpu_ns / events)


async def _measure(
    make: Callable[[str], _Client], url: str, concurrency: int, requests: int, body: bytes
) -> tuple[list[_Timing], list[_Timing], float]:
    """(every request's timing, those of requests on a reused connection, CPU ns)."""
    client = make(url)
    try:
        cpu_start = time.process_time_ns()

        async def stream() -> list[_Timing]:
            return [await client.request(body) for _ in range(requests)]

        streams = await asyncio.gather(*(stream() for _ in range(concurrency)))
        cpu_ns = time.process_time_ns() - cpu_start
    finally:
        await client.aclose()
    every = [timing for per_stream in streams for timing in per_stream]
    return every, [timing for per_stream in streams for timing in per_stream[1:]], cpu_ns


def _percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


_COLUMNS = {
    "event p50": lambda cell: statistics.median(cell.event_errors_ns),
    "event p99": lambda cell: _percentile(cell.event_errors_ns, 0.99),
    "1st byte p50": lambda cell: statistics.median(cell.first_byte_errors_ns),
    "1st byte p99": lambda cell: _percentile(cell.first_byte_errors_ns, 0.99),
    "send p50": lambda cell: statistics.median(cell.send_delays_ns),
    "send p99": lambda cell: _percentile(cell.send_delays_ns, 0.99),
    "sent-stamp p50": lambda cell: statistics.median(cell.sent_stamp_errors_ns),
    "cpu/request": lambda cell: statistics.median(cell.cpu_per_request_ns),
    "cpu/event": lambda cell: statistics.median(cell.cpu_per_event_ns),
}


async def _bench(args: argparse.Namespace, url: str) -> dict[tuple[str, int], _Cell]:
    names = args.clients.split(",")
    body = json.dumps({"events": args.events, "interval_ns": int(args.interval_ms * 1e6)}).encode()
    cells = {(name, c): _Cell() for name in names for c in args.concurrency}
    for name in names:  # warm up: imports, first connections, the server's code paths
        await _measure(_CLIENTS[name], url, 4, 1, body)
    for round_index in range(args.rounds):
        for concurrency in args.concurrency:
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                timings, reused, cpu_ns = await _measure(
                    _CLIENTS[name], url, concurrency, args.requests, body
                )
                received = sum(len(timing.event_errors_ns) for timing in timings)
                assert received == len(timings) * args.events, f"{name} lost events"
                cells[name, concurrency].add(timings, reused, cpu_ns)
        print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    return cells


def _row(name: str, concurrency: int, values: list[float], digits: int) -> str:
    return f"{name:<13}{concurrency:>8}" + "".join(f"{v:>15.{digits}f}" for v in values)


def _report(args: argparse.Namespace, cells: dict[tuple[str, int], _Cell]) -> None:
    names = args.clients.split(",")
    header = f"{'client':<13}{'streams':>8}" + "".join(f"{c:>15}" for c in _COLUMNS)
    print(
        f"{args.events} events/request every {args.interval_ms:g} ms, {args.requests} requests"
        f" per stream, {args.rounds} rounds. µs; event / 1st byte: client read time - server"
        " send stamp; send: server has the request - client issued it (kept-alive connections);"
        " sent-stamp: server has the request - client's recorded send time\n"
    )
    print(header)
    table = {
        key: [column(cell) / _NS_PER_US for column in _COLUMNS.values()]
        for key, cell in cells.items()
    }
    for concurrency in args.concurrency:
        for name in names:
            print(_row(name, concurrency, table[name, concurrency], 1))
    if "hand-written" not in names:
        return
    print(f"\nratio to hand-written\n{header}")
    for concurrency in args.concurrency:
        base = table["hand-written", concurrency]
        for name in names:
            if name != "hand-written":
                row = table[name, concurrency]
                print(
                    _row(
                        name,
                        concurrency,
                        [a / b if b else float("nan") for a, b in zip(row, base, strict=True)],
                        2,
                    )
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument(
        "--concurrency",
        type=lambda text: [int(part) for part in text.split(",")],
        default=[1, 16, 64],
        help="comma-separated stream counts (default 1,16,64)",
    )
    parser.add_argument("--events", type=int, default=32, help="events per request")
    parser.add_argument("--interval-ms", type=float, default=10.0, help="gap between events")
    parser.add_argument("--requests", type=int, default=2, help="requests per stream")
    parser.add_argument("--clients", default=",".join(_CLIENTS))
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        _run_server()
        return
    server = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None
        url = f"http://127.0.0.1:{int(server.stdout.readline())}"
        cells = asyncio.run(_bench(args, url))
    finally:
        server.terminate()
        server.wait()
    _report(args, cells)


if __name__ == "__main__":
    main()
