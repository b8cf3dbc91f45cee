"""Start and stop a real vLLM OpenAI-compatible server as a child process (demo, tests, benches).

The CPU backend needs a bounded KV cache (`VLLM_CPU_KVCACHE_SPACE`, GiB) or start-up asks for most
of the machine's memory; `--enforce-eager` skips the cold torch.compile (~35 s). The `vllm`
console script does not work with the `vllm-cpu` distribution, so the module is run directly.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SERVED_MODEL_NAME = "tiny-llama"

_DEFAULT_READY_TIMEOUT_S = 180.0
_DEFAULT_STOP_TIMEOUT_S = 30.0
_DEFAULT_MAX_MODEL_LEN = 512
_DEFAULT_LOG_TAIL_LINES = 60
_HEALTH_POLL_INTERVAL_S = 0.5
# Defaults for the child's environment; anything the caller or the outer environment sets wins.
_DEFAULT_SERVER_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
_OWN_PROCESS_GROUP: dict[str, Any] = (
    {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
)
"""``Popen`` options for a new process group in the caller's session (``process_group`` is
Python 3.11's; before it, ``setpgrp`` in the child)."""


class VllmServerError(RuntimeError):
    """The server exited or did not become healthy; the message carries its log's tail."""


@dataclass(frozen=True)
class VllmServer:
    """A running server: where to reach it, what it serves, and its process and log."""

    base_url: str
    model_dir: Path
    model_name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    started_in_s: float

    def log_tail(self, lines: int = _DEFAULT_LOG_TAIL_LINES) -> str:
        return log_tail(self.log_path, lines=lines)


def free_loopback_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago (vLLM cannot report a port-0 binding)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def log_tail(path: Path, *, lines: int = _DEFAULT_LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as error:
        return f"<no server log: {error}>"
    return "\n".join(text.splitlines()[-lines:])


def server_command(
    model_dir: Path,
    *,
    port: int,
    model_name: str = SERVED_MODEL_NAME,
    max_model_len: int = _DEFAULT_MAX_MODEL_LEN,
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
) -> list[str]:
    return [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        model_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--dtype",
        "bfloat16",
        "--enforce-eager",
        *extra_args,
    ]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def stop_server(
    process: subprocess.Popen[bytes], *, timeout_s: float = _DEFAULT_STOP_TIMEOUT_S
) -> None:
    """Stop the server gracefully, then make sure none of its processes is left.

    SIGINT goes to the API server alone: it shuts EngineCore and the worker down in order (a
    signal to the whole group makes it force-kill them). Whatever is still alive in the process
    group afterwards, or when the API server does not exit in time, is killed.
    """
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        with suppress(subprocess.TimeoutExpired):
            process.wait(timeout=timeout_s)
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10.0)


def spawn_until_healthy(
    command: Sequence[str],
    *,
    env: Mapping[str, str],
    log_path: Path,
    health_url: str,
    ready_timeout_s: float,
    name: str,
    error: type[Exception],
) -> subprocess.Popen[bytes]:
    """Start an inference server, its output into ``log_path``, in a process group of its own
    (so that ``stop_server`` reaches every process it starts), and return it once ``health_url``
    answers 200. Raises ``error`` (naming ``name``, with the log's tail) when it exits first or
    is not healthy within ``ready_timeout_s``; it is stopped then."""
    started = time.monotonic()
    with log_path.open("wb") as log:
        # A process group, not a session: Linux schedules each session as one group (autogroup),
        # and a busy engine's group on the core it is pinned to starved the load generator's
        # group there for up to 2.6 s at a time on a 2-core machine (its runqueue wait, read
        # from /proc/PID/schedstat); in one session the scheduler is fair to each process.
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, **_OWN_PROCESS_GROUP
        )
    try:
        while not _healthy(health_url):
            if process.poll() is not None:
                raise error(
                    f"{name} exited with {process.returncode} before it was ready; "
                    f"log tail ({log_path}):\n{log_tail(log_path)}"
                )
            if time.monotonic() > started + ready_timeout_s:
                raise error(
                    f"{name} not healthy after {ready_timeout_s:.0f} s; "
                    f"log tail ({log_path}):\n{log_tail(log_path)}"
                )
            time.sleep(_HEALTH_POLL_INTERVAL_S)
    except BaseException:
        stop_server(process)
        raise
    return process


@contextmanager
def running_vllm_server(
    model_dir: Path,
    *,
    log_path: Path,
    model_name: str = SERVED_MODEL_NAME,
    max_model_len: int = _DEFAULT_MAX_MODEL_LEN,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    command_prefix: Sequence[str] = (),
    ready_timeout_s: float = _DEFAULT_READY_TIMEOUT_S,
) -> Iterator[VllmServer]:
    """Start a server on a free loopback port, wait for `/health`, yield it, stop it afterwards.

    `env` adds to (and overrides) this process's environment; `command_prefix` wraps the command,
    e.g. `["tokentrace", "run", "--"]`. Raises `VllmServerError` with the log's tail if the server
    exits or is not healthy within `ready_timeout_s`.
    """
    child_env = {**_DEFAULT_SERVER_ENV, **os.environ, **(env or {})}
    port = free_loopback_port()
    command = [
        *command_prefix,
        *server_command(
            model_dir,
            port=port,
            model_name=model_name,
            max_model_len=max_model_len,
            extra_args=extra_args,
        ),
    ]
    base_url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    # Its process group also holds EngineCore and the CPU worker.
    process = spawn_until_healthy(
        command,
        env=child_env,
        log_path=log_path,
        health_url=f"{base_url}/health",
        ready_timeout_s=ready_timeout_s,
        name="vLLM server",
        error=VllmServerError,
    )
    try:
        yield VllmServer(
            base_url=base_url,
            model_dir=model_dir,
            model_name=model_name,
            process=process,
            log_path=log_path,
            started_in_s=time.monotonic() - started,
        )
    finally:
        stop_server(process)
