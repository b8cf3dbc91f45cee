"""A real ``tokentrace collector`` process, for the tests that need one (a SIGKILL, its resident
memory, an engine exporting to it from another process): started on a config file, its output
appended to a log file, its gRPC port read back from the line it prints once it listens
(``GRPC_LISTENING_LINE``, after any spool replay); stopped with SIGTERM, so it stores what it
holds. Nothing is exported upstream that its config does not name: the ``OTEL_*`` variables of
the test run are not passed on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from tokentrace.collector.service import GRPC_LISTENING_LINE

_DEFAULT_START_TIMEOUT_S: Final = 30.0
_DEFAULT_STOP_TIMEOUT_S: Final = 30.0
_POLL_S: Final = 0.05


@dataclass(frozen=True)
class CollectorProcess:
    process: subprocess.Popen[bytes]
    grpc_port: int
    log_path: Path
    log_offset: int
    """Where this process's output starts in ``log_path`` (a restart appends to the same file)."""

    @property
    def output(self) -> str:
        return self.log_path.read_bytes()[self.log_offset :].decode(errors="replace")

    def kill(self) -> None:
        """SIGKILL: nothing flushed, nothing stored on the way out."""
        self.process.kill()
        self.process.wait()

    def stop(self, *, timeout_s: float = _DEFAULT_STOP_TIMEOUT_S) -> int:
        """SIGTERM, and its exit status once it finished its pending traces; killed, and an
        AssertionError, past ``timeout_s``."""
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the collector did not stop in {timeout_s:.0f} s") from None


def start_collector_process(
    config: Path,
    log_path: Path,
    *,
    env: Mapping[str, str] | None = None,
    timeout_s: float = _DEFAULT_START_TIMEOUT_S,
) -> CollectorProcess:
    """``tokentrace collector --config config``; returns once its gRPC receiver listens."""
    offset = log_path.stat().st_size if log_path.exists() else 0
    environment = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    environment.update(env or {})
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "tokentrace.agent.cli", "collector", "--config", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=environment,
        )
    deadline = time.monotonic() + timeout_s
    while True:
        output = log_path.read_bytes()[offset:].decode(errors="replace")
        if match := GRPC_LISTENING_LINE.search(output):
            return CollectorProcess(process, int(match.group(2)), log_path, offset)
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            process.wait()
            raise AssertionError(f"the collector process did not start:\n{output[-3000:]}")
        time.sleep(_POLL_S)


@contextmanager
def running_collector_process(
    config: Path, log_path: Path, *, env: Mapping[str, str] | None = None
) -> Iterator[CollectorProcess]:
    """``start_collector_process``, stopped (SIGTERM) afterwards unless the test ended it."""
    collector = start_collector_process(config, log_path, env=env)
    try:
        yield collector
    finally:
        if collector.process.poll() is None:
            collector.stop()
