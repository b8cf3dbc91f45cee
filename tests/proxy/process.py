"""``tokentrace proxy`` as a real subprocess: shared by the tests against the stand-in engine
and against the real ``llama-server``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

_LISTENING = re.compile(r"listening on http://127\.0\.0\.1:(\d+) ")
_STOP_TIMEOUT_S = 10


def proxy_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "tokentrace.agent.cli", "proxy", *args]


def _clean_environment(extra: Mapping[str, str]) -> dict[str, str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    environment.update(extra)
    return environment


@dataclass(frozen=True)
class ProxyProcess:
    process: subprocess.Popen[str]
    port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextmanager
def proxy_process(upstream_url: str, endpoint: str, *args: str) -> Iterator[ProxyProcess]:
    """The proxy on a free loopback port (read back from its first line), exporting OTLP/gRPC
    to ``endpoint``; SIGTERM afterwards, which must stop it."""
    process = subprocess.Popen(
        proxy_command("--upstream", upstream_url, "--listen", "127.0.0.1:0", *args),
        stderr=subprocess.PIPE,
        text=True,
        env=_clean_environment(
            {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
        ),
    )
    try:
        assert process.stderr is not None
        line = process.stderr.readline()
        match = _LISTENING.search(line)
        assert match, line + process.stderr.read()
        yield ProxyProcess(process, int(match.group(1)))
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise AssertionError("the proxy did not stop on SIGTERM") from None


@dataclass(frozen=True)
class ProxyLoop:
    """A ``tests.loadgen.load_loop.LoadLoop``: the proxy is the server."""

    server: ProxyProcess
    otlp_endpoint: str
    store_path: Path
    slo_path: Path
    workdir: Path
