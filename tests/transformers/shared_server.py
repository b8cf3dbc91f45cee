"""A real ``transformers serve`` under ``tokentrace run``, tracing into an in-process collector.

The server is the project environment's own transformers (``transformers serve`` needs no
environment of its own), started as a child process with ``tokentrace run --`` in front, on the
tiny random Llama of ``tests/conftest.py``'s `tiny_model_dir`, on the CPU. It runs through
``serve_launcher.py`` (see its docstring: a CPU load without ``accelerate``).

`running_traced_loop` starts one collector (storing into a test-owned SQLite store, forwarding
every span to a test-owned OTLP receiver where the spans that are no request's, the cold start,
are read) and one server; tests find their requests by the trace ids they sent in
``traceparent``.
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.collector.upstream import UpstreamOtlp
from tests.storing_collector import storing_collector
from tokentrace.collector.service import Collector
from tokentrace.loadgen.local_vllm import (
    free_loopback_port,
    log_tail,
    spawn_until_healthy,
    stop_server,
)

LAUNCHER = Path(__file__).parent / "serve_launcher.py"
_DEFAULT_READY_TIMEOUT_S = 120.0
_STOP_TIMEOUT_S = 5.0
"""transformers 5.19's ``--continuous-batching`` server does not exit after SIGINT (its engine
thread outlives uvicorn's shutdown): it is killed after this long, not after 30 s."""
_DEFAULT_SERVER_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "DO_NOT_TRACK": "1"}
_DATA_PREFIX = "data: "
_DONE = "[DONE]"


class TransformersServeError(RuntimeError):
    """The server exited or did not become healthy; the message carries its log's tail."""


@dataclass(frozen=True)
class ServeLoop:
    """What ``tests/loadgen/load_loop.py`` needs (a ``LoadLoop``), and the server's model."""

    server: Any
    collector: Collector
    upstream: UpstreamOtlp
    store_path: Path
    slo_path: Path
    workdir: Path
    model_name: str
    process: Any
    log_path: Path

    @property
    def otlp_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.collector.grpc_port}"

    def log_tail(self) -> str:
        return log_tail(self.log_path)

    def upstream_spans(self, name: str) -> list[Any]:
        return [
            span
            for request in self.upstream.trace_requests
            for resource_spans in request.resource_spans
            for scope_spans in resource_spans.scope_spans
            for span in scope_spans.spans
            if span.name == name
        ]


@dataclass(frozen=True)
class _Server:
    base_url: str


@contextmanager
def running_traced_loop(
    model_dir: Path,
    workdir: Path,
    *,
    slo_file: str,
    service_name: str,
    preload: bool,
    extra_args: Sequence[str] = (),
    ready_timeout_s: float = _DEFAULT_READY_TIMEOUT_S,
) -> Iterator[ServeLoop]:
    """A collector and ``transformers serve`` under ``tokentrace run`` exporting to it;
    ``preload``: the model on the command line (loaded before the server listens), else the
    first request loads it."""
    with (
        UpstreamOtlp() as upstream,
        storing_collector(workdir, slo_file, forward_to=upstream.grpc_endpoint) as stored,
    ):
        collector, store_path, slo_path = stored.collector, stored.store_path, stored.slo_path
        port = free_loopback_port()
        env = {
            **_DEFAULT_SERVER_ENV,
            **os.environ,
            **stored.agent_environment(service_name=service_name),
        }
        command = [
            sys.executable, "-m", "tokentrace.agent.cli", "run", "--",
            sys.executable, str(LAUNCHER), "serve",
            *((str(model_dir),) if preload else ()),
            "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
            *extra_args,
        ]  # fmt: skip
        log_path = workdir / "server.log"
        base_url = f"http://127.0.0.1:{port}"
        process = spawn_until_healthy(
            command,
            env=env,
            log_path=log_path,
            health_url=f"{base_url}/health",
            ready_timeout_s=ready_timeout_s,
            name="transformers serve",
            error=TransformersServeError,
        )
        try:
            yield ServeLoop(
                _Server(base_url),
                collector,
                upstream,
                store_path,
                slo_path,
                workdir,
                str(model_dir),
                process,
                log_path,
            )
        finally:
            stop_server(process, timeout_s=_STOP_TIMEOUT_S)


@dataclass(frozen=True)
class Streamed:
    trace_id: str
    ttft_ns: int
    e2e_ns: int
    chunks: int


def stream_completion(
    base_url: str, *, model: str, max_tokens: int, prompt: str = "The quick brown fox"
) -> Streamed:
    """One streaming ``/v1/completions`` request with a ``traceparent`` of a new trace."""
    trace_id = secrets.token_hex(16)
    headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    first: int | None = None
    chunks = 0
    sent = time.monotonic_ns()
    with (
        httpx.Client(base_url=base_url, timeout=120.0) as http,
        http.stream("POST", "/v1/completions", json=body, headers=headers) as response,
    ):
        response.raise_for_status()
        for line in response.iter_lines():
            data = line.removeprefix(_DATA_PREFIX)
            if not line.startswith(_DATA_PREFIX) or data == _DONE:
                continue
            chunks += 1
            if first is None:
                first = time.monotonic_ns()
    end = time.monotonic_ns()
    assert first is not None, f"trace {trace_id}: the stream carried nothing"
    return Streamed(trace_id, first - sent, end - sent, chunks)
